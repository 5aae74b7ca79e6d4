//! Matrix products for the fast paths, through the `gemm` crate (AVX-512 kernels where
//! the CPU has them).

use gemm::Parallelism;

pub use crate::config::Precision;

use super::bf16::{matmul_bf16, matmul_bf16_serial};

/// Products smaller than this (in multiply-adds) stay on one thread: handing work to
/// another costs more than it saves.
pub(super) const PARALLEL_MIN_MACS: usize = 1 << 22;

/// Threads for large products: candle's count (RAYON_NUM_THREADS, else the physical
/// cores), looked up once: candle reads the environment and /proc/cpuinfo per call.
pub fn threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(candle_core::utils::get_num_threads)
}

fn parallelism(m: usize, n: usize, k: usize) -> Parallelism {
    let threads = threads();
    if threads > 1 && m * n * k >= PARALLEL_MIN_MACS {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    }
}

/// How a matrix operand is stored, row-major.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// As used: (rows, cols).
    AsIs,
    /// Transposed: the operand (rows, cols) is stored as (cols, rows).
    Transposed,
}

/// dst (m x n) = a (m x k) · b (k x n), or += with `accumulate`; `a_layout` and
/// `b_layout` say whether each operand is stored as used or transposed. Spread over
/// threads when large.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    dst: &mut [f32],
    a: &[f32],
    a_layout: Layout,
    b: &[f32],
    b_layout: Layout,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
    precision: Precision,
) {
    let a = Strided::new(a, a_layout, m, k);
    let b = Strided::new(b, b_layout, k, n);
    match precision {
        Precision::Bf16 => matmul_bf16(dst, n, a, b, (m, n, k), accumulate, 1.0),
        Precision::F32 => {
            let threads = parallelism(m, n, k);
            gemm_f32(dst, n, a, b, (m, n, k), accumulate, 1.0, threads)
        }
    }
}

/// Structure a product inside causal attention can exploit: parts of a (T x T)
/// operand are zero, or parts of the result are never read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Causal {
    /// A plain product.
    No,
    /// Only dst's lower triangle (column <= row) is needed; the rest may be left stale.
    LowerDst,
    /// A is lower triangular: A[i][k] = 0 for k > i.
    LowerA,
    /// A is upper triangular: A[i][k] = 0 for k < i.
    UpperA,
}

/// Rows per block when the f32 path splits a causal product: a block of rows
/// [i0, i1) needs columns (or k) up to i1 only, or from i0 on.
const CAUSAL_BLOCK: usize = 64;

/// Panics unless dst (m x n, rows `dst_row` apart), a (m x k) and b (k x n) hold every
/// element a product touches.
pub(super) fn check_bounds(
    dst: &[f32],
    dst_row: usize,
    a: &Strided,
    b: &Strided,
    (m, n, k): (usize, usize, usize),
) {
    if m == 0 || n == 0 {
        return;
    }
    let last = |s: &Strided, rows: usize, cols: usize| (rows - 1) * s.row + (cols - 1) * s.col;
    assert!(dst.len() > (m - 1) * dst_row + n - 1 && dst_row >= n);
    assert!(k == 0 || (a.data.len() > last(a, m, k) && b.data.len() > last(b, k, n)));
}

/// A matrix operand given by its first element and (row, column) strides.
#[derive(Clone, Copy)]
pub struct Strided<'a> {
    pub data: &'a [f32],
    pub row: usize,
    pub col: usize,
}

impl<'a> Strided<'a> {
    /// The operand from element (row, col) on.
    pub fn offset(self, row: usize, col: usize) -> Self {
        Self {
            data: &self.data[row * self.row + col * self.col..],
            ..self
        }
    }

    /// A dense (rows x cols) operand stored as `layout` says.
    pub fn new(data: &'a [f32], layout: Layout, rows: usize, cols: usize) -> Self {
        match layout {
            Layout::AsIs => Self {
                data,
                row: cols,
                col: 1,
            },
            Layout::Transposed => Self {
                data,
                row: 1,
                col: rows,
            },
        }
    }
}

