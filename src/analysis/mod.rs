//! `poslab analyze`: what a positional scheme encodes, for a formula or a trained model.
//!
//! A scheme is looked at through its table, one row per position: the sinusoid itself, RoPE's
//! rotation of a unit vector in every pair (`[cos t w_i, sin t w_i]` laid out by the pairing),
//! or a trained model's learned table. On it: distance matrices, distance against offset, the
//! relative-shift property, how well a linear probe reads the position back, and for fixed
//! tables the wavelength of every pair; for RoPE the decay of q·k with distance; for a trained
//! model with added positions, how the attention logits split into content and position terms.

pub mod bias;
pub mod command;
mod drawings;
pub mod linalg;
pub mod order;
pub mod page;
pub mod pca;
pub mod rope;
pub mod schemes;
pub mod scores;
pub mod terms;

use std::f64::consts::TAU;
use std::path::Path;

use rand::Rng as _;
use rand_distr::StandardNormal;
use serde::Serialize;

use crate::error::Result;
use crate::positional::sinusoidal::pair_slots;
use crate::positional::{
    inverse_frequencies, sinusoidal_table, FixedTable, PositionalConfig, RopePairing, TableLayout,
};
use linalg::{folds, ridge, Matrix};

/// How a table's columns pair into coordinates that rotate with position, where they do.
#[derive(Clone, Debug, PartialEq)]
pub struct Pairs {
    /// `(x[2i], x[2i+1])`, else `(x[i], x[i + d/2])`.
    pub interleaved: bool,
    /// Sinusoids store `(sin, cos)`; RoPE's rotation of a unit vector gives `(cos, sin)`.
    pub sin_first: bool,
    /// The base of the angles: pair `i` turns at `base^(-2i/d)` per position.
    pub base: f64,
}

/// A position table: row `r` is position `start + r`.
#[derive(Clone, Debug)]
pub struct Table {
    /// What the table is, for plot titles and the report.
    pub title: String,
    /// The position of row 0.
    pub start: usize,
    /// How many positions.
    pub rows: usize,
    /// The width of a row.
    pub dim: usize,
    /// Row-major values, `rows × dim`.
    pub values: Vec<f64>,
    /// Set for tables built from angles (sinusoids, RoPE).
    pub pairs: Option<Pairs>,
}

impl Table {
    /// Row `r`: position `start + r`.
    pub fn row(&self, r: usize) -> &[f64] {
        &self.values[r * self.dim..(r + 1) * self.dim]
    }

    fn matrix(&self) -> Matrix {
        Matrix::new(self.rows, self.dim, self.values.clone())
    }

    /// Every `step`-th row (row `r` of the result is row `r * step` of this table).
    fn every(&self, step: usize) -> Matrix {
        let rows: Vec<usize> = (0..self.rows).step_by(step.max(1)).collect();
        let mut data = Vec::with_capacity(rows.len() * self.dim);
        for &r in &rows {
            data.extend_from_slice(self.row(r));
        }
        Matrix::new(rows.len(), self.dim, data)
    }

    /// A scheme's computed table for `rows` positions, from `start` for a sinusoid (a
    /// rotation's from 0).
    pub fn fixed(table: FixedTable, rows: usize, start: usize) -> Self {
        match table {
            FixedTable::Sinusoidal { dim, base, layout } => {
                Self::sinusoidal(dim, base, layout, rows, start)
            }
            FixedTable::Rotation { dim, base, pairing } => Self::rope(dim, base, pairing, rows),
        }
    }

    /// The sinusoidal table of `dim` columns for `rows` positions from `start`.
    pub fn sinusoidal(
        dim: usize,
        base: f64,
        layout: TableLayout,
        rows: usize,
        start: usize,
    ) -> Self {
        Self {
            title: format!("sinusoidal, width {dim}, base {base}, {layout} layout"),
            start,
            rows,
            dim,
            values: sinusoidal_table(start, rows, dim, base, layout),
            pairs: Some(Pairs {
                interleaved: layout == TableLayout::Interleaved,
                sin_first: true,
                base,
            }),
        }
    }

