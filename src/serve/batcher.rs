//! Continuous batching: one thread owns the model and decodes every request's
//! sequences together, one pass per token.
//!
//! A request brings a prompt and one sampler per choice (`n`); each choice is a
//! sequence in a slot of the decoder's K/V buffers. Each pass runs, for every sequence,
//! the tokens it has not run yet: one for a sequence that is generating (the token it
//! drew last pass), a piece of its prompt for one that joined. Sequences join when
//! slots are free and leave when they finish, when their client goes away, or when the
//! server stops, all at token boundaries: nobody waits for the batch to drain.
//!
//! A joining prompt is run in pieces while others generate (chunked prefill): beside
//! `g` generating sequences a pass takes at most `max(g, PREFILL_ROWS)` prompt
//! positions, so a long prompt slows the others' next token by about one pass, not by
//! its whole length. With nobody generating, a prompt runs whole, as `generate` runs it.
//!
//! Every sequence draws from its own seeded sampler over its own window, and the
//! window slides as `generate::Decoder`'s does (the last half kept and run again), so
//! a request decoded alone gives `tinygpt generate`'s text for the same seed.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use anyhow::Result;
use rayon::prelude::*;
use tokio::sync::mpsc::UnboundedSender;

use super::metrics::Metrics;
use crate::cpu::{FastDecoder, Place};
use crate::generate::sample::Sampler;
use crate::generate::StopFilter;
use crate::tokenizer::{TextStream, Tokenizer};
use crate::util::Stop;

/// Prompt positions a pass takes beside the generating sequences' tokens, at least (as
/// many as there are generating sequences, when more). A pass reads every weight once
/// whatever its rows, so rows added to a small pass cost far less than passes of their
/// own: while a crowd arrives, its prompts get in within a few passes instead of a
/// few positions a pass behind the first few to generate. The generating sequences'
/// next token is late by about one pass while a prompt joins. Measured (GPT-2 124M
/// shape, 2 cores of a Xeon, f32, 16 clients arriving at once with 20-token prompts,
/// 64 tokens each, interleaved): 4 rows gave 177-193 tokens/s and first token p50
/// 0.7-1.0 s; 32 rows 214-239 tokens/s and 0.53 s (per-token p99 81-101 -> 99-105 ms);
/// int8 level in tokens/s, first token p50 0.42-1.2 s -> 0.45-0.57 s. Earlier, at 4
/// rows (16 prompt rows a pass beside 16 streams), 6 layers of 384: 16 streams waited
/// 16 ms a token, at most 29-34 ms while a 256-token prompt joined; beside 16 streams a
/// pass now takes 32, so such a join is shorter and each of its passes longer.
const PREFILL_ROWS: usize = 32;

/// One request, as the HTTP side hands it over: validated, tokenized.
pub struct Job {
    /// One or more prompts, each continued `samplers.len() / prompts.len()` times:
    /// choice i continues prompt i / n (OpenAI's numbering of a list of prompts).
    pub prompts: Vec<Vec<u32>>,
    /// One per choice; choice i draws with `samplers[i]`.
    pub samplers: Vec<Sampler>,
    /// 0 where only the prompt is wanted (`echo`): nothing drawn.
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// How many most likely tokens to report beside each drawn one (`logprobs`).
    pub logprobs: Option<usize>,
    /// Report the prompt's own tokens' log-probabilities too, each under the tokens
    /// before it (`echo` with `logprobs`): the first has none.
    pub score_prompt: bool,
    pub events: UnboundedSender<Event>,
}

