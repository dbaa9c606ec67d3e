//! Reductions the kernels share: a row's sums, maxima and dot products in 16 independent lanes
//! (so they vectorise), several rows at once, and sums over a batch in a fixed order, so that
//! the bits depend on neither the threads nor the instruction sets.

use rayon::prelude::*;

use super::{zeros, Real};

/// Rows the row-wise kernels (softmax, LayerNorm) reduce together: see [`row_folds`]; 16 was
/// the fastest of 1 to 32 (the book's performance page, "Measurements behind the code's choices").
pub(super) const FOLD_ROWS: usize = 16;

/// One reduction of each of `R` rows of `t` values (`a` and `b` hold them in turn):
/// `value(a_i, b_i)` accumulated by `step` from `init` in 16 independent lanes (so it
/// vectorises), the lanes then folded in order by `step` from `init`, then the row's last `t % 16`
/// values. Each row's result has the bits of that row reduced alone (`R` = 1); with `R` > 1 the
/// rows' serial folds are interleaved, `R` independent chains the core runs side by side,
/// instead of one 16-step chain after another (with rows of 64, those chains were most of a
/// softmax's time).
#[inline(always)]
fn row_folds<T: Real, const R: usize>(
    (a, b): (&[T], &[T]),
    t: usize,
    init: T,
    value: impl Fn(T, T) -> T,
    step: impl Fn(T, T) -> T,
) -> [T; R] {
    assert!(
        a.len() >= R * t && b.len() >= R * t,
        "row folds: {R} rows of {t}"
    );
    let mut lanes = [[init; 16]; R];
    for (r, acc) in lanes.iter_mut().enumerate() {
        let (ar, br) = (&a[r * t..(r + 1) * t], &b[r * t..(r + 1) * t]);
        for (ca, cb) in ar.chunks_exact(16).zip(br.chunks_exact(16)) {
            for i in 0..16 {
                acc[i] = step(acc[i], value(ca[i], cb[i]));
            }
        }
    }
    // Lane i of every row, then lane i + 1: each row's chain in its own order, the rows side
    // by side. (Storing the lanes transposed instead, so that this reads whole vectors, was
    // slower: the lane-by-lane stores stall the vector loads after them.)
    let mut s = [init; R];
    #[allow(clippy::needless_range_loop)]
    for i in 0..16 {
        for r in 0..R {
            s[r] = step(s[r], lanes[r][i]);
        }
    }
    for e in t / 16 * 16..t {
        for (r, s) in s.iter_mut().enumerate() {
            *s = step(*s, value(a[r * t + e], b[r * t + e]));
        }
    }
    s
}

/// The sum of each of `R` rows of `t` values, in lanes ([`row_folds`]).
#[inline(always)]
pub(super) fn sums<T: Real, const R: usize>(x: &[T], t: usize) -> [T; R] {
    row_folds((x, x), t, T::zero(), |v, _| v, |s, v| s + v)
}

/// The largest value of each of `R` rows of `t` values (-inf for empty rows), in lanes.
#[inline(always)]
pub(super) fn maxes<T: Real, const R: usize>(x: &[T], t: usize) -> [T; R] {
    row_folds(
        (x, x),
        t,
        T::neg_infinity(),
        |v, _| v,
        |m, v| if v > m { v } else { m },
    )
}

/// `sum_i a_i b_i` of each of `R` rows of `t` values, in lanes.
#[inline(always)]
pub(super) fn dots<T: Real, const R: usize>(a: &[T], b: &[T], t: usize) -> [T; R] {
    row_folds((a, b), t, T::zero(), |x, y| x * y, |s, v| s + v)
}

/// Where `len` values in rows of `t` split: the rows in whole blocks of [`FOLD_ROWS`] end at
/// the returned index; the rest are taken one by one.
///
/// The kernels write their two loops (blocks, then single rows) out rather than hand a closure
/// to a shared walker: a closure is compiled as a function of its own, without the instruction
/// sets `simd_dispatch!` enables around the body, which made the forward about three times
/// slower (the book's performance page, "Measurements behind the code's choices").
#[inline(always)]
pub(super) fn whole_blocks(len: usize, t: usize) -> usize {
    len / (FOLD_ROWS * t).max(1) * FOLD_ROWS * t
}

/// The sum of `b` equal blocks of `all`, each value in a fixed order (block 0 first), so the
/// bits do not depend on the threads.
pub(super) fn batch_sum<T: Real>(all: &[T], b: usize) -> Vec<T> {
    let per = all.len() / b.max(1);
    let mut sum = zeros::<T>(per);
    sum.par_chunks_mut(1 << 14)
        .enumerate()
        .for_each(|(c, out)| {
            let at = c * (1 << 14);
            for bi in 0..b {
                let src = &all[bi * per + at..bi * per + at + out.len()];
                for (o, v) in out.iter_mut().zip(src) {
                    *o += *v;
                }
            }
        });
    sum
}
