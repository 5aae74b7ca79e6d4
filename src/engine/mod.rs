//! One interface for what computes losses, gradients and updates. The trainer, `eval`
//! and `bench` hold a `Box<dyn Engine>` and never ask which one it is.
//!
//! Three engines read the same model spec: [`reference::ReferenceEngine`] (the candle
//! model of `crate::model` with candle's autograd, on any device; the oracle in tests),
//! [`crate::cpu::FusedCpu`] (our kernels over flat buffers) and, built with the `cuda`
//! feature, `crate::cuda::FusedCuda` (our CUDA kernels and cuBLAS over flat device
//! buffers). [`footprint`] names the engine for a device and the options;
//! [`build_replica`] builds it (with the first-use fallbacks). A new engine is an
//! `impl Engine` and an arm in each.
//!
//! An engine holds no random state: dropout masks are a function of (seed, step,
//! micro-batch), passed in with each forward, and batches are drawn by the trainer.

pub mod footprint;
pub mod fused_cpu;
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
pub mod fused_cuda;
pub mod interface;
pub mod race;
pub mod reference;

use std::sync::Arc;

use anyhow::Result;
use candle_core::Device;

use crate::cpu::FusedCpu;
use crate::model::ModelSpec;
use crate::parallel::{Collective, Single};
pub use footprint::{evaluation_bytes, training_bytes, Footprint};
pub use interface::{Engine, EngineOptions, MOMENT_SUFFIXES};
use reference::ReferenceEngine;

/// The engine for the model `spec` on `device`, starting from `weights` (a flat buffer
/// in table order: `spec.initial_values(seed)`, or a checkpoint's): the fused engine
/// of the CPU or of CUDA unless `options.fused` is off, the reference engine
/// everywhere else. Where a GPU's first-use check fails, the reference engine trains
/// instead (CUDA) or the fused CPU engine (Metal): a wrong GPU costs speed, not a
/// wrong model.
pub fn build(
    spec: &ModelSpec,
    weights: &[f32],
    device: &Device,
    options: EngineOptions,
) -> Result<Box<dyn Engine>> {
    build_replica(spec, weights, device, options, Arc::new(Single))
}

/// [`build`] for one rank of a data-parallel run over `comm` (every rank starting from
/// the same `weights`): the fused engines share AdamW's work and memory over the ranks
/// (ZeRO-1). The reference engine trains in one process only.
pub fn build_replica(
    spec: &ModelSpec,
    weights: &[f32],
    device: &Device,
    options: EngineOptions,
    comm: Arc<dyn Collective>,
) -> Result<Box<dyn Engine>> {
    let (batch, precision) = (options.batch, options.precision);
    let ranks = comm.size();
    #[cfg(feature = "cuda-emulator")]
    let emulated = emulate_cuda();
    #[cfg(not(feature = "cuda-emulator"))]
    let emulated = false;
    let tf32_runs = device.is_cuda() || emulated;
    if options.tf32 && precision == crate::config::Precision::F32 && !tf32_runs {
        crate::errln!(
            "note: train.tf32 is for CUDA GPUs' tensor cores; on {} the products stay f32",
            crate::device::name(device)
        );
    }
    // Where the fused CUDA code failed its first-use check, the reference engine trains.
    #[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
    let cuda_failed = first_use_failure;
    let reference = |why: &'static str| -> Result<Box<dyn Engine>> {
        if ranks > 1 {
            crate::user_bail!(
                "the reference engine trains in one process, not {ranks} ranks; set train.fused = true (the fused engines run on the CPU and on CUDA)"
            );
        }
        let options = EngineOptions {
            fused: false,
            ..options
        };
        Ok(Box::new(ReferenceEngine::new(
            spec, weights, device, options, why,
        )?))
    };
    match footprint(device, &options) {
        #[cfg(feature = "cuda-emulator")]
        Footprint::FusedCpu if emulate_cuda() => {
            // Counting the work (`TINYGPT_EMULATE_CUDA=costs`) runs nothing to check.
            let check = !crate::cuda::emulator_counts_only();
            if let Some(line) = check.then(|| cuda_failed(None)).transpose()?.flatten() {
                crate::errln!("{line}");
                return reference("the fused CUDA code failed its first-use check");
            }
            let engine = crate::cuda::FusedCuda::emulated(spec, weights, batch, precision)?
                .with_tf32(options.tf32);
            Ok(Box::new(engine.with_ranks(comm)?))
        }
        Footprint::FusedCpu => {
            let kernels = FusedCpu::new(spec, weights, batch, precision)?;
            Ok(Box::new(fused_cpu::FusedCpuEngine::with_ranks(
                kernels, comm,
            )))
        }
        #[cfg(feature = "cuda")]
        Footprint::FusedCuda => {
            if let Some(line) = cuda_failed(Some(device))? {
                crate::errln!("{line}");
                return reference("the fused CUDA code failed its first-use check");
            }
            let engine = crate::cuda::FusedCuda::new(spec, weights, device, batch, precision)?
                .with_tf32(options.tf32);
            Ok(Box::new(engine.with_ranks(comm)?))
        }
        _ if !options.fused => reference("train.fused = false"),
        // Where candle's Metal ops fail their first-use check, the fused CPU engine
        // trains: a wrong GPU costs speed, not a wrong model.
        #[cfg(feature = "metal")]
        _ if device.is_metal() => {
            if let Some(line) = first_use_failure(Some(device))? {
                crate::errln!("{line}");
                let kernels = FusedCpu::new(spec, weights, batch, precision)?;
                return Ok(Box::new(fused_cpu::FusedCpuEngine::with_ranks(
                    kernels, comm,
                )));
            }
            reference("no fused engine for Metal: candle's ops")
        }
        _ => reference("no fused engine for this device yet"),
    }
}

