//! Weights in eight bits for decoding, in the manner of llama.cpp's `q8_0`: each row of
//! a matrix in blocks of 32 values, each block its int8 values and one f32 scale (the
//! block's largest magnitude / 127). A token's activations are quantized the same way
//! before a product, so a block's dot product is 32 integer multiplications summed
//! exactly, scaled once: a quarter of f32's bytes read per weight, which is what a
//! decoding step spends its time on.
//!
//! The dot product of two blocks runs as AVX2 integer instructions where the CPU has
//! them (`vpmaddubsw` on |x| and w with x's sign, then `vpmaddwd`), plain Rust
//! elsewhere; both sum each block exactly in integers and differ only in the order the
//! scaled blocks are added in f32.

use rayon::prelude::*;

use super::isa::{self, Isa};
use super::kernels::{asks_ahead, multiversion, prefetch_all, AHEAD_BYTES};
use super::lines::Lines;
use super::weight_rows::PADDED_MIN_ROWS;
#[cfg(target_arch = "x86_64")]
use super::weight_rows::{sixteen_row_groups, Ahead, TileRows};

/// Values per block.
pub const BLOCK: usize = 32;

/// A (rows, cols) matrix in blocks of `BLOCK` along its rows (cols padded with zeros to
/// whole blocks).
#[derive(Debug, Clone)]
pub struct Q8Matrix {
    rows: usize,
    cols: usize,
    /// Blocks per row.
    blocks: usize,
    /// (rows, blocks x BLOCK) int8 values.
    quants: Lines<i8>,
    /// (rows, blocks) scales.
    scales: Lines<f32>,
}

/// One row of activations quantized for products with a [`Q8Matrix`].
#[derive(Debug, Clone, Default)]
pub struct Q8Row {
    quants: Vec<i8>,
    scales: Vec<f32>,
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
        Self {
            rows,
            cols,
            blocks,
            quants: Lines::zeroed(rows * blocks * BLOCK),
            scales: Lines::zeroed(rows * blocks),
        }
    }

    /// Rows first .. first + w.len() / cols set to `w` (row-major) quantized.
    pub fn quantize_rows(&mut self, first: usize, w: &[f32]) {
        let (cols, blocks) = (self.cols, self.blocks);
        assert_eq!(w.len() % cols, 0, "whole rows");
        let n = w.len() / cols;
        assert!(first + n <= self.rows, "rows inside the matrix");
        self.quants[first * blocks * BLOCK..(first + n) * blocks * BLOCK]
            .par_chunks_mut(blocks * BLOCK)
            .zip(self.scales[first * blocks..(first + n) * blocks].par_chunks_mut(blocks))
            .zip(w.par_chunks(cols))
            .for_each(|((q, s), row)| quantize_into(row, q, s));
    }

    /// Bytes held: the int8 values and the scales.
    pub fn bytes(&self) -> usize {
        self.quants.len() + 4 * self.scales.len()
    }

    /// Row `r` back in f32 (each value its int8 times its block's scale) into
    /// out[..cols].
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        self.rows_into(r, &mut out[..self.cols]);
    }
}

impl BlockMatrix for Q8Matrix {
    /// At the AVX2 level the integer products (`vpmaddubsw`, no VNNI) multiplied rows
    /// of x slower than f32's broadcasts: 16 sequences of GPT-2 124M decoded at 225-240
    /// tokens/s in int8, f32 at 249-270, int8 widened 267-324 (Zen 3, 2 threads).
    const WIDENED_FOR_MANY_ROWS: bool = true;

    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn prefetch_row(&self, r: usize) {
        let width = self.blocks * BLOCK;
        prefetch_all(&self.quants[r * width..(r + 1) * width]);
        prefetch_all(&self.scales[r * self.blocks..(r + 1) * self.blocks]);
    }

    fn row_bytes(&self) -> usize {
        self.blocks * (BLOCK + 4)
    }

    fn rows_into(&self, first: usize, out: &mut [f32]) {
        let (width, n) = (self.blocks * BLOCK, out.len() / self.cols);
        let quants = &self.quants[first * width..(first + n) * width];
        widen_q8(
            quants,
            &self.scales[first * self.blocks..(first + n) * self.blocks],
            self.cols,
            out,
        );
    }

