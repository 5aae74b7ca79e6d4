//! How a run begins: a new run (the tokenizer trained or given, weights from the seed),
//! a resumed one (everything from its run folder), or fine-tuning (model and tokenizer
//! from another checkpoint, data and training from this config). Each gives the
//! resolved config, the tokenizer, and what to load into the engine.

use std::path::{Path, PathBuf};

use anyhow::Result;
use candle_core::Device;

use crate::checkpoint::{Loaded, RunDir, TrainState, CONFIG_FILE, MODEL_FILE, STATE_FILE};
use crate::config::{Config, ModelConfig, PositionKind, TokenizerKind};
use crate::corpus::cache::CorpusCache;
use crate::corpus::Corpus;
use crate::model::named::weights_from_file;
use crate::model::ModelSpec;
use crate::tokenizer::Tokenizer;
use crate::user_bail;
use crate::util::Stop;

/// How a run begins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Start {
    /// A new run: tokenizer from the config, random weights.
    Fresh,
    /// Continue the checkpoint in the run folder.
    Resume,
    /// A new run whose model and tokenizer start from another checkpoint (fine-tuning),
    /// at a shorter `context` than the checkpoint's where one is asked (`model.block_size`
    /// named in the config or by `--set`).
    InitFrom {
        from: PathBuf,
        context: Option<usize>,
    },
}

/// What a run starts from.
pub struct Origin {
    /// The config as the run will use it (vocabulary size filled in; a resumed or
    /// fine-tuning run's model section from its checkpoint).
    pub config: Config,
    pub tokenizer: Tokenizer,
    /// Step 0, or where the resumed run stopped.
    pub state: TrainState,
    /// The weights to start from, flat in table order: the run folder's for a resumed
    /// run, the other checkpoint's for fine-tuning; `None` for a new run (the seed's,
    /// drawn once the model is known to fit in memory).
    pub weights: Option<Vec<f32>>,
    /// A resumed run's config as its checkpoint saved it (the schedule its last steps
    /// followed, the data it trained on).
    pub saved: Option<Config>,
}

/// Resolves `start` for the run folder `run`, whose corpus is `corpus`.
pub fn resolve(
    config: Config,
    start: &Start,
    run: &RunDir,
    corpus: &Corpus,
    cache: &CorpusCache,
    stop: &Stop,
) -> Result<Origin> {
    let orphans = run.orphaned_weights();
    if !orphans.is_empty() {
        user_bail!(
            "{} holds {} but no {STATE_FILE}, which names the step and files of a checkpoint (removed, or a first save cut short); restore it to --resume, or move the folder away to start anew (a new run would overwrite these weights)",
            run.path().display(),
            orphans.join(" and ")
        );
    }
    if *start != Start::Resume && run.has_checkpoint() {
        user_bail!(
            "{} already holds a checkpoint; pass --resume to continue it, or choose another run.name (--set run.name=...)",
            run.path().display()
        );
    }
    match start {
        Start::Resume => resume(config, run),
        Start::InitFrom { from, context } => init_from(config, from, *context),
        Start::Fresh => fresh(config, corpus, cache, stop),
    }
}

/// The run folder's config, tokenizer and state; the user's [model] section must match
/// the checkpoint's.
fn resume(mut config: Config, run: &RunDir) -> Result<Origin> {
    if !run.has_checkpoint() {
        user_bail!(
            "--resume: {} holds no checkpoint to resume; drop --resume to start a new run",
            run.path().display()
        );
    }
    let state = run.state()?;
    let saved = run.load_config(&state)?;
    let mut wanted = config.model.clone();
    wanted.vocab_size = saved.model.vocab_size;
    if wanted.sinusoidal_scale.is_none() {
        // Recorded by the run (or, for a checkpoint from before, its table's 1).
        wanted.sinusoidal_scale = saved.model.sinusoidal_scale;
    }
    // A fine-tuning run's model came from the --init-from checkpoint, not from the
    // user's [model] section.
    if saved.train.init_from.is_none() && wanted.resolved() != saved.model.resolved() {
        user_bail!(
            "--resume: the [model] section differs from the checkpoint's ({}): {}; resume with the checkpoint's settings, or start a new run under another run.name",
            run.path().join(CONFIG_FILE).display(),
            model_differences(&wanted.resolved(), &saved.model.resolved()).join(", ")
        );
    }
    // Finished: trained to train.max_iters (or past it) and evaluated there. (A stop in
    // the final evaluation leaves the last step saved but not evaluated: that resumes.)
    let max = config.train.max_iters;
    if state.step > max || (state.step == max && run.has_eval_at(state.step)) {
        user_bail!(
            "--resume: {} is finished at step {} (train.max_iters = {max}); to train on, raise it: --set train.max_iters={}",
            run.path().display(),
            state.step,
            (state.step * 2).max(state.step + 1)
        );
    }
    config.model = saved.model.clone();
    config.tokenizer = saved.tokenizer.clone();
    config.train.init_from = saved.train.init_from.clone();
    let tensors = run.load_tensors(&state, MODEL_FILE, &Device::Cpu)?;
    let source = run.file(MODEL_FILE).display().to_string();
    let spec = ModelSpec::new(&config.model);
    Ok(Origin {
        weights: Some(weights_from_file(spec.params(), &tensors, &source)?),
        tokenizer: run.load_tokenizer(&state)?,
        config,
        state,
        saved: Some(saved),
    })
}

