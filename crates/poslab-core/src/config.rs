//! The encoder's configuration: serde (TOML or JSON), validated once at load.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::layers::{LayerPlan, LayerSet, LayerSpec};
use crate::nn::Activation;
use crate::positional::{Placement, PositionalConfig, DEFAULT_BASE as DEFAULT_ROPE_BASE};

/// Where LayerNorm sits around each sub-layer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormPlacement {
    /// `x = x + f(LN(x))`, with a final LayerNorm after the last layer.
    #[default]
    Pre,
    /// `x = LN(x + f(x))`, as in the original Transformer and BERT; no final LayerNorm.
    Post,
}

impl std::fmt::Display for NormPlacement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Pre => "pre",
            Self::Post => "post",
        })
    }
}

/// The dtype the encoder computes its activations in: mixed precision.
///
/// `f32` computes in the parameters' own dtype (f32, or f64 in tests). `bf16` and `f16` cast
/// the embedded input, and each weight as it is used, to the half type, so the matrix multiplies
/// and the activations they make are half precision; the parameters themselves, their gradients
/// and the optimizer state stay in the parameters' dtype. What half precision would spoil stays
/// there too: the sinusoidal and learned tables are added before the cast, RoPE's angles and
/// rotation, the softmax (with its padding bias) and the LayerNorm statistics are computed in
/// f32 from upcast inputs, and the encoder hands its output back in the parameters' dtype, so
/// pooling, the head and the loss are f32. `f16` trains with a dynamic loss scale (its range
/// is too narrow for small gradients); `bf16` needs none.
///
/// Half precision is meant for CUDA. It runs on the CPU too (slowly, through candle's generic
/// kernels, never the fused f32 ones), which is how the tests check it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// 32-bit floats: the fused kernels' dtype.
    #[default]
    F32,
    /// bfloat16 activations.
    Bf16,
    /// IEEE half-precision activations (trained with loss scaling).
    F16,
}

impl Precision {
    /// The names a config accepts, in order.
    pub const NAMES: [&'static str; 3] = ["f32", "bf16", "f16"];

    /// The name a config writes: `f32`, `bf16` or `f16`.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
        }
    }

    /// The dtype activations are computed in, for parameters of dtype `params`.
    pub fn compute_dtype(self, params: candle::DType) -> candle::DType {
        match self {
            Self::F32 => params,
            Self::Bf16 => candle::DType::BF16,
            Self::F16 => candle::DType::F16,
        }
    }

    /// Whether activations are a half type (and so need f32 statistics).
    pub fn is_half(self) -> bool {
        self != Self::F32
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Precision {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(Self::F32),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            "f16" | "float16" | "half" => Ok(Self::F16),
            other => Err(Error::Config(format!(
                "unknown dtype `{other}`: use one of {}",
                Self::NAMES.join(", ")
            ))),
        }
    }
}

/// A scale written as a number or as a function of the width: `"sqrt_d_model"` or
/// `"inv_sqrt_d_model"` (Vaswani et al. scale token embeddings by `sqrt(d_model)` after
/// initialising them at `1/sqrt(d_model)`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scale {
    /// A fixed number.
    Value(f64),
    /// `sqrt(d_model)`, written `"sqrt_d_model"`.
    SqrtDModel,
    /// `1 / sqrt(d_model)`, written `"inv_sqrt_d_model"`.
    InvSqrtDModel,
}

impl Scale {
    /// The number this scale means at width `d_model`.
    pub fn value(self, d_model: usize) -> f64 {
        match self {
            Self::Value(v) => v,
            Self::SqrtDModel => (d_model as f64).sqrt(),
            Self::InvSqrtDModel => 1.0 / (d_model as f64).sqrt(),
        }
    }
}

impl std::fmt::Display for Scale {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Value(v) => write!(f, "{v}"),
            Self::SqrtDModel => f.write_str("sqrt_d_model"),
            Self::InvSqrtDModel => f.write_str("inv_sqrt_d_model"),
        }
    }
}

impl Serialize for Scale {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Self::Value(v) => s.serialize_f64(*v),
            named => s.serialize_str(&named.to_string()),
        }
    }
}

