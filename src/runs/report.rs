//! Tables and files from a comparison's records: printed tables, `report.md`, `results.csv`,
//! `summary.csv`, `results.json`, `timing.json`, and the plots. Reading and joining run folders
//! is [`super::merge`]'s.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::results::{Aggregate, Outcome, Results, Stat, SummaryRow, TaskInfo, Timing};
use super::verdict::{self, Family};
use super::{charts, report_page};
use crate::error::Result;
use crate::io::write_atomic;
use crate::render::csv::rows_text;
use crate::render::table::TextTable;

use super::folder::{RESULTS_JSON, TIMING_JSON};

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

/// A test set's column heading: `2x (len 10-24…)` for a factor, `len 41-100…` for a range,
/// `…` being `extra` (its size).
fn test_heading(t: &super::results::TestInfo, extra: &str) -> String {
    match t.factor {
        Some(_) => format!("{} (len {}-{}{extra})", t.name, t.lengths[0], t.lengths[1]),
        None => format!("len {}-{}{extra}", t.lengths[0], t.lengths[1]),
    }
}

/// Next-token prediction's perplexity on each test set: `exp` of the mean loss over seeds (the
/// geometric mean of the seeds' perplexities), with the lowest and highest seed's; `None` for
/// other tasks.
fn perplexity_table(task: &TaskInfo, rows: &[&SummaryRow]) -> Option<TextTable> {
    if !task.needs_causal() {
        return None;
    }
    let mut table = TextTable {
        header: std::iter::once("variant".to_string())
            .chain(task.tests.iter().map(|t| test_heading(t, "")))
            .collect(),
        right: std::iter::once(false)
            .chain(std::iter::repeat_n(true, task.tests.len()))
            .collect(),
        ..TextTable::default()
    };
    for row in rows {
        let mut r = vec![row.variant.clone()];
        for t in &task.tests {
            let loss = row
                .columns
                .iter()
                .find(|c| c.name == t.name)
                .and_then(|c| c.loss.as_ref());
            r.push(match loss {
                Some(l) if l.n > 1 => format!(
                    "{:.2} ({:.2}..{:.2})",
                    l.mean.exp(),
                    l.min.exp(),
                    l.max.exp()
                ),
                Some(l) => format!("{:.2}", l.mean.exp()),
                None => "-".into(),
            });
        }
        table.rows.push(r);
    }
    Some(table)
}

/// What the perplexity table is, for its heading.
const PERPLEXITY: &str =
    "perplexity (exp of the mean next-token loss over seeds; lowest..highest seed)";

