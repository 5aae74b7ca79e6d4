//! What a run reports, and to whom: the CLI draws a progress bar from these, tests
//! collect or ignore them. The library itself never prints.

/// Where the library reports progress; the CLI draws a progress bar, tests stay quiet.
pub trait Reporter {
    fn started(&mut self, _info: &RunInfo) {}
    fn step(&mut self, _log: &StepLog) {}
    fn eval(&mut self, _log: &EvalLog) {}
    /// Evaluation batch `done` of `total` is finished.
    fn evaluating(&mut self, _done: usize, _total: usize) {}
    /// A checkpoint is being written.
    fn saving(&mut self) {}
    fn note(&mut self, _message: &str) {}
    fn finished(&mut self, _summary: &TrainSummary) {}
}

/// Reports nothing.
pub struct Silent;
impl Reporter for Silent {}

#[derive(Debug, Clone)]
pub struct RunInfo {
    pub run_dir: std::path::PathBuf,
    pub start_step: usize,
    pub max_iters: usize,
    pub parameters: usize,
    pub train_tokens: usize,
    pub val_tokens: usize,
    /// The tokenizer's tokens, and the model's rows (more where padded to a multiple).
    pub vocab_size: usize,
    pub model_vocab_size: usize,
    pub tokenizer: &'static str,
    pub device: String,
    pub engine: String,
    pub tokens_per_step: usize,
}

#[derive(Debug, Clone)]
pub struct StepLog {
    /// Optimiser steps completed, this one included.
    pub step: usize,
    pub lr: f64,
    pub elapsed_s: f64,
    /// What the trainer read from the engine after this step, if it read: at log,
    /// evaluation and checkpoint steps, a stop and the end (a read waits for a GPU, so
    /// steps in between are not read).
    pub measured: Option<Measured>,
}

/// The losses of the steps since the last reading, read after the last of them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measured {
    /// How many steps: those since the last reading, this one included.
    pub steps: usize,
    /// Their mean training loss.
    pub loss: f64,
    /// The global gradient norm of the last step, before clipping.
    pub grad_norm: f64,
    /// Their tokens over the wall time they took.
    pub tokens_per_s: f64,
}

#[derive(Debug, Clone)]
pub struct EvalLog {
    pub step: usize,
    pub train_loss: f64,
    pub val_loss: f64,
}

#[derive(Debug, Clone)]
pub struct TrainSummary {
    pub step: usize,
    pub train_loss: Option<f64>,
    pub val_loss: Option<f64>,
    pub elapsed_s: f64,
    pub run_dir: std::path::PathBuf,
}