impl<'de> Deserialize<'de> for Scale {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Scale;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a number, \"sqrt_d_model\" or \"inv_sqrt_d_model\"")
            }
            fn visit_f64<E>(self, v: f64) -> std::result::Result<Scale, E> {
                Ok(Scale::Value(v))
            }
            fn visit_i64<E>(self, v: i64) -> std::result::Result<Scale, E> {
                Ok(Scale::Value(v as f64))
            }
            fn visit_u64<E>(self, v: u64) -> std::result::Result<Scale, E> {
                Ok(Scale::Value(v as f64))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<Scale, E> {
                match v {
                    "sqrt_d_model" => Ok(Scale::SqrtDModel),
                    "inv_sqrt_d_model" => Ok(Scale::InvSqrtDModel),
                    other => Err(E::invalid_value(serde::de::Unexpected::Str(other), &self)),
                }
            }
        }
        d.deserialize_any(Visitor)
    }
}

fn default_dropout() -> f64 {
    0.1
}

fn default_embed_scale() -> Scale {
    Scale::Value(1.0)
}

fn default_token_init_std() -> Scale {
    Scale::Value(1.0)
}

fn default_true() -> bool {
    true
}
fn is_true(b: &bool) -> bool {
    *b
}
fn default_layer_norm_eps() -> f64 {
    1e-5
}

/// The shape and positional choice of an encoder.
///
/// ```toml
/// vocab_size = 1000
/// d_model = 64
/// n_heads = 4
/// n_layers = 2
/// ffn_dim = 256
/// activation = "gelu"     # or "relu": the feed-forward nonlinearity
/// max_len = 128
/// norm = "pre"            # or "post"
/// dropout = 0.1           # embeddings and both residual branches
/// attention_dropout = 0.1 # attention weights
/// embed_scale = 1.0       # token embeddings are multiplied by this ("sqrt_d_model" allowed)
/// dtype = "f32"           # activations: f32, bf16 or f16 (mixed precision, for CUDA)
///
/// [positional]
/// kind = "rope"
/// base = 10000.0
/// pairing = "half"
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Number of token ids the embedding table holds.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Attention heads per layer; `d_model` is a multiple of it.
    pub n_heads: usize,
    /// Encoder layers.
    pub n_layers: usize,
    /// Width of the feed-forward hidden layer.
    pub ffn_dim: usize,
    /// The feed-forward nonlinearity: `gelu` (default), `relu` or `geglu` (ModernBERT's gated
    /// GELU: the up projection `2 · ffn_dim` wide).
    #[serde(default, skip_serializing_if = "Activation::is_gelu")]
    pub activation: Activation,
    /// Whether linear layers and LayerNorms have biases (default true; ModernBERT's have none).
    #[serde(default = "default_true", skip_serializing_if = "is_true")]
    pub bias: bool,
    /// Whether layer 0 normalises its attention input (default true). ModernBERT's does not:
    /// its embeddings end in a LayerNorm already. Pre-norm only.
    #[serde(default = "default_true", skip_serializing_if = "is_true")]
    pub first_attn_norm: bool,
    /// Longest sequence the learned table holds; the initial size of fixed tables, which grow
    /// on demand (sinusoids and RoPE extrapolate to any length).
    pub max_len: usize,
    /// Where LayerNorm sits: `pre` (default) or `post`.
    #[serde(default)]
    pub norm: NormPlacement,
    /// Dropout on the embeddings and on both residual branches.
    #[serde(default = "default_dropout")]
    pub dropout: f64,
    /// Dropout on the attention weights.
    #[serde(default = "default_dropout")]
    pub attention_dropout: f64,
    /// Token embeddings are multiplied by this before positions join: a number or
    /// `"sqrt_d_model"`.
    #[serde(default = "default_embed_scale")]
    pub embed_scale: Scale,
    /// Standard deviation of the token embeddings' normal initialisation: a number or
    /// `"inv_sqrt_d_model"`. The default 1.0 with `embed_scale = 1` gives unit-scale entries,
    /// like the sinusoids they join; Vaswani et al. use `inv_sqrt_d_model` with `sqrt_d_model`.
    #[serde(default = "default_token_init_std")]
    pub token_init_std: Scale,
    /// The LayerNorms' epsilon (default 1e-5).
    #[serde(default = "default_layer_norm_eps")]
    pub layer_norm_eps: f64,
    /// The dtype activations are computed in: `f32` (default), `bf16` or `f16` (see
    /// [`Precision`]).
    #[serde(default)]
    pub dtype: Precision,
    /// Randomized positions (Ruoss et al. 2023): each sequence's `t` tokens get `t` distinct
    /// positions drawn uniformly from `[0, N)` and sorted, in training and in testing, so that
    /// training sees the positions long inputs will need. A learned table then has `N` rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub random_positions: Option<usize>,
    /// What the embedding layer adds besides tokens and positions (BERT-family models).
    #[serde(default, skip_serializing_if = "EmbeddingExtras::is_none")]
    pub embeddings: EmbeddingExtras,
    /// The positional scheme and its options: the `[positional]` table, `kind = "..."`.
    pub positional: PositionalConfig,
    /// What each layer does, `[layers]`: a pattern of `global`, `local` (a sliding window),
    /// `none` (no positions) and `local_none` entries, a window and a rotation's base per kind
    /// (see [`crate::layers`]). `None`: every layer global with the scheme.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<LayerPlan>,
    /// A causal (decoder) mask in every layer: query `i` sees no key `j > i` (in token order),
    /// on top of the padding mask. Default false: an encoder, every query sees both sides.
    /// Two schemes switch formula under it, to their published causal forms: `t5` takes T5's
    /// decoder buckets, `fire` the paper's query-normalised inputs.
    #[serde(default, skip_serializing_if = "is_false")]
    pub causal: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Options of the embedding layer that BERT-family models use and any model may: a table of
