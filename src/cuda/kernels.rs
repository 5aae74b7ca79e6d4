//! The engine's own kernels (`kernels/*.cu`: PTX by build.rs on CUDA, C++ in the
//! emulator), each behind a typed launch on [`Gpu`].
//!
//! Pointers cross as raw device addresses (`u64`): the engine owns every buffer for
//! its whole life and runs on one stream, so nothing is freed or raced while a launch
//! reads it, and a layer's weights are an offset into the flat parameter buffer
//! (llm.c's pointers into `params_memory`).

use anyhow::Result;

use super::calls::{Arg, Kernel, Launch};
use super::gpu::Gpu;
use crate::config::{MlpKind, NormKind};
use crate::cpu::ops::Positions;
use crate::model::{Dropout, Site};
use crate::optim::AdamWF32;
use crate::profile::{Cost, Group};

/// Launches kernel `$kernel` on `$gpu` with `$cfg` and the arguments in order, each
/// passed by address as cuLaunchKernel takes them, with its size (the emulator checks
/// every size against the kernel's parameter). The temporaries live until the launch
/// returns. `$cost` is what a profile counts the launch as doing: its FLOPs (as the
/// kernel computes them; attention over the causal half) and the bytes it must move
/// at least (each value read or written once).
macro_rules! launch {
    ($gpu:expr, $kernel:ident, $cfg:expr, $cost:expr; $($arg:expr),* $(,)?) => {
        launch!($gpu, $kernel as (Kernel::$kernel.group()), $cfg, $cost; $($arg),*)
    };
    ($gpu:expr, $kernel:ident as $group:expr, $cfg:expr, $cost:expr; $($arg:expr),* $(,)?) => {
        // SAFETY: the arguments match the kernel's parameters in number, order and
        // type (each kernel's signature is beside its wrapper's in kernels/*.cu), and
        // every pointer is into a live buffer of the length the kernel reads.
        unsafe {
            $gpu.launch(Kernel::$kernel, $cfg, ($group, $cost), &[$(Arg::of(&mut { $arg })),*])
        }
    };
}

/// A dropout site's mask for the kernels, field for field `struct Dropout` of
/// kernels/common.cuh. `NONE` (threshold 0) keeps everything.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DropoutArgs {
    key0: u32,
    key1: u32,
    site: u32,
    micro: u32,
    step: u32,
    threshold: u64,
    keep: f32,
    /// Where micro and step are read instead, in device memory (0: from here).
    pass: u64,
}

impl DropoutArgs {
    pub const NONE: Self = Self {
        key0: 0,
        key1: 0,
        site: 0,
        micro: 0,
        step: 0,
        threshold: 0,
        keep: 1.0,
        pass: 0,
    };

    /// The same mask with its pass (micro-batch, step: two u32) read from device memory
    /// at `pass`, so a recorded pass replays with the pass it is given.
    pub fn reading_pass(self, pass: u64) -> Self {
        Self {
            micro: 0,
            step: 0,
            pass,
            ..self
        }
    }

    /// The mask of `site` in the pass `dropout` (none without one).
    pub fn at(dropout: Option<&Dropout>, site: Site) -> Self {
        let Some(d) = dropout else {
            return Self::NONE;
        };
        let (counter, key) = d.counter(site);
        Self {
            key0: key[0],
            key1: key[1],
            site: counter[1],
            micro: counter[2],
            step: counter[3],
            threshold: d.threshold(),
            keep: d.keep_scale(),
            pass: 0,
        }
    }
}

/// How `sample_tokens` chooses, field for field `struct Sampling` of kernels/sample.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingArgs {
    top_p: f64,
    inv_temperature: f32,
    penalty: f32,
    top_k: i32,
    greedy: i32,
}

impl SamplingArgs {
    /// The host sampler's settings (`generate::sample::SamplingParams`, which decides
    /// what is greedy): the temperature (none: greedy), top-k (0: all), top-p (1: all),
    /// repetition penalty (1: none).
    pub fn new(
        temperature: Option<f64>,
        top_k: usize,
        top_p: f64,
        repetition_penalty: f64,
    ) -> Self {
        Self {
            top_p,
            inv_temperature: temperature.map_or(1.0, |t| 1.0 / t as f32),
            penalty: repetition_penalty as f32,
            top_k: i32::try_from(top_k).unwrap_or(i32::MAX),
            greedy: i32::from(temperature.is_none()),
        }
    }

    /// Whether the repetition penalty changes anything (the context is read).
    pub fn penalizes(&self) -> bool {
        self.penalty != 1.0
    }
}

/// Work space `sample_tokens` needs beside the logits, for `batch` rows of `vocab`.
pub struct SamplingWork {
    pub weights: u64,
    /// (batch, vocab rounded up to a power of two).
    pub keys: u64,
    /// (batch, vocab), zero.
    pub seen: u64,
}

/// Cached positions one block of `attend_cached_partial` attends over
/// (`CACHED_CHUNK` in kernels/decode.cu).
const CACHED_CHUNK: usize = 64;

/// The work space values `attend_cached` needs for `rows` rows of `heads` query heads
/// of width `d` over a cache of `block` positions: per row and head, each chunk's
/// weighted values, max and sum.
pub fn cached_attention_partials(rows: usize, heads: usize, d: usize, block: usize) -> usize {
    rows * heads * block.div_ceil(CACHED_CHUNK) * (d + 2)
}

/// Rows' positions as the kernels take them: `t` new positions a sequence from `first`,
/// or from the i32 at device address `first_at` when that is not 0: a decoding step
/// replayed from a graph, whose arguments are fixed when it is recorded, reads its
/// position from device memory (`start_of` in kernels/common.cuh). Where `places` is
/// not 0 it is the device address of (sequence, position) i32 pairs, one per row, and
/// they say where each row goes instead (`sequence_of`, `position_of`): a server's
/// pass of many sequences at their own positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct At {
    pub t: usize,
    pub first: usize,
    pub first_at: u64,
    pub places: u64,
}

impl From<Positions> for At {
    fn from(p: Positions) -> Self {
        Self {
            t: p.t,
            first: p.first,
            first_at: 0,
            places: 0,
        }
    }
}

/// Threads per block of the element-wise kernels.
const THREADS: u32 = 256;

/// A grid-stride launch over `n` elements.
fn elements(n: usize) -> Launch {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 65_536) as u32;
    Launch {
        grid: (blocks, 1, 1),
        threads: THREADS,
    }
}

/// The activation kernels' grid: a thread per four values where GELU's come four an
/// access (kernels/activation.cu; the kernel checks alignment itself, and its
/// grid-stride loop covers every value whatever the grid).
fn activation_elements(values: usize, kind: MlpKind) -> Launch {
    match kind != MlpKind::Swiglu && values.is_multiple_of(4) {
        true => elements(values / 4),
        false => elements(values),
    }
}

/// The widest rows `norm_backward` takes in one pass (32 lanes x NORM_LANE_COLS in
/// kernels/norm.cu).
pub const NORM_ONE_PASS_WIDTH: usize = 32 * 48;

/// One warp per row.
fn warp_rows(rows: usize) -> Launch {
    let per_block = THREADS as usize / 32;
    Launch {
        grid: (rows.div_ceil(per_block) as u32, 1, 1),
        threads: THREADS,
    }
}

/// Flash attention's grid: a block of 4 warps per 64 rows (16 each) of each head.
fn flash_grid(h: Heads) -> Launch {
    Launch {
        grid: (h.t.div_ceil(64) as u32, (h.batch * h.heads) as u32, 1),
        threads: 128,
    }
}

/// 1 / sqrt(d), the scores' scale.
fn attention_scale(h: Heads) -> f32 {
    1.0 / (h.d as f32).sqrt()
}

/// One thread per column, `parts` block rows.
fn columns(cols: usize, parts: usize) -> Launch {
    Launch {
        grid: (cols.div_ceil(THREADS as usize) as u32, parts as u32, 1),
        threads: THREADS,
    }
}

fn int(n: usize) -> i32 {
    i32::try_from(n).expect("a size under 2^31")
}

fn long(n: usize) -> i64 {
    n as i64
}

/// The MLP's non-linearity as the kernels number it.
fn activation_kind(kind: MlpKind) -> i32 {
    match kind {
        MlpKind::Gelu => 0,
        MlpKind::GeluTanh => 1,
        MlpKind::Swiglu => 2,
    }
}

/// A norm over `rows` rows of width `c`: its kind, its gain, its bias (0 for none), and
/// where each row's mean (0 under RMSNorm) and 1 / std are kept.
#[derive(Debug, Clone, Copy)]
pub struct NormRows {
    pub kind: NormKind,
    pub weight: u64,
    pub bias: u64,
    pub mean: u64,
    pub rstd: u64,
    pub rows: usize,
    pub c: usize,
}

impl NormRows {
    /// The kernels' switch: 1 for RMSNorm.
    fn rms(&self) -> i32 {
        i32::from(self.kind == NormKind::RmsNorm)
    }
}

/// A layer's new rows in a decoding pass and the K/V cache they join: the rows' q, k, v
/// heads side by side in `qkv` (rows, qkv width), at the positions `at`; the cache's
/// keys and values, (batch, block, kv width) each.
#[derive(Debug, Clone, Copy)]
pub struct CachedRows {
    pub qkv: u64,
    pub rows: usize,
    pub at: At,
    pub h: Heads,
    pub keys: u64,
    pub values: u64,
    pub block: usize,
}

/// Where a tensor's heads are, field for field `struct HeadView` of kernels/flash.cu:
/// row t, column c of head h of sequence b at element
/// `b batch_stride + (h / group) head_stride + t ld + c` from `base`, f32 elements or
/// (`bf16` 1) bf16 ones.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadView {
    base: u64,
    batch_stride: i64,
    head_stride: i64,
    ld: i32,
    group: i32,
    bf16: i32,
}

// The kernels' structs, field for field: sizes and offsets as C lays them out.
const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    assert!(size_of::<HeadView>() == 40 && align_of::<HeadView>() == 8);
    assert!(offset_of!(HeadView, batch_stride) == 8 && offset_of!(HeadView, ld) == 24);
    assert!(offset_of!(HeadView, bf16) == 32);
    assert!(size_of::<DropoutArgs>() == 48 && offset_of!(DropoutArgs, threshold) == 24);
    assert!(offset_of!(DropoutArgs, keep) == 32 && offset_of!(DropoutArgs, pass) == 40);
};

impl HeadView {
    /// Heads side by side in rows `width` values wide (B T rows), from column `first`:
    /// the qkv projection's output (each K/V head serving `group` query heads), the
    /// attention output, their gradients.
    pub fn in_rows(base: u64, first: usize, width: usize, h: Heads, group: usize) -> Self {
        Self::in_rows_of(base, first, width, (h, group), false)
    }

    /// `in_rows` of f32 or (`bf16`) bf16 elements.
    fn in_rows_of(
        base: u64,
        first: usize,
        width: usize,
        (h, group): (Heads, usize),
        bf16: bool,
    ) -> Self {
        let bytes = if bf16 { 2 } else { 4 };
        Self {
            base: base + bytes * first as u64,
            batch_stride: (h.t * width) as i64,
            head_stride: h.d as i64,
            ld: int(width),
            group: int(group),
            bf16: i32::from(bf16),
        }
    }

    /// Heads split out as (B, H, T, d), one per query head (`split_heads`' layout).
    pub fn split(base: u64, h: Heads) -> Self {
        Self {
            base,
            batch_stride: (h.heads * h.t * h.d) as i64,
            head_stride: (h.t * h.d) as i64,
            ld: int(h.d),
            group: 1,
            bf16: 0,
        }
    }

