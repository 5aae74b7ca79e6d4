//! Products that read each weight row once for a few rows of activations: decoding's
//! mat-vecs (one row per sequence) and short prompts (a few rows per sequence).
//!
//! A GEMM packs its operands into panels before multiplying, which pays when each
//! weight meets hundreds of rows; for a handful the packing is a second pass over
//! every weight, and reading the weights is all the time there is. Here weight rows
//! are read four at a time, widened to f32 if held in bf16, and multiplied into the
//! activation rows while they sit in registers and L1: one activation row against four
//! weight rows streamed side by side and asked for ahead (decoding, bound by memory),
//! blocks of four activation rows against them (prompts, bound by the FMA units: in
//! AVX-512 registers where the CPU has them). Whole groups of sixteen rows (a server's
//! batch) with f32 weights go the other way round on AVX2 and AVX-512: x transposed
//! into vectors of the sixteen rows' values at one k, each weight broadcast against
//! them, no horizontal sums; at the AVX2 level bf16 weights go that way too, widened
//! to f32 a tile of weight rows at a time (`TileRows`). Sums are f32 in 16
//! lanes a row; a weight is the same f32 whichever kernel widens it.

use rayon::prelude::*;

pub use super::bf16::Bf16;
use super::kernels::{fold16, multiversion, prefetch, Widen, AHEAD_BYTES};
use super::team::for_each_piece;
use super::threads::threads;

/// A weight as stored, widened to f32 on load, and the kernels that read it so.
pub trait Weight: Widen {
    /// Σ_i w_j[i] x[i] for four weight rows and one row x (see [`dots4x1`]).
    #[inline(always)]
    fn dots4x1(w: [&[Self]; 4], x: &[f32]) -> [f32; 4] {
        dots4x1(w, x)
    }

    /// 16 weights from `p`, widened, in one AVX-512 register.
    ///
    /// # Safety
    /// `p` must point at 16 weights; the CPU must have AVX-512 F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;

    /// `w` as f32: itself, or widened into `scratch`.
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[cfg(target_arch = "x86_64")]
    unsafe fn as_f32<'a>(w: &'a [Self], scratch: &'a mut Vec<f32>) -> &'a [f32];
}

impl Weight for f32 {
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn as_f32<'a>(w: &'a [f32], _: &'a mut Vec<f32>) -> &'a [f32] {
        w
    }
}

impl Weight for Bf16 {
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const Bf16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(bits))
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn as_f32<'a>(w: &'a [Bf16], scratch: &'a mut Vec<f32>) -> &'a [f32] {
        scratch.resize(w.len(), 0.0);
        widen_avx2(w, scratch);
        scratch
    }

    /// Two weights a 32-bit word: the odd one is already an f32 once the even one's
    /// bits are masked off, the even one is the word shifted up, so a pair widens in
    /// two integer ops (widening each weight alone made this product bound by its
    /// shuffles, not by memory). x is split into its even and odd elements once per
    /// step, for all four rows.
    #[inline(always)]
    fn dots4x1(w: [&[Self]; 4], x: &[f32]) -> [f32; 4] {
        if cfg!(target_endian = "big") {
            return dots4x1(w, x); // the word trick reads the first weight as the low half
        }
        const PAIRS: usize = 16;
        let ahead = AHEAD_BYTES / 2;
        let n = x.len() / (2 * PAIRS) * (2 * PAIRS);
        let mut even = [[0f32; PAIRS]; 4];
        let mut odd = [[0f32; PAIRS]; 4];
        for i in (0..n).step_by(2 * PAIRS) {
            let xs = &x[i..i + 2 * PAIRS];
            let xe: [f32; PAIRS] = std::array::from_fn(|k| xs[2 * k]);
            let xo: [f32; PAIRS] = std::array::from_fn(|k| xs[2 * k + 1]);
            for r in 0..4 {
                prefetch(w[r].as_ptr().wrapping_add(i + ahead));
                let ws = &w[r][i..i + 2 * PAIRS];
                for k in 0..PAIRS {
                    // Safety: `ws` holds 2 PAIRS weights, so words 0..PAIRS are in it.
                    let word = unsafe { ws.as_ptr().cast::<u32>().add(k).read_unaligned() };
                    even[r][k] += f32::from_bits(word << 16) * xe[k];
                    odd[r][k] += f32::from_bits(word & 0xffff_0000) * xo[k];
                }
            }
        }
        let mut sums = [0f32; 4];
        for r in 0..4 {
            let lanes: [f32; 16] = std::array::from_fn(|k| even[r][k] + odd[r][k]);
            sums[r] = fold16(lanes);
            for i in n..x.len() {
                sums[r] += w[r][i].widen() * x[i];
            }
        }
        sums
    }
}

/// out[i] = w[i] widened to f32, eight at a time.
///
/// # Safety
/// The CPU must have AVX2; out is as long as w.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn widen_avx2(w: &[Bf16], out: &mut [f32]) {
    use std::arch::x86_64::*;
    debug_assert_eq!(w.len(), out.len());
    let whole = w.len() / 8 * 8;
    for i in (0..whole).step_by(8) {
        // Safety: i + 8 <= whole, in both.
        let bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(w.as_ptr().add(i).cast()));
        _mm256_storeu_ps(
            out.as_mut_ptr().add(i),
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(bits)),
        );
    }
    for i in whole..w.len() {
        out[i] = w[i].widen();
    }
}

/// Weight rows as [`sixteen_rows`] reads them: f32 where they lie, other formats
/// widened to f32 a tile at a time into L1, where the tile then serves every group of
/// sixteen rows of x (a weight costs a sixteenth of a widening beside its sixteen
/// multiply-adds).
#[cfg(target_arch = "x86_64")]
pub(crate) trait TileRows: Sync {
    /// The weight rows (outputs) of d_in values.
    fn outputs(&self, d_in: usize) -> usize;