/// token types (segments) added to every token, and a LayerNorm over the sum. Both off by
/// default.
///
/// ```text
/// x = tok_emb(ids) * embed_scale  (+ positions at the input)  (+ type_emb[0])  -> LN_embed
/// ```
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingExtras {
    /// Rows of `type_emb.weight` (0: none). Every token is of type 0: poslab reads one segment.
    #[serde(default)]
    pub token_types: usize,
    /// A LayerNorm (`embed_norm`, eps `layer_norm_eps`) over the summed embeddings.
    #[serde(default)]
    pub norm: bool,
    /// The position of every sequence's first token: its tokens sit at `first_position + i`.
    /// 0 for BERT; RoBERTa counts from `padding_idx + 1` (transformers'
    /// `create_position_ids_from_input_ids`), so its table's first rows are never read. A
    /// learned table then holds `max_len - first_position` tokens.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub first_position: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl EmbeddingExtras {
    /// Whether neither extra is on (the default).
    pub fn is_none(&self) -> bool {
        *self == Self::default()
    }
}

impl Default for ModelConfig {
    /// A small encoder: vocabulary 1000, width 64, 4 heads, 2 pre-norm layers, GELU
    /// feed-forward of 256, `max_len` 512, dropout 0.1, and the sinusoid added to the tokens
    /// (Vaswani et al.'s scheme): [`ModelShape::default`]. Change what differs with the
    /// `with_*` methods.
    fn default() -> Self {
        let sinusoid = PositionalConfig::SinusoidalAdd(Default::default());
        ModelShape::default().model_config(&Choices::of(&sinusoid), 1000, 512)
    }
}

/// How a sentence label reads the hidden states.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pooling {
    /// The mean over real (unpadded) tokens.
    #[default]
    Mean,
    /// The first token (a `[CLS]` token is prepended to every input).
    First,
    /// The last real token: a decoder's readout, the one token that has seen the whole input
    /// under `causal = true`.
    Last,
}

