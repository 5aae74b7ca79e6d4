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
use super::params::ParamBuilder;
use super::position::Rope;
use crate::config::ModelConfig;

pub struct Block {
    ln_1: Norm,
    attn: CausalSelfAttention,
    ln_2: Norm,
    mlp: Mlp,
}

impl Block {
    pub fn new(pb: &mut ParamBuilder, prefix: &str, cfg: &ModelConfig) -> Result<Self> {
        Ok(Self {
            ln_1: Norm::new(pb, &format!("{prefix}.ln_1"), cfg)?,
            attn: CausalSelfAttention::new(pb, &format!("{prefix}.attn"), cfg)?,
            ln_2: Norm::new(pb, &format!("{prefix}.ln_2"), cfg)?,
            mlp: Mlp::new(pb, &format!("{prefix}.mlp"), cfg)?,
        })
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
