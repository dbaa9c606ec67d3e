//! Fused CPU kernels with hand-written backward passes: LayerNorm, softmax with a key-padding
//! bias, exact GELU and RoPE.
//!
//! Each is a candle custom op whose `bwd` returns the exact gradient, itself computed by a fused
//! kernel, so training through them is as correct as through the compositions in [`super::ops`]
//! (which the tests compare them with, forward and backward, in f32 and f64) and much faster: one
//! pass over memory instead of a dozen temporary tensors. They run on the CPU in f32 and f64;
//! other devices and dtypes use the compositions.
//!
//! Every kernel works a row at a time, each row on one thread, and sums across rows (the
//! LayerNorm parameter gradients) over fixed chunks in a fixed order, so results do not depend
//! on the number of threads. Inner loops are written to auto-vectorise and compiled again for
//! AVX2 and AVX-512, chosen at run time.

use candle::backend::BackendStorage;
use candle::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType,
};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use rayon::prelude::*;

/// The numbers the kernels run on.
pub(crate) trait Real:
    num_traits::Float + WithDType + std::ops::AddAssign + std::ops::MulAssign + Send + Sync + 'static
{
    fn erf_(self) -> Self;
    /// `e^x`, exactly 0 below the smallest normal result.
    fn exp_(self) -> Self;
    fn lit(v: f64) -> Self;
    /// The standard normal's `(Phi(x), phi(x))`: GELU's CDF and density.
    fn normal_cdf_pdf(self) -> (Self, Self);
}

const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

impl Real for f64 {
    fn erf_(self) -> Self {
        libm::erf(self)
    }
    fn exp_(self) -> Self {
        self.exp()
    }
    fn lit(v: f64) -> Self {
        v
    }
    fn normal_cdf_pdf(self) -> (Self, Self) {
        let cdf = 0.5 * (1.0 + libm::erf(self * std::f64::consts::FRAC_1_SQRT_2));
        (cdf, INV_SQRT_2PI * (-0.5 * self * self).exp())
    }
}

impl Real for f32 {
    #[inline(always)]
    fn erf_(self) -> Self {
        erf_f32(self)
    }
    #[inline(always)]
    fn exp_(self) -> Self {
        exp_f32(self)
    }
    #[inline(always)]
    fn lit(v: f64) -> Self {
        v as f32
    }
    /// One `exp` for both: the `exp(-a²)` of `erf(a)`, `a = x/√2`, is the density's `exp(-x²/2)`.
    #[inline(always)]
    fn normal_cdf_pdf(self) -> (Self, Self) {
        let a = self.abs() * std::f32::consts::FRAC_1_SQRT_2;
        let e = exp_f32(-a * a);
        let erf_abs = 1.0 - erf_poly(a) * e;
        let erf = erf_abs.copysign(self);
        (0.5 * (1.0 + erf), INV_SQRT_2PI as f32 * e)
    }
}

/// `e^x` in f32 to about 1 ulp: Cody-Waite range reduction and a degree-6 polynomial
/// (Cephes' `expf` coefficients), branch-free so loops of it vectorise; 0 below -87.3.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(-87.3, 88.3);
    let n = (xc * LOG2E + 0.5).floor();
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2^n from the exponent bits. n + 127 is an integer in [1, 254]: adding 2^23 puts it in
    // the low mantissa bits, read out without a float-to-int conversion (Rust's saturating
    // `as` does not vectorise).
    let biased = (n + (127.0 + 8_388_608.0)).to_bits() & 0xff;
    let scale = f32::from_bits(biased << 23);
    if x < -87.3 {
        0.0
    } else {
        y * scale
    }
}

/// `erf(x)` in f32 with an absolute error below 1.5e-7 (Abramowitz & Stegun 7.1.26, the form
/// PyTorch's vectorised CPU `erf` uses).
#[inline(always)]
pub(crate) fn erf_f32(x: f32) -> f32 {
    let a = x.abs();
    let y = 1.0 - erf_poly(a) * exp_f32(-a * a);
    y.copysign(x)
}

/// The polynomial of Abramowitz & Stegun 7.1.26: `erf(a) = 1 - poly(a) e^(-a²)` for `a >= 0`.
#[inline(always)]
fn erf_poly(a: f32) -> f32 {
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    ((((1.061_405_4 * t - 1.453_152) * t + 1.421_413_8) * t - 0.284_496_74) * t + 0.254_829_6) * t
}

