//! The files of an analysis: CSVs of every number, PNGs of every picture.

use std::path::Path;

use super::linalg::Matrix;
use super::{distance_matrix, Analysis, Metric, Table};
use crate::error::Result;
use crate::io::write_atomic;
use crate::render::chart::{
    Axis, Chart, Color, Grid, Key, Layout, Mark, Page, Picture, Series, Ticks,
};
use crate::render::csv::{write_matrix_csv, write_rows};
use crate::render::png::{draw, heatmap, line_chart};

/// Each (x, y) pair of the table as points on the unit circle, coloured by position; a panel
/// per pair (eight pairs spread from the fastest to the slowest).
fn clock(path: &Path, table: &Table, analysis: &Analysis) -> Result<()> {
    let pairs = table.pairs.as_ref().expect("clock plots need pairs");
    let half = table.dim / 2;
    let chosen: Vec<usize> = if half <= 8 {
        (0..half).collect()
    } else {
        (0..8).map(|i| i * (half - 1) / 7).collect()
    };
    let wavelengths = &analysis.wavelengths[0].wavelength;
    let circle = (0..=100)
        .map(|s| (s as f64 * std::f64::consts::TAU / 100.0).sin_cos())
        .collect();
    let panel = |i: usize| {
        let (a, b) = crate::positional::sinusoidal::pair_slots(pairs.interleaved, i, table.dim);
        let dots = (0..table.rows)
            .map(|r| {
                let row = table.row(r);
                let color = Color::sequential(r as f64 / (table.rows.max(2) - 1) as f64);
                ((row[a], row[b]), color)
            })
            .collect();
        Chart {
            caption: (
                format!("pair {i}, wavelength {:.1} positions", wavelengths[i]),
                15,
            ),
            margin: 8,
            label_areas: (22, 30),
            x: Axis::linear(-1.15, 1.15).count(3),
            y: Axis::linear(-1.15, 1.15).count(3),
            grid: Grid::Off,
            axis_font: None,
            label_font: 10,
            series: vec![
                Mark::Line {
                    points: Vec::clone(&circle),
                    stroke: Color::BLACK.mix(0.2).stroke(1),
                }
                .into(),
                Mark::Dots { dots, radius: 3 }.into(),
            ],
            legend: None,
        }
    };
    let title = format!(
        "{}: each pair on the unit circle, colour = position (dark early, yellow late)",
        table.title
    );
    let page = Page {
        top: 50,
        title: Some((title, 20)),
        rows: 2,
        cols: 4,
        panels: chosen.into_iter().map(panel).collect(),
        below: 0,
        keys: Vec::new(),
    };
    let picture = Picture {
        size: (1200, 660),
        layout: Layout::Page(page),
        notes: Vec::new(),
    };
    draw(path, picture)
}

/// Writes the analysis: CSVs, PNGs and `summary.txt` / `summary.json`. Returns the file names.
pub fn write_all(analysis: &Analysis, table: &Table, dir: &Path) -> Result<Vec<String>> {
    crate::io::create_folder(dir)?;
    let mut files = Vec::new();
    write_table(table, dir, &mut files)?;
    write_distances(table, dir, &mut files)?;
    write_offsets(analysis, table, dir, &mut files)?;
    files.extend(write_geometry(analysis, dir)?);
    write_shift(analysis, dir, &mut files)?;
    if table.pairs.is_some() {
        write_wavelengths(analysis, table, dir, &mut files)?;
    }
    if let Some(d) = &analysis.rope_decay {
        write_rope_decay(d, dir, &mut files)?;
    }
    write_atomic(&dir.join("summary.txt"), analysis.summary().as_bytes())?;
    let json =
        serde_json::to_string_pretty(&analysis_json(analysis)).expect("analysis serializes") + "\n";
    write_atomic(&dir.join("summary.json"), json.as_bytes())?;
    files.extend(["summary.txt".to_string(), "summary.json".to_string()]);
    Ok(files)
}

/// Pictures and distance matrices of a long table read every `step`-th position: the step,
/// and the axis label that says so.
fn position_step(table: &Table) -> (usize, String) {
    let step = super::matrix_step(table.rows);
    let axis = match step {
        1 => "position".to_string(),
        s => format!("position (every {s} positions)"),
    };
    (step, axis)
}

/// The table as CSV and heatmap.
fn write_table(table: &Table, dir: &Path, files: &mut Vec<String>) -> Result<()> {
    let position = |r: usize| (table.start + r).to_string();
    let (step, position_axis) = position_step(table);
    write_matrix_csv(
        &dir.join("table.csv"),
        table.matrix().parts(),
        "position",
        position,
        |c| format!("d{c}"),
    )?;
    heatmap(
        &dir.join("table.png"),
        &format!("{} (positions x dimensions)", table.title),
        table.every(step).parts(),
        true,
        ("dimension", &position_axis),
        (table.start, 0),
        (step, 1),
    )?;
    files.extend(["table.csv".to_string(), "table.png".to_string()]);
    Ok(())
}

