//! `poslab train`: one model, any task and positional choice, checkpointed and resumable, saved
//! as a model folder that `predict`, `embed` and `analyze` load.
//!
//! A run folder holds `train.toml` (the config as run) and `tokenizer.json` from the start,
//! `checkpoints/step-NNNNNNNN/` (weights, optimizer moments, trainer state; each folder written
//! under a temporary name and renamed, then `checkpoints/latest` pointed at it), and at the end
//! `config.json`, `model.safetensors` and `metrics.json`. A run stopped at any point resumes from
//! its latest checkpoint and ends with the same weights as one that never stopped.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle::Device;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};

use crate::config::{Choices, ModelShape, Pooling, Precision};
use crate::error::{Error, Result};
use crate::io::write_atomic;
use crate::params::{load_tensors, save_tensors, ParamStore};
use crate::positional::PositionalConfig;
use crate::runs::job::{Job, JobEnd, Steps};
use crate::runs::prepare::{prepare, Prepared};
use crate::runs::results::TrainSummary;
use crate::runs::EvalConfig;
use crate::saved;
use crate::tasks::TaskSpec;
use crate::text::{HubSource, TextTokenizer, TokenizerSpec};
use crate::train::{Checkpoint, TrainConfig, TrainState, Trainer};

pub use crate::saved::{STOPPED, TRAIN_CONFIG};
/// The finished run's record ([`Metrics`]).
pub const METRICS: &str = "metrics.json";
/// The folder of checkpoints.
pub const CHECKPOINTS: &str = "checkpoints";
const LATEST: &str = "latest";
/// The run's config as each checkpoint was saved under it.
const CHECKPOINT_CONFIG: &str = "train.toml";

fn d_checkpoint_every() -> usize {
    100
}

/// `poslab train --config FILE`:
///
/// ```toml
/// name = "reviews"
/// seed = 0
/// checkpoint_every = 100       # steps; 0 saves only at the end
///
/// [model]                      # as an experiment's [model]
/// d_model = 64
/// n_heads = 4
/// n_layers = 2
/// ffn_dim = 128
///
/// [positional]
/// kind = "rope"
///
/// [train]
/// budget = { steps = 600 }
///
/// [task]                       # as an experiment's [[tasks]] entry
/// kind = "classify"
/// train = "examples/data/reviews.tsv"
/// ```
///
/// Or, to fine-tune a pretrained encoder, `init` instead of `[model]` and `[positional]` (the
/// model brings its shape, its positions and its tokenizer):
///
/// ```toml
/// name = "reviews-minilm"
/// init = { model = "sentence-transformers/all-MiniLM-L6-v2", pooling = "mean" }
/// [train]
/// budget = { steps = 300 }
/// lr = 5e-5
/// [task]
/// kind = "classify"
/// train = "examples/data/reviews.tsv"
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainRunConfig {
    /// Names the run folder.
    pub name: String,
    /// The seed of the weights, the data order and dropout.
    #[serde(default)]
    pub seed: u64,
    /// Steps between checkpoints.
    #[serde(default = "d_checkpoint_every")]
    pub checkpoint_every: usize,
    /// Start from a pretrained encoder (instead of `[model]` and `[positional]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init: Option<InitConfig>,
    /// The model shape, `[model]` (without `init`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelShape>,
    /// The positional scheme, `[positional]` (without `init`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub positional: Option<PositionalConfig>,
    /// Rows of a learned table; default: the longest training input (or the task's max_tokens).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_len: Option<usize>,
    /// Randomized positions drawn from `[0, N)` (Ruoss et al. 2023).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub random_positions: Option<usize>,
    /// What each layer does, `[layers]` (without `init`; see [`crate::layers`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<crate::layers::LayerPlan>,
    /// How to train, `[train]`.
    pub train: TrainConfig,
    /// How to test, `[eval]`.
    #[serde(default)]
    pub eval: EvalConfig,
    /// The task, `[task]`.
    pub task: TaskSpec,
}

/// `init = { model = ..., pooling = ..., dtype = ... }`: fine-tune a pretrained encoder.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InitConfig {
    /// A Hugging Face folder or Hub id of a BERT-family model (as `--model` takes).
    pub model: String,
    /// How a sentence label reads the hidden states: `first` (the `[CLS]` token, as
    /// transformers' sequence classifiers, default) or `mean` (over real tokens, as
    /// sentence-transformers).
    #[serde(default = "d_init_pooling")]
    pub pooling: Pooling,
    /// Activations in `f32` (default), `bf16` or `f16`.
    #[serde(default)]
    pub dtype: Precision,
    /// Always false: a pretrained encoder was trained seeing both sides, and is refused with
    /// a causal mask, which would change what every layer computes from its weights.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub causal: bool,
}

fn d_init_pooling() -> Pooling {
    Pooling::First
}

/// What a run builds: its own encoder, or a pretrained one.
enum Architecture<'a> {
    Own {
        shape: &'a ModelShape,
        positional: &'a PositionalConfig,
    },
    Pretrained(&'a InitConfig),
}

