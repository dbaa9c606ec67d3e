//! A whole encoder layer as one autograd node, with a hand-written backward.
//!
//! Through candle's autograd every node's gradient is accumulated into a freshly zeroed tensor
//! of its own (`zeros_like` then `add`), so each activation of a layer costs a memset, an
//! addition and an allocation more in the backward pass than the arithmetic needs: measured at
//! the reference shape, about a fifth of a training step. Here the layer's input and its
//! parameters (packed into one vector) go in, the output comes out, and the backward walks the
//! layer in reverse by hand: gemm for every product, the fused LayerNorm, activation (GELU or ReLU) and attention
//! kernels for the rest, and gradients written straight into their final buffers.
//!
//! ```text
//! pre-norm:   a = LN1(x); qkv = a Wqkvᵀ + b; c = attn(qkv); h = x + m1 ⊙ (c Woᵀ + bo)
//!             e = LN2(h); u = e Wupᵀ + bup; y = h + m2 ⊙ (act(u) Wdownᵀ + bdown)
//! post-norm:  qkv = x Wqkvᵀ + b; c = attn(qkv); s1 = x + m1 ⊙ (c Woᵀ + bo); h = LN1(s1)
//!             u = h Wupᵀ + bup; s2 = h + m2 ⊙ (act(u) Wdownᵀ + bdown); y = LN2(s2)
//! ```
//!
//! With forget gates (`gates` = 2 × heads channels), the score bias is computed inside from the
//! attention input `a` (pre-norm `LN1(x)`, post-norm `x`), as [`crate::nn::AttentionBias::SidedSums`]:
//!
//! ```text
//! z = a Wgᵀ + bg (n, 2h);   [f; g] = running sums along the tokens of log σ(z)   (2, b, h, t)
//! ```
//!
//! so the attention input is normalised once and its gradient (from q, k, v and the gates)
//! reaches LN1's backward as one sum.
//!
//! With a transport (`transport` = the width `K` of its conv), the reflections that carry the
//! keys to the queries ([`crate::nn::Transport`]) are made inside from the attention input `a`
//! in the same way, by the reflections' kernel ([`super::reflections`]), and the attention's
//! kernel takes them in place of `q kᵀ`:
//!
//! ```text
//! u = a W_wᵀ (n, d);   z = a W_bᵀ + b_b (n, h);   [w | β] = reflections(u, taps, z)   (b, h, t, d_head + 1)
//! ```
//!
//! and their gradient returns to `a` beside q, k and v's (`du W_w + dz W_b`).
//!
//! `m1`, `m2` are residual-dropout multipliers (absent in evaluation). In training the forward
//! keeps the activations the backward needs inside the op (about `(8 d + 2 ffn) × b t` values,
//! and `2 h` more per token with gates), and the attention weights `b h t²` while they are small
//! (`Attention::keeps_weights`; else the backward recomputes them);
//! if a backward comes without them (the forward ran in evaluation mode), it recomputes them.

use std::any::Any;
use std::borrow::Cow;
use std::sync::Mutex;

use candle::backend::BackendStorage;
use candle::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::attention::{Attention, Given};
use super::layer_norm::{LayerNormGrad, LayerNormOp};
use super::linear::{
    by_dtype, column_sum, gemm_sums_in_order, grad_input, grad_input_of, grad_weight, linear_out,
    linear_product, residual_linear,
};
use super::log_sigmoid::LogSigmoid;
use super::reflections::Reflections;
use super::{
    activation_par, activation_with_grad_par, contiguous, times_grad_summed_par, zeros, Real,
};
use super::{pointwise, running_sums};
use crate::gpu as device;
use crate::spec::{AttentionDropout, LayerBias, LayerMasks, LayerShape, TransportShape};

