//! Attention scores through a transport of reflections: each token `t` sets a unit vector
//! `w_t` and a strength `β_t`, and a key reaches a query through the reflections
//! `H_t = I - β_t w_t w_tᵀ` of the tokens between them.
//!
//! ```text
//! score_ij = c q_iᵀ H_i H_{i-1} ⋯ H_{j+1} k_j      j < i
//!          = c q_iᵀ H_{i+1} ⋯ H_j k_j               j > i
//!          = c q_i · k_i                            j = i
//! ```
//!
//! `w`, `β` `(b, h, t, ·)` are given stacked, `[w | β]` `(b, h, t, d_head + 1)`,
//! differentiable; a token with `β = 0` (padding) is the identity.
//!
//! **The composition: the UT transform** (the idea of fla's blockwise kernels). Applying
//! `H_{j+1}`, …, `H_i` to a vector `v` in turn subtracts `Σ_a w_a u_a`, where the coefficients
//! solve `(I + L) u = diag(β) W v` over the tokens `(j, i]`, with `L_ta = β_t w_t · w_a` for
//! `a < t`. `I + L` is unit lower triangular, so the inverse of any diagonal block of it is that
//! block of its inverse: one inverse `T = (I + L)⁻¹` over the whole sequence serves every pair,
//! and
//!
//! ```text
//! scores = Q Kᵀ - [Q Wᵀ]_{a <= i} T diag(β) [W Kᵀ]_{b > j} - [Q Wᵀ]_{a > i} T' diag(β) [W Kᵀ]_{b <= j}
//! ```
//!
//! with `T' = (I + U)⁻¹`, `U` the strictly upper `β_t w_t · w_a`, for keys after the query (each
//! bracket keeps the entries its subscript names; the triangles make each correction vanish on
//! the other side). The inverses come from doubling blocks, `[[A, 0], [C, D]]⁻¹ = [[A⁻¹, 0],
//! [-D⁻¹ C A⁻¹, D⁻¹]]`, which needs no division and stays bounded. Cost per head: about
//! `(2/3) t³` for each inverse and `4 t³` for the products, beside `q kᵀ`'s `2 t² d_head`; memory
//! a few `(t, t)` tensors per head, as attention's own. This composition keeps to tensor products
//! every device has, with a backward from autograd, and is the specification.
//!
//! **The fused CPU kernels** ([`super::QkScores::transport`]) compute the same scores inside the
//! attention node in `O(t² d_head)` a head: they carry every key to the query one reflection at
//! a time, all keys of a side together (a query's step reflects the keys before it once more),
//! with a hand-written backward.

use candle::{Tensor, D};

/// What a transport's reflections are made from: two projections of the attention input and
/// the tokens that are real.
///
/// ```text
/// u'_t = real_t u_t
/// v_t  = silu(Σ_s C[:, 0, s] u'_{t-K+1+s})      a causal depthwise conv of width K (none: v = u')
/// w_t  = v_t / sqrt(|v_t|² + eps)               per head, d_head wide
/// β_t  = 2 σ(z_t) real_t
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Projections<'a> {
    /// `(b, t, d_model)`
    pub u: &'a Tensor,
    /// `(d_model, 1, K)`: the conv's taps (`None`: no conv and no silu).
    pub conv: Option<&'a Tensor>,
    /// `(b, t, heads)`: the strengths before the sigmoid.
    pub z: &'a Tensor,
    /// `(b, t)`, 1 for a real token (`None`: all real).
    pub mask: Option<&'a Tensor>,
    /// The heads `d_model` splits into.
    pub heads: usize,
    /// Inside the norm's root.
    pub eps: f64,
}

/// The weights that make a transport's reflections from the attention input `x`, `u = x W_wᵀ`
/// and `z = x W_bᵀ + b_b` of [`Projections`], with the tokens that are real: what a fused layer
/// takes to make the reflections inside itself, beside its q, k and v.
#[derive(Clone, Copy, Debug)]
pub struct InputReflections<'a> {
    /// `(d_model, d_model)`
    pub w: &'a Tensor,
    /// `(d_model, 1, K)`: the conv's taps (`None`: no conv and no silu).
    pub conv: Option<&'a Tensor>,
    /// `(heads, d_model)`
    pub beta_weight: &'a Tensor,
    /// `(heads)`
    pub beta_bias: &'a Tensor,
    /// `(b, t)`, 1 for a real token (`None`: all real).
    pub mask: Option<&'a Tensor>,
    /// Inside the norm's root.
    pub eps: f64,
}

