//! `report.html` of `poslab analyze`: the analysis's pictures on one self-contained page,
//! interactive, beside its summary.
//!
//! What it shows, where the analysis has it:
//! - the table as a heatmap (position × dimension), and for a table of angles the same table at
//!   every base of `--bases`, one chosen at a time;
//! - the clock of one frequency pair: each position's point in the pair's two columns (a circle
//!   for a sinusoid or RoPE), the pair chosen with a slider;
//! - dot product, cosine distance and L2 distance against the offset: from the reference
//!   position, and the mean over every pair of positions with its range;
//! - the wavelengths of each frequency pair at each base, and RoPE's under each scaling;
//! - the split of attention logits into content and position terms, per layer and head.
//!
//! Hovering a chart or the heatmap shows its values. The page's data is built here;
//! [`crate::render::html`] draws it (`analysis.js`, with the shared pieces).

use serde::Serialize;

use super::{terms::HeadTerms, Analysis, Table};
use crate::render::html::{significant, Script};

/// The most values a heatmap embeds: a larger table is drawn from every k-th row.
const MAX_HEATMAP_VALUES: usize = 1 << 16;

/// The most heatmaps a page embeds (the table and other bases).
const MAX_HEATMAPS: usize = 6;

/// What an analysis page shows, gathered as the analysis runs.
#[derive(Default, Serialize)]
pub struct Page {
    title: String,
    summary: String,
    files: Vec<String>,
    heatmaps: Vec<Heatmap>,
    /// The columns of each frequency pair, for the clock.
    pairs: Vec<[usize; 2]>,
    offsets: Vec<Offsets>,
    wavelengths: Option<Lines>,
    scaled: Option<Lines>,
    biases: Vec<Lines>,
    terms: Option<Terms>,
}

/// A table drawn as a heatmap: `rows × dim` values, row `r` the position `start + r * step`.
#[derive(Serialize)]
struct Heatmap {
    label: String,
    start: usize,
    step: usize,
    rows: usize,
    dim: usize,
    values: Vec<f64>,
}

/// One metric against the offset.
#[derive(Serialize)]
struct Offsets {
    metric: &'static str,
    reference: usize,
    /// `[offset, value from the reference]`.
    from_reference: Vec<[f64; 2]>,
    /// `[offset, mean, min, max]` over every pair of positions that far apart.
    over_pairs: Vec<[f64; 4]>,
}

/// Curves by a shared `x`: one per label, each `[x, y]`.
#[derive(Serialize)]
struct Lines {
    title: String,
    x: String,
    y: String,
    /// A logarithmic `y`.
    log: bool,
    /// A horizontal guide (`RoPE`'s trained length), if any.
    guide: Option<(f64, String)>,
    series: Vec<(String, Vec<[f64; 2]>)>,
}

/// The four terms' shares of each head's logits.
#[derive(Serialize)]
struct Terms {
    title: String,
    names: [&'static str; 4],
    /// `[layer, head, share of each term]`.
    heads: Vec<(usize, usize, [f64; 4])>,
}

impl Page {
    /// A page titled `title`.
    pub fn new(title: impl Into<String>) -> Self {
        Self {
            title: title.into(),
            ..Self::default()
        }
    }

    /// The table analysed, and for a table of angles the same at each of `bases`.
    pub fn table(&mut self, table: &Table, bases: &[f64]) {
        self.heatmaps.push(heatmap(table, table.title.clone()));
        if let Some(own) = table.pairs.as_ref().map(|p| p.base) {
            for &base in bases.iter().filter(|b| **b != own) {
                if self.heatmaps.len() >= MAX_HEATMAPS {
                    break;
                }
                if let Some(t) = table.with_base(base) {
                    self.heatmaps.push(heatmap(&t, t.title.clone()));
                }
            }
        }
        self.pairs = table
            .pair_columns()
            .into_iter()
            .map(|(a, b)| [a, b])
            .collect();
    }

