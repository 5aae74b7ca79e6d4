//! The CPU decoder's keys and values, kept for every position each sequence has seen.
//!
//! Each layer holds, for every sequence of the batch, `block_size` positions of keys
//! and as many of values, laid out (batch, block, kv width): a sequence's positions
//! follow one another, so attending to them reads its rows in order. The buffers are
//! allocated zeroed and untouched, so a sequence's pages are taken only as its
//! positions fill.
//!
//! Their precision follows the weights', for the memory they take is what many long
//! sequences at once are made of (16 sequences of GPT-2 124M's 1,024 positions: 1.2 GB
//! in f32, more than eight times its int8 weights). A decoder that asked for exact f32
//! weights keeps exact keys and values too. Beside bf16 weights they are bf16: half the
//! bytes, 8 significant bits of each key and value, as bf16 weights keep of each weight.
//! Beside int8 or int4 weights they are int8, half bf16's bytes again: each head of each
//! key and value row in eight bits with one f32 scale (the head's largest magnitude /
//! 127, as llama.cpp's q8_0 cache keeps one per 32 values). Attention takes a key
//! head's dot product with the query times its scale, and a value head times its weight
//! times its scale. The products and sums stay f32 at every precision. What int8 keys
//! and values cost is far below what int8 or int4 weights do: on the Shakespeare char
//! model, eval's loss moved by 0.00003 nats beside int8 weights (1.88434 -> 1.88437) and
//! 0.00005 beside int4 (1.90070 -> 1.90075); `--kv-dtype` chooses any of the three.

use super::decode_weights::WeightFormat;
use super::kernels::Widen;
use super::weight_rows::Bf16;
use crate::model::spec::Shapes;

/// How a key or value is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvPrecision {
    F32,
    Bf16,
    Int8,
}

impl KvPrecision {
    /// The precision that goes with weights in `format` (see the module docs).
    pub fn for_weights(format: WeightFormat) -> Self {
        match format {
            WeightFormat::F32 => Self::F32,
            WeightFormat::Bf16 => Self::Bf16,
            WeightFormat::Int8 | WeightFormat::Int4 => Self::Int8,
        }
    }

    /// `--kv-dtype`'s value: f32, bf16 or int8; absent, the precision that goes with
    /// `weights`.
    pub fn parse(value: Option<&str>, weights: WeightFormat) -> anyhow::Result<Self> {
        Ok(
            match value.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
                None => Self::for_weights(weights),
                Some("f32") => Self::F32,
                Some("bf16") => Self::Bf16,
                Some("int8") => Self::Int8,
                Some(other) => crate::user_bail!("--kv-dtype {other:?}: use f32, bf16 or int8"),
            },
        )
    }

    /// Bytes one position's keys and values take in one layer (int8: with their
    /// scales).
    pub fn row_bytes(self, s: &Shapes) -> usize {
        match self {
            Self::F32 => 2 * s.kv_width * 4,
            Self::Bf16 => 2 * s.kv_width * 2,
            Self::Int8 => 2 * (s.kv_width + 4 * s.n_kv_head),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::Int8 => "int8",
        }
    }
}

/// Where one row of a forward pass belongs: its sequence (a slot of the K/V buffers)
/// and its position in that sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub seq: usize,
    pub pos: usize,
}

/// A key or value element as stored.
pub trait Stored: Widen {
    fn narrow(x: f32) -> Self;

    /// `n` zeros, allocated zeroed: the pages are the system's shared zero page until
    /// written (filling them one by one would take every position's memory up front).
    fn zeroed(n: usize) -> Vec<Self>;
}

impl Stored for f32 {
    #[inline(always)]
    fn narrow(x: f32) -> Self {
        x
    }

    fn zeroed(n: usize) -> Vec<Self> {
        vec![0.0; n]
    }
}

impl Stored for Bf16 {
    #[inline(always)]
    fn narrow(x: f32) -> Self {
        Bf16::round(x)
    }

