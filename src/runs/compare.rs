//! Training and testing every selected cell of an experiment.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use candle::Device;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::folder::{self, CellRecord, FolderKind, Rescored, SelectionRecord, CONFIG_TOML};
use super::job::{Job, JobEnd, Steps};
use super::prepare::{prepare, Prepared};
use super::results::{CellResult, Evaluation, Outcome, Results, Timing, TrainSummary, VariantInfo};
use super::{ExperimentConfig, Selection, VariantSpec};
use crate::config::ModelConfig;
use crate::device::{device_kind, device_name};
use crate::error::{Error, Result};
use crate::params::ParamStore;
use crate::positional::RopeScaling;
use crate::progress::{self, Board, Progress};
use crate::train::{planned_steps, Trainer};

/// Where and how to run.
#[derive(Clone)]
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
    /// core is fastest.
    pub jobs: usize,
    /// Threads per job: each job computes on a rayon pool of its own this wide
    /// ([`crate::nn::with_threads`]), which the fused kernels and their matrix multiplies split
    /// their work over. The results do not depend on it. `None`: the cores shared out among
    /// the jobs, at least one each.
    pub threads: Option<usize>,
    /// Replace the run already in `dir` (only the files it wrote) instead of continuing it.
    pub overwrite: bool,
    /// The kernels and instruction sets the cells compute with. The kernels agree to within
    /// rounding, not bit for bit: continue a run with the kernels it started with.
    pub backend: crate::nn::Backend,
    /// How large the models, tasks and batches may be.
    pub limits: crate::limits::Limits,
    /// For tests: SIGKILL the process at this point (`cell-I-step-S`, `cell-I-saved`,
    /// `cell-I-record` with the record half written, `cell-I-done`, `report`; `I` counts the
    /// selection's cells from 0), or SIGINT it there (`int:` before the point).
    #[doc(hidden)]
    pub kill_at: Option<String>,
}

impl RunOptions {
    /// Where the run's models compute: its device and backend.
    pub fn compute(&self) -> crate::nn::Compute<'_> {
        crate::nn::Compute {
            device: &self.device,
            backend: self.backend,
        }
    }

    /// Every cell on `device` into `dir`, one job, quietly, continuing a run already there.
    pub fn new(device: Device, dir: impl Into<PathBuf>) -> Self {
        Self {
            device,
            dir: dir.into(),
            selection: Selection::default(),
            progress: Progress::Quiet,
            jobs: 1,
            threads: None,
            overwrite: false,
            backend: crate::nn::Backend::default(),
            limits: crate::limits::Limits::default(),
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

/// What the cells of a run share.
struct Shared<'a> {
    config: &'a ExperimentConfig,
    options: &'a RunOptions,
    multi: &'a MultiProgress,
    board: &'a Board,
    style: ProgressStyle,
    threads: String,
}

/// SIGKILLs the process at `point` when `options.kill_at` names it (SIGINTs it, as a Ctrl-C,
/// where it reads `int:POINT`): how the tests show that a run stopped there resumes to the
/// results of one that never stopped.
fn kill_point(options: &RunOptions, point: impl FnOnce() -> String) {
    #[cfg(unix)]
    if let Some(at) = &options.kill_at {
        let (signal, at) = match at.strip_prefix("int:") {
            Some(at) => (libc::SIGINT, at),
            None => (libc::SIGKILL, at.as_str()),
        };
        if at == point() {
            // SAFETY: kill(2) on this process's own id has no memory effects; SIGKILL cannot be
            // caught, so the process ends here as a `kill -9` from outside would end it; SIGINT
            // ends it as a Ctrl-C would (or is handled by whoever waits for it).
            unsafe {
                libc::kill(libc::getpid(), signal);
            }
            loop {
                std::thread::park();
            }
        }
    }
}

/// A cell's steps: its bar among the run's, the progress board, the kill points.
struct CellSteps<'a> {
    shared: &'a Shared<'a>,
    name: &'a str,
    index: usize,
}

