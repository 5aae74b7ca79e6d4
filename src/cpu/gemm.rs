//! Matrix products for the fused engine: f32 on AVX2 cores through our own tile
//! (`sgemm`: the layers' products of 128 rows or more, and attention's, any size),
//! elsewhere through the `gemm` crate's blocking and micro-kernels; bf16 operands through
//! our own kernel (`bf16`).
//!
//! The `gemm` crate picks its micro-kernels once, by CPU detection alone. We call its
//! generic driver with the micro-kernels of the active level instead (`cpu::isa`), so
//! `TINYGPT_CPU_ISA` caps the products too. On aarch64 the portable level's micro-kernels
//! are the crate's NEON ones (NEON is that architecture's baseline). With the
//! `accelerate` feature on macOS, Apple's `cblas_sgemm` takes the f32 products instead
//! (`accelerate`).

use gemm_common::Parallelism;

pub use crate::config::Precision;

use super::bf16;
use super::isa;
use super::matrix::{Causal, Product, PARALLEL_MIN_MACS};
use super::threads::threads;

/// Rows per block when the f32 path splits a causal product: a block of rows
/// [i0, i1) needs columns (or k) up to i1 only, or from i0 on.
const CAUSAL_BLOCK: usize = 64;

/// dst (rows `dst_row` apart) = the product `p` in `precision`, spread over the threads
/// when it is large. Plain products only (no causal structure).
pub fn matmul(dst: &mut [f32], dst_row: usize, p: Product, precision: Precision) {
    debug_assert_eq!(p.causal, Causal::No);
    match precision {
        Precision::Bf16 => bf16::matmul(dst, dst_row, p),
        Precision::F32 => {
            let threads = if p.macs() >= PARALLEL_MIN_MACS {
                threads()
            } else {
                1
            };
            gemm_f32(dst, dst_row, p, threads)
        }
    }
}

/// The product `p` on this thread, skipping what its `causal` allows: for the many
/// small products inside attention, already spread over threads by the caller. On x86
/// cores with AVX2 our tiles skip tile by tile (`sgemm`; on AVX-512 the baby model's
/// attention took 20% less time than through the crate, Sapphire Rapids); the `gemm`
/// crate elsewhere, in blocks of rows.
pub fn matmul_serial(dst: &mut [f32], dst_row: usize, p: Product, precision: Precision) {
    if precision == Precision::Bf16 {
        return bf16::matmul_serial(dst, dst_row, p);
    }
    #[cfg(target_arch = "x86_64")]
    if isa::active() >= isa::Isa::Avx2 {
        // Our tile skips the triangles tile by tile, whatever the product's rows.
        p.check_bounds(dst, dst_row);
        // Safety: bounds checked above; the active level is one the CPU has.
        return unsafe { super::sgemm::multiply(dst, dst_row, p, 1) };
    }
    // The gemm crate knows no structure: split the rows into blocks, each multiplied
    // over the columns or k it needs (a plain product is one block).
    let block = match p.causal {
        Causal::No => p.m.max(1),
        _ => CAUSAL_BLOCK,
    };
    for i0 in (0..p.m).step_by(block) {
        let i1 = (i0 + block).min(p.m);
        let rows = p.block(i0..i1, 0..p.n);
        let part = match p.causal {
            Causal::No => rows,
            Causal::LowerDst => Product {
                n: p.n.min(i1),
                ..rows
            },
            Causal::LowerA => Product {
                k: p.k.min(i1),
                ..rows
            },
            Causal::UpperA => rows.k_range(i0.min(p.k), p.k - i0.min(p.k)),
        };
        gemm_f32(&mut dst[i0 * dst_row..], dst_row, part, 1);
    }
}

/// Rows or columns a thread's share of a product through the gemm crate rounds to: a
/// whole number of the crate's f32 vectors at every level (16 lanes at AVX-512, 8 at
/// AVX2, 4 at NEON), so only the last share ends in a part-filled one.
const CRATE_SHARE_UNIT: usize = 48;