    /// Heads side by side in bf16 rows `width` values wide (B T rows): where a kernel
    /// writes an output rounded, for the bf16 products that read it.
    pub fn rows_bf16(base16: u64, width: usize, h: Heads) -> Self {
        Self::in_rows_of(base16, 0, width, (h, 1), true)
    }

    /// The q, k and v heads of qkv rows (B T, (H + 2 Hkv) d), read in place.
    pub fn qkv(qkv: u64, h: Heads) -> [Self; 3] {
        Self::qkv_of(qkv, h, false)
    }

    /// The q, k and v heads of bf16 rows laid out as qkv's: where a kernel writes the
    /// heads' gradients rounded, for the bf16 products that read them next.
    pub fn qkv_bf16(qkv16: u64, h: Heads) -> [Self; 3] {
        Self::qkv_of(qkv16, h, true)
    }

    fn qkv_of(qkv: u64, h: Heads, bf16: bool) -> [Self; 3] {
        let (width, group) = ((h.heads + 2 * h.kv_heads) * h.d, h.heads / h.kv_heads);
        [
            Self::in_rows_of(qkv, 0, width, (h, 1), bf16),
            Self::in_rows_of(qkv, h.heads * h.d, width, (h, group), bf16),
            Self::in_rows_of(qkv, (h.heads + h.kv_heads) * h.d, width, (h, group), bf16),
        ]
    }
}

/// Bytes of one element of a view's heads.
fn element_bytes(view: HeadView) -> usize {
    if view.bf16 != 0 {
        2
    } else {
        4
    }
}

/// Where a kernel reads an input: f32 values, or bf16 ones. With `round`, f32 values
/// are rounded to bf16 as they are read: in bf16 training with products that round
/// their operands on the fly, an f32 buffer stands in for the bf16 one the product
/// would write (the logits, the MLP's projection and its gradient), the same numbers.
#[derive(Debug, Clone, Copy)]
pub enum In {
    F32 { at: u64, round: bool },
    Bf16(u64),
}

impl In {
    /// f32 values at `at`, read as they are.
    pub fn f32(at: u64) -> Self {
        In::F32 { at, round: false }
    }

    /// The kernel's three arguments: the f32 address, the bf16 one (one is 0), and
    /// whether f32 values are rounded.
    fn args(self) -> (u64, u64, i32) {
        match self {
            In::F32 { at, round } => (at, 0, i32::from(round)),
            In::Bf16(at) => (0, at, 0),
        }
    }

    /// Bytes read for `values` values.
    fn bytes(self, values: usize) -> f64 {
        let per = match self {
            In::F32 { .. } => 4,
            In::Bf16(_) => 2,
        };
        (per * values) as f64
    }
}

/// Where a kernel writes an output: as f32, rounded to bf16 for a product that reads
/// it, or both (an address of 0 is not written).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Out {
    pub f32: u64,
    pub bf16: u64,
}

impl Out {
    /// f32 values at `f32`.
    pub fn f32(f32: u64) -> Self {
        Self { f32, bf16: 0 }
    }

    /// Bytes written for `values` values.
    fn bytes(&self, values: usize) -> f64 {
        let per = 4 * usize::from(self.f32 != 0) + 2 * usize::from(self.bf16 != 0);
        (per * values) as f64
    }
}

/// Sizes of a batch of heads: (B, H, T, d), grouped K/V heads Hkv.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub batch: usize,
    pub t: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub d: usize,
}

impl Heads {
    /// Values of the query heads (B, H, T, d).
    fn len(&self) -> usize {
        self.batch * self.heads * self.t * self.d
    }

    /// Values of the key (or value) heads (B, Hkv, T, d).
    fn kv_len(&self) -> usize {
        self.batch * self.kv_heads * self.t * self.d
    }

    /// Rows of all query heads (B H T).
    fn rows(&self) -> usize {
        self.batch * self.heads * self.t
    }

    /// The (T, T) scores of every head.
    fn scores(&self) -> usize {
        self.rows() * self.t
    }

    /// FLOPs of one (T x d) by (d x T) product per head over the causal half.
    fn causal_product(&self) -> usize {
        self.scores() * self.d
    }
}

/// The width of fc, the MLP's first projection, for `hidden` units (gate | up for
/// SwiGLU).
fn fc_width(hidden: usize, kind: MlpKind) -> usize {
    match kind {
        MlpKind::Swiglu => 2 * hidden,
        MlpKind::Gelu | MlpKind::GeluTanh => hidden,
    }
}

impl Gpu {
    /// x (rows x C) = (wte[ids] + positions[at.first + row % at.t]) * mask;
    /// `positions` 0 for none.
    #[allow(clippy::too_many_arguments)]
    pub fn embedding_forward(
        &self,
        x: u64,
        ids: u64,
        wte: u64,
        positions: u64,
        rows: usize,
        at: impl Into<At>,
        c: usize,
        dropout: DropoutArgs,
    ) -> Result<()> {
        let at = at.into();
        launch!(self, EmbeddingForward, warp_rows(rows), Cost::f32s(rows * c * (2 + usize::from(positions != 0)));
            x, ids, wte, positions, int(rows), int(at.t), int(at.first), at.first_at, at.places, int(c),
            dropout)
    }

    /// dwte[tokens[u]] += the rows order[starts[u] .. starts[u + 1]] of dx * mask, for
    /// every u below `rows` (the ranges past the `distinct` tokens empty).
    pub fn embedding_backward_tokens(
        &self,
        dwte: u64,
        dx: u64,
        (tokens, starts, order): (u64, u64, u64),
        (rows, distinct): (usize, usize),
        c: usize,
        dropout: DropoutArgs,
    ) -> Result<()> {
        let cfg = Launch {
            grid: (rows as u32, c.div_ceil(THREADS as usize) as u32, 1),
            threads: THREADS,
        };
        launch!(self, EmbeddingBackwardTokens, cfg, Cost::f32s(2 * rows * c + distinct * c);
            dwte, dx, tokens, starts, order, int(c), dropout)
    }

    /// dwpe[t] += the sum over sequences of dx * mask at position t.
    pub fn embedding_backward_positions(
        &self,
        dwpe: u64,
        dx: u64,
        (b, t, c): (usize, usize, usize),
        dropout: DropoutArgs,
    ) -> Result<()> {
        launch!(self, EmbeddingBackwardPositions, elements(t * c), Cost::f32s((b + 2) * t * c);
            dwpe, dx, int(b), int(t), int(c), dropout)
    }

    /// out = the norm of each row of x, keeping each row's mean and rstd.
    pub fn norm_forward(&self, out: Out, x: u64, n: NormRows, eps: f32) -> Result<()> {
        let values = n.rows * n.c;
        let cost = Cost::new(
            (8 * values) as f64,
            4.0 * (values + 2 * n.rows) as f64 + out.bytes(values),
        );
        launch!(self, NormForward, warp_rows(n.rows), cost;
            out.f32, out.bf16, n.mean, n.rstd, x, n.weight, n.bias, int(n.rows), int(n.c), eps, n.rms())
    }

    /// res = x + (branch + its bias) * mask, then out = the norm of each row of res
    /// (keeping each row's mean and rstd): a residual add and the next norm in one
    /// pass. The branch is its product's output (f32 or bf16), its layer's bias
    /// (`branch_bias`, 0 for none) added here.
    pub fn residual_norm_forward(
        &self,
        (res, x, (branch, branch_bias), dropout): (u64, u64, (In, u64), DropoutArgs),
        out: Out,
        n: NormRows,
        eps: f32,
    ) -> Result<()> {
        let values = n.rows * n.c;
        let cost = Cost::new(
            (9 * values) as f64,
            4.0 * (2 * values + 2 * n.rows) as f64 + branch.bytes(values) + out.bytes(values),
        );
        let (branch32, branch16, round) = branch.args();
        launch!(self, ResidualNormForward, warp_rows(n.rows), cost;
            res, out.f32, out.bf16, n.mean, n.rstd, x, branch32, branch16, round, branch_bias,
            dropout, n.weight, n.bias, int(n.rows), int(n.c), eps, n.rms())
    }

    /// The forward's output again from the kept statistics.
    pub fn norm_apply(&self, out: Out, x: u64, n: NormRows) -> Result<()> {
        let values = n.rows * n.c;
        let cost = Cost::new((4 * values) as f64, 4.0 * values as f64 + out.bytes(values));
        launch!(self, NormApply, warp_rows(n.rows), cost;
            out.f32, out.bf16, x, n.weight, n.bias, n.mean, n.rstd, int(n.rows), int(n.c))
    }

    /// dx += d(norm)/dx . dout (and, where `dx16` is not 0, the new dx rounded to bf16
    /// there); then the gain's (and bias's) gradients `dw` (`db`, 0 for none) += theirs,
    /// via `partials` (`plan::partials_len` floats). Rows of up to
    /// NORM_ONE_PASS_WIDTH in one pass (`norm_backward`), wider ones in two.
    pub fn norm_backward(
        &self,
        (dx, dx16, dout, x): (u64, u64, In, u64),
        n: NormRows,
        (dw, db): (u64, u64),
        partials: u64,
    ) -> Result<()> {
        let (rows, c) = (n.rows, n.c);
        let (dout32, dout16, round) = dout.args();
        // Bytes of dout beyond f32's 4 a value, counted below as f32.
        let dout_saved = 4.0 * (rows * c) as f64 - dout.bytes(rows * c);
        let parts = if c <= NORM_ONE_PASS_WIDTH {
            // Blocks of two warps, at most NORM_PARTS warps (each warp's sums are one
            // partial row): small blocks, so the warps spread over every SM.
            let per_block = 2;
            let blocks = rows.min(super::plan::NORM_PARTS).div_ceil(per_block);
            let cfg = Launch {
                grid: (blocks as u32, 1, 1),
                threads: 32 * per_block as u32,
            };
            let (flops, f32s) = (15 * rows * c, 4 * rows * c + 2 * blocks * per_block * c);
            let rounded = if dx16 != 0 { 2 * rows * c } else { 0 };
            let cost = Cost::new(flops as f64, (4 * f32s + rounded) as f64 - dout_saved);
            launch!(self, NormBackward, cfg, cost;
                dx, dx16, partials, dout32, dout16, round, x, n.weight, n.mean, n.rstd,
                int(rows), int(c), n.rms())?;
            blocks * per_block
        } else {
            let rounded = if dx16 != 0 { 2 * rows * c } else { 0 };
            let cost = Cost::new(
                (12 * rows * c) as f64,
                (16 * rows * c + rounded) as f64 - dout_saved,
            );
            launch!(self, NormBackwardInput, warp_rows(rows), cost;
                dx, dx16, dout32, dout16, round, x, n.weight, n.mean, n.rstd, int(rows), int(c),
                n.rms())?;
            let parts = super::plan::PARTS.min(rows);
            let cost = Cost::new((4 * rows * c) as f64, (8 * rows * c) as f64 - dout_saved);
            launch!(self, NormBackwardParams, columns(c, parts), cost;
                partials, dout32, dout16, round, x, n.mean, n.rstd, int(rows), int(c))?;
            parts
        };
        self.add_column_sums(dw, partials, parts, 2 * c, c)?;
        if db != 0 {
            self.add_column_sums(db, partials + 4 * c as u64, parts, 2 * c, c)?;
        }
        Ok(())
    }

