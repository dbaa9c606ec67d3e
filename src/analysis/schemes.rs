//! What only the schemes of 2024-25 have to show: FIRE's learned function and its
//! interpolation over the span, p-RoPE's frequency spectrum beside RoPE's and `fraction`'s, and
//! FoX's forget gates on real text.

use std::fmt::Write as _;
use std::path::Path;

use candle::{DType, Tensor};

use super::bias::HeadBias;
use super::linalg::Matrix;
use crate::error::{Error, Result};
use crate::positional::{rope_frequencies, rotary_dim, Fox, PositionalModule, PropeOptions};
use crate::render::csv::{write_columns_csv, write_records_csv, write_rows};
use crate::render::png::{line_chart, Line};
use crate::Encoder;

/// FIRE's bias by offset per head, at several sequence lengths (spans `n - 1`).
#[derive(Clone, Debug)]
pub struct FireCurves {
    /// What the curves are, for plot titles and the report.
    pub title: String,
    /// `(n, per head the bias at offsets -(n-1) ..= n-1)`.
    pub curves: Vec<(usize, Vec<Vec<f64>>)>,
    /// Lines of facts for the report (the learned threshold, the curves' ranges).
    pub notes: Vec<String>,
}

/// FIRE's curves from `bias_at(n)`, the shared `(1, h, n, n)` bias of positions `0..n`, at each
/// of `lengths`.
pub fn fire_curves(
    title: String,
    lengths: &[usize],
    bias_at: impl Fn(usize) -> Result<Tensor>,
) -> Result<FireCurves> {
    let mut curves = Vec::new();
    for &n in lengths {
        let bias = bias_at(n)?.to_dtype(DType::F64)?;
        let heads = bias.dim(1)?;
        let values = bias.flatten_all()?.to_vec1::<f64>()?;
        let per_head = (0..heads)
            .map(|h| {
                HeadBias {
                    label: format!("H{h}"),
                    matrix: Matrix::new(n, n, values[h * n * n..(h + 1) * n * n].to_vec()),
                }
                .by_offset()
            })
            .collect();
        curves.push((n, per_head));
    }
    Ok(FireCurves {
        title,
        curves,
        notes: Vec::new(),
    })
}

impl FireCurves {
    /// Per head and length: the bias at offsets 0, ±1 and ±(n-1).
    pub fn summary(&self) -> String {
        let mut s = format!("{}\n", self.title);
        for note in &self.notes {
            let _ = writeln!(s, "  {note}");
        }
        for (n, heads) in &self.curves {
            let _ = writeln!(
                s,
                "  length {n}: bias at offsets -{m}, -1, 0, +1, +{m} (m = {m})",
                m = n - 1
            );
            for (h, c) in heads.iter().enumerate() {
                let at = |k: i64| c[(k + *n as i64 - 1) as usize] + 0.0;
                let m = *n as i64 - 1;
                let _ = writeln!(
                    s,
                    "    H{h}: {:>9.4} {:>9.4} {:>9.4} {:>9.4} {:>9.4}",
                    at(-m),
                    at(-1),
                    at(0),
                    at(1),
                    at(m)
                );
            }
        }
        s
    }

