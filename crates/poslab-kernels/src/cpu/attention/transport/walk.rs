//! Scores through a transport of reflections ([`crate::nn::Transport`]) for one head, inside the
//! fused attention, in `O(t² d_head)`, one reflection at a time: every key is carried to the
//! queries a step at a time, all keys of a side together. Faster than the blocks
//! ([`super::blocks`]) for narrow heads, where a block's products are too thin for gemm.
//!
//! **Left of the query** (`j < i`, `score_ij = c q_iᵀ H_i ⋯ H_{j+1} k_j`), queries in order: at
//! query `i` the carried keys `U` (one row per key before it) take key `k_{i-1}`, then every
//! row is reflected by `H_i`, and row `j` then holds `H_i ⋯ H_{j+1} k_j`:
//!
//! ```text
//! U ← [U; k_{i-1}];   a_r = w_i · U_r,   U_r ← U_r - β_i a_r w_i;   S[i, j_r] = c q_i · U_r
//! ```
//!
//! **Right of the query** (`j > i`, `score_ij = c q_iᵀ H_{i+1} ⋯ H_j k_j`) is the same walk with
//! the queries in reverse: at query `i` the rows take `k_{i+1}` and are reflected by `H_{i+1}`.
//! The diagonal is `c q_i · k_i`.
//!
//! **Backward**, a side at a time, from `dS` of the head: the walk is made again, keeping each
//! step's rows before their reflection (`U⁻`) and the `a_r`, then undone from the last step,
//! `G` holding the gradient of the carried rows:
//!
//! ```text
//! G_r += c dS[i, j_r] q_i;      dq_i += c dS[i, j_r] U_r          (U_r = U⁻_r - β a_r w)
//! γ_r = w · G_r;   dβ -= Σ_r a_r γ_r;   dw -= β Σ_r (γ_r U⁻_r + a_r G_r);   G_r -= β γ_r w
//! ```
//!
//! and the row a step took in, complete once that step is undone, is its key's gradient.
//!
//! The carried rows are kept transposed, a coordinate of every carried key side by side, so that
//! each step is whole-vector passes along the keys with no dependence between them (`a`, the
//! reflection and the scores are sums and updates over the coordinates, each a vector
//! operation over the keys). The backward's history is `t (t - 1) / 2 · d_head` values a side
//! (2 MiB at `t` 128 and `d_head` 64 in f32), kept whole while small and otherwise walked in
//! segments from checkpoints ([`segment`]). Cost per head: about `6 t² d_head` operations
//! forward and `20 t² d_head` backward (with the walk made again), beside `q kᵀ`'s `2 t²
//! d_head`.

use super::Real;
use super::{Head, Side};

/// The backward's sums over a step's keys run over whole blocks of this many (the score
/// gradients, `γ` and `a` zero past the keys), so that no sum ends in a serial tail.
const LANES: usize = 16;

/// `n` rounded up to whole blocks of [`LANES`].
fn padded(n: usize) -> usize {
    n.div_ceil(LANES) * LANES
}

/// The stride of the carried rows' coordinates: whole blocks and one more, so that the rows are
/// not a power of two apart (at 128 f32 values, 512 bytes, the coordinates of one key all fall
/// in 8 of the L1 cache's 64 sets).
fn row_stride(t: usize) -> usize {
    padded(t) + LANES
}

/// A task's work space, reused across heads: the carried rows and their gradient, kept
/// transposed `(d_head, t)` (a coordinate of every carried key side by side, in rows padded to
/// whole blocks, so that each step is whole-vector passes along the keys), a forward step's `a`
/// and the scores it makes, and for the backward the carried rows at the start of each segment
/// of steps (checkpoints), one segment's history (each step's rows before their reflection and
/// their `a`, padded to whole blocks), and a step's score gradients and `γ`.
pub(super) struct Work<T> {
    /// The backward's segment length ([`segment`]).
    steps: usize,
    u: Vec<T>,
    g: Vec<T>,
    checkpoints: Vec<T>,
    history: Vec<T>,
    a: Vec<T>,
    a_step: Vec<T>,
    step: Vec<T>,
    gs: Vec<T>,
    gamma: Vec<T>,
}

/// The most a task's walk history may take whole, in bytes; past it the backward walks in
/// segments from checkpoints.
const WHOLE_HISTORY: usize = 16 << 20;