/// The activations the backward needs, kept by the forward.
struct Saved<T> {
    /// pre-norm: `LN1(x)`; post-norm: unused (the layer input is `x` itself)
    a: Vec<T>,
    qkv: Vec<T>,
    /// the attention weights `(b, h, t, t)` before dropout; empty when not kept (evaluation, or
    /// too large: `Attention::keeps_weights`)
    probs: Vec<T>,
    c: Vec<T>,
    /// pre-norm: `h`; post-norm: `s1`
    h_or_s1: Vec<T>,
    /// pre-norm: `LN2(h)`; post-norm: `h = LN1(s1)`
    ffn_in: Vec<T>,
    /// `act(u)`
    act: Vec<T>,
    /// `act'(u)`, so the backward needs neither `u` nor the activation's derivative again
    act_grad: Vec<T>,
    /// post-norm: `s2`
    s2: Vec<T>,
    /// with gates: their pre-activations `z` `(n, gates)` and the running sums `(2, b, h, t)`
    gate_z: Vec<T>,
    sums: Vec<T>,
    /// with a transport: `u = a W_wᵀ` `(n, d)`, `z = a W_bᵀ + b_b` `(n, heads)` and the
    /// reflections `[w | β]` `(b, h, t, d_head + 1)`
    refl_u: Vec<T>,
    refl_z: Vec<T>,
    reflections: Vec<T>,
}

pub struct LayerOp {
    shape: LayerShape,
    attention: Attention,
    /// How a transport's reflections are made (heads, the norm's eps, the real tokens), when
    /// `shape.transport` is set.
    reflections: Option<Reflections>,
    masks: LayerMasks,
    /// Keep activations for the backward (training).
    keep: bool,
    saved: Mutex<Option<Box<dyn Any + Send>>>,
}

/// Host copies of the masks, in the dtype of the computation.
struct HostMasks<T> {
    attention: Option<Vec<T>>,
    attention_out: Option<Vec<T>>,
    ffn_out: Option<Vec<T>>,
}

fn host<T: Real>(x: &Option<Tensor>) -> Result<Option<Vec<T>>> {
    x.as_ref()
        .map(|m| m.flatten_all()?.to_dtype(T::DTYPE)?.to_vec1::<T>())
        .transpose()
}

/// The taps' dims as the reflections take them: `(d, K)`, or `[0]` without a conv.
fn taps_dims(d: usize, k: usize) -> Vec<usize> {
    match k {
        0 => vec![0],
        k => vec![d, k],
    }
}

/// `x ⊙ m` in place, when there is a mask.
fn apply_mask<T: Real>(x: &mut [T], m: &Option<Vec<T>>) {
    if let Some(m) = m {
        x.par_chunks_mut(1 << 14)
            .zip(m.par_chunks(1 << 14))
            .for_each(|(x, m)| {
                for (v, k) in x.iter_mut().zip(m) {
                    *v *= *k;
                }
            });
    }
}

/// `g ⊙ m`, borrowed when there is no mask.
fn masked<'a, T: Real>(g: &'a [T], m: &Option<Vec<T>>) -> Cow<'a, [T]> {
    match m {
        Some(_) => {
            let mut v = g.to_vec();
            apply_mask(&mut v, m);
            Cow::Owned(v)
        }
        None => Cow::Borrowed(g),
    }
}

/// `acc += x`, in parallel chunks.
fn add_into<T: Real>(acc: &mut [T], x: &[T]) {
    acc.par_chunks_mut(1 << 14)
        .zip(x.par_chunks(1 << 14))
        .for_each(|(a, x)| {
            for (v, w) in a.iter_mut().zip(x) {
                *v += *w;
            }
        });
}

impl LayerOp {
    pub fn new(shape: LayerShape, attention: Attention, masks: LayerMasks, keep: bool) -> Self {
        Self {
            shape,
            attention,
            reflections: None,
            masks,
            keep,
            saved: Mutex::new(None),
        }
    }

