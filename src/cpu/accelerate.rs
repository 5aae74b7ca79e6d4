//! The f32 products through Apple's Accelerate framework (`cblas_sgemm`), behind the
//! `accelerate` feature on macOS: on Apple Silicon it runs on the AMX units, which no
//! instruction of ours can reach. Products whose operands are not row- or column-major
//! (both strides above one) stay with the `gemm` crate.
//!
//! Compile-checked for macOS on Linux (tools/cross-check.sh) and never run on a Mac by
//! us; the mapping of a [`Product`] to BLAS's arguments is tested everywhere, against
//! BLAS's definition of a row-major sgemm.

use std::os::raw::c_int;

use super::matrix::{Product, Strided};

/// BLAS's transposition flags (CBLAS_TRANSPOSE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
enum Trans {
    No = 111,
    Yes = 112,
}

/// One row-major `cblas_sgemm`: c = alpha · op(a) · op(b) + beta · c, with op(a)
/// (m x k), op(b) (k x n), c (m x n).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Call {
    trans_a: Trans,
    trans_b: Trans,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: f32,
    lda: c_int,
    ldb: c_int,
    beta: f32,
    ldc: c_int,
}

/// A (rows x cols) operand as row-major BLAS takes it: (transposed?, leading
/// dimension), or None where neither stride is one. BLAS asks the leading dimension to
/// cover a whole row (a column when transposed); a stride never stepped (one row) is
/// raised to that.
fn operand(s: &Strided, rows: usize, cols: usize) -> Option<(Trans, c_int)> {
    let lead = |stride: usize, steps: usize, span: usize| {
        let stride = if steps <= 1 { stride.max(span) } else { stride };
        (stride >= span.max(1)).then(|| c_int::try_from(stride.max(1)).ok())?
    };
    if s.col == 1 {
        Some((Trans::No, lead(s.row, rows, cols)?))
    } else if s.row == 1 {
        Some((Trans::Yes, lead(s.col, cols, rows)?))
    } else {
        None
    }
}

/// The call that computes `p` into dst (rows `dst_row` apart), or None where BLAS
/// cannot take its operands or sizes.
fn call(p: &Product, dst_row: usize) -> Option<Call> {
    let (trans_a, lda) = operand(&p.a, p.m, p.k)?;
    let (trans_b, ldb) = operand(&p.b, p.k, p.n)?;
    let int = |x: usize| c_int::try_from(x).ok();
    Some(Call {
        trans_a,
        trans_b,
        m: int(p.m)?,
        n: int(p.n)?,
        k: int(p.k)?,
        alpha: p.beta,
        lda,
        ldb,
        beta: if p.accumulate { 1.0 } else { 0.0 },
        ldc: int(dst_row.max(p.n).max(1))?,
    })
}

#[cfg(all(feature = "accelerate", target_os = "macos"))]
#[link(name = "Accelerate", kind = "framework")]
extern "C" {
    fn cblas_sgemm(
        order: c_int,
        trans_a: c_int,
        trans_b: c_int,
        m: c_int,
        n: c_int,
        k: c_int,
        alpha: f32,
        a: *const f32,
        lda: c_int,
        b: *const f32,
        ldb: c_int,
        beta: f32,
        c: *mut f32,
        ldc: c_int,
    );
}

