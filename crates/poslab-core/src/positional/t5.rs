//! T5's relative-position buckets (Raffel et al. 2020), bidirectional as in T5's encoder, and
//! T5's decoder buckets in a causal model.
//!
//! Every layer adds `rel_bias.weight[bucket(p_j - p_i), h]` to its scores: one learned
//! `(buckets, heads)` table shared by all layers, indexed by the bucket of the key's position
//! minus the query's. An encoder splits the buckets between the two sides ([`t5_bucket`]); a
//! causal model gives them all to the keys before the query ([`t5_bucket_causal`]), as T5's
//! decoder does: masking the encoder's buckets would leave half of them unused.
//! `adaptive = { width = … }` adds DAPE's MLP over the logits and this bias (`adaptive.rs`).

use super::{Bench, Describe, Named, Portray, ScoreMemory};
use candle::{Tensor, D};
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};

use super::score_bias::offset_bias;
use super::{
    Adaptive, BiasBatch, BiasModule, Knobs, LayerBiases, OffsetIndex, Placement, Portrait,
    PositionalConfig, PositionalModule, Positions, Scheme, SchemeShape, ScoreBias,
};
use crate::error::Result;

fn default_t5_buckets() -> usize {
    32
}

fn default_t5_max_distance() -> usize {
    128
}

/// Options of `t5`: T5's bidirectional relative-position buckets (see [`t5_bucket`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct T5Options {
    /// Buckets in all (half for keys after the query, half for keys before it).
    #[serde(default = "default_t5_buckets")]
    pub buckets: usize,
    /// Distances from here on share the last bucket of their side.
    #[serde(default = "default_t5_max_distance")]
    pub max_distance: usize,
    /// DAPE's MLP over the logits and the bias (`adaptive = { width = 32 }`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adaptive: Option<Adaptive>,
}

impl Default for T5Options {
    fn default() -> Self {
        Self {
            buckets: default_t5_buckets(),
            max_distance: default_t5_max_distance(),
            adaptive: None,
        }
    }
}

impl Named for T5Options {
    fn name(&self) -> &'static str {
        "t5"
    }
}

impl Scheme for T5Options {
    fn placement(&self) -> Placement {
        Adaptive::placement(self.adaptive.as_ref())
    }

    fn check(&self, shape: &SchemeShape) -> std::result::Result<(), String> {
        if let Some(a) = self.adaptive {
            a.check("t5")?;
        }
        if shape.causal {
            // The decoder's buckets: all on the left, exact below buckets / 2.
            if self.buckets < 2 {
                return Err(format!(
                    "t5: buckets = {} must be at least 2 (exact buckets for the nearest \
                     distances, then logarithmic ones); 32 is T5's",
                    self.buckets
                ));
            }
            let max_exact = self.buckets / 2;
            if self.max_distance <= max_exact {
                return Err(format!(
                    "t5: max_distance = {} must be above {max_exact} (buckets / 2, the distances \
                     that get a bucket each in a causal model); 128 is T5's",
                    self.max_distance
                ));
            }
            return Ok(());
        }
        if self.buckets < 4 {
            return Err(format!(
                "t5: buckets = {} must be at least 4 (half the buckets for each side, and exact \
                 buckets for the nearest distances in each half); 32 is T5's",
                self.buckets
            ));
        }
        let max_exact = self.buckets / 4;
        if self.max_distance <= max_exact {
            return Err(format!(
                "t5: max_distance = {} must be above {max_exact} (buckets / 4, the distances \
                 that get a bucket each); 128 is T5's",
                self.max_distance
            ));
        }
        Ok(())
    }

    fn param_count(&self, shape: &SchemeShape) -> u128 {
        self.buckets as u128 * shape.n_heads as u128
            + self.adaptive.map_or(0, |a| a.param_count(shape))
    }

    fn build(&self, shape: &SchemeShape, vb: VarBuilder) -> Result<PositionalModule> {
        let bias = T5Bias::new(
            self.buckets,
            self.max_distance,
            shape.n_heads,
            shape.d_model,
            vb.pp("rel_bias"),
        )?;
        let bias = ScoreBias::new(bias.with_causal(shape.causal));
        Adaptive::wrap(self.adaptive.as_ref(), shape, &vb, bias)
    }
}

impl Describe for T5Options {
    fn describe(&self, shape: &SchemeShape) -> String {
        format!(
            "attention bias: a learned ({} buckets x {} heads) table shared by all layers, by \
             T5's {}bucket of j - i (max_distance {}){}",
            self.buckets,
            shape.n_heads,
            if shape.causal { "decoder " } else { "" },
            self.max_distance,
            self.adaptive
                .map_or(String::new(), |a| a.describe(shape.n_heads))
        )
    }

    fn label(&self) -> String {
        Adaptive::label(self.adaptive.as_ref(), self.name())
    }
}

