//! Exact (erf) GELU and ReLU, fused, with their backward passes.

use candle::{Result, Tensor};
use rayon::prelude::*;
use std::mem::MaybeUninit;

use super::linear::{add_partials, column_partial, SUM_CHUNK_ROWS};
use super::pointwise::{self, Pointwise, ELEMENTS_PER_TASK};
use super::*;

/// `GELU(x) = x/2 (1 + erf(x/√2))` from `erf(x/√2)`.
#[inline(always)]
fn gelu_of<T: Real>(x: T, erf: T) -> T {
    T::lit(0.5) * x * (T::one() + erf)
}

/// `GELU'(x) = Phi(x) + x phi(x)` from the normal's `(Phi(x), phi(x))`.
#[inline(always)]
fn gelu_slope<T: Real>(x: T, (cdf, pdf): (T, T)) -> T {
    cdf + x * pdf
}

#[inline(always)]
fn gelu_body<T: Real>(x: &[T], y: &mut [MaybeUninit<T>]) {
    let inv_sqrt2 = T::lit(std::f64::consts::FRAC_1_SQRT_2);
    for (o, v) in y.iter_mut().zip(x) {
        o.write(gelu_of(*v, (*v * inv_sqrt2).erf_()));
    }
}
simd_dispatch!(fn gelu_rows = gelu_body(x: &[T], y: &mut [MaybeUninit<T>]));

/// [`gelu_body`] in place.
#[inline(always)]
fn gelu_in_place_body<T: Real>(x: &mut [T]) {
    let inv_sqrt2 = T::lit(std::f64::consts::FRAC_1_SQRT_2);
    for v in x.iter_mut() {
        *v = gelu_of(*v, (*v * inv_sqrt2).erf_());
    }
}
simd_dispatch!(fn gelu_in_place_rows = gelu_in_place_body(x: &mut [T]));

/// `dx = g (Phi(x) + x phi(x))`.
#[inline(always)]
fn gelu_grad_body<T: Real>(x: &[T], g: &[T], dx: &mut [MaybeUninit<T>]) {
    for ((o, v), gi) in dx.iter_mut().zip(x).zip(g) {
        o.write(*gi * gelu_slope(*v, v.normal_cdf_pdf()));
    }
}
simd_dispatch!(fn gelu_grad_rows = gelu_grad_body(x: &[T], g: &[T], dx: &mut [MaybeUninit<T>]));

/// `y = GELU(x)` and `d = GELU'(x) = Phi(x) + x phi(x)` in one pass, with one `erf` and one
/// `exp` for both, `d` written over `x`: `y` has [`gelu_body`]'s bits, and `g d` those of
/// [`gelu_grad_body`].
#[inline(always)]
fn gelu_with_grad_body<T: Real>(x: &mut [T], y: &mut [MaybeUninit<T>]) {
    for (o, xv) in y.iter_mut().zip(x.iter_mut()) {
        let v = *xv;
        let (erf, gauss) = v.erf_gauss();
        o.write(gelu_of(v, erf));
        *xv = gelu_slope(v, cdf_pdf(erf, gauss));
    }
}
simd_dispatch!(fn gelu_with_grad_rows = gelu_with_grad_body(x: &mut [T], y: &mut [MaybeUninit<T>]));

/// Exact GELU as a [`Pointwise`] function.
#[derive(Clone, Copy)]
struct Gelu;

impl Pointwise for Gelu {
    const NAME: &'static str = "gelu";
    fn rows<T: Real>(simd: SimdLevel, x: &[T], y: &mut [MaybeUninit<T>]) {
        gelu_rows(simd, x, y)
    }
    fn grad_rows<T: Real>(simd: SimdLevel, x: &[T], g: &[T], dx: &mut [MaybeUninit<T>]) {
        gelu_grad_rows(simd, x, g, dx)
    }
}

/// Values per task over rows of `width` (whole rows, so that a bias lines up with them).
fn row_chunk(width: usize) -> usize {
    let width = width.max(1);
    (ELEMENTS_PER_TASK / width).max(1) * width
}

/// `x += bias` on every row of a chunk of whole rows of `bias.len()`: `fl(x + b)`, the value
/// gemm writes when it adds a product `x` onto rows holding the bias.
#[inline(always)]
fn add_bias_rows<T: Real>(x: &mut [T], bias: &[T]) {
    for row in x.chunks_exact_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += *b;
        }
    }
}

/// `max(x, 0)`.
#[inline(always)]
fn relu<T: Real>(v: T) -> T {
    if v > T::zero() {
        v
    } else {
        T::zero()
    }
}

