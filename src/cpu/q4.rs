//! Weights in four bits for decoding, as llama.cpp's `q4_0`: each row of a matrix in
//! blocks of 32 values, each block 16 bytes of 4-bit values (the block's first 16 in
//! the low halves, its last 16 in the high halves) and one scale, the block's value of
//! largest magnitude / -8 rounded to f16. A weight is (q - 8) x scale, q in 0..=15:
//! the same numbers llama.cpp's q4_0 holds, bit for bit (tested against candle's port
//! of its quantizer). The scale is kept in f16 as llama.cpp keeps it, 18 bytes a block:
//! decoding reads every byte of the weights once a token, so the 2 bytes an f32 scale
//! added to a block were a tenth more to read; the products widen four scales in one
//! instruction (F16C, part of every level from AVX2 up).
//!
//! A product takes the activations quantized to eight bits as `q8` does (`Q8Row`), so
//! a block's dot product is 32 integer multiplications summed exactly and scaled once:
//! AVX2 integer instructions two blocks at a time where the CPU has them, plain Rust
//! elsewhere, both exact in integers and differing only in the order the scaled sums
//! are added.

use half::f16;
use rayon::prelude::*;

use super::isa::Isa;
use super::kernels::{multiversion, prefetch_all};
use super::lines::Lines;
#[cfg(target_arch = "x86_64")]
use super::q8::{four_rows, lanes_sum_avx2, matmat_in_tiles, sums_4x4};
use super::q8::{matmat_by_dots, BlockMatrix, Q8Row, BLOCK};

/// Bytes of 4-bit values a block.
const HALF: usize = BLOCK / 2;

/// A (rows, cols) matrix in blocks of `BLOCK` along its rows (cols padded with zeros to
/// whole blocks).
#[derive(Debug, Clone)]
pub struct Q4Matrix {
    rows: usize,
    cols: usize,
    /// Blocks per row.
    blocks: usize,
    /// (rows, blocks x 16) bytes, two 4-bit values each.
    nibbles: Lines<u8>,
    /// (rows, blocks) scales.
    scales: Lines<f16>,
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

impl Q4Matrix {
    /// `w`, (rows, cols) row-major, quantized.
    pub fn quantize(w: &[f32], rows: usize, cols: usize) -> Self {
        assert_eq!(w.len(), rows * cols, "a (rows, cols) matrix");
        let mut q = Self::zeros(rows, cols);
        q.quantize_rows(0, w);
        q
    }

    /// A (rows, cols) matrix of zeros, to be filled by `quantize_rows`.
    pub fn zeros(rows: usize, cols: usize) -> Self {
        let blocks = cols.div_ceil(BLOCK);
        let mut nibbles = Lines::zeroed(rows * blocks * HALF);
        // 0x88: both values 8, which is 0 whatever the scale.
        nibbles.fill(0x88);
        Self {
            rows,
            cols,
            blocks,
            nibbles,
            scales: Lines::zeroed(rows * blocks),
        }
    }

    /// Rows first .. first + w.len() / cols set to `w` (row-major) quantized.
    pub fn quantize_rows(&mut self, first: usize, w: &[f32]) {
        let (cols, blocks) = (self.cols, self.blocks);
        assert_eq!(w.len() % cols, 0, "whole rows");
        let n = w.len() / cols;
        assert!(first + n <= self.rows, "rows inside the matrix");
        self.nibbles[first * blocks * HALF..(first + n) * blocks * HALF]
            .par_chunks_mut(blocks * HALF)
            .zip(self.scales[first * blocks..(first + n) * blocks].par_chunks_mut(blocks))
            .zip(w.par_chunks(cols))
            .for_each(|((nibbles, scales), row)| {
                for (b, (nibbles, scale)) in nibbles.chunks_exact_mut(HALF).zip(scales).enumerate()
                {
                    let values = &row[(b * BLOCK).min(cols)..((b + 1) * BLOCK).min(cols)];
                    quantize_block(values, nibbles, scale);
                }
            });
    }

    /// Bytes held: the 4-bit values and the scales.
    pub fn bytes(&self) -> usize {
        self.nibbles.len() + 2 * self.scales.len()
    }

    /// Row `r` back in f32 (each value (q - 8) times its block's scale) into
    /// out[..cols].
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        let width = self.blocks * HALF;
        widen_q4(
            &self.nibbles[r * width..(r + 1) * width],
            &self.scales[r * self.blocks..(r + 1) * self.blocks],
            self.cols,
            &mut out[..self.cols],
        );
    }
}

