//! Exact (erf) GELU and ReLU, fused, with their backward passes.

use candle::{Result, Tensor};
use rayon::prelude::*;
use std::mem::MaybeUninit;

use super::pointwise::{self, Pointwise, ELEMENTS_PER_TASK};
use super::*;

#[inline(always)]
fn gelu_body<T: Real>(x: &[T], y: &mut [MaybeUninit<T>]) {
    let (half, inv_sqrt2) = (T::lit(0.5), T::lit(std::f64::consts::FRAC_1_SQRT_2));
    for (o, v) in y.iter_mut().zip(x) {
        o.write(half * *v * (T::one() + (*v * inv_sqrt2).erf_()));
    }
}
simd_dispatch!(fn gelu_rows = gelu_body(x: &[T], y: &mut [MaybeUninit<T>]));

/// `dx = g (Phi(x) + x phi(x))`.
#[inline(always)]
fn gelu_grad_body<T: Real>(x: &[T], g: &[T], dx: &mut [MaybeUninit<T>]) {
    for ((o, v), gi) in dx.iter_mut().zip(x).zip(g) {
        let (cdf, pdf) = v.normal_cdf_pdf();
        o.write(*gi * (cdf + *v * pdf));
    }
}
simd_dispatch!(fn gelu_grad_rows = gelu_grad_body(x: &[T], g: &[T], dx: &mut [MaybeUninit<T>]));

/// Exact GELU as a [`Pointwise`] function.
#[derive(Clone, Copy)]
struct Gelu;

impl Pointwise for Gelu {
    const NAME: &'static str = "gelu";
    fn rows<T: Real>(simd: SimdLevel, x: &[T], y: &mut [MaybeUninit<T>]) {
        gelu_rows(simd, x, y)
    }
    fn grad_rows<T: Real>(simd: SimdLevel, x: &[T], g: &[T], dx: &mut [MaybeUninit<T>]) {
        gelu_grad_rows(simd, x, g, dx)
    }
}

/// `max(x, 0)`, in parallel chunks.
fn relu_par<T: Real>(x: &[T]) -> Vec<T> {
    let mut y = zeros(x.len());
    y.par_chunks_mut(ELEMENTS_PER_TASK)
        .zip(x.par_chunks(ELEMENTS_PER_TASK))
        .for_each(|(o, i)| {
            for (o, v) in o.iter_mut().zip(i) {
                *o = if *v > T::zero() { *v } else { T::zero() };
            }
        });
    y
}

/// `g ReLU'(x)`, with candle's convention at 0 (`x >= 0` passes the gradient), so the fused
/// layer and the composition agree everywhere.
fn relu_grad_par<T: Real>(x: &[T], g: &[T]) -> Vec<T> {
    let mut dx = zeros(x.len());
    dx.par_chunks_mut(ELEMENTS_PER_TASK)
        .zip(
            x.par_chunks(ELEMENTS_PER_TASK)
                .zip(g.par_chunks(ELEMENTS_PER_TASK)),
        )
        .for_each(|(o, (xc, gc))| {
            for ((o, v), gi) in o.iter_mut().zip(xc).zip(gc) {
                *o = if *v >= T::zero() { *gi } else { T::zero() };
            }
        });
    dx
}

/// The feed-forward activation of the fused layer.
pub(crate) fn activation_par<T: Real>(
    simd: SimdLevel,
    x: &[T],
    activation: crate::nn::Activation,
) -> Vec<T> {
    match activation {
        crate::nn::Activation::Gelu => pointwise::forward_par::<Gelu, T>(simd, x),
        crate::nn::Activation::Relu => relu_par(x),
        crate::nn::Activation::Geglu => unreachable!("encoder_layer refuses GeGLU"),
    }
}

/// `g act'(x)` for the fused layer's backward.
pub(crate) fn activation_grad_par<T: Real>(
    simd: SimdLevel,
    x: &[T],
    g: &[T],
    activation: crate::nn::Activation,
) -> Vec<T> {
    match activation {
        crate::nn::Activation::Gelu => pointwise::grad_par::<Gelu, T>(simd, x, g),
        crate::nn::Activation::Relu => relu_grad_par(x, g),
        crate::nn::Activation::Geglu => unreachable!("encoder_layer refuses GeGLU"),
    }
}

/// Exact GELU, fused.
pub(crate) fn gelu(x: &Tensor) -> Result<Tensor> {
    pointwise::apply::<Gelu>(x)
}