    /// Rows o..o + n as f32: in place, or widened into `scratch`.
    ///
    /// # Safety
    /// The CPU must have AVX2; o + n <= the outputs.
    unsafe fn tile<'a>(
        &'a self,
        o: usize,
        n: usize,
        d_in: usize,
        scratch: &'a mut Vec<f32>,
    ) -> &'a [f32];

    /// Where row o's stored values lie, to be asked for ahead of their use.
    fn stored_from(&self, o: usize, d_in: usize) -> Ahead;
}

/// Weight rows as stored (f32 or bf16): read in place, or widened whole.
#[cfg(target_arch = "x86_64")]
impl<W: Weight> TileRows for [W] {
    fn outputs(&self, d_in: usize) -> usize {
        self.len() / d_in
    }

    unsafe fn tile<'a>(
        &'a self,
        o: usize,
        n: usize,
        d_in: usize,
        scratch: &'a mut Vec<f32>,
    ) -> &'a [f32] {
        W::as_f32(&self[o * d_in..(o + n) * d_in], scratch)
    }

    fn stored_from(&self, o: usize, d_in: usize) -> Ahead {
        let size = std::mem::size_of::<W>();
        Ahead::rows(self.as_ptr().wrapping_add(o * d_in), size * d_in, 64 / size)
    }
}

/// Partial sums a row of the portable kernels keeps (the compiler holds them in vector
/// registers); also the rows of x [`sixteen_rows`] takes at once: an AVX-512
/// vector's lanes, two AVX2 vectors'.
const LANES: usize = 16;

/// Σ_i w[i] x_r[i] for the four rows x_r, in `LANES` partial sums each.
#[inline(always)]
fn dots4<W: Weight>(w: &[W], x: [&[f32]; 4]) -> [f32; 4] {
    let n = w.len() / LANES * LANES;
    let mut acc = [[0f32; LANES]; 4];
    let chunks = w[..n]
        .chunks_exact(LANES)
        .zip(x[0][..n].chunks_exact(LANES))
        .zip(x[1][..n].chunks_exact(LANES))
        .zip(x[2][..n].chunks_exact(LANES))
        .zip(x[3][..n].chunks_exact(LANES));
    for ((((w, x0), x1), x2), x3) in chunks {
        for k in 0..LANES {
            let wk = w[k].widen();
            acc[0][k] += wk * x0[k];
            acc[1][k] += wk * x1[k];
            acc[2][k] += wk * x2[k];
            acc[3][k] += wk * x3[k];
        }
    }
    let mut sums = [0f32; 4];
    for (sum, (acc, x)) in sums.iter_mut().zip(acc.iter().zip(x)) {
        for v in acc {
            *sum += v;
        }
        for i in n..w.len() {
            *sum += w[i].widen() * x[i];
        }
    }
    sums
}

/// Σ_i w_j[i] x_r[i] for four weight rows w_j and four rows x_r in AVX-512 registers:
/// sixteen sums, each step four weight loads and four activation loads for sixteen
/// fused multiply-adds. A prompt's rows meet each weight many times, so this is
/// bound by the FMA units; the portable [`dots2x4`] compiles to separate multiplies
/// and adds in half-width registers there (a 16-token prompt on GPT-2 124M: 66 ms).
///
/// # Safety
/// The CPU must have AVX-512 F; the rows must be of equal length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn dots4x4_avx512<W: Weight>(w: [&[W]; 4], x: [&[f32]; 4]) -> [[f32; 4]; 4] {
    use std::arch::x86_64::*;
    let len = x[0].len();
    debug_assert!(w.iter().all(|w| w.len() == len) && x.iter().all(|x| x.len() == len));
    let n = len / 16 * 16;
    let ahead = AHEAD_BYTES / std::mem::size_of::<W>();
    let mut acc = [[_mm512_setzero_ps(); 4]; 4];
    for i in (0..n).step_by(16) {
        // Safety: i + 16 <= n <= each row's length.
        let xs = [0, 1, 2, 3].map(|r| _mm512_loadu_ps(x[r].as_ptr().add(i)));
        for j in 0..4 {
            prefetch(w[j].as_ptr().wrapping_add(i + ahead));
            let wj = W::load16(w[j].as_ptr().add(i));
            for r in 0..4 {
                acc[j][r] = _mm512_fmadd_ps(wj, xs[r], acc[j][r]);
            }
        }
    }
    let mut sums = [[0f32; 4]; 4];
    for j in 0..4 {
        for r in 0..4 {
            let mut sum = _mm512_reduce_add_ps(acc[j][r]);
            for i in n..len {
                sum += w[j][i].widen() * x[r][i];
            }
            sums[j][r] = sum;
        }
    }
    sums
}

