//! Pretrained BERT-family encoders from a Hugging Face folder (`config.json`,
//! `model.safetensors`, `tokenizer.json`), run by poslab's own [`Encoder`].
//!
//! A BERT is poslab's encoder with a learned position table, post-norm layers, exact GELU, and
//! the two embedding extras of [`EmbeddingExtras`] (token types and an embedding LayerNorm);
//! the names map as [`names`] lists. RoBERTa differs only in its positions, which start at
//! `padding_idx + 1` (transformers'
//! `create_position_ids_from_input_ids`).
//!
//! ```text
//! text ──tokenizer.json (with [CLS] ... [SEP])──▶ ids (b, t), mask (b, t)
//!      ──Encoder (positions: 0..t, or pad+1.. for RoBERTa)──▶ hidden (b, t, d)
//!      ──mean over real tokens (or [CLS])──▶ (b, d)        ──MlmHead──▶ logits (b, t, vocab)
//! ```

mod mlm_head;
pub mod modernbert;
pub mod names;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle::{DType, Device, IndexOp, Tensor, D};
use serde::Deserialize;

pub use mlm_head::MlmHead;

use crate::config::{EmbeddingExtras, ModelConfig, NormPlacement, Precision, Scale};
use crate::encoder::Encoder;
use crate::error::{Error, Result};
use crate::nn::Activation;
use crate::params::ParamStore;
use crate::positional::{LearnedOptions, PositionalConfig, Positions};
use crate::prediction::{top_fills, MaskFill, Output, Prediction};
use crate::text::TextTokenizer;

/// The model types poslab loads.
pub const SUPPORTED: &str = "`bert` (BERT, MiniLM, ...), `roberta`, `distilbert` and `modernbert`";

/// The fields of a Hugging Face `config.json` poslab reads (others are ignored). DistilBERT's
/// own names (`dim`, `n_layers`, `n_heads`, `hidden_dim`, `activation`, `dropout`,
/// `attention_dropout`) are read as their BERT equivalents.
#[derive(Clone, Debug, Deserialize)]
pub struct HfConfig {
    /// `bert`, `roberta` or `distilbert`.
    pub model_type: String,
    /// Token ids of the embedding table.
    pub vocab_size: usize,
    /// Width of the residual stream (DistilBERT: `dim`).
    #[serde(alias = "dim")]
    pub hidden_size: usize,
    /// Encoder layers (DistilBERT: `n_layers`).
    #[serde(alias = "n_layers")]
    pub num_hidden_layers: usize,
    /// Attention heads per layer (DistilBERT: `n_heads`).
    #[serde(alias = "n_heads")]
    pub num_attention_heads: usize,
    /// Width of the feed-forward hidden layer (DistilBERT: `hidden_dim`).
    #[serde(alias = "hidden_dim")]
    pub intermediate_size: usize,
    /// The feed-forward nonlinearity (default `gelu`).
    #[serde(
        default = "default_act",
        alias = "activation",
        alias = "hidden_activation"
    )]
    pub hidden_act: String,
    /// Rows of the learned position table.
    pub max_position_embeddings: usize,
    /// Rows of the token-type table (default 2).
    #[serde(default = "default_type_vocab")]
    pub type_vocab_size: usize,
    /// The LayerNorms' epsilon (default 1e-12).
    #[serde(default = "default_eps", alias = "norm_eps")]
    pub layer_norm_eps: f64,
    /// The padding token's id (RoBERTa numbers positions from it).
    #[serde(default)]
    pub pad_token_id: Option<usize>,
    /// Whether the masked-LM decoder reuses the token embeddings (default true).
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
    /// Only `absolute` is read; other values are refused.
    #[serde(default)]
    pub position_embedding_type: Option<String>,
    /// Dropout on embeddings and residual branches (DistilBERT: `dropout`).
    #[serde(default, alias = "dropout")]
    pub hidden_dropout_prob: f64,
    /// Dropout on the attention weights (DistilBERT: `attention_dropout`).
    #[serde(default, alias = "attention_dropout")]
    pub attention_probs_dropout_prob: f64,
    /// ModernBERT's own keys (see [`modernbert`]).
    #[serde(flatten)]
    pub modernbert: modernbert::ModernBertKeys,
}

