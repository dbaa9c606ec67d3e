//! Ridge regression for the analyses (a Cholesky solve of the normal equations), in f64.
//!
//! Written here instead of pulling in a linear-algebra crate: the analyses need exactly one
//! solver, for systems no wider than a model's width.

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
        let mut out = vec![0.0; self.rows * other.cols];
        for i in 0..self.rows {
            for k in 0..self.cols {
                let a = self.data[i * self.cols + k];
                if a == 0.0 {
                    continue;
                }
                let row = &other.data[k * other.cols..(k + 1) * other.cols];
                for (o, b) in out[i * other.cols..(i + 1) * other.cols]
                    .iter_mut()
                    .zip(row)
                {
                    *o += a * b;
                }
            }
        }
        Matrix::new(self.rows, other.cols, out)
    }
}

/// The `w` minimising `|x w - y|^2 + lambda |w|^2` (`x`: n x d, `y`: n x m, `w`: d x m).
///
/// `lambda` is scaled by the mean diagonal of `xᵀx`, so it is relative to the data's size. With
/// fewer rows than columns the dual form is solved, `w = xᵀ (x xᵀ + λI)⁻¹ y`, an `n x n` system
/// instead of `d x d` (the same `w`): a 1024-wide table over 128 positions is a 128 x 128 solve,
/// not a 1024 x 1024 one.
pub fn ridge(x: &Matrix, y: &Matrix, lambda: f64) -> Matrix {
    assert_eq!(x.rows, y.rows, "ridge: x and y rows");
    let (n, d, m) = (x.rows, x.cols, y.cols);
    // trace(xᵀx) = trace(x xᵀ) = the sum of squares.
    let trace: f64 = x.data.iter().map(|v| v * v).sum();
    let ridge = lambda * (trace / d.max(1) as f64).max(f64::MIN_POSITIVE);
    if n < d {
        // Dual: (x xᵀ + λI) α = y, then w = xᵀ α.
        let mut k = vec![0.0; n * n];
        for i in 0..n {
            for j in 0..=i {
                let v: f64 = x.row(i).iter().zip(x.row(j)).map(|(a, b)| a * b).sum();
                k[i * n + j] = v;
                k[j * n + i] = v;
            }
            k[i * n + i] += ridge;
        }
        let alpha = cholesky_solve(k, y.data.clone(), n, m);
        let mut w = vec![0.0; d * m];
        for r in 0..n {
            let (xr, ar) = (x.row(r), &alpha[r * m..(r + 1) * m]);
            for (i, xi) in xr.iter().enumerate() {
                for (wik, ak) in w[i * m..(i + 1) * m].iter_mut().zip(ar) {
                    *wik += xi * ak;
                }
            }
        }
        return Matrix::new(d, m, w);
    }
    // Normal equations: (xᵀx + λI) w = xᵀy.
    let mut a = vec![0.0; d * d];
    let mut b = vec![0.0; d * m];
    for r in 0..n {
        let xr = x.row(r);
        let yr = y.row(r);
        for i in 0..d {
            let xi = xr[i];
            if xi == 0.0 {
                continue;
            }
            for (aij, xj) in a[i * d + i..(i + 1) * d].iter_mut().zip(&xr[i..]) {
                *aij += xi * xj;
            }
            for (bik, yk) in b[i * m..(i + 1) * m].iter_mut().zip(yr) {
                *bik += xi * yk;
            }
        }
    }
    for i in 0..d {
        for j in 0..i {
            a[i * d + j] = a[j * d + i];
        }
        a[i * d + i] += ridge;
    }
    Matrix::new(d, m, cholesky_solve(a, b, d, m))
}

/// Solves `a x = b` for a symmetric positive definite `a` (`d x d`) and `b` (`d x m`), by
/// Cholesky, `a = L Lᵀ`.
pub(crate) fn cholesky_solve(a: Vec<f64>, b: Vec<f64>, d: usize, m: usize) -> Vec<f64> {
    let mut l = vec![0.0; d * d];
    for i in 0..d {
        for j in 0..=i {
            let s: f64 = l[i * d..i * d + j]
                .iter()
                .zip(&l[j * d..j * d + j])
                .map(|(a, b)| a * b)
                .sum();
            if i == j {
                l[i * d + i] = (a[i * d + i] - s).max(1e-300).sqrt();
            } else {
                l[i * d + j] = (a[i * d + j] - s) / l[j * d + j];
            }
        }
    }
    // Solve L z = b, then Lᵀ x = z, for all columns of b at once: row operations, so every
    // inner loop runs over contiguous memory.
    let mut z = b;
    for i in 0..d {
        for k in 0..i {
            let lik = l[i * d + k];
            if lik != 0.0 {
                let (done, rest) = z.split_at_mut(i * m);
                for (zi, zk) in rest[..m].iter_mut().zip(&done[k * m..(k + 1) * m]) {
                    *zi -= lik * zk;
                }
            }
        }
        let inv = 1.0 / l[i * d + i];
        z[i * m..(i + 1) * m].iter_mut().for_each(|v| *v *= inv);
    }
    let mut w = z;
    for i in (0..d).rev() {
        for k in i + 1..d {
            let lki = l[k * d + i];
            if lki != 0.0 {
                let (head, tail) = w.split_at_mut(k * m);
                for (wi, wk) in head[i * m..(i + 1) * m].iter_mut().zip(&tail[..m]) {
                    *wi -= lki * wk;
                }
            }
        }
        let inv = 1.0 / l[i * d + i];
        w[i * m..(i + 1) * m].iter_mut().for_each(|v| *v *= inv);
    }
    w
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
        let dual = ridge(&x, &y, 1e-3); // n < d: dual
                                        // The primal on the same data, with rows padded by zeros so that n >= d (zero rows add
                                        // nothing to xᵀx or xᵀy).
        let mut xp = x.data.clone();
        xp.extend(vec![0.0; (d - n) * d]);
        let mut yp = y.data.clone();
        yp.extend(vec![0.0; (d - n) * m]);
        let primal = ridge(&Matrix::new(d, d, xp), &Matrix::new(d, m, yp), 1e-3);
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
        let got = ridge(&x, &y, 1e-12);
        for (a, b) in got.data.iter().zip(&w.data) {
            assert!((a - b).abs() < 1e-8, "{:?}", got.data);
        }
        // A large ridge shrinks the answer toward zero.
        let shrunk = ridge(&x, &y, 1e3);
        assert!(
            shrunk.data.iter().map(|v| v.abs()).sum::<f64>()
                < 0.1 * w.data.iter().map(|v| v.abs()).sum::<f64>()
        );
        assert_eq!(folds(7, 3), vec![vec![0, 3, 6], vec![1, 4], vec![2, 5]]);
    }
}
