//! What the analyses read of an encoder beyond its output: each layer's score bias, the four
//! terms of its scores, its queries and keys, its rotation's part, its hidden states.

use candle::Tensor;

use crate::config::NormPlacement;
use crate::error::{Error, Result};
use crate::nn::{key_padding_bias, AttentionInputs};
use crate::positional::{BiasBatch, PositionalModule, Positions};

use super::{Encoder, EncoderLayer};

/// One layer's attention scores split into four terms ([`Encoder::score_terms`]).
#[derive(Clone, Debug)]
pub struct ScoreTerms {
    /// The layer.
    pub layer: usize,
    /// The keys each query reads (a local layer's window, a causal mask).
    pub window: crate::nn::Window,
    /// The scores, `(b, h, t, t)`.
    pub scores: Tensor,
    /// content·content, content·position, position·content, position·position, each like
    /// `scores`; they sum to it.
    pub terms: [Tensor; 4],
}

impl Encoder {
    /// Layer `i`'s score bias for `positions` of sequences with no padding (an attention-bias
    /// scheme whose bias does not depend on the content), `(r, h, t, t)`: what `analyze` shows
    /// of TUPE's position-to-position term and the learned KERPLE, T5 and FIRE biases. Under
    /// DAPE's MLP (`adaptive`), the scheme's own bias, which the MLP reads beside the logits.
    pub fn score_bias(&self, layer: usize, positions: &Positions) -> Result<Option<Tensor>> {
        match self.positional.score_bias() {
            Some(bias) if layer < self.layers.len() && self.layers[layer].spec.positions => {
                let biases = bias.layer_biases(&BiasBatch {
                    positions,
                    mask: None,
                    dtype: self.dtype(),
                    device: self.device(),
                    backend: self.backend,
                })?;
                Ok(biases.layer(layer).cloned())
            }
            _ => Ok(None),
        }
    }

    /// Whether [`Encoder::score_terms`] is defined: positions joined to the token embeddings.
    pub fn has_position_terms(&self) -> bool {
        matches!(&self.positional, PositionalModule::Input(input) if input.splits())
    }

