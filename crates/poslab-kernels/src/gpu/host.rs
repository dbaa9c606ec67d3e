//! The twin's access to host memory: values of a [`Mem`] read into the compute dtype and
//! written back rounded to the storage dtype, and the row loop the twin's operations share.

use std::ops::Range;

use candle::{DType, Result};
use half::{bf16, f16};
use rayon::prelude::*;

use super::Mem;

/// A stored value, computed as `C`.
pub trait Store<C>: Copy + Send + Sync + 'static {
    const DTYPE: DType;
    fn get(self) -> C;
    fn put(c: C) -> Self;
    fn nan() -> Self;
}

impl Store<f64> for f64 {
    const DTYPE: DType = DType::F64;
    fn get(self) -> f64 {
        self
    }
    fn put(c: f64) -> Self {
        c
    }
    fn nan() -> Self {
        f64::NAN
    }
}

impl Store<f32> for f32 {
    const DTYPE: DType = DType::F32;
    fn get(self) -> f32 {
        self
    }
    fn put(c: f32) -> Self {
        c
    }
    fn nan() -> Self {
        f32::NAN
    }
}

impl Store<f32> for bf16 {
    const DTYPE: DType = DType::BF16;
    fn get(self) -> f32 {
        self.to_f32()
    }
    fn put(c: f32) -> Self {
        bf16::from_f32(c)
    }
    fn nan() -> Self {
        bf16::NAN
    }
}

impl Store<f32> for f16 {
    const DTYPE: DType = DType::F16;
    fn get(self) -> f32 {
        self.to_f32()
    }
    fn put(c: f32) -> Self {
        f16::from_f32(c)
    }
    fn nan() -> Self {
        f16::NAN
    }
}

/// The values `range` of `m`, as `C`.
pub(crate) fn load<S: Store<C>, C>(m: Mem, range: Range<usize>) -> Vec<C> {
    debug_assert!(range.end <= m.len && m.dtype == S::DTYPE);
    let ptr = m.addr as *const S;
    // SAFETY: a `Mem` spans live memory of its dtype (the caller's buffer or candle storage,
    // alive for the whole operation), and `range` lies within it (checked by the callers).
    range.map(|i| unsafe { ptr.add(i).read() }.get()).collect()
}

/// One value of `m`.
pub(crate) fn load1<S: Store<C>, C>(m: Mem, i: usize) -> C {
    debug_assert!(i < m.len && m.dtype == S::DTYPE);
    // SAFETY: as in `load`.
    unsafe { (m.addr as *const S).add(i).read() }.get()
}

/// Writes `values` into `m` from `at`, rounded to `S`.
pub(crate) fn store<S: Store<C>, C: Copy>(m: Mem, at: usize, values: &[C]) {
    debug_assert!(at + values.len() <= m.len && m.dtype == S::DTYPE);
    let ptr = m.addr as *mut S;
    for (i, v) in values.iter().enumerate() {
        // SAFETY: as in `load`; operations write disjoint rows from their tasks.
        unsafe { ptr.add(at + i).write(S::put(*v)) };
    }
}

/// Checks that `m` holds `len` values of `S`.
pub(crate) fn holds<S: Store<C>, C>(m: Mem, len: usize, what: &str) -> Result<()> {
    m.holds(len, S::DTYPE, what)
}

/// Checks that `m` holds `len` values of the compute dtype (statistics, tables, key bias).
pub(crate) fn holds_c<C: Store<C>>(m: Mem, len: usize, what: &str) -> Result<()> {
    m.holds(len, C::DTYPE, what)
}

/// Rows of `width`, one task each (in parallel over rows for the larger calls).
pub(crate) fn rows_par(rows: usize, width: usize, f: impl Fn(usize) + Sync + Send) {
    if rows * width >= 1 << 15 {
        (0..rows).into_par_iter().for_each(f);
    } else {
        (0..rows).for_each(f);
    }
}
