//! The shipped allocator (src/alloc.rs) keeps every layout's alignment and
//! every block's bytes: plain mimalloc blocks for word alignment and below,
//! aligned ones above, across the sizes where mimalloc's paths differ
//! (small bins, over 1 KiB, over a page, huge).

#[path = "../src/alloc.rs"]
mod alloc;

use std::alloc::{GlobalAlloc, Layout};

static A: alloc::Mimalloc = alloc::Mimalloc;

const SIZES: &[usize] = &[
    1,
    3,
    7,
    8,
    9,
    24,
    40,
    100,
    1000,
    1025,
    1500,
    4096,
    5000,
    70_000,
    3 << 20,
];
const ALIGNS: &[usize] = &[1, 2, 4, 8, 16, 32, 64, 4096];

/// The bytes `fill` writes and `holds` checks: all of a small block, a
/// spread of a large one (the test runs unoptimised).
fn places(n: usize) -> impl Iterator<Item = usize> {
    (0..n)
        .step_by(if n > 8192 { 61 } else { 1 })
        .chain(n.checked_sub(1))
}

fn fill(p: *mut u8, n: usize, seed: u8) {
    // SAFETY: `p` holds at least `n` bytes (the caller's live block).
    let s = unsafe { std::slice::from_raw_parts_mut(p, n) };
    for i in places(n) {
        s[i] = seed.wrapping_add(i as u8);
    }
}

fn holds(p: *const u8, n: usize, seed: u8) -> bool {
    // SAFETY: as in `fill`.
    let s = unsafe { std::slice::from_raw_parts(p, n) };
    places(n).all(|i| s[i] == seed.wrapping_add(i as u8))
}

#[test]
fn every_layout_is_aligned_and_keeps_its_bytes_through_realloc() {
    for &align in ALIGNS {
        for &size in SIZES {
            let layout = Layout::from_size_align(size, align).unwrap();
            // SAFETY: sizes are non-zero; each block is used within its
            // current size, resized and freed with the layout it has then,
            // and freed once.
            unsafe {
                let z = A.alloc_zeroed(layout);
                assert_eq!(z as usize % align, 0, "zeroed {size} align {align}");
                assert!(std::slice::from_raw_parts(z, size).iter().all(|&b| b == 0));
                A.dealloc(z, layout);

                let mut p = A.alloc(layout);
                assert_eq!(p as usize % align, 0, "alloc {size} align {align}");
                fill(p, size, 7);
                let mut now = size;
                // Up through every size, then down again.
                for &to in SIZES.iter().chain(SIZES.iter().rev()) {
                    let q = A.realloc(p, Layout::from_size_align(now, align).unwrap(), to);
                    assert!(!q.is_null());
                    assert_eq!(q as usize % align, 0, "realloc {now} -> {to} align {align}");
                    assert!(
                        holds(q, now.min(to), 7),
                        "realloc {now} -> {to} align {align}"
                    );
                    fill(q, to, 7);
                    (p, now) = (q, to);
                }
                A.dealloc(p, Layout::from_size_align(now, align).unwrap());
            }
        }
    }
}
