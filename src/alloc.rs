//! The process's allocator: mimalloc, asked for plain blocks where a plain
//! block will do. Not a module of the library (which forbids unsafe code):
//! `main.rs`, `examples/bench.rs`, `tests/soak.rs` and `tests/alloc.rs`
//! include this file, so the bench and the tests measure the allocator
//! that ships.
//!
//! `mimalloc::MiMalloc` hands every allocation to `mi_malloc_aligned`,
//! whose fast path takes only blocks of 1 KiB or less found aligned;
//! anything larger whose size is not a power of two (hyper's read and
//! write buffers, a request body, a header map's entries) goes through its
//! generic path and is over-allocated to be aligned by hand. Every
//! mimalloc block is aligned to a word at least (mimalloc's own
//! `mi_realloc_aligned` relies on it), so a layout asking no more than
//! that goes to `mi_malloc`, `mi_zalloc` and `mi_realloc` directly; a
//! larger alignment, as before.

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys as mi;

pub struct Mimalloc;

/// The alignment every mimalloc block has.
const WORD: usize = std::mem::size_of::<usize>();

// SAFETY: each method passes the layout's size to mimalloc and, where the
// alignment is above a word, the alignment too; a plain mimalloc block is
// word-aligned. Blocks are freed and resized by mimalloc, which made them.
unsafe impl GlobalAlloc for Mimalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.align() <= WORD {
            mi::mi_malloc(layout.size()).cast()
        } else {
            mi::mi_malloc_aligned(layout.size(), layout.align()).cast()
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.align() <= WORD {
            mi::mi_zalloc(layout.size()).cast()
        } else {
            mi::mi_zalloc_aligned(layout.size(), layout.align()).cast()
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        mi::mi_free(ptr.cast::<c_void>());
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if layout.align() <= WORD {
            mi::mi_realloc(ptr.cast::<c_void>(), new_size).cast()
        } else {
            mi::mi_realloc_aligned(ptr.cast::<c_void>(), new_size, layout.align()).cast()
        }
    }
}