/// The shape the models of a run share: the `[model]` table of an experiment (every variant's)
/// and of a train run. A model is this shape with its own [`Choices`]
/// ([`ModelShape::model_config`]); every key and default is [`ModelConfig`]'s, plus the head's
/// `pooling`.
///
/// ```toml
/// [model]
/// d_model = 64
/// n_heads = 4
/// n_layers = 2
/// ffn_dim = 256
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelShape {
    /// Width of the residual stream.
    pub d_model: usize,
    /// Attention heads per layer.
    pub n_heads: usize,
    /// Encoder layers.
    pub n_layers: usize,
    /// Width of the feed-forward hidden layer.
    pub ffn_dim: usize,
    /// The feed-forward nonlinearity: `gelu` (default) or `relu`.
    #[serde(default, skip_serializing_if = "Activation::is_gelu")]
    pub activation: Activation,
    /// Where LayerNorm sits: `pre` (default) or `post`.
    #[serde(default)]
    pub norm: NormPlacement,
    /// Dropout on the embeddings and both residual branches.
    #[serde(default = "default_dropout")]
    pub dropout: f64,
    /// Dropout on the attention weights.
    #[serde(default = "default_dropout")]
    pub attention_dropout: f64,
    /// Token embeddings are multiplied by this (see [`ModelConfig::embed_scale`]).
    #[serde(default = "default_embed_scale")]
    pub embed_scale: Scale,
    /// The token embeddings' initial standard deviation (see [`ModelConfig::token_init_std`]).
    #[serde(default = "default_token_init_std")]
    pub token_init_std: Scale,
    /// The LayerNorms' epsilon.
    #[serde(default = "default_layer_norm_eps")]
    pub layer_norm_eps: f64,
    /// Sentence labels read the mean of real tokens (`mean`), a prepended `[CLS]` token
    /// (`first`) or the last real token (`last`, a decoder's readout).
    #[serde(default)]
    pub pooling: Pooling,
    /// Activations in `f32` (default), `bf16` or `f16`: mixed precision, for CUDA.
    #[serde(default)]
    pub dtype: Precision,
    /// A causal (decoder) mask in every layer (see [`ModelConfig::causal`]); a variant may
    /// set its own.
    #[serde(default, skip_serializing_if = "is_false")]
    pub causal: bool,
}

impl Default for ModelShape {
    /// [`ModelConfig::default`]'s shape: width 64, 4 heads, 2 pre-norm layers, GELU
    /// feed-forward of 256, dropout 0.1, mean pooling.
    fn default() -> Self {
        Self {
            d_model: 64,
            n_heads: 4,
            n_layers: 2,
            ffn_dim: 256,
            activation: Activation::default(),
            norm: NormPlacement::default(),
            dropout: default_dropout(),
            attention_dropout: default_dropout(),
            embed_scale: default_embed_scale(),
            token_init_std: default_token_init_std(),
            layer_norm_eps: default_layer_norm_eps(),
            pooling: Pooling::default(),
            dtype: Precision::default(),
            causal: false,
        }
    }
}

/// What one model chooses beyond the [`ModelShape`] it shares: its positions, and where it
/// departs from the shape. An experiment's variant gives all of them
/// (the lab's `runs::VariantSpec::choices`), a train run its positions, table and layers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choices<'a> {
    /// The positional scheme and its options.
    pub positional: &'a PositionalConfig,
    /// Encoder width, if not the shape's.
    pub d_model: Option<usize>,
    /// Token embedding scale, if not the shape's.
    pub embed_scale: Option<Scale>,
    /// Token initialisation's standard deviation, if not the shape's.
    pub token_init_std: Option<Scale>,
    /// Rows of a learned table; default: the data's (see [`ModelShape::model_config`]).
    pub max_len: Option<usize>,
    /// Randomized positions drawn from `[0, N)`.
    pub random_positions: Option<usize>,
    /// What each layer does; `None`: every layer global with the scheme.
    pub layers: Option<&'a LayerPlan>,
    /// A causal mask, if not the shape's.
    pub causal: Option<bool>,
}

impl<'a> Choices<'a> {
    /// `positional` and nothing else: the shape as it is.
    pub fn of(positional: &'a PositionalConfig) -> Self {
        Self {
            positional,
            d_model: None,
            embed_scale: None,
            token_init_std: None,
            max_len: None,
            random_positions: None,
            layers: None,
            causal: None,
        }
    }
}