    /// `fire_by_offset.csv`, and two charts: against the offset, and against the offset over
    /// the span (where FIRE's interpolation makes the lengths' curves meet).
    pub fn write(&self, dir: &Path) -> Result<Vec<String>> {
        crate::io::create_folder(dir)?;
        let heads = self.curves.first().map_or(0, |c| c.1.len());
        let mut rows: Vec<Vec<String>> = Vec::new();
        let mut lines: Vec<(usize, usize, Line, Line)> = Vec::new();
        for (index, (n, curves)) in self.curves.iter().enumerate() {
            let m = *n as i64 - 1;
            for (i, k) in (-m..=m).enumerate() {
                let relative = k as f64 / m.max(1) as f64;
                rows.push(
                    [n.to_string(), k.to_string(), relative.to_string()]
                        .into_iter()
                        .chain(curves.iter().map(|c| c[i].to_string()))
                        .collect(),
                );
            }
            for (h, c) in curves.iter().enumerate() {
                let points = |scale: f64| -> Vec<(f64, f64)> {
                    (-m..=m)
                        .zip(c)
                        .map(|(k, v)| (k as f64 / scale, *v))
                        .collect()
                };
                let label = format!("H{h}, length {n}");
                let relative = (label.clone(), points(m.max(1) as f64), index > 0);
                lines.push((h, index, (label, points(1.0), index > 0), relative));
            }
        }
        // Each head's lengths side by side in the legend: solid, then dashed.
        lines.sort_by_key(|l| (l.0, l.1));
        let by_offset: Vec<Line> = lines.iter().map(|l| l.2.clone()).collect();
        let relative: Vec<Line> = lines.into_iter().map(|l| l.3).collect();
        let files = vec![
            "fire_by_offset.csv".to_string(),
            "fire_by_offset.png".into(),
            "fire_by_relative_offset.png".into(),
        ];
        let header = ["length", "offset", "relative_offset"]
            .map(String::from)
            .into_iter()
            .chain((0..heads).map(|h| format!("H{h}")));
        write_records_csv(&dir.join(&files[0]), header, rows)?;
        line_chart(
            &dir.join(&files[1]),
            &format!("{}: bias by offset", self.title),
            ("offset j - i (key minus query)", "bias added to the score"),
            &by_offset,
            false,
        )?;
        line_chart(
            &dir.join(&files[2]),
            &format!("{}: bias by offset over the span", self.title),
            ("(j - i) / span", "bias added to the score"),
            &relative,
            false,
        )?;
        Ok(files)
    }
}

/// The frequency of every pair of a head of `head_dim` under RoPE, p-RoPE at `keep`, and RoPE's
/// `fraction` at the same share: `(label, w_i per pair, 0 where the pair is not rotated)`.
pub fn rotation_spectra(head_dim: usize, base: f64, keep: f64) -> Vec<(String, Vec<f64>)> {
    let pairs = head_dim / 2;
    let (rope, _) = rope_frequencies(head_dim, base, None, 0);
    let prope = PropeOptions {
        base,
        keep,
        ..Default::default()
    }
    .frequencies(head_dim);
    let rd = rotary_dim(head_dim, keep);
    let (partial, _) = rope_frequencies(rd, base, None, 0);
    let mut fraction = vec![0.0; pairs];
    // `fraction` rotates the first `rd` coordinates: pairs `0..rd/2` of them (interleaved).
    fraction[..partial.len()].copy_from_slice(&partial);
    vec![
        ("rope".into(), rope),
        (format!("prope keep {keep}"), prope),
        (format!("rope fraction {keep}"), fraction),
    ]
}

/// `spectrum.csv` and `spectrum.png` (log frequency by pair; unrotated pairs left out), and a
/// summary line per scheme: its slowest rotated wavelength.
pub fn write_spectra(
    spectra: &[(String, Vec<f64>)],
    head_dim: usize,
    dir: &Path,
) -> Result<(String, Vec<String>)> {
    crate::io::create_folder(dir)?;
    let mut summary = format!(
        "rotation spectra of a head of {head_dim} ({} pairs): angular frequency per pair, 0 \
         where a pair is not rotated\n",
        head_dim / 2
    );
    for (label, w) in spectra {
        let rotated: Vec<f64> = w.iter().copied().filter(|&v| v > 0.0).collect();
        let slowest = rotated.iter().copied().fold(f64::INFINITY, f64::min);
        let _ = writeln!(
            summary,
            "  {label:<24} {} pairs rotated, fastest {:.4}, slowest {:.3e} (wavelength {:.1} \
             positions)",
            rotated.len(),
            rotated.first().copied().unwrap_or(0.0),
            slowest,
            std::f64::consts::TAU / slowest
        );
    }
    let series: Vec<Line> = spectra
        .iter()
        .enumerate()
        .map(|(n, (label, w))| {
            let pts = w
                .iter()
                .enumerate()
                .filter(|(_, &v)| v > 0.0)
                .map(|(i, &v)| (i as f64, v))
                .collect();
            (label.clone(), pts, n > 0)
        })
        .collect();
    let files = vec!["spectrum.csv".to_string(), "spectrum.png".into()];
    write_columns_csv(
        &dir.join(&files[0]),
        "pair",
        (0..head_dim / 2).map(|i| i.to_string()),
        spectra
            .iter()
            .map(|(label, w)| (label.replace(' ', "_"), w.as_slice())),
    )?;
    line_chart(
        &dir.join(&files[1]),
        &format!("rotation frequencies of a head of {head_dim}: the pairs each scheme rotates"),
        ("pair i", "angular frequency w_i (radians per position)"),
        &series,
        true,
    )?;
    Ok((summary, files))
}

