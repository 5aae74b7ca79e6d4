//! A fast path for encoding with byte-level BPE (GPT-2's scheme) that gives exactly the
//! ids `tokenizers`' own `encode` gives.
//!
//! `tokenizers` builds an `Encoding` for every call: a string and byte offsets for every
//! token, alignments through the normaliser. Training data needs only the ids, and that
//! bookkeeping, not BPE, is where the time goes (1.5 MB/s a core measured on
//! Shakespeare with an 8192-token vocabulary). This path does the same three steps and
//! nothing else:
//! 1. split out the added tokens (`<|endoftext|>`), leftmost-longest as `tokenizers`;
//! 2. split the rest into words with GPT-2's pre-tokenizer pattern;
//! 3. look each word's ids up in a per-thread cache, running the tokenizer's own BPE
//!    model on a miss.
//!
//! It applies only to tokenizers of exactly that shape ([`ByteLevelBpe::for_tokenizer`]);
//! any other is encoded by `tokenizers`.

use std::sync::Mutex;

use ahash::AHashMap;
use aho_corasick::{AhoCorasick, MatchKind};
use anyhow::Result;
use regex::Regex;
use tokenizers::{Model, ModelWrapper, PreTokenizerWrapper};

/// GPT-2's pattern without its one look-ahead (`\s+(?!\S)`), which the `regex` crate
/// lacks; [`ByteLevelBpe::for_each_word`] applies that rule by hand.
const WORDS: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";

/// Words longer than this are encoded but not cached (as `tokenizers`' own cache).
const MAX_CACHED_WORD: usize = 256;
/// A thread's cache is emptied when it holds this many words, to bound memory.
const MAX_CACHED_WORDS: usize = 1 << 18;

type WordCache = AHashMap<Box<str>, Box<[u32]>>;

pub struct ByteLevelBpe {
    /// The added tokens' texts and ids; `None` when there are none.
    added: Option<(AhoCorasick, Vec<u32>)>,
    words: Regex,
    /// GPT-2's bytes_to_unicode: the character each byte is written as in the vocabulary.
    byte_chars: Vec<char>,
    /// One cache per pool thread, and a last one shared by threads outside the pool.
    caches: Vec<Mutex<WordCache>>,
}

impl ByteLevelBpe {
    /// The fast path for `hf`, if it is a byte-level BPE this module reproduces exactly:
    /// no normaliser, GPT-2's pre-tokenizer pattern with no prefix space, a BPE model
    /// without dropout, added tokens matched as plain strings.
    pub fn for_tokenizer(hf: &tokenizers::Tokenizer) -> Option<Self> {
        if hf.get_normalizer().is_some() {
            return None;
        }
        match hf.get_pre_tokenizer() {
            Some(PreTokenizerWrapper::ByteLevel(b)) if b.use_regex && !b.add_prefix_space => {}
            _ => return None,
        }
        match hf.get_model() {
            ModelWrapper::BPE(bpe) if bpe.dropout.is_none_or(|p| p == 0.0) => {}
            _ => return None,
        }
        if hf.get_encode_special_tokens() {
            return None;
        }
        let added = hf.get_added_tokens_decoder();
        let plain = added
            .values()
            .all(|t| !t.single_word && !t.lstrip && !t.rstrip && !t.content.is_empty());
        // tokenizers matches non-normalised added tokens before normalised ones; one
        // pass over both kinds is the same only when all are of one kind.
        let one_kind = added
            .values()
            .all(|t| Some(t.normalized) == added.values().next().map(|t| t.normalized));
        if !plain || !one_kind {
            return None;
        }
        let added = if added.is_empty() {
            None
        } else {
            let (ids, texts): (Vec<u32>, Vec<String>) = added
                .iter()
                .map(|(&id, token)| (id, token.content.clone()))
                .unzip();
            let matcher = AhoCorasick::builder()
                .match_kind(MatchKind::LeftmostLongest)
                .build(&texts)
                .ok()?;
            Some((matcher, ids))
        };
        let byte_chars = gpt2_byte_chars();
        let threads = rayon::current_num_threads() + 1;
        Some(Self {
            added,
            words: Regex::new(WORDS).expect("a valid pattern"),
            byte_chars,
            caches: (0..threads).map(|_| Mutex::default()).collect(),
        })
    }

    /// Appends the ids of `text` to `out`.
    pub fn encode(&self, model: &ModelWrapper, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let slot = rayon::current_thread_index()
            .map_or(self.caches.len() - 1, |i| i % (self.caches.len() - 1));
        let mut cache = self.caches[slot].lock().unwrap_or_else(|e| e.into_inner());
        let Some((matcher, ids)) = &self.added else {
            return self.encode_words(model, text, &mut cache, out);
        };
        let mut start = 0;
        for m in matcher.find_iter(text) {
            self.encode_words(model, &text[start..m.start()], &mut cache, out)?;
            out.push(ids[m.pattern().as_usize()]);
            start = m.end();
        }
        self.encode_words(model, &text[start..], &mut cache, out)
    }

