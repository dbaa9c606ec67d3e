//! LayerNorm over the last axis, fused, with its backward (input and parameter gradients).

use candle::backend::BackendStorage;
use candle::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
#[cfg(test)]
use rayon::prelude::*;
use std::mem::MaybeUninit;

use super::linear::add_partials;
use super::*;

/// Each of `R` rows' mean, and its centred values into `xc` (perhaps uninitialised before).
#[inline(always)]
fn centre<'a, T: Real, const R: usize>(
    x: &[T],
    d: usize,
    xc: &'a mut [MaybeUninit<T>],
) -> &'a mut [T] {
    let n = T::lit(d as f64);
    let sums = sums::<T, R>(x, d);
    for ((xr, o), s) in x.chunks_exact(d).zip(xc.chunks_exact_mut(d)).zip(sums) {
        let mean = s / n;
        for (o, v) in o.iter_mut().zip(xr) {
            o.write(*v - mean);
        }
    }
    // SAFETY: every value was just written.
    unsafe { assume_written(xc) }
}

/// `1 / sqrt(mean(xc²) + eps)` of each of `R` centred rows.
#[inline(always)]
fn rstds<T: Real, const R: usize>(xc: &[T], d: usize, eps: T) -> [T; R] {
    let n = T::lit(d as f64);
    dots::<T, R>(xc, xc, d).map(|v| (v / n + eps).sqrt().recip())
}

#[inline(always)]
fn ln_forward_block<T: Real, const R: usize>(
    x: &[T],
    w: &[T],
    b: &[T],
    eps: T,
    y: &mut [MaybeUninit<T>],
) {
    let d = w.len();
    let y = centre::<T, R>(x, d, y);
    let rstd = rstds::<T, R>(y, d, eps);
    for (yr, rstd) in y.chunks_exact_mut(d).zip(rstd) {
        for ((o, wi), bi) in yr.iter_mut().zip(w).zip(b) {
            *o = *o * rstd * *wi + *bi;
        }
    }
}

/// Rows of `d` (`w.len()`) in blocks of [`FOLD_ROWS`], then one by one.
#[inline(always)]
fn ln_forward_body<T: Real>(x: &[T], w: &[T], b: &[T], eps: T, y: &mut [MaybeUninit<T>]) {
    let d = w.len();
    let split = whole_blocks(x.len(), d);
    let (yb, yr) = y.split_at_mut(split);
    for (xc, yc) in x[..split]
        .chunks_exact(FOLD_ROWS * d)
        .zip(yb.chunks_exact_mut(FOLD_ROWS * d))
    {
        ln_forward_block::<T, FOLD_ROWS>(xc, w, b, eps, yc);
    }
    for (xc, yc) in x[split..].chunks_exact(d).zip(yr.chunks_exact_mut(d)) {
        ln_forward_block::<T, 1>(xc, w, b, eps, yc);
    }
}
simd_dispatch!(pub(super) fn ln_forward = ln_forward_body(x: &[T], w: &[T], b: &[T], eps: T, y: &mut [MaybeUninit<T>]));

/// Adds `[sum g xhat ; sum g]` over centred rows `xc` (`xhat = xc rstd`), in row order, to
/// `(dw, db)`.
#[inline(always)]
fn add_param_rows<T: Real>(xc: &[T], g: &[T], rstd: &[T], (dw, db): (&mut [T], &mut [T])) {
    let d = dw.len();
    for ((h, gr), rstd) in xc.chunks_exact(d).zip(g.chunks_exact(d)).zip(rstd) {
        for (((w, b), h), gi) in dw.iter_mut().zip(db.iter_mut()).zip(h).zip(gr) {
            *w += *gi * *h * *rstd;
            *b += *gi;
        }
    }
}

