//! The fused CUDA engine (`crate::cuda::FusedCuda`) behind the engine interface: its
//! flat device buffers in and out by tensor name.

use anyhow::Result;

use super::interface::{check_batch, moments_by_name, moments_from_names, Engine};
use crate::config::Math;
use crate::cuda::{Attention, FusedCuda};
use crate::data::Batch;
use crate::model::named::{flat_from_named, named_from_flat, weights_from_file, NamedTensors};
use crate::model::{Dropout, ModelSpec};
use crate::optim::AdamWStep;
use crate::profile::Profiled;

impl Engine for FusedCuda {
    fn profiled(&self) -> Result<Option<Profiled>> {
        FusedCuda::profiled(self).map(Some)
    }

    fn describe(&self) -> String {
        let products = match (self.math(), self.bf16_operands()) {
            (Math::F32, _) => "fused CUDA kernels, cuBLAS f32 products",
            (Math::Tf32, _) => {
                "fused CUDA kernels, cuBLAS TF32 tensor-core products of f32 data (train.tf32)"
            }
            (Math::Bf16, true) => {
                "fused CUDA kernels, bf16 tensor-core products of bf16 operand copies (f32 sums and weights)"
            }
            (Math::Bf16, false) => {
                "fused CUDA kernels, bf16 tensor-core products of f32 operands rounded by cuBLAS (f32 sums and weights)"
            }
        };
        let e = self.epilogues();
        let fused: Vec<&str> = [
            (e.gelu, "the GELU"),
            (e.gelu_gradient, "its gradient"),
            (e.qkv_bias, "the qkv bias"),
        ]
        .into_iter()
        .filter_map(|(on, what)| on.then_some(what))
        .collect();
        let products = match fused.is_empty() {
            true => products.to_string(),
            false => format!("{products}, {} in their epilogues", fused.join(", ")),
        };
        let kernels = match self.attention() {
            Attention::Flash => format!("{products}, flash attention"),
            Attention::Products => products,
        };
        let kernels = match self.graphs() {
            true => format!("{kernels}; passes replayed as CUDA graphs"),
            false => kernels,
        };
        let kernels = match crate::cuda::emulator_counts_only() {
            true => format!(
                "{kernels}; emulated, counting its work only (TINYGPT_EMULATE_CUDA=costs): its times and losses mean nothing"
            ),
            false => kernels,
        };
        match self.ranks_described() {
            Some(ranks) => format!("{kernels}; {ranks}"),
            None => kernels,
        }
    }

    fn name(&self) -> &'static str {
        "fused"
    }

    fn spec(&self) -> &ModelSpec {
        FusedCuda::spec(self)
    }

    fn forward(&mut self, batch: &Batch, dropout: Option<&Dropout>) -> Result<()> {
        check_batch(self.batch(), self.spec().shapes.block_size, batch)?;
        FusedCuda::forward(self, &batch.x, &batch.y, dropout)
    }

    fn take_losses(&mut self) -> Result<Vec<f64>> {
        FusedCuda::take_losses(self)
    }

    fn position_losses(&self) -> Result<Vec<f64>> {
        FusedCuda::position_losses(self)
    }

    fn backward(&mut self, scale: f32) -> Result<()> {
        FusedCuda::backward(self, scale)
    }

    fn zero_grads(&mut self) -> Result<()> {
        FusedCuda::zero_grads(self)
    }

    fn reduce_grads(&mut self) -> Result<()> {
        FusedCuda::reduce_grads(self)
    }

    fn clip_grads(&mut self, max_norm: f64) -> Result<()> {
        FusedCuda::clip_grads(self, max_norm)
    }

    fn grad_norm(&self) -> Result<f64> {
        FusedCuda::grad_norm(self)
    }

    fn grads(&self) -> Result<NamedTensors> {
        named_from_flat(self.spec().params(), &FusedCuda::grads(self)?, "")
    }

    fn set_grads(&mut self, grads: &NamedTensors, source: &str) -> Result<()> {
        let flat = flat_from_named(self.spec().params(), grads, "", source)?;
        FusedCuda::set_grads(self, &flat)
    }

    fn adamw(&mut self, u: &AdamWStep) -> Result<()> {
        FusedCuda::adamw(self, u)
    }

    fn weights(&self) -> Result<NamedTensors> {
        named_from_flat(self.spec().params(), &FusedCuda::weights(self)?, "")
    }

    fn load_weights(&mut self, tensors: &NamedTensors, source: &str) -> Result<()> {
        let flat = weights_from_file(self.spec().params(), tensors, source)?;
        self.set_weights(&flat)
    }

    fn moments(&self) -> Result<NamedTensors> {
        let (m, v) = FusedCuda::moments(self)?;
        moments_by_name(self.spec().params(), &m, &v)
    }

    fn load_moments(&mut self, tensors: &NamedTensors, source: &str) -> Result<()> {
        let (m, v) = moments_from_names(self.spec().params(), tensors, source)?;
        self.set_moments(&m, &v)
    }
}
