//! Buffers that start on a cache line, large ones on huge pages.
//!
//! Decoding streams every weight from memory once a token, and reads it fastest in
//! whole 64-byte lines (`matvec`). A `Vec` starts wherever the allocator puts it (16
//! bytes past a page, for a large one from glibc), which would split every line-wide
//! load of a row in two: the weights the decoder converts or copies are held in these.
//! And it reads them fastest from 2 MiB pages: the hardware prefetchers stop at every
//! 4 KiB page's end, which a weight matrix streamed once a token crosses every 64 lines.

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

/// The bytes of a cache line.
pub const LINE: usize = 64;

/// A plain value that fits a line a whole number of times.
///
/// # Safety
/// Every bit pattern, all zeros included, is a valid value; the size divides [`LINE`]
/// and the alignment is at most it.
pub unsafe trait Plain: Copy + Send + Sync + 'static {}

// Safety: every bit pattern is a value of each; 1, 2 and 4 divide 64.
unsafe impl Plain for f32 {}
unsafe impl Plain for half::f16 {}
unsafe impl Plain for i8 {}
unsafe impl Plain for u8 {}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; LINE]);

/// `len` values of `T` from the start of a cache line.
pub struct Lines<T: Plain> {
    memory: Memory,
    len: usize,
    of: PhantomData<T>,
}

/// Where a buffer's lines lie: on the heap, or (large ones, where the kernel lends
/// transparent huge pages) in an anonymous mapping from a huge page's boundary.
enum Memory {
    Heap(Vec<Line>),
    #[cfg(target_os = "linux")]
    Huge {
        map: memmap2::MmapMut,
        start: usize,
    },
}

/// The bytes of an x86-64 / aarch64 transparent huge page.
#[cfg(target_os = "linux")]
const HUGE_PAGE: usize = 2 << 20;

impl Memory {
    fn zeroed(lines: usize) -> Self {
        #[cfg(target_os = "linux")]
        if lines * LINE >= HUGE_PAGE && huge_pages_lent() {
            if let Some(huge) = Self::huge(lines * LINE) {
                return huge;
            }
        }
        Memory::Heap(vec![Line([0; LINE]); lines])
    }

    /// `bytes` zeros from a huge page's boundary, asked to be held in huge pages (a
    /// plain loop of loads over 500 MB reads 35 -> 43 GB/s on two Zen 5 cores; an f32
    /// token decodes 7-8% faster: PERFORMANCE.md). The mapping's zeros are the
    /// kernel's, made as pages are first written, so a tail never touched costs
    /// nothing; the tail past the last whole huge page is held in small ones.
    #[cfg(target_os = "linux")]
    fn huge(bytes: usize) -> Option<Self> {
        let map = memmap2::MmapMut::map_anon(bytes + HUGE_PAGE).ok()?;
        let start = (map.as_ptr() as usize).next_multiple_of(HUGE_PAGE) - map.as_ptr() as usize;
        map.advise_range(memmap2::Advice::HugePage, start, bytes)
            .ok()?;
        Some(Memory::Huge { map, start })
    }

    fn as_ptr(&self) -> *const u8 {
        match self {
            Memory::Heap(lines) => lines.as_ptr().cast(),
            #[cfg(target_os = "linux")]
            Memory::Huge { map, start } => map[*start..].as_ptr(),
        }
    }

    fn as_mut_ptr(&mut self) -> *mut u8 {
        match self {
            Memory::Heap(lines) => lines.as_mut_ptr().cast(),
            #[cfg(target_os = "linux")]
            Memory::Huge { map, start } => map[*start..].as_mut_ptr(),
        }
    }
}

