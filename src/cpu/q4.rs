//! Weights in four bits as llama.cpp's `q4_0` holds them: blocks of 32 values, each
//! block 16 bytes of 4-bit values (the block's first 16 in the low halves, its last 16
//! in the high halves) and one scale, the block's value of largest magnitude / -8
//! rounded to f16. A weight is (q - 8) x scale, q in 0..=15: the same numbers llama.cpp's
//! q4_0 holds, bit for bit (tested against candle's port of its quantizer), 18 bytes a
//! block.
//!
//! In `grouped`'s groups of sixteen rows, a group's block is four 64-byte vectors, the
//! k-th holding bytes 4k..4k+4 of each row's 16: masked, the low halves are values
//! 4k..4k+4 and, shifted, the high halves values 16+4k..16+4k+4, each q unsigned as
//! `vpdpbusd` takes it; the activation row's excess is 8 x its block sums.

use half::f16;

#[cfg(target_arch = "x86_64")]
use super::grouped::{
    fold_block_avx2, fold_block_avx512, store_halves, x_pointers, Dpbusd256, MAX_X,
};
use super::grouped::{Format, Grouped, GROUP};
#[cfg(target_arch = "x86_64")]
use super::q8::Q8Row;
use super::q8::BLOCK;

/// int4 weights.
pub type Q4Matrix = Grouped<Int4>;

/// [`Format`] of int4 blocks.
#[derive(Debug, Clone, Copy)]
pub struct Int4;

/// Bytes of 4-bit values a block.
const HALF: usize = BLOCK / 2;
/// Bytes of a group's block: four vectors of four bytes of each row.
const GROUP_BLOCK: usize = GROUP * HALF;

/// Where byte `j` (0..16) of row `r`'s block lies in a group's block.
#[inline(always)]
fn at(j: usize, r: usize) -> usize {
    (j / 4) * (4 * GROUP) + r * 4 + j % 4
}

