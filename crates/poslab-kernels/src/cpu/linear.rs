//! A linear layer as one node: `y = x Wᵀ + b` by gemm directly, with a backward that computes
//! `dx = g W`, `dW = gᵀ x` and `db = sum g` by gemm and a fused column sum.
//!
//! Through candle's matmul a linear layer is a transposed view of `W`, a matrix multiply, a
//! broadcast and an add, each a node whose gradient is accumulated into a fresh zeroed tensor,
//! and the transposed gradient of `W` is added element by element through strides. Here it is
//! one node, and the strides are gemm's.

use candle::backend::BackendStorage;
use candle::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use gemm::Parallelism;
use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::{best_rate, contiguous, timing_operand, written, zeros, Real};

/// gemm's parallelism for an `m x n x k` product: every thread candle would use, for products
/// big enough to share.
pub(super) fn parallelism(m: usize, n: usize, k: usize) -> Parallelism {
    threads_for(rayon::current_num_threads(), m * n * k)
}

/// gemm's parallelism with `threads` threads for `work` multiply-adds. gemm splits the output
/// into blocks, never the inner dimension, so the result does not depend on the choice.
fn threads_for(threads: usize, work: usize) -> Parallelism {
    if threads > 1 && work >= 1 << 18 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    }
}

/// `dst (m x n) = [dst +] lhs (m x k) · rhs (k x n)`, every operand given by its pointer and its
/// row and column strides.
///
/// # Safety
/// Every pointer must be valid for the `(rows, cols, strides)` it is given with.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn matmul<T: Real>(
    (m, n, k): (usize, usize, usize),
    dst: *mut T,
    (dst_rs, dst_cs): (isize, isize),
    accumulate: bool,
    lhs: *const T,
    (lhs_rs, lhs_cs): (isize, isize),
    rhs: *const T,
    (rhs_rs, rhs_cs): (isize, isize),
    scale: T,
    parallelism: Parallelism,
) {
    gemm::gemm(
        m,
        n,
        k,
        dst,
        dst_cs,
        dst_rs,
        accumulate,
        lhs,
        lhs_cs,
        lhs_rs,
        rhs,
        rhs_cs,
        rhs_rs,
        T::one(),
        scale,
        false,
        false,
        false,
        parallelism,
    )
}

/// Whether gemm computes an `m x n x k` product with its plain kernels over one depth block
/// (more than 256 outputs, depth 3 to 256, neither side a single row or column): each value
/// then summed from zero by fused multiply-adds in order of `k`, and scaled. Loops that sum in
/// that order reproduce gemm's bits exactly there (and not always elsewhere: gemm's kernels
/// for small products sum in another order).
pub(super) fn gemm_sums_in_order((m, n, k): (usize, usize, usize)) -> bool {
    m * n > 256 && m > 1 && n > 1 && (3..=256).contains(&k)
}

/// `y = x Wᵀ (+ b)`: `x` `(n, in)`, `W` `(out, in)`, `b` `(out)`.
fn forward<T: Real>(
    x: &[T],
    w: &[T],
    b: Option<&[T]>,
    rows: usize,
    inp: usize,
    out: usize,
) -> Vec<T> {
    match b {
        Some(b) => linear_out(x, w, b, (rows, inp, out)),
        None => {
            let mut y = zeros(rows * out);
            forward_into(x, w, None, (rows, inp, out), &mut y, false);
            y
        }
    }
}

/// `x Wᵀ + b`, `(n, out)`: the bias rows are written first (no zero fill) and gemm adds the
/// product onto them.
pub(super) fn linear_out<T: Real>(
    x: &[T],
    w: &[T],
    b: &[T],
    (rows, inp, out): (usize, usize, usize),
) -> Vec<T> {
    assert_eq!(b.len(), out, "linear: bias length");
    // SAFETY: each row is zipped with the bias, of the row's length.
    let mut y = unsafe {
        rows_from(rows, out, |_, row| {
            for (o, v) in row.iter_mut().zip(b) {
                o.write(*v);
            }
        })
    };
    forward_into(x, w, None, (rows, inp, out), &mut y, true);
    y
}

