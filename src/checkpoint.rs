//! The run folder: a checkpoint is a folder of ordinary files.
//!
//! ```text
//! checkpoints/<name>/
//!   config.toml            the resolved experiment
//!   tokenizer.json         Hugging Face format
//!   model.safetensors      weights (names in docs/REFERENCE.md)
//!   optimizer.safetensors  AdamW moments, for resume
//!   state.json             step, losses, RNG positions, and each file's size + sha256
//!   metrics.jsonl          one JSON object per logged step / eval
//! ```
//!
//! Crash safety. A checkpoint is written in three phases:
//! 1. each file goes to `<name>.next` (temp file, fsync, rename, fsync of the folder);
//! 2. `state.json`, recording the size and SHA-256 of every file, replaces the old one
//!    the same way: this rename is the commit point;
//! 3. each `<name>.next` is renamed to `<name>`.
//!
//! Killed before 2, the old state.json still describes the old files, untouched. Killed
//! during 3, state.json describes the new files, each either renamed or still `.next`:
//! loading takes whichever copy matches the recorded hash (and training rolls the
//! renames forward). So at every moment the folder holds one complete checkpoint.
//!
//! Reading while a trainer saves. A reader that reads state.json and then a file can
//! meet the next save's file, renamed in after its state.json committed: the pair is
//! torn, not the checkpoint. [`RunDir::read_settled`] reads again from the new
//! state.json when the one it started from was replaced meanwhile.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::config::Config;
use crate::error::user_error;
use crate::tokenizer::Tokenizer;
use crate::user_bail;
use crate::util::{sha256_hex, write_atomic};

pub const CONFIG_FILE: &str = "config.toml";
pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const STATE_FILE: &str = "state.json";
pub const METRICS_FILE: &str = "metrics.jsonl";

/// How often a read torn by a save is tried again: a save per step of a small model
/// can land inside a few reads in a row, but not inside this many.
const SETTLE_TRIES: usize = 8;

/// Format version of state.json.
pub const STATE_VERSION: u32 = 1;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FileDigest {
    pub size: u64,
    pub sha256: String,
}

impl FileDigest {
    pub fn matches(&self, bytes: &[u8]) -> bool {
        self.size == bytes.len() as u64 && self.sha256 == sha256_hex(bytes)
    }
}

/// Where training stands; everything beyond the weights that resume needs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct TrainState {
    pub version: u32,
    /// Optimiser steps completed.
    pub step: usize,
    pub tokens_seen: u64,
    pub elapsed_s: f64,
    pub last_train_loss: Option<f64>,
    pub last_val_loss: Option<f64>,
    pub best_val_loss: Option<f64>,
    /// Position of the batch sampler's RNG stream (a u128 as a decimal string: JSON
    /// numbers cannot hold it). Dropout needs no state: its masks are a function of the
    /// step.
    pub sampler_position: String,
    /// Processes that trained the steps before this checkpoint (data-parallel ranks);
    /// a step is this many times train.batch_size x train.grad_accum sequences.
    #[serde(default = "one_rank")]
    pub ranks: usize,
    /// Sequences in one optimiser step over all ranks (0 in checkpoints from before it
    /// was kept).
    #[serde(default)]
    pub sequences_per_step: usize,
    /// The fingerprint of the corpus trained on, and how it was taken (`sampled:...`,
    /// `full:...`): a resume on the same path notices a corpus edited in place. Absent
    /// in checkpoints from before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub corpus_fingerprint: Option<String>,
    /// Size and SHA-256 of every other file of the checkpoint.
    pub files: BTreeMap<String, FileDigest>,
}

/// Checkpoints from before data-parallel training were written by one process.
fn one_rank() -> usize {
    1
}

/// The run folders (those with a state.json) directly inside `dir`, sorted.
pub fn runs_inside(dir: &Path) -> Vec<String> {
    let mut runs: Vec<String> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().join(STATE_FILE).is_file())
        .map(|e| e.path().display().to_string())
        .collect();
    runs.sort();
    runs
}