    #[cfg(target_arch = "x86_64")]
    fn values_from(&self, r: usize) -> Ahead {
        let width = self.blocks * BLOCK;
        Ahead::rows(self.quants.as_ptr().wrapping_add(r * width), width, 64)
    }

    fn dot_row(&self, level: Isa, r: usize, x: &Q8Row) -> f32 {
        let (wq, ws) = self.row(r);
        dot(level, wq, ws, &x.quants, &x.scales)
    }

    /// On AVX-512, each weight row against four rows of x at once ([`dots_1x4`]; on
    /// AVX2 [`dots_1x4_avx2`]): the weights and their scales are loaded once for the
    /// four, and the sums are
    /// `dot_row`'s to the bit (the same integer sums, scaled and added in the same
    /// order), so a sequence's logits do not depend on the rows beside it.
    fn matmat(
        &self,
        first: usize,
        len: usize,
        xs: &[Q8Row],
        bias: Option<&[f32]>,
        out: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if isa::active() >= Isa::Avx2 && xs.len() >= 4 {
            let outputs = first..first + len;
            let avx512 = isa::active() >= Isa::Avx512;
            // Safety (all kernels): the active level never exceeds what the CPU has;
            // the rows of x hold as many blocks as the weight rows.
            let four = |o: usize, xs: [&Prepared; 4]| {
                let (wq, ws) = self.row(o);
                match avx512 {
                    true => unsafe { dots_1x4(wq, ws, xs) },
                    false => unsafe { dots_1x4_avx2(wq, ws, xs) },
                }
            };
            // Which kernels is asked once: the rows of x are prepared for them.
            let vnni = avx512 && isa::has_avx512_vnni();
            let tile = |o: usize, xs: [&Prepared; 4]| match vnni {
                true => unsafe { dots_4x4_vnni(four_rows(o, |r| self.row(r)), xs) },
                false => [0, 1, 2, 3].map(|j| four(o + j, xs)),
            };
            let kernel = match (avx512, vnni) {
                (true, true) => Kernel::Vnni,
                (true, false) => Kernel::Bw,
                (false, _) => Kernel::Avx2,
            };
            let prepare = |x| Prepared::new(x, kernel);
            return matmat_in_tiles(self, outputs, xs, bias, out, prepare, (tile, four));
        }
        matmat_by_dots(self, first, len, xs, bias, out)
    }
}

multiversion! {
    /// Each int8 value of whole rows (`quants`, `scales`: rows of whole blocks) times
    /// its block's scale, into out's rows of `cols`, a block at a time so that the loop
    /// runs in vectors.
    pub fn widen_q8(quants: &[i8], scales: &[f32], cols: usize, out: &mut [f32]) {
        let blocks = cols.div_ceil(BLOCK);
        let rows = quants
            .chunks_exact(blocks * BLOCK)
            .zip(scales.chunks_exact(blocks))
            .zip(out.chunks_exact_mut(cols));
        for ((quants, scales), out) in rows {
            let blocks = quants.chunks_exact(BLOCK).zip(scales).zip(out.chunks_mut(BLOCK));
            for ((quants, &scale), out) in blocks {
                for (out, &q) in out.iter_mut().zip(quants) {
                    *out = f32::from(q) * scale;
                }
            }
        }
    }
}

impl Q8Matrix {
    /// Row `r`'s int8 values and block scales.
    fn row(&self, r: usize) -> (&[i8], &[f32]) {
        let width = self.blocks * BLOCK;
        (
            &self.quants[r * width..(r + 1) * width],
            &self.scales[r * self.blocks..(r + 1) * self.blocks],
        )
    }
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
    /// Whether products of many rows of x widen this matrix to f32 a tile at a time
    /// ([`matmat_widened`]) instead of quantizing x, where [`takes_widened`] says.
    const WIDENED_FOR_MANY_ROWS: bool;
    /// Rows first.. back in f32 (the values the products use), into `out` (whole rows
    /// of `cols`).
    fn rows_into(&self, first: usize, out: &mut [f32]);
    /// Where row `r`'s values (not its scales) lie, as `weight_rows::Ahead` takes them.
    #[cfg(target_arch = "x86_64")]
    fn values_from(&self, r: usize) -> Ahead;

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

/// Rows first..first + len of a block matrix as `weight_rows`' groups of sixteen rows
/// read them: widened to f32 a tile at a time.
#[cfg(target_arch = "x86_64")]
struct Widened<'a, M: ?Sized> {
    m: &'a M,
    first: usize,
    len: usize,
}