impl Portray for T5Options {
    /// Its bucket index: the learned values exist only in a trained model.
    fn without_model(&self, knobs: &Knobs) -> std::result::Result<Portrait, String> {
        Ok(Portrait::Index(PositionalConfig::T5(Self {
            buckets: knobs.buckets,
            max_distance: knobs.max_distance,
            adaptive: None,
        })))
    }

    fn offset_index(&self, positions: usize) -> Option<OffsetIndex> {
        let values = (0..positions * positions)
            .map(|n| {
                let (i, j) = (n / positions, n % positions);
                t5_bucket(j as i64 - i as i64, self.buckets, self.max_distance) as f64
            })
            .collect();
        Some(OffsetIndex {
            title: format!(
                "t5: bucket of j - i ({} buckets, max_distance {})",
                self.buckets, self.max_distance
            ),
            label: "bucket".into(),
            notes: vec![format!(
                "offsets below {} in size get a bucket each; keys after the query use buckets \
                 {}..{}; each head learns one value per bucket (see --run of a trained t5 model)",
                self.buckets / 4,
                self.buckets / 2,
                self.buckets - 1
            )],
            values,
        })
    }
}

impl Bench for T5Options {
    fn forward_flops(&self, shape: &SchemeShape, batch: usize, seq: usize) -> f64 {
        self.adaptive
            .map_or(0.0, |a| a.forward_flops(shape, batch, seq))
    }
}

impl ScoreMemory for T5Options {
    fn score_tensors(&self, training: bool, _fused: bool) -> usize {
        self.adaptive.map_or(1, |a| a.score_tensors(training))
    }
}

/// T5's bidirectional bucket of `rel = key position - query position`.
///
/// Half the buckets hold keys after the query (`rel > 0`), half the rest. Within a half,
/// distances below `max_exact = buckets / 4` get a bucket each; larger ones share logarithmic
/// buckets up to `max_distance`, and everything further falls in the half's last bucket:
///
/// ```text
/// bucket = half · [rel > 0] + (n                                                  if n < max_exact
///                              min(half - 1, max_exact + ⌊ln(n / max_exact)
///                                  / ln(max_distance / max_exact) · (half - max_exact)⌋)  else)
/// ```
///
/// with `half = buckets / 2`, `n = |rel|`. The logarithm is taken in f32, as T5 (and
/// transformers) compute it, so the bucket edges are theirs exactly.
pub fn t5_bucket(rel: i64, buckets: usize, max_distance: usize) -> usize {
    let half = buckets / 2;
    let side = if rel > 0 { half } else { 0 };
    side + side_bucket(rel.unsigned_abs() as usize, half, max_distance)
}

/// The bucket of distance `n` among the `side` buckets of one side: exact below `side / 2`,
/// then logarithmic up to `max_distance` (the logarithm in f32), the last one beyond.
fn side_bucket(n: usize, side: usize, max_distance: usize) -> usize {
    let max_exact = side / 2;
    if n < max_exact {
        return n;
    }
    let ratio = (n.max(1) as f32 / max_exact as f32).ln();
    let span = (max_distance as f64 / max_exact as f64).ln() as f32;
    let large = (ratio / span * (side - max_exact) as f32) as usize + max_exact;
    large.min(side - 1)
}

/// T5's decoder bucket (`bidirectional=False`) of `rel = key position - query position`.
///
/// Every bucket serves keys at or before the query: with `n = max(-rel, 0)`,
///
/// ```text
/// bucket = n                                                               if n < max_exact
///          min(buckets - 1, max_exact + ⌊ln(n / max_exact) / ln(max_distance / max_exact)
///                                        · (buckets - max_exact)⌋)        else
/// ```
///
/// with `max_exact = buckets / 2`, the logarithm in f32 as transformers compute it. Keys after
/// the query fall in bucket 0 (a causal mask hides them).
pub fn t5_bucket_causal(rel: i64, buckets: usize, max_distance: usize) -> usize {
    side_bucket((-rel).max(0) as usize, buckets, max_distance)
}

/// The T5 bias: a learned `(buckets, heads)` table, `rel_bias.weight`.
#[derive(Clone, Debug)]
pub struct T5Bias {
    table: Tensor,
    buckets: usize,
    max_distance: usize,
    /// The decoder's buckets ([`t5_bucket_causal`]) in place of the encoder's.
    causal: bool,
}

impl T5Bias {
    /// `rel_bias.weight` under `vb`, initialised `N(0, 1/sqrt(d_model))` as in transformers' T5.
    pub fn new(
        buckets: usize,
        max_distance: usize,
        heads: usize,
        d_model: usize,
        vb: VarBuilder,
    ) -> Result<Self> {
        let table = vb.get_with_hints(
            (buckets, heads),
            "weight",
            Init::Randn {
                mean: 0.0,
                stdev: 1.0 / (d_model as f64).sqrt(),
            },
        )?;
        Ok(Self {
            table,
            buckets,
            max_distance,
            causal: false,
        })
    }