    fn zeroed(n: usize) -> Vec<Self> {
        // `vec!` allocates zeroed memory only for types it knows to be zero when all
        // their bytes are: u16 is one, our newtype is not.
        let mut bits = std::mem::ManuallyDrop::new(vec![0u16; n]);
        let (ptr, len, capacity) = (bits.as_mut_ptr(), bits.len(), bits.capacity());
        // Safety: `Bf16` is `repr(transparent)` over u16 (same size, alignment and
        // valid bit patterns), and the allocation is handed over whole, once.
        unsafe { Vec::from_raw_parts(ptr.cast::<Bf16>(), len, capacity) }
    }
}

/// Every layer's keys and values in one precision.
pub struct Layers<T> {
    keys: Vec<Vec<T>>,
    values: Vec<Vec<T>>,
}

impl<T: Stored> Layers<T> {
    fn new(s: &Shapes, batch: usize) -> Self {
        let buffer = || T::zeroed(batch * s.block_size * s.kv_width);
        Self {
            keys: (0..s.n_layer).map(|_| buffer()).collect(),
            values: (0..s.n_layer).map(|_| buffer()).collect(),
        }
    }

    fn store(&mut self, layer: usize, qkv: &[f32], s: &Shapes, places: &[Place]) {
        let (c, kv) = (s.n_embd, s.kv_width);
        let (keys, values) = (&mut self.keys[layer], &mut self.values[layer]);
        for (row, at) in qkv.chunks_exact(s.qkv_width).zip(places) {
            let slot = (at.seq * s.block_size + at.pos) * kv;
            let narrow = |to: &mut [T], from: &[f32]| {
                for (t, &f) in to.iter_mut().zip(from) {
                    *t = T::narrow(f);
                }
            };
            narrow(&mut keys[slot..slot + kv], &row[c..c + kv]);
            narrow(&mut values[slot..slot + kv], &row[c + kv..]);
        }
    }
}

/// Every layer's keys and values in eight bits, each head of a row with its scale.
pub struct Int8Layers {
    keys: Vec<Vec<i8>>,
    values: Vec<Vec<i8>>,
    /// (batch, block, K/V heads) each.
    key_scales: Vec<Vec<f32>>,
    value_scales: Vec<Vec<f32>>,
}

impl Int8Layers {
    fn new(s: &Shapes, batch: usize) -> Self {
        let rows = batch * s.block_size;
        let layers = |width: usize| -> Vec<Vec<i8>> {
            (0..s.n_layer).map(|_| vec![0; rows * width]).collect()
        };
        let scales = || -> Vec<Vec<f32>> {
            (0..s.n_layer)
                .map(|_| vec![0.0; rows * s.n_kv_head])
                .collect()
        };
        Self {
            keys: layers(s.kv_width),
            values: layers(s.kv_width),
            key_scales: scales(),
            value_scales: scales(),
        }
    }

    fn store(&mut self, layer: usize, qkv: &[f32], s: &Shapes, places: &[Place]) {
        let (c, kv, d) = (s.n_embd, s.kv_width, s.head_dim);
        for (row, at) in qkv.chunks_exact(s.qkv_width).zip(places) {
            let slot = at.seq * s.block_size + at.pos;
            for g in 0..s.n_kv_head {
                let (from, to) = (
                    g * d..(g + 1) * d,
                    slot * kv + g * d..slot * kv + (g + 1) * d,
                );
                let scale = slot * s.n_kv_head + g;
                quantize_head(
                    &row[c..c + kv][from.clone()],
                    &mut self.keys[layer][to.clone()],
                    &mut self.key_scales[layer][scale],
                );
                quantize_head(
                    &row[c + kv..][from],
                    &mut self.values[layer][to],
                    &mut self.value_scales[layer][scale],
                );
            }
        }
    }
}

/// One head of a key or value row in eight bits: each value x as round(x / scale),
/// scale = the head's largest magnitude / 127 (0 for a head of zeros).
fn quantize_head(x: &[f32], into: &mut [i8], scale: &mut f32) {
    let peak = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    *scale = peak / 127.0;
    let inverse = if peak > 0.0 { 127.0 / peak } else { 0.0 };
    for (q, &v) in into.iter_mut().zip(x) {
        *q = (v * inverse).round().clamp(-127.0, 127.0) as i8;
    }
}

