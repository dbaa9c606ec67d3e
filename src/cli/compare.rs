//! `poslab compare`: every variant of an experiment trained under identical conditions, and
//! the report.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use poslab::experiment::{self, report, run, ExperimentConfig, Selection};

use super::Compute;

/// Train every positional variant of an experiment on the same data, seeds and budget, and
/// report scores by input length, the shuffle and shift tests, parameters and speed.
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
    /// its own --out, then merge the folders with `poslab report`. Maps onto a Slurm array
    /// (--shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT) or a Kubernetes Indexed Job
    /// (--shard $JOB_COMPLETION_INDEX/N); see examples/cluster/.
    #[arg(long, value_name = "K/N")]
    pub shard: Option<experiment::Shard>,
    /// Where run folders are made.
    #[arg(long, default_value = "runs")]
    pub runs_dir: PathBuf,
    /// The exact run folder to write (instead of runs/<name>-<timestamp>); one that holds
    /// another run is refused unless --overwrite.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// With --out: clear the run already in that folder (its results, report, plots and
    /// models) before this one is written.
    #[arg(long, requires = "out")]
    pub overwrite: bool,
    /// Cells trained at once (default: one per CPU core, one thread each; 1 on CUDA).
    #[arg(long)]
    pub jobs: Option<usize>,
    /// No progress bars.
    #[arg(long, short)]
    pub quiet: bool,
}

pub fn run(args: Args) -> Result<()> {
    let Args {
        config: path,
        compute,
        tasks,
        variants,
        seeds,
        shard,
        runs_dir,
        out,
        overwrite,
        jobs,
        quiet,
    } = args;
    let selection = Selection {
        tasks,
        variants,
        seeds,
        shard,
    };
    let path = path.as_deref();
    let started = Instant::now();
    let (mut config, source) = match path {
        Some(p) => (ExperimentConfig::load(p)?, p.display().to_string()),
        None => (
            ExperimentConfig::from_toml_str(experiment::DEFAULT_CONFIG)
                .context("the embedded configs/compare.toml")?,
            "configs/compare.toml (embedded default)".to_string(),
        ),
    };
    if let Some(dtype) = compute.dtype {
        config.model.dtype = dtype;
    }
    let cells = config.cells(&selection)?.len();
    let device = poslab::device::parse_device(&compute.device)?;
    // Small models train fastest as one single-threaded job per core; a lone cell gets every
    // core for its matrix multiplies. candle reads RAYON_NUM_THREADS at each multiply, so this
    // is set before any tensor work.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let jobs = match (jobs, device.is_cpu()) {
        (Some(j), _) => j.max(1),
        (None, true) => cores,
        (None, false) => 1,
    }
    .min(cells.max(1));
    if device.is_cpu() && std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", (cores / jobs).max(1).to_string());
    }
    let dir = match out {
        Some(dir) => {
            experiment::run::prepare_out_dir(&dir, overwrite)?;
            dir
        }
        None => experiment::new_run_dir(&runs_dir, &config.name)?,
    };
    poslab::io::write_atomic(&dir.join(report::CONFIG_TOML), config.to_toml().as_bytes())?;
    eprintln!(
        "poslab compare: {source}{} on {} -> {}",
        shard.map_or(String::new(), |s| format!(", shard {s} ({cells} cells)")),
        poslab::device::device_name(&device),
        dir.display()
    );
    let output = run::run(
        &config,
        &run::RunOptions {
            device,
            dir: dir.clone(),
            selection,
            progress: !quiet,
            jobs,
        },
        &|line| eprintln!("{line}"),
    )?;
    let table = report::write_report(&dir, &output.results, &output.timings, &[])?;
    outln!("{table}");
    outln!(
        "run folder: {} (report.md, results.csv, summary.csv, results.json, timing.json, plots/, models/)",
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
