//! The training loop: batches -> loss -> backward -> clip -> AdamW, with periodic
//! evaluation, metrics and checkpoints, resumable from the run folder.
//!
//! The trainer holds an [`Engine`] and never asks which one: the engine computes, the
//! trainer decides what to compute (batches, schedule, evaluation, checkpoints).

mod prepare;
mod report;
mod resume;
pub mod schedule;
mod start;

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use candle_core::Device;
use serde_json::json;

pub use prepare::{check_memory, engine_options};
use prepare::{lock_if_present, open_run_folder, prepare, shared_settings, Prepared};
pub use report::{EvalLog, Measured, Reporter, RunInfo, Silent, StepLog, TrainSummary};
use resume::{restore, Resumed};
use schedule::learning_rate;
pub use start::Start;

use crate::checkpoint::{RunDir, TrainState};
use crate::config::Config;
use crate::corpus::cache::CorpusCache;
use crate::data::{Batch, BatchSampler, Split, Tokens};
use crate::device;
use crate::engine::{self, Engine};
use crate::error::{DivergedError, InterruptedError};
use crate::lock::RunLock;
use crate::model::{Dropout, ModelSpec};
use crate::optim::AdamWStep;
use crate::parallel::agree::same_everywhere;
use crate::parallel::collective::interleave;
use crate::parallel::{agree, Collective, Single};
use crate::plot;
use crate::tokenizer::Tokenizer;
use crate::user_bail;
use crate::util::{Stop, Stopped};

/// RNG streams drawn from the run's seed; separate so that evaluation never shifts
/// the training batches and resume can restore each one. (Dropout needs no stream: its
/// masks are a function of the step. Stream 2 drew them before they were; the others
/// keep their numbers so that existing runs' batches do not move.)
const STREAM_TRAIN_BATCHES: u64 = 1;
const STREAM_EVAL_TRAIN: u64 = 3;
const STREAM_EVAL_VAL: u64 = 4;

/// Everything a run holds between steps.
pub struct Trainer {
    pub config: Config,
    pub run: RunDir,
    pub tokenizer: Tokenizer,
    engine: Box<dyn Engine>,
    split: Split,
    sampler: BatchSampler,
    pub state: TrainState,
    device: Device,
    session_start: Instant,
    resumed: bool,
    /// Asked through when the user wants training to stop.
    stop: Stop,
    /// The ranks of a data-parallel run (one process: `Single`).
    comm: Arc<dyn Collective>,
    /// The signal every rank agreed to stop for, once one was asked.
    stopping: Option<i32>,
    /// A step's micro-batch, and an evaluation batch, refilled in place.
    batch: Batch,
    eval_batch: Batch,
    /// The steps whose loss and gradient norm the engine holds unread.
    unread: Unread,
    /// Why `run.device = "auto"` chose the device (None when it was named).
    device_choice: Option<String>,
    /// A resumed run's config as its checkpoint saved it (the schedule its last steps
    /// followed, the data it trained on).
    saved: Option<Config>,
    /// Held by rank 0, which alone writes the run folder.
    _lock: Option<RunLock>,
    /// The corpus cache the run reads, held (`cache prune` leaves it alone meanwhile).
    cache: Option<CorpusCache>,
    /// The corpus's fingerprint as the state keeps it ([`TrainState::corpus_fingerprint`]).
    corpus_fingerprint: String,
    /// What training says of its data before it starts: a corpus folder's files not
    /// read, tokens the tokenizer could not spell.
    data_notes: Vec<String>,
}

/// Steps trained since the trainer last read the engine's loss: reading waits for a
/// GPU to finish the work queued, so it happens only where a step is reported (log,
/// evaluation and checkpoint steps, a stop, the end), never inside a step.
struct Unread {
    steps: usize,
    /// When the first of them started (tokens/s are over the whole stretch).
    since: Instant,
}

impl Trainer {
    /// Builds a new run, or with `resume` reloads the one in the run folder. A new run
    /// refuses a folder that already holds a checkpoint, so nothing is overwritten.
    pub fn new(config: Config, resume: bool) -> Result<Self> {
        Self::start(config, if resume { Start::Resume } else { Start::Fresh })
    }

