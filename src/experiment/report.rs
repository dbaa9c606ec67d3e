//! Tables and files from a comparison's records: printed tables, `report.md`, `results.csv`,
//! `summary.csv`, `results.json`, `timing.json`, and the plots.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::plot;
use super::results::{Aggregate, Outcome, Results, Stat, SummaryRow, TaskInfo, Timing};
use crate::error::{Error, Result};
use crate::io::write_atomic;

pub const RESULTS_JSON: &str = "results.json";
pub const TIMING_JSON: &str = "timing.json";
/// The experiment config as run, every default filled in.
pub const CONFIG_TOML: &str = "config.toml";

/// `99.1 ± 0.4 (98.6..99.5)`, or `99.1` for one seed; `scale` turns fractions into percent.
pub fn fmt_stat(s: &Stat, scale: f64, decimals: usize) -> String {
    if s.n == 1 {
        format!("{:.*}", decimals, s.mean * scale)
    } else {
        format!(
            "{:.*} ± {:.*} ({:.*}..{:.*})",
            decimals,
            s.mean * scale,
            decimals,
            s.std * scale,
            decimals,
            s.min * scale,
            decimals,
            s.max * scale
        )
    }
}

/// Notes for cells a variant could not run, numbered in order of appearance.
#[derive(Default)]
struct Notes(Vec<String>);

impl Notes {
    fn mark(&mut self, reason: &str) -> String {
        let i = match self.0.iter().position(|r| r == reason) {
            Some(i) => i,
            None => {
                self.0.push(reason.to_string());
                self.0.len() - 1
            }
        };
        format!("[{}]", i + 1)
    }
}

fn cell(agg: &Aggregate, notes: &mut Notes) -> String {
    match (&agg.accuracy, &agg.unavailable) {
        (Some(s), None) => fmt_stat(s, 100.0, 1),
        (Some(s), Some(r)) => format!("{} {}", fmt_stat(s, 100.0, 1), notes.mark(r)),
        (None, Some(r)) => format!("n/a {}", notes.mark(r)),
        (None, None) => "-".into(),
    }
}

/// Tokens per second and wall seconds over seeds, by (task, variant).
fn timing_stats(timings: &[Timing]) -> BTreeMap<(&str, &str), (Stat, Stat)> {
    type Samples = (Vec<f64>, Vec<f64>);
    let mut groups: BTreeMap<(&str, &str), Samples> = BTreeMap::new();
    for t in timings {
        let g = groups
            .entry((t.task.as_str(), t.variant.as_str()))
            .or_default();
        g.0.push(t.tokens_per_second);
        g.1.push(t.wall_seconds);
    }
    groups
        .into_iter()
        .filter_map(|(k, (tps, wall))| Some((k, (Stat::of(&tps)?, Stat::of(&wall)?))))
        .collect()
}

/// A table: header, rows, and which columns align right.
struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
    right: Vec<bool>,
}

