//! Decoding's mat-vec on CPUs whose cores stream one address-ordered run of memory
//! fastest: out = W · x for one row x, each weight row read whole before the next.
//!
//! Decoding one token reads every weight once, so a mat-vec runs at the speed one core
//! pulls weights from memory. Two things decide it, measured on an AMD Zen 5 with a C
//! loop over GPT-2 124M's matrices in order (f32, one thread): the order of the reads
//! (four rows side by side, `weight_rows`'s way, 26-30 GB/s; one row after the other
//! 34-42) and their alignment (that loop with the weights 4 bytes off a 64-byte line
//! 31-33 GB/s, with x off one 34, both on lines 39-42: a vector load across two lines is
//! two loads). The weights are put on lines where they are kept
//! (`checkpoint::DATA_ALIGNMENT`, `lines::Lines`); x is copied onto one here, once a call.
//!
//! A row's sums run in 64 lanes by the elements' places from the row's start and are
//! folded in one fixed tree, wherever the row lies: a mapped checkpoint and a copy of it
//! give the same bits. The AVX-512 and AVX2 loops are intrinsics with the portable
//! loops' bits (the compiler's fold of the portable lanes went through the stack every
//! row).
//!
//! Intel cores measured f32 the other way round (four rows side by side, each asked for
//! ahead, 19-23 GB/s against 16 for one row at a time, AVX-512, 2 threads), and the
//! newer ones bf16 as AMD's do, so the order is chosen by the weights' type and the CPU
//! ([`order`], [`MatVec::native_order`]); `TINYGPT_MATVEC_ORDER` overrides both.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use super::bf16::Bf16;
use super::kernels::{fold16, multiversion, prefetch, Widen};
use super::lines::Lines;

/// Elements of a row summed side by side: one lane per class i mod `CLASSES` (four
/// AVX-512 vectors of f32 sums, enough independent sums to keep loads in flight).
const CLASSES: usize = 64;

/// How a one-row product walks its weight rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// Four rows side by side, each asked for ahead (`weight_rows`).
    SideBySide,
    /// One row after the other, in address order, on whole lines (this module).
    InAddressOrder,
}

impl Order {
    pub const ALL: [Order; 2] = [Order::SideBySide, Order::InAddressOrder];

    pub fn name(self) -> &'static str {
        match self {
            Order::SideBySide => "side-by-side",
            Order::InAddressOrder => "in-order",
        }
    }

    fn parse(s: &str) -> Option<Order> {
        Order::ALL
            .into_iter()
            .find(|o| o.name().eq_ignore_ascii_case(s.trim()))
    }
}

const ENV: &str = "TINYGPT_MATVEC_ORDER";

/// The order `TINYGPT_MATVEC_ORDER` sets: `Ok(None)` when unset, `Err` (naming the
/// variable and its values) when it is not an order.
pub fn order_from_env() -> Result<Option<Order>, String> {
    match std::env::var(ENV) {
        Err(_) => Ok(None),
        Ok(value) if value.trim().is_empty() => Ok(None),
        Ok(value) => Order::parse(&value).map(Some).ok_or_else(|| {
            format!("{ENV}={value:?} is not a mat-vec order; use in-order or side-by-side (or unset it)")
        }),
    }
}

/// 0: not forced; otherwise the forced order's index + 1.
static FORCED: AtomicU8 = AtomicU8::new(0);

/// The order this process's mat-vecs of `W` weights take: `TINYGPT_MATVEC_ORDER` (an
/// invalid value is ignored here; the CLI refuses it at startup), else the one this
/// CPU streams `W` fastest in ([`MatVec::native_order`]), or the order [`force`] set.
pub fn order<W: MatVec>() -> Order {
    static FROM_ENV: OnceLock<Option<Order>> = OnceLock::new();
    match FORCED.load(Ordering::Relaxed) {
        0 => FROM_ENV
            .get_or_init(|| order_from_env().ok().flatten())
            .unwrap_or_else(W::native_order),
        n => Order::ALL[n as usize - 1],
    }
}

/// The orders [`order`] gives f32 and bf16 weights, for reports: one name when they
/// agree, "f32 ORDER, bf16 ORDER" when not.
pub fn orders_named() -> String {
    match (order::<f32>(), order::<Bf16>()) {
        (a, b) if a == b => a.name().to_string(),
        (a, b) => format!("f32 {}, bf16 {}", a.name(), b.name()),
    }
}

