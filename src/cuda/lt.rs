//! Products whose epilogue finishes the work a kernel would otherwise do by reading
//! the product's output back (`calls::Epilogue`: a bias, the MLP's GELU forward,
//! keeping its input for the backward, and the GELU's gradient), through cuBLASLt:
//! bf16 operands, f32 sums. Plain products stay with cuBLAS (`gpu::cublas_gemm`).
//!
//! cuBLASLt picks an algorithm per shape with a heuristic, which may find none for an
//! epilogue at some shapes or alignments: the engine asks first (`Lt::supports`) and
//! keeps its kernels where the answer is no. The choice is kept per kind of call, so
//! a step asks the heuristic once per shape, not once per product.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use anyhow::{bail, ensure, Context, Result};
use candle_core::cuda::cudarc::cublas::sys as blas_sys;
use candle_core::cuda::cudarc::cublaslt::{result, sys};

use super::calls::{ColumnMajor, Epilogue};

/// A cuBLASLt handle and the algorithm chosen for each kind of call.
pub struct Lt {
    handle: sys::cublasLtHandle_t,
    chosen: Mutex<HashMap<Key, sys::cublasLtMatmulAlgo_t>>,
}

// SAFETY: a cuBLASLt handle may be used from any thread (cuBLASLt keeps no per-thread
// state in it); the engine that holds it drives it from one thread anyway
// (`OwnerThread`), and the map of choices is behind a lock.
unsafe impl Send for Lt {}
unsafe impl Sync for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        // SAFETY: the handle is ours and nothing uses it after this.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}

/// What the heuristic's choice depends on: the call without its addresses, and the
/// addresses' alignment (cuBLASLt's kernels may assume up to 256 bytes; the heuristic
/// reads the bias's and aux's from their addresses, so a block whose bias sits on
/// fewer bytes than another's gets its own choice).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    trans: (bool, bool),
    mnk: (usize, usize, usize),
    ld: (usize, usize, usize),
    c16: bool,
    /// 1 GELU forward, 2 with a bias, 3 GELU backward, 4 a bias alone.
    epilogue: u8,
    alignment: (u32, u32, u32),
    /// The bias's and the aux's.
    epilogue_alignment: (u32, u32),
}

/// The largest power of two up to 256 that `address` is a multiple of.
fn alignment(address: u64) -> u32 {
    1 << address.trailing_zeros().min(8)
}

impl Key {
    fn of(g: &ColumnMajor) -> Self {
        let epilogue = match g.epilogue {
            Epilogue::None => 0,
            Epilogue::Bias { .. } => 4,
            Epilogue::GeluAux { bias: 0, .. } => 1,
            Epilogue::GeluAux { .. } => 2,
            Epilogue::GeluBackward { .. } => 3,
        };
        Self {
            trans: (g.transa, g.transb),
            mnk: (g.m, g.n, g.k),
            ld: (g.lda, g.ldb, g.ldc),
            c16: g.c16,
            epilogue,
            alignment: (alignment(g.a), alignment(g.b), alignment(g.c)),
            epilogue_alignment: {
                let (bias, aux) = g.epilogue.buffers();
                (alignment(bias), alignment(aux))
            },
        }
    }
}

/// One call's descriptors, destroyed when dropped.
struct Described {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
}

impl Drop for Described {
    fn drop(&mut self) {
        // SAFETY: each was created by `describe` (null ones are skipped) and is dropped
        // once.
        unsafe {
            for layout in [self.a, self.b, self.c] {
                if !layout.is_null() {
                    let _ = result::destroy_matrix_layout(layout);
                }
            }
            if !self.desc.is_null() {
                let _ = result::destroy_matmul_desc(self.desc);
            }
        }
    }
}

/// An attribute setter of cuBLASLt's (of a product's descriptor, of its preferences).
type Setter<H, A> = unsafe fn(H, A, *const c_void, usize) -> Result<(), result::CublasError>;

/// Sets attribute `attr` of `handle` to `value` through `setter`.
///
/// # Safety
/// `handle` is live, and `T` is the type cuBLASLt documents for `attr`.
unsafe fn set<H, A: std::fmt::Debug + Copy, T>(
    setter: Setter<H, A>,
    handle: H,
    attr: A,
    value: T,
) -> Result<()> {
    let (at, size) = (
        (&value as *const T).cast::<c_void>(),
        std::mem::size_of::<T>(),
    );
    // SAFETY: as the caller promises; `value` lives across the call, which copies it.
    unsafe { setter(handle, attr, at, size) }
        .with_context(|| format!("setting cuBLASLt's {attr:?}"))
}

