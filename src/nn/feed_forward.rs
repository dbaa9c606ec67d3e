//! The position-wise feed-forward block.

use candle::{Module, Result, Tensor};
use candle_nn::VarBuilder;

use super::Linear;

use super::{gelu, linear};

/// The feed-forward block's nonlinearity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// Exact GELU, `x Phi(x)` (BERT and most encoders since).
    #[default]
    Gelu,
    /// `max(x, 0)`, as in Vaswani et al. and the DeepMind length-generalization models.
    Relu,
}

impl Activation {
    /// The name configs use: `gelu` or `relu`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Gelu => "gelu",
            Self::Relu => "relu",
        }
    }

    /// Whether this is GELU, the default (configs omit it then).
    pub fn is_gelu(&self) -> bool {
        *self == Self::Gelu
    }

    /// The activation applied to `xs`, fused where the fused kernels run.
    pub fn apply(self, xs: &Tensor) -> Result<Tensor> {
        match self {
            Self::Gelu => gelu(xs),
            Self::Relu => xs.relu(),
        }
    }
}

/// `down(act(up(x)))`, weights `ffn.up` `(ffn_dim, d_model)` and `ffn.down` `(d_model, ffn_dim)`;
/// `act` is GELU or ReLU.
#[derive(Clone, Debug)]
pub struct FeedForward {
    up: Linear,
    down: Linear,
    activation: Activation,
}

impl FeedForward {
    /// `ffn.up`, `(ffn_dim, d_model)`
    pub fn up(&self) -> &Linear {
        &self.up
    }

    /// `ffn.down`, `(d_model, ffn_dim)`
    pub fn down(&self) -> &Linear {
        &self.down
    }

    /// The nonlinearity.
    pub fn activation(&self) -> Activation {
        self.activation
    }

    /// A feed-forward block of `d_model → ffn_dim → d_model`, weights under `vb` (`up`, `down`).
    pub fn new(
        d_model: usize,
        ffn_dim: usize,
        activation: Activation,
        vb: VarBuilder,
    ) -> Result<Self> {
        Ok(Self {
            up: linear(d_model, ffn_dim, vb.pp("up"))?,
            down: linear(ffn_dim, d_model, vb.pp("down"))?,
            activation,
        })
    }
}

impl Module for FeedForward {
    /// # Shapes
    /// - `xs`: `(b, t, d_model)`; returns the same shape
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let h = self.activation.apply(&self.up.forward(xs)?)?; // (b, t, ffn_dim)
        self.down.forward(&h)
    }
}
