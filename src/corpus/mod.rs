//! The training text as `data.corpus` names it, read as a stream.
//!
//! `data.corpus` is a file or a folder. A file's format comes from its extension:
//! - `.jsonl`: one JSON object per line, a document in its field `data.text_field`;
//! - `.parquet`: one document per row, from the column `data.text_field`;
//! - `.bin`: token ids already encoded (nanoGPT's raw u16 `train.bin`, llm.c's shards);
//! - anything else: UTF-8 text, one document per file.
//!
//! A folder's `.txt`, `.jsonl`, `.parquet` and `.bin` files are read in name order; token
//! files and text do not mix.
//!
//! Text is never held whole. [`Corpus::chunks`] reads about [`CHUNK_BYTES`] at a time,
//! cut where the tokenizer would split anyway (see `cut`), so chunks encode in parallel
//! to the ids of the whole.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use anyhow::Result;
use serde::Serialize;

use crate::config::FingerprintKind;
use crate::error::user_error;
use crate::user_bail;
use crate::util::sha256_hex;

pub mod cache;
pub mod cut;
pub mod encode;
mod jsonl;
mod parquet;
pub mod text;
pub mod token_files;
pub mod train;

/// About how much text a chunk holds.
pub const CHUNK_BYTES: usize = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Text,
    Jsonl,
    Parquet,
    /// Token ids already encoded.
    Tokens,
}

impl Format {
    pub fn of(path: &Path) -> Self {
        match extension(path).as_deref() {
            Some("jsonl") => Self::Jsonl,
            Some("parquet") => Self::Parquet,
            Some("bin") => Self::Tokens,
            _ => Self::Text,
        }
    }

    /// Whether a folder's file of this name is part of the corpus (`.TXT` as `.txt`).
    fn listed(path: &Path) -> bool {
        matches!(
            extension(path).as_deref(),
            Some("txt" | "jsonl" | "parquet" | "bin")
        )
    }
}

/// `path`'s extension in lower case.
fn extension(path: &Path) -> Option<String> {
    path.extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
}

/// What a corpus folder without a file to read holds, for its refusal: "it holds
/// notes.md, sub/ and 2 more", "it holds only hidden files (.a.txt), which are not
/// read", "it is empty".
fn what_it_holds(others: &[PathBuf], hidden: &[PathBuf]) -> String {
    let name = |p: &PathBuf| {
        let name = p
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        if p.is_dir() {
            format!("{name}/")
        } else {
            name
        }
    };
    match (others, hidden) {
        ([], []) => "it is empty".to_string(),
        ([], hidden) => format!(
            "it holds only hidden files ({}), which are not read",
            hidden
                .iter()
                .take(3)
                .map(name)
                .collect::<Vec<_>>()
                .join(", ")
        ),
        (others, _) => {
            let shown: Vec<String> = others.iter().take(3).map(name).collect();
            match others.len() - shown.len() {
                0 => format!("it holds {}", shown.join(", ")),
                more => format!("it holds {} and {more} more", shown.join(", ")),
            }
        }
    }
}

/// One file of the corpus, as it was when the corpus was opened.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct CorpusFile {
    #[serde(serialize_with = "crate::util::serialize_path_lossy")]
    pub path: PathBuf,
    pub format: Format,
    pub bytes: u64,
    /// Modification time in nanoseconds since the epoch: with the size, what the
    /// fingerprint sees of the contents.
    modified_ns: u128,
}

#[derive(Debug, Clone)]
pub struct Corpus {
    pub path: PathBuf,
    pub files: Vec<CorpusFile>,
    /// What a corpus folder holds that is not read: other kinds of file, folders, links
    /// that lead nowhere (hidden names aside). Training names them in a note.
    pub skipped: Vec<PathBuf>,
    text_field: String,
    /// Where the user named it, for messages that say what to name instead:
    /// `data.corpus`, or `--text` (eval).
    setting: &'static str,
}

/// A run of one document's text; `new_document` marks a document's first piece.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    pub text: String,
    pub new_document: bool,
}

/// Blocks a sampled fingerprint reads of each file, and their size.
const SAMPLED_BLOCKS: u64 = 64;
const SAMPLE_BLOCK: u64 = 4096;
/// Files up to this size are hashed whole even when sampled: tens of milliseconds, and
/// an edit that keeps a file's size and time is seen wherever it is.
const HASHED_WHOLE: u64 = 16 << 20;

