//! CoPE's term as one CPU node with a hand-written backward: from the scaled content scores `a`
//! `(b, h, t, t)` and each query's table products `R = q [E_left; E_right]ᵀ` `(b, h, t, 2 npos)`,
//! the scores `a + z`, computed a row (one query) at a time:
//!
//! ```text
//! g_j = σ(a_j) (0 at a padded key);   F_j = Σ_{j' <= j} g_j'
//! p_j = F_i - F_j + g_j   (j <= i),   F_j - F_i + g_i   (j > i)
//! z_j = R[s + ⌊p'⌋] + (p' - ⌊p'⌋) (R[s + ⌈p'⌉] - R[s + ⌊p'⌋]),  p' = min(p_j, npos - 1),
//!       s = 0 (j <= i) or npos (j > i)
//! ```
//!
//! The backward, for `dO` of one row:
//!
//! ```text
//! dR[s + ⌊p'⌋] += dO_j (1 - w_j),  dR[s + ⌈p'⌉] += dO_j w_j
//! dp_j = dO_j (R[s + ⌈p'⌉] - R[s + ⌊p'⌋]) where p_j < npos - 1 (half at equality, as
//!        `minimum`'s gradient), else 0
//! dg_t = Σ_{j <= t} dp_j (t <= i),  Σ_{j >= t} dp_j (t > i),  plus Σ_{j > i} dp_j at t = i
//! da_j = dO_j + dg_j σ(a_j)(1 - σ(a_j))  (the gate's part 0 at a padded key)
//! ```
//!
//! Each row is computed in f64 and rounded once. The composition in `mod.rs` stays the
//! specification; the tests hold this node to it, forward and backward.

use candle::backend::BackendStorage;
use candle::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor, WithDType};
use rayon::prelude::*;

/// The shapes and mask of one application.
#[derive(Clone, Debug)]
pub(super) struct CopeTerm {
    /// `(b, t)`: whether each token is real.
    pub real: Vec<bool>,
    pub b: usize,
    pub h: usize,
    pub t: usize,
    pub npos: usize,
}

fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// One row's gates (`σ` and the mask), and their prefix sums.
fn gates(a: &[f64], real: &[bool]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let t = a.len();
    let (mut sig, mut g, mut f) = (vec![0.0; t], vec![0.0; t], vec![0.0; t]);
    let mut acc = 0.0;
    for j in 0..t {
        sig[j] = sigmoid(a[j]);
        g[j] = if real[j] { sig[j] } else { 0.0 };
        acc += g[j];
        f[j] = acc;
    }
    (sig, g, f)
}

/// The count of key `j` for query `i`, its rows `(lo, hi)` in the stacked table and the weight
/// of `hi`; and `minimum`'s gradient factor (1 below the clamp, 0.5 at it, 0 above).
fn read(g: &[f64], f: &[f64], i: usize, j: usize, npos: usize) -> (usize, usize, f64, f64) {
    let p = match j <= i {
        true => f[i] - f[j] + g[j],
        false => f[j] - f[i] + g[i],
    };
    let top = (npos - 1) as f64;
    let c = p.min(top);
    let through = match p.partial_cmp(&top) {
        Some(std::cmp::Ordering::Less) => 1.0,
        Some(std::cmp::Ordering::Equal) => 0.5,
        _ => 0.0,
    };
    let lo = c.floor().max(0.0);
    let hi = c.ceil().max(0.0);
    let side = if j <= i { 0 } else { npos };
    (side + lo as usize, side + hi as usize, c - lo, through)
}

fn to_f64<T: WithDType>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

impl CopeTerm {
    fn forward<T: WithDType>(&self, a: &[T], r: &[T]) -> Vec<T> {
        let (h, t, w2) = (self.h, self.t, 2 * self.npos);
        let mut out = vec![T::zero(); a.len()];
        out.par_chunks_mut(t).enumerate().for_each(|(row, o)| {
            let (bi, i) = (row / (h * t), row % t);
            let a = to_f64(&a[row * t..(row + 1) * t]);
            let r = to_f64(&r[row * w2..(row + 1) * w2]);
            let (_, g, f) = gates(&a, &self.real[bi * t..(bi + 1) * t]);
            for j in 0..t {
                let (lo, hi, w, _) = read(&g, &f, i, j, self.npos);
                o[j] = T::from_f64(a[j] + r[lo] + w * (r[hi] - r[lo]));
            }
        });
        out
    }

