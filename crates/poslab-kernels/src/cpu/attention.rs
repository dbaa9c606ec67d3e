//! The core of multi-head self-attention as one node: from the packed projections
//! `qkv = [q | k | v]` `(b, t, 3 d)` to the heads' outputs side by side `(b, t, d)`, with a
//! rotation of q and k (RoPE's tables), an additive score bias (ALiBi, T5, KERPLE, TUPE's
//! position term: whatever the caller built; or FoX's, built here from running sums), the
//! key-padding bias, the softmax and (in training) an attention-dropout mask, and a backward
//! that returns `d(qkv)` and the score bias's gradient.
//!
//! Per batch element and head (one parallel task each), `c` the score scale (usually
//! `1/sqrt(d_head)`):
//!
//! ```text
//! q, k   = rot(q_h), rot(k_h)                          (t, d_head)
//! S      = c q kᵀ + score_bias_h                       (t, t)
//! P      = softmax(S + key_bias)                       (t, t)
//! out_h  = (P ⊙ M) v_h                                 (t, d_head), M the dropout mask or 1
//! ```
//!
//! The backward recomputes `P`, unless the fused layer's forward kept it
//! ([`Attention::keeps_weights`]: only when it is small), then
//!
//! ```text
//! dv = (P ⊙ M)ᵀ dout,  dP = (dout vᵀ) ⊙ M,  dS = P ⊙ (dP - rowsum(dP ⊙ P))
//! d(score_bias) = dS (summed over the batch when the bias is shared by it)
//! dq = rot⁻¹(c dS k),  dk = rot⁻¹(c dSᵀ q)
//! ```
//!
//! A bias given as running sums `f`, `g` ([`AttentionBias::SidedSums`]) is added per head as
//! `f[i] - f[j]` (`j <= i`) and `g[j] - g[i]` (`j > i`), each value as the table would hold it,
//! and its gradient is reduced to the sums' in the task, in the order of the two-sided
//! differences' own backward, so that neither the `(b, h, t, t)` bias nor its gradient is
//! stored:
//!
//! ```text
//! df[i] = Σ_{j <= i} dS[i, j] - Σ_{i' >= i} dS[i', i]
//! dg[j] = Σ_{i < j} dS[i, j] - Σ_{j' > j} dS[j, j']
//! ```
//!
//! A scheme's own scores take the place of `c q kᵀ` (with no rotation and no score bias beside):
//! a [`Polar`] form, whose `q'`, `k'` `(t, 2 d_head)` a task makes as it reads q and k, or
//! [`GateCounts`], whose counted term `counts.rs` adds to `c q kᵀ` a query's row at a time. Their
//! parameters (the polar offsets, the count tables) take the score bias's op-input slot, and
//! their gradient comes back in its place.
//!
//! Matrix products go through gemm, one thread per task; the rows of a head are read and written
//! in place through strides, so no `(b, h, t, d_head)` copies are made.

#[cfg(target_arch = "x86_64")]
mod avx512;
mod counts;
mod transport;

use candle::backend::BackendStorage;
use candle::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;

use super::differences::sided_grad;
use super::linear::{by_dtype, gemm_sums_in_order, matmul};
use super::softmax::{
    causal_softmax_grad_rows, causal_softmax_rows, softmax_grad_rows, softmax_rows,
};
use super::{
    assume_written, batch_sum, best_rate, contiguous, sigmoid, timing_operand, uninit, written,
    zeros, Real, Rotation, SimdLevel,
};
use crate::spec::{
    CountTables, LayerBias, PolarTables, Reflected, RopeTables, Window, MASKED_SCORE,
};
use std::mem::MaybeUninit;

/// The attention core's fixed inputs: everything but `qkv`, the dropout mask and (as an op
/// input) the score bias, which are the op's arguments.
#[derive(Clone)]
pub struct Attention {
    heads: usize,
    /// What `q kᵀ` is multiplied by.
    scale: f64,
    /// `(b, t)`: 0 for real keys, a large negative score for padded ones.
    key_bias: Tensor,
    /// `(r, t, w)` cos and sin tables, and whether the pairing is interleaved.
    rope: Option<(Tensor, Tensor, bool)>,
    /// Added to the scaled scores: a `(r, h, t, t)` table (`r` 1, shared by the batch, or `b`),
    /// or `(2, b, h, t)` running sums whose two-sided differences are the bias.
    score_bias: Option<LayerBias>,
    /// The keys each query may see (a sliding window, a causal mask): the others get the
    /// masked score.
    window: Window,
    /// Scores of q and k in polar form: the phases' `(r, 1, t, d_head)` tables, and the keys'
    /// phase offsets `(h, d_head)` (differentiable, in the op-input slot of a score bias, which
    /// such an attention has none of).
    polar: Option<PolarTables>,
    /// Scores with gate-counted positions: the stacked tables `(2 npos, d_head)`
    /// (differentiable, in the op-input slot of a score bias, which such an attention has none
    /// of) and the real keys.
    counts: Option<CountTables>,
    /// Scores through a transport of reflections: `[w | β]` `(b, h, t, d_head + 1)`
    /// (differentiable, in the op-input slot of a score bias, which such an attention has none
    /// of).
    transport: Option<Reflected>,
    /// Stick-breaking's weights in place of the softmax (`kernels::cpu::stick_breaking`),
    /// with whether the query's own key breaks first.
    sticks: Option<bool>,
    /// The instruction sets the kernels use (the backend's when the op was made).
    simd: SimdLevel,
}

/// What a caller computed itself and gives an attention made without it: the fused layer's own
/// score inputs, made from the attention input inside the layer.
#[derive(Clone, Copy)]
pub(super) enum Given<'a, T> {
    /// Nothing beyond what the attention was made with.
    Nothing,
    /// Running sums `(2, b, h, t)` as the score bias ([`AttentionBias::SidedSums`]; the
    /// layer's forget gates').
    Sums(&'a [T]),
    /// A transport's reflections `[w | β]` `(b, h, t, d_head + 1)`, for scores through it in
    /// place of `q kᵀ` (the attention then has no rotation, score bias or scores of its own).
    Reflections(&'a [T]),
}

/// A raw pointer that tasks writing disjoint parts of one buffer may share.
#[derive(Clone, Copy)]
struct Shared<T>(*mut T);
// SAFETY: every task writes its own (batch, head) block; no two tasks touch the same element.
unsafe impl<T> Send for Shared<T> {}
unsafe impl<T> Sync for Shared<T> {}

impl<T> Shared<T> {
    /// The pointer (a method, so closures capture the `Send` wrapper, not the raw field).
    fn ptr(self) -> *mut T {
        self.0
    }
}

/// The host values of the fixed inputs, in the dtype of `qkv`.
struct Fixed<T> {
    key_bias: Vec<T>,
    cos: Vec<T>,
    sin: Vec<T>,
    /// Rotated width, and the tables' blocks of `t` rows (1 or b).
    width: usize,
    rope_rows: usize,
    interleaved: bool,
    /// A table's values, or the running sums `[f; g]` when `sided`.
    score_bias: Vec<T>,
    /// Blocks of `(h, t, t)` in a table (1 or b).
    bias_rows: usize,
    /// Whether the bias is given as running sums.
    sided: bool,
    scale: T,
    window: Window,
    /// Polar scores' host tables.
    polar: Option<PolarFixed<T>>,
    /// Gate-counted scores' host tables.
    counts: Option<CountsFixed<T>>,
    /// A transport's reflections `[w | β]` `(b, h, t, d_head + 1)`.
    transport: Option<Vec<T>>,
    /// Stick-breaking's weights in place of the softmax: whether the own key breaks first.
    sticks: Option<bool>,
    simd: SimdLevel,
}

/// The host values of [`GateCounts`]: the stacked tables `(2 npos, d_head)` and their
/// transpose, and whether each key is real `(b, t)`.
struct CountsFixed<T> {
    tables: Vec<T>,
    tables_t: Vec<T>,
    npos: usize,
    real: Vec<bool>,
}

/// The host values of [`Polar`]'s tables: the phases' cosines and sines `(r, t, d_head)` and
/// the cosines and sines of the keys' phase offsets `(h, d_head)`.
struct PolarFixed<T> {
    cos: Vec<T>,
    sin: Vec<T>,
    rows: usize,
    cos_offset: Vec<T>,
    sin_offset: Vec<T>,
}

/// One head's polar tables: `(t, d_head)` phases of its batch element, and `(d_head)` offsets.
#[derive(Clone, Copy)]
struct HeadPolar<'a, T> {
    cos: &'a [T],
    sin: &'a [T],
    cos_offset: &'a [T],
    sin_offset: &'a [T],
}

impl<T: Real> PolarFixed<T> {
    fn head(&self, n: Dims, bi: usize, hd: usize) -> HeadPolar<'_, T> {
        let (th, at) = (n.t * n.dh, hd * n.dh);
        let block = if self.rows == 1 { 0 } else { bi } * th;
        HeadPolar {
            cos: &self.cos[block..block + th],
            sin: &self.sin[block..block + th],
            cos_offset: &self.cos_offset[at..at + n.dh],
            sin_offset: &self.sin_offset[at..at + n.dh],
        }
    }
}

/// `softplus(x) = max(x, 0) + ln(1 + e^(-|x|))`, the negated `log σ(-x)` of the fused kernel
/// (the same bits as the composition's `-log_sigmoid(-x)`).
#[inline(always)]
fn softplus<T: Real>(x: T) -> T {
    let relu = if x > T::zero() { x } else { T::zero() };
    relu + (-x.abs()).exp_().ln_1p_()
}

/// `(cos, sin)` of a key's phase `φ + δ` from those of `φ` and `δ`: `cos φ cos δ - sin φ sin δ`,
/// `sin φ cos δ + cos φ sin δ`, as the composition computes them.
#[inline(always)]
fn key_phase<T: Real>((c, s): (T, T), (co, so): (T, T)) -> (T, T) {
    (c * co - s * so, s * co + c * so)
}

/// Head rows `x` `(t, d_head)`, rows of `stride` values apart, with their head's polar tables,
/// as queries or as keys (`key`: their phases carry the offsets).
#[derive(Clone, Copy)]
struct PolarRows<'a, T> {
    x: &'a [T],
    stride: usize,
    polar: HeadPolar<'a, T>,
    key: bool,
}

