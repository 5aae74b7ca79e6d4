//! Weights in eight bits as llama.cpp's `q8_0` holds them (blocks of 32 int8 values,
//! one f16 scale each: 34 bytes a block, where an f32 scale made it 36 and a one-stream
//! pass, which reads every byte once a token, 6% longer), laid out for products that
//! keep every vector lane on whole blocks.
//!
//! Rows go in groups of sixteen. For each block, a group holds eight 64-byte vectors,
//! the k-th holding four values of each of its sixteen rows (values 4k..4k+4 of the
//! block), then the sixteen rows' scales. One `vpdpbusd` of such a vector against four
//! values of one activation row (broadcast) adds four products to each row's lane, so
//! eight of them leave each lane holding its row's whole block, exactly, as an integer;
//! it is converted and scaled once per block for sixteen rows. Row-major blocks instead
//! (two blocks a vector, each lane four products) paid a conversion, a multiplication
//! and an add for every four products of every (weight row, activation row) pair, and a
//! horizontal sum per pair at the end: three float instructions a `vpdpbusd`, where
//! here there are three per eight, and no horizontal sums.
//!
//! `vpdpbusd` multiplies unsigned by signed bytes, so the weights are kept as w + 128
//! (0..=255) and each activation row carries 128 x its block sums
//! ([`Q8Row::excess`]), subtracted before the conversion: (w + 128) · x - 128 Σx = w · x.
//! Without VNNI the AVX2 kernel takes |x| times w with x's sign (`vpmaddubsw`), the
//! same integers.
//!
//! Every level sums a row's blocks in the same order with the same f32 operations
//! (block integer to f32, times the activation's scale, fused multiply-add with the
//! weight's scale onto the row's sum), so the products are the same bits at every
//! level and for any number of activation rows: a sequence's logits do not depend on
//! the machine's vector level or the rows beside it in a pass.

use half::f16;
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::isa;
use super::isa::Isa;
use super::kernels::{asks_ahead, prefetch_all, AHEAD_BYTES};
use super::lines::Lines;
use super::q8::{quantize_into, BlockMatrix, Q8Row, BLOCK};

/// Weight rows whose values lie side by side: a 512-bit vector's sixteen lanes.
pub const GROUP: usize = 16;
/// Four-byte steps in a block (one `vpdpbusd` each).
const STEPS: usize = BLOCK / 4;
/// Bytes of a group's block: `STEPS` vectors of four values of each row.
const GROUP_BLOCK: usize = GROUP * BLOCK;
/// Activation rows a kernel call takes against a group at most: sixteen sums and
/// sixteen running totals in 32 registers would leave none for the weights.
const MAX_X: usize = 8;
/// [`Kernel::rows_a_call`] for AVX2.
const AVX2_ROWS: usize = 4;

/// A (rows, cols) matrix in blocks of `BLOCK` along its rows, rows in groups of
/// [`GROUP`] (cols padded with zeros to whole blocks, rows with zero rows to whole
/// groups).
#[derive(Debug, Clone)]
pub struct Q8Matrix {
    rows: usize,
    cols: usize,
    /// Blocks per row.
    blocks: usize,
    /// (groups, blocks, STEPS, GROUP, 4) values + 128.
    quants: Lines<u8>,
    /// (groups, blocks, GROUP) scales.
    scales: Lines<f16>,
}

