//! The trainer driving the fused CUDA engine under the CPU emulator (feature
//! `cuda-emulator`, `TINYGPT_EMULATE_CUDA=1`): the run says which engine it has, learns,
//! and a resumed run follows the uninterrupted curve exactly, with dropout, as the GPU
//! must (its adds run in a fixed order). Every test in this file sets the same switch,
//! so they may share the process.

use std::path::Path;

use tinygpt::config::{Config, TokenizerKind};
use tinygpt::train::Trainer;

mod common;
use common::Losses;

fn emulated() -> bool {
    if !cfg!(feature = "cuda-emulator") {
        eprintln!(
            "SKIPPED: training on the emulated CUDA engine (build with --features cuda-emulator)"
        );
        return false;
    }
    std::env::set_var("TINYGPT_EMULATE_CUDA", "1");
    true
}

fn config(dir: &Path) -> Config {
    let corpus = dir.join("corpus.txt");
    std::fs::write(
        &corpus,
        "the cat sat on the mat. the dog sat on the log. ".repeat(40),
    )
    .unwrap();
    let mut c = Config::default();
    c.run.name = "run".into();
    c.run.out_dir = dir.join("checkpoints");
    c.data.corpus = corpus;
    c.tokenizer.kind = TokenizerKind::Char;
    c.model.n_layer = 2;
    c.model.n_head = 2;
    c.model.n_embd = 16;
    c.model.block_size = 8;
    c.model.dropout = 0.1;
    c.train.batch_size = 4;
    c.train.max_iters = 12;
    c.train.warmup_iters = 2;
    c.train.lr_decay_iters = Some(12);
    c.train.eval_interval = 6;
    c.train.eval_iters = 1;
    c.train.log_interval = 1;
    c.train.checkpoint_interval = 6;
    c
}

/// The run `cfg` describes, trained: how its engine describes itself, its losses, its
/// checkpoint's weights (the file's bytes).
fn trained(cfg: Config) -> (String, Vec<(usize, f64)>, Vec<u8>) {
    let trainer = Trainer::new(cfg.clone(), false).unwrap();
    let engine = trainer.engine_name().to_string();
    drop(trainer);
    let weights = cfg
        .run
        .out_dir
        .join(&cfg.run.name)
        .join("model.safetensors");
    let mut losses = Losses::default();
    tinygpt::train::train(cfg, false, &mut losses).unwrap();
    (engine, losses.0, std::fs::read(weights).unwrap())
}

#[test]
fn the_emulated_cuda_engine_trains_and_resumes_exactly() {
    if !emulated() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut straight_cfg = config(dir.path());
    straight_cfg.run.name = "straight".into();
    let trainer = Trainer::new(straight_cfg.clone(), false).unwrap();
    assert!(
        trainer.engine_name().starts_with("fused CUDA kernels"),
        "{}",
        trainer.engine_name()
    );
    drop(trainer);
    let mut straight = Losses::default();
    tinygpt::train::train(straight_cfg.clone(), false, &mut straight).unwrap();

    let mut first_cfg = straight_cfg.clone();
    first_cfg.run.name = "interrupted".into();
    first_cfg.train.max_iters = 5;
    let mut first = Losses::default();
    tinygpt::train::train(first_cfg.clone(), false, &mut first).unwrap();
    let mut second_cfg = first_cfg;
    second_cfg.train.max_iters = 12;
    let mut second = Losses::default();
    tinygpt::train::train(second_cfg, true, &mut second).unwrap();

    let mut resumed = first.0;
    resumed.extend(second.0);
    assert_eq!(resumed.len(), 12);
    assert_eq!(
        resumed, straight.0,
        "the resumed run follows the same curve exactly"
    );
    let (start, end) = (straight.0[0].1, straight.0[11].1);
    assert!(end < start, "it learns: {start} -> {end}");
}

