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

use candle::{CpuStorage, DType, Layout, Result, Tensor, WithDType};
use std::sync::OnceLock;

use rayon::prelude::*;

/// The numbers the kernels run on.
pub(crate) trait Real:
    num_traits::Float + WithDType + std::ops::AddAssign + std::ops::MulAssign + Send + Sync + 'static
{
    fn erf_(self) -> Self;
    /// `e^x`, exactly 0 below the smallest normal result.
    fn exp_(self) -> Self;
    /// `ln(1 + x)` for `x >= 0`, accurate for small `x` too.
    fn ln_1p_(self) -> Self;
    fn lit(v: f64) -> Self;
    /// `(erf(x/√2), exp(-x²/2))`: what the standard normal's CDF and density are made of.
    fn erf_gauss(self) -> (Self, Self);
    /// The standard normal's `(Phi(x), phi(x))`: GELU's CDF and density.
    #[inline(always)]
    fn normal_cdf_pdf(self) -> (Self, Self) {
        let (erf, gauss) = self.erf_gauss();
        cdf_pdf(erf, gauss)
    }
}

/// The standard normal's `(Phi(x), phi(x))` from [`Real::erf_gauss`]'s `(erf(x/√2), exp(-x²/2))`.
#[inline(always)]
pub(super) fn cdf_pdf<T: Real>(erf: T, gauss: T) -> (T, T) {
    (T::lit(0.5) * (T::one() + erf), T::lit(INV_SQRT_2PI) * gauss)
}

const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

