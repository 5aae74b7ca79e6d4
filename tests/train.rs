//! Training end to end on small generated corpora: every parameter learns, a tiny model
//! overfits a tiny corpus, the same seed gives the same curve, and resume continues it
//! exactly. Overfitting, exact resume and fused-vs-reference curves run on every device
//! of `devices()`: the CPU, and CUDA in a `cuda` build on a machine with a GPU (skipped
//! loudly otherwise).

use std::path::Path;

use candle_core::Device;
use tinygpt::config::{Config, PositionKind, Precision, TokenizerKind};
use tinygpt::data::Batch;
use tinygpt::engine;
use tinygpt::model::ModelSpec;
use tinygpt::optim::AdamWStep;
use tinygpt::train::{Measured, Reporter, Silent, StepLog, Trainer};

mod common;
use common::Losses;

/// A corpus with structure: a fixed pseudo-random "sentence" of 48 characters repeated.
fn write_corpus(dir: &Path, repeats: usize) -> std::path::PathBuf {
    let alphabet: Vec<char> = "abcdefghij klmnop,.\n".chars().collect();
    let mut state = 12345u64;
    let sentence: String = (0..48)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            alphabet[(state >> 33) as usize % alphabet.len()]
        })
        .collect();
    let path = dir.join("corpus.txt");
    std::fs::write(&path, sentence.repeat(repeats)).unwrap();
    path
}

fn config(dir: &Path, corpus: &Path) -> Config {
    let mut c = Config::default();
    c.run.name = "run".into();
    c.run.out_dir = dir.join("checkpoints");
    c.data.corpus = corpus.to_path_buf();
    c.tokenizer.kind = TokenizerKind::Char;
    c.model.n_layer = 2;
    c.model.n_head = 2;
    c.model.n_embd = 32;
    c.model.block_size = 16;
    c.train.batch_size = 8;
    c.train.max_iters = 20;
    c.train.warmup_iters = 2;
    c.train.eval_interval = 10;
    c.train.eval_iters = 2;
    c.train.log_interval = 1;
    c.train.checkpoint_interval = 10;
    c
}

/// `run.device` values to train on: the CPU, and CUDA where the build and the machine
/// have it.
fn devices() -> Vec<&'static str> {
    let mut devices = vec!["cpu"];
    if cfg!(feature = "cuda") {
        match Device::new_cuda(0) {
            Ok(_) => devices.push("cuda"),
            Err(e) => eprintln!("SKIPPED on CUDA (no CUDA device: {e}); trained on the CPU only"),
        }
    }
    devices
}

/// In both engines and for every position kind: every parameter gets a finite,
/// non-zero gradient, and moves in an optimiser step.
#[test]
fn every_parameter_gets_a_gradient_and_moves() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = write_corpus(dir.path(), 20);
    for positions in [
        PositionKind::Learned,
        PositionKind::Rope,
        PositionKind::Sinusoidal,
    ] {
        for fused in [true, false] {
            let mut cfg = config(dir.path(), &corpus);
            cfg.model.positions = positions;
            cfg.model.bias = true;
            cfg.model.n_kv_head = Some(1);
            cfg.model.vocab_size = 11;
            cfg.train.batch_size = 1;
            cfg.train.fused = fused;
            let what = format!("{positions:?} fused={fused}");
            let options = tinygpt::train::engine_options(&cfg.train);
            let spec = ModelSpec::new(&cfg.model);
            let weights = spec.initial_values(5);
            let mut engine = engine::build(&spec, &weights, &Device::Cpu, options).unwrap();
            let batch = Batch {
                x: vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6],
                y: vec![2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7],
                batch: 1,
                block: 16,
            };
            let before = engine.weights().unwrap();
            engine.zero_grads().unwrap();
            engine.forward(&batch, None).unwrap();
            engine.backward(1.0).unwrap();
            for (name, g) in engine.grads().unwrap() {
                let values = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert!(
                    values.iter().all(|v| v.is_finite()),
                    "{what}: {name}: not finite"
                );
                assert!(values.iter().any(|v| *v != 0.0), "{what}: {name}: all zero");
            }
            engine.adamw(&AdamWStep::new(&cfg.train, 1, 1e-3)).unwrap();
            for (name, new) in engine.weights().unwrap() {
                let new: Vec<f32> = new.flatten_all().unwrap().to_vec1().unwrap();
                let old: Vec<f32> = before[&name].flatten_all().unwrap().to_vec1().unwrap();
                assert_ne!(
                    new, old,
                    "{what}: {name} did not change in an optimiser step"
                );
            }
        }
    }
}

