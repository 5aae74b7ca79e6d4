//! Decoding on the GPU: the fused CPU decoder's walk (`crate::cpu::FastDecoder`) with
//! the training engine's kernels and products, plus what only decoding has: per-layer
//! key/value caches on the device, written as rows arrive, and attention of new rows
//! over them (kernels/decode.cu). Weights stay resident; a step uploads one id per
//! sequence, and either reads back each sequence's row of logits (`logits`) or draws
//! the next tokens where the logits are and reads back only their ids (`draw`,
//! kernels/sample.cu). The prompt (and every window slide) runs through the same code
//! with many rows at once.

use anyhow::{bail, ensure, Result};
#[cfg(feature = "cuda")]
use candle_core::Device;

use super::blas::{linear, Weights};
use super::buffers::Buf;
use super::gpu::Gpu;
use super::gpu::Recording;
use super::kernels::{
    cached_attention_partials, At, CachedRows, DropoutArgs, Heads, In, NormRows, Out, SamplingArgs,
    SamplingWork,
};
use super::tables::PositionTables;
use crate::config::{Math, Precision};
use crate::cpu::ops::Positions;
use crate::cpu::Place;
use crate::model::spec::{LinearParams, ModelSpec, NormParams};

/// Rows one forward call holds at most: longer prefills run in chunks of positions.
const MAX_ROWS: usize = 4096;

/// A model's weights on the GPU and the K/V caches of `batch` sequences.
pub struct CudaDecoder {
    spec: ModelSpec,
    gpu: Gpu,
    /// Only this thread may drive it.
    owner: super::gpu::OwnerThread,
    params: Buf<f32>,
    tables: PositionTables,
    batch: usize,
    /// Positions per forward call the work space holds.
    chunk: usize,
    /// Positions held in the caches.
    len: usize,
    /// Per layer: (batch, block_size, kv width).
    keys: Vec<Buf<f32>>,
    values: Vec<Buf<f32>>,
    work: Work,
    /// The last call's logits, (batch, V), on the host once asked for.
    logits: Vec<f32>,
    logits_read: bool,
    /// Drawing on the device: made at the first draw.
    draws: Option<Draws>,
    /// With bf16 products: the weights as bf16 and a row buffer to round inputs into;
    /// none: f32 products over the f32 weights.
    bf16: Option<Bf16Copies>,
    /// Whether one-token steps replay a recording (`TINYGPT_CUDA_GRAPHS=0`: never).
    replays: bool,
    /// The recorded step, once made; it reads its position from `position`.
    step: Option<Recording>,
    position: Buf<i32>,
}

/// The weights a product reads, as bf16 (half the bytes of a step's weight reads, which
/// are most of a batch-1 step), and the rows rounded to bf16 before each product (the
/// rounding the tensor cores applied to f32 operands before).
struct Bf16Copies {
    /// The flat parameters, rounded: the spec's offsets address them.
    weights: Buf<u16>,
    /// (rows, the widest input of a linear layer).
    x: Buf<u16>,
}

/// What drawing tokens on the device holds besides the logits.
struct Draws {
    weights: Buf<f32>,
    keys: Buf<u64>,
    seen: Buf<u32>,
    uniforms: Buf<f64>,
    /// (batch, block_size): the windows the repetition penalty looks at.
    context: Buf<u32>,
    chosen: Buf<u32>,
    /// The ids read back.
    chosen_host: Vec<u32>,
    /// The contexts laid end to end, for their upload.
    context_host: Vec<u32>,
}

/// Work space for `chunk` positions of every sequence.
struct Work {
    ids: Buf<u32>,
    /// A server's pass: (sequence, position) per row, and the rows that give logits.
    places: Buf<i32>,
    picks: Buf<i32>,
    x: Buf<f32>,
    xn: Buf<f32>,
    /// A norm's mean and rstd per row.
    stats: Buf<f32>,
    qkv: Buf<f32>,
    att: Buf<f32>,
    proj: Buf<f32>,
    fc: Buf<f32>,
    act: Buf<f32>,
    /// Attention's per-chunk sums (`cached_attention_partials`).
    partial: Buf<f32>,
    /// (outputs, C): each sequence's last row (or a pass's picked rows), then its final
    /// norm, and its statistics.
    last: Buf<f32>,
    last_normed: Buf<f32>,
    last_stats: Buf<f32>,
    /// (outputs, V); the first batch rows are a step's.
    logits: Buf<f32>,
}

