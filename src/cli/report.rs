//! `poslab report`: run folders merged into one report.

use std::path::{Path, PathBuf};

use anyhow::Result;
use poslab::runs::folder::{self, FolderKind, Plan, SelectionRecord};
use poslab::runs::{merge, report};

/// Merge the results of run folders (cells split across machines with --shard, --task,
/// --variant, --seed) into one report. The merge is strict: folders of different configs,
/// cells the config does not name, a cell twice, scores out of range, and missing cells are
/// errors (missing cells unless --allow-partial).
#[derive(clap::Args)]
pub struct Args {
    /// Run folders holding results.json.
    #[arg(required = true)]
    pub runs: Vec<PathBuf>,
    /// Output folder (default: runs/report-<experiment>-<timestamp>); one that already holds a
    /// run or a report of this experiment is refused unless --overwrite, one of another
    /// experiment always, and so is one of the merged folders.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// With --out: replace the report (or run) of this experiment already in that folder
    /// (only the files it wrote).
    #[arg(long, requires = "out")]
    pub overwrite: bool,
    /// Merge even when cells are missing (unfinished runs contribute the cells they have). The
    /// report then says "partial: N of M cells" in report.md, results.json and on standard
    /// error, and poslab exits with status 3.
    #[arg(long)]
    pub allow_partial: bool,
    /// Also compare rows A and B (`--compare none,rope`; repeatable), as exploratory
    /// comparisons: chosen after the run, they get an interval and a p-value but no verdict,
    /// and stay out of the planned comparisons' Holm correction. Plan comparisons before a run
    /// with the config's `[[comparisons]]`.
    #[arg(long = "compare", value_name = "A,B", value_parser = parse_pair)]
    pub compare: Vec<(String, String)>,
}

/// `A,B`: two rows of the experiment.
fn parse_pair(s: &str) -> std::result::Result<(String, String), String> {
    match s.split_once(',') {
        Some((a, b)) if !a.trim().is_empty() && !b.trim().is_empty() => {
            Ok((a.trim().to_string(), b.trim().to_string()))
        }
        _ => Err(format!(
            "{s:?}: give two rows separated by a comma, a then b (`--compare none,rope` reports \
             rope − none)"
        )),
    }
}

/// A partial merge was written (`--allow-partial`): exit status 3.
#[derive(Debug)]
pub struct PartialMerge;

impl std::fmt::Display for PartialMerge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the merge is partial")
    }
}

impl std::error::Error for PartialMerge {}

/// Each run folder given once, and `--out` none of them: the same folder twice would merge
/// each of its cells with itself, and writing into a folder being merged would replace its own
/// results with the merge's.
fn check_folders(runs: &[std::path::PathBuf], out: Option<&Path>) -> Result<()> {
    let places: Vec<Option<std::path::PathBuf>> =
        runs.iter().map(|r| r.canonicalize().ok()).collect();
    for (i, place) in places.iter().enumerate() {
        if let Some(j) = (0..i).find(|&j| place.is_some() && places[j] == *place) {
            anyhow::bail!(
                "{} and {} are the same folder: give each run folder once",
                runs[j].display(),
                runs[i].display()
            );
        }
    }
    if let Some(dir) = out {
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
    Ok(())
}

pub fn run(args: Args) -> Result<()> {
    let Args {
        runs,
        out,
        overwrite,
        allow_partial,
        compare,
    } = args;
    let runs = &runs;
    check_folders(runs, out.as_deref())?;
    let merged = merge::merge_runs_exploring(runs, allow_partial, &compare)?;
    let (results, config) = (&merged.results, &merged.config);
    let dir = match out {
        Some(dir) => dir,
        None => poslab::io::new_run_dir(Path::new("runs"), "report", &results.experiment)?,
    };
    let plan = Plan {
        kind: FolderKind::Report,
        config,
        selection: SelectionRecord::default(),
        cells: Vec::new(),
        device: merged.device.clone(),
        kernels: merged.kernels.clone(),
        sources: runs.iter().map(|r| r.display().to_string()).collect(),
        files: folder::report_files(config),
        planned: results.compared_pairs().planned,
    };
    let opened = folder::open(&dir, &plan, overwrite)?;
    poslab::io::write_atomic(&dir.join(folder::CONFIG_TOML), config.to_toml().as_bytes())?;
    let table = report::write_report(&dir, results, &merged.timings, runs)?;
    drop(opened);
    outln!("{table}");
    outln!(
        "merged {} run folder{} ({} cell{}) into {}",
        runs.len(),
        if runs.len() == 1 { "" } else { "s" },
        results.cells.len(),
        if results.cells.len() == 1 { "" } else { "s" },
        dir.display()
    );
    if let Some(p) = &results.partial {
        errln!(
            "{p}: missing {} (report.md and results.json say so too; exit status 3)",
            p.missing
                .iter()
                .take(5)
                .cloned()
                .collect::<Vec<_>>()
                .join(", ")
                + if p.missing.len() > 5 { ", ..." } else { "" }
        );
        return Err(PartialMerge.into());
    }
    Ok(())
}
