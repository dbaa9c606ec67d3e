//! RoPE's rotation of queries and keys, fused, with its backward (the inverse rotation).

use candle::backend::BackendStorage;
use candle::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::*;

/// The rotation of RoPE on `(b, h, t, d_head)`, with `cos` and `sin` `(r, t, w)` laid out by the
/// pairing over the first `w` coordinates of each head (`r` 1 or `b`).
struct RopeOp {
    interleaved: bool,
    /// Rotate by minus the angle: the gradient of the forward rotation.
    inverse: bool,
    simd: SimdLevel,
}

/// RoPE's rotation of head rows by the angles of their positions, with cos and sin tables of
/// `width` columns per row laid out by the pairing; coordinates past `width` pass through.
/// `sign` -1 rotates back by the same angles (the gradient).
#[derive(Clone, Copy)]
pub struct Rotation<'a, T> {
    pub cos: &'a [T],
    pub sin: &'a [T],
    pub width: usize,
    pub interleaved: bool,
    pub sign: T,
}

impl<T: Real> Rotation<'_, T> {
    /// `out = R(sign · angles of table row p) x`, `x` one head row (at least `width` wide).
    #[inline(always)]
    pub fn apply(&self, x: &[T], p: usize, out: &mut [T]) {
        let w = self.width;
        let (c, s) = (&self.cos[p * w..(p + 1) * w], &self.sin[p * w..(p + 1) * w]);
        let half = w / 2;
        if self.interleaved {
            for i in 0..half {
                let (a, b) = (x[2 * i], x[2 * i + 1]);
                let (ci, si) = (c[2 * i], self.sign * s[2 * i]);
                out[2 * i] = a * ci - b * si;
                out[2 * i + 1] = b * ci + a * si;
            }
        } else {
            for i in 0..half {
                let (a, b) = (x[i], x[half + i]);
                let (ci, si) = (c[i], self.sign * s[i]);
                out[i] = a * ci - b * si;
                out[half + i] = b * ci + a * si;
            }
        }
        out[w..].copy_from_slice(&x[w..]);
    }

    /// The rows of batch element `bi` of tables with `rows` blocks of `t` rows each (`rows` 1:
    /// one block shared by the whole batch).
    pub fn for_batch(self, bi: usize, t: usize, rows: usize) -> Self {
        if rows == 1 {
            return self;
        }
        let block = t * self.width;
        Self {
            cos: &self.cos[bi * block..(bi + 1) * block],
            sin: &self.sin[bi * block..(bi + 1) * block],
            ..self
        }
    }
}

/// Rotates head rows of width `d`; row `r` (counted from `first` over the whole
/// `(b, h, t, d)` tensor) is at position `r mod t` of batch element `r / (h t)`.
#[inline(always)]
fn rope_rows_body<T: Real>(
    x: &[T],
    rotation: Rotation<'_, T>,
    (h, t, d): (usize, usize, usize),
    first: usize,
    out: &mut [T],
) {
    let rows = rotation.cos.len() / (t * rotation.width);
    for (r, (xr, o)) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)).enumerate() {
        let row = first + r;
        let block = if rows == 1 { 0 } else { row / (h * t) };
        rotation.apply(xr, block * t + row % t, o);
    }
}
simd_dispatch!(fn rope_rows = rope_rows_body(x: &[T], rotation: Rotation<'_, T>, dims: (usize, usize, usize), first: usize, out: &mut [T]));

impl RopeOp {
    fn run<T: Real>(&self, x: &[T], cos: &[T], sin: &[T], dims: &[usize], width: usize) -> Vec<T> {
        let (h, t, d) = (dims[1], dims[2], dims[3]);
        let mut out = zeros(x.len());
        let rows = rows_per_task(d);
        let sign = if self.inverse { -T::one() } else { T::one() };
        out.par_chunks_mut(rows * d)
            .zip(x.par_chunks(rows * d))
            .enumerate()
            .for_each(|(i, (o, xc))| {
                let rotation = Rotation {
                    cos,
                    sin,
                    width,
                    interleaved: self.interleaved,
                    sign,
                };
                rope_rows(self.simd, xc, rotation, (h, t, d), i * rows, o)
            });
        out
    }
}

impl CustomOp3 for RopeOp {
    fn name(&self) -> &'static str {
        "poslab-rope"
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
        let what = "rope";
        let dims = l1.dims();
        let width = *l2.dims().last().unwrap_or(&0);
        if dims.len() != 4 || l2.dims().len() != 3 || width == 0 || width > dims[3] {
            candle::bail!(
                "fused rope: x {dims:?} must be (b, h, t, d_head) and the tables {:?} (r, t, w)                  with 0 < w <= d_head",
                l2.dims()
            );
        }
        let storage = by_dtype!(s1.dtype(), what, |T| self.run::<T>(
            contiguous(s1, l1, what)?,
            contiguous(s2, l2, what)?,
            contiguous(s3, l3, what)?,
            dims,
            width
        ));
        Ok((storage, l1.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let back = RopeOp {
            interleaved: self.interleaved,
            inverse: !self.inverse,
            simd: self.simd,
        };
        Ok((
            Some(g.contiguous()?.apply_op3_no_bwd(cos, sin, &back)?),
            None,
            None,
        ))
    }
}

/// RoPE of `x` `(b, h, t, d_head)` with the `(r, t, w)` tables of its pairing, fused.
pub fn rope(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    interleaved: bool,
    simd: SimdLevel,
) -> Result<Tensor> {
    x.contiguous()?.apply_op3(
        &cos.contiguous()?,
        &sin.contiguous()?,
        RopeOp {
            interleaved,
            inverse: false,
            simd,
        },
    )
}
