//! Learning rate: linear warmup, then cosine decay to `min_lr` (nanoGPT's schedule).

use crate::config::TrainConfig;

/// The learning rate for optimiser step `step` (0-based).
pub fn learning_rate(step: usize, cfg: &TrainConfig) -> f64 {
    let decay_iters = cfg.lr_decay_iters();
    if step < cfg.warmup_iters {
        // Start above zero: a zero first step would waste a batch.
        return cfg.lr * (step + 1) as f64 / (cfg.warmup_iters + 1) as f64;
    }
    if step >= decay_iters {
        return cfg.min_lr;
    }
    let progress =
        (step - cfg.warmup_iters) as f64 / (decay_iters - cfg.warmup_iters).max(1) as f64;
    let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()); // 1 -> 0
    cfg.min_lr + cosine * (cfg.lr - cfg.min_lr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_to_min() {
        let cfg = TrainConfig {
            lr: 1e-3,
            min_lr: 1e-4,
            warmup_iters: 10,
            max_iters: 110,
            ..TrainConfig::default()
        };
        assert!((learning_rate(0, &cfg) - 1e-3 / 11.0).abs() < 1e-12);
        assert!((learning_rate(9, &cfg) - 1e-3 * 10.0 / 11.0).abs() < 1e-12);
        assert!((learning_rate(10, &cfg) - 1e-3).abs() < 1e-12);
        // Halfway through the decay the cosine is at its midpoint.
        assert!((learning_rate(60, &cfg) - 5.5e-4).abs() < 1e-12);
        assert!((learning_rate(110, &cfg) - 1e-4).abs() < 1e-12);
        assert!((learning_rate(500, &cfg) - 1e-4).abs() < 1e-12);
        for s in 10..110 {
            assert!(learning_rate(s + 1, &cfg) <= learning_rate(s, &cfg));
        }
    }
}
