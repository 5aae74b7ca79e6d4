//! A rough bound on what a training run needs, checked before anything is allocated,
//! so an absurd config is refused with a message instead of exhausting the machine.

use crate::config::{ModelConfig, TrainConfig};
use crate::model::ModelSpec;

/// Bytes for one training step of the reference path: weights, gradients and the two
/// AdamW moments (4 copies), plus the activations autograd keeps for one micro-batch
/// (about 40 values per channel per token per layer, the attention matrices, and the
/// logits a few times over), all f32.
pub fn training_bytes(m: &ModelConfig, t: &TrainConfig) -> f64 {
    let tokens = (t.batch_size * m.block_size) as f64;
    let per_layer = tokens * (40.0 * m.n_embd as f64 + 4.0 * (m.n_head * m.block_size) as f64);
    let activations = m.n_layer as f64 * per_layer + 4.0 * tokens * m.vocab_size as f64;
    4.0 * (4.0 * ModelSpec::new(m).len() as f64 + activations)
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
        assert!(training_bytes(&m, &t) < 500e6);
        let huge = ModelConfig {
            n_embd: 65536,
            n_head: 64,
            n_layer: 96,
            ..m
        };
        assert!(training_bytes(&huge, &t) > 1e13);
    }
}
