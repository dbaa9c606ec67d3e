//! The core of multi-head self-attention as one node: from the packed projections
//! `qkv = [q | k | v]` `(b, t, 3 d)` to the heads' outputs side by side `(b, t, d)`, with RoPE
//! on q and k, the key-padding bias, the softmax and (in training) an attention-dropout mask,
//! and a backward that returns `d(qkv)`.
//!
//! Per batch element and head (one parallel task each):
//!
//! ```text
//! q, k   = rope(q_h), rope(k_h)                       (t, d_head)
//! P      = softmax(q kᵀ / sqrt(d_head) + key_bias)    (t, t)
//! out_h  = (P ⊙ M) v_h                                (t, d_head), M the dropout mask or 1
//! ```
//!
//! The backward recomputes `P` rather than keeping it (a few percent of the layer's FLOPs, and
//! `b h t²` values less memory per layer), then
//!
//! ```text
//! dv = (P ⊙ M)ᵀ dout,  dP = (dout vᵀ) ⊙ M,  dS = P ⊙ (dP - rowsum(dP ⊙ P)) / sqrt(d_head)
//! dq = rope⁻¹(dS k),   dk = rope⁻¹(dSᵀ q)
//! ```
//!
//! Matrix products go through gemm, one thread per task; the rows of a head are read and written
//! in place through strides, so no `(b, h, t, d_head)` copies are made.

use candle::backend::BackendStorage;
use candle::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;

use super::linear::{by_dtype, matmul};
use super::{contiguous, softmax_grad_rows, softmax_rows, zeros, Real, Rotation};

/// The attention core's fixed inputs: everything but `qkv` (and the dropout mask).
#[derive(Clone)]
pub(crate) struct Attention {
    heads: usize,
    /// `(b, t)`: 0 for real keys, a large negative score for padded ones.
    key_bias: Tensor,
    /// `(t, d_head)` cos and sin tables, and whether the pairing is interleaved.
    rope: Option<(Tensor, Tensor, bool)>,
}

/// A raw pointer that tasks writing disjoint parts of one buffer may share.
#[derive(Clone, Copy)]
struct Shared<T>(*mut T);
// SAFETY: every task writes its own (batch, head) block; no two tasks touch the same element.
unsafe impl<T> Send for Shared<T> {}
unsafe impl<T> Sync for Shared<T> {}

impl<T> Shared<T> {
    /// The pointer (a method, so closures capture the `Send` wrapper, not the raw field).
    fn ptr(self) -> *mut T {
        self.0
    }
}

/// The host values of the fixed inputs, in the dtype of `qkv`.
struct Fixed<T> {
    key_bias: Vec<T>,
    cos: Vec<T>,
    sin: Vec<T>,
    interleaved: bool,
}

impl<T: Real> Fixed<T> {
    /// RoPE's rotation (`sign` 1) or its inverse (`sign` -1), if the scheme is RoPE.
    fn rotation(&self, sign: T) -> Option<Rotation<'_, T>> {
        (!self.cos.is_empty()).then_some(Rotation {
            cos: &self.cos,
            sin: &self.sin,
            interleaved: self.interleaved,
            sign,
        })
    }
}

/// Shapes of one call.
#[derive(Clone, Copy)]
pub(super) struct Dims {
    pub b: usize,
    pub t: usize,
    pub d: usize,
    pub h: usize,
    pub dh: usize,
}

impl Dims {
    fn scale<T: Real>(&self) -> T {
        T::lit(1.0 / (self.dh as f64).sqrt())
    }
}

