//! Ridge regression for the analyses (a Cholesky solve of the normal equations), in f64.
//!
//! Written here instead of pulling in a linear-algebra crate: the analyses need exactly one
//! solver, for systems no wider than a model's width.

/// A row-major matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f64>,
}

impl Matrix {
    pub fn new(rows: usize, cols: usize, data: Vec<f64>) -> Self {
        assert_eq!(data.len(), rows * cols, "matrix data");
        Self { rows, cols, data }
    }

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
/// `lambda` is scaled by the mean diagonal of `xᵀx`, so it is relative to the data's size.
pub fn ridge(x: &Matrix, y: &Matrix, lambda: f64) -> Matrix {
    assert_eq!(x.rows, y.rows, "ridge: x and y rows");
    let d = x.cols;
    // Normal equations: (xᵀx + λI) w = xᵀy.
    let mut a = vec![0.0; d * d];
    let mut b = vec![0.0; d * y.cols];
    for r in 0..x.rows {
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
            for (bik, yk) in b[i * y.cols..(i + 1) * y.cols].iter_mut().zip(yr) {
                *bik += xi * yk;
            }
        }
    }
    for i in 0..d {
        for j in 0..i {
            a[i * d + j] = a[j * d + i];
        }
    }
    let mean_diag = (0..d).map(|i| a[i * d + i]).sum::<f64>() / d.max(1) as f64;
    let ridge = lambda * mean_diag.max(f64::MIN_POSITIVE);
    for i in 0..d {
        a[i * d + i] += ridge;
    }
    // Cholesky: a = L Lᵀ (positive definite thanks to the ridge).
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
    // Solve L z = b, then Lᵀ w = z, for all columns of b at once: row operations, so every
    // inner loop runs over contiguous memory.
    let m = y.cols;
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
    Matrix::new(d, m, w)
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
