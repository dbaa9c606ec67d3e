//! Pictures as values: what a chart shows, with nothing drawn yet. A room with numbers to show
//! (a comparison's curves, an analysis's matrices) builds a [`Picture`] out of the pieces here,
//! and [`super::png::draw`] renders it to a PNG. So the rooms that know what the numbers mean
//! hold no drawing code, and this room knows no run, analysis or scheme.
//!
//! A [`Chart`] is one pair of axes: its frame ([`Axis`], [`Grid`], fonts, margins), its
//! [`Series`] in drawing order (each a [`Mark`] with an optional legend entry) and its
//! [`Legend`]. A [`Picture`] is one chart or a grid of them ([`Layout`]), plus free text
//! ([`Note`]) placed in pixels.
//!
//! A training curve on a log axis, with its legend:
//!
//! ```
//! use poslab::render::chart::{Axis, Chart, Color, Grid, Key, Legend, Mark, Picture, Ticks};
//!
//! let color = Color::palette(0);
//! let curve = Mark::Line {
//!     points: vec![(0.0, 2.1), (100.0, 0.9), (200.0, 0.3)],
//!     stroke: color.stroke(2),
//! };
//! let key = Key::Line { length: 20, stroke: color.stroke(3) };
//! let chart = Chart {
//!     caption: ("training loss".into(), 22),
//!     margin: 16,
//!     label_areas: (48, 72),
//!     x: Axis::linear(0.0, 200.0).titled("step").ticks(Ticks::Whole),
//!     y: Axis::log(0.2, 3.0).titled("loss (log scale)"),
//!     grid: Grid::Full,
//!     axis_font: Some(17),
//!     label_font: 13,
//!     series: vec![curve.keyed("rope", key)],
//!     legend: Some(Legend::at(None, 14)),
//! };
//! let dir = tempfile::tempdir()?;
//! let path = dir.path().join("loss.png");
//! poslab::render::png::draw(&path, Picture::chart((640, 400), chart))?;
//! assert!(std::fs::metadata(&path)?.len() > 0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

/// An sRGB colour and its opacity (1 is opaque).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Color {
    /// Red, green and blue, 0 to 255.
    pub rgb: (u8, u8, u8),
    /// Opacity, 0 (transparent) to 1.
    pub alpha: f64,
}

impl Color {
    /// Opaque black.
    pub const BLACK: Color = Color::rgb(0, 0, 0);
    /// Opaque white.
    pub const WHITE: Color = Color::rgb(255, 255, 255);

    /// An opaque colour.
    pub const fn rgb(r: u8, g: u8, b: u8) -> Self {
        Color {
            rgb: (r, g, b),
            alpha: 1.0,
        }
    }

    /// The same colour at `alpha` times its opacity.
    pub fn mix(self, alpha: f64) -> Self {
        Color {
            alpha: self.alpha * alpha,
            ..self
        }
    }

    /// A solid line of this colour, `width` pixels wide.
    pub fn stroke(self, width: u32) -> Stroke {
        Stroke {
            color: self,
            width,
            dash: None,
        }
    }

    /// Tableau 10, the `i`-th colour (cycling): distinct, colour-blind-friendlier than pure
    /// hues.
    pub fn palette(i: usize) -> Self {
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
        Color::rgb(r, g, b)
    }

    /// Blue (negative) through white to red (positive), for `v` in `[-1, 1]` (clamped).
    pub fn diverging(v: f64) -> Self {
        let v = v.clamp(-1.0, 1.0);
        let (end, t) = if v < 0.0 {
            ((33.0, 102.0, 172.0), -v)
        } else {
            ((178.0, 24.0, 43.0), v)
        };
        let mix = |e: f64| (255.0 + (e - 255.0) * t).round() as u8;
        Color::rgb(mix(end.0), mix(end.1), mix(end.2))
    }

    /// Viridis, sampled at five points and interpolated, for `v` in `[0, 1]` (clamped).
    pub fn sequential(v: f64) -> Self {
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
        Color::rgb(lerp(a.0, b.0), lerp(a.1, b.1), lerp(a.2, b.2))
    }
}

