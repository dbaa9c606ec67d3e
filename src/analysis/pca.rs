//! A table's rows as points: their lengths, and their principal components (the directions of
//! most variance, the view in which GPT-2's table is a helix and a sinusoid's pairs are circles).

use nalgebra::{DMatrix, SymmetricEigen};
use serde::Serialize;

use super::Table;

/// Components computed.
pub const COMPONENTS: usize = 3;

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

/// Norms and up to [`COMPONENTS`] principal components of `table`'s rows, exactly: the
/// symmetric eigendecomposition (nalgebra) of the smaller Gram matrix of the centred rows `X`,
/// `XᵀX` (`d x d`) or `X Xᵀ` (`n x n`), whose nonzero eigenvalues are the same. Each
/// component's sign makes its largest coordinate positive, so the result is unique.
pub fn row_geometry(table: &Table) -> RowGeometry {
    let (n, d) = (table.rows, table.dim);
    let norms = (0..n)
        .map(|r| table.row(r).iter().map(|v| v * v).sum::<f64>().sqrt())
        .collect();
    let x = DMatrix::from_row_slice(n, d, &table.values[..n * d]);
    let mean = x.row_mean();
    let x = DMatrix::from_fn(n, d, |r, c| x[(r, c)] - mean[c]);
    let total = x.norm_squared();
    let k = COMPONENTS.min(d).min(n.saturating_sub(1));
    if k == 0 || !(total > 0.0 && total.is_finite()) {
        return RowGeometry {
            norms,
            explained: Vec::new(),
            projections: vec![Vec::new(); n],
        };
    }
    // Each component as (variance, the rows' coordinates on it).
    let components: Vec<(f64, Vec<f64>)> = if d <= n {
        let eigen = SymmetricEigen::new(x.transpose() * &x);
        largest(&eigen.eigenvalues, k)
            .into_iter()
            .map(|i| {
                (
                    eigen.eigenvalues[i],
                    (&x * eigen.eigenvectors.column(i)).as_slice().to_vec(),
                )
            })
            .collect()
    } else {
        // X v = sqrt(λ) u for the unit eigenvector u of X Xᵀ.
        let eigen = SymmetricEigen::new(&x * x.transpose());
        largest(&eigen.eigenvalues, k)
            .into_iter()
            .map(|i| {
                let s = eigen.eigenvalues[i].max(0.0).sqrt();
                (
                    eigen.eigenvalues[i],
                    eigen.eigenvectors.column(i).iter().map(|u| u * s).collect(),
                )
            })
            .collect()
    };
    let explained = components.iter().map(|(l, _)| l / total).collect();
    let coordinates: Vec<Vec<f64>> = components
        .into_iter()
        .map(|(_, mut c)| {
            let top = c
                .iter()
                .copied()
                .fold(0.0, |m: f64, v| if v.abs() > m.abs() { v } else { m });
            if top < 0.0 {
                c.iter_mut().for_each(|v| *v = -*v);
            }
            c
        })
        .collect();
    let projections = (0..n)
        .map(|r| coordinates.iter().map(|c| c[r]).collect())
        .collect();
    RowGeometry {
        norms,
        explained,
        projections,
    }
}

