//! Wang & Chen (2020)'s relative-order probe: from two rows of a position table side by side,
//! can a linear classifier tell whether the second position comes after the first?
//!
//! As their `relative.py` (MiuLab/PE-Study): pairs `(i, j)` of the table's positions, features
//! `[p_i ; p_j]`, label `j > i`, a logistic regression with an L2 penalty of strength 1
//! (scikit-learn's default `C = 1`, on the raw rows), scored by 5-fold cross-validation. They draw
//! as many pairs as the table has rows (512); poslab draws [`PAIRS`] pairs of distinct positions
//! from its own seeded generator, whatever the table's size, and gives a random table of the
//! same shape the same pairs as a baseline (about 50%).

use rand::Rng as _;
use serde::Serialize;

use super::linalg::{folds, solve_spd};
use super::Table;
use crate::error::Result;
use crate::rng;

/// Pairs drawn per probe (PE-Study's count for a 512-row table).
pub const PAIRS: usize = 512;
/// Folds of the cross-validation.
pub const FOLDS: usize = 5;
/// The L2 penalty on the weights (`1 / C`); the intercept's is 1e-4 of it (scikit-learn leaves
/// it unpenalized; a small penalty keeps the Woodbury solve below well posed).
const PENALTY: f64 = 1.0;
const INTERCEPT_PENALTY: f64 = 1e-4;

/// The probe's result.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OrderProbe {
    /// Position pairs probed.
    pub pairs: usize,
    /// Cross-validation folds.
    pub folds: usize,
    /// Held-out pairs whose order is predicted right, over all pairs.
    pub accuracy: f64,
    /// The same for a random table of the same shape (the same pairs).
    pub random_accuracy: f64,
}

/// Runs the probe on `table` and on a random table like it; pairs from `seed`.
pub fn order_probe(table: &Table, seed: u64) -> Result<OrderProbe> {
    let pairs = draw_pairs(table.rows, seed);
    Ok(OrderProbe {
        pairs: pairs.len(),
        folds: FOLDS,
        accuracy: cross_validated(table, &pairs)?,
        random_accuracy: cross_validated(&table.random_like(seed), &pairs)?,
    })
}

/// [`PAIRS`] pairs of distinct rows, uniform (none when the table has one row).
fn draw_pairs(rows: usize, seed: u64) -> Vec<(usize, usize)> {
    if rows < 2 {
        return Vec::new();
    }
    let mut rng = rng::stream(seed, "order probe pairs");
    let mut pairs = Vec::with_capacity(PAIRS);
    while pairs.len() < PAIRS {
        let (i, j) = (rng.random_range(0..rows), rng.random_range(0..rows));
        if i != j {
            pairs.push((i, j));
        }
    }
    pairs
}