multiversion! {
    /// Each value of whole rows (`nibbles`, `scales`: rows of whole blocks), (q - 8)
    /// times its block's scale, into out's rows of `cols`, a block at a time so that
    /// whole blocks run in vectors.
    pub fn widen_q4(nibbles: &[u8], scales: &[f16], cols: usize, out: &mut [f32]) {
        let blocks = cols.div_ceil(BLOCK);
        let rows = nibbles
            .chunks_exact(blocks * HALF)
            .zip(scales.chunks_exact(blocks))
            .zip(out.chunks_exact_mut(cols));
        for ((nibbles, scales), out) in rows {
            let blocks = nibbles.chunks_exact(HALF).zip(scales).zip(out.chunks_mut(BLOCK));
            for ((bytes, scale), out) in blocks {
                let scale = scale.to_f32();
                if out.len() == BLOCK {
                    let (low, high) = out.split_at_mut(HALF);
                    for ((low, high), &byte) in low.iter_mut().zip(high).zip(bytes) {
                        *low = f32::from((byte & 0x0F) as i8 - 8) * scale;
                        *high = f32::from((byte >> 4) as i8 - 8) * scale;
                    }
                } else {
                    // The row's last block, cut short by `cols`.
                    for (j, out) in out.iter_mut().enumerate() {
                        let byte = bytes[j % HALF];
                        let q = if j < HALF { byte & 0x0F } else { byte >> 4 };
                        *out = f32::from(q as i8 - 8) * scale;
                    }
                }
            }
        }
    }
}

impl BlockMatrix for Q4Matrix {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn prefetch_row(&self, r: usize) {
        prefetch_all(&self.nibbles[r * self.blocks * HALF..(r + 1) * self.blocks * HALF]);
        prefetch_all(&self.scales[r * self.blocks..(r + 1) * self.blocks]);
    }

    fn row_bytes(&self) -> usize {
        self.blocks * (HALF + 2)
    }

    fn dot_row(&self, level: Isa, r: usize, x: &Q8Row) -> f32 {
        let (nibbles, scales) = self.row(r);
        let (xq, xs) = x.parts();
        dot(level, nibbles, scales, xq, xs)
    }

    /// On AVX-512, each weight row's nibbles unpacked once for four rows of x, x's
    /// side of `dot_avx512` prepared once for all the weight rows ([`dots_1x4`]); the
    /// sums are `dot_avx512`'s to the bit. On AVX2 the same against `dot_avx2`
    /// ([`dots_1x4_avx2`]).
    fn matmat(
        &self,
        first: usize,
        len: usize,
        xs: &[Q8Row],
        bias: Option<&[f32]>,
        out: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if super::isa::active() == Isa::Avx2 && xs.len() >= 4 {
            // Safety (both closures): the active level is one the CPU has; the rows of
            // x hold as many blocks as the weight rows.
            let prepare = |x| unsafe { PreparedAvx2::new(x) };
            let four = |o: usize, xs: [&PreparedAvx2; 4]| {
                let (nibbles, ws) = self.row(o);
                unsafe { dots_1x4_avx2(nibbles, ws, xs) }
            };
            let tile = |o: usize, xs: [&PreparedAvx2; 4]| [0, 1, 2, 3].map(|j| four(o + j, xs));
            let outputs = first..first + len;
            return matmat_in_tiles(self, outputs, xs, bias, out, prepare, (tile, four));
        }
        #[cfg(target_arch = "x86_64")]
        if super::isa::active() >= Isa::Avx512 && xs.len() >= 4 {
            // Safety (both closures): the active level never exceeds what the CPU has;
            // the rows of x hold as many blocks as the weight rows.
            let prepare = |x| unsafe { Prepared::new(x) };
            let outputs = first..first + len;
            let four = |o: usize, xs: [&Prepared; 4]| {
                let (nibbles, ws) = self.row(o);
                unsafe { dots_1x4(nibbles, ws, xs) }
            };
            if super::isa::has_avx512_vnni() {
                let tile = |o: usize, xs: [&Prepared; 4]| {
                    let rows = four_rows(o, |r| self.row(r));
                    unsafe { dots_4x4_vnni(rows, xs) }
                };
                return matmat_in_tiles(self, outputs, xs, bias, out, prepare, (tile, four));
            }
            let tile = |o: usize, xs: [&Prepared; 4]| [0, 1, 2, 3].map(|j| four(o + j, xs));
            return matmat_in_tiles(self, outputs, xs, bias, out, prepare, (tile, four));
        }
        matmat_by_dots(self, first, len, xs, bias, out)
    }
}

impl Q4Matrix {
    /// Row `r`'s packed values and block scales.
    fn row(&self, r: usize) -> (&[u8], &[f16]) {
        (
            &self.nibbles[r * self.blocks * HALF..(r + 1) * self.blocks * HALF],
            &self.scales[r * self.blocks..(r + 1) * self.blocks],
        )
    }
}

