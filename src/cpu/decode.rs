//! Decoding on the CPU without a tensor library in the loop.
//!
//! The reference model decodes through ~100 small candle ops per token, each allocating
//! its output. Here one token costs, per layer, the training engine's own layer ops
//! (norms, RoPE, the MLP's non-linearity, residual adds) on one row per sequence, plus
//! what only decoding has: mat-vecs laid out for one row at a time, and attention over
//! preallocated per-layer K/V buffers (grouped K/V heads stored once). Nothing is
//! allocated per token. Several sequences (samples) step together, so each weight row
//! is read once for all of them.
//!
//! The prompt (and every window slide) runs through the same code with many rows at
//! once: the projections become GEMMs and attention rows are spread over threads.
//!
//! With `WeightFormat::Int8` the matrices are also held in eight bits (`cpu::q8`: blocks
//! of 32 values and a scale) and every projection, a token's or a prompt's, reads those:
//! a quarter of the bytes per weight.

use anyhow::Result;
use rayon::prelude::*;

use super::gemm::{matmul, Precision};
use super::kernels::{axpy, dot_lanes, matvec, multiversion, softmax_inline};
use super::layout::Weights;
use super::matrix::{Product, Strided};
use super::ops::activation::Activation;
use super::ops::linear::LinearWeights;
use super::ops::norm::NormStats;
use super::ops::rope::{Rope, Turn};
use super::ops::{residual_in_place, Positions};
use super::q8::{Q8Matrix, Q8Row};
use super::threads::{on_workers, threads};
use crate::config::PositionKind;
use crate::model::position::sinusoidal_table;
use crate::model::spec::{ModelSpec, Shapes};

/// How the decoder holds the weights of its matrix products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    F32,
    /// Eight bits per weight in blocks of 32 with an f32 scale (llama.cpp's q8_0); the
    /// activations of each product quantized the same way.
    Int8,
}

/// Every projection's weights in eight bits, per layer in `BlockParams::linears` order,
/// and the tied output layer's.
struct Quantized {
    blocks: Vec<[Q8Matrix; 4]>,
    head: Q8Matrix,
}

/// A model's weights laid out for decoding, and the K/V buffers of `batch` sequences.
pub struct FastDecoder {
    spec: ModelSpec,
    /// The weights, flat in the spec's table order.
    params: Vec<f32>,
    /// Transposed copies (in, out) of the projections with narrow inputs, per layer in
    /// `BlockParams::linears` order: their mat-vecs then run along contiguous output
    /// rows (y += x_i Wᵀ[i, :]) with no horizontal sums. Wide ones use the rows as
    /// stored.
    transposed: Vec<[Option<Vec<f32>>; 4]>,
    /// The same for the tied output layer.
    head_transposed: Option<Vec<f32>>,
    sinusoids: Option<Vec<f32>>,
    rope: Option<Rope>,
    activation: Activation,
    /// Some layer's mat-vecs are split over the threads (see `splits_matvec`).
    splits_matvecs: bool,
    /// The matrices in eight bits (`WeightFormat::Int8`).
    quantized: Option<Quantized>,
    /// Activation rows quantized for the eight-bit products.
    q8_rows: Vec<Q8Row>,

    batch: usize,
    /// Positions per forward call that the scratch buffers hold (a prefill may need
    /// several calls).
    chunk: usize,
    len: usize,
    keys: Vec<Vec<f32>>,   // per layer: (batch, block, H_kv * d)
    values: Vec<Vec<f32>>, // per layer: (batch, block, H_kv * d)
    scratch: Scratch,
}

