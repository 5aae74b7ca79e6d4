//! The reference model's K/V cache: each layer's keys and values of the tokens seen so
//! far, as candle tensors, so that a decoding step attends to them without computing
//! them again. (The fused CPU decoder keeps its own, in flat buffers:
//! `cpu::kv_cache::KvCache`.)

use anyhow::Result;
use candle_core::Tensor;

/// Keys and values of the tokens seen so far, per layer. Grouped K/V heads are stored
/// once, before being shared across query heads.
#[derive(Default)]
pub struct TensorKvCache {
    layers: Vec<Option<(Tensor, Tensor)>>, // (B, H_kv, S, d) each
}

impl TensorKvCache {
    pub fn new(n_layer: usize) -> Self {
        Self {
            layers: vec![None; n_layer],
        }
    }

    /// Number of cached positions.
    pub fn len(&self) -> usize {
        match self.layers.first() {
            Some(Some((k, _))) => k.dim(2).unwrap_or(0),
            _ => 0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn clear(&mut self) {
        self.layers.iter_mut().for_each(|l| *l = None);
    }

    /// Appends this step's k, v for `layer` and returns all of them.
    pub(super) fn extend(
        &mut self,
        layer: usize,
        k: Tensor,
        v: Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let (k, v) = match self.layers[layer].take() {
            Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 2)?, Tensor::cat(&[&pv, &v], 2)?),
            None => (k, v),
        };
        self.layers[layer] = Some((k.clone(), v.clone()));
        Ok((k, v))
    }
}
