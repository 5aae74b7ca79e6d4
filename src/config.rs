//! The experiment: one TOML file, `--set section.key=value` overrides, one validated
//! [`Config`].
//!
//! Every field has a default, so a config file names only what differs. Unknown keys
//! are rejected by name (serde's `deny_unknown_fields`), overrides must fit the field's
//! type, and [`Config::validate`] checks the rules that tie fields together. The resolved
//! config (with the tokenizer's real vocabulary size filled in) is saved as
//! `config.toml` in every checkpoint folder.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::error::user_error;
use crate::user_bail;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub run: RunConfig,
    pub data: DataConfig,
    pub tokenizer: TokenizerConfig,
    pub model: ModelConfig,
    pub train: TrainConfig,
}

/// Where the run lives and what drives it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// Run folder name under `out_dir`; empty means the config file's stem.
    pub name: String,
    pub out_dir: PathBuf,
    /// Seeds initialisation, batch sampling and dropout.
    pub seed: u64,
    /// `cpu`, `cuda`, `cuda:N`, `metal` or `auto`.
    pub device: String,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            out_dir: PathBuf::from("checkpoints"),
            seed: 1337,
            device: "cpu".into(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// A text, `.jsonl`, `.parquet` or `.bin` (token ids) file, or a folder of them
    /// read in name order.
    pub corpus: PathBuf,
    /// The field (jsonl) or column (parquet) that holds each document's text.
    pub text_field: String,
    /// The last `val_fraction` of the tokens are held out for validation (token files
    /// named `val.bin` or `*_val_*.bin` are the validation set instead).
    pub val_fraction: f64,
    /// Where trained tokenizers and token ids are kept, per corpus, for every run;
    /// empty: a `cache` folder beside the corpus (data/shakespeare.txt -> data/cache).
    pub cache_dir: PathBuf,
    /// How the cache tells that the corpus changed: `sampled` (each file's size,
    /// modification time and 64 blocks of it; all of a file up to 16 MiB) or `full`
    /// (all of its bytes).
    pub fingerprint: FingerprintKind,
}

/// How much of a corpus its fingerprint reads (`data.fingerprint`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FingerprintKind {
    /// Size, modification time and a hash of 64 blocks of 4 KiB spread through each
    /// file larger than 16 MiB (smaller ones whole): milliseconds for any size; a
    /// rewrite of a large file with the same size and an old modification time is seen
    /// unless it changes no sampled block.
    #[default]
    Sampled,
    /// Size, modification time and a hash of every byte: seconds a gigabyte.
    Full,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            corpus: PathBuf::from("data/shakespeare.txt"),
            text_field: "text".into(),
            val_fraction: 0.1,
            cache_dir: PathBuf::new(),
            fingerprint: FingerprintKind::Sampled,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenizerKind {
    /// Byte-level BPE, as GPT-2: every byte is a token, merges learned on the corpus.
    Bpe,
    /// One token per character seen in the corpus.
    Char,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TokenizerConfig {
    pub kind: TokenizerKind,
    /// Target vocabulary for BPE (256 byte tokens + merges + special tokens).
    pub vocab_size: usize,
    /// BPE trains on a sample of this many bytes of the corpus, spread through it (all
    /// of a smaller corpus).
    pub train_bytes: u64,
    /// Use this tokenizer.json instead of training one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
}

impl Default for TokenizerConfig {
    fn default() -> Self {
        Self {
            kind: TokenizerKind::Bpe,
            vocab_size: 2048,
            train_bytes: 32_000_000,
            path: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PositionKind {
    /// A trained embedding per position, added to the token embedding (GPT-2).
    Learned,
    /// Rotary embeddings applied to queries and keys in every layer (Llama).
    Rope,
    /// The original transformer's fixed sines and cosines, added to the embedding.
    Sinusoidal,
}

/// A named architecture: the preset fills in the options that make the model exactly
/// a standard one (and `export` can write it in that family's Hugging Face layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Any combination of the options below.
    Custom,
    /// Hugging Face GPT2LMHeadModel: learned positions, LayerNorm with bias, tanh-GELU
    /// MLP, biases on linears, tied head.
    Gpt2,
    /// Hugging Face LlamaForCausalLM (tied embeddings): RoPE, RMSNorm, SwiGLU MLP, no
    /// biases, grouped K/V heads allowed.
    Llama,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NormKind {
    /// (x - mean) / std * weight (+ bias).
    LayerNorm,
    /// x / rms(x) * weight: no centring, no bias.
    RmsNorm,
}

/// As a config file spells it (`model.norm = "layernorm"`).
impl std::fmt::Display for NormKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::LayerNorm => "layernorm",
            Self::RmsNorm => "rmsnorm",
        })
    }
}

/// Precision of the matrix products in training (`train.dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// f32 operands and sums.
    #[default]
    F32,
    /// Mixed precision: matrix-product operands rounded to bf16, products summed in
    /// f32. Weights, gradients, optimiser state, norms, softmax and the loss stay f32.
    Bf16,
}

