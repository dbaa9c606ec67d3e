//! Drawing: a [`Picture`] (see [`super::chart`]) rendered to a PNG with plotters, and
//! [`line_chart`], the picture most of an analysis's curves use. This is the one file that
//! calls the drawing library.
//!
//! Text is drawn with DejaVu Sans embedded in the binary, so labels render on machines without
//! system fonts.

use std::path::Path;
use std::sync::Once;

use plotters::coord::ranged1d::ValueFormatter;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::Color as _;

use super::chart::{
    Axis, Chart, Color, Corner, Grid, Key, Layout, Legend, Mark, Note, Page, Picture, Scale,
    Series, Stroke, Ticks,
};
use crate::error::{Error, Result};

/// The family name the embedded DejaVu Sans is registered under for every plot.
const FONT: &str = "sans-serif";

/// A font size as drawn: `size` rounded up to an even number of pixels. plotters places each
/// glyph at half the size plus the glyph's top, truncated toward zero; at an odd size that
/// half pixel moves glyphs that reach above the middle (digits) down and those below it (a
/// decimal point, a comma) up, so `6.3` reads as `6·3`. At an even size every glyph sits on
/// the baseline.
fn px(size: u32) -> f64 {
    f64::from(size + size % 2)
}

static REGISTER: Once = Once::new();

/// Makes the embedded DejaVu Sans the `sans-serif` of every plot.
fn register_fonts() {
    REGISTER.call_once(|| {
        let regular =
            plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular());
        let bold = plotters::style::register_font(FONT, FontStyle::Bold, dejavu::sans::bold());
        assert!(
            regular.is_ok() && bold.is_ok(),
            "the embedded DejaVu fonts are valid TrueType"
        );
    });
}

/// What a drawing closure returns: plotters' errors boxed.
type DrawResult = std::result::Result<(), Box<dyn std::error::Error>>;

/// Renders a `width x height` PNG at `path`: drawn into memory, encoded as an 8-bit RGB PNG
/// (the `png` crate; plotters' own encoder would bring the whole `image` crate into the build)
/// and written atomically.
fn render_png(
    path: &Path,
    (width, height): (u32, u32),
    draw: impl FnOnce(&DrawingArea<BitMapBackend, Shift>) -> DrawResult,
) -> Result<()> {
    register_fonts();
    let fail = |message: String| Error::Plot {
        path: path.into(),
        message,
    };
    let mut rgb = vec![0u8; width as usize * height as usize * 3];
    {
        let area = BitMapBackend::with_buffer(&mut rgb, (width, height)).into_drawing_area();
        area.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
        draw(&area).map_err(|e| fail(e.to_string()))?;
        area.present().map_err(|e| fail(e.to_string()))?;
    }
    let mut bytes = Vec::new();
    let mut encoder = png::Encoder::new(&mut bytes, width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder
        .write_header()
        .and_then(|mut writer| writer.write_image_data(&rgb))
        .map_err(|e| fail(e.to_string()))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        crate::io::create_folder(dir)?;
    }
    crate::io::write_atomic(path, &bytes)
}

/// Draws `picture` as a PNG at `path`. A chart whose axes cannot be drawn (an end not finite,
/// the low not below the high, a log axis not above 0: what numbers that are not finite give)
/// is an error naming it; points that are not finite inside a chart are left out.
pub fn draw(path: &Path, mut picture: Picture) -> Result<()> {
    for chart in charts(&mut picture.layout) {
        for (name, axis) in [("x", &chart.x), ("y", &chart.y)] {
            let (low, high) = axis.range;
            let log = axis.scale == Scale::Log;
            if !(low.is_finite() && high.is_finite() && low < high && (!log || low > 0.0)) {
                return Err(Error::Plot {
                    path: path.into(),
                    message: format!(
                        "the {name} axis of \"{}\" would run from {low} to {high}: an axis needs \
                         finite ends, the low below the high{} (the numbers to draw are not \
                         finite, or there are none)",
                        chart.caption.0,
                        if log { ", above 0 on a log scale" } else { "" }
                    ),
                });
            }
        }
        chart.series = finite(std::mem::take(&mut chart.series));
    }
    render_png(path, picture.size, |area| {
        match &picture.layout {
            Layout::Chart(chart) => draw_chart(area, chart)?,
            Layout::Page(page) => draw_page(area, page)?,
        }
        for note in &picture.notes {
            let style = (FONT, px(note.font)).into_font().color(&rgba(note.color));
            area.draw(&Text::new(note.text.as_str(), note.at, style))?;
        }
        Ok(())
    })
}

