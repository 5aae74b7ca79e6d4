//! Multi-head causal self-attention, with optional grouped K/V heads and a KV cache.
//!
//! Each head asks "which earlier tokens matter to me?": its queries are compared with
//! the keys of every visible token (scores scaled by 1/sqrt(d_k) so their variance does
//! not grow with the head size), future tokens are masked out, a softmax turns scores
//! into weights, and the output is the weighted sum of the values.

use anyhow::Result;
use candle_core::{Device, Tensor, D};

use super::dropout::{Dropout, Site};
use super::kv_cache::TensorKvCache;
use super::linear::{product, Linear};
use super::pass::{Parts, Pass};
use super::position::Rope;
use crate::config::Precision;

/// softmax(q k^T * scale + mask) v, returning (output, weights); the two products in
/// `products` precision (softmax in the inputs' type). With `dropout` (in training), the
/// weights are dropped out at the given site before they weigh the values.
///
/// q: (B, H, T, d); k, v: (B, H, S, d) with S >= T. The T queries are the last T of
/// the S positions, so with `causal` query t sees keys 0 ..= S - T + t.
/// Output: (B, H, T, d); weights: (B, H, T, S).
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    causal: bool,
    dropout: Option<(&Dropout, Site)>,
    products: Precision,
) -> Result<(Tensor, Tensor)> {
    let t = q.dim(2)?;
    let s = k.dim(2)?;
    let mut scores = (product(q, &k.t()?, products)? * scale)?; // (B, H, T, S)
    if causal {
        let mask = causal_mask(t, s, q.device())?.to_dtype(scores.dtype())?;
        scores = scores.broadcast_add(&mask)?;
    }
    let weights = candle_nn::ops::softmax(&scores, D::Minus1)?;
    let used = match dropout {
        Some((d, site)) => d.apply(&weights, site)?,
        None => weights.clone(),
    };
    let out = product(&used, v, products)?;
    Ok((out, weights))
}

/// (T, S) additive mask: 0 where query t may see key s (s <= S - T + t), -inf elsewhere.
pub fn causal_mask(t: usize, s: usize, device: &Device) -> Result<Tensor> {
    let offset = s - t;
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| {
            (0..s).map(move |j| {
                if j <= offset + i {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Ok(Tensor::from_vec(mask, (t, s), device)?)
}

pub struct CausalSelfAttention {
    layer: usize,
    /// Rotary positions, when the model has them.
    rope: Option<Rope>,
    c_attn: Linear, // C -> (H + 2 H_kv) d: q | k | v
    c_proj: Linear, // C -> C
    n_head: usize,
    n_kv_head: usize,
    head_dim: usize,
    products: Precision,
}

impl CausalSelfAttention {
    /// The attention of block `layer`.
    pub fn new(parts: Parts, layer: usize) -> Self {
        let (block, shapes) = (&parts.spec.blocks[layer], &parts.spec.shapes);
        let products = parts.products;
        Self {
            layer,
            rope: parts.rope.cloned(),
            c_attn: Linear::new(parts.params, &block.attn_qkv, products),
            c_proj: Linear::new(parts.params, &block.attn_proj, products),
            n_head: shapes.n_head,
            n_kv_head: shapes.n_kv_head,
            head_dim: shapes.head_dim,
            products,
        }
    }

    /// x: (B, T, C) at positions pass.pos0 .. pass.pos0 + T -> (B, T, C), and the
    /// attention weights (B, H, T, S).
    pub fn forward(
        &self,
        x: &Tensor,
        pass: Pass,
        cache: Option<&mut TensorKvCache>,
    ) -> Result<(Tensor, Tensor)> {
        let (b, t, c) = x.dims3()?;
        let (h, h_kv, d) = (self.n_head, self.n_kv_head, self.head_dim);
        let qkv = self.c_attn.forward(x)?; // (B, T, (H + 2 H_kv) d)
        let heads = |start: usize, n: usize| -> Result<Tensor> {
            Ok(qkv
                .narrow(2, start * d, n * d)?
                .reshape((b, t, n, d))?
                .transpose(1, 2)? // (B, n, T, d)
                .contiguous()?)
        };
        let mut q = heads(0, h)?;
        let mut k = heads(h, h_kv)?;
        let mut v = heads(h + h_kv, h_kv)?;
        if let Some(rope) = &self.rope {
            q = rope.apply(&q, pass.pos0)?;
            k = rope.apply(&k, pass.pos0)?;
        }
        if let Some(cache) = cache {
            (k, v) = cache.extend(self.layer, k, v)?; // (B, H_kv, S, d)
        }
        // Each group of H / H_kv query heads shares one K/V head.
        let k = repeat_kv(&k, h / h_kv)?;
        let v = repeat_kv(&v, h / h_kv)?;
        let scale = 1.0 / (d as f64).sqrt();
        let dropout = pass
            .dropout
            .map(|d| (d, Site::AttentionWeights(self.layer)));
        let (y, weights) =
            scaled_dot_product_attention(&q, &k, &v, scale, true, dropout, self.products)?;
        let y = y.transpose(1, 2)?.reshape((b, t, c))?; // heads side by side again
        Ok((self.c_proj.forward(&y)?, weights))
    }
}

/// (B, H_kv, S, d) -> (B, H_kv * n_rep, S, d), each K/V head repeated for its group.
fn repeat_kv(x: &Tensor, n_rep: usize) -> Result<Tensor> {
    if n_rep == 1 {
        return Ok(x.clone());
    }
    let (b, h_kv, s, d) = x.dims4()?;
    Ok(x.unsqueeze(2)?
        .broadcast_as((b, h_kv, n_rep, s, d))?
        .reshape((b, h_kv * n_rep, s, d))?)
}