/// Σ_i w_j[i] x_r[i] for two weight rows w_j and four rows x_r: eight sums from each
/// six loads (two weights, four activations), which keeps the FMA units busy where
/// one weight row at a time would wait on loads.
#[inline(always)]
fn dots2x4<W: Weight>(w: [&[W]; 2], x: [&[f32]; 4]) -> [[f32; 4]; 2] {
    const L: usize = 8;
    let n = w[0].len() / L * L;
    let mut acc = [[[0f32; L]; 4]; 2];
    let chunks = w[0][..n]
        .chunks_exact(L)
        .zip(w[1][..n].chunks_exact(L))
        .zip(x[0][..n].chunks_exact(L))
        .zip(x[1][..n].chunks_exact(L))
        .zip(x[2][..n].chunks_exact(L))
        .zip(x[3][..n].chunks_exact(L));
    for (((((w0, w1), x0), x1), x2), x3) in chunks {
        for k in 0..L {
            let (a, b) = (w0[k].widen(), w1[k].widen());
            acc[0][0][k] += a * x0[k];
            acc[0][1][k] += a * x1[k];
            acc[0][2][k] += a * x2[k];
            acc[0][3][k] += a * x3[k];
            acc[1][0][k] += b * x0[k];
            acc[1][1][k] += b * x1[k];
            acc[1][2][k] += b * x2[k];
            acc[1][3][k] += b * x3[k];
        }
    }
    let mut sums = [[0f32; 4]; 2];
    for j in 0..2 {
        for r in 0..4 {
            let mut sum = 0f32;
            for v in acc[j][r] {
                sum += v;
            }
            for i in n..w[j].len() {
                sum += w[j][i].widen() * x[r][i];
            }
            sums[j][r] = sum;
        }
    }
    sums
}

/// Σ_i w[i] x[i], in `LANES` partial sums.
#[inline(always)]
fn dot1<W: Weight>(w: &[W], x: &[f32]) -> f32 {
    // Twice the lanes of the blocked kernels: one row is bound by its loads' latency,
    // so more independent sums in flight (four AVX2 registers; measured 8% faster).
    const LANES: usize = 32;
    let n = w.len() / LANES * LANES;
    let mut acc = [0f32; LANES];
    for (w, x) in w[..n].chunks_exact(LANES).zip(x[..n].chunks_exact(LANES)) {
        for k in 0..LANES {
            acc[k] += w[k].widen() * x[k];
        }
    }
    let mut sum = 0f32;
    for v in acc {
        sum += v;
    }
    for i in n..w.len() {
        sum += w[i].widen() * x[i];
    }
    sum
}

/// Σ_i w_j[i] x[i] for four weight rows w_j and one row x: the mat-vec of decoding.
/// One row's sums would wait on memory; four rows streamed side by side, each asked
/// for `AHEAD_BYTES` ahead, keep the loads in flight.
#[inline(always)]
fn dots4x1<W: Weight>(w: [&[W]; 4], x: &[f32]) -> [f32; 4] {
    const L: usize = 16;
    let ahead = AHEAD_BYTES / std::mem::size_of::<W>();
    let n = x.len() / L * L;
    let mut acc = [[0f32; L]; 4];
    for i in (0..n).step_by(L) {
        let xs = &x[i..i + L];
        for r in 0..4 {
            prefetch(w[r].as_ptr().wrapping_add(i + ahead));
            let ws = &w[r][i..i + L];
            for k in 0..L {
                acc[r][k] += ws[k].widen() * xs[k];
            }
        }
    }
    let mut sums = [0f32; 4];
    for ((sum, acc), w) in sums.iter_mut().zip(acc).zip(w) {
        *sum = fold16(acc);
        for i in n..x.len() {
            *sum += w[i].widen() * x[i];
        }
    }
    sums
}

multiversion! {
    /// out (rows, len) = x (rows, d_in) · w (len, d_in)ᵀ (+ bias), f32 weights.
    pub fn rows_f32(w: &[f32], bias: Option<&[f32]>, x: &[f32], d_in: usize, out: &mut [f32]) {
        product(w, bias, x, d_in, out)
    }
}

multiversion! {
    /// out (rows, len) = x (rows, d_in) · w (len, d_in)ᵀ (+ bias), bf16 weights.
    pub fn rows_bf16(w: &[Bf16], bias: Option<&[f32]>, x: &[f32], d_in: usize, out: &mut [f32]) {
        product(w, bias, x, d_in, out)
    }
}

/// The body of `rows_f32` and `rows_bf16`: four weight rows at a time, against the
/// rows of x in blocks of four (two pairs of weight rows each) and then the rest one
/// by one, while the four weight rows are in L1; the last few weight rows alone.
#[inline(always)]
fn product<W: Weight>(w: &[W], bias: Option<&[f32]>, x: &[f32], d_in: usize, out: &mut [f32]) {
    let len = w.len() / d_in;
    let rows = x.len() / d_in;
    debug_assert_eq!(out.len(), rows * len);
    let row = |r: usize| &x[r * d_in..(r + 1) * d_in];
    let weights = |o: usize| &w[o * d_in..(o + 1) * d_in];
    let bias = |o: usize| bias.map_or(0.0, |b| b[o]);
    let (quads, blocks) = (len / 4 * 4, rows / 4 * 4);
    // The blocks of rows in AVX-512 registers where the CPU has them.
    let avx512 = cfg!(target_arch = "x86_64") && super::isa::active() >= super::isa::Isa::Avx512;
    for o in (0..quads).step_by(4) {
        #[cfg(target_arch = "x86_64")]
        if avx512 {
            let four = [weights(o), weights(o + 1), weights(o + 2), weights(o + 3)];
            for r in (0..blocks).step_by(4) {
                // Safety: checked just above that the CPU has AVX-512; equal rows.
                let sums =
                    unsafe { dots4x4_avx512(four, [row(r), row(r + 1), row(r + 2), row(r + 3)]) };
                for (j, sums) in sums.into_iter().enumerate() {
                    for (i, s) in sums.into_iter().enumerate() {
                        out[(r + i) * len + o + j] = s + bias(o + j);
                    }
                }
            }
        }
        for o in [o, o + 2].into_iter().filter(|_| !avx512) {
            for r in (0..blocks).step_by(4) {
                let sums = dots2x4(
                    [weights(o), weights(o + 1)],
                    [row(r), row(r + 1), row(r + 2), row(r + 3)],
                );
                for (j, sums) in sums.into_iter().enumerate() {
                    for (i, s) in sums.into_iter().enumerate() {
                        out[(r + i) * len + o + j] = s + bias(o + j);
                    }
                }
            }
        }
        for r in blocks..rows {
            let four = [weights(o), weights(o + 1), weights(o + 2), weights(o + 3)];
            for (j, s) in W::dots4x1(four, row(r)).into_iter().enumerate() {
                out[r * len + o + j] = s + bias(o + j);
            }
        }
    }
    for o in quads..len {
        let mut r = 0;
        while r + 4 <= rows {
            let sums = dots4(weights(o), [row(r), row(r + 1), row(r + 2), row(r + 3)]);
            for (i, s) in sums.into_iter().enumerate() {
                out[(r + i) * len + o] = s + bias(o);
            }
            r += 4;
        }
        for r in r..rows {
            out[r * len + o] = dot1(weights(o), row(r)) + bias(o);
        }
    }
}