    /// This layer with scores through a transport whose reflections it makes as `reflections`
    /// says (`shape.transport` gives their widths).
    pub fn with_reflections(self, reflections: Option<Reflections>) -> Self {
        Self {
            reflections,
            ..self
        }
    }

    /// The reflections' maker and widths, when the layer has a transport.
    fn transport(&self) -> Option<(&Reflections, TransportShape)> {
        self.reflections.as_ref().zip(self.shape.transport)
    }

    fn rows(&self, l: &Layout, lp: &Layout) -> Result<(usize, usize, usize)> {
        let (b, t, d) = match l.dims() {
            [b, t, d] => (*b, *t, *d),
            dims => candle::bail!("fused encoder layer: x must be (b, t, d_model), got {dims:?}"),
        };
        if d != self.shape.d {
            candle::bail!(
                "fused encoder layer: x is {:?}, the layer is {} wide",
                l.dims(),
                self.shape.d
            );
        }
        if self.shape.transport.is_some() != self.reflections.is_some() {
            candle::bail!(
                "fused encoder layer: a transport's widths ({:?}) without how its reflections \
                 are made, or the reverse",
                self.shape.transport
            );
        }
        if lp.dims() != [self.shape.packed_len()] {
            candle::bail!(
                "fused encoder layer: packed parameters {:?}, expected ({})",
                lp.dims(),
                self.shape.packed_len()
            );
        }
        Ok((b, t, d))
    }

    /// The masks on the host; a seeded attention dropout's made for `b` sequences of `t`.
    fn host_masks<T: Real>(&self, b: usize, t: usize) -> Result<HostMasks<T>> {
        let shape = (b, self.attention.head_count(), t, t).into();
        let attention = match &self.masks.attention {
            Some(m) => Some(m.tensor(&shape, T::DTYPE, &candle::Device::Cpu)?),
            None => None,
        };
        Ok(HostMasks {
            attention: host(&attention)?,
            attention_out: host(&self.masks.attention_out)?,
            ffn_out: host(&self.masks.ffn_out)?,
        })
    }

