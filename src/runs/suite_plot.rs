//! Plots of the length suite: accuracy against input length, per task (`length_<task>.png`)
//! and for every task on one page (`length_suite.png`).
//!
//! Each variant is a line of the mean over seeds of the per-length accuracy, averaged over bins
//! of lengths so that a few examples per length still read as a curve (bins never straddle the
//! training maximum, drawn as a dashed vertical line; see [`super::curves`]), with the band
//! from the lowest seed to the highest on a task's own plot. A scheme keeps its colour; its
//! randomized-positions variant is the dashed line of the same colour.

use std::path::Path;

use super::curves::{length_curves, LENGTHS};
use super::results::{Results, TaskInfo};
use crate::error::Result;
use crate::render::chart::{
    Axis, Chart, Color, Corner, Grid, Key, Layout, Legend, Mark, Note, Page, Picture, Series, Ticks,
};
use crate::render::png::draw;

/// `(variant, colour index, dashed)` of every variant with results on `task`: colours by
/// scheme in order of appearance, dashed for randomized positions.
fn styles(results: &Results, task: &str) -> Vec<(String, usize, bool)> {
    let mut schemes: Vec<String> = Vec::new();
    results
        .variants
        .iter()
        .filter(|v| {
            results
                .cells
                .iter()
                .any(|c| c.task == task && c.variant == v.name)
        })
        .map(|v| {
            // A scheme and its options: the same with and without randomized positions.
            let key = serde_json::to_string(&v.positional).unwrap_or_default() + &v.width;
            let i = schemes.iter().position(|s| *s == key).unwrap_or_else(|| {
                schemes.push(key);
                schemes.len() - 1
            });
            (v.name.clone(), i, v.random_positions.is_some())
        })
        .collect()
}

/// The dashed vertical line at the longest trained length (`x`, half a token past it).
pub(super) fn trained_line(x: f64) -> Series {
    let stroke = Color::BLACK.mix(0.5).stroke(1).dashed(6, 5);
    let points = vec![(x, 0.0), (x, 102.0)];
    Mark::Line { points, stroke }.into()
}

/// One task's chart: `small` for a panel of the suite's page (its name for a caption, thin
/// lines, no bands or legend).
fn task_chart(results: &Results, task: &TaskInfo, small: bool) -> Chart {
    let x_max = task.tests.iter().map(|t| t.lengths[1]).max().unwrap_or(1) as f64;
    let mut series = Vec::new();
    if let Some(above) = task.score_above {
        series.push(trained_line(above as f64 + 0.5));
    }
    let width = if small { 1 } else { 2 };
    let curves = length_curves(results, task, LENGTHS);
    for (name, colour, dashed) in styles(results, &task.name) {
        let Some(curve) = curves.iter().find(|c| c.variant == name) else {
            continue;
        };
        let color = Color::palette(colour);
        if !small {
            let points = curve.band();
            series.push(Mark::Band { points, color }.into());
        }
        let points: Vec<(f64, f64)> = curve.points.iter().map(|p| (p.x, p.mean)).collect();
        let stroke = match dashed {
            true => color.stroke(width).dashed(7, 4),
            false => color.stroke(width),
        };
        let line = Mark::Line { points, stroke };
        series.push(match small {
            true => line.into(),
            false => {
                // A dashed line's sample is its first dash.
                let length = if dashed { 8 } else { 22 };
                let stroke = color.stroke(3);
                line.keyed(name, Key::Line { length, stroke })
            }
        });
    }
    let axes = (
        Axis::linear(0.0, x_max * 1.02).ticks(Ticks::Whole),
        Axis::linear(0.0, 102.0).ticks(Ticks::Whole),
    );
    match small {
        true => Chart {
            caption: (task.name.clone(), 18),
            margin: 6,
            label_areas: (22, 30),
            x: axes.0.count(5),
            y: axes.1.count(5),
            grid: Grid::Full,
            axis_font: None,
            label_font: 11,
            series,
            legend: None,
        },
        false => Chart {
            caption: (
                format!(
                    "{}: accuracy by input length (trained on {}-{})",
                    task.name, task.train_lengths[0], task.train_lengths[1]
                ),
                24,
            ),
            margin: 16,
            label_areas: (50, 60),
            x: axes.0.count(10).titled("input length"),
            y: axes.1.count(11).titled("accuracy at the outputs (%)"),
            grid: Grid::Full,
            axis_font: Some(18),
            label_font: 14,
            series,
            legend: Some(Legend::at(Some(Corner::UpperRight), 14)),
        },
    }
}

/// `length_<task>.png`: one task, with a legend.
pub fn task_plot(path: &Path, task: &TaskInfo, results: &Results) -> Result<()> {
    let chart = task_chart(results, task, false);
    draw(path, Picture::chart((960, 600), chart))
}

/// `length_suite.png`: every length-suite task of `results` in a grid, a shared legend below.
pub fn suite_plot(path: &Path, results: &Results) -> Result<()> {
    let tasks: Vec<&TaskInfo> = results
        .tasks
        .iter()
        .filter(|t| t.score_above.is_some() && results.cells.iter().any(|c| c.task == t.name))
        .collect();
    if tasks.is_empty() {
        return Ok(());
    }
    let cols = tasks.len().clamp(1, 4);
    let rows = tasks.len().div_ceil(cols);
    let (panel_w, panel_h, legend_h) = (330u32, 240u32, 90u32);
    // The legend: every variant of the first task.
    let keys = styles(results, &tasks[0].name)
        .into_iter()
        .map(|(name, colour, dashed)| {
            let stroke = Color::palette(colour).stroke(3);
            let stroke = if dashed { stroke.dashed(7, 4) } else { stroke };
            (name, Key::Line { length: 28, stroke })
        });
    let page = Page {
        top: 40,
        title: None,
        rows,
        cols,
        panels: tasks.iter().map(|t| task_chart(results, t, true)).collect(),
        below: legend_h,
        keys: keys.collect(),
    };
    let title = Note {
        text: "accuracy at the outputs (%) by input length; dashed vertical: the longest trained"
            .into(),
        at: (12, 10),
        font: 18,
        color: Color::BLACK,
    };
    let picture = Picture {
        size: (panel_w * cols as u32, panel_h * rows as u32 + legend_h + 40),
        layout: Layout::Page(page),
        notes: vec![title],
    };
    draw(path, picture)
}
