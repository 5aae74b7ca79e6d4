//! One transformer block, pre-norm: x + attn(ln_1(x)), then x + mlp(ln_2(x)).
//!
//! Normalising before each sub-layer (GPT-2, not the original post-norm) keeps the
//! residual stream an untouched sum, which is what lets deep stacks train stably.

use anyhow::Result;
use candle_core::Tensor;

use super::attention::{CausalSelfAttention, KvCache};
use super::dropout::Dropout;
use super::mlp::Mlp;
use super::norm::Norm;
use super::params::Params;
use super::position::Rope;
use super::spec::{BlockParams, ModelSpec};
use crate::config::Precision;

pub struct Block {
    ln_1: Norm,
    attn: CausalSelfAttention,
    ln_2: Norm,
    mlp: Mlp,
}

impl Block {
    pub fn new(
        params: &Params,
        spec: &ModelSpec,
        block: &BlockParams,
        products: Precision,
    ) -> Self {
        let cfg = &spec.config;
        Self {
            ln_1: Norm::new(params, &block.ln_1, cfg),
            attn: CausalSelfAttention::new(params, block, &spec.shapes, products),
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
        cache: Option<(&mut KvCache, usize)>,
        dropout: &mut Dropout,
    ) -> Result<(Tensor, Tensor)> {
        let (attn, weights) =
            self.attn
                .forward(&self.ln_1.forward(x)?, pos0, rope, cache, dropout)?;
        let x = (x + dropout.apply(&attn)?)?;
        let x = (&x + dropout.apply(&self.mlp.forward(&self.ln_2.forward(&x)?)?)?)?;
        Ok((x, weights))
    }
}
