//! The training loop: batches -> loss -> backward -> clip -> AdamW, with periodic
//! evaluation, metrics and checkpoints, resumable from the run folder.

pub mod memory;
pub mod optim;
pub mod schedule;

use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use candle_core::{Device, Tensor};
use serde_json::json;

use crate::checkpoint::{RunDir, TrainState, MODEL_FILE, OPTIMIZER_FILE};
use crate::config::{Config, Precision, TokenizerKind, TrainConfig};
use crate::data::{self, Batch, BatchSampler, Split, Tokens};
use crate::device::parse_device;
use crate::error::{DivergedError, InterruptedError};
use crate::fast::train::FastGpt;
use crate::lock::RunLock;
use crate::model::{Dropout, Gpt};
use crate::tokenizer::Tokenizer;
use crate::user_bail;
use optim::{clip_grad_norm, AdamW};
use schedule::learning_rate;

/// RNG streams drawn from the run's seed; separate so that evaluation never shifts
/// the training batches and resume can restore each one.
const STREAM_TRAIN_BATCHES: u64 = 1;
const STREAM_EVAL_TRAIN: u64 = 3;
const STREAM_EVAL_VAL: u64 = 4;

/// Where the library reports progress; the CLI draws a progress bar, tests stay quiet.
pub trait Reporter {
    fn started(&mut self, _info: &RunInfo) {}
    fn step(&mut self, _log: &StepLog) {}
    fn eval(&mut self, _log: &EvalLog) {}
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
    pub vocab_size: usize,
    pub tokenizer: &'static str,
    pub device: String,
    pub engine: String,
    pub tokens_per_step: usize,
}

#[derive(Debug, Clone)]
pub struct StepLog {
    /// Optimiser steps completed, this one included.
    pub step: usize,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub tokens_per_s: f64,
    pub elapsed_s: f64,
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

/// How a run begins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Start {
    /// A new run: tokenizer from the config, random weights.
    Fresh,
    /// Continue the checkpoint in the run folder.
    Resume,
    /// A new run whose model and tokenizer start from another checkpoint (fine-tuning).
    InitFrom(std::path::PathBuf),
}

/// What computes the gradients and applies the updates.
enum Engine {
    /// The reference model: candle ops, autograd, AdamW over tensors (every device).
    Reference(AdamW),
    /// The fused CPU kernels over flat buffers (`fast::train`); the reference model's
    /// variables are refreshed from it before saving.
    Fused(Box<FastGpt>),
}

/// Whether training runs on the fused CPU kernels (`fast::train`) rather than the
/// reference model (train.fused = false, or a GPU).
pub fn uses_fused_path(train: &TrainConfig, device: &Device) -> bool {
    train.fused && FastGpt::unsupported(device).is_none()
}

/// Everything a run holds between steps.
pub struct Trainer {
    pub config: Config,
    pub run: RunDir,
    pub tokenizer: Tokenizer,
    pub model: Gpt,
    engine: Engine,
    split: Split,
    sampler: BatchSampler,
    pub state: TrainState,
    device: Device,
    session_start: Instant,
    resumed: bool,
    /// Set (to the signal number) when the user asks training to stop.
    stop: Option<Arc<AtomicI32>>,
    /// The step's micro-batches, refilled in place.
    batches: Vec<Batch>,
    /// The reference path's clipped gradients between computing and applying them.
    pending_grads: Option<Vec<Tensor>>,
    _lock: RunLock,
}

impl Trainer {
    /// Builds a new run, or with `resume` reloads the one in the run folder. A new run
    /// refuses a folder that already holds a checkpoint, so nothing is overwritten.
    pub fn new(config: Config, resume: bool) -> Result<Self> {
        Self::start(config, if resume { Start::Resume } else { Start::Fresh })
    }