    /// Builds the run as `start` says.
    pub fn start(config: Config, start: Start) -> Result<Self> {
        Self::start_until(config, start, Stop::new())
    }

    /// Builds the run as `start` says; preparing the data gives up (`Stopped`) and
    /// training stops cleanly (checkpoint, then `InterruptedError`) once `stop` asks.
    pub fn start_until(config: Config, start: Start, stop: Stop) -> Result<Self> {
        Self::start_on(config, start, stop, Arc::new(Single))
    }

    /// [`Trainer::start_until`] as one rank of a data-parallel run over `comm`. Rank 0
    /// prepares first (trains the tokenizer, fills the token cache, locks the run
    /// folder) while the others wait; then they read what it prepared. Each stage ends
    /// with the ranks agreeing that it went well, so a rank that fails takes the
    /// others down with it instead of leaving them waiting.
    pub fn start_on(
        config: Config,
        start: Start,
        stop: Stop,
        comm: Arc<dyn Collective>,
    ) -> Result<Self> {
        let resume = start == Start::Resume;
        same_everywhere(comm.as_ref(), "the config", &shared_settings(&config))?;
        let prepared = if comm.rank() == 0 {
            let run = RunDir::new(config.run_dir());
            // A folder that exists is locked before it is read: a resumed run must not
            // read a checkpoint that another trainer is writing.
            let prepared = lock_if_present(&run).and_then(|held| {
                let mut p = prepare(config, &start, &stop, comm.as_ref())?;
                p.lock = Some(open_run_folder(&run, resume, &p.state, held)?);
                Ok(p)
            });
            agree(comm.as_ref(), prepared)
        } else {
            agree(comm.as_ref(), Ok(()))
                .and_then(|()| prepare(config, &start, &stop, comm.as_ref()))
        };
        // Every rank prepared (or all stop), then all read the same data: a corpus
        // that differs between nodes under one path shows here.
        let prepared = agree(comm.as_ref(), prepared).and_then(|p| {
            same_everywhere(comm.as_ref(), "the data", &p.data_summary())?;
            Ok(p)
        });
        let built = prepared.and_then(|mut p| {
            let cache = p.cache.take();
            Self::build(p, resume, stop, Arc::clone(&comm)).map(|t| (t, cache))
        });
        let (mut trainer, cache) = agree(comm.as_ref(), built)?;
        if let (Some(cache), 0) = (&cache, comm.rank()) {
            cache.note_use();
        }
        trainer.cache = cache;
        Ok(trainer)
    }

    /// The engine for what was prepared, restored to the checkpoint when resuming.
    fn build(p: Prepared, resume: bool, stop: Stop, comm: Arc<dyn Collective>) -> Result<Self> {
        let run = RunDir::new(p.config.run_dir());
        let config = p.config;
        let spec = ModelSpec::new(&config.model);
        let weights = p
            .weights
            .unwrap_or_else(|| spec.initial_values(config.run.seed));
        let options = engine_options(&config.train);
        let mut engine =
            engine::build_replica(&spec, &weights, &p.device, options, Arc::clone(&comm))?;
        drop(weights);
        let mut sampler = BatchSampler::new(config.run.seed, STREAM_TRAIN_BATCHES);
        if resume {
            restore(
                &run,
                &p.state,
                engine.as_mut(),
                &mut sampler,
                comm.rank() == 0,
            )?;
        }
        let batch = Batch::empty(config.train.batch_size, config.model.block_size);
        Ok(Self {
            batch: batch.clone(),
            eval_batch: batch,
            unread: Unread {
                steps: 0,
                since: Instant::now(),
            },
            device_choice: p.device_choice,
            tokenizer: p.tokenizer,
            config,
            run,
            engine,
            split: p.split,
            sampler,
            state: p.state,
            device: p.device,
            session_start: Instant::now(),
            resumed: resume,
            stop,
            comm,
            stopping: None,
            saved: p.saved,
            _lock: p.lock,
            cache: None,
            corpus_fingerprint: p.corpus_fingerprint,
            data_notes: p.data_notes,
        })
    }

