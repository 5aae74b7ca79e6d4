//! Dropout masks as a pure function of where and when.
//!
//! Whether element i of a mask is kept depends only on (seed, step, micro-batch, site,
//! i), through Philox-4x32-10, the counter-based generator of cuRAND and of PyTorch's
//! CUDA dropout. Nothing is drawn from a stream: any element's mask can be computed on
//! its own, in any order, on any device. So the reference model and every fused engine
//! drop exactly the same elements, threads fill disjoint parts of a mask
//! independently, and resuming at step k needs nothing but k.
//!
//! The counter of element i is (i / 4, site, micro-batch, step) and the key is the seed;
//! each Philox call gives four 32-bit words, word i % 4 decides element i: dropped when
//! below p * 2^32.

use anyhow::Result;
use candle_core::Tensor;

/// Where in the model a mask applies, and so its shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Site {
    /// The embeddings (token plus position) entering the first block: (B, T, C).
    Embedding,
    /// A layer's attention weights, after the softmax: (B, H, T, T).
    AttentionWeights(usize),
    /// A layer's attention branch, before the residual add: (B, T, C).
    AttentionOutput(usize),
    /// A layer's MLP branch, before the residual add: (B, T, C).
    MlpOutput(usize),
}

impl Site {
    /// The counter word that tells sites apart: layer and kind.
    fn code(self) -> u32 {
        let (layer, kind) = match self {
            Site::Embedding => (0, 0),
            Site::AttentionWeights(l) => (l, 1),
            Site::AttentionOutput(l) => (l, 2),
            Site::MlpOutput(l) => (l, 3),
        };
        (layer as u32) << 2 | kind
    }
}

/// Dropout in one forward pass of training: probability `p`, and which pass (the run's
/// seed, the optimiser step, the micro-batch within it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropout {
    pub p: f64,
    pub seed: u64,
    pub step: u32,
    pub micro: u32,
}

impl Dropout {
    /// Dropout at `p` in the forward pass of (step, micro-batch); `None` when p is 0.
    pub fn in_pass(p: f64, seed: u64, step: usize, micro: usize) -> Option<Self> {
        (p > 0.0).then_some(Self {
            p,
            seed,
            step: step as u32,
            micro: micro as u32,
        })
    }

    /// What a kept element is multiplied by: 1 / (1 - p), so the expected value of the
    /// output is the input.
    pub fn keep_scale(&self) -> f32 {
        (1.0 / (1.0 - self.p)) as f32
    }

    /// Words below this are dropped.
    pub fn threshold(&self) -> u64 {
        (self.p * 4_294_967_296.0) as u64
    }

    /// The counter of `site`, with its first word (the group of four elements) left to
    /// fill in, and the Philox key.
    pub fn counter(&self, site: Site) -> ([u32; 4], [u32; 2]) {
        let counter = [0, site.code(), self.micro, self.step];
        (counter, [self.seed as u32, (self.seed >> 32) as u32])
    }

    /// Fills `mask` with the mask of `site`'s elements `first .. first + mask.len()`:
    /// 0 where dropped, 1 / (1 - p) where kept.
    pub fn fill(&self, site: Site, first: usize, mask: &mut [f32]) {
        let (mut counter, key) = self.counter(site);
        let (threshold, keep) = (self.threshold(), self.keep_scale());
        for (i, m) in mask.iter_mut().enumerate() {
            let element = first + i;
            counter[0] = group(element);
            let word = philox4x32_10(counter, key)[element % 4];
            *m = if (word as u64) < threshold { 0.0 } else { keep };
        }
    }

    /// The reference model's dropout: x times the mask of `site` (x's elements in
    /// row-major order are the site's).
    pub fn apply(&self, x: &Tensor, site: Site) -> Result<Tensor> {
        let mut mask = vec![0f32; x.elem_count()];
        self.fill(site, 0, &mut mask);
        let mask = Tensor::from_vec(mask, x.shape(), x.device())?.to_dtype(x.dtype())?;
        Ok(x.mul(&mask)?)
    }
}

/// The counter word of `element`'s group of four. Masks are far below 2^34 elements
/// (one of that size would take 64 GiB).
pub fn group(element: usize) -> u32 {
    u32::try_from(element / 4).expect("a dropout mask under 2^34 elements")
}

/// `x` with dropout at `site` when training with dropout, `x` itself otherwise.
pub fn maybe_apply(dropout: Option<&Dropout>, x: &Tensor, site: Site) -> Result<Tensor> {
    match dropout {
        Some(d) => d.apply(x, site),
        None => Ok(x.clone()),
    }
}