/// Copies head rows `(rows, width)` out of rows of `stride` values, rotated by RoPE (or its
/// inverse) when a rotation is given, else plainly.
#[inline(always)]
fn gather_body<T: Real>(
    src: &[T],
    stride: usize,
    width: usize,
    rotation: Option<Rotation<'_, T>>,
    dst: &mut [T],
) {
    for (i, out) in dst.chunks_exact_mut(width).enumerate() {
        let x = &src[i * stride..i * stride + width];
        match rotation {
            Some(r) => r.apply(x, i, out),
            None => out.copy_from_slice(x),
        }
    }
}
simd_dispatch!(fn gather = gather_body(src: &[T], stride: usize, width: usize, rotation: Option<Rotation<'_, T>>, dst: &mut [T]));

/// Writes head rows `(t, dh)` into rows of `stride` values at `dst`, rotated as in [`gather`].
///
/// # Safety
/// `dst` must be valid for `t` rows of `stride` values, of which this call writes the first
/// `dh` of each, and nothing else may touch those.
#[inline(always)]
unsafe fn scatter<T: Real>(
    src: &[T],
    dh: usize,
    dst: *mut T,
    stride: usize,
    rotation: Option<Rotation<'_, T>>,
) {
    for (i, x) in src.chunks_exact(dh).enumerate() {
        // SAFETY: row i of the destination block, per the contract.
        let out = unsafe { std::slice::from_raw_parts_mut(dst.add(i * stride), dh) };
        match rotation {
            Some(r) => r.apply(x, i, out),
            None => out.copy_from_slice(x),
        }
    }
}

/// One task's scratch space.
struct Scratch<T> {
    /// rotated q and k (RoPE)
    q: Vec<T>,
    k: Vec<T>,
    /// scores, then probabilities `P`
    s: Vec<T>,
    p: Vec<T>,
    /// `P ⊙ M` (backward with dropout)
    pm: Vec<T>,
    dp: Vec<T>,
    ds: Vec<T>,
    dq: Vec<T>,
    dk: Vec<T>,
}

impl<T: Real> Scratch<T> {
    /// Buffers for a forward or a backward pass; those a pass does not use stay empty.
    fn new(n: Dims, rope: bool, mask: bool, backward: bool) -> Self {
        let (th, tt) = (n.t * n.dh, n.t * n.t);
        let z = |len, used: bool| vec![T::zero(); if used { len } else { 0 }];
        Self {
            q: z(th, rope),
            k: z(th, rope),
            s: z(tt, true),
            p: z(tt, true),
            pm: z(tt, mask && backward),
            dp: z(tt, backward),
            ds: z(tt, backward),
            dq: z(th, rope && backward),
            dk: z(th, rope && backward),
        }
    }

    /// The operands `q`, `k`, `v` `(t, d_head)` of head `hd` of batch element `bi`: read in
    /// place from `qkv` through strides, except `q` and `k` under RoPE, which are gathered here
    /// rotated.
    fn heads(&mut self, qkv: &[T], n: Dims, bi: usize, hd: usize, fixed: &Fixed<T>) -> Heads<T> {
        let row = 3 * n.d;
        let base = bi * n.t * row + hd * n.dh;
        let block = |offset: usize| &qkv[base + offset..base + offset + (n.t - 1) * row + n.dh];
        let v = View::rows(block(2 * n.d).as_ptr(), row);
        match fixed.rotation(T::one()) {
            Some(rotation) => {
                gather(block(0), row, n.dh, Some(rotation), &mut self.q);
                gather(block(n.d), row, n.dh, Some(rotation), &mut self.k);
                Heads {
                    q: View::rows(self.q.as_ptr(), n.dh),
                    k: View::rows(self.k.as_ptr(), n.dh),
                    v,
                }
            }
            None => Heads {
                q: View::rows(block(0).as_ptr(), row),
                k: View::rows(block(n.d).as_ptr(), row),
                v,
            },
        }
    }

    /// `P = softmax(q kᵀ / sqrt(d_head) + key_bias)` into `self.p`.
    fn probabilities(&mut self, heads: Heads<T>, n: Dims, bi: usize, fixed: &Fixed<T>) {
        // SAFETY: s is t x t; the heads are valid t x dh operands.
        unsafe {
            product(
                (n.t, n.t, n.dh),
                self.s.as_mut_ptr(),
                n.t,
                heads.q,
                heads.k.t(),
                n.scale(),
            )
        };
        softmax_rows(
            &self.s,
            &fixed.key_bias[bi * n.t..(bi + 1) * n.t],
            &mut self.p,
        );
    }
}

/// A matrix operand: where it starts and its row and column strides.
#[derive(Clone, Copy)]
struct View<T> {
    ptr: *const T,
    rs: isize,
    cs: isize,
}

impl<T> View<T> {
    /// Rows of `stride` values, columns adjacent.
    fn rows(ptr: *const T, stride: usize) -> Self {
        Self {
            ptr,
            rs: stride as isize,
            cs: 1,
        }
    }

    /// The transpose.
    fn t(self) -> Self {
        Self {
            ptr: self.ptr,
            rs: self.cs,
            cs: self.rs,
        }
    }
}

/// One head's operands, each `(t, d_head)`.
#[derive(Clone, Copy)]
struct Heads<T> {
    q: View<T>,
    k: View<T>,
    v: View<T>,
}

/// `dst (m x n) = scale · lhs (m x k) · rhs (k x n)`, on this thread; `dst` rows of `dst_rs`.
///
/// # Safety
/// Every pointer must be valid for the rows, columns and strides it is used with.
unsafe fn product<T: Real>(
    dims: (usize, usize, usize),
    dst: *mut T,
    dst_rs: usize,
    lhs: View<T>,
    rhs: View<T>,
    scale: T,
) {
    // SAFETY: per the contract.
    unsafe {
        matmul(
            dims,
            dst,
            (dst_rs as isize, 1),
            false,
            lhs.ptr,
            (lhs.rs, lhs.cs),
            rhs.ptr,
            (rhs.rs, rhs.cs),
            scale,
            Parallelism::None,
        )
    }
}

impl Attention {
    pub(crate) fn new(
        heads: usize,
        key_bias: Tensor,
        rope: Option<(Tensor, Tensor, bool)>,
    ) -> Self {
        Self {
            heads,
            key_bias,
            rope,
        }
    }

    fn dims(&self, l: &Layout) -> Result<Dims> {
        match l.dims() {
            [b, t, d3] => self.dims_of(*b, *t, *d3),
            d => candle::bail!("fused attention: qkv must be (b, t, 3 d_model), got {d:?}"),
        }
    }

    /// The shapes of a call on `qkv` `(b, t, d3)`, checked against the fixed inputs.
    pub(super) fn dims_of(&self, b: usize, t: usize, d3: usize) -> Result<Dims> {
        if d3 % (3 * self.heads) != 0 {
            candle::bail!(
                "fused attention: qkv width {d3} is not 3 x heads ({}) x d_head",
                self.heads
            );
        }
        let (d, h) = (d3 / 3, self.heads);
        if self.key_bias.dims() != [b, t] {
            candle::bail!(
                "fused attention: key bias {:?} does not match qkv (b, t) = ({b}, {t})",
                self.key_bias.shape()
            );
        }
        if let Some((cos, _, _)) = &self.rope {
            if cos.dims() != [t, d / h] {
                candle::bail!(
                    "fused attention: rope tables {:?} do not match (t, d_head) = ({t}, {})",
                    cos.shape(),
                    d / h
                );
            }
        }
        Ok(Dims {
            b,
            t,
            d,
            h,
            dh: d / h,
        })
    }

    fn fixed<T: Real>(&self) -> Result<Fixed<T>> {
        let host = |x: &Tensor| x.flatten_all()?.to_dtype(T::DTYPE)?.to_vec1::<T>();
        let (cos, sin, interleaved) = match &self.rope {
            Some((c, s, i)) => (host(c)?, host(s)?, *i),
            None => (Vec::new(), Vec::new(), false),
        };
        Ok(Fixed {
            key_bias: host(&self.key_bias)?,
            cos,
            sin,
            interleaved,
        })
    }

    /// The heads' outputs `(b, t, d)`; with `probs` (`b h t²` values), also the attention
    /// weights before dropout, for [`Attention::backward`].
    pub(super) fn forward<T: Real>(
        &self,
        qkv: &[T],
        mask: Option<&[T]>,
        n: Dims,
        probs: Option<&mut [T]>,
    ) -> Result<Vec<T>> {
        let fixed = self.fixed::<T>()?;
        let tt = n.t * n.t;
        let mut out = zeros::<T>(n.b * n.t * n.d);
        let dst = Shared(out.as_mut_ptr());
        let probs = probs.map(|p| {
            assert_eq!(p.len(), n.b * n.h * tt, "attention weights buffer");
            Shared(p.as_mut_ptr())
        });
        (0..n.b * n.h).into_par_iter().for_each_init(
            || Scratch::<T>::new(n, self.rope.is_some(), mask.is_some(), false),
            |w, task| {
                let (bi, hd) = (task / n.h, task % n.h);
                let heads = w.heads(qkv, n, bi, hd, &fixed);
                w.probabilities(heads, n, bi, &fixed);
                if let Some(probs) = probs {
                    // SAFETY: block `task` of the (b h, t, t) buffer is this task's alone.
                    unsafe { std::slice::from_raw_parts_mut(probs.ptr().add(task * tt), tt) }
                        .copy_from_slice(&w.p);
                }
                if let Some(m) = mask {
                    for (p, mi) in w.p.iter_mut().zip(&m[task * tt..(task + 1) * tt]) {
                        *p *= *mi;
                    }
                }
                // SAFETY: out (b, t, d) gets rows t x dh of this (batch, head) block, which no
                // other task writes; p is t x t, v a t x dh operand.
                unsafe {
                    product(
                        (n.t, n.dh, n.t),
                        dst.ptr().add(bi * n.t * n.d + hd * n.dh),
                        n.d,
                        View::rows(w.p.as_ptr(), n.t),
                        heads.v,
                        T::one(),
                    )
                };
            },
        );
        Ok(out)
    }

    /// `d(qkv)` from `d(out)`; the attention weights are recomputed unless `probs` (from
    /// [`Attention::forward`]) has them.
    pub(super) fn backward<T: Real>(
        &self,
        qkv: &[T],
        mask: Option<&[T]>,
        probs: Option<&[T]>,
        g: &[T],
        n: Dims,
    ) -> Result<Vec<T>> {
        let fixed = self.fixed::<T>()?;
        let (row, tt) = (3 * n.d, n.t * n.t);
        if let Some(p) = probs {
            if p.len() != n.b * n.h * tt {
                candle::bail!("fused attention backward: {} saved weights for (b, h, t, t) = ({}, {}, {}, {})", p.len(), n.b, n.h, n.t, n.t);
            }
        }
        let mut dqkv = zeros::<T>(n.b * n.t * row);
        let dst = Shared(dqkv.as_mut_ptr());
        (0..n.b * n.h).into_par_iter().for_each_init(
            || Scratch::<T>::new(n, self.rope.is_some(), mask.is_some(), true),
            |w, task| {
                let (bi, hd) = (task / n.h, task % n.h);
                let heads = w.heads(qkv, n, bi, hd, &fixed);
                let p: &[T] = match probs {
                    Some(probs) => &probs[task * tt..(task + 1) * tt],
                    None => {
                        w.probabilities(heads, n, bi, &fixed);
                        &w.p
                    }
                };
                let dout = View::rows(g[bi * n.t * n.d + hd * n.dh..].as_ptr(), n.d);
                let m = mask.map(|m| &m[task * tt..(task + 1) * tt]);
                if let Some(m) = m {
                    for ((pm, p), mi) in w.pm.iter_mut().zip(p).zip(m) {
                        *pm = *p * *mi;
                    }
                }
                let pm = if m.is_some() { &w.pm } else { p };
                let block = bi * n.t * row + hd * n.dh;
                let one = T::one();
                // SAFETY (all products): the scratch buffers and views have the shapes named;
                // the destination blocks of dqkv (b, t, 3d) belong to this (batch, head) alone.
                unsafe {
                    // dv = (P ⊙ M)ᵀ dout; dP = dout vᵀ
                    product(
                        (n.t, n.dh, n.t),
                        dst.ptr().add(block + 2 * n.d),
                        row,
                        View::rows(pm.as_ptr(), n.t).t(),
                        dout,
                        one,
                    );
                    product(
                        (n.t, n.t, n.dh),
                        w.dp.as_mut_ptr(),
                        n.t,
                        dout,
                        heads.v.t(),
                        one,
                    );
                }
                if let Some(m) = m {
                    for (dp, mi) in w.dp.iter_mut().zip(m) {
                        *dp *= *mi;
                    }
                }
                softmax_grad_rows(p, &w.dp, n.t, &mut w.ds);
                let ds = View::rows(w.ds.as_ptr(), n.t);
                // dq = dS k / sqrt(dh), dk = dSᵀ q / sqrt(dh): straight into dqkv, or rotated
                // back first under RoPE.
                unsafe {
                    match fixed.rotation(-one) {
                        None => {
                            product(
                                (n.t, n.dh, n.t),
                                dst.ptr().add(block),
                                row,
                                ds,
                                heads.k,
                                n.scale(),
                            );
                            product(
                                (n.t, n.dh, n.t),
                                dst.ptr().add(block + n.d),
                                row,
                                ds.t(),
                                heads.q,
                                n.scale(),
                            );
                        }
                        Some(back) => {
                            product(
                                (n.t, n.dh, n.t),
                                w.dq.as_mut_ptr(),
                                n.dh,
                                ds,
                                heads.k,
                                n.scale(),
                            );
                            product(
                                (n.t, n.dh, n.t),
                                w.dk.as_mut_ptr(),
                                n.dh,
                                ds.t(),
                                heads.q,
                                n.scale(),
                            );
                            scatter(&w.dq, n.dh, dst.ptr().add(block), row, Some(back));
                            scatter(&w.dk, n.dh, dst.ptr().add(block + n.d), row, Some(back));
                        }
                    }
                }
            },
        );
        Ok(dqkv)
    }
}

impl CustomOp1 for Attention {
    fn name(&self) -> &'static str {
        "poslab-attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let n = self.dims(l)?;
        let what = "attention";
        let storage = by_dtype!(s.dtype(), what, |T| self.forward::<T>(
            contiguous(s, l, what)?,
            None,
            n,
            None
        )?);
        Ok((storage, Shape::from((n.b, n.t, n.d))))
    }

    fn bwd(&self, qkv: &Tensor, _out: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(qkv.apply_op2_no_bwd(
            &g.contiguous()?,
            &AttentionGrad(self.clone()),
        )?))
    }
}