impl Table {
    fn text(&self) -> String {
        let widths: Vec<usize> = (0..self.header.len())
            .map(|c| {
                std::iter::once(&self.header)
                    .chain(&self.rows)
                    .map(|r| r[c].chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let line = |r: &[String]| {
            let cells: Vec<String> = r
                .iter()
                .enumerate()
                .map(|(c, v)| {
                    if self.right[c] {
                        format!("{v:>w$}", w = widths[c])
                    } else {
                        format!("{v:<w$}", w = widths[c])
                    }
                })
                .collect();
            cells.join("  ").trim_end().to_string()
        };
        let mut out = line(&self.header);
        out.push('\n');
        for r in &self.rows {
            out.push_str(&line(r));
            out.push('\n');
        }
        out
    }

    fn markdown(&self) -> String {
        let mut out = format!("| {} |\n", self.header.join(" | "));
        let rule: Vec<&str> = self
            .right
            .iter()
            .map(|&r| if r { "---:" } else { "---" })
            .collect();
        out.push_str(&format!("| {} |\n", rule.join(" | ")));
        for r in &self.rows {
            out.push_str(&format!("| {} |\n", r.join(" | ")));
        }
        out
    }
}

/// The tables of a task (scores by length; order tests and cost; for the length suite,
/// whole-sequence accuracy) and their notes.
fn task_tables(
    task: &TaskInfo,
    rows: &[&SummaryRow],
    results: &Results,
    timings: &[Timing],
) -> (Table, Table, Option<Table>, Vec<String>) {
    let mut notes = Notes::default();
    let times = timing_stats(timings);
    let variant = |name: &str| results.variants.iter().find(|v| v.name == name);
    let mut scores = Table {
        header: ["variant", "where", "width", "params"]
            .map(String::from)
            .to_vec(),
        rows: Vec::new(),
        right: vec![false, false, true, true],
    };
    for t in &task.tests {
        scores.header.push(match t.factor {
            Some(_) => format!("{} (len {}-{})", t.name, t.lengths[0], t.lengths[1]),
            None => format!("len {}", t.name),
        });
        scores.right.push(true);
    }
    // Length-suite tasks: whole-sequence accuracy beside the per-output one.
    let mut sequences = task.score_above.map(|_| Table {
        header: std::iter::once("variant".to_string())
            .chain(task.tests.iter().map(|t| format!("len {}", t.name)))
            .chain([super::results::SCORE.to_string()])
            .collect(),
        rows: Vec::new(),
        right: std::iter::once(false)
            .chain(std::iter::repeat_n(true, task.tests.len() + 1))
            .collect(),
    });
    let order_cols: Vec<String> = task.columns().into_iter().skip(task.tests.len()).collect();
    let mut tests = Table {
        header: std::iter::once("variant".to_string())
            .chain(order_cols.iter().cloned())
            .chain(["train loss", "tokens/s", "s/run"].map(String::from))
            .collect(),
        rows: Vec::new(),
        right: std::iter::once(false)
            .chain(std::iter::repeat_n(true, order_cols.len() + 3))
            .collect(),
    };
    for row in rows {
        let info = variant(&row.variant);
        let mut r = vec![
            row.variant.clone(),
            info.map_or("?".into(), |v| v.placement.clone()),
            info.map_or(row.d_model.to_string(), |v| v.width.clone()),
            row.params.to_string(),
        ];
        for t in &task.tests {
            r.push(
                row.columns
                    .iter()
                    .find(|c| c.name == t.name)
                    .map_or("-".into(), |c| cell(c, &mut notes)),
            );
        }
        scores.rows.push(r);
        let mut r = vec![row.variant.clone()];
        for name in &order_cols {
            r.push(
                row.columns
                    .iter()
                    .find(|c| &c.name == name)
                    .map_or("-".into(), |c| cell(c, &mut notes)),
            );
        }
        r.push(fmt_stat(&row.final_train_loss, 1.0, 3));
        match times.get(&(row.task.as_str(), row.variant.as_str())) {
            Some((tps, wall)) => {
                r.push(format!("{:.0}", tps.mean));
                r.push(format!("{:.1}", wall.mean));
            }
            None => r.extend(["-".to_string(), "-".to_string()]),
        }
        tests.rows.push(r);
        if let Some(table) = sequences.as_mut() {
            let mut r = vec![row.variant.clone()];
            for name in task
                .tests
                .iter()
                .map(|t| t.name.as_str())
                .chain([super::results::SCORE])
            {
                let col = row.columns.iter().find(|c| c.name == name);
                r.push(match col.and_then(|c| c.sequence_accuracy.as_ref()) {
                    Some(s) => fmt_stat(s, 100.0, 1),
                    None => col.map_or("-".into(), |c| cell(c, &mut notes)),
                });
            }
            table.rows.push(r);
        }
    }
    let notes = notes
        .0
        .iter()
        .enumerate()
        .map(|(i, n)| format!("[{}] {n}", i + 1))
        .collect();
    (scores, tests, sequences, notes)
}

fn task_heading(task: &TaskInfo, rows: &[&SummaryRow]) -> String {
    let seeds = rows.first().map_or(0, |r| r.seeds.len());
    let kind = if task.kind == task.name {
        String::new()
    } else {
        format!(" ({})", task.kind)
    };
    let over = if seeds == 1 {
        "one seed".to_string()
    } else {
        format!("mean ± std (min..max) over {seeds} seeds")
    };
    let mut h = format!(
        "{}{kind}: {} in %, {over}; trained on lengths {}-{}",
        task.name, task.metric, task.train_lengths[0], task.train_lengths[1]
    );
    if let Some(c) = &task.order_blind_ceiling {
        let _ = write!(
            h,
            "\norder-blind ceiling {:.1}%: {}",
            100.0 * c.accuracy,
            c.reason
        );
    }
    h
}

/// A task's part of the report.
struct Section<'a> {
    task: &'a TaskInfo,
    heading: String,
    scores: Table,
    tests: Table,
    sequences: Option<Table>,
    notes: Vec<String>,
}

/// The sections of every task that has results, in task order.
fn sections<'a>(results: &'a Results, timings: &[Timing]) -> Vec<Section<'a>> {
    results
        .tasks
        .iter()
        .filter_map(|task| {
            let rows: Vec<&SummaryRow> = results
                .summary
                .iter()
                .filter(|r| r.task == task.name)
                .collect();
            if rows.is_empty() {
                return None;
            }
            let (scores, tests, sequences, notes) = task_tables(task, &rows, results, timings);
            Some(Section {
                task,
                heading: task_heading(task, &rows),
                scores,
                tests,
                sequences,
                notes,
            })
        })
        .collect()
}