/// A row of x as [`dots_1x4`] reads it, per step of four blocks: what `dot_avx512`
/// works out from x alone (its halves paired with the low and high nibbles, their
/// offsets, its scales spread to lanes), once for every weight row.
#[cfg(target_arch = "x86_64")]
struct Prepared<'a> {
    row: &'a Q8Row,
    /// Per step: x's bytes that meet the low nibbles (64), then the high ones (64).
    halves: Vec<i8>,
    /// Per step: 8 x summed in pairs, as `dot_avx512`'s `offsets` (32 i16), for the
    /// sign trick; and in fours, negated (16 i32), to start VNNI's sums from.
    offsets: Vec<i16>,
    negative_offsets: Vec<i32>,
    /// Per step: block i's scale in lanes 4i .. 4i + 4.
    scales: Vec<f32>,
}

#[cfg(target_arch = "x86_64")]
impl<'a> Prepared<'a> {
    /// # Safety
    /// The CPU must have AVX-512 F/BW.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn new(row: &'a Q8Row) -> Self {
        use std::arch::x86_64::*;
        let (xq, xs) = row.parts();
        let steps = xs.len() / 4;
        let mut prepared = Self {
            row,
            halves: vec![0; steps * 128],
            offsets: vec![0; steps * 32],
            negative_offsets: vec![0; steps * 16],
            scales: vec![0.0; steps * 16],
        };
        let eight = _mm512_set1_epi8(8);
        let ones = _mm512_set1_epi16(1);
        let spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        for step in 0..steps {
            let b = 4 * step;
            let (x_low, x_high) = x_halves(xq.as_ptr().add(b * BLOCK));
            let halves = prepared.halves.as_mut_ptr().add(step * 128);
            _mm512_storeu_si512(halves.cast(), x_low);
            _mm512_storeu_si512(halves.add(64).cast(), x_high);
            let offsets = _mm512_add_epi16(
                _mm512_maddubs_epi16(eight, x_low),
                _mm512_maddubs_epi16(eight, x_high),
            );
            _mm512_storeu_si512(prepared.offsets.as_mut_ptr().add(step * 32).cast(), offsets);
            let fours = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_madd_epi16(offsets, ones));
            _mm512_storeu_si512(
                prepared.negative_offsets.as_mut_ptr().add(step * 16).cast(),
                fours,
            );
            let scales = _mm512_permutexvar_ps(
                spread,
                _mm512_castps128_ps512(_mm_loadu_ps(xs.as_ptr().add(b))),
            );
            _mm512_storeu_ps(prepared.scales.as_mut_ptr().add(step * 16), scales);
        }
        prepared
    }
}

/// [`dot_avx512`] of one weight row against four rows of x: the nibbles unpacked and
/// the weight scales spread once for the four. The integers are dot_avx512's (the
/// sums of (q - 8) x in fours, whether by `vpmaddubsw` + `vpmaddwd` less the offsets
/// or, with VNNI, by `vpdpbusd` from the negated offsets: no i16 sum overflows), the
/// scale of a lane is the same f32 product: the sums are its sums to the bit.
///
/// # Safety
/// The CPU must have AVX-512 F/BW; each row of x holds `ws.len()` blocks.
#[cfg(target_arch = "x86_64")]
unsafe fn dots_1x4(nibbles: &[u8], ws: &[f16], xs: [&Prepared; 4]) -> [f32; 4] {
    if super::isa::has_avx512_vnni() {
        dots_1x4_vnni(nibbles, ws, xs)
    } else {
        dots_1x4_bw(nibbles, ws, xs)
    }
}

/// The body of [`dots_1x4`]: `$sums(low, high, x, step)` gives a step's sums in fours.
#[cfg(target_arch = "x86_64")]
macro_rules! dots_1x4_body {
    ($nibbles:ident, $ws:ident, $xs:ident, $sums:expr) => {{
        use std::arch::x86_64::*;
        let blocks = $ws.len();
        debug_assert!($nibbles.len() >= blocks * HALF);
        let low_bits = _mm512_set1_epi8(0x0F);
        let spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        let mut acc = [_mm512_setzero_ps(); 4];
        let whole = blocks & !3;
        for b in (0..whole).step_by(4) {
            let step = b / 4;
            // Safety: each slice holds `blocks` whole blocks; b + 3 < blocks.
            let packed = _mm512_loadu_si512($nibbles.as_ptr().add(b * HALF).cast());
            let low = _mm512_and_si512(packed, low_bits);
            let high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_bits);
            let w_scales =
                _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(four_scales($ws, b)));
            for (acc, x) in acc.iter_mut().zip($xs) {
                let sums = $sums(low, high, x, step);
                let scale =
                    _mm512_mul_ps(w_scales, _mm512_loadu_ps(x.scales.as_ptr().add(step * 16)));
                *acc = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sums), *acc);
            }
        }
        let mut sums = [0f32; 4];
        for ((sum, acc), x) in sums.iter_mut().zip(acc).zip($xs) {
            *sum = _mm512_reduce_add_ps(acc);
            if whole < blocks {
                let (xq, xs) = x.row.parts();
                *sum += dot_avx2(
                    &$nibbles[whole * HALF..blocks * HALF],
                    &$ws[whole..],
                    &xq[whole * BLOCK..blocks * BLOCK],
                    &xs[whole..blocks],
                );
            }
        }
        sums
    }};
}