/// dst = dst (if accumulating) + beta * a · b through `cblas_sgemm`; false (nothing
/// done) where BLAS cannot take the operands or the sizes, for the caller to do it.
#[cfg(all(feature = "accelerate", target_os = "macos"))]
pub fn sgemm(dst: &mut [f32], dst_row: usize, p: Product) -> bool {
    const ROW_MAJOR: c_int = 101;
    let Some(c) = call(&p, dst_row) else {
        return false;
    };
    if c.m == 0 || c.n == 0 {
        return true;
    }
    // Safety: the caller checked that every element read or written lies inside the
    // slices (`Product::check_bounds`); BLAS reads a and b, and writes dst only.
    unsafe {
        cblas_sgemm(
            ROW_MAJOR,
            c.trans_a as c_int,
            c.trans_b as c_int,
            c.m,
            c.n,
            c.k,
            c.alpha,
            p.a.data.as_ptr(),
            c.lda,
            p.b.data.as_ptr(),
            c.ldb,
            c.beta,
            dst.as_mut_ptr(),
            c.ldc,
        );
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::matrix::Product;

    /// A row-major sgemm as BLAS defines it (the reference BLAS's loops), on the
    /// arguments of a [`Call`].
    fn blas_definition(c: &Call, a: &[f32], b: &[f32], dst: &mut [f32]) {
        let (m, n, k) = (c.m as usize, c.n as usize, c.k as usize);
        let (lda, ldb, ldc) = (c.lda as usize, c.ldb as usize, c.ldc as usize);
        let a_at = |i: usize, p: usize| match c.trans_a {
            Trans::No => a[i * lda + p],
            Trans::Yes => a[p * lda + i],
        };
        let b_at = |p: usize, j: usize| match c.trans_b {
            Trans::No => b[p * ldb + j],
            Trans::Yes => b[j * ldb + p],
        };
        for i in 0..m {
            for j in 0..n {
                let sum: f32 = (0..k).map(|p| a_at(i, p) * b_at(p, j)).sum();
                let old = if c.beta == 0.0 {
                    0.0
                } else {
                    c.beta * dst[i * ldc + j]
                };
                dst[i * ldc + j] = c.alpha * sum + old;
            }
        }
    }

    #[test]
    fn every_layout_maps_to_the_product_it_describes() {
        let (m, n, k) = (5, 4, 3);
        let a: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.5 - 2.0).collect(); // m x k rows
        let b: Vec<f32> = (0..k * n).map(|i| 1.0 - i as f32 * 0.25).collect(); // k x n rows
        let at: Vec<f32> = (0..m * k).map(|i| a[(i % m) * k + i / m]).collect();
        let bt: Vec<f32> = (0..k * n).map(|i| b[(i % k) * n + i / k]).collect();
        let want = |i: usize, j: usize| (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum::<f32>();
        let dst_row = n + 2;
        for (sa, sb) in [
            (Strided::rows(&a, k), Strided::rows(&b, n)),
            (Strided::columns(&at, m), Strided::rows(&b, n)),
            (Strided::rows(&a, k), Strided::columns(&bt, k)),
            (Strided::columns(&at, m), Strided::columns(&bt, k)),
        ] {
            for accumulate in [false, true] {
                let mut p = Product::new(sa, sb, (m, n, k)).scaled(0.5);
                p.accumulate = accumulate;
                let c = call(&p, dst_row).expect("a BLAS layout");
                let mut dst = vec![3.0f32; m * dst_row];
                blas_definition(&c, sa.data, sb.data, &mut dst);
                for i in 0..m {
                    for j in 0..n {
                        let expect = 0.5 * want(i, j) + if accumulate { 3.0 } else { 0.0 };
                        assert!(
                            (dst[i * dst_row + j] - expect).abs() < 1e-5,
                            "{c:?} [{i},{j}]"
                        );
                    }
                    // Padding past n is not written.
                    assert_eq!(dst[i * dst_row + n], 3.0);
                }
            }
        }
    }

    #[test]
    fn a_one_row_operand_gets_a_whole_leading_dimension_and_others_are_refused() {
        let a = [1.0f32, 2.0, 3.0];
        // One row with a stride of 0: never stepped, so raised to the row's length.
        let (trans, lda) = operand(
            &Strided {
                data: &a,
                row: 0,
                col: 1,
            },
            1,
            3,
        )
        .unwrap();
        assert_eq!((trans, lda), (Trans::No, 3));
        // Rows that overlap (a stepped stride shorter than a row) are not BLAS's.
        assert!(operand(
            &Strided {
                data: &a,
                row: 1,
                col: 1
            },
            2,
            2
        )
        .is_none());
        assert_eq!(
            operand(
                &Strided {
                    data: &a,
                    row: 3,
                    col: 1
                },
                2,
                3
            ),
            Some((Trans::No, 3))
        );
        // A column-major one: transposed, its columns apart.
        assert_eq!(
            operand(
                &Strided {
                    data: &a,
                    row: 1,
                    col: 4
                },
                4,
                2
            ),
            Some((Trans::Yes, 4))
        );
        // Neither stride one.
        assert!(operand(
            &Strided {
                data: &a,
                row: 2,
                col: 3
            },
            1,
            1
        )
        .is_none());
    }
}
