//! Plots of the length suite: accuracy against input length, per task (`length_<task>.png`)
//! and for every task on one page (`length_suite.png`).
//!
//! Each variant is a line of the mean over seeds of the per-length accuracy, averaged over bins
//! of lengths so that a few examples per length still read as a curve (bins never straddle the
//! training maximum, drawn as a dashed vertical line; see [`super::curves`]), with the band
//! from the lowest seed to the highest on a task's own plot. A scheme keeps its colour; its
//! randomized-positions variant is the dashed line of the same colour.

use std::path::Path;

use plotters::prelude::*;

use super::curves::{length_curves, LENGTHS};
use super::results::{Results, TaskInfo};
use crate::error::Result;
use crate::render::plot::{palette, render_png, FONT};

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

type DrawResult = std::result::Result<(), Box<dyn std::error::Error>>;

/// One task's chart into `area`.
fn draw_task(
    area: &DrawingArea<BitMapBackend, plotters::coord::Shift>,
    results: &Results,
    task: &TaskInfo,
    small: bool,
) -> DrawResult {
    let x_max = task.tests.iter().map(|t| t.lengths[1]).max().unwrap_or(1) as f64;
    let (caption, label, margin) = if small { (18, 11, 6) } else { (24, 14, 16) };
    let mut chart = ChartBuilder::on(area)
        .caption(
            if small {
                task.name.clone()
            } else {
                format!(
                    "{}: accuracy by input length (trained on {}-{})",
                    task.name, task.train_lengths[0], task.train_lengths[1]
                )
            },
            (FONT, caption),
        )
        .margin(margin)
        .x_label_area_size(if small { 22 } else { 50 })
        .y_label_area_size(if small { 30 } else { 60 })
        .build_cartesian_2d(0.0..x_max * 1.02, 0.0..102.0)?;
    let mut mesh = chart.configure_mesh();
    mesh.x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .label_style((FONT, label))
        .x_labels(if small { 5 } else { 10 })
        .y_labels(if small { 5 } else { 11 });
    if !small {
        mesh.x_desc("input length")
            .y_desc("accuracy at the outputs (%)")
            .axis_desc_style((FONT, 18));
    }
    mesh.draw()?;
    if let Some(above) = task.score_above {
        let x = above as f64 + 0.5;
        chart.draw_series(DashedLineSeries::new(
            vec![(x, 0.0), (x, 102.0)],
            6,
            5,
            BLACK.mix(0.5).stroke_width(1),
        ))?;
    }
    let width = if small { 1 } else { 2 };
    let curves = length_curves(results, task, LENGTHS);
    for (name, colour, dashed) in styles(results, &task.name) {
        let Some(curve) = curves.iter().find(|c| c.variant == name) else {
            continue;
        };
        let color = palette(colour);
        if !small {
            chart.draw_series(crate::render::plot::band(&curve.band(), color))?;
        }
        let points: Vec<(f64, f64)> = curve.points.iter().map(|p| (p.x, p.mean)).collect();
        let style = color.stroke_width(width);
        let series = if dashed {
            chart.draw_series(DashedLineSeries::new(points, 7, 4, style))?
        } else {
            chart.draw_series(LineSeries::new(points, style))?
        };
        if !small {
            series.label(name.as_str()).legend(move |(x, y)| {
                let line = vec![(x, y), (x + 22, y)];
                if dashed {
                    PathElement::new(vec![(x, y), (x + 8, y)], color.stroke_width(3))
                } else {
                    PathElement::new(line, color.stroke_width(3))
                }
            });
        }
    }
    if !small {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .label_font((FONT, 14))
            .position(SeriesLabelPosition::UpperRight)
            .draw()?;
    }
    Ok(())
}

/// `length_<task>.png`: one task, with a legend.
pub fn task_plot(path: &Path, task: &TaskInfo, results: &Results) -> Result<()> {
    render_png(path, (960, 600), |area| {
        draw_task(area, results, task, false)
    })
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
    let size = (panel_w * cols as u32, panel_h * rows as u32 + legend_h + 40);
    render_png(path, size, |area| {
        let (title, rest) = area.split_vertically(40);
        title.draw(&Text::new(
            "accuracy at the outputs (%) by input length; dashed vertical: the longest trained",
            (12, 10),
            (FONT, 18).into_font(),
        ))?;
        let (grid, legend) = rest.split_vertically(panel_h * rows as u32);
        let panels = grid.split_evenly((rows, cols));
        for (task, panel) in tasks.iter().zip(&panels) {
            draw_task(panel, results, task, true)?;
        }
        // The legend: every variant of the first task, in rows of four.
        for (i, (name, colour, dashed)) in styles(results, &tasks[0].name).into_iter().enumerate() {
            let (x, y) = (20 + (i % 4) as i32 * 300, 12 + (i / 4) as i32 * 24);
            let color = palette(colour);
            let end = if dashed { x + 10 } else { x + 28 };
            legend.draw(&PathElement::new(
                vec![(x, y + 8), (end, y + 8)],
                color.stroke_width(3),
            ))?;
            if dashed {
                legend.draw(&PathElement::new(
                    vec![(x + 16, y + 8), (x + 28, y + 8)],
                    color.stroke_width(3),
                ))?;
            }
            legend.draw(&Text::new(name, (x + 36, y), (FONT, 15).into_font()))?;
        }
        Ok(())
    })
}
