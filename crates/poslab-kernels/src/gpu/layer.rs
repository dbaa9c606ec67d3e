//! One encoder layer, forward and backward, as device operations on a [`Stream`].
//!
//! The same layer as the fused CPU kernel ([`crate::cpu`]'s `layer.rs`), with the same
//! packed parameters and the same saved activations, written as a sequence of matrix products
//! and row kernels. `n = b t` tokens, `d` the width, `f` the feed-forward width:
//!
//! ```text
//! pre-norm:   a = LN1(x)                                         layer_norm
//!             [q|k|v] = heads(a Wqkvᵀ + b, RoPE)                 gemm, heads_in
//!             P = softmax(c q kᵀ + bias + window + key_bias)     gemm (batched), softmax
//!             c = merge(P v)                                     gemm (batched), transpose12
//!               (fused: c written side by side from tiles of q, k, v)  flash
//!             h = x + m1 ⊙ (c Woᵀ + bo);  e = LN2(h)             gemm, residual
//!             u = act(e Wupᵀ + bup)                              gemm, bias_act
//!             y = h + m2 ⊙ (u Wdownᵀ + bdown)                    gemm, residual
//! post-norm:  as above from x, with h = LN1(x + m1 ⊙ (c Woᵀ + bo)) and
//!             y = LN2(h + m2 ⊙ (u Wdownᵀ + bdown))
//! ```
//!
//! 13 operations forward (6 of them products); 10 where the attention is fused ([`flash`]).
//! The backward walks it in reverse: each product's two gradients are two products with the
//! operands' transposes folded into their layouts, bias gradients are column sums (a product
//! with a row of ones; both LayerNorms' in one batched product), and residual gradients are
//! summed into the products that produce them (`beta` 1) or by the LayerNorm backward.
//! Parameter gradients are written straight into their place in the packed gradient.
//!
//! Kept for the backward: the activations (`7 n d + 2 n f` values pre-norm, `8 n d + 2 n f`
//! post-norm, and two statistics per token per LayerNorm), and the attention weights `b h t²`
//! while they take at most [`KEEP_WEIGHTS_BYTES`]; else the backward recomputes them.

use candle::{DType, Result};

use super::*;
use crate::spec::{Offsets, SeededDropout};

/// The attention weights of one layer are kept for the backward while they take at most this
/// much; larger ones are recomputed there (one batched product and one softmax: about 2% of a
/// step at width 768 and 512 tokens). Kept at the reference bench shape (8 MiB a layer, where a
/// step is bound by launches); recomputed at the large one (25 MiB a layer at batch 2, 400 MiB
/// at 32), which keeps the step's peak memory under PyTorch's (which keeps them all).
pub const KEEP_WEIGHTS_BYTES: usize = 16 << 20;

/// The layer's widths and where its parameters sit in the packed vector.
#[derive(Clone, Copy, Debug)]
pub struct Spec {
    pub d: usize,
    pub ffn: usize,
    pub eps: f64,
    pub pre_norm: bool,
    pub act: Act,
    /// FoX's forget gates (2 × heads channels of the attention input), whose running sums
    /// bias the scores.
    pub gates: bool,
    pub offsets: Offsets,
}

/// The attention weights' dropout: multipliers `(b, h, t, t)` in the activations' dtype, or a
/// seed the kernels draw them from (the fused attention per tile, elsewhere into a mask made
/// where it is used).
#[derive(Clone, Copy, Debug)]
pub enum AttentionMask {
    Drawn(Mem),
    Seeded(SeededDropout),
}

/// The dropout multipliers of one forward, each in the activations' dtype.
#[derive(Clone, Copy, Debug, Default)]
pub struct Masks {
    pub attention: Option<AttentionMask>,
    /// `(b, t, d)`
    pub attention_out: Option<Mem>,
    /// `(b, t, d)`
    pub ffn_out: Option<Mem>,
}

/// Everything the layer reads besides its input and parameters.
#[derive(Clone, Copy, Debug)]
pub struct Fixed {
    pub heads: Heads,
    /// What `q kᵀ` is multiplied by.
    pub scale: f64,
    /// `(b, t)`, compute dtype
    pub key_bias: Mem,
    pub rope: Option<Rope>,
    pub bias: ScoreBias,
    /// Whether the score bias is owed a gradient.
    pub bias_grad: bool,
    /// The keys each query may see.
    pub window: Window,
    pub masks: Masks,
}

