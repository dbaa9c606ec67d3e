//! Scores through a transport of reflections ([`crate::nn::Transport`]) for one head, a block
//! of tokens at a time, as matrix products: fla's blockwise form of PaTH, with the UT transform
//! of a block's reflections, for both sides of an encoder's query.
//!
//! **One side.** The keys before a query (`j < i`) score `c q_iᵀ H_i ⋯ H_{j+1} k_j`. The keys
//! after it (`j > i`, `c q_iᵀ H_{i+1} ⋯ H_j k_j`) score the same way over the tokens in reverse,
//! with every reflection moved one place (token `m` of the reversed order takes the reflection
//! of token `t - m`), so one routine serves both ([`Side`]). Token 0's reflection is never
//! used on either side; it is the identity here.
//!
//! **A block** `b` of `n` tokens from `a0`, with its reflections' directions `W` `(n, d_head)`
//! in rows and strengths `β`. The UT transform writes the product of a run of its reflections
//! through one lower triangular `T` `(n, n)`:
//!
//! ```text
//! H_e ⋯ H_s = I - W_[s..=e]ᵀ T_[s..=e] W_[s..=e],     (I + D L) T = D,
//! D = diag(β),  L = the strictly lower triangle of W Wᵀ
//! ```
//!
//! for every run `s..=e` of the block (a run's `T` is the block's, cut to it). So, with
//! `X = Q Wᵀ` kept where `r <= i` and `Y = K Wᵀ` kept where `s > j`:
//!
//! ```text
//! Q̂ = Q - (X T) W          q̂_i = H_a0 ⋯ H_i q_i: each query carried to the block's start
//! K̃ = K - (Y Tᵀ) W         k̃_j = H_last ⋯ H_{j+1} k_j: each key carried to its end
//! S_in = c (Q Kᵀ - (X T) Yᵀ)     the scores within the block (its strictly lower triangle)
//! S_out = c Q̂ Uᵀ                 the scores of the keys before the block
//! U ← [U - ((U Wᵀ) Tᵀ) W; K̃]     the keys before, carried through the block, and its own
//! ```
//!
//! `U` holds every key before the block carried to its start. Each product has a block's
//! width on one side, so a side's forward costs about `t² d_head (3 + n / d_head)` operations
//! (and `12 t n d_head + 6 t n²` within the blocks), as the one-reflection-at-a-time walk's
//! `3 t² d_head`, but in matrix products.
//!
//! **Backward**, a side at a time: the carried keys at each block's start are made again and
//! kept (`t² d_head / (2 n)` values; past 16 MiB in groups of blocks from checkpoints,
//! [`group`]), then the blocks are undone from the last, with `G` the gradient of the carried
//! keys. Each product's gradient is two products; `T`'s is
//! `Z = (I + D L)⁻ᵀ dT`, which gives `dβ_e += Z_ee + Σ_{s<e} dN_es A_es` and
//! `dA = (D dN)` strictly lower, with `dN = -Z Tᵀ` and `A = W Wᵀ`.

use super::Real;
use super::{Head, Side};
use crate::cpu::linear::matmul;
use gemm::Parallelism;

/// Tokens in a block. Each block's products are `n x n x d_head`, `n x n x n` and
/// `a0 x n x d_head`; 16 was the fastest of 8 to 64 at every shape measured (the book's performance page, "Measurements behind the code's choices").
const BLOCK: usize = 16;

/// A matrix operand: its values and its row and column strides (a transposed view swaps them).
#[derive(Clone, Copy)]
struct Op<'a, T> {
    v: &'a [T],
    rs: usize,
    cs: usize,
}

/// `v` as a matrix of rows `ld` apart.
fn rows<T>(v: &[T], ld: usize) -> Op<'_, T> {
    Op { v, rs: ld, cs: 1 }
}

/// The transpose of `v`'s matrix of rows `ld` apart.
fn cols<T>(v: &[T], ld: usize) -> Op<'_, T> {
    Op { v, rs: 1, cs: ld }
}

/// What a product does with its destination `dst`: `dst = a b`, `-a b` or `c a b`, or
/// `dst ± a b`.
#[derive(Clone, Copy)]
enum To<T> {
    Set,
    Neg,
    Scaled(T),
    Add,
    Sub,
}