/// Why the file `path` is not a run folder, and what to pass instead: the folder
/// that holds it where that is a run (or a Hugging Face folder: how to import it), the
/// run folder of an experiment file, else what a run folder is.
fn not_a_run_folder(path: &Path) -> String {
    let shown = path.display();
    let folder = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if folder.join(STATE_FILE).is_file() {
        return format!(
            "{shown} is a file; pass the run folder that holds it: {}",
            folder.display()
        );
    }
    if is_hugging_face_folder(folder) {
        return format!(
            "{shown} is a file of the Hugging Face model folder {}, not a run folder; import it first: tinygpt import --from {} --out checkpoints/{}",
            folder.display(),
            folder.display(),
            folder
                .file_name()
                .map_or("imported".into(), |n| n.to_string_lossy())
        );
    }
    if path.extension().is_some_and(|e| e == "toml") {
        if let Ok(config) = Config::load(path, &[]) {
            let run = config.run_dir();
            let when = match run.join(STATE_FILE).is_file() {
                true => String::new(),
                false => format!(" (once `tinygpt train --config {shown}` has written it)"),
            };
            return format!(
                "{shown} is an experiment file, not a run folder; pass the run folder it trains: {}{when}",
                run.display()
            );
        }
    }
    // GGUF's magic (not `gguf::is_gguf`: gguf reads checkpoints, so it is above this).
    if crate::util::file_starts_with(path, b"GGUF") {
        let stem = path
            .file_stem()
            .map_or("model".into(), |s| s.to_string_lossy());
        return format!(
            "{shown} is a GGUF file, not a run folder; import it first: tinygpt import --from {shown} --out checkpoints/{stem}"
        );
    }
    format!(
        "{shown} is a file, not a run folder; pass a folder that `tinygpt train` or `tinygpt import` wrote (one holding state.json), e.g. checkpoints/<run.name>"
    )
}

/// Whether `dir` is a Hugging Face model folder: a config.json and weights, no run.
fn is_hugging_face_folder(dir: &Path) -> bool {
    !dir.join(STATE_FILE).exists()
        && dir.join("config.json").is_file()
        && (dir.join(MODEL_FILE).is_file() || dir.join("model.safetensors.index.json").is_file())
}

/// One run's folder.
pub struct RunDir {
    path: PathBuf,
}

/// What to do about a checkpoint file that is not there (`why`: the system's words).
pub fn missing_file(path: &Path, why: &str) -> String {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let run = path.parent().unwrap_or(Path::new(".")).display();
    match name.as_ref() {
        // Only the optimizer's moments are gone: the weights still start a new run.
        OPTIMIZER_FILE => format!(
            "{}: {why}; the checkpoint cannot resume without it: restore it, or start a new run from its weights (train --init-from {run} --set run.name=...)",
            path.display()
        ),
        _ => format!(
            "{}: {why}; the checkpoint is incomplete: restore the file from a copy of the run folder",
            path.display()
        ),
    }
}

/// What to do about a checkpoint file whose bytes are not the ones state.json recorded.
pub fn changed_file(path: &Path) -> String {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    match name.as_ref() {
        CONFIG_FILE => format!(
            "{} was edited since the checkpoint was written (it no longer matches state.json): undo the edit, and give changed settings on the command line instead (train --resume --set train.lr=...)",
            path.display()
        ),
        _ => format!(
            "{} does not match the size/sha256 recorded in state.json: the file is truncated or was changed; restore it from a copy of the run folder",
            path.display()
        ),
    }
}

impl RunDir {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// True if the folder holds a completed checkpoint (its state.json).
    pub fn has_checkpoint(&self) -> bool {
        self.file(STATE_FILE).is_file()
    }

