//! A prompt's attention as matrix products.
//!
//! Decoding attends one position at a time (`cached_attention::attend`): its query against every
//! cached key, one dot product per key and head. A prompt has many positions of one
//! sequence in the same pass, and there that way reads the sequence's whole cache once
//! per position and spends as much on folding each short dot product as on the
//! products: a 512-token prompt of GPT-2's shape spent a fifth of its first token
//! there. Here a run of consecutive positions of one sequence attends as the training
//! engine's attention does, per head: S = Q Kᵀ / sqrt(d) and Y = P V as GEMMs, the
//! masked triangle skipped, the rows that see cached positions before the run
//! (`first` of them) seeing those in full.
//!
//! The sums run in another order than the one-position path's, so a run's outputs
//! differ from it by rounding. Given the run they depend on nothing else in the pass;
//! whether a prompt's positions form a run (16 or more of them in one pass) depends on
//! how a server cuts its prompts into pieces beside other sequences.

use std::ops::Range;

use rayon::prelude::*;

use super::gemm::matmul_serial;
use super::kernels::Widen;
use super::kv_cache::{LayerKv, Place};
use super::matrix::{Causal, Product, Strided};
use super::ops::attention::causal_softmax_rows_after;
use crate::config::Precision;
use crate::model::spec::Shapes;

/// Runs shorter than this attend a position at a time: a GEMM's packing costs more
/// than it saves on a few rows.
pub const MIN_RUN: usize = 16;

/// Consecutive positions of one sequence in a pass: rows `rows` of it, the first at
/// position `first` of sequence `seq`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    pub rows: Range<usize>,
    pub seq: usize,
    pub first: usize,
}

/// The runs of at least [`MIN_RUN`] rows in `places` (rows at consecutive positions of
/// one sequence), into `runs`.
pub fn find_runs(places: &[Place], runs: &mut Vec<Run>) {
    runs.clear();
    let mut start = 0;
    for r in 1..=places.len() {
        let goes_on = r < places.len()
            && places[r].seq == places[r - 1].seq
            && places[r].pos == places[r - 1].pos + 1;
        if !goes_on {
            if r - start >= MIN_RUN {
                runs.push(Run {
                    rows: start..r,
                    seq: places[start].seq,
                    first: places[start].pos,
                });
            }
            start = r;
        }
    }
}

/// The attention outputs of every row of `runs` into `att` (rows `n_embd` wide), from
/// the queries in `qkv` and the layer's `cache`, which already holds the runs' own keys
/// and values. Each run and head is a task for the pool; `by_head` (as long as `att`)
/// holds their outputs head-major until they are copied into place.
pub fn attend_runs(
    s: &Shapes,
    qkv: &[f32],
    cache: LayerKv,
    runs: &[Run],
    att: &mut [f32],
    by_head: &mut [f32],
) {
    let (c, d) = (s.n_embd, s.head_dim);
    let mut tasks = Vec::with_capacity(runs.len() * s.n_head);
    // The runs lie in row order, apart: each takes its rows' part of `by_head`.
    let (mut rest, mut at) = (&mut *by_head, 0);
    for run in runs {
        let (_, from_start) = rest.split_at_mut(run.rows.start * c - at);
        let (outs, after) = from_start.split_at_mut(run.rows.len() * c);
        (rest, at) = (after, run.rows.end * c);
        tasks.extend(
            outs.chunks_exact_mut(run.rows.len() * d)
                .enumerate()
                .map(|(head, out)| (run, head, out)),
        );
    }
    tasks
        .into_par_iter()
        .for_each_init(Vec::new, |work, (run, head, out)| {
            attend_head(s, qkv, cache, run, head, out, work)
        });
    for run in runs {
        let len = run.rows.len();
        let outs = &by_head[run.rows.start * c..run.rows.end * c];
        for (head, out) in outs.chunks_exact(len * d).enumerate() {
            for (i, y) in out.chunks_exact(d).enumerate() {
                let r = run.rows.start + i;
                att[r * c + head * d..][..d].copy_from_slice(y);
            }
        }
    }
}

