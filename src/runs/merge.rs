//! Reading and joining run folders: a finished run's records ([`load_run`]), and the strict
//! merge of folders of one experiment ([`merge_runs`]), which refuses damaged or foreign data
//! naming the folder, the file and the cell.

use std::path::{Path, PathBuf};

use super::folder::{self, FolderKind, Manifest};
use super::results::{CellResult, Outcome, Partial, Results, TaskInfo, Timing, SCORE};
use super::{ExperimentConfig, Selection, Shard};
use crate::error::{Error, Result};
use crate::io::FolderLock;

use super::folder::{load_run_config, CONFIG_TOML, RESULTS_JSON, TIMING_JSON};

/// Reads `results.json` and `timing.json` of a run folder.
pub fn load_run(dir: &Path) -> Result<(Results, Vec<Timing>)> {
    let read = |name: &str| -> Result<String> {
        let p = dir.join(name);
        crate::io::read_text_bounded(&p, crate::io::MAX_CONFIG_BYTES, "results")
    };
    let parse_err = |name: &str, e: serde_json::Error| {
        Error::Input(format!(
            "{}: not a readable poslab results file ({e}); it may be truncated or edited: run the \
             cells again, or leave this folder out",
            dir.join(name).display()
        ))
    };
    let results: Results =
        serde_json::from_str(&read(RESULTS_JSON)?).map_err(|e| parse_err(RESULTS_JSON, e))?;
    let timings: Vec<Timing> = match read(TIMING_JSON) {
        Ok(t) => serde_json::from_str(&t).map_err(|e| parse_err(TIMING_JSON, e))?,
        Err(_) => Vec::new(),
    };
    Ok((results, timings))
}

/// What `poslab report` merged: the results (their `partial` set when cells are missing), the
/// timings, and the config every folder was run with.
pub struct Merged {
    /// The merged results.
    pub results: Results,
    /// Every cell's timing.
    pub timings: Vec<Timing>,
    /// The experiment config the folders share.
    pub config: ExperimentConfig,
    /// The kind of device every folder's cells were computed on, where each records it.
    pub device: Option<String>,
    /// The kernels every folder's cells were computed with, where each records them.
    pub kernels: Option<String>,
}

/// Reads and joins run folders of one experiment, strictly:
///
/// - every folder was made with the same config, every setting that shapes a cell included
///   (two runs of an experiment with the same name but another `lr` are not one experiment);
///   `[[comparisons]]` may differ, and the report states all of them;
/// - no folder is being written (each is read under a shared [`FolderLock`]);
/// - every `results.json` holds only cells the config names, each once, with every column of
///   its task, scores in range and the lengths its tests name ([`check_results`]);
/// - no cell is in two folders;
/// - every cell of the experiment is there, unless `allow_partial`: then an unfinished run's
///   finished cells count too, and the results say what is missing ([`Results::partial`]).
///
/// Any violation is an error naming the folder or file and the cell.
///
/// The verdicts' family is the comparisons every folder planned when its run began; the
/// config's others are exploratory (see [`merge_runs_exploring`]).
pub fn merge_runs(dirs: &[PathBuf], allow_partial: bool) -> Result<Merged> {
    merge_runs_exploring(dirs, allow_partial, &[])
}

