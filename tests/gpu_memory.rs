//! On a GPU: the memory check before the first step reads the device's free memory and
//! refuses a run that cannot fit, in one line. Built with `--features cuda`; without a
//! CUDA device each test says so and passes.
#![cfg(feature = "cuda")]

use candle_core::Device;
use tinygpt::config::Config;
use tinygpt::train::Trainer;

fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(device) => Some(device),
        Err(e) => {
            eprintln!("SKIPPED: no CUDA device ({e})");
            None
        }
    }
}

#[test]
fn free_memory_is_read_from_the_driver() {
    let Some(device) = gpu() else { return };
    let (free, total) = tinygpt::device::gpu_memory(&device).expect("cuMemGetInfo answers");
    assert!(total > 1 << 30, "total {total}");
    assert!(free > 0 && free <= total, "free {free} of {total}");
}

#[test]
fn a_run_that_cannot_fit_the_gpu_is_refused_before_it_starts() {
    if gpu().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(&corpus, "Now is the winter of our discontent\n".repeat(200)).unwrap();
    // GPT-2 small at batch 512 x 1024 tokens: terabytes of activations.
    let overrides = [
        format!("data.corpus={:?}", corpus.display().to_string()),
        format!(
            "run.out_dir={:?}",
            dir.path().join("runs").display().to_string()
        ),
        "run.device=\"cuda\"".to_string(),
        "tokenizer.kind=\"char\"".to_string(),
        "model.n_layer=12".to_string(),
        "model.n_head=12".to_string(),
        "model.n_embd=768".to_string(),
        "model.block_size=1024".to_string(),
        "train.batch_size=512".to_string(),
    ];
    let config = Config::from_toml_str("", &overrides).unwrap();
    let err = Trainer::start(config, tinygpt::train::Start::Fresh)
        .err()
        .expect("refused");
    let message = format!("{err:#}");
    assert!(message.contains("GiB of GPU memory"), "{message}");
    assert!(message.contains("train.batch_size"), "{message}");
    assert!(!dir.path().join("runs").exists(), "nothing written");
}