/// The instruction sets the fused kernels may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimdLevel {
    /// The build's baseline target (SSE2 on x86-64).
    Baseline,
    /// AVX2 and FMA.
    Avx2,
    /// AVX-512 (F and VL).
    Avx512,
}

impl SimdLevel {
    /// The level's name: `baseline`, `avx2` or `avx512`.
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Baseline => "baseline",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
        }
    }

    /// The best level this CPU supports (checked at run time).
    pub fn detected() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512vl")
                && std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return SimdLevel::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return SimdLevel::Avx2;
            }
        }
        SimdLevel::Baseline
    }
}

/// A cap on the level the kernels use (`u8::MAX`: none): how the tests run the AVX2 and
/// baseline code on an AVX-512 machine. The same source compiled for each level gives the same
/// bits (Rust never fuses a multiply and an add on its own), so the cap changes speed only.
static SIMD_CAP: AtomicU8 = AtomicU8::new(u8::MAX);

/// Caps the instruction sets the fused kernels use, process-wide (gemm's own dispatch is not
/// affected). `None` lifts the cap.
pub fn cap_simd(level: Option<SimdLevel>) {
    SIMD_CAP.store(level.map_or(u8::MAX, |l| l as u8), Ordering::Relaxed);
}

/// The level the fused kernels run at: the detected one, under the cap.
pub fn simd_level() -> SimdLevel {
    static DETECTED: OnceLock<SimdLevel> = OnceLock::new();
    let detected = *DETECTED.get_or_init(SimdLevel::detected);
    match SIMD_CAP.load(Ordering::Relaxed) {
        0 => SimdLevel::Baseline,
        1 => detected.min(SimdLevel::Avx2),
        _ => detected,
    }
}

/// Defines `$name`, which runs `$body` compiled for AVX-512 or AVX2 + FMA when the CPU has them
/// (checked at run time, see [`simd_level`]) and for the baseline target otherwise.
macro_rules! simd_dispatch {
    ($vis:vis fn $name:ident = $body:ident ($($arg:ident : $ty:ty),* $(,)?)) => {
        $vis fn $name<T: Real>($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
                unsafe fn wide<T: Real>($($arg: $ty),*) {
                    $body::<T>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn narrow<T: Real>($($arg: $ty),*) {
                    $body::<T>($($arg),*)
                }
                match $crate::nn::fused::simd_level() {
                    // SAFETY: the CPU has the features `wide` is compiled for.
                    $crate::nn::fused::SimdLevel::Avx512 => return unsafe { wide::<T>($($arg),*) },
                    // SAFETY: the CPU has the features `narrow` is compiled for.
                    $crate::nn::fused::SimdLevel::Avx2 => return unsafe { narrow::<T>($($arg),*) },
                    $crate::nn::fused::SimdLevel::Baseline => {}
                }
            }
            $body::<T>($($arg),*)
        }
    };
}

mod adamw;
mod attention;
mod differences;
mod layer;
mod linear;

pub(crate) use differences::sided_differences;
use linear::by_dtype;

pub(crate) use adamw::adamw_step;
pub(crate) use attention::{attention, Attention};
pub(crate) use layer::{LayerMasks, LayerShape};
pub(crate) use linear::linear;

/// A sum in 16 independent lanes, so it vectorises (a single accumulator would not).
#[inline(always)]
fn sum<T: Real>(x: &[T]) -> T {
    let mut acc = [T::zero(); 16];
    let chunks = x.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..16 {
            acc[i] += c[i];
        }
    }
    let mut s = T::zero();
    for a in acc {
        s += a;
    }
    for v in rest {
        s += *v;
    }
    s
}

/// The largest value, in lanes (-inf for an empty slice).
#[inline(always)]
fn max_of<T: Real>(x: &[T]) -> T {
    let mut acc = [T::neg_infinity(); 16];
    let chunks = x.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..16 {
            acc[i] = if c[i] > acc[i] { c[i] } else { acc[i] };
        }
    }
    let mut m = T::neg_infinity();
    for v in acc.iter().chain(rest) {
        m = if *v > m { *v } else { m };
    }
    m
}

/// `sum_i a_i b_i`, in lanes.
#[inline(always)]
fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    let mut acc = [T::zero(); 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = T::zero();
    for v in acc {
        s += v;
    }
    for (x, y) in ra.iter().zip(rb) {
        s += *x * *y;
    }
    s
}

