//! KERPLE, logarithmic variant (Chi et al. 2022): every layer adds
//!
//! ```text
//! bias[h, i, j] = -r1_h · ln(1 + r2_h · |p_i - p_j|)
//! ```
//!
//! to its scores, with `r1, r2 > 0` learned per head and per layer
//! (`layers.{i}.attn.kerple.{r1,r2}`).
//!
//! Parametrisation: the variables are `r1` and `r2` themselves, kept at or above
//! [`KERPLE_MIN`] by projection: after every optimizer step, values below it are set to it
//! (what KERPLE's own code does by clamping the parameters before each forward). They start
//! uniform in `[KERPLE_MIN, 2]` (`r1`) and `[KERPLE_MIN, 1]` (`r2`), KERPLE's `U(0, 2)` and
//! `U(0, 1)` above its clamp, drawn from the seeded generator; they are not weight-decayed.
//! `adaptive = { width = … }` adds DAPE's MLP over the logits and this bias (`adaptive.rs`).

use super::{Bench, Describe, Named, Portray, ScoreMemory};
use candle::{DType, Tensor};
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};

use super::score_bias::{distance_tensor, offset_distances};
use super::{
    Adaptive, BiasBatch, BiasModule, Knobs, LayerBiases, Placement, Portrait, PositionalConfig,
    PositionalModule, Scheme, SchemeShape, ScoreBias,
};
use crate::error::Result;
use crate::params::LowerBound;

/// The least value of `r1` and `r2` (KERPLE's clamp).
pub const KERPLE_MIN: f64 = 1e-2;

/// Options of `kerple`: only DAPE's `adaptive` (none by default).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KerpleOptions {
    /// DAPE's MLP over the logits and the bias (`adaptive = { width = 32 }`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adaptive: Option<Adaptive>,
}

impl Named for KerpleOptions {
    fn name(&self) -> &'static str {
        "kerple"
    }
}

impl Scheme for KerpleOptions {
    fn placement(&self) -> Placement {
        Adaptive::placement(self.adaptive.as_ref())
    }

    fn check(&self, _shape: &SchemeShape) -> std::result::Result<(), String> {
        self.adaptive.map_or(Ok(()), |a| a.check("kerple"))
    }

    fn param_count(&self, shape: &SchemeShape) -> u128 {
        2 * shape.n_heads as u128 * shape.layers.count(shape.n_layers) as u128
            + self.adaptive.map_or(0, |a| a.param_count(shape))
    }

    fn build(&self, shape: &SchemeShape, vb: VarBuilder) -> Result<PositionalModule> {
        // Layers without positions (`[layers]`'s `none`) get no parameters.
        let layers = (0..shape.n_layers)
            .map(|i| {
                shape
                    .layers
                    .contains(i)
                    .then(|| Kerple::new(shape.n_heads, vb.pp(format!("layers.{i}.attn.kerple"))))
                    .transpose()
            })
            .collect::<Result<_>>()?;
        let bias = ScoreBias::new(KerpleLayers(layers));
        Adaptive::wrap(self.adaptive.as_ref(), shape, &vb, bias)
    }
}

impl Describe for KerpleOptions {
    fn describe(&self, shape: &SchemeShape) -> String {
        format!(
            "attention bias: -r1_h ln(1 + r2_h |i - j|), r1 and r2 learned per head and layer \
             ({} x {} each, kept >= {KERPLE_MIN}){}",
            shape.n_heads,
            shape.n_layers,
            self.adaptive
                .map_or(String::new(), |a| a.describe(shape.n_heads))
        )
    }

    fn label(&self) -> String {
        Adaptive::label(self.adaptive.as_ref(), self.name())
    }
}

impl Portray for KerpleOptions {
    fn without_model(&self, _knobs: &Knobs) -> std::result::Result<Portrait, String> {
        Ok(Portrait::Bias(PositionalConfig::Kerple(
            KerpleOptions::default(),
        )))
    }
}

impl Bench for KerpleOptions {
    fn forward_flops(&self, shape: &SchemeShape, batch: usize, seq: usize) -> f64 {
        self.adaptive
            .map_or(0.0, |a| a.forward_flops(shape, batch, seq))
    }
}

impl ScoreMemory for KerpleOptions {
    fn score_tensors(&self, training: bool, _fused: bool) -> usize {
        self.adaptive.map_or(1, |a| a.score_tensors(training))
    }
}

/// Every layer's KERPLE parameters; `None` for a layer without positions.
#[derive(Clone, Debug)]
pub struct KerpleLayers(pub Vec<Option<Kerple>>);