impl TrainRunConfig {
    /// `[model]` and `[positional]`, or `init`: exactly one of the two.
    fn architecture(&self) -> Result<Architecture<'_>> {
        match (&self.init, &self.model, &self.positional) {
            (Some(init), None, None) => {
                if init.causal {
                    return Err(Error::Config(format!(
                        "init = {{ model = {:?}, causal = true }}: a pretrained encoder learned \
                         its weights seeing both sides of every token, and a causal mask would \
                         change what each of its layers computes; fine-tune it without causal, \
                         or train a causal model of your own ([model] causal = true)",
                        init.model
                    )));
                }
                let own = [
                    ("max_len", self.max_len.is_some()),
                    ("random_positions", self.random_positions.is_some()),
                    (
                        "[task] tokenizer",
                        self.task.tokenizer != TokenizerSpec::default(),
                    ),
                ];
                if let Some((what, _)) = own.iter().find(|(_, set)| *set) {
                    return Err(Error::Config(format!(
                        "init = {{ model = {:?} }} brings the model's own position table and \
                         tokenizer: remove {what}",
                        init.model
                    )));
                }
                Ok(Architecture::Pretrained(init))
            }
            (Some(init), _, _) => Err(Error::Config(format!(
                "init = {{ model = {:?} }} takes the model's shape and positions from the \
                 pretrained model: remove [model] and [positional]",
                init.model
            ))),
            (None, Some(shape), Some(positional)) => Ok(Architecture::Own { shape, positional }),
            (None, _, _) => Err(Error::Config(
                "a train config needs [model] and [positional], or init = { model = \
                 \"PATH_OR_HUB_ID\" } to fine-tune a pretrained encoder"
                    .into(),
            )),
        }
    }

    /// What this run chooses beyond its `[model]` shape: `positional`, and its table and
    /// layers.
    fn choices<'a>(&'a self, positional: &'a PositionalConfig) -> Choices<'a> {
        Choices {
            max_len: self.max_len,
            random_positions: self.random_positions,
            layers: self.layers.as_ref(),
            ..Choices::of(positional)
        }
    }

    /// The dtype activations are computed in.
    pub fn set_dtype(&mut self, dtype: Precision) {
        match (&mut self.init, &mut self.model) {
            (Some(init), _) => init.dtype = dtype,
            (None, Some(shape)) => shape.dtype = dtype,
            (None, None) => {}
        }
    }

    /// Checks the whole run (name, training, task and model) before anything is written.
    pub fn validate(&self) -> Result<()> {
        crate::runs::check_name("run", &self.name)?;
        self.train.validate()?;
        self.task.validate()?;
        if self.eval.shift > crate::positional::MAX_POSITION {
            return Err(Error::Config(format!(
                "[eval] shift = {} moves positions past the largest supported, {}",
                self.eval.shift,
                crate::positional::MAX_POSITION
            )));
        }
        match self.architecture()? {
            Architecture::Own { shape, positional } => {
                let model =
                    shape.model_config(&self.choices(positional), 8, self.max_len.unwrap_or(1));
                model.validate()?;
                self.task.check_causal(model.causal).map_err(Error::Config)
            }
            Architecture::Pretrained(_) => self.task.check_causal(false).map_err(Error::Config),
        }
    }

    /// Refuses a generated task whose words, or a model whose parameters, pass `limits`
    /// (before anything is generated or built).
    pub fn check_limits(&self, limits: &crate::limits::Limits) -> Result<()> {
        self.task.check_limits(limits)?;
        match self.architecture()? {
            Architecture::Own { shape, positional } => shape
                .model_config(&self.choices(positional), 8, self.max_len.unwrap_or(1))
                .check_limits(limits),
            Architecture::Pretrained(_) => Ok(()),
        }
    }

    /// Parses and validates a run config from TOML text.
    pub fn from_toml_str(text: &str) -> Result<Self> {
        let config: Self = crate::io::parse_toml(text)?;
        config.validate()?;
        Ok(config)
    }

    /// Reads and validates a run config file. Its relative paths (the task's, and `init`'s
    /// local folder) resolve against the file's folder.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = crate::io::read_text_bounded(path, crate::io::MAX_CONFIG_BYTES, "config")?;
        let mut config = Self::from_toml_str(&text).map_err(|e| match e {
            Error::ConfigParse { message, .. }
                if ["tasks", "variants"]
                    .iter()
                    .any(|k| crate::io::toml_has_key(&text, k)) =>
            {
                Error::ConfigParse {
                    path: path.into(),
                    message: format!(
                        "this is an experiment config ([[tasks]] x [[variants]] x seeds), not \
                         one run: run it with `poslab compare {}`\n{message}",
                        path.display()
                    ),
                }
            }
            Error::ConfigParse { message, .. } if message.contains("unknown field `seeds`") => {
                Error::ConfigParse {
                    path: path.into(),
                    message: format!(
                        "`poslab train` trains one model from one seed: `seed = N`; `seeds = N` \
                         (a count) is an experiment's, for `poslab compare`\n{message}"
                    ),
                }
            }
            other => other.in_file(path),
        })?;
        config
            .task
            .resolve_from(path.parent().unwrap_or(Path::new(".")));
        Ok(config)
    }

    /// The config as TOML, the form the run folder keeps.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("a train config serializes")
    }
}

