//! Two maps of `H` channels summed with an MLP over their channels, at every position: one
//! fused node with its backward.
//!
//! ```text
//! u[:, p]   = [x[:, p] ; y[:, p]]                    C = 2H channels
//! z[w, p]   = c1[w] + Σ_c W1[w, c] u[c, p]           w < W
//! out[h, p] = x[h, p] + y[h, p] + Σ_w W2[h, w] leaky(z[w, p])    leaky(z) = z (z > 0), slope z
//! ```
//!
//! for each of `n` blocks `x` `(H, P)`, with `y` one block for all or one per block (DAPE's
//! scores: the logits and a scheme's bias of `H` heads at each of `t²` pairs). The weights come
//! packed `[W1 (W, C) | c1 (W) | W2 (H, W)]`. Neither `u` nor the hidden layer `(W, P)` is
//! stored: the hidden layer is made a block of pairs at a time, and made again in the backward:
//!
//! ```text
//! dz[w, p] = leaky'(z[w, p]) Σ_h W2[h, w] dO[h, p]
//! du[c, p] = Σ_w W1[w, c] dz[w, p];   dx = dO + du[:H],   dy = dO + du[H:]
//! dW1 = Σ_p dz uᵀ,   dc1 = Σ_p dz,   dW2 = Σ_p dO leaky(z)ᵀ
//! ```
//!
//! Each block of `n` runs on one thread, its weights' gradients kept in 16 lanes (so they
//! vectorise). The gradients shared by blocks (the weights', and `y`'s when it is one for all)
//! are summed over the blocks in their order, so results do not depend on the threads.

use candle::backend::BackendStorage;
use candle::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::linear::by_dtype;
use super::rows::batch_sum;
use super::{contiguous, Real, SimdLevel};

/// Pairs made at a time: the hidden block `(W, PAIRS)` stays in the cache.
const PAIRS: usize = 64;

/// The sizes of one channel MLP: `h` channels in each of `x` and `y`, hidden width `w`.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    h: usize,
    w: usize,
}

impl Sizes {
    /// The MLP's input channels, `[x; y]`.
    fn c(self) -> usize {
        2 * self.h
    }

    fn packed(self) -> usize {
        self.w * self.c() + self.w + self.h * self.w
    }

    /// `(W1, c1, W2)` of the packed weights.
    fn split<T>(self, packed: &[T]) -> (&[T], &[T], &[T]) {
        let (w1, rest) = packed.split_at(self.w * self.c());
        let (c1, w2) = rest.split_at(self.w);
        (w1, c1, w2)
    }
}

/// Channel `c` of `u = [x; y]`, `p` pairs a channel.
#[inline(always)]
fn channel<'a, T>(x: &'a [T], y: &'a [T], p: usize, h: usize, c: usize) -> &'a [T] {
    if c < h {
        &x[c * p..(c + 1) * p]
    } else {
        &y[(c - h) * p..(c - h + 1) * p]
    }
}

/// `z` `(W, k)` of the pairs `p0..p0 + k` of one block `u = [x; y]`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn hidden<T: Real>(
    x: &[T],
    y: &[T],
    p0: usize,
    k: usize,
    s: Sizes,
    w1: &[T],
    c1: &[T],
    z: &mut [T],
) {
    let p = x.len() / s.h;
    for w in 0..s.w {
        let zw = &mut z[w * PAIRS..w * PAIRS + k];
        zw.fill(c1[w]);
        for c in 0..s.c() {
            let a = w1[w * s.c() + c];
            let uc = &channel(x, y, p, s.h, c)[p0..p0 + k];
            for (zv, uv) in zw.iter_mut().zip(uc) {
                *zv += a * *uv;
            }
        }
    }
}

