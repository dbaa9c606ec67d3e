//! The encoder layer as a sequence of device operations: the CUDA path, and its CPU twin.
//!
//! On the CPU each encoder layer is one autograd node ([`super::cpu`]). This module gives
//! CUDA the same design: the layer's forward and backward ([`layer`]) are written once, as a
//! sequence of operations on a [`Stream`], each of which is one CUDA kernel launch or one cuBLAS
//! call on a GPU. Two streams implement them:
//!
//! - [`twin::Twin`], on the CPU: every operation computed by plain loops (and gemm for the
//!   matrix products), value for value what the CUDA kernel computes, in the same precision.
//!   The tests run the layer through it and hold it to the reference compositions and to the
//!   fused CPU layer, forward and backward, so the sequence of operations (the wiring, the
//!   layouts, the transposes folded into each product) is checked on every machine.
//! - `cuda::CudaStream` (with the `cuda` feature): cuBLAS strided-batched products for every
//!   matrix product, and poslab's own kernels (`kernels.cu`, compiled by NVRTC the first time a
//!   process needs them) for the rest.
//!
//! # Values
//! Activations are stored in the layer's dtype (f64, f32, bf16 or f16) and computed in f64 for
//! f64, else in f32: LayerNorm statistics, softmax sums and the activation's derivative are
//! f32 under half precision, as candle's and PyTorch's mixed precision do. Matrix products sum
//! in f32 from half inputs (tensor cores' accumulation).
//!
//! # Counting
//! Every operation is counted on the thread that issues it ([`counts`]), by kind: kernels,
//! matrix products and copies; every buffer a stream allocates is counted while it lives
//! ([`live_bytes`], [`peak_bytes`]). `poslab bench --launches` reads both.

#![allow(clippy::too_many_arguments)]

pub mod flash;
pub mod head;
pub mod host;
pub mod layer;
pub mod lookup;
pub mod norm;
pub mod twin;

#[cfg(feature = "cuda")]
pub mod cuda;

use std::cell::Cell;

use candle::{CpuStorage, DType, Result};

pub(crate) use crate::spec::Window;

pub use super::spec::Act;

/// A span of device memory: where it starts, how many values of which dtype it holds.
///
/// On the CPU `addr` is a host address, on CUDA a device pointer. A `Mem` borrows: the buffer
/// it points into ([`Buf`], or a candle storage) must outlive every operation given it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mem {
    pub addr: u64,
    pub len: usize,
    pub dtype: DType,
}

impl Mem {
    /// `len` values from `offset`, checked against this span.
    pub fn at(self, offset: usize, len: usize) -> Result<Mem> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(Mem {
                addr: self.addr + (offset * self.dtype.size_in_bytes()) as u64,
                len,
                dtype: self.dtype,
            }),
            _ => candle::bail!(
                "device path: {len} values at {offset} of a buffer of {}",
                self.len
            ),
        }
    }

    /// Checks that this span holds at least `len` values of `dtype`.
    pub fn holds(self, len: usize, dtype: DType, what: &str) -> Result<()> {
        if self.len < len || self.dtype != dtype {
            candle::bail!(
                "device path: {what} holds {} values of {:?}, {len} of {dtype:?} needed",
                self.len,
                self.dtype
            )
        }
        Ok(())
    }
}

/// Memory a stream allocated: freed (and uncounted) when dropped.
pub struct Buf {
    mem: Mem,
    owner: Owner,
}

pub enum Owner {
    Cpu(CpuStorage),
    #[cfg(feature = "cuda")]
    Cuda(candle::CudaStorage),
}

impl Buf {
    pub fn new(mem: Mem, owner: Owner) -> Self {
        let bytes = mem.len * mem.dtype.size_in_bytes();
        MEMORY.with(|m| {
            let live = m.live.get() + bytes;
            m.live.set(live);
            m.peak.set(m.peak.get().max(live));
        });
        Self { mem, owner }
    }

    /// All of it.
    pub fn mem(&self) -> Mem {
        self.mem
    }

    /// `len` values from `offset`.
    pub fn at(&self, offset: usize, len: usize) -> Result<Mem> {
        self.mem.at(offset, len)
    }

