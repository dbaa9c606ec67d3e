//! Stick-breaking attention's weights (Tan, Shen, Yang, Courville, Panda, ICLR 2025, "Scaling
//! Stick-Breaking Attention"), in place of the softmax: the order in which a query's keys break
//! a stick of length 1 is the position signal, and no positional encoding is needed.
//!
//! With `β_ij = σ(z_ij)` for the keys query `i` may see (0 for the others), each key takes
//! `β` of what the keys before it in the query's order left:
//!
//! ```text
//! A_ij = β_ij Π_{k before j in the order} (1 - β_ik)        R_i = Π_k (1 - β_ik) = 1 - Σ_j A_ij
//! ```
//!
//! The causal form is the original's: keys `i-1, i-2, ..., 0`, nearest first (`i` itself first
//! with `attend_current`; without it the first token attends to nothing). The encoder form is
//! the specification's (`reference_2026_schemes.py`): even heads break the stick over the left
//! side nearest first and then go on over the right, odd heads right then left, so a masked
//! key (β = 0) breaks nothing and under a causal mask both orders are the original's. Computed
//! in log space, as the original: with `L_ik = ln(1 - β_ik) = ln σ(-z_ik)` for the keys that
//! break (0 for the others),
//!
//! ```text
//! even heads:  ln A_ij = ln σ(z_ij) + L_ii + Σ_{j<k<i} L_ik              j < i
//!                      = ln σ(z_ij) + Σ_{k<j} L_ik                       j > i
//! odd heads:   ln A_ij = ln σ(z_ij) + L_ii + Σ_{i<k<j} L_ik              j > i
//!                      = ln σ(z_ij) + Σ_{k>j} L_ik                       j < i
//! ```
//!
//! (`L_ii` only with `attend_current`; `A_ii = β_ii` then, 0 otherwise), each sum taken
//! directly over its keys, never as a difference of two running sums: by the fused CPU kernel
//! (`kernels::cpu::stick_breaking`) as one walk over each row's keys in their order, forward
//! and backward, and by the composition ([`stick_breaking_reference`], the other paths) as a
//! product with a triangle of ones.
//!
//! The remainder `R_i` is dropped (`remainder = "none"`, the default, fla's layer, no
//! parameters) or adds `R_i b_h` to each head's output (`remainder = "bias"`, IBM dolomite's
//! `sb_remainder`, the paper's models: `layers.{l}.attn.stick_breaking.head_bias`
//! `(heads, d_head)`, starting at zero). Scores are `q · k / sqrt(d_head)` with the key's bias
//! (which a sigmoid, unlike a softmax, does not cancel). It reads token order, not position ids.
//! Reference: `reference_2026_schemes.py`, fixtures `encoder_stick_breaking_pre`,
//! `encoder_stick_breaking_current_h4_post`, `encoder_stick_breaking_bias_pre`,
//! `encoder_causal_stick_breaking_pre` and `encoder_causal_stick_breaking_current_post`.
//!
//! Cost: `O(t²)` a head on the fused kernel, inside the fused layer in place of its softmax
//! (with `remainder = "none"`; [`AttentionWeights::fused_sticks`]); the composition's triangle
//! products are `O(t³)` a head.

use candle::{DType, Device, Tensor};
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};

use super::{
    Bench, BiasBatch, Describe, Knobs, Measure, Named, Placement, Portrait, Portray,
    PositionalModule, Scheme, SchemeShape, ScoreFunction, ScoreMemory, ScoreModule,
};
use crate::error::Result;
use crate::nn::{AttentionWeights, QkScores};

/// What the rest of the stick `R_i` does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Remainder {
    /// Dropped (fla's layer): no parameters.
    #[default]
    None,
    /// `R_i b_h` added to each head's output, `b_h` learned per head and layer (dolomite's).
    Bias,
}

/// Options of `stick_breaking`: whether a query's own key breaks the stick first, and what the
/// remainder does.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StickBreakingOptions {
    /// The query's own key breaks first (default false, the original's: the first token then
    /// attends to nothing).
    #[serde(default)]
    pub attend_current: bool,
    /// `none` (default) or `bias`.
    #[serde(default)]
    pub remainder: Remainder,
}