impl Q8Matrix {
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
        let groups = rows.div_ceil(GROUP);
        let mut quants = Lines::zeroed(groups * blocks * GROUP_BLOCK);
        quants.fill(0x80); // zero + 128
        Self {
            rows,
            cols,
            blocks,
            quants,
            scales: Lines::zeroed(groups * blocks * GROUP),
        }
    }

    /// Rows first .. first + w.len() / cols set to `w` (row-major) quantized.
    pub fn quantize_rows(&mut self, first: usize, w: &[f32]) {
        let (cols, blocks) = (self.cols, self.blocks);
        assert_eq!(w.len() % cols, 0, "whole rows");
        let n = w.len() / cols;
        assert!(first + n <= self.rows, "rows inside the matrix");
        let groups = first / GROUP..(first + n).div_ceil(GROUP);
        let (group_quants, group_scales) = (blocks * GROUP_BLOCK, blocks * GROUP);
        self.quants[groups.start * group_quants..groups.end * group_quants]
            .par_chunks_mut(group_quants)
            .zip(
                self.scales[groups.start * group_scales..groups.end * group_scales]
                    .par_chunks_mut(group_scales),
            )
            .enumerate()
            .for_each(|(i, (quants, scales))| {
                let (mut row_quants, mut row_scales) =
                    (vec![0i8; blocks * BLOCK], vec![0f32; blocks]);
                let group = groups.start + i;
                for r in 0..GROUP {
                    let Some(row) = (group * GROUP + r)
                        .checked_sub(first)
                        .filter(|&row| row < n)
                    else {
                        continue;
                    };
                    quantize_into(
                        &w[row * cols..(row + 1) * cols],
                        &mut row_quants,
                        &mut row_scales,
                    );
                    for (b, &scale) in row_scales.iter().enumerate() {
                        scales[b * GROUP + r] = f16::from_f32(scale);
                        for (i, &q) in row_quants[b * BLOCK..(b + 1) * BLOCK].iter().enumerate() {
                            quants[at(b, i, r)] = (q as u8) ^ 0x80;
                        }
                    }
                }
            });
    }

    /// Bytes held: the int8 values and the scales.
    pub fn bytes(&self) -> usize {
        self.quants.len() + 2 * self.scales.len()
    }

    /// Row `r` back in f32 (each value its int8 times its block's scale) into
    /// out[..cols].
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        let (quants, scales) = self.group(r / GROUP);
        for (c, out) in out[..self.cols].iter_mut().enumerate() {
            let (b, i) = (c / BLOCK, c % BLOCK);
            let q = (quants[at(b, i, r % GROUP)] ^ 0x80) as i8;
            *out = f32::from(q) * scales[b * GROUP + r % GROUP].to_f32();
        }
    }

    /// Group `g`'s values and scales.
    fn group(&self, g: usize) -> (&[u8], &[f16]) {
        let (q, s) = (self.blocks * GROUP_BLOCK, self.blocks * GROUP);
        (
            &self.quants[g * q..(g + 1) * q],
            &self.scales[g * s..(g + 1) * s],
        )
    }

    /// out[r, o] = row (first + o) · xs[r] (+ bias[o]) for the `len` outputs of every
    /// row of x (`out` is (xs.len(), len)). Groups whose rows straddle first or
    /// first + len are computed whole and the outputs outside dropped. The rows of x go
    /// in chunks that fit L2, each chunk through every group of the outputs; a group
    /// then takes [`MAX_X`] rows of x a call, its weights read from memory once for the
    /// chunk and from the cache after.
    fn products(
        &self,
        first: usize,
        len: usize,
        xs: &[Q8Row],
        bias: Option<&[f32]>,
        out: &mut [f32],
    ) {
        debug_assert!(xs.iter().all(|x| x.parts().1.len() == self.blocks));
        let kernel = Kernel::active();
        let groups = first / GROUP..(first + len).div_ceil(GROUP);
        let group_bytes = self.blocks * (GROUP_BLOCK + 2 * GROUP);
        // Asked ahead where that helps this CPU (`asks_ahead`). A group's values are
        // one stretch of memory, which the prefetchers follow: on a Zen 4, asking for
        // each group ahead made 16 rows of GPT-2 124M 747-876 tokens/s, where the
        // prefetchers alone gave 968-1005.
        let ahead = asks_ahead().then(|| (AHEAD_BYTES / group_bytes).max(1));
        if let Some(ahead) = ahead {
            for g in groups.start..(groups.start + ahead).min(groups.end) {
                self.prefetch_group(g);
            }
        }
        let chunk = x_rows_per_chunk(self.cols);
        let mut sums = [[0f32; GROUP]; MAX_X];
        for chunk_start in (0..xs.len()).step_by(chunk) {
            let chunk = chunk_start..(chunk_start + chunk).min(xs.len());
            for g in groups.clone() {
                if let Some(ahead) = ahead.filter(|&a| g + a < groups.end) {
                    self.prefetch_group(g + ahead);
                }
                let (quants, scales) = self.group(g);
                for start in chunk.clone().step_by(kernel.rows_a_call()) {
                    let rows = &xs[start..(start + kernel.rows_a_call()).min(chunk.end)];
                    kernel.group_sums(quants, scales, rows, &mut sums);
                    for (c, sums) in sums[..rows.len()].iter().enumerate() {
                        let out = &mut out[(start + c) * len..(start + c + 1) * len];
                        for (r, &sum) in sums.iter().enumerate() {
                            let o = g * GROUP + r;
                            if (first..first + len).contains(&o) {
                                out[o - first] = sum + bias.map_or(0.0, |b| b[o - first]);
                            }
                        }
                    }
                }
            }
        }
    }

    fn prefetch_group(&self, g: usize) {
        let (quants, scales) = self.group(g);
        prefetch_all(quants);
        prefetch_all(scales);
    }
}

