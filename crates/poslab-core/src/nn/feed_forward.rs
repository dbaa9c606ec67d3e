//! The position-wise feed-forward block.

use candle::{Result, Tensor, D};
use candle_nn::VarBuilder;

use super::{gelu, linear_with_bias, Backend, Linear};

/// The feed-forward block's nonlinearity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// Exact GELU, `x Phi(x)` (BERT and most encoders since).
    #[default]
    Gelu,
    /// `max(x, 0)`, as in Vaswani et al. and the DeepMind length-generalization models.
    Relu,
    /// GeGLU (Shazeer 2020, "GLU Variants Improve Transformer"), ModernBERT's: the up
    /// projection is `2 · ffn_dim` wide, split into an input and a gate, and the block computes
    /// `gelu(input) ⊙ gate`.
    Geglu,
}

impl Activation {
    /// The fused layer's form of it: GELU and ReLU (GeGLU layers run as ops).
    pub fn fused(self) -> Option<crate::kernels::spec::Act> {
        match self {
            Self::Gelu => Some(crate::kernels::spec::Act::Gelu),
            Self::Relu => Some(crate::kernels::spec::Act::Relu),
            Self::Geglu => None,
        }
    }

    /// The name configs use: `gelu` or `relu`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Gelu => "gelu",
            Self::Relu => "relu",
            Self::Geglu => "geglu",
        }
    }

    /// How many times `ffn_dim` the up projection is wide: 2 for GeGLU's input and gate, else 1.
    pub fn up_factor(self) -> usize {
        match self {
            Self::Geglu => 2,
            _ => 1,
        }
    }

    /// Whether this is GELU, the default (configs omit it then).
    pub fn is_gelu(&self) -> bool {
        *self == Self::Gelu
    }

    /// The activation applied to `xs`, fused where the fused kernels run.
    ///
    /// # Shapes
    /// - `xs`: `(.., n)`; returns `(.., n)`, and for GeGLU `(.., n / 2)`: `gelu` of the first
    ///   half times the second
    pub fn apply(self, xs: &Tensor, backend: Backend) -> Result<Tensor> {
        match self {
            Self::Gelu => gelu(xs, backend),
            Self::Relu => xs.relu(),
            Self::Geglu => {
                let n = xs.dim(D::Minus1)? / 2;
                gelu(&xs.narrow(D::Minus1, 0, n)?, backend)? * xs.narrow(D::Minus1, n, n)?
            }
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
    /// What weight decay leaves alone: the projections' biases.
    pub fn undecayed(&self) -> Vec<Tensor> {
        [&self.up, &self.down]
            .iter()
            .flat_map(|l| l.undecayed())
            .collect()
    }
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

    /// `ffn.up` and `ffn.down`, to be packed ([`crate::ParamStore::pack`]).
    pub(crate) fn linears_mut(&mut self) -> (&mut Linear, &mut Linear) {
        (&mut self.up, &mut self.down)
    }

    /// The nonlinearity.
    pub fn activation(&self) -> Activation {
        self.activation
    }

    /// A feed-forward block of `d_model → ffn_dim → d_model` (the up projection twice as wide
    /// for GeGLU), weights under `vb` (`up`, `down`), with biases when `bias`.
    pub fn new(
        d_model: usize,
        ffn_dim: usize,
        activation: Activation,
        bias: bool,
        vb: VarBuilder,
    ) -> Result<Self> {
        let up = activation.up_factor() * ffn_dim;
        Ok(Self {
            up: linear_with_bias(d_model, up, bias, vb.pp("up"))?,
            down: linear_with_bias(ffn_dim, d_model, bias, vb.pp("down"))?,
            activation,
        })
    }
}

impl FeedForward {
    /// # Shapes
    /// - `xs`: `(b, t, d_model)`; returns the same shape
    pub fn forward(&self, xs: &Tensor, backend: Backend) -> Result<Tensor> {
        let h = self.up.forward(xs, backend)?;
        let h = self.activation.apply(&h, backend)?; // (b, t, ffn_dim)
        self.down.forward(&h, backend)
    }
}
