//! Dropout with its own seeded RNG, so that a run with dropout is reproducible and
//! resumable (candle's `dropout` draws from an unseeded RNG on CPU).

use anyhow::Result;
use candle_core::Tensor;
use rand::{RngCore, SeedableRng};
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

    /// True when masks are drawn (training with p > 0).
    pub fn active(&self) -> bool {
        self.rng.is_some() && self.p > 0.0
    }

    /// Fills `mask` with the next draws: 0 with probability p, else 1 / (1 - p). Both
    /// the reference model and the fused CPU path draw through here, in the same order,
    /// so they drop the same elements. Returns false (mask untouched) when inactive.
    pub fn fill_mask(&mut self, mask: &mut [f32]) -> bool {
        let p = self.p;
        let Some(rng) = self.rng.as_mut().filter(|_| p > 0.0) else {
            return false;
        };
        let keep = (1.0 / (1.0 - p)) as f32;
        // One 32-bit draw per element: dropped when below p * 2^32.
        let threshold = (p * 4_294_967_296.0) as u64;
        for m in mask.iter_mut() {
            *m = if (rng.next_u32() as u64) < threshold {
                0.0
            } else {
                keep
            };
        }
        true
    }

    /// Zeroes each element with probability p and scales the rest by 1 / (1 - p).
    pub fn apply(&mut self, x: &Tensor) -> Result<Tensor> {
        if !self.active() {
            return Ok(x.clone());
        }
        let mut mask = vec![0f32; x.elem_count()];
        self.fill_mask(&mut mask);
        let mask = Tensor::from_vec(mask, x.shape(), x.device())?.to_dtype(x.dtype())?;
        Ok(x.mul(&mask)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drops_a_fraction_p_and_rescales_the_rest() {
        let mut d = Dropout::new(0.25, 1, 0);
        let mut mask = vec![0f32; 100_000];
        assert!(d.fill_mask(&mut mask));
        let dropped = mask.iter().filter(|&&m| m == 0.0).count() as f64 / mask.len() as f64;
        assert!((dropped - 0.25).abs() < 0.01, "{dropped}");
        assert!(mask
            .iter()
            .all(|&m| m == 0.0 || (m - 1.0 / 0.75).abs() < 1e-6));
        // Same seed, same masks; off means untouched.
        let mut again = vec![0f32; 100_000];
        Dropout::new(0.25, 1, 0).fill_mask(&mut again);
        assert_eq!(mask, again);
        assert!(!Dropout::off().fill_mask(&mut again));
    }
}
