//! Multi-head self-attention with a key-padding mask, and the two places a positional scheme can
//! reach inside it, given as plain inputs ([`AttentionInputs`]): a rotation of q and k, and an
//! additive bias on the scores.

use candle::{DType, Result, Tensor};
use candle_nn::VarBuilder;

#[cfg(feature = "kernels")]
use super::Path;
use super::{linear_with_bias, masked_softmax, Backend, Dropout, Linear, Rotary, MASKED_SCORE};

pub use crate::kernels::spec::{key_padding_bias, Window};

/// The additive bias of a [`Window`] (a sliding window, a causal mask): 0 for the keys a query
/// may see, a large negative score for the others; `None` when every query sees all `t` keys
/// (nothing to mask).
///
/// # Shapes
/// - returns `(1, 1, t, t)` in `dtype`
pub fn window_bias(
    t: usize,
    window: Window,
    dtype: DType,
    device: &candle::Device,
) -> Result<Option<Tensor>> {
    if !window.masks_any(t) {
        return Ok(None);
    }
    let values: Vec<f64> = (0..t * t)
        .map(|n| match window.hides(n / t, n % t) {
            true => MASKED_SCORE,
            false => 0.0,
        })
        .collect();
    Ok(Some(
        Tensor::from_vec(values, (1, 1, t, t), device)?.to_dtype(dtype)?,
    ))
}

/// An additive bias on the attention scores, in one of two forms.
#[derive(Clone, Copy, Debug)]
pub enum AttentionBias<'a> {
    /// `(r, h, t, t)`, added as it is; `r` is 1 (the same for every sequence) or `b`.
    Table(&'a Tensor),
    /// `(2, b, h, t)`: two running sums `f` and `g` of per-token values along each sequence,
    /// whose differences are the bias:
    ///
    /// ```text
    /// bias[h, i, j] = f[h, i] - f[h, j]     j <= i
    ///               = g[h, j] - g[h, i]     j > i
    /// ```
    ///
    /// (the sum between key `j` and query `i`, from `f` to the query's left and `g` to its
    /// right: a content-set decay). The fused kernels build it in place per head and reduce its
    /// gradient to the sums' there, so no `(b, h, t, t)` bias or gradient is ever stored; the
    /// compositions build the table ([`AttentionBias::table`]).
    SidedSums(&'a Tensor),
    /// `(1, h, 2t - 1)`: a bias of the offset `j - i` alone, one value per head and offset
    /// `-(t - 1)..=t - 1` (ALiBi, T5, KERPLE and FIRE over shared positions
    /// `start..start + t`). The device path's fused attention reads it per tile; everything
    /// else reads its table ([`crate::kernels::spec::offset_table`]).
    Offsets(&'a Tensor),
}

impl AttentionBias<'_> {
    /// The same bias, owning its tensor.
    pub fn owned(&self) -> LayerBias {
        match *self {
            Self::Table(t) => LayerBias::Table(t.clone()),
            Self::SidedSums(s) => LayerBias::SidedSums(s.clone()),
            Self::Offsets(v) => LayerBias::Offsets(v.clone()),
        }
    }

    /// The bias as a `(r, h, t, t)` table.
    pub fn table(&self, backend: Backend) -> Result<Tensor> {
        match *self {
            Self::Table(t) => Ok(t.clone()),
            Self::SidedSums(sums) => {
                let (_, b, h, t) = sums.dims4()?;
                let f = sums.get(0)?.reshape((b * h, t))?;
                let g = sums.get(1)?.reshape((b * h, t))?;
                super::sided_differences(&f, &g, backend)?.reshape((b, h, t, t))
            }
            Self::Offsets(v) => crate::kernels::spec::offset_table(v),
        }
    }
}

/// An [`AttentionBias`] a layer computes from its own input, owned (the kernels' form).
pub use crate::kernels::spec::LayerBias;

impl<'a> From<&'a LayerBias> for AttentionBias<'a> {
    /// The bias as attention reads it.
    fn from(bias: &'a LayerBias) -> Self {
        match bias {
            LayerBias::Table(t) => AttentionBias::Table(t),
            LayerBias::SidedSums(s) => AttentionBias::SidedSums(s),
            LayerBias::Offsets(v) => AttentionBias::Offsets(v),
        }
    }
}