/// The tables of a task (scores by length; order tests and cost; for the length suite,
/// whole-sequence accuracy) and their notes.
fn task_tables(
    task: &TaskInfo,
    rows: &[&SummaryRow],
    results: &Results,
    timings: &[Timing],
) -> (TextTable, TextTable, Option<TextTable>, Vec<String>) {
    let mut notes = Notes::default();
    let times = timing_stats(timings);
    let variant = |name: &str| results.variants.iter().find(|v| v.name == name);
    let mut scores = TextTable {
        header: ["variant", "where", "width", "params"]
            .map(String::from)
            .to_vec(),
        right: vec![false, false, true, true],
        ..TextTable::default()
    };
    // A test set's size beside its name, where the record has it.
    let size = |n: usize| match n {
        0 => String::new(),
        n => format!(", n={n}"),
    };
    for t in &task.tests {
        scores.header.push(test_heading(t, &size(t.examples)));
        scores.right.push(true);
    }
    // Length-suite tasks: whole-sequence accuracy beside the per-output one.
    let mut sequences = task.score_above.map(|_| TextTable {
        header: std::iter::once("variant".to_string())
            .chain(
                task.tests
                    .iter()
                    .map(|t| format!("len {}-{}", t.lengths[0], t.lengths[1])),
            )
            .chain([super::results::SCORE.to_string()])
            .collect(),
        right: std::iter::once(false)
            .chain(std::iter::repeat_n(true, task.tests.len() + 1))
            .collect(),
        ..TextTable::default()
    });
    let order_cols: Vec<String> = task.columns().into_iter().skip(task.tests.len()).collect();
    let base = task.base_test().map_or(0, |t| t.examples);
    let mut tests = TextTable {
        header: std::iter::once("variant".to_string())
            .chain(order_cols.iter().map(|c| match c.as_str() {
                super::results::SCORE => c.clone(),
                _ if base > 0 => format!("{c} (n={base})"),
                _ => c.clone(),
            }))
            .chain(["train loss", "tokens/s", "s/run"].map(String::from))
            .collect(),
        right: std::iter::once(false)
            .chain(std::iter::repeat_n(true, order_cols.len() + 3))
            .collect(),
        ..TextTable::default()
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
    let mut notes: Vec<String> = notes
        .0
        .iter()
        .enumerate()
        .map(|(i, n)| format!("[{}] {n}", i + 1))
        .collect();
    let encoders: Vec<&str> = results
        .variants
        .iter()
        .filter(|v| !results.runs(task, &v.name))
        .map(|v| v.name.as_str())
        .collect();
    if !encoders.is_empty() {
        notes.push(format!(
            "Next-token prediction runs on the causal variants only: {} {} no cells here \
             (without the mask each position reads the token it is asked for).",
            encoders.join(", "),
            if encoders.len() == 1 { "has" } else { "have" }
        ));
    }
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
    scores: TextTable,
    tests: TextTable,
    sequences: Option<TextTable>,
    perplexity: Option<TextTable>,
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
                perplexity: perplexity_table(task, &rows),
                notes,
            })
        })
        .collect()
}

