//! Token files used as they are, memory-mapped: nanoGPT's `train.bin`/`val.bin` (raw
//! little-endian u16 ids, no header) and llm.c's shards (a header of 256 little-endian
//! i32: magic, version, token count; then the ids: u16 for GPT-2's magic 20240520
//! version 1, u32 for LLaMA 3's 20240801 version 7).
//!
//! A file whose header's count matches its size is taken as llm.c's; its magic must
//! then be one of those. Anything else is raw ids: nanoGPT's u16, unless its first
//! bytes read as u16 are plainly u32 ids (every second u16, the high halves, under 16
//! and mostly 0 while the others reach 256 or more: ids of a vocabulary over 65,536,
//! as tools write with `np.uint32`), which would otherwise train on two ids for each.

use std::fs::File;
use std::path::Path;

use anyhow::Result;
use memmap2::Mmap;

use super::Corpus;
use crate::data::{Storage, Tokens};
use crate::error::user_error;
use crate::user_bail;

const LLMC_HEADER_BYTES: usize = 256 * 4;
const LLMC_GPT2: (i32, i32) = (20240520, 1);
const LLMC_LLAMA3: (i32, i32) = (20240801, 7);

/// How a token file lays out its ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// nanoGPT: u16 ids from the first byte.
    Raw16,
    /// u32 ids from the first byte, no header.
    Raw32,
    /// llm.c: a 1 KiB header, then ids of `width` bytes.
    Llmc { width: usize },
}

/// Reads which layout `bytes` (a whole file) has, or why it has none.
pub fn layout(bytes: &[u8], path: &Path) -> Result<Layout> {
    layout_of_size(
        &bytes[..bytes.len().min(LLMC_HEADER_BYTES)],
        bytes.len(),
        path,
    )
}