impl ModelShape {
    /// The model config of this shape with `choices`, for a tokenizer of `vocab_size` ids and
    /// inputs that need a learned table of `table_rows` rows. The table holds `max_len` rows if
    /// chosen, else the larger of `table_rows` and `random_positions`.
    pub fn model_config(
        &self,
        choices: &Choices<'_>,
        vocab_size: usize,
        table_rows: usize,
    ) -> ModelConfig {
        ModelConfig {
            vocab_size,
            d_model: choices.d_model.unwrap_or(self.d_model),
            n_heads: self.n_heads,
            n_layers: self.n_layers,
            ffn_dim: self.ffn_dim,
            activation: self.activation,
            bias: true,
            first_attn_norm: true,
            max_len: choices.max_len.unwrap_or(
                choices
                    .random_positions
                    .unwrap_or(table_rows)
                    .max(table_rows),
            ),
            norm: self.norm,
            dropout: self.dropout,
            attention_dropout: self.attention_dropout,
            embed_scale: choices.embed_scale.unwrap_or(self.embed_scale),
            token_init_std: choices.token_init_std.unwrap_or(self.token_init_std),
            layer_norm_eps: self.layer_norm_eps,
            dtype: self.dtype,
            random_positions: choices.random_positions,
            embeddings: EmbeddingExtras::default(),
            positional: choices.positional.clone(),
            layers: choices.layers.cloned(),
            causal: choices.causal.unwrap_or(self.causal),
        }
    }
}

/// Builders: each returns the config with one setting changed. Nothing is checked until the
/// model is built ([`crate::Encoder::new`] validates, with the fix in its message).
impl ModelConfig {
    /// The positional scheme (with its options).
    pub fn with_positional(mut self, positional: PositionalConfig) -> Self {
        self.positional = positional;
        self
    }

    /// The number of token ids the embedding table holds.
    pub fn with_vocab_size(mut self, vocab_size: usize) -> Self {
        self.vocab_size = vocab_size;
        self
    }

    /// The residual width and the heads it is split into (`d_model` a multiple of `n_heads`).
    pub fn with_width(mut self, d_model: usize, n_heads: usize) -> Self {
        self.d_model = d_model;
        self.n_heads = n_heads;
        self
    }

    /// What each layer does: a pattern of global, local and position-free layers (see
    /// [`crate::layers`]).
    pub fn with_layer_plan(mut self, plan: LayerPlan) -> Self {
        self.layers = Some(plan);
        self
    }

    /// The number of encoder layers.
    pub fn with_layers(mut self, n_layers: usize) -> Self {
        self.n_layers = n_layers;
        self
    }

    /// The feed-forward's hidden width and nonlinearity.
    pub fn with_ffn(mut self, ffn_dim: usize, activation: Activation) -> Self {
        self.ffn_dim = ffn_dim;
        self.activation = activation;
        self
    }

    /// The longest sequence the learned table holds, and fixed tables' initial size.
    pub fn with_max_len(mut self, max_len: usize) -> Self {
        self.max_len = max_len;
        self
    }

    /// Where LayerNorm sits around each sub-layer.
    pub fn with_norm(mut self, norm: NormPlacement) -> Self {
        self.norm = norm;
        self
    }

    /// Dropout on the embeddings and residual branches, and on the attention weights.
    pub fn with_dropout(mut self, dropout: f64, attention_dropout: f64) -> Self {
        self.dropout = dropout;
        self.attention_dropout = attention_dropout;
        self
    }

    /// Randomized positions drawn from `[0, range)` (Ruoss et al. 2023).
    pub fn with_random_positions(mut self, range: usize) -> Self {
        self.random_positions = Some(range);
        self
    }

    /// A causal (decoder) mask in every layer, or none (an encoder, the default).
    pub fn with_causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }
}