/// `len` zeros, written in parallel: a large `vec![0; len]` is a memset on one thread.
pub(super) fn zeros<T: Real>(len: usize) -> Vec<T> {
    const CHUNK: usize = 1 << 15;
    if len < 4 * CHUNK {
        return vec![T::zero(); len];
    }
    let mut v: Vec<T> = Vec::with_capacity(len);
    v.spare_capacity_mut()[..len]
        .par_chunks_mut(CHUNK)
        .for_each(|c| {
            for x in c {
                x.write(T::zero());
            }
        });
    // SAFETY: every one of the `len` elements was written above.
    unsafe { v.set_len(len) };
    v
}

/// Rows per parallel task: about 16 K values each.
fn rows_per_task(row: usize) -> usize {
    (16_384 / row.max(1)).max(1)
}

fn contiguous<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s.as_slice::<T>()?[a..b]),
        None => candle::bail!(
            "fused {what}: the input must be contiguous, got strides {:?}",
            l.stride()
        ),
    }
}

fn unsupported(what: &str, dtype: DType) -> candle::Error {
    candle::Error::Msg(format!("fused {what} runs on f32 and f64, not {dtype:?}"))
}

// ---------------------------------------------------------------- LayerNorm

#[inline(always)]
fn ln_forward_body<T: Real>(x: &[T], w: &[T], b: &[T], eps: T, y: &mut [T]) {
    let d = w.len();
    let n = T::lit(d as f64);
    for (xr, yr) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
        let mean = sum(xr) / n;
        for (o, v) in yr.iter_mut().zip(xr) {
            *o = *v - mean;
        }
        let rstd = (dot(yr, yr) / n + eps).sqrt().recip();
        for ((o, wi), bi) in yr.iter_mut().zip(w).zip(b) {
            *o = *o * rstd * *wi + *bi;
        }
    }
}
simd_dispatch!(fn ln_forward = ln_forward_body(x: &[T], w: &[T], b: &[T], eps: T, y: &mut [T]));

/// `dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat))`, `dxhat = g w`.
#[inline(always)]
fn ln_grad_input_body<T: Real>(x: &[T], w: &[T], g: &[T], eps: T, dx: &mut [T]) {
    let d = w.len();
    let n = T::lit(d as f64);
    let mut xhat = vec![T::zero(); d];
    let mut dxhat = vec![T::zero(); d];
    for ((xr, gr), out) in x
        .chunks_exact(d)
        .zip(g.chunks_exact(d))
        .zip(dx.chunks_exact_mut(d))
    {
        let mean = sum(xr) / n;
        for (h, v) in xhat.iter_mut().zip(xr) {
            *h = *v - mean;
        }
        let rstd = (dot(&xhat, &xhat) / n + eps).sqrt().recip();
        for h in xhat.iter_mut() {
            *h *= rstd;
        }
        for ((o, gi), wi) in dxhat.iter_mut().zip(gr).zip(w) {
            *o = *gi * *wi;
        }
        let mean_dxhat = sum(&dxhat) / n;
        let mean_dxhat_xhat = dot(&dxhat, &xhat) / n;
        for ((o, dh), h) in out.iter_mut().zip(&dxhat).zip(&xhat) {
            *o = rstd * (*dh - mean_dxhat - *h * mean_dxhat_xhat);
        }
    }
}
simd_dispatch!(fn ln_grad_input = ln_grad_input_body(x: &[T], w: &[T], g: &[T], eps: T, dx: &mut [T]));

/// Partial `[sum g xhat ; sum g]` over the rows of `x`, into `out` (`2 d` values).
#[inline(always)]
fn ln_grad_params_body<T: Real>(x: &[T], g: &[T], d: usize, eps: T, out: &mut [T]) {
    let n = T::lit(d as f64);
    let (dw, db) = out.split_at_mut(d);
    let mut xhat = vec![T::zero(); d];
    for (xr, gr) in x.chunks_exact(d).zip(g.chunks_exact(d)) {
        let mean = sum(xr) / n;
        for (h, v) in xhat.iter_mut().zip(xr) {
            *h = *v - mean;
        }
        let rstd = (dot(&xhat, &xhat) / n + eps).sqrt().recip();
        for (((w, b), h), gi) in dw.iter_mut().zip(db.iter_mut()).zip(&xhat).zip(gr) {
            *w += *gi * *h * rstd;
            *b += *gi;
        }
    }
}
simd_dispatch!(fn ln_grad_params = ln_grad_params_body(x: &[T], g: &[T], d: usize, eps: T, out: &mut [T]));

