//! Eight-bit blocks as llama.cpp's `q8_0` holds them: values in blocks of 32, each
//! block its int8 values and one f32 scale (the block's largest magnitude / 127). A
//! token's activations are quantized so ([`Q8Row`]) before a product with int8 or int4
//! weights, so a block's dot product is 32 integer multiplications summed exactly,
//! scaled once. The int8 weights themselves (`Q8Matrix`) are in `q8_matrix`, laid
//! out in groups of rows; this module holds what both weight formats share: the
//! activation rows, the [`BlockMatrix`] products, and the tiles `q4` takes.

use super::isa::{self, Isa};
use super::kernels::{asks_ahead, multiversion, AHEAD_BYTES};

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

/// `row(o)` .. `row(o + 3)`, written out rather than by `array::map`: the map's closure
/// was called out of line, its slices stored and loaded back in halves, the loads
/// stalled on the stores (13% of a 16-row int8 pass on a Zen 5). The tiles of `q8` and
/// `q4` fetch their four weight rows through it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn four_rows<T>(o: usize, row: impl Fn(usize) -> T) -> [T; 4] {
    [row(o), row(o + 1), row(o + 2), row(o + 3)]
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

/// A matrix in blocks of [`BLOCK`] whose products take the activations in eight bits
/// ([`Q8Row`]): this module's and `q4`'s. Each gives its row dot product; the products
/// over many outputs and rows are written once, here.
pub trait BlockMatrix: Sync {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    /// Row `r` · x at `level`.
    fn dot_row(&self, level: Isa, r: usize, x: &Q8Row) -> f32;
    /// Asks for row `r`'s values and scales ahead of their use (`kernels::prefetch`).
    fn prefetch_row(&self, r: usize);
    /// The bytes of one row, scales included.
    fn row_bytes(&self) -> usize;
    /// Rows a product computes together: a thread's share of the outputs is a multiple
    /// of it.
    const ROWS_TOGETHER: usize = 1;

    /// `x` (one row of `cols` values) quantized for products with this matrix.
    fn quantize_row(&self, x: &[f32], into: &mut Q8Row) {
        assert_eq!(x.len(), self.cols(), "a row as wide as the matrix");
        into.quantize(x);
    }

    /// out[o] = row (first + o) · x (+ bias[o]) for the outputs in `out`.
    /// One row at a time, each asked for [`AHEAD_BYTES`] ahead: a row's dot product
    /// then reads from the cache, where one waiting on memory was most of the time.
    /// (Where the CPU's prefetchers do better alone, [`asks_ahead`], nothing is asked.)
    fn matvec(&self, first: usize, x: &Q8Row, bias: Option<&[f32]>, out: &mut [f32]) {
        let level = isa::active();
        let ahead = asks_ahead().then(|| (AHEAD_BYTES / self.row_bytes()).max(1));
        let end = first + out.len();
        if let Some(ahead) = ahead {
            for r in first..(first + ahead).min(end) {
                self.prefetch_row(r);
            }
        }
        for (o, out) in out.iter_mut().enumerate() {
            if let Some(ahead) = ahead.filter(|a| first + o + a < end) {
                self.prefetch_row(first + o + ahead);
            }
            *out = self.dot_row(level, first + o, x) + bias.map_or(0.0, |b| b[o]);
        }
    }

    /// out[r, o] = row (first + o) · xs[r] (+ bias[o]) for `len` outputs of every row
    /// (`out` is (rows, len)): a weight row is read once for all the rows, or, where
    /// many rows are tiled (`matmat_in_tiles`), once for each L2-sized chunk of them.
    fn matmat(
        &self,
        first: usize,
        len: usize,
        xs: &[Q8Row],
        bias: Option<&[f32]>,
        out: &mut [f32],
    ) {
        matmat_by_dots(self, first, len, xs, bias, out)
    }
}

