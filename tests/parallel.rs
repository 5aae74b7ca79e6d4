//! Data-parallel training under a real MPI launcher (Open MPI's or MPICH's `mpirun`),
//! against one process: N ranks with grad_accum A train as one process with grad_accum
//! N x A (bit for bit at 2 ranks, to 1e-6 at 3, whose ZeRO shards are unequal);
//! checkpoints resume across world sizes; a killed rank, a SIGTERM and a rank that
//! cannot read its data end the job, promptly, with the checkpoint intact.
//!
//! In a build without the `mpi` feature, the launcher guard: every rank refuses in one
//! line and nothing is written.

// A build without MPI runs the guard tests alone; the helpers serve the others.
#![cfg_attr(not(feature = "mpi"), allow(dead_code, unused_macros))]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_tinygpt");

/// A corpus of pseudo-random words: enough structure to learn, enough noise that
/// losses differ from batch to batch.
fn write_corpus(dir: &Path) -> PathBuf {
    let words = [
        "the", "king", "and", "queen", "of", "rome", "said", "to", "his", "her", "lord", "good",
        "night", "sweet", "prince", "what", "is", "done", "cannot", "be", "undone",
    ];
    let mut state = 2024u64;
    let mut text = String::new();
    for i in 0..6000 {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        text.push_str(words[(state >> 33) as usize % words.len()]);
        text.push(if i % 11 == 10 { '\n' } else { ' ' });
    }
    let path = dir.join("corpus.txt");
    std::fs::write(&path, text).unwrap();
    path
}

/// A config file in `dir`: a char model of ~59k parameters (8 norm blocks: ZeRO shards
/// of 4 + 4 blocks over 2 ranks, 3 + 3 + 2 over 3), with dropout and clipping on, so
/// that masks, the global norm and the sharded update all count.
fn write_config(dir: &Path, corpus: &Path) -> PathBuf {
    let path = dir.join("dp.toml");
    let text = format!(
        r#"[run]
name = "dp"
out_dir = "{out}"
seed = 7

[data]
corpus = "{corpus}"

[tokenizer]
kind = "char"

[model]
n_layer = 2
n_head = 2
n_embd = 48
block_size = 32
dropout = 0.1

[train]
batch_size = 4
max_iters = 12
warmup_iters = 2
lr = 3e-3
grad_clip = 0.5
eval_interval = 6
eval_iters = 5
log_interval = 1
checkpoint_interval = 6
"#,
        out = dir.join("checkpoints").display(),
        corpus = corpus.display(),
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// The `mpirun` on PATH, or None (skipped loudly by the caller).
fn mpirun() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("mpirun"))
        .find(|p| p.is_file())
}

/// `mpirun -np <ranks>` with the flags a container needs (root, more ranks than cores),
/// one thread per rank (as the single process it is compared with).
fn launcher(mpirun: &Path, ranks: usize) -> Command {
    let mut cmd = Command::new(mpirun);
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-np"])
        .arg(ranks.to_string())
        .env("RAYON_NUM_THREADS", "1")
        // Open MPI's mpirun kills ranks 1 s after forwarding a signal unless told to
        // wait (docs/DATA-PARALLEL.md: what users set for a checkpoint that takes
        // longer): a step, the ranks' agreement and a save can take longer than that on
        // a loaded two-core machine running two tests' ranks at once.
        .args(["--mca", "odls_base_sigkill_timeout", "10"]);
    cmd
}

/// `tinygpt train` of `config` into `out` with `sets`, as one process.
fn single(config: &Path, out: &Path, sets: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.env("RAYON_NUM_THREADS", "1");
    train_args(&mut cmd, config, out, sets);
    cmd
}

fn train_args(cmd: &mut Command, config: &Path, out: &Path, sets: &[&str]) {
    cmd.args(["train", "--config"]).arg(config);
    cmd.arg("--set")
        .arg(format!("run.out_dir={:?}", out.display().to_string()));
    for set in sets {
        cmd.args(["--set", set]);
    }
}