/// Whether large buffers are held on huge pages: where the kernel lends transparent
/// huge pages to a mapping that asks (its setting reads `[always]` or `[madvise]`, not
/// `[never]`; the file is absent where the kernel has none), this process is not barred
/// from them (`THP_enabled: 0` in /proc/self/status, after `prctl(PR_SET_THP_DISABLE)`)
/// and `TINYGPT_HUGE_PAGES` is not `0`. Elsewhere (macOS, Windows) never.
pub fn huge_pages_lent() -> bool {
    static LENT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *LENT.get_or_init(|| {
        let barred = || {
            std::fs::read_to_string("/proc/self/status").is_ok_and(|status| {
                status
                    .lines()
                    .any(|l| l.split_whitespace().eq(["THP_enabled:", "0"]))
            })
        };
        cfg!(target_os = "linux")
            && std::env::var_os("TINYGPT_HUGE_PAGES").is_none_or(|v| v != "0")
            && std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
                .is_ok_and(|setting| !setting.contains("[never]"))
            && !barred()
    })
}

impl<T: Plain> Lines<T> {
    /// `len` values whose bits are all zero.
    pub fn zeroed(len: usize) -> Self {
        let per_line = LINE / std::mem::size_of::<T>();
        Self {
            memory: Memory::zeroed(len.div_ceil(per_line)),
            len,
            of: PhantomData,
        }
    }

    pub fn copy_of(values: &[T]) -> Self {
        let mut lines = Self::zeroed(values.len());
        lines.copy_from_slice(values);
        lines
    }
}

impl<T: Plain> Deref for Lines<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // Safety: the lines hold at least `len` values of `T` (`Plain`: any bits are
        // one, the size divides a line, the alignment is at most a line's).
        unsafe { std::slice::from_raw_parts(self.memory.as_ptr().cast::<T>(), self.len) }
    }
}

impl<T: Plain> DerefMut for Lines<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // Safety: as in `deref`; the borrow of `self` is unique.
        unsafe { std::slice::from_raw_parts_mut(self.memory.as_mut_ptr().cast::<T>(), self.len) }
    }
}

impl<T: Plain> std::fmt::Debug for Lines<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lines({} values)", self.len)
    }
}

impl<T: Plain> Clone for Lines<T> {
    fn clone(&self) -> Self {
        Self::copy_of(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_on_a_line_and_holds_its_values() {
        for len in [0, 1, 15, 16, 17, 1000] {
            let values: Vec<f32> = (0..len).map(|i| i as f32 * 0.5).collect();
            let lines = Lines::copy_of(&values);
            assert_eq!(lines.as_ptr() as usize % LINE, 0);
            assert_eq!(&*lines, &values[..]);
        }
    }

    /// A buffer of a huge page or more starts on one and is marked for huge pages
    /// (`hg` in its mapping's flags in /proc/self/smaps), where the kernel lends them;
    /// it reads back what was written, and so does its clone.
    #[test]
    #[cfg(target_os = "linux")]
    fn large_buffers_lie_on_huge_pages_where_lent() {
        if !huge_pages_lent() {
            eprintln!("SKIPPED: no transparent huge pages here (or TINYGPT_HUGE_PAGES=0)");
            return;
        }
        let len = (3 << 20) / 4 + 5; // 3 MiB and a few: a huge page and a tail
        let mut lines = Lines::<f32>::zeroed(len);
        assert!(lines.iter().all(|&v| v == 0.0));
        for (i, v) in lines.iter_mut().enumerate() {
            *v = i as f32;
        }
        let start = lines.as_ptr() as usize;
        assert_eq!(start % HUGE_PAGE, 0, "starts on a huge page");
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut flags = None;
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((lo, hi)) = range.split_once('-') {
                    if let (Ok(lo), Ok(hi)) =
                        (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
                    {
                        inside = (lo..hi).contains(&start);
                        continue;
                    }
                }
            }
            if inside && line.starts_with("VmFlags:") {
                flags = Some(line.to_string());
            }
        }
        let flags = flags.expect("the buffer's mapping is in /proc/self/smaps");
        // The aarch64 build's tests run under qemu-user, which takes the advice
        // without passing it on to the kernel.
        if cfg!(target_arch = "x86_64") {
            assert!(flags.split_whitespace().any(|f| f == "hg"), "{flags}");
        }
        let copy = lines.clone();
        assert!(copy.iter().enumerate().all(|(i, &v)| v == i as f32));
        assert_eq!(copy.len(), len);
    }
}
