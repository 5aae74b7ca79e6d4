//! The fused CUDA engine: the model's forward and backward written out over flat,
//! preallocated device buffers in llm.c's manner, the same walk as the fused CPU
//! engine (`crate::cpu::FusedCpu`), layer for layer.
//!
//! Parameters, gradients and AdamW's moments are one flat device buffer each, laid
//! out by the model spec; a layer's weights are an offset into it. Every activation
//! the backward needs is allocated once for (batch, block_size): a step allocates
//! nothing. [`Plan`] says how much that is (the memory check reads it), and building
//! the engine checks that it holds exactly that. Matrix products go to cuBLAS (strided batches
//! for attention's heads); everything else is our kernels (`kernels/*.cu`). Dropout
//! masks are never stored: each kernel that drops computes the mask of its elements
//! from the counter-based generator of `crate::model::dropout`, so forward and
//! backward (and the CPU engines) drop the same elements. Sums over rows (bias and
//! gain gradients, embedding gradients, the loss, the gradient norm) are added in a
//! fixed order, without atomics: the same batch gives the same bits, run after run.

use std::sync::Arc;

use anyhow::{ensure, Context, Result};
#[cfg(feature = "cuda")]
use candle_core::Device;

use super::blas::{
    fused, linear, linear_to_bf16, matmul, run_fused, Fused, Matrix, Product, Weights,
};
use super::buckets::Buckets;
use super::buffers::{Buf, Staging};
use super::calls::{Epilogue, Operands};
use super::gpu::{Gpu, Recording};
use super::kernels::{adamw_chunks, AdamBuffers, DropoutArgs, HeadView, Heads, In, NormRows, Out};
use super::plan::{partials_len, Attention, Plan, FLASH_MAX_HEAD, LOSS_SLOTS, LOSS_SUM, NORM_SQ};
use super::ranks::Ranks;
use super::tables::PositionTables;
use crate::config::{Math, MlpKind, Precision};
use crate::cpu::ops::Positions;
use crate::model::spec::{LinearParams, ModelSpec, NormParams, ParamId};
use crate::model::{Dropout, Site};
use crate::optim::AdamWStep;
use crate::parallel::Collective;
use crate::profile::Group;

/// A model laid out on the GPU for fused training.
pub struct FusedCuda {
    spec: ModelSpec,
    batch: usize,
    precision: Precision,
    /// f32 products on TF32 tensor cores (`train.tf32`).
    tf32: bool,
    /// Where the buffers live and the kernels run.
    gpu: Gpu,
    /// Only this thread may drive it.
    owner: super::gpu::OwnerThread,
    /// How attention is computed (flash tiles for bf16 where they apply).
    attention: Attention,
    /// What its products' epilogues do beside the products.
    epilogues: Epilogues,
    params: Buf<f32>,
    /// With bf16 products, what they read instead of f32 data (None with f32).
    bf16: Option<Bf16Operands>,
    /// Gradients, then AdamW's moments, allocated when first needed (evaluation needs
    /// neither).
    grads: Option<Buf<f32>>,
    moments: Option<[Buf<f32>; 2]>,
    /// AdamW's chunks over the whole table (`kernels::adamw_chunks`).
    adam_chunks: Buf<u64>,
    tables: PositionTables,
    acts: Activations,
    scratch: Scratch,
    /// The dropout of the last forward, whose masks the backward recomputes.
    dropout: Option<Dropout>,
    /// The last forward's rows bucketed by token (the embedding's backward).
    buckets: Buckets,
    /// Host memory the batches are uploaded through.
    staging: Staging,
    /// Forwards whose losses the device has summed, each in its slot, since the host
    /// last fetched them.
    unread_forwards: usize,
    /// Losses fetched from full slots that the trainer has not yet taken.
    fetched_losses: Vec<f64>,
    /// Whether a clip has measured the gradient norm.
    clipped: bool,
    /// This engine's rank in a data-parallel run (None: one process).
    ranks: Option<Ranks>,
    /// The forward's and the backward's launches, recorded once and replayed.
    graphs: Graphs,
}

/// A forward's and a backward's launches recorded at their first call and replayed
/// after (`Gpu::record`: a CUDA graph, one launch for the hundreds of kernels and
/// products a step makes, where a small model's step is mostly the host launching
/// them). Every pass of the engine launches the same work on the same buffers: what
/// changes between batches is in device memory (the batch, its buckets, the pass its
/// dropout masks are drawn for, the weights), the loss goes to its slot outside the
/// recording, and the rounding of changed weights runs before it. One recording for
/// each kind of pass (with or without dropout masks; a backward's loss scale, which its
/// products carry). Not while a profile times each launch.
#[derive(Default)]
struct Graphs {
    /// Off (`TINYGPT_CUDA_GRAPHS=0`, `without_graphs`, or a recording failed).
    off: bool,
    forward: Vec<(Option<Masks>, Recording)>,
    backward: Vec<((u32, Option<Masks>), Recording)>,
}

/// What a recorded pass's dropout masks are drawn with beside the pass itself: the
/// rate and the seed (their bits), fixed in its launches' arguments.
type Masks = (u64, u64);

/// The masks of a pass with `dropout` (none without).
fn masks(dropout: Option<&Dropout>) -> Option<Masks> {
    dropout.map(|d| (d.p.to_bits(), d.seed))
}

impl Graphs {
    /// Graphs as the environment allows them.
    fn from_env() -> Self {
        Self {
            off: std::env::var("TINYGPT_CUDA_GRAPHS").is_ok_and(|v| v == "0"),
            ..Self::default()
        }
    }

    /// Nothing recorded, on or off as before: after a change to what the passes do or
    /// to the buffers they read.
    fn forgotten(&self) -> Self {
        Self {
            off: self.off,
            ..Self::default()
        }
    }

    /// Keeps `recording` under `key`. A few kinds of pass at most are kept (with or
    /// without masks, a loss scale or two): a caller that varies the scale from step to
    /// step would otherwise record a graph a step.
    fn keep<K>(kept: &mut Vec<(K, Recording)>, key: K, recording: Recording) {
        const MOST: usize = 4;
        if kept.len() == MOST {
            kept.clear();
        }
        kept.push((key, recording));
    }

    /// Whether this pass replays (or records) rather than launching.
    fn apply(&self) -> bool {
        !self.off && !crate::profile::is_on() && !super::gpu::emulator_counts_only()
    }
}

/// What bf16 products read: the weights rounded to bf16 (the flat buffer's layout, so
/// the spec's offsets address it), rounded again before a forward whenever the f32
/// weights changed, and two buffers each product's f32 operands are rounded into
/// first. cuBLAS then runs its bf16 kernels on bf16 data, where f32 data with bf16
/// arithmetic (32F_FAST_16BF) reads twice the bytes and, on Hopper, cannot use its
/// bf16 loads; the same operands (rounded to nearest even) and f32 sums, up to the order
/// cuBLAS sums in.
struct Bf16Operands {
    weights: Buf<u16>,
    /// The f32 weights changed since `weights` was rounded from them.
    stale: std::cell::Cell<bool>,
    /// A layer's input rows (N x its widest input).
    inputs: Buf<u16>,
    /// A layer's output's gradient rows (N x its widest output: the logits').
    outputs: Buf<u16>,
}

impl Bf16Operands {
    /// Sized as `plan` says, with bf16 products; None with f32 ones.
    fn new(gpu: &Gpu, plan: &Plan) -> Result<Option<Self>> {
        let sizes = plan.bf16;
        if sizes.weights == 0 {
            return Ok(None);
        }
        Ok(Some(Self {
            weights: Buf::zeros(gpu, sizes.weights)?,
            stale: std::cell::Cell::new(true),
            inputs: Buf::zeros(gpu, sizes.inputs)?,
            outputs: Buf::zeros(gpu, sizes.outputs)?,
        }))
    }

    fn bytes(&self) -> u64 {
        self.weights.bytes() + self.inputs.bytes() + self.outputs.bytes()
    }
}

/// Rows a product reads (a layer's input, or its output's gradient): f32 values,
/// rounded into their bf16 operand buffer first where products are bf16; or bf16 rows
/// the kernel that made them wrote, rounded, at the address given.
#[derive(Debug, Clone, Copy)]
enum Rows {
    F32(u64),
    Bf16(u64),
    /// f32 rows (a bias's gradient sums them) whose rounding the kernel that made them
    /// also wrote, at the second address.
    Both(u64, u64),
}

impl From<u64> for Rows {
    fn from(f32: u64) -> Self {
        Rows::F32(f32)
    }
}

/// Where a layer's backward writes the gradient at its input: into rows, or, for an
/// MLP's down-projection, on through its GELU in the product's epilogue: the gradient
/// at block `block`'s GELU input, into `rows`.
#[derive(Debug, Clone, Copy)]
enum InputGradient {
    Rows(Rows),
    ThroughGelu { rows: Rows, block: usize },
}

impl<T: Into<Rows>> From<T> for InputGradient {
    fn from(rows: T) -> Self {
        InputGradient::Rows(rows.into())
    }
}

/// What the products' epilogues do (cuBLASLt on a GPU), where a kernel would read a
/// product's output back. With bf16 operands only, each where the device has an
/// algorithm for every block's call (`Gpu::fuses`); `TINYGPT_CUDA_EPILOGUES=0` keeps
/// the kernels (one GPU run times both).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Epilogues {
    /// The MLP expansion adds its bias and applies GPT-2's tanh GELU (cuBLASLt's; the
    /// erf GELU keeps its kernel), keeping the GELU's input for the backward.
    pub gelu: bool,
    /// The down-projection's input gradient times the GELU's slope at the kept input.
    /// Only with `gelu`: it reads what that kept.
    pub gelu_gradient: bool,
    /// The qkv product adds its bias before rounding q | k | v to bf16, where flash
    /// attention reads them in bf16 (elsewhere a kernel adds it to the bf16 rows).
    pub qkv_bias: bool,
}

/// Per row of a norm: mean (0 for RMSNorm) then 1 / std, each `rows` long.
struct Stats {
    buf: Buf<f32>,
    rows: usize,
}

impl Stats {
    fn new(gpu: &Gpu, rows: usize) -> Result<Self> {
        Ok(Self {
            buf: Buf::zeros(gpu, 2 * rows)?,
            rows,
        })
    }

    /// (mean, rstd) addresses.
    fn ptrs(&self) -> (u64, u64) {
        (self.buf.at(0), self.buf.at(self.rows))
    }
}