/// `x Wᵀ` `(n, out)` without a bias, written by gemm with no fill first: for a consumer that
/// adds the bias itself as it reads the rows. Where [`gemm_sums_in_order`] holds, gemm sums each
/// value from zero and then adds it onto what the row held, so `fl(product + b)` computed by the
/// consumer has the bits [`linear_out`] gives.
pub(super) fn linear_product<T: Real>(
    x: &[T],
    w: &[T],
    (rows, inp, out): (usize, usize, usize),
) -> Vec<T> {
    assert!(
        x.len() == rows * inp && w.len() == out * inp,
        "linear: operand sizes"
    );
    // SAFETY: gemm writes all of y (rows x out) without reading it (no accumulation).
    unsafe { written(rows * out, |y| forward_at(x, w, (rows, inp, out), y, false)) }
}

/// A `(rows, width)` buffer whose every row `fill(i, row)` writes, filled in parallel and
/// without zeroing it first.
///
/// # Safety
/// `fill` must write every element of the row it is given.
pub(super) unsafe fn rows_from<T: Real>(
    rows: usize,
    width: usize,
    fill: impl Fn(usize, &mut [MaybeUninit<T>]) + Sync,
) -> Vec<T> {
    let len = rows * width;
    let mut y: Vec<T> = Vec::with_capacity(len);
    if len > 0 {
        let per_task = (ROWS_TASK_VALUES / width).max(1);
        y.spare_capacity_mut()[..len]
            .par_chunks_mut(per_task * width)
            .enumerate()
            .for_each(|(c, chunk)| {
                for (i, row) in chunk.chunks_exact_mut(width).enumerate() {
                    fill(c * per_task + i, row);
                }
            });
    }
    // SAFETY: the chunks cover all `len` elements and `fill` writes every element of its row.
    unsafe { y.set_len(len) };
    y
}

/// Values per parallel task when filling rows.
const ROWS_TASK_VALUES: usize = 1 << 15;

/// `res + m ⊙ (x Wᵀ + b)` (`m` absent: 1), `(n, out)`: a residual branch and its sum in one
/// buffer. Without a mask the sum `res + b` is written first and gemm accumulates onto it.
pub(super) fn residual_linear<T: Real>(
    res: &[T],
    x: &[T],
    w: &[T],
    b: &[T],
    dims: (usize, usize, usize),
    mask: Option<&[T]>,
) -> Vec<T> {
    let (rows, _, out) = dims;
    debug_assert_eq!(res.len(), rows * out);
    match mask {
        None => {
            assert_eq!(b.len(), out, "linear: bias length");
            // SAFETY: each row is zipped with a residual row and the bias, both of its length.
            let mut y = unsafe {
                rows_from(rows, out, |i, row| {
                    for ((o, a), c) in row.iter_mut().zip(&res[i * out..(i + 1) * out]).zip(b) {
                        o.write(*a + *c);
                    }
                })
            };
            forward_into(x, w, None, dims, &mut y, true);
            y
        }
        Some(m) => {
            let mut y = linear_out(x, w, b, dims);
            y.par_chunks_mut(1 << 14)
                .zip(m.par_chunks(1 << 14).zip(res.par_chunks(1 << 14)))
                .for_each(|(y, (m, r))| {
                    for ((v, k), a) in y.iter_mut().zip(m).zip(r) {
                        *v = *a + *v * *k;
                    }
                });
            y
        }
    }
}

/// `y = x Wᵀ (+ b)` into `y` `(n, out)`: `x` `(n, in)`, `W` `(out, in)`, `b` `(out)`.
/// With `accumulate`, and no bias, `y += x Wᵀ`.
pub(super) fn forward_into<T: Real>(
    x: &[T],
    w: &[T],
    b: Option<&[T]>,
    (rows, inp, out): (usize, usize, usize),
    y: &mut [T],
    accumulate: bool,
) {
    debug_assert!(x.len() == rows * inp && w.len() == out * inp && y.len() == rows * out);
    debug_assert!(
        !(accumulate && b.is_some()),
        "a bias overwrites what would be accumulated"
    );
    if let Some(b) = b {
        for row in y.chunks_exact_mut(out) {
            row.copy_from_slice(b);
        }
    }
    // SAFETY: y holds rows x out values, initialised.
    unsafe {
        forward_at(
            x,
            w,
            (rows, inp, out),
            y.as_mut_ptr(),
            b.is_some() || accumulate,
        )
    };
}

