//! GRAPE-AP, poslab's `grape_a` (Zhang et al., ICLR 2026, "Group Representational Position
//! Encoding", Section 5: the path-integral additive GRAPE, the headline of its tables;
//! `llama-mha-grape-ap-v1`, `p_head_dim = 8`): a bias on the scores summed over the edges of the
//! tokens between query and key, each edge set by the query and the edge token's content and
//! position.
//!
//! Per layer, from the attention input `x`, per head `h` (`d_p = p_dim` wide):
//!
//! ```text
//! p_t        = x_t W_pᵀ                              W_p = layers.{l}.attn.grape.p.weight (h d_p, d)
//! p̂_t        = p_t / sqrt(mean_c p_tc² + 2^-23)      (an RMS norm without weight, float32's eps)
//! r_l        = G1(p_l) p̂_l                           GRAPE's rotation at every frequency 1, angle p_l
//! ψ_h(i, l)  = α_h ln σ(p_{i,h} . r_{l,h} / d_p)     α the ALiBi slopes
//! b_h(i, j)  = Σ_{l = j+1..i} ψ_h(i, l)              j ≤ i (the original's causal bias)
//!            = Σ_{l = i+1..j} ψᴿ_h(i, l)             j > i (the encoder's right side, from W_pᴿ =
//!                                                           layers.{l}.attn.grape.p_right.weight)
//! score_ij   = q_i . k_j / sqrt(d_head) + b_h(i, j)
//! ```
//!
//! The query side is the raw `p_i`, as the original's code (its paper normalises both). In both
//! directions the edges are those of the tokens in `(min(i, j), max(i, j)]`, poslab's FoX/PaTH
//! convention, so with edges that do not depend on the query this is bidirectional FoX. Left
//! keys never read `W_pᴿ`, so under `causal = true` the layer has no right projection and the
//! causal form is the original's. Every `ψ ≤ 0`: the bias only decays with the path. It reads
//! position ids through the absolute angle `p_l` (1 radian per position), so a shift of every
//! position changes the scores. q and k are not rotated, so a key bias would add the same number
//! to every score of a query, which the softmax cancels: the key projection has none.
//! Reference: `reference_2026_schemes.py`, fixtures `encoder_grape_a_pre`,
//! `encoder_grape_a_p4_post` and `encoder_causal_grape_a_pre`.
//!
//! Each side's sums are products with a `(t, t)` triangle of the edges masked to the side, taken
//! directly (never a difference of running sums): `O(t³)` a head, composed of tensor ops on
//! every path.

use candle::{DType, Device, Tensor, D};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use super::grape_m::{grape_rotate, grape_tables};
use super::{
    alibi_slopes, Bench, BiasBatch, Describe, Named, Placement, Portray, PositionalModule, Scheme,
    SchemeShape, ScoreFunction, ScoreMemory, ScoreModule,
};
use crate::error::Result;
use crate::nn::{Backend, Linear, QkScores};

/// The RMS norm's epsilon: float32's machine epsilon, what `F.rms_norm` without `eps` uses on a
/// float32 `p`.
pub const GRAPE_RMS_EPS: f64 = 1.0 / 8_388_608.0;

/// The widest `p_dim` poslab takes.
pub const MAX_GRAPE_P_DIM: usize = 1024;

fn default_p_dim() -> usize {
    8
}

/// Options of `grape_a`: the width of each head's edge projection.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrapeAOptions {
    /// `d_p`, each head's width of `p` (default 8, the original's; even).
    #[serde(default = "default_p_dim")]
    pub p_dim: usize,
}

impl Default for GrapeAOptions {
    fn default() -> Self {
        Self {
            p_dim: default_p_dim(),
        }
    }
}

impl Named for GrapeAOptions {
    fn name(&self) -> &'static str {
        "grape_a"
    }
}

/// How many projections a layer has: the left one, and the right one in an encoder.
fn sides(causal: bool) -> usize {
    if causal {
        1
    } else {
        2
    }
}

impl Scheme for GrapeAOptions {
    fn placement(&self) -> Placement {
        Placement::Scores
    }

    fn reads_keys(&self) -> bool {
        false
    }

    fn check(&self, _shape: &SchemeShape) -> std::result::Result<(), String> {
        if self.p_dim < 2 || !self.p_dim.is_multiple_of(2) || self.p_dim > MAX_GRAPE_P_DIM {
            return Err(format!(
                "grape_a: p_dim = {} must be an even number from 2 to {MAX_GRAPE_P_DIM} (8 is \
                 the original's): each head's edge vector turns in planes of two coordinates",
                self.p_dim
            ));
        }
        Ok(())
    }

    fn param_count(&self, shape: &SchemeShape) -> u128 {
        let per_side = (shape.n_heads * self.p_dim * shape.d_model) as u128;
        per_side * sides(shape.causal) as u128 * shape.layers.count(shape.n_layers) as u128
    }

