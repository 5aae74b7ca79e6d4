//! Choosing the next token from the model's logits.
//!
//! In order: repetition penalty (CTRL's, with Hugging Face's sign rule so that a token
//! already in the context always becomes less likely: its logit is divided by the
//! penalty if positive, multiplied if negative), temperature (0 = greedy argmax), then
//! top-k (keep the k most likely) and top-p / nucleus (keep the smallest set whose
//! probability reaches p), both measured on the whole softmax: the set kept is the
//! smaller of the two (Hugging Face renormalises after top-k, so its top-p keeps fewer);
//! then one draw from a seeded RNG.
//!
//! Nothing sorts the whole vocabulary: with neither top-k nor top-p the draw walks the
//! tokens in id order over unnormalised weights, and otherwise only the most likely
//! prefix they need is selected and sorted; the exponentials are one vectorised pass.
//! Measured on GPT-2's vocabulary (50,304 logits; release build, one AMD EPYC Zen 3 core,
//! AVX2 + FMA; the same run alternating with the full-sort sampler): 0.16 ms a token at
//! the defaults (was 1.9-2.5 ms), 0.37 ms with top-k 50 (1.9-2.6), 0.62 ms with top-p 0.9
//! over a Zipf-like distribution (1.9-2.6). Several samples are drawn on every core
//! (`generate`).

use anyhow::Result;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::cpu::kernels::{exp_approx, multiversion};
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
                "--temperature {} must be a finite number >= 0 (0 is greedy decoding)",
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
    /// Scratch reused between calls: (probability, token id), unnormalised weights,
    /// and which tokens the context holds.
    candidates: Vec<(f32, u32)>,
    weights: Vec<f32>,
    seen: Vec<bool>,
}