/// The keys and values of a decoder's batch of sequences.
pub enum KvCache {
    F32(Layers<f32>),
    Bf16(Layers<Bf16>),
    Int8(Int8Layers),
}

/// One layer's int8 keys and values and their scales.
#[derive(Clone, Copy)]
pub struct Int8Kv<'a> {
    pub keys: &'a [i8],
    pub values: &'a [i8],
    /// (batch, block, K/V heads): a head's values times its scale are the numbers.
    pub key_scales: &'a [f32],
    pub value_scales: &'a [f32],
}

/// One layer's keys and values, (batch, block, kv width) each.
#[derive(Clone, Copy)]
pub enum LayerKv<'a> {
    F32(&'a [f32], &'a [f32]),
    Bf16(&'a [Bf16], &'a [Bf16]),
    Int8(Int8Kv<'a>),
}

impl KvCache {
    /// Empty buffers for `batch` sequences of `s.block_size` positions.
    pub fn new(s: &Shapes, batch: usize, precision: KvPrecision) -> Self {
        match precision {
            KvPrecision::F32 => Self::F32(Layers::new(s, batch)),
            KvPrecision::Bf16 => Self::Bf16(Layers::new(s, batch)),
            KvPrecision::Int8 => Self::Int8(Int8Layers::new(s, batch)),
        }
    }

    /// Bytes the buffers of `batch` sequences take once full.
    pub fn full_bytes(s: &Shapes, batch: usize, precision: KvPrecision) -> f64 {
        (s.n_layer * batch * s.block_size * precision.row_bytes(s)) as f64
    }

    /// Stores the key and value heads of each row of `qkv` (q, k, v side by side, as
    /// the attention's input product gives them) at its (sequence, position).
    pub fn store(&mut self, layer: usize, qkv: &[f32], s: &Shapes, places: &[Place]) {
        match self {
            Self::F32(l) => l.store(layer, qkv, s, places),
            Self::Bf16(l) => l.store(layer, qkv, s, places),
            Self::Int8(l) => l.store(layer, qkv, s, places),
        }
    }