/// LayerNorm over the last axis: `(x, weight, bias) -> y`.
struct LayerNormOp {
    eps: f64,
}

impl LayerNormOp {
    fn forward<T: Real>(&self, x: &[T], w: &[T], b: &[T]) -> Vec<T> {
        let d = w.len();
        let mut y = zeros(x.len());
        let rows = rows_per_task(d) * d;
        y.par_chunks_mut(rows)
            .zip(x.par_chunks(rows))
            .for_each(|(yc, xc)| ln_forward(xc, w, b, T::lit(self.eps), yc));
        y
    }
}

impl CustomOp3 for LayerNormOp {
    fn name(&self) -> &'static str {
        "poslab-layer-norm"
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
        let storage = match s1.dtype() {
            DType::F32 => f32::to_cpu_storage_owned(self.forward(
                contiguous::<f32>(s1, l1, "layer norm")?,
                contiguous(s2, l2, "layer norm")?,
                contiguous(s3, l3, "layer norm")?,
            )),
            DType::F64 => f64::to_cpu_storage_owned(self.forward(
                contiguous::<f64>(s1, l1, "layer norm")?,
                contiguous(s2, l2, "layer norm")?,
                contiguous(s3, l3, "layer norm")?,
            )),
            dt => return Err(unsupported("layer norm", dt)),
        };
        Ok((storage, l1.shape().clone()))
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
        let dx = x.apply_op3_no_bwd(w, &g, &LayerNormGradInput { eps: self.eps })?;
        let params = x.apply_op2_no_bwd(&g, &LayerNormGradParams { eps: self.eps })?; // (2, d)
        Ok((Some(dx), Some(params.get(0)?), Some(params.get(1)?)))
    }
}

struct LayerNormGradInput {
    eps: f64,
}

impl LayerNormGradInput {
    fn run<T: Real>(&self, x: &[T], w: &[T], g: &[T]) -> Vec<T> {
        let d = w.len();
        let mut dx = zeros(x.len());
        let rows = rows_per_task(d) * d;
        dx.par_chunks_mut(rows)
            .zip(x.par_chunks(rows).zip(g.par_chunks(rows)))
            .for_each(|(o, (xc, gc))| ln_grad_input(xc, w, gc, T::lit(self.eps), o));
        dx
    }
}

impl CustomOp3 for LayerNormGradInput {
    fn name(&self) -> &'static str {
        "poslab-layer-norm-grad-input"
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
        let what = "layer norm backward";
        let storage = match s1.dtype() {
            DType::F32 => f32::to_cpu_storage_owned(self.run(
                contiguous::<f32>(s1, l1, what)?,
                contiguous(s2, l2, what)?,
                contiguous(s3, l3, what)?,
            )),
            DType::F64 => f64::to_cpu_storage_owned(self.run(
                contiguous::<f64>(s1, l1, what)?,
                contiguous(s2, l2, what)?,
                contiguous(s3, l3, what)?,
            )),
            dt => return Err(unsupported(what, dt)),
        };
        Ok((storage, l1.shape().clone()))
    }
}

struct LayerNormGradParams {
    eps: f64,
}

/// Rows per chunk of the parameter-gradient sums: fixed, so the order of additions (and the
/// result) does not depend on the thread count.
const PARAM_CHUNK_ROWS: usize = 64;

impl LayerNormGradParams {
    fn run<T: Real>(&self, x: &[T], g: &[T], d: usize) -> Vec<T> {
        let partials: Vec<Vec<T>> = x
            .par_chunks(PARAM_CHUNK_ROWS * d)
            .zip(g.par_chunks(PARAM_CHUNK_ROWS * d))
            .map(|(xc, gc)| {
                let mut out = vec![T::zero(); 2 * d];
                ln_grad_params(xc, gc, d, T::lit(self.eps), &mut out);
                out
            })
            .collect();
        let mut total = vec![T::zero(); 2 * d];
        for p in partials {
            for (t, v) in total.iter_mut().zip(p) {
                *t += v;
            }
        }
        total
    }
}

