//! Matrix products with bf16 operands and f32 accumulation: the GEMM behind
//! `train.dtype = "bf16"` mixed precision.
//!
//! Operands stay f32 in memory (the master weights and the activations); they are
//! rounded to bf16 (to nearest, ties to even) while being packed into the small
//! panels the inner kernel reads, so no bf16 copy of any tensor is kept. Products
//! of two bf16 numbers are exact in f32, and sums are f32: the only precision lost
//! is the rounding of each operand to 8 significant bits.
//!
//! The inner kernel is `vdpbf16ps` (AVX512_BF16): per 32-bit lane, two bf16 products
//! added to an f32 accumulator, twice the multiply-adds of an f32 FMA per instruction.
//! That pairs up neighbouring k: a packed operand holds, per 32-bit word, the bf16 of
//! k = 2p in the low half and k = 2p + 1 in the high half. CPUs without AVX512_BF16
//! run the same packed data through f32 FMAs (AVX-512F, AVX2, or plain Rust), each pair
//! widened (exact) and its odd k added before its even k, as `vdpbf16ps` adds them: the
//! same bits on every CPU, at f32's speed there.
//!
//! Blocking follows BLIS/gemm: k in blocks of `KC`, rows in blocks of `MC` packed as
//! `MR`-row panels, columns packed as `NR`-column panels, an `MR` x `NR` tile of
//! accumulators in registers (6 x 64 f32 = 24 AVX-512 registers). Large products
//! are split over threads by rows or columns, weight gradients (long k) by k; the
//! products inside causal attention skip what the mask makes zero (`Causal`).

use super::matrix::{Product, Strided, Tile, PARALLEL_MIN_MACS};
use super::panels::{scratch, PANELS};
use super::threads::{split_dst, threads, with_partials};

const MR: usize = 6;
const NR: usize = 64;
/// k per packed block, about (even, so pairs never straddle blocks), for sums longer
/// than `KC_SINGLE`: a B panel of 384 pairs x 64 columns is 96 KiB, in L2.
const KC: usize = 768;
/// Up to this k, one block. Each further block is another pass over the tiles of dst
/// (loaded, added to, stored), and for the 1536-long sums of the MLP's forward and
/// input-gradient products those passes cost more than the B panel (then 192 KiB, in
/// L2, not L1) saves: on a Zen 4 core (32 KiB L1, 1 MiB L2) the 4096 x 384 x 1536
/// products ran at 136-141 GFLOP/s in blocks of 256, 153-170 in blocks of 512 or 768,
/// and 184-206 in one (`examples/gemm_probe.rs`, one thread; the vdpbf16ps loop's peak
/// 222); the 384-long products were level, the 4096-long weight gradients too.
const KC_SINGLE: usize = 1536;
/// Rows per packed block of A (a multiple of `MR`): 96 rows x up to 768 pairs, at most
/// 288 KiB, in L2 (48 or 192 rows measured level).
const MC: usize = 96;

/// The upper 16 bits of an f32 (bf16): widening is a shift.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(transparent)]
pub struct Bf16(pub u16);

// Safety: every bit pattern is a bf16; 2 divides 64.
unsafe impl super::lines::Plain for Bf16 {}

impl Bf16 {
    /// The bf16 nearest to `x` (ties to even).
    pub fn round(x: f32) -> Self {
        Self(to_bf16_bits(x))
    }
}

impl super::kernels::Widen for Bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }
}

/// The bits of the bf16 nearest to `x` (ties to even); NaN stays NaN.
#[inline(always)]
pub fn to_bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
    let quiet_nan = (bits >> 16) | 0x40;
    (if bits & 0x7fff_ffff > 0x7f80_0000 {
        quiet_nan
    } else {
        rounded
    }) as u16
}

/// `x` rounded to the nearest bf16, as an f32.
#[inline(always)]
pub fn round_to_bf16(x: f32) -> f32 {
    f32::from_bits((to_bf16_bits(x) as u32) << 16)
}

/// One 32-bit word of a packed operand: `even` (k = 2p) low, `odd` (k = 2p + 1) high.
#[inline(always)]
fn pair(even: f32, odd: f32) -> u32 {
    to_bf16_bits(even) as u32 | (to_bf16_bits(odd) as u32) << 16
}

