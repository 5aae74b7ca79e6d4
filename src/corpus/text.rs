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
    /// Where the user named the file (`data.corpus`, `--text`).
    setting: &'static str,
}

impl TextFile {
    pub fn open(path: &Path, chunk_bytes: usize, setting: &'static str) -> Result<Self> {
        let file = super::open_file(path)?;
        Ok(Self {
            setting,
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
            let at = (self.path.as_path(), self.offset, self.setting);
            let valid = valid_prefix(&self.pending, self.at_end, at)?;
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
fn valid_prefix<'a>(
    bytes: &'a [u8],
    at_end: bool,
    (path, offset, setting): (&Path, u64, &str),
) -> Result<&'a str> {
    match std::str::from_utf8(bytes) {
        Ok(text) => Ok(text),
        Err(e) if e.error_len().is_none() && !at_end => {
            Ok(std::str::from_utf8(&bytes[..e.valid_up_to()]).expect("a valid prefix"))
        }
        Err(e) => {
            // What the file is can be told from its first bytes only.
            let start = if offset == 0 { bytes } else { &[] };
            let bad = offset + e.valid_up_to() as u64;
            let invalid = bytes[e.valid_up_to()];
            Err(user_error(format!(
                "{} {} {}",
                file_named_by(setting),
                path.display(),
                not_text(path, start, (bad, invalid), setting)
            )))
        }
    }
}

/// What a message calls a file the user named in `setting`: "corpus file" for
/// `data.corpus`, else the flag (`--text`).
pub fn file_named_by(setting: &str) -> &str {
    match setting {
        "data.corpus" => "corpus file",
        flag => flag,
    }
}

/// What a file that is not UTF-8 is, and the command that makes it text, for a message
/// naming `path` before it: compressed (the command that decompresses it, whatever the
/// file's name), UTF-16 (its byte-order mark), not text at all (a known file type, a
/// NUL byte), or text in another encoding (iconv from that). `start` is the file's first
/// bytes (empty where they are not at hand), `invalid` the first byte that is not
/// UTF-8, at offset `bad`; `setting` where the user names the file (`data.corpus`).
pub fn not_text(path: &Path, start: &[u8], (bad, invalid): (u64, u8), setting: &str) -> String {
    let shown = path.display();
    // Beside the file, its name with `suffix` before the extension (or instead of a
    // compression's): corpus.txt.gz -> corpus.txt, notes.txt -> notes.utf8.txt.
    let beside = |suffix: &str| {
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let (stem, ext) = match name.rsplit_once('.') {
            Some((stem, ext)) if !stem.is_empty() => (stem.to_string(), format!(".{ext}")),
            _ => (name.to_string(), String::new()),
        };
        let compressed = [".gz", ".zst", ".bz2", ".xz", ".zip"];
        let out = match (
            suffix.is_empty(),
            compressed.contains(&ext.to_ascii_lowercase().as_str()),
        ) {
            (true, true) if stem.contains('.') => stem,
            (true, _) => format!("{stem}.decompressed.txt"),
            (false, _) => format!("{stem}.{suffix}{ext}"),
        };
        path.with_file_name(out).display().to_string()
    };
    if let Some((format, command)) = compression(start) {
        return format!(
            "is {format}-compressed; decompress it first ({command} {shown} > {}) and name the result in {setting}",
            beside("")
        );
    }
    if start.starts_with(b"\xFF\xFE") || start.starts_with(b"\xFE\xFF") {
        return format!(
            "is UTF-16 text (it starts with UTF-16's byte-order mark); convert it first (iconv -f UTF-16 -t UTF-8 {shown} > {}) and name the result in {setting}",
            beside("utf8")
        );
    }
    const KINDS: [(&[u8], &str); 6] = [
        (b"\x89PNG", "a PNG image"),
        (b"\xFF\xD8\xFF", "a JPEG image"),
        (b"GIF8", "a GIF image"),
        (b"%PDF", "a PDF document"),
        (b"\x7FELF", "a program (ELF)"),
        (b"\x00\x00\x00", "binary data"),
    ];
    if let Some((_, kind)) = KINDS.iter().find(|(magic, _)| start.starts_with(magic)) {
        return format!("is not text ({kind}); name a text file in {setting}");
    }
    if let Some(nul) = start.iter().take(1 << 16).position(|&b| b == 0) {
        return format!(
            "is not text (binary: a NUL byte at offset {nul}); name a text file in {setting}"
        );
    }
    format!(
        "is not UTF-8 (byte 0x{invalid:02X} at offset {bad}); convert it from the encoding it was written in (e.g. iconv -f LATIN1 -t UTF-8 {shown} > {}; CP1252 for Windows text) and name the result in {setting}",
        beside("utf8")
    )
}

/// The compressed format a file's first bytes say it is, and the command that
/// decompresses it: a `.txt.gz` read as text fails on its second byte.
pub fn compression(start: &[u8]) -> Option<(&'static str, &'static str)> {
    // Each command writes to standard output: it works whatever the file is named
    // (gunzip refuses a name without .gz).
    const MAGIC: [(&[u8], &str, &str); 5] = [
        (b"\x1f\x8b", "gzip", "gzip -dc"),
        (b"\x28\xb5\x2f\xfd", "zstd", "zstd -dc"),
        (b"BZh", "bzip2", "bzip2 -dc"),
        (b"\xfd7zXZ\x00", "xz", "xz -dc"),
        (b"PK\x03\x04", "zip", "unzip -p"),
    ];
    MAGIC
        .iter()
        .find(|(magic, _, _)| start.starts_with(magic))
        .map(|&(_, format, command)| (format, command))
}