/// How to run.
pub struct TrainOptions {
    /// The run folder.
    pub dir: PathBuf,
    /// Where to train.
    pub device: Device,
    /// How progress is shown.
    pub progress: crate::progress::Progress,
    /// Stop (after saving a checkpoint) once this many steps are done: what a kill between
    /// checkpoints would leave, on purpose.
    pub stop_after: Option<usize>,
    /// Where `init`'s Hub models are found (cache, offline).
    pub hub: HubSource,
    /// Threads to train with: the width of the run's own rayon pool
    /// ([`crate::nn::with_threads`]). The results do not depend on it. `None`: every core.
    pub threads: Option<usize>,
    /// The kernels and instruction sets the model computes with.
    pub backend: crate::nn::Backend,
    /// How large the model, its task and its batches may be.
    pub limits: crate::limits::Limits,
}

impl TrainOptions {
    /// Where the run's model computes: its device and backend.
    pub fn compute(&self) -> crate::nn::Compute<'_> {
        crate::nn::Compute {
            device: &self.device,
            backend: self.backend,
        }
    }

    /// A run into `dir` on `device`: quietly, to the end, the Hub's models read as its
    /// variables say ([`HubSource::from_env`]), on every core, with the default kernels and
    /// limits.
    pub fn new(dir: impl Into<PathBuf>, device: Device) -> Self {
        Self {
            dir: dir.into(),
            device,
            progress: crate::progress::Progress::Quiet,
            stop_after: None,
            hub: HubSource::from_env(),
            threads: None,
            backend: crate::nn::Backend::default(),
            limits: crate::limits::Limits::default(),
        }
    }
}

/// The record of a finished run, `metrics.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Metrics {
    /// The run's name.
    pub name: String,
    /// The task's name.
    pub task: String,
    /// The positional scheme.
    pub positional: PositionalConfig,
    /// The seed.
    pub seed: u64,
    /// Training and test scores, as a cell of `poslab compare` records them.
    #[serde(flatten)]
    pub summary: TrainSummary,
    /// Seconds spent in training steps.
    pub train_seconds: f64,
    /// Training tokens per second of `train_seconds`.
    pub tokens_per_second: f64,
    /// What was done to the data (truncation).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

/// How a call ended.
#[derive(Clone, Debug, PartialEq)]
pub enum TrainEnd {
    /// The run finished; its record.
    Finished(Box<Metrics>),
    /// Stopped by `stop_after`, a checkpoint saved at `step`.
    Stopped {
        /// The last step done.
        step: usize,
    },
}

/// Starts a new run in `options.dir` (which must not hold one already).
///
/// A run folder counts as started once its `train.toml` exists, and that file is written last,
/// after the data is read and `tokenizer.json` saved: a start that fails or is killed before
/// it leaves a folder that a fresh start takes over (and `--resume` says to start instead).
/// The folder is locked for the whole run, so a second `train` into it is refused.
pub fn start(config: &TrainRunConfig, options: &TrainOptions) -> Result<TrainEnd> {
    config.validate()?;
    config.check_limits(&options.limits)?;
    let dir = &options.dir;
    crate::io::create_folder(dir)?;
    let lock = crate::io::FolderLock::exclusive(dir, "poslab train")?;
    if dir.join(TRAIN_CONFIG).exists() {
        return Err(Error::Input(format!(
            "{} already holds a run: continue it with `poslab train --resume {}`, or choose another --out",
            dir.display(),
            dir.display()
        )));
    }
    clean_temporaries(dir);
    let start = Start::of(config, &options.hub)?;
    let tokenizer = start.as_ref().map(|s| s.folder.tokenizer.clone());
    let data = config.task.generate_with(&options.hub, tokenizer)?;
    // Every check before anything is written: a start that fails leaves no run behind.
    let ready = ready(config, data, start, options)?;
    if let Some(note) = ready.task.unknown_tokens_note() {
        crate::io::note(&format!("note: {note}"));
    }
    ready.task.data.tokenizer.save(dir.join(saved::TOKENIZER))?;
    let inputs = Inputs::of(config, ready.start.as_ref(), dir, options)?;
    write_atomic(&dir.join(INPUTS), inputs.to_json().as_bytes())?;
    write_atomic(&dir.join(TRAIN_CONFIG), config.to_toml().as_bytes())?;
    let end = run(config, ready, options, false).map_err(|e| diverged(dir, e));
    drop(lock);
    end
}