/// [`merge_runs`], with `explore` (`(a, b)` rows of the config) compared too, as exploratory
/// comparisons: chosen after the run, so outside the planned family's correction and never a
/// verdict.
pub fn merge_runs_exploring(
    dirs: &[PathBuf],
    allow_partial: bool,
    explore: &[(String, String)],
) -> Result<Merged> {
    let first = dirs
        .first()
        .ok_or_else(|| Error::Input("give at least one run folder to report on".into()))?;
    let mut config = load_run_config(first)?;
    // Comparisons shape no cell: folders whose configs differ only in them merge, and the
    // report states the union of their comparisons (those every folder planned as the family,
    // the rest exploratory: see `planned_family`).
    let cells_only =
        |c: &ExperimentConfig| toml::Value::try_from(c.shaping_cells()).expect("a config is TOML");
    let reference = cells_only(&config);
    let mut locks = Vec::with_capacity(dirs.len());
    let mut loaded = Vec::with_capacity(dirs.len());
    let mut manifests = Vec::with_capacity(dirs.len());
    for dir in dirs {
        locks.push(FolderLock::shared(dir)?);
        let other = load_run_config(dir)?;
        for c in &other.comparisons {
            if !config.comparisons.contains(c) {
                config.comparisons.push(c.clone());
            }
        }
        let value = cells_only(&other);
        if let Some(diff) = crate::io::first_difference("", &reference, &value) {
            return Err(Error::Input(format!(
                "{} and {} were run with different configs ({diff}): only runs of one \
                 experiment, split by --task, --variant, --seed or --shard, can be merged",
                first.display(),
                dir.display()
            )));
        }
        manifests.push(folder::read_manifest(dir)?);
    }
    // Folders computed otherwise are refused before any of their results is read.
    let (device, kernels) = computed_alike(dirs, &manifests)?;
    for (dir, manifest) in dirs.iter().zip(&manifests) {
        let (results, timings) = if dir.join(RESULTS_JSON).is_file() {
            let (results, timings) = load_run(dir)?;
            check_results(&config, &results, &dir.join(RESULTS_JSON))?;
            (results, timings)
        } else {
            unfinished(dir, &config, manifest.as_ref(), allow_partial)?
        };
        loaded.push((dir.clone(), results, timings));
    }
    let (mut results, mut timings) = merge(loaded)?;
    results.order_as(&config, &planned_family(&config, &manifests, explore)?);
    let order: Vec<(String, String, u64)> = results.cells.iter().map(|c| c.key()).collect();
    timings.sort_by_key(|t| {
        order
            .iter()
            .position(|k| {
                (k.0.as_str(), k.1.as_str(), k.2) == (t.task.as_str(), t.variant.as_str(), t.seed)
            })
            .unwrap_or(usize::MAX)
    });
    // Every cell of the experiment, or a partial merge that says so.
    let expected = config.cells(&Selection::default())?;
    let missing: Vec<(usize, String)> = expected
        .iter()
        .enumerate()
        .filter(|(_, &(t, v, seed))| {
            let (task, variant) = (&config.tasks[t].name, &config.variants[v].name);
            !results
                .cells
                .iter()
                .any(|c| (&c.task, &c.variant, c.seed) == (task, variant, seed))
        })
        .map(|(i, &cell)| (i, config.cell_name(cell)))
        .collect();
    if !missing.is_empty() {
        if !allow_partial {
            let shown: Vec<&str> = missing.iter().take(3).map(|m| m.1.as_str()).collect();
            return Err(Error::Input(format!(
                "{} of the experiment's {} cells are in none of these folders ({}{}){}: run them \
                 and merge again, or pass --allow-partial to merge what there is",
                missing.len(),
                expected.len(),
                shown.join(", "),
                if missing.len() > 3 { ", ..." } else { "" },
                missing_shards(&manifests, &missing)
            )));
        }
        results.partial = Some(Partial {
            cells: expected.len() - missing.len(),
            of: expected.len(),
            missing: missing.into_iter().map(|m| m.1).collect(),
        });
    }
    drop(locks);
    Ok(Merged {
        results,
        timings,
        config,
        device,
        kernels,
    })
}

