//! From examples to batches: tokenized samples, length buckets, padding masks, MLM masking.

use candle::{Device, Tensor};
use rand::seq::SliceRandom;
use rand::Rng as _;

use crate::error::{Error, Result};
use crate::rng::Rng;
use crate::tasks::{Example, Label, TokenLimit};
use crate::text::{Encoded, TextTokenizer};

/// Label value of a token that is not scored.
pub const NOT_SCORED: i64 = -1;

/// One tokenized example.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// The token ids, framing included.
    pub ids: Vec<u32>,
    /// What the model is scored on.
    pub target: Target,
    /// Where a length-suite tape's answer sits; `None` for every other task.
    pub tape: Option<TapeInfo>,
}

/// Where a length-suite tape's answer sits, for scoring it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TapeInfo {
    /// The task's input length, what scores are reported by.
    pub length: usize,
    /// Token index of the first output blank.
    pub first_output: usize,
    /// The outputs (from the first) the accuracy counts; the loss counts every output.
    pub counted: usize,
}

impl Sample {
    /// Keeps `len` tokens (and their labels): the first `len - keep_last`, and the last
    /// `keep_last` (a template's closing `[SEP]`).
    pub fn truncate(&mut self, len: usize, keep_last: usize) {
        keep_ends(&mut self.ids, len, keep_last);
        if let Target::Tags(tags) = &mut self.target {
            keep_ends(tags, len, keep_last);
        }
    }
}

/// Cuts `v` to `len` items (when longer): its first `len - keep_last`, then its last
/// `keep_last` (a template's closing `[SEP]`, which a cut text keeps).
pub fn keep_ends<T>(v: &mut Vec<T>, len: usize, keep_last: usize) {
    if v.len() <= len {
        return;
    }
    let keep_last = keep_last.min(len);
    v.drain(len - keep_last..v.len() - keep_last);
}

/// How a text's tokens are framed for the model that reads them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Framing {
    /// The text's tokens alone.
    #[default]
    Plain,
    /// A `[CLS]` token first (first-token pooling in poslab's own models).
    Cls(u32),
    /// The tokenizer's own template (`[CLS] ... [SEP]`, `<s> ... </s>`), what a pretrained
    /// encoder was trained on: `front` special tokens before the text and `back` after it.
    Template {
        /// Special tokens before the text.
        front: usize,
        /// Special tokens after the text.
        back: usize,
    },
}

impl From<Option<u32>> for Framing {
    fn from(cls: Option<u32>) -> Self {
        cls.map_or(Self::Plain, Self::Cls)
    }
}

impl Framing {
    /// How a model reads its texts: framed by the tokenizer's template (`template`: a model
    /// fine-tuned from a pretrained encoder), with a `[CLS]` first (`first_token`: a head that
    /// pools the first token), or as they are.
    pub fn of(tokenizer: &TextTokenizer, template: bool, first_token: bool) -> Result<Self> {
        if template {
            return Self::template(tokenizer);
        }
        if !first_token {
            return Ok(Self::Plain);
        }
        let cls = tokenizer.cls_id().ok_or_else(|| {
            Error::Config("first-token pooling needs a [CLS] token in the tokenizer".into())
        })?;
        Ok(Self::Cls(cls))
    }

    /// The template of `tokenizer`, measured on a one-word text; an error when it adds no
    /// special tokens.
    pub fn template(tokenizer: &TextTokenizer) -> Result<Self> {
        let enc = tokenizer.encode_words_with_specials(&["a"])?;
        let front = enc.word_ids.iter().take_while(|w| w.is_none()).count();
        let back = enc
            .word_ids
            .iter()
            .rev()
            .take_while(|w| w.is_none())
            .count();
        if front == 0 || front == enc.word_ids.len() {
            return Err(Error::Config(
                "the tokenizer adds no special tokens around a text (no template such as \
                 [CLS] ... [SEP]): a pretrained encoder's tokenizer.json has one"
                    .into(),
            ));
        }
        Ok(Self::Template { front, back })
    }

    /// The ids of `words` framed, and each token's word (`None` for the framing's tokens).
    pub fn encode<S: AsRef<str>>(self, tokenizer: &TextTokenizer, words: &[S]) -> Result<Encoded> {
        match self {
            Self::Plain => tokenizer.encode_words(words),
            Self::Cls(cls) => {
                let enc = tokenizer.encode_words(words)?;
                Ok(Encoded {
                    ids: std::iter::once(cls).chain(enc.ids).collect(),
                    word_ids: std::iter::once(None).chain(enc.word_ids).collect(),
                })
            }
            Self::Template { .. } => tokenizer.encode_words_with_specials(words),
        }
    }

