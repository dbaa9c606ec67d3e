//! DAPE (Zheng, Gao, Shi, Huang, Li, Xiong, Ren, Ng, Jiang, Li, Li, NeurIPS 2024, "DAPE:
//! Data-Adaptive Positional Encoding for Length Extrapolation"): `adaptive = { width = … }` on a
//! bias scheme (`alibi`, `kerple`, `fire`, `t5`) adds a small MLP over each query-key pair's
//! content logits and biases, across the heads:
//!
//! ```text
//! u_ij      = [s_0, …, s_{H-1}, b_0, …, b_{H-1}]_ij       s = q kᵀ / sqrt(d_head), b the scheme's bias
//! m_ij      = W2 leaky_relu(W1 u_ij + c1)                 2H -> width -> H, slope 0.01
//! score_ij  = s_ij + b_ij + m_ij
//! ```
//!
//! Both `s` and `b` stay as residuals, and the logits enter the MLP undetached (gradients flow
//! through both). The MLP runs over every pair and the masks come after it, as DAPE's code
//! (causal there), so the causal form is the masked one and the encoder's runs over every key
//! with the scheme's bidirectional bias. Per layer with positions:
//! `layers.{l}.attn.dape.mlp1.{weight (width, 2H), bias (width)}` and
//! `layers.{l}.attn.dape.mlp2.weight (H, width)`, initialised as PyTorch's `nn.Linear` (DAPE's).
//! DAPE's output layer has a bias `c2` too; it adds the same number to every score of a head,
//! which the softmax cancels exactly, so poslab leaves it out (as FIRE's: a file holding
//! `dape.mlp2.bias`, as the reference fixtures do, loads without it). Since `s` enters the MLP,
//! a key bias is a real parameter, and the key projection has one. Reference:
//! `reference_2026_schemes.py`, fixtures `encoder_{alibi,causal_alibi}_adaptive_pre`,
//! `encoder_kerple_adaptive_post`, `encoder_fire_adaptive_pre`,
//! `encoder_causal_fire_adaptive_post`, `encoder_t5_adaptive_post`.
//!
//! A scheme with `adaptive` computes its scores itself: its bias module is wrapped in [`Dape`],
//! a scores module (the MLP needs the whole `(t, t)` logits). `s + b + m` is
//! [`crate::nn::channel_mlp`]: one node with its backward on the fused CPU kernels, which
//! stores neither `u` nor the hidden layer; elsewhere a composition that keeps `width` tables
//! of hidden values. Cost: `O(t² H width)` a layer.

use candle::Tensor;
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use super::{
    BiasBatch, Placement, PositionalModule, SchemeShape, ScoreBias, ScoreFunction, ScoreModule,
};
use crate::error::{Error, Result};
use crate::nn::{linear, linear_no_bias, Backend, Linear, QkScores};
use crate::params::LowerBound;

/// LeakyReLU's negative slope (PyTorch's default, DAPE's).
pub const DAPE_SLOPE: f64 = 0.01;

/// The widest DAPE MLP poslab takes: its hidden layer is computed for every query-key pair.
pub const MAX_DAPE_WIDTH: usize = 1024;

fn default_width() -> usize {
    32
}

/// `adaptive = { width = 32 }`: DAPE's MLP over the logits and the bias, `width` its hidden
/// width (default 32, DAPE's `mlp_width`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Adaptive {
    /// The MLP's hidden width.
    #[serde(default = "default_width")]
    pub width: usize,
}

impl Default for Adaptive {
    fn default() -> Self {
        Self {
            width: default_width(),
        }
    }
}

impl Adaptive {
    /// Where a bias scheme acts with `adaptive` (its scores, computed whole) or without (a bias).
    pub fn placement(adaptive: Option<&Self>) -> Placement {
        match adaptive {
            Some(_) => Placement::Scores,
            None => Placement::ScoreBias,
        }
    }

    /// Checks the width; `kind` names the scheme in the message.
    pub fn check(&self, kind: &str) -> std::result::Result<(), String> {
        if self.width == 0 || self.width > MAX_DAPE_WIDTH {
            return Err(format!(
                "{kind}: adaptive.width = {} must be between 1 and {MAX_DAPE_WIDTH}: the hidden \
                 width of DAPE's MLP over each pair's logits and biases (32 is DAPE's)",
                self.width
            ));
        }
        Ok(())
    }

