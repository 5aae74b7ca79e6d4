//! The optimiser, defined once for every engine: AdamW with decoupled weight decay on
//! the tensors of two or more dimensions only, the embeddings included (nanoGPT's
//! grouping: norm gains would be pulled toward 0 rather than their start at 1, and a
//! bias has nothing to regularise), and global-norm gradient clipping. Each engine applies these numbers
//! to its own buffers.

use crate::config::TrainConfig;

/// One AdamW update: update number `step` (from 1) at learning rate `lr`.
///
/// m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g²;
/// p <- p * (1 - lr wd [matrices only]) - lr * (m / bc1) / (sqrt(v / bc2) + eps),
/// with the bias corrections bc1 = 1 - b1^step, bc2 = 1 - b2^step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    pub step: usize,
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl AdamWStep {
    pub fn new(cfg: &TrainConfig, step: usize, lr: f64) -> Self {
        assert!(step >= 1, "AdamW updates count from 1");
        Self {
            step,
            lr,
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            eps: cfg.eps,
            weight_decay: cfg.weight_decay,
        }
    }

    /// The update's numbers in f32, as the fused engines' kernels take them, for a
    /// tensor that decays (`decay`) or not.
    pub fn in_f32(&self, decay: bool) -> AdamWF32 {
        let (bc1, bc2) = self.bias_corrections();
        AdamWF32 {
            b1: self.beta1 as f32,
            b2: self.beta2 as f32,
            inv_bc1: (1.0 / bc1) as f32,
            inv_bc2: (1.0 / bc2) as f32,
            lr: self.lr as f32,
            eps: self.eps as f32,
            shrink: self.shrink(decay) as f32,
        }
    }

    /// (1 - b1^step, 1 - b2^step).
    pub fn bias_corrections(&self) -> (f64, f64) {
        let step = self.step as i32;
        (1.0 - self.beta1.powi(step), 1.0 - self.beta2.powi(step))
    }

    /// What the weights are multiplied by before the update: 1 - lr * weight_decay for
    /// tensors that decay, 1 for the others.
    pub fn shrink(&self, decay: bool) -> f64 {
        if decay {
            1.0 - self.lr * self.weight_decay
        } else {
            1.0
        }
    }
}

/// One AdamW update in f32: m, v <- moving averages of g, g²;
/// p <- p * shrink - lr * (m * inv_bc1) / (sqrt(v * inv_bc2) + eps).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWF32 {
    pub b1: f32,
    pub b2: f32,
    pub inv_bc1: f32,
    pub inv_bc2: f32,
    pub lr: f32,
    pub eps: f32,
    /// What the weights are multiplied by first (1 for tensors that do not decay).
    pub shrink: f32,
}

/// The global gradient norm is summed in blocks of this many values: each block's
/// squares in f64 in a fixed order, then the blocks' sums in order. The blocks are
/// fixed, so the norm is the same number on any number of threads, and ranks that each
/// sum the blocks of their shard (shards start at block boundaries) get it exactly too.
pub const NORM_CHUNK: usize = 8192;

/// The global L2 norm from the blocks' sums of squares, in block order.
pub fn norm_of_partials(partials: &[f64]) -> f64 {
    partials.iter().sum::<f64>().sqrt()
}

/// The factor that scales gradients of global L2 norm `norm` down to `max_norm`, as
/// torch's clip_grad_norm_; `None` when no clipping applies (max_norm 0 disables it).
pub fn clip_scale(norm: f64, max_norm: f64) -> Option<f64> {
    (max_norm > 0.0 && norm > max_norm).then(|| max_norm / (norm + 1e-6))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corrections_and_decay() {
        let cfg = TrainConfig {
            beta1: 0.9,
            beta2: 0.99,
            weight_decay: 0.1,
            ..TrainConfig::default()
        };
        let u = AdamWStep::new(&cfg, 2, 0.01);
        let (bc1, bc2) = u.bias_corrections();
        assert!((bc1 - 0.19).abs() < 1e-12 && (bc2 - 0.0199).abs() < 1e-12);
        assert_eq!(u.shrink(false), 1.0);
        assert!((u.shrink(true) - 0.999).abs() < 1e-12);
        assert_eq!(clip_scale(0.5, 1.0), None);
        assert_eq!(clip_scale(5.0, 0.0), None);
        assert!((clip_scale(5.0, 1.0).unwrap() - 1.0 / (5.0 + 1e-6)).abs() < 1e-12);
    }
}
