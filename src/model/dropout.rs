//! Dropout with its own seeded RNG, so that a run with dropout is reproducible and
//! resumable (candle's `dropout` draws from an unseeded RNG on CPU).

use anyhow::Result;
use candle_core::Tensor;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub struct Dropout {
    p: f64,
    rng: Option<ChaCha8Rng>,
}

impl Dropout {
    /// Active dropout with probability `p`, drawing masks from `seed`/`stream`.
    pub fn new(p: f64, seed: u64, stream: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(stream);
        Self { p, rng: Some(rng) }
    }

    /// No dropout: evaluation and inference.
    pub fn off() -> Self {
        Self { p: 0.0, rng: None }
    }

    pub fn position(&self) -> u128 {
        self.rng.as_ref().map_or(0, |r| r.get_word_pos())
    }

    pub fn set_position(&mut self, pos: u128) {
        if let Some(r) = self.rng.as_mut() {
            r.set_word_pos(pos);
        }
    }

    /// Zeroes each element with probability p and scales the rest by 1 / (1 - p).
    pub fn apply(&mut self, x: &Tensor) -> Result<Tensor> {
        let Some(rng) = self.rng.as_mut().filter(|_| self.p > 0.0) else {
            return Ok(x.clone());
        };
        let keep = 1.0 / (1.0 - self.p);
        let mask: Vec<f32> = (0..x.elem_count())
            .map(|_| {
                if rng.random::<f64>() < self.p {
                    0.0
                } else {
                    keep as f32
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, x.shape(), x.device())?.to_dtype(x.dtype())?;
        Ok(x.mul(&mask)?)
    }
}