/// The charts of a layout: the one, or a page's panels.
fn charts(layout: &mut Layout) -> &mut [Chart] {
    match layout {
        Layout::Chart(chart) => std::slice::from_mut(chart),
        Layout::Page(page) => &mut page.panels,
    }
}

/// A chart's series without the points that are not finite: a line is broken where one was,
/// and a band, dot, box or marker with one is left out.
fn finite(series: Vec<Series>) -> Vec<Series> {
    let ok = |p: &(f64, f64)| p.0.is_finite() && p.1.is_finite();
    let mut kept = Vec::with_capacity(series.len());
    for Series { mark, key } in series {
        let keyed = |mark: Mark| Series {
            mark,
            key: key.clone(),
        };
        match mark {
            Mark::Line { points, stroke } if !points.iter().all(ok) => {
                // Each finite run its own line; the legend entry on the first.
                let runs = points.split(|p| !ok(p)).filter(|r| !r.is_empty());
                for (i, run) in runs.enumerate() {
                    let mark = Mark::Line {
                        points: run.to_vec(),
                        stroke,
                    };
                    kept.push(match i {
                        0 => keyed(mark),
                        _ => mark.into(),
                    });
                }
            }
            Mark::Band { points, color } => {
                let points = points
                    .into_iter()
                    .filter(|p| p.0.is_finite() && p.1.is_finite() && p.2.is_finite())
                    .collect();
                kept.push(keyed(Mark::Band { points, color }));
            }
            Mark::Dots { dots, radius } => {
                let dots = dots.into_iter().filter(|d| ok(&d.0)).collect();
                kept.push(keyed(Mark::Dots { dots, radius }));
            }
            Mark::Boxes { boxes } => {
                let boxes = boxes.into_iter().filter(|b| b.0.iter().all(ok)).collect();
                kept.push(keyed(Mark::Boxes { boxes }));
            }
            Mark::ErrorBar {
                x, low, mean, high, ..
            } if ![x, low, mean, high].iter().all(|v| v.is_finite()) => {}
            Mark::Triangle { at, .. } | Mark::Cross { at, .. } if !ok(&at) => {}
            mark => kept.push(keyed(mark)),
        }
    }
    kept
}

/// A line chart of `series`, each line in the next palette colour (a log y axis with `log_y`),
/// as a 960 x 600 PNG at `path`.
pub fn line_chart(
    path: &Path,
    title: &str,
    axes: (&str, &str),
    series: &[Line],
    log_y: bool,
) -> Result<()> {
    let points = series.iter().flat_map(|s| s.1.iter());
    let x_max = points.clone().map(|p| p.0).fold(1.0, f64::max);
    let x_min = points.clone().map(|p| p.0).fold(0.0, f64::min);
    let (lo, hi) = points
        .map(|p| p.1)
        .filter(|v| v.is_finite() && (!log_y || *v > 0.0))
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
    let pad = ((hi - lo) * 0.05).max(1e-9);
    let y = match log_y {
        true => Axis::log(lo * 0.8, hi * 1.25),
        false => Axis::linear(lo - pad, hi + pad),
    };
    let lines = series
        .iter()
        .enumerate()
        .map(|(i, (name, points, dashed))| {
            let color = Color::palette(i);
            let stroke = match dashed {
                true => color.stroke(2).dashed(6, 4),
                false => color.stroke(2),
            };
            let key = Key::Line {
                length: 20,
                stroke: color.stroke(3),
            };
            let points = points.clone();
            Mark::Line { points, stroke }.keyed(name.as_str(), key)
        });
    let chart = Chart {
        caption: (title.to_string(), 22),
        margin: 16,
        label_areas: (50, 76),
        x: Axis::linear(x_min, x_max)
            .titled(axes.0)
            .ticks(Ticks::Hundredths),
        y: y.titled(axes.1).ticks(Ticks::Short),
        grid: Grid::Full,
        axis_font: Some(17),
        label_font: 13,
        series: lines.collect(),
        legend: Some(Legend::at(None, 14)),
    };
    draw(path, Picture::chart((960, 600), chart))
}

