//! tinygpt: train and sample small GPT language models, on candle.
//!
//! The data path, one direction: [`config`] -> [`corpus`] (+ [`tokenizer`]) -> [`data`]
//! -> [`model`] -> [`train`] -> [`checkpoint`]. The binary (`src/main.rs`) only parses
//! arguments and calls into here; the library reports training through the
//! [`train::Reporter`] it is given, and prints only the progress of preparing a corpus
//! (bars on stderr, one closing line each: see [`util::bars`]).

#[cfg(all(feature = "accelerate", not(target_os = "macos")))]
compile_error!("the `accelerate` feature is Apple's Accelerate framework: macOS only (build without it elsewhere)");

pub mod bench;
pub mod checkpoint;
pub mod compare;
pub mod config;
pub mod corpus;
pub mod cpu;
pub mod cuda;
pub mod data;
pub mod device;
pub mod doctor;
pub mod engine;
pub mod error;
pub mod eval;
pub mod generate;
pub mod gguf;
pub mod interop;
pub mod inventory;
pub mod lock;
pub mod mapped;
pub mod model;
pub mod optim;
pub mod parallel;
pub mod plot;
pub mod profile;
pub mod progress;
pub mod serve;
pub mod sweep;

pub mod tokenizer;
pub mod train;
pub mod util;
