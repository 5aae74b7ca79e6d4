//! The binary's allocator: the system's, with large blocks starting on a cache line.
//!
//! glibc hands out big blocks 16 bytes past a page boundary, so every 64-byte vector
//! load and store over a large activation buffer straddles two cache lines (measured:
//! 8% of the bf16 training step). Large blocks here come from malloc/calloc with a
//! cache line of slack, start at the first cache line past a header word that records
//! where the block really starts. calloc keeps the kernel's lazily zeroed pages, so
//! untouched buffers cost no memory (an aligned `System` allocation would memset).

use std::alloc::{GlobalAlloc, Layout, System};

/// Blocks at least this large start on a cache line.
const LARGE: usize = 4096;
#[cfg(unix)]
const CACHE_LINE: usize = 64;
/// Slack for the header word and the rounding up.
#[cfg(unix)]
const SLACK: usize = CACHE_LINE + std::mem::size_of::<usize>();

pub struct CacheLineAligned;

/// Whether this allocator places the block itself (else `System` does, as asked).
fn is_large(layout: &Layout) -> bool {
    cfg!(unix) && layout.size() >= LARGE && layout.align() <= 16
}

#[cfg(unix)]
unsafe fn alloc_large(size: usize, zeroed: bool) -> *mut u8 {
    let raw = if zeroed {
        libc::calloc(1, size + SLACK)
    } else {
        libc::malloc(size + SLACK)
    } as *mut u8;
    if raw.is_null() {
        return raw;
    }
    let start = raw as usize + std::mem::size_of::<usize>();
    let block = raw.add(start.next_multiple_of(CACHE_LINE) - raw as usize);
    // The header word sits just below the block, inside the slack.
    block.cast::<*mut u8>().sub(1).write_unaligned(raw);
    block
}

#[cfg(unix)]
unsafe fn free_large(block: *mut u8) {
    libc::free(block.cast::<*mut u8>().sub(1).read_unaligned().cast());
}

#[cfg(not(unix))]
unsafe fn alloc_large(_: usize, _: bool) -> *mut u8 {
    unreachable!("is_large is false off unix")
}

#[cfg(not(unix))]
unsafe fn free_large(_: *mut u8) {
    unreachable!("is_large is false off unix")
}

// Safety: large blocks are placed by `alloc_large` and freed by `free_large` only
// (`is_large` is a function of the layout, which the caller repeats on free); every
// other block goes to `System` with the caller's layout.
unsafe impl GlobalAlloc for CacheLineAligned {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if is_large(&layout) {
            alloc_large(layout.size(), false)
        } else {
            System.alloc(layout)
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if is_large(&layout) {
            alloc_large(layout.size(), true)
        } else {
            System.alloc_zeroed(layout)
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if is_large(&layout) {
            free_large(ptr)
        } else {
            System.dealloc(ptr, layout)
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new = Layout::from_size_align_unchecked(new_size, layout.align());
        if !is_large(&layout) && !is_large(&new) {
            return System.realloc(ptr, layout, new_size);
        }
        let fresh = self.alloc(new);
        if !fresh.is_null() {
            std::ptr::copy_nonoverlapping(ptr, fresh, layout.size().min(new_size));
            self.dealloc(ptr, layout);
        }
        fresh
    }
}

// Off unix every block is `System`'s, as asked: nothing of ours to test.
#[cfg(all(test, unix))]
mod tests {
    use super::*;

    #[test]
    fn large_blocks_start_on_a_cache_line_and_keep_their_bytes() {
        let a = CacheLineAligned;
        unsafe {
            for size in [LARGE, LARGE + 3, 1 << 20, 5 << 20] {
                let layout = Layout::from_size_align(size, 4).unwrap();
                let zeroed = a.alloc_zeroed(layout);
                assert_eq!(zeroed as usize % CACHE_LINE, 0, "size {size}");
                assert!(std::slice::from_raw_parts(zeroed, size)
                    .iter()
                    .all(|&b| b == 0));
                a.dealloc(zeroed, layout);
                let block = a.alloc(layout);
                assert_eq!(block as usize % CACHE_LINE, 0, "size {size}");
                a.dealloc(block, layout);
            }
            // Growing across the threshold and shrinking back keep the contents.
            let small = Layout::from_size_align(100, 4).unwrap();
            let p = a.alloc(small);
            for i in 0..100 {
                *p.add(i) = i as u8;
            }
            let p = a.realloc(p, small, 3 * LARGE);
            assert_eq!(p as usize % CACHE_LINE, 0);
            let large = Layout::from_size_align(3 * LARGE, 4).unwrap();
            let p = a.realloc(p, large, 50);
            for i in 0..50 {
                assert_eq!(*p.add(i), i as u8);
            }
            a.dealloc(p, Layout::from_size_align(50, 4).unwrap());
        }
    }
}
