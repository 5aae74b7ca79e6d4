//! Weights in eight bits as llama.cpp's `q8_0` holds them: blocks of 32 int8 values, one
//! f16 scale each (the block's largest magnitude / 127; 34 bytes a block, where an f32
//! scale made it 36 and a one-stream pass, which reads every byte once a token, 6%
//! longer), in `grouped`'s groups of sixteen rows. A group's block is eight 64-byte
//! vectors, the k-th holding values 4k..4k+4 of each of the sixteen rows, each kept as
//! w + 128 (unsigned, as `vpdpbusd` takes its first operand).

use half::f16;

#[cfg(target_arch = "x86_64")]
use super::grouped::{
    fold_block_avx2, fold_block_avx512, store_halves, x_pointers, Dpbusd256, MAX_X,
};
use super::grouped::{Format, Grouped, GROUP};
#[cfg(target_arch = "x86_64")]
use super::q8::Q8Row;
use super::q8::{quantize_into, BLOCK};

/// int8 weights.
pub type Q8Matrix = Grouped<Int8>;

/// [`Format`] of int8 blocks.
#[derive(Debug, Clone, Copy)]
pub struct Int8;

/// Four-byte steps in a block (one `vpdpbusd` each).
#[cfg(target_arch = "x86_64")]
const STEPS: usize = BLOCK / 4;
/// Bytes of a group's block: `STEPS` vectors of four values of each row.
const GROUP_BLOCK: usize = GROUP * BLOCK;

/// Where value `i` of row `r` lies in a group's block.
#[inline(always)]
fn at(i: usize, r: usize) -> usize {
    (i / 4) * (4 * GROUP) + r * 4 + i % 4
}

impl Format for Int8 {
    const BLOCK_BYTES: usize = GROUP_BLOCK;
    const ZERO: u8 = 0x80; // 0 + 128

    fn quantize_row(row: &[f32], quants: &mut [u8], scales: &mut [f16], r: usize) {
        let blocks = scales.len() / GROUP;
        let (mut values, mut block_scales) = (vec![0i8; blocks * BLOCK], vec![0f32; blocks]);
        quantize_into(row, &mut values, &mut block_scales);
        for (b, (block, &scale)) in quants
            .chunks_exact_mut(GROUP_BLOCK)
            .zip(&block_scales)
            .enumerate()
        {
            scales[b * GROUP + r] = f16::from_f32(scale);
            for (i, &q) in values[b * BLOCK..(b + 1) * BLOCK].iter().enumerate() {
                block[at(i, r)] = (q as u8) ^ 0x80;
            }
        }
    }

    #[inline(always)]
    fn value(block: &[u8], i: usize, r: usize) -> i32 {
        i32::from((block[at(i, r)] ^ 0x80) as i8)
    }

