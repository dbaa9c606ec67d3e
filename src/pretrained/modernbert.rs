//! ModernBERT (Warner et al. 2024, "Smarter, Better, Faster, Longer"), as options of poslab's
//! own encoder: no position table; RoPE with half pairing in every layer, its base per kind of
//! layer (`[layers] rope_base`); a global layer every `global_attn_every_n_layers`, sliding
//! windows of `local_attention` in the others (keys `|i - j| <= local_attention / 2`); pre-norm
//! with no attention norm in layer 0; no biases; a fused `Wqkv`; a GeGLU feed-forward; a final
//! norm; the masked-LM head `head.dense → GELU → head.norm → decoder` (tied) `+ decoder.bias`.
//!
//! Two forms of `config.json` are read: transformers 5's (`layer_types`, `rope_parameters`)
//! and the Hub checkpoints' (`global_attn_every_n_layers`, `global_rope_theta`,
//! `local_rope_theta`, `local_attention`). What poslab cannot run (another `rope_type`, biases,
//! another activation, an odd or zero window) is refused by key.

use std::collections::HashMap;

use serde::Deserialize;

use super::HfConfig;
use crate::config::{EmbeddingExtras, ModelConfig, NormPlacement, Precision, Scale};
use crate::error::{Error, Result};
use crate::layers::{LayerKind, LayerPlan, RopeBases};
use crate::nn::Activation;
use crate::positional::{PositionalConfig, RopeOptions, RopePairing};

/// The keys of a ModernBERT `config.json` beyond BERT's (absent in other families).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ModernBertKeys {
    /// transformers 5: `full_attention` or `sliding_attention` per layer.
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    /// transformers 5: per layer type, `{ rope_theta, rope_type }`.
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    /// Layer `i` is global when `i % n == 0`.
    #[serde(default)]
    pub global_attn_every_n_layers: Option<usize>,
    /// The Hub checkpoints' base of global layers.
    #[serde(default)]
    pub global_rope_theta: Option<f64>,
    /// The Hub checkpoints' base of local layers.
    #[serde(default)]
    pub local_rope_theta: Option<f64>,
    /// The sliding window's width.
    #[serde(default)]
    pub local_attention: Option<usize>,
    /// Biases of the LayerNorms.
    #[serde(default)]
    pub norm_bias: Option<bool>,
    /// Biases of the attention projections.
    #[serde(default)]
    pub attention_bias: Option<bool>,
    /// Biases of the feed-forward.
    #[serde(default)]
    pub mlp_bias: Option<bool>,
    /// The bias of the masked-LM head's dense layer.
    #[serde(default)]
    pub classifier_bias: Option<bool>,
    /// The masked-LM head's activation.
    #[serde(default)]
    pub classifier_activation: Option<String>,
    /// Dropout on the embeddings.
    #[serde(default)]
    pub embedding_dropout: Option<f64>,
    /// Dropout on the feed-forward's output.
    #[serde(default)]
    pub mlp_dropout: Option<f64>,
}

/// The defaults of transformers' `ModernBertConfig` for keys a file leaves out.
const GLOBAL_BASE: f64 = 160_000.0;
const LOCAL_BASE: f64 = 10_000.0;
const EVERY_N: usize = 3;
const WINDOW: usize = 128;

fn refuse(message: String) -> Error {
    Error::Config(format!("config.json (modernbert): {message}"))
}

