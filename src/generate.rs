//! Text from a trained model: prefill the prompt once, then one token per step from the
//! KV cache, sampled and streamed as it decodes.
//!
//! The context window: the model was trained on at most `block_size` positions, and it
//! is never asked about later ones. When the window is full it slides: the last half
//! of the tokens become the new window and are prefilled again (positions restart at
//! 0). This holds for every position kind (learned tables end at block_size; RoPE and
//! sinusoidal positions past it were never trained). `--no-kv-cache` recomputes the
//! same window from scratch each step, so all modes see identical contexts.
//!
//! Several samples decode together as one batch; each has its own seeded sampler, so
//! sample i is the same text whatever the number of samples.

use std::time::Instant;

use anyhow::Result;
use candle_core::Tensor;

use crate::cpu::FastDecoder;
use crate::model::{Gpt, KvCache};
use crate::sample::Sampler;
use crate::tokenizer::{TextStream, Tokenizer};
use crate::user_bail;

/// How the next logits are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeMode {
    /// The fused CPU decoder (`fast::FastDecoder`); the reference path elsewhere.
    Fast,
    /// The reference model, one position at a time from its KV cache.
    Cached,
    /// The reference model over the whole window at every step.
    Uncached,
}

enum Backend {
    Fast(Box<FastDecoder>),
    Cached(KvCache),
    Uncached,
}

/// Steps a model through growing contexts, `batch` sequences at once, and returns
/// next-token logits, (batch, V) row-major.
pub struct Decoder<'m> {
    model: &'m Gpt,
    backend: Backend,
    batch: usize,
    /// Per sequence, the tokens the next logits are conditioned on.
    windows: Vec<Vec<u32>>,
    logits: Vec<f32>,
}

impl<'m> Decoder<'m> {
    pub fn new(model: &'m Gpt, batch: usize, mode: DecodeMode) -> Result<Self> {
        let backend = match mode {
            DecodeMode::Fast if model.device().is_cpu() => {
                let weights = model.params().to_flat()?;
                Backend::Fast(Box::new(FastDecoder::new(model.spec(), &weights, batch)?))
            }
            DecodeMode::Fast | DecodeMode::Cached => {
                Backend::Cached(KvCache::new(model.config().n_layer))
            }
            DecodeMode::Uncached => Backend::Uncached,
        };
        Ok(Self {
            model,
            backend,
            batch,
            windows: vec![Vec::new(); batch],
            logits: Vec::new(),
        })
    }

    pub fn window(&self, row: usize) -> &[u32] {
        &self.windows[row]
    }

    /// Starts every sequence from `prompt` (1 ..= block_size tokens); returns the logits.
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<&[f32]> {
        let block = self.model.config().block_size;
        if prompt.is_empty() || prompt.len() > block {
            user_bail!(
                "the prompt is {} tokens; it must be 1 to {block} (the model's block_size)",
                prompt.len()
            );
        }
        self.windows = vec![prompt.to_vec(); self.batch];
        self.refill()
    }

    /// Appends one token to each sequence (sliding the windows when full); returns the
    /// logits.
    pub fn push(&mut self, ids: &[u32]) -> Result<&[f32]> {
        assert_eq!(ids.len(), self.batch);
        let block = self.model.config().block_size;
        if self.windows[0].len() == block {
            let keep = block / 2;
            for (w, &id) in self.windows.iter_mut().zip(ids) {
                w.drain(..block - keep);
                w.push(id);
            }
            return self.refill();
        }
        for (w, &id) in self.windows.iter_mut().zip(ids) {
            w.push(id);
        }
        let pos = self.windows[0].len() - 1;
        match &mut self.backend {
            Backend::Fast(fast) => {
                let logits = fast.step(ids)?;
                self.logits.clear();
                self.logits.extend_from_slice(logits);
            }
            Backend::Cached(cache) => {
                let ids = Tensor::from_slice(ids, (self.batch, 1), self.model.device())?;
                let out = self.model.forward(&ids, pos, Some(cache), None)?;
                self.logits = last_logits(&out.logits)?;
            }
            Backend::Uncached => return self.refill(),
        }
        Ok(&self.logits)
    }