    /// For N rows of x with AVX-512 VNNI: per block, each row of x
    /// starts sixteen integer lanes at minus its excess and adds eight `vpdpbusd` of the
    /// weight vectors against four of its values broadcast; then converted, times x's scale,
    /// fused onto the totals with the sixteen weight scales (widened from f16 in one
    /// instruction).
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
        let x = x_pointers::<N>(xs);
        let mut totals = [_mm512_setzero_ps(); N];
        for b in 0..blocks {
            let mut lanes = [_mm512_setzero_si512(); N];
            for c in 0..N {
                lanes[c] = _mm512_set1_epi32(-*x[c].1.add(b));
            }
            for k in 0..STEPS {
                let w = _mm512_load_si512(quants.as_ptr().add(b * GROUP_BLOCK + k * 64).cast());
                for c in 0..N {
                    let four = x[c].0.add(b * BLOCK + 4 * k).cast::<i32>().read_unaligned();
                    lanes[c] = _mm512_dpbusd_epi32(lanes[c], w, _mm512_set1_epi32(four));
                }
            }
            fold_block_avx512(&mut totals, &lanes, (scales, xs, b));
        }
        for c in 0..N {
            _mm512_storeu_ps(sums[c].as_mut_ptr(), totals[c]);
        }
    }

    /// For N rows of x with AVX2, the group's sixteen rows in two
    /// halves of eight lanes: the weights back to signed bytes (w + 128 with its top bit
    /// flipped), then |x| times w with x's sign (`vpmaddubsw`; a pair's sum, at most
    /// 2 x 127 x 127, fits i16) summed in fours (`vpmaddwd`): the same block integers as
    /// VNNI's, scaled in the same f32 steps.
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
        let (ones, flip) = (_mm256_set1_epi16(1), _mm256_set1_epi8(-128));
        let x: [*const i8; N] = std::array::from_fn(|c| xs[c].parts().0.as_ptr());
        let mut totals = [[_mm256_setzero_ps(); 2]; N];
        for b in 0..blocks {
            let mut lanes = [[_mm256_setzero_si256(); 2]; N];
            for k in 0..STEPS {
                let at = quants.as_ptr().add(b * GROUP_BLOCK + k * 64);
                let w = [
                    _mm256_xor_si256(_mm256_load_si256(at.cast()), flip),
                    _mm256_xor_si256(_mm256_load_si256(at.add(32).cast()), flip),
                ];
                for c in 0..N {
                    let four = _mm256_set1_epi32(
                        x[c].add(b * BLOCK + 4 * k).cast::<i32>().read_unaligned(),
                    );
                    let magnitude = _mm256_abs_epi8(four);
                    for h in 0..2 {
                        let pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(w[h], four));
                        lanes[c][h] = _mm256_add_epi32(lanes[c][h], _mm256_madd_epi16(pairs, ones));
                    }
                }
            }
            fold_block_avx2(&mut totals, &lanes, (scales, xs, b));
        }
        store_halves(&totals, sums);
    }

    /// For N rows of x with 256-bit `vpdpbusd`: [`Int8::vnni`]'s steps on the
    /// group's two halves of eight lanes, one instruction a half where AVX2 takes four
    /// (sign, `vpmaddubsw`, `vpmaddwd`, add).
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
        let x = x_pointers::<N>(xs);
        let mut totals = [[_mm256_setzero_ps(); 2]; N];
        for b in 0..blocks {
            let mut lanes = [[_mm256_setzero_si256(); 2]; N];
            for c in 0..N {
                let start = _mm256_set1_epi32(-*x[c].1.add(b));
                lanes[c] = [start, start];
            }
            for k in 0..STEPS {
                let at = quants.as_ptr().add(b * GROUP_BLOCK + k * 64);
                let w = [
                    _mm256_load_si256(at.cast()),
                    _mm256_load_si256(at.add(32).cast()),
                ];
                for c in 0..N {
                    let four = _mm256_set1_epi32(
                        x[c].0.add(b * BLOCK + 4 * k).cast::<i32>().read_unaligned(),
                    );
                    for h in 0..2 {
                        lanes[c][h] = D::dpbusd(lanes[c][h], w[h], four);
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

    #[test]
    fn every_kernel_and_row_count_gives_the_same_bits() {
        checks::every_kernel_and_row_count_gives_the_same_bits::<Int8>();
    }

    #[test]
    fn rows_set_in_pieces_are_rows_set_at_once() {
        checks::rows_set_in_pieces_are_rows_set_at_once::<Int8>();
    }

    #[test]
    fn a_product_is_the_dequantized_product() {
        checks::a_product_is_the_dequantized_product::<Int8>();
    }

    /// Each value within half a step of its block, plus what the scale's rounding to
    /// f16 (a relative 2^-11 at most) moves 127 steps by.
    #[test]
    fn quantizing_keeps_each_value_within_half_a_step() {
        let (rows, cols) = (3, 70); // 3 blocks a row, the last one short; one padded group
        let w = values(rows * cols, 1);
        let q = Q8Matrix::quantize(&w, rows, cols);
        assert_eq!(q.bytes(), GROUP * 3 * BLOCK + 2 * GROUP * 3);
        let mut back = vec![0f32; cols];
        let mut steps = vec![0f32; cols];
        for r in 0..rows {
            q.row_into(r, &mut back);
            // A block's step: its largest magnitude / 127.
            for (b, chunk) in w[r * cols..(r + 1) * cols].chunks(BLOCK).enumerate() {
                let peak = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
                steps[b * BLOCK..(b * BLOCK + chunk.len())].fill(peak / 127.0);
            }
            for (i, (&a, &b)) in w[r * cols..(r + 1) * cols].iter().zip(&back).enumerate() {
                let step = steps[i];
                assert!(
                    (a - b).abs() <= 0.5 * step + 127.0 * step / 2048.0 + 1e-7,
                    "{a} vs {b} (step {step})"
                );
            }
        }
        // The largest magnitude of a block is 127 steps: exact but for the scale's f16.
        let peak = Q8Matrix::quantize(&[0.0, -2.0, 1.0, 0.5], 1, 4);
        let mut back = [0f32; 4];
        peak.row_into(0, &mut back);
        assert_eq!(back[1], -127.0 * f16::from_f32(2.0 / 127.0).to_f32());
        let mut zeros = [1f32; 4];
        Q8Matrix::quantize(&[0.0; 4], 1, 4).row_into(0, &mut zeros);
        assert_eq!(zeros, [0.0; 4]);
    }
}