/// A run that stopped in training ([`Error::Training`]: a non-finite loss or gradient), with
/// the way on. Training is deterministic, so `--resume` would stop at the same step: the config
/// must change. A run with no checkpoint holds nothing a resume could use, so it is removed
/// (its start marker first), and the fixed config starts in the same folder; one with
/// checkpoints is kept, and the fixed config goes into another folder.
fn diverged(dir: &Path, e: Error) -> Error {
    let Error::Training(why) = e else {
        return e;
    };
    let checkpointed = latest_checkpoint_step(dir).is_some();
    let removed = !checkpointed
        && [TRAIN_CONFIG, INPUTS, saved::TOKENIZER].iter().all(|f| {
            match std::fs::remove_file(dir.join(f)) {
                Ok(()) => true,
                Err(e) => e.kind() == std::io::ErrorKind::NotFound,
            }
        });
    let way_on = match (checkpointed, removed) {
        (false, true) => format!(
            "no checkpoint was saved, so {} holds no run now: change the config and start it, \
             into the same --out if you like",
            dir.display()
        ),
        _ => {
            // So that `--resume` and `inspect` can say so later. If this write fails, the
            // message below still says it once.
            let _ = write_atomic(&dir.join(STOPPED), format!("{why}\n").as_bytes());
            format!(
                "{} keeps the run, but --resume would stop here again: change the config and \
                 start it into another --out",
                dir.display()
            )
        }
    };
    Error::Training(format!(
        "{why}; training is deterministic, so this config stops here every time ({way_on})"
    ))
}

/// Why the run in `dir` stopped for good ([`STOPPED`]), if it did.
pub fn stopped(dir: &Path) -> Option<String> {
    let why = std::fs::read_to_string(dir.join(STOPPED)).ok()?;
    let why = why.trim();
    Some(if why.is_empty() || why.len() > 2000 {
        "its loss diverged".to_string()
    } else {
        why.to_string()
    })
}

/// What a run reads besides its config, `inputs.json`: the SHA-256 of each data file, of the
/// tokenizer it saved, and of the pretrained folder it starts from. A resume reads them again
/// and must find them unchanged.
pub const INPUTS: &str = "inputs.json";

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Inputs {
    files: Vec<InputFile>,
    /// The kind of device (`cpu`, `cuda`) and the kernels the run computes with: a resume must
    /// use the same to end as a run that never stopped (absent in runs from before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    device: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    kernels: Option<String>,
    /// The folder of the config the run was started from, which its relative paths resolve
    /// against ([`crate::io::PathBase`]; absent in runs from before, and for a config made
    /// from text: the working directory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    paths_from: Option<PathBuf>,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct InputFile {
    path: PathBuf,
    sha256: String,
}

