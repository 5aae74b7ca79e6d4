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
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`): [`ready`] asks once per process. Rust has no
//! stable AMX intrinsics, so the instructions are inline assembly on fixed tile
//! registers, which the compiler never uses.

use std::cell::RefCell;
use std::ops::Range;

use super::bf16::to_bf16_bits;
use super::matrix::{Causal, Product, Strided};

/// Rows and columns of one block of dst (2 x 2 tiles).
const BLOCK: usize = 32;
/// k pairs per tile.
const TILE_PAIRS: usize = 16;
/// k per packed block: a B panel (32 columns x 256 pairs, 32 KiB) stays in L1 while a
/// block of A streams past it.
const KC: usize = 512;
/// Rows of A packed at a time (128 rows x 256 pairs, 128 KiB: in L2).
const MC: usize = 128;

/// Whether this CPU has AMX tiles with bf16 products and the kernel granted this
/// process their register state. Asked once; safe to call from any thread.
pub fn ready() -> bool {
    static READY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *READY.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            // CPUID leaf 7: EDX bit 22 is AMX-BF16, bit 24 AMX-TILE.
            // Safety: leaf 7 exists on every x86-64 CPU that has AVX2.
            let leaf = std::arch::x86_64::__cpuid_count(7, 0);
            if leaf.edx & (1 << 22) == 0 || leaf.edx & (1 << 24) == 0 {
                return false;
            }
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // Safety: a plain system call; it fails cleanly on kernels without AMX.
            unsafe {
                libc::syscall(
                    libc::SYS_arch_prctl,
                    ARCH_REQ_XCOMP_PERM,
                    XFEATURE_XTILEDATA,
                ) == 0
            }
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        false
    })
}

/// Pack buffers, one set per thread, grown on first use and then reused.
#[derive(Default)]
struct Panels {
    a: Vec<u32>,
    b: Vec<u32>,
    column: Vec<u32>,
}

thread_local! {
    static PANELS: RefCell<Panels> = RefCell::new(Panels::default());
}

/// dst block (rows, cols) of the plain product `p`, on this thread: dst = (dst if
/// `p.accumulate`) + `p.beta` · round(a) · round(b).
///
/// # Safety
/// [`ready`] must have returned true; `dst` (rows `dst_row` apart) must hold the block,
/// which no other thread touches meanwhile, and `p`'s operands every element it reads
/// (`Product::check_bounds`).
pub unsafe fn multiply(
    dst: *mut f32,
    dst_row: usize,
    p: &Product,
    rows: Range<usize>,
    cols: Range<usize>,
) {
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
            let column = scratch(&mut panels.column, pairs);
            pack_b(b, column, &p.b, k0, kc, pairs, cols.start, n);
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
                        // The k pairs this block of rows may hold non-zero, in whole tiles.
                        let (from, to) = match p.causal {
                            // Wholly above the diagonal: never read.
                            Causal::LowerDst if c0 >= r0 + height => continue,
                            Causal::No | Causal::LowerDst => (0, pairs),
                            Causal::LowerA => (0, (r0 + height).saturating_sub(k0).div_ceil(2)),
                            Causal::UpperA => (r0.saturating_sub(k0) / 2, pairs),
                        };
                        let from = (from / TILE_PAIRS * TILE_PAIRS).min(pairs);
                        let to = to.next_multiple_of(TILE_PAIRS).clamp(from, pairs);
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
                        tiles.block(
                            &a_rows[from..],
                            pairs,
                            &panel[from * BLOCK..],
                            (to - from) / TILE_PAIRS,
                            target,
                        );
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

/// The first `len` words of `buffer`, 64-byte aligned (tile rows then never straddle
/// cache lines), grown if needed; stale contents are left for the packers to overwrite.
fn scratch(buffer: &mut Vec<u32>, len: usize) -> &mut [u32] {
    const SLACK: usize = 64 / 4;
    if buffer.len() < len + SLACK {
        buffer.resize(len + SLACK, 0);
    }
    let skip = buffer.as_ptr().align_offset(64).min(SLACK);
    &mut buffer[skip..skip + len]
}

super::kernels::multiversion! {
    /// Rows i0..i0+mc, k k0..k0+kc of `a` as pair words, row after row, `pairs` words a
    /// row: word (i, p) at i * pairs + p. Rows past mc (to a multiple of 32) and pairs
    /// past kc are zeros, and so are the elements `causal` says are zero (`LowerA`,
    /// `UpperA`): whole tiles straddle the diagonal, and memory there may be stale.
    #[allow(clippy::too_many_arguments)]
    pub fn pack_a(
        out: &mut [u32],
        a: &Strided,
        i0: usize,
        mc: usize,
        k0: usize,
        kc: usize,
        pairs: usize,
        causal: Causal,
    ) {
        let used = kc.div_ceil(2);
        let (real, padding) = out.split_at_mut(mc * pairs);
        padding.fill(0);
        if a.row == 1 && a.col != 1 {
            // A's columns (fixed k) run along memory: zip pairs of them, all rows at once.
            for p in 0..used {
                let even = &a.data[(k0 + 2 * p) * a.col + i0..][..mc];
                let odd_k = k0 + 2 * p + 1;
                for (i, &e) in even.iter().enumerate() {
                    let o = if 2 * p + 1 < kc { a.data[odd_k * a.col + i0 + i] } else { 0.0 };
                    real[i * pairs + p] = pair(e, o);
                }
            }
            for row in real.chunks_exact_mut(pairs) {
                row[used..].fill(0);
            }
        } else {
            for (i, row) in real.chunks_exact_mut(pairs).enumerate() {
                let start = (i0 + i) * a.row + k0 * a.col;
                let (words, rest) = row.split_at_mut(used);
                if a.col == 1 {
                    convert_pairs(&a.data[start..start + kc], words);
                } else {
                    let at = |kk: usize| if kk < kc { a.data[start + kk * a.col] } else { 0.0 };
                    for (p, w) in words.iter_mut().enumerate() {
                        *w = pair(at(2 * p), at(2 * p + 1));
                    }
                }
                rest.fill(0);
            }
        }
        if matches!(causal, Causal::LowerA | Causal::UpperA) {
            for (i, row) in real.chunks_exact_mut(pairs).enumerate() {
                for (p, w) in row[..used].iter_mut().enumerate() {
                    let k = k0 + 2 * p;
                    let (even, odd) = (causal.zero_in_a(i0 + i, k), causal.zero_in_a(i0 + i, k + 1));
                    *w &= if even { 0 } else { 0xffff } | if odd { 0 } else { 0xffff_0000 };
                }
            }
        }
    }
}

super::kernels::multiversion! {
    /// k k0..k0+kc, columns first_col..first_col+n of `b` as 32-column panels of `pairs`
    /// pair-rows: word (p, j) of a panel at p * 32 + j. Columns past n and pairs past kc
    /// are zeros. `column` is scratch for one column's words.
    pub fn pack_b(
        out: &mut [u32],
        column: &mut [u32],
        b: &Strided,
        k0: usize,
        kc: usize,
        pairs: usize,
        first_col: usize,
        n: usize,
    ) {
        let used = kc.div_ceil(2);
        for (panel, out) in out.chunks_exact_mut(BLOCK * pairs).enumerate() {
            let c0 = first_col + panel * BLOCK;
            let width = BLOCK.min(n - panel * BLOCK);
            if b.col == 1 {
                // B's rows (fixed k) run along memory: zip pairs of them.
                for (p, words) in out.chunks_exact_mut(BLOCK).enumerate() {
                    if p >= used {
                        words.fill(0);
                        continue;
                    }
                    let even = &b.data[(k0 + 2 * p) * b.row + c0..][..width];
                    let (real, padding) = words.split_at_mut(width);
                    if 2 * p + 1 < kc {
                        let odd = &b.data[(k0 + 2 * p + 1) * b.row + c0..][..width];
                        for ((w, &e), &o) in real.iter_mut().zip(even).zip(odd) {
                            *w = pair(e, o);
                        }
                    } else {
                        for (w, &e) in real.iter_mut().zip(even) {
                            *w = pair(e, 0.0);
                        }
                    }
                    padding.fill(0);
                }
            } else {
                // Each column (fixed j) along k: its words, then spread down the panel.
                let column = &mut column[..used];
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
                        out[p * BLOCK + j] = w;
                    }
                }
                for (p, words) in out.chunks_exact_mut(BLOCK).enumerate() {
                    let from = if p < used { width } else { 0 };
                    words[from..].fill(0);
                }
            }
        }
    }
}

/// One 32-bit word of a packed operand: `even` (k = 2p) low, `odd` (k = 2p + 1) high.
#[inline(always)]
fn pair(even: f32, odd: f32) -> u32 {
    to_bf16_bits(even) as u32 | (to_bf16_bits(odd) as u32) << 16
}

/// out[p] = pair(src[2p], src[2p + 1]), the last odd element paired with zero.
#[inline(always)]
fn convert_pairs(src: &[f32], out: &mut [u32]) {
    for (w, two) in out.iter_mut().zip(src.chunks_exact(2)) {
        *w = pair(two[0], two[1]);
    }
    if src.len() % 2 == 1 {
        out[src.len() / 2] = pair(src[src.len() - 1], 0.0);
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
    /// [`ready`] must have returned true.
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

    /// One 32 x 32 block of dst (`target`): over `steps` x 16 k pairs of the 32 packed
    /// rows `a` (word (i, p) at i * a_row + p) and the 32-column panel `b` (word (p, j)
    /// at p * 32 + j).
    ///
    /// # Safety
    /// `a` and `b` must hold what those steps read; the block of dst must be writable.
    #[inline(always)]
    unsafe fn block(&self, a: &[u32], a_row: usize, b: &[u32], steps: usize, target: Target) {
        debug_assert!(steps == 0 || a.len() >= (BLOCK - 1) * a_row + steps * TILE_PAIRS);
        debug_assert!(b.len() >= steps * TILE_PAIRS * BLOCK);
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
            let c_stride = c_row * 4;
            if whole && load {
                asm!(
                    "tileloadd tmm0, [{c} + {s}*1]",
                    "tileloadd tmm1, [{c} + {s}*1 + 64]",
                    "tileloadd tmm2, [{c2} + {s}*1]",
                    "tileloadd tmm3, [{c2} + {s}*1 + 64]",
                    c = in(reg) c,
                    c2 = in(reg) c.add(16 * c_row),
                    s = in(reg) c_stride,
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
            }
            // A's tile rows are `a_row` words apart; B's 32 words. Each step takes 16
            // pairs: 64 bytes along A's rows, 16 pair-rows (2 KiB) down B's panel.
            if steps > 0 {
                asm!(
                    "2:",
                    "tileloadd tmm4, [{a} + {a_stride}*1]",
                    "tileloadd tmm6, [{b} + {b_stride}*1]",
                    "tileloadd tmm5, [{a2} + {a_stride}*1]",
                    "tileloadd tmm7, [{b} + {b_stride}*1 + 64]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    "add {a}, 64",
                    "add {a2}, 64",
                    "add {b}, 2048",
                    "dec {steps}",
                    "jnz 2b",
                    a = inout(reg) a.as_ptr() => _,
                    a2 = inout(reg) a.as_ptr().add(16 * a_row) => _,
                    b = inout(reg) b.as_ptr() => _,
                    a_stride = in(reg) a_row * 4,
                    b_stride = in(reg) BLOCK * 4,
                    steps = inout(reg) steps => _,
                    options(nostack, readonly),
                );
            }
            if whole {
                asm!(
                    "tilestored [{c} + {s}*1], tmm0",
                    "tilestored [{c} + {s}*1 + 64], tmm1",
                    "tilestored [{c2} + {s}*1], tmm2",
                    "tilestored [{c2} + {s}*1 + 64], tmm3",
                    c = in(reg) c,
                    c2 = in(reg) c.add(16 * c_row),
                    s = in(reg) c_stride,
                    options(nostack),
                );
                return;
            }
            let mut block = [0f32; BLOCK * BLOCK];
            let out = block.as_mut_ptr();
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
            for (i, sums) in block.chunks_exact(BLOCK).take(height).enumerate() {
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
