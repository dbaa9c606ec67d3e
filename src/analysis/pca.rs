//! A table's rows as points: their lengths, and their principal components (the directions of
//! most variance, the view in which GPT-2's table is a helix and a sinusoid's pairs are circles).

use rand::Rng as _;
use serde::Serialize;

use super::Table;

/// Components computed.
pub const COMPONENTS: usize = 3;

/// Subspace iterations: the Rayleigh quotients settle long before for the tables analysed.
const ITERATIONS: usize = 200;

/// Row norms and the top principal components of the centred rows.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RowGeometry {
    /// `|PE(p)|` for every row.
    #[serde(skip)]
    pub norms: Vec<f64>,
    /// Each component's share of the total variance, largest first.
    pub explained: Vec<f64>,
    /// Each row's coordinates on the components, `rows x explained.len()`.
    #[serde(skip)]
    pub projections: Vec<Vec<f64>>,
}

/// Norms and up to [`COMPONENTS`] principal components of `table`'s rows, by subspace
/// iteration from vectors drawn with `seed` (deterministic).
pub fn row_geometry(table: &Table, seed: u64) -> RowGeometry {
    let (n, d) = (table.rows, table.dim);
    let norms = (0..n)
        .map(|r| table.row(r).iter().map(|v| v * v).sum::<f64>().sqrt())
        .collect();
    let mean: Vec<f64> = (0..d)
        .map(|j| (0..n).map(|r| table.row(r)[j]).sum::<f64>() / n.max(1) as f64)
        .collect();
    let x: Vec<Vec<f64>> = (0..n)
        .map(|r| table.row(r).iter().zip(&mean).map(|(v, m)| v - m).collect())
        .collect();
    let total: f64 = x.iter().flatten().map(|v| v * v).sum();
    let k = COMPONENTS.min(d).min(n.saturating_sub(1));
    if k == 0 || total <= 0.0 {
        return RowGeometry {
            norms,
            explained: Vec::new(),
            projections: vec![Vec::new(); n],
        };
    }
    // C v = Xᵀ (X v), never forming the d x d covariance.
    let cov = |v: &[f64]| -> Vec<f64> {
        let xv: Vec<f64> = x.iter().map(|r| dot(r, v)).collect();
        let mut out = vec![0.0; d];
        for (r, s) in x.iter().zip(&xv) {
            for (o, a) in out.iter_mut().zip(r) {
                *o += a * s;
            }
        }
        out
    };
    let mut rng = crate::rng::stream(seed, "analysis/pca");
    let mut basis: Vec<Vec<f64>> = (0..k)
        .map(|_| (0..d).map(|_| rng.random::<f64>() - 0.5).collect())
        .collect();
    orthonormalize(&mut basis);
    for _ in 0..ITERATIONS {
        basis = basis.iter().map(|v| cov(v)).collect();
        orthonormalize(&mut basis);
    }
    // Rayleigh quotients, sorted largest first.
    let mut pairs: Vec<(f64, Vec<f64>)> =
        basis.into_iter().map(|v| (dot(&v, &cov(&v)), v)).collect();
    pairs.sort_by(|a, b| b.0.total_cmp(&a.0));
    let explained = pairs.iter().map(|(l, _)| l / total).collect();
    let projections = x
        .iter()
        .map(|r| pairs.iter().map(|(_, v)| dot(r, v)).collect())
        .collect();
    RowGeometry {
        norms,
        explained,
        projections,
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Gram-Schmidt, twice for stability; a vector that vanishes is replaced by a unit axis.
fn orthonormalize(basis: &mut [Vec<f64>]) {
    for i in 0..basis.len() {
        for _ in 0..2 {
            for j in 0..i {
                let p = dot(&basis[i], &basis[j]);
                let bj = basis[j].clone();
                for (a, b) in basis[i].iter_mut().zip(&bj) {
                    *a -= p * b;
                }
            }
        }
        let norm = dot(&basis[i], &basis[i]).sqrt();
        if norm > 1e-300 {
            basis[i].iter_mut().for_each(|a| *a /= norm);
        } else {
            let d = basis[i].len();
            basis[i] = (0..d).map(|j| f64::from(u8::from(j == i % d))).collect();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(rows: usize, dim: usize, f: impl Fn(usize, usize) -> f64) -> Table {
        Table {
            title: "t".into(),
            start: 0,
            rows,
            dim,
            values: (0..rows)
                .flat_map(|r| (0..dim).map(move |c| (r, c)))
                .map(|(r, c)| f(r, c))
                .collect(),
            pairs: None,
        }
    }

    #[test]
    fn a_line_is_one_component_and_a_circle_two() {
        // Rows on a line through the table: all the variance on one component.
        let line = row_geometry(&table(50, 6, |r, c| r as f64 * (c as f64 + 1.0)), 1);
        assert!(
            (line.explained[0] - 1.0).abs() < 1e-9,
            "{:?}",
            line.explained
        );
        // A circle (cos, sin of the position, whole turns) in 5 dimensions: two equal halves.
        let circle = row_geometry(
            &table(64, 5, |r, c| {
                let a = std::f64::consts::TAU * r as f64 / 16.0;
                [a.cos(), a.sin(), 0.0, 0.0, 0.0][c]
            }),
            1,
        );
        assert!(
            (circle.explained[0] - 0.5).abs() < 1e-9,
            "{:?}",
            circle.explained
        );
        assert!((circle.explained[1] - 0.5).abs() < 1e-9);
        assert!(circle.explained[2].abs() < 1e-9);
        // Its projections are the circle again: radius 1 about the centre.
        for p in &circle.projections {
            assert!((p[0].hypot(p[1]) - 1.0).abs() < 1e-9, "{p:?}");
        }
        assert!(circle.norms.iter().all(|n| (n - 1.0).abs() < 1e-12));
    }

    #[test]
    fn shares_are_ordered_bounded_and_seeded() {
        let t = table(40, 12, |r, c| {
            ((r * 7 + c * 13) % 11) as f64 - 5.0 + (r as f64).sqrt()
        });
        let a = row_geometry(&t, 3);
        assert_eq!(a.explained.len(), 3);
        assert!(a.explained.windows(2).all(|w| w[0] >= w[1]));
        assert!(a.explained.iter().sum::<f64>() <= 1.0 + 1e-12);
        // Another start finds the same components.
        let b = row_geometry(&t, 4);
        for (x, y) in a.explained.iter().zip(&b.explained) {
            assert!((x - y).abs() < 1e-6, "{x} {y}");
        }
        // The variance of the projections on a component is its share of the total.
        let total: f64 = {
            let g = row_geometry(&t, 3);
            let var0: f64 = g.projections.iter().map(|p| p[0] * p[0]).sum();
            var0 / g.explained[0]
        };
        let var1: f64 = a.projections.iter().map(|p| p[1] * p[1]).sum();
        assert!((var1 / total - a.explained[1]).abs() < 1e-6);
    }
}