    /// db += the column sums of x (rows x cols, f32 or bf16), via `partials` (PARTS x
    /// cols).
    pub fn bias_backward(
        &self,
        db: u64,
        x: In,
        rows: usize,
        cols: usize,
        partials: u64,
    ) -> Result<()> {
        let parts = super::plan::PARTS.min(rows);
        let cost = Cost::new((rows * cols) as f64, x.bytes(rows * cols));
        let (x32, x16, round) = x.args();
        launch!(self, ColumnPartials, columns(cols, parts), cost;
            partials, x32, x16, round, int(rows), int(cols))?;
        self.add_column_sums(db, partials, parts, cols, cols)
    }

    fn add_column_sums(
        &self,
        dst: u64,
        partials: u64,
        parts: usize,
        stride: usize,
        count: usize,
    ) -> Result<()> {
        launch!(self, AddColumnSums, columns(count, 1), Cost::f32s_and_flops((parts + 2) * count, parts * count);
            dst, partials, int(parts), int(stride), int(count))
    }

    /// out (rows x hidden) = the MLP's non-linearity of fc plus its bias (`bias`, 0
    /// without one).
    pub fn activation_forward(
        &self,
        out: Out,
        (fc, bias): (In, u64),
        rows: usize,
        hidden: usize,
        kind: MlpKind,
    ) -> Result<()> {
        let values = rows * hidden;
        let read = fc.bytes(rows * fc_width(hidden, kind));
        let cost = Cost::new((10 * values) as f64, read + out.bytes(values));
        let (fc32, fc16, round_fc) = fc.args();
        launch!(self, ActivationForward, activation_elements(values, kind), cost;
            out.f32, out.bf16, fc32, fc16, round_fc, bias, int(rows), int(hidden),
            activation_kind(kind))
    }

    /// dfc = the non-linearity's backward of dout (written), at fc plus its bias.
    pub fn activation_backward(
        &self,
        dfc: Out,
        (fc, bias): (In, u64),
        dout: In,
        (rows, hidden): (usize, usize),
        kind: MlpKind,
    ) -> Result<()> {
        let fc_values = rows * fc_width(hidden, kind);
        let read = fc.bytes(fc_values) + dout.bytes(rows * hidden);
        let cost = Cost::new((20 * rows * hidden) as f64, read + dfc.bytes(fc_values));
        let (fc32, fc16, round_fc) = fc.args();
        let (dout32, dout16, round_dout) = dout.args();
        launch!(self, ActivationBackward, activation_elements(rows * hidden, kind), cost;
            dfc.f32, dfc.bf16, fc32, fc16, round_fc, bias, dout32, dout16, round_dout,
            int(rows), int(hidden), activation_kind(kind))
    }

    /// out = x + branch * mask.
    pub fn residual(
        &self,
        out: u64,
        x: u64,
        branch: u64,
        n: usize,
        dropout: DropoutArgs,
    ) -> Result<()> {
        launch!(self, ResidualForward, elements(n), Cost::f32s_and_flops(3 * n, n); out, x, branch, long(n), dropout)
    }

    /// out = x * mask.
    pub fn dropout(&self, out: u64, x: u64, n: usize, dropout: DropoutArgs) -> Result<()> {
        launch!(self, DropoutApply, elements(n), Cost::f32s_and_flops(2 * n, n); out, x, long(n), dropout)
    }

    /// out16[r] = bf16(out16[r] + b), rows of `cols` in bf16.
    pub fn add_bias16(&self, out16: u64, b: u64, rows: usize, cols: usize) -> Result<()> {
        let cost = Cost::new((rows * cols) as f64, (4 * rows * cols + 4 * cols) as f64);
        launch!(self, AddBias16, warp_rows(rows), cost; out16, b, int(rows), int(cols))
    }

    /// out[r] += b, rows of `cols`.
    pub fn add_bias(&self, out: u64, b: u64, rows: usize, cols: usize) -> Result<()> {
        launch!(self, AddBias, warp_rows(rows), Cost::f32s_and_flops(2 * rows * cols, rows * cols); out, b, int(rows), int(cols))
    }

    /// Turns the q and k heads of qkv rows (width `w`) by their positions' angles;
    /// `sign` -1 turns back.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        qkv: u64,
        (cos, sin): (u64, u64),
        rows: usize,
        at: impl Into<At>,
        h: Heads,
        w: usize,
        sign: f32,
    ) -> Result<()> {
        let at = at.into();
        let turned = h.heads + h.kv_heads;
        launch!(self, Rope, warp_rows(rows), Cost::f32s_and_flops(2 * rows * turned * h.d, 3 * rows * turned * h.d);
            qkv, cos, sin, int(rows), int(at.t), int(at.first), at.first_at, at.places, int(turned),
            int(h.d), int(w), sign)
    }

    /// q, k, v (B, H, T, d) from qkv rows.
    pub fn split_heads(&self, (q, k, v): (u64, u64, u64), qkv: u64, h: Heads) -> Result<()> {
        launch!(self, SplitHeads, elements(h.len()), Cost::f32s(2 * (h.len() + 2 * h.kv_len()));
            q, k, v, qkv, int(h.batch), int(h.t), int(h.heads), int(h.kv_heads), int(h.d))
    }

    /// Rows (B T, H d) from heads (B, H, T, d).
    pub fn merge_heads(&self, y: u64, heads: u64, h: Heads) -> Result<()> {
        launch!(self, MergeHeads, elements(h.len()), Cost::f32s(2 * h.len());
            y, heads, int(h.batch), int(h.t), int(h.heads), int(h.d))
    }

    /// Heads (B, H, T, d) from rows (B T, H d).
    pub fn split_rows(&self, heads: u64, y: u64, h: Heads) -> Result<()> {
        launch!(self, SplitRows, elements(h.len()), Cost::f32s(2 * h.len());
            heads, y, int(h.batch), int(h.t), int(h.heads), int(h.d))
    }

    /// dqkv rows from dq, dk, dv (B, H, T, d), grouped K/V heads summed.
    pub fn merge_head_grads(
        &self,
        dqkv: u64,
        (dq, dk, dv): (u64, u64, u64),
        h: Heads,
    ) -> Result<()> {
        let w = (h.heads + 2 * h.kv_heads) * h.d;
        launch!(self, MergeHeadGrads, elements(h.batch * h.t * w), Cost::f32s(2 * h.batch * h.t * w);
            dqkv, dq, dk, dv, int(h.batch), int(h.t), int(h.heads), int(h.kv_heads), int(h.d))
    }

    /// In place on (B H, T, T) scores: the causal softmax of each row, times the mask.
    pub fn causal_softmax(&self, att: u64, h: Heads, dropout: DropoutArgs) -> Result<()> {
        let rows = h.batch * h.heads * h.t;
        launch!(self, CausalSoftmax, warp_rows(rows), Cost::f32s_and_flops(2 * h.scores(), 4 * h.scores());
            att, int(h.batch * h.heads), int(h.t), dropout)
    }

    /// out = the dropped causal attention of the heads `q, k, v`, read and written
    /// where their views say, without the (T, T) weights (kernels/flash.cu); lse (B H,
    /// T) = each row's log-sum-exp of its scaled scores, for the backward.
    pub fn flash_forward(
        &self,
        (out, lse): (HeadView, u64),
        [q, k, v]: [HeadView; 3],
        h: Heads,
        dropout: DropoutArgs,
    ) -> Result<()> {
        let heads_read = element_bytes(q) * (h.len() + 2 * h.kv_len());
        let bytes = heads_read + element_bytes(out) * h.len() + 4 * h.rows();
        let cost = Cost::new((2 * h.causal_product()) as f64, bytes as f64);
        launch!(self, FlashForward, flash_grid(h), cost;
            out, lse, q, k, v, int(h.t), int(h.d), int(h.heads), attention_scale(h), dropout)
    }

    /// dsum (B H, T) = each row's dY . Y over its head, from the merged (B T, H d) dY
    /// and Y.
    pub fn flash_backward_sums(&self, dsum: u64, dy: In, y: In, h: Heads) -> Result<()> {
        let rows = h.batch * h.heads * h.t;
        let bytes = dy.bytes(h.len()) + y.bytes(h.len()) + 4.0 * h.rows() as f64;
        let cost = Cost::new((2 * h.len()) as f64, bytes);
        let ((dy32, dy16, round_dy), (y32, y16, round_y)) = (dy.args(), y.args());
        launch!(self, FlashBackwardSums, warp_rows(rows), cost;
            dsum, dy32, dy16, round_dy, y32, y16, round_y,
            int(h.batch), int(h.t), int(h.heads), int(h.d))
    }

    /// dK, dV (per query head), then dQ of flash attention, written where their
    /// views say, from the heads, their output's gradient `dy`, and the forward's lse
    /// and `dsum`.
    pub fn flash_backward(
        &self,
        [dq, dk, dv]: [HeadView; 3],
        [q, k, v]: [HeadView; 3],
        (dy, lse, dsum): (HeadView, u64, u64),
        h: Heads,
        dropout: DropoutArgs,
    ) -> Result<()> {
        let (t, d, heads, scale) = (int(h.t), int(h.d), int(h.heads), attention_scale(h));
        // Reads q, k, v (f32 or bf16), dy and two values a row; writes its gradients,
        // f32 or bf16.
        let written = (element_bytes(dq) * h.len()) as f64;
        let heads_read = element_bytes(q) * (h.len() + 2 * h.kv_len());
        let read = (heads_read + element_bytes(dy) * h.len() + 8 * h.rows()) as f64;
        let kv_cost = Cost::new((4 * h.causal_product()) as f64, read + 2.0 * written);
        launch!(self, FlashBackwardKv, flash_grid(h), kv_cost;
            dk, dv, q, k, v, dy, lse, dsum, t, d, heads, scale, dropout)?;
        let q_cost = Cost::new((3 * h.causal_product()) as f64, read + written);
        launch!(self, FlashBackwardQ, flash_grid(h), q_cost;
            dq, q, k, v, dy, lse, dsum, t, d, heads, scale, dropout)
    }

    /// In place on datt: the scores' gradient, given the weights `p`.
    pub fn causal_softmax_backward(
        &self,
        datt: u64,
        p: u64,
        h: Heads,
        dropout: DropoutArgs,
    ) -> Result<()> {
        let rows = h.batch * h.heads * h.t;
        launch!(self, CausalSoftmaxBackward, warp_rows(rows), Cost::f32s_and_flops(3 * h.scores(), 4 * h.scores());
            datt, p, int(h.batch * h.heads), int(h.t), dropout)
    }

    /// row_loss = -log p[target] per row of logits (rows x V), and in place on the
    /// logits their probabilities; or, with `grad16` (not 0), the loss's gradient at
    /// them, p - onehot(target) unscaled, in bf16 there instead.
    pub fn softmax_cross_entropy(
        &self,
        (logits, grad16): (In, u64),
        row_loss: u64,
        targets: u64,
        rows: usize,
        v: usize,
    ) -> Result<()> {
        let cfg = Launch {
            grid: (rows as u32, 1, 1),
            threads: v.next_power_of_two().clamp(32, 1024) as u32,
        };
        let (logits32, logits16, round) = logits.args();
        // Two passes read the row; the softmax or the gradient written once.
        let written = if grad16 == 0 { 4.0 } else { 2.0 };
        let cost = Cost::new(
            (4 * rows * v) as f64,
            2.0 * logits.bytes(rows * v) + written * (rows * v) as f64,
        );
        launch!(self, SoftmaxCrossEntropy, cfg, cost;
            logits32, logits16, grad16, row_loss, targets, int(rows), int(v), round)
    }

    /// In place on probabilities: p - onehot(target) (unscaled).
    pub fn cross_entropy_backward(
        &self,
        probs: u64,
        targets: u64,
        rows: usize,
        v: usize,
    ) -> Result<()> {
        launch!(self, CrossEntropyBackward, elements(rows), Cost::f32s(2 * rows); probs, targets, int(rows), int(v))
    }

    /// out[0] = sum of x^2 over n f32 values, in f64, through `partials` (at most
    /// NORM_BLOCKS, one per block of the first pass).
    pub fn sum_squares(&self, out: u64, x: u64, n: usize, partials: u64) -> Result<()> {
        let blocks = n
            .div_ceil(THREADS as usize)
            .clamp(1, super::plan::NORM_BLOCKS);
        let cfg = Launch {
            grid: (blocks as u32, 1, 1),
            threads: THREADS,
        };
        launch!(self, SumSquares, cfg, Cost::f32s_and_flops(n, 2 * n); partials, x, long(n))?;
        self.sum_all(out, partials, 0, blocks, Sum::Replace)
    }

    /// out[0] = the sum of n f32 losses `x32`: the classifier's, for a profile.
    pub fn sum_losses(&self, out: u64, x32: u64, n: usize) -> Result<()> {
        let cfg = Launch {
            grid: (1, 1, 1),
            threads: 1024,
        };
        launch!(self, SumAll as Group::Classifier, cfg, Cost::f32s_and_flops(n, n);
            out, 0u64, x32, int(n), i32::from(false))
    }

    /// out[0] = the sum of n f64 values `x`, or of n f32 values `x32` when not 0;
    /// `Sum::Add` adds it to out[0].
    pub fn sum_all(&self, out: u64, x: u64, x32: u64, n: usize, into: Sum) -> Result<()> {
        let cfg = Launch {
            grid: (1, 1, 1),
            threads: 1024,
        };
        let accumulate = i32::from(into == Sum::Add);
        launch!(self, SumAll, cfg, Cost::f32s_and_flops(if x32 != 0 { n } else { 2 * n }, n); out, x, x32, int(n), accumulate)
    }

    /// Scales n f32 values `x` to an L2 norm of `max_norm` where the norm they have
    /// (the square root of the f64 at `norm_sq`) is larger: clipping decided on the
    /// device, as `optim::clip_scale` decides it on the host.
    pub fn clip_to_norm(&self, x: u64, n: usize, norm_sq: u64, max_norm: f64) -> Result<()> {
        launch!(self, ClipToNorm, elements(n), Cost::f32s_and_flops(2 * n, n); x, long(n), norm_sq, max_norm)
    }

    /// AdamW over n parameters in one launch, a block per chunk of `chunks` (from
    /// [`adamw_chunks`]), with the numbers of a decaying tensor (`p.shrink` applies
    /// only to the chunks of decaying tensors); the bf16 copy written where given.
    pub fn adamw(&self, buffers: AdamBuffers, n: usize, p: AdamWF32) -> Result<()> {
        let AdamBuffers {
            params,
            copy16,
            grads,
            m,
            v,
            chunks,
            blocks,
        } = buffers;
        let cfg = Launch {
            grid: (u32::try_from(blocks).expect("chunks under 2^32"), 1, 1),
            threads: THREADS,
        };
        let written = if copy16 == 0 { 0.0 } else { 2.0 * n as f64 };
        let cost = Cost::new((12 * n) as f64, (28 * n) as f64 + written);
        launch!(self, Adamw, cfg, cost;
            params, copy16, grads, m, v, chunks,
            p.b1, p.b2, p.inv_bc1, p.inv_bc2, p.lr, p.eps, p.shrink)
    }

    /// Each row's key and value heads into its sequence's cache slot at its position.
    pub fn store_keys_values(&self, r: CachedRows) -> Result<()> {
        let (h, at) = (r.h, r.at);
        let kv = h.kv_heads * h.d;
        let (c, w) = (h.heads * h.d, (h.heads + 2 * h.kv_heads) * h.d);
        launch!(self, StoreKeysValues, elements(r.rows * kv), Cost::f32s(4 * r.rows * kv);
            r.keys, r.values, r.qkv, int(r.rows), int(at.t), int(at.first), at.first_at,
            at.places, int(c), int(kv), int(w), int(r.block))
    }

    /// out (rows, H d): each row's query heads attending over its sequence's cache up
    /// to its position, in chunks of positions (`CACHED_CHUNK`) combined after;
    /// `partial` is work space of [`cached_attention_partials`] values.
    pub fn attend_cached(&self, (out, partial): (u64, u64), r: CachedRows) -> Result<()> {
        let (h, at, rows) = (r.h, r.at, r.rows);
        let splits = r.block.div_ceil(CACHED_CHUNK);
        let cfg = Launch {
            grid: ((rows * h.heads) as u32, splits as u32, 1),
            threads: 128,
        };
        launch!(self, AttendCachedPartial, cfg, Cost::f32s_and_flops(rows * h.heads * h.d + 2 * rows * h.kv_heads * r.block * h.d, 4 * rows * h.heads * r.block * h.d);
            partial, r.qkv, r.keys, r.values, int(rows), int(at.t), int(at.first), at.first_at,
            at.places, int(h.heads), int(h.kv_heads), int(h.d), int(r.block), int(splits))?;
        launch!(self, AttendCachedCombine, warp_rows(rows * h.heads), Cost::f32s(rows * h.heads * (splits * (h.d + 2) + h.d));
            out, partial, int(rows), int(at.t), int(at.first), at.first_at, at.places, int(h.heads),
            int(h.d), int(splits))
    }

    /// dst (n bf16 values) = src (n f32 values) rounded to nearest even.
    pub fn to_bf16(&self, dst: u64, src: u64, n: usize) -> Result<()> {
        launch!(self, ToBf16, elements(n), Cost::new(0.0, 6.0 * n as f64); dst, src, long(n))
    }

    /// dst (batch, C) = each sequence's last row of src (batch T, C).
    pub fn last_rows(&self, dst: u64, src: u64, batch: usize, t: usize, c: usize) -> Result<()> {
        launch!(self, LastRows, elements(batch * c), Cost::f32s(2 * batch * c); dst, src, int(batch), int(t), int(c), 0u64)
    }

    /// dst (n, C) = the rows of src that `picks` (n i32 row indices, on the device) names.
    pub fn pick_rows(&self, dst: u64, src: u64, picks: u64, n: usize, c: usize) -> Result<()> {
        launch!(self, LastRows, elements(n * c), Cost::f32s(2 * n * c); dst, src, int(n), int(1), int(c), picks)
    }

    /// chosen[b] = row b's next token from logits (batch, V) and its uniform draw
    /// uniforms[b] (f64), as the host's sampler chooses; ids from `text_vocab` on are
    /// never chosen. The repetition penalty reads `context` (batch, `stride`) up to
    /// `context_len`.
    #[allow(clippy::too_many_arguments)]
    pub fn sample_tokens(
        &self,
        chosen: u64,
        work: &SamplingWork,
        logits: u64,
        (context, context_len, stride): (u64, usize, usize),
        uniforms: u64,
        (batch, vocab, text_vocab): (usize, usize, usize),
        args: SamplingArgs,
    ) -> Result<()> {
        let cfg = Launch {
            grid: (batch as u32, 1, 1),
            threads: 1024,
        };
        launch!(self, SampleTokens, cfg, Cost::f32s(3 * batch * vocab);
            chosen, work.weights, work.keys, work.seen, logits, context, int(context_len),
            int(stride), uniforms, int(vocab), int(text_vocab), args)
    }
}