/// Each [model] key whose value differs: "n_layer = 6 (the checkpoint has 4)".
fn model_differences(wanted: &ModelConfig, saved: &ModelConfig) -> Vec<String> {
    let table = |m: &ModelConfig| toml::Table::try_from(m).unwrap_or_default();
    let (wanted, saved) = (table(wanted), table(saved));
    let shown = |v: Option<&toml::Value>| v.map_or("none".to_string(), ToString::to_string);
    super::resume::differing_keys(&saved, &wanted)
        .into_iter()
        .map(|key| {
            format!(
                "model.{key} = {} (the checkpoint has {})",
                shown(wanted.get(key)),
                shown(saved.get(key))
            )
        })
        .collect()
}

/// The model and tokenizer of the checkpoint in `dir`; data, training and dropout from
/// `config`. A `context` shorter than the checkpoint's trains on shorter sequences (its
/// learned positions cut to their first rows, as nanoGPT's `crop_block_size`: fine-tuning
/// GPT-2 at 256 tokens on a laptop); a longer one is not taken (nothing was trained for
/// positions past its own).
fn init_from(mut config: Config, dir: &Path, context: Option<usize>) -> Result<Origin> {
    let loaded = Loaded::load(dir, &Device::Cpu)?;
    let dropout = config.model.dropout;
    config.model = loaded.config.model.clone();
    config.model.dropout = dropout;
    config.tokenizer = loaded.config.tokenizer.clone();
    let mut weights = loaded.model.params().to_flat()?;
    if let Some(block) = context.filter(|&b| b < config.model.block_size) {
        weights = loaded.model.spec().with_context(&weights, block)?.1;
        config.model.block_size = block;
    }
    Ok(Origin {
        config,
        weights: Some(weights),
        tokenizer: loaded.tokenizer,
        state: TrainState::default(),
        saved: None,
    })
}

/// A tokenizer trained on the corpus (or read from tokenizer.path), and the model's
/// vocabulary set from it.
fn fresh(mut config: Config, corpus: &Corpus, cache: &CorpusCache, stop: &Stop) -> Result<Origin> {
    let tk = &config.tokenizer;
    let tokenizer = match &tk.path {
        Some(path) => {
            let tokenizer = Tokenizer::from_file(path)?;
            // A char kind asked for beside a file that is not one would be dropped.
            if tk.kind == TokenizerKind::Char && tokenizer.kind_name() != "char" {
                user_bail!(
                    "tokenizer.kind = \"char\" but tokenizer.path {} is not a char vocabulary (it is used as it is); remove tokenizer.path to train a char vocabulary on the corpus, or set tokenizer.kind = \"bpe\" to use the file",
                    path.display()
                );
            }
            tokenizer
        }
        None if corpus.is_tokenized() => {
            // A stray .bin beside the text makes the folder a folder of ids.
            let text: Vec<String> = corpus
                .skipped
                .iter()
                .filter(|p| p.is_file())
                .filter_map(|p| Some(p.file_name()?.to_string_lossy().into_owned()))
                .collect();
            let beside = match text.first() {
                Some(first) => format!(
                    " (the {first}{} beside them {} then not read: move the .bin files out to train on the text)",
                    match text.len() {
                        1 => String::new(),
                        n => format!(" and {} more", n - 1),
                    },
                    if text.len() == 1 { "is" } else { "are" }
                ),
                None => String::new(),
            };
            user_bail!(
                "corpus {} holds token ids (.bin files); set tokenizer.path to the tokenizer.json they were encoded with (GPT-2's for nanoGPT's and llm.c's files){beside}",
                corpus.path.display()
            )
        }
        None => cache.tokenizer(corpus, tk, stop)?,
    };
    let have = tokenizer.vocab_size();
    // A size asked for (any but the default) where none is chosen would otherwise be
    // dropped without a word.
    let default_size = crate::config::TokenizerConfig::default().vocab_size;
    if let Some(path) = &tk.path {
        // The file's vocabulary is the one used.
        if tk.vocab_size != have && tk.vocab_size != default_size {
            crate::errln!(
                "note: tokenizer.vocab_size = {} is not used: tokenizer.path {} brings its own {have} tokens (remove tokenizer.path to train a vocabulary of that size)",
                tk.vocab_size,
                path.display()
            );
        }
    }
    if tk.path.is_none() && tk.kind == TokenizerKind::Char && tk.vocab_size != default_size {
        crate::errln!(
            "note: tokenizer.vocab_size = {} is not used: a char tokenizer's vocabulary is the corpus's characters ({have} here; tokenizer.kind = \"bpe\" trains one of a chosen size)",
            tk.vocab_size
        );
    }
    let trained_bpe = tk.path.is_none() && tk.kind == TokenizerKind::Bpe;
    if trained_bpe && have < tk.vocab_size {
        user_bail!(
            "tokenizer.vocab_size = {} is more than corpus {} supports: BPE ran out of pairs seen twice at {have} tokens; set tokenizer.vocab_size to at most {have} or use a larger corpus",
            tk.vocab_size,
            config.data.corpus.display()
        );
    }
    if config.tokenizer.path.is_some() || config.tokenizer.kind == TokenizerKind::Char {
        // The run's config.toml says what the run used.
        config.tokenizer.vocab_size = have;
    }
    if config.model.positions == PositionKind::Sinusoidal {
        // The run's config.toml says which table the run used (see `Config::as_trained`).
        config.model.sinusoidal_scale = Some(config.model.sinusoidal_amplitude());
    }
    if config.model.vocab_size == 0 {
        config.model.vocab_size = have;
    } else if config.model.vocab_size < have {
        user_bail!(
            "config: model.vocab_size = {} is smaller than the tokenizer's {have} tokens; remove it or set it to at least {have}",
            config.model.vocab_size
        );
    }
    Ok(Origin {
        config,
        tokenizer,
        state: TrainState::default(),
        weights: None,
        saved: None,
    })
}
