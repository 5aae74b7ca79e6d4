//! What this CPU does at best, the measure a profile's floor and MFU are taken
//! against: one large matrix product in the run's precision on the kernels' threads
//! (and, for how they scale, on one), and one large streaming pass (a residual add),
//! each the best of three after one untimed.

use std::time::{Duration, Instant};

use crate::config::Precision;
use crate::cpu::gemm::{matmul, matmul_serial};
use rayon::prelude::*;

use crate::cpu::kernels::{multiversion, sum_lanes};
use crate::cpu::lines::Lines;
use crate::cpu::matrix::{Product, Strided};
use crate::cpu::threads::{on_workers, threads, zip_map};
use crate::profile::Measured;

/// The side of the square product timed (2 GFLOP).
const SIDE: usize = 1024;
/// Values in each of the streaming pass's three buffers (64 MiB each: beyond caches).
const STREAM: usize = 1 << 24;

/// Times the product and the pass on this CPU (about a second on two cores).
pub fn measure(precision: Precision) -> Measured {
    let n = SIDE;
    let (a, b) = (vec![1.0f32; n * n], vec![0.5f32; n * n]);
    let mut out = vec![0.0f32; n * n];
    let product = best_of_three(|| {
        let p = Product::new(Strided::rows(&a, n), Strided::rows(&b, n), (n, n, n));
        on_workers(|| matmul(&mut out, n, p, precision));
    });
    let one_thread = best_of_three(|| {
        let p = Product::new(Strided::rows(&a, n), Strided::rows(&b, n), (n, n, n));
        matmul_serial(&mut out, n, p, precision);
    });
    let (x, y) = (vec![1.0f32; STREAM], vec![2.0f32; STREAM]);
    let mut sum = vec![0.0f32; STREAM];
    let stream = best_of_three(|| on_workers(|| zip_map(&mut sum, &x, &y, |x, y| x + y)));
    Measured {
        matrix_tflops: 2.0 * (n * n * n) as f64 / product.as_secs_f64() / 1e12,
        one_thread_tflops: Some(2.0 * (n * n * n) as f64 / one_thread.as_secs_f64() / 1e12),
        bandwidth_gbs: (3 * 4 * STREAM) as f64 / stream.as_secs_f64() / 1e9,
    }
}

/// Bytes the read pass reads: beyond the caches a CPU (or a VM's share of one) has.
const READ_BYTES: usize = 256 << 20;

/// What the decoder could stream its weights at, in GB/s: one pass of plain reads over
/// a buffer held as it holds its copies (`Lines`: on huge pages where the kernel lends
/// them; f32 weights read in place from the file lie on its 4 KiB pages instead),
/// a share on each of the kernels' threads; the best of three after one untimed
/// (about half a second). Decoding a token reads every weight once, so this is its
/// roofline.
pub fn read_pass_gbs() -> f64 {
    let mut buffer = Lines::<f32>::zeroed(READ_BYTES / 4);
    buffer.fill(1.0);
    let share = buffer.len().div_ceil(threads());
    let mut sums = 0.0;
    let time = best_of_three(|| {
        sums += on_workers(|| buffer.par_chunks(share).map(read_all).sum::<f32>());
    });
    std::hint::black_box(sums);
    READ_BYTES as f64 / time.as_secs_f64() / 1e9
}

multiversion! {
    /// The sum of `x`: each value read once, in whole vectors.
    pub fn read_all(x: &[f32]) -> f32 {
        sum_lanes(x, |v| v)
    }
}

fn best_of_three(mut work: impl FnMut()) -> Duration {
    work();
    (0..3)
        .map(|_| {
            let t = Instant::now();
            work();
            t.elapsed()
        })
        .min()
        .expect("three runs")
}
