//! A model's weights as the CPU decoder reads them, in the precision it decodes in.
//!
//! Decoding one token reads every weight once, so its speed is the speed of reading
//! them: the matrices may be held in bf16 (half the bytes, each weight widened to f32
//! as it is read), in eight bits (`cpu::q8_matrix`, 34 bytes a block of 32: about a
//! quarter) or in four (`cpu::q4`, 18 bytes a block: about a seventh); the activations
//! they multiply are quantized by `cpu::q8`. Everything else (norms, biases, position
//! tables) stays f32. The token embedding is the tied output layer, a
//! matrix like the others: a token's input vector is its row read back in f32.
//!
//! Where the weights come from is `Values`: copies in memory, or the f32 tensors of a
//! checkpoint file mapped into memory and used where they lie (`crate::mapped`, which
//! copies f32 tensors onto huge pages for a decoder that will stream them). A
//! matrix converted to bf16, int8 or int4 is converted a slice of rows at a time, each slice's
//! pages of the file released once read, so the f32 file is never resident as a whole:
//! the process holds about the converted model, not the model twice.
//!
//! One `DecodeWeights` serves any number of decoders (`FastDecoder`), each with its
//! own K/V buffers.

use std::ops::Deref;
use std::sync::Arc;

use anyhow::Result;
use rayon::prelude::*;

use super::gemm::{matmul, Precision};
use super::grouped::{Format, Grouped, GROUP};
use super::isa::{self, Isa};
use super::kernels::Widen;
use super::kernels::{axpy, multiversion};
use super::lines::Lines;
use super::matrix::{Product, Strided};
use super::ops::activation::Activation;
use super::ops::norm::NormWeights;
use super::ops::rope::Rope;
use super::q4::Q4Matrix;
use super::q8::Q8Row;
use super::q8_matrix::Q8Matrix;
use super::team::for_each_piece;
use super::threads::threads;
use super::weight_rows::{by_output_shares, one_row_shares, project_rows, splits, Bf16};
use crate::config::PositionKind;
use crate::model::position::sinusoidal_values;
use crate::model::spec::{LinearParams, ModelSpec, NormParams, ParamId};

/// How the decoder holds the weights of its matrix products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    F32,
    /// The upper half of each f32 (rounded to nearest, ties to even), widened as read;
    /// products summed in f32.
    Bf16,
    /// Eight bits per weight in blocks of 32 with an f16 scale (llama.cpp's q8_0); the
    /// activations of each product quantized in the same blocks.
    Int8,
    /// Four bits per weight in blocks of 32 with an f16 scale (llama.cpp's q4_0); the
    /// activations of each product in eight bits, as for `Int8`.
    Int4,
}

impl WeightFormat {
    /// Whether the weights are in blocks of integers (int8, int4): the fused CPU
    /// decoder's alone.
    pub fn is_integer(self) -> bool {
        matches!(self, Self::Int8 | Self::Int4)
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::Int8 => "int8",
            Self::Int4 => "int4",
        }
    }
}

/// A tensor's f32 values: a copy in memory (on whole cache lines), or where they lie in
/// a mapped file.
pub enum Values {
    Owned(Lines<f32>),
    Mapped(MappedValues),
}

/// `len` f32 values at byte `start` of a mapped file.
pub struct MappedValues {
    map: Arc<MappedFile>,
    start: usize,
    len: usize,
}

/// A file mapped read-only, and what must last exactly as long as the mapping (the
/// watch that turns a fault in it into a one-line error: `mapped::sigbus`); the
/// mapping goes with its last `Values`.
pub struct MappedFile {
    // Declared first, so dropped first: the watch ends before the range is unmapped
    // (and could be reused by another mapping).
    _watch: Option<Box<dyn std::any::Any + Send + Sync>>,
    map: memmap2::Mmap,
}

impl MappedFile {
    pub fn new(map: memmap2::Mmap, watch: Option<Box<dyn std::any::Any + Send + Sync>>) -> Self {
        Self { _watch: watch, map }
    }
}

