//! A trained model on disk: `model.safetensors`, `config.json`, `tokenizer.json` in one folder.
//! It loads without the experiment config that made it.

use std::collections::HashMap;
use std::path::Path;

use candle::{DType, Device};
use serde::{Deserialize, Serialize};

use crate::config::{ModelConfig, Precision};
use crate::error::{Error, Result};
use crate::model::{HeadConfig, TaskModel};
use crate::params::ParamStore;
use crate::tasks::Objective;
use crate::text::TextTokenizer;

/// The saved model's format, written in its config.
pub const FORMAT: &str = "poslab-model/1";
/// The weights' file name in a saved model's folder.
pub const WEIGHTS: &str = "model.safetensors";
/// The config's file name ([`SavedConfig`]).
pub const CONFIG: &str = "config.json";
/// The tokenizer's file name.
pub const TOKENIZER: &str = "tokenizer.json";
/// The training config of a folder `poslab train` wrote, as the run started.
pub const TRAIN_CONFIG: &str = "train.toml";
/// Why a `poslab train` run stopped for good (its loss diverged after a checkpoint), in a folder
/// that keeps the run: resuming it would stop at the same step.
pub const STOPPED: &str = "stopped.txt";

/// `config.json` of a saved model: everything needed to rebuild it and read its outputs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedConfig {
    /// [`FORMAT`].
    pub format: String,
    /// The encoder's config.
    pub model: ModelConfig,
    /// The head's config.
    pub head: HeadConfig,
    /// What the outputs mean (label names for classification and tagging).
    pub objective: Objective,
    /// The task it was trained on and the training seed, for the record.
    pub task: String,
    /// The training seed.
    pub seed: u64,
    /// The task as configured, so its evaluation text can be made again (`poslab analyze`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_spec: Option<crate::tasks::TaskSpec>,
    /// The pretrained model the weights started from (`init = { model = ... }`), for the
    /// record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init: Option<String>,
    /// Texts are framed by the tokenizer's template (`[CLS] ... [SEP]`), as the pretrained
    /// encoder the model started from reads them.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub special_tokens: bool,
}

impl SavedConfig {
    /// How this model reads a text (see [`crate::data::Framing::of`]).
    pub fn framing(&self, tok: &TextTokenizer) -> Result<crate::data::Framing> {
        crate::data::Framing::of(tok, self.special_tokens, self.head.reads_first_token())
    }
}

/// Writes the model's folder, each file atomically.
pub fn save(
    dir: &Path,
    params: &ParamStore,
    tokenizer: &TextTokenizer,
    config: &SavedConfig,
) -> Result<()> {
    crate::io::create_folder(dir)?;
    let json = serde_json::to_string_pretty(config).expect("a saved config serializes");
    crate::io::write_atomic(&dir.join(CONFIG), json.as_bytes())?;
    tokenizer.save(dir.join(TOKENIZER))?;
    // One metadata key: safetensors writes its metadata map in hash order, so a single key
    // keeps the file's bytes a function of its content.
    let meta = HashMap::from([(
        "config".to_string(),
        serde_json::to_string(config).expect("serializes"),
    )]);
    params.save(dir.join(WEIGHTS), meta)
}

/// A loaded model with its variables, tokenizer and config.
pub struct Loaded {
    /// The model.
    pub model: TaskModel,
    /// Its variables, by name.
    pub params: ParamStore,
    /// Its tokenizer.
    pub tokenizer: TextTokenizer,
    /// Its config.
    pub config: SavedConfig,
}

/// Loads a folder written by [`save`], checking names and shapes of every tensor.
pub fn load(dir: &Path, dtype: DType, device: &Device) -> Result<Loaded> {
    load_as(dir, dtype, device, None)
}

/// As [`load`], computing in `precision` instead of the precision the model was trained with
/// (a model trained in bf16 on a GPU runs in f32 on a CPU, say).
pub fn load_as(
    dir: &Path,
    dtype: DType,
    device: &Device,
    precision: Option<Precision>,
) -> Result<Loaded> {
    load_within(
        dir,
        (dtype, device, precision),
        &crate::limits::Limits::default(),
    )
}

/// As [`load_as`], refusing a model whose parameters pass `limits` before anything of its size
/// is allocated (a `config.json` edited to a vocabulary of 60 million would take gigabytes).
pub fn load_within(
    dir: &Path,
    (dtype, device, precision): (DType, &Device, Option<Precision>),
    limits: &crate::limits::Limits,
) -> Result<Loaded> {
    if crate::pretrained::is_hf_folder(dir) {
        return Err(Error::Input(format!(
            "{} is a Hugging Face model folder, not a poslab run: pass it as --model {} \
             (supported: {})",
            dir.display(),
            dir.display(),
            crate::pretrained::SUPPORTED
        )));
    }
    let config_path = dir.join(CONFIG);
    let text =
        crate::io::read_text_bounded(&config_path, crate::io::MAX_CONFIG_BYTES, "config.json")?;
    let mut config: SavedConfig = serde_json::from_str(&text).map_err(|e| Error::ConfigParse {
        path: config_path.clone(),
        message: e.to_string(),
    })?;
    if let Some(precision) = precision {
        config.model.dtype = precision;
    }
    if config.format != FORMAT {
        return Err(Error::ConfigParse {
            path: config_path,
            message: format!("format `{}` is not `{FORMAT}`", config.format),
        });
    }
    config.model.validate()?;
    config
        .model
        .check_limits(limits)
        .map_err(|e| Error::Config(format!("{}: {e}", config_path.display())))?;
    let tokenizer = TextTokenizer::from_file(dir.join(TOKENIZER))?;
    // A pretrained model's table may have more rows than its tokenizer has ids (never fewer).
    let fits = match config.init {
        Some(_) => tokenizer.vocab_size() <= config.model.vocab_size,
        None => tokenizer.vocab_size() == config.model.vocab_size,
    };
    if !fits {
        return Err(Error::Config(format!(
            "{}: the tokenizer has {} ids but the model's vocab_size is {}",
            dir.display(),
            tokenizer.vocab_size(),
            config.model.vocab_size
        )));
    }
    // The weights file must hold at least what the config describes, before the model is
    // built at the config's size (a vocab_size edited to 60,000,000 would allocate gigabytes).
    let mut weights = crate::weights::WeightsFile::open(&dir.join(WEIGHTS))?;
    weights.check_holds(config.model.param_count(), "config.json")?;
    let params = ParamStore::new(0);
    let model = TaskModel::new(
        &config.model,
        &config.head,
        params.var_builder(dtype, device),
    )?;
    params.constrain(&model.encoder().constraints())?;
    params.exempt_from_decay(&model.undecayed());
    params.load_file(&mut weights)?;
    Ok(Loaded {
        model,
        params,
        tokenizer,
        config,
    })
}
