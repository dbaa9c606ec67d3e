//! Student's t distribution, for the verdicts' intervals and p-values: the two-sided tail
//! `P(|T| >= t)` and the quantiles, at any positive (fractional) degrees of freedom, accurate
//! in the far tail (the p-values Holm's correction decides on).
//!
//! The tail is the regularized incomplete beta function, `P(|T| >= t) = I_x(ν/2, 1/2)` with
//! `x = ν / (ν + t²)`, computed by its continued fraction (modified Lentz), on the side of the
//! symmetry `I_x(a, b) = 1 - I_{1-x}(b, a)` where the fraction converges fast; the quantile
//! inverts it by bisection.

/// Above this many degrees of freedom, the normal distribution (the t's limit; the two differ
/// by less than 1e-9 in a two-sided p of 1e-4).
const NORMAL_DF: f64 = 1e10;

/// `P(|T| >= |t|)` for Student's t with `df` degrees of freedom (`df > 0`); 1 at `t = 0`.
pub fn two_sided_p(t: f64, df: f64) -> f64 {
    debug_assert!(df > 0.0, "df = {df}");
    let t = t.abs();
    if t == 0.0 || t.is_nan() {
        return 1.0;
    }
    if t.is_infinite() {
        return 0.0;
    }
    if df >= NORMAL_DF {
        return libm::erfc(t / std::f64::consts::SQRT_2);
    }
    // x = ν / (ν + t²) and 1 - x = t² / (ν + t²), each computed directly (no cancellation).
    let t2 = t * t;
    let (x, y) = (df / (df + t2), t2 / (df + t2));
    incomplete_beta(df / 2.0, 0.5, x, y)
}

/// The `q`-quantile of Student's t with `df` degrees of freedom, for `0.5 <= q < 1`: the `t`
/// with `P(T <= t) = q`.
pub fn quantile(q: f64, df: f64) -> f64 {
    debug_assert!((0.5..1.0).contains(&q), "q = {q}");
    two_sided_quantile(2.0 * (1.0 - q), df)
}

/// The `t` with `P(|T| >= t) = tail` for Student's t with `df` degrees of freedom, `0 < tail
/// <= 1`; precise for tails far below `f64::EPSILON` (where `quantile`'s `1 - q` is not).
pub fn two_sided_quantile(tail: f64, df: f64) -> f64 {
    if tail >= 1.0 {
        return 0.0;
    }
    if tail <= 0.0 {
        return f64::INFINITY;
    }
    // A bracket [lo, hi] with P(|T| >= lo) > tail >= P(|T| >= hi).
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    while two_sided_p(hi, df) > tail {
        lo = hi;
        hi *= 2.0;
        if hi > 1e300 {
            return f64::INFINITY;
        }
    }
    // Newton's method on ln P(|T| >= t), whose slope is -2 f(t) / P, kept inside the bracket
    // (a step that leaves it is a bisection instead).
    let target = tail.ln();
    let mut t = 0.5 * (lo + hi);
    for _ in 0..200 {
        let p = two_sided_p(t, df);
        if p > tail {
            lo = t;
        } else {
            hi = t;
        }
        let step = (p.ln() - target) * p / (2.0 * density(t, df));
        let mut next = t + step;
        if !(next > lo && next < hi) {
            next = 0.5 * (lo + hi);
        }
        if (next - t).abs() <= 4.0 * f64::EPSILON * t || hi - lo <= 4.0 * f64::EPSILON * hi {
            return next;
        }
        t = next;
    }
    t
}

/// The density of Student's t with `df` degrees of freedom at `t`.
fn density(t: f64, df: f64) -> f64 {
    if df >= NORMAL_DF {
        return (-0.5 * t * t).exp() / (2.0 * std::f64::consts::PI).sqrt();
    }
    let ln = ln_gamma((df + 1.0) / 2.0)
        - ln_gamma(df / 2.0)
        - 0.5 * (df * std::f64::consts::PI).ln()
        - (df + 1.0) / 2.0 * (t * t / df).ln_1p();
    ln.exp()
}

/// The regularized incomplete beta function `I_x(a, b)`, given `x` and `y = 1 - x` (each
/// computed without cancellation by the caller).
fn incomplete_beta(a: f64, b: f64, x: f64, y: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    if y <= 0.0 {
        return 1.0;
    }
    // x^a y^b / B(a, b), in logarithms.
    let ln_front = a * x.ln() + b * y.ln() + ln_gamma(a + b) - ln_gamma(a) - ln_gamma(b);
    if x < (a + 1.0) / (a + b + 2.0) {
        (ln_front.exp() * continued_fraction(a, b, x) / a).clamp(0.0, 1.0)
    } else {
        (1.0 - ln_front.exp() * continued_fraction(b, a, y) / b).clamp(0.0, 1.0)
    }
}

/// `ln Γ(v)` for `v > 0`.
fn ln_gamma(v: f64) -> f64 {
    libm::lgamma(v)
}

