//! A tokenizer trained on the corpus, streamed.
//!
//! Char vocabularies see every character of the corpus (one not seen would be an error
//! later). BPE trains on a sample of `tokenizer.train_bytes`: whole chunks spread evenly
//! through the corpus, so a corpus sorted by source or date is sampled from end to end.
//! BPE keeps only the counts of distinct words, so memory follows the sample's
//! vocabulary, not its size.

use std::collections::HashSet;
use std::sync::Mutex;

use anyhow::Result;
use indicatif::ProgressBar;

use super::{Chunks, Corpus, Piece};
use crate::config::{TokenizerConfig, TokenizerKind};
use crate::tokenizer::bpe_train::WordCounts;
use crate::tokenizer::Tokenizer;
use crate::util::bars::restage;
use crate::util::Stop;

/// Trains the tokenizer `config` describes on `corpus`; gives up (`Stopped`) within a
/// fraction of a second once `stop` asks.
pub fn train_tokenizer(
    corpus: &Corpus,
    config: &TokenizerConfig,
    progress: &ProgressBar,
    stop: &Stop,
) -> Result<Tokenizer> {
    match config.kind {
        TokenizerKind::Char => train_char(corpus, progress, stop),
        TokenizerKind::Bpe => train_bpe(
            corpus,
            config.train_bytes,
            config.vocab_size,
            progress,
            stop,
        ),
    }
}

/// BPE on a sample of `wanted` bytes: the sample's words counted a few chunks at a
/// time on every core, then the merges; `progress` shows both stages, and `stop` ends
/// either (no thread of ours outlives the call).
fn train_bpe(
    corpus: &Corpus,
    wanted: u64,
    vocab_size: usize,
    progress: &ProgressBar,
    stop: &Stop,
) -> Result<Tokenizer> {
    let failure = Mutex::new(None);
    let mut sample = Sample {
        chunks: corpus.chunks(),
        total: corpus.bytes().max(1),
        wanted,
        taken: 0,
        progress,
        stop,
        failure: &failure,
    };
    let mut counts = WordCounts::default();
    let batch = 2 * rayon::current_num_threads();
    loop {
        let texts: Vec<String> = sample.by_ref().take(batch).collect();
        if let Some(e) = failure.lock().unwrap_or_else(|e| e.into_inner()).take() {
            return Err(e);
        }
        if texts.is_empty() {
            break;
        }
        counts.add(&texts)?;
    }
    let base: u64 = 257; // the 256 bytes and <|endoftext|>
    restage(
        progress,
        base,
        (vocab_size as u64).max(base),
        "merging BPE pairs",
    );
    Tokenizer::train_bpe_counts(&counts, vocab_size, stop, |tokens| {
        progress.set_position(tokens as u64)
    })
}

fn train_char(corpus: &Corpus, progress: &ProgressBar, stop: &Stop) -> Result<Tokenizer> {
    let mut chars = HashSet::new();
    let mut documents = 0usize;
    let mut chunks = corpus.chunks();
    while let Some(chunk) = chunks.next() {
        stop.check()?;
        for piece in chunk? {
            documents += piece.new_document as usize;
            chars.extend(piece.text.chars());
        }
        progress.set_position(chunks.position());
    }
    if documents > 1 {
        // Documents are separated by a newline.
        chars.insert('\n');
    }
    Tokenizer::train_char_on(chars)
}

/// A chunk's text, with a newline between documents (the trainer does not see the
/// end-of-text token that separates them in encoding).
fn joined(chunk: &[Piece]) -> String {
    let mut text = String::with_capacity(chunk.iter().map(|p| p.text.len() + 1).sum());
    for (i, piece) in chunk.iter().enumerate() {
        if i > 0 && piece.new_document {
            text.push('\n');
        }
        text.push_str(&piece.text);
    }
    text
}

/// The sample as the BPE trainer reads it: texts of whole chunks, taken where the
/// corpus position crosses the next of `wanted / CHUNK_BYTES` evenly spaced marks.
/// An error ends the stream and waits in `failure`.
struct Sample<'a> {
    chunks: Chunks<'a>,
    total: u64,
    wanted: u64,
    taken: u64,
    progress: &'a ProgressBar,
    stop: &'a Stop,
    failure: &'a Mutex<Option<anyhow::Error>>,
}

impl Iterator for Sample<'_> {
    type Item = String;

    fn next(&mut self) -> Option<String> {
        let marks = self.wanted.div_ceil(super::CHUNK_BYTES as u64).max(1);
        while self.taken < self.wanted {
            if let Err(stopped) = self.stop.check() {
                *self.failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(stopped.into());
                return None;
            }
            let before = self.chunks.position();
            let chunk = match self.chunks.next()? {
                Ok(chunk) => chunk,
                Err(e) => {
                    *self.failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                    return None;
                }
            };
            let after = self.chunks.position();
            self.progress.set_position(after);
            let mark = |position: u64| position as u128 * marks as u128 / self.total as u128;
            let all = self.total <= self.wanted;
            if all || mark(before) < mark(after) || before == 0 {
                let text = joined(&chunk);
                self.taken += text.len() as u64;
                return Some(text);
            }
        }
        None
    }
}