impl ModelConfig {
    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads.max(1)
    }

    /// Width of the token embedding table (narrower than `d_model` for concatenation).
    pub fn token_dim(&self) -> usize {
        self.positional.token_dim(self.d_model)
    }

    /// The sizes the positional scheme is built for.
    pub fn scheme_shape(&self) -> crate::positional::SchemeShape {
        crate::positional::SchemeShape {
            d_model: self.d_model,
            n_heads: self.n_heads,
            n_layers: self.n_layers,
            max_len: self.max_len,
            causal: self.causal,
            layers: self
                .layers
                .as_ref()
                .map_or(LayerSet::ALL, LayerPlan::positional_layers),
        }
    }

    /// What layer `i` does: positions or not, a window, the local base.
    pub fn layer_spec(&self, i: usize) -> LayerSpec {
        let spec = self
            .layers
            .as_ref()
            .map_or(LayerSpec::GLOBAL, |plan| LayerSpec::of(plan, i));
        LayerSpec {
            causal: self.causal,
            ..spec
        }
    }

    /// The sizes the limits are checked on, wherever the model computes: its attention tables
    /// counted as the compositions hold them (see [`ModelConfig::sizes_on`]).
    pub fn sizes(&self) -> crate::limits::Sizes {
        self.sizes_with(false)
    }

    /// The sizes the limits are checked on, for activations computed where `compute` says:
    /// where poslab's fused CPU kernels compute the layers ([`crate::nn::Backend::fused_on`]), a scheme
    /// whose scores they compute holds about one attention table a layer, not its
    /// composition's many ([`crate::positional::ScoreMemory::score_tensors`]).
    pub fn sizes_on(&self, compute: crate::nn::Compute<'_>) -> crate::limits::Sizes {
        let dtype = self.dtype.compute_dtype(candle::DType::F32);
        self.sizes_with(compute.backend.fused_on(compute.device, dtype))
    }

    fn sizes_with(&self, fused: bool) -> crate::limits::Sizes {
        crate::limits::Sizes {
            d_model: self.d_model,
            ffn_dim: self.ffn_dim,
            n_heads: self.n_heads,
            n_layers: self.n_layers,
            vocab_size: self.vocab_size,
            max_len: self.max_len,
            score_tensors: [false, true].map(|t| self.positional.scheme().score_tensors(t, fused)),
        }
    }

    /// The number of trainable parameters (the encoder, without a head), counted without
    /// overflow: the scheme's own, and those of the tokens and layers around it.
    pub fn param_count(&self) -> u128 {
        let (d, f, l) = (
            self.d_model as u128,
            self.ffn_dim as u128,
            self.n_layers as u128,
        );
        let tokens = self.vocab_size as u128 * self.token_dim() as u128;
        let positions = self.positional.param_count(&self.scheme_shape());
        let b = u128::from(self.bias);
        let up = f * self.activation.up_factor() as u128;
        let norm = d * (1 + b);
        // q, k, v, o (q's, v's and o's biases, when any); two LayerNorms; the feed-forward; a
        // final LayerNorm; less layer 0's attention norm where it has none.
        let layer = 4 * d * d + 3 * d * b + 2 * norm + d * up + up * b + f * d + d * b;
        let first = if self.first_attn_norm { 0 } else { norm };
        // The key's bias, in the layers where the scheme reads q and k (elsewhere the softmax
        // cancels it and the layer has none: `encoder::layer`).
        let keyed = (0..self.n_layers)
            .filter(|&i| self.positional.reads_keys() && self.layer_spec(i).positions)
            .count() as u128;
        tokens + positions + l * layer - first + norm + keyed * d * b
    }

    /// Checks every field; the message names the field, the value and a fix. How large the
    /// model may be is [`ModelConfig::check_limits`]'s question (a run's, a predictor's or a
    /// benchmark's [`Limits`](crate::limits::Limits)); building it ([`crate::Encoder::new`])
    /// refuses weights larger than the machine's memory.
    pub fn validate(&self) -> Result<()> {
        self.check().map_err(Error::Config)
    }

    /// Refuses a model with more parameters than `limits` allow; the message gives the count
    /// and the fields that make it.
    pub fn check_limits(&self, limits: &crate::limits::Limits) -> Result<()> {
        limits
            .check_params(self.param_count(), &self.sizes())
            .map_err(Error::Config)
    }

    fn check(&self) -> std::result::Result<(), String> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("d_model", self.d_model),
            ("n_heads", self.n_heads),
            ("ffn_dim", self.ffn_dim),
            ("max_len", self.max_len),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(format!("{name} = 0, but it must be at least 1"));
            }
        }
        if self.n_layers == 0 {
            return Err("n_layers = 0: an encoder needs at least one layer".into());
        }
        if !self.d_model.is_multiple_of(self.n_heads) {
            let divisors: Vec<String> = (1..=self.d_model.min(64))
                .filter(|h| self.d_model.is_multiple_of(*h))
                .map(|h| h.to_string())
                .collect();
            return Err(format!(
                "n_heads = {} does not divide d_model = {}: every head must be equally wide; \
                 choose n_heads from {{{}}} or change d_model",
                self.n_heads,
                self.d_model,
                divisors.join(", ")
            ));
        }
        for (name, p) in [
            ("dropout", self.dropout),
            ("attention_dropout", self.attention_dropout),
        ] {
            if !(0.0..1.0).contains(&p) {
                return Err(format!(
                    "{name} = {p} must be in [0, 1): it is the probability of zeroing a unit"
                ));
            }
        }
        let embed_scale = self.embed_scale.value(self.d_model);
        if !embed_scale.is_finite() || embed_scale <= 0.0 {
            return Err(format!(
                "embed_scale = {} must be a finite, positive number",
                self.embed_scale
            ));
        }
        let token_init_std = self.token_init_std.value(self.d_model);
        if !token_init_std.is_finite() || token_init_std <= 0.0 {
            return Err(format!(
                "token_init_std = {} must be a finite, positive number",
                self.token_init_std
            ));
        }
        if !self.layer_norm_eps.is_finite() || self.layer_norm_eps <= 0.0 {
            return Err(format!(
                "layer_norm_eps = {} must be a finite, positive number (1e-5 is usual)",
                self.layer_norm_eps
            ));
        }
        if let Some(n) = self.random_positions {
            self.positional.scheme().check_random_positions(n)?;
            if n == 0 || n > crate::positional::MAX_POSITION {
                return Err(format!(
                    "random_positions = {n} must be between 1 and {}: it is the range [0, N) \
                     positions are drawn from (Ruoss et al. use 2048)",
                    crate::positional::MAX_POSITION
                ));
            }
            if self.positional.has_learned_table() && self.max_len < n {
                return Err(format!(
                    "random_positions = {n} draws positions up to {}, but the learned table has \
                     max_len = {} rows: set max_len to at least {n} (or leave it unset)",
                    n - 1,
                    self.max_len
                ));
            }
        }
        if self.embeddings.first_position >= self.max_len {
            return Err(format!(
                "embeddings.first_position = {} leaves no row of the max_len = {} table: it \
                 must be below max_len (RoBERTa's is padding_idx + 1 = 2)",
                self.embeddings.first_position, self.max_len
            ));
        }
        self.positional.validate(&self.scheme_shape())?;
        if let Some(plan) = &self.layers {
            self.check_layers(plan)?;
        }
        if !self.first_attn_norm && self.norm != NormPlacement::Pre {
            return Err(
                "first_attn_norm = false needs norm = \"pre\": a post-norm layer's \
                        attention norm is its output norm"
                    .into(),
            );
        }
        let widest = self.d_model.max(self.head_dim());
        if (self.max_len as u128) * (widest as u128) > crate::positional::MAX_TABLE_VALUES as u128 {
            return Err(format!(
                "max_len = {} needs position tables of {} x {widest} values (d_model = {}), \
                 more than {}: lower max_len (it is the longest input a learned table holds, \
                 and the rows a fixed table starts with) or d_model",
                self.max_len,
                self.max_len,
                self.d_model,
                crate::positional::MAX_TABLE_VALUES
            ));
        }
        Ok(())
    }

    /// Checks `[layers]` against the scheme: position-free layers need a scheme that acts inside
    /// attention, bases a rotation that has one.
    fn check_layers(&self, plan: &LayerPlan) -> std::result::Result<(), String> {
        plan.check()?;
        let kind = self.positional.name();
        if let Some(i) = plan.first_without_positions(self.n_layers) {
            if self.positional.placement() == Placement::Input {
                return Err(format!(
                    "[layers] layer {i} is `{}` (no positions), but `{kind}` acts on the input: \
                     its positions reach every layer through the residual stream and cannot be \
                     turned off in one. Use a scheme inside attention (rope, prope, alibi, t5, \
                     kerple, fire, untied, fox) or make every entry global or local",
                    plan.kind(i).name()
                ));
            }
        }
        let shape = self.scheme_shape();
        if shape.layers.count(self.n_layers) == 0 && self.positional.param_count(&shape) > 0 {
            return Err(format!(
                "[layers] no layer has positions, so `{kind}`'s parameters would never be used: \
                 give some layer a `global` or `local` entry, or use kind = \"none\" for an \
                 encoder without positions"
            ));
        }
        if let Some(bases) = &plan.rope_base {
            let base = bases.global.or(bases.local).unwrap_or(DEFAULT_ROPE_BASE);
            match self.positional.with_base(base) {
                None => {
                    return Err(format!(
                        "[layers] rope_base is set, but `{kind}` has no rotation base: it applies \
                         to rope and prope"
                    ))
                }
                Some(rebased) => rebased.validate(&self.scheme_shape())?,
            }
        }
        Ok(())
    }

    /// The scheme of layer kind `local` (`true`) or `global`, with its `[layers] rope_base`.
    pub fn layer_positional(&self, local: bool) -> PositionalConfig {
        let base = self
            .layers
            .as_ref()
            .and_then(|p| p.rope_base)
            .and_then(|b| match local {
                true => b.local,
                false => b.global,
            });
        base.and_then(|b| self.positional.with_base(b))
            .unwrap_or_else(|| self.positional.clone())
    }

    /// Parses and validates a TOML document.
    pub fn from_toml_str(text: &str) -> Result<Self> {
        let config: Self = crate::io::parse_toml(text)?;
        config.validate()?;
        Ok(config)
    }

    /// Parses and validates a JSON document.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let config: Self = serde_json::from_str(text).map_err(|e| Error::ConfigParse {
            path: "<json>".into(),
            message: e.to_string(),
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Reads a `.toml` or `.json` file (by extension), then validates it.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = crate::io::read_text_bounded(path, crate::io::MAX_CONFIG_BYTES, "config")?;
        let parsed = match path.extension().and_then(|e| e.to_str()) {
            Some("json") => Self::from_json_str(&text),
            Some("toml") => Self::from_toml_str(&text),
            other => {
                return Err(Error::ConfigParse {
                    path: path.into(),
                    message: format!("unknown extension {other:?}: name the file *.toml or *.json"),
                })
            }
        };
        parsed.map_err(|e| e.in_file(path))
    }

    /// The config as pretty JSON, the form saved models keep.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a model config always serializes")
    }

    /// The config as TOML, the form `ModelConfig::load` reads.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("a model config always serializes")
    }
}