fn default_act() -> String {
    "gelu".into()
}
fn default_type_vocab() -> usize {
    2
}
fn default_eps() -> f64 {
    1e-12
}
fn default_true() -> bool {
    true
}

/// How a family numbers its positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Positions `0..t` for every sequence.
    Bert,
    /// Real tokens at `padding_idx + 1, + 2, ...`, padded tokens at `padding_idx`.
    Roberta {
        /// The padding token's id, the position of padding.
        padding_idx: usize,
    },
    /// Positions `0..t`, no token types, its own tensor names (and LayerNorm eps 1e-12).
    DistilBert,
    /// No position table: RoPE in every layer, global and sliding-window layers, no biases,
    /// GeGLU (see [`modernbert`]).
    ModernBert,
}

impl HfConfig {
    /// The family, or an error listing what is supported.
    pub fn family(&self) -> Result<Family> {
        match self.model_type.as_str() {
            "bert" => Ok(Family::Bert),
            "roberta" => Ok(Family::Roberta {
                padding_idx: self.pad_token_id.unwrap_or(1),
            }),
            "distilbert" => Ok(Family::DistilBert),
            "modernbert" => Ok(Family::ModernBert),
            other => Err(Error::Config(format!(
                "model_type `{other}` is not supported: poslab loads {SUPPORTED}"
            ))),
        }
    }

    /// poslab's config of the same encoder.
    pub fn model_config(&self) -> Result<ModelConfig> {
        let family = self.family()?;
        if family == Family::ModernBert {
            return modernbert::model_config(self);
        }
        // Ids must name a row of the tables they index: a pad_token_id of 2^64 - 1 would wrap
        // RoBERTa's first position to 0.
        if let Some(pad) = self.pad_token_id.filter(|&p| p >= self.vocab_size) {
            return Err(Error::Config(format!(
                "config.json: pad_token_id = {pad} is not an id of the vocabulary (vocab_size = \
                 {}): the file is damaged or belongs to another model",
                self.vocab_size
            )));
        }
        if let Family::Roberta { padding_idx } = family {
            if padding_idx
                .checked_add(2)
                .is_none_or(|p| p > self.max_position_embeddings)
            {
                return Err(Error::Config(format!(
                    "config.json: RoBERTa's positions start at pad_token_id + 1 = {}, but its \
                     table has max_position_embeddings = {} rows: not even one token fits",
                    padding_idx.saturating_add(1),
                    self.max_position_embeddings
                )));
            }
        }
        if let Some(kind) = self
            .position_embedding_type
            .as_deref()
            .filter(|k| *k != "absolute")
        {
            return Err(Error::Config(format!(
                "position_embedding_type `{kind}` is not supported: poslab loads BERT-family \
                 models with an absolute position table (`absolute`)"
            )));
        }
        let activation = match self.hidden_act.as_str() {
            "gelu" => Activation::Gelu,
            "relu" => Activation::Relu,
            other => {
                return Err(Error::Config(format!(
                    "hidden_act `{other}` is not supported: poslab computes `gelu` (exact, erf) \
                     and `relu`"
                )))
            }
        };
        let config = ModelConfig {
            vocab_size: self.vocab_size,
            d_model: self.hidden_size,
            n_heads: self.num_attention_heads,
            n_layers: self.num_hidden_layers,
            ffn_dim: self.intermediate_size,
            activation,
            bias: true,
            first_attn_norm: true,
            max_len: self.max_position_embeddings,
            norm: NormPlacement::Post,
            dropout: self.hidden_dropout_prob,
            attention_dropout: self.attention_probs_dropout_prob,
            embed_scale: Scale::Value(1.0),
            token_init_std: Scale::Value(0.02),
            layer_norm_eps: self.layer_norm_eps,
            dtype: Precision::default(),
            random_positions: None,
            layers: None,
            causal: false,
            embeddings: EmbeddingExtras {
                token_types: match family {
                    Family::DistilBert => 0,
                    _ => self.type_vocab_size,
                },
                norm: true,
                first_position: match family {
                    Family::Roberta { padding_idx } => padding_idx + 1,
                    _ => 0,
                },
            },
            positional: PositionalConfig::Learned(LearnedOptions { init_std: 0.02 }),
        };
        config.validate()?;
        Ok(config)
    }
}