    /// The tokens before and after the text's own.
    pub fn around(self) -> (usize, usize) {
        match self {
            Self::Plain => (0, 0),
            Self::Cls(_) => (1, 0),
            Self::Template { front, back } => (front, back),
        }
    }
}

/// What one example is scored on.
#[derive(Clone, Debug, PartialEq)]
pub enum Target {
    /// A class for the whole sequence.
    Class(u32),
    /// Per token, [`NOT_SCORED`] where no label applies.
    Tags(Vec<i64>),
    /// Targets are drawn when the batch is made.
    Masked,
}

/// Tokenized examples.
#[derive(Clone, Debug, Default)]
pub struct Dataset {
    /// The examples, in order.
    pub samples: Vec<Sample>,
    /// How many examples were cut to `max_tokens` (with `truncate = true`).
    pub truncated: usize,
}

impl Dataset {
    /// Tokenizes `examples`, framed as `framing` says (a `[CLS]` first for first-token
    /// pooling, `None`; the tokenizer's template for a pretrained encoder). A per-word tag goes
    /// to the word's first token; later sub-word tokens and the framing's are not scored. An
    /// input longer than `limit.max_tokens` is an error naming where it came from, or is cut to
    /// that length when `limit.truncate` (its closing special tokens kept; counted in
    /// `truncated`).
    pub fn encode(
        examples: &[Example],
        tokenizer: &TextTokenizer,
        framing: impl Into<Framing>,
        limit: TokenLimit,
    ) -> Result<Self> {
        let framing = framing.into();
        let (front, back) = framing.around();
        let mut truncated = 0;
        let samples = examples
            .iter()
            .enumerate()
            .map(|(n, example)| {
                // Where the example came from (`file:line`), for every message about it.
                let at = match &example.source {
                    Some(s) => s.to_string(),
                    None => format!("example {}", n + 1),
                };
                let enc = framing.encode(tokenizer, &example.words)?;
                if enc.ids.len() == front + back {
                    return Err(Error::Input(format!(
                        "{at}: {:?} produced no tokens",
                        example.text()
                    )));
                }
                let ids = enc.ids.clone();
                let mut tape = None;
                let target = match &example.label {
                    Label::Class(c) => Target::Class(*c as u32),
                    Label::Masked => Target::Masked,
                    Label::Outputs {
                        length,
                        targets,
                        counted,
                    } => {
                        // One token per word, so the blanks are the last tokens.
                        let one_each = enc.ids.len() == example.words.len()
                            && enc
                                .word_ids
                                .iter()
                                .enumerate()
                                .all(|(i, w)| *w == Some(i as u32));
                        if !one_each || targets.len() > enc.ids.len() || framing != Framing::Plain {
                            return Err(Error::Input(format!(
                                "{at}: a tape (the length suite's, or lm's) must be one token \
                                 per word without [CLS] ({} words made {} tokens): use the \
                                 word-level tokenizer",
                                example.words.len(),
                                enc.ids.len()
                            )));
                        }
                        let first_output = enc.ids.len() - targets.len();
                        tape = Some(TapeInfo {
                            length: *length,
                            first_output,
                            counted: (*counted).min(targets.len()),
                        });
                        let mut out = vec![NOT_SCORED; first_output];
                        out.extend(targets.iter().map(|&t| t as i64));
                        Target::Tags(out)
                    }
                    Label::Tags(tags) => {
                        let mut out = Vec::with_capacity(ids.len());
                        let mut previous = None;
                        for word in &enc.word_ids {
                            let first = word.is_some() && *word != previous;
                            previous = *word;
                            let tag = match word {
                                Some(w) if first => tags
                                    .get(*w as usize)
                                    .ok_or_else(|| {
                                        Error::Input(format!(
                                            "{at}: {:?} has {} tags for more words: give one \
                                             tag per word",
                                            example.text(),
                                            tags.len()
                                        ))
                                    })?
                                    .map_or(NOT_SCORED, |t| t as i64),
                                _ => NOT_SCORED,
                            };
                            out.push(tag);
                        }
                        Target::Tags(out)
                    }
                };
                let mut sample = Sample { ids, target, tape };
                if let Some(max) = limit.max_tokens {
                    if sample.ids.len() > max {
                        if sample.tape.is_some() {
                            return Err(Error::Input(format!(
                                "{at}: a tape of {} tokens, more than max_tokens = {max}; a tape \
                                 cut short loses its answer: raise max_tokens or shorten the \
                                 lengths",
                                sample.ids.len()
                            )));
                        }
                        if !limit.truncate {
                            return Err(Error::Input(format!(
                                "{at}: {} tokens, more than max_tokens = {max}: set truncate = true \
                                 to keep the first {max}, or raise max_tokens",
                                sample.ids.len()
                            )));
                        }
                        if max <= front + back {
                            return Err(Error::Input(format!(
                                "{at}: max_tokens = {max} leaves no room for the text between \
                                 the {} special tokens around it: raise max_tokens",
                                front + back
                            )));
                        }
                        sample.truncate(max, back);
                        truncated += 1;
                    }
                }
                Ok(sample)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { samples, truncated })
    }

    /// The number of examples.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// Whether there are no examples.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// Each example's length in tokens.
    pub fn lengths(&self) -> Vec<usize> {
        self.samples.iter().map(|s| s.ids.len()).collect()
    }

    /// Longest sequence in tokens.
    pub fn max_len(&self) -> usize {
        self.samples.iter().map(|s| s.ids.len()).max().unwrap_or(0)
    }

    /// The shuffle test's input: each sample's tokens permuted (the framing's special tokens
    /// stay where they are), labels unchanged. Only meaningful for sentence labels.
    pub fn with_shuffled_tokens(&self, framing: Framing, rng: &mut Rng) -> Self {
        let (front, back) = framing.around();
        let samples = self
            .samples
            .iter()
            .map(|s| {
                let mut ids = s.ids.clone();
                let end = ids.len().saturating_sub(back);
                if front < end {
                    ids[front..end].shuffle(rng);
                }
                Sample {
                    ids,
                    target: s.target.clone(),
                    tape: s.tape,
                }
            })
            .collect();
        Self {
            samples,
            truncated: self.truncated,
        }
    }
}

/// How MLM corrupts inputs: `mask_prob` of the real tokens are chosen (at least one per
/// sequence); of those 80% become `[MASK]`, 10% a random regular token, 10% stay.
#[derive(Clone, Debug)]
pub struct MlmMasking {
    /// The share of real tokens chosen for prediction.
    pub mask_prob: f64,
    /// The id of the mask token.
    pub mask_id: u32,
    /// Ids a random replacement is drawn from (the vocabulary without special tokens).
    pub regular_ids: Vec<u32>,
}

impl MlmMasking {
    /// MLM masking with `tokenizer`'s mask token; an error if it has none.
    pub fn new(mask_prob: f64, tokenizer: &TextTokenizer) -> Result<Self> {
        let mask_id = tokenizer.mask_id().ok_or_else(|| {
            Error::Input("MLM needs a mask token ([MASK] or <mask>) in the tokenizer".into())
        })?;
        let specials = [
            Some(tokenizer.pad_id()),
            tokenizer.unk_id(),
            tokenizer.cls_id(),
            tokenizer.token_to_id(crate::text::SEP),
            Some(mask_id),
        ];
        let regular_ids = (0..tokenizer.vocab_size() as u32)
            .filter(|id| !specials.contains(&Some(*id)))
            .collect();
        Ok(Self {
            mask_prob,
            mask_id,
            regular_ids,
        })
    }
}

pub use poslab_core::batch::Batch;

/// Sequences padded to the longest, row-major: ids, mask (1 for real tokens), rows, columns.
fn padded(seqs: &[&[u32]], pad_id: u32) -> Result<(Vec<u32>, Vec<u32>, usize, usize)> {
    let b = seqs.len();
    let t = seqs.iter().map(|s| s.len()).max().unwrap_or(0);
    if b == 0 || t == 0 {
        return Err(Error::Input("cannot make an empty batch".into()));
    }
    let mut ids = vec![pad_id; b * t];
    let mut mask = vec![0u32; b * t];
    for (i, s) in seqs.iter().enumerate() {
        ids[i * t..i * t + s.len()].copy_from_slice(s);
        mask[i * t..i * t + s.len()].fill(1);
    }
    Ok((ids, mask, b, t))
}

/// Token sequences padded into `(b, t)` u32 ids and a `(b, t)` u32 mask, for inference.
pub fn pad_batch(seqs: &[&[u32]], pad_id: u32, device: &Device) -> Result<(Tensor, Tensor)> {
    let (ids, mask, b, t) = padded(seqs, pad_id)?;
    Ok((
        Tensor::from_vec(ids, (b, t), device)?,
        Tensor::from_vec(mask, (b, t), device)?,
    ))
}

/// Pads `samples` into a batch. MLM samples need `masking` and a generator for the masks.
pub fn make_batch(
    samples: &[&Sample],
    pad_id: u32,
    masking: Option<(&MlmMasking, &mut Rng)>,
    device: &Device,
) -> Result<Batch> {
    let seqs: Vec<&[u32]> = samples.iter().map(|s| s.ids.as_slice()).collect();
    let (mut ids, mask, b, t) = padded(&seqs, pad_id)?;
    let real_tokens = mask.iter().filter(|&&m| m == 1).count();
    let (targets, weights, scored) = match &samples[0].target {
        Target::Class(_) => {
            let classes = samples
                .iter()
                .map(|s| match s.target {
                    Target::Class(c) => Ok(c),
                    _ => Err(Error::Input(
                        "a batch mixes sentence and token labels".into(),
                    )),
                })
                .collect::<Result<Vec<u32>>>()?;
            (Tensor::from_vec(classes, b, device)?, None, b)
        }
        Target::Tags(_) | Target::Masked => {
            let mut labels = vec![NOT_SCORED; b * t];
            match masking {
                None => {
                    for (i, s) in samples.iter().enumerate() {
                        match &s.target {
                            Target::Tags(tags) => {
                                labels[i * t..i * t + tags.len()].copy_from_slice(tags)
                            }
                            _ => {
                                return Err(Error::Input(
                                    "masked samples need MLM masking to make a batch".into(),
                                ))
                            }
                        }
                    }
                }
                Some((m, rng)) => {
                    for (i, s) in samples.iter().enumerate() {
                        let row = i * t;
                        let n = s.ids.len();
                        let mut chosen: Vec<usize> =
                            (0..n).filter(|_| rng.random_bool(m.mask_prob)).collect();
                        if chosen.is_empty() {
                            chosen.push(rng.random_range(0..n));
                        }
                        for j in chosen {
                            labels[row + j] = i64::from(s.ids[j]);
                            let roll: f64 = rng.random();
                            if roll < 0.8 {
                                ids[row + j] = m.mask_id;
                            } else if roll < 0.9 {
                                ids[row + j] =
                                    m.regular_ids[rng.random_range(0..m.regular_ids.len())];
                            }
                        }
                    }
                }
            }
            let weights: Vec<f32> = labels
                .iter()
                .map(|&l| if l == NOT_SCORED { 0.0 } else { 1.0 })
                .collect();
            let scored = weights.iter().filter(|&&w| w > 0.0).count();
            let targets: Vec<u32> = labels.iter().map(|&l| l.max(0) as u32).collect();
            (
                Tensor::from_vec(targets, (b, t), device)?,
                Some(Tensor::from_vec(weights, (b, t), device)?),
                scored,
            )
        }
    };
    let counted = if samples.iter().any(|s| s.tape.is_some()) {
        let mut counted = vec![0f32; b * t];
        for (i, s) in samples.iter().enumerate() {
            if let Some(tape) = s.tape {
                let from = i * t + tape.first_output;
                counted[from..from + tape.counted].fill(1.0);
            }
        }
        Some(Tensor::from_vec(counted, (b, t), device)?)
    } else {
        None
    };
    let max_id = ids.iter().copied().max().unwrap_or(0);
    Ok(Batch {
        ids: Tensor::from_vec(ids, (b, t), device)?,
        mask: Tensor::from_vec(mask, (b, t), device)?,
        targets,
        weights,
        counted,
        real_tokens,
        lengths: samples.iter().map(|s| s.ids.len()).collect(),
        positions: None,
        scored,
        max_id,
    })
}

/// One epoch's batches for training: samples shuffled, then sorted by length within pools of
/// 32 batches so each batch holds similar lengths (little padding), then the batches shuffled.
pub fn epoch_batches(lengths: &[usize], batch_size: usize, rng: &mut Rng) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.shuffle(rng);
    let mut batches: Vec<Vec<usize>> = Vec::new();
    for pool in order.chunks(batch_size * 32) {
        let mut pool = pool.to_vec();
        pool.sort_by_key(|&i| lengths[i]); // stable: ties keep the shuffled order
        batches.extend(pool.chunks(batch_size).map(<[usize]>::to_vec));
    }
    batches.shuffle(rng);
    batches
}

