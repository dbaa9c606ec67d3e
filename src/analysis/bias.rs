//! Attention-score biases as functions of position: what ALiBi, T5, KERPLE and TUPE's untied
//! term add to a layer's scores.
//!
//! A bias `B[h, i, j]` over positions `0..P` is summarised per head by its curve over offsets
//! `j - i` (the mean of each diagonal), and by how much of it the offset explains: the share of
//! its variance that the diagonal means account for. A relative scheme (ALiBi, T5, KERPLE) is a
//! function of the offset alone, 100% by construction; TUPE's untied term is absolute, and the
//! share says how relative training made it.

use std::fmt::Write as _;
use std::path::Path;

use candle::{DType, Device, Tensor};

use super::linalg::Matrix;
use crate::encoder::Encoder;
use crate::error::{Error, Result};
use crate::params::ParamStore;
use crate::positional::{
    BiasBatch, OffsetIndex, PositionalConfig, PositionalModule, Positions, SchemeShape, ScoreBias,
};
use crate::render::csv::{write_columns_csv, write_matrix_csv};
use crate::render::png::{heatmap, line_chart};
use crate::render::table::TextTable;

/// One head's bias over positions `0..P`.
#[derive(Clone, Debug)]
pub struct HeadBias {
    /// `L{layer} H{head}`, or `H{head}` for a bias every layer shares.
    pub label: String,
    /// `(P, P)`: query position by key position.
    pub matrix: Matrix,
}

impl HeadBias {
    /// The mean of each diagonal, for offsets `j - i = -(P-1) ..= P-1`.
    pub fn by_offset(&self) -> Vec<f64> {
        let p = self.matrix.rows as i64;
        (-(p - 1)..p)
            .map(|k| {
                let cells: Vec<f64> = (0..p)
                    .filter(|i| (0..p).contains(&(i + k)))
                    .map(|i| self.matrix.row(i as usize)[(i + k) as usize])
                    .collect();
                cells.iter().sum::<f64>() / cells.len() as f64
            })
            .collect()
    }

    /// The share of the bias's variance its offset explains (1 for a function of `j - i`).
    pub fn offset_share(&self) -> f64 {
        let p = self.matrix.rows;
        let curve = self.by_offset();
        let n = (p * p) as f64;
        let mean = self.matrix.data.iter().sum::<f64>() / n;
        let (mut total, mut residual) = (0.0, 0.0);
        for i in 0..p {
            for j in 0..p {
                let v = self.matrix.row(i)[j];
                total += (v - mean).powi(2);
                residual += (v - curve[j + p - 1 - i]).powi(2);
            }
        }
        if total <= 1e-300 {
            1.0
        } else {
            1.0 - residual / total
        }
    }
}

/// Biases of every head (and layer, where they differ), `(1, h, P, P)` tensors flattened.
#[derive(Clone, Debug)]
pub struct BiasAnalysis {
    /// What the biases are, for plot titles and the report.
    pub title: String,
    /// One entry per head (and layer, where they differ).
    pub heads: Vec<HeadBias>,
    /// Whether the scheme is absolute (TUPE): heatmaps are drawn, not only offset curves.
    pub absolute: bool,
    /// Lines of scheme-specific facts (slopes, r1 and r2).
    pub notes: Vec<String>,
}

impl BiasAnalysis {
    /// From one `(h, P, P)` block per layer (row-major values); `layers` 1 for a shared bias.
    pub fn from_layers(
        title: String,
        layers: &[Vec<f64>],
        heads: usize,
        positions: usize,
        absolute: bool,
    ) -> Self {
        let pp = positions * positions;
        let shared = layers.len() == 1;
        let mut out = Vec::new();
        for (l, values) in layers.iter().enumerate() {
            for h in 0..heads {
                let label = if shared {
                    format!("H{h}")
                } else {
                    format!("L{l} H{h}")
                };
                out.push(HeadBias {
                    label,
                    matrix: Matrix::new(
                        positions,
                        positions,
                        values[h * pp..(h + 1) * pp].to_vec(),
                    ),
                });
            }
        }
        Self {
            title,
            heads: out,
            absolute,
            notes: Vec::new(),
        }
    }

