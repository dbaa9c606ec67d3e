//! PaTH attention (Yang, Shen, Wen, Tan, Mishra, Ren, Panda, Kim 2025, "PaTH Attention: Position
//! Encoding via Accumulating Householder Transformations"), as fla-org/flash-linear-attention
//! computes it, in a bidirectional form for an encoder. A **contextual** scheme: the position
//! signal is a product of reflections each token sets from its content; no position id is read.
//!
//! Every layer makes, from its attention input `x`, one unit vector `w_t` and one strength
//! `β_t ∈ (0, 2)` per token and head:
//!
//! ```text
//! u     = x W_wᵀ, zero at padded tokens                  W_w = layers.{l}.attn.path.w.weight
//! u'_t  = silu(Σ_s C[:, 0, s] u_{t-K+1+s})                a causal depthwise conv of width K
//!                                                         (C = ...path.conv.weight; K = 0: u'=u)
//! w_t   = u'_t / sqrt(|u'_t|² + 1e-6)                     per head, d_head wide
//! β_t   = 2 σ(x_t W_bᵀ + b_b), 0 at padding               ...path.beta.{weight,bias}
//! H_t   = I - β_t w_t w_tᵀ
//! score_ij = q_iᵀ H_i H_{i-1} ⋯ H_{j+1} k_j / sqrt(d_head)   j < i   (fla's causal PaTH)
//!          = q_iᵀ H_{i+1} ⋯ H_j k_j / sqrt(d_head)          j > i   (the transport back)
//!          = q_i · k_i / sqrt(d_head)                        j = i
//! ```
//!
//! **How it is computed.** The scores are an [`nn::Transport`](crate::nn::Transport) of q and k
//! by the reflections `[w | β]`: composed of tensor ops through the UT transform of the
//! Householder products (the idea of fla's blockwise kernels; `O(t³)` a head), the specification
//! and what CUDA runs; on the CPU the fused attention kernel computes them in `O(t² d_head)` a
//! head with a hand-written backward, by fla's blockwise form (blocks of 16 tokens through the
//! UT transform, as matrix products) for heads 32 wide or more, and for narrower ones by
//! carrying the keys to each query one reflection at a time. Under the `layer`
//! kernels the whole encoder layer is one node that also makes `w` and `β` from its attention
//! input (the projections, conv, silu, norm and strengths), with their weights packed after the
//! layer's ([`QkScores::input_reflections`]); under `ops` the reflections are one more fused
//! node beside the attention's.
//!
//! Against fla's default layer: `W_w` is one `[d, d]` matrix (fla's `use_low_rank_w=False`),
//! there is no forget gate and no qk norm (both fla's defaults), and q, k, v and o carry
//! poslab's biases. The conv stays causal, as in fla, even in the encoder. Weights start as fla's:
//! every matrix N(0, 0.02), the β bias at zero (β = 1). Reference: `reference_2025_schemes.py`,
//! fixtures `encoder_path_pre`, `encoder_path_h4_post`.

use super::{Bench, Describe, Named, Portray, ScoreMemory};
use candle::{DType, Tensor};
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};

use super::{
    BiasBatch, Knobs, Measure, Placement, Portrait, PositionalModule, Scheme, SchemeShape,
    ScoreFunction, ScoreModule,
};
use crate::error::Result;
use crate::nn::{InputReflections, Projections, QkScores, Transport};

pub use crate::nn::{transport_inverse, transport_scores};

/// The widest short convolution `path` accepts.
pub const MAX_PATH_CONV: usize = 64;

/// The `eps` inside the root of `w`'s normalisation (fla's `l2_norm`).
pub const PATH_EPS: f64 = 1e-6;

fn default_conv_size() -> usize {
    3
}

/// Options of `path`: the width of the short convolution.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathOptions {
    /// Width `K` of the causal depthwise convolution before `w` (default 3, fla's; 0: no
    /// convolution and no silu, fla's `use_w_shortconv=False`).
    #[serde(default = "default_conv_size")]
    pub conv_size: usize,
}