/// The feed-forward activation of the fused layer, `act(x + bias)`, `bias` added to each row of
/// its length, or `act(x)`: written over `x`, for a forward with no backward to come (which
/// keeps neither).
pub fn activation_par<T: Real>(
    simd: SimdLevel,
    mut x: Vec<T>,
    bias: Option<&[T]>,
    activation: crate::spec::Act,
) -> Vec<T> {
    let chunk = row_chunk(bias.map_or(1, <[T]>::len));
    x.par_chunks_mut(chunk).for_each(|xc| {
        if let Some(b) = bias {
            add_bias_rows(xc, b);
        }
        match activation {
            crate::spec::Act::Gelu => gelu_in_place_rows(simd, xc),
            crate::spec::Act::Relu => {
                for v in xc.iter_mut() {
                    *v = relu(*v);
                }
            }
        }
    });
    x
}

/// The feed-forward activation `act(x + bias)` (or `act(x)`) and its derivative there, the
/// derivative written over `x` (which the layer needs no more), for a forward whose backward is
/// to come: the backward then multiplies by the derivative ([`times_grad_summed_par`]) instead of
/// recomputing it, with the bits of the pointwise op's backward, and no more memory than keeping
/// `x`. ReLU's derivative is 1 or 0, with candle's convention at 0 (`x >= 0` passes the
/// gradient), so the fused layer and the composition agree everywhere.
pub fn activation_with_grad_par<T: Real>(
    simd: SimdLevel,
    mut x: Vec<T>,
    bias: Option<&[T]>,
    activation: crate::spec::Act,
) -> (Vec<T>, Vec<T>) {
    let (len, chunk) = (x.len(), row_chunk(bias.map_or(1, <[T]>::len)));
    let mut y = Vec::<T>::with_capacity(len);
    y.spare_capacity_mut()[..len]
        .par_chunks_mut(chunk)
        .zip(x.par_chunks_mut(chunk))
        .for_each(|(yc, xc)| {
            if let Some(b) = bias {
                add_bias_rows(xc, b);
            }
            match activation {
                crate::spec::Act::Gelu => gelu_with_grad_rows(simd, xc, yc),
                crate::spec::Act::Relu => {
                    for (o, xv) in yc.iter_mut().zip(xc.iter_mut()) {
                        let v = *xv;
                        o.write(relu(v));
                        *xv = if v >= T::zero() { T::one() } else { T::zero() };
                    }
                }
            }
        });
    // SAFETY: the chunks together cover all `len` values, and each writes all of its own.
    unsafe { y.set_len(len) };
    (y, x)
}

/// `g act'(x)` for one chunk, from the derivative [`activation_with_grad_par`] kept: `g d` for
/// GELU, and for ReLU `g` where `d` is 1 and 0 elsewhere.
#[inline(always)]
fn times_grad_chunk<T: Real>(d: &[T], g: &[T], relu: bool, o: &mut [MaybeUninit<T>]) {
    for ((o, dv), gi) in o.iter_mut().zip(d).zip(g) {
        o.write(match relu {
            true if *dv == T::zero() => T::zero(),
            true => *gi,
            false => *gi * *dv,
        });
    }
}

/// `g act'(x)` from the derivative [`activation_with_grad_par`] kept, and its column sums
/// (`db.len()` columns) written into `db` with the bits of `linear::column_sum`: each chunk of rows summed right after it is written, while it is in the
/// cache, instead of in a second pass over the whole result.
pub fn times_grad_summed_par<T: Real>(
    d: &[T],
    g: &[T],
    activation: crate::spec::Act,
    db: &mut [T],
) -> Vec<T> {
    let relu = activation == crate::spec::Act::Relu;
    let (len, cols) = (d.len(), db.len());
    assert!(
        cols > 0 && len % cols == 0 && g.len() == len,
        "rows of {cols}"
    );
    // SAFETY: each chunk of the result is written in full before its sums are taken.
    let (out, partials) = unsafe {
        par_written_parts(len, SUM_CHUNK_ROWS * cols, cols, |r, o, sums| {
            times_grad_chunk(&d[r.clone()], &g[r], relu, o);
            column_partial(assume_written(o), sums)
        })
    };
    add_partials(&partials, db);
    out
}

/// Exact GELU, fused.
pub fn gelu(x: &Tensor, simd: SimdLevel) -> Result<Tensor> {
    pointwise::apply::<Gelu>(x, simd)
}

#[cfg(test)]
mod tests {
    use super::super::linear::column_sum;
    use super::*;
    use crate::spec::Act as Activation;

    /// `g act'(x)` through the fused pass, its column sums (`cols` of them) checked against
    /// [`column_sum`]'s of the result, bit for bit.
    fn times_grad<T: Real>(d: &[T], g: &[T], act: Activation, cols: usize) -> Vec<T> {
        let mut db = vec![T::zero(); cols];
        let dx = times_grad_summed_par(d, g, act, &mut db);
        let mut want = vec![T::lit(7.0); cols];
        column_sum(&dx, &mut want);
        assert_eq!(bits(&db), bits(&want), "{act:?}: column sums of {cols}");
        dx
    }