    /// The storage, handed to candle as a CPU storage (the twin's).
    pub fn into_cpu_storage(self) -> Result<CpuStorage> {
        match self.into_owner() {
            Owner::Cpu(s) => Ok(s),
            #[allow(unreachable_patterns)]
            _ => candle::bail!("device path: a CUDA buffer where the twin computes"),
        }
    }

    /// The storage, handed to candle as a CUDA storage.
    #[cfg(feature = "cuda")]
    pub fn into_cuda_storage(self) -> Result<candle::CudaStorage> {
        match self.into_owner() {
            Owner::Cuda(s) => Ok(s),
            Owner::Cpu(_) => candle::bail!("device path: a CPU buffer where CUDA computes"),
        }
    }

    /// The storage, handed to candle (and no longer counted as the device path's).
    pub fn into_owner(mut self) -> Owner {
        let owner = std::mem::replace(&mut self.owner, Owner::Cpu(CpuStorage::U8(Vec::new())));
        drop(self);
        owner
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        let bytes = self.mem.len * self.mem.dtype.size_in_bytes();
        MEMORY.with(|m| m.live.set(m.live.get().saturating_sub(bytes)));
    }
}

/// What a row-major matrix operand is: its memory, whether it is stored transposed, its leading
/// dimension (the distance between stored rows) and the distance between batch entries.
#[derive(Clone, Copy, Debug)]
pub struct Mat {
    pub mem: Mem,
    /// Stored as the transpose: element `(i, p)` of the operand is at `p * ld + i`.
    pub trans: bool,
    pub ld: usize,
    pub stride: usize,
}

impl Mat {
    /// Rows of `ld` values, as stored.
    pub fn rows(mem: Mem, ld: usize) -> Self {
        Self {
            mem,
            trans: false,
            ld,
            stride: 0,
        }
    }

    /// The transpose of a matrix stored in rows of `ld`.
    pub fn t(mem: Mem, ld: usize) -> Self {
        Self {
            trans: true,
            ..Self::rows(mem, ld)
        }
    }

    /// Batch entries `stride` values apart.
    pub fn every(self, stride: usize) -> Self {
        Self { stride, ..self }
    }
}

/// `C[i] (m x n) = alpha · A[i] (m x k) · B[i] (k x n) + beta · C[i]` for `i < batch`, every
/// matrix row-major ([`Mat`]); `beta` is 0 (C is overwritten, whatever it held) or 1.
#[derive(Clone, Copy, Debug)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub batch: usize,
    pub a: Mat,
    pub b: Mat,
    pub c: Mat,
    pub alpha: f64,
    pub beta: f64,
}

impl Gemm {
    /// `c = alpha · a b` for one matrix.
    pub fn one(m: usize, n: usize, k: usize, a: Mat, b: Mat, c: Mat) -> Self {
        Self {
            m,
            n,
            k,
            batch: 1,
            a,
            b,
            c,
            alpha: 1.0,
            beta: 0.0,
        }
    }

    /// Adds into `c` instead of overwriting it.
    pub fn accumulate(self) -> Self {
        Self { beta: 1.0, ..self }
    }

    /// Checks that every operand holds what the product reads or writes, in one dtype.
    pub fn check(&self) -> Result<()> {
        let span = |x: &Mat, rows: usize, cols: usize| {
            // the last batch entry's last stored row, and its width
            let (stored_rows, width) = if x.trans { (cols, rows) } else { (rows, cols) };
            if stored_rows == 0 || width == 0 || self.batch == 0 {
                return 0;
            }
            (self.batch - 1) * x.stride + (stored_rows - 1) * x.ld + width
        };
        let dtype = self.c.mem.dtype;
        for (x, rows, cols, what) in [
            (&self.a, self.m, self.k, "gemm's left operand"),
            (&self.b, self.k, self.n, "gemm's right operand"),
            (&self.c, self.m, self.n, "gemm's output"),
        ] {
            x.mem.holds(span(x, rows, cols), dtype, what)?;
            let width = if x.trans { rows } else { cols };
            if x.ld < width {
                candle::bail!("device path: {what}'s rows of {} hold {width}", x.ld)
            }
        }
        if self.c.trans {
            candle::bail!("device path: gemm writes its output in rows")
        }
        if self.beta != 0.0 && self.beta != 1.0 {
            candle::bail!("device path: gemm's beta is 0 or 1, not {}", self.beta)
        }
        Ok(())
    }
}

