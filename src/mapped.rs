//! A checkpoint opened for the CPU decoder, straight from its mapped file.
//!
//! `Loaded` (in `checkpoint`) builds a candle model: the file read into memory, parsed
//! into tensors, gathered into a flat buffer, built into the model: four copies of the
//! weights at the peak and seconds of copying before the first token. The CPU decoder
//! needs none of that. Here model.safetensors is mapped into memory; bf16, int8 and int4
//! convert its tensors a slice at a time and give each slice's pages back
//! (`DecodeWeights`), copy the small tensors, and the file is unmapped once converted.
//! f32 weights are used where they lie (the page cache's pages, shared with any other
//! process reading the file) for a look ([`Hold::InPlace`]: `info`, a server's sample
//! of a training run), and for decoding ([`Hold::Streamed`]) copied onto huge pages
//! where the kernel lends them, the same way, slice by slice (a private copy, which a
//! token's products read 7% faster than the file's 4 KiB pages: PERFORMANCE.md).
//!
//! The file's SHA-256 (recorded in state.json) is still checked, for a torn or changed
//! file must not decode, but beside the loading rather than before it: a thread hashes
//! the file (read, not through the mapping) while the weights are converted, and decoding waits for its answer
//! before the first token. A file that passed is noted in `.verified` in the run
//! folder (its size, modification time and inode), and is not hashed again until one
//! of those changes.
//!
//! Mapping is safe against training's own checkpoints: they replace a file by renaming
//! a new one over it, so the mapped bytes (the old file) never change underneath.
//! Another process that truncates the file in place takes the mapped pages away; the
//! next read of them raises SIGBUS, which [`sigbus`] turns into a one-line error naming
//! the file (exit 2) instead of a crash.

use std::collections::BTreeMap;
use std::fs;
use std::io::{Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::Result;
use serde::{Deserialize, Serialize};

use crate::checkpoint::{
    parse_config_and_tokenizer, FileDigest, RunDir, TrainState, CONFIG_FILE, MODEL_FILE,
    TOKENIZER_FILE,
};
use crate::config::Config;
use crate::cpu::decode_weights::{DecodeWeights, MappedFile, Values, WeightFormat};
use crate::model::ModelSpec;
use crate::tokenizer::Tokenizer;
use crate::user_bail;
use crate::util::sha256_hex_of_reader;

/// The run folder's note of files whose hash was checked.
pub const VERIFIED_FILE: &str = ".verified";

/// How f32 weights are held once opened (other formats are converted either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// Where they lie in the mapped file: opened in a moment, shared with other
    /// processes through the page cache. For a look: a few tokens, a description.
    InPlace,
    /// For decoding many tokens: copied onto transparent huge pages where the kernel
    /// lends them (`cpu::lines::huge_pages_lent`), in place elsewhere.
    Streamed,
}

/// A checkpoint ready for the CPU decoder.
pub struct ForDecoding {
    pub config: Config,
    pub tokenizer: Tokenizer,
    pub state: TrainState,
    pub weights: Arc<DecodeWeights>,
    /// The weights file's hash check, which may still be running.
    pub verification: Verification,
}

/// The check of a mapped file against its recorded SHA-256.
pub struct Verification {
    pending: Option<JoinHandle<Result<()>>>,
}

impl Verification {
    /// Whether nothing is left to check: `.verified` noted this very file as matching
    /// before (no hash was started), or `wait` has returned.
    pub fn checked_before(&self) -> bool {
        self.pending.is_none()
    }

    /// Waits for the check; an error if the file does not match (a user error naming it).
    pub fn wait(&mut self) -> Result<()> {
        match self.pending.take() {
            None => Ok(()),
            Some(thread) => thread
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("the hash check panicked"))),
        }
    }
}

/// Whether a safetensors file's data starts on a cache line, as the files tinygpt
/// writes do (`checkpoint::DATA_ALIGNMENT`); read from its header's length.
/// The file is left at its start (its hash is read from there).
fn data_on_lines(mut file: &fs::File) -> bool {
    use std::io::Read;
    let mut header = [0u8; 8];
    let read = file.read_exact(&mut header);
    let rewound = file.seek(SeekFrom::Start(0));
    read.is_ok()
        && rewound.is_ok()
        && (8 + u64::from_le_bytes(header)).is_multiple_of(crate::checkpoint::DATA_ALIGNMENT as u64)
}

