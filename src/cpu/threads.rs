//! How work is spread over the threads. Row-wise passes (norms, activations, residual
//! adds, the optimiser) give each thread one contiguous share of the rows. Every row sees the same
//! arithmetic whatever the number of threads; only sums across rows (norm weight
//! gradients) are split into per-share partials, added in share order, so results do
//! not depend on thread timing.

use std::cell::Cell;

use rayon::prelude::*;

/// Threads for parallel work: candle's count (RAYON_NUM_THREADS, else the physical
/// cores), looked up once: candle reads the environment and /proc/cpuinfo per call.
pub fn threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(candle_core::utils::get_num_threads)
}

/// Below this many elements a pass stays on one thread: waking another costs more.
const MIN_PARALLEL: usize = 1 << 14;

/// Runs `f` on one of the pool's threads (the caller waits): the many parallel
/// passes inside then fork and join within the pool instead of each waking it from
/// outside.
pub fn on_workers<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}

/// Rows per share for `rows` rows of `width` elements: all of them when small.
pub fn share_rows(rows: usize, width: usize) -> usize {
    let threads = threads();
    if threads < 2 || rows * width < MIN_PARALLEL {
        rows.max(1)
    } else {
        rows.div_ceil(threads)
    }
}

/// Elements per share of an elementwise pass over `len` values.
pub fn share_len(len: usize) -> usize {
    share_rows(len, 1)
}

/// out[i] = f(a[i], b[i]) over the threads.
pub fn zip_map(out: &mut [f32], a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32 + Sync) {
    let share = share_len(out.len());
    out.par_chunks_mut(share)
        .zip(a.par_chunks(share))
        .zip(b.par_chunks(share))
        .for_each(|((o, a), b)| {
            for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
                *o = f(a, b);
            }
        });
}

/// x[i] = f(x[i], y[i]) over the threads.
pub fn zip_in_place(x: &mut [f32], y: &[f32], f: impl Fn(f32, f32) -> f32 + Sync) {
    let share = share_len(x.len());
    x.par_chunks_mut(share)
        .zip(y.par_chunks(share))
        .for_each(|(x, y)| {
            for (x, &y) in x.iter_mut().zip(y) {
                *x = f(*x, y);
            }
        });
}

thread_local! {
    /// Scratch for per-share partial sums, kept by the calling thread between calls.
    static PARTIALS: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// Runs `f` with `len` zeroed values of this thread's scratch (reused from call to
/// call: no allocation per step).
pub fn with_partials<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    // Taken out for the call rather than borrowed: while `f` waits for other threads,
    // this thread may run another job that wants partials of its own (it then gets a
    // fresh buffer).
    let mut partials = PARTIALS.take();
    partials.clear();
    partials.resize(len, 0.0);
    let result = f(&mut partials);
    PARTIALS.set(partials);
    result
}
