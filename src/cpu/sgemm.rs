//! f32 products on x86: BLIS's blocking around our own register tiles, 6 rows by 16
//! columns on AVX2 + FMA cores (x86-64-v3: the laptops and servers without AVX-512,
//! Intel's and AMD's), 8 by 32 on AVX-512 ones.
//!
//! Why our own: on one Zen 3 core (an FMA loop: 97 GFLOP/s) the `gemm` crate's AVX2
//! path multiplied the 6L/384 model's layers at 69-74 GFLOP/s, this one at 74-84
//! (docs/PERFORMANCE.md). The tile is the same size as the crate's; the difference is
//! in reading A in place and fetching dst's tile ahead. On AVX-512 cores the crate
//! keeps the layers' products, and attention's come here (`gemm::matmul_serial`):
//! per-head products of 64 rows by a head's 32 k, where the crate's packing and
//! dispatch cost more than its tile saves.
//!
//! The blocking: k in equal blocks of at most `kc_max`, whose B panel (16 KiB) stays
//! in L1 while A streams from L2; rows in blocks of `mc`; columns in blocks of `NC`
//! (a k block of NC columns of B, in L3). B is packed into tile-wide panels, each k's
//! values side by side with zeros past the edge. A is read where it lies when its rows
//! run along memory (each value serves a whole block of columns, so a copy would cost
//! what it saves); read down its columns (a weight gradient's activations), a k a line,
//! it is packed into tile-high panels first.
//!
//! Inside causal attention (`Product::causal`) a tile wholly above the diagonal of a dst
//! whose lower triangle alone is read is skipped, and a tile's k are cut to those its
//! rows may hold non-zero in a triangular A.
//!
//! Every element of dst is summed in one order (k blocks in turn, each k of a block
//! in turn, the block's sum added to dst) wherever its row or column falls in the
//! blocking and however the threads split dst: a thread count never changes the bits.

use std::arch::x86_64::*;

use super::isa::Isa;
use super::matrix::{Product, Strided, Tile, PARALLEL_MIN_MACS};
use super::panels::{scratch, PANELS};
use super::threads::split_dst;

/// The register tile's rows and columns at each level, and the blocking sized from
/// them (below).
///
/// AVX2: twelve 8-lane accumulators, 6 rows by 16 columns (two vectors), per k two
/// loads of B and six broadcasts of A for twelve FMAs, which keeps both FMA ports of a
/// core busy past their latency (3-5 cycles on the x86 cores of the last decade) with 3
/// of the 16 registers to spare. Alone, in L1, it runs at the FMA loop's speed.
///
/// AVX-512: sixteen 16-lane accumulators, 8 rows by 32 columns, per k two loads of B
/// and eight broadcasts for sixteen FMAs (two 512-bit FMA ports, Intel's, want ~8-10
/// chains in flight; a double-pumped one, Zen 4's, half as many), with 14 of the 32
/// registers to spare. Eight rows divide attention's usual T (64, 256, 1024), so
/// causal skipping loses no part-filled tiles there.
const MR_AVX2: usize = 6;
const NR_AVX2: usize = 16;
const MR_AVX512: usize = 8;
const NR_AVX512: usize = 32;

/// The register tiles a product can run on: the CPU's widest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Avx2,
    Avx512,
}

impl Level {
    /// The tile for the active CPU level (`isa::active`), if it has AVX2.
    pub fn active() -> Option<Level> {
        match super::isa::active() {
            Isa::Scalar => None,
            Isa::Avx2 => Some(Level::Avx2),
            Isa::Avx512 | Isa::Amx => Some(Level::Avx512),
        }
    }

    /// The tile's rows and columns.
    fn shape(self) -> (usize, usize) {
        match self {
            Level::Avx2 => (MR_AVX2, NR_AVX2),
            Level::Avx512 => (MR_AVX512, NR_AVX512),
        }
    }
}

