//! The masked-LM head of BERT-family models.

use candle::Tensor;
use candle_nn::{Init, VarBuilder};

use crate::error::Result;
use crate::nn::{gelu, layer_norm_with_bias, linear_with_bias, Backend, LayerNorm, Linear};

/// `logits = LN(gelu(dense(h))) · E^T + bias`, `E` the word embeddings (the decoder is tied):
/// `mlm.dense`, `mlm.norm`, `mlm.bias`.
#[derive(Debug)]
pub struct MlmHead {
    dense: Linear,
    norm: LayerNorm,
    bias: Tensor,
}

impl MlmHead {
    /// The head for a `d_model`-wide encoder and `vocab` tokens, weights under `vb` (`dense`,
    /// `norm`, `bias`); `dense` and `norm` without biases unless `bias` (ModernBERT's have
    /// none; the decoder's `bias` is always there).
    pub fn new(d_model: usize, vocab: usize, eps: f64, bias: bool, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            dense: linear_with_bias(d_model, d_model, bias, vb.pp("dense"))?,
            norm: layer_norm_with_bias(d_model, eps, bias, vb.pp("norm"))?,
            bias: vb.get_with_hints(vocab, "bias", Init::Const(0.0))?,
        })
    }

    /// # Shapes
    /// - `hidden`: `(b, t, d)`, `embeddings`: `(vocab, d)`; returns `(b, t, vocab)`
    pub fn forward(
        &self,
        hidden: &Tensor,
        embeddings: &Tensor,
        backend: Backend,
    ) -> Result<Tensor> {
        let h = gelu(&self.dense.forward(hidden, backend)?, backend)?;
        let h = self.norm.forward(&h, backend)?;
        Ok(h.broadcast_matmul(&embeddings.t()?)?
            .broadcast_add(&self.bias)?)
    }
}
