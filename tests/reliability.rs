//! Nothing lost: SIGKILL at random moments leaves a loadable checkpoint, Ctrl-C and
//! SIGTERM checkpoint and stop, resume continues the exact curve, divergence stops with
//! exit 3, and one run folder has one trainer.
#![cfg(unix)]

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::train_args;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tinygpt"))
}

fn setup(max_iters: usize) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let text =
        "It is a tale told by an idiot, full of sound and fury, signifying nothing.\n".repeat(60);
    std::fs::write(dir.path().join("corpus.txt"), text).unwrap();
    std::fs::write(
        dir.path().join("exp.toml"),
        format!(
            "[data]\ncorpus = \"corpus.txt\"\n[tokenizer]\nkind = \"char\"\n\
             [model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nblock_size = 16\ndropout = 0.1\n\
             [train]\nbatch_size = 4\nmax_iters = {max_iters}\nwarmup_iters = 5\neval_interval = 50\n\
             eval_iters = 1\nlog_interval = 1\ncheckpoint_interval = 1\n"
        ),
    )
    .unwrap();
    dir
}

fn train(dir: &Path, extra: &[&str]) -> Child {
    let mut args = vec!["train", "--config", "exp.toml"];
    args.extend_from_slice(extra);
    bin()
        .args(&args)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn run(dir: &Path, args: &[&str]) -> Output {
    bin().args(args).current_dir(dir).output().unwrap()
}

fn signal(child: &Child, sig: i32) {
    // Safety: sending a signal to our own child.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, sig) }, 0);
}

/// Waits until the run has written at least one checkpoint.
fn wait_for_checkpoint(dir: &Path) {
    let state = dir.join("checkpoints/exp/state.json");
    let start = Instant::now();
    while !state.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no checkpoint written"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Per-step training losses from metrics.jsonl, by step.
fn losses(run: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| Some((v["step"].as_u64()?, v.get("loss")?.as_f64()?)))
        .collect()
}

#[test]
fn sigkill_at_random_moments_never_loses_the_checkpoint() {
    let dir = setup(100_000);
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut loaded = 0;
    for trial in 0..24 {
        let resume = dir.path().join("checkpoints/exp/state.json").exists();
        let mut child = train(dir.path(), if resume { &["--resume"] } else { &[] });
        if trial == 0 {
            wait_for_checkpoint(dir.path());
        }
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        std::thread::sleep(Duration::from_millis(20 + seed % 400));
        signal(&child, libc::SIGKILL);
        child.wait().unwrap();

        let out = run(
            dir.path(),
            &["info", "--checkpoint", "checkpoints/exp", "--json"],
        );
        assert!(
            out.status.success(),
            "trial {trial}: the checkpoint did not load after SIGKILL: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(info["step"].as_u64().unwrap() >= 1);
        loaded += 1;
    }
    assert_eq!(loaded, 24);
    // And the run still continues (the dead trainer's lock is stale, taken over), for a
    // step past its checkpoint (one already at train.max_iters is finished, refused).
    let out = run(
        dir.path(),
        &["info", "--checkpoint", "checkpoints/exp", "--json"],
    );
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let next = format!("train.max_iters={}", info["step"].as_u64().unwrap() + 1);
    let out = run(dir.path(), &train_args(&["--resume"], &[next.as_str()]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("resuming"), "{err}");
}

#[test]
fn ctrl_c_checkpoints_and_resume_continues_the_exact_curve() {
    let dir = setup(400);
    // The uninterrupted run, in its own folder.
    let decay = "train.lr_decay_iters=400";
    let straight = run(dir.path(), &train_args(&[], &["run.name=straight", decay]));
    assert!(straight.status.success());

    // The same schedule, but a run that cannot end before the signal however fast the
    // steps and their saves are (it is resumed to 400 below).
    let child = train(
        dir.path(),
        &["--set", "train.max_iters=1000000", "--set", decay],
    );
    wait_for_checkpoint(dir.path());
    std::thread::sleep(Duration::from_millis(100));
    signal(&child, libc::SIGINT);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(
        err.contains("interrupted at step") && err.contains("--resume"),
        "{err}"
    );
    let stopped_at = losses(&dir.path().join("checkpoints/exp"))
        .last()
        .unwrap()
        .0;
    assert!(stopped_at < 400, "the run must stop early to test resume");

    let out = run(dir.path(), &train_args(&["--resume"], &[decay]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let resumed = losses(&dir.path().join("checkpoints/exp"));
    let expected = losses(&dir.path().join("checkpoints/straight"));
    assert_eq!(resumed.len(), 400);
    assert_eq!(
        resumed, expected,
        "same seed: the interrupted + resumed curve is the straight one"
    );
}

#[test]
fn sigterm_checkpoints_and_exits_143() {
    let dir = setup(100_000);
    let mut child = train(dir.path(), &[]);
    wait_for_checkpoint(dir.path());
    // The loss curve is drawn at each evaluation (every 50 steps here) and at a stop.
    let folder = dir.path().join("checkpoints/exp");
    let start = Instant::now();
    while !std::fs::read_to_string(folder.join("metrics.jsonl"))
        .unwrap()
        .contains("\"val_loss\"")
    {
        assert!(start.elapsed() < Duration::from_secs(60), "no evaluation");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(100));
    assert!(child.try_wait().unwrap().is_none(), "still training");
    assert!(folder.join("loss.png").is_file(), "drawn at the evaluation");
    std::fs::remove_file(folder.join("loss.png")).unwrap();
    signal(&child, libc::SIGTERM);
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(143),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(folder.join("loss.png").is_file(), "drawn at the stop");
    let out = run(dir.path(), &["info", "--checkpoint", "checkpoints/exp"]);
    assert!(out.status.success());
    assert!(
        !dir.path().join("checkpoints/exp/train.lock").exists(),
        "the lock is released"
    );
}

#[test]
fn divergence_stops_with_exit_3_and_keeps_the_last_checkpoint() {
    let dir = setup(200);
    // A rate that makes the loss overflow at once, with `more` settings.
    let diverging = |more: &[&'static str]| {
        let mut sets = vec![
            "train.lr=1e6",
            "train.min_lr=1e6",
            "train.grad_clip=0",
            "train.warmup_iters=0",
        ];
        sets.extend_from_slice(more);
        run(dir.path(), &train_args(&[], &sets))
    };
    let out = diverging(&[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(
        err.contains("diverged") && err.contains("step") && err.contains("learning rate"),
        "{err}"
    );
    assert!(err.contains("the last checkpoint (step "), "{err}");
    let out = run(
        dir.path(),
        &["info", "--checkpoint", "checkpoints/exp", "--json"],
    );
    assert!(out.status.success(), "the last good checkpoint loads");
    // Before its first checkpoint, a run is told to start again, not to resume.
    let out = diverging(&["run.name=never", "train.checkpoint_interval=100000"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(!dir.path().join("checkpoints/never/state.json").exists());
    assert!(
        err.contains("no checkpoint was written yet") && err.contains("start again"),
        "{err}"
    );
}

#[test]
fn a_second_trainer_is_refused_while_the_first_runs() {
    let dir = setup(100_000);
    let mut first = train(dir.path(), &[]);
    wait_for_checkpoint(dir.path());
    let out = run(dir.path(), &["train", "--config", "exp.toml", "--resume"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains(&format!("pid {}", first.id())), "{err}");
    first.kill().unwrap();
    first.wait().unwrap();
}

#[test]
fn a_checkpoint_read_while_its_trainer_saves_every_step_always_loads() {
    let dir = setup(100_000);
    // Its stderr unread would fill the pipe (a line a save) and stop it saving.
    let mut trainer = bin()
        .args(["train", "--config", "exp.toml"])
        .current_dir(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_checkpoint(dir.path());
    let step = || {
        let state = std::fs::read_to_string(dir.path().join("checkpoints/exp/state.json"));
        serde_json::from_str::<serde_json::Value>(&state.unwrap()).unwrap()["step"]
            .as_u64()
            .unwrap()
    };
    let first = step();
    // Each save replaces state.json and then the files it describes; a reader that
    // lands between the two must read the pair again, never report a torn checkpoint.
    let reads: [&[&str]; 3] = [
        &["info", "--checkpoint", "checkpoints/exp", "--json"],
        &[
            "generate",
            "--checkpoint",
            "checkpoints/exp",
            "--max-new-tokens",
            "2",
            "--seed",
            "1",
        ],
        &[
            "eval",
            "--checkpoint",
            "checkpoints/exp",
            "--text",
            "corpus.txt",
        ],
    ];
    // At least 20 rounds, and on until the trainer has saved 20 times meanwhile (a slow
    // disk saves less often than these reads run).
    let mut round = 0;
    while round < 20 || step() < first + 20 {
        assert!(
            round < 500,
            "the trainer saved from step {first} to {} only in {round} rounds",
            step()
        );
        for args in reads {
            let out = run(dir.path(), args);
            assert!(
                out.status.success(),
                "round {round}, {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        round += 1;
    }
    trainer.kill().unwrap();
    trainer.wait().unwrap();
}