/// k per block, about: the k are split into equal blocks of at most this, so that a
/// block's B panel (`NR` columns of it: 16 KiB at either level) stays in L1 (32 KiB
/// on Zen 4, 48 on Intel's) while A streams from L2.
const fn kc_max(nr: usize) -> usize {
    (16 << 10) / (4 * nr)
}

/// Rows per block of A (twelve tiles): 72 or 96 rows of a block's k, 72 or 48 KiB, in
/// L2.
const fn mc(mr: usize) -> usize {
    12 * mr
}

/// Columns per packed block of B, a multiple of both levels' `NR`.
const NC: usize = 3072;
/// Plain products with fewer rows go to the `gemm` crate: packing B costs as much as
/// multiplying there (attention's per-head products, in blocks of 64 rows, were 20%
/// slower through this path). Attention's products (`gemm::matmul_serial`: training's,
/// and a prompt's in the decoder) come here whatever their rows: skipping the causal
/// triangles tile by tile, not in blocks of 64 rows, repays the packing (attention 20-30%
/// less time a training step at the baby and 6L/384 shapes; a 512-token prompt level).
pub const MIN_ROWS: usize = 128;

/// dst (rows `dst_row` apart) = dst (if `p.accumulate`) + p.beta * a · b, over
/// `threads` threads when the product is large enough to repay them, on the active
/// level's tile.
///
/// # Safety
/// The active level must be AVX2 or above (`Level::active` is some);
/// `p.check_bounds(dst, dst_row)` must hold.
pub unsafe fn multiply(dst: &mut [f32], dst_row: usize, p: Product, threads: usize) {
    let level = Level::active().expect("sgemm runs at AVX2 and above");
    multiply_at(level, dst, dst_row, p, threads)
}

/// [`multiply`] on `level`'s tile.
///
/// # Safety
/// The CPU must have `level`; `p.check_bounds(dst, dst_row)` must hold.
pub unsafe fn multiply_at(
    level: Level,
    dst: &mut [f32],
    dst_row: usize,
    p: Product,
    threads: usize,
) {
    let problem = Problem {
        dst: dst.as_mut_ptr(),
        dst_row,
        p,
    };
    // Safety (both): the shares are disjoint and inside (m, n); the CPU has the level.
    let run = |rows, cols| unsafe {
        match level {
            Level::Avx2 => problem.run::<MR_AVX2, NR_AVX2>(rows, cols, tile_avx2),
            Level::Avx512 => problem.run::<MR_AVX512, NR_AVX512>(rows, cols, tile_avx512),
        }
    };
    if threads < 2 || p.macs() < PARALLEL_MIN_MACS {
        return run(0..p.m, 0..p.n);
    }
    split_dst((p.m, p.n), threads, level.shape(), run);
}

/// A register tile: `kc` k from one A panel and one B panel, added into dst.
type TileFn = unsafe fn(usize, APanel, *const f32, Tile);

/// One product, read by the threads that compute its parts.
struct Problem<'a> {
    dst: *mut f32,
    dst_row: usize,
    p: Product<'a>,
}

// Safety: threads write disjoint blocks of `dst`; the operands are shared reads.
unsafe impl Sync for Problem<'_> {}

/// The first `len` f32 of a per-thread pack buffer (`panels`, shared with bf16's
/// kernels, which a thread never runs at the same time), on a 64-byte boundary: the
/// tile's loads of B never straddle two lines.
fn floats(buffer: &mut Vec<u32>, len: usize) -> &mut [f32] {
    let words = scratch(buffer, len);
    // Safety: u32 and f32 share size and alignment, and every bit pattern is an f32.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<f32>(), words.len()) }
}