/// dst (rows `dst_row` apart) = the product `p`, with its operands rounded to bf16 and
/// f32 sums. Splits the work over the available threads when it is large enough.
pub fn matmul(dst: &mut [f32], dst_row: usize, p: Product) {
    if p.macs() < PARALLEL_MIN_MACS {
        return matmul_serial(dst, dst_row, p);
    }
    p.check_bounds(dst, dst_row);
    let (m, n) = (p.m, p.n);
    // Asked before the thread count: the parts of a long sum are its bits, on one
    // thread too.
    if p.k >= 4 * m.max(n) {
        return split_k(dst, dst_row, p);
    }
    let threads = threads();
    if threads < 2 {
        return matmul_serial(dst, dst_row, p);
    }
    let problem = Problem {
        dst: dst.as_mut_ptr(),
        dst_row,
        p,
    };
    // Shares of whole blocks of the kernel that runs: AMX sums a k block into dst's
    // whole 32 x 32 blocks in its tiles and an edge block's apart, then adds, so a share
    // cut through a block rounded it otherwise than one thread (past one k block).
    #[cfg(target_arch = "x86_64")]
    let unit = if super::isa::active() == super::isa::Isa::Amx && super::amx::takes(&p) {
        (super::amx::BLOCK, NR.next_multiple_of(super::amx::BLOCK))
    } else {
        (MR, NR)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let unit = (MR, NR);
    // Safety: the shares are disjoint and inside (m, n), which was checked above.
    split_dst((m, n), threads, unit, |rows, cols| unsafe {
        problem.run(rows, cols)
    });
}

/// `matmul` on this thread, skipping what `p.causal` allows: tiles of dst above the
/// diagonal (`LowerDst`), or the k past (`LowerA`) or before (`UpperA`) each row's
/// diagonal, which are zeros of A. Packing skips them too.
pub fn matmul_serial(dst: &mut [f32], dst_row: usize, p: Product) {
    if p.m == 0 || p.n == 0 {
        return;
    }
    p.check_bounds(dst, dst_row);
    let problem = Problem {
        dst: dst.as_mut_ptr(),
        dst_row,
        p,
    };
    // Safety: bounds checked above; `dst` is borrowed mutably.
    unsafe { problem.run(0..p.m, 0..p.n) }
}

/// The most parts [`split_k`] cuts a long sum into, and the fewest k a part takes.
const K_PARTS: usize = 4;
const K_PART_MIN: usize = 128;

/// A long sum (weight gradients: k is the token count) cut by k into parts that depend
/// on k alone ([`k_share`]): each part multiplies its own stretch of both operands
/// (nothing packed twice) into its own partial product, on whichever thread is free,
/// and the partials are added into dst in part order. Cut by thread instead, the bits
/// followed the thread count: a bf16 run resumed under another RAYON_NUM_THREADS left
/// the unbroken run's path.
fn split_k(dst: &mut [f32], dst_row: usize, p: Product) {
    let (m, n, k) = (p.m, p.n, p.k);
    let share = k_share(k);
    let shares = k.div_ceil(share);
    let part = |i: usize| {
        let k0 = i * share;
        p.k_range(k0, share.min(k - k0))
    };
    with_partials((shares - 1) * m * n, |partials| {
        rayon::scope(|scope| {
            for (i, out) in partials.chunks_exact_mut(m * n).enumerate() {
                let part = Product {
                    accumulate: false,
                    beta: 1.0,
                    ..part(i + 1)
                };
                scope.spawn(move |_| matmul_serial(out, n, part));
            }
            matmul_serial(dst, dst_row, part(0));
        });
        for out in partials.chunks_exact(m * n) {
            for (row, add) in dst.chunks_mut(dst_row).zip(out.chunks_exact(n)) {
                for (d, x) in row.iter_mut().zip(add) {
                    *d += p.beta * x;
                }
            }
        }
    })
}

/// The k of each of [`split_k`]'s parts (the last may be shorter): k in at most
/// [`K_PARTS`] parts of at least [`K_PART_MIN`], an even count each (the packed operands
/// pair k). Enough parts for four threads, few enough that the partials' adds stay a
/// sliver of the product's (3 m n adds against m n k multiply-adds): the baby bf16 step
/// (k 768) took the same time within the VM's drift cut in 2 (by thread, before), 4 or
/// 8 parts on two Zen 5 cores.
fn k_share(k: usize) -> usize {
    k.div_ceil(K_PARTS).max(K_PART_MIN).next_multiple_of(2)
}

/// One product, shared (read-only) by the threads that compute its parts.
struct Problem<'a> {
    dst: *mut f32,
    dst_row: usize,
    /// Rows and columns count from the product's first (`run` over the whole of it).
    p: Product<'a>,
}

// Safety: threads write disjoint parts of `dst` (`split_dst`), and the operands are
// shared reads.
unsafe impl Sync for Problem<'_> {}

impl Problem<'_> {
    /// Computes the block (rows, cols) of dst on this thread.
    ///
    /// # Safety
    /// rows and cols must lie inside the bounds checked by `matmul`, and no other
    /// thread may touch this block of dst meanwhile.
    unsafe fn run(&self, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) {
        // The AMX tiles where the level allows them, for operands with a unit stride
        // (every product the engine makes).
        #[cfg(target_arch = "x86_64")]
        if super::isa::active() == super::isa::Isa::Amx && super::amx::takes(&self.p) {
            return super::amx::multiply(self.dst, self.dst_row, &self.p, rows, cols);
        }
        self.run_with(Kernel::pick(), rows, cols)
    }

    /// `run` with a given inner kernel.
    ///
    /// # Safety
    /// As for `run`; the CPU must have what `kernel` needs.
    unsafe fn run_with(
        &self,
        kernel: Kernel,
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
    ) {
        PANELS.with(|panels| {
            let panels = &mut *panels.borrow_mut();
            let n = cols.len();
            let col_panels = n.div_ceil(NR);
            if self.p.k == 0 {
                // An empty sum: dst = dst (if accumulating) + beta * 0.
                for r in rows {
                    let row = self.dst.add(r * self.dst_row + cols.start);
                    for j in 0..n {
                        *row.add(j) = if self.p.accumulate { *row.add(j) } else { 0.0 };
                    }
                }
                return;
            }
            // Equal k blocks of about KC (even), or one up to KC_SINGLE.
            let blocks = if self.p.k <= KC_SINGLE {
                1
            } else {
                self.p.k.div_ceil(KC)
            };
            let step = self.p.k.div_ceil(blocks).next_multiple_of(2);
            for k0 in (0..self.p.k).step_by(step) {
                let kc = step.min(self.p.k - k0);
                let kp = kc.div_ceil(2);
                let b_panels = pack_b(
                    &mut panels.b,
                    &mut panels.column,
                    &self.p.b,
                    k0,
                    kc,
                    cols.clone(),
                );
                let load = self.p.accumulate || k0 > 0;
                let mut i0 = rows.start;
                while i0 < rows.end {
                    let mc = MC.min(rows.end - i0);
                    // Pairs of this k block that rows i0..i0+mc may hold non-zero.
                    let (a_from, a_to) = pairs(self.p.causal.k_span(i0..i0 + mc, k0, kc));
                    let strides = pack_a(&mut panels.a, &self.p.a, i0, mc, k0, kc, a_from..a_to);
                    let halves = if kernel.widens() {
                        let halves = scratch(&mut panels.halves, 2 * strides.words.len());
                        strides.split_into(a_from..a_to, halves);
                        halves.as_ptr()
                    } else {
                        std::ptr::null()
                    };
                    for jp in 0..col_panels {
                        let c0 = cols.start + jp * NR;
                        let b = b_panels.as_ptr().add(jp * kp * NR);
                        let width = NR.min(n - jp * NR);
                        for ip in 0..mc.div_ceil(MR) {
                            let r0 = i0 + ip * MR;
                            let height = MR.min(mc - ip * MR);
                            if self.p.causal.skips_tile(r0 + height, c0) {
                                continue;
                            }
                            let (from, to) = pairs(self.p.causal.k_span(r0..r0 + height, k0, kc));
                            let at = ip * MR * strides.row + from * strides.pair;
                            let a = APanel {
                                first: strides.words.as_ptr().add(at),
                                halves: halves.wrapping_add(2 * at),
                                row: strides.row,
                                pair: strides.pair,
                                height,
                            };
                            let b = b.add(from * NR);
                            let c = self.dst.add(r0 * self.dst_row + c0);
                            kernel.tile(
                                to - from,
                                a,
                                b,
                                Tile {
                                    c,
                                    row: self.dst_row,
                                    height,
                                    width,
                                    load,
                                    beta: self.p.beta,
                                },
                            );
                        }
                    }
                    i0 += mc;
                }
            }
        })
    }
}