/// The distance matrices between positions, one per metric, as CSV and heatmap.
fn write_distances(table: &Table, dir: &Path, files: &mut Vec<String>) -> Result<()> {
    let (step, position_axis) = position_step(table);
    for metric in Metric::ALL {
        let m = distance_matrix(table, metric);
        let name = format!("distance_{}", metric.file());
        let at = |r: usize| table.start + r * step;
        write_matrix_csv(
            &dir.join(format!("{name}.csv")),
            m.parts(),
            "position",
            |r| at(r).to_string(),
            |c| format!("p{}", at(c)),
        )?;
        heatmap(
            &dir.join(format!("{name}.png")),
            &format!("{}: {} between positions", table.title, metric.name()),
            m.parts(),
            metric == Metric::Dot,
            (&position_axis, &position_axis),
            (table.start, table.start),
            (step, step),
        )?;
        files.push(format!("{name}.csv"));
        files.push(format!("{name}.png"));
    }
    Ok(())
}

/// Distance against offset, from the reference row and over all pairs, per metric.
fn write_offsets(
    analysis: &Analysis,
    table: &Table,
    dir: &Path,
    files: &mut Vec<String>,
) -> Result<()> {
    /// A row of `offsets.csv`.
    #[derive(serde::Serialize)]
    struct OffsetRow<'a> {
        metric: &'a str,
        offset: usize,
        from_reference: Option<f64>,
        mean_over_pairs: f64,
        min_over_pairs: f64,
        max_over_pairs: f64,
    }
    let mut rows = Vec::new();
    for curve in &analysis.offsets {
        for (k, s) in curve.over_pairs.iter().enumerate() {
            rows.push(OffsetRow {
                metric: curve.metric.file(),
                offset: k,
                from_reference: curve.from_reference.get(k).copied(),
                mean_over_pairs: s.mean,
                min_over_pairs: s.min,
                max_over_pairs: s.max,
            });
        }
        let pts = |f: &dyn Fn(usize) -> Option<f64>| -> Vec<(f64, f64)> {
            (0..curve.over_pairs.len())
                .filter_map(|k| f(k).map(|v| (k as f64, v)))
                .collect()
        };
        line_chart(
            &dir.join(format!("offset_{}.png", curve.metric.file())),
            &format!("{} against offset k", curve.metric.name()),
            ("offset k", curve.metric.name()),
            &[
                (
                    format!("from position {}", table.start + curve.reference),
                    pts(&|k| curve.from_reference.get(k).copied()),
                    false,
                ),
                (
                    "mean over all pairs (p, p + k)".into(),
                    pts(&|k| Some(curve.over_pairs[k].mean)),
                    false,
                ),
                (
                    "min over pairs".into(),
                    pts(&|k| Some(curve.over_pairs[k].min)),
                    true,
                ),
                (
                    "max over pairs".into(),
                    pts(&|k| Some(curve.over_pairs[k].max)),
                    true,
                ),
            ],
            false,
        )?;
        files.push(format!("offset_{}.png", curve.metric.file()));
    }
    write_rows(&dir.join("offsets.csv"), rows)?;
    files.push("offsets.csv".into());
    Ok(())
}

/// The relative-shift check per offset.
fn write_shift(analysis: &Analysis, dir: &Path, files: &mut Vec<String>) -> Result<()> {
    write_rows(&dir.join("relative_shift.csv"), &analysis.shift)?;
    files.push("relative_shift.csv".into());
    Ok(())
}

/// The clock plot and each pair's wavelength, for tables built from angles.
fn write_wavelengths(
    analysis: &Analysis,
    table: &Table,
    dir: &Path,
    files: &mut Vec<String>,
) -> Result<()> {
    clock(&dir.join("clock.png"), table, analysis)?;
    files.push("clock.png".into());
    /// A row of `wavelengths.csv`.
    #[derive(serde::Serialize)]
    struct PairRow {
        base: f64,
        pair: usize,
        wavelength: f64,
        first_wrap: usize,
    }
    let mut rows = Vec::new();
    let mut series = Vec::new();
    for w in &analysis.wavelengths {
        for (pair, (&wavelength, &first_wrap)) in w.wavelength.iter().zip(&w.first_wrap).enumerate()
        {
            rows.push(PairRow {
                base: w.base,
                pair,
                wavelength,
                first_wrap,
            });
        }
        series.push((
            format!("base {}", w.base),
            w.wavelength
                .iter()
                .enumerate()
                .map(|(i, l)| (i as f64, *l))
                .collect(),
            false,
        ));
    }
    let horizon = (table.start + table.rows) as f64;
    series.push((
        format!("positions analysed ({horizon})"),
        vec![(0.0, horizon), ((table.dim / 2 - 1).max(1) as f64, horizon)],
        true,
    ));
    write_rows(&dir.join("wavelengths.csv"), rows)?;
    line_chart(
        &dir.join("wavelengths.png"),
        "wavelength of each (sin, cos) pair: positions before its angle wraps",
        ("pair i", "wavelength 2 pi / w_i (positions, log scale)"),
        &series,
        true,
    )?;
    files.extend(["wavelengths.csv".to_string(), "wavelengths.png".to_string()]);
    Ok(())
}