/// RoPE's tables for [`Stream::heads_in`] and [`Stream::heads_back`]: `cos` and `sin`
/// `(rows, t, width)` in the compute dtype, laid out by the pairing (see
/// the core's `nn::Rotary`), `rows` 1 (shared by the batch) or `b`.
#[derive(Clone, Copy, Debug)]
pub struct Rope {
    pub cos: Mem,
    pub sin: Mem,
    pub rows: usize,
    pub width: usize,
    pub interleaved: bool,
}

/// Why a softmax or its backward refuses [`ScoreBias::Offsets`].
pub(crate) const OFFSETS_UNFUSED: &str = "device path: a bias by offset is read by the fused \
     attention alone; the softmax path is given its table (LayerBias::without_offsets)";

/// What [`Stream::sum_squares`] reads back.
#[derive(Clone, Debug, PartialEq)]
pub struct Squares {
    /// Each part's sum of squares.
    pub sums: Vec<f64>,
    /// The value read with them, as f64.
    pub with: Option<f64>,
}

/// The score bias a softmax adds.
#[derive(Clone, Copy, Debug)]
pub enum ScoreBias {
    None,
    /// A `(rows, h, t, t)` table in the compute dtype, `rows` 1 or `b`.
    Table {
        bias: Mem,
        rows: usize,
    },
    /// Running sums `(2, b, h, t)` in the compute dtype: `f[i] - f[j]` for `j <= i`, `g[j] - g[i]`
    /// for `j > i` (the core's `nn::AttentionBias::SidedSums`).
    Sided {
        sums: Mem,
    },
    /// `(h, 2t - 1)` in the compute dtype, by offset `j - i + t - 1` (the core's
    /// `LayerBias::Offsets`): read by the fused attention alone ([`Stream::fuses_attention`]).
    Offsets {
        values: Mem,
    },
}

/// The shapes of an attention: batch, tokens, heads, head width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heads {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub dh: usize,
}

impl Heads {
    pub fn d(&self) -> usize {
        self.h * self.dh
    }
    pub fn n(&self) -> usize {
        self.b * self.t
    }
    /// Values of one of q, k, v: `b h t dh`.
    pub fn one(&self) -> usize {
        self.n() * self.d()
    }
    /// Values of the scores of every head: `b h t t`.
    pub fn scores(&self) -> usize {
        self.b * self.h * self.t * self.t
    }
}

/// A softmax over the scores of every head, in place: `P = softmax(S + bias + window +
/// key_bias)` row by row; with a dropout mask, also `PM = P ⊙ M`.
#[derive(Clone, Copy, Debug)]
pub struct Softmax {
    pub heads: Heads,
    /// `(b h t, t)` scores in, weights out
    pub sp: Mem,
    /// `(b, t)` in the compute dtype: 0 for real keys, a large negative score for padding
    pub key_bias: Mem,
    pub bias: ScoreBias,
    /// Keys outside each query's window get the masked score.
    pub window: Window,
    /// The dropout multipliers `(b, h, t, t)` and where `P ⊙ M` goes.
    pub dropout: Option<(Mem, Mem)>,
}

/// LayerNorm's forward of `rows` rows of `width`: `y = (x - mean) rstd w + b`, and the rows'
/// `[mean, rstd]` (compute dtype, `2 rows`).
#[derive(Clone, Copy, Debug)]
pub struct Norm {
    pub w: Mem,
    pub b: Mem,
    pub eps: f64,
    pub out: Mem,
    pub stats: Mem,
}

