//! Layers of the encoder, each a small struct built from a `VarBuilder`.
//!
//! Everything here is differentiable on every device: in candle-nn 0.11 the fused
//! `ops::softmax_last_dim`, `ops::layer_norm` (and so `candle_nn::LayerNorm` on contiguous
//! input) and `rope`/`rope_i` have no backward pass, and every variable upstream of them would
//! silently stop learning. On the CPU (f32, f64) poslab runs its own kernels with hand-written
//! backward passes (`fused`): by default each encoder layer is one autograd node, and the
//! pieces outside the layers (linear heads, final LayerNorm) are fused ops; elsewhere, and under
//! [`with_reference_ops`], everything is a composition of differentiable tensor ops. See
//! [`Kernels`]. The tests hold every path to the reference, forward and backward.

mod attention;
mod counts;
mod cuda_ops;
pub(crate) mod device;
mod dropout;
mod feed_forward;
mod fused;
mod layer_norm;
mod ops;
mod polar;
mod rotary;
mod transport;

pub use attention::{
    key_padding_bias, window_bias, AttentionBias, AttentionInputs, ForgetGates, LayerBias,
    QkScores, SelfAttention,
};
pub use counts::{CountParts, GateCounts};
pub use dropout::{Dropout, SharedRng};
pub use feed_forward::{Activation, FeedForward};
pub(crate) use fused::{adamw_step, encoder_layer, LayerMasks, LayerShape, TransportShape};
pub use fused::{
    head_product_gflops, linear_pass_gflops, matmul_gflops, simd_dispatches, HeadProduct,
    LinearPass, SimdLevel,
};
pub use layer_norm::{layer_norm, layer_norm_no_bias, layer_norm_with_bias, LayerNorm};
pub use ops::{
    gelu, linear, linear_no_bias, linear_with_bias, log_sigmoid, log_softmax_last_dim,
    masked_softmax, rope_rotate, running_sums, sided_differences, softmax_last_dim, Linear,
};
pub use polar::Polar;
pub use rotary::Rotary;
pub use transport::{
    transport_inverse, transport_scores, InputReflections, Projections, Transport,
};

/// What the device path ([`Kernels::Layer`] on CUDA) issued and allocated on this thread:
/// see `poslab bench --launches`.
pub mod device_path {
    #[cfg(feature = "cuda")]
    pub use super::device::cuda::compile_check as compile_kernels;
    pub use super::device::{counts, live_bytes, peak_bytes, reset_peak_bytes, Counts};
}

use std::cell::Cell;

use candle::{DType, Tensor};

/// The score given to a padded key before the softmax: far enough below any real score that its
/// weight is exactly zero after `exp`, finite so that no `inf - inf` can appear.
pub(crate) const MASKED_SCORE: f64 = -1e9;

/// The CPU cores this process may use (at least one): what the thread counts left to poslab
/// share out.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Runs `f` on a rayon pool of `threads` threads of its own (at least one), the calling thread
/// waiting for it. The fused kernels and gemm split their work over the pool `f` runs on: on a
/// pool of its own with one thread they run inline, where from a thread outside any pool each
/// op would be handed to the process-wide pool and waited for (which several jobs at once
/// share, one op at a time). The kernels' results do not depend on the thread count, so
/// neither do `f`'s. If the pool cannot be built, `f` runs here.
pub fn with_threads<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    match rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .thread_name(|i| format!("poslab-compute-{i}"))
        .build()
    {
        Ok(pool) => pool.install(f),
        Err(_) => f(),
    }
}

/// Which implementation the layers compute with. On the CPU (f32 and f64) all three; on CUDA,
/// `ops` and `layer` both mean one candle kernel per softmax, LayerNorm, GELU and RoPE rotation
/// with poslab's backward passes (`cuda_ops.rs`), and `reference` the compositions; elsewhere
/// (the CPU in half precision) always [`Kernels::Reference`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Kernels {
    /// Compositions of differentiable candle tensor ops: the specification the others are
    /// tested against.
    Reference,
    /// Fused per-op kernels with hand-written backward passes: linear, LayerNorm, masked
    /// softmax, GELU, RoPE, and the attention core from packed QKV.
    Ops,
    /// Each encoder layer as one node with a hand-written backward (the default).
    #[default]
    Layer,
}

impl Kernels {
    /// Every choice, the specification first.
    pub const ALL: [Kernels; 3] = [Kernels::Reference, Kernels::Ops, Kernels::Layer];

    /// `reference`, `ops` or `layer`.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    /// The name the command line and bench records use: `reference`, `ops` or `layer`.
    pub fn name(self) -> &'static str {
        match self {
            Kernels::Reference => "reference",
            Kernels::Ops => "ops",
            Kernels::Layer => "layer",
        }
    }
}

