//! What the integration tests that drive the real binary share.
#![allow(dead_code)] // each test crate uses some of these

use std::path::Path;
use std::process::{Command, Output};

use tinygpt::config::{MlpKind, ModelConfig, NormKind, PositionKind};
use tinygpt::train::{Reporter, StepLog};

/// Runs the binary in `dir` and waits for it.
pub fn tinygpt(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tinygpt"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the binary runs")
}

/// Runs the binary in `dir` and asserts it exits 0 (showing its stderr if not).
pub fn succeeds(dir: &Path, args: &[&str]) -> Output {
    let out = tinygpt(dir, args);
    assert!(out.status.success(), "{:?}: {}", args, stderr(&out));
    out
}

/// `out`, asserted to be a run that exited 0 (its stderr shown if not).
pub fn succeeded(out: Output) -> Output {
    assert!(out.status.success(), "{}", stderr(&out));
    out
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A folder with `text` as corpus.txt and exp.toml: a char-level model with the
/// `[model]` and `[train]` settings given (TOML lines).
pub fn char_experiment(text: &str, model: &str, train: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("corpus.txt"), text).unwrap();
    let config = format!(
        "[data]\ncorpus = \"corpus.txt\"\n[tokenizer]\nkind = \"char\"\n[model]\n{model}\n[train]\n{train}\n"
    );
    std::fs::write(dir.path().join("exp.toml"), config).unwrap();
    dir
}

/// `train --config exp.toml`, then `flags`, then `--set S` for each of `sets`.
pub fn train_args<'a>(flags: &[&'a str], sets: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["train", "--config", "exp.toml"];
    args.extend_from_slice(flags);
    for set in sets {
        args.extend(["--set", set]);
    }
    args
}

/// Collects every reading's loss (every step's where train.log_interval is 1).
#[derive(Default)]
pub struct Losses(pub Vec<(usize, f64)>);

impl Reporter for Losses {
    fn step(&mut self, log: &StepLog) {
        if let Some(m) = &log.measured {
            self.0.push((log.step, m.loss));
        }
    }
}

/// The two families the engine tests cover, each 2 layers of 4 heads of size 18 (odd,
/// past the kernels' tiles), vocabulary 67, context `block`: GPT-2's (learned
/// positions, LayerNorm, GELU, 4 K/V heads) and Llama's (RoPE, RMSNorm, SwiGLU, 2
/// grouped K/V heads).
pub fn gpt2_and_llama(block: usize) -> [ModelConfig; 2] {
    let family = |positions, kv, norm, mlp| ModelConfig {
        n_layer: 2,
        n_head: 4,
        n_kv_head: Some(kv),
        n_embd: 72,
        block_size: block,
        positions,
        norm,
        mlp,
        vocab_size: 67,
        ..ModelConfig::default()
    };
    [
        family(PositionKind::Learned, 4, NormKind::LayerNorm, MlpKind::Gelu),
        family(PositionKind::Rope, 2, NormKind::RmsNorm, MlpKind::Swiglu),
    ]
}

/// `count` words of 1 to 16 letters from the first `letters` of the alphabet, each
/// followed by a space or now and then a newline: text with pairs for many merges and
/// merges of merges, the same for the same `seed` (Knuth's MMIX generator).
pub fn random_words(seed: u64, count: usize, letters: u64) -> String {
    let mut state = seed;
    (0..count)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let len = 1 + (state >> 60) as usize;
            let word: String = (0..len)
                .map(|k| (b'a' + ((state >> ((k * 5) % 60)) % letters) as u8) as char)
                .collect();
            word + if state.is_multiple_of(5) { "\n" } else { " " }
        })
        .collect()
}

/// A model of `n_layer` layers of `n_head` heads, width `n_embd`, context
/// `block_size`, `vocab_size` tokens; the other settings the defaults.
pub fn model(
    n_layer: usize,
    n_head: usize,
    n_embd: usize,
    block_size: usize,
    vocab_size: usize,
) -> ModelConfig {
    ModelConfig {
        n_layer,
        n_head,
        n_embd,
        block_size,
        vocab_size,
        ..ModelConfig::default()
    }
}