/// `sum = res + m ⊙ (z + bias)` by rows (bias per column), then a LayerNorm of `sum` if asked.
#[derive(Clone, Copy, Debug)]
pub struct Residual {
    pub rows: usize,
    pub width: usize,
    pub res: Mem,
    pub z: Mem,
    pub bias: Mem,
    pub mask: Option<Mem>,
    pub sum: Mem,
    pub norm: Option<Norm>,
}

/// LayerNorm's backward by rows: `out = add + dx` (`add` optional, and `out` may be `add`),
/// `masked = out ⊙ mask` when a mask is given, and `[g ⊙ x̂, g]` per row into `params`
/// `(rows, 2 width)`, whose column sums are the weight's and the bias's gradients.
#[derive(Clone, Copy, Debug)]
pub struct NormBack {
    pub rows: usize,
    pub width: usize,
    pub x: Mem,
    pub stats: Mem,
    pub w: Mem,
    pub g: Mem,
    pub add: Option<Mem>,
    pub out: Mem,
    pub mask: Option<(Mem, Mem)>,
    pub params: Mem,
}

/// One variable of [`Stream::adamw`]: its weights, gradient and moments `[m; v]` (each of the
/// variable's dtype, f32 or f64), what its weights are multiplied by first (`1 - lr wd` where
/// decayed, else 1), and the bound its updated weights are then held above, if any.
#[derive(Clone, Copy, Debug)]
pub struct AdamWPart {
    pub w: Mem,
    pub g: Mem,
    pub mv: Mem,
    pub decay_factor: f64,
    /// Applied as candle's `clamp(lower, f64::MAX)` in the weights' dtype: a weight below it
    /// becomes it, one above `f64::MAX` in that dtype becomes that, and NaN stays NaN.
    pub lower: Option<f64>,
}

/// What every variable's update in one AdamW step shares.
#[derive(Clone, Copy, Debug)]
pub struct AdamWStep {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// `1 - beta^step` of each moment.
    pub bias1: f64,
    pub bias2: f64,
    pub lr: f64,
    /// Every gradient is multiplied by this first (clipping).
    pub grad_scale: f64,
}

/// The rows of a cross-entropy: `(rows, classes)` logits in the storage dtype, each row's
/// target class (u32) and, when given, its weight (f32; every row weighs 1 without them), and
/// each row's log-sum-exp `(rows)` in the compute dtype.
#[derive(Clone, Copy, Debug)]
pub struct Xent {
    pub logits: Mem,
    pub rows: usize,
    pub classes: usize,
    pub targets: Mem,
    pub weights: Option<Mem>,
    pub lse: Mem,
}

impl Xent {
    /// Checks every span the kernels read or write, for logits of `dtype`.
    pub fn check(&self, dtype: DType) -> Result<()> {
        self.logits
            .holds(self.rows * self.classes, dtype, "the logits")?;
        self.targets.holds(self.rows, DType::U32, "the targets")?;
        if let Some(w) = self.weights {
            w.holds(self.rows, DType::F32, "the targets' weights")?;
        }
        self.lse
            .holds(self.rows, compute_dtype(dtype), "the rows' log-sum-exp")
    }
}

/// Values of one variable a block of the multi-tensor AdamW updates.
pub const ADAMW_CHUNK: usize = 1 << 16;