impl Fixed {
    /// Values of the score bias's gradient (0 when none is owed).
    pub fn bias_grad_len(&self) -> usize {
        let n = self.heads;
        match (self.bias_grad, self.bias) {
            (false, _) | (_, ScoreBias::None) => 0,
            (true, ScoreBias::Table { rows, .. }) => rows * n.h * n.t * n.t,
            (true, ScoreBias::Sided { .. }) => 2 * n.b * n.h * n.t,
            (true, ScoreBias::Offsets { .. }) => n.h * (2 * n.t - 1),
        }
    }

    /// Whether a forward keeps the attention weights of `dtype` for its backward.
    pub fn keeps_weights(&self, dtype: DType) -> bool {
        self.heads.scores().saturating_mul(dtype.size_in_bytes()) <= KEEP_WEIGHTS_BYTES
    }
}

/// What the forward keeps for the backward.
pub struct Saved {
    /// pre-norm: `LN1(x)`
    a: Option<Buf>,
    /// pre-norm: LN1's statistics
    stats_attn: Option<Buf>,
    /// q, k (rotated) and v: `(3, b, h, t, dh)`
    heads: Buf,
    /// the attention weights before dropout, when kept
    probs: Option<Buf>,
    /// fused: the rows' statistics (the output is `c`)
    flash: Option<Buf>,
    /// the heads' outputs side by side `(n, d)`
    c: Buf,
    /// pre-norm: `h`; post-norm: `s1`
    h_or_s1: Buf,
    /// pre-norm: `LN2(h)`; post-norm: `h = LN1(s1)`, and that LayerNorm's statistics
    ffn_in: Buf,
    stats_mid: Buf,
    act: Buf,
    act_grad: Buf,
    /// post-norm: `s2` and LN2's statistics
    s2: Option<Buf>,
    stats_out: Option<Buf>,
    /// with gates: their inputs `(n, 2h)` before the bias, and their running sums
    gates: Option<(Buf, Buf)>,
}

impl Saved {
    /// `fx` with the gates' running sums as its score bias, when the layer has gates.
    fn fixed(&self, fx: &Fixed) -> Fixed {
        match &self.gates {
            Some((_, sums)) => with_sums(fx, sums.mem()),
            None => *fx,
        }
    }
}

/// `fx` with `sums` (the gates') as its score bias, owed no gradient outside the layer.
fn with_sums(fx: &Fixed, sums: Mem) -> Fixed {
    Fixed {
        bias: ScoreBias::Sided { sums },
        bias_grad: false,
        ..*fx
    }
}

/// Whether a layer's attention can run fused on `s` ([`flash`]): the stream has the kernel and
/// no drawn attention dropout mask is given (it is a `b h t t` tensor; a seeded dropout is
/// drawn in the tile loop). Where it can, a bias by offset is given to the layer as it is;
/// elsewhere as its table.
pub fn fuses(s: &dyn Stream, drawn_mask: bool) -> bool {
    s.fuses_attention() && !drawn_mask
}

/// Whether the attention runs fused: it can ([`fuses`]) and the bias is one the kernel reads per
/// tile.
fn fused(s: &dyn Stream, fx: &Fixed) -> bool {
    let drawn = matches!(fx.masks.attention, Some(AttentionMask::Drawn(_)));
    fuses(s, drawn) && !matches!(fx.bias, ScoreBias::Table { .. })
}

/// The attention dropout's multipliers `(b, h, t, t)`, when there is a dropout: the drawn mask,
/// or a buffer made from the seed (which the caller holds while the mask is read).
fn attention_mask(s: &dyn Stream, fx: &Fixed, dt: DType) -> Result<Option<(Mem, Option<Buf>)>> {
    Ok(match fx.masks.attention {
        None => None,
        Some(AttentionMask::Drawn(m)) => Some((m, None)),
        Some(AttentionMask::Seeded(d)) => {
            let m = s.alloc(dt, fx.heads.scores())?;
            s.dropout_mask(d, m.mem())?;
            Some((m.mem(), Some(m)))
        }
    })
}

/// The fused attention of the heads `(3, b, h, t, dh)` under `fx` (a bias [`fused`] takes).
fn flash_of(fx: &Fixed, heads: Mem) -> Result<flash::Flash> {
    let one = fx.heads.one();
    Ok(flash::Flash {
        heads: fx.heads,
        q: heads.at(0, one)?,
        k: heads.at(one, one)?,
        v: heads.at(2 * one, one)?,
        scale: fx.scale,
        key_bias: fx.key_bias,
        bias: match fx.bias {
            ScoreBias::None => flash::FlashBias::None,
            ScoreBias::Sided { sums } => flash::FlashBias::Sided { sums },
            ScoreBias::Offsets { values } => flash::FlashBias::Offsets { values },
            ScoreBias::Table { .. } => {
                candle::bail!("device path: the fused attention reads no t x t bias table")
            }
        },
        window: fx.window,
        dropout: match fx.masks.attention {
            None => None,
            Some(AttentionMask::Seeded(d)) => Some(d),
            Some(AttentionMask::Drawn(_)) => {
                candle::bail!("device path: the fused attention reads no drawn dropout mask")
            }
        },
    })
}

