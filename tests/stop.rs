//! Stop means stop: the binary, sent SIGTERM or SIGINT in the middle of long work,
//! exits within seconds with 128 + the signal, keeping only whole files.
#![cfg(unix)]

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::train_args;

fn tinygpt(dir: &Path, args: &[&str]) -> Command {
    use std::os::unix::process::CommandExt;
    let mut command = Command::new(env!("CARGO_BIN_EXE_tinygpt"));
    command.args(args).current_dir(dir);
    // As a terminal's child: SIGHUP at its default, whatever this test's runner has (a
    // run under nohup ignores it, and so would the child).
    // Safety: only signal(2), async-signal-safe, between fork and exec.
    unsafe {
        command.pre_exec(|| {
            libc::signal(libc::SIGHUP, libc::SIG_DFL);
            Ok(())
        });
    }
    command
}

/// Waits until `ready` holds (polling), panicking after a minute.
fn wait_for(what: &str, child: &mut Child, ready: impl Fn() -> bool) {
    let start = Instant::now();
    while !ready() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("exited ({status}) before {what}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "never saw {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for `child` to exit and says how long it took, killing it (and panicking) if
/// it runs past `most`.
fn exit_within(child: &mut Child, most: Duration) -> (std::process::ExitStatus, Duration) {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return (status, start.elapsed());
        }
        if start.elapsed() > most {
            let _ = child.kill();
            panic!("still running after {:?}", start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Sends `signal` and returns the exit code and stderr, asserting the exit came within
/// `limit`.
fn signal_and_wait(mut child: Child, signal: i32, limit: Duration) -> (i32, String) {
    // Safety: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, signal) }, 0);
    let (status, took) = exit_within(&mut child, limit * 4);
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(took < limit, "took {took:?} to stop: {err}");
    (status.code().expect("exited, not killed"), err)
}

fn metrics_has(run: &Path, step: u64, key: &str) -> bool {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .any(|v| v["step"].as_u64() == Some(step) && v.get(key).is_some())
}

fn experiment(dir: &Path) {
    let text = "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n"
        .repeat(60);
    std::fs::write(dir.join("corpus.txt"), text).unwrap();
    std::fs::write(
        dir.join("exp.toml"),
        "[run]\nname = \"r\"\n[data]\ncorpus = \"corpus.txt\"\n[tokenizer]\nkind = \"char\"\n\
         [model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nblock_size = 16\n\
         [train]\nbatch_size = 4\nmax_iters = 2\nwarmup_iters = 1\neval_interval = 2\n\
         eval_iters = 2\nlog_interval = 1\ncheckpoint_interval = 2\n",
    )
    .unwrap();
    let out = tinygpt(dir, &["train", "--config", "exp.toml"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Resumes the run to step 3, whose evaluation would take hours, and stops it there.
fn stop_a_long_evaluation(signal: i32, code: i32) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    experiment(d);
    let run = d.join("checkpoints/r");
    let long = train_args(
        &["--resume"],
        &[
            "train.max_iters=6",
            "train.eval_interval=3",
            "train.eval_iters=100000000",
        ],
    );
    let mut child = tinygpt(d, &long).stderr(Stdio::piped()).spawn().unwrap();
    wait_for("step 3", &mut child, || metrics_has(&run, 3, "loss"));
    std::thread::sleep(Duration::from_millis(300)); // well into the evaluation
    let (exit, err) = signal_and_wait(child, signal, Duration::from_secs(5));
    assert_eq!(exit, code, "{err}");
    assert!(err.contains("interrupted at step 3"), "{err}");
    // The command that continues, to paste: this one (which has --resume already),
    // with the binary as it was started.
    let again = format!(
        "continue with {} {}",
        env!("CARGO_BIN_EXE_tinygpt"),
        long.join(" ")
    );
    assert!(err.contains(&again), "expected {again:?} in: {err}");

    // The step trained before the stop was saved whole; its evaluation was not logged.
    let loaded = tinygpt::checkpoint::Loaded::load(&run, &candle_core::Device::Cpu).unwrap();
    assert_eq!(loaded.state.step, 3);
    assert!(!metrics_has(&run, 3, "val_loss"));
    // Resumed with a sane evaluation: step 3 is evaluated after all, and training ends.
    let out = tinygpt(d, &long[..long.len() - 2]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(metrics_has(&run, 3, "val_loss") && metrics_has(&run, 6, "val_loss"));
}

#[test]
fn sigterm_stops_a_long_evaluation_within_seconds() {
    stop_a_long_evaluation(libc::SIGTERM, 143);
}

/// What a batch system sends ahead of a job's time limit (Slurm's --signal=USR1@120),
/// and a terminal that closes, stop as SIGTERM does, with the checkpoint.
#[test]
fn sigusr1_and_sighup_stop_as_sigterm_does() {
    stop_a_long_evaluation(libc::SIGUSR1, 128 + libc::SIGUSR1);
    stop_a_long_evaluation(libc::SIGHUP, 128 + libc::SIGHUP);
}

/// Started under `nohup` (SIGHUP ignored), a run outlives its terminal.
#[test]
fn a_run_started_to_ignore_sighup_goes_on() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    experiment(d);
    let run = d.join("checkpoints/r");
    let long = train_args(&["--resume"], &["train.max_iters=100000"]);
    let mut command = tinygpt(d, &long);
    // Safety: only signal(2), async-signal-safe, between fork and exec.
    unsafe {
        command.pre_exec(|| {
            libc::signal(libc::SIGHUP, libc::SIG_IGN);
            Ok(())
        });
    }
    let mut child = command.stderr(Stdio::piped()).spawn().unwrap();
    wait_for("step 3", &mut child, || metrics_has(&run, 3, "loss"));
    // Safety: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGHUP) }, 0);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        child.try_wait().unwrap().is_none(),
        "SIGHUP stopped a nohup run"
    );
    let (exit, err) = signal_and_wait(child, libc::SIGTERM, Duration::from_secs(10));
    assert_eq!(exit, 143, "{err}");
}

/// A stop between log lines still logs the steps it saves: metrics.jsonl reaches the
/// checkpoint's step (a curve, `compare` and the dashboard ended at the last line's).
#[test]
fn a_stop_between_log_lines_logs_the_steps_it_saves() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    experiment(d);
    let run = d.join("checkpoints/r");
    let long = train_args(
        &["--resume"],
        &[
            "train.max_iters=100000000",
            "train.log_interval=100000000",
            "train.eval_interval=100000000",
            "train.checkpoint_interval=100000000",
        ],
    );
    let child = tinygpt(d, &long).stderr(Stdio::piped()).spawn().unwrap();
    std::thread::sleep(Duration::from_secs(2)); // steps trained, none logged
    let (exit, err) = signal_and_wait(child, libc::SIGTERM, Duration::from_secs(10));
    assert_eq!(exit, 143, "{err}");
    let loaded = tinygpt::checkpoint::Loaded::load(&run, &candle_core::Device::Cpu).unwrap();
    let step = loaded.state.step as u64;
    assert!(step > 2, "no step trained in 2 s: {err}");
    assert!(metrics_has(&run, step, "loss"), "{err}");
    assert!(!metrics_has(&run, step, "val_loss"), "{err}");
}

#[test]
fn sigint_stops_a_long_evaluation_within_seconds() {
    stop_a_long_evaluation(libc::SIGINT, 130);
}

#[test]
fn sigterm_stops_corpus_encoding_leaving_no_partial_cache() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    experiment(d);
    // ~120 MB: seconds of encoding on any machine, after a BPE trained on 1 MB.
    let line = "Now is the winter of our discontent made glorious summer by this sun of York\n";
    let big = line.repeat(120_000_000 / line.len());
    std::fs::write(d.join("big.txt"), big).unwrap();
    let args = train_args(
        &[],
        &[
            "run.name=big",
            "data.corpus=big.txt",
            "tokenizer.kind=bpe",
            "tokenizer.vocab_size=300",
            "tokenizer.train_bytes=1000000",
        ],
    );
    let mut child = tinygpt(d, &args).stderr(Stdio::piped()).spawn().unwrap();
    let cache = d.join("cache");
    let tokenizer_done = || {
        std::fs::read_dir(&cache)
            .into_iter()
            .flatten()
            .flatten()
            .any(|corpus| {
                std::fs::read_dir(corpus.path())
                    .into_iter()
                    .flatten()
                    .flatten()
                    .any(|f| f.file_name().to_string_lossy().starts_with("tokenizer-bpe"))
            })
    };
    wait_for("the trained tokenizer", &mut child, tokenizer_done);
    // Into the encoding. The stop is seen between waves of chunks; on a loaded two-core
    // machine a wave takes seconds.
    std::thread::sleep(Duration::from_millis(200));
    let (exit, err) = signal_and_wait(child, libc::SIGTERM, Duration::from_secs(10));
    assert_eq!(exit, 143, "{err}");
    assert!(err.contains("stopped by SIGTERM"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    // No ids, no header, no temporary file; no run folder.
    let big_corpus = std::fs::read_dir(&cache)
        .unwrap()
        .flatten()
        .filter(|c| c.file_name().to_string_lossy().starts_with("big-"));
    for corpus in big_corpus {
        for file in std::fs::read_dir(corpus.path()).unwrap().flatten() {
            let name = file.file_name().to_string_lossy().to_string();
            assert!(
                name == "corpus.json" || name == "in-use.lock" || name.starts_with("tokenizer-"),
                "left behind: {name}"
            );
        }
    }
    assert!(!d.join("checkpoints/big").exists());
}

#[test]
fn sigint_stops_generation_between_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    experiment(d);
    let args = [
        "generate",
        "--checkpoint",
        "checkpoints/r",
        "--max-new-tokens",
        "100000000",
        "--prompt",
        "Now",
    ];
    let mut child = tinygpt(d, &args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert!(child.try_wait().unwrap().is_none(), "still generating");
    let (exit, err) = signal_and_wait(child, libc::SIGINT, Duration::from_secs(2));
    assert_eq!(exit, 130, "{err}");
    assert!(err.contains("stopped by Ctrl-C"), "{err}");
}

/// `generate --json` stopped by Ctrl-C still prints what it drew (a record per sample,
/// marked interrupted), then exits as a stop does.
#[test]
fn an_interrupted_json_generation_prints_its_samples() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    experiment(d);
    let args = [
        "generate",
        "--checkpoint",
        "checkpoints/r",
        "--max-new-tokens",
        "100000000",
        "--prompt",
        "Now",
        "--num-samples",
        "2",
        "--json",
    ];
    let mut child = tinygpt(d, &args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read as it comes: the records of many tokens outgrow a pipe's buffer.
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut out = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut out).unwrap();
        out
    });
    std::thread::sleep(Duration::from_millis(500));
    assert!(child.try_wait().unwrap().is_none(), "still generating");
    let (exit, err) = signal_and_wait(child, libc::SIGINT, Duration::from_secs(5));
    assert_eq!(exit, 130, "{err}");
    assert!(err.contains("stopped by Ctrl-C"), "{err}");
    let out = reader.join().unwrap();
    let records: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(records.len(), 2, "{out:.300}");
    for r in &records {
        assert_eq!(r["stats"]["stopped_by"], "interrupted", "{r:.300}");
        let drawn = r["token_ids"].as_array().unwrap().len();
        assert!(drawn > 0, "{r:.300}");
        assert_eq!(r["stats"]["generated_tokens"], drawn);
    }
}

/// A model whose checkpoint (weights and AdamW moments, ~130 MB) takes a while to write,
/// saved after every step, so a signal lands in a write more often than not.
fn big_checkpoints(dir: &Path) -> Vec<&'static str> {
    experiment(dir);
    train_args(
        &[],
        &[
            "run.name=big",
            "model.n_layer=6",
            "model.n_embd=384",
            "model.n_head=6",
            "train.max_iters=100000",
            "train.checkpoint_interval=1",
            "train.eval_interval=100000",
        ],
    )
}

#[test]
fn a_stop_during_checkpoint_writes_leaves_a_run_that_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let args = big_checkpoints(d);
    let run = d.join("checkpoints/big");
    for signals in [1, 2] {
        // The first session starts the run, the second resumes it; either saves two
        // checkpoints before the signal.
        let resume: &[&str] = if signals == 1 { &[] } else { &["--resume"] };
        let before = tinygpt::checkpoint::RunDir::new(&run)
            .state()
            .map_or(0, |s| s.step);
        let mut child = tinygpt(d, &args)
            .args(resume)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_for("a checkpoint", &mut child, || {
            tinygpt::checkpoint::RunDir::new(&run)
                .state()
                .is_ok_and(|s| s.step >= before + 2)
        });
        if signals == 2 {
            // A second signal exits at once, wherever the write is.
            // Safety: kill(2) on our own child's pid.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            // (a second within a second of the first is the same stop)
            std::thread::sleep(Duration::from_millis(1050));
        }
        // A signal in a save finishes it (130 MB with its syncs, on a disk other tests
        // share) and stops there.
        let (exit, err) = signal_and_wait(child, libc::SIGTERM, Duration::from_secs(60));
        assert_eq!(exit, 143, "{signals} signal(s): {err}");
        // Resumable: one more step from whatever the stop left.
        let state = tinygpt::checkpoint::RunDir::new(&run).state().unwrap();
        let next = format!("train.max_iters={}", state.step + 1);
        let out = tinygpt(d, &args)
            .args(["--resume", "--set", &next])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{signals} signal(s), resuming at {}: {}",
            state.step,
            String::from_utf8_lossy(&out.stderr)
        );
        let loaded = tinygpt::checkpoint::Loaded::load(&run, &candle_core::Device::Cpu).unwrap();
        assert_eq!(loaded.state.step, state.step + 1);
    }
}