/// A heatmap's cell whose value is not finite.
const NOT_FINITE: Color = Color::rgb(160, 160, 160);

/// A heatmap of a row-major `rows x cols` matrix (rows up the y axis), diverging around 0 or
/// sequential from its least value to its greatest, as a 900 x 820 PNG at `path`, the colour
/// scale's ends written below. Row `r` sits at `offset.0 + r * step.0` on its axis, column `c`
/// at `offset.1 + c * step.1`.
pub fn heatmap(
    path: &Path,
    title: &str,
    (rows, cols, data): (usize, usize, &[f64]),
    divergent: bool,
    axes: (&str, &str),
    offset: (usize, usize),
    step: (usize, usize),
) -> Result<()> {
    // The scale spans the finite values; a value that is not finite is a grey cell, said so.
    let span = data
        .iter()
        .filter(|v| v.is_finite())
        .fold(None, |span, &v| {
            let (lo, hi) = span.unwrap_or((v, v));
            Some((f64::min(lo, v), f64::max(hi, v)))
        });
    let (lo, hi) = span.unwrap_or((0.0, 0.0));
    let unfinite = data.iter().filter(|v| !v.is_finite()).count();
    let bound = lo.abs().max(hi.abs()).max(1e-300);
    let color = |v: f64| match (v.is_finite(), divergent) {
        (false, _) => NOT_FINITE,
        (true, true) => Color::diverging(v / bound),
        (true, false) => Color::sequential((v - lo) / (hi - lo).max(1e-300)),
    };
    // Three decimals, without a "-0.000" for a rounding-level negative.
    let f = |v: f64| match v.abs() < 5e-4 {
        true => "0.000".to_string(),
        false => format!("{v:.3}"),
    };
    let mut scale = match divergent {
        true => format!("blue {} .. white 0 .. red {}", f(-bound), f(bound)),
        false => format!("dark {} .. yellow {}", f(lo), f(hi)),
    };
    if unfinite > 0 {
        scale.push_str(&format!(
            "; grey: {unfinite} values not finite (NaN or infinite)"
        ));
    }
    let at = |i: usize, axis: usize| match axis {
        0 => (offset.0 + i * step.0) as f64,
        _ => (offset.1 + i * step.1) as f64,
    };
    let (w, h) = (step.1 as f64, step.0 as f64);
    let boxes = (0..rows)
        .flat_map(|r| (0..cols).map(move |c| (r, c)))
        .map(|(r, c)| {
            let (x, y) = (at(c, 1), at(r, 0));
            ([(x, y), (x + w, y + h)], color(data[r * cols + c]))
        })
        .collect();
    let chart = Chart {
        caption: (title.to_string(), 22),
        margin: 14,
        label_areas: (56, 64),
        x: Axis::linear(at(0, 1), at(cols, 1))
            .titled(axes.0)
            .ticks(Ticks::Hundredths),
        y: Axis::linear(at(0, 0), at(rows, 0))
            .titled(axes.1)
            .ticks(Ticks::Whole),
        grid: Grid::Off,
        axis_font: Some(17),
        label_font: 13,
        series: vec![Mark::Boxes { boxes }.into()],
        legend: None,
    };
    let picture = Picture::chart((900, 820), chart).with(Note::faint(scale, (80, 800), 14, 0.75));
    draw(path, picture)
}

/// One line of a [`line_chart`]: name, points, dashed.
pub type Line = (String, Vec<(f64, f64)>, bool);