/// What one block's forward keeps for its backward. N = batch x block_size rows.
struct BlockActs {
    ln_1: Stats,
    /// (N, qkv width): q and k turned under RoPE (empty where `Kept16::qkv` holds
    /// them).
    qkv: Buf<f32>,
    /// (N, C): the heads' outputs side by side, before the projection (empty where
    /// `Kept16::y` holds them).
    y: Buf<f32>,
    /// (N, C): the residual stream after the attention sub-layer.
    res_2: Buf<f32>,
    ln_2: Stats,
    /// (N, fc width): the MLP's first projection, before its bias (the activation adds
    /// it) and non-linearity (empty with bf16 operands: `Kept16::fc` holds it).
    fc: Buf<f32>,
    /// (N, C): the block's output.
    res_3: Buf<f32>,
    /// (B H, T): each attention row's log-sum-exp (flash attention; empty otherwise).
    lse: Buf<f32>,
    /// With bf16 products, what the backward's products read, kept as the forward
    /// wrote it (empty otherwise).
    kept: Kept16,
}

/// A block's rows in bf16, as its forward wrote them, kept for the backward: its
/// weight gradients read the same operands, so nothing is recomputed or rounded again.
struct Kept16 {
    /// (N, C) each: the two norms' outputs.
    ln_1: Buf<u16>,
    ln_2: Buf<u16>,
    /// (N, hidden): the activation.
    act: Buf<u16>,
    /// (N, C): the heads' outputs, in bf16 only (flash attention writes them; empty
    /// otherwise).
    y: Buf<u16>,
    /// (N, fc width): the MLP's first projection, rounded as its product wrote it
    /// (autocast's product returns it so; with the GELU in its epilogue, its bias
    /// added), which the activation's backward reads.
    fc: Buf<u16>,
    /// (N, qkv width): q | k | v as their product wrote them (a bias added in its
    /// epilogue, or to the rounded rows), where flash attention (which reads its
    /// heads in bf16 either way) is all that reads them: no rotary positions
    /// (`plan::qkv_in_bf16`; empty otherwise).
    qkv: Buf<u16>,
}

impl Kept16 {
    fn bytes(&self) -> u64 {
        [
            &self.ln_1, &self.ln_2, &self.act, &self.y, &self.fc, &self.qkv,
        ]
        .iter()
        .map(|b| b.bytes())
        .sum()
    }
}

/// The batch and what the forward keeps outside the blocks.
struct Activations {
    ids: Buf<u32>,
    targets: Buf<u32>,
    /// The batch's rows bucketed by token: distinct tokens, where each one's rows
    /// start in `order`, and the rows sorted by token.
    tokens: Buf<u32>,
    starts: Buf<u32>,
    order: Buf<u32>,
    /// The pass's micro-batch and step, which its dropout masks are drawn for.
    pass: Buf<u32>,
    /// (N, C): the embeddings entering the first block (after dropout).
    x0: Buf<f32>,
    blocks: Vec<BlockActs>,
    /// (N, C): the final norm's output, and its statistics.
    ln_f: Buf<f32>,
    ln_f_stats: Stats,
    /// (N, V): logits, then probabilities, then their gradient.
    logits: Buf<f32>,
    /// (N): each position's loss.
    row_loss: Buf<f32>,
}

/// Work space every block shares.
struct Scratch {
    /// (N, C): the gradient flowing down the residual stream.
    dres: Buf<f32>,
    /// (N, C): a norm's output (recomputed in the backward), and its gradient.
    ln: Buf<f32>,
    dln: Buf<f32>,
    /// (N, C): a branch's output before the residual add (or its gradient after
    /// dropout); with bf16 operands the forward's is bf16, as its product writes it.
    branch: Buf<f32>,
    branch16: Buf<u16>,
    /// (N, C): the gradient at a norm's output, as a product's backward writes it (bf16
    /// with bf16 operands).
    dln16: Buf<u16>,
    /// (N, C): the attention output's gradient: f32, or (flash attention with bf16
    /// operands) bf16 as its product writes it, which flash reads so.
    dy: Buf<f32>,
    dy16: Buf<u16>,
    dqkv: Buf<f32>,
    /// (N, hidden): the MLP's activations (recomputed in the backward), their gradient
    /// (both empty with bf16 operands, whose products write the gradient in bf16 into
    /// `dact16`).
    act: Buf<f32>,
    dact: Buf<f32>,
    dact16: Buf<u16>,
    /// (N, fc width): the gradient at the MLP's first projection.
    dfc: Buf<f32>,
    /// (B, H, T, d) each: the heads in the layout of the batched products, the heads'
    /// outputs (or their gradient), and the heads' gradients.
    q: Buf<f32>,
    k: Buf<f32>,
    v: Buf<f32>,
    heads: Buf<f32>,
    dq: Buf<f32>,
    dk: Buf<f32>,
    dv: Buf<f32>,
    /// (B, H, T, T): the attention weights, and their gradient (the products path;
    /// empty for flash attention).
    att: Buf<f32>,
    datt: Buf<f32>,
    /// (B H, T): each attention row's dY . Y (flash attention; empty otherwise).
    dsum: Buf<f32>,
    /// Column partial sums (PARTS rows).
    partials: Buf<f32>,
    /// f64: NORM_BLOCKS partial sums, then the squared gradient norm and the loss
    /// sum (`NORM_SQ`, `LOSS_SUM`).
    sums: Buf<f64>,
}

impl FusedCuda {
    /// The model `spec` with weights `values` (a flat buffer in table order) on the
    /// CUDA device `device`, for batches of `batch` sequences of block_size tokens.
    #[cfg(feature = "cuda")]
    pub fn new(
        spec: &ModelSpec,
        values: &[f32],
        device: &Device,
        batch: usize,
        precision: Precision,
    ) -> Result<Self> {
        let gpu = Gpu::cuda(device, "the fused CUDA engine")?;
        let attention = Attention::choose(&spec.shapes, precision, batch);
        Self::with_attention(gpu, spec, values, batch, precision, attention)
    }

    /// The same engine with its kernels run on the CPU by the emulator (tests).
    #[cfg(feature = "cuda-emulator")]
    pub fn emulated(
        spec: &ModelSpec,
        values: &[f32],
        batch: usize,
        precision: Precision,
    ) -> Result<Self> {
        let attention = Attention::choose(&spec.shapes, precision, batch);
        Self::with_attention(Gpu::Emulated, spec, values, batch, precision, attention)
    }

