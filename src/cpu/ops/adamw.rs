//! The optimiser over flat buffers: global-norm clipping and AdamW in place, one share
//! of the buffers per thread.

use rayon::prelude::*;

use crate::cpu::kernels::multiversion;
use crate::cpu::threads::share_len;
use crate::model::spec::Param;
use crate::optim::{norm_of_partials, AdamWF32, AdamWStep, NORM_CHUNK};
use crate::profile::{self, Cost, Group};

/// The sums of squares of `grads` in blocks of `NORM_CHUNK` (`grads` starts at a
/// block boundary), each summed in order in f64: the global norm's partial sums.
pub fn squares_by_chunk(grads: &[f32]) -> Vec<f64> {
    let _span = profile::span(Group::Optimizer, || {
        Cost::f32s_and_flops(grads.len(), 2 * grads.len())
    });
    grads
        .par_chunks(NORM_CHUNK)
        .map(|block| block.iter().map(|&x| f64::from(x) * f64::from(x)).sum())
        .collect()
}

/// The global L2 norm of all gradients together.
pub fn global_norm(grads: &[f32]) -> f64 {
    norm_of_partials(&squares_by_chunk(grads))
}

/// Multiplies every gradient by `scale` (clipping).
pub fn scale(grads: &mut [f32], scale: f32) {
    let _span = profile::span(Group::Optimizer, || {
        Cost::f32s_and_flops(2 * grads.len(), grads.len())
    });
    let share = share_len(grads.len());
    grads
        .par_chunks_mut(share)
        .for_each(|g| g.iter_mut().for_each(|x| *x *= scale));
}

/// The moving averages of the gradients and of their squares, flat like the parameters.
pub struct Moments<'a> {
    pub m: &'a mut [f32],
    pub v: &'a mut [f32],
}

/// The AdamW update `u` of `params` in place from `grads` and the moments: the values
/// from flat offset `first` on of buffers laid out as `table` says (all of them, or one
/// rank's shard), each tensor decayed as the table says.
pub fn update(
    u: &AdamWStep,
    params: &mut [f32],
    grads: &[f32],
    moments: Moments,
    table: &[Param],
    first: usize,
) {
    // p, g, m, v read; p, m, v written.
    let _span = profile::span(Group::Optimizer, || {
        Cost::f32s_and_flops(7 * params.len(), 12 * params.len())
    });
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
            let first = first + i * share;
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