    pub fn info(&self) -> RunInfo {
        RunInfo {
            run_dir: self.run.path().to_path_buf(),
            start_step: self.state.step,
            max_iters: self.config.train.max_iters,
            parameters: self.engine.spec().len(),
            train_tokens: self.split.train.len(),
            val_tokens: self.split.val.len(),
            vocab_size: self.tokenizer.vocab_size(),
            model_vocab_size: self.config.model.vocab_size,
            tokenizer: self.tokenizer.kind_name(),
            device: match (&self.device_choice, self.comm.size()) {
                (Some(why), _) => format!("{} (auto: {why})", device::name(&self.device)),
                (None, 1) => device::name(&self.device),
                (None, n) => format!(
                    "{} x {n} ranks ({})",
                    device::name(&self.device),
                    self.comm.describe()
                ),
            },
            engine: self.engine_name(),
            tokens_per_step: self.tokens_per_step(),
        }
    }

    /// Tokens in one optimiser step, over all ranks.
    fn tokens_per_step(&self) -> usize {
        self.sequences_per_step() * self.config.model.block_size
    }

    /// Sequences in one optimiser step, over all ranks.
    fn sequences_per_step(&self) -> usize {
        let train = &self.config.train;
        self.comm.size() * train.batch_size * train.grad_accum
    }

    /// How the engine computes (for the run's first line).
    pub fn engine_name(&self) -> String {
        self.engine.describe()
    }

    /// Refuses a batch holding an id past the vocabulary: the ids were checked when
    /// made (the cache header's largest), so only a file damaged since holds one, and
    /// an engine would index past its embedding. A batch's worth each step costs
    /// nothing beside it; a pass over a corpus of billions of ids at each start would.
    fn check_ids(&self, batch: &Batch) -> Result<()> {
        let (max, vocab) = (batch.max_id(), self.config.model.vocab_size);
        if (max as usize) < vocab {
            return Ok(());
        }
        match &self.cache {
            Some(cache) => user_bail!(
                "the token cache in {} holds id {max}, outside the model's vocabulary of {vocab}: its ids were damaged after they were written; delete that folder and run again (it is made anew)",
                cache.dir().display()
            ),
            None => user_bail!(
                "the token files of {} hold id {max}, outside the model's vocabulary of {vocab}: a file changed after the start checked it; check the corpus's files",
                self.config.data.corpus.display()
            ),
        }
    }

    /// One optimiser step over `grad_accum` micro-batches; reads the loss and the
    /// gradient norm where this step is reported (`reads_at`).
    fn train_step(&mut self) -> Result<StepLog> {
        if self.unread.steps == 0 {
            self.unread.since = Instant::now();
        }
        let cfg = &self.config.train;
        let step = self.state.step;
        let lr = learning_rate(step, cfg);
        let (rank, ranks) = (self.comm.rank(), self.comm.size());
        // The step's micro-batches are those one process with grad_accum = ranks x
        // accum would draw, in its order; this rank computes every ranks-th of them
        // from its rank on, and passes over the others' draws. One buffer serves them
        // all (the engines copy a batch in before they return).
        let micro_batches = ranks * cfg.grad_accum;
        self.engine.zero_grads()?;
        for micro in 0..micro_batches {
            if micro % ranks != rank {
                self.sampler.skip(&self.split.train, &self.batch);
                continue;
            }
            self.sampler.sample_into(&self.split.train, &mut self.batch);
            self.check_ids(&self.batch)?;
            let dropout =
                Dropout::in_pass(self.config.model.dropout, self.config.run.seed, step, micro);
            self.engine.forward(&self.batch, dropout.as_ref())?;
            // Each micro-batch contributes 1/micro_batches of the mean gradient.
            self.engine.backward(1.0 / micro_batches as f32)?;
        }
        self.engine.reduce_grads()?;
        self.engine.clip_grads(cfg.grad_clip)?;
        self.engine.adamw(&AdamWStep::new(cfg, step + 1, lr))?;

        let tokens = self.tokens_per_step();
        self.state.step += 1;
        self.state.tokens_seen += tokens as u64;
        self.unread.steps += 1;
        let measured = if self.reads_at(self.state.step) {
            self.read()?
        } else {
            None
        };
        Ok(StepLog {
            step: self.state.step,
            lr,
            elapsed_s: self.elapsed_s(),
            measured,
        })
    }