/// Work space for `chunk` positions of every sequence.
struct Scratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    stats: NormStats,
    qkv: Vec<f32>,
    att: Vec<f32>,
    proj: Vec<f32>,
    fc: Vec<f32>,
    act: Vec<f32>,
    scores: Vec<f32>,
    /// The final norm's output at each sequence's last position.
    last: Vec<f32>,
    logits: Vec<f32>,
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
        assert_eq!(values.len(), spec.len(), "a flat buffer of the whole table");
        let cfg = &spec.config;
        let s = &spec.shapes;
        let weights = Weights::new(spec, values);
        let quantized = (format == WeightFormat::Int8).then(|| {
            let quantize = |l: &LinearWeights| Q8Matrix::quantize(l.w, l.d_out, l.d_in);
            Quantized {
                blocks: (0..s.n_layer)
                    .map(|l| {
                        spec.blocks[l]
                            .linears()
                            .map(|p| quantize(&weights.linear(&p)))
                    })
                    .collect(),
                head: quantize(&weights.output()),
            }
        });
        // Eight-bit products read their own copy: no transposed f32 one.
        let transposed = (0..s.n_layer)
            .map(|l| {
                spec.blocks[l].linears().map(|p| {
                    quantized
                        .is_none()
                        .then(|| transpose_if_narrow(&weights.linear(&p)))
                        .flatten()
                })
            })
            .collect::<Vec<_>>();
        let splits_matvecs = spec
            .blocks
            .iter()
            .any(|b| b.linears().iter().any(|p| splits_matvec(p.d_in * p.d_out)));
        let sinusoids = match cfg.positions {
            PositionKind::Sinusoidal => {
                let table = sinusoidal_table(s.block_size, s.n_embd, &candle_core::Device::Cpu)?;
                Some(table.flatten_all()?.to_vec1()?)
            }
            _ => None,
        };
        let kv_bytes = 2.0 * 4.0 * (s.n_layer * batch * s.block_size * s.kv_width) as f64;
        if let Some(available) = crate::util::available_memory_bytes() {
            if kv_bytes > available {
                crate::user_bail!(
                    "{batch} samples of {} positions need {:.1} GiB of keys and values, more than the {:.1} GiB available; use fewer --num-samples",
                    s.block_size,
                    kv_bytes / f64::from(1 << 30),
                    available / f64::from(1 << 30)
                );
            }
        }
        // Scratch for at most MAX_ROWS rows: longer prefills run in chunks of positions.
        let chunk = (MAX_ROWS / batch).clamp(1, s.block_size);
        let cache = || vec![0f32; batch * s.block_size * s.kv_width];
        Ok(Self {
            transposed,
            head_transposed: quantized
                .is_none()
                .then(|| transpose_if_narrow(&weights.output()))
                .flatten(),
            quantized,
            q8_rows: Vec::new(),
            sinusoids,
            rope: (cfg.positions == PositionKind::Rope).then(|| Rope::new(cfg)),
            activation: Activation::new(cfg.mlp, s),
            splits_matvecs,
            batch,
            chunk,
            len: 0,
            keys: (0..s.n_layer).map(|_| cache()).collect(),
            values: (0..s.n_layer).map(|_| cache()).collect(),
            scratch: Scratch::new(s, batch, batch * chunk),
            params: values.to_vec(),
            spec: spec.clone(),
        })
    }

    pub fn batch(&self) -> usize {
        self.batch
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
        // On a pool thread: the many small parallel passes fork and join inside it.
        on_workers(|| self.prefill_on_worker(windows).map(|_| ()))?;
        Ok(&self.scratch.logits)
    }

    fn prefill_on_worker(&mut self, windows: &[Vec<u32>]) -> Result<&[f32]> {
        assert_eq!(windows.len(), self.batch);
        let t = windows[0].len();
        assert!(windows.iter().all(|w| w.len() == t));
        self.len = 0;
        // Position chunks that fit the scratch buffers; each appends to the K/V buffers.
        let mut start = 0;
        while start < t {
            let len = self.chunk.min(t - start);
            let ids: Vec<u32> = windows
                .iter()
                .flat_map(|w| w[start..start + len].iter().copied())
                .collect();
            self.forward(&ids, len)?;
            start += len;
        }
        Ok(&self.scratch.logits)
    }

    /// Feeds one token per sequence at the next position; returns logits, (batch, V).
    pub fn step(&mut self, ids: &[u32]) -> Result<&[f32]> {
        // Models that split mat-vecs over the threads run on a pool thread, so those
        // hand-offs stay inside it; the others run here, on one thread.
        if self.splits_matvecs {
            on_workers(|| self.forward(ids, 1).map(|_| ()))?;
        } else {
            self.forward(ids, 1)?;
        }
        Ok(&self.scratch.logits)
    }

    /// Runs `t` new tokens per sequence (`ids` is (batch, t) row-major) at positions
    /// len .. len + t, appending their keys and values.
    fn forward(&mut self, ids: &[u32], t: usize) -> Result<&[f32]> {
        assert_eq!(ids.len(), self.batch * t);
        assert!(t <= self.chunk, "prefill chunks fit the scratch buffers");
        let s = self.spec.shapes;
        let pos0 = self.len;
        if t == 0 || pos0 + t > s.block_size {
            anyhow::bail!(
                "{} positions do not fit the K/V buffers of {}: slide the window",
                pos0 + t,
                s.block_size
            );
        }
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= s.vocab_size) {
            anyhow::bail!(
                "token id {id} is outside the vocabulary of {}",
                s.vocab_size
            );
        }
        let (rows, c) = (self.batch * t, s.n_embd);
        let at = Positions { t, first: pos0 };
        let weights = Weights::new(&self.spec, &self.params);
        let sc = &mut self.scratch;
        let (quantized, q8_rows) = (self.quantized.as_ref(), &mut self.q8_rows);
        let x = &mut sc.x[..rows * c];
        weights
            .embedding(self.sinusoids.as_deref())
            .forward(x, ids, at);

        for (l, transposed) in self.transposed.iter().enumerate() {
            let w = weights.block(l);
            let [qkv_t, attn_proj_t, fc_t, mlp_proj_t] =
                transposed.each_ref().map(Option::as_deref);
            let [qkv_8, attn_proj_8, fc_8, mlp_proj_8] = match quantized {
                Some(q) => q.blocks[l].each_ref().map(Some),
                None => [None; 4],
            };
            // Attention: q, k, v for every row; positions turned in; keys and values
            // stored; each row attends over its sequence's cache.
            let (x, xn) = (&mut sc.x[..rows * c], &mut sc.xn[..rows * c]);
            w.ln_1.forward(xn, &mut sc.stats, x);
            let qkv = &mut sc.qkv[..rows * s.qkv_width];
            project(&w.attn_qkv, (qkv_t, qkv_8, q8_rows), xn, qkv);
            if let Some(rope) = &self.rope {
                rope.rotate(qkv, &s, at, Turn::Forward);
            }
            let (keys, values) = (&mut self.keys[l], &mut self.values[l]);
            store_keys_and_values((keys, values), qkv, &s, at);
            let cache = (keys.as_slice(), values.as_slice());
            let att = &mut sc.att[..rows * c];
            if rows == 1 {
                attend(&s, &qkv[..c], cache, (0, pos0), att, &mut sc.scores);
            } else {
                att.par_chunks_mut(c).enumerate().for_each_init(
                    || vec![0f32; s.block_size],
                    |scores, (r, out)| {
                        let q = &qkv[r * s.qkv_width..r * s.qkv_width + c];
                        attend(&s, q, cache, (r / t, at.of(r)), out, scores)
                    },
                );
            }
            let proj = &mut sc.proj[..rows * c];
            project(&w.attn_proj, (attn_proj_t, attn_proj_8, q8_rows), att, proj);
            residual_in_place(x, proj);

            // MLP.
            w.ln_2.forward(xn, &mut sc.stats, x);
            let fc = &mut sc.fc[..rows * s.mlp_fc_width];
            project(&w.mlp_fc, (fc_t, fc_8, q8_rows), xn, fc);
            let act = &mut sc.act[..rows * s.mlp_hidden];
            self.activation.forward(act, fc);
            project(&w.mlp_proj, (mlp_proj_t, mlp_proj_8, q8_rows), act, proj);
            residual_in_place(x, proj);
        }

        // Only each sequence's last position needs logits.
        let ln_f = weights.norm(&self.spec.ln_f);
        for b in 0..self.batch {
            let r = b * t + t - 1;
            let last = &mut sc.last[b * c..(b + 1) * c];
            ln_f.forward(last, &mut sc.stats, &sc.x[r * c..(r + 1) * c]);
        }
        let head = weights.output();
        let head_8 = quantized.map(|q| &q.head);
        let how = (self.head_transposed.as_deref(), head_8, q8_rows);
        project(&head, how, &sc.last, &mut sc.logits);
        self.len += t;
        Ok(&self.scratch.logits)
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
            proj: vec![0.0; rows * c],
            fc: vec![0.0; rows * s.mlp_fc_width],
            act: vec![0.0; rows * s.mlp_hidden],
            scores: vec![0.0; s.block_size],
            last: vec![0.0; batch * c],
            logits: vec![0.0; batch * s.vocab_size],
        }
    }
}

