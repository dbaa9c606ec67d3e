//! How a trained model's attention logits split into content and position terms, when its
//! positions are added to the token embeddings.

use std::path::Path;

use candle::{DType, Tensor, D};
use serde::Serialize;

use crate::data::{keep_ends, pad_batch};
use crate::encoder::Encoder;
use crate::error::{Error, Result};
use crate::saved::Loaded;
use crate::text::HubSource;

/// The four terms of `(W_q(x_i + p_i)) · (W_k(x_j + p_j))`, query side first.
pub const TERMS: [&str; 4] = [
    "content·content",
    "content·position",
    "position·content",
    "position·position",
];

/// One head's terms over the token pairs of a batch its layer reads (both real, within its
/// window).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HeadTerms {
    /// The layer.
    pub layer: usize,
    /// The head.
    pub head: usize,
    /// Mean absolute value of each term.
    pub mean_abs: [f64; 4],
    /// Each term's share of the sum of the four mean absolute values.
    pub share: [f64; 4],
    /// The largest `|sum of the terms - score|`: how exactly the terms rebuild the scores.
    pub reconstruction_error: f64,
}

/// The model's evaluation text: `text_file` (one text per line) if given, else the test set
/// at the training lengths of the task recorded in its `config.json`; at most `n` texts, each
/// cut to a learned table's length.
pub fn evaluation_batch(
    loaded: &Loaded,
    n: usize,
    text_file: Option<&Path>,
) -> Result<(Tensor, Tensor, usize)> {
    let texts: Vec<Vec<String>> = match text_file {
        Some(path) => {
            let text = crate::io::read_text_bounded(path, crate::io::MAX_DATA_BYTES, "text")?;
            text.lines()
                .map(|l| l.split_whitespace().map(String::from).collect::<Vec<_>>())
                .filter(|w| !w.is_empty())
                .take(n)
                .collect()
        }
        None => {
            let spec = loaded.config.task_spec.as_ref().ok_or_else(|| {
                Error::Input("this model's config.json does not record its task: give evaluation text with --text FILE".into())
            })?;
            let data = spec
                .generate_with(&HubSource::from_env(), Some(loaded.tokenizer.clone()))
                .map_err(|e| {
                    Error::Input(format!(
                        "cannot remake the model's evaluation text ({e}): give it with --text FILE"
                    ))
                })?;
            data.tests[0]
                .examples
                .iter()
                .take(n)
                .map(|e| e.words.clone())
                .collect()
        }
    };
    if texts.is_empty() {
        return Err(Error::Input("no evaluation text to analyse".into()));
    }
    let framing = loaded.config.framing(&loaded.tokenizer)?;
    let rows = loaded.model.encoder().max_positions();
    let mut cut = 0;
    let ids: Vec<Vec<u32>> = texts
        .iter()
        .map(|w| {
            let mut ids = framing.encode(&loaded.tokenizer, w)?.ids;
            if let Some(r) = rows.filter(|&r| ids.len() > r) {
                // As training cut it: a template's closing [SEP] stays.
                keep_ends(&mut ids, r, framing.around().1);
                cut += 1;
            }
            Ok(ids)
        })
        .collect::<Result<_>>()?;
    let seqs: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
    let (ids, mask) = pad_batch(
        &seqs,
        loaded.tokenizer.pad_id(),
        loaded.model.encoder().device(),
    )?;
    Ok((ids, mask, cut))
}

/// Text for a pretrained encoder's attention terms: the lines of `text_file` (at most `n`), or
/// without one the first `n` reviews of the shipped `examples/data/reviews.tsv` (plain English
/// sentences). Returns the texts and where they came from.
pub fn pretrained_texts(n: usize, text_file: Option<&Path>) -> Result<(Vec<String>, String)> {
    let (text, source) = match text_file {
        Some(path) => (
            crate::io::read_text_bounded(path, crate::io::MAX_DATA_BYTES, "text")?,
            path.display().to_string(),
        ),
        None => (
            REVIEWS
                .lines()
                .skip(1)
                .filter_map(|l| l.split('\t').next())
                .collect::<Vec<_>>()
                .join("\n"),
            "examples/data/reviews.tsv".to_string(),
        ),
    };
    let texts: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .take(n)
        .map(String::from)
        .collect();
    if texts.is_empty() {
        return Err(Error::Input(format!("{source}: no text to analyse")));
    }
    Ok((texts, source))
}