/// `tinygpt train` as `ranks` ranks.
fn ranked(mpirun: &Path, ranks: usize, config: &Path, out: &Path, sets: &[&str]) -> Command {
    let mut cmd = launcher(mpirun, ranks);
    cmd.arg(BIN);
    train_args(&mut cmd, config, out, sets);
    cmd
}

/// Runs `cmd` to its end, failing the test if it takes more than `limit`.
fn run_within(cmd: &mut Command, limit: Duration) -> Output {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let id = child.id();
    let (done, waiting) = std::sync::mpsc::channel();
    std::thread::spawn(move || done.send(child.wait_with_output()));
    match waiting.recv_timeout(limit) {
        Ok(output) => output.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &id.to_string()]).status();
            panic!("{cmd:?} did not end within {limit:?}");
        }
    }
}

fn succeed(cmd: &mut Command) -> Output {
    let out = run_within(cmd, Duration::from_secs(300));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// metrics.jsonl without its timings (which differ from run to run), line by line.
fn curve(run: &Path) -> Vec<BTreeMap<String, serde_json::Value>> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|line| {
            let mut m: BTreeMap<String, serde_json::Value> = serde_json::from_str(line).unwrap();
            m.remove("elapsed_s");
            m.remove("tokens_per_s");
            m
        })
        .collect()
}

fn sha256(path: &Path) -> String {
    use sha2::Digest;
    format!("{:x}", sha2::Sha256::digest(std::fs::read(path).unwrap()))
}

/// Every number of two curves within `rel` of each other (relative), same steps; what
/// is not a number (a resume's record of what it changed) the same.
fn assert_close(
    a: &[BTreeMap<String, serde_json::Value>],
    b: &[BTreeMap<String, serde_json::Value>],
    rel: f64,
) {
    assert_eq!(a.len(), b.len(), "as many metrics lines");
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.keys().collect::<Vec<_>>(), y.keys().collect::<Vec<_>>());
        for (key, vx) in x {
            let (Some(fx), Some(fy)) = (vx.as_f64(), y[key].as_f64()) else {
                assert_eq!(vx, &y[key], "{key} at step {}", x["step"]);
                continue;
            };
            assert!(
                (fx - fy).abs() <= rel * fx.abs().max(1e-12),
                "{key} at step {}: {fx} vs {fy}",
                x["step"]
            );
        }
    }
}

/// Weights of two checkpoints within `rel` of the model's largest weight.
fn assert_weights_close(a: &Path, b: &Path, rel: f32) {
    let read = |p: &Path| -> BTreeMap<String, Vec<f32>> {
        candle_core::safetensors::load(p.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap()
            .into_iter()
            .map(|(name, t)| (name, t.flatten_all().unwrap().to_vec1().unwrap()))
            .collect()
    };
    let (wa, wb) = (read(a), read(b));
    assert_eq!(wa.keys().collect::<Vec<_>>(), wb.keys().collect::<Vec<_>>());
    let largest = wa.values().flatten().fold(0f32, |m, v| m.max(v.abs()));
    for (name, x) in &wa {
        for (u, v) in x.iter().zip(&wb[name]) {
            assert!((u - v).abs() <= rel * largest, "{name}: {u} vs {v}");
        }
    }
}

macro_rules! need_mpirun {
    () => {
        match mpirun() {
            Some(m) => m,
            None => {
                eprintln!("SKIPPED: no mpirun on PATH (install openmpi-bin)");
                return;
            }
        }
    };
}

#[cfg(feature = "mpi")]
#[test]
fn two_ranks_train_bit_for_bit_as_one_process_with_grad_accum_2() {
    let mpirun = need_mpirun!();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &write_corpus(dir.path()));
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));
    succeed(&mut single(&config, &one, &["train.grad_accum=2"]));
    let out = succeed(&mut ranked(&mpirun, 2, &config, &two, &[]));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("x 2 ranks") && said.contains("ZeRO-1"),
        "{said}"
    );
    assert_eq!(
        said.matches("run ").count(),
        1,
        "rank 0 alone reports: {said}"
    );

    let (one, two) = (one.join("dp"), two.join("dp"));
    assert_eq!(curve(&one), curve(&two), "every logged loss, norm and eval");
    for file in ["model.safetensors", "optimizer.safetensors"] {
        assert_eq!(sha256(&one.join(file)), sha256(&two.join(file)), "{file}");
    }
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(two.join("state.json")).unwrap()).unwrap();
    assert_eq!(state["ranks"], 2);
    assert_eq!(state["sequences_per_step"], 8);

    // `compare` names the process count among what differs, as a setting would be:
    // the two runs' configs differ only in grad_accum.
    let out = succeed(
        Command::new(BIN)
            .args(["compare", "--json"])
            .arg(&one)
            .arg(&two),
    );
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let differs = |i: usize| rows[i]["differs"].clone();
    assert_eq!(differs(0), serde_json::json!(["ranks=1", "grad_accum=2"]));
    assert_eq!(differs(1), serde_json::json!(["ranks=2", "grad_accum=1"]));
}