/// `out (n, o) = x (n, i) Wᵀ`, `W` `(o, i)`.
fn project(
    s: &dyn Stream,
    x: Mem,
    w: Mem,
    (n, i, o): (usize, usize, usize),
    out: Mem,
) -> Result<()> {
    s.gemm(&Gemm::one(
        n,
        o,
        i,
        Mat::rows(x, i),
        Mat::t(w, i),
        Mat::rows(out, o),
    ))
}

/// A linear map's two gradients from `g` `(n, o)`: `dW (o, i) = gᵀ x` into `dw`, and (when
/// `dx` is given) `dx (n, i) = g W`, added to what `dx` holds with `accumulate`.
fn project_back(
    s: &dyn Stream,
    g: Mem,
    x: Mem,
    w: Mem,
    (n, i, o): (usize, usize, usize),
    dw: Mem,
    dx: Option<(Mem, bool)>,
) -> Result<()> {
    s.gemm(&Gemm::one(
        o,
        i,
        n,
        Mat::t(g, o),
        Mat::rows(x, i),
        Mat::rows(dw, i),
    ))?;
    if let Some((dx, accumulate)) = dx {
        let p = Gemm::one(n, i, o, Mat::rows(g, o), Mat::rows(w, i), Mat::rows(dx, i));
        s.gemm(&if accumulate { p.accumulate() } else { p })?;
    }
    Ok(())
}

/// `P = softmax(c q kᵀ + ...)` of every head into a new buffer, and `P ⊙ M` into `dropped`
/// when a mask is given.
fn weights(s: &dyn Stream, fx: &Fixed, heads: Mem, dropped: Option<(Mem, Mem)>) -> Result<Buf> {
    let n = fx.heads;
    let (one, th, tt) = (n.one(), n.t * n.dh, n.t * n.t);
    let p = s.alloc(heads.dtype, n.scores())?;
    s.gemm(&Gemm {
        m: n.t,
        n: n.t,
        k: n.dh,
        batch: n.b * n.h,
        a: Mat::rows(heads.at(0, one)?, n.dh).every(th),
        b: Mat::t(heads.at(one, one)?, n.dh).every(th),
        c: Mat::rows(p.mem(), n.t).every(tt),
        alpha: fx.scale,
        beta: 0.0,
    })?;
    s.softmax(&Softmax {
        heads: n,
        sp: p.mem(),
        key_bias: fx.key_bias,
        bias: fx.bias,
        window: fx.window,
        dropout: dropped,
    })?;
    Ok(p)
}