#[cfg(test)]
mod tests {
    use super::ModelConfig;

    #[test]
    fn counts_match_a_built_model() {
        use candle::{DType, Device};
        let text = "vocab_size = 50\nd_model = 16\nn_heads = 2\nn_layers = 2\nffn_dim = 24\nmax_len = 12\n[positional]\n";
        for positional in [
            "kind = \"learned\"",
            "kind = \"t5\"",
            "kind = \"kerple\"",
            "kind = \"fire\"\nwidth = 5",
            "kind = \"fox\"",
            "kind = \"pope\"",
            "kind = \"cope\"\nnpos = 7",
            "kind = \"path\"",
            "kind = \"path\"\nconv_size = 0",
            "kind = \"prope\"",
            "kind = \"untied\"",
            "kind = \"sinusoidal_concat\"\npos_dim = 4\nproject = true",
            "kind = \"sinusoidal_concat\"\npos_dim = 4",
        ] {
            let config = ModelConfig::from_toml_str(&format!("{text}{positional}")).unwrap();
            let store = crate::ParamStore::new(0);
            crate::Encoder::new(&config, store.var_builder(DType::F32, &Device::Cpu)).unwrap();
            assert_eq!(
                config.param_count(),
                store.num_params() as u128,
                "{positional}"
            );
        }
    }
}