/// The folder of `spec`: a local folder, or a Hub id (`owner/name`, `owner/name@revision`)
/// whose `config.json`, `tokenizer.json` and `model.safetensors` come from the Hugging Face
/// cache (downloaded into it when missing, unless `HF_HUB_OFFLINE`).
pub fn resolve(spec: &str, hub: &crate::text::HubSource) -> Result<PathBuf> {
    resolve_in(spec, &crate::io::PathBase::default(), hub).map_err(|e| match e {
        Error::Input(message) => Error::Input(format!("--model {spec}: {message}")),
        other => other,
    })
}

/// As [`resolve`], a relative folder looked for in `base` (a config's folder); the error says
/// where it was looked for.
pub fn resolve_in(
    spec: &str,
    base: &crate::io::PathBase,
    hub: &crate::text::HubSource,
) -> Result<PathBuf> {
    let path = base.join(Path::new(spec));
    if path.is_dir() {
        return Ok(path);
    }
    let nowhere = || {
        let rule = if Path::new(spec).is_relative() {
            format!(" ({})", base.rule())
        } else {
            String::new()
        };
        format!("no folder at {}{rule}", path.display())
    };
    let repo = crate::text::RepoRef::parse(spec).map_err(|_| {
        Error::Input(format!(
            "{}, and not a Hugging Face Hub id (owner/name or owner/name@revision)",
            nowhere()
        ))
    })?;
    let mut dir = None;
    for file in ["config.json", "tokenizer.json", "model.safetensors"] {
        let path = hub
            .fetch(&repo, file)
            .map_err(|e| Error::Input(format!("{}, and as a Hub id: {e}", nowhere())))?;
        dir = path.parent().map(Path::to_path_buf);
    }
    Ok(dir.expect("three files fetched"))
}

/// A Hugging Face folder: is this what `dir` holds? (`config.json` with a `model_type`.)
pub fn is_hf_folder(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|v| v.get("model_type").is_some())
}

/// A pretrained encoder, its masked-LM head when the file has one, and its tokenizer.
pub struct Pretrained {
    /// The folder's `config.json`.
    pub hf: HfConfig,
    /// How the family numbers positions.
    pub family: Family,
    /// The encoder, in poslab's form.
    pub encoder: Encoder,
    /// The masked-LM head, when the weights have one.
    pub mlm: Option<MlmHead>,
    /// The tokenizer.
    pub tokenizer: TextTokenizer,
    /// The variables, by poslab's names (for `init` and fine-tuning).
    pub params: ParamStore,
    /// The folder it was read from.
    pub dir: PathBuf,
    /// How large its batches may be ([`Pretrained::batch`] checks each).
    limits: crate::limits::Limits,
}

/// A batch of texts, padded at the end.
pub struct Batch {
    /// `(b, t)` u32
    pub ids: Tensor,
    /// `(b, t)` f32, 1 for real tokens
    pub mask: Tensor,
    /// Each text's length in tokens.
    pub lengths: Vec<usize>,
    /// Each token's word in its text (`None` for special tokens), as the tokenizer splits it.
    pub word_ids: Vec<Vec<Option<u32>>>,
}

