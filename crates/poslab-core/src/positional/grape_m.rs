//! GRAPE-M (Zhang, Chen, Liu, Qin, Yuan, Xu, Gu, Yao, ICLR 2026, "Group Representational Position
//! Encoding"; its non-contextual, commuting multi-subspace form, `llama-mha-grape-m-nonctx`):
//! RoPE's planes with learned frequencies.
//!
//! A head's `d_head` coordinates are split in halves `x = [a | b]` (the half pairing, always),
//! and each plane `(a_c, b_c)` turns by `-p f_c`, the opposite sense to poslab's RoPE:
//!
//! ```text
//! f_c       = exp(log_freq_c / s),  c < d_head/2            s = log_freq_scale (16)
//! G(p) x    = [a cos(p f) + b sin(p f) | -a sin(p f) + b cos(p f)]
//! score_ij  = (G(p_i) q_i) . (G(p_j) k_j) / sqrt(d_head)
//! ```
//!
//! `layers.{l}.attn.grape.log_freq` `(d_head/2)` per layer, shared by the heads, starts at
//! `s ln(base^(-2c/d_head))`, RoPE's spectrum, so an untrained GRAPE-M is RoPE (half pairing) at
//! negated positions. The scale `s` is the original's device for a larger effective learning
//! rate on the frequencies (an update of `log_freq` moves `ln f` by `1/s` of it). Relative: a
//! shift of every position changes nothing, so the encoder form is the same over every key and
//! the causal form is the masked one. Not included (as the specification): GRAPE's QK-RMSNorm,
//! per-head spectra and the contextual GRAPE-M. Reference: `reference_2026_schemes.py`, fixtures
//! `encoder_grape_m_pre`, `encoder_grape_m_h4_post` and `encoder_causal_grape_m_pre`.
//!
//! The angles are a differentiable function of `log_freq`, so the rotation is composed of tensor
//! ops on every path (the fused kernels' rotation takes fixed tables).

use candle::{DType, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use super::scheme::check_base;
use super::{
    Bench, BiasBatch, Describe, Named, Placement, Portray, PositionalModule, Positions, Scheme,
    SchemeShape, ScoreFunction, ScoreMemory, ScoreModule, DEFAULT_BASE,
};
use crate::error::Result;
use crate::nn::QkScores;

fn default_base() -> f64 {
    DEFAULT_BASE
}

fn default_scale() -> f64 {
    16.0
}

/// Options of `grape_m`: the base its frequencies start from (RoPE's spectrum) and the scale of
/// the stored log-frequencies.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrapeMOptions {
    /// The base of the starting frequencies `base^(-2c/d_head)` (default 10,000).
    #[serde(default = "default_base")]
    pub base: f64,
    /// `s` in `f = exp(log_freq / s)` (default 16, the original's).
    #[serde(default = "default_scale")]
    pub log_freq_scale: f64,
}

impl Default for GrapeMOptions {
    fn default() -> Self {
        Self {
            base: DEFAULT_BASE,
            log_freq_scale: default_scale(),
        }
    }
}

impl GrapeMOptions {
    /// The stored values a layer starts at: `s ln(base^(-2c/d_head))` for `c < d_head/2`, the
    /// logarithms of RoPE's frequencies.
    pub fn initial_log_freq(&self, head_dim: usize) -> Vec<f64> {
        super::sinusoidal::inverse_frequencies(head_dim, self.base)
            .into_iter()
            .map(|w| self.log_freq_scale * w.ln())
            .collect()
    }
}

impl Named for GrapeMOptions {
    fn name(&self) -> &'static str {
        "grape_m"
    }
}

impl Scheme for GrapeMOptions {
    fn placement(&self) -> Placement {
        Placement::Scores
    }

    fn check(&self, shape: &SchemeShape) -> std::result::Result<(), String> {
        check_base("grape_m", self.base)?;
        if !(self.log_freq_scale.is_finite() && self.log_freq_scale > 0.0) {
            return Err(format!(
                "grape_m: log_freq_scale = {} must be a finite number above 0 (16 is the \
                 original's): the frequencies are exp(log_freq / log_freq_scale)",
                self.log_freq_scale
            ));
        }
        let head_dim = shape.head_dim();
        if head_dim < 2 || !head_dim.is_multiple_of(2) {
            return Err(format!(
                "grape_m turns planes of two coordinates, so the head width must be even, but \
                 d_model / n_heads = {head_dim}: change d_model or n_heads"
            ));
        }
        Ok(())
    }

    fn param_count(&self, shape: &SchemeShape) -> u128 {
        (shape.head_dim() / 2) as u128 * shape.layers.count(shape.n_layers) as u128
    }

    fn build(&self, shape: &SchemeShape, vb: VarBuilder) -> Result<PositionalModule> {
        let head_dim = shape.head_dim();
        let layers = (0..shape.n_layers)
            .map(|i| {
                shape
                    .layers
                    .contains(i)
                    .then(|| {
                        crate::params::get_with_values(
                            &vb.pp(format!("layers.{i}.attn.grape")),
                            head_dim / 2,
                            "log_freq",
                            self.initial_log_freq(head_dim),
                        )
                    })
                    .transpose()
            })
            .collect::<Result<_>>()?;
        Ok(PositionalModule::Scores(ScoreFunction::new(GrapeM {
            log_freq_scale: self.log_freq_scale,
            log_freqs: layers,
        })))
    }
}

