//! Attention over the K/V cache, one query row at a time: what a decoding step and a
//! prompt's scattered rows attend with (a prompt's runs of 16 or more positions attend
//! as GEMMs: `prompt_attention`). A row's scores over the positions it sees, each
//! head's softmax, the values they weigh; a long row's positions split into parts
//! over the threads and combined as flash-decoding does; the head scores in vector
//! registers in `dot_lanes`'s order, so the same bits as the plain sum.

use std::ops::Range;

#[cfg(target_arch = "x86_64")]
use super::isa::{self, Isa};
use super::kernels::{axpy, dot_lanes, exp_approx, multiversion, softmax_inline, sum_lanes, Widen};
use super::kv_cache::LayerKv;
use super::team;
use super::weight_rows::Bf16;
#[cfg(target_arch = "x86_64")]
use super::weight_rows::Weight;
use crate::model::spec::Shapes;

multiversion! {
    /// One position's attention output, all heads: `q` holds its query heads; it sees
    /// the keys and values (`cache`) of sequence `at.0` up to position `at.1`.
    /// `scores` holds (head, position) for every head.
    pub fn attend(s: &Shapes, q: &[f32], cache: LayerKv, at: (usize, usize), out: &mut [f32], scores: &mut [f32]) {
        match cache {
            LayerKv::F32(keys, values) => attend_in(s, q, (keys, values, None), at, out, scores),
            LayerKv::Bf16(keys, values) => attend_in(s, q, (keys, values, None), at, out, scores),
            LayerKv::Int8(kv) => attend_in(s, q, (kv.keys, kv.values, Some((kv.key_scales, kv.value_scales))), at, out, scores),
        }
    }
}

/// Positions a part of a split attention covers at least: below twice this a row
/// attends whole, on one thread.
const PART_POSITIONS: usize = 128;

/// The most parts a row's attention is split into.
const MAX_PARTS: usize = 8;

/// The scratch [`attend_split`] needs: a row's scores (H x positions) and, per part,
/// its outputs (C), each head's maximum and sum (2H), and H more for rounding every part
/// up to the longest.
pub fn split_scratch_len(s: &Shapes) -> usize {
    s.n_head * s.block_size + MAX_PARTS * (s.n_embd + 3 * s.n_head)
}

/// [`attend`] of one row, its positions split into parts over the threads (the team's,
/// in a one-stream pass) once there are `2 * PART_POSITIONS` of them. Each part reads
/// whole key and value rows, in order: split by heads instead, each thread read half of
/// every row and a 1000-token context decoded slower than on one thread. Each part
/// keeps its heads' maxima and sums of exponentials; the parts' outputs are then
/// combined (as flash-decoding does). The parts depend on the positions alone, not on
/// the threads, so neither do the bits. `scratch` holds [`split_scratch_len`] values.
pub fn attend_split(
    s: &Shapes,
    q: &[f32],
    cache: LayerKv,
    at: (usize, usize),
    out: &mut [f32],
    scratch: &mut [f32],
) {
    let seen = at.1 + 1;
    let parts = (seen / PART_POSITIONS).min(MAX_PARTS);
    if parts < 2 {
        return attend(s, q, cache, at, out, scratch);
    }
    let (h, c, d) = (s.n_head, s.n_embd, s.head_dim);
    // A part's piece of scratch: its scores, its unnormalised outputs, its heads'
    // maxima and sums.
    let longest = seen.div_ceil(parts);
    let piece = h * longest + c + 2 * h;
    let scratch = &mut scratch[..parts * piece];
    let part = |k: usize, piece: &mut [f32]| {
        let positions = seen * k / parts..seen * (k + 1) / parts;
        let (scores, rest) = piece.split_at_mut(h * longest);
        let (out, rest) = rest.split_at_mut(c);
        let (top, total) = rest.split_at_mut(h);
        attend_part(s, q, cache, (at.0, positions), out, scores, (top, total));
    };
    if team::holding() {
        team::for_each_piece(scratch, piece, part);
    } else {
        // No team here (a model too small to split its products, one thread, or another
        // decoder's pass holding the team): the same parts on this thread.
        scratch
            .chunks_exact_mut(piece)
            .enumerate()
            .for_each(|(k, p)| part(k, p));
    }
    // out_h = Σ_k e^(top_k,h - top_h) out_k,h / Σ_k e^(top_k,h - top_h) total_k,h.
    let pieces = || scratch.chunks_exact(piece);
    for head in 0..h {
        let (top_at, total_at) = (h * longest + c + head, h * longest + c + h + head);
        let top = pieces()
            .map(|p| p[top_at])
            .fold(f32::NEG_INFINITY, f32::max);
        let out = &mut out[head * d..(head + 1) * d];
        out.fill(0.0);
        let mut total = 0.0;
        for p in pieces() {
            let weight = exp_approx(p[top_at] - top);
            total += weight * p[total_at];
            axpy(
                out,
                weight,
                &p[h * longest + head * d..h * longest + (head + 1) * d],
            );
        }
        let inv = 1.0 / total;
        for o in out.iter_mut() {
            *o *= inv;
        }
    }
}

