//! Heap buffers that start on a cache line.
//!
//! Decoding streams every weight from memory once a token, and reads it fastest in
//! whole 64-byte lines (`matvec`). A `Vec` starts wherever the allocator puts it (16
//! bytes past a page, for a large one from glibc), which would split every line-wide
//! load of a row in two: the weights the decoder converts or copies are held in these.

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

// Safety: every bit pattern is an f32; 4 divides 64.
unsafe impl Plain for f32 {}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; LINE]);

/// `len` values of `T` from the start of a cache line.
#[derive(Clone)]
pub struct Lines<T: Plain> {
    lines: Vec<Line>,
    len: usize,
    of: PhantomData<T>,
}

impl<T: Plain> Lines<T> {
    /// `len` values whose bits are all zero.
    pub fn zeroed(len: usize) -> Self {
        let per_line = LINE / std::mem::size_of::<T>();
        Self {
            lines: vec![Line([0; LINE]); len.div_ceil(per_line)],
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
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<T>(), self.len) }
    }
}

impl<T: Plain> DerefMut for Lines<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // Safety: as in `deref`; the borrow of `self` is unique.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<T>(), self.len) }
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
}
