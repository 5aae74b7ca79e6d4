//! A UTF-8 text file, one document, read a chunk at a time.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::Result;

use super::cut::{hard_cut, last_safe_cut, MAX_PIECE_BYTES};
use super::{Piece, Pieces};
use crate::error::user_error;

/// UTF-8's byte-order mark.
const BOM: &[u8] = b"\xEF\xBB\xBF";

pub struct TextFile {
    path: PathBuf,
    file: File,
    /// Bytes read and not yet handed out: the tail after the last cut.
    pending: Vec<u8>,
    /// Offset in the file of `pending[0]`, for error messages.
    offset: u64,
    started: bool,
    at_end: bool,
    chunk_bytes: usize,
}

impl TextFile {
    pub fn open(path: &Path, chunk_bytes: usize) -> Result<Self> {
        let file = super::open_file(path)?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
            pending: Vec::with_capacity(chunk_bytes),
            offset: 0,
            started: false,
            at_end: false,
            // At least one character of UTF-8 (up to 4 bytes) fits.
            chunk_bytes: chunk_bytes.max(4),
        })
    }

    /// Reads until `pending` holds `want` bytes or the file ends.
    fn fill(&mut self, want: usize) -> Result<()> {
        while !self.at_end && self.pending.len() < want {
            let have = self.pending.len();
            self.pending.resize(want, 0);
            let n = self.file.read(&mut self.pending[have..]).map_err(|e| {
                user_error(format!(
                    "cannot read corpus file {}: {e}",
                    self.path.display()
                ))
            })?;
            self.pending.truncate(have + n);
            self.at_end = n == 0;
        }
        Ok(())
    }
}

impl Pieces for TextFile {
    fn next_piece(&mut self) -> Result<Option<Piece>> {
        let mut want = self.chunk_bytes;
        loop {
            self.fill(want)?;
            // A byte-order mark (Windows editors write one) is not text: it would
            // be a token, or a character of a char vocabulary.
            if !self.started && self.offset == 0 && self.pending.starts_with(BOM) {
                self.pending.drain(..BOM.len());
                self.offset = BOM.len() as u64;
            }
            if self.started && self.pending.is_empty() {
                return Ok(None);
            }
            let valid = valid_prefix(&self.pending, self.at_end, &self.path, self.offset)?;
            let cut = if self.at_end {
                valid.len()
            } else {
                match last_safe_cut(valid, valid.len()) {
                    Some(cut) => cut,
                    // No safe place to cut: read on (a line of that length is rare) up to
                    // a bound, then cut where the bound falls.
                    None if want < MAX_PIECE_BYTES.max(self.chunk_bytes) => {
                        want = (want * 4).min(MAX_PIECE_BYTES.max(self.chunk_bytes));
                        continue;
                    }
                    None => hard_cut(valid, want),
                }
            };
            let piece = Piece {
                text: valid[..cut].to_string(),
                new_document: !self.started,
            };
            self.pending.drain(..cut);
            self.offset += cut as u64;
            self.started = true;
            return Ok(Some(piece));
        }
    }

    fn consumed(&self) -> u64 {
        self.offset
    }
}

/// The valid UTF-8 prefix of `bytes` (read from `path` at `offset`); a character split
/// by the last read waits for its other bytes, unless the file has ended.
fn valid_prefix<'a>(bytes: &'a [u8], at_end: bool, path: &Path, offset: u64) -> Result<&'a str> {
    match std::str::from_utf8(bytes) {
        Ok(text) => Ok(text),
        Err(e) if e.error_len().is_none() && !at_end => {
            Ok(std::str::from_utf8(&bytes[..e.valid_up_to()]).expect("a valid prefix"))
        }
        Err(_) if offset == 0 && compression(bytes).is_some() => {
            let (format, command) = compression(bytes).expect("checked");
            Err(user_error(format!(
                "corpus file {} is {format}-compressed; decompress it first ({command} {}) and name the result in data.corpus",
                path.display(),
                path.display()
            )))
        }
        Err(e) => Err(user_error(format!(
            "corpus file {} is not UTF-8 (invalid byte at offset {}); convert it, e.g. with iconv -t UTF-8",
            path.display(),
            offset + e.valid_up_to() as u64
        ))),
    }
}

/// The compressed format a file's first bytes say it is, and the command that
/// decompresses it: a `.txt.gz` read as text fails on its second byte.
pub fn compression(start: &[u8]) -> Option<(&'static str, &'static str)> {
    const MAGIC: [(&[u8], &str, &str); 5] = [
        (b"\x1f\x8b", "gzip", "gunzip -k"),
        (b"\x28\xb5\x2f\xfd", "zstd", "zstd -d"),
        (b"BZh", "bzip2", "bunzip2 -k"),
        (b"\xfd7zXZ\x00", "xz", "unxz -k"),
        (b"PK\x03\x04", "zip", "unzip"),
    ];
    MAGIC
        .iter()
        .find(|(magic, _, _)| start.starts_with(magic))
        .map(|&(_, format, command)| (format, command))
}
