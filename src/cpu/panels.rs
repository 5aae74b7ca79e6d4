//! Per-thread buffers for packed operands, shared by the bf16 vector kernels
//! (`bf16`), the AMX tiles (`amx`) and the f32 AVX2 tile (`sgemm`, as f32 bits): one
//! set per thread, reused product after product, so packing never allocates in a
//! training step.

use std::cell::RefCell;

/// Pack buffers, one set per thread, grown on first use and then reused (by
/// `bf16`'s, `amx`'s and `sgemm`'s kernels, which a thread never runs at once).
#[derive(Default)]
pub(super) struct Panels {
    pub a: Vec<u32>,
    /// `bf16`'s packed A split into its f32 halves, for the kernels that widen.
    pub halves: Vec<u32>,
    pub b: Vec<u32>,
    pub column: Vec<u32>,
}

thread_local! {
    /// Borrowed only while packing and multiplying, which never wait on other jobs.
    pub(super) static PANELS: RefCell<Panels> = RefCell::new(Panels::default());
}

/// The first `len` words of `buffer`, grown if needed. Stale contents are left: the
/// packers overwrite every word the kernel reads.
/// The slice starts on a 64-byte boundary, so the kernel's 64-byte panel loads never
/// straddle two cache lines.
pub(super) fn scratch(buffer: &mut Vec<u32>, len: usize) -> &mut [u32] {
    const SLACK: usize = 64 / 4;
    if buffer.len() < len + SLACK {
        buffer.resize(len + SLACK, 0);
    }
    let skip = buffer.as_ptr().align_offset(64).min(SLACK);
    &mut buffer[skip..skip + len]
}