/// A pass replays its launches recorded once (CUDA graphs; in the emulator the calls
/// kept with their arguments): what changes between batches (the tokens, their
/// buckets for the embedding's backward, the micro-batch and step the dropout masks
/// are drawn for, the weights, the loss's slot) reaches the replayed work through
/// device memory, so a run with graphs and one launching every kernel
/// (`TINYGPT_CUDA_GRAPHS=0`) agree bit for bit, losses and weights: f32 with dropout
/// and bf16 without (flash attention), two micro-batches a step (the backward replayed
/// with its loss scale), evaluations between steps (forwards alone, without masks).
#[test]
fn replayed_passes_train_as_launched_ones() {
    if !emulated() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, graphs: &str, bf16: bool| {
        std::env::set_var("TINYGPT_CUDA_GRAPHS", graphs);
        let mut cfg = config(dir.path());
        cfg.run.name = name.into();
        cfg.model.dropout = if bf16 { 0.0 } else { 0.1 };
        cfg.train.grad_accum = 2;
        if bf16 {
            cfg.train.dtype = tinygpt::config::Precision::Bf16;
            cfg.model.n_embd = 32;
        }
        let trained = trained(cfg);
        std::env::remove_var("TINYGPT_CUDA_GRAPHS");
        trained
    };
    for bf16 in [false, true] {
        let (replayed_engine, replayed, replayed_weights) =
            run(&format!("graphs-{bf16}"), "1", bf16);
        let (launched_engine, launched, launched_weights) =
            run(&format!("launched-{bf16}"), "0", bf16);
        assert!(replayed_engine.contains("CUDA graphs"), "{replayed_engine}");
        assert!(
            !launched_engine.contains("CUDA graphs"),
            "{launched_engine}"
        );
        assert_eq!(replayed.len(), 12);
        assert_eq!(
            replayed, launched,
            "bf16 {bf16}: the same losses, bit for bit"
        );
        assert!(
            replayed_weights == launched_weights,
            "bf16 {bf16}: the same weights, bit for bit"
        );
    }
}

/// bf16 products read bf16 copies of their operands (the weights' copy rounded again
/// after each update, each product's inputs rounded first, or written rounded by the
/// kernel that makes them): the same numbers as products that round f32 operands on
/// the fly (`TINYGPT_CUDA_BF16_OPERANDS=0`), so the two runs agree bit for bit, losses
/// and weights (in the emulator, whose product is one written-out loop: on a GPU cuBLAS
/// may sum the two in another order). Two models: heads of 8 with dropout and biases
/// (attention through products; the MLP's bias added to its bf16 rows by the
/// activation), and heads of 16 without dropout or biases (flash attention reading
/// q | k | v and its output's gradient in bf16, writing its output and dqkv in bf16;
/// norms' backwards writing the residual stream's gradient rounded).
#[test]
fn bf16_operand_copies_train_as_rounding_on_the_fly() {
    if !emulated() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, copies: &str, flash: bool| {
        std::env::set_var("TINYGPT_CUDA_BF16_OPERANDS", copies);
        let mut cfg = config(dir.path());
        cfg.run.name = name.into();
        cfg.train.dtype = tinygpt::config::Precision::Bf16;
        cfg.model.bias = !flash;
        if flash {
            cfg.model.n_embd = 32;
            cfg.model.dropout = 0.0;
        }
        trained(cfg)
    };
    for flash in [false, true] {
        let (copies_engine, copies, copies_weights) = run(&format!("copies-{flash}"), "1", flash);
        let (fly_engine, fly, fly_weights) = run(&format!("on-the-fly-{flash}"), "0", flash);
        std::env::remove_var("TINYGPT_CUDA_BF16_OPERANDS");
        assert!(
            copies_engine.contains("bf16 operand copies"),
            "{copies_engine}"
        );
        assert!(fly_engine.contains("rounded by cuBLAS"), "{fly_engine}");
        assert_eq!(
            copies_engine.contains("flash attention"),
            flash,
            "{copies_engine}"
        );
        assert_eq!(copies.len(), 12);
        assert_eq!(copies, fly, "flash {flash}: the same losses, bit for bit");
        assert!(
            copies_weights == fly_weights,
            "flash {flash}: the same weights, bit for bit"
        );
    }
}