    /// RoPE's rotation of a unit vector `(1, 0)` in every pair of a head of `head_dim`.
    pub fn rope(head_dim: usize, base: f64, pairing: RopePairing, rows: usize) -> Self {
        let interleaved = pairing == RopePairing::Interleaved;
        let values =
            crate::positional::sinusoidal::angle_table(0, rows, head_dim, base, |row, i, angle| {
                let (a, b) = pair_slots(interleaved, i, head_dim);
                (row[b], row[a]) = angle.sin_cos();
            });
        Self {
            title: format!("rope, head width {head_dim}, base {base}, {pairing} pairing"),
            start: 0,
            rows,
            dim: head_dim,
            values,
            pairs: Some(Pairs {
                interleaved,
                sin_first: false,
                base,
            }),
        }
    }

    /// The same table of angles with another `base` (a sinusoid's or RoPE's); `None` for a
    /// table not built from angles.
    pub fn with_base(&self, base: f64) -> Option<Self> {
        let pairs = self.pairs.as_ref()?;
        Some(if pairs.sin_first {
            let layout = match pairs.interleaved {
                true => TableLayout::Interleaved,
                false => TableLayout::Half,
            };
            Self::sinusoidal(self.dim, base, layout, self.rows, self.start)
        } else {
            let pairing = match pairs.interleaved {
                true => RopePairing::Interleaved,
                false => RopePairing::Half,
            };
            Self::rope(self.dim, base, pairing, self.rows)
        })
    }

    /// The columns of each pair `i`: the sine and cosine of one frequency in a table of angles,
    /// else columns `2i` and `2i + 1`.
    pub fn pair_columns(&self) -> Vec<(usize, usize)> {
        let interleaved = self.pairs.as_ref().is_none_or(|p| p.interleaved);
        (0..self.dim / 2)
            .map(|i| pair_slots(interleaved, i, self.dim))
            .collect()
    }

    /// A table of independent standard normal entries of the same shape, for baselines.
    fn random_like(&self, seed: u64) -> Self {
        let mut rng = crate::rng::stream(seed, "analysis/random table");
        Self {
            title: "random".into(),
            start: self.start,
            rows: self.rows,
            dim: self.dim,
            values: (0..self.values.len())
                .map(|_| rng.sample(StandardNormal))
                .collect(),
            pairs: None,
        }
    }
}

/// The table a positional choice gives a model of `d_model` (head width `head_dim`) for `rows`
/// positions: the fixed tables computed (TUPE's sinusoidal source included), `None` for a
/// learned table (read it from the weights) and for schemes without a table (p-RoPE's
/// frequencies are drawn as a spectrum: `analysis::schemes::rotation_spectra`).
pub fn fixed_table(
    positional: &PositionalConfig,
    d_model: usize,
    head_dim: usize,
    rows: usize,
) -> Option<Table> {
    let table = positional.scheme().fixed_table(d_model, head_dim)?;
    Some(Table::fixed(table, rows, 0))
}

/// Min, max and mean of some values.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Spread {
    /// The smallest value.
    pub min: f64,
    /// The largest value.
    pub max: f64,
    /// The mean.
    pub mean: f64,
}

impl Spread {
    fn of(values: impl IntoIterator<Item = f64>) -> Self {
        let (mut min, mut max, mut sum, mut n) = (f64::INFINITY, f64::NEG_INFINITY, 0.0, 0usize);
        for v in values {
            min = min.min(v);
            max = max.max(v);
            sum += v;
            n += 1;
        }
        Self {
            min,
            max,
            mean: sum / n.max(1) as f64,
        }
    }
}

/// The three ways of comparing two positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// `1 - cos(a, b)`.
    Cosine,
    /// `|a - b|`.
    L2,
    /// `a · b`.
    Dot,
}

impl Metric {
    /// The three metrics, in report order.
    pub const ALL: [Metric; 3] = [Metric::Cosine, Metric::L2, Metric::Dot];

