//! How well a model predicts a text: mean next-token loss, perplexity, bits per byte.
//!
//! Every token after the first is predicted exactly once. A text longer than the
//! context is covered by windows of `block_size` tokens that advance by half a block;
//! each window scores only the tokens the previous one did not, so every prediction
//! but those of the first window has at least half a block of context (Hugging Face's
//! strided perplexity). A text that fits in one window gets exactly the mean
//! cross-entropy of its T-1 next-token predictions, nothing prepended (what
//! `labels=input_ids` gives in transformers).
//!
//! The window may be shorter than the model's context (`eval --context N`): a model of a
//! long context (131,072 positions) cannot have a full window's activations in memory,
//! and a text shorter than the context needs no more than its own length.

use anyhow::Result;
use candle_core::Device;
use indicatif::ProgressBar;

use crate::config::ModelConfig;
use crate::cpu::kv_cache::{KvCache, KvPrecision};
use crate::cpu::{DecodeWeights, FastDecoder};
use crate::data::Batch;
use crate::engine::{self, EngineOptions};
use crate::model::spec::Shapes;
use crate::model::Gpt;
use crate::user_bail;
use crate::util::Stop;

/// Tokens scored per engine call: windows run together, as many as make up about this
/// many positions (activation memory grows with it).
const TOKENS_PER_CALL: usize = 2048;

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EvalResult {
    pub tokens: usize,
    /// Predictions scored: tokens - 1.
    pub predictions: usize,
    /// Bytes of the text predicted: all but the first token's (which nothing predicts).
    pub bytes: usize,
    /// Mean cross-entropy per predicted token, in nats.
    pub loss: f64,
    pub perplexity: f64,
    /// Total cross-entropy in bits over the UTF-8 bytes predicted: comparable across
    /// tokenizers.
    pub bits_per_byte: f64,
}

/// Of `text_bytes` bytes of text encoded as `ids`, those the tokens predict: all but
/// the first token's. (Counting those too made a short text's bits per byte too low:
/// "ab" scores one byte, not two.)
pub fn predicted_bytes(
    tokenizer: &crate::tokenizer::Tokenizer,
    ids: &[u32],
    text_bytes: usize,
) -> Result<usize> {
    let first = match ids.first() {
        Some(&id) => tokenizer.token_bytes(id)?.len(),
        None => 0,
    };
    Ok(text_bytes.saturating_sub(first))
}

/// What `eval --text` scores, read as training reads `data.corpus`: a .jsonl or
/// .parquet file's documents (`text_field`), a folder's files, a text file (its
/// byte-order mark dropped), each document separated as in training; streamed in
/// chunks encoded on every core, with a progress bar. The token ids and the bytes of
/// text they predict ([`predicted_bytes`]); None for what is read once, whole: standard
/// input (`-`), a pipe (`<(zcat a.gz)`).
pub fn documents(
    path: &std::path::Path,
    tokenizer: &crate::tokenizer::Tokenizer,
    text_field: &str,
    stop: &Stop,
) -> Result<Option<(Vec<u32>, usize)>> {
    use crate::corpus::{encode::encode, Corpus};
    let listed = std::fs::metadata(path).is_ok_and(|m| m.is_file() || m.is_dir());
    if path.as_os_str() == "-" || (path.exists() && !listed) {
        return Ok(None);
    }
    let corpus = Corpus::open_as(path, text_field, "--text")?;
    if corpus.is_tokenized() {
        crate::user_bail!(
            "--text {} holds token ids (.bin), not text; eval scores text: name the text they came from",
            path.display()
        );
    }
    // Room for the most ids the text can give (a token spells a byte or more, and
    // documents are separated by one): reserved, not touched, so the ids are never
    // copied to grow (a copy of a growing Vec holds both for a moment).
    let most = corpus.bytes() as usize + corpus.files.len();
    let mut ids = Vec::with_capacity(most);
    let mut bytes = 0;
    let bar = crate::util::bars::bytes_bar(corpus.bytes(), "reading --text");
    encode(&corpus, tokenizer, &bar, stop, |chunk, text| {
        ids.extend_from_slice(chunk);
        bytes += text;
        Ok(())
    })?;
    bar.finish_and_clear();
    let predicted = predicted_bytes(tokenizer, &ids, bytes)?;
    Ok(Some((ids, predicted)))
}