    fn build(&self, shape: &SchemeShape, vb: VarBuilder) -> Result<PositionalModule> {
        let (d, width) = (shape.d_model, shape.n_heads * self.p_dim);
        let layers = (0..shape.n_layers)
            .map(|i| -> Result<Option<GrapeALayer>> {
                if !shape.layers.contains(i) {
                    return Ok(None);
                }
                let vb = vb.pp(format!("layers.{i}.attn.grape"));
                let left = crate::nn::linear_no_bias(d, width, vb.pp("p"))?;
                let right = match shape.causal {
                    true => None,
                    false => Some(crate::nn::linear_no_bias(d, width, vb.pp("p_right"))?),
                };
                Ok(Some(GrapeALayer { left, right }))
            })
            .collect::<Result<_>>()?;
        Ok(PositionalModule::Scores(ScoreFunction::new(GrapeA {
            heads: shape.n_heads,
            p_dim: self.p_dim,
            layers,
        })))
    }
}

impl Describe for GrapeAOptions {
    fn describe(&self, shape: &SchemeShape) -> String {
        format!(
            "attention scores: q . k plus a bias summed over the edges of the tokens between \
             query and key, edge l of query i = slope_h ln sigmoid(p_i . G1(p_l) rms(p_l) / {}), \
             p = x W_p ({} wide a head){}",
            self.p_dim,
            self.p_dim,
            match shape.causal {
                true => "; left side only (causal)",
                false => ", a second W_p for the keys on the right",
            }
        )
    }

    fn label(&self) -> String {
        match self.p_dim == default_p_dim() {
            true => "grape_a".into(),
            false => format!("grape_a (p_dim {})", self.p_dim),
        }
    }
}

impl Portray for GrapeAOptions {}

impl Bench for GrapeAOptions {
    fn forward_flops(&self, shape: &SchemeShape, batch: usize, seq: usize) -> f64 {
        // Per side and head: the projection (2 t d d_p), the edges p rᵀ (2 t² d_p) and the sum
        // over the side (a product with a (t, t) triangle, 2 t³).
        let (d, t, dp, h) = (
            shape.d_model as f64,
            seq as f64,
            self.p_dim as f64,
            shape.n_heads as f64,
        );
        let layers = shape.layers.count(shape.n_layers) as f64;
        let per_head = 2.0 * t * d * dp + 2.0 * t * t * dp + 2.0 * t * t * t;
        per_head * h * sides(shape.causal) as f64 * batch as f64 * layers
    }
}

impl ScoreMemory for GrapeAOptions {
    fn score_tensors(&self, training: bool, _fused: bool) -> usize {
        // Composed on every path: per side the edges, their log-sigmoid, the masked edges and
        // the sums, then the scores and the softmax; their gradients in a step.
        match training {
            false => 12,
            true => 36,
        }
    }
}

/// One layer's edge projections: `W_p` and, in an encoder, `W_pᴿ` (`(h d_p, d)`, no bias).
#[derive(Clone, Debug)]
pub struct GrapeALayer {
    /// `layers.{l}.attn.grape.p`: the edges of the keys at and before the query.
    pub left: Linear,
    /// `layers.{l}.attn.grape.p_right`: the edges of the keys after it (`None` when causal).
    pub right: Option<Linear>,
}

/// GRAPE-AP's module: heads, `p_dim` and every layer's projections (`None` for a layer without
/// positions).
#[derive(Clone, Debug)]
pub struct GrapeA {
    /// Attention heads.
    pub heads: usize,
    /// Each head's width of `p`.
    pub p_dim: usize,
    /// Every layer's projections.
    pub layers: Vec<Option<GrapeALayer>>,
}

/// What every layer of one batch shares: the rotation tables at frequency 1, the slopes and the
/// triangles that pick each side's edges and sum them.
#[derive(Clone, Debug)]
pub struct GrapeAFrame {
    /// `(r, t, d_p)` cos and `-sin` of the angles `p_l`.
    cos: Tensor,
    neg_sin: Tensor,
    /// `(1, h, 1, 1)` ALiBi's slopes.
    slopes: Tensor,
    /// `(t, t)`: `[l ≤ i]` (rows i, columns l) and `[l > j]` (rows l, columns j).
    left_edges: Tensor,
    left_sum: Tensor,
    /// `(t, t)`: `[l > i]` and `[l ≤ j]`.
    right_edges: Tensor,
    right_sum: Tensor,
}