    /// Builds the run as `start` says.
    pub fn start(mut config: Config, start: Start) -> Result<Self> {
        let resume = start == Start::Resume;
        let device = parse_device(&config.run.device)?;
        let fused = uses_fused_path(&config.train, &device);
        let run = RunDir::new(config.run_dir());
        let mut state = TrainState::default();
        let docs = data::read_corpus(&config.data.corpus)?;
        let mut init_weights = None;

        let tokenizer = if resume {
            if !run.has_checkpoint() {
                user_bail!(
                    "--resume: {} holds no checkpoint to resume; drop --resume to start a new run",
                    run.path().display()
                );
            }
            state = run.state()?;
            let saved = run.load_config(&state)?;
            let mut wanted = config.model.clone();
            wanted.vocab_size = saved.model.vocab_size;
            // A fine-tuning run's model came from the --init-from checkpoint, not from
            // the user's [model] section.
            if saved.train.init_from.is_none() && wanted != saved.model {
                user_bail!(
                    "--resume: the [model] section differs from the checkpoint's in {}; resume with the same model settings",
                    run.path().join(crate::checkpoint::CONFIG_FILE).display()
                );
            }
            config.model = saved.model;
            config.tokenizer = saved.tokenizer;
            config.train.init_from = saved.train.init_from;
            run.load_tokenizer(&state)?
        } else {
            if run.has_checkpoint() {
                user_bail!(
                    "{} already holds a checkpoint; pass --resume to continue it, or choose another run.name (--set run.name=...)",
                    run.path().display()
                );
            }
            if let Start::InitFrom(dir) = &start {
                // Fine-tuning: the model and tokenizer come from the checkpoint; data,
                // training and dropout from this config.
                let loaded = crate::checkpoint::Loaded::load(dir, &device)?;
                let dropout = config.model.dropout;
                config.model = loaded.config.model.clone();
                config.model.dropout = dropout;
                config.tokenizer = loaded.config.tokenizer.clone();
                init_weights = Some(loaded.model.params().to_map());
                loaded.tokenizer
            } else {
                let tokenizer = match &config.tokenizer.path {
                    Some(path) => Tokenizer::from_file(path)?,
                    None => Tokenizer::train(
                        config.tokenizer.kind,
                        &data::joined(&docs),
                        config.tokenizer.vocab_size,
                    )?,
                };
                let have = tokenizer.vocab_size();
                let trained_bpe =
                    config.tokenizer.path.is_none() && config.tokenizer.kind == TokenizerKind::Bpe;
                if trained_bpe && have < config.tokenizer.vocab_size {
                    user_bail!(
                    "tokenizer.vocab_size = {} is more than corpus {} supports: BPE ran out of pairs seen twice at {have} tokens; set tokenizer.vocab_size to at most {have} or use a larger corpus",
                    config.tokenizer.vocab_size,
                    config.data.corpus.display()
                );
                }
                if config.model.vocab_size == 0 {
                    config.model.vocab_size = have;
                } else if config.model.vocab_size < have {
                    user_bail!(
                    "config: model.vocab_size = {} is smaller than the tokenizer's {have} tokens; remove it or set it to at least {have}",
                    config.model.vocab_size
                );
                }
                tokenizer
            }
        };
        config.validate()?;
        check_memory(&config, &device)?;

        std::fs::create_dir_all(run.path()).map_err(|e| {
            crate::error::user_error(format!(
                "cannot create run folder {}: {e}",
                run.path().display()
            ))
        })?;
        let lock = RunLock::acquire(run.path())?;
        run.remove_temp_files();
        if !resume {
            // Left by a run that never wrote a checkpoint (killed, diverged at once).
            let _ = std::fs::remove_file(run.file(crate::checkpoint::METRICS_FILE));
        }
        if resume {
            run.roll_forward(&state)?;
        }
        let tokens = data::cached_tokens(&docs, &tokenizer, &run.file("tokens"))?;
        check_token_ids(&tokens, config.model.vocab_size)?;
        let split = Split::new(
            tokens,
            config.data.val_fraction,
            config.model.block_size,
            &config.data.corpus,
        )?;

        let model =
            Gpt::with_products(&config.model, config.run.seed, &device, config.train.dtype)?;
        if let Some(weights) = &init_weights {
            model.params().load(weights, "--init-from")?;
        }
        let seed = config.run.seed;
        let mut sampler = BatchSampler::new(seed, STREAM_TRAIN_BATCHES);
        if resume {
            let weights = run.load_tensors(&state, MODEL_FILE, &device)?;
            model
                .params()
                .load(&weights, &run.file(MODEL_FILE).display().to_string())?;
            sampler.set_position(parse_position(&state.sampler_position)?);
            run.truncate_metrics(state.step)?;
        }
        let mut engine = if fused {
            Engine::Fused(Box::new(FastGpt::new(
                &config.model,
                model.params(),
                config.train.batch_size,
                config.train.dtype,
            )?))
        } else {
            Engine::Reference(AdamW::new(model.params(), &config.train)?)
        };
        if resume {
            let moments = run.load_tensors(&state, OPTIMIZER_FILE, &device)?;
            let source = run.file(OPTIMIZER_FILE).display().to_string();
            match &mut engine {
                Engine::Reference(adamw) => adamw.load_state(&moments, state.step, &source)?,
                Engine::Fused(fast) => fast.load_moments(&moments, &source)?,
            }
        }
        let (b, t) = (config.train.batch_size, config.model.block_size);
        let empty = Batch {
            x: vec![0; b * t],
            y: vec![0; b * t],
            batch: b,
            block: t,
        };
        let batches = vec![empty; config.train.grad_accum];
        Ok(Self {
            config,
            run,
            tokenizer,
            model,
            engine,
            split,
            sampler,
            state,
            device,
            session_start: Instant::now(),
            resumed: resume,
            stop: None,
            pending_grads: None,
            batches,
            _lock: lock,
        })
    }

