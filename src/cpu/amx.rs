//! bf16 products on AMX tiles (Intel Xeon from Sapphire Rapids on): the same numbers as
//! `bf16`'s kernels (operands rounded to bf16, products exact, sums in f32) at up to
//! sixteen times the multiply-adds per cycle of `vdpbf16ps`.
//!
//! An AMX tile is a 16-row by 64-byte register; `tdpbf16ps` adds to a 16 x 16 f32 tile
//! the product of a 16 x 32 bf16 tile of A (a row's 16 k pairs) and a 32 x 16 tile of
//! B (16 pair-rows of 16 columns, each word a column's k pair, even k low, as `bf16`
//! packs them). One block of dst is 32 x 32: four accumulator tiles (tmm0-3), two A
//! tiles (tmm4-5) and two B tiles (tmm6-7), so each tile loaded serves two products.
//!
//! Operands are packed with zeros to whole tiles (rows to 32, columns to 32, k pairs to
//! 16), so the kernel never meets an edge; edge blocks of dst go through a small
//! scratch block. Linux hands out the tiles' register state only on request
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`): [`super::isa::amx_ready`] asks once per process. Rust has no
//! stable AMX intrinsics, so the instructions are inline assembly on fixed tile
//! registers, which the compiler never uses.

use std::ops::Range;

use super::panels::{scratch, PANELS};

use super::matrix::{Causal, Product, Strided};

/// Rows and columns of one block of dst (2 x 2 tiles).
pub const BLOCK: usize = 32;
/// k pairs per tile.
const TILE_PAIRS: usize = 16;
/// k per packed block, at most: a B panel (32 columns x 1024 pairs, 128 KiB) and a block
/// of A (below) both in L2. The tiles load from L2 about as fast as from L1, while every
/// extra block reloads and restores the whole of dst: the products of k 1152-1536 ran
/// 15-30% faster in one block than in blocks of 512 (an L1-sized B panel); the weight
/// gradients' k 4096 gained nothing more from one block than from two.
const KC: usize = 2048;
/// Rows of A packed at a time (128 rows x up to 1024 pairs, 512 KiB: in L2).
const MC: usize = 128;

/// Whether `multiply` takes `p`: each operand has rows or columns next to each other
/// in memory (the packers read along one or the other).
pub fn takes(p: &Product) -> bool {
    let unit = |s: &Strided| s.row == 1 || s.col == 1;
    unit(&p.a) && unit(&p.b)
}

/// dst block (rows, cols) of the product `p`, on this thread: dst = (dst if
/// `p.accumulate`) + `p.beta` · round(a) · round(b), skipping what `p.causal` allows in
/// whole blocks of 32 rows and steps of 16 k pairs.
///
/// # Safety
/// [`super::isa::amx_ready`] must have returned true; `dst` (rows `dst_row` apart) must hold the block,
/// which no other thread touches meanwhile, and `p`'s operands every element it reads
/// (`Product::check_bounds`); [`takes`] must accept `p`.
pub unsafe fn multiply(
    dst: *mut f32,
    dst_row: usize,
    p: &Product,
    rows: Range<usize>,
    cols: Range<usize>,
) {
    debug_assert!(takes(p));
    if rows.is_empty() || cols.is_empty() {
        return;
    }
    if p.k == 0 {
        // An empty sum: dst = dst (if accumulating) + beta * 0.
        if !p.accumulate {
            for r in rows {
                std::slice::from_raw_parts_mut(dst.add(r * dst_row + cols.start), cols.len())
                    .fill(0.0);
            }
        }
        return;
    }
    let blocks = p.k.div_ceil(KC).max(1);
    let step = p.k.div_ceil(blocks).next_multiple_of(2 * TILE_PAIRS);
    PANELS.with(|panels| {
        let panels = &mut *panels.borrow_mut();
        let tiles = Tiles::configure();
        let n = cols.len();
        let mut k0 = 0;
        loop {
            let kc = step.min(p.k - k0);
            let pairs = kc.div_ceil(2).next_multiple_of(TILE_PAIRS);
            let load = p.accumulate || k0 > 0;
            let b = scratch(&mut panels.b, n.next_multiple_of(BLOCK) * pairs);
            pack_b(b, &p.b, k0, kc, pairs, cols.start, n);
            for i0 in rows.clone().step_by(MC) {
                let mc = MC.min(rows.end - i0);
                let a = scratch(&mut panels.a, mc.next_multiple_of(BLOCK) * pairs);
                pack_a(a, &p.a, i0, mc, k0, kc, pairs, p.causal);
                for (jp, panel) in b.chunks_exact(BLOCK * pairs).enumerate() {
                    let c0 = cols.start + jp * BLOCK;
                    for (ib, a_rows) in a.chunks_exact(BLOCK * pairs).enumerate() {
                        let r0 = i0 + ib * BLOCK;
                        let height = BLOCK.min(rows.end - r0);
                        let width = BLOCK.min(cols.end - c0);
                        if p.causal.skips_tile(r0 + height, c0) {
                            // Wholly above the diagonal: never read.
                            continue;
                        }
                        let (from, to) = read_pairs(p.causal, r0..r0 + height, k0, kc, pairs);
                        let c = dst.add(r0 * dst_row + c0);
                        let whole = height == BLOCK && width == BLOCK && p.beta == 1.0;
                        let target = Target {
                            c,
                            row: dst_row,
                            whole,
                            load,
                            beta: p.beta,
                            height,
                            width,
                        };
                        let (a, b) = (&a_rows[from * BLOCK..], &panel[from * BLOCK..]);
                        tiles.block(a, b, (to - from) / TILE_PAIRS, target);
                    }
                }
            }
            k0 += kc;
            if k0 >= p.k {
                break;
            }
        }
    })
}

/// The k pairs of a packed block (k0..k0 + kc, `pairs` of them) that the kernel
/// multiplies for the block of A's rows `rows`: those `causal` says may be non-zero,
/// in whole tiles. `pack_a` converts these alone.
fn read_pairs(
    causal: Causal,
    rows: Range<usize>,
    k0: usize,
    kc: usize,
    pairs: usize,
) -> (usize, usize) {
    let span = causal.k_span(rows, k0, kc);
    let from = (span.start / 2 / TILE_PAIRS * TILE_PAIRS).min(pairs);
    let to = span
        .end
        .div_ceil(2)
        .next_multiple_of(TILE_PAIRS)
        .clamp(from, pairs);
    (from, to)
}

/// Where word (line, p) of a packed block lies: the block is 32 lines (rows of A,
/// columns of B) by `pairs` k pairs, stored tile after tile so that each tile the
/// kernel loads is 1 KiB of contiguous memory: step s (pairs 16s..16s+16) holds the
/// tile of lines 0-15, then that of lines 16-31. Within A's tiles a row is 16 pairs
/// (word (r, q) at r * 16 + q); within B's a row is a pair of 16 columns (q * 16 + r).
#[inline(always)]
fn tile_base(line: usize, p: usize) -> usize {
    (p / TILE_PAIRS) * 2 * TILE_WORDS + (line / 16) * TILE_WORDS
}

/// Where row r (< 32) of a packed block of A starts: its first step's 16 words.
#[inline(always)]
fn a_row_base(r: usize) -> usize {
    tile_base(r, 0) + (r % 16) * 16
}

/// Words in one tile (16 rows of 64 bytes).
const TILE_WORDS: usize = 256;

/// Rows i0..i0+mc, k k0..k0+kc of `a` as 32-row blocks of pair words (`tile_base`; a
/// row's 16 pairs of a step side by side). Rows past mc (to a multiple of 32) and
/// pairs past kc are zeros, and so are the elements `causal` says are zero (`LowerA`,
/// `UpperA`): whole tiles straddle the diagonal, and nothing else guarantees zeros there.
/// A block's steps the kernel never reads (`read_pairs`: wholly past or before the
/// diagonal) are left stale, not converted: attention's T x T operands are half zeros
/// (its backward at T 256 ran 3-6% faster, `examples/attention_probe`).
#[allow(clippy::too_many_arguments)]
fn pack_a(
    out: &mut [u32],
    a: &Strided,
    i0: usize,
    mc: usize,
    k0: usize,
    kc: usize,
    pairs: usize,
    causal: Causal,
) {
    let block = BLOCK * pairs;
    let row_start = |i: usize| (i / BLOCK) * block + a_row_base(i % BLOCK);
    // The steps the kernel reads for packed row i: its block's `read_pairs`.
    let steps_read = |i: usize| {
        let r0 = i0 + i / BLOCK * BLOCK;
        let end = (i0 + mc).min(r0 + BLOCK);
        let (from, to) = read_pairs(causal, r0..end, k0, kc, pairs);
        from / TILE_PAIRS..to / TILE_PAIRS
    };
    if a.col == 1 {
        // Rows past mc: the last block's, zeroed first.
        if !mc.is_multiple_of(BLOCK) {
            out[mc / BLOCK * block..].fill(0);
        }
        // A block's rows all read the same steps: converted in one call a block, not a
        // call a row (attention's rows are 64 wide: the bf16 attention's share in the
        // row conversion fell from 11.5% to 8.9% of its samples).
        for b0 in (0..mc).step_by(BLOCK) {
            let steps = steps_read(b0);
            let first = (k0 + 2 * TILE_PAIRS * steps.start).min(k0 + kc);
            let last = (k0 + 2 * TILE_PAIRS * steps.end).min(k0 + kc);
            let rows = BLOCK.min(mc - b0);
            let start = (i0 + b0) * a.row + first;
            let src = &a.data[start..start + (rows - 1) * a.row + (last - first)];
            let at = row_start(b0) + steps.start * 2 * TILE_WORDS;
            // Safety: `amx_ready` checked AVX-512 BF16; `out` holds the block's steps.
            unsafe {
                convert::block_rows(src, a.row, last - first, rows, &mut out[at..], steps.len())
            };
        }
    } else {
        // A's columns (fixed k) run along memory: for sixteen rows at a time, the 32
        // columns of a step zipped into sixteen pair vectors (a row's word in each
        // lane) and transposed into the tile's sixteen rows of sixteen pairs.
        let column = |k: usize| (k < kc).then(|| &a.data[(k0 + k) * a.col + i0..][..mc]);
        for s in 0..pairs / TILE_PAIRS {
            let k = 2 * s * TILE_PAIRS;
            let columns: [Option<&[f32]>; 2 * TILE_PAIRS] = std::array::from_fn(|c| column(k + c));
            for i in (0..mc.next_multiple_of(BLOCK)).step_by(16) {
                if !steps_read(i.min(mc - 1)).contains(&s) {
                    continue;
                }
                let at = (i / BLOCK) * block + tile_base(i % BLOCK, k / 2);
                // Safety: `amx_ready` checked AVX-512 BF16; the tile's 256 words lie
                // in `out` (mc rounded up to whole blocks).
                unsafe {
                    convert::tile_from_columns(&columns, i, mc, &mut out[at..][..TILE_WORDS])
                };
            }
        }
    }
    if !matches!(causal, Causal::LowerA | Causal::UpperA) {
        return;
    }
    // Zero what the structure says is zero: each row's stretch past (LowerA) or before
    // (UpperA) its diagonal, sixteen words (one step of the row) at a time.
    for i in 0..mc {
        let row = row_start(i);
        // Local k of the first element kept (UpperA) or zeroed (LowerA).
        let edge = match causal {
            Causal::LowerA => (i0 + i + 1).saturating_sub(k0),
            _ => (i0 + i).saturating_sub(k0),
        };
        for s in steps_read(i) {
            let (first_k, last_k) = (2 * s * TILE_PAIRS, 2 * (s + 1) * TILE_PAIRS);
            let zero_all = match causal {
                Causal::LowerA => first_k >= edge,
                _ => last_k <= edge,
            };
            let keep_all = match causal {
                Causal::LowerA => last_k <= edge,
                _ => first_k >= edge,
            };
            let words = &mut out[row + s * 2 * TILE_WORDS..][..TILE_PAIRS];
            if zero_all {
                words.fill(0);
            } else if !keep_all {
                for (q, w) in words.iter_mut().enumerate() {
                    let k = k0 + 2 * (s * TILE_PAIRS + q);
                    let (even, odd) =
                        (causal.zero_in_a(i0 + i, k), causal.zero_in_a(i0 + i, k + 1));
                    *w &= if even { 0 } else { 0xffff } | if odd { 0 } else { 0xffff_0000 };
                }
            }
        }
    }
}

/// k k0..k0+kc, columns first_col..first_col+n of `b` as 32-column panels of pair words
/// (`tile_base`; a pair's 16 columns of a tile side by side). Columns past n and pairs
/// past kc are zeros.
fn pack_b(
    out: &mut [u32],
    b: &Strided,
    k0: usize,
    kc: usize,
    pairs: usize,
    first_col: usize,
    n: usize,
) {
    if b.col == 1 {
        // B's rows (fixed k) run along memory: each pair of rows zipped across all n
        // columns at once, sixteen columns to a tile row.
        let row = |k: usize| (k < kc).then(|| &b.data[(k0 + k) * b.row + first_col..][..n]);
        for p in 0..pairs {
            let within = (p % TILE_PAIRS) * 16;
            let at = [tile_base(0, p) + within, tile_base(16, p) + within];
            match row(2 * p) {
                // Safety: `amx_ready` checked AVX-512 BF16; every panel holds its rows.
                Some(even) => unsafe {
                    convert::zip_panels(even, row(2 * p + 1), out, BLOCK * pairs, at)
                },
                None => {
                    for panel in out.chunks_exact_mut(BLOCK * pairs) {
                        for start in at {
                            panel[start..start + 16].fill(0);
                        }
                    }
                }
            }
        }
        return;
    }
    // B's columns (fixed j) run along k: sixteen of them a step at a time, converted
    // to pair words and transposed into a tile's sixteen rows (pairs) of sixteen columns.
    for (panel, out) in out.chunks_exact_mut(BLOCK * pairs).enumerate() {
        let c0 = first_col + panel * BLOCK;
        let width = BLOCK.min(n - panel * BLOCK);
        for half in 0..2 {
            let columns: [Option<&[f32]>; 16] = std::array::from_fn(|c| {
                let j = 16 * half + c;
                (j < width).then(|| &b.data[(c0 + j) * b.col + k0..][..kc])
            });
            for s in 0..pairs / TILE_PAIRS {
                let at = tile_base(16 * half, s * TILE_PAIRS);
                // Safety: `amx_ready` checked AVX-512 BF16; the tile lies in the panel.
                unsafe { convert::tile_from_b_columns(&columns, s, &mut out[at..][..TILE_WORDS]) };
            }
        }
    }
}

/// f32 to bf16 pair words sixteen at a time with `vcvtne2ps2bf16`: to nearest, ties to
/// even, as `bf16::to_bf16_bits`. It reads subnormal inputs as zero, as the tiles do
/// with subnormal bf16, so the products come out the same.
mod convert {
    use std::arch::x86_64::*;

    /// vpermw indices: word j of the result is lane j of the low 16 bf16 (low half)
    /// and lane j of the high 16 (high half).
    const INTERLEAVE: [u16; 32] = {
        let mut idx = [0u16; 32];
        let mut j = 0;
        while j < 16 {
            idx[2 * j] = j as u16;
            idx[2 * j + 1] = 16 + j as u16;
            j += 1;
        }
        idx
    };

    /// The first `count` (at most 16) lanes.
    #[inline(always)]
    fn lanes(count: usize) -> __mmask16 {
        ((1u32 << count.min(16)) - 1) as __mmask16
    }

    /// `len` (1 to 16) words pair(even[j], odd[j]), zeros after; no odd: zeros.
    #[inline(always)]
    unsafe fn zip16(even: *const f32, odd: Option<*const f32>, len: usize) -> __m512i {
        let e = _mm512_maskz_loadu_ps(lanes(len), even);
        let o = odd.map_or(_mm512_setzero_ps(), |odd| {
            _mm512_maskz_loadu_ps(lanes(len), odd)
        });
        let both: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(o, e));
        _mm512_permutexvar_epi16(_mm512_loadu_si512(INTERLEAVE.as_ptr().cast()), both)
    }

    /// The words pair(even[j], odd[j]) of a pair of B's rows into 32-column panels
    /// `panel` words apart: columns 0-15 of each panel at `at[0]` in it, 16-31 at
    /// `at[1]`; columns past even.len() (to whole panels) are zeros, and so is a
    /// missing `odd`.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW and BF16; `odd`, if any, as long as `even`; `out`
    /// must hold even.len().div_ceil(32) panels.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn zip_panels(
        even: &[f32],
        odd: Option<&[f32]>,
        out: &mut [u32],
        panel: usize,
        at: [usize; 2],
    ) {
        let n = even.len();
        debug_assert!(odd.is_none_or(|o| o.len() == n));
        debug_assert!(out.len() >= n.div_ceil(32) * panel);
        for g in 0..n.div_ceil(32) * 2 {
            let j = 16 * g;
            let len = n.saturating_sub(j).min(16);
            let words = if len == 0 {
                _mm512_setzero_si512()
            } else {
                zip16(even.as_ptr().add(j), odd.map(|o| o.as_ptr().add(j)), len)
            };
            let to = out.as_mut_ptr().add((g / 2) * panel + at[g % 2]);
            _mm512_storeu_si512(to.cast(), words);
        }
    }

    /// One tile of A from its columns: rows i..i+16 (zeros from `rows` on) of the 32
    /// columns of a step (`None`: past k's end, zeros), as 16 rows of 16 pair words.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW and BF16; each column holds `rows` values; out
    /// holds 256 words.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn tile_from_columns(
        columns: &[Option<&[f32]>; 32],
        i: usize,
        rows: usize,
        out: &mut [u32],
    ) {
        debug_assert!(out.len() >= 256);
        let len = rows.saturating_sub(i).min(16);
        if len == 0 {
            return out[..256].fill(0);
        }
        // pairs[q]: lane r holds row i + r's word of pair q.
        let mut pairs = [_mm512_setzero_si512(); 16];
        for (q, pair) in pairs.iter_mut().enumerate() {
            if let Some(even) = columns[2 * q] {
                let odd = columns[2 * q + 1].map(|o| o.as_ptr().add(i));
                *pair = zip16(even.as_ptr().add(i), odd, len);
            }
        }
        for (r, row) in transpose16(pairs).iter().enumerate() {
            _mm512_storeu_si512(out.as_mut_ptr().add(16 * r).cast(), *row);
        }
    }

    /// One tile of B from its columns: for step `s` (k 32s..32s+32, zeros past a
    /// column's end), each column's 16 pair words, transposed so that the tile's row q
    /// holds pair q of the sixteen columns (`None`: zeros).
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW and BF16; out holds 256 words.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn tile_from_b_columns(columns: &[Option<&[f32]>; 16], s: usize, out: &mut [u32]) {
        debug_assert!(out.len() >= 256);
        let i = 32 * s;
        let mut words = [_mm512_setzero_si512(); 16];
        for (word, column) in words.iter_mut().zip(columns) {
            if let Some(column) = column {
                let left = column.len().saturating_sub(i);
                let at = column.as_ptr().wrapping_add(i);
                let lo = _mm512_maskz_loadu_ps(lanes(left), at);
                let hi = _mm512_maskz_loadu_ps(lanes(left.saturating_sub(16)), at.wrapping_add(16));
                *word = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo));
            }
        }
        for (q, row) in transpose16(words).iter().enumerate() {
            _mm512_storeu_si512(out.as_mut_ptr().add(16 * q).cast(), *row);
        }
    }

    /// The 16 x 16 transpose of 32-bit words: lane c of vector r becomes lane r of
    /// vector c (words paired, then pairs of pairs, then 128-bit lanes twice).
    ///
    /// Loops over arrays, not `std::array::from_fn`: its closures are functions of
    /// their own, compiled without the caller's AVX-512, so each intrinsic in them was
    /// a call (a seventh of a bf16 training step on AMX went to those calls).
    #[inline(always)]
    unsafe fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
        // Within each 128-bit lane: rows 2j and 2j + 1 interleaved by words.
        let mut t = [_mm512_setzero_si512(); 16];
        for (x, t) in t.iter_mut().enumerate() {
            let (a, b) = (r[x / 2 * 2], r[x / 2 * 2 + 1]);
            *t = if x % 2 == 0 {
                _mm512_unpacklo_epi32(a, b)
            } else {
                _mm512_unpackhi_epi32(a, b)
            };
        }
        // Then by pairs: u[4g + c] holds, per 128-bit lane L, column 4L + c of rows
        // 4g..4g+4.
        let mut u = [_mm512_setzero_si512(); 16];
        for (x, u) in u.iter_mut().enumerate() {
            let (g, c) = (x / 4, x % 4);
            let (a, b) = (t[4 * g + c / 2], t[4 * g + 2 + c / 2]);
            *u = if c % 2 == 0 {
                _mm512_unpacklo_epi64(a, b)
            } else {
                _mm512_unpackhi_epi64(a, b)
            };
        }
        // 128-bit lanes of rows 0-3 with 4-7 (and 8-11 with 12-15): v[c] for c < 4
        // holds columns c and c + 8, v[c + 4] columns c + 4 and c + 12; then of those
        // with v[c + 8], which completes each column.
        let v = pair_lanes(u, 4);
        pair_lanes(v, 8)
    }

    /// Vector x of the result, with g = x / 2s and c = x % 2s: 128-bit lanes 0 and 2 (for
    /// c < s) or 1 and 3 of input 2s g + c % s, then the same lanes of input 2s g + s + c % s.
    #[inline(always)]
    unsafe fn pair_lanes(x: [__m512i; 16], s: usize) -> [__m512i; 16] {
        let mut out = [_mm512_setzero_si512(); 16];
        for (i, out) in out.iter_mut().enumerate() {
            let (g, c) = (i / (2 * s), i % (2 * s));
            let (a, b) = (x[2 * s * g + c % s], x[2 * s * g + s + c % s]);
            *out = if c < s {
                _mm512_shuffle_i32x4::<0x88>(a, b)
            } else {
                _mm512_shuffle_i32x4::<0xdd>(a, b)
            };
        }
        out
    }

    /// `rows` (at most 32) rows of a block of A into their `steps` steps: row r's `len`
    /// values from src[r * row..] at its place in the block (`a_row_base`; `row_steps`).
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW and BF16; out must reach the last row's last step.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn block_rows(
        src: &[f32],
        row: usize,
        len: usize,
        rows: usize,
        out: &mut [u32],
        steps: usize,
    ) {
        debug_assert!(rows <= 32 && (rows == 0 || src.len() >= (rows - 1) * row + len));
        for r in 0..rows {
            let at = super::a_row_base(r);
            row_steps(&src[r * row..r * row + len], &mut out[at..], steps * 16);
        }
    }

    /// One row of A into its steps: for each s < pairs / 16, the 16 words
    /// pair(src[2p], src[2p + 1]) of p = 16s.. at out[s * 512..], zeros past src's end.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW and BF16; out must reach the last step's 16 words.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[inline]
    pub unsafe fn row_steps(src: &[f32], out: &mut [u32], pairs: usize) {
        let steps = pairs / 16;
        debug_assert!(steps == 0 || out.len() >= (steps - 1) * 512 + 16);
        debug_assert!(src.len() <= 32 * steps);
        let (n, from) = (src.len(), src.as_ptr());
        for s in 0..steps {
            let i = 32 * s;
            let (lo, hi) = if i + 32 <= n {
                (
                    _mm512_loadu_ps(from.add(i)),
                    _mm512_loadu_ps(from.add(i + 16)),
                )
            } else {
                let left = n.saturating_sub(i);
                let lo = if left > 0 {
                    _mm512_maskz_loadu_ps(lanes(left), from.add(i))
                } else {
                    _mm512_setzero_ps()
                };
                let hi = if left > 16 {
                    _mm512_maskz_loadu_ps(lanes(left - 16), from.add(i + 16))
                } else {
                    _mm512_setzero_ps()
                };
                (lo, hi)
            };
            let words: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(out.as_mut_ptr().add(s * 512).cast(), words);
        }
    }
}

/// The tile registers, configured on this thread as 8 tiles of 16 rows x 64 bytes, and
/// released (back to their initial state, which costs the OS nothing to save) on drop.
struct Tiles {
    _not_send: std::marker::PhantomData<*const ()>,
}

/// Where one block's sums go: `c`, rows `row` apart; c = (c if `load`) + beta * sums
/// for its `height` x `width` corner. `whole`: the block lies inside dst and beta is 1,
/// so the tiles load from and store to dst itself; otherwise through a scratch block.
struct Target {
    c: *mut f32,
    row: usize,
    whole: bool,
    load: bool,
    beta: f32,
    height: usize,
    width: usize,
}

/// One block of sums in L1, on a cache line: the tiles store a block here and vector
/// stores carry it on to dst. `tilestored` straight into dst's rows, each on a line not
/// in cache, stalled the tiles: the 6L/384 forward's products (k 384) spent a quarter
/// of their time there, and ran 1.5-2.3x faster one thread through this block
/// (`gemm_probe`, Sapphire Rapids).
#[repr(C, align(64))]
struct Staged([f32; BLOCK * BLOCK]);

impl Staged {
    /// The block into dst at `c`, rows `c_row` apart.
    ///
    /// # Safety
    /// dst must hold the block; the CPU must have AVX-512 F.
    #[target_feature(enable = "avx512f")]
    unsafe fn put(&self, c: *mut f32, c_row: usize) {
        use std::arch::x86_64::*;
        for (i, row) in self.0.chunks_exact(BLOCK).enumerate() {
            let to = c.add(i * c_row);
            _mm512_storeu_ps(to, _mm512_load_ps(row.as_ptr()));
            _mm512_storeu_ps(to.add(16), _mm512_load_ps(row.as_ptr().add(16)));
        }
    }
}

/// `ldtilecfg`'s 64-byte operand (palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    /// Bytes per row of each tile.
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl Tiles {
    /// # Safety
    /// [`super::isa::amx_ready`] must have returned true.
    unsafe fn configure() -> Tiles {
        let mut config = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for t in 0..8 {
            config.colsb[t] = 64;
            config.rows[t] = 16;
        }
        #[cfg(target_arch = "x86_64")]
        std::arch::asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly));
        Tiles {
            _not_send: std::marker::PhantomData,
        }
    }

    /// One 32 x 32 block of dst (`target`): over `steps` x 16 k pairs of a packed block
    /// of A's rows `a` and a panel of B's columns `b` (`tile_base`'s layout).
    ///
    /// # Safety
    /// `a` and `b` must hold what those steps read; the block of dst must be writable.
    #[inline(always)]
    unsafe fn block(&self, a: &[u32], b: &[u32], steps: usize, target: Target) {
        debug_assert!(a.len() >= steps * 2 * TILE_WORDS && b.len() >= steps * 2 * TILE_WORDS);
        let Target {
            c,
            row: c_row,
            whole,
            load,
            beta,
            height,
            width,
        } = target;
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::asm;
            if whole && load {
                asm!(
                    "tileloadd tmm0, [{c} + {s}*1]",
                    "tileloadd tmm1, [{c} + {s}*1 + 64]",
                    "tileloadd tmm2, [{c2} + {s}*1]",
                    "tileloadd tmm3, [{c2} + {s}*1 + 64]",
                    c = in(reg) c,
                    c2 = in(reg) c.add(16 * c_row),
                    s = in(reg) c_row * 4,
                    options(nostack, readonly),
                );
            } else {
                asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    options(nostack, nomem)
                );
                if whole {
                    // dst's 64 lines asked for (to be written) now, to arrive while the
                    // tiles multiply: the stores after the loop waited on each line
                    // (qkv forward, k 384, one thread: 12% faster, Sapphire Rapids).
                    for i in 0..BLOCK {
                        asm!(
                            "prefetchw [{0}]",
                            "prefetchw [{0} + 64]",
                            in(reg) c.add(i * c_row),
                            options(nostack, readonly, preserves_flags)
                        );
                    }
                }
            }
            // Each step: the two tiles of A's rows (1 KiB each, rows 64 bytes apart),
            // then B's, 2 KiB on for the next 16 pairs.
            if steps > 0 {
                asm!(
                    "2:",
                    "tileloadd tmm4, [{a} + {row}*1]",
                    "tileloadd tmm6, [{b} + {row}*1]",
                    "tileloadd tmm5, [{a} + {row}*1 + 1024]",
                    "tileloadd tmm7, [{b} + {row}*1 + 1024]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    "add {a}, 2048",
                    "add {b}, 2048",
                    "dec {steps}",
                    "jnz 2b",
                    a = inout(reg) a.as_ptr() => _,
                    b = inout(reg) b.as_ptr() => _,
                    row = in(reg) 64usize,
                    steps = inout(reg) steps => _,
                    options(nostack, readonly),
                );
            }
            // The sums to a block in L1, then on to dst (`Staged`). (Uninitialised:
            // the four stores write all of it.)
            let mut staged = std::mem::MaybeUninit::<Staged>::uninit();
            let out = staged.as_mut_ptr().cast::<f32>();
            asm!(
                "tilestored [{c} + {s}*1], tmm0",
                "tilestored [{c} + {s}*1 + 64], tmm1",
                "tilestored [{c2} + {s}*1], tmm2",
                "tilestored [{c2} + {s}*1 + 64], tmm3",
                c = in(reg) out,
                c2 = in(reg) out.add(16 * BLOCK),
                s = in(reg) BLOCK * 4,
                options(nostack),
            );
            let staged = staged.assume_init_ref();
            if whole {
                staged.put(c, c_row);
                return;
            }
            for (i, sums) in staged.0.chunks_exact(BLOCK).take(height).enumerate() {
                let row = std::slice::from_raw_parts_mut(c.add(i * c_row), width);
                for (d, s) in row.iter_mut().zip(sums) {
                    *d = if load { *d } else { 0.0 } + beta * s;
                }
            }
        }
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // Safety: the tiles were configured by this thread (`configure`).
        #[cfg(target_arch = "x86_64")]
        unsafe {
            std::arch::asm!("tilerelease", options(nostack, nomem))
        };
    }
}