impl GrapeAFrame {
    /// The frame of a batch at `positions` for `heads` heads of edge width `p_dim`.
    pub fn new(
        positions: &super::Positions,
        heads: usize,
        p_dim: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let ones = Tensor::ones(p_dim / 2, dtype, device)?;
        let (cos, neg_sin) = grape_tables(positions, &ones)?;
        let slopes = Tensor::from_vec(alibi_slopes(heads), (1, heads, 1, 1), &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(device)?;
        let t = positions.len();
        let triangle =
            |keep: fn(usize, usize) -> bool| crate::nn::pair_mask(t, keep, dtype, device);
        Ok(Self {
            cos,
            neg_sin,
            slopes,
            left_edges: triangle(|i, l| l <= i)?,
            left_sum: triangle(|l, j| l > j)?,
            right_edges: triangle(|i, l| l > i)?,
            right_sum: triangle(|l, j| l <= j)?,
        })
    }
}

/// The edges `ψ` `(b, h, t, t)` (query `i`, edge token `l`) of the attention input `x`
/// `(b, t, d)` through the projection `p` (`(h d_p, d)`), in the frame's dtype.
pub fn grape_a_edges(
    x: &Tensor,
    p: &Linear,
    frame: &GrapeAFrame,
    heads: usize,
    backend: Backend,
) -> Result<Tensor> {
    let (b, t, _) = x.dims3()?;
    let x = x.to_dtype(frame.cos.dtype())?;
    let p = p.forward(&x, backend)?; // (b, t, h d_p)
    let p_dim = p.dim(2)? / heads;
    let p = p
        .reshape((b, t, heads, p_dim))?
        .transpose(1, 2)?
        .contiguous()?; // (b, h, t, d_p)
    let rms = ((p.sqr()?.mean_keepdim(D::Minus1)? + GRAPE_RMS_EPS)?).sqrt()?;
    let r = grape_rotate(&p.broadcast_div(&rms)?, &frame.cos, &frame.neg_sin)?;
    let s = (crate::nn::matmul(&p, &r.t()?.contiguous()?)? / p_dim as f64)?; // (b, h, t, t)
    Ok(crate::nn::log_sigmoid(&s, backend)?.broadcast_mul(&frame.slopes)?)
}

/// The bias `(b, h, t, t)` of one layer on the attention input `x` `(b, t, d)`: the left edges
/// summed over `(j, i]` for keys at and before the query, the right edges over `(i, j]` after it
/// (none when the layer has no right projection).
pub fn grape_a_bias(
    x: &Tensor,
    layer: &GrapeALayer,
    frame: &GrapeAFrame,
    heads: usize,
    backend: Backend,
) -> Result<Tensor> {
    let side = |p: &Linear, edges: &Tensor, sum: &Tensor| -> Result<Tensor> {
        let psi = grape_a_edges(x, p, frame, heads, backend)?;
        Ok(psi.broadcast_mul(edges)?.broadcast_matmul(sum)?)
    };
    let left = side(&layer.left, &frame.left_edges, &frame.left_sum)?;
    match &layer.right {
        Some(right) => Ok((left + side(right, &frame.right_edges, &frame.right_sum)?)?),
        None => Ok(left),
    }
}

impl ScoreModule for GrapeA {
    fn batch_scores<'a>(
        &'a self,
        batch: &BiasBatch,
    ) -> Result<Vec<Option<Box<dyn QkScores + 'a>>>> {
        let frame = match self.layers.iter().any(Option::is_some) {
            true => Some(GrapeAFrame::new(
                batch.positions,
                self.heads,
                self.p_dim,
                batch.dtype,
                batch.device,
            )?),
            false => None,
        };
        Ok(self
            .layers
            .iter()
            .map(|layer| {
                let (layer, frame) = (layer.as_ref()?, frame.clone()?);
                Some(Box::new(GrapeAScores {
                    layer,
                    frame,
                    heads: self.heads,
                }) as Box<dyn QkScores + 'a>)
            })
            .collect())
    }

    fn notes(&self) -> Result<Vec<String>> {
        self.layers
            .iter()
            .enumerate()
            .map(|(l, layer)| {
                let Some(layer) = layer else {
                    return Ok(format!("layer {l}: no positions"));
                };
                let norm = |p: &Linear| super::weight_norm(p.weight());
                Ok(match &layer.right {
                    Some(right) => format!(
                        "layer {l}: edge projection norms {:.4} (left), {:.4} (right)",
                        norm(&layer.left)?,
                        norm(right)?
                    ),
                    None => format!("layer {l}: edge projection norm {:.4}", norm(&layer.left)?),
                })
            })
            .collect()
    }

    fn parameters(&self) -> Vec<Tensor> {
        self.layers
            .iter()
            .flatten()
            .flat_map(|l| std::iter::once(&l.left).chain(&l.right))
            .map(|p| p.weight().clone())
            .collect()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// One layer's GRAPE-AP for one batch.
#[derive(Debug)]
struct GrapeAScores<'a> {
    layer: &'a GrapeALayer,
    frame: GrapeAFrame,
    heads: usize,
}

impl QkScores for GrapeAScores<'_> {
    fn scores(
        &self,
        q: &Tensor,
        k: &Tensor,
        x: &Tensor,
        scale: f64,
        backend: Backend,
    ) -> Result<Tensor> {
        let bias = grape_a_bias(x, self.layer, &self.frame, self.heads, backend)?;
        let content = (crate::nn::matmul(q, &k.t()?)? * scale)?;
        Ok((content.to_dtype(bias.dtype())? + bias)?)
    }
}