/// `dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat))`, `dxhat = g w`, for `R` rows, and
/// with `params` also their `[sum g xhat ; sum g]` added to it ([`add_param_rows`], from the
/// same centred rows); `xhat` and `dxhat` are scratch of `R d`.
#[inline(always)]
fn ln_grad_input_block<T: Real, const R: usize>(
    (x, w, g): (&[T], &[T], &[T]),
    eps: T,
    dx: &mut [MaybeUninit<T>],
    params: Option<(&mut [T], &mut [T])>,
    (xhat, dxhat): (&mut [MaybeUninit<T>], &mut [T]),
) {
    let d = w.len();
    let n = T::lit(d as f64);
    let xhat = centre::<T, R>(x, d, xhat);
    let rstd = rstds::<T, R>(xhat, d, eps);
    if let Some(params) = params {
        add_param_rows(xhat, g, &rstd, params);
    }
    for (h, rstd) in xhat.chunks_exact_mut(d).zip(rstd) {
        for h in h.iter_mut() {
            *h *= rstd;
        }
    }
    for (o, gr) in dxhat.chunks_exact_mut(d).zip(g.chunks_exact(d)) {
        for ((o, gi), wi) in o.iter_mut().zip(gr).zip(w) {
            *o = *gi * *wi;
        }
    }
    let sum_dxhat = sums::<T, R>(dxhat, d);
    let sum_dxhat_xhat = dots::<T, R>(dxhat, xhat, d);
    for (r, out) in dx.chunks_exact_mut(d).enumerate() {
        let (mean_dxhat, mean_dxhat_xhat) = (sum_dxhat[r] / n, sum_dxhat_xhat[r] / n);
        let rows = r * d..(r + 1) * d;
        for ((o, dh), h) in out.iter_mut().zip(&dxhat[rows.clone()]).zip(&xhat[rows]) {
            o.write(rstd[r] * (*dh - mean_dxhat - *h * mean_dxhat_xhat));
        }
    }
}

/// Rows of `d` (`w.len()`) in blocks of [`FOLD_ROWS`], then one by one; with `params` (`2 d`
/// values), the rows' `[sum g xhat ; sum g]` added to it in row order as well.
#[inline(always)]
fn ln_grad_input_body<T: Real>(
    (x, w, g): (&[T], &[T], &[T]),
    eps: T,
    dx: &mut [MaybeUninit<T>],
    mut params: Option<&mut [T]>,
) {
    let d = w.len();
    let mut xhat = vec![MaybeUninit::uninit(); FOLD_ROWS * d];
    let mut dxhat = vec![T::zero(); FOLD_ROWS * d];
    let split = whole_blocks(x.len(), d);
    let (db, dr) = dx.split_at_mut(split);
    let block = FOLD_ROWS * d;
    for (i, o) in db.chunks_exact_mut(block).enumerate() {
        let r = i * block..(i + 1) * block;
        let rows = (&x[r.clone()], w, &g[r]);
        let params = params.as_deref_mut().map(|p| p.split_at_mut(d));
        ln_grad_input_block::<T, FOLD_ROWS>(rows, eps, o, params, (&mut xhat, &mut dxhat));
    }
    for (i, o) in dr.chunks_exact_mut(d).enumerate() {
        let r = split + i * d..split + (i + 1) * d;
        let rows = (&x[r.clone()], w, &g[r]);
        let params = params.as_deref_mut().map(|p| p.split_at_mut(d));
        let scratch = (&mut xhat[..d], &mut dxhat[..d]);
        ln_grad_input_block::<T, 1>(rows, eps, o, params, scratch);
    }
}
simd_dispatch!(pub(super) fn ln_grad_input = ln_grad_input_body(rows: (&[T], &[T], &[T]), eps: T, dx: &mut [MaybeUninit<T>], params: Option<&mut [T]>));

/// Adds `[sum g xhat ; sum g]` over `R` rows, in row order, to `(dw, db)`; `xhat` is scratch of
/// `R d`. (The parameter gradients alone: what the one-pass kernel is tested against.)
#[cfg(test)]
#[inline(always)]
fn ln_grad_params_block<T: Real, const R: usize>(
    (x, g): (&[T], &[T]),
    eps: T,
    params: (&mut [T], &mut [T]),
    xhat: &mut [MaybeUninit<T>],
) {
    let d = params.0.len();
    let xhat = centre::<T, R>(x, d, xhat);
    let rstd = rstds::<T, R>(xhat, d, eps);
    add_param_rows(xhat, g, &rstd, params);
}