impl CustomOp2 for LayerNormGradParams {
    fn name(&self) -> &'static str {
        "poslab-layer-norm-grad-params"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let what = "layer norm backward";
        let d = *l1.dims().last().unwrap_or(&1);
        let storage = match s1.dtype() {
            DType::F32 => f32::to_cpu_storage_owned(self.run(
                contiguous::<f32>(s1, l1, what)?,
                contiguous(s2, l2, what)?,
                d,
            )),
            DType::F64 => f64::to_cpu_storage_owned(self.run(
                contiguous::<f64>(s1, l1, what)?,
                contiguous(s2, l2, what)?,
                d,
            )),
            dt => return Err(unsupported(what, dt)),
        };
        Ok((storage, Shape::from((2, d))))
    }
}

/// LayerNorm of `x` over its last axis, fused (CPU, f32/f64, contiguous `x`).
pub(crate) fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op3(weight, bias, LayerNormOp { eps })
}

// ---------------------------------------------------------------- softmax

/// `y = softmax(x + bias)` per row of length `t`.
#[inline(always)]
fn softmax_body<T: Real>(x: &[T], bias: &[T], y: &mut [T]) {
    let t = bias.len();
    for (xr, yr) in x.chunks_exact(t).zip(y.chunks_exact_mut(t)) {
        for ((o, v), b) in yr.iter_mut().zip(xr).zip(bias) {
            *o = *v + *b;
        }
        let max = max_of(yr);
        for o in yr.iter_mut() {
            *o = (*o - max).exp_();
        }
        let inv = sum(yr).recip();
        for o in yr.iter_mut() {
            *o *= inv;
        }
    }
}
simd_dispatch!(fn softmax_rows = softmax_body(x: &[T], bias: &[T], y: &mut [T]));

/// `dx = y (g - sum(g y))` per row.
#[inline(always)]
fn softmax_grad_body<T: Real>(y: &[T], g: &[T], t: usize, dx: &mut [T]) {
    for ((yr, gr), o) in y
        .chunks_exact(t)
        .zip(g.chunks_exact(t))
        .zip(dx.chunks_exact_mut(t))
    {
        let s = dot(yr, gr);
        for ((o, yi), gi) in o.iter_mut().zip(yr).zip(gr) {
            *o = *yi * (*gi - s);
        }
    }
}
simd_dispatch!(fn softmax_grad_rows = softmax_grad_body(y: &[T], g: &[T], t: usize, dx: &mut [T]));

/// `softmax(scores + bias)` over the last axis, `scores` `(b, h, t, t)`, `bias` `(b, t)` added
/// to every row of batch element `b`.
struct MaskedSoftmax;

impl MaskedSoftmax {
    fn forward<T: Real>(x: &[T], bias: &[T], dims: &[usize]) -> Vec<T> {
        let t = dims[dims.len() - 1];
        let per_batch = x.len() / dims[0].max(1);
        let mut y = zeros(x.len());
        // Rows per task: as many as suit the work size and divide a batch element's rows, so
        // no task straddles two batch elements (whose biases differ).
        let rows_per_batch = per_batch / t;
        let mut k = rows_per_task(t).min(rows_per_batch).max(1);
        while rows_per_batch % k != 0 {
            k -= 1;
        }
        let chunk = k * t;
        y.par_chunks_mut(chunk)
            .zip(x.par_chunks(chunk))
            .enumerate()
            .for_each(|(i, (yc, xc))| {
                let batch = i * chunk / per_batch;
                softmax_rows(xc, &bias[batch * t..(batch + 1) * t], yc)
            });
        y
    }
}

impl CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "poslab-masked-softmax"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let what = "softmax";
        let dims = l1.dims();
        let storage = match s1.dtype() {
            DType::F32 => f32::to_cpu_storage_owned(Self::forward(
                contiguous::<f32>(s1, l1, what)?,
                contiguous(s2, l2, what)?,
                dims,
            )),
            DType::F64 => f64::to_cpu_storage_owned(Self::forward(
                contiguous::<f64>(s1, l1, what)?,
                contiguous(s2, l2, what)?,
                dims,
            )),
            dt => return Err(unsupported(what, dt)),
        };
        Ok((storage, l1.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _bias: &Tensor,
        y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((
            Some(y.apply_op2_no_bwd(&g.contiguous()?, &SoftmaxGrad)?),
            None,
        ))
    }
}

struct SoftmaxGrad;