    /// The MLPs' trainable values in an encoder of `shape`: one per layer with positions.
    pub fn param_count(&self, shape: &SchemeShape) -> u128 {
        let (w, h) = (self.width as u128, shape.n_heads as u128);
        (w * 2 * h + w + h * w) * shape.layers.count(shape.n_layers) as u128
    }

    /// A bias scheme's label: its name, marked `(adaptive)` under DAPE's MLP.
    pub fn label(adaptive: Option<&Self>, name: &str) -> String {
        match adaptive {
            Some(_) => format!("{name} (adaptive)"),
            None => name.into(),
        }
    }

    /// What `inspect` adds to the scheme's line.
    pub fn describe(&self, heads: usize) -> String {
        format!(
            "; plus DAPE's MLP ({} -> {} -> {heads}, LeakyReLU) over each pair's logits and \
             biases of every head, per layer (adaptive)",
            2 * heads,
            self.width
        )
    }

    /// The FLOPs of the MLPs in a forward pass of `batch` sequences of `seq` tokens.
    pub fn forward_flops(&self, shape: &SchemeShape, batch: usize, seq: usize) -> f64 {
        let (w, h, t) = (self.width as f64, shape.n_heads as f64, seq as f64);
        let layers = shape.layers.count(shape.n_layers) as f64;
        2.0 * t * t * (2.0 * h * w + w * h) * batch as f64 * layers
    }

    /// The attention tables a layer holds at its peak (see [`super::ScoreMemory`]), as the
    /// composition holds them: the logits and bias joined, the hidden layer before and after its
    /// activation (`width` each) and the sums, with their gradients in a step. The fused CPU
    /// node stores neither the join nor the hidden layer, so it stays below this.
    pub fn score_tensors(&self, training: bool) -> usize {
        let hidden = 2 * self.width + 8;
        match training {
            false => hidden,
            true => 3 * hidden,
        }
    }

    /// The scheme's bias module `inner` with DAPE's MLPs in every layer with positions, as a
    /// scores module.
    pub fn build(
        &self,
        shape: &SchemeShape,
        vb: &VarBuilder,
        inner: ScoreBias,
    ) -> Result<PositionalModule> {
        let h = shape.n_heads;
        let layers = (0..shape.n_layers)
            .map(|i| -> Result<Option<DapeMlp>> {
                if !shape.layers.contains(i) {
                    return Ok(None);
                }
                let vb = vb.pp(format!("layers.{i}.attn.dape"));
                Ok(Some(DapeMlp {
                    mlp1: linear(2 * h, self.width, vb.pp("mlp1"))?,
                    mlp2: linear_no_bias(self.width, h, vb.pp("mlp2"))?,
                }))
            })
            .collect::<Result<_>>()?;
        Ok(PositionalModule::Scores(ScoreFunction::new(Dape {
            inner,
            layers,
        })))
    }

    /// A bias scheme's module: `inner` alone, or wrapped with DAPE's MLPs when `adaptive`.
    pub fn wrap(
        adaptive: Option<&Self>,
        shape: &SchemeShape,
        vb: &VarBuilder,
        inner: ScoreBias,
    ) -> Result<PositionalModule> {
        match adaptive {
            Some(a) => a.build(shape, vb, inner),
            None => Ok(PositionalModule::ScoreBias(inner)),
        }
    }
}

/// One layer's DAPE MLP: `mlp1` `(width, 2H)` with its bias and `mlp2` `(H, width)` without.
#[derive(Clone, Debug)]
pub struct DapeMlp {
    /// `layers.{l}.attn.dape.mlp1`
    pub mlp1: Linear,
    /// `layers.{l}.attn.dape.mlp2`
    pub mlp2: Linear,
}

