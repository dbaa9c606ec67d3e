//! The plain descriptions the kernels are given, shared by the CPU kernels ([`super::cpu`]) and
//! the device path ([`super::gpu`]): the shapes of a layer, where its parameters sit in the
//! packed vector, its dropout masks, and its feed-forward nonlinearity.

use candle::{DType, Result, Tensor};

/// The keys each query may see besides padding: at most `before` tokens before it and at most
/// `after` tokens after it (`None`: no limit on that side). A sliding window of `m` is
/// `(Some(m), Some(m))`; a causal (decoder) mask is `after = Some(0)`: query `i` sees keys
/// `j <= i` only. Keys outside get the masked score, so their weights are exactly 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Window {
    /// The most tokens before the query a key may be.
    pub before: Option<usize>,
    /// The most tokens after the query a key may be.
    pub after: Option<usize>,
}

impl Window {
    /// Every key.
    pub const ALL: Self = Self {
        before: None,
        after: None,
    };

    /// Keys at most `max_offset` tokens from the query (a local layer; `None`: any), and none
    /// after it when `causal`.
    pub fn new(max_offset: Option<usize>, causal: bool) -> Self {
        Self {
            before: max_offset,
            after: if causal { Some(0) } else { max_offset },
        }
    }

    /// Whether keys after the query are masked (a causal mask).
    pub fn causal(&self) -> bool {
        self.after == Some(0)
    }

    /// The keys query `i` of `t` may see: `lo..hi`.
    #[inline]
    pub fn keys(&self, i: usize, t: usize) -> std::ops::Range<usize> {
        let lo = self.before.map_or(0, |m| i.saturating_sub(m));
        let hi = self
            .after
            .map_or(t, |m| i.saturating_add(m).saturating_add(1).min(t));
        lo..hi.max(lo)
    }

    /// Whether key `j` is outside query `i`'s window.
    #[inline]
    pub fn hides(&self, i: usize, j: usize) -> bool {
        match j > i {
            true => self.after.is_some_and(|m| j - i > m),
            false => self.before.is_some_and(|m| i - j > m),
        }
    }

    /// The keys any query of `rows` may see: the union of their [`Window::keys`].
    pub fn keys_of(&self, rows: std::ops::Range<usize>, t: usize) -> std::ops::Range<usize> {
        match rows.is_empty() {
            true => 0..0,
            false => self.keys(rows.start, t).start..self.keys(rows.end - 1, t).end,
        }
    }

    /// The queries that may see any key of `keys`: those within `after` before them to
    /// `before` after them.
    pub fn queries_of(&self, keys: std::ops::Range<usize>, t: usize) -> std::ops::Range<usize> {
        if keys.is_empty() {
            return 0..0;
        }
        let lo = self.after.map_or(0, |m| keys.start.saturating_sub(m));
        let hi = self.before.map_or(t, |m| {
            (keys.end - 1).saturating_add(m).saturating_add(1).min(t)
        });
        lo..hi.max(lo)
    }

    /// Whether it hides any key of a sequence of `t` tokens.
    pub fn masks_any(&self, t: usize) -> bool {
        let limit = t.saturating_sub(1);
        self.before.is_some_and(|m| m < limit) || self.after.is_some_and(|m| m < limit)
    }
}

/// The feed-forward nonlinearity of a fused layer (GeGLU layers run as ops).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    /// GELU with the exact (erf) CDF.
    Gelu,
    /// `max(x, 0)`.
    Relu,
}

/// The widths of a layer and where each parameter sits in the packed vector.
#[derive(Clone, Copy, Debug)]
pub struct LayerShape {
    /// The residual stream's width.
    pub d: usize,
    /// The feed-forward block's width.
    pub ffn: usize,
    /// The LayerNorms' epsilon.
    pub eps: f64,
    /// LayerNorm before each branch (else after the residual sum).
    pub pre_norm: bool,
    /// The feed-forward nonlinearity.
    pub activation: Act,
    /// Forget-gate channels computed from the attention input (2 × heads: forward gates, then
    /// backward), whose running sums bias the scores; 0 for none.
    pub gates: usize,
    /// Scores through a transport whose reflections the layer makes from its attention input
    /// (PaTH's); `None` for scores without.
    pub transport: Option<TransportShape>,
}

/// The widths of a transport's reflections made inside a layer.
#[derive(Clone, Copy, Debug)]
pub struct TransportShape {
    /// The heads, one strength each.
    pub heads: usize,
    /// The width `K` of the short convolution (0: none).
    pub taps: usize,
}

