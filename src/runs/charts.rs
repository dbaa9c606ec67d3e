//! PNG plots of a comparison: training loss per variant, score against input length (where the
//! test examples' lengths vary), each a mean over seeds with the band from the lowest seed to
//! the highest ([`super::curves`]).

use std::path::Path;

use super::curves::{self, Curve, LENGTHS};
use super::results::{Outcome, Results, TaskInfo};
use crate::error::Result;
use crate::render::chart::{
    Axis, Chart, Color, Corner, Grid, Key, Legend, Mark, Note, Picture, Series, Ticks,
};
use crate::render::png::draw;

/// Every plot of `results` into `dir`.
pub fn draw_all(dir: &Path, results: &Results) -> Result<()> {
    for task in &results.tasks {
        if results.cells.iter().any(|c| c.task == task.name) {
            loss_curves(&dir.join(format!("loss_{}.png", task.name)), task, results)?;
            let path = dir.join(format!("length_{}.png", task.name));
            if task.score_above.is_some() {
                super::suite_plot::task_plot(&path, task, results)?;
            } else {
                let curves = curves::length_curves(results, task, LENGTHS);
                if curves::vary(&curves) {
                    score_by_length(&path, task, results, curves)?;
                }
            }
        }
    }
    super::suite_plot::suite_plot(&dir.join("length_suite.png"), results)
}

fn loss_curves(path: &Path, task: &TaskInfo, results: &Results) -> Result<()> {
    let curves = curves::loss_curves(results, task);
    let points = curves.iter().flat_map(|c| c.points.iter());
    let max_step = points.clone().map(|p| p.x).fold(1.0, f64::max);
    let (lo, hi) = points
        .flat_map(|p| [p.low, p.high])
        .filter(|l| l.is_finite() && *l > 0.0)
        .fold((f64::INFINITY, 0.0f64), |(lo, hi), l| {
            (lo.min(l), hi.max(l))
        });
    let (lo, hi) = if lo < hi {
        (lo * 0.8, hi * 1.25)
    } else {
        (1e-3, 10.0)
    };
    let floor = |v: f64| v.max(lo);
    let mut series = Vec::new();
    for (i, curve) in curves.iter().enumerate() {
        let color = Color::palette(i);
        series.push(band(curve, color, floor).into());
        let points = curve.points.iter().map(|p| (p.x, floor(p.mean)));
        series.push(mean_line(curve, points.collect(), color));
    }
    let chart = Chart {
        caption: (
            format!(
                "{}: training loss (mean over seeds; band: lowest to highest seed)",
                task.name
            ),
            26,
        ),
        margin: 16,
        label_areas: (48, 72),
        x: Axis::linear(0.0, max_step)
            .titled("step")
            .ticks(Ticks::Whole),
        y: Axis::log(lo, hi).titled("cross-entropy loss (log scale)"),
        grid: Grid::Full,
        axis_font: Some(18),
        label_font: 14,
        series,
        legend: Some(Legend::at(Some(Corner::UpperRight), 15)),
    };
    draw(path, Picture::chart((960, 600), chart))
}

/// A curve's band, from its lowest seed to its highest (`clip` bounds a value to the chart).
fn band(curve: &Curve, color: Color, clip: impl Fn(f64) -> f64) -> Mark {
    let points = curve.band().into_iter();
    let points = points.map(|(x, low, high)| (x, clip(low), clip(high)));
    Mark::Band {
        points: points.collect(),
        color,
    }
}

/// A variant's mean line through `points`, named in the legend.
fn mean_line(curve: &Curve, points: Vec<(f64, f64)>, color: Color) -> Series {
    let key = Key::Line {
        length: 20,
        stroke: color.stroke(3),
    };
    let stroke = color.stroke(2);
    Mark::Line { points, stroke }.keyed(curve.variant.as_str(), key)
}

