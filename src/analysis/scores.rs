//! What the schemes that compute the scores themselves have to show, as curves against the
//! offset `j - i` (key minus query), one per layer and head:
//! - CoPE: the mean count `p_ij` on real text (does a head count tokens, or something rarer?);
//! - PaTH: how far the transport turns a key, the cosine between `k_j` and its transported form
//!   `H ⋯ k_j` on real text (1: the key reaches the query as it is);
//! - PoPE: the score of unit magnitudes in every coordinate (`softplus(q) = softplus(k) = 1`)
//!   at each offset, which is the position's whole part of the score, and the learned `δ`;
//! - stick-breaking: the mean weight on real text (which side a head breaks first, and how far
//!   its weight reaches).

use std::fmt::Write as _;
use std::path::Path;

use candle::{DType, Tensor};

use crate::error::{Error, Result};
use crate::positional::{
    pope_frequencies, stick_breaking_weights, Cope, Path as PathScheme, Pope, PositionalModule,
    StickBreaking,
};
use crate::render::csv::write_rows;
use crate::render::png::{line_chart, Line};
use crate::Encoder;

/// One value per offset `j - i`, per layer and head.
#[derive(Clone, Debug)]
pub struct OffsetCurves {
    /// The file stem (`cope_counts`, `path_turning`, `pope_scores`).
    pub stem: &'static str,
    /// The chart's title.
    pub title: String,
    /// What a value is.
    pub value: &'static str,
    /// The offsets, `-(t - 1)..=t - 1`.
    pub offsets: Vec<i64>,
    /// `(layer, head, value per offset)`; `None` where no real pair has the offset.
    pub curves: Vec<(usize, usize, Vec<Option<f64>>)>,
    /// Lines of scheme facts.
    pub notes: Vec<String>,
}

impl OffsetCurves {
    /// A few numbers per layer and head: the value at offsets -8, -1, +1 and +8 (as far as
    /// they reach).
    pub fn summary(&self) -> String {
        let mut s = format!("{} ({}):\n", self.title, self.value);
        for note in &self.notes {
            let _ = writeln!(s, "  {note}");
        }
        let at = |c: &[Option<f64>], o: i64| -> String {
            self.offsets
                .iter()
                .position(|&x| x == o)
                .and_then(|k| c[k])
                .map_or("-".into(), |v| format!("{v:.3}"))
        };
        for (layer, head, c) in &self.curves {
            let _ = writeln!(
                s,
                "  layer {layer} head {head}: at -8 {}, -1 {}, +1 {}, +8 {}",
                at(c, -8),
                at(c, -1),
                at(c, 1),
                at(c, 8)
            );
        }
        s
    }

    /// `{stem}.csv` (layer, head, offset, value) and `{stem}.png`.
    pub fn write(&self, dir: &Path) -> Result<Vec<String>> {
        crate::io::create_folder(dir)?;
        #[derive(serde::Serialize)]
        struct Row {
            layer: usize,
            head: usize,
            offset: i64,
            value: f64,
        }
        let rows = self.curves.iter().flat_map(|(layer, head, c)| {
            self.offsets.iter().zip(c).filter_map(move |(&offset, v)| {
                v.map(|value| Row {
                    layer: *layer,
                    head: *head,
                    offset,
                    value,
                })
            })
        });
        let files = vec![format!("{}.csv", self.stem), format!("{}.png", self.stem)];
        write_rows(&dir.join(&files[0]), rows)?;
        let series: Vec<Line> = self
            .curves
            .iter()
            .map(|(layer, head, c)| {
                let pts = self
                    .offsets
                    .iter()
                    .zip(c)
                    .filter_map(|(&o, v)| v.map(|v| (o as f64, v)))
                    .collect();
                (format!("L{layer} H{head}"), pts, *layer > 0)
            })
            .collect();
        line_chart(
            &dir.join(&files[1]),
            &self.title,
            ("offset j - i (key minus query)", self.value),
            &series,
            false,
        )?;
        Ok(files)
    }
}

/// Means by offset of `(b, h, t, t)` values over the pairs of real tokens.
fn by_offset(values: &[Vec<Vec<Vec<f64>>>], real: &[Vec<bool>]) -> Vec<Vec<Option<f64>>> {
    let heads = values.first().map_or(0, Vec::len);
    let t = real.first().map_or(0, Vec::len);
    let width = 2 * t.max(1) - 1;
    (0..heads)
        .map(|h| {
            let mut sum = vec![(0.0, 0usize); width];
            for (b, seq) in values.iter().enumerate() {
                for i in 0..t {
                    for j in 0..t {
                        if real[b][i] && real[b][j] {
                            let cell = &mut sum[j + t - 1 - i];
                            cell.0 += seq[h][i][j];
                            cell.1 += 1;
                        }
                    }
                }
            }
            sum.into_iter()
                .map(|(s, n)| (n > 0).then(|| s / n as f64))
                .collect()
        })
        .collect()
}