/// Copies each row's key and value heads (rows are sequences of `at.t` positions) into
/// its sequence's slot of `keys` and `values` (batch, block, kv width) at its position.
fn store_keys_and_values(cache: (&mut [f32], &mut [f32]), qkv: &[f32], s: &Shapes, at: Positions) {
    let (c, kv) = (s.n_embd, s.kv_width);
    for (r, row) in qkv.chunks_exact(s.qkv_width).enumerate() {
        let slot = ((r / at.t) * s.block_size + at.of(r)) * kv;
        cache.0[slot..slot + kv].copy_from_slice(&row[c..c + kv]);
        cache.1[slot..slot + kv].copy_from_slice(&row[c + kv..]);
    }
}

multiversion! {
    /// One position's attention output, all heads: `q` holds its query heads; it sees
    /// the keys and values (`cache`) of sequence `at.0` up to position `at.1`.
    pub fn attend(s: &Shapes, q: &[f32], cache: (&[f32], &[f32]), at: (usize, usize), out: &mut [f32], scores: &mut [f32]) {
        let (b, pos) = at;
        let (d, kv_width) = (s.head_dim, s.kv_width);
        let scale = 1.0 / (d as f32).sqrt();
        let keys = &cache.0[b * s.block_size * kv_width..];
        let values = &cache.1[b * s.block_size * kv_width..];
        out.fill(0.0);
        for head in 0..s.n_head {
            let g = head / s.group(); // the K/V head this query head shares
            let q = &q[head * d..(head + 1) * d];
            let scores = &mut scores[..=pos];
            for (p, score) in scores.iter_mut().enumerate() {
                *score = dot_lanes(q, &keys[p * kv_width + g * d..p * kv_width + (g + 1) * d]) * scale;
            }
            softmax_inline(scores);
            let out = &mut out[head * d..(head + 1) * d];
            for (p, &weight) in scores.iter().enumerate() {
                axpy(out, weight, &values[p * kv_width + g * d..p * kv_width + (g + 1) * d]);
            }
        }
    }
}