    /// The layer's output and, `for_backward`, the activations its backward needs (else only
    /// some of them, which the caller drops).
    fn forward<T: Real>(
        &self,
        x: &[T],
        p: &[T],
        (b, t, d): (usize, usize, usize),
        for_backward: bool,
    ) -> Result<(Vec<T>, Saved<T>)> {
        let (n, f, eps) = (b * t, self.shape.ffn, self.shape.eps);
        let simd = self.attention.simd();
        let o = self.shape.offsets();
        let masks = self.host_masks::<T>(b, t)?;
        let ln = |x: &[T], at: usize| {
            LayerNormOp { eps, simd }.forward(x, &p[at..at + d], &p[at + d..at + 2 * d])
        };
        let dims = self.attention.dims_of(b, t, 3 * d)?;

        let a = if self.shape.pre_norm {
            ln(x, o.ln1)
        } else {
            Vec::new()
        };
        let attn_in = if self.shape.pre_norm { &a[..] } else { x };
        // qkv: (n, 3d); c: (n, d), and the attention weights when kept
        let qkv = linear_out(attn_in, &p[o.wqkv..o.bqkv], &p[o.bqkv..o.wo], (n, d, 3 * d));
        // The gates' pre-activations z (n, gates) and the score bias's running sums.
        let (gate_z, sums) = match self.shape.gates {
            0 => (Vec::new(), Vec::new()),
            c => {
                let z = linear_out(attn_in, &p[o.wg..o.bg], &p[o.bg..o.ww], (n, d, c));
                let log_gates = pointwise::forward_par::<LogSigmoid, T>(simd, &z);
                let sums = running_sums::forward(&log_gates, (b, t, 2, c / 2));
                (z, sums)
            }
        };
        // A transport's reflections: u = a W_wᵀ (n, d), z = a W_bᵀ + b_b (n, heads), then
        // [w | β] (b, h, t, d_head + 1) as the reflections' own node makes them.
        let (refl_u, refl_z, reflections) = match self.transport() {
            None => (Vec::new(), Vec::new(), Vec::new()),
            Some((maker, TransportShape { heads: h, taps: k })) => {
                let u = linear_product(attn_in, &p[o.ww..o.taps], (n, d, d));
                let z = linear_out(attn_in, &p[o.wb..o.bb], &p[o.bb..o.len], (n, d, h));
                let rd = maker.dims(&[b, t, d], &taps_dims(d, k), &[b, t, h])?;
                let r = maker.forward(&u, &p[o.taps..o.wb], &z, rd);
                (u, z, r)
            }
        };
        let attention_mask = masks.attention.as_deref();
        let given = self.given(&sums, &reflections);
        let keep_weights = for_backward && self.attention.keeps_weights::<T>(dims);
        let (c, probs) = self
            .attention
            .forward(&qkv, attention_mask, given, dims, keep_weights)?;
        // pre: h = x + m1 ⊙ (c Woᵀ + bo); post: s1, the same sum
        let h_or_s1 = residual_linear(
            x,
            &c,
            &p[o.wo..o.bo],
            &p[o.bo..o.ln2],
            (n, d, d),
            masks.attention_out.as_deref(),
        );

        let ffn_in = ln(&h_or_s1, if self.shape.pre_norm { o.ln2 } else { o.ln1 });
        // u = ffn_in Wupᵀ + bup (n, ffn): the activation's pass adds the bias as it reads u, with
        // gemm's bits where gemm sums u's values from zero; elsewhere gemm adds onto the bias.
        let (w_up, b_up) = (&p[o.wup..o.bup], &p[o.bup..o.wdown]);
        let (u, up_bias) = if gemm_sums_in_order((n, f, d)) {
            (linear_product(&ffn_in, w_up, (n, d, f)), Some(b_up))
        } else {
            (linear_out(&ffn_in, w_up, b_up, (n, d, f)), None)
        };
        let activation = self.shape.activation;
        let (act, act_grad) = if for_backward {
            activation_with_grad_par(simd, u, up_bias, activation)
        } else {
            (activation_par(simd, u, up_bias, activation), Vec::new())
        };
        // pre: y = h + m2 ⊙ (act(u) Wdownᵀ + bdown); post: s2, the same sum from h = LN1(s1)
        let res = if self.shape.pre_norm {
            &h_or_s1
        } else {
            &ffn_in
        };
        let sum = residual_linear(
            res,
            &act,
            &p[o.wdown..o.bdown],
            &p[o.bdown..o.wg],
            (n, f, d),
            masks.ffn_out.as_deref(),
        );
        let (y, s2) = if self.shape.pre_norm {
            (sum, Vec::new())
        } else {
            (ln(&sum, o.ln2), sum)
        };
        Ok((
            y,
            Saved {
                a,
                qkv,
                probs,
                c,
                h_or_s1,
                ffn_in,
                act,
                act_grad,
                s2,
                gate_z,
                sums,
                refl_u,
                refl_z,
                reflections,
            },
        ))
    }

    /// What the layer gives its attention: the gates' running sums, or the reflections, when
    /// it made them.
    fn given<'a, T: Real>(&self, sums: &'a [T], reflections: &'a [T]) -> Given<'a, T> {
        match (sums.is_empty(), reflections.is_empty()) {
            (false, _) => Given::Sums(sums),
            (true, false) => Given::Reflections(reflections),
            (true, true) => Given::Nothing,
        }
    }