#[test]
fn tiny_model_overfits_a_tiny_corpus() {
    for device in devices() {
        tiny_model_overfits_a_tiny_corpus_on(device);
    }
}

fn tiny_model_overfits_a_tiny_corpus_on(device: &str) {
    let dir = tempfile::tempdir().unwrap();
    let corpus = write_corpus(dir.path(), 30);
    let mut cfg = config(dir.path(), &corpus);
    cfg.run.device = device.into();
    cfg.train.max_iters = 300;
    cfg.train.lr = 3e-3;
    cfg.train.min_lr = 3e-4;
    cfg.train.warmup_iters = 20;
    cfg.train.weight_decay = 0.0;
    cfg.train.eval_interval = 100;
    cfg.train.checkpoint_interval = 1000;
    let mut losses = Losses::default();
    let summary = tinygpt::train::train(cfg, false, &mut losses).unwrap();
    let first = losses.0[0].1;
    let last = losses.0.last().unwrap().1; // the training loss of the last step
    assert!(first > 2.5, "{device}: starts near ln(vocab): {first}");
    assert!(last < 0.1, "{device}: loss after 300 steps: {last}");
    let val = summary.val_loss.unwrap();
    // The first characters of a window have too little context to be certain.
    assert!(
        val < 0.25,
        "{device}: the val text repeats the same sentence: {val}"
    );
}

/// Collects every step's reading, or its absence.
#[derive(Default)]
struct Readings(Vec<(usize, Option<Measured>)>);
impl Reporter for Readings {
    fn step(&mut self, log: &StepLog) {
        self.0.push((log.step, log.measured));
    }
}

/// The trainer reads the engine (which waits for a GPU) only where a step is
/// reported: log, evaluation and checkpoint steps and the end. A reading covers the
/// steps since the last one: their mean loss is the mean of the per-step losses of
/// the same run read every step, and metrics.jsonl has one line per reading.
#[test]
fn a_reading_covers_the_steps_since_the_last() {
    for device in devices() {
        let dir = tempfile::tempdir().unwrap();
        let corpus = write_corpus(dir.path(), 20);
        let mut every_cfg = config(dir.path(), &corpus);
        every_cfg.run.device = device.into();
        every_cfg.run.name = "every".into();
        let mut every = Losses::default();
        tinygpt::train::train(every_cfg.clone(), false, &mut every).unwrap();
        assert_eq!(
            every.0.len(),
            20,
            "{device}: log_interval 1 reads every step"
        );

        let mut sparse_cfg = every_cfg;
        sparse_cfg.run.name = "sparse".into();
        sparse_cfg.train.log_interval = 4;
        sparse_cfg.train.eval_interval = 10;
        sparse_cfg.train.checkpoint_interval = 6;
        let mut sparse = Readings::default();
        let summary = tinygpt::train::train(sparse_cfg, false, &mut sparse).unwrap();
        let read: Vec<(usize, Measured)> = sparse
            .0
            .iter()
            .filter_map(|&(step, m)| m.map(|m| (step, m)))
            .collect();
        let steps: Vec<usize> = read.iter().map(|r| r.0).collect();
        assert_eq!(steps, [4, 6, 8, 10, 12, 16, 18, 20], "{device}");
        assert_eq!(sparse.0.len(), 20, "every step is reported");
        let mut first = 1;
        for &(step, m) in &read {
            assert_eq!(m.steps, step + 1 - first, "{device} at {step}");
            let window = &every.0[first - 1..step];
            let mean = window.iter().map(|l| l.1).sum::<f64>() / window.len() as f64;
            assert!(
                (m.loss - mean).abs() <= 1e-9 * mean,
                "{device} at {step}: {} vs the mean {mean} of steps {first}..={step}",
                m.loss
            );
            assert!(m.grad_norm.is_finite() && m.grad_norm > 0.0);
            assert!(m.tokens_per_s > 0.0);
            first = step + 1;
        }
        let run = tinygpt::checkpoint::RunDir::new(&summary.run_dir);
        let metrics = std::fs::read_to_string(run.file("metrics.jsonl")).unwrap();
        let logged: Vec<u64> = metrics
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|l| l.get("loss").is_some())
            .map(|l| l["step"].as_u64().unwrap())
            .collect();
        assert_eq!(logged, [4, 6, 8, 10, 12, 16, 18, 20], "{device}");
    }
}