/// Opens the run folder `dir` for decoding on the CPU with weights in `format`, f32
/// ones held as `hold` says.
pub fn open_for_decoding(dir: &Path, format: WeightFormat, hold: Hold) -> Result<ForDecoding> {
    let run = RunDir::new(dir);
    run.read_settled(|state| open_described(&run, state, format, hold))
}

/// [`open_for_decoding`] for the checkpoint `state` describes.
fn open_described(
    run: &RunDir,
    state: &TrainState,
    format: WeightFormat,
    hold: Hold,
) -> Result<ForDecoding> {
    let source = run.path().display().to_string();
    let (config, tokenizer) = parse_config_and_tokenizer(
        &run.read_verified(state, CONFIG_FILE)?,
        &run.read_verified(state, TOKENIZER_FILE)?,
        &source,
    )?;
    let m = &config.model;
    let spec = ModelSpec::new(m);
    let (path, file, digest) = open_model_file(run, state)?;
    // A save renames its model in only after its state.json: if ours is still the one
    // on disk, the file just opened is the one it describes (hashed below).
    run.still_describes(state)?;
    // f32 weights decoded where they lie have their pages mapped in now, in one pass
    // the kernel batches, rather than faulted in one by one inside the first token's
    // products. Other formats, f32 weights copied onto huge pages, and f32 weights off
    // the cache lines (a file written before tinygpt aligned its tensors) read each
    // page once while converting or copying; a look (`info` reads no weight, a sample
    // a few tokens) faults in what it reads.
    let copy_f32 = format == WeightFormat::F32
        && hold == Hold::Streamed
        && crate::cpu::lines::huge_pages_lent();
    let mut options = memmap2::MmapOptions::new();
    if format == WeightFormat::F32 && hold == Hold::Streamed && !copy_f32 && data_on_lines(&file) {
        options.populate();
    }
    // Safety: read-only; see the module docs on why the bytes do not change under us.
    let map = unsafe { options.map(&file) }
        .map_err(|e| crate::error::user_error(format!("cannot map {}: {e}", path.display())))?;
    #[cfg(unix)]
    let watch: Option<Box<dyn std::any::Any + Send + Sync>> = Some(Box::new(sigbus::watch(
        map.as_ptr() as usize,
        map.len(),
        &path,
    )));
    #[cfg(not(unix))]
    let watch = None;
    let map = Arc::new(MappedFile::new(map, watch));
    let mut verification = verify(run, &path, &file, digest);
    let shown = path.display().to_string();
    let weights = match read_weights(&spec, &map, (format, copy_f32), &shown) {
        Ok(weights) => weights,
        // A torn file fails both ways; its hash names the cause better than its parse.
        Err(e) => {
            verification.wait()?;
            return Err(e);
        }
    };
    Ok(ForDecoding {
        config,
        tokenizer,
        state: state.clone(),
        weights: Arc::new(weights),
        verification,
    })
}

/// Opens model.safetensors, or the `.next` copy of an unfinished commit, whichever
/// state.json describes: by size, and where both have its size (the same model always
/// has), by hash (only after a checkpoint was cut off between its commit and its
/// renames, or while a trainer renames; the next `train --resume` finishes them). The
/// chosen file's hash is checked later, in `verify`.
///
/// `.next` is opened first: a trainer renames it over model.safetensors and only later
/// writes the next save's `.next`, so whichever moment the two opens fall on, one of the
/// files held is the one state.json describes (or state.json has changed since, which
/// the caller checks).
fn open_model_file(run: &RunDir, state: &TrainState) -> Result<(PathBuf, fs::File, FileDigest)> {
    let Some(digest) = state.files.get(MODEL_FILE) else {
        user_bail!(
            "{} does not list {MODEL_FILE}; the checkpoint is incomplete",
            run.file(crate::checkpoint::STATE_FILE).display()
        );
    };
    let (path, next) = (run.file(MODEL_FILE), run.next_file(MODEL_FILE));
    let open_sized = |p: &Path| {
        fs::File::open(p)
            .ok()
            .filter(|f| f.metadata().is_ok_and(|m| m.len() == digest.size))
    };
    let next_file = open_sized(&next);
    let (chosen, file) = match (open_sized(&path), next_file) {
        (Some(file), None) => (path, file),
        (None, Some(file)) => (next, file),
        (Some(mut file), Some(next_file)) => {
            let matches =
                sha256_hex_of_reader(&file).is_ok_and(|(sha256, _)| sha256 == digest.sha256);
            if matches {
                file.seek(SeekFrom::Start(0))
                    .map_err(|e| crate::error::user_error(format!("{}: {e}", path.display())))?;
                (path, file)
            } else {
                (next, next_file)
            }
        }
        (None, None) if !path.exists() => {
            user_bail!("{}", crate::checkpoint::missing_file(&path, "not found"))
        }
        (None, None) => user_bail!("{}", crate::checkpoint::changed_file(&path)),
    };
    Ok((chosen, file, digest.clone()))
}