    /// The metric in words, for titles.
    pub fn name(self) -> &'static str {
        match self {
            Metric::Cosine => "cosine distance",
            Metric::L2 => "L2 distance",
            Metric::Dot => "dot product",
        }
    }

    /// The metric in file names.
    pub fn file(self) -> &'static str {
        match self {
            Metric::Cosine => "cosine",
            Metric::L2 => "l2",
            Metric::Dot => "dot",
        }
    }

    /// The metric between two rows of the same width.
    pub fn between(self, a: &[f64], b: &[f64]) -> f64 {
        let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
        match self {
            Metric::Dot => dot,
            Metric::L2 => a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).powi(2))
                .sum::<f64>()
                .sqrt(),
            Metric::Cosine => {
                let na = a.iter().map(|x| x * x).sum::<f64>().sqrt();
                let nb = b.iter().map(|x| x * x).sum::<f64>().sqrt();
                if na == 0.0 || nb == 0.0 {
                    1.0
                } else {
                    1.0 - dot / (na * nb)
                }
            }
        }
    }
}

/// Positions a distance matrix (and a table's picture) holds at most: a larger table is read
/// at every `step`-th position ([`matrix_step`]), so that 8192 positions make three 1024 x 1024
/// matrices (CSV and PNG), not three of 67 million entries.
pub const MAX_MATRIX_POSITIONS: usize = 1024;

/// The stride between the positions of a distance matrix of `rows` positions.
pub fn matrix_step(rows: usize) -> usize {
    rows.div_ceil(MAX_MATRIX_POSITIONS).max(1)
}

/// The position-by-position matrix of `metric`, at every [`matrix_step`]-th position.
pub fn distance_matrix(table: &Table, metric: Metric) -> Matrix {
    let rows = table.every(matrix_step(table.rows));
    let n = rows.rows;
    let mut data = vec![0.0; n * n];
    for i in 0..n {
        for j in i..n {
            let d = metric.between(rows.row(i), rows.row(j));
            data[i * n + j] = d;
            data[j * n + i] = d;
        }
    }
    Matrix::new(n, n, data)
}

/// `metric` against the offset `k`: from one reference row, and over all pairs `(p, p + k)`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OffsetCurve {
    /// The metric.
    pub metric: Metric,
    /// The reference row of `from_reference`.
    pub reference: usize,
    /// `metric(reference, reference + k)` for `k = 0, 1, ...`.
    pub from_reference: Vec<f64>,
    /// Over `p`: min, max and mean of `metric(p, p + k)`, for `k = 0, 1, ...`.
    pub over_pairs: Vec<Spread>,
    /// The last `k` up to which `from_reference` moves one way only (rises for distances,
    /// falls for the dot product), and the first `k` where it turns.
    pub monotone_until: usize,
    /// The first `k` where `from_reference` turns; `None` if it never does.
    pub first_turn: Option<usize>,
}

fn offset_curve(table: &Table, metric: Metric, reference: usize) -> OffsetCurve {
    let n = table.rows;
    let reference = reference.min(n.saturating_sub(1));
    let from_reference: Vec<f64> = (0..n - reference)
        .map(|k| metric.between(table.row(reference), table.row(reference + k)))
        .collect();
    let over_pairs = (0..n)
        .map(|k| Spread::of((0..n - k).map(|p| metric.between(table.row(p), table.row(p + k)))))
        .collect();
    // Distances should rise with the offset, a dot product fall; a relative tolerance keeps
    // rounding from ending the run.
    let sign = if metric == Metric::Dot { -1.0 } else { 1.0 };
    let scale = from_reference
        .iter()
        .fold(0.0f64, |m, v| m.max(v.abs()))
        .max(1e-300);
    let turn = from_reference
        .windows(2)
        .position(|w| sign * (w[1] - w[0]) < -1e-12 * scale);
    OffsetCurve {
        metric,
        reference,
        monotone_until: turn.unwrap_or(from_reference.len().saturating_sub(1)),
        first_turn: turn.map(|k| k + 1),
        from_reference,
        over_pairs,
    }
}

/// One offset's relative-shift check.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ShiftRow {
    /// The offset.
    pub k: usize,
    /// `max over p, j of |M(k) PE(p) - PE(p + k)|` with the block rotation `M(k)`, for tables
    /// built from angles.
    pub rotation_error: Option<f64>,
    /// The best linear map from `PE(p)` to `PE(p + k)`, fitted on 4/5 of the positions:
    /// `|residual| / |target|` on the held-out fifth.
    pub linear_residual: f64,
    /// The same for a random table of the same shape.
    pub random_residual: f64,
}

