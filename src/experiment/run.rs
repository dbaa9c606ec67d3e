//! Training and testing every selected cell of an experiment.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use candle::{DType, Device};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::folder::{self, CellRecord, FolderKind, Rescored, SelectionRecord, CONFIG_TOML};
use super::results::{
    shift_column, CellResult, Evaluation, Outcome, Results, TaskInfo, TestInfo, Timing,
    VariantInfo, SCORE, SHUFFLED,
};
use super::{ExperimentConfig, Selection, VariantSpec};
use crate::config::ModelConfig;
use crate::data::{Dataset, MlmMasking};
use crate::device::device_name;
use crate::error::{Error, Result};
use crate::model::{HeadConfig, Pooling, TaskModel};
use crate::params::ParamStore;
use crate::positional::{PositionalConfig, RopeOptions, RopeScaling};
use crate::progress::{self, Board, Progress};
use crate::rng::{self, derive_seed};
use crate::saved::{self, SavedConfig};
use crate::tasks::{Objective, TaskData, TaskSpec};
use crate::train::{evaluate, evaluate_by_length, planned_steps, TrainData, Trainer};

/// Where and how to run.
pub struct RunOptions {
    /// Where the cells train.
    pub device: Device,
    /// The run folder: the manifest (`run.json`), finished cells' records under `cells/`,
    /// trained models under `models/`, and the report (see [`folder`]).
    pub dir: PathBuf,
    /// Which cells to run.
    pub selection: Selection,
    /// How progress is shown.
    pub progress: Progress,
    /// Cells trained at the same time. Each cell has its own variables and generators, so the
    /// results do not depend on this; on a CPU with small models, one single-threaded job per
    /// core is fastest (set `RAYON_NUM_THREADS=1`, as the `poslab` binary does).
    pub jobs: usize,
    /// Replace the run already in `dir` (only the files it wrote) instead of continuing it.
    pub overwrite: bool,
    /// For tests: SIGKILL the process at this point (`cell-I-step-S`, `cell-I-saved`,
    /// `cell-I-record` with the record half written, `cell-I-done`, `report`; `I` counts the
    /// selection's cells from 0).
    #[doc(hidden)]
    pub kill_at: Option<String>,
}

impl RunOptions {
    /// Every cell on `device` into `dir`, one job, quietly, continuing a run already there.
    pub fn new(device: Device, dir: impl Into<PathBuf>) -> Self {
        Self {
            device,
            dir: dir.into(),
            selection: Selection::default(),
            progress: Progress::Quiet,
            jobs: 1,
            overwrite: false,
            kill_at: None,
        }
    }
}

/// Records of a run.
pub struct RunOutput {
    /// The results.
    pub results: Results,
    /// Every cell's timing.
    pub timings: Vec<Timing>,
    /// The printed report.
    pub table: String,
}

/// At most this many points per loss curve.
const CURVE_POINTS: usize = 200;

fn downsample(losses: &[f64]) -> Vec<[f64; 2]> {
    let window = losses.len().div_ceil(CURVE_POINTS).max(1);
    losses
        .chunks(window)
        .enumerate()
        .map(|(i, w)| {
            let step = (i * window + w.len()) as f64;
            [step, w.iter().sum::<f64>() / w.len() as f64]
        })
        .collect()
}

/// A test the model can run: data, position offset, MLM mask seed.
struct Test {
    name: String,
    /// Index into [`Prepared::sets`].
    set: usize,
    start: usize,
    mask_seed: u64,
}

/// A task generated and tokenized once, shared by all of its cells (and by `poslab train`).
pub(crate) struct Prepared<'a> {
    pub(crate) spec: &'a TaskSpec,
    pub(crate) data: TaskData,
    pub(crate) head: HeadConfig,
    pub(crate) masking: Option<MlmMasking>,
    pub(crate) train: Dataset,
    pub(crate) valid: Dataset,
    /// The test sets by length, then the shuffled copy of the base test set if any.
    sets: Vec<Dataset>,
    tests: Vec<Test>,
    pub(crate) info: TaskInfo,
}