/// The device operations the layer is made of. Each is one kernel launch or one cuBLAS call on
/// a GPU; all are asynchronous there, ordered on one stream.
pub trait Stream {
    /// Uninitialised memory for `len` values of `dtype` (the twin fills it with NaN, so that
    /// reading a value never written shows).
    fn alloc(&self, dtype: DType, len: usize) -> Result<Buf>;
    /// A matrix product ([`Gemm`]).
    fn gemm(&self, g: &Gemm) -> Result<()>;
    /// `out[i] = value`.
    fn fill(&self, out: Mem, value: f64) -> Result<()>;
    /// `out = x ⊙ m`, elementwise (`out` may be `x`).
    fn mul(&self, x: Mem, m: Mem, out: Mem) -> Result<()>;
    /// The multipliers of a seeded dropout's entries `0..out.len` ([`crate::spec::SeededDropout::mask`]'s
    /// values) into `out`.
    fn dropout_mask(&self, d: crate::spec::SeededDropout, out: Mem) -> Result<()>;
    /// `out = x`, converted to `out`'s dtype.
    fn convert(&self, x: Mem, out: Mem) -> Result<()>;
    /// LayerNorm's forward over `rows` rows of `width` ([`Norm`]).
    fn layer_norm(&self, x: Mem, rows: usize, width: usize, norm: &Norm) -> Result<()>;
    /// [`Residual`].
    fn residual(&self, r: &Residual) -> Result<()>;
    /// [`NormBack`].
    fn norm_back(&self, n: &NormBack) -> Result<()>;
    /// `act(u + bias)` in place over `rows` rows of `width`, and its derivative into `grad`.
    fn bias_act(
        &self,
        u: Mem,
        bias: Mem,
        grad: Mem,
        rows: usize,
        width: usize,
        act: Act,
    ) -> Result<()>;
    /// The projections `(n, 3d)` (`[q | k | v]` by token) plus their bias, into heads
    /// `(3, b, h, t, dh)`, q and k rotated by `rope`.
    fn heads_in(
        &self,
        qkv: Mem,
        bias: Mem,
        rope: Option<&Rope>,
        heads: Heads,
        out: Mem,
    ) -> Result<()>;
    /// The gradient of [`Stream::heads_in`]: heads' gradients `(3, b, h, t, dh)` back to
    /// `(n, 3d)`, q's and k's rotated back.
    fn heads_back(&self, g: Mem, rope: Option<&Rope>, heads: Heads, out: Mem) -> Result<()>;
    /// `(a, b, c, d)` to `(a, c, b, d)`.
    fn transpose12(&self, x: Mem, dims: [usize; 4], out: Mem) -> Result<()>;
    /// [`Softmax`].
    fn softmax(&self, s: &Softmax) -> Result<()>;
    /// Whether this stream has the fused attention ([`Stream::flash`]).
    fn fuses_attention(&self) -> bool {
        false
    }
    /// The fused attention's forward ([`flash::Flash`]): its output into `out`, the heads side
    /// by side `(b, t, h dh)` (the layer's `c`, with no transpose), and the rows' statistics
    /// `(2, b, h, t)` (compute dtype) into `lse`, without the scores.
    fn flash(&self, f: &flash::Flash, out: Mem, lse: Mem) -> Result<()> {
        let _ = (f, out, lse);
        candle::bail!("device path: this stream has no fused attention")
    }
    /// The fused attention's backward from the forward's `out` and statistics and the output's
    /// gradient `dout`: [`flash::FlashGrads`].
    fn flash_back(
        &self,
        f: &flash::Flash,
        out: Mem,
        lse: Mem,
        dout: Mem,
        g: &flash::FlashGrads,
    ) -> Result<()> {
        let _ = (f, out, lse, dout, g);
        candle::bail!("device path: this stream has no fused attention")
    }
    /// `dS = P ⊙ (dP' - rowsum(dP' ⊙ P))` in place of `dp` `(rows, t)`, `dP' = dP ⊙ M` with a
    /// dropout mask.
    fn softmax_back(&self, p: Mem, dp: Mem, mask: Option<Mem>, rows: usize, t: usize)
        -> Result<()>;
    /// The running sums' gradient `(2, b, h, t)` (storage dtype) from `dS` `(b h, t, t)`:
    /// `df[i] = Σ_{j<=i} dS[i,j] - Σ_{i'>=i} dS[i',i]`, `dg[j] = Σ_{i<j} dS[i,j] - Σ_{j'>j}
    /// dS[j,j']`.
    fn sided_back(&self, ds: Mem, heads: Heads, out: Mem) -> Result<()>;
    /// FoX's forget gates: `[f; g]`, the running sums along the tokens of `log σ(z + bias)`,
    /// `z` `(b, t, 2h)` (forward gates' channels, then backward ones'), into `sums`
    /// `(2, b, h, t)` (compute dtype): `sums[s, b, c, i] = Σ_{j <= i} log σ(z[b, j, s h + c] +
    /// bias[s h + c])`.
    fn gates(&self, z: Mem, bias: Mem, heads: Heads, sums: Mem) -> Result<()>;
    /// The gates' backward: `dz[b, j, ch] = σ(-(z + bias)) Σ_{i >= j} dsums[s, b, c, i]`, `dsums`
    /// `(2, b, h, t)` and `dz` `(b, t, 2h)` in the storage dtype.
    fn gates_back(&self, z: Mem, bias: Mem, dsums: Mem, heads: Heads, dz: Mem) -> Result<()>;
    /// AdamW's update of every variable of `parts` at once, in place (one launch, after one
    /// copy of the variables' addresses to the device): per value, in this order,
    /// `g' = s g`, `m = β1 m + (1 - β1) g'`, `v = β2 v + (1 - β2) g'²`,
    /// `w = w k - lr (m / bias1) / (sqrt(v / bias2) + eps)`, `k` the part's decay factor.
    fn adamw(&self, parts: &[AdamWPart], step: &AdamWStep) -> Result<()>;
    /// The sum of the squares of each of `parts` (of one dtype, f32 or f64), in f64, read back
    /// to the host with the value `with` holds (one value of any dtype: the loss), in the same
    /// copy: one copy of the parts' addresses to the device, one launch (and one conversion of
    /// `with`), and one copy back, which waits for the work queued before it: a training step's
    /// one read. Each part is summed by chunks of [`ADAMW_CHUNK`] values, each chunk in a fixed
    /// order on the device, and the chunks in order on the host.
    fn sum_squares(&self, parts: &[Mem], with: Option<Mem>) -> Result<Squares>;
    /// The mean over each sequence's real tokens: `x` `(b, t, d)` and the mask `(b, t)` (u32, 1
    /// for a real token) to `out` `(b, d)`, each value summed over the tokens in order and
    /// divided by the sequence's count; with `back`, the gradient instead: `x` `(b, d)` to `out`
    /// `(b, t, d)`, `out[s, j] = mask[s, j] x[s] / count[s]`.
    fn pool_mean(
        &self,
        x: Mem,
        mask: Mem,
        dims: (usize, usize, usize),
        out: Mem,
        back: bool,
    ) -> Result<()>;
    /// The cross-entropy's rows ([`Xent`]), one block a row: `logits += bias` (stored), each
    /// row's log-sum-exp, and `nll[r] = lse[r] - logits[r, target[r]]` (NaN for a target that
    /// is not a class).
    fn xent(&self, x: &Xent, bias: Mem, nll: Mem) -> Result<()>;
    /// `out[0] = scale Σ_r w[r] x[r]` (`w` f32, all 1 when absent), in one block.
    fn weighted_sum(&self, x: Mem, w: Option<Mem>, scale: f64, out: Mem) -> Result<()>;
    /// The cross-entropy's backward in place of the logits:
    /// `logits[r, j] = g[0] scale w[r] (exp(logits[r, j] - lse[r]) - [j = target[r]])`, `g` the
    /// loss's gradient (one value on the device, read there).
    fn xent_back(&self, x: &Xent, g: Mem, scale: f64) -> Result<()>;
    /// The token embedding's gradient `out` `(vocab, d)` from its lookup's gradient `g`
    /// `(n, d)` and the ids `(n)` (u32): each row the sum, in the compute dtype and in token
    /// order, of the rows of `g` whose id it is; zeros for an id no token has. No atomics (the
    /// same bits every launch), and every token's row read by one block of columns, where
    /// candle's `index_add` gives each column one thread that walks every token.
    fn embedding_back(&self, ids: Mem, g: Mem, out: Mem, vocab: usize, d: usize) -> Result<()>;
}