/// Forget gates a layer computes from its attention input `a` `(b, t, d)`, whose running sums
/// are its score bias ([`AttentionBias::SidedSums`]):
///
/// ```text
/// z = a Wᵀ + b   (b, t, 2h): each head's forward gate, then each head's backward gate
/// [f; g] = running sums along the tokens of log σ(z), laid out (2, b, h, t)
/// ```
///
/// The fused encoder layer computes them inside itself, so the attention input is normalised
/// once and the gates' gradient joins q, k and v's before its LayerNorm's backward.
#[derive(Clone, Debug)]
pub struct ForgetGates {
    /// `(2h, d)`
    pub weight: Tensor,
    /// `(2h)`
    pub bias: Tensor,
}

impl ForgetGates {
    /// `log σ(x Wᵀ + b)` ([`super::log_sigmoid`]: exact for any `z`), in the weights' dtype
    /// (under mixed precision the bias joins the f32 scores).
    ///
    /// # Shapes
    /// - `x`: `(b, t, d)`; returns `(b, t, 2h)`, every value at most 0
    pub fn log_gates(&self, x: &Tensor, backend: Backend) -> Result<Tensor> {
        let z = Linear::new(self.weight.clone(), Some(self.bias.clone()))
            .forward(&x.to_dtype(self.weight.dtype())?, backend)?;
        super::log_sigmoid(&z, backend)
    }

    /// The score bias: the gates' running sums `[f; g]` along the tokens, as compositions of
    /// ops (the fused layer computes the same inside itself).
    ///
    /// # Shapes
    /// - `x`: `(b, t, d)`; returns `(2, b, h, t)`; differentiable in the gates and `x`
    pub fn sums(&self, x: &Tensor, backend: Backend) -> Result<Tensor> {
        super::running_sums(&self.log_gates(x, backend)?, 2, backend)
    }
}

/// Attention scores a positional scheme computes itself from the queries and keys, in place of
/// `scale · q kᵀ` (PoPE's polar product, CoPE's counted positions, PaTH's transport): `nn`
/// knows no scheme, only this question. Attention then adds the window and the padding, and
/// takes the softmax, as for any scores. Such a layer runs as a composition of ops, unless the
/// scores are a [`Polar`](super::Polar) form, [`GateCounts`](super::GateCounts) or a
/// [`Transport`](super::Transport), which the fused CPU kernels compute themselves.
pub trait QkScores: std::fmt::Debug + Send + Sync {
    /// # Shapes
    /// - `q`, `k`: `(b, h, t, d_head)`, projected (with their biases), never rotated
    /// - `x`: `(b, t, d_model)`, the attention's input (what q, k and v are projected from)
    /// - returns `(b, h, t, t)`, the scaled scores before window and padding, in any float
    ///   dtype (the softmax runs in it)
    fn scores(
        &self,
        q: &Tensor,
        k: &Tensor,
        x: &Tensor,
        scale: f64,
        backend: Backend,
    ) -> crate::Result<Tensor>;

    /// The scores as a [`Polar`](super::Polar) form of q and k, when they are exactly that
    /// (what [`QkScores::scores`] computes): the fused CPU kernels then compute them inside the
    /// attention node, with a hand-written backward, instead of composing ops.
    fn polar(&self) -> Option<&super::Polar> {
        None
    }

    /// The scores as [`GateCounts`](super::GateCounts) of q and k, when they are exactly that:
    /// the fused CPU kernels then compute them inside the attention node, as for
    /// [`QkScores::polar`].
    fn counts(&self) -> Option<&super::GateCounts> {
        None
    }

    /// The scores as a [`Transport`](super::Transport) of q and k by reflections made from the
    /// attention input `x` (`(b, t, d_model)`, over `heads` heads), when they are exactly that:
    /// the fused CPU kernels then carry the keys to the queries inside the attention node, with
    /// a hand-written backward, and the reflections are made beside it (on the CPU's fused
    /// kernels, one more node; inside the layer's node under the `layer` kernels, given
    /// [`QkScores::input_reflections`]).
    fn transport(
        &self,
        _x: &Tensor,
        _heads: usize,
        _backend: Backend,
    ) -> crate::Result<Option<super::Transport>> {
        Ok(None)
    }

    /// The weights [`QkScores::transport`] makes its reflections with, when its scores are a
    /// transport: a fused layer then makes them inside itself from its attention input, and
    /// the layer is one node.
    fn input_reflections(&self) -> Option<super::InputReflections<'_>> {
        None
    }

    /// What turns these scores into attention weights, where it is not the softmax
    /// (stick-breaking's): the layer then runs as a composition of ops.
    fn weights(&self) -> Option<&dyn AttentionWeights> {
        None
    }
}