/// `a (m x k) · b (k x n)` into `dst` (`m x n`, rows `ld` apart) as `to` says, in one thread.
fn mm<T: Real>(
    dst: &mut [T],
    ld: usize,
    (m, n, k): (usize, usize, usize),
    a: Op<'_, T>,
    b: Op<'_, T>,
    to: To<T>,
) {
    let (accumulate, scale) = match to {
        To::Set => (false, T::one()),
        To::Neg => (false, -T::one()),
        To::Scaled(c) => (false, c),
        To::Add => (true, T::one()),
        To::Sub => (true, -T::one()),
    };
    if m == 0 || n == 0 {
        return;
    }
    let end = |o: Op<'_, T>, r: usize, c: usize| (r - 1) * o.rs + (c - 1) * o.cs + 1;
    assert!(end(rows(dst, ld), m, n) <= dst.len());
    if k == 0 {
        if !accumulate {
            for row in dst.chunks_mut(ld).take(m) {
                row[..n].fill(T::zero());
            }
        }
        return;
    }
    assert!(end(a, m, k) <= a.v.len() && end(b, k, n) <= b.v.len());
    // SAFETY: every operand holds the values its shape and strides reach (asserted above), and
    // dst does not overlap them (it is borrowed mutably).
    unsafe {
        matmul(
            (m, n, k),
            dst.as_mut_ptr(),
            (ld as isize, 1),
            accumulate,
            a.v.as_ptr(),
            (a.rs as isize, a.cs as isize),
            b.v.as_ptr(),
            (b.rs as isize, b.cs as isize),
            scale,
            Parallelism::None,
        )
    }
}

/// The blocks over `t` tokens: `(a0, n)`.
fn blocks(t: usize, block: usize) -> impl DoubleEndedIterator<Item = (usize, usize)> + Clone {
    (0..t).step_by(block).map(move |a0| (a0, block.min(t - a0)))
}

/// The most the backward's carried keys may take kept whole, in bytes; past it the blocks are
/// undone in groups from checkpoints.
const WHOLE_KEPT: usize = 16 << 20;

/// Blocks a group of the backward holds over `t` tokens `d_head` wide, values of `size` bytes:
/// all while the carried keys at every block's start (`t² d_head / (2 n)` values) take at most
/// [`WHOLE_KEPT`] (`t` 1,024 at `d_head` 64 and blocks of 16 in f32); else about
/// `sqrt(blocks / 2)`, which makes the checkpoints and one group's keys about the same size
/// (`sqrt(2 / n) t^1.5 d_head` values together: 26 MiB at `t` 4,096, where whole they would be
/// 128 MiB), for the keys carried once more.
fn group(t: usize, dh: usize, block: usize, size: usize) -> usize {
    let nb = t.div_ceil(block).max(1);
    let whole: usize = blocks(t, block).map(|(a0, _)| a0).sum::<usize>() * dh * size;
    match whole <= WHOLE_KEPT {
        true => nb,
        false => ((nb as f64 / 2.0).sqrt().round() as usize).max(1),
    }
}

/// Rows the checkpoints hold (the carried keys at each group's start), and the most one group
/// keeps (at each of its blocks' start), for groups of `group` blocks.
fn kept_sizes(t: usize, block: usize, group: usize) -> (usize, usize) {
    let nb = t.div_ceil(block);
    let starts = (0..nb).step_by(group.max(1));
    let checkpoints = starts.clone().map(|b| b * block).sum();
    let kept = starts
        .map(|g0| (g0..(g0 + group).min(nb)).map(|b| b * block).sum::<usize>())
        .max()
        .unwrap_or(0);
    (checkpoints, kept)
}

/// A task's work space, reused across heads: one side's operands in its order, the carried
/// keys, a block's small matrices, and for the backward the carried keys at every block's start
/// and the side's gradients.
pub(super) struct Work<T> {
    block: usize,
    q: Vec<T>,
    k: Vec<T>,
    w: Vec<T>,
    beta: Vec<T>,
    /// The carried keys `(t, d_head)`, the first `a0` rows live.
    u: Vec<T>,
    /// `U Wᵀ` then `(U Wᵀ) Tᵀ` `(t, n)`, and in the backward their gradients.
    p: Vec<T>,
    r: Vec<T>,
    /// The block's `(n, n)` matrices: `W Wᵀ`, `T`, `X`, `Y`, `X T`, `Y Tᵀ`, then scores.
    a: Vec<T>,
    tm: Vec<T>,
    x: Vec<T>,
    y: Vec<T>,
    xt: Vec<T>,
    yt: Vec<T>,
    sin: Vec<T>,
    /// `Q̂` and `K̃` `(n, d_head)`, the scores of the keys before `(n, t)`.
    qhat: Vec<T>,
    kt: Vec<T>,
    sout: Vec<T>,
    /// Backward: the carried keys at each block's start, their gradient `(t, d_head)`, the
    /// side's gradients, and the block's.
    /// The backward's groups of blocks ([`group`]), the carried keys at each group's start
    /// (checkpoints) and at each block's start in one group.
    group: usize,
    checkpoints: Vec<T>,
    kept: Vec<T>,
    g: Vec<T>,
    dq: Vec<T>,
    dk: Vec<T>,
    dw: Vec<T>,
    dbeta: Vec<T>,
    dqhat: Vec<T>,
    dt: Vec<T>,
    dx: Vec<T>,
    dy: Vec<T>,
    dxt: Vec<T>,
    dyt: Vec<T>,
}