fn rotate(pairs: &Pairs, dim: usize, row: &[f64], k: usize) -> Vec<f64> {
    let mut out = row.to_vec();
    for (i, w) in inverse_frequencies(dim, pairs.base).into_iter().enumerate() {
        let (a, b) = pair_slots(pairs.interleaved, i, dim);
        let (s, c) = (k as f64 * w).sin_cos();
        let (x, y) = (row[a], row[b]);
        (out[a], out[b]) = if pairs.sin_first {
            // (sin t, cos t) -> (sin(t + phi), cos(t + phi))
            (x * c + y * s, y * c - x * s)
        } else {
            // (cos t, sin t) -> (cos(t + phi), sin(t + phi))
            (x * c - y * s, x * s + y * c)
        };
    }
    out
}

/// Rows a linear-map fit uses at most: evenly spaced `p` beyond it, so that a table of
/// thousands of wide rows is a few seconds' work, not minutes.
const MAX_FIT_ROWS: usize = 512;

/// Held-out relative residual of the best linear map from rows `p` to rows `p + k` (at most
/// [`MAX_FIT_ROWS`] evenly spaced `p`).
fn linear_residual(table: &Table, k: usize) -> Result<f64> {
    let step = (table.rows - k).div_ceil(MAX_FIT_ROWS);
    let starts: Vec<usize> = (0..table.rows - k).step_by(step).collect();
    let n = starts.len();
    let all = table.matrix();
    let x = all.select(&starts);
    let y = all.select(&starts.iter().map(|p| p + k).collect::<Vec<_>>());
    let (mut err, mut norm) = (0.0, 0.0);
    for held in folds(n, 5) {
        if held.is_empty() {
            continue;
        }
        let fit: Vec<usize> = (0..n).filter(|i| !held.contains(i)).collect();
        let w = ridge(&x.select(&fit), &y.select(&fit), 1e-10)?;
        let predicted = x.select(&held).matmul(&w);
        let target = y.select(&held);
        err += predicted
            .data
            .iter()
            .zip(&target.data)
            .map(|(a, b)| (a - b).powi(2))
            .sum::<f64>();
        norm += target.data.iter().map(|b| b * b).sum::<f64>();
    }
    Ok((err / norm.max(1e-300)).sqrt())
}

fn shift_check(table: &Table, seed: u64) -> Result<Vec<ShiftRow>> {
    let random = table.random_like(seed);
    // Offsets 1, 2, 4, ... while enough rows remain to fit and test a map.
    let ks: Vec<usize> = std::iter::successors(Some(1usize), |k| Some(k * 2))
        .take_while(|&k| table.rows >= k + 10)
        .collect();
    ks.into_iter()
        .map(|k| {
            Ok(ShiftRow {
                k,
                rotation_error: table.pairs.as_ref().map(|pairs| {
                    (0..table.rows - k)
                        .flat_map(|p| {
                            rotate(pairs, table.dim, table.row(p), k)
                                .into_iter()
                                .zip(table.row(p + k))
                                .map(|(a, b)| (a - b).abs())
                                .collect::<Vec<_>>()
                        })
                        .fold(0.0, f64::max)
                }),
                linear_residual: linear_residual(table, k)?,
                random_residual: linear_residual(&random, k)?,
            })
        })
        .collect()
}

/// How well a linear map reads the position back from a row.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Probe {
    /// Cross-validation folds.
    pub folds: usize,
    /// Mean absolute error of the rounded prediction, in positions, on held-out rows.
    pub mae: f64,
    /// Fraction of held-out rows whose rounded prediction is exact.
    pub exact: f64,
    /// The same mean absolute error for a random table of the same shape.
    pub random_mae: f64,
}

