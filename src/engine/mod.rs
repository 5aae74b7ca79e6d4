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

pub mod reference;

use anyhow::Result;
use candle_core::Device;

use crate::config::Precision;
use crate::cpu::FusedCpu;
use crate::data::Batch;
use crate::model::params::{flat_from_named, named_from_flat, NamedTensors};
use crate::model::{Dropout, ModelSpec};
use crate::optim::AdamWStep;
use reference::ReferenceEngine;

/// A model that trains: loss, gradients, updates, and its state in and out.
pub trait Engine {
    /// How it computes, for the run's first line (e.g. "fused CPU kernels").
    fn describe(&self) -> String;

    /// "fused" or "reference" (bench's JSON).
    fn name(&self) -> &'static str;

    fn spec(&self) -> &ModelSpec;

    /// Mean next-token loss of `batch` (as many sequences as the engine was built
    /// for, block_size tokens each), with `dropout` when training. Keeps what
    /// `backward` needs.
    fn forward(&mut self, batch: &Batch, dropout: Option<&Dropout>) -> Result<f64>;

    /// Each position's loss in the last forward, (batch, block_size) row-major.
    fn position_losses(&self) -> Result<Vec<f64>>;

    /// Adds the gradient of the last forward's loss times `scale` to the gradients.
    fn backward(&mut self, scale: f32) -> Result<()>;

    fn zero_grads(&mut self) -> Result<()>;

    /// Scales the gradients to a global L2 norm of at most `max_norm` (0: no clipping)
    /// and returns the norm before.
    fn clip_grads(&mut self, max_norm: f64) -> Result<f64>;

    /// The gradients summed since `zero_grads`, by parameter name (zeros where none
    /// arrived).
    fn grads(&self) -> Result<NamedTensors>;

    /// Replaces the gradients (tests hold every engine's optimiser to the same
    /// gradients); `source` names them in errors.
    fn set_grads(&mut self, grads: &NamedTensors, source: &str) -> Result<()>;

    /// Applies the AdamW update `u` with the current gradients.
    fn adamw(&mut self, u: &AdamWStep) -> Result<()>;

    /// A copy of the weights by tensor name (as `model.safetensors` holds them).
    fn weights(&self) -> Result<NamedTensors>;

    /// Replaces the weights; `source` names the file in errors.
    fn load_weights(&mut self, tensors: &NamedTensors, source: &str) -> Result<()>;

    /// AdamW's moments by name (`<param>.exp_avg`, `<param>.exp_avg_sq`), zeros before
    /// the first update.
    fn moments(&self) -> Result<NamedTensors>;

    fn load_moments(&mut self, tensors: &NamedTensors, source: &str) -> Result<()>;
}

/// How to build an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineOptions {
    /// Sequences per forward.
    pub batch: usize,
    /// Precision of the matrix products.
    pub precision: Precision,
    /// Use a fused engine where one runs on the device (`train.fused`).
    pub fused: bool,
}

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
    let why = if !options.fused {
        "train.fused = false"
    } else if device.is_cpu() {
        let engine = FusedCpu::new(spec, weights, options.batch, options.precision)?;
        return Ok(Box::new(engine));
    } else {
        "no fused engine for this device yet"
    };
    let engine = ReferenceEngine::new(spec, weights, device, options, why)?;
    Ok(Box::new(engine))
}

impl Engine for FusedCpu {
    fn describe(&self) -> String {
        let kernels = "fused CPU kernels";
        match self.precision() {
            Precision::F32 => kernels.into(),
            Precision::Bf16 if crate::cpu::bf16::has_avx512_bf16() => {
                format!("{kernels}, bf16 matrix products")
            }
            Precision::Bf16 => format!(
                "{kernels}, bf16 matrix products emulated (this CPU lacks AVX512_BF16: \
                 train.dtype = \"f32\" is faster here)"
            ),
        }
    }

    fn name(&self) -> &'static str {
        "fused"
    }

    fn spec(&self) -> &ModelSpec {
        FusedCpu::spec(self)
    }

    fn forward(&mut self, batch: &Batch, dropout: Option<&Dropout>) -> Result<f64> {
        check_batch(self.batch(), self.spec().shapes.block_size, batch)?;
        Ok(FusedCpu::forward(self, &batch.x, &batch.y, dropout))
    }

    fn position_losses(&self) -> Result<Vec<f64>> {
        Ok(FusedCpu::position_losses(self).to_vec())
    }

    fn backward(&mut self, scale: f32) -> Result<()> {
        FusedCpu::backward(self, scale);
        Ok(())
    }

    fn zero_grads(&mut self) -> Result<()> {
        FusedCpu::zero_grads(self);
        Ok(())
    }

    fn clip_grads(&mut self, max_norm: f64) -> Result<f64> {
        Ok(FusedCpu::clip_grads(self, max_norm))
    }

    fn grads(&self) -> Result<NamedTensors> {
        let grads = FusedCpu::grads(self);
        let zeros;
        let flat = if grads.is_empty() {
            zeros = vec![0.0; self.spec().len()];
            &zeros
        } else {
            grads
        };
        named_from_flat(self.spec().params(), flat, "")
    }

    fn set_grads(&mut self, grads: &NamedTensors, source: &str) -> Result<()> {
        let flat = flat_from_named(self.spec().params(), grads, "", source)?;
        self.grads_mut().copy_from_slice(&flat);
        Ok(())
    }

    fn adamw(&mut self, u: &AdamWStep) -> Result<()> {
        FusedCpu::adamw(self, u);
        Ok(())
    }

    fn weights(&self) -> Result<NamedTensors> {
        named_from_flat(self.spec().params(), FusedCpu::weights(self), "")
    }

    fn load_weights(&mut self, tensors: &NamedTensors, source: &str) -> Result<()> {
        let flat = flat_from_named(self.spec().params(), tensors, "", source)?;
        self.set_weights(&flat);
        Ok(())
    }

    fn moments(&self) -> Result<NamedTensors> {
        let table = self.spec().params();
        let (m, v) = FusedCpu::moments(self);
        let mut out = named_from_flat(table, &m, MOMENT_SUFFIXES[0])?;
        out.extend(named_from_flat(table, &v, MOMENT_SUFFIXES[1])?);
        Ok(out)
    }

    fn load_moments(&mut self, tensors: &NamedTensors, source: &str) -> Result<()> {
        let table = self.spec().params();
        let m = flat_from_named(table, tensors, MOMENT_SUFFIXES[0], source)?;
        let v = flat_from_named(table, tensors, MOMENT_SUFFIXES[1], source)?;
        self.set_moments(&m, &v);
        Ok(())
    }
}

/// The names of AdamW's two moments of a parameter: `<param>.exp_avg` (m) and
/// `<param>.exp_avg_sq` (v), as PyTorch's AdamW state calls them.
pub const MOMENT_SUFFIXES: [&str; 2] = [".exp_avg", ".exp_avg_sq"];

/// An engine built for `sequences` of `block` tokens takes only batches of that shape.
fn check_batch(sequences: usize, block: usize, batch: &Batch) -> Result<()> {
    let shape = (batch.batch, batch.block);
    let filled = batch.x.len() == sequences * block && batch.y.len() == batch.x.len();
    if shape != (sequences, block) || !filled {
        anyhow::bail!("a batch of {shape:?} for an engine built for ({sequences}, {block})");
    }
    Ok(())
}