#[inline(always)]
fn forward_body<T: Real>(x: &[T], y: &[T], packed: &[T], s: Sizes, slope: T, out: &mut [T]) {
    let p = x.len() / s.h;
    let (w1, c1, w2) = s.split(packed);
    let mut z = vec![T::zero(); s.w * PAIRS];
    for p0 in (0..p).step_by(PAIRS) {
        let k = PAIRS.min(p - p0);
        hidden(x, y, p0, k, s, w1, c1, &mut z);
        // A factor chosen by a select, not a branch: the signs are unpredictable.
        for v in z.iter_mut() {
            *v *= if *v > T::zero() { T::one() } else { slope };
        }
        for h in 0..s.h {
            let at = h * p + p0..h * p + p0 + k;
            let o = &mut out[at.clone()];
            for ((ov, xv), yv) in o.iter_mut().zip(&x[at.clone()]).zip(&y[at]) {
                *ov = *xv + *yv;
            }
            for w in 0..s.w {
                let b = w2[h * s.w + w];
                for (ov, av) in o.iter_mut().zip(&z[w * PAIRS..w * PAIRS + k]) {
                    *ov += b * *av;
                }
            }
        }
    }
}

simd_dispatch!(fn forward_block = forward_body(
    x: &[T], y: &[T], packed: &[T], s: Sizes, slope: T, out: &mut [T]
));

/// `acc[i % 16] += a[i] b[i]`: a dot product kept in 16 lanes (so it vectorises), folded once
/// at the end of a block ([`fold_lanes`]).
#[inline(always)]
fn lane_dot<T: Real>(acc: &mut [T; 16], a: &[T], b: &[T]) {
    // A local copy the compiler keeps in registers (through `acc` it could alias the inputs).
    let mut l = *acc;
    let (mut ca, mut cb) = (a.chunks_exact(16), b.chunks_exact(16));
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..16 {
            l[i] += x[i] * y[i];
        }
    }
    for (i, (x, y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        l[i] += *x * *y;
    }
    *acc = l;
}

/// `acc[i % 16] += a[i]`, as [`lane_dot`].
#[inline(always)]
fn lane_sum<T: Real>(acc: &mut [T; 16], a: &[T]) {
    let mut l = *acc;
    let mut ca = a.chunks_exact(16);
    for x in &mut ca {
        for i in 0..16 {
            l[i] += x[i];
        }
    }
    for (i, x) in ca.remainder().iter().enumerate() {
        l[i] += *x;
    }
    *acc = l;
}

/// Each value's lanes summed in order into `out`.
fn fold_lanes<T: Real>(lanes: &[[T; 16]], out: &mut [T]) {
    for (o, l) in out.iter_mut().zip(lanes) {
        *o = l.iter().fold(T::zero(), |s, v| s + *v);
    }
}

/// One block's `(dx, dy, dpacked)`: `dx` and `dy` `(H, P)` of its `(x, y)`, and its share of
/// the weights' gradient (packed).
#[inline(always)]
fn backward_body<T: Real>(
    (x, y): (&[T], &[T]),
    packed: &[T],
    dout: &[T],
    s: Sizes,
    slope: T,
    (dx, dy, dpacked): (&mut [T], &mut [T], &mut [T]),
) {
    let p = x.len() / s.h;
    let (w1, c1, w2) = s.split(packed);
    // The weights' gradients in lanes, packed as the weights are.
    let mut lanes = vec![[T::zero(); 16]; s.packed()];
    let (dw1, rest) = lanes.split_at_mut(s.w * s.c());
    let (dc1, dw2) = rest.split_at_mut(s.w);
    let mut z = vec![T::zero(); s.w * PAIRS];
    let mut dz = vec![T::zero(); s.w * PAIRS];
    for p0 in (0..p).step_by(PAIRS) {
        let k = PAIRS.min(p - p0);
        hidden(x, y, p0, k, s, w1, c1, &mut z);
        for w in 0..s.w {
            let zw = &mut z[w * PAIRS..w * PAIRS + k];
            let dzw = &mut dz[w * PAIRS..w * PAIRS + k];
            dzw.fill(T::zero());
            for h in 0..s.h {
                let b = w2[h * s.w + w];
                for (d, g) in dzw.iter_mut().zip(&dout[h * p + p0..h * p + p0 + k]) {
                    *d += b * *g;
                }
            }
            // z becomes the activation, and dz the pre-activation's gradient (a select).
            for (zv, dv) in zw.iter_mut().zip(dzw.iter_mut()) {
                let f = if *zv > T::zero() { T::one() } else { slope };
                *zv *= f;
                *dv *= f;
            }
            for h in 0..s.h {
                lane_dot(&mut dw2[h * s.w + w], &dout[h * p + p0..h * p + p0 + k], zw);
            }
            lane_sum(&mut dc1[w], dzw);
            for c in 0..s.c() {
                let uc = &channel(x, y, p, s.h, c)[p0..p0 + k];
                lane_dot(&mut dw1[w * s.c() + c], dzw, uc);
            }
        }
        for c in 0..s.c() {
            let at = (c % s.h) * p + p0..(c % s.h) * p + p0 + k;
            let o = if c < s.h {
                &mut dx[at.clone()]
            } else {
                &mut dy[at.clone()]
            };
            o.copy_from_slice(&dout[at]);
            for w in 0..s.w {
                let a = w1[w * s.c() + c];
                for (ov, d) in o.iter_mut().zip(&dz[w * PAIRS..w * PAIRS + k]) {
                    *ov += a * *d;
                }
            }
        }
    }
    fold_lanes(&lanes, dpacked);
}