/// Where value `i` of block `b` of a group's row `r` lies in the group's values.
#[inline(always)]
fn at(b: usize, i: usize, r: usize) -> usize {
    b * GROUP_BLOCK + (i / 4) * (4 * GROUP) + r * 4 + i % 4
}

/// Rows of x that go through every group before the next rows (a multiple of
/// [`MAX_X`]): as many as keep their int8 values in 256 KiB of L2. All of a long
/// prompt's rows at once streamed them from L3 for every group.
fn x_rows_per_chunk(cols: usize) -> usize {
    const X_BYTES: usize = 256 << 10;
    (X_BYTES / cols.max(1)).max(MAX_X) / MAX_X * MAX_X
}

impl BlockMatrix for Q8Matrix {
    /// A group's rows go through a kernel together.
    const ROWS_TOGETHER: usize = GROUP;

    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn prefetch_row(&self, r: usize) {
        self.prefetch_group(r / GROUP);
    }

    fn row_bytes(&self) -> usize {
        self.blocks * (BLOCK + 2)
    }

    /// The kernels' sum for one row, in plain Rust: the same bits.
    fn dot_row(&self, _: Isa, r: usize, x: &Q8Row) -> f32 {
        let (quants, scales) = self.group(r / GROUP);
        let (xq, xs) = x.parts();
        let mut total = 0f32;
        for b in 0..self.blocks {
            let sum: i32 = (0..BLOCK)
                .map(|i| {
                    i32::from((quants[at(b, i, r % GROUP)] ^ 0x80) as i8)
                        * i32::from(xq[b * BLOCK + i])
                })
                .sum();
            total = (sum as f32 * xs[b]).mul_add(scales[b * GROUP + r % GROUP].to_f32(), total);
        }
        total
    }

    fn matvec(&self, first: usize, x: &Q8Row, bias: Option<&[f32]>, out: &mut [f32]) {
        self.products(first, out.len(), std::slice::from_ref(x), bias, out);
    }

    fn matmat(
        &self,
        first: usize,
        len: usize,
        xs: &[Q8Row],
        bias: Option<&[f32]>,
        out: &mut [f32],
    ) {
        self.products(first, len, xs, bias, out);
    }
}

/// The kernels, by what the CPU has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    /// AVX-512 with VNNI: [`group_vnni`].
    #[cfg(target_arch = "x86_64")]
    Vnni,
    /// AVX2 (and AVX-512 without VNNI): [`group_avx2`].
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// [`group_portable`].
    Portable,
}

