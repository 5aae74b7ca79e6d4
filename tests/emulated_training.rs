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