/// The kind of device and the kernels the folders' cells were computed with, where every
/// folder records the same (`None` where one does not say). Folders that record different ones
/// are refused: their cells agree to within rounding, not bit for bit, so their merge would not
/// be the run it stands for. A folder from before they were recorded joins any.
fn computed_alike(
    dirs: &[PathBuf],
    manifests: &[Option<Manifest>],
) -> Result<(Option<String>, Option<String>)> {
    // What each field is, how a message says a value, and the flag that chooses it.
    type Field = (
        fn(&Manifest) -> &Option<String>,
        fn(&str) -> String,
        &'static str,
    );
    let fields: [Field; 2] = [
        (|m| &m.device, |v| format!("on {v}"), "--device"),
        (
            |m| &m.kernels,
            |v| format!("with the {v} kernels"),
            "--kernels",
        ),
    ];
    let mut common = [None, None];
    for ((field, said, flag), common) in fields.iter().zip(&mut common) {
        let recorded: Vec<(&PathBuf, &str)> = dirs
            .iter()
            .zip(manifests)
            .filter_map(|(dir, m)| Some((dir, field(m.as_ref()?).as_deref()?)))
            .collect();
        let Some(&(first, value)) = recorded.first() else {
            continue;
        };
        if let Some(&(other, theirs)) = recorded.iter().find(|r| r.1 != value) {
            return Err(Error::Input(format!(
                "{} computed its cells {} and {} {}, which agree to within rounding, not bit \
                 for bit: a report merges cells computed alike. Rerun the cells of {} into a \
                 new folder with {flag} {value}, or report on each apart",
                first.display(),
                said(value),
                other.display(),
                said(theirs),
                other.display()
            )));
        }
        if recorded.len() == dirs.len() {
            *common = Some(value.to_string());
        }
    }
    let [device, kernels] = common;
    Ok((device, kernels))
}