impl CudaDecoder {
    /// The model `spec` with weights `values` (flat, table order) on the CUDA device
    /// `device`, for `batch` sequences decoded together, products in `precision`.
    #[cfg(feature = "cuda")]
    pub fn new(
        spec: &ModelSpec,
        values: &[f32],
        device: &Device,
        batch: usize,
        precision: Precision,
    ) -> Result<Self> {
        let gpu = Gpu::cuda(device, "the CUDA decoder")?;
        Self::on(gpu, spec, values, batch, precision)
    }

    /// The same decoder with its kernels run on the CPU by the emulator (tests).
    #[cfg(feature = "cuda-emulator")]
    pub fn emulated(
        spec: &ModelSpec,
        values: &[f32],
        batch: usize,
        precision: Precision,
    ) -> Result<Self> {
        Self::on(Gpu::Emulated, spec, values, batch, precision)
    }

    fn on(
        gpu: Gpu,
        spec: &ModelSpec,
        values: &[f32],
        batch: usize,
        precision: Precision,
    ) -> Result<Self> {
        ensure!(
            values.len() == spec.len(),
            "a flat buffer of the whole table"
        );
        gpu.bind()?;
        let s = &spec.shapes;
        ensure!(batch > 0, "at least one sequence");
        // Rows per call: at most MAX_ROWS, and attention's work space of at most 2^26
        // values (256 MiB).
        let partials = |rows| cached_attention_partials(rows, s.n_head, s.head_dim, s.block_size);
        let by_partials = (1 << 26) / partials(batch);
        let chunk = (MAX_ROWS / batch).min(by_partials).clamp(1, s.block_size);
        let rows = batch * chunk;
        let outputs = crate::cpu::decode::outputs_per_pass(batch, rows);
        let zeros = |len: usize| Buf::<f32>::zeros(&gpu, len);
        let tables = PositionTables::new(&gpu, spec)?;
        let cache = batch * s.block_size * s.kv_width;
        let (keys, values_cache) = (
            (0..s.n_layer)
                .map(|_| zeros(cache))
                .collect::<Result<Vec<_>>>()?,
            (0..s.n_layer)
                .map(|_| zeros(cache))
                .collect::<Result<Vec<_>>>()?,
        );
        let c = s.n_embd;
        let work = Work {
            ids: Buf::zeros(&gpu, rows)?,
            places: Buf::zeros(&gpu, 2 * rows)?,
            picks: Buf::zeros(&gpu, outputs)?,
            x: zeros(rows * c)?,
            xn: zeros(rows * c)?,
            stats: zeros(2 * rows)?,
            qkv: zeros(rows * s.qkv_width)?,
            att: zeros(rows * c)?,
            proj: zeros(rows * c)?,
            fc: zeros(rows * s.mlp_fc_width)?,
            act: zeros(rows * s.mlp_hidden)?,
            partial: zeros(partials(rows))?,
            last: zeros(outputs * c)?,
            last_normed: zeros(outputs * c)?,
            last_stats: zeros(2 * outputs)?,
            logits: zeros(outputs * s.vocab_size)?,
        };
        let position = Buf::zeros(&gpu, 1)?;
        let params = Buf::from_host(&gpu, values)?;
        let bf16 = match precision {
            Precision::F32 => None,
            Precision::Bf16 => {
                let weights = Buf::<u16>::zeros(&gpu, params.len())?;
                gpu.to_bf16(weights.ptr(), params.ptr(), params.len())?;
                let widest = c.max(s.mlp_hidden);
                let x = Buf::<u16>::zeros(&gpu, rows * widest)?;
                Some(Bf16Copies { weights, x })
            }
        };
        Ok(Self {
            params,
            bf16,
            spec: spec.clone(),
            gpu,
            owner: super::gpu::OwnerThread::here(),
            tables,
            batch,
            chunk,
            len: 0,
            keys,
            values: values_cache,
            work,
            logits: Vec::new(),
            logits_read: false,
            draws: None,
            replays: std::env::var("TINYGPT_CUDA_GRAPHS").map_or(true, |v| v != "0"),
            step: None,
            position,
        })
    }

