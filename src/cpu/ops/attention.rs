//! Causal self-attention over fused q | k | v rows, with grouped K/V heads: per
//! sequence and head, the weights P = causal softmax(Q Kᵀ / sqrt(d)), then Y = P V, as
//! strided GEMMs that skip the masked triangle. Sequences run in parallel.
//!
//! The weights are recomputed in the backward rather than kept per layer: keeping them
//! would cost B H T T values a layer (150 MiB at 6 layers and T = 256) for a few percent
//! of the step.

use rayon::prelude::*;

use crate::config::Precision;
use crate::cpu::gemm::matmul_serial;
use crate::cpu::kernels::{exp_approx, multiversion, sum_lanes};
use crate::cpu::matrix::{Causal, Product, Strided};
use crate::cpu::threads::threads;
use crate::model::spec::Shapes;
use crate::profile::{self, Cost, Group};

/// One attention call: `batch` sequences of `t` positions, the model's heads, products
/// in `precision`.
#[derive(Debug, Clone, Copy)]
pub struct Attention {
    pub batch: usize,
    pub t: usize,
    pub shapes: Shapes,
    pub precision: Precision,
}

/// One sequence's T x T work space.
pub struct AttnWork<'a> {
    /// The weights P of one head.
    pub p: &'a mut [f32],
    /// Their gradient (backward only).
    pub ds: &'a mut [f32],
    /// The weights after dropout.
    pub dropped: &'a mut [f32],
}

impl Attention {
    /// Work space `forward` and `backward` need: three T x T matrices (weights, their
    /// gradient, the dropped weights) per share of sequences, one share per thread.
    pub fn scratch_len(&self) -> usize {
        self.batch.div_ceil(self.sequences_per_share()) * 3 * self.t * self.t
    }

    /// Sequences each thread takes.
    fn sequences_per_share(&self) -> usize {
        self.batch.div_ceil(threads()).max(1)
    }

    /// Offsets in a qkv row of the key and the value head that query head `head` reads.
    fn kv_offsets(&self, head: usize) -> (usize, usize) {
        let s = &self.shapes;
        let kv_head = head / s.group();
        let k = s.n_embd + kv_head * s.head_dim;
        (k, k + s.kv_width)
    }

    /// Runs `one(sequence, its rows of out, work space)` for every sequence of the
    /// batch: one share of sequences per thread, each share with its own slice of
    /// `scratch`. `out` has rows `width` wide.
    fn per_sequence(
        &self,
        out: &mut [f32],
        width: usize,
        scratch: &mut [f32],
        one: impl Fn(usize, &mut [f32], AttnWork) + Sync,
    ) {
        let (t, share) = (self.t, self.sequences_per_share());
        out.par_chunks_mut(share * t * width)
            .zip(scratch.par_chunks_mut(3 * t * t))
            .enumerate()
            .for_each(|(i, (out, scratch))| {
                let (p, rest) = scratch.split_at_mut(t * t);
                let (ds, dropped) = rest.split_at_mut(t * t);
                for (j, out) in out.chunks_mut(t * width).enumerate() {
                    let work = AttnWork {
                        p: &mut *p,
                        ds: &mut *ds,
                        dropped: &mut dropped[..t * t],
                    };
                    one(i * share + j, out, work);
                }
            });
    }