#[cfg(feature = "mpi")]
#[test]
fn three_ranks_with_unequal_shards_follow_one_process_with_grad_accum_3() {
    let mpirun = need_mpirun!();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &write_corpus(dir.path()));
    let (one, three) = (dir.path().join("one"), dir.path().join("three"));
    succeed(&mut single(&config, &one, &["train.grad_accum=3"]));
    succeed(&mut ranked(&mpirun, 3, &config, &three, &[]));
    let (one, three) = (one.join("dp"), three.join("dp"));
    assert_close(&curve(&one), &curve(&three), 1e-6);
    assert_weights_close(&one, &three, 1e-6);
}

#[cfg(feature = "mpi")]
#[test]
fn checkpoints_resume_across_world_sizes() {
    let mpirun = need_mpirun!();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &write_corpus(dir.path()));
    let (mixed, alone) = (dir.path().join("mixed"), dir.path().join("alone"));
    // Steps 0-6 on 2 ranks, 6-12 resumed in one process: as one process throughout.
    succeed(&mut ranked(
        &mpirun,
        2,
        &config,
        &mixed,
        &["train.max_iters=6"],
    ));
    let resumed = succeed(single(&config, &mixed, &["train.grad_accum=2"]).arg("--resume"));
    assert!(!String::from_utf8_lossy(&resumed.stderr).contains("note: a step was"));
    succeed(&mut single(
        &config,
        &alone,
        &["train.grad_accum=2", "train.max_iters=6"],
    ));
    succeed(single(&config, &alone, &["train.grad_accum=2"]).arg("--resume"));
    assert_eq!(curve(&mixed.join("dp")), curve(&alone.join("dp")));
    let model = |d: &Path| sha256(&d.join("dp/model.safetensors"));
    assert_eq!(model(&mixed), model(&alone));

    // Steps 12-18 on 3 ranks from the one-process checkpoint, against one process
    // with grad_accum 3 from the same checkpoint.
    copy_dir(&mixed, &alone);
    let steps = ["train.max_iters=18"];
    let on_three = succeed(ranked(&mpirun, 3, &config, &mixed, &steps).arg("--resume"));
    let said = String::from_utf8_lossy(&on_three.stderr);
    assert!(
        said.contains("note: a step was 8 sequences (1 rank) and is now 12")
            && said.contains("no train.batch_size x train.grad_accum on 3 ranks makes 8 sequences"),
        "{said}"
    );
    succeed(
        single(
            &config,
            &alone,
            &["train.max_iters=18", "train.grad_accum=3"],
        )
        .arg("--resume"),
    );
    let (a, b) = (curve(&mixed.join("dp")), curve(&alone.join("dp")));
    assert_eq!(a.len(), b.len());
    assert_eq!(a.last().unwrap()["step"], 18);
    assert_close(&a, &b, 1e-6);
    assert_weights_close(&mixed.join("dp"), &alone.join("dp"), 1e-6);
}

