//! PNG plots of a comparison: training loss per variant, score against input length.

use std::path::Path;

use plotters::prelude::*;

use super::results::{Outcome, Results, TaskInfo};
use crate::error::Result;
use crate::plot::{palette, render_png, FONT};

/// Every plot of `results` into `dir`.
pub fn draw_all(dir: &Path, results: &Results) -> Result<()> {
    for task in &results.tasks {
        if results.cells.iter().any(|c| c.task == task.name) {
            loss_curves(&dir.join(format!("loss_{}.png", task.name)), task, results)?;
            let path = dir.join(format!("length_{}.png", task.name));
            if task.score_above.is_some() {
                super::suite_plot::task_plot(&path, task, results)?;
            } else {
                score_by_length(&path, task, results)?;
            }
        }
    }
    super::suite_plot::suite_plot(&dir.join("length_suite.png"), results)
}

/// Mean over seeds of each variant's training-loss curve.
fn mean_curves(task: &TaskInfo, results: &Results) -> Vec<(String, Vec<(f64, f64)>)> {
    results
        .variants
        .iter()
        .filter_map(|v| {
            let curves: Vec<&Vec<[f64; 2]>> = results
                .cells
                .iter()
                .filter(|c| c.task == task.name && c.variant == v.name)
                .map(|c| &c.summary.loss_curve)
                .collect();
            let n = curves.iter().map(|c| c.len()).min()?;
            let mean = (0..n)
                .map(|i| {
                    let step = curves[0][i][0];
                    let loss = curves.iter().map(|c| c[i][1]).sum::<f64>() / curves.len() as f64;
                    (step, loss)
                })
                .collect();
            Some((v.name.clone(), mean))
        })
        .collect()
}

fn loss_curves(path: &Path, task: &TaskInfo, results: &Results) -> Result<()> {
    let curves = mean_curves(task, results);
    let points = curves.iter().flat_map(|(_, c)| c.iter());
    let max_step = points.clone().map(|p| p.0).fold(1.0, f64::max);
    let (lo, hi) = points
        .map(|p| p.1)
        .filter(|l| l.is_finite() && *l > 0.0)
        .fold((f64::INFINITY, 0.0f64), |(lo, hi), l| {
            (lo.min(l), hi.max(l))
        });
    let (lo, hi) = if lo < hi {
        (lo * 0.8, hi * 1.25)
    } else {
        (1e-3, 10.0)
    };
    render_png(path, (960, 600), |area| {
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!("{}: training loss (mean over seeds)", task.name),
                (FONT, 26),
            )
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(72)
            .build_cartesian_2d(0.0..max_step, (lo..hi).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("cross-entropy loss (log scale)")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .axis_desc_style((FONT, 18))
            .label_style((FONT, 14))
            .draw()?;
        for (i, (name, curve)) in curves.iter().enumerate() {
            let color = palette(i);
            chart
                .draw_series(LineSeries::new(
                    curve.iter().copied(),
                    color.stroke_width(2),
                ))?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .label_font((FONT, 15))
            .position(SeriesLabelPosition::UpperRight)
            .draw()?;
        Ok(())
    })
}

fn score_by_length(path: &Path, task: &TaskInfo, results: &Results) -> Result<()> {
    // x: the middle of each test set's length range; y: score in %, mean with min..max whiskers.
    let xs: Vec<f64> = task
        .tests
        .iter()
        .map(|t| (t.lengths[0] + t.lengths[1]) as f64 / 2.0)
        .collect();
    let x_max = xs.iter().copied().fold(1.0, f64::max) * 1.08;
    // (variant, [(x, min, mean, max)])
    type Series = Vec<(String, Vec<(f64, f64, f64, f64)>)>;
    let series: Series = results
        .variants
        .iter()
        .map(|v| {
            let summary = results
                .summary
                .iter()
                .find(|r| r.task == task.name && r.variant == v.name);
            let points = task
                .tests
                .iter()
                .zip(&xs)
                .filter_map(|(t, &x)| {
                    let col = summary?.columns.iter().find(|c| c.name == t.name)?;
                    let s = col.accuracy?;
                    Some((x, 100.0 * s.min, 100.0 * s.mean, 100.0 * s.max))
                })
                .collect();
            (v.name.clone(), points)
        })
        .collect();
    let unavailable: Vec<String> = results
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
        .collect();
    render_png(path, (960, 600), |area| {
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!(
                    "{}: {} by input length (trained on {}-{})",
                    task.name, task.metric, task.train_lengths[0], task.train_lengths[1]
                ),
                (FONT, 24),
            )
            .margin(16)
            .x_label_area_size(70)
            .y_label_area_size(64)
            .build_cartesian_2d(0.0..x_max, 0.0..102.0)?;
        chart
            .configure_mesh()
            .x_desc("input length of the test set: the middle of its range (words)")
            .y_desc(format!("{} (%)", task.metric))
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .axis_desc_style((FONT, 18))
            .label_style((FONT, 14))
            .draw()?;
        if let Some(c) = &task.order_blind_ceiling {
            let y = 100.0 * c.accuracy;
            chart
                .draw_series(DashedLineSeries::new(
                    vec![(0.0, y), (x_max, y)],
                    8,
                    6,
                    BLACK.mix(0.6).stroke_width(2),
                ))?
                .label(format!("order-blind ceiling {y:.0}%"))
                .legend(|(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], BLACK.mix(0.6).stroke_width(2))
                });
        }
        let n = series.len().max(1) as f64;
        for (i, (name, points)) in series.iter().enumerate() {
            let color = palette(i);
            // Spread variants sideways a little so whiskers do not hide each other.
            let dx = (i as f64 - (n - 1.0) / 2.0) * x_max * 0.006;
            chart
                .draw_series(LineSeries::new(
                    points.iter().map(|p| (p.0 + dx, p.2)),
                    color.stroke_width(2),
                ))?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
                });
            chart.draw_series(points.iter().map(|p| {
                ErrorBar::new_vertical(p.0 + dx, p.1, p.2, p.3, color.stroke_width(2), 10)
            }))?;
            chart.draw_series(
                points
                    .iter()
                    .map(|p| Circle::new((p.0 + dx, p.2), 4, color.filled())),
            )?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .label_font((FONT, 15))
            .position(SeriesLabelPosition::LowerLeft)
            .draw()?;
        if !unavailable.is_empty() {
            area.draw(&Text::new(
                format!(
                    "not runnable (learned table too short): {}",
                    unavailable.join(", ")
                ),
                (90, 582),
                (FONT, 13).into_font().color(&BLACK.mix(0.7)),
            ))?;
        }
        Ok(())
    })
}
