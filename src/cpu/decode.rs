//! Decoding on the CPU without a tensor library in the loop.
//!
//! The reference model decodes through ~100 small candle ops per token, each allocating
//! its output. Here one token costs, per layer, the training engine's own layer ops
//! (norms, RoPE, the MLP's non-linearity, residual adds) on one row per sequence, plus
//! what only decoding has: products that read each weight once for all the rows
//! (`DecodeWeights`, in f32, bf16 or eight bits), and attention over preallocated
//! per-layer K/V buffers (grouped K/V heads stored once). Nothing is allocated per
//! token of one stream. Several sequences (samples) step together, so each weight row
//! is read once for all of them.
//!
//! The prompt (and every window slide) runs through the same code with many rows at
//! once: attention rows are spread over threads, long prompts' products become GEMMs.

use std::ops::Range;
use std::sync::Arc;

use anyhow::Result;
use rayon::prelude::*;

use super::decode_weights::{DecodeWeights, WeightFormat};
#[cfg(target_arch = "x86_64")]
use super::isa::{self, Isa};
use super::kernels::{axpy, dot_lanes, exp_approx, multiversion, softmax_inline, sum_lanes, Widen};
use super::kv_cache::{KvCache, KvPrecision, LayerKv, Place};
use super::ops::loss::row_loss;
use super::ops::norm::NormStats;
use super::ops::rope::Turn;
use super::ops::{residual_in_place, Positions};
use super::prompt_attention::{attend_runs, find_runs, Run};
use super::q8::Q8Row;
use super::team;
use super::threads::on_workers_awake;
use super::weight_rows::Bf16;
#[cfg(target_arch = "x86_64")]
use super::weight_rows::Weight;
use crate::model::spec::{ModelSpec, Shapes};

/// A model's weights laid out for decoding (shared), and the K/V buffers of `batch`
/// sequences.
pub struct FastDecoder {
    weights: Arc<DecodeWeights>,
    /// The weights' shapes with `block_size` the positions this decoder holds (fewer
    /// than the model's where scoring needs no more: `eval --context`).
    shapes: Shapes,
    /// Activation rows quantized for the eight-bit products.
    q8_rows: Vec<Q8Row>,
    /// `next_token_losses`' work space: `GROUP` positions' final norms, their logits.
    scoring: Option<(Vec<f32>, Vec<f32>, NormStats)>,

    batch: usize,
    /// Positions per forward call that the scratch buffers hold (a prefill may need
    /// several calls).
    chunk: usize,
    len: usize,
    cache: KvCache,
    scratch: Scratch,
    /// The rows of the pass being run: where each goes, which give logits.
    places: Vec<Place>,
    /// The prompts' runs of positions among `places`, which attend as GEMMs.
    runs: Vec<Run>,
    outputs: Vec<usize>,
}

/// A prefill of `windows` (one per sequence of `batch`, of equal length) as a decoder
/// runs it: pieces of at most `chunk` positions of every window, each piece's ids
/// sequence-major, with its length.
pub(crate) fn prefill_chunks(
    windows: &[Vec<u32>],
    batch: usize,
    chunk: usize,
) -> Result<impl Iterator<Item = (Vec<u32>, usize)> + '_> {
    anyhow::ensure!(chunk > 0, "chunks of at least one position");
    anyhow::ensure!(windows.len() == batch, "one window per sequence");
    let t = windows[0].len();
    anyhow::ensure!(
        windows.iter().all(|w| w.len() == t),
        "windows of equal length"
    );
    Ok((0..t).step_by(chunk).map(move |start| {
        let len = chunk.min(t - start);
        let ids = windows
            .iter()
            .flat_map(|w| w[start..start + len].iter().copied())
            .collect();
        (ids, len)
    }))
}

/// Work space for `chunk` positions of every sequence.
struct Scratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    stats: NormStats,
    qkv: Vec<f32>,
    att: Vec<f32>,
    /// Attention outputs of the prompts' runs, head-major (`prompt_attention`).
    by_head: Vec<f32>,
    proj: Vec<f32>,
    fc: Vec<f32>,
    act: Vec<f32>,
    /// (head, position) scores of one row's attention; with room for the parts of a
    /// long one's split ([`attend_split`]).
    scores: Vec<f32>,
    /// The final norm's output at each row that gives logits.
    last: Vec<f32>,
    logits: Vec<f32>,
    /// Rows a pass can hold.
    rows: usize,
}

impl FastDecoder {
    /// The model `spec` with weights `values` (flat, table order), for `batch`
    /// sequences decoded together.
    pub fn new(spec: &ModelSpec, values: &[f32], batch: usize) -> Result<Self> {
        Self::with_format(spec, values, batch, WeightFormat::F32)
    }