impl Sampler {
    pub fn new(params: SamplingParams, seed: u64) -> Result<Self> {
        params.validate()?;
        Ok(Self {
            params,
            rng: ChaCha8Rng::seed_from_u64(seed),
            candidates: Vec::new(),
            weights: Vec::new(),
            seen: Vec::new(),
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The uniform draw in [0, 1) that the next `sample` over `vocab` logits makes, for
    /// a device that chooses the token itself (`cuda::CudaDecoder::draw`), so a seed
    /// gives the same draws on every device; none when greedy. f64 for a draw over every
    /// token, f32 (widened) when top-k or top-p pick candidates, as `sample` draws.
    pub fn next_uniform(&mut self, vocab: usize) -> Option<f64> {
        let p = &self.params;
        if p.is_greedy() {
            None
        } else if (p.top_k == 0 || p.top_k >= vocab) && p.top_p >= 1.0 {
            Some(self.rng.random::<f64>())
        } else {
            Some(f64::from(self.rng.random::<f32>()))
        }
    }

    /// Picks the next token. `logits` is modified: the repetition penalty is applied in
    /// place (temperature only scales the weights drawn from); `context` is the tokens
    /// the repetition penalty looks at.
    pub fn sample(&mut self, logits: &mut [f32], context: &[u32]) -> u32 {
        let u = self.next_uniform(logits.len());
        self.sample_with(logits, context, u)
    }

    /// [`Sampler::sample`] with the uniform draw given (`None`: greedy) instead of
    /// drawn: what this sampler would pick for that draw. Tests use it to tell a token
    /// the GPU's sums moved across a boundary from a wrong one.
    pub fn sample_with(&mut self, logits: &mut [f32], context: &[u32], u: Option<f64>) -> u32 {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let penalty = p.repetition_penalty as f32;
            let seen = &mut self.seen;
            seen.clear();
            seen.resize(logits.len(), false);
            for &id in context {
                if let Some(s) = seen.get_mut(id as usize) {
                    *s = true;
                }
            }
            for (logit, _) in logits.iter_mut().zip(seen.iter()).filter(|(_, s)| **s) {
                *logit = if *logit > 0.0 {
                    *logit / penalty
                } else {
                    *logit * penalty
                };
            }
        }
        let Some(u) = u else {
            return argmax(logits);
        };
        let p = &self.params;
        let limit = match p.top_k {
            0 => logits.len(),
            k => k.min(logits.len()),
        };
        if limit == logits.len() && p.top_p >= 1.0 {
            // Every token is a candidate: a draw in id order needs no sorting (sorting
            // GPT-2's 50,257 took ~2 ms a token, more than a GPU's whole step) and no
            // normalising.
            let inv_temperature = 1.0 / p.temperature as f32;
            return draw_in_id_order(logits, inv_temperature, &mut self.weights, u);
        }
        let probs = &mut self.candidates;
        softmax_into(logits, p.temperature as f32, &mut self.weights, probs);
        let keep = most_likely_prefix(probs, limit, p.top_p);
        probs.truncate(keep);
        let total: f32 = probs.iter().map(|c| c.0).sum();
        let mut r = u as f32 * total;
        for &(prob, id) in probs.iter() {
            if r < prob {
                return id;
            }
            r -= prob;
        }
        // Rounding left r just past the end: the last candidate that can be drawn (top-k
        // may keep masked tokens, of probability 0).
        let drawable = probs.iter().rev().find(|c| c.0 > 0.0);
        drawable
            .or(probs.first())
            .expect("at least one candidate")
            .1
    }
}

/// A draw from softmax(logits * inv_temperature): the token where `u` (uniform in
/// [0, 1)) falls among the unnormalised weights laid end to end in id order.
fn draw_in_id_order(logits: &[f32], inv_temperature: f32, weights: &mut Vec<f32>, u: f64) -> u32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    weights.resize(logits.len(), 0.0);
    exp_weights(logits, max, inv_temperature, weights);
    // Four running sums, so the adds do not wait on each other.
    let mut sums = [0f64; 4];
    for chunk in weights.chunks(4) {
        for (sum, &w) in sums.iter_mut().zip(chunk) {
            *sum += w as f64;
        }
    }
    let mut r = u * sums.iter().sum::<f64>();
    let mut last = 0;
    for (id, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            if r < w as f64 {
                return id as u32;
            }
            r -= w as f64;
            last = id as u32;
        }
    }
    last // rounding left r just past the end: the last possible token
}

multiversion! {
    /// weights[i] = e^((logits[i] - max) * inv_temperature), vectorised; exactly 0 for a
    /// logit of -inf (a token masked out, which exp_approx would give ~1e-38).
    pub fn exp_weights(logits: &[f32], max: f32, inv_temperature: f32, weights: &mut [f32]) {
        for (w, &l) in weights.iter_mut().zip(logits) {
            let e = exp_approx((l - max) * inv_temperature);
            *w = if l == f32::NEG_INFINITY { 0.0 } else { e };
        }
    }
}

