//! A linear layer `y = x W^T (+ b)`, with W stored as `[out, in]` like torch's nn.Linear.

use anyhow::Result;
use candle_core::Tensor;

use super::params::{Init, ParamBuilder};

pub struct Linear {
    weight: Tensor, // (out, in)
    bias: Option<Tensor>,
}

impl Linear {
    /// Weights N(0, std); biases (if any) zero.
    pub fn new(
        pb: &mut ParamBuilder,
        prefix: &str,
        d_in: usize,
        d_out: usize,
        bias: bool,
        std: f64,
    ) -> Result<Self> {
        let weight = pb.var(
            &format!("{prefix}.weight"),
            &[d_out, d_in],
            Init::Normal { std },
        )?;
        let bias = if bias {
            Some(pb.var(&format!("{prefix}.bias"), &[d_out], Init::Zeros)?)
        } else {
            None
        };
        Ok(Self { weight, bias })
    }

    /// x: (B, T, in) -> (B, T, out). Flattened to one 2-D matmul.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, d_in) = x.dims3()?;
        let d_out = self.weight.dim(0)?;
        let y = x.reshape((b * t, d_in))?.matmul(&self.weight.t()?)?;
        let y = match &self.bias {
            Some(bias) => y.broadcast_add(bias)?,
            None => y,
        };
        Ok(y.reshape((b, t, d_out))?)
    }
}