fn probe_mae(table: &Table, k: usize) -> Result<(f64, f64)> {
    let x = table.matrix().with_ones();
    let y = Matrix::new(
        table.rows,
        1,
        (0..table.rows).map(|r| (table.start + r) as f64).collect(),
    );
    let (mut abs_err, mut exact, mut n) = (0.0, 0usize, 0usize);
    for held in folds(table.rows, k) {
        let fit: Vec<usize> = (0..table.rows).filter(|i| !held.contains(i)).collect();
        let w = ridge(&x.select(&fit), &y.select(&fit), 1e-8)?;
        let predicted = x.select(&held).matmul(&w);
        for (p, &i) in predicted.data.iter().zip(&held) {
            let e = (p.round() - y.data[i]).abs();
            abs_err += e;
            exact += usize::from(e == 0.0);
            n += 1;
        }
    }
    Ok((abs_err / n.max(1) as f64, exact as f64 / n.max(1) as f64))
}

fn probe(table: &Table, seed: u64) -> Result<Probe> {
    let folds = 5.min(table.rows).max(2);
    let (mae, exact) = probe_mae(table, folds)?;
    let (random_mae, _) = probe_mae(&table.random_like(seed), folds)?;
    Ok(Probe {
        folds,
        mae,
        exact,
        random_mae,
    })
}

/// Every pair's wavelength and the first position at which its angle wraps, for one base.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Wavelengths {
    /// The base.
    pub base: f64,
    /// `2 pi / w_i` in positions, pair `i = 0, 1, ...`.
    pub wavelength: Vec<f64>,
    /// The smallest position `p` with `p w_i >= 2 pi`.
    pub first_wrap: Vec<usize>,
}

/// The wavelengths of a `dim`-wide table of angles with `base` (`dim / 2` pairs).
pub fn wavelengths(dim: usize, base: f64) -> Wavelengths {
    let w = inverse_frequencies(dim, base);
    Wavelengths {
        base,
        wavelength: w.iter().map(|w| TAU / w).collect(),
        first_wrap: w.iter().map(|w| (TAU / w).ceil() as usize).collect(),
    }
}

/// RoPE's q·k against the relative distance.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RopeDecay {
    /// `q = k = (1, ..., 1)`, divided by the head width: `(2/d) sum_i cos(delta w_i)`, which is
    /// also the expected score of `q = k` with unit-variance entries.
    pub ones: Vec<f64>,
    /// Independent standard normal `q` and `k`: the mean of `|q · R(delta) k| / d` over samples.
    pub random: Vec<f64>,
    /// The RoFormer bound, `(1/(d/2)) sum_j |S_j|`, `S_j = sum_{i<j} e^{i delta w_i}`.
    pub bound: Vec<f64>,
}

fn rope_decay(head_dim: usize, base: f64, distances: usize, seed: u64) -> RopeDecay {
    let w = inverse_frequencies(head_dim, base);
    let half = head_dim / 2;
    let mut rng = crate::rng::stream(seed, "analysis/rope decay");
    let samples: Vec<(Vec<f64>, Vec<f64>)> = (0..256)
        .map(|_| {
            let v = |rng: &mut crate::rng::Rng| {
                (0..head_dim).map(|_| rng.sample(StandardNormal)).collect()
            };
            (v(&mut rng), v(&mut rng))
        })
        .collect();
    let (mut ones, mut random, mut bound) = (Vec::new(), Vec::new(), Vec::new());
    for delta in 0..distances {
        let angles: Vec<f64> = w.iter().map(|w| delta as f64 * w).collect();
        ones.push(2.0 * angles.iter().map(|a| a.cos()).sum::<f64>() / head_dim as f64);
        // q · R(delta) k, pairs (q[i], q[i + d/2]) (the pairing only permutes coordinates).
        let score = |q: &[f64], k: &[f64]| -> f64 {
            angles
                .iter()
                .enumerate()
                .map(|(i, a)| {
                    let (s, c) = a.sin_cos();
                    let (k0, k1) = (k[i], k[half + i]);
                    q[i] * (k0 * c - k1 * s) + q[half + i] * (k0 * s + k1 * c)
                })
                .sum()
        };
        random.push(
            samples.iter().map(|(q, k)| score(q, k).abs()).sum::<f64>()
                / (samples.len() * head_dim) as f64,
        );
        let (mut re, mut im, mut total) = (0.0, 0.0, 0.0);
        for a in &angles {
            let (s, c) = a.sin_cos();
            re += c;
            im += s;
            total += (re * re + im * im).sqrt();
        }
        bound.push(total / half as f64);
    }
    RopeDecay {
        ones,
        random,
        bound,
    }
}

