//! poslab: a lab for transformer positional encodings, built on candle.
//!
//! An [`Encoder`] whose positional scheme is one of five, chosen in its [`ModelConfig`]:
//! `none` (the control), `sinusoidal_add`, `sinusoidal_concat`, `learned` (input side) and
//! `rope` (attention side). See [`positional`] for what each computes and where.
//!
//! ```no_run
//! use candle::{DType, Device, Tensor};
//! use poslab::{Encoder, ModelConfig, ParamStore};
//!
//! let config = ModelConfig::load("configs/encoder.toml")?;
//! let params = ParamStore::new(42); // same seed, same weights, bit for bit
//! let encoder = Encoder::new(&config, params.var_builder(DType::F32, &Device::Cpu))?;
//! let ids = Tensor::new(&[[5u32, 8, 13, 0], [3, 1, 4, 1]], &Device::Cpu)?;
//! let mask = Tensor::new(&[[1u32, 1, 1, 0], [1, 1, 1, 1]], &Device::Cpu)?;
//! let hidden = encoder.forward_t(&ids, &mask, false)?; // (2, 4, d_model)
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod analysis;
pub mod config;
pub mod data;
pub mod device;
pub mod encoder;
pub mod error;
pub mod experiment;
pub mod infer;
pub mod io;
pub mod model;
pub mod nn;
pub mod params;
pub mod positional;
pub mod rng;
pub mod saved;
pub mod tasks;
pub mod text;
pub mod train;

pub use config::{ModelConfig, NormPlacement, Scale};
pub use encoder::{Encoder, EncoderLayer};
pub use error::{Error, Result};
pub use params::ParamStore;
pub use positional::{Placement, PositionalConfig, RopePairing, TableLayout};