impl EvalResult {
    /// The figures of `tokens` tokens (`bytes` bytes of text) whose predictions summed
    /// to `total_nll` nats.
    fn of(tokens: usize, bytes: usize, total_nll: f64) -> Self {
        let predictions = tokens - 1;
        let loss = total_nll / predictions as f64;
        Self {
            tokens,
            predictions,
            bytes,
            loss,
            perplexity: loss.exp(),
            bits_per_byte: total_nll / std::f64::consts::LN_2 / bytes.max(1) as f64,
        }
    }
}

fn needs_two_tokens(tokens: usize) -> Result<()> {
    if tokens < 2 {
        user_bail!(
            "the text is {tokens} token(s); evaluation needs at least 2 (one to predict from, one to predict)"
        );
    }
    Ok(())
}

/// One window of the text: tokens `begin .. end` go in, and the predictions of
/// targets `first .. end` are scored (each position predicts the next token).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Window {
    begin: usize,
    first: usize,
    end: usize,
}

impl Window {
    /// The window's positions whose predictions are scored: target k is predicted at
    /// position k - 1 - begin.
    fn scored(&self) -> std::ops::Range<usize> {
        self.first - 1 - self.begin..self.end - 1 - self.begin
    }
}

/// Windows of `block` tokens advancing by half a block over `n` tokens, each scoring
/// the targets the previous one did not: every target from 1 on exactly once. Made as
/// they are scored (a text of a hundred million tokens has millions of them).
fn windows(n: usize, block: usize) -> impl Iterator<Item = Window> {
    let stride = (block / 2).max(1);
    let mut next = Some(Window {
        begin: 0,
        first: 1,
        end: block.min(n),
    });
    std::iter::from_fn(move || {
        let window = next?;
        next = (window.end < n).then(|| {
            let begin = window.begin + stride;
            Window {
                begin,
                first: window.end,
                end: (begin + block).min(n),
            }
        });
        Some(window)
    })
}

/// Scores `ids` (the tokens of a text of `bytes` UTF-8 bytes) with `model`'s weights,
/// on the engine that `engine::build` picks for its device, in windows of the model's
/// context.
pub fn evaluate(model: &Gpt, ids: &[u32], bytes: usize) -> Result<EvalResult> {
    let context = model.config().block_size;
    evaluate_until(
        model,
        ids,
        bytes,
        context,
        &ProgressBar::hidden(),
        &Stop::new(),
    )
}

/// The tokens a window holds: `asked` (`eval --context`) or the model's `block_size`,
/// and never more than the text's `tokens` (of which there must be two).
pub fn window(asked: Option<usize>, block_size: usize, tokens: usize) -> Result<usize> {
    needs_two_tokens(tokens)?;
    let context = match asked {
        Some(n) if n < 2 => {
            user_bail!("--context {n} is too short: a window needs at least 2 tokens")
        }
        Some(n) if n > block_size => user_bail!(
            "--context {n} is longer than the model's context of {block_size} tokens; pass at most {block_size}"
        ),
        Some(n) => n,
        None => block_size,
    };
    Ok(context.min(tokens))
}

/// How scoring `tokens` tokens in windows of `block` builds its engine: as many windows
/// a call as make about TOKENS_PER_CALL tokens.
pub fn engine_options(tokens: usize, block: usize) -> EngineOptions {
    let batch = (TOKENS_PER_CALL / block).clamp(1, windows(tokens, block).count());
    EngineOptions::f32(batch, true)
}