fn rgba(c: Color) -> RGBAColor {
    RGBAColor(c.rgb.0, c.rgb.1, c.rgb.2, c.alpha)
}

fn line_style(s: &Stroke) -> ShapeStyle {
    ShapeStyle {
        color: rgba(s.color),
        filled: false,
        stroke_width: s.width,
    }
}

fn fill_style(c: Color) -> ShapeStyle {
    ShapeStyle {
        color: rgba(c),
        filled: true,
        stroke_width: 1,
    }
}

/// A chart filling `area`: its frame, then its series in order, then its legend.
fn draw_chart(area: &DrawingArea<BitMapBackend, Shift>, chart: &Chart) -> DrawResult {
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(&chart.caption.0, (FONT, px(chart.caption.1)))
        .margin(chart.margin)
        .x_label_area_size(chart.label_areas.0)
        .y_label_area_size(chart.label_areas.1);
    let ((x0, x1), (y0, y1)) = (chart.x.range, chart.y.range);
    match (chart.x.scale, chart.y.scale) {
        (Scale::Linear, Scale::Linear) => {
            on_axes(&mut builder.build_cartesian_2d(x0..x1, y0..y1)?, chart)
        }
        (Scale::Linear, Scale::Log) => on_axes(
            &mut builder.build_cartesian_2d(x0..x1, (y0..y1).log_scale())?,
            chart,
        ),
        (Scale::Log, Scale::Linear) => on_axes(
            &mut builder.build_cartesian_2d((x0..x1).log_scale(), y0..y1)?,
            chart,
        ),
        (Scale::Log, Scale::Log) => on_axes(
            &mut builder.build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())?,
            chart,
        ),
    }
}

/// The mesh, the series and the legend of `chart`, on axes of any scale.
fn on_axes<'a, X, Y>(
    ctx: &mut ChartContext<'a, BitMapBackend<'a>, Cartesian2d<X, Y>>,
    chart: &Chart,
) -> DrawResult
where
    X: Ranged<ValueType = f64> + ValueFormatter<f64>,
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    let label = |axis: &Axis, v: &f64| {
        axis.ticks
            .as_ref()
            .map_or_else(String::new, |t| t.label(*v))
    };
    let (x_ticks, y_ticks) = (|v: &f64| label(&chart.x, v), |v: &f64| label(&chart.y, v));
    let mut mesh = ctx.configure_mesh();
    match chart.grid {
        Grid::Full => &mut mesh,
        Grid::Horizontal => mesh.disable_x_mesh(),
        Grid::Off => mesh.disable_mesh(),
    };
    mesh.label_style((FONT, px(chart.label_font)));
    if let Some(title) = &chart.x.title {
        mesh.x_desc(title.as_str());
    }
    if let Some(title) = &chart.y.title {
        mesh.y_desc(title.as_str());
    }
    if let Some(size) = chart.axis_font {
        mesh.axis_desc_style((FONT, px(size)));
    }
    if chart.x.ticks.is_some() {
        mesh.x_label_formatter(&x_ticks);
    }
    if chart.y.ticks.is_some() {
        mesh.y_label_formatter(&y_ticks);
    }
    if let Some(n) = chart.x.count {
        mesh.x_labels(n);
    }
    if let Some(n) = chart.y.count {
        mesh.y_labels(n);
    }
    mesh.draw()?;
    for series in &chart.series {
        draw_series(ctx, series)?;
    }
    if let Some(legend) = &chart.legend {
        let mut labels = ctx.configure_series_labels();
        labels
            .background_style(WHITE.mix(legend.background))
            .border_style(BLACK.mix(0.4))
            .label_font((FONT, px(legend.font)));
        match legend.corner {
            Some(Corner::UpperRight) => labels.position(SeriesLabelPosition::UpperRight),
            Some(Corner::LowerLeft) => labels.position(SeriesLabelPosition::LowerLeft),
            None => &mut labels,
        };
        labels.draw()?;
    }
    Ok(())
}

