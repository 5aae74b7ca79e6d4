//! Matrix products on cuBLAS, written in row-major terms.
//!
//! The engine's matrices are row-major (as the CPU engine's and PyTorch's); cuBLAS is
//! column-major. A row-major matrix is the column-major view of its transpose, so
//! C = op(A) op(B) is computed as Cᵀ = op(B)ᵀ op(A)ᵀ: the operands swap places and
//! keep their own transposition. Every product is a strided batch (a batch of one for
//! the linear layers), and operands may be strided views (rows `ld` apart), so the
//! attention's per-head products read their heads in place.

use anyhow::{ensure, Context, Result};
use candle_core::cuda::cudarc::cublas::{result, sys, CudaBlas};

use crate::config::Precision;

/// A row-major matrix on the device: `rows x cols` as stored, consecutive rows `ld`
/// elements apart, a batch of them `stride` elements apart.
#[derive(Debug, Clone, Copy)]
pub struct Matrix {
    pub ptr: u64,
    pub rows: usize,
    pub cols: usize,
    pub ld: usize,
    pub stride: usize,
}

impl Matrix {
    /// A dense `rows x cols` matrix (a batch of them back to back).
    pub fn new(ptr: u64, rows: usize, cols: usize) -> Self {
        Self {
            ptr,
            rows,
            cols,
            ld: cols,
            stride: rows * cols,
        }
    }

    /// Read as it is.
    pub fn n(self) -> Operand {
        Operand {
            m: self,
            transposed: false,
        }
    }

    /// Read transposed.
    pub fn t(self) -> Operand {
        Operand {
            m: self,
            transposed: true,
        }
    }
}

/// A matrix as a product reads it.
#[derive(Debug, Clone, Copy)]
pub struct Operand {
    m: Matrix,
    transposed: bool,
}

impl Operand {
    /// (rows, cols) as read.
    fn shape(&self) -> (usize, usize) {
        if self.transposed {
            (self.m.cols, self.m.rows)
        } else {
            (self.m.rows, self.m.cols)
        }
    }

    fn op(&self) -> sys::cublasOperation_t {
        if self.transposed {
            sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            sys::cublasOperation_t::CUBLAS_OP_N
        }
    }
}

/// C = alpha op(A) op(B) + beta C for each of `batch` matrices. `precision` picks the
/// products' arithmetic: f32 throughout, or operands rounded to bf16 with f32 sums
/// on the tensor cores (cuBLAS's 32F_FAST_16BF; the data stays f32 in memory).
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    blas: &CudaBlas,
    precision: Precision,
    c: Matrix,
    a: Operand,
    b: Operand,
    alpha: f32,
    beta: f32,
    batch: usize,
) -> Result<()> {
    let ((m, k), (k2, n)) = (a.shape(), b.shape());
    ensure!(
        k == k2 && (c.rows, c.cols) == (m, n),
        "matmul: ({m} x {k}) times ({k2} x {n}) into ({} x {})",
        c.rows,
        c.cols
    );
    let compute = match precision {
        Precision::F32 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        Precision::Bf16 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16BF,
    };
    let f32 = sys::cudaDataType_t::CUDA_R_32F;
    let dim = |x: usize| i32::try_from(x).context("a matrix dimension over 2^31");
    // SAFETY: the pointers are into live device buffers the engine sized for these
    // shapes (checked above against each other), on the handle's stream; alpha and
    // beta are host values that outlive the call.
    unsafe {
        result::gemm_strided_batched_ex(
            *blas.handle(),
            b.op(),
            a.op(),
            dim(n)?,
            dim(m)?,
            dim(k)?,
            (&alpha) as *const f32 as *const _,
            b.m.ptr as *const _,
            f32,
            dim(b.m.ld)?,
            b.m.stride as i64,
            a.m.ptr as *const _,
            f32,
            dim(a.m.ld)?,
            a.m.stride as i64,
            (&beta) as *const f32 as *const _,
            c.ptr as *mut _,
            f32,
            dim(c.ld)?,
            c.stride as i64,
            dim(batch)?,
            compute,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .context("cuBLAS matmul")
}