/// The length suite's two summary tables: every task's score by variant (mean ± std over
/// seeds), and the gain of randomized positions for each scheme; `None` without suite tasks.
/// The length suite's score table, and the randomized-positions gain table where the
/// experiment runs a scheme both with and without randomized positions.
fn suite_tables(results: &Results) -> Option<(TextTable, Option<TextTable>)> {
    let summary = super::suite::summarize(results)?;
    let mut scores = TextTable {
        header: std::iter::once("task".to_string())
            .chain(summary.variants.iter().cloned())
            .collect(),
        right: std::iter::once(false)
            .chain(std::iter::repeat_n(true, summary.variants.len()))
            .collect(),
        ..TextTable::default()
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
    let mut gains = TextTable {
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
        right: vec![false, false, false, true, true, true, true],
        ..TextTable::default()
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
    if summary.gains.is_empty() {
        return Some((scores, None));
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
    Some((scores, Some(gains)))
}

const SUITE_SCORES: &str = "length suite: score (accuracy in % averaged over every test length \
     above the training lengths, Ruoss et al. 2023), mean ± std over seeds";
const SUITE_GAINS: &str = "randomized positions: the mean over tasks of the score with \
     random_positions minus without, in points, over seeds' means and between best seeds, beside \
     the paper's average over its 15 tasks and schemes (best of 10 seeds and 3 learning rates); \
     a finding at this config's budget, not a replication";

/// The verdicts, one line per comparison and task: each evaluation's `b - a` in points with its
/// 95% interval, marked `*` where Holm's p is below 0.05; then the comparisons that could not
/// be made; a row with no cell in the results (a run of some variants) is one line, not one
/// for each of its comparisons. Empty when there are none.
pub fn verdict_lines(results: &Results, markdown: bool) -> Vec<String> {
    let mut lines = family_lines(results, Family::Planned, markdown);
    lines.extend(absent_lines(results, markdown));
    let exploratory = family_lines(results, Family::Exploratory, markdown);
    if !exploratory.is_empty() {
        lines.push(format!(
            "{}exploratory, chosen after the run began (no verdicts, outside the planned \
             correction):",
            if markdown { "\n" } else { "" }
        ));
        lines.extend(exploratory);
    }
    lines
}

/// The verdict lines of one family: one per task and pair.
fn family_lines(results: &Results, family: Family, markdown: bool) -> Vec<String> {
    let mut lines = Vec::new();
    // Every (task, a, b) with a verdict or a skipped evaluation, in report order.
    let mut seen: Vec<(&str, &str, &str)> = Vec::new();
    let keys = results
        .comparisons
        .iter()
        .filter(|c| c.family == family)
        .map(|c| (c.task.as_str(), c.a.as_str(), c.b.as_str()))
        .chain(
            results
                .comparisons_skipped
                .iter()
                .filter(|k| k.family == family)
                .map(|k| (k.task.as_str(), k.a.as_str(), k.b.as_str())),
        );
    for key in keys {
        if seen.contains(&key) {
            continue;
        }
        seen.push(key);
        let (task, a, b) = key;
        if !results.has_cells(task, a) || !results.has_cells(task, b) {
            continue;
        }
        let mut parts: Vec<String> = results
            .comparisons
            .iter()
            .filter(|d| d.family == family)
            .filter(|d| (d.task.as_str(), d.a.as_str(), d.b.as_str()) == key)
            .map(|d| {
                let detected = d.detected;
                let diff = format!("{:+.1}", d.diff);
                let diff = match (detected, markdown) {
                    (true, true) => format!("**{diff}**"),
                    (true, false) => format!("{diff}*"),
                    _ => diff,
                };
                format!(
                    "{} {diff} ({:+.1} to {:+.1})",
                    d.evaluation, d.ci_low, d.ci_high
                )
            })
            .collect();
        // The evaluations without a verdict, with the first one's reason.
        let skipped: Vec<&verdict::Skipped> = results
            .comparisons_skipped
            .iter()
            .filter(|k| k.family == family)
            .filter(|k| (k.task.as_str(), k.a.as_str(), k.b.as_str()) == key)
            .collect();
        if let Some(first) = skipped.first() {
            let names: Vec<&str> = skipped.iter().map(|k| k.evaluation.as_str()).collect();
            parts.push(format!("n/a {} ({})", names.join(", "), first.reason));
        }
        let (task, a, b) = if markdown {
            (format!("**{task}**"), format!("`{a}`"), format!("`{b}`"))
        } else {
            (task.to_string(), a.to_string(), b.to_string())
        };
        let bullet = if markdown { "- " } else { "" };
        lines.push(format!("{bullet}{task}, {b} − {a}: {}", parts.join("; ")));
    }
    lines
}

/// The comparisons without a verdict because a row has no cell on their task in `results` (a
/// run of some of the variants), in one line that names those rows: none when there are none.
fn absent_lines(results: &Results, markdown: bool) -> Vec<String> {
    // The rows, with the tasks they lack, in order of appearance; and the comparisons.
    let mut absent: Vec<(&str, Vec<&str>)> = Vec::new();
    let mut seen: Vec<(&str, &str, &str)> = Vec::new();
    for k in results
        .comparisons_skipped
        .iter()
        .filter(|k| k.family == Family::Planned)
    {
        let key = (k.task.as_str(), k.a.as_str(), k.b.as_str());
        let lacking: Vec<&str> = [key.1, key.2]
            .into_iter()
            .filter(|row| !results.has_cells(key.0, row))
            .collect();
        if lacking.is_empty() || seen.contains(&key) {
            continue;
        }
        seen.push(key);
        for row in lacking {
            match absent.iter_mut().find(|(r, _)| *r == row) {
                Some((_, tasks)) if !tasks.contains(&key.0) => tasks.push(key.0),
                Some(_) => {}
                None => absent.push((row, vec![key.0])),
            }
        }
    }
    if absent.is_empty() {
        return Vec::new();
    }
    let rows: Vec<String> = absent
        .into_iter()
        .map(|(row, tasks)| {
            let row = match markdown {
                true => format!("`{row}`"),
                false => row.to_string(),
            };
            match tasks.len() == results.tasks.len() {
                true => row,
                false => format!("{row} (on {})", tasks.join(", ")),
            }
        })
        .collect();
    let n = seen.len();
    vec![format!(
        "{}no verdict in {n} comparison{}: these results hold no cell of {}; run those cells, or \
         give [[comparisons]] between the rows they hold",
        if markdown { "- " } else { "" },
        if n == 1 { "" } else { "s" },
        rows.join(", ")
    )]
}

/// What the verdict lines say, in a sentence for the report's readers.
fn verdict_legend(results: &Results) -> String {
    let planned = planned_count(results);
    format!(
        "`b − a` in accuracy points, the mean over seeds, with its 95% interval (Student's t \
         over seeds and test examples, the method under \"Comparisons in full\"); marked where \
         the difference is detected: Holm's p < 0.05 over the {planned} planned comparison{} of \
         this report. The intervals are each comparison's own, not corrected for their number: \
         one that excludes zero without a mark is not a finding of this report. Every \
         comparison's p-values and smallest detectable difference are under \"Comparisons in \
         full\" and in `results.json` (`comparisons`).",
        if planned == 1 { "" } else { "s" }
    )
}

/// The planned comparisons with an estimate: the size of Holm's family.
fn planned_count(results: &Results) -> usize {
    results
        .comparisons
        .iter()
        .filter(|c| c.family == Family::Planned)
        .count()
}

/// The seeds of these results' cells, in order.
fn seeds_of(results: &Results) -> Vec<u64> {
    let mut seeds: Vec<u64> = results.cells.iter().map(|c| c.seed).collect();
    seeds.sort_unstable();
    seeds.dedup();
    seeds
}

/// `0, 1, 2` or `0-9` for a run of seeds.
fn seeds_label(seeds: &[u64]) -> String {
    match seeds {
        [] => String::new(),
        [one] => one.to_string(),
        [first, .., last] if seeds.len() > 3 && last - first + 1 == seeds.len() as u64 => {
            format!("{first}-{last}")
        }
        _ => seeds
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(", "),
    }
}

/// `text` broken into lines of at most `width` characters at spaces (a longer word keeps its
/// own line), for the terminal.
fn wrap(text: &str, width: usize) -> String {
    let mut lines: Vec<String> = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.chars().count() + 1 + word.chars().count() > width {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        lines.push(line);
    }
    lines.join("\n")
}

/// `(better, worse)` rows.
type Pair<'a> = (&'a str, &'a str);

/// A task and the tests on it.
type Places<'a> = (&'a str, Vec<&'a str>);

/// The report's opening paragraph, in words: what was detected and what was not, how many
/// comparisons share the correction, and what a seed varied.
pub fn findings(results: &Results, markdown: bool) -> Option<String> {
    let planned: Vec<&verdict::Comparison> = results
        .comparisons
        .iter()
        .filter(|c| c.family == Family::Planned)
        .collect();
    let no_verdict = results
        .comparisons_skipped
        .iter()
        .filter(|k| k.family == Family::Planned)
        .count();
    let code = |name: &str| match markdown {
        true => format!("`{name}`"),
        false => name.to_string(),
    };
    let s = |n: usize| if n == 1 { "" } else { "s" };
    let seeds = seeds_of(results);
    let mut text = String::new();
    if planned.is_empty() && no_verdict == 0 {
        text.push_str("This run compares no variants.");
    } else if planned.is_empty() {
        text.push_str(&format!(
            "No comparison has a verdict ({no_verdict} could not be made; the reasons are \
             below)."
        ));
    } else {
        // Who was better than whom, where: grouped by (better, worse), then by task.
        let mut found: Vec<(Pair, Vec<Places>)> = Vec::new();
        for c in planned.iter().filter(|c| c.detected) {
            let pair = match c.diff > 0.0 {
                true => (c.b.as_str(), c.a.as_str()),
                false => (c.a.as_str(), c.b.as_str()),
            };
            let at = match found.iter().position(|(p, _)| *p == pair) {
                Some(i) => i,
                None => {
                    found.push((pair, Vec::new()));
                    found.len() - 1
                }
            };
            let tasks = &mut found[at].1;
            match tasks.iter_mut().find(|(t, _)| *t == c.task) {
                Some((_, tests)) => tests.push(&c.evaluation),
                None => tasks.push((&c.task, vec![&c.evaluation])),
            }
        }
        let detected = planned.iter().filter(|c| c.detected).count();
        text.push_str(&format!(
            "Of the {} planned comparison{}, which share Holm's correction at 0.05, {detected} \
             found a difference",
            planned.len(),
            s(planned.len())
        ));
        if found.is_empty() {
            text.push('.');
        } else {
            let parts: Vec<String> = found
                .iter()
                .map(|((better, worse), tasks)| {
                    let places: Vec<String> = tasks
                        .iter()
                        .map(|(task, tests)| format!("{task} ({})", tests.join(", ")))
                        .collect();
                    format!(
                        "{} better than {} on {}",
                        code(better),
                        code(worse),
                        places.join(", ")
                    )
                })
                .collect();
            text.push_str(&format!(": {}.", parts.join("; ")));
        }
        let alike = planned
            .iter()
            .filter(|c| !c.detected && c.diff == 0.0 && (c.ci_low, c.ci_high) == (0.0, 0.0))
            .count();
        let inconclusive = planned.len() - detected - alike;
        if inconclusive > 0 {
            text.push_str(&format!(
                " {inconclusive} {} inconclusive at {} seed{}: no difference found, which is not \
                 a finding of no difference.",
                if inconclusive == 1 { "is" } else { "are" },
                seeds.len(),
                s(seeds.len())
            ));
        }
        if alike > 0 {
            text.push_str(&format!(
                " In {alike} the two variants had the same outcome on every example in every \
                 seed."
            ));
        }
        // The pairs with nothing detected on any test.
        let mut quiet: Vec<(&str, &str)> = Vec::new();
        for c in &planned {
            let key = (c.a.as_str(), c.b.as_str());
            let any = planned
                .iter()
                .any(|d| (d.a.as_str(), d.b.as_str()) == key && d.detected);
            if !any && !quiet.contains(&key) {
                quiet.push(key);
            }
        }
        if !quiet.is_empty() && detected > 0 {
            let pairs: Vec<String> = quiet
                .iter()
                .map(|(a, b)| format!("{} against {}", code(b), code(a)))
                .collect();
            text.push_str(&format!(
                " Nothing was found on any test of {}.",
                pairs.join(", or of ")
            ));
        }
        if no_verdict > 0 {
            text.push_str(&format!(
                " {no_verdict} more ha{} no verdict (the reasons are below).",
                if no_verdict == 1 { "s" } else { "ve" }
            ));
        }
    }
    text.push_str(&format!(
        " Each of the {} seed{} ({}) drew {}.",
        seeds.len(),
        s(seeds.len()),
        seeds_label(&seeds),
        results.data_seed.seed_varies()
    ));
    if seeds.len() < verdict::MIN_SEEDS {
        text.push_str(&format!(
            " One seed cannot measure how much training varies, so no difference is marked: \
             run at least {} seeds (3 or more for a useful interval).",
            verdict::MIN_SEEDS
        ));
    }
    let exploratory = results
        .comparisons
        .iter()
        .filter(|c| c.family == Family::Exploratory)
        .count();
    if exploratory > 0 {
        text.push_str(&format!(
            " {exploratory} exploratory comparison{}, chosen after the run began, {} reported \
             without verdicts.",
            s(exploratory),
            if exploratory == 1 { "is" } else { "are" }
        ));
    }
    Some(text)
}

/// Every comparison as a table: the numbers behind the verdicts.
fn comparison_table(results: &Results) -> TextTable {
    let mut t = TextTable::new(
        [
            "task",
            "test",
            "b − a",
            "diff",
            "95% CI",
            "se",
            "t",
            "p",
            "p (Holm)",
            "detectable",
            "seeds",
            "examples",
            "verdict",
        ],
        [
            false, false, false, true, true, true, true, true, true, true, true, true, false,
        ],
    );
    for c in &results.comparisons {
        t.push([
            c.task.clone(),
            c.evaluation.clone(),
            format!("{} − {}", c.b, c.a),
            format!("{:+.1}", c.diff),
            format!("{:+.1} to {:+.1}", c.ci_low, c.ci_high),
            format!("{:.2}", c.se),
            format!("{:.2}", c.t),
            verdict::format_p(c.p),
            verdict::format_p(c.p_holm),
            format!("{:.1}", c.detectable),
            c.seeds.to_string(),
            c.examples.to_string(),
            c.verdict.clone(),
        ]);
    }
    t
}

/// The printed report: the verdicts first, then each task's tables.
pub fn text_report(results: &Results, timings: &[Timing]) -> String {
    let mut out = String::new();
    if let Some(p) = &results.partial {
        let _ = writeln!(out, "{p} (missing: {} cells)", p.missing.len());
    }
    let verdicts = verdict_lines(results, false);
    if let Some(words) = findings(results, false) {
        let _ = writeln!(out, "\n{}", wrap(&words, 96));
    }
    if !verdicts.is_empty() {
        let _ = writeln!(
            out,
            "\n== Verdicts (b − a in points, 95% interval; * detected, Holm's p < 0.05 over the \
             {} planned)\n",
            planned_count(results)
        );
        for line in verdicts {
            let _ = writeln!(out, "{line}");
        }
    }
    for s in sections(results, timings) {
        let _ = writeln!(out, "\n== {}\n", s.heading);
        out.push_str(&s.scores.text());
        out.push('\n');
        out.push_str(&s.tests.text());
        if let Some(t) = &s.sequences {
            out.push_str("\nwhole-sequence accuracy in %:\n");
            out.push_str(&t.text());
        }
        if let Some(t) = &s.perplexity {
            let _ = writeln!(out, "\n{PERPLEXITY}:");
            out.push_str(&t.text());
        }
        for n in s.notes {
            let _ = writeln!(out, "{n}");
        }
    }
    if let Some((scores, gains)) = suite_tables(results) {
        let _ = writeln!(out, "\n== {SUITE_SCORES}\n");
        out.push_str(&scores.text());
        if let Some(gains) = gains {
            let _ = writeln!(out, "\n== {SUITE_GAINS}\n");
            out.push_str(&gains.text());
        }
    }
    out
}

fn markdown_report(results: &Results, timings: &[Timing], sources: &[PathBuf]) -> String {
    let mut md = format!("# poslab compare: {}\n\n", results.experiment);
    if let Some(p) = &results.partial {
        let _ = writeln!(
            md,
            "**{p}**: this merge lacks {} cells ({}{}); their rows and means are missing or over \
             fewer seeds.\n",
            p.missing.len(),
            p.missing
                .iter()
                .take(10)
                .cloned()
                .collect::<Vec<_>>()
                .join(", "),
            if p.missing.len() > 10 { ", ..." } else { "" }
        );
    }
    let verdicts = verdict_lines(results, true);
    if let Some(words) = findings(results, true) {
        let _ = write!(md, "{words}\n\n");
    }
    if !verdicts.is_empty() {
        let _ = write!(md, "## Verdicts\n\n{}\n\n", verdict_legend(results));
        for line in verdicts {
            let _ = writeln!(md, "{line}");
        }
        md.push('\n');
    }
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
        if let Some(gains) = gains {
            let _ = write!(md, "\n{SUITE_GAINS}.\n\n");
            md.push_str(&gains.markdown());
        }
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
        if let Some(t) = &s.perplexity {
            let _ = writeln!(md, "\nP{}:\n", &PERPLEXITY[1..]);
            md.push_str(&t.markdown());
        }
        for n in s.notes {
            let _ = writeln!(md, "\n{n}");
        }
        let _ = writeln!(md, "\n![training loss](plots/loss_{}.png)", s.task.name);
        if s.task.score_above.is_some() || super::curves::lengths_vary(results, s.task) {
            let _ = writeln!(md, "![score by length](plots/length_{}.png)", s.task.name);
        }
    }
    if !results.comparisons.is_empty() {
        let _ = write!(md, "\n## Comparisons in full\n\n{}\n\n", COMPARISON_METHOD);
        md.push_str(&comparison_table(results).markdown());
    }
    md
}

/// How the comparisons are computed, for the report.
const COMPARISON_METHOD: &str = "Each cell of a task is tested on the same examples, so two \
    variants pair up example by example and seed by seed. `diff` is `b − a` in accuracy points, \
    the mean over seeds. Each example's share of it is split, by a two-way analysis of \
    variance, into a seed effect (what a seed gives b over a: how training varies), an example \
    effect and a residual. The 95% interval is the wider of two Student's t intervals: the \
    seeds' (the spread of the per-seed differences, on seeds − 1 degrees of freedom), and the \
    outcomes' (the residual, on many), each widened by the examples' effect on their own degrees \
    of freedom (`se` is the interval's standard error and `t` its half-width over it); `p` is the \
    larger of their two-sided p-values, computed exactly (no resampling), so p < 0.05 exactly \
    when the interval excludes zero. Intervals end at ±100 points. `p (Holm)` is Holm's \
    correction over the planned comparisons of this report (the config's `[[comparisons]]` as \
    the run began, or each row against the first); a verdict names the better variant when it \
    is below 0.05. Exploratory comparisons (chosen after the run began: `poslab report \
    --compare`, or `[[comparisons]]` added later) have Holm's correction among themselves and \
    no verdict. `detectable` is the difference this run would find with 80% power at the level \
    Holm's correction tests the family's first comparison at (0.05 over the family's size). One \
    seed gives no verdict. On simulated runs with a seed-by-variant interaction, at 2, 3, 5 and \
    10 seeds, the intervals held the truth 95.2-96.7% of the time and families of 10 A/A \
    comparisons marked a difference at most 4.8% of the time (the tests of \
    `src/runs/verdict.rs`; real A/A runs in the book's Verified page).";

/// `v` rounded to `decimals` places (what a timing is worth).
fn rounded(v: f64, decimals: i32) -> f64 {
    let scale = 10f64.powi(decimals);
    (v * scale).round() / scale
}

/// A row of `results.csv`: a cell's test, with the cell's timing.
#[derive(serde::Serialize)]
struct ResultRow<'a> {
    task: &'a str,
    variant: &'a str,
    seed: u64,
    d_model: usize,
    params: usize,
    max_len: usize,
    steps: usize,
    tokens: usize,
    final_train_loss: f64,
    evaluation: &'a str,
    accuracy: Option<f64>,
    loss: Option<f64>,
    unavailable: Option<&'a str>,
    train_seconds: Option<f64>,
    tokens_per_second: Option<f64>,
    wall_seconds: Option<f64>,
}

/// One row per cell and evaluation, with the cell's timing.
fn results_csv(results: &Results, timings: &[Timing]) -> String {
    rows_text(results.cells.iter().flat_map(|c| {
        let t = timings
            .iter()
            .find(|t| t.task == c.task && t.variant == c.variant && t.seed == c.seed);
        let s = &c.summary;
        s.evaluations.iter().map(move |e| {
            let (accuracy, loss, unavailable) = match &e.outcome {
                Outcome::Scored { accuracy, loss, .. } => (Some(*accuracy), Some(*loss), None),
                Outcome::Unavailable { reason } => (None, None, Some(reason.as_str())),
            };
            ResultRow {
                task: &c.task,
                variant: &c.variant,
                seed: c.seed,
                d_model: s.d_model,
                params: s.params,
                max_len: s.max_len,
                steps: s.steps,
                tokens: s.tokens,
                final_train_loss: s.final_train_loss,
                evaluation: &e.name,
                accuracy,
                loss,
                unavailable,
                train_seconds: t.map(|t| rounded(t.train_seconds, 3)),
                tokens_per_second: t.map(|t| rounded(t.tokens_per_second, 1)),
                wall_seconds: t.map(|t| rounded(t.wall_seconds, 3)),
            }
        })
    }))
}

/// A row of `summary.csv`: a task, variant and evaluation over seeds.
#[derive(serde::Serialize)]
struct SummaryCsvRow<'a> {
    task: &'a str,
    variant: &'a str,
    seeds: usize,
    d_model: usize,
    params: usize,
    evaluation: &'a str,
    n: usize,
    mean: Option<f64>,
    std: Option<f64>,
    min: Option<f64>,
    max: Option<f64>,
    unavailable: Option<&'a str>,
}