#[test]
fn same_seed_same_curve_other_seed_other_curve() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = write_corpus(dir.path(), 20);
    let run = |name: &str, seed: u64| -> Vec<(usize, f64)> {
        let mut cfg = config(dir.path(), &corpus);
        cfg.run.name = name.into();
        cfg.run.seed = seed;
        cfg.model.dropout = 0.1;
        let mut losses = Losses::default();
        tinygpt::train::train(cfg, false, &mut losses).unwrap();
        losses.0
    };
    let a = run("a", 1);
    let b = run("b", 1);
    let c = run("c", 2);
    assert_eq!(a.len(), 20);
    assert_eq!(a, b);
    assert_ne!(a, c);
}

#[test]
fn resume_continues_the_same_curve() {
    // With and without dropout (its stream position is saved too), and in bf16.
    for device in devices() {
        for (dropout, dtype) in [
            (0.1, Precision::F32),
            (0.0, Precision::F32),
            (0.0, Precision::Bf16),
        ] {
            resume_continues_the_same_curve_with(device, dropout, dtype);
        }
    }
}

fn resume_continues_the_same_curve_with(device: &str, dropout: f64, dtype: Precision) {
    let dir = tempfile::tempdir().unwrap();
    let corpus = write_corpus(dir.path(), 20);
    let mut straight_cfg = config(dir.path(), &corpus);
    straight_cfg.run.device = device.into();
    straight_cfg.run.name = "straight".into();
    straight_cfg.model.dropout = dropout;
    straight_cfg.train.dtype = dtype;
    straight_cfg.train.grad_accum = 2;
    // The schedule must not depend on where the first part stops.
    straight_cfg.train.lr_decay_iters = Some(20);
    let mut straight = Losses::default();
    tinygpt::train::train(straight_cfg.clone(), false, &mut straight).unwrap();

    let mut first_cfg = straight_cfg.clone();
    first_cfg.run.name = "interrupted".into();
    first_cfg.train.max_iters = 8; // stops (and checkpoints) at step 8
    let mut first = Losses::default();
    tinygpt::train::train(first_cfg.clone(), false, &mut first).unwrap();

    // The same run folder, continued to 20 steps.
    let mut second_cfg = first_cfg.clone();
    second_cfg.train.max_iters = 20;
    let mut second = Losses::default();
    tinygpt::train::train(second_cfg, true, &mut second).unwrap();

    let mut resumed = first.0.clone();
    resumed.extend(second.0);
    assert_eq!(
        resumed.iter().map(|s| s.0).collect::<Vec<_>>(),
        (1..=20).collect::<Vec<_>>()
    );
    assert_eq!(
        &resumed[..8],
        &straight.0[..8],
        "the first 8 steps match already"
    );
    assert_eq!(
        resumed, straight.0,
        "{device}: resumed run must follow the uninterrupted curve exactly"
    );
}