impl Real for f64 {
    fn erf_(self) -> Self {
        libm::erf(self)
    }
    fn exp_(self) -> Self {
        self.exp()
    }
    fn ln_1p_(self) -> Self {
        self.ln_1p()
    }
    fn lit(v: f64) -> Self {
        v
    }
    fn erf_gauss(self) -> (Self, Self) {
        (
            libm::erf(self * std::f64::consts::FRAC_1_SQRT_2),
            (-0.5 * self * self).exp(),
        )
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
    fn ln_1p_(self) -> Self {
        ln_1p_f32(self)
    }
    #[inline(always)]
    fn lit(v: f64) -> Self {
        v as f32
    }
    /// One `exp` for both: the `exp(-a²)` of `erf(a)`, `a = |x|/√2`, is the density's
    /// `exp(-x²/2)`. `erf` has the bits of [`erf_f32`]`(x/√2)`: `|x|/√2` rounds as `|x/√2|` does.
    #[inline(always)]
    fn erf_gauss(self) -> (Self, Self) {
        let a = self.abs() * std::f32::consts::FRAC_1_SQRT_2;
        let e = exp_f32(-a * a);
        let erf_abs = 1.0 - erf_poly(a) * e;
        (erf_abs.copysign(self), e)
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

/// `ln(x)` in f32 to about 1 ulp for a positive normal `x`: the exponent from the bits, the
/// mantissa brought to `[sqrt(1/2), sqrt(2))` and Cephes' `logf` polynomial, branch-free so
/// loops of it vectorise.
#[inline(always)]
pub(crate) fn ln_f32(x: f32) -> f32 {
    const SQRT_HALF: f32 = std::f32::consts::FRAC_1_SQRT_2;
    let bits = x.to_bits();
    // x = m 2^e with m in [0.5, 1)
    let e = ((bits >> 23) & 0xff) as i32 - 126;
    let m = f32::from_bits((bits & 0x007f_ffff) | 0x3f00_0000);
    let low = m < SQRT_HALF;
    let e = (e - i32::from(low)) as f32;
    let r = if low { m + m - 1.0 } else { m - 1.0 };
    let z = r * r;
    let mut p = 7.037_683_6e-2_f32;
    p = p * r - 1.151_461e-1;
    p = p * r + 1.167_699_9e-1;
    p = p * r - 1.242_014_1e-1;
    p = p * r + 1.424_932_3e-1;
    p = p * r - 1.666_805_8e-1;
    p = p * r + 2.000_071_5e-1;
    p = p * r - 2.499_999_4e-1;
    p = p * r + 3.333_333e-1;
    let y = p * r * z - 2.121_944_4e-4 * e - 0.5 * z;
    r + y + 0.693_359_4 * e
}

/// `ln(1 + x)` in f32 for `x >= 0`: `ln(w)` of `w = 1 + x`, corrected for the rounding of `w`
/// (`((w - 1) - x) / w`), so that a small `x` keeps its digits.
#[inline(always)]
pub(crate) fn ln_1p_f32(x: f32) -> f32 {
    let w = 1.0 + x;
    ln_f32(w) - ((w - 1.0) - x) / w
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
    /// Every level, from the lowest.
    pub const ALL: [SimdLevel; 3] = [SimdLevel::Baseline, SimdLevel::Avx2, SimdLevel::Avx512];

    /// The level's name: `baseline`, `avx2` or `avx512`.
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Baseline => "baseline",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
        }
    }

    /// The best level this CPU supports (checked at run time, once).
    pub fn detected() -> Self {
        static DETECTED: OnceLock<SimdLevel> = OnceLock::new();
        *DETECTED.get_or_init(|| {
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
        })
    }
}

/// The level the fused kernels launched on this thread run at: that of the backend in force
/// (see [`crate::nn::Backend`]). An op reads it when it is created, on the thread that creates
/// it, and passes it to the kernels it runs, on whichever threads they run.
pub(crate) fn simd_level() -> SimdLevel {
    crate::nn::backend().simd
}

/// Kernel calls run at each level (baseline, AVX2, AVX-512) in this process.
static DISPATCHES: [std::sync::atomic::AtomicUsize; 3] =
    [const { std::sync::atomic::AtomicUsize::new(0) }; 3];

/// Counts a kernel call at `level`.
#[inline(always)]
pub(crate) fn count_dispatch(level: SimdLevel) {
    DISPATCHES[level as usize].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// For tests: how many fused-kernel calls ran at each level (baseline, AVX2, AVX-512), so a
/// test can tell that a backend's level reached the kernels.
#[doc(hidden)]
pub fn simd_dispatches() -> [usize; 3] {
    DISPATCHES
        .each_ref()
        .map(|c| c.load(std::sync::atomic::Ordering::Relaxed))
}

/// Defines `$name`, which runs `$body` compiled for AVX-512 or AVX2 + FMA when `level` (its
/// first argument) asks for them and the CPU has them, and for the baseline target otherwise.
///
/// `fn` takes a safe body and counts the call ([`count_dispatch`]); `unsafe fn` takes an unsafe
/// one (raw pointers), is itself unsafe with the body's contract, and is not counted: the
/// attention's tiled head products run once per head, where a shared atomic on every core is
/// contention (the softmax beside each product is counted).
macro_rules! simd_dispatch {
    ($vis:vis fn $name:ident = $body:ident ($($arg:ident : $ty:ty),* $(,)?)) => {
        $vis fn $name<T: Real>(level: $crate::nn::SimdLevel, $($arg: $ty),*) {
            let level = level.min($crate::nn::SimdLevel::detected());
            $crate::nn::fused::count_dispatch(level);
            // SAFETY: the body is safe; the level is one the CPU has.
            #[allow(unused_unsafe)]
            unsafe {
                simd_dispatch!(@at level, $body ($($arg: $ty),*))
            }
        }
    };
    ($(#[$doc:meta])* $vis:vis unsafe fn $name:ident = $body:ident ($($arg:ident : $ty:ty),* $(,)?)) => {
        $(#[$doc])*
        $vis unsafe fn $name<T: Real>(level: $crate::nn::SimdLevel, $($arg: $ty),*) {
            let level = level.min($crate::nn::SimdLevel::detected());
            // SAFETY: the caller keeps the body's contract; the level is one the CPU has.
            unsafe { simd_dispatch!(@at level, $body ($($arg: $ty),*)) }
        }
    };
    // `$body` at `$level` (already capped at the CPU's): the one place the instruction sets
    // are named. Expands inside an unsafe block.
    (@at $level:ident, $body:ident ($($arg:ident : $ty:ty),*)) => {{
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
            unsafe fn wide<T: Real>($($arg: $ty),*) {
                #[allow(unused_unsafe)]
                unsafe { $body::<T>($($arg),*) }
            }
            #[target_feature(enable = "avx2,fma")]
            unsafe fn narrow<T: Real>($($arg: $ty),*) {
                #[allow(unused_unsafe)]
                unsafe { $body::<T>($($arg),*) }
            }
            match $level {
                $crate::nn::fused::SimdLevel::Avx512 => return wide::<T>($($arg),*),
                $crate::nn::fused::SimdLevel::Avx2 => return narrow::<T>($($arg),*),
                $crate::nn::fused::SimdLevel::Baseline => {}
            }
        }
        $body::<T>($($arg),*)
    }};
}

mod adamw;
mod attention;
mod differences;
mod gelu;
mod layer;
mod layer_norm;
mod linear;
mod log_sigmoid;
mod pointwise;
mod reflections;
mod rope;
mod running_sums;
mod softmax;

pub(crate) use differences::sided_differences;
use linear::by_dtype;

pub(crate) use adamw::adamw_step;
pub(crate) use attention::{attention, Attention};
pub use attention::{head_product_gflops, HeadProduct};
pub(crate) use gelu::{activation_par, activation_with_grad_par, gelu, times_grad_summed_par};
pub(crate) use layer::{LayerMasks, LayerShape, Offsets};
pub(crate) use layer_norm::layer_norm;
pub(crate) use linear::linear;
pub use linear::{linear_pass_gflops, matmul_gflops, LinearPass};
pub(crate) use log_sigmoid::log_sigmoid;
pub(crate) use reflections::reflections;
pub(crate) use rope::{rope, Rotation};
pub(crate) use running_sums::{
    group_channels as running_sums_channels, in_order as running_sums_in_order, running_sums,
};
pub(crate) use softmax::masked_softmax;

/// Rows the row-wise kernels (softmax, LayerNorm) reduce together: see [`row_folds`]. One
/// thread, AVX-512, f32, a 64 x 64 head's softmax (2026-11-26): 3.56 µs one row at a time, 2.89
/// with 4 rows, 2.78 with 8, 2.29 with 16, 2.37 with 32.
pub(super) const FOLD_ROWS: usize = 16;

/// One reduction of each of `R` rows of `t` values (`a` and `b` hold them in turn):
/// `value(a_i, b_i)` accumulated by `step` from `init` in 16 independent lanes (so it
/// vectorises), the lanes then folded in order by `step` from `init`, then the row's last `t % 16`
/// values. Each row's result has the bits of that row reduced alone (`R` = 1); with `R` > 1 the
/// rows' serial folds are interleaved, `R` independent chains the core runs side by side,
/// instead of one 16-step chain after another (with rows of 64, those chains were most of a
/// softmax's time).
#[inline(always)]
fn row_folds<T: Real, const R: usize>(
    (a, b): (&[T], &[T]),
    t: usize,
    init: T,
    value: impl Fn(T, T) -> T,
    step: impl Fn(T, T) -> T,
) -> [T; R] {
    assert!(
        a.len() >= R * t && b.len() >= R * t,
        "row folds: {R} rows of {t}"
    );
    let mut lanes = [[init; 16]; R];
    for (r, acc) in lanes.iter_mut().enumerate() {
        let (ar, br) = (&a[r * t..(r + 1) * t], &b[r * t..(r + 1) * t]);
        for (ca, cb) in ar.chunks_exact(16).zip(br.chunks_exact(16)) {
            for i in 0..16 {
                acc[i] = step(acc[i], value(ca[i], cb[i]));
            }
        }
    }
    // Lane i of every row, then lane i + 1: each row's chain in its own order, the rows side
    // by side. (Storing the lanes transposed instead, so that this reads whole vectors, was
    // slower: the lane-by-lane stores stall the vector loads after them.)
    let mut s = [init; R];
    #[allow(clippy::needless_range_loop)]
    for i in 0..16 {
        for r in 0..R {
            s[r] = step(s[r], lanes[r][i]);
        }
    }
    for e in t / 16 * 16..t {
        for (r, s) in s.iter_mut().enumerate() {
            *s = step(*s, value(a[r * t + e], b[r * t + e]));
        }
    }
    s
}

/// The sum of each of `R` rows of `t` values, in lanes ([`row_folds`]).
#[inline(always)]
fn sums<T: Real, const R: usize>(x: &[T], t: usize) -> [T; R] {
    row_folds((x, x), t, T::zero(), |v, _| v, |s, v| s + v)
}

/// The largest value of each of `R` rows of `t` values (-inf for empty rows), in lanes.
#[inline(always)]
fn maxes<T: Real, const R: usize>(x: &[T], t: usize) -> [T; R] {
    row_folds(
        (x, x),
        t,
        T::neg_infinity(),
        |v, _| v,
        |m, v| if v > m { v } else { m },
    )
}

/// `sum_i a_i b_i` of each of `R` rows of `t` values, in lanes.
#[inline(always)]
fn dots<T: Real, const R: usize>(a: &[T], b: &[T], t: usize) -> [T; R] {
    row_folds((a, b), t, T::zero(), |x, y| x * y, |s, v| s + v)
}

/// Where `len` values in rows of `t` split: the rows in whole blocks of [`FOLD_ROWS`] end at
/// the returned index; the rest are taken one by one.
///
/// The kernels write their two loops (blocks, then single rows) out rather than hand a closure
/// to a shared walker: a closure is compiled as a function of its own, without the instruction
/// sets `simd_dispatch!` enables around the body, and the paper shape's forward then took 272-301
/// ms against 90-117 (tried 2026-11-26).
#[inline(always)]
fn whole_blocks(len: usize, t: usize) -> usize {
    len / (FOLD_ROWS * t).max(1) * FOLD_ROWS * t
}

/// An operand for the timing functions ([`matmul_gflops`] and its kin): `len` small f32 values
/// in a fixed pattern, one per `seed`.
pub(super) fn timing_operand(len: usize, seed: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7 + seed) % 13) as f32 * 0.01 - 0.06)
        .collect()
}