/// Everything measured on one table.
#[derive(Clone, Debug, Serialize)]
pub struct Analysis {
    /// What the table is.
    pub title: String,
    /// The position of row 0.
    pub start: usize,
    /// How many positions.
    pub rows: usize,
    /// The width of a row.
    pub dim: usize,
    /// The spread of the table's values.
    pub values: Spread,
    /// `L2(p, p + 1)` over the table.
    pub consecutive_l2: Spread,
    /// Each metric against the offset.
    pub offsets: Vec<OffsetCurve>,
    /// The relative-shift check at each offset measured.
    pub shift: Vec<ShiftRow>,
    /// The linear position probe.
    pub probe: Probe,
    /// Wang & Chen's relative-order probe.
    pub order: order::OrderProbe,
    /// Row norms and principal components.
    pub geometry: pca::RowGeometry,
    /// For tables built from angles: the sweep of bases (the table's own first).
    pub wavelengths: Vec<Wavelengths>,
    /// RoPE's q·k against distance, for RoPE tables.
    pub rope_decay: Option<RopeDecay>,
}

/// Options of an analysis.
#[derive(Clone, Debug)]
pub struct Options {
    /// The reference position of the offset curves (a row index).
    pub reference: usize,
    /// Bases compared in the wavelength sweep.
    pub bases: Vec<f64>,
    /// Seeds the random baselines.
    pub seed: u64,
    /// Whether the table is RoPE's (adds the decay curve).
    pub rope: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            reference: 0,
            bases: vec![1e2, 1e4, 1e8],
            seed: 0,
            rope: false,
        }
    }
}

/// Measures `table`.
pub fn analyze(table: &Table, options: &Options) -> Result<Analysis> {
    let wavelengths = match &table.pairs {
        Some(p) => std::iter::once(p.base)
            .chain(options.bases.iter().copied().filter(|b| *b != p.base))
            .map(|b| wavelengths(table.dim, b))
            .collect(),
        None => Vec::new(),
    };
    Ok(Analysis {
        title: table.title.clone(),
        start: table.start,
        rows: table.rows,
        dim: table.dim,
        values: Spread::of(table.values.iter().copied()),
        consecutive_l2: Spread::of(
            (0..table.rows.saturating_sub(1))
                .map(|p| Metric::L2.between(table.row(p), table.row(p + 1))),
        ),
        offsets: Metric::ALL
            .iter()
            .map(|&m| offset_curve(table, m, options.reference))
            .collect(),
        shift: shift_check(table, options.seed)?,
        probe: probe(table, options.seed)?,
        order: order::order_probe(table, options.seed)?,
        geometry: pca::row_geometry(table),
        wavelengths,
        rope_decay: match (&table.pairs, options.rope) {
            (Some(p), true) => Some(rope_decay(table.dim, p.base, table.rows, options.seed)),
            _ => None,
        },
    })
}

impl Analysis {
    /// The largest rotation error over all offsets, for tables built from angles.
    pub fn rotation_error(&self) -> Option<f64> {
        self.shift
            .iter()
            .filter_map(|r| r.rotation_error)
            .reduce(f64::max)
    }

    /// The largest held-out linear-map residual over all offsets, and the random table's
    /// smallest.
    pub fn linear_residuals(&self) -> (f64, f64) {
        (
            self.shift
                .iter()
                .map(|r| r.linear_residual)
                .fold(0.0, f64::max),
            self.shift
                .iter()
                .map(|r| r.random_residual)
                .fold(f64::INFINITY, f64::min),
        )
    }