/// `y [+]= x Wᵀ` at `y` `(n, out)`.
///
/// # Safety
/// `y` must be valid for `rows x out` values (initialised when `accumulate`).
unsafe fn forward_at<T: Real>(
    x: &[T],
    w: &[T],
    (rows, inp, out): (usize, usize, usize),
    y: *mut T,
    accumulate: bool,
) {
    debug_assert!(x.len() == rows * inp && w.len() == out * inp);
    // SAFETY: y rows x out (per the contract), x rows x in, W out x in (read as its transpose
    // through strides).
    unsafe {
        matmul(
            (rows, out, inp),
            y,
            (out as isize, 1),
            accumulate,
            x.as_ptr(),
            (inp as isize, 1),
            w.as_ptr(),
            (1, inp as isize),
            T::one(),
            parallelism(rows, out, inp),
        )
    };
}

/// `dx [+]= g W`: `g` `(n, out)`, `W` `(out, in)`, `dx` `(n, in)`.
pub(super) fn grad_input<T: Real>(
    g: &[T],
    w: &[T],
    (rows, out, inp): (usize, usize, usize),
    dx: &mut [T],
    accumulate: bool,
) {
    debug_assert!(dx.len() == rows * inp);
    // SAFETY: dx holds rows x in values.
    unsafe { grad_input_at(g, w, (rows, out, inp), dx.as_mut_ptr(), accumulate) }
}

/// [`grad_input`] into a new buffer, written without being zeroed first.
pub(super) fn grad_input_of<T: Real>(g: &[T], w: &[T], dims: (usize, usize, usize)) -> Vec<T> {
    // SAFETY: gemm writes all of dx (rows x in) when it does not accumulate, reading none of it.
    unsafe { written(dims.0 * dims.2, |dx| grad_input_at(g, w, dims, dx, false)) }
}

/// # Safety
/// `dx` must be valid for `rows x in` values (initialised when `accumulate`).
unsafe fn grad_input_at<T: Real>(
    g: &[T],
    w: &[T],
    (rows, out, inp): (usize, usize, usize),
    dx: *mut T,
    accumulate: bool,
) {
    debug_assert!(g.len() == rows * out && w.len() == out * inp);
    // SAFETY: dx rows x in (per the contract), g rows x out, W out x in.
    unsafe {
        matmul(
            (rows, inp, out),
            dx,
            (inp as isize, 1),
            accumulate,
            g.as_ptr(),
            (out as isize, 1),
            w.as_ptr(),
            (inp as isize, 1),
            T::one(),
            parallelism(rows, inp, out),
        )
    };
}

/// `dW = gᵀ x`: `g` `(n, out)`, `x` `(n, in)`, `dW` `(out, in)`.
pub(super) fn grad_weight<T: Real>(
    g: &[T],
    x: &[T],
    (rows, out, inp): (usize, usize, usize),
    dw: &mut [T],
) {
    debug_assert!(g.len() == rows * out && x.len() == rows * inp && dw.len() == out * inp);
    // SAFETY (both products): dW out x in, g rows x out read as its transpose, x rows x in.
    let product = |g: &[T], x: &[T], rows: usize, dw: &mut [T], threads: usize| unsafe {
        matmul(
            (out, inp, rows),
            dw.as_mut_ptr(),
            (inp as isize, 1),
            false,
            g.as_ptr(),
            (1, out as isize),
            x.as_ptr(),
            (inp as isize, 1),
            T::one(),
            threads_for(threads, out * inp * rows),
        )
    };
    if rows < SPLIT_ROWS {
        product(g, x, rows, dw, rayon::current_num_threads());
        return;
    }
    // A long inner dimension (every token) and a small output: gemm, which parallelises over
    // the output only, keeps both cores busy better as two half-sums computed side by side
    // (measured 136 -> 160 GFLOP/s for 256 x 256 x 4096, 135 -> 185 for 768 x 256 x 4096).
    // The split is fixed, so the result does not depend on the thread count.
    let half = rows / 2;
    let threads = (rayon::current_num_threads() / 2).max(1);
    let mut second = zeros(out * inp);
    rayon::join(
        || product(&g[..half * out], &x[..half * inp], half, dw, threads),
        || {
            product(
                &g[half * out..],
                &x[half * inp..],
                rows - half,
                &mut second,
                threads,
            )
        },
    );
    dw.par_chunks_mut(1 << 14)
        .zip(second.par_chunks(1 << 14))
        .for_each(|(d, s)| {
            for (d, s) in d.iter_mut().zip(s) {
                *d += *s;
            }
        });
}

