//! The training fast path on the CPU: the whole model's forward and backward written out
//! over preallocated buffers (llm.c style), GEMMs through `fast::gemm`, AdamW in place.
//!
//! All parameters live in one flat buffer, their gradients and AdamW moments in three
//! more of the same layout; every activation the backward needs has its own buffer,
//! sized once for (batch, block_size). A step allocates nothing. The reference model
//! (`crate::model`) stays the definition: tests hold this path's loss and gradients to
//! it within 1e-5, and checkpoints are written from the reference's named tensors.

use std::collections::HashMap;
use std::ops::Range;

use anyhow::Result;
use candle_core::{Device, Tensor};

use super::gemm::{matmul, Layout, Precision};
use super::kernels::multiversion;
use super::ops::{self, AttnShape};
use super::parallel::{on_workers, share_len, zip_in_place, zip_map};
use crate::config::{ModelConfig, PositionKind, TrainConfig};
use crate::model::position::{rope_tables, sinusoidal_table};
use crate::model::{Dropout, Params, Site};
use rayon::prelude::*;

/// Where each parameter of one block sits in the flat buffer.
struct BlockIndex {
    ln_1_w: Range<usize>,
    ln_1_b: Option<Range<usize>>,
    attn_w: Range<usize>,
    attn_b: Option<Range<usize>>,
    proj_w: Range<usize>,
    proj_b: Option<Range<usize>>,
    ln_2_w: Range<usize>,
    ln_2_b: Option<Range<usize>>,
    fc_w: Range<usize>,
    fc_b: Option<Range<usize>>,
    fc_proj_w: Range<usize>,
    fc_proj_b: Option<Range<usize>>,
}

/// Activations of one block, kept for the backward.
struct BlockActs {
    ln_1_mean: Vec<f32>,
    ln_1_rstd: Vec<f32>,
    qkv: Vec<f32>, // (N, 3C), q and k rotated when RoPE
    y: Vec<f32>,   // (N, C) attention output before the projection
    res_2: Vec<f32>,
    ln_2_mean: Vec<f32>,
    ln_2_rstd: Vec<f32>,
    fc: Vec<f32>,    // (N, 4C) before GELU; GELU(fc) is recomputed in the backward
    res_3: Vec<f32>, // the block's output
    // Dropout masks (0 or 1/(1-p)) of the last forward; empty without dropout.
    drop_att: Vec<f32>,  // (B, H, T, T) on the attention weights
    drop_attn: Vec<f32>, // (N, C) on the attention branch's output
    drop_mlp: Vec<f32>,  // (N, C) on the MLP branch's output
}

/// Gradient scratch shared by all blocks.
struct Scratch {
    dres: Vec<f32>,    // (N, C): gradient flowing down the residual stream
    dnorm: Vec<f32>,   // (N, C): gradient at a norm's output
    dy: Vec<f32>,      // (N, C)
    dqkv: Vec<f32>,    // (N, 3C)
    dfc: Vec<f32>,     // (N, 4C)
    dfc_out: Vec<f32>, // (N, 4C)
    tmp: Vec<f32>,     // (N, C): a projection's output before the residual add
    gelu: Vec<f32>,    // (N, 4C): GELU(fc) of the block at hand
    ln: Vec<f32>,      // (N, C): a norm's output, recomputed in the backward
    attn: Vec<f32>,    // (B, 3, T, T): attention's per-sequence work space
}

/// A model laid out for fused training: parameters, gradients, moments, activations.
pub struct FastGpt {
    cfg: ModelConfig,
    batch: usize,
    /// The reference model's parameter names, their ranges in the flat buffers, shapes.
    names: Vec<(String, Range<usize>, Vec<usize>)>,
    wte: Range<usize>,
    wpe: Option<Range<usize>>,
    ln_f_w: Range<usize>,
    ln_f_b: Option<Range<usize>>,
    blocks: Vec<BlockIndex>,
    pos_table: Option<Vec<f32>>, // sinusoidal
    rope: Option<(Vec<f32>, Vec<f32>)>,

    pub params: Vec<f32>,
    pub grads: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    decay: Vec<bool>, // per parameter tensor: weight decay applies (matrices)