    /// Sequence `b`'s rows of `x` (rows `width` wide), and its part of a dropout mask.
    fn sequence<'x>(&self, x: &'x [f32], width: usize, b: usize) -> &'x [f32] {
        let len = self.t * width;
        &x[b * len..(b + 1) * len]
    }

    /// y (N, C) from qkv (N, qkv width). With a dropout `mask` (B, H, T, T; 0 or
    /// 1/(1-p)), Y = (P * mask) V.
    pub fn forward(&self, y: &mut [f32], qkv: &[f32], mask: Option<&[f32]>, scratch: &mut [f32]) {
        let s = &self.shapes;
        let heads = s.n_head * self.t;
        // Q Kᵀ and P V over the causal half: 2 t² d a head and sequence.
        let rows = qkv.len() / s.qkv_width;
        let _span = profile::span(Group::Attention, || {
            Cost::f32s_and_flops(
                rows * (s.qkv_width + s.n_embd),
                2 * rows * self.t * s.n_embd,
            )
        });
        self.per_sequence(y, s.n_embd, scratch, |b, y, work| {
            let qkv = self.sequence(qkv, s.qkv_width, b);
            let mask = mask.map(|m| self.sequence(m, heads, b));
            self.forward_one(y, qkv, mask, work)
        });
    }

    /// `forward` for one sequence: per head, the weights P (into `work.p`), then Y = P V
    /// (a GEMM on strided views of qkv).
    fn forward_one(&self, y: &mut [f32], qkv: &[f32], mask: Option<&[f32]>, work: AttnWork) {
        let (t, s) = (self.t, &self.shapes);
        let (c, d, w) = (s.n_embd, s.head_dim, s.qkv_width);
        let AttnWork { p, dropped, .. } = work;
        for head in 0..s.n_head {
            self.weights(p, qkv, head);
            let (_, vo) = self.kv_offsets(head);
            let p: &[f32] = match mask {
                Some(mask) => drop_out(dropped, p, &mask[head * t * t..(head + 1) * t * t]),
                None => p,
            };
            let v = Strided::rows(&qkv[vo..], w);
            let pv = Product::new(Strided::rows(p, t), v, (t, d, t)).causal(Causal::LowerA);
            matmul_serial(&mut y[head * d..], c, pv, self.precision);
        }
    }

    /// One head's weights for one sequence into `p` (T x T): S = Q Kᵀ / sqrt(d), then the
    /// causal softmax of each row (zeros above the diagonal).
    fn weights(&self, p: &mut [f32], qkv: &[f32], head: usize) {
        let (t, s) = (self.t, &self.shapes);
        let (d, w) = (s.head_dim, s.qkv_width);
        let (ko, _) = self.kv_offsets(head);
        let q = Strided::rows(&qkv[head * d..], w);
        let kt = Strided::columns(&qkv[ko..], w);
        let scale = 1.0 / (d as f32).sqrt();
        // Scores above the diagonal are never read: the softmax writes zeros there.
        let qk = Product::new(q, kt, (t, t, d))
            .scaled(scale)
            .causal(Causal::LowerDst);
        matmul_serial(p, t, qk, self.precision);
        causal_softmax_rows(p, t);
    }

    /// dqkv += d(q | k | v) from dy. Per head, with P recomputed and Pd = P * mask (P
    /// without dropout): dPd = dY Vᵀ; dP = dPd * mask; dS = P * (dP - rowsum(P * dP))
    /// * scale; dQ += dS K; dK += dSᵀ Q; dV += Pdᵀ dY.
    pub fn backward(
        &self,
        dqkv: &mut [f32],
        dy: &[f32],
        qkv: &[f32],
        mask: Option<&[f32]>,
        scratch: &mut [f32],
    ) {
        let s = &self.shapes;
        let heads = s.n_head * self.t;
        // Five products over the causal half: S again, dPd, dQ, dK, dV.
        let rows = qkv.len() / s.qkv_width;
        let _span = profile::span(Group::Attention, || {
            Cost::f32s_and_flops(
                rows * (s.n_embd + 3 * s.qkv_width),
                5 * rows * self.t * s.n_embd,
            )
        });
        self.per_sequence(dqkv, s.qkv_width, scratch, |b, dqkv, work| {
            let rows = (
                self.sequence(dy, s.n_embd, b),
                self.sequence(qkv, s.qkv_width, b),
            );
            let mask = mask.map(|m| self.sequence(m, heads, b));
            self.backward_one(dqkv, rows, mask, work)
        });
    }

    /// `backward` for one sequence.
    fn backward_one(
        &self,
        dqkv: &mut [f32],
        (dy, qkv): (&[f32], &[f32]),
        mask: Option<&[f32]>,
        work: AttnWork,
    ) {
        let (t, s) = (self.t, &self.shapes);
        let (c, d, w) = (s.n_embd, s.head_dim, s.qkv_width);
        let scale = 1.0 / (d as f32).sqrt();
        let AttnWork { p, ds, dropped } = work;
        for head in 0..s.n_head {
            let (ko, vo) = self.kv_offsets(head);
            self.weights(p, qkv, head);
            let p: &[f32] = p;
            let dy_h = Strided::rows(&dy[head * d..], c);
            // dPd below the diagonal (the rest stays stale: the softmax backward reads
            // and writes only j <= i).
            let dpd = Product::new(dy_h, Strided::columns(&qkv[vo..], w), (t, t, d));
            matmul_serial(ds, t, dpd.causal(Causal::LowerDst), self.precision);
            let head_mask = mask.map(|m| &m[head * t * t..(head + 1) * t * t]);
            if let Some(m) = head_mask {
                for (g, k) in ds.iter_mut().zip(m) {
                    *g *= k;
                }
            }
            causal_softmax_rows_backward(ds, p, t, scale);
            // dS is zero above the diagonal: query i takes keys j <= i, key j gets
            // gradient from queries i >= j.
            let (ds_m, ds_t) = (Strided::rows(ds, t), Strided::columns(ds, t));
            let k = Strided::rows(&qkv[ko..], w);
            let q = Strided::rows(&qkv[head * d..], w);
            let dq = Product::new(ds_m, k, (t, d, t))
                .accumulating()
                .causal(Causal::LowerA);
            matmul_serial(&mut dqkv[head * d..], w, dq, self.precision);
            let dk = Product::new(ds_t, q, (t, d, t))
                .accumulating()
                .causal(Causal::UpperA);
            matmul_serial(&mut dqkv[ko..], w, dk, self.precision);
            let p_used: &[f32] = match head_mask {
                Some(m) => drop_out(dropped, p, m),
                None => p,
            };
            let dv = Product::new(Strided::columns(p_used, t), dy_h, (t, d, t));
            matmul_serial(
                &mut dqkv[vo..],
                w,
                dv.accumulating().causal(Causal::UpperA),
                self.precision,
            );
        }
    }
}

