//! `report.html`: one self-contained page per compare run or merged report.
//!
//! The page leads with the verdicts, then each task's tables and its curves (score against
//! length, the shuffle and shift tests, training loss), each a mean over seeds with the band
//! from the lowest seed to the highest. It is interactive: variants toggle on and off, an
//! evaluation can be chosen for the verdicts and for the curves, and hovering a chart shows
//! every visible variant's values at that point.
//!
//! The page's data is built here; [`crate::render::html`] draws it (`comparison.js`, with the
//! shared pieces, and where the choice of poslab's own SVG over a charting library is
//! explained).

use serde::Serialize;

use super::curves::{self, Curve};
use super::results::{Results, TaskInfo};
use super::verdict;
use crate::render::html::{significant, Script};
use crate::render::table::TextTable;

/// What the page is drawn from, embedded as JSON.
#[derive(Serialize)]
struct Page<'a> {
    title: String,
    partial: Option<String>,
    sources: Vec<String>,
    findings: Option<String>,
    legend: String,
    method: &'static str,
    curve_method: &'static str,
    variants: Vec<&'a str>,
    verdicts: Vec<VerdictRow<'a>>,
    skipped: Vec<SkippedRow<'a>>,
    /// The comparisons without a verdict because a row has no cell, in one line.
    absent: Vec<String>,
    tasks: Vec<TaskView<'a>>,
}

/// One comparison: its numbers, and the text the report prints for them.
#[derive(Serialize)]
struct VerdictRow<'a> {
    task: &'a str,
    evaluation: &'a str,
    a: &'a str,
    b: &'a str,
    detected: bool,
    exploratory: bool,
    diff: String,
    ci: String,
    p: String,
    p_holm: String,
    detectable: String,
    seeds: usize,
    examples: usize,
    verdict: &'a str,
}

/// A comparison that could not be made, with the reason.
#[derive(Serialize)]
struct SkippedRow<'a> {
    task: &'a str,
    evaluation: &'a str,
    a: &'a str,
    b: &'a str,
    reason: &'a str,
}

/// A table: its header and rows of text, the first cell of a row its variant.
#[derive(Serialize)]
struct Table {
    title: String,
    header: Vec<String>,
    right: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn of(title: &str, t: &TextTable) -> Self {
        Self {
            title: title.into(),
            header: t.header.clone(),
            right: t.right.clone(),
            rows: t.rows.clone(),
        }
    }
}

/// A chart's curves: `[x, mean, low, high, seeds, examples]` per point.
#[derive(Serialize)]
struct Chart {
    /// What the curves are of: `lengths`, `shuffled`, `shift+k`, `loss`.
    name: String,
    series: Vec<Series>,
}

#[derive(Serialize)]
struct Series {
    variant: String,
    points: Vec<[f64; 6]>,
}

fn chart(name: &str, curves: Vec<Curve>) -> Chart {
    Chart {
        name: name.into(),
        series: curves
            .into_iter()
            .map(|c| Series {
                variant: c.variant,
                points: c
                    .points
                    .iter()
                    .map(|p| {
                        [
                            significant(p.x),
                            significant(p.mean),
                            significant(p.low),
                            significant(p.high),
                            p.seeds as f64,
                            p.examples as f64,
                        ]
                    })
                    .collect(),
            })
            .collect(),
    }
}

/// A task's tables as the report lays them out: what [`page`] shows of a task beside its curves.
pub struct TaskTables<'a> {
    /// The task.
    pub task: &'a TaskInfo,
    /// Its heading, a line per paragraph.
    pub heading: String,
    /// Its tables, each with a title.
    pub tables: Vec<(&'static str, &'a TextTable)>,
    /// The numbered notes its tables point to.
    pub notes: Vec<String>,
}

/// What the page says beside its data: how the verdicts read and how they are computed.
pub struct Texts<'a> {
    /// The opening paragraph: what was found, in words.
    pub findings: Option<String>,
    /// What a verdict line says.
    pub legend: String,
    /// How the comparisons are computed.
    pub method: &'static str,
    /// The folders a merged report was made from.
    pub sources: &'a [std::path::PathBuf],
    /// The comparisons without a verdict because a row has no cell, in one line each.
    pub absent: Vec<String>,
}