/// A Hugging Face folder, read and checked: its config, poslab's config of the same encoder,
/// the tensors under poslab's names ([`names`]), and the tokenizer. What [`Pretrained::load`]
/// builds a model from, and what `train`'s `init = { model = ... }` starts from.
pub struct Folder {
    /// The folder.
    pub dir: PathBuf,
    /// Its `config.json`.
    pub hf: HfConfig,
    /// How the family numbers positions.
    pub family: Family,
    /// The same encoder as a poslab config.
    pub config: ModelConfig,
    /// Under poslab's names; the masked-LM head's, when the file has one, under `mlm.`.
    pub tensors: HashMap<String, Tensor>,
    /// Whether the weights hold a masked-LM head.
    pub has_mlm: bool,
    /// The tokenizer.
    pub tokenizer: TextTokenizer,
    /// `model.safetensors`, for messages.
    pub weights: PathBuf,
}

impl Folder {
    /// Reads `dir`, checking every tensor of `model.safetensors` against the config.
    pub fn read(dir: &Path) -> Result<Self> {
        let config_path = dir.join("config.json");
        let text =
            crate::io::read_text_bounded(&config_path, crate::io::MAX_CONFIG_BYTES, "config.json")?;
        let hf: HfConfig = serde_json::from_str(&text).map_err(|e| Error::ConfigParse {
            path: config_path.clone(),
            message: match e.is_data().then(|| culprit_key(&text)).flatten() {
                // A value of the wrong type: name the key (serde's message names the type only).
                Some(key) => format!("key `{key}`: {e}; poslab loads {SUPPORTED}"),
                None => format!("not a BERT-family config.json ({e}); poslab loads {SUPPORTED}"),
            },
        })?;
        let family = hf.family()?;
        let config = hf.model_config()?;
        let weights = dir.join("model.safetensors");
        if weights.symlink_metadata().is_err() {
            return Err(Error::Input(format!(
                "{}: no model.safetensors; save the model with transformers' save_pretrained \
                 (safe_serialization, the default) or convert its pytorch_model.bin",
                dir.display()
            )));
        }
        // The header first: every tensor the config needs, named where one is missing or of
        // another shape; then the config must describe no more than the file holds (the
        // encoder is built at the config's size), and only the tensors poslab maps are read.
        let mut file = crate::weights::WeightsFile::open(&weights)?;
        let (mapping, has_mlm) =
            rename(&file.shapes(), &hf, family).map_err(|message| Error::Checkpoint {
                path: weights.clone(),
                message,
            })?;
        file.check_holds(config.param_count(), "config.json")?;
        let tensors = mapping
            .into_iter()
            .map(|(ours, theirs)| {
                let tensor = file.read(&theirs.name)?;
                Ok(match theirs.rows {
                    Some((first, rows)) => (ours, tensor.narrow(0, first, rows)?.contiguous()?),
                    None => (ours, tensor),
                })
            })
            .collect::<Result<HashMap<_, _>>>()?;
        let tokenizer = TextTokenizer::from_file(dir.join("tokenizer.json"))?;
        if tokenizer.vocab_size() > hf.vocab_size {
            return Err(Error::Config(format!(
                "{}: the tokenizer has {} ids but the model's vocab_size is {}",
                dir.display(),
                tokenizer.vocab_size(),
                hf.vocab_size
            )));
        }
        if config.embeddings.token_types > 0 {
            // poslab reads one segment and adds the token-type table's row 0 to every token, as
            // transformers does where the tokenizer's template types a single text 0.
            let types = tokenizer.single_text_type_ids()?;
            if let Some(&other) = types.iter().find(|&&t| t != 0) {
                return Err(Error::Config(format!(
                    "{}: the tokenizer's template gives a single text token type {other} (its \
                     type ids: {types:?}), but poslab reads every token as type 0 (row 0 of \
                     token_type_embeddings), as BERT's own template does: set the single \
                     template's type ids to 0 in tokenizer.json's post_processor (\"$A\" with \
                     \"type_id\": 0, and its special tokens likewise)",
                    dir.join("tokenizer.json").display()
                )));
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            hf,
            family,
            config,
            tensors,
            has_mlm,
            tokenizer,
            weights,
        })
    }
}