    /// Makes a stop asked of any rank a stop of every rank, at the same step: a signal
    /// reaches the ranks at different times (or only some of them), and a rank that
    /// stopped alone would leave the others waiting in their next collective.
    /// (The trainer acts on the agreed signal, never on its own flag, which may be
    /// raised between two agreements on one rank only.)
    fn agree_on_stop(&mut self) -> Result<Option<i32>> {
        let mine = self.stop.signal();
        self.stopping = if self.comm.size() > 1 {
            let asked = self.comm.all_reduce_max(mine.unwrap_or(0).into())?;
            (asked > 0).then_some(asked as i32)
        } else {
            mine
        };
        Ok(self.stopping)
    }

    /// `Err(Stopped)` once any rank was asked to stop.
    fn check_stop(&mut self) -> Result<()> {
        match self.agree_on_stop()? {
            Some(signal) => Err(Stopped { signal }.into()),
            None => Ok(()),
        }
    }

    /// The mean of the losses of every rank's forwards since the last read, in the
    /// order one process would have run them (ranks take work round-robin).
    fn take_mean_loss(&mut self) -> Result<f64> {
        let mine = self.engine.take_losses()?;
        let losses = interleave(&self.comm.all_gather_lists(&mine)?);
        anyhow::ensure!(
            !losses.is_empty(),
            "a loss read with no forward since the last"
        );
        Ok(losses.iter().sum::<f64>() / losses.len() as f64)
    }

    /// Whether the loss is read after `step`: where it is logged, evaluated (whose
    /// forwards must not mix with the training losses the engine sums), saved, or
    /// stopped.
    fn reads_at(&self, step: usize) -> bool {
        let cfg = &self.config.train;
        [cfg.log_interval, cfg.eval_interval, cfg.checkpoint_interval]
            .iter()
            .any(|&every| step.is_multiple_of(every))
            || step >= cfg.max_iters
            || self.stopping.is_some()
    }

    /// The loss and gradient norm of the steps trained since the last read (none if
    /// there are none), checked: a run whose loss or norm is not finite has diverged,
    /// and stays so (NaN weights give NaN losses), so a check here catches it before
    /// anything is saved.
    fn read(&mut self) -> Result<Option<Measured>> {
        let steps = std::mem::take(&mut self.unread.steps);
        if steps == 0 {
            return Ok(None);
        }
        let loss = self.take_mean_loss()?;
        let grad_norm = self.engine.grad_norm()?;
        if !loss.is_finite() || !grad_norm.is_finite() {
            let what = if loss.is_finite() {
                "gradient norm"
            } else {
                "loss"
            };
            return Err(DivergedError {
                step: self.state.step,
                lr: learning_rate(self.state.step - 1, &self.config.train),
                what,
                checkpoint: self.run.state().ok().map(|saved| saved.step),
            }
            .into());
        }
        self.state.last_train_loss = Some(loss);
        let tokens = steps * self.tokens_per_step();
        Ok(Some(Measured {
            steps,
            loss,
            grad_norm,
            tokens_per_s: tokens as f64 / self.unread.since.elapsed().as_secs_f64(),
        }))
    }

