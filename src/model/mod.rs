//! The GPT: token embedding -> positions -> N blocks -> final norm -> logits through the
//! token embedding matrix (weight tying).
//!
//! Read in this order: `spec` (the shapes and the parameter table every engine reads),
//! `params` (the table as candle variables), `linear`, `norm`, `position`, `pass` (what
//! each layer is built from and runs in), `dropout` (the masks), `attention` with `kv_cache`,
//! `mlp`, `block`, then `Gpt` below: the reference engine's model, plain candle ops
//! differentiated by candle's autograd. Shapes: B batch, T tokens, C width, V
//! vocabulary, H heads, d = C / H head size; S the positions attended (cached plus
//! new; S = T in training), H_kv the key/value heads (H_kv = H without grouping).

pub mod attention;
pub mod block;
pub mod dropout;
pub mod kv_cache;
pub mod linear;
pub mod mlp;
pub mod named;
pub mod norm;
pub mod params;
pub mod pass;
pub mod position;
pub mod spec;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};

use block::Block;
pub use dropout::{Dropout, Site};
pub use kv_cache::TensorKvCache;
use linear::product;
use norm::Norm;
pub use params::Params;
use pass::{Parts, Pass};
use position::{InputPositions, Rope};
pub use spec::ModelSpec;

use crate::config::{ModelConfig, PositionKind, Precision};
use crate::user_bail;

pub struct Gpt {
    spec: ModelSpec,
    wte: Tensor, // (V, C): token embedding, and (transposed) the output layer
    positions: InputPositions,
    blocks: Vec<Block>,
    ln_f: Norm,
    params: Params,
    /// Precision of every matrix product (train.dtype).
    products: Precision,
}

/// What one forward pass returns.
pub struct Output {
    /// (B, T, V) next-token scores.
    pub logits: Tensor,
    /// Per layer, the attention weights (B, H, T, S), before dropout.
    pub attention: Vec<Tensor>,
}

impl Gpt {
    /// A freshly initialised model, from `ModelSpec::initial_values(seed)` (GPT-2's
    /// scheme; see `ModelSpec::new`). Same seed, same weights, on any device.
    pub fn new(cfg: &ModelConfig, seed: u64, device: &Device) -> Result<Self> {
        Self::with_dtype(cfg, seed, device, DType::F32)
    }

    /// As [`Gpt::new`] with parameters of type `dtype` (f64 for gradient checks).
    pub fn with_dtype(cfg: &ModelConfig, seed: u64, device: &Device, dtype: DType) -> Result<Self> {
        let spec = ModelSpec::new(cfg);
        Self::from_flat(
            &spec,
            &spec.initial_values(seed),
            device,
            dtype,
            Precision::F32,
        )
    }

    /// The model `spec` with `values` (flat, table order) as its weights, of type
    /// `dtype` on `device`, every matrix product in `products` precision.
    pub fn from_flat(
        spec: &ModelSpec,
        values: &[f32],
        device: &Device,
        dtype: DType,
        products: Precision,
    ) -> Result<Self> {
        let cfg = &spec.config;
        if cfg.vocab_size == 0 {
            anyhow::bail!(
                "model.vocab_size must be set (from the tokenizer) before building the model"
            );
        }
        if device.is_metal() && (dtype == DType::BF16 || products == Precision::Bf16) {
            crate::device::require_metal_bf16(device)?;
        }
        let spec = spec.clone();
        let params = Params::from_flat(&spec, values, device, dtype)?;
        let rope = match cfg.positions {
            PositionKind::Rope => Some(Rope::new(cfg, device, dtype)?),
            _ => None,
        };
        Ok(Self {
            wte: params.tensor(spec.wte).clone(),
            positions: InputPositions::new(&params, &spec, device, dtype)?,
            blocks: (0..cfg.n_layer)
                .map(|layer| {
                    let parts = Parts {
                        params: &params,
                        spec: &spec,
                        rope: rope.as_ref(),
                        products,
                    };
                    Block::new(parts, layer)
                })
                .collect(),
            ln_f: Norm::new(&params, &spec.ln_f, cfg),
            params,
            products,
            spec,
        })
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The precision of its matrix products (decoders built from it use the same).
    pub fn products(&self) -> Precision {
        self.products
    }

    pub fn config(&self) -> &ModelConfig {
        &self.spec.config
    }

    pub fn params(&self) -> &Params {
        &self.params
    }

    pub fn device(&self) -> &Device {
        self.wte.device()
    }

    /// Logits for tokens `idx` (B, T) at positions pos0 .. pos0 + T.
    ///
    /// With a cache, pos0 must equal the number of cached positions: the new keys and
    /// values are appended and attention sees all of them.
    pub fn forward(
        &self,
        idx: &Tensor,
        pos0: usize,
        mut cache: Option<&mut TensorKvCache>,
        dropout: Option<&Dropout>,
    ) -> Result<Output> {
        let (b, t) = idx.dims2()?;
        if pos0 + t > self.spec.config.block_size {
            user_bail!(
                "{} positions requested but the model was trained on at most block_size = {}",
                pos0 + t,
                self.spec.config.block_size
            );
        }
        if let Some(cache) = cache.as_deref() {
            if cache.len() != pos0 {
                anyhow::bail!("KV cache holds {} positions but pos0 = {pos0}", cache.len());
            }
        }
        let c = self.spec.config.n_embd;
        let tok = self
            .wte
            .embedding(&idx.flatten_all()?)?
            .reshape((b, t, c))?;
        let embedded = self.positions.add_to(&tok, pos0)?;
        let mut x = dropout::maybe_apply(dropout, &embedded, Site::Embedding)?;
        let mut attention = Vec::with_capacity(self.blocks.len());
        let pass = Pass { pos0, dropout };
        for block in &self.blocks {
            let (y, weights) = block.forward(&x, pass, cache.as_deref_mut())?;
            x = y;
            attention.push(weights);
        }
        let x = self.ln_f.forward(&x)?.reshape((b * t, c))?;
        let logits = product(&x, &self.wte.t()?, self.products)?.reshape((
            b,
            t,
            self.spec.config.vocab_size,
        ))?;
        Ok(Output { logits, attention })
    }

    /// Mean cross-entropy of predicting `targets` (B, T) from `idx` (B, T).
    pub fn loss(
        &self,
        idx: &Tensor,
        targets: &Tensor,
        dropout: Option<&Dropout>,
    ) -> Result<Tensor> {
        let logits = self.forward(idx, 0, None, dropout)?.logits;
        cross_entropy(&logits, targets)
    }
}

/// Mean over all positions of -log softmax(logits)[target]. logits: (B, T, V).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    Ok(position_losses(logits, targets)?.mean_all()?)
}

/// Each position's -log softmax(logits)[target], (B * T). logits: (B, T, V).
pub fn position_losses(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    let logits = logits.reshape((b * t, v))?;
    // Half-precision logits are widened: the log-sum-exp needs the range.
    let logits = match logits.dtype() {
        DType::F16 | DType::BF16 => logits.to_dtype(DType::F32)?,
        _ => logits,
    };
    let log_probs = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
    let targets = targets.flatten_all()?.unsqueeze(1)?;
    Ok(log_probs.gather(&targets, 1)?.squeeze(1)?.neg()?)
}
