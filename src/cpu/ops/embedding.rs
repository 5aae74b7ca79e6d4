//! The input embedding: each token's vector, plus its position's vector when positions
//! are added at the input (learned or sinusoidal; RoPE works inside attention instead).

use super::Positions;
use crate::cpu::kernels::axpy;
use crate::profile::{self, Cost, Group};

/// The tables the embedding reads: tokens (V, C), and position vectors (block_size, C)
/// when positions are added here.
#[derive(Clone, Copy)]
pub struct EmbeddingWeights<'a> {
    pub wte: &'a [f32],
    pub positions: Option<&'a [f32]>,
}

/// Gradients of the trained tables: tokens, and learned positions.
pub struct EmbeddingGrads<'a> {
    pub wte: &'a mut [f32],
    pub wpe: Option<&'a mut [f32]>,
}

impl EmbeddingWeights<'_> {
    /// x[r] = wte[ids[r]] (+ positions[position of row r]), rows of width C.
    pub fn forward(&self, x: &mut [f32], ids: &[u32], at: Positions) {
        let c = x.len() / ids.len();
        let tables = 1 + usize::from(self.positions.is_some());
        let _span = profile::span(Group::Embedding, || Cost::f32s((tables + 1) * x.len()));
        for (r, (row, &id)) in x.chunks_exact_mut(c).zip(ids).enumerate() {
            let id = id as usize;
            row.copy_from_slice(&self.wte[id * c..(id + 1) * c]);
            if let Some(table) = self.positions {
                let p = at.of(r);
                axpy(row, 1.0, &table[p * c..(p + 1) * c]);
            }
        }
    }
}

impl EmbeddingGrads<'_> {
    /// dwte[ids[r]] += dx[r]; dwpe[position of r] += dx[r] (learned positions).
    pub fn backward(self, dx: &[f32], ids: &[u32], at: Positions) {
        let c = dx.len() / ids.len();
        let tables = 1 + usize::from(self.wpe.is_some());
        let _span = profile::span(Group::Embedding, || Cost::f32s((2 * tables + 1) * dx.len()));
        for (row, &id) in dx.chunks_exact(c).zip(ids) {
            let id = id as usize;
            axpy(&mut self.wte[id * c..(id + 1) * c], 1.0, row);
        }
        if let Some(dwpe) = self.wpe {
            for (r, row) in dx.chunks_exact(c).enumerate() {
                let p = at.of(r);
                axpy(&mut dwpe[p * c..(p + 1) * c], 1.0, row);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::ops::testing::{all, assert_gradient, probe_loss, values};

    /// Rows of two sequences of 3 positions: the gradients of sum(x * probe) reach the
    /// looked-up token rows and the position rows, against central differences.
    #[test]
    fn backward_matches_differences() {
        let (v, c, t) = (5, 2, 3);
        let ids = [1u32, 4, 1, 0, 4, 4];
        let at = Positions::from_start(t);
        let (wte, wpe, probe) = (values(v * c, 1), values(t * c, 2), values(ids.len() * c, 3));
        let loss = |wte: &[f32], wpe: &[f32]| -> f64 {
            let mut x = vec![0.0; ids.len() * c];
            let tables = EmbeddingWeights {
                wte,
                positions: Some(wpe),
            };
            tables.forward(&mut x, &ids, at);
            probe_loss(&x, &probe)
        };
        let (mut dwte, mut dwpe) = (vec![0.0; v * c], vec![0.0; t * c]);
        let grads = EmbeddingGrads {
            wte: &mut dwte,
            wpe: Some(&mut dwpe),
        };
        grads.backward(&probe, &ids, at);
        assert_gradient("dwte", &dwte, &mut |w| loss(w, &wpe), &wte, &all(v * c));
        assert_gradient("dwpe", &dwpe, &mut |p| loss(&wte, p), &wpe, &all(t * c));
        assert!(
            dwte[2 * c..3 * c].iter().all(|&g| g == 0.0),
            "token 2 is not in the batch"
        );
    }

    #[test]
    fn rows_after_a_cache_start_at_its_length() {
        let at = Positions { t: 4, first: 10 };
        assert_eq!(
            (0..6).map(|r| at.of(r)).collect::<Vec<_>>(),
            [10, 11, 12, 13, 10, 11]
        );
    }
}