    /// `(dx, dparams, d(score bias))` from the layer input, the parameters, the saved
    /// activations and `dy`; the last is empty unless the score bias is owed a gradient.
    fn backward<T: Real>(
        &self,
        x: &[T],
        p: &[T],
        s: &Saved<T>,
        gy: &[T],
        (b, t, d): (usize, usize, usize),
    ) -> Result<(Vec<T>, Vec<T>, Vec<T>)> {
        let (n, f, eps) = (b * t, self.shape.ffn, self.shape.eps);
        let simd = self.attention.simd();
        let o = self.shape.offsets();
        let masks = self.host_masks::<T>(b, t)?;
        let dims = self.attention.dims_of(b, t, 3 * d)?;
        let mut dp = zeros(o.len);
        // LayerNorm backward: returns dx, writes [dw; db] at `at`.
        let ln_back = |x: &[T], g: &[T], at: usize, dp: &mut [T]| -> Vec<T> {
            let (dx, params) = LayerNormGrad { eps, simd }.run(x, &p[at..at + d], g);
            dp[at..at + 2 * d].copy_from_slice(&params);
            dx
        };
        // The gradient of the sum closing the feed-forward residual: pre y itself, post s2.
        let g_res: Cow<'_, [T]> = if self.shape.pre_norm {
            Cow::Borrowed(gy)
        } else {
            Cow::Owned(ln_back(&s.s2, gy, o.ln2, &mut dp))
        };
        // Feed-forward branch.
        let gz = masked(&g_res, &masks.ffn_out);
        grad_weight(&gz, &s.act, (n, d, f), &mut dp[o.wdown..o.bdown]);
        column_sum(&gz, &mut dp[o.bdown..o.wg]);
        let g_act = grad_input_of(&gz, &p[o.wdown..o.bdown], (n, d, f));
        drop(gz);
        // gu = g_act ⊙ act'(u), and b_up's gradient summed from it in the same pass
        let gu = times_grad_summed_par(
            &s.act_grad,
            &g_act,
            self.shape.activation,
            &mut dp[o.bup..o.wdown],
        );
        drop(g_act);
        grad_weight(&gu, &s.ffn_in, (n, f, d), &mut dp[o.wup..o.bup]);
        // The gradient reaching the feed-forward input, plus the residual's.
        let mut g_ffn_in = g_res.into_owned();
        let g_ffn_in = if self.shape.pre_norm {
            // e = LN2(h): gh = g_res + LN2'(gu Wup)
            let ge = grad_input_of(&gu, &p[o.wup..o.bup], (n, f, d));
            add_into(&mut g_ffn_in, &ln_back(&s.h_or_s1, &ge, o.ln2, &mut dp));
            g_ffn_in
        } else {
            // h = LN1(s1) feeds both: gs1 = LN1'(g_res + gu Wup)
            grad_input(&gu, &p[o.wup..o.bup], (n, f, d), &mut g_ffn_in, true);
            ln_back(&s.h_or_s1, &g_ffn_in, o.ln1, &mut dp)
        };
        drop(gu);
        // g_mid: the gradient of the sum closing the attention residual (pre h, post s1).
        let g_mid = g_ffn_in;