impl Deref for MappedFile {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.map
    }
}

impl Values {
    /// The `len` f32 values at byte `start` of `map`, read in place: only where they are
    /// aligned for f32 and the machine is little-endian (as the file is); `None`
    /// otherwise, and the caller copies them.
    pub fn mapped(map: &Arc<MappedFile>, start: usize, len: usize) -> Option<Self> {
        let end = start.checked_add(len.checked_mul(4)?)?;
        let aligned = (map.as_ptr() as usize + start).is_multiple_of(std::mem::align_of::<f32>());
        (cfg!(target_endian = "little") && aligned && end <= map.len()).then(|| {
            Self::Mapped(MappedValues {
                map: Arc::clone(map),
                start,
                len,
            })
        })
    }

    /// The values copied into memory: a converted model's small tensors (norms, biases,
    /// position tables) are, so that nothing stays mapped once its matrices are
    /// converted. A mapped norm read later would map in the file's whole large page
    /// around it (2 MiB where the page cache holds the file in large folios), the
    /// released rows of the matrices beside it included: 22 MiB for GPT-2 124M.
    fn into_owned(self) -> Self {
        match self {
            Values::Mapped(_) => Values::Owned(Lines::copy_of(&self)),
            owned => owned,
        }
    }

    /// The values where every row of whole lines starts on one (`matvec` reads them in
    /// line-wide loads): mapped values that lie off the lines (a file written before
    /// tinygpt aligned its tensors) are copied onto them ([`Values::copied`]).
    fn on_lines(self) -> Self {
        if (self.as_ptr() as usize).is_multiple_of(super::lines::LINE) {
            return self;
        }
        self.copied()
    }

    /// The values copied into `Lines` (on huge pages where the kernel lends them, which
    /// a token's f32 products read 7% faster than the mapped file's 4 KiB pages:
    /// PERFORMANCE.md), a slice at a time over the pool's threads (most of the time is the
    /// kernel's, clearing the new pages), each slice's pages given back to the file once
    /// copied. Copies are returned as they are.
    pub fn copied(self) -> Self {
        if matches!(self, Values::Owned(_)) {
            return self;
        }
        let mut lines = Lines::zeroed(self.len());
        // 4 MiB of f32 a task: enough to amortise a task, small enough to spread.
        const SLICE: usize = 1 << 20;
        lines
            .par_chunks_mut(SLICE)
            .enumerate()
            .for_each(|(i, chunk)| {
                let range = i * SLICE..i * SLICE + chunk.len();
                chunk.copy_from_slice(&self[range.clone()]);
                self.release(range);
            });
        self.release(0..self.len());
        Values::Owned(lines)
    }

    /// Gives the pages that lie wholly inside values `range` back to the file: they
    /// leave this process's memory and are read from the page cache again if touched.
    /// A page shared with values outside the range is kept (another thread may be
    /// reading them): callers release a whole tensor once they are done. Copies keep
    /// theirs.
    fn release(&self, range: std::ops::Range<usize>) {
        #[cfg(unix)]
        if let Values::Mapped(m) = self {
            // Safety: sysconf has no preconditions.
            let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
                .unwrap_or(4096)
                .max(1);
            let base = m.map.as_ptr() as usize;
            let start = (base + m.start + 4 * range.start).next_multiple_of(page);
            let end = (base + m.start + 4 * range.end) / page * page;
            if start < end {
                // Safety: the mapping is read-only and private; dropped pages of a file
                // mapping are read back from the file, so nothing that reads them
                // changes.
                let _ = unsafe {
                    m.map.map.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        start - base,
                        end - start,
                    )
                };
            }
        }
        let _ = range;
    }
}