    pub fn batch(&self) -> usize {
        self.batch
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Rows one [`Self::run_rows`] pass can take.
    pub fn rows_per_pass(&self) -> usize {
        self.batch * self.chunk
    }

    /// Rows one [`CudaDecoder::run_rows`] pass can give logits of: a sequence each, and
    /// more for a prompt whose every position is scored (as the CPU decoder's).
    pub fn outputs_per_pass(&self) -> usize {
        self.work.picks.len()
    }

    /// Binds the device's context to this thread, the one that built the decoder (its
    /// work goes to that thread's stream).
    fn bind(&self) -> Result<()> {
        self.owner.check("the CUDA decoder")?;
        self.gpu.bind()
    }

    /// Whether one-token steps replay a recorded step (the default, unless
    /// `TINYGPT_CUDA_GRAPHS=0`) or launch each kernel.
    pub fn set_replays(&mut self, on: bool) {
        self.replays = on;
        if !on {
            self.step = None;
        }
    }

    /// Whether one-token steps replay their recorded graph: false before the first
    /// step, with `set_replays(false)`, and once recording or a replay failed.
    pub fn is_replaying(&self) -> bool {
        self.replays && self.step.is_some()
    }

    pub fn vocab_size(&self) -> usize {
        self.spec.shapes.vocab_size
    }

    /// Positions held in the caches.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Starts over: runs `windows` (one per sequence, equal lengths) from position 0.
    /// Returns the last position's logits, (batch, V).
    pub fn prefill(&mut self, windows: &[Vec<u32>]) -> Result<&[f32]> {
        self.run_windows(windows)?;
        self.logits()
    }

    /// Feeds one token per sequence at the next position; returns logits, (batch, V).
    pub fn step(&mut self, ids: &[u32]) -> Result<&[f32]> {
        self.run_step(ids)?;
        self.logits()
    }

    /// [`Self::prefill`], leaving the logits on the device.
    pub fn run_windows(&mut self, windows: &[Vec<u32>]) -> Result<()> {
        let chunks = crate::cpu::decode::prefill_chunks(windows, self.batch, self.chunk)?;
        self.len = 0;
        for (ids, len) in chunks {
            self.forward(&ids, len)?;
        }
        Ok(())
    }

    /// [`Self::step`], leaving the logits on the device.
    pub fn run_step(&mut self, ids: &[u32]) -> Result<()> {
        self.forward(ids, 1)
    }

    /// Rows of any sequences at their own positions in one pass, as
    /// [`crate::cpu::FastDecoder::run_rows`] runs them (a server's batch: some
    /// sequences taking their next token, others a piece of their prompt); returns the
    /// logits of the rows `outputs` names, (outputs.len(), V). The positions are the
    /// caller's to keep; the equal-length API's count is left as it was.
    pub fn run_rows(&mut self, ids: &[u32], places: &[Place], outputs: &[usize]) -> Result<&[f32]> {
        self.bind()?;
        let s = self.spec.shapes;
        let (rows, capacity) = (ids.len(), self.batch * self.chunk);
        ensure!(
            rows == places.len() && (1..=capacity).contains(&rows),
            "{rows} rows for {} places: a pass runs 1 to {capacity} rows",
            places.len()
        );
        if let Some(p) = places
            .iter()
            .find(|p| p.seq >= self.batch || p.pos >= s.block_size)
        {
            bail!(
                "row at sequence {} position {} is outside the {} sequences of {} positions",
                p.seq,
                p.pos,
                self.batch,
                s.block_size
            );
        }
        ensure!(
            outputs.len() <= self.outputs_per_pass() && outputs.iter().all(|&r| r < rows),
            "logits are asked of rows {outputs:?} of a {rows}-row pass (at most {} rows)",
            self.outputs_per_pass()
        );
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= s.vocab_size) {
            bail!(
                "token id {id} is outside the vocabulary of {}",
                s.vocab_size
            );
        }
        let pairs: Vec<i32> = places
            .iter()
            .flat_map(|p| [p.seq as i32, p.pos as i32])
            .collect();
        // A pass of prompt pieces only still computes one row's logits (row 0's,
        // unread): the launches stay the same shape.
        let picks: Vec<i32> = match outputs {
            [] => vec![0],
            _ => outputs.iter().map(|&r| r as i32).collect(),
        };
        self.work.ids.write_at(&self.gpu, 0, ids)?;
        self.work.places.write_at(&self.gpu, 0, &pairs)?;
        self.work.picks.write_at(&self.gpu, 0, &picks)?;
        let n = outputs.len();
        let at = At {
            t: 1,
            first: 0,
            first_at: 0,
            places: self.work.places.ptr(),
        };
        self.forward_kernels(rows, at, Some((self.work.picks.ptr(), picks.len())))?;
        // The (batch, V) logits `logits()` reads are not these.
        self.logits_read = false;
        let v = s.vocab_size;
        self.logits.resize(n * v, 0.0);
        self.work
            .logits
            .read_into(&self.gpu, 0, &mut self.logits[..n * v])?;
        Ok(&self.logits[..n * v])
    }