/// What `.verified` remembers of a file that matched its hash.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Checked {
    size: u64,
    modified_ns: u128,
    inode: u64,
    sha256: String,
}

fn checked_now(file: &fs::File, sha256: &str) -> Option<Checked> {
    let meta = file.metadata().ok()?;
    let modified_ns = meta
        .modified()
        .ok()?
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_nanos();
    #[cfg(unix)]
    let inode = std::os::unix::fs::MetadataExt::ino(&meta);
    #[cfg(not(unix))]
    let inode = 0;
    Some(Checked {
        size: meta.len(),
        modified_ns,
        inode,
        sha256: sha256.to_string(),
    })
}

type Notes = BTreeMap<String, Checked>;

fn read_notes(run: &RunDir) -> Notes {
    fs::read(run.file(VERIFIED_FILE))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// Starts checking `file` (open at `path`, and mapped) against `digest`, unless
/// `.verified` says this very file matched it before. The check reads the file rather
/// than the mapping: hashing through the mapping would bring every page of it into
/// this process (a converted model's peak RSS would hold the f32 file too).
fn verify(run: &RunDir, path: &Path, file: &fs::File, digest: FileDigest) -> Verification {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let now = checked_now(file, &digest.sha256);
    if now.is_some() && read_notes(run).get(&name) == now.as_ref() {
        return Verification { pending: None };
    }
    // The very file that is mapped, even if `path` is renamed over meanwhile.
    let reader = file.try_clone();
    let (path, dir) = (path.to_path_buf(), run.path().to_path_buf());
    let thread = std::thread::spawn(move || {
        let (sha256, size) = reader.and_then(sha256_hex_of_reader).map_err(|e| {
            crate::error::user_error(format!("cannot read {}: {e}", path.display()))
        })?;
        if size != digest.size || sha256 != digest.sha256 {
            user_bail!("{}", crate::checkpoint::changed_file(&path));
        }
        // Noted for next time, if the folder can be written; nothing depends on it.
        if let Some(now) = now {
            let run = RunDir::new(dir);
            let mut notes = read_notes(&run);
            notes.insert(name, now);
            if let Ok(json) = serde_json::to_vec_pretty(&notes) {
                let _ = crate::util::write_atomic(&run.file(VERIFIED_FILE), &json);
            }
        }
        Ok(())
    });
    Verification {
        pending: Some(thread),
    }
}

/// The weights of `spec` in `format` from the safetensors bytes `map`, which must hold
/// exactly its tensors with its shapes, f32 tensors copied out of it if `copy_f32`
/// (nothing of the file then stays mapped); `source` names the file in errors.
fn read_weights(
    spec: &ModelSpec,
    map: &Arc<MappedFile>,
    (format, copy_f32): (WeightFormat, bool),
    source: &str,
) -> Result<DecodeWeights> {
    let file = safetensors::SafeTensors::deserialize(map).map_err(|e| {
        crate::error::user_error(format!(
            "{source} is not a valid safetensors file ({e}); restore it or retrain"
        ))
    })?;
    let table = spec.params();
    for (name, _) in file.iter() {
        if !table.iter().any(|p| p.name == name) {
            user_bail!(
                "{source}: unexpected tensor {name}; the file does not match this model's config"
            );
        }
    }
    let base = map.as_ptr() as usize;
    DecodeWeights::build(spec, format, |id| {
        let p = &spec[id];
        let Ok(view) = file.tensor(&p.name) else {
            user_bail!(
                "{source}: tensor {} is missing; the file does not match this model's config",
                p.name
            );
        };
        if view.shape() != p.shape.as_slice() {
            user_bail!(
                "{source}: tensor {} has shape {:?}, but the config needs {:?}",
                p.name,
                view.shape(),
                p.shape
            );
        }
        let start = view.data().as_ptr() as usize - base;
        if view.dtype() == safetensors::Dtype::F32 {
            if let Some(values) = Values::mapped(map, start, p.len()) {
                return Ok(if copy_f32 { values.copied() } else { values });
            }
        }
        // Another dtype (or unaligned): converted through candle, copied.
        let dtype = candle_core::DType::try_from(view.dtype())
            .map_err(|e| crate::error::user_error(format!("{source}: tensor {}: {e}", p.name)))?;
        let t = candle_core::Tensor::from_raw_buffer(
            view.data(),
            dtype,
            view.shape(),
            &candle_core::Device::Cpu,
        )?;
        Ok(Values::Owned(crate::cpu::lines::Lines::copy_of(
            &t.to_dtype(candle_core::DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?,
        )))
    })
}

/// A mapped checkpoint truncated underneath: SIGBUS on the next read of the pages it
/// lost. The handler knows the mapped ranges (the last [`sigbus::SLOTS`] mapped) and,
/// for a fault inside one, writes one line naming its file and exits 2; a fault
/// elsewhere goes to the handler that was there before (Rust's own, or the default).
#[cfg(unix)]
pub mod sigbus {
    use std::path::Path;
    use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
    use std::sync::OnceLock;

    /// Mapped ranges remembered.
    pub const SLOTS: usize = 16;
    const MESSAGE: usize = 640;

    static STARTS: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];
    static LENS: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];
    static MESSAGE_LENS: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];
    static MESSAGES: [[AtomicU8; MESSAGE]; SLOTS] =
        [const { [const { AtomicU8::new(0) }; MESSAGE] }; SLOTS];
    /// Each slot's watch (its ticket), 0 where the slot is free.
    static OWNERS: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];
    static REGISTERED: AtomicUsize = AtomicUsize::new(0);
    /// The handler before ours (zeroed: none was read).
    static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

    /// A mapping watched until this is dropped (before the mapping is unmapped: its
    /// range may then be reused, and a fault there is not the checkpoint's).
    pub struct Watch {
        slot: usize,
        ticket: usize,
    }

    impl Drop for Watch {
        fn drop(&mut self) {
            // A slot is taken from a live watch only when every slot is (more than
            // SLOTS mappings at once): it is then the newer one's, and left alone.
            if OWNERS[self.slot].load(Ordering::Acquire) == self.ticket {
                LENS[self.slot].store(0, Ordering::Release);
                let _ = OWNERS[self.slot].compare_exchange(
                    self.ticket,
                    0,
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                );
            }
        }
    }

    /// Remembers `len` bytes at `start` as the mapping of `path` until the returned
    /// watch is dropped, and installs the handler (once).
    pub fn watch(start: usize, len: usize, path: &Path) -> Watch {
        install();
        let line = format!(
            "error: {} was truncated or rewritten in place while in use (by another process; training replaces a checkpoint by renaming a new file over it, which is safe); run again once the file is whole\n",
            path.display()
        );
        let bytes = line.as_bytes();
        let bytes = &bytes[..bytes.len().min(MESSAGE)];
        // A free slot (a server's short-lived samples must not push out the model it
        // serves); with none free, the slot of the watch SLOTS tickets older.
        let ticket = REGISTERED.fetch_add(1, Ordering::AcqRel) + 1;
        let free = (0..SLOTS).map(|k| (ticket + k) % SLOTS).find(|&slot| {
            OWNERS[slot]
                .compare_exchange(0, ticket, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        });
        let slot = free.unwrap_or_else(|| {
            let slot = ticket % SLOTS;
            OWNERS[slot].store(ticket, Ordering::Release);
            slot
        });
        LENS[slot].store(0, Ordering::Release);
        for (cell, &b) in MESSAGES[slot].iter().zip(bytes) {
            cell.store(b, Ordering::Relaxed);
        }
        MESSAGE_LENS[slot].store(bytes.len(), Ordering::Relaxed);
        STARTS[slot].store(start, Ordering::Release);
        LENS[slot].store(len, Ordering::Release);
        Watch { slot, ticket }
    }

    fn install() {
        PREVIOUS.get_or_init(|| {
            // Safety: sigaction with a handler that only reads atomics, writes to
            // stderr and exits, or restores the previous action.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = handler as *const () as usize;
                action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
                libc::sigemptyset(&mut action.sa_mask);
                let mut previous: libc::sigaction = std::mem::zeroed();
                libc::sigaction(libc::SIGBUS, &action, &mut previous);
                previous
            }
        });
    }

    extern "C" fn handler(_: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
        // Safety: the kernel hands a valid siginfo_t to an SA_SIGINFO handler.
        let address = unsafe { (*info).si_addr() } as usize;
        // The watched ranges are live mappings (a watch ends before its unmapping), so
        // they never overlap: whichever holds the address is its file.
        for slot in 0..SLOTS {
            let len = LENS[slot].load(Ordering::Acquire);
            let start = STARTS[slot].load(Ordering::Relaxed);
            if len == 0 || address < start || address - start >= len {
                continue;
            }
            let mut line = [0u8; MESSAGE];
            let n = MESSAGE_LENS[slot].load(Ordering::Relaxed).min(MESSAGE);
            for (out, cell) in line.iter_mut().zip(&MESSAGES[slot]).take(n) {
                *out = cell.load(Ordering::Relaxed);
            }
            // Safety: write(2) and _exit(2) are async-signal-safe.
            unsafe {
                libc::write(2, line.as_ptr().cast(), n);
                libc::_exit(crate::error::exit_code::USER);
            }
        }
        // Not a mapped checkpoint: the previous handler takes the fault when the
        // access repeats.
        if let Some(previous) = PREVIOUS.get() {
            // Safety: restores the action that was installed before ours.
            unsafe { libc::sigaction(libc::SIGBUS, previous, std::ptr::null_mut()) };
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// A watch lasts until it is dropped; a mapping watched for long is not pushed
        /// out by many short-lived ones (a server's samples); when more than SLOTS are
        /// live, the newest takes a slot, and dropping the older watch leaves it alone.
        #[test]
        fn a_watch_ends_with_its_mapping_and_never_ends_a_newer_one() {
            let path = Path::new("model.safetensors");
            // Addresses no test maps: the handler is never asked about them.
            let first = watch(0x10_0000, 4096, path);
            let slot = first.slot;
            assert_eq!(LENS[slot].load(Ordering::Acquire), 4096);
            drop(first);
            assert_eq!(LENS[slot].load(Ordering::Acquire), 0, "unwatched");

            let served = watch(0x30_0000, 8192, path);
            for i in 0..3 * SLOTS {
                drop(watch(0x40_0000 + i * 0x1_0000, 4096, path));
            }
            assert_eq!(STARTS[served.slot].load(Ordering::Acquire), 0x30_0000);
            assert_eq!(
                LENS[served.slot].load(Ordering::Acquire),
                8192,
                "still watched"
            );

            let old = watch(0x20_0000, 4096, path);
            let newer: Vec<Watch> = (1..SLOTS)
                .map(|i| watch(0x20_0000 + i * 0x1_0000, 4096, path))
                .collect();
            let taking = watch(0x50_0000, 4096, path);
            let taken = [&served, &old]
                .into_iter()
                .chain(&newer)
                .find(|w| w.slot == taking.slot)
                .expect("every slot was live: the newest took one");
            let (slot, start) = (taken.slot, STARTS[taken.slot].load(Ordering::Acquire));
            assert_eq!(start, 0x50_0000);
            drop(newer);
            drop(old);
            drop(served);
            assert_eq!(STARTS[slot].load(Ordering::Acquire), 0x50_0000);
            assert_eq!(
                LENS[slot].load(Ordering::Acquire),
                4096,
                "the newest still watched"
            );
        }
    }
}