    /// The checkpoint files the folder holds without a `state.json` to name them (one
    /// removed, or a first checkpoint cut short): weights a new run would overwrite.
    pub fn orphaned_weights(&self) -> Vec<&'static str> {
        match self.has_checkpoint() {
            true => Vec::new(),
            false => [MODEL_FILE, OPTIMIZER_FILE]
                .into_iter()
                .filter(|name| self.file(name).is_file())
                .collect(),
        }
    }

    /// Writes a whole checkpoint (see the module docs for the protocol); `state.files` is
    /// filled in here.
    pub fn save(
        &self,
        config: &Config,
        tokenizer: &Tokenizer,
        weights: &HashMap<String, Tensor>,
        optimizer: &HashMap<String, Tensor>,
        state: &TrainState,
    ) -> Result<()> {
        fs::create_dir_all(&self.path).map_err(|e| {
            user_error(format!(
                "cannot create the run folder {}: {e}; pick another place",
                self.path.display()
            ))
        })?;
        let files: [(&str, Vec<u8>); 4] = [
            (CONFIG_FILE, config.to_toml_string().into_bytes()),
            (TOKENIZER_FILE, tokenizer.to_json()?.into_bytes()),
            (MODEL_FILE, serialize_tensors(weights, None)?),
            (OPTIMIZER_FILE, serialize_tensors(optimizer, None)?),
        ];
        let mut state = state.clone();
        state.version = STATE_VERSION;
        state.files.clear();
        for (name, bytes) in &files {
            write_atomic(&self.next_file(name), bytes)?;
            state.files.insert(
                name.to_string(),
                FileDigest {
                    size: bytes.len() as u64,
                    sha256: sha256_hex(bytes),
                },
            );
        }
        // The commit point.
        write_atomic(
            &self.file(STATE_FILE),
            serde_json::to_string_pretty(&state)?.as_bytes(),
        )?;
        self.roll_forward(&state)
    }

    /// Removes temp files of writes a killed process never finished.
    pub fn remove_temp_files(&self) {
        let Ok(entries) = fs::read_dir(&self.path) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') && name.contains(".tmp") {
                let _ = fs::remove_file(entry.path());
            }
        }
    }

    pub(crate) fn next_file(&self, name: &str) -> PathBuf {
        self.file(&format!("{name}.next"))
    }

    /// Finishes phase 3 of a save: renames each `<name>.next` that the committed
    /// state.json describes over `<name>`; removes ones it does not (left by a save
    /// that never committed).
    pub fn roll_forward(&self, state: &TrainState) -> Result<()> {
        for (name, digest) in &state.files {
            let next = self.next_file(name);
            if !next.exists() {
                continue;
            }
            if fs::read(&next).is_ok_and(|b| digest.matches(&b)) {
                fs::rename(&next, self.file(name))
                    .with_context(|| format!("renaming {}", next.display()))?;
            } else {
                let _ = fs::remove_file(&next);
            }
        }
        fs::File::open(&self.path)
            .and_then(|d| d.sync_all())
            .with_context(|| format!("syncing {}", self.path.display()))
    }

    /// Runs `read` on the checkpoint state.json describes. A read that failed while a
    /// save replaced state.json is run again on the new one (see the module docs), so a
    /// folder whose trainer is saving reads as one checkpoint, the newest.
    pub fn read_settled<T>(&self, mut read: impl FnMut(&TrainState) -> Result<T>) -> Result<T> {
        let mut state = self.state()?;
        for _ in 1..SETTLE_TRIES {
            let result = read(&state);
            if result.is_ok() {
                return result;
            }
            match self.state() {
                Ok(now) if now != state => state = now,
                _ => return result,
            }
        }
        read(&state)
    }

    /// Fails (for [`RunDir::read_settled`] to read again) if state.json is no longer
    /// `state`: for a reader whose files are not hashed before it goes on (a mapped
    /// model, hashed in the background).
    pub fn still_describes(&self, state: &TrainState) -> Result<()> {
        if self.state()? != *state {
            user_bail!(
                "{} was saved again while it was read; read it again",
                self.path.display()
            );
        }
        Ok(())
    }

    /// Reads state.json.
    pub fn state(&self) -> Result<TrainState> {
        let path = self.file(STATE_FILE);
        if self.path.is_file() {
            return Err(user_error(not_a_run_folder(&self.path)));
        }
        if !self.path.is_dir() {
            user_bail!(
                "checkpoint folder {} does not exist; train one first or check the path",
                self.path.display()
            );
        }
        if !path.exists() {
            let runs = runs_inside(&self.path);
            if !runs.is_empty() {
                user_bail!(
                    "{} holds run folders, not a checkpoint; pass one of them: {}",
                    self.path.display(),
                    runs.join(", ")
                );
            }
            if is_hugging_face_folder(&self.path) {
                let name = self
                    .path
                    .file_name()
                    .map_or("imported".into(), |n| n.to_string_lossy().into_owned());
                user_bail!(
                    "{} is a Hugging Face model folder (config.json), not a run folder; import it first: tinygpt import --from {} --out checkpoints/{name}",
                    self.path.display(),
                    self.path.display()
                );
            }
        }
        let bytes = fs::read(&path).map_err(|e| {
            // A trainer's folder before its first checkpoint: say so, not that it is broken.
            match crate::lock::holder(&self.path) {
                Some(trainer) => user_error(format!(
                    "{} has no checkpoint yet: a trainer ({trainer}) is writing this run and saves its first at train.checkpoint_interval (or when stopped)",
                    self.path.display()
                )),
                None => user_error(format!(
                    "{}: {e}; this folder has no complete checkpoint",
                    path.display()
                )),
            }
        })?;
        let state: TrainState = serde_json::from_slice(&bytes).map_err(|e| {
            user_error(format!(
                "{} is corrupt ({e}); restore it or retrain",
                path.display()
            ))
        })?;
        if state.version != STATE_VERSION {
            user_bail!(
                "{} has format version {}, this tinygpt reads version {STATE_VERSION}",
                path.display(),
                state.version
            );
        }
        Ok(state)
    }

    /// Reads one checkpoint file and checks it against the size and hash in `state`.
    pub fn read_verified(&self, state: &TrainState, name: &str) -> Result<Vec<u8>> {
        let path = self.file(name);
        let Some(digest) = state.files.get(name) else {
            user_bail!(
                "{} does not list {name}; the checkpoint is incomplete",
                self.file(STATE_FILE).display()
            );
        };
        let read = fs::read(&path);
        if let Ok(bytes) = &read {
            if digest.matches(bytes) {
                return Ok(read?);
            }
        }
        // Saved and committed, but not yet renamed into place; or renamed just now.
        for copy in [self.next_file(name), path.clone()] {
            if let Ok(bytes) = fs::read(copy) {
                if digest.matches(&bytes) {
                    return Ok(bytes);
                }
            }
        }
        match read {
            Err(e) => user_bail!("{}", missing_file(&path, &e.to_string())),
            Ok(_) => user_bail!("{}", changed_file(&path)),
        }
    }

    pub fn load_config(&self, state: &TrainState) -> Result<Config> {
        let bytes = self.read_verified(state, CONFIG_FILE)?;
        parse_config(&bytes, &self.file(CONFIG_FILE).display().to_string())
    }

    /// The config of the newest checkpoint, read settled (a trainer may be saving).
    pub fn saved_config(&self) -> Result<Config> {
        self.read_settled(|state| self.load_config(state))
    }

    pub fn load_tokenizer(&self, state: &TrainState) -> Result<Tokenizer> {
        let bytes = self.read_verified(state, TOKENIZER_FILE)?;
        parse_tokenizer(&bytes, &self.file(TOKENIZER_FILE).display().to_string())
    }

    /// Loads a safetensors file of the checkpoint onto `device`.
    pub fn load_tensors(
        &self,
        state: &TrainState,
        name: &str,
        device: &Device,
    ) -> Result<HashMap<String, Tensor>> {
        let bytes = self.read_verified(state, name)?;
        parse_tensors(&bytes, device, &self.file(name).display().to_string())
    }

    /// Appends one JSON object to metrics.jsonl.
    pub fn append_metrics(&self, record: &serde_json::Value) -> Result<()> {
        let path = self.file(METRICS_FILE);
        let mut f = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        writeln!(f, "{record}").with_context(|| format!("writing {}", path.display()))
    }

    /// Drops metrics logged after `step` (they belong to work lost since the checkpoint).
    /// Whether metrics.jsonl holds an evaluation of `step` (an evaluation cut short by
    /// a stop left none, and a resumed run does it again).
    pub fn has_eval_at(&self, step: usize) -> bool {
        let Ok(text) = fs::read_to_string(self.file(METRICS_FILE)) else {
            return false;
        };
        text.lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .any(|v| v["step"].as_u64() == Some(step as u64) && v.get("val_loss").is_some())
    }

    /// The step of the last evaluation logged at or before `step`, if any.
    pub fn last_eval_at_or_before(&self, step: usize) -> Option<usize> {
        let text = fs::read_to_string(self.file(METRICS_FILE)).ok()?;
        text.lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(|v| v.get("val_loss").is_some())
            .filter_map(|v| v["step"].as_u64())
            .filter(|&at| at <= step as u64)
            .max()
            .map(|at| at as usize)
    }

    pub fn truncate_metrics(&self, step: usize) -> Result<()> {
        let path = self.file(METRICS_FILE);
        let Ok(text) = fs::read_to_string(&path) else {
            return Ok(());
        };
        let kept: String = text
            .lines()
            .filter(|line| {
                serde_json::from_str::<serde_json::Value>(line)
                    .ok()
                    .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                    .is_some_and(|s| s as usize <= step)
            })
            .map(|l| format!("{l}\n"))
            .collect();
        write_atomic(&path, kept.as_bytes())
    }
}

