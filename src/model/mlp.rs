//! The position-wise feed-forward network: expand 4x, GELU, project back.

use anyhow::Result;
use candle_core::Tensor;

use super::linear::Linear;
use super::params::ParamBuilder;
use crate::config::ModelConfig;

pub struct Mlp {
    c_fc: Linear,   // C -> 4C
    c_proj: Linear, // 4C -> C
}

impl Mlp {
    pub fn new(pb: &mut ParamBuilder, prefix: &str, cfg: &ModelConfig) -> Result<Self> {
        let hidden = 4 * cfg.n_embd;
        let proj_std = 0.02 / (2.0 * cfg.n_layer as f64).sqrt();
        Ok(Self {
            c_fc: Linear::new(
                pb,
                &format!("{prefix}.c_fc"),
                cfg.n_embd,
                hidden,
                cfg.bias,
                0.02,
            )?,
            c_proj: Linear::new(
                pb,
                &format!("{prefix}.c_proj"),
                hidden,
                cfg.n_embd,
                cfg.bias,
                proj_std,
            )?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // Exact (erf) GELU, as torch.nn.GELU() by default.
        self.c_proj.forward(&self.c_fc.forward(x)?.gelu_erf()?)
    }
}
