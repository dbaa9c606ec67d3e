//! `poslab report`: run folders merged into one report.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use poslab::experiment::{self, report};

/// Merge the results of run folders (cells split across machines with --shard, --task,
/// --variant, --seed) into one report; folders of different configs are refused.
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
    // A merge of some shards only is a partial report: say what is missing.
    let expected = config.cells(&experiment::Selection::default())?;
    let missing: Vec<String> = expected
        .iter()
        .filter(|&&(t, v, seed)| {
            let (task, variant) = (&config.tasks[t].name, &config.variants[v].name);
            !results
                .cells
                .iter()
                .any(|c| (&c.task, &c.variant, c.seed) == (task, variant, seed))
        })
        .map(|&(t, v, seed)| {
            format!(
                "{}/{}/seed{seed}",
                config.tasks[t].name, config.variants[v].name
            )
        })
        .collect();
    if !missing.is_empty() {
        eprintln!(
            "note: {} of the experiment's {} cells are not in these folders (a shard or a \
             selection not run yet?), e.g. {}",
            missing.len(),
            expected.len(),
            missing
                .iter()
                .take(3)
                .cloned()
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    outln!(
        "merged {} run folders ({} cells) into {}",
        runs.len(),
        results.cells.len(),
        dir.display()
    );
    Ok(())
}