/// How an encoder computes: which kernels, and the instruction sets poslab's fused CPU kernels
/// may use. A value, chosen by whoever builds the encoder ([`crate::Encoder::with_backend`];
/// by default [`Backend::default`]) and never read from the environment here, in force for everything its forward passes, its model's
/// head, and a training step on it compute ([`Backend::run`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backend {
    /// Which implementation the layers run.
    pub kernels: Kernels,
    /// The instruction sets the fused kernels use (never above what the CPU has: see
    /// [`Backend::with_simd`]). The same source compiled for each level gives the same bits
    /// (Rust never fuses a multiply and an add on its own), so it changes speed only.
    pub simd: SimdLevel,
}

impl Default for Backend {
    /// The fused layer kernel at the best level the CPU has.
    fn default() -> Self {
        Self {
            kernels: Kernels::Layer,
            simd: SimdLevel::detected(),
        }
    }
}

impl Backend {
    /// This backend with `kernels`.
    pub fn with_kernels(self, kernels: Kernels) -> Self {
        Self { kernels, ..self }
    }

    /// This backend with its fused kernels capped at `simd` (or at what the CPU has, if lower).
    pub fn with_simd(self, simd: SimdLevel) -> Self {
        Self {
            simd: simd.min(SimdLevel::detected()),
            ..self
        }
    }

    /// Runs `f` with the layers' ops on this thread computing with this backend (restoring the
    /// one before after). A test override ([`with_kernels`]) takes precedence.
    pub fn run<R>(self, f: impl FnOnce() -> R) -> R {
        let _in_force = self.enter();
        f()
    }

    /// This backend in force on this thread until the guard is dropped (then the one before
    /// it again): how an encoder's forward pass, its model's head and a training step compute
    /// with the encoder's backend.
    pub fn enter(self) -> InForce {
        InForce {
            before: IN_FORCE.with(|b| b.replace(Some(self))),
            _not_send: std::marker::PhantomData,
        }
    }
}

/// A [`Backend`] in force on this thread, until dropped ([`Backend::enter`]).
#[must_use = "the backend is in force only while the guard lives"]
pub struct InForce {
    before: Option<Backend>,
    /// The backend is in force on the thread that entered it: the guard stays there.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for InForce {
    fn drop(&mut self) {
        IN_FORCE.with(|b| b.set(self.before));
    }
}

thread_local! {
    static IN_FORCE: Cell<Option<Backend>> = const { Cell::new(None) };
    static TEST_OVERRIDE: Cell<Option<Backend>> = const { Cell::new(None) };
    static GPU_OPS_ON_CPU: Cell<bool> = const { Cell::new(false) };
}

/// The backend in force on this thread: a test's override, else the one a [`Backend::run`]
/// installed (an encoder's, for the length of its pass), else [`Backend::default`].
pub fn backend() -> Backend {
    TEST_OVERRIDE
        .with(Cell::get)
        .or_else(|| IN_FORCE.with(Cell::get))
        .unwrap_or_default()
}

/// For tests and benchmarks of the kernels: runs `f` with the layers on this thread computed
/// by `backend`, overriding every encoder's own. How the tests hold the fast paths to the
/// reference at every SIMD level.
#[doc(hidden)]
pub fn with_backend<R>(backend: Backend, f: impl FnOnce() -> R) -> R {
    let before = TEST_OVERRIDE.with(|k| k.replace(Some(backend)));
    let out = f();
    TEST_OVERRIDE.with(|k| k.set(before));
    out
}

/// For tests and benchmarks: [`with_backend`] with `kernels` (and the SIMD level in force).
#[doc(hidden)]
pub fn with_kernels<R>(kernels: Kernels, f: impl FnOnce() -> R) -> R {
    with_backend(backend().with_kernels(kernels), f)
}

/// For tests: runs `f` with the layers on this thread computing on the CPU as they do on CUDA:
/// under [`Kernels::Ops`] the ops of `cuda_ops.rs` (one kernel each for softmax, LayerNorm,
/// GELU and RoPE's rotation, poslab's backward passes), computed by their CPU forward passes,
/// and compositions elsewhere; under [`Kernels::Layer`] each encoder layer as the device
/// path's sequence of operations (`nn/device/`), computed by its CPU twin, in f32,
/// f64 and half precision alike. How the tests check the CUDA path's wiring without a GPU;
/// [`Kernels::Reference`] still means the compositions. Returns `f`'s value and how many of
/// the one-kernel ops it ran (forward passes), so a test can tell that the path was taken
/// ([`device_path::counts`] counts the layer's operations).
#[doc(hidden)]
pub fn with_gpu_ops_on_cpu<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let before = GPU_OPS_ON_CPU.with(|g| g.replace(true));
    let calls = cuda_ops::calls();
    let out = f();
    GPU_OPS_ON_CPU.with(|g| g.set(before));
    (out, cuda_ops::calls() - calls)
}

/// For tests: [`with_kernels`] with [`Kernels::Reference`].
#[doc(hidden)]
pub fn with_reference_ops<R>(f: impl FnOnce() -> R) -> R {
    with_kernels(Kernels::Reference, f)
}