impl Default for PathOptions {
    fn default() -> Self {
        Self {
            conv_size: default_conv_size(),
        }
    }
}

impl Named for PathOptions {
    fn name(&self) -> &'static str {
        "path"
    }
}

impl Scheme for PathOptions {
    fn placement(&self) -> Placement {
        Placement::Scores
    }

    fn check(&self, _shape: &SchemeShape) -> std::result::Result<(), String> {
        if self.conv_size > MAX_PATH_CONV {
            return Err(format!(
                "path: conv_size = {} is wider than {MAX_PATH_CONV}: the short convolution reads \
                 the token and the conv_size - 1 before it (fla uses 3; 0 turns it off)",
                self.conv_size
            ));
        }
        Ok(())
    }

    fn check_random_positions(&self, range: usize) -> std::result::Result<(), String> {
        Err(format!(
            "random_positions = {range} with positional `path`: PaTH's transport runs over the \
             tokens between query and key and reads no position ids, so randomizing them would \
             change nothing; remove random_positions"
        ))
    }

    fn param_count(&self, shape: &SchemeShape) -> u128 {
        let (d, h, k) = (
            shape.d_model as u128,
            shape.n_heads as u128,
            self.conv_size as u128,
        );
        (d * d + d * k + h * d + h) * shape.layers.count(shape.n_layers) as u128
    }

    fn build(&self, shape: &SchemeShape, vb: VarBuilder) -> Result<PositionalModule> {
        let (d, h, k) = (shape.d_model, shape.n_heads, self.conv_size);
        let normal = Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        };
        let layers = (0..shape.n_layers)
            .map(|i| {
                shape
                    .layers
                    .contains(i)
                    .then(|| -> candle::Result<_> {
                        let vb = vb.pp(format!("layers.{i}.attn.path"));
                        Ok(PathLayer {
                            w: vb.get_with_hints((d, d), "w.weight", normal)?,
                            conv: match k {
                                0 => None,
                                k => Some(vb.get_with_hints((d, 1, k), "conv.weight", normal)?),
                            },
                            beta_weight: vb.get_with_hints((h, d), "beta.weight", normal)?,
                            beta_bias: vb.get_with_hints(h, "beta.bias", Init::Const(0.0))?,
                        })
                    })
                    .transpose()
            })
            .collect::<candle::Result<_>>()?;
        Ok(PositionalModule::Scores(ScoreFunction::new(Path(layers))))
    }
}

impl Describe for PathOptions {
    fn describe(&self, shape: &SchemeShape) -> String {
        let conv = match self.conv_size {
            0 => "no short conv".to_string(),
            k => format!("a causal short conv of width {k} and silu"),
        };
        format!(
            "attention scores: keys carried to the query through the Householder reflections \
             I - beta_t w_t w_t^T of the tokens between them; per layer w from x W_w^T ({d} x \
             {d}, {conv}), beta = 2 sigmoid(x W_b^T + b) per head ({h}); no position ids",
            d = shape.d_model,
            h = shape.n_heads,
        )
    }

    fn label(&self) -> String {
        match self.conv_size == default_conv_size() {
            true => "path".into(),
            false => format!("path (conv {})", self.conv_size),
        }
    }
}

impl Portray for PathOptions {
    fn measure(&self) -> Option<Measure> {
        Some(Measure::Turning)
    }

    fn without_model(&self, _knobs: &Knobs) -> std::result::Result<Portrait, String> {
        Err(
            "path: its transport comes from the content (each token's reflection), so it \
             exists only in a trained model: give --run DIR of a path model"
                .into(),
        )
    }
}

