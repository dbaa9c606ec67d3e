//! `poslab report`: run folders merged into one report.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use poslab::experiment::{self, report};

/// Merge the results of run folders (cells split across machines with --task, --variant,
/// --seed) into one report.
#[derive(clap::Args)]
pub struct Args {
    /// Run folders holding results.json.
    #[arg(required = true)]
    pub runs: Vec<PathBuf>,
    /// Output folder (default: runs/<experiment>-report-<timestamp>).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<()> {
    let Args { runs, out } = args;
    let runs = &runs;
    let (results, timings, config) = report::merge_runs(runs)?;
    let dir = match out {
        Some(dir) => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            dir
        }
        None => {
            experiment::new_run_dir(Path::new("runs"), &format!("{}-report", results.experiment))?
        }
    };
    poslab::io::write_atomic(&dir.join(report::CONFIG_TOML), config.to_toml().as_bytes())?;
    let table = report::write_report(&dir, &results, &timings, runs)?;
    outln!("{table}");
    outln!(
        "merged {} run folders ({} cells) into {}",
        runs.len(),
        results.cells.len(),
        dir.display()
    );
    Ok(())
}