    /// A few numbers per head: the bias at offsets 0, ±1, ±8, ±(P-1), and the offset's share.
    pub fn summary(&self) -> String {
        let mut s = format!("{}\n", self.title);
        for note in &self.notes {
            let _ = writeln!(s, "  {note}");
        }
        let p = self.heads.first().map_or(0, |h| h.matrix.rows) as i64;
        let offsets: Vec<i64> = [-(p - 1), -8, -1, 0, 1, 8, p - 1]
            .into_iter()
            .filter(|k| k.abs() < p)
            .collect();
        let mut table = TextTable::new(
            std::iter::once("  head".to_string())
                .chain(offsets.iter().map(|k| format!("j-i={k}")))
                .chain(["offset share".to_string()]),
            std::iter::once(false).chain(std::iter::repeat_n(true, offsets.len() + 1)),
        );
        for head in &self.heads {
            let curve = head.by_offset();
            table.push(
                std::iter::once(format!("  {}", head.label))
                    // `+ 0.0` turns a -0 into 0, so the table never reads "-0.0000".
                    .chain(
                        offsets
                            .iter()
                            .map(|k| format!("{:.4}", curve[(k + p - 1) as usize] + 0.0)),
                    )
                    .chain([format!("{:.1}%", 100.0 * head.offset_share())]),
            );
        }
        s + &table.text()
    }

    /// `bias_by_offset.csv` and `.png`, and for an absolute scheme a heatmap per head
    /// (`bias_{label}.png`, `bias_{label}.csv`).
    pub fn write(&self, dir: &Path) -> Result<Vec<String>> {
        crate::io::create_folder(dir)?;
        let p = self.heads.first().map_or(0, |h| h.matrix.rows) as i64;
        let curves: Vec<Vec<f64>> = self.heads.iter().map(HeadBias::by_offset).collect();
        let mut files = vec![
            "bias_by_offset.csv".to_string(),
            "bias_by_offset.png".into(),
        ];
        write_columns_csv(
            &dir.join(&files[0]),
            "offset",
            (-(p - 1)..p).map(|k| k.to_string()),
            self.heads
                .iter()
                .zip(&curves)
                .map(|(h, c)| (h.label.replace(' ', "_"), c.as_slice())),
        )?;
        let series: Vec<_> = self
            .heads
            .iter()
            .zip(&curves)
            .map(|(h, c)| {
                let pts = (-(p - 1)..p).zip(c).map(|(k, v)| (k as f64, *v)).collect();
                (h.label.clone(), pts, false)
            })
            .collect();
        let y = if self.absolute {
            "mean bias over positions i (added to the score)"
        } else {
            "bias added to the score"
        };
        line_chart(
            &dir.join(&files[1]),
            &format!("{}: bias by offset", self.title),
            ("offset j - i (key minus query)", y),
            &series,
            false,
        )?;
        if self.absolute {
            for h in &self.heads {
                let stem = format!("bias_{}", h.label.replace(' ', "_"));
                write_matrix_csv(
                    &dir.join(format!("{stem}.csv")),
                    h.matrix.parts(),
                    "query",
                    |r| r.to_string(),
                    |c| format!("key{c}"),
                )?;
                heatmap(
                    &dir.join(format!("{stem}.png")),
                    &format!("{}: {} (query i by key j)", self.title, h.label),
                    h.matrix.parts(),
                    true,
                    ("key position j", "query position i"),
                    (0, 0),
                    (1, 1),
                )?;
                files.push(format!("{stem}.csv"));
                files.push(format!("{stem}.png"));
            }
        }
        Ok(files)
    }
}

/// The score biases of a trained encoder with an attention-bias scheme over positions
/// `0..positions` (at most a learned table's rows; every layer's for KERPLE, the shared one
/// otherwise), under DAPE's MLP the scheme's own bias it reads; `None` for other schemes.
pub fn encoder_biases(encoder: &Encoder, positions: usize) -> Result<Option<BiasAnalysis>> {
    let Some(module) = encoder.positional().score_bias() else {
        return Ok(None);
    };
    let through_scores = matches!(encoder.positional(), PositionalModule::Scores(_));
    let config = encoder.config();
    // A learned table (TUPE's learned source) holds only its rows.
    let positions = positions.min(encoder.max_positions().unwrap_or(usize::MAX));
    let range = Positions::range(0, positions)?;
    let layers = if module.per_layer() {
        config.n_layers
    } else {
        1
    };
    let mut blocks = Vec::new();
    for l in 0..layers {
        // A contextual bias (FoX) has no bias of positions alone.
        let Some(bias) = encoder.score_bias(l, &range)? else {
            return Ok(None);
        };
        blocks.push(bias.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?);
    }
    let name = config.positional.name();
    let mut analysis = BiasAnalysis::from_layers(
        format!("{name}: the score bias every layer adds"),
        &blocks,
        config.n_heads,
        positions,
        module.absolute(),
    );
    if layers > 1 {
        analysis.title = format!("{name}: each layer's score bias");
    }
    if through_scores {
        analysis.title = format!(
            "{name}: the score bias, before the MLP that reads it with the logits (adaptive)"
        );
    }
    analysis.notes = encoder.positional().notes()?;
    Ok(Some(analysis))
}