impl Bench for PathOptions {
    fn forward_flops(&self, shape: &SchemeShape, batch: usize, seq: usize) -> f64 {
        // The reflections: `x W_wᵀ` and `x W_bᵀ` (`2 t d (d + h)`) and the short convolution
        // (`2 t d k`); the transport: every key carried past each reflection between it and a
        // query, `w·k` and `k - β w (w·k)`, `2 d_head` multiply-adds a key and step, on both
        // sides: `4 t (t - 1) d` a layer. The queries' products with the carried keys are the
        // encoder's own `q kᵀ`.
        let (d, h, t) = (shape.d_model as f64, shape.n_heads as f64, seq as f64);
        let k = self.conv_size as f64;
        let layers = shape.layers.count(shape.n_layers) as f64;
        let per_sequence = 2.0 * t * d * (d + h) + 2.0 * t * d * k + 4.0 * t * (t - 1.0) * d;
        per_sequence * batch as f64 * layers
    }
}

impl ScoreMemory for PathOptions {
    fn score_tensors(&self, training: bool, fused: bool) -> usize {
        // The composition holds the transport's inverses and products and their gradients,
        // about 5 and 58 attention tables a layer more than `sin_add`; the fused CPU layer what
        // `sin_add` holds (measured: the book's performance page, "Measurements behind the code's choices"), and a training step counts a second table
        // for what the transport's backward keeps: the walk's checkpoints and history (at most 16 MiB a task
        // whole, else about `1.4 t^1.5 d_head` values), or the blocks' carried keys (at most
        // 16 MiB a task whole, else about `0.35 t^1.5 d_head`).
        match (fused, training) {
            (true, false) => 1,
            (true, true) => 2,
            (false, false) => 8,
            (false, true) => 64,
        }
    }
}

/// One layer's PaTH weights.
#[derive(Clone, Debug)]
pub struct PathLayer {
    /// `(d, d)`: `u = x W_wᵀ`.
    pub w: Tensor,
    /// `(d, 1, K)`: the depthwise short convolution (`None` when `K = 0`).
    pub conv: Option<Tensor>,
    /// `(h, d)` and `(h)`: `β = 2 σ(x W_bᵀ + b)`.
    pub beta_weight: Tensor,
    /// See `beta_weight`.
    pub beta_bias: Tensor,
}

/// What a layer's reflections are made of, for tests and analysis.
#[derive(Clone, Debug)]
pub struct Reflections {
    /// `(b, t, d)`: `silu(conv(x W_wᵀ))` before the per-head normalisation.
    pub u: Tensor,
    /// `(b, h, t, d_head)`: the unit vectors `w`.
    pub w: Tensor,
    /// `(b, h, t)`: the strengths `β`, 0 at padding.
    pub beta: Tensor,
}

impl PathLayer {
    /// The reflections of a layer's input.
    ///
    /// # Shapes
    /// - `x`: `(b, t, d)`; `mask`: `(b, t)`, 1 for a real token (`None`: all real)
    pub fn reflections(
        &self,
        x: &Tensor,
        mask: Option<&Tensor>,
        heads: usize,
        backend: crate::nn::Backend,
    ) -> Result<Reflections> {
        let (u, z) = self.projections(x)?;
        let made_of = Self::made_of(&u, self.conv.as_ref(), &z, mask, heads);
        let (u, transport) = Transport::compose(made_of, backend)?;
        let (w, beta) = transport.parts()?;
        Ok(Reflections { u, w, beta })
    }

    /// The layer's reflections as a transport: one fused node on the CPU's fused kernels, else
    /// as [`PathLayer::reflections`].
    ///
    /// # Shapes
    /// - `x`: `(b, t, d)`; `mask`: `(b, t)`, 1 for a real token (`None`: all real)
    pub fn transport(
        &self,
        x: &Tensor,
        mask: Option<&Tensor>,
        heads: usize,
        backend: crate::nn::Backend,
    ) -> Result<Transport> {
        let (u, z) = self.projections(x)?;
        let made_of = Self::made_of(&u, self.conv.as_ref(), &z, mask, heads);
        Transport::from_projections(made_of, backend)
    }

