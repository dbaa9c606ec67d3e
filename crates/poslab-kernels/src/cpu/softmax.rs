//! Softmax over the last axis with an additive key-padding bias, fused, with its backward.

use candle::backend::BackendStorage;
use candle::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use std::mem::MaybeUninit;

use super::*;

/// `y = softmax(x + bias)` for `R` rows of length `t` (`bias.len()`); `y` may come
/// uninitialised (every value is written before it is read).
#[inline(always)]
fn softmax_block<T: Real, const R: usize>(x: &[T], bias: &[T], y: &mut [MaybeUninit<T>]) {
    let t = bias.len();
    for (xr, yr) in x.chunks_exact(t).zip(y.chunks_exact_mut(t)) {
        for ((o, v), b) in yr.iter_mut().zip(xr).zip(bias) {
            o.write(*v + *b);
        }
    }
    // SAFETY: every value of the rows was just written.
    let y = unsafe { assume_written(y) };
    let max = maxes::<T, R>(y, t);
    for (yr, max) in y.chunks_exact_mut(t).zip(max) {
        for o in yr.iter_mut() {
            *o = (*o - max).exp_();
        }
    }
    let sums = sums::<T, R>(y, t);
    for (yr, s) in y.chunks_exact_mut(t).zip(sums) {
        let inv = s.recip();
        for o in yr.iter_mut() {
            *o *= inv;
        }
    }
}

/// `y = softmax(x + bias)` per row of length `t` (`bias.len()`), rows in blocks of
/// [`FOLD_ROWS`] (each row's bits as alone); `y` may come uninitialised.
#[inline(always)]
fn softmax_body<T: Real>(x: &[T], bias: &[T], y: &mut [MaybeUninit<T>]) {
    let t = bias.len();
    if t == 0 {
        return;
    }
    let split = whole_blocks(x.len(), t);
    let (xb, xr) = x.split_at(split);
    let (yb, yr) = y.split_at_mut(split);
    for (xc, yc) in xb
        .chunks_exact(FOLD_ROWS * t)
        .zip(yb.chunks_exact_mut(FOLD_ROWS * t))
    {
        softmax_block::<T, FOLD_ROWS>(xc, bias, yc);
    }
    for (xc, yc) in xr.chunks_exact(t).zip(yr.chunks_exact_mut(t)) {
        softmax_block::<T, 1>(xc, bias, yc);
    }
}
simd_dispatch!(pub(super) fn softmax_rows = softmax_body(x: &[T], bias: &[T], y: &mut [MaybeUninit<T>]));

/// [`softmax_rows`] of `(t, t)` blocks of scores under a causal mask: row `i` of a block over
/// its first `i + 1` keys, exactly 0 after them (the keys the mask hides, whose scores are never
/// read), so the masked half of the exponentials is skipped.
#[inline(always)]
fn causal_softmax_body<T: Real>(x: &[T], bias: &[T], y: &mut [MaybeUninit<T>]) {
    let t = bias.len();
    if t == 0 {
        return;
    }
    for (i, (xr, yr)) in x.chunks_exact(t).zip(y.chunks_exact_mut(t)).enumerate() {
        let seen = i % t + 1;
        let (kept, hidden) = yr.split_at_mut(seen);
        softmax_block::<T, 1>(&xr[..seen], &bias[..seen], kept);
        for o in hidden {
            o.write(T::zero());
        }
    }
}
simd_dispatch!(pub(super) fn causal_softmax_rows = causal_softmax_body(x: &[T], bias: &[T], y: &mut [MaybeUninit<T>]));

/// `dx = y (g - sum(g y))` for `R` rows of `t`.
#[inline(always)]
fn softmax_grad_block<T: Real, const R: usize>(y: &[T], g: &[T], t: usize, dx: &mut [T]) {
    let s = dots::<T, R>(y, g, t);
    for (((o, yr), gr), s) in dx
        .chunks_exact_mut(t)
        .zip(y.chunks_exact(t))
        .zip(g.chunks_exact(t))
        .zip(s)
    {
        for ((o, yi), gi) in o.iter_mut().zip(yr).zip(gr) {
            *o = *yi * (*gi - s);
        }
    }
}

