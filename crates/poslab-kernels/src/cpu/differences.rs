//! Two-sided differences of running sums, one fused node with its backward:
//!
//! ```text
//! out[n, i, j] = f[n, i] - f[n, j]      j <= i
//!              = g[n, j] - g[n, i]      j > i
//! ```
//!
//! for `f`, `g` of shape `(n, t)`: the sum of one sequence of per-token values between token `j`
//! and token `i`, taken from `f` for keys at or before the query and from `g` after it (a
//! content-set decay bias is built this way). The backward, for `dO` of shape `(n, t, t)`:
//!
//! ```text
//! df[k] = Σ_{j <= k} dO[k, j] - Σ_{i >= k} dO[i, k]
//! dg[k] = Σ_{i < k} dO[i, k] - Σ_{j > k} dO[k, j]
//! ```

use candle::backend::BackendStorage;
use candle::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::linear::by_dtype;
use super::{contiguous, Real, SimdLevel};

fn forward<T: Real>(f: &[T], g: &[T], t: usize) -> Vec<T> {
    let mut out = vec![T::zero(); f.len() * t];
    out.par_chunks_mut(t * t)
        .zip(f.par_chunks(t).zip(g.par_chunks(t)))
        .for_each(|(o, (f, g))| {
            for i in 0..t {
                let row = &mut o[i * t..(i + 1) * t];
                for j in 0..=i {
                    row[j] = f[i] - f[j];
                }
                for j in i + 1..t {
                    row[j] = g[j] - g[i];
                }
            }
        });
    out
}

/// The sums' gradient `[df; dg]` `(2 t)` from `dS` `(t, t)`.
///
/// Each value is summed in the order of one pass over `dS` row by row (`df[i] += v, df[j] -= v`
/// left of the diagonal, `dg[j] += v, dg[i] -= v` right of it): `df[k]` takes row `k`'s terms
/// `dS[k, j]` (`j <= k`) and then the column's `-dS[i, k]` (`i >= k`); `dg[k]` the column's
/// `dS[i, k]` (`i < k`), then row `k`'s `-dS[k, j]` (`j > k`). The column terms run along
/// contiguous rows of `dS`; the row terms, each row's own serial sum, eight rows side by side.
/// The two-sided differences' backward and the fused attention's sums both use it, so a bias
/// given as a table or as sums gets the same bits.
#[inline(always)]
fn sided_grad_body<T: Real>(ds: &[T], t: usize, dfg: &mut [T]) {
    const R: usize = 8;
    assert!(
        ds.len() >= t * t && dfg.len() >= 2 * t,
        "sided_grad: buffers too short"
    );
    let (df, dg) = dfg.split_at_mut(t);
    // `acc[r] += dS[k0 + r, j]` (`-dS` when `neg`) for every row of the block and `j` in `js`:
    // the range where every row takes the term. Full blocks call it with the constant R, so
    // the rows are unrolled and the sums stay in registers (measured: the book's performance page, "Measurements behind the code's choices").
    let rows_sum =
        |acc: &mut [T; R], k0: usize, rows: usize, js: std::ops::Range<usize>, neg: bool| {
            assert!(k0 + rows <= t && js.end <= t);
            for j in js {
                for (r, a) in acc[..rows].iter_mut().enumerate() {
                    // SAFETY: row k0 + r < t and column j < t of the t x t block (asserted);
                    // unchecked, as the bounds checks cost a quarter of the kernel's time.
                    let v = unsafe { *ds.get_unchecked((k0 + r) * t + j) };
                    *a += if neg { -v } else { v };
                }
            }
        };
    for k0 in (0..t).step_by(R) {
        // row terms of df: dS[k, j] for j <= k
        let rows = R.min(t - k0);
        let mut acc = [T::zero(); R];
        if rows == R {
            rows_sum(&mut acc, k0, R, 0..k0 + 1, false);
        } else {
            rows_sum(&mut acc, k0, rows, 0..k0 + 1, false);
        }
        for j in k0 + 1..k0 + rows {
            for (r, a) in acc[..rows].iter_mut().enumerate().skip(j - k0) {
                *a += ds[(k0 + r) * t + j];
            }
        }
        df[k0..k0 + rows].copy_from_slice(&acc[..rows]);
    }
    dg.fill(T::zero());
    for (i, row) in ds.chunks_exact(t).enumerate() {
        // column terms: -dS[i, k] into df[k] (k <= i), dS[i, k] into dg[k] (k > i)
        for (d, v) in df[..=i].iter_mut().zip(row) {
            *d += -*v;
        }
        for (d, v) in dg[i + 1..].iter_mut().zip(&row[i + 1..]) {
            *d += *v;
        }
    }
    for k0 in (0..t).step_by(R) {
        // row terms of dg: -dS[k, j] for j > k
        let rows = R.min(t - k0);
        let mut acc = [T::zero(); R];
        acc[..rows].copy_from_slice(&dg[k0..k0 + rows]);
        for j in k0 + 1..k0 + rows {
            for (r, a) in acc[..j - k0].iter_mut().enumerate() {
                *a += -ds[(k0 + r) * t + j];
            }
        }
        if rows == R {
            rows_sum(&mut acc, k0, R, k0 + R..t, true);
        } else {
            rows_sum(&mut acc, k0, rows, k0 + rows..t, true);
        }
        dg[k0..k0 + rows].copy_from_slice(&acc[..rows]);
    }
}