/// out = p * mask, elementwise; returns out.
fn drop_out<'o>(out: &'o mut [f32], p: &[f32], mask: &[f32]) -> &'o [f32] {
    for ((o, a), k) in out.iter_mut().zip(p).zip(mask) {
        *o = a * k;
    }
    out
}

multiversion! {
    /// Row i of the (t x t) scores: softmax over columns 0..=i, zeros after.
    ///
    /// Each row is taken in whole vectors of 16, the columns past the diagonal masked
    /// out (-inf for the maximum, 0 after the exponential): row by row the lengths
    /// 1..=t each leave a ragged tail, and a tail runs element by element (the running
    /// maximum's serial chain was a third of this function's time at T = 64).
    pub fn causal_softmax_rows(p: &mut [f32], t: usize) {
        softmax_rows_seeing(p, t, 0)
    }
}

multiversion! {
    /// Row i of scores `width` wide: softmax over columns 0..first + i + 1, zeros after
    /// (queries at positions first.. of a sequence whose first positions are cached:
    /// a prompt after the part already decoded). As [`causal_softmax_rows`] otherwise.
    pub fn causal_softmax_rows_after(p: &mut [f32], width: usize, first: usize) {
        softmax_rows_seeing(p, width, first)
    }
}

/// The rows of `p` (`width` wide), row i seeing `first + i + 1` columns.
#[inline(always)]
fn softmax_rows_seeing(p: &mut [f32], width: usize, first: usize) {
    for (i, row) in p.chunks_exact_mut(width).enumerate() {
        let seen = first + i + 1;
        let whole = seen.next_multiple_of(LANES);
        let written = if whole > width {
            // The last rows when the width is not a multiple of 16.
            softmax_in_place(&mut row[..seen]);
            seen
        } else {
            softmax_whole_vectors(&mut row[..whole], seen);
            whole
        };
        row[written..].fill(0.0);
    }
}

/// Lanes of the softmax's vectors.
const LANES: usize = 16;

/// Softmax over the first `seen` values of `row`, zeros after, `row` a whole number of
/// vectors: the maximum, then the exponentials and their sum in one pass, then the
/// scaling. Only the vector holding the diagonal is masked; the rest run unmasked (a
/// mask on every vector kept the maximum out of vector registers). Sums and maxima go
/// lane by lane, then across the lanes as trees.
#[inline(always)]
fn softmax_whole_vectors(row: &mut [f32], seen: usize) {
    let (vectors, rest) = row.as_chunks_mut::<LANES>();
    debug_assert!(rest.is_empty() && seen <= vectors.len() * LANES);
    let (full, tail) = (seen / LANES, seen % LANES);
    let mut top = [f32::NEG_INFINITY; LANES];
    for v in &vectors[..full] {
        for k in 0..LANES {
            top[k] = top[k].max(v[k]);
        }
    }
    if tail > 0 {
        let v = &vectors[full];
        for k in 0..LANES {
            top[k] = top[k].max(if k < tail { v[k] } else { f32::NEG_INFINITY });
        }
    }
    let max = max_of_lanes(top);
    let mut sums = [0f32; LANES];
    for v in &mut vectors[..full] {
        for k in 0..LANES {
            v[k] = exp_approx(v[k] - max);
            sums[k] += v[k];
        }
    }
    if tail > 0 {
        let v = &mut vectors[full];
        for k in 0..LANES {
            v[k] = if k < tail {
                exp_approx(v[k] - max)
            } else {
                0.0
            };
            sums[k] += v[k];
        }
    }
    let inv = 1.0 / sum_of_lanes(sums);
    for x in row.iter_mut() {
        *x *= inv;
    }
}

