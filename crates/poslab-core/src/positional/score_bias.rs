//! The third place a scheme acts: a bias on every layer's attention scores.
//!
//! A score-bias scheme's module implements [`BiasModule`]. For each batch it gives the bias of
//! every layer ([`LayerBiases`]), which attention adds to its scaled scores before the padding
//! mask and the softmax: one tensor shared by all layers (ALiBi, T5, FIRE, TUPE's term), one per
//! layer (KERPLE), or, for a contextual scheme (FoX), a bias each layer computes from its own
//! attention input.

use std::any::Any;

use candle::{DType, Device, Tensor};

use super::Positions;
use crate::error::Result;
use crate::params::LowerBound;

/// What a score bias is computed from, for one batch.
#[derive(Clone, Copy, Debug)]
pub struct BiasBatch<'a> {
    /// `(r, t)`, `r` 1 or `b`.
    pub positions: &'a Positions,
    /// `(b, t)`, 1 for real tokens and 0 for padding; `None`: every token is real.
    pub mask: Option<&'a Tensor>,
    /// The parameters' dtype, in which the bias is returned.
    pub dtype: DType,
    /// The device the bias is made on.
    pub device: &'a Device,
    /// Where the ops making it compute.
    pub backend: crate::nn::Backend,
}

/// A score-bias scheme's module.
pub trait BiasModule: std::fmt::Debug + Send + Sync {
    /// Every layer's bias for a batch.
    fn layer_biases(&self, batch: &BiasBatch) -> Result<LayerBiases>;

    /// Every layer's bias by offset, where at these positions it is a function of the offset
    /// `j - i` alone, the same for every sequence: [`BiasModule::layer_biases`]'s values, each
    /// tensor `(1, h, 2t - 1)` for offsets `-(t - 1)..=t - 1` in order (its table is
    /// [`crate::kernels::spec::offset_table`]'s). What the device path's fused attention reads in
    /// place of a `t × t` table. `None` where the bias is not one of offsets at these positions.
    fn offset_biases(&self, _batch: &BiasBatch) -> Result<Option<LayerBiases>> {
        Ok(None)
    }

    /// Layer `layer`'s bias computed from its attention input `x` (`(b, t, d_model)`), for a
    /// contextual scheme whose [`BiasModule::layer_biases`] is [`LayerBiases::FromInput`]: a
    /// `(b, h, t, t)` table, or running sums whose two-sided differences are the bias (see
    /// [`crate::nn::AttentionBias`]).
    fn input_bias(
        &self,
        _layer: usize,
        _x: &Tensor,
        _backend: crate::nn::Backend,
    ) -> Result<Option<crate::nn::LayerBias>> {
        Ok(None)
    }

    /// Layer `layer`'s [`BiasModule::input_bias`] as the forget gates a fused layer computes
    /// inside itself, where the bias is exactly their running sums ([`crate::nn::ForgetGates`]);
    /// `None` otherwise, and the layer is given [`BiasModule::input_bias`]'s bias.
    fn input_gates(&self, _layer: usize) -> Option<crate::nn::ForgetGates> {
        None
    }

    /// Every layer's [`BiasModule::input_gates`] themselves, by layer (empty when none), to be
    /// packed with the layers' parameters ([`crate::Encoder::pack`]), which replaces their
    /// tensors by views.
    fn input_gates_mut(&mut self) -> Vec<Option<&mut crate::nn::ForgetGates>> {
        Vec::new()
    }

    /// The positions a learned table can read (TUPE's learned source).
    fn max_positions(&self) -> Option<usize> {
        None
    }

    /// Whether the layers' biases differ (an analysis shows each).
    fn per_layer(&self) -> bool {
        false
    }

    /// Whether the bias depends on absolute positions (an analysis draws heatmaps too).
    fn absolute(&self) -> bool {
        false
    }

    /// Lines of scheme facts for an analysis: slopes, learned parameters.
    fn notes(&self) -> Result<Vec<String>>;

    /// The trainable tensors the module holds.
    fn parameters(&self) -> Vec<Tensor>;

    /// A learned position table `(max_len, d_model)` the module holds (TUPE's), if any.
    fn learned_table(&self) -> Option<&Tensor> {
        None
    }

    /// Its variables that weight decay leaves alone (biases).
    fn undecayed(&self) -> Vec<Tensor> {
        Vec::new()
    }

    /// Bounds its variables must stay within, applied by the optimizer after every step.
    fn constraints(&self) -> Vec<LowerBound> {
        Vec::new()
    }

    /// For an analysis that draws what only this scheme has.
    fn as_any(&self) -> &dyn Any;
}

/// The score bias of each layer for one batch.
#[derive(Clone, Debug)]
pub enum LayerBiases {
    /// The same `(r, h, t, t)` tensor for every layer.
    Shared(Tensor),
    /// One `(r, h, t, t)` tensor per layer; `None` for a layer without positions.
    PerLayer(Vec<Option<Tensor>>),
    /// Each layer computes its own from its attention input ([`BiasModule::input_bias`]).
    FromInput,
}

impl LayerBiases {
    /// Layer `i`'s bias, where it does not depend on the layer's input.
    pub fn layer(&self, i: usize) -> Option<&Tensor> {
        match self {
            Self::Shared(t) => Some(t),
            Self::PerLayer(v) => v.get(i).and_then(Option::as_ref),
            Self::FromInput => None,
        }
    }
}