/// [`BlockMatrix::matmat`] for the weight rows `outputs`, in tiles of weight rows
/// against four rows of x at once: `prepare` works out once what a kernel needs of a
/// row of x; `tile(o, rows)` gives weight rows o..o+4 against four prepared rows
/// (`[j][i]`: weight row o + j, x row i) and `four(o, rows)` weight row o alone against
/// them, each sum to the bit what `dot_row` gives (so a sequence's logits do not
/// depend on the rows beside it). The rows of x go in chunks that fit L2
/// (`x_rows_per_chunk`), each chunk through every weight row; the last rows of x (fewer
/// than four) go through `dot_row`, the last weight rows through `four`. Weight rows are
/// asked for ahead.
#[cfg(target_arch = "x86_64")]
pub(super) fn matmat_in_tiles<'x, P>(
    w: &impl BlockMatrix,
    outputs: std::ops::Range<usize>,
    xs: &'x [Q8Row],
    bias: Option<&[f32]>,
    out: &mut [f32],
    prepare: impl Fn(&'x Q8Row) -> P,
    (tile, four): (
        impl Fn(usize, [&P; 4]) -> [[f32; 4]; 4],
        impl Fn(usize, [&P; 4]) -> [f32; 4],
    ),
) {
    let (first, len) = (outputs.start, outputs.len());
    let blocks = xs.len() / 4 * 4;
    let level = isa::active();
    let prepared: Vec<P> = xs[..blocks].iter().map(prepare).collect();
    let quads = |r: usize| {
        [
            &prepared[r],
            &prepared[r + 1],
            &prepared[r + 2],
            &prepared[r + 3],
        ]
    };
    let ahead = (AHEAD_BYTES / w.row_bytes()).max(1);
    let bias = |o: usize| bias.map_or(0.0, |b| b[o]);
    let tiled = len / 4 * 4;
    let chunk = x_rows_per_chunk(w.cols());
    for x_rows in (0..blocks).step_by(chunk) {
        let x_rows = x_rows..(x_rows + chunk).min(blocks);
        for o in (0..tiled).step_by(4) {
            for a in o + ahead..(o + 4 + ahead).min(len) {
                w.prefetch_row(first + a);
            }
            for r in x_rows.clone().step_by(4) {
                for (j, sums) in tile(first + o, quads(r)).into_iter().enumerate() {
                    for (i, s) in sums.into_iter().enumerate() {
                        out[(r + i) * len + o + j] = s + bias(o + j);
                    }
                }
            }
        }
        for o in tiled..len {
            for r in x_rows.clone().step_by(4) {
                for (i, s) in four(first + o, quads(r)).into_iter().enumerate() {
                    out[(r + i) * len + o] = s + bias(o);
                }
            }
        }
    }
    for o in 0..len {
        for r in blocks..xs.len() {
            out[r * len + o] = w.dot_row(level, first + o, &xs[r]) + bias(o);
        }
    }
}

/// Rows of x that [`matmat_in_tiles`] takes through every weight row before the next
/// rows (a multiple of four): as many as keep their prepared forms (about 2 bytes a
/// column for int4's, less for int8's) in 256 KiB of L2. All of a long prompt's rows at
/// once made every four weight rows stream megabytes of them from L3 (GPT-2, 512
/// rows: int4 254-264 -> 217-219 ms, int8 263-283 -> 249-254 on a Zen 5; 64 KiB to
/// 512 KiB within a few percent of each other).
#[cfg(target_arch = "x86_64")]
fn x_rows_per_chunk(cols: usize) -> usize {
    const PREPARED_BYTES: usize = 256 << 10;
    (PREPARED_BYTES / (2 * cols.max(1))).max(4) / 4 * 4
}

/// [`BlockMatrix::matmat`] one row dot product at a time.
pub(super) fn matmat_by_dots(
    w: &(impl BlockMatrix + ?Sized),
    first: usize,
    len: usize,
    xs: &[Q8Row],
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    let level = isa::active();
    for o in 0..len {
        let b = bias.map_or(0.0, |b| b[o]);
        for (x, out) in xs.iter().zip(out.chunks_exact_mut(len)) {
            out[o] = w.dot_row(level, first + o, x) + b;
        }
    }
}