impl CustomOp2 for Attention {
    fn name(&self) -> &'static str {
        "poslab-attention-dropout"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let n = self.dims(l1)?;
        check_mask(l2, n)?;
        let what = "attention";
        let storage = by_dtype!(s1.dtype(), what, |T| self.forward::<T>(
            contiguous(s1, l1, what)?,
            Some(contiguous(s2, l2, what)?),
            n,
            None
        )?);
        Ok((storage, Shape::from((n.b, n.t, n.d))))
    }

    fn bwd(
        &self,
        qkv: &Tensor,
        mask: &Tensor,
        _out: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let d = qkv.apply_op3_no_bwd(mask, &g.contiguous()?, &AttentionGrad(self.clone()))?;
        Ok((Some(d), None))
    }
}

fn check_mask(l: &Layout, n: Dims) -> Result<()> {
    if l.dims() != [n.b, n.h, n.t, n.t] {
        candle::bail!(
            "fused attention: dropout mask {:?} is not (b, h, t, t) = ({}, {}, {}, {})",
            l.dims(),
            n.b,
            n.h,
            n.t,
            n.t
        );
    }
    Ok(())
}

/// `d(qkv)` from `(qkv, [mask,] d(out))`.
struct AttentionGrad(Attention);

impl CustomOp2 for AttentionGrad {
    fn name(&self) -> &'static str {
        "poslab-attention-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let n = self.0.dims(l1)?;
        let what = "attention backward";
        let storage = by_dtype!(s1.dtype(), what, |T| self.0.backward::<T>(
            contiguous(s1, l1, what)?,
            None,
            None,
            contiguous(s2, l2, what)?,
            n
        )?);
        Ok((storage, l1.shape().clone()))
    }
}