const REVIEWS: &str = include_str!("../../examples/data/reviews.tsv");

/// The (query, key) pairs of a batch that a layer reads: both tokens real, and the key within
/// the layer's window.
struct RealPairs {
    /// `(b, 1, t, t)`: 1 where both are real.
    pairs: Tensor,
    /// How many there are.
    count: f64,
}

impl RealPairs {
    /// # Shapes
    /// - `mask`: `(b, t)`, 1 for real tokens
    fn of(mask: &Tensor, window: crate::nn::Window) -> Result<Self> {
        let m = mask.to_dtype(DType::F64)?;
        let mut pairs = m
            .unsqueeze(2)?
            .broadcast_mul(&m.unsqueeze(1)?)?
            .unsqueeze(1)?; // (b, 1, t, t)
        let t = mask.dim(1)?;
        if window.masks_any(t) {
            let inside: Vec<f64> = (0..t * t)
                .map(|n| f64::from(u8::from(!window.hides(n / t, n % t))))
                .collect();
            let inside = Tensor::from_vec(inside, (1, 1, t, t), mask.device())?;
            pairs = pairs.broadcast_mul(&inside)?;
        }
        let count = pairs.sum_all()?.to_scalar::<f64>()?;
        Ok(Self { pairs, count })
    }

    /// Mean over `(b, i, j)` of `|x|` at real pairs, per head: `x` `(b, h, t, t)` to `(h)`.
    fn mean_abs_per_head(&self, x: &Tensor) -> Result<Vec<f64>> {
        Ok((x
            .to_dtype(DType::F64)?
            .abs()?
            .broadcast_mul(&self.pairs)?
            .sum(D::Minus1)?
            .sum(D::Minus1)?
            .sum(0)?
            / self.count.max(1.0))?
        .to_vec1::<f64>()?)
    }
}

/// The four terms per layer and head, over the token pairs of a batch each layer reads (both
/// real, and within a local layer's window).
pub fn attention_terms(encoder: &Encoder, ids: &Tensor, mask: &Tensor) -> Result<Vec<HeadTerms>> {
    let layers = encoder.score_terms(ids, mask)?;
    let mut out = Vec::new();
    for crate::encoder::ScoreTerms {
        layer,
        window,
        scores,
        terms,
    } in layers
    {
        let real = RealPairs::of(mask, window)?;
        let means: Vec<Vec<f64>> = terms
            .iter()
            .map(|t| real.mean_abs_per_head(t))
            .collect::<Result<_>>()?;
        let rebuilt = terms
            .iter()
            .skip(1)
            .try_fold(terms[0].clone(), |acc, t| acc + t)?;
        let err = (rebuilt - &scores)?
            .to_dtype(DType::F64)?
            .abs()?
            .broadcast_mul(&real.pairs)?;
        let err = err
            .max(D::Minus1)?
            .max(D::Minus1)?
            .max(0)?
            .to_vec1::<f64>()?;
        for head in 0..means[0].len() {
            let mean_abs = [
                means[0][head],
                means[1][head],
                means[2][head],
                means[3][head],
            ];
            let total: f64 = mean_abs.iter().sum::<f64>().max(1e-300);
            out.push(HeadTerms {
                layer,
                head,
                mean_abs,
                share: mean_abs.map(|v| v / total),
                reconstruction_error: err[head],
            });
        }
    }
    Ok(out)
}

/// Per layer, the mean share of each term over its heads, as printed lines.
pub fn summary(terms: &[HeadTerms]) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let layers: std::collections::BTreeSet<usize> = terms.iter().map(|t| t.layer).collect();
    for layer in layers {
        let heads: Vec<&HeadTerms> = terms.iter().filter(|t| t.layer == layer).collect();
        let share =
            |i: usize| 100.0 * heads.iter().map(|t| t.share[i]).sum::<f64>() / heads.len() as f64;
        let err = heads
            .iter()
            .map(|t| t.reconstruction_error)
            .fold(0.0, f64::max);
        let _ = writeln!(
            s,
            "  layer {layer}: content·content {:.1}%, content·position {:.1}%, position·content {:.1}%, position·position {:.1}% (mean over {} heads; terms rebuild the logits to {err:.1e})",
            share(0),
            share(1),
            share(2),
            share(3),
            heads.len()
        );
    }
    s
}

