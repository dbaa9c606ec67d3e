//! The numbers the kernels run on ([`Real`]: f32 and f64) and the scalar functions they
//! share: `exp`, `ln`, `erf`, the normal's CDF and density, and the sigmoid, each with the same
//! bits at every instruction set level.

use candle::WithDType;

/// The numbers the kernels run on.
pub trait Real:
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
    /// `exp(-x²/2)`. `erf` has the bits of `erf_f32``(x/√2)`: `|x|/√2` rounds as `|x/√2|` does.
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
pub fn exp_f32(x: f32) -> f32 {
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
pub fn ln_f32(x: f32) -> f32 {
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
pub fn ln_1p_f32(x: f32) -> f32 {
    let w = 1.0 + x;
    ln_f32(w) - ((w - 1.0) - x) / w
}

/// `erf(x)` in f32 with an absolute error below 1.5e-7 (Abramowitz & Stegun 7.1.26, the form
/// PyTorch's vectorised CPU `erf` uses).
#[inline(always)]
pub fn erf_f32(x: f32) -> f32 {
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
