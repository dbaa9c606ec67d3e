//! A transport's reflections `[w | β]` from two projections of the attention input, as one
//! node with its backward (see [`crate::nn::Transport::from_projections`], whose composition is
//! the specification):
//!
//! ```text
//! u'_t = real_t u_t                                           u (b, t, d), padded rows zeroed
//! y_t  = Σ_s C[:, s] u'_{t-K+1+s}                            causal depthwise conv, width K
//! v_t  = silu(y_t)               (K = 0: v_t = u'_t)
//! w_t  = v_t / sqrt(|v_t|² + eps)                             per head, d_head wide
//! β_t  = 2 σ(z_t) real_t                                      z (b, t, h)
//! ```
//!
//! Backward, from `d[w | β]`:
//!
//! ```text
//! dv = (dw - w (w · dw)) / sqrt(|v|² + eps)                   per head
//! dy = dv σ(y) (1 + y (1 - σ(y)))                             silu's derivative
//! du'_{t-K+1+s} += C[:, s] dy_t,   dC[:, s] += Σ_t dy_t u'_{t-K+1+s},   du = real du'
//! dz = dβ 2 σ(z) (1 - σ(z)) real
//! ```
//!
//! A batch element is a task; the taps' gradient sums the batch's in order. The composition
//! takes about twenty passes over `(b, t, d)` forward and more backward; this is one each way.

use candle::backend::BackendStorage;
use candle::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::attention::absent;
use super::linear::by_dtype;
use super::{batch_sum, contiguous, sigmoid, Real};

/// The fixed inputs: heads, the norm's `eps`, and which tokens are real `(b, t)`.
#[derive(Clone)]
pub struct Reflections {
    heads: usize,
    eps: f64,
    real: Option<Vec<bool>>,
}

/// Shapes of one call: batch, tokens, width, heads, taps.
#[derive(Clone, Copy)]
pub(super) struct Dims {
    b: usize,
    t: usize,
    d: usize,
    h: usize,
    k: usize,
}

impl Reflections {
    /// For `heads` heads, the norm's `eps`, and which tokens are real: `mask` `(b, t)`, 1 for a
    /// real token (`None`: all real).
    pub(super) fn new(heads: usize, eps: f64, mask: Option<&Tensor>) -> Result<Self> {
        let real = match mask {
            Some(m) => Some(
                m.flatten_all()?
                    .to_dtype(DType::F32)?
                    .to_vec1::<f32>()?
                    .into_iter()
                    .map(|v| v > 0.0)
                    .collect(),
            ),
            None => None,
        };
        Ok(Self { heads, eps, real })
    }

    /// The shapes of a call on `u` `(b, t, d)`, the taps `(d, K)` (`[0]`: none) and `z`
    /// `(b, t, h)`, checked.
    pub(super) fn dims(&self, u: &[usize], taps: &[usize], z: &[usize]) -> Result<Dims> {
        let (b, t, d) = match u {
            &[b, t, d] if d % self.heads == 0 => (b, t, d),
            dims => candle::bail!(
                "fused reflections: u {dims:?} is not (b, t, d_model) with d_model a multiple of \
                 {} heads",
                self.heads
            ),
        };
        let k = match taps {
            [0] => 0,
            &[c, k] if c == d && k > 0 => k,
            dims => {
                candle::bail!("fused reflections: taps {dims:?} are not (d_model, K) = ({d}, K)")
            }
        };
        if z != [b, t, self.heads] {
            candle::bail!(
                "fused reflections: z {z:?} is not (b, t, heads) = ({b}, {t}, {})",
                self.heads
            );
        }
        if let Some(real) = &self.real {
            if real.len() != b * t {
                candle::bail!(
                    "fused reflections: {} mask values for (b, t) = ({b}, {t})",
                    real.len()
                );
            }
        }
        Ok(Dims {
            b,
            t,
            d,
            h: self.heads,
            k,
        })
    }

    fn real(&self, n: Dims, bi: usize, t: usize) -> bool {
        self.real.as_ref().is_none_or(|r| r[bi * n.t + t])
    }