/// The pairs holding the k of `span` (counted from a block's first k): from the pair
/// of its first to the pair of its last.
fn pairs(span: std::ops::Range<usize>) -> (usize, usize) {
    (span.start / 2, span.end.div_ceil(2).max(span.start / 2))
}

/// Rows i0..i0+mc, k k0..k0+kc of A as pair words, in whichever order reads A along
/// memory: word (i, p) is at `i * row + p * pair`. k past kc reads as zero.
struct APairs<'d> {
    words: &'d [u32],
    row: usize,
    pair: usize,
    /// Whether a pair's rows lie side by side (`row` 1, `pair` mc), rather than a
    /// row's pairs (`row` kp, `pair` 1).
    by_columns: bool,
}

impl APairs<'_> {
    /// Splits the words of `pairs` (those `pack_a` filled) into `halves`, laid out as
    /// the words are but two to a word (`split_halves`).
    fn split_into(&self, pairs: std::ops::Range<usize>, halves: &mut [u32]) {
        let mut split = |span: std::ops::Range<usize>| {
            split_halves(
                &self.words[span.clone()],
                &mut halves[2 * span.start..2 * span.end],
            );
        };
        if self.by_columns {
            split(pairs.start * self.pair..pairs.end * self.pair);
        } else {
            for start in (0..self.words.len()).step_by(self.row) {
                split(start + pairs.start..start + pairs.end);
            }
        }
    }
}

/// Packs rows i0..i0+mc, k k0..k0+kc of `a` into `dst` (see `APairs`); only the pairs
/// in `pairs` (the rest of the layout is left stale: the kernel will not read it).
fn pack_a<'d>(
    dst: &'d mut Vec<u32>,
    a: &Strided,
    i0: usize,
    mc: usize,
    k0: usize,
    kc: usize,
    pairs: std::ops::Range<usize>,
) -> APairs<'d> {
    let kp = kc.div_ceil(2);
    let out = scratch(dst, mc * kp);
    // Read A along memory: by columns (fixed k) when those are contiguous, else by rows.
    let by_columns = a.row == 1 && a.col != 1;
    fill_a(out, a, i0..i0 + mc, k0..k0 + kc, pairs, by_columns);
    let (row, pair) = if by_columns { (1, mc) } else { (kp, 1) };
    APairs {
        words: out,
        row,
        pair,
        by_columns,
    }
}

super::kernels::multiversion! {
    /// `pack_a`'s loops, compiled for the CPU's vector width.
    pub fn fill_a(
        out: &mut [u32],
        a: &Strided,
        rows: std::ops::Range<usize>,
        ks: std::ops::Range<usize>,
        pairs: std::ops::Range<usize>,
        by_columns: bool,
    ) {
        let (i0, mc, k0, kc) = (rows.start, rows.len(), ks.start, ks.len());
        let kp = kc.div_ceil(2);
        if by_columns {
            // Word (i, p) at p * mc + i: zip pairs of A's columns, all rows at once.
            for (p, out) in out.chunks_exact_mut(mc).enumerate().take(pairs.end).skip(pairs.start) {
                let even = &a.data[(k0 + 2 * p) * a.col + i0..][..mc];
                if 2 * p + 1 < kc {
                    zip_pairs(even, &a.data[(k0 + 2 * p + 1) * a.col + i0..][..mc], out);
                } else {
                    zip_pairs(even, even, out);
                    zero_odd(out);
                }
            }
        } else {
            // Word (i, p) at i * kp + p.
            let (k_from, k_to) = (2 * pairs.start, (2 * pairs.end).min(kc));
            for (i, out) in out.chunks_exact_mut(kp).enumerate() {
                let out = &mut out[pairs.clone()];
                let start = (i0 + i) * a.row + (k0 + k_from) * a.col;
                if a.col == 1 {
                    convert_pairs(&a.data[start..start + k_to - k_from], out);
                } else {
                    let len = k_to - k_from;
                    let at = |kk: usize| if kk < len { a.data[start + kk * a.col] } else { 0.0 };
                    for (p, w) in out.iter_mut().enumerate() {
                        *w = pair(at(2 * p), at(2 * p + 1));
                    }
                }
            }
        }
    }
}

/// Packs k k0..k0+kc, columns `cols` of `b` as `NR`-column panels: word (p, j) of a
/// panel holds column j's k pair p; columns past the end and k past kc are zeros.
/// `column` is scratch for one column's words.
fn pack_b<'d>(
    dst: &'d mut Vec<u32>,
    column: &mut Vec<u32>,
    b: &Strided,
    k0: usize,
    kc: usize,
    cols: std::ops::Range<usize>,
) -> &'d [u32] {
    let kp = kc.div_ceil(2);
    let panels = cols.len().div_ceil(NR);
    let out = scratch(dst, panels * kp * NR);
    let column = scratch(column, kp);
    fill_b(out, column, b, k0, kc, cols.start, cols.len());
    out
}

super::kernels::multiversion! {
    /// `pack_b`'s loops, compiled for the CPU's vector width.
    pub fn fill_b(
        out: &mut [u32],
        column: &mut [u32],
        b: &Strided,
        k0: usize,
        kc: usize,
        first_col: usize,
        n: usize,
    ) {
        let kp = kc.div_ceil(2);
        for (panel, out) in out.chunks_exact_mut(kp * NR).enumerate() {
            let c0 = first_col + panel * NR;
            let width = NR.min(n - panel * NR);
            if b.col == 1 {
                // B's rows (fixed k) run along memory: zip pairs of them.
                for (p, words) in out.chunks_exact_mut(NR).enumerate() {
                    let even = &b.data[(k0 + 2 * p) * b.row + c0..][..width];
                    let (used, padding) = words.split_at_mut(width);
                    if 2 * p + 1 < kc {
                        zip_pairs(even, &b.data[(k0 + 2 * p + 1) * b.row + c0..][..width], used);
                    } else {
                        zip_pairs(even, even, used);
                        zero_odd(used);
                    }
                    padding.fill(0);
                }
            } else {
                for j in 0..width {
                    let start = (c0 + j) * b.col + k0 * b.row;
                    if b.row == 1 {
                        convert_pairs(&b.data[start..start + kc], column);
                    } else {
                        let at = |kk: usize| if kk < kc { b.data[start + kk * b.row] } else { 0.0 };
                        for (p, w) in column.iter_mut().enumerate() {
                            *w = pair(at(2 * p), at(2 * p + 1));
                        }
                    }
                    for (p, &w) in column.iter().enumerate() {
                        out[p * NR + j] = w;
                    }
                }
                for p in 0..kp {
                    out[p * NR + width..(p + 1) * NR].fill(0);
                }
            }
        }
    }
}

