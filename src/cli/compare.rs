//! `poslab compare`: every variant of an experiment trained under identical conditions, and
//! the report.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use poslab::progress::{human_duration, Progress};
use poslab::render::table::TextTable;
use poslab::runs::{self, compare, estimate, ExperimentConfig, Selection};

use super::Compute;

/// Train every positional variant of an experiment on the same data, seeds and budget, and
/// report scores by input length, the shuffle and shift tests, parameters and speed.
///
/// Each finished cell (task x variant x seed) is kept in the run folder as it finishes. A run
/// that was stopped (killed, preempted, timed out) continues when the same command is run again
/// with the same --out: finished cells are skipped, and the results are those of a run that
/// never stopped, byte for byte.
#[derive(clap::Args)]
pub struct Args {
    /// Experiment config (TOML). Default: configs/compare.toml, embedded in the binary.
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub compute: Compute,
    /// Run only this task (repeatable).
    #[arg(long = "task", value_name = "NAME")]
    pub tasks: Vec<String>,
    /// Run only this variant (repeatable).
    #[arg(long = "variant", value_name = "NAME")]
    pub variants: Vec<String>,
    /// Run only this seed (repeatable).
    #[arg(long = "seed", value_name = "N")]
    pub seeds: Vec<u64>,
    /// Run only the K-th of N deterministic slices of the cells, K counting from 0 (0/4 .. 3/4):
    /// cell i (in report order: task, seed, variant) belongs to slice i % N. Give each slice
    /// its own --out, then merge the folders with `poslab report`; see examples/cluster/ for
    /// Slurm and Kubernetes.
    #[arg(long, value_name = "K/N")]
    pub shard: Option<runs::Shard>,
    /// Where run folders are made.
    #[arg(long, default_value = "runs")]
    pub runs_dir: PathBuf,
    /// The exact run folder (instead of runs/compare-<name>-<timestamp>). The same command again into
    /// it continues the run there; a folder of another config or other cells is refused.
    /// Without it, the same command continues this config's newest unfinished run (the same
    /// cells) under --runs-dir, and starts a new folder only when there is none.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// With --out: start the run over, removing the run already in the folder (only the files
    /// it wrote; never another experiment's finished cells: another config takes the folder
    /// only from a run that stopped before any cell finished).
    #[arg(long, requires = "out")]
    pub overwrite: bool,
    /// Cells trained at once (default: one per CPU core, one thread each; 1 on CUDA).
    #[arg(long)]
    pub jobs: Option<usize>,
    /// No progress bars or progress lines.
    #[arg(long, short)]
    pub quiet: bool,
    /// Where standard error is not a terminal (a cluster job's log), print a progress line
    /// every this many seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = Progress::DEFAULT_EVERY.as_secs_f64())]
    pub log_every: f64,
    /// Check the whole experiment and list the cells it would run (this shard's with --shard),
    /// each with its estimated cost; train nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// --dry-run's time estimates assume this rate per job, in GFLOP/s (default: what small
    /// models reach here, 13-18; time one cell on your machine to set it).
    #[arg(long, value_name = "GFLOPS", default_value_t = 15.0)]
    pub gflops: f64,
    /// Testing: kill the process (SIGKILL) at this point of the run.
    #[arg(long, hide = true)]
    pub kill_at: Option<String>,
}

