//! The fused CPU engine: the model's forward and backward written out over flat,
//! preallocated buffers (llm.c's `gpt2_forward` / `gpt2_backward`), GEMMs through
//! `gemm`, AdamW in place.
//!
//! All parameters live in one flat buffer laid out by the model spec; their gradients
//! and AdamW moments in three more of the same layout. Every activation the backward
//! needs has its own buffer, sized once for (batch, block_size): after the first step,
//! a step allocates nothing. Outputs that are cheap to recompute (norms, the MLP's
//! non-linearity, attention weights) are recomputed in the backward instead of kept per
//! layer. The reference model stays the definition: tests hold this engine's loss,
//! gradients and updates to it within 1e-5.

use std::ops::Range;

use anyhow::Result;

use super::layout::{BlockGrads, BlockWeights, Grads, Weights};
use super::ops::activation::Activation;
use super::ops::adamw::{self, Moments};
use super::ops::attention::Attention;
use super::ops::dropout::{self as drop, masked};
use super::ops::loss;
use super::ops::norm::NormStats;
use super::ops::rope::{Rope, Turn};
use super::ops::{residual, Positions};
use super::threads::{on_workers, on_workers_awake, zip_in_place};
use crate::config::{PositionKind, Precision};
use crate::model::position::sinusoidal_values;
use crate::model::spec::{ModelSpec, Shapes};
use crate::model::{Dropout, Site};
use crate::optim::AdamWStep;

/// A model laid out for fused training: parameters, gradients, moments, activations.
pub struct FusedCpu {
    spec: ModelSpec,
    batch: usize,
    /// Of every matrix product, forward and backward.
    precision: Precision,
    params: Vec<f32>,
    /// Gradients and AdamW's moments, allocated when first needed (evaluation needs
    /// none of them).
    grads: Vec<f32>,
    /// A micro-batch's gradient after the first since `zero_grads`, computed alone and
    /// then added to `grads` (see `backward`).
    micro_grads: Vec<f32>,
    /// Whether a backward since `zero_grads` has written `grads`.
    summing: bool,
    /// The parameters the optimiser updates, and the range of the flat buffer its
    /// moments cover: all of them, or one rank's shard (ZeRO-1).
    optimized: Range<usize>,
    m: Vec<f32>,
    v: Vec<f32>,
    /// The fixed sinusoidal table, when positions are sinusoidal.
    sinusoids: Option<Vec<f32>>,
    rope: Option<Rope>,
    acts: Activations,
    scratch: Scratch,
}

/// What one block's forward keeps for its backward. N = batch x block_size rows.
struct BlockActs {
    ln_1: NormStats,
    /// (N, qkv width): q and k rotated under RoPE.
    qkv: Vec<f32>,
    /// (N, C): the heads' outputs side by side, before the projection.
    y: Vec<f32>,
    /// (N, C): the residual stream after the attention sub-layer.
    res_2: Vec<f32>,
    ln_2: NormStats,
    /// (N, fc width): the MLP's first projection, before its non-linearity.
    fc: Vec<f32>,
    /// (N, C): the block's output.
    res_3: Vec<f32>,
    /// The dropout masks of the last forward (empty without dropout).
    masks: BlockMasks,
}

/// A block's dropout masks: 0 or 1 / (1 - p) per element.
struct BlockMasks {
    /// (B, H, T, T) on the attention weights.
    weights: Vec<f32>,
    /// (N, C) on the attention branch.
    attention: Vec<f32>,
    /// (N, C) on the MLP branch.
    mlp: Vec<f32>,
}