/// The polar form of head rows `(t, d_head)` read from rows of `stride` values, into `dst`
/// `(t, 2 d_head)`: `[μ cos | μ sin]` of the phase, plus the offset for keys. Branch-free
/// loops over a row, so that they vectorise at each instruction set level.
#[inline(always)]
fn polar_gather_body<T: Real>(rows: PolarRows<'_, T>, dst: &mut [T]) {
    let PolarRows {
        x: src,
        stride,
        polar: p,
        key,
    } = rows;
    let dh = p.cos_offset.len();
    for (i, out) in dst.chunks_exact_mut(2 * dh).enumerate() {
        let x = &src[i * stride..i * stride + dh];
        let (cos, sin) = (&p.cos[i * dh..(i + 1) * dh], &p.sin[i * dh..(i + 1) * dh]);
        let (re, im) = out.split_at_mut(dh);
        if key {
            let offsets = p.cos_offset.iter().zip(p.sin_offset);
            let tables = cos.iter().zip(sin).zip(offsets);
            for ((r, m), ((c, s), (co, so))) in re.iter_mut().zip(im.iter_mut()).zip(tables) {
                (*r, *m) = key_phase((*c, *s), (*co, *so));
            }
        } else {
            re.copy_from_slice(cos);
            im.copy_from_slice(sin);
        }
        for ((r, m), x) in re.iter_mut().zip(im.iter_mut()).zip(x) {
            let mu = softplus(*x);
            *r *= mu;
            *m *= mu;
        }
    }
}
simd_dispatch!(fn polar_gather = polar_gather_body(rows: PolarRows<'_, T>, dst: &mut [T]));

/// The gradient of head rows `x` `(t, d_head)` (rows of `stride` values) from that of their
/// polar form `g` `(t, 2 d_head)` whose values are `form`, written into rows of `stride` values
/// at `dst`; for keys, the offsets' gradient is added to `offsets` `(d_head)`.
///
/// ```text
/// dx = σ(x) (g_re cos + g_im sin),   dδ += g_im re - g_re im    (re, im: the form's halves)
/// ```
///
/// # Safety
/// As [`scatter`]'s: `dst` valid for `t` rows of `stride` values, the first `d_head` of each
/// this call's alone.
#[inline(always)]
unsafe fn polar_scatter_body<T: Real>(
    rows: PolarRows<'_, T>,
    (g, form): (&[T], &[T]),
    dst: *mut T,
    offsets: &mut [T],
) {
    let PolarRows {
        x,
        stride,
        polar: p,
        key,
    } = rows;
    let dh = p.cos_offset.len();
    for (i, (g, f)) in g
        .chunks_exact(2 * dh)
        .zip(form.chunks_exact(2 * dh))
        .enumerate()
    {
        let x = &x[i * stride..i * stride + dh];
        let tables = p.cos[i * dh..(i + 1) * dh]
            .iter()
            .zip(&p.sin[i * dh..(i + 1) * dh]);
        let (g_re, g_im) = g.split_at(dh);
        // SAFETY: row i of the destination block, per the contract.
        let out = unsafe { std::slice::from_raw_parts_mut(dst.add(i * stride), dh) };
        let grads = g_re.iter().zip(g_im);
        if key {
            let tables = tables.zip(p.cos_offset.iter().zip(p.sin_offset));
            for ((o, x), ((gr, gi), ((c, s), (co, so)))) in
                out.iter_mut().zip(x).zip(grads.zip(tables))
            {
                let (pc, ps) = key_phase((*c, *s), (*co, *so));
                *o = sigmoid(*x) * (*gr * pc + *gi * ps);
            }
            let (re, im) = f.split_at(dh);
            for ((d, (gr, gi)), (r, m)) in offsets
                .iter_mut()
                .zip(g_re.iter().zip(g_im))
                .zip(re.iter().zip(im))
            {
                *d += *gi * *r - *gr * *m;
            }
        } else {
            for ((o, x), ((gr, gi), (c, s))) in out.iter_mut().zip(x).zip(grads.zip(tables)) {
                *o = sigmoid(*x) * (*gr * *c + *gi * *s);
            }
        }
    }
}
simd_dispatch!(
    /// # Safety
    /// As [`polar_scatter_body`]'s.
    unsafe fn polar_scatter = polar_scatter_body(rows: PolarRows<'_, T>, grads: (&[T], &[T]), dst: *mut T, offsets: &mut [T])
);

impl<T: Real> Fixed<T> {
    /// Head `hd` of batch element `bi`, where its weights are stick-breaking's.
    fn sticks_head(
        &self,
        n: Dims,
        bi: usize,
        hd: usize,
    ) -> Option<super::stick_breaking::Head<'_, T>> {
        self.sticks.map(|own_first| super::stick_breaking::Head {
            parity: hd,
            own_first,
            window: self.window,
            key_bias: &self.key_bias[bi * n.t..(bi + 1) * n.t],
        })
    }

    /// The width of the operands of `q kᵀ`: `2 d_head` in polar form, else `d_head`.
    fn qk_width(&self, n: Dims) -> usize {
        match self.polar {
            Some(_) => 2 * n.dh,
            None => n.dh,
        }
    }

    /// Whether a task copies q and k out (rotated, or in polar form), and how wide: what its
    /// [`Scratch`] holds.
    fn gathered(&self, n: Dims) -> (bool, usize) {
        (
            !self.cos.is_empty() || self.polar.is_some() || self.transport.is_some(),
            self.qk_width(n),
        )
    }

    /// The transport of head `hd` of batch element `bi`, over its gathered q and k.
    fn transport_head<'a>(
        &'a self,
        (n, bi, hd): (Dims, usize, usize),
        (q, k): (&'a [T], &'a [T]),
    ) -> Option<transport::Head<'a, T>> {
        self.transport.as_ref().map(|r| {
            let (per, at) = (n.t * (n.dh + 1), bi * n.h + hd);
            transport::Head {
                q,
                k,
                reflections: &r[at * per..(at + 1) * per],
                scale: self.scale,
            }
        })
    }

    /// The rotation of batch element `bi` (`sign` 1) or its inverse (`sign` -1), if there is one.
    fn rotation(&self, sign: T, bi: usize, t: usize) -> Option<Rotation<'_, T>> {
        (!self.cos.is_empty()).then(|| {
            Rotation {
                cos: &self.cos,
                sin: &self.sin,
                width: self.width,
                interleaved: self.interleaved,
                sign,
            }
            .for_batch(bi, t, self.rope_rows)
        })
    }

    /// The score bias of head `hd` of batch element `bi`, if there is one.
    fn score_bias(&self, n: Dims, bi: usize, hd: usize) -> Option<HeadBias<'_, T>> {
        if self.score_bias.is_empty() {
            return None;
        }
        if self.sided {
            let (at, half) = ((bi * n.h + hd) * n.t, n.b * n.h * n.t);
            return Some(HeadBias::Sided {
                f: &self.score_bias[at..at + n.t],
                g: &self.score_bias[half + at..half + at + n.t],
            });
        }
        let block = if self.bias_rows == 1 { 0 } else { bi };
        let tt = n.t * n.t;
        let at = (block * n.h + hd) * tt;
        Some(HeadBias::Table(&self.score_bias[at..at + tt]))
    }
}

/// One head's score bias: a `(t, t)` block of a table, or its running sums `f`, `g` `(t)`.
enum HeadBias<'a, T> {
    Table(&'a [T]),
    Sided { f: &'a [T], g: &'a [T] },
}

/// `s[i, j] += f[i] - f[j]` for `j <= i` and `g[j] - g[i]` for `j > i`: each value as the
/// two-sided differences' table holds it, added as the table would be.
#[inline(always)]
fn add_sided_body<T: Real>(s: &mut [T], f: &[T], g: &[T]) {
    let t = f.len();
    for (i, row) in s.chunks_exact_mut(t).enumerate() {
        let (before, after) = row.split_at_mut(i + 1);
        let (fi, gi) = (f[i], g[i]);
        for (v, fj) in before.iter_mut().zip(f) {
            *v += fi - *fj;
        }
        for (v, gj) in after.iter_mut().zip(&g[i + 1..]) {
            *v += *gj - gi;
        }
    }
}

simd_dispatch!(fn add_sided = add_sided_body(s: &mut [T], f: &[T], g: &[T]));

/// Shapes of one call.
#[derive(Clone, Copy)]
pub(super) struct Dims {
    pub b: usize,
    pub t: usize,
    pub d: usize,
    pub h: usize,
    pub dh: usize,
}

