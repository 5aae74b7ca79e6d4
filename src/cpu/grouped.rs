//! Weights in blocks of 32 values (int8 as llama.cpp's `q8_0`, int4 as its `q4_0`; an
//! f16 scale a block), laid out for products that keep every vector lane on whole
//! blocks: rows go in groups of sixteen, and for each block a group holds its rows'
//! values side by side, four bytes of each row to a 64-byte vector (`q8_matrix` and
//! `q4` say what the bytes hold), and apart from them the sixteen rows' scales
//! together. One `vpdpbusd` of such a vector against four values of an activation row
//! (broadcast) adds four products to each row's lane, so a block's steps leave each
//! lane holding its row's whole block, exactly, as an integer; it is converted and
//! scaled once per block for sixteen rows. Row-major blocks instead (two blocks a
//! vector, each lane four products) paid a conversion, a multiplication and an add for
//! every four products of every (weight row, activation row) pair, and a horizontal
//! sum per pair at the end.
//!
//! `vpdpbusd` multiplies unsigned by signed bytes: the weights are kept unsigned (int8
//! as w + 128, int4 as q4_0's q = w + 8), and each activation row carries 128 x its
//! block sums ([`Q8Row::excess`]; int4 takes a sixteenth of it), subtracted first.
//!
//! The kernels: AVX-512 VNNI on 512-bit vectors; on 256-bit vectors (the sixteen rows in
//! two halves), `vpdpbusd` where the CPU has AVX-VNNI (Intel's cores from Alder Lake on,
//! AMD's from Zen 5 on) and AVX2's `vpmaddubsw` and `vpmaddwd` where it has not; plain
//! Rust elsewhere.
//!
//! Every level sums a row's blocks in the same order with the same f32 operations
//! (block integer to f32, times the activation's scale, fused multiply-add with the
//! weight's scale onto the row's sum), so the products are the same bits at every
//! level and for any number of activation rows: a sequence's logits do not depend on
//! the machine's vector level or on the rows beside it in a pass.

use std::marker::PhantomData;

use half::f16;
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::isa;
use super::kernels::{asks_ahead, prefetch_all, AHEAD_BYTES};
use super::lines::Lines;
use super::q8::{Q8Row, BLOCK};

/// Weight rows whose values lie side by side: a 512-bit vector's sixteen lanes.
pub const GROUP: usize = 16;
/// Activation rows a kernel call takes at most: sixteen sums and sixteen running
/// totals in 32 registers would leave none for the weights.
pub const MAX_X: usize = 8;
/// [`Kernel::rows_a_call`] for AVX2: its 16 registers hold four rows' lanes and totals
/// (eight spilled: GPT-2 124M int8, 16 sequences capped to AVX2, 460 tokens/s against
/// 499-537 at four, on a Zen 4).
#[cfg(target_arch = "x86_64")]
const AVX2_ROWS: usize = 4;

