//! Single-token decoding on the CPU without a tensor library in the loop.
//!
//! The reference model decodes through ~100 small candle ops per token, each allocating
//! its output. Here one token costs, per layer: LayerNorm, one QKV mat-vec, RoPE in
//! place, attention over preallocated per-layer K/V buffers (grouped K/V heads stored
//! once), the output projection, LayerNorm, the MLP. Weights are copied once into flat
//! row-major buffers; nothing is allocated per token. Several sequences (samples) step
//! together so each weight row is read once for all of them.
//!
//! The prompt (and every window slide) is prefilled by the reference model's batched
//! forward, whose K/V cache is copied in.

use anyhow::Result;
use candle_core::{DType, Tensor};

use super::kernels::{dot, gelu_erf, layer_norm, matvec};
use crate::config::PositionKind;
use crate::model::norm::LAYER_NORM_EPS;
use crate::model::position::{rope_tables, sinusoidal_table};
use crate::model::{Dropout, Gpt, KvCache};

struct Linear {
    w: Vec<f32>, // (out, in), row-major
    b: Option<Vec<f32>>,
    d_out: usize,
}

struct Norm {
    w: Vec<f32>,
    b: Option<Vec<f32>>,
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
    pos_table: Option<Vec<f32>>, // (block, C): learned or sinusoidal
    rope: Option<(Vec<f32>, Vec<f32>)>,
    layers: Vec<Layer>,
    ln_f: Norm,

    batch: usize,
    len: usize,
    keys: Vec<Vec<f32>>,   // per layer: (batch, block, H_kv * d)
    values: Vec<Vec<f32>>, // per layer: (batch, block, H_kv * d)

