//! What the fused CUDA engine allocates, as numbers: every device buffer's length,
//! sized once from the model's shapes and the batch. The engine allocates from this
//! plan and the memory check reads its total, so the estimate is the allocation, not
//! a fit. Plain arithmetic: it compiles and is tested without CUDA.

use crate::config::{PositionKind, Precision};
use crate::model::spec::{ModelSpec, Shapes};

/// Block rows of the two-step column sums (bias and norm-gain gradients): each sums
/// every PARTS-th row, then one pass adds the PARTS partial sums in order.
pub const PARTS: usize = 64;

/// Partial rows of the one-pass norm backward's column sums, at most (a warp's each):
/// enough warps to reach every SM of a large GPU, few enough rows for
/// `add_column_sums`.
pub const NORM_PARTS: usize = 256;

/// The column partial sums' buffer for rows `c` wide and layers at most `widest`:
/// PARTS rows of a bias's or a norm's two sums, or NORM_PARTS rows of a norm's two.
pub fn partials_len(c: usize, widest: usize) -> usize {
    (PARTS * 2 * widest).max(NORM_PARTS * 2 * c)
}

/// Values of one tensor a block of AdamW updates, at most (`kernels::adamw_chunks`).
pub const ADAMW_CHUNK: usize = 4096;

/// Blocks of the first step of the gradient norm (partial sums of squares in f64).
pub const NORM_BLOCKS: usize = 1024;

/// Where, in the f64 sums after the NORM_BLOCKS partials, the engine keeps what the
/// host reads only when it reports: the squared gradient norm of the last clip, and
/// from LOSS_SUM on each forward's summed loss since the last read (LOSS_SLOTS of them;
/// more forwards between reads fetch the full slots first).
pub const NORM_SQ: usize = NORM_BLOCKS;
pub const LOSS_SUM: usize = NORM_BLOCKS + 1;
pub const LOSS_SLOTS: usize = 256;

/// How the engine computes attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attention {
    /// cuBLAS batched products around a causal softmax kernel, through (B, H, T, T)
    /// weights (attention.cu): any head size, f32 or bf16.
    Products,
    /// Tiles of scores in registers on bf16 tensor cores, never the (T, T) weights
    /// (flash.cu): bf16, heads of 16 to 64 in steps of 16.
    Flash,
}

/// The largest head flash.cu's tiles hold (`FLASH_MAX_D`).
pub const FLASH_MAX_HEAD: usize = 64;

impl Attention {
    /// Flash where it applies (`flash_holds`, kernels built for sm_80 or newer), unless
    /// `TINYGPT_CUDA_ATTENTION=products` asks for the products path (to compare the two).
    pub fn choose(shapes: &Shapes, precision: Precision, batch: usize) -> Self {
        // build.rs says what the PTX targets (its default, 80, where it did not run).
        let arch = option_env!("TINYGPT_PTX_ARCH").map_or(Some(80), |a| a.parse::<u32>().ok());
        let bf16_cores = arch.is_some_and(|cap| cap >= 80);
        let asked_products = std::env::var("TINYGPT_CUDA_ATTENTION")
            .is_ok_and(|v| v.eq_ignore_ascii_case("products"));
        if Self::flash_holds(shapes, precision, batch) && bf16_cores && !asked_products {
            Attention::Flash
        } else {
            Attention::Products
        }
    }

    /// Whether flash attention computes this model at `batch` sequences: bf16, a head
    /// its tiles hold, and at most 65,535 heads in all (its grid's second dimension).
    pub fn flash_holds(shapes: &Shapes, precision: Precision, batch: usize) -> bool {
        let d = shapes.head_dim;
        precision == Precision::Bf16
            && d.is_multiple_of(16)
            && d <= FLASH_MAX_HEAD
            && batch * shapes.n_head <= 65_535
    }
}