/// The layer's output `(n, d)`, and what its backward needs when `keep` (training).
pub fn forward(
    s: &dyn Stream,
    spec: &Spec,
    fx: &Fixed,
    x: Mem,
    p: Mem,
    keep: bool,
) -> Result<(Buf, Option<Saved>)> {
    let hs = fx.heads;
    let (n, d, f, eps) = (hs.n(), spec.d, spec.ffn, spec.eps);
    let (dt, cd) = (x.dtype, compute_dtype(x.dtype));
    let o = &spec.offsets;
    x.holds(n * d, dt, "the layer's input")?;
    p.holds(o.len, dt, "the layer's parameters")?;
    let norm = |at: usize, out: Mem, stats: Mem| -> Result<Norm> {
        Ok(Norm {
            w: p.at(at, d)?,
            b: p.at(at + d, d)?,
            eps,
            out,
            stats,
        })
    };

    // The attention's input: LN1(x) pre-norm, x itself post-norm.
    let (a, stats_attn) = if spec.pre_norm {
        let (a, stats) = (s.alloc(dt, n * d)?, s.alloc(cd, 2 * n)?);
        s.layer_norm(x, n, d, &norm(o.ln1, a.mem(), stats.mem())?)?;
        (Some(a), Some(stats))
    } else {
        (None, None)
    };
    let attn_in = a.as_ref().map_or(x, Buf::mem);
    // FoX's gates from the attention input, and their running sums as the score bias.
    let gates = match spec.gates {
        true => {
            let (z, sums) = (s.alloc(dt, 2 * hs.h * n)?, s.alloc(cd, 2 * hs.h * n)?);
            let width = 2 * hs.h;
            project(s, attn_in, p.at(o.wg, width * d)?, (n, d, width), z.mem())?;
            s.gates(z.mem(), p.at(o.bg, width)?, hs, sums.mem())?;
            Some((z, sums))
        }
        false => None,
    };
    let fx = &match &gates {
        Some((_, sums)) => with_sums(fx, sums.mem()),
        None => *fx,
    };

    // q, k, v by head, biased and rotated.
    let raw = s.alloc(dt, 3 * n * d)?;
    project(
        s,
        attn_in,
        p.at(o.wqkv, 3 * d * d)?,
        (n, d, 3 * d),
        raw.mem(),
    )?;
    let heads = s.alloc(dt, 3 * n * d)?;
    s.heads_in(
        raw.mem(),
        p.at(o.bqkv, 3 * d)?,
        fx.rope.as_ref(),
        hs,
        heads.mem(),
    )?;
    drop(raw);

    // The weights, their dropout, and the heads' outputs side by side: fused (no weights
    // stored, the output written side by side), or the scores, their softmax, a product and a
    // transpose.
    let (c, probs, flash) = if fused(s, fx) {
        let (c, lse) = (s.alloc(dt, n * d)?, s.alloc(cd, 2 * hs.b * hs.h * hs.t)?);
        s.flash(&flash_of(fx, heads.mem())?, c.mem(), lse.mem())?;
        (c, None, keep.then_some(lse))
    } else {
        let mask = attention_mask(s, fx, dt)?;
        let dropped = match &mask {
            Some((m, _)) => Some((*m, s.alloc(dt, hs.scores())?)),
            None => None,
        };
        let probs = weights(
            s,
            fx,
            heads.mem(),
            dropped.as_ref().map(|(m, b)| (*m, b.mem())),
        )?;
        let used = dropped.as_ref().map_or(probs.mem(), |(_, b)| b.mem());
        let (th, tt) = (hs.t * hs.dh, hs.t * hs.t);
        let ctx = s.alloc(dt, n * d)?;
        s.gemm(&Gemm {
            m: hs.t,
            n: hs.dh,
            k: hs.t,
            batch: hs.b * hs.h,
            a: Mat::rows(used, hs.t).every(tt),
            b: Mat::rows(heads.at(2 * n * d, n * d)?, hs.dh).every(th),
            c: Mat::rows(ctx.mem(), hs.dh).every(th),
            alpha: 1.0,
            beta: 0.0,
        })?;
        drop((dropped, mask));
        let c = s.alloc(dt, n * d)?;
        s.transpose12(ctx.mem(), [hs.b, hs.h, hs.t, hs.dh], c.mem())?;
        drop(ctx);
        (c, (keep && fx.keeps_weights(dt)).then_some(probs), None)
    };

    // The attention's residual (and the LayerNorm after it).
    let proj = s.alloc(dt, n * d)?;
    project(s, c.mem(), p.at(o.wo, d * d)?, (n, d, d), proj.mem())?;
    let (h_or_s1, ffn_in, stats_mid) = (
        s.alloc(dt, n * d)?,
        s.alloc(dt, n * d)?,
        s.alloc(cd, 2 * n)?,
    );
    let mid_norm = if spec.pre_norm { o.ln2 } else { o.ln1 };
    s.residual(&Residual {
        rows: n,
        width: d,
        res: x,
        z: proj.mem(),
        bias: p.at(o.bo, d)?,
        mask: fx.masks.attention_out,
        sum: h_or_s1.mem(),
        norm: Some(norm(mid_norm, ffn_in.mem(), stats_mid.mem())?),
    })?;
    drop(proj);

    // The feed-forward block.
    let (act, act_grad) = (s.alloc(dt, n * f)?, s.alloc(dt, n * f)?);
    project(s, ffn_in.mem(), p.at(o.wup, f * d)?, (n, d, f), act.mem())?;
    s.bias_act(act.mem(), p.at(o.bup, f)?, act_grad.mem(), n, f, spec.act)?;
    let z = s.alloc(dt, n * d)?;
    project(s, act.mem(), p.at(o.wdown, d * f)?, (n, f, d), z.mem())?;
    let y = s.alloc(dt, n * d)?;
    let (s2, stats_out) = if spec.pre_norm {
        s.residual(&Residual {
            rows: n,
            width: d,
            res: h_or_s1.mem(),
            z: z.mem(),
            bias: p.at(o.bdown, d)?,
            mask: fx.masks.ffn_out,
            sum: y.mem(),
            norm: None,
        })?;
        (None, None)
    } else {
        let (s2, stats) = (s.alloc(dt, n * d)?, s.alloc(cd, 2 * n)?);
        s.residual(&Residual {
            rows: n,
            width: d,
            res: ffn_in.mem(),
            z: z.mem(),
            bias: p.at(o.bdown, d)?,
            mask: fx.masks.ffn_out,
            sum: s2.mem(),
            norm: Some(norm(o.ln2, y.mem(), stats.mem())?),
        })?;
        (Some(s2), Some(stats))
    };
    drop(z);
    let saved = keep.then_some(Saved {
        a,
        stats_attn,
        heads,
        probs,
        flash,
        c,
        h_or_s1,
        ffn_in,
        stats_mid,
        act,
        act_grad,
        s2,
        stats_out,
        gates,
    });
    Ok((y, saved))
}

