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
    /// Output folder (default: runs/<experiment>-report-<timestamp>); one that already holds a
    /// run or a report is refused unless --overwrite, and one of the merged folders always.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// With --out: clear the run or report already in that folder first.
    #[arg(long, requires = "out")]
    pub overwrite: bool,
}

pub fn run(args: Args) -> Result<()> {
    let Args {
        runs,
        out,
        overwrite,
    } = args;
    let runs = &runs;
    if let Some(dir) = &out {
        // Writing into a folder being merged would replace its own results with the merge's.
        let same = |a: &Path| match (a.canonicalize(), dir.canonicalize()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        };
        if let Some(run) = runs.iter().find(|r| same(r)) {
            anyhow::bail!(
                "--out {} is one of the run folders being merged ({}): write the report to a \
                 new folder",
                dir.display(),
                run.display()
            );
        }
    }
    let (results, timings, config) = report::merge_runs(runs)?;
    let dir = match out {
        Some(dir) => {
            experiment::run::prepare_out_dir(&dir, overwrite)
                .with_context(|| format!("preparing {}", dir.display()))?;
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
