//! The position-wise feed-forward block.

use candle::{Module, Result, Tensor};
use candle_nn::VarBuilder;

use super::Linear;

use super::{gelu, linear};

/// `down(GELU(up(x)))`, weights `ffn.up` `(ffn_dim, d_model)` and `ffn.down` `(d_model, ffn_dim)`.
#[derive(Clone, Debug)]
pub struct FeedForward {
    up: Linear,
    down: Linear,
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

    pub fn new(d_model: usize, ffn_dim: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            up: linear(d_model, ffn_dim, vb.pp("up"))?,
            down: linear(ffn_dim, d_model, vb.pp("down"))?,
        })
    }
}

impl Module for FeedForward {
    /// # Shapes
    /// - `xs`: `(b, t, d_model)`; returns the same shape
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let h = gelu(&self.up.forward(xs)?)?; // (b, t, ffn_dim)
        self.down.forward(&h)
    }
}