impl Named for StickBreakingOptions {
    fn name(&self) -> &'static str {
        "stick_breaking"
    }
}

impl Scheme for StickBreakingOptions {
    fn placement(&self) -> Placement {
        Placement::Weights
    }

    fn check_random_positions(&self, range: usize) -> std::result::Result<(), String> {
        Err(format!(
            "random_positions = {range} with positional `stick_breaking`: its weights follow \
             the order in which the keys break the stick and read no position ids, so \
             randomizing them would change nothing; remove random_positions"
        ))
    }

    fn param_count(&self, shape: &SchemeShape) -> u128 {
        match self.remainder {
            Remainder::None => 0,
            Remainder::Bias => shape.d_model as u128 * shape.layers.count(shape.n_layers) as u128,
        }
    }

    fn build(&self, shape: &SchemeShape, vb: VarBuilder) -> Result<PositionalModule> {
        let (h, hd) = (shape.n_heads, shape.head_dim());
        let layers = (0..shape.n_layers)
            .map(|i| -> Result<Option<SbLayer>> {
                if !shape.layers.contains(i) {
                    return Ok(None);
                }
                let head_bias = match self.remainder {
                    Remainder::None => None,
                    Remainder::Bias => Some(
                        vb.pp(format!("layers.{i}.attn.stick_breaking"))
                            .get_with_hints((h, hd), "head_bias", Init::Const(0.0))?,
                    ),
                };
                Ok(Some(SbLayer {
                    attend_current: self.attend_current,
                    head_bias,
                }))
            })
            .collect::<Result<_>>()?;
        Ok(PositionalModule::Scores(ScoreFunction::new(StickBreaking(
            layers,
        ))))
    }
}

impl Describe for StickBreakingOptions {
    fn describe(&self, _shape: &SchemeShape) -> String {
        format!(
            "attention weights: stick-breaking in place of the softmax, A_ij = sigmoid(z_ij) x \
             what the keys before j left (even heads left first, odd heads right first; \
             nearest first{}), the remainder {}; no position ids",
            match self.attend_current {
                true => ", the query's own key before all",
                false => "",
            },
            match self.remainder {
                Remainder::None => "dropped",
                Remainder::Bias => "times a learned vector per head added to the output",
            }
        )
    }

    fn label(&self) -> String {
        let mut parts = Vec::new();
        if self.attend_current {
            parts.push("attend_current");
        }
        if self.remainder == Remainder::Bias {
            parts.push("remainder bias");
        }
        match parts.is_empty() {
            true => "stick_breaking".into(),
            false => format!("stick_breaking ({})", parts.join(", ")),
        }
    }
}

impl Portray for StickBreakingOptions {
    fn measure(&self) -> Option<Measure> {
        Some(Measure::Weights)
    }

    fn without_model(&self, _knobs: &Knobs) -> std::result::Result<Portrait, String> {
        Err(
            "stick_breaking: its weights come from the scores q . k of a trained model, in the \
             order the keys break the stick: give --run DIR of a stick_breaking model"
                .into(),
        )
    }
}

impl Bench for StickBreakingOptions {
    fn forward_flops(&self, _shape: &SchemeShape, _batch: usize, _seq: usize) -> f64 {
        // No products of its own: a walk over each row's keys, `O(t²)` a head (the
        // composition's triangle products stand in for that walk and are not the scheme's).
        0.0
    }
}

impl ScoreMemory for StickBreakingOptions {
    fn score_tensors(&self, training: bool, fused: bool) -> usize {
        // Fused: the fused layer holds what `sin_add`'s does (with `remainder = "bias"` the
        // layer runs as ops around the weights' kernel: the logits, the keys that break and
        // the weights, and their gradients). Composed: the sigmoids, the sums over each side
        // and the weights, about 12 tables a layer, and their gradients.
        match (fused, training) {
            (true, false) => 3,
            (true, true) => 8,
            (false, false) => 12,
            (false, true) => 48,
        }
    }
}

/// One layer's stick-breaking: whether the query's own key breaks first, and the remainder's
/// learned vector `(h, d_head)` if it has one.
#[derive(Clone, Debug)]
pub struct SbLayer {
    /// The query's own key breaks first.
    pub attend_current: bool,
    /// `layers.{l}.attn.stick_breaking.head_bias`, with `remainder = "bias"`.
    pub head_bias: Option<Tensor>,
}