    /// `[da; dR]`, flat: `(b, h, t, t)` then `(b, h, t, 2 npos)`.
    fn backward<T: WithDType>(&self, a: &[T], r: &[T], d_out: &[T]) -> Vec<T> {
        let (h, t, w2) = (self.h, self.t, 2 * self.npos);
        let rows = self.b * h * t;
        let mut da = vec![T::zero(); rows * t];
        let mut dr = vec![T::zero(); rows * w2];
        da.par_chunks_mut(t)
            .zip(dr.par_chunks_mut(w2))
            .enumerate()
            .for_each(|(row, (da, dr))| {
                let (bi, i) = (row / (h * t), row % t);
                let real = &self.real[bi * t..(bi + 1) * t];
                let a = to_f64(&a[row * t..(row + 1) * t]);
                let r = to_f64(&r[row * w2..(row + 1) * w2]);
                let d = to_f64(&d_out[row * t..(row + 1) * t]);
                let (sig, g, f) = gates(&a, real);
                let mut dr_row = vec![0.0; w2];
                let mut dp = vec![0.0; t];
                for j in 0..t {
                    let (lo, hi, w, through) = read(&g, &f, i, j, self.npos);
                    dr_row[lo] += d[j] * (1.0 - w);
                    dr_row[hi] += d[j] * w;
                    dp[j] = through * d[j] * (r[hi] - r[lo]);
                }
                let mut dg = vec![0.0; t];
                let mut left = 0.0;
                for k in 0..=i {
                    left += dp[k];
                    dg[k] = left;
                }
                let mut right = 0.0;
                for k in (i + 1..t).rev() {
                    right += dp[k];
                    dg[k] = right;
                }
                dg[i] += right;
                for j in 0..t {
                    let gate = if real[j] {
                        dg[j] * sig[j] * (1.0 - sig[j])
                    } else {
                        0.0
                    };
                    da[j] = T::from_f64(d[j] + gate);
                }
                for (o, v) in dr.iter_mut().zip(&dr_row) {
                    *o = T::from_f64(*v);
                }
            });
        da.extend(dr);
        da
    }
}

fn slice<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout) -> candle::Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s.as_slice::<T>()?[a..b]),
        None => candle::bail!("cope term: the inputs must be contiguous"),
    }
}

impl CustomOp2 for CopeTerm {
    fn name(&self) -> &'static str {
        "poslab-cope-term"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle::Result<(CpuStorage, Shape)> {
        let storage = match s1.dtype() {
            DType::F32 => f32::to_cpu_storage_owned(self.forward(slice(s1, l1)?, slice(s2, l2)?)),
            DType::F64 => f64::to_cpu_storage_owned(self.forward(slice(s1, l1)?, slice(s2, l2)?)),
            dt => candle::bail!("cope term runs on f32 and f64, not {dt:?}"),
        };
        Ok((storage, l1.shape().clone()))
    }

    fn bwd(
        &self,
        a: &Tensor,
        r: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> candle::Result<(Option<Tensor>, Option<Tensor>)> {
        let both = a.apply_op3_no_bwd(r, &grad.contiguous()?, &CopeTermGrad(self.clone()))?;
        let n = a.elem_count();
        let da = both.narrow(0, 0, n)?.reshape(a.shape())?;
        let dr = both.narrow(0, n, r.elem_count())?.reshape(r.shape())?;
        Ok((Some(da), Some(dr)))
    }
}

struct CopeTermGrad(CopeTerm);

impl CustomOp3 for CopeTermGrad {
    fn name(&self) -> &'static str {
        "poslab-cope-term-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle::Result<(CpuStorage, Shape)> {
        let n = l1.shape().elem_count() + l2.shape().elem_count();
        let storage = match s1.dtype() {
            DType::F32 => f32::to_cpu_storage_owned(self.0.backward::<f32>(
                slice(s1, l1)?,
                slice(s2, l2)?,
                slice(s3, l3)?,
            )),
            DType::F64 => f64::to_cpu_storage_owned(self.0.backward::<f64>(
                slice(s1, l1)?,
                slice(s2, l2)?,
                slice(s3, l3)?,
            )),
            dt => candle::bail!("cope term runs on f32 and f64, not {dt:?}"),
        };
        Ok((storage, Shape::from(n)))
    }
}

/// The scores `a + z` as one node.
///
/// # Shapes
/// - `a`: `(b, h, t, t)`; `r`: `(b, h, t, 2 npos)`; `real`: `b · t` flags
pub(super) fn cope_scores(a: &Tensor, r: &Tensor, real: Vec<bool>) -> candle::Result<Tensor> {
    let (b, h, t, _) = a.dims4()?;
    let npos = r.dim(3)? / 2;
    a.contiguous()?.apply_op2(
        &r.contiguous()?,
        CopeTerm {
            real,
            b,
            h,
            t,
            npos,
        },
    )
}