    /// The measures of the table: its metrics against the offset, its wavelengths by base.
    pub fn analysis(&mut self, analysis: &Analysis) {
        self.offsets = analysis
            .offsets
            .iter()
            .map(|c| Offsets {
                metric: c.metric.name(),
                reference: c.reference,
                from_reference: c
                    .from_reference
                    .iter()
                    .enumerate()
                    .map(|(k, v)| [k as f64, significant(*v)])
                    .collect(),
                over_pairs: c
                    .over_pairs
                    .iter()
                    .enumerate()
                    .map(|(k, s)| {
                        [
                            k as f64,
                            significant(s.mean),
                            significant(s.min),
                            significant(s.max),
                        ]
                    })
                    .collect(),
            })
            .collect();
        if !analysis.wavelengths.is_empty() {
            self.wavelengths = Some(Lines {
                title: "wavelength of each frequency pair, by base".into(),
                x: "pair".into(),
                y: "wavelength (positions, log scale)".into(),
                log: true,
                guide: Some((analysis.rows as f64, "positions analysed".into())),
                series: analysis
                    .wavelengths
                    .iter()
                    .map(|w| (format!("base {}", w.base), by_pair(&w.wavelength)))
                    .collect(),
            });
        }
    }

    /// RoPE's wavelengths under each scaling (`curves` as [`super::rope::scaled_wavelengths`]
    /// gives them), trained on `original` positions.
    pub fn scaled_wavelengths(&mut self, curves: &[(String, Vec<f64>)], original: usize) {
        self.scaled = Some(Lines {
            title: "RoPE's wavelengths under each scaling".into(),
            x: "pair".into(),
            y: "wavelength (positions, log scale)".into(),
            log: true,
            guide: Some((original as f64, "trained length".into())),
            series: curves
                .iter()
                .map(|(label, w)| (label.clone(), by_pair(w)))
                .collect(),
        });
    }

    /// An attention bias by offset `j - i`, a line per head (the mean of each diagonal).
    pub fn bias(&mut self, bias: &super::bias::BiasAnalysis) {
        self.biases.push(Lines {
            title: format!("{}: the bias by offset j - i", bias.title),
            x: "offset j - i".into(),
            y: "bias (mean over the diagonal)".into(),
            log: false,
            guide: None,
            series: bias
                .heads
                .iter()
                .map(|h| (h.label.clone(), by_offset(&h.by_offset(), h.matrix.rows)))
                .collect(),
        });
    }

    /// FIRE's bias by offset per head at each length.
    pub fn fire(&mut self, curves: &super::schemes::FireCurves) {
        for (n, heads) in &curves.curves {
            self.biases.push(Lines {
                title: format!("{}: {n} positions", curves.title),
                x: "offset j - i".into(),
                y: "bias".into(),
                log: false,
                guide: None,
                series: heads
                    .iter()
                    .enumerate()
                    .map(|(h, curve)| (format!("H{h}"), by_offset(curve, *n)))
                    .collect(),
            });
        }
    }

    /// The split of attention logits into content and position terms.
    pub fn terms(&mut self, terms: &[HeadTerms], title: &str) {
        self.terms = Some(Terms {
            title: title.into(),
            names: super::terms::TERMS,
            heads: terms
                .iter()
                .map(|t| (t.layer, t.head, t.share.map(significant)))
                .collect(),
        });
    }

    /// The page, with the analysis's summary and the files it wrote.
    pub fn render(mut self, summary: &str, files: &[String]) -> String {
        self.summary = summary.into();
        self.files = files.to_vec();
        crate::render::html::document(&self.title, &self, Script::Analysis)
    }
}

/// `[pair, value]` of each pair's value.
fn by_pair(values: &[f64]) -> Vec<[f64; 2]> {
    values
        .iter()
        .enumerate()
        .map(|(i, v)| [i as f64, significant(*v)])
        .collect()
}

/// `[offset, value]` of a curve over the offsets `-(n - 1) ..= n - 1` of `n` positions.
fn by_offset(curve: &[f64], n: usize) -> Vec<[f64; 2]> {
    let first = -(n as f64 - 1.0);
    curve
        .iter()
        .enumerate()
        .map(|(i, v)| [first + i as f64, significant(*v)])
        .collect()
}

/// `table` as a heatmap, from every k-th row where it is larger than the page takes.
fn heatmap(table: &Table, label: String) -> Heatmap {
    let step = (table.rows * table.dim).div_ceil(MAX_HEATMAP_VALUES).max(1);
    let rows: Vec<usize> = (0..table.rows).step_by(step).collect();
    Heatmap {
        label,
        start: table.start,
        step,
        rows: rows.len(),
        dim: table.dim,
        values: rows
            .iter()
            .flat_map(|&r| table.row(r).iter().map(|v| significant(*v)))
            .collect(),
    }
}