impl Precision {
    /// The arithmetic of the products in this precision, f32 ones on TF32 if `tf32`.
    pub fn math(self, tf32: bool) -> Math {
        match (self, tf32) {
            (Precision::F32, false) => Math::F32,
            (Precision::F32, true) => Math::Tf32,
            (Precision::Bf16, _) => Math::Bf16,
        }
    }
}

/// How a matrix product multiplies on a GPU: f32 operands as they are, rounded to TF32
/// (8-bit exponent, 10-bit mantissa) on the tensor cores, or rounded to bf16 (operands
/// kept as bf16 are read as they are). The sums are f32 in all three.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Math {
    F32,
    Tf32,
    Bf16,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MlpKind {
    /// Linear, exact (erf) GELU, linear.
    Gelu,
    /// Linear, tanh-approximated GELU (GPT-2's "gelu_new"), linear.
    GeluTanh,
    /// SiLU(gate) * up, then down (Llama).
    Swiglu,
}

/// As a config file spells it (`model.mlp = "gelu_tanh"`).
impl std::fmt::Display for MlpKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Gelu => "gelu",
            Self::GeluTanh => "gelu_tanh",
            Self::Swiglu => "swiglu",
        })
    }
}

impl Arch {
    /// The options an architecture fixes, as (key, TOML value).
    pub fn preset(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Arch::Custom => &[],
            Arch::Gpt2 => &[
                ("positions", "\"learned\""),
                ("norm", "\"layernorm\""),
                ("mlp", "\"gelu_tanh\""),
                ("bias", "true"),
            ],
            Arch::Llama => &[
                ("positions", "\"rope\""),
                ("norm", "\"rmsnorm\""),
                ("mlp", "\"swiglu\""),
                ("bias", "false"),
                ("norm_eps", "1e-6"),
            ],
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// `custom`, `gpt2` or `llama`; the last two fill in positions, norm, mlp and bias.
    pub arch: Arch,
    pub n_layer: usize,
    pub n_head: usize,
    /// Key/value heads; fewer than `n_head` gives grouped-query attention, 1 multi-query.
    /// Absent means `n_head` (plain multi-head attention).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n_kv_head: Option<usize>,
    pub n_embd: usize,
    /// Context length: the most tokens the model sees at once.
    pub block_size: usize,
    pub positions: PositionKind,
    /// The sinusoidal table's amplitude; absent means 1/sqrt(n_embd) (see
    /// `model::position::sinusoidal_table`). A run records the value it trained with, so
    /// a checkpoint from before the table was scaled (2026-12-05), which records none,
    /// is read as 1: the table it was trained with.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sinusoidal_scale: Option<f64>,
    pub rope_theta: f64,
    pub dropout: f64,
    /// Biases on linear layers and LayerNorms.
    pub bias: bool,
    pub norm: NormKind,
    /// The epsilon inside the norms' square root.
    pub norm_eps: f64,
    pub mlp: MlpKind,
    /// Hidden width of the MLP; absent means 4 n_embd (GELU) or 8/3 n_embd rounded up to a
    /// multiple of 8 (SwiGLU, the same parameter count).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mlp_hidden: Option<usize>,
    /// Filled in from the tokenizer; 0 in a config file means "whatever it has".
    pub vocab_size: usize,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            n_layer: 4,
            n_head: 4,
            n_kv_head: None,
            n_embd: 128,
            block_size: 64,
            positions: PositionKind::Learned,
            sinusoidal_scale: None,
            rope_theta: 10000.0,
            dropout: 0.0,
            bias: false,
            norm: NormKind::LayerNorm,
            norm_eps: 1e-5,
            mlp: MlpKind::Gelu,
            mlp_hidden: None,
            vocab_size: 0,
            arch: Arch::Custom,
        }
    }
}