    /// [`FastDecoder::new`] with the matrices' weights held as `format` says.
    pub fn with_format(
        spec: &ModelSpec,
        values: &[f32],
        batch: usize,
        format: WeightFormat,
    ) -> Result<Self> {
        let weights = DecodeWeights::from_flat(spec, values, format)?;
        Self::from_weights(Arc::new(weights), batch)
    }

    /// A decoder of `batch` sequences reading `weights` (which other decoders may share),
    /// its keys and values in the precision that goes with them
    /// (`KvPrecision::for_weights`).
    pub fn from_weights(weights: Arc<DecodeWeights>, batch: usize) -> Result<Self> {
        let precision = KvPrecision::for_weights(weights.format);
        Self::with_kv(weights, batch, precision)
    }

    /// [`FastDecoder::from_weights`] with keys and values held in `precision`.
    pub fn with_kv(
        weights: Arc<DecodeWeights>,
        batch: usize,
        precision: KvPrecision,
    ) -> Result<Self> {
        let positions = weights.spec.shapes.block_size;
        Self::with_positions(weights, batch, precision, positions)
    }

    /// [`FastDecoder::with_kv`] holding `positions` (at most the model's context) per
    /// sequence: what scoring windows shorter than the context needs.
    pub fn with_positions(
        weights: Arc<DecodeWeights>,
        batch: usize,
        precision: KvPrecision,
        positions: usize,
    ) -> Result<Self> {
        let model = weights.spec.shapes.block_size;
        anyhow::ensure!(
            (1..=model).contains(&positions),
            "a decoder holds 1 to {model} positions, not {positions}"
        );
        let s = Shapes {
            block_size: positions,
            ..weights.spec.shapes
        };
        let kv_bytes = KvCache::full_bytes(&s, batch, precision);
        if let Some(available) = crate::util::available_memory_bytes() {
            if kv_bytes > available {
                crate::user_bail!(
                    "{batch} samples of {} positions need {:.1} GiB of keys and values ({}), more than the {:.1} GiB available; decode fewer at once (generate --num-samples, bench --decode-batch, serve --parallel)",
                    s.block_size,
                    kv_bytes / f64::from(1 << 30),
                    precision.name(),
                    available / f64::from(1 << 30)
                );
            }
        }
        // Scratch for at most MAX_ROWS rows: longer prefills run in chunks of positions.
        let chunk = (MAX_ROWS / batch).clamp(1, s.block_size);
        Ok(Self {
            q8_rows: Vec::new(),
            scoring: None,
            batch,
            chunk,
            len: 0,
            cache: KvCache::new(&s, batch, precision),
            scratch: Scratch::new(&s, batch, batch * chunk),
            places: Vec::with_capacity(batch * chunk),
            runs: Vec::with_capacity(batch),
            outputs: Vec::with_capacity(batch),
            shapes: s,
            weights,
        })
    }

    pub fn weights(&self) -> &Arc<DecodeWeights> {
        &self.weights
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.weights.spec
    }

    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Rows one [`FastDecoder::run_rows`] pass can take.
    pub fn rows_per_pass(&self) -> usize {
        self.scratch.rows
    }

    /// Rows one [`FastDecoder::run_rows`] pass can give logits of: a sequence each, and
    /// more for a prompt whose every position is scored (a server's `echo` with
    /// `logprobs`), up to [`OUTPUT_ROWS`] (the logits' buffer grows when first needed).
    pub fn outputs_per_pass(&self) -> usize {
        self.batch.max(OUTPUT_ROWS).min(self.scratch.rows)
    }

    /// Positions held in the K/V buffers.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Starts over: runs `windows` (one per sequence, equal lengths) from position 0.
    /// Returns the last position's logits, (batch, V).
    pub fn prefill(&mut self, windows: &[Vec<u32>]) -> Result<&[f32]> {
        // On a pool thread with the others awake: the many small parallel passes fork
        // and join inside it.
        on_workers_awake(|| self.prefill_on_worker(windows).map(|_| ()))?;
        Ok(&self.scratch.logits[..self.batch * self.shapes.vocab_size])
    }

    fn prefill_on_worker(&mut self, windows: &[Vec<u32>]) -> Result<&[f32]> {
        // Chunks that fit the scratch buffers; each appends to the K/V buffers.
        let chunks = prefill_chunks(windows, self.batch, self.chunk)?;
        self.len = 0;
        for (ids, len) in chunks {
            self.forward(&ids, len)?;
        }
        Ok(&self.scratch.logits[..self.batch * self.shapes.vocab_size])
    }