impl SoftmaxGrad {
    fn run<T: Real>(y: &[T], g: &[T], t: usize) -> Vec<T> {
        let mut dx = zeros(y.len());
        let rows = rows_per_task(t) * t;
        dx.par_chunks_mut(rows)
            .zip(y.par_chunks(rows).zip(g.par_chunks(rows)))
            .for_each(|(o, (yc, gc))| softmax_grad_rows(yc, gc, t, o));
        dx
    }
}

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "poslab-softmax-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let what = "softmax backward";
        let t = *l1.dims().last().unwrap_or(&1);
        let storage = match s1.dtype() {
            DType::F32 => f32::to_cpu_storage_owned(Self::run(
                contiguous::<f32>(s1, l1, what)?,
                contiguous(s2, l2, what)?,
                t,
            )),
            DType::F64 => f64::to_cpu_storage_owned(Self::run(
                contiguous::<f64>(s1, l1, what)?,
                contiguous(s2, l2, what)?,
                t,
            )),
            dt => return Err(unsupported(what, dt)),
        };
        Ok((storage, l1.shape().clone()))
    }
}

/// `softmax(scores + bias)` with `scores` `(b, h, t, t)` and a key bias `(b, t)`, fused.
pub(crate) fn masked_softmax(scores: &Tensor, key_bias: &Tensor) -> Result<Tensor> {
    scores
        .contiguous()?
        .apply_op2(&key_bias.contiguous()?, MaskedSoftmax)
}

// ---------------------------------------------------------------- GELU

#[inline(always)]
fn gelu_body<T: Real>(x: &[T], y: &mut [T]) {
    let (half, inv_sqrt2) = (T::lit(0.5), T::lit(std::f64::consts::FRAC_1_SQRT_2));
    for (o, v) in y.iter_mut().zip(x) {
        *o = half * *v * (T::one() + (*v * inv_sqrt2).erf_());
    }
}
simd_dispatch!(fn gelu_rows = gelu_body(x: &[T], y: &mut [T]));

/// `dx = g (Phi(x) + x phi(x))`.
#[inline(always)]
fn gelu_grad_body<T: Real>(x: &[T], g: &[T], dx: &mut [T]) {
    for ((o, v), gi) in dx.iter_mut().zip(x).zip(g) {
        let (cdf, pdf) = v.normal_cdf_pdf();
        *o = *gi * (cdf + *v * pdf);
    }
}
simd_dispatch!(fn gelu_grad_rows = gelu_grad_body(x: &[T], g: &[T], dx: &mut [T]));

const ELEMENTS_PER_TASK: usize = 16_384;

/// `GELU(x)`, in parallel chunks.
fn gelu_par<T: Real>(x: &[T]) -> Vec<T> {
    let mut y = zeros(x.len());
    y.par_chunks_mut(ELEMENTS_PER_TASK)
        .zip(x.par_chunks(ELEMENTS_PER_TASK))
        .for_each(|(o, i)| gelu_rows(i, o));
    y
}

/// `g GELU'(x)`, in parallel chunks.
fn gelu_grad_par<T: Real>(x: &[T], g: &[T]) -> Vec<T> {
    let mut dx = zeros(x.len());
    dx.par_chunks_mut(ELEMENTS_PER_TASK)
        .zip(
            x.par_chunks(ELEMENTS_PER_TASK)
                .zip(g.par_chunks(ELEMENTS_PER_TASK)),
        )
        .for_each(|(o, (xc, gc))| gelu_grad_rows(xc, gc, o));
    dx
}

/// `max(x, 0)`, in parallel chunks.
fn relu_par<T: Real>(x: &[T]) -> Vec<T> {
    let mut y = zeros(x.len());
    y.par_chunks_mut(ELEMENTS_PER_TASK)
        .zip(x.par_chunks(ELEMENTS_PER_TASK))
        .for_each(|(o, i)| {
            for (o, v) in o.iter_mut().zip(i) {
                *o = if *v > T::zero() { *v } else { T::zero() };
            }
        });
    y
}

/// `g ReLU'(x)`, with candle's convention at 0 (`x >= 0` passes the gradient), so the fused
/// layer and the composition agree everywhere.
fn relu_grad_par<T: Real>(x: &[T], g: &[T]) -> Vec<T> {
    let mut dx = zeros(x.len());
    dx.par_chunks_mut(ELEMENTS_PER_TASK)
        .zip(
            x.par_chunks(ELEMENTS_PER_TASK)
                .zip(g.par_chunks(ELEMENTS_PER_TASK)),
        )
        .for_each(|(o, (xc, gc))| {
            for ((o, v), gi) in o.iter_mut().zip(xc).zip(gc) {
                *o = if *v >= T::zero() { *gi } else { T::zero() };
            }
        });
    dx
}

