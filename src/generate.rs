//! Text from a trained model: prefill the prompt once, then one token per step from the
//! KV cache, sampled and streamed as it decodes.
//!
//! The context window: the model was trained on at most `block_size` positions, and it
//! is never asked about later ones. When the window is full it slides: the last half
//! of the tokens become the new window and are prefilled again (positions restart at
//! 0). This holds for every position kind (learned tables end at block_size; RoPE and
//! sinusoidal positions past it were never trained). `--no-kv-cache` recomputes the
//! same window from scratch each step, so both modes see identical contexts.

use std::time::Instant;

use anyhow::Result;
use candle_core::{IndexOp, Tensor};

use crate::model::{Dropout, Gpt, KvCache};
use crate::sample::Sampler;
use crate::tokenizer::Tokenizer;
use crate::user_bail;

/// Steps a model through a growing context and returns next-token logits.
pub struct Decoder<'m> {
    model: &'m Gpt,
    cache: Option<KvCache>,
    /// The tokens in the current window: what the next logits are conditioned on.
    window: Vec<u32>,
}

impl<'m> Decoder<'m> {
    pub fn new(model: &'m Gpt, use_cache: bool) -> Self {
        Self {
            model,
            cache: use_cache.then(|| KvCache::new(model.config().n_layer)),
            window: Vec::new(),
        }
    }

    pub fn window(&self) -> &[u32] {
        &self.window
    }

    /// Starts over with `prompt` (1 ..= block_size tokens); returns the next-token logits.
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<Vec<f32>> {
        let block = self.model.config().block_size;
        if prompt.is_empty() || prompt.len() > block {
            user_bail!(
                "the prompt is {} tokens; it must be 1 to {block} (the model's block_size)",
                prompt.len()
            );
        }
        self.window = prompt.to_vec();
        if let Some(cache) = &mut self.cache {
            cache.clear();
        }
        self.run(0, prompt.len())
    }

    /// Appends `id` to the context (sliding the window when full); returns the logits.
    pub fn push(&mut self, id: u32) -> Result<Vec<f32>> {
        let block = self.model.config().block_size;
        if self.window.len() == block {
            let keep = block / 2;
            let mut window = self.window[block - keep..].to_vec();
            window.push(id);
            return self.prefill(&window);
        }
        self.window.push(id);
        match self.cache {
            Some(_) => self.run(self.window.len() - 1, 1),
            None => self.run(0, self.window.len()),
        }
    }

    /// Runs the window's tokens from `start` (`len` of them) and returns the last logits.
    fn run(&mut self, start: usize, len: usize) -> Result<Vec<f32>> {
        let ids =
            Tensor::new(&self.window[start..start + len], self.model.device())?.unsqueeze(0)?;
        let out = self
            .model
            .forward(&ids, start, self.cache.as_mut(), &mut Dropout::off())?;
        Ok(out
            .logits
            .i((0, len - 1))?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1()?)
    }
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

/// Everything one sample needs.
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    pub stop: Vec<String>,
    pub use_cache: bool,
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
    pub decode_tokens_per_s: f64,
    pub stopped_by: &'static str,
}

/// Generates one sample after `prompt`, calling `on_text` with each piece of text as
/// soon as it is decoded.
pub fn generate(
    model: &Gpt,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    sampler: &mut Sampler,
    options: &GenerateOptions,
    on_text: &mut dyn FnMut(&str) -> Result<()>,
) -> Result<Sample> {
    let mut decoder = Decoder::new(model, options.use_cache);
    let mut stream = tokenizer.text_stream();
    let mut stops = StopFilter::new(options.stop.clone());
    let mut generated = Vec::with_capacity(options.max_new_tokens);
    // A model trained on several documents ends one with <|endoftext|>: stop there.
    let end_of_text = tokenizer.end_of_text();

    let started = Instant::now();
    let mut logits = decoder.prefill(prompt)?;
    let prefill_ms = started.elapsed().as_secs_f64() * 1e3;
    let decode_start = Instant::now();
    let mut stopped_by = "max_new_tokens";
    while generated.len() < options.max_new_tokens {
        let id = sampler.sample(&mut logits, decoder.window());
        if Some(id) == end_of_text {
            stopped_by = "end_of_text";
            break;
        }
        generated.push(id);
        if let Some(piece) = stream.push(id)? {
            let shown = stops.push(&piece);
            if !shown.is_empty() {
                on_text(&shown)?;
            }
            if stops.stopped() {
                stopped_by = "stop";
                break;
            }
        }
        if generated.len() == options.max_new_tokens {
            break;
        }
        logits = decoder.push(id)?;
    }
    if let Some(tail) = stream.finish() {
        let shown = stops.push(&tail);
        if !shown.is_empty() {
            on_text(&shown)?;
        }
    }
    let rest = stops.finish();
    if !rest.is_empty() {
        on_text(&rest)?;
    }
    let decode_ms = decode_start.elapsed().as_secs_f64() * 1e3;
    Ok(Sample {
        text: stops.text().to_string(),
        stats: Stats {
            prompt_tokens: prompt.len(),
            generated_tokens: generated.len(),
            prefill_ms,
            decode_ms,
            decode_tokens_per_s: generated.len() as f64 / (decode_ms / 1e3).max(1e-9),
            stopped_by,
        },
        token_ids: generated,
    })
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