impl Inputs {
    /// The inputs of `config` as they are now.
    fn of(
        config: &TrainRunConfig,
        start: Option<&Start>,
        dir: &Path,
        options: &TrainOptions,
    ) -> Result<Self> {
        // Files outside the run folder by their absolute paths, and the run folder's own
        // tokenizer by its name in the folder: the record holds from any working directory,
        // and when the folder moves.
        let mut paths: Vec<PathBuf> = config.task.input_files();
        if let Some(start) = start {
            let d = &start.folder.dir;
            paths.extend(["config.json", "model.safetensors", "tokenizer.json"].map(|f| d.join(f)));
        }
        let mut files = paths
            .into_iter()
            .map(|path| {
                Ok(InputFile {
                    sha256: crate::io::sha256_file(&path)?,
                    path: std::path::absolute(&path).unwrap_or(path),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        files.push(InputFile {
            sha256: crate::io::sha256_file(&dir.join(saved::TOKENIZER))?,
            path: saved::TOKENIZER.into(),
        });
        Ok(Self {
            files,
            device: Some(crate::device::device_kind(&options.device)),
            kernels: Some(options.backend.kernels.name().into()),
            paths_from: config.task.base.0.clone(),
        })
    }

    fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("inputs serialize") + "\n"
    }

    /// The inputs the run in `dir` recorded (`None` for a run started before poslab recorded
    /// them).
    fn recorded(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join(INPUTS);
        if !path.exists() {
            return Ok(None);
        }
        let text = crate::io::read_text_bounded(&path, crate::io::MAX_CONFIG_BYTES, "inputs")?;
        let recorded = serde_json::from_str(&text).map_err(|e| Error::Checkpoint {
            path: path.clone(),
            message: format!("unreadable ({e}): the file was edited or damaged"),
        })?;
        Ok(Some(recorded))
    }

    /// Refuses a resume of the run in `dir`, which recorded these inputs, whose inputs differ
    /// now, naming the file, or that computes on another kind of device or with other kernels
    /// than the run began with.
    fn check(&self, dir: &Path, options: &TrainOptions) -> Result<()> {
        for f in &self.files {
            // A relative path is the run folder's own file (runs from before recorded every
            // path as the working directory saw it).
            let at = match dir.join(&f.path) {
                inside if f.path.is_relative() && inside.exists() => inside,
                _ => f.path.clone(),
            };
            let now = crate::io::sha256_file(&at).map_err(|e| {
                Error::Input(format!(
                    "{} was read when the run started, and cannot be read now ({e}): a \
                     resumed run reads the same inputs; restore it, or start a new run",
                    at.display()
                ))
            })?;
            if now != f.sha256 {
                return Err(Error::Input(format!(
                    "{} changed since the run started (its SHA-256 differs): a resumed run \
                     must read the same inputs to end as an uninterrupted one; restore the \
                     file, or start a new run",
                    f.path.display()
                )));
            }
        }
        let now = (
            crate::device::device_kind(&options.device),
            options.backend.kernels.name(),
        );
        if let (Some(device), Some(kernels)) = (&self.device, &self.kernels) {
            if (device.as_str(), kernels.as_str()) != (now.0.as_str(), now.1) {
                return Err(Error::Input(format!(
                    "{} began on {device} with the {kernels} kernels, and this resume computes \
                     on {} with the {} kernels: they agree to within rounding, not bit for bit, \
                     so the run would not end as one that never stopped; resume it with \
                     --device {device} --kernels {kernels}",
                    dir.display(),
                    now.0,
                    now.1
                )));
            }
        }
        Ok(())
    }
}

/// Continues the run in `options.dir` from its latest checkpoint (from the start if it stopped
/// before the first), with the config and tokenizer it saved.
pub fn resume(options: &TrainOptions) -> Result<TrainEnd> {
    let dir = &options.dir;
    if !dir.is_dir() {
        return Err(Error::Input(format!(
            "{}: no such run folder to resume",
            dir.display()
        )));
    }
    let lock = crate::io::FolderLock::exclusive(dir, "poslab train")?;
    if dir.join(METRICS).exists() {
        return Err(Error::Input(format!(
            "{} has already finished (metrics.json exists)",
            dir.display()
        )));
    }
    if !dir.join(TRAIN_CONFIG).exists() {
        if dir.join(crate::runs::folder::MANIFEST).is_file() {
            return Err(Error::Input(format!(
                "{} holds a `poslab compare` run, not a `poslab train` one: the same compare \
                 command into it (`poslab compare CONFIG --out {}`) continues it",
                dir.display(),
                dir.display()
            )));
        }
        return Err(Error::Input(format!(
            "{} holds no started run (no {TRAIN_CONFIG}): start one with `poslab train --config \
             FILE --out {}`",
            dir.display(),
            dir.display()
        )));
    }
    if let Some(why) = stopped(dir) {
        return Err(Error::Input(format!(
            "{} stopped for good: {why}. Training is deterministic, so --resume would stop at the \
             same step: change the config and start it into another --out (or delete {} to try \
             anyway, on a machine that computes differently)",
            dir.display(),
            dir.join(STOPPED).display()
        )));
    }
    let mut config = TrainRunConfig::load(dir.join(TRAIN_CONFIG))?;
    let recorded = Inputs::recorded(dir)?;
    config.task.base = crate::io::PathBase(recorded.as_ref().and_then(|r| r.paths_from.clone()));
    let tokenizer = TextTokenizer::from_file(dir.join(saved::TOKENIZER))?;
    clean_temporaries(dir);
    if let Some(recorded) = &recorded {
        recorded.check(dir, options)?;
    }
    config.check_limits(&options.limits)?;
    let data = config.task.generate_with(&options.hub, Some(tokenizer))?;
    let start = Start::of(&config, &options.hub)?;
    let ready = ready(&config, data, start, options)?;
    let end = run(&config, ready, options, true).map_err(|e| diverged(dir, e));
    drop(lock);
    end
}

/// Removes what killed runs leave behind: temporary files and unfinished checkpoint folders.
fn clean_temporaries(dir: &Path) {
    for folder in [dir.to_path_buf(), dir.join(CHECKPOINTS)] {
        let Ok(entries) = std::fs::read_dir(&folder) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') && name.ends_with(".tmp") {
                let path = entry.path();
                let _ = if path.is_dir() {
                    std::fs::remove_dir_all(&path)
                } else {
                    std::fs::remove_file(&path)
                };
            }
        }
    }
}

/// A pretrained start: the folder read, its encoder's config as this run computes it.
struct Start {
    folder: crate::pretrained::Folder,
    config: crate::config::ModelConfig,
}

impl Start {
    /// The pretrained start of `config` (its folder read once), if it has one.
    fn of(config: &TrainRunConfig, hub: &HubSource) -> Result<Option<Self>> {
        let Some(init) = &config.init else {
            return Ok(None);
        };
        let dir =
            crate::pretrained::resolve_in(&init.model, &config.task.base, hub).map_err(|e| {
                let e = match e {
                    Error::Input(message) => message,
                    other => other.to_string(),
                };
                Error::Config(format!("init = {{ model = {:?} }}: {e}", init.model))
            })?;
        let folder = crate::pretrained::Folder::read(&dir)
            .map_err(|e| Error::Config(format!("init = {{ model = {:?} }}: {e}", init.model)))?;
        let config = crate::config::ModelConfig {
            dtype: init.dtype,
            ..folder.config.clone()
        };
        Ok(Some(Self { folder, config }))
    }

