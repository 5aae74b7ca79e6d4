//! The interface every engine implements: what the trainer, `eval` and `bench` need
//! from a model that computes somewhere.

use anyhow::Result;

use crate::config::Precision;
use crate::data::Batch;
use crate::model::named::{flat_from_named, named_from_flat, NamedTensors};
use crate::model::spec::Param;
use crate::model::{Dropout, ModelSpec};
use crate::optim::AdamWStep;
use crate::profile::Profiled;

/// A model that trains: loss, gradients, updates, and its state in and out.
pub trait Engine {
    /// How it computes, for the run's first line (e.g. "fused CPU kernels").
    fn describe(&self) -> String;

    /// "fused" or "reference" (bench's JSON).
    fn name(&self) -> &'static str;

    fn spec(&self) -> &ModelSpec;

    /// The mean next-token loss of `batch` (as many sequences as the engine was built
    /// for, block_size tokens each), with `dropout` when training, added to the losses
    /// `take_losses` reads. Keeps what `backward` needs.
    fn forward(&mut self, batch: &Batch, dropout: Option<&Dropout>) -> Result<()>;

    /// Each forward's mean loss since the last call, in order, which it forgets. A GPU
    /// engine keeps them on the device and this is where the host waits for it, so the
    /// trainer calls it only when it reports, not every step.
    fn take_losses(&mut self) -> Result<Vec<f64>>;

    /// The mean of the losses of the forwards since the last call (summed in order),
    /// which it forgets.
    fn take_loss(&mut self) -> Result<f64> {
        let losses = self.take_losses()?;
        anyhow::ensure!(
            !losses.is_empty(),
            "a loss read with no forward since the last"
        );
        Ok(losses.iter().sum::<f64>() / losses.len() as f64)
    }

    /// `forward`, then its loss (with no other forward since the last `take_loss`).
    fn loss(&mut self, batch: &Batch, dropout: Option<&Dropout>) -> Result<f64> {
        self.forward(batch, dropout)?;
        self.take_loss()
    }

    /// Each position's loss in the last forward, (batch, block_size) row-major.
    fn position_losses(&self) -> Result<Vec<f64>>;

    /// Adds the gradient of the last forward's loss times `scale` to the gradients.
    fn backward(&mut self, scale: f32) -> Result<()>;

    fn zero_grads(&mut self) -> Result<()>;

    /// Adds up the ranks' gradients in a data-parallel run, once a step after the last
    /// backward: each rank then holds, for the parameters it updates (its ZeRO-1
    /// shard), the sum of every rank's gradients. With one process there is nothing
    /// to add. `clip_grads` and `adamw` then act on what each rank updates, and the
    /// updated shards are gathered, so every rank ends the step with all the weights.
    fn reduce_grads(&mut self) -> Result<()>;

    /// Scales the gradients to a global L2 norm of at most `max_norm` (0: no
    /// clipping).
    fn clip_grads(&mut self, max_norm: f64) -> Result<()>;

    /// The global L2 norm of the gradients the last `clip_grads` measured, before it
    /// scaled them. Waits for the device, as `take_loss` does.
    fn grad_norm(&self) -> Result<f64>;

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

    /// Replaces the weights, which must be exactly the model's tensors (a missing, extra
    /// or mis-shaped one is refused); `source` names the file in errors.
    fn load_weights(&mut self, tensors: &NamedTensors, source: &str) -> Result<()>;

    /// AdamW's moments by name (`<param>.exp_avg`, `<param>.exp_avg_sq`), zeros before
    /// the first update: all of them, the ranks' shards gathered (every rank calls it).
    fn moments(&self) -> Result<NamedTensors>;

    /// Loads the moments of all parameters (each rank keeps its shard's).
    fn load_moments(&mut self, tensors: &NamedTensors, source: &str) -> Result<()>;

    /// How a profile (`bench --profile`) times this engine's work, and the peak of the
    /// device it runs on (measured there where it can be: this takes a second or so).
    /// None where its work is not recorded (the reference engine: candle's ops).
    fn profiled(&self) -> Result<Option<Profiled>> {
        Ok(None)
    }
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
    /// f32 products on TF32 tensor cores where the device has them (`train.tf32`).
    pub tf32: bool,
}

impl EngineOptions {
    /// `batch` sequences a forward, f32 products, the fused engine where the device has
    /// one if `fused`: what scoring and the checks build.
    pub fn f32(batch: usize, fused: bool) -> Self {
        Self {
            batch,
            precision: Precision::F32,
            fused,
            tf32: false,
        }
    }

    /// The same options with products in `precision`.
    pub fn with(self, precision: Precision) -> Self {
        Self { precision, ..self }
    }
}

/// What a host-side engine keeps for the trainer to read: the losses since the last
/// read, and the gradient norm of the last clip. (The CUDA engine keeps the same
/// on the device.)
#[derive(Debug, Default)]
pub(super) struct Readings {
    losses: Vec<f64>,
    grad_norm: Option<f64>,
}

impl Readings {
    pub fn add_loss(&mut self, loss: f64) {
        self.losses.push(loss);
    }

    pub fn take_losses(&mut self) -> Vec<f64> {
        std::mem::take(&mut self.losses)
    }

    pub fn set_grad_norm(&mut self, norm: f64) {
        self.grad_norm = Some(norm);
    }

    pub fn grad_norm(&self) -> Result<f64> {
        self.grad_norm
            .ok_or_else(|| anyhow::anyhow!("a gradient norm read before any clip_grads"))
    }
}

/// The names of AdamW's two moments of a parameter: `<param>.exp_avg` (m) and
/// `<param>.exp_avg_sq` (v), as PyTorch's AdamW state calls them.
pub const MOMENT_SUFFIXES: [&str; 2] = [".exp_avg", ".exp_avg_sq"];

/// AdamW's two flat moment buffers (laid out as `table`) by tensor name.
pub(super) fn moments_by_name(table: &[Param], m: &[f32], v: &[f32]) -> Result<NamedTensors> {
    let mut out = named_from_flat(table, m, MOMENT_SUFFIXES[0])?;
    out.extend(named_from_flat(table, v, MOMENT_SUFFIXES[1])?);
    Ok(out)
}

/// The two flat moment buffers from tensors by name; `source` names them in errors.
pub(super) fn moments_from_names(
    table: &[Param],
    tensors: &NamedTensors,
    source: &str,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let m = flat_from_named(table, tensors, MOMENT_SUFFIXES[0], source)?;
    let v = flat_from_named(table, tensors, MOMENT_SUFFIXES[1], source)?;
    Ok((m, v))
}

/// An engine built for `sequences` of `block` tokens takes only batches of that shape.
pub(super) fn check_batch(sequences: usize, block: usize, batch: &Batch) -> Result<()> {
    let shape = (batch.batch, batch.block);
    let filled = batch.x.len() == sequences * block && batch.y.len() == batch.x.len();
    if shape != (sequences, block) || !filled {
        anyhow::bail!("a batch of {shape:?} for an engine built for ({sequences}, {block})");
    }
    Ok(())
}
