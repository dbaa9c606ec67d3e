//! ALiBi (Press et al. 2022), in its symmetric form for an encoder: every head adds
//!
//! ```text
//! bias[h, i, j] = -slope_h · |p_i - p_j|
//! ```
//!
//! to its scaled scores. Nothing is learned; the slopes are a geometric sequence per head.
//! `adaptive = { width = … }` adds DAPE's MLP over the logits and this bias (`adaptive.rs`).

use super::score_bias::offset_lengths;
use super::{Bench, Describe, Named, Portray, ScoreMemory};
use candle::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use super::{
    Adaptive, BiasBatch, BiasModule, Knobs, LayerBiases, Placement, Portrait, PositionalConfig,
    PositionalModule, Positions, Scheme, SchemeShape, ScoreBias,
};
use crate::error::Result;

/// Options of `alibi`: only DAPE's `adaptive` (none by default).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AlibiOptions {
    /// DAPE's MLP over the logits and the bias (`adaptive = { width = 32 }`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adaptive: Option<Adaptive>,
}

impl Named for AlibiOptions {
    fn name(&self) -> &'static str {
        "alibi"
    }
}

impl Scheme for AlibiOptions {
    fn placement(&self) -> Placement {
        Adaptive::placement(self.adaptive.as_ref())
    }

    fn check(&self, _shape: &SchemeShape) -> std::result::Result<(), String> {
        self.adaptive.map_or(Ok(()), |a| a.check("alibi"))
    }

    fn param_count(&self, shape: &SchemeShape) -> u128 {
        self.adaptive.map_or(0, |a| a.param_count(shape))
    }

    fn build(&self, shape: &SchemeShape, vb: VarBuilder) -> Result<PositionalModule> {
        let bias = ScoreBias::new(Alibi::new(shape.n_heads));
        Adaptive::wrap(self.adaptive.as_ref(), shape, &vb, bias)
    }
}

impl Describe for AlibiOptions {
    fn describe(&self, shape: &SchemeShape) -> String {
        let h = shape.n_heads;
        let slopes = alibi_slopes(h);
        format!(
            "attention bias: -slope_h |i - j| on every layer's scores, {h} slopes {:.4}..{:.4} \
             (Press et al.), no weights{}",
            slopes.first().copied().unwrap_or(0.0),
            slopes.last().copied().unwrap_or(0.0),
            self.adaptive.map_or(String::new(), |a| a.describe(h))
        )
    }

    fn label(&self) -> String {
        Adaptive::label(self.adaptive.as_ref(), self.name())
    }
}

impl Portray for AlibiOptions {
    fn without_model(&self, _knobs: &Knobs) -> std::result::Result<Portrait, String> {
        Ok(Portrait::Bias(PositionalConfig::Alibi(
            AlibiOptions::default(),
        )))
    }
}

impl Bench for AlibiOptions {
    fn forward_flops(&self, shape: &SchemeShape, batch: usize, seq: usize) -> f64 {
        self.adaptive
            .map_or(0.0, |a| a.forward_flops(shape, batch, seq))
    }

    fn benchmarked(&self) -> Option<Vec<(String, PositionalConfig)>> {
        // ALiBi, and ALiBi under DAPE's MLP at its default width: what `adaptive` costs.
        let adaptive = Self {
            adaptive: Some(Adaptive::default()),
        };
        Some(vec![
            ("alibi".into(), PositionalConfig::Alibi(self.clone())),
            ("alibi_adaptive".into(), PositionalConfig::Alibi(adaptive)),
        ])
    }
}

impl ScoreMemory for AlibiOptions {
    fn score_tensors(&self, training: bool, _fused: bool) -> usize {
        self.adaptive.map_or(1, |a| a.score_tensors(training))
    }
}