/// The fused CUDA engine's ranks under the CPU emulator (its device memory is host
/// memory, so its blocks travel through MPI as a CUDA build without NCCL's do): 2 and 3
/// ranks (the third's block empty) follow one emulated process with grad_accum 2 and 3.
#[cfg(all(feature = "mpi", feature = "cuda-emulator"))]
#[test]
fn the_emulated_cuda_engine_trains_as_ranks() {
    let mpirun = need_mpirun!();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &write_corpus(dir.path()));
    // ~27k parameters: 4 norm blocks, 2 + 2 over 2 ranks, 2 + 2 + 0 over 3.
    let small = [
        "model.n_embd=32",
        "model.block_size=16",
        "train.max_iters=6",
        "train.eval_iters=3",
    ];
    for ranks in [2, 3] {
        let (one, many) = (
            dir.path().join(format!("one-{ranks}")),
            dir.path().join(format!("many-{ranks}")),
        );
        let accum = format!("train.grad_accum={ranks}");
        let sets: Vec<&str> = small.iter().copied().chain([accum.as_str()]).collect();
        succeed(single(&config, &one, &sets).env("TINYGPT_EMULATE_CUDA", "1"));
        let out = succeed(
            ranked(&mpirun, ranks, &config, &many, &small).env("TINYGPT_EMULATE_CUDA", "1"),
        );
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(
            said.contains("fused CUDA kernels") && said.contains("ZeRO-1"),
            "{said}"
        );
        let (one, many) = (one.join("dp"), many.join("dp"));
        assert_close(&curve(&one), &curve(&many), 1e-6);
        assert_weights_close(&one, &many, 1e-6);
    }
}

fn copy_dir(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// The pid of `rank` of the job training into `out` (from /proc: its command line and
/// the rank Open MPI or PMI gave it).
#[cfg(target_os = "linux")]
fn rank_pid(out: &Path, rank: usize) -> Option<u32> {
    let marker = out.display().to_string();
    let wanted = [
        format!("OMPI_COMM_WORLD_RANK={rank}"),
        format!("PMI_RANK={rank}"),
    ];
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline);
            if !cmdline.starts_with(BIN) || !cmdline.contains(&marker) {
                return None;
            }
            let environ = std::fs::read(entry.path().join("environ")).ok()?;
            let environ = String::from_utf8_lossy(&environ);
            environ
                .split('\0')
                .any(|var| wanted.iter().any(|w| var == w))
                .then_some(pid)
        })
}

/// Starts a long run of `ranks` ranks into `out`, and returns once it has trained a few
/// steps (and written a checkpoint).
#[cfg(target_os = "linux")]
fn start_long_run(
    mpirun: &Path,
    ranks: usize,
    config: &Path,
    out: &Path,
    flags: &[&str],
) -> std::process::Child {
    let sets = [
        "train.max_iters=1000000",
        "train.checkpoint_interval=5",
        "train.eval_interval=1000",
        "model.dropout=0",
    ];
    let child = ranked(mpirun, ranks, config, out, &sets)
        .args(flags)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    let state = out.join("dp/state.json");
    while !state.exists() || rank_pid(out, ranks - 1).is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the run never checkpointed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    child
}

#[cfg(target_os = "linux")]
fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .args([name, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// Waits for `child`, failing the test after `limit`; its exit code and stderr.
#[cfg(target_os = "linux")]
fn wait_within(child: std::process::Child, limit: Duration) -> (Option<i32>, String) {
    let id = child.id();
    let (done, waiting) = std::sync::mpsc::channel();
    std::thread::spawn(move || done.send(child.wait_with_output()));
    match waiting.recv_timeout(limit) {
        Ok(output) => {
            let output = output.unwrap();
            (
                output.status.code(),
                String::from_utf8_lossy(&output.stderr).into_owned(),
            )
        }
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &id.to_string()]).status();
            panic!("the job did not end within {limit:?}");
        }
    }
}

