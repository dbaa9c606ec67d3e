//! Using a trained model on new text: labels, tags, mask fills and sentence vectors.

use candle::{DType, Device, IndexOp, Tensor, D};

use crate::config::ModelConfig;
use crate::data::{keep_ends, pad_batch};
use crate::error::{Error, Result};
use crate::limits::Limits;
use crate::model::TaskModel;
use crate::positional::RopeScaling;
use crate::positional::{random_positions, Positions};
use crate::rng::{self, derive_seed, stable_hash};
use crate::saved::Loaded;
use crate::tasks::Objective;

use crate::prediction::top_fills;
pub use crate::prediction::{Embedding, MaskFill, Output, Prediction, Scored};

/// Texts per forward pass.
const BATCH: usize = 32;

/// A text's tokens and words, ready for a batch.
struct Prepared {
    ids: Vec<u32>,
    /// Tokens that are the unknown token.
    unknown: usize,
    /// Word index of each token (after a `[CLS]`, if any).
    word_ids: Vec<Option<u32>>,
    words: Vec<String>,
    note: Option<String>,
}

/// Inference on a loaded model.
pub struct Predictor<'a> {
    loaded: &'a Loaded,
    truncate: bool,
    rope_scaling: Option<RopeScaling>,
    limits: Limits,
    meter: Option<&'a crate::progress::Meter>,
}

impl<'a> Predictor<'a> {
    /// With `truncate`, texts longer than a learned table are cut to fit (and say so);
    /// without, they are an error.
    pub fn new(loaded: &'a Loaded, truncate: bool) -> Self {
        Self {
            loaded,
            truncate,
            rope_scaling: None,
            limits: Limits::default(),
            meter: None,
        }
    }

    /// Says on `meter` which batch runs, what it holds, and the time left (see
    /// [`crate::progress::with_meter`]).
    pub fn with_meter(mut self, meter: &'a crate::progress::Meter) -> Self {
        self.meter = Some(meter);
        self
    }

    /// Reads texts within `limits` (by default [`Limits::default`]): a text whose attention
    /// would not fit is refused, and batches are cut to fit.
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Reads texts with a `rope` model's frequencies rescaled (to read past its training
    /// length): `factor = "auto"` is the longest text over the model's `max_len` (its training's
    /// longest input), at least 1; `original_max_len` defaults to `max_len`.
    pub fn with_rope_scaling(mut self, scaling: Option<RopeScaling>) -> Result<Self> {
        if let Some(s) = &scaling {
            let positional = &self.loaded.config.model.positional;
            if !positional.rescales() {
                return Err(Error::Input(format!(
                    "--rope-scaling {}: this model's scheme is `{}`; scaling applies to rope \
                     models only",
                    s.label(),
                    positional.name()
                )));
            }
        }
        self.rope_scaling = scaling;
        Ok(self)
    }

    /// The model to read `prepared` with: the loaded one, or the same weights with RoPE's
    /// frequencies rescaled.
    fn model_for(&self, prepared: &[Prepared]) -> Result<Option<TaskModel>> {
        let Some(scaling) = &self.rope_scaling else {
            return Ok(None);
        };
        let trained = self.loaded.config.model.max_len.max(1);
        let longest = prepared.iter().map(|p| p.ids.len()).max().unwrap_or(1);
        let scaling = scaling.resolved(longest as f64 / trained as f64, trained);
        let Some(positional) = self
            .loaded
            .config
            .model
            .positional
            .with_scaling(Some(scaling))
        else {
            return Ok(None);
        };
        let config = ModelConfig {
            positional,
            ..self.loaded.config.model.clone()
        };
        let encoder = self.loaded.model.encoder();
        let vb = self
            .loaded
            .params
            .var_builder(encoder.dtype(), encoder.device());
        let model = TaskModel::new(&config, &self.loaded.config.head, vb)?;
        Ok(Some(model.with_backend(encoder.backend())))
    }

    fn device(&self) -> &Device {
        self.loaded.model.encoder().device()
    }

