//! `log σ(z)`, fused, with its backward: FoX's forget gates and any other log-space gate.
//!
//! ```text
//! y  = log σ(z) = -(max(-z, 0) + ln(1 + e^(-|z|)))      exact for any z, never above 0
//! dz = dy σ(-z) = dy · u / (1 + u) for z >= 0, dy / (1 + u) below,   u = e^(-|z|)
//! ```
//!
//! The composition of candle ops (`nn::log_sigmoid` off the fused path) takes eight passes and
//! eight temporaries forward, a dozen more backward; this is one pass each way.

use candle::{Result, Tensor};
use std::mem::MaybeUninit;

use super::pointwise::{self, Pointwise};
use super::*;

#[inline(always)]
fn log_sigmoid_body<T: Real>(z: &[T], y: &mut [MaybeUninit<T>]) {
    for (o, v) in y.iter_mut().zip(z) {
        let u = (-v.abs()).exp_();
        let neg = -*v;
        let relu = if neg > T::zero() { neg } else { T::zero() };
        o.write(-(relu + u.ln_1p_()));
    }
}
simd_dispatch!(fn log_sigmoid_rows = log_sigmoid_body(z: &[T], y: &mut [MaybeUninit<T>]));

/// `dz = g σ(-z)`.
#[inline(always)]
fn log_sigmoid_grad_body<T: Real>(z: &[T], g: &[T], dz: &mut [MaybeUninit<T>]) {
    for ((o, v), gi) in dz.iter_mut().zip(z).zip(g) {
        let u = (-v.abs()).exp_();
        let inv = (T::one() + u).recip();
        let sigmoid_neg = if *v >= T::zero() { u * inv } else { inv };
        o.write(*gi * sigmoid_neg);
    }
}
simd_dispatch!(fn log_sigmoid_grad_rows = log_sigmoid_grad_body(z: &[T], g: &[T], dz: &mut [MaybeUninit<T>]));

/// `log σ` as a [`Pointwise`] function.
#[derive(Clone, Copy)]
pub(super) struct LogSigmoid;

impl Pointwise for LogSigmoid {
    const NAME: &'static str = "log sigmoid";
    fn rows<T: Real>(simd: SimdLevel, z: &[T], y: &mut [MaybeUninit<T>]) {
        log_sigmoid_rows(simd, z, y)
    }
    fn grad_rows<T: Real>(simd: SimdLevel, z: &[T], g: &[T], dz: &mut [MaybeUninit<T>]) {
        log_sigmoid_grad_rows(simd, z, g, dz)
    }
}

/// `log σ(z)`, fused.
pub fn log_sigmoid(z: &Tensor, simd: SimdLevel) -> Result<Tensor> {
    pointwise::apply::<LogSigmoid>(z, simd)
}