/// Offsets of the parameters in the packed vector, in this order: `attn_norm.{weight,bias}`,
/// `W_qkv` `(3d, d)` (q, k, v stacked), `b_qkv` `(3d)`, `W_o` `(d, d)`, `b_o`,
/// `ffn_norm.{weight,bias}`, `W_up` `(ffn, d)`, `b_up`, `W_down` `(d, ffn)`, `b_down`, and with
/// gates `W_g` `(gates, d)`, `b_g` `(gates)`, and with a transport its reflections' `W_w`
/// `(d, d)`, the conv's taps `(d, K)`, `W_b` `(heads, d)` and `b_b` `(heads)`.
#[derive(Clone, Copy, Debug)]
#[allow(missing_docs)]
pub struct Offsets {
    pub ln1: usize,
    pub wqkv: usize,
    pub bqkv: usize,
    pub wo: usize,
    pub bo: usize,
    pub ln2: usize,
    pub wup: usize,
    pub bup: usize,
    pub wdown: usize,
    pub bdown: usize,
    pub wg: usize,
    pub bg: usize,
    pub ww: usize,
    pub taps: usize,
    pub wb: usize,
    pub bb: usize,
    pub len: usize,
}

impl LayerShape {
    /// Where each parameter sits in the packed vector.
    pub fn offsets(&self) -> Offsets {
        let (d, f) = (self.d, self.ffn);
        let mut at = 0;
        let mut take = |n: usize| {
            let start = at;
            at += n;
            start
        };
        let ln1 = take(2 * d);
        let wqkv = take(3 * d * d);
        let bqkv = take(3 * d);
        let wo = take(d * d);
        let bo = take(d);
        let ln2 = take(2 * d);
        let wup = take(f * d);
        let bup = take(f);
        let wdown = take(d * f);
        let bdown = take(d);
        let wg = take(self.gates * d);
        let bg = take(self.gates);
        let (rows, k, h) = match self.transport {
            Some(tr) => (d, tr.taps, tr.heads),
            None => (0, 0, 0),
        };
        let ww = take(rows * d);
        let taps = take(d * k);
        let wb = take(h * d);
        let bb = take(h);
        Offsets {
            ln1,
            wqkv,
            bqkv,
            wo,
            bo,
            ln2,
            wup,
            bup,
            wdown,
            bdown,
            wg,
            bg,
            ww,
            taps,
            wb,
            bb,
            len: at,
        }
    }

    /// The length of the packed parameter vector.
    pub fn packed_len(&self) -> usize {
        self.offsets().len
    }
}

/// Attention dropout given by a seed: the multiplier of entry `index` of the `(b, h, t, t)`
/// weights (row-major, `((bi h + hd) t + i) t + j`) is `1 / (1 - p)` when
/// [`dropout_bits`]`(seed, index)` is at or above `p · 2³²`, else 0. Any kernel can make any
/// tile of the mask on its own, which lets the fused attention drop weights without a `t × t`
/// tensor (as FlashAttention draws with Philox); the same entries as a tensor are
/// [`SeededDropout::mask`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SeededDropout {
    pub seed: u64,
    /// The probability of dropping a weight, in `(0, 1)`.
    pub p: f64,
}

/// 32 random bits for entry `index` of a mask seeded by `seed`: SplitMix64's output at the
/// state `seed + (index + 1) γ`, its upper half. Stateless, so entries can be drawn in any
/// order, by any thread; the CUDA kernels compute the same bits (`dropout_bits` in
/// `kernels.cu`).
pub fn dropout_bits(seed: u64, index: u64) -> u32 {
    const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut z = seed.wrapping_add(index.wrapping_add(1).wrapping_mul(GAMMA));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) >> 32) as u32
}

impl SeededDropout {
    /// Entries whose [`dropout_bits`] are below this are dropped: `⌊p · 2³²⌋`, as the host's
    /// dropout draws.
    pub fn threshold(&self) -> u64 {
        (self.p * 4_294_967_296.0) as u64
    }

    /// Whether entry `index` is kept.
    pub fn keeps(&self, index: u64) -> bool {
        u64::from(dropout_bits(self.seed, index)) >= self.threshold()
    }

    /// What a kept entry is multiplied by, as a mask of `dtype` stores it: `1 / (1 - p)` in
    /// f64, else rounded to f32 and then to `dtype` (as the host's dropout makes its masks).
    pub fn scale(&self, dtype: DType) -> Result<f64> {
        let scale = 1.0 / (1.0 - self.p);
        if dtype == DType::F64 {
            return Ok(scale);
        }
        Tensor::new(&[scale as f32], &candle::Device::Cpu)?
            .to_dtype(dtype)?
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()
            .map(|v| v[0])
    }