simd_dispatch!(fn backward_block = backward_body(
    u: (&[T], &[T]), packed: &[T], dout: &[T], s: Sizes, slope: T,
    grads: (&mut [T], &mut [T], &mut [T])
));

/// The blocks of `x` `(n, H, P)` and their `y`: `y` has `n` blocks or one.
fn y_block<T>(y: &[T], i: usize, per: usize) -> &[T] {
    if y.len() == per {
        y
    } else {
        &y[i * per..(i + 1) * per]
    }
}

#[allow(clippy::too_many_arguments)]
fn forward<T: Real>(
    simd: SimdLevel,
    x: &[T],
    y: &[T],
    packed: &[T],
    s: Sizes,
    slope: f64,
    per: usize,
) -> Vec<T> {
    let mut out = vec![T::zero(); x.len()];
    if per == 0 {
        return out;
    }
    out.par_chunks_mut(per)
        .zip(x.par_chunks(per))
        .enumerate()
        .for_each(|(i, (o, xb))| {
            forward_block(simd, xb, y_block(y, i, per), packed, s, T::lit(slope), o)
        });
    out
}

/// `[dx (n, H, P) | dy (r, H, P) | dpacked]`, flat.
#[allow(clippy::too_many_arguments)]
fn backward<T: Real>(
    simd: SimdLevel,
    x: &[T],
    y: &[T],
    packed: &[T],
    dout: &[T],
    s: Sizes,
    slope: f64,
    per: usize,
) -> Vec<T> {
    let (xs, ys) = (x.len(), y.len());
    let mut out = vec![T::zero(); xs + ys + s.packed()];
    if per == 0 {
        return out;
    }
    let n = xs / per;
    let (dx, rest) = out.split_at_mut(xs);
    let (dy, dpacked) = rest.split_at_mut(ys);
    // One `y` for all blocks: each block's share apart, summed in order after.
    let mut shares = if ys == xs {
        Vec::new()
    } else {
        vec![T::zero(); xs]
    };
    let dy_blocks: &mut [T] = if ys == xs { dy } else { &mut shares };
    let parts: Vec<Vec<T>> = dx
        .par_chunks_mut(per)
        .zip(dy_blocks.par_chunks_mut(per))
        .zip(x.par_chunks(per).zip(dout.par_chunks(per)))
        .enumerate()
        .map(|(i, ((dxb, dyb), (xb, gb)))| {
            let mut part = vec![T::zero(); s.packed()];
            let yb = y_block(y, i, per);
            let grads = (dxb, dyb, &mut part[..]);
            backward_block(simd, (xb, yb), packed, gb, s, T::lit(slope), grads);
            part
        })
        .collect();
    if ys != xs {
        dy.copy_from_slice(&batch_sum(&shares, n));
    }
    for part in &parts {
        for (d, v) in dpacked.iter_mut().zip(part) {
            *d += *v;
        }
    }
    out
}

