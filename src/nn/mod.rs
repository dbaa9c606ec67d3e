//! Layers of the encoder, each a small struct built from a `VarBuilder`.
//!
//! Everything here is differentiable on every device: in candle-nn 0.11 the fused
//! `ops::softmax_last_dim`, `ops::layer_norm` (and so `candle_nn::LayerNorm` on contiguous
//! input) and `rope`/`rope_i` have no backward pass, and every variable upstream of them would
//! silently stop learning. The compositions below are what the gradient tests check.

mod attention;
mod dropout;
mod feed_forward;
mod layer_norm;
mod ops;

pub use attention::{key_padding_bias, SelfAttention};
pub use dropout::{Dropout, SharedRng};
pub use feed_forward::FeedForward;
pub use layer_norm::{layer_norm, LayerNorm};
pub use ops::{gelu, linear, linear_no_bias, log_softmax_last_dim, softmax_last_dim};
