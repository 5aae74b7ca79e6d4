//! The fused CPU engine (`crate::cpu::FusedCpu`) behind the engine interface: its flat
//! buffers in and out by tensor name, and, in a data-parallel run, ZeRO-1 over the
//! ranks: gradients reduce-scattered, each rank's shard clipped by the global norm and
//! updated with its shard of the moments, the shards of weights gathered again.

use std::sync::Arc;

use anyhow::Result;

use super::interface::{check_batch, moments_by_name, moments_from_names, Engine, Readings};
use crate::config::Precision;
use crate::cpu::FusedCpu;
use crate::data::Batch;
use crate::model::named::{flat_from_named, named_from_flat, weights_from_file, NamedTensors};
use crate::model::{Dropout, ModelSpec};
use crate::optim::{clip_scale, norm_of_partials, AdamWStep};
use crate::parallel::{Collective, Shards, Single};
use crate::profile::{Peak, Profiled, Timing};

/// The fused CPU kernels, what the trainer reads of them, and the ranks they train
/// with.
pub struct FusedCpuEngine {
    kernels: FusedCpu,
    readings: Readings,
    ranks: Ranks,
}

/// The ranks of a run and how the parameters are shared among them.
struct Ranks {
    comm: Arc<dyn Collective>,
    shards: Shards,
    /// A shard's values on their way in or out of a collective.
    shard: Vec<f32>,
}

impl Ranks {
    fn count(&self) -> usize {
        self.comm.size()
    }

    fn counts(&self) -> Vec<usize> {
        self.shards.counts()
    }
}

impl FusedCpuEngine {
    /// The kernels training in one process.
    pub fn new(kernels: FusedCpu) -> Self {
        Self::with_ranks(kernels, Arc::new(Single))
    }

    /// The kernels as one of `comm`'s ranks: this rank updates its shard of the
    /// parameters and keeps AdamW's moments for that shard alone.
    pub fn with_ranks(mut kernels: FusedCpu, comm: Arc<dyn Collective>) -> Self {
        let shards = Shards::new(kernels.spec().len(), comm.size());
        let mine = shards.range(comm.rank());
        kernels.optimize_only(mine.clone());
        Self {
            kernels,
            readings: Readings::default(),
            ranks: Ranks {
                shard: vec![0.0; if comm.size() > 1 { mine.len() } else { 0 }],
                comm,
                shards,
            },
        }
    }

    /// Every rank's shard of `mine` (this rank's), end to end: all the parameters'.
    fn gather(&self, mine: &[f32]) -> Result<Vec<f32>> {
        let mut all = vec![0.0; self.spec().len()];
        self.ranks
            .comm
            .all_gather(mine, &self.ranks.counts(), &mut all)?;
        Ok(all)
    }
}

impl Engine for FusedCpuEngine {
    fn profiled(&self) -> Result<Option<Profiled>> {
        let cpu = crate::cpu::isa::cpu_model().unwrap_or_else(|| "this CPU".into());
        let device = format!("{cpu} ({} threads)", crate::cpu::threads::threads());
        let measured = crate::cpu::peak::measure(self.kernels.precision());
        Ok(Some(Profiled {
            timing: Timing::CpuTimers,
            peak: Peak::measured(device, measured),
        }))
    }

    fn describe(&self) -> String {
        let kernels = format!("fused CPU kernels, {}", crate::cpu::isa::active().name());
        let kernels = match self.kernels.precision() {
            Precision::F32 => kernels,
            Precision::Bf16 if crate::cpu::bf16::has_avx512_bf16() => {
                format!("{kernels}, bf16 matrix products")
            }
            Precision::Bf16 => format!(
                "{kernels}, bf16 matrix products widened to f32 (this CPU lacks AVX512_BF16: \
                 no faster than train.dtype = \"f32\" here)"
            ),
        };
        match self.ranks.count() {
            1 => kernels,
            n => format!("{kernels}; AdamW sharded over {n} ranks (ZeRO-1)"),
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

    fn take_losses(&mut self) -> Result<Vec<f64>> {
        Ok(self.readings.take_losses())
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

    fn reduce_grads(&mut self) -> Result<()> {
        if self.ranks.count() == 1 {
            return Ok(());
        }
        let counts = self.ranks.counts();
        let Ranks { comm, shard, .. } = &mut self.ranks;
        comm.reduce_scatter_sum(self.kernels.grads_mut(), &counts, shard)?;
        self.kernels.optimized_grads_mut().copy_from_slice(shard);
        Ok(())
    }

    fn clip_grads(&mut self, max_norm: f64) -> Result<()> {
        // Each rank's blocks of the norm, in rank order: every block in buffer order.
        let partials = self
            .ranks
            .comm
            .all_gather_lists(&self.kernels.grad_squares())?
            .concat();
        let norm = norm_of_partials(&partials);
        if let Some(scale) = clip_scale(norm, max_norm) {
            self.kernels.scale_grads(scale as f32);
        }
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
        if self.ranks.count() == 1 {
            return Ok(());
        }
        // Every rank's updated shard, into every rank's weights.
        let mine = self.kernels.optimized();
        let counts = self.ranks.counts();
        let Ranks { comm, shard, .. } = &mut self.ranks;
        shard.copy_from_slice(&self.kernels.weights()[mine]);
        comm.all_gather(shard, &counts, self.kernels.weights_mut())
    }

    fn weights(&self) -> Result<NamedTensors> {
        named_from_flat(self.spec().params(), self.kernels.weights(), "")
    }

    fn load_weights(&mut self, tensors: &NamedTensors, source: &str) -> Result<()> {
        let flat = weights_from_file(self.spec().params(), tensors, source)?;
        self.kernels.set_weights(&flat);
        Ok(())
    }

    fn moments(&self) -> Result<NamedTensors> {
        let (m, v) = self.kernels.moments();
        let (m, v) = match self.ranks.count() {
            1 => (m, v),
            _ => (self.gather(&m)?, self.gather(&v)?),
        };
        moments_by_name(self.spec().params(), &m, &v)
    }

    fn load_moments(&mut self, tensors: &NamedTensors, source: &str) -> Result<()> {
        let (m, v) = moments_from_names(self.spec().params(), tensors, source)?;
        let mine = self.kernels.optimized();
        self.kernels.set_moments(&m[mine.clone()], &v[mine]);
        Ok(())
    }
}
