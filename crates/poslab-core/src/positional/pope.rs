//! PoPE (Gopalakrishnan, Csordás, Schmidhuber, Mozer 2025, "Decoupling the 'What' and 'Where'
//! With Polar Coordinate Positional Embeddings"), as x-transformers' `PolarEmbedding` computes
//! it, over every key (an encoder).
//!
//! Each of a head's `d_head` coordinates becomes one complex number: the content sets its
//! magnitude and the position its phase, so what a token is and where it is never mix:
//!
//! ```text
//! θ_c       = base^(-c/d_head),  c = 0 .. d_head - 1      (d_head frequencies; RoPE has d_head/2)
//! μ(z)      = softplus(z) = ln(1 + e^z)
//! δ_h       = clamp(layers.{l}.attn.pope.bias[h], -2π, 0)   (clamped where used)
//! score_ij  = Σ_c μ(q_ic) μ(k_jc) cos((p_i - p_j) θ_c - δ_hc) / sqrt(d_head)
//! ```
//!
//! computed in real form: q and k become `[μ cos φ | μ sin φ]`, `2 d_head` wide (`φ = p θ`, plus
//! `δ` for keys), and the score is their dot product over `sqrt(d_head)`, the original width.
//! `v` is untouched. The score reads only position differences (randomized positions apply).
//! With `δ = 0` it is even in `p_i - p_j`, so a head cannot tell a key three tokens to the left
//! from one three tokens to the right; `δ` breaks the tie. That is why `delta_init` defaults to
//! `uniform` (`δ` drawn from `[-2π, 0]`, x-transformers' `polar_bias_uniform_init`) for an
//! encoder, where the paper's causal models start it at zero (`zeros`). Each layer has its own
//! `δ` (x-transformers shares one across the stack; equal values in every layer give its
//! model). Reference: `reference_2025_schemes.py`, fixtures `encoder_pope_{pre,post}`.
//!
//! The scores are an [`nn::Polar`](crate::nn::Polar) form of q and k: on the CPU (f32, f64) the
//! fused kernels compute them inside the attention node with a hand-written backward; elsewhere
//! (CUDA, half precision, `--kernels reference`) they are composed of tensor ops.

use super::{Bench, Describe, Named, Portray, ScoreMemory};
use std::f64::consts::PI;

use candle::{DType, Device, Tensor};
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};

use super::scheme::check_base;
use super::{
    BiasBatch, Knobs, Measure, Placement, Portrait, PositionalModule, Positions, Scheme,
    SchemeShape, ScoreFunction, ScoreModule, DEFAULT_BASE,
};
use crate::error::Result;
use crate::nn::{Polar, QkScores};

/// How a layer's phase offsets `δ` start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeltaInit {
    /// Drawn uniformly from `[-2π, 0]`: left and right told apart from the first step (the
    /// default, for an encoder).
    #[default]
    Uniform,
    /// Zeros, as the paper's causal models start: every head even in the offset at first.
    Zeros,
}

fn default_base() -> f64 {
    DEFAULT_BASE
}

/// Options of `pope`: the base of its `d_head` frequencies and how its phase offsets start.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PopeOptions {
    /// The base of the frequencies `base^(-c/d_head)` (default 10,000).
    #[serde(default = "default_base")]
    pub base: f64,
    /// How `δ` starts: `uniform` in `[-2π, 0]` (default) or `zeros`.
    #[serde(default)]
    pub delta_init: DeltaInit,
}

impl Default for PopeOptions {
    fn default() -> Self {
        Self {
            base: DEFAULT_BASE,
            delta_init: DeltaInit::default(),
        }
    }
}

impl Named for PopeOptions {
    fn name(&self) -> &'static str {
        "pope"
    }
}

impl Scheme for PopeOptions {
    fn placement(&self) -> Placement {
        Placement::Scores
    }

    fn check(&self, _shape: &SchemeShape) -> std::result::Result<(), String> {
        check_base("pope", self.base)
    }