/// Partial `[sum g xhat ; sum g]` over the rows of `x`, into `out` (`2 d` values); rows in
/// blocks of [`FOLD_ROWS`], then one by one.
#[cfg(test)]
#[inline(always)]
fn ln_grad_params_body<T: Real>(x: &[T], g: &[T], d: usize, eps: T, out: &mut [T]) {
    let (dw, db) = out.split_at_mut(d);
    let mut xhat = vec![MaybeUninit::uninit(); FOLD_ROWS * d];
    let split = whole_blocks(x.len(), d);
    let block = FOLD_ROWS * d;
    for (xc, gc) in x[..split].chunks_exact(block).zip(g.chunks_exact(block)) {
        ln_grad_params_block::<T, FOLD_ROWS>((xc, gc), eps, (dw, db), &mut xhat);
    }
    for (xc, gc) in x[split..].chunks_exact(d).zip(g[split..].chunks_exact(d)) {
        ln_grad_params_block::<T, 1>((xc, gc), eps, (dw, db), &mut xhat[..d]);
    }
}
#[cfg(test)]
simd_dispatch!(pub(super) fn ln_grad_params = ln_grad_params_body(x: &[T], g: &[T], d: usize, eps: T, out: &mut [T]));

/// LayerNorm over the last axis: `(x, weight, bias) -> y`.
pub(super) struct LayerNormOp {
    pub(super) eps: f64,
    pub(super) simd: SimdLevel,
}

/// The input `(.., d)` against the weight `(d)`: the kernels write whole rows of `d`.
fn check_width(x: &Layout, w: &Layout, what: &str) -> Result<()> {
    let d = w.shape().elem_count();
    if d == 0 || x.dims().last() != Some(&d) {
        candle::bail!("fused {what}: input {:?} for a weight of {d}", x.dims());
    }
    Ok(())
}

impl LayerNormOp {
    pub(super) fn forward<T: Real>(&self, x: &[T], w: &[T], b: &[T]) -> Vec<T> {
        let d = w.len();
        assert!(
            d > 0 && x.len().is_multiple_of(d),
            "layer norm: rows of {d}"
        );
        let rows = rows_per_task(d) * d;
        // SAFETY: ln_forward writes every value of its rows.
        unsafe {
            par_written(x.len(), rows, |r, yc| {
                ln_forward(self.simd, &x[r], w, b, T::lit(self.eps), yc)
            })
        }
    }
}