/// Lengths, in elements, of everything the engine holds on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// Rows: sequences x block_size.
    pub rows: usize,
    /// Scalars of all parameters: the flat buffer's length, as are the gradients',
    /// and each AdamW moment's.
    pub params: usize,
    /// What one block's forward keeps for its backward (f32).
    pub per_block: usize,
    /// Activations outside the blocks (f32): embeddings, final norm, logits, losses.
    pub outside: usize,
    /// Work space every block shares (f32): gradients flowing down, heads in the
    /// products' layout, the attention weights and their gradient.
    pub scratch: usize,
    /// The batch and its token buckets (u32).
    pub ids: usize,
    /// Fixed tables (f32): sinusoidal positions or RoPE's cos and sin.
    pub tables: usize,
    /// f64 partial sums of the gradient norm, then the norm and the loss summed.
    pub sums: usize,
    /// AdamW's chunks (`kernels::adamw_chunks`): two u64 each.
    pub adam_chunks: usize,
    /// What bf16 products read, in bf16 values (all 0 with f32 products): the
    /// weights' copy, and the buffers each product's operands are rounded into: a
    /// layer's input rows (N x its widest input) and its output's gradient rows (N x
    /// its widest output, the logits' among them).
    pub bf16: Bf16Plan,
}

/// The bf16 buffers' lengths (`Plan::bf16`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Bf16Plan {
    pub weights: usize,
    pub inputs: usize,
    pub outputs: usize,
    /// The MLP's activation's gradient, as the down-projection's backward writes it
    /// (N x hidden).
    pub dact: usize,
    /// The heads' output's gradient, as the attention projection's backward writes it
    /// for flash attention (N x C; 0 with the products path, which reads it in f32).
    pub dy: usize,
    /// A sub-layer's branch as its product writes it, before the residual add (N x C).
    pub branch: usize,
    /// The gradient at a norm's output, as a product's backward writes it (N x C).
    pub dln: usize,
    /// What each block's forward keeps in bf16 for its backward (`Kept16`): its two
    /// norms' outputs, its activation, (flash attention) its heads' output, and the
    /// MLP's first projection.
    pub kept: Kept16Plan,
}

/// The bf16 rows a block keeps (`Bf16Plan::kept`), in values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Kept16Plan {
    pub ln: usize,
    pub act: usize,
    pub y: usize,
    pub fc: usize,
    /// q | k | v where only flash attention reads them (`qkv_in_bf16`).
    pub qkv: usize,
}

impl Kept16Plan {
    fn values(&self) -> usize {
        2 * self.ln + self.act + self.y + self.fc + self.qkv
    }
}

impl Bf16Plan {
    fn values(&self) -> usize {
        self.weights + self.inputs + self.outputs + self.dact + self.dy + self.branch + self.dln
    }
}

/// Whether a block keeps its q | k | v rows only in bf16, as their product writes them:
/// with bf16 operand copies and flash attention (which reads its heads in bf16 either
/// way), where nothing is done to them in f32 (no rotary positions turned in; a bias is
/// added by the product's epilogue before it rounds, or else to the rounded rows).
pub fn qkv_in_bf16(spec: &ModelSpec, attention: Attention, precision: Precision) -> bool {
    bf16_operands(precision)
        && attention == Attention::Flash
        && spec.config.positions != PositionKind::Rope
}

/// Whether bf16 products read bf16 copies of their operands (the default), or, with
/// `TINYGPT_CUDA_BF16_OPERANDS=0`, f32 data that cuBLAS rounds on the fly
/// (32F_FAST_16BF): the same operands and f32 sums (up to the order cuBLAS sums in), so a
/// GPU check can time the two in one run.
pub fn bf16_operands(precision: Precision) -> bool {
    precision == Precision::Bf16
        && std::env::var("TINYGPT_CUDA_BF16_OPERANDS").map_or(true, |v| v != "0")
}