/// The module of a score-bias scheme.
#[derive(Debug)]
pub struct ScoreBias(Box<dyn BiasModule>);

impl ScoreBias {
    /// Wraps a scheme's bias module.
    pub fn new(module: impl BiasModule + 'static) -> Self {
        Self(Box::new(module))
    }

    /// Its variables that weight decay leaves alone.
    pub fn undecayed(&self) -> Vec<Tensor> {
        self.0.undecayed()
    }

    /// The learned position table the module holds, if any.
    pub fn learned_table(&self) -> Option<&Tensor> {
        self.0.learned_table()
    }

    /// The scheme's module as its own type, if it is `T`.
    pub fn downcast<T: 'static>(&self) -> Option<&T> {
        self.0.as_any().downcast_ref::<T>()
    }
}

impl std::ops::Deref for ScoreBias {
    type Target = dyn BiasModule;
    fn deref(&self) -> &Self::Target {
        self.0.as_ref()
    }
}

impl std::ops::DerefMut for ScoreBias {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.0.as_mut()
    }
}

/// `|o|` for the offsets `o = -(t - 1)..=t - 1` in order: the distances of a bias by offset.
pub(crate) fn offset_lengths(t: usize) -> impl Iterator<Item = f64> {
    (0..2 * t - 1).map(move |o| (o as f64 - (t as f64 - 1.0)).abs())
}

/// [`offset_lengths`] as a `(1, 1, 1, 2t - 1)` tensor in `dtype` on `device`.
pub(crate) fn offset_distances(t: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let d: Vec<f64> = offset_lengths(t).collect();
    Ok(Tensor::from_vec(d, (1, 1, 1, 2 * t - 1), &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)?)
}

/// `(r, 1, t, t)` of `|p_i - p_j|` in `dtype` on `device`.
pub(crate) fn distance_tensor(
    positions: &Positions,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let (r, t) = (positions.rows(), positions.len());
    Ok(
        Tensor::from_vec(positions.distances(), (r, 1, t, t), &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(device)?,
    )
}

/// The bias of offsets: element `(k, head, i, j)` is `v[k, head, j - i + t - 1]`, for a bias
/// that depends on the offset `j - i` alone (positions `start..start + t`), from its `2t - 1`
/// values per row and head ([`crate::kernels::spec::offset_table`]).
///
/// # Shapes
/// - `v`: `(r, h, 2t - 1)`, offsets `-(t - 1)..=t - 1` in order
/// - returns `(r, h, t, t)`
pub(crate) fn offset_bias(v: &Tensor) -> Result<Tensor> {
    let w = v.dims3()?.2;
    if w % 2 == 0 {
        return Err(crate::error::Error::Input(format!(
            "a bias of offsets needs 2t - 1 values per head, not {w}"
        )));
    }
    Ok(crate::kernels::spec::offset_table(v)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bias_of_offsets_reads_each_offset_and_its_gradient_sums_each_diagonal() {
        let device = Device::Cpu;
        for t in [1usize, 2, 3, 7] {
            let (r, h, w) = (2, 3, 2 * t - 1);
            let values: Vec<f64> = (0..r * h * w).map(|k| (k as f64 * 0.37).sin()).collect();
            let v = candle::Var::from_vec(values.clone(), (r, h, w), &device).unwrap();
            let bias = offset_bias(v.as_tensor()).unwrap();
            assert_eq!(bias.dims(), &[r, h, t, t]);
            let b4: Vec<Vec<Vec<Vec<f64>>>> = (0..r)
                .map(|k| bias.get(k).unwrap().to_vec3::<f64>().unwrap())
                .collect();
            for k in 0..r {
                for head in 0..h {
                    for i in 0..t {
                        for j in 0..t {
                            let want = values[(k * h + head) * w + (j + t - 1 - i)];
                            assert_eq!(b4[k][head][i][j], want, "t {t} ({k}, {head}, {i}, {j})");
                        }
                    }
                }
            }
            // d/dv of sum(bias * g) is the sum of g along each diagonal.
            let g: Vec<f64> = (0..r * h * t * t)
                .map(|k| (k as f64 * 0.11).cos())
                .collect();
            let gt = Tensor::from_vec(g.clone(), (r, h, t, t), &device).unwrap();
            let grads = (bias * &gt).unwrap().sum_all().unwrap().backward().unwrap();
            let dv = grads
                .get(&v)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            for k in 0..r {
                for head in 0..h {
                    for d in 0..w {
                        let offset = d as i64 - (t as i64 - 1);
                        let want: f64 = (0..t as i64)
                            .filter(|i| (0..t as i64).contains(&(i + offset)))
                            .map(|i| {
                                g[((k * h + head) * t + i as usize) * t + (i + offset) as usize]
                            })
                            .sum();
                        let got = dv[(k * h + head) * w + d];
                        assert!(
                            (got - want).abs() < 1e-12,
                            "t {t} offset {offset}: {got} vs {want}"
                        );
                    }
                }
            }
        }
        assert!(offset_bias(&Tensor::zeros((1, 1, 4), DType::F32, &device).unwrap()).is_err());
    }
}