/// One series on `ctx`, with its legend entry.
fn draw_series<'a, X, Y>(
    ctx: &mut ChartContext<'a, BitMapBackend<'a>, Cartesian2d<X, Y>>,
    series: &Series,
) -> DrawResult
where
    X: Ranged<ValueType = f64> + ValueFormatter<f64>,
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    let drawn = match &series.mark {
        Mark::Band { points, color } => ctx.draw_series(band(points, *color))?,
        Mark::Line { points, stroke } => match stroke.dash {
            None => ctx.draw_series(LineSeries::new(points.clone(), line_style(stroke)))?,
            Some(dash) => ctx.draw_series(DashedLineSeries::new(
                points.clone(),
                dash.size,
                dash.gap,
                line_style(stroke),
            ))?,
        },
        Mark::Dots { dots, radius } => ctx.draw_series(
            dots.iter()
                .map(|(at, color)| Circle::new(*at, *radius, fill_style(*color))),
        )?,
        Mark::Boxes { boxes } => ctx.draw_series(
            boxes
                .iter()
                .map(|(corners, color)| Rectangle::new(*corners, fill_style(*color))),
        )?,
        &Mark::ErrorBar {
            x,
            low,
            mean,
            high,
            ref stroke,
            whisker,
        } => ctx.draw_series([ErrorBar::new_vertical(
            x,
            low,
            mean,
            high,
            line_style(stroke),
            whisker,
        )])?,
        &Mark::Triangle { at, size, color } => {
            ctx.draw_series([TriangleMarker::new(at, size, fill_style(color))])?
        }
        &Mark::Cross {
            at,
            size,
            ref stroke,
        } => ctx.draw_series([Cross::new(at, size, line_style(stroke))])?,
    };
    if let Some((name, key)) = &series.key {
        let drawn = drawn.label(name.as_str());
        match *key {
            Key::Line { length, stroke } => drawn.legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + length, y)], line_style(&stroke))
            }),
            Key::Box { color } => drawn.legend(move |(x, y)| {
                Rectangle::new([(x, y - 5), (x + 14, y + 5)], fill_style(color))
            }),
        };
    }
    Ok(())
}

/// A band between two curves, lightly filled; `None` where there is nothing to fill.
fn band(points: &[(f64, f64, f64)], color: Color) -> Option<Polygon<(f64, f64)>> {
    (points.len() > 1 && points.iter().any(|p| p.2 > p.1)).then(|| {
        let upper = points.iter().map(|p| (p.0, p.2));
        let lower = points.iter().rev().map(|p| (p.0, p.1));
        Polygon::new(
            upper.chain(lower).collect::<Vec<_>>(),
            fill_style(color.mix(0.15)),
        )
    })
}