pub fn run(a: Args, interrupt: &super::interrupt::Interrupt) -> Result<()> {
    let selection = Selection {
        tasks: a.tasks.clone(),
        variants: a.variants.clone(),
        seeds: a.seeds.clone(),
        shard: a.shard,
    };
    let every = super::log_interval(a.log_every)?;
    let threads = a.compute.threads()?;
    let backend = a.compute.backend()?;
    let limits = super::limits()?;
    let started = Instant::now();
    let (config, source) = load(a.config.as_deref(), a.compute.dtype)?;
    let cells = config.cells(&selection)?.len();
    let device = a.compute.device.open()?;
    let mut look = compare::RunOptions::new(device.clone(), PathBuf::new());
    look.selection = selection.clone();
    look.limits = limits;
    look.backend = backend;
    if a.dry_run {
        return dry_run(&a, &config, &source, look);
    }
    let jobs = jobs(a.jobs, &device, cells)?;
    let (dir, created) = run_folder(&a, &config, &look, cells)?;
    say_on_interrupt(interrupt, &dir);
    let shard = selection.shard;
    errln!(
        "poslab compare: {source}{} on {} -> {}",
        shard.map_or(String::new(), |s| format!(", shard {s} ({cells} cells)")),
        poslab::device::device_name(&device),
        dir.display()
    );
    let options = compare::RunOptions {
        dir: dir.clone(),
        progress: Progress::for_stderr(a.quiet, every),
        jobs,
        threads,
        overwrite: a.overwrite,
        kill_at: a.kill_at.clone(),
        ..look
    };
    let output = match compare::run(&config, &options, &|line| errln!("{line}")) {
        Ok(output) => output,
        Err(e) => {
            // A start that failed (its data missing, say) leaves no folder behind.
            if created {
                super::discard_failed_start(&dir);
            }
            return Err(e.into());
        }
    };
    outln!("{}", output.table);
    outln!(
        "run folder: {} (report.html, report.md, results.csv, summary.csv, results.json, timing.json, plots/, models/)",
        dir.display()
    );
    if let Some(s) = shard {
        outln!(
            "this is shard {s} of the experiment: when all {} have run, merge their folders with \
             `poslab report FOLDERS... --out DIR`",
            s.count
        );
    }
    outln!("total time: {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// `--dry-run`: the experiment checked, the folder looked at exactly as the run looks at it,
/// and each cell's estimated cost.
fn dry_run(
    a: &Args,
    config: &ExperimentConfig,
    source: &str,
    look: compare::RunOptions,
) -> Result<()> {
    if !(a.gflops.is_finite() && a.gflops > 0.0) {
        anyhow::bail!(
            "--gflops {}: give a training rate above 0 GFLOP/s",
            a.gflops
        );
    }
    let jobs = a.jobs.unwrap_or(poslab::nn::cores());
    let found = match &a.out {
        Some(dir) => {
            let options = compare::RunOptions {
                dir: dir.clone(),
                overwrite: a.overwrite,
                ..look.clone()
            };
            Some((dir.clone(), compare::preview(config, &options)?))
        }
        None => None,
    };
    let compute = poslab::nn::Compute {
        device: &look.device,
        backend: look.backend,
    };
    let selection = &look.selection;
    let estimate = estimate::estimate(config, selection, jobs, &look.limits, compute)?;
    print_estimate(config, selection, estimate, source, a.gflops, jobs, found)
}

/// The run's folder, and whether this run makes it: `--out`, else this experiment's unfinished
/// run (one stopped by Ctrl-C, a kill or a crash), which the same command continues rather than
/// starting over, else a new folder.
fn run_folder(
    a: &Args,
    config: &ExperimentConfig,
    look: &compare::RunOptions,
    cells: usize,
) -> Result<(PathBuf, bool)> {
    if let Some(dir) = &a.out {
        return Ok((dir.clone(), false));
    }
    Ok(match compare::unfinished_run(config, look, &a.runs_dir)? {
        Some(dir) => {
            let (done, all) = compare::progress_of(&dir).unwrap_or((0, cells));
            errln!(
                "poslab compare: continuing the unfinished run in {} ({done} of {all} cells \
                 done); --out DIR runs elsewhere",
                dir.display()
            );
            (dir, false)
        }
        None => (
            poslab::io::new_run_dir(&a.runs_dir, "compare", &config.name)?,
            true,
        ),
    })
}

/// What Ctrl-C prints: how many cells are kept in `dir`, and the command that continues.
fn say_on_interrupt(interrupt: &super::interrupt::Interrupt, dir: &Path) {
    let command = super::interrupt::this_command(&["--overwrite"]);
    let at = dir.to_path_buf();
    interrupt.says(move || match compare::progress_of(&at) {
        Some((done, all)) => format!(
            "poslab compare: interrupted; {done} of {all} cells are done and kept in {}. The \
             same command continues there:\n  {command}",
            at.display()
        ),
        None => format!(
            "poslab compare: interrupted before the run began in {}; the same command starts \
             it:\n  {command}",
            at.display()
        ),
    });
}

/// The experiment at `path` (default: the embedded configs/compare.toml), with `--dtype`, and
/// how to name it.
fn load(
    path: Option<&Path>,
    dtype: Option<poslab::Precision>,
) -> Result<(ExperimentConfig, String)> {
    let (mut config, source) = match path {
        Some(p) => (ExperimentConfig::load(p)?, p.display().to_string()),
        None => (
            ExperimentConfig::from_toml_str(runs::DEFAULT_CONFIG)
                .context("the embedded configs/compare.toml")?,
            "configs/compare.toml (embedded default)".to_string(),
        ),
    };
    if let Some(dtype) = dtype {
        config.model.dtype = dtype;
    }
    Ok((config, source))
}

/// Cells trained at once. Small models train fastest as one single-threaded job per core; a
/// lone cell gets every core for its matrix multiplies.
fn jobs(asked: Option<usize>, device: &candle::Device, cells: usize) -> Result<usize> {
    if let Some(j) = asked {
        super::check_workers("--jobs", j, "cells at once")?;
    }
    let cores = poslab::nn::cores();
    let jobs = match (asked, device.is_cpu()) {
        (Some(j), _) => j,
        (None, true) => cores,
        (None, false) => 1,
    }
    .min(cells.max(1));
    Ok(jobs)
}

/// `--dry-run`: the experiment checked, what the run would find in its folder, and the cells
/// it would train with their estimated costs.
fn print_estimate(
    config: &ExperimentConfig,
    selection: &Selection,
    mut e: estimate::Estimate,
    source: &str,
    gflops: f64,
    jobs: usize,
    found: Option<(PathBuf, compare::Preview)>,
) -> Result<()> {
    print_selection(config, selection, &e, source)?;
    if let Some((dir, found)) = &found {
        print_found(dir, found, e.cells.len())?;
        let mut keep = found.done.iter().map(|&d| !d);
        e.cells.retain(|_| keep.next().unwrap_or(true));
    }
    print_costs(config, &e, gflops, jobs)
}

/// The dry run's first line: the experiment valid, and the cells the selection holds.
fn print_selection(
    config: &ExperimentConfig,
    selection: &Selection,
    e: &estimate::Estimate,
    source: &str,
) -> Result<()> {
    outln!(
        "{source}: valid; experiment `{}`: {} task{} x {} variant{} x {} seed{} = {} cell{}{}",
        config.name,
        config.tasks.len(),
        super::plural(config.tasks.len()),
        config.variants.len(),
        super::plural(config.variants.len()),
        config.seeds,
        super::plural(config.seeds as usize),
        e.experiment_cells,
        super::plural(e.experiment_cells),
        match selection.shard {
            Some(s) => format!("; shard {s} holds {} of them", e.cells.len()),
            None if e.cells.len() < e.experiment_cells => {
                format!("; the selection holds {}", e.cells.len())
            }
            None => String::new(),
        }
    );
    Ok(())
}

/// What the run would find in `--out DIR`, of its `selected` cells.
fn print_found(dir: &Path, found: &compare::Preview, selected: usize) -> Result<()> {
    {
        let done = found.done.iter().filter(|&&d| d).count();
        outln!(
            "--out {}: {}",
            dir.display(),
            match found.folder {
                runs::folder::Preview::NewFolder => "a new folder: the run makes it".to_string(),
                runs::folder::Preview::New => "holds no run: a new run starts there".to_string(),
                runs::folder::Preview::Replace => {
                    "holds a run that --overwrite replaces (only the files it wrote)".to_string()
                }
                runs::folder::Preview::Resume => format!(
                    "holds this run, which continues: {done} of {selected} cells done, {} to run",
                    selected - done
                ),
            }
        );
        for note in &found.notes {
            outln!("note: {note}");
        }
    }
    Ok(())
}

/// Each cell's estimated cost at `gflops` per job, and the total.
fn print_costs(
    config: &ExperimentConfig,
    e: &estimate::Estimate,
    gflops: f64,
    jobs: usize,
) -> Result<()> {
    let rate = gflops * 1e9;
    let seconds = |flop: f64| Duration::from_secs_f64((flop / rate).min(1e12));
    if !e.sampled.is_empty() {
        let [train, other] = estimate::DRY_RUN_SAMPLE;
        outln!(
            "costs of {} from a sample (each task's first {train} training examples and {other} \
             of each other split, every length of a test range), scaled to the whole splits",
            match e.sampled.len() == config.tasks.len() {
                true => "every task".to_string(),
                false => e.sampled.join(", "),
            }
        );
    }
    outln!(
        "estimated cost at {gflops} GFLOP/s per job (the default is what the small length suite \
         and the default compare reach on one core of a 2-core cloud VM, 13-18, as the book's \
         performance page records; --gflops sets it):\n"
    );
    let mut table = TextTable::new(
        [
            "cell",
            "params",
            "steps",
            "tokens/step",
            "train GFLOP",
            "test GFLOP",
            "est. time",
        ],
        [false, true, true, true, true, true, true],
    );
    for c in &e.cells {
        table.push([
            c.name.clone(),
            c.params.to_string(),
            c.steps.to_string(),
            format!("{:.0}", c.tokens_per_step),
            format!("{:.1}", c.train_flop / 1e9),
            format!("{:.1}", c.eval_flop / 1e9),
            human_duration(seconds(c.flop())),
        ]);
    }
    out!("{}", table.text());
    let total: f64 = e.cells.iter().map(|c| c.flop()).sum();
    let jobs = jobs.clamp(1, e.cells.len().max(1));
    outln!(
        "\ntotal: {} cells, {:.1} TFLOP: about {} for one job, {} with {jobs} jobs at once",
        e.cells.len(),
        total / 1e12,
        human_duration(seconds(total)),
        human_duration(seconds(total / jobs as f64))
    );
    Ok(())
}
