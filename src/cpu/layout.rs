//! Typed views of the flat buffers: a layer's weights read out of the parameter
//! buffer, its gradients cut out of the gradient buffer, both by the spec's offsets
//! (llm.c's `ParameterTensors` pointers, as borrow-checked slices).

use super::ops::embedding::{EmbeddingGrads, EmbeddingWeights};
use super::ops::linear::{LinearGrads, LinearWeights};
use super::ops::norm::{NormGrads, NormWeights};
use crate::model::spec::{LinearParams, ModelSpec, NormParams, ParamId};

/// One block's weights, in the order the data flows.
pub struct BlockWeights<'a> {
    pub ln_1: NormWeights<'a>,
    pub attn_qkv: LinearWeights<'a>,
    pub attn_proj: LinearWeights<'a>,
    pub ln_2: NormWeights<'a>,
    pub mlp_fc: LinearWeights<'a>,
    pub mlp_proj: LinearWeights<'a>,
}

/// One block's gradients.
pub struct BlockGrads<'a> {
    pub ln_1: NormGrads<'a>,
    pub attn_qkv: LinearGrads<'a>,
    pub attn_proj: LinearGrads<'a>,
    pub ln_2: NormGrads<'a>,
    pub mlp_fc: LinearGrads<'a>,
    pub mlp_proj: LinearGrads<'a>,
}

/// The parameters of `spec` in a flat buffer, read by layer.
#[derive(Clone, Copy)]
pub struct Weights<'a> {
    spec: &'a ModelSpec,
    flat: &'a [f32],
}

impl<'a> Weights<'a> {
    pub fn new(spec: &'a ModelSpec, flat: &'a [f32]) -> Self {
        assert_eq!(flat.len(), spec.len(), "a flat buffer of the whole table");
        Self { spec, flat }
    }

    pub fn param(&self, id: ParamId) -> &'a [f32] {
        &self.flat[self.spec[id].range()]
    }

    pub fn linear(&self, p: &LinearParams) -> LinearWeights<'a> {
        LinearWeights {
            w: self.param(p.weight),
            b: p.bias.map(|b| self.param(b)),
            d_in: p.d_in,
            d_out: p.d_out,
        }
    }

    pub fn norm(&self, p: &NormParams) -> NormWeights<'a> {
        let cfg = &self.spec.config;
        NormWeights {
            kind: cfg.norm,
            eps: cfg.norm_eps as f32,
            w: self.param(p.weight),
            b: p.bias.map(|b| self.param(b)),
        }
    }

    pub fn block(&self, layer: usize) -> BlockWeights<'a> {
        let b = &self.spec.blocks[layer];
        BlockWeights {
            ln_1: self.norm(&b.ln_1),
            attn_qkv: self.linear(&b.attn_qkv),
            attn_proj: self.linear(&b.attn_proj),
            ln_2: self.norm(&b.ln_2),
            mlp_fc: self.linear(&b.mlp_fc),
            mlp_proj: self.linear(&b.mlp_proj),
        }
    }

    /// The input embedding's tables: tokens, and the learned position table or else
    /// `fixed` (sinusoidal positions; `None` for RoPE).
    pub fn embedding(&self, fixed: Option<&'a [f32]>) -> EmbeddingWeights<'a> {
        EmbeddingWeights {
            wte: self.param(self.spec.wte),
            positions: self.spec.wpe.map(|id| self.param(id)).or(fixed),
        }
    }

    /// The tied output layer: the token embedding read as a (V, C) linear layer.
    pub fn output(&self) -> LinearWeights<'a> {
        let s = &self.spec.shapes;
        LinearWeights {
            w: self.param(self.spec.wte),
            b: None,
            d_in: s.n_embd,
            d_out: s.vocab_size,
        }
    }
}

/// The gradient buffer of `spec`, cut into the pieces of one layer at a time. Pieces
/// are taken front to back (the table's order), each split off what is left, so the
/// borrows are disjoint.
pub struct Grads<'a> {
    spec: &'a ModelSpec,
    rest: &'a mut [f32],
    /// Where `rest` starts in the whole buffer.
    offset: usize,
}

impl<'a> Grads<'a> {
    pub fn new(spec: &'a ModelSpec, flat: &'a mut [f32]) -> Self {
        assert_eq!(flat.len(), spec.len(), "a flat buffer of the whole table");
        Self {
            spec,
            rest: flat,
            offset: 0,
        }
    }

    /// The gradient of `id`, which must come after everything taken so far.
    pub fn take(&mut self, id: ParamId) -> &'a mut [f32] {
        let range = self.spec[id].range();
        assert!(
            range.start >= self.offset,
            "gradients are taken in table order"
        );
        let rest = std::mem::take(&mut self.rest);
        let (piece, rest) = rest[range.start - self.offset..].split_at_mut(range.len());
        self.rest = rest;
        self.offset = range.end;
        piece
    }

    pub fn linear(&mut self, p: &LinearParams) -> LinearGrads<'a> {
        LinearGrads {
            w: self.take(p.weight),
            b: p.bias.map(|b| self.take(b)),
        }
    }

    pub fn norm(&mut self, p: &NormParams) -> NormGrads<'a> {
        NormGrads {
            w: self.take(p.weight),
            b: p.bias.map(|b| self.take(b)),
        }
    }

    /// Block `layer`'s gradients.
    pub fn block(mut self, layer: usize) -> BlockGrads<'a> {
        let b = &self.spec.blocks[layer];
        BlockGrads {
            ln_1: self.norm(&b.ln_1),
            attn_qkv: self.linear(&b.attn_qkv),
            attn_proj: self.linear(&b.attn_proj),
            ln_2: self.norm(&b.ln_2),
            mlp_fc: self.linear(&b.mlp_fc),
            mlp_proj: self.linear(&b.mlp_proj),
        }
    }

    /// The gradients of the token embedding and learned positions.
    pub fn embedding(mut self) -> EmbeddingGrads<'a> {
        EmbeddingGrads {
            wte: self.take(self.spec.wte),
            wpe: self.spec.wpe.map(|id| self.take(id)),
        }
    }

    /// The output layer's gradient: the token embedding's (tied).
    pub fn output(mut self) -> LinearGrads<'a> {
        LinearGrads {
            w: self.take(self.spec.wte),
            b: None,
        }
    }
}
