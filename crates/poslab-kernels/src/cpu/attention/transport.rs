//! Scores through a transport of reflections ([`crate::nn::Transport`]) for one head, inside the
//! fused attention: `c q_iᵀ H_i ⋯ H_{j+1} k_j` for the keys before a query and
//! `c q_iᵀ H_{i+1} ⋯ H_j k_j` for those after it, and their backward. Two routes compute the
//! same function in `O(t² d_head)`:
//! - [`walk`]: every key carried to the queries one reflection at a time, in vector
//!   passes along the keys;
//! - [`blocks`]: fla's blockwise form, a block of tokens at a time through the UT
//!   transform of its reflections, in matrix products.
//!
//! [`Route::of`] picks one for each pass from the head's width and length, as measured.

mod blocks;
mod walk;

use super::Real;
use crate::SimdLevel;

/// One head's operands: q and k `(t, d_head)` in rows, the reflections `[w | β]`
/// `(t, d_head + 1)`, and the score scale.
#[derive(Clone, Copy)]
pub(super) struct Head<'a, T> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub reflections: &'a [T],
    pub scale: T,
}

impl<T: Real> Head<'_, T> {
    /// `(t, d_head)`: `[w | β]` holds one value a token more than q.
    pub(super) fn dims(&self) -> (usize, usize) {
        let t = self.reflections.len() - self.q.len();
        (t, self.q.len() / t.max(1))
    }

    pub(super) fn q(&self, i: usize, dh: usize) -> &[T] {
        &self.q[i * dh..(i + 1) * dh]
    }

    pub(super) fn k(&self, j: usize, dh: usize) -> &[T] {
        &self.k[j * dh..(j + 1) * dh]
    }

    /// Token `m`'s `(w, β)`.
    pub(super) fn reflection(&self, m: usize, dh: usize) -> (&[T], T) {
        let row = &self.reflections[m * (dh + 1)..(m + 1) * (dh + 1)];
        (&row[..dh], row[dh])
    }
}

/// The two sides of a query: the keys before it, and after it. Each side is computed as the
/// keys before a query in the side's order: the tokens in order on the left; on the right in
/// reverse, with every reflection moved one place (the keys after query `i` score
/// `c q_iᵀ H_{i+1} ⋯ H_j k_j`, which in reverse order is the left's form with place `m` taking
/// token `t - m`'s reflection).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Left,
    Right,
}

impl Side {
    /// The head's token at place `p` of the side's order: in a walk, the query at step `p`,
    /// which is also the key of carried row `p`.
    #[inline(always)]
    fn token(self, p: usize, t: usize) -> usize {
        match self {
            Side::Left => p,
            Side::Right => t - 1 - p,
        }
    }

    /// The head's token whose reflection place `m` (> 0) of the side's order takes: the
    /// query's own on the left, the key just taken in on the right.
    #[inline(always)]
    fn reflection(self, m: usize, t: usize) -> usize {
        match self {
            Side::Left => m,
            Side::Right => t - m,
        }
    }
}

/// Which route each pass takes: blocks (`true`) or the walk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Route {
    pub forward_blocks: bool,
    pub backward_blocks: bool,
}

/// The walk's backward history past which its backward is slower than the blocks' even for
/// narrow heads (it then leaves the caches; in segments it also walks twice).
const WALK_HISTORY: usize = 6 << 20;

impl Route {
    /// For heads of `t` tokens `d_head` wide, values of `size` bytes: the blocks forward from
    /// heads 32 wide, backward from 16 or once the walk's history (`t² d_head / 2` values)
    /// passes a few MiB, as measured head by head against the walk (the book's performance page, "Measurements behind the code's choices").
    pub(super) fn of(t: usize, dh: usize, size: usize) -> Self {
        let history = t * t.saturating_sub(1) / 2 * dh * size;
        Self {
            forward_blocks: dh >= 32,
            backward_blocks: dh >= 16 || history > WALK_HISTORY,
        }
    }
}

/// A task's work space for the route its passes take, reused across heads.
pub(super) struct Work<T> {
    route: Route,
    walk: walk::Work<T>,
    blocks: blocks::Work<T>,
}

impl<T: Real> Work<T> {
    /// For heads of `t` tokens `d_head` wide; the backward's buffers only for a backward;
    /// nothing when `used` is false.
    pub(super) fn new(t: usize, dh: usize, used: bool, backward: bool) -> Self {
        let route = Route::of(t, dh, std::mem::size_of::<T>());
        let (fb, bb) = (route.forward_blocks, backward && route.backward_blocks);
        let walked = !route.forward_blocks || (backward && !route.backward_blocks);
        Self {
            route,
            walk: walk::Work::new(t, dh, used && walked, backward && !bb),
            blocks: blocks::Work::new(t, dh, used && (fb || bb), bb),
        }
    }
}

/// The head's scores `S` `(t, t)`, written in full: the diagonal `c q_i · k_i` here, the rest
/// by the route.
pub(super) fn forward<T: Real>(
    level: SimdLevel,
    head: Head<'_, T>,
    s: &mut [T],
    work: &mut Work<T>,
) {
    let (t, dh) = head.dims();
    for i in 0..t {
        let qk = head.q(i, dh).iter().zip(head.k(i, dh));
        s[i * t + i] = head.scale * qk.fold(T::zero(), |sum, (q, k)| sum + *q * *k);
    }
    match work.route.forward_blocks {
        true => blocks::forward(level, head, s, &mut work.blocks),
        false => walk::forward(level, head, s, &mut work.walk),
    }
}

/// The gradients of the head's q and k `(t, d_head)` and of its reflections `(t, d_head + 1)`
/// (each overwritten) from that of its scores `ds` `(t, t)`: the diagonal's here, the rest
/// added by the route.
pub(super) fn backward<T: Real>(
    level: SimdLevel,
    head: Head<'_, T>,
    ds: &[T],
    (dq, dk, dr): (&mut [T], &mut [T], &mut [T]),
    work: &mut Work<T>,
) {
    let (t, dh) = head.dims();
    dr.fill(T::zero());
    for i in 0..t {
        let g = head.scale * ds[i * t + i];
        let (dqi, dki) = (&mut dq[i * dh..(i + 1) * dh], &mut dk[i * dh..(i + 1) * dh]);
        let qk = head.q(i, dh).iter().zip(head.k(i, dh));
        for ((a, b), (q, k)) in dqi.iter_mut().zip(dki.iter_mut()).zip(qk) {
            *a = g * *k;
            *b = g * *q;
        }
    }
    let grads = (dq, dk, dr);
    match work.route.backward_blocks {
        true => blocks::backward(level, head, ds, grads, &mut work.blocks),
        false => walk::backward(level, head, ds, grads, &mut work.walk),
    }
}
