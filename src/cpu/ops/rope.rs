//! Rotary position embedding on the q and k heads of fused q | k | v rows, in the
//! split-halves pairing of Hugging Face's Llama (dimension i turns with i + d/2).

use super::Positions;
use crate::config::ModelConfig;
use crate::model::position::rope_tables;
use crate::model::spec::Shapes;
use crate::profile::{self, Cost, Group};

/// Which way to turn: forward, or back (the backward: a rotation's transpose is its
/// inverse).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Turn {
    Forward,
    Back,
}

/// cos and sin of every position's angles: two (block_size, d/2) tables.
pub struct Rope {
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    pub fn new(cfg: &ModelConfig) -> Self {
        let (cos, sin) = rope_tables(cfg);
        Self { cos, sin }
    }

    /// Rotates the query and key heads of every qkv row in place, each by the angles of
    /// its row's position.
    pub fn rotate(&self, qkv: &mut [f32], s: &Shapes, at: Positions, turn: Turn) {
        self.rotate_rows(qkv, s, |r| at.of(r), turn);
    }

    /// [`Rope::rotate`] with each row's position given by `position(row)` (rows of
    /// different sequences at different positions, as a server's batch holds them).
    pub fn rotate_rows(
        &self,
        qkv: &mut [f32],
        s: &Shapes,
        position: impl Fn(usize) -> usize,
        turn: Turn,
    ) {
        let (d, half) = (s.head_dim, s.head_dim / 2);
        let rotated = s.n_embd + s.kv_width; // q heads, then k heads
        let rows = qkv.len() / s.qkv_width;
        let _span = profile::span(Group::Elementwise, || {
            Cost::f32s_and_flops(2 * rows * rotated, 3 * rows * rotated)
        });
        let sign = match turn {
            Turn::Forward => 1.0,
            Turn::Back => -1.0,
        };
        for (r, row) in qkv.chunks_exact_mut(s.qkv_width).enumerate() {
            let p = position(r);
            let cos = &self.cos[p * half..(p + 1) * half];
            let sin = &self.sin[p * half..(p + 1) * half];
            for head in row[..rotated].chunks_exact_mut(d) {
                let (a, b) = head.split_at_mut(half);
                for i in 0..half {
                    let (x, y) = (a[i], b[i]);
                    let s = sign * sin[i];
                    a[i] = x * cos[i] - y * s;
                    b[i] = y * cos[i] + x * s;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::ops::testing::values;

    fn shapes() -> (ModelConfig, Shapes) {
        let cfg = ModelConfig {
            n_head: 2,
            n_kv_head: Some(1),
            n_embd: 8,
            block_size: 6,
            vocab_size: 3,
            ..ModelConfig::default()
        };
        let s = Shapes::new(&cfg);
        (cfg, s)
    }

    /// Turning back undoes turning forward, values stay untouched, and q and k heads
    /// turn by the angle of their position.
    #[test]
    fn back_undoes_forward_and_only_q_and_k_turn() {
        let (cfg, s) = shapes();
        let rope = Rope::new(&cfg);
        let at = Positions::from_start(3);
        let original = values(2 * 3 * s.qkv_width, 9);
        let mut qkv = original.clone();
        rope.rotate(&mut qkv, &s, at, Turn::Forward);
        for (r, (row, orig)) in qkv
            .chunks(s.qkv_width)
            .zip(original.chunks(s.qkv_width))
            .enumerate()
        {
            let values_start = s.n_embd + s.kv_width;
            assert_eq!(
                row[values_start..],
                orig[values_start..],
                "values are not turned"
            );
            // Position r % 3, pair (i, i + d/2) of the first head, i = 0: angle = pos.
            let angle = at.of(r) as f32;
            let (x, y) = (orig[0], orig[s.head_dim / 2]);
            assert!((row[0] - (x * angle.cos() - y * angle.sin())).abs() < 1e-5);
        }
        rope.rotate(&mut qkv, &s, at, Turn::Back);
        for (a, b) in qkv.iter().zip(&original) {
            assert!((a - b).abs() < 1e-5);
        }
    }
}