impl Deref for Values {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match self {
            Values::Owned(v) => v,
            // Safety: `Values::mapped` checked the range lies inside the map and is
            // aligned for f32; every bit pattern is an f32; the map lives as long as
            // this `Arc` and is never written.
            Values::Mapped(m) => unsafe {
                std::slice::from_raw_parts(m.map.as_ptr().add(m.start).cast::<f32>(), m.len)
            },
        }
    }
}

/// A matrix's weights, (d_out, d_in) row-major, in one of the formats.
enum Stored {
    F32 {
        w: Values,
        /// A transposed copy (d_in, d_out) for narrow inputs: mat-vecs then run along
        /// contiguous output rows (y += x_i Wᵀ[i, :]) with no horizontal sums.
        transposed: Option<Vec<f32>>,
    },
    Bf16(Lines<Bf16>),
    Int8(Q8Matrix),
    Int4(Q4Matrix),
}

/// One projection (or the tied output layer): out = x Wᵀ + b.
pub struct Matrix {
    stored: Stored,
    bias: Option<Values>,
    d_in: usize,
    d_out: usize,
}

/// Rows converted (and their file pages released) at a time.
const CONVERT_ROWS: usize = 1024;

impl Matrix {
    fn new(
        w: Values,
        bias: Option<Values>,
        (d_out, d_in): (usize, usize),
        format: WeightFormat,
    ) -> Self {
        assert_eq!(w.len(), d_out * d_in, "a (d_out, d_in) matrix");
        let stored = match format {
            WeightFormat::F32 => {
                let w = w.on_lines();
                Stored::F32 {
                    transposed: transpose_if_narrow(&w, d_out, d_in),
                    w,
                }
            }
            WeightFormat::Bf16 => {
                let mut bits = Lines::<Bf16>::zeroed(w.len());
                for (i, chunk) in bits.chunks_mut(CONVERT_ROWS * d_in).enumerate() {
                    let first = i * CONVERT_ROWS * d_in;
                    round_to_bf16(&w[first..first + chunk.len()], chunk);
                    w.release(first..first + chunk.len());
                }
                w.release(0..w.len());
                Stored::Bf16(bits)
            }
            WeightFormat::Int8 => {
                let mut q = Q8Matrix::zeros(d_out, d_in);
                convert_rows(&w, d_out, d_in, |first, rows| q.quantize_rows(first, rows));
                Stored::Int8(q)
            }
            WeightFormat::Int4 => {
                let mut q = Q4Matrix::zeros(d_out, d_in);
                convert_rows(&w, d_out, d_in, |first, rows| q.quantize_rows(first, rows));
                Stored::Int4(q)
            }
        };
        Self {
            stored,
            bias,
            d_in,
            d_out,
        }
    }

    /// Bytes held in memory (an f32 matrix read in place counts: its pages are read in).
    pub fn bytes(&self) -> usize {
        let bias = self.bias.as_ref().map_or(0, |b| 4 * b.len());
        bias + match &self.stored {
            Stored::F32 { w, transposed } => {
                4 * (w.len() + transposed.as_ref().map_or(0, Vec::len))
            }
            Stored::Bf16(bits) => 2 * bits.len(),
            Stored::Int8(q) => q.bytes(),
            Stored::Int4(q) => q.bytes(),
        }
    }

    /// Bytes a pass reads, whatever its rows: one of an f32 matrix's two layouts.
    fn bytes_per_pass(&self) -> usize {
        let bias = self.bias.as_ref().map_or(0, |b| 4 * b.len());
        bias + match &self.stored {
            Stored::F32 { w, .. } => 4 * w.len(),
            _ => self.bytes(),
        }
    }