#[cfg(target_arch = "x86_64")]
impl<M: BlockMatrix + ?Sized> TileRows for Widened<'_, M> {
    fn outputs(&self, _: usize) -> usize {
        self.len
    }

    unsafe fn tile<'a>(
        &'a self,
        o: usize,
        n: usize,
        d_in: usize,
        scratch: &'a mut Vec<f32>,
    ) -> &'a [f32] {
        scratch.resize(n * d_in, 0.0);
        self.m.rows_into(self.first + o, scratch);
        scratch
    }

    fn stored_from(&self, o: usize, _: usize) -> Ahead {
        self.m.values_from(self.first + o)
    }
}

/// Whether a product of `rows` rows of x with `M` takes [`matmat_widened`]: matrices
/// that choose it ([`BlockMatrix::WIDENED_FOR_MANY_ROWS`]), at the AVX2 level, from the
/// rows where f32's groups of sixteen start (8). AVX-512 has its own integer tiles
/// (`vpdpbusd` where the CPU has VNNI).
pub fn takes_widened<M: BlockMatrix + ?Sized>(rows: usize) -> bool {
    cfg!(target_arch = "x86_64")
        && M::WIDENED_FOR_MANY_ROWS
        && isa::active() == Isa::Avx2
        && rows >= PADDED_MIN_ROWS
}

/// out (rows, len) = x (rows, cols) · (rows first..first + len of w)ᵀ (+ bias[o]),
/// the weights widened to f32 a tile at a time for the f32 weights' groups of sixteen
/// rows of x (`weight_rows`), the activations kept in f32.
///
/// # Panics
/// If the CPU is below AVX2 or x has fewer than 8 rows ([`takes_widened`] holds
/// neither).
#[cfg(target_arch = "x86_64")]
pub fn matmat_widened(
    w: &(impl BlockMatrix + ?Sized),
    (first, len): (usize, usize),
    x: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    let d_in = w.cols();
    let rows = Widened { m: w, first, len };
    let done = sixteen_row_groups(&rows, bias, x, d_in, out);
    assert_eq!(done, x.len() / d_in, "AVX2 and 8 rows or more");
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

/// Σ over blocks of (w scale x x scale) x Σ w_i x_i, at `level`.
fn dot(level: Isa, wq: &[i8], ws: &[f32], xq: &[i8], xs: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if level >= Isa::Avx512 {
        // Safety: the active level never exceeds what the CPU has.
        return unsafe { dot_avx512(wq, ws, xq, xs) };
    }
    #[cfg(target_arch = "x86_64")]
    if level >= Isa::Avx2 {
        // Safety: the active level never exceeds what the CPU has, and AVX2 + FMA are
        // part of every level from Avx2 up.
        return unsafe { dot_avx2(wq, ws, xq, xs) };
    }
    let _ = level;
    dot_portable(wq, ws, xq, xs)
}

/// [`dot_avx2`] two blocks a step in 512-bit registers (lanes 0..8 the first block's
/// sums, 8..16 the second's); an odd last block goes to `dot_avx2`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx2,fma")]
unsafe fn dot_avx512(wq: &[i8], ws: &[f32], xq: &[i8], xs: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let blocks = ws.len();
    debug_assert!(wq.len() >= blocks * BLOCK && xq.len() >= blocks * BLOCK && xs.len() >= blocks);
    let ones = _mm512_set1_epi16(1);
    let mut acc = _mm512_setzero_ps();
    let whole = blocks & !1;
    for b in (0..whole).step_by(2) {
        // Safety: each slice holds `blocks` whole blocks; b + 1 < blocks.
        let w = _mm512_loadu_si512(wq.as_ptr().add(b * BLOCK).cast());
        let x = _mm512_loadu_si512(xq.as_ptr().add(b * BLOCK).cast());
        // As in dot_avx2: |x| times w with x's sign (AVX-512 BW has no vpsignb: the
        // negation is masked where x < 0).
        let negative = _mm512_movepi8_mask(x);
        let zero = _mm512_setzero_si512();
        let magnitude = _mm512_mask_sub_epi8(x, negative, zero, x);
        let signed = _mm512_mask_sub_epi8(w, negative, zero, w);
        let pairs = _mm512_maddubs_epi16(magnitude, signed);
        let quads = _mm512_madd_epi16(pairs, ones);
        let scale = _mm512_insertf32x8(
            _mm512_set1_ps(*ws.get_unchecked(b) * *xs.get_unchecked(b)),
            _mm256_set1_ps(*ws.get_unchecked(b + 1) * *xs.get_unchecked(b + 1)),
            1,
        );
        acc = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(quads), acc);
    }
    let mut sum = _mm512_reduce_add_ps(acc);
    if whole < blocks {
        sum += dot_avx2(
            &wq[whole * BLOCK..blocks * BLOCK],
            &ws[whole..],
            &xq[whole * BLOCK..blocks * BLOCK],
            &xs[whole..],
        );
    }
    sum
}