    /// The multipliers of a `(b, h, t, t)` mask of `dtype` on `device`.
    pub fn mask(
        &self,
        shape: &candle::Shape,
        dtype: DType,
        device: &candle::Device,
    ) -> Result<Tensor> {
        let n = shape.elem_count() as u64;
        let cpu = &candle::Device::Cpu;
        let mask = if dtype == DType::F64 {
            let scale = self.scale(dtype)?;
            let v: Vec<f64> = (0..n)
                .map(|i| if self.keeps(i) { scale } else { 0.0 })
                .collect();
            Tensor::from_vec(v, shape, cpu)?
        } else {
            let scale = (1.0 / (1.0 - self.p)) as f32;
            let v: Vec<f32> = (0..n)
                .map(|i| if self.keeps(i) { scale } else { 0.0 })
                .collect();
            Tensor::from_vec(v, shape, cpu)?.to_dtype(dtype)?
        };
        mask.to_device(device)
    }
}

/// A layer's attention dropout: multipliers drawn beforehand, or a seed the kernels draw from.
#[derive(Clone, Debug)]
pub enum AttentionDropout {
    /// `(b, h, t, t)` multipliers.
    Drawn(Tensor),
    Seeded(SeededDropout),
}

impl AttentionDropout {
    /// The multipliers as a tensor of `shape` `(b, h, t, t)`, `dtype` and `device` when made
    /// from the seed (a drawn mask is returned as it is).
    pub fn tensor(
        &self,
        shape: &candle::Shape,
        dtype: DType,
        device: &candle::Device,
    ) -> Result<Tensor> {
        match self {
            Self::Drawn(m) => Ok(m.clone()),
            Self::Seeded(s) => s.mask(shape, dtype, device),
        }
    }
}

/// Dropout multipliers of one layer's forward pass, each drawn beforehand in the order the
/// reference composition draws them.
#[derive(Clone, Default)]
pub struct LayerMasks {
    /// On the attention weights.
    pub attention: Option<AttentionDropout>,
    /// `(b, t, d)` on the attention branch
    pub attention_out: Option<Tensor>,
    /// `(b, t, d)` on the feed-forward branch
    pub ffn_out: Option<Tensor>,
}

/// The score of a padded key before the softmax: far enough below any real score that its
/// weight is exactly zero after `exp`, finite so that no `inf - inf` can appear.
pub const MASKED_SCORE: f64 = -1e9;

/// An additive bias on the attention scores, owned.
#[derive(Clone, Debug)]
pub enum LayerBias {
    /// `(r, h, t, t)`, added as it is; `r` is 1 (the same for every sequence) or `b`.
    Table(Tensor),
    /// `(2, b, h, t)`: two running sums `f` and `g` whose two-sided differences are the bias:
    /// `f[h, i] - f[h, j]` for keys `j <= i`, `g[h, j] - g[h, i]` after.
    SidedSums(Tensor),
    /// `(1, h, 2t - 1)`: a bias of the offset `j - i` alone, one value per head and offset
    /// `-(t - 1)..=t - 1` in order ([`offset_table`] is its table). The device path's fused
    /// attention reads it per tile and sums its gradient per offset; every other kernel is
    /// given its table.
    Offsets(Tensor),
}

impl LayerBias {
    /// The bias's tensor: the table, the running sums or the values by offset.
    pub fn tensor(&self) -> &Tensor {
        match self {
            Self::Table(t) | Self::SidedSums(t) | Self::Offsets(t) => t,
        }
    }

    /// The same bias with a bias of offsets given as its table, differentiably.
    pub fn without_offsets(&self) -> Result<Self> {
        Ok(match self {
            Self::Offsets(v) => Self::Table(offset_table(v)?),
            other => other.clone(),
        })
    }
}