/// A page: the title strip, the panels row by row, then the shared legend below them.
fn draw_page(area: &DrawingArea<BitMapBackend, Shift>, page: &Page) -> DrawResult {
    let (top, rest) = area.split_vertically(page.top);
    if let Some((title, size)) = &page.title {
        top.titled(title, (FONT, px(*size)))?;
    }
    let (grid, below) = rest.split_vertically(rest.dim_in_pixel().1.saturating_sub(page.below));
    for (chart, panel) in page
        .panels
        .iter()
        .zip(&grid.split_evenly((page.rows, page.cols)))
    {
        draw_chart(panel, chart)?;
    }
    // Four keys a row, 300 pixels apart, or closer on a narrow page.
    let step = (below.dim_in_pixel().0.saturating_sub(40) / 4).min(300) as i32;
    for (i, (name, key)) in page.keys.iter().enumerate() {
        let (x, y) = (20 + (i % 4) as i32 * step, 12 + (i / 4) as i32 * 24);
        match key {
            Key::Line { length, stroke } => {
                let style = line_style(&Stroke {
                    dash: None,
                    ..*stroke
                });
                let spans: &[(i32, i32)] = match stroke.dash {
                    Some(_) => &[(0, 10), (16, *length)],
                    None => &[(0, *length)],
                };
                for &(a, b) in spans {
                    below.draw(&PathElement::new(
                        vec![(x + a, y + 8), (x + b, y + 8)],
                        style,
                    ))?;
                }
            }
            Key::Box { color } => {
                below.draw(&Rectangle::new(
                    [(x + 4, y + 2), (x + 24, y + 15)],
                    fill_style(*color),
                ))?;
            }
        }
        below.draw(&Text::new(
            name.as_str(),
            (x + 36, y),
            (FONT, px(15)).into_font(),
        ))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The PNG at `path` as `(width, rgb bytes)`.
    fn pixels(path: &Path) -> (usize, Vec<u8>) {
        let decoder = png::Decoder::new(std::fs::File::open(path).unwrap());
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!(info.color_type, png::ColorType::Rgb);
        (info.width as usize, buf)
    }

    fn at((width, rgb): &(usize, Vec<u8>), x: usize, y: usize) -> (u8, u8, u8) {
        let i = 3 * (y * width + x);
        (rgb[i], rgb[i + 1], rgb[i + 2])
    }

    /// A chart with no room around its axes, over `0..10` both ways.
    fn bare(series: Vec<Series>) -> Chart {
        Chart {
            caption: (String::new(), 1),
            margin: 0,
            label_areas: (0, 0),
            x: Axis::linear(0.0, 10.0),
            y: Axis::linear(0.0, 10.0),
            grid: Grid::Off,
            axis_font: None,
            label_font: 10,
            series,
            legend: None,
        }
    }

    fn fill(x: (f64, f64), color: Color) -> Series {
        let boxes = vec![([(x.0, 0.0), (x.1, 10.0)], color)];
        Mark::Boxes { boxes }.into()
    }

    /// At an odd size too, a decimal point sits on the digits' baseline (`6.3`, not `6·3`).
    #[test]
    fn a_decimal_point_sits_on_the_baseline_at_any_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("text.png");
        for size in [13, 15, 16, 17] {
            let picture = Picture::chart((120, 60), bare(Vec::new()))
                .with(Note::faint("0", (10, 10), size, 1.0))
                .with(Note::faint(".", (60, 10), size, 1.0));
            draw(&path, picture).unwrap();
            let png = pixels(&path);
            // The lowest row with ink between columns `x0..x1`.
            let lowest = |x0: usize, x1: usize| {
                (0..60)
                    .rev()
                    .find(|&y| (x0..x1).any(|x| at(&png, x, y).0 < 128))
                    .unwrap()
            };
            assert_eq!(lowest(10, 40), lowest(60, 90), "size {size}");
        }
    }

    #[test]
    fn a_chart_draws_its_marks_where_their_values_fall_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("chart.png");
        let (red, blue) = (Color::rgb(200, 0, 0), Color::rgb(0, 0, 200));
        let band = Mark::Band {
            points: vec![(0.0, 2.0, 8.0), (10.0, 2.0, 8.0)],
            color: blue,
        };
        // The red box under the band's right half, the blue box over it.
        let series = vec![fill((0.0, 5.0), red), band.into(), fill((7.5, 10.0), blue)];
        draw(&path, Picture::chart((200, 100), bare(series))).unwrap();
        let png = pixels(&path);
        assert_eq!(png.1.len(), 200 * 100 * 3);
        // Left: red under a 15% blue tint; middle: the tint on white; right: blue on top.
        let tint = |c: u8, over: u8| f64::from(over) + (f64::from(c) - f64::from(over)) * 0.15;
        let near = |got: (u8, u8, u8), want: (f64, f64, f64)| {
            let d = [(got.0, want.0), (got.1, want.1), (got.2, want.2)];
            d.iter().all(|(g, w)| (f64::from(*g) - w).abs() <= 1.5)
        };
        let left = at(&png, 40, 55);
        assert!(near(left, (tint(0, 200), 0.0, tint(200, 0))), "{left:?}");
        let middle = at(&png, 125, 55);
        assert!(
            near(middle, (tint(0, 255), tint(0, 255), tint(200, 255))),
            "{middle:?}"
        );
        assert_eq!(at(&png, 180, 55), (0, 0, 200));
        // Outside the band's 2..8: the boxes alone, or white.
        assert_eq!(at(&png, 40, 95), (200, 0, 0));
        assert_eq!(at(&png, 125, 95), (255, 255, 255));
    }

    #[test]
    fn numbers_that_are_not_finite_are_refused_as_an_axis_and_left_out_as_points() {
        // All NaN once hung plotters (an axis from inf to -inf); now an error naming the axis.
        let dir = tempfile::tempdir().unwrap();
        let nan = f64::NAN;
        for log in [false, true] {
            let lines = [("a".to_string(), vec![(0.0, nan), (1.0, nan)], false)];
            let err = line_chart(&dir.path().join("nan.png"), "t", ("x", "y"), &lines, log);
            let message = err.unwrap_err().to_string();
            assert!(
                message.contains("the y axis of \"t\" would run from inf to -inf"),
                "{message}"
            );
            // A NaN or an infinity among finite points: the line broken there, drawn.
            let lines = [(
                "a".to_string(),
                vec![
                    (0.0, 1.0),
                    (1.0, nan),
                    (2.0, 3.0),
                    (3.0, f64::INFINITY),
                    (4.0, 2.0),
                ],
                false,
            )];
            let path = dir.path().join(format!("broken{log}.png"));
            line_chart(&path, "t", ("x", "y"), &lines, log).unwrap();
            assert_eq!(pixels(&path).1.len(), 960 * 600 * 3);
        }
        // A heatmap draws a cell that is not finite grey, and its note counts them.
        let path = dir.path().join("heat.png");
        heatmap(
            &path,
            "h",
            (2, 2, &[1.0, nan, 3.0, 4.0]),
            true,
            ("a", "b"),
            (0, 0),
            (1, 1),
        )
        .unwrap();
        // Row 0 is at the bottom: its second cell, the NaN, is the lower right quadrant.
        assert_eq!(at(&pixels(&path), 684, 600), NOT_FINITE.rgb);
        assert_ne!(at(&pixels(&path), 280, 600), NOT_FINITE.rgb);
    }

    #[test]
    fn a_page_fills_its_panels_row_by_row_and_keys_a_dashed_line_broken_and_a_box() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("page.png");
        let colors = [
            Color::rgb(200, 0, 0),
            Color::rgb(0, 150, 0),
            Color::rgb(0, 0, 200),
        ];
        let panels = colors.iter().map(|&c| bare(vec![fill((0.0, 10.0), c)]));
        let dashed = Color::rgb(250, 120, 0).stroke(3).dashed(7, 4);
        let page = Page {
            top: 20,
            title: None,
            rows: 2,
            cols: 2,
            panels: panels.collect(),
            below: 40,
            keys: vec![
                (
                    "dashed".into(),
                    Key::Line {
                        length: 28,
                        stroke: dashed,
                    },
                ),
                ("box".into(), Key::Box { color: colors[2] }),
            ],
        };
        let picture = Picture {
            size: (200, 260),
            layout: Layout::Page(page),
            notes: Vec::new(),
        };
        draw(&path, picture).unwrap();
        let png = pixels(&path);
        // Panels of 100 x 100 from y = 20; the fourth is empty.
        assert_eq!(at(&png, 50, 75), (200, 0, 0));
        assert_eq!(at(&png, 150, 75), (0, 150, 0));
        assert_eq!(at(&png, 50, 175), (0, 0, 200));
        assert_eq!(at(&png, 150, 175), (255, 255, 255));
        assert_eq!(at(&png, 100, 10), (255, 255, 255));
        // The key at (20, 12) in the strip below (y = 220): a dash, a gap, a dash.
        let y = 220 + 12 + 8;
        assert_eq!(at(&png, 25, y), (250, 120, 0));
        assert_eq!(at(&png, 33, y), (255, 255, 255));
        assert_eq!(at(&png, 42, y), (250, 120, 0));
        // The second key a quarter of the narrow page further (40 pixels): a filled box.
        assert_eq!(at(&png, 60 + 14, 220 + 12 + 8), (0, 0, 200));
    }
}