/// The kernels that take a weight row against four rows of x.
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    /// AVX-512 with VNNI: [`dots_1x4_vnni`], [`dots_4x4_vnni`].
    Vnni,
    /// AVX-512 F/BW without VNNI: [`dots_1x4_bw`].
    Bw,
    /// AVX2: [`dots_1x4_avx2`].
    Avx2,
}

/// A row of x as [`dots_1x4`] reads it against many weight rows: what depends on x
/// alone worked out once (its magnitudes, its signs, its scales spread to lanes), not
/// once per weight row.
#[cfg(target_arch = "x86_64")]
struct Prepared<'a> {
    row: &'a Q8Row,
    /// |x| per value (x lies in -127..=127, so it fits a byte).
    magnitude: Vec<u8>,
    /// x + 128 per value (0..=255): unsigned, as `vpdpbusd` takes its first operand
    /// (the sign bit flipped: -128..=127 to 0..=255).
    biased: Vec<u8>,
    /// Bit i of word p: value 64 p + i is negative.
    negative: Vec<u64>,
    /// Per pair of blocks: the first's scale in 8 lanes, then the second's.
    scales: Vec<f32>,
}

#[cfg(target_arch = "x86_64")]
impl<'a> Prepared<'a> {
    /// What `kernel` reads: x + 128 (VNNI), magnitudes and signs (AVX-512 BW), or only
    /// the spread scales (AVX2, which reads x itself).
    fn new(row: &'a Q8Row, kernel: Kernel) -> Self {
        let (mut magnitude, mut biased, mut negative) = (Vec::new(), Vec::new(), Vec::new());
        if kernel == Kernel::Vnni {
            biased = row.quants.iter().map(|&q| (q as u8) ^ 0x80).collect();
        } else if kernel == Kernel::Bw {
            magnitude = row.quants.iter().map(|q| q.unsigned_abs()).collect();
            negative = row
                .quants
                .chunks(64)
                .map(|c| {
                    c.iter()
                        .enumerate()
                        .fold(0u64, |m, (i, &q)| m | u64::from(q < 0) << i)
                })
                .collect();
        }
        let mut scales = Vec::with_capacity(8 * row.scales.len());
        for &s in &row.scales {
            scales.extend_from_slice(&[s; 8]);
        }
        Self {
            row,
            magnitude,
            biased,
            negative,
            scales,
        }
    }
}

/// [`dot_avx512`] of one weight row against four rows of x: the weights and their
/// scales loaded once for the four, x's side prepared once for all the weight rows.
/// Each lane's sum of four byte products is the same integer in both kernels (VNNI's
/// `vpdpbusd` on x + 128, or the sign trick's `vpmaddubsw` + `vpmaddwd`: a pair's sum
/// fits i16), and the scale products are dot_avx512's (w scale x x scale, each an f32
/// product): the sums are its sums to the bit.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/DQ; each row of x holds `ws.len()` blocks.
#[cfg(target_arch = "x86_64")]
unsafe fn dots_1x4(wq: &[i8], ws: &[f32], xs: [&Prepared; 4]) -> [f32; 4] {
    if super::isa::has_avx512_vnni() {
        dots_1x4_vnni(wq, ws, xs)
    } else {
        dots_1x4_bw(wq, ws, xs)
    }
}