/// The share of held-out pairs classified right over the folds.
fn cross_validated(table: &Table, pairs: &[(usize, usize)]) -> Result<f64> {
    if pairs.is_empty() {
        return Ok(f64::NAN);
    }
    let features: Vec<Vec<f64>> = pairs
        .iter()
        .map(|&(i, j)| {
            let mut x = Vec::with_capacity(2 * table.dim + 1);
            x.extend_from_slice(table.row(i));
            x.extend_from_slice(table.row(j));
            x.push(1.0); // the intercept's feature
            x
        })
        .collect();
    let labels: Vec<f64> = pairs
        .iter()
        .map(|&(i, j)| f64::from(u8::from(j > i)))
        .collect();
    let mut right = 0usize;
    for held in folds(pairs.len(), FOLDS) {
        let fit: Vec<usize> = (0..pairs.len()).filter(|k| !held.contains(k)).collect();
        let x: Vec<&[f64]> = fit.iter().map(|&k| features[k].as_slice()).collect();
        let y: Vec<f64> = fit.iter().map(|&k| labels[k]).collect();
        let w = logistic(&x, &y)?;
        right += held
            .iter()
            .filter(|&&k| (dot(&features[k], &w) > 0.0) == (labels[k] > 0.5))
            .count();
    }
    Ok(right as f64 / pairs.len() as f64)
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The weights minimising `½ Σ λ_k w_k² + Σ_n log(1 + exp(-(2 y_n - 1) x_n·w))` (the last
/// feature is the intercept, `λ` = [`PENALTY`], the intercept's [`INTERCEPT_PENALTY`]), by
/// Newton's method with a backtracking line search.
///
/// Each Newton step solves `(Λ + Xᵀ S X) Δ = g` through the Woodbury identity,
/// `Δ = Λ⁻¹g - Λ⁻¹Xᵀ (S⁻¹ + X Λ⁻¹ Xᵀ)⁻¹ X Λ⁻¹ g`: an `n x n` system for `n` pairs, however wide
/// the rows (a 768-wide table has 1537 features).
fn logistic(x: &[&[f64]], y: &[f64]) -> Result<Vec<f64>> {
    let (n, d) = (x.len(), x.first().map_or(0, |r| r.len()));
    let inv_penalty: Vec<f64> = (0..d)
        .map(|k| match k + 1 == d {
            true => 1.0 / (PENALTY * INTERCEPT_PENALTY),
            false => 1.0 / PENALTY,
        })
        .collect();
    // K = X Λ⁻¹ Xᵀ, fixed across the iterations.
    let mut gram = vec![0.0; n * n];
    for a in 0..n {
        for b in 0..=a {
            let v: f64 = x[a]
                .iter()
                .zip(x[b])
                .zip(&inv_penalty)
                .map(|((p, q), l)| p * q * l)
                .sum();
            gram[a * n + b] = v;
            gram[b * n + a] = v;
        }
    }
    let objective = |w: &[f64]| -> f64 {
        let penalty: f64 = w.iter().zip(&inv_penalty).map(|(w, l)| w * w / l).sum();
        let loss: f64 = x
            .iter()
            .zip(y)
            .map(|(row, &yn)| {
                let margin = (2.0 * yn - 1.0) * dot(row, w);
                // log(1 + exp(-m)), stable for either sign.
                (-margin).max(0.0) + (-margin.abs()).exp().ln_1p()
            })
            .sum();
        0.5 * penalty + loss
    };
    let mut w = vec![0.0; d];
    let mut f = objective(&w);
    for _ in 0..100 {
        let p: Vec<f64> = x.iter().map(|row| sigmoid(dot(row, &w))).collect();
        let mut g: Vec<f64> = w.iter().zip(&inv_penalty).map(|(w, l)| w / l).collect();
        for (row, (pn, yn)) in x.iter().zip(p.iter().zip(y)) {
            let r = pn - yn;
            g.iter_mut()
                .zip(row.iter())
                .for_each(|(gk, xk)| *gk += r * xk);
        }
        if g.iter().fold(0.0f64, |m, v| m.max(v.abs())) < 1e-8 {
            break;
        }
        let u: Vec<f64> = g.iter().zip(&inv_penalty).map(|(g, l)| g * l).collect();
        let v: Vec<f64> = x.iter().map(|row| dot(row, &u)).collect();
        let mut m = gram.clone();
        for (k, pk) in p.iter().enumerate() {
            m[k * n + k] += 1.0 / (pk * (1.0 - pk)).max(1e-12);
        }
        let a = solve_spd(
            nalgebra::DMatrix::from_row_slice(n, n, &m),
            nalgebra::DMatrix::from_column_slice(n, 1, &v),
            "the order probe's Newton step",
        )?;
        let mut step = u;
        for (row, ak) in x.iter().zip(&a) {
            step.iter_mut()
                .zip(row.iter().zip(&inv_penalty))
                .for_each(|(s, (xk, l))| *s -= l * xk * ak);
        }
        // Backtracking (Armijo): Newton's full step can overshoot on nearly separable pairs.
        let slope: f64 = dot(&g, &step);
        let mut t = 1.0;
        let mut next: Vec<f64>;
        loop {
            next = w.iter().zip(&step).map(|(w, s)| w - t * s).collect();
            let fnext = objective(&next);
            if fnext <= f - 1e-4 * t * slope || t < 1e-10 {
                f = fnext;
                break;
            }
            t *= 0.5;
        }
        let moved = w
            .iter()
            .zip(&next)
            .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
        w = next;
        if moved < 1e-12 {
            break;
        }
    }
    Ok(w)
}

fn sigmoid(z: f64) -> f64 {
    if z >= 0.0 {
        1.0 / (1.0 + (-z).exp())
    } else {
        let e = z.exp();
        e / (1.0 + e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logistic_fits_a_line_through_two_clouds_and_matches_its_optimality_condition() {
        // y = 1 exactly where x0 > x1; the fit's gradient is zero at its optimum.
        let pts: Vec<[f64; 3]> = (0..60)
            .map(|k| {
                let a = (k as f64 * 0.37).sin() * 3.0;
                let b = (k as f64 * 0.91).cos() * 3.0;
                [a, b, 1.0]
            })
            .collect();
        let x: Vec<&[f64]> = pts.iter().map(|p| p.as_slice()).collect();
        let y: Vec<f64> = pts
            .iter()
            .map(|p| f64::from(u8::from(p[0] > p[1])))
            .collect();
        let w = logistic(&x, &y).unwrap();
        assert!(w[0] > 0.0 && w[1] < 0.0, "{w:?}");
        let right = x
            .iter()
            .zip(&y)
            .filter(|(r, &yn)| (dot(r, &w) > 0.0) == (yn > 0.5))
            .count();
        assert!(right >= 58, "{right} of 60");
        // Stationarity: Λ w + Xᵀ(σ(Xw) - y) = 0.
        let mut g: Vec<f64> = vec![
            w[0] * PENALTY,
            w[1] * PENALTY,
            w[2] * PENALTY * INTERCEPT_PENALTY,
        ];
        for (r, yn) in x.iter().zip(&y) {
            let e = sigmoid(dot(r, &w)) - yn;
            for k in 0..3 {
                g[k] += e * r[k];
            }
        }
        assert!(g.iter().all(|v| v.abs() < 1e-7), "{g:?}");
    }

    #[test]
    fn a_table_that_counts_is_ordered_and_a_random_one_is_not() {
        // One column that is the position itself: j > i is linear in [p_i; p_j].
        let rows = 64;
        let table = Table {
            title: "ramp".into(),
            start: 0,
            rows,
            dim: 2,
            values: (0..rows).flat_map(|r| [r as f64 / 8.0, 1.0]).collect(),
            pairs: None,
        };
        let probe = order_probe(&table, 0).unwrap();
        assert_eq!((probe.pairs, probe.folds), (PAIRS, FOLDS));
        assert!(probe.accuracy > 0.97, "{probe:?}");
        assert!((0.35..0.65).contains(&probe.random_accuracy), "{probe:?}");
        // Seeded: the same numbers again.
        assert_eq!(order_probe(&table, 0).unwrap(), probe);
        // Sinusoids carry order too (Wang & Chen report the same for their tables).
        let sin = Table::sinusoidal(64, 1e4, Default::default(), 128, 0);
        let probe = order_probe(&sin, 1).unwrap();
        assert!(probe.accuracy > 0.9, "{probe:?}");
    }
}