impl Steps for CellSteps<'_> {
    fn begin(&mut self, trainer: &mut Trainer<'_>, _: &ParamStore) -> Result<ProgressBar> {
        // Styled and sized before it is added: a bar drawn at length 0 shows full.
        let bar = ProgressBar::new(trainer.planned_steps() as u64)
            .with_style(self.shared.style.clone())
            .with_prefix(self.name.to_string());
        let bar = self.shared.multi.add(bar);
        self.shared
            .board
            .start(self.name, 0, trainer.planned_steps());
        Ok(bar)
    }

    fn after_step(&mut self, trainer: &Trainer<'_>, _: &ParamStore) -> Result<bool> {
        let state = trainer.state();
        let loss = state.losses.last().copied().unwrap_or(f64::NAN);
        self.shared.board.step(self.name, state.steps, loss);
        let index = self.index;
        kill_point(self.shared.options, || {
            format!("cell-{index}-step-{}", state.steps)
        });
        Ok(true)
    }

    fn testing(&mut self, bar: &ProgressBar) {
        bar.finish_and_clear();
        self.shared.multi.remove(bar);
        self.shared.board.testing(self.name);
    }
}

/// Test scores as a log line's part: `name 97.5%, ...`.
fn scores_line(evaluations: &[Evaluation]) -> String {
    evaluations
        .iter()
        .map(|e| match &e.outcome {
            Outcome::Scored { accuracy, .. } => format!("{} {:.1}%", e.name, 100.0 * accuracy),
            Outcome::Unavailable { .. } => format!("{} n/a", e.name),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Trains, tests and saves cell `index` (its number in the run's selection) as one [`Job`];
/// the record is written by the caller, after the model.
fn run_cell(
    shared: &Shared,
    index: usize,
    task: &Prepared,
    variant: &VariantSpec,
    seed: u64,
) -> Result<(CellRecord, String)> {
    let Shared {
        config, options, ..
    } = shared;
    let name = super::results::cell_name(&task.spec.name, &variant.name, seed);
    let started = Instant::now();
    let model_config =
        config.model_config(variant, task.data.tokenizer.vocab_size(), task.table_rows());
    // What this seed draws: the weights, the batch order and dropout from its training seed,
    // and under `data_seed = "per_seed"` the training set too.
    let train_seed = variant.training_seed(seed);
    let drawn = match config.data_seed {
        super::DataScope::Fixed => None,
        super::DataScope::PerSeed => Some(task.training_draw(train_seed)?),
    };
    let job = Job {
        task,
        model: &model_config,
        train: &config.train,
        seed: train_seed,
        train_set: drawn.as_ref(),
        eval_batch: config
            .eval
            .batch_size
            .unwrap_or(2 * config.train.batch_size),
        device: &options.device,
        backend: options.backend,
    };
    let mut steps = CellSteps {
        shared,
        name: &name,
        index,
    };
    let JobEnd::Trained(trained) = job.run(None, &mut steps)? else {
        unreachable!("a cell's steps never stop it early")
    };
    let model_dir = folder::model_dir(&task.spec.name, &variant.name, seed);
    job.save(&options.dir.join(&model_dir), &trained, None)?;
    let info = variant_info(variant, &model_config);
    let result = CellResult {
        task: task.spec.name.clone(),
        variant: variant.name.clone(),
        seed,
        config_sha256: folder::config_sha256(config),
        summary: trained.summary.clone(),
        model_dir,
    };
    let scalings = &config.eval.rope_scaling;
    let rescored = rescore(&job, variant, scalings, &trained.params, &info, &result)?;

    let wall = started.elapsed().as_secs_f64();
    let outcome = &trained.outcome;
    let tokens_per_second = outcome.tokens_per_second();
    let mut line = format!(
        "{name}: {}; loss {:.3}, {tokens_per_second:.0} tok/s, {wall:.1} s",
        scores_line(&trained.summary.evaluations),
        outcome.final_loss()
    );
    for r in &rescored {
        line.push_str(&format!(
            "\n  {}: {}",
            r.variant.name,
            scores_line(&r.result.summary.evaluations)
        ));
    }
    let timing = Timing {
        task: task.spec.name.clone(),
        variant: variant.name.clone(),
        seed,
        device: format!("{} ({})", device_name(&options.device), shared.threads),
        train_seconds: outcome.train_seconds,
        tokens_per_second,
        wall_seconds: wall,
    };
    let record = CellRecord::new(task.info.clone(), info, result, rescored, timing);
    Ok((record, line))
}

/// How a variant is described in the results.
fn variant_info(variant: &VariantSpec, model_config: &ModelConfig) -> VariantInfo {
    VariantInfo {
        name: variant.name.clone(),
        positional: variant.positional.clone(),
        placement: {
            let mut placement = variant.positional.placement().name().to_string();
            if let Some(n) = variant.random_positions {
                placement += &format!(", random {n}");
            }
            if model_config.causal {
                placement += ", causal";
            }
            placement
        },
        d_model: model_config.d_model,
        token_dim: model_config.token_dim(),
        width: variant.positional.scheme().width(model_config.d_model),
        random_positions: variant.random_positions,
        layers: variant.layers.clone(),
        causal: model_config.causal,
    }
}

/// A RoPE cell's model tested again under each of `[eval] rope_scaling`: each a row of its
/// own (`info` and `result` with the scaling's name and scores), the same weights with the
/// rotation rescaled. Nothing for other schemes.
fn rescore(
    job: &Job,
    variant: &VariantSpec,
    scalings: &[RopeScaling],
    params: &ParamStore,
    info: &VariantInfo,
    result: &CellResult,
) -> Result<Vec<Rescored>> {
    let mut rows = Vec::new();
    for scaling in scalings {
        let Some(positional) = variant.positional.with_scaling(Some(scaling.clone())) else {
            return Ok(Vec::new());
        };
        let evaluations =
            job.task
                .evaluate_scaled(job.model, params, scaling, job.eval_batch, job.backend)?;
        let name = format!("{} + {}", variant.name, scaling.label());
        rows.push(Rescored {
            variant: VariantInfo {
                name: name.clone(),
                positional,
                ..info.clone()
            },
            result: CellResult {
                variant: name,
                summary: TrainSummary {
                    evaluations,
                    ..result.summary.clone()
                },
                ..result.clone()
            },
        });
    }
    Ok(rows)
}

/// `cpu` or `cuda` (the device's name without its ordinal): what a run folder's cells must all
/// have been computed on.
/// The folder plan of a compare run of `selected` cells.
fn plan<'a>(
    config: &'a ExperimentConfig,
    options: &RunOptions,
    selected: &[(usize, usize, u64)],
) -> folder::Plan<'a> {
    folder::Plan {
        kind: FolderKind::Compare,
        config,
        selection: SelectionRecord::of(&options.selection),
        cells: selected.to_vec(),
        device: Some(device_kind(&options.device)),
        kernels: Some(options.backend.kernels.name().into()),
        sources: Vec::new(),
        files: folder::compare_files(config, selected),
        planned: config.comparison_pairs(),
    }
}

/// What [`run`] would find in `options.dir`, looked at by the same rules and changing nothing.
#[derive(Clone, Debug, PartialEq)]
pub struct Preview {
    /// A new folder, a new run, a run replaced, or a run continued.
    pub folder: folder::Preview,
    /// For each selected cell (as [`ExperimentConfig::cells`] gives them): whether a usable
    /// record of it is there, so that the run would not train it.
    pub done: Vec<bool>,
    /// The records there that the run would not use, and why (it trains those cells again).
    pub notes: Vec<String>,
}

/// The newest folder under `runs_dir` named `compare-<config's name>-...` that holds this experiment's
/// run (the same config, the same cells of `options`) unfinished: where `poslab compare`
/// without `--out` continues instead of starting over in a new folder. Folders of another
/// config or other cells, finished runs and folders a running writer holds are passed over.
pub fn unfinished_run(
    config: &ExperimentConfig,
    options: &RunOptions,
    runs_dir: &std::path::Path,
) -> Result<Option<PathBuf>> {
    let Ok(entries) = std::fs::read_dir(runs_dir) else {
        return Ok(None);
    };
    let prefix = crate::io::run_dir_prefix("compare", &config.name);
    let mut candidates: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    // Named by their start, to the second: the newest last.
    candidates.sort();
    for dir in candidates.into_iter().rev() {
        let mut look = RunOptions::new(options.device.clone(), dir.clone());
        look.selection = options.selection.clone();
        look.backend = options.backend;
        look.limits = options.limits;
        let Ok(found) = preview(config, &look) else {
            continue;
        };
        let unfinished =
            found.done.iter().any(|done| !done) || !dir.join(folder::RESULTS_JSON).exists();
        if found.folder == folder::Preview::Resume && unfinished {
            return Ok(Some(dir));
        }
    }
    Ok(None)
}

/// How far the run in `dir` got: its finished cells and its cells, from its manifest (`None`
/// where it has none yet).
pub fn progress_of(dir: &std::path::Path) -> Option<(usize, usize)> {
    folder::progress_of(dir)
}

/// What [`run`] would do with `options.dir`: the error it would give (another config's run,
/// other cells, a running writer, files poslab did not write), or the cells it would find done
/// there. `poslab compare --dry-run` says this before anything is spent.
pub fn preview(config: &ExperimentConfig, options: &RunOptions) -> Result<Preview> {
    config.validate()?;
    config.check_limits(&options.limits)?;
    let selected = config.cells(&options.selection)?;
    let found = folder::preview(
        &options.dir,
        &plan(config, options, &selected),
        options.overwrite,
    )?;
    let notes = Mutex::new(Vec::new());
    let done = match found {
        folder::Preview::Resume => {
            folder::read_cells(&options.dir, config, &selected, &|cell, e| {
                if let Ok(mut n) = notes.lock() {
                    n.push(format!("cell {cell}: runs again ({e})"));
                }
            })
            .iter()
            .map(Option::is_some)
            .collect()
        }
        _ => vec![false; selected.len()],
    };
    Ok(Preview {
        folder: found,
        done,
        notes: notes.into_inner().unwrap_or_default(),
    })
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
    config.check_limits(&options.limits)?;
    let dir = &options.dir;
    let selected = config.cells(&options.selection)?;
    let opened = folder::open(dir, &plan(config, options, &selected), options.overwrite)?;
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
                Error::Cell { cell, cause } => Error::RunStopped {
                    cell,
                    cause,
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
    // The comparisons planned when the run began; any added since are exploratory.
    let plan = folder::comparison_plan(folder::read_manifest(dir)?.as_ref(), config);
    let (results, timings) = folder::assemble(config, records, &plan);
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
/// gives them) and checks every variant they pair with against each, as
/// [`prepare_task_checked`]. Returns the task indices in the order prepared, and the prepared
/// tasks.
pub(crate) fn prepare_checked<'a>(
    config: &'a ExperimentConfig,
    cells: &[(usize, usize, u64)],
    jobs: usize,
    options: &RunOptions,
) -> Result<(Vec<usize>, Vec<Prepared<'a>>)> {
    let (task_ids, variants) = tasks_and_variants(config, cells);
    let prepared = task_ids
        .iter()
        .map(|&t| {
            let compute = options.compute();
            prepare_task_checked(config, t, &variants, jobs, None, &options.limits, compute)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((task_ids, prepared))
}

/// The tasks of `cells` in their order, and the variants among them (in the config's order).
pub(crate) fn tasks_and_variants<'a>(
    config: &'a ExperimentConfig,
    cells: &[(usize, usize, u64)],
) -> (Vec<usize>, Vec<&'a VariantSpec>) {
    let mut task_ids: Vec<usize> = cells.iter().map(|c| c.0).collect();
    task_ids.dedup();
    let mut variant_ids: Vec<usize> = cells.iter().map(|c| c.1).collect();
    variant_ids.sort_unstable();
    variant_ids.dedup();
    let variants = variant_ids.iter().map(|&v| &config.variants[v]).collect();
    (task_ids, variants)
}

/// Generates task `t` of `config` and checks each of `variants` against it: randomized
/// positions that cover the inputs, a valid model, batches that fit the memory limit with
/// `jobs` cells training at once. With `sample`, the generated training split holds only its
/// first `sample[0]` examples and each other split its first `sample[1]` (a dry run's
/// [`crate::tasks::TaskSpec::generate_sample`]).
pub(crate) fn prepare_task_checked<'a>(
    config: &'a ExperimentConfig,
    t: usize,
    variants: &[&VariantSpec],
    jobs: usize,
    sample: Option<[usize; 2]>,
    limits: &crate::limits::Limits,
    compute: crate::nn::Compute<'_>,
) -> Result<Prepared<'a>> {
    let spec = &config.tasks[t];
    let data = match sample {
        Some([train, eval]) => spec.generate_sample(train, eval)?,
        None => spec.generate()?,
    };
    let task = prepare(spec, data, config.model.pooling, config.eval.shift, false)?;
    let eval_batch = config
        .eval
        .batch_size
        .unwrap_or(2 * config.train.batch_size);
    for variant in variants {
        let what = format!("variant `{}`", variant.name);
        task.check_random_positions(variant.random_positions, &what)?;
        let model =
            config.model_config(variant, task.data.tokenizer.vocab_size(), task.table_rows());
        model
            .validate()
            .and_then(|()| model.check_limits(limits))
            .map_err(|e| Error::Config(format!("{what}: {e}")))?;
        task.check_memory(
            &model.sizes_on(compute),
            config.train.batch_size,
            eval_batch,
            &what,
            jobs,
            limits,
        )?;
    }
    Ok(task)
}

/// Writes a trained cell's record into the run folder (with the kill points a test stops
/// at), and gives back the record and its report line.
fn commit_cell(
    options: &RunOptions,
    i: usize,
    (record, line): (CellRecord, String),
) -> Result<(CellRecord, String)> {
    kill_point(options, || format!("cell-{i}-saved"));
    folder::write_cell(&options.dir, &record, &|| {
        kill_point(options, || format!("cell-{i}-record"))
    })?;
    kill_point(options, || format!("cell-{i}-done"));
    Ok((record, line))
}

/// The bar over all cells.
fn overall_bar(multi: &MultiProgress, cells: usize) -> ProgressBar {
    let overall = multi.add(ProgressBar::new(cells as u64));
    overall.set_style(
        ProgressStyle::with_template(
            "{prefix:>12} [{bar:30}] {pos}/{len} cells, {elapsed} elapsed{msg}",
        )
        .expect("template")
        .progress_chars("=> "),
    );
    overall.set_prefix("compare");
    overall
}

/// `2 jobs x 1 thread`: how the cells share the machine.
fn threads_label(jobs: usize, threads: usize) -> String {
    let s = |n: usize| if n == 1 { "" } else { "s" };
    format!("{jobs} job{} x {threads} thread{}", s(jobs), s(threads))
}

/// A cell is done: the overall bar moves on with the time left, and its line is printed.
fn cell_finished(
    overall: &ProgressBar,
    multi: &MultiProgress,
    log: &(dyn Fn(&str) + Sync),
    line: &str,
) {
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
        log(line);
    } else {
        let _ = multi.println(line);
    }
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
    let jobs = options.jobs.clamp(1, cells_needed.len().max(1));
    let (task_ids, prepared) = prepare_checked(config, &cells_needed, jobs, options)?;
    for note in prepared.iter().filter_map(Prepared::unknown_tokens_note) {
        log(&format!("note: {note}"));
    }
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
    let overall = overall_bar(&multi, cells.len());
    // Each job's pool width.
    let threads = options
        .threads
        .unwrap_or_else(|| crate::nn::cores() / jobs)
        .max(1);
    let shared = Shared {
        config,
        options,
        multi: &multi,
        board: &board,
        style: ProgressStyle::with_template("{prefix:>40} [{bar:30}] {pos}/{len} steps {msg}")
            .expect("template")
            .progress_chars("=> "),
        threads: threads_label(jobs, threads),
    };

    let next = AtomicUsize::new(0);
    let outputs: Mutex<Vec<(usize, CellRecord)>> = Mutex::new(Vec::new());
    let failure: Mutex<Option<Error>> = Mutex::new(None);
    progress::with_lines(options.progress, &board, log, || {
        std::thread::scope(|scope| {
            for _ in 0..jobs {
                // Each job computes on a pool of its own, `threads` wide (see with_threads).
                scope.spawn(|| {
                    crate::nn::with_threads(threads, || loop {
                        let n = next.fetch_add(1, Ordering::SeqCst);
                        if n >= cells.len() || failure.lock().expect("lock").is_some() {
                            break;
                        }
                        let (i, t, variant, seed) = cells[n];
                        let name =
                            super::results::cell_name(&prepared[t].spec.name, &variant.name, seed);
                        let committed = run_cell(&shared, i, &prepared[t], variant, seed)
                            .and_then(|done| commit_cell(options, i, done));
                        board.finish(&name, committed.is_ok());
                        match committed {
                            Ok((record, line)) => {
                                cell_finished(&overall, &multi, log, &line);
                                outputs.lock().expect("lock").push((i, record));
                            }
                            Err(e) => {
                                failure.lock().expect("lock").get_or_insert(Error::Cell {
                                    cell: name,
                                    cause: Box::new(e),
                                });
                            }
                        }
                    })
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