/// The four sums of [`dots_1x4`]: each accumulator's lanes added as `dot_avx512` adds
/// them, and an odd last block through `dot_avx2`, as there.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx2,fma")]
unsafe fn finish_1x4(
    wq: &[i8],
    ws: &[f32],
    xs: [&Prepared; 4],
    acc: [std::arch::x86_64::__m512; 4],
    whole: usize,
) -> [f32; 4] {
    let mut sums = acc.map(|acc| std::arch::x86_64::_mm512_reduce_add_ps(acc));
    add_odd_block(wq, ws, xs, whole, &mut sums);
    sums
}

/// Adds to each of `sums` (one weight row against four rows of x) the products of the
/// blocks past `whole` (an odd last one, or none), through `dot_avx2` as `dot_avx512` does.
///
/// # Safety
/// The CPU must have AVX2 and FMA; each row of x holds `ws.len()` blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn add_odd_block(
    wq: &[i8],
    ws: &[f32],
    xs: [&Prepared; 4],
    whole: usize,
    sums: &mut [f32; 4],
) {
    let blocks = ws.len();
    if whole == blocks {
        return;
    }
    for (sum, x) in sums.iter_mut().zip(xs) {
        *sum += dot_avx2(
            &wq[whole * BLOCK..blocks * BLOCK],
            &ws[whole..],
            &x.row.quants[whole * BLOCK..blocks * BLOCK],
            &x.row.scales[whole..blocks],
        );
    }
}

/// [`dots_1x4`] with VNNI: `vpdpbusd` multiplies unsigned by signed bytes, so x goes
/// in as x + 128 and each lane starts from -128 x (its four weights' sum), worked out
/// once per weight block pair: Σ (x + 128) w - 128 Σ w = Σ x w, the same integers as
/// the sign trick, with no per-row sign work.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vnni,avx2,fma")]
unsafe fn dots_1x4_vnni(wq: &[i8], ws: &[f32], xs: [&Prepared; 4]) -> [f32; 4] {
    use std::arch::x86_64::*;
    let blocks = ws.len();
    debug_assert!(wq.len() >= blocks * BLOCK);
    debug_assert!(xs.iter().all(|x| x.biased.len() >= blocks * BLOCK));
    let bias = _mm512_set1_epi8(-128); // the byte 0x80: 128 as vpdpbusd's unsigned operand
    let zero = _mm512_setzero_si512();
    let mut acc = [_mm512_setzero_ps(); 4];
    let whole = blocks & !1;
    for b in (0..whole).step_by(2) {
        // Safety: every slice holds `blocks` whole blocks; b + 1 < blocks.
        let w = _mm512_loadu_si512(wq.as_ptr().add(b * BLOCK).cast());
        let start = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, bias, w));
        let w_scales = _mm512_insertf32x8(
            _mm512_set1_ps(*ws.get_unchecked(b)),
            _mm256_set1_ps(*ws.get_unchecked(b + 1)),
            1,
        );
        for (acc, x) in acc.iter_mut().zip(xs) {
            let biased = _mm512_loadu_si512(x.biased.as_ptr().add(b * BLOCK).cast());
            let quads = _mm512_dpbusd_epi32(start, biased, w);
            let scale = _mm512_mul_ps(w_scales, _mm512_loadu_ps(x.scales.as_ptr().add(8 * b)));
            *acc = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(quads), *acc);
        }
    }
    finish_1x4(wq, ws, xs, acc, whole)
}

