//! A UTF-8 text file, one document, read a chunk at a time.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::Result;

use super::cut::{hard_cut, last_safe_cut};
use super::{Piece, Pieces};
use crate::error::user_error;

/// A piece grows this large, at most, looking for a safe place to cut.
const MAX_PIECE_BYTES: usize = 256 << 20;

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
        let file = File::open(path)
            .map_err(|e| user_error(format!("cannot read corpus file {}: {e}", path.display())))?;
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
        let cut = loop {
            self.fill(want)?;
            match self.cut()? {
                Some(cut) => break cut,
                // No safe place to cut: read on (a line of that length is rare) up to a
                // bound, then cut where the bound falls.
                None if want < MAX_PIECE_BYTES => want = (want * 4).min(MAX_PIECE_BYTES),
                None => break hard_cut(self.valid(), want),
            }
        };
        if self.started && self.pending.is_empty() {
            return Ok(None);
        }
        let piece = Piece {
            text: self.valid()[..cut].to_string(),
            new_document: !self.started,
        };
        self.pending.drain(..cut);
        self.offset += cut as u64;
        self.started = true;
        Ok(Some(piece))
    }

    fn consumed(&self) -> u64 {
        self.offset
    }
}

impl TextFile {
    /// The valid UTF-8 prefix of `pending` (checked by [`TextFile::cut`]).
    fn valid(&self) -> &str {
        let n = std::str::from_utf8(&self.pending).map_or_else(|e| e.valid_up_to(), str::len);
        std::str::from_utf8(&self.pending[..n]).expect("a valid prefix")
    }

    /// Where to end the next piece: all that is left at the end of the file, else the
    /// last safe cut; `None` when there is no safe cut in what is read.
    fn cut(&self) -> Result<Option<usize>> {
        // The valid prefix; a character split by the read waits for its other bytes.
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(text) => text,
            Err(e) if e.error_len().is_none() && !self.at_end => {
                std::str::from_utf8(&self.pending[..e.valid_up_to()]).expect("valid prefix")
            }
            Err(e) => {
                return Err(user_error(format!(
                    "corpus file {} is not UTF-8 (invalid byte at offset {}); convert it, e.g. with iconv -t UTF-8",
                    self.path.display(),
                    self.offset + e.valid_up_to() as u64
                )))
            }
        };
        Ok(if self.at_end {
            Some(valid.len())
        } else {
            last_safe_cut(valid, valid.len())
        })
    }
}