#[cfg_attr(not(feature = "kernels"), allow(dead_code))]
impl InputReflections<'_> {
    /// What the fused layer needs beside the weights to make the reflections.
    pub(crate) fn spec(&self) -> candle::Result<crate::kernels::spec::ReflectionInputs<'_>> {
        Ok(crate::kernels::spec::ReflectionInputs {
            taps: self.taps()?,
            eps: self.eps,
            mask: self.mask,
        })
    }

    /// The weights flattened in the fused layer's order: `W_w`, the taps, `W_b`, `b_b`.
    pub(crate) fn flat(&self) -> candle::Result<Vec<Tensor>> {
        let parts = [
            Some(self.w),
            self.conv,
            Some(self.beta_weight),
            Some(self.beta_bias),
        ];
        parts
            .into_iter()
            .flatten()
            .map(Tensor::flatten_all)
            .collect()
    }

    /// The conv's width `K` (0: none).
    pub(crate) fn taps(&self) -> candle::Result<usize> {
        Ok(match self.conv {
            Some(c) => c.dim(2)?,
            None => 0,
        })
    }
}

/// The reflections of a transport, stacked `[w | β]`.
#[derive(Clone, Debug)]
pub struct Transport {
    /// `(b, h, t, d_head + 1)`
    reflections: Tensor,
}

impl Projections<'_> {
    /// Checks the shapes and numbers against one another: `u` `(b, t, d)` with every size at
    /// least 1 and `d` a multiple of `heads` (at least 1), `z` `(b, t, heads)`, the conv
    /// `(d, 1, K)` with `K` at least 1, the mask `(b, t)`, `eps` finite and not negative.
    pub fn check(&self) -> crate::Result<()> {
        let bad = |what: String| Err(crate::Error::Config(format!("transport: {what}")));
        let (b, t, d) = self.u.dims3()?;
        if b == 0 || t == 0 || d == 0 {
            return bad(format!(
                "u of shape {:?} is empty: a transport needs at least one token of width 1",
                self.u.dims()
            ));
        }
        if self.heads == 0 || !d.is_multiple_of(self.heads) {
            return bad(format!(
                "heads = {} does not split d_model = {d}: give a count of at least 1 that divides it",
                self.heads
            ));
        }
        if self.z.dims() != [b, t, self.heads] {
            return bad(format!(
                "z of shape {:?} is not (b, t, heads) = ({b}, {t}, {})",
                self.z.dims(),
                self.heads
            ));
        }
        if let Some(conv) = self.conv {
            let dims = conv.dims();
            if dims.len() != 3 || dims[0] != d || dims[1] != 1 || dims[2] == 0 {
                return bad(format!(
                    "the conv's taps {dims:?} are not (d_model, 1, K) = ({d}, 1, K) with K at least 1"
                ));
            }
        }
        if let Some(mask) = self.mask {
            if mask.dims() != [b, t] {
                return bad(format!(
                    "the mask {:?} is not (b, t) = ({b}, {t})",
                    mask.dims()
                ));
            }
        }
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return bad(format!(
                "eps = {} must be finite and not negative",
                self.eps
            ));
        }
        Ok(())
    }
}

impl Transport {
    /// # Shapes
    /// - `w`: `(b, h, t, d_head)`, unit vectors (or 0); `beta`: `(b, h, t)`
    pub fn new(w: &Tensor, beta: &Tensor) -> crate::Result<Self> {
        let (b, h, t, _) = w.dims4()?;
        if beta.dims() != [b, h, t] {
            return Err(crate::Error::Config(format!(
                "transport: strengths {:?} do not match the vectors' (b, h, t) = ({b}, {h}, {t})",
                beta.dims()
            )));
        }
        Ok(Self {
            reflections: Tensor::cat(&[w, &beta.unsqueeze(3)?.to_dtype(w.dtype())?], 3)?,
        })
    }

    /// The reflections of [`Projections`]: one fused node on the CPU's fused kernels (which
    /// take f32 and f64 alone), else [`Transport::compose`].
    pub fn from_projections(p: Projections, backend: super::Backend) -> crate::Result<Self> {
        p.check()?;
        #[cfg(feature = "kernels")]
        if backend.path(p.u) == super::Path::Fused {
            let taps = match p.conv {
                Some(c) => Some(c.reshape((c.dim(0)?, c.dim(2)?))?),
                None => None,
            };
            let z = p.z.to_dtype(p.u.dtype())?;
            let (heads, eps) = (p.heads, p.eps);
            let reflections =
                crate::kernels::cpu::reflections(p.u, taps.as_ref(), &z, p.mask, (heads, eps))?;
            return Ok(Self { reflections });
        }
        Ok(Self::compose(p, backend)?.1)
    }