/// `x` `(n, H, P)` and `y` `(n or 1, H, P)`, checked against the packed weights.
fn check(s: Sizes, x: &Layout, y: &Layout, packed: &Layout) -> Result<usize> {
    let (n, h, p) = x.shape().dims3()?;
    let (r, hy, py) = y.shape().dims3()?;
    if h != s.h || hy != h || py != p || (r != n && r != 1) {
        candle::bail!(
            "fused channel MLP: x {:?} and y {:?} (y needs x's shape or one block of it)",
            x.shape(),
            y.shape()
        );
    }
    if packed.shape().elem_count() != s.packed() {
        candle::bail!(
            "fused channel MLP: {} packed weights for {:?} (needs {})",
            packed.shape().elem_count(),
            s,
            s.packed()
        );
    }
    Ok(h * p)
}

struct ChannelMlp {
    sizes: Sizes,
    slope: f64,
    simd: SimdLevel,
}

impl CustomOp3 for ChannelMlp {
    fn name(&self) -> &'static str {
        "poslab-channel-mlp"
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
        let what = "channel MLP";
        let per = check(self.sizes, l1, l2, l3)?;
        let storage = by_dtype!(s1.dtype(), what, |T| forward::<T>(
            self.simd,
            contiguous(s1, l1, what)?,
            contiguous(s2, l2, what)?,
            contiguous(s3, l3, what)?,
            self.sizes,
            self.slope,
            per
        ));
        Ok((storage, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        y: &Tensor,
        packed: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let op = ChannelMlpGrad {
            sizes: self.sizes,
            slope: self.slope,
            simd: self.simd,
            packed: packed
                .flatten_all()?
                .to_dtype(candle::DType::F64)?
                .to_vec1()?,
        };
        let all = x.apply_op3_no_bwd(y, &grad.contiguous()?, &op)?;
        let (xs, ys) = (x.elem_count(), y.elem_count());
        let dx = all.narrow(0, 0, xs)?.reshape(x.shape())?;
        let dy = all.narrow(0, xs, ys)?.reshape(y.shape())?;
        let dpacked = all
            .narrow(0, xs + ys, self.sizes.packed())?
            .reshape(packed.shape())?;
        Ok((Some(dx), Some(dy), Some(dpacked)))
    }
}

/// The backward, with the weights (exact in f64) held by the op: a node takes three inputs.
struct ChannelMlpGrad {
    sizes: Sizes,
    slope: f64,
    simd: SimdLevel,
    packed: Vec<f64>,
}

impl CustomOp3 for ChannelMlpGrad {
    fn name(&self) -> &'static str {
        "poslab-channel-mlp-grad"
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
        let what = "channel MLP backward";
        if l3.shape() != l1.shape() {
            candle::bail!(
                "fused {what}: gradient {:?} for x {:?}",
                l3.shape(),
                l1.shape()
            );
        }
        let (_, h, p) = l1.shape().dims3()?;
        let per = h * p;
        if per != self.sizes.h * l2.shape().dims3()?.2 {
            candle::bail!("fused {what}: x {:?} and y {:?}", l1.shape(), l2.shape());
        }
        let storage = by_dtype!(s1.dtype(), what, |T| backward::<T>(
            self.simd,
            contiguous(s1, l1, what)?,
            contiguous(s2, l2, what)?,
            &self.packed.iter().map(|v| T::lit(*v)).collect::<Vec<T>>(),
            contiguous(s3, l3, what)?,
            self.sizes,
            self.slope,
            per
        ));
        let len = l1.shape().elem_count() + l2.shape().elem_count() + self.sizes.packed();
        Ok((storage, Shape::from(len)))
    }
}

/// `x + y + W2 leaky(W1 [x; y] + c1)` over the channels of every position, LeakyReLU slope
/// `slope`, as one node with its backward (see the module).
///
/// # Shapes
/// - `x`: `(n, H, P)`; `y`: `(n, H, P)` or `(1, H, P)` (one for every block)
/// - `packed`: `[W1 (W, 2H) | c1 (W) | W2 (H, W)]` flat, `W` = `width`
/// - returns `(n, H, P)`
pub fn channel_mlp(
    x: &Tensor,
    y: &Tensor,
    packed: &Tensor,
    width: usize,
    slope: f64,
    simd: SimdLevel,
) -> Result<Tensor> {
    let (_, h, _) = x.dims3()?;
    let op = ChannelMlp {
        sizes: Sizes { h, w: width },
        slope,
        simd,
    };
    x.contiguous()?
        .apply_op3(&y.contiguous()?, &packed.contiguous()?, op)
}