multiversion! {
    /// One part of [`attend_split`]: sequence `at.0`'s positions `at.1`; `out` gets each
    /// head's Σ e^(score - max) v over them (not normalised), `stats` each head's max
    /// and sum of those exponentials.
    pub fn attend_part(s: &Shapes, q: &[f32], cache: LayerKv, at: (usize, Range<usize>), out: &mut [f32], scores: &mut [f32], stats: (&mut [f32], &mut [f32])) {
        match cache {
            LayerKv::F32(keys, values) => attend_part_in(s, q, (keys, values, None), at, out, scores, stats),
            LayerKv::Bf16(keys, values) => attend_part_in(s, q, (keys, values, None), at, out, scores, stats),
            LayerKv::Int8(kv) => attend_part_in(s, q, (kv.keys, kv.values, Some((kv.key_scales, kv.value_scales))), at, out, scores, stats),
        }
    }
}

/// A layer's key and value scales, (batch, block, K/V heads) each, where the keys and
/// values are int8 (`None`: they are their numbers).
type Scales<'c> = Option<(&'c [f32], &'c [f32])>;

/// A layer's keys and values as held, and their scales where they are int8.
type Held<'c, T> = (&'c [T], &'c [T], Scales<'c>);

/// [`attend`] over keys and values held as `T`: the scores, each head's softmax, the
/// values they weigh.
#[inline(always)]
fn attend_in<T: KeyRow>(
    s: &Shapes,
    q: &[f32],
    (keys, values, scales): Held<T>,
    at: (usize, usize),
    out: &mut [f32],
    scores: &mut [f32],
) {
    let (b, pos) = at;
    let seen = pos + 1;
    let rows = sequence_rows(s, (keys, values), b, 0..seen);
    let scales = scales.map(|sc| sequence_scales(s, sc, b, 0..seen));
    let scores = &mut scores[..s.n_head * seen];
    score_positions(s, q, rows.0, scales.map(|sc| sc.0), scores, seen);
    for head in scores.chunks_exact_mut(seen) {
        softmax_inline(head);
    }
    weigh_values(s, rows.1, scales.map(|sc| sc.1), scores, seen, out);
}

/// [`attend_part`] over keys and values held as `T`.
#[inline(always)]
fn attend_part_in<T: KeyRow>(
    s: &Shapes,
    q: &[f32],
    (keys, values, scales): Held<T>,
    (b, positions): (usize, Range<usize>),
    out: &mut [f32],
    scores: &mut [f32],
    (top, total): (&mut [f32], &mut [f32]),
) {
    let len = positions.len();
    let rows = sequence_rows(s, (keys, values), b, positions.clone());
    let scales = scales.map(|sc| sequence_scales(s, sc, b, positions));
    let scores = &mut scores[..s.n_head * len];
    score_positions(s, q, rows.0, scales.map(|sc| sc.0), scores, len);
    for (h, head) in scores.chunks_exact_mut(len).enumerate() {
        let max = head.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for v in head.iter_mut() {
            *v = exp_approx(*v - max);
        }
        top[h] = max;
        total[h] = sum_lanes(head, |v| v);
    }
    weigh_values(s, rows.1, scales.map(|sc| sc.1), scores, len, out);
}

