//! What an engine needs in memory to train, estimated before anything is allocated, so
//! a config that cannot fit is refused with a message instead of exhausting the machine.

use crate::config::{ModelConfig, TrainConfig};
use crate::model::ModelSpec;

/// Which engine's footprint to estimate ([`super::footprint`] tells the one `build`
/// chooses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Footprint {
    /// candle's autograd (the reference engine): every intermediate kept for backward.
    Reference,
    /// The fused CPU engine: flat buffers of what backward needs, attention recomputed.
    FusedCpu,
    /// The fused CUDA engine: its allocation plan, exactly (`crate::cuda::Plan`).
    FusedCuda,
}

/// Bytes for building one rank's engine (of `ranks`) and one training step: weights,
/// gradients, a micro-batch's own gradients when several are summed, and the rank's
/// share of AdamW's two moments (f32), plus activations for one micro-batch of
/// `tokens` (batch x block), in f32 values:
/// - `per_channel` per channel per token per layer (inputs of each product, norms,
///   the MLP's hidden layer, residuals, their gradients);
/// - `per_score` per attention score per layer (B x H x T x T);
/// - `per_logit` per logit (B x T x vocab);
/// - `outside` per channel per token outside the layers (embeddings, final norm).
///
/// The coefficients are fitted to the heap's peak measured by a counting allocator
/// over 7 shapes (tests/memory.rs; within 7% of each); they hold on the CPU, and
/// roughly on a GPU for the same engine.
///
/// The fused CUDA engine allocates everything up front from its plan: its bytes are
/// the plan's total (cuBLAS's work space and the CUDA context come on top).
pub fn training_bytes(m: &ModelConfig, t: &TrainConfig, engine: Footprint, ranks: usize) -> f64 {
    if engine == Footprint::FusedCuda {
        let spec = ModelSpec::new(m);
        let plan = cuda_plan(&spec, t.batch_size, t);
        let moments = 2 * spec.len() * std::mem::size_of::<f32>();
        let unshared = moments - moments / ranks.max(1);
        return (plan.bytes(m.n_layer, true) - unshared as u64) as f64;
    }
    let micro_grads = if t.grad_accum > 1 { 1.0 } else { 0.0 };
    let copies = 2.0 + micro_grads + 2.0 / ranks.max(1) as f64;
    cpu_bytes(m, t.batch_size, engine, copies)
}

/// Bytes for building an engine that only scores (`eval`): as [`training_bytes`]
/// without AdamW's moments (the CPU engines' gradient buffers counted, the CUDA plan's
/// evaluation total), for `batch` sequences of `m.block_size`.
pub fn evaluation_bytes(m: &ModelConfig, batch: usize, engine: Footprint) -> f64 {
    if engine == Footprint::FusedCuda {
        let spec = ModelSpec::new(m);
        return cuda_plan(&spec, batch, &TrainConfig::default()).bytes(m.n_layer, false) as f64;
    }
    cpu_bytes(m, batch, engine, 2.0)
}

fn cuda_plan(spec: &ModelSpec, batch: usize, t: &TrainConfig) -> crate::cuda::Plan {
    let attention = crate::cuda::Attention::choose(&spec.shapes, t.dtype, batch);
    crate::cuda::Plan::for_spec(spec, batch, attention, t.dtype)
}

/// A CPU or reference engine's bytes: `copies` of the parameters and one micro-batch's
/// activations (the coefficients above).
fn cpu_bytes(m: &ModelConfig, batch: usize, engine: Footprint, copies: f64) -> f64 {
    let (per_channel, per_score, per_logit, outside) = match engine {
        Footprint::Reference => (19.0, 10.5, 4.0, 72.0),
        _ => (10.0, 0.12, 1.1, 21.0),
    };
    let tokens = (batch * m.block_size) as f64;
    let (layers, width) = (m.n_layer as f64, m.n_embd as f64);
    let scores = (m.n_head * m.block_size) as f64;
    let activations = tokens
        * (layers * (per_channel * width + per_score * scores)
            + per_logit * m.vocab_size as f64
            + outside * width);
    4.0 * (copies * ModelSpec::new(m).len() as f64 + activations)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_baby_run_fits_and_a_huge_one_does_not() {
        let m = ModelConfig {
            vocab_size: 65,
            ..ModelConfig::default()
        };
        let t = TrainConfig::default();
        assert!(training_bytes(&m, &t, Footprint::Reference, 1) < 500e6);
        let huge = ModelConfig {
            n_embd: 65536,
            n_head: 64,
            n_layer: 96,
            ..m
        };
        assert!(training_bytes(&huge, &t, Footprint::FusedCpu, 1) > 1e13);
    }
}