/// The length suite's two summary tables: every task's score by variant (mean ± std over
/// seeds), and the gain of randomized positions for each scheme; `None` without suite tasks.
fn suite_tables(results: &Results) -> Option<(Table, Table)> {
    let summary = super::suite::summarize(results)?;
    let mut scores = Table {
        header: std::iter::once("task".to_string())
            .chain(summary.variants.iter().cloned())
            .collect(),
        rows: Vec::new(),
        right: std::iter::once(false)
            .chain(std::iter::repeat_n(true, summary.variants.len()))
            .collect(),
    };
    for (task, row) in summary.tasks.iter().zip(&summary.scores) {
        scores.rows.push(
            std::iter::once(task.clone())
                .chain(row.iter().map(|s| match s {
                    Some(s) if s.n > 1 => format!("{:.1} ± {:.1}", 100.0 * s.mean, 100.0 * s.std),
                    Some(s) => format!("{:.1}", 100.0 * s.mean),
                    None => "-".into(),
                }))
                .collect(),
        );
    }
    let mut gains = Table {
        header: [
            "scheme",
            "plain",
            "random",
            "gain (points)",
            "best seeds",
            "tasks better / worse",
            "range over tasks",
        ]
        .map(String::from)
        .to_vec(),
        rows: Vec::new(),
        right: vec![false, false, false, true, true, true, true],
    };
    for g in &summary.gains {
        gains.rows.push(vec![
            g.scheme.clone(),
            g.plain.clone(),
            g.random.clone(),
            format!("{:+.1}", g.mean),
            format!("{:+.1}", g.best),
            format!("{} / {}", g.better, g.worse),
            format!("{:+.1} .. {:+.1}", g.min, g.max),
        ]);
    }
    let blank = String::new;
    if let Some((mean, best)) = summary.overall_gain() {
        gains.rows.push(vec![
            "all schemes".into(),
            blank(),
            blank(),
            format!("{mean:+.1}"),
            format!("{best:+.1}"),
            blank(),
            blank(),
        ]);
    }
    gains.rows.push(vec![
        "Ruoss et al. 2023".into(),
        blank(),
        blank(),
        blank(),
        format!("{:+.1}", super::suite::PAPER_GAIN),
        blank(),
        blank(),
    ]);
    Some((scores, gains))
}

const SUITE_SCORES: &str = "length suite: score (accuracy in % averaged over every test length \
     above the training lengths, Ruoss et al. 2023), mean ± std over seeds";
const SUITE_GAINS: &str = "randomized positions: the mean over tasks of the score with \
     random_positions minus without, in points, over seeds' means and between best seeds, beside \
     the paper's average over its 15 tasks and schemes (best of 10 seeds and 3 learning rates); \
     a finding at this config's budget, not a replication";

/// The printed report.
pub fn text_report(results: &Results, timings: &[Timing]) -> String {
    let mut out = String::new();
    for s in sections(results, timings) {
        let _ = writeln!(out, "\n== {}\n", s.heading);
        out.push_str(&s.scores.text());
        out.push('\n');
        out.push_str(&s.tests.text());
        if let Some(t) = &s.sequences {
            out.push_str("\nwhole-sequence accuracy in %:\n");
            out.push_str(&t.text());
        }
        for n in s.notes {
            let _ = writeln!(out, "{n}");
        }
    }
    if let Some((scores, gains)) = suite_tables(results) {
        let _ = writeln!(out, "\n== {SUITE_SCORES}\n");
        out.push_str(&scores.text());
        let _ = writeln!(out, "\n== {SUITE_GAINS}\n");
        out.push_str(&gains.text());
    }
    out
}

