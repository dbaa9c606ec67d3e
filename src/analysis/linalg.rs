//! Linear algebra for the analyses, on nalgebra: the row-major matrix the analyses pass
//! around, ridge regression by a Cholesky solve that refuses a system that is not positive
//! definite, and the folds of a cross-validation.

use nalgebra::DMatrix;

use crate::error::{Error, Result};

/// A row-major matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// The values, row after row.
    pub data: Vec<f64>,
}

impl Matrix {
    /// A `rows × cols` matrix; panics if `data` has another length (a programming error).
    pub fn new(rows: usize, cols: usize, data: Vec<f64>) -> Self {
        assert_eq!(data.len(), rows * cols, "matrix data");
        Self { rows, cols, data }
    }

    /// Rows, columns and the row-major data, as [`crate::render::csv::write_matrix_csv`] takes
    /// them.
    pub fn parts(&self) -> (usize, usize, &[f64]) {
        (self.rows, self.cols, &self.data)
    }

    /// Row `r`.
    pub fn row(&self, r: usize) -> &[f64] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// The rows at `indices`.
    pub fn select(&self, indices: &[usize]) -> Self {
        let mut data = Vec::with_capacity(indices.len() * self.cols);
        for &i in indices {
            data.extend_from_slice(self.row(i));
        }
        Self::new(indices.len(), self.cols, data)
    }

    /// This matrix with a column of ones appended (an intercept).
    pub fn with_ones(&self) -> Self {
        let mut data = Vec::with_capacity(self.rows * (self.cols + 1));
        for r in 0..self.rows {
            data.extend_from_slice(self.row(r));
            data.push(1.0);
        }
        Self::new(self.rows, self.cols + 1, data)
    }

    /// `self * other`.
    pub fn matmul(&self, other: &Matrix) -> Matrix {
        assert_eq!(self.cols, other.rows, "matmul shapes");
        Self::from_nalgebra(&(self.to_nalgebra() * other.to_nalgebra()))
    }

    /// As an nalgebra matrix.
    pub fn to_nalgebra(&self) -> DMatrix<f64> {
        DMatrix::from_row_slice(self.rows, self.cols, &self.data)
    }

    /// From an nalgebra matrix.
    pub fn from_nalgebra(m: &DMatrix<f64>) -> Self {
        // nalgebra stores columns; the transpose's columns are this matrix's rows.
        Self::new(m.nrows(), m.ncols(), m.transpose().as_slice().to_vec())
    }
}

/// The `w` minimising `|x w - y|^2 + lambda |w|^2` (`x`: n x d, `y`: n x m, `w`: d x m).
///
/// `lambda` is scaled by the mean diagonal of `xᵀx`, so it is relative to the data's size. With
/// fewer rows than columns the dual form is solved, `w = xᵀ (x xᵀ + λI)⁻¹ y`, an `n x n` system
/// instead of `d x d` (the same `w`): a 1024-wide table over 128 positions is a 128 x 128 solve,
/// not a 1024 x 1024 one.
pub fn ridge(x: &Matrix, y: &Matrix, lambda: f64) -> Result<Matrix> {
    assert_eq!(x.rows, y.rows, "ridge: x and y rows");
    let (n, d) = (x.rows, x.cols);
    let (xm, ym) = (x.to_nalgebra(), y.to_nalgebra());
    // trace(xᵀx) = trace(x xᵀ) = the sum of squares.
    let trace: f64 = x.data.iter().map(|v| v * v).sum();
    let ridge = lambda * (trace / d.max(1) as f64).max(f64::MIN_POSITIVE);
    let w = if n < d {
        // Dual: (x xᵀ + λI) α = y, then w = xᵀ α.
        let k = &xm * xm.transpose() + DMatrix::identity(n, n) * ridge;
        xm.transpose() * solve_spd(k, ym, "ridge regression (dual)")?
    } else {
        // Normal equations: (xᵀx + λI) w = xᵀy.
        let a = xm.transpose() * &xm + DMatrix::identity(d, d) * ridge;
        solve_spd(a, xm.transpose() * ym, "ridge regression")?
    };
    Ok(Matrix::from_nalgebra(&w))
}