    /// Row `r` of W in f32 (exactly the values the products use).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        let d = self.d_in;
        match &self.stored {
            Stored::F32 { w, .. } => out.copy_from_slice(&w[r * d..(r + 1) * d]),
            Stored::Bf16(bits) => {
                for (o, b) in out.iter_mut().zip(&bits[r * d..(r + 1) * d]) {
                    *o = b.widen();
                }
            }
            Stored::Int8(q) => q.row_into(r, out),
            Stored::Int4(q) => q.row_into(r, out),
        }
    }

    /// out = x Wᵀ + b for every row of x. `q8_rows` holds the quantized rows of x for
    /// the eight- and four-bit formats.
    pub fn project(&self, x: &[f32], out: &mut [f32], q8_rows: &mut Vec<Q8Row>) {
        let (d_in, d_out) = (self.d_in, self.d_out);
        let rows = x.len() / d_in;
        let out = &mut out[..rows * d_out];
        let bias = self.bias.as_deref();
        match &self.stored {
            // However many rows: the integer products read each group of weight rows
            // once for up to eight rows of x (row-major integer tiles already beat
            // widening the matrix to f32 for a GEMM at prompts of 64 to 512 tokens;
            // docs/PERFORMANCE.md), and a prompt is then summed as its tokens are
            // decoded, from activations in eight bits.
            Stored::Int8(q) => project_quantized(q, bias, x, out, q8_rows),
            Stored::Int4(q) => project_quantized(q, bias, x, out, q8_rows),
            Stored::F32 { w, transposed } => {
                if let (Some(wt), true) = (transposed, rows <= NARROW_MAX_ROWS) {
                    project_transposed(wt, bias, x, d_in, out);
                } else if rows <= F32_ROWS_MAX_ROWS {
                    project_rows(w, bias, x, d_in, out);
                } else {
                    let p = Product::new(
                        Strided::rows(x, d_in),
                        Strided::columns(w, d_in),
                        (rows, d_out, d_in),
                    );
                    matmul(out, d_out, p, Precision::F32);
                    add_bias(out, bias, d_out);
                }
            }
            Stored::Bf16(bits) => {
                if rows <= bf16_rows_max_rows() {
                    project_rows(bits, bias, x, d_in, out);
                } else {
                    gemm_widened(d_out, x, d_in, out, |first, panel| {
                        let bits = &bits[first * d_in..first * d_in + panel.len()];
                        for (p, b) in panel.iter_mut().zip(bits) {
                            *p = b.widen();
                        }
                    });
                    add_bias(out, bias, d_out);
                }
            }
        }
    }
}

/// Up to this many rows, an f32 product reads each weight row once for all of them
/// (`weight_rows`); beyond, the GEMM's packing of the whole matrix pays for itself.
/// Measured on the GPT-2 124M shape, 2 threads, prompts of 48 to 512 tokens (Zen 5,
/// at AVX-512 and capped to AVX2: docs/PERFORMANCE.md): the GEMM was 2.5x slower at 64
/// rows, level at 512.
const F32_ROWS_MAX_ROWS: usize = 256;

/// [`F32_ROWS_MAX_ROWS`] for bf16 weights, whose GEMM path first widens the whole
/// matrix to f32: 256 rows at AVX2 and above (measured as for f32: the widening GEMM
/// 2.7x slower at 64 rows on Zen 5 at AVX-512; on Zen 3 at AVX2, the sixteen-row groups
/// of widened tiles 123-134 ms at 64 rows against the GEMM's 196-265), 48 below, where
/// the rows' portable bf16 loop is slower than widening (82 against 70 ms at 64 rows,
/// 161 against 122 at 128).
fn bf16_rows_max_rows() -> usize {
    match isa::active() >= Isa::Avx2 {
        true => F32_ROWS_MAX_ROWS,
        false => 48,
    }
}

/// Up to this many rows, a narrow f32 matrix reads its transposed copy.
const NARROW_MAX_ROWS: usize = 4;

/// Inputs narrower than this have a transposed f32 copy (long rows amortise a dot
/// product's horizontal sum; narrow ones do not).
const NARROW_INPUT: usize = 256;

fn add_bias(out: &mut [f32], bias: Option<&[f32]>, d_out: usize) {
    if let Some(bias) = bias {
        for row in out.chunks_exact_mut(d_out) {
            axpy(row, 1.0, bias);
        }
    }
}

