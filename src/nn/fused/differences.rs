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
use super::{contiguous, Real};

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

/// `(2, n, t)`: `df` then `dg`.
fn backward<T: Real>(grad: &[T], t: usize) -> Vec<T> {
    let n = grad.len() / (t * t);
    let mut parts: Vec<(Vec<T>, Vec<T>)> = grad
        .par_chunks(t * t)
        .map(|d| {
            let (mut df, mut dg) = (vec![T::zero(); t], vec![T::zero(); t]);
            for i in 0..t {
                let row = &d[i * t..(i + 1) * t];
                for (j, &v) in row.iter().enumerate() {
                    if j <= i {
                        df[i] += v;
                        df[j] += -v;
                    } else {
                        dg[j] += v;
                        dg[i] += -v;
                    }
                }
            }
            (df, dg)
        })
        .collect();
    let mut out = Vec::with_capacity(2 * n * t);
    for (df, _) in &parts {
        out.extend_from_slice(df);
    }
    for (_, dg) in parts.iter_mut() {
        out.append(dg);
    }
    out
}

struct SidedDifferences;

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
        let both = grad.contiguous()?.apply_op1_no_bwd(&SidedDifferencesGrad)?; // (2, n, t)
        Ok((Some(both.get(0)?), Some(both.get(1)?)))
    }
}

struct SidedDifferencesGrad;

impl CustomOp1 for SidedDifferencesGrad {
    fn name(&self) -> &'static str {
        "poslab-sided-differences-grad"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let what = "sided differences backward";
        let (n, t, _) = l.shape().dims3()?;
        let storage = by_dtype!(s.dtype(), what, |T| backward::<T>(
            contiguous(s, l, what)?,
            t
        ));
        Ok((storage, Shape::from((2, n, t))))
    }
}

/// # Shapes
/// - `f`, `g`: `(n, t)`; returns `(n, t, t)`
pub(crate) fn sided_differences(f: &Tensor, g: &Tensor) -> Result<Tensor> {
    f.contiguous()?
        .apply_op2(&g.contiguous()?, SidedDifferences)
}