/// [`dots_1x4_vnni`] for four weight rows at once (`[j][i]`: weight row j, x row i):
/// each weight row's start and scales worked out once for the four rows of x. x is
/// read where it is used (from L1): held instead in eight registers beside the sixteen
/// sums, it pushed sums out to the stack every step (a 16-row int8 pass 5-10% slower on
/// a Zen 5). Every lane takes the same steps as in `dots_1x4_vnni`, so the sums are its
/// sums to the bit.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vnni,avx2,fma")]
unsafe fn dots_4x4_vnni(w: [(&[i8], &[f32]); 4], xs: [&Prepared; 4]) -> [[f32; 4]; 4] {
    use std::arch::x86_64::*;
    let blocks = w[0].1.len();
    debug_assert!(w
        .iter()
        .all(|(q, s)| s.len() == blocks && q.len() >= blocks * BLOCK));
    debug_assert!(xs.iter().all(|x| x.biased.len() >= blocks * BLOCK));
    let bias = _mm512_set1_epi8(-128);
    let zero = _mm512_setzero_si512();
    let mut acc = [[_mm512_setzero_ps(); 4]; 4];
    let whole = blocks & !1;
    for b in (0..whole).step_by(2) {
        // Safety: every slice holds `blocks` whole blocks; b + 1 < blocks.
        for (acc, (wq, ws)) in acc.iter_mut().zip(w) {
            let w = _mm512_loadu_si512(wq.as_ptr().add(b * BLOCK).cast());
            let start = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, bias, w));
            let w_scales = _mm512_insertf32x8(
                _mm512_set1_ps(*ws.get_unchecked(b)),
                _mm256_set1_ps(*ws.get_unchecked(b + 1)),
                1,
            );
            for (acc, x) in acc.iter_mut().zip(xs) {
                let biased = _mm512_loadu_si512(x.biased.as_ptr().add(b * BLOCK).cast());
                let x_scales = _mm512_loadu_ps(x.scales.as_ptr().add(8 * b));
                let quads = _mm512_dpbusd_epi32(start, biased, w);
                let scale = _mm512_mul_ps(w_scales, x_scales);
                *acc = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(quads), *acc);
            }
        }
    }
    let mut sums = sums_4x4(acc);
    for (sums, (wq, ws)) in sums.iter_mut().zip(w) {
        add_odd_block(wq, ws, xs, whole, sums);
    }
    sums
}

/// [`dots_1x4`] without VNNI: |x| times w with x's sign (as in `dot_avx512`), the
/// byte products summed in pairs by `vpmaddubsw` and in fours by `vpmaddwd`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx2,fma")]
unsafe fn dots_1x4_bw(wq: &[i8], ws: &[f32], xs: [&Prepared; 4]) -> [f32; 4] {
    use std::arch::x86_64::*;
    let blocks = ws.len();
    debug_assert!(wq.len() >= blocks * BLOCK);
    debug_assert!(xs.iter().all(|x| x.magnitude.len() >= blocks * BLOCK));
    let (zero, ones) = (_mm512_setzero_si512(), _mm512_set1_epi16(1));
    let mut acc = [_mm512_setzero_ps(); 4];
    let whole = blocks & !1;
    for b in (0..whole).step_by(2) {
        // Safety: every slice holds `blocks` whole blocks; b + 1 < blocks.
        let w = _mm512_loadu_si512(wq.as_ptr().add(b * BLOCK).cast());
        let w_scales = _mm512_insertf32x8(
            _mm512_set1_ps(*ws.get_unchecked(b)),
            _mm256_set1_ps(*ws.get_unchecked(b + 1)),
            1,
        );
        for (acc, x) in acc.iter_mut().zip(xs) {
            let magnitude = _mm512_loadu_si512(x.magnitude.as_ptr().add(b * BLOCK).cast());
            let negative = *x.negative.get_unchecked(b / 2);
            let signed = _mm512_mask_sub_epi8(w, negative, zero, w);
            let quads = _mm512_madd_epi16(_mm512_maddubs_epi16(magnitude, signed), ones);
            let scale = _mm512_mul_ps(w_scales, _mm512_loadu_ps(x.scales.as_ptr().add(8 * b)));
            *acc = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(quads), *acc);
        }
    }
    finish_1x4(wq, ws, xs, acc, whole)
}

