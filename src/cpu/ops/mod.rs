//! The layers of the fused CPU engine, each a forward and its backward side by side (as
//! llm.c lays them out), over flat f32 buffers. Rows: N = B * T positions of width C.
//!
//! Weights come as typed views of the flat parameter buffer (`LinearWeights`,
//! `NormWeights`, ...), gradients as views of the flat gradient buffer. Backward passes
//! accumulate (+=) into parameter gradients and into the gradient of their input, so
//! residual branches and gradient accumulation need no extra pass. Every backward is
//! checked against finite differences of its forward here, and the whole step against
//! the reference model in `tests/engines.rs`.

pub mod activation;
pub mod adamw;
pub mod attention;
pub mod dropout;
pub mod embedding;
pub mod linear;
pub mod loss;
pub mod norm;
pub mod rope;

use super::threads::{zip_in_place, zip_map};
use crate::profile::{self, Cost, Group};

/// Where each row sits: rows are sequences of `t` positions, the first at position
/// `first` (0 in training; the number of cached positions in decoding).
#[derive(Debug, Clone, Copy)]
pub struct Positions {
    pub t: usize,
    pub first: usize,
}

impl Positions {
    /// Rows of `t` positions from position 0.
    pub fn from_start(t: usize) -> Self {
        Self { t, first: 0 }
    }

    /// The position of row `row`.
    pub fn of(&self, row: usize) -> usize {
        self.first + row % self.t
    }
}

/// A residual connection: out = x + branch.
pub fn residual(out: &mut [f32], x: &[f32], branch: &[f32]) {
    let _span = profile::span(Group::Elementwise, || {
        Cost::f32s_and_flops(3 * out.len(), out.len())
    });
    zip_map(out, x, branch, |x, y| x + y);
}

/// A residual connection in place: x += branch.
pub fn residual_in_place(x: &mut [f32], branch: &[f32]) {
    zip_in_place(x, branch, |x, y| x + y);
}

/// Finite-difference checks shared by the ops' tests.
#[cfg(test)]
pub mod testing {
    /// A spread of values in [-1, 1) from a cheap hash of the index.
    pub fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    /// sum(out * probe): a scalar loss whose gradient at out is the probe.
    pub fn probe_loss(out: &[f32], probe: &[f32]) -> f64 {
        out.iter().zip(probe).map(|(a, b)| (*a * *b) as f64).sum()
    }

    /// Asserts `analytic` is the gradient of `f` at `x`, by central differences at
    /// every index of `at`.
    pub fn assert_gradient(
        what: &str,
        analytic: &[f32],
        f: &mut dyn FnMut(&[f32]) -> f64,
        x: &[f32],
        at: &[usize],
    ) {
        let eps = 1e-2f32;
        for &i in at {
            let mut p = x.to_vec();
            p[i] += eps;
            let up = f(&p);
            p[i] -= 2.0 * eps;
            let down = f(&p);
            let numeric = (up - down) / (2.0 * eps as f64);
            let got = analytic[i] as f64;
            assert!(
                (got - numeric).abs() <= 2e-3 * (1.0 + numeric.abs()),
                "{what}[{i}]: {got} vs finite difference {numeric}"
            );
        }
    }

    /// Every index of a buffer of `n` values.
    pub fn all(n: usize) -> Vec<usize> {
        (0..n).collect()
    }
}