        // Attention branch.
        let go = masked(&g_mid, &masks.attention_out);
        grad_weight(&go, &s.c, (n, d, d), &mut dp[o.wo..o.bo]);
        column_sum(&go, &mut dp[o.bo..o.ln2]);
        let gc = grad_input_of(&go, &p[o.wo..o.bo], (n, d, d));
        drop(go);
        let probs = (!s.probs.is_empty()).then_some(&s.probs[..]);
        let given = self.given(&s.sums, &s.reflections);
        let (gqkv, g_sums) =
            self.attention
                .backward(&s.qkv, masks.attention.as_deref(), given, probs, &gc, dims)?;
        drop(gc);
        let attn_in = if self.shape.pre_norm { &s.a[..] } else { x };
        grad_weight(&gqkv, attn_in, (n, 3 * d, d), &mut dp[o.wqkv..o.bqkv]);
        column_sum(&gqkv, &mut dp[o.bqkv..o.wo]);
        // The gates take the running sums' gradient (from the attention) back to z; without
        // them it is the score bias input's, returned.
        let c = self.shape.gates;
        let (gz, gbias) = match c {
            0 => (None, g_sums),
            _ => {
                let g_log = running_sums::backward(&g_sums, (b, t, 2, c / 2));
                let gz = pointwise::grad_par::<LogSigmoid, T>(simd, &s.gate_z, &g_log);
                grad_weight(&gz, attn_in, (n, c, d), &mut dp[o.wg..o.bg]);
                column_sum(&gz, &mut dp[o.bg..o.ww]);
                (Some(gz), Vec::new())
            }
        };
        // A transport takes the reflections' gradient (from the attention) back to u and z,
        // and to the conv's taps.
        let (refl, gbias) = match self.transport() {
            None => (None, gbias),
            Some((maker, TransportShape { heads: h, taps: k })) => {
                let rd = maker.dims(&[b, t, d], &taps_dims(d, k), &[b, t, h])?;
                let taps = &p[o.taps..o.wb];
                let (du, dtaps, dz) = maker.backward((&s.refl_u, taps, &s.refl_z), &gbias, rd);
                grad_weight(&du, attn_in, (n, d, d), &mut dp[o.ww..o.taps]);
                dp[o.taps..o.wb].copy_from_slice(&dtaps);
                grad_weight(&dz, attn_in, (n, h, d), &mut dp[o.wb..o.bb]);
                column_sum(&dz, &mut dp[o.bb..o.len]);
                (Some((du, dz, h)), Vec::new())
            }
        };
        // d(attention input): from q, k and v, plus the gates' (gz Wg) and the reflections'
        // (du W_w + dz W_b).
        let gates_into = |ga: &mut [T]| {
            if let Some(gz) = &gz {
                grad_input(gz, &p[o.wg..o.bg], (n, c, d), ga, true);
            }
            if let Some((du, dz, h)) = &refl {
                grad_input(du, &p[o.ww..o.taps], (n, d, d), ga, true);
                grad_input(dz, &p[o.wb..o.bb], (n, *h, d), ga, true);
            }
        };

        let mut gx = g_mid;
        if self.shape.pre_norm {
            let mut ga = grad_input_of(&gqkv, &p[o.wqkv..o.bqkv], (n, 3 * d, d));
            gates_into(&mut ga);
            add_into(&mut gx, &ln_back(x, &ga, o.ln1, &mut dp));
        } else {
            grad_input(&gqkv, &p[o.wqkv..o.bqkv], (n, 3 * d, d), &mut gx, true);
            gates_into(&mut gx);
        }
        Ok((gx, dp, gbias))
    }
}

/// The layer on the device path ([`crate::gpu`]), for a stack of layers (`stack.rs`): its
/// description, and its fixed inputs as device memory (the guards that keep them valid are
/// `held`).
impl LayerOp {
    fn device_spec(&self) -> Result<device::layer::Spec> {
        if self.attention.own_scores() || self.reflections.is_some() {
            candle::bail!("device path: a scheme's own scores run as a composition of ops");
        }
        let heads = self.attention.head_count();
        if self.shape.gates != 0 && self.shape.gates != 2 * heads {
            candle::bail!(
                "device path: {} gate channels for {heads} heads (2 a head)",
                self.shape.gates
            );
        }
        Ok(device::layer::Spec {
            gates: self.shape.gates != 0,
            d: self.shape.d,
            ffn: self.shape.ffn,
            eps: self.shape.eps,
            pre_norm: self.shape.pre_norm,
            act: self.shape.activation,
            offsets: self.shape.offsets(),
        })
    }

