//! Exact (erf) GELU and ReLU, fused, with their backward passes.

use candle::backend::BackendStorage;
use candle::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use std::mem::MaybeUninit;

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

const ELEMENTS_PER_TASK: usize = 16_384;

/// `GELU(x)`, in parallel chunks.
fn gelu_par<T: Real>(simd: SimdLevel, x: &[T]) -> Vec<T> {
    // SAFETY: gelu_rows writes every value of its output, as long as its input chunk.
    unsafe { par_written(x.len(), ELEMENTS_PER_TASK, |r, o| gelu_rows(simd, &x[r], o)) }
}

/// `g GELU'(x)`, in parallel chunks.
fn gelu_grad_par<T: Real>(simd: SimdLevel, x: &[T], g: &[T]) -> Vec<T> {
    // SAFETY: gelu_grad_rows writes every value of its output, as long as its input chunks.
    unsafe {
        par_written(x.len(), ELEMENTS_PER_TASK, |r, o| {
            gelu_grad_rows(simd, &x[r.clone()], &g[r], o)
        })
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
        crate::nn::Activation::Gelu => gelu_par(simd, x),
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
        crate::nn::Activation::Gelu => gelu_grad_par(simd, x, g),
        crate::nn::Activation::Relu => relu_grad_par(x, g),
        crate::nn::Activation::Geglu => unreachable!("encoder_layer refuses GeGLU"),
    }
}

struct Gelu {
    simd: SimdLevel,
}

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "poslab-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let storage = by_dtype!(s.dtype(), "gelu", |T| gelu_par(
            self.simd,
            contiguous::<T>(s, l, "gelu")?
        ));
        Ok((storage, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(x.apply_op2_no_bwd(
            &g.contiguous()?,
            &GeluGrad { simd: self.simd },
        )?))
    }
}

struct GeluGrad {
    simd: SimdLevel,
}

impl CustomOp2 for GeluGrad {
    fn name(&self) -> &'static str {
        "poslab-gelu-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let what = "gelu backward";
        let storage = by_dtype!(s1.dtype(), what, |T| gelu_grad_par(
            self.simd,
            contiguous::<T>(s1, l1, what)?,
            contiguous(s2, l2, what)?,
        ));
        Ok((storage, l1.shape().clone()))
    }
}

/// Exact GELU, fused.
pub(crate) fn gelu(x: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Gelu { simd: simd_level() })
}