    fn prepare(&self, index: usize, text: &str) -> Result<Prepared> {
        let encoder = self.loaded.model.encoder();
        // The tightest of: a learned table's rows, randomized positions' range, and the
        // longest text whose attention fits the memory limit.
        let memory =
            self.limits
                .longest_fitting(&encoder.config().sizes_on(encoder.compute()), 1, false);
        let limit = [
            encoder
                .max_positions()
                .map(|rows| (rows, "learned position table holds")),
            encoder
                .config()
                .random_positions
                .map(|n| (n, "randomized positions are drawn from [0, N) with N =")),
            Some((
                memory,
                "attention (quadratic in the length) fits the memory limit (POSLAB_MAX_MEMORY) up to",
            )),
        ]
        .into_iter()
        .flatten()
        .min_by_key(|(rows, _)| *rows);
        // Every word is at least one token: words far past the limit are never read, so a
        // 100 MB line costs about what the model can take (a text of up to 65,536 words is
        // read whole, for an exact count in the message).
        let cap = limit.map_or(usize::MAX, |(rows, _)| rows.saturating_add(1).max(1 << 16));
        let total_words = text.split_whitespace().count();
        let words: Vec<String> = text
            .split_whitespace()
            .take(cap)
            .map(String::from)
            .collect();
        if words.is_empty() {
            return Err(Error::Input(format!("text {}: empty", index + 1)));
        }
        // As the model was trained: a [CLS] first for first-token pooling, the tokenizer's
        // template for a fine-tuned pretrained encoder.
        let framing = self.loaded.config.framing(&self.loaded.tokenizer)?;
        let enc = framing.encode(&self.loaded.tokenizer, &words)?;
        let (mut ids, mut word_ids) = (enc.ids, enc.word_ids);
        let tokens = if total_words > words.len() {
            format!("more than {}", ids.len())
        } else {
            ids.len().to_string()
        };
        let mut note = None;
        if let Some((rows, what)) = limit {
            if ids.len() > rows {
                if !self.truncate {
                    return Err(Error::Input(format!(
                        "text {}: {tokens} tokens, but the model's {what} {rows}: pass --truncate \
                         to keep the first {rows}, or shorten the text",
                        index + 1,
                    )));
                }
                note = Some(format!("cut to the first {rows} of {tokens} tokens"));
                // The template's closing tokens ([SEP]) stay at the end.
                let (_, back) = framing.around();
                keep_ends(&mut ids, rows, back);
                keep_ends(&mut word_ids, rows, back);
            }
        }
        let unknown = match self.loaded.tokenizer.unk_id() {
            Some(unk) => ids.iter().filter(|&&id| id == unk).count(),
            None => 0,
        };
        Ok(Prepared {
            ids,
            unknown,
            word_ids,
            words,
            note,
        })
    }

    /// The tokens' positions in a batch of `chunk`, padded to `t`: `0..t`, or for a model
    /// trained with randomized positions, drawn the way it was tested (Ruoss et al.'s
    /// protocol), from a generator seeded by the model's seed and the text's tokens, so a text
    /// gets the same positions (and the same answer) whatever else is in the batch.
    fn positions(&self, chunk: &[Prepared], t: usize) -> Result<Positions> {
        let Some(n) = self.loaded.model.encoder().config().random_positions else {
            return Positions::range(0, t);
        };
        let rows = chunk
            .iter()
            .map(|p| {
                let bytes: Vec<u8> = p.ids.iter().flat_map(|id| id.to_le_bytes()).collect();
                let seed = derive_seed(
                    self.loaded.config.seed,
                    "predict positions",
                    stable_hash(&bytes),
                );
                let mut row = random_positions(p.ids.len(), n, &mut rng::stream(seed, "text"))?;
                let last = row.last().copied().unwrap_or(0);
                row.resize(t, last);
                Ok(row)
            })
            .collect::<Result<Vec<_>>>()?;
        Positions::from_rows(&rows)
    }

    /// Runs `f` on the model and batches of `texts`.
    fn batched<T>(
        &self,
        texts: &[String],
        mut f: impl FnMut(&TaskModel, &[Prepared], &Tensor, &Tensor, &Positions) -> Result<Vec<T>>,
    ) -> Result<Vec<Output<T>>> {
        let prepared = texts
            .iter()
            .enumerate()
            .map(|(i, t)| self.prepare(i, t))
            .collect::<Result<Vec<_>>>()?;
        let scaled = self.model_for(&prepared)?;
        let model = scaled.as_ref().unwrap_or(&self.loaded.model);
        let mut out = Vec::with_capacity(texts.len());
        // Batches of at most BATCH texts whose padded length fits the memory limit.
        let encoder = model.encoder();
        let sizes = encoder.config().sizes_on(encoder.compute());
        let mut bounds = vec![0];
        let mut longest = 0;
        for (i, p) in prepared.iter().enumerate() {
            let start = *bounds.last().expect("bounds start at 0");
            let grown = longest.max(p.ids.len());
            let size = i - start + 1;
            if size > BATCH
                || self
                    .limits
                    .check_batch(&sizes, size, grown, false, "")
                    .is_err()
            {
                bounds.push(i);
                longest = p.ids.len();
            } else {
                longest = grown;
            }
        }
        bounds.push(prepared.len());
        let ranges: Vec<&[usize]> = bounds.windows(2).filter(|w| w[0] < w[1]).collect();
        // A batch's cost: its padded tokens times a layer's products per token, the attention's
        // growing with the length.
        let config = encoder.config();
        let cost = |chunk: &[Prepared]| {
            let t = chunk.iter().map(|p| p.ids.len()).max().unwrap_or(0) as f64;
            let d = config.d_model as f64;
            chunk.len() as f64 * t * (4.0 * d * d + 2.0 * d * config.ffn_dim as f64 + 2.0 * t * d)
        };
        if let Some(meter) = self.meter {
            let all = ranges.iter().map(|r| cost(&prepared[r[0]..r[1]])).sum();
            meter.plan("batch", ranges.len(), all);
        }
        for range in ranges {
            let (chunk, texts) = (&prepared[range[0]..range[1]], &texts[range[0]..range[1]]);
            if let Some(meter) = self.meter {
                let longest = chunk.iter().map(|p| p.ids.len()).max().unwrap_or(0);
                meter.start(match chunk.len() {
                    1 => format!("1 text of {longest} tokens"),
                    n => format!("{n} texts of at most {longest} tokens"),
                });
            }
            let seqs: Vec<&[u32]> = chunk.iter().map(|p| p.ids.as_slice()).collect();
            let (ids, mask) = pad_batch(&seqs, self.loaded.tokenizer.pad_id(), self.device())?;
            let positions = self.positions(chunk, ids.dim(1)?)?;
            let values = f(model, chunk, &ids, &mask, &positions)?;
            if let Some(meter) = self.meter {
                meter.done(cost(chunk));
            }
            for ((p, text), value) in chunk.iter().zip(texts).zip(values) {
                out.push(Output {
                    text: text.clone(),
                    value,
                    unknown_tokens: p.unknown,
                    note: p.note.clone(),
                });
            }
        }
        Ok(out)
    }