/// Where a one-block sum goes: over what its output holds, or added to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sum {
    Replace,
    Add,
}

/// The flat buffers AdamW updates (from the first value it updates), the bf16 copy to
/// write (0: none), and its chunks (`blocks` of them, from [`adamw_chunks`]).
pub struct AdamBuffers {
    pub params: u64,
    pub copy16: u64,
    pub grads: u64,
    pub m: u64,
    pub v: u64,
    pub chunks: u64,
    pub blocks: usize,
}

pub use super::plan::ADAMW_CHUNK;

/// AdamW's chunks over the values `range` of flat buffers laid out as `table`: each
/// tensor's part of the range cut into pieces of at most [`ADAMW_CHUNK`], as pairs
/// (first value counted from `range.start`, length | 1 << 32 where the tensor decays),
/// in order, covering the range once.
pub fn adamw_chunks(
    table: &[crate::model::spec::Param],
    range: std::ops::Range<usize>,
) -> Vec<u64> {
    let mut chunks = Vec::new();
    for p in table {
        let (start, end) = (
            p.offset.max(range.start),
            (p.offset + p.len()).min(range.end),
        );
        let mut first = start;
        while first < end {
            let len = ADAMW_CHUNK.min(end - first);
            chunks.push((first - range.start) as u64);
            chunks.push(len as u64 | u64::from(p.decay) << 32);
            first += len;
        }
    }
    chunks
}

#[cfg(test)]
mod tests {
    use super::super::buffers::Buf;
    use super::*;
    use crate::config::Math;

    /// Where the kernels can run in this build: the emulator, and the first GPU where
    /// the build and the machine have one (said loudly when not).
    #[allow(clippy::vec_init_then_push)] // which pushes there are depends on the features
    fn gpus() -> Vec<(&'static str, Gpu)> {
        #[allow(unused_mut)]
        let mut gpus = Vec::new();
        #[cfg(feature = "cuda-emulator")]
        gpus.push(("emulator", Gpu::Emulated));
        #[cfg(feature = "cuda")]
        match candle_core::Device::new_cuda(0) {
            Ok(device) => gpus.push(("cuda", Gpu::cuda(&device, "the kernel tests").unwrap())),
            Err(e) => eprintln!("SKIPPED on CUDA (no CUDA device: {e})"),
        }
        gpus
    }

    /// max |got - want| over max |want|.
    fn rel_err(got: &[f32], want: &[f64]) -> f64 {
        let scale = want.iter().fold(1e-12f64, |m, x| m.max(x.abs()));
        let diff = got
            .iter()
            .zip(want)
            .fold(0f64, |m, (g, w)| m.max((*g as f64 - w).abs()));
        diff / scale
    }

    /// What attention computes, written out in f64 for heads (B H, T, d): the output, each
    /// row's log-sum-exp, and dQ, dK, dV given the output's gradient `dy`.
    struct Written {
        out: Vec<f64>,
        lse: Vec<f64>,
        dq: Vec<f64>,
        dk: Vec<f64>,
        dv: Vec<f64>,
    }