/// The rate, in GFLOP/s, of `gflop` at the fastest of `reps` (at least one) runs of `run`.
pub(super) fn best_rate(gflop: f64, reps: usize, mut run: impl FnMut()) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let start = std::time::Instant::now();
        run();
        best = best.min(start.elapsed().as_secs_f64());
    }
    gflop / best
}

/// `σ(x)`, stable for any x (softplus's derivative).
#[inline(always)]
pub(super) fn sigmoid<T: Real>(x: T) -> T {
    let u = (-x.abs()).exp_();
    let inv = (T::one() + u).recip();
    if x >= T::zero() {
        inv
    } else {
        u * inv
    }
}

/// The sum of `b` equal blocks of `all`, each value in a fixed order (block 0 first), so the
/// bits do not depend on the threads.
pub(super) fn batch_sum<T: Real>(all: &[T], b: usize) -> Vec<T> {
    let per = all.len() / b.max(1);
    let mut sum = zeros::<T>(per);
    sum.par_chunks_mut(1 << 14)
        .enumerate()
        .for_each(|(c, out)| {
            let at = c * (1 << 14);
            for bi in 0..b {
                let src = &all[bi * per + at..bi * per + at + out.len()];
                for (o, v) in out.iter_mut().zip(src) {
                    *o += *v;
                }
            }
        });
    sum
}