/// One block of `values` (zero-padded to `BLOCK`) in llama.cpp's q4_0: its 16 bytes and
/// its scale. The quantizer's own arithmetic: the scale divides in f32 before it is
/// rounded to f16, and each value truncates x / scale + 8.5, capped at 15.
fn quantize_block(values: &[f32], nibbles: &mut [u8], scale: &mut f16) {
    let mut block = [0f32; BLOCK];
    block[..values.len()].copy_from_slice(values);
    let (mut amax, mut max) = (0f32, 0f32);
    for &x in &block {
        if amax < x.abs() {
            amax = x.abs();
            max = x;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    *scale = f16::from_f32(d);
    for (j, byte) in nibbles.iter_mut().enumerate() {
        // `as u8` saturates: a value past -8 steps (never, but for rounding) is 0.
        let low = ((block[j] * id + 8.5) as u8).min(15);
        let high = ((block[HALF + j] * id + 8.5) as u8).min(15);
        *byte = low | (high << 4);
    }
}

impl Format for Int4 {
    const BLOCK_BYTES: usize = GROUP_BLOCK;
    const ZERO: u8 = 0x88; // both values 8, which is 0 whatever the scale

    fn quantize_row(row: &[f32], quants: &mut [u8], scales: &mut [f16], r: usize) {
        let cols = row.len();
        let mut nibbles = [0u8; HALF];
        for (b, block) in quants.chunks_exact_mut(GROUP_BLOCK).enumerate() {
            let values = &row[(b * BLOCK).min(cols)..((b + 1) * BLOCK).min(cols)];
            quantize_block(values, &mut nibbles, &mut scales[b * GROUP + r]);
            for (j, &byte) in nibbles.iter().enumerate() {
                block[at(j, r)] = byte;
            }
        }
    }

    #[inline(always)]
    fn value(block: &[u8], i: usize, r: usize) -> i32 {
        let byte = block[at(i % HALF, r)];
        let q = if i < HALF { byte & 0x0F } else { byte >> 4 };
        i32::from(q) - 8
    }

    /// For N rows of x: per block, each row of x starts sixteen integer
    /// lanes at minus 8 x its block sum and adds eight `vpdpbusd` (four vectors, each
    /// masked to its low halves and shifted to its high ones) against four of its values
    /// broadcast; then converted, times x's scale, fused onto the totals with the sixteen
    /// weight scales.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW and VNNI; each row of x holds the group's blocks.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn vnni<const N: usize>(
        quants: &[u8],
        scales: &[f16],
        xs: &[Q8Row],
        sums: &mut [[f32; GROUP]; MAX_X],
    ) {
        use std::arch::x86_64::*;
        let blocks = scales.len() / GROUP;
        debug_assert!(quants.len() == blocks * GROUP_BLOCK && xs.len() == N);
        let low = _mm512_set1_epi8(0x0F);
        let x = x_pointers::<N>(xs);
        let four = |p: *const i8| _mm512_set1_epi32(p.cast::<i32>().read_unaligned());
        let mut totals = [_mm512_setzero_ps(); N];
        for b in 0..blocks {
            let mut lanes = [_mm512_setzero_si512(); N];
            for c in 0..N {
                // 128 x the block sum, a sixteenth: 8 x the sum, what q = w + 8 adds.
                lanes[c] = _mm512_set1_epi32(-(*x[c].1.add(b) >> 4));
            }
            for k in 0..4 {
                let v = _mm512_load_si512(quants.as_ptr().add(b * GROUP_BLOCK + k * 64).cast());
                let (lo, hi) = (
                    _mm512_and_si512(v, low),
                    _mm512_and_si512(_mm512_srli_epi16(v, 4), low),
                );
                for c in 0..N {
                    let at = x[c].0.add(b * BLOCK + 4 * k);
                    lanes[c] = _mm512_dpbusd_epi32(lanes[c], lo, four(at));
                    lanes[c] = _mm512_dpbusd_epi32(lanes[c], hi, four(at.add(HALF)));
                }
            }
            fold_block_avx512(&mut totals, &lanes, (scales, xs, b));
        }
        for c in 0..N {
            _mm512_storeu_ps(sums[c].as_mut_ptr(), totals[c]);
        }
    }

    /// For N rows of x, the group's sixteen rows in two halves of eight
    /// lanes: q (0..=15, unsigned) times x (`vpmaddubsw`) for the low and the high halves,
    /// the two pair sums added in i16 (at most 4 x 15 x 127) and summed in fours
    /// (`vpmaddwd`): the same block integers as VNNI's, scaled in the same f32 steps.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C; each row of x holds the group's blocks.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2<const N: usize>(
        quants: &[u8],
        scales: &[f16],
        xs: &[Q8Row],
        sums: &mut [[f32; GROUP]; MAX_X],
    ) {
        use std::arch::x86_64::*;
        let blocks = scales.len() / GROUP;
        debug_assert!(quants.len() == blocks * GROUP_BLOCK && xs.len() == N);
        let (ones, low) = (_mm256_set1_epi16(1), _mm256_set1_epi8(0x0F));
        let x = x_pointers::<N>(xs);
        let four = |p: *const i8| _mm256_set1_epi32(p.cast::<i32>().read_unaligned());
        let mut totals = [[_mm256_setzero_ps(); 2]; N];
        for b in 0..blocks {
            let mut lanes = [[_mm256_setzero_si256(); 2]; N];
            for c in 0..N {
                let start = _mm256_set1_epi32(-(*x[c].1.add(b) >> 4));
                lanes[c] = [start, start];
            }
            for k in 0..4 {
                let at = quants.as_ptr().add(b * GROUP_BLOCK + k * 64);
                let v = [
                    _mm256_load_si256(at.cast()),
                    _mm256_load_si256(at.add(32).cast()),
                ];
                let lo = [_mm256_and_si256(v[0], low), _mm256_and_si256(v[1], low)];
                let hi = [
                    _mm256_and_si256(_mm256_srli_epi16(v[0], 4), low),
                    _mm256_and_si256(_mm256_srli_epi16(v[1], 4), low),
                ];
                for c in 0..N {
                    let at = x[c].0.add(b * BLOCK + 4 * k);
                    let (x_lo, x_hi) = (four(at), four(at.add(HALF)));
                    for h in 0..2 {
                        let pairs = _mm256_add_epi16(
                            _mm256_maddubs_epi16(lo[h], x_lo),
                            _mm256_maddubs_epi16(hi[h], x_hi),
                        );
                        lanes[c][h] = _mm256_add_epi32(lanes[c][h], _mm256_madd_epi16(pairs, ones));
                    }
                }
            }
            fold_block_avx2(&mut totals, &lanes, (scales, xs, b));
        }
        store_halves(&totals, sums);
    }

    /// For N rows of x with 256-bit `vpdpbusd`: [`Int4::vnni`]'s steps on the
    /// group's two halves of eight lanes (two instructions a half and step, where AVX2
    /// takes two `vpmaddubsw`, an add, a `vpmaddwd` and an add).
    ///
    /// # Safety
    /// As for [`Format::vnni256`].
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn vnni256<const N: usize, D: Dpbusd256>(
        quants: &[u8],
        scales: &[f16],
        xs: &[Q8Row],
        sums: &mut [[f32; GROUP]; MAX_X],
    ) {
        use std::arch::x86_64::*;
        let blocks = scales.len() / GROUP;
        debug_assert!(quants.len() == blocks * GROUP_BLOCK && xs.len() == N);
        let low = _mm256_set1_epi8(0x0F);
        let x = x_pointers::<N>(xs);
        let four = |p: *const i8| _mm256_set1_epi32(p.cast::<i32>().read_unaligned());
        let mut totals = [[_mm256_setzero_ps(); 2]; N];
        for b in 0..blocks {
            let mut lanes = [[_mm256_setzero_si256(); 2]; N];
            for c in 0..N {
                let start = _mm256_set1_epi32(-(*x[c].1.add(b) >> 4));
                lanes[c] = [start, start];
            }
            for k in 0..4 {
                let at = quants.as_ptr().add(b * GROUP_BLOCK + k * 64);
                let v = [
                    _mm256_load_si256(at.cast()),
                    _mm256_load_si256(at.add(32).cast()),
                ];
                let lo = [_mm256_and_si256(v[0], low), _mm256_and_si256(v[1], low)];
                let hi = [
                    _mm256_and_si256(_mm256_srli_epi16(v[0], 4), low),
                    _mm256_and_si256(_mm256_srli_epi16(v[1], 4), low),
                ];
                for c in 0..N {
                    let at = x[c].0.add(b * BLOCK + 4 * k);
                    let (x_lo, x_hi) = (four(at), four(at.add(HALF)));
                    for h in 0..2 {
                        lanes[c][h] = D::dpbusd(lanes[c][h], lo[h], x_lo);
                        lanes[c][h] = D::dpbusd(lanes[c][h], hi[h], x_hi);
                    }
                }
            }
            fold_block_avx2(&mut totals, &lanes, (scales, xs, b));
        }
        store_halves(&totals, sums);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::grouped::checks::{self, values};
    use candle_core::quantized::k_quants::{BlockQ4_0, GgmlType};

    #[test]
    fn every_kernel_and_row_count_gives_the_same_bits() {
        checks::every_kernel_and_row_count_gives_the_same_bits::<Int4>();
    }

    #[test]
    fn rows_set_in_pieces_are_rows_set_at_once() {
        checks::rows_set_in_pieces_are_rows_set_at_once::<Int4>();
    }

    #[test]
    fn a_product_is_the_dequantized_product() {
        checks::a_product_is_the_dequantized_product::<Int4>();
    }

    #[test]
    fn quantizing_gives_llama_cpp_q4_0_values() {
        let (rows, cols) = (5, 96);
        let mut w = values(rows * cols, 7);
        w[40] = 3.0; // a block whose largest magnitude is positive
        w[100] = -2.5; // and one whose is negative
        w[200] = 2.25; // ties: the first of the largest magnitude sets the sign
        w[201] = -2.25;
        w[230] = -2.75;
        w[231] = 2.75;
        w[384..416].fill(0.0); // an all-zero block
        let q = Q4Matrix::quantize(&w, rows, cols);
        assert_eq!(q.bytes(), GROUP * 3 * (HALF + 2)); // one group, padded
        let mut ours = vec![0f32; cols];
        let mut blocks = vec![BlockQ4_0::zeros(); cols / BLOCK];
        let mut theirs = vec![0f32; cols];
        for r in 0..rows {
            let row = &w[r * cols..(r + 1) * cols];
            q.row_into(r, &mut ours);
            BlockQ4_0::from_float(row, &mut blocks);
            BlockQ4_0::to_float(&blocks, &mut theirs);
            assert_eq!(ours, theirs, "row {r}");
            for (i, (&a, &b)) in row.iter().zip(&ours).enumerate() {
                // Half a step, but for values capped at +7 steps (q4_0 has -8..=7).
                let (mut nibbles, mut scale) = ([0u8; HALF], f16::ZERO);
                let block = i / BLOCK * BLOCK;
                quantize_block(&row[block..block + BLOCK], &mut nibbles, &mut scale);
                let scale = scale.to_f32();
                let capped = b == 7.0 * scale;
                let bound = if capped { 1.0 } else { 0.5 } * scale.abs() * 1.01 + 1e-6;
                assert!((a - b).abs() <= bound, "{a} vs {b} (step {scale})");
            }
        }
        // A short last block is zero-padded; zeros quantize to zero.
        let short = Q4Matrix::quantize(&[0.5, -1.0, 0.25], 1, 3);
        let mut back = [0f32; 3];
        short.row_into(0, &mut back);
        assert_eq!(back, [0.5, -1.0, 0.25]);
        let mut zeros = [1f32; 4];
        Q4Matrix::quantize(&[0.0; 4], 1, 4).row_into(0, &mut zeros);
        assert_eq!(zeros, [0.0; 4]);
    }
}