/// `dx = y (g - sum(g y))` per row, rows in blocks of [`FOLD_ROWS`].
#[inline(always)]
fn softmax_grad_body<T: Real>(y: &[T], g: &[T], t: usize, dx: &mut [T]) {
    if t == 0 {
        return;
    }
    let split = whole_blocks(y.len(), t);
    let (dxb, dxr) = dx.split_at_mut(split);
    let block = FOLD_ROWS * t;
    for ((o, yc), gc) in dxb
        .chunks_exact_mut(block)
        .zip(y.chunks_exact(block))
        .zip(g.chunks_exact(block))
    {
        softmax_grad_block::<T, FOLD_ROWS>(yc, gc, t, o);
    }
    for ((o, yc), gc) in dxr
        .chunks_exact_mut(t)
        .zip(y[split..].chunks_exact(t))
        .zip(g[split..].chunks_exact(t))
    {
        softmax_grad_block::<T, 1>(yc, gc, t, o);
    }
}
simd_dispatch!(pub(super) fn softmax_grad_rows = softmax_grad_body(y: &[T], g: &[T], t: usize, dx: &mut [T]));

/// [`softmax_grad_rows`] of the weights of [`causal_softmax_rows`]: row `i` of a `(t, t)` block
/// over its first `i + 1` keys, 0 after them (where the weights are 0).
#[inline(always)]
fn causal_softmax_grad_body<T: Real>(y: &[T], g: &[T], t: usize, dx: &mut [T]) {
    if t == 0 {
        return;
    }
    for (i, ((o, yr), gr)) in dx
        .chunks_exact_mut(t)
        .zip(y.chunks_exact(t))
        .zip(g.chunks_exact(t))
        .enumerate()
    {
        let seen = i % t + 1;
        let (kept, hidden) = o.split_at_mut(seen);
        softmax_grad_block::<T, 1>(&yr[..seen], &gr[..seen], seen, kept);
        hidden.fill(T::zero());
    }
}
simd_dispatch!(pub(super) fn causal_softmax_grad_rows = causal_softmax_grad_body(y: &[T], g: &[T], t: usize, dx: &mut [T]));

/// `softmax(scores + bias)` over the last axis, `scores` `(b, h, t, t)`, `bias` `(b, t)` added
/// to every row of batch element `b`.
struct MaskedSoftmax {
    simd: SimdLevel,
}

impl MaskedSoftmax {
    fn forward<T: Real>(&self, x: &[T], bias: &[T], dims: &[usize]) -> Vec<T> {
        let t = dims[dims.len() - 1];
        let per_batch = x.len() / dims[0].max(1);
        // Rows per task: as many as suit the work size and divide a batch element's rows, so
        // no task straddles two batch elements (whose biases differ).
        let rows_per_batch = per_batch / t;
        let mut k = rows_per_task(t).min(rows_per_batch).max(1);
        while !rows_per_batch.is_multiple_of(k) {
            k -= 1;
        }
        let chunk = k * t;
        // SAFETY: softmax_rows writes every value of its chunk.
        unsafe {
            par_written(x.len(), chunk, |r, yc| {
                let batch = r.start / per_batch;
                softmax_rows(self.simd, &x[r], &bias[batch * t..(batch + 1) * t], yc)
            })
        }
    }
}

impl CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "poslab-masked-softmax"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let what = "softmax";
        let dims = l1.dims();
        let storage = by_dtype!(s1.dtype(), what, |T| self.forward(
            contiguous::<T>(s1, l1, what)?,
            contiguous(s2, l2, what)?,
            dims,
        ));
        Ok((storage, l1.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _bias: &Tensor,
        y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((
            Some(y.apply_op2_no_bwd(&g.contiguous()?, &SoftmaxGrad { simd: self.simd })?),
            None,
        ))
    }
}

struct SoftmaxGrad {
    simd: SimdLevel,
}

impl SoftmaxGrad {
    fn run<T: Real>(&self, y: &[T], g: &[T], t: usize) -> Vec<T> {
        let mut dx = zeros(y.len());
        let rows = rows_per_task(t) * t;
        dx.par_chunks_mut(rows)
            .zip(y.par_chunks(rows).zip(g.par_chunks(rows)))
            .for_each(|(o, (yc, gc))| softmax_grad_rows(self.simd, yc, gc, t, o));
        dx
    }
}

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "poslab-softmax-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let what = "softmax backward";
        let t = *l1.dims().last().unwrap_or(&1);
        let storage = by_dtype!(s1.dtype(), what, |T| self.run(
            contiguous::<T>(s1, l1, what)?,
            contiguous(s2, l2, what)?,
            t,
        ));
        Ok((storage, l1.shape().clone()))
    }
}

/// `softmax(scores + bias)` with `scores` `(b, h, t, t)` and a key bias `(b, t)`, fused.
pub fn masked_softmax(scores: &Tensor, key_bias: &Tensor, simd: SimdLevel) -> Result<Tensor> {
    scores
        .contiguous()?
        .apply_op2(&key_bias.contiguous()?, MaskedSoftmax { simd })
}