/// `len` zeros, written in parallel: a large `vec![0; len]` is a memset on one thread.
pub(super) fn zeros<T: Real>(len: usize) -> Vec<T> {
    const CHUNK: usize = 1 << 15;
    if len < 4 * CHUNK {
        return vec![T::zero(); len];
    }
    // SAFETY: every value of every chunk is written.
    unsafe {
        par_written(len, CHUNK, |_, c| {
            c.fill(std::mem::MaybeUninit::new(T::zero()))
        })
    }
}

/// A buffer of `len` values that `fill` writes in full, never zeroed first: at the paper's
/// shape the zero fills of outputs that are then overwritten were about 10% of a training step.
///
/// # Safety
/// `fill` must write every one of the `len` values through the pointer it is given, and read
/// none of them before writing it.
pub(super) unsafe fn written<T: Real>(len: usize, fill: impl FnOnce(*mut T)) -> Vec<T> {
    let mut v = Vec::<T>::with_capacity(len);
    fill(v.as_mut_ptr());
    // SAFETY: the `len` values are initialised, per the contract.
    unsafe { v.set_len(len) };
    v
}

/// `x` as storage a kernel writes through.
///
/// # Safety
/// Whoever writes through the result must write only initialised values.
pub(super) unsafe fn uninit<T>(x: &mut [T]) -> &mut [std::mem::MaybeUninit<T>] {
    // SAFETY: MaybeUninit<T> has T's layout; the writer keeps the values initialised.
    unsafe { &mut *(x as *mut [T] as *mut [std::mem::MaybeUninit<T>]) }
}

