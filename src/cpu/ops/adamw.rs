//! The optimiser over flat buffers: global-norm clipping and AdamW in place, one share
//! of the buffers per thread.

use rayon::prelude::*;

use crate::cpu::kernels::multiversion;
use crate::cpu::threads::share_len;
use crate::model::spec::Param;
use crate::optim::{norm_of_partials, AdamWF32, AdamWStep, NORM_CHUNK};
use crate::profile::{self, Cost, Group};

/// The sums of squares of `grads` in blocks of `NORM_CHUNK` (`grads` starts at a
/// block boundary), each in f64 by [`block_squares`]: the global norm's partial sums.
pub fn squares_by_chunk(grads: &[f32]) -> Vec<f64> {
    let _span = profile::span(Group::Optimizer, || {
        Cost::f32s_and_flops(grads.len(), 2 * grads.len())
    });
    grads.par_chunks(NORM_CHUNK).map(block_squares).collect()
}

/// Lanes a block's sum of squares runs in.
const SQUARE_LANES: usize = 32;

multiversion! {
    /// Σ x² over `block` in f64: element i into lane i % 32, the lanes then added in
    /// lane order, the last few elements after them in order. A fixed order, so the
    /// same bits on any thread or rank; thirty-two independent sums where one chain of
    /// f64 adds (four cycles each) took most of the optimiser's time on a small model.
    pub fn block_squares(block: &[f32]) -> f64 {
        let mut lanes = [0f64; SQUARE_LANES];
        let (whole, rest) = block.as_chunks::<SQUARE_LANES>();
        for chunk in whole {
            for l in 0..SQUARE_LANES {
                let x = f64::from(chunk[l]);
                lanes[l] += x * x;
            }
        }
        let mut sum = 0.0;
        for lane in lanes {
            sum += lane;
        }
        for &x in rest {
            sum += f64::from(x) * f64::from(x);
        }
        sum
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::ops::testing::values;

    /// Each block's sum of squares against the sum written out in f64 (the lanes change
    /// the order, not the precision), for lengths short of a lane set, whole, with a
    /// tail, and a whole block; and the blocks of a longer buffer one sum each.
    #[test]
    fn squares_by_block_match_their_sum() {
        for len in [0, 5, 32, 100, NORM_CHUNK] {
            let x = values(len, 3);
            let want: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
            let got = block_squares(&x);
            assert!(
                (got - want).abs() <= 1e-12 * want.max(1.0),
                "{len}: {got} vs {want}"
            );
        }
        let x = values(2 * NORM_CHUNK + 17, 4);
        let partials = squares_by_chunk(&x);
        assert_eq!(partials.len(), 3);
        for (block, partial) in x.chunks(NORM_CHUNK).zip(&partials) {
            assert_eq!(*partial, block_squares(block));
        }
        let want = x
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            .sqrt();
        assert!((global_norm(&x) - want).abs() <= 1e-12 * want);
    }
}
