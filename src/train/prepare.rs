//! A run made ready before its first step: the config resolved (against its checkpoint
//! where it resumes), the corpus read, tokenized and split, the device and the memory
//! checked, the run folder opened and locked. Rank 0 prepares; the other ranks then
//! check they were given the same (`Prepared::data_summary`).

use std::collections::BTreeMap;

use anyhow::Result;
use candle_core::Device;

use super::start::{self, Start};
use crate::checkpoint::{RunDir, TrainState, METRICS_FILE};
use crate::config::{Config, TrainConfig};
use crate::corpus::cache::CorpusCache;
use crate::corpus::{token_files, Corpus};
use crate::data::Split;
use crate::device::{self, parse_device};
use crate::engine::{self, race::Work, EngineOptions};
use crate::lock::RunLock;
use crate::model::ModelSpec;
use crate::parallel::Collective;
use crate::tokenizer::Tokenizer;
use crate::user_bail;
use crate::util::{sha256_hex, Stop};

/// What rank 0 prepares before the others start: the config resolved, the data split,
/// and (rank 0 only) the run folder locked.
pub(super) struct Prepared {
    pub(super) config: Config,
    pub(super) tokenizer: Tokenizer,
    pub(super) state: TrainState,
    pub(super) weights: Option<Vec<f32>>,
    pub(super) split: Split,
    pub(super) device: Device,
    pub(super) device_choice: Option<String>,
    pub(super) lock: Option<RunLock>,
    /// The corpus cache the run reads (none for token files).
    pub(super) cache: Option<CorpusCache>,
    /// The corpus's fingerprint, as [`TrainState::corpus_fingerprint`] keeps it.
    pub(super) corpus_fingerprint: String,
    /// What training says of its data before it starts.
    pub(super) data_notes: Vec<String>,
    /// A resumed run's config as saved.
    pub(super) saved: Option<Config>,
}

impl Prepared {
    /// What the data every rank reads must agree on: the resolved config (the
    /// vocabulary filled in), the tokenizer, and the tokens (counts and a hash of each
    /// split's ends: a whole-corpus hash would cost a pass over it).
    /// Infallible: every rank must reach the comparison's collectives.
    pub(super) fn data_summary(&self) -> BTreeMap<String, String> {
        let mut summary = shared_settings(&self.config);
        let tokenizer = self
            .tokenizer
            .to_json()
            .unwrap_or_else(|e| format!("unwritable: {e}"));
        summary.insert("tokenizer".into(), sha256_hex(tokenizer.as_bytes()));
        for (name, tokens) in [("train", &self.split.train), ("val", &self.split.val)] {
            // The first and last 4,096 tokens (all of a shorter split, once).
            let n = tokens.len();
            let head = n.min(4096);
            let tail = n.saturating_sub(4096).max(head);
            let mut ends = vec![0u32; head + (n - tail)];
            tokens.copy_range(0, &mut ends[..head]);
            tokens.copy_range(tail, &mut ends[head..]);
            let bytes: Vec<u8> = ends.iter().flat_map(|id| id.to_le_bytes()).collect();
            summary.insert(format!("{name} tokens"), n.to_string());
            summary.insert(format!("{name} tokens' ends"), sha256_hex(&bytes));
        }
        summary
    }
}

/// The settings every rank must share: all but where each finds its device and its
/// corpus cache (`--device cuda:$LOCAL_RANK`, a cache on each node's own disk).
pub(super) fn shared_settings(config: &Config) -> BTreeMap<String, String> {
    let mut settings = crate::compare::flatten(config);
    settings.remove("run.device");
    settings.remove("data.cache_dir");
    settings
}

/// The run folder's lock, if the folder exists (a new run's is created and locked
/// once its config is known to be good, by [`open_run_folder`]).
pub(super) fn lock_if_present(run: &RunDir) -> Result<Option<RunLock>> {
    if run.path().is_dir() {
        RunLock::acquire(run.path()).map(Some)
    } else {
        Ok(None)
    }
}