    /// The last call's logits, (batch, V), read back once.
    pub fn logits(&mut self) -> Result<&[f32]> {
        if !self.logits_read {
            self.logits
                .resize(self.batch * self.spec.shapes.vocab_size, 0.0);
            self.work.logits.read_into(&self.gpu, 0, &mut self.logits)?;
            self.logits_read = true;
        }
        Ok(&self.logits)
    }

    /// Each sequence's next token, drawn from the last call's logits on the device as
    /// `args` say, with the sequence's uniform draw `uniforms[b]` (the host sampler's
    /// own, `Sampler::next_uniform`); only the ids are read back. `contexts` are the
    /// windows the repetition penalty looks at (equal lengths). Ids from `text_vocab`
    /// on are never drawn.
    pub fn draw(
        &mut self,
        args: SamplingArgs,
        uniforms: &[f64],
        contexts: &[&[u32]],
        text_vocab: usize,
    ) -> Result<&[u32]> {
        let (batch, s) = (self.batch, self.spec.shapes);
        ensure!(uniforms.len() == batch, "one uniform draw per sequence");
        ensure!(
            (1..=s.vocab_size).contains(&text_vocab),
            "text_vocab {text_vocab} of a vocabulary of {}",
            s.vocab_size
        );
        self.bind()?;
        if self.draws.is_none() {
            self.draws = Some(Draws::new(&self.gpu, batch, s.vocab_size, s.block_size)?);
        }
        let d = self.draws.as_mut().expect("made above");
        let context_len = if args.penalizes() {
            ensure!(contexts.len() == batch, "one context per sequence");
            let len = contexts[0].len();
            ensure!(
                len <= s.block_size && contexts.iter().all(|c| c.len() == len),
                "contexts of equal lengths within the block"
            );
            d.context_host.clear();
            d.context_host
                .extend(contexts.iter().flat_map(|c| c.iter().copied()));
            d.context.write(&self.gpu, &d.context_host)?;
            len
        } else {
            0
        };
        d.uniforms.write(&self.gpu, uniforms)?;
        let work = SamplingWork {
            weights: d.weights.ptr(),
            keys: d.keys.ptr(),
            seen: d.seen.ptr(),
        };
        self.gpu.sample_tokens(
            d.chosen.ptr(),
            &work,
            self.work.logits.ptr(),
            (d.context.ptr(), context_len, context_len.max(1)),
            d.uniforms.ptr(),
            (batch, s.vocab_size, text_vocab),
            args,
        )?;
        d.chosen.read_into(&self.gpu, 0, &mut d.chosen_host)?;
        Ok(&d.chosen_host)
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

    /// Runs `t` new tokens per sequence (`ids` is (batch, t) row-major) at positions
    /// len .. len + t, appending their keys and values.
    fn forward(&mut self, ids: &[u32], t: usize) -> Result<()> {
        self.bind()?;
        let s = self.spec.shapes;
        ensure!(
            ids.len() == self.batch * t && t <= self.chunk,
            "ids of (batch, chunk)"
        );
        if t == 0 || self.len + t > s.block_size {
            bail!(
                "{} positions do not fit the K/V caches of {}: slide the window",
                self.len + t,
                s.block_size
            );
        }
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= s.vocab_size) {
            bail!(
                "token id {id} is outside the vocabulary of {}",
                s.vocab_size
            );
        }
        self.work.ids.write(&self.gpu, ids)?;
        if t == 1 && self.replays {
            self.position.write(&self.gpu, &[self.len as i32])?;
            if self.step.is_none() {
                self.step = self.record_step();
            }
        }
        let at = Positions { t, first: self.len }.into();
        match &self.step {
            Some(step) if t == 1 => {
                if let Err(e) = self.gpu.replay(step) {
                    crate::errln!("note: decoding launches each kernel (a replay failed: {e:#})");
                    self.set_replays(false);
                    self.forward_kernels(self.batch * t, at, None)?;
                }
            }
            _ => self.forward_kernels(self.batch * t, at, None)?,
        }
        self.logits_read = false;
        self.len += t;
        Ok(())
    }