/// `: shard 2/3 is not among them` when the folders are shards of one count and the missing
/// cells belong to shards that none of them holds.
fn missing_shards(manifests: &[Option<Manifest>], missing: &[(usize, String)]) -> String {
    let shards: Option<Vec<Shard>> = manifests
        .iter()
        .map(|m| m.as_ref()?.selection.shard.as_deref()?.parse().ok())
        .collect();
    let Some(shards) = shards else {
        return String::new();
    };
    let Some(count) = shards.first().map(|s| s.count) else {
        return String::new();
    };
    if shards.iter().any(|s| s.count != count) {
        return String::new();
    }
    let mut absent: Vec<usize> = missing.iter().map(|(i, _)| i % count).collect();
    absent.sort_unstable();
    absent.dedup();
    absent.retain(|k| !shards.iter().any(|s| s.index == *k));
    match absent.len() {
        0 => String::new(),
        1 => format!("; shard {}/{count} is not among the folders", absent[0]),
        _ => format!(
            "; shards {} of {count} are not among the folders",
            absent
                .iter()
                .map(|k| k.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// A folder without `results.json`: an unfinished compare run. Refused, saying how to finish
/// it, unless `allow_partial`: then its finished cells, from their records.
fn unfinished(
    dir: &Path,
    config: &ExperimentConfig,
    manifest: Option<&Manifest>,
    allow_partial: bool,
) -> Result<(Results, Vec<Timing>)> {
    let Some(m) = manifest.filter(|m| m.kind == FolderKind::Compare) else {
        return Err(Error::Input(format!(
            "{} holds no {RESULTS_JSON} and no run of poslab compare: is it a run folder?",
            dir.display()
        )));
    };
    let cells = config.cells(&m.selection.selection()?)?;
    // A damaged or foreign record is damage, not absence: say which and why.
    let damaged = std::sync::Mutex::new(Vec::new());
    let records: Vec<_> = folder::read_cells(dir, config, &cells, &|cell, e| {
        if let Ok(mut d) = damaged.lock() {
            d.push(format!("cell {cell}: {e}"));
        }
    })
    .into_iter()
    .flatten()
    .collect();
    let damaged = damaged.into_inner().unwrap_or_default();
    if !damaged.is_empty() {
        return Err(Error::Input(format!(
            "{} holds unusable cell records (damaged, or made by another config): {}; run those \
             cells again (`poslab compare {} --out {}{}` continues the run and redoes them), or \
             delete their records",
            dir.display(),
            damaged.join("; "),
            dir.join(CONFIG_TOML).display(),
            dir.display(),
            m.selection.flags()
        )));
    }
    if !allow_partial {
        return Err(Error::Input(format!(
            "{} is an unfinished run ({}: {} of {} cells done): finish it with `poslab compare \
             {} --out {}{}` (the same command continues it), or pass --allow-partial to merge \
             the cells it has",
            dir.display(),
            m.selection.describe(),
            records.len(),
            cells.len(),
            dir.join(CONFIG_TOML).display(),
            dir.display(),
            m.selection.flags()
        )));
    }
    let plan = folder::comparison_plan(Some(m), config);
    let (results, timings) = folder::assemble(config, records, &plan);
    for c in &results.cells {
        let name = c.name();
        check_cell(config, &results, c, &dir.join(folder::CELLS), &name)?;
    }
    Ok((results, timings))
}

/// The comparisons of a merge: planned, those every folder planned when its run began (the
/// config's where a folder records none); exploratory, the config's others and `explore`'s,
/// each of which must name two different rows of the config.
fn planned_family(
    config: &ExperimentConfig,
    manifests: &[Option<Manifest>],
    explore: &[(String, String)],
) -> Result<super::results::ComparisonPlan> {
    let rows = config.variant_rows();
    for (a, b) in explore {
        for name in [a, b] {
            if !rows.contains(name) {
                return Err(Error::Config(format!(
                    "--compare {a},{b}: `{name}` is not a row of this experiment (its rows: {})",
                    rows.join(", ")
                )));
            }
        }
        if a == b {
            return Err(Error::Config(format!(
                "--compare {a},{b}: compare two different rows"
            )));
        }
    }
    let plans: Vec<super::results::ComparisonPlan> = manifests
        .iter()
        .map(|m| folder::comparison_plan(m.as_ref(), config))
        .collect();
    let planned: Vec<(String, String)> = plans
        .first()
        .map(|p| p.planned.clone())
        .unwrap_or_default()
        .into_iter()
        .filter(|pair| plans.iter().all(|p| p.planned.contains(pair)))
        .collect();
    let mut now = config.comparison_pairs();
    now.extend(explore.iter().cloned());
    Ok(super::results::ComparisonPlan::of(planned, &now))
}

/// Checks a `results.json` against the config its folder was run with: the experiment's
/// name; tasks, variants and seeds the config names, each cell once; every column of its task,
/// each once; scores, losses and counts in range, means that match their scores by length, and
/// the length suite's tests scored at every length their column names.
pub fn check_results(config: &ExperimentConfig, results: &Results, file: &Path) -> Result<()> {
    let bad = |what: String| {
        Err(Error::Input(format!(
            "{}: {what}: the file was edited or damaged; run those cells again, or leave the \
             folder out",
            file.display()
        )))
    };
    if results.experiment != config.name {
        return bad(format!(
            "it is a run of experiment `{}`, but its config.toml names `{}`",
            results.experiment, config.name
        ));
    }
    if results.cells.is_empty() || results.tasks.is_empty() || results.variants.is_empty() {
        return bad("it holds no cells (an empty list)".into());
    }
    let mut names = std::collections::HashSet::new();
    for task in &results.tasks {
        let Some(spec) = config.tasks.iter().find(|t| t.name == task.name) else {
            return bad(format!(
                "task `{}` is not in the experiment's config",
                task.name
            ));
        };
        if !names.insert(task.name.as_str()) {
            return bad(format!("task `{}` is listed twice", task.name));
        }
        if let Err(why) = check_task(spec, task) {
            return bad(format!("task `{}`: {why}", task.name));
        }
    }
    let rows = config.variant_rows();
    let mut names = std::collections::HashSet::new();
    for variant in &results.variants {
        if !rows.contains(&variant.name) {
            return bad(format!(
                "variant `{}` is not in the experiment's config",
                variant.name
            ));
        }
        if !names.insert(variant.name.as_str()) {
            return bad(format!("variant `{}` is listed twice", variant.name));
        }
        if let Some(spec) = config.variants.iter().find(|v| v.name == variant.name) {
            if spec.positional != variant.positional {
                return bad(format!(
                    "variant `{}` is not the config's `{}`",
                    variant.name,
                    spec.positional.name()
                ));
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    for c in &results.cells {
        let name = c.name();
        if !seen.insert(c.key()) {
            return bad(format!("cell {name} appears twice"));
        }
        check_cell(config, results, c, file, &name)?;
    }
    // A re-scored row comes with the cell it re-scores, and the other way round.
    for c in &results.cells {
        let base = rows_base(config, &c.variant);
        for row in config.variant_rows() {
            if rows_base(config, &row) == base
                && !results
                    .cells
                    .iter()
                    .any(|o| (&o.task, &o.variant, o.seed) == (&c.task, &row, c.seed))
            {
                return bad(format!("cell {} lacks its row `{row}`", c.name()));
            }
        }
    }
    // The summary is a function of the cells: one that disagrees with them was edited.
    let mut recomputed = results.clone();
    recomputed.finish();
    if recomputed.summary.len() != results.summary.len() {
        return bad(format!(
            "its summary has {} rows, its cells make {}",
            results.summary.len(),
            recomputed.summary.len()
        ));
    }
    if let Some((ours, theirs)) = recomputed
        .summary
        .iter()
        .zip(&results.summary)
        .find(|(a, b)| a != b)
    {
        return bad(format!(
            "its summary of {}/{} disagrees with its cells (the cells give {}, the summary {})",
            theirs.task,
            theirs.variant,
            summary_digest(ours),
            summary_digest(theirs)
        ));
    }
    Ok(())
}

/// The variant a row belongs to (`rope` for `rope + yarn`).
fn rows_base<'a>(config: &'a ExperimentConfig, row: &str) -> Option<&'a str> {
    config
        .variants
        .iter()
        .map(|v| v.name.as_str())
        .find(|v| row == *v || row.strip_prefix(v).is_some_and(|r| r.starts_with(" + ")))
}

/// A task's tests as recorded against what its config asks for.
fn check_task(spec: &crate::tasks::TaskSpec, task: &TaskInfo) -> std::result::Result<(), String> {
    for test in &task.tests {
        test.lengths_of_examples()?;
    }
    let ranges = spec.test_ranges();
    if ranges.is_empty() {
        return Ok(()); // read from files: tested at the files' own lengths
    }
    if task.tests.len() != ranges.len() {
        return Err(format!(
            "{} tests recorded, the config names {}",
            task.tests.len(),
            ranges.len()
        ));
    }
    for (test, [lo, hi]) in task.tests.iter().zip(ranges) {
        let [a, b] = test.lengths;
        let ok = match test.factor {
            Some(_) => lo <= a && a <= b && b <= hi,
            None => [a, b] == [lo, hi],
        };
        if !ok {
            return Err(format!(
                "test `{}` records lengths {a}-{b}, the config asks for {lo}-{hi}",
                test.name
            ));
        }
    }
    Ok(())
}

/// One cell of `results` (from `file`) against the config and its task.
fn check_cell(
    config: &ExperimentConfig,
    results: &Results,
    c: &CellResult,
    file: &Path,
    name: &str,
) -> Result<()> {
    let bad = |what: String| {
        Err(Error::Input(format!(
            "{}: cell {name}: {what}: the file was edited or damaged; run that cell again, or \
             leave the folder out",
            file.display()
        )))
    };
    let Some(task) = results.tasks.iter().find(|t| t.name == c.task) else {
        return bad(format!(
            "task `{}` is not in the experiment's config (nor among the file's tasks)",
            c.task
        ));
    };
    if !config.tasks.iter().any(|t| t.name == c.task) {
        return bad(format!(
            "task `{}` is not in the experiment's config",
            c.task
        ));
    }
    let Some(base) = rows_base(config, &c.variant).filter(|_| {
        config.variant_rows().contains(&c.variant)
            && results.variants.iter().any(|v| v.name == c.variant)
    }) else {
        return bad(format!(
            "variant `{}` is not in the experiment's config",
            c.variant
        ));
    };
    if !config.seed_list().contains(&c.seed) {
        return bad(format!(
            "seed {} is not among the experiment's seeds {:?}",
            c.seed,
            config.seed_list()
        ));
    }
    let columns = task.columns();
    let names: Vec<&str> = c
        .summary
        .evaluations
        .iter()
        .map(|e| e.name.as_str())
        .collect();
    if names != columns.iter().map(String::as_str).collect::<Vec<_>>() {
        return bad(format!(
            "its tests are [{}], its task's columns are [{}]",
            names.join(", "),
            columns.join(", ")
        ));
    }
    if !(c.summary.final_train_loss.is_finite() && c.summary.final_train_loss >= 0.0)
        || c.summary.steps == 0
        || c.summary.params == 0
    {
        return bad(format!(
            "training loss {}, {} steps, {} parameters",
            c.summary.final_train_loss, c.summary.steps, c.summary.params
        ));
    }
    if c.model_dir != folder::model_dir(&c.task, base, c.seed) {
        return bad(format!("its model folder is `{}`", c.model_dir));
    }
    let expected = folder::config_sha256(config);
    if c.config_sha256 != expected {
        return bad(format!(
            "it was made by another config (its fingerprint `{}`, the folder's `{}`)",
            folder::short(&c.config_sha256),
            folder::short(&expected)
        ));
    }
    for e in &c.summary.evaluations {
        let test = task.tests.iter().find(|t| t.name == e.name);
        // The size of the test set these examples are of.
        let size = task.test_of(&e.name).map_or(0, |t| t.examples);
        let sized = |()| match e.examples.as_ref().map(|x| x.len()) {
            Some(n) if size > 0 && n != size => Err(format!(
                "{n} example outcomes, but the test set has {size} examples"
            )),
            _ => Ok(()),
        };
        if let Err(why) = check_outcome(task, test, &e.name, &e.outcome)
            .and_then(|()| super::results::check_examples(&e.outcome, e.examples.as_ref()))
            .and_then(sized)
        {
            return bad(format!("test `{}`: {why}", e.name));
        }
    }
    Ok(())
}

/// A summary row's scores in a few words, for a message.
fn summary_digest(row: &super::results::SummaryRow) -> String {
    row.columns
        .iter()
        .map(|c| match (&c.accuracy, &c.loss) {
            (Some(a), Some(l)) => format!("{} {:.4}/{:.4}", c.name, a.mean, l.mean),
            _ => format!("{} n/a", c.name),
        })
        .chain(std::iter::once(format!(
            "train loss {:.4}",
            row.final_train_loss.mean
        )))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A score in range, consistent with its scores by length, which cover the test's lengths.
fn check_outcome(
    task: &TaskInfo,
    test: Option<&super::results::TestInfo>,
    name: &str,
    outcome: &Outcome,
) -> std::result::Result<(), String> {
    let fraction = |what: &str, x: f64| {
        if x.is_finite() && (0.0..=1.0).contains(&x) {
            Ok(())
        } else {
            Err(format!("{what} {x} is outside 0..1"))
        }
    };
    let loss = |x: f64| {
        if x.is_finite() && x >= 0.0 {
            Ok(())
        } else {
            Err(format!("loss {x} is not a finite number >= 0"))
        }
    };
    let (accuracy, l, sequence_accuracy, by_length) = match outcome {
        Outcome::Unavailable { reason } if reason.trim().is_empty() => {
            return Err("unavailable without a reason".into())
        }
        Outcome::Unavailable { .. } => return Ok(()),
        Outcome::Scored {
            accuracy,
            loss,
            sequence_accuracy,
            by_length,
        } => (*accuracy, *loss, *sequence_accuracy, by_length),
    };
    fraction("accuracy", accuracy)?;
    loss(l)?;
    if let Some(s) = sequence_accuracy {
        fraction("whole-sequence accuracy", s)?;
    }
    let lengths: Vec<usize> = by_length.iter().map(|s| s.length).collect();
    for s in by_length {
        fraction(&format!("accuracy at length {}", s.length), s.accuracy)?;
        fraction(
            &format!("whole-sequence accuracy at length {}", s.length),
            s.sequence_accuracy,
        )?;
        loss(s.loss)?;
        if s.examples == 0 {
            return Err(format!("no examples at length {}", s.length));
        }
    }
    if lengths.windows(2).any(|w| w[0] >= w[1]) {
        return Err("its lengths are not in increasing order, each once".into());
    }
    if !by_length.is_empty() {
        let n = by_length.len() as f64;
        let mean = by_length.iter().map(|s| s.accuracy).sum::<f64>() / n;
        if (mean - accuracy).abs() > 1e-9 {
            return Err(format!(
                "accuracy {accuracy} is not the mean of its scores by length ({mean})"
            ));
        }
    }
    // The length suite's tests are scored at every length they name.
    let expected: Option<Vec<usize>> = match test {
        Some(t) if t.factor.is_none() && !by_length.is_empty() => {
            Some((t.lengths[0]..=t.lengths[1]).collect())
        }
        // Tests at a factor of the training lengths sample their lengths, so a score over them
        // names no fixed set (its lengths are still checked in order, each once, above).
        None if name == SCORE && task.tests.iter().all(|t| t.factor.is_none()) => {
            task.score_above.map(|above| {
                task.tests
                    .iter()
                    .flat_map(|t| t.lengths[0]..=t.lengths[1])
                    .filter(|&l| l > above)
                    .collect()
            })
        }
        _ => None,
    };
    if let Some(expected) = expected {
        if lengths != expected {
            return Err(format!(
                "scored at {} lengths ({}..{}), but its column names {} ({}..{})",
                lengths.len(),
                lengths.first().unwrap_or(&0),
                lengths.last().unwrap_or(&0),
                expected.len(),
                expected.first().unwrap_or(&0),
                expected.last().unwrap_or(&0),
            ));
        }
    }
    Ok(())
}

/// Joins runs of the same experiment (cells split across machines by `--shard`, `--task`,
/// `--variant`, `--seed`). Tasks and variants must agree where they meet, and each cell must
/// be in one run only.
pub fn merge(runs: Vec<(PathBuf, Results, Vec<Timing>)>) -> Result<(Results, Vec<Timing>)> {
    let mut iter = runs.into_iter();
    let (first_dir, mut merged, mut timings) = iter
        .next()
        .ok_or_else(|| Error::Input("give at least one run folder to report on".into()))?;
    // What a merged folder lacked is the merge's own to say, not its inputs'.
    merged.partial = None;
    let mut origin: std::collections::HashMap<(String, String, u64), PathBuf> = merged
        .cells
        .iter()
        .map(|c| (c.key(), first_dir.clone()))
        .collect();
    let mut plan = merged.compared_pairs();
    for (dir, results, more_timings) in iter {
        let theirs = results.compared_pairs();
        for p in theirs.planned {
            if !plan.planned.contains(&p) {
                plan.planned.push(p);
            }
        }
        plan.exploratory.extend(theirs.exploratory);
        let conflict = |what: String| {
            Err(Error::Input(format!(
                "{} and {} disagree on {what}: they are not runs of the same experiment",
                first_dir.display(),
                dir.display()
            )))
        };
        if results.experiment != merged.experiment {
            return conflict(format!(
                "the experiment name (`{}` vs `{}`)",
                merged.experiment, results.experiment
            ));
        }
        for t in results.tasks {
            match merged.tasks.iter().find(|m| m.name == t.name) {
                Some(m) if *m != t => return conflict(format!("task `{}`", t.name)),
                Some(_) => {}
                None => merged.tasks.push(t),
            }
        }
        for v in results.variants {
            match merged.variants.iter().find(|m| m.name == v.name) {
                Some(m) if *m != v => return conflict(format!("variant `{}`", v.name)),
                Some(_) => {}
                None => merged.variants.push(v),
            }
        }
        for c in results.cells {
            if let Some(other) = origin.get(&c.key()) {
                return Err(Error::Input(format!(
                    "cell {} is in both {} and {}: each cell must come from one folder (were \
                     two selections or shard counts mixed?); leave one out",
                    c.name(),
                    other.display(),
                    dir.display()
                )));
            }
            origin.insert(c.key(), dir.clone());
            merged.cells.push(c);
        }
        for t in more_timings {
            if !timings.iter().any(|m| {
                (m.task.as_str(), m.variant.as_str(), m.seed)
                    == (t.task.as_str(), t.variant.as_str(), t.seed)
            }) {
                timings.push(t);
            }
        }
    }
    merged.finish();
    // The union of the parts' comparisons, stated again over every cell.
    merged.compare(&super::results::ComparisonPlan::of(
        plan.planned,
        &plan.exploratory,
    ));
    Ok((merged, timings))
}