/// What a block format puts in a group's bytes, and its kernels.
pub trait Format: Send + Sync + 'static {
    /// Bytes of a block of a group's sixteen rows (scales apart).
    const BLOCK_BYTES: usize;
    /// The byte a block of zeros holds.
    const ZERO: u8;
    /// `row` (its `cols` values) quantized into row `r` of a group's bytes (every block)
    /// and scales.
    fn quantize_row(row: &[f32], quants: &mut [u8], scales: &mut [f16], r: usize);
    /// Row `r`'s value `i` of a group's block bytes, as the integer the products take.
    fn value(block: &[u8], i: usize, r: usize) -> i32;
    /// [`Kernel::group_sums`] with AVX-512 VNNI, for N rows of x.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW and VNNI; every row of x holds the group's blocks.
    #[cfg(target_arch = "x86_64")]
    unsafe fn vnni<const N: usize>(
        quants: &[u8],
        scales: &[f16],
        xs: &[Q8Row],
        sums: &mut [[f32; GROUP]; MAX_X],
    );
    /// [`Kernel::group_sums`] with AVX2, FMA and F16C, for N rows of x.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C; every row of x holds the group's blocks.
    #[cfg(target_arch = "x86_64")]
    unsafe fn avx2<const N: usize>(
        quants: &[u8],
        scales: &[f16],
        xs: &[Q8Row],
        sums: &mut [[f32; GROUP]; MAX_X],
    );
    /// [`Kernel::group_sums`] for N rows of x with 256-bit vectors and `vpdpbusd` in
    /// `D`'s encoding: the AVX2 kernel's two halves of eight lanes, VNNI's integer steps.
    /// Only ever inlined into [`Format::avx_vnni`] (or, in tests, its AVX-512 twin),
    /// which enables the features it uses.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA, F16C and `D`'s feature; every row of x holds the
    /// group's blocks.
    #[cfg(target_arch = "x86_64")]
    unsafe fn vnni256<const N: usize, D: Dpbusd256>(
        quants: &[u8],
        scales: &[f16],
        xs: &[Q8Row],
        sums: &mut [[f32; GROUP]; MAX_X],
    );
    /// [`Format::vnni256`] with AVX-VNNI: the integer products of AVX2 cores that have
    /// it (Intel's from Alder Lake on, AMD's from Zen 5 on).
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA, F16C and AVX-VNNI; as for [`Format::vnni256`].
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    unsafe fn avx_vnni<const N: usize>(
        quants: &[u8],
        scales: &[f16],
        xs: &[Q8Row],
        sums: &mut [[f32; GROUP]; MAX_X],
    ) {
        Self::vnni256::<N, Vex>(quants, scales, xs, sums)
    }
    /// [`Format::avx_vnni`] with AVX-512 VNNI's encoding of the same instruction on the
    /// same 256-bit vectors: how a machine without AVX-VNNI (no emulator has it) tests
    /// every line of that kernel but the instruction's encoding.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA, F16C and AVX-512 VL and VNNI; as for
    /// [`Format::vnni256`].
    #[cfg(all(test, target_arch = "x86_64"))]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    unsafe fn avx512_vnni_ymm<const N: usize>(
        quants: &[u8],
        scales: &[f16],
        xs: &[Q8Row],
        sums: &mut [[f32; GROUP]; MAX_X],
    ) {
        Self::vnni256::<N, Evex>(quants, scales, xs, sums)
    }
}

/// `vpdpbusd` on 256-bit vectors: each i32 lane of `acc` plus the four products of
/// `unsigned`'s bytes and `signed`'s bytes in that lane. Two encodings of one operation:
/// AVX-VNNI's VEX ([`Vex`]) and AVX-512 VNNI's EVEX ([`Evex`], with AVX-512 VL).
#[cfg(target_arch = "x86_64")]
pub trait Dpbusd256 {
    /// # Safety
    /// The CPU must have the encoding's feature, and the caller, once inlined, enable it.
    unsafe fn dpbusd(
        acc: std::arch::x86_64::__m256i,
        unsigned: std::arch::x86_64::__m256i,
        signed: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i;
}

/// AVX-VNNI's `vpdpbusd`.
#[cfg(target_arch = "x86_64")]
pub struct Vex;

#[cfg(target_arch = "x86_64")]
impl Dpbusd256 for Vex {
    #[inline(always)]
    unsafe fn dpbusd(
        acc: std::arch::x86_64::__m256i,
        unsigned: std::arch::x86_64::__m256i,
        signed: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        std::arch::x86_64::_mm256_dpbusd_avx_epi32(acc, unsigned, signed)
    }
}

/// AVX-512 VNNI's `vpdpbusd` on 256-bit vectors (tests only: see
/// [`Format::avx512_vnni_ymm`]).
#[cfg(all(test, target_arch = "x86_64"))]
pub struct Evex;

#[cfg(all(test, target_arch = "x86_64"))]
impl Dpbusd256 for Evex {
    #[inline(always)]
    unsafe fn dpbusd(
        acc: std::arch::x86_64::__m256i,
        unsigned: std::arch::x86_64::__m256i,
        signed: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        std::arch::x86_64::_mm256_dpbusd_epi32(acc, unsigned, signed)
    }
}

/// A (rows, cols) matrix in blocks of `BLOCK` along its rows, rows in groups of
/// [`GROUP`] (cols padded with zeros to whole blocks, rows with zero rows to whole
/// groups), its values as `F` holds them.
#[derive(Debug, Clone)]
pub struct Grouped<F> {
    rows: usize,
    cols: usize,
    /// Blocks per row.
    blocks: usize,
    /// (groups, blocks, F::BLOCK_BYTES) values.
    quants: Lines<u8>,
    /// (groups, blocks, GROUP) scales.
    scales: Lines<f16>,
    format: PhantomData<F>,
}

impl<F: Format> Grouped<F> {
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
        let mut quants = Lines::zeroed(groups * blocks * F::BLOCK_BYTES);
        quants.fill(F::ZERO);
        Self {
            rows,
            cols,
            blocks,
            quants,
            scales: Lines::zeroed(groups * blocks * GROUP),
            format: PhantomData,
        }
    }