    // Scratch, one row per sequence.
    x: Vec<f32>,
    xn: Vec<f32>,
    qkv: Vec<f32>,
    att: Vec<f32>,
    proj: Vec<f32>,
    hidden: Vec<f32>,
    scores: Vec<f32>,
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
            Ok(Linear {
                w,
                b: opt(&format!("{prefix}.bias"))?,
                d_out,
            })
        };
        let norm = |prefix: &str| -> Result<Norm> {
            Ok(Norm {
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
        Ok(Self {
            n_head: cfg.n_head,
            n_kv_head: cfg.kv_heads(),
            head_dim: cfg.head_dim(),
            n_embd: c,
            vocab: cfg.vocab_size,
            block: cfg.block_size,
            wte: get("wte.weight")?,
            pos_table,
            rope: (cfg.positions == PositionKind::Rope).then(|| rope_tables(cfg)),
            layers,
            ln_f: norm("ln_f")?,
            batch,
            len: 0,
            keys: (0..cfg.n_layer).map(|_| cache()).collect(),
            values: (0..cfg.n_layer).map(|_| cache()).collect(),
            x: vec![0.0; batch * c],
            xn: vec![0.0; batch * c],
            qkv: vec![0.0; batch * qkv_dim],
            att: vec![0.0; batch * c],
            proj: vec![0.0; batch * c],
            hidden: vec![0.0; batch * 4 * c],
            scores: vec![0.0; cfg.block_size],
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

    /// Runs the reference model over `windows` (one per sequence, equal lengths) and
    /// keeps its keys and values. Returns the last position's logits, (batch, V).
    pub fn prefill(&mut self, model: &Gpt, windows: &[Vec<u32>]) -> Result<&[f32]> {
        assert_eq!(windows.len(), self.batch);
        let t = windows[0].len();
        assert!(windows.iter().all(|w| w.len() == t) && t <= self.block);
        let flat: Vec<u32> = windows.concat();
        let ids = Tensor::from_vec(flat, (self.batch, t), model.device())?;
        let mut cache = KvCache::new(self.layers.len());
        let out = model.forward(&ids, 0, Some(&mut cache), &mut Dropout::off())?;
        let kv_dim = self.n_kv_head * self.head_dim;
        for l in 0..self.layers.len() {
            let (k, v) = cache.layer(l).expect("every layer cached");
            // (B, H_kv, T, d) -> (B, T, H_kv * d), the row layout of our buffers.
            for (src, dst) in [(k, &mut self.keys[l]), (v, &mut self.values[l])] {
                let rows = host(&src.transpose(1, 2)?.contiguous()?)?;
                for b in 0..self.batch {
                    let n = t * kv_dim;
                    let start = b * self.block * kv_dim;
                    dst[start..start + n].copy_from_slice(&rows[b * n..(b + 1) * n]);
                }
            }
        }
        self.len = t;
        let last = host(&out.logits.narrow(1, t - 1, 1)?)?;
        self.logits.copy_from_slice(&last);
        Ok(&self.logits)
    }

    /// Feeds one token per sequence at the next position; returns logits, (batch, V).
    pub fn step(&mut self, ids: &[u32]) -> Result<&[f32]> {
        assert_eq!(ids.len(), self.batch);
        let pos = self.len;
        if pos >= self.block {
            anyhow::bail!(
                "the K/V buffers are full ({} positions): slide the window",
                self.block
            );
        }
        let c = self.n_embd;
        let (h, h_kv, d) = (self.n_head, self.n_kv_head, self.head_dim);
        let kv_dim = h_kv * d;
        let qkv_dim = c + 2 * kv_dim;
        let scale = 1.0 / (d as f32).sqrt();

        for (b, &id) in ids.iter().enumerate() {
            let x = &mut self.x[b * c..(b + 1) * c];
            let id = id as usize;
            if id >= self.vocab {
                anyhow::bail!("token id {id} is outside the vocabulary of {}", self.vocab);
            }
            x.copy_from_slice(&self.wte[id * c..(id + 1) * c]);
            if let Some(table) = &self.pos_table {
                for (xi, pi) in x.iter_mut().zip(&table[pos * c..(pos + 1) * c]) {
                    *xi += pi;
                }
            }
        }

        for (l, layer) in self.layers.iter().enumerate() {
            // Attention.
            norm_rows(&self.x, &layer.ln_1, c, &mut self.xn);
            linear_rows(&layer.c_attn, &self.xn, c, &mut self.qkv);
            for b in 0..self.batch {
                let qkv = &mut self.qkv[b * qkv_dim..(b + 1) * qkv_dim];
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
                let row = (b * self.block + pos) * kv_dim;
                self.keys[l][row..row + kv_dim].copy_from_slice(&qkv[c..c + kv_dim]);
                self.values[l][row..row + kv_dim].copy_from_slice(&qkv[c + kv_dim..]);

                let keys = &self.keys[l][b * self.block * kv_dim..];
                let values = &self.values[l][b * self.block * kv_dim..];
                let att = &mut self.att[b * c..(b + 1) * c];
                att.fill(0.0);
                for head in 0..h {
                    let g = head / (h / h_kv); // the K/V head this query head shares
                    let q = &qkv[head * d..(head + 1) * d];
                    let scores = &mut self.scores[..=pos];
                    for (s, score) in scores.iter_mut().enumerate() {
                        let k = &keys[s * kv_dim + g * d..s * kv_dim + (g + 1) * d];
                        *score = dot(q, k) * scale;
                    }
                    super::kernels::softmax(scores);
                    let out = &mut att[head * d..(head + 1) * d];
                    for (s, &p) in scores.iter().enumerate() {
                        let v = &values[s * kv_dim + g * d..s * kv_dim + (g + 1) * d];
                        super::kernels::axpy(out, p, v);
                    }
                }
            }
            linear_rows(&layer.attn_proj, &self.att, c, &mut self.proj);
            add(&mut self.x, &self.proj);

            // MLP.
            norm_rows(&self.x, &layer.ln_2, c, &mut self.xn);
            linear_rows(&layer.c_fc, &self.xn, c, &mut self.hidden);
            gelu_erf(&mut self.hidden);
            linear_rows(&layer.mlp_proj, &self.hidden, 4 * c, &mut self.proj);
            add(&mut self.x, &self.proj);
        }

        norm_rows(&self.x, &self.ln_f, c, &mut self.xn);
        for b in 0..self.batch {
            matvec(
                &self.wte,
                None,
                &self.xn[b * c..(b + 1) * c],
                &mut self.logits[b * self.vocab..(b + 1) * self.vocab],
            );
        }
        self.len += 1;
        Ok(&self.logits)
    }
}

/// LayerNorm of each row of `x` (rows of width c).
fn norm_rows(x: &[f32], norm: &Norm, c: usize, out: &mut [f32]) {
    for (xr, or) in x.chunks_exact(c).zip(out.chunks_exact_mut(c)) {
        layer_norm(xr, &norm.w, norm.b.as_deref(), LAYER_NORM_EPS as f32, or);
    }
}

/// out[b] = W x[b] + bias for every row b; each weight row is read once for all rows.
fn linear_rows(lin: &Linear, x: &[f32], d_in: usize, out: &mut [f32]) {
    let rows = x.len() / d_in;
    if rows == 1 {
        return matvec(&lin.w, lin.b.as_deref(), x, out);
    }
    for o in 0..lin.d_out {
        let w = &lin.w[o * d_in..(o + 1) * d_in];
        let bias = lin.b.as_ref().map_or(0.0, |b| b[o]);
        for r in 0..rows {
            out[r * lin.d_out + o] = dot(w, &x[r * d_in..(r + 1) * d_in]) + bias;
        }
    }
}

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
