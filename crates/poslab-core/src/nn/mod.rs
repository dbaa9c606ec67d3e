//! Layers of the encoder, each a small struct built from a `VarBuilder`.
//!
//! Everything here is differentiable on every device: in candle-nn 0.11 the fused
//! `ops::softmax_last_dim`, `ops::layer_norm` (and so `candle_nn::LayerNorm` on contiguous
//! input) and `rope`/`rope_i` have no backward pass, and every variable upstream of them would
//! silently stop learning. On the CPU (f32, f64) poslab runs its own kernels with hand-written
//! backward passes (`fused`): by default each encoder layer is one autograd node, and the
//! pieces outside the layers (linear heads, final LayerNorm) are fused ops; elsewhere, and under
//! [`Backend::reference`], everything is a composition of differentiable tensor ops. See
//! [`Kernels`]. Every op takes the [`Backend`] its model holds and asks it once where to
//! compute ([`Backend::path`]); each keeps its reference composition beside it (`*_reference`).
//! The tests hold every path to the reference, forward and backward.

mod attention;
mod dropout;
mod feed_forward;
mod gate_counts;
#[cfg(all(test, feature = "kernels"))]
mod kernel_checks;
mod layer_norm;
mod ops;
mod polar;
mod rotary;
mod transport;

#[cfg(feature = "kernels")]
pub(crate) use crate::kernels::cpu::{encoder_layer, encoder_stack, StackLayer};
#[cfg(feature = "kernels")]
pub(crate) use crate::kernels::spec::{AttentionDropout, LayerMasks, LayerShape, TransportShape};
pub use crate::kernels::{cores, simd_dispatches, with_threads, SimdLevel};
#[cfg(feature = "kernels")]
pub use crate::kernels::{
    head_product_gflops, linear_pass_gflops, matmul_gflops, HeadProduct, LinearPass,
};
pub use attention::{
    allowed_keys, key_padding_bias, pair_mask, window_bias, AttentionBias, AttentionInputs,
    AttentionWeights, ForgetGates, LayerBias, QkScores, SelfAttention, Window,
};
pub use dropout::{Dropout, SharedRng};
pub use feed_forward::{Activation, FeedForward};
pub use gate_counts::{CountParts, GateCounts};
pub use layer_norm::{layer_norm, layer_norm_no_bias, layer_norm_with_bias, LayerNorm};
pub use ops::{
    channel_mlp, channel_mlp_reference, gelu, gelu_reference, linear, linear_no_bias,
    linear_with_bias, log_sigmoid, log_sigmoid_reference, log_softmax_last_dim, masked_softmax,
    rope_rotate, rope_rotate_reference, running_sums, running_sums_reference, sided_differences,
    softmax_last_dim, Linear,
};
pub use polar::Polar;
pub use rotary::Rotary;
pub use transport::{
    transport_inverse, transport_scores, InputReflections, Projections, Transport,
};

/// What the device path ([`Kernels::Layer`] on CUDA) issued and allocated on this thread:
/// see `poslab bench --launches`.
#[cfg(feature = "kernels")]
pub mod device_path {
    #[cfg(feature = "cuda")]
    pub use crate::kernels::gpu::cuda::compile_check as compile_kernels;
    pub use crate::kernels::gpu::flash::against_twin as fused_attention_against_twin;
    pub use crate::kernels::gpu::{counts, live_bytes, peak_bytes, reset_peak_bytes, Counts};
}

use candle::{DType, Tensor};

pub(crate) use crate::kernels::spec::MASKED_SCORE;

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