/// The same signal twice at once (GNU `timeout` signals the process and then its group)
/// is one stop: the step finishes and is saved. A second signal a second or more
/// later exits at once, saying so, and writes nothing more.
#[test]
fn a_signal_twice_at_once_is_one_stop_and_a_later_one_exits_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    experiment(d);
    let run = d.join("checkpoints/slow");
    // Steps of seconds on one thread (5 s on a Zen 4), so both signals land in one.
    let slow = |resume: &[&str]| {
        let args = train_args(
            resume,
            &[
                "run.name=slow",
                "model.n_layer=6",
                "model.n_embd=384",
                "model.n_head=6",
                "model.block_size=256",
                "train.batch_size=8",
                "train.max_iters=100000",
                "train.checkpoint_interval=100000",
                "train.eval_interval=100000",
                "train.eval_iters=1",
            ],
        );
        tinygpt(d, &args)
            .env("RAYON_NUM_THREADS", "1")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let term = |child: &Child| {
        // Safety: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    };
    let stderr_of = |child: &mut Child| {
        let mut err = String::new();
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
        err
    };

    let mut child = slow(&[]);
    wait_for("step 1", &mut child, || metrics_has(&run, 1, "loss"));
    term(&child);
    term(&child);
    let (status, _) = exit_within(&mut child, Duration::from_secs(120));
    let err = stderr_of(&mut child);
    assert_eq!(status.code(), Some(143), "{err}");
    assert!(!err.contains("stopped at once"), "{err}");
    let saved = tinygpt::checkpoint::RunDir::new(&run).state().unwrap().step;
    assert_eq!(saved, 2, "the step under way finished and was saved: {err}");

    let mut child = slow(&["--resume"]);
    wait_for("step 3", &mut child, || metrics_has(&run, 3, "loss"));
    term(&child);
    std::thread::sleep(Duration::from_millis(1200));
    let step = || tinygpt::checkpoint::RunDir::new(&run).state().unwrap().step;
    assert!(
        child.try_wait().unwrap().is_none() && step() == 2,
        "step 4 ended within 1.2 s of the first signal: too fast a machine for this check"
    );
    term(&child);
    let (status, took) = exit_within(&mut child, Duration::from_secs(10));
    let err = stderr_of(&mut child);
    assert_eq!(status.code(), Some(143), "{err}");
    assert!(took < Duration::from_millis(500), "took {took:?}: {err}");
    assert!(err.contains("stopped at once by a second signal"), "{err}");
    assert_eq!(step(), 2, "nothing more written");
}

/// Whether a save is under way in `run`: a checkpoint file's temporary copy exists.
fn saving(run: &Path) -> bool {
    std::fs::read_dir(run).is_ok_and(|entries| {
        entries.flatten().any(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with(".model.safetensors.next.tmp")
                || name.starts_with(".optimizer.safetensors.next.tmp")
        })
    })
}