/// One head of one run: `out` (rows x head width) = softmax(Q Kᵀ / sqrt(d)) V over the
/// positions each row sees. `work` holds the scores, and bf16 or int8 keys and values
/// widened (int8 ones times their scales).
fn attend_head(
    s: &Shapes,
    qkv: &[f32],
    cache: LayerKv,
    run: &Run,
    head: usize,
    out: &mut [f32],
    work: &mut Vec<f32>,
) {
    let (d, len, first) = (s.head_dim, run.rows.len(), run.first);
    // Positions the run's last row sees: the width of the scores.
    let seen = first + len;
    let kv_head = head / s.group();
    let widened = match cache {
        LayerKv::F32(..) => 0,
        LayerKv::Bf16(..) | LayerKv::Int8(..) => 2 * seen * d,
    };
    work.resize(len * seen + widened, 0.0);
    let (scores, widened) = work.split_at_mut(len * seen);
    let (keys, values) = match cache {
        LayerKv::F32(k, v) => (
            head_rows(k, s, run.seq, kv_head),
            head_rows(v, s, run.seq, kv_head),
        ),
        LayerKv::Bf16(k, v) => {
            let (wk, wv) = widened.split_at_mut(seen * d);
            widen_head(wk, k, s, run.seq, kv_head);
            widen_head(wv, v, s, run.seq, kv_head);
            (Strided::rows(wk, d), Strided::rows(wv, d))
        }
        LayerKv::Int8(kv) => {
            let (wk, wv) = widened.split_at_mut(seen * d);
            // The head's scale of each position: every n_kv_head-th from the first.
            let first = run.seq * s.block_size * s.n_kv_head + kv_head;
            widen_head(wk, kv.keys, s, run.seq, kv_head);
            widen_head(wv, kv.values, s, run.seq, kv_head);
            scale_rows(wk, d, kv.key_scales[first..].iter().step_by(s.n_kv_head));
            scale_rows(wv, d, kv.value_scales[first..].iter().step_by(s.n_kv_head));
            (Strided::rows(wk, d), Strided::rows(wv, d))
        }
    };

    // S = Q Kᵀ / sqrt(d): the cached positions in full, the run's own below the
    // diagonal (the softmax writes zeros above it).
    let q = Strided::rows(&qkv[run.rows.start * s.qkv_width + head * d..], s.qkv_width);
    let kt = keys.transpose();
    let scale = 1.0 / (d as f32).sqrt();
    if first > 0 {
        let cached = Product::new(q, kt, (len, first, d)).scaled(scale);
        matmul_serial(scores, seen, cached, Precision::F32);
    }
    let own = Product::new(q, kt.offset(0, first), (len, len, d))
        .scaled(scale)
        .causal(Causal::LowerDst);
    matmul_serial(&mut scores[first..], seen, own, Precision::F32);
    causal_softmax_rows_after(scores, seen, first);

    // Y = P V, the run's own positions' weights lower triangular.
    let p = Strided::rows(scores, seen);
    if first > 0 {
        let cached = Product::new(p, values, (len, d, first));
        matmul_serial(out, d, cached, Precision::F32);
    }
    let own = Product::new(p.offset(0, first), values.offset(first, 0), (len, d, len))
        .causal(Causal::LowerA);
    let own = if first > 0 { own.accumulating() } else { own };
    matmul_serial(out, d, own, Precision::F32);
}

/// K/V head `kv_head` of sequence `seq` in an f32 layer: rows a K/V row apart.
fn head_rows<'a>(rows: &'a [f32], s: &Shapes, seq: usize, kv_head: usize) -> Strided<'a> {
    let at = seq * s.block_size * s.kv_width + kv_head * s.head_dim;
    Strided::rows(&rows[at..], s.kv_width)
}

/// Each row of `rows` (`width` values) times its scale.
fn scale_rows<'s>(rows: &mut [f32], width: usize, scales: impl Iterator<Item = &'s f32>) {
    for (row, &scale) in rows.chunks_exact_mut(width).zip(scales) {
        for v in row {
            *v *= scale;
        }
    }
}

