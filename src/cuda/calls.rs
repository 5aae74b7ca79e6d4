//! What the engine asks of a device, in plain data: a kernel launch (which kernel, its
//! grid) and a column-major matrix product as cuBLAS takes it. `gpu` carries them out
//! on CUDA or in the emulator.

use crate::profile::Group;

/// Grid and block of a launch (one dimension of threads; no dynamic shared memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub grid: (u32, u32, u32),
    pub threads: u32,
}

/// One kernel argument as cuLaunchKernel takes it: the address of its value, and the
/// value's size.
#[derive(Debug, Clone, Copy)]
pub struct Arg {
    pub ptr: *mut std::ffi::c_void,
    /// Checked against the kernel's parameter by the emulator (cuLaunchKernel takes
    /// the addresses only).
    #[cfg_attr(not(feature = "cuda-emulator"), allow(dead_code))]
    pub size: usize,
}

impl Arg {
    pub fn of<T>(value: &mut T) -> Self {
        Self {
            ptr: (value as *mut T).cast(),
            size: std::mem::size_of::<T>(),
        }
    }
}

/// Kernels take at most this many arguments (residual_norm_forward's 18).
pub const MAX_ARGS: usize = 20;

/// Calls `$then!` with the name of every kernel file (`kernels/<name>.cu`), each
/// compiled to PTX by build.rs: the one list `gpu.rs` includes PTX from, and that the
/// test below holds to the files on disk and to every kernel's file.
#[cfg_attr(not(any(test, feature = "cuda")), allow(unused_macros))]
macro_rules! kernel_files {
    ($then:ident) => {
        $then!(
            "embedding",
            "norm",
            "activation",
            "elementwise",
            "attention",
            "flash",
            "loss",
            "optim",
            "decode",
            "sample"
        )
    };
}
#[cfg(feature = "cuda")]
pub(crate) use kernel_files;

/// Names every kernel: its variant, its function name, the file it is in, and the
/// group a profile counts it in.
macro_rules! kernels {
    ($($variant:ident = $name:literal in $module:literal as $group:ident,)*) => {
        /// Every kernel of kernels/*.cu.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum Kernel {
            $($variant,)*
        }

        impl Kernel {
            /// In declaration order: `Kernel::X as usize` indexes it.
            #[allow(dead_code)] // read on CUDA only
            pub const ALL: &[Kernel] = &[$(Kernel::$variant,)*];

            pub fn name(self) -> &'static str {
                match self {
                    $(Kernel::$variant => $name,)*
                }
            }

            /// The file (`kernels/<module>.cu`) it is in.
            #[allow(dead_code)] // read on CUDA only
            pub fn module(self) -> &'static str {
                match self {
                    $(Kernel::$variant => $module,)*
                }
            }

            /// What a profile counts its time as.
            pub fn group(self) -> Group {
                match self {
                    $(Kernel::$variant => Group::$group,)*
                }
            }
        }
    };
}

