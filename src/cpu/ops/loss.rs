//! The output layer's loss: softmax over the vocabulary and cross-entropy with the
//! targets, forward and backward in place on the logits.

use rayon::prelude::*;

use crate::profile::{self, Cost, Group};

/// Turns each row of `logits` (N, V) into probabilities in place and returns the summed
/// loss -log p[target]. Rows run in parallel, each writing its loss to `row_loss` (N);
/// the sum runs in row order, so the result does not depend on thread timing.
pub fn softmax_cross_entropy(
    logits: &mut [f32],
    targets: &[u32],
    v: usize,
    row_loss: &mut [f64],
) -> f64 {
    // Each row read twice (its max, its exponentials) and written once.
    let _span = profile::span(Group::Classifier, || {
        Cost::f32s_and_flops(3 * logits.len(), 4 * logits.len())
    });
    logits
        .par_chunks_mut(v)
        .zip(targets.par_iter())
        .zip(row_loss.par_iter_mut())
        .for_each(|((row, &target), loss)| {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            // -log p = log(sum e^(x - max)) - (x_target - max): finite even when
            // e^(x_target - max) underflows.
            let shifted_target = (row[target as usize] - max) as f64;
            let mut sum = 0.0f64;
            for x in row.iter_mut() {
                *x = (*x - max).exp();
                sum += *x as f64;
            }
            let inv = (1.0 / sum) as f32;
            for x in row.iter_mut() {
                *x *= inv;
            }
            *loss = sum.ln() - shifted_target;
        });
    row_loss.iter().sum()
}

/// probs -> dlogits in place: (p - onehot(target)) * scale.
pub fn cross_entropy_backward(probs: &mut [f32], targets: &[u32], v: usize, scale: f32) {
    let _span = profile::span(Group::Classifier, || {
        Cost::f32s_and_flops(2 * probs.len(), probs.len())
    });
    for (row, &target) in probs.chunks_exact_mut(v).zip(targets) {
        row[target as usize] -= 1.0;
        for x in row.iter_mut() {
            *x *= scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::ops::testing::{all, assert_gradient, values};

    /// The summed loss equals -log softmax[target] by hand, and the backward is its
    /// gradient (times the scale).
    #[test]
    fn loss_and_gradient() {
        let (n, v) = (3, 5);
        let logits = values(n * v, 1);
        let targets = [4u32, 0, 2];
        let mut loss = |logits: &[f32]| -> f64 {
            let mut probs = logits.to_vec();
            softmax_cross_entropy(&mut probs, &targets, v, &mut vec![0.0; n])
        };
        let by_hand: f64 = logits
            .chunks(v)
            .zip(&targets)
            .map(|(row, &t)| {
                let sum: f64 = row.iter().map(|&x| (x as f64).exp()).sum();
                sum.ln() - row[t as usize] as f64
            })
            .sum();
        assert!((loss(&logits) - by_hand).abs() < 1e-6);
        let mut grad = logits.clone();
        softmax_cross_entropy(&mut grad, &targets, v, &mut vec![0.0; n]);
        cross_entropy_backward(&mut grad, &targets, v, 1.0);
        assert_gradient("dlogits", &grad, &mut loss, &logits, &all(n * v));
    }
}