#[test]
fn a_stop_during_a_save_stops_at_that_save() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let args = big_checkpoints(d);
    let run = d.join("checkpoints/big");
    let state = || {
        tinygpt::checkpoint::RunDir::new(&run)
            .state()
            .map_or(0, |s| s.step)
    };
    let mut child = tinygpt(d, &args).stderr(Stdio::piped()).spawn().unwrap();
    wait_for("two checkpoints", &mut child, || state() >= 2);
    wait_for("a save under way", &mut child, || saving(&run));
    // The last step committed: the save under way is the next one's (or, if it has
    // just committed, the step being trained now is).
    let committed = state();
    let (exit, err) = signal_and_wait(child, libc::SIGTERM, Duration::from_secs(60));
    assert_eq!(exit, 143, "{err}");
    let last = state();
    assert!(
        last <= committed + 1,
        "stopped at step {last}: a step and a save past the one the signal landed in ({committed} committed before it): {err}"
    );
}

/// `tinygpt train ... | head`: the reader goes, and training stops as for a signal,
/// with its checkpoint, instead of dying unsaved on the closed pipe.
#[test]
fn a_closed_pipe_stops_training_with_its_checkpoint() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    experiment(d);
    let run = d.join("checkpoints/r");
    let long = train_args(
        &["--resume"],
        &["train.max_iters=100000", "train.eval_interval=2"],
    );
    let mut child = tinygpt(d, &long)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read a line, as `head -1` would, and go.
    let mut first = String::new();
    std::io::BufReader::new(child.stderr.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(first.contains("run "), "{first}");
    let (status, _) = exit_within(&mut child, Duration::from_secs(120));
    assert_eq!(status.code(), Some(141), "{status}");
    // Saved where it stopped, and resumable.
    let step = tinygpt::checkpoint::RunDir::new(&run).state().unwrap().step;
    assert!(step > 2, "no step saved past the first session's 2: {step}");
    let next = format!("train.max_iters={}", step + 1);
    let out = tinygpt(d, &train_args(&["--resume"], &[&next]))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