/// Press et al.'s slopes for `heads` heads. For a power of two `n`: `2^(-8h/n)`, `h = 1..n`.
/// Otherwise the slopes of the nearest lower power of two `m`, then every other slope of `2m`
/// (the odd ones, `2^(-8(2k-1)/2m)`) until there are `heads`.
pub fn alibi_slopes(heads: usize) -> Vec<f64> {
    fn power_of_two(n: usize) -> Vec<f64> {
        (1..=n)
            .map(|h| 2f64.powf(-8.0 * h as f64 / n as f64))
            .collect()
    }
    if heads == 0 {
        return Vec::new();
    }
    if heads.is_power_of_two() {
        return power_of_two(heads);
    }
    let closest = 1usize << heads.ilog2();
    let mut slopes = power_of_two(closest);
    slopes.extend(
        alibi_slopes(2 * closest)
            .into_iter()
            .step_by(2)
            .take(heads - closest),
    );
    slopes
}

/// The ALiBi bias of a model with a given number of heads.
#[derive(Clone, Debug)]
pub struct Alibi {
    slopes: Vec<f64>,
}

impl Alibi {
    /// ALiBi for `heads` heads, with the paper's geometric slopes.
    pub fn new(heads: usize) -> Self {
        Self {
            slopes: alibi_slopes(heads),
        }
    }

    /// Each head's slope `m_h`, head 0 first.
    pub fn slopes(&self) -> &[f64] {
        &self.slopes
    }

    /// # Shapes
    /// - returns `(r, h, t, t)` for positions `(r, t)`, computed in f64 and rounded once
    pub fn bias(&self, positions: &Positions, dtype: DType, device: &Device) -> Result<Tensor> {
        let (r, t, h) = (positions.rows(), positions.len(), self.slopes.len());
        let dist = positions.distances(); // (r, t, t)
        let mut out = Vec::with_capacity(r * h * t * t);
        for row in dist.chunks_exact(t * t) {
            for &slope in &self.slopes {
                out.extend(row.iter().map(|d| -slope * d));
            }
        }
        Ok(Tensor::from_vec(out, (r, h, t, t), &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(device)?)
    }

    /// The bias by offset `(1, h, 2t - 1)` for `t` tokens: `-m_h |o|` for offsets
    /// `o = -(t - 1)..=t - 1`, computed in f64 and rounded once (the values of [`Alibi::bias`]
    /// over positions `start..start + t`).
    pub fn offsets(&self, t: usize, dtype: DType, device: &Device) -> Result<Tensor> {
        let w = 2 * t - 1;
        let mut out = Vec::with_capacity(self.slopes.len() * w);
        for &slope in &self.slopes {
            out.extend(offset_lengths(t).map(|d| -slope * d));
        }
        Ok(
            Tensor::from_vec(out, (1, self.slopes.len(), w), &Device::Cpu)?
                .to_dtype(dtype)?
                .to_device(device)?,
        )
    }
}

impl BiasModule for Alibi {
    fn layer_biases(&self, batch: &BiasBatch) -> Result<LayerBiases> {
        Ok(LayerBiases::Shared(self.bias(
            batch.positions,
            batch.dtype,
            batch.device,
        )?))
    }

    fn offset_biases(&self, batch: &BiasBatch) -> Result<Option<LayerBiases>> {
        let t = batch.positions.len();
        if batch.positions.as_range().is_none() {
            return Ok(None);
        }
        let v = self.offsets(t, batch.dtype, batch.device)?;
        Ok(Some(LayerBiases::Shared(v)))
    }

    fn notes(&self) -> Result<Vec<String>> {
        Ok(vec![format!(
            "slopes per head: {}",
            super::list(&self.slopes)
        )])
    }

    fn parameters(&self) -> Vec<Tensor> {
        Vec::new()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slopes_follow_press_et_al() {
        // 8 heads: 1/2, 1/4, ..., 1/256.
        let s = alibi_slopes(8);
        assert_eq!(s[0], 0.5);
        assert_eq!(s[7], 1.0 / 256.0);
        // 6 heads: the 4-head slopes (1/4, 1/16, 1/64, 1/256), then the odd 8-head ones (1/2, 1/8).
        assert_eq!(
            alibi_slopes(6),
            [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]
        );
    }
}