/// Makes every mat-vec take `order` (`None`: back to [`order`]'s own choice), for tests
/// that hold both to the same numbers in one process. Not for use while kernels run on
/// other threads.
pub fn force(order: Option<Order>) {
    let code = order.map_or(0, |o| {
        Order::ALL.iter().position(|&x| x == o).unwrap() as u8 + 1
    });
    FORCED.store(code, Ordering::Relaxed);
}

/// Σ_i w[i] x[i]: `CLASSES` sums side by side along whole lines of the row, then the
/// rest one by one.
#[inline(always)]
fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    let whole = x.len() / CLASSES * CLASSES;
    let mut lanes = [0f32; CLASSES];
    for (w, x) in w[..whole]
        .chunks_exact(CLASSES)
        .zip(x[..whole].chunks_exact(CLASSES))
    {
        for j in 0..CLASSES {
            lanes[j] += w[j] * x[j];
        }
    }
    let c = &lanes;
    let mut sum = fold16(std::array::from_fn(|k| {
        (c[k] + c[k + 16]) + (c[k + 32] + c[k + 48])
    }));
    for i in whole..x.len() {
        sum += w[i] * x[i];
    }
    sum
}

/// Σ_i w[i] x[i] for bf16 weights, x also given split into its even (`xe`) and odd
/// (`xo`) elements. Two weights a 32-bit word: the odd one is an f32 once the even one's
/// bits are masked off, the even one is the word shifted up, so a pair widens in two
/// integer ops and meets its x without a shuffle.
#[inline(always)]
fn dot_bf16(w: &[Bf16], x: &[f32], xe: &[f32], xo: &[f32]) -> f32 {
    const PAIRS: usize = CLASSES / 2;
    let whole = x.len() / CLASSES * CLASSES;
    let (mut even, mut odd) = ([0f32; PAIRS], [0f32; PAIRS]);
    if cfg!(target_endian = "little") {
        let words = w[..whole].chunks_exact(CLASSES);
        for ((w, xe), xo) in words
            .zip(xe.chunks_exact(PAIRS))
            .zip(xo.chunks_exact(PAIRS))
        {
            // Both lines of this step's weights, `BF16_AHEAD` ahead (see its note).
            for line in [0, 32] {
                prefetch(w.as_ptr().wrapping_add(BF16_AHEAD + line));
            }
            for k in 0..PAIRS {
                // Safety: w holds CLASSES weights, so words 0..PAIRS are in it.
                let word = unsafe { w.as_ptr().cast::<u32>().add(k).read_unaligned() };
                even[k] += f32::from_bits(word << 16) * xe[k];
                odd[k] += f32::from_bits(word & 0xffff_0000) * xo[k];
            }
        }
    } else {
        // The word trick reads the first weight as the low half.
        for (c, w) in w[..whole].chunks_exact(CLASSES).enumerate() {
            for k in 0..PAIRS {
                even[k] += w[2 * k].widen() * xe[c * PAIRS + k];
                odd[k] += w[2 * k + 1].widen() * xo[c * PAIRS + k];
            }
        }
    }
    let mut sum = fold16(std::array::from_fn(|k| {
        (even[k] + even[k + 16]) + (odd[k] + odd[k + 16])
    }));
    for i in whole..x.len() {
        sum += w[i].widen() * x[i];
    }
    sum
}

multiversion! {
    /// out[o] = w_o · x (+ bias[o]) for each row w_o of f32 weights, in address order.
    pub fn rows_f32(w: &[f32], bias: Option<&[f32]>, x: &[f32], out: &mut [f32]) {
        for (o, (out, w)) in out.iter_mut().zip(w.chunks_exact(x.len())).enumerate() {
            *out = dot_f32(w, x) + bias.map_or(0.0, |b| b[o]);
        }
    }
}

multiversion! {
    /// out[o] = w_o · x (+ bias[o]) for each row w_o of bf16 weights, in address order
    /// (`xe`, `xo`: x's even and odd elements).
    pub fn rows_bf16(
        w: &[Bf16],
        bias: Option<&[f32]>,
        x: &[f32],
        xe: &[f32],
        xo: &[f32],
        out: &mut [f32],
    ) {
        for (o, (out, w)) in out.iter_mut().zip(w.chunks_exact(x.len())).enumerate() {
            *out = dot_bf16(w, x, xe, xo) + bias.map_or(0.0, |b| b[o]);
        }
    }
}