/// A weight matrix held as `W`, (d_out, d_in) row-major, multiplied into a few rows at
/// a time.
pub trait RowProduct: Weight {
    fn rows_kernel(w: &[Self], bias: Option<&[f32]>, x: &[f32], d_in: usize, out: &mut [f32]);
}

impl RowProduct for f32 {
    fn rows_kernel(w: &[f32], bias: Option<&[f32]>, x: &[f32], d_in: usize, out: &mut [f32]) {
        // From 8 rows on, groups of sixteen rows by broadcasts where the CPU has AVX2 or
        // AVX-512 (the last group padded); fewer rows (and every row elsewhere) four
        // weight rows at a time.
        #[cfg(target_arch = "x86_64")]
        let done = sixteen_row_groups(w, bias, x, d_in, out);
        #[cfg(not(target_arch = "x86_64"))]
        let done = 0;
        if x.len() == d_in && super::matvec::order::<Self>() == super::matvec::Order::InAddressOrder
        {
            return <Self as super::matvec::MatVec>::matvec(w, bias, x, out);
        }
        let len = w.len() / d_in;
        rows_f32(w, bias, &x[done * d_in..], d_in, &mut out[done * len..])
    }
}

/// Every row of x through [`sixteen_rows`], in groups of sixteen (the last padded),
/// where the CPU has AVX2 or AVX-512 and x has [`PADDED_MIN_ROWS`] rows or more; the
/// rows done (all or none).
#[cfg(target_arch = "x86_64")]
pub(crate) fn sixteen_row_groups<T: TileRows + ?Sized>(
    w: &T,
    bias: Option<&[f32]>,
    x: &[f32],
    d_in: usize,
    out: &mut [f32],
) -> usize {
    let level = super::isa::active();
    if level < super::isa::Isa::Avx2 {
        return 0;
    }
    let len = w.outputs(d_in);
    let rows = x.len() / d_in;
    if rows < PADDED_MIN_ROWS {
        return 0;
    }
    let done = rows;
    let rows = groups_at_once(d_in) * LANES;
    for (x, out) in x[..done * d_in]
        .chunks(rows * d_in)
        .zip(out[..done * len].chunks_mut(rows * len))
    {
        // Safety: the CPU has the level (checked just above); the shapes agree.
        unsafe { sixteen_rows(level, w, bias, x, d_in, out) };
    }
    done
}

/// From this many rows on, every row goes through [`sixteen_rows`], the last group's
/// missing rows zeros (their sums dropped): a server's pass of 15 or 17 rows otherwise
/// took its rest four by four (`dots4x4_avx512`) or, after the whole groups, in a
/// second sweep over the weights. GPT-2 f32, Zen 5, 2 threads, `bench --decode-batch
/// N`, twice interleaved: 12 rows 650-657 -> 735-741 tokens/s, 15 rows 643-645 -> 833,
/// 17 rows 595-602 -> 648-662, 8 rows level. Fewer rows gain 3-8% too, but keep the
/// dot products' bits, which a few samples decoded together share with each decoded
/// alone.
pub const PADDED_MIN_ROWS: usize = 8;

/// Groups of sixteen rows [`sixteen_rows`] takes through each tile of weight rows
/// before the next tile: as many as keep x transposed within 512 KiB (of L2). One group
/// at a time, a prompt of 256 rows read every weight from memory sixteen times (GPT-2,
/// Zen 5, first token of 64 / 128 / 256 tokens: 38-44 / 71-72 / 139-142 ms -> 35 / 66 /
/// 132-136; 128 to 1,024 KiB within a few percent of each other).
#[cfg(target_arch = "x86_64")]
fn groups_at_once(d_in: usize) -> usize {
    const TRANSPOSED_BYTES: usize = 512 << 10;
    (TRANSPOSED_BYTES / (LANES * d_in.max(1) * 4)).max(1)
}

/// Weight rows (outputs) a tile of [`sixteen_rows`] keeps in registers at once: on
/// AVX-512 twelve vectors of sixteen sums, addressed from four base registers and the
/// row stride ([`twelve_rows`]); on AVX2 six pairs of eight ([`six_rows`]).
#[cfg(target_arch = "x86_64")]
const TILE: usize = 12;
#[cfg(target_arch = "x86_64")]
const TILE_AVX2: usize = 6;

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// x transposed for [`sixteen_rows`], kept between calls.
    static TRANSPOSED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// A tile of weight rows widened to f32 for [`by_tiles`], kept between calls (a
    /// decoding pass makes dozens).
    static WIDENED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// out (rows, len) = x (rows, d_in) · w (len, d_in)ᵀ (+ bias), f32 weights, for g