    /// The encoder's weights into `params`; the new head keeps its seeded initialisation and
    /// the folder's masked-LM head is left out.
    fn assign(&self, params: &ParamStore) -> Result<()> {
        params.assign_where(&self.folder.tensors, &self.folder.weights, |name| {
            !name.starts_with("head.") && !name.starts_with("mlm.")
        })
    }
}

/// A run checked and its data prepared: everything that can fail before training is done
/// here, before a start writes anything into its folder.
struct Ready<'a> {
    task: Prepared<'a>,
    model_config: crate::config::ModelConfig,
    eval_batch: usize,
    start: Option<Start>,
}

/// Prepares `data` for `config` and runs every check a run makes before its first step.
fn ready<'a>(
    config: &'a TrainRunConfig,
    mut data: crate::tasks::TaskData,
    start: Option<Start>,
    options: &TrainOptions,
) -> Result<Ready<'a>> {
    let limits = &options.limits;
    let architecture = config.architecture()?;
    let pooling = match (&architecture, &start) {
        (Architecture::Pretrained(init), Some(start)) => {
            if !matches!(
                data.objective,
                crate::tasks::Objective::Classify { .. } | crate::tasks::Objective::Tag { .. }
            ) {
                return Err(Error::Config(format!(
                    "init = {{ model = {:?} }}: fine-tuning trains a classify or tag head; task \
                     `{}` is neither (for masked-LM predictions use `poslab predict --model`)",
                    init.model, config.task.name
                )));
            }
            // Texts longer than the table are refused (or cut, with truncate = true).
            let rows = start.config.max_len - start.config.embeddings.first_position;
            match data.limit.max_tokens {
                Some(n) if n > rows => {
                    return Err(Error::Config(format!(
                        "[task] max_tokens = {n}, but {}'s position table reads at most {rows} \
                         tokens: lower max_tokens",
                        init.model
                    )))
                }
                Some(_) => {}
                None => data.limit.max_tokens = Some(rows),
            }
            init.pooling
        }
        (Architecture::Own { shape, .. }, None) => shape.pooling,
        _ => unreachable!("Start::of reads a folder exactly when the config has init"),
    };
    let task = prepare(
        &config.task,
        data,
        pooling,
        config.eval.shift,
        start.is_some(),
    )?;
    task.check_random_positions(config.random_positions, &config.name)?;
    let eval_batch = config
        .eval
        .batch_size
        .unwrap_or(2 * config.train.batch_size);
    let tok = &task.data.tokenizer;
    let model_config = match (&start, architecture) {
        (Some(start), _) => start.config.clone(),
        (None, Architecture::Own { shape, positional }) => shape.model_config(
            &config.choices(positional),
            tok.vocab_size(),
            task.table_rows(),
        ),
        (None, Architecture::Pretrained(_)) => unreachable!("Start::of read the folder"),
    };
    model_config.validate()?;
    model_config.check_limits(limits)?;
    task.check_memory(
        &model_config.sizes_on(options.compute()),
        config.train.batch_size,
        eval_batch,
        &config.name,
        1,
        limits,
    )?;
    task.train_data().check()?;
    Ok(Ready {
        task,
        model_config,
        eval_batch,
        start,
    })
}

/// A run's steps: resumed from the latest checkpoint, a bar on standard error, the progress
/// board, a checkpoint every `checkpoint_every` steps, and `stop_after`.
struct RunSteps<'a> {
    config: &'a TrainRunConfig,
    options: &'a TrainOptions,
    board: &'a crate::progress::Board,
    resuming: bool,
}

impl Steps for RunSteps<'_> {
    fn begin(&mut self, trainer: &mut Trainer<'_>, params: &ParamStore) -> Result<ProgressBar> {
        if self.resuming {
            if let Some(checkpoint) = load_latest(&self.options.dir, params, self.config)? {
                trainer.restore(&checkpoint)?;
            }
        }
        let bar = if self.options.progress.bars() {
            ProgressBar::with_draw_target(
                Some(trainer.planned_steps() as u64),
                ProgressDrawTarget::stderr(),
            )
        } else {
            ProgressBar::hidden()
        };
        bar.set_style(
            ProgressStyle::with_template(
                "{prefix} [{bar:40}] {pos}/{len} steps, {elapsed} elapsed, about {eta} left {msg}",
            )
            .expect("template")
            .progress_chars("=> "),
        );
        bar.set_prefix(self.config.name.clone());
        let first = trainer.state().steps;
        bar.set_position(first as u64);
        self.board
            .start(&self.config.name, first, trainer.planned_steps());
        Ok(bar)
    }

    fn after_step(&mut self, trainer: &Trainer<'_>, params: &ParamStore) -> Result<bool> {
        let (config, options) = (self.config, self.options);
        let state = trainer.state();
        let steps = state.steps;
        let loss = state.losses.last().copied().unwrap_or(f64::NAN);
        self.board.step(&config.name, steps, loss);
        let stop = options.stop_after.is_some_and(|n| steps >= n);
        let due = config.checkpoint_every > 0 && steps.is_multiple_of(config.checkpoint_every);
        if (due || stop) && !trainer.finished() {
            save_checkpoint(&options.dir, params, &trainer.checkpoint(), config)?;
        }
        Ok(!stop)
    }

    fn testing(&mut self, bar: &ProgressBar) {
        bar.finish_and_clear();
        self.board.testing(&self.config.name);
    }
}

