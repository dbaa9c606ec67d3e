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

use candle::{DType, Device};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};

use super::results::Evaluation;
use super::run::prepare;
use super::{EvalConfig, ModelShape, VariantSpec};
use crate::error::{Error, Result};
use crate::io::write_atomic;
use crate::model::TaskModel;
use crate::params::{load_tensors, save_tensors, ParamStore};
use crate::positional::PositionalConfig;
use crate::saved::{self, SavedConfig};
use crate::tasks::TaskSpec;
use crate::text::{HubSource, TextTokenizer};
use crate::train::{Checkpoint, TrainConfig, TrainState, Trainer};

pub const TRAIN_CONFIG: &str = "train.toml";
pub const METRICS: &str = "metrics.json";
pub const CHECKPOINTS: &str = "checkpoints";
const LATEST: &str = "latest";

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
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainRunConfig {
    pub name: String,
    #[serde(default)]
    pub seed: u64,
    #[serde(default = "d_checkpoint_every")]
    pub checkpoint_every: usize,
    pub model: ModelShape,
    pub positional: PositionalConfig,
    /// Rows of a learned table; default: the longest training input (or the task's max_tokens).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_len: Option<usize>,
    /// Randomized positions drawn from `[0, N)` (Ruoss et al. 2023).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub random_positions: Option<usize>,
    pub train: TrainConfig,
    #[serde(default)]
    pub eval: EvalConfig,
    pub task: TaskSpec,
}

impl TrainRunConfig {
    fn variant(&self) -> VariantSpec {
        VariantSpec {
            name: self.positional.name().into(),
            positional: self.positional.clone(),
            d_model: None,
            embed_scale: None,
            token_init_std: None,
            max_len: self.max_len,
            random_positions: self.random_positions,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.name.is_empty() {
            return Err(Error::Config("name must not be empty".into()));
        }
        self.train.validate()?;
        self.task.validate()?;
        self.model
            .model_config(&self.variant(), 8, self.max_len.unwrap_or(1))
            .validate()
    }

    pub fn from_toml_str(text: &str) -> Result<Self> {
        let config: Self = crate::config::parse_toml(text)?;
        config.validate()?;
        Ok(config)
    }

    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_toml_str(&text).map_err(|e| e.in_file(path))
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("a train config serializes")
    }
}

/// How to run.
pub struct TrainOptions {
    /// The run folder.
    pub dir: PathBuf,
    pub device: Device,
    pub progress: bool,
    /// Stop (after saving a checkpoint) once this many steps are done: what a kill between
    /// checkpoints would leave, on purpose.
    pub stop_after: Option<usize>,
    pub hub: HubSource,
}

/// The record of a finished run, `metrics.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Metrics {
    pub name: String,
    pub task: String,
    pub positional: PositionalConfig,
    pub seed: u64,
    pub params: usize,
    pub steps: usize,
    pub tokens: usize,
    pub kept_step: usize,
    pub stopped_early: bool,
    pub final_train_loss: f64,
    /// `(step, validation accuracy)`.
    pub validation: Vec<[f64; 2]>,
    /// Test scores: by length, shuffled, shifted (as in `poslab compare`).
    pub evaluations: Vec<Evaluation>,
    pub train_seconds: f64,
    pub tokens_per_second: f64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

/// How a call ended.
#[derive(Clone, Debug, PartialEq)]
pub enum TrainEnd {
    Finished(Box<Metrics>),
    /// Stopped by `stop_after`, a checkpoint saved at `step`.
    Stopped {
        step: usize,
    },
}