    /// For an encoder whose positions are joined to the token embeddings (`sinusoidal_add`,
    /// `learned`, `sinusoidal_concat`): per layer, the attention scores and their
    /// content·content, content·position, position·content and position·position terms (see
    /// [`crate::nn::SelfAttention::score_terms`]), each `(b, h, t, t)`.
    ///
    /// The residual stream is split as `(h - p) + p`, `p` the positional part of the embedding
    /// ([`crate::positional::InputPositions::split`]: the added vectors, or a concatenation's
    /// `[0 ; PE]` through its projection, where `q = W_q [x ; p] = W_qx x + W_qp p`), which
    /// stay in it additively under pre-norm, so every layer is decomposed; under post-norm the
    /// first LayerNorm mixes them, so only the first layer is. An embedding LayerNorm (BERT's)
    /// is split exactly the same way ([`crate::nn::LayerNorm::split`]: both parts over the sum's
    /// standard deviation, the bias and the token-type row with the content), so a BERT's first
    /// layer is decomposed too: TUPE's analysis of BERT. Layers are returned in order with their
    /// index and their window: a local layer's scores beyond it are never read, and each layer
    /// runs as the model runs it (its window, a local layer's own rotation), so the next layer's
    /// input is the model's.
    pub fn score_terms(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
    ) -> Result<Vec<ScoreTerms>> {
        let (_, t) = self.check_input(input_ids, attention_mask)?;
        let at = self.starting_at_first(&Positions::range(0, t)?)?;
        let refused = || {
            Error::Input(format!(
                "attention terms need positions joined to the token embeddings \
                 (sinusoidal_add, sinusoidal_concat or learned); this encoder's are `{}`",
                self.config.positional.name()
            ))
        };
        let PositionalModule::Input(input) = &self.positional else {
            return Err(refused());
        };
        let scale = self.config.embed_scale.value(self.config.d_model);
        let tokens = (self.embed_tokens(input_ids)? * scale)?;
        // (b, t, d_model) content and (1 or b, t, d_model) positions, summing to the embedding.
        let split = input.split(&tokens, &at, self.backend)?;
        let (content, positions) = split.ok_or_else(refused)?;
        let content = match &self.type_emb {
            Some(table) => content.broadcast_add(&table.get(0)?)?,
            None => content,
        };
        // The positional part of the residual stream as the first layer receives it.
        let (mut h, positions) = match &self.embed_norm {
            Some(norm) => {
                let (c, p) = norm.split(&content, &positions)?;
                ((c + &p)?, p)
            }
            None => (
                content.broadcast_add(&positions)?,
                positions.broadcast_as(content.shape())?.contiguous()?,
            ),
        };
        let padding = key_padding_bias(attention_mask, h.dtype())?;
        // What each layer reads besides its input (a local layer's rotation), as the model has it.
        let (_, placed) = self.place(tokens.clone(), &at, attention_mask)?;
        let mut out = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            let content = (&h - &positions)?;
            let (inputs, own) = self.layer_inputs(&placed, &padding, i);
            let split = match self.config.norm {
                NormPlacement::Pre => {
                    let (c, p) = match &layer.attn_norm {
                        Some(norm) => norm.split(&content, &positions)?,
                        None => (content, positions.clone()),
                    };
                    layer.attn.score_terms(&c, &p, self.backend)?
                }
                NormPlacement::Post if i == 0 => {
                    layer.attn.score_terms(&content, &positions, self.backend)?
                }
                NormPlacement::Post => break,
            };
            out.push(ScoreTerms {
                layer: i,
                window: inputs.window,
                scores: split.0,
                terms: split.1,
            });
            h = layer.forward_t(&h, inputs, own, false, self.backend)?;
        }
        Ok(out)
    }

    /// Runs the batch through every layer with the tokens at `0..t` and no dropout, calling
    /// `visit(layer, its input x, its attention inputs)` before each;
    /// returns the last layer's output (before the final LayerNorm). What the analyses below
    /// read, from one walk.
    fn walk(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        mut visit: impl FnMut(&EncoderLayer, &Tensor, &AttentionInputs) -> Result<()>,
    ) -> Result<Tensor> {
        let (_, t) = self.check_input(input_ids, attention_mask)?;
        let positions = self.starting_at_first(&Positions::range(0, t)?)?;
        let x = self.embed_tokens(input_ids)?;
        let x = (x * self.config.embed_scale.value(self.config.d_model))?;
        let (x, placed) = self.place(x, &positions, attention_mask)?;
        let mut x = self.embedding_extras(x)?;
        let padding = key_padding_bias(attention_mask, x.dtype())?;
        for (i, layer) in self.layers.iter().enumerate() {
            let (inputs, own) = self.layer_inputs(&placed, &padding, i);
            visit(layer, &x, &inputs)?;
            x = layer.forward_t(&x, inputs, own, false, self.backend)?;
        }
        Ok(x)
    }

    /// Every layer's attention scores with and without its rotation, over the tokens at `0..t`:
    /// `c rot(q) rot(k)ᵀ` and `c q kᵀ` (`c` the score scale), each `(b, h, t, t)`, their
    /// difference what the rotation (the position) adds to the content's score. A layer without
    /// a rotation (no positions, or a scheme that does not rotate) gives the same tensor twice.
    pub fn rotation_scores(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
    ) -> Result<Vec<(Tensor, Tensor)>> {
        let mut out = Vec::with_capacity(self.layers.len());
        let backend = self.backend;
        self.walk(input_ids, attention_mask, |layer, x, inputs| {
            let a = layer.attention_input(x, backend)?;
            let (q, k) = layer.attn.queries_keys(&a, backend)?; // (b, h, t, d_head)
            let c = layer.attn.score_scale();
            let plain = (q.matmul(&k.t()?)? * c)?;
            let rotated = match inputs.rotary {
                Some(r) => (r.apply(&q, backend)?.matmul(&r.apply(&k, backend)?.t()?)? * c)?,
                None => plain.clone(),
            };
            out.push((rotated, plain));
            Ok(())
        })?;
        Ok(out)
    }

    /// Every layer's queries and keys before any rotation, `(b, h, t, d_head)` each, with the
    /// tokens at `0..t`: what RoPE's frequency pairs carry in a trained model.
    pub fn queries_keys(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
    ) -> Result<Vec<(Tensor, Tensor)>> {
        let mut out = Vec::with_capacity(self.layers.len());
        let backend = self.backend;
        self.walk(input_ids, attention_mask, |layer, x, _| {
            let a = layer.attention_input(x, backend)?;
            out.push(layer.attn.queries_keys(&a, backend)?);
            Ok(())
        })?;
        Ok(out)
    }

    /// The hidden states at every depth, with the tokens at `0..t` and no dropout: the
    /// embeddings (positions joined, the embedding LayerNorm applied), then each layer's output
    /// (the last before the final LayerNorm): transformers' `hidden_states` (whose last entry
    /// is after the final norm for ModernBERT: the last hidden state).
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `(b, t)`; returns `n_layers + 1` tensors `(b, t, d_model)`
    pub fn hidden_states(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
    ) -> Result<Vec<Tensor>> {
        let mut out = Vec::with_capacity(self.layers.len() + 1);
        let last = self.walk(input_ids, attention_mask, |_, x, _| {
            out.push(x.clone());
            Ok(())
        })?;
        out.push(last);
        Ok(out)
    }

    /// Every layer's attention input (after its LayerNorm under pre-norm), `(b, t, d_model)`,
    /// with the tokens at `0..t`: what q, k, v (and FoX's gates) are computed from.
    pub fn attention_inputs(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
    ) -> Result<Vec<Tensor>> {
        let mut out = Vec::with_capacity(self.layers.len());
        let backend = self.backend;
        self.walk(input_ids, attention_mask, |layer, x, _| {
            out.push(layer.attention_input(x, backend)?);
            Ok(())
        })?;
        Ok(out)
    }
}
