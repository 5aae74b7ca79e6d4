//! The model, described once: its shapes and its parameter table.
//!
//! Every engine reads this. The reference model takes its tensors from the table by
//! handle; the fused CPU engine lays the same table out in one flat buffer (llm.c's
//! `ParameterTensors` and `fill_in_parameter_sizes`, typed); the decoder, Hugging Face
//! import and export, the memory estimate and the checkpoint checks find names, shapes
//! and offsets here. A parameter's name is its tensor name in `model.safetensors`
//! (GPT-2's, without the `transformer.` prefix), and it is spelled nowhere else.

use std::ops::{Index, Range};

use anyhow::Result;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

use crate::config::{MlpKind, ModelConfig, NormKind, PositionKind};

/// The sizes every layer works with. The batch (B) and the positions of one call (T)
/// are not here: they belong to a call, not to the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shapes {
    pub n_layer: usize,
    /// C: the width of the residual stream.
    pub n_embd: usize,
    /// H: query heads.
    pub n_head: usize,
    /// Key/value heads; each serves `n_head / n_kv_head` query heads.
    pub n_kv_head: usize,
    /// d = C / H.
    pub head_dim: usize,
    /// The most positions the model sees at once.
    pub block_size: usize,
    /// V.
    pub vocab_size: usize,
    /// Keys (and values) of one position: n_kv_head * d.
    pub kv_width: usize,
    /// One row of the fused q | k | v projection: (H + 2 H_kv) d.
    pub qkv_width: usize,
    /// The MLP's hidden layer.
    pub mlp_hidden: usize,
    /// The MLP's first projection: the hidden width, twice it for SwiGLU (gate | up).
    pub mlp_fc_width: usize,
}

impl Shapes {
    pub fn new(cfg: &ModelConfig) -> Self {
        let head_dim = cfg.head_dim();
        let kv_width = cfg.kv_heads() * head_dim;
        let mlp_hidden = cfg.mlp_hidden();
        Self {
            n_layer: cfg.n_layer,
            n_embd: cfg.n_embd,
            n_head: cfg.n_head,
            n_kv_head: cfg.kv_heads(),
            head_dim,
            block_size: cfg.block_size,
            vocab_size: cfg.vocab_size,
            kv_width,
            qkv_width: cfg.n_head * head_dim + 2 * kv_width,
            mlp_hidden,
            mlp_fc_width: match cfg.mlp {
                MlpKind::Swiglu => 2 * mlp_hidden,
                MlpKind::Gelu | MlpKind::GeluTanh => mlp_hidden,
            },
        }
    }

    /// Query heads that share one K/V head.
    pub fn group(&self) -> usize {
        self.n_head / self.n_kv_head
    }

    /// Weights of one block's matrices (q | k | v, attention output, MLP in and out):
    /// the multiply-adds each token makes through a layer's projections.
    pub fn block_matrix_weights(&self) -> usize {
        let c = self.n_embd;
        c * self.qkv_width + c * c + c * self.mlp_fc_width + self.mlp_hidden * c
    }
}

/// How a tensor starts: GPT-2's scheme.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    Normal { std: f64 },
    Zeros,
    Ones,
}

/// One trainable tensor of the table.
#[derive(Debug, Clone, PartialEq)]
pub struct Param {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
    /// AdamW's weight decay applies: every tensor of two or more dimensions, the
    /// embeddings included (nanoGPT's grouping). Not to norm gains (decay pulls them
    /// toward 0, not toward their start at 1) nor to biases (one number per channel:
    /// decay regularises nothing there).
    pub decay: bool,
    /// Where it starts in a flat buffer holding every parameter in table order.
    pub offset: usize,
}

impl Param {
    /// Number of scalars.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its place in a flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len()
    }
}

/// A handle to one entry of a [`ModelSpec`]'s table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ParamId(usize);

impl ParamId {
    /// Its position in the table.
    pub fn index(self) -> usize {
        self.0
    }
}

/// `y = x Wᵀ (+ b)` with W stored `[d_out, d_in]`, as torch's nn.Linear.
#[derive(Debug, Clone, Copy)]
pub struct LinearParams {
    pub weight: ParamId,
    pub bias: Option<ParamId>,
    pub d_in: usize,
    pub d_out: usize,
    /// Which of the model's projections it is (profiles group products by it).
    pub role: Projection,
}