/// SHA-256 of a file's bytes: all of them, or `SAMPLED_BLOCKS` blocks spread evenly from
/// its first to its last (all of a file up to `HASHED_WHOLE`).
fn content_hash(path: &Path, bytes: u64, how: FingerprintKind) -> Result<String> {
    use sha2::{Digest, Sha256};
    use std::io::{Read, Seek, SeekFrom};
    let mut file = open_file(path)?;
    let read_error =
        |e: std::io::Error| user_error(format!("cannot read corpus file {}: {e}", path.display()));
    if how == FingerprintKind::Full || bytes <= HASHED_WHOLE {
        let (hash, _) = crate::util::sha256_hex_of_reader(file).map_err(read_error)?;
        return Ok(hash);
    }
    let mut hasher = Sha256::new();
    let mut block = vec![0u8; SAMPLE_BLOCK as usize];
    let last = bytes - SAMPLE_BLOCK;
    for i in 0..SAMPLED_BLOCKS {
        let at = last * i / (SAMPLED_BLOCKS - 1);
        file.seek(SeekFrom::Start(at)).map_err(read_error)?;
        file.read_exact(&mut block).map_err(read_error)?;
        hasher.update(&block);
    }
    Ok(format!("{:x}", hasher.finalize()))
}

/// Opens a corpus file for reading; failing is the user's to fix (a path, permissions).
fn open_file(path: &Path) -> Result<fs::File> {
    fs::File::open(path)
        .map_err(|e| user_error(format!("cannot read corpus file {}: {e}", path.display())))
}

/// A file's documents, a piece at a time.
trait Pieces {
    fn next_piece(&mut self) -> Result<Option<Piece>>;
    /// About how many of the file's bytes are behind the pieces handed out.
    fn consumed(&self) -> u64;
}

impl Corpus {
    /// Lists the corpus's files; `text_field` names the text in jsonl and parquet files.
    pub fn open(path: &Path, text_field: &str) -> Result<Self> {
        Self::open_as(path, text_field, "data.corpus")
    }

