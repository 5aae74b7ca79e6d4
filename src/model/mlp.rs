//! The position-wise feed-forward network: expand, non-linearity, project back.
//!
//! GELU MLPs (GPT-2) are `c_proj(gelu(c_fc(x)))`. SwiGLU (Llama) gates instead:
//! `c_proj(silu(gate(x)) * up(x))`, with gate and up stored as one `c_fc` matrix
//! (rows: gate, then up) so both variants have the same tensor names.

use anyhow::Result;
use candle_core::{Tensor, D};

use super::linear::Linear;
use super::params::Params;
use super::spec::BlockParams;
use crate::config::{MlpKind, Precision};

pub struct Mlp {
    kind: MlpKind,
    c_fc: Linear,   // C -> hidden (or 2 hidden: gate | up)
    c_proj: Linear, // hidden -> C
}

impl Mlp {
    pub fn new(params: &Params, block: &BlockParams, kind: MlpKind, products: Precision) -> Self {
        Self {
            kind,
            c_fc: Linear::new(params, &block.mlp_fc, products),
            c_proj: Linear::new(params, &block.mlp_proj, products),
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.c_fc.forward(x)?;
        let h = match self.kind {
            // Exact (erf) GELU, as torch.nn.GELU() by default.
            MlpKind::Gelu => h.gelu_erf()?,
            // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), GPT-2's "gelu_new".
            MlpKind::GeluTanh => h.gelu()?,
            MlpKind::Swiglu => {
                let hidden = h.dim(D::Minus1)? / 2;
                let gate = h.narrow(D::Minus1, 0, hidden)?;
                let up = h.narrow(D::Minus1, hidden, hidden)?;
                (gate.silu()? * up)?
            }
        };
        self.c_proj.forward(&h)
    }
}
