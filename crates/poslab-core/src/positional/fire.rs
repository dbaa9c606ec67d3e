//! FIRE (Li et al., ICLR 2024, "Functional Interpolation for Relative Positions Improves Long
//! Context Transformers"), in the bidirectional form of an encoder.
//!
//! The paper's causal bias is `f(psi(i - j) / psi(max(L, i)))`: an MLP of the log-compressed
//! distance, normalised by the query's position, so that every query's inputs span `[0, 1]`
//! however long the sequence (the "interpolation"). An encoder sees keys on both sides and
//! every query sees the whole sequence, so here:
//!
//! ```text
//! rel      = p_j - p_i                                (key minus query, as T5)
//! psi(z)   = ln(|c| z + 1)
//! span     = largest minus smallest position of the sequence's real tokens
//! L        = |l_multiplier| · threshold
//! x        = sign(rel) · psi(|rel|) / (psi(max(L, span)) + 1e-6)          in [-1, 1]
//! bias     = W2 relu(W1 x + b1)                       (1 -> width -> heads)
//! ```
//!
//! The papers' output layer has a bias `b2` too; in attention it adds the same number to every
//! score of a head, which the softmax cancels exactly, so poslab leaves it out (a file holding
//! `fire.mlp2.bias`, as the reference fixtures do, loads without it: see the tests). With
//! `adaptive = { width = … }` (DAPE's MLP over the logits and this bias, `adaptive.rs`) the bias
//! is an input of that MLP, where a constant per head is no longer cancelled, and the output
//! layer has its bias.
//!
//! The sign keeps left and right apart; the span is the bidirectional counterpart of the causal
//! query position, so the bias depends on position differences only and a shift of every
//! position changes nothing. One module (`fire.mlp1`, `fire.mlp2`, `fire.c`,
//! `fire.l_multiplier`) is shared by every layer, as T5's table is; `c` starts at 0.1 and
//! `l_multiplier` at 1, as in the paper. `threshold` (default 512, as in the public
//! implementations) is the length below which inputs are not stretched: set it to the training
//! length, so that sequences up to it keep their raw scale and longer ones are interpolated.
//!
//! In a causal model (`causal = true`) FIRE takes the paper's own form, which masking the
//! encoder's would not give: for keys at or before the query,
//!
//! ```text
//! x = psi(p_i - p_j) / (psi(max(L, p_i)) + 1e-6)                                  in [0, 1]
//! ```
//!
//! unsigned, and normalised by the query's position (keys after it read `x = 0`, and are
//! masked).

use super::{Bench, Describe, Named, Portray, ScoreMemory};
use candle::{DType, Device, Tensor};
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};

use super::score_bias::offset_bias;
use super::{
    Adaptive, BiasBatch, BiasModule, Knobs, LayerBiases, Measure, Placement, Portrait,
    PositionalConfig, PositionalModule, Scheme, SchemeShape, ScoreBias,
};
use crate::error::{Error, Result};
use crate::nn::{linear, linear_no_bias, Linear};

fn default_threshold() -> f64 {
    512.0
}

fn default_width() -> usize {
    32
}

/// The widest FIRE MLP accepted: its hidden layer is computed for every query-key pair.
pub const MAX_FIRE_WIDTH: usize = 1024;

/// Options of `fire`: `threshold`, the length from which inputs are interpolated (default 512;
/// set it to the training length), and `width`, the MLP's hidden width (default 32, the
/// paper's).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FireOptions {
    /// The length `L` from which distances are divided by the query's position instead (default
    /// 512).
    #[serde(default = "default_threshold")]
    pub threshold: f64,
    /// The hidden width of the MLP `f_θ` (default 32).
    #[serde(default = "default_width")]
    pub width: usize,
    /// DAPE's MLP over the logits and the bias (`adaptive = { width = 32 }`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adaptive: Option<Adaptive>,
}

impl Default for FireOptions {
    fn default() -> Self {
        Self {
            threshold: default_threshold(),
            width: default_width(),
            adaptive: None,
        }
    }
}

impl FireOptions {
    /// FIRE with `threshold` and the paper's width.
    pub fn threshold(threshold: f64) -> Self {
        Self {
            threshold,
            ..Self::default()
        }
    }
}

impl Named for FireOptions {
    fn name(&self) -> &'static str {
        "fire"
    }
}

impl Scheme for FireOptions {
    fn placement(&self) -> Placement {
        Adaptive::placement(self.adaptive.as_ref())
    }