    /// Mean loss over `eval_iters` batches of train and of val, reporting each batch;
    /// gives up (`Stopped`) between batches once a stop is asked for. The batches are
    /// the same at every evaluation (a fixed seed), so the curve shows the model
    /// change, not noise. Runs where the training losses were just read.
    fn evaluate_reporting(&mut self, reporter: &mut dyn Reporter) -> Result<EvalLog> {
        let (train, val) = (self.split.train.clone(), self.split.val.clone());
        let iters = self.config.train.eval_iters;
        Ok(EvalLog {
            step: self.state.step,
            train_loss: self.mean_loss(&train, STREAM_EVAL_TRAIN, |done| {
                reporter.evaluating(done, 2 * iters)
            })?,
            val_loss: self.mean_loss(&val, STREAM_EVAL_VAL, |done| {
                reporter.evaluating(iters + done, 2 * iters)
            })?,
        })
    }

    fn mean_loss(
        &mut self,
        tokens: &Tokens,
        stream: u64,
        mut progress: impl FnMut(usize),
    ) -> Result<f64> {
        let iters = self.config.train.eval_iters;
        let (rank, ranks) = (self.comm.rank(), self.comm.size());
        let mut sampler = BatchSampler::new(self.config.run.seed, stream);
        // Batch i is rank i mod ranks's: the ranks split the batches one process
        // would score, and their losses are put back in its order.
        for i in 0..iters {
            self.check_stop()?;
            if i % ranks == rank {
                sampler.sample_into(tokens, &mut self.eval_batch);
                self.check_ids(&self.eval_batch)?;
                self.engine.forward(&self.eval_batch, None)?;
            } else {
                sampler.skip(tokens, &self.eval_batch);
            }
            progress(i + 1);
        }
        self.take_mean_loss()
    }

    pub fn elapsed_s(&self) -> f64 {
        self.state.elapsed_s + self.session_start.elapsed().as_secs_f64()
    }

    /// Writes a checkpoint of the current step: rank 0 writes, the others hand it
    /// their shards of AdamW's moments.
    pub fn save(&self) -> Result<()> {
        let moments = self.engine.moments()?;
        if self.comm.rank() != 0 {
            return Ok(());
        }
        let mut state = self.state.clone();
        state.elapsed_s = self.elapsed_s();
        state.sampler_position = self.sampler.position().to_string();
        state.ranks = self.comm.size();
        state.sequences_per_step = self.sequences_per_step();
        state.corpus_fingerprint = Some(self.corpus_fingerprint.clone());
        let weights = self.engine.weights()?;
        self.run
            .save(&self.config, &self.tokenizer, &weights, &moments, &state)
    }

    /// Appends a line to metrics.jsonl (rank 0 writes the run folder).
    fn log_metrics(&self, line: &serde_json::Value) -> Result<()> {
        match self.comm.rank() {
            0 => self.run.append_metrics(line),
            _ => Ok(()),
        }
    }

    /// Appends the loss and tokens/s of the steps read up to `step` (the last at
    /// rate `lr`) to metrics.jsonl.
    fn log_measured(&self, step: usize, lr: f64, elapsed_s: f64, m: &Measured) -> Result<()> {
        self.log_metrics(&json!({
            "step": step, "loss": m.loss, "lr": lr, "grad_norm": m.grad_norm,
            "tokens_per_s": m.tokens_per_s, "elapsed_s": elapsed_s,
        }))
    }

    /// Evaluates, records the losses in the state and metrics.jsonl, and reports.
    fn evaluate_and_log(&mut self, reporter: &mut dyn Reporter) -> Result<()> {
        let e = self.evaluate_reporting(reporter)?;
        self.state.last_val_loss = Some(e.val_loss);
        self.state.last_train_loss = Some(e.train_loss);
        let best = self
            .state
            .best_val_loss
            .map_or(e.val_loss, |b| b.min(e.val_loss));
        self.state.best_val_loss = Some(best);
        self.log_metrics(&json!({
            "step": e.step, "train_loss": e.train_loss, "val_loss": e.val_loss,
            // The rate of the update that led here, as the training line of this step
            // logs it (at step 0, the first update's).
            "lr": learning_rate(e.step.saturating_sub(1), &self.config.train),
            "elapsed_s": self.elapsed_s(),
        }))?;
        reporter.eval(&e);
        Ok(())
    }