/// Philox-4x32 with 10 rounds (Salmon, Moraes, Dror and Shaw, "Parallel random numbers:
/// as easy as 1, 2, 3", SC'11): a bijection of the 128-bit `counter` under the 64-bit
/// `key`.
#[inline(always)]
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    const M0: u64 = 0xD251_1F53;
    const M1: u64 = 0xCD9E_8D57;
    const W0: u32 = 0x9E37_79B9; // the golden ratio
    const W1: u32 = 0xBB67_AE85; // sqrt(3) - 1
    let [mut c0, mut c1, mut c2, mut c3] = counter;
    let [mut k0, mut k1] = key;
    for round in 0..10 {
        if round > 0 {
            k0 = k0.wrapping_add(W0);
            k1 = k1.wrapping_add(W1);
        }
        let p0 = M0 * c0 as u64;
        let p1 = M1 * c2 as u64;
        (c0, c1, c2, c3) = (
            (p1 >> 32) as u32 ^ c1 ^ k0,
            p1 as u32,
            (p0 >> 32) as u32 ^ c3 ^ k1,
            p0 as u32,
        );
    }
    [c0, c1, c2, c3]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's known-answer vectors for philox4x32_10 (its kat_vectors file).
    #[test]
    fn philox_matches_the_published_test_vectors() {
        let cases: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
            (
                [0, 0, 0, 0],
                [0, 0],
                [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8],
            ),
            (
                [u32::MAX; 4],
                [u32::MAX; 2],
                [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd],
            ),
            (
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0],
                [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1],
            ),
        ];
        for (counter, key, expected) in cases {
            assert_eq!(
                philox4x32_10(counter, key),
                expected,
                "{counter:x?} {key:x?}"
            );
        }
    }

    fn pass(p: f64, seed: u64, step: usize, micro: usize) -> Dropout {
        Dropout::in_pass(p, seed, step, micro).unwrap()
    }

    fn mask(d: &Dropout, site: Site, n: usize) -> Vec<f32> {
        let mut m = vec![0f32; n];
        d.fill(site, 0, &mut m);
        m
    }

    #[test]
    fn drops_a_fraction_p_and_rescales_the_rest() {
        let d = pass(0.25, 1, 0, 0);
        let m = mask(&d, Site::Embedding, 100_000);
        let dropped = m.iter().filter(|&&x| x == 0.0).count() as f64 / m.len() as f64;
        assert!((dropped - 0.25).abs() < 0.01, "{dropped}");
        assert!(m.iter().all(|&x| x == 0.0 || (x - 1.0 / 0.75).abs() < 1e-6));
        assert!(
            Dropout::in_pass(0.0, 1, 0, 0).is_none(),
            "p = 0 is no dropout"
        );
    }

    /// Every coordinate of (seed, step, micro-batch, layer, site) gives other masks;
    /// the same coordinates give the same mask.
    #[test]
    fn masks_depend_on_every_coordinate_and_nothing_else() {
        let base = pass(0.5, 7, 3, 1);
        let site = Site::AttentionOutput(2);
        let m = mask(&base, site, 4096);
        assert_eq!(m, mask(&pass(0.5, 7, 3, 1), site, 4096), "a pure function");
        let others = [
            mask(&pass(0.5, 8, 3, 1), site, 4096),
            mask(&pass(0.5, 7 + (1 << 32), 3, 1), site, 4096),
            mask(&pass(0.5, 7, 4, 1), site, 4096),
            mask(&pass(0.5, 7, 3, 0), site, 4096),
            mask(&base, Site::AttentionOutput(1), 4096),
            mask(&base, Site::MlpOutput(2), 4096),
            mask(&base, Site::AttentionWeights(2), 4096),
            mask(&base, Site::Embedding, 4096),
        ];
        for (i, other) in others.iter().enumerate() {
            let same = m.iter().zip(other).filter(|(a, b)| a == b).count();
            // Independent masks at p = 0.5 agree on about half the elements.
            assert!(
                (1500..2600).contains(&same),
                "variant {i}: {same} of 4096 agree"
            );
        }
    }

    /// Any part of a mask computed on its own equals that part of the whole.
    #[test]
    fn parts_of_a_mask_are_the_mask() {
        let d = pass(0.3, 11, 5, 2);
        let whole = mask(&d, Site::AttentionWeights(1), 1000);
        for (first, len) in [(0, 1), (1, 6), (3, 5), (4, 4), (997, 3), (250, 500)] {
            let mut part = vec![0f32; len];
            d.fill(Site::AttentionWeights(1), first, &mut part);
            assert_eq!(part, whole[first..first + len], "{first}+{len}");
        }
    }
}
