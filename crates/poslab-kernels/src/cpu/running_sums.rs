//! Running sums along the tokens, laid out group by group, fused, with the backward:
//!
//! ```text
//! out[s, b, c, i] = Σ_{j <= i} x[b, j, s C + c]        x (b, t, S C) -> out (S, b, C, t)
//! dx[b, j, s C + c] = Σ_{i >= j} dout[s, b, c, i]
//! ```
//!
//! The composition (`nn::running_sums` off the fused path) transposes, runs candle's `cumsum`
//! (a product with a `t x t` triangle of ones) and transposes again: about ten nodes with their
//! copies and gradient buffers. Here it is one pass each way, with the composition's bits
//! wherever gemm sums that product in order ([`in_order`]): each output from zero in order of
//! the tokens (the triangle's zeros add nothing to a sum that starts at `+0`), as these loops
//! do, forward and backward. Elsewhere (a few rows, or one or two tokens, or more than 256)
//! `nn::running_sums` keeps the composition.

use candle::backend::BackendStorage;
use candle::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::linear::{by_dtype, gemm_sums_in_order};
use super::{contiguous, Real};

/// Where channel `ch` of batch element `bi` starts in the `(S, b, C, t)` layout.
#[inline(always)]
fn group_major(ch: usize, bi: usize, (b, t, c): (usize, usize, usize)) -> usize {
    let (s, cc) = (ch / c, ch % c);
    ((s * b + bi) * c + cc) * t
}

pub use crate::spec::group_channels;

/// `(S, b, C, t)` running sums of `x` `(b, t, S C)`.
pub(super) fn forward<T: Real>(x: &[T], (b, t, groups, c): (usize, usize, usize, usize)) -> Vec<T> {
    let width = groups * c;
    // Each batch element's sums, as (t, S C), then laid out group by group.
    let per_batch: Vec<Vec<T>> = x
        .par_chunks(t * width)
        .map(|xb| {
            let mut acc = vec![T::zero(); width];
            let mut out = Vec::with_capacity(t * width);
            for row in xb.chunks_exact(width) {
                for (a, v) in acc.iter_mut().zip(row) {
                    *a += *v;
                }
                out.extend_from_slice(&acc);
            }
            out
        })
        .collect();
    let mut out = vec![T::zero(); b * t * width];
    for (bi, sums) in per_batch.iter().enumerate() {
        for (i, row) in sums.chunks_exact(width).enumerate() {
            for (ch, v) in row.iter().enumerate() {
                out[group_major(ch, bi, (b, t, c)) + i] = *v;
            }
        }
    }
    out
}

/// `dx` `(b, t, S C)` from `dout` `(S, b, C, t)`: each value the sum of `dout` from its token
/// to the last, in order of the tokens.
pub(super) fn backward<T: Real>(
    g: &[T],
    (b, t, groups, c): (usize, usize, usize, usize),
) -> Vec<T> {
    let width = groups * c;
    let mut dx = vec![T::zero(); b * t * width];
    dx.par_chunks_mut(t * width)
        .enumerate()
        .for_each(|(bi, dxb)| {
            // this batch element's gradient as (t, S C)
            let mut rows = vec![T::zero(); t * width];
            for ch in 0..width {
                let at = group_major(ch, bi, (b, t, c));
                for (i, v) in g[at..at + t].iter().enumerate() {
                    rows[i * width + ch] = *v;
                }
            }
            for (j, out) in dxb.chunks_exact_mut(width).enumerate() {
                for row in rows[j * width..].chunks_exact(width) {
                    for (o, v) in out.iter_mut().zip(row) {
                        *o += *v;
                    }
                }
            }
        });
    dx
}

/// The op on `x` `(b, t, S C)`.
struct RunningSums {
    groups: usize,
}

impl RunningSums {
    fn dims(&self, l: &Layout) -> Result<(usize, usize, usize, usize)> {
        let (b, t, width) = l.shape().dims3()?;
        Ok((b, t, self.groups, group_channels(width, self.groups)?))
    }
}

impl CustomOp1 for RunningSums {
    fn name(&self) -> &'static str {
        "poslab-running-sums"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let what = "running sums";
        let dims = self.dims(l)?;
        let storage = by_dtype!(s.dtype(), what, |T| forward::<T>(
            contiguous(s, l, what)?,
            dims
        ));
        let (b, t, groups, c) = dims;
        Ok((storage, Shape::from((groups, b, c, t))))
    }

    fn bwd(&self, x: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let op = RunningSumsGrad {
            dims: self.dims(x.layout())?,
        };
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&op)?))
    }
}

struct RunningSumsGrad {
    dims: (usize, usize, usize, usize),
}

impl CustomOp1 for RunningSumsGrad {
    fn name(&self) -> &'static str {
        "poslab-running-sums-grad"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let what = "running sums backward";
        let (b, t, groups, c) = self.dims;
        if l.dims() != [groups, b, c, t] {
            candle::bail!(
                "running sums backward: gradient {:?}, expected {:?}",
                l.dims(),
                [groups, b, c, t]
            );
        }
        let storage = by_dtype!(s.dtype(), what, |T| backward::<T>(
            contiguous(s, l, what)?,
            self.dims
        ));
        Ok((storage, Shape::from((b, t, groups * c))))
    }
}

/// Whether the fused op gives the composition's bits for `x` `(b, t, width)`: where gemm sums
/// the composition's product (`b · width` rows, a `t x t` triangle) in order, forward and
/// backward.
pub fn in_order((b, t, width): (usize, usize, usize)) -> bool {
    gemm_sums_in_order((b * width, t, t))
}

/// Running sums along the tokens of `x` `(b, t, groups · c)`, as `(groups, b, c, t)`.
pub fn running_sums(x: &Tensor, groups: usize) -> Result<Tensor> {
    x.contiguous()?.apply_op1(RunningSums { groups })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_fused_op_runs_where_gemm_sums_in_order_and_only_there() {
        assert!(super::in_order((3, 37, 10)) && super::in_order((2, 64, 16)));
        assert!(super::in_order((32, 3, 16)));
        assert!(!super::in_order((1, 5, 3)) && !super::in_order((4, 1, 4)));
        assert!(!super::in_order((2, 300, 16)));
    }
}
