//! Matrix products for the fast paths, through the `gemm` crate (AVX-512 kernels where
//! the CPU has them).

use gemm::Parallelism;

/// Products smaller than this (in multiply-adds) stay on one thread: handing work to
/// another costs more than it saves.
const PARALLEL_MIN_MACS: usize = 1 << 18;

fn parallelism(m: usize, n: usize, k: usize) -> Parallelism {
    let threads = candle_core::utils::get_num_threads();
    if threads > 1 && m * n * k >= PARALLEL_MIN_MACS {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    }
}

/// out (m x n) = a (m x k) · wᵀ, with w stored (n x k) row-major like a linear layer's
/// weight; with `accumulate`, out += instead of =.
pub fn matmul_wt(
    out: &mut [f32],
    a: &[f32],
    w: &[f32],
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) {
    assert!(out.len() >= m * n && a.len() >= m * k && w.len() >= n * k);
    // Safety: the asserts above bound every index gemm touches given these strides.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism(m, n, k),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_definition() {
        let (m, n, k) = (5, 7, 19);
        let a: Vec<f32> = (0..m * k).map(|i| (i % 11) as f32 * 0.1 - 0.5).collect();
        let w: Vec<f32> = (0..n * k).map(|i| (i % 7) as f32 * 0.2 - 0.6).collect();
        let mut out = vec![1.0f32; m * n];
        matmul_wt(&mut out, &a, &w, m, n, k, true);
        for i in 0..m {
            for j in 0..n {
                let dot: f32 = (0..k).map(|p| a[i * k + p] * w[j * k + p]).sum();
                assert!((out[i * n + j] - (1.0 + dot)).abs() < 1e-5);
            }
        }
        matmul_wt(&mut out, &a, &w, m, n, k, false);
        let dot: f32 = (0..k).map(|p| a[p] * w[p]).sum();
        assert!((out[0] - dot).abs() < 1e-5);
    }
}