    /// Rows first .. first + w.len() / cols set to `w` (row-major) quantized.
    pub fn quantize_rows(&mut self, first: usize, w: &[f32]) {
        let (cols, blocks) = (self.cols, self.blocks);
        assert_eq!(w.len() % cols, 0, "whole rows");
        let n = w.len() / cols;
        assert!(first + n <= self.rows, "rows inside the matrix");
        let groups = first / GROUP..(first + n).div_ceil(GROUP);
        let (group_quants, group_scales) = (blocks * F::BLOCK_BYTES, blocks * GROUP);
        let quants = &mut self.quants[groups.start * group_quants..groups.end * group_quants];
        let scales = &mut self.scales[groups.start * group_scales..groups.end * group_scales];
        quants
            .par_chunks_mut(group_quants)
            .zip(scales.par_chunks_mut(group_scales))
            .enumerate()
            .for_each(|(i, (quants, scales))| {
                let group = groups.start + i;
                for r in 0..GROUP {
                    let row = (group * GROUP + r)
                        .checked_sub(first)
                        .filter(|&row| row < n);
                    let Some(row) = row else { continue };
                    F::quantize_row(&w[row * cols..(row + 1) * cols], quants, scales, r);
                }
            });
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held: the values and the scales.
    pub fn bytes(&self) -> usize {
        self.quants.len() + 2 * self.scales.len()
    }

    /// Row `r` back in f32 (each value times its block's scale) into out[..cols].
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        let (quants, scales) = self.group(r / GROUP);
        for (c, out) in out[..self.cols].iter_mut().enumerate() {
            let (b, i) = (c / BLOCK, c % BLOCK);
            let block = &quants[b * F::BLOCK_BYTES..(b + 1) * F::BLOCK_BYTES];
            let scale = scales[b * GROUP + r % GROUP].to_f32();
            *out = F::value(block, i, r % GROUP) as f32 * scale;
        }
    }

    /// `x` (one row of `cols` values) quantized for products with this matrix.
    pub fn quantize_row(&self, x: &[f32], into: &mut Q8Row) {
        assert_eq!(x.len(), self.cols, "a row as wide as the matrix");
        into.quantize(x);
    }

    /// Row `r` · x, in plain Rust: the kernels' sum, to the bit (what the tests hold
    /// the kernels to).
    pub fn dot_row(&self, r: usize, x: &Q8Row) -> f32 {
        let (quants, scales) = self.group(r / GROUP);
        let mut sums = [[0f32; GROUP]; MAX_X];
        portable::<F>(quants, scales, std::slice::from_ref(x), &mut sums);
        sums[0][r % GROUP]
    }

