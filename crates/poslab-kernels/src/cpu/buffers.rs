//! Output buffers: zeroed or written in parallel, never filled twice, and the rows each parallel
//! task takes.

use rayon::prelude::*;

use super::Real;

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
pub(super) fn rows_per_task(row: usize) -> usize {
    (16_384 / row.max(1)).max(1)
}