    /// Layer `layer`'s keys and values, to attend over.
    pub fn layer(&self, layer: usize) -> LayerKv<'_> {
        match self {
            Self::F32(l) => LayerKv::F32(&l.keys[layer], &l.values[layer]),
            Self::Bf16(l) => LayerKv::Bf16(&l.keys[layer], &l.values[layer]),
            Self::Int8(l) => LayerKv::Int8(Int8Kv {
                keys: &l.keys[layer],
                values: &l.values[layer],
                key_scales: &l.key_scales[layer],
                value_scales: &l.value_scales[layer],
            }),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::cpu::cached_attention::attend;

    /// `qkv` with each key and value head replaced by the numbers an int8 cache holds
    /// for it (its integers times its scale).
    pub(crate) fn held_int8(s: &Shapes, qkv: &[f32]) -> Vec<f32> {
        let mut held = qkv.to_vec();
        let d = s.head_dim;
        for row in held.chunks_exact_mut(s.qkv_width) {
            for head in row[s.n_embd..].chunks_exact_mut(d) {
                let (mut q, mut scale) = (vec![0i8; d], 0f32);
                quantize_head(head, &mut q, &mut scale);
                for (v, &q) in head.iter_mut().zip(&q) {
                    *v = f32::from(q) * scale;
                }
            }
        }
        held
    }

    /// Each stored value is within half a step (the head's largest magnitude / 127) of
    /// what was stored, the largest is exact but for the scale's rounding, a head of
    /// zeros is zeros, and nothing is written outside the slot.
    #[test]
    fn int8_keys_and_values_are_within_half_a_step_in_their_slot() {
        let s = shapes();
        let (c, kv, d) = (s.n_embd, s.kv_width, s.head_dim);
        let mut cache = KvCache::new(&s, 2, KvPrecision::Int8);
        let mut qkv = values(s.qkv_width, 3);
        qkv[c + kv + d..c + 2 * kv].fill(0.0); // the second value head: zeros
        cache.store(1, &qkv, &s, &[Place { seq: 1, pos: 5 }]);
        let LayerKv::Int8(layer) = cache.layer(1) else {
            panic!("an int8 cache");
        };
        let slot = s.block_size + 5;
        for (part, (ints, scales)) in [
            (layer.keys, layer.key_scales),
            (layer.values, layer.value_scales),
        ]
        .into_iter()
        .enumerate()
        {
            for g in 0..s.n_kv_head {
                let stored = &qkv[c + part * kv + g * d..][..d];
                let peak = stored.iter().fold(0f32, |m, v| m.max(v.abs()));
                let scale = scales[slot * s.n_kv_head + g];
                assert_eq!(scale, peak / 127.0, "part {part} head {g}");
                let held = &ints[slot * kv + g * d..][..d];
                for (&x, &q) in stored.iter().zip(held) {
                    let back = f32::from(q) * scale;
                    assert!(
                        (back - x).abs() <= 0.5 * scale * (1.0 + 1e-6),
                        "{x} held as {back}"
                    );
                }
            }
            let written = ints.iter().filter(|&&q| q != 0).count();
            let nonzero_heads = if part == 0 { 2 } else { 1 };
            assert!(
                written <= nonzero_heads * d,
                "nothing written outside the slot"
            );
        }
        assert!(layer.value_scales[slot * s.n_kv_head + 1] == 0.0);
        let LayerKv::Int8(untouched) = cache.layer(0) else {
            panic!("an int8 cache");
        };
        assert!(
            untouched.keys.iter().all(|&q| q == 0),
            "other layers untouched"
        );
    }

    /// Attention over an int8 cache is attention over the numbers it holds (each
    /// head's integers times its scale), within f32 rounding of the sum in f64.
    #[test]
    fn attention_over_int8_is_attention_over_the_numbers_held() {
        let s = shapes();
        let mut cache = KvCache::new(&s, 1, KvPrecision::Int8);
        let rows = 6;
        let qkv = values(rows * s.qkv_width, 11);
        let places: Vec<Place> = (0..rows).map(|pos| Place { seq: 0, pos }).collect();
        cache.store(0, &qkv, &s, &places);
        let held = held_int8(&s, &qkv);
        let pos = rows - 1;
        let q = &qkv[pos * s.qkv_width..][..s.n_embd];
        let mut scores = vec![0f32; s.n_head * s.block_size];
        let mut got = vec![0f32; s.n_embd];
        attend(&s, q, cache.layer(0), (0, pos), &mut got, &mut scores);
        let want = crate::cpu::prompt_attention::tests::by_definition(&s, &held, pos, pos, false);
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (f64::from(g) - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "{i}: {g} vs {w}"
            );
        }
    }