/// Tokenizes `data` of `spec` into the splits, the head and the tests (by length, shuffled for
/// sentence labels, shifted by `shift`). With `template`, every text is framed by the
/// tokenizer's special tokens (`[CLS] ... [SEP]`), as a pretrained encoder reads it; first-token
/// pooling then reads its `[CLS]`.
pub(crate) fn prepare(
    spec: &TaskSpec,
    data: TaskData,
    pooling: Pooling,
    shift: usize,
    template: bool,
) -> Result<Prepared<'_>> {
    let tok = &data.tokenizer;
    let head = match &data.objective {
        Objective::Classify { labels } => HeadConfig::Classify {
            classes: labels.len(),
            pooling,
        },
        Objective::Tag { labels } => HeadConfig::Tag {
            classes: labels.len(),
        },
        Objective::Mlm { .. } => HeadConfig::Mlm,
    };
    let framing = head.framing(tok, template)?;
    let masking = match &data.objective {
        Objective::Mlm { mask_prob } => Some(MlmMasking::new(*mask_prob, tok)?),
        _ => None,
    };
    let train = Dataset::encode(&data.train, tok, framing, data.limit)?;
    let valid = Dataset::encode(&data.valid, tok, framing, data.limit)?;
    let mut sets = data
        .tests
        .iter()
        .map(|t| Dataset::encode(&t.examples, tok, framing, data.limit))
        .collect::<Result<Vec<_>>>()?;
    let mut notes = Vec::new();
    for (what, set) in [("training", &train), ("validation", &valid)]
        .into_iter()
        .chain(sets.iter().map(|s| ("test", s)))
    {
        if set.truncated > 0 {
            notes.push(format!(
                "{} of {} {what} examples were cut to max_tokens = {} (truncate = true)",
                set.truncated,
                set.samples.len(),
                data.limit.max_tokens.unwrap_or(0)
            ));
        }
    }
    // MLM masks (and randomized positions) of a test, the same for every model.
    let mask_seed = |t: &crate::tasks::TestSet| match t.factor {
        Some(factor) => derive_seed(spec.data_seed, "test masks", factor as u64),
        None => derive_seed(spec.data_seed, &format!("test masks {}", t.name), 0),
    };
    let mut tests: Vec<Test> = data
        .tests
        .iter()
        .enumerate()
        .map(|(i, t)| Test {
            name: t.name.clone(),
            set: i,
            start: 0,
            mask_seed: mask_seed(t),
        })
        .collect();
    // The order tests run on the test set at the training lengths (the first of a range list).
    let base = data
        .tests
        .iter()
        .position(|t| t.factor == Some(1))
        .unwrap_or(0);
    let base_seed = mask_seed(&data.tests[base]);
    let shuffle_test = matches!(data.objective, Objective::Classify { .. });
    if shuffle_test {
        let shuffled = sets[base]
            .with_shuffled_tokens(framing, &mut rng::stream(spec.data_seed, "shuffle test"));
        sets.push(shuffled);
        tests.push(Test {
            name: SHUFFLED.into(),
            set: sets.len() - 1,
            start: 0,
            mask_seed: base_seed,
        });
    }
    tests.push(Test {
        name: shift_column(shift),
        set: base,
        start: shift,
        mask_seed: base_seed,
    });
    let info = TaskInfo {
        name: spec.name.clone(),
        kind: spec.kind.name().into(),
        metric: data.objective.metric().into(),
        train_lengths: spec.lengths.unwrap_or_else(|| data.train_lengths()),
        tests: data
            .tests
            .iter()
            .map(|t| TestInfo {
                name: t.name.clone(),
                factor: t.factor,
                lengths: t.tested_lengths(),
            })
            .collect(),
        shift: Some(shift),
        shuffle_test,
        order_blind_ceiling: data.order_blind_ceiling.clone(),
        vocab_size: tok.vocab_size(),
        notes,
        score_above: matches!(spec.kind, crate::tasks::TaskKind::Algorithmic(_))
            .then(|| spec.lengths.map_or(0, |l| l[1])),
    };
    Ok(Prepared {
        spec,
        data,
        head,
        masking,
        train,
        valid,
        sets,
        tests,
        info,
    })
}