    fn check(&self, _shape: &SchemeShape) -> std::result::Result<(), String> {
        if let Some(a) = self.adaptive {
            a.check("fire")?;
        }
        let most = super::MAX_POSITION as f64;
        if !(self.threshold.is_finite() && self.threshold > 0.0 && self.threshold <= most) {
            let t = self.threshold;
            let shown = if t.abs() >= 1e9 {
                format!("{t:e}")
            } else {
                format!("{t}")
            };
            return Err(format!(
                "fire: threshold = {shown} must be a positive length up to {most} (the largest \
                 position): the length from which inputs are interpolated (set it to the \
                 training length; 512 is the papers')"
            ));
        }
        if self.width == 0 || self.width > MAX_FIRE_WIDTH {
            return Err(format!(
                "fire: width = {} must be between 1 and {MAX_FIRE_WIDTH}: the hidden width of \
                 the MLP from distance to bias (32 is the paper's)",
                self.width
            ));
        }
        Ok(())
    }

    fn param_count(&self, shape: &SchemeShape) -> u128 {
        let (w, h) = (self.width as u128, shape.n_heads as u128);
        // The output bias only under DAPE's MLP (see the module's notes).
        let output_bias = self.adaptive.map_or(0, |a| h + a.param_count(shape));
        2 * w + w * h + 2 + output_bias
    }

    fn build(&self, shape: &SchemeShape, vb: VarBuilder) -> Result<PositionalModule> {
        let fire = Fire::new(self, shape.n_heads, vb.pp("fire"))?.with_causal(shape.causal);
        Adaptive::wrap(self.adaptive.as_ref(), shape, &vb, ScoreBias::new(fire))
    }
}

impl Describe for FireOptions {
    fn describe(&self, shape: &SchemeShape) -> String {
        let input = match shape.causal {
            true => "ln(|c| (i - j) + 1) / ln(|c| max(L, i) + 1) (causal)",
            false => "sign(j - i) ln(|c| |j - i| + 1) / ln(|c| max(L, span) + 1)",
        };
        format!(
            "attention bias: an MLP (1 -> {} -> {} heads) of {input}, L = |l_multiplier| x {} \
             (threshold), shared by all layers{}",
            self.width,
            shape.n_heads,
            self.threshold,
            self.adaptive
                .map_or(String::new(), |a| a.describe(shape.n_heads))
        )
    }

    fn label(&self) -> String {
        Adaptive::label(self.adaptive.as_ref(), self.name())
    }
}

impl Portray for FireOptions {
    /// Its bias at initialisation at the settings' length and 4x, its threshold theirs.
    fn without_model(&self, knobs: &Knobs) -> std::result::Result<Portrait, String> {
        Ok(Portrait::Interpolation {
            config: PositionalConfig::Fire(Self::threshold(knobs.threshold)),
            title: format!(
                "fire, {} heads, threshold {}: the bias at initialisation (seed 0)",
                knobs.heads, knobs.threshold
            ),
            note: "inputs sign(j - i) ln(|c| |j - i| + 1) / ln(|c| max(L, span) + 1): up to the \
                   threshold the curve is the raw one; at 4x the span it is stretched to the \
                   same [-1, 1] (fire_by_relative_offset.png)"
                .into(),
        })
    }

    fn measure(&self) -> Option<Measure> {
        Some(Measure::Interpolation)
    }
}

impl Bench for FireOptions {
    fn forward_flops(&self, shape: &SchemeShape, batch: usize, seq: usize) -> f64 {
        self.adaptive
            .map_or(0.0, |a| a.forward_flops(shape, batch, seq))
    }
}

impl ScoreMemory for FireOptions {
    fn score_tensors(&self, training: bool, _fused: bool) -> usize {
        self.adaptive.map_or(1, |a| a.score_tensors(training))
    }
}

/// FIRE's module: the MLP, `c` and `l_multiplier`.
#[derive(Debug)]
pub struct Fire {
    mlp1: Linear,
    mlp2: Linear,
    /// `(1)`
    c: Tensor,
    /// `(1)`
    l_multiplier: Tensor,
    threshold: f64,
    /// The paper's causal inputs (normalised by the query's position) in place of the
    /// encoder's.
    causal: bool,
}

