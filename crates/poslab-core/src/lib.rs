//! poslab-core: a transformer encoder with swappable positional schemes, on candle.
//!
//! An [`Encoder`] whose positional scheme is one of eighteen, chosen in its [`ModelConfig`]:
//! `none` (the control), `sinusoidal_add`, `sinusoidal_concat`, `learned` (input side), `rope`
//! and `prope` (a rotation inside attention), `alibi`, `t5`, `kerple`, `fire`, `untied`, `fox`
//! (a bias on the attention scores, FoX's set by the content), `pope`, `cope`, `path`,
//! `grape_m`, `grape_a` (the scores computed by the scheme itself) and `stick_breaking` (weights in place of the
//! softmax), each also with a causal mask (`causal`). Each scheme lives in its own file of [`positional`],
//! with its reference composition; [`nn`] holds the layers, each op choosing once where it
//! computes ([`nn::Backend`]): poslab's fused CPU kernels and the CUDA device path
//! (`poslab-kernels`, the default feature `kernels`) or compositions of candle ops.
//!
//! The lab (`poslab`) trains, compares, analyses and reports on these encoders; this crate is
//! the model alone, with no dependency of the lab's.
//!
//! An encoder with RoPE on a padded batch, and the same with ALiBi:
//!
//! ```
//! use poslab_core::candle::{Device, Tensor};
//! use poslab_core::positional::RopeOptions;
//! use poslab_core::{Encoder, ModelConfig, PositionalConfig};
//!
//! let device = Device::Cpu;
//! let ids = Tensor::new(&[[5u32, 8, 13, 0], [3, 1, 4, 1]], &device)?;
//! let mask = Tensor::new(&[[1u32, 1, 1, 0], [1, 1, 1, 1]], &device)?; // 0: padding
//! for scheme in [PositionalConfig::Rope(RopeOptions::default()), PositionalConfig::Alibi(Default::default())] {
//!     let config = ModelConfig::default().with_vocab_size(16).with_positional(scheme);
//!     let (encoder, store) = Encoder::seeded(&config, 42, &device)?; // seeded weights
//!     let hidden = encoder.forward_t(&ids, &mask, false)?;
//!     assert_eq!(hidden.dims(), [2, 4, 64]); // (batch, tokens, d_model)
//!     assert!(store.num_params() > 0);
//! }
//! # Ok::<(), poslab_core::Error>(())
//! ```

#![warn(missing_docs)]

pub mod batch;
pub mod config;
pub mod encoder;
pub mod error;
pub mod io;
#[doc(hidden)]
pub mod keyed;
pub mod layers;
pub mod limits;
pub mod model;
pub mod nn;
pub mod params;
pub mod positional;
pub mod rng;
pub mod weights;

/// The kernels this core computes with (the default feature `kernels`).
pub use poslab_kernels as kernels;

/// The candle poslab is built with: a program using poslab writes `poslab_core::candle::Tensor`
/// and needs no candle version of its own.
pub use candle;
/// The candle-nn poslab is built with.
pub use candle_nn;

pub use config::{
    Choices, EmbeddingExtras, ModelConfig, ModelShape, NormPlacement, Precision, Scale,
};
pub use encoder::{Encoder, EncoderLayer};
pub use error::{Error, Result};
pub use layers::{LayerKind, LayerPlan, RopeBases};
pub use model::{HeadConfig, Pooling, TaskModel};
pub use nn::Activation;
pub use params::ParamStore;
pub use positional::{
    Placement, PositionalConfig, Positions, RopeOptions, RopePairing, TableLayout,
};
