//! The plotting pieces every plot shares: the embedded font, the palette, colour scales, PNG
//! rendering and a line chart. The comparison's plots (`experiment`) and the analysis's
//! (`analysis`) are built from these.
//!
//! Text is drawn with DejaVu Sans embedded in the binary, so labels render on machines without
//! system fonts.

use std::path::Path;
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::error::{Error, Result};

/// The family name the embedded DejaVu Sans is registered under for every plot.
pub const FONT: &str = "sans-serif";

static REGISTER: Once = Once::new();

/// Makes the embedded DejaVu Sans the `sans-serif` of every plot.
pub fn register_fonts() {
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

/// Tableau 10: distinct, colour-blind-friendlier than pure hues.
pub fn palette(i: usize) -> RGBColor {
    const COLORS: [(u8, u8, u8); 10] = [
        (31, 119, 180),
        (255, 127, 14),
        (44, 160, 44),
        (214, 39, 40),
        (148, 103, 189),
        (140, 86, 75),
        (227, 119, 194),
        (127, 127, 127),
        (188, 189, 34),
        (23, 190, 207),
    ];
    let (r, g, b) = COLORS[i % COLORS.len()];
    RGBColor(r, g, b)
}

/// What a drawing closure returns: plotters' errors boxed.
pub type DrawResult = std::result::Result<(), Box<dyn std::error::Error>>;

/// Renders a `width x height` PNG at `path`: drawn into memory, encoded as an 8-bit RGB PNG
/// (the `png` crate; plotters' own encoder would bring the whole `image` crate into the build)
/// and written atomically.
pub fn render_png(
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

/// A band between two curves, lightly filled: `(x, low, high)` by increasing `x`; `None`
/// where there is nothing to fill (one point, or every `low` equal to its `high`).
pub fn band(points: &[(f64, f64, f64)], color: RGBColor) -> Option<Polygon<(f64, f64)>> {
    (points.len() > 1 && points.iter().any(|p| p.2 > p.1)).then(|| {
        let upper = points.iter().map(|p| (p.0, p.2));
        let lower = points.iter().rev().map(|p| (p.0, p.1));
        Polygon::new(
            upper.chain(lower).collect::<Vec<_>>(),
            color.mix(0.15).filled(),
        )
    })
}

/// Blue (negative) through white to red (positive), for `v` in `[-1, 1]`.
pub fn diverging(v: f64) -> RGBColor {
    let v = v.clamp(-1.0, 1.0);
    let (end, t) = if v < 0.0 {
        ((33.0, 102.0, 172.0), -v)
    } else {
        ((178.0, 24.0, 43.0), v)
    };
    let mix = |e: f64| (255.0 + (e - 255.0) * t).round() as u8;
    RGBColor(mix(end.0), mix(end.1), mix(end.2))
}

/// Viridis, sampled at five points and interpolated, for `v` in `[0, 1]`.
pub fn sequential(v: f64) -> RGBColor {
    const STOPS: [(f64, f64, f64); 5] = [
        (68.0, 1.0, 84.0),
        (59.0, 82.0, 139.0),
        (33.0, 145.0, 140.0),
        (94.0, 201.0, 98.0),
        (253.0, 231.0, 37.0),
    ];
    let x = v.clamp(0.0, 1.0) * 4.0;
    let i = (x.floor() as usize).min(3);
    let t = x - i as f64;
    let (a, b) = (STOPS[i], STOPS[i + 1]);
    let lerp = |p: f64, q: f64| (p + (q - p) * t).round() as u8;
    RGBColor(lerp(a.0, b.0), lerp(a.1, b.1), lerp(a.2, b.2))
}

/// An x tick label: a whole number as it is, else two decimals.
pub fn x_label(x: &f64) -> String {
    match x.fract() == 0.0 {
        true => format!("{x:.0}"),
        false => format!("{x:.2}"),
    }
}

/// A short tick label: `1e8` for large values, two decimals for small ones.
pub fn tick(v: &f64) -> String {
    let a = v.abs();
    if a >= 1e5 {
        format!("{v:.0e}")
    } else if a >= 10.0 || a == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

/// One line of a chart: name, points, dashed.
pub type Line = (String, Vec<(f64, f64)>, bool);

/// Series of a line chart.
pub type Series = [Line];

/// Draws the mesh, the series and their legend on a chart of any y coordinate.
fn draw_lines<'a, Y>(
    chart: &mut ChartContext<
        'a,
        BitMapBackend<'a>,
        Cartesian2d<plotters::coord::types::RangedCoordf64, Y>,
    >,
    axes: (&str, &str),
    series: &Series,
) -> DrawResult
where
    Y: Ranged<ValueType = f64> + plotters::coord::ranged1d::ValueFormatter<f64>,
{
    chart
        .configure_mesh()
        .x_desc(axes.0)
        .y_desc(axes.1)
        .axis_desc_style((FONT, 17))
        .label_style((FONT, 13))
        .x_label_formatter(&x_label)
        .y_label_formatter(&tick)
        .draw()?;
    for (i, (name, pts, dashed)) in series.iter().enumerate() {
        let color = palette(i);
        let style = color.stroke_width(2);
        if *dashed {
            chart.draw_series(DashedLineSeries::new(pts.clone(), 6, 4, style))?
        } else {
            chart.draw_series(LineSeries::new(pts.clone(), style))?
        }
        .label(name.as_str())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .label_font((FONT, 14))
        .draw()?;
    Ok(())
}

/// A line chart of `series` (a log y axis with `log_y`), as a 960 x 600 PNG at `path`.
pub fn line_chart(
    path: &Path,
    title: &str,
    axes: (&str, &str),
    series: &Series,
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
    render_png(path, (960, 600), |area| {
        let mut builder = ChartBuilder::on(area);
        builder
            .caption(title, (FONT, 22))
            .margin(16)
            .x_label_area_size(50)
            .y_label_area_size(76);
        if log_y {
            let mut chart =
                builder.build_cartesian_2d(x_min..x_max, (lo * 0.8..hi * 1.25).log_scale())?;
            draw_lines(&mut chart, axes, series)
        } else {
            let mut chart = builder.build_cartesian_2d(x_min..x_max, (lo - pad)..(hi + pad))?;
            draw_lines(&mut chart, axes, series)
        }
    })
}
