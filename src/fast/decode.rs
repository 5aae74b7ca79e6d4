//! Single-token decoding on the CPU without a tensor library in the loop.
//!
//! The reference model decodes through ~100 small candle ops per token, each allocating
//! its output. Here one token costs, per layer: LayerNorm, one QKV mat-vec, RoPE in
//! place, attention over preallocated per-layer K/V buffers (grouped K/V heads stored
//! once), the output projection, LayerNorm, the MLP. Weights are copied once into flat
//! row-major buffers; nothing is allocated per token. Several sequences (samples) step
//! together so each weight row is read once for all of them.
//!
//! The prompt (and every window slide) runs through the same code with many rows at
//! once: the projections become GEMMs (`fast::gemm`) and attention rows are spread
//! over threads.

use anyhow::Result;
use candle_core::{DType, Tensor};
use rayon::prelude::*;

use super::gemm::{matmul, threads, Layout, Precision};
use super::kernels::{
    axpy, dot_lanes, exp_approx, gelu_in_place, gelu_tanh_in_place, matvec, multiversion,
    softmax_inline,
};
use super::ops::{layernorm_forward, rmsnorm_forward};
use crate::config::PositionKind;
use crate::config::{MlpKind, NormKind};
use crate::model::position::{rope_tables, sinusoidal_table};
use crate::model::Gpt;

/// How a decode layer keeps its weight: as stored, (out, in), for dot products over long
/// input rows; or transposed, (in, out), for narrow inputs, so a mat-vec runs along
/// contiguous output rows (y += x_i * Wᵀ[i, :]) with no horizontal sums.
enum Weight {
    Rows(Vec<f32>),
    Cols(Vec<f32>),
}

struct Linear {
    w: Weight,
    b: Option<Vec<f32>>,
    d_out: usize,
}

impl Linear {
    /// From a weight stored (out, in).
    fn from_rows(w: &[f32], b: Option<Vec<f32>>, d_out: usize) -> Self {
        let d_in = w.len() / d_out;
        let w = if d_in >= DOT_MATVEC_MIN_INPUT {
            Weight::Rows(w.to_vec())
        } else {
            let mut wt = vec![0f32; w.len()];
            for o in 0..d_out {
                for i in 0..d_in {
                    wt[i * d_out + o] = w[o * d_in + i];
                }
            }
            Weight::Cols(wt)
        };
        Self { w, b, d_out }
    }

    /// Whether a mat-vec with this weight is split over the threads.
    fn splits(&self) -> bool {
        let weights = match &self.w {
            Weight::Rows(w) | Weight::Cols(w) => w.len(),
        };
        splits_matvec(weights)
    }
}

struct Norm {
    kind: NormKind,
    eps: f32,
    w: Vec<f32>,
    b: Option<Vec<f32>>,
}

impl Norm {
    /// The training path's kernels, one row at a time (the statistics are not kept).
    fn row(&self, x: &[f32], out: &mut [f32]) {
        let (mut mean, mut rstd) = ([0f32], [0f32]);
        let (w, b) = (&self.w, self.b.as_deref());
        match self.kind {
            NormKind::LayerNorm => layernorm_forward(out, &mut mean, &mut rstd, x, w, b, self.eps),
            NormKind::RmsNorm => rmsnorm_forward(out, &mut rstd, x, w, self.eps),
        }
    }
}

struct Layer {
    ln_1: Norm,
    c_attn: Linear,
    attn_proj: Linear,
    ln_2: Norm,
    c_fc: Linear,
    mlp_proj: Linear,
}

/// A model's weights laid out for mat-vecs, and the K/V buffers of `batch` sequences.
pub struct FastDecoder {
    n_head: usize,
    n_kv_head: usize,
    head_dim: usize,
    n_embd: usize,
    vocab: usize,
    block: usize,
    wte: Vec<f32>,
    /// The tied output layer: a transposed copy of wte for narrow models; wide ones
    /// use wte's rows directly.
    head: Option<Linear>,
    pos_table: Option<Vec<f32>>, // (block, C): learned or sinusoidal
    rope: Option<(Vec<f32>, Vec<f32>)>,
    layers: Vec<Layer>,
    ln_f: Norm,
    /// Some layer's mat-vecs are split over the threads (see `splits_matvec`).
    splits_matvecs: bool,