    /// The summary printed at the end of an analysis.
    pub fn summary(&self) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{}: {} positions from {}, {} wide",
            self.title, self.rows, self.start, self.dim
        );
        if self.rows <= self.dim {
            let _ = writeln!(
                s,
                "  note: {} rows of {} dimensions leave any linear map underdetermined; the held-out \
                 shift residual and the probe below are noisy",
                self.rows, self.dim
            );
        }
        let _ = writeln!(
            s,
            "  values in [{:.4}, {:.4}], mean {:.4}",
            self.values.min, self.values.max, self.values.mean
        );
        let c = &self.consecutive_l2;
        let constant = (c.max - c.min) <= 1e-9 * c.max.max(1.0);
        let _ = writeln!(
            s,
            "  consecutive L2 distance: min {:.6}, max {:.6}, mean {:.6}{}",
            c.min,
            c.max,
            c.mean,
            if constant { " (constant)" } else { "" }
        );
        self.summary_offsets(&mut s);
        self.summary_probes(&mut s);
        self.summary_geometry(&mut s);
        self.summary_frequencies(&mut s);
        s
    }

    /// Distance against offset, and the relative-shift check.
    fn summary_offsets(&self, s: &mut String) {
        use std::fmt::Write as _;
        for curve in &self.offsets {
            let _ = writeln!(
                s,
                "  {} from position {}: {} up to offset {}{}",
                curve.metric.name(),
                self.start + curve.reference,
                if curve.metric == Metric::Dot {
                    "falls"
                } else {
                    "rises"
                },
                curve.monotone_until,
                match curve.first_turn {
                    Some(k) => format!(", first turns at offset {k}"),
                    None => ", never turns".into(),
                }
            );
        }
        if let Some(e) = self.rotation_error() {
            let _ = writeln!(s, "  relative shift: PE(p + k) = M(k) PE(p) with a block rotation M(k), largest error {e:.2e} (k = 1..{})", self.shift.last().map_or(0, |r| r.k));
        }
        if !self.shift.is_empty() {
            let (fit, random) = self.linear_residuals();
            // Like with like: each offset's residual beside a random table's at the same offset.
            let below: Vec<bool> = self
                .shift
                .iter()
                .map(|r| r.linear_residual < r.random_residual)
                .collect();
            let run = below.iter().take_while(|&&b| b).count();
            let count = below.iter().filter(|&&b| b).count();
            let last = self.shift.last().map_or(0, |r| r.k);
            let verdict = if count == below.len() {
                format!(
                    "below a random table's at every offset k = 1..{last} (the random table's \
                     least: {random:.2})"
                )
            } else {
                format!(
                    "below a random table's at the same offset for {count} of {} offsets{}",
                    below.len(),
                    match run {
                        0 => ", not at k = 1".to_string(),
                        n => format!(", k = 1..{} without a gap", self.shift[n - 1].k),
                    }
                )
            };
            let _ = writeln!(
                s,
                "  best linear map PE(p) -> PE(p + k), held out: residual at most {fit:.2e}, {verdict}"
            );
        }
    }

    /// The position and order probes.
    fn summary_probes(&self, s: &mut String) {
        use std::fmt::Write as _;
        let p = &self.probe;
        let _ = writeln!(
            s,
            "  linear position probe ({}-fold): mean error {:.2} positions, {:.1}% exact (random table: {:.2} positions)",
            p.folds,
            p.mae,
            100.0 * p.exact,
            p.random_mae
        );
        let o = &self.order;
        if o.pairs > 0 {
            let _ = writeln!(
                s,
                "  order probe (is j after i? logistic on [PE(i); PE(j)], {} pairs, {}-fold): {:.1}% right (random table: {:.1}%)",
                o.pairs,
                o.folds,
                100.0 * o.accuracy,
                100.0 * o.random_accuracy
            );
        }
    }

    /// Row norms and principal components.
    fn summary_geometry(&self, s: &mut String) {
        use std::fmt::Write as _;
        let g = &self.geometry;
        if !g.norms.is_empty() {
            let mut sorted = g.norms.clone();
            sorted.sort_by(f64::total_cmp);
            let (lo, hi) = (sorted[0], sorted[sorted.len() - 1]);
            let longest = g
                .norms
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map_or(0, |(i, _)| i);
            let _ = writeln!(
                s,
                "  row norms: min {lo:.4}, median {:.4}, max {hi:.4}{}",
                sorted[sorted.len() / 2],
                if hi - lo <= 1e-9 * hi.max(1.0) {
                    " (all equal)".to_string()
                } else {
                    format!(" (position {})", self.start + longest)
                }
            );
        }
        if !g.explained.is_empty() {
            let shares: Vec<String> = g
                .explained
                .iter()
                .map(|e| format!("{:.1}%", 100.0 * e))
                .collect();
            let _ = writeln!(
                s,
                "  principal components of the rows: the top {} hold {} of the variance",
                shares.len(),
                shares.join(", ")
            );
        }
    }

    /// Wavelengths and RoPE's decay.
    fn summary_frequencies(&self, s: &mut String) {
        use std::fmt::Write as _;
        for w in &self.wavelengths {
            let longest = w.wavelength.last().copied().unwrap_or(0.0);
            let unwrapped = w
                .first_wrap
                .iter()
                .filter(|&&f| f > self.start + self.rows)
                .count();
            let _ = writeln!(
                s,
                "  base {}: wavelengths {:.1} to {:.1} positions; {} of {} pairs never wrap within these positions",
                w.base,
                w.wavelength.first().copied().unwrap_or(0.0),
                longest,
                unwrapped,
                w.wavelength.len()
            );
        }
        if let Some(d) = &self.rope_decay {
            let at = |k: usize| d.ones.get(k).copied().unwrap_or(f64::NAN);
            let last = d.ones.len().saturating_sub(1);
            let _ = writeln!(
                s,
                "  rope q·k for q = k = ones (per width): {:.3} at distance 0, {:.3} at {}, {:.3} at {last}",
                at(0),
                at(last / 8),
                last / 8,
                at(last)
            );
        }
    }

    /// Writes every table and plot into `dir`.
    pub fn write(&self, table: &Table, dir: &Path) -> Result<Vec<String>> {
        drawings::write_all(self, table, dir)
    }
}