    /// out[o] = row (first + o) · x (+ bias[o]) for the outputs in `out`.
    pub fn matvec(&self, first: usize, x: &Q8Row, bias: Option<&[f32]>, out: &mut [f32]) {
        self.products(first, out.len(), std::slice::from_ref(x), bias, out);
    }

    /// out[r, o] = row (first + o) · xs[r] (+ bias[o]) for `len` outputs of every row
    /// (`out` is (rows, len)).
    pub fn matmat(
        &self,
        first: usize,
        len: usize,
        xs: &[Q8Row],
        bias: Option<&[f32]>,
        out: &mut [f32],
    ) {
        self.products(first, len, xs, bias, out);
    }

    /// Group `g`'s values and scales.
    fn group(&self, g: usize) -> (&[u8], &[f16]) {
        let (q, s) = (self.blocks * F::BLOCK_BYTES, self.blocks * GROUP);
        (
            &self.quants[g * q..(g + 1) * q],
            &self.scales[g * s..(g + 1) * s],
        )
    }

    /// out[r, o] = row (first + o) · xs[r] (+ bias[o]) for the `len` outputs of every
    /// row of x (`out` is (xs.len(), len)). Groups whose rows straddle first or
    /// first + len are computed whole and the outputs outside dropped. The rows of x go
    /// in chunks that fit L2, each chunk through every group of the outputs; a group
    /// then takes [`MAX_X`] rows of x a call (four on AVX2), its weights read from
    /// memory once for the chunk and from the cache after.
    fn products(
        &self,
        first: usize,
        len: usize,
        xs: &[Q8Row],
        bias: Option<&[f32]>,
        out: &mut [f32],
    ) {
        // The kernels read every block of every row of x: a row quantized for another
        // width would be read past its end.
        assert!(
            xs.iter().all(|x| x.parts().1.len() == self.blocks),
            "rows of x quantized for this matrix's width"
        );
        assert!(first + len <= self.rows, "outputs inside the matrix");
        let kernel = Kernel::active();
        let groups = first / GROUP..(first + len).div_ceil(GROUP);
        let group_bytes = self.blocks * (F::BLOCK_BYTES + 2 * GROUP);
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
                    kernel.group_sums::<F>(quants, scales, rows, &mut sums);
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

/// Rows of x that go through every group before the next rows (a multiple of
/// [`MAX_X`]): as many as keep their int8 values in 256 KiB of L2. All of a long
/// prompt's rows at once streamed them from L3 for every group.
fn x_rows_per_chunk(cols: usize) -> usize {
    const X_BYTES: usize = 256 << 10;
    (X_BYTES / cols.max(1)).max(MAX_X) / MAX_X * MAX_X
}

/// The kernels, by what the CPU has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    /// AVX-512 with VNNI: [`Format::vnni`].
    #[cfg(target_arch = "x86_64")]
    Vnni,
    /// AVX2 with AVX-VNNI (at the `avx2` level, or AVX-512 without its VNNI):
    /// [`Format::avx_vnni`].
    #[cfg(target_arch = "x86_64")]
    AvxVnni,
    /// [`Kernel::AvxVnni`]'s kernel in AVX-512 VNNI's encoding, for tests.
    #[cfg(all(test, target_arch = "x86_64"))]
    VnniYmm,
    /// AVX2 (and AVX-512 without VNNI): [`Format::avx2`].
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// [`portable`].
    Portable,
}

impl Kernel {
    fn active() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let level = isa::active();
            if level >= isa::Isa::Avx512 && isa::has_avx512_vnni() {
                return Kernel::Vnni;
            }
            if level >= isa::Isa::Avx2 && isa::has_avx_vnni() {
                return Kernel::AvxVnni;
            }
            if level >= isa::Isa::Avx2 {
                return Kernel::Avx2;
            }
        }
        Kernel::Portable
    }

    /// Rows of x a call takes at most: each row's integer lanes and running totals
    /// stay in registers (VNNI: 16 of AVX-512's 32 at eight rows; AVX2 and AVX-VNNI:
    /// two registers each for a row's sixteen lanes, of 16).
    fn rows_a_call(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 | Kernel::AvxVnni => AVX2_ROWS,
            #[cfg(all(test, target_arch = "x86_64"))]
            Kernel::VnniYmm => AVX2_ROWS,
            _ => MAX_X,
        }
    }

    /// sums[c][r] = row r of the group (`quants`, `scales`) · xs[c], for every row of x
    /// (at most [`MAX_X`]). Every row of x must hold the group's blocks (`products`
    /// asserts it).
    fn group_sums<F: Format>(
        self,
        quants: &[u8],
        scales: &[f16],
        xs: &[Q8Row],
        sums: &mut [[f32; GROUP]; MAX_X],
    ) {
        debug_assert!(xs.len() <= MAX_X);
        match self {
            // Safety: `active` chose the kernel from what the CPU has; every row of x
            // holds the group's blocks (`products` asserts it; the tests' callers
            // quantize x for the matrix).
            #[cfg(target_arch = "x86_64")]
            Kernel::Vnni => unsafe { by_count!(F::vnni, quants, scales, xs, sums) },
            #[cfg(target_arch = "x86_64")]
            Kernel::AvxVnni => unsafe { by_count!(F::avx_vnni, quants, scales, xs, sums) },
            #[cfg(all(test, target_arch = "x86_64"))]
            Kernel::VnniYmm => unsafe { by_count!(F::avx512_vnni_ymm, quants, scales, xs, sums) },
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { by_count!(F::avx2, quants, scales, xs, sums) },
            Kernel::Portable => portable::<F>(quants, scales, xs, sums),
        }
    }
}