    /// The engine on `gpu` with attention computed as `attention` (tests hold the two
    /// ways to each other).
    pub fn with_attention(
        gpu: Gpu,
        spec: &ModelSpec,
        values: &[f32],
        batch: usize,
        precision: Precision,
        attention: Attention,
    ) -> Result<Self> {
        assert_eq!(values.len(), spec.len(), "a flat buffer of the whole table");
        ensure!(
            attention == Attention::Products
                || Attention::flash_holds(&spec.shapes, precision, batch),
            "flash attention needs bf16, a head of 16 to {FLASH_MAX_HEAD} in steps of 16 \
             and at most 65,535 heads in a batch"
        );
        gpu.bind()?;
        let s = &spec.shapes;
        let (n, c) = (batch * s.block_size, s.n_embd);
        let zeros = |len: usize| Buf::<f32>::zeros(&gpu, len);

        let rows_of_heads = batch * s.n_head * s.block_size;
        let (lse_len, dsum_len, scores) = match attention {
            Attention::Flash => (rows_of_heads, rows_of_heads, 0),
            Attention::Products => (0, 0, rows_of_heads * s.block_size),
        };
        let tables = PositionTables::new(&gpu, spec)?;
        let table = spec.params();
        let chunks = adamw_chunks(table, 0..spec.len());
        let plan = Plan::for_spec(spec, batch, attention, precision);

        // What the work space holds in f32 depends on the precision and the attention
        // (`Plan::new`).
        let unless_copies = |values: usize| if plan.copies() { 0 } else { values };
        let f32_fc = unless_copies(n * s.mlp_fc_width);
        let products = attention == Attention::Products;
        let split_heads = if products { n * c } else { 0 };
        let head_grads = if products || s.n_kv_head != s.n_head {
            n * c
        } else {
            0
        };
        let blocks = (0..s.n_layer)
            .map(|_| {
                Ok(BlockActs {
                    ln_1: Stats::new(&gpu, n)?,
                    qkv: zeros(if plan.bf16.kept.qkv > 0 {
                        0
                    } else {
                        n * s.qkv_width
                    })?,
                    y: zeros(if plan.bf16.kept.y > 0 { 0 } else { n * c })?,
                    res_2: zeros(n * c)?,
                    ln_2: Stats::new(&gpu, n)?,
                    fc: zeros(f32_fc)?,
                    res_3: zeros(n * c)?,
                    lse: zeros(lse_len)?,
                    kept: Kept16 {
                        ln_1: Buf::zeros(&gpu, plan.bf16.kept.ln)?,
                        ln_2: Buf::zeros(&gpu, plan.bf16.kept.ln)?,
                        act: Buf::zeros(&gpu, plan.bf16.kept.act)?,
                        y: Buf::zeros(&gpu, plan.bf16.kept.y)?,
                        fc: Buf::zeros(&gpu, plan.bf16.kept.fc)?,
                        qkv: Buf::zeros(&gpu, plan.bf16.kept.qkv)?,
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let ids = |len: usize| Buf::<u32>::zeros(&gpu, len);
        let acts = Activations {
            ids: ids(n)?,
            targets: ids(n)?,
            tokens: ids(n)?,
            starts: ids(n + 1)?,
            order: ids(n)?,
            pass: ids(2)?,
            x0: zeros(n * c)?,
            blocks,
            ln_f: zeros(n * c)?,
            ln_f_stats: Stats::new(&gpu, n)?,
            logits: zeros(Plan::f32_logits(n, s.vocab_size, precision))?,
            row_loss: zeros(n)?,
        };
        let widest = c.max(s.qkv_width).max(s.mlp_fc_width);
        let scratch = Scratch {
            dres: zeros(n * c)?,
            ln: zeros(unless_copies(n * c))?,
            dln: zeros(unless_copies(n * c))?,
            branch: zeros(n * c)?,
            dy: zeros(if plan.bf16.dy > 0 { 0 } else { n * c })?,
            dy16: Buf::zeros(&gpu, plan.bf16.dy)?,
            dqkv: zeros(n * s.qkv_width)?,
            act: zeros(unless_copies(n * s.mlp_hidden))?,
            dact: zeros(unless_copies(n * s.mlp_hidden))?,
            dact16: Buf::zeros(&gpu, plan.bf16.dact)?,
            branch16: Buf::zeros(&gpu, plan.bf16.branch)?,
            dln16: Buf::zeros(&gpu, plan.bf16.dln)?,
            dfc: zeros(n * s.mlp_fc_width)?,
            q: zeros(split_heads)?,
            k: zeros(split_heads)?,
            v: zeros(split_heads)?,
            heads: zeros(split_heads)?,
            dq: zeros(head_grads)?,
            dk: zeros(head_grads)?,
            dv: zeros(head_grads)?,
            att: zeros(scores)?,
            datt: zeros(scores)?,
            dsum: zeros(dsum_len)?,
            partials: zeros(partials_len(c, widest))?,
            sums: Buf::zeros(&gpu, LOSS_SUM + LOSS_SLOTS)?,
        };
        let engine = Self {
            owner: super::gpu::OwnerThread::here(),
            params: Buf::from_host(&gpu, values)?,
            bf16: Bf16Operands::new(&gpu, &plan)?,
            grads: None,
            moments: None,
            adam_chunks: Buf::from_host(&gpu, &chunks)?,
            tables,
            acts,
            scratch,
            dropout: None,
            buckets: Buckets::default(),
            staging: Staging::new(&gpu, plan.ids)?,
            unread_forwards: 0,
            fetched_losses: Vec::new(),
            clipped: false,
            ranks: None,
            graphs: Graphs::from_env(),
            spec: spec.clone(),
            batch,
            precision,
            tf32: false,
            attention,
            epilogues: Epilogues::default(),
            gpu,
        };
        let plan = plan.bytes(s.n_layer, false);
        ensure!(
            engine.bytes_held() == plan,
            "the fused CUDA engine holds {} bytes, its allocation plan says {plan}",
            engine.bytes_held()
        );
        let mut engine = engine;
        engine.epilogues = engine.choose_epilogues();
        Ok(engine)
    }

    /// Device bytes of every buffer the engine holds (the plan's total, checked when
    /// it is built).
    fn bytes_held(&self) -> u64 {
        let (a, sc, t) = (&self.acts, &self.scratch, &self.tables);
        let blocks: u64 = a
            .blocks
            .iter()
            .map(|b| {
                b.ln_1.buf.bytes()
                    + b.qkv.bytes()
                    + b.y.bytes()
                    + b.res_2.bytes()
                    + b.ln_2.buf.bytes()
                    + b.fc.bytes()
                    + b.res_3.bytes()
                    + b.lse.bytes()
                    + b.kept.bytes()
            })
            .sum();
        let outside = [&a.x0, &a.ln_f, &a.ln_f_stats.buf, &a.logits, &a.row_loss]
            .iter()
            .map(|b| b.bytes())
            .sum::<u64>();
        let ids = [&a.ids, &a.targets, &a.tokens, &a.starts, &a.order, &a.pass]
            .iter()
            .map(|b| b.bytes())
            .sum::<u64>();
        let scratch = [
            &sc.dres,
            &sc.ln,
            &sc.dln,
            &sc.branch,
            &sc.dy,
            &sc.dqkv,
            &sc.act,
            &sc.dact,
            &sc.dfc,
            &sc.q,
            &sc.k,
            &sc.v,
            &sc.heads,
            &sc.dq,
            &sc.dk,
            &sc.dv,
            &sc.att,
            &sc.datt,
            &sc.dsum,
            &sc.partials,
        ]
        .iter()
        .map(|b| b.bytes())
        .sum::<u64>()
            + [&sc.dact16, &sc.dy16, &sc.branch16, &sc.dln16]
                .iter()
                .map(|b| b.bytes())
                .sum::<u64>();
        let optimiser = self.grads.iter().chain(self.moments.iter().flatten());
        let flat = std::iter::once(&self.params).chain(optimiser);
        blocks
            + outside
            + ids
            + scratch
            + flat.map(|b| b.bytes()).sum::<u64>()
            + t.bytes()
            + sc.sums.bytes()
            + self.adam_chunks.bytes()
            + self.bf16.as_ref().map_or(0, Bf16Operands::bytes)
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    pub fn batch(&self) -> usize {
        self.batch
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The engine with its f32 products on TF32 tensor cores (`on`), or exact f32.
    /// bf16 products stay bf16.
    pub fn with_tf32(mut self, on: bool) -> Self {
        self.tf32 = on;
        self.graphs = self.graphs.forgotten();
        self
    }

    /// The same engine with no work in the products' epilogues: its kernels do it
    /// (tests hold the two to each other).
    pub fn without_epilogues(mut self) -> Self {
        self.epilogues = Epilogues::default();
        self.graphs = self.graphs.forgotten();
        self
    }

    /// The same engine launching every kernel of every pass, none recorded (tests hold
    /// the two to each other).
    pub fn without_graphs(mut self) -> Self {
        self.graphs = Graphs {
            off: true,
            ..Graphs::default()
        };
        self
    }

    /// Whether its passes replay recorded launches (CUDA graphs) where they can.
    pub fn graphs(&self) -> bool {
        !self.graphs.off && !super::gpu::emulator_counts_only()
    }

    /// What the products' epilogues do.
    pub fn epilogues(&self) -> Epilogues {
        self.epilogues
    }

    /// How its products multiply.
    pub fn math(&self) -> Math {
        self.precision.math(self.tf32)
    }

    pub fn attention(&self) -> Attention {
        self.attention
    }

    /// Whether its bf16 products read bf16 copies of their operands.
    pub fn bf16_operands(&self) -> bool {
        self.bf16.is_some()
    }

    /// How a profile times this engine's work and the peak it is held to.
    pub fn profiled(&self) -> Result<crate::profile::Profiled> {
        self.bind()?;
        super::peak::profiled(&self.gpu, self.math())
    }

    fn rows(&self) -> usize {
        self.batch * self.spec.shapes.block_size
    }

    /// Makes the engine's CUDA context current on this thread: cuBLAS calls and raw
    /// driver calls need it (cudarc's own calls bind it themselves). The engine's work
    /// goes to the stream of the thread that built it, so only that thread may.
    fn bind(&self) -> Result<()> {
        self.owner.check("the fused CUDA engine")?;
        self.gpu.bind()
    }

    fn heads(&self) -> Heads {
        let s = &self.spec.shapes;
        Heads {
            batch: self.batch,
            t: s.block_size,
            heads: s.n_head,
            kv_heads: s.n_kv_head,
            d: s.head_dim,
        }
    }

    /// The address of parameter `id`'s weights.
    fn w(&self, id: ParamId) -> u64 {
        self.params.at(self.spec[id].offset)
    }

    fn w_opt(&self, id: Option<ParamId>) -> u64 {
        id.map_or(0, |id| self.w(id))
    }

    /// The address of parameter `id`'s gradient.
    fn g(&self, id: ParamId) -> u64 {
        self.grads
            .as_ref()
            .expect("gradients allocated before a backward")
            .at(self.spec[id].offset)
    }

    fn g_opt(&self, id: Option<ParamId>) -> u64 {
        id.map_or(0, |id| self.g(id))
    }

    /// Mean cross-entropy of `targets` given `ids`, both (batch, block_size) row-major,
    /// with `dropout` when training, added on the device to the losses `take_loss`
    /// reads. Keeps what the backward needs.
    pub fn forward(
        &mut self,
        ids: &[u32],
        targets: &[u32],
        dropout: Option<&Dropout>,
    ) -> Result<()> {
        self.bind()?;
        let n = self.rows();
        ensure!(
            ids.len() == n && targets.len() == n,
            "a batch of (batch, block_size)"
        );
        let v = self.spec.shapes.vocab_size;
        ensure!(
            ids.iter().chain(targets).all(|&id| (id as usize) < v),
            "a token id beyond the vocabulary of {v}"
        );
        self.upload_batch(ids, targets, dropout)?;
        self.round_weights()?;
        self.dropout = dropout.copied();
        if self.graphs.apply() {
            let key = masks(dropout);
            if !self.graphs.forward.iter().any(|(k, _)| *k == key) {
                if let Some(graph) = self.record(|e| e.forward_launches()) {
                    Graphs::keep(&mut self.graphs.forward, key, graph);
                }
            }
            match self.graphs.forward.iter().find(|(k, _)| *k == key) {
                Some((_, forward)) => self.gpu.replay(forward)?,
                None => self.forward_launches()?,
            }
        } else {
            self.forward_launches()?;
        }
        // Summed where they are, each forward in its slot, so the host waits for
        // nothing until it reads them.
        if self.unread_forwards == LOSS_SLOTS {
            self.fetch_losses()?;
        }
        let total = self.scratch.sums.at(LOSS_SUM + self.unread_forwards);
        let losses = self.acts.row_loss.ptr();
        self.gpu.sum_losses(total, losses, n)?;
        self.unread_forwards += 1;
        Ok(())
    }

    /// `work`'s launches recorded, or None where recording failed: said once, and the
    /// passes launch their kernels one by one from then on.
    fn record(&mut self, work: impl FnOnce(&Self) -> Result<()>) -> Option<Recording> {
        match self.gpu.record(|| work(self)) {
            Ok(recording) => Some(recording),
            Err(e) => {
                crate::errln!(
                    "note: training launches each kernel (recording a pass failed: {e:#})"
                );
                self.graphs.off = true;
                None
            }
        }
    }

    /// The forward's launches, after the batch is on the device: the embeddings, the
    /// blocks, the logits, each row's loss.
    fn forward_launches(&self) -> Result<()> {
        let n = self.rows();
        let s = self.spec.shapes;
        let (t, c) = (s.block_size, s.n_embd);

        let positions = self.tables.added(&self.spec, &self.params);
        let a = &self.acts;
        self.gpu.embedding_forward(
            a.x0.ptr(),
            a.ids.ptr(),
            self.w(self.spec.wte),
            positions,
            n,
            Positions::from_start(t),
            c,
            self.mask(Site::Embedding),
        )?;
        for l in 0..s.n_layer {
            self.block_forward(l)?;
        }
        // The last block normed its output (ln_f) as it added its residual.
        let a = &self.acts;
        let (_, input) = self.final_norm_output();
        let output = self.spec.output_layer();
        let logits = match &self.bf16 {
            // With bf16 operand copies the logits are written in bf16 into the buffer
            // the output layer's backward products read, and the loss's gradient
            // overwrites them there, rounded: no f32 logits at all.
            Some(b) => {
                let x16 = self.rounded(input, output.d_in, &b.inputs)?;
                let at = b.outputs.ptr();
                linear_to_bf16(&self.gpu, (&b.weights, &self.spec), at, x16, &output, n)?;
                (In::Bf16(at), at)
            }
            None => {
                self.linear_forward(a.logits.ptr(), input, &output)?;
                let round = self.precision == Precision::Bf16;
                (
                    In::F32 {
                        at: a.logits.ptr(),
                        round,
                    },
                    0,
                )
            }
        };
        let losses = a.row_loss.ptr();
        self.gpu
            .softmax_cross_entropy(logits, losses, a.targets.ptr(), n, s.vocab_size)
    }

    /// Moves the losses in the device's slots to `fetched_losses` (waits for the
    /// device).
    fn fetch_losses(&mut self) -> Result<()> {
        let forwards = std::mem::take(&mut self.unread_forwards);
        let slots = LOSS_SUM..LOSS_SUM + forwards;
        let sums = self.scratch.sums.read_range(&self.gpu, slots)?;
        let rows = self.rows() as f64;
        self.fetched_losses
            .extend(sums.iter().map(|sum| sum / rows));
        Ok(())
    }

    /// Each forward's mean loss since the last call, in order (waits for the device).
    pub fn take_losses(&mut self) -> Result<Vec<f64>> {
        self.fetch_losses()?;
        Ok(std::mem::take(&mut self.fetched_losses))
    }

    /// The batch to the device, with its rows bucketed by token for the embedding's
    /// backward (rows sorted by token, stably, so each token's rows add in order).
    fn upload_batch(
        &mut self,
        ids: &[u32],
        targets: &[u32],
        dropout: Option<&Dropout>,
    ) -> Result<()> {
        self.buckets.fill(ids, self.spec.shapes.vocab_size);
        let (a, b) = (&mut self.acts, &self.buckets);
        let pass = dropout.map_or([0, 0], |d| [d.micro, d.step]);
        self.staging.upload(
            &self.gpu,
            &mut [
                (&mut a.ids, ids),
                (&mut a.targets, targets),
                (&mut a.tokens, &b.tokens),
                (&mut a.starts, &b.starts),
                (&mut a.order, &b.order),
                (&mut a.pass, &pass),
            ],
        )
    }

    /// The dropout mask of `site` in this pass (none without dropout), its pass read
    /// from the device.
    fn mask(&self, site: Site) -> DropoutArgs {
        match &self.dropout {
            Some(d) => DropoutArgs::at(Some(d), site).reading_pass(self.acts.pass.ptr()),
            None => DropoutArgs::NONE,
        }
    }

    /// Block `l`: res_2 = x + attention(ln_1(x)); res_3 = res_2 + mlp(ln_2(res_2)).
    /// Each residual add also norms its sum for what reads it next (`residual_norm`):
    /// ln_2 here, and the next block's ln_1 or the final norm at the end; so only the
    /// first block norms its input itself.
    fn block_forward(&self, l: usize) -> Result<()> {
        let (s, k, sc) = (&self.spec.shapes, &self.gpu, &self.scratch);
        let n = self.rows();
        let p = &self.spec.blocks[l];
        let a = &self.acts.blocks[l];
        let x = self.block_input(l);

        // Attention: q | k | v of the normed input, positions turned in, heads attend,
        // their outputs projected back into the residual stream.
        let (ln_1, normed_1) = self.kept_rows(sc.ln.ptr(), &a.kept.ln_1);
        if l == 0 {
            self.norm_forward(ln_1, &a.ln_1, x, &p.ln_1)?;
        }
        match (&self.bf16, a.kept.qkv.len()) {
            (Some(b), 1..) => {
                let x16 = self.rounded(normed_1, p.attn_qkv.d_in, &b.inputs)?;
                self.qkv_to_bf16(l, x16)?;
            }
            _ => self.linear_forward(a.qkv.ptr(), normed_1, &p.attn_qkv)?,
        }
        if let Some(tables) = self.tables.rope() {
            let at = Positions::from_start(s.block_size);
            k.rope(a.qkv.ptr(), tables, n, at, self.heads(), s.qkv_width, 1.0)?;
        }
        self.attention_forward(l, a.y.ptr())?;
        let branch = self.branch_forward(self.heads_output(l), &p.attn_proj)?;
        let mask = self.mask(Site::AttentionOutput(l));
        let residual = (a.res_2.ptr(), x, branch, mask);
        let (ln_2, normed_2) = self.kept_rows(sc.ln.ptr(), &a.kept.ln_2);
        self.residual_norm(residual, ln_2, &a.ln_2, &p.ln_2)?;

        // MLP: expand, non-linearity (in the expansion's epilogue, or a kernel), project
        // back.
        self.mlp_expand(l, normed_2)?;
        let kind = self.spec.config.mlp;
        let (act, activated) = self.kept_rows(sc.act.ptr(), &a.kept.act);
        if !self.epilogues.gelu {
            k.activation_forward(act, self.pre_activation(l), n, s.mlp_hidden, kind)?;
        }
        let branch = self.branch_forward(activated, &p.mlp_proj)?;
        let mask = self.mask(Site::MlpOutput(l));
        let residual = (a.res_3.ptr(), a.res_2.ptr(), branch, mask);
        match self.acts.blocks.get(l + 1) {
            Some(next) => {
                let (ln_1, _) = self.kept_rows(sc.ln.ptr(), &next.kept.ln_1);
                self.residual_norm(residual, ln_1, &next.ln_1, &self.spec.blocks[l + 1].ln_1)
            }
            None => {
                let (ln_f, _) = self.final_norm_output();
                let stats = &self.acts.ln_f_stats;
                self.residual_norm(residual, ln_f, stats, &self.spec.ln_f)
            }
        }
    }

    /// Block `l`'s MLP's first projection of its normed input: without the bias (the
    /// activation adds it; `pre_activation` says where it is), or with the bias and the
    /// GELU in its epilogue.
    fn mlp_expand(&self, l: usize, x: Rows) -> Result<()> {
        let a = &self.acts.blocks[l];
        let p = &self.spec.blocks[l].mlp_fc;
        match &self.bf16 {
            Some(b) if self.epilogues.gelu => {
                let x16 = self.rounded(x, p.d_in, &b.inputs)?;
                run_fused(
                    &self.gpu,
                    Group::Product(p.role),
                    &self.gelu_forward(l, x16)?,
                )
            }
            _ => {
                self.product_output((a.fc.ptr(), a.kept.fc.ptr()), x, p)?;
                Ok(())
            }
        }
    }

    /// Block `l`'s MLP expansion of the bf16 rows `x16` with the GELU in its epilogue:
    /// the activation into the kept `act`, its input (the bias added) into the kept
    /// `fc`, both bf16.
    fn gelu_forward(&self, l: usize, x16: u64) -> Result<Fused> {
        let (p, a, n) = (
            &self.spec.blocks[l].mlp_fc,
            &self.acts.blocks[l],
            self.rows(),
        );
        let b = self
            .bf16
            .as_ref()
            .context("GELU epilogues need bf16 operands")?;
        let w = b.weights.at(self.spec[p.weight].offset);
        let epilogue = Epilogue::GeluAux {
            bias: self.bias16(p.bias),
            aux: a.kept.fc.ptr(),
        };
        fused(
            (
                Product::Bf16(Matrix::new(a.kept.act.ptr(), n, p.d_out)),
                epilogue,
            ),
            Matrix::new(x16, n, p.d_in).n(),
            Matrix::new(w, p.d_out, p.d_in).t(),
        )
    }

    /// The gradient at block `l`'s GELU input from the MLP output's gradient `dout16`
    /// (bf16): the down-projection's input gradient times the GELU's slope at the
    /// input the forward kept, in the product's epilogue, into `dfc`.
    fn gelu_backward(&self, l: usize, dfc: Rows, dout16: u64) -> Result<Fused> {
        let (p, n) = (&self.spec.blocks[l].mlp_proj, self.rows());
        let b = self
            .bf16
            .as_ref()
            .context("GELU epilogues need bf16 operands")?;
        let w = b.weights.at(self.spec[p.weight].offset);
        let c = match dfc {
            Rows::F32(at) => Product::F32(Matrix::new(at, n, p.d_in)),
            Rows::Bf16(at) => Product::Bf16(Matrix::new(at, n, p.d_in)),
            Rows::Both(..) => anyhow::bail!("an epilogue writes one precision"),
        };
        let aux = self.acts.blocks[l].kept.fc.ptr();
        fused(
            (c, Epilogue::GeluBackward { aux }),
            Matrix::new(dout16, n, p.d_out).n(),
            Matrix::new(w, p.d_out, p.d_in).n(),
        )
    }

    /// Where the GELU backward's epilogue writes the gradient at the MLP expansion's
    /// output: bf16, in the activation gradient's buffer (the products' own
    /// output-gradient buffer holds the product's input), which the expansion's
    /// backward products and its bias gradient read.
    fn gelu_input_gradient(&self) -> Rows {
        Rows::Bf16(self.scratch.dact16.ptr())
    }

    /// What the products' epilogues take on (`Epilogues`): each where every block's
    /// call runs on this device.
    fn choose_epilogues(&self) -> Epilogues {
        let off = Epilogues::default();
        let asked = std::env::var("TINYGPT_CUDA_EPILOGUES").map_or(true, |v| v != "0");
        let Some(b) = self.bf16.as_ref().filter(|_| asked) else {
            return off;
        };
        // `Gpu::fuses` says no where cuBLASLt does not document a call (a bias off 16
        // bytes, say) or has no algorithm for it.
        let runs = |product: Result<Fused>| product.is_ok_and(|p| self.gpu.fuses(p.call()));
        let blocks = &self.spec.blocks;
        let every =
            |call: &dyn Fn(usize) -> Result<Fused>| (0..blocks.len()).all(|l| runs(call(l)));
        let gelu = self.spec.config.mlp == MlpKind::GeluTanh
            && every(&|l| self.gelu_forward(l, b.inputs.ptr()));
        let dfc = self.gelu_input_gradient();
        let gelu_gradient = gelu && every(&|l| self.gelu_backward(l, dfc, b.outputs.ptr()));
        let qkv_bias = self.acts.blocks.iter().all(|a| a.kept.qkv.len() > 0)
            && blocks.iter().all(|p| p.attn_qkv.bias.is_some())
            && every(&|l| self.qkv_with_bias(l, b.inputs.ptr()));
        Epilogues {
            gelu,
            gelu_gradient,
            qkv_bias,
        }
    }

    /// Where a bias's bf16 copy is (among the weights' bf16 copy, which AdamW writes;
    /// 0 without a bias or bf16 operands): a product epilogue's bias is bf16 beside a
    /// bf16 output, as cuBLASLt documents and autocast rounds it.
    fn bias16(&self, bias: Option<ParamId>) -> u64 {
        match (bias, &self.bf16) {
            (Some(id), Some(b)) => b.weights.at(self.spec[id].offset),
            _ => 0,
        }
    }

    /// Block `l`'s q | k | v from the bf16 rows `x16`, its bias (bf16) added in the
    /// product's epilogue, rounded to bf16 into the kept `qkv`.
    fn qkv_with_bias(&self, l: usize, x16: u64) -> Result<Fused> {
        let (p, n) = (&self.spec.blocks[l].attn_qkv, self.rows());
        let b = self.bf16.as_ref().context("epilogues need bf16 operands")?;
        ensure!(p.bias.is_some(), "a bias epilogue of a layer without one");
        let w = b.weights.at(self.spec[p.weight].offset);
        let out = self.acts.blocks[l].kept.qkv.ptr();
        fused(
            (
                Product::Bf16(Matrix::new(out, n, p.d_out)),
                Epilogue::Bias {
                    bias: self.bias16(p.bias),
                },
            ),
            Matrix::new(x16, n, p.d_in).n(),
            Matrix::new(w, p.d_out, p.d_in).t(),
        )
    }

    /// Block `l`'s q | k | v from the bf16 rows `x16`, written in bf16 into the kept
    /// `qkv`, where flash attention alone reads them: the bias added in the product's
    /// epilogue, or without one there by a kernel to the rounded rows (which rounds
    /// again).
    fn qkv_to_bf16(&self, l: usize, x16: u64) -> Result<()> {
        let p = &self.spec.blocks[l].attn_qkv;
        if self.epilogues.qkv_bias {
            return run_fused(
                &self.gpu,
                Group::Product(p.role),
                &self.qkv_with_bias(l, x16)?,
            );
        }
        let b = self
            .bf16
            .as_ref()
            .context("bf16 q | k | v need bf16 operands")?;
        let (out, n) = (self.acts.blocks[l].kept.qkv.ptr(), self.rows());
        let weights_only = LinearParams { bias: None, ..*p };
        linear_to_bf16(
            &self.gpu,
            (&b.weights, &self.spec),
            out,
            x16,
            &weights_only,
            n,
        )?;
        match p.bias {
            Some(bias) => self.gpu.add_bias16(out, self.w(bias), n, p.d_out),
            None => Ok(()),
        }
    }

    /// A sub-layer's branch: its projection of `x`, without the bias, which the
    /// residual add adds (returned beside it).
    fn branch_forward(&self, x: Rows, p: &LinearParams) -> Result<(In, u64)> {
        let sc = &self.scratch;
        let branch = self.product_output((sc.branch.ptr(), sc.branch16.ptr()), x, p)?;
        Ok((branch, self.w_opt(p.bias)))
    }

    /// x Wᵀ of layer `p`, its bias left to the kernel that reads it: with bf16
    /// operands written in bf16 at `out16` (autocast's product returns it so),
    /// otherwise in f32 at `out32`, read rounded in bf16 training (the same numbers).
    fn product_output(&self, (out32, out16): (u64, u64), x: Rows, p: &LinearParams) -> Result<In> {
        let weights_only = LinearParams { bias: None, ..*p };
        match &self.bf16 {
            Some(b) => {
                let x16 = self.rounded(x, p.d_in, &b.inputs)?;
                let copy = (&b.weights, &self.spec);
                linear_to_bf16(&self.gpu, copy, out16, x16, &weights_only, self.rows())?;
                Ok(In::Bf16(out16))
            }
            None => {
                self.linear_forward(out32, x, &weights_only)?;
                Ok(self.f32_rows(out32))
            }
        }
    }

    /// f32 rows a product wrote, as a kernel reads them: rounded to bf16 in bf16
    /// training (where the product's bf16 output would have been), as they are in f32.
    fn f32_rows(&self, at: u64) -> In {
        In::F32 {
            at,
            round: self.precision == Precision::Bf16,
        }
    }

    /// Where a product's backward writes the gradient at a norm's output and the
    /// norm's backward reads it: bf16 with bf16 operands, f32 otherwise.
    fn norm_output_gradient(&self) -> (Rows, In) {
        let sc = &self.scratch;
        match self.bf16 {
            Some(_) => (Rows::Bf16(sc.dln16.ptr()), In::Bf16(sc.dln16.ptr())),
            None => (Rows::F32(sc.dln.ptr()), self.f32_rows(sc.dln.ptr())),
        }
    }

    /// Where the activation of block `l` reads its input: the MLP's first projection
    /// (bf16 in bf16 training: kept so, or rounded as read where products round on the
    /// fly) and its bias.
    fn pre_activation(&self, l: usize) -> (In, u64) {
        let a = &self.acts.blocks[l];
        let fc = match self.bf16 {
            Some(_) => In::Bf16(a.kept.fc.ptr()),
            None => self.f32_rows(a.fc.ptr()),
        };
        // The forward's epilogue kept it with the bias added.
        let bias = match self.epilogues.gelu {
            true => 0,
            false => self.w_opt(self.spec.blocks[l].mlp_fc.bias),
        };
        (fc, bias)
    }

    /// Where a block's forward writes rows its products read (a norm's output, the
    /// activation) and how they find them: with bf16 products, rounded into the
    /// block's own buffer `kept16`, which its backward's products read again; with f32
    /// products, the f32 work space `f32` (the backward recomputes them).
    fn kept_rows(&self, f32: u64, kept16: &Buf<u16>) -> (Out, Rows) {
        match self.bf16 {
            Some(_) => (
                Out {
                    f32: 0,
                    bf16: kept16.ptr(),
                },
                Rows::Bf16(kept16.ptr()),
            ),
            None => (Out::f32(f32), Rows::F32(f32)),
        }
    }

    /// A norm's output for block `l`'s backward products: kept from the forward with
    /// bf16 products, recomputed into the f32 work space from x and the statistics
    /// with f32 ones.
    fn norm_output_again(
        &self,
        kept16: &Buf<u16>,
        (stats, x, p): (&Stats, u64, &NormParams),
    ) -> Result<Rows> {
        if self.bf16.is_some() {
            return Ok(Rows::Bf16(kept16.ptr()));
        }
        let ln = self.scratch.ln.ptr();
        self.norm_apply(Out::f32(ln), stats, x, p)?;
        Ok(Rows::F32(ln))
    }

    /// Block `l`'s heads' output as its projection reads it: f32 rows, or (flash
    /// attention with bf16 products) bf16 rows, which the flash kernel wrote.
    fn heads_output(&self, l: usize) -> Rows {
        let a = &self.acts.blocks[l];
        match a.kept.y.len() {
            0 => Rows::F32(a.y.ptr()),
            _ => Rows::Bf16(a.kept.y.ptr()),
        }
    }

    /// Where block `l`'s backward writes the gradient at its heads' output (the
    /// projection's backward product) and attention reads it: bf16 where the block
    /// keeps its heads' output in bf16, f32 otherwise (flash attention reads f32
    /// rounded, as products rounding on the fly do).
    fn heads_output_gradient(&self, l: usize) -> (Rows, In) {
        let sc = &self.scratch;
        match self.acts.blocks[l].kept.y.len() {
            0 => (Rows::F32(sc.dy.ptr()), self.f32_rows(sc.dy.ptr())),
            _ => (Rows::Bf16(sc.dy16.ptr()), In::Bf16(sc.dy16.ptr())),
        }
    }

    /// Block `l`'s input: the embeddings, or the block below's output.
    fn block_input(&self, l: usize) -> u64 {
        match l {
            0 => self.acts.x0.ptr(),
            _ => self.acts.blocks[l - 1].res_3.ptr(),
        }
    }

    /// Block `l`'s q, k and v heads, read in place from its qkv rows: bf16 where the
    /// block keeps them so, f32 otherwise.
    fn qkv_heads(&self, l: usize) -> [HeadView; 3] {
        let a = &self.acts.blocks[l];
        match a.kept.qkv.len() {
            0 => HeadView::qkv(a.qkv.ptr(), self.heads()),
            _ => HeadView::qkv_bf16(a.kept.qkv.ptr(), self.heads()),
        }
    }

    /// y (N, C) from qkv: per sequence and head, P = causal softmax(Q Kᵀ / sqrt(d)),
    /// dropped (layer `l`'s weights mask), then Y = P V.
    fn attention_forward(&self, l: usize, y: u64) -> Result<()> {
        let qkv = self.acts.blocks[l].qkv.ptr();
        let (h, sc, k) = (self.heads(), &self.scratch, &self.gpu);
        let (t, d, bh) = (h.t, h.d, h.batch * h.heads);
        let mask = self.mask(Site::AttentionWeights(l));
        if self.attention == Attention::Flash {
            // Q, K, V read in place from the qkv rows, y written in place as rows: in
            // bf16 only where bf16 products read it (`heads_output`).
            let a = &self.acts.blocks[l];
            let out = match a.kept.y.len() {
                0 => HeadView::in_rows(y, 0, h.heads * d, h, 1),
                _ => HeadView::rows_bf16(a.kept.y.ptr(), h.heads * d, h),
            };
            let heads = self.qkv_heads(l);
            return k.flash_forward((out, a.lse.ptr()), heads, h, mask);
        }
        let qkv_heads = (sc.q.ptr(), sc.k.ptr(), sc.v.ptr());
        k.split_heads(qkv_heads, qkv, h)?;
        self.scores(h)?;
        k.causal_softmax(sc.att.ptr(), h, mask)?;
        self.product(
            (Operands::F32, Group::Attention),
            Matrix::new(sc.heads.ptr(), t, d),
            Matrix::new(sc.att.ptr(), t, t).n(),
            Matrix::new(sc.v.ptr(), t, d).n(),
            (1.0, 0.0),
            bh,
        )?;
        k.merge_heads(y, sc.heads.ptr(), h)
    }

    /// att = Q Kᵀ / sqrt(d) for every sequence and head, from the split heads.
    fn scores(&self, h: Heads) -> Result<()> {
        let sc = &self.scratch;
        let (t, d) = (h.t, h.d);
        let scale = 1.0 / (d as f32).sqrt();
        self.product(
            (Operands::F32, Group::Attention),
            Matrix::new(sc.att.ptr(), t, t),
            Matrix::new(sc.q.ptr(), t, d).n(),
            Matrix::new(sc.k.ptr(), t, d).t(),
            (scale, 0.0),
            h.batch * h.heads,
        )
    }

    /// One matrix product (a batch of `batch`) in the engine's precision:
    /// c = alpha a b + beta c, its operands `operands` in memory, for `group` (a
    /// profile's).
    fn product(
        &self,
        (operands, group): (Operands, Group),
        c: Matrix,
        a: super::blas::Operand,
        b: super::blas::Operand,
        (alpha, beta): (f32, f32),
        batch: usize,
    ) -> Result<()> {
        let how = (operands, self.math(), group);
        matmul(&self.gpu, how, Product::F32(c), a, b, alpha, beta, batch)
    }

    /// The final norm's output: kept in f32 for its backward, and with bf16 products
    /// also rounded into the input buffer, where the output layer's forward and
    /// backward products read it.
    fn final_norm_output(&self) -> (Out, Rows) {
        let ln_f = self.acts.ln_f.ptr();
        match &self.bf16 {
            Some(b) => (
                Out {
                    f32: ln_f,
                    bf16: b.inputs.ptr(),
                },
                Rows::Both(ln_f, b.inputs.ptr()),
            ),
            None => (Out::f32(ln_f), Rows::F32(ln_f)),
        }
    }

    /// Where a kernel writes the gradient at layer `p`'s output, which its backward
    /// products read next: `f32` itself with f32 products, or with a bias (its
    /// gradient sums the f32 rows); otherwise only the bf16 gradient buffer, rounded as
    /// it is written.
    fn product_gradient(&self, f32: u64, p: &LinearParams) -> (Out, Rows) {
        match (&self.bf16, p.bias) {
            (Some(b), None) => (
                Out {
                    f32: 0,
                    bf16: b.outputs.ptr(),
                },
                Rows::Bf16(b.outputs.ptr()),
            ),
            _ => (Out::f32(f32), Rows::F32(f32)),
        }
    }

    /// A product's rows in bf16 (`width` wide): `x` rounded into `buffer` (the input
    /// or the output-gradient buffer), or where they already are.
    fn rounded(&self, x: Rows, width: usize, buffer: &Buf<u16>) -> Result<u64> {
        Ok(match x {
            Rows::F32(x) => {
                self.gpu.to_bf16(buffer.ptr(), x, self.rows() * width)?;
                buffer.ptr()
            }
            Rows::Bf16(x16) | Rows::Both(_, x16) => x16,
        })
    }

    /// out (N, d_out) = x Wᵀ (+ b): with bf16 products, x in bf16 and the weights'
    /// bf16 copy read.
    fn linear_forward(&self, out: u64, x: Rows, p: &LinearParams) -> Result<()> {
        let (spec, params, n) = (&self.spec, &self.params, self.rows());
        let (weights, x) = match (&self.bf16, x) {
            (Some(b), x) => (
                Weights::Bf16(&b.weights),
                self.rounded(x, p.d_in, &b.inputs)?,
            ),
            (None, Rows::F32(x) | Rows::Both(x, _)) => (Weights::F32(self.math()), x),
            (None, Rows::Bf16(_)) => anyhow::bail!("bf16 rows with f32 products"),
        };
        linear(&self.gpu, weights, spec, params, out, x, p, n)
    }

    /// With the output's gradient `factor` dout: dx = factor dout W (written: f32, or
    /// rounded to bf16 with bf16 products); dW += factor doutᵀ x; db += the column sums
    /// of dout (layers with a bias take factor 1).
    fn linear_backward(
        &self,
        dx: impl Into<InputGradient>,
        dout: impl Into<Rows>,
        x: Rows,
        p: &LinearParams,
        factor: f32,
    ) -> Result<()> {
        let dout = dout.into();
        ensure!(
            p.bias.is_none() || factor == 1.0,
            "a scaled gradient into a bias"
        );
        let n = self.rows();
        // With bf16 products: dout and x rounded to bf16, the weights' bf16 copy read.
        let (operands, dout16, x16, w) = match (&self.bf16, dout, x) {
            (Some(b), dout, x) => {
                let dout16 = self.rounded(dout, p.d_out, &b.outputs)?;
                let x16 = self.rounded(x, p.d_in, &b.inputs)?;
                let w = b.weights.at(self.spec[p.weight].offset);
                (Operands::Bf16, dout16, x16, w)
            }
            (None, Rows::F32(dout) | Rows::Both(dout, _), Rows::F32(x) | Rows::Both(x, _)) => {
                (Operands::F32, dout, x, self.w(p.weight))
            }
            (None, _, _) => anyhow::bail!("bf16 rows with f32 products"),
        };
        let how = (operands, Group::Product(p.role));
        let (dout_w, w) = (
            Matrix::new(dout16, n, p.d_out).n(),
            Matrix::new(w, p.d_out, p.d_in).n(),
        );
        match dx.into() {
            InputGradient::Rows(Rows::F32(dx)) => {
                let dx = Matrix::new(dx, n, p.d_in);
                self.product(how, dx, dout_w, w, (factor, 0.0), 1)?;
            }
            InputGradient::Rows(Rows::Bf16(dx16)) if operands == Operands::Bf16 => {
                let dx16 = Product::Bf16(Matrix::new(dx16, n, p.d_in));
                let how = (operands, Math::Bf16, how.1);
                matmul(&self.gpu, how, dx16, dout_w, w, factor, 0.0, 1)?;
            }
            InputGradient::ThroughGelu { rows, block } if factor == 1.0 => {
                run_fused(&self.gpu, how.1, &self.gelu_backward(block, rows, dout16)?)?;
            }
            dx => anyhow::bail!("an input's gradient into {dx:?} from {operands:?} products"),
        }
        self.product(
            how,
            Matrix::new(self.g(p.weight), p.d_out, p.d_in),
            Matrix::new(dout16, n, p.d_out).t(),
            Matrix::new(x16, n, p.d_in).n(),
            (factor, 1.0),
            1,
        )?;
        if let Some(b) = p.bias {
            // The f32 rows where there are any; bf16 ones where a product's epilogue
            // wrote only those (autocast's bias gradients sum bf16 rows too).
            let dout = match dout {
                Rows::F32(dout) | Rows::Both(dout, _) => In::F32 {
                    at: dout,
                    round: false,
                },
                Rows::Bf16(dout16) => In::Bf16(dout16),
            };
            let partials = self.scratch.partials.ptr();
            self.gpu
                .bias_backward(self.g(b), dout, n, p.d_out, partials)?;
        }
        Ok(())
    }

    /// The norm `p` over this engine's rows, its statistics kept in `stats`.
    fn norm_rows(&self, stats: &Stats, p: &NormParams) -> NormRows {
        let (mean, rstd) = stats.ptrs();
        NormRows {
            kind: self.spec.config.norm,
            weight: self.w(p.weight),
            bias: self.w_opt(p.bias),
            mean,
            rstd,
            rows: self.rows(),
            c: self.spec.shapes.n_embd,
        }
    }

    fn norm_forward(&self, out: Out, stats: &Stats, x: u64, p: &NormParams) -> Result<()> {
        let eps = self.spec.config.norm_eps as f32;
        self.gpu.norm_forward(out, x, self.norm_rows(stats, p), eps)
    }

    /// res = x + (branch + its bias) * mask, then `out` = the norm `p` of res, its
    /// statistics kept in `stats`.
    fn residual_norm(
        &self,
        (res, x, branch, mask): (u64, u64, (In, u64), DropoutArgs),
        out: Out,
        stats: &Stats,
        p: &NormParams,
    ) -> Result<()> {
        let eps = self.spec.config.norm_eps as f32;
        let rows = self.norm_rows(stats, p);
        self.gpu
            .residual_norm_forward((res, x, branch, mask), out, rows, eps)
    }

    /// out = the norm's output again, from x and the kept statistics.
    fn norm_apply(&self, out: Out, stats: &Stats, x: u64, p: &NormParams) -> Result<()> {
        self.gpu.norm_apply(out, x, self.norm_rows(stats, p))
    }

    /// dx += d(norm)/dx . dout; the gain's (and bias's) gradients += theirs.
    fn norm_backward(
        &self,
        dx: u64,
        dout: In,
        x: u64,
        stats: &Stats,
        p: &NormParams,
    ) -> Result<()> {
        let grads = (self.g(p.weight), self.g_opt(p.bias));
        let partials = self.scratch.partials.ptr();
        let n = self.norm_rows(stats, p);
        // The new dx is the residual stream's gradient, which a bf16 product reads
        // next (`branch_gradient`): rounded into the output-gradient buffer as it is made.
        let dx16 = self.bf16.as_ref().map_or(0, |b| b.outputs.ptr());
        self.gpu
            .norm_backward((dx, dx16, dout, x), n, grads, partials)
    }

    /// Adds d(loss * `scale`)/d(params) to the gradients, for the batch of the last
    /// forward.
    pub fn backward(&mut self, scale: f32) -> Result<()> {
        self.bind()?;
        if self.grads.is_none() {
            self.zero_grads()?;
        }
        if !self.graphs.apply() {
            return self.backward_launches(scale);
        }
        let key = (scale.to_bits(), masks(self.dropout.as_ref()));
        if !self.graphs.backward.iter().any(|(k, _)| *k == key) {
            if let Some(graph) = self.record(|e| e.backward_launches(scale)) {
                Graphs::keep(&mut self.graphs.backward, key, graph);
            }
        }
        match self.graphs.backward.iter().find(|(k, _)| *k == key) {
            Some((_, backward)) => self.gpu.replay(backward),
            None => self.backward_launches(scale),
        }
    }

    /// The backward's launches, gradients added for the batch of the last forward.
    fn backward_launches(&self, scale: f32) -> Result<()> {
        let n = self.rows();
        let s = self.spec.shapes;
        let (k, a, sc) = (&self.gpu, &self.acts, &self.scratch);

        // d(loss)/d(logits) = (p - onehot) * scale / N: the subtraction in place on the
        // probabilities (with bf16 products the forward wrote it, rounded), the factor
        // carried by the output layer's two products.
        let dlogits = match &self.bf16 {
            Some(b) => Rows::Bf16(b.outputs.ptr()),
            None => {
                let probs = a.logits.ptr();
                k.cross_entropy_backward(probs, a.targets.ptr(), n, s.vocab_size)?;
                Rows::F32(probs)
            }
        };
        let output = self.spec.output_layer();
        let factor = scale / n as f32;
        // The final norm's rounded output is still where the forward's product read
        // it: nothing writes the input buffer between a forward and its backward.
        let (_, ln_f) = self.final_norm_output();
        let (dln, dln_in) = self.norm_output_gradient();
        self.linear_backward(dln, dlogits, ln_f, &output, factor)?;
        let last = a.blocks.last().expect("at least one layer").res_3.ptr();
        sc.dres.fill_zeros(&self.gpu)?;
        let stats = &a.ln_f_stats;
        self.norm_backward(sc.dres.ptr(), dln_in, last, stats, &self.spec.ln_f)?;
        for l in (0..s.n_layer).rev() {
            self.block_backward(l)?;
        }

        // The embeddings: each row's gradient (through the embedding's dropout) to its
        // token's vector and, when learned, its position's.
        let mask = self.mask(Site::Embedding);
        let (k, a, sc) = (&self.gpu, &self.acts, &self.scratch);
        k.embedding_backward_tokens(
            self.g(self.spec.wte),
            sc.dres.ptr(),
            (a.tokens.ptr(), a.starts.ptr(), a.order.ptr()),
            (n, self.buckets.tokens.len()),
            s.n_embd,
            mask,
        )?;
        if let Some(wpe) = self.spec.wpe {
            let dims = (self.batch, s.block_size, s.n_embd);
            k.embedding_backward_positions(self.g(wpe), sc.dres.ptr(), dims, mask)?;
        }
        Ok(())
    }

    /// The backward of `block_forward`: `dres` holds the gradient at the block's
    /// output on entry and at its input on return; weight gradients accumulate.
    fn block_backward(&self, l: usize) -> Result<()> {
        let (s, k, sc) = (&self.spec.shapes, &self.gpu, &self.scratch);
        let n = self.rows();
        let p = &self.spec.blocks[l];
        let a = &self.acts.blocks[l];
        let x = self.block_input(l);
        let dres = sc.dres.ptr();

        // res_3 = res_2 + mlp(ln_2(res_2)): dres reaches both terms. The non-linearity's
        // output: kept in bf16, or recomputed in f32.
        let kind = self.spec.config.mlp;
        let fc = self.pre_activation(l);
        let activated = match self.bf16 {
            Some(_) => Rows::Bf16(a.kept.act.ptr()),
            None => {
                let act = sc.act.ptr();
                k.activation_forward(Out::f32(act), fc, n, s.mlp_hidden, kind)?;
                Rows::F32(act)
            }
        };
        // The activation's gradient: bf16 as its bf16 product writes it (rounded as read
        // where products round on the fly), f32 with f32 products.
        let dbranch = self.branch_gradient(dres, Site::MlpOutput(l))?;
        let (dact, dact_in) = match self.bf16 {
            Some(_) => (Rows::Bf16(sc.dact16.ptr()), In::Bf16(sc.dact16.ptr())),
            None => (Rows::F32(sc.dact.ptr()), self.f32_rows(sc.dact.ptr())),
        };
        let dfc = if self.epilogues.gelu_gradient {
            let dfc = self.gelu_input_gradient();
            let through = InputGradient::ThroughGelu {
                rows: dfc,
                block: l,
            };
            self.linear_backward(through, dbranch, activated, &p.mlp_proj, 1.0)?;
            dfc
        } else {
            self.linear_backward(dact, dbranch, activated, &p.mlp_proj, 1.0)?;
            let dims = (n, s.mlp_hidden);
            let (dfc_out, dfc) = self.product_gradient(sc.dfc.ptr(), &p.mlp_fc);
            k.activation_backward(dfc_out, fc, dact_in, dims, kind)?;
            dfc
        };
        let normed_2 = self.norm_output_again(&a.kept.ln_2, (&a.ln_2, a.res_2.ptr(), &p.ln_2))?;
        let (dln, dln_in) = self.norm_output_gradient();
        self.linear_backward(dln, dfc, normed_2, &p.mlp_fc, 1.0)?;
        self.norm_backward(dres, dln_in, a.res_2.ptr(), &a.ln_2, &p.ln_2)?;

        // res_2 = x + proj(attention(qkv(ln_1(x)))).
        let dbranch = self.branch_gradient(dres, Site::AttentionOutput(l))?;
        let (dy, dy_in) = self.heads_output_gradient(l);
        self.linear_backward(dy, dbranch, self.heads_output(l), &p.attn_proj, 1.0)?;
        let dqkv = self.attention_backward(l, sc.dqkv.ptr(), dy_in)?;
        if let Some(tables) = self.tables.rope() {
            // q and k were turned after the projection: turn their gradients back.
            let at = Positions::from_start(s.block_size);
            k.rope(
                sc.dqkv.ptr(),
                tables,
                n,
                at,
                self.heads(),
                s.qkv_width,
                -1.0,
            )?;
        }
        let normed_1 = self.norm_output_again(&a.kept.ln_1, (&a.ln_1, x, &p.ln_1))?;
        let (dln, dln_in) = self.norm_output_gradient();
        self.linear_backward(dln, dqkv, normed_1, &p.attn_qkv, 1.0)?;
        self.norm_backward(dres, dln_in, x, &a.ln_1, &p.ln_1)
    }

    /// The gradient at a branch's output before its dropout: dres through the mask of
    /// `site` (into the branch buffer), or dres itself without dropout, which the norm
    /// backward that made it also rounded for bf16 products (`norm_backward`).
    fn branch_gradient(&self, dres: u64, site: Site) -> Result<Rows> {
        if self.dropout.is_none() {
            return Ok(match &self.bf16 {
                Some(b) => Rows::Both(dres, b.outputs.ptr()),
                None => Rows::F32(dres),
            });
        }
        let sc = &self.scratch;
        let n = self.rows() * self.spec.shapes.n_embd;
        let mask = self.mask(site);
        self.gpu.dropout(sc.branch.ptr(), dres, n, mask)?;
        Ok(Rows::F32(sc.branch.ptr()))
    }

    /// dqkv (written) from dy, with the weights recomputed: with Pd = P * mask,
    /// dV = Pdᵀ dY; dPd = dY Vᵀ; dS = softmax backward; dQ = dS K / sqrt(d);
    /// dK = dSᵀ Q / sqrt(d); grouped K/V heads sum their query heads' gradients.
    /// Returns where the qkv projection's backward finds them: in dqkv, or, where
    /// flash attention writes them rounded straight into the bf16 gradient buffer
    /// (`rounded_dqkv`), there only.
    fn attention_backward(&self, l: usize, dqkv: u64, dy: In) -> Result<Rows> {
        let qkv = self.acts.blocks[l].qkv.ptr();
        let (h, sc, k) = (self.heads(), &self.scratch, &self.gpu);
        let (t, d, bh) = (h.t, h.d, h.batch * h.heads);
        let scale = 1.0 / (d as f32).sqrt();
        let mask = self.mask(Site::AttentionWeights(l));

        if self.attention == Attention::Flash {
            // Read in place from the qkv and dY rows; the gradients written in place
            // into the dqkv rows, or, where K/V heads serve several query heads, per
            // query head and summed into them after.
            // dsum from dY and Y in bf16 (as FlashAttention-2's): as kept, or rounded
            // as read.
            let a = &self.acts.blocks[l];
            let (y, dy_rows) = match dy {
                In::Bf16(dy16) => (
                    In::Bf16(a.kept.y.ptr()),
                    HeadView::rows_bf16(dy16, h.heads * d, h),
                ),
                In::F32 { at, round } => (
                    In::F32 {
                        at: a.y.ptr(),
                        round,
                    },
                    HeadView::in_rows(at, 0, h.heads * d, h, 1),
                ),
            };
            k.flash_backward_sums(sc.dsum.ptr(), dy, y, h)?;
            let given = (dy_rows, a.lse.ptr(), sc.dsum.ptr());
            if h.kv_heads == h.heads {
                let (grads, rows) = match self.rounded_dqkv() {
                    Some(dqkv16) => (HeadView::qkv_bf16(dqkv16, h), Rows::Bf16(dqkv16)),
                    None => (HeadView::qkv(dqkv, h), Rows::F32(dqkv)),
                };
                k.flash_backward(grads, self.qkv_heads(l), given, h, mask)?;
                return Ok(rows);
            }
            let head_grads = (sc.dq.ptr(), sc.dk.ptr(), sc.dv.ptr());
            let split = |ptr| HeadView::split(ptr, h);
            let grads = [split(sc.dq.ptr()), split(sc.dk.ptr()), split(sc.dv.ptr())];
            k.flash_backward(grads, self.qkv_heads(l), given, h, mask)?;
            k.merge_head_grads(dqkv, head_grads, h)?;
            return Ok(Rows::F32(dqkv));
        }
        let In::F32 { at: dy, .. } = dy else {
            anyhow::bail!("the products path's attention reads dY in f32")
        };
        k.split_rows(sc.heads.ptr(), dy, h)?; // dY
        let qkv_heads = (sc.q.ptr(), sc.k.ptr(), sc.v.ptr());
        k.split_heads(qkv_heads, qkv, h)?;
        self.scores(h)?;
        k.causal_softmax(sc.att.ptr(), h, DropoutArgs::NONE)?; // P
        let dropped = match self.dropout {
            Some(_) => {
                k.dropout(sc.datt.ptr(), sc.att.ptr(), bh * t * t, mask)?;
                sc.datt.ptr()
            }
            None => sc.att.ptr(),
        };
        let heads = |ptr| Matrix::new(ptr, t, d);
        let weights = |ptr| Matrix::new(ptr, t, t);
        let dy = heads(sc.heads.ptr());
        let how = (Operands::F32, Group::Attention);
        let product = |c, a, b, alpha| self.product(how, c, a, b, (alpha, 0.0), bh);
        // dV, then dPd, which overwrites Pd (in datt) once dV has used it.
        product(heads(sc.dv.ptr()), weights(dropped).t(), dy.n(), 1.0)?;
        product(weights(sc.datt.ptr()), dy.n(), heads(sc.v.ptr()).t(), 1.0)?;
        k.causal_softmax_backward(sc.datt.ptr(), sc.att.ptr(), h, mask)?;
        let ds = weights(sc.datt.ptr());
        product(heads(sc.dq.ptr()), ds.n(), heads(sc.k.ptr()).n(), scale)?;
        product(heads(sc.dk.ptr()), ds.t(), heads(sc.q.ptr()).n(), scale)?;
        k.merge_head_grads(dqkv, (sc.dq.ptr(), sc.dk.ptr(), sc.dv.ptr()), h)?;
        Ok(Rows::F32(dqkv))
    }

    /// Where flash attention may write dqkv rounded and nothing else: the bf16
    /// gradient buffer, when products are bf16 and nothing reads dqkv in f32 (no
    /// rotary positions turning it back; a bias sums the bf16 rows, as autocast's
    /// bias gradients do; grouped K/V heads are summed after, and never come here).
    fn rounded_dqkv(&self) -> Option<u64> {
        let b = self.bf16.as_ref()?;
        self.tables.rope().is_none().then(|| b.outputs.ptr())
    }

    pub fn zero_grads(&mut self) -> Result<()> {
        match &self.grads {
            Some(g) => g.fill_zeros(&self.gpu),
            None => {
                self.grads = Some(Buf::zeros(&self.gpu, self.flat_len())?);
                Ok(())
            }
        }
    }

    /// The engine as one of `comm`'s ranks (every rank calls it together): its
    /// weights and gradients padded to whole blocks, AdamW's moments for its block.
    /// With one process, the engine as it is.
    pub fn with_ranks(self, comm: Arc<dyn Collective>) -> Result<Self> {
        match comm.size() {
            1 => Ok(self),
            _ => self.sharded(comm),
        }
    }

    /// [`FusedCuda::with_ranks`] even for one process: the sharded path (and NCCL,
    /// where built) at world size 1, which must train as the engine alone does (the
    /// test a single GPU can run).
    pub fn sharded(mut self, comm: Arc<dyn Collective>) -> Result<Self> {
        self.bind()?;
        let ranks = Ranks::new(&self.gpu, &self.spec, comm)?;
        let values = self.params.read(&self.gpu, self.spec.len())?;
        self.params = Buf::zeros(&self.gpu, ranks.shards.padded())?;
        self.params.write(&self.gpu, &values)?;
        self.grads = None;
        self.moments = None;
        self.ranks = Some(ranks);
        // What was recorded read the buffers just replaced.
        self.graphs = self.graphs.forgotten();
        Ok(self)
    }

    /// How a data-parallel run shares the work (None: one process).
    pub fn ranks_described(&self) -> Option<String> {
        self.ranks.as_ref().map(Ranks::describe)
    }

    /// Values in the flat gradient and weight buffers: the table's, or whole blocks.
    fn flat_len(&self) -> usize {
        match &self.ranks {
            Some(r) => r.shards.padded(),
            None => self.spec.len(),
        }
    }

    /// The parameters this engine updates: all, or its rank's block.
    fn mine(&self) -> std::ops::Range<usize> {
        match &self.ranks {
            Some(r) => r.mine.clone(),
            None => 0..self.spec.len(),
        }
    }

    /// Adds up the ranks' gradients, each rank keeping the sum of its block (on the
    /// engine's stream); with one process, nothing.
    pub fn reduce_grads(&mut self) -> Result<()> {
        if self.ranks.is_none() {
            return Ok(());
        }
        self.bind()?;
        if self.grads.is_none() {
            self.zero_grads()?;
        }
        let (ranks, grads) = (
            self.ranks.as_ref().context("ranks")?,
            self.grads.as_mut().context("gradients")?,
        );
        ranks.check()?;
        ranks.reduce_scatter(&self.gpu, grads)
    }

    /// Scales the gradients to a global L2 norm of at most `max_norm` (0: no
    /// clipping), deciding on the device: the host reads the norm only when it asks
    /// (`grad_norm`).
    pub fn clip_grads(&mut self, max_norm: f64) -> Result<()> {
        self.bind()?;
        if self.grads.is_none() {
            self.zero_grads()?;
        }
        // The norm of what this engine updates (its rank's block), its square summed
        // over the ranks.
        let mine = self.mine();
        let grads = self.grads.as_ref().context("gradients")?;
        let sums = &self.scratch.sums;
        let (norm_sq, partials) = (sums.at(NORM_SQ), sums.ptr());
        let first = grads.at(mine.start);
        self.gpu.sum_squares(norm_sq, first, mine.len(), partials)?;
        if let Some(ranks) = &self.ranks {
            ranks.all_reduce_sum(&self.gpu, &mut self.scratch.sums, NORM_SQ)?;
        }
        if max_norm > 0.0 && !mine.is_empty() {
            self.gpu
                .clip_to_norm(first, mine.len(), norm_sq, max_norm)?;
        }
        self.clipped = true;
        Ok(())
    }

    /// The gradients' global L2 norm the last clip measured (waits for the device).
    pub fn grad_norm(&self) -> Result<f64> {
        ensure!(self.clipped, "a gradient norm read before any clip");
        Ok(self.scratch.sums.read_one(&self.gpu, NORM_SQ)?.sqrt())
    }

    /// The AdamW update `u`, in place, in one launch.
    pub fn adamw(&mut self, u: &AdamWStep) -> Result<()> {
        self.bind()?;
        if self.grads.is_none() {
            self.zero_grads()?;
        }
        let mine = self.mine();
        if self.moments.is_none() {
            let len = mine.len();
            self.moments = Some([Buf::zeros(&self.gpu, len)?, Buf::zeros(&self.gpu, len)?]);
        }
        let (grads, [m, v]) = (
            self.grads.as_ref().context("gradients")?,
            self.moments.as_ref().context("moments")?,
        );
        let hyper = u.in_f32(true);
        // Over this engine's range, in chunks counted from its start; the bf16 copy
        // written as the weights are.
        let chunks = self
            .ranks
            .as_ref()
            .map_or(&self.adam_chunks, |r| &r.adam_chunks);
        let buffers = AdamBuffers {
            params: self.params.at(mine.start),
            // Ranks round the gathered weights again after (`weights_changed`).
            copy16: match self.ranks {
                Some(_) => 0,
                None => self.bf16.as_ref().map_or(0, |b| b.weights.at(mine.start)),
            },
            grads: grads.at(mine.start),
            m: m.ptr(),
            v: v.ptr(),
            chunks: chunks.ptr(),
            blocks: chunks.len() / 2,
        };
        if !mine.is_empty() {
            self.gpu.adamw(buffers, mine.len(), hyper)?;
        }
        match &self.ranks {
            Some(ranks) => {
                // The other ranks' blocks arrive in f32: round them again.
                self.weights_changed();
                ranks.all_gather(&self.gpu, &mut self.params)
            }
            None => Ok(()),
        }
    }

    /// The weights: a flat buffer in the spec's table order.
    pub fn weights(&self) -> Result<Vec<f32>> {
        self.params.read(&self.gpu, self.spec.len())
    }

    pub fn set_weights(&mut self, values: &[f32]) -> Result<()> {
        ensure!(
            values.len() == self.spec.len(),
            "a flat buffer of the whole table"
        );
        self.params.write(&self.gpu, values)?;
        self.weights_changed();
        Ok(())
    }

    /// The f32 weights changed: bf16 products round them again before they next read
    /// them.
    fn weights_changed(&self) {
        if let Some(b) = &self.bf16 {
            b.stale.set(true);
        }
    }

    /// Rounds the weights to their bf16 copy if they changed since it was made.
    fn round_weights(&self) -> Result<()> {
        match &self.bf16 {
            Some(b) if b.stale.get() => {
                let n = self.spec.len();
                self.gpu.to_bf16(b.weights.ptr(), self.params.ptr(), n)?;
                b.stale.set(false);
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// The gradients, laid out like the weights (zeros before the first backward).
    pub fn grads(&self) -> Result<Vec<f32>> {
        match &self.grads {
            Some(g) => g.read(&self.gpu, self.spec.len()),
            None => Ok(vec![0.0; self.spec.len()]),
        }
    }

    pub fn set_grads(&mut self, values: &[f32]) -> Result<()> {
        ensure!(
            values.len() == self.spec.len(),
            "a flat buffer of the whole table"
        );
        if self.grads.is_none() {
            self.zero_grads()?;
        }
        let grads = self.grads.as_mut().context("gradients")?;
        grads.write(&self.gpu, values)
    }

    /// AdamW's moments (m, v), laid out like the weights; zeros before the first
    /// update. Of several ranks, every rank's blocks gathered (all call it together).
    pub fn moments(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        let len = self.mine().len();
        let (m, v) = match &self.moments {
            Some([m, v]) => (m.read(&self.gpu, len)?, v.read(&self.gpu, len)?),
            None => (vec![0.0; len], vec![0.0; len]),
        };
        match &self.ranks {
            Some(ranks) => Ok((ranks.gather_ranges(&m)?, ranks.gather_ranges(&v)?)),
            None => Ok((m, v)),
        }
    }

    /// Sets the moments from those of the whole table (a rank keeps its block's).
    pub fn set_moments(&mut self, m: &[f32], v: &[f32]) -> Result<()> {
        let len = self.spec.len();
        ensure!(
            m.len() == len && v.len() == len,
            "moments of the whole table"
        );
        let mine = self.mine();
        if self.moments.is_none() {
            let len = mine.len();
            self.moments = Some([Buf::zeros(&self.gpu, len)?, Buf::zeros(&self.gpu, len)?]);
        }
        let [bm, bv] = self.moments.as_mut().context("moments")?;
        bm.write(&self.gpu, &m[mine.clone()])?;
        bv.write(&self.gpu, &v[mine])
    }

    /// Each position's loss in the last forward, (batch, block_size) row-major.
    pub fn position_losses(&self) -> Result<Vec<f64>> {
        let losses = self.acts.row_loss.read(&self.gpu, self.rows())?;
        Ok(losses.into_iter().map(f64::from).collect())
    }
}
