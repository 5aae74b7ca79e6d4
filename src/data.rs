//! Token ids -> train/val split -> random `(x, y)` windows. (The ids come from the
//! corpus through `corpus::cache`, or from token files as they are.)

use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use memmap2::Mmap;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::user_bail;

/// Token ids: owned, or memory-mapped from token files (the cache, nanoGPT's and
/// llm.c's `.bin` files), possibly several files one after another; a cheap view of a
/// range of them.
#[derive(Clone)]
pub struct Tokens {
    parts: Vec<Part>,
    len: usize,
}

/// A range of one storage.
#[derive(Clone)]
struct Part {
    storage: Arc<Storage>,
    start: usize,
    len: usize,
}

pub enum Storage {
    Owned(Vec<u32>),
    /// Little-endian ids of `width` bytes (2 or 4) from byte `offset` of a mapped file.
    Mapped {
        map: Mmap,
        offset: usize,
        width: usize,
    },
}

impl Storage {
    fn len(&self) -> usize {
        match self {
            Storage::Owned(v) => v.len(),
            Storage::Mapped { map, offset, width } => (map.len() - offset) / width,
        }
    }

    /// Copies ids `start..start + out.len()` into `out`.
    fn copy(&self, start: usize, out: &mut [u32]) {
        match self {
            Storage::Owned(v) => out.copy_from_slice(&v[start..start + out.len()]),
            Storage::Mapped { map, offset, width } => {
                let from = offset + start * width;
                let bytes = &map[from..from + out.len() * width];
                if *width == 2 {
                    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                        *o = u16::from_le_bytes([b[0], b[1]]) as u32;
                    }
                } else {
                    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                        *o = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    }
                }
            }
        }
    }
}

impl Tokens {
    pub fn from_vec(ids: Vec<u32>) -> Self {
        Self::concat(vec![Storage::Owned(ids)])
    }

    /// The storages' ids one after another.
    pub fn concat(storages: Vec<Storage>) -> Self {
        let parts: Vec<Part> = storages
            .into_iter()
            .map(|storage| Part {
                len: storage.len(),
                storage: Arc::new(storage),
                start: 0,
            })
            .filter(|p| p.len > 0)
            .collect();
        let len = parts.iter().map(|p| p.len).sum();
        Self { parts, len }
    }

    /// The views' ids one after another.
    pub fn chain(views: Vec<Tokens>) -> Self {
        let parts: Vec<Part> = views.into_iter().flat_map(|v| v.parts).collect();
        let len = parts.iter().map(|p| p.len).sum();
        Self { parts, len }
    }

    /// The tokens in `range` (relative to this view), sharing storage.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Self {
        assert!(range.start <= range.end && range.end <= self.len);
        let mut parts = Vec::new();
        let mut at = 0;
        for part in &self.parts {
            let (lo, hi) = (range.start.max(at), range.end.min(at + part.len));
            if lo < hi {
                parts.push(Part {
                    storage: Arc::clone(&part.storage),
                    start: part.start + lo - at,
                    len: hi - lo,
                });
            }
            at += part.len;
        }
        Self {
            parts,
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
        let mut out = [0];
        self.copy_range(i, &mut out);
        out[0]
    }

    /// Copies the ids from `start` on into `out`.
    pub fn copy_range(&self, start: usize, out: &mut [u32]) {
        assert!(start + out.len() <= self.len);
        let (mut at, mut done) = (0, 0);
        for part in &self.parts {
            if done == out.len() {
                break;
            }
            let want = start + done;
            if want < at + part.len {
                let from = want - at;
                let n = (part.len - from).min(out.len() - done);
                part.storage
                    .copy(part.start + from, &mut out[done..done + n]);
                done += n;
            }
            at += part.len;
        }
    }

    /// How many of the tokens are `id`.
    pub fn count(&self, id: u32) -> usize {
        let mut block = vec![0u32; (1 << 20).min(self.len)];
        let mut found = 0;
        let mut start = 0;
        while start < self.len {
            let n = block.len().min(self.len - start);
            self.copy_range(start, &mut block[..n]);
            found += block[..n].iter().filter(|&&t| t == id).count();
            start += n;
        }
        found
    }

    pub fn to_vec(&self) -> Vec<u32> {
        let mut v = vec![0; self.len()];
        self.copy_range(0, &mut v);
        v
    }
}

/// Train and validation tokens: the first `1 - val_fraction` and the rest.
pub struct Split {
    pub train: Tokens,
    pub val: Tokens,
}

impl Split {
    /// The last `val_fraction` of `tokens` for validation, the rest for training.
    pub fn new(
        tokens: Tokens,
        val_fraction: f64,
        block_size: usize,
        corpus: &Path,
    ) -> Result<Self> {
        let n = tokens.len();
        let n_val = ((n as f64) * val_fraction).round() as usize;
        let n_train = n - n_val;
        Self::of(
            tokens.slice(0..n_train),
            tokens.slice(n_train..n),
            block_size,
            corpus,
        )
    }

    /// Given train and validation tokens (nanoGPT's train.bin and val.bin, say).
    pub fn of(train: Tokens, val: Tokens, block_size: usize, corpus: &Path) -> Result<Self> {
        let (n_train, n_val) = (train.len(), val.len());
        let need = block_size + 1;
        if n_train < need || n_val < need {
            user_bail!(
                "corpus {} has {} tokens: {n_train} for training and {n_val} for validation, but each needs at least block_size + 1 = {need}; use a longer corpus or a smaller model.block_size",
                corpus.display(),
                n_train + n_val
            );
        }
        Ok(Self { train, val })
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

    /// The largest id among its inputs and targets.
    pub fn max_id(&self) -> u32 {
        self.x.iter().chain(&self.y).copied().max().unwrap_or(0)
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

    /// Draws what `sample_into(tokens, batch)` would, without copying any token: the
    /// stream moves on as if `batch` had been refilled (a rank passing over the
    /// micro-batches of the others).
    pub fn skip(&mut self, tokens: &Tokens, batch: &Batch) {
        let max_start = tokens.len() - batch.block - 1;
        for _ in 0..batch.batch {
            self.rng.random_range(0..=max_start);
        }
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
    fn skipping_a_batch_moves_the_stream_as_drawing_it_does() {
        let tokens = Tokens::from_vec((0..1000).collect());
        let (mut drawn, mut skipped) = (BatchSampler::new(3, 1), BatchSampler::new(3, 1));
        let mut batch = Batch::empty(4, 16);
        drawn.sample_into(&tokens, &mut batch);
        let untouched = Batch::empty(4, 16);
        skipped.skip(&tokens, &untouched);
        assert_eq!(drawn.position(), skipped.position());
        assert_eq!(drawn.sample(&tokens, 4, 16), skipped.sample(&tokens, 4, 16));
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
    fn split_refuses_a_corpus_too_short() {
        let tokens = Tokens::from_vec((0..50).collect());
        let err = Split::new(tokens, 0.1, 8, Path::new("c.txt"))
            .err()
            .unwrap();
        assert!(format!("{err}").contains("block_size"));
    }
}