impl CustomOp3 for AttentionGrad {
    fn name(&self) -> &'static str {
        "poslab-attention-dropout-grad"
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
        let n = self.0.dims(l1)?;
        check_mask(l2, n)?;
        let what = "attention backward";
        let storage = by_dtype!(s1.dtype(), what, |T| self.0.backward::<T>(
            contiguous(s1, l1, what)?,
            Some(contiguous(s2, l2, what)?),
            None,
            contiguous(s3, l3, what)?,
            n
        )?);
        Ok((storage, l1.shape().clone()))
    }
}

/// Multi-head attention from packed projections, fused (CPU, f32/f64).
///
/// # Shapes
/// - `qkv`: `(b, t, 3 d_model)`, `[q | k | v]` with heads side by side in each
/// - `key_bias`: `(b, t)`; `rope`: `(t, d_head)` cos and sin tables and the pairing
/// - `dropout_mask`: `(b, h, t, t)` multipliers of the attention weights, or none
/// - returns `(b, t, d_model)`
pub(crate) fn attention(
    qkv: &Tensor,
    heads: usize,
    key_bias: &Tensor,
    rope: Option<(&Tensor, &Tensor, bool)>,
    dropout_mask: Option<&Tensor>,
) -> Result<Tensor> {
    let op = Attention::new(
        heads,
        key_bias.clone(),
        rope.map(|(c, s, i)| (c.clone(), s.clone(), i)),
    );
    let qkv = qkv.contiguous()?;
    match dropout_mask {
        None => qkv.apply_op1(op),
        Some(m) => qkv.apply_op2(&m.contiguous()?, op),
    }
}