/// [`dot_avx2`] of one weight row against four rows of x: each weight block loaded,
/// its magnitudes taken and its scale spread once for the four, x's scales spread once
/// for all the weight rows (`Prepared`). The sign trick turned round, |w| times x with
/// w's sign, gives the same pair sums as dot_avx2's |x| times w with x's sign; the
/// scales are the same f32 products, added in its order: its sums to the bit.
///
/// # Safety
/// The CPU must have AVX2 and FMA; each row of x holds `ws.len()` blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dots_1x4_avx2(wq: &[i8], ws: &[f32], xs: [&Prepared; 4]) -> [f32; 4] {
    use std::arch::x86_64::*;
    let blocks = ws.len();
    debug_assert!(wq.len() >= blocks * BLOCK);
    debug_assert!(xs.iter().all(|x| x.scales.len() >= 8 * blocks));
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); 4];
    for b in 0..blocks {
        // Safety: every slice holds `blocks` whole blocks.
        let w = _mm256_loadu_si256(wq.as_ptr().add(b * BLOCK).cast());
        let magnitude = _mm256_sign_epi8(w, w);
        let w_scale = _mm256_set1_ps(*ws.get_unchecked(b));
        for (acc, x) in acc.iter_mut().zip(xs) {
            let values = _mm256_loadu_si256(x.row.quants.as_ptr().add(b * BLOCK).cast());
            let signed = _mm256_sign_epi8(values, w);
            let quads = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed), ones);
            let scale = _mm256_mul_ps(w_scale, _mm256_loadu_ps(x.scales.as_ptr().add(8 * b)));
            *acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(quads), *acc);
        }
    }
    let mut sums = [0f32; 4];
    for (sum, acc) in sums.iter_mut().zip(acc) {
        *sum = lanes_sum_avx2(acc);
    }
    sums
}