    fn written_out(
        (q, k, v, dy): (&[f32], &[f32], &[f32], &[f32]),
        (bh, t, d): (usize, usize, usize),
        mask: impl Fn(usize) -> f64,
    ) -> Written {
        let scale = 1.0 / (d as f64).sqrt();
        let at = |x: &[f32], head: usize, row: usize, c: usize| x[(head * t + row) * d + c] as f64;
        let n = bh * t * d;
        let mut w = Written {
            out: vec![0.0; n],
            lse: vec![0.0; bh * t],
            dq: vec![0.0; n],
            dk: vec![0.0; n],
            dv: vec![0.0; n],
        };
        for head in 0..bh {
            for i in 0..t {
                let s: Vec<f64> = (0..=i)
                    .map(|j| {
                        scale
                            * (0..d)
                                .map(|c| at(q, head, i, c) * at(k, head, j, c))
                                .sum::<f64>()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let lse = m + s.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
                w.lse[head * t + i] = lse;
                let p: Vec<f64> = s.iter().map(|x| (x - lse).exp()).collect();
                let keep: Vec<f64> = (0..=i).map(|j| mask((head * t + i) * t + j)).collect();
                let dp: Vec<f64> = (0..=i)
                    .map(|j| {
                        keep[j]
                            * (0..d)
                                .map(|c| at(dy, head, i, c) * at(v, head, j, c))
                                .sum::<f64>()
                    })
                    .collect();
                let dsum: f64 = (0..=i).map(|j| p[j] * dp[j]).sum();
                for j in 0..=i {
                    let ds = p[j] * (dp[j] - dsum);
                    for c in 0..d {
                        let (row, col) = ((head * t + i) * d + c, (head * t + j) * d + c);
                        w.out[row] += p[j] * keep[j] * at(v, head, j, c);
                        w.dv[col] += p[j] * keep[j] * at(dy, head, i, c);
                        w.dq[row] += scale * ds * at(k, head, j, c);
                        w.dk[col] += scale * ds * at(q, head, i, c);
                    }
                }
            }
        }
        w
    }

    /// Flash attention's kernels against attention written out in f64: the output, the
    /// log-sum-exps and all three gradients within bf16 rounding, for blocks that are not
    /// whole tiles, several thread blocks of rows, and dropout. Inputs of unit size make
    /// the weights peaked, so the scores' gradients (dQ, dK) are far from negligible.
    /// AdamW's chunks cover a range once, in order, each within one tensor and at most
    /// ADAMW_CHUNK long, marked as their tensor decays; a rank's range cuts tensors.
    #[test]
    fn adamw_chunks_cover_the_range_by_tensor() {
        let cfg = crate::config::ModelConfig {
            n_layer: 1,
            n_head: 2,
            n_embd: 96,
            block_size: 8,
            vocab_size: 50,
            ..crate::config::ModelConfig::default()
        };
        let spec = crate::model::ModelSpec::new(&cfg);
        let table = spec.params();
        for range in [0..spec.len(), 1000..spec.len() - 77, 5..6] {
            let chunks = adamw_chunks(table, range.clone());
            let mut next = range.start;
            for pair in chunks.chunks(2) {
                let (first, len) = (
                    range.start + pair[0] as usize,
                    (pair[1] & 0xffff_ffff) as usize,
                );
                assert_eq!(first, next, "in order, no gap or overlap");
                assert!((1..=ADAMW_CHUNK).contains(&len));
                let tensor = table.iter().find(|p| p.range().contains(&first)).unwrap();
                assert!(
                    first + len <= tensor.offset + tensor.len(),
                    "within {}",
                    tensor.name
                );
                assert_eq!(pair[1] >> 32 == 1, tensor.decay, "{}", tensor.name);
                next = first + len;
            }
            assert_eq!(next, range.end);
        }
        // The token embedding (50 x 96 = 4,800 values) takes two chunks.
        let whole = adamw_chunks(table, 0..spec.len());
        assert_eq!(
            (whole[1] & 0xffff_ffff, whole[3] & 0xffff_ffff),
            (4096, 704)
        );
    }

    #[test]
    fn flash_attention_matches_attention_written_out() {
        for (place, gpu) in gpus() {
            flash_attention_on(place, &gpu);
        }
    }

    fn flash_attention_on(place: &str, gpu: &Gpu) {
        gpu.bind().unwrap();
        for (batch, heads, t, d, p) in [
            (1, 2, 37, 16, 0.0),
            (2, 1, 70, 32, 0.3),
            (1, 1, 200, 64, 0.1),
        ] {
            let h = Heads {
                batch,
                t,
                heads,
                kv_heads: heads,
                d,
            };
            let (bh, n) = (batch * heads, batch * heads * t * d);
            let random = |seed: u32| -> Vec<f32> {
                (0..n as u32)
                    .map(|i| {
                        let x = i
                            .wrapping_mul(2654435761)
                            .wrapping_add(seed.wrapping_mul(40503));
                        ((x >> 8) % 2001) as f32 / 1000.0 - 1.0
                    })
                    .collect()
            };
            let (q, k, v, dy) = (random(1), random(2), random(3), random(4));
            let dropout = crate::model::Dropout::in_pass(p, 9, 3, 1);
            let site = Site::AttentionWeights(1);
            let mask = |element: usize| {
                let mut m = [1.0f32];
                if let Some(d) = &dropout {
                    d.fill(site, element, &mut m);
                }
                m[0] as f64
            };
            let want = written_out((&q, &k, &v, &dy), (bh, t, d), mask);

            let up = |x: &[f32]| Buf::from_host(gpu, x).unwrap();
            let (qb, kb, vb, dyb) = (up(&q), up(&k), up(&v), up(&dy));
            let zeros = |len| Buf::<f32>::zeros(gpu, len).unwrap();
            let (out, lse, dsum) = (zeros(n), zeros(bh * t), zeros(bh * t));
            let (dq, dk, dv) = (zeros(n), zeros(n), zeros(n));
            let split = |b: &Buf<f32>| HeadView::split(b.ptr(), h);
            let heads_in = [split(&qb), split(&kb), split(&vb)];
            let args = DropoutArgs::at(dropout.as_ref(), site);
            gpu.flash_forward((split(&out), lse.ptr()), heads_in, h, args)
                .unwrap();
            // dY . Y per row reads the merged (B T, H d) layouts.
            let merged = |x: &[f32]| {
                let mut m = vec![0f32; n];
                for (b, hh, row, c) in (0..batch)
                    .flat_map(|b| (0..heads).map(move |hh| (b, hh)))
                    .flat_map(|(b, hh)| (0..t).map(move |row| (b, hh, row)))
                    .flat_map(|(b, hh, row)| (0..d).map(move |c| (b, hh, row, c)))
                {
                    m[((b * t + row) * heads + hh) * d + c] =
                        x[((b * heads + hh) * t + row) * d + c];
                }
                m
            };
            let (dy_merged, out_merged) =
                (up(&merged(&dy)), up(&merged(&out.read(gpu, n).unwrap())));
            // Rounded to bf16 as they are read, as the engine's are.
            let rounded = |b: &Buf<f32>| In::F32 {
                at: b.ptr(),
                round: true,
            };
            gpu.flash_backward_sums(dsum.ptr(), rounded(&dy_merged), rounded(&out_merged), h)
                .unwrap();
            let given = (split(&dyb), lse.ptr(), dsum.ptr());
            gpu.flash_backward(
                [split(&dq), split(&dk), split(&dv)],
                heads_in,
                given,
                h,
                args,
            )
            .unwrap();

            let what = format!("{place}: B {batch} H {heads} T {t} d {d} dropout {p}");
            let read = |b: &Buf<f32>, len| b.read(gpu, len).unwrap();
            for (name, got, want, tol) in [
                ("out", read(&out, n), &want.out, 1e-2),
                ("lse", read(&lse, bh * t), &want.lse, 1e-2),
                ("dq", read(&dq, n), &want.dq, 2e-2),
                ("dk", read(&dk, n), &want.dk, 2e-2),
                ("dv", read(&dv, n), &want.dv, 1e-2),
            ] {
                let err = rel_err(&got, want);
                assert!(err <= tol, "{what}: {name} off by {err:e}");
                assert!(err > 0.0, "{what}: {name} exact: not rounded to bf16?");
            }
        }
    }

    /// Attention over cached keys and values, taken in chunks of 64 positions and
    /// combined after, against softmax(q k / sqrt(d)) v written out in f64: a batch-1
    /// step at the cache's last position (three chunks, the last part full), prefill
    /// rows crossing a chunk boundary, and rows that start later in the cache; grouped
    /// K/V heads; scores spread over several units so each chunk's max differs.
    #[test]
    fn cached_attention_matches_attention_written_out() {
        for (place, gpu) in gpus() {
            gpu.bind().unwrap();
            let (heads, kv_heads, d, block) = (4usize, 2usize, 8usize, 150usize);
            let (w, kv) = ((heads + 2 * kv_heads) * d, kv_heads * d);
            for (batch, t, first) in [(1usize, 1usize, 149usize), (2, 70, 0), (2, 3, 120)] {
                let rows = batch * t;
                let random = |n: usize, seed: u32, scale: f32| -> Vec<f32> {
                    (0..n as u32)
                        .map(|i| {
                            let x = i
                                .wrapping_mul(2654435761)
                                .wrapping_add(seed.wrapping_mul(40503));
                            scale * (((x >> 8) % 2001) as f32 / 1000.0 - 1.0)
                        })
                        .collect()
                };
                let qkv = random(rows * w, 1, 3.0);
                let (keys, values) = (
                    random(batch * block * kv, 2, 1.0),
                    random(batch * block * kv, 3, 1.0),
                );
                let h = Heads {
                    batch,
                    t: block,
                    heads,
                    kv_heads,
                    d,
                };
                let out = Buf::<f32>::zeros(&gpu, rows * heads * d).unwrap();
                let partial =
                    Buf::<f32>::zeros(&gpu, cached_attention_partials(rows, heads, d, block))
                        .unwrap();
                let (qkv_buf, keys_buf, values_buf) = (
                    Buf::from_host(&gpu, &qkv).unwrap(),
                    Buf::from_host(&gpu, &keys).unwrap(),
                    Buf::from_host(&gpu, &values).unwrap(),
                );
                let at = Positions { t, first };
                let cached = CachedRows {
                    qkv: qkv_buf.ptr(),
                    rows,
                    at: at.into(),
                    h,
                    keys: keys_buf.ptr(),
                    values: values_buf.ptr(),
                    block,
                };
                gpu.attend_cached((out.ptr(), partial.ptr()), cached)
                    .unwrap();
                let got = out.read(&gpu, rows * heads * d).unwrap();
                let mut want = vec![0f64; rows * heads * d];
                for r in 0..rows {
                    let (b, pos) = (r / t, first + r % t);
                    for hd in 0..heads {
                        let g = hd / (heads / kv_heads);
                        let at = |x: &[f32], p: usize, c: usize| {
                            x[(b * block + p) * kv + g * d + c] as f64
                        };
                        let q = |c: usize| qkv[r * w + hd * d + c] as f64;
                        let scores: Vec<f64> = (0..=pos)
                            .map(|p| {
                                (0..d).map(|c| q(c) * at(&keys, p, c)).sum::<f64>()
                                    / (d as f64).sqrt()
                            })
                            .collect();
                        let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                        let sum: f64 = e.iter().sum();
                        for c in 0..d {
                            want[(r * heads + hd) * d + c] =
                                (0..=pos).map(|p| e[p] * at(&values, p, c)).sum::<f64>() / sum;
                        }
                    }
                }
                let err = rel_err(&got, &want);
                assert!(
                    err < 1e-5,
                    "{place}: batch {batch}, {t} rows from position {first}: off by {err}"
                );
            }
        }
    }

    /// `to_bf16` rounds as the host's `to_bf16_bits` (nearest, ties to even; NaN quiet;
    /// infinities, subnormals and the largest finite values), bit for bit.
    #[test]
    fn rounding_to_bf16_is_the_hosts() {
        let mut values = vec![
            0.0f32,
            -0.0,
            1.0,
            f32::from_bits(0x3f80_8000), // a tie: to even (down)
            f32::from_bits(0x3f81_8000), // a tie: to even (up)
            f32::from_bits(0x3f80_8001),
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7f80_0001), // a signalling NaN
            f32::MAX,
            f32::MIN_POSITIVE / 3.0,
        ];
        values.extend((0..500u32).map(|i| f32::from_bits(i.wrapping_mul(2654435761))));
        for (place, gpu) in gpus() {
            let (src, dst) = (
                Buf::from_host(&gpu, &values).unwrap(),
                Buf::<u16>::zeros(&gpu, values.len()).unwrap(),
            );
            gpu.to_bf16(dst.ptr(), src.ptr(), values.len()).unwrap();
            let got = dst.read(&gpu, values.len()).unwrap();
            for (x, g) in values.iter().zip(got) {
                let want = crate::cpu::bf16::to_bf16_bits(*x);
                assert_eq!(g, want, "{place}: {x:e} ({:#x})", x.to_bits());
            }
        }
    }

    /// A one-layer model without biases, its values, and 5 input rows for its MLP's
    /// first layer: the linear-layer tests' fixture.
    fn one_layer() -> (crate::model::ModelSpec, Vec<f32>, Vec<f32>, usize) {
        let cfg = crate::config::ModelConfig {
            n_layer: 1,
            n_head: 2,
            n_embd: 24,
            block_size: 4,
            vocab_size: 7,
            bias: false,
            ..crate::config::ModelConfig::default()
        };
        let spec = crate::model::ModelSpec::new(&cfg);
        let d_in = spec.blocks[0].mlp_fc.d_in;
        let values: Vec<f32> = (0..spec.len() as u32)
            .map(|i| ((i.wrapping_mul(2654435761) >> 8) % 2001) as f32 / 997.0 - 1.0)
            .collect();
        let rows = 5;
        let x: Vec<f32> = (0..(rows * d_in) as u32)
            .map(|i| (i as f32 * 0.37).sin())
            .collect();
        (spec, values, x, rows)
    }

    /// A linear layer over bf16 in memory (the decoder's resident weights, its rows
    /// rounded first) computes what the bf16 product over f32 data does (operands
    /// rounded on the way in, f32 sums): the same numbers in the emulator, within
    /// summation order on a GPU; the bias added either way.
    #[test]
    fn linear_layers_over_bf16_in_memory_are_bf16_products() {
        use super::super::blas::{linear, Weights};
        let (spec, values, x, rows) = one_layer();
        let p = spec.blocks[0].mlp_fc;
        for (place, gpu) in gpus() {
            let params = Buf::from_host(&gpu, &values).unwrap();
            let weights16 = Buf::<u16>::zeros(&gpu, values.len()).unwrap();
            gpu.to_bf16(weights16.ptr(), params.ptr(), values.len())
                .unwrap();
            let (x, x16) = (
                Buf::from_host(&gpu, &x).unwrap(),
                Buf::<u16>::zeros(&gpu, rows * p.d_in).unwrap(),
            );
            gpu.to_bf16(x16.ptr(), x.ptr(), rows * p.d_in).unwrap();
            let (want, got) = (
                Buf::<f32>::zeros(&gpu, rows * p.d_out).unwrap(),
                Buf::<f32>::zeros(&gpu, rows * p.d_out).unwrap(),
            );
            let layer = |weights, out: &Buf<f32>, x: u64| {
                linear(&gpu, weights, &spec, &params, out.ptr(), x, &p, rows).unwrap()
            };
            layer(Weights::F32(Math::Bf16), &want, x.ptr());
            layer(Weights::Bf16(&weights16), &got, x16.ptr());
            let (want, got) = (
                want.read(&gpu, rows * p.d_out).unwrap(),
                got.read(&gpu, rows * p.d_out).unwrap(),
            );
            let want64: Vec<f64> = want.iter().map(|&v| v as f64).collect();
            let err = rel_err(&got, &want64);
            let f32_products = Buf::<f32>::zeros(&gpu, rows * p.d_out).unwrap();
            layer(Weights::F32(Math::F32), &f32_products, x.ptr());
            let exact = f32_products.read(&gpu, rows * p.d_out).unwrap();
            if place == "emulator" {
                assert!(err == 0.0, "{place}: off by {err:e}");
            } else {
                // CUBLAS_COMPUTE_32F_FAST_16BF allows cuBLAS to round f32 operands to
                // bf16, it does not promise to (measured on an H200: 3.5e-3 apart): on
                // hardware both are held to bf16 rounding of the f32 product instead.
                let exact64: Vec<f64> = exact.iter().map(|&v| v as f64).collect();
                let bf16_err = rel_err(&got, &exact64);
                eprintln!("{place}: bf16 in memory vs FAST_16BF {err:e}, vs f32 {bf16_err:e}");
                assert!(
                    bf16_err <= 1e-2,
                    "{place}: bf16 products off f32 by {bf16_err:e}"
                );
            }
            assert!(
                rel_err(&exact, &want64) > 1e-4,
                "{place}: the operands were not rounded"
            );
        }
    }

    /// The norms against their formulas in f64: the residual add with the next norm in
    /// one pass (res = x + branch, then LayerNorm / RMSNorm of it), and the backward in
    /// one pass (rows up to NORM_ONE_PASS_WIDTH wide) and in two (wider): dx added to
    /// what dx held, the gain's and bias's gradients added to theirs. More rows than
    /// the one pass has warps, so warps take several.
    #[test]
    fn norms_match_their_formulas_in_one_pass_and_two() {
        for (place, gpu) in gpus() {
            gpu.bind().unwrap();
            for (c, kind) in [
                (40, NormKind::LayerNorm),
                (40, NormKind::RmsNorm),
                (NORM_ONE_PASS_WIDTH + 64, NormKind::LayerNorm),
            ] {
                let rows = 300;
                let n = rows * c;
                let wave = |seed: f32, scale: f32| -> Vec<f32> {
                    (0..n)
                        .map(|i| scale * ((i as f32) * 0.61 + seed).sin())
                        .collect()
                };
                let (x, branch, dout, dx0) = (
                    wave(0.3, 1.0),
                    wave(1.7, 0.5),
                    wave(2.9, 1.0),
                    wave(4.1, 0.1),
                );
                let gain: Vec<f32> = (0..c).map(|i| 1.0 + 0.01 * i as f32).collect();
                let bias: Vec<f32> = (0..c).map(|i| 0.02 * i as f32 - 0.3).collect();
                let (dw0, db0): (Vec<f32>, Vec<f32>) =
                    ((0..c).map(|i| i as f32).collect(), vec![0.5; c]);
                let rms = kind == NormKind::RmsNorm;
                let eps = 1e-5f32;

                // Worked in f64.
                let res: Vec<f64> = x.iter().zip(&branch).map(|(a, b)| (a + b) as f64).collect();
                let (mut want_out, mut want_dx) = (vec![0f64; n], vec![0f64; n]);
                let (mut want_dw, mut want_db): (Vec<f64>, Vec<f64>) = (
                    dw0.iter().map(|&v| v as f64).collect(),
                    db0.iter().map(|&v| v as f64).collect(),
                );
                for r in 0..rows {
                    let row = &res[r * c..][..c];
                    let mean = if rms {
                        0.0
                    } else {
                        row.iter().sum::<f64>() / c as f64
                    };
                    let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / c as f64;
                    let rstd = 1.0 / (var + eps as f64).sqrt();
                    let xhat: Vec<f64> = row.iter().map(|v| (v - mean) * rstd).collect();
                    let g: Vec<f64> = (0..c)
                        .map(|i| dout[r * c + i] as f64 * gain[i] as f64)
                        .collect();
                    let g_mean = if rms {
                        0.0
                    } else {
                        g.iter().sum::<f64>() / c as f64
                    };
                    let gx_mean = g.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f64>() / c as f64;
                    for i in 0..c {
                        let b = if rms { 0.0 } else { bias[i] as f64 };
                        want_out[r * c + i] = xhat[i] * gain[i] as f64 + b;
                        want_dx[r * c + i] =
                            dx0[r * c + i] as f64 + rstd * (g[i] - g_mean - xhat[i] * gx_mean);
                        want_dw[i] += dout[r * c + i] as f64 * xhat[i];
                        want_db[i] += dout[r * c + i] as f64;
                    }
                }

                let up = |v: &[f32]| Buf::from_host(&gpu, v).unwrap();
                let (xb, branchb, doutb, dxb) = (up(&x), up(&branch), up(&dout), up(&dx0));
                let (gainb, biasb, dwb, dbb) = (up(&gain), up(&bias), up(&dw0), up(&db0));
                let zeros = |len| Buf::<f32>::zeros(&gpu, len).unwrap();
                let (resb, outb, mean, rstd) = (zeros(n), zeros(n), zeros(rows), zeros(rows));
                let partials = zeros(super::super::plan::partials_len(c, c));
                let norm = NormRows {
                    kind,
                    weight: gainb.ptr(),
                    bias: if rms { 0 } else { biasb.ptr() },
                    mean: mean.ptr(),
                    rstd: rstd.ptr(),
                    rows,
                    c,
                };
                let none = DropoutArgs::at(None, Site::Embedding);
                let residual = (resb.ptr(), xb.ptr(), (In::f32(branchb.ptr()), 0), none);
                gpu.residual_norm_forward(residual, Out::f32(outb.ptr()), norm, eps)
                    .unwrap();
                let grads = (dwb.ptr(), if rms { 0 } else { dbb.ptr() });
                let dx16 = Buf::<u16>::zeros(&gpu, n).unwrap();
                gpu.norm_backward(
                    (dxb.ptr(), dx16.ptr(), In::f32(doutb.ptr()), resb.ptr()),
                    norm,
                    grads,
                    partials.ptr(),
                )
                .unwrap();

                let what = format!("{place}: C {c}, {kind:?}");
                let read = |b: &Buf<f32>, len| b.read(&gpu, len).unwrap();
                let mut checks = vec![
                    ("res", read(&resb, n), res.clone()),
                    ("out", read(&outb, n), want_out),
                    ("dx", read(&dxb, n), want_dx),
                    ("dw", read(&dwb, c), want_dw),
                ];
                if !rms {
                    checks.push(("db", read(&dbb, c), want_db));
                }
                for (name, got, want) in checks {
                    let err = rel_err(&got, &want);
                    assert!(err <= 1e-5, "{what}: {name} off by {err:e}");
                }
                // The rounded copy is the new dx, rounded.
                let rounded = dx16.read(&gpu, n).unwrap();
                for (got, x) in rounded.iter().zip(read(&dxb, n)) {
                    assert_eq!(
                        *got,
                        crate::cpu::bf16::to_bf16_bits(x),
                        "{what}: dx16 of {x:e}"
                    );
                }
            }
        }
    }

    /// GPT-2's tanh GELU in f64, and its slope.
    fn gelu_tanh64(x: f64) -> f64 {
        let k = (2.0 / std::f64::consts::PI).sqrt();
        0.5 * x * (1.0 + (k * (x + 0.044715 * x.powi(3))).tanh())
    }

    fn gelu_tanh_slope64(x: f64) -> f64 {
        let k = (2.0 / std::f64::consts::PI).sqrt();
        let t = (k * (x + 0.044715 * x.powi(3))).tanh();
        0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x)
    }