impl Plan {
    /// `qkv16`: blocks keep q | k | v in bf16 only (`qkv_in_bf16`).
    pub fn new(
        s: &Shapes,
        (params, adam_chunks): (usize, usize),
        batch: usize,
        tables: usize,
        (attention, precision, qkv16): (Attention, Precision, bool),
    ) -> Self {
        let (t, c) = (s.block_size, s.n_embd);
        let n = batch * t;
        let norm_stats = 2 * n;
        let (lse, weights) = match attention {
            // Each row's log-sum-exp (kept per layer), and dY . Y per row (shared).
            Attention::Flash => (batch * s.n_head * t, batch * s.n_head * t),
            // The weights and their gradient.
            Attention::Products => (0, 2 * batch * s.n_head * t * t),
        };
        // With bf16 operands the MLP's first projection is kept in bf16 (`Kept16Plan`),
        // and so is its activation (the backward reads it there, where f32 products
        // recompute it into the work space), whose gradient a bf16 product writes.
        let copies = bf16_operands(precision);
        let f32_unless_copies = |values: usize| if copies { 0 } else { values };
        let qkv = n * s.qkv_width;
        let (qkv_f32, qkv_bf16) = if qkv16 { (0, qkv) } else { (qkv, 0) };
        // Flash attention with bf16 operands writes the heads' output in bf16 only,
        // and reads its gradient so.
        let y16 = copies && attention == Attention::Flash;
        let (y_f32, y_bf16) = if y16 { (0, n * c) } else { (n * c, 0) };
        let per_block = 2 * norm_stats
            + qkv_f32 // q | k | v, positions turned in
            + y_f32 // the heads' output
            + 2 * n * c // the residual stream after each sub-layer
            + f32_unless_copies(n * s.mlp_fc_width) // the MLP's first projection
            + lse;
        let outside = n * c // the embeddings entering the first block
            + n * c + norm_stats // the final norm
            + Self::f32_logits(n, s.vocab_size, precision)
            + n; // each position's loss
        let widest = c.max(s.qkv_width).max(s.mlp_fc_width);
        // The products path splits the heads out (q, k, v, and the heads' output or its
        // gradient) and computes their gradients there; flash attention reads them in
        // place and writes their gradients in place, but for grouped K/V heads (written
        // per query head, then summed).
        let products = attention == Attention::Products;
        let split_heads = if products { 4 * n * c } else { 0 };
        let head_grads = if products || s.n_kv_head != s.n_head {
            3 * n * c
        } else {
            0
        };
        let scratch = 2 * n * c // dres, and the branch (or its gradient after dropout)
            + f32_unless_copies(2 * n * c) // a norm's output (recomputed), its gradient
            + y_f32 // dy
            + n * s.qkv_width // dqkv
            + f32_unless_copies(2 * n * s.mlp_hidden) // the activation and its gradient
            + n * s.mlp_fc_width // dfc
            + split_heads // q, k, v, heads: (B, H, T, d) each
            + head_grads // dq, dk, dv
            + weights
            + partials_len(c, widest); // column partial sums
        let bf16 = match copies {
            false => Bf16Plan::default(),
            true => Bf16Plan {
                weights: params,
                inputs: n * c.max(s.mlp_hidden),
                outputs: n * c.max(s.qkv_width).max(s.mlp_fc_width).max(s.vocab_size),
                dact: n * s.mlp_hidden,
                dy: y_bf16,
                branch: n * c,
                dln: n * c,
                kept: Kept16Plan {
                    fc: n * s.mlp_fc_width,
                    qkv: qkv_bf16,
                    ln: n * c,
                    act: n * s.mlp_hidden,
                    y: y_bf16,
                },
            },
        };
        Self {
            bf16,
            rows: n,
            params,
            per_block,
            outside,
            scratch,
            ids: 2 * n + 3 * n + 1 + 2, // ids, targets; tokens, starts, order; the pass
            tables,
            sums: LOSS_SUM + LOSS_SLOTS,
            adam_chunks,
        }
    }

    /// Whether bf16 products read bf16 copies of their operands (`bf16_operands`).
    pub fn copies(&self) -> bool {
        self.bf16.weights > 0
    }

    /// The f32 logits (then probabilities, then their gradient): none where the output
    /// layer writes bf16 logits into the bf16 operand buffer, and the loss's gradient
    /// overwrites them there.
    pub fn f32_logits(rows: usize, vocab: usize, precision: Precision) -> usize {
        if bf16_operands(precision) {
            0
        } else {
            rows * vocab
        }
    }