/// A product descriptor's attribute (`set`).
///
/// # Safety
/// As `set`'s.
unsafe fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: T,
) -> Result<()> {
    // SAFETY: as the caller promises.
    unsafe { set(result::set_matmul_desc_attribute, desc, attr, value) }
}

/// The descriptors of `g`: bf16 A and B, C and D the same (f32 or bf16), f32 sums and
/// scale, its epilogue and the epilogue's buffers. The bias and aux types are left at
/// their default, D's type, as cuBLASLt asks outside its FP8 kernels: `g` is one it
/// documents (`ColumnMajor::documented_epilogue`; a bias or an aux goes with a bf16 D).
fn describe(g: &ColumnMajor) -> Result<Described> {
    use sys::cublasLtMatmulDescAttributes_t as Attr;
    use sys::cudaDataType_t::{CUDA_R_16BF, CUDA_R_32F};
    ensure!(
        g.documented_epilogue(),
        "not an epilogue cuBLASLt documents: bf16 operands, one matrix, nothing added \
         from C, a bias or aux beside a bf16 D, aux rows a multiple of 8 apart, buffers \
         on 16 bytes"
    );
    let mut d = Described {
        desc: std::ptr::null_mut(),
        a: std::ptr::null_mut(),
        b: std::ptr::null_mut(),
        c: std::ptr::null_mut(),
    };
    let layout = |kind, rows: usize, cols: usize, ld: usize| {
        result::create_matrix_layout(kind, rows as u64, cols as u64, ld as i64)
            .context("creating a cuBLASLt matrix layout")
    };
    // Layouts describe the matrices as stored: op(A) is m x k, so A is k x m when
    // transposed.
    let (a_rows, a_cols) = if g.transa { (g.k, g.m) } else { (g.m, g.k) };
    let (b_rows, b_cols) = if g.transb { (g.n, g.k) } else { (g.k, g.n) };
    d.a = layout(CUDA_R_16BF, a_rows, a_cols, g.lda)?;
    d.b = layout(CUDA_R_16BF, b_rows, b_cols, g.ldb)?;
    let c_type = if g.c16 { CUDA_R_16BF } else { CUDA_R_32F };
    d.c = layout(c_type, g.m, g.n, g.ldc)?;
    d.desc = result::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, CUDA_R_32F)
        .context("creating a cuBLASLt product")?;
    let op = |t: bool| {
        if t {
            blas_sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            blas_sys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    use sys::cublasLtEpilogue_t::{
        CUBLASLT_EPILOGUE_BIAS, CUBLASLT_EPILOGUE_DGELU, CUBLASLT_EPILOGUE_GELU_AUX,
        CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
    };
    // SAFETY: each value has the type cuBLASLt documents for its attribute: operations
    // and the epilogue are enums, pointers 64-bit addresses, the aux's row spacing an
    // int64.
    unsafe {
        set_desc(d.desc, Attr::CUBLASLT_MATMUL_DESC_TRANSA, op(g.transa))?;
        set_desc(d.desc, Attr::CUBLASLT_MATMUL_DESC_TRANSB, op(g.transb))?;
        let (epilogue, aux, bias) = match g.epilogue {
            Epilogue::None => bail!("a plain product goes to cuBLAS"),
            Epilogue::Bias { bias } => (CUBLASLT_EPILOGUE_BIAS, 0, bias),
            Epilogue::GeluAux { bias: 0, aux } => (CUBLASLT_EPILOGUE_GELU_AUX, aux, 0),
            Epilogue::GeluAux { bias, aux } => (CUBLASLT_EPILOGUE_GELU_AUX_BIAS, aux, bias),
            Epilogue::GeluBackward { aux } => (CUBLASLT_EPILOGUE_DGELU, aux, 0),
        };
        set_desc(d.desc, Attr::CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue)?;
        if aux != 0 {
            set_desc(d.desc, Attr::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux)?;
            let ld = g.ldc as i64;
            set_desc(d.desc, Attr::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, ld)?;
        }
        if bias != 0 {
            set_desc(d.desc, Attr::CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias)?;
        }
    }
    Ok(d)
}

impl Lt {
    pub fn new() -> Result<Self> {
        Ok(Self {
            handle: result::create_handle().context("creating a cuBLASLt handle")?,
            chosen: Mutex::default(),
        })
    }

    /// The algorithm for `g` with `workspace` bytes of work space: the one chosen
    /// before for a call of its kind, else the heuristic's first; an error where it
    /// finds none.
    fn algorithm(
        &self,
        g: &ColumnMajor,
        d: &Described,
        workspace: usize,
    ) -> Result<sys::cublasLtMatmulAlgo_t> {
        let key = Key::of(g);
        if let Some(algo) = self.chosen.lock().ok().and_then(|m| m.get(&key).copied()) {
            return Ok(algo);
        }
        use sys::cublasLtMatmulPreferenceAttributes_t as Pref;
        let pref = result::create_matmul_pref().context("creating cuBLASLt preferences")?;
        struct Prefs(sys::cublasLtMatmulPreference_t);
        impl Drop for Prefs {
            fn drop(&mut self) {
                // SAFETY: created above, dropped once.
                let _ = unsafe { result::destroy_matmul_pref(self.0) };
            }
        }
        let pref = Prefs(pref);
        let set_pref = |attr: Pref, value: u64, narrow: bool| {
            let setter = result::set_matmul_pref_attribute;
            // SAFETY: the preferences are live; the work space's size is a uint64, the
            // alignments and the scheme mask uint32s (`narrow`), as cuBLASLt documents.
            unsafe {
                match narrow {
                    true => set(setter, pref.0, attr, value as u32),
                    false => set(setter, pref.0, attr, value),
                }
            }
        };
        let (a, b, c) = key.alignment;
        // Sums split over k, where an algorithm splits them, added in f32, never in
        // the output's bf16.
        let f32_partials = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
        set_pref(
            Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            workspace as u64,
            false,
        )?;
        set_pref(
            Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
            a.into(),
            true,
        )?;
        set_pref(
            Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            b.into(),
            true,
        )?;
        set_pref(
            Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            c.into(),
            true,
        )?;
        set_pref(
            Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            c.into(),
            true,
        )?;
        let mask = Pref::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK;
        set_pref(mask, f32_partials as u64, true)?;
        // SAFETY: the descriptors are live; the result is written by the call.
        let algo = unsafe {
            result::get_matmul_algo_heuristic(self.handle, d.desc, d.a, d.b, d.c, d.c, pref.0)
        }
        .with_context(|| {
            format!(
                "cuBLASLt has no algorithm for a {}x{}x{} product with {:?}",
                g.m, g.n, g.k, g.epilogue
            )
        })?
        .algo;
        if let Ok(mut chosen) = self.chosen.lock() {
            chosen.insert(key, algo);
        }
        Ok(algo)
    }

    /// Whether cuBLASLt has an algorithm for `g` (its shapes, epilogue and
    /// alignments) with `workspace` bytes of work space.
    pub fn supports(&self, g: &ColumnMajor, workspace: usize) -> bool {
        describe(g)
            .and_then(|d| self.algorithm(g, &d, workspace))
            .is_ok()
    }

    /// Queues `g` on `stream`, using the `workspace` (address, bytes).
    ///
    /// # Safety
    /// `g`'s addresses, its epilogue's included, are into live device buffers of the
    /// shapes it describes; the work space is live, and nothing else uses it while
    /// work queued on `stream` before this runs.
    pub unsafe fn matmul(
        &self,
        g: &ColumnMajor,
        stream: sys::cudaStream_t,
        (workspace, bytes): (u64, usize),
    ) -> Result<()> {
        let d = describe(g)?;
        let algo = self.algorithm(g, &d, bytes)?;
        let (alpha, beta) = (g.alpha, 0f32);
        // SAFETY: as the caller promises; alpha, beta and the algorithm outlive the call.
        unsafe {
            result::matmul(
                self.handle,
                d.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                g.a as *const c_void,
                d.a,
                g.b as *const c_void,
                d.b,
                g.c as *const c_void,
                d.c,
                g.c as *mut c_void,
                d.c,
                &algo,
                workspace as *mut c_void,
                bytes,
                stream,
            )
        }
        .context("cuBLASLt matmul")
    }
}