    /// Training stops cleanly (checkpoint, then `InterruptedError`) once `flag` holds a
    /// signal number other than 0.
    pub fn stop_when(&mut self, flag: Arc<AtomicI32>) {
        self.stop = Some(flag);
    }

    pub fn info(&self) -> RunInfo {
        RunInfo {
            run_dir: self.run.path().to_path_buf(),
            start_step: self.state.step,
            max_iters: self.config.train.max_iters,
            parameters: self.model.params().count(),
            train_tokens: self.split.train.len(),
            val_tokens: self.split.val.len(),
            vocab_size: self.config.model.vocab_size,
            tokenizer: self.tokenizer.kind_name(),
            device: format!("{:?}", self.device),
            engine: self.engine_name(),
            tokens_per_step: self
                .config
                .train
                .tokens_per_step(self.config.model.block_size),
        }
    }

    fn batch_tensors(&self, batch: &Batch) -> Result<(Tensor, Tensor)> {
        let shape = (batch.batch, batch.block);
        Ok((
            Tensor::from_slice(&batch.x, shape, &self.device)?,
            Tensor::from_slice(&batch.y, shape, &self.device)?,
        ))
    }

    /// One optimiser step over `grad_accum` micro-batches.
    pub fn train_step(&mut self) -> Result<StepLog> {
        let started = Instant::now();
        let cfg = &self.config.train;
        let lr = learning_rate(self.state.step, cfg);
        let (accum, clip) = (cfg.grad_accum, cfg.grad_clip);
        let tokens = cfg.tokens_per_step(self.config.model.block_size);
        for batch in &mut self.batches {
            self.sampler.sample_into(&self.split.train, batch);
        }
        let (loss, grad_norm) = match &mut self.engine {
            Engine::Fused(fast) => {
                fast.zero_grads();
                let mut loss_sum = 0.0;
                for (micro, batch) in self.batches.iter().enumerate() {
                    let dropout = dropout_in(&self.config, self.state.step, micro);
                    loss_sum += fast.forward(&batch.x, &batch.y, dropout.as_ref());
                    // Each micro-batch contributes 1/accum of the mean gradient.
                    fast.backward(1.0 / accum as f32);
                }
                (loss_sum / accum as f64, fast.clip_grads(clip))
            }
            Engine::Reference(_) => self.reference_gradients(clip)?,
        };
        if !loss.is_finite() || !grad_norm.is_finite() {
            return Err(DivergedError {
                step: self.state.step + 1,
                lr,
                what: if loss.is_finite() {
                    "gradient norm"
                } else {
                    "loss"
                },
            }
            .into());
        }
        match &mut self.engine {
            Engine::Fused(fast) => fast.adamw(self.state.step + 1, lr, &self.config.train),
            Engine::Reference(adamw) => {
                let grads = self.pending_grads.take().expect("gradients computed above");
                adamw.step(&grads, lr)?;
            }
        }

        self.state.step += 1;
        self.state.tokens_seen += tokens as u64;
        self.state.last_train_loss = Some(loss);
        Ok(StepLog {
            step: self.state.step,
            loss,
            lr,
            grad_norm,
            tokens_per_s: tokens as f64 / started.elapsed().as_secs_f64(),
            elapsed_s: self.elapsed_s(),
        })
    }