impl CustomOp3 for LayerNormOp {
    fn name(&self) -> &'static str {
        "poslab-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        check_width(l1, l2, "layer norm")?;
        let storage = by_dtype!(s1.dtype(), "layer norm", |T| self.forward(
            contiguous::<T>(s1, l1, "layer norm")?,
            contiguous(s2, l2, "layer norm")?,
            contiguous(s3, l3, "layer norm")?,
        ));
        Ok((storage, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // dx and [dw; db] from one pass, side by side in one buffer: (b t d + 2 d) values.
        let both = x.apply_op3_no_bwd(
            w,
            &g.contiguous()?,
            &LayerNormGrad {
                eps: self.eps,
                simd: self.simd,
            },
        )?;
        let (nx, d) = (x.elem_count(), w.elem_count());
        let dx = both.narrow(0, 0, nx)?.reshape(x.shape())?;
        let params = both.narrow(0, nx, 2 * d)?.reshape((2, d))?;
        Ok((Some(dx), Some(params.get(0)?), Some(params.get(1)?)))
    }
}

/// LayerNorm's input gradient alone: the reference [`LayerNormGrad`] is tested against.
#[cfg(test)]
pub(super) struct LayerNormGradInput {
    pub(super) eps: f64,
    pub(super) simd: SimdLevel,
}

#[cfg(test)]
impl LayerNormGradInput {
    pub(super) fn run<T: Real>(&self, x: &[T], w: &[T], g: &[T]) -> Vec<T> {
        let d = w.len();
        assert!(
            d > 0 && x.len().is_multiple_of(d) && g.len() == x.len(),
            "layer norm: rows of {d}"
        );
        let rows = rows_per_task(d) * d;
        // SAFETY: ln_grad_input writes every value of its rows.
        unsafe {
            par_written(x.len(), rows, |r, o| {
                ln_grad_input(
                    self.simd,
                    (&x[r.clone()], w, &g[r]),
                    T::lit(self.eps),
                    o,
                    None,
                )
            })
        }
    }
}

/// LayerNorm's input and parameter gradients in one pass over `(x, g)`: `dx` with the bits of
/// `LayerNormGradInput`, `[dw; db]` with those of `LayerNormGradParams` (the tests' separate
/// references: the same chunks of rows, summed in the same order), each row centred and scaled
/// once for both.
pub(super) struct LayerNormGrad {
    pub(super) eps: f64,
    pub(super) simd: SimdLevel,
}

impl LayerNormGrad {
    /// `(dx, [dw; db])`.
    pub(super) fn run<T: Real>(&self, x: &[T], w: &[T], g: &[T]) -> (Vec<T>, Vec<T>) {
        let (d, len) = (w.len(), x.len());
        assert!(
            d > 0 && len % d == 0 && g.len() == len,
            "layer norm: rows of {d}"
        );
        // SAFETY: ln_grad_input writes every value of its chunk.
        let (dx, partials) = unsafe {
            par_written_parts(len, PARAM_CHUNK_ROWS * d, 2 * d, |r, o, params| {
                let rows = (&x[r.clone()], w, &g[r]);
                ln_grad_input(self.simd, rows, T::lit(self.eps), o, Some(params));
            })
        };
        let mut total = vec![T::zero(); 2 * d];
        add_partials(&partials, &mut total);
        (dx, total)
    }
}

/// LayerNorm's parameter gradients alone: the reference [`LayerNormGrad`] is tested against.
#[cfg(test)]
pub(super) struct LayerNormGradParams {
    pub(super) eps: f64,
    pub(super) simd: SimdLevel,
}

/// Rows per chunk of the parameter-gradient sums: fixed, so the order of additions (and the
/// result) does not depend on the thread count.
const PARAM_CHUNK_ROWS: usize = 64;

#[cfg(test)]
impl LayerNormGradParams {
    pub(super) fn run<T: Real>(&self, x: &[T], g: &[T], d: usize) -> Vec<T> {
        let chunk = PARAM_CHUNK_ROWS * d;
        let mut partials = vec![T::zero(); x.len().div_ceil(chunk) * 2 * d];
        x.par_chunks(chunk)
            .zip(g.par_chunks(chunk))
            .zip(partials.par_chunks_mut(2 * d))
            .for_each(|((xc, gc), out)| {
                ln_grad_params(self.simd, xc, gc, d, T::lit(self.eps), out)
            });
        let mut total = vec![T::zero(); 2 * d];
        add_partials(&partials, &mut total);
        total
    }
}

impl CustomOp3 for LayerNormGrad {
    fn name(&self) -> &'static str {
        "poslab-layer-norm-grad"
    }

    /// `(x, w, g) -> [dx; dw; db]`, flat.
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let what = "layer norm backward";
        check_width(l1, l2, what)?;
        if l3.dims() != l1.dims() {
            candle::bail!(
                "fused {what}: gradient {:?} for input {:?}",
                l3.dims(),
                l1.dims()
            );
        }
        let len = l1.shape().elem_count() + 2 * l2.shape().elem_count();
        let storage = by_dtype!(s1.dtype(), what, |T| {
            let (mut dx, params) = self.run(
                contiguous::<T>(s1, l1, what)?,
                contiguous(s2, l2, what)?,
                contiguous(s3, l3, what)?,
            );
            dx.extend_from_slice(&params);
            dx
        });
        Ok((storage, Shape::from(len)))
    }
}

/// LayerNorm of `x` over its last axis, fused (CPU, f32/f64, contiguous `x`).
pub fn layer_norm(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
    simd: SimdLevel,
) -> Result<Tensor> {
    x.contiguous()?
        .apply_op3(weight, bias, LayerNormOp { eps, simd })
}