/// dst (m x n, rows `dst_row` apart) = dst (if `accumulate`) + beta * a · b, on
/// this thread: for the many small products inside attention, already spread over
/// threads by the caller. `causal` says what may be skipped (see `Causal`).
#[allow(clippy::too_many_arguments)]
pub fn matmul_strided(
    dst: &mut [f32],
    dst_row: usize,
    a: Strided,
    b: Strided,
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
    beta: f32,
    causal: Causal,
    precision: Precision,
) {
    if precision == Precision::Bf16 {
        let problem = (m, n, k);
        return matmul_bf16_serial(dst, dst_row, a, b, problem, accumulate, beta, causal);
    }
    // The gemm crate knows no structure: split the rows into blocks, each multiplied
    // over the columns or k it needs (a plain product is one block).
    let block = match causal {
        Causal::No => m.max(1),
        _ => CAUSAL_BLOCK,
    };
    for i0 in (0..m).step_by(block) {
        let i1 = (i0 + block).min(m);
        let rows = &mut dst[i0 * dst_row..];
        let (a, b, n, k) = match causal {
            Causal::No => (a.offset(i0, 0), b, n, k),
            Causal::LowerDst => (a.offset(i0, 0), b, n.min(i1), k),
            Causal::LowerA => (a.offset(i0, 0), b, n, k.min(i1)),
            Causal::UpperA => (a.offset(i0, i0), b.offset(i0, 0), n, k - i0.min(k)),
        };
        let here = Parallelism::None;
        gemm_f32(rows, dst_row, a, b, (i1 - i0, n, k), accumulate, beta, here);
    }
}

/// dst = dst (if `accumulate`) + beta * a · b in f32, through the gemm crate.
#[allow(clippy::too_many_arguments)]
fn gemm_f32(
    dst: &mut [f32],
    dst_row: usize,
    a: Strided,
    b: Strided,
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
    beta: f32,
    threads: Parallelism,
) {
    check_bounds(dst, dst_row, &a, &b, (m, n, k));
    // Safety: checked above: every element gemm reads or writes is inside the slices
    // (it handles empty sizes itself).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_row as isize,
            accumulate,
            a.data.as_ptr(),
            a.col as isize,
            a.row as isize,
            b.data.as_ptr(),
            b.col as isize,
            b.row as isize,
            1.0,
            beta,
            false,
            false,
            false,
            threads,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_layout_matches_the_definition() {
        let (m, n, k) = (6, 5, 9);
        let a: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect(); // m x k
        let b: Vec<f32> = (0..k * n).map(|i| (i % 7) as f32 * 0.2 - 0.5).collect(); // k x n
        let t = |x: &[f32], r: usize, c: usize| -> Vec<f32> {
            (0..r * c).map(|i| x[(i % r) * c + i / r]).collect() // (c x r) transposed copy
        };
        let (at, bt) = (t(&a, m, k), t(&b, k, n));
        let expected: Vec<f32> = (0..m * n)
            .map(|i| (0..k).map(|p| a[(i / n) * k + p] * b[p * n + i % n]).sum())
            .collect();
        for (aa, al) in [(&a, Layout::AsIs), (&at, Layout::Transposed)] {
            for (bb, bl) in [(&b, Layout::AsIs), (&bt, Layout::Transposed)] {
                let mut out = vec![1.0f32; m * n];
                matmul(&mut out, aa, al, bb, bl, m, n, k, true, Precision::F32);
                for (o, e) in out.iter().zip(&expected) {
                    assert!((o - (1.0 + e)).abs() < 1e-5, "{al:?} {bl:?}");
                }
            }
        }
    }

    /// The f32 path's causal splitting against plain products, past one row block.
    #[test]
    fn causal_splits_match_plain_products() {
        let (t, d) = (150, 7);
        let values = |len: usize, seed: usize| -> Vec<f32> {
            (0..len)
                .map(|i| ((i * 31 + seed * 17) % 23) as f32 * 0.1 - 1.1)
                .collect()
        };
        for causal in [Causal::LowerDst, Causal::LowerA, Causal::UpperA] {
            let (m, n, k) = match causal {
                Causal::LowerDst => (t, t, d),
                _ => (t, d, t),
            };
            let mut a_data = values(m * k, 1);
            for i in 0..m {
                for kk in 0..k {
                    let zero = match causal {
                        Causal::LowerA => kk > i,
                        Causal::UpperA => kk < i,
                        _ => false,
                    };
                    if zero {
                        a_data[i * k + kk] = 0.0;
                    }
                }
            }
            let b_data = values(k * n, 2);
            let a = Strided {
                data: &a_data,
                row: k,
                col: 1,
            };
            let b = Strided {
                data: &b_data,
                row: n,
                col: 1,
            };
            let start = values(m * n, 3);
            let (mut split, mut plain) = (start.clone(), start);
            let f32s = Precision::F32;
            matmul_strided(&mut split, n, a, b, (m, n, k), true, 0.5, causal, f32s);
            matmul_strided(&mut plain, n, a, b, (m, n, k), true, 0.5, Causal::No, f32s);
            for i in 0..m {
                for j in 0..n {
                    if causal == Causal::LowerDst && j > i {
                        continue;
                    }
                    let (s, p) = (split[i * n + j], plain[i * n + j]);
                    assert!((s - p).abs() < 1e-4, "{causal:?} ({i},{j}): {s} vs {p}");
                }
            }
        }
    }
}