impl Fire {
    /// The module under `vb` (`fire.mlp1.{weight,bias}`, `fire.mlp2.weight` and, under DAPE's
    /// MLP, `fire.mlp2.bias`, `fire.c`, `fire.l_multiplier`).
    pub fn new(options: &FireOptions, heads: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            mlp1: linear(1, options.width, vb.pp("mlp1"))?,
            // No output bias: a constant per head added to every score of the head is cancelled
            // by the softmax, so it could never learn (its gradient is exactly zero); DAPE's MLP
            // reads the bias, where it is not.
            mlp2: match options.adaptive {
                Some(_) => linear(options.width, heads, vb.pp("mlp2"))?,
                None => linear_no_bias(options.width, heads, vb.pp("mlp2"))?,
            },
            c: vb.get_with_hints(1, "c", Init::Const(0.1))?,
            l_multiplier: vb.get_with_hints(1, "l_multiplier", Init::Const(1.0))?,
            threshold: options.threshold,
            causal: false,
        })
    }

    /// The same module with the paper's causal inputs (normalised by the query's position)
    /// when `causal`, the encoder's otherwise.
    pub fn with_causal(self, causal: bool) -> Self {
        Self { causal, ..self }
    }

    /// The interpolation threshold `L`.
    pub fn threshold(&self) -> f64 {
        self.threshold
    }

    /// `(|c|, |l_multiplier|)` as they stand.
    pub fn scalars(&self) -> Result<(f64, f64)> {
        let v =
            |t: &Tensor| -> Result<f64> { Ok(t.to_dtype(DType::F64)?.to_vec1::<f64>()?[0].abs()) };
        Ok((v(&self.c)?, v(&self.l_multiplier)?))
    }

    /// The distinct MLP inputs of a batch, and where each query-key pair reads its own.
    ///
    /// The input depends on the offset `p_j - p_i` and the sequence's span only, so the MLP runs
    /// once per distinct (span, offset), at most `2t - 1` per distinct span, not per pair. When
    /// the positions are shared (`r = 1`) and every sequence has the same span (no padding), the
    /// bias is one `(1, h, t, t)` block for the whole batch. `spans` are the batch's
    /// ([`spans`]).
    fn distinct_inputs(&self, batch: &BiasBatch, spans: &[u32]) -> Result<DistinctInputs> {
        let (r, t) = (batch.positions.rows(), batch.positions.len());
        if self.causal {
            return self.distinct_causal_inputs(batch, r);
        }
        let rows = if one_block(batch, spans) {
            1
        } else {
            spans.len()
        };
        let row_of = |k: usize| batch.positions.row(if r == 1 { 0 } else { k });
        let mut distinct: std::collections::HashMap<(u32, i64), u32> = Default::default();
        let (mut sign, mut distance, mut span) = (Vec::new(), Vec::new(), Vec::new());
        let mut index = Vec::with_capacity(rows * t * t);
        for (k, &s) in spans.iter().enumerate().take(rows) {
            let p = row_of(k);
            for &query in p {
                for &key in p {
                    let rel = i64::from(key) - i64::from(query);
                    let next = distinct.len() as u32;
                    let u = *distinct.entry((s, rel)).or_insert_with(|| {
                        sign.push(rel.signum() as f64);
                        distance.push(rel.unsigned_abs() as f64);
                        span.push(f64::from(s));
                        next
                    });
                    index.push(u);
                }
            }
        }
        let x = self.normalised(batch, sign, distance, span)?;
        Ok(DistinctInputs { x, index, rows, t })
    }

    /// The causal inputs of a batch whose positions have `r` rows: they depend on the query's
    /// position and its distance to the key only (not on the padding), so one block per row of
    /// positions.
    fn distinct_causal_inputs(&self, batch: &BiasBatch, r: usize) -> Result<DistinctInputs> {
        let t = batch.positions.len();
        let mut distinct: std::collections::HashMap<(u32, u32), u32> = Default::default();
        let (mut distance, mut reach) = (Vec::new(), Vec::new());
        let mut index = Vec::with_capacity(r * t * t);
        for k in 0..r {
            let p = batch.positions.row(k);
            for &query in p {
                for &key in p {
                    let d = query.saturating_sub(key);
                    let next = distinct.len() as u32;
                    let u = *distinct.entry((query, d)).or_insert_with(|| {
                        distance.push(f64::from(d));
                        reach.push(f64::from(query));
                        next
                    });
                    index.push(u);
                }
            }
        }
        let sign = vec![1.0; distance.len()];
        let x = self.normalised(batch, sign, distance, reach)?;
        Ok(DistinctInputs {
            x,
            index,
            rows: r,
            t,
        })
    }

    /// `sign · psi(distance) / (psi(max(L, reach)) + 1e-6)` of each distinct input, `(u)`:
    /// `reach` the span (encoder) or the query's position (causal).
    fn normalised(
        &self,
        batch: &BiasBatch,
        sign: Vec<f64>,
        distance: Vec<f64>,
        span: Vec<f64>,
    ) -> Result<Tensor> {
        let (dtype, device) = (batch.dtype, batch.device);
        let host = |v: Vec<f64>| -> Result<Tensor> {
            let len = v.len();
            Ok(Tensor::from_vec(v, len, &Device::Cpu)?
                .to_dtype(dtype)?
                .to_device(device)?)
        };
        let c = self.c.abs()?;
        let psi = |z: &Tensor| -> Result<Tensor> { Ok((z.broadcast_mul(&c)? + 1.0)?.log()?) };
        // max(L, span), with the branch chosen by value: the gradient reaches l_multiplier
        // where L is the larger, as the maximum's does.
        let l = (self.l_multiplier.abs()? * self.threshold)?; // (1)
        let l_value = l.to_dtype(DType::F64)?.to_vec1::<f64>()?[0];
        let longer: Vec<f64> = span
            .iter()
            .map(|&s| f64::from(u8::from(s > l_value)))
            .collect();
        let longer = host(longer)?;
        let reach = (host(span)?.mul(&longer)? + longer.affine(-1.0, 1.0)?.broadcast_mul(&l)?)?;
        let norm = (psi(&reach)? + 1e-6)?;
        Ok(host(sign)?.mul(&psi(&host(distance)?)?)?.div(&norm)?) // (u)
    }

    /// The MLP's inputs for every query-key pair.
    ///
    /// # Shapes
    /// - returns `(n, t, t)`, `n` 1 when the positions are shared and every sequence has the
    ///   same span, else the mask's rows (`b`) or, without a mask, the positions' (`r`); values
    ///   in `[-1, 1]`, differentiable in `c` and `l_multiplier`
    pub fn inputs(&self, batch: &BiasBatch) -> Result<Tensor> {
        let d = self.distinct_inputs(batch, &spans(batch)?)?;
        let index = Tensor::from_vec(d.index, d.rows * d.t * d.t, batch.device)?;
        Ok(d.x.index_select(&index, 0)?.reshape((d.rows, d.t, d.t))?)
    }

    /// # Shapes
    /// - returns `(n, h, t, t)` (`n` as in [`Fire::inputs`]); differentiable in every FIRE
    ///   variable
    pub fn bias(&self, batch: &BiasBatch) -> Result<Tensor> {
        match self.bias_or_offsets(batch, &spans(batch)?, false)? {
            Ok(table) => Ok(table),
            Err(v) => offset_bias(&v),
        }
    }

    /// [`Fire::bias`] as a table (`Ok`), or (`Err`, when `by_offset` asks for it and the
    /// bias is a function of the offset alone, the same for every sequence: shared positions
    /// `start..start + t` with one span, in the encoder's form) its values by offset
    /// `(1, h, 2t - 1)`.
    fn bias_or_offsets(
        &self,
        batch: &BiasBatch,
        spans: &[u32],
        by_offset: bool,
    ) -> Result<std::result::Result<Tensor, Tensor>> {
        let DistinctInputs { x, index, rows, t } = self.distinct_inputs(batch, spans)?;
        let u = x.dim(0)?;
        let hidden = self.mlp1.forward(&x.reshape((u, 1))?, batch.backend)?; // (u, width)
        let out = self.mlp2.forward(&hidden.relu()?, batch.backend)?; // (u, h)
        let h = out.dim(1)?;
        if batch.positions.as_range().is_some() && !self.causal {
            // Shared positions `start..start + t`: each row's input is a function of the offset,
            // and the bias is built from its 2t - 1 offsets (its gradient a sum per diagonal,
            // where a gather's is a nearly serial index_add on CUDA). Offset j - i is the pair
            // (0, j) for j >= i, (i, 0) otherwise.
            let mut offsets = Vec::with_capacity(rows * (2 * t - 1));
            for k in 0..rows {
                let pairs = &index[k * t * t..(k + 1) * t * t];
                offsets.extend((1..t).rev().map(|i| pairs[i * t]));
                offsets.extend(pairs[..t].iter().copied());
            }
            let offsets = Tensor::from_vec(offsets, rows * (2 * t - 1), batch.device)?;
            let v = out
                .index_select(&offsets, 0)? // (rows (2t - 1), h)
                .reshape((rows, 2 * t - 1, h))?
                .transpose(1, 2)?
                .contiguous()?; // (rows, h, 2t - 1)
            return match by_offset && rows == 1 {
                true => Ok(Err(v)),
                false => Ok(Ok(offset_bias(&v)?)),
            };
        }
        // Element (k, head, i, j) of the bias reads out[index[k, i, j], head].
        let mut gather = Vec::with_capacity(rows * h * t * t);
        for k in 0..rows {
            let pairs = &index[k * t * t..(k + 1) * t * t];
            for head in 0..h as u32 {
                gather.extend(pairs.iter().map(|&u| u * h as u32 + head));
            }
        }
        let gather = Tensor::from_vec(gather, rows * h * t * t, batch.device)?;
        Ok(Ok(out
            .flatten_all()?
            .index_select(&gather, 0)?
            .reshape((rows, h, t, t))?))
    }
}

