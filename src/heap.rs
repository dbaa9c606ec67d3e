//! Live heap bytes and their high-water mark, where the program installs [`Counting`] as its
//! global allocator (the `poslab` binary does): how `poslab bench --launches` measures the peak
//! memory of a training step on the CPU, where every tensor lives on the heap, as a GPU's
//! memory pool measures it there.
//!
//! Two relaxed atomic operations per allocation and per free; the allocation itself is the
//! system's (glibc's, tuned by [`crate::tune_allocator`]).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The system allocator, counting the bytes it holds.
pub struct Counting;

fn grew(bytes: usize) {
    let live = LIVE.fetch_add(bytes, Relaxed) + bytes;
    PEAK.fetch_max(live, Relaxed);
}

fn shrank(bytes: usize) {
    LIVE.fetch_sub(bytes, Relaxed);
}

// SAFETY: every call is passed to `System` as it came; the counters only observe.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            INSTALLED.store(true, Relaxed);
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as above.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            INSTALLED.store(true, Relaxed);
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

/// Bytes allocated and not yet freed, when [`Counting`] is the global allocator.
pub fn live_bytes() -> Option<usize> {
    INSTALLED.load(Relaxed).then(|| LIVE.load(Relaxed))
}

/// The most bytes allocated at once since [`reset_peak`], when [`Counting`] is the global
/// allocator.
pub fn peak_bytes() -> Option<usize> {
    INSTALLED.load(Relaxed).then(|| PEAK.load(Relaxed))
}

/// Starts the high-water mark again from what lives now.
pub fn reset_peak() {
    PEAK.store(LIVE.load(Relaxed), Relaxed);
}