kernels! {
    EmbeddingForward = "embedding_forward" in "embedding" as Embedding,
    EmbeddingBackwardTokens = "embedding_backward_tokens" in "embedding" as Embedding,
    EmbeddingBackwardPositions = "embedding_backward_positions" in "embedding" as Embedding,
    NormForward = "norm_forward" in "norm" as Norm,
    NormApply = "norm_apply" in "norm" as Norm,
    ResidualNormForward = "residual_norm_forward" in "norm" as Norm,
    NormBackward = "norm_backward" in "norm" as Norm,
    NormBackwardInput = "norm_backward_input" in "norm" as Norm,
    NormBackwardParams = "norm_backward_params" in "norm" as Norm,
    ColumnPartials = "column_partials" in "norm" as Elementwise,
    AddColumnSums = "add_column_sums" in "norm" as Norm,
    ActivationForward = "activation_forward" in "activation" as Activation,
    ActivationBackward = "activation_backward" in "activation" as Activation,
    ResidualForward = "residual_forward" in "elementwise" as Elementwise,
    DropoutApply = "dropout_apply" in "elementwise" as Elementwise,
    AddBias = "add_bias" in "elementwise" as Elementwise,
    AddBias16 = "add_bias16" in "elementwise" as Elementwise,
    Rope = "rope" in "elementwise" as Elementwise,
    SplitHeads = "split_heads" in "attention" as Copy,
    MergeHeads = "merge_heads" in "attention" as Copy,
    SplitRows = "split_rows" in "attention" as Copy,
    MergeHeadGrads = "merge_head_grads" in "attention" as Copy,
    CausalSoftmax = "causal_softmax" in "attention" as Attention,
    CausalSoftmaxBackward = "causal_softmax_backward" in "attention" as Attention,
    FlashForward = "flash_forward" in "flash" as Attention,
    FlashBackwardSums = "flash_backward_sums" in "flash" as Attention,
    FlashBackwardKv = "flash_backward_kv" in "flash" as Attention,
    FlashBackwardQ = "flash_backward_q" in "flash" as Attention,
    SoftmaxCrossEntropy = "softmax_cross_entropy" in "loss" as Classifier,
    CrossEntropyBackward = "cross_entropy_backward" in "loss" as Classifier,
    SumSquares = "sum_squares" in "optim" as Optimizer,
    SumAll = "sum_all" in "optim" as Optimizer,
    ClipToNorm = "clip_to_norm" in "optim" as Optimizer,
    Adamw = "adamw" in "optim" as Optimizer,
    StoreKeysValues = "store_keys_values" in "decode" as Copy,
    AttendCachedPartial = "attend_cached_partial" in "decode" as Attention,
    AttendCachedCombine = "attend_cached_combine" in "decode" as Attention,
    LastRows = "last_rows" in "decode" as Copy,
    ToBf16 = "to_bf16" in "elementwise" as Copy,
    SampleTokens = "sample_tokens" in "sample" as Classifier,
}

/// x rounded to TF32 (the top 19 bits of an f32: 10 of mantissa), to nearest with ties
/// away from zero, as PTX's cvt.rna.tf32.f32 does; infinities and NaN as they are.
#[cfg(any(test, feature = "cuda-emulator"))]
pub fn round_to_tf32(x: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    f32::from_bits((x.to_bits() + 0x1000) & !0x1fff)
}

/// What a product's operands A and B are in memory (C is f32 either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operands {
    F32,
    /// bf16 values (the decoder's resident weights and its rows rounded to match).
    Bf16,
}

/// One column-major strided-batched product as cuBLAS takes it:
/// C = alpha op(A) op(B) + beta C, op(A) m x k, op(B) k x n, for each of `batch`.
#[derive(Debug, Clone, Copy)]
pub struct ColumnMajor {
    pub operands: Operands,
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
    /// C is bf16, written rounded from the f32 sums (beta 0), not f32.
    pub c16: bool,
    /// What happens to each f32 sum before it is stored.
    pub epilogue: Epilogue,
}

/// What a product does to each f32 sum (times alpha) on its way to C: cuBLASLt's
/// epilogues, which save the kernel that would otherwise read the product's output
/// back. Indices are column-major: the bias has one value per row of C (m of them),
/// which is one per output feature of a row-major linear layer, in bf16 (the type
/// cuBLASLt documents beside a bf16 C; autocast rounds a bias so too); `aux` has C's
/// shape and row spacing, in bf16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Epilogue {
    /// Stored as it is.
    None,
    /// x = sum + bias: cuBLASLt's BIAS.
    Bias { bias: u64 },
    /// x = sum + bias (0: none), stored at `aux` rounded to bf16 for the backward; C
    /// gets GPT-2's tanh GELU of x (cuBLASLt's GELU_AUX and GELU_AUX_BIAS).
    GeluAux { bias: u64, aux: u64 },
    /// C gets sum times the tanh GELU's slope at the bf16 `aux` a `GeluAux` kept: the
    /// gradient at the GELU's input from the gradient at its output (DGELU).
    GeluBackward { aux: u64 },
}

impl Epilogue {
    /// Its bias and aux addresses (0 where it has none).
    pub fn buffers(self) -> (u64, u64) {
        match self {
            Epilogue::None => (0, 0),
            Epilogue::Bias { bias } => (bias, 0),
            Epilogue::GeluAux { bias, aux } => (bias, aux),
            Epilogue::GeluBackward { aux } => (0, aux),
        }
    }

