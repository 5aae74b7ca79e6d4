//! The fused CUDA engine (feature `cuda`): the model's training step as our own CUDA
//! kernels (`kernels/*.cu`, PTX by build.rs) around cuBLAS matrix products, over flat
//! device buffers, in llm.c's manner. The third engine beside the reference (candle's
//! autograd, the oracle) and the fused CPU one; `tests/engines.rs` holds it to the
//! reference on the same GPU.
//!
//! - [`plan`]: every buffer's size, from the shapes (also the memory check; no CUDA).
//! - `buckets`: a batch's rows grouped by token, for the embedding's backward.
//! - `calls`: what the engine asks of a device, as data (kernel launches, products).
//! - `gpu`: where it runs: a CUDA device, or the emulator (below).
//! - `kernels`: every kernel, each behind a typed launch.
//! - `blas`: row-major matrix products on cuBLAS (f32, or bf16 tensor-core products).
//! - `lt` (CUDA only): products with a fused epilogue (the MLP's GELU and its
//!   gradient) on cuBLASLt.
//! - `buffers`: buffers with their addresses; `tables`: the position tables.
//! - `engine`: `FusedCuda`, the forward and backward walk.
//! - `decode`: `CudaDecoder`, decoding with per-layer K/V caches on the device.
//! - `peak`: what a profile holds the engine's work to (the GPU's peak, measured).
//! - `emulator` (feature `cuda-emulator`): the same kernels compiled as C++ and run on
//!   the CPU, and cuBLAS's product written out, so `tests/engines.rs` holds the whole
//!   engine to the reference on machines without a GPU (CI's). What it cannot catch:
//!   the CUDA API's own use (loading, launching, copying) and timing; the GPU tests do.

pub mod plan;

#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
mod blas;
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
mod buckets;
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
mod buffers;
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
mod calls;
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
mod decode;
#[cfg(feature = "cuda-emulator")]
mod emulator;
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
mod engine;
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
mod gpu;
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
mod kernels;
#[cfg(feature = "cuda")]
mod lt;
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
mod peak;
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
mod ranks;
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
mod tables;

#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
pub use decode::CudaDecoder;
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
pub use engine::{Epilogues, FusedCuda};
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
pub use gpu::{emulator_counts_only, Gpu};
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
pub use kernels::SamplingArgs;
pub use plan::{Attention, Plan};