impl<T: Real> Work<T> {
    /// For heads of `t` tokens `d_head` wide; the backward's buffers only for a backward;
    /// nothing when `used` is false.
    pub(super) fn new(t: usize, dh: usize, used: bool, backward: bool) -> Self {
        let group = group(t, dh, BLOCK, std::mem::size_of::<T>());
        Self::with_groups(t, dh, (used, backward), (BLOCK, group))
    }

    /// As [`Work::new`], with blocks of `block` tokens undone in groups of `group`.
    fn with_groups(
        t: usize,
        dh: usize,
        (used, backward): (bool, bool),
        (block, group): (usize, usize),
    ) -> Self {
        let z = |len: usize, on: bool| vec![T::zero(); if on && used { len } else { 0 }];
        let n = block.min(t).max(1);
        let (checkpoints, kept) = kept_sizes(t, block, group);
        Self {
            block,
            q: z(t * dh, true),
            k: z(t * dh, true),
            w: z(t * dh, true),
            beta: z(t, true),
            u: z(t * dh, true),
            p: z(t * n, true),
            r: z(t * n, true),
            a: z(n * n, true),
            tm: z(n * n, true),
            x: z(n * n, true),
            y: z(n * n, true),
            xt: z(n * n, true),
            yt: z(n * n, true),
            sin: z(n * n, true),
            qhat: z(n * dh, true),
            kt: z(n * dh, true),
            sout: z(n * t, true),
            group,
            checkpoints: z(checkpoints * dh, backward),
            kept: z(kept * dh, backward),
            g: z(t * dh, backward),
            dq: z(t * dh, backward),
            dk: z(t * dh, backward),
            dw: z(t * dh, backward),
            dbeta: z(t, backward),
            dqhat: z(n * dh, backward),
            dt: z(n * n, backward),
            dx: z(n * n, backward),
            dy: z(n * n, backward),
            dxt: z(n * n, backward),
            dyt: z(n * n, backward),
        }
    }

    /// The head's q, k and reflections in the side's order (token 0's reflection the identity).
    fn gather(&mut self, head: &Head<'_, T>, side: Side, (t, dh): (usize, usize)) {
        for p in 0..t {
            let token = side.token(p, t);
            self.q[p * dh..(p + 1) * dh].copy_from_slice(head.q(token, dh));
            self.k[p * dh..(p + 1) * dh].copy_from_slice(head.k(token, dh));
        }
        self.w[..dh].fill(T::zero());
        self.beta[0] = T::zero();
        for m in 1..t {
            let (w, beta) = head.reflection(side.reflection(m, t), dh);
            self.w[m * dh..(m + 1) * dh].copy_from_slice(w);
            self.beta[m] = beta;
        }
    }

    /// Block `(a0, n)`'s `A = W Wᵀ` and `T`, solved a row at a time:
    /// `T_e = β_e (e_e - Σ_{r<e} A_er T_r)`.
    fn transform(&mut self, (a0, n): (usize, usize), dh: usize) {
        let Self { w, beta, a, tm, .. } = self;
        let wb = &w[a0 * dh..(a0 + n) * dh];
        mm(a, n, (n, n, dh), rows(wb, dh), cols(wb, dh), To::Set);
        let tm = &mut tm[..n * n];
        tm.fill(T::zero());
        for e in 0..n {
            let (done, row) = tm.split_at_mut(e * n);
            let row = &mut row[..n];
            for r in 0..e {
                let c = -a[e * n + r];
                for (o, v) in row[..=r].iter_mut().zip(&done[r * n..r * n + r + 1]) {
                    *o += c * *v;
                }
            }
            let be = beta[a0 + e];
            for o in row[..e].iter_mut() {
                *o *= be;
            }
            row[e] = be;
        }
    }