/// Writes the attention-term shares of a trained model into `dir`.
pub fn write_terms(terms: &[terms::HeadTerms], title: &str, dir: &Path) -> Result<Vec<String>> {
    drawings::write_terms(terms, title, dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_with_its_own_base_is_itself_and_with_another_is_that_tables() {
        for t in [
            Table::sinusoidal(16, 10_000.0, TableLayout::Half, 30, 5),
            Table::sinusoidal(16, 10_000.0, TableLayout::Interleaved, 30, 0),
            Table::rope(8, 500.0, RopePairing::Half, 20),
        ] {
            assert_eq!(
                t.with_base(t.pairs.as_ref().unwrap().base).unwrap().values,
                t.values
            );
        }
        let t = Table::sinusoidal(16, 10_000.0, TableLayout::Half, 30, 5);
        let other = Table::sinusoidal(16, 100.0, TableLayout::Half, 30, 5);
        assert_eq!(t.with_base(100.0).unwrap().values, other.values);
        assert_eq!(t.pair_columns()[3], (3, 11));
        assert_eq!(
            Table::rope(8, 500.0, RopePairing::Interleaved, 4).pair_columns()[1],
            (2, 3)
        );
    }

    #[test]
    fn rope_rows_are_unit_pairs_and_rotate_exactly() {
        let t = Table::rope(8, 10_000.0, RopePairing::Half, 40);
        for r in 0..t.rows {
            for i in 0..4 {
                let (a, b) = (t.row(r)[i], t.row(r)[4 + i]);
                assert!((a * a + b * b - 1.0).abs() < 1e-12);
            }
        }
        assert_eq!(&t.row(0)[..4], &[1.0; 4]);
        let a = analyze(
            &t,
            &Options {
                rope: true,
                ..Default::default()
            },
        )
        .unwrap();
        assert!(a.rotation_error().unwrap() < 1e-12);
        let d = a.rope_decay.unwrap();
        assert!(
            (d.ones[0] - 1.0).abs() < 1e-12,
            "q = k = ones scores d at distance 0"
        );
        assert!(d.bound[0] > d.bound[20], "the bound decays");
    }
}
