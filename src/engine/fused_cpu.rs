//! The fused CPU engine (`crate::cpu::FusedCpu`) behind the engine interface: its flat
//! buffers in and out by tensor name.

use anyhow::Result;

use super::interface::{check_batch, moments_by_name, moments_from_names, Engine, Readings};
use crate::config::Precision;
use crate::cpu::FusedCpu;
use crate::data::Batch;
use crate::model::params::{flat_from_named, named_from_flat, NamedTensors};
use crate::model::{Dropout, ModelSpec};
use crate::optim::AdamWStep;

/// The fused CPU kernels, and what the trainer reads of them.
pub struct FusedCpuEngine {
    kernels: FusedCpu,
    readings: Readings,
}

impl FusedCpuEngine {
    pub fn new(kernels: FusedCpu) -> Self {
        Self {
            kernels,
            readings: Readings::default(),
        }
    }
}

impl Engine for FusedCpuEngine {
    fn describe(&self) -> String {
        let kernels = format!("fused CPU kernels, {}", crate::cpu::isa::active().name());
        match self.kernels.precision() {
            Precision::F32 => kernels,
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
        self.kernels.spec()
    }

    fn forward(&mut self, batch: &Batch, dropout: Option<&Dropout>) -> Result<()> {
        check_batch(self.kernels.batch(), self.spec().shapes.block_size, batch)?;
        let loss = self.kernels.forward(&batch.x, &batch.y, dropout);
        self.readings.add_loss(loss);
        Ok(())
    }

    fn take_loss(&mut self) -> Result<f64> {
        self.readings.take_loss()
    }

    fn position_losses(&self) -> Result<Vec<f64>> {
        Ok(self.kernels.position_losses().to_vec())
    }

    fn backward(&mut self, scale: f32) -> Result<()> {
        self.kernels.backward(scale);
        Ok(())
    }

    fn zero_grads(&mut self) -> Result<()> {
        self.kernels.zero_grads();
        Ok(())
    }

    fn clip_grads(&mut self, max_norm: f64) -> Result<()> {
        let norm = self.kernels.clip_grads(max_norm);
        self.readings.set_grad_norm(norm);
        Ok(())
    }

    fn grad_norm(&self) -> Result<f64> {
        self.readings.grad_norm()
    }

    fn grads(&self) -> Result<NamedTensors> {
        let grads = self.kernels.grads();
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
        self.kernels.grads_mut().copy_from_slice(&flat);
        Ok(())
    }

    fn adamw(&mut self, u: &AdamWStep) -> Result<()> {
        self.kernels.adamw(u);
        Ok(())
    }

    fn weights(&self) -> Result<NamedTensors> {
        named_from_flat(self.spec().params(), self.kernels.weights(), "")
    }

    fn load_weights(&mut self, tensors: &NamedTensors, source: &str) -> Result<()> {
        let flat = flat_from_named(self.spec().params(), tensors, "", source)?;
        self.kernels.set_weights(&flat);
        Ok(())
    }

    fn moments(&self) -> Result<NamedTensors> {
        let (m, v) = self.kernels.moments();
        moments_by_name(self.spec().params(), &m, &v)
    }

    fn load_moments(&mut self, tensors: &NamedTensors, source: &str) -> Result<()> {
        let (m, v) = moments_from_names(self.spec().params(), tensors, source)?;
        self.kernels.set_moments(&m, &v);
        Ok(())
    }
}