    /// One batch element's conv output `y` and activation `v` `(t, d)` (`y` empty when there
    /// is no conv), and each token's per-head norm `(t, h)`.
    fn activations<T: Real>(
        &self,
        u: &[T],
        taps: &[T],
        n: Dims,
        bi: usize,
    ) -> (Vec<T>, Vec<T>, Vec<T>) {
        let (t, d, k) = (n.t, n.d, n.k);
        let row = |s: usize| -> &[T] { &u[(bi * t + s) * d..(bi * t + s + 1) * d] };
        let mut v = vec![T::zero(); t * d];
        let mut y = vec![T::zero(); if k == 0 { 0 } else { t * d }];
        for s in 0..t {
            let out = &mut v[s * d..(s + 1) * d];
            if k == 0 {
                if self.real(n, bi, s) {
                    out.copy_from_slice(row(s));
                }
                continue;
            }
            let acc = &mut y[s * d..(s + 1) * d];
            for tap in 0..k {
                // Input token s - K + 1 + tap, when it exists and is real.
                let Some(src) = (s + 1 + tap).checked_sub(k) else {
                    continue;
                };
                if !self.real(n, bi, src) {
                    continue;
                }
                for ((a, x), c) in acc
                    .iter_mut()
                    .zip(row(src))
                    .zip(taps.iter().skip(tap).step_by(k))
                {
                    *a += *c * *x;
                }
            }
            for (o, y) in out.iter_mut().zip(acc.iter()) {
                *o = *y * sigmoid(*y);
            }
        }
        let (h, dh) = (n.h, d / n.h);
        let eps = T::lit(self.eps);
        let norms = v
            .chunks_exact(dh)
            .map(|x| (x.iter().fold(T::zero(), |s, a| s + *a * *a) + eps).sqrt())
            .collect::<Vec<T>>();
        debug_assert_eq!(norms.len(), t * h);
        (y, v, norms)
    }

    /// `[w | β]` `(b, h, t, d_head + 1)`.
    pub(super) fn forward<T: Real>(&self, u: &[T], taps: &[T], z: &[T], n: Dims) -> Vec<T> {
        let (t, d, h) = (n.t, n.d, n.h);
        let dh = d / h;
        let mut out = vec![T::zero(); n.b * h * t * (dh + 1)];
        out.par_chunks_mut(h * t * (dh + 1))
            .enumerate()
            .for_each(|(bi, block)| {
                let (_, v, norms) = self.activations(u, taps, n, bi);
                for s in 0..t {
                    for hd in 0..h {
                        let at = (hd * t + s) * (dh + 1);
                        let (w, rest) = block[at..at + dh + 1].split_at_mut(dh);
                        let inv = norms[s * h + hd].recip();
                        for (o, x) in w.iter_mut().zip(&v[s * d + hd * dh..s * d + (hd + 1) * dh]) {
                            *o = *x * inv;
                        }
                        rest[0] = match self.real(n, bi, s) {
                            true => T::lit(2.0) * sigmoid(z[(bi * t + s) * h + hd]),
                            false => T::zero(),
                        };
                    }
                }
            });
        out
    }

