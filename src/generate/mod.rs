//! Text from a trained model: prefill the prompt once, then one token per step from a
//! KV cache, sampled and streamed as it decodes.
//!
//! Several samples decode together as one batch; each has its own seeded sampler, so
//! sample i is the same text whatever the number of samples. Read `decoder` (how the
//! next logits are computed), `sample` (how a token is chosen from them) and `stop`
//! (stop strings), then `generate` below; `race` times the CPU against a GPU for
//! `--device auto`.

pub mod decoder;
pub mod race;
pub mod sample;
pub mod stop;

use std::time::Instant;

use anyhow::Result;

use std::sync::Arc;

use crate::cpu::DecodeWeights;
use crate::model::Gpt;
use crate::tokenizer::{TextStream, Tokenizer};
use crate::util::Stop;
pub use decoder::{DecodeMode, Decoder};
use sample::Sampler;
pub use stop::{unescape, StopFilter};

/// What decodes: a candle model (on any device, in every `DecodeMode`), or weights laid
/// out for the fused CPU decoder alone (`crate::mapped`: a checkpoint opened without
/// building the candle model).
#[derive(Clone, Copy)]
pub enum Model<'m> {
    Candle(&'m Gpt),
    Cpu(&'m Arc<DecodeWeights>),
}

impl<'m> Model<'m> {
    pub fn config(&self) -> &'m crate::config::ModelConfig {
        match self {
            Model::Candle(gpt) => gpt.config(),
            Model::Cpu(weights) => &weights.spec.config,
        }
    }

    /// A decoder of `batch` sequences as `options` ask.
    pub fn decoder(&self, batch: usize, options: &GenerateOptions) -> Result<Decoder<'m>> {
        match *self {
            Model::Candle(gpt) => Decoder::with_format(gpt, batch, options.mode, options.weights),
            Model::Cpu(weights) => {
                if options.mode != DecodeMode::Fast || options.weights != weights.format {
                    anyhow::bail!(
                        "weights laid out for the fused CPU decoder in {} decode in no other way",
                        weights.format.name()
                    );
                }
                Decoder::fused(Arc::clone(weights), batch, options.kv)
            }
        }
    }
}

impl<'m> From<&'m Gpt> for Model<'m> {
    fn from(gpt: &'m Gpt) -> Self {
        Model::Candle(gpt)
    }
}

/// Everything a generation needs besides the model and the prompt.
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    pub stop: Vec<String>,
    pub mode: DecodeMode,
    /// How the fused CPU decoder holds its weights.
    pub weights: crate::cpu::WeightFormat,
    /// How the fused CPU decoder over mapped weights (`Model::Cpu`) holds its keys and
    /// values; the candle and CUDA paths keep their own.
    pub kv: crate::cpu::KvPrecision,
    /// Decoding gives up (`Stopped`) between tokens once this asks; the text handed to
    /// `on_text` so far stands.
    pub cancel: Stop,
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
    model: Model<'_>,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    samplers: &mut [Sampler],
    options: &GenerateOptions,
    on_text: &mut dyn FnMut(usize, &str) -> Result<()>,
) -> Result<Vec<Sample>> {
    let batch = samplers.len();
    let text_vocab = tokenizer.vocab_size().min(model.config().vocab_size);
    let mut decoder = model.decoder(batch, options)?;
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
    decoder.prefill(prompt)?;
    let prefill_ms = started.elapsed().as_secs_f64() * 1e3;
    let decode_start = Instant::now();
    let mut next = vec![0u32; batch];
    let mut active = vec![true; batch];
    for step in 0..options.max_new_tokens {
        // A stop ends the samples where they are: what was drawn is handed back
        // (the caller shows it, then gives up as asked).
        if options.cancel.signal().is_some() {
            for row in rows.iter_mut().filter(|r| r.stopped_by.is_none()) {
                row.stopped_by = Some("interrupted");
            }
            break;
        }
        // The rows that stopped draw nothing.
        for (a, row) in active.iter_mut().zip(&rows) {
            *a = row.stopped_by.is_none();
        }
        // A vocabulary padded past the tokenizer's ids has rows no text maps to.
        let chosen = decoder.draw(samplers, &active, text_vocab)?;
        for (i, row) in rows.iter_mut().enumerate() {
            if row.stopped_by.is_some() {
                continue; // feeds its last token as filler; its output is final
            }
            let id = chosen[i];
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
        decoder.push(&next)?;
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