impl Problem<'_> {
    /// The block (rows, cols) of dst, on this thread.
    ///
    /// # Safety
    /// As `multiply`'s, and no other thread touches this block of dst meanwhile.
    unsafe fn run<const MR: usize, const NR: usize>(
        &self,
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
        tile_fma: TileFn,
    ) {
        let p = &self.p;
        if rows.is_empty() || cols.is_empty() {
            return;
        }
        if p.k == 0 {
            // An empty sum: dst = dst (if accumulating) + beta * 0.
            if !p.accumulate {
                for r in rows {
                    let row = self.dst.add(r * self.dst_row + cols.start);
                    std::ptr::write_bytes(row, 0, cols.len());
                }
            }
            return;
        }
        PANELS.with(|packs| {
            let packs = &mut *packs.borrow_mut();
            let blocks = p.k.div_ceil(kc_max(NR));
            let step = p.k.div_ceil(blocks);
            for j0 in cols.clone().step_by(NC) {
                let nc = NC.min(cols.end - j0);
                for k0 in (0..p.k).step_by(step) {
                    let kc = step.min(p.k - k0);
                    let b = floats(&mut packs.b, nc.div_ceil(NR) * NR * kc);
                    pack_b::<NR>(b, &p.b, k0, kc, j0, nc);
                    let load = p.accumulate || k0 > 0;
                    for i0 in rows.clone().step_by(mc(MR)) {
                        let mc = mc(MR).min(rows.end - i0);
                        // A read down its columns (a weight gradient's activations)
                        // would touch a line a k, more lines than L1 holds beside B's
                        // panel: those are packed; rows along memory are read in place.
                        let packed = (p.a.row == 1 && p.a.col != 1).then(|| {
                            let a = floats(&mut packs.a, mc.div_ceil(MR) * MR * kc);
                            pack_a::<MR>(a, &p.a, i0, mc, k0, kc);
                            &*a
                        });
                        for (jp, b_panel) in b.chunks_exact(NR * kc).enumerate() {
                            let c0 = j0 + jp * NR;
                            for r0 in (i0..i0 + mc).step_by(MR) {
                                let height = MR.min(i0 + mc - r0);
                                if p.causal.skips_tile(r0 + height, c0) {
                                    continue;
                                }
                                // The k of this block the tile's rows may hold non-zero
                                // in A (attention's triangles).
                                let span = p.causal.k_span(r0..r0 + height, k0, kc);
                                let (from, to) = (span.start, span.end);
                                if from == to && load {
                                    // Nothing to add to what dst holds.
                                    continue;
                                }
                                let a = match packed {
                                    Some(a) => APanel {
                                        first: a.as_ptr().add((r0 - i0) * kc + from * MR),
                                        row: 1,
                                        step: MR,
                                        height,
                                    },
                                    None => APanel {
                                        first: p
                                            .a
                                            .data
                                            .as_ptr()
                                            .add(r0 * p.a.row + (k0 + from) * p.a.col),
                                        row: p.a.row,
                                        step: p.a.col,
                                        height,
                                    },
                                };
                                let tile = Tile {
                                    c: self.dst.add(r0 * self.dst_row + c0),
                                    row: self.dst_row,
                                    height: a.height,
                                    width: NR.min(j0 + nc - c0),
                                    load,
                                    beta: p.beta,
                                };
                                tile_fma(to - from, a, b_panel.as_ptr().add(from * NR), tile);
                            }
                        }
                    }
                }
            }
        })
    }
}

/// Rows i0..i0 + mc, k k0..k0 + kc of `a`, whose columns run along memory, as
/// `MR`-row panels: panel i holds, per k, its rows' values side by side (MR
/// neighbours copied a k); rows past mc are zeros.
fn pack_a<const MR: usize>(
    out: &mut [f32],
    a: &Strided,
    i0: usize,
    mc: usize,
    k0: usize,
    kc: usize,
) {
    for (ip, panel) in out.chunks_exact_mut(MR * kc).enumerate() {
        let r0 = i0 + ip * MR;
        let height = MR.min(i0 + mc - r0);
        for (kk, values) in panel.chunks_exact_mut(MR).enumerate() {
            let start = (k0 + kk) * a.col + r0 * a.row;
            if height == MR {
                // A tile's rows of a known size: a move or two, where a copy of a
                // length only known at run time was a call to memcpy a k (a tenth of
                // the weight gradients' time).
                let column: &[f32; MR] = a.data[start..start + MR].try_into().unwrap();
                values.copy_from_slice(column);
            } else {
                values[..height].copy_from_slice(&a.data[start..start + height]);
                values[height..].fill(0.0);
            }
        }
    }
}

