//! RoPE beyond its table: the wavelengths each scaling gives the frequency pairs, and how a
//! trained model spreads its queries' and keys' energy over those pairs.
//!
//! Barbero et al. 2025 ("Round and round we go") find that trained models put much of q and k
//! into the slowest pairs, which barely turn over a context and so act as semantic channels
//! rather than positional ones. [`pair_energy`] measures the same on a poslab model: the share
//! of each head's squared q (and k) norm in every pair, over real tokens.

use std::fmt::Write as _;
use std::path::Path;

use candle::{DType, Tensor};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::positional::{
    rope_frequencies, sinusoidal::pair_slots, Factor, PositionalModule, RopePairing, RopeScaling,
};
use crate::render::csv::{write_columns_csv, write_rows};
use crate::render::png::{line_chart, Line};
use crate::Encoder;

/// Wavelengths `2π / w_i` (in positions) of every pair, unscaled and under each scaling at
/// `factor`, for a rotated width `rotary_dim` trained at `original` positions (dynamic NTK
/// evaluated at `factor x original`).
pub fn scaled_wavelengths(
    rotary_dim: usize,
    base: f64,
    factor: f64,
    original: usize,
) -> Vec<(String, Vec<f64>)> {
    let f = Factor::Value(factor);
    let o = Some(original);
    let scalings = [
        None,
        Some(RopeScaling::Linear { factor: f }),
        Some(RopeScaling::Ntk { factor: f }),
        Some(RopeScaling::DynamicNtk {
            factor: f,
            original_max_len: o,
        }),
        Some(RopeScaling::Yarn {
            factor: f,
            original_max_len: o,
            beta_fast: 32.0,
            beta_slow: 1.0,
        }),
    ];
    let reach = (factor * original as f64).ceil() as usize;
    scalings
        .iter()
        .map(|s| {
            let (inv, _) = rope_frequencies(rotary_dim, base, s.as_ref(), reach);
            let label = s.as_ref().map_or("none".to_string(), |s| s.label());
            let wavelengths = inv.iter().map(|w| 2.0 * std::f64::consts::PI / w).collect();
            (label, wavelengths)
        })
        .collect()
}

/// `rope_scaling_wavelengths.csv` and `.png`: every pair's wavelength under each scaling, with
/// the training length and its `factor` multiple for reference.
pub fn write_wavelengths(
    curves: &[(String, Vec<f64>)],
    original: usize,
    factor: f64,
    dir: &Path,
) -> Result<Vec<String>> {
    crate::io::create_folder(dir)?;
    let pairs = curves.first().map_or(0, |c| c.1.len());
    write_columns_csv(
        &dir.join("rope_scaling_wavelengths.csv"),
        "pair",
        (0..pairs).map(|i| i.to_string()),
        curves
            .iter()
            .map(|(label, w)| (label.replace(' ', "_"), w.as_slice())),
    )?;
    let mut series: Vec<Line> = curves
        .iter()
        .map(|(label, w)| {
            (
                label.clone(),
                w.iter().enumerate().map(|(i, v)| (i as f64, *v)).collect(),
                false,
            )
        })
        .collect();
    let flat = |y: f64| (0..pairs).map(|i| (i as f64, y)).collect::<Vec<_>>();
    series.push((
        format!("trained length {original}"),
        flat(original as f64),
        true,
    ));
    series.push((
        format!("{factor} x trained length"),
        flat(factor * original as f64),
        true,
    ));
    line_chart(
        &dir.join("rope_scaling_wavelengths.png"),
        &format!("RoPE wavelengths under each scaling (factor {factor})"),
        (
            "frequency pair i (0 = fastest)",
            "wavelength 2π / w_i (positions)",
        ),
        &series,
        true,
    )?;
    Ok(vec![
        "rope_scaling_wavelengths.csv".into(),
        "rope_scaling_wavelengths.png".into(),
    ])
}

/// One head's share of its squared q or k norm in each frequency pair.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PairEnergy {
    /// The layer.
    pub layer: usize,
    /// What the layer does with positions ([`crate::layers::LayerSpec::describe`]): `global`,
    /// `local, keys within 4`, `no positions` (whose q and k are not rotated).
    pub plan: String,
    /// The head.
    pub head: usize,
    /// `q` or `k`.
    pub side: &'static str,
    /// Per pair, fastest first; sums to 1 over the rotated width.
    pub share: Vec<f64>,
}

impl PairEnergy {
    /// The share in the slowest quarter of the pairs (a uniform spread gives 0.25).
    pub fn slowest_quarter(&self) -> f64 {
        let n = self.share.len();
        self.share[n - n.div_ceil(4)..].iter().sum()
    }
}