/// Trains, tests and saves the run as one [`Job`], and writes its `metrics.json`.
fn run(
    config: &TrainRunConfig,
    ready: Ready,
    options: &TrainOptions,
    resuming: bool,
) -> Result<TrainEnd> {
    let dir = &options.dir;
    let Ready {
        task,
        model_config,
        eval_batch,
        start,
    } = ready;
    let job = Job {
        task: &task,
        model: &model_config,
        train: &config.train,
        seed: config.seed,
        train_set: None,
        eval_batch,
        device: &options.device,
        backend: options.backend,
    };
    // The board's count of steps left, for its time estimate: from the checkpoint resumed.
    let first = match resuming {
        true => latest_checkpoint_step(dir).unwrap_or(0),
        false => 0,
    };
    let planned = crate::train::planned_steps(&config.train, &task.train);
    let board = crate::progress::Board::new(&config.name, 0, planned.saturating_sub(first) as u64);
    let mut steps = RunSteps {
        config,
        options,
        board: &board,
        resuming,
    };
    let assign = |params: &ParamStore| match &start {
        Some(start) => start.assign(params),
        None => Ok(()),
    };
    let end = crate::progress::with_lines(
        options.progress,
        &board,
        &|line| crate::io::note(line),
        // On a pool of its own, as compare's jobs (see nn::with_threads).
        || {
            crate::nn::with_threads(options.threads.unwrap_or_else(crate::nn::cores), || {
                job.run(Some(&assign), &mut steps)
            })
        },
    )?;
    let trained = match end {
        JobEnd::Trained(trained) => trained,
        JobEnd::Stopped { step } => return Ok(TrainEnd::Stopped { step }),
    };
    job.save(dir, &trained, config.init.as_ref().map(|i| i.model.clone()))?;
    let outcome = &trained.outcome;
    let metrics = Metrics {
        name: config.name.clone(),
        task: config.task.name.clone(),
        positional: model_config.positional.clone(),
        seed: config.seed,
        summary: trained.summary.clone(),
        train_seconds: outcome.train_seconds,
        tokens_per_second: outcome.tokens_per_second(),
        notes: task.info.notes.clone(),
    };
    let json = serde_json::to_string_pretty(&metrics).expect("metrics serialize") + "\n";
    write_atomic(&dir.join(METRICS), json.as_bytes())?;
    Ok(TrainEnd::Finished(Box::new(metrics)))
}

/// The step of a run folder's latest checkpoint, as `checkpoints/latest` names it (`None`
/// before the first, or when the pointer is unreadable).
pub fn latest_checkpoint_step(dir: &Path) -> Option<usize> {
    let name = read_pointer(&dir.join(CHECKPOINTS)).ok()??;
    name.strip_prefix("step-")?.parse().ok()
}