impl ModelConfig {
    /// Checks the model's rules alone (also for a model read from another tool's
    /// files, before any size is derived from it). Each error names the field.
    pub fn validate(&self) -> Result<()> {
        let m = self;
        for (name, value) in [
            ("model.n_layer", m.n_layer),
            ("model.n_head", m.n_head),
            ("model.n_embd", m.n_embd),
        ] {
            if value == 0 {
                user_bail!("config: {name} = 0; it must be at least 1");
            }
        }
        // Bounds that keep every size the model derives (parameter counts, buffer
        // offsets) far inside a usize; the memory check refuses far smaller models.
        let bounded = [
            ("model.n_layer", m.n_layer, MAX_LAYERS),
            ("model.n_embd", m.n_embd, MAX_WIDTH),
            ("model.block_size", m.block_size, MAX_WIDTH),
            ("model.mlp_hidden", m.mlp_hidden.unwrap_or(0), MAX_WIDTH),
        ];
        for (name, value, max) in bounded {
            if value > max {
                user_bail!("config: {name} = {value} exceeds the limit of {max}");
            }
        }
        if m.block_size < 2 {
            user_bail!(
                "config: model.block_size = {} is too small; it must be at least 2",
                m.block_size
            );
        }
        if !m.n_embd.is_multiple_of(m.n_head) {
            user_bail!(
                "config: model.n_embd = {} is not divisible by model.n_head = {}; pick n_embd a multiple of n_head",
                m.n_embd,
                m.n_head
            );
        }
        let kv = m.kv_heads();
        if kv == 0 {
            user_bail!(
                "config: model.n_kv_head = 0 must be at least 1; it divides model.n_head (leave it out for as many K/V heads as heads)"
            );
        }
        if !m.n_head.is_multiple_of(kv) {
            user_bail!(
                "config: model.n_head = {} is not divisible by model.n_kv_head = {kv}; n_kv_head must divide n_head",
                m.n_head
            );
        }
        if m.positions == PositionKind::Rope && !m.head_dim().is_multiple_of(2) {
            user_bail!(
                "config: RoPE needs an even head size, but n_embd / n_head = {}; change model.n_embd or model.n_head",
                m.head_dim()
            );
        }
        if m.positions == PositionKind::Sinusoidal && !m.n_embd.is_multiple_of(2) {
            user_bail!(
                "config: sinusoidal positions need an even model.n_embd (got {})",
                m.n_embd
            );
        }
        if let Some(scale) = m.sinusoidal_scale {
            if m.positions != PositionKind::Sinusoidal {
                user_bail!(
                    "config: model.sinusoidal_scale is for sinusoidal positions, but model.positions = {:?}; remove it",
                    format!("{:?}", m.positions).to_lowercase()
                );
            }
            if !(scale.is_finite() && scale > 0.0) {
                user_bail!(
                    "config: model.sinusoidal_scale = {} must be a number above 0 (leave it out for 1/sqrt(n_embd))",
                    Num(scale)
                );
            }
        }
        if !(m.rope_theta.is_finite() && m.rope_theta > 1.0) {
            user_bail!(
                "config: model.rope_theta = {} must be a number above 1 (10000 is usual)",
                Num(m.rope_theta)
            );
        }
        if !(0.0..1.0).contains(&m.dropout) {
            user_bail!(
                "config: model.dropout = {} must be in [0, 1)",
                Num(m.dropout)
            );
        }
        if m.arch != Arch::Custom {
            let preset = toml::Table::try_from(m).expect("a ModelConfig serialises");
            for (key, value) in m.arch.preset() {
                let want = parse_value(value);
                if key != &"norm_eps" && preset.get(*key) != Some(&want) {
                    user_bail!(
                        "config: model.arch = {:?} needs model.{key} = {value}; remove model.{key} or set model.arch = \"custom\"",
                        format!("{:?}", m.arch).to_lowercase()
                    );
                }
            }
            if m.arch == Arch::Gpt2 && m.kv_heads() != m.n_head {
                user_bail!("config: model.arch = \"gpt2\" has no grouped K/V heads; remove model.n_kv_head");
            }
        }
        if !(m.norm_eps.is_finite() && m.norm_eps > 0.0 && m.norm_eps < 1.0) {
            user_bail!("config: model.norm_eps = {} must be in (0, 1)", m.norm_eps);
        }
        if m.mlp_hidden == Some(0) {
            user_bail!("config: model.mlp_hidden = 0; it must be at least 1");
        }
        if m.vocab_size > MAX_VOCAB {
            user_bail!(
                "config: model.vocab_size = {} exceeds the limit of {MAX_VOCAB}",
                m.vocab_size
            );
        }
        Ok(())
    }

    /// The same model with each setting left to its default spelled out (K/V heads,
    /// the MLP's width, the sinusoidal table's amplitude): two configs of one model
    /// compare equal however they are written.
    pub fn resolved(&self) -> ModelConfig {
        ModelConfig {
            n_kv_head: Some(self.kv_heads()),
            mlp_hidden: Some(self.mlp_hidden()),
            sinusoidal_scale: (self.positions == PositionKind::Sinusoidal)
                .then(|| self.sinusoidal_amplitude()),
            ..self.clone()
        }
    }

    /// The sinusoidal table's amplitude: as recorded, else 1/sqrt(n_embd).
    pub fn sinusoidal_amplitude(&self) -> f64 {
        self.sinusoidal_scale
            .unwrap_or(1.0 / (self.n_embd as f64).sqrt())
    }

    pub fn mlp_hidden(&self) -> usize {
        self.mlp_hidden.unwrap_or(match self.mlp {
            MlpKind::Swiglu => (8 * self.n_embd / 3).div_ceil(8) * 8,
            _ => 4 * self.n_embd,
        })
    }

