//! How well a model predicts a text: mean next-token loss, perplexity, bits per byte.
//!
//! Every token after the first is predicted exactly once. A text longer than the
//! context is covered by windows of `block_size` tokens that advance by half a block;
//! each window scores only the tokens the previous one did not, so every prediction
//! but those of the first window has at least half a block of context (Hugging Face's
//! strided perplexity). A text that fits in one window gets exactly the mean
//! cross-entropy of its T-1 next-token predictions, nothing prepended (what
//! `labels=input_ids` gives in transformers).

use anyhow::Result;
use indicatif::ProgressBar;

use crate::data::Batch;
use crate::engine::{self, EngineOptions};
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
    pub bytes: usize,
    /// Mean cross-entropy per predicted token, in nats.
    pub loss: f64,
    pub perplexity: f64,
    /// Total cross-entropy in bits over the text's UTF-8 bytes: comparable across
    /// tokenizers.
    pub bits_per_byte: f64,
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

fn needs_two_tokens(ids: &[u32]) -> Result<()> {
    if ids.len() < 2 {
        user_bail!(
            "the text is {} token(s); evaluation needs at least 2 (one to predict from, one to predict)",
            ids.len()
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
/// the targets the previous one did not: every target from 1 on exactly once.
fn windows(n: usize, block: usize) -> Vec<Window> {
    let stride = (block / 2).max(1);
    let mut out = Vec::new();
    let (mut begin, mut first) = (0, 1);
    loop {
        let end = (begin + block).min(n);
        out.push(Window { begin, first, end });
        if end == n {
            return out;
        }
        first = end;
        begin += stride;
    }
}

/// Scores `ids` (the tokens of a text of `bytes` UTF-8 bytes) with `model`'s weights,
/// on the engine that `engine::build` picks for its device.
pub fn evaluate(model: &Gpt, ids: &[u32], bytes: usize) -> Result<EvalResult> {
    evaluate_until(model, ids, bytes, &ProgressBar::hidden(), &Stop::new())
}

/// How scoring `tokens` tokens with a model of context `block` builds its engine: as
/// many windows a call as make about TOKENS_PER_CALL tokens.
pub fn engine_options(tokens: usize, block: usize) -> EngineOptions {
    let batch = (TOKENS_PER_CALL / block).clamp(1, windows(tokens, block).len());
    EngineOptions::f32(batch, true)
}

/// [`evaluate`], advancing `progress` over the windows and giving up (`Stopped`)
/// between batches of windows once `stop` asks.
pub fn evaluate_until(
    model: &Gpt,
    ids: &[u32],
    bytes: usize,
    progress: &ProgressBar,
    stop: &Stop,
) -> Result<EvalResult> {
    needs_two_tokens(ids)?; // before building an engine (seconds on a GPU)
    let block = model.config().block_size;
    let options = engine_options(ids.len(), block);
    let weights = model.params().to_flat()?;
    let mut engine = engine::build(model.spec(), &weights, model.device(), options)?;
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

/// [`evaluate_until`] through the fused CPU decoder holding `weights` (in whatever
/// precision they are: this measures what bf16, int8 or int4 weights cost): the same windows,
/// the same predictions scored, a window at a time.
pub fn evaluate_decoding(
    weights: &std::sync::Arc<crate::cpu::DecodeWeights>,
    ids: &[u32],
    bytes: usize,
    progress: &ProgressBar,
    stop: &Stop,
) -> Result<EvalResult> {
    let block = weights.spec.shapes.block_size;
    let mut decoder = crate::cpu::FastDecoder::from_weights(weights.clone(), 1)?;
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
    needs_two_tokens(ids)?;
    let windows = windows(ids.len(), block);
    progress.set_length(windows.len() as u64);
    let mut total_nll = 0.0f64;
    for group in windows.chunks(batch) {
        stop.check()?;
        total_nll += score(group)?;
        progress.inc(group.len() as u64);
    }
    Ok(EvalResult::of(ids.len(), bytes, total_nll))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every target from 1 to n - 1 is scored exactly once, each window holds at most a
    /// block, and every window after the first sees at least half a block of context.
    #[test]
    fn windows_score_every_target_once() {
        for (n, block) in [(2, 8), (8, 8), (9, 8), (50, 8), (51, 7), (5, 2)] {
            let ws = windows(n, block);
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