/// The backward's segments of steps over `t` tokens of `d_head` values of `size` bytes: one,
/// the whole walk, while its history (`t² / 2` rows) takes at most [`WHOLE_HISTORY`] (`t` 256
/// at `d_head` 64 in f32); else about `sqrt(t / 2)` steps each, which makes the checkpoints
/// (`t² / (2 C)` rows) and one segment's history (`C t` rows) about the same size,
/// `sqrt(2) t^1.5 d_head` values together (4 MiB at `t` 512, 33 MiB at 2,048, where the whole
/// history would be 32 and 512 MiB a task), for one more walk (the backward's cost in segments:
/// the book's performance page, "Measurements behind the code's choices").
fn segment(t: usize, dh: usize, size: usize) -> usize {
    let whole = t * t.saturating_sub(1) / 2 * dh * size;
    match whole <= WHOLE_HISTORY {
        true => t.max(1),
        false => ((t as f64 / 2.0).sqrt().round() as usize).max(1),
    }
}

/// The first step of each segment of `c` steps (steps run from 1 to `t - 1`).
fn segment_starts(t: usize, c: usize) -> impl DoubleEndedIterator<Item = usize> {
    (1..t).step_by(c)
}

/// Rows the checkpoints hold (the rows carried into each segment's first step, `lo - 1`), and
/// the longest segment's history in values of `a` (padded steps), for segments of `c` steps.
fn backward_sizes(t: usize, c: usize) -> (usize, usize) {
    let checkpoints = segment_starts(t, c).map(|lo| lo - 1).sum();
    let history = segment_starts(t, c)
        .map(|lo| (lo..(lo + c).min(t)).map(padded).sum::<usize>())
        .max()
        .unwrap_or(0);
    (checkpoints, history)
}

impl<T: Real> Work<T> {
    /// For heads of `t` tokens `d_head` wide; the checkpoints and history only for a backward;
    /// nothing when `used` is false.
    pub(super) fn new(t: usize, dh: usize, used: bool, backward: bool) -> Self {
        Self::with_segments(
            t,
            dh,
            (used, backward),
            segment(t, dh, std::mem::size_of::<T>()),
        )
    }

    /// As [`Work::new`], with the backward's segments `c` steps long.
    fn with_segments(t: usize, dh: usize, (used, backward): (bool, bool), c: usize) -> Self {
        let z = |len: usize, on: bool| vec![T::zero(); if on && used { len } else { 0 }];
        let tp = row_stride(t);
        let (checkpoints, history) = backward_sizes(t, c);
        Self {
            steps: c,
            u: z(tp * dh, true),
            g: z(tp * dh, backward),
            checkpoints: z(checkpoints * dh, backward),
            history: z(history * dh, backward),
            a: z(history, backward),
            a_step: z(tp, true),
            step: z(tp, true),
            gs: z(tp, backward),
            gamma: z(tp, backward),
        }
    }
}

/// The sum of 16 lanes, folded as a tree.
#[inline(always)]
fn fold<T: Real>(mut lanes: [T; LANES]) -> T {
    let mut width = LANES / 2;
    while width > 0 {
        for e in 0..width {
            lanes[e] += lanes[e + width];
        }
        width /= 2;
    }
    lanes[0]
}

/// `Σ a_e b_e` in lanes folded as a tree, then the tail one by one.
#[inline(always)]
fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    let mut lanes = [T::zero(); LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail = ca.remainder().iter().zip(cb.remainder());
    for (x, y) in ca.zip(cb) {
        for e in 0..LANES {
            lanes[e] += x[e] * y[e];
        }
    }
    let mut s = fold(lanes);
    for (x, y) in tail {
        s += *x * *y;
    }
    s
}

/// `u ← u + c w`.
#[inline(always)]
fn add_scaled<T: Real>(u: &mut [T], c: T, w: &[T]) {
    for (x, y) in u.iter_mut().zip(w) {
        *x += c * *y;
    }
}

/// One step of a walk over the carried rows `u` `(d_head, tp)` (the first `s` keys of each
/// coordinate's row): takes in `key` as row `s - 1`, writes each row's `a = w · U_r` into `a`,
/// and reflects every row, `U_r ← U_r - (β w) a_r`. With `q`, also each reflected row's
/// `q · U_r` into `scores`. Each pass runs along a coordinate's row of keys.
#[inline(always)]
fn walk_step<T: Real>(
    (u, tp, s): (&mut [T], usize, usize),
    key: &[T],
    (w, beta): (&[T], T),
    a: &mut [T],
    scores: Option<(&[T], &mut [T])>,
) {
    for (e, k) in key.iter().enumerate() {
        u[e * tp + s - 1] = *k;
    }
    a.fill(T::zero());
    for (e, we) in w.iter().enumerate() {
        add_scaled(a, *we, &u[e * tp..e * tp + s]);
    }
    match scores {
        Some((q, sc)) => {
            sc.fill(T::zero());
            for (e, (we, qe)) in w.iter().zip(q).enumerate() {
                let (row, c) = (&mut u[e * tp..e * tp + s], -(beta * *we));
                for ((x, ar), o) in row.iter_mut().zip(a.iter()).zip(sc.iter_mut()) {
                    *x += c * *ar;
                    *o += *qe * *x;
                }
            }
        }
        None => {
            for (e, we) in w.iter().enumerate() {
                add_scaled(&mut u[e * tp..e * tp + s], -(beta * *we), a);
            }
        }
    }
}