impl Pretrained {
    /// The encoder `spec` names, a folder or a Hub id read from the Hugging Face cache
    /// ([`resolve`], with [`crate::text::HubSource::from_env`]), loaded by [`Pretrained::load`].
    pub fn open(spec: &str, device: &Device) -> Result<Self> {
        Self::open_within(spec, device, &crate::limits::Limits::default())
    }

    /// [`Pretrained::open`] within `limits`: a model of more parameters is refused before it
    /// is built, and every batch it reads is held to them.
    pub fn open_within(
        spec: &str,
        device: &Device,
        limits: &crate::limits::Limits,
    ) -> Result<Self> {
        let dir = resolve(spec, &crate::text::HubSource::from_env())?;
        Self::load_within(&dir, device, limits)
    }

    /// Loads `dir`, checking every tensor of `model.safetensors` against the config.
    pub fn load(dir: &Path, device: &Device) -> Result<Self> {
        Self::load_within(dir, device, &crate::limits::Limits::default())
    }

    /// [`Pretrained::load`] within `limits` (see [`Pretrained::open_within`]).
    pub fn load_within(
        dir: &Path,
        device: &Device,
        limits: &crate::limits::Limits,
    ) -> Result<Self> {
        let folder = Folder::read(dir)?;
        folder
            .config
            .check_limits(limits)
            .map_err(|e| Error::Config(format!("{}: {e}", dir.display())))?;
        let hf = folder.hf;
        let params = ParamStore::new(0);
        let vb = params.var_builder(DType::F32, device);
        let encoder = Encoder::new(&folder.config, vb.clone())?;
        let mlm = match folder.has_mlm {
            true => Some(MlmHead::new(
                hf.hidden_size,
                hf.vocab_size,
                hf.layer_norm_eps,
                folder.config.bias,
                vb.pp("mlm"),
            )?),
            false => None,
        };
        params.assign(&folder.tensors, &folder.weights)?;
        Ok(Self {
            hf,
            family: folder.family,
            encoder,
            mlm,
            tokenizer: folder.tokenizer,
            params,
            dir: folder.dir,
            limits: *limits,
        })
    }

    /// The most tokens (specials included) one text may have: the position table's rows,
    /// less RoBERTa's offset.
    pub fn max_tokens(&self) -> usize {
        self.encoder
            .max_positions()
            .unwrap_or(self.hf.max_position_embeddings)
    }