    /// Runs the whole windows from position 0.
    fn refill(&mut self) -> Result<&[f32]> {
        match &mut self.backend {
            Backend::Fast(fast) => {
                let logits = fast.prefill(&self.windows)?;
                self.logits.clear();
                self.logits.extend_from_slice(logits);
            }
            Backend::Cached(cache) => {
                cache.clear();
                let ids = windows_tensor(&self.windows, self.model)?;
                let out = self.model.forward(&ids, 0, Some(cache), None)?;
                self.logits = last_logits(&out.logits)?;
            }
            Backend::Uncached => {
                let ids = windows_tensor(&self.windows, self.model)?;
                let out = self.model.forward(&ids, 0, None, None)?;
                self.logits = last_logits(&out.logits)?;
            }
        }
        Ok(&self.logits)
    }
}

fn windows_tensor(windows: &[Vec<u32>], model: &Gpt) -> Result<Tensor> {
    let t = windows[0].len();
    Ok(Tensor::from_vec(
        windows.concat(),
        (windows.len(), t),
        model.device(),
    )?)
}

/// (B, T, V) -> the last position's logits, (B, V) flat on the host.
fn last_logits(logits: &Tensor) -> Result<Vec<f32>> {
    let t = logits.dim(1)?;
    Ok(logits
        .narrow(1, t - 1, 1)?
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1()?)
}

/// Holds back text that might be the start of a stop string, and cuts the output at the
/// first stop string.
pub struct StopFilter {
    stops: Vec<String>,
    text: String,
    emitted: usize,
    stopped: bool,
}

impl StopFilter {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            text: String::new(),
            emitted: 0,
            stopped: false,
        }
    }

    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Adds decoded text; returns what can be shown now.
    pub fn push(&mut self, piece: &str) -> String {
        if self.stopped {
            return String::new();
        }
        self.text.push_str(piece);
        // A stop string cannot begin in text already shown: its start would have been
        // held back.
        let from = self.emitted;
        let first_stop = self
            .stops
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i))
            .min();
        let end = match first_stop {
            Some(at) => {
                self.stopped = true;
                self.text.truncate(at);
                at
            }
            None => self.text.len() - self.held_back(),
        };
        let out = self.text[self.emitted..end].to_string();
        self.emitted = end;
        out
    }

    /// Whatever is still held back, at the end of generation.
    pub fn finish(&mut self) -> String {
        let out = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out
    }

    /// The final text.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Length of the longest suffix of the unshown text that begins a stop string.
    fn held_back(&self) -> usize {
        let pending = &self.text[self.emitted..];
        let mut longest = 0;
        for stop in &self.stops {
            for (i, _) in pending.char_indices() {
                let tail = &pending[i..];
                if tail.len() > longest && stop.starts_with(tail) {
                    longest = tail.len();
                }
            }
        }
        longest
    }
}

/// Everything a generation needs besides the model and the prompt.
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    pub stop: Vec<String>,
    pub mode: DecodeMode,
}

/// One finished sample.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Sample {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub stats: Stats,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Stats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub prefill_ms: f64,
    pub decode_ms: f64,
    /// This sample's tokens over the decode time (samples decode together).
    pub decode_tokens_per_s: f64,
    pub stopped_by: &'static str,
}

/// One sequence being generated.
struct Row<'t> {
    stream: TextStream<'t>,
    stops: StopFilter,
    generated: Vec<u32>,
    stopped_by: Option<&'static str>,
}