fn markdown_report(results: &Results, timings: &[Timing], sources: &[PathBuf]) -> String {
    let mut md = format!("# poslab compare: {}\n\n", results.experiment);
    if !sources.is_empty() {
        md.push_str("Merged from:\n\n");
        for s in sources {
            let _ = writeln!(md, "- `{}`", s.display());
        }
        md.push('\n');
    }
    md.push_str(
        "Scores are in %, mean ± sample standard deviation (min..max) over seeds. `1x` is the \
         training lengths, `2x` and `4x` multiples of them; `shuffled` scores sentences whose \
         tokens were permuted (a model that uses order drops); `shift+k` moves every position by \
         k (relative schemes hold). `s/run` is wall time per trained model, evaluation included.\n",
    );
    if results.tasks.iter().any(|t| t.score_above.is_some()) {
        md.push_str(
            "\nLength-suite tasks are tested over ranges of input lengths (`len 41-100`): a \
             range's accuracy is the mean over its lengths of the share of answer outputs right \
             (read at the blank output tokens only, up to `end` where a task has one), and \
             `score` is that mean over every tested length above the training lengths (Ruoss et \
             al. 2023). Whole-sequence accuracy counts an example right when all its answer \
             outputs are.\n",
        );
    }
    if let Some((scores, gains)) = suite_tables(results) {
        let _ = write!(md, "\n## Length suite\n\n{SUITE_SCORES}.\n\n");
        md.push_str(&scores.markdown());
        let _ = write!(md, "\n{SUITE_GAINS}.\n\n");
        md.push_str(&gains.markdown());
        md.push_str("\n![length suite](plots/length_suite.png)\n");
    }
    for s in sections(results, timings) {
        let _ = write!(
            md,
            "\n## {}\n\n{}\n\n",
            s.task.name,
            s.heading.replace('\n', "\n\n")
        );
        md.push_str(&s.scores.markdown());
        md.push('\n');
        md.push_str(&s.tests.markdown());
        if let Some(t) = &s.sequences {
            md.push_str("\nWhole-sequence accuracy in %:\n\n");
            md.push_str(&t.markdown());
        }
        for n in s.notes {
            let _ = writeln!(md, "\n{n}");
        }
        let _ = write!(
            md,
            "\n![training loss](plots/loss_{0}.png)\n![score by length](plots/length_{0}.png)\n",
            s.task.name
        );
    }
    md
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

fn csv(rows: Vec<Vec<String>>) -> String {
    rows.into_iter()
        .map(|r| r.iter().map(|f| csv_field(f)).collect::<Vec<_>>().join(","))
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

/// One row per cell and evaluation, with the cell's timing.
fn results_csv(results: &Results, timings: &[Timing]) -> String {
    let mut rows = vec![[
        "task",
        "variant",
        "seed",
        "d_model",
        "params",
        "max_len",
        "steps",
        "tokens",
        "final_train_loss",
        "evaluation",
        "accuracy",
        "loss",
        "unavailable",
        "train_seconds",
        "tokens_per_second",
        "wall_seconds",
    ]
    .map(String::from)
    .to_vec()];
    for c in &results.cells {
        let t = timings
            .iter()
            .find(|t| t.task == c.task && t.variant == c.variant && t.seed == c.seed);
        for e in &c.evaluations {
            let (acc, loss, why) = match &e.outcome {
                Outcome::Scored { accuracy, loss, .. } => {
                    (accuracy.to_string(), loss.to_string(), String::new())
                }
                Outcome::Unavailable { reason } => (String::new(), String::new(), reason.clone()),
            };
            rows.push(vec![
                c.task.clone(),
                c.variant.clone(),
                c.seed.to_string(),
                c.d_model.to_string(),
                c.params.to_string(),
                c.max_len.to_string(),
                c.steps.to_string(),
                c.tokens.to_string(),
                c.final_train_loss.to_string(),
                e.name.clone(),
                acc,
                loss,
                why,
                t.map_or(String::new(), |t| format!("{:.3}", t.train_seconds)),
                t.map_or(String::new(), |t| format!("{:.1}", t.tokens_per_second)),
                t.map_or(String::new(), |t| format!("{:.3}", t.wall_seconds)),
            ]);
        }
    }
    csv(rows)
}

/// One row per task, variant and evaluation, over seeds.
fn summary_csv(results: &Results) -> String {
    let mut rows = vec![[
        "task",
        "variant",
        "seeds",
        "d_model",
        "params",
        "evaluation",
        "n",
        "mean",
        "std",
        "min",
        "max",
        "unavailable",
    ]
    .map(String::from)
    .to_vec()];
    for r in &results.summary {
        for c in &r.columns {
            let stat = |f: fn(&Stat) -> f64| {
                c.accuracy
                    .as_ref()
                    .map_or(String::new(), |s| f(s).to_string())
            };
            rows.push(vec![
                r.task.clone(),
                r.variant.clone(),
                r.seeds.len().to_string(),
                r.d_model.to_string(),
                r.params.to_string(),
                c.name.clone(),
                c.accuracy.as_ref().map_or(0, |s| s.n).to_string(),
                stat(|s| s.mean),
                stat(|s| s.std),
                stat(|s| s.min),
                stat(|s| s.max),
                c.unavailable.clone().unwrap_or_default(),
            ]);
        }
    }
    csv(rows)
}

/// Writes every report file into `dir` and returns the printed report.
pub fn write_report(
    dir: &Path,
    results: &Results,
    timings: &[Timing],
    sources: &[PathBuf],
) -> Result<String> {
    write_atomic(&dir.join(RESULTS_JSON), pretty_json(results).as_bytes())?;
    write_atomic(&dir.join(TIMING_JSON), pretty_json(&timings).as_bytes())?;
    write_atomic(
        &dir.join("results.csv"),
        results_csv(results, timings).as_bytes(),
    )?;
    write_atomic(&dir.join("summary.csv"), summary_csv(results).as_bytes())?;
    write_atomic(
        &dir.join("report.md"),
        markdown_report(results, timings, sources).as_bytes(),
    )?;
    plot::draw_all(&dir.join("plots"), results)?;
    Ok(text_report(results, timings))
}

fn pretty_json<T: serde::Serialize + ?Sized>(value: &T) -> String {
    serde_json::to_string_pretty(value).expect("results serialize") + "\n"
}

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

/// The experiment config a run folder was made with (`config.toml`, which `compare` writes).
pub fn load_run_config(dir: &Path) -> Result<super::ExperimentConfig> {
    let path = dir.join(CONFIG_TOML);
    if !path.is_file() {
        return Err(Error::Input(format!(
            "{} has no {CONFIG_TOML} (poslab compare writes one into every run folder): without \
             it nothing says the runs share their settings",
            dir.display()
        )));
    }
    super::ExperimentConfig::load(&path)
}

/// Reads and joins run folders of one experiment ([`merge`]), after checking that every one was
/// made with the same config, every setting included (two runs of an experiment with the same
/// name but another `lr` are not one experiment). Returns the config too.
pub fn merge_runs(dirs: &[PathBuf]) -> Result<(Results, Vec<Timing>, super::ExperimentConfig)> {
    let first = dirs
        .first()
        .ok_or_else(|| Error::Input("give at least one run folder to report on".into()))?;
    let config = load_run_config(first)?;
    let reference = toml::Value::try_from(&config).expect("a config is TOML");
    let mut loaded = Vec::with_capacity(dirs.len());
    for dir in dirs {
        let other = load_run_config(dir)?;
        let value = toml::Value::try_from(&other).expect("a config is TOML");
        if let Some(diff) = crate::config::first_difference("", &reference, &value) {
            return Err(Error::Input(format!(
                "{} and {} were run with different configs ({diff}): only runs of one \
                 experiment, split by --task, --variant, --seed or --shard, can be merged",
                first.display(),
                dir.display()
            )));
        }
        let (results, timings) = load_run(dir)?;
        loaded.push((dir.clone(), results, timings));
    }
    let (mut results, mut timings) = merge(loaded)?;
    results.order_as(&config);
    let order: Vec<(String, String, u64)> = results.cells.iter().map(|c| c.key()).collect();
    timings.sort_by_key(|t| {
        order
            .iter()
            .position(|k| {
                (k.0.as_str(), k.1.as_str(), k.2) == (t.task.as_str(), t.variant.as_str(), t.seed)
            })
            .unwrap_or(usize::MAX)
    });
    Ok((results, timings, config))
}

/// Joins runs of the same experiment (cells split across machines by `--task`, `--variant`,
/// `--seed`). Tasks and variants must agree where they meet; a cell present twice must hold the
/// same results.
pub fn merge(runs: Vec<(PathBuf, Results, Vec<Timing>)>) -> Result<(Results, Vec<Timing>)> {
    let mut iter = runs.into_iter();
    let (first_dir, mut merged, mut timings) = iter
        .next()
        .ok_or_else(|| Error::Input("give at least one run folder to report on".into()))?;
    for (dir, results, more_timings) in iter {
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
            match merged.cells.iter().find(|m| m.key() == c.key()) {
                Some(m) if *m != c => {
                    return conflict(format!(
                        "the results of cell {}/{}/seed{}",
                        c.task, c.variant, c.seed
                    ))
                }
                Some(_) => {}
                None => merged.cells.push(c),
            }
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
    Ok((merged, timings))
}