/// Up to `MR` rows of A, read where they lie (A is not packed: each value serves a
/// whole block of columns, so reading it in place costs what copying it would): value
/// (i, k) at `first + i * row + k * step`, for i < `height`.
struct APanel {
    first: *const f32,
    row: usize,
    step: usize,
    height: usize,
}

/// k k0..k0 + kc, columns j0..j0 + nc of `b` as `NR`-column panels: panel j holds, per
/// k, its columns' values side by side; columns past nc are zeros.
///
/// # Safety
/// The CPU must have AVX2.
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_b<const NR: usize>(
    out: &mut [f32],
    b: &Strided,
    k0: usize,
    kc: usize,
    j0: usize,
    nc: usize,
) {
    for (jp, panel) in out.chunks_exact_mut(NR * kc).enumerate() {
        let c0 = j0 + jp * NR;
        let width = NR.min(j0 + nc - c0);
        if b.col == 1 {
            // B's rows (fixed k) run along memory: a tile's width of neighbours a k.
            let (values, _) = panel.as_chunks_mut::<NR>();
            for (kk, values) in values.iter_mut().enumerate() {
                let start = (k0 + kk) * b.row + c0;
                if width == NR {
                    // Values of a known count: vector moves, where a copy of a length
                    // known only at run time was a call to memcpy a k (4% of the baby
                    // model's step on one Zen 3 thread).
                    *values = b.data[start..start + NR].try_into().unwrap();
                } else {
                    values[..width].copy_from_slice(&b.data[start..start + width]);
                    values[width..].fill(0.0);
                }
            }
            continue;
        }
        // B's columns run along memory (the forward's transposed weights): whole 8 x 8
        // blocks through vector transposes (one value at a time, the baby model's
        // products were 4% behind the gemm crate's; level with them), the rest singly.
        let whole = if b.row == 1 && width == NR {
            kc / 8 * 8
        } else {
            0
        };
        for half in 0..NR / 8 {
            for kk in (0..whole).step_by(8) {
                let start = (c0 + 8 * half) * b.col + k0 + kk;
                let rows: [&[f32]; 8] = std::array::from_fn(|j| &b.data[start + j * b.col..][..8]);
                transpose_8x8(rows, &mut panel[kk * NR + 8 * half..], NR);
            }
        }
        for j in 0..NR {
            if j < width {
                let start = (c0 + j) * b.col + k0 * b.row;
                for (kk, values) in panel.chunks_exact_mut(NR).enumerate().skip(whole) {
                    values[j] = b.data[start + kk * b.row];
                }
            } else {
                panel.iter_mut().skip(j).step_by(NR).for_each(|v| *v = 0.0);
            }
        }
    }
}