/// [`layout`] from the file's first bytes and its size.
fn layout_of_size(head: &[u8], len: usize, path: &Path) -> Result<Layout> {
    let bytes = head;
    let int = |i: usize| -> Option<i32> {
        bytes
            .get(4 * i..4 * i + 4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    if let (Some(magic), Some(version), Some(count)) = (int(0), int(1), int(2)) {
        // llm.c's header with a size that does not match: a cut-short download, not
        // raw ids (which would train on the header and half-ids).
        let width = match (magic, version) {
            LLMC_GPT2 => Some(2),
            LLMC_LLAMA3 => Some(4),
            _ => None,
        };
        if let Some(width) = width {
            let want = (count.max(0) as u64) * width as u64 + LLMC_HEADER_BYTES as u64;
            if want != len as u64 {
                user_bail!(
                    "token file {} is a truncated llm.c shard: its header says {count} tokens ({want} bytes), the file has {len} bytes; download it again",
                    path.display()
                );
            }
        }
        for width in [2, 4] {
            let size = (count.max(0) as usize)
                .checked_mul(width)
                .and_then(|n| n.checked_add(LLMC_HEADER_BYTES));
            if count > 0 && size == Some(len) {
                return match (magic, version) {
                    LLMC_GPT2 if width == 2 => Ok(Layout::Llmc { width }),
                    LLMC_LLAMA3 if width == 4 => Ok(Layout::Llmc { width }),
                    _ => Err(user_error(format!(
                        "token file {} has an llm.c header with magic {magic} version {version}, which is neither GPT-2's ({}, {}) nor LLaMA 3's ({}, {}); regenerate it with llm.c's dev/data scripts",
                        path.display(),
                        LLMC_GPT2.0,
                        LLMC_GPT2.1,
                        LLMC_LLAMA3.0,
                        LLMC_LLAMA3.1
                    ))),
                };
            }
        }
    }
    if len.is_multiple_of(4) && high_halves_of_u32(bytes) {
        return Ok(Layout::Raw32);
    }
    if !len.is_multiple_of(2) {
        user_bail!(
            "token file {} is {len} bytes: not u16 ids (nanoGPT's .bin) nor an llm.c shard; it may be truncated",
            path.display(),
        );
    }
    Ok(Layout::Raw16)
}

/// Ids the first bytes of a raw file must hold before they are read as u32.
const RAW32_SAMPLE_IDS: usize = 64;

/// Whether `head`, a raw file's first bytes, reads as u32 ids and not as u16: taken as
/// u16, every second one (a u32's high half) is under 16 (ids under 2^20), at least
/// half of them 0 (a BPE vocabulary's frequent tokens have its low ids), while the
/// others (the low halves) reach 256. Real u16 text is not 0 at every other position
/// (GPT-2's id 0 is "!"), and a tiny vocabulary (all ids under 256) stays u16, as
/// nanoGPT's character-level files are.
fn high_halves_of_u32(head: &[u8]) -> bool {
    let ids = head.len() / 4;
    if ids < RAW32_SAMPLE_IDS {
        return false;
    }
    let halves = |at: usize| {
        head[..ids * 4]
            .chunks_exact(4)
            .map(move |b| u16::from_le_bytes([b[at], b[at + 1]]))
    };
    halves(2).all(|high| high < 16)
        && 2 * halves(2).filter(|&high| high == 0).count() >= ids
        && halves(0).any(|low| low >= 256)
}

/// Maps one token file.
pub fn open(path: &Path) -> Result<Tokens> {
    Ok(open_with_layout(path)?.0)
}

/// [`open`], and the layout it read the file in.
fn open_with_layout(path: &Path) -> Result<(Tokens, Layout)> {
    let file = File::open(path)
        .map_err(|e| user_error(format!("cannot read token file {}: {e}", path.display())))?;
    // Safety: the file is only read; a corpus rewritten while training would change the
    // ids under us, as rewriting any input would.
    let map = unsafe { Mmap::map(&file) }
        .map_err(|e| user_error(format!("cannot map token file {}: {e}", path.display())))?;
    let layout = layout(&map, path)?;
    let (offset, width) = layout.offset_and_width();
    let storage = Storage::Mapped { map, offset, width };
    Ok((Tokens::concat(vec![storage]), layout))
}

impl Layout {
    /// Where the ids start and the bytes each takes.
    fn offset_and_width(self) -> (usize, usize) {
        match self {
            Layout::Raw16 => (0, 2),
            Layout::Raw32 => (0, 4),
            Layout::Llmc { width } => (LLMC_HEADER_BYTES, width),
        }
    }
}

/// A tokenized corpus's ids: `(train, Some(val))` when some of its files are named as
/// validation (nanoGPT's `val.bin`, llm.c's `*_val_*.bin`), else `(all, None)`.
/// Every id is checked against `vocab_size`.
pub fn load(corpus: &Corpus, vocab_size: usize) -> Result<(Tokens, Option<Tokens>)> {
    let (mut train, mut val) = (Vec::new(), Vec::new());
    for file in &corpus.files {
        let (tokens, layout) = open_with_layout(&file.path)?;
        if layout == Layout::Raw32 {
            crate::errln!(
                "note: token file {} read as u32 ids: taken as nanoGPT's u16, every second id would be 0 (the high halves)",
                file.path.display()
            );
        }
        let max = max_id(&file.path)?;
        if max as usize >= vocab_size {
            user_bail!(
                "token file {} holds id {max}, outside the vocabulary of {vocab_size}; set tokenizer.path to the tokenizer it was encoded with (or model.vocab_size to at least {})",
                file.path.display(),
                max as usize + 1
            );
        }
        let name = file.path.file_name().unwrap_or_default().to_string_lossy();
        if is_validation(&name) {
            // Else the split's message would blame the corpus's length.
            if tokens.is_empty() {
                user_bail!(
                    "token file {} (validation) holds no ids; replace it, or remove it to hold out data.val_fraction of the training ids instead",
                    file.path.display()
                );
            }
            val.push(tokens);
        } else {
            train.push(tokens);
        }
    }
    if train.is_empty() {
        user_bail!(
            "corpus {} has only validation token files (named *val*); add training files",
            corpus.path.display()
        );
    }
    let val = (!val.is_empty()).then(|| Tokens::chain(val));
    Ok((Tokens::chain(train), val))
}

/// The largest id in a token file, read in blocks (not through the map, whose pages
/// would all stay resident).
fn max_id(path: &Path) -> Result<u32> {
    use std::io::Read;
    let cannot =
        |e: std::io::Error| user_error(format!("cannot read token file {}: {e}", path.display()));
    let mut file = File::open(path).map_err(cannot)?;
    let mut head = vec![0u8; LLMC_HEADER_BYTES];
    let n = file.read(&mut head).map_err(cannot)?;
    let len = file.metadata().map_err(cannot)?.len() as usize;
    // The layout needs the header and the size only.
    let (offset, width) = layout_of_size(&head[..n], len, path)?.offset_and_width();
    use std::io::{Seek, SeekFrom};
    file.seek(SeekFrom::Start(offset as u64)).map_err(cannot)?;
    let mut block = vec![0u8; 1 << 22];
    let mut max = 0u32;
    loop {
        let n = file.read(&mut block).map_err(cannot)?;
        if n == 0 {
            return Ok(max);
        }
        let whole = n - n % width;
        max = block[..whole]
            .chunks_exact(width)
            .map(|b| match width {
                2 => u16::from_le_bytes([b[0], b[1]]) as u32,
                _ => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            })
            .fold(max, u32::max);
        if whole < n {
            // A read that ended inside an id: take its bytes again next time.
            file.seek(SeekFrom::Current(-((n - whole) as i64)))
                .map_err(cannot)?;
        }
    }
}

/// nanoGPT's `val.bin`, llm.c's `fineweb_val_000000.bin`, `tiny_shakespeare_val.bin`.
fn is_validation(name: &str) -> bool {
    let stem = name.strip_suffix(".bin").unwrap_or(name);
    stem == "val" || stem.ends_with("_val") || stem.contains("_val_") || stem.starts_with("val_")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llmc(magic: i32, version: i32, ids: &[u16]) -> Vec<u8> {
        let mut header = [0i32; 256];
        header[0] = magic;
        header[1] = version;
        header[2] = ids.len() as i32;
        let mut bytes: Vec<u8> = header.iter().flat_map(|x| x.to_le_bytes()).collect();
        bytes.extend(ids.iter().flat_map(|x| x.to_le_bytes()));
        bytes
    }

    #[test]
    fn tells_the_layouts_apart() {
        let p = Path::new("x.bin");
        assert_eq!(
            layout(&llmc(20240520, 1, &[1, 2, 3]), p).unwrap(),
            Layout::Llmc { width: 2 }
        );
        assert_eq!(layout(&[1, 0, 2, 0], p).unwrap(), Layout::Raw16);
        let err = layout(&llmc(12345, 1, &[1, 2, 3]), p).unwrap_err();
        assert!(format!("{err}").contains("magic 12345"), "{err}");
        let mut cut = llmc(20240520, 1, &[1, 2, 3, 4]);
        cut.truncate(cut.len() - 2);
        let err = layout(&cut, p).unwrap_err();
        assert!(format!("{err}").contains("truncated"), "{err}");
        for name in [
            "val.bin",
            "fineweb_val_000000.bin",
            "tiny_shakespeare_val.bin",
            "val_1.bin",
        ] {
            assert!(is_validation(name), "{name}");
        }
        for name in [
            "train.bin",
            "fineweb_train_000001.bin",
            "interval.bin",
            "valley.bin",
        ] {
            assert!(!is_validation(name), "{name}");
        }
        assert!(layout(&[1, 0, 2], p).is_err());
    }

    #[test]
    fn raw_u32_ids_are_told_from_u16_ones() {
        let p = Path::new("x.bin");
        let bytes = |ids: &[u32], width: usize| -> Vec<u8> {
            ids.iter()
                .flat_map(|&i| i.to_le_bytes().into_iter().take(width))
                .collect()
        };
        // A 128k vocabulary's ids: most under 65,536, some above.
        let big: Vec<u32> = (0..300u32).map(|i| i * 7919 % 128_000).collect();
        assert_eq!(layout(&bytes(&big, 4), p).unwrap(), Layout::Raw32);
        // GPT-2's ids as u16 stay u16, and so does a character vocabulary's...
        let gpt2: Vec<u32> = (0..300u32).map(|i| i * 7919 % 50_257).collect();
        assert_eq!(layout(&bytes(&gpt2, 2), p).unwrap(), Layout::Raw16);
        let chars: Vec<u32> = (0..300u32).map(|i| i % 5).collect();
        assert_eq!(layout(&bytes(&chars, 2), p).unwrap(), Layout::Raw16);
        // ... and numbers between commas (GPT-2's "," is 11): every second u16 small,
        // but not 0.
        let listed: Vec<u32> = (0..300u32)
            .map(|i| if i % 2 == 1 { 11 } else { 300 + i })
            .collect();
        assert_eq!(layout(&bytes(&listed, 2), p).unwrap(), Layout::Raw16);
        // Too few ids to tell: u16.
        assert_eq!(layout(&bytes(&big[..10], 4), p).unwrap(), Layout::Raw16);
    }
}
