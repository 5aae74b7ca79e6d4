//! Matrix products on cuBLAS, written in row-major terms.
//!
//! The engine's matrices are row-major (as the CPU engine's and PyTorch's); cuBLAS is
//! column-major. A row-major matrix is the column-major view of its transpose, so
//! C = op(A) op(B) is computed as Cᵀ = op(B)ᵀ op(A)ᵀ: the operands swap places and
//! keep their own transposition. Every product is a strided batch (a batch of one for
//! the linear layers), and operands may be strided views (rows `ld` apart), so the
//! attention's per-head products read their heads in place.

#[cfg(feature = "cuda")]
use anyhow::Context;
use anyhow::{ensure, Result};
#[cfg(feature = "cuda")]
use candle_core::cuda::cudarc::cublas::{result, sys, CudaBlas};

use super::gpu::Gpu;
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
}

/// One column-major strided-batched product as cuBLAS takes it:
/// C = alpha op(A) op(B) + beta C, op(A) m x k, op(B) k x n, for each of `batch`.
#[derive(Debug, Clone, Copy)]
pub struct ColumnMajor {
    pub transa: bool,
    pub transb: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub alpha: f32,
    pub a: u64,
    pub lda: usize,
    pub stride_a: usize,
    pub b: u64,
    pub ldb: usize,
    pub stride_b: usize,
    pub beta: f32,
    pub c: u64,
    pub ldc: usize,
    pub stride_c: usize,
    pub batch: usize,
}

/// C = alpha op(A) op(B) + beta C for each of `batch` matrices. `precision` picks the
/// products' arithmetic: f32 throughout, or operands rounded to bf16 with f32 sums
/// on the tensor cores (cuBLAS's 32F_FAST_16BF; the data stays f32 in memory).
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    gpu: &Gpu,
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
    for x in [a.m, b.m, c] {
        ensure!(
            x.ld >= x.cols,
            "matmul: rows of {} apart, {} wide",
            x.ld,
            x.cols
        );
        ensure!(
            batch == 1 || x.stride >= x.rows * x.ld,
            "matmul: a batch of ({} x {}) matrices {} apart",
            x.rows,
            x.ld,
            x.stride
        );
    }
    // Cᵀ = op(B)ᵀ op(A)ᵀ: B comes first, each operand keeps its own transposition.
    let call = ColumnMajor {
        transa: b.transposed,
        transb: a.transposed,
        m: n,
        n: m,
        k,
        alpha,
        a: b.m.ptr,
        lda: b.m.ld,
        stride_a: b.m.stride,
        b: a.m.ptr,
        ldb: a.m.ld,
        stride_b: a.m.stride,
        beta,
        c: c.ptr,
        ldc: c.ld,
        stride_c: c.stride,
        batch,
    };
    match gpu {
        #[cfg(feature = "cuda")]
        Gpu::Cuda(g) => cublas(&g.blas, precision, &call),
        #[cfg(feature = "cuda-emulator")]
        Gpu::Emulated => {
            // SAFETY: the addresses are the engine's host buffers, sized for these
            // shapes (checked above).
            unsafe { super::emulator::gemm(&call, precision) };
            Ok(())
        }
    }
}

#[cfg(feature = "cuda")]
fn cublas(blas: &CudaBlas, precision: Precision, g: &ColumnMajor) -> Result<()> {
    let compute = match precision {
        Precision::F32 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        Precision::Bf16 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16BF,
    };
    let op = |t: bool| {
        if t {
            sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            sys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    let f32 = sys::cudaDataType_t::CUDA_R_32F;
    let dim = |x: usize| i32::try_from(x).context("a matrix dimension over 2^31");
    // SAFETY: the pointers are into live device buffers the engine sized for these
    // shapes (the shapes, row spacings and batch strides checked by `matmul`), on the
    // handle's stream; alpha and beta are host values that outlive the call.
    unsafe {
        result::gemm_strided_batched_ex(
            *blas.handle(),
            op(g.transa),
            op(g.transb),
            dim(g.m)?,
            dim(g.n)?,
            dim(g.k)?,
            (&g.alpha) as *const f32 as *const _,
            g.a as *const _,
            f32,
            dim(g.lda)?,
            g.stride_a as i64,
            g.b as *const _,
            f32,
            dim(g.ldb)?,
            g.stride_b as i64,
            (&g.beta) as *const f32 as *const _,
            g.c as *mut _,
            f32,
            dim(g.ldc)?,
            g.stride_c as i64,
            dim(g.batch)?,
            compute,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .context("cuBLAS matmul")
}
