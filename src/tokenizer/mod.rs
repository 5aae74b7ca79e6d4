//! Text <-> token ids, whatever the kind of tokenizer.
//!
//! Two kinds are trained here, both stored as a Hugging Face `tokenizer.json` so they
//! load in `tokenizers` (Rust or Python) anywhere:
//! - byte-level BPE (GPT-2's scheme): the 256 bytes are the base vocabulary, merges are
//!   learned on the corpus, `<|endoftext|>` is a special token. Any text encodes.
//! - char-level: one token per character seen in the corpus, ids in sorted order (as
//!   nanoGPT's shakespeare_char). Stored as a BPE model with no merges and a `Fuse`
//!   decoder; a character outside the vocabulary is an error, never silently dropped.
//!
//! Any other `tokenizer.json` (e.g. GPT-2's own) can be loaded too.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use anyhow::{Context, Result};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, DecoderWrapper, ModelWrapper, PreTokenizerWrapper};

use crate::error::user_error;

pub mod bpe_train;
mod byte_level;
use bpe_train::{learn, WordCounts};
pub use byte_level::gpt2_byte_chars;
use byte_level::ByteLevelBpe;

/// The special token that separates documents in BPE vocabularies.
pub const END_OF_TEXT: &str = "<|endoftext|>";

pub struct Tokenizer {
    hf: tokenizers::Tokenizer,
    /// Present for char-level vocabularies: encoding is a lookup, and an unknown
    /// character is reported instead of dropped.
    char_ids: Option<HashMap<char, u32>>,
    /// Present for byte-level vocabularies: the character each byte is written as in
    /// token strings (GPT-2's table), reversed.
    byte_of_char: Option<HashMap<char, u8>>,
    /// Present for byte-level BPE of GPT-2's shape: encoding without `tokenizers`'
    /// per-token bookkeeping, same ids.
    fast_bpe: Option<ByteLevelBpe>,
}

impl Tokenizer {
    /// Trains byte-level BPE on `text` up to `vocab_size` tokens (fewer if the corpus
    /// has fewer distinct pairs worth merging).
    pub fn train_bpe(text: &str, vocab_size: usize) -> Result<Self> {
        Self::train_bpe_on(std::iter::once(text), vocab_size)
    }

    /// Trains byte-level BPE on the texts of a stream (only the counts of distinct
    /// words are kept).
    pub fn train_bpe_on<I, S>(texts: I, vocab_size: usize) -> Result<Self>
    where
        I: Iterator<Item = S> + Send,
        S: AsRef<str> + Send,
    {
        let mut counts = WordCounts::default();
        let texts: Vec<String> = texts.map(|t| t.as_ref().to_string()).collect();
        counts.add(&texts)?;
        Self::train_bpe_counts(&counts, vocab_size, &crate::util::Stop::new(), |_| {})
    }