/// Most likely first; ties broken by id, so the order is total and deterministic.
fn most_likely(a: &(f32, u32), b: &(f32, u32)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Sorts the candidates' most likely prefix (in `most_likely` order) as far as top-k
/// (`limit`) and top-p need, and says how many they keep: the same as sorting them all
/// and taking `nucleus_size`, without sorting the whole vocabulary. The prefix grows
/// fourfold from 64 (64, 256, 1024, ...) until it holds the nucleus; selecting each is
/// linear.
fn most_likely_prefix(candidates: &mut [(f32, u32)], limit: usize, top_p: f64) -> usize {
    let mut sorted = if top_p < 1.0 { limit.min(64) } else { limit };
    loop {
        if sorted < candidates.len() {
            candidates.select_nth_unstable_by(sorted - 1, most_likely);
        }
        candidates[..sorted].sort_unstable_by(most_likely);
        match nucleus_within(&candidates[..sorted], top_p) {
            Some(keep) => return keep,
            None if sorted == limit => return limit.max(1),
            None => sorted = (4 * sorted).min(limit),
        }
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

/// softmax(logits / temperature) as (probability, id) pairs; `weights` is scratch.
fn softmax_into(
    logits: &[f32],
    temperature: f32,
    weights: &mut Vec<f32>,
    out: &mut Vec<(f32, u32)>,
) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    weights.resize(logits.len(), 0.0);
    exp_weights(logits, max, 1.0 / temperature, weights);
    let sum: f32 = weights.iter().sum();
    out.clear();
    out.extend(
        weights
            .iter()
            .enumerate()
            .map(|(i, &w)| (w / sum, i as u32)),
    );
}

/// How many of the sorted candidates top-k and top-p keep: the smallest prefix whose
/// probability reaches `top_p`, at most `top_k` (0 = no limit), at least one.
pub fn nucleus_size(sorted: &[(f32, u32)], top_k: usize, top_p: f64) -> usize {
    let limit = if top_k == 0 {
        sorted.len()
    } else {
        top_k.min(sorted.len())
    };
    nucleus_within(&sorted[..limit], top_p)
        .unwrap_or(limit)
        .max(1)
}

/// The smallest prefix of `sorted` whose probability reaches `top_p`, if one does
/// (none for top_p 1, which keeps everything).
fn nucleus_within(sorted: &[(f32, u32)], top_p: f64) -> Option<usize> {
    if top_p >= 1.0 {
        return None;
    }
    let mut cumulative = 0.0f64;
    for (i, c) in sorted.iter().enumerate() {
        cumulative += c.0 as f64;
        if cumulative >= top_p {
            return Some(i + 1);
        }
    }
    None
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

    /// The partial sort keeps exactly what sorting the whole vocabulary keeps, in the
    /// same order (so top-k and top-p draw the same token for the same seed), also when
    /// the nucleus needs the prefix to grow several times, and with ties.
    #[test]
    fn the_partial_sort_keeps_what_a_full_sort_keeps() {
        let n = 5000u32;
        let weights: Vec<f32> = (0..n)
            .map(|i| 1.0 / ((i.wrapping_mul(7919) % 1000) as f32 + 1.0).powf(1.1))
            .collect();
        let sum: f32 = weights.iter().sum();
        let probs: Vec<(f32, u32)> = (0..n).map(|i| (weights[i as usize] / sum, i)).collect();
        for (top_k, top_p) in [
            (0, 0.3),
            (0, 0.9),
            (0, 0.999),
            (10, 0.9),
            (100, 1.0),
            (1, 1.0),
            (6000, 0.95),
        ] {
            let mut full = probs.clone();
            full.sort_unstable_by(most_likely);
            let want = nucleus_size(&full, top_k, top_p);
            let limit = if top_k == 0 {
                probs.len()
            } else {
                top_k.min(probs.len())
            };
            let mut partial = probs.clone();
            let got = most_likely_prefix(&mut partial, limit, top_p);
            assert_eq!(got, want, "top_k {top_k} top_p {top_p}");
            assert_eq!(
                &partial[..got],
                &full[..want],
                "top_k {top_k} top_p {top_p}"
            );
        }
    }

    /// Masked tokens (logit -inf, as the vocabulary's padding is) are never drawn, not
    /// even where rounding leaves the draw past the last weight.
    #[test]
    fn masked_tokens_are_never_drawn() {
        let logits = [1.0f32, 2.0, 0.5, f32::NEG_INFINITY, f32::NEG_INFINITY];
        let mut weights = Vec::new();
        for u in [0.0, 0.5, 0.999_999_999_999_999_9, 1.0] {
            let id = draw_in_id_order(&logits, 1.0, &mut weights, u);
            assert!(id < 3, "u {u}: drew masked token {id}");
        }
        assert_eq!(weights[3..], [0.0, 0.0]);
        let mut top_k = Sampler::new(params(1.0, 4, 1.0), 1).unwrap();
        for _ in 0..200 {
            assert!(top_k.sample(&mut logits.clone(), &[]) < 3);
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