/// Rows from which a weight gradient is computed as two half-sums.
const SPLIT_ROWS: usize = 512;

/// `db = sum over the rows of g` (`db.len()` columns), in fixed chunks of rows added in a fixed
/// order, so the result does not depend on the thread count.
pub(super) fn column_sum<T: Real>(g: &[T], db: &mut [T]) {
    let cols = db.len();
    let chunk = SUM_CHUNK_ROWS * cols;
    let mut partials = vec![T::zero(); g.len().div_ceil(chunk) * cols];
    g.par_chunks(chunk)
        .zip(partials.par_chunks_mut(cols))
        .for_each(|(rows, sums)| column_partial(rows, sums));
    add_partials(&partials, db);
}

/// Adds the column sums of one chunk of [`column_sum`]'s to `sums` (zeros): its rows of
/// `sums.len()` added in order.
pub(super) fn column_partial<T: Real>(chunk: &[T], sums: &mut [T]) {
    for row in chunk.chunks_exact(sums.len()) {
        for (a, v) in sums.iter_mut().zip(row) {
            *a += *v;
        }
    }
}

/// `total` = the chunks' sums (`partials`, one after another, each `total.len()` long) added in
/// order from zero: [`column_sum`]'s last step. The partials sit in one buffer, allocated before
/// the pass, rather than one allocation per chunk in the middle of it (which split freed large
/// buffers: the paper shape's training peak grew by 1-2 MiB).
pub(super) fn add_partials<T: Real>(partials: &[T], total: &mut [T]) {
    total.fill(T::zero());
    for p in partials.chunks_exact(total.len()) {
        for (t, v) in total.iter_mut().zip(p) {
            *t += *v;
        }
    }
}

fn dims2(l: &Layout, what: &str) -> Result<(usize, usize)> {
    match l.dims() {
        [r, c] => Ok((*r, *c)),
        d => candle::bail!("fused linear: {what} must be 2-D, got {d:?}"),
    }
}

/// With a bias: `(x, W, b) -> y`.
pub(super) struct Linear;
/// Without: `(x, W) -> y`.
pub(super) struct LinearNoBias;

/// Runs `$body` with `$t` the element type of `$dtype` (f32 or f64) and wraps the `Vec` it
/// returns as CPU storage; other dtypes are an error naming `$what`.
macro_rules! by_dtype {
    ($dtype:expr, $what:expr, |$t:ident| $body:expr) => {
        match $dtype {
            candle::DType::F32 => {
                type $t = f32;
                <$t as candle::WithDType>::to_cpu_storage_owned($body)
            }
            candle::DType::F64 => {
                type $t = f64;
                <$t as candle::WithDType>::to_cpu_storage_owned($body)
            }
            dt => return Err($crate::cpu::unsupported($what, dt)),
        }
    };
}
pub(super) use by_dtype;