simd_dispatch!(pub(super) fn sided_grad = sided_grad_body(ds: &[T], t: usize, dfg: &mut [T]));

/// `(2, n, t)`: `df` then `dg`.
fn backward<T: Real>(simd: SimdLevel, grad: &[T], t: usize) -> Vec<T> {
    let n = grad.len() / (t * t);
    let parts: Vec<Vec<T>> = grad
        .par_chunks(t * t)
        .map(|d| {
            let mut dfg = vec![T::zero(); 2 * t];
            sided_grad(simd, d, t, &mut dfg);
            dfg
        })
        .collect();
    let mut out = Vec::with_capacity(2 * n * t);
    for half in [0..t, t..2 * t] {
        for dfg in &parts {
            out.extend_from_slice(&dfg[half.clone()]);
        }
    }
    out
}

struct SidedDifferences {
    simd: SimdLevel,
}

impl CustomOp2 for SidedDifferences {
    fn name(&self) -> &'static str {
        "poslab-sided-differences"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let what = "sided differences";
        let (n, t) = l1.shape().dims2()?;
        let storage = by_dtype!(s1.dtype(), what, |T| forward::<T>(
            contiguous(s1, l1, what)?,
            contiguous(s2, l2, what)?,
            t,
        ));
        Ok((storage, Shape::from((n, t, t))))
    }

    fn bwd(
        &self,
        _f: &Tensor,
        _g: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let op = SidedDifferencesGrad { simd: self.simd };
        let both = grad.contiguous()?.apply_op1_no_bwd(&op)?; // (2, n, t)
        Ok((Some(both.get(0)?), Some(both.get(1)?)))
    }
}

struct SidedDifferencesGrad {
    simd: SimdLevel,
}

impl CustomOp1 for SidedDifferencesGrad {
    fn name(&self) -> &'static str {
        "poslab-sided-differences-grad"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let what = "sided differences backward";
        let (n, t, _) = l.shape().dims3()?;
        let storage = by_dtype!(s.dtype(), what, |T| backward::<T>(
            self.simd,
            contiguous(s, l, what)?,
            t
        ));
        Ok((storage, Shape::from((2, n, t))))
    }
}

/// # Shapes
/// - `f`, `g`: `(n, t)`; returns `(n, t, t)`
pub fn sided_differences(f: &Tensor, g: &Tensor, simd: SimdLevel) -> Result<Tensor> {
    f.contiguous()?
        .apply_op2(&g.contiguous()?, SidedDifferences { simd })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reduction as one pass over `dS` row by row, the order [`sided_grad`] keeps.
    fn serial<T: Real>(ds: &[T], t: usize) -> Vec<T> {
        let (mut df, mut dg) = (vec![T::zero(); t], vec![T::zero(); t]);
        for i in 0..t {
            for (j, &v) in ds[i * t..(i + 1) * t].iter().enumerate() {
                if j <= i {
                    df[i] += v;
                    df[j] += -v;
                } else {
                    dg[j] += v;
                    dg[i] += -v;
                }
            }
        }
        df.extend(dg);
        df
    }

    fn agrees<T: Real>() {
        let mut x = 7u64;
        for t in [1, 5, 8, 13, 64, 70] {
            let ds: Vec<T> = (0..t * t)
                .map(|_| {
                    x = x
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    T::lit((x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0)
                })
                .collect();
            let want = serial(&ds, t);
            for level in [SimdLevel::Baseline, SimdLevel::Avx2, SimdLevel::Avx512] {
                let mut got = vec![T::lit(9.0); 2 * t];
                sided_grad(level, &ds, t, &mut got);
                assert!(
                    got.iter().zip(&want).all(|(a, b)| {
                        candle::WithDType::to_f64(*a).to_bits()
                            == candle::WithDType::to_f64(*b).to_bits()
                    }),
                    "t {t} at {level:?}: the sums differ from one pass row by row"
                );
            }
        }
    }

    #[test]
    fn the_reduction_sums_in_the_order_of_one_pass_row_by_row() {
        agrees::<f32>();
        agrees::<f64>();
    }
}