    /// Block `(a0, n)`'s `Y = K Wᵀ` (kept where `s > j`), `Y Tᵀ` and `K̃ = K - (Y Tᵀ) W`.
    fn carried_keys(&mut self, (a0, n): (usize, usize), dh: usize) {
        let Self {
            k,
            w,
            tm,
            y,
            yt,
            kt,
            ..
        } = self;
        let (wb, kb) = (&w[a0 * dh..(a0 + n) * dh], &k[a0 * dh..(a0 + n) * dh]);
        mm(y, n, (n, n, dh), rows(kb, dh), cols(wb, dh), To::Set);
        for j in 0..n {
            y[j * n..j * n + j + 1].fill(T::zero());
        }
        mm(yt, n, (n, n, n), rows(y, n), cols(tm, n), To::Set);
        kt[..n * dh].copy_from_slice(kb);
        mm(kt, dh, (n, dh, n), rows(yt, n), rows(wb, dh), To::Sub);
    }

    /// Block `(a0, n)`'s `X = Q Wᵀ` (kept where `r <= i`), `X T` and `Q̂ = Q - (X T) W`.
    fn carried_queries(&mut self, (a0, n): (usize, usize), dh: usize) {
        let Self {
            q,
            w,
            tm,
            x,
            xt,
            qhat,
            ..
        } = self;
        let (wb, qb) = (&w[a0 * dh..(a0 + n) * dh], &q[a0 * dh..(a0 + n) * dh]);
        mm(x, n, (n, n, dh), rows(qb, dh), cols(wb, dh), To::Set);
        for i in 0..n {
            x[i * n + i + 1..(i + 1) * n].fill(T::zero());
        }
        mm(xt, n, (n, n, n), rows(x, n), rows(tm, n), To::Set);
        qhat[..n * dh].copy_from_slice(qb);
        mm(qhat, dh, (n, dh, n), rows(xt, n), rows(wb, dh), To::Sub);
    }

    /// The keys before block `(a0, n)` and its own carried past it, from its reflections.
    fn carry_keys(&mut self, (a0, n): (usize, usize), dh: usize) {
        self.transform((a0, n), dh);
        self.carried_keys((a0, n), dh);
        self.carry((a0, n), dh);
    }

    /// The keys before block `(a0, n)` carried through it, `U ← U - ((U Wᵀ) Tᵀ) W`, and its
    /// own (`K̃`) appended.
    fn carry(&mut self, (a0, n): (usize, usize), dh: usize) {
        let Self {
            w, tm, u, p, r, kt, ..
        } = self;
        let wb = &w[a0 * dh..(a0 + n) * dh];
        if a0 > 0 {
            let (p, r) = (&mut p[..a0 * n], &mut r[..a0 * n]);
            mm(
                p,
                n,
                (a0, n, dh),
                rows(&u[..a0 * dh], dh),
                cols(wb, dh),
                To::Set,
            );
            mm(r, n, (a0, n, n), rows(p, n), cols(tm, n), To::Set);
            mm(u, dh, (a0, dh, n), rows(r, n), rows(wb, dh), To::Sub);
        }
        u[a0 * dh..(a0 + n) * dh].copy_from_slice(&kt[..n * dh]);
    }
}

