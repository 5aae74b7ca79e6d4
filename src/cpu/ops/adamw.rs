//! The optimiser over flat buffers: global-norm clipping and AdamW in place, one share
//! of the buffers per thread.

use rayon::prelude::*;

use crate::cpu::kernels::multiversion;
use crate::cpu::threads::share_len;
use crate::model::spec::Param;
use crate::optim::{clip_scale, AdamWF32, AdamWStep};

/// The global L2 norm of all gradients together.
pub fn global_norm(grads: &[f32]) -> f64 {
    grads
        .iter()
        .map(|&x| (x as f64) * (x as f64))
        .sum::<f64>()
        .sqrt()
}

/// Scales gradients to a global norm of at most `max_norm` (0: no clipping); returns
/// the norm before.
pub fn clip(grads: &mut [f32], max_norm: f64) -> f64 {
    let norm = global_norm(grads);
    if let Some(scale) = clip_scale(norm, max_norm) {
        let scale = scale as f32;
        grads.iter_mut().for_each(|x| *x *= scale);
    }
    norm
}

/// The moving averages of the gradients and of their squares, flat like the parameters.
pub struct Moments<'a> {
    pub m: &'a mut [f32],
    pub v: &'a mut [f32],
}

/// The AdamW update `u` of `params` in place from `grads` and the moments, all flat
/// buffers laid out as `table` says, each tensor decayed as the table says.
pub fn update(u: &AdamWStep, params: &mut [f32], grads: &[f32], moments: Moments, table: &[Param]) {
    // One share of the flat buffers per thread, each updating the parts of the tensors
    // that fall in it with that tensor's decay.
    let share = share_len(params.len());
    params
        .par_chunks_mut(share)
        .zip(grads.par_chunks(share))
        .zip(moments.m.par_chunks_mut(share))
        .zip(moments.v.par_chunks_mut(share))
        .enumerate()
        .for_each(|(i, (((p, g), m), v))| {
            let first = i * share;
            for param in table {
                let range = param.range();
                let start = range.start.max(first);
                let end = range.end.min(first + p.len());
                if start < end {
                    let r = start - first..end - first;
                    let (p, g) = (&mut p[r.clone()], &g[r.clone()]);
                    adamw_update(p, g, &mut m[r.clone()], &mut v[r], u.in_f32(param.decay));
                }
            }
        });
}

multiversion! {
    /// m, v <- moving averages of g, g^2; p <- p * shrink - lr * m_hat / (sqrt(v_hat) + eps).
    pub fn adamw_update(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], hp: AdamWF32) {
        for i in 0..p.len() {
            m[i] = hp.b1 * m[i] + (1.0 - hp.b1) * g[i];
            v[i] = hp.b2 * v[i] + (1.0 - hp.b2) * g[i] * g[i];
            let m_hat = m[i] * hp.inv_bc1;
            let v_hat = v[i] * hp.inv_bc2;
            p[i] = p[i] * hp.shrink - hp.lr * m_hat / (v_hat.sqrt() + hp.eps);
        }
    }
}
