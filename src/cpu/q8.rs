//! Eight-bit blocks in llama.cpp's `q8_0` layout: values in blocks of 32, each block
//! its int8 values and one scale (the block's largest magnitude / 127), kept here in
//! f32 where q8_0, and our weights' blocks (`q8_matrix`), round it to f16. A
//! token's activations are quantized so ([`Q8Row`]) before a product with int8 or int4
//! weights, so a block's dot product is 32 integer multiplications summed exactly,
//! scaled once. The weights themselves are in `grouped` (int8: `q8_matrix`, int4:
//! `q4`).

use super::kernels::multiversion;

/// Values per block.
pub const BLOCK: usize = 32;

/// One row of activations quantized for products with int8 weights (`Q8Matrix`) or int4
/// (`Q4Matrix`).
#[derive(Debug, Clone, Default)]
pub struct Q8Row {
    quants: Vec<i8>,
    scales: Vec<f32>,
    /// Per block, 128 x the sum of its values: what a product with weights kept as
    /// w + 128 (unsigned, as `vpdpbusd` takes them: `q8_matrix`) exceeds x · w by.
    excess: Vec<i32>,
}

multiversion! {
    /// Quantizes `values` into `quants` and `scales` (one per block of `BLOCK`; the last
    /// block's missing values are zeros). Each value is rounded to the nearest step,
    /// ties to even.
    pub fn quantize_into(values: &[f32], quants: &mut [i8], scales: &mut [f32]) {
        let mut block = [0f32; BLOCK];
        for (b, (q, scale)) in quants
            .chunks_exact_mut(BLOCK)
            .zip(scales.iter_mut())
            .enumerate()
        {
            // A whole block, zero-padded: the loops below then vectorise.
            let start = (b * BLOCK).min(values.len());
            let given = &values[start..(start + BLOCK).min(values.len())];
            block[..given.len()].copy_from_slice(given);
            block[given.len()..].fill(0.0);
            let mut peaks = [0f32; 8];
            for lane in block.chunks_exact(8) {
                for k in 0..8 {
                    peaks[k] = peaks[k].max(lane[k].abs());
                }
            }
            let max = peaks.iter().fold(0f32, |m, &p| m.max(p));
            *scale = max / 127.0;
            let inverse = if max > 0.0 { 127.0 / max } else { 0.0 };
            for (q, &v) in q.iter_mut().zip(&block) {
                *q = round_small(v * inverse);
            }
        }
    }
}

/// `y` (|y| <= 127.5) rounded to the nearest integer, ties to even: adding 1.5 x 2^23
/// leaves a float whose unit is 1, so the hardware's rounding does the work and the
/// integer is read from the low mantissa bits (no call to `roundf`, and it vectorises).
#[inline(always)]
fn round_small(y: f32) -> i8 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 x 2^23
    ((y + MAGIC).to_bits() as i32 - MAGIC.to_bits() as i32) as i8
}

impl Q8Row {
    /// `x` quantized in blocks of [`BLOCK`] (the last one zero-padded), as every
    /// block-quantized matrix of `x.len()` columns takes it.
    pub fn quantize(&mut self, x: &[f32]) {
        let blocks = x.len().div_ceil(BLOCK);
        self.quants.resize(blocks * BLOCK, 0);
        self.scales.resize(blocks, 0.0);
        quantize_into(x, &mut self.quants, &mut self.scales);
        self.excess.clear();
        self.excess.extend(
            self.quants
                .chunks_exact(BLOCK)
                .map(|block| 128 * block.iter().map(|&q| i32::from(q)).sum::<i32>()),
        );
    }

    /// The values back in f32 (each int8 value times its block's scale), as the
    /// products see them, into out[..out.len()] (at most the quantized length).
    pub fn values_into(&self, out: &mut [f32]) {
        for (i, out) in out.iter_mut().enumerate() {
            *out = f32::from(self.quants[i]) * self.scales[i / BLOCK];
        }
    }

    /// Per block, 128 x the sum of its int8 values.
    pub fn excess(&self) -> &[i32] {
        &self.excess
    }

    /// The int8 values (whole blocks) and each block's scale.
    pub fn parts(&self) -> (&[i8], &[f32]) {
        (&self.quants, &self.scales)
    }
}