/// The table of a bias of offsets: element `(k, head, i, j)` is `v[k, head, j - i + t - 1]`,
/// from `2t - 1` values per row and head.
///
/// Built by a skew (each row of `v` repeated `t` times, then read with a row stride one
/// shorter, starting `t - 1` in), so that its gradient is a sum along each diagonal made of
/// candle's parallel reductions. A gather's gradient is an `index_add` into the few values, which
/// candle's CUDA kernel runs with one thread per output column looping over every index: for
/// FIRE at width 768 and 512 tokens, one thread over 3.1 million (its cost: the book's
/// performance page, "Measurements behind the code's choices").
///
/// # Shapes
/// - `v`: `(r, h, 2t - 1)`, offsets `-(t - 1)..=t - 1` in order
/// - returns `(r, h, t, t)`
pub fn offset_table(v: &Tensor) -> Result<Tensor> {
    let (r, h, w) = v.dims3()?;
    if w % 2 == 0 {
        candle::bail!("a bias of offsets needs 2t - 1 values per head, not {w}");
    }
    let t = w.div_ceil(2);
    if t == 1 {
        return v.reshape((r, h, 1, 1));
    }
    // (r, h, t, w): every row the same w values, flat with row stride w.
    let rows = v
        .unsqueeze(2)?
        .broadcast_as((r, h, t, w))?
        .contiguous()?
        .reshape((r, h, t * w))?;
    // Read with row stride w - 1 from t - 1 in: element (i, c) is flat t - 1 + i (w - 1) + c,
    // which is row i, column t - 1 + c - i of `rows`, that is v[t - 1 + (c - i)].
    let skewed = rows
        .narrow(2, t - 1, t * (w - 1))?
        .reshape((r, h, t, w - 1))?;
    skewed.narrow(3, 0, t)?.contiguous()
}

/// A rotation of q and k: `(r, t, w)` cos and sin tables, and whether the pairing is
/// interleaved.
#[derive(Clone, Debug)]
pub struct RopeTables {
    /// `(r, t, w)`
    pub cos: Tensor,
    /// `(r, t, w)`
    pub sin: Tensor,
    /// `(x[2i], x[2i+1])` pairs, else `(x[i], x[i + w/2])`.
    pub interleaved: bool,
}

/// Scores of q and k in polar form: the phases' `(r, 1, t, d_head)` tables and the keys' phase
/// offsets `(h, d_head)`.
#[derive(Clone, Debug)]
pub struct PolarTables {
    /// `(r, 1, t, d_head)`
    pub cos: Tensor,
    /// `(r, 1, t, d_head)`
    pub sin: Tensor,
    /// `(h, d_head)`, differentiable.
    pub offsets: Tensor,
}

impl PolarTables {
    /// `(cos, sin)`.
    pub fn tables(&self) -> (&Tensor, &Tensor) {
        (&self.cos, &self.sin)
    }

    /// The keys' phase offsets.
    pub fn offsets(&self) -> &Tensor {
        &self.offsets
    }
}

/// Scores with gate-counted positions: the stacked tables `[E_left; E_right]`
/// `(2 npos, d_head)` and which keys are real `(b, t)`.
#[derive(Clone, Debug)]
pub struct CountTables {
    /// `(2 npos, d_head)`, differentiable.
    pub tables: Tensor,
    /// `(b, t)`, 1 for a real key (`None`: all real).
    pub mask: Option<Tensor>,
}

impl CountTables {
    /// The stacked tables.
    pub fn tables(&self) -> &Tensor {
        &self.tables
    }

    /// Which keys are real.
    pub fn mask(&self) -> Option<&Tensor> {
        self.mask.as_ref()
    }

    /// The positions each side counts to.
    pub fn npos(&self) -> usize {
        self.tables.dims().first().copied().unwrap_or(0) / 2
    }
}

/// Scores through a transport of reflections: `[w | β]` `(b, h, t, d_head + 1)`.
#[derive(Clone, Debug)]
pub struct Reflected {
    /// `(b, h, t, d_head + 1)`, differentiable.
    pub reflections: Tensor,
}

impl Reflected {
    /// `[w | β]`.
    pub fn reflections(&self) -> &Tensor {
        &self.reflections
    }
}

/// What a fused layer needs to make a transport's reflections from its attention input, their
/// weights travelling in the packed parameters: the short convolution's width, the norm's
/// epsilon and which tokens are real.
#[derive(Clone, Copy, Debug)]
pub struct ReflectionInputs<'a> {
    /// The width `K` of the short convolution (0: none).
    pub taps: usize,
    /// Inside the norm's root.
    pub eps: f64,
    /// `(b, t)`, 1 for a real token (`None`: all real).
    pub mask: Option<&'a Tensor>,
}

/// The additive attention bias of a key-padding mask.
///
/// # Shapes
/// - `mask`: `(b, t)`, 1 for a real token and 0 for padding (any numeric dtype)
/// - returns `(b, t)` in `dtype`: 0 for real keys, a large negative score for padded keys
pub fn key_padding_bias(mask: &Tensor, dtype: DType) -> Result<Tensor> {
    (mask.to_dtype(dtype)? - 1.0)? * -MASKED_SCORE
}