/// out (d_out) = w (d_out, d_in) · x (d_in) (+ bias), the rows one after the other.
pub trait MatVec: Sized {
    fn matvec(w: &[Self], bias: Option<&[f32]>, x: &[f32], out: &mut [f32]);

    /// The order this CPU streams these weights fastest in, unless told otherwise.
    fn native_order() -> Order;
}

thread_local! {
    /// x copied to the start of a cache line (for bf16 weights: its even elements, then
    /// its odd ones), so that its loads, like the weights', are whole lines. Kept at the
    /// widest x yet: a token's products alternate between widths, and reallocating at
    /// each change was two allocations a layer.
    static PLACED: RefCell<Lines<f32>> = RefCell::new(Lines::zeroed(0));
}

/// `f` given a copy of x on whole lines, `arrange`d into it.
fn with_placed<R>(len: usize, arrange: impl FnOnce(&mut [f32]), f: impl FnOnce(&[f32]) -> R) -> R {
    PLACED.with_borrow_mut(|placed| {
        if placed.len() < len {
            *placed = Lines::zeroed(len);
        }
        let placed = &mut placed[..len];
        arrange(placed);
        f(placed)
    })
}

impl MatVec for f32 {
    /// In address order on AMD (measured on Zen 5), side by side elsewhere (measured on
    /// Intel Xeons; other CPUs keep the kernels they had).
    fn native_order() -> Order {
        match super::isa::amd_family() {
            Some(_) => Order::InAddressOrder,
            None => Order::SideBySide,
        }
    }

    fn matvec(w: &[f32], bias: Option<&[f32]>, x: &[f32], out: &mut [f32]) {
        with_placed(
            x.len(),
            |p| p.copy_from_slice(x),
            |x| {
                #[cfg(target_arch = "x86_64")]
                if super::isa::active() >= super::isa::Isa::Avx512 {
                    // Safety: the CPU has AVX-512 F (checked just above).
                    return unsafe { rows_f32_avx512(w, bias, x, out) };
                }
                #[cfg(target_arch = "x86_64")]
                if super::isa::active() >= super::isa::Isa::Avx2 {
                    // Safety: the CPU has AVX2 (checked just above).
                    return unsafe { rows_f32_avx2(w, bias, x, out) };
                }
                rows_f32(w, bias, x, out)
            },
        )
    }
}

/// A vector loop's row: `lanes`, the sum of its whole lines, then the rest of its
/// elements one by one and its bias, as the portable loops add them.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn finish_row<W: Widen + Copy>(lanes: f32, w: &[W], x: &[f32], bias: Option<f32>) -> f32 {
    let mut sum = lanes;
    for i in x.len() / CLASSES * CLASSES..x.len() {
        sum += w[i].widen() * x[i];
    }
    sum + bias.unwrap_or(0.0)
}

/// The sum of a vector's 16 lanes as [`fold16`] sums them: halves of 8, then 4, 2, 1.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn reduce16(v: std::arch::x86_64::__m512) -> f32 {
    use std::arch::x86_64::*;
    let eight = _mm256_add_ps(
        _mm512_castps512_ps256(v),
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
    );
    let four = _mm_add_ps(
        _mm256_castps256_ps128(eight),
        _mm256_extractf128_ps::<1>(eight),
    );
    let two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)))
}

/// The sum of 16 lanes held as two AVX2 vectors (`low`: lanes 0-7, `high`: 8-15) as
/// [`fold16`] sums them: halves of 8, then 4, 2, 1.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn reduce16_avx2(low: std::arch::x86_64::__m256, high: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let eight = _mm256_add_ps(low, high);
    let four = _mm_add_ps(
        _mm256_castps256_ps128(eight),
        _mm256_extractf128_ps::<1>(eight),
    );
    let two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)))
}

/// How many bf16 weights ahead [`rows_bf16_avx512`] and [`rows_bf16`] ask for their
/// lines, where they ask ([`super::kernels::asks_ahead`]: not on Zen 4): 8 KiB. Its
/// f32 twin streams at the memory's speed on the core's own prefetcher (asking 4-16 KiB
/// ahead slowed it by 3-15%), but the bf16 loop, a quarter more instructions a byte, did
/// not: one thread on a Zen 5 decoded GPT-2 at 130-136 tokens/s alone, 137-139 asking 4
/// KiB ahead, 154-161 at 7-8 KiB, 151 at 12, 128-132 at 16 (two threads 173-180 against
/// 190-194 at 8 KiB), interleaved.
const BF16_AHEAD: usize = 4096;