/// The fused kernels and the reference model train along the same curve (not bit for
/// bit: float sums run in another order), on each device.
#[test]
fn fused_and_reference_paths_follow_the_same_curve() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = write_corpus(dir.path(), 20);
    for (device, dropout) in devices().into_iter().flat_map(|d| [(d, 0.0), (d, 0.1)]) {
        let mut curves = Vec::new();
        for (name, fused) in [("fused", true), ("reference", false)] {
            let mut cfg = config(dir.path(), &corpus);
            cfg.run.name = format!("{name}-{device}-{dropout}");
            cfg.run.device = device.into();
            cfg.model.dropout = dropout;
            cfg.train.fused = fused;
            cfg.train.max_iters = 40;
            let trainer = Trainer::new(cfg.clone(), false).unwrap();
            assert_eq!(trainer.engine_name().starts_with("fused"), fused);
            drop(trainer);
            let mut losses = Losses::default();
            tinygpt::train::train(cfg, false, &mut losses).unwrap();
            curves.push(losses.0);
        }
        for (f, r) in curves[0].iter().zip(&curves[1]) {
            assert_eq!(f.0, r.0);
            assert!(
                (f.1 - r.1).abs() < 1e-4 * r.1,
                "{device} dropout {dropout} step {}: fused {} vs reference {}",
                f.0,
                f.1,
                r.1
            );
        }
    }
}

#[test]
fn new_run_refuses_to_overwrite_and_resume_needs_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = write_corpus(dir.path(), 20);
    let mut cfg = config(dir.path(), &corpus);
    cfg.train.max_iters = 2;
    let err = Trainer::new(cfg.clone(), true).err().unwrap();
    assert!(format!("{err}").contains("no checkpoint"), "{err}");
    tinygpt::train::train(cfg.clone(), false, &mut Silent).unwrap();
    let err = Trainer::new(cfg.clone(), false).err().unwrap();
    assert!(format!("{err}").contains("--resume"), "{err}");
    let mut other = cfg.clone();
    other.model.n_layer = 3;
    let err = Trainer::new(other, true).err().unwrap();
    assert!(format!("{err}").contains("[model]"), "{err}");
}

#[test]
fn checkpoint_folder_has_every_file_and_loads() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = write_corpus(dir.path(), 20);
    let cfg = config(dir.path(), &corpus);
    let summary = tinygpt::train::train(cfg, false, &mut Silent).unwrap();
    let run = tinygpt::checkpoint::RunDir::new(&summary.run_dir);
    for f in [
        "config.toml",
        "tokenizer.json",
        "model.safetensors",
        "optimizer.safetensors",
        "state.json",
        "metrics.jsonl",
    ] {
        assert!(run.file(f).is_file(), "{f} missing");
    }
    let state = run.state().unwrap();
    assert_eq!(state.step, 20);
    let config = run.load_config(&state).unwrap();
    assert_eq!(
        config.model.vocab_size,
        run.load_tokenizer(&state).unwrap().vocab_size()
    );
    let weights = run
        .load_tensors(&state, "model.safetensors", &candle_core::Device::Cpu)
        .unwrap();
    assert!(weights.contains_key("wte.weight") && weights.contains_key("h.1.mlp.c_proj.weight"));
    // metrics: one line per step, plus evals at 0, 10, 20.
    let metrics = std::fs::read_to_string(run.file("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.iter().filter(|l| l.get("loss").is_some()).count(), 20);
    assert_eq!(
        lines.iter().filter(|l| l.get("val_loss").is_some()).count(),
        3
    );

    // A corrupted weight file is caught by its hash.
    let path = run.file("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 0xff;
    std::fs::write(&path, bytes).unwrap();
    let err = run
        .load_tensors(&state, "model.safetensors", &candle_core::Device::Cpu)
        .unwrap_err();
    assert!(format!("{err}").contains("sha256"), "{err}");
}