    /// A step's launches recorded once (a CUDA graph: one launch replays them all,
    /// where a small model's step is mostly the host launching ~15 kernels a layer),
    /// reading its position from device memory. None where recording failed: said once,
    /// and the steps launch their kernels one by one.
    fn record_step(&mut self) -> Option<Recording> {
        let at = At {
            t: 1,
            first: 0,
            first_at: self.position.ptr(),
            places: 0,
        };
        match self
            .gpu
            .record(|| self.forward_kernels(self.batch, at, None))
        {
            Ok(step) => Some(step),
            Err(e) => {
                crate::errln!(
                    "note: decoding launches each kernel (recording a step failed: {e:#})"
                );
                self.replays = false;
                None
            }
        }
    }

    /// The launches of a forward over `rows` rows whose ids are in the work space
    /// (`at.t` new positions a sequence, or rows at the places `at.places` gives):
    /// embedding, the blocks, then logits of each sequence's last row, or of the `n`
    /// rows `picks` (a device address) names.
    fn forward_kernels(&self, rows: usize, at: At, picks: Option<(u64, usize)>) -> Result<()> {
        let (s, t) = (self.spec.shapes, at.t);
        let c = s.n_embd;
        let (g, w) = (&self.gpu, &self.work);
        let positions = self.tables.added(&self.spec, &self.params);
        let wte = self.params.at(self.spec[self.spec.wte].offset);
        g.embedding_forward(
            w.x.ptr(),
            w.ids.ptr(),
            wte,
            positions,
            rows,
            at,
            c,
            DropoutArgs::NONE,
        )?;
        let heads = self.heads();
        let kind = self.spec.config.mlp;
        // x += a sub-layer's output (left in `proj`).
        let add_branch = || {
            g.residual(
                w.x.ptr(),
                w.x.ptr(),
                w.proj.ptr(),
                rows * c,
                DropoutArgs::NONE,
            )
        };
        for (l, p) in self.spec.blocks.iter().enumerate() {
            // Attention: q, k, v for every row; positions turned in; keys and values
            // cached; each row attends over its sequence's cache.
            self.norm(w.xn.ptr(), w.stats.ptr(), w.x.ptr(), &p.ln_1, rows)?;
            self.linear(w.qkv.ptr(), w.xn.ptr(), &p.attn_qkv, rows)?;
            if let Some(tables) = self.tables.rope() {
                g.rope(w.qkv.ptr(), tables, rows, at, heads, s.qkv_width, 1.0)?;
            }
            let cached = CachedRows {
                qkv: w.qkv.ptr(),
                rows,
                at,
                h: heads,
                keys: self.keys[l].ptr(),
                values: self.values[l].ptr(),
                block: s.block_size,
            };
            g.store_keys_values(cached)?;
            g.attend_cached((w.att.ptr(), w.partial.ptr()), cached)?;
            self.linear(w.proj.ptr(), w.att.ptr(), &p.attn_proj, rows)?;
            add_branch()?;

            // MLP.
            self.norm(w.xn.ptr(), w.stats.ptr(), w.x.ptr(), &p.ln_2, rows)?;
            self.linear(w.fc.ptr(), w.xn.ptr(), &p.mlp_fc, rows)?;
            let fc = (In::f32(w.fc.ptr()), 0); // its bias added by `linear`
            g.activation_forward(Out::f32(w.act.ptr()), fc, rows, s.mlp_hidden, kind)?;
            self.linear(w.proj.ptr(), w.act.ptr(), &p.mlp_proj, rows)?;
            add_branch()?;
        }

        // Only each sequence's last position (or the picked rows) needs logits.
        let n = match picks {
            Some((picks, n)) => {
                g.pick_rows(w.last.ptr(), w.x.ptr(), picks, n, c)?;
                n
            }
            None => {
                g.last_rows(w.last.ptr(), w.x.ptr(), self.batch, t, c)?;
                self.batch
            }
        };
        let (last, normed) = (w.last.ptr(), w.last_normed.ptr());
        self.norm(normed, w.last_stats.ptr(), last, &self.spec.ln_f, n)?;
        self.linear(w.logits.ptr(), normed, &self.spec.output_layer(), n)
    }

