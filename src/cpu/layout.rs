//! Typed views of the flat buffers: a layer's weights read out of the parameter
//! buffer, its gradients cut out of the gradient buffer, both by the spec's offsets
//! (llm.c's `ParameterTensors` pointers, as borrow-checked slices).

use super::ops::embedding::{EmbeddingGrads, EmbeddingWeights};
use super::ops::linear::{LinearGrads, LinearWeights};
use super::ops::norm::{NormGrads, NormWeights};
use crate::model::spec::{LinearParams, ModelSpec, NormParams, ParamId};

/// One block's views, in the order the data flows (and the table is laid out): its
/// norms' as N, its projections' as L.
pub struct Block<N, L> {
    pub ln_1: N,
    pub attn_qkv: L,
    pub attn_proj: L,
    pub ln_2: N,
    pub mlp_fc: L,
    pub mlp_proj: L,
}

/// One block's weights.
pub type BlockWeights<'a> = Block<NormWeights<'a>, LinearWeights<'a>>;

/// One block's gradients.
pub type BlockGrads<'a> = Block<NormGrads<'a>, LinearGrads<'a>>;

/// What hands out a layer's view by its spec handle: weights or gradients.
pub trait Views {
    type Norm;
    type Linear;
    fn norm(&mut self, p: &NormParams) -> Self::Norm;
    fn linear(&mut self, p: &LinearParams) -> Self::Linear;
}

impl<N, L> Block<N, L> {
    /// Block `layer` of `spec`, each view taken in table order.
    fn of<V: Views<Norm = N, Linear = L>>(views: &mut V, spec: &ModelSpec, layer: usize) -> Self {
        let b = &spec.blocks[layer];
        Self {
            ln_1: views.norm(&b.ln_1),
            attn_qkv: views.linear(&b.attn_qkv),
            attn_proj: views.linear(&b.attn_proj),
            ln_2: views.norm(&b.ln_2),
            mlp_fc: views.linear(&b.mlp_fc),
            mlp_proj: views.linear(&b.mlp_proj),
        }
    }
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
            role: p.role,
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
        // A copy of the two references: reading needs no `&mut`, but `Views` hands it
        // out for the gradients' sake.
        let mut views = *self;
        Block::of(&mut views, self.spec, layer)
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
        self.linear(&self.spec.output_layer())
    }
}

impl<'a> Views for Weights<'a> {
    type Norm = NormWeights<'a>;
    type Linear = LinearWeights<'a>;

    fn norm(&mut self, p: &NormParams) -> NormWeights<'a> {
        Weights::norm(self, p)
    }

    fn linear(&mut self, p: &LinearParams) -> LinearWeights<'a> {
        Weights::linear(self, p)
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

    /// Block `layer`'s gradients.
    pub fn block(mut self, layer: usize) -> BlockGrads<'a> {
        let spec = self.spec;
        Block::of(&mut self, spec, layer)
    }

    /// A weight's gradient and its bias's, which follows it in the table.
    fn weight_and_bias(
        &mut self,
        w: ParamId,
        b: Option<ParamId>,
    ) -> (&'a mut [f32], Option<&'a mut [f32]>) {
        (self.take(w), b.map(|b| self.take(b)))
    }

    /// The gradients of the token embedding and learned positions.
    pub fn embedding(mut self) -> EmbeddingGrads<'a> {
        EmbeddingGrads {
            wte: self.take(self.spec.wte),
            wpe: self.spec.wpe.map(|id| self.take(id)),
        }
    }

    /// The final norm's gradients.
    pub fn ln_f(mut self) -> NormGrads<'a> {
        let ln_f = self.spec.ln_f;
        Views::norm(&mut self, &ln_f)
    }

    /// The output layer's gradient: the token embedding's (tied).
    pub fn output(mut self) -> LinearGrads<'a> {
        LinearGrads {
            w: self.take(self.spec.wte),
            b: None,
        }
    }
}

impl<'a> Views for Grads<'a> {
    type Norm = NormGrads<'a>;
    type Linear = LinearGrads<'a>;

    fn norm(&mut self, p: &NormParams) -> NormGrads<'a> {
        let (w, b) = self.weight_and_bias(p.weight, p.bias);
        NormGrads { w, b }
    }

    fn linear(&mut self, p: &LinearParams) -> LinearGrads<'a> {
        let (w, b) = self.weight_and_bias(p.weight, p.bias);
        LinearGrads { w, b }
    }
}
