//! One interface for what computes losses, gradients and updates. The trainer, `eval`
//! and `bench` hold a `Box<dyn Engine>` and never ask which one it is.
//!
//! Two engines read the same model spec: [`reference::ReferenceEngine`] (the candle
//! model of `crate::model` with candle's autograd, on any device; the oracle in tests)
//! and [`crate::cpu::FusedCpu`] (our kernels over flat buffers). [`build`] chooses one;
//! a new engine (fused CUDA, say) is an `impl Engine` and one arm there.
//!
//! An engine holds no random state: dropout masks are a function of (seed, step,
//! micro-batch), passed in with each forward, and batches are drawn by the trainer.

pub mod footprint;
pub mod fused_cpu;
pub mod interface;
pub mod reference;

use anyhow::Result;
use candle_core::Device;

use crate::cpu::FusedCpu;
use crate::model::ModelSpec;
pub use footprint::{training_bytes, Footprint};
pub use interface::{Engine, EngineOptions, MOMENT_SUFFIXES};
use reference::ReferenceEngine;

/// The engine for the model `spec` on `device`, starting from `weights` (a flat buffer
/// in table order: `spec.initial_values(seed)`, or a checkpoint's): the fused CPU
/// engine on the CPU unless `options.fused` is off, the reference engine everywhere
/// else.
pub fn build(
    spec: &ModelSpec,
    weights: &[f32],
    device: &Device,
    options: EngineOptions,
) -> Result<Box<dyn Engine>> {
    if footprint(device, &options) == Footprint::FusedCpu {
        let engine = FusedCpu::new(spec, weights, options.batch, options.precision)?;
        return Ok(Box::new(engine));
    }
    let why = if !options.fused {
        "train.fused = false"
    } else {
        "no fused engine for this device yet"
    };
    let engine = ReferenceEngine::new(spec, weights, device, options, why)?;
    Ok(Box::new(engine))
}

/// The engine [`build`] chooses for `device` and `options`, as the footprint to
/// estimate (the one place the choice is made).
pub fn footprint(device: &Device, options: &EngineOptions) -> Footprint {
    if options.fused && device.is_cpu() {
        Footprint::FusedCpu
    } else {
        Footprint::Reference
    }
}