    /// `u = x W_wᵀ` `(b, t, d)` and `z = x W_bᵀ + b` `(b, t, h)`, in the weights' dtype.
    fn projections(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let x = x.to_dtype(self.w.dtype())?;
        let u = x.broadcast_matmul(&self.w.t()?)?;
        let z = x
            .broadcast_matmul(&self.beta_weight.t()?)?
            .broadcast_add(&self.beta_bias)?;
        Ok((u, z))
    }

    fn made_of<'a>(
        u: &'a Tensor,
        conv: Option<&'a Tensor>,
        z: &'a Tensor,
        mask: Option<&'a Tensor>,
        heads: usize,
    ) -> Projections<'a> {
        Projections {
            u,
            conv,
            z,
            mask,
            heads,
            eps: PATH_EPS,
        }
    }
}

/// Every layer's PaTH weights; `None` for a layer without positions.
#[derive(Clone, Debug)]
pub struct Path(pub Vec<Option<PathLayer>>);

impl ScoreModule for Path {
    fn batch_scores<'a>(
        &'a self,
        batch: &BiasBatch,
    ) -> Result<Vec<Option<Box<dyn QkScores + 'a>>>> {
        Ok(self
            .0
            .iter()
            .map(|layer| {
                layer.as_ref().map(|weights| {
                    Box::new(PathScores {
                        weights,
                        mask: batch.mask.cloned(),
                    }) as Box<dyn QkScores + 'a>
                })
            })
            .collect())
    }

    fn notes(&self) -> Result<Vec<String>> {
        self.0
            .iter()
            .enumerate()
            .map(|(l, p)| {
                let Some(p) = p else {
                    return Ok(format!("layer {l}: no positions"));
                };
                let bias = p.beta_bias.to_dtype(DType::F64)?.to_vec1::<f64>()?;
                let beta: Vec<f64> = bias.iter().map(|z| 2.0 / (1.0 + (-z).exp())).collect();
                Ok(format!(
                    "layer {l}: beta at a zero input per head [{}] (2 sigmoid of the bias)",
                    super::list(&beta)
                ))
            })
            .collect()
    }

    fn parameters(&self) -> Vec<Tensor> {
        self.0
            .iter()
            .flatten()
            .flat_map(|p| {
                [
                    Some(&p.w),
                    p.conv.as_ref(),
                    Some(&p.beta_weight),
                    Some(&p.beta_bias),
                ]
                .into_iter()
                .flatten()
                .cloned()
            })
            .collect()
    }

    fn undecayed(&self) -> Vec<Tensor> {
        self.0
            .iter()
            .flatten()
            .map(|p| p.beta_bias.clone())
            .collect()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// One layer's PaTH for one batch.
#[derive(Debug)]
struct PathScores<'a> {
    weights: &'a PathLayer,
    mask: Option<Tensor>,
}

impl QkScores for PathScores<'_> {
    fn scores(
        &self,
        q: &Tensor,
        k: &Tensor,
        x: &Tensor,
        scale: f64,
        backend: crate::nn::Backend,
    ) -> Result<Tensor> {
        let r = self
            .weights
            .reflections(x, self.mask.as_ref(), q.dim(1)?, backend)?;
        Transport::new(&r.w, &r.beta)?.scores(q, k, scale)
    }

    fn transport(
        &self,
        x: &Tensor,
        heads: usize,
        backend: crate::nn::Backend,
    ) -> Result<Option<Transport>> {
        let mask = self.mask.as_ref();
        Ok(Some(self.weights.transport(x, mask, heads, backend)?))
    }

    fn input_reflections(&self) -> Option<InputReflections<'_>> {
        let w = self.weights;
        Some(InputReflections {
            w: &w.w,
            conv: w.conv.as_ref(),
            beta_weight: &w.beta_weight,
            beta_bias: &w.beta_bias,
            mask: self.mask.as_ref(),
            eps: PATH_EPS,
        })
    }
}