/// config.toml's bytes to a validated config; `path` names the file in errors.
pub(crate) fn parse_config(bytes: &[u8], path: &str) -> Result<Config> {
    let text =
        std::str::from_utf8(bytes).map_err(|_| user_error(format!("{path} is not UTF-8")))?;
    let config =
        Config::from_toml_str(text, &[]).map_err(|e| user_error(format!("{path}: {e:#}")))?;
    config.validate()?;
    Ok(config.as_trained())
}

/// The bytes of a run's config.toml and tokenizer.json, parsed and checked to belong
/// together; `source` names the run folder in errors.
pub(crate) fn parse_config_and_tokenizer(
    config: &[u8],
    tokenizer: &[u8],
    source: &str,
) -> Result<(Config, Tokenizer)> {
    let config = parse_config(config, &format!("{source}/{CONFIG_FILE}"))?;
    let tokenizer = parse_tokenizer(tokenizer, &format!("{source}/{TOKENIZER_FILE}"))?;
    let m = &config.model;
    if tokenizer.vocab_size() > m.vocab_size {
        user_bail!(
            "{source}: the tokenizer has {} tokens but the model only {}; the tokenizer.json belongs to another model",
            tokenizer.vocab_size(),
            m.vocab_size
        );
    }
    Ok((config, tokenizer))
}