    /// Read guards on every tensor the device path reads besides the op's inputs: the key
    /// bias, RoPE's tables, the score bias and the dropout masks.
    fn held(&self) -> Vec<Option<device::Held<'_>>> {
        let (key_bias, rope) = self.attention.device_tensors();
        let bias = self.attention.bias_tensor();
        let m = &self.masks;
        [
            Some(key_bias),
            rope.map(|r| r.0),
            rope.map(|r| r.1),
            bias,
            match &m.attention {
                Some(AttentionDropout::Drawn(t)) => Some(t),
                _ => None,
            },
            m.attention_out.as_ref(),
            m.ffn_out.as_ref(),
        ]
        .into_iter()
        .map(|t| t.map(device::Held::of))
        .collect()
    }

    fn device_fixed(
        &self,
        held: &[Option<device::Held<'_>>],
        b: usize,
        t: usize,
    ) -> Result<device::layer::Fixed> {
        let mem = |i: usize| held[i].as_ref().map(device::Held::mem).transpose();
        let heads = self.attention.head_count();
        let d = self.shape.d;
        let (scale, window, bias_shape) = self.attention.device_shape();
        let Some(key_bias) = mem(0)? else {
            candle::bail!("device path: no key bias")
        };
        let rope = match (mem(1)?, mem(2)?, self.attention.device_tensors().1) {
            (Some(cos), Some(sin), Some((c, _, interleaved))) => Some(device::Rope {
                cos,
                sin,
                rows: c.dims()[0],
                width: c.dims()[2],
                interleaved,
            }),
            _ => None,
        };
        let bias = match (mem(3)?, bias_shape) {
            (Some(sums), Some(LayerBias::SidedSums(_))) => device::ScoreBias::Sided { sums },
            (Some(values), Some(LayerBias::Offsets(_))) => device::ScoreBias::Offsets { values },
            (Some(bias), Some(LayerBias::Table(table))) => device::ScoreBias::Table {
                bias,
                rows: table.dims()[0],
            },
            _ => device::ScoreBias::None,
        };
        Ok(device::layer::Fixed {
            heads: device::Heads {
                b,
                t,
                h: heads,
                dh: d / heads,
            },
            scale,
            key_bias,
            rope,
            bias,
            bias_grad: self.attention.bias_needs_grad(),
            window,
            masks: device::layer::Masks {
                attention: match (&self.masks.attention, mem(4)?) {
                    (Some(AttentionDropout::Seeded(d)), _) => {
                        Some(device::layer::AttentionMask::Seeded(*d))
                    }
                    (_, m) => m.map(device::layer::AttentionMask::Drawn),
                },
                attention_out: mem(5)?,
                ffn_out: mem(6)?,
            },
        })
    }

    /// The forward on `stream`: the output, and `keep`ing, what the backward reads.
    pub(super) fn device_run(
        &self,
        stream: &dyn device::Stream,
        x: device::Mem,
        p: device::Mem,
        (b, t, _): (usize, usize, usize),
        keep: bool,
    ) -> Result<(device::Buf, Option<device::layer::Saved>)> {
        let held = self.held();
        let fixed = self.device_fixed(&held, b, t)?;
        device::layer::forward(stream, &self.device_spec()?, &fixed, x, p, keep)
    }

    /// The backward on `stream` into `into`, from what the forward kept (else it is
    /// recomputed).
    pub(super) fn device_backward_into(
        &self,
        stream: &dyn device::Stream,
        saved: Option<device::layer::Saved>,
        (x, p, gy): (device::Mem, device::Mem, device::Mem),
        (b, t, _): (usize, usize, usize),
        into: device::layer::Grads,
    ) -> Result<()> {
        let held = self.held();
        let fixed = self.device_fixed(&held, b, t)?;
        let spec = self.device_spec()?;
        let saved = match saved {
            Some(s) => s,
            None => match device::layer::forward(stream, &spec, &fixed, x, p, true)?.1 {
                Some(s) => s,
                None => candle::bail!("device path: a training forward kept nothing"),
            },
        };
        device::layer::backward(stream, &spec, &fixed, x, p, &saved, gy, into)
    }

    /// The packed parameters' length.
    pub(super) fn packed_len(&self) -> usize {
        self.shape.packed_len()
    }
}