    pub fn kv_heads(&self) -> usize {
        self.n_kv_head.unwrap_or(self.n_head)
    }

    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Sequences per micro-batch.
    pub batch_size: usize,
    /// Micro-batches whose gradients are summed before each optimiser step.
    pub grad_accum: usize,
    /// Optimiser steps.
    pub max_iters: usize,
    /// Peak learning rate, reached after `warmup_iters`.
    pub lr: f64,
    /// Floor of the cosine decay.
    pub min_lr: f64,
    pub warmup_iters: usize,
    /// Steps over which the rate decays to `min_lr`; absent means `max_iters`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lr_decay_iters: Option<usize>,
    /// Decoupled (AdamW) weight decay, on matrices only.
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Global gradient-norm clip; 0 disables it.
    pub grad_clip: f64,
    /// Evaluate train and val loss every this many steps (and at the end).
    pub eval_interval: usize,
    /// Batches per evaluation.
    pub eval_iters: usize,
    /// Write metrics.jsonl every this many steps.
    pub log_interval: usize,
    /// Write a checkpoint every this many steps (and at the end).
    pub checkpoint_interval: usize,
    /// Train with the fused CPU kernels when the model allows (`false`: the reference
    /// candle-ops model with autograd, as on GPUs).
    pub fused: bool,
    /// Precision of the matrix products: "f32", or "bf16" (mixed precision: bf16
    /// operands; f32 master weights, optimiser, norms, softmax and loss).
    pub dtype: Precision,
    /// f32 products on the TF32 tensor cores (CUDA, Ampere or newer), as nanoGPT sets:
    /// operands rounded to 10-bit mantissas, sums in f32, about 7x the f32 rate on an
    /// H100. Off, f32 training is f32 throughout. Only f32 products change: bf16
    /// training's are bf16 already, and the CPU engines have no TF32 (they ignore it).
    pub tf32: bool,
    /// Start from this checkpoint's weights and tokenizer (fine-tuning); set by
    /// `train --init-from`. The model section then comes from that checkpoint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub init_from: Option<PathBuf>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            batch_size: 12,
            grad_accum: 1,
            max_iters: 2000,
            lr: 1e-3,
            min_lr: 1e-4,
            warmup_iters: 100,
            lr_decay_iters: None,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            grad_clip: 1.0,
            eval_interval: 250,
            eval_iters: 20,
            log_interval: 10,
            checkpoint_interval: 500,
            fused: true,
            dtype: Precision::F32,
            tf32: false,
            init_from: None,
        }
    }
}

impl TrainConfig {
    pub fn lr_decay_iters(&self) -> usize {
        self.lr_decay_iters.unwrap_or(self.max_iters)
    }

    pub fn tokens_per_step(&self, block_size: usize) -> usize {
        self.batch_size * self.grad_accum * block_size
    }
}

/// The largest vocabulary: token ids are stored as u32 and the embedding must stay sane.
pub const MAX_VOCAB: usize = 1 << 20;

/// The most layers, and the widest width, context or MLP a config may ask for.
pub const MAX_LAYERS: usize = 1 << 16;
pub const MAX_WIDTH: usize = 1 << 20;