/// The batch and everything the forward keeps outside the blocks.
struct Activations {
    ids: Vec<u32>,
    targets: Vec<u32>,
    /// (N, C): the embeddings entering the first block (after dropout).
    x0: Vec<f32>,
    /// (N, C): the embeddings' dropout mask.
    drop_x0: Vec<f32>,
    blocks: Vec<BlockActs>,
    /// (N, C): the final norm's output, and its statistics.
    ln_f: Vec<f32>,
    ln_f_stats: NormStats,
    /// (N, V): the logits, then their probabilities, then their gradient.
    logits: Vec<f32>,
    /// (N): each position's loss, summed in order.
    row_loss: Vec<f64>,
    /// Whether the last forward applied dropout masks.
    dropped: bool,
}

impl Activations {
    /// Block `l`'s input (the embeddings, or the block below's output) and what it
    /// keeps.
    fn block_mut(&mut self, l: usize) -> (&[f32], &mut BlockActs) {
        let (below, rest) = self.blocks.split_at_mut(l);
        let input = below
            .last()
            .map_or(self.x0.as_slice(), |b| b.res_3.as_slice());
        (input, &mut rest[0])
    }

    fn block(&self, l: usize) -> BlockIo<'_> {
        BlockIo {
            input: if l == 0 {
                &self.x0
            } else {
                &self.blocks[l - 1].res_3
            },
            kept: &self.blocks[l],
        }
    }
}

/// A block's input and what its forward kept, for its backward.
struct BlockIo<'a> {
    input: &'a [f32],
    kept: &'a BlockActs,
}

/// Work space shared by all blocks, (N, width) each.
struct Scratch {
    /// The gradient flowing down the residual stream.
    dres: Vec<f32>,
    /// A norm's output (recomputed in the backward), and its gradient.
    ln: Vec<f32>,
    dln: Vec<f32>,
    /// A branch's output before the residual add (or its gradient after dropout).
    branch: Vec<f32>,
    /// The attention output's gradient.
    dy: Vec<f32>,
    dqkv: Vec<f32>,
    /// The MLP's hidden activations (recomputed in the backward), and their gradient.
    act: Vec<f32>,
    dact: Vec<f32>,
    /// The gradient at the first projection's output (or the non-linearity's slope).
    dfc: Vec<f32>,
    /// Attention's per-thread T x T work space.
    attention: Vec<f32>,
}

/// What every layer of one pass shares.
struct Pass<'a> {
    shapes: &'a Shapes,
    precision: Precision,
    attention: Attention,
    activation: Activation,
    rope: Option<&'a Rope>,
    positions: Positions,
    dropout: Option<&'a Dropout>,
}