/// [`rows_bf16`] in AVX-512 registers, the same sums in the same order (see
/// [`rows_f32_avx512`]).
///
/// # Safety
/// The CPU must have AVX-512 F; `xe` and `xo` hold x's even and odd elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn rows_bf16_avx512(
    w: &[Bf16],
    bias: Option<&[f32]>,
    x: &[f32],
    xe: &[f32],
    xo: &[f32],
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let len = x.len();
    let whole = len / CLASSES * CLASSES;
    debug_assert!(xe.len() >= whole / 2 && xo.len() >= whole / 2);
    let high = _mm512_set1_epi32(0xffff_0000_u32 as i32);
    let ahead = super::kernels::asks_ahead();

    for (o, (out, w)) in out.iter_mut().zip(w.chunks_exact(len)).enumerate() {
        let (mut even, mut odd) = ([_mm512_setzero_ps(); 2], [_mm512_setzero_ps(); 2]);
        for i in (0..whole).step_by(CLASSES) {
            // Both lines of this step's weights, `BF16_AHEAD` ahead (see its note).
            if ahead {
                for line in [0, 32] {
                    prefetch(w.as_ptr().wrapping_add(i + BF16_AHEAD + line));
                }
            }
            for v in 0..2 {
                // Safety: the 16 words from element i + 32 v, and x's 16 even and odd
                // elements from (i + 32 v) / 2, lie before `whole`.
                let words = _mm512_loadu_si512(w.as_ptr().add(i + 32 * v).cast());
                let p = (i + 32 * v) / 2;
                let (e, d) = (
                    _mm512_loadu_ps(xe.as_ptr().add(p)),
                    _mm512_loadu_ps(xo.as_ptr().add(p)),
                );
                let low = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(words));
                let up = _mm512_castsi512_ps(_mm512_and_si512(words, high));
                even[v] = _mm512_add_ps(even[v], _mm512_mul_ps(low, e));
                odd[v] = _mm512_add_ps(odd[v], _mm512_mul_ps(up, d));
            }
        }
        let lanes = _mm512_add_ps(
            _mm512_add_ps(even[0], even[1]),
            _mm512_add_ps(odd[0], odd[1]),
        );
        *out = finish_row(reduce16(lanes), w, x, bias.map(|b| b[o]));
    }
}

/// [`rows_f32`] in AVX-512 registers, the same sums in the same order (the same bits):
/// the compiler's fold of the portable loop's lanes spilled them to the stack for every
/// row, a tenth of the time of a mat-vec bound by memory (measured on a Zen 5).
///
/// # Safety
/// The CPU must have AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn rows_f32_avx512(w: &[f32], bias: Option<&[f32]>, x: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let len = x.len();
    let whole = len / CLASSES * CLASSES;
    for (o, (out, w)) in out.iter_mut().zip(w.chunks_exact(len)).enumerate() {
        let mut acc = [_mm512_setzero_ps(); 4];
        for i in (0..whole).step_by(CLASSES) {
            for (v, acc) in acc.iter_mut().enumerate() {
                // Safety: i + 16 v + 16 <= whole <= the row's and x's length.
                let (wv, xv) = (
                    _mm512_loadu_ps(w.as_ptr().add(i + 16 * v)),
                    _mm512_loadu_ps(x.as_ptr().add(i + 16 * v)),
                );
                // A multiply, then an add: the portable loop's rounding, not an FMA's.
                *acc = _mm512_add_ps(*acc, _mm512_mul_ps(wv, xv));
            }
        }
        let lanes = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        *out = finish_row(reduce16(lanes), w, x, bias.map(|b| b[o]));
    }
}

/// [`rows_f32`] in AVX2 registers, the same sums in the same order (the same bits):
/// the portable loop's 64 lanes are eight vectors here, folded in registers where the
/// compiler's fold spilled them to the stack for every row.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn rows_f32_avx2(w: &[f32], bias: Option<&[f32]>, x: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let len = x.len();
    let whole = len / CLASSES * CLASSES;
    for (o, (out, w)) in out.iter_mut().zip(w.chunks_exact(len)).enumerate() {
        // acc[m] holds classes 8 m .. 8 m + 8.
        let mut acc = [_mm256_setzero_ps(); 8];
        for i in (0..whole).step_by(CLASSES) {
            for (m, acc) in acc.iter_mut().enumerate() {
                // Safety: i + 8 m + 8 <= whole <= the row's and x's length.
                let (wv, xv) = (
                    _mm256_loadu_ps(w.as_ptr().add(i + 8 * m)),
                    _mm256_loadu_ps(x.as_ptr().add(i + 8 * m)),
                );
                // A multiply, then an add: the portable loop's rounding, not an FMA's.
                *acc = _mm256_add_ps(*acc, _mm256_mul_ps(wv, xv));
            }
        }
        // Lane k < 16 of the fold: (c[k] + c[k + 16]) + (c[k + 32] + c[k + 48]).
        let low = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[4], acc[6]));
        let high = _mm256_add_ps(_mm256_add_ps(acc[1], acc[3]), _mm256_add_ps(acc[5], acc[7]));
        *out = finish_row(reduce16_avx2(low, high), w, x, bias.map(|b| b[o]));
    }
}