/// Attention weights a scheme makes from the scores in place of the softmax (stick-breaking's),
/// and what each head then adds to its output beside `weights · v`: `nn` knows no scheme, only
/// this question.
pub trait AttentionWeights: std::fmt::Debug + Send + Sync {
    /// # Shapes
    /// - `scores`: `(b, h, t, t)`, scaled, with any score bias, before masks; `allowed`:
    ///   `(b, 1, t, t)`, 1 for the keys a query may see (real, and within its window) and 0
    ///   for the others, in the scores' dtype
    /// - returns the weights `(b, h, t, t)`, 0 where not allowed, and what each head adds to
    ///   its output `(b, h, t, d_head)` (or a shape that broadcasts to it), if anything
    fn weights(
        &self,
        scores: &Tensor,
        allowed: &Tensor,
        backend: Backend,
    ) -> crate::Result<(Tensor, Option<Tensor>)>;

    /// Whether the fused CPU kernels compute these weights inside the attention node, in place
    /// of its softmax: the stick-breaking order's, with the query's own key first (`Some(true)`)
    /// or never (`Some(false)`), and nothing added to the heads' outputs. `None`: the layer
    /// runs as ops, through [`AttentionWeights::weights`].
    fn fused_sticks(&self) -> Option<bool> {
        None
    }
}

/// `(b, 1, t, t)`: 1 where query `i` may see key `j` (a real key within its window), else 0,
/// in `dtype`, from the key-padding bias `(b, t)` of [`key_padding_bias`].
pub fn allowed_keys(
    key_padding: &Tensor,
    window: Window,
    t: usize,
    dtype: DType,
) -> Result<Tensor> {
    let (b, _) = key_padding.dims2()?;
    let real = key_padding
        .ge(MASKED_SCORE / 2.0)?
        .to_dtype(dtype)?
        .reshape((b, 1, 1, t))?;
    let inside = pair_mask(t, |i, j| !window.hides(i, j), dtype, key_padding.device())?;
    real.broadcast_mul(&inside.reshape((1, 1, t, t))?)
}

/// `(t, t)`: 1 where `keep(row, column)`, else 0, in `dtype` on `device`: a mask or a triangle
/// over query-key pairs.
pub fn pair_mask(
    t: usize,
    keep: impl Fn(usize, usize) -> bool,
    dtype: DType,
    device: &candle::Device,
) -> Result<Tensor> {
    let v: Vec<f64> = (0..t * t)
        .map(|n| f64::from(u8::from(keep(n / t, n % t))))
        .collect();
    Tensor::from_vec(v, (t, t), &candle::Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)
}

/// What attention reads besides the hidden states: plain tensors, built by whoever knows the
/// positional scheme (`nn` knows none).
///
/// ```text
/// S = scale · rot(q) rot(k)ᵀ + score_bias + window;   P = softmax(S + key_padding)
/// ```
///
/// `window` is a large negative score for keys outside the query's [`Window`] (more than
/// `max_offset` from it in a local layer, after it in a causal model), 0 otherwise; the fused
/// kernels apply it in place, the composition as a [`window_bias`].
#[derive(Clone, Copy, Debug)]
pub struct AttentionInputs<'a> {
    /// `(b, t)` from [`key_padding_bias`].
    pub key_padding: &'a Tensor,
    /// A rotation of q and k by their tokens' positions.
    pub rotary: Option<&'a Rotary>,
    /// Added to the scaled scores.
    pub score_bias: Option<AttentionBias<'a>>,
    /// The keys each query may see (a sliding window, a causal mask): others get no weight.
    pub window: Window,
    /// Scores the scheme computes from q and k itself, in place of `scale · q kᵀ`.
    pub scores: Option<&'a dyn QkScores>,
}

impl<'a> AttentionInputs<'a> {
    /// Only the padding mask.
    pub fn padding(key_padding: &'a Tensor) -> Self {
        Self {
            key_padding,
            rotary: None,
            score_bias: None,
            window: Window::ALL,
            scores: None,
        }
    }