/// A check the fused CUDA code passes before it first runs on a GPU (`None`: under the
/// emulator): `Some(line)` when it failed, the line to say. The binary sets it
/// (`doctor::first_use_check`, which builds engines itself, so it cannot be called from
/// here); unset, everything passes.
pub type FirstUseCheck = fn(Option<&Device>) -> Result<Option<String>>;

static FIRST_USE: std::sync::OnceLock<FirstUseCheck> = std::sync::OnceLock::new();

/// Sets the check [`first_use_failure`] runs (once; later calls are ignored).
pub fn set_first_use_check(check: FirstUseCheck) {
    let _ = FIRST_USE.set(check);
}

/// The line to say where the fused CUDA code failed its first-use check on `gpu`.
pub fn first_use_failure(gpu: Option<&Device>) -> Result<Option<String>> {
    match FIRST_USE.get() {
        Some(check) => check(gpu),
        None => Ok(None),
    }
}

/// Builds with the feature `cuda-emulator` take `TINYGPT_EMULATE_CUDA=1` to mean: where
/// the fused CPU engine would run, run the fused CUDA engine under the CPU emulator
/// instead. A developer's switch (train, eval, bench with the CUDA engine's code on a
/// machine without a GPU, slowly) and the trainer tests' (tests/emulated_training.rs).
/// `TINYGPT_EMULATE_CUDA=costs` builds the same engine but runs none of its kernels and
/// products, only counting them for `bench --profile`: the cost of shapes too large to
/// emulate, whose numbers are then meaningless.
#[cfg(feature = "cuda-emulator")]
fn emulate_cuda() -> bool {
    std::env::var_os("TINYGPT_EMULATE_CUDA").is_some_and(|v| v == "1" || v == "costs")
}

/// The engine [`build`] chooses for `device` and `options`, as the footprint to
/// estimate (the one place the choice is made).
pub fn footprint(device: &Device, options: &EngineOptions) -> Footprint {
    if !options.fused {
        Footprint::Reference
    } else if device.is_cpu() {
        Footprint::FusedCpu
    } else if cfg!(feature = "cuda") && device.is_cuda() {
        Footprint::FusedCuda
    } else {
        Footprint::Reference
    }
}