/// A score-bias scheme's module by name for `heads` heads (2 wide each), one layer and
/// `max_len` positions, its variables drawn from seed 0 in f64; and the store that holds them.
pub fn module_by_name(
    positional: &PositionalConfig,
    heads: usize,
    max_len: usize,
) -> Result<(ScoreBias, ParamStore)> {
    let params = ParamStore::new(0);
    let shape = SchemeShape {
        d_model: heads * 2,
        n_heads: heads,
        n_layers: 1,
        max_len,
        layers: crate::layers::LayerSet::ALL,
        causal: false,
    };
    let vb = params.var_builder(DType::F64, &Device::Cpu);
    match PositionalModule::new(positional, shape, vb)? {
        PositionalModule::ScoreBias(module) => Ok((module, params)),
        _ => Err(Error::Config(format!(
            "`{}` is not an attention-bias scheme",
            positional.name()
        ))),
    }
}

/// The bias a module of [`module_by_name`] adds to layer 0's scores at `positions`, no
/// padding, `(r, h, t, t)` in f64; an error for a bias of the content (`name` the scheme's).
pub fn shared_bias(
    module: &ScoreBias,
    positions: &Positions,
    name: &str,
    backend: crate::nn::Backend,
) -> Result<Tensor> {
    let biases = module.layer_biases(&BiasBatch {
        positions,
        mask: None,
        dtype: DType::F64,
        device: &Device::Cpu,
        backend,
    })?;
    biases.layer(0).cloned().ok_or_else(|| {
        Error::Config(format!(
            "`{name}` computes its bias from the content: analyse a trained model (--run)"
        ))
    })
}

/// A scheme's bias by name, for `heads` heads over `positions` positions: ALiBi's fixed bias,
/// KERPLE's at its initialisation (seed 0).
pub fn scheme_biases(
    positional: &PositionalConfig,
    heads: usize,
    positions: usize,
    backend: crate::nn::Backend,
) -> Result<BiasAnalysis> {
    let range = Positions::range(0, positions)?;
    let (module, params) = module_by_name(positional, heads, positions)?;
    let bias = shared_bias(&module, &range, positional.name(), backend)?;
    let values = bias.flatten_all()?.to_vec1::<f64>()?;
    let name = positional.name();
    let what = if params.num_params() > 0 {
        "at initialisation (seed 0)"
    } else {
        "fixed"
    };
    let mut a = BiasAnalysis::from_layers(
        format!("{name}, {heads} heads: the score bias, {what}"),
        &[values],
        heads,
        positions,
        false,
    );
    a.notes = module.notes()?;
    Ok(a)
}

/// The offset index a scheme's learned values are read by (T5's bucket of `j - i`), as the
/// drawing of one head over `positions` positions.
pub fn index_drawing(index: OffsetIndex, positions: usize) -> BiasAnalysis {
    let mut a = BiasAnalysis::from_layers(index.title, &[index.values], 1, positions, false);
    a.heads[0].label = index.label;
    a.notes = index.notes;
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_function_of_the_offset_is_all_offset_and_an_absolute_one_is_not() {
        let p = 12;
        let rel: Vec<f64> = (0..p * p)
            .map(|n| -0.5 * ((n % p) as f64 - (n / p) as f64).abs())
            .collect();
        let a = BiasAnalysis::from_layers("rel".into(), &[rel], 1, p, false);
        assert!((a.heads[0].offset_share() - 1.0).abs() < 1e-12);
        assert_eq!(a.heads[0].by_offset()[p - 1], 0.0);
        assert_eq!(a.heads[0].by_offset()[p + 2], -1.5);
        // i * j depends on both positions, not on their difference alone.
        let abs: Vec<f64> = (0..p * p).map(|n| ((n % p) * (n / p)) as f64).collect();
        let b = BiasAnalysis::from_layers("abs".into(), &[abs], 1, p, true);
        assert!(b.heads[0].offset_share() < 0.9);
    }
}