/// [`rows_bf16`] in AVX2 registers, the same sums in the same order (see
/// [`rows_f32_avx2`]).
///
/// # Safety
/// The CPU must have AVX2; `xe` and `xo` hold x's even and odd elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn rows_bf16_avx2(
    w: &[Bf16],
    bias: Option<&[f32]>,
    x: &[f32],
    xe: &[f32],
    xo: &[f32],
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let len = x.len();
    let whole = len / CLASSES * CLASSES;
    debug_assert!(xe.len() >= whole / 2 && xo.len() >= whole / 2);
    let high_half = _mm256_set1_epi32(0xffff_0000_u32 as i32);
    let ahead = super::kernels::asks_ahead();

    for (o, (out, w)) in out.iter_mut().zip(w.chunks_exact(len)).enumerate() {
        // even[m] and odd[m] hold pairs 8 m .. 8 m + 8 of a step's 32.
        let (mut even, mut odd) = ([_mm256_setzero_ps(); 4], [_mm256_setzero_ps(); 4]);
        for i in (0..whole).step_by(CLASSES) {
            // Both lines of this step's weights, `BF16_AHEAD` ahead (see its note).
            if ahead {
                for line in [0, 32] {
                    prefetch(w.as_ptr().wrapping_add(i + BF16_AHEAD + line));
                }
            }
            for m in 0..4 {
                // Safety: the 8 words from element i + 16 m, and x's 8 even and odd
                // elements from (i + 16 m) / 2, lie before `whole`.
                let words = _mm256_loadu_si256(w.as_ptr().add(i + 16 * m).cast());
                let p = (i + 16 * m) / 2;
                let (e, d) = (
                    _mm256_loadu_ps(xe.as_ptr().add(p)),
                    _mm256_loadu_ps(xo.as_ptr().add(p)),
                );
                let low = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(words));
                let up = _mm256_castsi256_ps(_mm256_and_si256(words, high_half));
                even[m] = _mm256_add_ps(even[m], _mm256_mul_ps(low, e));
                odd[m] = _mm256_add_ps(odd[m], _mm256_mul_ps(up, d));
            }
        }
        // Lane k < 16 of the fold: (even[k] + even[k + 16]) + (odd[k] + odd[k + 16]).
        let low = _mm256_add_ps(
            _mm256_add_ps(even[0], even[2]),
            _mm256_add_ps(odd[0], odd[2]),
        );
        let high = _mm256_add_ps(
            _mm256_add_ps(even[1], even[3]),
            _mm256_add_ps(odd[1], odd[3]),
        );
        *out = finish_row(reduce16_avx2(low, high), w, x, bias.map(|b| b[o]));
    }
}

impl MatVec for Bf16 {
    /// In address order on AMD (as f32, Zen 5) and on Intel cores with AVX512_BF16
    /// (Sapphire Rapids on, where f32 still streams faster side by side); side by side
    /// on older Intel cores, where it was measured (Cascade Lake: 1.18-1.33x llama.cpp's
    /// f16), and elsewhere. GPT-2 124M's bf16 decoding on an Intel Xeon with AMX (2
    /// threads; `TINYGPT_MATVEC_ORDER`, interleaved, seven rounds): 57.6-86.7 tokens/s in
    /// address order against 52.2-77.9 side by side, faster by 7-16% in every round;
    /// side by side asking 8 KiB ahead instead of 16 came level in three rounds of five
    /// and 9-18% behind in two.
    fn native_order() -> Order {
        #[cfg(target_arch = "x86_64")]
        if super::isa::has_avx512_bf16() {
            return Order::InAddressOrder;
        }
        <f32 as MatVec>::native_order()
    }

