//! Corpus -> token ids (once, cached) -> train/val split -> random `(x, y)` windows.
//!
//! The token cache is a flat little-endian file of u16 ids (u32 when the vocabulary is
//! larger than 65,536), memory-mapped on reuse. A small JSON header beside it records
//! the SHA-256 of the corpus and of the tokenizer.json it was made with; when either
//! changes the cache is rebuilt.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use memmap2::Mmap;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::error::user_error;
use crate::tokenizer::Tokenizer;
use crate::user_bail;
use crate::util::{sha256_hex, sha256_hex_of, write_atomic};

/// Reads the corpus: one file, or every `.txt` file of a folder in name order.
/// Returns the documents' texts.
pub fn read_corpus(path: &Path) -> Result<Vec<String>> {
    let meta = fs::metadata(path).map_err(|e| {
        user_error(format!(
            "corpus {}: {e}; set data.corpus to a text file or a folder of .txt files{}",
            path.display(),
            if path.ends_with("data/shakespeare.txt") {
                " (./data/prepare.sh builds data/shakespeare.txt)"
            } else {
                ""
            }
        ))
    })?;
    let files: Vec<PathBuf> = if meta.is_dir() {
        let mut files: Vec<PathBuf> = fs::read_dir(path)
            .with_context(|| format!("listing {}", path.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "txt"))
            .collect();
        files.sort();
        if files.is_empty() {
            user_bail!(
                "corpus folder {} has no .txt files; put the training text in *.txt files there",
                path.display()
            );
        }
        files
    } else {
        vec![path.to_path_buf()]
    };
    let mut docs = Vec::with_capacity(files.len());
    for file in files {
        let bytes = fs::read(&file)
            .map_err(|e| user_error(format!("cannot read corpus file {}: {e}", file.display())))?;
        let text = String::from_utf8(bytes).map_err(|e| {
            user_error(format!(
                "corpus file {} is not UTF-8 (invalid byte at offset {}); convert it, e.g. with iconv -t UTF-8",
                file.display(),
                e.utf8_error().valid_up_to()
            ))
        })?;
        docs.push(text);
    }
    if docs.iter().all(|d| d.trim().is_empty()) {
        user_bail!(
            "corpus {} is empty; it needs some text to train on",
            path.display()
        );
    }
    Ok(docs)
}

/// The documents joined into one text, as the tokenizer is trained on.
pub fn joined(docs: &[String]) -> String {
    docs.join("\n")
}

/// Encodes the documents; BPE vocabularies put `<|endoftext|>` between documents,
/// char vocabularies a newline.
pub fn encode_corpus(docs: &[String], tokenizer: &Tokenizer) -> Result<Vec<u32>> {
    let separator = match tokenizer.end_of_text() {
        Some(eot) => vec![eot],
        None if docs.len() > 1 => tokenizer.encode("\n")?,
        None => vec![],
    };
    let mut ids = Vec::new();
    for (i, doc) in docs.iter().enumerate() {
        if i > 0 {
            ids.extend_from_slice(&separator);
        }
        ids.extend(tokenizer.encode(doc)?);
    }
    Ok(ids)
}

/// Token ids, owned or memory-mapped from the cache; a cheap view of a range of them.
#[derive(Clone)]
pub struct Tokens {
    storage: Arc<Storage>,
    start: usize,
    len: usize,
}

enum Storage {
    Owned(Vec<u32>),
    MappedU16(Mmap),
    MappedU32(Mmap),
}

impl Tokens {
    pub fn from_vec(ids: Vec<u32>) -> Self {
        Self::whole(Storage::Owned(ids))
    }

    fn whole(storage: Storage) -> Self {
        let len = match &storage {
            Storage::Owned(v) => v.len(),
            Storage::MappedU16(m) => m.len() / 2,
            Storage::MappedU32(m) => m.len() / 4,
        };
        Self {
            storage: Arc::new(storage),
            start: 0,
            len,
        }
    }