    /// The same bias with the decoder's buckets ([`t5_bucket_causal`]) when `causal`.
    pub fn with_causal(self, causal: bool) -> Self {
        Self { causal, ..self }
    }

    /// The bucket of `rel = key position - query position`, the encoder's or the decoder's.
    pub fn bucket(&self, rel: i64) -> usize {
        match self.causal {
            true => t5_bucket_causal(rel, self.buckets, self.max_distance),
            false => t5_bucket(rel, self.buckets, self.max_distance),
        }
    }

    /// `(buckets, heads)`
    pub fn table(&self) -> &Tensor {
        &self.table
    }

    /// The number of distance buckets.
    pub fn buckets(&self) -> usize {
        self.buckets
    }

    /// The distance from which every offset shares the last bucket.
    pub fn max_distance(&self) -> usize {
        self.max_distance
    }

    /// The bias by offset `(1, h, 2t - 1)` where the positions are `start..start + t` shared
    /// by the batch (the bucket is then a function of the offset); `None` otherwise.
    /// Differentiable in the table.
    pub fn offsets(&self, positions: &Positions) -> Result<Option<Tensor>> {
        let t = positions.len();
        if positions.as_range().is_none() {
            return Ok(None);
        }
        let ids: Vec<u32> = (-(t as i64 - 1)..t as i64)
            .map(|rel| self.bucket(rel) as u32)
            .collect();
        let ids = Tensor::from_vec(ids, 2 * t - 1, self.table.device())?;
        let v = self.table.index_select(&ids, 0)?.t()?.unsqueeze(0)?; // (1, h, 2t - 1)
        Ok(Some(v.contiguous()?))
    }

    /// # Shapes
    /// - returns `(r, h, t, t)` for positions `(r, t)`; differentiable in the table
    pub fn bias(&self, positions: &Positions) -> Result<Tensor> {
        let (r, t) = (positions.rows(), positions.len());
        let heads = self.table.dim(D::Minus1)?;
        if let Some(v) = self.offsets(positions)? {
            // Shared positions: the bias is built from the 2t - 1 offsets' rows (its gradient a
            // sum per diagonal).
            return offset_bias(&v);
        }
        let mut idx = Vec::with_capacity(r * t * t);
        for row in 0..r {
            let p = positions.row(row);
            for &query in p {
                idx.extend(
                    p.iter()
                        .map(|&key| self.bucket(i64::from(key) - i64::from(query)) as u32),
                );
            }
        }
        let idx = Tensor::from_vec(idx, r * t * t, self.table.device())?;
        Ok(self
            .table
            .index_select(&idx, 0)? // (r t t, h)
            .reshape((r, t, t, heads))?
            .permute((0, 3, 1, 2))?
            .contiguous()?)
    }
}

impl BiasModule for T5Bias {
    fn layer_biases(&self, batch: &BiasBatch) -> Result<LayerBiases> {
        Ok(LayerBiases::Shared(
            self.bias(batch.positions)?.to_dtype(batch.dtype)?,
        ))
    }

    fn offset_biases(&self, batch: &BiasBatch) -> Result<Option<LayerBiases>> {
        Ok(match self.offsets(batch.positions)? {
            Some(v) => Some(LayerBiases::Shared(v.to_dtype(batch.dtype)?)),
            None => None,
        })
    }

    fn notes(&self) -> Result<Vec<String>> {
        Ok(vec![match self.causal {
            true => format!(
                "{} decoder buckets (max_distance {}): exact offsets up to -{}, then \
                 logarithmic buckets, all on the left",
                self.buckets,
                self.max_distance,
                self.buckets / 2 - 1
            ),
            false => format!(
                "{} buckets (max_distance {}): exact offsets up to ±{}, then logarithmic buckets",
                self.buckets,
                self.max_distance,
                self.buckets / 4 - 1
            ),
        }])
    }

    fn parameters(&self) -> Vec<Tensor> {
        vec![self.table.clone()]
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_by_hand() {
        // 32 buckets, max 128: exact below 8 on each side, keys after the query from 16.
        assert_eq!(t5_bucket(0, 32, 128), 0);
        assert_eq!(t5_bucket(-7, 32, 128), 7);
        assert_eq!(t5_bucket(7, 32, 128), 23);
        assert_eq!(t5_bucket(-8, 32, 128), 8);
        assert_eq!(t5_bucket(-1000, 32, 128), 15);
        assert_eq!(t5_bucket(1000, 32, 128), 31);
    }

    #[test]
    fn decoder_buckets_by_hand() {
        // 32 buckets, max 128: exact below 16, every bucket on the left, keys after in 0.
        assert_eq!(t5_bucket_causal(0, 32, 128), 0);
        assert_eq!(t5_bucket_causal(-15, 32, 128), 15);
        assert_eq!(t5_bucket_causal(-16, 32, 128), 16);
        assert_eq!(t5_bucket_causal(-1000, 32, 128), 31);
        assert_eq!(t5_bucket_causal(5, 32, 128), 0);
    }
}
