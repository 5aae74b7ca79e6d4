//! The fused CUDA engine (feature `cuda`): the model's training step as our own CUDA
//! kernels (`kernels/*.cu`, PTX by build.rs) around cuBLAS matrix products, over flat
//! device buffers, in llm.c's manner. The third engine beside the reference (candle's
//! autograd, the oracle) and the fused CPU one; `tests/engines.rs` holds it to the
//! reference on the same GPU.
//!
//! - [`plan`]: every buffer's size, from the shapes (also the memory check; no CUDA).
//! - `kernels`: the kernels, loaded, each behind a typed launch.
//! - `blas`: row-major matrix products on cuBLAS (f32, or bf16 tensor-core products).
//! - `buffers`: device buffers with their addresses.
//! - `engine`: [`FusedCuda`], the forward and backward walk.

pub mod plan;

#[cfg(feature = "cuda")]
mod blas;
#[cfg(feature = "cuda")]
mod buffers;
#[cfg(feature = "cuda")]
mod engine;
#[cfg(feature = "cuda")]
mod kernels;

#[cfg(feature = "cuda")]
pub use engine::FusedCuda;
pub use plan::Plan;