/// How a line is drawn: colour, width in pixels, and dashes (`None` for a solid line).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stroke {
    /// The line's colour.
    pub color: Color,
    /// Its width in pixels.
    pub width: u32,
    /// Its dashes; `None` for a solid line.
    pub dash: Option<Dash>,
}

impl Stroke {
    /// The same line, dashed: `size` pixels drawn, `gap` pixels left out.
    pub fn dashed(self, size: u32, gap: u32) -> Self {
        Stroke {
            dash: Some(Dash { size, gap }),
            ..self
        }
    }
}

/// A dashed line's pattern, in pixels.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dash {
    /// Pixels drawn.
    pub size: u32,
    /// Pixels left out after each dash.
    pub gap: u32,
}

/// What a series draws, in the chart's coordinates.
#[derive(Clone, Debug, PartialEq)]
pub enum Mark {
    /// The region between two curves, `(x, low, high)` by increasing `x`, filled at 15% of
    /// `color`; nothing where there is nothing to fill (one point, or every low equal to its
    /// high).
    Band {
        /// `(x, low, high)` by increasing `x`.
        points: Vec<(f64, f64, f64)>,
        /// The colour the fill is a light tint of.
        color: Color,
    },
    /// A line through `points` in order.
    Line {
        /// The points, joined in order.
        points: Vec<(f64, f64)>,
        /// How the line is drawn.
        stroke: Stroke,
    },
    /// Filled dots of `radius` pixels, each of its own colour.
    Dots {
        /// Each dot's centre and colour.
        dots: Vec<((f64, f64), Color)>,
        /// Their radius in pixels.
        radius: u32,
    },
    /// Filled rectangles, each by two opposite corners and of its own colour.
    Boxes {
        /// Each box's two opposite corners and its colour.
        boxes: Vec<([(f64, f64); 2], Color)>,
    },
    /// A vertical bar from `low` to `high` at `x`, with whiskers `whisker` pixels wide at both
    /// ends and at `mean`.
    ErrorBar {
        /// Where the bar stands.
        x: f64,
        /// Its lower end.
        low: f64,
        /// Its middle whisker.
        mean: f64,
        /// Its upper end.
        high: f64,
        /// How it is drawn.
        stroke: Stroke,
        /// The whiskers' width in pixels.
        whisker: u32,
    },
    /// A filled triangle of `size` pixels centred on `at`.
    Triangle {
        /// Its centre.
        at: (f64, f64),
        /// Its size in pixels.
        size: u32,
        /// Its fill.
        color: Color,
    },
    /// A cross of `size` pixels centred on `at`.
    Cross {
        /// Its centre.
        at: (f64, f64),
        /// Its size in pixels.
        size: u32,
        /// How it is drawn.
        stroke: Stroke,
    },
}

impl Mark {
    /// This mark as a series with a legend entry.
    pub fn keyed(self, name: impl Into<String>, key: Key) -> Series {
        Series {
            mark: self,
            key: Some((name.into(), key)),
        }
    }
}

/// A series' sample in the legend, drawn at the entry's left end.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Key {
    /// A horizontal line `length` pixels long.
    Line {
        /// Its length in pixels.
        length: i32,
        /// How it is drawn.
        stroke: Stroke,
    },
    /// A filled 14 x 10 pixel box.
    Box {
        /// Its fill.
        color: Color,
    },
}

/// One mark, and its entry in the legend if it has one.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// What is drawn.
    pub mark: Mark,
    /// Its name and sample in the legend; `None` for no entry.
    pub key: Option<(String, Key)>,
}

impl From<Mark> for Series {
    fn from(mark: Mark) -> Self {
        Series { mark, key: None }
    }
}

/// How an axis maps values to pixels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scale {
    /// Equal steps for equal differences.
    Linear,
    /// Equal steps for equal ratios.
    Log,
}

/// How an axis's tick values are written.
#[derive(Clone, Debug, PartialEq)]
pub enum Ticks {
    /// Rounded to a whole number: `12`.
    Whole,
    /// A whole number as it is, anything else to two decimals: `12`, `0.25`.
    Hundredths,
    /// Short: `1e8` from 100,000 up, a whole number from 10, two decimals below.
    Short,
    /// The name at the tick's value rounded to an index; none past the last name.
    Named(Vec<String>),
}