impl Kernel {
    fn active() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let level = isa::active();
            if level >= Isa::Avx512 && isa::has_avx512_vnni() {
                return Kernel::Vnni;
            }
            if level >= Isa::Avx2 {
                return Kernel::Avx2;
            }
        }
        Kernel::Portable
    }

    /// Rows of x a call takes at most: each row's integer lanes and running totals
    /// stay in registers (VNNI: 16 of AVX-512's 32 at eight rows; AVX2: two registers
    /// each for a row's sixteen lanes, of 16).
    fn rows_a_call(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => AVX2_ROWS,
            _ => MAX_X,
        }
    }

    /// sums[c][r] = row r of the group (`quants`, `scales`) · xs[c], for every row of x
    /// (at most [`MAX_X`]).
    fn group_sums(
        self,
        quants: &[u8],
        scales: &[f16],
        xs: &[Q8Row],
        sums: &mut [[f32; GROUP]; MAX_X],
    ) {
        debug_assert!(xs.len() <= MAX_X);
        match self {
            // Safety: `active` chose the kernel from what the CPU has; every row of x
            // holds the group's blocks (`products` asserts it in debug).
            #[cfg(target_arch = "x86_64")]
            Kernel::Vnni => unsafe { by_count!(group_vnni, quants, scales, xs, sums) },
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { by_count!(group_avx2, quants, scales, xs, sums) },
            Kernel::Portable => group_portable(quants, scales, xs, sums),
        }
    }
}

/// `$kernel::<N>` for N = the rows of x (1..=MAX_X): the sums and running totals then
/// live in registers, one per row.
#[cfg(target_arch = "x86_64")]
macro_rules! by_count {
    ($kernel:ident, $q:expr, $s:expr, $xs:expr, $sums:expr) => {{
        let (q, s, xs, sums) = ($q, $s, $xs, $sums);
        match xs.len() {
            1 => $kernel::<1>(q, s, xs, sums),
            2 => $kernel::<2>(q, s, xs, sums),
            3 => $kernel::<3>(q, s, xs, sums),
            4 => $kernel::<4>(q, s, xs, sums),
            5 => $kernel::<5>(q, s, xs, sums),
            6 => $kernel::<6>(q, s, xs, sums),
            7 => $kernel::<7>(q, s, xs, sums),
            _ => $kernel::<8>(q, s, xs, sums),
        }
    }};
}
#[cfg(target_arch = "x86_64")]
use by_count;

/// [`Kernel::group_sums`] for N rows of x with AVX-512 VNNI: per block, each row of x
/// starts sixteen integer lanes at minus its excess and adds eight `vpdpbusd` of the
/// weight vectors against four of its values broadcast; then converted, times x's scale,
/// fused onto the totals with the sixteen weight scales (widened from f16 in one
/// instruction).
///
/// # Safety
/// The CPU must have AVX-512 F/BW and VNNI; each row of x holds the group's blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn group_vnni<const N: usize>(
    quants: &[u8],
    scales: &[f16],
    xs: &[Q8Row],
    sums: &mut [[f32; GROUP]; MAX_X],
) {
    use std::arch::x86_64::*;
    let blocks = scales.len() / GROUP;
    debug_assert!(quants.len() == blocks * GROUP_BLOCK && xs.len() == N);
    let x: [(*const i8, *const f32, *const i32); N] = std::array::from_fn(|c| {
        let (q, s) = xs[c].parts();
        (q.as_ptr(), s.as_ptr(), xs[c].excess().as_ptr())
    });
    let mut totals = [_mm512_setzero_ps(); N];
    for b in 0..blocks {
        let mut lanes = [_mm512_setzero_si512(); N];
        for c in 0..N {
            lanes[c] = _mm512_set1_epi32(-*x[c].2.add(b));
        }
        for k in 0..STEPS {
            let w = _mm512_load_si512(quants.as_ptr().add(b * GROUP_BLOCK + k * 64).cast());
            for c in 0..N {
                let four = x[c].0.add(b * BLOCK + 4 * k).cast::<i32>().read_unaligned();
                lanes[c] = _mm512_dpbusd_epi32(lanes[c], w, _mm512_set1_epi32(four));
            }
        }
        let w_scales = _mm512_cvtph_ps(_mm256_loadu_si256(scales.as_ptr().add(b * GROUP).cast()));
        for c in 0..N {
            let scaled =
                _mm512_mul_ps(_mm512_cvtepi32_ps(lanes[c]), _mm512_set1_ps(*x[c].1.add(b)));
            totals[c] = _mm512_fmadd_ps(scaled, w_scales, totals[c]);
        }
    }
    for c in 0..N {
        _mm512_storeu_ps(sums[c].as_mut_ptr(), totals[c]);
    }
}