    /// The reflections of [`Projections`] composed of tensor ops (the specification), and `v`
    /// `(b, t, d_model)`, the conv's activation before the norm.
    pub fn compose(p: Projections, backend: super::Backend) -> crate::Result<(Tensor, Self)> {
        p.check()?;
        let dtype = p.u.dtype();
        let (b, t, d) = p.u.dims3()?;
        let real = match p.mask {
            Some(m) => Some(m.to_dtype(dtype)?.reshape((b, t, 1))?),
            None => None,
        };
        let mut u = p.u.clone();
        if let Some(real) = &real {
            u = u.broadcast_mul(real)?;
        }
        if let Some(conv) = p.conv {
            let k = conv.dim(2)?;
            let taps = conv.reshape((d, k))?;
            let padded = match k {
                1 => u.clone(),
                _ => Tensor::cat(&[&Tensor::zeros((b, k - 1, d), dtype, u.device())?, &u], 1)?,
            };
            let mut y = padded
                .narrow(1, 0, t)?
                .broadcast_mul(&taps.narrow(1, 0, 1)?.t()?)?;
            for s in 1..k {
                let tap = taps.narrow(1, s, 1)?.t()?; // (1, d)
                y = (y + padded.narrow(1, s, t)?.broadcast_mul(&tap)?)?;
            }
            u = y.silu()?;
        }
        let hd = d / p.heads;
        let uh = u
            .reshape((b, t, p.heads, hd))?
            .transpose(1, 2)?
            .contiguous()?; // (b, h, t, hd)
        let norm = (uh.sqr()?.sum_keepdim(D::Minus1)? + p.eps)?.sqrt()?;
        let w = uh.broadcast_div(&norm)?;
        let mut beta = (super::log_sigmoid(&p.z.to_dtype(dtype)?, backend)?.exp()? * 2.0)?;
        if let Some(real) = &real {
            beta = beta.broadcast_mul(real)?;
        }
        let beta = beta.transpose(1, 2)?.contiguous()?;
        Ok((u, Self::new(&w, &beta)?))
    }

    /// The reflections as the fused kernels take them.
    pub fn spec(&self) -> crate::kernels::spec::Reflected {
        crate::kernels::spec::Reflected {
            reflections: self.reflections.clone(),
        }
    }

    /// `[w | β]`, `(b, h, t, d_head + 1)`.
    pub fn reflections(&self) -> &Tensor {
        &self.reflections
    }

    /// The vectors `w` `(b, h, t, d_head)` and strengths `β` `(b, h, t)`.
    pub fn parts(&self) -> crate::Result<(Tensor, Tensor)> {
        let hd = self.reflections.dim(3)? - 1;
        Ok((
            self.reflections.narrow(3, 0, hd)?,
            self.reflections.narrow(3, hd, 1)?.squeeze(3)?,
        ))
    }

    /// The scores `c q_iᵀ P_ij k_j`, composed of tensor ops (the UT transform), in the
    /// reflections' dtype.
    ///
    /// # Shapes
    /// - `q`, `k`: `(b, h, t, d_head)`; returns `(b, h, t, t)`
    pub fn scores(&self, q: &Tensor, k: &Tensor, scale: f64) -> crate::Result<Tensor> {
        let dtype = self.reflections.dtype();
        let (w, beta) = self.parts()?;
        let raw = transport_scores(&q.to_dtype(dtype)?, &k.to_dtype(dtype)?, &w, &beta)?;
        Ok((raw * scale)?)
    }
}