/// How an encoder computes: which kernels, the instruction sets poslab's fused CPU kernels may
/// use, and whether the CPU computes as CUDA does. A value, chosen by whoever builds the encoder
/// ([`crate::Encoder::with_backend`]; by default [`Backend::default`]) and never read from the
/// environment, handed to every op its forward passes, its model's head and a training step on
/// it run. Each op asks it once where it computes ([`Backend::path`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backend {
    /// Which implementation the layers run.
    pub kernels: Kernels,
    /// The instruction sets the fused kernels use (never above what the CPU has: see
    /// [`Backend::with_simd`]). The same source compiled for each level gives the same bits
    /// (Rust never fuses a multiply and an add on its own), so it changes speed only.
    pub simd: SimdLevel,
    /// The CPU computes as CUDA does ([`Backend::as_on_cuda`]): how the tests check the CUDA
    /// path's wiring without a GPU.
    pub cuda_twin: bool,
    /// Attention dropout from a seed everywhere ([`Backend::seeds_attention_dropout`]), as the
    /// device path draws it: how the tests give the compositions the device path's masks.
    pub seeded_attention_dropout: bool,
}

impl Default for Backend {
    /// The fused layer kernel at the best level the CPU has.
    fn default() -> Self {
        Self {
            kernels: Kernels::Layer,
            simd: SimdLevel::detected(),
            cuda_twin: false,
            seeded_attention_dropout: false,
        }
    }
}

/// Where an op computes a tensor ([`Backend::path`]): the one question each op asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// Compositions of differentiable candle tensor ops (the specification).
    Reference,
    /// poslab's fused CPU kernels, with their hand-written backward passes (`fused/`).
    Fused,
    /// The CUDA path: one kernel per softmax, LayerNorm, GELU and RoPE rotation
    /// (`cuda_ops.rs`), and under [`Kernels::Layer`] each encoder layer as the device path's
    /// operations (`device/`); on the CPU, under [`Backend::as_on_cuda`], their CPU twins.
    Device,
}

impl Backend {
    /// The compositions of differentiable tensor ops everywhere: the specification.
    pub fn reference() -> Self {
        Self::default().with_kernels(Kernels::Reference)
    }

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

    /// For tests: this backend with the CPU computing as CUDA does. Under [`Kernels::Ops`] the
    /// ops of `cuda_ops.rs` (one kernel each for softmax, LayerNorm, GELU and RoPE's rotation,
    /// poslab's backward passes), computed by their CPU forward passes, and compositions
    /// elsewhere; under [`Kernels::Layer`] each encoder layer as the device path's sequence of
    /// operations (`poslab-kernels/src/gpu/`), computed by its CPU twin, in f32, f64 and half precision
    /// alike; [`Kernels::Reference`] still means the compositions. [`cuda_op_calls`] and
    /// [`device_path::counts`] tell a test that the path was taken.
    #[doc(hidden)]
    pub fn as_on_cuda(self) -> Self {
        Self {
            cuda_twin: true,
            ..self
        }
    }

    /// For tests: this backend with the attention weights' dropout drawn from a seed on every
    /// path, as on the device path ([`Backend::seeds_attention_dropout`]).
    #[doc(hidden)]
    pub fn with_seeded_attention_dropout(self) -> Self {
        Self {
            seeded_attention_dropout: true,
            ..self
        }
    }

    /// Whether the attention weights of `x`'s layers are dropped by a seeded mask
    /// ([`crate::kernels::spec::SeededDropout`]: one seed drawn from the model's generator a
    /// layer, each weight's multiplier a hash of the seed and its index), rather than by
    /// multipliers drawn one by one from the generator. On the device path: its kernels draw
    /// each tile's multipliers where they are used, so the fused attention makes no `t × t` mask
    /// (a device-path run's masks are therefore not the CPU path's, though they are drawn with
    /// the same probability). Elsewhere only under [`Backend::with_seeded_attention_dropout`].
    pub fn seeds_attention_dropout(&self, x: &Tensor) -> bool {
        self.seeded_attention_dropout || self.path(x) == Path::Device
    }