/// Creates (or reopens) the run folder and takes its lock, unless `held`. A resumed run
/// finishes the renames of a checkpoint write that was cut short; a new one drops
/// metrics left by a run that never wrote a checkpoint (killed, or diverged at once).
pub(super) fn open_run_folder(
    run: &RunDir,
    resume: bool,
    state: &TrainState,
    held: Option<RunLock>,
) -> Result<RunLock> {
    let lock = match held {
        Some(lock) => lock,
        None => {
            std::fs::create_dir_all(run.path()).map_err(|e| {
                crate::error::user_error(format!(
                    "cannot create run folder {}: {e}; set run.out_dir to a writable folder",
                    run.path().display()
                ))
            })?;
            RunLock::acquire(run.path())?
        }
    };
    run.remove_temp_files();
    if resume {
        run.roll_forward(state)?;
    } else {
        let _ = std::fs::remove_file(run.file(METRICS_FILE));
    }
    Ok(lock)
}

/// run.out_dir made (or found) and written to before any corpus work: one that cannot
/// be failed only after the tokenizer was trained and the corpus encoded.
pub(super) fn check_out_dir(out_dir: &std::path::Path) -> Result<()> {
    if let Some(file) = out_dir.ancestors().find(|p| p.is_file()) {
        user_bail!(
            "run.out_dir {}: {} is a file, not a folder; set run.out_dir to a folder",
            out_dir.display(),
            file.display()
        );
    }
    let refused = |e: std::io::Error| {
        crate::error::user_error(format!(
            "run.out_dir {}: {e}; set run.out_dir to a writable folder",
            out_dir.display()
        ))
    };
    std::fs::create_dir_all(out_dir).map_err(refused)?;
    let probe = out_dir.join(format!(".tinygpt-write-check-{}", std::process::id()));
    std::fs::File::create(&probe).map_err(refused)?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// The engine options a training config asks for.
pub fn engine_options(train: &TrainConfig) -> EngineOptions {
    EngineOptions {
        batch: train.batch_size,
        precision: train.dtype,
        fused: train.fused,
        tf32: train.tf32,
    }
}

/// What a run needs before its engine: the config resolved (a new run's tokenizer
/// trained, a resumed run's checkpoint read), the device chosen and checked for memory,
/// the corpus's tokens split. Nothing is written to the run folder.
pub(super) fn prepare(
    config: Config,
    start: &Start,
    stop: &Stop,
    comm: &dyn Collective,
) -> Result<Prepared> {
    let ranks = comm.size();
    let auto = device::is_auto(&config.run.device);
    if auto && ranks > 1 {
        user_bail!(
            "run.device = \"auto\" times one process; with {ranks} ranks name the device: cpu, or cuda (each rank takes cuda:<its rank on the machine>)"
        );
    }
    // `auto` is raced below, once the model's vocabulary is known.
    let device = if auto {
        Device::Cpu
    } else {
        parse_device(&rank_device(&config.run.device, comm))?
    };
    let run = RunDir::new(config.run_dir());
    if comm.rank() == 0 {
        check_out_dir(&config.run.out_dir)?;
    }
    let corpus = Corpus::open(&config.data.corpus, &config.data.text_field)?;
    let cache = CorpusCache::new(&config.data.cache_dir, &corpus, config.data.fingerprint)?;
    let origin = start::resolve(config, start, &run, &corpus, &cache, stop)?;
    let (config, state) = (origin.config, origin.state);
    config.validate()?;
    let (device, device_choice) = if auto {
        let spec = ModelSpec::new(&config.model);
        let fits = |d: &Device| check_memory(&config, d, 1).is_ok();
        let options = engine_options(&config.train);
        let choice = engine::race::fastest_device(&spec, options, Work::Training, fits)?;
        (choice.device, Some(choice.why))
    } else {
        (device, None)
    };
    check_memory(&config, &device, ranks)?;
    let split = load_split(&config, &corpus, &cache, &origin.tokenizer, stop)?;
    let unknown_note = unknown_tokens(&origin.tokenizer, &split, &config)?;
    Ok(Prepared {
        corpus_fingerprint: format!(
            "{}:{}",
            format!("{:?}", config.data.fingerprint).to_lowercase(),
            cache.fingerprint()
        ),
        data_notes: skipped_note(&config.data.corpus, &corpus.skipped)
            .into_iter()
            .chain(table_note(&config.data.corpus))
            .chain(windows_line_ends_note(&origin.tokenizer))
            .chain(unknown_note)
            .collect(),
        cache: (!corpus.is_tokenized()).then_some(cache),
        config,
        tokenizer: origin.tokenizer,
        state,
        weights: origin.weights,
        saved: origin.saved,
        split,
        device,
        device_choice,
        lock: None,
    })
}

/// The device a rank trains on: `cuda` means each rank's own GPU on its machine
/// (`cuda:<local rank>`), as torchrun's LOCAL_RANK and llm.c do; a named one is kept.
pub(super) fn rank_device(device: &str, comm: &dyn Collective) -> String {
    match (device, comm.size()) {
        ("cuda", n) if n > 1 => format!("cuda:{}", comm.local_rank()),
        _ => device.to_string(),
    }
}

/// Refuses a config whose training would not fit in the memory available to one of
/// `ranks` ranks (before anything is allocated: an allocation that fails aborts).
pub fn check_memory(config: &Config, device: &Device, ranks: usize) -> Result<()> {
    let footprint = engine::footprint(device, &engine_options(&config.train));
    let need = engine::training_bytes(&config.model, &config.train, footprint, ranks);
    let gib = |bytes: f64| bytes / f64::from(1 << 30);
    let what = format!(
        "{:.2}M parameters, batch {} x {} tokens",
        ModelSpec::new(&config.model).len() as f64 / 1e6,
        config.train.batch_size,
        config.model.block_size
    );
    if device.is_cpu() {
        if let Some(available) = crate::util::available_memory_bytes() {
            if need > available {
                user_bail!(
                    "config: training this model needs about {:.1} GiB ({what}) but {:.1} GiB is available; reduce model.n_embd, model.n_layer, model.block_size or train.batch_size",
                    gib(need),
                    gib(available)
                );
            }
        }
    } else if let Some((free, total)) = crate::device::gpu_memory(device) {
        if need > free as f64 {
            user_bail!(
                "config: training this model needs about {:.1} GiB of GPU memory ({what}) but {:.1} GiB of {:.1} GiB is free; use a smaller train.batch_size with a larger train.grad_accum, a shorter model.block_size, or train.dtype = \"bf16\"",
                gib(need),
                gib(free as f64),
                gib(total as f64)
            );
        }
    }
    Ok(())
}

/// The corpus's tokens, split for training and validation: token files as they are,
/// text through the cache.
pub(super) fn load_split(
    config: &Config,
    corpus: &Corpus,
    cache: &CorpusCache,
    tokenizer: &Tokenizer,
    stop: &Stop,
) -> Result<Split> {
    let (data, block) = (&config.data, config.model.block_size);
    let vocab_size = config.model.vocab_size;
    if corpus.is_tokenized() {
        return match token_files::load(corpus, vocab_size)? {
            (train, Some(val)) => Split::of(train, val, block, &data.corpus),
            (all, None) => Split::new(all, data.val_fraction, block, &data.corpus),
        };
    }
    let (tokens, max) = cache.tokens(corpus, tokenizer, stop)?;
    if !tokens.is_empty() && max as usize >= vocab_size {
        user_bail!(
            "the token cache in {} holds id {max}, outside the model's vocabulary of {vocab_size}; delete that folder and retry",
            cache.dir().display()
        );
    }
    Split::new(tokens, data.val_fraction, block, &data.corpus)
}

/// A tokenizer that maps what it cannot spell to one unknown token (a WordPiece or
/// SentencePiece tokenizer.json without byte fallback; byte-level BPE spells any text):
/// a note where some of the corpus became that token, a refusal where much of it did
/// (the model would learn `[UNK]`).
pub(super) fn unknown_tokens(
    tokenizer: &Tokenizer,
    split: &crate::data::Split,
    config: &Config,
) -> Result<Option<String>> {
    let Some((name, id)) = tokenizer.unknown_token() else {
        return Ok(None);
    };
    let total = split.train.len() + split.val.len();
    let unknown = split.train.count(id) + split.val.count(id);
    if unknown == 0 || total == 0 {
        return Ok(None);
    }
    let share = 100.0 * unknown as f64 / total as f64;
    let path = config
        .tokenizer
        .path
        .as_ref()
        .map_or_else(|| "the tokenizer".to_string(), |p| p.display().to_string());
    if share >= 5.0 {
        user_bail!(
            "{share:.0}% of the corpus's tokens ({unknown} of {total}) are the unknown token {name:?}: {path} cannot spell this corpus; use a tokenizer with byte fallback, or leave tokenizer.path out to train a byte-level BPE (which spells any text)"
        );
    }
    Ok(Some(format!(
        "note: {unknown} of the corpus's {total} tokens ({share:.2}%) are the unknown token {name:?}: {path} cannot spell some of its text"
    )))
}

/// The note for a char vocabulary that holds '\r': the corpus has Windows line ends,
/// and the model learns to write them (a Unix terminal shows each as a stray ^M or a
/// line overwritten).
pub(super) fn windows_line_ends_note(tokenizer: &Tokenizer) -> Option<String> {
    (tokenizer.kind_name() == "char" && tokenizer.unknown_char("\r").is_none()).then(|| {
        "note: the char vocabulary holds '\\r': the corpus has Windows line ends (\\r\\n), which the model learns to write too; convert them (dos2unix) before training for text with \\n alone".to_string()
    })
}

/// The note for a corpus file that is a table (.csv, .tsv): read as the plain text it
/// is, its header, separators and quotes are trained on with the rest.
pub(super) fn table_note(corpus: &std::path::Path) -> Option<String> {
    let extension = corpus.extension()?.to_str()?.to_ascii_lowercase();
    matches!(extension.as_str(), "csv" | "tsv").then(|| {
        format!(
            "note: corpus {} is read as plain text, its header, separators and quotes included; to train on one column, write it as .jsonl, one {{\"text\": ...}} a line (e.g. python3 -c \"import csv,json,sys; [print(json.dumps({{'text': r['COLUMN']}})) for r in csv.DictReader(open(sys.argv[1]))]\" {} > data.jsonl)",
            corpus.display(),
            corpus.display()
        )
    })
}

/// The note naming what corpus folder `corpus` holds that training does not read: a
/// `.csv` or a subfolder left there by mistake would otherwise go unseen.
pub(super) fn skipped_note(
    corpus: &std::path::Path,
    skipped: &[std::path::PathBuf],
) -> Option<String> {
    if skipped.is_empty() {
        return None;
    }
    let mut names: Vec<String> = skipped
        .iter()
        .take(4)
        .map(|p| {
            let name = p
                .file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
            match (p.is_dir(), p.exists()) {
                (true, _) => format!("{name}/"),
                (false, false) => format!("{name} (a link to nothing)"),
                _ => name,
            }
        })
        .collect();
    if skipped.len() > 4 {
        names.push(format!("and {} more", skipped.len() - 4));
    }
    Some(format!(
        "note: corpus folder {} also holds {} not read (only .txt, .jsonl, .parquet and .bin files directly in it are): {}",
        corpus.display(),
        match skipped.len() {
            1 => "1 entry".to_string(),
            n => format!("{n} entries"),
        },
        names.join(", ")
    ))
}