    /// Runs `window` (one sequence: the decoder's batch is 1) from position 0 and
    /// returns the loss of each next-token prediction in it: entry k is
    /// -ln p(window[k + 1] | window[..=k]), from the logits the decoder computes (in its
    /// weight format), by the training classifier's arithmetic (`loss::row_loss`: f32
    /// exponentials, their sum and its logarithm in f64). For measuring what a format
    /// costs.
    pub fn next_token_losses(&mut self, window: &[u32]) -> Result<Vec<f64>> {
        assert_eq!(self.batch, 1, "one sequence");
        let mut losses = Vec::with_capacity(window.len().saturating_sub(1));
        on_workers_awake(|| self.losses_on_worker(window, &mut losses))?;
        Ok(losses)
    }

    fn losses_on_worker(&mut self, window: &[u32], losses: &mut Vec<f64>) -> Result<()> {
        let s = self.shapes;
        let (c, v, t) = (s.n_embd, s.vocab_size, window.len());
        // Kept between windows (scoring a text calls this once a window); taken out
        // while `forward` borrows the decoder.
        let (mut normed, mut logits, mut stats) = self.scoring.take().unwrap_or_else(|| {
            (
                vec![0f32; GROUP * c],
                vec![0f32; GROUP * v],
                NormStats::new(GROUP),
            )
        });
        self.len = 0;
        for start in (0..t).step_by(self.chunk) {
            let len = self.chunk.min(t - start);
            self.forward(&window[start..start + len], len)?;
            // The chunk's final residual stream is still in the scratch rows.
            let weights = &*self.weights;
            let ln_f = weights.norm(&weights.ln_f);
            for g in (0..len).step_by(GROUP) {
                let n = GROUP.min(len - g);
                let rows = &self.scratch.x[g * c..(g + n) * c];
                ln_f.forward(&mut normed[..n * c], &mut stats, rows);
                let logits = &mut logits[..n * v];
                weights
                    .tokens
                    .project(&normed[..n * c], logits, &mut self.q8_rows);
                for (r, row) in logits.chunks_exact(v).enumerate() {
                    let position = start + g + r;
                    if let Some(&target) = window.get(position + 1) {
                        losses.push(row_loss(row, target as usize));
                    }
                }
            }
        }
        self.scoring = Some((normed, logits, stats));
        Ok(())
    }

    /// Feeds one token per sequence at the next position; returns logits, (batch, V).
    pub fn step(&mut self, ids: &[u32]) -> Result<&[f32]> {
        // Models that split products over the threads run with the team awake (one
        // sequence: every split is ours) or on a pool thread with the others awake
        // (several: the rows' passes fork and join inside the pool, some through the
        // gemm crate); the others run here, on one thread.
        if self.weights.splits_products && self.batch == 1 {
            team::pass(|| self.forward(ids, 1).map(|_| ()))?;
        } else if self.weights.splits_products {
            on_workers_awake(|| self.forward(ids, 1).map(|_| ()))?;
        } else {
            self.forward(ids, 1)?;
        }
        Ok(&self.scratch.logits[..self.batch * self.shapes.vocab_size])
    }

    /// Runs rows of any sequences at their own positions in one pass (a server's batch:
    /// some sequences taking their next token, others a piece of their prompt), storing
    /// each row's keys and values at its place. A sequence's rows come in order of
    /// position, and the positions before a sequence's first row here are already in
    /// its buffers (from earlier passes): each row attends over positions 0 ..= its own.
    /// Returns the logits of the rows `outputs` names, (outputs.len(), V). The
    /// equal-length [`FastDecoder::prefill`] / [`FastDecoder::step`] API keeps its own
    /// count of positions; this one leaves the positions to the caller.
    pub fn run_rows(&mut self, ids: &[u32], places: &[Place], outputs: &[usize]) -> Result<&[f32]> {
        let s = self.shapes;
        let rows = ids.len();
        if rows != places.len() || rows == 0 || rows > self.scratch.rows {
            anyhow::bail!(
                "{rows} rows for {} places: a pass runs 1 to {} rows",
                places.len(),
                self.scratch.rows
            );
        }
        if let Some(p) = places
            .iter()
            .find(|p| p.seq >= self.batch || p.pos >= s.block_size)
        {
            anyhow::bail!(
                "row at sequence {} position {} is outside the {} sequences of {} positions",
                p.seq,
                p.pos,
                self.batch,
                s.block_size
            );
        }
        if outputs.len() > self.outputs_per_pass() || outputs.iter().any(|&r| r >= rows) {
            anyhow::bail!(
                "logits are asked of rows {outputs:?} of a {rows}-row pass (at most {} rows)",
                self.outputs_per_pass()
            );
        }
        let (c, v) = (s.n_embd, s.vocab_size);
        if self.scratch.logits.len() < outputs.len() * v {
            self.scratch.last.resize(outputs.len() * c, 0.0);
            self.scratch.logits.resize(outputs.len() * v, 0.0);
        }
        self.places.clear();
        self.places.extend_from_slice(places);
        self.outputs.clear();
        self.outputs.extend_from_slice(outputs);
        if rows > 1 {
            on_workers_awake(|| self.forward_places(ids).map(|_| ()))?;
        } else if self.weights.splits_products {
            team::pass(|| self.forward_places(ids).map(|_| ()))?;
        } else {
            self.forward_places(ids)?;
        }
        Ok(&self.scratch.logits[..outputs.len() * s.vocab_size])
    }