/// The sum of the lanes, added as a tree (a chain of sixteen adds a row was a tenth of
/// the softmax's time).
#[inline(always)]
fn sum_of_lanes(mut lanes: [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for k in 0..width {
            lanes[k] += lanes[k + width];
        }
        width /= 2;
    }
    lanes[0]
}

/// softmax over all of `x`, in place.
#[inline(always)]
fn softmax_in_place(x: &mut [f32]) {
    let max = max_of_first(x, x.len());
    for a in x.iter_mut() {
        *a = exp_approx(*a - max);
    }
    let inv = 1.0 / sum_lanes(x, |a| a);
    for a in x.iter_mut() {
        *a *= inv;
    }
}

multiversion! {
    /// dP -> dS in place, row by row: ds_j = p_j (dp_j - sum_k p_k dp_k) * scale for
    /// j <= i; zero above the diagonal (where p is zero and dP need not be set).
    ///
    /// Rows go in whole vectors of 16 as in [`causal_softmax_rows`], columns past the
    /// diagonal masked out (dP there is stale).
    pub fn causal_softmax_rows_backward(ds: &mut [f32], p: &[f32], t: usize, scale: f32) {
        for (i, (row, p)) in ds.chunks_exact_mut(t).zip(p.chunks_exact(t)).enumerate() {
            let seen = i + 1;
            let whole = seen.next_multiple_of(LANES).min(t);
            let weighted = masked_dot(&row[..whole], &p[..whole], seen);
            for (j, (a, &pj)) in row[..whole].iter_mut().zip(p).enumerate() {
                *a = if j < seen { pj * (*a - weighted) * scale } else { 0.0 };
            }
            row[whole..].fill(0.0);
        }
    }
}

/// Σ a[j] b[j] over the first `n` elements, in 16 lanes (whole vectors read, those
/// past `n` masked out) summed as a tree.
#[inline(always)]
fn masked_dot(a: &[f32], b: &[f32], n: usize) -> f32 {
    let mut lanes = [0f32; LANES];
    let (whole, _) = a.as_chunks::<LANES>();
    let (b_whole, _) = b.as_chunks::<LANES>();
    for (c, (a, b)) in whole.iter().zip(b_whole).enumerate() {
        for k in 0..LANES {
            lanes[k] += if c * LANES + k < n { a[k] * b[k] } else { 0.0 };
        }
    }
    let mut width = LANES / 2;
    while width > 0 {
        for k in 0..width {
            lanes[k] += lanes[k + width];
        }
        width /= 2;
    }
    let done = whole.len() * LANES;
    lanes[0] + (done..n).map(|j| a[j] * b[j]).sum::<f32>()
}

/// The largest of the first `n` elements of `x`, with 16 running maxima the compiler
/// keeps in a vector register (whole vectors of `x` read, those past `n` masked out),
/// combined as a tree.
#[inline(always)]
fn max_of_first(x: &[f32], n: usize) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for (c, chunk) in chunks.enumerate() {
        for k in 0..LANES {
            let v = if c * LANES + k < n {
                chunk[k]
            } else {
                f32::NEG_INFINITY
            };
            lanes[k] = if v > lanes[k] { v } else { lanes[k] };
        }
    }
    let mut m = max_of_lanes(lanes);
    for &v in &rest[..n.saturating_sub(x.len() - rest.len()).min(rest.len())] {
        m = if v > m { v } else { m };
    }
    m
}