/// The layer as a candle op on `(x, packed parameters, score bias or empty)`.
impl CustomOp3 for LayerOp {
    fn name(&self) -> &'static str {
        "poslab-encoder-layer"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        _s3: &CpuStorage,
        _l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = self.rows(l1, l2)?;
        let what = "encoder layer";
        let storage = by_dtype!(s1.dtype(), what, |T| {
            let (y, saved) = self.forward::<T>(
                contiguous(s1, l1, what)?,
                contiguous(s2, l2, what)?,
                dims,
                self.keep,
            )?;
            if self.keep {
                *self.saved.lock().expect("layer activations lock poisoned") =
                    Some(Box::new(saved));
            }
            y
        });
        Ok((storage, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        params: &Tensor,
        bias: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = g.contiguous()?;
        let saved = self
            .saved
            .lock()
            .expect("layer activations lock poisoned")
            .take();
        let grads = x.apply_op3_no_bwd(
            params,
            &g,
            &LayerGrad {
                layer: self,
                saved: Mutex::new(saved),
            },
        )?;
        let owed = self.attention.bias_grad_len() > 0;
        split_gradients(&grads, (x, params, bias), owed)
    }
}

/// The gradients of a layer node's (or a stack's) `(x, params, bias)` from the values its
/// backward wrote one after another: `dx`, `dparams`, then the bias's if `owed` (in its dtype).
pub(super) fn split_gradients(
    grads: &Tensor,
    (x, params, bias): (&Tensor, &Tensor, &Tensor),
    owed: bool,
) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    let (nx, np) = (x.elem_count(), params.elem_count());
    let dx = grads.narrow(0, 0, nx)?.reshape(x.shape())?;
    let dp = grads.narrow(0, nx, np)?;
    let dbias = match owed {
        false => None,
        true => Some(
            grads
                .narrow(0, nx + np, bias.elem_count())?
                .reshape(bias.shape())?
                .to_dtype(bias.dtype())?,
        ),
    };
    Ok((Some(dx), Some(dp), dbias))
}

/// The backward of [`LayerOp`] as a no-gradient op on `(x, params, dy)`, returning `dx`,
/// `dparams` and (when owed) the score bias's gradient concatenated.
struct LayerGrad<'a> {
    layer: &'a LayerOp,
    saved: Mutex<Option<Box<dyn Any + Send>>>,
}

impl LayerGrad<'_> {
    fn run<T: Real>(
        &self,
        x: &[T],
        p: &[T],
        g: &[T],
        dims: (usize, usize, usize),
    ) -> Result<Vec<T>> {
        let saved = self
            .saved
            .lock()
            .expect("layer activations lock poisoned")
            .take();
        let saved = match saved.and_then(|s| s.downcast::<Saved<T>>().ok()) {
            Some(s) => *s,
            None => self.layer.forward::<T>(x, p, dims, true)?.1,
        };
        let (mut dx, dp, dbias) = self.layer.backward(x, p, &saved, g, dims)?;
        drop(saved);
        dx.reserve(dp.len() + dbias.len());
        dx.extend_from_slice(&dp);
        dx.extend_from_slice(&dbias);
        Ok(dx)
    }
}

impl candle::CustomOp3 for LayerGrad<'_> {
    fn name(&self) -> &'static str {
        "poslab-encoder-layer-grad"
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
        let dims = self.layer.rows(l1, l2)?;
        let len = l1.shape().elem_count()
            + l2.shape().elem_count()
            + self.layer.attention.bias_grad_len();
        let what = "encoder layer backward";
        let storage = by_dtype!(s1.dtype(), what, |T| self.run::<T>(
            contiguous(s1, l1, what)?,
            contiguous(s2, l2, what)?,
            contiguous(s3, l3, what)?,
            dims
        )?);
        Ok((storage, Shape::from(len)))
    }
}