/// groups of sixteen rows (a server's batch, a prompt; the last group may be short,
/// its missing rows zeros whose sums are dropped): each group's x transposed so
/// that a vector holds its sixteen rows' values at one k (one AVX-512 vector, two AVX2
/// ones), and each weight broadcast against it into a vector of sixteen sums. No
/// horizontal sums, and on AVX-512 the broadcast folds into the FMA's load: each k
/// costs one load of x and one FMA per weight row, where four by four dot products
/// (`dots4x4_avx512`) pay two loads per four FMAs and a reduction per sum. Weight rows
/// go a tile at a time through every group, the next tile asked for meanwhile. Each
/// sum runs along k in one lane (a different order from the dot products' lanes: f32
/// rounding differs between the two, within the same bound), whatever the groups
/// beside it.
///
/// # Safety
/// The CPU must have `level` (AVX2 or above); x holds rows of d_in (16 g, or fewer: the
/// last group padded with zeros), out as many rows of len.
#[cfg(target_arch = "x86_64")]
unsafe fn sixteen_rows<T: TileRows + ?Sized>(
    level: super::isa::Isa,
    w: &T,
    bias: Option<&[f32]>,
    x: &[f32],
    d_in: usize,
    out: &mut [f32],
) {
    let len = w.outputs(d_in);
    let groups = (x.len() / d_in).div_ceil(LANES);
    debug_assert!(x.len().is_multiple_of(d_in) && out.len() == x.len() / d_in * len);
    TRANSPOSED.with(|xt| {
        let xt = &mut *xt.borrow_mut();
        // Every lane is written below (a short group's missing rows as zeros), so a
        // longer buffer from an earlier call is reused as it is, not cleared.
        xt.resize(xt.len().max(groups * LANES * d_in), 0.0);
        let xt = &mut xt[..groups * LANES * d_in];
        for (xt, x) in xt
            .chunks_exact_mut(LANES * d_in)
            .zip(x.chunks(LANES * d_in))
        {
            transpose_group(x, d_in, xt);
        }
        let xt = &*xt;
        let xt = |g: usize| &xt[g * LANES * d_in..(g + 1) * LANES * d_in];
        let shape = (d_in, len, groups);
        // Safety (all four kernels): the level is the CPU's; the rows hold a tile's
        // d_in values each, xt d_in vectors. The vectors are reinterpreted as lanes.
        if level >= super::isa::Isa::Avx512 {
            by_tiles::<T, TILE>(
                w,
                shape,
                (out, bias),
                |rows, g, ahead| std::mem::transmute(tile_avx512(rows, 0, d_in, xt(g), ahead)),
                |row, g| std::mem::transmute(row_avx512(row, xt(g))),
            );
        } else {
            by_tiles::<T, TILE_AVX2>(
                w,
                shape,
                (out, bias),
                |rows, g, ahead| std::mem::transmute(tile_avx2(rows, 0, d_in, xt(g), ahead)),
                |row, g| std::mem::transmute(row_avx2(row, xt(g))),
            );
        }
    })
}

/// xt[k LANES + r] = x[r d_in + k] for the (up to) sixteen rows of one group, zeros in
/// the lanes of rows it lacks; sixteen k at a time so that each block's stores fill the
/// same sixteen lines of xt while they are in L1 (row by row, each row's stores met
/// d_in lines of xt, which at d_in 3,072 are 192 KiB: with the zeroing of all of xt
/// before it, 5.2% of a sixteen-row pass's samples; blocked, over the buffer as left,
/// 3.0%).
#[cfg(target_arch = "x86_64")]
fn transpose_group(x: &[f32], d_in: usize, xt: &mut [f32]) {
    const K: usize = 16;
    let rows = x.len() / d_in;
    for k0 in (0..d_in).step_by(K) {
        let ks = k0..(k0 + K).min(d_in);
        for r in 0..rows {
            for (k, &v) in ks.clone().zip(&x[r * d_in + ks.start..r * d_in + ks.end]) {
                xt[k * LANES + r] = v;
            }
        }
        for k in ks {
            xt[k * LANES + rows..(k + 1) * LANES].fill(0.0);
        }
    }
}

/// The outputs of [`sixteen_rows`] N at a time: each tile's weight rows as f32
/// ([`TileRows::tile`]: widened once for all the groups) through `tile(the rows,
/// group, the next tile to ask for)` for each group of sixteen rows, the last few rows
/// one at a time through `one(row, group)`, written into out (rows of len) with the
/// bias.
///
/// # Safety
/// The CPU must have AVX2; w holds len rows of d_in.
#[cfg(target_arch = "x86_64")]
unsafe fn by_tiles<T: TileRows + ?Sized, const N: usize>(
    w: &T,
    (d_in, len, groups): (usize, usize, usize),
    (out, bias): (&mut [f32], Option<&[f32]>),
    tile: impl Fn(&[f32], usize, Option<Ahead>) -> [[f32; LANES]; N],
    one: impl Fn(&[f32], usize) -> [f32; LANES],
) {
    WIDENED.with_borrow_mut(|widened| {
        let tiled = len / N * N;
        for o in (0..tiled).step_by(N) {
            let rows = w.tile(o, N, d_in, widened);
            for (g, out) in out.chunks_mut(LANES * len).take(groups).enumerate() {
                // The next tile, as stored, asked for while the first group multiplies
                // this one (read from memory if f32, widened into L1 if not).
                let ahead = (g == 0 && o + N < tiled).then(|| w.stored_from(o + N, d_in));
                put(out, len, o, &tile(rows, g, ahead), bias);
            }
        }
        for o in tiled..len {
            let row = w.tile(o, 1, d_in, widened);
            for (g, out) in out.chunks_mut(LANES * len).take(groups).enumerate() {
                put(out, len, o, &[one(row, g)], bias);
            }
        }
    })
}