/// The largest of the lanes, combined as a tree.
#[inline(always)]
fn max_of_lanes(mut lanes: [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for k in 0..width {
            lanes[k] = if lanes[k + width] > lanes[k] {
                lanes[k + width]
            } else {
                lanes[k]
            };
        }
        width /= 2;
    }
    lanes[0]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::cpu::ops::testing::{assert_gradient, probe_loss, values};

    /// Each row's softmax over its first i + 1 scores against f64, zeros after, whatever
    /// lies above the diagonal (the scores product leaves it stale): rows in whole
    /// vectors and, with T not a multiple of 16, the last rows element by element.
    #[test]
    fn causal_softmax_rows_match_f64_and_ignore_what_lies_above_the_diagonal() {
        for t in [16, 37, 64] {
            let mut p = values(t * t, 3);
            for (i, row) in p.chunks_exact_mut(t).enumerate() {
                for (j, a) in row.iter_mut().enumerate().skip(i + 1) {
                    *a = [f32::NAN, f32::INFINITY, 1e30][j % 3];
                }
                row[i] *= 30.0; // some rows' largest far above the rest
            }
            let scores = p.clone();
            causal_softmax_rows(&mut p, t);
            for i in 0..t {
                let row = &scores[i * t..=i * t + i];
                let max = row
                    .iter()
                    .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
                let total: f64 = row.iter().map(|&v| (f64::from(v) - max).exp()).sum();
                for j in 0..t {
                    let got = p[i * t + j];
                    if j > i {
                        assert_eq!(got, 0.0, "t {t}: row {i}, column {j} above the diagonal");
                    } else {
                        let want = (f64::from(row[j]) - max).exp() / total;
                        let off = (f64::from(got) - want).abs();
                        assert!(
                            off <= 1e-6 * want.max(1e-3),
                            "t {t}: ({i}, {j}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// dS = P * (dP - rowsum(P * dP)) * scale against f64, row by row, whatever dP
    /// holds above the diagonal; zeros there.
    #[test]
    fn causal_softmax_rows_backward_matches_f64() {
        let scale = 0.125;
        for t in [4, 16, 37, 64] {
            let mut p = values(t * t, 5);
            causal_softmax_rows(&mut p, t);
            let mut ds = values(t * t, 6);
            for (i, row) in ds.chunks_exact_mut(t).enumerate() {
                for (j, a) in row.iter_mut().enumerate().skip(i + 1) {
                    *a = [f32::NAN, f32::INFINITY, 1e30][j % 3];
                }
            }
            let dp = ds.clone();
            causal_softmax_rows_backward(&mut ds, &p, t, scale);
            for i in 0..t {
                let at = |m: &[f32], j: usize| f64::from(m[i * t + j]);
                let weighted: f64 = (0..=i).map(|j| at(&p, j) * at(&dp, j)).sum();
                for j in 0..t {
                    let got = ds[i * t + j];
                    if j > i {
                        assert_eq!(got, 0.0, "t {t}: ({i}, {j}) above the diagonal");
                        continue;
                    }
                    let want = at(&p, j) * (at(&dp, j) - weighted) * f64::from(scale);
                    let off = (f64::from(got) - want).abs();
                    assert!(off <= 1e-6, "t {t}: ({i}, {j}): {got} vs {want}");
                }
            }
        }
    }

    /// dqkv of sum(attention(qkv) * probe) against central differences, with grouped
    /// K/V heads, without and with a dropout mask on the weights.
    #[test]
    fn backward_matches_differences() {
        let cfg = ModelConfig {
            n_head: 2,
            n_kv_head: Some(1),
            n_embd: 6,
            block_size: 4,
            vocab_size: 3,
            ..ModelConfig::default()
        };
        let attn = Attention {
            batch: 2,
            t: 4,
            shapes: Shapes::new(&cfg),
            precision: Precision::F32,
        };
        let s = attn.shapes;
        let n = attn.batch * attn.t;
        let qkv = values(n * s.qkv_width, 7);
        let probe = values(n * s.n_embd, 8);
        let mask: Vec<f32> = values(attn.batch * s.n_head * 16, 9)
            .iter()
            .map(|&v| if v < -0.3 { 0.0 } else { 1.25 })
            .collect();
        for mask in [None, Some(mask.as_slice())] {
            let mut scratch = vec![0.0; attn.scratch_len()];
            let mut loss = |qkv: &[f32]| -> f64 {
                let mut y = vec![0.0; n * s.n_embd];
                attn.forward(&mut y, qkv, mask, &mut vec![0.0; attn.scratch_len()]);
                probe_loss(&y, &probe)
            };
            let mut dqkv = vec![0.0; n * s.qkv_width];
            attn.backward(&mut dqkv, &probe, &qkv, mask, &mut scratch);
            let at: Vec<usize> = (0..n * s.qkv_width).step_by(3).collect();
            let what = format!("dqkv, mask: {}", mask.is_some());
            assert_gradient(&what, &dqkv, &mut loss, &qkv, &at);
        }
    }
}