/// Storage a kernel has written, as its values.
///
/// # Safety
/// Every value of `x` must have been written.
pub(super) unsafe fn assume_written<T>(x: &mut [std::mem::MaybeUninit<T>]) -> &mut [T] {
    // SAFETY: MaybeUninit<T> has T's layout, and every value is initialised, per the contract.
    unsafe { &mut *(x as *mut [std::mem::MaybeUninit<T>] as *mut [T]) }
}

/// `len` values written by `fill` in parallel chunks of `chunk` values (the chunk's range of
/// indices and its uninitialised values), never zeroed first.
///
/// # Safety
/// `fill` must initialise every value of each chunk it is given.
pub(super) unsafe fn par_written<T: Real>(
    len: usize,
    chunk: usize,
    fill: impl Fn(std::ops::Range<usize>, &mut [std::mem::MaybeUninit<T>]) + Sync,
) -> Vec<T> {
    let mut v = Vec::<T>::with_capacity(len);
    v.spare_capacity_mut()[..len]
        .par_chunks_mut(chunk)
        .enumerate()
        .for_each(|(i, c)| fill(i * chunk..i * chunk + c.len(), c));
    // SAFETY: every chunk was initialised, per the contract.
    unsafe { v.set_len(len) };
    v
}

/// [`par_written`], each chunk's `fill` also given `part` zeros of its own to add into (its
/// partial sums, say); those come back side by side in the chunks' order, in one buffer
/// allocated before the pass (one allocation per chunk in the middle of a backward split freed
/// large buffers: the paper shape's training peak grew by 1-2 MiB).
///
/// # Safety
/// As [`par_written`]'s.
pub(super) unsafe fn par_written_parts<T: Real>(
    len: usize,
    chunk: usize,
    part: usize,
    fill: impl Fn(std::ops::Range<usize>, &mut [std::mem::MaybeUninit<T>], &mut [T]) + Sync,
) -> (Vec<T>, Vec<T>) {
    assert!(chunk > 0 && part > 0, "chunks of {chunk}, parts of {part}");
    let mut parts = vec![T::zero(); len.div_ceil(chunk) * part];
    let mut v = Vec::<T>::with_capacity(len);
    v.spare_capacity_mut()[..len]
        .par_chunks_mut(chunk)
        .zip(parts.par_chunks_mut(part))
        .enumerate()
        .for_each(|(i, (c, p))| fill(i * chunk..i * chunk + c.len(), c, p));
    // SAFETY: every chunk was initialised, per the contract.
    unsafe { v.set_len(len) };
    (v, parts)
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
    if shape.gates != 0 && shape.gates != 2 * attention.head_count() {
        candle::bail!(
            "the fused layer's forget gates have {} channels, not 2 x {} heads",
            shape.gates,
            attention.head_count()
        );
    }
    if crate::nn::device_layer_for(x) {
        // The device path: parameters in the activations' dtype (cast once per step, here),
        // the fixed inputs in the dtype values are computed in.
        let attention = attention.in_dtype(crate::nn::device::compute_dtype(x.dtype()))?;
        let bias = attention.score_bias_input(x)?;
        let params = params.to_dtype(x.dtype())?.contiguous()?;
        let op = layer::LayerOp::new(shape, attention, masks, keep_activations, true);
        return x.contiguous()?.apply_op3(&params, &bias, op);
    }
    let bias = attention.score_bias_input(x)?;
    let op = layer::LayerOp::new(shape, attention, masks, keep_activations, false);
    x.contiguous()?.apply_op3(&params.contiguous()?, &bias, op)
}