/// Generates one sample per sampler after `prompt`, all decoded together. `on_text`
/// gets (sample index, text) for each piece of text as soon as it is decoded.
pub fn generate(
    model: &Gpt,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    samplers: &mut [Sampler],
    options: &GenerateOptions,
    on_text: &mut dyn FnMut(usize, &str) -> Result<()>,
) -> Result<Vec<Sample>> {
    let batch = samplers.len();
    let vocab = model.config().vocab_size;
    let text_vocab = tokenizer.vocab_size().min(vocab);
    let mut decoder = Decoder::new(model, batch, options.mode)?;
    // A model trained on several documents ends one with <|endoftext|>: stop there.
    let end_of_text = tokenizer.end_of_text();
    let mut rows: Vec<Row> = (0..batch)
        .map(|_| Row {
            stream: tokenizer.text_stream(),
            stops: StopFilter::new(options.stop.clone()),
            generated: Vec::with_capacity(options.max_new_tokens.min(1 << 16)),
            stopped_by: None,
        })
        .collect();

    let started = Instant::now();
    let mut logits = decoder.prefill(prompt)?.to_vec();
    let prefill_ms = started.elapsed().as_secs_f64() * 1e3;
    let decode_start = Instant::now();
    let mut next = vec![0u32; batch];
    for step in 0..options.max_new_tokens {
        for (i, row) in rows.iter_mut().enumerate() {
            if row.stopped_by.is_some() {
                continue; // feeds its last token as filler; its output is final
            }
            let row_logits = &mut logits[i * vocab..(i + 1) * vocab];
            // A vocabulary padded past the tokenizer's ids has rows no text maps to.
            row_logits[text_vocab..].fill(f32::NEG_INFINITY);
            let id = samplers[i].sample(row_logits, decoder.window(i));
            if Some(id) == end_of_text {
                row.stopped_by = Some("end_of_text");
                continue;
            }
            next[i] = id;
            row.generated.push(id);
            if let Some(piece) = row.stream.push(id)? {
                let shown = row.stops.push(&piece);
                if !shown.is_empty() {
                    on_text(i, &shown)?;
                }
                if row.stops.stopped() {
                    row.stopped_by = Some("stop");
                }
            }
        }
        if rows.iter().all(|r| r.stopped_by.is_some()) || step + 1 == options.max_new_tokens {
            break;
        }
        logits.copy_from_slice(decoder.push(&next)?);
    }
    let decode_ms = decode_start.elapsed().as_secs_f64() * 1e3;
    let mut samples = Vec::with_capacity(batch);
    for (i, mut row) in rows.into_iter().enumerate() {
        if let Some(tail) = row.stream.finish() {
            let shown = row.stops.push(&tail);
            if !shown.is_empty() {
                on_text(i, &shown)?;
            }
        }
        let rest = row.stops.finish();
        if !rest.is_empty() {
            on_text(i, &rest)?;
        }
        samples.push(Sample {
            text: row.stops.text().to_string(),
            stats: Stats {
                prompt_tokens: prompt.len(),
                generated_tokens: row.generated.len(),
                prefill_ms,
                decode_ms,
                decode_tokens_per_s: row.generated.len() as f64 / (decode_ms / 1e3).max(1e-9),
                stopped_by: row.stopped_by.unwrap_or("max_new_tokens"),
            },
            token_ids: row.generated,
        });
    }
    Ok(samples)
}

/// Turns `\n`, `\t`, `\\` written on a command line into the characters.
pub fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('r') => out.push('\r'),
            Some('\\') => out.push('\\'),
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, String, bool) {
        let mut f = StopFilter::new(stops.iter().map(|s| s.to_string()).collect());
        let mut shown = String::new();
        for p in pieces {
            shown.push_str(&f.push(p));
        }
        shown.push_str(&f.finish());
        (shown, f.text().to_string(), f.stopped())
    }

    #[test]
    fn stop_strings_cut_and_are_never_shown() {
        let (shown, text, stopped) = run(&["\n\n"], &["Hello", "\n", "\nworld"]);
        assert_eq!(
            (shown.as_str(), text.as_str(), stopped),
            ("Hello", "Hello", true)
        );
        // A partial match that does not complete is shown in the end.
        let (shown, _, stopped) = run(&["END"], &["the E", "N", "d"]);
        assert_eq!((shown.as_str(), stopped), ("the ENd", false));
        // Earliest of several stops wins.
        let (shown, _, _) = run(&["b", "cd"], &["a", "cdb"]);
        assert_eq!(shown, "a");
        let (shown, _, _) = run(&[], &["x", "y"]);
        assert_eq!(shown, "xy");
    }

    #[test]
    fn unescaping() {
        assert_eq!(unescape("a\\n\\nb\\t\\\\"), "a\n\nb\t\\");
        assert_eq!(unescape("\\q"), "\\q");
    }
}
