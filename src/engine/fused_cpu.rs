//! The fused CPU engine (`crate::cpu::FusedCpu`) behind the engine interface: its flat
//! buffers in and out by tensor name.

use anyhow::Result;

use super::interface::{check_batch, moments_by_name, moments_from_names, Engine};
use crate::config::Precision;
use crate::cpu::FusedCpu;
use crate::data::Batch;
use crate::model::params::{flat_from_named, named_from_flat, NamedTensors};
use crate::model::{Dropout, ModelSpec};
use crate::optim::AdamWStep;

impl Engine for FusedCpu {
    fn describe(&self) -> String {
        let kernels = format!("fused CPU kernels, {}", crate::cpu::isa::active().name());
        match self.precision() {
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
        let (m, v) = FusedCpu::moments(self);
        moments_by_name(self.spec().params(), &m, &v)
    }

    fn load_moments(&mut self, tensors: &NamedTensors, source: &str) -> Result<()> {
        let (m, v) = moments_from_names(self.spec().params(), tensors, source)?;
        self.set_moments(&m, &v);
        Ok(())
    }
}