/// Sequence `b`'s key and value rows at `positions`.
#[inline(always)]
fn sequence_rows<'c, T>(
    s: &Shapes,
    cache: (&'c [T], &'c [T]),
    b: usize,
    positions: Range<usize>,
) -> (&'c [T], &'c [T]) {
    let first = b * s.block_size * s.kv_width;
    let rows = first + positions.start * s.kv_width..first + positions.end * s.kv_width;
    (&cache.0[rows.clone()], &cache.1[rows])
}

/// Sequence `b`'s key and value scales at `positions`.
#[inline(always)]
fn sequence_scales<'c>(
    s: &Shapes,
    scales: (&'c [f32], &'c [f32]),
    b: usize,
    positions: Range<usize>,
) -> (&'c [f32], &'c [f32]) {
    let first = b * s.block_size * s.n_kv_head;
    let rows = first + positions.start * s.n_kv_head..first + positions.end * s.n_kv_head;
    (&scales.0[rows.clone()], &scales.1[rows])
}

/// The K/V head query head h shares, in a key or value row.
#[inline(always)]
fn kv<'r, T>(row: &'r [T], h: usize, s: &Shapes) -> &'r [T] {
    let g = h / s.group();
    &row[g * s.head_dim..(g + 1) * s.head_dim]
}

/// scores[h * len + p] = (q_h · key p's head for h) / sqrt(d) for the `len` key rows of
/// `keys` (int8 ones times their heads' scales, `key_scales`). Positions go in the outer
/// loop: each key row is read once, whole and in order, for all the heads (head by
/// head, a row's heads were read a head's width at a time, a row apart), and the heads'
/// dot products, independent, overlap.
#[inline(always)]
fn score_positions<T: KeyRow>(
    s: &Shapes,
    q: &[f32],
    keys: &[T],
    key_scales: Option<&[f32]>,
    scores: &mut [f32],
    len: usize,
) {
    let d = s.head_dim;
    let scale = 1.0 / (d as f32).sqrt();
    #[cfg(target_arch = "x86_64")]
    let level = isa::active();
    for (p, key) in keys.chunks_exact(s.kv_width).take(len).enumerate() {
        let at = (&mut *scores, len, p, scale);
        #[cfg(target_arch = "x86_64")]
        if level >= Isa::Avx2 {
            // Safety: the active level never exceeds what the CPU has (AVX2 and FMA
            // come with every level from AVX2 up).
            unsafe { T::head_scores(level, q, key, s, at) };
            continue;
        }
        for (h, q) in q.chunks_exact(d).take(s.n_head).enumerate() {
            at.0[h * len + p] = dot_lanes(q, kv(key, h, s)) * scale;
        }
    }
    if let Some(key_scales) = key_scales {
        for (h, head) in scores[..s.n_head * len].chunks_exact_mut(len).enumerate() {
            let g = h / s.group();
            for (score, heads) in head.iter_mut().zip(key_scales.chunks_exact(s.n_kv_head)) {
                *score *= heads[g];
            }
        }
    }
}

/// out_h = Σ_p scores[h * len + p] v_p for the `len` value rows of `values` (int8 ones
/// times their heads' scales, `value_scales`), a row at a time for every head.
#[inline(always)]
fn weigh_values<T: KeyRow>(
    s: &Shapes,
    values: &[T],
    value_scales: Option<&[f32]>,
    scores: &[f32],
    len: usize,
    out: &mut [f32],
) {
    let d = s.head_dim;
    out.fill(0.0);
    for (p, value) in values.chunks_exact(s.kv_width).take(len).enumerate() {
        for (h, out) in out.chunks_exact_mut(d).take(s.n_head).enumerate() {
            let weight = match value_scales {
                Some(scales) => scores[h * len + p] * scales[p * s.n_kv_head + h / s.group()],
                None => scores[h * len + p],
            };
            axpy(out, weight, kv(value, h, s));
        }
    }
}

/// A key row's element type (f32, bf16 or int8) with its head scores in vector
/// registers.
trait KeyRow: Widen {
    /// scores[h * stride + p] = (q_h · the key row's head for h) x scale for every query
    /// head h (stride: a head's row of scores, the positions seen in `attend`, a part's
    /// length in `attend_part`), at `level` (AVX2 or AVX-512): `dot_lanes`'s operations in its order, so
    /// its bits. (Written out, as the compiler multiplied f32 rows four lanes at a
    /// time once `dot_lanes` folded its sums in halves: a 512-token prompt's attention
    /// a third slower.)
    ///
    /// # Safety
    /// The CPU must have `level`, at least AVX2 with FMA.
    #[cfg(target_arch = "x86_64")]
    unsafe fn head_scores(
        level: Isa,
        q: &[f32],
        key: &[Self],
        s: &Shapes,
        scores: (&mut [f32], usize, usize, f32),
    );
}