    /// The products' epilogues (cuBLASLt's GELU_AUX_BIAS, BIAS and DGELU on a GPU) are
    /// the formulas written out in f64: the GELU's forward keeps x = x Wᵀ + b rounded to
    /// bf16 and gives GELU(x) in bf16; the bias alone gives x rounded; the backward gives
    /// (g Wᵀ) GELU'(kept x). The slope itself is held to finite differences of the GELU.
    #[test]
    fn gelu_epilogues_are_the_written_out_formulas() {
        use super::super::blas::{fused, run_fused, Matrix, Product};
        use super::super::calls::Epilogue;
        use crate::cpu::bf16::round_to_bf16;
        for x in [-4.0, -1.7, -0.3, 0.0, 0.2, 1.1, 3.5] {
            let h = 1e-5;
            let numeric = (gelu_tanh64(x + h) - gelu_tanh64(x - h)) / (2.0 * h);
            assert!(
                (numeric - gelu_tanh_slope64(x)).abs() < 1e-8,
                "slope at {x}"
            );
        }
        let (rows, d_in, d_out) = (5, 24, 40);
        let value = |i: usize, scale: f32| round_to_bf16(((i as f32) * 0.731).sin() * scale);
        let x: Vec<f32> = (0..rows * d_in).map(|i| value(i, 1.0)).collect();
        let w: Vec<f32> = (0..d_out * d_in).map(|i| value(i + 7, 0.4)).collect();
        let bias: Vec<f32> = (0..d_out)
            .map(|o| round_to_bf16((o as f32 * 0.3).cos() * 0.5))
            .collect();
        let bits =
            |v: &[f32]| -> Vec<u16> { v.iter().map(|&f| (f.to_bits() >> 16) as u16).collect() };
        let sums: Vec<f64> = (0..rows * d_out)
            .map(|e| {
                let (r, o) = (e / d_out, e % d_out);
                (0..d_in)
                    .map(|k| x[r * d_in + k] as f64 * w[o * d_in + k] as f64)
                    .sum()
            })
            .collect();
        let widen = |h: u16| f32::from_bits(u32::from(h) << 16);
        let n = rows * d_out;
        for (place, gpu) in gpus() {
            let up = |v: &[u16]| Buf::from_host(&gpu, v).unwrap();
            let (x16, w16, b) = (up(&bits(&x)), up(&bits(&w)), up(&bits(&bias)));
            let read = |buf: &Buf<u16>| -> Vec<f32> {
                buf.read(&gpu, n).unwrap().into_iter().map(widen).collect()
            };
            // bf16(x Wᵀ) through `epilogue` into a new buffer, read back; None (said)
            // where the device does not run it.
            let product = |epilogue, name: &str| -> Option<Vec<f32>> {
                let out = Buf::<u16>::zeros(&gpu, n).unwrap();
                let call = fused(
                    (Product::Bf16(Matrix::new(out.ptr(), rows, d_out)), epilogue),
                    Matrix::new(x16.ptr(), rows, d_in).n(),
                    Matrix::new(w16.ptr(), d_out, d_in).t(),
                )
                .unwrap();
                if !gpu.fuses(call.call()) {
                    eprintln!("SKIPPED on {place}: cuBLASLt has no {name} algorithm here");
                    return None;
                }
                run_fused(&gpu, crate::profile::Group::Elementwise, &call).unwrap();
                Some(read(&out))
            };
            // Each kept value and output is one bf16 rounding (2^-9 relative) from its
            // value; on a GPU the epilogue's tanh may be a faster approximation.
            let bound = if place == "emulator" {
                2f64.powi(-8)
            } else {
                4e-3
            };
            let pre: Vec<f64> = (0..n).map(|e| sums[e] + bias[e % d_out] as f64).collect();

            let aux = Buf::<u16>::zeros(&gpu, n).unwrap();
            let gelu = Epilogue::GeluAux {
                bias: b.ptr(),
                aux: aux.ptr(),
            };
            let Some(got) = product(gelu, "GELU_AUX_BIAS") else {
                continue;
            };
            let kept = read(&aux);
            let want: Vec<f64> = pre.iter().map(|&v| gelu_tanh64(v)).collect();
            let (kept_err, act_err) = (rel_err(&kept, &pre), rel_err(&got, &want));
            assert!(kept_err <= bound, "{place}: kept input off by {kept_err:e}");
            assert!(act_err <= bound, "{place}: GELU off by {act_err:e}");

            // A bias alone (the qkv product's): bf16(x Wᵀ + b).
            if let Some(got) = product(Epilogue::Bias { bias: b.ptr() }, "BIAS") {
                let err = rel_err(&got, &pre);
                assert!(
                    err <= 2f64.powi(-8),
                    "{place}: biased product off by {err:e}"
                );
            }

            // The backward: g Wᵀ (g = x here) times the slope at the kept input, in bf16.
            let backward = Epilogue::GeluBackward { aux: aux.ptr() };
            if let Some(got) = product(backward, "DGELU") {
                let want: Vec<f64> = (0..n)
                    .map(|e| sums[e] * gelu_tanh_slope64(kept[e] as f64))
                    .collect();
                let err = rel_err(&got, &want);
                assert!(err <= bound, "{place}: GELU gradient off by {err:e}");
            }
        }
    }