impl BiasModule for KerpleLayers {
    fn layer_biases(&self, batch: &BiasBatch) -> Result<LayerBiases> {
        let distances = distance_tensor(batch.positions, batch.dtype, batch.device)?;
        Ok(LayerBiases::PerLayer(
            self.0
                .iter()
                .map(|k| k.as_ref().map(|k| k.bias(&distances)).transpose())
                .collect::<Result<_>>()?,
        ))
    }

    fn offset_biases(&self, batch: &BiasBatch) -> Result<Option<LayerBiases>> {
        let t = batch.positions.len();
        if batch.positions.as_range().is_none() {
            return Ok(None);
        }
        let layers: Vec<&Kerple> = self.0.iter().flatten().collect();
        if layers.is_empty() {
            return Ok(Some(LayerBiases::PerLayer(vec![None; self.0.len()])));
        }
        // Every layer's at once, with the table's elementwise ops in its order on each offset's
        // distance: `r1` and `r2` stacked `(L, h, 1)`, one chain over `(L, h, 2t - 1)`, so that a
        // GPU launches each op once for the model rather than once a layer.
        let stack = |pick: fn(&Kerple) -> &Tensor| -> Result<Tensor> {
            let parts: Vec<&Tensor> = layers.iter().map(|k| pick(k)).collect();
            Ok(Tensor::stack(&parts, 0)?.unsqueeze(2)?)
        };
        let (r1, r2) = (stack(|k| &k.r1)?, stack(|k| &k.r2)?);
        let distances =
            offset_distances(t, batch.dtype, batch.device)?.reshape((1, 1, 2 * t - 1))?;
        let log = (distances.broadcast_mul(&r2)? + 1.0)?.log()?;
        let values = log.broadcast_mul(&r1)?.neg()?; // (L, h, 2t - 1)
        let mut next = 0;
        let per_layer = self
            .0
            .iter()
            .map(|k| match k {
                Some(_) => {
                    next += 1;
                    Ok(Some(values.narrow(0, next - 1, 1)?))
                }
                None => Ok(None),
            })
            .collect::<Result<_>>()?;
        Ok(Some(LayerBiases::PerLayer(per_layer)))
    }

    fn per_layer(&self) -> bool {
        true
    }

    fn notes(&self) -> Result<Vec<String>> {
        let v = |t: &Tensor| -> Result<Vec<f64>> { Ok(t.to_dtype(DType::F64)?.to_vec1::<f64>()?) };
        self.0
            .iter()
            .enumerate()
            .map(|(l, k)| match k {
                Some(k) => Ok(format!(
                    "layer {l}: r1 = [{}], r2 = [{}]",
                    super::list(&v(&k.r1)?),
                    super::list(&v(&k.r2)?)
                )),
                None => Ok(format!("layer {l}: no positions")),
            })
            .collect()
    }

    fn parameters(&self) -> Vec<Tensor> {
        self.0
            .iter()
            .flatten()
            .flat_map(|k| [k.r1.clone(), k.r2.clone()])
            .collect()
    }

    /// `r1` and `r2` stay at or above [`KERPLE_MIN`], where they were created.
    fn constraints(&self) -> Vec<LowerBound> {
        self.parameters()
            .into_iter()
            .map(|var| LowerBound {
                var,
                min: KERPLE_MIN,
            })
            .collect()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// One layer's KERPLE parameters.
#[derive(Clone, Debug)]
pub struct Kerple {
    /// `(h)`
    r1: Tensor,
    /// `(h)`
    r2: Tensor,
}

impl Kerple {
    /// `r1`, `r2` under `vb` (a layer's `attn.kerple`).
    pub fn new(heads: usize, vb: VarBuilder) -> Result<Self> {
        let uniform = |up: f64| Init::Uniform { lo: KERPLE_MIN, up };
        Ok(Self {
            r1: vb.get_with_hints(heads, "r1", uniform(2.0))?,
            r2: vb.get_with_hints(heads, "r2", uniform(1.0))?,
        })
    }

    /// From given `r1` and `r2`, each `(h)` (for analysis and tests).
    pub fn from_tensors(r1: Tensor, r2: Tensor) -> Self {
        Self { r1, r2 }
    }

    /// `(r1, r2)`, each `(h)`.
    pub fn params(&self) -> (&Tensor, &Tensor) {
        (&self.r1, &self.r2)
    }

    /// # Shapes
    /// - `distances`: `(r, 1, t, t)` of `|p_i - p_j|` in the parameters' dtype
    /// - returns `(r, h, t, t)`; differentiable in `r1` and `r2`
    pub fn bias(&self, distances: &Tensor) -> Result<Tensor> {
        let h = self.r1.dim(0)?;
        let r1 = self.r1.reshape((1, h, 1, 1))?;
        let r2 = self.r2.reshape((1, h, 1, 1))?;
        let log = (distances.broadcast_mul(&r2)? + 1.0)?.log()?;
        Ok(log.broadcast_mul(&r1)?.neg()?)
    }
}
