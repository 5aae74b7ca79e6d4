//! How work is spread over the threads. Row-wise passes (norms, activations, residual
//! adds, the optimiser) give each thread one contiguous share of the rows. Every row sees the same
//! arithmetic whatever the number of threads; only sums across rows (norm weight
//! gradients) are split into partials, added in order, and those parts are set by the
//! shape ([`summed_share_rows`]), so results depend neither on thread timing nor on the
//! thread count.

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

/// As [`on_workers`], with the pool's other threads kept awake through the call: each
/// spins on `rayon::yield_now`, taking work from the pool (the call's forked passes) as
/// soon as it is pushed, instead of going to sleep between two parallel passes and being
/// woken through the kernel for the next. A training step has over a hundred passes;
/// kept awake, the baby model's forward and backward took 8% less time, 6L/384's 3%
/// (Zen 5, 2 threads).
///
/// One spinner a thread (a broadcast), for one call at a time (a call begun while
/// another is awake runs as [`on_workers`]). A spinner never outlives the call, leaves
/// after [`AWAKE_IDLE`] without work, and after [`AWAKE_MOST`] in all: a thread may take
/// its spinner up inside a job it is running (of another call, or of this one, waiting
/// in a join), and that job waits until the spinner leaves.
pub fn on_workers_awake<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;
    static AWAKE: AtomicBool = AtomicBool::new(false);
    if rayon::current_num_threads() < 2
        || AWAKE
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
    {
        return on_workers(f);
    }
    /// Lets the next call keep the pool awake, however this one ends.
    struct Awake;
    impl Drop for Awake {
        fn drop(&mut self) {
            AWAKE.store(false, Ordering::Release);
        }
    }
    let _awake = Awake;
    let done = AtomicBool::new(false);
    rayon::scope(|scope| {
        let caller = rayon::current_thread_index();
        let done = &done;
        scope.spawn_broadcast(move |_, context| {
            if Some(context.index()) == caller {
                return;
            }
            let start = Instant::now();
            let mut last_work = start;
            while !done.load(Ordering::Acquire) {
                if rayon::yield_now() == Some(rayon::Yield::Executed) {
                    last_work = Instant::now();
                } else if last_work.elapsed() > AWAKE_IDLE || start.elapsed() > AWAKE_MOST {
                    return;
                } else {
                    std::hint::spin_loop();
                }
            }
        });
        let result = f();
        done.store(true, Ordering::Release);
        result
    })
}

/// How long a spinner of [`on_workers_awake`] waits for work before it leaves: longer
/// than the serial stretches between a step's parallel passes (microseconds).
const AWAKE_IDLE: std::time::Duration = std::time::Duration::from_micros(200);

/// How long a spinner of [`on_workers_awake`] spins at most: a baby step's backward
/// (8 ms) in full, a large model's first passes.
const AWAKE_MOST: std::time::Duration = std::time::Duration::from_millis(20);

/// Rows per share for `rows` rows of `width` elements: all of them when small.
pub fn share_rows(rows: usize, width: usize) -> usize {
    let threads = threads();
    if threads < 2 || rows * width < MIN_PARALLEL {
        rows.max(1)
    } else {
        rows.div_ceil(threads)
    }
}

/// Rows per part of a pass whose parts' sums are added afterwards, in part order (a
/// norm's gain gradient): all of them when small, else an eighth, whatever the thread
/// count. Cut per thread ([`share_rows`]), the order of the adds, and so the bits,
/// followed RAYON_NUM_THREADS: a run resumed under another count left the unbroken
/// run's path by an ulp at a time.
pub fn summed_share_rows(rows: usize, width: usize) -> usize {
    const PARTS: usize = 8;
    if rows * width < MIN_PARALLEL {
        rows.max(1)
    } else {
        rows.div_ceil(PARTS)
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

/// Splits a product's dst (m x n) over `threads`: the longer side in one contiguous
/// share per thread, in whole register tiles (`tile` = its rows and columns), each
/// share's `part(rows, cols)` on a thread of the pool, the first on this one. The
/// shares are disjoint, so `part` may write its block of dst.
pub(crate) fn split_dst(
    (m, n): (usize, usize),
    threads: usize,
    (tile_rows, tile_cols): (usize, usize),
    part: impl Fn(std::ops::Range<usize>, std::ops::Range<usize>) + Sync,
) {
    let (len, unit) = if m >= n {
        (m, tile_rows)
    } else {
        (n, tile_cols)
    };
    let share = len.div_ceil(threads.max(1)).div_ceil(unit).max(1) * unit;
    let run = |i: usize| {
        let range = i * share..((i + 1) * share).min(len);
        if m >= n {
            part(range, 0..n)
        } else {
            part(0..m, range)
        }
    };
    let run = &run;
    rayon::scope(|scope| {
        for i in 1..len.div_ceil(share) {
            scope.spawn(move |_| run(i));
        }
        run(0);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// Passes kept awake from four threads at once, each forking nested work (as the
    /// gemm crate does inside a pass), on a pool of four: every pass finishes with every
    /// item counted, none waits on a spinner forever.
    #[test]
    fn awake_passes_at_once_with_nested_work_all_finish() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let pool = std::sync::Arc::new(pool);
        for caller in 0..4 {
            let (pool, tx) = (pool.clone(), tx.clone());
            std::thread::spawn(move || {
                for round in 0..100 {
                    let count = AtomicUsize::new(0);
                    pool.install(|| {
                        on_workers_awake(|| {
                            (0..8).into_par_iter().for_each(|_| {
                                (0..64).into_par_iter().for_each(|_| {
                                    count.fetch_add(1, Ordering::Relaxed);
                                });
                            });
                            if round % 7 == 0 {
                                // A serial stretch longer than a spinner waits.
                                std::thread::sleep(Duration::from_millis(1));
                            }
                        })
                    });
                    assert_eq!(count.into_inner(), 8 * 64);
                }
                tx.send(caller).unwrap();
            });
        }
        drop(tx);
        for _ in 0..4 {
            rx.recv_timeout(Duration::from_secs(60))
                .expect("every caller's passes finish within a minute");
        }
    }
}