impl Prepared<'_> {
    /// Rows a learned table gets: the longest training input, or `max_tokens` when set.
    pub(crate) fn table_rows(&self) -> usize {
        self.train
            .max_len()
            .max(self.data.limit.max_tokens.unwrap_or(0))
    }

    /// The longest input of any split (training, validation, every test).
    pub(crate) fn longest_input(&self) -> usize {
        [&self.train, &self.valid]
            .into_iter()
            .chain(&self.sets)
            .map(Dataset::max_len)
            .max()
            .unwrap_or(0)
    }

    /// Refuses randomized positions drawn from fewer than the longest input's positions.
    pub(crate) fn check_random_positions(
        &self,
        random_positions: Option<usize>,
        what: &str,
    ) -> Result<()> {
        match random_positions {
            Some(n) if n < self.longest_input() => Err(Error::Config(format!(
                "{what}: random_positions = {n}, but task `{}` has inputs of {} tokens, which \
                 need as many distinct positions: set random_positions to at least {}",
                self.spec.name,
                self.longest_input(),
                self.longest_input()
            ))),
            _ => Ok(()),
        }
    }

    /// Refuses a model whose training or test batches would not fit the memory limit (see
    /// [`crate::limits`]), before anything trains.
    pub(crate) fn check_memory(
        &self,
        config: &ModelConfig,
        train_batch: usize,
        eval_batch: usize,
        what: &str,
    ) -> Result<()> {
        let training = [&self.train, &self.valid]
            .map(|s| s.max_len())
            .into_iter()
            .max()
            .unwrap_or(0);
        crate::limits::check_batch(
            &config.sizes(),
            train_batch,
            training,
            true,
            &format!("{what}: training"),
        )
        .map_err(Error::Config)?;
        let testing = self.sets.iter().map(Dataset::max_len).max().unwrap_or(0);
        crate::limits::check_batch(
            &config.sizes(),
            eval_batch,
            testing,
            false,
            &format!("{what}: testing"),
        )
        .map_err(Error::Config)
    }

    /// The token count of every example each test reads, test after test (the shift test
    /// reads its set again), and the validation set's.
    pub(crate) fn eval_lengths(&self) -> (Vec<usize>, Vec<usize>) {
        let tests = self
            .tests
            .iter()
            .flat_map(|t| self.sets[t.set].lengths())
            .collect();
        (tests, self.valid.lengths())
    }

    /// The data `train` needs.
    pub(crate) fn train_data(&self) -> TrainData<'_> {
        TrainData {
            train: &self.train,
            valid: &self.valid,
            pad_id: self.data.tokenizer.pad_id(),
            masking: self.masking.as_ref(),
        }
    }

    /// Every test of the task on `model`; a test whose inputs a learned table cannot hold is
    /// marked unavailable with the reason.
    pub(crate) fn evaluate(&self, model: &TaskModel, eval_batch: usize) -> Result<Vec<Evaluation>> {
        let evaluations = (0..self.tests.len())
            .map(|i| self.evaluate_test(model, i, eval_batch))
            .collect::<Result<Vec<_>>>()?;
        Ok(self.with_score(evaluations))
    }

    /// `evaluations` with the length suite's score inserted after the tests by length: the
    /// mean over every tested length above the training maximum (each length weighs the same,
    /// and counts once: where test sets overlap, as `eval_factors` 2 and 4 do, a length is
    /// scored by the first test that has it).
    fn with_score(&self, mut evaluations: Vec<Evaluation>) -> Vec<Evaluation> {
        let Some(above) = self.info.score_above else {
            return evaluations;
        };
        let mut lengths = std::collections::BTreeMap::new();
        let mut unavailable = None;
        for e in evaluations.iter().take(self.info.tests.len()) {
            match &e.outcome {
                Outcome::Scored { by_length, .. } => {
                    for s in by_length.iter().filter(|s| s.length > above) {
                        lengths.entry(s.length).or_insert(*s);
                    }
                }
                Outcome::Unavailable { reason } if reaches_above(&self.info, &e.name, above) => {
                    unavailable = Some(format!("test {}: {reason}", e.name));
                }
                Outcome::Unavailable { .. } => {}
            }
        }
        let outcome = match unavailable {
            Some(reason) => Outcome::Unavailable { reason },
            None if lengths.is_empty() => Outcome::Unavailable {
                reason: format!("no test length is above the training lengths (up to {above})"),
            },
            None => Outcome::by_length(lengths.into_values().collect()),
        };
        evaluations.insert(
            self.info.tests.len(),
            Evaluation {
                name: SCORE.into(),
                outcome,
            },
        );
        evaluations
    }

    /// The largest position (plus one) test `i` reads without randomized positions.
    fn reach(&self, i: usize) -> usize {
        let test = &self.tests[i];
        test.start + self.sets[test.set].max_len()
    }

    /// Test `i` on `model`.
    fn evaluate_test(&self, model: &TaskModel, i: usize, eval_batch: usize) -> Result<Evaluation> {
        let table_rows = model.encoder().max_positions();
        let pad = self.data.tokenizer.pad_id();
        let test = &self.tests[i];
        {
            {
                let set = &self.sets[test.set];
                // Randomized positions may reach any position below N.
                let reach = match model.encoder().config().random_positions {
                    Some(n) => test.start + n,
                    None => self.reach(i),
                };
                let outcome = match table_rows {
                    Some(rows) if reach > rows => Outcome::Unavailable {
                        reason: format!("the learned table has {rows} rows; these inputs reach position {reach}"),
                    },
                    _ if set.samples.iter().any(|s| s.tape.is_some()) => Outcome::by_length(
                        evaluate_by_length(model, set, pad, test.mask_seed, eval_batch, test.start)?,
                    ),
                    _ => {
                        let s = evaluate(model, set, pad, self.masking.as_ref(), test.mask_seed, eval_batch, test.start)?;
                        Outcome::scored(s.accuracy, s.loss)
                    }
                };
                Ok(Evaluation {
                    name: test.name.clone(),
                    outcome,
                })
            }
        }
    }

    /// Every test of a trained `rope` model re-scored under `scaling`, without retraining: the
    /// same weights, the frequencies rescaled per test (`factor = "auto"`: the test's largest
    /// position plus one over the training's longest input).
    pub(crate) fn evaluate_scaled(
        &self,
        model_config: &ModelConfig,
        params: &ParamStore,
        scaling: &RopeScaling,
        eval_batch: usize,
    ) -> Result<Vec<Evaluation>> {
        let PositionalConfig::Rope(options) = &model_config.positional else {
            return Err(Error::Config(format!(
                "rope scaling applies to rope models, not `{}`",
                model_config.positional.name()
            )));
        };
        let trained = self.train.max_len().max(1);
        let device = params
            .vars()
            .first()
            .map_or(Device::Cpu, |(_, v)| v.device().clone());
        (0..self.tests.len())
            .map(|i| {
                let auto = self.reach(i) as f64 / trained as f64;
                let scaled = ModelConfig {
                    positional: PositionalConfig::Rope(RopeOptions {
                        scaling: Some(scaling.resolved(auto, trained)),
                        ..options.clone()
                    }),
                    ..model_config.clone()
                };
                // Built from the same store: the trained variables, shared.
                let model =
                    TaskModel::new(&scaled, &self.head, params.var_builder(DType::F32, &device))?;
                self.evaluate_test(&model, i, eval_batch)
            })
            .collect::<Result<Vec<_>>>()
            .map(|e| self.with_score(e))
    }
}