/// What a request hears back, choice by choice, as it decodes.
#[derive(Debug)]
pub enum Event {
    /// Text to show (never part of a stop string, never half a character), with the
    /// tokens it came from when logprobs were asked for.
    Text {
        choice: usize,
        text: String,
        tokens: Vec<TokenLogprob>,
    },
    /// The choice is finished.
    Done {
        choice: usize,
        finish: Finish,
        completion_tokens: usize,
    },
    /// The request cannot go on (it had already begun, or the server is stopping).
    Failed { status: u16, message: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// A stop string or the end-of-text token.
    Stop,
    /// max_tokens reached, or the server stopping cut it short.
    Length,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// A token's log-probability under the model (before temperature and truncation), and
/// the most likely alternatives' at its place; none for a prompt's first token, which
/// nothing predicts.
#[derive(Debug, Clone)]
pub struct TokenLogprob {
    pub token: Piece,
    pub logprob: Option<f32>,
    pub top: Vec<(Piece, f32)>,
}

/// A token as text (lossily: half a character shows as U+FFFD) and as the bytes it
/// stands for (chat's logprobs give both).
#[derive(Debug, Clone)]
pub struct Piece {
    pub text: String,
    pub bytes: Vec<u8>,
}

impl Piece {
    fn of(tokenizer: &Tokenizer, id: u32) -> Self {
        let bytes = tokenizer.token_bytes(id).unwrap_or_default();
        Self {
            text: String::from_utf8_lossy(&bytes).into_owned(),
            bytes,
        }
    }
}

impl TokenLogprob {
    /// A prompt's first token `id`: nothing predicts it.
    fn unpredicted(id: u32, tokenizer: &Tokenizer) -> Self {
        Self {
            token: Piece::of(tokenizer, id),
            logprob: None,
            top: Vec::new(),
        }
    }
}

/// What a decoder must do for the batcher: run rows of sequences at their own positions
/// (`FastDecoder::run_rows`).
pub trait RowModel {
    /// Sequences it holds at once.
    fn slots(&self) -> usize;
    /// Rows one pass can take.
    fn max_rows(&self) -> usize;
    /// Rows one pass can give logits of (at least one per slot).
    fn max_outputs(&self) -> usize;
    fn block_size(&self) -> usize;
    fn vocab_size(&self) -> usize;
    /// Logits of the rows `outputs` names, (outputs.len(), V).
    fn run(&mut self, ids: &[u32], places: &[Place], outputs: &[usize]) -> Result<&[f32]>;
}

/// Both decoders hold their sequences in slots and run rows at their own places alike.
macro_rules! row_model {
    ($decoder:ty) => {
        impl RowModel for $decoder {
            fn slots(&self) -> usize {
                self.batch()
            }
            fn max_rows(&self) -> usize {
                self.rows_per_pass()
            }
            fn max_outputs(&self) -> usize {
                self.outputs_per_pass()
            }
            fn block_size(&self) -> usize {
                self.spec().config.block_size
            }
            fn vocab_size(&self) -> usize {
                self.spec().config.vocab_size
            }
            fn run(&mut self, ids: &[u32], places: &[Place], outputs: &[usize]) -> Result<&[f32]> {
                self.run_rows(ids, places, outputs)
            }
        }
    };
}

row_model!(FastDecoder);
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
row_model!(crate::cuda::CudaDecoder);

/// A request being decoded.
struct Active {
    job: Job,
    /// Choices not finished yet.
    running: usize,
}

/// One choice of one request, in its slot.
struct Sequence<'t> {
    /// When it was admitted: prompts take a pass's rows first come, first served.
    admitted: u64,
    request: usize,
    choice: usize,
    sampler: Sampler,
    logprobs: Option<usize>,
    /// Prompt positions still to be scored (`Job::score_prompt`): those below it.
    scoring: usize,
    max_tokens: usize,
    /// The tokens the next logits are conditioned on; the first `cached` are in the
    /// slot's K/V buffers, the rest run in the next pass.
    window: Vec<u32>,
    cached: usize,
    stream: TextStream<'t>,
    stops: StopFilter,
    generated: usize,
    /// Drawn tokens' log-probabilities not yet sent with text.
    unsent: Vec<TokenLogprob>,
}

/// The decoding loop: runs until `stop` is asked (or every sender is gone), then ends
/// every request (running ones cut with finish "length", queued ones told the server
/// is stopping) and returns.
pub fn run(
    model: &mut dyn RowModel,
    tokenizer: &Tokenizer,
    jobs: Receiver<Job>,
    metrics: &Metrics,
    stop: &Stop,
) {
    let mut batcher = Batcher::new(model, tokenizer, metrics);
    let mut queue: VecDeque<Job> = VecDeque::new();
    loop {
        // Idle: wait for work, waking now and then to see a stop.
        if batcher.is_idle() && queue.is_empty() {
            match jobs.recv_timeout(Duration::from_millis(50)) {
                Ok(job) => queue.push_back(job),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
        queue.extend(jobs.try_iter());
        if stop.signal().is_some() {
            batcher.cut_all();
            for job in queue.drain(..) {
                metrics.queued.fetch_sub(1, Ordering::Relaxed);
                let _ = job.events.send(Event::Failed {
                    status: 503,
                    message: "the server is stopping".into(),
                });
            }
            return;
        }
        // Clients that went away free their place in the queue, or their slots.
        queue.retain(|job| {
            let gone = job.events.is_closed();
            if gone {
                metrics.queued.fetch_sub(1, Ordering::Relaxed);
                metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            }
            !gone
        });
        batcher.drop_abandoned();
        // First come, first served: a request waits for slots for all its choices.
        while queue
            .front()
            .is_some_and(|job| job.samplers.len() <= batcher.free_slots())
        {
            let job = queue.pop_front().expect("a front");
            metrics.queued.fetch_sub(1, Ordering::Relaxed);
            batcher.admit(job);
        }
        if batcher.is_idle() {
            continue;
        }
        if let Err(e) = batcher.pass() {
            // A failed pass leaves the K/V buffers unknown: end everything running.
            batcher.fail_all(&format!("decoding failed: {e:#}"));
        }
    }
}

/// What a row's logits are for.
#[derive(Debug, Clone, Copy)]
enum Use {
    /// Scoring a prompt: the log-probability of `target`, the prompt's next token.
    Score { slot: usize, target: u32 },
    /// Drawing the sequence's next token.
    Draw(usize),
}

struct Batcher<'m, 't> {
    model: &'m mut dyn RowModel,
    tokenizer: &'t Tokenizer,
    metrics: &'m Metrics,
    /// Requests by id (a slab: finished ones leave `None`).
    requests: Vec<Option<Active>>,
    /// Sequences by slot.
    slots: Vec<Option<Sequence<'t>>>,
    text_vocab: usize,
    end_of_text: Option<u32>,
    // A pass's rows, kept between passes.
    ids: Vec<u32>,
    places: Vec<Place>,
    outputs: Vec<usize>,
    /// What each output row's logits are for.
    uses: Vec<Use>,
    /// Requests admitted so far (each sequence's `admitted`).
    admissions: u64,
    /// Slots in the order their sequences were admitted.
    order: Vec<usize>,
    /// A pass's drawing rows: (slot, index among the output rows).
    draws: Vec<(usize, usize)>,
    /// The slot each drawing row belongs to (ascending).
    output_slots: Vec<usize>,
    scratch: Vec<f32>,
    chosen: Vec<(u32, Option<TokenLogprob>)>,
}

impl<'m, 't> Batcher<'m, 't> {
    fn new(model: &'m mut dyn RowModel, tokenizer: &'t Tokenizer, metrics: &'m Metrics) -> Self {
        let slots = model.slots();
        let text_vocab = tokenizer.vocab_size().min(model.vocab_size());
        Self {
            model,
            tokenizer,
            metrics,
            requests: Vec::new(),
            slots: (0..slots).map(|_| None).collect(),
            text_vocab,
            end_of_text: tokenizer.end_of_text(),
            ids: Vec::new(),
            places: Vec::new(),
            outputs: Vec::new(),
            uses: Vec::new(),
            admissions: 0,
            order: Vec::new(),
            draws: Vec::new(),
            output_slots: Vec::new(),
            scratch: Vec::new(),
            chosen: Vec::new(),
        }
    }

    fn is_idle(&self) -> bool {
        self.slots.iter().all(Option::is_none)
    }

    fn free_slots(&self) -> usize {
        self.slots.iter().filter(|s| s.is_none()).count()
    }

    fn admit(&mut self, mut job: Job) {
        let id = match self.requests.iter().position(Option::is_none) {
            Some(free) => free,
            None => {
                self.requests.push(None);
                self.requests.len() - 1
            }
        };
        let samplers = std::mem::take(&mut job.samplers);
        let running = samplers.len();
        let per_prompt = running / job.prompts.len();
        let free: Vec<usize> = (0..self.slots.len())
            .filter(|&s| self.slots[s].is_none())
            .take(running)
            .collect();
        for (choice, (sampler, slot)) in samplers.into_iter().zip(free).enumerate() {
            let prompt = &job.prompts[choice / per_prompt];
            if job.score_prompt {
                // The first token: nothing before it to predict it.
                let _ = job.events.send(Event::Text {
                    choice,
                    text: String::new(),
                    tokens: vec![TokenLogprob::unpredicted(prompt[0], self.tokenizer)],
                });
            }
            self.slots[slot] = Some(Sequence {
                admitted: self.admissions,
                request: id,
                choice,
                sampler,
                logprobs: job.logprobs,
                scoring: if job.score_prompt {
                    prompt.len() - 1
                } else {
                    0
                },
                max_tokens: job.max_tokens,
                window: prompt.clone(),
                cached: 0,
                stream: self.tokenizer.text_stream(),
                stops: StopFilter::new(job.stop.clone()),
                generated: 0,
                unsent: Vec::new(),
            });
        }
        self.admissions += 1;
        self.metrics.running.fetch_add(1, Ordering::Relaxed);
        let prompt_tokens: usize = job.prompts.iter().map(Vec::len).sum();
        self.metrics
            .prompt_tokens
            .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        self.requests[id] = Some(Active { job, running });
    }

    /// One pass: every sequence's pending tokens (prompts in pieces, within the
    /// budget), then a token drawn for each sequence whose last pending token ran; a
    /// prompt wanted alone (max_tokens 0) ends once its last row has run.
    fn pass(&mut self) -> Result<()> {
        self.run_and_draw()?;
        for slot in 0..self.slots.len() {
            let scored_alone = self.slots[slot]
                .as_ref()
                .is_some_and(|s| s.max_tokens == 0 && s.cached == s.window.len());
            if scored_alone {
                self.finish(slot, Finish::Length);
            }
        }
        Ok(())
    }

    fn run_and_draw(&mut self) -> Result<()> {
        let started = Instant::now();
        let vocab = self.model.vocab_size();
        self.ids.clear();
        self.places.clear();
        self.outputs.clear();
        self.uses.clear();
        let generating = self
            .slots
            .iter()
            .flatten()
            .filter(|s| s.window.len() - s.cached == 1)
            .count();
        let max_rows = self.model.max_rows();
        let mut prompt_budget = match generating {
            0 => max_rows,
            g => g.max(PREFILL_ROWS).min(max_rows - g),
        };
        // A pass gives logits of a bounded number of rows: one for each generating
        // sequence, the rest for prompts that end or are scored here.
        let mut spare_outputs = self.model.max_outputs() - generating;
        self.order.clear();
        self.order
            .extend((0..self.slots.len()).filter(|&s| self.slots[s].is_some()));
        let slots = &self.slots;
        self.order
            .sort_by_key(|&s| slots[s].as_ref().map(|seq| seq.admitted));
        for &slot in &self.order {
            let Some(seq) = &self.slots[slot] else {
                continue;
            };
            let pending = seq.window.len() - seq.cached;
            let take = match pending {
                1 => 1,
                _ => {
                    let draws = |take: usize| take == pending && seq.max_tokens > 0;
                    let outputs = |take: usize| {
                        let scored = (seq.cached + take).min(seq.scoring);
                        scored.saturating_sub(seq.cached) + usize::from(draws(take))
                    };
                    let mut take = pending.min(prompt_budget);
                    while take > 0 && outputs(take) > spare_outputs {
                        take -= 1;
                    }
                    spare_outputs -= outputs(take);
                    prompt_budget -= take;
                    take
                }
            };
            for pos in seq.cached..seq.cached + take {
                self.ids.push(seq.window[pos]);
                self.places.push(Place { seq: slot, pos });
                // A scored prompt needs each row's logits: they predict the next token.
                if pos < seq.scoring {
                    self.outputs.push(self.ids.len() - 1);
                    self.uses.push(Use::Score {
                        slot,
                        target: seq.window[pos + 1],
                    });
                }
            }
            // A prompt wanted alone (max_tokens 0) draws nothing: it ends once scored.
            if take > 0 && take == pending && seq.max_tokens > 0 {
                self.outputs.push(self.ids.len() - 1);
                self.uses.push(Use::Draw(slot));
            }
        }
        let logits = self.model.run(&self.ids, &self.places, &self.outputs)?;
        for place in &self.places {
            if let Some(seq) = &mut self.slots[place.seq] {
                seq.cached = seq.cached.max(place.pos + 1);
                if seq.cached >= seq.scoring {
                    // Scored once: a window slid later runs these positions again.
                    seq.scoring = 0;
                }
            }
        }
        // The scored prompt rows' log-probabilities go out ahead of what is drawn.
        let (text_vocab, tokenizer) = (self.text_vocab, self.tokenizer);
        let rows: Vec<&[f32]> = logits.chunks(vocab).collect();
        let scored: Vec<(usize, TokenLogprob)> = self
            .uses
            .par_iter()
            .zip(&rows)
            .filter_map(|(use_, row)| match *use_ {
                Use::Score { slot, target } => {
                    let k = self.slots[slot].as_ref().and_then(|s| s.logprobs);
                    let text = &row[..text_vocab];
                    let entry = LogSoftmax::of(text, k.unwrap_or(0)).report(row, target, tokenizer);
                    Some((slot, entry))
                }
                Use::Draw(_) => None,
            })
            .collect();
        for (slot, entry) in scored {
            if let Some(seq) = &mut self.slots[slot] {
                seq.unsent.push(entry);
            }
        }
        // The drawing rows' logits, in slot order, are what the samplers read.
        self.draws.clear();
        self.draws.extend(
            self.uses
                .iter()
                .enumerate()
                .filter_map(|(k, use_)| match *use_ {
                    Use::Draw(slot) => Some((slot, k)),
                    Use::Score { .. } => None,
                }),
        );
        self.draws.sort_unstable();
        if self.draws.is_empty() {
            self.metrics.record_pass(self.ids.len(), started.elapsed());
            return Ok(());
        }
        let raw: Vec<&[f32]> = self.draws.iter().map(|&(_, k)| rows[k]).collect();
        self.output_slots.clear();
        self.output_slots
            .extend(self.draws.iter().map(|&(slot, _)| slot));

        // Draw: each sequence with its own sampler, so threads cannot change a draw.
        self.scratch.clear();
        raw.iter()
            .for_each(|row| self.scratch.extend_from_slice(row));
        let mut wanted = self.output_slots.iter().peekable();
        let drawing: Vec<&mut Sequence> = self
            .slots
            .iter_mut()
            .enumerate()
            .filter_map(|(slot, seq)| {
                let hit = wanted.next_if_eq(&&slot).is_some();
                seq.as_mut().filter(|_| hit)
            })
            .collect();
        self.chosen.clear();
        self.chosen.resize(drawing.len(), (0, None));
        drawing
            .into_par_iter()
            .zip(self.scratch.par_chunks_mut(vocab))
            .zip(raw.par_iter())
            .zip(self.chosen.par_iter_mut())
            .for_each(|(((seq, row), raw), chosen)| {
                row[text_vocab..].fill(f32::NEG_INFINITY);
                let id = seq.sampler.sample(row, &seq.window);
                // Log-probabilities are the model's own (the logits before the
                // sampler's changes), over the tokens text has.
                let logprob = seq
                    .logprobs
                    .map(|k| LogSoftmax::of(&raw[..text_vocab], k).report(raw, id, tokenizer));
                *chosen = (id, logprob);
            });

        let chosen = std::mem::take(&mut self.chosen);
        let slots = std::mem::take(&mut self.output_slots);
        for (&slot, (id, logprob)) in slots.iter().zip(&chosen) {
            // A request that failed on an earlier choice of this pass has left.
            if self.slots[slot].is_none() {
                continue;
            }
            if let Err(e) = self.take_token(slot, *id, logprob.clone()) {
                let request = self.slots[slot].as_ref().map(|s| s.request);
                if let Some(request) = request {
                    self.fail_request(request, 500, &format!("{e:#}"));
                }
            }
        }
        self.chosen = chosen;
        self.output_slots = slots;
        self.metrics.record_pass(self.ids.len(), started.elapsed());
        Ok(())
    }

    /// A drawn token: ends the choice (end of text, a stop string, max_tokens) or
    /// becomes its next pending row, and its text goes out.
    fn take_token(&mut self, slot: usize, id: u32, logprob: Option<TokenLogprob>) -> Result<()> {
        let block = self.model.block_size();
        let seq = self.slots[slot].as_mut().expect("a drawing sequence");
        // Every drawn token's logprob is reported, end of text included: a harness
        // reading all entries but the last (the drawn one) relies on it.
        seq.unsent.extend(logprob);
        if Some(id) == self.end_of_text {
            self.finish(slot, Finish::Stop);
            return Ok(());
        }
        seq.generated += 1;
        self.metrics
            .generated_tokens
            .fetch_add(1, Ordering::Relaxed);
        // A full window slides as `generate::Decoder`'s: its last half runs again.
        if seq.window.len() == block {
            seq.window.drain(..block - block / 2);
            seq.cached = 0;
        }
        seq.window.push(id);
        if let Some(piece) = seq.stream.push(id)? {
            let shown = seq.stops.push(&piece);
            if !shown.is_empty() {
                let tokens = std::mem::take(&mut seq.unsent);
                let events = &self.requests[seq.request]
                    .as_ref()
                    .expect("its request")
                    .job
                    .events;
                let _ = events.send(Event::Text {
                    choice: seq.choice,
                    text: shown,
                    tokens,
                });
            }
            if seq.stops.stopped() {
                // The tokens that spelled the stop string (and what followed it) are
                // not part of the answer: their logprobs go with their text.
                let mut cut = seq.stops.cut_bytes();
                while let Some(last) = seq.unsent.last() {
                    let len = last.token.bytes.len();
                    if len == 0 || len > cut {
                        break;
                    }
                    cut -= len;
                    seq.unsent.pop();
                }
                self.finish(slot, Finish::Stop);
                return Ok(());
            }
        }
        if seq.generated == seq.max_tokens {
            self.finish(slot, Finish::Length);
        }
        Ok(())
    }

    /// Ends the choice in `slot`: what its filters held back goes out, then `Done`.
    fn finish(&mut self, slot: usize, finish: Finish) {
        let Some(mut seq) = self.slots[slot].take() else {
            return;
        };
        let mut text = String::new();
        if let Some(tail) = seq.stream.finish() {
            text.push_str(&seq.stops.push(&tail));
        }
        text.push_str(&seq.stops.finish());
        let request = self.requests[seq.request].as_mut().expect("its request");
        let events = &request.job.events;
        if !text.is_empty() || !seq.unsent.is_empty() {
            let _ = events.send(Event::Text {
                choice: seq.choice,
                text,
                tokens: std::mem::take(&mut seq.unsent),
            });
        }
        // The gauges move before the last `Done` goes out: a client that has
        // its whole answer must find it counted in /metrics.
        request.running -= 1;
        if request.running == 0 {
            self.metrics.running.fetch_sub(1, Ordering::Relaxed);
            self.metrics.completed.fetch_add(1, Ordering::Relaxed);
        }
        let _ = events.send(Event::Done {
            choice: seq.choice,
            finish,
            completion_tokens: seq.generated,
        });
        if request.running == 0 {
            self.requests[seq.request] = None;
        }
    }

    /// Frees the slots of requests whose client has gone.
    fn drop_abandoned(&mut self) {
        for id in 0..self.requests.len() {
            let gone = self.requests[id]
                .as_ref()
                .is_some_and(|r| r.job.events.is_closed());
            if gone {
                self.remove(id);
                self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn fail_request(&mut self, id: usize, status: u16, message: &str) {
        // Counted before the client hears of it, as in `finish`.
        let Some(events) = self.requests[id].as_ref().map(|a| a.job.events.clone()) else {
            return;
        };
        self.remove(id);
        self.metrics.failed.fetch_add(1, Ordering::Relaxed);
        let _ = events.send(Event::Failed {
            status,
            message: message.to_string(),
        });
    }

    fn remove(&mut self, id: usize) {
        for slot in &mut self.slots {
            if slot.as_ref().is_some_and(|s| s.request == id) {
                *slot = None;
            }
        }
        if self.requests[id].take().is_some() {
            self.metrics.running.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// The server is stopping: every running choice ends here, with what it has.
    fn cut_all(&mut self) {
        for slot in 0..self.slots.len() {
            self.finish(slot, Finish::Length);
        }
    }

    fn fail_all(&mut self, message: &str) {
        for id in 0..self.requests.len() {
            self.fail_request(id, 500, message);
        }
    }
}

/// A row's log-softmax normaliser, and its `k` most likely tokens.
struct LogSoftmax {
    log_z: f32,
    top: Vec<(u32, f32)>,
}

impl LogSoftmax {
    fn of(row: &[f32], k: usize) -> Self {
        // The maximum and the sum of exponentials as `eval --dtype` scores a row (its
        // logarithm then taken here in f32, as the logprobs are).
        let (max, sum) = crate::cpu::ops::loss::max_and_sum_exp(row);
        let log_z = max + sum.ln() as f32;
        let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
        for (id, &x) in row.iter().enumerate() {
            if top.len() < k || top.last().is_some_and(|&(_, y)| x > y) {
                let at = top.partition_point(|&(_, y)| y >= x);
                top.insert(at, (id as u32, x));
                top.truncate(k);
            }
        }
        Self {
            log_z,
            top: top.into_iter().map(|(id, x)| (id, x - log_z)).collect(),
        }
    }

    /// Token `id`'s entry, `row` being the logits the normaliser was taken of.
    fn report(self, row: &[f32], id: u32, tokenizer: &Tokenizer) -> TokenLogprob {
        TokenLogprob {
            token: Piece::of(tokenizer, id),
            logprob: Some(row[id as usize] - self.log_z),
            top: self
                .top
                .into_iter()
                .map(|(t, lp)| (Piece::of(tokenizer, t), lp))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::sample::SamplingParams;

    /// A model whose every row predicts end-of-text, by a margin `MARGIN` over every
    /// other token: what the batcher reports is then known exactly.
    struct EndsAtOnce {
        vocab: usize,
        end_of_text: u32,
        logits: Vec<f32>,
    }

    const MARGIN: f32 = 3.0;

    impl RowModel for EndsAtOnce {
        fn slots(&self) -> usize {
            2
        }
        fn max_rows(&self) -> usize {
            64
        }
        fn max_outputs(&self) -> usize {
            2
        }
        fn block_size(&self) -> usize {
            16
        }
        fn vocab_size(&self) -> usize {
            self.vocab
        }
        fn run(&mut self, _: &[u32], _: &[Place], outputs: &[usize]) -> Result<&[f32]> {
            self.logits = vec![0.0; outputs.len() * self.vocab];
            for row in self.logits.chunks_mut(self.vocab) {
                row[self.end_of_text as usize] = MARGIN;
            }
            Ok(&self.logits)
        }
    }

    /// A scored prompt (echo with logprobs) whose drawn token is end-of-text: every
    /// prompt token's entry (the first without a logprob), then the drawn end-of-text's,
    /// each the model's log-softmax; scored in pieces (two rows of logits a pass).
    #[test]
    fn a_scored_prompt_reports_every_token_end_of_text_included() {
        let tokenizer = Tokenizer::train_bpe_on(["to be or not to be"].iter(), 300).unwrap();
        let end_of_text = tokenizer.end_of_text().unwrap();
        let vocab = tokenizer.vocab_size();
        let mut model = EndsAtOnce {
            vocab,
            end_of_text,
            logits: Vec::new(),
        };
        let metrics = Metrics::default();
        let prompt = tokenizer.encode("to be or not").unwrap();
        let (events, mut received) = tokio::sync::mpsc::unbounded_channel();
        let greedy = SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        };
        let job = Job {
            prompts: vec![prompt.clone()],
            samplers: vec![Sampler::new(greedy, 1).unwrap()],
            max_tokens: 5,
            stop: Vec::new(),
            logprobs: Some(1),
            score_prompt: true,
            events,
        };
        let mut batcher = Batcher::new(&mut model, &tokenizer, &metrics);
        batcher.admit(job);
        let mut passes = 0;
        while !batcher.is_idle() {
            batcher.pass().unwrap();
            passes += 1;
        }
        assert!(
            passes >= prompt.len() / 2,
            "scored two rows a pass: {passes}"
        );
        let mut tokens = Vec::new();
        let mut finish = None;
        while let Ok(event) = received.try_recv() {
            match event {
                Event::Text { tokens: t, .. } => tokens.extend(t),
                Event::Done { finish: f, .. } => finish = Some(f),
                Event::Failed { message, .. } => panic!("{message}"),
            }
        }
        assert_eq!(finish, Some(Finish::Stop));
        assert_eq!(tokens.len(), prompt.len() + 1, "the prompt's and the drawn");
        assert_eq!(tokens[0].logprob, None);
        let log_z = (MARGIN.exp() + (vocab - 1) as f32).ln();
        for (t, &id) in tokens[1..]
            .iter()
            .zip(prompt[1..].iter().chain([&end_of_text]))
        {
            let want = if id == end_of_text { MARGIN } else { 0.0 } - log_z;
            assert!(
                (t.logprob.unwrap() - want).abs() < 1e-5,
                "{t:?}: want {want}"
            );
            assert_eq!(t.top[0].0.text, "<|endoftext|>");
        }
        assert_eq!(tokens.last().unwrap().token.text, "<|endoftext|>");
    }
}