    /// Whether the fused CPU kernels compute these scores: `scale · q kᵀ`, or a scheme's own
    /// scores that are a [`Polar`](super::Polar) form or [`GateCounts`](super::GateCounts), or
    /// `scale · q kᵀ` under weights the kernels make in place of the softmax
    /// ([`AttentionWeights::fused_sticks`]), alone (no rotation, no score bias beside).
    #[cfg_attr(not(feature = "kernels"), allow(dead_code))]
    pub(crate) fn fused_scores(&self) -> bool {
        match self.scores {
            None => true,
            Some(s) => {
                let own = s.polar().is_some()
                    || s.counts().is_some()
                    || s.weights().and_then(|w| w.fused_sticks()).is_some();
                own && self.rotary.is_none() && self.score_bias.is_none()
            }
        }
    }
}

/// Scaled dot-product attention over `n_heads` heads, projections `attn.{q,k,v,o}`.
///
/// The key projection has a bias only when asked (`key_bias`), which is when q and k are
/// rotated. Without a rotation a key bias adds `q_i . b_k` to every score of query `i`, the same
/// for all keys, and softmax cancels it: the bias could never change an output, and its
/// gradient is exactly zero. A rotation turns it by position (`q_i . R(j - i) b_k`), which makes
/// it a real, relative-position parameter.
#[derive(Clone, Debug)]
pub struct SelfAttention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    n_heads: usize,
    head_dim: usize,
    /// What `q kᵀ` is multiplied by: `1/sqrt(d_head)` usually, `1/sqrt(2 d_head)` when a
    /// second, positional score of the same size is added (TUPE).
    scale: f64,
    dropout: Dropout,
}

impl SelfAttention {
    /// What weight decay leaves alone: the projections' biases.
    pub fn undecayed(&self) -> Vec<Tensor> {
        [&self.q, &self.k, &self.v, &self.o]
            .iter()
            .flat_map(|l| l.undecayed())
            .collect()
    }
}

impl SelfAttention {
    /// `score_scale` multiplies `q kᵀ`; `None` is the usual `1/sqrt(d_head)`. The projections
    /// have biases when `bias` (the key's only when `key_bias` too).
    pub fn new(
        d_model: usize,
        n_heads: usize,
        key_bias: bool,
        bias: bool,
        score_scale: Option<f64>,
        dropout: Dropout,
        vb: VarBuilder,
    ) -> Result<Self> {
        let make = |with_bias: bool, name: &str| {
            linear_with_bias(d_model, d_model, with_bias, vb.pp(name))
        };
        Ok(Self {
            q: make(bias, "q")?,
            k: make(bias && key_bias, "k")?,
            v: make(bias, "v")?,
            o: make(bias, "o")?,
            n_heads,
            head_dim: d_model / n_heads,
            scale: score_scale.unwrap_or(1.0 / ((d_model / n_heads) as f64).sqrt()),
            dropout,
        })
    }

    /// Attention heads.
    pub fn n_heads(&self) -> usize {
        self.n_heads
    }

    /// What `q kᵀ` is multiplied by.
    pub fn score_scale(&self) -> f64 {
        self.scale
    }

    /// The dropout on the attention weights.
    pub fn dropout(&self) -> &Dropout {
        &self.dropout
    }

    /// The projections `(q, k, v, o)`.
    pub fn projections(&self) -> [&Linear; 4] {
        [&self.q, &self.k, &self.v, &self.o]
    }

    /// The projections `(q, k, v, o)`, to be packed ([`crate::ParamStore::pack`]).
    pub(crate) fn projections_mut(&mut self) -> [&mut Linear; 4] {
        [&mut self.q, &mut self.k, &mut self.v, &mut self.o]
    }

    /// `[W_q; W_k; W_v]` `(3 d, d)` and `[b_q; b_k; b_v]` `(3 d)`, zeros for a projection
    /// without bias: the packed projection of the fused kernels.
    #[cfg_attr(not(feature = "kernels"), allow(dead_code))]
    pub(crate) fn packed_qkv(&self) -> Result<(Tensor, Tensor)> {
        let weight = Tensor::cat(&[self.q.weight(), self.k.weight(), self.v.weight()], 0)?;
        let biases = [&self.q, &self.k, &self.v]
            .map(|l| l.bias_or_zeros())
            .into_iter()
            .collect::<Result<Vec<_>>>()?;
        Ok((weight, Tensor::cat(&biases, 0)?))
    }

    /// The queries and keys of `xs` before any rotation, each `(b, h, t, d_head)`: what
    /// `analyze` measures RoPE's frequency use on.
    pub fn queries_keys(&self, xs: &Tensor, backend: Backend) -> Result<(Tensor, Tensor)> {
        let (b, t, _) = xs.dims3()?;
        let heads = |y: Tensor| -> Result<Tensor> {
            y.reshape((b, t, self.n_heads, self.head_dim))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k) = (self.q.forward(xs, backend)?, self.k.forward(xs, backend)?);
        Ok((heads(q)?, heads(k)?))
    }