fn real_tokens(mask: &Tensor) -> Result<Vec<Vec<bool>>> {
    Ok(mask
        .to_dtype(DType::F64)?
        .to_vec2::<f64>()?
        .into_iter()
        .map(|row| row.into_iter().map(|m| m > 0.0).collect())
        .collect())
}

/// The encoder's scores module as `T`, or an error naming what only `T`'s models have.
fn scores_module<'a, T: 'static>(encoder: &'a Encoder, what: &str) -> Result<&'a T> {
    match encoder.positional() {
        PositionalModule::Scores(s) => s.downcast::<T>(),
        _ => None,
    }
    .ok_or_else(|| Error::Input(what.into()))
}

/// `(b, ...)` values as one host array of 3 dimensions per sequence, in f64.
fn per_sequence(x: &Tensor) -> Result<Vec<Vec<Vec<Vec<f64>>>>> {
    Ok((0..x.dim(0)?)
        .map(|b| x.get(b)?.to_dtype(DType::F64)?.to_vec3::<f64>())
        .collect::<candle::Result<_>>()?)
}

fn offsets(t: usize) -> Vec<i64> {
    let t = t.max(1) as i64;
    (-(t - 1)..t).collect()
}

/// CoPE's mean count `p_ij` by offset on `ids`, per layer and head.
pub fn cope_counts(encoder: &Encoder, ids: &Tensor, mask: &Tensor) -> Result<OffsetCurves> {
    let cope: &Cope = scores_module(encoder, "CoPE's counts exist in cope models only")?;
    let real = real_tokens(mask)?;
    let t = ids.dim(1)?;
    let scale = 1.0 / (encoder.config().head_dim() as f64).sqrt();
    let mut curves = Vec::new();
    for (layer, (q, k)) in encoder.queries_keys(ids, mask)?.iter().enumerate() {
        let Some(tables) = &cope.layers[layer] else {
            continue;
        };
        let parts = tables.parts(q, k, Some(mask), scale, encoder.backend())?;
        let counts = per_sequence(&parts.counts)?;
        for (head, c) in by_offset(&counts, &real).into_iter().enumerate() {
            curves.push((layer, head, c));
        }
    }
    Ok(OffsetCurves {
        stem: "cope_counts",
        title: "CoPE: the mean count between key and query, per layer and head".into(),
        value: "mean count p_ij (a token-counting head: |j - i| + 1)",
        offsets: offsets(t),
        curves,
        notes: crate::positional::ScoreModule::notes(cope)?,
    })
}

/// Stick-breaking's mean weight by offset on `ids`, per layer and head, over the keys each
/// query sees (real, within the layer's window, and at or before it in a causal model).
pub fn stick_weights(encoder: &Encoder, ids: &Tensor, mask: &Tensor) -> Result<OffsetCurves> {
    let sb: &StickBreaking = scores_module(
        encoder,
        "stick-breaking weights exist in stick_breaking models only",
    )?;
    let real = real_tokens(mask)?;
    let t = ids.dim(1)?;
    let scale = 1.0 / (encoder.config().head_dim() as f64).sqrt();
    let padding = crate::nn::key_padding_bias(mask, encoder.dtype())?;
    let mut curves = Vec::new();
    for (layer, (q, k)) in encoder.queries_keys(ids, mask)?.iter().enumerate() {
        let Some(sticks) = &sb.0[layer] else {
            continue;
        };
        let window = encoder.config().layer_spec(layer).keys();
        let allowed = crate::nn::allowed_keys(&padding, window, t, q.dtype())?;
        let z = (q.matmul(&k.t()?)? * scale)?;
        let backend = encoder.backend();
        let (w, _) = stick_breaking_weights(&z, &allowed, sticks.attend_current, backend)?;
        let w = per_sequence(&w)?;
        for (head, c) in by_offset(&w, &real).into_iter().enumerate() {
            curves.push((layer, head, c));
        }
    }
    Ok(OffsetCurves {
        stem: "stick_weights",
        title: "stick-breaking: the mean weight by offset, per layer and head (even heads break \
                left first, odd heads right first)"
            .into(),
        value: "mean weight A_ij",
        offsets: offsets(t),
        curves,
        notes: crate::positional::ScoreModule::notes(sb)?,
    })
}

/// PaTH's turning by offset on `ids`: the mean cosine between `k_j` and `P_ij k_j`, the key as
/// the query at `i` reads it, per layer and head.
pub fn path_turning(encoder: &Encoder, ids: &Tensor, mask: &Tensor) -> Result<OffsetCurves> {
    let path: &PathScheme = scores_module(encoder, "PaTH's transport exists in path models only")?;
    let real = real_tokens(mask)?;
    let t = ids.dim(1)?;
    let heads = encoder.config().n_heads;
    let inputs = encoder.attention_inputs(ids, mask)?;
    let mut curves = Vec::new();
    for (layer, (_, k)) in encoder.queries_keys(ids, mask)?.iter().enumerate() {
        let Some(weights) = &path.0[layer] else {
            continue;
        };
        let r = weights.reflections(&inputs[layer], Some(mask), heads, encoder.backend())?;
        let (w, k) = (per_sequence(&r.w)?, per_sequence(k)?);
        let beta = r.beta.to_dtype(DType::F64)?.to_vec3::<f64>()?; // (b, h, t)
        let mut cos = vec![vec![vec![vec![0.0; t]; t]; heads]; w.len()];
        for b in 0..w.len() {
            for h in 0..heads {
                let (w, beta, k) = (&w[b][h], &beta[b][h], &k[b][h]);
                for j in 0..t {
                    let kj = &k[j];
                    let cosine = |v: &[f64]| -> f64 {
                        let dot: f64 = v.iter().zip(kj).map(|(a, b)| a * b).sum();
                        let n = (v.iter().map(|a| a * a).sum::<f64>()
                            * kj.iter().map(|a| a * a).sum::<f64>())
                        .sqrt();
                        if n > 0.0 {
                            dot / n
                        } else {
                            1.0
                        }
                    };
                    let reflect = |v: &mut Vec<f64>, s: usize| {
                        let c =
                            beta[s] * w[s].iter().zip(v.iter()).map(|(a, b)| a * b).sum::<f64>();
                        v.iter_mut().zip(&w[s]).for_each(|(x, ws)| *x -= c * ws);
                    };
                    let rows = &mut cos[b][h];
                    rows[j][j] = 1.0;
                    // Queries after the key: H_i ⋯ H_{j+1} k_j, applied nearest the key first.
                    let mut v = kj.clone();
                    for (i, row) in rows.iter_mut().enumerate().skip(j + 1) {
                        reflect(&mut v, i);
                        row[j] = cosine(&v);
                    }
                    // Queries before it: H_{i+1} ⋯ H_j k_j.
                    let mut v = kj.clone();
                    for (i, row) in rows.iter_mut().enumerate().take(j).rev() {
                        reflect(&mut v, i + 1);
                        row[j] = cosine(&v);
                    }
                }
            }
        }
        for (head, c) in by_offset(&cos, &real).into_iter().enumerate() {
            curves.push((layer, head, c));
        }
    }
    Ok(OffsetCurves {
        stem: "path_turning",
        title: "PaTH: how far the transport turns a key, per layer and head".into(),
        value: "mean cosine of k_j and its transported form (1: unturned)",
        offsets: offsets(t),
        curves,
        notes: crate::positional::ScoreModule::notes(path)?,
    })
}

/// PoPE's score against the offset for unit magnitudes, `Σ_c cos(Δ θ_c − δ_hc) / sqrt(d_head)`,
/// at offsets up to `reach` each way, per layer and head; and each head's `δ`.
pub fn pope_scores(encoder: &Encoder, reach: usize) -> Result<OffsetCurves> {
    let pope: &Pope = scores_module(encoder, "PoPE's phases exist in pope models only")?;
    let hd = encoder.config().head_dim();
    let freqs = pope_frequencies(hd, pope.base);
    let offsets = offsets(reach + 1);
    let mut curves = Vec::new();
    for layer in 0..pope.deltas.len() {
        let Some(delta) = pope.delta(layer).transpose()? else {
            continue;
        };
        let delta = delta.to_dtype(DType::F64)?.to_vec2::<f64>()?;
        for (head, d) in delta.iter().enumerate() {
            let c = offsets
                .iter()
                .map(|&o| {
                    // Δ = p_i - p_j = -(j - i).
                    let s: f64 = freqs
                        .iter()
                        .zip(d)
                        .map(|(f, dc)| (-(o as f64) * f - dc).cos())
                        .sum();
                    Some(s / (hd as f64).sqrt())
                })
                .collect();
            curves.push((layer, head, c));
        }
    }
    Ok(OffsetCurves {
        stem: "pope_scores",
        title: "PoPE: the score of unit magnitudes against the offset, per layer and head".into(),
        value: "sum_c cos(delta_pos theta_c - delta_hc) / sqrt(d_head)",
        offsets,
        curves,
        notes: crate::positional::ScoreModule::notes(pope)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn means_by_offset_count_real_pairs_only() {
        // One sequence of 3 tokens, the last padded; values i - j... as (b, h, t, t).
        let v: Vec<Vec<Vec<Vec<f64>>>> = vec![vec![(0..3)
            .map(|i| (0..3).map(|j| (10 * i + j) as f64).collect())
            .collect()]];
        let real = vec![vec![true, true, false]];
        let c = &by_offset(&v, &real)[0];
        // Offsets -2..=2: (0,0)+(1,1) at 0 -> (0 + 11) / 2; (1,0) at -1 -> 10; (0,1) at +1 -> 1.
        assert_eq!(c, &vec![None, Some(10.0), Some(5.5), Some(1.0), None]);
    }
}