/// FoX's gates on real text: per layer, the mean forget gate (`sigmoid`, 1 keeps everything)
/// per token, and the decay one query applies to the keys of one text.
#[derive(Clone, Debug)]
pub struct FoxGateAnalysis {
    /// Per layer: `(token, count, mean forward gate over heads, mean backward gate)`, sorted by
    /// the forward gate, most forgetting first.
    pub by_token: Vec<Vec<(String, usize, f64, f64)>>,
    /// The query of the decay: its index in text 0, and text 0's tokens.
    pub query: usize,
    /// Text 0's tokens.
    pub tokens: Vec<String>,
    /// Per layer and head, the bias from the query to every real key of text 0 (its log decay).
    pub decay: Vec<Vec<Vec<f64>>>,
}

/// FoX's gates of a trained encoder on `ids` (real tokens per `mask`); `name` spells a token id.
pub fn fox_gates(
    encoder: &Encoder,
    ids: &Tensor,
    mask: &Tensor,
    name: impl Fn(u32) -> String,
) -> Result<FoxGateAnalysis> {
    let PositionalModule::ScoreBias(module) = encoder.positional() else {
        return Err(Error::Input("forget gates exist in fox models only".into()));
    };
    let fox = module
        .downcast::<Fox>()
        .ok_or_else(|| Error::Input("forget gates exist in fox models only".into()))?;
    let ids_v = ids.to_dtype(DType::U32)?.to_vec2::<u32>()?;
    let mask_v = mask.to_dtype(DType::F64)?.to_vec2::<f64>()?;
    let real0 = mask_v[0].iter().filter(|&&m| m > 0.0).count();
    let query = real0 / 2;
    let tokens: Vec<String> = ids_v[0][..real0].iter().map(|&i| name(i)).collect();
    let mut by_token = Vec::new();
    let mut decay = Vec::new();
    for (layer, x) in encoder.attention_inputs(ids, mask)?.iter().enumerate() {
        let Some(gates) = &fox.0[layer] else {
            // A layer without positions (`[layers]`'s `none`) has no gates.
            by_token.push(Vec::new());
            decay.push(Vec::new());
            continue;
        };
        let g = gates
            .log_gates(x, encoder.backend())?
            .exp()?
            .to_dtype(DType::F64)?; // (b, t, 2h)
        let heads = g.dim(2)? / 2;
        let g = g.to_vec3::<f64>()?;
        let mut sums: std::collections::BTreeMap<u32, (usize, f64, f64)> = Default::default();
        for (b, row) in g.iter().enumerate() {
            for (t, gate) in row.iter().enumerate() {
                if mask_v[b][t] == 0.0 {
                    continue;
                }
                let e = sums.entry(ids_v[b][t]).or_insert((0, 0.0, 0.0));
                e.0 += 1;
                e.1 += gate[..heads].iter().sum::<f64>() / heads as f64;
                e.2 += gate[heads..].iter().sum::<f64>() / heads as f64;
            }
        }
        let mut rows: Vec<_> = sums
            .into_iter()
            .map(|(id, (n, f, b))| (name(id), n, f / n as f64, b / n as f64))
            .collect();
        rows.sort_by(|a, b| a.2.total_cmp(&b.2));
        by_token.push(rows);
        let bias = gates
            .bias(&x.narrow(0, 0, 1)?.narrow(1, 0, real0)?, encoder.backend())?
            .to_dtype(DType::F64)?; // (1, h, t, t)
        let bias = bias.squeeze(0)?.to_vec3::<f64>()?;
        decay.push(bias.iter().map(|head| head[query].clone()).collect());
    }
    Ok(FoxGateAnalysis {
        by_token,
        query,
        tokens,
        decay,
    })
}