/// `len` values in [0, 1) from a fixed linear congruential sequence: the kernels' tests' inputs.
#[cfg(test)]
pub(super) fn test_uniform(len: usize, seed: u64) -> impl Iterator<Item = f64> {
    let mut x = seed;
    (0..len).map(move |_| {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (x >> 11) as f64 / (1u64 << 53) as f64
    })
}

#[cfg(test)]
mod tests {
    use super::layer_norm::{ln_forward, ln_grad_input, ln_grad_params};
    use super::softmax::{softmax_grad_rows, softmax_rows};
    use super::*;

    /// Values whose sums depend on the order they are taken in: both signs, magnitudes from
    /// `spread`^-3 to `spread`^3, and masked entries (-inf) now and then when `masked`.
    fn values<T: Real>(n: usize, seed: u64, spread: f64, masked: bool) -> Vec<T> {
        test_uniform(n, seed)
            .enumerate()
            .map(|(i, u)| {
                if masked && i % 23 == 7 {
                    T::neg_infinity()
                } else {
                    T::lit((u - 0.5) * spread.powi((i % 7) as i32 - 3))
                }
            })
            .collect()
    }

    fn bits<T: Real>(v: &[T]) -> Vec<u64> {
        v.iter().map(|x| WithDType::to_f64(*x).to_bits()).collect()
    }

    /// Every row-wise kernel, over `rows` rows of `t`, against itself one row at a time (the
    /// single-row path, [`FOLD_ROWS`] rows never folded together), at `level`.
    fn blocks_against_single_rows<T: Real>(level: SimdLevel, rows: usize, t: usize) -> Vec<u64> {
        let n = rows * t;
        let x = values::<T>(n, 1 + n as u64, 10.0, false);
        let g = values::<T>(n, 2 + n as u64, 10.0, false);
        let w = values::<T>(t, 3, 10.0, false);
        let b = values::<T>(t, 4, 10.0, false);
        // scores: exponentials of comparable size, so their sum depends on its order
        let scores = values::<T>(n, 5 + n as u64, 1.5, false);
        let key_bias = values::<T>(t, 6, 1.0, true);
        let eps = T::lit(1e-5);
        let one_by_one = |f: &mut dyn FnMut(std::ops::Range<usize>)| {
            for r in 0..rows {
                f(r * t..(r + 1) * t);
            }
        };
        let mut all = Vec::new();
        // softmax
        let mut y = vec![T::zero(); n];
        // SAFETY (all `uninit`): the kernels write values only.
        softmax_rows(level, &scores, &key_bias, unsafe { uninit(&mut y) });
        let mut want = vec![T::zero(); n];
        one_by_one(&mut |r| {
            softmax_rows(level, &scores[r.clone()], &key_bias, unsafe {
                uninit(&mut want[r])
            })
        });
        assert!(bits(&y) == bits(&want), "softmax, {rows} rows of {t}");
        all.extend(bits(&y));
        // its gradient
        let mut dx = vec![T::zero(); n];
        softmax_grad_rows(level, &y, &g, t, &mut dx);
        one_by_one(&mut |r| {
            softmax_grad_rows(level, &y[r.clone()], &g[r.clone()], t, &mut want[r])
        });
        assert!(
            bits(&dx) == bits(&want),
            "softmax gradient, {rows} rows of {t}"
        );
        all.extend(bits(&dx));
        // LayerNorm forward, input gradient and parameter gradients (summed over the rows)
        ln_forward(level, &x, &w, &b, eps, unsafe { uninit(&mut y) });
        one_by_one(&mut |r| {
            ln_forward(level, &x[r.clone()], &w, &b, eps, unsafe {
                uninit(&mut want[r])
            })
        });
        assert!(bits(&y) == bits(&want), "layer norm, {rows} rows of {t}");
        all.extend(bits(&y));
        ln_grad_input(level, (&x, &w, &g), eps, unsafe { uninit(&mut dx) }, None);
        one_by_one(&mut |r| {
            let o = unsafe { uninit(&mut want[r.clone()]) };
            ln_grad_input(level, (&x[r.clone()], &w, &g[r]), eps, o, None)
        });
        assert!(
            bits(&dx) == bits(&want),
            "layer norm gradient, {rows} rows of {t}"
        );
        all.extend(bits(&dx));
        let mut params = vec![T::zero(); 2 * t];
        ln_grad_params(level, &x, &g, t, eps, &mut params);
        let mut want_params = vec![T::zero(); 2 * t];
        one_by_one(&mut |r| ln_grad_params(level, &x[r.clone()], &g[r], t, eps, &mut want_params));
        assert!(
            bits(&params) == bits(&want_params),
            "layer norm parameters, {rows} rows of {t}"
        );
        // both gradients in one pass: each with its own kernel's bits
        let mut both = vec![T::zero(); 2 * t];
        ln_grad_input(
            level,
            (&x, &w, &g),
            eps,
            unsafe { uninit(&mut want) },
            Some(&mut both),
        );
        assert!(
            bits(&want) == bits(&dx) && bits(&both) == bits(&params),
            "layer norm gradients in one pass, {rows} rows of {t}"
        );
        all.extend(bits(&params));
        all
    }