impl CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        "poslab-linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let ((rows, inp), (out, w_in)) = (dims2(l1, "x")?, dims2(l2, "W")?);
        if w_in != inp || l3.dims() != [out] {
            candle::bail!("fused linear: x {:?}, W {:?} and b {:?} do not fit (x (n, in), W (out, in), b (out))", l1.dims(), l2.dims(), l3.dims());
        }
        let storage = by_dtype!(s1.dtype(), "linear", |T| forward::<T>(
            contiguous(s1, l1, "linear")?,
            contiguous(s2, l2, "linear")?,
            Some(contiguous(s3, l3, "linear")?),
            rows,
            inp,
            out
        ));
        Ok((storage, Shape::from((rows, out))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = g.contiguous()?;
        Ok((
            Some(g.apply_op2_no_bwd(w, &GradInput)?),
            Some(g.apply_op2_no_bwd(x, &GradWeight)?),
            Some(g.apply_op1_no_bwd(&ColumnSum)?),
        ))
    }
}

impl CustomOp2 for LinearNoBias {
    fn name(&self) -> &'static str {
        "poslab-linear-no-bias"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let ((rows, inp), (out, w_in)) = (dims2(l1, "x")?, dims2(l2, "W")?);
        if w_in != inp {
            candle::bail!(
                "fused linear: x {:?} and W {:?} do not fit (x (n, in), W (out, in))",
                l1.dims(),
                l2.dims()
            );
        }
        let storage = by_dtype!(s1.dtype(), "linear", |T| forward::<T>(
            contiguous(s1, l1, "linear")?,
            contiguous(s2, l2, "linear")?,
            None,
            rows,
            inp,
            out
        ));
        Ok((storage, Shape::from((rows, out))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = g.contiguous()?;
        Ok((
            Some(g.apply_op2_no_bwd(w, &GradInput)?),
            Some(g.apply_op2_no_bwd(x, &GradWeight)?),
        ))
    }
}

/// `dx = g W`: `g` `(n, out)`, `W` `(out, in)`.
struct GradInput;

impl CustomOp2 for GradInput {
    fn name(&self) -> &'static str {
        "poslab-linear-grad-input"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let ((rows, out), (_, inp)) = (dims2(l1, "g")?, dims2(l2, "W")?);
        fn run<T: Real>(g: &[T], w: &[T], rows: usize, out: usize, inp: usize) -> Vec<T> {
            grad_input_of(g, w, (rows, out, inp))
        }
        let what = "linear backward";
        let storage = by_dtype!(s1.dtype(), what, |T| run::<T>(
            contiguous(s1, l1, what)?,
            contiguous(s2, l2, what)?,
            rows,
            out,
            inp
        ));
        Ok((storage, Shape::from((rows, inp))))
    }
}

/// `dW = gᵀ x`: `g` `(n, out)`, `x` `(n, in)`.
struct GradWeight;

impl CustomOp2 for GradWeight {
    fn name(&self) -> &'static str {
        "poslab-linear-grad-weight"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let ((rows, out), (_, inp)) = (dims2(l1, "g")?, dims2(l2, "x")?);
        fn run<T: Real>(g: &[T], x: &[T], rows: usize, out: usize, inp: usize) -> Vec<T> {
            let mut dw = zeros(out * inp);
            grad_weight(g, x, (rows, out, inp), &mut dw);
            dw
        }
        let what = "linear backward";
        let storage = by_dtype!(s1.dtype(), what, |T| run::<T>(
            contiguous(s1, l1, what)?,
            contiguous(s2, l2, what)?,
            rows,
            out,
            inp
        ));
        Ok((storage, Shape::from((out, inp))))
    }
}

/// Rows per chunk of a column sum: fixed, so the order of additions does not depend on the
/// thread count.
pub(super) const SUM_CHUNK_ROWS: usize = 64;

/// `db = sum over rows of g`.
struct ColumnSum;

impl candle::CustomOp1 for ColumnSum {
    fn name(&self) -> &'static str {
        "poslab-column-sum"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, cols) = dims2(l, "g")?;
        fn run<T: Real>(g: &[T], cols: usize) -> Vec<T> {
            let mut total = vec![T::zero(); cols];
            column_sum(g, &mut total);
            total
        }
        let storage = by_dtype!(s.dtype(), "column sum", |T| run::<T>(
            contiguous(s, l, "column sum")?,
            cols
        ));
        Ok((storage, Shape::from(cols)))
    }
}