    fn linear(&self, out: u64, x: u64, p: &LinearParams, rows: usize) -> Result<()> {
        let (spec, params, g) = (&self.spec, &self.params, &self.gpu);
        match &self.bf16 {
            None => linear(g, Weights::F32(Math::F32), spec, params, out, x, p, rows),
            Some(b) => {
                g.to_bf16(b.x.ptr(), x, rows * p.d_in)?;
                let weights = Weights::Bf16(&b.weights);
                linear(g, weights, spec, params, out, b.x.ptr(), p, rows)
            }
        }
    }

    /// out = the norm of each of `rows` rows of x; `stats` holds 2 rows of statistics.
    fn norm(&self, out: u64, stats: u64, x: u64, p: &NormParams, rows: usize) -> Result<()> {
        let cfg = &self.spec.config;
        let n = NormRows {
            kind: cfg.norm,
            weight: self.params.at(self.spec[p.weight].offset),
            bias: p.bias.map_or(0, |b| self.params.at(self.spec[b].offset)),
            mean: stats,
            rstd: stats + 4 * rows as u64,
            rows,
            c: self.spec.shapes.n_embd,
        };
        self.gpu
            .norm_forward(Out::f32(out), x, n, cfg.norm_eps as f32)
    }
}

impl Draws {
    fn new(gpu: &Gpu, batch: usize, vocab: usize, block: usize) -> Result<Self> {
        Ok(Self {
            weights: Buf::zeros(gpu, batch * vocab)?,
            keys: Buf::zeros(gpu, batch * vocab.next_power_of_two())?,
            seen: Buf::zeros(gpu, batch * vocab)?,
            uniforms: Buf::zeros(gpu, batch)?,
            context: Buf::zeros(gpu, batch * block)?,
            chosen: Buf::zeros(gpu, batch)?,
            chosen_host: vec![0; batch],
            context_host: Vec::with_capacity(batch * block),
        })
    }
}
