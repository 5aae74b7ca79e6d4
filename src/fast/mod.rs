//! The CPU fast paths: our own kernels over preallocated buffers, checked against the
//! reference model (plain candle ops) in tests. The reference stays the definition of
//! the model and the path on every other device.

pub mod bf16;
pub mod decode;
pub mod gemm;
pub mod kernels;
pub mod ops;
pub mod parallel;
pub mod train;

pub use decode::FastDecoder;