/// The kernels in force on this thread (ignoring the tensor's device and dtype).
pub fn current_kernels() -> Kernels {
    backend().kernels
}

/// The kernels activations of `dtype` on `device` are computed with: [`current_kernels`] on
/// the CPU in f32 or f64, and on CUDA (where [`Kernels::Layer`] is the device path's layer,
/// `nn/device/`); else the reference compositions. Under [`with_gpu_ops_on_cpu`] the
/// CPU computes as CUDA does, half precision included.
pub fn kernels_on(device: &candle::Device, dtype: DType) -> Kernels {
    let chosen = current_kernels();
    let gpu_on_cpu = device.is_cpu() && GPU_OPS_ON_CPU.with(Cell::get);
    if (device.is_cpu() && matches!(dtype, DType::F32 | DType::F64))
        || (device.is_cuda() && self::device::supports(dtype))
    {
        chosen
    } else if gpu_on_cpu && chosen == Kernels::Layer && self::device::supports(dtype) {
        Kernels::Layer
    } else {
        Kernels::Reference
    }
}

/// Whether AdamW updates a variable with gradient `g` on the device path (one multi-tensor
/// launch for all of them): on CUDA, and on the CPU under [`with_gpu_ops_on_cpu`], unless the
/// reference compositions are asked for.
pub(crate) fn device_optimizer_for(g: &Tensor) -> bool {
    matches!(g.dtype(), DType::F32 | DType::F64)
        && current_kernels() != Kernels::Reference
        && (g.device().is_cuda() || (g.device().is_cpu() && GPU_OPS_ON_CPU.with(Cell::get)))
}

/// Whether an encoder layer of `x` runs on the device path: on CUDA, and on the CPU under
/// [`with_gpu_ops_on_cpu`] (its twin).
pub(crate) fn device_layer_for(x: &Tensor) -> bool {
    kernels_for(x) == Kernels::Layer
        && (x.device().is_cuda() || (x.device().is_cpu() && GPU_OPS_ON_CPU.with(Cell::get)))
}

/// The kernels `x` is computed with (see [`kernels_on`]).
pub(crate) fn kernels_for(x: &Tensor) -> Kernels {
    kernels_on(x.device(), x.dtype())
}

/// Whether `x` goes through one of poslab's fused CPU kernels.
pub(crate) fn fused_for(x: &Tensor) -> bool {
    fused_on(x.device(), x.dtype(), current_kernels())
}

/// Where a model computes: its device, and the backend its layers run with. What a memory bound
/// is given to know which path will hold a batch's attention tables ([`fused_on`]).
#[derive(Clone, Copy, Debug)]
pub struct Compute<'a> {
    /// The device activations live on.
    pub device: &'a candle::Device,
    /// The kernels (and SIMD level) the layers run with.
    pub backend: Backend,
}

/// Whether poslab's fused CPU kernels compute activations of `dtype` on `device` under
/// `kernels`: on the CPU in f32 or f64, unless the reference compositions are asked for. Where
/// they do, a scheme whose scores they compute (PoPE, CoPE, PaTH) holds far fewer attention
/// tables than its composition ([`crate::positional::Scheme::score_tensors`]).
///
/// Not under [`with_gpu_ops_on_cpu`], where the CPU computes as CUDA does (the device path's
/// twin, whose schemes hold their compositions' tables): a memory bound checked there is
/// checked for the path that runs.
pub fn fused_on(device: &candle::Device, dtype: DType, kernels: Kernels) -> bool {
    device.is_cpu()
        && !GPU_OPS_ON_CPU.with(Cell::get)
        && matches!(dtype, DType::F32 | DType::F64)
        && kernels != Kernels::Reference
}

/// Whether `x` goes through the one-kernel CUDA ops of `cuda_ops.rs` (on the CPU only under
/// [`with_gpu_ops_on_cpu`]).
pub(crate) fn gpu_ops_for(x: &Tensor) -> bool {
    let device = x.device();
    kernels_for(x) != Kernels::Reference
        && (device.is_cuda() || (device.is_cpu() && GPU_OPS_ON_CPU.with(Cell::get)))
}

// Mixed precision (see `crate::Precision`): activations may be bf16 or f16 while parameters,
// positional tables and statistics stay in f32 (or f64).

/// Whether `dtype` is a half type, whose softmax, LayerNorm and RoPE run in f32.
pub(crate) fn is_half(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

/// `a.matmul(b)`. candle's CPU matmul has no bf16 kernel; there the product is taken in f32
/// from the bf16 inputs and rounded back, which is what a GPU's bf16 tensor cores compute
/// (bf16 inputs, f32 accumulation).
pub(crate) fn matmul(a: &Tensor, b: &Tensor) -> candle::Result<Tensor> {
    if a.dtype() == DType::BF16 && a.device().is_cpu() {
        a.to_dtype(DType::F32)?
            .matmul(&b.to_dtype(DType::F32)?)?
            .to_dtype(DType::BF16)
    } else {
        a.matmul(b)
    }
}