#[cfg(all(feature = "mpi", target_os = "linux"))]
#[test]
fn a_killed_rank_ends_the_job_and_the_checkpoint_stands() {
    let mpirun = need_mpirun!();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &write_corpus(dir.path()));
    let out = dir.path().join("killed");
    let child = start_long_run(&mpirun, 2, &config, &out, &[]);
    signal(rank_pid(&out, 1).unwrap(), "-KILL");
    let killed = std::time::Instant::now();
    let (code, said) = wait_within(child, Duration::from_secs(30));
    assert!(killed.elapsed() < Duration::from_secs(30));
    assert_ne!(code, Some(0), "{said}");
    assert!(said.contains("rank 1"), "the lost rank is named: {said}");
    assert!(rank_pid(&out, 0).is_none(), "no rank outlives the job");
    // The last checkpoint loads, and training continues from it in one process.
    let info = succeed(
        Command::new(BIN)
            .args(["info", "--checkpoint"])
            .arg(out.join("dp")),
    );
    assert!(info.status.success());
    let step = |state: &str| -> u64 {
        serde_json::from_str::<serde_json::Value>(state).unwrap()["step"]
            .as_u64()
            .unwrap()
    };
    let saved = step(&std::fs::read_to_string(out.join("dp/state.json")).unwrap());
    let more = format!("train.max_iters={}", saved + 2);
    succeed(
        single(
            &config,
            &out,
            &[&more, "model.dropout=0", "train.grad_accum=2"],
        )
        .arg("--resume"),
    );
}

/// A rank that stops answering (SIGSTOP: alive, so the launcher sees nothing wrong)
/// ends the job once another has waited --collective-timeout for it in a collective:
/// that rank's one line, exit 4, and no rank outlives the job.
#[cfg(all(feature = "mpi", target_os = "linux"))]
#[test]
fn a_silent_rank_ends_the_job_after_the_collective_timeout() {
    let mpirun = need_mpirun!();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &write_corpus(dir.path()));
    let out = dir.path().join("silent");
    let child = start_long_run(&mpirun, 2, &config, &out, &["--collective-timeout", "5"]);
    let silent = rank_pid(&out, 1).unwrap();
    signal(silent, "-STOP");
    let stopped = std::time::Instant::now();
    let (code, said) = wait_within(child, Duration::from_secs(60));
    // Whatever happened, no stopped process is left behind.
    if rank_pid(&out, 1).is_some() {
        let _ = Command::new("kill")
            .args(["-9", &silent.to_string()])
            .status();
    }
    assert!(stopped.elapsed() >= Duration::from_secs(5), "{said}");
    assert_eq!(code, Some(4), "{said}");
    let waited: f64 = said
        .split("rank 0: error: waited ")
        .nth(1)
        .and_then(|rest| rest.split(" s for the other ranks").next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{said}"));
    assert!(waited >= 5.0, "{said}");
    assert!(said.contains("--collective-timeout"), "{said}");
    assert!(rank_pid(&out, 0).is_none(), "no rank outlives the job");
    assert!(rank_pid(&out, 1).is_none(), "no rank outlives the job");
}

#[cfg(all(feature = "mpi", target_os = "linux"))]
#[test]
fn sigterm_stops_every_rank_at_the_same_step() {
    let mpirun = need_mpirun!();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &write_corpus(dir.path()));

    // To the launcher, which forwards it to every rank.
    let out = dir.path().join("launcher");
    let child = start_long_run(&mpirun, 2, &config, &out, &[]);
    signal(child.id(), "-TERM");
    let (code, said) = wait_within(child, Duration::from_secs(60));
    assert_ne!(code, Some(0), "{said}");
    let (step0, step1) = stopped_steps(&said);
    assert_eq!(step0, step1, "{said}");
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("dp/state.json")).unwrap()).unwrap();
    assert_eq!(
        state["step"], step0,
        "rank 0 saved the step they stopped at"
    );

    // To one rank alone (a signal that reached one node): the others stop with it,
    // every rank exits 143, and so does the job.
    let out = dir.path().join("one-rank");
    let child = start_long_run(&mpirun, 2, &config, &out, &[]);
    signal(rank_pid(&out, 1).unwrap(), "-TERM");
    let (code, said) = wait_within(child, Duration::from_secs(60));
    assert_eq!(code, Some(143), "{said}");
    let (step0, step1) = stopped_steps(&said);
    assert_eq!(step0, step1, "{said}");
}