/// [`KeyRow`] for `$t`, its head scores by the level's kernel.
macro_rules! key_row {
    ($t:ty, $avx512:ident, $avx2:ident) => {
        impl KeyRow for $t {
            #[cfg(target_arch = "x86_64")]
            unsafe fn head_scores(
                level: Isa,
                q: &[f32],
                key: &[$t],
                s: &Shapes,
                scores: (&mut [f32], usize, usize, f32),
            ) {
                // Safety (both): as the caller promises.
                match level >= Isa::Avx512 {
                    true => unsafe { $avx512(q, key, s, scores) },
                    false => unsafe { $avx2(q, key, s, scores) },
                }
            }
        }
    };
}

key_row!(f32, head_scores_f32, head_scores_f32_avx2);
key_row!(Bf16, head_scores_bf16, head_scores_bf16_avx2);
key_row!(i8, head_scores_i8, head_scores_i8_avx2);

/// `KeyRow::head_scores` at one level: `$four(q_h, k_h, whole)` gives a head's first
/// `whole` products summed in `dot_lanes`'s 32 lanes and folded to four (16 + 16,
/// 8 + 8, 4 + 4); here the rest of its order: (0 + 2) + (1 + 3), the tail, the scale.
#[cfg(target_arch = "x86_64")]
macro_rules! head_scores {
    ($name:ident, $t:ty, $four:ident, $features:literal) => {
        #[target_feature(enable = $features)]
        unsafe fn $name(
            q: &[f32],
            key: &[$t],
            s: &Shapes,
            (scores, stride, p, scale): (&mut [f32], usize, usize, f32),
        ) {
            use std::arch::x86_64::*;
            let d = s.head_dim;
            let whole = d / 32 * 32;
            for h in 0..s.n_head {
                let g = h / s.group();
                let (qh, kh) = (&q[h * d..(h + 1) * d], &key[g * d..(g + 1) * d]);
                let s4 = $four(qh, kh, whole);
                let pairs = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
                let mut sum = _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
                for i in whole..d {
                    sum += qh[i] * kh[i].widen();
                }
                scores[h * stride + p] = sum * scale;
            }
        }
    };
}

/// A head's first `whole` products (a multiple of 32) in `dot_lanes`'s lanes, folded to
/// four, in AVX-512 registers: 16 lanes each.
#[cfg(target_arch = "x86_64")]
macro_rules! four_lanes_avx512 {
    ($name:ident, $t:ty, $load:expr) => {
        #[inline]
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn $name(qh: &[f32], kh: &[$t], whole: usize) -> std::arch::x86_64::__m128 {
            use std::arch::x86_64::*;
            let (mut low, mut high) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            for c in (0..whole).step_by(32) {
                // Safety: c + 32 <= whole, inside both heads.
                let (qa, ka) = (qh.as_ptr().add(c), kh.as_ptr().add(c));
                let load = $load;
                low = _mm512_add_ps(low, _mm512_mul_ps(_mm512_loadu_ps(qa), load(ka)));
                let products = _mm512_mul_ps(_mm512_loadu_ps(qa.add(16)), load(ka.add(16)));
                high = _mm512_add_ps(high, products);
            }
            let s16 = _mm512_add_ps(low, high);
            let upper = _mm512_extractf64x4_pd(_mm512_castps_pd(s16), 1);
            let s8 = _mm256_add_ps(_mm512_castps512_ps256(s16), _mm256_castpd_ps(upper));
            _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1))
        }
    };
}