    /// Runs `t` new tokens per sequence (`ids` is (batch, t) row-major) at positions
    /// len .. len + t, appending their keys and values.
    fn forward(&mut self, ids: &[u32], t: usize) -> Result<&[f32]> {
        assert_eq!(ids.len(), self.batch * t);
        assert!(t <= self.chunk, "prefill chunks fit the scratch buffers");
        let block_size = self.shapes.block_size;
        let pos0 = self.len;
        if t == 0 || pos0 + t > block_size {
            anyhow::bail!(
                "{} positions do not fit the K/V buffers of {block_size}: slide the window",
                pos0 + t,
            );
        }
        let at = Positions { t, first: pos0 };
        self.places.clear();
        self.places.extend((0..ids.len()).map(|r| Place {
            seq: r / t,
            pos: at.of(r),
        }));
        // Only each sequence's last position needs logits.
        self.outputs.clear();
        self.outputs.extend((0..self.batch).map(|b| b * t + t - 1));
        self.forward_places(ids)?;
        self.len += t;
        Ok(&self.scratch.logits[..self.batch * self.shapes.vocab_size])
    }

    /// One pass over the rows `self.places` describes; logits for `self.outputs`.
    fn forward_places(&mut self, ids: &[u32]) -> Result<()> {
        let weights = &*self.weights;
        let s = self.shapes;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= s.vocab_size) {
            anyhow::bail!(
                "token id {id} is outside the vocabulary of {}",
                s.vocab_size
            );
        }
        let (rows, c) = (ids.len(), s.n_embd);
        let places = &self.places;
        find_runs(places, &mut self.runs);
        let runs = &self.runs;
        let sc = &mut self.scratch;
        let q8_rows = &mut self.q8_rows;
        weights.embed(&mut sc.x[..rows * c], ids, |r| places[r].pos);

        for (l, w) in weights.layers.iter().enumerate() {
            // Attention: q, k, v for every row; positions turned in; keys and values
            // stored; each row attends over its sequence's cache.
            let (x, xn) = (&mut sc.x[..rows * c], &mut sc.xn[..rows * c]);
            weights.norm(&w.ln_1).forward(xn, &mut sc.stats, x);
            let qkv = &mut sc.qkv[..rows * s.qkv_width];
            w.attn_qkv.project(xn, qkv, q8_rows);
            if let Some(rope) = &weights.rope {
                rope.rotate_rows(qkv, &s, |r| places[r].pos, Turn::Forward);
            }
            self.cache.store(l, qkv, &s, places);
            let cache = self.cache.layer(l);
            let att = &mut sc.att[..rows * c];
            if rows == 1 {
                let at = (places[0].seq, places[0].pos);
                attend_split(&s, &qkv[..c], cache, at, att, &mut sc.scores);
            } else {
                // A prompt's runs of positions as GEMMs, the other rows one by one.
                attend_runs(&s, qkv, cache, runs, att, &mut sc.by_head[..rows * c]);
                let in_run = |r: usize| runs.iter().any(|run| run.rows.contains(&r));
                att.par_chunks_mut(c)
                    .enumerate()
                    .filter(|(r, _)| !in_run(*r))
                    .for_each_init(
                        || vec![0f32; s.n_head * s.block_size],
                        |scores, (r, out)| {
                            let q = &qkv[r * s.qkv_width..r * s.qkv_width + c];
                            let at = (places[r].seq, places[r].pos);
                            attend(&s, q, cache, at, out, scores)
                        },
                    );
            }
            let proj = &mut sc.proj[..rows * c];
            w.attn_proj.project(att, proj, q8_rows);
            residual_in_place(x, proj);

            // MLP.
            weights.norm(&w.ln_2).forward(xn, &mut sc.stats, x);
            let fc = &mut sc.fc[..rows * s.mlp_fc_width];
            w.mlp_fc.project(xn, fc, q8_rows);
            let act = &mut sc.act[..rows * s.mlp_hidden];
            weights.activation.forward(act, fc);
            w.mlp_proj.project(act, proj, q8_rows);
            residual_in_place(x, proj);
        }