/// [`Kernel::group_sums`] for N rows of x with AVX2, the group's sixteen rows in two
/// halves of eight lanes: the weights back to signed bytes (w + 128 with its top bit
/// flipped), then |x| times w with x's sign (`vpmaddubsw`; a pair's sum, at most
/// 2 x 127 x 127, fits i16) summed in fours (`vpmaddwd`): the same block integers as
/// VNNI's, scaled in the same f32 steps.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; each row of x holds the group's blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_avx2<const N: usize>(
    quants: &[u8],
    scales: &[f16],
    xs: &[Q8Row],
    sums: &mut [[f32; GROUP]; MAX_X],
) {
    use std::arch::x86_64::*;
    let blocks = scales.len() / GROUP;
    debug_assert!(quants.len() == blocks * GROUP_BLOCK && xs.len() == N);
    let (ones, flip) = (_mm256_set1_epi16(1), _mm256_set1_epi8(-128));
    let x: [(*const i8, *const f32); N] = std::array::from_fn(|c| {
        let (q, s) = xs[c].parts();
        (q.as_ptr(), s.as_ptr())
    });
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
                let four =
                    _mm256_set1_epi32(x[c].0.add(b * BLOCK + 4 * k).cast::<i32>().read_unaligned());
                let magnitude = _mm256_abs_epi8(four);
                for h in 0..2 {
                    let pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(w[h], four));
                    lanes[c][h] = _mm256_add_epi32(lanes[c][h], _mm256_madd_epi16(pairs, ones));
                }
            }
        }
        let w_scales = [
            _mm256_cvtph_ps(_mm_loadu_si128(scales.as_ptr().add(b * GROUP).cast())),
            _mm256_cvtph_ps(_mm_loadu_si128(scales.as_ptr().add(b * GROUP + 8).cast())),
        ];
        for c in 0..N {
            let x_scale = _mm256_set1_ps(*x[c].1.add(b));
            for h in 0..2 {
                let scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(lanes[c][h]), x_scale);
                totals[c][h] = _mm256_fmadd_ps(scaled, w_scales[h], totals[c][h]);
            }
        }
    }
    for c in 0..N {
        _mm256_storeu_ps(sums[c].as_mut_ptr(), totals[c][0]);
        _mm256_storeu_ps(sums[c].as_mut_ptr().add(8), totals[c][1]);
    }
}

