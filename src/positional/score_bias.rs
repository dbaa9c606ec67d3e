//! The third place a scheme acts: a bias on every layer's attention scores.
//!
//! [`ScoreBias`] holds the scheme's module; for each batch it builds the `(r, h, t, t)` bias of
//! every layer from the tokens' positions ([`LayerBiases`]), which attention adds to its scaled
//! scores before the padding mask and the softmax. ALiBi, T5 and TUPE's term are one tensor
//! shared by all layers; KERPLE's parameters are per layer.

use candle::{Device, Tensor};
use candle_nn::VarBuilder;

use super::{Alibi, Kerple, PositionalConfig, Positions, SchemeShape, T5Bias, Untied};
use crate::error::Result;

/// A score-bias scheme's module.
#[derive(Debug)]
pub enum ScoreBias {
    Alibi(Alibi),
    T5(T5Bias),
    /// One per layer.
    Kerple(Vec<Kerple>),
    Untied(Untied),
}

/// The score bias of each layer for one batch.
#[derive(Clone, Debug)]
pub enum LayerBiases {
    /// The same `(r, h, t, t)` tensor for every layer.
    Shared(Tensor),
    /// One `(r, h, t, t)` tensor per layer.
    PerLayer(Vec<Tensor>),
}

impl LayerBiases {
    /// Layer `i`'s bias.
    pub fn layer(&self, i: usize) -> &Tensor {
        match self {
            Self::Shared(t) => t,
            Self::PerLayer(v) => &v[i],
        }
    }
}

impl ScoreBias {
    /// Builds the module of a score-bias scheme under `vb`.
    pub fn new(config: &PositionalConfig, shape: SchemeShape, vb: VarBuilder) -> Result<Self> {
        let SchemeShape {
            d_model,
            n_heads,
            n_layers,
            max_len,
        } = shape;
        Ok(match config {
            PositionalConfig::Alibi(_) => Self::Alibi(Alibi::new(n_heads)),
            PositionalConfig::T5(o) => Self::T5(T5Bias::new(
                o.buckets,
                o.max_distance,
                n_heads,
                d_model,
                vb.pp("rel_bias"),
            )?),
            PositionalConfig::Kerple(_) => Self::Kerple(
                (0..n_layers)
                    .map(|i| Kerple::new(n_heads, vb.pp(format!("layers.{i}.attn.kerple"))))
                    .collect::<Result<_>>()?,
            ),
            PositionalConfig::Untied(o) => {
                Self::Untied(Untied::new(o, d_model, n_heads, max_len, vb)?)
            }
            other => {
                return Err(crate::Error::Config(format!(
                    "`{}` is not an attention-bias scheme",
                    other.name()
                )))
            }
        })
    }

    /// The rows of a learned table (TUPE's learned source), which bound the positions.
    pub fn max_positions(&self) -> Option<usize> {
        match self {
            Self::Untied(u) => u.max_positions(),
            _ => None,
        }
    }

    /// Every layer's bias for a batch at `positions`, in `dtype` (the parameters').
    pub fn layer_biases(
        &self,
        positions: &Positions,
        dtype: candle::DType,
        device: &Device,
    ) -> Result<LayerBiases> {
        Ok(match self {
            Self::Alibi(a) => LayerBiases::Shared(a.bias(positions, dtype, device)?),
            Self::T5(t5) => LayerBiases::Shared(t5.bias(positions)?.to_dtype(dtype)?),
            Self::Untied(u) => LayerBiases::Shared(u.bias(positions, dtype)?),
            Self::Kerple(layers) => {
                let (r, t) = (positions.rows(), positions.len());
                let distances =
                    Tensor::from_vec(positions.distances(), (r, 1, t, t), &Device::Cpu)?
                        .to_dtype(dtype)?
                        .to_device(device)?;
                LayerBiases::PerLayer(
                    layers
                        .iter()
                        .map(|k| k.bias(&distances))
                        .collect::<Result<_>>()?,
                )
            }
        })
    }
}