/// Batches for evaluation: sorted by length, in order.
pub fn eval_batches(lengths: &[usize], batch_size: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by_key(|&i| lengths[i]);
    order.chunks(batch_size).map(<[usize]>::to_vec).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok() -> TextTokenizer {
        TextTokenizer::word_level(["a", "b", "c"]).unwrap()
    }

    #[test]
    fn batches_pad_and_mask() {
        let ex =
            |w: &str, c| Example::new(w.split(' ').map(String::from).collect(), Label::Class(c));
        let ds = Dataset::encode(
            &[ex("a b c", 1), ex("c", 0)],
            &tok(),
            Some(2),
            TokenLimit::default(),
        )
        .unwrap();
        assert_eq!(ds.samples[0].ids, vec![2, 5, 6, 7]);
        let refs: Vec<&Sample> = ds.samples.iter().collect();
        let b = make_batch(&refs, 0, None, &Device::Cpu).unwrap();
        assert_eq!(
            b.ids.to_vec2::<u32>().unwrap(),
            vec![vec![2, 5, 6, 7], vec![2, 7, 0, 0]]
        );
        assert_eq!(
            b.mask.to_vec2::<u32>().unwrap(),
            vec![vec![1, 1, 1, 1], vec![1, 1, 0, 0]]
        );
        assert_eq!(b.targets.to_vec1::<u32>().unwrap(), vec![1, 0]);
        assert_eq!((b.real_tokens, b.scored), (6, 2));
    }

    #[test]
    fn tags_align_and_mlm_masks_are_seeded() {
        let ex = Example::new(
            vec!["a".into(), "zzz".into(), "c".into()],
            Label::Tags(vec![None, Some(3), Some(1)]),
        );
        let ds = Dataset::encode(
            std::slice::from_ref(&ex),
            &tok(),
            None,
            TokenLimit::default(),
        )
        .unwrap();
        assert_eq!(ds.samples[0].target, Target::Tags(vec![-1, 3, 1]));
        assert_eq!(ds.samples[0].ids[1], 1, "unknown word maps to [UNK]");
        // Too long: refused, or cut with its tags when asked.
        let strict = TokenLimit {
            max_tokens: Some(2),
            truncate: false,
        };
        let e = Dataset::encode(std::slice::from_ref(&ex), &tok(), None, strict)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("example 1: 3 tokens, more than max_tokens = 2")
                && e.contains("truncate = true"),
            "{e}"
        );
        let cut = Dataset::encode(
            &[ex],
            &tok(),
            None,
            TokenLimit {
                truncate: true,
                ..strict
            },
        )
        .unwrap();
        assert_eq!(
            (cut.truncated, cut.samples[0].target.clone()),
            (1, Target::Tags(vec![-1, 3]))
        );

        let masked = Example::new(
            "a b c a b c a b c a".split(' ').map(String::from).collect(),
            Label::Masked,
        );
        let ds = Dataset::encode(
            &[masked.clone(), masked],
            &tok(),
            None,
            TokenLimit::default(),
        )
        .unwrap();
        let m = MlmMasking::new(0.3, &tok()).unwrap();
        assert_eq!(m.regular_ids, vec![5, 6, 7]);
        let refs: Vec<&Sample> = ds.samples.iter().collect();
        let run = |seed| {
            let mut rng = crate::rng::stream(seed, "mlm");
            let b = make_batch(&refs, 0, Some((&m, &mut rng)), &Device::Cpu).unwrap();
            (
                b.ids.to_vec2::<u32>().unwrap(),
                b.weights.unwrap().to_vec2::<f32>().unwrap(),
                b.scored,
            )
        };
        let (ids, weights, scored) = run(1);
        assert_eq!(run(1).0, ids);
        assert!(scored >= 2);
        for (row, w) in ids.iter().zip(&weights) {
            for (&id, &wt) in row.iter().zip(w) {
                if wt == 0.0 {
                    assert_ne!(id, m.mask_id, "unscored tokens are never masked");
                }
            }
        }
    }

    #[test]
    fn bucketed_epochs_cover_every_sample_once_with_similar_lengths() {
        let lengths: Vec<usize> = (0..1000).map(|i| 5 + (i * 7919) % 40).collect();
        let mut rng = crate::rng::stream(0, "epoch");
        let batches = epoch_batches(&lengths, 16, &mut rng);
        let mut seen: Vec<usize> = batches.iter().flatten().copied().collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..1000).collect::<Vec<_>>());
        let spread: usize = batches
            .iter()
            .map(|b| {
                b.iter().map(|&i| lengths[i]).max().unwrap()
                    - b.iter().map(|&i| lengths[i]).min().unwrap()
            })
            .sum();
        assert!(
            spread / batches.len() <= 3,
            "mean in-batch length spread {}",
            spread / batches.len()
        );
    }
}
