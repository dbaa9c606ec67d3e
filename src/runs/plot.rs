//! PNG plots of a comparison: training loss per variant, score against input length (where the
//! test examples' lengths vary), each a mean over seeds with the band from the lowest seed to
//! the highest ([`super::curves`]).

use std::path::Path;

use plotters::prelude::*;

use super::curves::{self, Curve, LENGTHS};
use super::results::{Outcome, Results, TaskInfo};
use crate::error::Result;
use crate::render::plot::{palette, render_png, FONT};

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
    render_png(path, (960, 600), |area| {
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!(
                    "{}: training loss (mean over seeds; band: lowest to highest seed)",
                    task.name
                ),
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
        for (i, curve) in curves.iter().enumerate() {
            let color = palette(i);
            let floor = |v: f64| v.max(lo);
            chart.draw_series(band(curve, color, floor))?;
            chart
                .draw_series(LineSeries::new(
                    curve.points.iter().map(|p| (p.x, floor(p.mean))),
                    color.stroke_width(2),
                ))?
                .label(curve.variant.as_str())
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

/// A curve's band, from its lowest seed to its highest (`clip` bounds a value to the chart).
fn band(curve: &Curve, color: RGBColor, clip: impl Fn(f64) -> f64) -> Option<Polygon<(f64, f64)>> {
    let points: Vec<(f64, f64, f64)> = curve
        .band()
        .into_iter()
        .map(|(x, low, high)| (x, clip(low), clip(high)))
        .collect();
    crate::render::plot::band(&points, color)
}

fn score_by_length(
    path: &Path,
    task: &TaskInfo,
    results: &Results,
    curves: Vec<Curve>,
) -> Result<()> {
    // Each variant (`curves`): its accuracy at every tested length, pooled over the test sets,
    // mean over seeds with the seeds' band; the shuffle and shift tests as markers at the middle
    // of the lengths they run at, with whiskers from the lowest seed to the highest.
    let x_max = task.tests.iter().map(|t| t.lengths[1]).max().unwrap_or(1) as f64 * 1.04;
    let base_x = task
        .base_test()
        .map_or(0.0, |t| (t.lengths[0] + t.lengths[1]) as f64 / 2.0);
    let order_tests: Vec<String> = curves::evaluations(task).into_iter().skip(1).collect();
    // The shuffle test (first, where it runs) is marked by a triangle, the shift test a cross.
    let triangle = |k: usize| k == 0 && task.shuffle_test;
    // (variant index, test index, min, mean, max)
    let markers: Vec<(usize, usize, f64, f64, f64)> = results
        .variants
        .iter()
        .enumerate()
        .flat_map(|(i, v)| {
            let row = results
                .summary
                .iter()
                .find(|r| r.task == task.name && r.variant == v.name);
            order_tests.iter().enumerate().filter_map(move |(k, name)| {
                let s = row?.columns.iter().find(|c| &c.name == name)?.accuracy?;
                Some((i, k, 100.0 * s.min, 100.0 * s.mean, 100.0 * s.max))
            })
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
            .x_desc("input length (every test set; band: lowest to highest seed)")
            .y_desc(format!("{} (%)", task.metric))
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .axis_desc_style((FONT, 18))
            .label_style((FONT, 14))
            .draw()?;
        let trained = task.train_lengths[1] as f64 + 0.5;
        chart.draw_series(DashedLineSeries::new(
            vec![(trained, 0.0), (trained, 102.0)],
            6,
            5,
            BLACK.mix(0.5).stroke_width(1),
        ))?;
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
        let index = |name: &str| results.variants.iter().position(|v| v.name == name);
        for curve in &curves {
            let color = palette(index(&curve.variant).unwrap_or(0));
            chart.draw_series(band(curve, color, |v| v))?;
            chart
                .draw_series(LineSeries::new(
                    curve.points.iter().map(|p| (p.x, p.mean)),
                    color.stroke_width(2),
                ))?
                .label(curve.variant.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
                });
        }
        // A curve over fewer lengths than the others (a learned table that cannot read the
        // longer tests) is drawn again on top, its points marked, so that it does not hide
        // under curves that run along it.
        let longest = curves.iter().map(|c| c.points.len()).max().unwrap_or(0);
        for curve in curves.iter().filter(|c| c.points.len() < longest) {
            let color = palette(index(&curve.variant).unwrap_or(0));
            chart.draw_series(LineSeries::new(
                curve.points.iter().map(|p| (p.x, p.mean)),
                color.stroke_width(2),
            ))?;
            chart.draw_series(
                curve
                    .points
                    .iter()
                    .map(|p| Circle::new((p.x, p.mean), 3, color.filled())),
            )?;
        }
        // Markers, spread sideways a little so whiskers do not hide each other.
        let n = results.variants.len().max(1) as f64;
        for &(i, k, lo, mean, hi) in &markers {
            let color = palette(i);
            let x = base_x + (i as f64 - (n - 1.0) / 2.0) * x_max * 0.008;
            chart.draw_series([ErrorBar::new_vertical(
                x,
                lo,
                mean,
                hi,
                color.stroke_width(2),
                8,
            )])?;
            if triangle(k) {
                chart.draw_series([TriangleMarker::new((x, mean), 6, color.filled())])?;
            } else {
                chart.draw_series([Cross::new((x, mean), 5, color.stroke_width(2))])?;
            }
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .label_font((FONT, 15))
            .position(SeriesLabelPosition::LowerLeft)
            .draw()?;
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
        if !unavailable.is_empty() {
            foot.push_str(&format!(
                "; not runnable (learned table too short): {}",
                unavailable.join(", ")
            ));
        }
        area.draw(&Text::new(
            foot,
            (90, 582),
            (FONT, 13).into_font().color(&BLACK.mix(0.7)),
        ))?;
        Ok(())
    })
}