    /// [`Corpus::open`] of a corpus the user named in `setting` (`--text`): what is
    /// refused as it is read says what to name instead there.
    pub fn open_as(path: &Path, text_field: &str, setting: &'static str) -> Result<Self> {
        let meta = fs::metadata(path).map_err(|e| {
            // A relative path is the current folder's, not the config file's: said,
            // as a config run from another folder is the likeliest cause.
            let from = match (path.is_relative(), std::env::current_dir()) {
                (true, Ok(here)) => format!(" (read from the current folder, {})", here.display()),
                _ => String::new(),
            };
            user_error(format!(
                "corpus {}: {e}{from}; set data.corpus to a text, .jsonl, .parquet or .bin file, or a folder of them{}",
                path.display(),
                if path.ends_with("data/shakespeare.txt") {
                    " (./data/prepare.sh builds data/shakespeare.txt)"
                } else {
                    ""
                }
            ))
        })?;
        let mut skipped = Vec::new();
        let paths: Vec<PathBuf> = if meta.is_dir() {
            let (mut hidden, entries): (Vec<PathBuf>, Vec<PathBuf>) = fs::read_dir(path)
                .map_err(|e| {
                    user_error(format!(
                        "corpus folder {}: cannot list it ({e}); give this user read access, or set data.corpus to another",
                        path.display()
                    ))
                })?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .partition(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')));
            hidden.sort();
            let (mut paths, mut others): (Vec<PathBuf>, Vec<PathBuf>) = entries
                .into_iter()
                .partition(|p| p.is_file() && Format::listed(p));
            paths.sort();
            others.sort();
            skipped = others;
            if paths.is_empty() {
                // Shards as downloaded (`train-0001.jsonl.gz`) are the likeliest.
                let compressed: Vec<String> = skipped
                    .iter()
                    .filter(|p| {
                        matches!(
                            extension(p).as_deref(),
                            Some("gz" | "zst" | "bz2" | "xz" | "zip")
                        )
                    })
                    .filter_map(|p| Some(p.file_name()?.to_string_lossy().into_owned()))
                    .collect();
                if let Some(first) = compressed.first() {
                    user_bail!(
                        "corpus folder {} has no .txt, .jsonl, .parquet or .bin files, only compressed ones ({first}{}); decompress them there first (e.g. gunzip -k {}/*.gz)",
                        path.display(),
                        match compressed.len() {
                            1 => String::new(),
                            n => format!(" and {} more", n - 1),
                        },
                        path.display()
                    );
                }
                user_bail!(
                    "corpus folder {} has no .txt, .jsonl, .parquet or .bin files ({}); put the files to train on there (folders inside it are not read), or name one in data.corpus",
                    path.display(),
                    what_it_holds(&skipped, &hidden)
                );
            }
            paths
        } else if !meta.is_file() {
            // A pipe reads once, and the corpus is read several times (fingerprint,
            // tokenizer, ids): it would look empty, or change between reads.
            user_bail!(
                "corpus {} is not a regular file (a pipe or a device); save it to a file first and set data.corpus to that",
                path.display()
            );
        } else if extension(path).as_deref() == Some("json") {
            // Read as text, its braces and quotes would be trained on.
            user_bail!(
                "corpus {} is a .json file; tinygpt reads JSON Lines (one object per line) as .jsonl: rename it if it is that, or convert a JSON array with jq -c '.[]' {} > {}l",
                path.display(),
                path.display(),
                path.display()
            );
        } else {
            vec![path.to_path_buf()]
        };
        let mut files = Vec::with_capacity(paths.len());
        for path in paths {
            let meta = fs::metadata(&path)
                .map_err(|e| user_error(format!("corpus file {}: {e}", path.display())))?;
            let modified_ns = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            files.push(CorpusFile {
                format: Format::of(&path),
                bytes: meta.len(),
                modified_ns,
                path,
            });
        }
        // A folder of token files may hold the text they came from too (nanoGPT's
        // data/shakespeare_char has input.txt beside train.bin): the ids are the corpus.
        if meta.is_dir() && files.iter().any(|f| f.format == Format::Tokens) {
            // Named with the rest not read: nanoGPT's input.txt is meant, a .jsonl
            // beside the ids may not be.
            let (ids, text): (Vec<CorpusFile>, Vec<CorpusFile>) =
                files.into_iter().partition(|f| f.format == Format::Tokens);
            files = ids;
            skipped.extend(text.into_iter().map(|f| f.path));
            skipped.sort();
        }
        if files.iter().all(|f| f.bytes == 0) {
            match setting {
                "data.corpus" => user_bail!(
                    "corpus {} is empty; it needs some text to train on",
                    path.display()
                ),
                _ => user_bail!(
                    "{setting} {} is empty; name a text to score",
                    path.display()
                ),
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            files,
            skipped,
            text_field: text_field.to_string(),
            setting,
        })
    }

    /// Whether the corpus is token ids already (`.bin` files), not text.
    pub fn is_tokenized(&self) -> bool {
        self.files.iter().all(|f| f.format == Format::Tokens)
    }

    /// The files' total size: what progress is measured in.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.bytes).sum()
    }