    /// The plan of the model `spec` at `batch` sequences, attention computed as
    /// `attention`, products in `precision`.
    pub fn for_spec(
        spec: &ModelSpec,
        batch: usize,
        attention: Attention,
        precision: Precision,
    ) -> Self {
        let s = &spec.shapes;
        let tables = match spec.config.positions {
            PositionKind::Sinusoidal => s.block_size * s.n_embd,
            PositionKind::Rope => s.block_size * s.head_dim, // cos and sin, d/2 each
            PositionKind::Learned => 0,
        };
        let chunks = spec
            .params()
            .iter()
            .map(|p| p.len().div_ceil(ADAMW_CHUNK))
            .sum();
        let table = (spec.len(), chunks);
        let qkv16 = qkv_in_bf16(spec, attention, precision);
        Self::new(s, table, batch, tables, (attention, precision, qkv16))
    }

    /// Device bytes to evaluate (weights and activations) and, with `training`, to
    /// train (gradients and the two moments besides).
    pub fn bytes(&self, layers: usize, training: bool) -> u64 {
        let copies = if training { 4 } else { 1 };
        let f32s = copies * self.params
            + layers * self.per_block
            + self.outside
            + self.scratch
            + self.tables;
        4 * (f32s + self.ids) as u64
            + 8 * self.sums as u64
            + 16 * self.adam_chunks as u64
            + 2 * (self.bf16.values() + layers * self.bf16.kept.values()) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::model::ModelSpec;

    /// GPT-2 small at T 1024, batch 8: 124M parameters (4 copies: ~2 GB) and the
    /// activations of 8192 rows, the logits alone 1.6 GB.
    #[test]
    fn gpt2_small_needs_a_few_gigabytes() {
        let cfg = ModelConfig {
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            block_size: 1024,
            vocab_size: 50304,
            ..ModelConfig::default()
        };
        let spec = ModelSpec::new(&cfg);
        let plan = Plan::for_spec(&spec, 8, Attention::Products, Precision::F32);
        assert_eq!(plan.rows, 8192);
        let logits = 4 * 8192 * 50304u64;
        let gb = plan.bytes(12, true) as f64 / 1e9;
        assert!((4.0..9.0).contains(&gb), "{gb} GB");
        assert!(plan.bytes(12, true) > logits + 16 * spec.len() as u64);
        // Flash attention keeps 2 x 8 x 12 x 1024 values of row statistics instead of
        // the (B, H, T, T) weights and their gradient (805 MB), and reads and writes
        // the heads in place: no split q, k, v, heads, dq, dk, dv.
        let flash = Plan::for_spec(&spec, 8, Attention::Flash, Precision::F32);
        let weights = 4 * 2 * 8 * 12 * 1024 * 1024u64;
        let statistics = 4 * (12 + 1) * 8 * 12 * 1024u64;
        let split = 4 * 7 * 8192 * 768u64;
        assert_eq!(
            flash.bytes(12, true) + weights + split - statistics,
            plan.bytes(12, true)
        );
        // bf16 products add the weights' bf16 copy, two operand buffers (8192 rows of
        // the widest input, the MLP's 3072, and of the widest output, the logits',
        // which the output layer writes there in bf16: the f32 logits are gone), the
        // activation's gradient, and what each block keeps in bf16 for its backward:
        // two norms' outputs, the heads' output, the MLP's first projection and its
        // activation, which are no longer kept or recomputed in f32.
        let bf16 = Plan::for_spec(&spec, 8, Attention::Flash, Precision::Bf16);
        // And (learned positions, no biases) q | k | v in bf16 only, the heads' output
        // and its gradient too, a branch and a norm's output's gradient as their
        // products write them; the f32 work space of a norm's output is not needed.
        let operands = 8192 * (3072 + 50304 + 3072 + 3 * 768) as u64;
        let kept = 12 * 8192 * (3 * 768 + 3072 + 3072 + 3 * 768) as u64;
        let f32_gone = 4 * 8192 * (12 * (3072 + 3 * 768 + 768) + 2 * 3072 + 3 * 768) as u64;
        assert_eq!(
            bf16.bytes(12, true) + logits + f32_gone - flash.bytes(12, true),
            2 * (spec.len() as u64 + operands + kept)
        );
        let optimiser = plan.bytes(12, true) - plan.bytes(12, false);
        assert_eq!(
            optimiser,
            12 * spec.len() as u64,
            "gradients and two moments"
        );
    }
}