    x0: Vec<f32>,
    acts: Vec<BlockActs>,
    ln_f: Vec<f32>,
    ln_f_mean: Vec<f32>,
    ln_f_rstd: Vec<f32>,
    logits: Vec<f32>, // (N, V): logits, then probabilities, then their gradient
    scratch: Scratch,
    ids: Vec<u32>,
    drop_x0: Vec<f32>,  // (N, C) on the embeddings
    row_loss: Vec<f64>, // (N): each position's loss, summed in order
    /// Whether the last forward drew dropout masks (training) or not (evaluation).
    dropped: bool,
    targets: Vec<u32>,
    /// Of every matrix product, forward and backward.
    precision: Precision,
}

impl FastGpt {
    /// Why this config cannot use the fast path, if it cannot.
    pub fn unsupported(device: &Device) -> Option<String> {
        if !device.is_cpu() {
            return Some("the fast path runs on the CPU".into());
        }
        None
    }

    /// Lays out `params` (the reference model's, in their order) for (batch, block_size),
    /// with matrix products in `precision`.
    pub fn new(
        cfg: &ModelConfig,
        params: &Params,
        batch: usize,
        precision: Precision,
    ) -> Result<Self> {
        let mut names = Vec::new();
        let mut offset = 0;
        let mut flat = Vec::with_capacity(params.count());
        let mut decay = Vec::new();
        for (name, var) in params.iter() {
            let values: Vec<f32> = var.as_tensor().flatten_all()?.to_vec1()?;
            let range = offset..offset + values.len();
            offset += values.len();
            flat.extend_from_slice(&values);
            decay.push(name.decay);
            names.push((name.name.clone(), range, var.dims().to_vec()));
        }
        let find = |name: &str| -> Option<Range<usize>> {
            names
                .iter()
                .find(|(n, _, _)| n == name)
                .map(|(_, r, _)| r.clone())
        };
        let need = |name: &str| -> Result<Range<usize>> {
            find(name).ok_or_else(|| anyhow::anyhow!("fast path: no parameter {name}"))
        };
        let blocks = (0..cfg.n_layer)
            .map(|i| {
                let p = |s: &str| format!("h.{i}.{s}");
                Ok(BlockIndex {
                    ln_1_w: need(&p("ln_1.weight"))?,
                    ln_1_b: find(&p("ln_1.bias")),
                    attn_w: need(&p("attn.c_attn.weight"))?,
                    attn_b: find(&p("attn.c_attn.bias")),
                    proj_w: need(&p("attn.c_proj.weight"))?,
                    proj_b: find(&p("attn.c_proj.bias")),
                    ln_2_w: need(&p("ln_2.weight"))?,
                    ln_2_b: find(&p("ln_2.bias")),
                    fc_w: need(&p("mlp.c_fc.weight"))?,
                    fc_b: find(&p("mlp.c_fc.bias")),
                    fc_proj_w: need(&p("mlp.c_proj.weight"))?,
                    fc_proj_b: find(&p("mlp.c_proj.bias")),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let (n, c, v) = (batch * cfg.block_size, cfg.n_embd, cfg.vocab_size);
        let hidden = cfg.mlp_hidden();
        let dropout = cfg.dropout > 0.0;
        let qkv_w = cfg.n_embd + 2 * cfg.kv_heads() * cfg.head_dim();
        let fc_out = crate::model::spec::Shapes::new(cfg).mlp_fc_width;
        let h = cfg.n_head;
        let t = cfg.block_size;
        let acts = (0..cfg.n_layer)
            .map(|_| BlockActs {
                ln_1_mean: vec![0.0; n],
                ln_1_rstd: vec![0.0; n],
                qkv: vec![0.0; n * qkv_w],
                y: vec![0.0; n * c],
                res_2: vec![0.0; n * c],
                ln_2_mean: vec![0.0; n],
                ln_2_rstd: vec![0.0; n],
                fc: vec![0.0; n * fc_out],
                res_3: vec![0.0; n * c],
                drop_att: vec![0.0; if dropout { batch * h * t * t } else { 0 }],
                drop_attn: vec![0.0; if dropout { n * c } else { 0 }],
                drop_mlp: vec![0.0; if dropout { n * c } else { 0 }],
            })
            .collect();
        let size = flat.len();
        Ok(Self {
            cfg: cfg.clone(),
            batch,
            wte: need("wte.weight")?,
            wpe: find("wpe.weight"),
            ln_f_w: need("ln_f.weight")?,
            ln_f_b: find("ln_f.bias"),
            blocks,
            pos_table: match cfg.positions {
                PositionKind::Sinusoidal => Some(
                    sinusoidal_table(cfg.block_size, c, &Device::Cpu)?
                        .flatten_all()?
                        .to_vec1()?,
                ),
                _ => None,
            },
            rope: (cfg.positions == PositionKind::Rope).then(|| rope_tables(cfg)),
            names,
            params: flat,
            grads: vec![0.0; size],
            m: vec![0.0; size],
            v: vec![0.0; size],
            decay,
            x0: vec![0.0; n * c],
            acts,
            ln_f: vec![0.0; n * c],
            ln_f_mean: vec![0.0; n],
            ln_f_rstd: vec![0.0; n],
            logits: vec![0.0; n * v],
            scratch: Scratch {
                dres: vec![0.0; n * c],
                dnorm: vec![0.0; n * c],
                dy: vec![0.0; n * c],
                dqkv: vec![0.0; n * qkv_w],
                dfc: vec![0.0; n * fc_out],
                dfc_out: vec![0.0; n * hidden],
                tmp: vec![0.0; n * c],
                gelu: vec![0.0; n * hidden],
                ln: vec![0.0; n * c],
                attn: vec![0.0; ops::attention_scratch_len(batch, t)],
            },
            ids: vec![0; n],
            drop_x0: vec![0.0; if dropout { n * c } else { 0 }],
            row_loss: vec![0.0; n],
            dropped: false,
            targets: vec![0; n],
            precision,
        })
    }

    fn rows(&self) -> usize {
        self.batch * self.cfg.block_size
    }

    /// Mean cross-entropy of `targets` given `ids`, both (batch, block_size) row-major.
    /// Keeps what the backward needs. With an active `dropout`, masks are drawn from it
    /// in the reference model's order (embeddings; per layer attention weights, attention
    /// output, MLP output), so both paths drop the same elements.
    pub fn forward(&mut self, ids: &[u32], targets: &[u32], dropout: Option<&Dropout>) -> f64 {
        on_workers(|| self.forward_on_worker(ids, targets, dropout))
    }

    fn forward_on_worker(
        &mut self,
        ids: &[u32],
        targets: &[u32],
        dropout: Option<&Dropout>,
    ) -> f64 {
        let n = self.rows();
        assert_eq!(ids.len(), n);
        assert_eq!(targets.len(), n);
        let Dims {
            t,
            c,
            v,
            hidden,
            fc_out,
            d,
            kv_dim,
            qkv_w,
        } = self.dims();
        let (norm, act, shape) = (self.norm_op(), self.activation(), self.attn_shape());
        let precision = self.precision;
        self.ids.copy_from_slice(ids);
        self.targets.copy_from_slice(targets);
        let p = &self.params;
        let slice = |r: &Range<usize>| &p[r.clone()];
        let opt = |r: &Option<Range<usize>>| r.as_ref().map(|r| &p[r.clone()]);

        let pos = match (&self.wpe, &self.pos_table) {
            (Some(r), _) => Some(&p[r.clone()]),
            (None, Some(table)) => Some(table.as_slice()),
            _ => None,
        };
        ops::embed_forward(&mut self.x0, ids, slice(&self.wte), pos, t, c);
        self.dropped = dropout.is_some() && !self.drop_x0.is_empty();
        let draw = |mask: &mut [f32], site: Site| {
            if let Some(d) = dropout {
                d.fill(site, 0, mask);
            }
        };
        if self.dropped {
            draw(&mut self.drop_x0, Site::Embedding);
            mul(&mut self.x0, &self.drop_x0);
        }

        for l in 0..self.blocks.len() {
            let (before, rest) = self.acts.split_at_mut(l);
            let a = &mut rest[0];
            let input: &[f32] = if l == 0 {
                &self.x0
            } else {
                &before[l - 1].res_3
            };
            let bi = &self.blocks[l];
            norm.forward(
                &mut self.scratch.ln,
                &mut a.ln_1_mean,
                &mut a.ln_1_rstd,
                input,
                slice(&bi.ln_1_w),
                opt(&bi.ln_1_b),
            );
            linear_forward(
                precision,
                &mut a.qkv,
                &self.scratch.ln,
                slice(&bi.attn_w),
                opt(&bi.attn_b),
                n,
                c,
                qkv_w,
            );
            if let Some((cos, sin)) = &self.rope {
                ops::rope(&mut a.qkv, cos, sin, t, qkv_w, c + kv_dim, d, false);
            }
            if self.dropped {
                draw(&mut a.drop_att, Site::AttentionWeights(l));
            }
            let att_mask = self.dropped.then_some(a.drop_att.as_slice());
            ops::attention_forward(
                precision,
                &mut a.y,
                &a.qkv,
                att_mask,
                &mut self.scratch.attn,
                shape,
            );
            linear_forward(
                precision,
                &mut self.scratch.tmp,
                &a.y,
                slice(&bi.proj_w),
                opt(&bi.proj_b),
                n,
                c,
                c,
            );
            if self.dropped {
                draw(&mut a.drop_attn, Site::AttentionOutput(l));
                mul(&mut self.scratch.tmp, &a.drop_attn);
            }
            zip_map(&mut a.res_2, input, &self.scratch.tmp, |x, y| x + y);
            norm.forward(
                &mut self.scratch.ln,
                &mut a.ln_2_mean,
                &mut a.ln_2_rstd,
                &a.res_2,
                slice(&bi.ln_2_w),
                opt(&bi.ln_2_b),
            );
            linear_forward(
                precision,
                &mut a.fc,
                &self.scratch.ln,
                slice(&bi.fc_w),
                opt(&bi.fc_b),
                n,
                c,
                fc_out,
            );
            act.forward(&mut self.scratch.gelu, &a.fc);
            linear_forward(
                precision,
                &mut self.scratch.tmp,
                &self.scratch.gelu,
                slice(&bi.fc_proj_w),
                opt(&bi.fc_proj_b),
                n,
                hidden,
                c,
            );
            if self.dropped {
                draw(&mut a.drop_mlp, Site::MlpOutput(l));
                mul(&mut self.scratch.tmp, &a.drop_mlp);
            }
            zip_map(&mut a.res_3, &a.res_2, &self.scratch.tmp, |x, y| x + y);
        }
        let last = &self.acts.last().expect("at least one layer").res_3;
        norm.forward(
            &mut self.ln_f,
            &mut self.ln_f_mean,
            &mut self.ln_f_rstd,
            last,
            slice(&self.ln_f_w),
            opt(&self.ln_f_b),
        );
        // Tied output layer: logits = ln_f · wteᵀ.
        matmul(
            &mut self.logits,
            &self.ln_f,
            Layout::AsIs,
            slice(&self.wte),
            Layout::Transposed,
            n,
            v,
            c,
            false,
            precision,
        );
        ops::softmax_cross_entropy(&mut self.logits, targets, v, &mut self.row_loss) / n as f64
    }

    /// Adds d(loss * `scale`)/d(params) to `grads`, for the batch of the last forward.
    pub fn backward(&mut self, scale: f32) {
        on_workers(|| self.backward_on_worker(scale))
    }

    fn backward_on_worker(&mut self, scale: f32) {
        let n = self.rows();
        let Dims {
            t,
            c,
            v,
            hidden,
            fc_out,
            d,
            kv_dim,
            qkv_w,
        } = self.dims();
        let (norm, act, shape) = (self.norm_op(), self.activation(), self.attn_shape());
        let precision = self.precision;
        let p = &self.params;
        let g = &mut self.grads;
        let s = &mut self.scratch;

        // Softmax + cross-entropy, then the tied output layer.
        ops::cross_entropy_backward(&mut self.logits, &self.targets, v, scale / n as f32);
        matmul(
            &mut s.dnorm,
            &self.logits,
            Layout::AsIs,
            &p[self.wte.clone()],
            Layout::AsIs,
            n,
            c,
            v,
            false,
            precision,
        );
        matmul(
            &mut g[self.wte.clone()],
            &self.logits,
            Layout::Transposed,
            &self.ln_f,
            Layout::AsIs,
            v,
            c,
            n,
            true,
            precision,
        );
        let last = &self.acts.last().expect("at least one layer").res_3;
        s.dres.fill(0.0);
        {
            let (dw, db) = weight_and_bias(g, &self.ln_f_w, &self.ln_f_b);
            norm.backward(
                &mut s.dres,
                dw,
                db,
                &s.dnorm,
                last,
                &p[self.ln_f_w.clone()],
                &self.ln_f_mean,
                &self.ln_f_rstd,
            );
        }

        for l in (0..self.blocks.len()).rev() {
            let a = &self.acts[l];
            let input: &[f32] = if l == 0 {
                &self.x0
            } else {
                &self.acts[l - 1].res_3
            };
            let bi = &self.blocks[l];

            // res_3 = res_2 + fc_proj(gelu(fc(ln_2(res_2)))): dres reaches both terms.
            // GELU(fc) is recomputed rather than kept per layer: it costs little time and
            // saves one (N, 4C) buffer per layer, the largest activation.
            let have_slope = act.recompute(&mut s.gelu, &mut s.dfc, &a.fc);
            // Through the branch's dropout: its gradient is dres * mask.
            let dbranch: &[f32] = if self.dropped {
                masked(&mut s.tmp, &s.dres, &a.drop_mlp)
            } else {
                &s.dres
            };
            linear_backward(
                precision,
                &mut s.dfc_out,
                g,
                dbranch,
                &s.gelu,
                p,
                &bi.fc_proj_w,
                &bi.fc_proj_b,
                n,
                hidden,
                c,
            );
            if have_slope {
                // s.dfc holds the slope: scale it by the output's gradient in place.
                zip_in_place(&mut s.dfc, &s.dfc_out, |slope, g| slope * g);
            } else {
                act.backward(&mut s.dfc, &a.fc, &s.dfc_out);
            }
            // The norms' outputs are recomputed from their inputs and saved statistics.
            norm.apply(
                &mut s.ln,
                &a.res_2,
                &p[bi.ln_2_w.clone()],
                bi.ln_2_b.as_ref().map(|r| &p[r.clone()]),
                &a.ln_2_mean,
                &a.ln_2_rstd,
            );
            linear_backward(
                precision,
                &mut s.dnorm,
                g,
                &s.dfc,
                &s.ln,
                p,
                &bi.fc_w,
                &bi.fc_b,
                n,
                c,
                fc_out,
            );
            {
                let (dw, db) = weight_and_bias(g, &bi.ln_2_w, &bi.ln_2_b);
                norm.backward(
                    &mut s.dres,
                    dw,
                    db,
                    &s.dnorm,
                    &a.res_2,
                    &p[bi.ln_2_w.clone()],
                    &a.ln_2_mean,
                    &a.ln_2_rstd,
                );
            }

            // res_2 = input + proj(attention(qkv(ln_1(input)))).
            let dbranch: &[f32] = if self.dropped {
                masked(&mut s.tmp, &s.dres, &a.drop_attn)
            } else {
                &s.dres
            };
            linear_backward(
                precision, &mut s.dy, g, dbranch, &a.y, p, &bi.proj_w, &bi.proj_b, n, c, c,
            );
            s.dqkv.fill(0.0);
            let att_mask = self.dropped.then_some(a.drop_att.as_slice());
            ops::attention_backward(
                precision,
                &mut s.dqkv,
                &s.dy,
                &a.qkv,
                att_mask,
                &mut s.attn,
                shape,
            );
            if let Some((cos, sin)) = &self.rope {
                // q, k were rotated after the projection: rotate their gradients back.
                ops::rope(&mut s.dqkv, cos, sin, t, qkv_w, c + kv_dim, d, true);
                // The projection's input is ln_1; its output before rotation is not
                // kept, but the weight gradient only needs ln_1 and dqkv.
            }
            norm.apply(
                &mut s.ln,
                input,
                &p[bi.ln_1_w.clone()],
                bi.ln_1_b.as_ref().map(|r| &p[r.clone()]),
                &a.ln_1_mean,
                &a.ln_1_rstd,
            );
            linear_backward(
                precision,
                &mut s.dnorm,
                g,
                &s.dqkv,
                &s.ln,
                p,
                &bi.attn_w,
                &bi.attn_b,
                n,
                c,
                qkv_w,
            );
            {
                let (dw, db) = weight_and_bias(g, &bi.ln_1_w, &bi.ln_1_b);
                norm.backward(
                    &mut s.dres,
                    dw,
                    db,
                    &s.dnorm,
                    input,
                    &p[bi.ln_1_w.clone()],
                    &a.ln_1_mean,
                    &a.ln_1_rstd,
                );
            }
        }

        // The embeddings.
        let (dwte, dwpe) = match &self.wpe {
            Some(wpe) => {
                // wte comes first in the buffer, so the two can be borrowed apart.
                let (lo, hi) = g.split_at_mut(wpe.start);
                (&mut lo[self.wte.clone()], Some(&mut hi[..wpe.len()]))
            }
            None => (&mut g[self.wte.clone()], None),
        };
        if self.dropped {
            mul(&mut s.dres, &self.drop_x0);
        }
        ops::embed_backward(dwte, dwpe, &s.dres, &self.ids, t, c);
    }

    fn dims(&self) -> Dims {
        let c = self.cfg.n_embd;
        let d = self.cfg.head_dim();
        let kv_dim = self.cfg.kv_heads() * d;
        Dims {
            t: self.cfg.block_size,
            c,
            v: self.cfg.vocab_size,
            hidden: self.cfg.mlp_hidden(),
            fc_out: crate::model::spec::Shapes::new(&self.cfg).mlp_fc_width,
            d,
            kv_dim,
            qkv_w: c + 2 * kv_dim,
        }
    }

    fn attn_shape(&self) -> AttnShape {
        AttnShape {
            b: self.batch,
            t: self.cfg.block_size,
            c: self.cfg.n_embd,
            h: self.cfg.n_head,
            kv: self.cfg.kv_heads(),
        }
    }

    fn norm_op(&self) -> ops::NormOp {
        ops::NormOp {
            kind: self.cfg.norm,
            eps: self.cfg.norm_eps as f32,
        }
    }

    fn activation(&self) -> ops::Activation {
        ops::Activation {
            kind: self.cfg.mlp,
            hidden: self.cfg.mlp_hidden(),
            fc_out: crate::model::spec::Shapes::new(&self.cfg).mlp_fc_width,
        }
    }

    pub fn zero_grads(&mut self) {
        self.grads.fill(0.0);
    }

    /// Scales gradients to a global L2 norm of at most `max_norm` (0: no clipping) and
    /// returns the norm before.
    pub fn clip_grads(&mut self, max_norm: f64) -> f64 {
        let norm = self
            .grads
            .iter()
            .map(|&x| (x as f64) * (x as f64))
            .sum::<f64>()
            .sqrt();
        if max_norm > 0.0 && norm > max_norm {
            let scale = (max_norm / (norm + 1e-6)) as f32;
            self.grads.iter_mut().for_each(|x| *x *= scale);
        }
        norm
    }

    /// One AdamW update (the same formula as `train::optim::AdamW`), in place.
    pub fn adamw(&mut self, step: usize, lr: f64, cfg: &TrainConfig) {
        on_workers(|| self.adamw_on_worker(step, lr, cfg))
    }

    fn adamw_on_worker(&mut self, step: usize, lr: f64, cfg: &TrainConfig) {
        let (b1, b2) = (cfg.beta1 as f32, cfg.beta2 as f32);
        let bc1 = 1.0 - cfg.beta1.powi(step as i32);
        let bc2 = 1.0 - cfg.beta2.powi(step as i32);
        let (lr32, eps) = (lr as f32, cfg.eps as f32);
        let hyper = |decay: bool| AdamHyper {
            b1,
            b2,
            inv_bc1: (1.0 / bc1) as f32,
            inv_bc2: (1.0 / bc2) as f32,
            lr: lr32,
            eps,
            shrink: if decay {
                1.0 - (lr * cfg.weight_decay) as f32
            } else {
                1.0
            },
        };
        // One share of the flat buffers per thread, each updating the parts of the
        // tensors that fall in it with that tensor's decay.
        let share = share_len(self.params.len());
        self.params
            .par_chunks_mut(share)
            .zip(self.grads.par_chunks(share))
            .zip(self.m.par_chunks_mut(share))
            .zip(self.v.par_chunks_mut(share))
            .enumerate()
            .for_each(|(i, (((p, g), m), v))| {
                let first = i * share;
                for ((_, range, _), decay) in self.names.iter().zip(&self.decay) {
                    let start = range.start.max(first);
                    let end = range.end.min(first + p.len());
                    if start < end {
                        let r = start - first..end - first;
                        let (p, g) = (&mut p[r.clone()], &g[r.clone()]);
                        adamw_update(p, g, &mut m[r.clone()], &mut v[r], hyper(*decay));
                    }
                }
            });
    }

    /// Copies the weights into the reference model's variables (for saving, evaluating).
    pub fn write_params(&self, params: &Params) -> Result<()> {
        for (name, range, dims) in &self.names {
            let var = params
                .get(name)
                .ok_or_else(|| anyhow::anyhow!("no parameter {name}"))?;
            let t = Tensor::from_slice(&self.params[range.clone()], dims.as_slice(), &Device::Cpu)?;
            var.set(&t)?;
        }
        Ok(())
    }

    /// Copies the reference model's weights in (after a resume, or to compare).
    pub fn read_params(&mut self, params: &Params) -> Result<()> {
        for (name, range, _) in &self.names {
            let var = params
                .get(name)
                .ok_or_else(|| anyhow::anyhow!("no parameter {name}"))?;
            let values: Vec<f32> = var.as_tensor().flatten_all()?.to_vec1()?;
            self.params[range.clone()].copy_from_slice(&values);
        }
        Ok(())
    }

    /// Sets the gradient of parameter `name` (for tests of the optimiser alone).
    pub fn set_grad(&mut self, name: &str, values: &[f32]) {
        let (_, range, _) = self
            .names
            .iter()
            .find(|(n, _, _)| n == name)
            .expect("a parameter");
        self.grads[range.clone()].copy_from_slice(values);
    }

    /// The gradients by parameter name (for tests against the reference).
    pub fn grads_by_name(&self) -> HashMap<String, Vec<f32>> {
        self.names
            .iter()
            .map(|(n, r, _)| (n.clone(), self.grads[r.clone()].to_vec()))
            .collect()
    }

    /// AdamW moments by checkpoint name (`<param>.exp_avg`, `<param>.exp_avg_sq`).
    pub fn moments(&self) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::new();
        for (name, range, dims) in &self.names {
            out.insert(
                format!("{name}.exp_avg"),
                Tensor::from_slice(&self.m[range.clone()], dims.as_slice(), &Device::Cpu)?,
            );
            out.insert(
                format!("{name}.exp_avg_sq"),
                Tensor::from_slice(&self.v[range.clone()], dims.as_slice(), &Device::Cpu)?,
            );
        }
        Ok(out)
    }

    /// Restores AdamW moments saved by `moments` (or the reference optimiser).
    pub fn load_moments(&mut self, tensors: &HashMap<String, Tensor>, source: &str) -> Result<()> {
        for (name, range, dims) in &self.names {
            for (suffix, buf) in [("exp_avg", &mut self.m), ("exp_avg_sq", &mut self.v)] {
                let key = format!("{name}.{suffix}");
                let Some(t) = tensors.get(&key) else {
                    crate::user_bail!("{source}: tensor {key} is missing");
                };
                if t.dims() != dims.as_slice() {
                    crate::user_bail!(
                        "{source}: tensor {key} has shape {:?}, expected {dims:?}",
                        t.dims()
                    );
                }
                let values: Vec<f32> = t
                    .to_dtype(candle_core::DType::F32)?
                    .flatten_all()?
                    .to_vec1()?;
                buf[range.clone()].copy_from_slice(&values);
            }
        }
        Ok(())
    }
}

#[derive(Clone, Copy)]
pub struct AdamHyper {
    b1: f32,
    b2: f32,
    inv_bc1: f32,
    inv_bc2: f32,
    lr: f32,
    eps: f32,
    shrink: f32,
}

multiversion! {
    /// m, v <- moving averages of g, g^2; p <- p * shrink - lr * m_hat / (sqrt(v_hat) + eps).
    pub fn adamw_update(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], hp: AdamHyper) {
        for i in 0..p.len() {
            m[i] = hp.b1 * m[i] + (1.0 - hp.b1) * g[i];
            v[i] = hp.b2 * v[i] + (1.0 - hp.b2) * g[i] * g[i];
            let m_hat = m[i] * hp.inv_bc1;
            let v_hat = v[i] * hp.inv_bc2;
            p[i] = p[i] * hp.shrink - hp.lr * m_hat / (v_hat.sqrt() + hp.eps);
        }
    }
}

/// The sizes a forward or backward pass works with.
struct Dims {
    t: usize,      // positions per sequence
    c: usize,      // width
    v: usize,      // vocabulary
    hidden: usize, // MLP hidden width
    fc_out: usize, // c_fc's output width (2 hidden for SwiGLU)
    d: usize,      // head size
    kv_dim: usize, // K/V heads x head size
    qkv_w: usize,  // a qkv row: c + 2 kv_dim
}

/// x *= mask, elementwise.
fn mul(x: &mut [f32], mask: &[f32]) {
    zip_in_place(x, mask, |a, m| a * m);
}

/// out = x * mask; returns out.
fn masked<'o>(out: &'o mut [f32], x: &[f32], mask: &[f32]) -> &'o [f32] {
    zip_map(out, x, mask, |a, m| a * m);
    out
}