/// Every layer's stick-breaking (`None` for a layer without positions, which keeps the
/// softmax).
#[derive(Clone, Debug)]
pub struct StickBreaking(pub Vec<Option<SbLayer>>);

impl ScoreModule for StickBreaking {
    fn batch_scores<'a>(
        &'a self,
        _batch: &BiasBatch,
    ) -> Result<Vec<Option<Box<dyn QkScores + 'a>>>> {
        Ok(self
            .0
            .iter()
            .map(|l| {
                l.as_ref()
                    .map(|l| Box::new(l.clone()) as Box<dyn QkScores + 'a>)
            })
            .collect())
    }

    fn notes(&self) -> Result<Vec<String>> {
        self.0
            .iter()
            .enumerate()
            .map(|(l, layer)| {
                Ok(match layer {
                    None => format!("layer {l}: no positions (softmax)"),
                    Some(SbLayer {
                        head_bias: Some(b), ..
                    }) => {
                        let norms = b.to_dtype(DType::F64)?.sqr()?.sum(1)?.sqrt()?;
                        format!(
                            "layer {l}: remainder vector norms per head [{}]",
                            super::list(&norms.to_vec1::<f64>()?)
                        )
                    }
                    Some(_) => format!("layer {l}: remainder dropped"),
                })
            })
            .collect()
    }

    fn parameters(&self) -> Vec<Tensor> {
        self.0
            .iter()
            .flatten()
            .filter_map(|l| l.head_bias.clone())
            .collect()
    }

    fn undecayed(&self) -> Vec<Tensor> {
        // A bias: decay would pull the remainder's vector toward 0.
        self.parameters()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl QkScores for SbLayer {
    fn scores(
        &self,
        q: &Tensor,
        k: &Tensor,
        _x: &Tensor,
        scale: f64,
        _backend: crate::nn::Backend,
    ) -> Result<Tensor> {
        Ok((crate::nn::matmul(q, &k.t()?)? * scale)?)
    }

    fn weights(&self) -> Option<&dyn AttentionWeights> {
        Some(self)
    }
}

impl AttentionWeights for SbLayer {
    fn weights(
        &self,
        scores: &Tensor,
        allowed: &Tensor,
        backend: crate::nn::Backend,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let breaks = breaking_keys(scores, allowed, self.attend_current)?;
        let weights = stick_breaking_from(scores, &breaks, backend)?;
        let added =
            match &self.head_bias {
                // R_i b_h: (b, h, t, 1) x (1, h, 1, d_head).
                Some(b) => {
                    let remainder = remainders(scores, &breaks, backend)?;
                    Some(remainder.unsqueeze(3)?.broadcast_mul(
                        &b.to_dtype(remainder.dtype())?.unsqueeze(1)?.unsqueeze(0)?,
                    )?)
                }
                None => None,
            };
        Ok((weights, added))
    }

    fn fused_sticks(&self) -> Option<bool> {
        // The remainder's vector is added outside the fused node's heads: that layer runs as
        // ops.
        self.head_bias.is_none().then_some(self.attend_current)
    }
}

/// Stick-breaking weights and remainders of scaled logits `z`, over the keys `allowed` lets
/// each query see (real keys, and under a causal mask those at or before the query); even
/// heads break left first, odd heads right first; the query's own key breaks first when
/// `attend_current`, else never. Differentiable in `z`.
///
/// # Shapes
/// - `z`: `(b, h, t, t)`; `allowed`: 1 or 0, broadcast to `z` (`(b or 1, 1 or h, t, t)`), in
///   `z`'s dtype
/// - returns the weights `(b, h, t, t)`, each row summing to at most 1, and the remainders
///   `(b, h, t)`, `1 - Σ_j A_ij`
pub fn stick_breaking_weights(
    z: &Tensor,
    allowed: &Tensor,
    attend_current: bool,
    backend: crate::nn::Backend,
) -> Result<(Tensor, Tensor)> {
    let breaks = breaking_keys(z, allowed, attend_current)?;
    Ok((
        stick_breaking_from(z, &breaks, backend)?,
        remainders(z, &breaks, backend)?,
    ))
}

/// The keys that break each query's stick, 1 or 0 `(b, h, t, t)`: those `allowed`, less the
/// query's own without `attend_current`.
fn breaking_keys(z: &Tensor, allowed: &Tensor, attend_current: bool) -> Result<Tensor> {
    let t = z.dim(3)?;
    let breaks = match attend_current {
        true => allowed.clone(),
        false => {
            let diagonal = crate::nn::pair_mask(t, |i, j| i == j, z.dtype(), z.device())?;
            allowed.broadcast_mul(&(1.0 - &diagonal)?)?
        }
    };
    Ok(breaks.broadcast_as(z.shape())?.contiguous()?)
}

/// The weights of `z` over the keys `breaks` holds: the fused kernel where the CPU's kernels
/// run, else [`stick_breaking_reference`].
fn stick_breaking_from(z: &Tensor, breaks: &Tensor, backend: crate::nn::Backend) -> Result<Tensor> {
    match backend.path(z) {
        #[cfg(feature = "kernels")]
        crate::nn::Path::Fused => Ok(crate::kernels::cpu::stick_breaking(
            z,
            breaks,
            backend.simd,
        )?),
        _ => stick_breaking_reference(z, breaks, backend),
    }
}

/// `R_i = exp(Σ_k L_ik)`, what each query's keys left of the stick `(b, h, t)`.
fn remainders(z: &Tensor, breaks: &Tensor, backend: crate::nn::Backend) -> Result<Tensor> {
    Ok(crate::nn::log_sigmoid(&z.neg()?, backend)?
        .mul(breaks)?
        .sum(3)?
        .exp()?)
}

/// The weights of `z` over the keys `breaks` holds, as a composition of tensor ops: each sum
/// over a side of the keys a product with a `(t, t)` triangle. The specification the fused
/// kernel (`kernels::cpu::stick_breaking`) is checked against.
pub fn stick_breaking_reference(
    z: &Tensor,
    breaks: &Tensor,
    backend: crate::nn::Backend,
) -> Result<Tensor> {
    let (_, h, t, _) = z.dims4()?;
    let (dtype, device) = (z.dtype(), z.device());
    let tri = |keep: fn(usize, usize) -> bool| crate::nn::pair_mask(t, keep, dtype, device);
    let diagonal = tri(|i, j| i == j)?;
    let below = tri(|i, j| j < i)?; // (query i, key j): keys before the query
    let above = tri(|i, j| j > i)?;
    // L = ln(1 - β) for the keys that break, 0 for the others; and ln β.
    let log_kept = crate::nn::log_sigmoid(&z.neg()?, backend)?.mul(breaks)?;
    let log_taken = crate::nn::log_sigmoid(z, backend)?;
    // L_ii, (b, h, t, 1)
    let own = log_kept.broadcast_mul(&diagonal)?.sum_keepdim(3)?;
    // Sums over keys before (`before[k, j] = k < j`) or after (`after[k, j] = k > j`) a key:
    // Σ_{k<j} L_ik and Σ_{k>j} L_ik.
    let (before_key, after_key) = (above.clone(), below.clone());
    let sum_before = log_kept.broadcast_matmul(&before_key)?;
    let sum_after = log_kept.broadcast_matmul(&after_key)?;
    // Σ_{j<k<i} L_ik and Σ_{i<k<j} L_ik: the keys between key and query on each side.
    let between_left = log_kept
        .broadcast_mul(&below)?
        .broadcast_matmul(&after_key)?;
    let between_right = log_kept
        .broadcast_mul(&above)?
        .broadcast_matmul(&before_key)?;
    let even = ((between_left.broadcast_add(&own)?.broadcast_mul(&below))?
        + sum_before.broadcast_mul(&above)?)?;
    let odd = ((between_right.broadcast_add(&own)?.broadcast_mul(&above))?
        + sum_after.broadcast_mul(&below)?)?;
    let parity: Vec<f64> = (0..h).map(|hd| f64::from(u8::from(hd % 2 == 0))).collect();
    let even_head = Tensor::from_vec(parity, (1, h, 1, 1), &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)?;
    let prefix = (even.broadcast_mul(&even_head)? + odd.broadcast_mul(&(1.0 - &even_head)?)?)?;
    Ok((log_taken + prefix)?.exp()?.mul(breaks)?)
}