/// [`four_lanes_avx512!`] in AVX2 registers: lanes 0..8, 8..16 (the low 16) and
/// 16..24, 24..32 (the high 16).
#[cfg(target_arch = "x86_64")]
macro_rules! four_lanes_avx2 {
    ($name:ident, $t:ty, $load:ident) => {
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn $name(qh: &[f32], kh: &[$t], whole: usize) -> std::arch::x86_64::__m128 {
            use std::arch::x86_64::*;
            let mut acc = [_mm256_setzero_ps(); 4];
            for c in (0..whole).step_by(32) {
                for (i, acc) in acc.iter_mut().enumerate() {
                    // Safety: c + 32 <= whole, inside both heads.
                    let (qa, ka) = (qh.as_ptr().add(c + 8 * i), kh.as_ptr().add(c + 8 * i));
                    *acc = _mm256_add_ps(*acc, _mm256_mul_ps(_mm256_loadu_ps(qa), $load(ka)));
                }
            }
            let (s_low, s_high) = (_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
            let s8 = _mm256_add_ps(s_low, s_high);
            _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1))
        }
    };
}

/// 8 f32 values at `at`.
///
/// # Safety
/// They are readable; the CPU must have AVX.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx")]
unsafe fn load8_f32(at: *const f32) -> std::arch::x86_64::__m256 {
    std::arch::x86_64::_mm256_loadu_ps(at)
}

/// 16 int8 values at `at`, widened to f32 (exactly).
///
/// # Safety
/// They are readable; the CPU must have AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load16_i8(at: *const i8) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(at.cast())))
}

/// 8 int8 values at `at`, widened to f32 (exactly).
///
/// # Safety
/// They are readable; the CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load8_i8(at: *const i8) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(at.cast())))
}

/// 8 bf16 values at `at`, widened to f32.
///
/// # Safety
/// They are readable; the CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load8_bf16(at: *const Bf16) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(at.cast()));
    _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16))
}

