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
use candle_core::{DType, IndexOp, Tensor, D};

use crate::model::Gpt;
use crate::user_bail;

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

/// Scores `ids` (the tokens of a text of `bytes` UTF-8 bytes).
pub fn evaluate(model: &Gpt, ids: &[u32], bytes: usize) -> Result<EvalResult> {
    if ids.len() < 2 {
        user_bail!(
            "the text is {} token(s); evaluation needs at least 2 (one to predict from, one to predict)",
            ids.len()
        );
    }
    let block = model.config().block_size;
    let stride = (block / 2).max(1);
    let mut total_nll = 0.0f64;
    let mut scored_until = 1; // targets [1, scored_until) are done
    let mut begin = 0;
    loop {
        let end = (begin + block).min(ids.len());
        let window = Tensor::new(&ids[begin..end], model.device())?.unsqueeze(0)?;
        let logits = model.forward(&window, 0, None, None)?.logits.i(0)?; // (T, V)
                                                                          // Position j predicts ids[begin + j + 1]; score targets scored_until .. end.
        let first = scored_until - 1 - begin;
        let count = end - scored_until;
        let logits = logits.narrow(0, first, count)?.to_dtype(DType::F32)?;
        let targets = Tensor::new(&ids[scored_until..end], model.device())?;
        let log_probs = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        let picked = log_probs.gather(&targets.unsqueeze(1)?, 1)?;
        total_nll -= picked.sum_all()?.to_scalar::<f32>()? as f64;
        scored_until = end;
        if end == ids.len() {
            break;
        }
        begin += stride;
    }
    let predictions = ids.len() - 1;
    let loss = total_nll / predictions as f64;
    Ok(EvalResult {
        tokens: ids.len(),
        predictions,
        bytes,
        loss,
        perplexity: loss.exp(),
        bits_per_byte: total_nll / std::f64::consts::LN_2 / bytes.max(1) as f64,
    })
}