    /// The reference path's gradients for the step's batches (mean over them), clipped
    /// to `clip`; kept in `pending_grads` for the optimiser. Returns (mean loss, norm
    /// before clipping).
    fn reference_gradients(&mut self, clip: f64) -> Result<(f64, f64)> {
        let batches = std::mem::take(&mut self.batches);
        let params: Vec<Tensor> = self
            .model
            .params()
            .iter()
            .map(|(_, v)| v.as_tensor().clone())
            .collect();
        let mut grads: Vec<Option<Tensor>> = vec![None; params.len()];
        let mut loss_sum = 0.0;
        for (micro, batch) in batches.iter().enumerate() {
            let (x, y) = self.batch_tensors(batch)?;
            let dropout = dropout_in(&self.config, self.state.step, micro);
            let loss = self.model.loss(&x, &y, dropout.as_ref())?;
            loss_sum += loss.to_scalar::<f32>()? as f64;
            let store = (loss / batches.len() as f64)?.backward()?;
            for (acc, p) in grads.iter_mut().zip(&params) {
                if let Some(g) = store.get(p) {
                    *acc = Some(match acc.take() {
                        Some(prev) => (prev + g)?,
                        None => g.clone(),
                    });
                }
            }
        }
        let mut grads: Vec<Tensor> = grads
            .into_iter()
            .zip(&params)
            .map(|(g, p)| g.map_or_else(|| p.zeros_like(), Ok))
            .collect::<candle_core::Result<_>>()?;
        let norm = clip_grad_norm(&mut grads, clip)?;
        let mean = loss_sum / batches.len() as f64;
        self.batches = batches;
        self.pending_grads = Some(grads);
        Ok((mean, norm))
    }

    /// Mean loss over `eval_iters` batches of train and of val. The batches are the same
    /// at every evaluation (a fixed seed), so the curve shows the model change, not noise.
    pub fn evaluate(&mut self) -> Result<EvalLog> {
        let train = self.split.train.clone();
        let val = self.split.val.clone();
        Ok(EvalLog {
            step: self.state.step,
            train_loss: self.mean_loss(&train, STREAM_EVAL_TRAIN)?,
            val_loss: self.mean_loss(&val, STREAM_EVAL_VAL)?,
        })
    }

