//! The output layer's loss: softmax over the vocabulary and cross-entropy with the
//! targets, forward and backward in place on the logits.

use rayon::prelude::*;

use crate::cpu::kernels::{exp_approx, multiversion};
use crate::cpu::threads::share_rows;
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
        .for_each(|((row, &target), loss)| *loss = softmax_row_loss(row, target as usize));
    row_loss.iter().sum()
}

/// Lanes a row's maximum and sum run in.
const LANES: usize = 16;

multiversion! {
    /// One row of logits into its probabilities, in place; returns -log p[target] =
    /// log(Σ e^(x - max)) - (x_target - max), finite even where e^(x_target - max)
    /// underflows. The maximum and the sum as [`max_and_sum_exp`] takes them (so
    /// scoring a text gives training's loss), then each exponential again, scaled: as
    /// vectors, where libm's exp and one chain of f64 adds a value made this a tenth of
    /// a step at a vocabulary of 2048.
    pub fn softmax_row_loss(row: &mut [f32], target: usize) -> f64 {
        let (max, sum) = max_and_sum_exp(row);
        let loss = sum.ln() - f64::from(row[target] - max);
        let inv = (1.0 / sum) as f32;
        for x in row.iter_mut() {
            *x = exp_approx(*x - max) * inv;
        }
        loss
    }
}

/// -log softmax(row)[target], the row left as it is (scoring a text): the loss
/// [`softmax_row_loss`] returns.
pub fn row_loss(row: &[f32], target: usize) -> f64 {
    let (max, sum) = max_and_sum_exp(row);
    sum.ln() - f64::from(row[target] - max)
}

multiversion! {
    /// A row's largest value and Σ e^(x - max) over it: the maximum in 16 lanes, the
    /// exponentials through `exp_approx`, their sum in 16 f64 lanes (then in lane order,
    /// the tail after). log softmax(row) = row - max - ln(sum).
    pub fn max_and_sum_exp(row: &[f32]) -> (f32, f64) {
        let max = row_max(row);
        let (whole, rest) = row.as_chunks::<LANES>();
        let mut lanes = [0f64; LANES];
        for chunk in whole {
            for l in 0..LANES {
                lanes[l] += f64::from(exp_approx(chunk[l] - max));
            }
        }
        let mut sum = 0.0f64;
        for lane in lanes {
            sum += lane;
        }
        for &x in rest {
            sum += f64::from(exp_approx(x - max));
        }
        (max, sum)
    }
}

/// The largest value of `row`, in 16 lanes.
#[inline(always)]
fn row_max(row: &[f32]) -> f32 {
    let (whole, rest) = row.as_chunks::<LANES>();
    let mut top = [f32::NEG_INFINITY; LANES];
    for chunk in whole {
        for l in 0..LANES {
            top[l] = if chunk[l] > top[l] { chunk[l] } else { top[l] };
        }
    }
    let mut max = f32::NEG_INFINITY;
    for m in top.into_iter().chain(rest.iter().copied()) {
        max = if m > max { m } else { max };
    }
    max
}

/// probs -> dlogits in place: (p - onehot(target)) * scale.
pub fn cross_entropy_backward(probs: &mut [f32], targets: &[u32], v: usize, scale: f32) {
    let _span = profile::span(Group::Classifier, || {
        Cost::f32s_and_flops(2 * probs.len(), probs.len())
    });
    let share = share_rows(targets.len(), v);
    probs
        .par_chunks_mut(share * v)
        .zip(targets.par_chunks(share))
        .for_each(|(rows, targets)| {
            for (row, &target) in rows.chunks_exact_mut(v).zip(targets) {
                row[target as usize] -= 1.0;
                for x in row.iter_mut() {
                    *x *= scale;
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::ops::testing::{all, assert_gradient, values};

    /// The summed loss equals -log softmax[target] by hand and the probabilities their
    /// definition (in f64), at widths short of a vector, with a tail and of many
    /// vectors; and the backward is the loss's gradient (times the scale).
    #[test]
    fn loss_and_gradient() {
        for (v, targets) in [
            (5, [4u32, 0, 2]),
            (37, [36, 0, 17]),
            (2048, [5, 2047, 1000]),
        ] {
            let n = targets.len();
            let mut logits = values(n * v, 1);
            // A row whose largest logit is far above the rest.
            logits[v + 3] = 40.0;
            // And one far below its row's largest: past `exp_approx`'s range.
            logits[2 * v + 1] = -100.0;
            let mut loss = |logits: &[f32]| -> f64 {
                let mut probs = logits.to_vec();
                softmax_cross_entropy(&mut probs, &targets, v, &mut vec![0.0; n])
            };
            let mut probs = logits.clone();
            let got = softmax_cross_entropy(&mut probs, &targets, v, &mut vec![0.0; n]);
            let mut by_hand = 0.0;
            for (r, (row, &t)) in logits.chunks(v).zip(&targets).enumerate() {
                let max = row
                    .iter()
                    .fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
                let sum: f64 = row.iter().map(|&x| (f64::from(x) - max).exp()).sum();
                by_hand += sum.ln() - (f64::from(row[t as usize]) - max);
                for (j, &x) in row.iter().enumerate() {
                    let want = (f64::from(x) - max).exp() / sum;
                    let p = f64::from(probs[r * v + j]);
                    // x - max is rounded to f32 first: half an ulp of the gap, relative.
                    let gap = max - f64::from(x);
                    assert!(
                        (p - want).abs() <= (1e-6 + 1e-7 * gap) * want + 1e-30,
                        "v {v}: p[{r}][{j}] {p} vs {want}"
                    );
                }
            }
            assert!(
                (got - by_hand).abs() < 1e-6 * by_hand.abs().max(1.0),
                "v {v}: {got} vs {by_hand}"
            );
            // Scoring without writing the row gives each row's loss bit for bit.
            let mut in_place = logits.clone();
            for (r, (row, &t)) in in_place.chunks_mut(v).zip(&targets).enumerate() {
                let scored = row_loss(&logits[r * v..(r + 1) * v], t as usize);
                assert_eq!(scored, softmax_row_loss(row, t as usize), "v {v}: row {r}");
            }
            if v <= 37 {
                let mut grad = probs.clone();
                cross_entropy_backward(&mut grad, &targets, v, 1.0);
                assert_gradient("dlogits", &grad, &mut loss, &logits, &all(n * v));
            }
        }
    }
}
