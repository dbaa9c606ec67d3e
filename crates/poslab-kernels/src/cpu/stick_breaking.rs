//! Stick-breaking attention's weights, fused, with their backward: each query's keys break a
//! stick of length 1 in an order of their own (the scheme is `positional/stick_breaking.rs`).
//!
//! For a row (query `i`) with logits `z`, `b_j` 1 for the keys that break (0 for the others),
//! in the row's order (`i`, then `i-1, ..., 0`, then `i+1, ..., t-1` for an even head; `i`,
//! then `i+1, ..., t-1`, then `i-1, ..., 0` for an odd one):
//!
//! ```text
//! L_j = b_j ln σ(-z_j)                 P_j = Σ_{k before j} L_k
//! A_j = b_j exp(ln σ(z_j) + P_j)
//! dz_j = b_j (dA_j A_j σ(-z_j) - σ(z_j) G_j)        G_j = Σ_{m after j} dA_m A_m
//! ```
//!
//! One pass a row each way: the logs and exponentials over the row (vectorised), and the sums
//! `P` and `G` as one walk in the row's order, where the composition takes each sum over a side
//! of the keys as a product with a `(t, t)` triangle, `O(t³)` a head. The backward recomputes
//! the row's weights rather than keeping them. The same rows serve the fused attention
//! ([`Head`]: one head of `attention.rs`, in place of its softmax), and a weight below `e^-60`
//! is exactly 0 ([`LOG_FLUSH`]).

use candle::backend::BackendStorage;
use candle::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use std::mem::MaybeUninit;

use crate::spec::Window;

use super::*;

/// Walks the row's keys in their order (the query's own, then one side nearest first, then
/// the other), `left_first` for an even head; `visit(j)` for each.
#[inline(always)]
fn in_order(i: usize, t: usize, left_first: bool, mut visit: impl FnMut(usize)) {
    visit(i);
    if left_first {
        (0..i).rev().for_each(&mut visit);
        (i + 1..t).for_each(&mut visit);
    } else {
        (i + 1..t).for_each(&mut visit);
        (0..i).rev().for_each(&mut visit);
    }
}

/// As [`in_order`], the other way round: the last key to break first.
#[inline(always)]
fn in_reverse_order(i: usize, t: usize, left_first: bool, mut visit: impl FnMut(usize)) {
    if left_first {
        (i + 1..t).rev().for_each(&mut visit);
        (0..i).for_each(&mut visit);
    } else {
        (0..i).for_each(&mut visit);
        (i + 1..t).rev().for_each(&mut visit);
    }
    visit(i);
}

/// A row's `ln σ(z_j)` in `taken` and `L_j` in `kept` (0 where the key does not break).
#[inline(always)]
fn logs<T: Real>(z: &[T], b: &[T], taken: &mut [T], kept: &mut [T]) {
    for (((&v, &bj), lt), lk) in z.iter().zip(b).zip(taken.iter_mut()).zip(kept.iter_mut()) {
        let u = (-v.abs()).exp_();
        let relu = if v < T::zero() { -v } else { T::zero() };
        let log_sigmoid = -(relu + u.ln_1p_());
        *lt = log_sigmoid;
        // ln σ(-z) = ln σ(z) - z.
        *lk = if bj != T::zero() {
            log_sigmoid - v
        } else {
            T::zero()
        };
    }
}

/// The log below which a weight is exactly 0 (`e^-60`, about 1e-26): the weights fall off
/// geometrically along the stick, and values near the smallest normal number would make the
/// products after them (`A v`, and in the backward `dA ⊙ A` and the scores' gradient through
/// `q` and `k`) meet subnormal numbers, which the CPU computes many times slower.
const LOG_FLUSH: f64 = -60.0;