/// Solves `a x = b` for a symmetric positive definite `a`, by Cholesky; a matrix that is not
/// positive definite (to working precision) is an error naming `what`, never a clamped answer.
pub(crate) fn solve_spd(a: DMatrix<f64>, b: DMatrix<f64>, what: &str) -> Result<DMatrix<f64>> {
    let n = a.nrows();
    let finite = a.iter().chain(b.iter()).all(|v| v.is_finite());
    match a.cholesky().filter(|_| finite) {
        Some(l) => Ok(l.solve(&b)),
        None => Err(Error::Input(format!(
            "{what}: the {n} x {n} system is not positive definite (the table's rows are \
             degenerate or not finite), so it has no fit"
        ))),
    }
}

/// Indices `0..n` in `folds` contiguous-free interleaved folds: fold `f` holds `f, f + k, ...`.
pub fn folds(n: usize, folds: usize) -> Vec<Vec<usize>> {
    (0..folds)
        .map(|f| (f..n).step_by(folds).collect())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dual_form_gives_the_primal_answer() {
        let mut rng = crate::rng::stream(4, "ridge");
        use rand::Rng as _;
        let (n, d, m) = (9, 14, 3);
        let x = Matrix::new(
            n,
            d,
            (0..n * d).map(|_| rng.random_range(-1.0..1.0)).collect(),
        );
        let y = Matrix::new(
            n,
            m,
            (0..n * m).map(|_| rng.random_range(-1.0..1.0)).collect(),
        );
        let dual = ridge(&x, &y, 1e-3).unwrap(); // n < d: dual
                                                 // The primal on the same data, with rows padded by zeros so that n >= d (zero rows add
                                                 // nothing to xᵀx or xᵀy).
        let mut xp = x.data.clone();
        xp.extend(vec![0.0; (d - n) * d]);
        let mut yp = y.data.clone();
        yp.extend(vec![0.0; (d - n) * m]);
        let primal = ridge(&Matrix::new(d, d, xp), &Matrix::new(d, m, yp), 1e-3).unwrap();
        for (a, b) in dual.data.iter().zip(&primal.data) {
            assert!((a - b).abs() < 1e-9, "{a} vs {b}");
        }
    }

    #[test]
    fn ridge_recovers_an_exact_linear_map() {
        // y = x w for a known w; with a tiny ridge the solve returns it.
        let x = Matrix::new(
            5,
            3,
            vec![1., 2., 0., 0., 1., 1., 3., 0., 1., 1., 1., 1., 2., 5., 3.],
        );
        let w = Matrix::new(3, 2, vec![1., -1., 0.5, 2., -2., 0.25]);
        let y = x.matmul(&w);
        let got = ridge(&x, &y, 1e-12).unwrap();
        for (a, b) in got.data.iter().zip(&w.data) {
            assert!((a - b).abs() < 1e-8, "{:?}", got.data);
        }
        // A large ridge shrinks the answer toward zero.
        let shrunk = ridge(&x, &y, 1e3).unwrap();
        assert!(
            shrunk.data.iter().map(|v| v.abs()).sum::<f64>()
                < 0.1 * w.data.iter().map(|v| v.abs()).sum::<f64>()
        );
        assert_eq!(folds(7, 3), vec![vec![0, 3, 6], vec![1, 4], vec![2, 5]]);
    }

    #[test]
    fn a_system_that_is_not_positive_definite_fails() {
        // Once clamped to a tiny pivot and "solved"; now refused, naming the fit.
        let a = DMatrix::from_row_slice(2, 2, &[1.0, 2.0, 2.0, 1.0]); // eigenvalues 3 and -1
        let b = DMatrix::from_row_slice(2, 1, &[1.0, 1.0]);
        let e = solve_spd(a, b, "a test fit").unwrap_err().to_string();
        assert!(
            e.contains("a test fit") && e.contains("not positive definite"),
            "{e}"
        );
        let nan = Matrix::new(2, 2, vec![f64::NAN, 0.0, 0.0, 1.0]);
        assert!(ridge(&nan, &nan, 1e-3).is_err());
    }
}