/// Weight rows o..o+TILE against the sixteen rows of x transposed (`xt`): TILE
/// vectors of sixteen sums (lane r: row r of x), the rows of `ahead` asked for
/// meanwhile.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512(
    w: &[f32],
    o: usize,
    d_in: usize,
    xt: &[f32],
    ahead: Option<Ahead>,
) -> [std::arch::x86_64::__m512; TILE] {
    use std::arch::x86_64::*;
    debug_assert!((o + TILE) * d_in <= w.len() && xt.len() == LANES * d_in);
    let first = w.as_ptr().add(o * d_in);
    let mut acc = [_mm512_setzero_ps(); TILE];
    by_lines(TILE, d_in, ahead, |k0, steps| {
        // Safety: the rows hold d_in values from `first` on, xt d_in vectors.
        let x = xt.as_ptr().add(k0 * LANES);
        twelve_rows(first.add(k0), 4 * d_in, x, steps, &mut acc)
    });
    acc
}

/// Where the next tile of weight rows lies, as stored, to be asked for while a tile is
/// multiplied: row j at `first + j row_bytes`, a cache line every `k_per_line` weights.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub struct Ahead {
    first: *const u8,
    row_bytes: usize,
    k_per_line: usize,
}

#[cfg(target_arch = "x86_64")]
impl Ahead {
    /// Rows from `first`, `row_bytes` apart, `k_per_line` weights a cache line (a
    /// multiple of 16).
    pub fn rows<T>(first: *const T, row_bytes: usize, k_per_line: usize) -> Self {
        debug_assert!(k_per_line.is_multiple_of(16));
        Ahead {
            first: first.cast(),
            row_bytes,
            k_per_line,
        }
    }
}

/// The k loop of a tile of `n` weight rows of d_in: `step(k0, steps)` for each stretch
/// of 16 k (a cache line of each f32 row), the lines of the next tile's `n` rows (its
/// k0's, `ahead`) asked for first.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn by_lines(n: usize, d_in: usize, ahead: Option<Ahead>, mut step: impl FnMut(usize, usize)) {
    for k0 in (0..d_in).step_by(16) {
        if let Some(a) = ahead {
            if k0.is_multiple_of(a.k_per_line) {
                let line = k0 / a.k_per_line * 64;
                for j in 0..n {
                    prefetch(a.first.wrapping_add(j * a.row_bytes + line));
                }
            }
        }
        step(k0, 16.min(d_in - k0));
    }
}

/// One weight row against the sixteen rows of x transposed: a vector of sixteen sums,
/// each in the order `tile_avx512` adds them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn row_avx512(w: &[f32], xt: &[f32]) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    debug_assert_eq!(xt.len(), LANES * w.len());
    let mut acc = _mm512_setzero_ps();
    for (k, &v) in w.iter().enumerate() {
        // Safety: xt holds a vector for each k.
        acc = _mm512_fmadd_ps(
            _mm512_loadu_ps(xt.as_ptr().add(k * LANES)),
            _mm512_set1_ps(v),
            acc,
        );
    }
    acc
}

/// `steps` k of twelve weight rows (the first at `w`, the others `stride` bytes
/// apart) against x transposed (`x`: a vector of sixteen rows a k) into `acc`. In
/// assembly because each FMA's broadcast must take its address straight from a few
/// base registers and the stride (rows 0-2, 4, 8 from the first; 3, 5, 7, 11 and 6, 10
/// and 9 from three more): compiled from intrinsics, the twelve addresses came from a
/// chain of additions, one after another, slower than the FMAs.
///
/// # Safety
/// AVX-512 F; each of the twelve rows holds `steps` values from `w` on, x `steps`
/// vectors; steps >= 1.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn twelve_rows(
    w: *const f32,
    stride: usize,
    x: *const f32,
    steps: usize,
    acc: &mut [std::arch::x86_64::__m512; TILE],
) {
    debug_assert!(steps >= 1);
    let [a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11] = acc;
    std::arch::asm!(
        "2:",
        "vmovups {x}, zmmword ptr [{xp}]",
        "vfmadd231ps {a0}, {x}, dword ptr [{b0}]{{1to16}}",
        "vfmadd231ps {a1}, {x}, dword ptr [{b0} + {s}]{{1to16}}",
        "vfmadd231ps {a2}, {x}, dword ptr [{b0} + {s}*2]{{1to16}}",
        "vfmadd231ps {a4}, {x}, dword ptr [{b0} + {s}*4]{{1to16}}",
        "vfmadd231ps {a8}, {x}, dword ptr [{b0} + {s}*8]{{1to16}}",
        "vfmadd231ps {a3}, {x}, dword ptr [{b3}]{{1to16}}",
        "vfmadd231ps {a5}, {x}, dword ptr [{b3} + {s}*2]{{1to16}}",
        "vfmadd231ps {a7}, {x}, dword ptr [{b3} + {s}*4]{{1to16}}",
        "vfmadd231ps {a11}, {x}, dword ptr [{b3} + {s}*8]{{1to16}}",
        "vfmadd231ps {a6}, {x}, dword ptr [{b6}]{{1to16}}",
        "vfmadd231ps {a10}, {x}, dword ptr [{b6} + {s}*4]{{1to16}}",
        "vfmadd231ps {a9}, {x}, dword ptr [{b9}]{{1to16}}",
        "add {b0}, 4",
        "add {b3}, 4",
        "add {b6}, 4",
        "add {b9}, 4",
        "add {xp}, 64",
        "dec {n}",
        "jnz 2b",
        a0 = inout(zmm_reg) *a0,
        a1 = inout(zmm_reg) *a1,
        a2 = inout(zmm_reg) *a2,
        a3 = inout(zmm_reg) *a3,
        a4 = inout(zmm_reg) *a4,
        a5 = inout(zmm_reg) *a5,
        a6 = inout(zmm_reg) *a6,
        a7 = inout(zmm_reg) *a7,
        a8 = inout(zmm_reg) *a8,
        a9 = inout(zmm_reg) *a9,
        a10 = inout(zmm_reg) *a10,
        a11 = inout(zmm_reg) *a11,
        x = out(zmm_reg) _,
        xp = inout(reg) x => _,
        b0 = inout(reg) w => _,
        b3 = inout(reg) w.byte_add(3 * stride) => _,
        b6 = inout(reg) w.byte_add(6 * stride) => _,
        b9 = inout(reg) w.byte_add(9 * stride) => _,
        s = in(reg) stride,
        n = inout(reg) steps => _,
        options(nostack, readonly),
    );
}