/// A row's weights `A` into `a` (every value written), with `taken` and `kept` its [`logs`]
/// (`kept` is left holding each key's `P_j`); those below `e^-60` are 0.
#[inline(always)]
fn row_weights<T: Real>(
    i: usize,
    left_first: bool,
    b: &[T],
    taken: &[T],
    kept: &mut [T],
    a: &mut [MaybeUninit<T>],
) {
    let t = b.len();
    let mut sum = T::zero();
    in_order(i, t, left_first, |j| {
        let l = kept[j];
        kept[j] = sum;
        sum += l;
    });
    let flush = T::lit(LOG_FLUSH);
    for (((o, &bj), &lt), &p) in a.iter_mut().zip(b).zip(taken).zip(kept.iter()) {
        let log = lt + p;
        o.write(if bj != T::zero() && log > flush {
            log.exp_()
        } else {
            T::zero()
        });
    }
}

/// Where a chunk of rows lies in the `(b, h, t, t)` values: its first row, the heads, the keys
/// of a row. A head of the fused attention alone is its `t` rows: `first` is `t` for an odd
/// head, 0 for an even one, of 2.
#[derive(Clone, Copy)]
struct Rows {
    first: usize,
    heads: usize,
    t: usize,
}

impl Rows {
    /// Row `r` of the chunk's query, and whether its head breaks the left side first (an even
    /// head).
    fn row(self, r: usize) -> (usize, bool) {
        let row = self.first + r;
        (
            row % self.t,
            ((row / self.t) % self.heads).is_multiple_of(2),
        )
    }
}

/// Where a row's breaking keys come from: `breaks(r, b)` writes row `r` of a chunk's into `b`
/// (1 or 0): read from a tensor of them, or made from a head's key bias and window.
type Breaks<'a, T> = &'a (dyn Fn(usize, &mut [T]) + Sync);