/// `x Wᵀ + b` on the last axis of `x`, fused (CPU, f32/f64).
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let inp = *dims.last().unwrap_or(&0);
    let x2 = x.contiguous()?.reshape(((), inp))?;
    let y = match bias {
        Some(b) => x2.apply_op3(&weight.contiguous()?, &b.contiguous()?, Linear)?,
        None => x2.apply_op2(&weight.contiguous()?, LinearNoBias)?,
    };
    let mut out_dims = dims;
    *out_dims.last_mut().expect("x has an axis") = weight.dim(0)?;
    y.reshape(out_dims)
}

/// The best rate, in GFLOP/s, of `reps` f32 products `(m x k) · (k x n)` through the gemm call
/// the fused layers make, on the current rayon pool: the matrix-multiply peak a training step's
/// rate is measured against (`poslab bench`).
pub fn matmul_gflops(m: usize, n: usize, k: usize, reps: usize) -> f64 {
    let (a, b) = (timing_operand(m * k, 1), timing_operand(k * n, 2));
    let mut c = vec![0f32; m * n];
    // c (m x n) = a (m x k) · b (k x n): a linear layer's input gradient is this product.
    let rate = best_rate(2.0 * (m * n * k) as f64 / 1e9, reps, || {
        grad_input(&a, &b, (m, k, n), &mut c, false)
    });
    std::hint::black_box(&c);
    rate
}

/// One of the three matrix products of a linear layer `(rows, in) -> (rows, out)` in a training
/// step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LinearPass {
    /// `y = x Wᵀ`: `rows x out x in`.
    Output,
    /// `dx = g W`: `rows x in x out`.
    InputGradient,
    /// `dW = gᵀ x`: `out x in x rows`, summed over every row.
    WeightGradient,
}

impl LinearPass {
    /// The product's `(m, n, k)`: output rows, output columns, depth.
    pub fn dims(self, (rows, inp, out): (usize, usize, usize)) -> (usize, usize, usize) {
        match self {
            LinearPass::Output => (rows, out, inp),
            LinearPass::InputGradient => (rows, inp, out),
            LinearPass::WeightGradient => (out, inp, rows),
        }
    }
}

/// The best rate, in GFLOP/s, of `reps` runs of one pass of an f32 linear layer `(rows, inp) ->
/// (rows, out)` through the calls the fused layers make, on the current rayon pool: the output
/// onto rows it adds to (a bias or the residual) when `onto`, written fresh otherwise; the input
/// gradient written fresh; the weight gradient as the layer sums it (two half-sums side
/// by side from 512 rows on). `poslab bench --products` sets these against the
/// matrix-multiply peak and against PyTorch's products.
pub fn linear_pass_gflops(
    pass: LinearPass,
    (rows, inp, out): (usize, usize, usize),
    onto: bool,
    reps: usize,
) -> f64 {
    let w = timing_operand(out * inp, 1);
    let (x, g) = (timing_operand(rows * inp, 2), timing_operand(rows * out, 3));
    // What the output adds to, and the weight gradient's own buffer (the layer's is a part of
    // its parameters' gradient, allocated once), made before the clock starts.
    let mut onto_rows = timing_operand(
        if pass == LinearPass::Output && onto {
            rows * out
        } else {
            0
        },
        4,
    );
    let mut dw = zeros(if pass == LinearPass::WeightGradient {
        out * inp
    } else {
        0
    });
    let rate = best_rate(2.0 * (rows * inp * out) as f64 / 1e9, reps, || match pass {
        LinearPass::Output if onto => {
            forward_into(&x, &w, None, (rows, inp, out), &mut onto_rows, true)
        }
        LinearPass::Output => {
            std::hint::black_box(linear_product(&x, &w, (rows, inp, out)));
        }
        LinearPass::InputGradient => {
            std::hint::black_box(grad_input_of(&g, &w, (rows, out, inp)));
        }
        LinearPass::WeightGradient => grad_weight(&g, &x, (rows, out, inp), &mut dw),
    });
    std::hint::black_box((&onto_rows, &dw));
    rate
}