fn transpose_if_narrow(w: &[f32], d_out: usize, d_in: usize) -> Option<Vec<f32>> {
    (d_in < NARROW_INPUT).then(|| {
        let mut wt = vec![0f32; d_in * d_out];
        for o in 0..d_out {
            for i in 0..d_in {
                wt[i * d_out + o] = w[o * d_in + i];
            }
        }
        wt
    })
}

fn round_to_bf16(values: &[f32], out: &mut [Bf16]) {
    use rayon::prelude::*;
    out.par_chunks_mut(1 << 16)
        .zip(values.par_chunks(1 << 16))
        .for_each(|(out, values)| {
            for (o, &v) in out.iter_mut().zip(values) {
                *o = Bf16::round(v);
            }
        });
}

/// out = x Wᵀ for many rows with W held in fewer bits: W widened to f32 a panel of
/// output rows at a time (`widen(first row, panel)`, a few MiB reused, spread over the
/// threads), each panel's product a GEMM at full speed. A weight is then an exact f32
/// of its stored value, and the activations stay f32.
fn gemm_widened(
    d_out: usize,
    x: &[f32],
    d_in: usize,
    out: &mut [f32],
    widen: impl Fn(usize, &mut [f32]) + Sync,
) {
    use rayon::prelude::*;
    let rows = x.len() / d_in;
    let panel_rows = ((1 << 20) / d_in).clamp(1, d_out);
    let mut panel = vec![0f32; panel_rows * d_in];
    // Slices of the panel per thread, whole rows each.
    let slice_rows = panel_rows.div_ceil(4 * threads()).max(1);
    for first in (0..d_out).step_by(panel_rows) {
        let n = panel_rows.min(d_out - first);
        let panel = &mut panel[..n * d_in];
        panel
            .par_chunks_mut(slice_rows * d_in)
            .enumerate()
            .for_each(|(i, slice)| widen(first + i * slice_rows, slice));
        let p = Product::new(
            Strided::rows(x, d_in),
            Strided::columns(panel, d_in),
            (rows, n, d_in),
        );
        matmul(&mut out[first..], d_out, p, Precision::F32);
    }
}

