//! Choosing the next token from the model's logits.
//!
//! In order: repetition penalty (CTRL's: tokens already in the context get their logit
//! divided by the penalty if positive, multiplied if negative), temperature (0 = greedy
//! argmax), top-k (keep the k most likely), top-p / nucleus (keep the smallest set whose
//! probability reaches p), then one draw from a seeded RNG.

use anyhow::Result;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::user_bail;

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 picks the most likely token; 1 samples the model's distribution as is.
    pub temperature: f64,
    /// Keep only the k most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probabilities sum to at least p (1 = all).
    pub top_p: f64,
    /// 1 = none; above 1 discourages repeating tokens already in the context.
    pub repetition_penalty: f64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            user_bail!(
                "--temperature {} must be >= 0 (0 is greedy decoding)",
                self.temperature
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            user_bail!("--top-p {} must be in (0, 1]", self.top_p);
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            user_bail!(
                "--repetition-penalty {} must be positive (1 disables it)",
                self.repetition_penalty
            );
        }
        Ok(())
    }

    /// Temperatures this small make every probability but the top one underflow.
    pub fn is_greedy(&self) -> bool {
        self.temperature < 1e-6
    }
}

/// A seeded token sampler.
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Scratch: (probability, token id), reused between calls.
    candidates: Vec<(f32, u32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams, seed: u64) -> Result<Self> {
        params.validate()?;
        Ok(Self {
            params,
            rng: ChaCha8Rng::seed_from_u64(seed),
            candidates: Vec::new(),
        })
    }

    /// Picks the next token. `logits` is modified (penalty and temperature applied);
    /// `context` is the tokens the repetition penalty looks at.
    pub fn sample(&mut self, logits: &mut [f32], context: &[u32]) -> u32 {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let penalty = p.repetition_penalty as f32;
            let mut seen = vec![false; logits.len()];
            for &id in context {
                if let Some(s) = seen.get_mut(id as usize) {
                    *s = true;
                }
            }
            for (logit, _) in logits.iter_mut().zip(&seen).filter(|(_, s)| **s) {
                *logit = if *logit > 0.0 {
                    *logit / penalty
                } else {
                    *logit * penalty
                };
            }
        }
        if p.is_greedy() {
            return argmax(logits);
        }
        let probs = &mut self.candidates;
        softmax_into(logits, p.temperature as f32, probs);
        // Most likely first; ties broken by id so the order is deterministic.
        probs.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let keep = nucleus_size(probs, p.top_k, p.top_p);
        probs.truncate(keep);
        let total: f32 = probs.iter().map(|c| c.0).sum();
        let mut r = self.rng.random::<f32>() * total;
        for &(prob, id) in probs.iter() {
            if r < prob {
                return id;
            }
            r -= prob;
        }
        probs.last().expect("at least one candidate").1
    }
}

/// The index of the largest logit (the first, if tied).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// softmax(logits / temperature) as (probability, id) pairs.
fn softmax_into(logits: &[f32], temperature: f32, out: &mut Vec<(f32, u32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    out.clear();
    out.extend(
        logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (((l - max) / temperature).exp(), i as u32)),
    );
    let sum: f32 = out.iter().map(|c| c.0).sum();
    for c in out.iter_mut() {
        c.0 /= sum;
    }
}

/// How many of the sorted candidates top-k and top-p keep: the smallest prefix whose
/// probability reaches `top_p`, at most `top_k` (0 = no limit), at least one.
pub fn nucleus_size(sorted: &[(f32, u32)], top_k: usize, top_p: f64) -> usize {
    let limit = if top_k == 0 {
        sorted.len()
    } else {
        top_k.min(sorted.len())
    };
    if top_p >= 1.0 {
        return limit.max(1);
    }
    let mut cumulative = 0.0f64;
    for (i, c) in sorted[..limit].iter().enumerate() {
        cumulative += c.0 as f64;
        if cumulative >= top_p {
            return i + 1;
        }
    }
    limit.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f64, top_k: usize, top_p: f64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            repetition_penalty: 1.0,
        }
    }

    const LOGITS: [f32; 5] = [1.0, 3.0, 0.5, 2.9, -1.0];

    #[test]
    fn greedy_and_top_k_1_pick_the_argmax() {
        let mut greedy = Sampler::new(params(0.0, 0, 1.0), 1).unwrap();
        assert_eq!(greedy.sample(&mut LOGITS.clone(), &[]), 1);
        for seed in 0..20 {
            let mut s = Sampler::new(params(1.5, 1, 1.0), seed).unwrap();
            assert_eq!(s.sample(&mut LOGITS.clone(), &[]), 1);
        }
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_p() {
        let sorted = [(0.5f32, 0u32), (0.3, 1), (0.15, 2), (0.05, 3)];
        assert_eq!(nucleus_size(&sorted, 0, 0.5), 1);
        assert_eq!(nucleus_size(&sorted, 0, 0.51), 2);
        assert_eq!(nucleus_size(&sorted, 0, 0.8), 2);
        assert_eq!(nucleus_size(&sorted, 0, 0.81), 3);
        assert_eq!(nucleus_size(&sorted, 0, 1.0), 4);
        assert_eq!(nucleus_size(&sorted, 2, 0.99), 2, "top-k caps top-p");
        assert_eq!(nucleus_size(&sorted, 0, 0.01), 1);
        // Sampling never leaves the nucleus.
        for seed in 0..200 {
            let mut s = Sampler::new(params(1.0, 0, 0.6), seed).unwrap();
            let id = s.sample(&mut LOGITS.clone(), &[]);
            assert!(id == 1 || id == 3, "token {id} is outside the nucleus");
        }
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_seed_dependent() {
        let draw = |seed| {
            let mut s = Sampler::new(params(1.0, 0, 1.0), seed).unwrap();
            (0..50)
                .map(|_| s.sample(&mut LOGITS.clone(), &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
    }

    #[test]
    fn sampling_follows_the_distribution() {
        let mut s = Sampler::new(params(1.0, 0, 1.0), 9).unwrap();
        let logits = [0.0f32, (3.0f32).ln()]; // p = 0.25, 0.75
        let n = 20000;
        let ones = (0..n)
            .filter(|_| s.sample(&mut logits.clone(), &[]) == 1)
            .count();
        let freq = ones as f64 / n as f64;
        assert!((freq - 0.75).abs() < 0.02, "{freq}");
    }

    #[test]
    fn repetition_penalty_demotes_seen_tokens() {
        let mut p = params(0.0, 0, 1.0);
        p.repetition_penalty = 2.0;
        let mut s = Sampler::new(p, 0).unwrap();
        // Token 1 (3.0) was seen: 3.0 / 2 = 1.5 < 2.9, so token 3 wins.
        assert_eq!(s.sample(&mut LOGITS.clone(), &[1]), 3);
        let mut logits = [-1.0f32, -2.0];
        assert_eq!(s.sample(&mut logits, &[0]), 0);
        assert_eq!(logits[0], -2.0, "negative logits are multiplied");
    }

    #[test]
    fn invalid_values_are_errors() {
        assert!(Sampler::new(params(-0.1, 0, 1.0), 0).is_err());
        assert!(Sampler::new(params(1.0, 0, 0.0), 0).is_err());
        assert!(Sampler::new(params(1.0, 0, 1.5), 0).is_err());
        let mut p = params(1.0, 0, 1.0);
        p.repetition_penalty = 0.0;
        assert!(Sampler::new(p, 0).is_err());
    }
}
