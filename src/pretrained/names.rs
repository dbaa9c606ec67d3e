//! Hugging Face parameter names to poslab's, in one place.
//!
//! A BERT-family checkpoint names its encoder `[bert. | roberta.]embeddings...` and
//! `...encoder.layer.{i}...` (DistilBERT: `distilbert.embeddings...` and
//! `distilbert.transformer.layer.{i}...`); poslab's encoder (see [`crate::encoder`]) names the
//! same tensors as below. Every tensor of a file is mapped, deliberately ignored (with the reason), or an
//! error.

/// The embedding layer: Hugging Face name (after the model prefix) → poslab name.
pub const EMBEDDINGS: &[(&str, &str)] = &[
    ("embeddings.word_embeddings.weight", "tok_emb.weight"),
    ("embeddings.position_embeddings.weight", "pos_emb.weight"),
    ("embeddings.token_type_embeddings.weight", "type_emb.weight"),
    ("embeddings.LayerNorm.weight", "embed_norm.weight"),
    ("embeddings.LayerNorm.bias", "embed_norm.bias"),
];

/// One layer, `encoder.layer.{i}.` → `layers.{i}.`. The layer is post-norm: `attn_norm`
/// follows attention, `ffn_norm` the feed-forward block.
pub const LAYER: &[(&str, &str)] = &[
    ("attention.self.query.weight", "attn.q.weight"),
    ("attention.self.query.bias", "attn.q.bias"),
    ("attention.self.key.weight", "attn.k.weight"),
    ("attention.self.value.weight", "attn.v.weight"),
    ("attention.self.value.bias", "attn.v.bias"),
    ("attention.output.dense.weight", "attn.o.weight"),
    ("attention.output.dense.bias", "attn.o.bias"),
    ("attention.output.LayerNorm.weight", "attn_norm.weight"),
    ("attention.output.LayerNorm.bias", "attn_norm.bias"),
    ("intermediate.dense.weight", "ffn.up.weight"),
    ("intermediate.dense.bias", "ffn.up.bias"),
    ("output.dense.weight", "ffn.down.weight"),
    ("output.dense.bias", "ffn.down.bias"),
    ("output.LayerNorm.weight", "ffn_norm.weight"),
    ("output.LayerNorm.bias", "ffn_norm.bias"),
];

/// DistilBERT's embedding layer (no token types).
pub const DISTILBERT_EMBEDDINGS: &[(&str, &str)] = &[
    ("embeddings.word_embeddings.weight", "tok_emb.weight"),
    ("embeddings.position_embeddings.weight", "pos_emb.weight"),
    ("embeddings.LayerNorm.weight", "embed_norm.weight"),
    ("embeddings.LayerNorm.bias", "embed_norm.bias"),
];

/// One DistilBERT layer, `transformer.layer.{i}.` → `layers.{i}.`, post-norm as BERT's.
pub const DISTILBERT_LAYER: &[(&str, &str)] = &[
    ("attention.q_lin.weight", "attn.q.weight"),
    ("attention.q_lin.bias", "attn.q.bias"),
    ("attention.k_lin.weight", "attn.k.weight"),
    ("attention.v_lin.weight", "attn.v.weight"),
    ("attention.v_lin.bias", "attn.v.bias"),
    ("attention.out_lin.weight", "attn.o.weight"),
    ("attention.out_lin.bias", "attn.o.bias"),
    ("sa_layer_norm.weight", "attn_norm.weight"),
    ("sa_layer_norm.bias", "attn_norm.bias"),
    ("ffn.lin1.weight", "ffn.up.weight"),
    ("ffn.lin1.bias", "ffn.up.bias"),
    ("ffn.lin2.weight", "ffn.down.weight"),
    ("ffn.lin2.bias", "ffn.down.bias"),
    ("output_layer_norm.weight", "ffn_norm.weight"),
    ("output_layer_norm.bias", "ffn_norm.bias"),
];

/// The masked-LM head of `BertForMaskedLM` (full names): dense → GELU → LayerNorm → the word
/// embeddings (tied decoder) + bias.
pub const BERT_MLM: &[(&str, &str)] = &[
    ("cls.predictions.transform.dense.weight", "mlm.dense.weight"),
    ("cls.predictions.transform.dense.bias", "mlm.dense.bias"),
    (
        "cls.predictions.transform.LayerNorm.weight",
        "mlm.norm.weight",
    ),
    ("cls.predictions.transform.LayerNorm.bias", "mlm.norm.bias"),
    ("cls.predictions.bias", "mlm.bias"),
];

/// The masked-LM head of `RobertaForMaskedLM`, the same structure under `lm_head.`.
pub const ROBERTA_MLM: &[(&str, &str)] = &[
    ("lm_head.dense.weight", "mlm.dense.weight"),
    ("lm_head.dense.bias", "mlm.dense.bias"),
    ("lm_head.layer_norm.weight", "mlm.norm.weight"),
    ("lm_head.layer_norm.bias", "mlm.norm.bias"),
    ("lm_head.bias", "mlm.bias"),
];

/// The masked-LM head of `DistilBertForMaskedLM`: the same structure (its `vocab_projector`
/// tied to the word embeddings).
pub const DISTILBERT_MLM: &[(&str, &str)] = &[
    ("vocab_transform.weight", "mlm.dense.weight"),
    ("vocab_transform.bias", "mlm.dense.bias"),
    ("vocab_layer_norm.weight", "mlm.norm.weight"),
    ("vocab_layer_norm.bias", "mlm.norm.bias"),
    ("vocab_projector.bias", "mlm.bias"),
];

/// Tensors read and dropped, and why (suffixes of full names).
pub const IGNORED: &[(&str, &str)] = &[
    (
        "attention.self.key.bias",
        "adds q_i . b_k to every score of query i alike, which softmax cancels",
    ),
    (
        "attention.k_lin.bias",
        "DistilBERT's key bias, cancelled by softmax as above",
    ),
    (
        "pooler.dense.weight",
        "the pooler (tanh over [CLS]) is not part of the hidden states; poslab pools itself",
    ),
    ("pooler.dense.bias", "the pooler, as above"),
    (
        "embeddings.position_ids",
        "a buffer of 0..max_len some checkpoints store",
    ),
    (
        "predictions.decoder.bias",
        "a second copy of the masked-LM bias",
    ),
    (
        "lm_head.decoder.bias",
        "a second copy of the masked-LM bias",
    ),
    (
        "predictions.decoder.weight",
        "the decoder is tied to the word embeddings",
    ),
    (
        "lm_head.decoder.weight",
        "the decoder is tied to the word embeddings",
    ),
    (
        "vocab_projector.weight",
        "the decoder is tied to the word embeddings",
    ),
];
