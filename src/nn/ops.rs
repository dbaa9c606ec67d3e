//! Small differentiable functions shared by the layers.

use candle::{Result, Tensor, D};
use candle_nn::{Init, Linear, VarBuilder};

/// A linear layer `y = x W^T + b`, `W` of shape `(out, in)` as in PyTorch and candle-nn,
/// initialised like PyTorch's `nn.Linear`: weight and bias uniform in `±1/sqrt(in)`.
pub fn linear(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    let weight = vb.get_with_hints((out_dim, in_dim), "weight", linear_init(in_dim))?;
    let bias = vb.get_with_hints(out_dim, "bias", linear_init(in_dim))?;
    Ok(Linear::new(weight, Some(bias)))
}

/// As [`linear`], without the bias.
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    let weight = vb.get_with_hints((out_dim, in_dim), "weight", linear_init(in_dim))?;
    Ok(Linear::new(weight, None))
}

fn linear_init(in_dim: usize) -> Init {
    let bound = 1.0 / (in_dim as f64).sqrt();
    Init::Uniform {
        lo: -bound,
        up: bound,
    }
}

/// Softmax over the last axis, `exp(x - max) / sum(exp(x - max))`.
///
/// The max is detached: subtracting it changes no value of the result, so no gradient is owed
/// through it, and skipping it saves a backward pass through the reduction.
pub fn softmax_last_dim(xs: &Tensor) -> Result<Tensor> {
    let max = xs.max_keepdim(D::Minus1)?.detach();
    let exp = xs.broadcast_sub(&max)?.exp()?;
    let sum = exp.sum_keepdim(D::Minus1)?;
    exp.broadcast_div(&sum)
}

/// Log-softmax over the last axis, `x - max - log(sum(exp(x - max)))`, the max detached as in
/// [`softmax_last_dim`].
pub fn log_softmax_last_dim(xs: &Tensor) -> Result<Tensor> {
    let max = xs.max_keepdim(D::Minus1)?.detach();
    let shifted = xs.broadcast_sub(&max)?;
    let log_sum = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    shifted.broadcast_sub(&log_sum)
}

/// GELU in its exact form, `x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2))`.
///
/// Composed from `erf` rather than candle's fused `gelu_erf`, whose backward hard-codes
/// `1/sqrt(2 pi)` as 0.398942: its gradients are off by up to about 5e-7 relative, which the
/// f64 finite-difference test sees (1.7e-9 with this form). The fused forward is about 2x faster
/// on CPU; a fused op with an exact backward is the way to get both.
pub fn gelu(xs: &Tensor) -> Result<Tensor> {
    let cdf = ((xs * std::f64::consts::FRAC_1_SQRT_2)?.erf()? + 1.0)? * 0.5;
    xs * cdf?
}