    /// Labels, tags or fills for each text, as the model's objective says; `top_k` fills per
    /// mask (MLM).
    pub fn predict(&self, texts: &[String], top_k: usize) -> Result<Vec<Output<Prediction>>> {
        let objective = &self.loaded.config.objective;
        let tok = &self.loaded.tokenizer;
        self.batched(texts, |model, chunk, ids, mask, positions| {
            let logits = model.logits(ids, mask, positions, false)?;
            let probs = crate::nn::softmax_last_dim(&logits.to_dtype(DType::F32)?)?;
            match objective {
                Objective::Classify { labels } => {
                    let probs = probs.to_vec2::<f32>()?;
                    Ok(probs
                        .into_iter()
                        .map(|row| {
                            let mut scored: Vec<Scored> = labels
                                .iter()
                                .zip(row)
                                .map(|(l, p)| Scored {
                                    label: l.clone(),
                                    probability: f64::from(p),
                                })
                                .collect();
                            scored.sort_by(|a, b| b.probability.total_cmp(&a.probability));
                            Prediction::Class {
                                label: scored[0].label.clone(),
                                probabilities: scored,
                            }
                        })
                        .collect())
                }
                // A next-token model's tag of a word is the word it predicts after it.
                Objective::Tag { labels } | Objective::Lm { labels } => {
                    let best = probs.argmax(D::Minus1)?.to_vec2::<u32>()?;
                    Ok(chunk
                        .iter()
                        .zip(best)
                        .map(|(p, row)| {
                            // A word's tag is its first token's.
                            let mut tags = vec![String::new(); p.words.len()];
                            let mut seen = vec![false; p.words.len()];
                            for (t, w) in p.word_ids.iter().enumerate() {
                                if let Some(w) = w.map(|w| w as usize) {
                                    if !seen[w] {
                                        seen[w] = true;
                                        tags[w] = labels[row[t] as usize].clone();
                                    }
                                }
                            }
                            // Words cut off by truncation have no tag.
                            let kept = seen.iter().filter(|s| **s).count();
                            Prediction::Tags {
                                words: p.words[..kept].to_vec(),
                                tags: tags[..kept].to_vec(),
                            }
                        })
                        .collect())
                }
                Objective::Mlm { .. } => {
                    let mask_id = tok
                        .mask_id()
                        .ok_or_else(|| Error::Input("the tokenizer has no mask token".into()))?;
                    let specials: Vec<u32> = [
                        Some(tok.pad_id()),
                        tok.unk_id(),
                        tok.cls_id(),
                        Some(mask_id),
                    ]
                    .into_iter()
                    .flatten()
                    .collect();
                    chunk
                        .iter()
                        .enumerate()
                        .map(|(b, p)| {
                            let mut masks = Vec::new();
                            for (t, &id) in p.ids.iter().enumerate() {
                                if id != mask_id {
                                    continue;
                                }
                                let row = probs.i((b, t))?.to_vec1::<f32>()?;
                                let fills = top_fills(&row, top_k, &specials, tok);
                                masks.push(MaskFill {
                                    word: p.word_ids[t].map_or(t, |w| w as usize),
                                    fills,
                                });
                            }
                            if masks.is_empty() {
                                return Err(Error::Input(format!(
                                    "{:?} has no {} token to fill",
                                    p.words.join(" "),
                                    tok.id_to_token(mask_id).unwrap_or_default()
                                )));
                            }
                            Ok(Prediction::Fills { masks })
                        })
                        .collect()
                }
            }
        })
    }

    /// The pooled sentence vector of each text (the model's pooling for classifiers, else the
    /// mean over tokens).
    pub fn embed(&self, texts: &[String]) -> Result<Vec<Output<Embedding>>> {
        self.batched(texts, |model, _, ids, mask, positions| {
            let hidden = model.encoder().forward_with(ids, mask, positions, false)?;
            let pooled = model.pool(&hidden, mask)?.to_dtype(DType::F32)?;
            Ok(pooled
                .to_vec2::<f32>()?
                .into_iter()
                .map(|embedding| Embedding { embedding })
                .collect())
        })
    }
}