/// A batch's distinct FIRE inputs `x` (`(u)`), and for every (row, query, key) the input it
/// reads (`rows × t × t` indices into `x`).
struct DistinctInputs {
    x: Tensor,
    index: Vec<u32>,
    rows: usize,
    t: usize,
}

/// Each sequence's span over its real tokens (the largest position less the smallest).
fn spans(batch: &BiasBatch) -> Result<Vec<u32>> {
    let positions = batch.positions;
    let (r, t) = (positions.rows(), positions.len());
    let real: Vec<Vec<bool>> = match batch.mask {
        Some(mask) => mask
            .to_dtype(DType::F64)?
            .to_vec2::<f64>()?
            .into_iter()
            .map(|row| row.into_iter().map(|v| v > 0.0).collect())
            .collect(),
        None => vec![vec![true; t]; r],
    };
    let n = real.len();
    if r != 1 && r != n {
        return Err(Error::Input(format!(
            "fire: positions of {r} rows for a batch of {n} sequences: give one row, or one \
             per sequence"
        )));
    }
    let row_of = |k: usize| positions.row(if r == 1 { 0 } else { k });
    Ok(real
        .iter()
        .enumerate()
        .map(|(k, real)| {
            let kept = row_of(k)
                .iter()
                .zip(real)
                .filter(|(_, &m)| m)
                .map(|(&v, _)| v);
            let (lo, hi) = kept.fold((u32::MAX, 0), |(lo, hi), v| (lo.min(v), hi.max(v)));
            hi.saturating_sub(lo)
        })
        .collect())
}