/// [`dots_1x4_vnni`] for four weight rows at once: each step's x (its halves, offsets
/// and scales) loaded once for the four, where one weight row at a time loaded them
/// for each (the prompt's products were bound by those loads). Every sum is the same
/// operations in the same order as `dots_1x4_vnni`'s, so the same bits.
///
/// # Safety
/// The CPU must have AVX-512 F/BW and VNNI; each row of x holds as many blocks as the
/// weight rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn dots_4x4_vnni(rows: [(&[u8], &[f16]); 4], xs: [&Prepared; 4]) -> [[f32; 4]; 4] {
    use std::arch::x86_64::*;
    let blocks = rows[0].1.len();
    debug_assert!(rows
        .iter()
        .all(|(n, ws)| ws.len() == blocks && n.len() >= blocks * HALF));
    let low_bits = _mm512_set1_epi8(0x0F);
    let spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    let mut acc = [[_mm512_setzero_ps(); 4]; 4];
    let whole = blocks & !3;
    for b in (0..whole).step_by(4) {
        let step = b / 4;
        // Safety: each row holds `blocks` whole blocks; b + 3 < blocks.
        let unpacked = rows.map(|(nibbles, ws)| {
            let packed = _mm512_loadu_si512(nibbles.as_ptr().add(b * HALF).cast());
            let low = _mm512_and_si512(packed, low_bits);
            let high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_bits);
            let scales = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(four_scales(ws, b)));
            (low, high, scales)
        });
        for (i, x) in xs.iter().enumerate() {
            let halves = x.halves.as_ptr().add(step * 128);
            let (x_low, x_high) = (
                _mm512_loadu_si512(halves.cast()),
                _mm512_loadu_si512(halves.add(64).cast()),
            );
            let start = _mm512_loadu_si512(x.negative_offsets.as_ptr().add(step * 16).cast());
            let x_scales = _mm512_loadu_ps(x.scales.as_ptr().add(step * 16));
            for (j, &(low, high, w_scales)) in unpacked.iter().enumerate() {
                let with_low = _mm512_dpbusd_epi32(start, low, x_low);
                let sums = _mm512_dpbusd_epi32(with_low, high, x_high);
                let scale = _mm512_mul_ps(w_scales, x_scales);
                acc[j][i] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sums), acc[j][i]);
            }
        }
    }
    let mut sums = sums_4x4(acc);
    if whole < blocks {
        for (sums, (nibbles, ws)) in sums.iter_mut().zip(rows) {
            for (sum, x) in sums.iter_mut().zip(xs) {
                let (xq, x_scales) = x.row.parts();
                *sum += dot_avx2(
                    &nibbles[whole * HALF..blocks * HALF],
                    &ws[whole..],
                    &xq[whole * BLOCK..blocks * BLOCK],
                    &x_scales[whole..blocks],
                );
            }
        }
    }
    sums
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn dots_1x4_vnni(nibbles: &[u8], ws: &[f16], xs: [&Prepared; 4]) -> [f32; 4] {
    dots_1x4_body!(nibbles, ws, xs, |low, high, x: &Prepared, step: usize| {
        let halves = x.halves.as_ptr().add(step * 128);
        let start = _mm512_loadu_si512(x.negative_offsets.as_ptr().add(step * 16).cast());
        let with_low = _mm512_dpbusd_epi32(start, low, _mm512_loadu_si512(halves.cast()));
        _mm512_dpbusd_epi32(with_low, high, _mm512_loadu_si512(halves.add(64).cast()))
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn dots_1x4_bw(nibbles: &[u8], ws: &[f16], xs: [&Prepared; 4]) -> [f32; 4] {
    let ones = std::arch::x86_64::_mm512_set1_epi16(1);
    dots_1x4_body!(nibbles, ws, xs, |low, high, x: &Prepared, step: usize| {
        let halves = x.halves.as_ptr().add(step * 128);
        let products = _mm512_add_epi16(
            _mm512_maddubs_epi16(low, _mm512_loadu_si512(halves.cast())),
            _mm512_maddubs_epi16(high, _mm512_loadu_si512(halves.add(64).cast())),
        );
        let offsets = _mm512_loadu_si512(x.offsets.as_ptr().add(step * 32).cast());
        _mm512_madd_epi16(_mm512_sub_epi16(products, offsets), ones)
    })
}

/// A row of x as [`dots_1x4_avx2`] reads it, per step of two blocks: what `dot_avx2`
/// works out from x alone (its values as the nibbles meet them, 8 x their pair sums,
/// the two scales in four lanes each), once for every weight row.
#[cfg(target_arch = "x86_64")]
struct PreparedAvx2<'a> {
    row: &'a Q8Row,
    /// Per step: the values that meet the low nibbles (32), then the high ones (32).
    halves: Vec<i8>,
    /// Per step: `dot_avx2`'s `offsets` (16 i16).
    offsets: Vec<i16>,
    /// Per step: block b's scale in lanes 0..4, block b + 1's in 4..8.
    scales: Vec<f32>,
}

#[cfg(target_arch = "x86_64")]
impl<'a> PreparedAvx2<'a> {
    /// # Safety
    /// The CPU must have AVX2.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn new(row: &'a Q8Row) -> Self {
        use std::arch::x86_64::*;
        let (xq, xs) = row.parts();
        let steps = xs.len() / 2;
        let mut prepared = Self {
            row,
            halves: vec![0; steps * 64],
            offsets: vec![0; steps * 16],
            scales: vec![0.0; steps * 8],
        };
        let eight = _mm256_set1_epi8(8);
        for step in 0..steps {
            let b = 2 * step;
            let x = xq.as_ptr().add(b * BLOCK);
            let x_low = _mm256_loadu2_m128i(x.add(BLOCK).cast(), x.cast());
            let x_high = _mm256_loadu2_m128i(x.add(BLOCK + HALF).cast(), x.add(HALF).cast());
            let halves = prepared.halves.as_mut_ptr().add(step * 64);
            _mm256_storeu_si256(halves.cast(), x_low);
            _mm256_storeu_si256(halves.add(32).cast(), x_high);
            let offsets = _mm256_add_epi16(
                _mm256_maddubs_epi16(eight, x_low),
                _mm256_maddubs_epi16(eight, x_high),
            );
            _mm256_storeu_si256(prepared.offsets.as_mut_ptr().add(step * 16).cast(), offsets);
            prepared.scales[step * 8..step * 8 + 4].fill(xs[b]);
            prepared.scales[step * 8 + 4..step * 8 + 8].fill(xs[b + 1]);
        }
        prepared
    }
}

/// [`dot_avx2`] of one weight row against four rows of x: the nibbles unpacked and the
/// weight scales spread once for the four, x's side prepared once for all the weight
/// rows. The integers are dot_avx2's in the same lanes, each scale the same f32
/// product, added in its order, an odd last block through `dot_portable` as there:
/// its sums to the bit.
///
/// # Safety
/// The CPU must have AVX2 and FMA; each row of x holds `ws.len()` blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dots_1x4_avx2(nibbles: &[u8], ws: &[f16], xs: [&PreparedAvx2; 4]) -> [f32; 4] {
    use std::arch::x86_64::*;
    let blocks = ws.len();
    debug_assert!(nibbles.len() >= blocks * HALF);
    debug_assert!(xs.iter().all(|x| x.scales.len() >= blocks / 2 * 8));
    let low_bits = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); 4];
    for b in (0..blocks & !1).step_by(2) {
        let step = b / 2;
        // Safety: each slice holds `blocks` whole blocks; b + 1 < blocks.
        let packed = _mm256_loadu_si256(nibbles.as_ptr().add(b * HALF).cast());
        let low = _mm256_and_si256(packed, low_bits);
        let high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_bits);
        let pair = two_scales(ws, b);
        let w_scales = _mm256_set_m128(
            _mm_shuffle_ps::<0b01_01_01_01>(pair, pair),
            _mm_shuffle_ps::<0>(pair, pair),
        );
        for (acc, x) in acc.iter_mut().zip(xs) {
            let halves = x.halves.as_ptr().add(step * 64);
            let products = _mm256_add_epi16(
                _mm256_maddubs_epi16(low, _mm256_loadu_si256(halves.cast())),
                _mm256_maddubs_epi16(high, _mm256_loadu_si256(halves.add(32).cast())),
            );
            let offsets = _mm256_loadu_si256(x.offsets.as_ptr().add(step * 16).cast());
            let sums = _mm256_madd_epi16(_mm256_sub_epi16(products, offsets), ones);
            let scale = _mm256_mul_ps(w_scales, _mm256_loadu_ps(x.scales.as_ptr().add(step * 8)));
            *acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums), *acc);
        }
    }
    let mut sums = [0f32; 4];
    for ((sum, acc), x) in sums.iter_mut().zip(acc).zip(xs) {
        *sum = lanes_sum_avx2(acc);
        if blocks % 2 == 1 {
            let last = blocks - 1;
            let (xq, x_scales) = x.row.parts();
            *sum += dot_portable(
                &nibbles[last * HALF..blocks * HALF],
                &ws[last..],
                &xq[last * BLOCK..blocks * BLOCK],
                &x_scales[last..blocks],
            );
        }
    }
    sums
}

