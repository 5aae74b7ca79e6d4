//! Decoding on the CPU without a tensor library in the loop.
//!
//! The reference model decodes through ~100 small candle ops per token, each allocating
//! its output. Here one token costs, per layer, the training engine's own layer ops
//! (norms, RoPE, the MLP's non-linearity, residual adds) on one row per sequence, plus
//! what only decoding has: products that read each weight once for all the rows
//! (`DecodeWeights`, in f32, bf16, int8 or int4), and attention over preallocated
//! per-layer K/V buffers (grouped K/V heads stored once). Nothing is allocated per
//! token of one stream. Several sequences (samples) step together, so each weight row
//! is read once for all of them.
//!
//! The prompt (and every window slide) runs through the same code with many rows at
//! once (at most `MAX_ROWS` a pass): each weight is still read once for all of a pass's
//! rows, attention rows are spread over threads, and a prompt's runs of 16 or more
//! positions attend as GEMMs (`prompt_attention`).

use std::sync::Arc;

use anyhow::Result;
use rayon::prelude::*;

use super::cached_attention::{attend, attend_split, split_scratch_len};
use super::decode_weights::{DecodeWeights, WeightFormat};
use super::kv_cache::{KvCache, KvPrecision, Place};
use super::ops::loss::row_loss;
use super::ops::norm::NormStats;
use super::ops::rope::Turn;
use super::ops::{residual_in_place, Positions};
use super::prompt_attention::{attend_runs, find_runs, Run};
use super::q8::Q8Row;
use super::team;
use super::threads::on_workers_awake;
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

    /// Rows one [`FastDecoder::run_rows`] pass can give logits of: max(batch,
    /// [`OUTPUT_ROWS`]), at most [`FastDecoder::rows_per_pass`]: a sequence each, and more
    /// for a prompt whose every position is scored (a server's `echo` with `logprobs`;
    /// the logits' buffer grows when first needed).
    pub fn outputs_per_pass(&self) -> usize {
        outputs_per_pass(self.batch, self.scratch.rows)
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
/// (`weight_rows`, up to 256 rows) instead of a GEMM: that first token in pieces of
/// 1,024 rows against 256, f32 536 ms against 564, bf16 675 against 574.
const MAX_ROWS: usize = 256;

/// Rows of logits a pass of `rows` rows for `batch` sequences can give: one per
/// sequence, and up to [`OUTPUT_ROWS`] for a prompt whose every position is scored (the
/// CUDA decoder's too).
pub(crate) fn outputs_per_pass(batch: usize, rows: usize) -> usize {
    batch.max(OUTPUT_ROWS).min(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

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
}
