//! The fused CPU engine and decoder: our own kernels over flat, preallocated buffers
//! (llm.c's way), reading the same model spec as the reference and held to it in tests.
//!
//! Read in this order: `isa` (which vector instructions run), `threads` (how work is
//! split; `team` for one-stream decoding), `matrix` (how a product is
//! described), `kernels` (vector building blocks, compiled per CPU), `gemm`, `sgemm`, `bf16` and
//! `amx` (matrix products; `panels` holds the bf16 pack buffers), `ops/` (each layer's forward and backward side by side), `layout`
//! (typed views of the flat buffers), `engine` (the training step) and `decode`
//! (decoding with a K/V cache).

// Compiled for its tests everywhere; it calls Apple's BLAS on macOS alone.
#[cfg(any(test, all(feature = "accelerate", target_os = "macos")))]
mod accelerate;
#[cfg(target_arch = "x86_64")]
pub mod amx;
pub mod bf16;
pub mod cached_attention;
pub mod decode;
pub mod decode_weights;
pub mod engine;
pub mod gemm;
pub mod grouped;
pub mod isa;
pub mod kernels;
pub mod kv_cache;
pub mod layout;
pub mod lines;
pub mod matrix;
pub mod matvec;
pub mod ops;
mod panels;
pub mod peak;
pub mod prompt_attention;
pub mod q4;
pub mod q8;
pub mod q8_matrix;
#[cfg(target_arch = "x86_64")]
mod sgemm;
pub mod team;
pub mod threads;
pub mod weight_rows;

pub use decode::FastDecoder;
pub use decode_weights::{DecodeWeights, WeightFormat};
pub use engine::FusedCpu;
pub use kv_cache::{KvPrecision, Place};