pub(crate) fn parse_tokenizer(bytes: &[u8], path: &str) -> Result<Tokenizer> {
    Tokenizer::from_json(bytes)
        .map_err(|e| user_error(format!("{path} is not a valid tokenizer.json ({e:#})")))
}

fn parse_tensors(bytes: &[u8], device: &Device, path: &str) -> Result<HashMap<String, Tensor>> {
    candle_core::safetensors::load_buffer(bytes, device).map_err(|e| {
        user_error(format!(
            "{path} is not a valid safetensors file ({e}); restore it or retrain"
        ))
    })
}

/// The byte boundary the tensor data of the safetensors files we write starts on: a
/// cache line, so that mapped f32 weights are read in whole lines (GGUF aligns its
/// tensors the same way). Every tensor after it starts on one too while the tensors
/// before it (sorted by name) fill whole lines, as every tensor of a model whose width
/// is a multiple of 16 does. Measured on an AMD Zen 5: f32 decoding of GPT-2 124M on one
/// thread 52 tokens/s from a file whose data sat 8 bytes past a line, 65 aligned.
pub const DATA_ALIGNMENT: usize = 64;

/// A safetensors file of `tensors` (and `metadata`), its data aligned (see
/// [`DATA_ALIGNMENT`]).
pub(crate) fn serialize_tensors(
    tensors: &HashMap<String, Tensor>,
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>> {
    // Sorted names: the same weights always give the same bytes (and hash).
    let sorted: BTreeMap<&String, &Tensor> = tensors.iter().collect();
    let mut bytes =
        safetensors::serialize(sorted.into_iter().map(|(k, v)| (k.as_str(), v)), metadata)
            .map_err(|e| anyhow::anyhow!("serialising safetensors: {e}"))?;
    align_data(&mut bytes);
    Ok(bytes)
}

/// Pads a safetensors file's JSON header with spaces, which the format allows (the
/// crate pads it to 8 bytes the same way), until its data starts on a
/// [`DATA_ALIGNMENT`] boundary.
fn align_data(bytes: &mut Vec<u8>) {
    let header: [u8; 8] = bytes[..8].try_into().expect("a safetensors file");
    let n = u64::from_le_bytes(header) as usize;
    let pad = (8 + n).wrapping_neg() % DATA_ALIGNMENT;
    bytes.splice(8 + n..8 + n, std::iter::repeat_n(b' ', pad));
    bytes[..8].copy_from_slice(&((n + pad) as u64).to_le_bytes());
}

/// A trained model ready to use: what `generate`, `eval` and `info` load.
pub struct Loaded {
    pub config: Config,
    pub tokenizer: Tokenizer,
    pub model: crate::model::Gpt,
    pub state: TrainState,
}

impl Loaded {
    /// Loads the run folder's config, tokenizer and weights onto `device`, checking that
    /// they fit together.
    pub fn load(dir: &Path, device: &Device) -> Result<Self> {
        Self::load_with(dir, device, crate::config::Precision::F32)
    }

    /// [`Loaded::load`], the model's matrix products in `products` precision (weights
    /// stay f32).
    pub fn load_with(
        dir: &Path,
        device: &Device,
        products: crate::config::Precision,
    ) -> Result<Self> {
        let run = RunDir::new(dir);
        let (state, config, tokenizer, weights) = run.read_settled(|state| {
            Ok((
                state.clone(),
                run.read_verified(state, CONFIG_FILE)?,
                run.read_verified(state, TOKENIZER_FILE)?,
                run.read_verified(state, MODEL_FILE)?,
            ))
        })?;
        let (config, tokenizer, model) = Self::from_parts(
            &config,
            &tokenizer,
            &weights,
            (device, products),
            &dir.display().to_string(),
        )?;
        Ok(Self {
            config,
            tokenizer,
            model,
            state,
        })
    }

    /// Builds a model on `device`, its products in `products` precision, from the bytes
    /// of config.toml, tokenizer.json and model.safetensors; every way they can be wrong
    /// is a user error naming `source`.
    pub fn from_parts(
        config: &[u8],
        tokenizer: &[u8],
        weights: &[u8],
        (device, products): (&Device, crate::config::Precision),
        source: &str,
    ) -> Result<(Config, Tokenizer, crate::model::Gpt)> {
        let (config, tokenizer) = parse_config_and_tokenizer(config, tokenizer, source)?;
        let m = &config.model;
        let need = 4.0 * crate::model::ModelSpec::new(m).len() as f64;
        if let Some(available) = crate::util::available_memory_bytes() {
            if need > available {
                user_bail!(
                    "{source}/{CONFIG_FILE}: the model needs {:.1} GiB, more than the {:.1} GiB available",
                    need / f64::from(1 << 30),
                    available / f64::from(1 << 30)
                );
            }
        }
        let file = format!("{source}/{MODEL_FILE}");
        let tensors = parse_tensors(weights, &Device::Cpu, &file)?;
        let spec = crate::model::ModelSpec::new(m);
        let values = crate::model::named::weights_from_file(spec.params(), &tensors, &file)?;
        let dtype = candle_core::DType::F32;
        let model = crate::model::Gpt::from_flat(&spec, &values, device, dtype, products)?;
        Ok((config, tokenizer, model))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sinusoidal_run_without_a_recorded_scale_has_the_unscaled_table() {
        let read = |toml: &str| {
            parse_config(toml.as_bytes(), "config.toml")
                .unwrap()
                .model
                .sinusoidal_scale
        };
        let sinusoidal = "[model]\npositions = \"sinusoidal\"\n";
        assert_eq!(read(sinusoidal), Some(1.0));
        assert_eq!(
            read(&format!("{sinusoidal}sinusoidal_scale = 0.25\n")),
            Some(0.25)
        );
        assert_eq!(read("[model]\npositions = \"rope\"\n"), None);
    }

    #[test]
    fn written_tensors_start_on_cache_lines_and_read_back() {
        let device = Device::Cpu;
        let mut tensors = HashMap::new();
        for (name, n) in [("a.weight", 48 * 16), ("b.bias", 16), ("c.weight", 32 * 16)] {
            let values: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
            tensors.insert(
                name.to_string(),
                Tensor::from_vec(values, n, &device).unwrap(),
            );
        }
        for metadata in [None, Some(HashMap::from([("format".into(), "pt".into())]))] {
            let bytes = serialize_tensors(&tensors, metadata).unwrap();
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            assert_eq!((8 + n) % DATA_ALIGNMENT, 0, "the data starts on a line");
            let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            for (name, view) in file.tensors() {
                let start = view.data().as_ptr() as usize - bytes.as_ptr() as usize;
                assert_eq!(start % DATA_ALIGNMENT, 0, "{name} starts on a line");
            }
            let back = parse_tensors(&bytes, &device, "test").unwrap();
            for (name, t) in &tensors {
                let got: Vec<f32> = back[name].to_vec1().unwrap();
                assert_eq!(got, t.to_vec1::<f32>().unwrap(), "{name}");
            }
        }
    }
}