/// The name `checkpoints/latest` holds, trimmed; `None` before the first checkpoint.
fn read_pointer(root: &Path) -> Result<Option<String>> {
    match crate::io::read_text_bounded(&root.join(LATEST), 1024, "checkpoint pointer") {
        Ok(n) => Ok(Some(n.trim().to_string())),
        Err(Error::Io { error, .. }) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

fn step_dir_name(step: usize) -> String {
    format!("step-{step:08}")
}

/// Writes a checkpoint folder atomically (a temporary folder renamed), points `latest` at it,
/// and removes all but the two newest.
fn save_checkpoint(
    dir: &Path,
    params: &ParamStore,
    checkpoint: &Checkpoint,
    config: &TrainRunConfig,
) -> Result<()> {
    let root = dir.join(CHECKPOINTS);
    let name = step_dir_name(checkpoint.state.steps);
    let tmp = root.join(format!(".{name}.{}.tmp", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    write_atomic(&tmp.join(CHECKPOINT_CONFIG), config.to_toml().as_bytes())?;
    params.save(tmp.join(saved::WEIGHTS), HashMap::new())?;
    save_tensors(
        &tmp.join("optimizer.safetensors"),
        checkpoint.optimizer.clone().into_iter().collect(),
        HashMap::from([("step".to_string(), checkpoint.optimizer_step.to_string())]),
    )?;
    if let Some(best) = &checkpoint.best_weights {
        save_tensors(
            &tmp.join("best.safetensors"),
            best.clone().into_iter().collect(),
            HashMap::new(),
        )?;
    }
    let state = serde_json::to_string(&checkpoint.state).expect("state serializes");
    write_atomic(&tmp.join("state.json"), state.as_bytes())?;
    let target = root.join(&name);
    if target.exists() {
        std::fs::remove_dir_all(&target).map_err(|e| Error::io(&target, e))?;
    }
    std::fs::rename(&tmp, &target).map_err(|e| Error::io(&target, e))?;
    write_atomic(&root.join(LATEST), name.as_bytes())?;
    // Keep the two newest: the latest, and one before it in case the latest is damaged later.
    let mut steps: Vec<String> = std::fs::read_dir(&root)
        .map_err(|e| Error::io(&root, e))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("step-"))
        .collect();
    steps.sort();
    for old in steps.iter().rev().skip(2) {
        let _ = std::fs::remove_dir_all(root.join(old));
    }
    Ok(())
}

/// The latest usable checkpoint, its weights loaded into `params`; `None` if the run has none
/// yet. When the latest is damaged (truncated by a full disk, say), the older one kept beside it
/// is used, and a note says so. `checkpoints/latest` must name a checkpoint of this folder.
fn load_latest(
    dir: &Path,
    params: &ParamStore,
    config: &TrainRunConfig,
) -> Result<Option<Checkpoint>> {
    let root = dir.join(CHECKPOINTS);
    let latest = root.join(LATEST);
    let Some(name) = read_pointer(&root)? else {
        return Ok(None);
    };
    let valid = |n: &str| {
        n.strip_prefix("step-")
            .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
    };
    if !valid(&name) {
        return Err(Error::Checkpoint {
            path: latest,
            message: format!(
                "names `{name}`, not a checkpoint of this run (step-NNNNNNNN): the file was \
                 edited or damaged; write the name of a folder in {} into it",
                root.display()
            ),
        });
    }
    // The latest first, then the older ones kept, newest first.
    let mut candidates: Vec<String> = std::fs::read_dir(&root)
        .map_err(|e| Error::io(&root, e))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| valid(n) && *n < name)
        .collect();
    candidates.sort();
    candidates.reverse();
    candidates.insert(0, name);
    let mut failures = Vec::new();
    for name in candidates {
        match load_checkpoint(&root.join(&name), params, config) {
            Ok(checkpoint) => {
                if !failures.is_empty() {
                    crate::io::note(&format!(
                        "note: resuming from {name}: {}",
                        failures.join("; ")
                    ));
                }
                return Ok(Some(checkpoint));
            }
            // A checkpoint of other settings is not damage: it is refused outright.
            Err(e @ Error::Config(_)) => return Err(e),
            Err(e) => failures.push(format!("{name} is unusable ({e})")),
        }
    }
    Err(Error::Checkpoint {
        path: root,
        message: format!(
            "no usable checkpoint: {}; start the run again in a new folder",
            failures.join("; ")
        ),
    })
}

/// One checkpoint folder, its weights loaded into `params` (only once everything in it has
/// been read and checked).
fn load_checkpoint(
    folder: &Path,
    params: &ParamStore,
    config: &TrainRunConfig,
) -> Result<Checkpoint> {
    // The settings it was saved under must be the run's: an edited train.toml would continue
    // a different run from these weights.
    let saved_config = folder.join(CHECKPOINT_CONFIG);
    if saved_config.exists() {
        let saved = TrainRunConfig::load(&saved_config)?;
        let (a, b) = (
            toml::Value::try_from(&saved).expect("a config is TOML"),
            toml::Value::try_from(config).expect("a config is TOML"),
        );
        if let Some(diff) = crate::io::first_difference("", &a, &b) {
            return Err(Error::Config(format!(
                "{TRAIN_CONFIG} was edited after the run started ({diff}: checkpoint vs now): \
                 a resumed run must keep its settings; restore them, or start a new run with \
                 the new ones"
            )));
        }
    }
    // The moments m and v of every variable, and at most one copy of the weights.
    let params_count = params.num_params() as u128;
    let (optimizer, meta) = load_tensors(&folder.join("optimizer.safetensors"), 2 * params_count)?;
    let optimizer_step = meta
        .get("step")
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| Error::Checkpoint {
            path: folder.join("optimizer.safetensors"),
            message: "no optimizer step in its metadata".into(),
        })?;
    let best_path = folder.join("best.safetensors");
    let best_weights = if best_path.exists() {
        Some(load_tensors(&best_path, params_count)?.0)
    } else {
        None
    };
    let state_path = folder.join("state.json");
    let text =
        crate::io::read_text_bounded(&state_path, crate::io::MAX_CONFIG_BYTES, "trainer state")?;
    let state: TrainState = serde_json::from_str(&text).map_err(|e| Error::Checkpoint {
        path: state_path,
        message: format!("unreadable trainer state: {e}"),
    })?;
    // The weights last: `load` changes nothing unless the whole file matches.
    params.load(folder.join(saved::WEIGHTS))?;
    Ok(Checkpoint {
        state,
        optimizer,
        optimizer_step,
        best_weights,
    })
}