    /// Only epilogues cuBLASLt documents run (`Gpu::fuses`, on every device): a bias
    /// or an aux beside an f32 output, a bias off 16 bytes, aux rows not a multiple of
    /// 8 apart are refused, so the engine keeps its kernels there.
    #[test]
    fn undocumented_epilogues_are_refused() {
        use super::super::blas::{fused, Matrix, Product};
        use super::super::calls::Epilogue;
        for (place, gpu) in gpus() {
            let buf = |n: usize| Buf::<u16>::zeros(&gpu, n).unwrap();
            let (x, w, out, aux, bias) =
                (buf(8 * 32), buf(48 * 32), buf(8 * 48), buf(8 * 48), buf(64));
            let call = |c: Product, epilogue, cols: usize| {
                let product = fused(
                    (c, epilogue),
                    Matrix::new(x.ptr(), 8, 32).n(),
                    Matrix::new(w.ptr(), cols, 32).t(),
                )
                .unwrap();
                gpu.fuses(product.call())
            };
            let bf16 = |cols| Product::Bf16(Matrix::new(out.ptr(), 8, cols));
            let f32_out = Product::F32(Matrix::new(out.ptr(), 8, 24));
            let gelu = |bias| Epilogue::GeluAux {
                bias,
                aux: aux.ptr(),
            };
            let what = |w: &str| format!("{place}: {w}");
            if !call(bf16(48), gelu(bias.ptr()), 48) {
                eprintln!("SKIPPED on {place}: cuBLASLt has no GELU_AUX_BIAS algorithm here");
                continue;
            }
            assert!(
                !call(bf16(48), gelu(bias.ptr() + 2), 48),
                "{}",
                what("a bias off 16 bytes")
            );
            assert!(
                !call(bf16(44), gelu(0), 44),
                "{}",
                what("aux rows 44 apart")
            );
            let backward = Epilogue::GeluBackward { aux: aux.ptr() };
            assert!(
                !call(f32_out, backward, 24),
                "{}",
                what("an aux beside f32")
            );
            let biased = Epilogue::Bias { bias: bias.ptr() };
            assert!(
                !call(f32_out, biased, 24),
                "{}",
                what("a bf16 bias beside f32")
            );
        }
    }

    /// TF32 products (`train.tf32`) are the f32 products of operands rounded to 10-bit
    /// mantissas: in the emulator exactly the f64 sums of the rounded operands (to f32
    /// summation), on a GPU within TF32's rounding of the f32 product (reported), and
    /// apart from the exact f32 product in both.
    #[test]
    fn tf32_products_multiply_operands_rounded_to_ten_bits() {
        use super::super::blas::{linear, Weights};
        use super::super::calls::round_to_tf32;
        let (spec, values, x, rows) = one_layer();
        let p = spec.blocks[0].mlp_fc;
        let w = &values[spec[p.weight].offset..][..p.d_out * p.d_in];
        let rounded_product: Vec<f64> = (0..rows * p.d_out)
            .map(|e| {
                let (r, o) = (e / p.d_out, e % p.d_out);
                (0..p.d_in)
                    .map(|k| {
                        let xv = round_to_tf32(x[r * p.d_in + k]) as f64;
                        xv * round_to_tf32(w[o * p.d_in + k]) as f64
                    })
                    .sum()
            })
            .collect();
        for (place, gpu) in gpus() {
            let params = Buf::from_host(&gpu, &values).unwrap();
            let xb = Buf::from_host(&gpu, &x).unwrap();
            let product = |math| {
                let out = Buf::<f32>::zeros(&gpu, rows * p.d_out).unwrap();
                linear(
                    &gpu,
                    Weights::F32(math),
                    &spec,
                    &params,
                    out.ptr(),
                    xb.ptr(),
                    &p,
                    rows,
                )
                .unwrap();
                out.read(&gpu, rows * p.d_out).unwrap()
            };
            let (tf32, exact) = (product(Math::Tf32), product(Math::F32));
            let exact64: Vec<f64> = exact.iter().map(|&v| v as f64).collect();
            let (to_rounded, to_exact) =
                (rel_err(&tf32, &rounded_product), rel_err(&tf32, &exact64));
            if place == "emulator" {
                assert!(
                    to_rounded <= 1e-6,
                    "{place}: off the rounded operands' product by {to_rounded:e}"
                );
                assert!(
                    to_exact > 1e-5,
                    "{place}: TF32 gave the f32 product ({to_exact:e} apart)"
                );
            } else {
                eprintln!("{place}: TF32 vs rounded operands {to_rounded:e}, vs f32 {to_exact:e}");
                assert!(
                    to_exact <= 2e-3,
                    "{place}: TF32 off the f32 product by {to_exact:e}"
                );
            }
        }
    }

    /// Rounding to TF32 keeps 10 mantissa bits, to nearest with ties away from zero
    /// (cvt.rna): worked values.
    #[test]
    fn tf32_rounding_keeps_ten_bits_ties_away() {
        use super::super::calls::round_to_tf32;
        let ulp = 2f32.powi(-10);
        for (x, want) in [
            (1.0, 1.0),
            (1.0 + ulp, 1.0 + ulp),
            (1.0 + ulp / 2.0, 1.0 + ulp),       // a tie: away from zero
            (-(1.0 + ulp / 2.0), -(1.0 + ulp)), // and for negatives
            (1.0 + ulp / 2.0 - 2f32.powi(-23), 1.0), // just under the tie
            (1.0 + 3.0 * ulp / 4.0, 1.0 + ulp),
            (3.0 + 2f32.powi(-9) / 4.0, 3.0),
            (f32::INFINITY, f32::INFINITY),
        ] {
            assert_eq!(round_to_tf32(x), want, "{x:e}");
        }
        assert!(round_to_tf32(f32::NAN).is_nan());
    }

    /// A sampler's settings: temperature, top-k, top-p, repetition penalty.
    type Setting = (f64, usize, f64, f64);

    /// The device draws what the host's sampler (generate/sample.rs) draws from the same
    /// logits with the same uniform draws: the same token, or, where rounding moved a
    /// boundary (its sums run in another order), the neighbouring token, with the draw
    /// within rounding of the boundary between the two. Greedy picks are equal. Every
    /// setting: plain temperature, top-k (1, some, past the text's ids, all), top-p
    /// (nuclei that make the sorted prefix grow), both, the repetition penalty (repeated
    /// ids and padding ids in the context); ties among the logits; padding past
    /// text_vocab never drawn.
    #[test]
    fn sampling_on_the_device_draws_what_the_host_draws() {
        for (place, gpu) in gpus() {
            let settings: &[Setting] = &[
                (0.0, 0, 1.0, 1.0),
                (0.0, 0, 1.0, 1.5),
                (1.0, 0, 1.0, 1.0),
                (0.7, 0, 1.0, 1.3),
                (1.0, 1, 1.0, 1.0),
                (1.0, 5, 1.0, 1.0),
                (0.9, 50, 1.0, 1.2),
                (1.0, 680, 1.0, 1.0),
                (1.0, 700, 1.0, 1.0),
                (1.0, 0, 0.3, 1.0),
                (1.0, 0, 0.9, 1.0),
                (1.5, 0, 0.99, 1.0),
                (0.8, 100, 0.8, 1.4),
            ];
            let mismatches: usize = settings
                .iter()
                .enumerate()
                .map(|(i, setting)| sampling_on(place, &gpu, i as u64, *setting))
                .sum();
            eprintln!("{place}: {mismatches} draws moved by rounding");
        }
    }