/// A transposed copy (in, out) of `layer`'s weight when its input is narrow enough for
/// mat-vecs along output rows to pay.
fn transpose_if_narrow(layer: &LinearWeights) -> Option<Vec<f32>> {
    let (d_in, d_out) = (layer.d_in, layer.d_out);
    (d_in < DOT_MATVEC_MIN_INPUT).then(|| {
        let mut wt = vec![0f32; d_in * d_out];
        for o in 0..d_out {
            for i in 0..d_in {
                wt[i * d_out + o] = layer.w[o * d_in + i];
            }
        }
        wt
    })
}

/// How a projection reads its weights: along W's transposed (in, out) copy where there
/// is one, from the eight-bit copy where there is one (with room for the quantized rows
/// of x), else from W as stored.
type Reading<'a> = (Option<&'a [f32]>, Option<&'a Q8Matrix>, &'a mut Vec<Q8Row>);

/// out = x Wᵀ + bias for the rows of x: from eight bits when the layer has them,
/// otherwise mat-vecs for a few rows (along the transposed copy, when there is one) and
/// a GEMM for many.
fn project(layer: &LinearWeights, how: Reading, x: &[f32], out: &mut [f32]) {
    let (transposed, quantized, q8_rows) = how;
    if let Some(q) = quantized {
        return project_q8(q, layer.b, x, out, q8_rows);
    }
    let (d_in, d_out) = (layer.d_in, layer.d_out);
    let rows = x.len() / d_in;
    if rows > 4 {
        let w = match transposed {
            Some(wt) => Strided::rows(wt, d_out),
            None => Strided::columns(layer.w, d_in),
        };
        let p = Product::new(Strided::rows(x, d_in), w, (rows, d_out, d_in));
        matmul(out, d_out, p, Precision::F32);
        if let Some(bias) = layer.b {
            for row in out[..rows * d_out].chunks_exact_mut(d_out) {
                axpy(row, 1.0, bias);
            }
        }
        return;
    }
    // Large weights: each thread takes a share of the outputs (the weights are read
    // from memory once per token; two cores read them faster than one).
    let share = if splits_matvec(d_out * d_in) {
        d_out.div_ceil(threads())
    } else {
        d_out
    };
    for (x, out) in x.chunks_exact(d_in).zip(out.chunks_exact_mut(d_out)) {
        out.par_chunks_mut(share).enumerate().for_each(|(i, out)| {
            let first = i * share;
            let bias = layer.b.map(|b| &b[first..first + out.len()]);
            match transposed {
                Some(wt) => matvec_t(wt, d_out, first, bias, x, out),
                None => matvec(
                    &layer.w[first * d_in..(first + out.len()) * d_in],
                    bias,
                    x,
                    out,
                ),
            }
        });
    }
}