    batch: usize,
    /// Positions per forward call that the scratch buffers hold (a prefill may need
    /// several calls).
    chunk: usize,
    len: usize,
    keys: Vec<Vec<f32>>,   // per layer: (batch, block, H_kv * d)
    values: Vec<Vec<f32>>, // per layer: (batch, block, H_kv * d)

    // Scratch, sized for every position of every sequence (a full prefill).
    x: Vec<f32>,
    xn: Vec<f32>,
    qkv: Vec<f32>,
    att: Vec<f32>,
    proj: Vec<f32>,
    hidden: Vec<f32>, // MLP: rows of c_fc outputs
    mlp: MlpKind,
    mlp_hidden: usize,
    scores: Vec<f32>,
    last: Vec<f32>, // final-norm output of each sequence's last position
    logits: Vec<f32>,
}

fn host(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
}

impl FastDecoder {
    /// True when the fast path can run this model (weights on the CPU).
    pub fn supports(model: &Gpt) -> bool {
        model.device().is_cpu()
    }

    pub fn new(model: &Gpt, batch: usize) -> Result<Self> {
        let cfg = model.config();
        let p = model.params();
        let get = |name: &str| -> Result<Vec<f32>> {
            host(
                p.get(name)
                    .ok_or_else(|| anyhow::anyhow!("missing {name}"))?
                    .as_tensor(),
            )
        };
        let opt = |name: &str| -> Result<Option<Vec<f32>>> {
            p.get(name).map(|v| host(v.as_tensor())).transpose()
        };
        let linear = |prefix: &str| -> Result<Linear> {
            let w = get(&format!("{prefix}.weight"))?;
            let d_out = p
                .get(&format!("{prefix}.weight"))
                .expect("just read")
                .dims()[0];
            Ok(Linear::from_rows(
                &w,
                opt(&format!("{prefix}.bias"))?,
                d_out,
            ))
        };
        let norm = |prefix: &str| -> Result<Norm> {
            Ok(Norm {
                kind: cfg.norm,
                eps: cfg.norm_eps as f32,
                w: get(&format!("{prefix}.weight"))?,
                b: opt(&format!("{prefix}.bias"))?,
            })
        };
        let layers = (0..cfg.n_layer)
            .map(|i| {
                Ok(Layer {
                    ln_1: norm(&format!("h.{i}.ln_1"))?,
                    c_attn: linear(&format!("h.{i}.attn.c_attn"))?,
                    attn_proj: linear(&format!("h.{i}.attn.c_proj"))?,
                    ln_2: norm(&format!("h.{i}.ln_2"))?,
                    c_fc: linear(&format!("h.{i}.mlp.c_fc"))?,
                    mlp_proj: linear(&format!("h.{i}.mlp.c_proj"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let pos_table = match cfg.positions {
            PositionKind::Learned => Some(get("wpe.weight")?),
            PositionKind::Sinusoidal => Some(host(&sinusoidal_table(
                cfg.block_size,
                cfg.n_embd,
                &candle_core::Device::Cpu,
            )?)?),
            PositionKind::Rope => None,
        };
        let c = cfg.n_embd;
        let kv_dim = cfg.kv_heads() * cfg.head_dim();
        let qkv_dim = c + 2 * kv_dim;
        let cache = || vec![0f32; batch * cfg.block_size * kv_dim];
        // Scratch for at most MAX_ROWS rows: longer prefills run in chunks of positions.
        let chunk = (MAX_ROWS / batch).clamp(1, cfg.block_size);
        let rows = batch * chunk;
        let kv_bytes = 2.0 * 4.0 * (cfg.n_layer * batch * cfg.block_size * kv_dim) as f64;
        if let Some(available) = crate::util::available_memory_bytes() {
            if kv_bytes > available {
                crate::user_bail!(
                    "{batch} samples of {} positions need {:.1} GiB of keys and values, more than the {:.1} GiB available; use fewer --num-samples",
                    cfg.block_size,
                    kv_bytes / f64::from(1 << 30),
                    available / f64::from(1 << 30)
                );
            }
        }
        let fc_out = crate::model::spec::Shapes::new(cfg).mlp_fc_width;
        let splits_matvecs = layers.iter().any(|l| {
            [&l.c_attn, &l.attn_proj, &l.c_fc, &l.mlp_proj]
                .iter()
                .any(|lin| lin.splits())
        });
        Ok(Self {
            n_head: cfg.n_head,
            n_kv_head: cfg.kv_heads(),
            head_dim: cfg.head_dim(),
            n_embd: c,
            vocab: cfg.vocab_size,
            block: cfg.block_size,
            head: (cfg.n_embd < DOT_MATVEC_MIN_INPUT)
                .then(|| -> Result<Linear> {
                    Ok(Linear::from_rows(&get("wte.weight")?, None, cfg.vocab_size))
                })
                .transpose()?,
            wte: get("wte.weight")?,
            pos_table,
            rope: (cfg.positions == PositionKind::Rope).then(|| rope_tables(cfg)),
            layers,
            ln_f: norm("ln_f")?,
            splits_matvecs,
            batch,
            chunk,
            len: 0,
            keys: (0..cfg.n_layer).map(|_| cache()).collect(),
            values: (0..cfg.n_layer).map(|_| cache()).collect(),
            x: vec![0.0; rows * c],
            xn: vec![0.0; rows * c],
            qkv: vec![0.0; rows * qkv_dim],
            att: vec![0.0; rows * c],
            proj: vec![0.0; rows * c],
            hidden: vec![0.0; rows * fc_out],
            mlp: cfg.mlp,
            mlp_hidden: cfg.mlp_hidden(),
            scores: vec![0.0; cfg.block_size],
            last: vec![0.0; batch * c],
            logits: vec![0.0; batch * cfg.vocab_size],
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
        super::parallel::on_workers(|| self.prefill_on_worker(windows).map(|_| ()))?;
        Ok(&self.logits)
    }

    fn prefill_on_worker(&mut self, windows: &[Vec<u32>]) -> Result<&[f32]> {
        assert_eq!(windows.len(), self.batch);
        let t = windows[0].len();
        assert!(windows.iter().all(|w| w.len() == t));
        self.len = 0;
        // Position chunks that fit the scratch buffers; each appends to the K/V buffers.
        let mut start = 0;
        while start + self.chunk < t {
            let ids: Vec<u32> = windows
                .iter()
                .flat_map(|w| w[start..start + self.chunk].iter().copied())
                .collect();
            self.forward(&ids, self.chunk)?;
            start += self.chunk;
        }
        let ids: Vec<u32> = windows
            .iter()
            .flat_map(|w| w[start..].iter().copied())
            .collect();
        self.forward(&ids, t - start)
    }

    /// Feeds one token per sequence at the next position; returns logits, (batch, V).
    pub fn step(&mut self, ids: &[u32]) -> Result<&[f32]> {
        // Models that split mat-vecs over the threads run on a pool thread, so those
        // hand-offs stay inside it; the others run here, on one thread.
        if !self.splits_matvecs {
            return self.forward(ids, 1);
        }
        super::parallel::on_workers(|| self.forward(ids, 1).map(|_| ()))?;
        Ok(&self.logits)
    }

    /// Runs `t` new tokens per sequence (`ids` is (batch, t) row-major) at positions
    /// len .. len + t, appending their keys and values.
    fn forward(&mut self, ids: &[u32], t: usize) -> Result<&[f32]> {
        assert_eq!(ids.len(), self.batch * t);
        assert!(t <= self.chunk, "prefill chunks fit the scratch buffers");
        let pos0 = self.len;
        if t == 0 || pos0 + t > self.block {
            anyhow::bail!(
                "{} positions do not fit the K/V buffers of {}: slide the window",
                pos0 + t,
                self.block
            );
        }
        let c = self.n_embd;
        let (h, h_kv, d) = (self.n_head, self.n_kv_head, self.head_dim);
        let kv_dim = h_kv * d;
        let qkv_dim = c + 2 * kv_dim;
        let rows = self.batch * t;
        let block = self.block;

        // Token (+ position) embeddings; row r is sequence r / t at position pos0 + r % t.
        for (r, &id) in ids.iter().enumerate() {
            let id = id as usize;
            if id >= self.vocab {
                anyhow::bail!("token id {id} is outside the vocabulary of {}", self.vocab);
            }
            let x = &mut self.x[r * c..(r + 1) * c];
            x.copy_from_slice(&self.wte[id * c..(id + 1) * c]);
            if let Some(table) = &self.pos_table {
                let pos = pos0 + r % t;
                for (xi, pi) in x.iter_mut().zip(&table[pos * c..(pos + 1) * c]) {
                    *xi += pi;
                }
            }
        }

        for (l, layer) in self.layers.iter().enumerate() {
            // Attention: q, k, v for every row; rotate; store k, v; attend.
            norm_rows(&self.x[..rows * c], &layer.ln_1, c, &mut self.xn);
            linear(&layer.c_attn, &self.xn[..rows * c], rows, c, &mut self.qkv);
            for r in 0..rows {
                let (b, pos) = (r / t, pos0 + r % t);
                let qkv = &mut self.qkv[r * qkv_dim..(r + 1) * qkv_dim];
                if let Some((cos, sin)) = &self.rope {
                    let half = d / 2;
                    let (cos, sin) = (
                        &cos[pos * half..(pos + 1) * half],
                        &sin[pos * half..(pos + 1) * half],
                    );
                    for head in qkv[..c + kv_dim].chunks_exact_mut(d) {
                        rotate_half_pairs(head, cos, sin);
                    }
                }
                let at = (b * block + pos) * kv_dim;
                self.keys[l][at..at + kv_dim].copy_from_slice(&qkv[c..c + kv_dim]);
                self.values[l][at..at + kv_dim].copy_from_slice(&qkv[c + kv_dim..]);
            }
            let heads = Heads {
                n_head: h,
                n_kv_head: h_kv,
                head_dim: d,
                block,
            };
            let (keys, values, qkv) = (&self.keys[l], &self.values[l], &self.qkv);
            let attend_row = |r: usize, out: &mut [f32], scores: &mut [f32]| {
                attend(
                    &heads,
                    &qkv[r * qkv_dim..r * qkv_dim + c],
                    keys,
                    values,
                    (r / t, pos0 + r % t),
                    out,
                    scores,
                );
            };
            if rows == 1 {
                attend_row(0, &mut self.att[..c], &mut self.scores);
            } else {
                self.att[..rows * c]
                    .par_chunks_mut(c)
                    .enumerate()
                    .for_each_init(
                        || vec![0f32; block],
                        |scores, (r, out)| attend_row(r, out, scores),
                    );
            }
            linear(
                &layer.attn_proj,
                &self.att[..rows * c],
                rows,
                c,
                &mut self.proj,
            );
            add(&mut self.x[..rows * c], &self.proj[..rows * c]);

            // MLP.
            norm_rows(&self.x[..rows * c], &layer.ln_2, c, &mut self.xn);
            let hidden = self.mlp_hidden;
            let fc_out = layer.c_fc.d_out;
            linear(&layer.c_fc, &self.xn[..rows * c], rows, c, &mut self.hidden);
            match self.mlp {
                MlpKind::Gelu => gelu_in_place(&mut self.hidden[..rows * fc_out]),
                MlpKind::GeluTanh => gelu_tanh_in_place(&mut self.hidden[..rows * fc_out]),
                // Rows of (gate | up) -> rows of silu(gate) * up, packed in place.
                MlpKind::Swiglu => {
                    for r in 0..rows {
                        let (gate, up) = (r * fc_out, r * fc_out + hidden);
                        swiglu_into(&mut self.hidden, gate, up, r * hidden, hidden);
                    }
                }
            }
            linear(
                &layer.mlp_proj,
                &self.hidden[..rows * hidden],
                rows,
                hidden,
                &mut self.proj,
            );
            add(&mut self.x[..rows * c], &self.proj[..rows * c]);
        }

        // Only each sequence's last position needs logits.
        for b in 0..self.batch {
            let r = b * t + t - 1;
            self.ln_f.row(
                &self.x[r * c..(r + 1) * c],
                &mut self.last[b * c..(b + 1) * c],
            );
        }
        match &self.head {
            Some(head) => linear(head, &self.last, self.batch, c, &mut self.logits),
            None => project(
                WeightRef::Rows(&self.wte),
                None,
                self.vocab,
                &self.last,
                self.batch,
                c,
                &mut self.logits,
            ),
        }
        self.len += t;
        Ok(&self.logits)
    }
}

/// The shapes attention needs to find a head's query, keys and values.
pub struct Heads {
    n_head: usize,
    n_kv_head: usize,
    head_dim: usize,
    block: usize,
}

multiversion! {
    /// One position's attention output, all heads: `q` holds its query heads, the
    /// buffers hold the keys and values of sequence `at.0` up to position `at.1`.
    pub fn attend(heads: &Heads, q: &[f32], keys: &[f32], values: &[f32], at: (usize, usize), out: &mut [f32], scores: &mut [f32]) {
        let (b, pos) = at;
        let d = heads.head_dim;
        let kv_dim = heads.n_kv_head * d;
        let group = heads.n_head / heads.n_kv_head;
        let scale = 1.0 / (d as f32).sqrt();
        let keys = &keys[b * heads.block * kv_dim..];
        let values = &values[b * heads.block * kv_dim..];
        out.fill(0.0);
        for head in 0..heads.n_head {
            let g = head / group; // the K/V head this query head shares
            let q = &q[head * d..(head + 1) * d];
            let scores = &mut scores[..=pos];
            for (s, score) in scores.iter_mut().enumerate() {
                *score = dot_lanes(q, &keys[s * kv_dim + g * d..s * kv_dim + (g + 1) * d]) * scale;
            }
            softmax_inline(scores);
            let out = &mut out[head * d..(head + 1) * d];
            for (s, &p) in scores.iter().enumerate() {
                axpy(out, p, &values[s * kv_dim + g * d..s * kv_dim + (g + 1) * d]);
            }
        }
    }
}

/// The norm of each row of `x` (rows of width c).
fn norm_rows(x: &[f32], norm: &Norm, c: usize, out: &mut [f32]) {
    for (xr, or) in x.chunks_exact(c).zip(out.chunks_exact_mut(c)) {
        norm.row(xr, or);
    }
}

/// buf[out..out + n] = silu(buf[gate..gate + n]) * buf[up..up + n]; `out` <= `gate`, so
/// rows can be packed in place front to back.
fn swiglu_into(buf: &mut [f32], gate: usize, up: usize, out: usize, n: usize) {
    for i in 0..n {
        let g = buf[gate + i];
        buf[out + i] = g / (1.0 + exp_approx(-g)) * buf[up + i];
    }
}

/// out = x Wᵀ + bias for `rows` rows of width `d_in`: a GEMM for many rows, one dot
/// product per weight row (read once for all rows) for a few.
fn linear(lin: &Linear, x: &[f32], rows: usize, d_in: usize, out: &mut [f32]) {
    let w = match &lin.w {
        Weight::Rows(w) => WeightRef::Rows(w),
        Weight::Cols(wt) => WeightRef::Cols(wt),
    };
    project(w, lin.b.as_deref(), lin.d_out, x, rows, d_in, out);
}

/// A borrowed weight in either layout.
#[derive(Clone, Copy)]
enum WeightRef<'a> {
    Rows(&'a [f32]),
    Cols(&'a [f32]),
}

/// out = x Wᵀ + bias for `rows` rows of width `d_in`: mat-vecs for a few rows, a GEMM for
/// many.
fn project(
    w: WeightRef,
    bias: Option<&[f32]>,
    d_out: usize,
    x: &[f32],
    rows: usize,
    d_in: usize,
    out: &mut [f32],
) {
    if rows <= 4 {
        // Large weights: each thread takes a share of the outputs (the weights are
        // read from memory once per token; two cores read them faster than one).
        let share = if splits_matvec(d_out * d_in) {
            d_out.div_ceil(threads())
        } else {
            d_out
        };
        for r in 0..rows {
            let (x, out) = (
                &x[r * d_in..(r + 1) * d_in],
                &mut out[r * d_out..(r + 1) * d_out],
            );
            out.par_chunks_mut(share).enumerate().for_each(|(i, out)| {
                let first = i * share;
                let bias = bias.map(|b| &b[first..first + out.len()]);
                match w {
                    WeightRef::Rows(w) => {
                        matvec(&w[first * d_in..(first + out.len()) * d_in], bias, x, out)
                    }
                    WeightRef::Cols(wt) => matvec_t(wt, d_out, first, bias, x, out),
                }
            });
        }
        return;
    }
    let (w, layout) = match w {
        WeightRef::Rows(w) => (w, Layout::Transposed),
        WeightRef::Cols(wt) => (wt, Layout::AsIs),
    };
    matmul(
        out,
        x,
        Layout::AsIs,
        w,
        layout,
        rows,
        d_out,
        d_in,
        false,
        Precision::F32,
    );
    if let Some(bias) = bias {
        for row in out[..rows * d_out].chunks_exact_mut(d_out) {
            add(row, bias);
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

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// RoPE on one head, split-halves pairing: (x_i, x_{i+d/2}) turned by angle_i.
fn rotate_half_pairs(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = head.len() / 2;
    let (first, second) = head.split_at_mut(half);
    for i in 0..half {
        let (a, b) = (first[i], second[i]);
        first[i] = a * cos[i] - b * sin[i];
        second[i] = b * cos[i] + a * sin[i];
    }
}