/// [`tile_avx512`] on AVX2: weight rows o..o+6 against the sixteen rows of x
/// transposed, six pairs of vectors of eight sums (lane r of pair j: row r of x).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2(
    w: &[f32],
    o: usize,
    d_in: usize,
    xt: &[f32],
    ahead: Option<Ahead>,
) -> [[std::arch::x86_64::__m256; 2]; TILE_AVX2] {
    use std::arch::x86_64::*;
    debug_assert!((o + TILE_AVX2) * d_in <= w.len() && xt.len() == LANES * d_in);
    let first = w.as_ptr().add(o * d_in);
    let mut acc = [[_mm256_setzero_ps(); 2]; TILE_AVX2];
    by_lines(TILE_AVX2, d_in, ahead, |k0, steps| {
        // Safety: the rows hold d_in values from `first` on, xt d_in vectors.
        let x = xt.as_ptr().add(k0 * LANES);
        six_rows(first.add(k0), 4 * d_in, x, steps, &mut acc)
    });
    acc
}

/// [`row_avx512`] on AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_avx2(w: &[f32], xt: &[f32]) -> [std::arch::x86_64::__m256; 2] {
    use std::arch::x86_64::*;
    debug_assert_eq!(xt.len(), LANES * w.len());
    let mut acc = [_mm256_setzero_ps(); 2];
    for (k, &v) in w.iter().enumerate() {
        let v = _mm256_set1_ps(v);
        for (h, acc) in acc.iter_mut().enumerate() {
            // Safety: xt holds sixteen values for each k.
            let x = _mm256_loadu_ps(xt.as_ptr().add(k * LANES + 8 * h));
            *acc = _mm256_fmadd_ps(x, v, *acc);
        }
    }
    acc
}

/// [`twelve_rows`] on AVX2: `steps` k of six weight rows (rows 0-2 and 4 from `w`, 3
/// and 5 from a second base) against the two vectors of x a k, into six pairs of sums.
/// AVX2 has no broadcast inside the FMA: each weight is broadcast once for both halves.
///
/// # Safety
/// AVX2 and FMA; each of the six rows holds `steps` values from `w` on, x `steps`
/// pairs of vectors; steps >= 1.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn six_rows(
    w: *const f32,
    stride: usize,
    x: *const f32,
    steps: usize,
    acc: &mut [[std::arch::x86_64::__m256; 2]; TILE_AVX2],
) {
    debug_assert!(steps >= 1);
    let [[a0, c0], [a1, c1], [a2, c2], [a3, c3], [a4, c4], [a5, c5]] = acc;
    std::arch::asm!(
        "2:",
        "vmovups {x0}, ymmword ptr [{xp}]",
        "vmovups {x1}, ymmword ptr [{xp} + 32]",
        "vbroadcastss {t}, dword ptr [{b0}]",
        "vfmadd231ps {a0}, {x0}, {t}",
        "vfmadd231ps {c0}, {x1}, {t}",
        "vbroadcastss {t}, dword ptr [{b0} + {s}]",
        "vfmadd231ps {a1}, {x0}, {t}",
        "vfmadd231ps {c1}, {x1}, {t}",
        "vbroadcastss {t}, dword ptr [{b0} + {s}*2]",
        "vfmadd231ps {a2}, {x0}, {t}",
        "vfmadd231ps {c2}, {x1}, {t}",
        "vbroadcastss {t}, dword ptr [{b3}]",
        "vfmadd231ps {a3}, {x0}, {t}",
        "vfmadd231ps {c3}, {x1}, {t}",
        "vbroadcastss {t}, dword ptr [{b0} + {s}*4]",
        "vfmadd231ps {a4}, {x0}, {t}",
        "vfmadd231ps {c4}, {x1}, {t}",
        "vbroadcastss {t}, dword ptr [{b3} + {s}*2]",
        "vfmadd231ps {a5}, {x0}, {t}",
        "vfmadd231ps {c5}, {x1}, {t}",
        "add {b0}, 4",
        "add {b3}, 4",
        "add {xp}, 64",
        "dec {n}",
        "jnz 2b",
        a0 = inout(ymm_reg) *a0,
        a1 = inout(ymm_reg) *a1,
        a2 = inout(ymm_reg) *a2,
        a3 = inout(ymm_reg) *a3,
        a4 = inout(ymm_reg) *a4,
        a5 = inout(ymm_reg) *a5,
        c0 = inout(ymm_reg) *c0,
        c1 = inout(ymm_reg) *c1,
        c2 = inout(ymm_reg) *c2,
        c3 = inout(ymm_reg) *c3,
        c4 = inout(ymm_reg) *c4,
        c5 = inout(ymm_reg) *c5,
        x0 = out(ymm_reg) _,
        x1 = out(ymm_reg) _,
        t = out(ymm_reg) _,
        xp = inout(reg) x => _,
        b0 = inout(reg) w => _,
        b3 = inout(reg) w.byte_add(3 * stride) => _,
        s = in(reg) stride,
        n = inout(reg) steps => _,
        options(nostack, readonly),
    );
}