/// Σ over blocks of (w scale x x scale) x Σ (q_i - 8) x_i, at `level`.
fn dot(level: Isa, nibbles: &[u8], ws: &[f16], xq: &[i8], xs: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if level >= Isa::Avx512 {
        // Safety: the active level never exceeds what the CPU has.
        return unsafe { dot_avx512(nibbles, ws, xq, xs) };
    }
    #[cfg(target_arch = "x86_64")]
    if level >= Isa::Avx2 {
        // Safety: the active level never exceeds what the CPU has, and AVX2 + FMA are
        // part of every level from Avx2 up.
        return unsafe { dot_avx2(nibbles, ws, xq, xs) };
    }
    let _ = level;
    dot_portable(nibbles, ws, xq, xs)
}

/// The scales of blocks b .. b + 4 in f32 (exactly: every f16 is an f32).
///
/// # Safety
/// `ws` must hold blocks b .. b + 4; the CPU must have F16C.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "f16c")]
unsafe fn four_scales(ws: &[f16], b: usize) -> std::arch::x86_64::__m128 {
    use std::arch::x86_64::*;
    debug_assert!(b + 4 <= ws.len());
    _mm_cvtph_ps(_mm_loadl_epi64(ws.as_ptr().add(b).cast()))
}

/// The scales of blocks b and b + 1 in f32, in lanes 0 and 1.
///
/// # Safety
/// `ws` must hold blocks b and b + 1; the CPU must have F16C.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "f16c")]
unsafe fn two_scales(ws: &[f16], b: usize) -> std::arch::x86_64::__m128 {
    use std::arch::x86_64::*;
    debug_assert!(b + 2 <= ws.len());
    let bits = ws.as_ptr().add(b).cast::<i32>().read_unaligned();
    _mm_cvtph_ps(_mm_cvtsi32_si128(bits))
}