impl FusedCpu {
    /// The model `spec` with weights `values` (a flat buffer in table order), for
    /// batches of `batch` sequences of block_size tokens, products in `precision`.
    pub fn new(
        spec: &ModelSpec,
        values: &[f32],
        batch: usize,
        precision: Precision,
    ) -> Result<Self> {
        assert_eq!(values.len(), spec.len(), "a flat buffer of the whole table");
        let cfg = &spec.config;
        let s = &spec.shapes;
        let sinusoids = match cfg.positions {
            PositionKind::Sinusoidal => Some(sinusoidal_values(spec)?),
            _ => None,
        };
        let mut engine = Self {
            batch,
            precision,
            params: values.to_vec(),
            grads: Vec::new(),
            micro_grads: Vec::new(),
            summing: false,
            optimized: 0..spec.len(),
            m: Vec::new(),
            v: Vec::new(),
            sinusoids,
            rope: (cfg.positions == PositionKind::Rope).then(|| Rope::new(cfg)),
            acts: Activations::new(s, batch, cfg.dropout > 0.0),
            scratch: Scratch::new(s, batch),
            spec: spec.clone(),
        };
        let pass = Self::pass(spec, None, batch, precision);
        engine.scratch.attention = vec![0.0; pass.attention.scratch_len()];
        Ok(engine)
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Sequences per batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    fn rows(&self) -> usize {
        self.batch * self.spec.shapes.block_size
    }

    /// What the layers of a pass share, borrowed from the fields it needs.
    fn pass<'a>(
        spec: &'a ModelSpec,
        rope: Option<&'a Rope>,
        batch: usize,
        precision: Precision,
    ) -> Pass<'a> {
        let s = &spec.shapes;
        Pass {
            shapes: s,
            precision,
            attention: Attention {
                batch,
                t: s.block_size,
                shapes: *s,
                precision,
            },
            activation: Activation::new(spec.config.mlp, s),
            rope,
            positions: Positions::from_start(s.block_size),
            dropout: None,
        }
    }

    /// Mean cross-entropy of `targets` given `ids`, both (batch, block_size) row-major,
    /// with `dropout` when training. Keeps what the backward needs.
    pub fn forward(&mut self, ids: &[u32], targets: &[u32], dropout: Option<&Dropout>) -> f64 {
        on_workers_awake(|| self.forward_on_worker(ids, targets, dropout))
    }

    fn forward_on_worker(
        &mut self,
        ids: &[u32],
        targets: &[u32],
        dropout: Option<&Dropout>,
    ) -> f64 {
        let n = self.rows();
        assert!(
            ids.len() == n && targets.len() == n,
            "a batch of (batch, block_size)"
        );
        let weights = Weights::new(&self.spec, &self.params);
        let pass = Pass {
            dropout,
            ..Self::pass(&self.spec, self.rope.as_ref(), self.batch, self.precision)
        };
        let (a, s) = (&mut self.acts, &mut self.scratch);
        a.ids.copy_from_slice(ids);
        a.targets.copy_from_slice(targets);
        a.dropped = dropout.is_some();

        weights
            .embedding(self.sinusoids.as_deref())
            .forward(&mut a.x0, ids, pass.positions);
        if let Some(d) = dropout {
            drop::fill(d, Site::Embedding, &mut a.drop_x0);
            drop::apply(&mut a.x0, &a.drop_x0);
        }
        for l in 0..self.spec.blocks.len() {
            let (input, kept) = a.block_mut(l);
            pass.block_forward(l, &weights.block(l), input, kept, s);
        }
        let last = &a.blocks.last().expect("at least one layer").res_3;
        let ln_f = weights.norm(&self.spec.ln_f);
        ln_f.forward(&mut a.ln_f, &mut a.ln_f_stats, last);
        // The output layer is the token embedding, transposed (weight tying).
        weights
            .output()
            .forward(&mut a.logits, &a.ln_f, pass.precision);
        let v = self.spec.shapes.vocab_size;
        loss::softmax_cross_entropy(&mut a.logits, targets, v, &mut a.row_loss) / n as f64
    }

    /// Adds d(loss * `scale`)/d(params) to the gradients, for the batch of the last
    /// forward.
    ///
    /// The first micro-batch since `zero_grads` writes the gradients; each later one is
    /// computed alone and then added. So a step's gradient is each micro-batch's
    /// gradient, added up, whether one process adds them or ranks' reduction does: two
    /// ranks give the bits of one process with two micro-batches (a + b is b + a; more
    /// terms may round in another order).
    pub fn backward(&mut self, scale: f32) {
        if self.grads.is_empty() {
            self.zero_grads();
        }
        if !self.summing {
            self.summing = true;
            return on_workers_awake(|| self.backward_on_worker(scale, false));
        }
        if self.micro_grads.len() != self.grads.len() {
            self.micro_grads = vec![0.0; self.grads.len()];
        } else {
            self.micro_grads.fill(0.0);
        }
        on_workers_awake(|| {
            self.backward_on_worker(scale, true);
            zip_in_place(&mut self.grads, &self.micro_grads, |sum, g| sum + g);
        })
    }

    /// The backward into the gradients, or into `micro_grads` (`alone`).
    fn backward_on_worker(&mut self, scale: f32, alone: bool) {
        let n = self.rows();
        let spec = &self.spec;
        let weights = Weights::new(spec, &self.params);
        let pass = Self::pass(spec, self.rope.as_ref(), self.batch, self.precision);
        let g = if alone {
            &mut self.micro_grads
        } else {
            &mut self.grads
        };
        let (a, s) = (&mut self.acts, &mut self.scratch);
        let v = spec.shapes.vocab_size;

        loss::cross_entropy_backward(&mut a.logits, &a.targets, v, scale / n as f32);
        let dlogits = &a.logits;
        let out = Grads::new(spec, g).output();
        weights
            .output()
            .backward(&mut s.dln, out, dlogits, &a.ln_f, pass.precision);
        let last = &a.blocks.last().expect("at least one layer").res_3;
        s.dres.fill(0.0);
        let ln_f_grads = Grads::new(spec, g).ln_f();
        weights
            .norm(&spec.ln_f)
            .backward(&mut s.dres, ln_f_grads, &s.dln, last, &a.ln_f_stats);
        for l in (0..spec.blocks.len()).rev() {
            let grads = Grads::new(spec, g).block(l);
            pass.block_backward(&weights.block(l), grads, a.block(l), a.dropped, s);
        }
        if a.dropped {
            drop::apply(&mut s.dres, &a.drop_x0);
        }
        Grads::new(spec, g)
            .embedding()
            .backward(&s.dres, &a.ids, pass.positions);
    }

    pub fn zero_grads(&mut self) {
        self.grads.clear();
        self.grads.resize(self.params.len(), 0.0);
        self.summing = false;
    }

    /// Makes the optimiser update only `range` of the flat buffer (one rank's shard:
    /// ZeRO-1), with moments for that range alone, zero until set.
    pub fn optimize_only(&mut self, range: Range<usize>) {
        assert!(range.end <= self.params.len(), "a range of the parameters");
        self.optimized = range;
        self.m = Vec::new();
        self.v = Vec::new();
    }

    /// The range of the flat buffer the optimiser updates.
    pub fn optimized(&self) -> Range<usize> {
        self.optimized.clone()
    }

    /// The gradients of the optimised range (where a rank's reduced shard goes).
    pub fn optimized_grads_mut(&mut self) -> &mut [f32] {
        let range = self.optimized();
        &mut self.grads_mut()[range]
    }

    /// The optimised range's gradients' sums of squares by block of `NORM_CHUNK`: its
    /// part of the global norm.
    pub fn grad_squares(&self) -> Vec<f64> {
        if self.grads.is_empty() {
            return vec![0.0; self.optimized.len().div_ceil(crate::optim::NORM_CHUNK)];
        }
        on_workers(|| adamw::squares_by_chunk(&self.grads[self.optimized.clone()]))
    }

    /// Multiplies the optimised range's gradients by `factor` (clipping).
    pub fn scale_grads(&mut self, factor: f32) {
        let range = self.optimized();
        let grads = &mut self.grads_mut()[range];
        on_workers(|| adamw::scale(grads, factor))
    }

    /// The AdamW update `u` of the optimised range, in place.
    pub fn adamw(&mut self, u: &AdamWStep) {
        let range = self.optimized();
        if self.grads.is_empty() {
            self.zero_grads();
        }
        if self.m.is_empty() {
            self.m = vec![0.0; range.len()];
            self.v = vec![0.0; range.len()];
        }
        let moments = Moments {
            m: &mut self.m,
            v: &mut self.v,
        };
        let params = &mut self.params[range.clone()];
        let (grads, table) = (&self.grads[range.clone()], self.spec.params());
        on_workers(|| adamw::update(u, params, grads, moments, table, range.start))
    }

    /// The weights: a flat buffer in the spec's table order.
    pub fn weights(&self) -> &[f32] {
        &self.params
    }

    pub fn set_weights(&mut self, values: &[f32]) {
        self.params.copy_from_slice(values);
    }

    /// The weights, to be written in place (the ranks' shards gathered after an
    /// update).
    pub fn weights_mut(&mut self) -> &mut [f32] {
        &mut self.params
    }

    /// The gradients of the last backward(s), laid out like the weights (empty before
    /// the first).
    pub fn grads(&self) -> &[f32] {
        &self.grads
    }

    pub fn grads_mut(&mut self) -> &mut [f32] {
        if self.grads.is_empty() {
            self.zero_grads();
        }
        &mut self.grads
    }

    /// AdamW's moments (m, v) of the optimised range, laid out like the weights there;
    /// zeros before the first update.
    pub fn moments(&self) -> (Vec<f32>, Vec<f32>) {
        if self.m.is_empty() {
            let zeros = vec![0.0; self.optimized.len()];
            return (zeros.clone(), zeros);
        }
        (self.m.clone(), self.v.clone())
    }

    /// Sets the moments of the optimised range.
    pub fn set_moments(&mut self, m: &[f32], v: &[f32]) {
        let len = self.optimized.len();
        assert!(
            m.len() == len && v.len() == len,
            "moments of the optimised range"
        );
        self.m = m.to_vec();
        self.v = v.to_vec();
    }

    /// Each position's loss in the last forward, (batch, block_size) row-major.
    pub fn position_losses(&self) -> &[f64] {
        &self.acts.row_loss
    }
}