    /// Trains to `max_iters`: eval at every `eval_interval` (and at the end), metrics
    /// every `log_interval`, checkpoint every `checkpoint_interval` and at the end.
    pub fn run(&mut self, reporter: &mut dyn Reporter) -> Result<TrainSummary> {
        let cfg = self.config.train.clone();
        self.say_before_training(reporter)?;
        let start = self.state.step;
        let mut step = start;
        // A resumed run evaluated its first step before the checkpoint, unless a stop
        // cut that evaluation short.
        // Rank 0's reading of its run folder decides for every rank.
        let evaluated_start = self.resumed && {
            let here = self.comm.rank() == 0 && self.run.has_eval_at(start);
            self.comm.all_reduce_max(here.into())? == 1
        };
        loop {
            let is_last = step >= cfg.max_iters;
            let done_already = evaluated_start && step == start;
            let evaluate = (step.is_multiple_of(cfg.eval_interval) || is_last) && !done_already;
            if evaluate {
                if let Err(e) = self.evaluate_and_log(reporter) {
                    return Err(match e.downcast_ref::<Stopped>() {
                        Some(stopped) => self.interrupt(stopped.signal, step > start, reporter)?,
                        None => self.explain(e),
                    });
                }
                if !is_last {
                    // The curve so far, for whoever watches the run (the end's draw,
                    // below, says what went wrong where one fails).
                    self.draw_loss_curve();
                }
            }
            // A resumed run that redid the evaluation a stop cut short saves it too (its
            // last step may need no training at all).
            let redid_evaluation = evaluate && self.resumed && step == start;
            if (step > start || redid_evaluation)
                && (step.is_multiple_of(cfg.checkpoint_interval) || is_last)
            {
                reporter.saving();
                self.save()?;
                let at = self.run.path().display();
                reporter.note(&format!("checkpoint: {at} at step {step}"));
                // A stop asked during the save (a large model's takes seconds) stops
                // here: the checkpoint is this step's, no step more to train and save.
                if let (Some(signal), false) = (self.agree_on_stop()?, is_last) {
                    return Err(self.interrupt(signal, false, reporter)?);
                }
            }
            if is_last {
                break;
            }
            let log = self.train_step().map_err(|e| self.explain(e))?;
            step = log.step;
            if let Some(m) = &log.measured {
                self.log_measured(log.step, log.lr, log.elapsed_s, m)?;
            }
            reporter.step(&log);
            // A stop asked of any rank during this step (or its report) stops all here.
            if let (Some(signal), true) = (self.agree_on_stop()?, step < cfg.max_iters) {
                // The evaluation due at this step is left to the resumed run.
                return Err(self.interrupt(signal, true, reporter)?);
            }
        }
        if self.comm.rank() == 0 {
            match plot::run_loss_curve(self.run.path()) {
                Ok(png) => reporter.note(&format!("loss curve: {}", png.display())),
                Err(e) => reporter.note(&format!("no loss curve: {e:#}")),
            }
        }
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

impl Trainer {
    /// What a run says before its first step: its settings and data, and what may
    /// surprise (a warmup longer than the run, a model `export` will refuse, how a stop
    /// through mpirun is timed, what a resume changed).
    fn say_before_training(&mut self, reporter: &mut dyn Reporter) -> Result<()> {
        let cfg = &self.config.train;
        reporter.started(&self.info());
        for note in &self.data_notes {
            reporter.note(note);
        }
        let (start, end) = (self.state.step, cfg.max_iters);
        if cfg.warmup_iters > end && start < end && cfg.lr > 0.0 {
            // The rate still rising when training ends: the loss barely moves, and
            // nothing else would say why.
            reporter.note(&format!(
                "note: train.warmup_iters = {} is longer than the run (train.max_iters = {end}): the learning rate reaches {:.1e}, {} of train.lr; lower warmup_iters for a short run",
                cfg.warmup_iters,
                learning_rate(end - 1, cfg),
                match 100.0 * learning_rate(end - 1, cfg) / cfg.lr {
                    share if share < 1.0 => format!("{share:.2}%"),
                    share => format!("{share:.0}%"),
                }
            ));
        }
        if !self.resumed {
            // Said before the run, not after it: only training anew changes this.
            if let Err(e) = crate::interop::layout_for(&self.config.model) {
                reporter.note(&format!(
                    "note: `tinygpt export` will refuse this model: {e:#}"
                ));
            }
        }
        if self.comm.size() > 1 {
            // A checkpoint: the weights and AdamW's two moments, f32 each.
            let checkpoint_bytes = 3 * 4 * ModelSpec::new(&self.config.model).len();
            if let Some(note) = crate::parallel::launcher::open_mpi_stop_note(checkpoint_bytes) {
                reporter.note(&note);
            }
        }
        if let (true, Some(saved)) = (self.resumed, &self.saved) {
            let resumed = Resumed {
                saved,
                state: &self.state,
                now: &self.config,
                corpus_fingerprint: &self.corpus_fingerprint,
                sequences_per_step: self.sequences_per_step(),
                ranks: self.comm.size(),
            };
            for note in resumed.notes() {
                reporter.note(&note);
            }
            if self.state.step < self.config.train.max_iters {
                reporter.note(&resumed.rate());
                // metrics.jsonl says what changed here, so that `compare` can tell this
                // run from one trained with the new settings from the start.
                let changed = resumed.changed_settings();
                if !changed.is_empty() {
                    let step = self.state.step;
                    self.log_metrics(&json!({"step": step, "resumed": changed}))?;
                }
            }
        }
        Ok(())
    }

    /// loss.png from metrics.jsonl as it is now (rank 0; ~10 ms for a thousand steps,
    /// 0.14 s for 100,000); a failure leaves the last one.
    fn draw_loss_curve(&self) {
        if self.comm.rank() == 0 {
            let _ = plot::run_loss_curve(self.run.path());
        }
    }

    /// A device that ran out of memory mid-run is a one-line user error (the batch is
    /// too big for it), not the device library's internals; other errors pass.
    fn explain(&self, error: anyhow::Error) -> anyhow::Error {
        if !crate::device::is_out_of_memory(&error) {
            return error;
        }
        let kept = if self.run.has_checkpoint() {
            format!(
                "the last checkpoint in {} stands",
                self.run.path().display()
            )
        } else {
            "no checkpoint was written yet".to_string()
        };
        let which = if self.device.is_cpu() {
            "the machine"
        } else {
            "the GPU"
        };
        crate::error::user_error(format!(
            "{which} ran out of memory at step {}; {kept}; use a smaller train.batch_size with a larger train.grad_accum, a shorter model.block_size, or train.dtype = \"bf16\"",
            self.state.step
        ))
    }

    /// Stops for `signal`: saves the current step if it trained (`save`), and says what
    /// was kept and how to continue.
    fn interrupt(
        &mut self,
        signal: i32,
        save: bool,
        reporter: &mut dyn Reporter,
    ) -> Result<anyhow::Error> {
        if save {
            // Steps the signal arrived too late to read: checked before they are kept,
            // and logged, so that the metrics reach the checkpoint's step (a curve or
            // `compare` would end at the last log_interval's).
            if let Some(m) = self.read()? {
                let step = self.state.step;
                let lr = learning_rate(step - 1, &self.config.train);
                self.log_measured(step, lr, self.elapsed_s(), &m)?;
            }
            reporter.saving();
            self.save()?;
        }
        self.draw_loss_curve();
        let saved = self.run.has_checkpoint();
        let continue_with = match saved {
            true => "the same command and --resume",
            false => "the same command",
        };
        Ok(InterruptedError {
            signal,
            step: self.state.step,
            run_dir: self.run.path().to_path_buf(),
            continue_with: continue_with.into(),
            saved,
        }
        .into())
    }
}

/// Trains as the config says (`resume` continues the run folder's checkpoint).
pub fn train(config: Config, resume: bool, reporter: &mut dyn Reporter) -> Result<TrainSummary> {
    let mut trainer = Trainer::new(config, resume)?;
    trainer.run(reporter)
}