    fn param_count(&self, shape: &SchemeShape) -> u128 {
        // δ: heads × d_head = d_model per layer with positions.
        shape.d_model as u128 * shape.layers.count(shape.n_layers) as u128
    }

    fn build(&self, shape: &SchemeShape, vb: VarBuilder) -> Result<PositionalModule> {
        let init = match self.delta_init {
            DeltaInit::Uniform => Init::Uniform {
                lo: -2.0 * PI,
                up: 0.0,
            },
            DeltaInit::Zeros => Init::Const(0.0),
        };
        let (h, hd) = (shape.n_heads, shape.head_dim());
        let layers = (0..shape.n_layers)
            .map(|i| {
                shape
                    .layers
                    .contains(i)
                    .then(|| {
                        vb.pp(format!("layers.{i}.attn.pope"))
                            .get_with_hints((h, hd), "bias", init)
                    })
                    .transpose()
            })
            .collect::<candle::Result<_>>()?;
        Ok(PositionalModule::Scores(ScoreFunction::new(Pope {
            base: self.base,
            deltas: layers,
        })))
    }
}

impl Describe for PopeOptions {
    fn describe(&self, shape: &SchemeShape) -> String {
        format!(
            "attention scores: polar q and k, magnitudes softplus(q), softplus(k), phases p \
             theta_c with {} frequencies base^(-c/{}) (base {}), a learned key phase offset \
             delta in [-2 pi, 0] per head, coordinate and layer (starts {})",
            shape.head_dim(),
            shape.head_dim(),
            self.base,
            match self.delta_init {
                DeltaInit::Uniform => "uniform",
                DeltaInit::Zeros => "at zero",
            }
        )
    }

    fn label(&self) -> String {
        match self.base == DEFAULT_BASE {
            true => "pope".into(),
            false => format!("pope (base {})", self.base),
        }
    }
}

impl Portray for PopeOptions {
    fn measure(&self) -> Option<Measure> {
        Some(Measure::PolarScores)
    }

    fn without_model(&self, _knobs: &Knobs) -> std::result::Result<Portrait, String> {
        Err(
            "pope: its scores depend on q and k and on each head's learned phase δ, so they \
             exist only in a trained model: give --run DIR of a model trained with `pope`"
                .into(),
        )
    }
}

impl Bench for PopeOptions {
    fn forward_flops(&self, shape: &SchemeShape, batch: usize, seq: usize) -> f64 {
        // `q' k'ᵀ` runs over twice the head's width (a cosine and a sine part): one more
        // `2 t² d` a layer beyond the encoder's `q kᵀ`.
        let (d, t) = (shape.d_model as f64, seq as f64);
        let layers = shape.layers.count(shape.n_layers) as f64;
        2.0 * t * t * d * batch as f64 * layers
    }
}

impl ScoreMemory for PopeOptions {
    fn score_tensors(&self, training: bool, fused: bool) -> usize {
        // The composition holds the polar q and k and their gradients, about 1 and 9 attention
        // tables a layer more than `sin_add`; the fused CPU layer what `sin_add` holds
        // (measured: the book's performance page, "Measurements behind the code's choices").
        match (fused, training) {
            (true, _) => 1,
            (false, false) => 2,
            (false, true) => 12,
        }
    }
}

/// `θ_c = base^(-c/d_head)` for `c < d_head`.
pub fn pope_frequencies(head_dim: usize, base: f64) -> Vec<f64> {
    (0..head_dim)
        .map(|c| base.powf(-(c as f64) / head_dim as f64))
        .collect()
}

/// PoPE's module: the base, and every layer's stored phase offsets `(h, d_head)` (`None` for a
/// layer without positions).
#[derive(Clone, Debug)]
pub struct Pope {
    /// The base of the frequencies.
    pub base: f64,
    /// `layers.{l}.attn.pope.bias`, unclamped.
    pub deltas: Vec<Option<Tensor>>,
}