    /// The attention scores (scaled, before masking) of the input `content + position`, and
    /// their four terms: content·content, content·position, position·content,
    /// position·position (query side first). Projection biases go with the content side. The
    /// terms sum to the scores.
    ///
    /// # Shapes
    /// - `content`, `position`: `(b, t, d_model)`
    /// - returns `(scores, [cc, cp, pc, pp])`, each `(b, h, t, t)`
    pub fn score_terms(
        &self,
        content: &Tensor,
        position: &Tensor,
        backend: Backend,
    ) -> Result<(Tensor, [Tensor; 4])> {
        let (b, t, _) = content.dims3()?;
        let heads = |y: Tensor| -> Result<Tensor> {
            y.reshape((b, t, self.n_heads, self.head_dim))?
                .transpose(1, 2)?
                .contiguous() // (b, h, t, d_head)
        };
        let weight_only = |lin: &Linear, x: &Tensor| x.broadcast_matmul(&lin.weight().t()?);
        let scale = self.scale;
        let qk = |q: &Tensor, k: &Tensor| -> Result<Tensor> { q.matmul(&k.t()?)? * scale };
        let whole = (content + position)?;
        let scores = qk(
            &heads(self.q.forward(&whole, backend)?)?,
            &heads(self.k.forward(&whole, backend)?)?,
        )?;
        let (qc, qp) = (
            heads(self.q.forward(content, backend)?)?,
            heads(weight_only(&self.q, position)?)?,
        );
        let (kc, kp) = (
            heads(self.k.forward(content, backend)?)?,
            heads(weight_only(&self.k, position)?)?,
        );
        Ok((
            scores,
            [qk(&qc, &kc)?, qk(&qc, &kp)?, qk(&qp, &kc)?, qk(&qp, &kp)?],
        ))
    }

    /// # Shapes
    /// - `xs`: `(b, t, d_model)`; `inputs`: see [`AttentionInputs`]
    /// - returns `(b, t, d_model)`
    pub fn forward_t(
        &self,
        xs: &Tensor,
        inputs: AttentionInputs,
        train: bool,
        backend: Backend,
    ) -> crate::Result<Tensor> {
        #[cfg(feature = "kernels")]
        if backend.path(xs) == Path::Fused {
            return self.forward_fused(xs, inputs, train, backend);
        }
        self.forward_composed(xs, inputs, train, backend)
    }

    /// [`SelfAttention::forward_t`] on the fused CPU kernels: one projection for q, k and v,
    /// then the whole attention core as one node, where the kernels compute these scores
    /// (`q kᵀ`, a polar form, gate counts or a transport); else as ops.
    #[cfg(feature = "kernels")]
    fn forward_fused(
        &self,
        xs: &Tensor,
        inputs: AttentionInputs,
        train: bool,
        backend: Backend,
    ) -> crate::Result<Tensor> {
        let (b, t, _) = xs.dims3()?;
        // Scores carried by a transport: its reflections are made from `xs` here, before the
        // attention node.
        let transport = match inputs.scores {
            Some(own) if inputs.rotary.is_none() && inputs.score_bias.is_none() => {
                own.transport(xs, self.n_heads, backend)?
            }
            _ => None,
        };
        if inputs.fused_scores() || transport.is_some() {
            // One projection for q, k and v, then the whole attention core as one node.
            let (weight, bias_qkv) = self.packed_qkv()?; // (3d, d), (3d)
            let qkv = crate::kernels::cpu::linear(xs, &weight, Some(&bias_qkv))?; // (b, t, 3d)
            let mask = self.dropout.attention_multipliers(
                xs,
                &(b, self.n_heads, t, t).into(),
                train,
                backend,
            )?;
            let core = self
                .fused_core(inputs, backend)
                .with_transport(transport.as_ref().map(super::Transport::spec));
            let out = crate::kernels::cpu::attention(&qkv, core, mask.as_ref())?; // (b, t, d)
            return Ok(self.o.forward(&out, backend)?);
        }
        self.forward_composed(xs, inputs, train, backend)
    }

