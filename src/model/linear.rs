//! A linear layer `y = x W^T (+ b)`, with W stored as `[out, in]` like torch's nn.Linear.

use anyhow::Result;
use candle_core::{DType, Tensor};

use super::params::Params;
use super::spec::LinearParams;
use crate::config::Precision;

pub struct Linear {
    weight: Tensor, // (out, in)
    bias: Option<Tensor>,
    products: Precision,
}

impl Linear {
    /// The layer `p` of `params`, multiplying in `products` precision.
    pub fn new(params: &Params, p: &LinearParams, products: Precision) -> Self {
        Self {
            weight: params.tensor(p.weight).clone(),
            bias: p.bias.map(|b| params.tensor(b).clone()),
            products,
        }
    }

    /// x: (B, T, in) -> (B, T, out). Flattened to one 2-D matmul.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, d_in) = x.dims3()?;
        let d_out = self.weight.dim(0)?;
        let y = product(&x.reshape((b * t, d_in))?, &self.weight.t()?, self.products)?;
        let y = match &self.bias {
            Some(bias) => y.broadcast_add(bias)?,
            None => y,
        };
        Ok(y.reshape((b, t, d_out))?)
    }
}

/// a · b with operands in `precision`. bf16: both operands rounded to bf16 and
/// multiplied as bf16 (tensor cores on GPUs; candle's CPU kernel sums in f32 and rounds
/// the result), the result widened back to a's type; autograd carries the gradient
/// through the casts, so the backward products run in bf16 as well. This is PyTorch
/// autocast's recipe; the fused CPU path keeps f32 results instead.
pub fn product(a: &Tensor, b: &Tensor, precision: Precision) -> Result<Tensor> {
    Ok(match precision {
        Precision::F32 => a.matmul(b)?,
        Precision::Bf16 => a
            .to_dtype(DType::BF16)?
            .matmul(&b.to_dtype(DType::BF16)?)?
            .to_dtype(a.dtype())?,
    })
}