    /// Tokenizes `texts` with the folder's tokenizer (special tokens included) and pads them.
    /// A text longer than [`Pretrained::max_tokens`] is cut to it with `truncate` (keeping the
    /// closing special token), and refused without.
    pub fn batch(&self, texts: &[String], truncate: bool) -> Result<Batch> {
        let max = self.max_tokens();
        let mut rows = Vec::with_capacity(texts.len());
        let mut word_ids = Vec::with_capacity(texts.len());
        for (i, text) in texts.iter().enumerate() {
            // Only as much of the text as the model can read is tokenized.
            let (encoded, whole) = self.tokenizer.encode_with_specials_at_most(text, max)?;
            let (mut ids, mut words) = (encoded.ids, encoded.word_ids);
            if ids.len() > max || !whole {
                if !truncate {
                    return Err(Error::Input(format!(
                        "text {} has {} tokens but the model's position table reads at most \
                         {max}: shorten it, or pass --truncate to cut it",
                        i + 1,
                        if whole {
                            ids.len().to_string()
                        } else {
                            format!("more than {max}")
                        }
                    )));
                }
                // The closing special token ([SEP], </s>) stays.
                crate::data::keep_ends(&mut ids, max, 1);
                crate::data::keep_ends(&mut words, max, 1);
            }
            rows.push(ids);
            word_ids.push(words);
        }
        let t = rows.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let sizes = self.encoder.config().sizes_on(self.encoder.compute());
        self.limits
            .check_batch(
                &sizes,
                rows.len(),
                t,
                false,
                &format!("{} texts", rows.len()),
            )
            .map_err(Error::Config)?;
        let pad = self.tokenizer.pad_id();
        let device = self.encoder.device();
        let mut ids = Vec::with_capacity(rows.len() * t);
        let mut mask = Vec::with_capacity(rows.len() * t);
        for r in &rows {
            ids.extend(
                r.iter()
                    .copied()
                    .chain(std::iter::repeat_n(pad, t - r.len())),
            );
            mask.extend((0..t).map(|j| if j < r.len() { 1f32 } else { 0.0 }));
        }
        Ok(Batch {
            ids: Tensor::from_vec(ids, (rows.len(), t), device)?,
            mask: Tensor::from_vec(mask, (rows.len(), t), device)?,
            lengths: rows.iter().map(Vec::len).collect(),
            word_ids,
        })
    }

    /// The position ids of a padded batch: `0..t`, which the encoder moves to where the
    /// family's positions start (RoBERTa's `padding_idx + 1`, its config's
    /// `embeddings.first_position`). Padded tokens' positions differ from transformers' (it
    /// puts them at `padding_idx`) but are never read: padded keys are masked.
    ///
    /// # Shapes
    /// - `mask`: `(b, t)`; returns `(1, t)` positions
    pub fn positions(&self, mask: &Tensor) -> Result<Positions> {
        Positions::range(0, mask.dim(1)?)
    }

    /// The last hidden states, `(b, t, d)`.
    pub fn hidden(&self, ids: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let positions = self.positions(mask)?;
        self.encoder.forward_with(ids, mask, &positions, false)
    }

    /// Masked-LM logits of hidden states, `(b, t, vocab)`; an error when the file has no head.
    pub fn mlm_logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let head = self.mlm.as_ref().ok_or_else(|| {
            Error::Input(format!(
                "{} has no masked-LM head (a `{}ForMaskedLM` checkpoint has one); use a \
                 masked-LM model to fill masks",
                self.dir.display(),
                match self.family {
                    Family::Bert => "Bert",
                    Family::Roberta { .. } => "Roberta",
                    Family::DistilBert => "DistilBert",
                    Family::ModernBert => "ModernBert",
                }
            ))
        })?;
        head.forward(
            hidden,
            self.encoder.token_embeddings(),
            self.encoder.backend(),
        )
    }
}