/// The weights of a chunk of rows (every value written).
#[inline(always)]
fn weights_body<T: Real>(z: &[T], rows: Rows, breaks: Breaks<'_, T>, out: &mut [MaybeUninit<T>]) {
    let t = rows.t;
    let (mut b, mut taken, mut kept) = (vec![T::zero(); t], vec![T::zero(); t], vec![T::zero(); t]);
    for (r, (zr, ar)) in z.chunks_exact(t).zip(out.chunks_exact_mut(t)).enumerate() {
        let (i, left_first) = rows.row(r);
        breaks(r, &mut b);
        logs(zr, &b, &mut taken, &mut kept);
        row_weights(i, left_first, &b, &taken, &mut kept, ar);
    }
}
simd_dispatch!(fn weights_rows = weights_body(z: &[T], rows: Rows, breaks: Breaks<'_, T>, out: &mut [MaybeUninit<T>]));

/// A row's work space for its gradient: its logs and weights.
struct RowWork<T> {
    taken: Vec<T>,
    kept: Vec<T>,
    a: Vec<T>,
}

impl<T: Real> RowWork<T> {
    fn new(t: usize) -> Self {
        Self {
            taken: vec![T::zero(); t],
            kept: vec![T::zero(); t],
            a: vec![T::zero(); t],
        }
    }

    /// Row `i`'s logits' gradient `dr` from its logits `zr`, breaking keys `br` and the
    /// weights' gradient `gr` (whose values where a key does not break are never read).
    #[inline(always)]
    fn grad(&mut self, i: usize, left_first: bool, zr: &[T], br: &[T], gr: &[T], dr: &mut [T]) {
        let t = zr.len();
        let (taken, kept, a) = (&mut self.taken, &mut self.kept, &mut self.a);
        logs(zr, br, taken, kept);
        // SAFETY: row_weights writes values only.
        row_weights(i, left_first, br, taken, kept, unsafe { uninit(a) });
        // c_j = dA_j A_j in place of the weights, dz_j's first term dA_j A_j σ(-z_j), and σ(z_j)
        // in place of its log, all 0 where the key does not break (one exponential each).
        for ((((c, o), lt), &gj), (&zj, &bj)) in a
            .iter_mut()
            .zip(dr.iter_mut())
            .zip(taken.iter_mut())
            .zip(gr)
            .zip(zr.iter().zip(br))
        {
            let u = (-zj.abs()).exp_();
            let inv = (T::one() + u).recip();
            let (up, down) = if zj >= T::zero() {
                (inv, u * inv)
            } else {
                (u * inv, inv)
            };
            let breaks = bj != T::zero();
            *c = if breaks { *c * gj } else { T::zero() };
            *o = *c * down;
            *lt = if breaks { up } else { T::zero() };
        }
        // Its second, -σ(z_j) G_j, with G_j summed over the keys after j in the row's order.
        let sigmoid = &*taken;
        let mut after = T::zero();
        in_reverse_order(i, t, left_first, |j| {
            dr[j] -= sigmoid[j] * after;
            after += a[j];
        });
    }
}

/// The logits' gradient of a chunk of rows from the weights' `g`.
#[inline(always)]
fn grad_body<T: Real>(z: &[T], g: &[T], rows: Rows, breaks: Breaks<'_, T>, dz: &mut [T]) {
    let t = rows.t;
    let mut b = vec![T::zero(); t];
    let mut work = RowWork::new(t);
    let each = z.chunks_exact(t).zip(g.chunks_exact(t));
    for (r, ((zr, gr), dr)) in each.zip(dz.chunks_exact_mut(t)).enumerate() {
        let (i, left_first) = rows.row(r);
        breaks(r, &mut b);
        work.grad(i, left_first, zr, &b, gr, dr);
    }
}
simd_dispatch!(fn grad_rows = grad_body(z: &[T], g: &[T], rows: Rows, breaks: Breaks<'_, T>, dz: &mut [T]));

/// One head of the fused attention (`attention.rs`), whose weights are stick-breaking's in
/// place of the softmax: the keys that break are the real ones (`key_bias` 0) in the query's
/// `window`, less the query's own unless `own_first`.
pub(super) struct Head<'a, T> {
    /// The head's index: even heads break the left side first.
    pub parity: usize,
    /// Whether the query's own key breaks first.
    pub own_first: bool,
    /// The keys each query may see besides padding.
    pub window: Window,
    /// The batch element's key bias `(t)`: 0 for real keys.
    pub key_bias: &'a [T],
}

impl<T: Real> Head<'_, T> {
    /// Row `i`'s breaking keys into `b`: 1 or 0.
    fn breaks(&self, i: usize, b: &mut [T]) {
        let t = b.len();
        let seen = self.window.keys(i, t);
        for (j, (o, &kb)) in b.iter_mut().zip(self.key_bias).enumerate() {
            let breaks = kb == T::zero() && seen.contains(&j) && (self.own_first || j != i);
            *o = if breaks { T::one() } else { T::zero() };
        }
    }

    /// The head's rows (see [`Rows`]).
    fn rows(&self) -> Rows {
        let t = self.key_bias.len();
        Rows {
            first: (self.parity % 2) * t,
            heads: 2,
            t,
        }
    }

    /// The head's weights `(t, t)` from its scores `z` into `out` (written in full).
    pub fn weights(&self, simd: SimdLevel, z: &[T], out: &mut [MaybeUninit<T>]) {
        weights_rows(simd, z, self.rows(), &|i, b| self.breaks(i, b), out);
    }

    /// The head's scores' gradient `dz` `(t, t)` from its scores `z` and the weights' `g`.
    pub fn grad(&self, simd: SimdLevel, z: &[T], g: &[T], dz: &mut [T]) {
        grad_rows(simd, z, g, self.rows(), &|i, b| self.breaks(i, b), dz);
    }
}

/// The breaking keys of a chunk's rows of `t`, read from `b` (their `(rows, t)` values).
fn given<T: Real>(b: &[T], t: usize) -> impl Fn(usize, &mut [T]) + Sync + '_ {
    move |r, row| row.copy_from_slice(&b[r * t..(r + 1) * t])
}

/// `body` over the rows of `(b, h, t, t)` values `inputs` (each that long), in parallel tasks
/// of whole rows, each writing its chunk of the output.
fn by_rows<T: Real>(
    inputs: &[&[T]],
    dims: &[usize],
    body: impl Fn(&[&[T]], Rows, &mut [T]) + Sync,
) -> Vec<T> {
    let (heads, t) = (dims[1], dims[3]);
    let mut out = zeros(inputs[0].len());
    if t == 0 {
        return out;
    }
    let chunk = rows_per_task(t).max(1) * t;
    out.par_chunks_mut(chunk).enumerate().for_each(|(n, o)| {
        let range = n * chunk..n * chunk + o.len();
        let parts: Vec<&[T]> = inputs.iter().map(|x| &x[range.clone()]).collect();
        let first = n * chunk / t;
        body(&parts, Rows { first, heads, t }, o)
    });
    out
}

/// [`by_rows`] over contiguous CPU storages of one dtype, f32 (`run`) or f64 (`run64`).
fn on_storages(
    what: &str,
    inputs: &[(&CpuStorage, &Layout)],
    run: impl Fn(&[&[f32]], Rows, &mut [f32]) + Sync,
    run64: impl Fn(&[&[f64]], Rows, &mut [f64]) + Sync,
) -> Result<(CpuStorage, Shape)> {
    let (s1, l1) = inputs[0];
    let dims = l1.dims();
    let storage = match s1.dtype() {
        candle::DType::F32 => {
            let xs = inputs
                .iter()
                .map(|(s, l)| contiguous::<f32>(s, l, what))
                .collect::<Result<Vec<_>>>()?;
            CpuStorage::F32(by_rows(&xs, dims, run))
        }
        candle::DType::F64 => {
            let xs = inputs
                .iter()
                .map(|(s, l)| contiguous::<f64>(s, l, what))
                .collect::<Result<Vec<_>>>()?;
            CpuStorage::F64(by_rows(&xs, dims, run64))
        }
        dtype => return Err(unsupported(what, dtype)),
    };
    Ok((storage, l1.shape().clone()))
}

/// The weights of `(b, h, t, t)` logits and their breaking keys.
struct Weights {
    simd: SimdLevel,
}

impl CustomOp2 for Weights {
    fn name(&self) -> &'static str {
        "poslab-stick-breaking"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let simd = self.simd;
        on_storages(
            "stick-breaking weights",
            &[(s1, l1), (s2, l2)],
            // SAFETY (both): weights_rows writes values only.
            |x, rows, o| weights_rows(simd, x[0], rows, &given(x[1], rows.t), unsafe { uninit(o) }),
            |x, rows, o| weights_rows(simd, x[0], rows, &given(x[1], rows.t), unsafe { uninit(o) }),
        )
    }

    fn bwd(
        &self,
        z: &Tensor,
        breaks: &Tensor,
        _a: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dz = z.apply_op3_no_bwd(breaks, &g.contiguous()?, &Grad { simd: self.simd })?;
        Ok((Some(dz), None))
    }
}

