//! `log σ(z)`, fused, with its backward: FoX's forget gates and any other log-space gate.
//!
//! ```text
//! y  = log σ(z) = -(max(-z, 0) + ln(1 + e^(-|z|)))      exact for any z, never above 0
//! dz = dy σ(-z) = dy · u / (1 + u) for z >= 0, dy / (1 + u) below,   u = e^(-|z|)
//! ```
//!
//! The composition of candle ops (`nn::log_sigmoid` off the fused path) takes eight passes and
//! eight temporaries forward, a dozen more backward; this is one pass each way.

use candle::backend::BackendStorage;
use candle::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use std::mem::MaybeUninit;

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

const ELEMENTS_PER_TASK: usize = 16_384;

struct LogSigmoid {
    simd: SimdLevel,
}

impl CustomOp1 for LogSigmoid {
    fn name(&self) -> &'static str {
        "poslab-log-sigmoid"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let what = "log sigmoid";
        let storage = by_dtype!(s.dtype(), what, |T| {
            let z = contiguous::<T>(s, l, what)?;
            // SAFETY: log_sigmoid_rows writes every value of its output chunk.
            unsafe {
                par_written(z.len(), ELEMENTS_PER_TASK, |r, o| {
                    log_sigmoid_rows(self.simd, &z[r], o)
                })
            }
        });
        Ok((storage, l.shape().clone()))
    }

    fn bwd(&self, z: &Tensor, _y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(z.apply_op2_no_bwd(
            &g.contiguous()?,
            &LogSigmoidGrad { simd: self.simd },
        )?))
    }
}

struct LogSigmoidGrad {
    simd: SimdLevel,
}

impl CustomOp2 for LogSigmoidGrad {
    fn name(&self) -> &'static str {
        "poslab-log-sigmoid-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let what = "log sigmoid backward";
        let storage = by_dtype!(s1.dtype(), what, |T| {
            let (z, g) = (
                contiguous::<T>(s1, l1, what)?,
                contiguous::<T>(s2, l2, what)?,
            );
            // SAFETY: log_sigmoid_grad_rows writes every value of its output chunk.
            unsafe {
                par_written(z.len(), ELEMENTS_PER_TASK, |r, o| {
                    log_sigmoid_grad_rows(self.simd, &z[r.clone()], &g[r], o)
                })
            }
        });
        Ok((storage, l1.shape().clone()))
    }
}

/// `log σ(z)`, fused.
pub(crate) fn log_sigmoid(z: &Tensor) -> Result<Tensor> {
    z.contiguous()?.apply_op1(LogSigmoid { simd: simd_level() })
}