    /// Trains byte-level BPE on the words of `counts` up to `vocab_size` tokens (fewer
    /// if the text has fewer pairs seen twice): the 256 bytes, `<|endoftext|>`, then
    /// merges. Gives up (`Stopped`) between merges once `stop` asks; `progress` hears
    /// the vocabulary's size.
    pub fn train_bpe_counts(
        counts: &WordCounts,
        vocab_size: usize,
        stop: &crate::util::Stop,
        progress: impl FnMut(usize),
    ) -> Result<Self> {
        let alphabet = ByteLevel::alphabet().into_iter().collect::<Vec<char>>();
        let learned = learn(
            counts,
            vocab_size,
            &[END_OF_TEXT],
            &alphabet,
            stop,
            progress,
        )?;
        let vocab: Vocab = learned
            .tokens
            .into_iter()
            .enumerate()
            .map(|(id, token)| (token, id as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, learned.merges)
            .build()
            .map_err(|e| anyhow::anyhow!("building the BPE model: {e}"))?;
        let mut tk = tokenizers::Tokenizer::new(ModelWrapper::BPE(bpe));
        tk.with_pre_tokenizer(Some(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
            false, true, true,
        ))));
        tk.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevelDecoder::default())));
        tk.add_special_tokens([AddedToken::from(END_OF_TEXT, true)])
            .map_err(|e| anyhow::anyhow!("adding {END_OF_TEXT}: {e}"))?;
        Ok(Self::from_hf(tk))
    }

    /// One token per distinct character of `text`, in sorted order.
    pub fn train_char(text: &str) -> Result<Self> {
        Self::train_char_on(text.chars().collect())
    }

    /// One token per character of `chars`, in sorted order.
    pub fn train_char_on(chars: HashSet<char>) -> Result<Self> {
        let mut chars: Vec<char> = chars.into_iter().collect();
        chars.sort_unstable();
        let vocab: Vocab = chars
            .iter()
            .enumerate()
            .map(|(i, c)| (c.to_string(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, vec![])
            .build()
            .map_err(|e| anyhow::anyhow!("building the char vocabulary: {e}"))?;
        let mut hf = tokenizers::Tokenizer::new(ModelWrapper::BPE(bpe));
        hf.with_decoder(Some(DecoderWrapper::Fuse(Fuse::new())));
        Ok(Self::from_hf(hf))
    }

    /// Loads a `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path)
            .map_err(|e| user_error(format!("cannot read tokenizer {}: {e}", path.display())))?;
        Self::from_json(&bytes).map_err(|e| {
            user_error(format!(
                "tokenizer {} is not a valid tokenizer.json ({e:#}); replace it with a good copy",
                path.display()
            ))
        })
    }

    pub fn from_json(bytes: &[u8]) -> Result<Self> {
        // tokenizers 0.23 panics on some malformed files (an `expect` in its decoder
        // deserialiser, found by fuzzing): a damaged file must be an error, not a crash.
        let hf = catch_quietly(|| tokenizers::Tokenizer::from_bytes(bytes))
            .map_err(|panic| anyhow::anyhow!("{panic}"))?
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        if hf.get_vocab_size(true) == 0 {
            anyhow::bail!("empty vocabulary");
        }
        Ok(Self::from_hf(hf))
    }

    fn from_hf(mut hf: tokenizers::Tokenizer) -> Self {
        // A tokenizer.json may carry truncation or padding for model inputs (as
        // save_pretrained writes them); applied here they would cut every chunk of a
        // corpus to max_length tokens. Our encoding is of whole texts.
        hf.with_padding(None);
        if hf.with_truncation(None).is_err() {
            unreachable!("removing truncation cannot fail");
        }
        let is_char = matches!(hf.get_decoder(), Some(DecoderWrapper::Fuse(_)))
            && hf.get_pre_tokenizer().is_none()
            && hf
                .get_vocab(true)
                .keys()
                .all(|token| token.chars().count() == 1);
        let char_ids = is_char.then(|| {
            hf.get_vocab(true)
                .into_iter()
                .map(|(token, id)| (token.chars().next().expect("one char"), id))
                .collect()
        });
        let byte_of_char =
            matches!(hf.get_decoder(), Some(DecoderWrapper::ByteLevel(_))).then(byte_level_table);
        let fast_bpe = ByteLevelBpe::for_tokenizer(&hf);
        Self {
            hf,
            char_ids,
            byte_of_char,
            fast_bpe,
        }
    }

    pub fn to_json(&self) -> Result<String> {
        self.hf
            .to_string(true)
            .map_err(|e| anyhow::anyhow!("serialising the tokenizer: {e}"))
    }

    pub fn kind_name(&self) -> &'static str {
        if self.char_ids.is_some() {
            "char"
        } else {
            "bpe"
        }
    }

    /// The token text the vocabulary cannot spell becomes (`[UNK]`, `<unk>`) and its
    /// id, where the model has one: byte-level BPE has none (any byte is a token).
    pub fn unknown_token(&self) -> Option<(String, u32)> {
        let name = match self.hf.get_model() {
            ModelWrapper::BPE(bpe) => bpe.get_unk_token().clone()?,
            ModelWrapper::WordPiece(model) => model.unk_token.clone(),
            ModelWrapper::WordLevel(model) => model.unk_token.clone(),
            // Its unknown id is private to `tokenizers`: SentencePiece's name for it.
            ModelWrapper::Unigram(_) => "<unk>".to_string(),
        };
        let id = self.hf.token_to_id(&name)?;
        Some((name, id))
    }

    pub fn vocab_size(&self) -> usize {
        self.hf.get_vocab_size(true)
    }

    /// The id of `<|endoftext|>`, if the vocabulary has it.
    pub fn end_of_text(&self) -> Option<u32> {
        self.hf.token_to_id(END_OF_TEXT)
    }

    /// Where a sample with no prompt starts: the end-of-text token (a document
    /// boundary), else a newline; None where the vocabulary has neither.
    pub fn empty_prompt(&self) -> Option<Vec<u32>> {
        match self.end_of_text() {
            Some(eot) => Some(vec![eot]),
            None => self.encode("\n").ok().filter(|ids| !ids.is_empty()),
        }
    }

    /// Encodes text; special tokens written in the text (like `<|endoftext|>`) are
    /// recognised. A character a char-level vocabulary lacks is a user error.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3);
        self.encode_into(text, &mut out)?;
        Ok(out)
    }

    /// The first character of `text` a char-level vocabulary lacks (none for BPE, which
    /// encodes any text).
    pub fn unknown_char(&self, text: &str) -> Option<char> {
        let ids = self.char_ids.as_ref()?;
        text.chars().find(|c| !ids.contains_key(c))
    }

    /// Appends the ids of `text` to `out` (a char-level vocabulary refuses a character
    /// it lacks, naming every one it lacks: one run per character to fix a file was
    /// slow).
    pub fn encode_into(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        match (&self.char_ids, &self.fast_bpe) {
            (Some(ids), _) => {
                out.reserve(text.len());
                for (pos, c) in text.char_indices() {
                    match ids.get(&c) {
                        Some(&id) => out.push(id),
                        None => return Err(unknown_chars(ids, text, c, pos)),
                    }
                }
                Ok(())
            }
            (None, Some(fast)) => fast.encode(self.hf.get_model(), text, out),
            (None, None) => {
                out.extend(self.encode_with_tokenizers(text)?);
                Ok(())
            }
        }
    }

    /// Encodes with `tokenizers`' own pipeline (the fast path's oracle).
    pub fn encode_with_tokenizers(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .hf
            .encode_fast(text, false)
            .map_err(|e| anyhow::anyhow!("encoding text: {e}"))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Whether encoding takes the byte-level fast path (see `byte_level`).
    pub fn has_fast_path(&self) -> bool {
        self.fast_bpe.is_some()
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.hf
            .decode(ids, false)
            .map_err(|e| anyhow::anyhow!("decoding token ids: {e}"))
    }

    /// The raw text of one token, for display.
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.hf.id_to_token(id)
    }

    /// The bytes token `id` stands for, as `decode` sees them: for byte-level BPE,
    /// possibly part of a character.
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>> {
        let Some(token) = self.hf.id_to_token(id) else {
            anyhow::bail!(
                "token id {id} is outside the vocabulary of {}",
                self.vocab_size()
            );
        };
        match &self.byte_of_char {
            // As the ByteLevel decoder: map every char, or take the text as is.
            Some(table) => Ok(token
                .chars()
                .map(|c| table.get(&c).copied())
                .collect::<Option<Vec<u8>>>()
                .unwrap_or_else(|| token.into_bytes())),
            None if self.char_ids.is_some() => Ok(token.into_bytes()),
            None => Ok(self.decode(&[id])?.into_bytes()),
        }
    }

    /// A decoder for tokens arriving one at a time: yields text as soon as it is valid
    /// UTF-8 (a byte-level token can hold half a character; its bytes wait for the rest).
    pub fn text_stream(&self) -> TextStream<'_> {
        TextStream {
            tokenizer: self,
            pending: Vec::new(),
            ids: Vec::new(),
            emitted: 0,
        }
    }

    /// Tokens map to bytes one by one (byte-level BPE, char vocabularies); other
    /// decoders (SentencePiece's Metaspace, byte fallback...) depend on neighbours.
    fn bytes_per_token(&self) -> bool {
        self.byte_of_char.is_some() || self.char_ids.is_some()
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_json()?).with_context(|| format!("writing {}", path.display()))
    }
}