/// Writes a tile's sums (`sums[j]`: output o + j, lane r: row r) into out (rows of
/// len, as many as it holds: a padded group's last lanes are dropped), with the bias.
#[cfg(target_arch = "x86_64")]
fn put(out: &mut [f32], len: usize, o: usize, sums: &[[f32; LANES]], bias: Option<&[f32]>) {
    let rows = out.len() / len;
    for (j, lanes) in sums.iter().enumerate() {
        let b = bias.map_or(0.0, |b| b[o + j]);
        for (r, s) in lanes.iter().enumerate().take(rows) {
            out[r * len + o + j] = s + b;
        }
    }
}

impl RowProduct for Bf16 {
    fn rows_kernel(w: &[Bf16], bias: Option<&[f32]>, x: &[f32], d_in: usize, out: &mut [f32]) {
        // From 8 rows on at the AVX2 level, the f32 weights' groups of sixteen rows, a
        // tile of weight rows widened at a time: the portable four-row blocks took a
        // 16-token prompt's first token on GPT-2 124M to 57-79 ms where f32's groups
        // took 34-46 (Zen 3). AVX-512 keeps its own four by four FMAs, which widen in
        // registers as they load (widened tiles measured level with them on Zen 5).
        #[cfg(target_arch = "x86_64")]
        let done = match super::isa::active() == super::isa::Isa::Avx2 {
            true => sixteen_row_groups(w, bias, x, d_in, out),
            false => 0,
        };
        #[cfg(not(target_arch = "x86_64"))]
        let done = 0;
        if x.len() == d_in && super::matvec::order::<Self>() == super::matvec::Order::InAddressOrder
        {
            return <Self as super::matvec::MatVec>::matvec(w, bias, x, out);
        }
        let len = w.len() / d_in;
        rows_bf16(w, bias, &x[done * d_in..], d_in, &mut out[done * len..])
    }
}

/// out (rows, d_out) = x (rows, d_in) · Wᵀ (+ bias) with W (d_out, d_in) row-major: the
/// outputs shared out over the threads when W is large (each thread reads its share of
/// the weights once for every row), on this thread otherwise.
pub fn project_rows<W: RowProduct>(
    w: &[W],
    bias: Option<&[f32]>,
    x: &[f32],
    d_in: usize,
    out: &mut [f32],
) {
    let d_out = w.len() / d_in;
    let rows = x.len() / d_in;
    debug_assert_eq!(out.len(), rows * d_out);
    let shares = if splits(w.len()) { threads() } else { 1 };
    if shares == 1 {
        return W::rows_kernel(w, bias, x, d_in, out);
    }
    if rows == 1 {
        let share = d_out.div_ceil(one_row_shares(w.len()));
        // One row: each share's outputs are contiguous in `out`.
        for_each_piece(out, share, |i, out| {
            let first = i * share;
            let w = &w[first * d_in..(first + out.len()) * d_in];
            W::rows_kernel(w, bias.map(|b| &b[first..first + out.len()]), x, d_in, out);
        });
        return;
    }
    let share = d_out.div_ceil(shares);
    by_output_shares(d_out, rows, share, out, |first, len, part| {
        let w = &w[first * d_in..(first + len) * d_in];
        W::rows_kernel(w, bias.map(|b| &b[first..first + len]), x, d_in, part);
    });
}

/// out (rows, d_out) filled by `fill(first, len, part)` for shares of `share` outputs,
/// in parallel: a share's outputs are strided in `out`, so each thread fills its own
/// (rows, len) part, and the parts are put in place after.
pub fn by_output_shares(
    d_out: usize,
    rows: usize,
    share: usize,
    out: &mut [f32],
    fill: impl Fn(usize, usize, &mut [f32]) + Sync,
) {
    let parts: Vec<(usize, Vec<f32>)> = (0..d_out.div_ceil(share))
        .into_par_iter()
        .map(|i| {
            let (first, len) = (i * share, share.min(d_out - i * share));
            let mut part = vec![0f32; rows * len];
            fill(first, len, &mut part);
            (first, part)
        })
        .collect();
    for (first, part) in parts {
        let len = part.len() / rows;
        for (r, values) in part.chunks_exact(len).enumerate() {
            out[r * d_out + first..r * d_out + first + len].copy_from_slice(values);
        }
    }
}

/// Whether a product over `weights` values is split over the threads: from 128 Ki on;
/// smaller ones (the baby model's) stay on one, where the hand-off costs more than it
/// saves.
pub fn splits(weights: usize) -> bool {
    weights >= 1 << 17
}

/// Shares a one-row product over `weights` values is cut into: [`ONE_ROW_PIECES`] a
/// thread, taken from the team's counter as each thread comes free. A thread slowed by
/// something else on its core (a VM's shared vCPU, another process) then leaves its
/// unstarted shares to the others, where halves fixed in advance waited for the slow
/// one. Which thread computes an output changes no bits.
pub fn one_row_shares(weights: usize) -> usize {
    if splits(weights) {
        threads() * ONE_ROW_PIECES
    } else {
        1
    }
}

/// Pieces a thread of a one-row product: GPT-2 124M on a 2-vCPU Zen 3 VM with a busy
/// loop on the second core, decoding int4 at 68-77 tokens/s in halves, 81-104 in four
/// pieces a thread, 94-96 in eight (bf16 31-35, 36-39, 35-37); with the core free all
/// three within the VM's drift (int4 144-190, bf16 61-72).
const ONE_ROW_PIECES: usize = 4;