/// dst = dst (if accumulating) + beta * a · b in f32 on up to `threads` threads: on
/// AVX2 cores through our own tile (`sgemm`) when it has the rows to repay packing,
/// otherwise through the gemm crate's driver and the micro-kernels of the active level.
fn gemm_f32(dst: &mut [f32], dst_row: usize, p: Product, threads: usize) {
    p.check_bounds(dst, dst_row);
    #[cfg(all(feature = "accelerate", target_os = "macos"))]
    if super::accelerate::sgemm(dst, dst_row, p) {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa::active() == isa::Isa::Avx2 && p.m >= super::sgemm::MIN_ROWS {
        // Safety: bounds checked above; the active level is one the CPU has.
        return unsafe { super::sgemm::multiply(dst, dst_row, p, threads) };
    }
    let dst_ptr = dst.as_mut_ptr();
    if threads < 2 {
        // Safety: bounds checked above.
        return unsafe { crate_gemm(dst_ptr, dst_row, p) };
    }
    // One block of dst per thread, each through the crate on one thread, rather than
    // the crate's own threading: on a 2-core Xeon (model 167) its split ran the 6L/384
    // products 0-20% slower and less evenly (examples/gemm_probe). The crate picks its
    // k blocking from k alone, so a block's sums run in one thread's order: the thread
    // count never changes the bits.
    let dst = SharedDst(dst_ptr);
    let unit = (CRATE_SHARE_UNIT, CRATE_SHARE_UNIT);
    super::threads::split_dst((p.m, p.n), threads, unit, |rows, cols| {
        let at = rows.start * dst_row + cols.start;
        // Safety: the blocks are disjoint and inside the bounds checked above.
        unsafe { crate_gemm(dst.at(at), dst_row, p.block(rows, cols)) }
    });
}

/// dst = dst (if accumulating) + beta * a · b through the gemm crate's driver with the
/// micro-kernels of the active level, on this thread.
///
/// # Safety
/// Every element of the product's operands and of its m x n block of `dst` (rows
/// `dst_row` apart) must be in bounds, and no other thread may touch that block.
unsafe fn crate_gemm(dst: *mut f32, dst_row: usize, p: Product) {
    let kernel: GemmF32 = match isa::active() {
        #[cfg(target_arch = "x86_64")]
        isa::Isa::Avx512 | isa::Isa::Amx => avx512::gemm,
        #[cfg(target_arch = "x86_64")]
        isa::Isa::Avx2 => avx2::gemm,
        // NEON is aarch64's baseline: its micro-kernels are the portable level there.
        #[cfg(target_arch = "aarch64")]
        _ => neon::gemm,
        #[cfg(not(target_arch = "aarch64"))]
        _ => scalar::gemm,
    };
    // The micro-kernels prefer a column-major destination: a row-major one (ours) is
    // multiplied as its transpose, dstᵀ = bᵀ aᵀ, as the crate's own entry point does.
    let (dst_cs, dst_rs) = (1, dst_row as isize);
    let transpose = dst_cs < dst_rs;
    let (m, n, lhs, rhs, dst_cs, dst_rs) = if transpose {
        (p.n, p.m, p.b.transpose(), p.a.transpose(), dst_rs, dst_cs)
    } else {
        (p.m, p.n, p.a, p.b, dst_cs, dst_rs)
    };
    // Safety: the caller keeps every element gemm reads or writes in bounds (it handles
    // empty sizes itself); the active level is one the CPU has.
    unsafe {
        kernel(
            m,
            n,
            p.k,
            dst,
            dst_cs,
            dst_rs,
            p.accumulate,
            lhs.data.as_ptr(),
            lhs.col as isize,
            lhs.row as isize,
            rhs.data.as_ptr(),
            rhs.col as isize,
            rhs.row as isize,
            1.0,
            p.beta,
            false,
            false,
            false,
            Parallelism::None,
        )
    }
}

/// `dst` shared by the threads that write its disjoint blocks.
#[derive(Clone, Copy)]
struct SharedDst(*mut f32);

// Safety: each thread writes only its own block (`split_dst`).
unsafe impl Sync for SharedDst {}

impl SharedDst {
    fn at(self, offset: usize) -> *mut f32 {
        // Safety: offsets stay inside the dst whose bounds the product checked.
        unsafe { self.0.add(offset) }
    }
}

/// The gemm crate's f32 entry point: (m, n, k, dst, dst column and row strides,
/// read dst, lhs and strides, rhs and strides, alpha, beta, three conjugation flags,
/// threads).
type GemmF32 = unsafe fn(
    usize,
    usize,
    usize,
    *mut f32,
    isize,
    isize,
    bool,
    *const f32,
    isize,
    isize,
    *const f32,
    isize,
    isize,
    f32,
    f32,
    bool,
    bool,
    bool,
    Parallelism,
);

/// One level's entry point: the crate's generic driver with that level's micro-kernels
/// (as the crate's own `gemm_def!` builds them), `$lanes` f32 to a vector.
macro_rules! level_gemm {
    ($level:ident, $kernels:ident, $simd:ident, $lanes:expr) => {
        mod $level {
            use gemm_common::gemm::gemm_basic_generic;
            use gemm_common::simd::MixedSimd;
            use gemm_common::Parallelism;
            use gemm_f32::microkernel::$kernels::f32 as ukr;

            #[allow(clippy::too_many_arguments)]
            pub unsafe fn gemm(
                m: usize,
                n: usize,
                k: usize,
                dst: *mut f32,
                dst_cs: isize,
                dst_rs: isize,
                read_dst: bool,
                lhs: *const f32,
                lhs_cs: isize,
                lhs_rs: isize,
                rhs: *const f32,
                rhs_cs: isize,
                rhs_rs: isize,
                alpha: f32,
                beta: f32,
                conj_dst: bool,
                conj_lhs: bool,
                conj_rhs: bool,
                threads: Parallelism,
            ) {
                let simd = <gemm_common::simd::$simd as MixedSimd<f32, f32, f32, f32>>::try_new()
                    .expect("the active level is one the CPU has");
                gemm_basic_generic::<
                    _,
                    f32,
                    $lanes,
                    { ukr::MR_DIV_N * $lanes },
                    { ukr::NR },
                    { ukr::MR_DIV_N },
                    { ukr::H_M },
                    { ukr::H_N },
                >(
                    simd,
                    m,
                    n,
                    k,
                    dst,
                    dst_cs,
                    dst_rs,
                    read_dst,
                    lhs,
                    lhs_cs,
                    lhs_rs,
                    rhs,
                    rhs_cs,
                    rhs_rs,
                    alpha,
                    beta,
                    conj_dst,
                    conj_lhs,
                    conj_rhs,
                    |a, b, c| a * b + c,
                    &ukr::UKR,
                    &ukr::H_UKR,
                    false,
                    threads,
                )
            }
        }
    };
}

#[cfg(not(target_arch = "aarch64"))]
level_gemm!(scalar, scalar, Scalar, 1);
// The crate's own aarch64 choice: NEON micro-kernels of 4 f32 lanes, scalar glue.
#[cfg(target_arch = "aarch64")]
level_gemm!(neon, neon, Scalar, 4);
#[cfg(target_arch = "x86_64")]
level_gemm!(avx2, fma, V3, 8);
#[cfg(target_arch = "x86_64")]
level_gemm!(avx512, avx512f, V4, 16);

#[cfg(test)]
mod tests {
    use super::super::matrix::{Layout, Strided};
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
                let (sa, sb) = (Strided::dense(aa, al, m, k), Strided::dense(bb, bl, k, n));
                let p = Product::new(sa, sb, (m, n, k)).accumulating();
                matmul(&mut out, n, p, Precision::F32);
                for (o, e) in out.iter().zip(&expected) {
                    assert!((o - (1.0 + e)).abs() < 1e-5, "{al:?} {bl:?}");
                }
            }
        }
    }

    /// Split by rows (m >= n) or by columns over 2 and 3 threads, the f32 product at the
    /// active level has the bits of one thread's.
    #[test]
    fn threads_do_not_change_the_bits() {
        let values = |len: usize, seed: usize| -> Vec<f32> {
            (0..len)
                .map(|i| ((i * 37 + seed * 11) % 29) as f32 * 0.07 - 1.0)
                .collect()
        };
        for (m, n, k) in [(301, 70, 400), (70, 301, 400)] {
            let (a, b) = (values(m * k, 1), values(k * n, 2));
            let p = Product::new(Strided::rows(&a, k), Strided::columns(&b, k), (m, n, k))
                .accumulating()
                .scaled(0.5);
            let mut one = values(m * n, 3);
            gemm_f32(&mut one, n, p, 1);
            for threads in [2, 3] {
                let mut many = values(m * n, 3);
                gemm_f32(&mut many, n, p, threads);
                assert!(
                    one.iter()
                        .zip(&many)
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{m}x{n}x{k} on {threads}"
                );
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
                for kk in (0..k).filter(|&kk| causal.zero_in_a(i, kk)) {
                    a_data[i * k + kk] = 0.0;
                }
            }
            let b_data = values(k * n, 2);
            let (a, b) = (Strided::rows(&a_data, k), Strided::rows(&b_data, n));
            let p = Product::new(a, b, (m, n, k)).accumulating().scaled(0.5);
            let start = values(m * n, 3);
            let (mut split, mut plain) = (start.clone(), start);
            matmul_serial(&mut split, n, p.causal(causal), Precision::F32);
            matmul_serial(&mut plain, n, p, Precision::F32);
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