    /// Values across GELU's range: both signs, zeros, the tails where `erf` saturates and the
    /// density underflows, and every width of a ragged last chunk.
    fn inputs<T: Real>() -> Vec<T> {
        let mut x: Vec<T> = (0..3 * ELEMENTS_PER_TASK + 37)
            .map(|i| T::lit(((i * 7_919) % 20_001) as f64 / 1_000.0 - 10.0))
            .collect();
        for (i, v) in [0.0, -0.0, 1e-30, -1e-30, 40.0, -40.0, 1e30, -1e30]
            .iter()
            .enumerate()
        {
            x[i * 5] = T::lit(*v);
        }
        x
    }

    fn bits<T: Real>(v: &[T]) -> Vec<u64> {
        v.iter().map(|x| WithDType::to_f64(*x).to_bits()).collect()
    }

    fn same_bits<T: Real>() {
        let x = inputs::<T>();
        let g: Vec<T> = x
            .iter()
            .rev()
            .map(|v| *v * T::lit(0.37) - T::lit(0.5))
            .collect();
        // A bias of 37 per row, over the rows that fit.
        let width = 37;
        let rows = x.len() / width;
        let bias: Vec<T> = (0..width).map(|j| T::lit(j as f64 * 0.25 - 4.0)).collect();
        let xr = &x[..rows * width];
        let biased: Vec<T> = xr
            .chunks_exact(width)
            .flat_map(|row| row.iter().zip(&bias).map(|(v, b)| *v + *b))
            .collect();
        let relu_of = |x: &[T]| -> Vec<T> { x.iter().map(|v| relu(*v)).collect() };
        for level in [SimdLevel::Baseline, SimdLevel::Avx2, SimdLevel::Avx512] {
            // GELU: the pointwise op's forward and backward.
            let (y, d) = activation_with_grad_par(level, x.clone(), None, Activation::Gelu);
            let want_y = pointwise::forward_par::<Gelu, T>(level, &x);
            let want_dx = pointwise::grad_par::<Gelu, T>(level, &x, &g);
            let dx = times_grad(&d, &g, Activation::Gelu, 1);
            assert_eq!(bits(&y), bits(&want_y), "GELU forward at {level:?}");
            assert_eq!(bits(&dx), bits(&want_dx), "GELU backward at {level:?}");
            assert!(want_dx.iter().any(|v| *v != T::zero()));
            let y = activation_par(level, x.clone(), None, Activation::Gelu);
            assert_eq!(bits(&y), bits(&want_y), "GELU forward alone at {level:?}");
            // ReLU: max(x, 0), and g where x >= 0 (candle's convention at 0).
            let (y, d) = activation_with_grad_par(level, x.clone(), None, Activation::Relu);
            assert_eq!(bits(&y), bits(&relu_of(&x)), "ReLU forward at {level:?}");
            let y = activation_par(level, x.clone(), None, Activation::Relu);
            assert_eq!(
                bits(&y),
                bits(&relu_of(&x)),
                "ReLU forward alone at {level:?}"
            );
            let dx = times_grad(&d, &g, Activation::Relu, 1);
            for ((xv, gv), got) in x.iter().zip(&g).zip(&dx) {
                let want = if *xv >= T::zero() { *gv } else { T::zero() };
                assert_eq!(
                    bits(&[*got]),
                    bits(&[want]),
                    "ReLU backward at x = {}",
                    WithDType::to_f64(*xv)
                );
            }
            // The bias added in the pass: the bits of the activation of x + bias, added first.
            for act in [Activation::Gelu, Activation::Relu] {
                let (y, d) = activation_with_grad_par(level, xr.to_vec(), Some(&bias), act);
                let (want_y, want_d) = activation_with_grad_par(level, biased.clone(), None, act);
                assert_eq!(bits(&y), bits(&want_y), "{act:?} with a bias at {level:?}");
                assert_eq!(bits(&d), bits(&want_d), "{act:?}' with a bias at {level:?}");
                let y = activation_par(level, xr.to_vec(), Some(&bias), act);
                assert_eq!(
                    bits(&y),
                    bits(&want_y),
                    "{act:?} alone with a bias at {level:?}"
                );
                // and the bias's gradient, summed in the backward's pass
                let dx = times_grad(&d, &g[..rows * width], act, width);
                assert!(dx.iter().any(|v| *v != T::zero()));
            }
        }
    }

    #[test]
    fn the_kept_derivative_gives_the_pointwise_ops_bits_forward_and_backward() {
        same_bits::<f32>();
        same_bits::<f64>();
    }
}
