//! A counting global allocator: heap bytes live, for the memory figures.
//!
//! The binary installs [`Counting`] as its global allocator; [`live_bytes`] then reads what is
//! allocated and not yet freed, across all threads (an index's worker threads included).

#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

static LIVE: AtomicIsize = AtomicIsize::new(0);

/// The system allocator, counting bytes.
pub struct Counting;

// SAFETY: every call forwards to `System` with the caller's arguments unchanged; the counter
// has no effect on the memory returned.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        // SAFETY: as the trait's contract, passed through.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
        // SAFETY: as the trait's contract, passed through.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        // SAFETY: as the trait's contract, passed through.
        unsafe { System.realloc(p, l, new) }
    }
}

/// Heap bytes allocated and not freed (0 unless [`Counting`] is the global allocator).
pub fn live_bytes() -> isize {
    LIVE.load(Ordering::Relaxed)
}