/// Four blocks of x from `x` as the nibbles meet them: blocks b, b+1 and b+2, b+3 lie
/// as [lo16, hi16] each; the first of the pair holds every block's first 16 values
/// (against the low nibbles), the second its last 16 (against the high ones).
///
/// # Safety
/// `x` must point at four blocks; the CPU must have AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn x_halves(x: *const i8) -> (std::arch::x86_64::__m512i, std::arch::x86_64::__m512i) {
    use std::arch::x86_64::*;
    let (first, second) = (
        _mm512_loadu_si512(x.cast()),
        _mm512_loadu_si512(x.add(2 * BLOCK).cast()),
    );
    (
        _mm512_shuffle_i64x2(first, second, 0b10_00_10_00),
        _mm512_shuffle_i64x2(first, second, 0b11_01_11_01),
    )
}

/// [`dot_avx2`]'s sums four blocks a step in 512-bit registers: lane group k (four
/// i32 lanes) holds block k's; x's halves are gathered to match by one shuffle each.
/// The blocks left over (up to three) go to `dot_avx2`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn dot_avx512(nibbles: &[u8], ws: &[f16], xq: &[i8], xs: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let blocks = ws.len();
    debug_assert!(
        nibbles.len() >= blocks * HALF && xq.len() >= blocks * BLOCK && xs.len() >= blocks
    );
    let low_bits = _mm512_set1_epi8(0x0F);
    let eight = _mm512_set1_epi8(8);
    let ones = _mm512_set1_epi16(1);
    // Lane i takes the scale of block i / 4.
    let spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    let mut acc = _mm512_setzero_ps();
    let whole = blocks & !3;
    for b in (0..whole).step_by(4) {
        // Safety: each slice holds `blocks` whole blocks; b + 3 < blocks.
        let packed = _mm512_loadu_si512(nibbles.as_ptr().add(b * HALF).cast());
        let low = _mm512_and_si512(packed, low_bits);
        let high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_bits);
        let (x_low, x_high) = x_halves(xq.as_ptr().add(b * BLOCK));
        let products = _mm512_add_epi16(
            _mm512_maddubs_epi16(low, x_low),
            _mm512_maddubs_epi16(high, x_high),
        );
        let offsets = _mm512_add_epi16(
            _mm512_maddubs_epi16(eight, x_low),
            _mm512_maddubs_epi16(eight, x_high),
        );
        let sums = _mm512_madd_epi16(_mm512_sub_epi16(products, offsets), ones);
        let scales = _mm_mul_ps(four_scales(ws, b), _mm_loadu_ps(xs.as_ptr().add(b)));
        let scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(scales));
        acc = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sums), acc);
    }
    let mut sum = _mm512_reduce_add_ps(acc);
    if whole < blocks {
        sum += dot_avx2(
            &nibbles[whole * HALF..blocks * HALF],
            &ws[whole..],
            &xq[whole * BLOCK..blocks * BLOCK],
            &xs[whole..],
        );
    }
    sum
}

/// The blocks' exact integer sums, scaled and added in block order.
pub fn dot_portable(nibbles: &[u8], ws: &[f16], xq: &[i8], xs: &[f32]) -> f32 {
    let mut sum = 0f32;
    for (b, (w, x)) in nibbles
        .chunks_exact(HALF)
        .zip(xq.chunks_exact(BLOCK))
        .enumerate()
    {
        let block: i32 = w
            .iter()
            .enumerate()
            .map(|(j, &byte)| {
                let low = i32::from(byte & 0x0F) - 8;
                let high = i32::from(byte >> 4) - 8;
                low * i32::from(x[j]) + high * i32::from(x[HALF + j])
            })
            .sum();
        sum += ws[b].to_f32() * xs[b] * block as f32;
    }
    sum
}

