//! Normalisation over the last dimension, LayerNorm or RMSNorm.
//!
//! LayerNorm: (x - mean) / sqrt(var + eps) * weight (+ bias). RMSNorm (Llama): x /
//! sqrt(mean(x^2) + eps) * weight, no centring and no bias: cheaper, and it works as
//! well in practice.
//!
//! Both are written with plain tensor ops so candle's autograd differentiates them.
//! (candle_nn's fused `layer_norm`/`rms_norm` have no backward, and
//! `candle_nn::LayerNorm` with a bias silently routes to it: gradients would never reach
//! the norm or anything below it.)

use anyhow::Result;
use candle_core::{DType, Tensor, D};

use super::params::Params;
use super::spec::NormParams;
use crate::config::{ModelConfig, NormKind};

pub struct Norm {
    kind: NormKind,
    eps: f64,
    weight: Tensor, // (C,)
    bias: Option<Tensor>,
}

impl Norm {
    /// The norm `p` of `params`, of the kind and epsilon `cfg` says.
    pub fn new(params: &Params, p: &NormParams, cfg: &ModelConfig) -> Self {
        Self {
            kind: cfg.norm,
            eps: cfg.norm_eps,
            weight: params.tensor(p.weight).clone(),
            bias: p.bias.map(|b| params.tensor(b).clone()),
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        // Statistics in f32 even when activations are half precision.
        let x = match dtype {
            DType::F16 | DType::BF16 => x.to_dtype(DType::F32)?,
            _ => x.clone(),
        };
        let normed = match self.kind {
            NormKind::LayerNorm => {
                let mean = x.mean_keepdim(D::Minus1)?;
                let centered = x.broadcast_sub(&mean)?;
                let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
                centered.broadcast_div(&(var + self.eps)?.sqrt()?)?
            }
            NormKind::RmsNorm => {
                let mean_square = x.sqr()?.mean_keepdim(D::Minus1)?;
                x.broadcast_div(&(mean_square + self.eps)?.sqrt()?)?
            }
        };
        let y = normed.to_dtype(dtype)?.broadcast_mul(&self.weight)?;
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}