    /// A short name for cache folders: the corpus's file or folder name.
    pub fn name(&self) -> String {
        let name = self
            .path
            .file_stem()
            .map(|s| s.to_string_lossy().to_string())
            .unwrap_or_default();
        let name: String = name
            .chars()
            .map(|c| {
                if c.is_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .take(40)
            .collect();
        if name.is_empty() {
            "corpus".into()
        } else {
            name
        }
    }

    /// The jsonl field / parquet column documents are read from.
    pub fn text_field(&self) -> &str {
        &self.text_field
    }

    /// SHA-256 of what identifies the corpus's contents: the field read from
    /// jsonl/parquet and, for each file, its name, size, modification time and a hash
    /// of its bytes (`how`: sampled blocks, or all of them). A rewrite that keeps the
    /// size and the old modification time (`cp -p`, `rsync -t`) still changes the
    /// sampled blocks it touches.
    pub fn fingerprint(&self, how: FingerprintKind) -> Result<String> {
        #[derive(Serialize)]
        struct Manifest<'a> {
            text_field: &'a str,
            files: Vec<(String, u64, u128, String)>,
        }
        let files = self
            .files
            .iter()
            .map(|f| {
                let name = f.path.file_name().unwrap_or_default();
                let content = content_hash(&f.path, f.bytes, how)?;
                Ok((
                    name.to_string_lossy().to_string(),
                    f.bytes,
                    f.modified_ns,
                    content,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let manifest = Manifest {
            text_field: &self.text_field,
            files,
        };
        let text = serde_json::to_string(&manifest).expect("a manifest serialises");
        Ok(sha256_hex(text.as_bytes()))
    }

    /// The text in chunks of about [`CHUNK_BYTES`], each a list of pieces in order.
    pub fn chunks(&self) -> Chunks<'_> {
        self.chunks_of(CHUNK_BYTES)
    }

    /// The text in chunks of about `chunk_bytes`.
    pub fn chunks_of(&self, chunk_bytes: usize) -> Chunks<'_> {
        Chunks {
            corpus: self,
            chunk_bytes: chunk_bytes.max(1),
            files_done_bytes: 0,
            next_file: 0,
            current: None,
            oversized: None,
            done: false,
        }
    }

    fn open_file(&self, file: &CorpusFile, chunk_bytes: usize) -> Result<Box<dyn Pieces + Send>> {
        Ok(match file.format {
            Format::Text => Box::new(text::TextFile::open(&file.path, chunk_bytes, self.setting)?),
            Format::Jsonl => Box::new(jsonl::JsonlFile::open(
                &file.path,
                &self.text_field,
                self.setting,
            )?),
            Format::Parquet => {
                Box::new(parquet::ParquetFile::open(&file.path, &self.text_field)?)
            }
            Format::Tokens => user_bail!(
                "corpus {} holds token ids (.bin), not text; it is used as it is, with tokenizer.path",
                file.path.display()
            ),
        })
    }
}

/// See [`Corpus::chunks`].
pub struct Chunks<'a> {
    corpus: &'a Corpus,
    chunk_bytes: usize,
    /// The sizes of the files read to the end.
    files_done_bytes: u64,
    next_file: usize,
    current: Option<Box<dyn Pieces + Send>>,
    /// A document too long for one chunk, and how much of it is handed out already.
    oversized: Option<(Piece, usize)>,
    done: bool,
}

impl Chunks<'_> {
    /// About how many of the corpus's bytes (see [`Corpus::bytes`]) are read.
    pub fn position(&self) -> u64 {
        self.files_done_bytes + self.current.as_ref().map_or(0, |f| f.consumed())
    }

    fn next_piece(&mut self) -> Result<Option<Piece>> {
        if let Some((document, start)) = self.oversized.take() {
            let rest = &document.text[start..];
            let cut = cut::cut_near(rest, self.chunk_bytes);
            let piece = Piece {
                text: rest[..cut].to_string(),
                new_document: document.new_document && start == 0,
            };
            if start + cut < document.text.len() {
                self.oversized = Some((document, start + cut));
            }
            return Ok(Some(piece));
        }
        loop {
            if self.current.is_none() {
                let Some(file) = self.corpus.files.get(self.next_file) else {
                    return Ok(None);
                };
                self.next_file += 1;
                self.current = Some(self.corpus.open_file(file, self.chunk_bytes)?);
            }
            match self
                .current
                .as_mut()
                .expect("a file is open")
                .next_piece()?
            {
                Some(piece) if piece.text.len() > self.chunk_bytes => {
                    self.oversized = Some((piece, 0));
                    return self.next_piece();
                }
                Some(piece) => return Ok(Some(piece)),
                None => {
                    self.current = None;
                    self.files_done_bytes += self.corpus.files[self.next_file - 1].bytes;
                }
            }
        }
    }
}

impl Iterator for Chunks<'_> {
    type Item = Result<Vec<Piece>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let mut chunk = Vec::new();
        let mut bytes = 0;
        // Pieces of a text file come near the chunk size, one to a chunk; small
        // documents gather until half a chunk.
        while bytes < self.chunk_bytes.div_ceil(2) {
            match self.next_piece() {
                Ok(Some(piece)) => {
                    bytes += piece.text.len().max(1);
                    chunk.push(piece);
                }
                Ok(None) => break,
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            }
        }
        if chunk.is_empty() {
            self.done = true;
            return None;
        }
        Some(Ok(chunk))
    }
}