/// The indices of the `k` largest eigenvalues, largest first.
fn largest(eigenvalues: &nalgebra::DVector<f64>, k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..eigenvalues.len()).collect();
    order.sort_by(|&a, &b| eigenvalues[b].total_cmp(&eigenvalues[a]));
    order.truncate(k);
    order
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
        let line = row_geometry(&table(50, 6, |r, c| r as f64 * (c as f64 + 1.0)));
        assert!(
            (line.explained[0] - 1.0).abs() < 1e-9,
            "{:?}",
            line.explained
        );
        // A circle (cos, sin of the position, whole turns) in 5 dimensions: two equal halves.
        let circle = row_geometry(&table(64, 5, |r, c| {
            let a = std::f64::consts::TAU * r as f64 / 16.0;
            [a.cos(), a.sin(), 0.0, 0.0, 0.0][c]
        }));
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

    /// The subspace iteration this module used before it was exact (200 iterations from
    /// seeded vectors, Gram-Schmidt twice): the shares it found, largest first.
    fn subspace_iteration(t: &Table, k: usize) -> Vec<f64> {
        use rand::Rng as _;
        let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
        let (n, d) = (t.rows, t.dim);
        let mean: Vec<f64> = (0..d)
            .map(|j| (0..n).map(|r| t.row(r)[j]).sum::<f64>() / n as f64)
            .collect();
        let x: Vec<Vec<f64>> = (0..n)
            .map(|r| t.row(r).iter().zip(&mean).map(|(v, m)| v - m).collect())
            .collect();
        let total: f64 = x.iter().flatten().map(|v| v * v).sum();
        let cov = |v: &[f64]| -> Vec<f64> {
            let mut out = vec![0.0; d];
            for r in &x {
                let s = dot(r, v);
                out.iter_mut().zip(r).for_each(|(o, a)| *o += a * s);
            }
            out
        };
        let mut rng = crate::rng::stream(1, "analysis/pca");
        let mut basis: Vec<Vec<f64>> = (0..k)
            .map(|_| (0..d).map(|_| rng.random::<f64>() - 0.5).collect())
            .collect();
        for it in 0..=200 {
            if it > 0 {
                basis = basis.iter().map(|v| cov(v)).collect();
            }
            for i in 0..k {
                for _ in 0..2 {
                    for j in 0..i {
                        let p = dot(&basis[i], &basis[j]);
                        let bj = basis[j].clone();
                        basis[i].iter_mut().zip(&bj).for_each(|(a, b)| *a -= p * b);
                    }
                }
                let norm = dot(&basis[i], &basis[i]).sqrt();
                basis[i].iter_mut().for_each(|a| *a /= norm);
            }
        }
        let mut shares: Vec<f64> = basis.iter().map(|v| dot(v, &cov(v)) / total).collect();
        shares.sort_by(|a, b| b.total_cmp(a));
        shares
    }

    #[test]
    fn shares_are_ordered_bounded_and_match_the_old_iteration() {
        let t = table(40, 12, |r, c| {
            ((r * 7 + c * 13) % 11) as f64 - 5.0 + (r as f64).sqrt()
        });
        let a = row_geometry(&t);
        assert_eq!(a.explained.len(), 3);
        assert!(a.explained.windows(2).all(|w| w[0] >= w[1]));
        assert!(a.explained.iter().sum::<f64>() <= 1.0 + 1e-12);
        // The subspace iteration it replaced finds the same shares.
        for (x, y) in a.explained.iter().zip(subspace_iteration(&t, 3)) {
            assert!((x - y).abs() < 1e-6, "{x} {y}");
        }
        // The variance of the projections on a component is its share of the total.
        let var0: f64 = a.projections.iter().map(|p| p[0] * p[0]).sum();
        let total = var0 / a.explained[0];
        let var1: f64 = a.projections.iter().map(|p| p[1] * p[1]).sum();
        assert!((var1 / total - a.explained[1]).abs() < 1e-10);
        // A sinusoid's table, wider than it is long (the n x n path): the same as the iteration.
        let wide = Table::sinusoidal(
            64,
            10_000.0,
            crate::positional::TableLayout::Interleaved,
            24,
            0,
        );
        let g = row_geometry(&wide);
        for (x, y) in g.explained.iter().zip(subspace_iteration(&wide, 3)) {
            assert!((x - y).abs() < 1e-6, "{x} {y}");
        }
    }

    #[test]
    fn eigenvalues_of_a_known_matrix_are_exact() {
        // Rows X = H S Rᵀ: H's columns orthogonal and centred (+-1 patterns over 8 rows),
        // S = diag(3, 2, 1), R a rotation of 4 coordinates. XᵀX = R diag(9, 4, 1, 0) Rᵀ · 8, so
        // the shares are 9/14, 4/14 and 1/14, whichever Gram matrix is decomposed.
        let h = |r: usize, j: usize| -> f64 {
            let bit = [r & 1, (r >> 1) & 1, (r >> 2) & 1][j];
            if bit == 0 {
                1.0
            } else {
                -1.0
            }
        };
        let (c, s) = (0.6f64, 0.8f64);
        // R: a rotation in the (0, 1) plane and one in the (2, 3) plane.
        let r = [
            [c, -s, 0.0, 0.0],
            [s, c, 0.0, 0.0],
            [0.0, 0.0, s, c],
            [0.0, 0.0, -c, s],
        ];
        let scale = [3.0, 2.0, 1.0, 0.0];
        let row =
            |i: usize, col: usize| -> f64 { (0..3).map(|j| h(i, j) * scale[j] * r[col][j]).sum() };
        let tall = table(8, 4, row);
        let want = [9.0 / 14.0, 4.0 / 14.0, 1.0 / 14.0];
        let g = row_geometry(&tall);
        for (got, want) in g.explained.iter().zip(want) {
            assert!((got - want).abs() < 1e-10, "{:?}", g.explained);
        }
        // The same points in 12 coordinates (zeros appended): the n x n path, the same shares.
        let wide = table(8, 12, |i, col| if col < 4 { row(i, col) } else { 0.0 });
        let g = row_geometry(&wide);
        for (got, want) in g.explained.iter().zip(want) {
            assert!((got - want).abs() < 1e-10, "{:?}", g.explained);
        }
        // Each component's largest coordinate is positive (the sign is fixed).
        for k in 0..3 {
            let top =
                g.projections
                    .iter()
                    .map(|p| p[k])
                    .fold(0.0, |m: f64, v| if v.abs() > m.abs() { v } else { m });
            assert!(top > 0.0);
        }
    }
}