/// Copies head rows `(rows, width)` out of rows of `stride` values, rotated when a rotation is
/// given, else plainly.
#[inline(always)]
fn gather_body<T: Real>(
    src: &[T],
    stride: usize,
    width: usize,
    rotation: Option<Rotation<'_, T>>,
    dst: &mut [T],
) {
    for (i, out) in dst.chunks_exact_mut(width).enumerate() {
        let x = &src[i * stride..i * stride + width];
        match rotation {
            Some(r) => r.apply(x, i, out),
            None => out.copy_from_slice(x),
        }
    }
}
simd_dispatch!(fn gather = gather_body(src: &[T], stride: usize, width: usize, rotation: Option<Rotation<'_, T>>, dst: &mut [T]));

/// Writes head rows `(t, dh)` into rows of `stride` values at `dst`, rotated as in [`gather`].
///
/// # Safety
/// `dst` must be valid for `t` rows of `stride` values, of which this call writes the first
/// `dh` of each, and nothing else may touch those.
#[inline(always)]
unsafe fn scatter<T: Real>(
    src: &[T],
    dh: usize,
    dst: *mut T,
    stride: usize,
    rotation: Option<Rotation<'_, T>>,
) {
    for (i, x) in src.chunks_exact(dh).enumerate() {
        // SAFETY: row i of the destination block, per the contract.
        let out = unsafe { std::slice::from_raw_parts_mut(dst.add(i * stride), dh) };
        match rotation {
            Some(r) => r.apply(x, i, out),
            None => out.copy_from_slice(x),
        }
    }
}

/// `s += bias`, elementwise.
#[inline(always)]
fn add_bias_body<T: Real>(s: &mut [T], bias: &[T]) {
    for (v, b) in s.iter_mut().zip(bias) {
        *v += *b;
    }
}
simd_dispatch!(fn add_bias = add_bias_body(s: &mut [T], bias: &[T]));

/// Adds the masked score to every score of a `(t, t)` block whose key is outside its query's
/// `window` (a sliding window, a causal mask), with no `(t, t)` mask kept anywhere. The masked
/// weights are exactly 0 after the softmax, so their gradients are too.
fn mask_outside_window<T: Real>(s: &mut [T], t: usize, window: Window) {
    let masked = T::lit(MASKED_SCORE);
    for (i, row) in s.chunks_exact_mut(t).enumerate() {
        let std::ops::Range { start: lo, end: hi } = window.keys(i, t);
        let (before, rest) = row.split_at_mut(lo);
        let after = &mut rest[hi - lo..];
        for v in before.iter_mut().chain(after) {
            *v += masked;
        }
    }
}

/// One task's scratch space.
struct Scratch<T> {
    /// rotated q and k, or their polar forms
    q: Vec<T>,
    k: Vec<T>,
    /// scores, then probabilities `P`
    s: Vec<T>,
    p: Vec<T>,
    /// `P ⊙ M` (backward with dropout)
    pm: Vec<T>,
    dp: Vec<T>,
    ds: Vec<T>,
    dq: Vec<T>,
    dk: Vec<T>,
    /// the running sums' gradient `[df; dg]` (backward with a sided bias)
    dfg: Vec<T>,
    /// the polar offsets' gradient of this head `(d_head)` (backward with polar scores)
    doffsets: Vec<T>,
    /// gate-counted scores: the content scores `(t, t)`, the rows' table products and their
    /// gradient `(t, 2 npos)`, and a row's work space
    a: Vec<T>,
    r: Vec<T>,
    dr: Vec<T>,
    rows: counts::RowWork<T>,
    /// a transport's carried rows (and in a backward their history), and the reflections'
    /// gradient `(t, d_head + 1)`
    carried: transport::Work<T>,
    drefl: Vec<T>,
    /// a product's right operand in contiguous rows (see [`product`])
    pack: Vec<T>,
}

/// Where a pass's scores come from, for what its [`Scratch`] holds.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Scores {
    /// `q kᵀ`, rotated or not.
    Products,
    /// The product of q and k in polar form, with each head's learned offsets.
    Polar,
    /// Gate-counted scores with tables of `npos` rows each.
    Counted {
        /// The rows of each table.
        npos: usize,
    },
    /// Keys carried to the query through a transport.
    Carried,
}

impl<T: Real> Fixed<T> {
    /// The window the head products run in bands of ([`banded_scores`], [`banded_sums`]), if
    /// they do: plain `q kᵀ` scores under a causal mask without a window, whose weights are
    /// then exactly 0 after the query (every query sees itself and the real keys before it).
    /// Under a window a padded query far from the real tokens sees only padding, and its
    /// weights then spread over every key, as the composition's do: such layers are not banded.
    fn band(&self, n: Dims) -> Option<Window> {
        let banded = self.scores() == Scores::Products
            && self.window.causal()
            && self.window.before.is_none()
            && n.t > 1;
        banded.then_some(self.window)
    }

    /// Where the scores come from (one kind at most: [`Attention::dims_of`] checks it).
    fn scores(&self) -> Scores {
        match (&self.polar, &self.counts, &self.transport) {
            (Some(_), _, _) => Scores::Polar,
            (None, Some(c), _) => Scores::Counted { npos: c.npos },
            (None, None, Some(_)) => Scores::Carried,
            (None, None, None) => Scores::Products,
        }
    }
}

impl<T: Real> Scratch<T> {
    /// Buffers for a forward or a backward pass; those a pass does not use stay empty.
    /// `gathered`: q and k are copied out (rotated or in polar form) `width` wide; `scores`:
    /// what the scores are made of beside q and k.
    fn new(
        n: Dims,
        (gathered, width): (bool, usize),
        (mask, backward, sided): (bool, bool, bool),
        scores: Scores,
    ) -> Self {
        let (npos, carried, polar) = match scores {
            Scores::Counted { npos } => (npos, false, false),
            Scores::Carried => (0, true, false),
            Scores::Polar => (0, false, true),
            Scores::Products => (0, false, false),
        };
        let (tw, tt, counted) = (n.t * width, n.t * n.t, npos > 0);
        let z = |len, used: bool| vec![T::zero(); if used { len } else { 0 }];
        Self {
            q: z(tw, gathered),
            k: z(tw, gathered),
            s: z(tt, true),
            p: z(tt, true),
            pm: z(tt, mask && backward),
            dp: z(tt, backward),
            ds: z(tt, backward),
            dq: z(tw, (gathered || counted) && backward),
            dk: z(tw, gathered && backward),
            dfg: z(2 * n.t, sided && backward),
            doffsets: z(n.dh, polar && backward),
            a: z(tt, counted),
            r: z(n.t * 2 * npos, counted),
            dr: z(n.t * 2 * npos, counted && backward),
            rows: counts::RowWork::new(n.t, npos),
            carried: transport::Work::new(n.t, n.dh, carried, backward),
            drefl: z(n.t * (n.dh + 1), carried && backward),
            pack: z(n.t * width.max(n.dh), true),
        }
    }

    /// The operands `q`, `k`, `v` `(t, d_head)` of head `hd` of batch element `bi`: read in
    /// place from `qkv` through strides, except `q` and `k` under a rotation, which are
    /// gathered here rotated.
    fn heads(&mut self, qkv: &[T], n: Dims, bi: usize, hd: usize, fixed: &Fixed<T>) -> Heads<T> {
        let row = 3 * n.d;
        let base = bi * n.t * row + hd * n.dh;
        let block = |offset: usize| &qkv[base + offset..base + offset + (n.t - 1) * row + n.dh];
        let v = View::rows(block(2 * n.d).as_ptr(), row);
        if let Some(polar) = &fixed.polar {
            let p = polar.head(n, bi, hd);
            let rows = |x, key| PolarRows {
                x,
                stride: row,
                polar: p,
                key,
            };
            polar_gather(fixed.simd, rows(block(0), false), &mut self.q);
            polar_gather(fixed.simd, rows(block(n.d), true), &mut self.k);
            return Heads {
                q: View::rows(self.q.as_ptr(), 2 * n.dh),
                k: View::rows(self.k.as_ptr(), 2 * n.dh),
                v,
            };
        }
        // Rotated, or (for a transport, which reads rows whole) copied plainly.
        match fixed.rotation(T::one(), bi, n.t) {
            rotation if rotation.is_some() || fixed.transport.is_some() => {
                gather(fixed.simd, block(0), row, n.dh, rotation, &mut self.q);
                gather(fixed.simd, block(n.d), row, n.dh, rotation, &mut self.k);
                Heads {
                    q: View::rows(self.q.as_ptr(), n.dh),
                    k: View::rows(self.k.as_ptr(), n.dh),
                    v,
                }
            }
            _ => Heads {
                q: View::rows(block(0).as_ptr(), row),
                k: View::rows(block(n.d).as_ptr(), row),
                v,
            },
        }
    }

    /// `P = softmax(c q kᵀ + score_bias + key_bias)` into `into` (`t x t`, written in full,
    /// perhaps uninitialised before), or `self.p`.
    fn probabilities(
        &mut self,
        heads: Heads<T>,
        (n, bi, hd): (Dims, usize, usize),
        fixed: &Fixed<T>,
        into: Option<&mut [MaybeUninit<T>]>,
    ) {
        // Gate-counted scores: the content scores go to `a`, then `s = a + z` row by row.
        let counted = fixed.counts.as_ref();
        let scores = match counted {
            Some(_) => self.a.as_mut_ptr(),
            None => self.s.as_mut_ptr(),
        };
        match fixed.transport_head((n, bi, hd), (&self.q, &self.k)) {
            // A transport's scores: the keys carried to each query.
            Some(head) => transport::forward(fixed.simd, head, &mut self.s, &mut self.carried),
            // SAFETY: s and a are t x t; the heads are valid t x dh operands.
            None => unsafe {
                banded_scores(
                    (n.t, fixed.qk_width(n)),
                    scores,
                    n.t,
                    heads.q,
                    heads.k.t(),
                    fixed.scale,
                    fixed.band(n),
                    (fixed.simd, &mut self.pack),
                )
            },
        }
        if let Some(c) = counted {
            let w2 = 2 * c.npos;
            // SAFETY: r is t x 2 npos, the transposed tables d_head x 2 npos in rows.
            unsafe {
                product(
                    (n.t, w2, n.dh),
                    self.r.as_mut_ptr(),
                    w2,
                    heads.q,
                    View::rows(c.tables_t.as_ptr(), w2),
                    T::one(),
                    Some((fixed.simd, &mut self.pack)),
                )
            };
            let rows = counts::Rows {
                a: &self.a,
                r: &self.r,
                real: &c.real[bi * n.t..(bi + 1) * n.t],
                npos: c.npos,
            };
            counts::forward_rows(fixed.simd, rows, &mut self.s, &mut self.rows);
        }
        match fixed.score_bias(n, bi, hd) {
            Some(HeadBias::Table(bias)) => add_bias(fixed.simd, &mut self.s, bias),
            Some(HeadBias::Sided { f, g }) => add_sided(fixed.simd, &mut self.s, f, g),
            None => {}
        }
        let key_bias = &fixed.key_bias[bi * n.t..(bi + 1) * n.t];
        // SAFETY: the softmax writes values only.
        let into = into.unwrap_or_else(|| unsafe { uninit(&mut self.p) });
        if let Some(head) = fixed.sticks_head(n, bi, hd) {
            // The scores after each query under a band were never computed: they do not break.
            head.weights(fixed.simd, &self.s, into);
            return;
        }
        if fixed.band(n).is_some() {
            // Banded: the scores after each query were never computed, and are never read.
            causal_softmax_rows(fixed.simd, &self.s, key_bias, into);
            return;
        }
        if fixed.window.masks_any(n.t) {
            mask_outside_window(&mut self.s, n.t, fixed.window);
        }
        softmax_rows(fixed.simd, &self.s, key_bias, into);
    }
}

/// A matrix operand: where it starts and its row and column strides.
#[derive(Clone, Copy)]
struct View<T> {
    ptr: *const T,
    rs: isize,
    cs: isize,
}

impl<T> View<T> {
    /// Rows of `stride` values, columns adjacent.
    fn rows(ptr: *const T, stride: usize) -> Self {
        Self {
            ptr,
            rs: stride as isize,
            cs: 1,
        }
    }

    /// The transpose.
    fn t(self) -> Self {
        Self {
            ptr: self.ptr,
            rs: self.cs,
            cs: self.rs,
        }
    }

    /// The operand from row `r`, column `c` on.
    ///
    /// # Safety
    /// The element at `(r, c)` must lie within the operand's allocation.
    unsafe fn from(self, r: usize, c: usize) -> Self {
        Self {
            // SAFETY: per the contract.
            ptr: unsafe { self.ptr.offset(r as isize * self.rs + c as isize * self.cs) },
            ..self
        }
    }
}

/// Rows of queries a banded product takes at a time: each block multiplies only the keys its
/// queries see (a causal mask's lower triangle, a window's band).
const BAND_ROWS: usize = 64;

/// The row blocks of `t` queries, each with the keys (`keys = true`) or, for a transposed
/// product whose rows are keys, the queries (`false`) that `band` pairs with it; without a
/// band, one block of every row with every column.
fn bands(
    band: Option<Window>,
    t: usize,
    keys: bool,
) -> impl Iterator<Item = (std::ops::Range<usize>, std::ops::Range<usize>)> {
    let step = if band.is_some() { BAND_ROWS } else { t.max(1) };
    (0..t).step_by(step).map(move |r0| {
        let rows = r0..(r0 + step).min(t);
        let with = match (band, keys) {
            (None, _) => 0..t,
            (Some(window), true) => window.keys_of(rows.clone(), t),
            (Some(window), false) => window.queries_of(rows.clone(), t),
        };
        (rows, with)
    })
}

/// `dst (t x t) = scale · lhs (t x k) · rhs (k x t)`, with a `band` only the (query, key) pairs
/// its window lets through: each block of rows gets the columns of its keys, and the others
/// are left as they were (the caller masks them). Without one, the whole [`product`].
///
/// # Safety
/// As [`product`]'s, for the whole `t x t` product.
#[allow(clippy::too_many_arguments)]
unsafe fn banded_scores<T: Real>(
    (t, k): (usize, usize),
    dst: *mut T,
    dst_rs: usize,
    lhs: View<T>,
    rhs: View<T>,
    scale: T,
    band: Option<Window>,
    (simd, pack): (SimdLevel, &mut [T]),
) {
    for (rows, keys) in bands(band, t, true) {
        // SAFETY: per the contract; each block stays within the t x t product.
        unsafe {
            product(
                (rows.len(), keys.len(), k),
                dst.add(rows.start * dst_rs + keys.start),
                dst_rs,
                lhs.from(rows.start, 0),
                rhs.from(0, keys.start),
                scale,
                Some((simd, &mut *pack)),
            )
        }
    }
}

/// `dst (t x n) = scale · lhs (t x t) · rhs (t x n)`; with a `band`, `lhs` zero outside the
/// pairs its window lets through, and each block of rows sums over only its band of `lhs`'s
/// columns. `lhs` is weights by (query, key) when `keys`, or their transpose (rows of keys)
/// when not. Without a band, the whole [`product`].
///
/// # Safety
/// As [`product`]'s, for the whole product.
#[allow(clippy::too_many_arguments)]
unsafe fn banded_sums<T: Real>(
    (t, n): (usize, usize),
    dst: *mut T,
    dst_rs: usize,
    lhs: View<T>,
    rhs: View<T>,
    scale: T,
    (band, keys): (Option<Window>, bool),
    (simd, pack): (SimdLevel, &mut [T]),
) {
    for (rows, depth) in bands(band, t, keys) {
        // SAFETY: per the contract; each block stays within the product.
        unsafe {
            product(
                (rows.len(), n, depth.len()),
                dst.add(rows.start * dst_rs),
                dst_rs,
                lhs.from(rows.start, depth.start),
                rhs.from(depth.start, 0),
                scale,
                Some((simd, &mut *pack)),
            )
        }
    }
}

/// One head's operands, each `(t, d_head)`.
#[derive(Clone, Copy)]
struct Heads<T> {
    q: View<T>,
    k: View<T>,
    v: View<T>,
}

/// `dst (m x n) = scale · lhs (m x k) · rhs (k x n)`, on this thread; `dst` rows of `dst_rs`.
///
/// Given `small` (the SIMD level and a buffer to pack into), the products [`tiles_pay`] for run
/// in register tiles ([`tiled`]), the others through gemm; both give the same bits.
///
/// # Safety
/// Every pointer must be valid for the rows, columns and strides it is used with, and `pack`
/// must hold at least `k n` values when `rhs`'s columns are not adjacent.
unsafe fn product<T: Real>(
    dims: (usize, usize, usize),
    dst: *mut T,
    dst_rs: usize,
    lhs: View<T>,
    rhs: View<T>,
    scale: T,
    small: Option<(SimdLevel, &mut [T])>,
) {
    if let Some((simd, pack)) = small.filter(|_| tiles_pay(dims)) {
        // SAFETY: per the contract.
        return unsafe { tiled(dims, dst, dst_rs, lhs, rhs, scale, simd, pack) };
    }
    // SAFETY: per the contract.
    unsafe {
        matmul(
            dims,
            dst,
            (dst_rs as isize, 1),
            false,
            lhs.ptr,
            (lhs.rs, lhs.cs),
            rhs.ptr,
            (rhs.rs, rhs.cs),
            scale,
            Parallelism::None,
        )
    }
}

/// [`product`] in register tiles, for the products of a head too small for gemm to run at
/// speed (`t x t x d_head`, `d_head` 8, where its packing and dispatch cost more than the
/// arithmetic). Each value is summed in order of `k` by fused multiply-adds from zero and then
/// scaled, as gemm's kernels sum within one depth block, so where [`gemm_sums_in_order`] holds
/// both give the same bits. `rhs` is packed to contiguous rows into `pack` first when its rows
/// are strided. For `f32` at AVX-512 the tiles are [`avx512`]'s, which name their registers
/// (the same sums in the same order, so the same bits); other types and levels, and shapes
/// those kernels do not take, use the portable tiles below.
///
/// # Safety
/// As [`product`]'s.
#[allow(clippy::too_many_arguments)]
unsafe fn tiled<T: Real>(
    (m, n, k): (usize, usize, usize),
    dst: *mut T,
    dst_rs: usize,
    lhs: View<T>,
    rhs: View<T>,
    scale: T,
    simd: SimdLevel,
    pack: &mut [T],
) {
    let (rhs_ptr, rhs_rs) = if rhs.cs == 1 {
        (rhs.ptr, rhs.rs as usize)
    } else if cfg!(target_arch = "x86_64")
        && k == 8
        && rhs.rs == 1
        && rhs.cs >= 8
        && avx512_f32::<T>(simd)
    {
        // kᵀ or vᵀ of a head 8 wide: its n rows transposed 16 at a time.
        #[cfg(target_arch = "x86_64")]
        // SAFETY: rhs is n rows (its columns) of 8 adjacent values, rhs.cs apart; pack holds 8 n
        // values; the CPU has AVX-512 (`avx512_f32` checked it).
        unsafe {
            avx512::pack_transposed(rhs.ptr.cast(), rhs.cs as usize, n, pack.as_mut_ptr().cast())
        };
        (pack.as_ptr(), n)
    } else {
        // Column by column: a column of rhs is a row of the operand it transposes (k's or v's
        // `d_head` values, adjacent in qkv), so it is read from one cache line.
        for j in 0..n {
            for kk in 0..k {
                // SAFETY: rhs is valid for k x n through its strides, per the contract.
                pack[kk * n + j] =
                    unsafe { *rhs.ptr.offset(kk as isize * rhs.rs + j as isize * rhs.cs) };
            }
        }
        (pack.as_ptr(), n)
    };
    let tiles = Tiles {
        m,
        n,
        k,
        dst,
        dst_rs,
        lhs,
        rhs: rhs_ptr,
        rhs_rs,
        scale,
    };
    #[cfg(target_arch = "x86_64")]
    if let Some(p) = tiles.avx512(simd) {
        // SAFETY: per the contract; the CPU has AVX-512 (`avx512` checked it).
        if unsafe { avx512::product(p) } {
            return;
        }
    }
    // SAFETY: per the contract, and rhs now has contiguous rows of rhs_rs.
    unsafe { tiled_product(simd, tiles) }
}

/// Whether a product runs in [`tiled`]: where it gives gemm's bits ([`gemm_sums_in_order`]) and
/// is the faster of the two: when its depth
/// or its width is at most 8 (`q kᵀ`, `P v` and their gradients with heads 8 wide). Wider
/// heads go to gemm, whose larger kernels then win (the book's performance page, "Measurements behind the code's choices").
fn tiles_pay(dims: (usize, usize, usize)) -> bool {
    let (_, n, k) = dims;
    gemm_sums_in_order(dims) && (n <= 8 || k <= 8)
}

/// The operands of one [`tiled_product`]: `rhs` in contiguous rows of `rhs_rs`.
#[derive(Clone, Copy)]
struct Tiles<T> {
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    dst_rs: usize,
    lhs: View<T>,
    rhs: *const T,
    rhs_rs: usize,
    scale: T,
}

/// Whether the head products of `T` run in [`avx512`]'s kernels at `simd`: `T` is `f32`, and
/// `simd` (capped at the CPU's) is AVX-512.
fn avx512_f32<T: Real>(simd: SimdLevel) -> bool {
    std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>()
        && simd.min(SimdLevel::detected()) == SimdLevel::Avx512
}

impl<T: Real> Tiles<T> {
    /// These operands for [`avx512::product`], when they are `f32` and `simd` (capped at the
    /// CPU's) is AVX-512.
    #[cfg(target_arch = "x86_64")]
    fn avx512(&self, simd: SimdLevel) -> Option<avx512::Product> {
        avx512_f32::<T>(simd).then(|| avx512::Product {
            m: self.m,
            n: self.n,
            k: self.k,
            dst: self.dst.cast(),
            dst_rs: self.dst_rs,
            lhs: self.lhs.ptr.cast(),
            lhs_rs: self.lhs.rs,
            lhs_cs: self.lhs.cs,
            rhs: self.rhs.cast(),
            rhs_rs: self.rhs_rs,
            scale: self.scale.to_f32().unwrap_or(f32::NAN),
        })
    }
}

/// `R x C` outputs from `(i0, j0)`, kept in registers over the whole depth.
///
/// # Safety
/// As [`tiled_product`]'s, for the tile's rows and columns.
#[inline(always)]
unsafe fn tile<T: Real, const R: usize, const C: usize>(p: Tiles<T>, i0: usize, j0: usize) {
    let mut acc = [[T::zero(); C]; R];
    for kk in 0..p.k {
        // SAFETY: row kk of rhs has columns j0..j0 + C; lhs rows i0..i0 + R have column kk.
        let b = unsafe { &*(p.rhs.add(kk * p.rhs_rs + j0) as *const [T; C]) };
        for (r, acc) in acc.iter_mut().enumerate() {
            let a = unsafe {
                *p.lhs
                    .ptr
                    .offset((i0 + r) as isize * p.lhs.rs + kk as isize * p.lhs.cs)
            };
            for c in 0..C {
                acc[c] = a.mul_add(b[c], acc[c]);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (c, v) in acc.iter().enumerate() {
            // SAFETY: dst holds rows i0..i0 + R, columns j0..j0 + C.
            unsafe { *p.dst.add((i0 + r) * p.dst_rs + j0 + c) = p.scale * *v };
        }
    }
}

/// Columns `j0..j0 + C` of every row: tiles of 8 rows when the columns are few (a head's
/// `d_head`, as in `P v`: more rows per loaded row of `rhs`), then of 4 rows, then single rows.
/// (Wider tiles of more rows measured far slower: their accumulators leave the registers.)
#[inline(always)]
unsafe fn column_block<T: Real, const C: usize>(p: Tiles<T>, j0: usize) {
    let mut i = 0;
    if C <= 8 {
        while i + 8 <= p.m {
            // SAFETY: per the contract.
            unsafe { tile::<T, 8, C>(p, i, j0) };
            i += 8;
        }
    }
    while i + 4 <= p.m {
        // SAFETY: per the contract.
        unsafe { tile::<T, 4, C>(p, i, j0) };
        i += 4;
    }
    while i < p.m {
        unsafe { tile::<T, 1, C>(p, i, j0) };
        i += 1;
    }
}

/// `dst = scale · lhs · rhs` in register tiles (16, then 8, then 1 column wide).
///
/// # Safety
/// Every pointer of `p` must be valid for its rows, columns and strides.
#[inline(always)]
unsafe fn tiled_body<T: Real>(p: Tiles<T>) {
    let mut j = 0;
    // SAFETY (all): per the contract; each block stays within the n columns.
    while j + 16 <= p.n {
        unsafe { column_block::<T, 16>(p, j) };
        j += 16;
    }
    while j + 8 <= p.n {
        unsafe { column_block::<T, 8>(p, j) };
        j += 8;
    }
    while j < p.n {
        unsafe { column_block::<T, 1>(p, j) };
        j += 1;
    }
}

simd_dispatch!(
    /// [`tiled_body`] compiled for each instruction set.
    ///
    /// # Safety
    /// As [`tiled_body`]'s.
    unsafe fn tiled_product = tiled_body(p: Tiles<T>)
);

/// A tensor standing for an absent op input (no dropout mask, no score bias).
pub(super) fn absent(like: &Tensor) -> Result<Tensor> {
    Tensor::zeros(0, like.dtype(), like.device())
}

fn is_absent(l: &Layout) -> bool {
    l.shape().elem_count() == 0
}

impl Attention {
    /// # Shapes
    /// - `key_bias`: `(b, t)`; `rope`: tables `(r, t, w)`, `r` 1 or `b`; `score_bias`: see
    ///   [`LayerBias`]
    pub fn new(
        heads: usize,
        scale: f64,
        key_bias: &Tensor,
        rope: Option<RopeTables>,
        score_bias: Option<LayerBias>,
        window: Window,
        simd: SimdLevel,
    ) -> Self {
        Self {
            heads,
            scale,
            key_bias: key_bias.clone(),
            rope: rope.map(|r| (r.cos, r.sin, r.interleaved)),
            score_bias,
            window,
            polar: None,
            counts: None,
            transport: None,
            sticks: None,
            simd,
        }
    }

    /// This attention with stick-breaking's weights in place of the softmax, when given
    /// (whether the query's own key breaks first): each row's keys break a stick in their
    /// order, even heads left first (see `stick_breaking`).
    pub fn with_sticks(self, sticks: Option<bool>) -> Self {
        Self { sticks, ..self }
    }

    /// This attention with its scores in polar form ([`PolarTables`]), when given, in place of
    /// `q kᵀ`. It then takes no rotation and no score bias (checked with the shapes).
    pub fn with_polar(self, polar: Option<PolarTables>) -> Self {
        Self { polar, ..self }
    }

    /// This attention with gate-counted scores ([`CountTables`]), when given, in place of
    /// `q kᵀ`. It then takes no rotation and no score bias (checked with the shapes).
    pub fn with_counts(self, counts: Option<CountTables>) -> Self {
        Self { counts, ..self }
    }

    /// This attention with scores through a transport ([`Reflected`]), when given, in place of
    /// `q kᵀ`. It then takes no rotation and no score bias (checked with the shapes).
    pub fn with_transport(self, transport: Option<Reflected>) -> Self {
        Self { transport, ..self }
    }

    /// Whether the scores are a scheme's own (polar, gate-counted or carried), not `q kᵀ`.
    pub(super) fn own_scores(&self) -> bool {
        self.polar.is_some() || self.counts.is_some() || self.transport.is_some()
    }

    /// The differentiable op input: the score bias, the polar offsets, the count tables or the
    /// reflections.
    fn grad_input(&self) -> Option<&Tensor> {
        self.bias_tensor()
            .or(self.polar.as_ref().map(PolarTables::offsets))
            .or(self.counts.as_ref().map(CountTables::tables))
            .or(self.transport.as_ref().map(Reflected::reflections))
    }

    /// The score bias's tensor (a table or the running sums), if there is one.
    pub(super) fn bias_tensor(&self) -> Option<&Tensor> {
        self.score_bias.as_ref().map(LayerBias::tensor)
    }

    /// This attention with a bias of offsets given as its table ([`LayerBias::without_offsets`]):
    /// what every kernel but the device path's fused attention reads.
    pub fn without_offsets(self) -> Result<Self> {
        Ok(Self {
            score_bias: self
                .score_bias
                .as_ref()
                .map(LayerBias::without_offsets)
                .transpose()?,
            ..self
        })
    }

    /// Whether the score bias is given as running sums.
    fn sided(&self) -> bool {
        matches!(self.score_bias, Some(LayerBias::SidedSums(_)))
    }

    /// The op input carrying the score bias into the autograd graph: the table or the sums, the
    /// polar offsets or the count tables, or an empty tensor when there is none.
    pub fn score_bias_input(&self, like: &Tensor) -> Result<Tensor> {
        match self.grad_input() {
            Some(b) => b.contiguous(),
            None => absent(like),
        }
    }

    /// Whether a training forward of `n` should keep the attention weights for its backward,
    /// which otherwise recomputes them (one `q kᵀ` and one softmax more per head, with the same
    /// bits): when they take less than [`crate::MMAP_THRESHOLD`] per layer, so that they come
    /// from memory the heap reuses step after step. Larger ones are mapped and faulted in
    /// afresh every step, written once and read once (the book's performance page, "Measurements behind the code's choices").
    /// Gate-counted scores keep their content scores and table products beside them, which
    /// their backward reads too ([`Attention::kept_per_head`]).
    /// Stick-breaking's weights are always recomputed: their backward reads the scores.
    pub(super) fn keeps_weights<T>(&self, n: Dims) -> bool {
        if self.sticks.is_some() {
            return false;
        }
        let values =
            n.b.saturating_mul(n.h)
                .saturating_mul(self.kept_per_head(n));
        values.saturating_mul(std::mem::size_of::<T>()) < crate::MMAP_THRESHOLD
    }

    /// Values a training forward keeps per (batch, head) when it keeps the weights: `P`
    /// `(t, t)`, and for gate-counted scores also the content scores `(t, t)` and the rows'
    /// table products `(t, 2 npos)`.
    fn kept_per_head(&self, n: Dims) -> usize {
        let tt = n.t.saturating_mul(n.t);
        match &self.counts {
            Some(c) => tt
                .saturating_mul(2)
                .saturating_add(n.t.saturating_mul(2 * c.npos())),
            None => tt,
        }
    }

    /// The number of heads.
    pub(super) fn head_count(&self) -> usize {
        self.heads
    }

    /// This attention with its fixed inputs (key bias, rotary tables, score bias) in `dtype`
    /// and contiguous, as the device path reads them; the score bias stays differentiable.
    pub(super) fn in_dtype(&self, dtype: candle::DType) -> Result<Self> {
        let convert = |t: &Tensor| t.to_dtype(dtype)?.contiguous();
        Ok(Self {
            key_bias: convert(&self.key_bias)?,
            rope: match &self.rope {
                Some((c, s, i)) => Some((convert(c)?, convert(s)?, *i)),
                None => None,
            },
            score_bias: match &self.score_bias {
                Some(LayerBias::Table(t)) => Some(LayerBias::Table(convert(t)?)),
                Some(LayerBias::SidedSums(t)) => Some(LayerBias::SidedSums(convert(t)?)),
                Some(LayerBias::Offsets(t)) => Some(LayerBias::Offsets(convert(t)?)),
                None => None,
            },
            ..self.clone()
        })
    }

    /// What the device path needs of this attention besides tensors' memory: the scale, the
    /// window and the score bias.
    pub(super) fn device_shape(&self) -> (f64, Window, Option<&LayerBias>) {
        (self.scale, self.window, self.score_bias.as_ref())
    }

    /// The key bias `(b, t)` and the rotary tables `(cos, sin, interleaved)`.
    pub(super) fn device_tensors(&self) -> (&Tensor, Option<(&Tensor, &Tensor, bool)>) {
        (
            &self.key_bias,
            self.rope.as_ref().map(|(c, s, i)| (c, s, *i)),
        )
    }

    /// The instruction sets this op's kernels (and a layer's around it) use.
    pub(super) fn simd(&self) -> SimdLevel {
        self.simd
    }

    /// Whether a gradient is owed to the score bias or the polar offsets (they are computed
    /// from trained variables).
    pub(super) fn bias_needs_grad(&self) -> bool {
        self.grad_input().is_some_and(Tensor::track_op)
    }

    /// Elements of the score bias's (or polar offsets') gradient (0 when none is owed).
    pub(super) fn bias_grad_len(&self) -> usize {
        match self.grad_input() {
            Some(b) if self.bias_needs_grad() => b.elem_count(),
            _ => 0,
        }
    }

    fn dims(&self, l: &Layout) -> Result<Dims> {
        match l.dims() {
            [b, t, d3] => self.dims_of(*b, *t, *d3),
            d => candle::bail!("fused attention: qkv must be (b, t, 3 d_model), got {d:?}"),
        }
    }

    /// The shapes of a call on `qkv` `(b, t, d3)`, checked against the fixed inputs.
    pub(super) fn dims_of(&self, b: usize, t: usize, d3: usize) -> Result<Dims> {
        if !d3.is_multiple_of(3 * self.heads) {
            candle::bail!(
                "fused attention: qkv width {d3} is not 3 x heads ({}) x d_head",
                self.heads
            );
        }
        let (d, h) = (d3 / 3, self.heads);
        if self.key_bias.dims() != [b, t] {
            candle::bail!(
                "fused attention: key bias {:?} does not match qkv (b, t) = ({b}, {t})",
                self.key_bias.shape()
            );
        }
        if let Some((cos, _, _)) = &self.rope {
            match cos.dims() {
                &[r, rt, w] if (r == 1 || r == b) && rt == t && w <= d / h && w % 2 == 0 => {}
                dims => candle::bail!(
                    "fused attention: rotary tables {dims:?} do not match (1 or b, t, <= d_head) \
                     = ({b}, {t}, {})",
                    d / h
                ),
            }
        }
        match &self.score_bias {
            Some(LayerBias::Table(bias)) => match bias.dims() {
                &[r, bh, bt, bt2] if (r == 1 || r == b) && bh == h && bt == t && bt2 == t => {}
                dims => candle::bail!(
                    "fused attention: score bias {dims:?} does not match (1 or b, h, t, t) = \
                     ({b}, {h}, {t}, {t})"
                ),
            },
            Some(LayerBias::SidedSums(sums)) if sums.dims() != [2, b, h, t] => candle::bail!(
                "fused attention: the score bias's running sums {:?} do not match (2, b, h, t) \
                 = (2, {b}, {h}, {t})",
                sums.dims()
            ),
            Some(LayerBias::Offsets(v)) if v.dims() != [1, h, 2 * t - 1] => candle::bail!(
                "fused attention: the score bias by offset {:?} does not match (1, h, 2t - 1) \
                 = (1, {h}, {})",
                v.dims(),
                2 * t - 1
            ),
            Some(LayerBias::SidedSums(_) | LayerBias::Offsets(_)) | None => {}
        }
        if let Some(polar) = &self.polar {
            let ((cos, sin), offsets, dh) = (polar.tables(), polar.offsets(), d / h);
            if self.rope.is_some() || self.score_bias.is_some() {
                candle::bail!(
                    "fused attention: polar scores take neither a rotation nor a score bias"
                );
            }
            match (cos.dims(), offsets.dims()) {
                (&[r, 1, pt, pd], &[oh, od])
                    if (r == 1 || r == b)
                        && pt == t
                        && pd == dh
                        && cos.dims() == sin.dims()
                        && (oh, od) == (h, dh) => {}
                (c, o) => candle::bail!(
                    "fused attention: polar tables {c:?} and offsets {o:?} do not match \
                     (1 or b, 1, t, d_head) = ({b}, 1, {t}, {dh}) and (h, d_head) = ({h}, {dh})"
                ),
            }
        }
        if let Some(counts) = &self.counts {
            let dh = d / h;
            if self.rope.is_some() || self.score_bias.is_some() || self.polar.is_some() {
                candle::bail!(
                    "fused attention: gate-counted scores take neither a rotation, a score bias \
                     nor polar scores"
                );
            }
            match counts.tables().dims() {
                &[rows, td] if td == dh && rows >= 4 && rows % 2 == 0 => {}
                dims => candle::bail!(
                    "fused attention: count tables {dims:?} do not match (2 npos, d_head) with \
                     d_head {dh}"
                ),
            }
            if let Some(mask) = counts.mask() {
                if mask.dims() != [b, t] {
                    candle::bail!(
                        "fused attention: the count mask {:?} does not match (b, t) = ({b}, {t})",
                        mask.dims()
                    );
                }
            }
        }
        if let Some(transport) = &self.transport {
            let dh = d / h;
            if self.rope.is_some()
                || self.score_bias.is_some()
                || self.polar.is_some()
                || self.counts.is_some()
            {
                candle::bail!(
                    "fused attention: scores through a transport take neither a rotation, a \
                     score bias, polar scores nor gate counts"
                );
            }
            if transport.reflections().dims() != [b, h, t, dh + 1] {
                candle::bail!(
                    "fused attention: reflections {:?} do not match (b, h, t, d_head + 1) = \
                     ({b}, {h}, {t}, {})",
                    transport.reflections().dims(),
                    dh + 1
                );
            }
        }
        Ok(Dims {
            b,
            t,
            d,
            h,
            dh: d / h,
        })
    }

    fn fixed<T: Real>(&self) -> Result<Fixed<T>> {
        let host = |x: &Tensor| x.flatten_all()?.to_dtype(T::DTYPE)?.to_vec1::<T>();
        let (cos, sin, width, rope_rows, interleaved) = match &self.rope {
            Some((c, s, i)) => (host(c)?, host(s)?, c.dims()[2], c.dims()[0], *i),
            None => (Vec::new(), Vec::new(), 0, 1, false),
        };
        let (score_bias, bias_rows) = match self.bias_tensor() {
            Some(b) => (host(b)?, b.dims()[0]),
            None => (Vec::new(), 1),
        };
        let polar = match &self.polar {
            Some(polar) => {
                let ((cos, sin), offsets) = (polar.tables(), polar.offsets());
                Some(PolarFixed {
                    cos: host(cos)?,
                    sin: host(sin)?,
                    rows: cos.dims()[0],
                    cos_offset: host(&offsets.cos()?)?,
                    sin_offset: host(&offsets.sin()?)?,
                })
            }
            None => None,
        };
        let counts = match &self.counts {
            Some(counts) => {
                let tables = counts.tables();
                let real = match counts.mask() {
                    Some(m) => m
                        .flatten_all()?
                        .to_dtype(candle::DType::F32)?
                        .to_vec1::<f32>()?
                        .into_iter()
                        .map(|v| v > 0.0)
                        .collect(),
                    None => vec![true; self.key_bias.elem_count()],
                };
                Some(CountsFixed {
                    tables: host(tables)?,
                    tables_t: host(&tables.t()?.contiguous()?)?,
                    npos: counts.npos(),
                    real,
                })
            }
            None => None,
        };
        let transport = match &self.transport {
            Some(t) => Some(host(t.reflections())?),
            None => None,
        };
        Ok(Fixed {
            polar,
            counts,
            transport,
            key_bias: host(&self.key_bias)?,
            cos,
            sin,
            width,
            rope_rows,
            interleaved,
            score_bias,
            bias_rows,
            sided: self.sided(),
            scale: T::lit(self.scale),
            window: self.window,
            sticks: self.sticks,
            simd: self.simd,
        })
    }

    /// The fixed inputs, with what the caller `given` computed itself for an attention made
    /// without it (the fused layer's gates' running sums, or its reflections).
    fn fixed_with<T: Real>(&self, given: Given<'_, T>, n: Dims) -> Result<Fixed<T>> {
        let mut fixed = self.fixed::<T>()?;
        match given {
            Given::Nothing => {}
            Given::Sums(sums) => {
                if self.score_bias.is_some()
                    || self.own_scores()
                    || sums.len() != 2 * n.b * n.h * n.t
                {
                    candle::bail!(
                        "fused attention: {} running sums given for (2, b, h, t) = (2, {}, {}, \
                         {}), beside a score bias of its own: {}",
                        sums.len(),
                        n.b,
                        n.h,
                        n.t,
                        self.score_bias.is_some()
                    );
                }
                fixed.score_bias = sums.to_vec();
                fixed.sided = true;
            }
            Given::Reflections(r) => {
                let expected = n.b * n.h * n.t * (n.dh + 1);
                if self.score_bias.is_some()
                    || self.own_scores()
                    || self.rope.is_some()
                    || r.len() != expected
                {
                    candle::bail!(
                        "fused attention: {} reflection values given for (b, h, t, d_head + 1) = \
                         ({}, {}, {}, {}), beside a rotation, a score bias or scores of its own: {}",
                        r.len(),
                        n.b,
                        n.h,
                        n.t,
                        n.dh + 1,
                        self.rope.is_some() || self.score_bias.is_some() || self.own_scores()
                    );
                }
                fixed.transport = Some(r.to_vec());
            }
        }
        Ok(fixed)
    }

    /// The heads' outputs `(b, t, d)`; with `keep_probs`, also the attention weights before
    /// dropout (`b h t²` values, else none), for [`Attention::backward`]. `given`: what the
    /// caller computed itself ([`Given`]), for an attention made without it.
    pub(super) fn forward<T: Real>(
        &self,
        qkv: &[T],
        mask: Option<&[T]>,
        given: Given<'_, T>,
        n: Dims,
        keep_probs: bool,
    ) -> Result<(Vec<T>, Vec<T>)> {
        let fixed = self.fixed_with::<T>(given, n)?;
        let gathered = fixed.gathered(n);
        let scores = fixed.scores();
        let (tt, per) = (n.t * n.t, self.kept_per_head(n));
        let one_task =
            |w: &mut Scratch<T>, task: usize, dst: Shared<T>, probs: Option<Shared<T>>| {
                let (bi, hd) = (task / n.h, task % n.h);
                let heads = w.heads(qkv, n, bi, hd, &fixed);
                // SAFETY: block `task` of the (b h, per) buffer is this task's alone, and
                // nothing reads it before it is written here.
                let block = probs.map(|probs| unsafe {
                    std::slice::from_raw_parts_mut(
                        probs.ptr().add(task * per) as *mut MaybeUninit<T>,
                        per,
                    )
                });
                // The weights first; gate-counted scores' content scores and table products
                // after them, copied once the weights are made.
                let (kept, rest) = match block {
                    Some(block) => {
                        let (kept, rest) = block.split_at_mut(tt);
                        (Some(kept), Some(rest))
                    }
                    None => (None, None),
                };
                // The weights go straight into the kept block, unless dropout is to change them
                // after: then they are computed here and copied.
                let p: &[T] = match (kept, mask) {
                    (Some(kept), None) => {
                        w.probabilities(heads, (n, bi, hd), &fixed, Some(&mut *kept));
                        // SAFETY: probabilities wrote every value of the block.
                        unsafe { &*assume_written(kept) }
                    }
                    (kept, mask) => {
                        w.probabilities(heads, (n, bi, hd), &fixed, None);
                        if let Some(kept) = kept {
                            for (k, p) in kept.iter_mut().zip(&w.p) {
                                k.write(*p);
                            }
                        }
                        if let Some(m) = mask {
                            for (p, mi) in w.p.iter_mut().zip(&m[task * tt..(task + 1) * tt]) {
                                *p *= *mi;
                            }
                        }
                        &w.p
                    }
                };
                if let Some(rest) = rest {
                    let from = w.a.iter().chain(&w.r);
                    for (k, v) in rest.iter_mut().zip(from) {
                        k.write(*v);
                    }
                }
                // SAFETY: out (b, t, d) gets rows t x dh of this (batch, head) block, which no
                // other task writes; p is t x t (0 outside a causal band), v a t x dh operand.
                unsafe {
                    let out = dst.ptr().add(bi * n.t * n.d + hd * n.dh);
                    let p = View::rows(p.as_ptr(), n.t);
                    let (band, pack) = ((fixed.band(n), true), (fixed.simd, &mut w.pack[..]));
                    banded_sums((n.t, n.dh), out, n.d, p, heads.v, T::one(), band, pack)
                }
            };
        let run = |dst: *mut T, probs: Option<*mut T>| {
            let (dst, probs) = (Shared(dst), probs.map(Shared));
            (0..n.b * n.h).into_par_iter().for_each_init(
                || Scratch::<T>::new(n, gathered, (mask.is_some(), false, false), scores),
                |w, task| one_task(w, task, dst, probs),
            )
        };
        // SAFETY (both): the (batch, head) tasks together write every value of the output (the
        // heads' columns side by side, all rows) and every (t, t) block of the weights; nothing
        // reads either before.
        let (out, probs) = if keep_probs {
            let mut out = Vec::new();
            let probs = unsafe {
                written(n.b * n.h * per, |probs| {
                    out = written(n.b * n.t * n.d, |dst| run(dst, Some(probs)));
                })
            };
            (out, probs)
        } else {
            (
                unsafe { written(n.b * n.t * n.d, |dst| run(dst, None)) },
                Vec::new(),
            )
        };
        Ok((out, probs))
    }

    /// `d(qkv)` from `d(out)`, and the score bias's gradient when one is owed (see
    /// [`Attention::bias_grad_len`]; always for what was [`Given`]: the running sums' or the
    /// reflections'); the attention weights are recomputed unless `probs` (from
    /// [`Attention::forward`]) has them.
    pub(super) fn backward<T: Real>(
        &self,
        qkv: &[T],
        mask: Option<&[T]>,
        given: Given<'_, T>,
        probs: Option<&[T]>,
        g: &[T],
        n: Dims,
    ) -> Result<(Vec<T>, Vec<T>)> {
        let fixed = self.fixed_with::<T>(given, n)?;
        let gathered = fixed.gathered(n);
        let (row, tt, per) = (3 * n.d, n.t * n.t, self.kept_per_head(n));
        if let Some(p) = probs {
            if p.len() != n.b * n.h * per {
                candle::bail!("fused attention backward: {} saved values for (b, h) = ({}, {}) blocks of {per}", p.len(), n.b, n.h);
            }
        }
        // When the score bias is owed a gradient: dS of every (batch, head) for a table, or the
        // running sums' gradient `(2, b, h, t)` for sums; when polar offsets are, theirs of
        // every (batch, head) `(b, h, d_head)`.
        // When count tables are, theirs of every (batch, head) `(b, h, 2 npos, d_head)`.
        let polar_grad = fixed.polar.is_some() && self.bias_needs_grad();
        let npos = fixed.counts.as_ref().map_or(0, |c| c.npos);
        let counts_grad = npos > 0 && self.bias_needs_grad();
        let carried = fixed.transport.is_some();
        let transport_grad =
            carried && (self.bias_needs_grad() || matches!(given, Given::Reflections(_)));
        let bias_grad =
            (!self.own_scores() && self.bias_needs_grad()) || matches!(given, Given::Sums(_));
        let sided = fixed.sided;
        let refl = n.t * (n.dh + 1);
        let mut ds_all = zeros::<T>(match (bias_grad, sided) {
            _ if polar_grad => n.b * n.h * n.dh,
            _ if counts_grad => n.b * n.h * 2 * npos * n.dh,
            _ if transport_grad => n.b * n.h * refl,
            (false, _) => 0,
            (true, false) => n.b * n.h * tt,
            (true, true) => 2 * n.b * n.h * n.t,
        });
        let ds_dst = Shared(ds_all.as_mut_ptr());
        let tasks = |dst: Shared<T>| {
            (0..n.b * n.h).into_par_iter().for_each_init(
                || Scratch::<T>::new(n, gathered, (mask.is_some(), true, sided), fixed.scores()),
                |w, task| {
                    let (bi, hd) = (task / n.h, task % n.h);
                    let heads = w.heads(qkv, n, bi, hd, &fixed);
                    // The weights, and gate-counted scores' content scores and table products:
                    // kept by the forward, or recomputed.
                    let (p, (a, r)): (&[T], (&[T], &[T])) = match probs {
                        Some(probs) => {
                            let (p, rest) = probs[task * per..(task + 1) * per].split_at(tt);
                            (p, rest.split_at(rest.len().min(tt)))
                        }
                        None => {
                            w.probabilities(heads, (n, bi, hd), &fixed, None);
                            (&w.p, (&w.a, &w.r))
                        }
                    };
                    let dout = View::rows(g[bi * n.t * n.d + hd * n.dh..].as_ptr(), n.d);
                    let m = mask.map(|m| &m[task * tt..(task + 1) * tt]);
                    if let Some(m) = m {
                        for ((pm, p), mi) in w.pm.iter_mut().zip(p).zip(m) {
                            *pm = *p * *mi;
                        }
                    }
                    let pm = if m.is_some() { &w.pm } else { p };
                    let block = bi * n.t * row + hd * n.dh;
                    let one = T::one();
                    // Under a causal mask, only each band's pairs (P is 0 after the query).
                    let band = fixed.band(n);
                    // SAFETY (all products): the scratch buffers and views have the shapes named;
                    // the destination blocks of dqkv (b, t, 3d) belong to this (batch, head) alone.
                    unsafe {
                        // dv = (P ⊙ M)ᵀ dout; dP = dout vᵀ
                        let pmt = View::rows(pm.as_ptr(), n.t).t();
                        let dv = dst.ptr().add(block + 2 * n.d);
                        let pack = (fixed.simd, &mut w.pack[..]);
                        banded_sums((n.t, n.dh), dv, row, pmt, dout, one, (band, false), pack);
                        let pack = (fixed.simd, &mut w.pack[..]);
                        let (dp, v) = (w.dp.as_mut_ptr(), heads.v.t());
                        banded_scores((n.t, n.dh), dp, n.t, dout, v, one, band, pack);
                    }
                    if let Some(m) = m {
                        for (dp, mi) in w.dp.iter_mut().zip(m) {
                            *dp *= *mi;
                        }
                    }
                    match (fixed.sticks_head(n, bi, hd), band) {
                        // Recomputed (never kept): the scores are in `w.s`.
                        (Some(head), _) => head.grad(fixed.simd, &w.s, &w.dp, &mut w.ds),
                        (None, Some(_)) => {
                            causal_softmax_grad_rows(fixed.simd, p, &w.dp, n.t, &mut w.ds)
                        }
                        (None, None) => softmax_grad_rows(fixed.simd, p, &w.dp, n.t, &mut w.ds),
                    }
                    if let Some(c) = &fixed.counts {
                        // dS of the scores a + z into da, in place, and dR of the rows'
                        // table products.
                        let rows = counts::Rows {
                            a,
                            r,
                            real: &c.real[bi * n.t..(bi + 1) * n.t],
                            npos,
                        };
                        counts::backward_rows(fixed.simd, rows, &mut w.ds, &mut w.dr, &mut w.rows);
                    }
                    if bias_grad && sided {
                        sided_grad(fixed.simd, &w.ds, n.t, &mut w.dfg);
                        let half = n.b * n.h * n.t;
                        for (part, sums) in w.dfg.chunks_exact(n.t).enumerate() {
                            // SAFETY: row `task` of each half of the (2, b h, t) buffer is this
                            // task's alone.
                            unsafe {
                                std::slice::from_raw_parts_mut(
                                    ds_dst.ptr().add(part * half + task * n.t),
                                    n.t,
                                )
                            }
                            .copy_from_slice(sums);
                        }
                    } else if bias_grad {
                        // SAFETY: block `task` of the (b h, t, t) buffer is this task's alone.
                        unsafe { std::slice::from_raw_parts_mut(ds_dst.ptr().add(task * tt), tt) }
                            .copy_from_slice(&w.ds);
                    }
                    if let Some(head) = fixed.transport_head((n, bi, hd), (&w.q, &w.k)) {
                        // dq, dk and the reflections' gradient by undoing the walks, then dq
                        // and dk into dqkv.
                        let grads = (&mut w.dq[..], &mut w.dk[..], &mut w.drefl[..]);
                        transport::backward(fixed.simd, head, &w.ds, grads, &mut w.carried);
                        // SAFETY: the q and k blocks of dqkv (b, t, 3d) written belong to this
                        // (batch, head) alone; dq and dk are t x dh.
                        unsafe {
                            scatter(&w.dq, n.dh, dst.ptr().add(block), row, None);
                            scatter(&w.dk, n.dh, dst.ptr().add(block + n.d), row, None);
                        }
                        if transport_grad {
                            // SAFETY: row `task` of the (b h, t (d_head + 1)) buffer is this
                            // task's alone.
                            unsafe {
                                std::slice::from_raw_parts_mut(ds_dst.ptr().add(task * refl), refl)
                            }
                            .copy_from_slice(&w.drefl);
                        }
                        return;
                    }
                    let ds = View::rows(w.ds.as_ptr(), n.t);
                    if let Some(polar) = &fixed.polar {
                        // dq' = c dS k', dk' = c dSᵀ q' (t, 2 d_head), then back through the
                        // polar forms into dqkv, and the offsets' gradient from dk'.
                        let (w2, simd) = (2 * n.dh, fixed.simd);
                        let ph = polar.head(n, bi, hd);
                        let rows = |at: usize| &qkv[at..at + (n.t - 1) * row + n.dh];
                        w.doffsets.fill(T::zero());
                        // SAFETY: the scratch buffers are t x 2 d_head; the blocks of dqkv
                        // (b, t, 3d) written belong to this (batch, head) alone.
                        unsafe {
                            let pack = Some((simd, &mut w.pack[..]));
                            product(
                                (n.t, w2, n.t),
                                w.dq.as_mut_ptr(),
                                w2,
                                ds,
                                heads.k,
                                fixed.scale,
                                pack,
                            );
                            let pack = Some((simd, &mut w.pack[..]));
                            product(
                                (n.t, w2, n.t),
                                w.dk.as_mut_ptr(),
                                w2,
                                ds.t(),
                                heads.q,
                                fixed.scale,
                                pack,
                            );
                            let head = |at: usize, key| PolarRows {
                                x: rows(at),
                                stride: row,
                                polar: ph,
                                key,
                            };
                            let (dq, dk) = ((&w.dq[..], &w.q[..]), (&w.dk[..], &w.k[..]));
                            polar_scatter(
                                simd,
                                head(block, false),
                                dq,
                                dst.ptr().add(block),
                                &mut [],
                            );
                            let at = dst.ptr().add(block + n.d);
                            polar_scatter(simd, head(block + n.d, true), dk, at, &mut w.doffsets);
                        }
                        if polar_grad {
                            // SAFETY: row `task` of the (b h, d_head) buffer is this task's.
                            unsafe {
                                std::slice::from_raw_parts_mut(ds_dst.ptr().add(task * n.dh), n.dh)
                            }
                            .copy_from_slice(&w.doffsets);
                        }
                        return;
                    }
                    // dq = c dS k, dk = c dSᵀ q: straight into dqkv, or rotated back first.
                    let back = fixed.rotation(-one, bi, n.t);
                    let simd = fixed.simd;
                    // SAFETY: the blocks of dqkv (b, t, 3d) written belong to this (batch,
                    // head) alone; the scratch buffers are t x dh.
                    unsafe {
                        let (dq_at, dk_at, rs) = match back {
                            None => (dst.ptr().add(block), dst.ptr().add(block + n.d), row),
                            Some(_) => (w.dq.as_mut_ptr(), w.dk.as_mut_ptr(), n.dh),
                        };
                        let (td, c) = ((n.t, n.dh), fixed.scale);
                        let pack = (simd, &mut w.pack[..]);
                        banded_sums(td, dq_at, rs, ds, heads.k, c, (band, true), pack);
                        let pack = (simd, &mut w.pack[..]);
                        banded_sums(td, dk_at, rs, ds.t(), heads.q, c, (band, false), pack);
                        if let Some(back) = back {
                            scatter(&w.dq, n.dh, dst.ptr().add(block), row, Some(back));
                            scatter(&w.dk, n.dh, dst.ptr().add(block + n.d), row, Some(back));
                        }
                    }
                    if let Some(c) = &fixed.counts {
                        // dq += dR E; the tables' gradient of this (batch, head) is dRᵀ q.
                        let w2 = 2 * npos;
                        let dr = View::rows(w.dr.as_ptr(), w2);
                        // SAFETY: dr is t x 2 npos, the tables 2 npos x d_head, dq t x d_head;
                        // the q block of dqkv and row `task` of the (b h, 2 npos d_head) buffer
                        // are this (batch, head)'s alone.
                        unsafe {
                            let tables = View::rows(c.tables.as_ptr(), n.dh);
                            let pack = Some((simd, &mut w.pack[..]));
                            product(
                                (n.t, n.dh, w2),
                                w.dq.as_mut_ptr(),
                                n.dh,
                                dr,
                                tables,
                                one,
                                pack,
                            );
                            for (i, add) in w.dq.chunks_exact(n.dh).enumerate() {
                                let at = dst.ptr().add(block + i * row);
                                for (m, v) in add.iter().enumerate() {
                                    *at.add(m) += *v;
                                }
                            }
                            if counts_grad {
                                let at = ds_dst.ptr().add(task * w2 * n.dh);
                                let pack = Some((simd, &mut w.pack[..]));
                                product((w2, n.dh, n.t), at, n.dh, dr.t(), heads.q, one, pack);
                            }
                        }
                    }
                },
            );
        };
        // SAFETY: the (batch, head) tasks together write all of dqkv (each its q, k and v
        // columns, every row), and nothing reads it before.
        let dqkv = unsafe { written(n.b * n.t * row, |dst| tasks(Shared(dst))) };
        // The polar offsets, and a bias shared by the batch: their gradient sums the batch's;
        // the count tables, shared by the heads too, sum every (batch, head)'s.
        let dbias = if counts_grad {
            batch_sum(&ds_all, n.b * n.h)
        } else if polar_grad || (bias_grad && !sided && fixed.bias_rows == 1) {
            batch_sum(&ds_all, n.b)
        } else {
            ds_all
        };
        Ok((dqkv, dbias))
    }
}

fn check_mask(l: &Layout, n: Dims) -> Result<()> {
    if l.dims() != [n.b, n.h, n.t, n.t] {
        candle::bail!(
            "fused attention: dropout mask {:?} is not (b, h, t, t) = ({}, {}, {}, {})",
            l.dims(),
            n.b,
            n.h,
            n.t,
            n.t
        );
    }
    Ok(())
}

/// The attention core as a candle op on `(qkv, dropout mask, score bias)`, the last two empty
/// when absent.
impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "poslab-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        _s3: &CpuStorage,
        _l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let n = self.dims(l1)?;
        let masked = !is_absent(l2);
        if masked {
            check_mask(l2, n)?;
        }
        let what = "attention";
        let storage = by_dtype!(s1.dtype(), what, |T| self
            .forward::<T>(
                contiguous(s1, l1, what)?,
                if masked {
                    Some(contiguous(s2, l2, what)?)
                } else {
                    None
                },
                Given::Nothing,
                n,
                false
            )?
            .0);
        Ok((storage, Shape::from((n.b, n.t, n.d))))
    }

    fn bwd(
        &self,
        qkv: &Tensor,
        mask: &Tensor,
        bias: &Tensor,
        _out: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let flat = qkv.apply_op3_no_bwd(mask, &g.contiguous()?, &AttentionGrad(self.clone()))?;
        let nq = qkv.elem_count();
        let dqkv = flat.narrow(0, 0, nq)?.reshape(qkv.shape())?;
        let dbias = match self.bias_grad_len() {
            0 => None,
            len => Some(flat.narrow(0, nq, len)?.reshape(bias.shape())?),
        };
        Ok((Some(dqkv), None, dbias))
    }
}

/// `[d(qkv); d(score bias)]` flattened, from `(qkv, mask or empty, d(out))`.
struct AttentionGrad(Attention);

impl CustomOp3 for AttentionGrad {
    fn name(&self) -> &'static str {
        "poslab-attention-grad"
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
        let n = self.0.dims(l1)?;
        let masked = !is_absent(l2);
        if masked {
            check_mask(l2, n)?;
        }
        let what = "attention backward";
        let len = l1.shape().elem_count() + self.0.bias_grad_len();
        let storage = by_dtype!(s1.dtype(), what, |T| {
            let (mut dqkv, dbias) = self.0.backward::<T>(
                contiguous(s1, l1, what)?,
                if masked {
                    Some(contiguous(s2, l2, what)?)
                } else {
                    None
                },
                Given::Nothing,
                None,
                contiguous(s3, l3, what)?,
                n,
            )?;
            dqkv.extend_from_slice(&dbias);
            dqkv
        });
        Ok((storage, Shape::from(len)))
    }
}