    fn matvec(w: &[Bf16], bias: Option<&[f32]>, x: &[f32], out: &mut [f32]) {
        let pairs = x.len() / 2;
        let arrange = |split: &mut [f32]| {
            let (xe, xo) = split.split_at_mut(pairs);
            for (k, (e, o)) in xe.iter_mut().zip(xo).enumerate() {
                (*e, *o) = (x[2 * k], x[2 * k + 1]);
            }
        };
        with_placed(2 * pairs, arrange, |split| {
            let (xe, xo) = split.split_at(pairs);
            #[cfg(target_arch = "x86_64")]
            if super::isa::active() >= super::isa::Isa::Avx512 && cfg!(target_endian = "little") {
                // Safety: the CPU has AVX-512 F (checked just above).
                return unsafe { rows_bf16_avx512(w, bias, x, xe, xo, out) };
            }
            #[cfg(target_arch = "x86_64")]
            if super::isa::active() >= super::isa::Isa::Avx2 && cfg!(target_endian = "little") {
                // Safety: the CPU has AVX2 (checked just above).
                return unsafe { rows_bf16_avx2(w, bias, x, xe, xo, out) };
            }
            rows_bf16(w, bias, x, xe, xo, out)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Each output against the f64 sum of the weights as stored, for rows shorter than
    /// a line, of whole lines and of lines and a rest.
    fn against_f64<W: MatVec + Widen>(of: impl Fn(f32) -> W) {
        for d_in in [1, 63, 64, 65, 200, 768] {
            let d_out = 3;
            let w: Vec<W> = values(d_out * d_in, 3).into_iter().map(&of).collect();
            let (x, bias) = (values(d_in, 4), values(d_out, 5));
            let mut out = vec![0f32; d_out];
            W::matvec(&w, Some(&bias), &x, &mut out);
            for (o, got) in out.into_iter().enumerate() {
                let row = &w[o * d_in..(o + 1) * d_in];
                let exact: f64 = row
                    .iter()
                    .zip(&x)
                    .map(|(w, &x)| f64::from(w.widen()) * f64::from(x))
                    .sum::<f64>()
                    + f64::from(bias[o]);
                assert!(
                    (f64::from(got) - exact).abs() <= 1e-6 * d_in as f64,
                    "d_in {d_in}, row {o}: {got} vs {exact}"
                );
            }
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_vector_rows_give_the_portable_bits() {
        use super::super::isa::Isa;
        type F32Rows = unsafe fn(&[f32], Option<&[f32]>, &[f32], &mut [f32]);
        type Bf16Rows = unsafe fn(&[Bf16], Option<&[f32]>, &[f32], &[f32], &[f32], &mut [f32]);
        let levels: [(Isa, F32Rows, Bf16Rows); 2] = [
            (Isa::Avx2, rows_f32_avx2, rows_bf16_avx2),
            (Isa::Avx512, rows_f32_avx512, rows_bf16_avx512),
        ];
        for (level, f32_rows, bf16_rows) in levels {
            if Isa::detected() < level {
                eprintln!(
                    "note: this CPU lacks {}; its mat-vec rows were not run",
                    level.name()
                );
                continue;
            }
            for d_in in [1, 64, 100, 768, 3072] {
                let (w, x, bias) = (values(4 * d_in, 1), values(d_in, 2), values(4, 3));
                let (mut a, mut b) = (vec![0f32; 4], vec![0f32; 4]);
                // Safety: the CPU has this level (checked above).
                unsafe { f32_rows(&w, Some(&bias), &x, &mut a) };
                rows_f32(&w, Some(&bias), &x, &mut b);
                assert_eq!(a, b, "{}, f32, d_in {d_in}", level.name());
                let bits: Vec<Bf16> = w.iter().map(|&v| Bf16::round(v)).collect();
                let pairs = d_in / 2;
                let xe: Vec<f32> = x.iter().step_by(2).take(pairs).copied().collect();
                let xo: Vec<f32> = x.iter().skip(1).step_by(2).take(pairs).copied().collect();
                // Safety: as above.
                unsafe { bf16_rows(&bits, Some(&bias), &x, &xe, &xo, &mut a) };
                rows_bf16(&bits, Some(&bias), &x, &xe, &xo, &mut b);
                assert_eq!(a, b, "{}, bf16, d_in {d_in}", level.name());
            }
        }
    }

    #[test]
    fn rows_in_order_are_dot_products() {
        against_f64(|v| v);
        against_f64(Bf16::round);
    }
}