/// out[t * nr + j] = rows[j][t] for t, j < 8: eight rows of eight into eight k of a
/// panel `nr` wide.
#[target_feature(enable = "avx2,fma")]
unsafe fn transpose_8x8(rows: [&[f32]; 8], out: &mut [f32], nr: usize) {
    assert!(out.len() >= 7 * nr + 8);
    // A loop, not `std::array::from_fn`, whose closure would be compiled without AVX2
    // and call the load.
    let mut r = [_mm256_setzero_ps(); 8];
    for (r, row) in r.iter_mut().zip(rows) {
        *r = _mm256_loadu_ps(row.as_ptr());
    }
    let t = [
        _mm256_unpacklo_ps(r[0], r[1]),
        _mm256_unpackhi_ps(r[0], r[1]),
        _mm256_unpacklo_ps(r[2], r[3]),
        _mm256_unpackhi_ps(r[2], r[3]),
        _mm256_unpacklo_ps(r[4], r[5]),
        _mm256_unpackhi_ps(r[4], r[5]),
        _mm256_unpacklo_ps(r[6], r[7]),
        _mm256_unpackhi_ps(r[6], r[7]),
    ];
    let u = [
        _mm256_shuffle_ps::<0x44>(t[0], t[2]),
        _mm256_shuffle_ps::<0xee>(t[0], t[2]),
        _mm256_shuffle_ps::<0x44>(t[1], t[3]),
        _mm256_shuffle_ps::<0xee>(t[1], t[3]),
        _mm256_shuffle_ps::<0x44>(t[4], t[6]),
        _mm256_shuffle_ps::<0xee>(t[4], t[6]),
        _mm256_shuffle_ps::<0x44>(t[5], t[7]),
        _mm256_shuffle_ps::<0xee>(t[5], t[7]),
    ];
    for i in 0..4 {
        let low = _mm256_permute2f128_ps::<0x20>(u[i], u[i + 4]);
        let high = _mm256_permute2f128_ps::<0x31>(u[i], u[i + 4]);
        _mm256_storeu_ps(out.as_mut_ptr().add(i * nr), low);
        _mm256_storeu_ps(out.as_mut_ptr().add((i + 4) * nr), high);
    }
}

/// The vector operations a tile is written in, at one register width.
trait Lanes: Copy {
    /// f32 lanes in a register.
    const N: usize;
    unsafe fn zero() -> Self;
    /// From an address on the register's width.
    unsafe fn load(p: *const f32) -> Self;
    unsafe fn load_unaligned(p: *const f32) -> Self;
    /// One value in every lane.
    unsafe fn splat(x: f32) -> Self;
    /// a * b + c, rounded once.
    unsafe fn mul_add(a: Self, b: Self, c: Self) -> Self;
    unsafe fn mul(a: Self, b: Self) -> Self;
    unsafe fn store_unaligned(p: *mut f32, v: Self);
}

