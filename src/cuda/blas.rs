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
use super::calls::{ColumnMajor, Epilogue, Operands};
use super::gpu::Gpu;
use crate::config::Math;
use crate::model::spec::{LinearParams, ModelSpec};
use crate::profile::Group;

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

/// Where a product writes C: f32, or (of bf16 operands) rounded to bf16 as the f32
/// sums are stored, for a result only bf16 readers read.
#[derive(Debug, Clone, Copy)]
pub enum Product {
    F32(Matrix),
    Bf16(Matrix),
}

/// C = alpha op(A) op(B) + beta C for each of `batch` matrices, A and B `operands` in
/// memory, C as `c` says. `math` picks the arithmetic of f32 operands: f32 throughout,
/// or rounded to bf16 with f32 sums on the tensor cores (cuBLAS's 32F_FAST_16BF);
/// bf16 operands sum in f32. A profile counts it in `group`.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    gpu: &Gpu,
    (operands, math, group): (Operands, Math, Group),
    c: Product,
    a: Operand,
    b: Operand,
    alpha: f32,
    beta: f32,
    batch: usize,
) -> Result<()> {
    let call = match c {
        Product::F32(c) => column_major(operands, c, a, b, (alpha, beta), batch)?,
        Product::Bf16(c) => {
            ensure!(operands == Operands::Bf16, "a bf16 result of f32 operands");
            ColumnMajor {
                c16: true,
                ..column_major(operands, c, a, b, (alpha, beta), batch)?
            }
        }
    };
    // SAFETY: the addresses are into the engine's live buffers on `gpu`, sized for
    // these shapes (shapes, row spacings and batch strides checked), of `operands`.
    unsafe { gpu.gemm(&call, math, group) }
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
        c16: false,
        epilogue: Epilogue::None,
    })
}

/// c = op(A) op(B) of bf16 operands, each f32 sum passed through an epilogue on its
/// way to C (f32, or rounded to bf16): one matrix, alpha 1, nothing added from C. Made
/// only by [`fused`], so its shapes agree; `Gpu::fuses` says whether the device runs it.
#[derive(Debug, Clone, Copy)]
pub struct Fused(ColumnMajor);

impl Fused {
    pub fn call(&self) -> &ColumnMajor {
        &self.0
    }
}

/// The fused product c = op(A) op(B) through `epilogue`, once the shapes agree.
pub fn fused((c, epilogue): (Product, Epilogue), a: Operand, b: Operand) -> Result<Fused> {
    let (c, c16) = match c {
        Product::F32(c) => (c, false),
        Product::Bf16(c) => (c, true),
    };
    Ok(Fused(ColumnMajor {
        c16,
        epilogue,
        ..column_major(Operands::Bf16, c, a, b, (1.0, 0.0), 1)?
    }))
}

/// Runs `product` (cuBLASLt on a GPU); a profile counts it in `group`.
pub fn run_fused(gpu: &Gpu, group: Group, product: &Fused) -> Result<()> {
    // SAFETY: as `matmul`'s: the addresses are into the engine's live buffers, sized
    // for the shapes `fused` checked; the epilogue's aux has C's shape and its bias a
    // value per output column.
    unsafe { gpu.gemm(&product.0, Math::Bf16, group) }
}

/// Where a linear layer reads its weight matrix: the f32 flat parameters (products in
/// the precision given), or their bf16 copy (the same offsets), whose input rows the
/// caller has rounded to bf16 too: half the bytes a product reads from the weights, and
/// a decoding step at batch 1 is mostly that read.
#[derive(Clone, Copy)]
pub enum Weights<'a> {
    F32(Math),
    Bf16(&'a Buf<u16>),
}

/// A layer without a bias over bf16 rows and weights (the weights' bf16 copy, at the
/// spec's offsets), its output rounded to bf16: out16 (rows, d_out) = x16 Wᵀ, summed
/// in f32. In bf16 training: the output layer, whose logits the loss reads in bf16,
/// and the MLP's first projection, which its activation reads (and adds the bias to).
pub fn linear_to_bf16(
    gpu: &Gpu,
    (weights16, spec): (&Buf<u16>, &ModelSpec),
    out16: u64,
    x16: u64,
    p: &LinearParams,
    rows: usize,
) -> Result<()> {
    ensure!(p.bias.is_none(), "a bf16 output of a layer with a bias");
    let w = weights16.at(spec[p.weight].offset);
    let (c, a, b) = (
        Matrix::new(out16, rows, p.d_out),
        Matrix::new(x16, rows, p.d_in).n(),
        Matrix::new(w, p.d_out, p.d_in).t(),
    );
    let how = (Operands::Bf16, Math::Bf16, Group::Product(p.role));
    matmul(gpu, how, Product::Bf16(c), a, b, 1.0, 0.0, 1)
}

/// A linear layer forward: out (rows, d_out) = x Wᵀ (+ b), its weights read at the
/// spec's offsets (from `weights`), the bias from the flat parameter buffer `params`.
#[allow(clippy::too_many_arguments)]
pub fn linear(
    gpu: &Gpu,
    weights: Weights,
    spec: &ModelSpec,
    params: &Buf<f32>,
    out: u64,
    x: u64,
    p: &LinearParams,
    rows: usize,
) -> Result<()> {
    let offset = spec[p.weight].offset;
    let (operands, w, math) = match weights {
        Weights::F32(math) => (Operands::F32, params.at(offset), math),
        Weights::Bf16(copy) => (Operands::Bf16, copy.at(offset), Math::Bf16),
    };
    let (c, a, b) = (
        Matrix::new(out, rows, p.d_out),
        Matrix::new(x, rows, p.d_in).n(),
        Matrix::new(w, p.d_out, p.d_in).t(),
    );
    let call = column_major(operands, c, a, b, (1.0, 0.0), 1)?;
    // SAFETY: `out`, `x` and the weights are live buffers of these shapes (checked).
    unsafe { gpu.gemm(&call, math, Group::Product(p.role)) }?;
    if let Some(bias) = p.bias {
        gpu.add_bias(out, params.at(spec[bias].offset), rows, p.d_out)?;
    }
    Ok(())
}