/// Column sums of `x` `(rows, width)` into `into`, as a product with a row of `ones`.
pub fn colsum(
    s: &dyn Stream,
    ones: Mem,
    x: Mem,
    rows: usize,
    width: usize,
    into: Mem,
) -> Result<()> {
    s.gemm(&Gemm::one(
        1,
        width,
        rows,
        Mat::rows(ones, rows),
        Mat::rows(x, width),
        Mat::rows(into, width),
    ))
}

/// Device operations issued on this thread, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Kernel launches (poslab's kernels).
    pub kernels: usize,
    /// cuBLAS calls.
    pub gemms: usize,
    /// Copies and conversions between buffers (kernels too, counted apart).
    pub copies: usize,
}

impl Counts {
    /// Everything a GPU is asked to launch.
    pub fn launches(&self) -> usize {
        self.kernels + self.gemms + self.copies
    }
}

impl std::ops::Sub for Counts {
    type Output = Counts;
    fn sub(self, o: Counts) -> Counts {
        Counts {
            kernels: self.kernels - o.kernels,
            gemms: self.gemms - o.gemms,
            copies: self.copies - o.copies,
        }
    }
}

struct Memory {
    live: Cell<usize>,
    peak: Cell<usize>,
}

thread_local! {
    static COUNTS: Cell<Counts> = const { Cell::new(Counts { kernels: 0, gemms: 0, copies: 0 }) };
    static MEMORY: Memory = const { Memory { live: Cell::new(0), peak: Cell::new(0) } };
}