impl Lanes for __m256 {
    const N: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> Self {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        _mm256_load_ps(p)
    }
    #[inline(always)]
    unsafe fn load_unaligned(p: *const f32) -> Self {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        _mm256_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn mul_add(a: Self, b: Self, c: Self) -> Self {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        _mm256_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn store_unaligned(p: *mut f32, v: Self) {
        _mm256_storeu_ps(p, v)
    }
}

impl Lanes for __m512 {
    const N: usize = 16;
    #[inline(always)]
    unsafe fn zero() -> Self {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        _mm512_load_ps(p)
    }
    #[inline(always)]
    unsafe fn load_unaligned(p: *const f32) -> Self {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        _mm512_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn mul_add(a: Self, b: Self, c: Self) -> Self {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        _mm512_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn store_unaligned(p: *mut f32, v: Self) {
        _mm512_storeu_ps(p, v)
    }
}

/// The AVX2 tile ([`register_tile`]).
///
/// # Safety
/// AVX2 and FMA; as [`register_tile`]'s, B on a 32-byte boundary.
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2(kc: usize, a: APanel, b: *const f32, dst: Tile) {
    register_tile::<__m256, MR_AVX2, NR_AVX2>(kc, a, b, dst)
}

/// The AVX-512 tile ([`register_tile`]).
///
/// # Safety
/// AVX-512 F; as [`register_tile`]'s, B on a 64-byte boundary.
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512(kc: usize, a: APanel, b: *const f32, dst: Tile) {
    register_tile::<__m512, MR_AVX512, NR_AVX512>(kc, a, b, dst)
}

/// A tile of `MR` rows by `NR` columns (two registers of `V`): `kc` k from one A panel
/// and one B panel, added into dst. Inlined into a caller compiled for `V`'s level,
/// where its vector operations become single instructions.
///
/// # Safety
/// The CPU must have `V`'s level; `a`'s rows hold `kc` values each, `b` holds `NR * kc`
/// on a boundary of `V`'s width, and the tile's `height` x `width` of dst are writable.
#[inline(always)]
unsafe fn register_tile<V: Lanes, const MR: usize, const NR: usize>(
    kc: usize,
    a: APanel,
    b: *const f32,
    tile: Tile,
) {
    debug_assert_eq!(NR, 2 * V::N);
    let mut acc = [[V::zero(); 2]; MR];
    // Rows past the panel's height read row 0 again (their sums are never stored), so
    // every read stays inside A.
    let rows: [*const f32; MR] =
        std::array::from_fn(|r| a.first.add(if r < a.height { r * a.row } else { 0 }));
    // Fetch the tile of dst now, so its misses overlap the products instead of
    // stalling the stores at the end (the forward's 384-wide products: 68 -> 84 GFLOP/s on
    // one Zen 3 core).
    for r in 0..tile.height {
        _mm_prefetch::<_MM_HINT_T0>(tile.c.add(r * tile.row).cast());
        _mm_prefetch::<_MM_HINT_T0>(tile.c.add(r * tile.row + tile.width - 1).cast());
    }
    for kk in 0..kc {
        let b = b.add(kk * NR);
        let (b0, b1) = (V::load(b), V::load(b.add(V::N)));
        let at = kk * a.step;
        for (row, first) in acc.iter_mut().zip(rows) {
            let x = V::splat(*first.add(at));
            row[0] = V::mul_add(x, b0, row[0]);
            row[1] = V::mul_add(x, b1, row[1]);
        }
    }
    let beta = V::splat(tile.beta);
    if tile.height == MR && tile.width == NR {
        for (r, row) in acc.iter().enumerate() {
            let c = tile.c.add(r * tile.row);
            for (v, &sum) in row.iter().enumerate() {
                let c = c.add(V::N * v);
                let out = if tile.load {
                    V::mul_add(sum, beta, V::load_unaligned(c))
                } else {
                    V::mul(sum, beta)
                };
                V::store_unaligned(c, out);
            }
        }
        return;
    }
    // An edge: the whole tile to the stack, its real part to dst, with the same
    // arithmetic as above (fused multiply-add, or a product).
    let mut sums = [[0f32; NR]; MR];
    for (out, row) in sums.iter_mut().zip(&acc) {
        V::store_unaligned(out.as_mut_ptr(), row[0]);
        V::store_unaligned(out.as_mut_ptr().add(V::N), row[1]);
    }
    for (r, row) in sums.iter().enumerate().take(tile.height) {
        let c = std::slice::from_raw_parts_mut(tile.c.add(r * tile.row), tile.width);
        for (out, &sum) in c.iter_mut().zip(row) {
            *out = if tile.load {
                sum.mul_add(tile.beta, *out)
            } else {
                sum * tile.beta
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::matrix::{Causal, Layout};
    use super::*;

    /// The tiles this CPU runs; says loudly which it cannot.
    fn levels() -> Vec<Level> {
        let avx2 = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma");
        let avx512 = avx2 && std::arch::is_x86_feature_detected!("avx512f");
        if !avx2 {
            eprintln!("SKIPPED: sgemm's AVX2 tile needs AVX2 and FMA, which this CPU lacks");
        }
        if !avx512 {
            eprintln!("SKIPPED: sgemm's AVX-512 tile needs AVX-512 F, which this CPU lacks");
        }
        [(Level::Avx2, avx2), (Level::Avx512, avx512)]
            .into_iter()
            .filter_map(|(level, has)| has.then_some(level))
            .collect()
    }

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 37 + seed * 101) % 29) as f32 * 0.07 - 0.95)
            .collect()
    }

    /// dst = start (if accumulating) + beta * a · b, in f64 from the dense (m x k) and
    /// (k x n) row-major operands.
    fn definition(
        start: &[f32],
        a: &[f32],
        b: &[f32],
        (m, n, k): (usize, usize, usize),
        p: &Product,
    ) -> Vec<f64> {
        (0..m * n)
            .map(|i| {
                let (r, c) = (i / n, i % n);
                let sum: f64 = (0..k)
                    .map(|kk| a[r * k + kk] as f64 * b[kk * n + c] as f64)
                    .sum();
                let base = if p.accumulate { start[i] as f64 } else { 0.0 };
                base + p.beta as f64 * sum
            })
            .collect()
    }

    fn transposed(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols)
            .map(|i| x[(i % rows) * cols + i / rows])
            .collect()
    }

    /// Every layout of both operands, edges in every direction (m, n not multiples of
    /// the tile, k past one block and not a multiple of it), accumulating and scaled,
    /// against the product in f64 within f32's rounding of a k-long sum.
    #[test]
    fn every_layout_and_edge_matches_the_definition() {
        for level in levels() {
            every_layout_and_edge_matches_the_definition_at(level);
        }
    }

    fn every_layout_and_edge_matches_the_definition_at(level: Level) {
        for (m, n, k) in [
            (1, 1, 1),
            (6, 16, 8),
            (8, 32, 8),
            (17, 50, 129),
            (7, 17, 300),
            (13, 35, 513),
            (150, 40, 64),
            (20, 3100, 5),
        ] {
            let (a, b) = (values(m * k, 1), values(k * n, 2));
            let (at, bt) = (transposed(&a, m, k), transposed(&b, k, n));
            let start = values(m * n, 3);
            for (aa, al) in [(&a, Layout::AsIs), (&at, Layout::Transposed)] {
                for (bb, bl) in [(&b, Layout::AsIs), (&bt, Layout::Transposed)] {
                    for (accumulate, beta) in [(false, 1.0), (false, 0.5), (true, -0.5)] {
                        let p = Product {
                            accumulate,
                            beta,
                            ..Product::new(
                                Strided::dense(aa, al, m, k),
                                Strided::dense(bb, bl, k, n),
                                (m, n, k),
                            )
                        };
                        let want = definition(&start, &a, &b, (m, n, k), &p);
                        let mut got = start.clone();
                        // Safety: the CPU has the level (`levels`); dst is m x n.
                        unsafe { multiply_at(level, &mut got, n, p, 1) };
                        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                            let bound = 1e-6 * (k as f64 + 1.0) * (1.0 + w.abs());
                            assert!(
                                (*g as f64 - w).abs() <= bound,
                                "{level:?} {m}x{n}x{k} {al:?} {bl:?} acc {accumulate}: ({}, {}) {g} vs {w}",
                                i / n,
                                i % n
                            );
                        }
                    }
                }
            }
        }
    }

    /// Attention's triangles, skipped tile by tile: a causal product matches the plain
    /// one on the part it promises (all of dst where A is triangular, dst's lower
    /// triangle for `LowerDst`), with T past a tile's edge and past one k block, A in
    /// either layout, accumulating or not. dst starts as NaN where it is not
    /// accumulated, so an element left unwritten fails too.
    #[test]
    fn causal_products_match_the_definition_on_their_part() {
        for level in levels() {
            causal_products_match_the_definition_on_their_part_at(level);
        }
    }

    fn causal_products_match_the_definition_on_their_part_at(level: Level) {
        for t in [1, 5, 6, 7, 17, 64, 70, 300] {
            for d in [3, 32] {
                for causal in [Causal::LowerDst, Causal::LowerA, Causal::UpperA] {
                    let (m, n, k) = match causal {
                        Causal::LowerDst => (t, t, d),
                        _ => (t, d, t),
                    };
                    let mut a = values(m * k, 8);
                    for (i, x) in a.iter_mut().enumerate() {
                        if causal.zero_in_a(i / k, i % k) {
                            *x = 0.0;
                        }
                    }
                    let b = values(k * n, 9);
                    let at = transposed(&a, m, k);
                    for (aa, al) in [(&a, Layout::AsIs), (&at, Layout::Transposed)] {
                        for (accumulate, beta) in [(false, 0.5), (true, -1.0)] {
                            let p = Product {
                                accumulate,
                                beta,
                                ..Product::new(
                                    Strided::dense(aa, al, m, k),
                                    Strided::rows(&b, n),
                                    (m, n, k),
                                )
                            }
                            .causal(causal);
                            let start = values(m * n, 10);
                            let want = definition(&start, &a, &b, (m, n, k), &p);
                            let mut got = if accumulate {
                                start
                            } else {
                                vec![f32::NAN; m * n]
                            };
                            // Safety: the CPU has the level (`levels`); dst is m x n.
                            unsafe { multiply_at(level, &mut got, n, p, 1) };
                            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                                let (r, c) = (i / n, i % n);
                                if causal == Causal::LowerDst && c > r {
                                    continue;
                                }
                                let bound = 1e-6 * (k as f64 + 1.0) * (1.0 + w.abs());
                                assert!(
                                    (*g as f64 - w).abs() <= bound,
                                    "{level:?} {causal:?} t {t} d {d} {al:?} acc {accumulate}: ({r}, {c}) {g} vs {w}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// An empty sum leaves dst (accumulating) or clears it, and a wider dst's other
    /// columns are untouched.
    #[test]
    fn an_empty_sum_and_a_wider_dst() {
        for level in levels() {
            an_empty_sum_and_a_wider_dst_at(level);
        }
    }

    fn an_empty_sum_and_a_wider_dst_at(level: Level) {
        let (m, n, k, dst_row) = (9, 18, 0, 21);
        let none: [f32; 0] = [];
        let p = Product::new(Strided::rows(&none, 0), Strided::rows(&none, n), (m, n, k));
        let mut dst = vec![2.0f32; m * dst_row];
        // Safety: the CPU has the level (`levels`); dst holds m rows of dst_row.
        unsafe { multiply_at(level, &mut dst, dst_row, p.accumulating(), 1) };
        assert!(dst.iter().all(|&x| x == 2.0));
        unsafe { multiply_at(level, &mut dst, dst_row, p, 1) };
        for row in dst.chunks(dst_row) {
            assert!(row[..n].iter().all(|&x| x == 0.0) && row[n..].iter().all(|&x| x == 2.0));
        }
        let (k, a, b) = (5, values(m * 5, 4), values(5 * n, 5));
        let p = Product::new(Strided::rows(&a, k), Strided::rows(&b, n), (m, n, k));
        let mut dst = vec![2.0f32; m * dst_row];
        unsafe { multiply_at(level, &mut dst, dst_row, p, 1) };
        assert!(dst
            .chunks(dst_row)
            .all(|row| row[n..].iter().all(|&x| x == 2.0)));
    }

    /// Split by rows (m >= n) or by columns over 2 and 3 threads, dst has the bits of
    /// one thread's product.
    #[test]
    fn threads_do_not_change_the_bits() {
        for level in levels() {
            threads_do_not_change_the_bits_at(level);
        }
    }

    fn threads_do_not_change_the_bits_at(level: Level) {
        for (m, n, k) in [(301, 70, 400), (70, 301, 400)] {
            let (a, b) = (values(m * k, 6), values(k * n, 7));
            let p =
                Product::new(Strided::rows(&a, k), Strided::rows(&b, n), (m, n, k)).scaled(0.25);
            assert!(p.macs() >= PARALLEL_MIN_MACS);
            let mut one = vec![0f32; m * n];
            unsafe { multiply_at(level, &mut one, n, p, 1) };
            for threads in [2, 3] {
                let mut many = vec![0f32; m * n];
                unsafe { multiply_at(level, &mut many, n, p, threads) };
                assert!(
                    one.iter()
                        .zip(&many)
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{level:?} {m}x{n}x{k} on {threads}"
                );
            }
        }
    }
}