/// `length_<task>.png` where the test examples' lengths vary: each variant's accuracy at every
/// tested length, pooled over the test sets (the mean over seeds, with the seeds' band), and
/// the shuffle and shift tests as markers at the middle of the lengths they run at, with
/// whiskers from the lowest seed to the highest.
fn score_by_length(
    path: &Path,
    task: &TaskInfo,
    results: &Results,
    curves: Vec<Curve>,
) -> Result<()> {
    let x_max = task.tests.iter().map(|t| t.lengths[1]).max().unwrap_or(1) as f64 * 1.04;
    let base_x = task
        .base_test()
        .map_or(0.0, |t| (t.lengths[0] + t.lengths[1]) as f64 / 2.0);
    let order_tests: Vec<String> = curves::evaluations(task).into_iter().skip(1).collect();
    // The shuffle test (first, where it runs) is marked by a triangle, the shift test a cross.
    let triangle = |k: usize| k == 0 && task.shuffle_test;
    let mut series = Vec::new();
    let trained = task.train_lengths[1] as f64 + 0.5;
    series.push(super::suite_plot::trained_line(trained));
    if let Some(c) = &task.order_blind_ceiling {
        let y = 100.0 * c.accuracy;
        let stroke = Color::BLACK.mix(0.6).stroke(2);
        let line = Mark::Line {
            points: vec![(0.0, y), (x_max, y)],
            stroke: stroke.dashed(8, 6),
        };
        let key = Key::Line { length: 20, stroke };
        series.push(line.keyed(format!("order-blind ceiling {y:.0}%"), key));
    }
    let color = |name: &str| {
        let index = results.variants.iter().position(|v| v.name == name);
        Color::palette(index.unwrap_or(0))
    };
    for curve in &curves {
        let color = color(&curve.variant);
        series.push(band(curve, color, |v| v).into());
        let points = curve.points.iter().map(|p| (p.x, p.mean)).collect();
        series.push(mean_line(curve, points, color));
    }
    // A curve over fewer lengths than the others (a learned table that cannot read the longer
    // tests) is drawn again on top, its points marked, so that it does not hide under curves
    // that run along it.
    let longest = curves.iter().map(|c| c.points.len()).max().unwrap_or(0);
    for curve in curves.iter().filter(|c| c.points.len() < longest) {
        let color = color(&curve.variant);
        let points: Vec<(f64, f64)> = curve.points.iter().map(|p| (p.x, p.mean)).collect();
        let dots = points.iter().map(|&p| (p, color)).collect();
        let stroke = color.stroke(2);
        series.push(Mark::Line { points, stroke }.into());
        series.push(Mark::Dots { dots, radius: 3 }.into());
    }
    series.extend(order_markers(task, results, (base_x, x_max), &order_tests));
    let mut foot = format!(
        "dashed vertical: the longest trained length; at {base_x:.0}: {}",
        order_tests
            .iter()
            .enumerate()
            .map(|(k, t)| match triangle(k) {
                true => format!("{t} (triangle)"),
                false => format!("{t} (cross)"),
            })
            .collect::<Vec<_>>()
            .join(", ")
    );
    let unavailable = unavailable(task, results);
    if !unavailable.is_empty() {
        foot.push_str(&format!(
            "; not runnable (learned table too short): {}",
            unavailable.join(", ")
        ));
    }
    let chart = Chart {
        caption: (
            format!(
                "{}: {} by input length (trained on {}-{})",
                task.name, task.metric, task.train_lengths[0], task.train_lengths[1]
            ),
            24,
        ),
        margin: 16,
        label_areas: (70, 64),
        x: Axis::linear(0.0, x_max)
            .titled("input length (every test set; band: lowest to highest seed)")
            .ticks(Ticks::Whole),
        y: Axis::linear(0.0, 102.0)
            .titled(format!("{} (%)", task.metric))
            .ticks(Ticks::Whole),
        grid: Grid::Full,
        axis_font: Some(18),
        label_font: 14,
        series,
        legend: Some(Legend::at(Some(Corner::LowerLeft), 15)),
    };
    let picture = Picture::chart((960, 600), chart).with(Note::faint(foot, (90, 582), 13, 0.7));
    draw(path, picture)
}

/// Each variant's order tests (`order_tests`: the shuffle test first where it runs, a triangle;
/// the shift test a cross) at `base_x`, spread sideways a little so that whiskers from the
/// lowest seed to the highest do not hide each other.
fn order_markers(
    task: &TaskInfo,
    results: &Results,
    (base_x, x_max): (f64, f64),
    order_tests: &[String],
) -> Vec<Series> {
    let n = results.variants.len().max(1) as f64;
    let mut series = Vec::new();
    for (i, v) in results.variants.iter().enumerate() {
        let row = results
            .summary
            .iter()
            .find(|r| r.task == task.name && r.variant == v.name);
        for (k, name) in order_tests.iter().enumerate() {
            let Some(s) = row.and_then(|r| r.columns.iter().find(|c| &c.name == name)?.accuracy)
            else {
                continue;
            };
            let (low, mean, high) = (100.0 * s.min, 100.0 * s.mean, 100.0 * s.max);
            let color = Color::palette(i);
            let x = base_x + (i as f64 - (n - 1.0) / 2.0) * x_max * 0.008;
            let stroke = color.stroke(2);
            let whisker = 8;
            let bar = Mark::ErrorBar {
                x,
                low,
                mean,
                high,
                stroke,
                whisker,
            };
            let at = (x, mean);
            let marker = match k == 0 && task.shuffle_test {
                true => Mark::Triangle { at, size: 6, color },
                false => Mark::Cross {
                    at,
                    size: 5,
                    stroke,
                },
            };
            series.extend([bar.into(), marker.into()]);
        }
    }
    series
}

/// `variant test` for every test of `task` a variant could not run, sorted.
fn unavailable(task: &TaskInfo, results: &Results) -> Vec<String> {
    results
        .cells
        .iter()
        .filter(|c| c.task == task.name)
        .flat_map(|c| c.summary.evaluations.iter().map(move |e| (c, e)))
        .filter(|(_, e)| {
            matches!(e.outcome, Outcome::Unavailable { .. })
                && task.tests.iter().any(|t| t.name == e.name)
        })
        .map(|(c, e)| format!("{} {}", c.variant, e.name))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect()
}