impl Config {
    /// Reads a TOML experiment file and applies `section.key=value` overrides.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Config> {
        let bytes = std::fs::read(path).map_err(|e| {
            user_error(format!(
                "cannot read config {}: {e}; pass an existing TOML file to --config",
                path.display()
            ))
        })?;
        let text = String::from_utf8(bytes).map_err(|e| {
            user_error(format!(
                "config {} is not UTF-8 text (invalid byte at offset {}); TOML files are UTF-8: save it as such",
                path.display(),
                e.utf8_error().valid_up_to()
            ))
        })?;
        let mut config = Self::from_toml_str(&text, overrides)
            .map_err(|e| user_error(format!("config {}: {e:#}", path.display())))?;
        if config.run.name.is_empty() {
            config.run.name = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "run".into());
        }
        config.validate()?;
        Ok(config)
    }

    /// The settings the file at `path` and `overrides` name themselves (`model.n_layer`),
    /// as opposed to those left at their defaults.
    pub fn keys_given(
        path: &Path,
        overrides: &[String],
    ) -> Result<std::collections::BTreeSet<String>> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| user_error(format!("cannot read config {}: {e}", path.display())))?;
        let table: toml::Table =
            toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}", one_line(&e, &text)))?;
        let mut keys = std::collections::BTreeSet::new();
        for (section, value) in &table {
            match value {
                toml::Value::Table(inner) => {
                    keys.extend(inner.keys().map(|key| format!("{section}.{key}")))
                }
                _ => {
                    keys.insert(section.clone());
                }
            }
        }
        keys.extend(
            overrides
                .iter()
                .filter_map(|o| o.split_once('='))
                .map(|(key, _)| key.trim().to_string()),
        );
        Ok(keys)
    }

    /// A run folder's config.toml, validated, [`Config::as_trained`].
    pub fn from_run_toml(text: &str) -> Result<Config> {
        let config = Self::from_toml_str(text, &[])?;
        config.validate()?;
        Ok(config.as_trained())
    }

    /// A run folder's config as that run trained: what it leaves out is what it used.
    /// (Sinusoidal runs from before the table's amplitude was recorded used 1; see
    /// `ModelConfig::sinusoidal_scale`.)
    pub fn as_trained(mut self) -> Config {
        let m = &mut self.model;
        if m.positions == PositionKind::Sinusoidal && m.sinusoidal_scale.is_none() {
            m.sinusoidal_scale = Some(1.0);
        }
        self
    }

    /// Parses TOML text and applies overrides; does not validate.
    pub fn from_toml_str(text: &str, overrides: &[String]) -> Result<Config> {
        // `[[model]]` makes a list of sections, which serde reads as something else
        // entirely ("unknown variant `n_layer`").
        if let Some((i, line)) = text
            .lines()
            .enumerate()
            .find(|(_, l)| l.trim_start().starts_with("[["))
        {
            anyhow::bail!(
                "line {} (`{}`): double brackets make a list of sections; a config's sections take one: [{}]",
                i + 1,
                line.trim(),
                line.trim().trim_matches(|c| c == '[' || c == ']')
            );
        }
        // Parse once as the schema so syntax errors, unknown keys and wrong types are
        // reported with the line they are on in the user's file.
        let _: Config =
            toml::from_str(text).map_err(|e| anyhow::anyhow!("{}", one_line(&e, text)))?;
        let mut table: toml::Table =
            toml::from_str(text).map_err(|e| anyhow::anyhow!("{}", one_line(&e, text)))?;
        for item in overrides {
            apply_override(&mut table, item)?;
            Config::deserialize(table.clone()).map_err(|e| {
                let mut told = format!("--set {item}: {}", plain_words(e.message()));
                // Several values for one key: a sweep's grid, not a setting.
                if let Some((key, values)) = item.split_once('=') {
                    if values.contains(',') && !values.trim_start().starts_with('[') {
                        told.push_str(&format!(
                            "; --set takes one value; to train at each of several, use `tinygpt sweep --grid {}={}`",
                            key.trim(),
                            values.trim()
                        ));
                    }
                }
                anyhow::anyhow!("{told}")
            })?;
        }
        apply_arch_preset(&mut table)?;
        let config = Config::deserialize(table)
            .map_err(|e| anyhow::anyhow!("{}", plain_words(e.message())))?;
        Ok(config)
    }

    pub fn to_toml_string(&self) -> String {
        toml::to_string_pretty(self).expect("a Config always serialises")
    }

    /// The folder this run writes its checkpoints to.
    pub fn run_dir(&self) -> PathBuf {
        self.run.out_dir.join(&self.run.name)
    }

    /// Checks the rules that tie fields together. Each error names the field and the fix.
    pub fn validate(&self) -> Result<()> {
        self.model.validate()?;
        let t = &self.train;
        let positive = [
            ("train.batch_size", t.batch_size),
            ("train.max_iters", t.max_iters),
            ("train.grad_accum", t.grad_accum),
            ("train.eval_interval", t.eval_interval),
            ("train.eval_iters", t.eval_iters),
            ("train.log_interval", t.log_interval),
            ("train.checkpoint_interval", t.checkpoint_interval),
        ];
        for (name, value) in positive {
            if value == 0 {
                user_bail!("config: {name} = 0; it must be at least 1");
            }
        }
        if self.run.name.contains(['/', '\\']) || self.run.name == ".." || self.run.name == "." {
            user_bail!(
                "config: run.name = {:?} must be a plain folder name (not . or .., no slashes); set run.out_dir for the parent folder",
                self.run.name
            );
        }
        // A newline in a folder's name breaks every line that shows its path.
        if self.run.name.chars().any(char::is_control) {
            user_bail!(
                "config: run.name = {:?} holds a control character (a newline, a tab); name the run with printable characters",
                self.run.name
            );
        }
        let tk = &self.tokenizer;
        if tk.kind == TokenizerKind::Bpe
            && tk.path.is_none()
            && !(257..=MAX_VOCAB).contains(&tk.vocab_size)
        {
            user_bail!(
                "config: tokenizer.vocab_size = {} is out of range; byte-level BPE needs 257..={MAX_VOCAB} (256 bytes + end-of-text)",
                tk.vocab_size
            );
        }
        if tk.train_bytes == 0 {
            user_bail!("config: tokenizer.train_bytes = 0; BPE needs some text to train on (default 32000000)");
        }
        if self.data.text_field.is_empty() {
            user_bail!("config: data.text_field is empty; name the jsonl field or parquet column holding the text (default \"text\")");
        }
        if !(self.data.val_fraction > 0.0 && self.data.val_fraction < 1.0) {
            user_bail!(
                "config: data.val_fraction = {} must be strictly between 0 and 1",
                Num(self.data.val_fraction)
            );
        }
        for (name, value) in [("train.lr", t.lr), ("train.min_lr", t.min_lr)] {
            if !(value.is_finite() && value >= 0.0) {
                user_bail!(
                    "config: {name} = {} must be a non-negative number",
                    Num(value)
                );
            }
        }
        if t.min_lr > t.lr {
            user_bail!(
                "config: train.min_lr = {} is above train.lr = {}; the schedule decays from lr down to min_lr",
                Num(t.min_lr),
                Num(t.lr)
            );
        }
        for (name, value) in [("train.beta1", t.beta1), ("train.beta2", t.beta2)] {
            if !(0.0..1.0).contains(&value) {
                user_bail!("config: {name} = {} must be in [0, 1)", Num(value));
            }
        }
        if !(t.eps.is_finite() && t.eps > 0.0) {
            user_bail!("config: train.eps = {} must be positive", Num(t.eps));
        }
        if !(t.weight_decay.is_finite() && t.weight_decay >= 0.0) {
            user_bail!(
                "config: train.weight_decay = {} must be a non-negative number",
                Num(t.weight_decay)
            );
        }
        if !(t.grad_clip.is_finite() && t.grad_clip >= 0.0) {
            user_bail!(
                "config: train.grad_clip = {} must be >= 0 (0 disables clipping)",
                Num(t.grad_clip)
            );
        }
        // An explicit decay shorter than the warmup is a contradiction; a short run
        // (max_iters below warmup_iters) just warms up the whole time.
        if let Some(decay) = t.lr_decay_iters.filter(|&d| d < t.warmup_iters) {
            user_bail!(
                "config: train.lr_decay_iters = {decay} is shorter than train.warmup_iters = {}",
                t.warmup_iters
            );
        }
        Ok(())
    }
}