/// The eight lanes of `acc` added in one fixed order (halves, then pairs, then the
/// last two): every AVX2 dot product and its four-row kernel end here, so their sums
/// agree to the bit.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn lanes_sum_avx2(acc: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let halves = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    let pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
    _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)))
}

/// `_mm512_reduce_add_ps` of each of sixteen accumulators (`[j][i]`), its tree to the
/// bit (lane l + lane l + 8, then + 4, + 2, + 1), taken for all sixteen at once: each
/// step adds two vectors' halves side by side in one register, 15 adds and 30 shuffles
/// where sixteen reductions take 64 and 64 (a 4 x 4 tile's reductions were 5-6% of a
/// 16-row int8 pass on a Zen 5).
///
/// # Safety
/// The CPU must have AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn sums_4x4(acc: [[std::arch::x86_64::__m512; 4]; 4]) -> [[f32; 4]; 4] {
    use std::arch::x86_64::*;
    let v = |k: usize| acc[k / 4][k % 4];
    // Lanes 0-7: vector 2m's l + (l + 8); lanes 8-15: vector 2m + 1's.
    let eights: [__m512; 8] = std::array::from_fn(|m| {
        let (a, b) = (v(2 * m), v(2 * m + 1));
        _mm512_add_ps(
            _mm512_shuffle_f32x4(a, b, 0x44),
            _mm512_shuffle_f32x4(a, b, 0xEE),
        )
    });
    // Quarter q: vector 4n + q's l + (l + 4).
    let fours: [__m512; 4] = std::array::from_fn(|n| {
        let (a, b) = (eights[2 * n], eights[2 * n + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4(a, b, 0x88),
            _mm512_shuffle_f32x4(a, b, 0xDD),
        )
    });
    // Quarter q: lanes 0-1 vector 8t + q's l + (l + 2), lanes 2-3 vector 8t + 4 + q's.
    let twos: [__m512; 2] = std::array::from_fn(|t| {
        let (a, b) = (
            _mm512_castps_pd(fours[2 * t]),
            _mm512_castps_pd(fours[2 * t + 1]),
        );
        _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
            _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
        )
    });
    // Lane 4q + m: vector 4m + q's sum.
    let ones = _mm512_add_ps(
        _mm512_shuffle_ps(twos[0], twos[1], 0x88),
        _mm512_shuffle_ps(twos[0], twos[1], 0xDD),
    );
    let mut lanes = [0f32; 16];
    _mm512_storeu_ps(lanes.as_mut_ptr(), ones);
    std::array::from_fn(|j| std::array::from_fn(|i| lanes[4 * i + j]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    /// `sums_4x4` is sixteen `_mm512_reduce_add_ps` to the bit: lanes of mixed
    /// magnitudes, so that any other order of the adds rounds differently.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn sixteen_sums_at_once_are_each_vectors_own_sum() {
        use std::arch::x86_64::*;
        if !std::arch::is_x86_feature_detected!("avx512f") {
            eprintln!("SKIPPED: the 4 x 4 AVX-512 reduction (no AVX-512 here)");
            return;
        }
        for seed in 0..20u32 {
            let lanes: Vec<f32> = values(256, seed)
                .iter()
                .enumerate()
                .map(|(n, v)| v * [1.0, 1e-3, 3e4, 7e-6][(n * 7 + seed as usize) % 4])
                .collect();
            // Safety: AVX-512 F checked above; each load reads 16 of the 256 lanes.
            let acc = std::array::from_fn(|j| {
                std::array::from_fn(|i| unsafe {
                    _mm512_loadu_ps(lanes[16 * (4 * j + i)..].as_ptr())
                })
            });
            let got = unsafe { sums_4x4(acc) };
            for (j, row) in got.iter().enumerate() {
                for (i, &sum) in row.iter().enumerate() {
                    let want = unsafe { _mm512_reduce_add_ps(acc[j][i]) };
                    assert_eq!(sum.to_bits(), want.to_bits(), "[{j}][{i}] seed {seed}");
                }
            }
        }
    }
}