/// Multi-head attention from packed projections, fused (CPU, f32/f64).
///
/// # Shapes
/// - `qkv`: `(b, t, 3 d_model)`, `[q | k | v]` with heads side by side in each
/// - `op`: the fixed inputs (see [`Attention::new`])
/// - `dropout_mask`: `(b, h, t, t)` multipliers of the attention weights, or none
/// - returns `(b, t, d_model)`
pub fn attention(qkv: &Tensor, op: Attention, dropout_mask: Option<&Tensor>) -> Result<Tensor> {
    let qkv = qkv.contiguous()?;
    let op = op.without_offsets()?;
    let mask = match dropout_mask {
        Some(m) => m.contiguous()?,
        None => absent(&qkv)?,
    };
    let bias = op.score_bias_input(&qkv)?;
    qkv.apply_op3(&mask, &bias, op)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{key_padding_bias, LayerBias};

    /// Values in [-1, 1) from a fixed linear congruential sequence.
    fn values<T: Real>(len: usize, seed: u64) -> Vec<T> {
        crate::testing::uniform(len, seed)
            .map(|u| T::lit(u * 2.0 - 1.0))
            .collect()
    }

    /// `len` values of [`values`] (`seed`) as a CPU tensor of `dims` in `dtype`.
    fn tensor(len: usize, seed: u64, dims: &[usize], dtype: candle::DType) -> Tensor {
        Tensor::from_vec(values::<f64>(len, seed), dims, &candle::Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    }

    fn bits_agree<T: Real>() {
        // Head shapes (t x t x d_head and t x d_head x t), ragged tiles, a long depth; the
        // left operand in rows of a wider buffer (as q in qkv), the right one in rows or
        // transposed (as kᵀ and vᵀ, which the tiles pack first).
        // And products 8 wide (P v and its kin) over more rows and depths, whole tiles and
        // ragged ones.
        for (m, n, k) in [
            (64, 64, 8),
            (64, 8, 64),
            (17, 23, 5),
            (33, 9, 40),
            (20, 20, 256),
            (100, 16, 3),
            (48, 8, 3),
            (70, 8, 37),
            (128, 8, 128),
            (40, 8, 256),
            // Ragged for the AVX-512 kernels: rows past whole tiles of 32, 16 and 4, columns
            // past whole vectors of 32 and 16.
            (37, 8, 64),
            (50, 8, 11),
            (35, 8, 7),
            (50, 40, 8),
            (7, 72, 8),
            (19, 17, 6),
        ] {
            assert!(gemm_sums_in_order((m, n, k)));
            let lhs_rs = k + 3;
            let lhs = values::<T>(m * lhs_rs + k * (m + 3), 1);
            let rhs = values::<T>(k * n + n * k, 2);
            let scale = T::lit(0.353_553_390_593_273_8);
            // The left operand in rows (as P, dS) or transposed, its rows adjacent (as Pᵀ, dSᵀ).
            for (transposed, lhs_transposed) in [(false, false), (true, false), (false, true)] {
                let rhs_view = if transposed {
                    View::rows(rhs.as_ptr(), k).t()
                } else {
                    View::rows(rhs.as_ptr(), n)
                };
                let run = |small: Option<SimdLevel>| {
                    let mut dst = vec![T::zero(); m * (n + 1)];
                    let mut pack = vec![T::zero(); k * n];
                    let lhs = if lhs_transposed {
                        // its columns in rows of m + 3
                        View::rows(lhs.as_ptr(), m + 3).t()
                    } else {
                        View::rows(lhs.as_ptr(), lhs_rs)
                    };
                    let d = dst.as_mut_ptr();
                    // SAFETY: dst m rows of n + 1, lhs m x k in rows of lhs_rs, rhs k x n in
                    // rows of n or (transposed) columns of k; pack k x n; gemm_sums_in_order holds.
                    unsafe {
                        match small {
                            Some(simd) => {
                                tiled((m, n, k), d, n + 1, lhs, rhs_view, scale, simd, &mut pack)
                            }
                            None => product((m, n, k), d, n + 1, lhs, rhs_view, scale, None),
                        }
                    };
                    dst
                };
                let gemm = run(None);
                assert!(gemm.iter().any(|v| *v != T::zero()));
                for level in [SimdLevel::Baseline, SimdLevel::Avx2, SimdLevel::Avx512] {
                    let tiled = run(Some(level));
                    let differ = gemm.iter().zip(&tiled).filter(|(a, b)| a != b).count();
                    assert_eq!(
                        differ, 0,
                        "{m} x {n} x {k} (rhs transposed: {transposed}, lhs: {lhs_transposed}) at {level:?}: {differ} values differ from gemm's"
                    );
                }
            }
        }
    }

    #[test]
    fn tiled_head_products_give_gemms_bits_at_every_level() {
        bits_agree::<f32>();
        bits_agree::<f64>();
    }

    /// The output and every gradient of attention on random inputs with the bias of `sums`
    /// `(2, b, h, t)` given as sums or as their two-sided differences' table.
    fn with_sided_bias(
        dtype: candle::DType,
        sided: bool,
        (b, t, h, dh): (usize, usize, usize, usize),
        simd: SimdLevel,
    ) -> Vec<Vec<f64>> {
        use candle::{Device, Var};
        let tensor = |len: usize, seed: u64, dims: &[usize]| tensor(len, seed, dims, dtype);
        let d = h * dh;
        let qkv = Var::from_tensor(&tensor(b * t * 3 * d, 11, &[b, t, 3 * d])).unwrap();
        // Running sums of per-token values at most 0, as FoX's are.
        let steps = (tensor(2 * b * h * t, 12, &[2, b, h, t]) - 1.0).unwrap() * 0.5;
        let sums = Var::from_tensor(&steps.unwrap().cumsum(3).unwrap()).unwrap();
        // The last keys of batch element 0 padded.
        let mut mask = vec![1u32; b * t];
        mask[t - 3..t].fill(0);
        let mask = Tensor::from_vec(mask, (b, t), &Device::Cpu).unwrap();
        let key_bias = key_padding_bias(&mask, dtype).unwrap();
        let bias = if sided {
            LayerBias::SidedSums(sums.as_tensor().clone())
        } else {
            // The table of the sums' two-sided differences, (b, h, t, t).
            let f = sums.get(0).unwrap().reshape((b * h, t)).unwrap();
            let g = sums.get(1).unwrap().reshape((b * h, t)).unwrap();
            let table = super::super::sided_differences(&f, &g, simd).unwrap();
            LayerBias::Table(table.reshape((b, h, t, t)).unwrap())
        };
        let op = Attention::new(h, 0.5, &key_bias, None, Some(bias), Window::ALL, simd);
        let out = attention(qkv.as_tensor(), op, None).unwrap();
        let r = tensor(b * t * d, 13, &[b, t, d]);
        let grads = (&out * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let flat = |x: &Tensor| -> Vec<f64> {
            let x = x
                .flatten_all()
                .unwrap()
                .to_dtype(candle::DType::F64)
                .unwrap();
            x.to_vec1().unwrap()
        };
        vec![
            flat(&out),
            flat(grads.get(qkv.as_tensor()).unwrap()),
            flat(grads.get(sums.as_tensor()).unwrap()),
        ]
    }

    /// d(qkv) and the score bias's gradient from the weights the forward kept, and from the
    /// weights the backward recomputes.
    /// With `counted`, gate-counted scores (tables of 5 rows, a gradient owed) in place of the
    /// score bias and RoPE; with `carried`, scores through a transport (a gradient owed).
    fn kept_and_recomputed<T: Real>(
        level: SimdLevel,
        rope: bool,
        (counted, carried): (bool, bool),
    ) -> [Vec<T>; 4] {
        use candle::Device;
        let (b, t, h, dh) = (2, 37, 3, 8);
        let (d, tt) = (h * dh, t * t);
        let dtype = T::DTYPE;
        let tensor = |len: usize, seed: u64, dims: &[usize]| tensor(len, seed, dims, dtype);
        let mut padding = vec![1u32; b * t];
        padding[t - 4..t].fill(0);
        let padding = Tensor::from_vec(padding, (b, t), &Device::Cpu).unwrap();
        let key_bias = key_padding_bias(&padding, dtype).unwrap();
        // A trained score bias (its gradient is owed), and RoPE's tables on half of each head.
        let bias = candle::Var::from_tensor(&tensor(h * tt, 21, &[1, h, t, t])).unwrap();
        let rotary = rope.then(|| {
            let angles = (tensor(t * dh / 2, 22, &[1, t, dh / 2]) * 3.0).unwrap();
            crate::spec::RopeTables {
                cos: angles.cos().unwrap(),
                sin: angles.sin().unwrap(),
                interleaved: false,
            }
        });
        let op = Attention {
            simd: level,
            ..Attention::new(
                h,
                0.35,
                &key_bias,
                rotary,
                Some(LayerBias::Table(bias.as_tensor().clone())),
                Window::ALL,
                SimdLevel::detected(),
            )
        };
        let op = match (counted, carried) {
            (false, false) => op,
            (_, true) => {
                let w =
                    candle::Var::from_tensor(&tensor(b * h * t * dh, 27, &[b, h, t, dh])).unwrap();
                let beta = (tensor(b * h * t, 28, &[b, h, t]) + 1.0).unwrap();
                let beta = candle::Var::from_tensor(&beta).unwrap();
                let beta = beta.as_tensor().unsqueeze(3).unwrap();
                let transport = crate::spec::Reflected {
                    reflections: Tensor::cat(&[w.as_tensor(), &beta], 3).unwrap(),
                };
                let plain = Attention::new(
                    h,
                    0.35,
                    &key_bias,
                    None,
                    None,
                    Window::ALL,
                    SimdLevel::detected(),
                );
                Attention {
                    simd: level,
                    ..plain.with_transport(Some(transport))
                }
            }
            (true, false) => {
                let table =
                    |seed| candle::Var::from_tensor(&tensor(5 * dh, seed, &[5, dh])).unwrap();
                let (left, right) = (table(25), table(26));
                let counts = crate::spec::CountTables {
                    tables: Tensor::cat(&[left.as_tensor(), right.as_tensor()], 0).unwrap(),
                    mask: Some(padding.clone()),
                };
                let plain = Attention::new(
                    h,
                    0.35,
                    &key_bias,
                    None,
                    None,
                    Window::ALL,
                    SimdLevel::detected(),
                );
                Attention {
                    simd: level,
                    ..plain.with_counts(Some(counts))
                }
            }
        };
        let n = op.dims_of(b, t, 3 * d).unwrap();
        let qkv = values::<T>(b * t * 3 * d, 23);
        // An attention-dropout mask: every fourth weight dropped, the rest scaled.
        let mask: Vec<T> = (0..b * h * tt)
            .map(|i| {
                if i % 4 == 1 {
                    T::zero()
                } else {
                    T::lit(4.0 / 3.0)
                }
            })
            .collect();
        let g = values::<T>(b * t * d, 24);
        let (_, probs) = op
            .forward(&qkv, Some(&mask), Given::Nothing, n, true)
            .unwrap();
        let per = if counted { 2 * tt + t * 10 } else { tt };
        assert_eq!(probs.len(), b * h * per);
        let (dqkv_kept, dbias_kept) = op
            .backward(&qkv, Some(&mask), Given::Nothing, Some(&probs), &g, n)
            .unwrap();
        let (dqkv, dbias) = op
            .backward(&qkv, Some(&mask), Given::Nothing, None, &g, n)
            .unwrap();
        [dqkv_kept, dqkv, dbias_kept, dbias]
    }

    #[test]
    fn the_backward_gives_the_same_bits_from_kept_or_recomputed_weights() {
        // The fused layer keeps the weights only while they are small (`keeps_weights`), so
        // training runs both ways; either way the gradients must be the same, bit for bit. With
        // a score bias and RoPE, gate-counted scores (their kept content scores and table
        // products too), or scores through a transport (whose forward, run again in the
        // backward, shares its task's work space with the backward's walk).
        fn check<T: Real>() {
            for level in [SimdLevel::Baseline, SimdLevel::Avx2, SimdLevel::Avx512] {
                for (rope, own) in [
                    (false, (false, false)),
                    (true, (false, false)),
                    (false, (true, false)),
                    (false, (false, true)),
                ] {
                    let [dqkv_kept, dqkv, dbias_kept, dbias] =
                        kept_and_recomputed::<T>(level, rope, own);
                    let what = format!("{level:?} rope {rope} (counted, carried) {own:?}");
                    assert!(dqkv.iter().any(|v| *v != T::zero()) && !dbias.is_empty());
                    assert!(dqkv_kept == dqkv, "{what}: d(qkv) differs");
                    assert!(dbias_kept == dbias, "{what}: d(bias) differs");
                }
            }
        }
        check::<f32>();
        check::<f64>();
    }

    #[test]
    fn weights_are_kept_below_the_allocators_mapping_threshold() {
        use candle::{DType, Device};
        let key_bias = Tensor::zeros((64, 128), DType::F32, &Device::Cpu).unwrap();
        let op = Attention::new(
            8,
            0.35,
            &key_bias,
            None,
            None,
            Window::ALL,
            SimdLevel::detected(),
        );
        // 64 x 8 x 128 x 128 f32 values are 32 MiB exactly: recomputed. One head fewer is kept.
        let n = op.dims_of(64, 128, 3 * 64).unwrap();
        assert!(!op.keeps_weights::<f32>(n));
        assert!(op.keeps_weights::<f32>(Dims { h: 7, ..n }));
        assert!(!op.keeps_weights::<f64>(Dims { h: 4, ..n }));
        assert!(op.keeps_weights::<f32>(Dims { t: 64, ..n }));
        // Sizes past usize saturate: not kept.
        assert!(!op.keeps_weights::<f32>(Dims { b: usize::MAX, ..n }));
    }

    #[test]
    fn a_bias_of_running_sums_gives_the_tables_bits_forward_and_backward() {
        // Built in the task and reduced there, the sums' bias gives what the materialised
        // table gives, bit for bit: the output, d(qkv) and the sums' gradient (through the
        // two-sided differences' backward on the table's path), at every instruction set
        // level and for a length that is not a multiple of the kernels' blocks.
        for dtype in [candle::DType::F32, candle::DType::F64] {
            for level in [SimdLevel::Baseline, SimdLevel::Avx2, SimdLevel::Avx512] {
                for shape in [(3, 13, 2, 4), (2, 64, 3, 8)] {
                    {
                        let table = with_sided_bias(dtype, false, shape, level);
                        let sided = with_sided_bias(dtype, true, shape, level);
                        for (i, what) in ["output", "d(qkv)", "d(sums)"].iter().enumerate() {
                            assert!(table[i].iter().any(|v| *v != 0.0), "{what}: all zero");
                            assert_eq!(
                                sided[i], table[i],
                                "{dtype:?} {level:?} {shape:?}: {what} differs"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// One of the attention core's per-head matrix products, for each (batch, head).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HeadProduct {
    /// `S = c q kᵀ`: `t x t x d_head`.
    Scores,
    /// `out = P v`: `t x d_head x t`.
    Outputs,
    /// `dP = dout vᵀ`: `t x t x d_head`.
    ProbsGradient,
    /// `dv = Pᵀ dout`: `t x d_head x t`.
    ValuesGradient,
    /// `dq = c dS k`: `t x d_head x t`.
    QueriesGradient,
    /// `dk = c dSᵀ q`: `t x d_head x t`.
    KeysGradient,
}

impl HeadProduct {
    /// Every one, in the order a training step runs them.
    pub const ALL: [HeadProduct; 6] = [
        HeadProduct::Scores,
        HeadProduct::Outputs,
        HeadProduct::ProbsGradient,
        HeadProduct::ValuesGradient,
        HeadProduct::QueriesGradient,
        HeadProduct::KeysGradient,
    ];

    /// One head's `(m, n, k)` at `t` tokens and heads `d_head` wide.
    pub fn dims(self, t: usize, d_head: usize) -> (usize, usize, usize) {
        match self {
            HeadProduct::Scores | HeadProduct::ProbsGradient => (t, t, d_head),
            _ => (t, d_head, t),
        }
    }
}

/// The best rate, in GFLOP/s, of `reps` runs of one of the attention core's per-head products
/// over every (batch, head) of `(b, h, t, d_head)`, as the core computes it: one task per head
/// on the current rayon pool, the operands where the core finds them (q, k and v in the packed
/// `(b, t, 3d)` projections, the output's gradient in `(b, t, d)` rows, `P` and `dS` as `t x t`
/// blocks), the outputs where it writes them, and register tiles or gemm as
/// the core chooses (f32, without RoPE). `poslab bench --products` sets these beside
/// PyTorch's batched products.
pub fn head_product_gflops(
    which: HeadProduct,
    (b, h, t, dh): (usize, usize, usize, usize),
    reps: usize,
    simd: SimdLevel,
) -> f64 {
    let (d, tt) = (h * dh, t * t);
    let row = 3 * d;
    let (qkv, g, p) = (
        timing_operand(b * t * row, 1),
        timing_operand(b * t * d, 2),
        timing_operand(b * h * tt, 3),
    );
    let mut out = zeros::<f32>(b * t * row);
    let dst = Shared(out.as_mut_ptr());
    let scale = 0.35f32;
    let gflop = 2.0 * (b * h * tt * dh) as f64 / 1e9;
    let rate = best_rate(gflop, reps, || {
        (0..b * h).into_par_iter().for_each_init(
            || (zeros::<f32>(t * t.max(dh)), zeros::<f32>(tt)),
            |(pack, s), task| {
                let (bi, hd) = (task / h, task % h);
                let base = bi * t * row + hd * dh;
                let q = View::rows(qkv[base..].as_ptr(), row);
                let k = View::rows(qkv[base + d..].as_ptr(), row);
                let v = View::rows(qkv[base + 2 * d..].as_ptr(), row);
                let dout = View::rows(g[bi * t * d + hd * dh..].as_ptr(), d);
                let pm = View::rows(p[task * tt..].as_ptr(), t);
                let small = Some((simd, &mut pack[..]));
                let dims = which.dims(t, dh);
                // SAFETY: every view is a t x dh or t x t operand inside its buffer; the t x dh
                // outputs go to this (batch, head)'s own block of `out` ((b, t, d) rows for the
                // output, (b, t, 3d) for the gradients), the t x t ones to the task's scratch.
                unsafe {
                    match which {
                        HeadProduct::Scores => {
                            product(dims, s.as_mut_ptr(), t, q, k.t(), scale, small)
                        }
                        HeadProduct::Outputs => {
                            let at = dst.ptr().add(bi * t * d + hd * dh);
                            product(dims, at, d, pm, v, 1.0, small)
                        }
                        HeadProduct::ProbsGradient => {
                            product(dims, s.as_mut_ptr(), t, dout, v.t(), 1.0, small)
                        }
                        HeadProduct::ValuesGradient => {
                            let at = dst.ptr().add(base + 2 * d);
                            product(dims, at, row, pm.t(), dout, 1.0, small)
                        }
                        HeadProduct::QueriesGradient => {
                            product(dims, dst.ptr().add(base), row, pm, k, scale, small)
                        }
                        HeadProduct::KeysGradient => {
                            product(dims, dst.ptr().add(base + d), row, pm.t(), q, scale, small)
                        }
                    }
                }
                std::hint::black_box(&s);
            },
        )
    });
    std::hint::black_box(&out);
    rate
}