    fn encode_words(
        &self,
        model: &ModelWrapper,
        text: &str,
        cache: &mut WordCache,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        let mut failure = None;
        self.for_each_word(text, |word| {
            if failure.is_some() {
                return;
            }
            if let Some(ids) = cache.get(word) {
                out.extend_from_slice(ids);
                return;
            }
            let mapped: String = word.bytes().map(|b| self.byte_chars[b as usize]).collect();
            match model.tokenize(&mapped) {
                Ok(tokens) => {
                    let ids: Box<[u32]> = tokens.iter().map(|t| t.id).collect();
                    out.extend_from_slice(&ids);
                    if word.len() <= MAX_CACHED_WORD {
                        if cache.len() >= MAX_CACHED_WORDS {
                            cache.clear();
                        }
                        cache.insert(word.into(), ids);
                    }
                }
                Err(e) => failure = Some(anyhow::anyhow!("encoding {word:?}: {e}")),
            }
        });
        failure.map_or(Ok(()), Err)
    }

    /// Calls `f` with each word of `text` as GPT-2's pre-tokenizer splits it.
    pub fn for_each_word(&self, text: &str, mut f: impl FnMut(&str)) {
        let mut pos = 0;
        while let Some(m) = self.words.find_at(text, pos) {
            let word = m.as_str();
            let last = word.chars().next_back().expect("matches are never empty");
            // GPT-2's `\s+(?!\S)`: a run of whitespace followed by a word gives its last
            // character to that word (" the"), or, when that character is not a plain
            // space, makes it a word of its own.
            if last.is_whitespace() && m.end() < text.len() && word.len() > last.len_utf8() {
                let split = word.len() - last.len_utf8();
                f(&word[..split]);
                pos = m.start() + split;
                continue;
            }
            f(word);
            pos = m.end();
        }
    }
}

/// GPT-2's bytes_to_unicode: the character each byte is written as in a byte-level
/// vocabulary. Printable bytes stand for themselves, the others are shifted to code
/// points from 256 up.
pub fn gpt2_byte_chars() -> Vec<char> {
    let printable = |b: u32| {
        (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    let mut shifted = 0;
    (0u32..=255)
        .map(|b| {
            let code = if printable(b) {
                b
            } else {
                shifted += 1;
                255 + shifted
            };
            char::from_u32(code).expect("a valid code point")
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::Tokenizer;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;

    /// Text that exercises every branch of the pattern: contractions, runs of spaces,
    /// tabs and newlines before words and at the end, digits, punctuation, non-ASCII
    /// letters and spaces, emoji, and the end-of-text token inside and between words.
    fn tricky_text() -> String {
        let pieces = [
            "Hello, world! It's 2024 and we've 3.14 apples;  don't  panic.\n\n",
            "  indented\tline\t\twith tabs \n \n\nTrailing spaces   \n",
            "Ünïcödé wörds — “quotes” and naïve café; 日本語の文章。 한국어\u{3000}全角\n",
            "emoji 🎉🎉 mixed123abc 4567 ''' 're 'll 'd 'm 't 's 'S\r\n",
            "a<|endoftext|>b <|endoftext|> <|endoftext|><|endoftext|>c\n",
            "   \n\t \u{a0}x \u{2003}y\n",
            "end with spaces   ",
        ];
        pieces.concat()
    }

    #[test]
    fn gives_the_ids_tokenizers_gives() {
        let corpus = tricky_text().repeat(20);
        let tk = Tokenizer::train_bpe(&corpus, 400).unwrap();
        assert!(tk.has_fast_path(), "our own BPE must take the fast path");
        let text = tricky_text();
        // Every prefix and suffix, so that every way a text can begin and end is met.
        for cut in (0..text.len()).filter(|&i| text.is_char_boundary(i)) {
            for piece in [&text[..cut], &text[cut..]] {
                assert_eq!(
                    tk.encode(piece).unwrap(),
                    tk.encode_with_tokenizers(piece).unwrap(),
                    "{piece:?}"
                );
            }
        }
    }

    #[test]
    fn splits_words_as_gpt2s_pattern() {
        let corpus = tricky_text();
        let tk = Tokenizer::train_bpe(&corpus, 300).unwrap();
        let hf_words = |text: &str| {
            use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
            let mut pre = PreTokenizedString::from(text);
            ByteLevel::new(false, true, true)
                .pre_tokenize(&mut pre)
                .unwrap();
            pre.get_splits(OffsetReferential::Original, OffsetType::Byte)
                .into_iter()
                .map(|(_, (start, end), _)| text[start..end].to_string())
                .collect::<Vec<_>>()
        };
        let fast = tk.fast_bpe.as_ref().unwrap();
        for text in [
            "a  b",
            "a \n b",
            "x\n\ny",
            "  ",
            "a ",
            " a",
            "\t\tb",
            "a\u{3000}\u{3000}b",
        ] {
            let mut words = vec![];
            fast.for_each_word(text, |w| words.push(w.to_string()));
            assert_eq!(words, hf_words(text), "{text:?}");
        }
    }

    #[test]
    fn bytes_map_to_gpt2s_characters() {
        let chars = gpt2_byte_chars();
        assert_eq!(chars[b'!' as usize], '!');
        assert_eq!(chars[b' ' as usize], 'Ġ');
        assert_eq!(chars[b'\n' as usize], 'Ċ');
        assert_eq!(chars[0], 'Ā');
        let alphabet = ByteLevel::alphabet();
        assert_eq!(alphabet.len(), 256);
        assert!(chars.iter().all(|c| alphabet.contains(c)));
    }
}