/// Where [`backward`] writes its gradients (the layer's dtype), and the ones its column sums
/// read.
#[derive(Clone, Copy, Debug)]
pub struct Grads {
    /// `(n, d)`
    pub dx: Mem,
    /// the packed parameters' ([`Offsets::len`] values)
    pub dp: Mem,
    /// the score bias's ([`Fixed::bias_grad_len`] values; empty when none is owed)
    pub dbias: Mem,
    /// at least [`ones_len`] ones
    pub ones: Mem,
}

/// The ones [`Grads::ones`] holds for layers of `b` sequences of `t` tokens: a column sum's
/// over the tokens or over the sequences.
pub fn ones_len(b: usize, t: usize) -> usize {
    (b * t).max(b)
}

/// [`ones_len`] ones of `dtype`, for any number of layers' backwards.
pub fn ones(s: &dyn Stream, b: usize, t: usize, dtype: DType) -> Result<Buf> {
    let ones = s.alloc(dtype, ones_len(b, t))?;
    s.fill(ones.mem(), 1.0)?;
    Ok(ones)
}

/// Writes the gradients of the input, the packed parameters and (when owed) the score bias
/// into `into` from the input, the parameters, what the forward kept and `gy`.
pub fn backward(
    s: &dyn Stream,
    spec: &Spec,
    fx: &Fixed,
    x: Mem,
    p: Mem,
    sv: &Saved,
    gy: Mem,
    into: Grads,
) -> Result<()> {
    // Owed outside the layer: gates' running sums are the layer's own.
    let nb = fx.bias_grad_len();
    let fx = &sv.fixed(fx);
    let hs = fx.heads;
    let (n, d, f) = (hs.n(), spec.d, spec.ffn);
    let dt = x.dtype;
    let o = &spec.offsets;
    gy.holds(n * d, dt, "the layer's output gradient")?;
    into.dx.holds(n * d, dt, "the layer's input gradient")?;
    into.dp.holds(o.len, dt, "the layer's parameter gradient")?;
    into.dbias
        .holds(nb, dt, "the layer's score bias gradient")?;
    into.ones
        .holds(ones_len(hs.b, hs.t), dt, "the layer's ones")?;
    let (dx, dp, dbias, ones) = (
        into.dx.at(0, n * d)?,
        into.dp,
        into.dbias.at(0, nb)?,
        into.ones,
    );
    let w = |at: usize, len: usize| p.at(at, len);
    let g = |at: usize, len: usize| dp.at(at, len);
    // `[g ⊙ x̂, g]` rows of a LayerNorm's backward, summed into its packed `[w; b]` gradient.
    // Both LayerNorms' rows, LN1's then LN2's, summed in one batched product at the end.
    let ln_rows = s.alloc(dt, 4 * n * d)?;
    let (ln1_rows, ln2_rows) = (ln_rows.at(0, 2 * n * d)?, ln_rows.at(2 * n * d, 2 * n * d)?);
    let ln_params = || -> Result<()> {
        if o.ln2 < o.ln1 + 2 * d {
            candle::bail!("device path: the packed LayerNorms overlap");
        }
        let apart = o.ln2 - o.ln1;
        s.gemm(&Gemm {
            m: 1,
            n: 2 * d,
            k: n,
            batch: 2,
            a: Mat::rows(ones, n).every(0),
            b: Mat::rows(ln_rows.mem(), 2 * d).every(2 * n * d),
            c: Mat::rows(g(o.ln1, apart + 2 * d)?, 2 * d).every(apart),
            alpha: 1.0,
            beta: 0.0,
        })
    };
    let masked = |m: Option<Mem>| -> Result<Option<(Mem, Buf)>> {
        m.map(|m| Ok((m, s.alloc(dt, n * d)?))).transpose()
    };

    // The feed-forward branch, from the gradient of the sum that closes it (pre `y`, post `s2`)
    // and its masked form `gz`: parameters, then `gu` (the gradient of `e Wupᵀ + bup`).
    let ffn_back = |gz: Mem| -> Result<Buf> {
        colsum(s, ones, gz, n, d, g(o.bdown, d)?)?;
        let gact = s.alloc(dt, n * f)?;
        project_back(
            s,
            gz,
            sv.act.mem(),
            w(o.wdown, d * f)?,
            (n, f, d),
            g(o.wdown, d * f)?,
            Some((gact.mem(), false)),
        )?;
        s.mul(gact.mem(), sv.act_grad.mem(), gact.mem())?;
        colsum(s, ones, gact.mem(), n, f, g(o.bup, f)?)?;
        Ok(gact)
    };

    // The attention's output projection and core, from the gradient of its masked branch `go`:
    // returns `d(qkv)` `(n, 3d)`, and with gates the gradient of their inputs `(n, 2h)`.
    let attention_back = |go: Mem| -> Result<(Buf, Option<Buf>)> {
        colsum(s, ones, go, n, d, g(o.bo, d)?)?;
        let gc = s.alloc(dt, n * d)?;
        project_back(
            s,
            go,
            sv.c.mem(),
            w(o.wo, d * d)?,
            (n, d, d),
            g(o.wo, d * d)?,
            Some((gc.mem(), false)),
        )?;
        let Some((z, _)) = &sv.gates else {
            let into = (nb > 0).then_some(dbias);
            return Ok((core_back(s, fx, sv, gc, ones, into)?, None));
        };
        // The gates' running sums take the scores' gradient back to their inputs.
        let dsums = s.alloc(dt, 2 * hs.b * hs.h * hs.t)?;
        let gqkv = core_back(s, fx, sv, gc, ones, Some(dsums.mem()))?;
        let (width, bg) = (2 * hs.h, w(o.bg, 2 * hs.h)?);
        let gz = s.alloc(dt, n * width)?;
        s.gates_back(z.mem(), bg, dsums.mem(), hs, gz.mem())?;
        colsum(s, ones, gz.mem(), n, width, g(o.bg, width)?)?;
        Ok((gqkv, Some(gz)))
    };
    // The gates' weight gradient, and their share of the attention input's gradient (added
    // into `ga`).
    let gates_back = |gz: &Option<Buf>, attn_in: Mem, ga: Mem| -> Result<()> {
        match gz {
            Some(gz) => project_back(
                s,
                gz.mem(),
                attn_in,
                w(o.wg, 2 * hs.h * d)?,
                (n, d, 2 * hs.h),
                g(o.wg, 2 * hs.h * d)?,
                Some((ga, true)),
            ),
            None => Ok(()),
        }
    };

    if spec.pre_norm {
        let gz = masked(fx.masks.ffn_out)?;
        if let Some((m, b)) = &gz {
            s.mul(gy, *m, b.mem())?;
        }
        let gz_mem = gz.as_ref().map_or(gy, |(_, b)| b.mem());
        let gu = ffn_back(gz_mem)?;
        drop(gz);
        let ge = s.alloc(dt, n * d)?;
        project_back(
            s,
            gu.mem(),
            sv.ffn_in.mem(),
            w(o.wup, f * d)?,
            (n, d, f),
            g(o.wup, f * d)?,
            Some((ge.mem(), false)),
        )?;
        drop(gu);
        // gh = gy + LN2'(ge), and go = gh ⊙ m1
        let gh = s.alloc(dt, n * d)?;
        let go = masked(fx.masks.attention_out)?;
        s.norm_back(&NormBack {
            rows: n,
            width: d,
            x: sv.h_or_s1.mem(),
            stats: sv.stats_mid.mem(),
            w: w(o.ln2, d)?,
            g: ge.mem(),
            add: Some(gy),
            out: gh.mem(),
            mask: go.as_ref().map(|(m, b)| (*m, b.mem())),
            params: ln2_rows,
        })?;
        drop(ge);
        let (gqkv, gz) = attention_back(go.as_ref().map_or(gh.mem(), |(_, b)| b.mem()))?;
        drop(go);
        let (a, stats_attn) = match (&sv.a, &sv.stats_attn) {
            (Some(a), Some(st)) => (a.mem(), st.mem()),
            _ => candle::bail!("device path: a pre-norm layer's backward without LN1's output"),
        };
        let ga = s.alloc(dt, n * d)?;
        colsum(s, ones, gqkv.mem(), n, 3 * d, g(o.bqkv, 3 * d)?)?;
        project_back(
            s,
            gqkv.mem(),
            a,
            w(o.wqkv, 3 * d * d)?,
            (n, d, 3 * d),
            g(o.wqkv, 3 * d * d)?,
            Some((ga.mem(), false)),
        )?;
        drop(gqkv);
        gates_back(&gz, a, ga.mem())?;
        drop(gz);
        // dx = gh + LN1'(ga)
        s.norm_back(&NormBack {
            rows: n,
            width: d,
            x,
            stats: stats_attn,
            w: w(o.ln1, d)?,
            g: ga.mem(),
            add: Some(gh.mem()),
            out: dx,
            mask: None,
            params: ln1_rows,
        })?;
        ln_params()
    } else {
        let (s2, stats_out) = match (&sv.s2, &sv.stats_out) {
            (Some(s2), Some(st)) => (s2.mem(), st.mem()),
            _ => candle::bail!("device path: a post-norm layer's backward without its saved sum"),
        };
        // gs2 = LN2'(gy), and gz = gs2 ⊙ m2
        let gs2 = s.alloc(dt, n * d)?;
        let gz = masked(fx.masks.ffn_out)?;
        s.norm_back(&NormBack {
            rows: n,
            width: d,
            x: s2,
            stats: stats_out,
            w: w(o.ln2, d)?,
            g: gy,
            add: None,
            out: gs2.mem(),
            mask: gz.as_ref().map(|(m, b)| (*m, b.mem())),
            params: ln2_rows,
        })?;
        let gu = ffn_back(gz.as_ref().map_or(gs2.mem(), |(_, b)| b.mem()))?;
        drop(gz);
        // g_h = gs2 + gu Wup, summed into gs2
        project_back(
            s,
            gu.mem(),
            sv.ffn_in.mem(),
            w(o.wup, f * d)?,
            (n, d, f),
            g(o.wup, f * d)?,
            Some((gs2.mem(), true)),
        )?;
        drop(gu);
        // gs1 = LN1'(g_h) straight into dx, and go = gs1 ⊙ m1
        let go = masked(fx.masks.attention_out)?;
        s.norm_back(&NormBack {
            rows: n,
            width: d,
            x: sv.h_or_s1.mem(),
            stats: sv.stats_mid.mem(),
            w: w(o.ln1, d)?,
            g: gs2.mem(),
            add: None,
            out: dx,
            mask: go.as_ref().map(|(m, b)| (*m, b.mem())),
            params: ln1_rows,
        })?;
        drop(gs2);
        let (gqkv, gz) = attention_back(go.as_ref().map_or(dx, |(_, b)| b.mem()))?;
        drop(go);
        colsum(s, ones, gqkv.mem(), n, 3 * d, g(o.bqkv, 3 * d)?)?;
        // dx = gs1 + gqkv Wqkv (+ gz Wg)
        project_back(
            s,
            gqkv.mem(),
            x,
            w(o.wqkv, 3 * d * d)?,
            (n, d, 3 * d),
            g(o.wqkv, 3 * d * d)?,
            Some((dx, true)),
        )?;
        gates_back(&gz, x, dx)?;
        ln_params()
    }
}