/// The feed-forward activation of the fused layer.
pub(crate) fn activation_par<T: Real>(x: &[T], activation: crate::nn::Activation) -> Vec<T> {
    match activation {
        crate::nn::Activation::Gelu => gelu_par(x),
        crate::nn::Activation::Relu => relu_par(x),
        crate::nn::Activation::Geglu => unreachable!("encoder_layer refuses GeGLU"),
    }
}

/// `g act'(x)` for the fused layer's backward.
pub(crate) fn activation_grad_par<T: Real>(
    x: &[T],
    g: &[T],
    activation: crate::nn::Activation,
) -> Vec<T> {
    match activation {
        crate::nn::Activation::Gelu => gelu_grad_par(x, g),
        crate::nn::Activation::Relu => relu_grad_par(x, g),
        crate::nn::Activation::Geglu => unreachable!("encoder_layer refuses GeGLU"),
    }
}

struct Gelu;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "poslab-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let storage = match s.dtype() {
            DType::F32 => f32::to_cpu_storage_owned(gelu_par(contiguous::<f32>(s, l, "gelu")?)),
            DType::F64 => f64::to_cpu_storage_owned(gelu_par(contiguous::<f64>(s, l, "gelu")?)),
            dt => return Err(unsupported("gelu", dt)),
        };
        Ok((storage, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(x.apply_op2_no_bwd(&g.contiguous()?, &GeluGrad)?))
    }
}

struct GeluGrad;

impl CustomOp2 for GeluGrad {
    fn name(&self) -> &'static str {
        "poslab-gelu-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let what = "gelu backward";
        let storage = match s1.dtype() {
            DType::F32 => f32::to_cpu_storage_owned(gelu_grad_par(
                contiguous::<f32>(s1, l1, what)?,
                contiguous(s2, l2, what)?,
            )),
            DType::F64 => f64::to_cpu_storage_owned(gelu_grad_par(
                contiguous::<f64>(s1, l1, what)?,
                contiguous(s2, l2, what)?,
            )),
            dt => return Err(unsupported(what, dt)),
        };
        Ok((storage, l1.shape().clone()))
    }
}

/// Exact GELU, fused.
pub(crate) fn gelu(x: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Gelu)
}

// ---------------------------------------------------------------- RoPE

/// The rotation of RoPE on `(b, h, t, d_head)`, with `cos` and `sin` `(r, t, w)` laid out by the
/// pairing over the first `w` coordinates of each head (`r` 1 or `b`).
struct RopeOp {
    interleaved: bool,
    /// Rotate by minus the angle: the gradient of the forward rotation.
    inverse: bool,
}

/// RoPE's rotation of head rows by the angles of their positions, with cos and sin tables of
/// `width` columns per row laid out by the pairing; coordinates past `width` pass through.
/// `sign` -1 rotates back by the same angles (the gradient).
#[derive(Clone, Copy)]
pub(crate) struct Rotation<'a, T> {
    pub cos: &'a [T],
    pub sin: &'a [T],
    pub width: usize,
    pub interleaved: bool,
    pub sign: T,
}

impl<T: Real> Rotation<'_, T> {
    /// `out = R(sign · angles of table row p) x`, `x` one head row (at least `width` wide).
    #[inline(always)]
    pub fn apply(&self, x: &[T], p: usize, out: &mut [T]) {
        let w = self.width;
        let (c, s) = (&self.cos[p * w..(p + 1) * w], &self.sin[p * w..(p + 1) * w]);
        let half = w / 2;
        if self.interleaved {
            for i in 0..half {
                let (a, b) = (x[2 * i], x[2 * i + 1]);
                let (ci, si) = (c[2 * i], self.sign * s[2 * i]);
                out[2 * i] = a * ci - b * si;
                out[2 * i + 1] = b * ci + a * si;
            }
        } else {
            for i in 0..half {
                let (a, b) = (x[i], x[half + i]);
                let (ci, si) = (c[i], self.sign * s[i]);
                out[i] = a * ci - b * si;
                out[half + i] = b * ci + a * si;
            }
        }
        out[w..].copy_from_slice(&x[w..]);
    }

    /// The rows of batch element `bi` of tables with `rows` blocks of `t` rows each (`rows` 1:
    /// one block shared by the whole batch).
    pub fn for_batch(self, bi: usize, t: usize, rows: usize) -> Self {
        if rows == 1 {
            return self;
        }
        let block = t * self.width;
        Self {
            cos: &self.cos[bi * block..(bi + 1) * block],
            sin: &self.sin[bi * block..(bi + 1) * block],
            ..self
        }
    }
}

