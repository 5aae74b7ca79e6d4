//! LayerNorm over the last dimension: `(x - mean) / sqrt(var + eps) * weight (+ bias)`.
//!
//! Written with plain tensor ops so candle's autograd differentiates it. (candle_nn's
//! fused `layer_norm` has no backward, and `candle_nn::LayerNorm` with a bias silently
//! routes to it: gradients would never reach the norm or anything below it.)

use anyhow::Result;
use candle_core::{DType, Tensor, D};

use super::params::{Init, ParamBuilder};

pub const LAYER_NORM_EPS: f64 = 1e-5;

pub struct LayerNorm {
    weight: Tensor, // (C,)
    bias: Option<Tensor>,
}

impl LayerNorm {
    pub fn new(pb: &mut ParamBuilder, prefix: &str, dim: usize, bias: bool) -> Result<Self> {
        let weight = pb.var(&format!("{prefix}.weight"), &[dim], Init::Ones)?;
        let bias = if bias {
            Some(pb.var(&format!("{prefix}.bias"), &[dim], Init::Zeros)?)
        } else {
            None
        };
        Ok(Self { weight, bias })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        // Statistics in f32 even when activations are half precision.
        let x = match dtype {
            DType::F16 | DType::BF16 => x.to_dtype(DType::F32)?,
            _ => x.clone(),
        };
        let mean = x.mean_keepdim(D::Minus1)?;
        let centered = x.broadcast_sub(&mean)?;
        let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = centered.broadcast_div(&(var + LAYER_NORM_EPS)?.sqrt()?)?;
        let y = normed.to_dtype(dtype)?.broadcast_mul(&self.weight)?;
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}