/// out[p] = pair(src[2p], src[2p + 1]), the last odd element paired with zero.
#[inline(always)]
fn convert_pairs(src: &[f32], out: &mut [u32]) {
    debug_assert_eq!(out.len(), src.len().div_ceil(2));
    let whole = src.len() / 2;
    for (w, two) in out.iter_mut().zip(src.chunks_exact(2)) {
        *w = pair(two[0], two[1]);
    }
    if src.len() % 2 == 1 {
        out[whole] = pair(src[src.len() - 1], 0.0);
    }
}

/// out[j] = pair(even[j], odd[j]).
#[inline(always)]
fn zip_pairs(even: &[f32], odd: &[f32], out: &mut [u32]) {
    for ((w, e), o) in out.iter_mut().zip(even).zip(odd) {
        *w = pair(*e, *o);
    }
}

/// Clears the odd (high) half of every word: the pair past an odd k's end.
#[inline(always)]
fn zero_odd(words: &mut [u32]) {
    for w in words {
        *w &= 0xffff;
    }
}

super::kernels::multiversion! {
    /// Each pair word as its two f32s (bits), side by side in `halves`: the odd k's
    /// (the high half, masked), then the even k's (the low half, shifted up); exact, as
    /// widening is. One stream a row for the kernels, not two.
    pub fn split_halves(words: &[u32], halves: &mut [u32]) {
        for (w, h) in words.iter().zip(halves.chunks_exact_mut(2)) {
            h[0] = w & 0xffff_0000;
            h[1] = w << 16;
        }
    }
}

/// Up to `MR` rows of A's pair words for the inner kernel: word (i, p) at
/// `first + i * row + p * pair`, for i < `height`. For the kernels that widen, the same
/// words split into their two f32s (as bits, `split_halves`), side by side: the odd k's
/// at `halves + 2 * (i * row + p * pair)`, the even k's just after; null for
/// `vdpbf16ps`, which reads the words.
struct APanel {
    // Read by `vdpbf16ps` alone, an x86-64 kernel.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    first: *const u32,
    halves: *const u32,
    row: usize,
    pair: usize,
    height: usize,
}

impl APanel {
    /// Where each of the `MR` rows of `first`, or (`spread` 2) of `halves`, starts;
    /// rows past `height` repeat row 0 (their results are never stored), so every read
    /// stays inside the block.
    fn rows_of(&self, first: *const u32, spread: usize) -> [*const u32; MR] {
        std::array::from_fn(|i| {
            let i = if i < self.height { i } else { 0 };
            first.wrapping_add(spread * i * self.row)
        })
    }
}

/// An inner kernel: the tile for `kp` k pairs of one A panel and one B panel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    /// Plain Rust, vectorised for the CPU at hand (`accumulate_tile`).
    Portable,
    /// AVX2 FMAs on the pairs widened (`kernel_avx2`).
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512 FMAs on the pairs widened (`kernel_avx512`).
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// `vdpbf16ps` on the pairs as they are (`kernel_avx512_bf16`).
    #[cfg(target_arch = "x86_64")]
    Avx512Bf16,
}

impl Kernel {
    /// The fastest this CPU has at the active level.
    fn pick() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            use super::isa::{active, Isa};
            if has_avx512_bf16() {
                return Self::Avx512Bf16;
            }
            if active() >= Isa::Avx512 {
                return Self::Avx512;
            }
            if active() >= Isa::Avx2 {
                return Self::Avx2;
            }
        }
        Self::Portable
    }

    /// Whether it reads A's pairs widened (`APanel::halves`): done once per packed
    /// block rather than once per tile.
    fn widens(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        if self == Self::Avx512Bf16 {
            return false;
        }
        true
    }

    /// # Safety
    /// The CPU must have what the kernel needs; `a` (with its halves where the kernel
    /// widens) and `b` must hold `kp` packed pairs of a full panel each, and the tile
    /// must be writable.
    unsafe fn tile(self, kp: usize, a: APanel, b: *const u32, tile: Tile) {
        match self {
            Self::Portable => kernel_portable(kp, a, b, tile),
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => kernel_avx2(kp, a, b, tile),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => kernel_avx512(kp, a, b, tile),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512Bf16 => kernel_avx512_bf16(kp, a, b, tile),
        }
    }
}