thread_local! {
    static QUIET_PANICS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f`, turning a panic into an error message, without the panic's report on
/// stderr (the process-wide panic hook is wrapped once to stay quiet on this thread
/// while `f` runs; other panics are reported as before).
fn catch_quietly<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET_PANICS.with(|q| q.get()) {
                previous(info);
            }
        }));
    });
    QUIET_PANICS.with(|q| q.set(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    QUIET_PANICS.with(|q| q.set(false));
    result.map_err(|payload| {
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("malformed");
        format!(
            "the tokenizers library rejected it: {}",
            message.lines().next().unwrap_or("")
        )
    })
}

/// GPT-2's byte-to-character table (bytes_to_unicode), reversed.
fn byte_level_table() -> HashMap<char, u8> {
    gpt2_byte_chars()
        .into_iter()
        .enumerate()
        .map(|(byte, c)| (c, byte as u8))
        .collect()
}

/// Incremental detokenisation; see [`Tokenizer::text_stream`].
///
/// Bytes are held until they form whole characters. A sequence that can never be
/// valid becomes U+FFFD exactly as `String::from_utf8_lossy` (and so `decode`) does it,
/// so the pieces always add up to the decoded text.
pub struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    pending: Vec<u8>,
    /// For other decoders: every id so far, and the length of the text already given.
    ids: Vec<u32>,
    emitted: usize,
}

impl TextStream<'_> {
    /// The new text that token `id` completes, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        if !self.tokenizer.bytes_per_token() {
            // Decode the whole sequence and give what is new, unless it ends in the
            // middle of a character (a byte-fallback token waiting for the next).
            self.ids.push(id);
            let text = self.tokenizer.decode(&self.ids)?;
            if text.ends_with('\u{FFFD}')
                || text.len() < self.emitted
                || !text.is_char_boundary(self.emitted)
            {
                return Ok(None);
            }
            let new = text[self.emitted..].to_string();
            self.emitted = text.len();
            return Ok((!new.is_empty()).then_some(new));
        }
        self.pending.extend(self.tokenizer.token_bytes(id)?);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(
                        std::str::from_utf8(&self.pending[..valid]).expect("valid prefix"),
                    );
                    match e.error_len() {
                        // Invalid bytes: one replacement character, then go on.
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..valid + bad);
                        }
                        // The start of a character whose other bytes are still to come.
                        None => {
                            self.pending.drain(..valid);
                            break;
                        }
                    }
                }
            }
        }
        Ok((!out.is_empty()).then_some(out))
    }

    /// Bytes still held at the end (an unfinished character), as `decode` shows them.
    pub fn finish(&mut self) -> Option<String> {
        if !self.tokenizer.bytes_per_token() {
            let text = self.tokenizer.decode(&self.ids).ok()?;
            let rest = text.get(self.emitted..).unwrap_or("").to_string();
            self.emitted = text.len();
            return (!rest.is_empty()).then_some(rest);
        }
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        (!rest.is_empty()).then_some(rest)
    }
}

/// The error for `text`'s characters that the char-level vocabulary `ids` lacks, the
/// first (`first`, at byte `pos`) with its place, the rest by name, and the likely
/// causes of the commonest: a byte-order mark, Windows line ends.
fn unknown_chars(ids: &HashMap<char, u32>, text: &str, first: char, pos: usize) -> anyhow::Error {
    let mut missing: Vec<char> = Vec::new();
    for c in text[pos..].chars().filter(|c| !ids.contains_key(c)) {
        if !missing.contains(&c) {
            missing.push(c);
        }
    }
    let shown: Vec<String> = missing.iter().take(8).map(|c| format!("{c:?}")).collect();
    let more = match missing.len() {
        1 => String::new(),
        n if n > 8 => format!(" (nor are {}, and {} more)", shown[1..].join(", "), n - 8),
        _ => format!(" (nor are {})", shown[1..].join(", ")),
    };
    let hint = if missing.contains(&'\u{feff}') {
        "; '\\u{feff}' is a byte-order mark: save the text as UTF-8 without one"
    } else if missing.contains(&'\r') {
        "; '\\r' comes from Windows line ends: convert them (dos2unix)"
    } else {
        ""
    };
    crate::error::user_error(format!(
        "the character {first:?} (byte offset {pos}) is not in this char-level vocabulary{more}{hint}; remove such characters from the text or train a BPE tokenizer"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "The quick brown fox — jumps over the lazy dog.\n\
        Über naïve café, 東京 and ünïcödé: ∑ x² ≤ 1. 🙂\n\
        The quick brown fox jumps again, and again, and again.\n";

    #[test]
    fn bpe_round_trips_non_ascii_and_survives_json() {
        let corpus = TEXT.repeat(20);
        let tk = Tokenizer::train_bpe(&corpus, 300).unwrap();
        assert!(tk.vocab_size() > 257 && tk.vocab_size() <= 300);
        assert_eq!(tk.kind_name(), "bpe");
        let ids = tk.encode(TEXT).unwrap();
        assert!(ids.len() < TEXT.len(), "merges should shorten the text");
        assert_eq!(tk.decode(&ids).unwrap(), TEXT);
        // Unseen characters still encode: every byte is in the base vocabulary.
        let unseen = "Ωμέγα ☃ ñ";
        assert_eq!(tk.decode(&tk.encode(unseen).unwrap()).unwrap(), unseen);

        let back = Tokenizer::from_json(tk.to_json().unwrap().as_bytes()).unwrap();
        assert_eq!(back.encode(TEXT).unwrap(), ids);
        assert_eq!(back.vocab_size(), tk.vocab_size());
        assert!(back.end_of_text().is_some());
    }

    /// A SentencePiece-style vocabulary (Metaspace decoder: "▁" marks a space, the
    /// first one of a decode is dropped) streams to what decode gives.
    #[test]
    fn streaming_with_a_metaspace_decoder() {
        let json = r#"{
          "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
          "normalizer": null,
          "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true},
          "post_processor": null,
          "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true},
          "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "▁to": 1, "▁be": 2, "▁or": 3, "▁not": 4}, "unk_token": "[UNK]"}
        }"#;
        let tk = Tokenizer::from_json(json.as_bytes()).unwrap();
        let ids = [1u32, 2, 3, 4, 1, 2];
        let mut stream = tk.text_stream();
        let mut text = String::new();
        for &id in &ids {
            text.extend(stream.push(id).unwrap());
        }
        text.extend(stream.finish());
        assert_eq!(text, tk.decode(&ids).unwrap());
        assert_eq!(text, "to be or not to be");
    }

    #[test]
    fn byte_table_is_gpt2s() {
        let table = byte_level_table();
        let ours: HashSet<char> = table.keys().copied().collect();
        let theirs: HashSet<char> = ByteLevel::alphabet().into_iter().collect();
        assert_eq!(ours, theirs);
        assert_eq!(table[&'Ġ'], b' ');
        assert_eq!(table[&'Ċ'], b'\n');
        assert_eq!(table[&'A'], b'A');
    }

    /// Any byte sequence, valid or not, streams to exactly what decode gives.
    #[test]
    fn streaming_agrees_with_decode_on_invalid_bytes() {
        let tk = Tokenizer::train_bpe(&TEXT.repeat(5), 270).unwrap();
        let mut state = 99u64;
        for _ in 0..50 {
            let ids: Vec<u32> = (0..40)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
                    ((state >> 33) % tk.vocab_size() as u64) as u32
                })
                .collect();
            let mut stream = tk.text_stream();
            let mut text = String::new();
            for &id in &ids {
                text.extend(stream.push(id).unwrap());
            }
            text.extend(stream.finish());
            assert_eq!(text, tk.decode(&ids).unwrap(), "{ids:?}");
        }
    }

    #[test]
    fn char_vocab_is_sorted_and_exact() {
        let tk = Tokenizer::train_char(TEXT).unwrap();
        assert_eq!(tk.kind_name(), "char");
        let distinct: HashSet<char> = TEXT.chars().collect();
        assert_eq!(tk.vocab_size(), distinct.len());
        let ids = tk.encode("The").unwrap();
        assert_eq!(ids.len(), 3);
        // Sorted order: '\n' < ' ' < 'T' < 'h' < 'e'? ids follow code points.
        assert!(tk.encode("\n").unwrap()[0] < tk.encode(" ").unwrap()[0]);
        assert_eq!(tk.decode(&tk.encode(TEXT).unwrap()).unwrap(), TEXT);

        // The saved tokenizer.json encodes exactly like our lookup, in HF's own code.
        let json = tk.to_json().unwrap();
        let back = Tokenizer::from_json(json.as_bytes()).unwrap();
        assert_eq!(back.kind_name(), "char");
        let hf = tokenizers::Tokenizer::from_bytes(json.as_bytes()).unwrap();
        let hf_ids = hf.encode(TEXT, false).unwrap().get_ids().to_vec();
        assert_eq!(hf_ids, tk.encode(TEXT).unwrap());
    }

    #[test]
    fn char_vocab_rejects_unknown_characters() {
        let tk = Tokenizer::train_char("abc").unwrap();
        let err = tk.encode("abz").unwrap_err();
        let msg = format!("{err:#}");
        assert!(msg.contains("'z'") && msg.contains("offset 2"), "{msg}");
        assert!(crate::error::find_user_error(&err).is_some());
        // Every character it lacks, once each, and what a \r or a BOM means.
        let msg = format!("{:#}", tk.encode("ab\r\nzz\r\ny").unwrap_err());
        assert!(
            msg.contains("'\\r' (byte offset 2)")
                && msg.contains("(nor are '\\n', 'z', 'y')")
                && msg.contains("dos2unix"),
            "{msg}"
        );
        let msg = format!("{:#}", tk.encode("\u{feff}abc").unwrap_err());
        assert!(msg.contains("byte-order mark"), "{msg}");
    }

    /// Byte-level tokens that split a character never print half of it, and the
    /// streamed pieces add up to the whole decoded text.
    #[test]
    fn streaming_yields_valid_utf8_that_adds_up() {
        let corpus = TEXT.repeat(5);
        let tk = Tokenizer::train_bpe(&corpus, 270).unwrap();
        // Single bytes of multi-byte characters: the hardest case.
        let text = "東京 🙂 naïve";
        let ids = tk.encode(text).unwrap();
        let mut stream = tk.text_stream();
        let mut pieces = Vec::new();
        for &id in &ids {
            if let Some(piece) = stream.push(id).unwrap() {
                assert!(
                    !piece.contains('\u{FFFD}'),
                    "half a character escaped: {piece:?}"
                );
                pieces.push(piece);
            }
        }
        assert!(
            ids.len() > text.chars().count(),
            "the test needs split characters"
        );
        assert_eq!(pieces.concat(), text);
        assert_eq!(pieces.concat(), tk.decode(&ids).unwrap());
    }

    #[test]
    fn truncation_in_a_tokenizer_json_is_not_applied_to_texts() {
        let text = "hello world, hello tokens\n".repeat(20);
        let tk = Tokenizer::train_bpe(&text, 300).unwrap();
        let mut json: serde_json::Value = serde_json::from_str(&tk.to_json().unwrap()).unwrap();
        json["truncation"] = serde_json::json!({
            "direction": "Right", "max_length": 5, "strategy": "LongestFirst", "stride": 0
        });
        let truncating = Tokenizer::from_json(json.to_string().as_bytes()).unwrap();
        assert_eq!(
            truncating.encode_with_tokenizers(&text).unwrap(),
            tk.encode_with_tokenizers(&text).unwrap()
        );
    }

    #[test]
    fn corrupt_json_is_an_error() {
        assert!(Tokenizer::from_json(b"{not json").is_err());
        assert!(Tokenizer::from_json(b"{}").is_err());
        // Found by the fuzzer: makes tokenizers 0.23 panic inside its decoder parser.
        let crash = include_bytes!("../../tests/data/tokenizer-decoder-panic.json");
        let err = Tokenizer::from_json(crash)
            .err()
            .expect("an error, not a panic");
        assert!(format!("{err}").contains("rejected"), "{err}");
    }
}