    /// [`SelfAttention::forward_t`] as a composition of ops (each op on the path `backend`
    /// gives it).
    fn forward_composed(
        &self,
        xs: &Tensor,
        inputs: AttentionInputs,
        train: bool,
        backend: Backend,
    ) -> crate::Result<Tensor> {
        let (b, t, d) = xs.dims3()?;
        let heads = |y: Tensor| -> Result<Tensor> {
            y.reshape((b, t, self.n_heads, self.head_dim))?
                .transpose(1, 2)? // (b, h, t, d_head)
                .contiguous()
        };
        let mut q = heads(self.q.forward(xs, backend)?)?;
        let mut k = heads(self.k.forward(xs, backend)?)?;
        let v = heads(self.v.forward(xs, backend)?)?;
        if let Some(rotary) = inputs.rotary {
            // A partial rotation joins its parts along the head: contiguous again, so that a
            // one-token input (strides candle's matmul refuses) multiplies like any other.
            q = rotary.apply(&q, backend)?.contiguous()?;
            k = rotary.apply(&k, backend)?.contiguous()?;
        }
        let scores = match inputs.scores {
            // (b, h, t, t) in the scheme's dtype: the softmax runs in it, as for a bias.
            Some(own) => own.scores(&q, &k, xs, self.scale, backend)?,
            None => (super::matmul(&q, &k.t()?)? * self.scale)?, // (b, h, t, t)
        };
        if let Some(own) = inputs.scores.and_then(|s| s.weights()) {
            // Weights of the scheme's own in place of the softmax, over the keys it may see.
            let scores = match inputs.score_bias {
                Some(bias) => {
                    let bias = bias.table(backend)?;
                    scores.to_dtype(bias.dtype())?.broadcast_add(&bias)?
                }
                None => scores,
            };
            let allowed = allowed_keys(inputs.key_padding, inputs.window, t, scores.dtype())?;
            let (weights, added) = own.weights(&scores, &allowed, backend)?;
            let weights =
                self.dropout
                    .forward_attention(&weights.to_dtype(v.dtype())?, train, backend)?;
            let mut out = super::matmul(&weights, &v)?; // (b, h, t, d_head)
            if let Some(added) = added {
                out = out.broadcast_add(&added.to_dtype(out.dtype())?)?;
            }
            let out = out.transpose(1, 2)?.reshape((b, t, d))?; // (b, t, d_model)
            return Ok(self.o.forward(&out, backend)?);
        }

        // The window after the score bias, as the fused kernels add them.
        let window = |s: Tensor| -> Result<Tensor> {
            match window_bias(t, inputs.window, s.dtype(), xs.device())? {
                Some(w) => s.broadcast_add(&w), // (1, 1, t, t)
                None => Ok(s),
            }
        };
        let weights = match inputs.score_bias {
            None => masked_softmax(&window(scores)?, inputs.key_padding, backend)?
                .to_dtype(v.dtype())?,
            Some(bias) => {
                // The bias is added in its own dtype (the parameters', f32 under mixed
                // precision), where the softmax runs anyway.
                let bias = bias.table(backend)?;
                let biased = window(scores.to_dtype(bias.dtype())?.broadcast_add(&bias)?)?;
                masked_softmax(&biased, inputs.key_padding, backend)?.to_dtype(v.dtype())?
            }
        };
        let weights = self.dropout.forward_attention(&weights, train, backend)?;
        let out = super::matmul(&weights, &v)?; // (b, h, t, d_head)
        let out = out.transpose(1, 2)?.reshape((b, t, d))?; // (b, t, d_model)
        Ok(self.o.forward(&out, backend)?)
    }

    /// The fixed inputs of the fused attention core.
    #[cfg(feature = "kernels")]
    pub(crate) fn fused_core(
        &self,
        inputs: AttentionInputs,
        backend: Backend,
    ) -> crate::kernels::cpu::Attention {
        crate::kernels::cpu::Attention::new(
            self.n_heads,
            self.scale,
            inputs.key_padding,
            inputs.rotary.map(Rotary::spec),
            inputs.score_bias.as_ref().map(AttentionBias::owned),
            inputs.window,
            backend.simd,
        )
        .with_polar(
            inputs
                .scores
                .and_then(|s| s.polar())
                .map(super::Polar::spec),
        )
        .with_counts(
            inputs
                .scores
                .and_then(|s| s.counts())
                .map(super::GateCounts::spec),
        )
        .with_sticks(
            inputs
                .scores
                .and_then(|s| s.weights())
                .and_then(|w| w.fused_sticks()),
        )
    }
}
