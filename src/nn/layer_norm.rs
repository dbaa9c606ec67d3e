//! LayerNorm as a composition of differentiable ops.

use candle::{Module, Result, Tensor, D};
use candle_nn::{Init, VarBuilder};

/// `(x - mean) / sqrt(var + eps) * weight + bias` over the last axis (biased variance, as in
/// PyTorch). Built from primitive ops so gradients reach everything upstream.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

/// A LayerNorm of width `size` with weight 1 and bias 0, under `vb` as `weight` and `bias`.
pub fn layer_norm(size: usize, eps: f64, vb: VarBuilder) -> Result<LayerNorm> {
    let weight = vb.get_with_hints(size, "weight", Init::Const(1.0))?;
    let bias = vb.get_with_hints(size, "bias", Init::Const(0.0))?;
    Ok(LayerNorm { weight, bias, eps })
}

impl Module for LayerNorm {
    /// # Shapes
    /// - `xs`: `(..., size)`; returns the same shape
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let mean = xs.mean_keepdim(D::Minus1)?;
        let centered = xs.broadcast_sub(&mean)?;
        let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
        let inv_std = (var + self.eps)?.sqrt()?.recip()?;
        centered
            .broadcast_mul(&inv_std)?
            .broadcast_mul(&self.weight)?
            .broadcast_add(&self.bias)
    }
}