/// The blocks' exact integer sums, scaled and added in block order.
pub fn dot_portable(wq: &[i8], ws: &[f32], xq: &[i8], xs: &[f32]) -> f32 {
    let mut sum = 0f32;
    for (b, (w, x)) in wq
        .chunks_exact(BLOCK)
        .zip(xq.chunks_exact(BLOCK))
        .enumerate()
    {
        let block: i32 = w
            .iter()
            .zip(x)
            .map(|(&w, &x)| i32::from(w) * i32::from(x))
            .sum();
        sum += ws[b] * xs[b] * block as f32;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(wq: &[i8], ws: &[f32], xq: &[i8], xs: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let blocks = ws.len();
    debug_assert!(wq.len() >= blocks * BLOCK && xq.len() >= blocks * BLOCK && xs.len() >= blocks);
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    for b in 0..blocks {
        // Safety: each slice holds `blocks` whole blocks (asserted above in debug, by
        // construction in every caller).
        let w = _mm256_loadu_si256(wq.as_ptr().add(b * BLOCK).cast());
        let x = _mm256_loadu_si256(xq.as_ptr().add(b * BLOCK).cast());
        // vpmaddubsw multiplies unsigned by signed bytes: |x| times w with x's sign.
        // Values lie in -127..=127, so a pair's sum (at most 2 x 127 x 127) fits i16.
        let magnitude = _mm256_sign_epi8(x, x);
        let signed = _mm256_sign_epi8(w, x);
        let pairs = _mm256_maddubs_epi16(magnitude, signed);
        let quads = _mm256_madd_epi16(pairs, ones);
        let scale = _mm256_set1_ps(*ws.get_unchecked(b) * *xs.get_unchecked(b));
        acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(quads), acc);
    }
    lanes_sum_avx2(acc)
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

    /// Four rows of x, `cols` wide, quantized (seeds `seed`..`seed + 4`).
    #[cfg(target_arch = "x86_64")]
    fn rows_of_x(cols: usize, seed: u32) -> Vec<Q8Row> {
        (0..4)
            .map(|r| {
                let mut row = Q8Row::default();
                row.quantize(&values(cols, seed + r));
                row
            })
            .collect()
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    #[test]
    fn quantizing_keeps_each_value_within_half_a_step() {
        let (rows, cols) = (3, 70); // 3 blocks a row, the last one short
        let w = values(rows * cols, 1);
        let q = Q8Matrix::quantize(&w, rows, cols);
        assert_eq!(q.bytes(), rows * 3 * BLOCK + 4 * rows * 3);
        let mut back = vec![0f32; cols];
        for r in 0..rows {
            q.row_into(r, &mut back);
            for (i, (&a, &b)) in w[r * cols..(r + 1) * cols].iter().zip(&back).enumerate() {
                let step = q.scales[r * 3 + i / BLOCK];
                assert!(
                    (a - b).abs() <= 0.5 * step + 1e-7,
                    "{a} vs {b} (step {step})"
                );
            }
        }
        // The largest magnitude of a block is exact: 127 steps.
        let peak = Q8Matrix::quantize(&[0.0, -2.0, 1.0, 0.5], 1, 4);
        let mut back = [0f32; 4];
        peak.row_into(0, &mut back);
        assert_eq!(back[1], -2.0);
        assert_eq!(*Q8Matrix::quantize(&[0.0; 4], 1, 4).scales, [0.0]);
    }

    /// AVX2's four-row kernel gives `dot_avx2`'s sums to the bit.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn four_rows_at_once_on_avx2_give_each_rows_own_sums() {
        use std::arch::is_x86_feature_detected as has;
        if !(has!("avx2") && has!("fma")) {
            eprintln!("SKIPPED: the AVX2 four-row int8 kernel (no AVX2 here)");
            return;
        }
        let cols = 7 * BLOCK;
        let q = Q8Matrix::quantize(&values(3 * cols, 6), 3, cols);
        let xs = rows_of_x(cols, 30);
        let prepared: Vec<Prepared> = xs.iter().map(|x| Prepared::new(x, Kernel::Avx2)).collect();
        for o in 0..3 {
            let (wq, ws) = q.row(o);
            // Safety: AVX2 and FMA checked above; whole blocks throughout.
            let want: Vec<f32> = xs
                .iter()
                .map(|x| unsafe { dot_avx2(wq, ws, &x.quants, &x.scales) })
                .collect();
            let got = unsafe { dots_1x4_avx2(wq, ws, quads(&prepared)) };
            assert_eq!(got.to_vec(), want, "weight row {o}");
        }
    }

    /// Both four-row kernels (with and without VNNI, where the CPU has them) give
    /// `dot_avx512`'s sums to the bit, with an odd last block; four weight rows at
    /// once too.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn four_rows_at_once_give_each_rows_own_sums() {
        use std::arch::is_x86_feature_detected as has;
        if !(has!("avx512f") && has!("avx512bw") && has!("avx512dq")) {
            eprintln!("SKIPPED: the AVX-512 four-row int8 kernels (no AVX-512 here)");
            return;
        }
        let cols = 7 * BLOCK;
        let q = Q8Matrix::quantize(&values(4 * cols, 5), 4, cols);
        let xs = rows_of_x(cols, 20);
        let prepare =
            |kernel| -> Vec<Prepared> { xs.iter().map(|x| Prepared::new(x, kernel)).collect() };
        let (bw, vnni) = (prepare(Kernel::Bw), prepare(Kernel::Vnni));
        // Safety: AVX-512 F/BW/DQ checked above; whole blocks throughout.
        let want: Vec<Vec<f32>> = (0..4)
            .map(|o| {
                let (wq, ws) = q.row(o);
                xs.iter()
                    .map(|x| unsafe { dot_avx512(wq, ws, &x.quants, &x.scales) })
                    .collect()
            })
            .collect();
        for (o, want) in want.iter().enumerate() {
            let (wq, ws) = q.row(o);
            assert_eq!(unsafe { dots_1x4_bw(wq, ws, quads(&bw)) }.to_vec(), *want);
        }
        if !has!("avx512vnni") {
            eprintln!("SKIPPED: the VNNI four-row int8 kernels (no AVX-512 VNNI here)");
            return;
        }
        for (o, want) in want.iter().enumerate() {
            let (wq, ws) = q.row(o);
            assert_eq!(
                unsafe { dots_1x4_vnni(wq, ws, quads(&vnni)) }.to_vec(),
                *want
            );
        }
        let tile = unsafe { dots_4x4_vnni([0, 1, 2, 3].map(|o| q.row(o)), quads(&vnni)) };
        for (got, want) in tile.iter().zip(&want) {
            assert_eq!(got.to_vec(), *want, "the 4 x 4 tile");
        }
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

    /// The first four of `rows`, as the four-row kernels take them.
    #[cfg(target_arch = "x86_64")]
    fn quads<'p, 'x>(rows: &'p [Prepared<'x>]) -> [&'p Prepared<'x>; 4] {
        [&rows[0], &rows[1], &rows[2], &rows[3]]
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
            .map(|i| f64::from(qx.quants[i]) * f64::from(qx.scales[i / BLOCK]))
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