/// Whether test `name` of `info` holds lengths above `above` (so the score needs it).
fn reaches_above(info: &TaskInfo, name: &str, above: usize) -> bool {
    info.tests
        .iter()
        .any(|t| t.name == name && t.lengths[1] > above)
}

/// What the cells of a run share.
struct Shared<'a> {
    config: &'a ExperimentConfig,
    options: &'a RunOptions,
    multi: &'a MultiProgress,
    board: &'a Board,
    style: ProgressStyle,
    threads: String,
}

/// SIGKILLs the process at `point` when `options.kill_at` names it: how the tests show that a
/// run killed there resumes to the results of one that never stopped.
fn kill_point(options: &RunOptions, point: impl FnOnce() -> String) {
    #[cfg(unix)]
    if let Some(at) = &options.kill_at {
        if *at == point() {
            // SAFETY: kill(2) on this process's own id has no memory effects; SIGKILL cannot be
            // caught, so the process ends here as a `kill -9` from outside would end it.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
            loop {
                std::thread::park();
            }
        }
    }
}

/// Trains, tests and saves cell `index` (its number in the run's selection); the record is
/// written by the caller, after the model.
fn run_cell(
    shared: &Shared,
    index: usize,
    task: &Prepared,
    variant: &VariantSpec,
    seed: u64,
) -> Result<(CellRecord, String)> {
    let Shared {
        config,
        options,
        board,
        ..
    } = shared;
    let device = &options.device;
    let tok = &task.data.tokenizer;
    let name = super::results::cell_name(&task.spec.name, &variant.name, seed);
    let started = Instant::now();
    let model_config = config.model_config(variant, tok.vocab_size(), task.table_rows());
    let params = ParamStore::new(seed);
    let model = TaskModel::new(
        &model_config,
        &task.head,
        params.var_builder(DType::F32, device),
    )?;
    let data = task.train_data();
    let mut trainer = Trainer::new(&model, &params, &data, &config.train, seed)?;
    // Styled and sized before it is added: a bar drawn at length 0 shows full.
    let bar = ProgressBar::new(trainer.planned_steps() as u64)
        .with_style(shared.style.clone())
        .with_prefix(name.clone());
    let bar = shared.multi.add(bar);
    board.start(&name, 0, trainer.planned_steps());
    while !trainer.finished() {
        trainer.step(&bar)?;
        let state = trainer.state();
        board.step(
            &name,
            state.steps,
            state.losses.last().copied().unwrap_or(f64::NAN),
        );
        kill_point(options, || format!("cell-{index}-step-{}", state.steps));
    }
    let outcome = trainer.finish()?;
    bar.finish_and_clear();
    shared.multi.remove(&bar);
    board.testing(&name);

    let eval_batch = config
        .eval
        .batch_size
        .unwrap_or(2 * config.train.batch_size);
    let evaluations = task.evaluate(&model, eval_batch)?;

    let model_dir = folder::model_dir(&task.spec.name, &variant.name, seed);
    saved::save(
        &options.dir.join(&model_dir),
        &params,
        tok,
        &SavedConfig {
            format: saved::FORMAT.into(),
            model: model_config.clone(),
            head: task.head.clone(),
            objective: task.data.objective.clone(),
            task: task.spec.name.clone(),
            seed,
            task_spec: Some(task.spec.clone()),
            init: None,
            special_tokens: false,
        },
    )?;

    let mut rescored = Vec::new();
    if matches!(variant.positional, PositionalConfig::Rope(_)) {
        for scaling in &config.eval.rope_scaling {
            let evaluations = task.evaluate_scaled(&model_config, &params, scaling, eval_batch)?;
            rescored.push((scaling.clone(), evaluations));
        }
    }

    let wall = started.elapsed().as_secs_f64();
    let tokens_per_second = outcome.tokens as f64 / outcome.train_seconds.max(1e-9);
    let scores = |evaluations: &[Evaluation]| {
        evaluations
            .iter()
            .map(|e| match &e.outcome {
                Outcome::Scored { accuracy, .. } => format!("{} {:.1}%", e.name, 100.0 * accuracy),
                Outcome::Unavailable { .. } => format!("{} n/a", e.name),
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut line = format!(
        "{name}: {}; loss {:.3}, {tokens_per_second:.0} tok/s, {wall:.1} s",
        scores(&evaluations),
        outcome.final_loss()
    );
    let info = VariantInfo {
        name: variant.name.clone(),
        positional: variant.positional.clone(),
        placement: match variant.random_positions {
            Some(n) => format!("{}, random {n}", variant.positional.placement()),
            None => variant.positional.placement().name().into(),
        },
        d_model: model_config.d_model,
        token_dim: model_config.token_dim(),
        width: variant.positional.scheme().width(model_config.d_model),
        random_positions: variant.random_positions,
        layers: variant.layers.clone(),
    };
    let result = CellResult {
        task: task.spec.name.clone(),
        variant: variant.name.clone(),
        seed,
        params: params.num_params(),
        d_model: model_config.d_model,
        max_len: model_config.max_len,
        steps: outcome.steps,
        tokens: outcome.tokens,
        kept_step: outcome.kept_step,
        stopped_early: outcome.stopped_early,
        final_train_loss: outcome.final_loss(),
        loss_curve: downsample(&outcome.losses),
        validation: outcome
            .validation
            .iter()
            .map(|(s, v)| [*s as f64, v.accuracy])
            .collect(),
        evaluations,
        model_dir,
    };
    // Each re-scoring is a row of its own: the same model, a rescaled RoPE.
    let rescored = rescored
        .into_iter()
        .map(|(scaling, evaluations)| {
            let name = format!("{} + {}", variant.name, scaling.label());
            line.push_str(&format!("\n  {name}: {}", scores(&evaluations)));
            let positional = match &variant.positional {
                PositionalConfig::Rope(o) => PositionalConfig::Rope(RopeOptions {
                    scaling: Some(scaling),
                    ..o.clone()
                }),
                other => other.clone(),
            };
            Rescored {
                variant: VariantInfo {
                    name: name.clone(),
                    positional,
                    ..info.clone()
                },
                result: CellResult {
                    variant: name,
                    evaluations,
                    ..result.clone()
                },
            }
        })
        .collect();
    let timing = Timing {
        task: task.spec.name.clone(),
        variant: variant.name.clone(),
        seed,
        device: format!("{} ({})", device_name(device), shared.threads),
        train_seconds: outcome.train_seconds,
        tokens_per_second,
        wall_seconds: wall,
    };
    let record = CellRecord::new(task.info.clone(), info, result, rescored, timing);
    Ok((record, line))
}

/// `cpu` or `cuda` (the device's name without its ordinal): what a run folder's cells must all
/// have been computed on.
fn device_kind(device: &Device) -> String {
    let name = device_name(device);
    name.split(':').next().unwrap_or(&name).to_string()
}

/// The results and timings of finished cells (in the selection's order), as `results.json` and
/// `timing.json` hold them: the same records give the same bytes, however many runs wrote them.
pub fn assemble(config: &ExperimentConfig, records: Vec<CellRecord>) -> (Results, Vec<Timing>) {
    let mut results = Results {
        experiment: config.name.clone(),
        tasks: Vec::new(),
        variants: Vec::new(),
        cells: Vec::new(),
        summary: Vec::new(),
        partial: None,
    };
    let mut timings = Vec::new();
    for record in records {
        if !results.tasks.iter().any(|t| t.name == record.task.name) {
            results.tasks.push(record.task);
        }
        let rows = std::iter::once((record.variant, record.result))
            .chain(record.rescored.into_iter().map(|r| (r.variant, r.result)));
        for (variant, result) in rows {
            if !results.variants.iter().any(|v| v.name == variant.name) {
                results.variants.push(variant);
            }
            results.cells.push(result);
        }
        timings.push(record.timing);
    }
    results.order_as(config);
    (results, timings)
}

/// Trains and tests every selected cell into `options.dir`, `options.jobs` at a time, and
/// writes the report there.
///
/// The folder is locked for the whole run and described by its manifest (see [`folder`]).
/// Each finished cell is committed as it finishes (its model, then its record), so a run that
/// is killed keeps its finished cells: the same call again into the same folder (same config,
/// same selection) trains only the rest, and ends with the `results.json` an uninterrupted run
/// writes, byte for byte. `log` receives one line per finished cell when no bars are drawn,
/// notes, and with [`Progress::Lines`] a progress line at each interval.
pub fn run(
    config: &ExperimentConfig,
    options: &RunOptions,
    log: &(dyn Fn(&str) + Sync),
) -> Result<RunOutput> {
    config.validate()?;
    let dir = &options.dir;
    let selected = config.cells(&options.selection)?;
    let plan = folder::Plan {
        kind: FolderKind::Compare,
        config,
        selection: SelectionRecord::of(&options.selection),
        cells: selected.clone(),
        device: Some(device_kind(&options.device)),
        sources: Vec::new(),
        files: folder::compare_files(config, &selected),
    };
    let opened = folder::open(dir, &plan, options.overwrite)?;
    crate::io::write_atomic(&dir.join(CONFIG_TOML), config.to_toml().as_bytes())?;
    // The cells an earlier run into this folder finished.
    let mut records: Vec<Option<CellRecord>> = if opened.resumed {
        let records = folder::read_cells(dir, config, &selected, &|cell, e| {
            log(&format!("note: cell {cell}: runs again ({e})"))
        });
        let done = records.iter().flatten().count();
        log(&format!(
            "resuming {}: {done} of {} cells were done before, {} to run",
            dir.display(),
            selected.len(),
            selected.len() - done
        ));
        records
    } else {
        vec![None; selected.len()]
    };
    let pending: Vec<usize> = (0..selected.len())
        .filter(|&i| records[i].is_none())
        .collect();

    if !pending.is_empty() {
        // A results.json says the folder is complete: not while cells are missing.
        let stale = dir.join(super::folder::RESULTS_JSON);
        if stale.exists() {
            std::fs::remove_file(&stale).map_err(|e| Error::io(&stale, e))?;
        }
        let fresh = train_cells(config, options, &selected, &pending, log).map_err(|e| {
            let done = folder::cells_done(dir, config, &selected);
            match e {
                Error::Cell { cell, source } => Error::RunStopped {
                    cell,
                    source,
                    done,
                    total: selected.len(),
                    dir: dir.clone(),
                },
                other => other,
            }
        })?;
        for (i, record) in fresh {
            records[i] = Some(record);
        }
    }
    let records: Vec<CellRecord> = records.into_iter().flatten().collect();
    let (results, timings) = assemble(config, records);
    let table = super::report::write_report_with(dir, &results, &timings, &[], &|| {
        kill_point(options, || "report".into())
    })?;
    drop(opened);
    Ok(RunOutput {
        results,
        timings,
        table,
    })
}

/// Generates the tasks of `cells` (indices into the config, as [`ExperimentConfig::cells`]
/// gives them) and checks every variant they pair with against each: randomized positions that
/// cover the inputs, a valid model, batches that fit the memory limit. Returns the task
/// indices in the order prepared, and the prepared tasks.
pub(crate) fn prepare_checked<'a>(
    config: &'a ExperimentConfig,
    cells: &[(usize, usize, u64)],
) -> Result<(Vec<usize>, Vec<Prepared<'a>>)> {
    let mut task_ids: Vec<usize> = cells.iter().map(|c| c.0).collect();
    task_ids.dedup();
    let mut variant_ids: Vec<usize> = cells.iter().map(|c| c.1).collect();
    variant_ids.sort_unstable();
    variant_ids.dedup();
    let variants: Vec<&VariantSpec> = variant_ids.iter().map(|&v| &config.variants[v]).collect();
    let prepared = task_ids
        .iter()
        .map(|&t| {
            let spec = &config.tasks[t];
            prepare(
                spec,
                spec.generate()?,
                config.model.pooling,
                config.eval.shift,
                false,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let eval_batch = config
        .eval
        .batch_size
        .unwrap_or(2 * config.train.batch_size);
    for task in &prepared {
        for variant in &variants {
            let what = format!("variant `{}`", variant.name);
            task.check_random_positions(variant.random_positions, &what)?;
            let model =
                config.model_config(variant, task.data.tokenizer.vocab_size(), task.table_rows());
            model
                .validate()
                .map_err(|e| Error::Config(format!("{what}: {e}")))?;
            task.check_memory(&model, config.train.batch_size, eval_batch, &what)?;
        }
    }
    Ok((task_ids, prepared))
}

/// Trains the `pending` cells (indices into `selected`), committing each as it finishes;
/// returns their records by index.
fn train_cells(
    config: &ExperimentConfig,
    options: &RunOptions,
    selected: &[(usize, usize, u64)],
    pending: &[usize],
    log: &(dyn Fn(&str) + Sync),
) -> Result<Vec<(usize, CellRecord)>> {
    // The tasks the pending cells need: only those are generated and checked.
    let cells_needed: Vec<(usize, usize, u64)> = pending.iter().map(|&i| selected[i]).collect();
    let (task_ids, prepared) = prepare_checked(config, &cells_needed)?;
    // Pending cells in report order: (index in the selection, index into `prepared`, variant,
    // seed).
    let cells: Vec<(usize, usize, &VariantSpec, u64)> = pending
        .iter()
        .map(|&i| {
            let (task, variant, seed) = selected[i];
            let t = task_ids.iter().position(|&x| x == task).expect("prepared");
            (i, t, &config.variants[variant], seed)
        })
        .collect();
    let steps: u64 = cells
        .iter()
        .map(|&(_, t, _, _)| planned_steps(&config.train, &prepared[t].train) as u64)
        .sum();
    let board = Board::new("compare", selected.len(), steps);
    board.done_before(selected.len() - pending.len());

    let multi = MultiProgress::with_draw_target(if options.progress.bars() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    });
    let overall = multi.add(ProgressBar::new(cells.len() as u64));
    overall.set_style(
        ProgressStyle::with_template(
            "{prefix:>12} [{bar:30}] {pos}/{len} cells, {elapsed} elapsed{msg}",
        )
        .expect("template")
        .progress_chars("=> "),
    );
    overall.set_prefix("compare");
    let jobs = options.jobs.clamp(1, cells.len().max(1));
    let shared = Shared {
        config,
        options,
        multi: &multi,
        board: &board,
        style: ProgressStyle::with_template("{prefix:>40} [{bar:30}] {pos}/{len} steps {msg}")
            .expect("template")
            .progress_chars("=> "),
        threads: format!(
            "{jobs} job{} x {} thread{}",
            if jobs == 1 { "" } else { "s" },
            candle::utils::get_num_threads(),
            if candle::utils::get_num_threads() == 1 {
                ""
            } else {
                "s"
            }
        ),
    };

    let next = AtomicUsize::new(0);
    let outputs: Mutex<Vec<(usize, CellRecord)>> = Mutex::new(Vec::new());
    let failure: Mutex<Option<Error>> = Mutex::new(None);
    let dir = &options.dir;
    progress::with_lines(options.progress, &board, log, || {
        std::thread::scope(|scope| {
            for _ in 0..jobs {
                scope.spawn(|| loop {
                    let n = next.fetch_add(1, Ordering::SeqCst);
                    if n >= cells.len() || failure.lock().expect("lock").is_some() {
                        break;
                    }
                    let (i, t, variant, seed) = cells[n];
                    let name =
                        super::results::cell_name(&prepared[t].spec.name, &variant.name, seed);
                    let committed = run_cell(&shared, i, &prepared[t], variant, seed).and_then(
                        |(record, line)| {
                            kill_point(options, || format!("cell-{i}-saved"));
                            folder::write_cell(dir, &record, &|| {
                                kill_point(options, || format!("cell-{i}-record"))
                            })?;
                            kill_point(options, || format!("cell-{i}-done"));
                            Ok((record, line))
                        },
                    );
                    board.finish(&name, committed.is_ok());
                    match committed {
                        Ok((record, line)) => {
                            overall.inc(1);
                            // The time left, once a cell has finished to estimate it from.
                            let (done, total) = (overall.position(), overall.length().unwrap_or(0));
                            if done > 0 && done < total {
                                // Wall time per finished cell, parallel jobs included.
                                let per = overall.elapsed().as_secs_f64() / done as f64;
                                let left = per * (total - done) as f64;
                                overall.set_message(format!(", about {}s left", left.round()));
                            }
                            if multi.is_hidden() {
                                log(&line);
                            } else {
                                let _ = multi.println(&line);
                            }
                            outputs.lock().expect("lock").push((i, record));
                        }
                        Err(e) => {
                            failure.lock().expect("lock").get_or_insert(Error::Cell {
                                cell: name,
                                source: Box::new(e),
                            });
                        }
                    }
                });
            }
        })
    });
    overall.finish_and_clear();
    if let Some(e) = failure.into_inner().expect("lock") {
        return Err(e);
    }
    Ok(outputs.into_inner().expect("lock"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn curves_keep_their_mean_and_length() {
        let losses: Vec<f64> = (0..1000).map(|i| i as f64).collect();
        let d = downsample(&losses);
        assert_eq!(d.len(), 200);
        assert_eq!(d[0], [5.0, 2.0]);
        assert_eq!(d[199], [1000.0, 997.0]);
        assert_eq!(downsample(&[1.0, 3.0]), vec![[1.0, 1.0], [2.0, 3.0]]);
    }
}