/// The first `into.len() / head_dim` positions of K/V head `kv_head` of sequence `seq`,
/// widened to f32 and packed.
fn widen_head<T: Widen>(into: &mut [f32], rows: &[T], s: &Shapes, seq: usize, kv_head: usize) {
    let d = s.head_dim;
    let rows = rows[seq * s.block_size * s.kv_width..].chunks_exact(s.kv_width);
    for (to, row) in into.chunks_exact_mut(d).zip(rows) {
        for (t, x) in to.iter_mut().zip(&row[kv_head * d..(kv_head + 1) * d]) {
            *t = x.widen();
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::cpu::cached_attention::attend;
    use crate::cpu::kv_cache::{KvCache, KvPrecision};
    use crate::cpu::weight_rows::Bf16;

    /// 4 query heads of width 24 sharing 2 K/V heads (not a multiple of 16 or 32 wide),
    /// 80 positions.
    fn shapes() -> Shapes {
        let config = crate::config::ModelConfig {
            n_layer: 1,
            n_head: 4,
            n_kv_head: Some(2),
            n_embd: 96,
            block_size: 80,
            vocab_size: 16,
            ..Default::default()
        };
        let s = crate::model::spec::ModelSpec::new(&config).shapes;
        assert_eq!((s.head_dim, s.group()), (24, 2));
        s
    }

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 7919 + seed * 104_729) % 1000) as f32 / 500.0 - 1.0) * 1.5)
            .collect()
    }

    /// softmax(q · k_p / sqrt(d)) v_p summed over the positions a query sees, in f64,
    /// from the keys and values as the cache holds them (`round` for bf16): the query is
    /// row `q_row` of `qkv`, the keys and values its rows 0..=pos. (The decoder's tests
    /// use it too.)
    pub(crate) fn by_definition(
        s: &Shapes,
        qkv: &[f32],
        pos: usize,
        q_row: usize,
        round: bool,
    ) -> Vec<f64> {
        let (c, d) = (s.n_embd, s.head_dim);
        let stored = |x: f32| if round { Bf16::round(x).widen() } else { x } as f64;
        let mut y = vec![0f64; c];
        for h in 0..s.n_head {
            let g = h / s.group();
            let q = &qkv[q_row * s.qkv_width + h * d..][..d];
            let kv = |p: usize, part: usize| {
                &qkv[p * s.qkv_width + c + part * s.kv_width + g * d..][..d]
            };
            let scores: Vec<f64> = (0..=pos)
                .map(|p| {
                    let dot: f64 = q
                        .iter()
                        .zip(kv(p, 0))
                        .map(|(a, b)| *a as f64 * stored(*b))
                        .sum();
                    dot / (d as f64).sqrt()
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let total: f64 = scores.iter().map(|x| (x - max).exp()).sum();
            for (p, score) in scores.iter().enumerate() {
                let w = (score - max).exp() / total;
                for (out, v) in y[h * d..(h + 1) * d].iter_mut().zip(kv(p, 1)) {
                    *out += w * stored(*v);
                }
            }
        }
        y
    }

    /// A run's outputs are attention by its definition (f64, within the approximate
    /// exponential's and f32's error), and the one-position path's within rounding:
    /// a whole prompt from position 0, and a run after 23 cached positions (queries that
    /// see cached keys in full and their own below the diagonal, also past the causal
    /// products' 64-row blocks), f32, bf16 and int8 caches (int8: the definition over
    /// the numbers it holds), lengths that are not multiples of the vectors' 16.
    #[test]
    fn runs_attend_as_the_definition_and_as_one_position_at_a_time() {
        let s = shapes();
        let positions = 71;
        let qkv = values(positions * s.qkv_width, 3);
        let held = crate::cpu::kv_cache::tests::held_int8(&s, &qkv);
        for precision in [KvPrecision::F32, KvPrecision::Bf16, KvPrecision::Int8] {
            let mut cache = KvCache::new(&s, 2, precision);
            // Sequence 1, so a run's rows are read at its own offset in the cache.
            let places: Vec<Place> = (0..positions).map(|pos| Place { seq: 1, pos }).collect();
            cache.store(0, &qkv, &s, &places);
            // A run past one 64-row block of the causal products after cached positions.
            for (first, len) in [(0, positions), (23, positions - 23), (50, MIN_RUN), (5, 66)] {
                let run = Run {
                    rows: 0..len,
                    seq: 1,
                    first,
                };
                let queries = &qkv[first * s.qkv_width..];
                let c = s.n_embd;
                let mut att = vec![0f32; len * c];
                let mut by_head = vec![0f32; len * c];
                attend_runs(&s, queries, cache.layer(0), &[run], &mut att, &mut by_head);
                let mut scores = vec![0f32; s.n_head * s.block_size];
                let round = precision == KvPrecision::Bf16;
                for i in 0..len {
                    let pos = first + i;
                    let q = &qkv[pos * s.qkv_width..][..c];
                    let mut one = vec![0f32; c];
                    attend(&s, q, cache.layer(0), (1, pos), &mut one, &mut scores);
                    let want = match precision {
                        KvPrecision::Int8 => by_definition(&s, &held, pos, pos, false),
                        _ => by_definition(&s, &qkv, pos, pos, round),
                    };
                    let got = &att[i * c..(i + 1) * c];
                    for (k, ((g, o), w)) in got.iter().zip(&one).zip(&want).enumerate() {
                        let what = format!("{precision:?}, run from {first}, position {pos}, {k}");
                        assert!(
                            (*g as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()),
                            "{what}: {g} vs {w}"
                        );
                        assert!(
                            (g - o).abs() <= 1e-5 * (1.0 + o.abs()),
                            "{what}: {g} vs one at a time {o}"
                        );
                    }
                }
            }
        }
    }

    /// Runs are the stretches of consecutive positions of one sequence at least
    /// `MIN_RUN` long, wherever they lie in a pass.
    #[test]
    fn runs_are_long_stretches_of_consecutive_positions() {
        let at = |seq: usize, pos: Range<usize>| pos.map(move |pos| Place { seq, pos });
        let places: Vec<Place> = at(0, 5..6)
            .chain(at(1, 0..MIN_RUN))
            .chain(at(2, 3..3 + MIN_RUN - 1))
            .chain(at(2, 40..40 + MIN_RUN + 2))
            .chain(at(3, 9..10))
            .collect();
        let mut runs = vec![];
        find_runs(&places, &mut runs);
        let (a, b) = (
            1 + MIN_RUN + MIN_RUN - 1,
            1 + MIN_RUN + MIN_RUN - 1 + MIN_RUN + 2,
        );
        assert_eq!(
            runs,
            vec![
                Run {
                    rows: 1..1 + MIN_RUN,
                    seq: 1,
                    first: 0
                },
                Run {
                    rows: a..b,
                    seq: 2,
                    first: 40
                },
            ]
        );
    }
}