/// Whether the `vdpbf16ps` kernel runs: the CPU has AVX512_BF16 and the active level
/// (`cpu::isa`) allows AVX-512. Otherwise the kernels that widen the pairs run.
pub fn has_avx512_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::isa::active() >= super::isa::Isa::Avx512
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// # Safety
/// The CPU must have AVX-512F and AVX512_BF16; `a` and `b` must hold `kp` packed
/// pairs of a full panel each, and the tile must be writable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn kernel_avx512_bf16(kp: usize, a: APanel, b: *const u32, tile: Tile) {
    use std::arch::x86_64::*;
    const V: usize = NR / 16;
    let mut acc = [[_mm512_setzero_ps(); V]; MR];
    let rows = a.rows_of(a.first, 1);
    // Fetch the tile of dst now, so its misses overlap the products instead of
    // stalling the stores at the end.
    for i in 0..tile.height {
        for v in 0..V {
            if 16 * v < tile.width {
                _mm_prefetch::<_MM_HINT_T0>(tile.c.add(i * tile.row + 16 * v).cast());
            }
        }
    }
    for p in 0..kp {
        let bp = b.add(p * NR);
        // A loop, not `std::array::from_fn`, whose closure would be compiled without
        // AVX-512 and call the load.
        let mut bv = [std::mem::transmute::<__m512i, __m512bh>(_mm512_setzero_si512()); V];
        for (v, bv) in bv.iter_mut().enumerate() {
            *bv =
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(bp.add(16 * v).cast()));
        }
        for (row, first) in acc.iter_mut().zip(rows) {
            let word = *first.add(p * a.pair);
            let ai: __m512bh = std::mem::transmute(_mm512_set1_epi32(word as i32));
            for v in 0..V {
                row[v] = _mm512_dpbf16_ps(row[v], ai, bv[v]);
            }
        }
    }
    let beta = _mm512_set1_ps(tile.beta);
    for (i, row) in acc.iter().enumerate().take(tile.height) {
        let c = tile.c.add(i * tile.row);
        for (v, lane) in row.iter().enumerate() {
            let start = 16 * v;
            if start >= tile.width {
                break;
            }
            let mask: __mmask16 = if tile.width - start >= 16 {
                0xffff
            } else {
                (1u16 << (tile.width - start)) - 1
            };
            let mut out = _mm512_mul_ps(*lane, beta);
            if tile.load {
                out = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, c.add(start)), out);
            }
            _mm512_mask_storeu_ps(c.add(start), mask, out);
        }
    }
}

/// The tile at the AVX2 level on CPUs without AVX512_BF16: f32 FMAs on the pairs
/// widened (A's split once per packed block, `split_halves`; B's in registers, a mask
/// for the odd k and a shift for the even), odd k before even as `vdpbf16ps` adds them.
/// The products are exact, so the sums have the portable kernel's bits and
/// `vdpbf16ps`'s. 16 columns at a time: the 6 x 2 accumulators, a half pair of B and
/// one of A in the 16 registers.
///
/// # Safety
/// The CPU must have AVX2 and FMA; otherwise as for `Kernel::tile`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel_avx2(kp: usize, a: APanel, b: *const u32, tile: Tile) {
    use std::arch::x86_64::*;
    const W: usize = 16;
    let rows = a.rows_of(a.halves, 2);
    let odd_half = _mm256_set1_epi32(0xffff_0000_u32 as i32);
    let broadcast = |half: *const u32| _mm256_set1_ps(f32::from_bits(*half));
    for chunk in (0..tile.width).step_by(W) {
        let mut acc = [[_mm256_setzero_ps(); 2]; MR];
        for p in 0..kp {
            let bp = b.add(p * NR + chunk);
            let words = [
                _mm256_loadu_si256(bp.cast()),
                _mm256_loadu_si256(bp.add(8).cast()),
            ];
            let odd = words.map(|w| _mm256_castsi256_ps(_mm256_and_si256(w, odd_half)));
            for (row, first) in acc.iter_mut().zip(rows) {
                let ai = broadcast(first.add(2 * p * a.pair));
                row[0] = _mm256_fmadd_ps(ai, odd[0], row[0]);
                row[1] = _mm256_fmadd_ps(ai, odd[1], row[1]);
            }
            let even = words.map(|w| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w)));
            for (row, first) in acc.iter_mut().zip(rows) {
                let ai = broadcast(first.add(2 * p * a.pair + 1));
                row[0] = _mm256_fmadd_ps(ai, even[0], row[0]);
                row[1] = _mm256_fmadd_ps(ai, even[1], row[1]);
            }
        }
        let mut sums = [[0f32; W]; MR];
        for (sum, row) in sums.iter_mut().zip(&acc) {
            _mm256_storeu_ps(sum.as_mut_ptr(), row[0]);
            _mm256_storeu_ps(sum.as_mut_ptr().add(8), row[1]);
        }
        store_sums(&sums, chunk, &tile);
    }
}

/// The tile at the AVX-512 level on CPUs without AVX512_BF16 (Skylake-SP, Cascade Lake,
/// Ice Lake; Zen 3 has no AVX-512): as `kernel_avx2`, 32 columns at a time.
///
/// # Safety
/// The CPU must have AVX-512F; otherwise as for `Kernel::tile`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn kernel_avx512(kp: usize, a: APanel, b: *const u32, tile: Tile) {
    use std::arch::x86_64::*;
    const W: usize = 32;
    let rows = a.rows_of(a.halves, 2);
    let odd_half = _mm512_set1_epi32(0xffff_0000_u32 as i32);
    let broadcast = |half: *const u32| _mm512_set1_ps(f32::from_bits(*half));
    for chunk in (0..tile.width).step_by(W) {
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        for p in 0..kp {
            let bp = b.add(p * NR + chunk);
            let words = [
                _mm512_loadu_si512(bp.cast()),
                _mm512_loadu_si512(bp.add(16).cast()),
            ];
            let odd = [
                _mm512_castsi512_ps(_mm512_and_si512(words[0], odd_half)),
                _mm512_castsi512_ps(_mm512_and_si512(words[1], odd_half)),
            ];
            for (row, first) in acc.iter_mut().zip(rows) {
                let ai = broadcast(first.add(2 * p * a.pair));
                row[0] = _mm512_fmadd_ps(ai, odd[0], row[0]);
                row[1] = _mm512_fmadd_ps(ai, odd[1], row[1]);
            }
            let even = [
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(words[0])),
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(words[1])),
            ];
            for (row, first) in acc.iter_mut().zip(rows) {
                let ai = broadcast(first.add(2 * p * a.pair + 1));
                row[0] = _mm512_fmadd_ps(ai, even[0], row[0]);
                row[1] = _mm512_fmadd_ps(ai, even[1], row[1]);
            }
        }
        let mut sums = [[0f32; W]; MR];
        for (sum, row) in sums.iter_mut().zip(&acc) {
            _mm512_storeu_ps(sum.as_mut_ptr(), row[0]);
            _mm512_storeu_ps(sum.as_mut_ptr().add(16), row[1]);
        }
        store_sums(&sums, chunk, &tile);
    }
}

/// Writes a kernel's sums for the tile's columns `first..first + W` (those inside it):
/// dst = (dst if the tile loads) + beta * sum.
///
/// # Safety
/// The tile must be writable.
unsafe fn store_sums<const W: usize>(sums: &[[f32; W]; MR], first: usize, tile: &Tile) {
    let width = W.min(tile.width.saturating_sub(first));
    for (i, sum) in sums.iter().enumerate().take(tile.height) {
        let c = std::slice::from_raw_parts_mut(tile.c.add(i * tile.row + first), width);
        for (out, x) in c.iter_mut().zip(sum) {
            *out = if tile.load { *out } else { 0.0 } + tile.beta * x;
        }
    }
}