/// The head's scores `S` `(t, t)` off the diagonal.
#[inline(always)]
pub(super) fn forward_body<T: Real>(head: Head<'_, T>, s: &mut [T], work: &mut Work<T>) {
    let (t, dh) = head.dims();
    let (c, tp) = (head.scale, row_stride(t));
    for side in [Side::Left, Side::Right] {
        for step in 1..t {
            let i = side.token(step, t);
            let key = head.k(side.token(step - 1, t), dh);
            let reflection = head.reflection(side.reflection(step, t), dh);
            let (a, sc) = (&mut work.a_step[..step], &mut work.step[..step]);
            let scores = Some((head.q(i, dh), &mut *sc));
            walk_step((&mut work.u, tp, step), key, reflection, a, scores);
            let row = &mut s[i * t..(i + 1) * t];
            match side {
                Side::Left => {
                    for (o, v) in row[..step].iter_mut().zip(sc.iter()) {
                        *o = c * *v;
                    }
                }
                Side::Right => {
                    for (o, v) in row[t - step..].iter_mut().rev().zip(sc.iter()) {
                        *o = c * *v;
                    }
                }
            }
        }
    }
}
simd_dispatch!(pub(super) fn forward = forward_body(head: Head<'_, T>, s: &mut [T], work: &mut Work<T>));

/// The gradients of the head's q and k `(t, d_head)` and of its reflections `(t, d_head + 1)`
/// from that of its scores `ds` `(t, t)` off the diagonal, added to `dq`, `dk` and `dr`.
#[inline(always)]
pub(super) fn backward_body<T: Real>(
    head: Head<'_, T>,
    ds: &[T],
    (dq, dk, dr): (&mut [T], &mut [T], &mut [T]),
    work: &mut Work<T>,
) {
    let (t, dh) = head.dims();
    let (c, tp) = (head.scale, row_stride(t));
    let steps = work.steps;
    for side in [Side::Left, Side::Right] {
        // The walk again, keeping the carried rows at the start of each segment.
        let mut at = 0;
        let last = segment_starts(t, steps).next_back().unwrap_or(t);
        for step in 1..=last.min(t - 1) {
            if (step - 1) % steps == 0 {
                for e in 0..dh {
                    let (from, to) = (e * tp, at + e * (step - 1));
                    let rows = &work.u[from..from + step - 1];
                    work.checkpoints[to..to + step - 1].copy_from_slice(rows);
                }
                at += (step - 1) * dh;
            }
            if step == last {
                break;
            }
            let key = head.k(side.token(step - 1, t), dh);
            let reflection = head.reflection(side.reflection(step, t), dh);
            let a = &mut work.a_step[..step];
            walk_step((&mut work.u, tp, step), key, reflection, a, None);
        }
        // Then a segment at a time from the last: its walk again from its checkpoint, keeping
        // each step's rows before their reflection `(d_head, sp)` and their a `(sp)`, zeros in
        // a past the step's keys; then its steps undone from its last, over whole blocks of
        // keys: the score gradients, `γ` and `a` are 0 past the step's keys, so what lies there
        // adds nothing and is left as it is.
        work.g.fill(T::zero());
        let mut checkpoint = work.checkpoints.len();
        for lo in segment_starts(t, steps).rev() {
            let hi = (lo + steps).min(t);
            checkpoint -= (lo - 1) * dh;
            for e in 0..dh {
                let (from, to) = (checkpoint + e * (lo - 1), e * tp);
                work.u[to..to + lo - 1].copy_from_slice(&work.checkpoints[from..from + lo - 1]);
            }
            let mut starts = Vec::with_capacity(hi - lo);
            let mut at = 0;
            for step in lo..hi {
                let sp = padded(step);
                starts.push(at);
                let key = head.k(side.token(step - 1, t), dh);
                for (e, k) in key.iter().enumerate() {
                    work.u[e * tp + step - 1] = *k;
                }
                let history = &mut work.history[at * dh..(at + sp) * dh];
                for (e, h) in history.chunks_exact_mut(sp).enumerate() {
                    h[..step].copy_from_slice(&work.u[e * tp..e * tp + step]);
                }
                let reflection = head.reflection(side.reflection(step, t), dh);
                let a = &mut work.a[at..at + sp];
                walk_step(
                    (&mut work.u, tp, step),
                    key,
                    reflection,
                    &mut a[..step],
                    None,
                );
                a[step..].fill(T::zero());
                at += sp;
            }
            for step in (lo..hi).rev() {
                let (at, sp) = (starts[step - lo], padded(step));
                let i = side.token(step, t);
                let m = side.reflection(step, t);
                let (w, beta) = head.reflection(m, dh);
                let q = head.q(i, dh);
                let history = &work.history[at * dh..(at + sp) * dh];
                let a = &work.a[at..at + sp];
                let (gs, gamma) = (&mut work.gs[..sp], &mut work.gamma[..sp]);
                let row = &ds[i * t..(i + 1) * t];
                match side {
                    Side::Left => {
                        for (o, v) in gs.iter_mut().zip(&row[..step]) {
                            *o = c * *v;
                        }
                    }
                    Side::Right => {
                        for (o, v) in gs.iter_mut().zip(row[t - step..].iter().rev()) {
                            *o = c * *v;
                        }
                    }
                }
                gs[step..].fill(T::zero());
                // G_r += gs_r q; dq += Σ_r gs_r U_r with U_r = U⁻_r - β a_r w; γ_r = w · G_r.
                let ga = dot(gs, a);
                gamma.fill(T::zero());
                let dqi = &mut dq[i * dh..(i + 1) * dh];
                for (e, (h, d)) in history.chunks_exact(sp).zip(dqi.iter_mut()).enumerate() {
                    let g = &mut work.g[e * tp..e * tp + sp];
                    add_scaled(g, q[e], gs);
                    *d += dot(gs, h) - beta * w[e] * ga;
                    add_scaled(gamma, w[e], g);
                }
                gamma[step..].fill(T::zero());
                // dβ -= Σ_r a_r γ_r; dw -= β Σ_r (γ_r U⁻_r + a_r G_r); G_r -= β γ_r w.
                let drm = &mut dr[m * (dh + 1)..(m + 1) * (dh + 1)];
                drm[dh] += -dot(a, gamma);
                for (e, (h, d)) in history.chunks_exact(sp).zip(drm.iter_mut()).enumerate() {
                    let g = &mut work.g[e * tp..e * tp + sp];
                    *d += -(beta * (dot(gamma, h) + dot(a, g)));
                    add_scaled(g, -(beta * w[e]), gamma);
                }
                // The row this step took in is complete: its key's gradient.
                let key = side.token(step - 1, t);
                for (e, d) in dk[key * dh..(key + 1) * dh].iter_mut().enumerate() {
                    *d += work.g[e * tp + step - 1];
                }
            }
        }
    }
}
simd_dispatch!(pub(super) fn backward = backward_body(head: Head<'_, T>, ds: &[T], grads: (&mut [T], &mut [T], &mut [T]), work: &mut Work<T>));

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backward_in_segments_gives_the_whole_walks_bits() {
        // Segments of 1, 3 and 7 steps (checkpoints restored, the last segment short) against
        // the whole walk's history, every gradient, f64 and f32; and the sizes the work space
        // is made with hold every segment.
        fn check<T: Real>() {
            let (t, dh) = (37, 5);
            let values = |len: usize, seed: u64| -> Vec<T> {
                crate::testing::uniform(len, seed)
                    .map(|u| T::lit(u * 2.0 - 1.0))
                    .collect()
            };
            let (q, k, ds) = (values(t * dh, 1), values(t * dh, 2), values(t * t, 3));
            let mut reflections = values(t * (dh + 1), 4);
            for row in reflections.chunks_exact_mut(dh + 1) {
                row[dh] += T::one(); // strengths in [0, 2)
            }
            let head = Head {
                q: &q,
                k: &k,
                reflections: &reflections,
                scale: T::lit(0.4),
            };
            let run = |c: usize| {
                let mut work = Work::<T>::with_segments(t, dh, (true, true), c);
                let (mut dq, mut dk, mut dr) = (
                    vec![T::zero(); t * dh],
                    vec![T::zero(); t * dh],
                    vec![T::zero(); t * (dh + 1)],
                );
                backward_body(head, &ds, (&mut dq, &mut dk, &mut dr), &mut work);
                [dq, dk, dr]
            };
            let whole = run(t);
            assert!(whole.iter().all(|g| g.iter().any(|v| *v != T::zero())));
            for c in [1, 3, 7] {
                assert!(run(c) == whole, "segments of {c} steps give other bits");
            }
        }
        check::<f64>();
        check::<f32>();
    }

    #[test]
    fn the_walk_is_kept_whole_while_small_and_in_segments_past_that() {
        // 128 tokens of 64 f32 values: 2 MiB whole; 512: 32 MiB, in segments of 16 steps.
        assert_eq!(segment(128, 64, 4), 128);
        assert_eq!(segment(512, 64, 4), 16);
        let (checkpoints, history) = backward_sizes(512, 16);
        assert_eq!(checkpoints, (0..32).map(|s| 16 * s).sum::<usize>());
        // The longest: steps 481 to 496 (the last segment, 497 to 511, is one step short).
        assert_eq!(history, (481..497).map(padded).sum::<usize>());
    }
}