/// Whether the encoder's bias is one block for the whole batch: shared positions and one span.
fn one_block(batch: &BiasBatch, spans: &[u32]) -> bool {
    batch.positions.rows() == 1 && spans.iter().all(|&s| s == spans[0])
}

impl BiasModule for Fire {
    fn layer_biases(&self, batch: &BiasBatch) -> Result<LayerBiases> {
        Ok(LayerBiases::Shared(self.bias(batch)?))
    }

    fn offset_biases(&self, batch: &BiasBatch) -> Result<Option<LayerBiases>> {
        if batch.positions.as_range().is_none() || self.causal {
            return Ok(None);
        }
        let spans = spans(batch)?;
        if !one_block(batch, &spans) {
            return Ok(None);
        }
        Ok(match self.bias_or_offsets(batch, &spans, true)? {
            Err(v) => Some(LayerBiases::Shared(v)),
            Ok(_) => None,
        })
    }

    fn undecayed(&self) -> Vec<Tensor> {
        let mut out = self.mlp1.undecayed();
        out.extend(self.mlp2.undecayed());
        out
    }

    fn notes(&self) -> Result<Vec<String>> {
        let (c, l) = self.scalars()?;
        Ok(vec![format!(
            "|c| = {c:.4}, |l_multiplier| = {l:.4}: L = {:.1} (threshold {}); inputs are \
             stretched over max(L, {})",
            l * self.threshold,
            self.threshold,
            if self.causal {
                "the query's position"
            } else {
                "span"
            }
        )])
    }

    fn parameters(&self) -> Vec<Tensor> {
        let mut out = Vec::new();
        for l in [&self.mlp1, &self.mlp2] {
            out.push(l.weight().clone());
            out.extend(l.bias().cloned());
        }
        out.extend([self.c.clone(), self.l_multiplier.clone()]);
        out
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