/// out = x Wᵀ + b for a few rows, along Wᵀ (d_in, d_out): each thread takes a share of
/// the outputs when W is large.
fn project_transposed(wt: &[f32], bias: Option<&[f32]>, x: &[f32], d_in: usize, out: &mut [f32]) {
    let d_out = wt.len() / d_in;
    let share = if splits(wt.len()) {
        d_out.div_ceil(threads())
    } else {
        d_out
    };
    for (x, out) in x.chunks_exact(d_in).zip(out.chunks_exact_mut(d_out)) {
        for_each_piece(out, share, |i, out| {
            let first = i * share;
            let bias = bias.map(|b| &b[first..first + out.len()]);
            matvec_t(wt, d_out, first, bias, x, out);
        });
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

/// f32 rows of `w` converted into a matrix `CONVERT_ROWS` at a time (`convert(first
/// row, their values)`), each slice's file pages released once read.
fn convert_rows(w: &Values, d_out: usize, d_in: usize, mut convert: impl FnMut(usize, &[f32])) {
    for first in (0..d_out).step_by(CONVERT_ROWS) {
        let rows = first..(first + CONVERT_ROWS).min(d_out);
        let values = rows.start * d_in..rows.end * d_in;
        convert(first, &w[values.clone()]);
        w.release(values);
    }
    w.release(0..w.len());
}

/// out = x Wᵀ + bias from W in eight or four bits, for every row of x (each quantized
/// once). The outputs are shared out over the threads and each thread takes every row,
/// in L2-sized chunks (`grouped::x_rows_per_chunk`): a weight is read from memory once
/// per chunk, so once for a decoding step and a few times for a long prompt's pass.
fn project_quantized<F: Format>(
    w: &Grouped<F>,
    bias: Option<&[f32]>,
    x: &[f32],
    out: &mut [f32],
    rows: &mut Vec<Q8Row>,
) {
    let (d_in, d_out) = (w.cols(), w.rows());
    let n = x.len() / d_in;
    let shares = if splits(d_out * d_in) { threads() } else { 1 };
    let share = d_out.div_ceil(shares).max(1).next_multiple_of(GROUP);
    if rows.len() < n {
        rows.resize_with(n, Q8Row::default);
    }
    for (row, x) in rows.iter_mut().zip(x.chunks_exact(d_in)) {
        w.quantize_row(x, row);
    }
    let rows = &rows[..n];
    if n == 1 {
        let share = d_out
            .div_ceil(one_row_shares(d_out * d_in))
            .next_multiple_of(GROUP);
        for_each_piece(&mut out[..d_out], share, |i, out| {
            let first = i * share;
            let bias = bias.map(|b| &b[first..first + out.len()]);
            w.matvec(first, &rows[0], bias, out);
        });
        return;
    }
    // Several rows: each share of the outputs for every row.
    by_output_shares(d_out, n, share, out, |first, len, part| {
        w.matmat(first, len, rows, bias.map(|b| &b[first..first + len]), part);
    });
}

/// A norm's gain and bias (always f32: they are C values each).
pub struct Norm {
    w: Values,
    b: Option<Values>,
}

/// One block's weights, in the order the data flows.
pub struct Layer {
    pub ln_1: Norm,
    pub attn_qkv: Matrix,
    pub attn_proj: Matrix,
    pub ln_2: Norm,
    pub mlp_fc: Matrix,
    pub mlp_proj: Matrix,
}

/// The whole model as the decoder reads it.
pub struct DecodeWeights {
    pub spec: ModelSpec,
    pub format: WeightFormat,
    pub layers: Vec<Layer>,
    /// The token embedding (V, C), also the tied output layer.
    pub tokens: Matrix,
    /// Vectors added at the input per position: the learned table, or the sinusoids;
    /// `None` for RoPE.
    pub positions: Option<Values>,
    pub ln_f: Norm,
    pub rope: Option<Rope>,
    pub activation: Activation,
    /// Some matrix's products are split over the threads even for one row (see
    /// `weight_rows::splits`): decoding then runs on the thread pool.
    pub splits_products: bool,
}

impl DecodeWeights {
    /// `spec`'s weights from a flat buffer in table order (copied).
    pub fn from_flat(spec: &ModelSpec, flat: &[f32], format: WeightFormat) -> Result<Self> {
        assert_eq!(flat.len(), spec.len(), "a flat buffer of the whole table");
        Self::build(spec, format, |id| {
            Ok(Values::Owned(Lines::copy_of(&flat[spec[id].range()])))
        })
    }

    /// `spec`'s weights, each tensor's values from `fetch` (in table order).
    pub fn build(
        spec: &ModelSpec,
        format: WeightFormat,
        mut fetch: impl FnMut(ParamId) -> Result<Values>,
    ) -> Result<Self> {
        let cfg = &spec.config;
        let s = &spec.shapes;
        // f32 weights are read as `fetch` gives them (in place, or copied); a converted
        // model holds its own copy of the small tensors (`Values::into_owned`).
        let small = |values: Values| match format {
            WeightFormat::F32 => values,
            _ => values.into_owned(),
        };
        let mut norm = |p: &NormParams| -> Result<Norm> {
            Ok(Norm {
                w: small(fetch(p.weight)?),
                b: p.bias.map(&mut fetch).transpose()?.map(small),
            })
        };
        // Norms first, then matrices: `fetch` is one closure, borrowed in turn.
        let mut norms = Vec::with_capacity(2 * s.n_layer + 1);
        for b in &spec.blocks {
            norms.push(norm(&b.ln_1)?);
            norms.push(norm(&b.ln_2)?);
        }
        let ln_f = norm(&spec.ln_f)?;
        let mut matrix = |p: &LinearParams| -> Result<Matrix> {
            let w = fetch(p.weight)?;
            let bias = p.bias.map(&mut fetch).transpose()?.map(small);
            Ok(Matrix::new(w, bias, (p.d_out, p.d_in), format))
        };
        let mut layers = Vec::with_capacity(s.n_layer);
        let mut norms = norms.into_iter();
        for b in &spec.blocks {
            let (ln_1, ln_2) = (norms.next().unwrap(), norms.next().unwrap());
            layers.push(Layer {
                ln_1,
                attn_qkv: matrix(&b.attn_qkv)?,
                attn_proj: matrix(&b.attn_proj)?,
                ln_2,
                mlp_fc: matrix(&b.mlp_fc)?,
                mlp_proj: matrix(&b.mlp_proj)?,
            });
        }
        let tokens = Matrix::new(fetch(spec.wte)?, None, (s.vocab_size, s.n_embd), format);
        let positions = match (spec.wpe, cfg.positions) {
            (Some(id), _) => Some(small(fetch(id)?)),
            (None, PositionKind::Sinusoidal) => {
                Some(Values::Owned(Lines::copy_of(&sinusoidal_values(spec)?)))
            }
            (None, _) => None,
        };
        let splits_products = spec
            .blocks
            .iter()
            .any(|b| b.linears().iter().any(|p| splits(p.d_in * p.d_out)));
        Ok(Self {
            layers,
            tokens,
            positions,
            ln_f,
            rope: (cfg.positions == PositionKind::Rope).then(|| Rope::new(cfg)),
            activation: Activation::new(cfg.mlp, s),
            splits_products,
            format,
            spec: spec.clone(),
        })
    }

    /// Bytes of weights held (or mapped and read).
    pub fn bytes(&self) -> usize {
        self.sum_bytes(Matrix::bytes) + self.positions.as_ref().map_or(0, |p| 4 * p.len())
    }

    /// Bytes of weights a decoding pass reads, whatever its rows: every matrix once
    /// (the token embedding as the output layer; an f32 matrix in one of its two
    /// layouts), the norms, and one row of a position table (`bench`'s read rate).
    pub fn bytes_per_pass(&self) -> usize {
        let row = 4 * self.spec.shapes.n_embd;
        self.sum_bytes(Matrix::bytes_per_pass) + self.positions.as_ref().map_or(0, |_| row)
    }

    /// The norms' bytes and `matrix`'s count of every matrix's.
    fn sum_bytes(&self, matrix: fn(&Matrix) -> usize) -> usize {
        let norm = |n: &Norm| 4 * (n.w.len() + n.b.as_ref().map_or(0, |b| b.len()));
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                norm(&l.ln_1)
                    + norm(&l.ln_2)
                    + [&l.attn_qkv, &l.attn_proj, &l.mlp_fc, &l.mlp_proj]
                        .into_iter()
                        .map(matrix)
                        .sum::<usize>()
            })
            .sum();
        layers + matrix(&self.tokens) + norm(&self.ln_f)
    }

    /// A norm's view for the norm kernels.
    pub fn norm<'a>(&self, n: &'a Norm) -> NormWeights<'a> {
        let cfg = &self.spec.config;
        NormWeights {
            kind: cfg.norm,
            eps: cfg.norm_eps as f32,
            w: &n.w,
            b: n.b.as_deref(),
        }
    }

    /// x[r] = the token vector of ids[r] (+ its position's vector), rows of width C;
    /// row r is at position `position(r)`.
    pub fn embed(&self, x: &mut [f32], ids: &[u32], position: impl Fn(usize) -> usize) {
        let c = self.spec.shapes.n_embd;
        for (r, (row, &id)) in x.chunks_exact_mut(c).zip(ids).enumerate() {
            self.tokens.row_into(id as usize, row);
            if let Some(table) = &self.positions {
                let p = position(r);
                axpy(row, 1.0, &table[p * c..(p + 1) * c]);
            }
        }
    }
}