impl Describe for GrapeMOptions {
    fn describe(&self, shape: &SchemeShape) -> String {
        format!(
            "attention scores: q and k turned in {} planes (half pairing) by -p f_c, the \
             frequencies f = exp(log_freq / {}) learned per layer, starting at RoPE's (base {})",
            shape.head_dim() / 2,
            self.log_freq_scale,
            self.base
        )
    }
}

impl Portray for GrapeMOptions {}

impl Bench for GrapeMOptions {}

impl ScoreMemory for GrapeMOptions {
    fn score_tensors(&self, training: bool, _fused: bool) -> usize {
        // Composed on every path: the scores, the windowed scores and the softmax in a forward,
        // and their gradients in a step, as PoPE's composition.
        match training {
            false => 2,
            true => 12,
        }
    }
}

/// The tables of GRAPE's rotation `G(p)` by angles `p f_c`: `cos` and `-sin`, `(r, t, 2 w)`
/// laid out for the half pairing (`[c_0 .. c_{w-1}, c_0 .. c_{w-1}]`), so that
/// [`crate::nn::rope_rotate_reference`] with them turns each plane by `-p f_c`. Differentiable in
/// `freqs`.
///
/// # Shapes
/// - `freqs`: `(w)`; the positions `(r, t)`; returns two `(r, t, 2 w)` in `freqs`' dtype
pub fn grape_tables(positions: &Positions, freqs: &Tensor) -> Result<(Tensor, Tensor)> {
    let w = freqs.dim(0)?;
    let pos = positions
        .tensor(freqs.device())?
        .to_dtype(freqs.dtype())?
        .unsqueeze(2)?; // (r, t, 1)
    let angles = pos.broadcast_mul(&freqs.reshape((1, 1, w))?)?; // (r, t, w)
    let (cos, sin) = (angles.cos()?, angles.sin()?.neg()?);
    Ok((
        Tensor::cat(&[&cos, &cos], 2)?,
        Tensor::cat(&[&sin, &sin], 2)?,
    ))
}

/// GRAPE's rotation `G(p) x` of `x` `(b, h, t, 2 w)` by [`grape_tables`], in the tables' dtype.
pub fn grape_rotate(x: &Tensor, cos: &Tensor, neg_sin: &Tensor) -> Result<Tensor> {
    Ok(crate::nn::rope_rotate_reference(
        &x.to_dtype(cos.dtype())?,
        cos,
        neg_sin,
        false,
    )?)
}

/// GRAPE-M's module: every layer's stored log-frequencies `(d_head/2)` (`None` for a layer
/// without positions) and their scale.
#[derive(Clone, Debug)]
pub struct GrapeM {
    /// `s` in `f = exp(log_freq / s)`.
    pub log_freq_scale: f64,
    /// `layers.{l}.attn.grape.log_freq`.
    pub log_freqs: Vec<Option<Tensor>>,
}

impl GrapeM {
    /// Layer `layer`'s frequencies `exp(log_freq / s)`, `(d_head/2)`.
    pub fn frequencies(&self, layer: usize) -> Option<Result<Tensor>> {
        let lf = self.log_freqs.get(layer)?.as_ref()?;
        Some(
            (lf / self.log_freq_scale)
                .and_then(|l| l.exp())
                .map_err(Into::into),
        )
    }
}

impl ScoreModule for GrapeM {
    fn batch_scores<'a>(
        &'a self,
        batch: &BiasBatch,
    ) -> Result<Vec<Option<Box<dyn QkScores + 'a>>>> {
        (0..self.log_freqs.len())
            .map(|layer| {
                let Some(freqs) = self.frequencies(layer).transpose()? else {
                    return Ok(None);
                };
                let (cos, neg_sin) = grape_tables(batch.positions, &freqs)?;
                Ok(Some(
                    Box::new(GrapeMScores { cos, neg_sin }) as Box<dyn QkScores + 'a>
                ))
            })
            .collect()
    }

    fn notes(&self) -> Result<Vec<String>> {
        (0..self.log_freqs.len())
            .map(|layer| {
                let Some(freqs) = self.frequencies(layer).transpose()? else {
                    return Ok(format!("layer {layer}: no positions"));
                };
                let f = freqs.to_dtype(DType::F64)?.to_vec1::<f64>()?;
                let periods: Vec<f64> = f.iter().map(|w| 2.0 * std::f64::consts::PI / w).collect();
                Ok(format!(
                    "layer {layer}: learned frequencies per plane [{}] (periods [{}] positions)",
                    super::list(&f),
                    super::list(&periods)
                ))
            })
            .collect()
    }

    fn parameters(&self) -> Vec<Tensor> {
        self.log_freqs.iter().flatten().cloned().collect()
    }

    fn undecayed(&self) -> Vec<Tensor> {
        // Decay would pull every log-frequency toward 0, every frequency toward 1 radian per
        // position.
        self.parameters()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// One layer's GRAPE-M for one batch: its rotation tables `(r, t, d_head)`.
#[derive(Debug)]
struct GrapeMScores {
    cos: Tensor,
    neg_sin: Tensor,
}

impl QkScores for GrapeMScores {
    fn scores(
        &self,
        q: &Tensor,
        k: &Tensor,
        _x: &Tensor,
        scale: f64,
        _backend: crate::nn::Backend,
    ) -> Result<Tensor> {
        let q = grape_rotate(q, &self.cos, &self.neg_sin)?;
        let k = grape_rotate(k, &self.cos, &self.neg_sin)?;
        Ok((crate::nn::matmul(&q, &k.t()?.contiguous()?)? * scale)?)
    }
}