impl FoxGateAnalysis {
    /// Per layer: the tokens that forget most and least, and the decay's reach.
    pub fn summary(&self) -> String {
        let mut s = String::from(
            "FoX forget gates on the text (mean sigmoid gate per token; 1 forgets nothing):\n",
        );
        for (layer, rows) in self.by_token.iter().enumerate() {
            if rows.is_empty() {
                let _ = writeln!(s, "  layer {layer}: no positions (no gates)");
                continue;
            }
            let show =
                |r: &(String, usize, f64, f64)| format!("{} {:.3}/{:.3} (x{})", r.0, r.2, r.3, r.1);
            let most: Vec<String> = rows.iter().take(5).map(show).collect();
            let least: Vec<String> = rows.iter().rev().take(5).map(show).collect();
            let _ = writeln!(
                s,
                "  layer {layer}: most forgetting (forward/backward): {}; least: {}",
                most.join(", "),
                least.join(", ")
            );
        }
        let _ = writeln!(
            s,
            "  decay from query {} (`{}`) of text 0 to its first and last keys, per layer and \
             head (log weight added to the score):",
            self.query,
            self.tokens.get(self.query).map_or("", String::as_str)
        );
        for (layer, heads) in self.decay.iter().enumerate() {
            let cells: Vec<String> = heads
                .iter()
                .map(|row| {
                    format!(
                        "{:.2}/{:.2}",
                        row.first().copied().unwrap_or(0.0),
                        row.last().copied().unwrap_or(0.0)
                    )
                })
                .collect();
            let _ = writeln!(s, "    layer {layer}: {}", cells.join("  "));
        }
        s
    }

    /// `fox_gates.csv` (per layer and token) and `fox_decay.csv` / `.png` (from one query).
    pub fn write(&self, dir: &Path) -> Result<Vec<String>> {
        crate::io::create_folder(dir)?;
        #[derive(serde::Serialize)]
        struct Gate<'a> {
            layer: usize,
            token: &'a str,
            count: usize,
            forward_gate: f64,
            backward_gate: f64,
        }
        #[derive(serde::Serialize)]
        struct Decay<'a> {
            layer: usize,
            head: usize,
            key: usize,
            token: &'a str,
            offset: i64,
            bias: f64,
        }
        let mut decay = Vec::new();
        let mut series: Vec<Line> = Vec::new();
        for (layer, heads) in self.decay.iter().enumerate() {
            for (head, row) in heads.iter().enumerate() {
                for (key, &bias) in row.iter().enumerate() {
                    decay.push(Decay {
                        layer,
                        head,
                        key,
                        token: &self.tokens[key],
                        offset: key as i64 - self.query as i64,
                        bias,
                    });
                }
                let pts = row
                    .iter()
                    .enumerate()
                    .map(|(j, v)| (j as f64 - self.query as f64, *v))
                    .collect();
                series.push((format!("L{layer} H{head}"), pts, layer > 0));
            }
        }
        let files = vec![
            "fox_gates.csv".to_string(),
            "fox_decay.csv".into(),
            "fox_decay.png".into(),
        ];
        write_rows(
            &dir.join(&files[0]),
            self.by_token.iter().enumerate().flat_map(|(layer, rows)| {
                rows.iter().map(move |(token, count, f, b)| Gate {
                    layer,
                    token,
                    count: *count,
                    forward_gate: *f,
                    backward_gate: *b,
                })
            }),
        )?;
        write_rows(&dir.join(&files[1]), decay)?;
        line_chart(
            &dir.join(&files[2]),
            &format!(
                "FoX: the decay from query {} of one text, per layer and head",
                self.query
            ),
            ("offset j - i (key minus query)", "bias added to the score"),
            &series,
            false,
        )?;
        Ok(files)
    }
}