    fn rows_in_blocks<T: Real>() {
        let levels: Vec<SimdLevel> = [SimdLevel::Baseline, SimdLevel::Avx2, SimdLevel::Avx512]
            .into_iter()
            .filter(|l| *l <= SimdLevel::detected())
            .collect();
        // Whole blocks and rows left over, rows of whole lane chunks and ragged ones.
        for (rows, t) in [
            (37, 64),
            (2 * FOLD_ROWS, 17),
            (FOLD_ROWS + 3, 5),
            (3, 1),
            (40, 33),
        ] {
            let first = blocks_against_single_rows::<T>(levels[0], rows, t);
            for &level in &levels[1..] {
                let other = blocks_against_single_rows::<T>(level, rows, t);
                assert!(
                    other == first,
                    "{level:?} against {:?}, {rows} rows of {t}",
                    levels[0]
                );
            }
        }
    }

    /// The fused layer's LayerNorm backward ([`LayerNormGrad`]) against the two ops it stands
    /// for, over more rows than a chunk of the parameter sums and a ragged last chunk.
    fn layer_norm_grads_in_one_pass<T: Real>() {
        use super::layer_norm::{LayerNormGrad, LayerNormGradInput, LayerNormGradParams};
        for (rows, d) in [(200, 40), (64, 64), (7, 5)] {
            let x = values::<T>(rows * d, 11, 10.0, false);
            let g = values::<T>(rows * d, 12, 10.0, false);
            let w = values::<T>(d, 13, 10.0, false);
            for simd in [SimdLevel::Baseline, SimdLevel::Avx2, SimdLevel::Avx512] {
                let (dx, params) = LayerNormGrad { eps: 1e-5, simd }.run(&x, &w, &g);
                let want_dx = LayerNormGradInput { eps: 1e-5, simd }.run(&x, &w, &g);
                let want_params = LayerNormGradParams { eps: 1e-5, simd }.run(&x, &g, d);
                assert!(bits(&dx) == bits(&want_dx), "dx, {rows} x {d}, {simd:?}");
                assert!(
                    bits(&params) == bits(&want_params),
                    "params, {rows} x {d}, {simd:?}"
                );
            }
        }
    }

    #[test]
    fn layer_norm_gradients_in_one_pass_have_each_ops_bits() {
        layer_norm_grads_in_one_pass::<f32>();
        layer_norm_grads_in_one_pass::<f64>();
    }

    #[test]
    fn rows_reduced_in_blocks_keep_each_rows_own_bits_at_every_level() {
        rows_in_blocks::<f32>();
        rows_in_blocks::<f64>();
    }
}