    /// `(du (b, t, d), dC (d, K), dz (b, t, h))` from `d[w | β]`.
    pub(super) fn backward<T: Real>(
        &self,
        (u, taps, z): (&[T], &[T], &[T]),
        g: &[T],
        n: Dims,
    ) -> (Vec<T>, Vec<T>, Vec<T>) {
        let (t, d, h, k) = (n.t, n.d, n.h, n.k);
        let dh = d / h;
        let mut du = vec![T::zero(); n.b * t * d];
        let mut dz = vec![T::zero(); n.b * t * h];
        let mut dtaps_all = vec![T::zero(); n.b * (d * k).max(1)];
        du.par_chunks_mut(t * d)
            .zip(dz.par_chunks_mut(t * h))
            .zip(dtaps_all.par_chunks_mut((d * k).max(1)))
            .enumerate()
            .for_each(|(bi, ((du, dz), dtaps))| {
                let (y, v, norms) = self.activations(u, taps, n, bi);
                // dv, then dy in place.
                let mut dy = vec![T::zero(); t * d];
                for s in 0..t {
                    let real = self.real(n, bi, s);
                    for hd in 0..h {
                        let at = ((bi * h + hd) * t + s) * (dh + 1);
                        let (gw, gb) = (&g[at..at + dh], g[at + dh]);
                        let x = &v[s * d + hd * dh..s * d + (hd + 1) * dh];
                        let inv = norms[s * h + hd].recip();
                        let wg = x
                            .iter()
                            .zip(gw)
                            .fold(T::zero(), |a, (x, g)| a + *x * inv * *g);
                        for ((o, x), g) in dy[s * d + hd * dh..].iter_mut().zip(x).zip(gw) {
                            *o = (*g - *x * inv * wg) * inv;
                        }
                        let zi = z[(bi * t + s) * h + hd];
                        let sg = sigmoid(zi);
                        dz[s * h + hd] = match real {
                            true => gb * T::lit(2.0) * sg * (T::one() - sg),
                            false => T::zero(),
                        };
                    }
                }
                if k == 0 {
                    for s in 0..t {
                        if self.real(n, bi, s) {
                            du[s * d..(s + 1) * d].copy_from_slice(&dy[s * d..(s + 1) * d]);
                        }
                    }
                    return;
                }
                for (o, y) in dy.iter_mut().zip(&y) {
                    let sg = sigmoid(*y);
                    *o = *o * sg * (T::one() + *y * (T::one() - sg));
                }
                let row = |s: usize| -> &[T] { &u[(bi * t + s) * d..(bi * t + s + 1) * d] };
                for s in 0..t {
                    let dys = &dy[s * d..(s + 1) * d];
                    for tap in 0..k {
                        let Some(src) = (s + 1 + tap).checked_sub(k) else {
                            continue;
                        };
                        if !self.real(n, bi, src) {
                            continue;
                        }
                        let dsrc = &mut du[src * d..(src + 1) * d];
                        for (c, ((o, g), x)) in dsrc.iter_mut().zip(dys).zip(row(src)).enumerate() {
                            *o += taps[c * k + tap] * *g;
                            dtaps[c * k + tap] += *g * *x;
                        }
                    }
                }
            });
        // The taps' gradient: the batch's summed in order.
        let dtaps = match k {
            0 => Vec::new(),
            _ => batch_sum(&dtaps_all, n.b),
        };
        (du, dtaps, dz)
    }

    fn grads<T: Real>(
        &self,
        u: &Tensor,
        taps: &Tensor,
        z: &Tensor,
        g: &Tensor,
    ) -> Result<(Tensor, Option<Tensor>, Tensor)> {
        let host = |x: &Tensor| x.flatten_all()?.to_vec1::<T>();
        let n = self.dims(u.dims(), taps.dims(), z.dims())?;
        let (du, dtaps, dz) = self.backward((&host(u)?, &host(taps)?, &host(z)?), &host(g)?, n);
        let dev = u.device();
        Ok((
            Tensor::from_vec(du, u.shape(), dev)?,
            (n.k > 0)
                .then(|| Tensor::from_vec(dtaps, taps.shape(), dev))
                .transpose()?,
            Tensor::from_vec(dz, z.shape(), dev)?,
        ))
    }
}

impl CustomOp3 for Reflections {
    fn name(&self) -> &'static str {
        "poslab-reflections"
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
        let n = self.dims(l1.dims(), l2.dims(), l3.dims())?;
        let what = "reflections";
        let storage = by_dtype!(s1.dtype(), what, |T| self.forward::<T>(
            contiguous(s1, l1, what)?,
            contiguous(s2, l2, what)?,
            contiguous(s3, l3, what)?,
            n
        ));
        Ok((storage, Shape::from((n.b, n.h, n.t, n.d / n.h + 1))))
    }

    fn bwd(
        &self,
        u: &Tensor,
        taps: &Tensor,
        z: &Tensor,
        _out: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (du, dtaps, dz) = match u.dtype() {
            DType::F32 => self.grads::<f32>(u, taps, z, g)?,
            DType::F64 => self.grads::<f64>(u, taps, z, g)?,
            dt => return Err(super::unsupported("reflections", dt)),
        };
        Ok((Some(du), dtaps, Some(dz)))
    }
}

/// `[w | β]` `(b, h, t, d_head + 1)` from `u` `(b, t, d)`, the conv's taps `(d, K)` (`None`: no
/// conv and no silu), `z` `(b, t, h)` and which tokens are real `(b, t)`, fused (CPU, f32/f64).
pub fn reflections(
    u: &Tensor,
    taps: Option<&Tensor>,
    z: &Tensor,
    mask: Option<&Tensor>,
    (heads, eps): (usize, f64),
) -> Result<Tensor> {
    let op = Reflections::new(heads, eps, mask)?;
    let u = u.contiguous()?;
    let taps = match taps {
        Some(t) => t.contiguous()?,
        None => absent(&u)?,
    };
    u.apply_op3(&taps, &z.contiguous()?, op)
}
