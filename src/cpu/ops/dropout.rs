//! Dropout masks filled in parallel and vectorised, and applied: the same masks as the
//! definition in `model::dropout` (tested element for element), thirty-two Philox
//! counters at a time in vector lanes.

use rayon::prelude::*;

use crate::cpu::kernels::multiversion;
use crate::cpu::threads::{share_len, zip_in_place, zip_map};
use crate::model::dropout::{group, philox4x32_10, Dropout, Site};
use crate::profile::{self, Cost, Group};

/// Fills `mask` (the whole mask of `site`) with `dropout`'s values: 0 or 1 / (1 - p).
pub fn fill(dropout: &Dropout, site: Site, mask: &mut [f32]) {
    let _span = profile::span(Group::Elementwise, || {
        Cost::f32s_and_flops(mask.len(), 10 * mask.len())
    });
    // Shares of whole groups of four, so each Philox call serves one share.
    let share = share_len(mask.len()).next_multiple_of(4);
    mask.par_chunks_mut(share)
        .enumerate()
        .for_each(|(i, part)| fill_part(dropout, site, i * share, part));
}

/// Elements `first .. first + part.len()` of the mask; `first` a multiple of 4.
fn fill_part(dropout: &Dropout, site: Site, first: usize, part: &mut [f32]) {
    debug_assert_eq!(first % 4, 0);
    let (counter, key) = dropout.counter(site);
    let rule = Keep {
        threshold: dropout.threshold(),
        scale: dropout.keep_scale(),
    };
    let whole = part.len() / (4 * LANES) * (4 * LANES);
    let (body, tail) = part.split_at_mut(whole);
    fill_lanes(body, counter, key, group(first), rule);
    // The last few elements one counter at a time.
    let mut counter = counter;
    for (i, m) in tail.iter_mut().enumerate() {
        let element = first + whole + i;
        counter[0] = group(element);
        *m = rule.value(philox4x32_10(counter, key)[element % 4]);
    }
}

/// Counters per vector pass: each word of a pass's Philox rounds in four 512-bit
/// vectors (or eight 256-bit), enough independent chains to hide the multiplies'
/// latency (a million values on one thread, Zen 5: 8 counters 1.21 ms, 16 0.98, 32
/// 0.66; at AVX2 1.57, 1.22, 1.14).
const LANES: usize = 32;

/// Below `threshold` dropped (0), else kept (`scale`).
#[derive(Clone, Copy)]
pub struct Keep {
    threshold: u64,
    scale: f32,
}

impl Keep {
    #[inline(always)]
    fn value(&self, word: u32) -> f32 {
        if (word as u64) < self.threshold {
            0.0
        } else {
            self.scale
        }
    }
}

multiversion! {
    /// Mask values for `out` (a multiple of 4 * LANES elements), whose first element is
    /// the first of counter group `group0`.
    pub fn fill_lanes(out: &mut [f32], counter: [u32; 4], key: [u32; 2], group0: u32, rule: Keep) {
        for (pass, out) in out.chunks_exact_mut(4 * LANES).enumerate() {
            let first = group0 + (pass * LANES) as u32;
            let words = philox_lanes(std::array::from_fn(|l| first + l as u32), counter, key);
            for (l, out) in out.chunks_exact_mut(4).enumerate() {
                for (k, m) in out.iter_mut().enumerate() {
                    *m = rule.value(words[k][l]);
                }
            }
        }
    }
}

/// `philox4x32_10` for LANES counters that differ in their first word only, written
/// lane-wise so the compiler keeps each word in a vector register. Each 32-bit word
/// sits in a 64-bit lane, so a round's 32 x 32 -> 64-bit products are one multiply per
/// vector (`vpmuludq` reads a lane's low half) and their halves a shift and a mask: kept
/// in 32-bit lanes, splitting the products took more shuffles than the rounds took
/// arithmetic.
#[inline(always)]
fn philox_lanes(first: [u32; LANES], counter: [u32; 4], key: [u32; 2]) -> [[u32; LANES]; 4] {
    const M0: u64 = 0xD251_1F53;
    const M1: u64 = 0xCD9E_8D57;
    const LOW: u64 = 0xFFFF_FFFF;
    let mut c0: [u64; LANES] = first.map(u64::from);
    let mut c1 = [u64::from(counter[1]); LANES];
    let mut c2 = [u64::from(counter[2]); LANES];
    let mut c3 = [u64::from(counter[3]); LANES];
    let [mut k0, mut k1] = key;
    for round in 0..10 {
        if round > 0 {
            k0 = k0.wrapping_add(0x9E37_79B9);
            k1 = k1.wrapping_add(0xBB67_AE85);
        }
        let (k0, k1) = (u64::from(k0), u64::from(k1));
        for l in 0..LANES {
            let p0 = M0 * (c0[l] & LOW);
            let p1 = M1 * (c2[l] & LOW);
            (c0[l], c1[l], c2[l], c3[l]) = (
                (p1 >> 32) ^ c1[l] ^ k0,
                p1 & LOW,
                (p0 >> 32) ^ c3[l] ^ k1,
                p0 & LOW,
            );
        }
    }
    [c0, c1, c2, c3].map(|word| word.map(|w| w as u32))
}

/// x *= mask, elementwise.
pub fn apply(x: &mut [f32], mask: &[f32]) {
    let _span = profile::span(Group::Elementwise, || {
        Cost::f32s_and_flops(3 * x.len(), x.len())
    });
    zip_in_place(x, mask, |a, m| a * m);
}

/// out = x * mask; returns out.
pub fn masked<'o>(out: &'o mut [f32], x: &[f32], mask: &[f32]) -> &'o [f32] {
    let _span = profile::span(Group::Elementwise, || {
        Cost::f32s_and_flops(3 * out.len(), out.len())
    });
    zip_map(out, x, mask, |a, m| a * m);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorised, parallel fill equals the definition at every element, across
    /// lane passes, the scalar tail and thread shares.
    #[test]
    fn fills_the_masks_of_the_definition() {
        // One pass is 4 * LANES = 128 values: lengths short of one, one, one and a tail.
        let lengths = [
            (0.1, 1),
            (0.5, 31),
            (0.2, 128),
            (0.4, 131),
            (0.3, 1000),
            (0.9, 70_001),
        ];
        for (p, len) in lengths {
            let d = Dropout::in_pass(p, 99, 12, 3).unwrap();
            for site in [
                Site::Embedding,
                Site::AttentionWeights(5),
                Site::MlpOutput(1),
            ] {
                let mut want = vec![0f32; len];
                d.fill(site, 0, &mut want);
                let mut got = vec![-1f32; len];
                fill(&d, site, &mut got);
                assert_eq!(got, want, "p={p} len={len} {site:?}");
            }
        }
    }
}