impl Pass<'_> {
    /// Block `l`: res_2 = x + attention(ln_1(x)); res_3 = res_2 + mlp(ln_2(res_2)).
    fn block_forward(
        &self,
        l: usize,
        w: &BlockWeights,
        x: &[f32],
        a: &mut BlockActs,
        s: &mut Scratch,
    ) {
        let dropout = self.dropout;
        let precision = self.precision;
        // Attention: q | k | v of the normed input, positions turned in, heads attend,
        // their outputs projected back into the residual stream.
        w.ln_1.forward(&mut s.ln, &mut a.ln_1, x);
        w.attn_qkv.forward(&mut a.qkv, &s.ln, precision);
        if let Some(rope) = self.rope {
            rope.rotate(&mut a.qkv, self.shapes, self.positions, Turn::Forward);
        }
        let weights_mask = dropout.map(|d| {
            drop::fill(d, Site::AttentionWeights(l), &mut a.masks.weights);
            a.masks.weights.as_slice()
        });
        self.attention
            .forward(&mut a.y, &a.qkv, weights_mask, &mut s.attention);
        w.attn_proj.forward(&mut s.branch, &a.y, precision);
        if let Some(d) = dropout {
            drop::fill(d, Site::AttentionOutput(l), &mut a.masks.attention);
            drop::apply(&mut s.branch, &a.masks.attention);
        }
        residual(&mut a.res_2, x, &s.branch);

        // MLP: expand, non-linearity, project back.
        w.ln_2.forward(&mut s.ln, &mut a.ln_2, &a.res_2);
        w.mlp_fc.forward(&mut a.fc, &s.ln, precision);
        self.activation.forward(&mut s.act, &a.fc);
        w.mlp_proj.forward(&mut s.branch, &s.act, precision);
        if let Some(d) = dropout {
            drop::fill(d, Site::MlpOutput(l), &mut a.masks.mlp);
            drop::apply(&mut s.branch, &a.masks.mlp);
        }
        residual(&mut a.res_3, &a.res_2, &s.branch);
    }

    /// The backward of `block_forward`: `s.dres` holds the gradient at the block's
    /// output on entry and at its input on return; weight gradients accumulate in `g`.
    fn block_backward(
        &self,
        w: &BlockWeights,
        g: BlockGrads,
        io: BlockIo,
        dropped: bool,
        s: &mut Scratch,
    ) {
        let BlockIo { input: x, kept: a } = io;
        let precision = self.precision;
        // res_3 = res_2 + mlp(ln_2(res_2)): dres reaches both terms. The non-linearity's
        // output is recomputed (with its slope where the kind allows).
        let have_slope = self.activation.recompute(&mut s.act, &mut s.dfc, &a.fc);
        let dbranch: &[f32] = if dropped {
            masked(&mut s.branch, &s.dres, &a.masks.mlp)
        } else {
            &s.dres
        };
        w.mlp_proj
            .backward(&mut s.dact, g.mlp_proj, dbranch, &s.act, precision);
        if have_slope {
            zip_in_place(&mut s.dfc, &s.dact, |slope, g| slope * g);
        } else {
            self.activation.backward(&mut s.dfc, &a.fc, &s.dact);
        }
        w.ln_2.apply(&mut s.ln, &a.res_2, &a.ln_2);
        w.mlp_fc
            .backward(&mut s.dln, g.mlp_fc, &s.dfc, &s.ln, precision);
        w.ln_2
            .backward(&mut s.dres, g.ln_2, &s.dln, &a.res_2, &a.ln_2);

        // res_2 = x + proj(attention(qkv(ln_1(x)))).
        let dbranch: &[f32] = if dropped {
            masked(&mut s.branch, &s.dres, &a.masks.attention)
        } else {
            &s.dres
        };
        w.attn_proj
            .backward(&mut s.dy, g.attn_proj, dbranch, &a.y, precision);
        s.dqkv.fill(0.0);
        let weights_mask = dropped.then_some(a.masks.weights.as_slice());
        self.attention
            .backward(&mut s.dqkv, &s.dy, &a.qkv, weights_mask, &mut s.attention);
        if let Some(rope) = self.rope {
            // q and k were turned after the projection: turn their gradients back.
            rope.rotate(&mut s.dqkv, self.shapes, self.positions, Turn::Back);
        }
        w.ln_1.apply(&mut s.ln, x, &a.ln_1);
        w.attn_qkv
            .backward(&mut s.dln, g.attn_qkv, &s.dqkv, &s.ln, precision);
        w.ln_1.backward(&mut s.dres, g.ln_1, &s.dln, x, &a.ln_1);
    }
}