super::kernels::multiversion! {
    /// acc[i][j] += A row i's pairs times B column j's, for the pairs in `b` (kp x NR
    /// words): odd k then even k added per lane, as `vdpbf16ps` does. A's pairs come
    /// widened (`split_halves`): row i's pair p at `rows[i][2 * p * pair]` (odd k) and
    /// just after (even k); B's words are widened here (exact).
    pub fn accumulate_tile(acc: &mut [[f32; NR]; MR], rows: &[&[u32]; MR], pair: usize, b: &[u32]) {
        let odd_of = |w: u32| f32::from_bits(w & 0xffff_0000);
        let even_of = |w: u32| f32::from_bits(w << 16);
        for (p, bp) in b.chunks_exact(NR).enumerate() {
            for (row, a) in acc.iter_mut().zip(rows) {
                let (a_odd, a_even) = (f32::from_bits(a[2 * p * pair]), f32::from_bits(a[2 * p * pair + 1]));
                for (x, &bw) in row.iter_mut().zip(bp) {
                    *x += a_odd * odd_of(bw);
                    *x += a_even * even_of(bw);
                }
            }
        }
    }
}

/// The same tile in plain Rust (`accumulate_tile`, vectorised for the CPU at hand).
///
/// # Safety
/// As for `Kernel::tile`.
unsafe fn kernel_portable(kp: usize, a: APanel, b: *const u32, tile: Tile) {
    let b = std::slice::from_raw_parts(b, kp * NR);
    // Each row's halves, from the first to the last pair read.
    let span = if kp == 0 {
        0
    } else {
        2 * (kp - 1) * a.pair + 2
    };
    let rows = a
        .rows_of(a.halves, 2)
        .map(|row| std::slice::from_raw_parts(row, span));
    let mut acc = [[0f32; NR]; MR];
    accumulate_tile(&mut acc, &rows, a.pair, b);
    store_sums(&acc, 0, &tile);
}

#[cfg(test)]
mod tests {
    use super::super::matrix::Causal;
    use super::*;