/// out = x Wᵀ + bias from W in eight bits, for every row of x (each quantized once). The
/// outputs are shared out over the threads and each thread takes every row, so a
/// weight is read from memory once per call, whatever the number of rows.
fn project_q8(
    w: &Q8Matrix,
    bias: Option<&[f32]>,
    x: &[f32],
    out: &mut [f32],
    rows: &mut Vec<Q8Row>,
) {
    let (d_in, d_out) = (w.cols(), w.rows());
    let n = x.len() / d_in;
    if rows.len() < n {
        rows.resize_with(n, Q8Row::default);
    }
    for (row, x) in rows.iter_mut().zip(x.chunks_exact(d_in)) {
        w.quantize_row(x, row);
    }
    let rows = &rows[..n];
    if n == 1 {
        let share = if splits_matvec(d_out * d_in) {
            d_out.div_ceil(threads())
        } else {
            d_out
        };
        out[..d_out]
            .par_chunks_mut(share)
            .enumerate()
            .for_each(|(i, out)| {
                let first = i * share;
                let bias = bias.map(|b| &b[first..first + out.len()]);
                w.matvec(first, &rows[0], bias, out);
            });
        return;
    }
    // Several rows: each share of the outputs for every row, into its own buffer (the
    // rows' outputs for a share are not contiguous in `out`), then put in place.
    let share = d_out.div_ceil(threads()).max(1);
    let parts: Vec<(usize, Vec<f32>)> = (0..d_out.div_ceil(share))
        .into_par_iter()
        .map(|i| {
            let (first, len) = (i * share, share.min(d_out - i * share));
            let bias = bias.map(|b| &b[first..first + len]);
            let mut part = vec![0f32; n * len];
            w.matmat(first, len, rows, bias, &mut part);
            (first, part)
        })
        .collect();
    for (first, part) in parts {
        let len = part.len() / n;
        for (r, values) in part.chunks_exact(len).enumerate() {
            out[r * d_out + first..r * d_out + first + len].copy_from_slice(values);
        }
    }
}

multiversion! {
    /// out = x · Wᵀ (+ b) with Wᵀ stored (in, stride): a sum of scaled rows, for the
    /// output columns first .. first + out.len().
    pub fn matvec_t(wt: &[f32], stride: usize, first: usize, bias: Option<&[f32]>, x: &[f32], out: &mut [f32]) {
        let d_out = out.len();
        match bias {
            Some(b) => out.copy_from_slice(b),
            None => out.fill(0.0),
        }
        for (i, &xi) in x.iter().enumerate() {
            axpy(out, xi, &wt[i * stride + first..i * stride + first + d_out]);
        }
    }
}

/// Rows (sequences x positions) of scratch a decoder allocates: bounds memory for long
/// contexts and many samples; a longer prefill runs in chunks.
const MAX_ROWS: usize = 1024;

/// Whether a mat-vec over `weights` values is split over the threads: from 128 Ki on;
/// smaller ones (the baby model's) stay on one, where the hand-off costs more than it
/// saves.
fn splits_matvec(weights: usize) -> bool {
    weights >= 1 << 17
}

/// Inputs at least this wide use dot products over weight rows for a mat-vec (long
/// rows amortise the horizontal sum); narrower ones sum scaled rows of Wᵀ.
const DOT_MATVEC_MIN_INPUT: usize = 256;