/// RoPE's score against distance.
fn write_rope_decay(d: &super::RopeDecay, dir: &Path, files: &mut Vec<String>) -> Result<()> {
    /// A row of `rope_decay.csv`.
    #[derive(serde::Serialize)]
    struct DecayRow {
        distance: usize,
        ones: f64,
        random_abs: f64,
        roformer_bound: f64,
    }
    write_rows(
        &dir.join("rope_decay.csv"),
        (0..d.ones.len()).map(|k| DecayRow {
            distance: k,
            ones: d.ones[k],
            random_abs: d.random[k],
            roformer_bound: d.bound[k],
        }),
    )?;
    let pts = |v: &[f64]| {
        v.iter()
            .enumerate()
            .map(|(k, y)| (k as f64, *y))
            .collect::<Vec<_>>()
    };
    line_chart(
        &dir.join("rope_decay.png"),
        "RoPE: q·k against relative distance (divided by the head width)",
        ("relative distance", "score / head width"),
        &[
            (
                "q = k = all ones (= E[q·k] for q = k)".into(),
                pts(&d.ones),
                false,
            ),
            (
                "|q·k|, independent random q, k".into(),
                pts(&d.random),
                false,
            ),
            (
                "RoFormer bound, (1/(d/2)) sum_j |S_j|".into(),
                pts(&d.bound),
                true,
            ),
        ],
        false,
    )?;
    files.extend(["rope_decay.csv".to_string(), "rope_decay.png".to_string()]);
    Ok(())
}

/// The analysis without its long per-offset curves (those are in the CSVs).
fn analysis_json(a: &Analysis) -> serde_json::Value {
    serde_json::json!({
        "title": a.title,
        "start": a.start,
        "rows": a.rows,
        "dim": a.dim,
        "values": a.values,
        "consecutive_l2": a.consecutive_l2,
        "offsets": a.offsets.iter().map(|c| serde_json::json!({
            "metric": c.metric, "reference": c.reference,
            "monotone_until": c.monotone_until, "first_turn": c.first_turn,
        })).collect::<Vec<_>>(),
        "relative_shift": a.shift,
        "rotation_error": a.rotation_error(),
        "probe": a.probe,
        "order_probe": a.order,
        "principal_components": a.geometry,
        "wavelengths": a.wavelengths.iter().map(|w| serde_json::json!({
            "base": w.base,
            "shortest": w.wavelength.first(),
            "longest": w.wavelength.last(),
        })).collect::<Vec<_>>(),
    })
}

/// `attention_terms.csv` and `attention_terms.png`: each head's share of the four terms.
pub fn write_terms(
    terms: &[super::terms::HeadTerms],
    title: &str,
    dir: &Path,
) -> Result<Vec<String>> {
    use super::terms::TERMS;
    crate::io::create_folder(dir)?;
    /// A row of `attention_terms.csv`.
    #[derive(serde::Serialize)]
    struct TermRow<'a> {
        layer: usize,
        head: usize,
        term: &'a str,
        mean_abs: f64,
        share: f64,
        reconstruction_error: f64,
    }
    write_rows(
        &dir.join("attention_terms.csv"),
        terms.iter().flat_map(|t| {
            TERMS.iter().enumerate().map(move |(i, name)| TermRow {
                layer: t.layer,
                head: t.head,
                term: name,
                mean_abs: t.mean_abs[i],
                share: t.share[i],
                reconstruction_error: t.reconstruction_error,
            })
        }),
    )?;
    let n = terms.len() as f64;
    // Every head its label under its bar (at most 32: past that every other, or fewer); the
    // bars fill the height (shares sum to 100%), so the key sits below the chart.
    let labels: Vec<String> = terms
        .iter()
        .map(|t| format!("L{} H{}", t.layer, t.head))
        .collect();
    let bars = TERMS.iter().enumerate().map(|(i, _)| {
        let color = Color::palette(i);
        let boxes = terms.iter().enumerate().map(|(h, t)| {
            let below: f64 = t.share[..i].iter().sum::<f64>() * 100.0;
            let x = h as f64;
            let corners = [(x - 0.35, below), (x + 0.35, below + 100.0 * t.share[i])];
            (corners, color)
        });
        Mark::Boxes {
            boxes: boxes.collect(),
        }
        .into()
    });
    let chart = Chart {
        caption: (String::new(), 1),
        margin: 16,
        label_areas: (56, 64),
        x: Axis::linear(-0.5, n - 0.5)
            .titled("layer and head")
            .ticks(Ticks::Named(labels))
            .count(terms.len().min(32)),
        y: Axis::linear(0.0, 100.0)
            .titled("share of |attention logit| (%)")
            .ticks(Ticks::Whole),
        grid: Grid::Horizontal,
        axis_font: Some(17),
        label_font: 13,
        series: bars.collect(),
        legend: None,
    };
    let page = Page {
        top: 36,
        title: Some((title.to_string(), 20)),
        rows: 1,
        cols: 1,
        panels: vec![chart],
        below: 36,
        keys: TERMS
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let color = Color::palette(i);
                (name.to_string(), Key::Box { color })
            })
            .collect(),
    };
    draw(
        &dir.join("attention_terms.png"),
        Picture {
            size: (1000, 600),
            layout: Layout::Page(page),
            notes: Vec::new(),
        },
    )?;
    Ok(vec![
        "attention_terms.csv".into(),
        "attention_terms.png".into(),
    ])
}