/// Each layer's kind: from `layer_types`, else from `global_attn_every_n_layers`.
fn pattern(hf: &HfConfig) -> Result<Vec<LayerKind>> {
    let keys = &hf.modernbert;
    if let Some(types) = &keys.layer_types {
        if types.len() != hf.num_hidden_layers {
            return Err(refuse(format!(
                "layer_types has {} entries for num_hidden_layers = {}",
                types.len(),
                hf.num_hidden_layers
            )));
        }
        return types
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                "full_attention" => Ok(LayerKind::Global),
                "sliding_attention" => Ok(LayerKind::Local),
                other => Err(refuse(format!(
                    "layer_types[{i}] = `{other}`: poslab runs full_attention and \
                     sliding_attention layers"
                ))),
            })
            .collect();
    }
    let n = keys.global_attn_every_n_layers.unwrap_or(EVERY_N);
    if n == 0 {
        return Err(refuse(
            "global_attn_every_n_layers = 0: it must be at least 1".into(),
        ));
    }
    Ok((0..hf.num_hidden_layers)
        .map(|i| match i % n {
            0 => LayerKind::Global,
            _ => LayerKind::Local,
        })
        .collect())
}

/// The base of `kind` layers (`full_attention`, `sliding_attention`): from `rope_parameters`,
/// else `global_rope_theta` / `local_rope_theta`, else transformers' defaults.
///
/// Each kind falls back to its own default, as transformers does (v4 and v5 alike): a file that
/// gives the global layers' base and not the local layers' leaves the local ones at 10000.
fn base(hf: &HfConfig, kind: &str) -> Result<f64> {
    let keys = &hf.modernbert;
    if let Some(params) = &keys.rope_parameters {
        // Per kind of layer (transformers 5), or one flat entry, which is the global layers'.
        let (entry, key) = match params.get(kind) {
            Some(entry) => (Some(entry), format!("rope_parameters.{kind}")),
            None if kind == "full_attention" && params.get("rope_theta").is_some() => {
                (Some(params), "rope_parameters".to_string())
            }
            None => (None, String::new()),
        };
        if let Some(entry) = entry {
            match entry.get("rope_type") {
                None => {}
                Some(serde_json::Value::String(t)) if t == "default" => {}
                Some(serde_json::Value::String(t)) => {
                    return Err(refuse(format!(
                        "{key}.rope_type = `{t}`: poslab runs `default` RoPE (no scaling) for \
                         ModernBERT"
                    )))
                }
                Some(t) => {
                    return Err(refuse(format!(
                        "{key}.rope_type = {t}: it must be a string, `default`"
                    )))
                }
            }
            match entry.get("rope_theta") {
                None => {}
                Some(t) => match t.as_f64() {
                    Some(theta) if theta.is_finite() && theta > 1.0 => return Ok(theta),
                    _ => {
                        return Err(refuse(format!(
                            "{key}.rope_theta = {t}: it must be a number above 1 (the RoPE \
                             base), not a string or another type"
                        )))
                    }
                },
            }
        }
    }
    let (value, key, default) = match kind {
        "full_attention" => (keys.global_rope_theta, "global_rope_theta", GLOBAL_BASE),
        _ => (keys.local_rope_theta, "local_rope_theta", LOCAL_BASE),
    };
    match value {
        Some(theta) if !(theta.is_finite() && theta > 1.0) => Err(refuse(format!(
            "{key} = {theta}: it must be a number above 1 (the RoPE base)"
        ))),
        Some(theta) => Ok(theta),
        None => Ok(default),
    }
}