impl Activations {
    fn new(s: &Shapes, batch: usize, dropout: bool) -> Self {
        let (t, c) = (s.block_size, s.n_embd);
        let n = batch * t;
        let with_dropout = |len: usize| vec![0.0; if dropout { len } else { 0 }];
        let blocks = (0..s.n_layer)
            .map(|_| BlockActs {
                ln_1: NormStats::new(n),
                qkv: vec![0.0; n * s.qkv_width],
                y: vec![0.0; n * c],
                res_2: vec![0.0; n * c],
                ln_2: NormStats::new(n),
                fc: vec![0.0; n * s.mlp_fc_width],
                res_3: vec![0.0; n * c],
                masks: BlockMasks {
                    weights: with_dropout(batch * s.n_head * t * t),
                    attention: with_dropout(n * c),
                    mlp: with_dropout(n * c),
                },
            })
            .collect();
        Self {
            ids: vec![0; n],
            targets: vec![0; n],
            x0: vec![0.0; n * c],
            drop_x0: with_dropout(n * c),
            blocks,
            ln_f: vec![0.0; n * c],
            ln_f_stats: NormStats::new(n),
            logits: vec![0.0; n * s.vocab_size],
            row_loss: vec![0.0; n],
            dropped: false,
        }
    }
}

impl Scratch {
    fn new(s: &Shapes, batch: usize) -> Self {
        let (n, c) = (batch * s.block_size, s.n_embd);
        Self {
            dres: vec![0.0; n * c],
            ln: vec![0.0; n * c],
            dln: vec![0.0; n * c],
            branch: vec![0.0; n * c],
            dy: vec![0.0; n * c],
            dqkv: vec![0.0; n * s.qkv_width],
            act: vec![0.0; n * s.mlp_hidden],
            dact: vec![0.0; n * s.mlp_hidden],
            dfc: vec![0.0; n * s.mlp_fc_width],
            attention: Vec::new(),
        }
    }
}