/// The logits' gradient from the weights'.
struct Grad {
    simd: SimdLevel,
}

impl CustomOp3 for Grad {
    fn name(&self) -> &'static str {
        "poslab-stick-breaking-grad"
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
        let simd = self.simd;
        on_storages(
            "stick-breaking backward",
            &[(s1, l1), (s2, l2), (s3, l3)],
            |x, rows, o| grad_rows(simd, x[0], x[2], rows, &given(x[1], rows.t), o),
            |x, rows, o| grad_rows(simd, x[0], x[2], rows, &given(x[1], rows.t), o),
        )
    }
}

/// Stick-breaking weights of logits `z` `(b, h, t, t)`, over the keys `breaks` (1 or 0, the
/// same shape) lets break, even heads left first and odd heads right first; the query's own
/// key breaks first where `breaks` holds it. Differentiable in `z`.
pub fn stick_breaking(z: &Tensor, breaks: &Tensor, simd: SimdLevel) -> Result<Tensor> {
    let (_, _, t, keys) = z.dims4()?;
    if keys != t || breaks.dims() != z.dims() {
        candle::bail!(
            "fused stick-breaking: logits {:?} must be (b, h, t, t), and the breaking keys {:?} \
             the same shape",
            z.dims(),
            breaks.dims()
        );
    }
    z.contiguous()?
        .apply_op2(&breaks.contiguous()?, Weights { simd })
}