/// One step of the modified Lentz method with partial numerator `aa`: updates `c` and `d` and
/// gives the factor the fraction's value is multiplied by.
fn lentz_step(aa: f64, c: &mut f64, d: &mut f64) -> f64 {
    const TINY: f64 = 1e-300;
    *d = 1.0 + aa * *d;
    if d.abs() < TINY {
        *d = TINY;
    }
    *c = 1.0 + aa / *c;
    if c.abs() < TINY {
        *c = TINY;
    }
    *d = 1.0 / *d;
    *d * *c
}

/// The continued fraction of the incomplete beta function (Numerical Recipes' `betacf`, by
/// the modified Lentz method).
fn continued_fraction(a: f64, b: f64, x: f64) -> f64 {
    const TINY: f64 = 1e-300;
    const EPS: f64 = 1e-16;
    let (qab, qap, qam) = (a + b, a + 1.0, a - 1.0);
    let mut c = 1.0;
    let mut d = 1.0 - qab * x / qap;
    if d.abs() < TINY {
        d = TINY;
    }
    d = 1.0 / d;
    let mut h = d;
    for m in 1..10_000 {
        let m = f64::from(m);
        let m2 = 2.0 * m;
        // The even step, then the odd.
        h *= lentz_step(m * (b - m) * x / ((qam + m2) * (a + m2)), &mut c, &mut d);
        let delta = lentz_step(
            -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)),
            &mut c,
            &mut d,
        );
        h *= delta;
        if (delta - 1.0).abs() < EPS {
            break;
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(got: f64, want: f64, rel: f64) -> bool {
        (got - want).abs() <= rel * want.abs()
    }

    #[test]
    fn the_tail_matches_closed_forms_at_one_and_two_degrees_of_freedom() {
        // ν = 1 (Cauchy): 1 - 2 atan(t) / π, i.e. 2 atan(1 / t) / π; ν = 2: 1 - t / √(2 + t²).
        for t in [0.01f64, 0.5, 1.0, 3.0, 12.706, 100.0, 1e4, 1e8] {
            let one = 2.0 * (1.0 / t).atan() / std::f64::consts::PI;
            let two = 1.0 - t / (2.0 + t * t).sqrt();
            // 1 - t / √(2 + t²) in a form without cancellation for large t.
            let two_far = 2.0 / ((2.0 + t * t).sqrt() * ((2.0 + t * t).sqrt() + t));
            let two = if t > 1.0 { two_far } else { two };
            assert!(
                close(two_sided_p(t, 1.0), one, 1e-12),
                "t {t}: {}",
                two_sided_p(t, 1.0)
            );
            assert!(
                close(two_sided_p(t, 2.0), two, 1e-12),
                "t {t}: {}",
                two_sided_p(t, 2.0)
            );
        }
        assert_eq!(two_sided_p(0.0, 3.0), 1.0);
        assert_eq!(two_sided_p(f64::INFINITY, 3.0), 0.0);
    }

    #[test]
    fn tails_and_quantiles_match_scipy() {
        // 2 * scipy.stats.t.sf(t, df) and t.ppf(q, df) (SciPy 1.x; mpmath's incomplete beta
        // at 40 digits gives the same to the digits shown).
        let tails = [
            (2.0, 2.5, 0.157_391_495_757_966),
            (4.302_652_729_749_462, 2.0, 0.05),
            (10.0, 2.0, 0.009_852_457_023_325_69),
            (1000.0, 2.0, 9.999_985_000_025e-7),
            (3.0, 4.7, 0.032_539_273_977_036_78),
            (25.0, 5.0, 1.910_677_784_395_423_4e-6),
            (50.0, 30.0, 1.871_541_765_922_271_3e-30),
            (1.959_963_984_540_054, 1e12, 0.05),
        ];
        for (t, df, want) in tails {
            let got = two_sided_p(t, df);
            assert!(close(got, want, 1e-9), "t {t}, df {df}: {got} vs {want}");
        }
        let quantiles = [
            (0.975, 1.0, 12.706_204_736_174_693),
            (0.975, 2.0, 4.302_652_729_749_462),
            (0.975, 4.0, 2.776_445_105_197_793_5),
            (0.975, 9.0, 2.262_157_162_798_205),
            (0.975, 2.37, 3.718_920_839_797_456_7),
            (0.8, 2.0, 1.060_660_171_779_821_4),
            (0.999_99, 3.0, 47.927_728_376_006_71),
            (0.975, 1e12, 1.959_963_984_540_054),
        ];
        for (q, df, want) in quantiles {
            let got = quantile(q, df);
            assert!(close(got, want, 1e-9), "q {q}, df {df}: {got} vs {want}");
        }
        // Far tails, given as tails: each quantile's tail is the tail asked for.
        for (tail, df) in [
            (1e-30, 2.0),
            (1e-12, 7.5),
            (3e-7, 1.0),
            (0.5, 40.0),
            (1e-200, 3.0),
        ] {
            let t = two_sided_quantile(tail, df);
            assert!(
                close(two_sided_p(t, df), tail, 1e-9),
                "tail {tail}, df {df}: t {t}"
            );
        }
    }
}