/// `$f::$kernel::<N>` for N = the rows of x (1..=MAX_X): the sums and running totals
/// then live in registers, one per row.
#[cfg(target_arch = "x86_64")]
macro_rules! by_count {
    ($f:ident :: $kernel:ident, $q:expr, $s:expr, $xs:expr, $sums:expr) => {{
        let (q, s, xs, sums) = ($q, $s, $xs, $sums);
        match xs.len() {
            1 => $f::$kernel::<1>(q, s, xs, sums),
            2 => $f::$kernel::<2>(q, s, xs, sums),
            3 => $f::$kernel::<3>(q, s, xs, sums),
            4 => $f::$kernel::<4>(q, s, xs, sums),
            5 => $f::$kernel::<5>(q, s, xs, sums),
            6 => $f::$kernel::<6>(q, s, xs, sums),
            7 => $f::$kernel::<7>(q, s, xs, sums),
            _ => $f::$kernel::<8>(q, s, xs, sums),
        }
    }};
}
#[cfg(target_arch = "x86_64")]
use by_count;

/// The f32 steps that end a block in every AVX-512 kernel, in one place so that every
/// kernel's sums are the same bits: each row of x's sixteen block integers (`lanes`)
/// converted, times x's scale for block `b`, fused onto `totals` with the group's
/// sixteen weight scales (f16, widened in one instruction).
///
/// # Safety
/// The CPU must have AVX-512 F; the scales hold block `b` and every row of x its scale.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
pub unsafe fn fold_block_avx512<const N: usize>(
    totals: &mut [std::arch::x86_64::__m512; N],
    lanes: &[std::arch::x86_64::__m512i; N],
    (scales, xs, b): (&[f16], &[Q8Row], usize),
) {
    use std::arch::x86_64::*;
    let w_scales = _mm512_cvtph_ps(_mm256_loadu_si256(scales.as_ptr().add(b * GROUP).cast()));
    for c in 0..N {
        let x_scale = _mm512_set1_ps(*xs[c].parts().1.get_unchecked(b));
        let scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(lanes[c]), x_scale);
        totals[c] = _mm512_fmadd_ps(scaled, w_scales, totals[c]);
    }
}