    fn mean_loss(&mut self, tokens: &Tokens, stream: u64) -> Result<f64> {
        let cfg = self.config.train.clone();
        let block = self.config.model.block_size;
        let mut sampler = BatchSampler::new(self.config.run.seed, stream);
        let mut sum = 0.0;
        for _ in 0..cfg.eval_iters {
            let batch = sampler.sample(tokens, cfg.batch_size, block);
            sum += match &mut self.engine {
                Engine::Fused(fast) => fast.forward(&batch.x, &batch.y, None),
                Engine::Reference(_) => {
                    let (x, y) = self.batch_tensors(&batch)?;
                    let loss = self.model.loss(&x, &y, None)?;
                    loss.to_scalar::<f32>()? as f64
                }
            };
        }
        Ok(sum / cfg.eval_iters as f64)
    }

    pub fn elapsed_s(&self) -> f64 {
        self.state.elapsed_s + self.session_start.elapsed().as_secs_f64()
    }

    /// Writes a checkpoint of the current step.
    pub fn save(&self) -> Result<()> {
        let mut state = self.state.clone();
        state.elapsed_s = self.elapsed_s();
        state.sampler_position = self.sampler.position().to_string();
        self.sync_model()?;
        let moments = match &self.engine {
            Engine::Reference(adamw) => adamw.state_tensors(),
            Engine::Fused(fast) => fast.moments()?,
        };
        self.run.save(
            &self.config,
            &self.tokenizer,
            &self.model.params().to_map(),
            &moments,
            &state,
        )
    }

    /// Brings the reference model's weights up to date with the engine's.
    pub fn sync_model(&self) -> Result<()> {
        if let Engine::Fused(fast) = &self.engine {
            fast.write_params(self.model.params())?;
        }
        Ok(())
    }

    /// "fused CPU kernels", or why the reference path is used.
    pub fn engine_name(&self) -> String {
        let path = match &self.engine {
            Engine::Fused(_) => "fused CPU kernels".into(),
            Engine::Reference(_) if !self.config.train.fused => {
                "reference (train.fused = false)".into()
            }
            Engine::Reference(_) => format!(
                "reference ({})",
                FastGpt::unsupported(&self.device).unwrap_or_default()
            ),
        };
        match self.config.train.dtype {
            Precision::F32 => path,
            Precision::Bf16
                if matches!(self.engine, Engine::Fused(_))
                    && !crate::fast::bf16::has_avx512_bf16() =>
            {
                format!(
                    "{path}, bf16 matrix products emulated (this CPU lacks AVX512_BF16: \
                 train.dtype = \"f32\" is faster here)"
                )
            }
            Precision::Bf16 => format!("{path}, bf16 matrix products"),
        }
    }

    /// Evaluates, records the losses in the state and metrics.jsonl, and reports.
    fn evaluate_and_log(
        &mut self,
        step: usize,
        cfg: &crate::config::TrainConfig,
        reporter: &mut dyn Reporter,
    ) -> Result<()> {
        let e = self.evaluate()?;
        self.state.last_val_loss = Some(e.val_loss);
        self.state.last_train_loss = Some(e.train_loss);
        self.state.best_val_loss = Some(
            self.state
                .best_val_loss
                .map_or(e.val_loss, |b| b.min(e.val_loss)),
        );
        self.run.append_metrics(&json!({
            "step": e.step, "train_loss": e.train_loss, "val_loss": e.val_loss,
            "lr": learning_rate(step, cfg), "elapsed_s": self.elapsed_s(),
        }))?;
        reporter.eval(&e);
        Ok(())
    }