/// The head's scores `S` `(t, t)` off the diagonal.
#[inline(always)]
fn forward_body<T: Real>(head: Head<'_, T>, s: &mut [T], work: &mut Work<T>) {
    let (t, dh) = head.dims();
    let c = head.scale;
    if t < 2 {
        return;
    }
    for side in [Side::Left, Side::Right] {
        work.gather(&head, side, (t, dh));
        for (a0, n) in blocks(t, work.block) {
            work.transform((a0, n), dh);
            work.carried_keys((a0, n), dh);
            work.carried_queries((a0, n), dh);
            // S_in = Q Kᵀ - (X T) Yᵀ, strictly lower; S_out = c Q̂ Uᵀ.
            let Work {
                q,
                k,
                u,
                xt,
                y,
                qhat,
                sin,
                sout,
                ..
            } = &mut *work;
            let (qb, kb) = (&q[a0 * dh..(a0 + n) * dh], &k[a0 * dh..(a0 + n) * dh]);
            mm(sin, n, (n, n, dh), rows(qb, dh), cols(kb, dh), To::Set);
            mm(sin, n, (n, n, n), rows(xt, n), cols(y, n), To::Sub);
            let u = &u[..a0 * dh];
            mm(
                sout,
                a0.max(1),
                (n, a0, dh),
                rows(qhat, dh),
                cols(u, dh),
                To::Scaled(c),
            );
            for ib in 0..n {
                let i = side.token(a0 + ib, t);
                let row = &mut s[i * t..(i + 1) * t];
                for j in 0..a0 {
                    row[side.token(j, t)] = work.sout[ib * a0 + j];
                }
                for jb in 0..ib {
                    row[side.token(a0 + jb, t)] = c * work.sin[ib * n + jb];
                }
            }
            if a0 + n < t {
                work.carry((a0, n), dh);
            }
        }
    }
}
simd_dispatch!(pub(super) fn forward = forward_body(head: Head<'_, T>, s: &mut [T], work: &mut Work<T>));

/// The gradients of the head's q and k `(t, d_head)` and of its reflections `(t, d_head + 1)`
/// from that of its scores `ds` `(t, t)` off the diagonal, added to `dq`, `dk` and `dr`.
#[inline(always)]
fn backward_body<T: Real>(
    head: Head<'_, T>,
    ds: &[T],
    (dq, dk, dr): (&mut [T], &mut [T], &mut [T]),
    work: &mut Work<T>,
) {
    let (t, dh) = head.dims();
    let c = head.scale;
    if t < 2 {
        return;
    }
    let (block, group) = (work.block, work.group);
    let nb = t.div_ceil(block);
    let at_block = |b: usize| (b * block, block.min(t - b * block));
    let last = (nb - 1) / group * group;
    for side in [Side::Left, Side::Right] {
        work.gather(&head, side, (t, dh));
        // The carried keys to the last group's start, kept at each group's start.
        let mut at = 0;
        for b in (0..=last).step_by(group) {
            let a0 = b * block;
            work.checkpoints[at..at + a0 * dh].copy_from_slice(&work.u[..a0 * dh]);
            at += a0 * dh;
            for b in b..(b + group).min(last) {
                work.carry_keys(at_block(b), dh);
            }
        }
        // Then a group at a time from the last: the keys carried again from its checkpoint,
        // kept at each of its blocks' start, and its blocks undone from the last.
        work.g.fill(T::zero());
        for g0 in (0..=last).rev().step_by(group) {
            let g1 = (g0 + group).min(nb);
            at -= g0 * block * dh;
            let a0 = g0 * block;
            work.u[..a0 * dh].copy_from_slice(&work.checkpoints[at..at + a0 * dh]);
            let mut to = 0;
            for b in g0..g1 {
                let (a0, n) = at_block(b);
                work.kept[to..to + a0 * dh].copy_from_slice(&work.u[..a0 * dh]);
                to += a0 * dh;
                if b + 1 < g1 {
                    work.carry_keys((a0, n), dh);
                }
            }
            for b in (g0..g1).rev() {
                to -= b * block * dh;
                block_backward(work, at_block(b), (t, dh, c), side, ds, to);
            }
        }
        // The side's gradients into the head's.
        for p in 0..t {
            let token = side.token(p, t);
            let add = |dst: &mut [T], src: &[T]| {
                for (o, v) in dst.iter_mut().zip(src) {
                    *o += *v;
                }
            };
            add(
                &mut dq[token * dh..(token + 1) * dh],
                &work.dq[p * dh..(p + 1) * dh],
            );
            add(
                &mut dk[token * dh..(token + 1) * dh],
                &work.dk[p * dh..(p + 1) * dh],
            );
            if p > 0 {
                let m = side.reflection(p, t);
                let drm = &mut dr[m * (dh + 1)..(m + 1) * (dh + 1)];
                add(&mut drm[..dh], &work.dw[p * dh..(p + 1) * dh]);
                drm[dh] += work.dbeta[p];
            }
        }
    }
}
simd_dispatch!(pub(super) fn backward = backward_body(head: Head<'_, T>, ds: &[T], grads: (&mut [T], &mut [T], &mut [T]), work: &mut Work<T>));

/// Block `(a0, n)` undone: from `G` (the gradient of the keys carried past it) and the score
/// gradients `ds` of its queries, the block's rows of the side's `dq`, `dk`, `dw` and `dβ`, and
/// `G` for the keys carried into it. `kept` is where the keys carried into it are kept.
fn block_backward<T: Real>(
    work: &mut Work<T>,
    (a0, n): (usize, usize),
    (t, dh, c): (usize, usize, T),
    side: Side,
    ds: &[T],
    kept: usize,
) {
    work.transform((a0, n), dh);
    work.carried_keys((a0, n), dh);
    work.carried_queries((a0, n), dh);
    let Work {
        q,
        k,
        w,
        beta,
        p,
        r,
        a,
        tm,
        x,
        y,
        xt,
        yt,
        sin,
        qhat,
        sout,
        kept: keys,
        g,
        dq,
        dk,
        dw,
        dbeta,
        dqhat,
        dt,
        dx,
        dy,
        dxt,
        dyt,
        ..
    } = work;
    let span = a0 * dh..(a0 + n) * dh;
    let (qb, kb, wb) = (&q[span.clone()], &k[span.clone()], &w[span.clone()]);
    let u = &keys[kept..kept + a0 * dh];
    // The block's score gradients, scaled by c: of the keys before (n, a0), and within
    // (strictly lower).
    let lda = a0.max(1);
    for ib in 0..n {
        let i = side.token(a0 + ib, t);
        let row = &ds[i * t..(i + 1) * t];
        for j in 0..a0 {
            sout[ib * lda + j] = c * row[side.token(j, t)];
        }
        for jb in 0..n {
            sin[ib * n + jb] = match jb < ib {
                true => c * row[side.token(a0 + jb, t)],
                false => T::zero(),
            };
        }
    }
    let (dqb, dkb, dwb) = (
        &mut dq[span.clone()],
        &mut dk[span.clone()],
        &mut dw[span.clone()],
    );
    dwb.fill(T::zero());
    dt[..n * n].fill(T::zero());
    let (nnn, ndn) = ((n, n, n), (n, dh, n));
    // S_out = c Q̂ Uᵀ: dQ̂ = dS_out U.
    let dsout = &sout[..n * lda];
    mm(
        dqhat,
        dh,
        (n, dh, a0),
        rows(dsout, lda),
        rows(u, dh),
        To::Set,
    );
    if a0 > 0 {
        // U' = U - R W with R = P Tᵀ, P = U Wᵀ; G_old is the gradient of U'.
        let (p, r) = (&mut p[..a0 * n], &mut r[..a0 * n]);
        mm(p, n, (a0, n, dh), rows(u, dh), cols(wb, dh), To::Set);
        mm(r, n, (a0, n, n), rows(p, n), cols(tm, n), To::Set);
        let g_old = &g[..a0 * dh];
        // dW -= Rᵀ G_old, then dR = -G_old Wᵀ (in r).
        mm(dwb, dh, (n, dh, a0), cols(r, n), rows(g_old, dh), To::Sub);
        mm(r, n, (a0, n, dh), rows(g_old, dh), cols(wb, dh), To::Neg);
        // dT += dRᵀ P, then dP = dR T (in p).
        mm(dt, n, (n, n, a0), cols(r, n), rows(p, n), To::Add);
        mm(p, n, (a0, n, n), rows(r, n), rows(tm, n), To::Set);
        // dW += dPᵀ U; G = G_old + dS_outᵀ Q̂ + dP W.
        mm(dwb, dh, (n, dh, a0), cols(p, n), rows(u, dh), To::Add);
        let g = &mut g[..a0 * dh];
        mm(
            g,
            dh,
            (a0, dh, n),
            cols(dsout, lda),
            rows(qhat, dh),
            To::Add,
        );
        mm(g, dh, (a0, dh, n), rows(p, n), rows(wb, dh), To::Add);
    }
    // K̃ = K - (Y Tᵀ) W: dK = G_new, dW -= (Y Tᵀ)ᵀ G_new, d(Y Tᵀ) = -G_new Wᵀ.
    let g_new = &g[span];
    dkb.copy_from_slice(g_new);
    mm(dwb, dh, ndn, cols(yt, n), rows(g_new, dh), To::Sub);
    mm(dyt, n, (n, n, dh), rows(g_new, dh), cols(wb, dh), To::Neg);
    // Q̂ = Q - (X T) W: dQ = dQ̂, dW -= (X T)ᵀ dQ̂, d(X T) = -dQ̂ Wᵀ.
    dqb.copy_from_slice(&dqhat[..n * dh]);
    mm(dwb, dh, ndn, cols(xt, n), rows(dqhat, dh), To::Sub);
    mm(dxt, n, (n, n, dh), rows(dqhat, dh), cols(wb, dh), To::Neg);
    // S_in = Q Kᵀ - (X T) Yᵀ: dQ += dS K, dK += dSᵀ Q, d(X T) -= dS Y, dY = -dSᵀ (X T).
    let dsin = &sin[..n * n];
    mm(dqb, dh, ndn, rows(dsin, n), rows(kb, dh), To::Add);
    mm(dkb, dh, ndn, cols(dsin, n), rows(qb, dh), To::Add);
    mm(dxt, n, nnn, rows(dsin, n), rows(y, n), To::Sub);
    mm(dy, n, nnn, cols(dsin, n), rows(xt, n), To::Neg);
    // Y Tᵀ: dY += d(Y Tᵀ) T, dT += d(Y Tᵀ)ᵀ Y.
    mm(dy, n, nnn, rows(dyt, n), rows(tm, n), To::Add);
    mm(dt, n, nnn, cols(dyt, n), rows(y, n), To::Add);
    // X T: dX = d(X T) Tᵀ, dT += Xᵀ d(X T).
    mm(dx, n, nnn, rows(dxt, n), cols(tm, n), To::Set);
    mm(dt, n, nnn, cols(x, n), rows(dxt, n), To::Add);
    // X = Q Wᵀ where r <= i, Y = K Wᵀ where s > j.
    for i in 0..n {
        dx[i * n + i + 1..(i + 1) * n].fill(T::zero());
        dy[i * n..i * n + i + 1].fill(T::zero());
    }
    mm(dqb, dh, ndn, rows(dx, n), rows(wb, dh), To::Add);
    mm(dwb, dh, ndn, cols(dx, n), rows(qb, dh), To::Add);
    mm(dkb, dh, ndn, rows(dy, n), rows(wb, dh), To::Add);
    mm(dwb, dh, ndn, cols(dy, n), rows(kb, dh), To::Add);
    // T = (I + D L)⁻¹ D: Z = (I + D L)⁻ᵀ dT (in dt, from the last row up), lower part only.
    for e in 0..n {
        dt[e * n + e + 1..(e + 1) * n].fill(T::zero());
    }
    for e in (0..n).rev() {
        let (head_rows, below) = dt.split_at_mut((e + 1) * n);
        let row = &mut head_rows[e * n..];
        for r in e + 1..n {
            let coef = -(beta[a0 + r] * a[r * n + e]);
            for (o, v) in row.iter_mut().zip(&below[(r - e - 1) * n..(r - e) * n]) {
                *o += coef * *v;
            }
        }
    }
    // dβ_e = Z_ee + Σ_{s<e} dN_es A_es, dA = D dN strictly lower, dN = -Z Tᵀ (in dx).
    mm(dx, n, nnn, rows(dt, n), cols(tm, n), To::Neg);
    for e in 0..n {
        let mut db = dt[e * n + e];
        for s in 0..e {
            db += dx[e * n + s] * a[e * n + s];
        }
        dbeta[a0 + e] = db;
        let be = beta[a0 + e];
        for s in 0..n {
            dx[e * n + s] = match s < e {
                true => be * dx[e * n + s],
                false => T::zero(),
            };
        }
    }
    // A = W Wᵀ: dW += (dA + dAᵀ) W.
    mm(dwb, dh, ndn, rows(dx, n), rows(wb, dh), To::Add);
    mm(dwb, dh, ndn, cols(dx, n), rows(wb, dh), To::Add);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values<T: Real>(len: usize, seed: u64) -> Vec<T> {
        crate::testing::uniform(len, seed)
            .map(|u| T::lit(u * 2.0 - 1.0))
            .collect()
    }

    /// Reflections with unit directions and strengths in (0, 2).
    fn reflections<T: Real>(t: usize, dh: usize, seed: u64) -> Vec<T> {
        let mut r = values::<T>(t * (dh + 1), seed);
        for row in r.chunks_exact_mut(dh + 1) {
            let inv = row[..dh]
                .iter()
                .fold(T::zero(), |s, v| s + *v * *v)
                .sqrt()
                .recip();
            for v in row[..dh].iter_mut() {
                *v *= inv;
            }
            row[dh] += T::one();
        }
        r
    }

    /// A backward that writes `dq`, `dk` and `dr`.
    type Grads<'a> = dyn FnMut(&mut [f64], &mut [f64], &mut [f64]) + 'a;

    #[test]
    fn blocks_give_the_walks_scores_and_gradients() {
        // Against the one-reflection-at-a-time walk, f64: blocks of 1, 4, 7, 16, 32 and 64 over
        // 2, 16, 17 and 37 tokens (whole blocks, a short last block, a single block), undone
        // whole or in groups from checkpoints (the last group short, or one block), scores and
        // every gradient.
        let plan = [
            (1, 37),
            (1, 6),
            (4, 10),
            (4, 3),
            (7, 6),
            (7, 1),
            (16, 1),
            (32, 2),
            (64, 1),
        ];
        for (t, dh) in [(2, 3), (16, 4), (17, 6), (37, 5)] {
            let (q, k, ds) = (
                values::<f64>(t * dh, 1),
                values(t * dh, 2),
                values(t * t, 3),
            );
            let refl = reflections::<f64>(t, dh, 4);
            let head = Head {
                q: &q,
                k: &k,
                reflections: &refl,
                scale: 0.4,
            };
            let grads = |backward: &mut Grads<'_>| {
                let mut g = [
                    vec![0.0; t * dh],
                    vec![0.0; t * dh],
                    vec![0.0; t * (dh + 1)],
                ];
                let [a, b, r] = &mut g;
                backward(a, b, r);
                g
            };
            let mut walk = super::super::walk::Work::<f64>::new(t, dh, true, true);
            let mut want = vec![0.0; t * t];
            super::super::walk::forward_body(head, &mut want, &mut walk);
            let want_grads = grads(&mut |a, b, r| {
                super::super::walk::backward_body(head, &ds, (a, b, r), &mut walk)
            });
            assert!(want_grads.iter().all(|g| g.iter().any(|v| *v != 0.0)));
            for (block, group) in plan {
                let mut work = Work::<f64>::with_groups(t, dh, (true, true), (block, group));
                let mut s = vec![0.0; t * t];
                forward_body(head, &mut s, &mut work);
                let close = |a: &[f64], b: &[f64], what: &str| {
                    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs()));
                    for (i, (x, y)) in a.iter().zip(b).enumerate() {
                        assert!(
                            (x - y).abs() <= 1e-12 * scale,
                            "{what}, {t} tokens, blocks of {block} in groups of {group}: \
                             {x} against {y} at {i}"
                        );
                    }
                };
                close(&s, &want, "scores");
                let got = grads(&mut |a, b, r| backward_body(head, &ds, (a, b, r), &mut work));
                for (g, (w, what)) in got.iter().zip(want_grads.iter().zip(["dq", "dk", "dr"])) {
                    close(g, w, what);
                }
            }
        }
    }

    #[test]
    fn groups_from_checkpoints_give_the_whole_backwards_bits() {
        // Blocks of 16 over 150 tokens (10 blocks), undone whole and in groups of 1, 3 and 4
        // (the last group short): every gradient bit for bit, f32 and f64; and the sizes the
        // work space is made with hold every group.
        fn check<T: Real>() {
            let (t, dh) = (150, 6);
            let (q, k, ds) = (values::<T>(t * dh, 5), values(t * dh, 6), values(t * t, 7));
            let refl = reflections::<T>(t, dh, 8);
            let head = Head {
                q: &q,
                k: &k,
                reflections: &refl,
                scale: T::lit(0.3),
            };
            let run = |group: usize| {
                let mut work = Work::<T>::with_groups(t, dh, (true, true), (16, group));
                let mut g = [
                    vec![T::zero(); t * dh],
                    vec![T::zero(); t * dh],
                    vec![T::zero(); t * (dh + 1)],
                ];
                let [a, b, r] = &mut g;
                backward_body(head, &ds, (a, b, r), &mut work);
                g
            };
            let whole = run(10);
            assert!(whole.iter().all(|g| g.iter().any(|v| *v != T::zero())));
            for group in [1, 3, 4] {
                assert!(
                    run(group) == whole,
                    "groups of {group} blocks give other bits"
                );
            }
        }
        check::<f64>();
        check::<f32>();
    }

    #[test]
    fn the_kept_keys_are_whole_while_small_and_in_groups_past_that() {
        // 1,024 tokens of 64 f32 values in blocks of 16: 15.75 MiB whole; 2,048: 63.5 MiB, in
        // groups of 8 (sqrt(128 / 2)).
        assert_eq!(group(1024, 64, 16, 4), 64);
        assert_eq!(group(2048, 64, 16, 4), 8);
        let (checkpoints, kept) = kept_sizes(2048, 16, 8);
        assert_eq!(checkpoints, (0..16).map(|g| g * 8 * 16).sum::<usize>());
        // The longest: blocks 120 to 127, the last group.
        assert_eq!(kept, (120..128).map(|b| b * 16).sum::<usize>());
    }
}
