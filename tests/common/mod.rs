//! What the integration tests that drive the real binary share.
#![allow(dead_code)] // each test crate uses some of these

use std::path::Path;
use std::process::{Command, Output};

/// Runs the binary in `dir` and waits for it.
pub fn tinygpt(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tinygpt"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the binary runs")
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