/// The steps rank 0 and rank 1 said they were interrupted at, from a two-rank job's
/// stderr. The launcher forwards each rank's stderr in whatever pieces it reads, so rank
/// 1's line can land inside one of rank 0's (seen: "chec" + rank 1's line + "kpoint:
/// ..."): rank 1's line is taken out wherever it is, then rank 0's lines are read.
#[cfg(all(feature = "mpi", target_os = "linux"))]
fn stopped_steps(said: &str) -> (u64, u64) {
    let step_after = |text: &str| -> Option<u64> {
        text.split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse()
            .ok()
    };
    let rank1 = "rank 1: interrupted at step ";
    let at = said.find(rank1).expect(said);
    let step1 = step_after(&said[at + rank1.len()..]).expect(said);
    let rank0_said = said.replacen(&format!("{rank1}{step1}\n"), "", 1);
    let prefix = "interrupted at step ";
    let line0 = rank0_said
        .lines()
        .find(|l| l.starts_with(prefix))
        .expect(said);
    (step_after(&line0[prefix.len()..]).expect(said), step1)
}

/// An MPMD launch of two single ranks: rank 0 in `wdir[0]` with `sets[0]`, rank 1 in
/// `wdir[1]` with `sets[1]` (what differing nodes, or a launch that gives each rank its
/// own arguments, amount to).
fn two_ranks_each_their_own(
    mpirun: &Path,
    config: &Path,
    out: &Path,
    wdir: [&Path; 2],
    sets: [&[&str]; 2],
) -> Command {
    let mut cmd = launcher(mpirun, 1);
    cmd.arg("-wdir").arg(wdir[0]).arg(BIN);
    train_args(&mut cmd, config, out, sets[0]);
    cmd.args([":", "-np", "1", "-wdir"]).arg(wdir[1]).arg(BIN);
    train_args(&mut cmd, config, out, sets[1]);
    cmd
}

/// The job's one error line: rank 1's, starting with `rank 1: error:`, containing each
/// of `needles`; exit 2 within a minute; the run folder left as it was.
fn fails_on_rank_1(mut cmd: Command, out: &Path, needles: &[&str]) {
    let output = run_within(&mut cmd, Duration::from_secs(60));
    let said = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{said}");
    let errors: Vec<&str> = said.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(errors.len(), 1, "one error line: {said}");
    assert!(errors[0].starts_with("rank 1: error:"), "{said}");
    for needle in needles {
        assert!(errors[0].contains(needle), "{needle}: {said}");
    }
    assert!(
        !out.join("dp/train.lock").exists() && !out.join("dp/model.safetensors").exists(),
        "rank 0 let go of the run folder, nothing trained"
    );
}

#[cfg(feature = "mpi")]
#[test]
fn a_rank_that_cannot_read_its_data_takes_the_job_down_with_its_message() {
    let mpirun = need_mpirun!();
    let dir = tempfile::tempdir().unwrap();
    let corpus = write_corpus(dir.path());
    let config = write_config(dir.path(), &corpus);
    let out = dir.path().join("broken");
    // One config naming the corpus by a relative path; rank 1's node (working
    // directory) does not have it.
    let elsewhere = dir.path().join("node-1");
    std::fs::create_dir(&elsewhere).unwrap();
    let relative: &[&str] = &["data.corpus=\"corpus.txt\""];
    let cmd = two_ranks_each_their_own(
        &mpirun,
        &config,
        &out,
        [dir.path(), &elsewhere],
        [relative, relative],
    );
    fails_on_rank_1(cmd, &out, &["corpus.txt"]);
}