impl Pretrained {
    /// The `top_k` most probable tokens at every mask token (`[MASK]`, `<mask>`) of each text,
    /// special tokens left out; `word` counts the tokenizer's words. A text without a mask
    /// is an error.
    pub fn fill_masks(
        &self,
        texts: &[String],
        top_k: usize,
        truncate: bool,
    ) -> Result<Vec<Output<Prediction>>> {
        let tok = &self.tokenizer;
        let mask_id = tok.mask_id().ok_or_else(|| {
            Error::Input(format!(
                "{}: the tokenizer has no mask token ([MASK] or <mask>)",
                self.dir.display()
            ))
        })?;
        let specials: Vec<u32> = [
            Some(tok.pad_id()),
            tok.cls_id(),
            tok.unk_id(),
            Some(mask_id),
        ]
        .into_iter()
        .flatten()
        .chain(
            ["[SEP]", "</s>", "<s>"]
                .iter()
                .filter_map(|s| tok.token_to_id(s)),
        )
        .collect();
        let mut outputs = Vec::with_capacity(texts.len());
        for chunk in texts.chunks(32) {
            let batch = self.batch(chunk, truncate)?;
            let logits = self.mlm_logits(&self.hidden(&batch.ids, &batch.mask)?)?;
            let probs = crate::nn::softmax_last_dim(&logits)?;
            let ids = batch.ids.to_vec2::<u32>()?;
            for (b, text) in chunk.iter().enumerate() {
                let word_ids = &batch.word_ids[b];
                let mut masks = Vec::new();
                for (t, &id) in ids[b][..batch.lengths[b]].iter().enumerate() {
                    if id != mask_id {
                        continue;
                    }
                    let row = probs.i((b, t))?.to_vec1::<f32>()?;
                    let fills = top_fills(&row, top_k, &specials, tok);
                    let word = word_ids.get(t).copied().flatten();
                    masks.push(MaskFill {
                        word: word.map_or(t, |w| w as usize),
                        fills,
                    });
                }
                if masks.is_empty() {
                    return Err(Error::Input(format!(
                        "{text:?} has no {} token to fill",
                        tok.id_to_token(mask_id).unwrap_or_default()
                    )));
                }
                let unk = tok.unk_id();
                outputs.push(Output {
                    text: text.clone(),
                    value: Prediction::Fills { masks },
                    unknown_tokens: ids[b][..batch.lengths[b]]
                        .iter()
                        .filter(|&&id| Some(id) == unk)
                        .count(),
                    note: None,
                });
            }
        }
        Ok(outputs)
    }
}

/// The top-level key of a `config.json` that keeps it from reading as an [`HfConfig`] (a value
/// of the wrong type): the one key without which it reads. serde's error cannot say where, as
/// the family's keys are read from a buffered copy of the object.
fn culprit_key(text: &str) -> Option<String> {
    let serde_json::Value::Object(map) = serde_json::from_str(text).ok()? else {
        return None;
    };
    map.keys().find_map(|key| {
        let mut without = map.clone();
        without.remove(key);
        serde_json::from_value::<HfConfig>(serde_json::Value::Object(without))
            .ok()
            .map(|_| key.clone())
    })
}

/// The mean of `hidden` over real tokens, optionally scaled to unit L2 norm (as
/// sentence-transformers' `Normalize`).
///
/// # Shapes
/// - `hidden`: `(b, t, d)`, `mask`: `(b, t)`; returns `(b, d)`
pub fn mean_pool(hidden: &Tensor, mask: &Tensor, normalize: bool) -> Result<Tensor> {
    let m = mask.to_dtype(hidden.dtype())?.unsqueeze(2)?; // (b, t, 1)
    let sum = hidden.broadcast_mul(&m)?.sum(1)?; // (b, d)
    let count = m.sum(1)?; // (b, 1)
    let counts = count
        .flatten_all()?
        .to_dtype(DType::F64)?
        .to_vec1::<f64>()?;
    if let Some(i) = counts.iter().position(|c| *c <= 0.0) {
        return Err(Error::Input(format!(
            "sequence {i} of the batch has no real tokens (its mask is all 0): there is nothing \
             to pool; drop empty sequences before pooling"
        )));
    }
    let mean = sum.broadcast_div(&count)?;
    match normalize {
        true => unit_rows(&mean),
        false => Ok(mean),
    }
}

/// Each row of `x` `(b, d)` scaled to unit L2 norm (a zero row stays zero).
pub fn unit_rows(x: &Tensor) -> Result<Tensor> {
    let norm = x
        .sqr()?
        .sum_keepdim(D::Minus1)?
        .sqrt()?
        .clamp(1e-12, f64::MAX)?;
    Ok(x.broadcast_div(&norm)?)
}