/// [`evaluate`] in windows of `block` tokens (see [`window`]), advancing `progress`
/// over the windows and giving up (`Stopped`) between batches of windows once `stop`
/// asks.
pub fn evaluate_until(
    model: &Gpt,
    ids: &[u32],
    bytes: usize,
    block: usize,
    progress: &ProgressBar,
    stop: &Stop,
) -> Result<EvalResult> {
    needs_two_tokens(ids.len())?; // before building an engine (seconds on a GPU)
    let block = block.min(ids.len());
    let options = engine_options(ids.len(), block);
    check_memory(model.config(), (ids.len(), block), options, model.device())?;
    let weights = model.params().to_flat()?;
    let (spec, weights) = match block == model.config().block_size {
        true => (model.spec().clone(), weights),
        false => model.spec().with_context(&weights, block)?,
    };
    let mut engine = engine::build(&spec, &weights, model.device(), options)?;
    // Windows shorter than a block are padded at the end: causal attention means the
    // padding changes no earlier position. Rows past the last window are padding too.
    let mut input = Batch::empty(options.batch, block);
    let score = |group: &[Window]| -> Result<f64> {
        input.x.fill(0);
        input.y.fill(0);
        for (row, w) in group.iter().enumerate() {
            let at = row * block;
            let len = w.end - w.begin;
            input.x[at..at + len].copy_from_slice(&ids[w.begin..w.end]);
            let targets = &ids[w.begin + 1..(w.end + 1).min(ids.len())];
            input.y[at..at + targets.len()].copy_from_slice(targets);
        }
        engine.forward(&input, None)?;
        let losses = engine.position_losses()?;
        Ok(group
            .iter()
            .enumerate()
            .map(|(row, w)| {
                let scored = w.scored();
                losses[row * block + scored.start..row * block + scored.end]
                    .iter()
                    .sum::<f64>()
            })
            .sum())
    };
    score_windows(ids, bytes, (block, options.batch), (progress, stop), score)
}

/// Refuses windows of `block` tokens over a text of `tokens` whose engine (built with
/// `options`) would not fit in the memory `device` has free: the engine takes its
/// buffers at once, and an allocation that fails aborts the process.
fn check_memory(
    model: &ModelConfig,
    (tokens, block): (usize, usize),
    options: EngineOptions,
    device: &Device,
) -> Result<()> {
    let engine = engine::footprint(device, &options);
    // As scoring in windows of `block` tokens would build its engine.
    let need = |block: usize| {
        let m = ModelConfig {
            block_size: block,
            ..model.clone()
        };
        engine::evaluation_bytes(&m, engine_options(tokens, block).batch, engine)
    };
    let available = match device {
        Device::Cpu => crate::util::available_memory_bytes(),
        _ => crate::device::gpu_memory(device).map(|(free, _)| free as f64),
    };
    let Some(available) = available.filter(|&a| need(block) > a) else {
        return Ok(());
    };
    let gib = |bytes: f64| bytes / f64::from(1 << 30);
    let fits = longest_fitting(block, need, available);
    if fits < 2 {
        user_bail!(
            "scoring with this model needs about {:.1} GiB even in windows of 2 tokens, but {:.1} GiB is available",
            gib(need(2)),
            gib(available)
        );
    }
    user_bail!(
        "scoring windows of {block} tokens needs about {:.1} GiB but {:.1} GiB is available; pass --context with fewer tokens, e.g. --context {fits}",
        gib(need(block)),
        gib(available)
    )
}

/// [`evaluate_until`] through the fused CPU decoder holding `weights` (in whatever
/// precision they are: this measures what bf16, int8 or int4 weights cost) and its keys
/// and values in `precision`: the same windows of `block` tokens, the same predictions
/// scored, a window at a time.
pub fn evaluate_decoding(
    weights: &std::sync::Arc<DecodeWeights>,
    ids: &[u32],
    bytes: usize,
    (block, precision): (usize, KvPrecision),
    progress: &ProgressBar,
    stop: &Stop,
) -> Result<EvalResult> {
    needs_two_tokens(ids.len())?;
    let block = block.min(ids.len());
    check_decoder_memory(&weights.spec.shapes, block, precision)?;
    let mut decoder = FastDecoder::with_positions(weights.clone(), 1, precision, block)?;
    let score = |group: &[Window]| -> Result<f64> {
        let mut nll = 0.0;
        for w in group {
            let losses = decoder.next_token_losses(&ids[w.begin..w.end])?;
            nll += losses[w.scored()].iter().sum::<f64>();
        }
        Ok(nll)
    };
    score_windows(ids, bytes, (block, 1), (progress, stop), score)
}

/// The longest power of two below `block` whose windows `need` no more than
/// `available` bytes, to offer as `--context`; under 2 where none does.
fn longest_fitting(block: usize, need: impl Fn(usize) -> f64, available: f64) -> usize {
    let mut fits = block.next_power_of_two() / 2;
    while fits >= 2 && need(fits) > available {
        fits /= 2;
    }
    fits
}