impl DapeMlp {
    /// `s + b + MLP([s, b])` `(n, h, t, t)`: the logits `s` `(n, h, t, t)` with the bias `b`
    /// (`(1 or n, h, t, t)`) and DAPE's term, in the MLP's dtype, computed where `backend` says
    /// ([`crate::nn::channel_mlp`]).
    pub fn scores(&self, s: &Tensor, bias: &Tensor, backend: Backend) -> Result<Tensor> {
        let dtype = self.mlp1.weight().dtype();
        let (n, h, t, _) = s.dims4()?;
        // The heads are the MLP's channels, each pair a column: (n, h, t t).
        let s = s.to_dtype(dtype)?.reshape((n, h, t * t))?;
        let b = bias.to_dtype(dtype)?.reshape((bias.dim(0)?, h, t * t))?;
        let c1 = self.mlp1.bias_or_zeros()?;
        let weights = (self.mlp1.weight(), &c1, self.mlp2.weight());
        let out = crate::nn::channel_mlp(&s, &b, weights, DAPE_SLOPE, backend)?;
        Ok(out.reshape((n, h, t, t))?)
    }
}

/// A bias scheme with DAPE's MLP in every layer with positions: the scheme's own module, and
/// the MLPs (`None` for a layer without positions).
#[derive(Debug)]
pub struct Dape {
    inner: ScoreBias,
    layers: Vec<Option<DapeMlp>>,
}

impl Dape {
    /// The scheme's bias module, as it is without DAPE.
    pub fn inner(&self) -> &ScoreBias {
        &self.inner
    }

    /// Layer `layer`'s MLP, where it has one.
    pub fn layer(&self, layer: usize) -> Option<&DapeMlp> {
        self.layers.get(layer)?.as_ref()
    }
}

impl ScoreModule for Dape {
    fn batch_scores<'a>(
        &'a self,
        batch: &BiasBatch,
    ) -> Result<Vec<Option<Box<dyn QkScores + 'a>>>> {
        let biases = self.inner.layer_biases(batch)?;
        self.layers
            .iter()
            .enumerate()
            .map(|(i, mlp)| {
                let Some(mlp) = mlp else {
                    return Ok(None);
                };
                let bias = biases.layer(i).cloned().ok_or_else(|| {
                    Error::Input(format!(
                        "adaptive: layer {i}'s bias depends on its input, which DAPE does not \
                         take"
                    ))
                })?;
                Ok(Some(
                    Box::new(DapeScores { mlp, bias }) as Box<dyn QkScores + 'a>
                ))
            })
            .collect()
    }

    fn notes(&self) -> Result<Vec<String>> {
        let mut notes = self.inner.notes()?;
        for (l, mlp) in self.layers.iter().enumerate() {
            let Some(mlp) = mlp else { continue };
            notes.push(format!(
                "layer {l}: DAPE MLP weight norms {:.4} (in), {:.4} (out)",
                super::weight_norm(mlp.mlp1.weight())?,
                super::weight_norm(mlp.mlp2.weight())?
            ));
        }
        Ok(notes)
    }

    fn parameters(&self) -> Vec<Tensor> {
        let mut out = self.inner.parameters();
        for mlp in self.layers.iter().flatten() {
            for l in [&mlp.mlp1, &mlp.mlp2] {
                out.push(l.weight().clone());
                out.extend(l.bias().cloned());
            }
        }
        out
    }

    fn undecayed(&self) -> Vec<Tensor> {
        let mut out = self.inner.undecayed();
        for mlp in self.layers.iter().flatten() {
            out.extend(
                [&mlp.mlp1, &mlp.mlp2]
                    .iter()
                    .filter_map(|l| l.bias().cloned()),
            );
        }
        out
    }

    fn constraints(&self) -> Vec<LowerBound> {
        self.inner.constraints()
    }

    fn base_bias(&self) -> Option<&ScoreBias> {
        Some(&self.inner)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// One layer's DAPE for one batch: its MLP and the scheme's bias `(r, h, t, t)`.
#[derive(Debug)]
struct DapeScores<'a> {
    mlp: &'a DapeMlp,
    bias: Tensor,
}

impl QkScores for DapeScores<'_> {
    fn scores(
        &self,
        q: &Tensor,
        k: &Tensor,
        _x: &Tensor,
        scale: f64,
        backend: Backend,
    ) -> Result<Tensor> {
        // The logits in the MLP's dtype (the parameters', f32 under mixed precision): the MLP
        // reads them, and its gradients sum over every pair.
        let dtype = self.mlp.mlp1.weight().dtype();
        let (q, k) = (q.to_dtype(dtype)?, k.to_dtype(dtype)?);
        let s = (crate::nn::matmul(&q, &k.t()?)? * scale)?;
        self.mlp.scores(&s, &self.bias, backend)
    }
}
