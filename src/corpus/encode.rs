//! Corpus -> token ids: chunks encoded on every core, handed on in corpus order.
//!
//! Documents are separated as one encoding of the whole would have them: by the
//! end-of-text token in vocabularies that have it (BPE), by a newline in char
//! vocabularies. Memory holds a few chunks per core, whatever the corpus's size.

use anyhow::Result;
use indicatif::ProgressBar;
use rayon::prelude::*;

use super::{Corpus, Piece};
use crate::error::user_error;
use crate::tokenizer::Tokenizer;
use crate::util::Stop;

/// Encodes `corpus`, calling `sink` with each chunk's ids in order and the bytes of text
/// they spell; `progress` advances through the corpus's bytes. Gives up (`Stopped`) between waves of chunks (a few MB)
/// once `stop` asks.
pub fn encode(
    corpus: &Corpus,
    tokenizer: &Tokenizer,
    progress: &ProgressBar,
    stop: &Stop,
    sink: impl FnMut(&[u32], usize) -> Result<()>,
) -> Result<()> {
    encode_in_chunks(corpus, tokenizer, super::CHUNK_BYTES, progress, stop, sink)
}

/// [`encode`] with chunks of about `chunk_bytes` (small ones in tests).
pub fn encode_in_chunks(
    corpus: &Corpus,
    tokenizer: &Tokenizer,
    chunk_bytes: usize,
    progress: &ProgressBar,
    stop: &Stop,
    mut sink: impl FnMut(&[u32], usize) -> Result<()>,
) -> Result<()> {
    let separator = Separator::of(tokenizer);
    let wave = 4 * rayon::current_num_threads();
    let mut chunks = corpus.chunks_of(chunk_bytes);
    let mut first = true;
    loop {
        stop.check()?;
        let batch: Vec<Vec<Piece>> = chunks.by_ref().take(wave).collect::<Result<_>>()?;
        if batch.is_empty() {
            return Ok(());
        }
        let encoded: Vec<Result<Vec<u32>>> = batch
            .par_iter()
            .enumerate()
            .map(|(i, pieces)| {
                encode_chunk(pieces, first && i == 0, &separator, tokenizer)
                    .map_err(|e| name_the_corpus(e, pieces, corpus, tokenizer))
            })
            .collect();
        for (ids, pieces) in encoded.into_iter().zip(&batch) {
            sink(&ids?, pieces.iter().map(|p| p.text.len()).sum())?;
        }
        first = false;
        progress.set_position(chunks.position());
    }
}

/// A character the char vocabulary lacks, told as the corpus's (where a chunk's byte
/// offset would say nothing), with the fix for Windows line endings.
fn name_the_corpus(
    error: anyhow::Error,
    pieces: &[Piece],
    corpus: &Corpus,
    tokenizer: &Tokenizer,
) -> anyhow::Error {
    let Some(c) = pieces.iter().find_map(|p| tokenizer.unknown_char(&p.text)) else {
        return error;
    };
    // The vocabulary came from another corpus (a resumed run's, a tokenizer file's):
    // the text is what can change here, or a new run on this corpus.
    let fix = match c {
        '\r' => "it has Windows line endings (\\r\\n): convert them to \\n (dos2unix), or start a new run on this corpus",
        _ => "remove it from the text, or start a new run on this corpus (its own char vocabulary, or a BPE tokenizer)",
    };
    user_error(format!(
        "corpus {} holds the character {c:?}, which this run's char-level vocabulary lacks; {fix}",
        corpus.path.display()
    ))
}

/// What goes between documents; a char vocabulary without a newline can only encode a
/// corpus of one document, so its error waits until a second document comes.
enum Separator {
    Ids(Vec<u32>),
    Missing(String),
}

impl Separator {
    fn of(tokenizer: &Tokenizer) -> Self {
        match tokenizer.end_of_text() {
            Some(eot) => Self::Ids(vec![eot]),
            None => match tokenizer.encode("\n") {
                Ok(ids) => Self::Ids(ids),
                Err(e) => Self::Missing(format!("documents are separated by a newline, and {e:#}")),
            },
        }
    }
}

/// `pieces` as token ids, their documents separated as [`encode`] separates them;
/// `starts_corpus`: the first piece is the corpus's first (no separator before it).
pub fn encode_pieces(
    pieces: &[Piece],
    starts_corpus: bool,
    tokenizer: &Tokenizer,
) -> Result<Vec<u32>> {
    encode_chunk(pieces, starts_corpus, &Separator::of(tokenizer), tokenizer)
}

fn encode_chunk(
    pieces: &[Piece],
    starts_corpus: bool,
    separator: &Separator,
    tokenizer: &Tokenizer,
) -> Result<Vec<u32>> {
    let bytes: usize = pieces.iter().map(|p| p.text.len()).sum();
    let mut ids = Vec::with_capacity(bytes / 3 + 1);
    for (i, piece) in pieces.iter().enumerate() {
        if piece.new_document && !(starts_corpus && i == 0) {
            match separator {
                Separator::Ids(sep) => ids.extend_from_slice(sep),
                Separator::Missing(why) => return Err(user_error(why.clone())),
            }
        }
        tokenizer.encode_into(&piece.text, &mut ids)?;
    }
    Ok(ids)
}