/// Refuses windows of `block` tokens whose keys and values (in `precision`, for a
/// model of `shapes`) would not fit in free memory, offering a `--context` that does.
fn check_decoder_memory(shapes: &Shapes, block: usize, precision: KvPrecision) -> Result<()> {
    let need = |block: usize| {
        let s = Shapes {
            block_size: block,
            ..*shapes
        };
        KvCache::full_bytes(&s, 1, precision)
    };
    let Some(available) = crate::util::available_memory_bytes().filter(|&a| need(block) > a) else {
        return Ok(());
    };
    let gib = |bytes: f64| bytes / f64::from(1 << 30);
    let fits = longest_fitting(block, need, available);
    user_bail!(
        "keys and values for windows of {block} tokens need {:.1} GiB but {:.1} GiB is available; pass --context with fewer tokens, e.g. --context {}",
        gib(need(block)),
        gib(available),
        fits.max(2)
    )
}

/// Sums what `score` gives for the windows of `block` tokens over `ids` (the tokens of
/// `bytes` bytes of text), `batch` windows a call: the total negative log-likelihood of
/// their scored targets. `progress` counts windows; `stop` is heeded between calls.
fn score_windows(
    ids: &[u32],
    bytes: usize,
    (block, batch): (usize, usize),
    (progress, stop): (&ProgressBar, &Stop),
    mut score: impl FnMut(&[Window]) -> Result<f64>,
) -> Result<EvalResult> {
    needs_two_tokens(ids.len())?;
    progress.set_length(windows(ids.len(), block).count() as u64);
    let mut total_nll = 0.0f64;
    let mut windows = windows(ids.len(), block);
    let mut group = Vec::with_capacity(batch);
    loop {
        group.clear();
        group.extend(windows.by_ref().take(batch));
        if group.is_empty() {
            break;
        }
        stop.check()?;
        total_nll += score(&group)?;
        progress.inc(group.len() as u64);
    }
    Ok(EvalResult::of(ids.len(), bytes, total_nll))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys and values too big for memory are refused with a --context that fits; a
    /// short window of the same model passes.
    #[test]
    fn decoder_windows_that_cannot_fit_are_refused() {
        let Some(available) = crate::util::available_memory_bytes() else {
            crate::errln!("SKIPPED: this system does not say how much memory is free");
            return;
        };
        // 2 x 1000 layers x 131,072 positions x 4,096 x 2 bytes: about 4 TiB.
        let shapes = crate::model::ModelSpec::new(&ModelConfig {
            n_layer: 1000,
            n_head: 32,
            n_embd: 4096,
            block_size: 131_072,
            ..ModelConfig::default()
        })
        .shapes;
        assert!(KvCache::full_bytes(&shapes, 1, KvPrecision::Bf16) > available);
        let err = check_decoder_memory(&shapes, 131_072, KvPrecision::Bf16).unwrap_err();
        let message = err.to_string();
        assert!(crate::error::find_user_error(&err).is_some(), "{message}");
        let fits: usize = message
            .rsplit("--context ")
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{message}"));
        assert!(fits.is_power_of_two() && fits < 131_072, "{message}");
        assert!(check_decoder_memory(&shapes, fits, KvPrecision::Bf16).is_ok());
        assert!(check_decoder_memory(&shapes, 16, KvPrecision::Bf16).is_ok());
    }

    /// Every target from 1 to n - 1 is scored exactly once, each window holds at most a
    /// block, and every window after the first sees at least half a block of context.
    #[test]
    fn windows_score_every_target_once() {
        for (n, block) in [(2, 8), (8, 8), (9, 8), (50, 8), (51, 7), (5, 2)] {
            let ws: Vec<Window> = windows(n, block).collect();
            let mut scored = Vec::new();
            for (i, w) in ws.iter().enumerate() {
                assert!(w.end - w.begin <= block && w.begin < w.first && w.first <= w.end);
                if i > 0 {
                    assert!(w.first - 1 - w.begin >= block / 2 - 1, "{n} {block}: {w:?}");
                }
                scored.extend(w.first..w.end);
            }
            assert_eq!(scored, (1..n).collect::<Vec<_>>(), "n={n} block={block}");
        }
    }
}