/// `rows.csv` (each row's norm and principal coordinates), `norms.png` (norm by position) and
/// `pca.png` (the rows on the first two components, joined in position order).
fn write_geometry(analysis: &Analysis, dir: &Path) -> Result<Vec<String>> {
    let g = &analysis.geometry;
    // Position, norm, and the coordinates on each component.
    let rows = Matrix::new(
        g.norms.len(),
        1 + g.explained.len(),
        g.norms
            .iter()
            .zip(&g.projections)
            .flat_map(|(norm, p)| std::iter::once(*norm).chain(p.iter().copied()))
            .collect(),
    );
    write_matrix_csv(
        &dir.join("rows.csv"),
        rows.parts(),
        "position",
        |r| (analysis.start + r).to_string(),
        |c| match c {
            0 => "norm".to_string(),
            c => format!("pc{c}"),
        },
    )?;
    let mut files = vec!["rows.csv".to_string()];
    let norms: Vec<(f64, f64)> = g
        .norms
        .iter()
        .enumerate()
        .map(|(r, n)| ((analysis.start + r) as f64, *n))
        .collect();
    line_chart(
        &dir.join("norms.png"),
        &format!("{}: the length of each row", analysis.title),
        ("position", "L2 norm"),
        &[("|PE(p)|".into(), norms, false)],
        false,
    )?;
    files.push("norms.png".into());
    if g.explained.len() >= 2 {
        let title = format!(
            "{}: rows on components 1 and 2 ({:.1}% + {:.1}% of the variance)",
            analysis.title,
            100.0 * g.explained[0],
            100.0 * g.explained[1]
        );
        pca_path(&dir.join("pca.png"), &title, &g.projections)?;
        files.push("pca.png".into());
    }
    Ok(files)
}

/// The rows on the first two principal components, joined in position order and coloured from
/// the first position (dark) to the last (light), on equal axes.
fn pca_path(path: &Path, title: &str, projections: &[Vec<f64>]) -> Result<()> {
    let pts: Vec<(f64, f64)> = projections.iter().map(|p| (p[0], p[1])).collect();
    let reach = pts
        .iter()
        .map(|p| p.0.abs().max(p.1.abs()))
        .fold(1e-12, f64::max)
        * 1.08;
    let n = pts.len().max(2);
    let steps = pts.windows(2).enumerate().map(|(i, w)| {
        let color = Color::sequential(i as f64 / (n - 2).max(1) as f64);
        let (points, stroke) = (w.to_vec(), color.stroke(1));
        Series::from(Mark::Line { points, stroke })
    });
    let dots = pts
        .iter()
        .enumerate()
        .map(|(i, p)| (*p, Color::sequential(i as f64 / (n - 1) as f64)))
        .collect();
    let chart = Chart {
        caption: (title.to_string(), 18),
        margin: 16,
        label_areas: (50, 70),
        x: Axis::linear(-reach, reach)
            .titled("component 1")
            .ticks(Ticks::Short),
        y: Axis::linear(-reach, reach)
            .titled("component 2")
            .ticks(Ticks::Short),
        grid: Grid::Full,
        axis_font: Some(17),
        label_font: 13,
        series: steps
            .chain([Mark::Dots { dots, radius: 2 }.into()])
            .collect(),
        legend: None,
    };
    draw(path, Picture::chart((820, 820), chart))
}