/// Maps a checkpoint's tensors (by their shapes) to poslab's names ([`names`]; ModernBERT's in
/// [`modernbert::rename`]): each name poslab reads, to the file's tensor it comes from, and
/// whether the file holds a masked-LM head. The error lists every problem.
fn rename(
    tensors: &HashMap<String, Vec<usize>>,
    hf: &HfConfig,
    family: Family,
) -> std::result::Result<(HashMap<String, modernbert::Source>, bool), String> {
    let (prefix, embeddings, layers, layer, mlm_table) = match family {
        Family::Bert => (
            "bert.",
            names::EMBEDDINGS,
            "encoder.layer.",
            names::LAYER,
            names::BERT_MLM,
        ),
        Family::Roberta { .. } => (
            "roberta.",
            names::EMBEDDINGS,
            "encoder.layer.",
            names::LAYER,
            names::ROBERTA_MLM,
        ),
        Family::ModernBert => {
            return modernbert::rename(tensors, hf.hidden_size, hf.num_hidden_layers)
        }
        Family::DistilBert => (
            "distilbert.",
            names::DISTILBERT_EMBEDDINGS,
            "transformer.layer.",
            names::DISTILBERT_LAYER,
            names::DISTILBERT_MLM,
        ),
    };
    let has_mlm = tensors.contains_key(mlm_table[0].0);
    let mut out = HashMap::new();
    let mut problems = Vec::new();
    for (name, tensor) in tensors {
        let inner = name.strip_prefix(prefix).unwrap_or(name);
        let mapped = embeddings
            .iter()
            .find(|(hf_name, _)| *hf_name == inner)
            .map(|(_, ours)| ours.to_string())
            .or_else(|| {
                let rest = inner.strip_prefix(layers)?;
                let (i, rest) = rest.split_once('.')?;
                let i: usize = i.parse().ok()?;
                layer
                    .iter()
                    .find(|(hf_name, _)| *hf_name == rest)
                    .map(|(_, ours)| format!("layers.{i}.{ours}"))
            })
            .or_else(|| {
                mlm_table
                    .iter()
                    .find(|(hf_name, _)| *hf_name == name.as_str())
                    .map(|(_, ours)| ours.to_string())
            });
        match mapped {
            Some(ours) => {
                out.insert(
                    ours,
                    modernbert::Source {
                        name: name.clone(),
                        rows: None,
                    },
                );
            }
            None => {
                let ignored = names::IGNORED
                    .iter()
                    .find(|(suffix, _)| name.ends_with(suffix));
                match ignored {
                    Some((suffix, _))
                        if (suffix.ends_with("decoder.weight")
                            || *suffix == "vocab_projector.weight")
                            && !hf.tie_word_embeddings =>
                    {
                        problems.push(format!(
                            "`{name}`: an untied masked-LM decoder is not supported \
                             (tie_word_embeddings = false)"
                        ))
                    }
                    Some(_) => {}
                    None => problems.push(format!(
                        "unexpected tensor `{name}` {tensor:?}: not part of a {} encoder or its \
                         masked-LM head",
                        hf.model_type
                    )),
                }
            }
        }
    }
    // Every tensor the config needs is there: a missing one is named, not only counted.
    let needed = embeddings
        .iter()
        .filter(|(_, ours)| *ours != "type_emb.weight" || hf.type_vocab_size > 0)
        .map(|&(theirs, ours)| (theirs.to_string(), ours.to_string()))
        .chain((0..hf.num_hidden_layers).flat_map(|i| {
            layer.iter().map(move |(theirs, ours)| {
                (
                    format!("{layers}{i}.{theirs}"),
                    format!("layers.{i}.{ours}"),
                )
            })
        }));
    for (theirs, ours) in needed {
        if !out.contains_key(&ours) {
            problems.push(format!(
                "lacks tensor `{prefix}{theirs}`, which the config's {} layers need",
                hf.num_hidden_layers
            ));
        }
    }
    if !problems.is_empty() {
        problems.sort();
        return Err(format!(
            "does not match a {} checkpoint:\n  - {}",
            hf.model_type,
            problems.join("\n  - ")
        ));
    }
    Ok((out, has_mlm))
}
