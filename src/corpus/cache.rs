//! What is made from a corpus, made once and kept for every run that uses it:
//!
//! ```text
//! <data.cache_dir, or cache/ beside the corpus>/<corpus name>-<fingerprint>/
//!     corpus.json                          the corpus it was made from: its path, the
//!                                          field read, its files
//!     used                                 when a run last read it (seconds since 1970)
//!     in-use.lock                          shared-locked by every process using the
//!                                          folder: `cache prune` leaves it alone then
//!     tokenizer-bpe-<vocab>-<sample>.json  a trained tokenizer, per settings
//!     tokenizer-char.json
//!     tokens-<tokenizer hash>.bin          the corpus's ids, little-endian u16
//!                                          (u32 above 65,536 tokens)
//!     tokens-<tokenizer hash>.json         their header, written after them
//! ```
//!
//! The fingerprint covers the corpus's files and samples of their bytes, or all of them
//! (`data.fingerprint`; see [`Corpus::fingerprint`]); the
//! tokenizer hash is the SHA-256 of its tokenizer.json, so a given `tokenizer.path` or a
//! resumed run's tokenizer finds its ids too. Files are written whole under a temporary
//! name and renamed; a header is trusted only when the ids file has the size it names.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{Context, Result};
use memmap2::Mmap;
use serde::{Deserialize, Serialize};

use super::encode::encode;
use super::train::train_tokenizer;
use super::Corpus;
use crate::config::{FingerprintKind, TokenizerConfig, TokenizerKind};
use crate::data::{Storage, Tokens};
use crate::tokenizer::Tokenizer;
use crate::util::bars::{bytes_bar, finish};
use crate::util::{sha256_hex, write_atomic, AtomicFile, Stop};

pub struct CorpusCache {
    dir: PathBuf,
    /// The corpus's fingerprint (its folder's name ends with a prefix of it).
    fingerprint: String,
    /// This process's shared lock on the folder's [`IN_USE_FILE`], taken when it first
    /// writes or reads the folder and held as long as the cache is.
    hold: Mutex<Option<fs::File>>,
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct TokensHeader {
    corpus_fingerprint: String,
    tokenizer_sha256: String,
    bytes_per_token: usize,
    tokens: usize,
    max_id: u32,
}

impl CorpusCache {
    /// The cache folder of `corpus` under `cache_dir`, or, when that is empty, under
    /// `cache` beside the corpus (created when first written); `how` says how much of
    /// the corpus its fingerprint reads.
    pub fn new(cache_dir: &Path, corpus: &Corpus, how: FingerprintKind) -> Result<Self> {
        let fingerprint = corpus.fingerprint(how)?;
        let root = root_for(cache_dir, &corpus.path);
        Ok(Self {
            dir: root.join(format!("{}-{}", corpus.name(), &fingerprint[..16])),
            fingerprint,
            hold: Mutex::new(None),
        })
    }

    /// The corpus's fingerprint (see [`Corpus::fingerprint`]).
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Before the work whose result the folder will keep: says why a corpus read before
    /// is read again ([`CorpusCache::changed_note`]), and refuses a folder this process
    /// cannot write (a tokenizer trained for minutes, then "permission denied"): a
    /// shared dataset's cache/ made by another user, a read-only mount.
    fn ready_to_fill(&self, corpus: &Corpus) -> Result<()> {
        if !self.dir.exists() {
            if let Some(note) = self.changed_note(corpus) {
                crate::errln!("{note}");
            }
        }
        crate::util::check_output_folder("data.cache_dir", &self.dir)
    }

    fn create(&self, corpus: &Corpus) -> Result<()> {
        fs::create_dir_all(&self.dir).map_err(|e| {
            crate::error::user_error(format!(
                "cannot create the cache folder {}: {e}; set data.cache_dir to a writable folder",
                self.dir.display()
            ))
        })?;
        self.hold();
        let manifest = self.dir.join(MANIFEST_FILE);
        if !manifest.exists() {
            let record = Manifest {
                corpus: corpus.path.clone(),
                text_field: corpus.text_field().to_string(),
                files: corpus.files.clone(),
            };
            write_atomic(&manifest, serde_json::to_string_pretty(&record)?.as_bytes())?;
        }
        Ok(())
    }