/// The channels `C` of each of `groups` groups of running sums in `width`, or an error naming
/// the mismatch.
pub fn group_channels(width: usize, groups: usize) -> Result<usize> {
    if groups == 0 || !width.is_multiple_of(groups) {
        candle::bail!("running sums: {width} channels do not split into {groups} groups");
    }
    Ok(width / groups)
}

/// Whether the device path stores activations of `dtype`.
pub fn device_path_supports(dtype: DType) -> bool {
    matches!(dtype, DType::F64 | DType::F32 | DType::BF16 | DType::F16)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Over a million entries at p = 0.1 and 0.5 the dropped share is within five standard
    /// errors of p, the kept entries' multiplier is `1 / (1 - p)` in the mask's dtype, and
    /// neighbouring entries (a row's next key, the next seed) are uncorrelated to the same
    /// bound; the same seed gives the same mask.
    #[test]
    fn a_seeded_dropout_drops_each_entry_with_probability_p_independently() {
        let n = 1usize << 20;
        for p in [0.1, 0.5] {
            let d = SeededDropout { seed: 42, p };
            let next = SeededDropout { seed: 43, p };
            let kept: Vec<bool> = (0..n as u64).map(|i| d.keeps(i)).collect();
            let dropped = kept.iter().filter(|k| !**k).count() as f64 / n as f64;
            let se = (p * (1.0 - p) / n as f64).sqrt();
            assert!((dropped - p).abs() < 5.0 * se, "p {p}: dropped {dropped}");
            // Both of two neighbours dropped: p² when independent.
            let both = kept.windows(2).filter(|w| !w[0] && !w[1]).count() as f64 / n as f64;
            let se2 = (p * p * (1.0 - p * p) / n as f64).sqrt();
            assert!((both - p * p).abs() < 5.0 * se2, "p {p}: neighbours {both}");
            let across = (0..n as u64)
                .filter(|i| !d.keeps(*i) && !next.keeps(*i))
                .count() as f64
                / n as f64;
            assert!((across - p * p).abs() < 5.0 * se2, "p {p}: seeds {across}");
            let shape: candle::Shape = (4, 2, 16, 16).into();
            for dtype in [DType::F64, DType::F32, DType::BF16, DType::F16] {
                let mask = d.mask(&shape, dtype, &candle::Device::Cpu).unwrap();
                let again = d.mask(&shape, dtype, &candle::Device::Cpu).unwrap();
                let v = mask.flatten_all().unwrap().to_dtype(DType::F64).unwrap();
                let v = v.to_vec1::<f64>().unwrap();
                let scale = d.scale(dtype).unwrap();
                assert!((scale - 1.0 / (1.0 - p)).abs() < 1e-2 * scale);
                for (i, m) in v.iter().enumerate() {
                    let want = if kept[i] { scale } else { 0.0 };
                    assert_eq!(*m, want, "entry {i} of {dtype:?}");
                }
                let diff = (mask.to_dtype(DType::F64).unwrap()
                    - again.to_dtype(DType::F64).unwrap())
                .unwrap();
                let max = diff.abs().unwrap().max_all().unwrap();
                assert_eq!(max.to_scalar::<f64>().unwrap(), 0.0);
            }
        }
    }

    /// The device path's mask kernel (its CPU twin) writes [`SeededDropout::mask`]'s values, bit
    /// for bit, in every dtype.
    #[cfg(feature = "fused")]
    #[test]
    fn the_mask_kernel_writes_the_seeded_masks_values() {
        use crate::gpu::{twin::Twin, Stream};
        let d = SeededDropout {
            seed: 0xDEAD_BEEF,
            p: 0.3,
        };
        let shape: candle::Shape = (3, 2, 33, 33).into();
        for dtype in [DType::F64, DType::F32, DType::BF16, DType::F16] {
            let want = d.mask(&shape, dtype, &candle::Device::Cpu).unwrap();
            let s = Twin;
            let n = shape.elem_count();
            let (buf, out) = (s.alloc(dtype, n).unwrap(), s.alloc(DType::F64, n).unwrap());
            s.dropout_mask(d, buf.mem()).unwrap();
            s.convert(buf.mem(), out.mem()).unwrap();
            let got = crate::gpu::host::load::<f64, f64>(out.mem(), 0..n);
            let want = want.flatten_all().unwrap().to_dtype(DType::F64).unwrap();
            assert_eq!(got, want.to_vec1::<f64>().unwrap(), "{dtype:?}");
        }
    }
}
