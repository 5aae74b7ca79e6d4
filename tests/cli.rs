//! The real binary: a run from a config file, resume, and user mistakes that must end in
//! one line on stderr and exit code 2 (never a panic).

use std::path::Path;
use std::process::{Command, Output};

fn tinygpt(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tinygpt"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn setup() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let text =
        "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
            .repeat(40);
    std::fs::write(dir.path().join("corpus.txt"), text).unwrap();
    std::fs::write(
        dir.path().join("exp.toml"),
        "[data]\ncorpus = \"corpus.txt\"\n[tokenizer]\nkind = \"char\"\n\
         [model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nblock_size = 16\n\
         [train]\nbatch_size = 4\nmax_iters = 6\nwarmup_iters = 1\neval_interval = 3\neval_iters = 1\ncheckpoint_interval = 3\n",
    )
    .unwrap();
    dir
}

#[test]
fn train_then_resume_from_the_command_line() {
    let dir = setup();
    let out = tinygpt(
        dir.path(),
        &[
            "train",
            "--config",
            "exp.toml",
            "--set",
            "tokenizer.kind=bpe",
            "--set",
            "tokenizer.vocab_size=300",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let log = stderr(&out);
    assert!(log.contains("val loss"), "{log}");
    let run = dir.path().join("checkpoints/exp");
    assert!(run.join("model.safetensors").is_file());
    let config = std::fs::read_to_string(run.join("config.toml")).unwrap();
    assert!(
        config.contains("kind = \"bpe\""),
        "the resolved config records the overrides"
    );

    // Same folder again without --resume: refused, nothing overwritten.
    let before = std::fs::read(run.join("model.safetensors")).unwrap();
    let out = tinygpt(dir.path(), &["train", "--config", "exp.toml"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert_eq!(
        std::fs::read(run.join("model.safetensors")).unwrap(),
        before
    );

    // Resume to more steps.
    let out = tinygpt(
        dir.path(),
        &[
            "train",
            "--config",
            "exp.toml",
            "--resume",
            "--set",
            "train.max_iters=9",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("resuming at step 6"),
        "{}",
        stderr(&out)
    );
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run.join("state.json")).unwrap()).unwrap();
    assert_eq!(state["step"], 9);
}

#[test]
fn user_mistakes_exit_2_with_one_clear_line() {
    let dir = setup();
    std::fs::write(dir.path().join("empty.txt"), "").unwrap();
    std::fs::write(
        dir.path().join("latin1.txt"),
        b"caf\xe9 au lait\n".repeat(50),
    )
    .unwrap();
    std::fs::write(dir.path().join("short.txt"), "too short").unwrap();
    std::fs::write(dir.path().join("bad.toml"), "[model]\nn_layer = = 2\n").unwrap();
    std::fs::create_dir(dir.path().join("notxt")).unwrap();
    std::fs::write(dir.path().join("bad-tokenizer.json"), "{ nope").unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["--config", "missing.toml"], "missing.toml"),
        (&["--config", "bad.toml"], "line 2"),
        (
            &["--config", "exp.toml", "--set", "model.n_layers=2"],
            "n_layers",
        ),
        (
            &["--config", "exp.toml", "--set", "model.n_layer=two"],
            "model.n_layer",
        ),
        (
            &["--config", "exp.toml", "--set", "model.n_head=3"],
            "n_head",
        ),
        (
            &["--config", "exp.toml", "--set", "data.corpus=nope.txt"],
            "nope.txt",
        ),
        (
            &["--config", "exp.toml", "--set", "data.corpus=empty.txt"],
            "empty",
        ),
        (
            &["--config", "exp.toml", "--set", "data.corpus=latin1.txt"],
            "not UTF-8",
        ),
        (
            &["--config", "exp.toml", "--set", "data.corpus=short.txt"],
            "block_size",
        ),
        (
            &["--config", "exp.toml", "--set", "data.corpus=notxt"],
            ".txt",
        ),
        (
            &[
                "--config",
                "exp.toml",
                "--set",
                "tokenizer.path=bad-tokenizer.json",
            ],
            "bad-tokenizer.json",
        ),
        (&["--config", "exp.toml", "--resume"], "no checkpoint"),
        (&["--config", "exp.toml", "--device", "cuda"], "CUDA"),
        (
            &["--config", "exp.toml", "--device", "tpu"],
            "unknown device",
        ),
    ];
    for (args, needle) in cases {
        let mut full = vec!["train"];
        full.extend_from_slice(args);
        let out = tinygpt(dir.path(), &full);
        let err = stderr(&out);
        if *needle == "CUDA" && cfg!(feature = "cuda") {
            continue;
        }
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains(needle),
            "{args:?}: expected {needle:?} in {err}"
        );
        assert!(
            !err.contains("panicked") && !err.contains("backtrace"),
            "{args:?}: {err}"
        );
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{args:?}: one line, got {err}"
        );
        assert!(err.starts_with("error: "), "{args:?}: {err}");
    }
}