    fn product<'a>(
        a: Strided<'a>,
        b: Strided<'a>,
        mnk: (usize, usize, usize),
        accumulate: bool,
        beta: f32,
    ) -> Product<'a> {
        Product {
            accumulate,
            beta,
            ..Product::new(a, b, mnk)
        }
    }

    #[test]
    fn rounding_is_to_nearest_even() {
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even (1.0).
        assert_eq!(round_to_bf16(1.0 + 2f32.powi(-8)), 1.0);
        // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties go to even.
        assert_eq!(
            round_to_bf16(1.0 + 3.0 * 2f32.powi(-8)),
            1.0 + 2f32.powi(-6)
        );
        // Just above halfway rounds up.
        assert_eq!(
            round_to_bf16(1.0 + 2f32.powi(-8) + 2f32.powi(-20)),
            1.0 + 2f32.powi(-7)
        );
        assert_eq!(round_to_bf16(-2.5), -2.5);
        assert_eq!(round_to_bf16(f32::INFINITY), f32::INFINITY);
        assert!(round_to_bf16(f32::NAN).is_nan());
        // The largest f32 is past the largest bf16 by more than half a step.
        assert_eq!(round_to_bf16(f32::MAX), f32::INFINITY);
        assert_eq!(to_bf16_bits(1.0), 0x3f80);
    }

    /// dst = (dst if accumulate) + beta * round(a) · round(b), summed in f64.
    #[allow(clippy::too_many_arguments)]
    fn oracle(
        dst: &mut [f32],
        dst_row: usize,
        a: &Strided,
        b: &Strided,
        (m, n, k): (usize, usize, usize),
        accumulate: bool,
        beta: f32,
    ) {
        for i in 0..m {
            for j in 0..n {
                let sum: f64 = (0..k)
                    .map(|p| {
                        round_to_bf16(a.data[i * a.row + p * a.col]) as f64
                            * round_to_bf16(b.data[p * b.row + j * b.col]) as f64
                    })
                    .sum();
                let old = if accumulate {
                    dst[i * dst_row + j]
                } else {
                    0.0
                };
                dst[i * dst_row + j] = old + beta * sum as f32;
            }
        }
    }

    fn values(len: usize, seed: u32) -> Vec<f32> {
        // A cheap deterministic spread of magnitudes and signs.
        (0..len as u32)
            .map(|i| {
                let x = i
                    .wrapping_mul(2654435761)
                    .wrapping_add(seed.wrapping_mul(40503));
                (x >> 8) as f32 / (1 << 24) as f32 * 2.0 - 1.0
            })
            .collect()
    }

    /// Every combination of operand layouts, odd sizes past every block edge, with and
    /// without accumulation, on one thread and split over threads, against the oracle.
    fn check(
        kernel_name: &str,
        run: impl Fn(&mut [f32], usize, Strided, Strided, (usize, usize, usize), bool, f32),
    ) {
        for &(m, n, k) in &[
            (1, 1, 1),
            (7, 65, 3),
            (13, 130, 257),
            (100, 70, 600),
            // Past the AMX tiles' k block (2048) too.
            (9, 33, 2600),
            (5, 3, 0),
        ] {
            let (a_data, b_data) = (values(m * k + 1, 1), values(k * n + 1, 2));
            for a_t in [false, true] {
                for b_t in [false, true] {
                    let a = if a_t {
                        Strided {
                            data: &a_data,
                            row: 1,
                            col: m,
                        }
                    } else {
                        Strided {
                            data: &a_data,
                            row: k,
                            col: 1,
                        }
                    };
                    let b = if b_t {
                        Strided {
                            data: &b_data,
                            row: 1,
                            col: k,
                        }
                    } else {
                        Strided {
                            data: &b_data,
                            row: n,
                            col: 1,
                        }
                    };
                    for (accumulate, beta) in [(false, 1.0), (true, 0.5)] {
                        let dst_row = n + 3;
                        let start = values(m * dst_row, 3);
                        let mut got = start.clone();
                        let mut want = start.clone();
                        run(&mut got, dst_row, a, b, (m, n, k), accumulate, beta);
                        oracle(&mut want, dst_row, &a, &b, (m, n, k), accumulate, beta);
                        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                            let padding = i % dst_row >= n;
                            // f32 partial sums of up to a block's length, each
                            // rounding by a unit in the last place of sums as large as
                            // the result: a random walk of sqrt(k) such steps.
                            let tol = if padding {
                                0.0
                            } else {
                                let steps = (1.0 + k as f32).sqrt();
                                1e-5 * steps + 4.0 * f32::EPSILON * steps * w.abs()
                            };
                            assert!(
                                (g - w).abs() <= tol,
                                "{kernel_name} {m}x{n}x{k} a_t={a_t} b_t={b_t} acc={accumulate}: [{i}] {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn products_match_rounded_operands_summed_exactly() {
        check("one thread", |dst, dst_row, a, b, (m, n, k), acc, beta| {
            matmul_serial(dst, dst_row, product(a, b, (m, n, k), acc, beta))
        });
        check(
            "split over threads",
            |dst, dst_row, a, b, (m, n, k), acc, beta| {
                matmul(dst, dst_row, product(a, b, (m, n, k), acc, beta))
            },
        );
    }

    #[test]
    fn the_portable_kernel_matches_too() {
        fn run(
            dst: &mut [f32],
            dst_row: usize,
            a: Strided,
            b: Strided,
            (m, n, k): (usize, usize, usize),
            acc: bool,
            beta: f32,
        ) {
            let problem = Problem {
                dst: dst.as_mut_ptr(),
                dst_row,
                p: product(a, b, (m, n, k), acc, beta),
            };
            // Safety: the whole (m, n) block of a buffer sized for it, on this thread.
            unsafe { problem.run_with(Kernel::Portable, 0..m, 0..n) }
        }
        check("portable", run);
    }

    /// The AMX tiles (`amx`), called directly whatever the active level, on CPUs that
    /// have them; named as skipped elsewhere.
    #[test]
    fn the_amx_tiles_match_too() {
        #[cfg(target_arch = "x86_64")]
        if super::super::isa::amx_ready() {
            fn run(
                dst: &mut [f32],
                dst_row: usize,
                a: Strided,
                b: Strided,
                (m, n, k): (usize, usize, usize),
                acc: bool,
                beta: f32,
            ) {
                let p = product(a, b, (m, n, k), acc, beta);
                p.check_bounds(dst, dst_row);
                // Safety: AMX is ready; the whole (m, n) block of a buffer sized for it,
                // on this thread.
                unsafe { super::super::amx::multiply(dst.as_mut_ptr(), dst_row, &p, 0..m, 0..n) }
            }
            check("amx", run);
            return;
        }
        eprintln!("SKIPPED: this CPU (or OS) has no AMX tiles with bf16 products");
    }

    /// Split over dst's rows or columns, each element is summed in the same order as on
    /// one thread: the bits agree. Shapes with more rows than columns (split by rows: on
    /// AMX in whole 32-row blocks), more columns than rows, k in one block, two and
    /// three (past `amx::KC`; short of `split_k`, tested below), edges
    /// off whole tiles; B read along rows and down columns.
    #[test]
    fn big_products_split_over_threads_agree_with_one_thread() {
        for (m, n, k) in [
            (300, 200, 100),
            (600, 200, 2100),
            (1100, 70, 4200),
            (70, 600, 2100),
        ] {
            let (a_data, b_data) = (values(m * k, 4), values(k * n, 5));
            let a = Strided {
                data: &a_data,
                row: k,
                col: 1,
            };
            for b in [
                Strided {
                    data: &b_data,
                    row: 1,
                    col: k,
                },
                Strided {
                    data: &b_data,
                    row: n,
                    col: 1,
                },
            ] {
                let (mut one, mut many) = (vec![0f32; m * n], vec![0f32; m * n]);
                matmul_serial(&mut one, n, Product::new(a, b, (m, n, k)));
                matmul(&mut many, n, Product::new(a, b, (m, n, k)));
                assert!(
                    one.iter()
                        .zip(&many)
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{m}x{n}x{k} (B rows {} apart): one thread and many differ",
                    b.row
                );
            }
        }
    }

    /// A long sum (`split_k`) is its parts, set by k alone, each part's product from
    /// zero, added into dst in part order, to the bit, whichever pool's threads run the
    /// parts. (The thread count itself is read once per process; that it no longer
    /// changes a run's bits is held end to end by tests/cli.rs, which runs the binary
    /// under several RAYON_NUM_THREADS.)
    #[test]
    fn long_sums_are_their_parts_added_in_order() {
        for (m, n, k) in [(128, 128, 768), (40, 200, 1100), (64, 96, 4096)] {
            assert!(k >= 4 * m.max(n) && m * n * k >= PARALLEL_MIN_MACS);
            let (a_data, b_data) = (values(m * k, 6), values(k * n, 7));
            let a = Strided {
                data: &a_data,
                row: k,
                col: 1,
            };
            let b = Strided {
                data: &b_data,
                row: 1,
                col: k,
            };
            let p = Product::new(a, b, (m, n, k));
            // The definition: each part from zero, added in order.
            let share = k_share(k);
            let mut want = vec![0f32; m * n];
            let mut part = vec![0f32; m * n];
            for (i, k0) in (0..k).step_by(share).enumerate() {
                let range = p.k_range(k0, share.min(k - k0));
                if i == 0 {
                    matmul_serial(&mut want, n, range);
                } else {
                    part.fill(0.0);
                    matmul_serial(&mut part, n, range);
                    want.iter_mut().zip(&part).for_each(|(w, x)| *w += x);
                }
            }
            assert!(k.div_ceil(share) > 1, "{m}x{n}x{k} is cut into parts");
            for threads in [1, 2, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let mut got = vec![0f32; m * n];
                pool.install(|| matmul(&mut got, n, p));
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{m}x{n}x{k} on {threads} threads: not the parts' sum in order"
                );
            }
        }
    }

    /// The register kernels this CPU can run, by name: the portable one always, the
    /// AVX2 and AVX-512 ones that widen the pairs, `vdpbf16ps` (whatever the active
    /// level: each is called directly).
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    fn vector_kernels() -> Vec<(&'static str, Kernel)> {
        let mut kernels = vec![("portable", Kernel::Portable)];
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") {
                kernels.push(("avx2", Kernel::Avx2));
            }
            if has!("avx512f") {
                kernels.push(("avx512", Kernel::Avx512));
            }
            if has!("avx512f") && has!("avx512bf16") {
                kernels.push(("avx512_bf16", Kernel::Avx512Bf16));
            }
        }
        kernels
    }

    /// `p` on one thread into copies of `start` (rows `dst_row` apart), once by each
    /// kernel this CPU has: the vector ones and, where there are tiles, AMX.
    fn every_kernel(start: &[f32], dst_row: usize, p: Product) -> Vec<(&'static str, Vec<f32>)> {
        let mut out = Vec::new();
        p.check_bounds(start, dst_row);
        for (name, kernel) in vector_kernels() {
            let mut got = start.to_vec();
            let problem = Problem {
                dst: got.as_mut_ptr(),
                dst_row,
                p,
            };
            // Safety: bounds checked above, on this thread; the CPU has the kernel.
            unsafe { problem.run_with(kernel, 0..p.m, 0..p.n) };
            out.push((name, got));
        }
        #[cfg(target_arch = "x86_64")]
        if super::super::isa::amx_ready() {
            let mut got = start.to_vec();
            // Safety: AMX is ready; bounds checked above, on this thread.
            unsafe { super::super::amx::multiply(got.as_mut_ptr(), dst_row, &p, 0..p.m, 0..p.n) };
            out.push(("amx", got));
        }
        out
    }

    /// Every register kernel adds each pair's two exact products to its f32 sums in the
    /// same order (odd k, then even, as `vdpbf16ps` does), so they agree to the bit: a
    /// bf16 run's numbers do not depend on which of them the CPU runs. (`vdpbf16ps`
    /// flushes subnormals, which these operands never reach.)
    #[test]
    fn the_register_kernels_agree_to_the_bit() {
        let kernels = vector_kernels();
        eprintln!(
            "bf16 register kernels on this CPU: {:?}",
            kernels.iter().map(|(name, _)| *name).collect::<Vec<_>>()
        );
        for &(m, n, k) in &[(1, 1, 1), (7, 65, 3), (13, 130, 257), (100, 70, 1700)] {
            let (a_data, b_data) = (values(m * k, 1), values(k * n, 2));
            let (a, b) = (Strided::rows(&a_data, k), Strided::rows(&b_data, n));
            for (accumulate, beta) in [(false, 1.0), (true, 0.5)] {
                let dst_row = n + 3;
                let start = values(m * dst_row, 3);
                let p = product(a, b, (m, n, k), accumulate, beta);
                let outs = every_kernel(&start, dst_row, p);
                let (first, want) = &outs[0];
                for (name, got) in outs.iter().filter(|(name, _)| *name != "amx") {
                    let same = got
                        .iter()
                        .zip(want)
                        .all(|(g, w)| g.to_bits() == w.to_bits());
                    assert!(same, "{name} vs {first} at {m}x{n}x{k} acc={accumulate}");
                }
            }
        }
    }

    /// The widening kernels against the oracle, each called directly (the active level
    /// picks `vdpbf16ps` on CPUs that have it); named as skipped where the CPU lacks one.
    #[test]
    fn the_widening_kernels_match_too() {
        let kernels = vector_kernels();
        for wanted in ["avx2", "avx512"] {
            let Some(&(name, kernel)) = kernels.iter().find(|(name, _)| *name == wanted) else {
                eprintln!("skipped: the {wanted} bf16 kernel (this CPU lacks it)");
                continue;
            };
            check(name, |dst, dst_row, a, b, (m, n, k), acc, beta| {
                let problem = Problem {
                    dst: dst.as_mut_ptr(),
                    dst_row,
                    p: product(a, b, (m, n, k), acc, beta),
                };
                // Safety: the whole (m, n) block of a buffer sized for it, on this
                // thread; the CPU has the kernel.
                unsafe { problem.run_with(kernel, 0..m, 0..n) }
            });
        }
    }

    /// Causal attention products (T x T operands, both layouts of A) against the
    /// oracle: at T past the row blocks and past one k block (`KC_SINGLE`), with A zero
    /// where the structure says, and (for `LowerDst`) only the lower triangle compared.
    #[test]
    fn causal_products_skip_only_zeros() {
        for t in [5, 130, 1600] {
            let d = 19;
            for causal in [Causal::LowerDst, Causal::LowerA, Causal::UpperA] {
                for a_t in [false, true] {
                    // (m, n, k): dst T x T for LowerDst (k = d), else T x d (k = T).
                    let (m, n, k) = match causal {
                        Causal::LowerDst => (t, t, d),
                        _ => (t, d, t),
                    };
                    let mut a_data = values(m * k, 7);
                    let a = |data| {
                        if a_t {
                            Strided {
                                data,
                                row: 1,
                                col: m,
                            }
                        } else {
                            Strided {
                                data,
                                row: k,
                                col: 1,
                            }
                        }
                    };
                    // Zero A where the structure promises zeros.
                    for i in 0..m {
                        for kk in (0..k).filter(|&kk| causal.zero_in_a(i, kk)) {
                            a_data[if a_t { kk * m + i } else { i * k + kk }] = 0.0;
                        }
                    }
                    let b_data = values(k * n, 8);
                    let b = Strided {
                        data: &b_data,
                        row: n,
                        col: 1,
                    };
                    for accumulate in [false, true] {
                        let start = values(m * n, 9);
                        let mut want = start.clone();
                        let run = (m, n, k);
                        let p = product(a(&a_data), b, run, accumulate, 0.5).causal(causal);
                        oracle(&mut want, n, &a(&a_data), &b, run, accumulate, 0.5);
                        for (kernel, got) in every_kernel(&start, n, p) {
                            for i in 0..m {
                                for j in 0..n {
                                    if causal == Causal::LowerDst && j > i {
                                        continue;
                                    }
                                    let (g, w) = (got[i * n + j], want[i * n + j]);
                                    assert!(
                                        (g - w).abs() <= 1e-5 * (1.0 + k as f32).sqrt(),
                                        "{kernel} {causal:?} t={t} a_t={a_t} acc={accumulate} ({i},{j}): {g} vs {w}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