#[cfg(target_arch = "x86_64")]
four_lanes_avx512!(four_lanes_f32, f32, <f32 as Weight>::load16);
#[cfg(target_arch = "x86_64")]
four_lanes_avx512!(four_lanes_bf16, Bf16, <Bf16 as Weight>::load16);
#[cfg(target_arch = "x86_64")]
four_lanes_avx512!(four_lanes_i8, i8, load16_i8);
#[cfg(target_arch = "x86_64")]
four_lanes_avx2!(four_lanes_i8_avx2, i8, load8_i8);
#[cfg(target_arch = "x86_64")]
head_scores!(head_scores_i8, i8, four_lanes_i8, "avx512f,avx2,fma");
#[cfg(target_arch = "x86_64")]
head_scores!(head_scores_i8_avx2, i8, four_lanes_i8_avx2, "avx2,fma");
#[cfg(target_arch = "x86_64")]
four_lanes_avx2!(four_lanes_f32_avx2, f32, load8_f32);
#[cfg(target_arch = "x86_64")]
four_lanes_avx2!(four_lanes_bf16_avx2, Bf16, load8_bf16);
#[cfg(target_arch = "x86_64")]
head_scores!(head_scores_f32, f32, four_lanes_f32, "avx512f,avx2,fma");
#[cfg(target_arch = "x86_64")]
head_scores!(head_scores_bf16, Bf16, four_lanes_bf16, "avx512f,avx2,fma");
#[cfg(target_arch = "x86_64")]
head_scores!(head_scores_f32_avx2, f32, four_lanes_f32_avx2, "avx2,fma");
#[cfg(target_arch = "x86_64")]
head_scores!(
    head_scores_bf16_avx2,
    Bf16,
    four_lanes_bf16_avx2,
    "avx2,fma"
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::cpu::kv_cache::{KvCache, KvPrecision, Place};
    use crate::model::spec::ModelSpec;

    /// A long row's attention split into parts (inside a team pass and outside) is the
    /// attention of its definition, in f64, with grouped K/V heads, over f32, bf16 and
    /// int8 keys and values (the definition over the numbers they hold), at lengths
    /// below, at and past the split.
    #[test]
    fn split_attention_is_attention() {
        use crate::cpu::prompt_attention::tests::by_definition;
        let s = ModelSpec::new(&ModelConfig {
            n_head: 4,
            n_kv_head: Some(2),
            n_embd: 64,
            block_size: 1100,
            ..ModelConfig::default()
        })
        .shapes;
        let c = s.n_embd;
        let qkv: Vec<f32> = (0..s.block_size * s.qkv_width)
            .map(|i| ((i as f32) * 0.37).sin() * 1.3)
            .collect();
        // Sequence 1, so the rows are read at its own offset in the cache.
        let places: Vec<Place> = (0..s.block_size).map(|pos| Place { seq: 1, pos }).collect();
        let held = crate::cpu::kv_cache::tests::held_int8(&s, &qkv);
        for precision in [KvPrecision::F32, KvPrecision::Bf16, KvPrecision::Int8] {
            let mut cache = KvCache::new(&s, 2, precision);
            cache.store(0, &qkv, &s, &places);
            for pos in [100, 255, 256, 700, 1099] {
                let q = &qkv[pos * s.qkv_width..][..c];
                let want = match precision {
                    KvPrecision::Int8 => by_definition(&s, &held, pos, pos, false),
                    _ => by_definition(&s, &qkv, pos, pos, precision == KvPrecision::Bf16),
                };
                for in_pass in [false, true] {
                    let mut out = vec![f32::NAN; c];
                    let mut scratch = vec![0f32; split_scratch_len(&s)];
                    let mut run =
                        || attend_split(&s, q, cache.layer(0), (1, pos), &mut out, &mut scratch);
                    match in_pass {
                        true => team::pass(&mut run),
                        false => run(),
                    }
                    for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
                        let what =
                            format!("{precision:?}, position {pos}, in a pass {in_pass}, {i}");
                        assert!(
                            (got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "{what}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// The head scores in AVX2 and AVX-512 registers are `dot_lanes`'s sums to the bit,
    /// for f32, bf16 and int8 keys, heads whose width is and is not a multiple of 32, K/V
    /// heads grouped and not.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_head_scores_are_dot_lanes_bits() {
        use crate::cpu::isa::Isa;
        let levels: Vec<Isa> = Isa::supported()
            .into_iter()
            .filter(|&l| l == Isa::Avx2 || l == Isa::Avx512)
            .collect();
        if levels.is_empty() {
            eprintln!("SKIPPED: the vector head scores (no AVX2 here)");
            return;
        }
        for (n_head, kv, n_embd) in [(2, 2, 128), (4, 2, 192), (3, 1, 48), (2, 1, 160)] {
            let s = ModelSpec::new(&ModelConfig {
                n_head,
                n_kv_head: Some(kv),
                n_embd,
                ..ModelConfig::default()
            })
            .shapes;
            let value = |i: usize| ((i as f32) * 0.61).sin() * 1.7;
            let q: Vec<f32> = (0..n_embd).map(value).collect();
            let key: Vec<f32> = (0..s.kv_width).map(|i| value(i + 1000)).collect();
            let key16: Vec<Bf16> = key.iter().map(|&v| Bf16::round(v)).collect();
            let key8: Vec<i8> = (0..s.kv_width).map(|i| (i * 37 % 255) as i8).collect();
            let d = s.head_dim;
            let (seen, p, scale) = (3, 1, 0.125);
            let kv_head = |h: usize| (h / s.group()) * d..(h / s.group() + 1) * d;
            for &level in &levels {
                let mut got = vec![0f32; n_head * seen];
                // Safety: `level` is one this CPU supports.
                unsafe { f32::head_scores(level, &q, &key, &s, (&mut got, seen, p, scale)) };
                for h in 0..n_head {
                    let want = dot_lanes(&q[h * d..(h + 1) * d], &key[kv_head(h)]) * scale;
                    let what = format!("f32 head {h} at {level:?} of {s:?}");
                    assert_eq!(got[h * seen + p].to_bits(), want.to_bits(), "{what}");
                }
                // Safety: as above.
                unsafe { Bf16::head_scores(level, &q, &key16, &s, (&mut got, seen, p, scale)) };
                for h in 0..n_head {
                    let want = dot_lanes(&q[h * d..(h + 1) * d], &key16[kv_head(h)]) * scale;
                    let what = format!("bf16 head {h} at {level:?} of {s:?}");
                    assert_eq!(got[h * seen + p].to_bits(), want.to_bits(), "{what}");
                }
                // Safety: as above.
                unsafe { i8::head_scores(level, &q, &key8, &s, (&mut got, seen, p, scale)) };
                for h in 0..n_head {
                    let want = dot_lanes(&q[h * d..(h + 1) * d], &key8[kv_head(h)]) * scale;
                    let what = format!("int8 head {h} at {level:?} of {s:?}");
                    assert_eq!(got[h * seen + p].to_bits(), want.to_bits(), "{what}");
                }
            }
        }
    }
}