/// A task's part of the page.
#[derive(Serialize)]
struct TaskView<'a> {
    name: &'a str,
    heading: Vec<String>,
    metric: &'a str,
    trained: usize,
    ceiling: Option<f64>,
    tests: Vec<TestView<'a>>,
    tables: Vec<Table>,
    notes: Vec<String>,
    lengths: Vec<Chart>,
    loss: Chart,
}

/// A test set: its name, lengths and size.
#[derive(Serialize)]
struct TestView<'a> {
    name: &'a str,
    lengths: [usize; 2],
    examples: usize,
}

/// How the curves are drawn, for the page's readers.
const CURVE_METHOD: &str = "Each line is the mean over seeds, and its band runs from the \
    lowest seed to the highest. Against length, a seed's accuracy at a length is its right \
    outputs over its counted outputs among the examples of that length, pooled over the test \
    sets (1x, 2x, 4x or the ranges); the shuffle and shift tests have their own curves over \
    the lengths they run at. Where a task tests more than 60 lengths, they are grouped into \
    bins of equal width (never across the longest trained length), each length weighing the \
    same. Hover a chart for the values, and the examples behind each point.";

/// The page for `results`: self-contained, with its data, style and script embedded.
pub fn page(results: &Results, tasks: &[TaskTables], texts: &Texts) -> String {
    let page = Page {
        title: format!("poslab compare: {}", results.experiment),
        partial: results
            .partial
            .as_ref()
            .map(|p| format!("{p} (missing: {} cells)", p.missing.len())),
        sources: texts
            .sources
            .iter()
            .map(|s| s.display().to_string())
            .collect(),
        findings: texts.findings.clone(),
        legend: texts.legend.clone(),
        method: texts.method,
        curve_method: CURVE_METHOD,
        variants: results.variants.iter().map(|v| v.name.as_str()).collect(),
        verdicts: results
            .comparisons
            .iter()
            .map(|c| VerdictRow {
                task: &c.task,
                evaluation: &c.evaluation,
                a: &c.a,
                b: &c.b,
                detected: c.detected,
                exploratory: c.family == verdict::Family::Exploratory,
                diff: format!("{:+.1}", c.diff),
                ci: format!("{:+.1} to {:+.1}", c.ci_low, c.ci_high),
                p: verdict::format_p(c.p),
                p_holm: verdict::format_p(c.p_holm),
                detectable: format!("{:.1}", c.detectable),
                seeds: c.seeds,
                examples: c.examples,
                verdict: &c.verdict,
            })
            .collect(),
        skipped: results
            .comparisons_skipped
            .iter()
            .filter(|k| results.has_cells(&k.task, &k.a) && results.has_cells(&k.task, &k.b))
            .map(|k| SkippedRow {
                task: &k.task,
                evaluation: &k.evaluation,
                a: &k.a,
                b: &k.b,
                reason: &k.reason,
            })
            .collect(),
        absent: texts.absent.clone(),
        tasks: tasks
            .iter()
            .map(|s| {
                let task = s.task;
                TaskView {
                    name: &task.name,
                    heading: s.heading.lines().map(String::from).collect(),
                    metric: &task.metric,
                    trained: task.train_lengths[1],
                    ceiling: task
                        .order_blind_ceiling
                        .as_ref()
                        .map(|c| 100.0 * c.accuracy),
                    tests: task
                        .tests
                        .iter()
                        .map(|t| TestView {
                            name: &t.name,
                            lengths: t.lengths,
                            examples: t.examples,
                        })
                        .collect(),
                    tables: s
                        .tables
                        .iter()
                        .map(|(title, t)| Table::of(title, t))
                        .collect(),
                    notes: s.notes.clone(),
                    lengths: curves::evaluations(task)
                        .iter()
                        .map(|e| chart(e, curves::length_curves(results, task, e)))
                        .filter(|c| !c.series.is_empty())
                        .collect(),
                    loss: chart("loss", curves::loss_curves(results, task)),
                }
            })
            .collect(),
    };
    crate::render::html::document(&page.title, &page, Script::Comparison)
}