/// One row per task, variant and evaluation, over seeds.
fn summary_csv(results: &Results) -> String {
    rows_text(results.summary.iter().flat_map(|r| {
        r.columns.iter().map(move |c| {
            let stat = |f: fn(&Stat) -> f64| c.accuracy.as_ref().map(f);
            SummaryCsvRow {
                task: &r.task,
                variant: &r.variant,
                seeds: r.seeds.len(),
                d_model: r.d_model,
                params: r.params,
                evaluation: &c.name,
                n: c.accuracy.as_ref().map_or(0, |s| s.n),
                mean: stat(|s| s.mean),
                std: stat(|s| s.std),
                min: stat(|s| s.min),
                max: stat(|s| s.max),
                unavailable: c.unavailable.as_deref(),
            }
        })
    }))
}

/// Writes every report file into `dir` and returns the printed report.
pub fn write_report(
    dir: &Path,
    results: &Results,
    timings: &[Timing],
    sources: &[PathBuf],
) -> Result<String> {
    write_report_with(dir, results, timings, sources, &|| {})
}

/// [`write_report`], calling `before_results` before `results.json` is written: it is written
/// last, so that a folder holding it holds a complete report.
pub fn write_report_with(
    dir: &Path,
    results: &Results,
    timings: &[Timing],
    sources: &[PathBuf],
    before_results: &dyn Fn(),
) -> Result<String> {
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
    write_atomic(
        &dir.join("report.html"),
        html_report(results, timings, sources).as_bytes(),
    )?;
    charts::draw_all(&dir.join("plots"), results)?;
    before_results();
    write_atomic(&dir.join(RESULTS_JSON), pretty_json(results).as_bytes())?;
    Ok(text_report(results, timings))
}

/// `report.html`: the verdicts, and each task's tables as `report.md` lays them out, with its
/// curves.
fn html_report(results: &Results, timings: &[Timing], sources: &[PathBuf]) -> String {
    let sections = sections(results, timings);
    let tasks: Vec<report_page::TaskTables> = sections
        .iter()
        .map(|s| report_page::TaskTables {
            task: s.task,
            heading: s.heading.clone(),
            tables: [
                ("scores by test set", Some(&s.scores)),
                ("order tests and cost", Some(&s.tests)),
                ("whole-sequence accuracy in %", s.sequences.as_ref()),
                (PERPLEXITY, s.perplexity.as_ref()),
            ]
            .into_iter()
            .filter_map(|(title, t)| Some((title, t?)))
            .collect(),
            notes: s.notes.clone(),
        })
        .collect();
    let texts = report_page::Texts {
        findings: findings(results, false),
        legend: verdict_legend(results),
        method: COMPARISON_METHOD,
        sources,
        absent: absent_lines(results, false),
    };
    report_page::page(results, &tasks, &texts)
}

fn pretty_json<T: serde::Serialize + ?Sized>(value: &T) -> String {
    serde_json::to_string_pretty(value).expect("results serialize") + "\n"
}