/// Two blocks a step: their 32 bytes of 4-bit values split into the low halves (both
/// blocks' values 0..16) and the high ones (16..32), each multiplied with the matching
/// halves of x by `vpmaddubsw` (4-bit values are unsigned bytes as they lie), less 8
/// times x's pair sums: Σ (q - 8) x, exact in 16 bits (at most 4 x 15 x 127 a lane).
/// Lanes 0..4 then hold the first block's sums, 4..8 the second's, each scaled by its
/// block's scales. An odd last block is summed by the portable code.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_avx2(nibbles: &[u8], ws: &[f16], xq: &[i8], xs: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let blocks = ws.len();
    debug_assert!(
        nibbles.len() >= blocks * HALF && xq.len() >= blocks * BLOCK && xs.len() >= blocks
    );
    let low_bits = _mm256_set1_epi8(0x0F);
    let eight = _mm256_set1_epi8(8);
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    for b in (0..blocks & !1).step_by(2) {
        // Safety: each slice holds `blocks` whole blocks (asserted above in debug, by
        // construction in every caller); b + 1 < blocks.
        let packed = _mm256_loadu_si256(nibbles.as_ptr().add(b * HALF).cast());
        let low = _mm256_and_si256(packed, low_bits);
        let high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_bits);
        let x = xq.as_ptr().add(b * BLOCK);
        let x_low = _mm256_loadu2_m128i(x.add(BLOCK).cast(), x.cast());
        let x_high = _mm256_loadu2_m128i(x.add(BLOCK + HALF).cast(), x.add(HALF).cast());
        let products = _mm256_add_epi16(
            _mm256_maddubs_epi16(low, x_low),
            _mm256_maddubs_epi16(high, x_high),
        );
        let offsets = _mm256_add_epi16(
            _mm256_maddubs_epi16(eight, x_low),
            _mm256_maddubs_epi16(eight, x_high),
        );
        let sums = _mm256_madd_epi16(_mm256_sub_epi16(products, offsets), ones);
        let pair = two_scales(ws, b);
        let scale = _mm256_set_m128(
            _mm_set1_ps(
                _mm_cvtss_f32(_mm_shuffle_ps::<0b01_01_01_01>(pair, pair))
                    * *xs.get_unchecked(b + 1),
            ),
            _mm_set1_ps(_mm_cvtss_f32(pair) * *xs.get_unchecked(b)),
        );
        acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums), acc);
    }
    let mut sum = lanes_sum_avx2(acc);
    if blocks % 2 == 1 {
        let last = blocks - 1;
        sum += dot_portable(
            &nibbles[last * HALF..blocks * HALF],
            &ws[last..],
            &xq[last * BLOCK..blocks * BLOCK],
            &xs[last..],
        );
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::k_quants::{BlockQ4_0, GgmlType};

    /// Four rows of x, `cols` wide, quantized for `q` (seeds `seed`..`seed + 4`).
    #[cfg(target_arch = "x86_64")]
    fn rows_of_x(q: &Q4Matrix, cols: usize, seed: u32) -> Vec<Q8Row> {
        (0..4)
            .map(|r| {
                let mut row = Q8Row::default();
                q.quantize_row(&values(cols, seed + r), &mut row);
                row
            })
            .collect()
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    /// The same numbers as llama.cpp's q4_0 (candle's port of its quantizer and
    /// dequantizer), bit for bit, and each within half a step (a block's largest
    /// magnitude is -8 steps: exact up to f16's rounding of the scale).
    /// AVX2's four-row kernel gives `dot_avx2`'s sums to the bit, with an odd last
    /// block.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn four_rows_at_once_on_avx2_give_each_rows_own_sums() {
        use std::arch::is_x86_feature_detected as has;
        if !(has!("avx2") && has!("fma")) {
            eprintln!("SKIPPED: the AVX2 four-row int4 kernel (no AVX2 here)");
            return;
        }
        // An odd number of blocks: the last one goes through dot_portable.
        let cols = 11 * BLOCK;
        let q = Q4Matrix::quantize(&values(3 * cols, 6), 3, cols);
        let xs = rows_of_x(&q, cols, 40);
        // Safety: AVX2 and FMA checked above; whole blocks throughout.
        let prepared: Vec<PreparedAvx2> =
            xs.iter().map(|x| unsafe { PreparedAvx2::new(x) }).collect();
        let four = [&prepared[0], &prepared[1], &prepared[2], &prepared[3]];
        for o in 0..3 {
            let (nibbles, ws) = q.row(o);
            let want: Vec<f32> = xs
                .iter()
                .map(|x| unsafe { dot_avx2(nibbles, ws, x.parts().0, x.parts().1) })
                .collect();
            let got = unsafe { dots_1x4_avx2(nibbles, ws, four) };
            assert_eq!(got.to_vec(), want, "weight row {o}");
        }
    }

    /// Both four-row kernels (with and without VNNI, where the CPU has them) give
    /// `dot_avx512`'s sums to the bit, with a last step of fewer than four blocks.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn four_rows_at_once_give_each_rows_own_sums() {
        use std::arch::is_x86_feature_detected as has;
        if !(has!("avx512f") && has!("avx512bw")) {
            eprintln!("SKIPPED: the AVX-512 four-row int4 kernels (no AVX-512 here)");
            return;
        }
        let cols = 11 * BLOCK;
        let q = Q4Matrix::quantize(&values(4 * cols, 5), 4, cols);
        let xs = rows_of_x(&q, cols, 20);
        // Safety: AVX-512 F/BW checked above; whole blocks throughout.
        let prepared: Vec<Prepared> = xs.iter().map(|x| unsafe { Prepared::new(x) }).collect();
        let four = [&prepared[0], &prepared[1], &prepared[2], &prepared[3]];
        if has!("avx512vnni") {
            // Four weight rows at once: each one's sums those of the row alone.
            let tile = unsafe { dots_4x4_vnni([0, 1, 2, 3].map(|o| q.row(o)), four) };
            for (o, sums) in tile.into_iter().enumerate() {
                let (nibbles, ws) = q.row(o);
                assert_eq!(sums, unsafe { dots_1x4_vnni(nibbles, ws, four) }, "row {o}");
            }
        }
        for o in 0..4 {
            let (nibbles, ws) = q.row(o);
            let want: Vec<f32> = xs
                .iter()
                .map(|x| unsafe { dot_avx512(nibbles, ws, x.parts().0, x.parts().1) })
                .collect();
            assert_eq!(unsafe { dots_1x4_bw(nibbles, ws, four) }.to_vec(), want);
            if has!("avx512vnni") {
                assert_eq!(unsafe { dots_1x4_vnni(nibbles, ws, four) }.to_vec(), want);
            } else {
                eprintln!("SKIPPED: the VNNI four-row int4 kernel (no AVX-512 VNNI here)");
            }
        }
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
        assert_eq!(q.bytes(), rows * 3 * (HALF + 2));
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
                let scale = q.scales[r * 3 + i / BLOCK].to_f32();
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
        assert_eq!(*Q4Matrix::quantize(&[0.0; 4], 1, 4).scales, [f16::ZERO]);
    }

    #[test]
    fn a_product_is_the_dequantized_product() {
        let (rows, cols) = (9, 100);
        let w = values(rows * cols, 2);
        let x = values(cols, 3);
        let q = Q4Matrix::quantize(&w, rows, cols);
        let mut qx = Q8Row::default();
        q.quantize_row(&x, &mut qx);
        let (xq, xs) = qx.parts();
        let x_back: Vec<f64> = (0..cols)
            .map(|i| f64::from(xq[i]) * f64::from(xs[i / BLOCK]))
            .collect();
        let bias = values(rows, 4);
        let mut out = vec![0f32; rows];
        q.matvec(0, &qx, Some(&bias), &mut out);
        let mut both = vec![0f32; 2 * 4];
        q.matmat(3, 4, &[qx.clone(), qx.clone()], None, &mut both);
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            q.row_into(r, &mut row);
            let want: f64 = row
                .iter()
                .zip(&x_back)
                .map(|(&w, &x)| f64::from(w) * x)
                .sum();
            let got = f64::from(out[r]) - f64::from(bias[r]);
            assert!((got - want).abs() < 1e-5, "row {r}: {got} vs {want}");
            if (3..7).contains(&r) {
                assert_eq!(both[r - 3], both[4 + r - 3]);
                assert!((f64::from(both[r - 3]) - want).abs() < 1e-5);
            }
        }
        // Every level the CPU has sums each block exactly: the same to f32 rounding,
        // over whole groups of blocks and with some left over.
        let (rows, cols) = (2, 7 * BLOCK + 5);
        let w = values(rows * cols, 5);
        let q = Q4Matrix::quantize(&w, rows, cols);
        let mut qx = Q8Row::default();
        q.quantize_row(&values(cols, 6), &mut qx);
        let (xq, xs) = qx.parts();
        let sizes = [1, 2, 3, 4, 5, 8];
        for (level, blocks) in Isa::supported()
            .into_iter()
            .flat_map(|l| sizes.map(|b| (l, b)))
        {
            let (w, s) = (&q.nibbles[..blocks * HALF], &q.scales[..blocks]);
            let (a, b) = (dot(level, w, s, xq, xs), dot_portable(w, s, xq, xs));
            assert!(
                (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                "{level:?}: {a} vs {b}"
            );
        }
    }
}