/// Rotates head rows of width `d`; row `r` (counted from `first` over the whole
/// `(b, h, t, d)` tensor) is at position `r mod t` of batch element `r / (h t)`.
#[inline(always)]
fn rope_rows_body<T: Real>(
    x: &[T],
    rotation: Rotation<'_, T>,
    (h, t, d): (usize, usize, usize),
    first: usize,
    out: &mut [T],
) {
    let rows = rotation.cos.len() / (t * rotation.width);
    for (r, (xr, o)) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)).enumerate() {
        let row = first + r;
        let block = if rows == 1 { 0 } else { row / (h * t) };
        rotation.apply(xr, block * t + row % t, o);
    }
}
simd_dispatch!(fn rope_rows = rope_rows_body(x: &[T], rotation: Rotation<'_, T>, dims: (usize, usize, usize), first: usize, out: &mut [T]));

impl RopeOp {
    fn run<T: Real>(&self, x: &[T], cos: &[T], sin: &[T], dims: &[usize], width: usize) -> Vec<T> {
        let (h, t, d) = (dims[1], dims[2], dims[3]);
        let mut out = zeros(x.len());
        let rows = rows_per_task(d);
        let sign = if self.inverse { -T::one() } else { T::one() };
        out.par_chunks_mut(rows * d)
            .zip(x.par_chunks(rows * d))
            .enumerate()
            .for_each(|(i, (o, xc))| {
                let rotation = Rotation {
                    cos,
                    sin,
                    width,
                    interleaved: self.interleaved,
                    sign,
                };
                rope_rows(xc, rotation, (h, t, d), i * rows, o)
            });
        out
    }
}

impl CustomOp3 for RopeOp {
    fn name(&self) -> &'static str {
        "poslab-rope"
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
        let what = "rope";
        let dims = l1.dims();
        let width = *l2.dims().last().unwrap_or(&0);
        if dims.len() != 4 || l2.dims().len() != 3 || width == 0 || width > dims[3] {
            candle::bail!(
                "fused rope: x {dims:?} must be (b, h, t, d_head) and the tables {:?} (r, t, w)                  with 0 < w <= d_head",
                l2.dims()
            );
        }
        let storage = by_dtype!(s1.dtype(), what, |T| self.run::<T>(
            contiguous(s1, l1, what)?,
            contiguous(s2, l2, what)?,
            contiguous(s3, l3, what)?,
            dims,
            width
        ));
        Ok((storage, l1.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let back = RopeOp {
            interleaved: self.interleaved,
            inverse: !self.inverse,
        };
        Ok((
            Some(g.contiguous()?.apply_op3_no_bwd(cos, sin, &back)?),
            None,
            None,
        ))
    }
}

/// RoPE of `x` `(b, h, t, d_head)` with the `(r, t, w)` tables of its pairing, fused.
pub(crate) fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, interleaved: bool) -> Result<Tensor> {
    x.contiguous()?.apply_op3(
        &cos.contiguous()?,
        &sin.contiguous()?,
        RopeOp {
            interleaved,
            inverse: false,
        },
    )
}

/// One encoder layer as one node (see `layer`).
///
/// # Shapes
/// - `x`: `(b, t, d)`; `params`: the packed vector of [`LayerShape`]
/// - `inputs`: the attention's key bias `(b, t)`, rotary tables `(r, t, w)` and additive score
///   bias `(r, h, t, t)` (see [`Attention::new`])
/// - returns `(b, t, d)`
pub(crate) fn encoder_layer(
    x: &Tensor,
    params: &Tensor,
    shape: LayerShape,
    attention: Attention,
    masks: LayerMasks,
    keep_activations: bool,
) -> Result<Tensor> {
    if shape.activation == crate::nn::Activation::Geglu {
        candle::bail!("the fused layer computes GELU and ReLU feed-forwards; GeGLU runs as ops");
    }
    let bias = attention.score_bias_input(x)?;
    let op = layer::LayerOp::new(shape, attention, masks, keep_activations);
    x.contiguous()?.apply_op3(&params.contiguous()?, &bias, op)
}