    /// Trains to `max_iters`: eval at every `eval_interval` (and at the end), metrics
    /// every `log_interval`, checkpoint every `checkpoint_interval` and at the end.
    pub fn run(&mut self, reporter: &mut dyn Reporter) -> Result<TrainSummary> {
        let cfg = self.config.train.clone();
        reporter.started(&self.info());
        let start = self.state.step;
        let mut step = start;
        loop {
            let is_last = step >= cfg.max_iters;
            // A resumed run already evaluated (and saved) its first step.
            let resumed_here = self.resumed && step == start;
            if (step.is_multiple_of(cfg.eval_interval) || is_last) && !resumed_here {
                self.evaluate_and_log(step, &cfg, reporter)?;
            }
            if step > start && (step.is_multiple_of(cfg.checkpoint_interval) || is_last) {
                self.save()?;
                reporter.note(&format!(
                    "checkpoint: {} at step {step}",
                    self.run.path().display()
                ));
            }
            if is_last {
                break;
            }
            let log = self.train_step()?;
            step = log.step;
            if step.is_multiple_of(cfg.log_interval) || step == cfg.max_iters {
                self.run.append_metrics(&json!({
                    "step": log.step, "loss": log.loss, "lr": log.lr, "grad_norm": log.grad_norm,
                    "tokens_per_s": log.tokens_per_s, "elapsed_s": log.elapsed_s,
                }))?;
            }
            reporter.step(&log);
            let signal = self.stop.as_ref().map_or(0, |f| f.load(Ordering::SeqCst));
            if signal != 0 && step < cfg.max_iters {
                // A resumed run skips the evaluation of its first step, so do it now.
                if step.is_multiple_of(cfg.eval_interval) {
                    self.evaluate_and_log(step, &cfg, reporter)?;
                }
                self.save()?;
                return Err(InterruptedError {
                    signal,
                    step,
                    run_dir: self.run.path().to_path_buf(),
                }
                .into());
            }
        }
        match crate::plot::run_loss_curve(self.run.path()) {
            Ok(png) => reporter.note(&format!("loss curve: {}", png.display())),
            Err(e) => reporter.note(&format!("no loss curve: {e:#}")),
        }
        self.sync_model()?;
        let summary = TrainSummary {
            step: self.state.step,
            train_loss: self.state.last_train_loss,
            val_loss: self.state.last_val_loss,
            elapsed_s: self.elapsed_s(),
            run_dir: self.run.path().to_path_buf(),
        };
        reporter.finished(&summary);
        Ok(summary)
    }
}

/// Trains as the config says (`resume` continues the run folder's checkpoint).
pub fn train(config: Config, resume: bool, reporter: &mut dyn Reporter) -> Result<TrainSummary> {
    let mut trainer = Trainer::new(config, resume)?;
    trainer.run(reporter)
}

/// Refuses a config whose training would not fit in the memory available.
fn check_memory(config: &Config, device: &Device) -> Result<()> {
    if !device.is_cpu() {
        return Ok(()); // the GPU's own allocator reports what does not fit
    }
    let need = memory::training_bytes(&config.model, &config.train);
    if let Some(available) = crate::util::available_memory_bytes() {
        if need > available {
            user_bail!(
                "config: training this model needs about {:.1} GiB ({:.0}M parameters, batch {} x {} tokens) but {:.1} GiB is available; reduce model.n_embd, model.n_layer, model.block_size or train.batch_size",
                need / f64::from(1 << 30),
                crate::model::ModelSpec::new(&config.model).len() as f64 / 1e6,
                config.train.batch_size,
                config.model.block_size,
                available / f64::from(1 << 30)
            );
        }
    }
    Ok(())
}

/// Dropout in the forward pass of micro-batch `micro` of step `step`, if the model has any.
fn dropout_in(config: &Config, step: usize, micro: usize) -> Option<Dropout> {
    Dropout::in_pass(config.model.dropout, config.run.seed, step, micro)
}

fn parse_position(s: &str) -> Result<u128> {
    if s.is_empty() {
        return Ok(0);
    }
    s.parse()
        .map_err(|_| crate::error::user_error(format!("state.json: bad RNG position {s:?}")))
}

fn check_token_ids(tokens: &Tokens, vocab_size: usize) -> Result<()> {
    if let Some(bad) = (0..tokens.len())
        .map(|i| tokens.get(i))
        .find(|&id| id as usize >= vocab_size)
    {
        user_bail!("the token cache holds id {bad}, outside the model's vocabulary of {vocab_size}; delete the run's tokens.bin and retry");
    }
    Ok(())
}
