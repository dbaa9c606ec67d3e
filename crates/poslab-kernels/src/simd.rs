//! The instruction sets the kernels are compiled for ([`SimdLevel`]), the level in force, the
//! count of calls at each, and `simd_dispatch!`, which compiles a kernel body for each level and
//! picks one at run time.

use std::sync::OnceLock;

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

/// Kernel calls run at each level (baseline, AVX2, AVX-512) in this process.
static DISPATCHES: [std::sync::atomic::AtomicUsize; 3] =
    [const { std::sync::atomic::AtomicUsize::new(0) }; 3];

/// Counts a kernel call at `level`.
#[inline(always)]
#[cfg(feature = "fused")]
pub fn count_dispatch(level: SimdLevel) {
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

#[cfg(feature = "fused")]
/// Defines `$name`, which runs `$body` compiled for AVX-512 or AVX2 + FMA when `level` (its
/// first argument) asks for them and the CPU has them, and for the baseline target otherwise.
///
/// `fn` takes a safe body and counts the call ([`count_dispatch`]); `unsafe fn` takes an unsafe
/// one (raw pointers), is itself unsafe with the body's contract, and is not counted: the
/// attention's tiled head products run once per head, where a shared atomic on every core is
/// contention (the softmax beside each product is counted).
macro_rules! simd_dispatch {
    ($vis:vis fn $name:ident = $body:ident ($($arg:ident : $ty:ty),* $(,)?)) => {
        $vis fn $name<T: Real>(level: $crate::SimdLevel, $($arg: $ty),*) {
            let level = level.min($crate::SimdLevel::detected());
            $crate::count_dispatch(level);
            // SAFETY: the body is safe; the level is one the CPU has.
            #[allow(unused_unsafe)]
            unsafe {
                simd_dispatch!(@at level, $body ($($arg: $ty),*))
            }
        }
    };
    ($(#[$doc:meta])* $vis:vis unsafe fn $name:ident = $body:ident ($($arg:ident : $ty:ty),* $(,)?)) => {
        $(#[$doc])*
        $vis unsafe fn $name<T: Real>(level: $crate::SimdLevel, $($arg: $ty),*) {
            let level = level.min($crate::SimdLevel::detected());
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
                $crate::SimdLevel::Avx512 => return wide::<T>($($arg),*),
                $crate::SimdLevel::Avx2 => return narrow::<T>($($arg),*),
                $crate::SimdLevel::Baseline => {}
            }
        }
        $body::<T>($($arg),*)
    }};
}