/// poslab's config of a ModernBERT.
pub fn model_config(hf: &HfConfig) -> Result<ModelConfig> {
    let keys = &hf.modernbert;
    for (key, value) in [
        ("norm_bias", keys.norm_bias),
        ("attention_bias", keys.attention_bias),
        ("mlp_bias", keys.mlp_bias),
        ("classifier_bias", keys.classifier_bias),
    ] {
        if value == Some(true) {
            return Err(refuse(format!(
                "{key} = true: poslab's ModernBERT has no biases (as the released checkpoints)"
            )));
        }
    }
    for (key, value) in [
        ("hidden_activation", Some(hf.hidden_act.as_str())),
        (
            "classifier_activation",
            keys.classifier_activation.as_deref(),
        ),
    ] {
        if let Some(v) = value.filter(|v| *v != "gelu") {
            return Err(refuse(format!(
                "{key} = `{v}`: poslab computes ModernBERT's exact `gelu`"
            )));
        }
    }
    if !hf.tie_word_embeddings {
        return Err(refuse(
            "tie_word_embeddings = false: poslab's masked-LM decoder is tied to the token \
             embeddings"
                .into(),
        ));
    }
    let pattern = pattern(hf)?;
    let local = pattern.contains(&LayerKind::Local);
    let window = keys.local_attention.unwrap_or(WINDOW);
    if local && (window == 0 || window % 2 == 1) {
        return Err(refuse(format!(
            "local_attention = {window}: it must be even and positive (a sliding layer sees keys \
             up to local_attention / 2 away on either side)"
        )));
    }
    if let Some(pad) = hf.pad_token_id.filter(|&p| p >= hf.vocab_size) {
        return Err(refuse(format!(
            "pad_token_id = {pad} is not an id of the vocabulary (vocab_size = {})",
            hf.vocab_size
        )));
    }
    let global = base(hf, "full_attention")?;
    let config = ModelConfig {
        vocab_size: hf.vocab_size,
        d_model: hf.hidden_size,
        n_heads: hf.num_attention_heads,
        n_layers: hf.num_hidden_layers,
        ffn_dim: hf.intermediate_size,
        activation: Activation::Geglu,
        bias: false,
        first_attn_norm: false,
        max_len: hf.max_position_embeddings,
        norm: NormPlacement::Pre,
        dropout: keys.mlp_dropout.unwrap_or(0.0),
        attention_dropout: hf.attention_probs_dropout_prob,
        embed_scale: Scale::Value(1.0),
        token_init_std: Scale::Value(0.02),
        layer_norm_eps: hf.layer_norm_eps,
        dtype: Precision::default(),
        random_positions: None,
        embeddings: EmbeddingExtras {
            token_types: 0,
            norm: true,
            first_position: 0,
        },
        positional: PositionalConfig::Rope(RopeOptions {
            base: global,
            pairing: RopePairing::Half,
            ..RopeOptions::default()
        }),
        layers: Some(LayerPlan {
            pattern,
            local_window: local.then_some(window),
            rope_base: Some(RopeBases {
                global: Some(global),
                local: local.then(|| base(hf, "sliding_attention")).transpose()?,
            }),
        }),
        causal: false,
    };
    config.validate()?;
    Ok(config)
}

/// Where a poslab tensor comes from: a tensor of the file, or a block of its rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Source {
    /// The tensor's name in the file.
    pub name: String,
    /// `(first row, rows)` of it, for the three parts of a fused `Wqkv`.
    pub rows: Option<(usize, usize)>,
}

