//! One transformer block, pre-norm: x + attn(ln_1(x)), then x + mlp(ln_2(x)).
//!
//! Normalising before each sub-layer (GPT-2, not the original post-norm) keeps the
//! residual stream an untouched sum, which is what lets deep stacks train stably.

use anyhow::Result;
use candle_core::Tensor;

use super::attention::{CausalSelfAttention, KvCache};
use super::dropout::{maybe_apply, Dropout, Site};
use super::mlp::Mlp;
use super::norm::Norm;
use super::params::Params;
use super::position::Rope;
use super::spec::{BlockParams, ModelSpec};
use crate::config::Precision;

pub struct Block {
    /// Its place in the stack (0 = nearest the input).
    layer: usize,
    ln_1: Norm,
    attn: CausalSelfAttention,
    ln_2: Norm,
    mlp: Mlp,
}

impl Block {
    pub fn new(
        params: &Params,
        spec: &ModelSpec,
        layer: usize,
        block: &BlockParams,
        products: Precision,
    ) -> Self {
        let cfg = &spec.config;
        Self {
            layer,
            ln_1: Norm::new(params, &block.ln_1, cfg),
            attn: CausalSelfAttention::new(params, layer, block, &spec.shapes, products),
            ln_2: Norm::new(params, &block.ln_2, cfg),
            mlp: Mlp::new(params, block, cfg.mlp, products),
        }
    }

    /// x: (B, T, C) -> (B, T, C), and this layer's attention weights.
    pub fn forward(
        &self,
        x: &Tensor,
        pos0: usize,
        rope: Option<&Rope>,
        cache: Option<&mut KvCache>,
        dropout: Option<&Dropout>,
    ) -> Result<(Tensor, Tensor)> {
        let l = self.layer;
        let (attn, weights) =
            self.attn
                .forward(&self.ln_1.forward(x)?, pos0, rope, cache, dropout)?;
        let x = (x + maybe_apply(dropout, &attn, Site::AttentionOutput(l))?)?;
        let mlp = self.mlp.forward(&self.ln_2.forward(&x)?)?;
        let x = (&x + maybe_apply(dropout, &mlp, Site::MlpOutput(l))?)?;
        Ok((x, weights))
    }
}