/// One head's attention scores split by what its rotation adds: `c q kᵀ` (the content's score,
/// as if unrotated) and `c (rot(q) rot(k)ᵀ - q kᵀ)` (the rotation's, the position term of a
/// RoPE layer), over the token pairs of a batch the layer reads (both real, within its window).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RotationTerms {
    /// The layer.
    pub layer: usize,
    /// What the layer does with positions ([`crate::layers::LayerSpec::describe`]).
    pub plan: String,
    /// The head.
    pub head: usize,
    /// Mean absolute content score.
    pub content: f64,
    /// Mean absolute rotation term.
    pub rotation: f64,
    /// `rotation / (content + rotation)`.
    pub share: f64,
}

/// The rotation split per layer and head (see [`RotationTerms`]).
pub fn rotation_terms(
    encoder: &Encoder,
    ids: &Tensor,
    mask: &Tensor,
) -> Result<Vec<RotationTerms>> {
    let mut out = Vec::new();
    for (layer, (rotated, plain)) in encoder.rotation_scores(ids, mask)?.into_iter().enumerate() {
        let spec = encoder.config().layer_spec(layer);
        let real = RealPairs::of(mask, spec.keys())?;
        let content = real.mean_abs_per_head(&plain)?;
        let rotation = real.mean_abs_per_head(&(rotated - &plain)?)?;
        let plan = spec.describe();
        for (head, (c, r)) in content.iter().zip(&rotation).enumerate() {
            out.push(RotationTerms {
                layer,
                plan: plan.clone(),
                head,
                content: *c,
                rotation: *r,
                share: r / (c + r).max(1e-300),
            });
        }
    }
    Ok(out)
}

/// Per layer, the rotation's mean share over heads, as printed lines.
pub fn rotation_summary(terms: &[RotationTerms]) -> String {
    use std::fmt::Write as _;
    let mut s = String::from(
        "attention scores split into the content's (q·k unrotated) and what the rotation adds \
         (the position term), mean |term| over the token pairs each layer reads (both real, within its window):\n",
    );
    let layers: std::collections::BTreeSet<usize> = terms.iter().map(|t| t.layer).collect();
    for layer in layers {
        let heads: Vec<&RotationTerms> = terms.iter().filter(|t| t.layer == layer).collect();
        let share = 100.0 * heads.iter().map(|t| t.share).sum::<f64>() / heads.len() as f64;
        let per_head: Vec<String> = heads
            .iter()
            .map(|t| format!("{:.0}%", 100.0 * t.share))
            .collect();
        let _ = writeln!(
            s,
            "  layer {layer} ({}): rotation {share:.1}% of the score (per head: {})",
            heads[0].plan,
            per_head.join(", ")
        );
    }
    s
}

/// `rotation_terms.csv`, and `rotation_terms.png`: each head's rotation share by layer.
pub fn write_rotation_terms(terms: &[RotationTerms], dir: &Path) -> Result<Vec<String>> {
    crate::io::create_folder(dir)?;
    crate::render::csv::write_rows(&dir.join("rotation_terms.csv"), terms)?;
    let heads = terms.iter().map(|t| t.head).max().map_or(0, |h| h + 1);
    let series: Vec<crate::render::png::Line> = (0..heads)
        .map(|h| {
            (
                format!("H{h}"),
                terms
                    .iter()
                    .filter(|t| t.head == h)
                    .map(|t| (t.layer as f64, 100.0 * t.share))
                    .collect(),
                false,
            )
        })
        .collect();
    crate::render::png::line_chart(
        &dir.join("rotation_terms.png"),
        "what the rotation adds to each head's attention scores, by layer",
        ("layer", "rotation's share of the score (%)"),
        &series,
        false,
    )?;
    Ok(vec![
        "rotation_terms.csv".into(),
        "rotation_terms.png".into(),
    ])
}