impl Ticks {
    /// The label of the tick at `v`.
    pub fn label(&self, v: f64) -> String {
        match self {
            Ticks::Whole => format!("{v:.0}"),
            Ticks::Hundredths => match v.fract() == 0.0 {
                true => format!("{v:.0}"),
                false => format!("{v:.2}"),
            },
            Ticks::Short => {
                let a = v.abs();
                if a >= 1e5 {
                    format!("{v:.0e}")
                } else if a >= 10.0 || a == 0.0 {
                    format!("{v:.0}")
                } else {
                    format!("{v:.2}")
                }
            }
            // A value below the first index (`as usize` saturates at 0) names the first.
            Ticks::Named(names) => match v > names.len() as f64 - 0.5 {
                true => String::new(),
                false => names.get(v.round() as usize).cloned().unwrap_or_default(),
            },
        }
    }
}

/// One axis: its range, scale, title, how many ticks and how they read (`None`: the drawing
/// library's choice).
#[derive(Clone, Debug, PartialEq)]
pub struct Axis {
    /// The values at its two ends.
    pub range: (f64, f64),
    /// Linear or logarithmic.
    pub scale: Scale,
    /// Its title, if any.
    pub title: Option<String>,
    /// How its tick labels read.
    pub ticks: Option<Ticks>,
    /// About how many ticks.
    pub count: Option<usize>,
}

impl Axis {
    /// A linear axis over `low..high`, untitled, with the default ticks.
    pub fn linear(low: f64, high: f64) -> Self {
        Axis {
            range: (low, high),
            scale: Scale::Linear,
            title: None,
            ticks: None,
            count: None,
        }
    }

    /// A logarithmic axis over `low..high` (both positive).
    pub fn log(low: f64, high: f64) -> Self {
        Axis {
            scale: Scale::Log,
            ..Axis::linear(low, high)
        }
    }

    /// The axis with a title.
    pub fn titled(self, title: impl Into<String>) -> Self {
        Axis {
            title: Some(title.into()),
            ..self
        }
    }

    /// The axis with its ticks written as `ticks`.
    pub fn ticks(self, ticks: Ticks) -> Self {
        Axis {
            ticks: Some(ticks),
            ..self
        }
    }

    /// The axis with about `count` ticks.
    pub fn count(self, count: usize) -> Self {
        Axis {
            count: Some(count),
            ..self
        }
    }
}

/// Which grid lines a chart draws behind its series.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grid {
    /// At the ticks of both axes.
    Full,
    /// At the y ticks only.
    Horizontal,
    /// None.
    Off,
}

/// Where a legend sits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Corner {
    /// Top right, inside the axes.
    UpperRight,
    /// Bottom left, inside the axes.
    LowerLeft,
}

/// A chart's legend: its corner (`None`: the drawing library's), the opacity of its white
/// background and its font size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Legend {
    /// Where it sits.
    pub corner: Option<Corner>,
    /// The opacity of its white background.
    pub background: f64,
    /// Its font size.
    pub font: u32,
}

impl Legend {
    /// A legend at `corner` on an 85% white background.
    pub fn at(corner: Option<Corner>, font: u32) -> Self {
        Legend {
            corner,
            background: 0.85,
            font,
        }
    }
}

/// One pair of axes and what is drawn on them.
///
/// Sizes are in pixels: `margin` around the chart, `label_areas` the room for the tick labels
/// below the x axis and left of the y axis, `caption`'s font size, `axis_font` the axis
/// titles' (`None`: the library's), `label_font` the tick labels'.
#[derive(Clone, Debug, PartialEq)]
pub struct Chart {
    /// The caption above the chart and its font size.
    pub caption: (String, u32),
    /// The room left around the chart.
    pub margin: u32,
    /// The room for tick labels below the x axis and left of the y axis.
    pub label_areas: (u32, u32),
    /// The horizontal axis.
    pub x: Axis,
    /// The vertical axis.
    pub y: Axis,
    /// Which grid lines are drawn.
    pub grid: Grid,
    /// The axis titles' font size (`None`: the library's).
    pub axis_font: Option<u32>,
    /// The tick labels' font size.
    pub label_font: u32,
    /// Drawn in order, the later over the earlier.
    pub series: Vec<Series>,
    /// The legend of the series with keys, if drawn.
    pub legend: Option<Legend>,
}