/// Ranks given different settings would exchange buffers of different sizes (a heap
/// corrupted, an MPI truncation), or wait in collectives the others never reach
/// (forever), or train what nobody asked for; a corpus that differs between nodes
/// under one path, the same. Refused before anything is trained, naming the setting.
#[cfg(feature = "mpi")]
#[test]
fn ranks_given_different_configs_or_corpora_are_refused() {
    let mpirun = need_mpirun!();
    let dir = tempfile::tempdir().unwrap();
    let corpus = write_corpus(dir.path());
    let config = write_config(dir.path(), &corpus);
    let out = dir.path().join("mixed");
    for (other, says) in [
        ("model.n_embd=64", "model.n_embd = 64 (rank 0 has 48)"),
        ("train.max_iters=13", "train.max_iters = 13 (rank 0 has 12)"),
        ("train.lr=0.001", "train.lr = 0.001 (rank 0 has 0.003)"),
    ] {
        let cmd = two_ranks_each_their_own(
            &mpirun,
            &config,
            &out,
            [dir.path(), dir.path()],
            [&[], &[other]],
        );
        fails_on_rank_1(cmd, &out, &["the config differs from rank 0's", says]);
    }
    // One relative path, another text on each node.
    let elsewhere = dir.path().join("node-1");
    std::fs::create_dir(&elsewhere).unwrap();
    let text = std::fs::read_to_string(&corpus).unwrap();
    std::fs::write(elsewhere.join("corpus.txt"), text.replace("king", "kong")).unwrap();
    let relative: &[&str] = &["data.corpus=\"corpus.txt\""];
    let cmd = two_ranks_each_their_own(
        &mpirun,
        &config,
        &out,
        [dir.path(), &elsewhere],
        [relative, relative],
    );
    fails_on_rank_1(cmd, &out, &["the data differs from rank 0's"]);
}

/// torchrun (or an srun without an MPI plugin) starts processes that MPI does not
/// join: each would train alone into the one run folder.
#[cfg(feature = "mpi")]
#[test]
fn processes_a_launcher_started_that_mpi_does_not_join_refuse() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &write_corpus(dir.path()));
    let out = dir.path().join("refused");
    let output = single(&config, &out, &[])
        .env("WORLD_SIZE", "2")
        .env("RANK", "1")
        .env("LOCAL_RANK", "1")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{said}");
    assert_eq!(said.lines().count(), 1, "{said}");
    assert!(
        said.contains("torchrun started 2 processes, but MPI sees this one alone")
            && said.contains("mpirun -np N"),
        "{said}"
    );
    assert!(!out.exists(), "nothing written");
}

#[cfg(not(feature = "mpi"))]
#[test]
fn a_build_without_mpi_refuses_to_run_as_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &write_corpus(dir.path()));
    let out = dir.path().join("refused");
    // The environment Open MPI's mpirun gives rank 1 of 4.
    let output = single(&config, &out, &[])
        .env("OMPI_COMM_WORLD_SIZE", "4")
        .env("OMPI_COMM_WORLD_RANK", "1")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{said}");
    assert_eq!(said.lines().count(), 1, "{said}");
    assert!(
        said.contains("rank 1 of 4") && said.contains("--features mpi"),
        "{said}"
    );
    assert!(!out.exists(), "nothing written");

    // And under a real launcher, where there is one.
    if let Some(mpirun) = mpirun() {
        let output = run_within(
            &mut ranked(&mpirun, 2, &config, &out, &[]),
            Duration::from_secs(60),
        );
        let said = String::from_utf8_lossy(&output.stderr);
        assert_ne!(output.status.code(), Some(0), "{said}");
        assert!(said.contains("--features mpi"), "{said}");
        assert!(!out.exists(), "nothing written");
    } else {
        eprintln!("SKIPPED the guard under mpirun: no mpirun on PATH");
    }
}

#[test]
fn other_commands_refuse_to_run_as_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let output = Command::new(BIN)
        .args(["info", "--checkpoint"])
        .arg(dir.path())
        .env("PMI_SIZE", "2")
        .env("PMI_RANK", "0")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{said}");
    assert!(
        said.contains("only `tinygpt train` runs as several ranks"),
        "{said}"
    );
}