/// The model's linear layers, by what they do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Projection {
    /// C -> q | k | v heads.
    Qkv,
    /// The heads' outputs back to the residual stream.
    AttentionOut,
    /// C -> the MLP's hidden layer.
    MlpUp,
    /// The MLP's hidden layer back to C.
    MlpDown,
    /// The tied output layer: the token embedding read as (V, C).
    Output,
}

/// A norm's gain (and, for LayerNorm with biases, its bias).
#[derive(Debug, Clone, Copy)]
pub struct NormParams {
    pub weight: ParamId,
    pub bias: Option<ParamId>,
}

/// One pre-norm block, in the order the data flows.
#[derive(Debug, Clone, Copy)]
pub struct BlockParams {
    pub ln_1: NormParams,
    /// C -> q | k | v heads.
    pub attn_qkv: LinearParams,
    /// C -> C: the heads, side by side, back to the residual stream.
    pub attn_proj: LinearParams,
    pub ln_2: NormParams,
    /// C -> the MLP's hidden layer (gate | up for SwiGLU).
    pub mlp_fc: LinearParams,
    /// hidden -> C.
    pub mlp_proj: LinearParams,
}

impl BlockParams {
    /// The four projections, in the order the data flows.
    pub fn linears(&self) -> [LinearParams; 4] {
        [self.attn_qkv, self.attn_proj, self.mlp_fc, self.mlp_proj]
    }
}

/// The whole model: its config, shapes and parameter table, with typed handles into
/// the table for every layer.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    pub config: ModelConfig,
    pub shapes: Shapes,
    table: Vec<Param>,
    /// (V, C): the token embedding, and (transposed) the output layer.
    pub wte: ParamId,
    /// (block_size, C): learned positions only.
    pub wpe: Option<ParamId>,
    pub blocks: Vec<BlockParams>,
    pub ln_f: NormParams,
}

impl ModelSpec {
    /// The table in the order the model is built (and its flat buffer laid out):
    /// embeddings, each block front to back, the final norm. Init N(0, 0.02); the two
    /// projections that write into the residual stream N(0, 0.02 / sqrt(2 n_layer)) so
    /// its variance does not grow with depth; norms at 1, biases at 0.
    pub fn new(cfg: &ModelConfig) -> Self {
        let shapes = Shapes::new(cfg);
        let (c, bias) = (shapes.n_embd, cfg.bias);
        let residual_std = 0.02 / (2.0 * cfg.n_layer as f64).sqrt();
        let mut t = Table::default();
        let wte = t.matrix("wte.weight", [shapes.vocab_size, c], 0.02);
        let wpe = (cfg.positions == PositionKind::Learned)
            .then(|| t.matrix("wpe.weight", [shapes.block_size, c], 0.02));
        let norm_bias = bias && cfg.norm == NormKind::LayerNorm;
        let blocks = (0..cfg.n_layer)
            .map(|i| {
                let at = |layer: &str| format!("h.{i}.{layer}");
                BlockParams {
                    ln_1: t.norm(&at("ln_1"), c, norm_bias),
                    attn_qkv: t.linear(
                        Projection::Qkv,
                        &at("attn.c_attn"),
                        [c, shapes.qkv_width],
                        bias,
                        0.02,
                    ),
                    attn_proj: t.linear(
                        Projection::AttentionOut,
                        &at("attn.c_proj"),
                        [c, c],
                        bias,
                        residual_std,
                    ),
                    ln_2: t.norm(&at("ln_2"), c, norm_bias),
                    mlp_fc: t.linear(
                        Projection::MlpUp,
                        &at("mlp.c_fc"),
                        [c, shapes.mlp_fc_width],
                        bias,
                        0.02,
                    ),
                    mlp_proj: t.linear(
                        Projection::MlpDown,
                        &at("mlp.c_proj"),
                        [shapes.mlp_hidden, c],
                        bias,
                        residual_std,
                    ),
                }
            })
            .collect();
        let ln_f = t.norm("ln_f", c, norm_bias);
        Self {
            config: cfg.clone(),
            shapes,
            table: t.params,
            wte,
            wpe,
            blocks,
            ln_f,
        }
    }

    /// The tied output layer: the token embedding read as a (V, C) linear layer.
    pub fn output_layer(&self) -> LinearParams {
        LinearParams {
            weight: self.wte,
            bias: None,
            d_in: self.shapes.n_embd,
            d_out: self.shapes.vocab_size,
            role: Projection::Output,
        }
    }

