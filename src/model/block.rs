//! One transformer block, pre-norm: x + attn(ln_1(x)), then x + mlp(ln_2(x)).
//!
//! Normalising before each sub-layer (GPT-2, not the original post-norm) keeps the
//! residual stream an untouched sum, which is what lets deep stacks train stably.

use anyhow::Result;
use candle_core::Tensor;

use super::attention::CausalSelfAttention;
use super::dropout::{maybe_apply, Site};
use super::kv_cache::TensorKvCache;
use super::mlp::Mlp;
use super::norm::Norm;
use super::pass::{Parts, Pass};

pub struct Block {
    /// Its place in the stack (0 = nearest the input).
    layer: usize,
    ln_1: Norm,
    attn: CausalSelfAttention,
    ln_2: Norm,
    mlp: Mlp,
}

impl Block {
    /// Block `layer` (0 = nearest the input).
    pub fn new(parts: Parts, layer: usize) -> Self {
        let (cfg, block, params) = (&parts.spec.config, &parts.spec.blocks[layer], parts.params);
        Self {
            layer,
            ln_1: Norm::new(params, &block.ln_1, cfg),
            attn: CausalSelfAttention::new(parts, layer),
            ln_2: Norm::new(params, &block.ln_2, cfg),
            mlp: Mlp::new(params, block, cfg.mlp, parts.products),
        }
    }

    /// x: (B, T, C) -> (B, T, C), and this layer's attention weights.
    pub fn forward(
        &self,
        x: &Tensor,
        pass: Pass,
        cache: Option<&mut TensorKvCache>,
    ) -> Result<(Tensor, Tensor)> {
        let (l, dropout) = (self.layer, pass.dropout);
        let (attn, weights) = self.attn.forward(&self.ln_1.forward(x)?, pass, cache)?;
        let x = (x + maybe_apply(dropout, &attn, Site::AttentionOutput(l))?)?;
        let mlp = self.mlp.forward(&self.ln_2.forward(&x)?)?;
        let x = (&x + maybe_apply(dropout, &mlp, Site::MlpOutput(l))?)?;
        Ok((x, weights))
    }
}
