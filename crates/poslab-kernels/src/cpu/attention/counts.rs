//! Gate-counted scores ([`crate::nn::GateCounts`]) a query's row at a time, inside the fused
//! attention: from the row's scaled content scores `a` `(t)` and its products with the stacked
//! tables `R = q [E_left; E_right]ᵀ` `(2 npos)`, the scores `a + z`:
//!
//! ```text
//! g_j = σ(a_j) (0 at a padded key);   F_j = Σ_{j' <= j} g_j'
//! p_j = F_i - F_j + g_j   (j <= i),   F_j - F_i + g_i   (j > i)
//! z_j = R[s + ⌊p'⌋] + (p' - ⌊p'⌋) (R[s + ⌈p'⌉] - R[s + ⌊p'⌋]),  p' = min(p_j, npos - 1),
//!       s = 0 (j <= i) or npos (j > i)
//! ```
//!
//! and the backward, for the row's score gradient `dS`:
//!
//! ```text
//! dR[s + ⌊p'⌋] += dS_j (1 - w_j),  dR[s + ⌈p'⌉] += dS_j w_j
//! dp_j = dS_j (R[s + ⌈p'⌉] - R[s + ⌊p'⌋]) where p_j < npos - 1 (half at equality, as
//!        `minimum`'s gradient), else 0
//! dg_t = Σ_{j <= t} dp_j (t <= i),  Σ_{j >= t} dp_j (t > i),  plus Σ_{j > i} dp_j at t = i
//! da_j = dS_j + dg_j σ(a_j)(1 - σ(a_j))  (the gate's part 0 at a padded key)
//! ```
//!
//! The gates are computed in the row's type (vectorised); their running sums, the counts and
//! the interpolation in f64, each value rounded once.

use super::{sigmoid, Real};
use candle::WithDType;

/// A row's work space, reused across rows: the sigmoids, the gates and their running sums, and
/// the counts' gradient.
pub(super) struct RowWork<T> {
    sig: Vec<T>,
    g: Vec<f64>,
    f: Vec<f64>,
    dp: Vec<f64>,
    dr: Vec<f64>,
    rr: Vec<f64>,
    step: Vec<f64>,
}

impl<T: Real> RowWork<T> {
    /// For rows of `t` keys and tables of `npos` rows each (empty when `npos` is 0).
    pub(super) fn new(t: usize, npos: usize) -> Self {
        let len = if npos == 0 { 0 } else { t };
        Self {
            sig: vec![T::zero(); len],
            g: vec![0.0; len],
            f: vec![0.0; len],
            dp: vec![0.0; len],
            dr: vec![0.0; 2 * npos],
            rr: vec![0.0; 2 * npos],
            step: vec![0.0; 2 * npos],
        }
    }
}

/// One head's rows: its content scores `a` `(t, t)`, their products with the stacked tables
/// `r` `(t, 2 npos)`, and which keys are real `(t)`.
#[derive(Clone, Copy)]
pub(super) struct Rows<'a, T> {
    pub a: &'a [T],
    pub r: &'a [T],
    pub real: &'a [bool],
    pub npos: usize,
}

impl<'a, T> Rows<'a, T> {
    /// Query `i`'s row: its content scores and table products.
    #[inline(always)]
    fn row(&self, i: usize) -> (Row<'a>, (&'a [T], &'a [T])) {
        let (t, w2) = (self.real.len(), 2 * self.npos);
        let row = Row {
            i,
            real: self.real,
            npos: self.npos,
        };
        (
            row,
            (&self.a[i * t..(i + 1) * t], &self.r[i * w2..(i + 1) * w2]),
        )
    }
}

/// The scores `s = a + z` `(t, t)` of a head's rows.
#[inline(always)]
fn forward_rows_body<T: Real>(rows: Rows<'_, T>, s: &mut [T], w: &mut RowWork<T>) {
    for (i, s) in s.chunks_exact_mut(rows.real.len()).enumerate() {
        let (row, ar) = rows.row(i);
        row.forward(ar, s, w);
    }
}