/// Applies one `section.key=value` override to a TOML table. The value is parsed as a
/// TOML value (`6`, `1e-3`, `true`, `"text"`, `[1, 2]`); anything that is not valid
/// TOML is taken as a bare string, so `--set tokenizer.kind=char` works unquoted.
fn apply_override(table: &mut toml::Table, item: &str) -> Result<()> {
    let (key, raw) = item
        .split_once('=')
        .with_context(|| format!("--set {item}: expected section.key=value"))?;
    let key = key.trim();
    let raw = raw.trim();
    let path: Vec<&str> = key.split('.').collect();
    if path.len() != 2 || path.iter().any(|p| p.is_empty()) {
        anyhow::bail!("--set {item}: the key must be section.key, e.g. model.n_layer=6");
    }
    // A whole number past TOML's (i64) would otherwise be read as text, and refused as
    // the wrong type; a text setting (run.name) takes it as the text it is.
    let digits = raw.strip_prefix(['-', '+']).unwrap_or(raw);
    let number = !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit());
    if number && raw.parse::<i64>().is_err() && !is_text_setting(path[0], path[1]) {
        anyhow::bail!(
            "--set {item}: {raw} is too large a number (at most {})",
            i64::MAX
        );
    }
    let value = parse_value(raw);
    let section = table
        .entry(path[0].to_string())
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    let toml::Value::Table(section) = section else {
        anyhow::bail!("--set {item}: {} is not a section", path[0]);
    };
    section.insert(path[1].to_string(), value);
    Ok(())
}

/// Whether `section.key` holds text (a name, a path) by default.
fn is_text_setting(section: &str, key: &str) -> bool {
    toml::Table::try_from(Config::default())
        .ok()
        .and_then(|table| table.get(section)?.get(key).cloned())
        .is_some_and(|value| value.is_str())
}

/// Fills in the options `model.arch` fixes, where the file does not set them.
/// (Set ones are checked against the preset by `validate`.)
fn apply_arch_preset(table: &mut toml::Table) -> Result<()> {
    let Some(toml::Value::Table(model)) = table.get_mut("model") else {
        return Ok(());
    };
    let Some(arch) = model.get("arch").cloned() else {
        return Ok(());
    };
    let arch =
        Arch::deserialize(arch).map_err(|e| anyhow::anyhow!("model.arch: {}", e.message()))?;
    for (key, value) in arch.preset() {
        if !model.contains_key(*key) {
            model.insert(key.to_string(), parse_value(value));
        }
    }
    Ok(())
}

/// toml's errors are several lines with a source excerpt; users get one:
/// "line L, column C: message".
fn one_line(e: &toml::de::Error, text: &str) -> String {
    let message = plain_words(e.message().trim()).replace('\n', "; ");
    match e.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let line_start = before.rfind('\n').map_or(0, |i| i + 1);
            let column = before.len() - line_start + 1;
            let source = text[line_start..].lines().next().unwrap_or("").trim();
            format!("line {line}, column {column} (`{source}`): {message}")
        }
        None => message,
    }
}

/// The `section.key` of a config key named `key` (as in `--max-iters`: `max_iters`),
/// if exactly one section has it.
pub fn key_named(key: &str) -> Option<String> {
    let key = key.trim_start_matches('-').replace('-', "_");
    let table = toml::Table::try_from(Config::default()).ok()?;
    let mut found = table.iter().filter_map(|(section, keys)| {
        let keys = keys.as_table()?;
        keys.contains_key(&key).then(|| format!("{section}.{key}"))
    });
    match (found.next(), found.next()) {
        (Some(one), None) => Some(one),
        _ => None,
    }
}

/// A setting's number as a message shows it: as written where that is short, with an
/// exponent where it is tiny or huge (`1e-320`, not 320 digits).
struct Num(f64);

impl std::fmt::Display for Num {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let magnitude = self.0.abs();
        if magnitude == 0.0 || !magnitude.is_finite() || (1e-4..1e16).contains(&magnitude) {
            write!(f, "{}", self.0)
        } else {
            write!(f, "{:e}", self.0)
        }
    }
}