    /// The tokens in `range` (relative to this view), sharing storage.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Self {
        assert!(range.start <= range.end && range.end <= self.len);
        Self {
            storage: Arc::clone(&self.storage),
            start: self.start + range.start,
            len: range.end - range.start,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn get(&self, i: usize) -> u32 {
        assert!(i < self.len, "token index {i} out of range {}", self.len);
        let i = self.start + i;
        match &*self.storage {
            Storage::Owned(v) => v[i],
            Storage::MappedU16(m) => u16::from_le_bytes([m[2 * i], m[2 * i + 1]]) as u32,
            Storage::MappedU32(m) => {
                u32::from_le_bytes([m[4 * i], m[4 * i + 1], m[4 * i + 2], m[4 * i + 3]])
            }
        }
    }

    /// Copies `range` into `out`.
    pub fn copy_range(&self, start: usize, out: &mut [u32]) {
        assert!(start + out.len() <= self.len);
        match &*self.storage {
            Storage::Owned(v) => {
                let s = self.start + start;
                out.copy_from_slice(&v[s..s + out.len()])
            }
            _ => {
                for (k, o) in out.iter_mut().enumerate() {
                    *o = self.get(start + k);
                }
            }
        }
    }

    pub fn to_vec(&self) -> Vec<u32> {
        let mut v = vec![0; self.len()];
        self.copy_range(0, &mut v);
        v
    }
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct CacheHeader {
    corpus_sha256: String,
    tokenizer_sha256: String,
    bytes_per_token: usize,
    tokens: usize,
}

/// Returns the corpus's tokens, from `cache` (a path without extension: `.bin` and
/// `.json` are added) when it was made from the same corpus and tokenizer, else encodes
/// and writes the cache.
pub fn cached_tokens(docs: &[String], tokenizer: &Tokenizer, cache: &Path) -> Result<Tokens> {
    let lengths: Vec<[u8; 8]> = docs
        .iter()
        .map(|d| (d.len() as u64).to_le_bytes())
        .collect();
    let corpus_sha256 = sha256_hex_of(
        lengths
            .iter()
            .zip(docs)
            .flat_map(|(len, d)| [len.as_slice(), d.as_bytes()]),
    );
    let tokenizer_sha256 = sha256_hex(tokenizer.to_json()?.as_bytes());
    let bytes_per_token = if tokenizer.vocab_size() <= 1 << 16 {
        2
    } else {
        4
    };
    let bin = cache.with_extension("bin");
    let json = cache.with_extension("json");

    if let Some(tokens) = read_cache(&bin, &json, &corpus_sha256, &tokenizer_sha256) {
        return Ok(tokens);
    }

    let ids = encode_corpus(docs, tokenizer)?;
    let mut bytes = Vec::with_capacity(ids.len() * bytes_per_token);
    for &id in &ids {
        if bytes_per_token == 2 {
            bytes.extend_from_slice(&(id as u16).to_le_bytes());
        } else {
            bytes.extend_from_slice(&id.to_le_bytes());
        }
    }
    let header = CacheHeader {
        corpus_sha256,
        tokenizer_sha256,
        bytes_per_token,
        tokens: ids.len(),
    };
    if let Some(dir) = bin.parent() {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    // The header is written after the data, so a header always describes a whole file.
    write_atomic(&bin, &bytes)?;
    write_atomic(&json, serde_json::to_string_pretty(&header)?.as_bytes())?;
    Ok(Tokens::from_vec(ids))
}

fn read_cache(bin: &Path, json: &Path, corpus: &str, tokenizer: &str) -> Option<Tokens> {
    let header: CacheHeader = serde_json::from_slice(&fs::read(json).ok()?).ok()?;
    if header.corpus_sha256 != corpus || header.tokenizer_sha256 != tokenizer {
        return None;
    }
    let file = fs::File::open(bin).ok()?;
    // Safety: the cache file is ours and replaced only by rename, never written in place.
    let map = unsafe { Mmap::map(&file) }.ok()?;
    if map.len() != header.tokens * header.bytes_per_token {
        return None;
    }
    let storage = match header.bytes_per_token {
        2 => Storage::MappedU16(map),
        4 => Storage::MappedU32(map),
        _ => return None,
    };
    Some(Tokens::whole(storage))
}

/// Train and validation tokens: the first `1 - val_fraction` and the rest.
pub struct Split {
    pub train: Tokens,
    pub val: Tokens,
}

impl Split {
    pub fn new(
        tokens: Tokens,
        val_fraction: f64,
        block_size: usize,
        corpus: &Path,
    ) -> Result<Self> {
        let n = tokens.len();
        let n_val = ((n as f64) * val_fraction).round() as usize;
        let n_train = n - n_val;
        let need = block_size + 1;
        if n_train < need || n_val < need {
            user_bail!(
                "corpus {} has {n} tokens: {n_train} for training and {n_val} for validation, but each needs at least block_size + 1 = {need}; use a longer corpus or a smaller model.block_size",
                corpus.display()
            );
        }
        Ok(Self {
            train: tokens.slice(0..n_train),
            val: tokens.slice(n_train..n),
        })
    }
}

/// A batch of `batch` windows: `x[b, t]` and the next tokens `y[b, t] = x[b, t + 1]`,
/// flat in row-major order.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub x: Vec<u32>,
    pub y: Vec<u32>,
    pub batch: usize,
    pub block: usize,
}

impl Batch {
    /// A batch of zeros, to be filled by a sampler.
    pub fn empty(batch: usize, block: usize) -> Self {
        Self {
            x: vec![0; batch * block],
            y: vec![0; batch * block],
            batch,
            block,
        }
    }
}

/// Draws windows at uniformly random offsets from a seeded, resumable RNG.
#[derive(Clone)]
pub struct BatchSampler {
    rng: ChaCha8Rng,
}

impl BatchSampler {
    pub fn new(seed: u64, stream: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(stream);
        Self { rng }
    }

    /// Position in the RNG's output, to save and restore for exact resume.
    pub fn position(&self) -> u128 {
        self.rng.get_word_pos()
    }

    pub fn set_position(&mut self, pos: u128) {
        self.rng.set_word_pos(pos);
    }

    pub fn sample(&mut self, tokens: &Tokens, batch: usize, block: usize) -> Batch {
        let mut out = Batch::empty(batch, block);
        self.sample_into(tokens, &mut out);
        out
    }

    /// Refills `out` (keeping its batch and block sizes) with the next windows.
    pub fn sample_into(&mut self, tokens: &Tokens, out: &mut Batch) {
        let (batch, block) = (out.batch, out.block);
        let max_start = tokens.len() - block - 1;
        for b in 0..batch {
            let start = self.rng.random_range(0..=max_start);
            tokens.copy_range(start, &mut out.x[b * block..(b + 1) * block]);
            tokens.copy_range(start + 1, &mut out.y[b * block..(b + 1) * block]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_are_shifted_by_one() {
        let tokens = Tokens::from_vec((0..100).collect());
        let mut s = BatchSampler::new(1, 0);
        let b = s.sample(&tokens, 4, 8);
        for row in 0..4 {
            let x = &b.x[row * 8..(row + 1) * 8];
            let y = &b.y[row * 8..(row + 1) * 8];
            for t in 0..8 {
                assert_eq!(y[t], x[t] + 1);
                if t > 0 {
                    assert_eq!(x[t], x[t - 1] + 1);
                }
            }
        }
    }

    #[test]
    fn sampler_is_seeded_and_resumable() {
        let tokens = Tokens::from_vec((0..1000).collect());
        let mut a = BatchSampler::new(7, 0);
        let mut b = BatchSampler::new(7, 0);
        assert_eq!(a.sample(&tokens, 3, 5), b.sample(&tokens, 3, 5));
        let pos = a.position();
        let next = a.sample(&tokens, 3, 5);
        let mut c = BatchSampler::new(7, 0);
        c.set_position(pos);
        assert_eq!(c.sample(&tokens, 3, 5), next);
        let mut d = BatchSampler::new(8, 0);
        assert_ne!(
            d.sample(&tokens, 3, 5),
            BatchSampler::new(7, 0).sample(&tokens, 3, 5)
        );
    }

    #[test]
    fn cache_is_reused_and_invalidated() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("tokens");
        let docs = vec!["hello world\n".repeat(10)];
        let tk = Tokenizer::train_char(&docs[0]).unwrap();
        let first = cached_tokens(&docs, &tk, &cache).unwrap();
        assert!(matches!(*first.storage, Storage::Owned(_)));
        let second = cached_tokens(&docs, &tk, &cache).unwrap();
        assert!(matches!(*second.storage, Storage::MappedU16(_)));
        assert_eq!(first.to_vec(), second.to_vec());
        let changed = vec!["hello world!\n".repeat(10)];
        let tk2 = Tokenizer::train_char(&changed[0]).unwrap();
        let third = cached_tokens(&changed, &tk2, &cache).unwrap();
        assert!(matches!(*third.storage, Storage::Owned(_)));
    }

    #[test]
    fn split_refuses_a_corpus_too_short() {
        let tokens = Tokens::from_vec((0..50).collect());
        let err = Split::new(tokens, 0.1, 8, Path::new("c.txt"))
            .err()
            .unwrap();
        assert!(format!("{err}").contains("block_size"));
    }
}