/// [`fold_block_avx512`] for the AVX2 kernels, the sixteen rows in two halves of
/// eight lanes: the same operations lane for lane.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; as for [`fold_block_avx512`].
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn fold_block_avx2<const N: usize>(
    totals: &mut [[std::arch::x86_64::__m256; 2]; N],
    lanes: &[[std::arch::x86_64::__m256i; 2]; N],
    (scales, xs, b): (&[f16], &[Q8Row], usize),
) {
    use std::arch::x86_64::*;
    let w_scales = [
        _mm256_cvtph_ps(_mm_loadu_si128(scales.as_ptr().add(b * GROUP).cast())),
        _mm256_cvtph_ps(_mm_loadu_si128(scales.as_ptr().add(b * GROUP + 8).cast())),
    ];
    for c in 0..N {
        let x_scale = _mm256_set1_ps(*xs[c].parts().1.get_unchecked(b));
        for h in 0..2 {
            let scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(lanes[c][h]), x_scale);
            totals[c][h] = _mm256_fmadd_ps(scaled, w_scales[h], totals[c][h]);
        }
    }
}

/// Each row of x's values and its blocks' excess ([`Q8Row::excess`]), as the kernels
/// read them.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn x_pointers<const N: usize>(xs: &[Q8Row]) -> [(*const i8, *const i32); N] {
    std::array::from_fn(|c| (xs[c].parts().0.as_ptr(), xs[c].excess().as_ptr()))
}

/// The 256-bit kernels' totals (each row of x's sixteen sums in two halves of eight
/// lanes) into `sums`.
///
/// # Safety
/// The CPU must have AVX.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx")]
pub unsafe fn store_halves<const N: usize>(
    totals: &[[std::arch::x86_64::__m256; 2]; N],
    sums: &mut [[f32; GROUP]; MAX_X],
) {
    use std::arch::x86_64::_mm256_storeu_ps;
    for c in 0..N {
        _mm256_storeu_ps(sums[c].as_mut_ptr(), totals[c][0]);
        _mm256_storeu_ps(sums[c].as_mut_ptr().add(8), totals[c][1]);
    }
}

/// [`Kernel::group_sums`] in plain Rust: each block's integer sum, then the same f32
/// steps as the vector kernels (`mul_add` is fused everywhere).
pub fn portable<F: Format>(
    quants: &[u8],
    scales: &[f16],
    xs: &[Q8Row],
    sums: &mut [[f32; GROUP]; MAX_X],
) {
    for (x, sums) in xs.iter().zip(sums.iter_mut()) {
        let (xq, xs) = x.parts();
        for (r, total) in sums.iter_mut().enumerate() {
            *total = 0.0;
            for (b, block) in quants.chunks_exact(F::BLOCK_BYTES).enumerate() {
                let sum: i32 = (0..BLOCK)
                    .map(|i| F::value(block, i, r) * i32::from(xq[b * BLOCK + i]))
                    .sum();
                *total = (sum as f32 * xs[b]).mul_add(scales[b * GROUP + r].to_f32(), *total);
            }
        }
    }
}

/// Tests each format runs: every kernel the CPU has, for every count of rows of x,
/// gives the plain Rust sums to the bit; a share of the outputs starting inside a
/// group; rows set a few at a time as at once; each product against the dequantized
/// numbers in f64.
#[cfg(test)]
pub mod checks {
    use super::*;

    pub fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    fn rows_of_x(n: usize, cols: usize, seed: u32) -> Vec<Q8Row> {
        (0..n as u32)
            .map(|r| {
                let mut row = Q8Row::default();
                row.quantize(&values(cols, seed + r));
                row
            })
            .collect()
    }