/// What the streams counted on this thread so far.
pub fn counts() -> Counts {
    COUNTS.with(Cell::get)
}

/// Bytes the streams' buffers hold now, on this thread.
pub fn live_bytes() -> usize {
    MEMORY.with(|m| m.live.get())
}

/// The most bytes the streams' buffers held at once on this thread since
/// [`reset_peak_bytes`].
pub fn peak_bytes() -> usize {
    MEMORY.with(|m| m.peak.get())
}

/// Starts [`peak_bytes`] again from what lives now.
pub fn reset_peak_bytes() {
    MEMORY.with(|m| m.peak.set(m.live.get()));
}

/// Counts one operation of `kind`.
pub fn count(kind: Kind) {
    COUNTS.with(|c| {
        let mut v = c.get();
        match kind {
            Kind::Kernel => v.kernels += 1,
            Kind::Gemm => v.gemms += 1,
            Kind::Copy => v.copies += 1,
        }
        c.set(v);
    });
}

/// The kinds of [`Counts`].
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    Kernel,
    Gemm,
    Copy,
}

/// The dtype values of `dtype` are computed in: f64 for f64, else f32.
pub fn compute_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

pub use super::spec::device_path_supports as supports;

/// The memory of a contiguous tensor's storage, CPU (the twin's) or CUDA.
pub fn storage_mem(storage: &candle::Storage, layout: &candle::Layout) -> Result<Mem> {
    match storage {
        candle::Storage::Cpu(s) => twin::Twin::mem(s, layout),
        #[cfg(feature = "cuda")]
        candle::Storage::Cuda(s) => cuda::mem(s, layout),
        #[allow(unreachable_patterns)]
        _ => candle::bail!("device path: tensors on the CPU or CUDA only"),
    }
}

/// The body of a device-path candle op on three CPU storages (the twin's): `run` given the twin
/// and the storages' memory, its buffer handed back to candle with its length.
pub fn on_twin(
    inputs: [(&CpuStorage, &candle::Layout); 3],
    run: impl FnOnce(&dyn Stream, [Mem; 3]) -> Result<Buf>,
) -> Result<(CpuStorage, usize)> {
    let [a, b, c] = inputs.map(|(s, l)| twin::Twin::mem(s, l));
    let out = run(&twin::Twin, [a?, b?, c?])?;
    let len = out.mem().len;
    Ok((out.into_cpu_storage()?, len))
}

/// [`on_twin`] on three CUDA storages, on the first one's device.
#[cfg(feature = "cuda")]
pub fn on_cuda(
    inputs: [(&candle::CudaStorage, &candle::Layout); 3],
    run: impl FnOnce(&dyn Stream, [Mem; 3]) -> Result<Buf>,
) -> Result<(candle::CudaStorage, usize)> {
    use candle::backend::BackendStorage;
    let stream = cuda::CudaStream::new(inputs[0].0.device());
    let [a, b, c] = inputs.map(|(s, l)| cuda::mem(s, l));
    let out = run(&stream, [a?, b?, c?])?;
    let len = out.mem().len;
    Ok((out.into_cuda_storage()?, len))
}