    /// The bytes it reads or writes beside the product's own, for `values` sums of C.
    fn bytes(self, values: usize, m: usize) -> f64 {
        match self {
            Epilogue::None => 0.0,
            Epilogue::Bias { .. } => 2.0 * m as f64,
            Epilogue::GeluAux { bias, .. } => {
                2.0 * values as f64 + if bias == 0 { 0.0 } else { 2.0 * m as f64 }
            }
            Epilogue::GeluBackward { .. } => 2.0 * values as f64,
        }
    }
}

impl ColumnMajor {
    /// Whether its epilogue is one cuBLASLt documents for it: bf16 operands, one
    /// matrix, nothing added from C; a bias or an aux (both bf16) beside a bf16 C, the
    /// aux's rows a multiple of 8 apart; bias and aux on 16 bytes. A device may still have no algorithm
    /// for it (`Gpu::fuses` asks).
    pub fn documented_epilogue(&self) -> bool {
        let (bias, aux) = self.epilogue.buffers();
        let aligned = |at: u64| at.is_multiple_of(16);
        let bf16_beside = (bias == 0 && aux == 0) || self.c16;
        let aux_fits = aux == 0 || self.ldc.is_multiple_of(8);
        self.epilogue != Epilogue::None
            && self.operands == Operands::Bf16
            && self.batch == 1
            && self.beta == 0.0
            && bf16_beside
            && aux_fits
            && aligned(bias)
            && aligned(aux)
    }

    /// What a profile counts it as doing: 2 m n k FLOPs per matrix; A, B and C read
    /// once (C only with beta), C written, at their sizes in memory, and what its
    /// epilogue reads or writes (its FLOPs are noise beside the product's).
    pub fn cost(&self) -> crate::profile::Cost {
        let per = (self.m * self.n * self.k * self.batch) as f64;
        let operand = match self.operands {
            Operands::F32 => 4.0,
            Operands::Bf16 => 2.0,
        };
        let c_passes = if self.beta == 0.0 { 1.0 } else { 2.0 };
        let c_bytes = if self.c16 { 2.0 } else { 4.0 };
        let (a, b, c) = (self.m * self.k, self.k * self.n, self.m * self.n);
        let bytes = self.batch as f64
            * (operand * (a + b) as f64
                + c_bytes * c_passes * c as f64
                + self.epilogue.bytes(c, self.m));
        crate::profile::Cost::new(2.0 * per, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    macro_rules! list {
        ($($file:literal),*) => {
            &[$($file),*]
        };
    }

    /// The kernel files, by name.
    const FILES: &[&str] = kernel_files!(list);

    /// Every kernel names a file that is compiled and loaded (a wrong one would only
    /// fail on a GPU, when its PTX is loaded), and every .cu file is in the list.
    #[test]
    fn every_kernel_is_in_a_listed_file_and_every_file_is_listed() {
        // The checkout this was built from, else the working directory (a test binary
        // carried to a GPU machine runs from the copy of the repository there).
        let root = Some(env!("CARGO_MANIFEST_DIR"))
            .filter(|d| std::path::Path::new(d).is_dir())
            .unwrap_or(".");
        for k in Kernel::ALL {
            assert!(FILES.contains(&k.module()), "{k:?} names {}", k.module());
            let path = format!("{root}/src/cuda/kernels/{}.cu", k.module());
            let source = std::fs::read_to_string(&path).unwrap();
            // `void name(`, or `void __launch_bounds__(n)` and the name on the next line.
            let defined = source
                .split(|c: char| c.is_whitespace() || c == ')')
                .any(|word| word.starts_with(&format!("{}(", k.name())));
            assert!(defined, "{} is not in {path}", k.name());
        }
        let dir = format!("{root}/src/cuda/kernels");
        let mut on_disk: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "cu"))
            .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
            .collect();
        on_disk.sort();
        let mut listed: Vec<String> = FILES.iter().map(|f| f.to_string()).collect();
        listed.sort();
        assert_eq!(on_disk, listed);
    }
}