/// serde's type names in users' words: "expected usize" -> "expected a whole number".
fn plain_words(message: &str) -> String {
    // Whole numbers past TOML's own (i64): read as i128 or refused as u64.
    if message.contains("` as i128") || message.contains("u64 value was too large") {
        return format!("too large: TOML's whole numbers stop at {}", i64::MAX);
    }
    // A list or number where one of a setting's names goes.
    if message.contains("unit variant, expected string only")
        || message.contains("wanted string or table")
    {
        return "expected one of its names, in quotes (see docs/REFERENCE.md)".into();
    }
    const WORDS: [(&str, &str); 8] = [
        ("expected usize", "expected a whole number (0 or more)"),
        ("expected u64", "expected a whole number (0 or more)"),
        ("expected u32", "expected a whole number (0 or more)"),
        ("expected f64", "expected a number"),
        ("expected f32", "expected a number"),
        ("expected a boolean", "expected true or false"),
        ("floating point `", "the decimal number `"),
        ("integer `", "the whole number `"),
    ];
    let message = WORDS.iter().fold(message.to_string(), |m, (serde, plain)| {
        m.replace(serde, plain)
    });
    let mut message = with_suggestion(&message);
    // `--set 'train.lr="3e-4"'`: a number in quotes is text to TOML.
    if message.contains("invalid type: string") && message.contains("number") {
        message.push_str(" (a number goes without quotes)");
    }
    // A value where a section goes (`run = 5`): serde names our struct.
    match message.find("expected struct ") {
        Some(at) => format!(
            "{}expected a section of settings ([section] and key = value lines below it)",
            &message[..at]
        ),
        None => message,
    }
}

/// "unknown field `n_layers`, expected one of `arch`, `n_layer`, ..." with "did you
/// mean `n_layer`?" after the name, where one of the names is that close (a letter or
/// two apart).
fn with_suggestion(message: &str) -> String {
    let Some(rest) = message
        .strip_prefix("unknown field `")
        .or_else(|| message.strip_prefix("unknown variant `"))
    else {
        return message.to_string();
    };
    let Some((given, expected)) = rest.split_once("`, expected one of ") else {
        return message.to_string();
    };
    let closest = expected
        .split(", ")
        .map(|name| name.trim_matches('`'))
        .map(|name| (strsim::damerau_levenshtein(given, name), name))
        .filter(|&(distance, name)| distance <= 2 && distance < name.len())
        .min();
    match closest {
        Some((_, name)) => {
            let at = message.len() - rest.len() + given.len() + 1;
            format!(
                "{} (did you mean `{name}`?){}",
                &message[..at],
                &message[at..]
            )
        }
        None => message.to_string(),
    }
}