/// Starts a new run in `options.dir` (which must not hold one already).
pub fn start(config: &TrainRunConfig, options: &TrainOptions) -> Result<TrainEnd> {
    config.validate()?;
    let dir = &options.dir;
    if dir.join(TRAIN_CONFIG).exists() {
        return Err(Error::Input(format!(
            "{} already holds a run: continue it with `poslab train --resume {}`, or choose another --out",
            dir.display(),
            dir.display()
        )));
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    write_atomic(&dir.join(TRAIN_CONFIG), config.to_toml().as_bytes())?;
    let data = config.task.generate_with(&options.hub, None)?;
    data.tokenizer.save(dir.join(saved::TOKENIZER))?;
    run(config, data, options, false)
}

/// Continues the run in `options.dir` from its latest checkpoint (from the start if it stopped
/// before the first), with the config and tokenizer it saved.
pub fn resume(options: &TrainOptions) -> Result<TrainEnd> {
    let dir = &options.dir;
    if dir.join(METRICS).exists() {
        return Err(Error::Input(format!(
            "{} has already finished (metrics.json exists)",
            dir.display()
        )));
    }
    let config = TrainRunConfig::load(dir.join(TRAIN_CONFIG))?;
    let tokenizer = TextTokenizer::from_file(dir.join(saved::TOKENIZER))?;
    let data = config.task.generate_with(&options.hub, Some(tokenizer))?;
    run(&config, data, options, true)
}

fn run(
    config: &TrainRunConfig,
    data: crate::tasks::TaskData,
    options: &TrainOptions,
    resuming: bool,
) -> Result<TrainEnd> {
    let dir = &options.dir;
    let task = prepare(&config.task, data, config.model.pooling, config.eval.shift)?;
    task.check_random_positions(config.random_positions, &config.name)?;
    let tok = &task.data.tokenizer;
    let model_config =
        config
            .model
            .model_config(&config.variant(), tok.vocab_size(), task.table_rows());
    let params = ParamStore::new(config.seed);
    let model = TaskModel::new(
        &model_config,
        &task.head,
        params.var_builder(DType::F32, &options.device),
    )?;
    let train_data = task.train_data();
    let mut trainer = Trainer::new(&model, &params, &train_data, &config.train, config.seed)?;
    if resuming {
        if let Some(checkpoint) = load_latest(dir, &params)? {
            trainer.restore(&checkpoint)?;
        }
    }

    let bar = if options.progress {
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
    bar.set_prefix(config.name.clone());
    bar.set_position(trainer.state().steps as u64);
    while !trainer.finished() {
        trainer.step(&bar)?;
        let steps = trainer.state().steps;
        let stop = options.stop_after.is_some_and(|n| steps >= n);
        let due = config.checkpoint_every > 0 && steps % config.checkpoint_every == 0;
        if (due || stop) && !trainer.finished() {
            save_checkpoint(dir, &params, &trainer.checkpoint())?;
        }
        if stop && !trainer.finished() {
            bar.finish_and_clear();
            return Ok(TrainEnd::Stopped { step: steps });
        }
    }
    bar.finish_and_clear();
    let outcome = trainer.finish()?;
    let eval_batch = config
        .eval
        .batch_size
        .unwrap_or(2 * config.train.batch_size);
    let evaluations = task.evaluate(&model, eval_batch)?;
    saved::save(
        dir,
        &params,
        tok,
        &SavedConfig {
            format: saved::FORMAT.into(),
            model: model_config,
            head: task.head.clone(),
            objective: task.data.objective.clone(),
            task: config.task.name.clone(),
            seed: config.seed,
            task_spec: Some(config.task.clone()),
        },
    )?;
    let metrics = Metrics {
        name: config.name.clone(),
        task: config.task.name.clone(),
        positional: config.positional.clone(),
        seed: config.seed,
        params: params.num_params(),
        steps: outcome.steps,
        tokens: outcome.tokens,
        kept_step: outcome.kept_step,
        stopped_early: outcome.stopped_early,
        final_train_loss: outcome.final_loss(),
        validation: outcome
            .validation
            .iter()
            .map(|(s, v)| [*s as f64, v.accuracy])
            .collect(),
        evaluations,
        train_seconds: outcome.train_seconds,
        tokens_per_second: outcome.tokens as f64 / outcome.train_seconds.max(1e-9),
        notes: task.info.notes.clone(),
    };
    let json = serde_json::to_string_pretty(&metrics).expect("metrics serialize") + "\n";
    write_atomic(&dir.join(METRICS), json.as_bytes())?;
    Ok(TrainEnd::Finished(Box::new(metrics)))
}

fn step_dir_name(step: usize) -> String {
    format!("step-{step:08}")
}

/// Writes a checkpoint folder atomically (a temporary folder renamed), points `latest` at it,
/// and removes all but the two newest.
fn save_checkpoint(dir: &Path, params: &ParamStore, checkpoint: &Checkpoint) -> Result<()> {
    let root = dir.join(CHECKPOINTS);
    let name = step_dir_name(checkpoint.state.steps);
    let tmp = root.join(format!(".{name}.{}.tmp", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
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

/// The latest checkpoint, its weights loaded into `params`; `None` if the run has none yet.
fn load_latest(dir: &Path, params: &ParamStore) -> Result<Option<Checkpoint>> {
    let root = dir.join(CHECKPOINTS);
    let latest = root.join(LATEST);
    let name = match std::fs::read_to_string(&latest) {
        Ok(n) => n.trim().to_string(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(&latest, e)),
    };
    let folder = root.join(&name);
    params.load(folder.join(saved::WEIGHTS))?;
    let (optimizer, meta) = load_tensors(&folder.join("optimizer.safetensors"))?;
    let optimizer_step = meta
        .get("step")
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| Error::Checkpoint {
            path: folder.join("optimizer.safetensors"),
            message: "no optimizer step in its metadata".into(),
        })?;
    let best_path = folder.join("best.safetensors");
    let best_weights = if best_path.exists() {
        Some(load_tensors(&best_path)?.0)
    } else {
        None
    };
    let state_path = folder.join("state.json");
    let text = std::fs::read_to_string(&state_path).map_err(|e| Error::io(&state_path, e))?;
    let state: TrainState = serde_json::from_str(&text).map_err(|e| Error::Checkpoint {
        path: state_path,
        message: format!("unreadable trainer state: {e}"),
    })?;
    Ok(Some(Checkpoint {
        state,
        optimizer,
        optimizer_step,
        best_weights,
    }))
}
