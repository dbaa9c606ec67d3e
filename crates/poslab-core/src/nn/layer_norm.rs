//! LayerNorm as a composition of differentiable ops.

use candle::{Result, Tensor, D};
use candle_nn::{Init, VarBuilder};

use super::Backend;
#[cfg(feature = "kernels")]
use super::Path;

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

/// [`layer_norm`] with a bias, or [`layer_norm_no_bias`] without one (`bias = false` models).
pub fn layer_norm_with_bias(
    size: usize,
    eps: f64,
    bias: bool,
    vb: VarBuilder,
) -> Result<LayerNorm> {
    match bias {
        true => layer_norm(size, eps, vb),
        false => layer_norm_no_bias(size, eps, vb),
    }
}

/// A LayerNorm without a bias (ModernBERT's): its `weight` under `vb`, and a bias fixed at 0
/// that is no variable.
pub fn layer_norm_no_bias(size: usize, eps: f64, vb: VarBuilder) -> Result<LayerNorm> {
    let weight = vb.get_with_hints(size, "weight", Init::Const(1.0))?;
    let bias = Tensor::zeros(size, vb.dtype(), vb.device())?;
    Ok(LayerNorm { weight, bias, eps })
}

impl LayerNorm {
    /// The scale, `(d,)`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The shift, `(d,)`.
    pub fn bias(&self) -> &Tensor {
        &self.bias
    }

    /// What weight decay leaves alone: the gain and the shift (a model without biases has no
    /// shift variable, only zeros).
    pub fn undecayed(&self) -> Vec<Tensor> {
        vec![self.weight.clone(), self.bias.clone()]
    }

    /// The scale and the shift, to be replaced by views of a packed variable
    /// ([`crate::ParamStore::pack`]).
    pub(crate) fn params_mut(&mut self) -> (&mut Tensor, &mut Tensor) {
        (&mut self.weight, &mut self.bias)
    }

    /// The epsilon added to the variance.
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// `LN(content + position)` as a content part and a position part that sum to it exactly:
    /// the mean is linear, both parts are divided by the sum's standard deviation, and the bias
    /// goes with the content.
    ///
    /// # Shapes
    /// - `content`: `(b, t, size)`; `position`: `(1, t, size)` or `(b, t, size)`
    /// - returns two `(b, t, size)` tensors
    pub fn split(&self, content: &Tensor, position: &Tensor) -> Result<(Tensor, Tensor)> {
        let position = position.broadcast_as(content.shape())?;
        let sum = (content + &position)?;
        let centered = sum.broadcast_sub(&sum.mean_keepdim(D::Minus1)?)?;
        let inv_std = (centered.sqr()?.mean_keepdim(D::Minus1)? + self.eps)?
            .sqrt()?
            .recip()?;
        let part = |x: &Tensor| -> Result<Tensor> {
            x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?
                .broadcast_mul(&inv_std)?
                .broadcast_mul(&self.weight)
        };
        Ok((part(content)?.broadcast_add(&self.bias)?, part(&position)?))
    }
}

impl LayerNorm {
    /// `LN(xs)` over the last axis, computed where `backend` says.
    ///
    /// # Shapes
    /// - `xs`: `(..., size)`; returns the same shape
    pub fn forward(&self, xs: &Tensor, backend: Backend) -> Result<Tensor> {
        if super::is_half(xs.dtype()) && !super::is_half(self.weight.dtype()) {
            // Half-precision activations: statistics and affine in the weights' dtype (f32),
            // the result rounded back once.
            return self
                .forward(&xs.to_dtype(self.weight.dtype())?, backend)?
                .to_dtype(xs.dtype());
        }
        #[cfg(feature = "kernels")]
        {
            let (w, b, eps) = (&self.weight, &self.bias, self.eps);
            let same = xs.dtype() == w.dtype();
            match backend.path(xs) {
                Path::Fused => return crate::kernels::cpu::layer_norm(xs, w, b, eps, backend.simd),
                Path::Device if same && backend.whole_layers(xs) => {
                    return crate::kernels::gpu::norm::layer_norm(xs, w, b, eps)
                }
                Path::Device if same => return crate::kernels::cuda_ops::layer_norm(xs, w, b, eps),
                _ => {}
            }
        }
        self.forward_reference(xs)
    }

    /// The composition: mean, variance, normalisation and the affine map.
    pub fn forward_reference(&self, xs: &Tensor) -> Result<Tensor> {
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