/// The stream of `device`: the CPU twin, or CUDA's.
pub fn stream_for(device: &candle::Device) -> Result<Box<dyn Stream>> {
    match device {
        candle::Device::Cpu => Ok(Box::new(twin::Twin)),
        #[cfg(feature = "cuda")]
        candle::Device::Cuda(d) => Ok(Box::new(cuda::CudaStream::new(d))),
        #[allow(unreachable_patterns)]
        _ => candle::bail!("device path: the CPU or CUDA only"),
    }
}

/// Runs `f` with the memory of each of `tensors` (contiguous, of distinct storages), every one
/// held for writing (candle's write lock on its storage) until `f` returns: how an update in
/// place of many tensors at once (AdamW's) gets their memory soundly.
pub fn with_writable<R>(
    tensors: &[&candle::Tensor],
    f: impl FnOnce(&[Mem]) -> Result<R>,
) -> Result<R> {
    let mut ids: Vec<_> = tensors.iter().map(|t| t.id()).collect();
    ids.sort_unstable_by_key(|id| format!("{id:?}"));
    ids.dedup();
    if ids.len() != tensors.len() {
        candle::bail!("device path: a tensor updated in place is listed twice");
    }
    let mut f = Some(f);
    let mut out = None;
    let mut run = |mems: &[Mem]| -> Result<()> {
        if let Some(f) = f.take() {
            out = Some(f(mems)?);
        }
        Ok(())
    };
    nest(tensors, &mut Vec::with_capacity(tensors.len()), &mut run)?;
    out.ok_or_else(|| candle::Error::Msg("device path: the update never ran".into()))
}

/// Takes the write lock of the first tensor, then (inside it) of the rest, then calls `f`.
fn nest(
    tensors: &[&candle::Tensor],
    mems: &mut Vec<Mem>,
    f: &mut dyn FnMut(&[Mem]) -> Result<()>,
) -> Result<()> {
    match tensors.split_first() {
        None => f(mems),
        Some((t, rest)) => t.inplace_op1(&Nested {
            rest,
            state: std::cell::RefCell::new((mems, f)),
        }),
    }
}

type NestState<'a, 'b> = (
    &'a mut Vec<Mem>,
    &'a mut (dyn FnMut(&[Mem]) -> Result<()> + 'b),
);

struct Nested<'a, 'b> {
    rest: &'a [&'a candle::Tensor],
    state: std::cell::RefCell<NestState<'a, 'b>>,
}

impl Nested<'_, '_> {
    fn go(&self, mem: Mem) -> Result<()> {
        let mut state = self.state.borrow_mut();
        let (mems, f) = &mut *state;
        mems.push(mem);
        nest(self.rest, mems, &mut **f)
    }
}

impl candle::InplaceOp1 for Nested<'_, '_> {
    fn name(&self) -> &'static str {
        "poslab-device-writable"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &candle::Layout) -> Result<()> {
        // The address comes from the mutable borrow, which lasts until `go` returns.
        let mem = match s {
            CpuStorage::F64(v) => {
                twin::Twin::mem_mut(v.as_mut_ptr() as u64, v.len(), DType::F64, l)?
            }
            CpuStorage::F32(v) => {
                twin::Twin::mem_mut(v.as_mut_ptr() as u64, v.len(), DType::F32, l)?
            }
            _ => candle::bail!("device path: an update in place of f32 or f64 tensors only"),
        };
        self.go(mem)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &mut candle::CudaStorage, l: &candle::Layout) -> Result<()> {
        self.go(cuda::mem(s, l)?)
    }
}

/// A tensor's memory, and the read guard on its storage that keeps it valid.
pub struct Held<'a>(candle::StorageRef<'a>, &'a candle::Layout);

impl<'a> Held<'a> {
    pub fn of(t: &'a candle::Tensor) -> Self {
        let (guard, layout) = t.storage_and_layout();
        Self(guard, layout)
    }

    pub fn mem(&self) -> Result<Mem> {
        storage_mem(&self.0, self.1)
    }
}