/// out (n x d_out) = x (n x d_in) · Wᵀ + b.
#[allow(clippy::too_many_arguments)]
fn linear_forward(
    precision: Precision,
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    n: usize,
    d_in: usize,
    d_out: usize,
) {
    matmul(
        out,
        x,
        Layout::AsIs,
        w,
        Layout::Transposed,
        n,
        d_out,
        d_in,
        false,
        precision,
    );
    if let Some(b) = b {
        ops::add_bias(&mut out[..n * d_out], b);
    }
}

/// For out = x Wᵀ + b: dx = dout · W (overwritten), dW += doutᵀ · x, db += sum(dout).
#[allow(clippy::too_many_arguments)]
fn linear_backward(
    precision: Precision,
    dx: &mut [f32],
    grads: &mut [f32],
    dout: &[f32],
    x: &[f32],
    params: &[f32],
    w: &Range<usize>,
    b: &Option<Range<usize>>,
    n: usize,
    d_in: usize,
    d_out: usize,
) {
    matmul(
        dx,
        dout,
        Layout::AsIs,
        &params[w.clone()],
        Layout::AsIs,
        n,
        d_in,
        d_out,
        false,
        precision,
    );
    matmul(
        &mut grads[w.clone()],
        dout,
        Layout::Transposed,
        x,
        Layout::AsIs,
        d_out,
        d_in,
        n,
        true,
        precision,
    );
    if let Some(b) = b {
        ops::bias_backward(&mut grads[b.clone()], &dout[..n * d_out]);
    }
}

/// Mutable views of a weight's and (optionally) its bias's gradients; the bias follows
/// the weight in the buffer.
fn weight_and_bias<'g>(
    grads: &'g mut [f32],
    w: &Range<usize>,
    b: &Option<Range<usize>>,
) -> (&'g mut [f32], Option<&'g mut [f32]>) {
    match b {
        Some(b) => {
            assert!(b.start >= w.end, "bias after weight");
            let (lo, hi) = grads.split_at_mut(w.end);
            (
                &mut lo[w.clone()],
                Some(&mut hi[b.start - w.end..b.end - w.end]),
            )
        }
        None => (&mut grads[w.clone()], None),
    }
}