    /// The kernels activations of `dtype` on `device` are computed with: [`Backend::kernels`]
    /// on the CPU in f32 or f64, and on CUDA (where [`Kernels::Layer`] is the device path's
    /// layer, `poslab-kernels/src/gpu/`); else the reference compositions. Under [`Backend::as_on_cuda`]
    /// the CPU computes as CUDA does, half precision included.
    pub fn kernels_on(&self, device: &candle::Device, dtype: DType) -> Kernels {
        // Without the kernels (the feature `kernels`), every op is its composition.
        let chosen = match cfg!(feature = "kernels") {
            true => self.kernels,
            false => Kernels::Reference,
        };
        let twin = device.is_cpu() && self.cuda_twin;
        if (device.is_cpu() && matches!(dtype, DType::F32 | DType::F64))
            || (device.is_cuda() && crate::kernels::spec::device_path_supports(dtype))
        {
            chosen
        } else if twin
            && chosen == Kernels::Layer
            && crate::kernels::spec::device_path_supports(dtype)
        {
            Kernels::Layer
        } else {
            Kernels::Reference
        }
    }

    /// Where an op computes `x`: the one place the implementation is chosen. The fused CPU
    /// kernels on the CPU in f32 or f64; the CUDA path on CUDA (and on the CPU as its twin,
    /// under [`Backend::as_on_cuda`]); the compositions elsewhere and under
    /// [`Kernels::Reference`].
    pub fn path(&self, x: &Tensor) -> Path {
        let device = x.device();
        if self.kernels_on(device, x.dtype()) == Kernels::Reference {
            Path::Reference
        } else if device.is_cuda() || self.cuda_twin {
            Path::Device
        } else {
            Path::Fused
        }
    }

    /// Whether `x`'s encoder layers run whole, as one node ([`Kernels::Layer`]) on the path
    /// [`Backend::path`] gives.
    pub fn whole_layers(&self, x: &Tensor) -> bool {
        self.kernels_on(x.device(), x.dtype()) == Kernels::Layer
    }

    /// Whether `x`'s encoder layers run on the device path (CUDA, or its CPU twin), each as
    /// one node: where the lookup and the head's loss join that path too.
    pub fn device_layer(&self, x: &Tensor) -> bool {
        self.path(x) == Path::Device && self.whole_layers(x)
    }

    /// Whether AdamW updates a variable with gradient `g` on the device path (one multi-tensor
    /// launch for all of them): on CUDA, and on the CPU under [`Backend::as_on_cuda`], unless
    /// the reference compositions are asked for.
    pub fn device_optimizer(&self, g: &Tensor) -> bool {
        cfg!(feature = "kernels")
            && matches!(g.dtype(), DType::F32 | DType::F64)
            && self.kernels != Kernels::Reference
            && (g.device().is_cuda() || (g.device().is_cpu() && self.cuda_twin))
    }

    /// Whether poslab's fused CPU kernels compute activations of `dtype` on `device`: on the
    /// CPU in f32 or f64, unless the reference compositions are asked for. Where they do, a
    /// scheme whose scores they compute (PoPE, CoPE, PaTH) holds far fewer attention tables
    /// than its composition ([`crate::positional::ScoreMemory::score_tensors`]).
    ///
    /// Not under [`Backend::as_on_cuda`], where the CPU computes as CUDA does (the device
    /// path's twin, whose schemes hold their compositions' tables): a memory bound checked
    /// there is checked for the path that runs.
    pub fn fused_on(&self, device: &candle::Device, dtype: DType) -> bool {
        cfg!(feature = "kernels")
            && device.is_cpu()
            && !self.cuda_twin
            && matches!(dtype, DType::F32 | DType::F64)
            && self.kernels != Kernels::Reference
    }
}

/// How many of `cuda_ops.rs`'s one-kernel ops have run their forward in this process (counters
/// kept for tests: [`Backend::as_on_cuda`]).
#[doc(hidden)]
#[cfg(feature = "kernels")]
pub fn cuda_op_calls() -> usize {
    crate::kernels::cuda_ops::calls()
}

/// Where a model computes: its device, and the backend its layers run with. What a memory bound
/// is given to know which path will hold a batch's attention tables ([`Backend::fused_on`]).
#[derive(Clone, Copy, Debug)]
pub struct Compute<'a> {
    /// The device activations live on.
    pub device: &'a candle::Device,
    /// The kernels (and SIMD level) the layers run with.
    pub backend: Backend,
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
