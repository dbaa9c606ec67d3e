//! An elementwise function and its derivative as a fused op: one pass forward, one backward,
//! in parallel chunks. GELU and `log σ` are written this way.

use candle::backend::BackendStorage;
use candle::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use std::mem::MaybeUninit;

use super::*;

/// Values per parallel task (the fused layer's ReLU uses it too).
pub(super) const ELEMENTS_PER_TASK: usize = 16_384;

/// `y = f(x)` and `dx = g f'(x)`, elementwise, each writing every value of its output.
pub(super) trait Pointwise: Copy + Send + Sync + 'static {
    /// The op's name (its backward's is this with ` backward`).
    const NAME: &'static str;
    /// `y = f(x)`.
    fn rows<T: Real>(simd: SimdLevel, x: &[T], y: &mut [MaybeUninit<T>]);
    /// `dx = g f'(x)`.
    fn grad_rows<T: Real>(simd: SimdLevel, x: &[T], g: &[T], dx: &mut [MaybeUninit<T>]);
}

/// `f(x)` in parallel chunks.
pub(super) fn forward_par<P: Pointwise, T: Real>(simd: SimdLevel, x: &[T]) -> Vec<T> {
    // SAFETY: `rows` writes every value of its output, as long as its input chunk.
    unsafe { par_written(x.len(), ELEMENTS_PER_TASK, |r, o| P::rows(simd, &x[r], o)) }
}

/// `g f'(x)` in parallel chunks.
pub(super) fn grad_par<P: Pointwise, T: Real>(simd: SimdLevel, x: &[T], g: &[T]) -> Vec<T> {
    // SAFETY: `grad_rows` writes every value of its output, as long as its input chunks.
    unsafe {
        par_written(x.len(), ELEMENTS_PER_TASK, |r, o| {
            P::grad_rows(simd, &x[r.clone()], &g[r], o)
        })
    }
}

/// `f` as a candle op, its backward [`PointwiseGrad`].
struct PointwiseOp<P> {
    simd: SimdLevel,
    _f: std::marker::PhantomData<P>,
}

impl<P: Pointwise> CustomOp1 for PointwiseOp<P> {
    fn name(&self) -> &'static str {
        P::NAME
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let storage = by_dtype!(s.dtype(), P::NAME, |T| forward_par::<P, T>(
            self.simd,
            contiguous::<T>(s, l, P::NAME)?
        ));
        Ok((storage, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let grad = PointwiseGrad::<P> {
            simd: self.simd,
            _f: std::marker::PhantomData,
        };
        Ok(Some(x.apply_op2_no_bwd(&g.contiguous()?, &grad)?))
    }
}

/// `g f'(x)` from `(x, g)`.
struct PointwiseGrad<P> {
    simd: SimdLevel,
    _f: std::marker::PhantomData<P>,
}

impl<P: Pointwise> CustomOp2 for PointwiseGrad<P> {
    fn name(&self) -> &'static str {
        P::NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let what = P::NAME;
        let storage = by_dtype!(s1.dtype(), what, |T| grad_par::<P, T>(
            self.simd,
            contiguous::<T>(s1, l1, what)?,
            contiguous(s2, l2, what)?,
        ));
        Ok((storage, l1.shape().clone()))
    }
}

/// `f(x)`, fused, differentiable.
pub(super) fn apply<P: Pointwise>(x: &Tensor, simd: SimdLevel) -> Result<Tensor> {
    x.contiguous()?.apply_op1(PointwiseOp::<P> {
        simd,
        _f: std::marker::PhantomData,
    })
}