    /// Draws 10 rounds of 4 rows with `setting`; returns how many differed (by rounding).
    fn sampling_on(place: &str, gpu: &Gpu, seed: u64, setting: Setting) -> usize {
        use crate::generate::sample::{Sampler, SamplingParams};
        let (batch, vocab, text_vocab, block) = (4usize, 700usize, 650usize, 40usize);
        let (temperature, top_k, top_p, repetition_penalty) = setting;
        let params = SamplingParams {
            temperature,
            top_k,
            top_p,
            repetition_penalty,
        };
        let what = format!("{place} {params:?}");
        let sampler = |b: usize| Sampler::new(params.clone(), seed * 100 + b as u64).unwrap();
        let (mut host, mut device): (Vec<_>, Vec<_>) =
            (0..batch).map(|b| (sampler(b), sampler(b))).unzip();
        let args = SamplingArgs::new(
            (temperature > 0.0).then_some(temperature),
            top_k,
            top_p,
            repetition_penalty,
        );
        let (weights, keys, seen) = (
            Buf::<f32>::zeros(gpu, batch * vocab).unwrap(),
            Buf::<u64>::zeros(gpu, batch * vocab.next_power_of_two()).unwrap(),
            Buf::<u32>::zeros(gpu, batch * vocab).unwrap(),
        );
        let work = SamplingWork {
            weights: weights.ptr(),
            keys: keys.ptr(),
            seen: seen.ptr(),
        };
        let mut moved = 0;
        for round in 0..10usize {
            // Zipf-like logits in a shuffled order (the token of rank r at id
            // (r - shift) / 7919 mod V), positive and negative, rounded to eighths (so
            // many tie).
            let token_of_rank = |b: usize, rank: usize| {
                let shift = b * 31 + round * 13;
                ((rank + vocab - shift % vocab) * inverse_mod(7919, vocab)) % vocab
            };
            let mut logits = vec![0f32; batch * vocab];
            for b in 0..batch {
                for rank in 0..vocab {
                    let l = 3.0 - 1.1 * ((rank + 1) as f32).ln();
                    logits[b * vocab + token_of_rank(b, rank)] = (8.0 * l).round() / 8.0;
                }
            }
            // Contexts of the likeliest tokens, most of them repeated, and padding ids
            // the penalty must not trip on.
            let contexts: Vec<u32> = (0..batch * block)
                .map(|i| match i % block % 5 {
                    4 => (text_vocab + i % 40) as u32,
                    k => token_of_rank(i / block, (i % block) / 3 + k % 2) as u32,
                })
                .collect();
            let want: Vec<u32> = (0..batch)
                .map(|b| {
                    let mut row = logits[b * vocab..(b + 1) * vocab].to_vec();
                    row[text_vocab..].fill(f32::NEG_INFINITY);
                    host[b].sample(&mut row, &contexts[b * block..(b + 1) * block])
                })
                .collect();
            let uniforms: Vec<f64> = device
                .iter_mut()
                .map(|s| s.next_uniform(vocab).unwrap_or(0.0))
                .collect();
            let (chosen, logits_buf) = (
                Buf::<u32>::zeros(gpu, batch).unwrap(),
                Buf::from_host(gpu, &logits).unwrap(),
            );
            let (context_buf, uniforms_buf) = (
                Buf::from_host(gpu, &contexts).unwrap(),
                Buf::from_host(gpu, &uniforms).unwrap(),
            );
            gpu.sample_tokens(
                chosen.ptr(),
                &work,
                logits_buf.ptr(),
                (context_buf.ptr(), block, block),
                uniforms_buf.ptr(),
                (batch, vocab, text_vocab),
                args,
            )
            .unwrap();
            let got = chosen.read(gpu, batch).unwrap();
            chosen.fill_zeros(gpu).unwrap();
            let marks = seen.read(gpu, batch * vocab).unwrap();
            assert!(marks.iter().all(|&m| m == 0), "{what}: `seen` left marked");
            for b in 0..batch {
                let (g, w) = (got[b], want[b]);
                assert!((g as usize) < text_vocab, "{what}: drew padding {g}");
                if g == w {
                    continue;
                }
                assert!(temperature > 0.0, "{what}: greedy picks {g}, the host {w}");
                let row = &logits[b * vocab..(b + 1) * vocab];
                let context = &contexts[b * block..(b + 1) * block];
                assert!(
                    within_rounding(row, context, text_vocab, setting, uniforms[b], (g, w)),
                    "{what}, round {round}, row {b}: the device drew {g}, the host {w}"
                );
                moved += 1;
            }
        }
        moved
    }

    /// x such that a x = 1 mod m (a and m coprime).
    fn inverse_mod(a: usize, m: usize) -> usize {
        (1..m).find(|x| a * x % m == 1).expect("coprime")
    }

    /// Worked examples where the draw lands exactly on a boundary (so only the host's
    /// comparisons decide: a draw past a boundary takes the next token, a nucleus that
    /// reaches p exactly stops there): four equally likely tokens, then padding.
    #[test]
    fn sampling_on_the_device_decides_boundaries_as_the_host() {
        for (place, gpu) in gpus() {
            let text_vocab = 4; // of 6 ids: the last two are padding
            let cases: &[(Setting, f64, u32)] = &[
                // Every token a candidate: u = i / 4 falls just past token i - 1's end.
                ((1.0, 0, 1.0, 1.0), 0.0, 0),
                ((1.0, 0, 1.0, 1.0), 0.25, 1),
                ((1.0, 0, 1.0, 1.0), 0.5, 2),
                ((1.0, 0, 1.0, 1.0), 0.75, 3),
                ((1.0, 0, 1.0, 1.0), 0.999_999, 3),
                // top-p 0.5 keeps two tokens (0.25 + 0.25 reaches it), ids 0 and 1.
                ((1.0, 0, 0.5, 1.0), 0.5, 1),
                ((1.0, 0, 0.5, 1.0), 0.999_999, 1),
                ((1.0, 0, 0.5, 1.0), 0.499_999, 0),
                // top-k 3 keeps ids 0, 1, 2; top-k 6 keeps the padding too, never drawn.
                ((1.0, 3, 1.0, 1.0), 0.999_999, 2),
                ((1.0, 6, 1.0, 1.0), 0.999_999_999, 3),
                // Greedy: the first of equal logits.
                ((0.0, 0, 1.0, 1.0), 0.0, 0),
            ];
            let logits = [0.5f32, 0.5, 0.5, 0.5, 9.0, 9.0];
            for &(setting, u, want) in cases {
                let got = sample_one(&gpu, &logits, text_vocab, setting, u);
                assert_eq!(got, want, "{place}: {setting:?} at u = {u}");
            }
            // A diverged model's logits: the host's argmax never takes a NaN but at id
            // 0, where it starts; a draw over NaN weights falls back to id 0; an id
            // outside the vocabulary never comes back.
            let nan = f32::NAN;
            let rows: &[([f32; 6], Setting, u32)] = &[
                ([0.5, nan, 2.0, 1.0, 0.0, 0.0], (0.0, 0, 1.0, 1.0), 2),
                ([nan, 0.5, 2.0, 1.0, 0.0, 0.0], (0.0, 0, 1.0, 1.0), 0),
                ([nan; 6], (1.0, 0, 1.0, 1.0), 0),
                ([nan; 6], (1.0, 2, 0.9, 1.0), 0),
            ];
            for &(row, setting, want) in rows {
                let (t, k, p, r) = setting;
                let got = sample_one(&gpu, &row, text_vocab, setting, 0.5);
                assert_eq!(got, want, "{place}: {row:?} {setting:?}");
                // The host's sampler, on the row as `generate` hands it over.
                use crate::generate::sample::{Sampler, SamplingParams};
                let params = SamplingParams {
                    temperature: t,
                    top_k: k,
                    top_p: p,
                    repetition_penalty: r,
                };
                let mut masked = row;
                masked[text_vocab..].fill(f32::NEG_INFINITY);
                let host = Sampler::new(params, 1).unwrap().sample(&mut masked, &[]);
                assert_eq!(host, want, "the host on {row:?} {setting:?}");
            }
        }
    }

    /// The token `sample_tokens` draws from one row of `logits` with `setting` and the
    /// uniform draw `u`.
    fn sample_one(gpu: &Gpu, logits: &[f32], text_vocab: usize, setting: Setting, u: f64) -> u32 {
        let vocab = logits.len();
        let (t, k, p, r) = setting;
        let (chosen, weights, keys, seen) = (
            Buf::<u32>::zeros(gpu, 1).unwrap(),
            Buf::<f32>::zeros(gpu, vocab).unwrap(),
            Buf::<u64>::zeros(gpu, vocab.next_power_of_two()).unwrap(),
            Buf::<u32>::zeros(gpu, vocab).unwrap(),
        );
        let work = SamplingWork {
            weights: weights.ptr(),
            keys: keys.ptr(),
            seen: seen.ptr(),
        };
        let (logits, uniforms) = (
            Buf::from_host(gpu, logits).unwrap(),
            Buf::from_host(gpu, &[u]).unwrap(),
        );
        let args = SamplingArgs::new((t > 0.0).then_some(t), k, p, r);
        let (no_context, shape) = ((0, 0, 1), (1, vocab, text_vocab));
        gpu.sample_tokens(
            chosen.ptr(),
            &work,
            logits.ptr(),
            no_context,
            uniforms.ptr(),
            shape,
            args,
        )
        .unwrap();
        chosen.read_one(gpu, 0).unwrap()
    }

    /// Whether tokens `a` and `b` are neighbours in the draw's order (id order, or most
    /// likely first over the kept candidates) and the draw `u` falls within rounding
    /// (1e-5 of the total) of the boundary between them: computed again in f64.
    fn within_rounding(
        logits: &[f32],
        context: &[u32],
        text_vocab: usize,
        (temperature, top_k, top_p, penalty): Setting,
        u: f64,
        (a, b): (u32, u32),
    ) -> bool {
        use crate::generate::sample::nucleus_size;
        let mut l: Vec<f32> = logits.to_vec();
        l[text_vocab..].fill(f32::NEG_INFINITY);
        let mut seen = vec![false; l.len()];
        for &id in context {
            if (id as usize) < l.len() && !std::mem::replace(&mut seen[id as usize], true) {
                let x = l[id as usize];
                l[id as usize] = if x > 0.0 {
                    x / penalty as f32
                } else {
                    x * penalty as f32
                };
            }
        }
        let max = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<(f64, u32)> = l
            .iter()
            .enumerate()
            .map(|(i, &x)| (((x - max) as f64 / temperature).exp(), i as u32))
            .collect();
        let mut order = weights.clone();
        let mut kept = order.len();
        if (top_k != 0 && top_k < l.len()) || top_p < 1.0 {
            order.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
            let total: f64 = order.iter().map(|w| w.0).sum();
            let probs: Vec<(f32, u32)> =
                order.iter().map(|w| ((w.0 / total) as f32, w.1)).collect();
            kept = nucleus_size(&probs, top_k, top_p);
        }
        let order = &order[..kept];
        let total: f64 = order.iter().map(|w| w.0).sum();
        let at = |id: u32| order.iter().position(|w| w.1 == id);
        let (Some(pa), Some(pb)) = (at(a), at(b)) else {
            return false;
        };
        let (first, last) = (pa.min(pb), pa.max(pb));
        let between = order[first + 1..last].iter().map(|w| w.0).sum::<f64>();
        let boundary: f64 = order[..=first].iter().map(|w| w.0).sum();
        between <= 1e-9 * total && (boundary - u * total).abs() <= 1e-5 * total
    }
}