/// ModernBERT's tensors under poslab's names, and whether the file has the masked-LM head.
/// Every tensor of the file is mapped or an error naming it.
pub fn rename(
    tensors: &HashMap<String, Vec<usize>>,
    d_model: usize,
    n_layers: usize,
) -> std::result::Result<(HashMap<String, Source>, bool), String> {
    let plain = |name: &str| Source {
        name: name.into(),
        rows: None,
    };
    let mut out = HashMap::new();
    let mut problems = Vec::new();
    for name in tensors.keys() {
        let inner = name.strip_prefix("model.").unwrap_or(name);
        let mut mapped: Vec<(String, Source)> = match inner {
            "embeddings.tok_embeddings.weight" => vec![("tok_emb.weight".into(), plain(name))],
            "embeddings.norm.weight" => vec![("embed_norm.weight".into(), plain(name))],
            "final_norm.weight" => vec![("final_norm.weight".into(), plain(name))],
            "head.dense.weight" => vec![("mlm.dense.weight".into(), plain(name))],
            "head.norm.weight" => vec![("mlm.norm.weight".into(), plain(name))],
            "decoder.bias" => vec![("mlm.bias".into(), plain(name))],
            _ => Vec::new(),
        };
        if let Some((i, rest)) = inner
            .strip_prefix("layers.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(i, rest)| Some((i.parse::<usize>().ok()?, rest)))
        {
            let ours = |s: &str| format!("layers.{i}.{s}");
            mapped = match rest {
                "attn.Wqkv.weight" => ["q", "k", "v"]
                    .iter()
                    .enumerate()
                    .map(|(j, p)| {
                        (
                            ours(&format!("attn.{p}.weight")),
                            Source {
                                name: name.clone(),
                                rows: Some((j * d_model, d_model)),
                            },
                        )
                    })
                    .collect(),
                "attn.Wo.weight" => vec![(ours("attn.o.weight"), plain(name))],
                "attn_norm.weight" => vec![(ours("attn_norm.weight"), plain(name))],
                "mlp_norm.weight" => vec![(ours("ffn_norm.weight"), plain(name))],
                "mlp.Wi.weight" => vec![(ours("ffn.up.weight"), plain(name))],
                "mlp.Wo.weight" => vec![(ours("ffn.down.weight"), plain(name))],
                _ => Vec::new(),
            };
        }
        if name == "decoder.weight" {
            // The decoder is tied to the token embeddings (a file may store the copy, which
            // must then have the embeddings' shape).
            let embeddings = tensors
                .get("model.embeddings.tok_embeddings.weight")
                .or_else(|| tensors.get("embeddings.tok_embeddings.weight"));
            if let Some(e) = embeddings.filter(|e| **e != tensors[name]) {
                problems.push(format!(
                    "tensor `{name}` has shape {:?}, but the decoder is tied to the token \
                     embeddings, {e:?}",
                    tensors[name]
                ));
            }
            continue;
        }
        if inner.ends_with("attn.Wqkv.weight") && tensors[name] != [3 * d_model, d_model] {
            problems.push(format!(
                "tensor `{name}` has shape {:?}, but the config describes {:?} (q, k and v \
                 stacked: 3 x hidden_size rows of hidden_size)",
                tensors[name],
                [3 * d_model, d_model]
            ));
            continue;
        }
        if mapped.is_empty() {
            problems.push(format!(
                "unexpected tensor `{name}` {:?}: not part of a ModernBERT encoder or its \
                 masked-LM head (biases are not supported)",
                tensors[name]
            ));
        }
        out.extend(mapped);
    }
    // Every tensor the config needs is there: a missing one is named, not only counted (the
    // first layer has no attention norm: the embeddings' norm serves it).
    let mut needed: Vec<(String, String)> = [
        ("embeddings.tok_embeddings.weight", "tok_emb.weight"),
        ("embeddings.norm.weight", "embed_norm.weight"),
        ("final_norm.weight", "final_norm.weight"),
    ]
    .map(|(theirs, ours)| (theirs.to_string(), ours.to_string()))
    .to_vec();
    for i in 0..n_layers {
        let per_layer = [
            ("attn.Wqkv.weight", "attn.q.weight"),
            ("attn.Wo.weight", "attn.o.weight"),
            ("attn_norm.weight", "attn_norm.weight"),
            ("mlp_norm.weight", "ffn_norm.weight"),
            ("mlp.Wi.weight", "ffn.up.weight"),
            ("mlp.Wo.weight", "ffn.down.weight"),
        ];
        needed.extend(
            per_layer
                .iter()
                .filter(|(theirs, _)| i > 0 || *theirs != "attn_norm.weight")
                .map(|(theirs, ours)| {
                    (format!("layers.{i}.{theirs}"), format!("layers.{i}.{ours}"))
                }),
        );
    }
    for (theirs, ours) in needed {
        if !out.contains_key(&ours) {
            problems.push(format!(
                "lacks tensor `model.{theirs}`, which the config's {n_layers} layers need"
            ));
        }
    }
    if !problems.is_empty() {
        problems.sort();
        return Err(format!(
            "does not match a modernbert checkpoint:\n  - {}",
            problems.join("\n  - ")
        ));
    }
    let has_mlm = out.contains_key("mlm.bias");
    Ok((out, has_mlm))
}
