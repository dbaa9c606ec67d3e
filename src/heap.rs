//! Live heap bytes and their high-water mark, where the program installs [`Counting`] as its
//! global allocator (the `poslab` binary does) and turns the count on with [`start_counting`]
//! (`poslab bench --launches` does, first thing): how it measures the peak memory of a training
//! step on the CPU, where every tensor lives on the heap, as a GPU's memory pool measures it
//! there.
//!
//! Until it is turned on, the count costs one relaxed load of a flag that is never written, per
//! allocation and per free: counting costs every allocation two atomic read-modify-writes on one
//! shared cache line, which threads allocating at once contend for (43% of the time of a dry run
//! that tokenizes on two threads, and a quarter of the default compare's wall time, when it was
//! always on). The allocation itself is the system's (glibc's, tuned by
//! [`crate::tune_allocator`]).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering::Relaxed};

/// Bytes allocated minus bytes freed since the count started (a free of an earlier
/// allocation can take it below 0).
static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);
static COUNTING: AtomicBool = AtomicBool::new(false);

/// Turns the count on, from 0 bytes: call it before what is to be measured is allocated.
pub fn start_counting() {
    LIVE.store(0, Relaxed);
    PEAK.store(0, Relaxed);
    COUNTING.store(true, Relaxed);
}

/// The system allocator, counting the bytes it holds.
pub struct Counting;

fn grew(bytes: usize) {
    if COUNTING.load(Relaxed) {
        let bytes = bytes as isize;
        let live = LIVE.fetch_add(bytes, Relaxed) + bytes;
        PEAK.fetch_max(live, Relaxed);
    }
}

fn shrank(bytes: usize) {
    if COUNTING.load(Relaxed) {
        LIVE.fetch_sub(bytes as isize, Relaxed);
    }
}

// SAFETY: every call is passed to `System` as it came; the counters only observe.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as above.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as above.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            shrank(layout.size());
            grew(new_size);
        }
        p
    }
}

/// Bytes allocated since the count started and not yet freed, when [`Counting`] is the global
/// allocator and counts.
pub fn live_bytes() -> Option<usize> {
    COUNTING
        .load(Relaxed)
        .then(|| LIVE.load(Relaxed).max(0) as usize)
}

/// The most bytes allocated at once (counting from [`start_counting`]) since [`reset_peak`],
/// when [`Counting`] is the global allocator and counts.
pub fn peak_bytes() -> Option<usize> {
    COUNTING
        .load(Relaxed)
        .then(|| PEAK.load(Relaxed).max(0) as usize)
}

/// Starts the high-water mark again from what lives now.
pub fn reset_peak() {
    PEAK.store(LIVE.load(Relaxed), Relaxed);
}