    /// Every parameter, in table (and flat buffer) order.
    pub fn params(&self) -> &[Param] {
        &self.table
    }

    /// Handles to every parameter, in table order.
    pub fn ids(&self) -> impl Iterator<Item = ParamId> {
        (0..self.table.len()).map(ParamId)
    }

    /// Scalars in all parameters together: the length of the flat buffer.
    pub fn len(&self) -> usize {
        self.table.last().map_or(0, |p| p.offset + p.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Scalars of the embedding tables (token, and learned positions).
    pub fn embedding_len(&self) -> usize {
        let wpe = self.wpe.map_or(0, |id| self[id].len());
        self[self.wte].len() + wpe
    }

    /// The same model with a context of `block_size` positions, and `values` (flat, in
    /// this spec's table order) as the weights of that spec. Only learned positions
    /// depend on the context: a shorter one keeps the table's first rows (nanoGPT's
    /// `crop_block_size`: position p means what it did), a longer one has rows nobody
    /// trained and is refused. Rotary and sinusoidal positions are computed for any.
    pub fn with_context(&self, values: &[f32], block_size: usize) -> Result<(Self, Vec<f32>)> {
        let mut config = self.config.clone();
        config.block_size = block_size;
        let spec = Self::new(&config);
        let mut out = Vec::with_capacity(spec.len());
        for (old, new) in self.table.iter().zip(&spec.table) {
            let mine = &values[old.range()];
            if old.shape == new.shape {
                out.extend_from_slice(mine);
            } else if block_size < self.shapes.block_size {
                // Only wpe (block_size, C) differs: its first rows, in row-major order.
                out.extend_from_slice(&mine[..new.len()]);
            } else {
                anyhow::bail!(
                    "{} has learned positions for {} tokens, none for a context of {block_size}",
                    old.name,
                    self.shapes.block_size
                );
            }
        }
        Ok((spec, out))
    }

    /// Freshly initialised weights, as one flat buffer in table order: every Normal
    /// tensor drawn in turn from one ChaCha8 stream seeded with `seed`, so the same seed
    /// gives the same weights in every engine on every device.
    pub fn initial_values(&self, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut values = Vec::with_capacity(self.len());
        for p in &self.table {
            match p.init {
                Init::Normal { std } => values.extend((0..p.len()).map(|_| {
                    let z: f64 = StandardNormal.sample(&mut rng);
                    (z * std) as f32
                })),
                Init::Zeros => values.resize(values.len() + p.len(), 0.0),
                Init::Ones => values.resize(values.len() + p.len(), 1.0),
            }
        }
        values
    }
}

impl Index<ParamId> for ModelSpec {
    type Output = Param;

    fn index(&self, id: ParamId) -> &Param {
        &self.table[id.0]
    }
}

/// The table under construction: each entry placed after the last.
#[derive(Default)]
struct Table {
    params: Vec<Param>,
    next: usize,
}

impl Table {
    fn push(&mut self, name: String, shape: Vec<usize>, init: Init) -> ParamId {
        let param = Param {
            name,
            decay: shape.len() >= 2,
            shape,
            init,
            offset: self.next,
        };
        self.next += param.len();
        self.params.push(param);
        ParamId(self.params.len() - 1)
    }

    fn matrix(&mut self, name: &str, shape: [usize; 2], std: f64) -> ParamId {
        self.push(name.into(), shape.to_vec(), Init::Normal { std })
    }

    /// `{prefix}.weight` as (d_out, d_in), and `{prefix}.bias` (d_out) when `bias`.
    fn linear(
        &mut self,
        role: Projection,
        prefix: &str,
        [d_in, d_out]: [usize; 2],
        bias: bool,
        std: f64,
    ) -> LinearParams {
        LinearParams {
            weight: self.matrix(&format!("{prefix}.weight"), [d_out, d_in], std),
            bias: bias.then(|| self.push(format!("{prefix}.bias"), vec![d_out], Init::Zeros)),
            d_in,
            d_out,
            role,
        }
    }

    fn norm(&mut self, prefix: &str, width: usize, bias: bool) -> NormParams {
        NormParams {
            weight: self.push(format!("{prefix}.weight"), vec![width], Init::Ones),
            bias: bias.then(|| self.push(format!("{prefix}.bias"), vec![width], Init::Zeros)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn baby() -> ModelConfig {
        ModelConfig {
            vocab_size: 65,
            ..ModelConfig::default()
        }
    }

    #[test]
    fn a_shorter_context_keeps_the_first_position_rows_and_everything_else() {
        let spec = ModelSpec::new(&baby());
        let values = spec.initial_values(3);
        let (short, cut) = spec.with_context(&values, 16).unwrap();
        assert_eq!(short.shapes.block_size, 16);
        assert_eq!(cut.len(), spec.len() - (64 - 16) * 128);
        for (old, new) in spec.params().iter().zip(short.params()) {
            let kept = &values[old.range()][..new.len()];
            assert_eq!(&cut[new.range()], kept, "{}", old.name);
        }
        // Nothing was trained for positions past the table.
        let err = spec.with_context(&values, 65).unwrap_err();
        assert!(format!("{err}").contains("wpe.weight"), "{err}");
        // Rotary positions hold no weights: any context, the same values.
        let rope = ModelSpec::new(&ModelConfig {
            positions: PositionKind::Rope,
            ..baby()
        });
        let values = rope.initial_values(3);
        for block in [16, 256] {
            assert_eq!(rope.with_context(&values, block).unwrap().1, values);
        }
    }

    #[test]
    fn the_baby_model_has_nanogpts_parameter_count() {
        // 0.80M in nanoGPT's count, which leaves out the 64 x 128 position table.
        let spec = ModelSpec::new(&baby());
        assert_eq!(spec.len(), 804_096);
        assert_eq!(spec.len() - 64 * 128, 795_904);
        assert_eq!(spec.embedding_len(), 65 * 128 + 64 * 128);
    }

    #[test]
    fn offsets_tile_the_flat_buffer_in_table_order() {
        let cfg = ModelConfig {
            bias: true,
            n_kv_head: Some(2),
            ..baby()
        };
        let spec = ModelSpec::new(&cfg);
        let mut next = 0;
        for p in spec.params() {
            assert_eq!(p.offset, next, "{} starts where the last ended", p.name);
            next += p.len();
        }
        assert_eq!(next, spec.len());
    }

    #[test]
    fn grouped_heads_narrow_the_qkv_rows() {
        let cfg = ModelConfig {
            n_kv_head: Some(1),
            ..baby()
        };
        let s = Shapes::new(&cfg);
        // 4 query heads of 32, one K/V head of 32: 128 + 2 * 32.
        assert_eq!(
            (s.head_dim, s.kv_width, s.qkv_width, s.group()),
            (32, 32, 192, 4)
        );
        let spec = ModelSpec::new(&cfg);
        assert_eq!(spec[spec.blocks[0].attn_qkv.weight].shape, vec![192, 128]);
    }

    #[test]
    fn swiglu_fuses_gate_and_up() {
        let cfg = ModelConfig {
            mlp: MlpKind::Swiglu,
            ..baby()
        };
        let s = Shapes::new(&cfg);
        // 8/3 C rounded up to a multiple of 8: 344; gate | up.
        assert_eq!((s.mlp_hidden, s.mlp_fc_width), (344, 688));
    }

    #[test]
    fn only_matrices_decay_and_init_follows_the_table() {
        let cfg = ModelConfig {
            bias: true,
            ..baby()
        };
        let spec = ModelSpec::new(&cfg);
        let values = spec.initial_values(3);
        assert_eq!(values, spec.initial_values(3), "seeded");
        for p in spec.params() {
            assert_eq!(p.decay, p.shape.len() == 2, "{}", p.name);
            let v = &values[p.range()];
            match p.init {
                Init::Ones => assert!(v.iter().all(|&x| x == 1.0), "{}", p.name),
                Init::Zeros => assert!(v.iter().all(|&x| x == 0.0), "{}", p.name),
                Init::Normal { std } => {
                    let sd = (v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / v.len() as f64)
                        .sqrt();
                    assert!((sd / std - 1.0).abs() < 0.1, "{}: sd {sd} vs {std}", p.name);
                }
            }
        }
        // The residual projections start smaller: 0.02 / sqrt(2 * 4 layers).
        let proj = &spec[spec.blocks[0].attn_proj.weight];
        assert_eq!(
            proj.init,
            Init::Normal {
                std: 0.02 / 8f64.sqrt()
            }
        );
    }
}
