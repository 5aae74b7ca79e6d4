//! Matrix products written in row-major terms, carried out as cuBLAS's column-major
//! products.
//!
//! The engine's matrices are row-major (as the CPU engine's and PyTorch's); cuBLAS is
//! column-major. A row-major matrix is the column-major view of its transpose, so
//! C = op(A) op(B) is computed as Cᵀ = op(B)ᵀ op(A)ᵀ: the operands swap places and
//! keep their own transposition. Every product is a strided batch (a batch of one for
//! the linear layers), and operands may be strided views (rows `ld` apart), so the
//! attention's per-head products read their heads in place.

use anyhow::{ensure, Result};

use super::buffers::Buf;
use super::calls::{ColumnMajor, Operands};
use super::gpu::Gpu;
use crate::config::Precision;
use crate::model::spec::{LinearParams, ModelSpec};

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
    let call = column_major(Operands::F32, c, a, b, (alpha, beta), batch)?;
    // SAFETY: the addresses are into the engine's live buffers on `gpu`, sized for
    // these shapes (shapes, row spacings and batch strides checked).
    unsafe { gpu.gemm(&call, precision) }
}

/// C = op(A) op(B) as cuBLAS's column-major product, once the shapes agree.
fn column_major(
    operands: Operands,
    c: Matrix,
    a: Operand,
    b: Operand,
    (alpha, beta): (f32, f32),
    batch: usize,
) -> Result<ColumnMajor> {
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
    Ok(ColumnMajor {
        operands,
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
    })
}

/// A linear layer forward: out (rows, d_out) = x Wᵀ (+ b), its weights read from the
/// flat parameter buffer `params` at the spec's offsets.
#[allow(clippy::too_many_arguments)]
pub fn linear(
    gpu: &Gpu,
    precision: Precision,
    spec: &ModelSpec,
    params: &Buf<f32>,
    out: u64,
    x: u64,
    p: &LinearParams,
    rows: usize,
) -> Result<()> {
    let w = params.at(spec[p.weight].offset);
    let (c, a, b) = (
        Matrix::new(out, rows, p.d_out),
        Matrix::new(x, rows, p.d_in).n(),
        Matrix::new(w, p.d_out, p.d_in).t(),
    );
    matmul(gpu, precision, c, a, b, 1.0, 0.0, 1)?;
    if let Some(bias) = p.bias {
        gpu.add_bias(out, params.at(spec[bias].offset), rows, p.d_out)?;
    }
    Ok(())
}

/// [`linear`] over bf16 in memory: x16 (rows, d_in) already rounded to bf16, the weight
/// read from `weights16` (the flat parameters as bf16, at the spec's offsets), f32 sums
/// into f32 `out`; the bias added from the f32 `params`. Half the bytes a product
/// reads from the weights: a decoding step at batch 1 is mostly that read.
#[allow(clippy::too_many_arguments)]
pub fn linear_bf16(
    gpu: &Gpu,
    spec: &ModelSpec,
    (weights16, params): (&Buf<u16>, &Buf<f32>),
    out: u64,
    x16: u64,
    p: &LinearParams,
    rows: usize,
) -> Result<()> {
    let w = weights16.at(spec[p.weight].offset);
    let (c, a, b) = (
        Matrix::new(out, rows, p.d_out),
        Matrix::new(x16, rows, p.d_in).n(),
        Matrix::new(w, p.d_out, p.d_in).t(),
    );
    let call = column_major(Operands::Bf16, c, a, b, (1.0, 0.0), 1)?;
    // SAFETY: `out`, `x16` and the weights are live buffers of these shapes.
    unsafe { gpu.gemm(&call, Precision::Bf16) }?;
    if let Some(bias) = p.bias {
        gpu.add_bias(out, params.at(spec[bias].offset), rows, p.d_out)?;
    }
    Ok(())
}
