//! AdamW's update in place, two passes over memory and no temporaries: the moments
//! `[m; v]` (one tensor) from the gradient, then the weights from the moments.
//!
//! The composition in `train::optim` allocates about ten tensors of every parameter's size per
//! step; this does the same arithmetic in the same order of operations per element.

use candle::backend::BackendStorage;
use candle::{CpuStorage, InplaceOp2, Layout, Result, Tensor};
use rayon::prelude::*;

use super::{contiguous, Real};

const CHUNK: usize = 1 << 14;

/// `m = b1 m + (1 - b1) s g`, `v = b2 v + (1 - b2) (s g)²` on `mv = [m; v]`.
struct Moments {
    beta1: f64,
    beta2: f64,
    grad_scale: f64,
}

impl Moments {
    fn run<T: Real>(&self, mv: &mut [T], g: &[T]) {
        let n = g.len();
        let (m, v) = mv.split_at_mut(n);
        let (b1, b2, s) = (
            T::lit(self.beta1),
            T::lit(self.beta2),
            T::lit(self.grad_scale),
        );
        let (c1, c2) = (T::lit(1.0 - self.beta1), T::lit(1.0 - self.beta2));
        let scaled = self.grad_scale != 1.0;
        m.par_chunks_mut(CHUNK)
            .zip(v.par_chunks_mut(CHUNK))
            .zip(g.par_chunks(CHUNK))
            .for_each(|((m, v), g)| {
                for ((m, v), g) in m.iter_mut().zip(v.iter_mut()).zip(g) {
                    let g = if scaled { *g * s } else { *g };
                    *m = *m * b1 + g * c1;
                    *v = *v * b2 + g * g * c2;
                }
            });
    }
}

/// `w = w (1 - lr wd) - lr (m / bias1) / (sqrt(v / bias2) + eps)`.
struct Update {
    lr: f64,
    decay_factor: f64,
    bias1: f64,
    bias2: f64,
    eps: f64,
}

impl Update {
    fn run<T: Real>(&self, w: &mut [T], mv: &[T]) {
        let n = w.len();
        let (m, v) = mv.split_at(n);
        let (lr, keep) = (T::lit(self.lr), T::lit(self.decay_factor));
        let (bias1, bias2, eps) = (T::lit(self.bias1), T::lit(self.bias2), T::lit(self.eps));
        let decays = self.decay_factor != 1.0;
        w.par_chunks_mut(CHUNK)
            .zip(m.par_chunks(CHUNK))
            .zip(v.par_chunks(CHUNK))
            .for_each(|((w, m), v)| {
                for ((w, m), v) in w.iter_mut().zip(m).zip(v) {
                    let update = (*m / bias1) / ((*v / bias2).sqrt() + eps);
                    let kept = if decays { *w * keep } else { *w };
                    *w = kept - update * lr;
                }
            });
    }
}

/// A mutable slice of a whole contiguous CPU tensor's storage.
fn storage_mut<'a, T: Real>(s: &'a mut CpuStorage, l: &Layout, what: &str) -> Result<&'a mut [T]> {
    let (start, end) = match l.contiguous_offsets() {
        Some(o) => o,
        None => candle::bail!("fused {what}: the tensor updated in place must be contiguous"),
    };
    let slice: &mut [T] = match (s, T::DTYPE) {
        (CpuStorage::F32(v), candle::DType::F32) => same_type_slice(v),
        (CpuStorage::F64(v), candle::DType::F64) => same_type_slice(v),
        (s, _) => candle::bail!(
            "fused {what}: storage {:?} is not {:?}",
            s.dtype(),
            T::DTYPE
        ),
    };
    Ok(&mut slice[start..end])
}

/// `&mut [U]` as `&mut [T]` when they are the same type (checked by the caller through
/// `T::DTYPE`).
fn same_type_slice<U: 'static, T: 'static>(v: &mut [U]) -> &mut [T] {
    assert_eq!(std::any::TypeId::of::<U>(), std::any::TypeId::of::<T>());
    // SAFETY: U and T are the same type.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<T>(), v.len()) }
}

impl InplaceOp2 for Moments {
    fn name(&self) -> &'static str {
        "poslab-adamw-moments"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let what = "adamw";
        match s2.dtype() {
            candle::DType::F32 => {
                self.run::<f32>(storage_mut(s1, l1, what)?, contiguous(s2, l2, what)?)
            }
            candle::DType::F64 => {
                self.run::<f64>(storage_mut(s1, l1, what)?, contiguous(s2, l2, what)?)
            }
            dt => return Err(super::unsupported(what, dt)),
        }
        Ok(())
    }
}

impl InplaceOp2 for Update {
    fn name(&self) -> &'static str {
        "poslab-adamw-update"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let what = "adamw";
        match s2.dtype() {
            candle::DType::F32 => {
                self.run::<f32>(storage_mut(s1, l1, what)?, contiguous(s2, l2, what)?)
            }
            candle::DType::F64 => {
                self.run::<f64>(storage_mut(s1, l1, what)?, contiguous(s2, l2, what)?)
            }
            dt => return Err(super::unsupported(what, dt)),
        }
        Ok(())
    }
}

/// One AdamW step in place: `moments` is `[m; v]` (`2 n` values, contiguous), `weight` and
/// `grad` `n` values each.
#[allow(clippy::too_many_arguments)]
pub fn adamw_step(
    weight: &Tensor,
    moments: &Tensor,
    grad: &Tensor,
    (beta1, beta2, eps): (f64, f64, f64),
    grad_scale: f64,
    lr: f64,
    decay_factor: f64,
    (bias1, bias2): (f64, f64),
) -> Result<()> {
    if moments.elem_count() != 2 * weight.elem_count() || grad.elem_count() != weight.elem_count() {
        candle::bail!(
            "fused adamw: moments {:?} and gradient {:?} do not fit the weight {:?}",
            moments.shape(),
            grad.shape(),
            weight.shape()
        );
    }
    moments.inplace_op2(
        &grad.contiguous()?,
        &Moments {
            beta1,
            beta2,
            grad_scale,
        },
    )?;
    weight.inplace_op2(
        moments,
        &Update {
            lr,
            decay_factor,
            bias1,
            bias2,
            eps,
        },
    )
}