/// For a trained rope model (a run's, or a pretrained one's such as ModernBERT): every layer's
/// and head's share of q and k energy per pair, over the real tokens of `ids`.
pub fn pair_energy(encoder: &Encoder, ids: &Tensor, mask: &Tensor) -> Result<Vec<PairEnergy>> {
    let PositionalModule::Rotation(rope) = encoder.positional() else {
        return Err(Error::Input(format!(
            "frequency pairs exist in rope models; this one is `{}`",
            encoder.config().positional.name()
        )));
    };
    let (rd, interleaved) = (
        rope.rotary_dim(),
        rope.pairing() == RopePairing::Interleaved,
    );
    let m = mask.to_dtype(DType::F64)?.unsqueeze(1)?.unsqueeze(3)?; // (b, 1, t, 1)
    let mut out = Vec::new();
    for (layer, (q, k)) in encoder.queries_keys(ids, mask)?.into_iter().enumerate() {
        for (side, x) in [("q", q), ("k", k)] {
            // Sum over real tokens of each coordinate's square, per head: (h, d_head).
            let sq = x
                .to_dtype(DType::F64)?
                .sqr()?
                .broadcast_mul(&m)?
                .sum(2)?
                .sum(0)?
                .to_vec2::<f64>()?;
            for (head, coords) in sq.iter().enumerate() {
                let pair: Vec<f64> = (0..rd / 2)
                    .map(|i| {
                        let (a, b) = pair_slots(interleaved, i, rd);
                        coords[a] + coords[b]
                    })
                    .collect();
                let total: f64 = pair.iter().sum::<f64>().max(1e-300);
                out.push(PairEnergy {
                    layer,
                    plan: encoder.config().layer_spec(layer).describe(),
                    head,
                    side,
                    share: pair.iter().map(|v| v / total).collect(),
                });
            }
        }
    }
    Ok(out)
}

/// Per layer, the mean share of q and k energy in the slowest quarter of pairs, and the
/// pair holding the most.
pub fn energy_summary(energy: &[PairEnergy]) -> String {
    let mut s = String::from(
        "q and k energy by RoPE frequency pair (Barbero et al. 2025: trained models use the \
         slowest pairs as semantic channels); a uniform spread puts 25% in the slowest quarter:\n",
    );
    let layers = energy.iter().map(|e| e.layer).max().map_or(0, |l| l + 1);
    for layer in 0..layers {
        for side in ["q", "k"] {
            let rows: Vec<&PairEnergy> = energy
                .iter()
                .filter(|e| e.layer == layer && e.side == side)
                .collect();
            let quarter =
                rows.iter().map(|e| e.slowest_quarter()).sum::<f64>() / rows.len().max(1) as f64;
            let peaks: Vec<String> = rows
                .iter()
                .map(|e| {
                    let (i, _) = e.share.iter().enumerate().fold((0, f64::MIN), |m, (i, v)| {
                        if *v > m.1 {
                            (i, *v)
                        } else {
                            m
                        }
                    });
                    i.to_string()
                })
                .collect();
            let plan = rows.first().map_or("", |e| e.plan.as_str());
            let _ = writeln!(
                s,
                "  layer {layer} ({plan}) {side}: {:.1}% in the slowest quarter of {} pairs (mean \
                 over heads); the pair with the most, per head: {}",
                100.0 * quarter,
                rows.first().map_or(0, |e| e.share.len()),
                peaks.join(", ")
            );
        }
    }
    s
}

/// `rope_energy.csv`, and `rope_energy_layer{l}.png` per layer: each head's q (solid) and k
/// (dashed) share per pair.
pub fn write_energy(energy: &[PairEnergy], dir: &Path) -> Result<Vec<String>> {
    crate::io::create_folder(dir)?;
    #[derive(serde::Serialize)]
    struct Row {
        layer: usize,
        head: usize,
        side: &'static str,
        pair: usize,
        share: f64,
    }
    write_rows(
        &dir.join("rope_energy.csv"),
        energy.iter().flat_map(|e| {
            e.share.iter().enumerate().map(|(pair, &share)| Row {
                layer: e.layer,
                head: e.head,
                side: e.side,
                pair,
                share,
            })
        }),
    )?;
    let mut files = vec!["rope_energy.csv".to_string()];
    let layers = energy.iter().map(|e| e.layer).max().map_or(0, |l| l + 1);
    for layer in 0..layers {
        let series: Vec<Line> = energy
            .iter()
            .filter(|e| e.layer == layer)
            .map(|e| {
                (
                    format!("H{} {}", e.head, e.side),
                    e.share
                        .iter()
                        .enumerate()
                        .map(|(i, v)| (i as f64, 100.0 * v))
                        .collect(),
                    e.side == "k",
                )
            })
            .collect();
        let name = format!("rope_energy_layer{layer}.png");
        let plan = energy
            .iter()
            .find(|e| e.layer == layer)
            .map_or("", |e| e.plan.as_str());
        line_chart(
            &dir.join(&name),
            &format!("layer {layer} ({plan}): share of q and k energy per RoPE pair"),
            (
                "frequency pair i (0 = fastest, right = slowest)",
                "share of the head's energy (%)",
            ),
            &series,
            false,
        )?;
        files.push(name);
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalings_stretch_the_slow_pairs_and_keep_linear_proportional() {
        let curves = scaled_wavelengths(16, 10_000.0, 4.0, 64);
        let (none, linear) = (&curves[0].1, &curves[1].1);
        for (a, b) in none.iter().zip(linear) {
            assert!(
                (b / a - 4.0).abs() < 1e-12,
                "linear multiplies every wavelength by 4"
            );
        }
        // NTK leaves the fastest pair alone and stretches the slowest the most.
        let ntk = &curves[2].1;
        assert!((ntk[0] - none[0]).abs() < 1e-12);
        assert!(ntk[7] / none[7] > 3.0);
        // YaRN interpolates the slow pairs (x4) and keeps the fast ones.
        let yarn = &curves[4].1;
        assert!((yarn[0] - none[0]).abs() < 1e-12);
        assert!((yarn[7] / none[7] - 4.0).abs() < 1e-9);
    }
}