fn parse_value(raw: &str) -> toml::Value {
    let doc = format!("v = {raw}");
    match toml::from_str::<toml::Table>(&doc) {
        Ok(mut t) => t.remove("v").expect("the key we just wrote"),
        Err(_) => toml::Value::String(raw.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str, overrides: &[&str]) -> String {
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        match Config::from_toml_str(text, &o).and_then(|c| c.validate().map(|_| c)) {
            Ok(_) => panic!("expected an error for {text:?} {overrides:?}"),
            Err(e) => format!("{e:#}"),
        }
    }

    #[test]
    fn empty_file_gives_defaults() {
        let c = Config::from_toml_str("", &[]).unwrap();
        assert_eq!(c, Config::default());
        c.validate().unwrap();
    }

    #[test]
    fn overrides_are_typed() {
        let o = [
            "model.n_layer=6".to_string(),
            "train.lr=3e-4".to_string(),
            "tokenizer.kind=char".to_string(),
            "model.positions=\"rope\"".to_string(),
            "model.bias=true".to_string(),
        ];
        let c = Config::from_toml_str("[model]\nn_layer = 2\n", &o).unwrap();
        assert_eq!(c.model.n_layer, 6);
        assert_eq!(c.train.lr, 3e-4);
        assert_eq!(c.tokenizer.kind, TokenizerKind::Char);
        assert_eq!(c.model.positions, PositionKind::Rope);
        assert!(c.model.bias);
    }

    #[test]
    fn unknown_keys_are_named() {
        assert!(err("[model]\nn_layers = 2\n", &[]).contains("n_layers"));
        assert!(err("[modle]\n", &[]).contains("modle"));
        assert!(err("", &["train.lrr=1"]).contains("lrr"));
        assert!(err("", &["nosection=1"]).contains("section.key"));
    }

    /// Mistakes serde words in its own terms (structs, variants, i128) told in ours.
    #[test]
    fn shapes_serde_names_are_told_in_a_users_words() {
        let cases = [
            (
                "[[model]]\nn_layer = 2\n",
                "double brackets make a list of sections; a config's sections take one: [model]",
            ),
            ("run = 5\n", "expected a section of settings"),
            (
                "[train]\nmax_iters = 99999999999999999999\n",
                "too large: TOML's whole numbers stop at 9223372036854775807",
            ),
            ("[run]\nseed = 18446744073709551615\n", "too large"),
            (
                "[model]\npositions = 5\n",
                "expected one of its names, in quotes",
            ),
        ];
        for (text, says) in cases {
            let e = err(text, &[]);
            assert!(e.contains(says), "{text:?}: {e}");
            assert!(
                !e.contains("struct") && !e.contains("i128") && !e.contains("variant"),
                "{e}"
            );
        }
        let e = err("", &["model.positions=[1,2]"]);
        assert!(e.contains("expected one of its names"), "{e}");
        // A name a letter or two off is offered.
        let e = err("", &["model.n_layers=2"]);
        assert!(
            e.contains("unknown field `n_layers` (did you mean `n_layer`?), expected one of"),
            "{e}"
        );
        let e = err("[model]\npositions = \"rop\"\n", &[]);
        assert!(e.contains("(did you mean `rope`?)"), "{e}");
        let e = err("", &["model.zzzzzzzz=2"]);
        assert!(!e.contains("did you mean"), "{e}");
    }

    #[test]
    fn wrong_types_are_errors() {
        let e = err("[model]\nn_layer = \"four\"\n", &[]);
        assert!(e.contains("n_layer") || e.contains("line 2"), "{e}");
        assert!(err("", &["model.n_layer=four"]).contains("model.n_layer=four"));
        assert!(err("", &["model.n_layer=-1"]).contains("model.n_layer"));
    }

    #[test]
    fn syntax_errors_give_the_line() {
        let e = err("[model]\nn_layer = = 3\n", &[]);
        assert!(e.contains("line 2"), "{e}");
    }

    #[test]
    fn a_number_past_i64_is_too_large_for_a_number_and_text_for_a_name() {
        let huge = "123456789012345678901234";
        let e = err("", &[&format!("model.n_embd={huge}")]);
        assert!(e.contains("too large a number"), "{e}");
        let named = Config::from_toml_str("", &[format!("run.name={huge}")]).unwrap();
        assert_eq!(named.run.name, huge);
    }

    #[test]
    fn each_validation_rule_fires() {
        let cases: &[(&[&str], &str)] = &[
            (
                &["model.n_embd=100", "model.n_head=3"],
                "not divisible by model.n_head",
            ),
            (&["model.n_kv_head=3"], "n_kv_head"),
            (&["model.n_kv_head=0"], "n_kv_head"),
            (
                &["model.positions=rope", "model.n_embd=12", "model.n_head=4"],
                "even head size",
            ),
            (
                &[
                    "model.positions=sinusoidal",
                    "model.n_embd=7",
                    "model.n_head=1",
                ],
                "even model.n_embd",
            ),
            (&["model.block_size=1"], "block_size"),
            (&["model.n_layer=0"], "model.n_layer"),
            (&["model.dropout=1.0"], "model.dropout"),
            (&["model.vocab_size=99999999"], "vocab_size"),
            (&["model.n_layer=100000"], "model.n_layer"),
            (&["model.n_embd=4194304", "model.n_head=1"], "model.n_embd"),
            (&["model.rope_theta=0.5"], "rope_theta"),
            (
                &["model.sinusoidal_scale=0.1"],
                "model.sinusoidal_scale is for sinusoidal positions, but model.positions = \"learned\"; remove it",
            ),
            (
                &["model.positions=sinusoidal", "model.sinusoidal_scale=0"],
                "model.sinusoidal_scale = 0 must be a number above 0",
            ),
            (&["tokenizer.vocab_size=100"], "tokenizer.vocab_size"),
            (&["data.val_fraction=0"], "val_fraction"),
            (&["train.min_lr=1", "train.lr=0.1"], "min_lr"),
            // Tiny numbers shown as written, not as 320 digits.
            (
                &["train.lr=1e-320"],
                "train.min_lr = 0.0001 is above train.lr = 1e-320;",
            ),
            (&["train.weight_decay=-1e30"], "weight_decay = -1e30 must"),
            (&["train.beta2=1.0"], "beta2"),
            (&["train.eps=0"], "train.eps"),
            (&["train.grad_clip=-1"], "grad_clip"),
            (&["train.batch_size=0"], "batch_size"),
            (
                &["train.lr_decay_iters=5", "train.warmup_iters=10"],
                "lr_decay_iters",
            ),
            (&["run.name=a/b"], "run.name"),
            (&["train.lr=\"3e-4\""], "(a number goes without quotes)"),
            (&["run.name=\"a\\nb\""], "control character"),
        ];
        for (overrides, needle) in cases {
            let e = err("", overrides);
            assert!(e.contains(needle), "{overrides:?}: {e}");
        }
    }

    #[test]
    fn resolved_config_round_trips() {
        let mut c = Config::default();
        c.model.n_kv_head = Some(2);
        c.model.vocab_size = 65;
        let back = Config::from_toml_str(&c.to_toml_string(), &[]).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn shipped_configs_are_valid() {
        // The checkout this was built from, else the working directory (a test binary
        // carried to a GPU machine runs from the copy of the repository there).
        let root = Some(Path::new(env!("CARGO_MANIFEST_DIR")))
            .filter(|d| d.is_dir())
            .unwrap_or(Path::new("."));
        let dir = root.join("configs");
        let mut n = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                Config::load(&path, &[]).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
                n += 1;
            }
        }
        assert!(n >= 3, "expected at least three shipped configs");
    }
}