/// Text at a pixel position of the whole picture (its top-left corner).
#[derive(Clone, Debug, PartialEq)]
pub struct Note {
    /// What it says.
    pub text: String,
    /// Its top-left corner in pixels.
    pub at: (i32, i32),
    /// Its font size.
    pub font: u32,
    /// Its colour.
    pub color: Color,
}

/// Charts laid out on a page: a strip `top` pixels high (its `title` centred), a grid of
/// `rows x cols` equal panels filled row by row, and below them a strip `below` pixels high
/// holding `keys`, a legend shared by the panels in rows of four (a dashed stroke drawn
/// broken, a box filled).
#[derive(Clone, Debug, PartialEq)]
pub struct Page {
    /// The height of the strip above the panels.
    pub top: u32,
    /// The title centred in it, and its font size.
    pub title: Option<(String, u32)>,
    /// Rows of panels.
    pub rows: usize,
    /// Panels in a row.
    pub cols: usize,
    /// The panels, row by row (fewer than `rows x cols` leaves the last empty).
    pub panels: Vec<Chart>,
    /// The height of the strip below the panels.
    pub below: u32,
    /// The shared legend in it: each name beside its key (a line, a box).
    pub keys: Vec<(String, Key)>,
}

impl Note {
    /// Black text at `alpha` opacity: a picture's fine print.
    pub fn faint(text: impl Into<String>, at: (i32, i32), font: u32, alpha: f64) -> Self {
        Note {
            text: text.into(),
            at,
            font,
            color: Color::BLACK.mix(alpha),
        }
    }
}

/// What fills a picture.
#[derive(Clone, Debug, PartialEq)]
pub enum Layout {
    /// One chart filling the picture.
    Chart(Chart),
    /// Charts in a grid.
    Page(Page),
}

/// A whole picture: its size in pixels, its layout, and notes drawn over it last.
#[derive(Clone, Debug, PartialEq)]
pub struct Picture {
    /// Width and height in pixels.
    pub size: (u32, u32),
    /// What fills it.
    pub layout: Layout,
    /// Text drawn over it last.
    pub notes: Vec<Note>,
}

impl Picture {
    /// One chart filling `size`, without notes.
    pub fn chart(size: (u32, u32), chart: Chart) -> Self {
        Picture {
            size,
            layout: Layout::Chart(chart),
            notes: Vec::new(),
        }
    }

    /// The picture with `note` drawn over it too.
    pub fn with(mut self, note: Note) -> Self {
        self.notes.push(note);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_read_as_their_rules_say() {
        assert_eq!(Ticks::Whole.label(12.6), "13");
        assert_eq!(Ticks::Hundredths.label(12.0), "12");
        assert_eq!(Ticks::Hundredths.label(0.256), "0.26");
        assert_eq!(Ticks::Short.label(2.5e8), "2e8");
        assert_eq!(Ticks::Short.label(0.0), "0");
        assert_eq!(Ticks::Short.label(42.4), "42");
        assert_eq!(Ticks::Short.label(0.1234), "0.12");
        let names = Ticks::Named(vec!["a".into(), "b".into()]);
        assert_eq!(names.label(-0.4), "a");
        assert_eq!(names.label(1.2), "b");
        assert_eq!(names.label(1.6), "");
    }

    #[test]
    fn colour_scales_meet_their_ends_and_middles() {
        assert_eq!(Color::diverging(0.0), Color::WHITE);
        assert_eq!(Color::diverging(-1.0).rgb, (33, 102, 172));
        assert_eq!(Color::diverging(7.0).rgb, (178, 24, 43));
        assert_eq!(Color::sequential(0.0).rgb, (68, 1, 84));
        assert_eq!(Color::sequential(0.5).rgb, (33, 145, 140));
        assert_eq!(Color::sequential(1.0).rgb, (253, 231, 37));
        assert_eq!(Color::palette(10), Color::palette(0));
        assert_eq!(Color::BLACK.mix(0.5).mix(0.5).alpha, 0.25);
    }
}