    pub fn every_kernel_and_row_count_gives_the_same_bits<F: Format>() {
        let (rows, cols) = (35, 7 * BLOCK + 5);
        let q = Grouped::<F>::quantize(&values(rows * cols, 5), rows, cols);
        let xs = rows_of_x(11, cols, 20);
        let want: Vec<Vec<f32>> = xs
            .iter()
            .map(|x| (0..rows).map(|o| q.dot_row(o, x)).collect())
            .collect();
        #[allow(unused_mut)] // only x86 adds kernels
        let mut kernels = vec![Kernel::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") && has!("f16c") {
                kernels.push(Kernel::Avx2);
            } else {
                eprintln!("SKIPPED: the AVX2 block kernels (no AVX2 here)");
            }
            if has!("avx2") && has!("fma") && has!("f16c") && has!("avxvnni") {
                kernels.push(Kernel::AvxVnni);
            } else {
                eprintln!("SKIPPED: the AVX-VNNI block kernels (no AVX-VNNI here)");
            }
            if has!("avx512f") && has!("avx512bw") && has!("avx512vnni") {
                kernels.push(Kernel::Vnni);
            } else {
                eprintln!("SKIPPED: the VNNI block kernels (no AVX-512 VNNI here)");
            }
            if has!("avx2") && has!("fma") && has!("f16c") && has!("avx512vl") && has!("avx512vnni")
            {
                kernels.push(Kernel::VnniYmm);
            } else {
                eprintln!("SKIPPED: the AVX-VNNI kernels' lines in AVX-512 VNNI's encoding (no AVX-512 VL and VNNI here)");
            }
        }
        for kernel in kernels {
            for n in 1..=MAX_X {
                for g in 0..rows.div_ceil(GROUP) {
                    let mut sums = [[0f32; GROUP]; MAX_X];
                    let (quants, scales) = q.group(g);
                    kernel.group_sums::<F>(quants, scales, &xs[..n], &mut sums);
                    for (c, sums) in sums[..n].iter().enumerate() {
                        let real = sums
                            .iter()
                            .enumerate()
                            .filter(|&(r, _)| g * GROUP + r < rows);
                        for (r, &sum) in real {
                            let want = want[c][g * GROUP + r];
                            let row = g * GROUP + r;
                            assert_eq!(sum.to_bits(), want.to_bits(), "{kernel:?} x{n} row {row}");
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

    pub fn rows_set_in_pieces_are_rows_set_at_once<F: Format>() {
        let (rows, cols) = (37, 40);
        let w = values(rows * cols, 9);
        let whole = Grouped::<F>::quantize(&w, rows, cols);
        let mut pieces = Grouped::<F>::zeros(rows, cols);
        for (first, n) in [(0, 5), (5, 14), (19, 18)] {
            pieces.quantize_rows(first, &w[first * cols..(first + n) * cols]);
        }
        assert_eq!(*pieces.quants, *whole.quants);
        assert_eq!(*pieces.scales, *whole.scales);
    }

    pub fn a_product_is_the_dequantized_product<F: Format>() {
        let (rows, cols) = (9, 100);
        let w = values(rows * cols, 2);
        let x = values(cols, 3);
        let q = Grouped::<F>::quantize(&w, rows, cols);
        let mut qx = Q8Row::default();
        q.quantize_row(&x, &mut qx);
        let bias = values(rows, 4);
        let mut out = vec![0f32; rows];
        q.matvec(0, &qx, Some(&bias), &mut out);
        let mut xs = vec![0f32; cols];
        qx.values_into(&mut xs);
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            q.row_into(r, &mut row);
            let want: f64 = row
                .iter()
                .zip(&xs)
                .map(|(&w, &x)| f64::from(w) * f64::from(x))
                .sum::<f64>()
                + f64::from(bias[r]);
            assert!(
                (f64::from(out[r]) - want).abs() < 1e-5,
                "row {r}: {} vs {want}",
                out[r]
            );
        }
    }
}
