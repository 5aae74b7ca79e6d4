//! AdamW with decoupled weight decay on matrices only, and global-norm clipping.
//!
//! Weight decay pulls weights toward zero; applied to gains and biases (1-D tensors) it
//! would fight the normalisation, so they are left out (nanoGPT's grouping). candle_nn's
//! AdamW has one decay for all and cannot save its moments, hence this one.

use std::collections::HashMap;

use anyhow::Result;
use candle_core::{DType, Tensor, Var};

use crate::config::TrainConfig;
use crate::model::Params;
use crate::user_bail;

pub struct AdamW {
    slots: Vec<Slot>,
    /// Optimiser steps taken (for the bias corrections).
    pub step: usize,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
}

struct Slot {
    name: String,
    var: Var,
    m: Tensor, // first moment: running mean of gradients
    v: Tensor, // second moment: running mean of squared gradients
    decay: bool,
}

impl AdamW {
    pub fn new(params: &Params, cfg: &TrainConfig) -> Result<Self> {
        let slots = params
            .iter()
            .map(|(p, var)| {
                Ok(Slot {
                    name: p.name.clone(),
                    var: var.clone(),
                    m: var.zeros_like()?,
                    v: var.zeros_like()?,
                    decay: p.decay,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            slots,
            step: 0,
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            eps: cfg.eps,
            weight_decay: cfg.weight_decay,
        })
    }

    /// Applies one update. `grads[i]` belongs to the i-th parameter (as `Params::iter`).
    pub fn step(&mut self, grads: &[Tensor], lr: f64) -> Result<()> {
        assert_eq!(grads.len(), self.slots.len());
        self.step += 1;
        let bc1 = 1.0 - self.beta1.powi(self.step as i32);
        let bc2 = 1.0 - self.beta2.powi(self.step as i32);
        for (slot, g) in self.slots.iter_mut().zip(grads) {
            slot.m = ((&slot.m * self.beta1)? + (g * (1.0 - self.beta1))?)?;
            slot.v = ((&slot.v * self.beta2)? + (g.sqr()? * (1.0 - self.beta2))?)?;
            let m_hat = (&slot.m / bc1)?;
            let v_hat = (&slot.v / bc2)?;
            let update = (m_hat / (v_hat.sqrt()? + self.eps)?)?;
            let p = slot.var.as_tensor().detach();
            let decayed = if slot.decay {
                (p * (1.0 - lr * self.weight_decay))?
            } else {
                p
            };
            slot.var.set(&(decayed - (update * lr)?)?)?;
        }
        Ok(())
    }

    /// Moments by name (`<param>.exp_avg`, `<param>.exp_avg_sq`), for the checkpoint.
    pub fn state_tensors(&self) -> HashMap<String, Tensor> {
        let mut out = HashMap::new();
        for s in &self.slots {
            out.insert(format!("{}.exp_avg", s.name), s.m.clone());
            out.insert(format!("{}.exp_avg_sq", s.name), s.v.clone());
        }
        out
    }

    pub fn load_state(
        &mut self,
        tensors: &HashMap<String, Tensor>,
        step: usize,
        source: &str,
    ) -> Result<()> {
        for s in &mut self.slots {
            for (suffix, slot) in [("exp_avg", &mut s.m), ("exp_avg_sq", &mut s.v)] {
                let name = format!("{}.{suffix}", s.name);
                let Some(t) = tensors.get(&name) else {
                    user_bail!("{source}: tensor {name} is missing");
                };
                if t.dims() != slot.dims() {
                    user_bail!(
                        "{source}: tensor {name} has shape {:?}, expected {:?}",
                        t.dims(),
                        slot.dims()
                    );
                }
                *slot = t.to_dtype(slot.dtype())?.to_device(slot.device())?;
            }
        }
        self.step = step;
        Ok(())
    }
}

/// The global L2 norm of all gradients together.
pub fn global_norm(grads: &[Tensor]) -> Result<f64> {
    let mut sum = 0.0;
    for g in grads {
        sum += g
            .to_dtype(DType::F32)?
            .sqr()?
            .sum_all()?
            .to_scalar::<f32>()? as f64;
    }
    Ok(sum.sqrt())
}

/// Scales gradients down so their global norm is at most `max_norm` (as torch's
/// clip_grad_norm_). Returns the norm before clipping.
pub fn clip_grad_norm(grads: &mut [Tensor], max_norm: f64) -> Result<f64> {
    let norm = global_norm(grads)?;
    if max_norm > 0.0 && norm > max_norm {
        let scale = max_norm / (norm + 1e-6);
        for g in grads.iter_mut() {
            *g = (&*g * scale)?;
        }
    }
    Ok(norm)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Two steps, checked against the AdamW formula written out by hand on one element
    /// of a matrix (decayed) and of a norm's gain (not decayed).
    #[test]
    fn matches_the_formula() {
        let dev = Device::Cpu;
        let cfg = crate::config::ModelConfig {
            n_layer: 1,
            n_head: 1,
            n_embd: 2,
            block_size: 2,
            vocab_size: 3,
            ..Default::default()
        };
        let model = crate::model::Gpt::new(&cfg, 0, &dev).unwrap();
        let spec = model.spec();
        let params = model.params();
        let train = TrainConfig {
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
            ..TrainConfig::default()
        };
        let mut opt = AdamW::new(params, &train).unwrap();
        let lr = 0.01;
        let first = |id| -> f64 {
            params
                .tensor(id)
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()[0] as f64
        };
        let (wte0, gain0) = (first(spec.wte), first(spec.ln_f.weight));
        for g in [0.5f64, -2.0] {
            let grads: Vec<Tensor> = params
                .iter()
                .map(|(_, v)| (v.ones_like().unwrap() * g).unwrap())
                .collect();
            opt.step(&grads, lr).unwrap();
        }
        // By hand.
        let (mut m, mut v, mut pw, mut pg) = (0.0, 0.0, wte0, gain0);
        for (t, g) in [0.5f64, -2.0].iter().enumerate() {
            m = 0.9 * m + 0.1 * g;
            v = 0.99 * v + 0.01 * g * g;
            let step = t as i32 + 1;
            let upd =
                (m / (1.0 - 0.9f64.powi(step))) / ((v / (1.0 - 0.99f64.powi(step))).sqrt() + 1e-8);
            pw = pw * (1.0 - lr * 0.1) - lr * upd;
            pg -= lr * upd; // 1-D: no decay
        }
        let (w, gain) = (first(spec.wte), first(spec.ln_f.weight));
        assert!((w - pw).abs() < 1e-6, "{w} vs {pw}");
        assert!((gain - pg).abs() < 1e-6, "{gain} vs {pg}");
        assert!(
            (pw - (wte0 - (gain0 - pg))).abs() > 1e-6,
            "the matrix is decayed, the gain is not"
        );
    }

    #[test]
    fn clipping_scales_to_the_max_norm() {
        let dev = Device::Cpu;
        let mut grads = vec![
            Tensor::new(&[3f32, 0.0], &dev).unwrap(),
            Tensor::new(&[[0f32, 4.0]], &dev).unwrap(),
        ];
        let norm = clip_grad_norm(&mut grads, 1.0).unwrap();
        assert!((norm - 5.0).abs() < 1e-6);
        assert!((global_norm(&grads).unwrap() - 1.0).abs() < 1e-5);
        let norm = clip_grad_norm(&mut grads, 10.0).unwrap();
        assert!((norm - 1.0).abs() < 1e-5, "no clipping under the max");
    }
}
