//! The training step's attention alone (forward, backward) at the 6L/384 shape (B 16,
//! T 256, 6 heads of 64), best of five, for each precision:
//!
//!     cargo run --release --example attention_probe
//!
//! `PROBE_PRECISION=bf16|f32` times one precision; `PROBE_ONLY=forward|backward` one pass
//! (for `perf`); `PROBE_ONLY=softmax` the causal softmax alone, per score, at T 64, 256
//! and 1024.
use std::time::Instant;
use tinygpt::config::{ModelConfig, Precision};
use tinygpt::cpu::ops::attention::{causal_softmax_rows, Attention};
use tinygpt::model::spec::Shapes;

fn main() {
    let cfg = ModelConfig {
        n_layer: 6,
        n_head: 6,
        n_embd: 384,
        block_size: 256,
        vocab_size: 65,
        ..ModelConfig::default()
    };
    let (batch, t) = (16, 256);
    let precisions = match std::env::var("PROBE_PRECISION").as_deref() {
        Ok("bf16") => vec![Precision::Bf16],
        Ok("f32") => vec![Precision::F32],
        _ => vec![Precision::F32, Precision::Bf16],
    };
    let only = std::env::var("PROBE_ONLY").ok();
    let shapes = Shapes::new(&cfg);
    let n = batch * t;
    let values = |len: usize, seed: usize| -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 37 + seed * 11) % 29) as f32 * 0.07 - 1.0)
            .collect()
    };
    if only.as_deref() == Some("softmax") {
        // The causal softmax alone, one T x T head at a time.
        for t in [64, 256, 1024] {
            let mut p = values(t * t, 3);
            let mut best = f64::MAX;
            let reps = 64 * 1024 * 1024 / (t * t);
            for _ in 0..5 {
                let start = Instant::now();
                for _ in 0..reps {
                    causal_softmax_rows(&mut p, t);
                }
                best = best.min(start.elapsed().as_secs_f64() * 1e6 / reps as f64);
            }
            let per = best * 1e3 / (t * (t + 1) / 2) as f64;
            println!("causal softmax of one {t} x {t} head: {best:.1} us, {per:.2} ns a score");
        }
        return;
    }
    let qkv = values(n * shapes.qkv_width, 1);
    let dy = values(n * shapes.n_embd, 2);
    for precision in precisions {
        let attn = Attention {
            batch,
            t,
            shapes,
            precision,
        };
        let mut scratch = vec![0f32; attn.scratch_len()];
        let mut y = vec![0f32; n * shapes.n_embd];
        let mut dqkv = vec![0f32; n * shapes.qkv_width];
        let (mut fwd, mut bwd) = (f64::MAX, f64::MAX);
        for _ in 0..5 {
            if only.as_deref() != Some("backward") {
                let start = Instant::now();
                for _ in 0..6 {
                    attn.forward(&mut y, &qkv, None, &mut scratch);
                }
                fwd = fwd.min(start.elapsed().as_secs_f64() * 1e3);
            }
            if only.as_deref() != Some("forward") {
                let start = Instant::now();
                for _ in 0..6 {
                    attn.backward(&mut dqkv, &dy, &qkv, None, &mut scratch);
                }
                bwd = bwd.min(start.elapsed().as_secs_f64() * 1e3);
            }
        }
        println!("{precision:?}: six layers' attention forward {fwd:.1} ms, backward {bwd:.1} ms");
    }
}