/// The attention core's backward, from `gc` `(n, d)`, the gradient of the heads' outputs side
/// by side: returns `d(qkv)` `(n, 3d)`, and writes the score bias's gradient into `dbias` when
/// given.
fn core_back(
    s: &dyn Stream,
    fx: &Fixed,
    sv: &Saved,
    gc: Buf,
    ones: Mem,
    dbias: Option<Mem>,
) -> Result<Buf> {
    let hs = fx.heads;
    let (n, d, dt) = (hs.n(), hs.d(), gc.mem().dtype);
    let (one, th, tt, bh) = (hs.one(), hs.t * hs.dh, hs.t * hs.t, hs.b * hs.h);
    let heads = sv.heads.mem();
    let (q, k, v) = (
        heads.at(0, one)?,
        heads.at(one, one)?,
        heads.at(2 * one, one)?,
    );
    if let Some(lse) = &sv.flash {
        // Fused: the weights recomputed tile by tile from the rows' statistics.
        let gheads = s.alloc(dt, 3 * one)?;
        // The bias's gradient in the compute dtype: into `dbias` itself where that is the
        // layer's, else converted there.
        let len = match fx.bias {
            ScoreBias::Sided { .. } => 2 * bh * hs.t,
            _ => hs.h * (2 * hs.t - 1),
        };
        let dsums = match dbias {
            Some(_) if compute_dtype(dt) != dt => Some(s.alloc(compute_dtype(dt), len)?),
            _ => None,
        };
        s.flash_back(
            &flash_of(fx, heads)?,
            sv.c.mem(),
            lse.mem(),
            gc.mem(),
            &flash::FlashGrads {
                dq: gheads.at(0, one)?,
                dk: gheads.at(one, one)?,
                dv: gheads.at(2 * one, one)?,
                dbias: dsums.as_ref().map(Buf::mem).or(dbias),
            },
        )?;
        drop(gc);
        if let (Some(dsums), Some(dbias)) = (dsums, dbias) {
            s.convert(dsums.mem(), dbias)?;
        }
        let gqkv = s.alloc(dt, 3 * n * d)?;
        s.heads_back(gheads.mem(), fx.rope.as_ref(), hs, gqkv.mem())?;
        return Ok(gqkv);
    }
    let gctx = s.alloc(dt, n * d)?;
    s.transpose12(gc.mem(), [hs.b, hs.t, hs.h, hs.dh], gctx.mem())?;
    drop(gc);
    let recomputed = match &sv.probs {
        Some(_) => None,
        None => Some(weights(s, fx, heads, None)?),
    };
    let Some(probs) = sv.probs.as_ref().or(recomputed.as_ref()).map(Buf::mem) else {
        candle::bail!("device path: the attention weights were neither kept nor recomputed")
    };
    let batched = |m, nn, k, a: Mat, b: Mat, c: Mat, alpha| Gemm {
        m,
        n: nn,
        k,
        batch: bh,
        a,
        b,
        c,
        alpha,
        beta: 0.0,
    };
    let gheads = s.alloc(dt, 3 * one)?;
    let (gq, gk, gv) = (
        gheads.at(0, one)?,
        gheads.at(one, one)?,
        gheads.at(2 * one, one)?,
    );
    // dv = (P ⊙ M)ᵀ gctx
    let mask = attention_mask(s, fx, dt)?;
    let dropped = match &mask {
        Some((m, _)) => {
            let m = *m;
            let pm = s.alloc(dt, hs.scores())?;
            s.mul(probs, m, pm.mem())?;
            Some(pm)
        }
        None => None,
    };
    let used = dropped.as_ref().map_or(probs, Buf::mem);
    s.gemm(&batched(
        hs.t,
        hs.dh,
        hs.t,
        Mat::t(used, hs.t).every(tt),
        Mat::rows(gctx.mem(), hs.dh).every(th),
        Mat::rows(gv, hs.dh).every(th),
        1.0,
    ))?;
    drop(dropped);
    // dP = gctx vᵀ, then dS in place
    let ds = s.alloc(dt, hs.scores())?;
    s.gemm(&batched(
        hs.t,
        hs.t,
        hs.dh,
        Mat::rows(gctx.mem(), hs.dh).every(th),
        Mat::t(v, hs.dh).every(th),
        Mat::rows(ds.mem(), hs.t).every(tt),
        1.0,
    ))?;
    drop(gctx);
    s.softmax_back(probs, ds.mem(), mask.as_ref().map(|m| m.0), bh * hs.t, hs.t)?;
    drop(mask);
    drop(recomputed);
    if let Some(dbias) = dbias {
        match fx.bias {
            ScoreBias::None => {}
            ScoreBias::Table { rows: 1, .. } => {
                // shared by the batch: dS summed over it
                colsum(s, ones, ds.mem(), hs.b, hs.h * tt, dbias)?;
            }
            ScoreBias::Table { .. } => s.convert(ds.mem(), dbias)?,
            ScoreBias::Sided { .. } => s.sided_back(ds.mem(), hs, dbias)?,
            ScoreBias::Offsets { .. } => candle::bail!("{OFFSETS_UNFUSED}"),
        }
    }
    // dq = c dS k, dk = c dSᵀ q
    s.gemm(&batched(
        hs.t,
        hs.dh,
        hs.t,
        Mat::rows(ds.mem(), hs.t).every(tt),
        Mat::rows(k, hs.dh).every(th),
        Mat::rows(gq, hs.dh).every(th),
        fx.scale,
    ))?;
    s.gemm(&batched(
        hs.t,
        hs.dh,
        hs.t,
        Mat::t(ds.mem(), hs.t).every(tt),
        Mat::rows(q, hs.dh).every(th),
        Mat::rows(gk, hs.dh).every(th),
        fx.scale,
    ))?;
    drop(ds);
    let gqkv = s.alloc(dt, 3 * n * d)?;
    s.heads_back(gheads.mem(), fx.rope.as_ref(), hs, gqkv.mem())?;
    Ok(gqkv)
}