        // Only the rows asked for need logits.
        let ln_f = weights.norm(&weights.ln_f);
        let n = self.outputs.len();
        for (i, &r) in self.outputs.iter().enumerate() {
            let last = &mut sc.last[i * c..(i + 1) * c];
            ln_f.forward(last, &mut sc.stats, &sc.x[r * c..(r + 1) * c]);
        }
        weights
            .tokens
            .project(&sc.last[..n * c], &mut sc.logits, q8_rows);
        Ok(())
    }
}

impl Scratch {
    fn new(s: &Shapes, batch: usize, rows: usize) -> Self {
        let c = s.n_embd;
        Self {
            x: vec![0.0; rows * c],
            xn: vec![0.0; rows * c],
            stats: NormStats::new(rows),
            qkv: vec![0.0; rows * s.qkv_width],
            att: vec![0.0; rows * c],
            by_head: vec![0.0; rows * c],
            proj: vec![0.0; rows * c],
            fc: vec![0.0; rows * s.mlp_fc_width],
            act: vec![0.0; rows * s.mlp_hidden],
            scores: vec![0.0; split_scratch_len(s)],
            last: vec![0.0; batch * c],
            logits: vec![0.0; batch * s.vocab_size],
            rows,
        }
    }
}

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

/// The scratch [`attend_split`] needs: a row's scores and its parts' outputs and
/// statistics.
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
    /// scores[h * seen + p] = (q_h · the key row's head for h) x scale for every query
    /// head h, at `level` (AVX2 or AVX-512): `dot_lanes`'s operations in its order, so
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
            (scores, seen, p, scale): (&mut [f32], usize, usize, f32),
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
                scores[h * seen + p] = sum * scale;
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

/// Positions whose logits `next_token_losses` holds at once (a few MiB for a large
/// vocabulary).
const GROUP: usize = 16;

/// Rows of logits a pass may give beyond one per sequence (for a prompt scored at every
/// position): 128 rows of GPT-2's vocabulary are 26 MB.
pub const OUTPUT_ROWS: usize = 128;

/// Rows (sequences x positions) of scratch a decoder allocates: bounds memory for long
/// contexts and many samples; a longer prefill runs in chunks. 1,024 rows held a
/// 512-token prompt's activations at once: GPT-2 124M's peak RSS 17-34 MiB higher (int4
/// 134 MiB against 116 at 256, bf16 317 against 283; Zen 4). Its first token is no
/// sooner for int8 and int4 (their products read the weights once per L2-sized chunk of
/// rows anyway); f32 and bf16 pieces of 256 rows take the few-row products
/// (`weight_rows`, up to 256 rows) instead of a GEMM: f32 536 ms against 564, bf16
/// 675 against 574.
const MAX_ROWS: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

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

    /// A decoder holding fewer positions than the model's context (`eval --context`)
    /// scores a window as one holding them all does, and refuses a longer one.
    #[test]
    fn fewer_positions_score_the_same() {
        let spec = ModelSpec::new(&ModelConfig {
            n_layer: 2,
            n_head: 4,
            n_kv_head: Some(2),
            n_embd: 32,
            block_size: 512,
            vocab_size: 50,
            ..ModelConfig::default()
        });
        let values = spec.initial_values(3);
        let weights =
            Arc::new(DecodeWeights::from_flat(&spec, &values, WeightFormat::F32).unwrap());
        let window: Vec<u32> = (0..40).map(|i| (i * 7 % 50) as u32).collect();
        let mut full = FastDecoder::from_weights(weights.clone(), 1).unwrap();
        let mut short =
            FastDecoder::with_positions(weights.clone(), 1, KvPrecision::F32, 40).unwrap();
        let want = full.next_token_losses(&window).unwrap();
        let got = short.next_token_losses(&window).unwrap();
        assert_eq!(got.len(), 39);
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-6 * w.abs(), "position {k}: {g} vs {w}");
        }
        let mut longer = window.clone();
        longer.push(3);
        assert!(short.next_token_losses(&longer).is_err());
        for bad in [0, 513] {
            assert!(
                FastDecoder::with_positions(weights.clone(), 1, KvPrecision::F32, bad).is_err()
            );
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