    /// The note for a corpus whose fingerprint moved (an edit, or only `touch`, `cp`
    /// without -p, a checkout): another cache folder beside this one was made for the
    /// same path, and its gigabytes stay until `cache prune` while this one is filled.
    fn changed_note(&self, corpus: &Corpus) -> Option<String> {
        let root = self.dir.parent()?;
        let prefix = format!("{}-", corpus.name());
        let mut earlier: Vec<(PathBuf, u64)> = fs::read_dir(root)
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(&prefix))
            })
            .filter(|p| {
                let manifest = fs::read_to_string(p.join(MANIFEST_FILE)).ok();
                manifest
                    .and_then(|m| serde_json::from_str::<Manifest>(&m).ok())
                    .is_some_and(|m| m.corpus == corpus.path)
            })
            .map(|p| {
                let bytes = fs::read_dir(&p)
                    .map(|files| {
                        files
                            .filter_map(|f| f.ok()?.metadata().ok())
                            .map(|m| m.len())
                            .sum()
                    })
                    .unwrap_or(0);
                (p, bytes)
            })
            .collect();
        earlier.sort();
        let (last, _) = earlier.last()?;
        let bytes: u64 = earlier.iter().map(|e| e.1).sum();
        Some(format!(
            "note: corpus {} is not what its cache {} was made from (its size, modification time or sampled bytes moved: an edit, or a touch or copy), so it is read again into {}; {} ({:.1} MB) until `tinygpt cache prune`",
            corpus.path.display(),
            last.display(),
            self.dir.display(),
            match earlier.len() {
                1 => "the cache made before stays".to_string(),
                n => format!("the {n} caches made before stay"),
            },
            bytes as f64 / 1e6
        ))
    }

    /// Takes this process's shared lock on the folder (once), so that `cache prune`,
    /// which deletes a folder only under an exclusive lock, leaves it alone while this
    /// process reads or writes it. Waits while a prune holds the folder; a folder it
    /// removed meanwhile is made again. Best effort: a read-only disk or one that
    /// cannot lock files (some network mounts) goes without.
    fn hold(&self) {
        let mut held = self.hold.lock().unwrap_or_else(|e| e.into_inner());
        if held.is_some() {
            return;
        }
        let path = self.dir.join(IN_USE_FILE);
        for _ in 0..8 {
            let _ = fs::create_dir_all(&self.dir);
            let open = fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path);
            let Ok(file) = open else { return };
            // Alone with the folder (no other process holds it), the files of writes a
            // killed process never finished go: an encoding cut short by kill -9 left
            // its ids' temporary file, as big as the ids, for ever.
            if file.try_lock().is_ok() {
                remove_unfinished_writes(&self.dir);
            }
            if file.lock_shared().is_err() {
                return;
            }
            // Locked in vain if a prune removed the name while this waited.
            if path.exists() {
                *held = Some(file);
                return;
            }
        }
    }

    /// Notes that a run uses the cache now (what `tinygpt cache` calls last used):
    /// called once the run has started, so a run refused as a mistake changes nothing.
    /// A cache on a read-only disk is still read: the note is best effort.
    pub fn note_use(&self) {
        if !self.dir.is_dir() {
            return;
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let _ = write_atomic(&self.dir.join(USED_FILE), now.to_string().as_bytes());
    }

    /// The file the tokenizer `config` describes is kept in.
    fn tokenizer_file(&self, config: &TokenizerConfig) -> PathBuf {
        self.dir.join(match config.kind {
            TokenizerKind::Bpe => format!(
                "tokenizer-bpe-{}-{}.json",
                config.vocab_size, config.train_bytes
            ),
            TokenizerKind::Char => "tokenizer-char.json".to_string(),
        })
    }

    /// The tokenizer `config` describes if one was trained on this corpus already
    /// (nothing is trained or written).
    pub fn trained_tokenizer(&self, config: &TokenizerConfig) -> Option<Tokenizer> {
        Tokenizer::from_file(&self.tokenizer_file(config)).ok()
    }

    /// The tokenizer `config` describes, trained on `corpus` once per settings.
    pub fn tokenizer(
        &self,
        corpus: &Corpus,
        config: &TokenizerConfig,
        stop: &Stop,
    ) -> Result<Tokenizer> {
        let file = self.tokenizer_file(config);
        // A damaged file is trained again, not trusted.
        if let Ok(tokenizer) = Tokenizer::from_file(&file) {
            return Ok(tokenizer);
        }
        self.ready_to_fill(corpus)?;
        let start = Instant::now();
        let what = match config.kind {
            TokenizerKind::Bpe => format!("training BPE ({} tokens)", config.vocab_size),
            TokenizerKind::Char => "collecting characters".to_string(),
        };
        let bar = bytes_bar(corpus.bytes(), &what);
        let tokenizer = train_tokenizer(corpus, config, &bar, stop)
            .context("training the tokenizer; nothing was kept")?;
        // A BPE that ran out of pairs is not the tokenizer asked for: refused, and not
        // kept under the name of the one asked for (a refused run changes no file).
        let have = tokenizer.vocab_size();
        if config.kind == TokenizerKind::Bpe && have < config.vocab_size {
            bar.finish_and_clear();
            // Trained on a sample of the corpus, more of it may hold more pairs.
            let more = match config.train_bytes < corpus.bytes() {
                true => format!(
                    "raise tokenizer.train_bytes (it trained on a sample: tokenizer.train_bytes = {} of the corpus's {} bytes)",
                    config.train_bytes,
                    corpus.bytes()
                ),
                false => "use a larger corpus".to_string(),
            };
            crate::user_bail!(
                "tokenizer.vocab_size = {} is more than corpus {} supports: BPE ran out of pairs seen twice at {have} tokens; set tokenizer.vocab_size to at most {have} or {more}",
                config.vocab_size,
                corpus.path.display()
            );
        }
        self.create(corpus)?;
        write_atomic(&file, tokenizer.to_json()?.as_bytes())?;
        finish(
            &bar,
            &format!(
                "tokenizer: {} tokens ({}) in {:.1} s, kept in {}",
                tokenizer.vocab_size(),
                tokenizer.kind_name(),
                start.elapsed().as_secs_f64(),
                file.display()
            ),
        );
        Ok(tokenizer)
    }

    /// The ids of `corpus` under `tokenizer`, mapped from the cache (encoded into it
    /// first if need be), and the largest of them (from the header: checking the ids
    /// needs no pass over them).
    pub fn tokens(
        &self,
        corpus: &Corpus,
        tokenizer: &Tokenizer,
        stop: &Stop,
    ) -> Result<(Tokens, u32)> {
        let tokenizer_sha256 = sha256_hex(tokenizer.to_json()?.as_bytes());
        let stem = format!("tokens-{}", &tokenizer_sha256[..16]);
        let (bin, json) = (
            self.dir.join(format!("{stem}.bin")),
            self.dir.join(format!("{stem}.json")),
        );
        let fingerprint = &self.fingerprint;
        if self.dir.is_dir() {
            self.hold();
        }
        if let Some(tokens) = read_cache(&bin, &json, fingerprint, &tokenizer_sha256) {
            return Ok(tokens);
        }

        self.ready_to_fill(corpus)?;
        let made_here = !self.dir.exists();
        self.create(corpus)?;
        let start = Instant::now();
        let bar = bytes_bar(corpus.bytes(), "encoding");
        let width = if tokenizer.vocab_size() <= 1 << 16 {
            2
        } else {
            4
        };
        let mut out = AtomicFile::create(&bin)?;
        let (mut tokens, mut max_id) = (0usize, 0u32);
        let mut bytes = Vec::new();
        let encoded = encode(corpus, tokenizer, &bar, stop, |ids, _| {
            bytes.clear();
            for &id in ids {
                if width == 2 {
                    bytes.extend_from_slice(&(id as u16).to_le_bytes());
                } else {
                    bytes.extend_from_slice(&id.to_le_bytes());
                }
            }
            tokens += ids.len();
            max_id = ids.iter().copied().fold(max_id, u32::max);
            out.write_all(&bytes)
                .with_context(|| format!("writing {}", bin.display()))
        });
        if let Err(e) = encoded {
            // Its temporary file goes first. A folder made for ids that could not be
            // made (a character the vocabulary lacks, a stop) would hold only its
            // manifest: not left behind, unless another process has put something
            // there meanwhile.
            drop(out);
            if made_here {
                let _ = fs::remove_file(self.dir.join(MANIFEST_FILE));
                let held = self.hold.lock().unwrap_or_else(|e| e.into_inner()).take();
                // Its name goes only if no other process holds it too.
                if let Some(file) = held {
                    if file.unlock().is_ok() && file.try_lock().is_ok() {
                        let _ = fs::remove_file(self.dir.join(IN_USE_FILE));
                    }
                }
                let _ = fs::remove_dir(&self.dir);
            }
            return Err(e.context("encoding the corpus; nothing partial was kept"));
        }
        out.commit()?;
        let header = TokensHeader {
            corpus_fingerprint: fingerprint.clone(),
            tokenizer_sha256: tokenizer_sha256.clone(),
            bytes_per_token: width,
            tokens,
            max_id,
        };
        write_atomic(&json, serde_json::to_string_pretty(&header)?.as_bytes())?;
        let seconds = start.elapsed().as_secs_f64();
        finish(
            &bar,
            &format!(
                "encoded {:.1} MB into {tokens} tokens in {seconds:.1} s ({:.1} MB/s), kept in {}",
                corpus.bytes() as f64 / 1e6,
                corpus.bytes() as f64 / 1e6 / seconds.max(1e-9),
                bin.display()
            ),
        );
        read_cache(&bin, &json, fingerprint, &tokenizer_sha256)
            .with_context(|| format!("reading back {}", bin.display()))
    }
}