impl Pope {
    /// `cos(p θ)` and `sin(p θ)` `(r, 1, t, d_head)`, computed in f64 and rounded once.
    ///
    /// # Shapes
    /// - `positions`: `(r, t)`
    pub fn phases(
        &self,
        positions: &Positions,
        head_dim: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let freqs = pope_frequencies(head_dim, self.base);
        let (r, t) = (positions.rows(), positions.len());
        let angles: Vec<f64> = positions
            .as_slice()
            .iter()
            .flat_map(|&p| freqs.iter().map(move |f| p as f64 * f))
            .collect();
        let table = |f: fn(f64) -> f64| -> Result<Tensor> {
            let v: Vec<f64> = angles.iter().map(|&a| f(a)).collect();
            Ok(Tensor::from_vec(v, (r, 1, t, head_dim), &Device::Cpu)?
                .to_dtype(dtype)?
                .to_device(device)?)
        };
        Ok((table(f64::cos)?, table(f64::sin)?))
    }

    /// Layer `layer`'s offsets as used: clamped to `[-2π, 0]`, `(h, d_head)`.
    pub fn delta(&self, layer: usize) -> Option<Result<Tensor>> {
        self.deltas
            .get(layer)?
            .as_ref()
            .map(|d| Ok(d.clamp(-2.0 * PI, 0.0)?))
    }

    /// The polar form `[μ cos φ | μ sin φ]` of q or k ([`Polar::form`]).
    ///
    /// # Shapes
    /// - `x`: `(b, h, t, d_head)`; `cos`, `sin`: broadcast to it; returns `(b, h, t, 2 d_head)`
    pub fn polar(
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        backend: crate::nn::Backend,
    ) -> Result<Tensor> {
        Polar::form(x, cos, sin, backend)
    }
}

impl ScoreModule for Pope {
    fn batch_scores<'a>(
        &'a self,
        batch: &BiasBatch,
    ) -> Result<Vec<Option<Box<dyn QkScores + 'a>>>> {
        let Some(head_dim) = self.deltas.iter().flatten().next().map(|d| d.dim(1)) else {
            // No layer has positions.
            return Ok((0..self.deltas.len()).map(|_| None).collect());
        };
        // The phase tables depend on the positions only: made once, shared by every layer.
        let (cos, sin) = self.phases(batch.positions, head_dim?, batch.dtype, batch.device)?;
        (0..self.deltas.len())
            .map(|layer| {
                Ok(self.delta(layer).transpose()?.map(|delta| {
                    Box::new(PopeScores(Polar::new(cos.clone(), sin.clone(), delta)))
                        as Box<dyn QkScores + 'a>
                }))
            })
            .collect()
    }

    fn notes(&self) -> Result<Vec<String>> {
        self.deltas
            .iter()
            .enumerate()
            .map(|(l, d)| {
                let Some(d) = d else {
                    return Ok(format!("layer {l}: no positions"));
                };
                let d = d.clamp(-2.0 * PI, 0.0)?.to_dtype(DType::F64)?;
                let means = d.mean(1)?.to_vec1::<f64>()?;
                Ok(format!(
                    "layer {l}: mean key phase offset delta per head [{}] (in [-2 pi, 0])",
                    super::list(&means)
                ))
            })
            .collect()
    }

    fn parameters(&self) -> Vec<Tensor> {
        self.deltas.iter().flatten().cloned().collect()
    }

    fn undecayed(&self) -> Vec<Tensor> {
        // Decay would pull every phase offset toward 0, where a head cannot tell left from
        // right.
        self.parameters()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// One layer's PoPE for one batch: the phase tables `(r, 1, t, d_head)` and the clamped
/// offsets `(h, d_head)`.
#[derive(Debug)]
struct PopeScores(Polar);

impl QkScores for PopeScores {
    fn scores(
        &self,
        q: &Tensor,
        k: &Tensor,
        _x: &Tensor,
        scale: f64,
        backend: crate::nn::Backend,
    ) -> Result<Tensor> {
        self.0.scores(q, k, scale, backend)
    }

    fn polar(&self) -> Option<&Polar> {
        Some(&self.0)
    }
}
