//! poslab: a lab for transformer positional encodings, built on candle.
//!
//! An [`Encoder`] whose positional scheme is one of eighteen, chosen in its [`ModelConfig`]:
//! `none` (the control), `sinusoidal_add`, `sinusoidal_concat`, `learned` (input side), `rope`
//! and `prope` (a rotation inside attention), `alibi`, `t5`, `kerple`, `fire`, `untied`, `fox`
//! (a bias on the attention scores, FoX's set by the content), `pope`, `cope`, `path`,
//! `grape_m`, `grape_a` (the scores computed by the scheme itself) and `stick_breaking` (weights in place of the
//! softmax), each also with a causal mask (`causal`); randomized positions on the schemes that read
//! positions. See [`positional`] for what each computes and where, and
//! [`Encoder::seeded`] for an encoder alone.
//!
//! Two encoders with different schemes, a padded batch through each, three training steps,
//! and the bias ALiBi adds to the scores:
//!
//! ```
//! use poslab::prelude::*;
//!
//! let device = Device::Cpu;
//! let ids = Tensor::new(&[[5u32, 8, 13, 0], [3, 1, 4, 1]], &device)?;
//! let mask = Tensor::new(&[[1u32, 1, 1, 0], [1, 1, 1, 1]], &device)?; // 0: padding
//! let labels = Tensor::new(&[0u32, 1], &device)?;
//! let head = HeadConfig::Classify { classes: 2, pooling: Pooling::Mean };
//! for scheme in [PositionalConfig::Rope(RopeOptions::default()), PositionalConfig::Alibi(Default::default())] {
//!     let config = ModelConfig::default().with_vocab_size(16).with_positional(scheme);
//!     let mut learner = Learner::new(&config, &head, 42, &device)?; // seeded weights, AdamW
//!     let encoder = learner.model().encoder();
//!     let hidden = encoder.forward_t(&ids, &mask, false)?;
//!     assert_eq!(hidden.dims(), [2, 4, 64]); // (batch, tokens, d_model)
//!     // ALiBi's bias on layer 0's scores at positions 0..4 (`range(start, count)`), (1, heads,
//!     // 4, 4); None for RoPE, a rotation.
//!     let bias = encoder.score_bias(0, &Positions::range(0, 4)?)?;
//!     assert_eq!(bias.is_some(), config.positional.name() == "alibi");
//!     for _ in 0..3 {
//!         let loss = learner.step(&ids, &mask, &labels)?;
//!         assert!(loss.is_finite());
//!     }
//! }
//! # Ok::<(), poslab::Error>(())
//! ```
//!
//! The same from a TOML file: `ModelConfig::load("configs/encoder.toml")`, whose format is the
//! command line's (see the book, `book/src/reference/config.md`).

#![warn(missing_docs)]

pub use poslab_core::{
    batch, config, encoder, error, kernels, keyed, layers, limits, model, nn, params, positional,
    rng, weights,
};

pub mod analysis;
pub mod bench;
pub mod data;
pub mod device;
pub mod heap;
pub mod infer;
pub mod io;
pub mod prediction;
pub mod pretrained;
pub mod progress;
pub mod render;
pub mod runs;
pub mod saved;
pub mod tasks;
pub mod text;
pub mod train;

pub use poslab_core::{
    Activation, Choices, EmbeddingExtras, HeadConfig, LayerKind, LayerPlan, ModelConfig,
    ModelShape, NormPlacement, Pooling, Precision, RopeBases, Scale, TaskModel,
};
pub use train::Learner;

/// The candle poslab is built with: a program using poslab writes `poslab::candle::Tensor`
/// and needs no candle version of its own.
pub use poslab_core::candle;
/// The candle-nn poslab is built with.
pub use poslab_core::candle_nn;

/// What a program using the library needs first: the encoder, its config and schemes, a
/// training loop, and candle's `Device`, `DType`, `Tensor` and `Module`.
pub mod prelude {
    pub use crate::candle::{DType, Device, Module, Tensor};
    pub use crate::model::{HeadConfig, Pooling, TaskModel};
    pub use crate::positional::{
        ConcatOptions, FireOptions, NoOptions, PropeOptions, RopeOptions, SinusoidalOptions,
        T5Options,
    };
    pub use crate::train::Learner;
    pub use crate::{Encoder, ModelConfig, NormPlacement, ParamStore, PositionalConfig, Positions};
}

/// Keeps freed tensor memory in the process for reuse (glibc on Linux; elsewhere nothing).
///
/// glibc serves allocations above 128 KiB with `mmap` and returns them to the system when
/// freed, so each step's multi-MiB activations are faulted in and zeroed by the kernel again:
/// measured here, a third of a training step. Raising the mmap and trim thresholds to 32 MiB and
/// 1 GiB lets the heap reuse that memory instead (forward 1.66x, training 1.40x faster at the
/// reference bench shape). It changes process-wide allocator settings, so the `poslab` binary
/// calls it at start-up and a program using the library decides for itself.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only adjusts glibc's allocator parameters; any value is memory-safe.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, kernels::MMAP_THRESHOLD as i32);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}
pub use poslab_core::{
    Encoder, EncoderLayer, Error, ParamStore, Placement, PositionalConfig, Positions, Result,
    RopeOptions, RopePairing, TableLayout,
};