/// The cache folder's record of the corpus it was made from.
pub const MANIFEST_FILE: &str = "corpus.json";
/// When a run last read the cache folder.
pub const USED_FILE: &str = "used";
/// Locked (shared) by each process using the cache folder; `cache prune` deletes a
/// folder, or files in it, only while it can lock this file exclusively.
pub const IN_USE_FILE: &str = "in-use.lock";

/// What `corpus.json` holds.
#[derive(Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// `data.corpus` as the run named it.
    #[serde(serialize_with = "crate::util::serialize_path_lossy")]
    pub corpus: PathBuf,
    pub text_field: String,
    pub files: Vec<super::CorpusFile>,
}

/// Whether `name` is the temporary file of a write in progress or never finished
/// ([`AtomicFile`]: `.<name>.tmp<pid>`).
pub fn is_unfinished_write(name: &str) -> bool {
    name.starts_with('.')
        && name
            .rsplit_once(".tmp")
            .is_some_and(|(_, pid)| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
}

/// Removes the unfinished writes in `dir`; call only while no other process holds it.
fn remove_unfinished_writes(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if is_unfinished_write(&entry.file_name().to_string_lossy()) {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// Where the cache folders of the corpus at `corpus` go: `cache_dir`, or `cache`
/// beside the corpus when that is empty.
/// The vocabulary of the tokenizer a run of `config` would use, where it needs no
/// training: `tokenizer.path`'s, or the one trained on `data.corpus` already (None when
/// neither is there). Reads, never writes.
pub fn known_vocab(config: &crate::config::Config) -> Option<usize> {
    if let Some(path) = &config.tokenizer.path {
        return Tokenizer::from_file(path).ok().map(|t| t.vocab_size());
    }
    let data = &config.data;
    let corpus = Corpus::open(&data.corpus, &data.text_field).ok()?;
    let cache = CorpusCache::new(&data.cache_dir, &corpus, data.fingerprint).ok()?;
    cache
        .trained_tokenizer(&config.tokenizer)
        .map(|t| t.vocab_size())
}

pub fn root_for(cache_dir: &Path, corpus: &Path) -> PathBuf {
    if cache_dir.as_os_str().is_empty() {
        corpus.parent().unwrap_or(Path::new("")).join("cache")
    } else {
        cache_dir.to_path_buf()
    }
}

fn read_cache(bin: &Path, json: &Path, corpus: &str, tokenizer: &str) -> Option<(Tokens, u32)> {
    let header: TokensHeader = serde_json::from_slice(&fs::read(json).ok()?).ok()?;
    if header.corpus_fingerprint != corpus || header.tokenizer_sha256 != tokenizer {
        return None;
    }
    let file = fs::File::open(bin).ok()?;
    // Safety: the cache file is replaced only by rename, never written in place.
    let map = unsafe { Mmap::map(&file) }.ok()?;
    let width = header.bytes_per_token;
    if !matches!(width, 2 | 4) || Some(map.len()) != header.tokens.checked_mul(width) {
        return None;
    }
    let tokens = Tokens::concat(vec![Storage::Mapped {
        map,
        offset: 0,
        width,
    }]);
    Some((tokens, header.max_id))
}