/// [`Kernel::group_sums`] in plain Rust: each block's integer sum, then the same f32
/// steps as the vector kernels (`mul_add` is fused everywhere).
fn group_portable(quants: &[u8], scales: &[f16], xs: &[Q8Row], sums: &mut [[f32; GROUP]; MAX_X]) {
    let blocks = scales.len() / GROUP;
    for (x, sums) in xs.iter().zip(sums.iter_mut()) {
        let (xq, xs) = x.parts();
        for (r, total) in sums.iter_mut().enumerate() {
            *total = 0.0;
            for b in 0..blocks {
                let sum: i32 = (0..BLOCK)
                    .map(|i| {
                        i32::from((quants[at(b, i, r)] ^ 0x80) as i8) * i32::from(xq[b * BLOCK + i])
                    })
                    .sum();
                *total = (sum as f32 * xs[b]).mul_add(scales[b * GROUP + r].to_f32(), *total);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
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
        for r in 0..rows {
            q.row_into(r, &mut back);
            for (i, (&a, &b)) in w[r * cols..(r + 1) * cols].iter().zip(&back).enumerate() {
                let step = q.scales[(i / BLOCK) * GROUP + r].to_f32();
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
        assert!((back[1] + 2.0).abs() <= 2.0 / 2048.0);
        assert_eq!(Q8Matrix::quantize(&[0.0; 4], 1, 4).scales[0].to_f32(), 0.0);
    }

    /// Rows set a few at a time, straddling groups, land where one call puts them.
    #[test]
    fn rows_set_in_pieces_are_rows_set_at_once() {
        let (rows, cols) = (37, 40);
        let w = values(rows * cols, 9);
        let whole = Q8Matrix::quantize(&w, rows, cols);
        let mut pieces = Q8Matrix::zeros(rows, cols);
        for (first, n) in [(0, 5), (5, 14), (19, 18)] {
            pieces.quantize_rows(first, &w[first * cols..(first + n) * cols]);
        }
        assert_eq!(*pieces.quants, *whole.quants);
        assert_eq!(*pieces.scales, *whole.scales);
    }

    /// Each kernel the CPU has, for every count of rows of x, gives the plain Rust sums
    /// to the bit; a share of the outputs starting inside a group too.
    #[test]
    fn every_kernel_and_row_count_gives_the_same_bits() {
        let (rows, cols) = (35, 7 * BLOCK + 5);
        let q = Q8Matrix::quantize(&values(rows * cols, 5), rows, cols);
        let xs: Vec<Q8Row> = (0..11)
            .map(|r| {
                let mut row = Q8Row::default();
                row.quantize(&values(cols, 20 + r));
                row
            })
            .collect();
        let want: Vec<Vec<f32>> = xs
            .iter()
            .map(|x| (0..rows).map(|o| q.dot_row(Isa::Scalar, o, x)).collect())
            .collect();
        let mut kernels = vec![Kernel::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") {
                kernels.push(Kernel::Avx2);
            } else {
                eprintln!("SKIPPED: the AVX2 int8 kernel (no AVX2 here)");
            }
            if has!("avx512f") && has!("avx512bw") && has!("avx512vnni") {
                kernels.push(Kernel::Vnni);
            } else {
                eprintln!("SKIPPED: the VNNI int8 kernel (no AVX-512 VNNI here)");
            }
        }
        for kernel in kernels {
            for n in 1..=MAX_X {
                for g in 0..rows.div_ceil(GROUP) {
                    let mut sums = [[0f32; GROUP]; MAX_X];
                    let (quants, scales) = q.group(g);
                    kernel.group_sums(quants, scales, &xs[..n], &mut sums);
                    for (c, sums) in sums[..n].iter().enumerate() {
                        for (r, &sum) in sums
                            .iter()
                            .enumerate()
                            .filter(|&(r, _)| g * GROUP + r < rows)
                        {
                            let want = want[c][g * GROUP + r];
                            assert_eq!(
                                sum.to_bits(),
                                want.to_bits(),
                                "{kernel:?} x{n} row {}: {sum} vs {want}",
                                g * GROUP + r
                            );
                        }
                    }
                }
            }
        }
        // Outputs 7..30 (inside the first group to inside the second) for all 11 rows.
        let (first, len) = (7, 23);
        let mut out = vec![0f32; xs.len() * len];
        q.matmat(first, len, &xs, None, &mut out);
        for (c, out) in out.chunks_exact(len).enumerate() {
            assert_eq!(out, &want[c][first..first + len], "row {c} of x");
        }
    }

    #[test]
    fn a_product_is_the_dequantized_product() {
        let (rows, cols) = (9, 100);
        let w = values(rows * cols, 2);
        let x = values(cols, 3);
        let q = Q8Matrix::quantize(&w, rows, cols);
        let mut qx = Q8Row::default();
        q.quantize_row(&x, &mut qx);
        let bias = values(rows, 4);
        let mut out = vec![0f32; rows];
        q.matvec(0, &qx, Some(&bias), &mut out);
        // The same numbers in f64: dequantized weights times dequantized inputs.
        let xs: Vec<f64> = (0..cols)
            .map(|i| f64::from(qx.parts().0[i]) * f64::from(qx.parts().1[i / BLOCK]))
            .collect();
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            q.row_into(r, &mut row);
            let want: f64 = row
                .iter()
                .zip(&xs)
                .map(|(&w, &x)| f64::from(w) * x)
                .sum::<f64>()
                + f64::from(bias[r]);
            assert!(
                (f64::from(out[r]) - want).abs() < 1e-5,
                "row {r}: {} vs {want}",
                out[r]
            );
        }
        // And near the f32 product: each value off by at most half a step.
        let exact: f32 = w[..cols].iter().zip(&x).map(|(a, b)| a * b).sum::<f32>() + bias[0];
        assert!((out[0] - exact).abs() < 0.05, "{} vs {exact}", out[0]);
    }
}