simd_dispatch!(pub(super) fn forward_rows = forward_rows_body(rows: Rows<'_, T>, s: &mut [T], w: &mut RowWork<T>));

/// From the scores' gradient `ds` `(t, t)` of a head: the content scores' gradient, in place,
/// and the table products' gradient `dr` `(t, 2 npos)`.
#[inline(always)]
fn backward_rows_body<T: Real>(rows: Rows<'_, T>, ds: &mut [T], dr: &mut [T], w: &mut RowWork<T>) {
    let (t, w2) = (rows.real.len(), 2 * rows.npos);
    for (i, (ds, dr)) in ds
        .chunks_exact_mut(t)
        .zip(dr.chunks_exact_mut(w2))
        .enumerate()
    {
        let (row, ar) = rows.row(i);
        row.backward(ar, ds, dr, w);
    }
}

simd_dispatch!(pub(super) fn backward_rows = backward_rows_body(rows: Rows<'_, T>, ds: &mut [T], dr: &mut [T], w: &mut RowWork<T>));

/// One query's row: its index, the keys that count, the tables' rows.
#[derive(Clone, Copy)]
struct Row<'a> {
    i: usize,
    real: &'a [bool],
    npos: usize,
}

#[inline(always)]
fn f64_of<T: Real>(x: T) -> f64 {
    <T as WithDType>::to_f64(x)
}

impl Row<'_> {
    /// The gates of content row `a` and their running sums, into `w`.
    #[inline(always)]
    fn gates<T: Real>(&self, a: &[T], w: &mut RowWork<T>) {
        for (s, a) in w.sig.iter_mut().zip(a) {
            *s = sigmoid(*a);
        }
        let mut acc = 0.0;
        for j in 0..a.len() {
            let g = if self.real[j] { f64_of(w.sig[j]) } else { 0.0 };
            w.g[j] = g;
            acc += g;
            w.f[j] = acc;
        }
    }

    /// `s = a + z` for content row `a` and table products `r`.
    #[inline(always)]
    fn forward<T: Real>(&self, (a, r): (&[T], &[T]), s: &mut [T], w: &mut RowWork<T>) {
        self.gates(a, w);
        // The products in f64, and each row's step to the next (0 past a table's last row,
        // where only a weight of 0 reads it): z = R[lo] + w (R[hi] - R[lo]) with hi = lo + 1
        // or w = 0, the same value.
        self.steps(r, w);
        for (j, s) in s.iter_mut().enumerate() {
            let (_, frac, k) = self.count(w, j);
            *s = T::from_f64(f64_of(a[j]) + w.rr[k] + frac * w.step[k]);
        }
    }

    /// The table products `r` in f64 into `w.rr`, and each row's step to the next into
    /// `w.step` (0 at a table's last row).
    #[inline(always)]
    fn steps<T: Real>(&self, r: &[T], w: &mut RowWork<T>) {
        let npos = self.npos;
        for (o, v) in w.rr.iter_mut().zip(r) {
            *o = f64_of(*v);
        }
        for side in [0, npos] {
            for k in side..side + npos - 1 {
                w.step[k] = w.rr[k + 1] - w.rr[k];
            }
            w.step[side + npos - 1] = 0.0;
        }
    }

    /// Key `j`'s count `p`, the weight `c - ⌊c⌋` of the clamped count `c`'s next row, and the
    /// row `k` of the stacked tables it reads first (`⌊c⌋` of its side's table). Counts are
    /// never negative (the running sums never fall), so the cast floors; NaN reads row 0.
    #[inline(always)]
    fn count<T>(&self, w: &RowWork<T>, j: usize) -> (f64, f64, usize) {
        let i = self.i;
        let (p, side) = match j <= i {
            true => (w.f[i] - w.f[j] + w.g[j], 0),
            false => (w.f[j] - w.f[i] + w.g[i], self.npos),
        };
        let c = p.min((self.npos - 1) as f64);
        let lo = c as usize;
        (p, c - lo as f64, side + lo)
    }

    /// From the scores' gradient `ds` of the row: the content scores' gradient, in place of
    /// `ds`, and the table products' gradient into `dr` `(2 npos)`.
    #[inline(always)]
    fn backward<T: Real>(
        &self,
        (a, r): (&[T], &[T]),
        ds: &mut [T],
        dr: &mut [T],
        w: &mut RowWork<T>,
    ) {
        self.gates(a, w);
        self.steps(r, w);
        let (t, top) = (a.len(), (self.npos - 1) as f64);
        w.dr.fill(0.0);
        for (j, d) in ds.iter().enumerate() {
            let (p, frac, k) = self.count(w, j);
            let d = f64_of(*d);
            // The clamp's gradient factor: 1 below it, 0.5 at it (as `minimum`'s), 0 above.
            let through = match p.partial_cmp(&top) {
                Some(std::cmp::Ordering::Less) => 1.0,
                Some(std::cmp::Ordering::Equal) => 0.5,
                _ => 0.0,
            };
            w.dr[k] += d * (1.0 - frac);
            // An integer count reads one row: no weight on the next, no gradient of the count.
            w.dp[j] = match frac > 0.0 {
                true => {
                    w.dr[k + 1] += d * frac;
                    through * d * w.step[k]
                }
                false => 0.0,
            };
        }
        // dp becomes dg: running sums from the query outwards on each side.
        let i = self.i;
        let mut left = 0.0;
        for k in 0..=i {
            left += w.dp[k];
            w.dp[k] = left;
        }
        let mut right = 0.0;
        for k in (i + 1..t).rev() {
            right += w.dp[k];
            w.dp[k] = right;
        }
        w.dp[i] += right;
        for (j, ds) in ds.iter_mut().enumerate() {
            let gate = match self.real[j] {
                true => {
                    let s = f64_of(w.sig[j]);
                    w.dp[j] * s * (1.0 - s)
                }
                false => 0.0,
            };
            *ds = T::from_f64(f64_of(*ds) + gate);
        }
        for (o, v) in dr.iter_mut().zip(&w.dr) {
            *o = T::from_f64(*v);
        }
    }
}