    /// Two layers, 4 query heads of width 32 sharing 2 K/V heads, 8 positions.
    fn shapes() -> Shapes {
        let (n_head, n_kv_head, head_dim) = (4, 2, 32);
        Shapes {
            n_layer: 2,
            n_embd: n_head * head_dim,
            n_head,
            n_kv_head,
            head_dim,
            block_size: 8,
            vocab_size: 16,
            kv_width: n_kv_head * head_dim,
            qkv_width: (n_head + 2 * n_kv_head) * head_dim,
            mlp_hidden: 4 * n_head * head_dim,
            mlp_fc_width: 4 * n_head * head_dim,
        }
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    #[test]
    fn bf16_keys_and_values_are_rounded_to_nearest_even_in_their_slot() {
        let s = shapes();
        let mut cache = KvCache::new(&s, 2, KvPrecision::Bf16);
        let mut qkv = vec![0f32; s.qkv_width];
        let (c, kv) = (s.n_embd, s.kv_width);
        // bf16 steps by 2^-7 above 1. 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties
        // go to the even one, 1; a bit above halfway goes up; 1 + 3 2^-8 is a tie
        // between 1 + 2^-7 (odd) and 1 + 2^-6 (even): up.
        qkv[c] = 1.0 + 2f32.powi(-8);
        qkv[c + 1] = 1.0 + 2f32.powi(-8) + 2f32.powi(-20);
        qkv[c + 2] = 1.0 + 3.0 * 2f32.powi(-8);
        qkv[c + kv] = -3.0;
        cache.store(1, &qkv, &s, &[Place { seq: 1, pos: 5 }]);
        let LayerKv::Bf16(keys, values) = cache.layer(1) else {
            panic!("a bf16 cache");
        };
        let slot = (s.block_size + 5) * kv;
        assert_eq!(keys[slot].widen(), 1.0);
        assert_eq!(keys[slot + 1].widen(), 1.0 + 2f32.powi(-7));
        assert_eq!(keys[slot + 2].widen(), 1.0 + 2f32.powi(-6));
        assert_eq!(values[slot].widen(), -3.0);
        let written = keys
            .iter()
            .chain(values)
            .filter(|v| v.widen() != 0.0)
            .count();
        assert_eq!(written, 4, "nothing written outside the slot");
        let LayerKv::Bf16(untouched, _) = cache.layer(0) else {
            panic!("a bf16 cache");
        };
        assert!(
            untouched.iter().all(|v| v.widen() == 0.0),
            "other layers untouched"
        );
    }

    /// Attention over a bf16 cache is attention over the rounded keys and values: to
    /// the bit the same as over an f32 cache holding them, and within f32 rounding of
    /// the softmax-weighted sum computed in f64.
    #[test]
    fn attention_over_bf16_is_attention_over_the_rounded_values() {
        let s = shapes();
        let (mut half, mut full) = (
            KvCache::new(&s, 1, KvPrecision::Bf16),
            KvCache::new(&s, 1, KvPrecision::F32),
        );
        let rows = 6;
        let qkv = values(rows * s.qkv_width, 7);
        let rounded: Vec<f32> = qkv.iter().map(|&x| Bf16::round(x).widen()).collect();
        let places: Vec<Place> = (0..rows).map(|pos| Place { seq: 0, pos }).collect();
        half.store(0, &qkv, &s, &places);
        full.store(0, &rounded, &s, &places);
        let q = &qkv[(rows - 1) * s.qkv_width..][..s.n_embd];
        let mut scores = vec![0f32; s.n_head * s.block_size];
        let (mut a, mut b) = (vec![0f32; s.n_embd], vec![0f32; s.n_embd]);
        attend(&s, q, half.layer(0), (0, rows - 1), &mut a, &mut scores);
        attend(&s, q, full.layer(0), (0, rows - 1), &mut b, &mut scores);
        assert_eq!(a, b);

        let d = s.head_dim;
        for h in 0..s.n_head {
            let g = h / s.group();
            let at = |p: usize, part: usize| {
                &rounded[p * s.qkv_width + s.n_embd + part * s.kv_width + g * d..][..d]
            };
            let logits: Vec<f64> = (0..rows)
                .map(|p| {
                    let dot: f64 = (0..d)
                        .map(|i| f64::from(q[h * d + i]) * f64::from(at(p, 0)[i]))
                        .sum();
                    dot / (d as f64).sqrt()
                })
                .collect();
            let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            for i in 0..d {
                let want: f64 = (0..rows)
                    .map(|p| weights[p] / total * f64::from(at(p, 1)[i]))
                    .sum();
                let got = f64::from(a[h * d + i]);
                assert!((got - want).abs() <= 1e-5, "head {h}, {i}: {got} vs {want}");
            }
        }
    }

    /// The buffers take memory as positions fill, not when made: a server's batch of
    /// long contexts costs what its sequences hold, not batch x block_size.
    #[cfg(target_os = "linux")]
    #[test]
    fn buffers_take_no_memory_until_written() {
        fn rss_kib() -> i64 {
            let status = std::fs::read_to_string("/proc/self/status").unwrap();
            let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
            line.split_whitespace().nth(1).unwrap().parse().unwrap()
        }
        let s = Shapes {
            block_size: 1 << 12,
            ..shapes()
        };
        for precision in [KvPrecision::F32, KvPrecision::Bf16, KvPrecision::Int8] {
            // 512 MiB once full, at any precision.
            let batch = (512 << 20) / (KvCache::full_bytes(&s, 1, precision) as usize);
            let before = rss_kib();
            let cache = KvCache::new(&s, batch, precision);
            let grown = rss_kib() - before;
            assert!(
                grown < 128 << 10,
                "{}: 512 MiB of keys and values took {grown} KiB before any was written",
                precision.name()
            );
            drop(cache);
        }
    }
}