/// `(I + L)⁻¹` for `L_ta = β_t w_t · w_a` strictly below the diagonal (`upper`: strictly above),
/// by doubling diagonal blocks: `[[A, 0], [C, D]]⁻¹ = [[A⁻¹, 0], [-D⁻¹ C A⁻¹, D⁻¹]]` (above:
/// `[[A, C], [0, D]]⁻¹ = [[A⁻¹, -A⁻¹ C D⁻¹], [0, D⁻¹]]`). The sequence is padded to a power of two
/// with `β = 0` (identity rows).
///
/// # Shapes
/// - `w`: `(n, t, d_head)`; `beta`: `(n, t)`; returns `(n, t, t)`
pub fn transport_inverse(w: &Tensor, beta: &Tensor, upper: bool) -> crate::Result<Tensor> {
    let (n, t, hd) = w.dims3()?;
    let (dtype, device) = (w.dtype(), w.device());
    let size = t.next_power_of_two();
    let (w, beta) = match size - t {
        0 => (w.clone(), beta.clone()),
        pad => (
            Tensor::cat(&[w, &Tensor::zeros((n, pad, hd), dtype, device)?], 1)?,
            Tensor::cat(&[beta, &Tensor::zeros((n, pad), dtype, device)?], 1)?,
        ),
    };
    let mut blocks = Tensor::ones((n, size, 1, 1), dtype, device)?;
    let mut s = 1;
    while s < size {
        let m = size / (2 * s);
        let half = |x: &Tensor, i: usize| -> crate::Result<Tensor> {
            Ok(x.narrow(2, i, 1)?.squeeze(2)?.contiguous()?)
        };
        let pairs = blocks.reshape((n, m, 2, s, s))?;
        let (a, d) = (half(&pairs, 0)?, half(&pairs, 1)?); // (n, m, s, s)
        let wp = w.reshape((n, m, 2, s, hd))?;
        let bp = beta.reshape((n, m, 2, s, 1))?;
        let (w0, w1) = (half(&wp, 0)?, half(&wp, 1)?); // (n, m, s, hd)
        let zeros = Tensor::zeros((n, m, s, s), dtype, device)?;
        let (top, bottom) = match upper {
            false => {
                let c = half(&bp, 1)?.broadcast_mul(&w1.matmul(&w0.t()?.contiguous()?)?)?;
                let x = d.matmul(&c)?.matmul(&a)?.neg()?;
                (Tensor::cat(&[&a, &zeros], 3)?, Tensor::cat(&[&x, &d], 3)?)
            }
            true => {
                let c = half(&bp, 0)?.broadcast_mul(&w0.matmul(&w1.t()?.contiguous()?)?)?;
                let x = a.matmul(&c)?.matmul(&d)?.neg()?;
                (Tensor::cat(&[&a, &x], 3)?, Tensor::cat(&[&zeros, &d], 3)?)
            }
        };
        blocks = Tensor::cat(&[&top, &bottom], 2)?; // (n, m, 2s, 2s)
        s *= 2;
    }
    let full = blocks.reshape((n, size, size))?;
    Ok(match size == t {
        true => full,
        false => full.narrow(1, 0, t)?.narrow(2, 0, t)?.contiguous()?,
    })
}

/// The transported scores before the scale: `q_iᵀ P_ij k_j`, `P_ij` the product of the
/// reflections of the tokens between query and key (see the module's notes).
///
/// # Shapes
/// - `q`, `k`, `w`: `(b, h, t, d_head)`; `beta`: `(b, h, t)`; returns `(b, h, t, t)`
pub fn transport_scores(
    q: &Tensor,
    k: &Tensor,
    w: &Tensor,
    beta: &Tensor,
) -> crate::Result<Tensor> {
    let (b, h, t, hd) = q.dims4()?;
    let flat = |x: &Tensor| x.reshape((b * h, t, hd));
    let (q, k, w) = (flat(q)?, flat(k)?, flat(w)?);
    let beta = beta.reshape((b * h, t))?;
    let low = Tensor::tril2(t, q.dtype(), q.device())?; // [a <= i]
    let strict_low = (&low - Tensor::eye(t, q.dtype(), q.device())?)?; // [b > j]
    let strict_up = (1.0 - &low)?; // [a > i]
    let up = (1.0 - &strict_low)?; // [b <= j]
    let qk = q.matmul(&k.t()?.contiguous()?)?; // (n, t, t)
    let qw = q.matmul(&w.t()?.contiguous()?)?; // (n, t, t): q_i · w_a
    let wk = w
        .matmul(&k.t()?.contiguous()?)?
        .broadcast_mul(&beta.unsqueeze(D::Minus1)?)?; // β_b w_b · k_j
    let left = qw
        .broadcast_mul(&low)?
        .matmul(&transport_inverse(&w, &beta, false)?)?
        .matmul(&wk.broadcast_mul(&strict_low)?)?;
    let right = qw
        .broadcast_mul(&strict_up)?
        .matmul(&transport_inverse(&w, &beta, true)?)?
        .matmul(&wk.broadcast_mul(&up)?)?;
    Ok(((qk - left)? - right)?.reshape((b, h, t, t))?)
}
