//! The dashboard's data: the run folders under `--runs`, compared as `tinygpt compare`
//! compares them, their metrics.jsonl read incrementally while `train` appends to it,
//! and samples from any of their checkpoints.
//!
//! Bounded however large the files grow: each run's summary (`tinygpt compare`'s row)
//! is kept between calls and only the bytes appended since are read; a poll of the
//! feed reads at most [`LINE_MAX`] bytes; a line longer than that is skipped and
//! counted (the feed moves past it); at most [`READS_AT_ONCE`] reads run at once, on
//! blocking threads. Only what lies under `--runs` is read: folders starting with `.`
//! are not runs, and links that lead out of `--runs` are refused.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::{ApiError, ApiJson, ApiPath, ApiQuery, Fields};
use super::openai::{Limits, SamplingFields};
use super::Shared;
use crate::checkpoint::{CONFIG_FILE, METRICS_FILE, MODEL_FILE, STATE_FILE, TOKENIZER_FILE};
use crate::compare;
use crate::cpu::WeightFormat;
use crate::generate::sample::Sampler;
use crate::generate::{generate, DecodeMode, GenerateOptions, Model};

/// The longest metrics line read (longer ones are skipped and counted), and the most
/// one poll of a run's feed reads.
pub const LINE_MAX: usize = 4 << 20;
/// Dashboard reads (the list, a feed's poll) running at once; the rest wait.
pub const READS_AT_ONCE: usize = 2;
static READING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(READS_AT_ONCE);
/// Throughput readings a summary keeps for its median (evenly spaced over the run).
const RATES_KEPT: usize = 4096;
/// The largest config.toml read.
const CONFIG_MAX: u64 = 1 << 20;

/// What the dashboard keeps between calls: each run's summary so far.
#[derive(Default)]
pub struct Dashboard {
    summaries: Mutex<HashMap<PathBuf, Summary>>,
}

fn runs_dir(state: &Shared) -> Result<&PathBuf, ApiError> {
    state.options.runs.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "no runs are shown: start the server with --runs checkpoints/",
        )
    })
}

/// `path` followed through its links, if it lies under `root` (canonical); None if
/// it does not exist or leads elsewhere.
fn within(root: &Path, path: &Path) -> Option<PathBuf> {
    let real = path.canonicalize().ok()?;
    real.starts_with(root).then_some(real)
}

/// Whether `path` exists (as itself: a link counts, wherever it leads).
fn present(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}

/// --runs, canonical: what every path read must lie under.
fn root_of(state: &Shared) -> Result<(PathBuf, PathBuf), ApiError> {
    let root = runs_dir(state)?.clone();
    let real = root.canonicalize().map_err(|_| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "the --runs folder is gone; restart the server with another",
        )
    })?;
    Ok((root, real))
}

/// `message` without the server's --runs path (a client need not learn where it is).
fn hide_root(message: &str, root: &Path, real: &Path) -> String {
    let mut message = message.replace(&real.display().to_string(), "--runs");
    if root.is_absolute() {
        message = message.replace(&root.display().to_string(), "--runs");
    }
    message
}

/// The run folder `name` names (one folder under --runs, not hidden, not a link out).
fn run_dir(state: &Shared, name: &str) -> Result<(PathBuf, PathBuf), ApiError> {
    let (root, real) = root_of(state)?;
    let plain = !name.is_empty() && !name.contains(['/', '\\']) && !name.starts_with('.');
    let dir = root.join(name);
    if !plain || !within(&real, &dir).is_some_and(|d| d.is_dir()) {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no run `{name}` (the runs are the folders under --runs: GET /api/runs)"),
        ));
    }
    Ok((dir, real))
}

/// Folders under --runs that hold a run (metrics.jsonl or config.toml): not hidden,
/// not leading out of it.
fn run_folders(root: &Path, real: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .map(|e| e.path())
        .filter(|p| {
            within(real, p).is_some_and(|d| d.is_dir())
                && (present(&p.join(METRICS_FILE)) || present(&p.join(CONFIG_FILE)))
        })
        .collect();
    dirs.sort();
    dirs
}

/// Where a read of whole lines stopped.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Lines {
    /// Where the next read begins.
    pub next: u64,
    /// Lines skipped: longer than [`LINE_MAX`] (and, counted by the callers, lines
    /// that are not metrics records).
    pub skipped: u64,
    /// Whether `next` is inside such a line (the rest of it is skipped too).
    pub skipping: bool,
}

/// Reads whole lines of `file` from byte `from` (inside a skipped line if `skipping`),
/// at most `budget` bytes, and hands each to `each`; a line longer than [`LINE_MAX`]
/// is skipped and counted. A line not yet ended is left for the next read.
pub fn read_lines(
    file: &mut File,
    from: u64,
    budget: u64,
    mut skipping: bool,
    mut each: impl FnMut(&[u8]),
) -> std::io::Result<Lines> {
    let len = file.metadata()?.len();
    let mut lines = Lines {
        next: from,
        skipped: 0,
        skipping,
    };
    if len <= from {
        return Ok(lines);
    }
    file.seek(SeekFrom::Start(from))?;
    // Zeroed pages cost nothing until read into.
    let size = LINE_MAX.min(usize::try_from(len - from).unwrap_or(LINE_MAX));
    let mut buffer = vec![0u8; size.max(1)];
    let (mut filled, mut read) = (0usize, 0u64);
    while read < budget {
        let want =
            (buffer.len() - filled).min(usize::try_from(budget - read).unwrap_or(usize::MAX));
        let n = file.read(&mut buffer[filled..filled + want])?;
        if n == 0 {
            break;
        }
        read += n as u64;
        filled += n;
        let mut start = 0;
        while let Some(end) = buffer[start..filled].iter().position(|&b| b == b'\n') {
            if skipping {
                skipping = false;
            } else {
                each(&buffer[start..start + end]);
            }
            start += end + 1;
        }
        lines.next += start as u64;
        buffer.copy_within(start..filled, 0);
        filled -= start;
        if filled == LINE_MAX {
            // A line longer than the buffer: dropped, and the rest of it after.
            if !skipping {
                lines.skipped += 1;
                skipping = true;
            }
            lines.next += filled as u64;
            filled = 0;
        }
        if filled == buffer.len() {
            // The buffer was sized to the file, which grew meanwhile: the rest waits.
            break;
        }
    }
    lines.skipping = skipping;
    Ok(lines)
}

/// A run's `tinygpt compare` row, kept as its metrics.jsonl grows.
#[derive(Default)]
struct Summary {
    /// The file read (device, inode), and how far.
    file: Option<(u64, u64)>,
    lines: Lines,
    steps: usize,
    /// (step, loss) of the best validation loss (the first of equals).
    best_val: Option<(f64, f64)>,
    /// (step, seconds) of the last step logged with its time.
    wall: Option<(f64, f64)>,
    /// Every `stride`-th throughput reading, for the median.
    rates: Vec<f64>,
    stride: usize,
    seen: usize,
    /// Resumes with changed settings (`compare::resume_note`), the first
    /// `compare::MAX_RESUMES`.
    resumes: Vec<String>,
}

impl Summary {
    /// Takes one record in, as `compare::Run::read` and `rows` do for the whole file.
    fn add(&mut self, record: &Value) {
        let Some(step) = record["step"].as_f64() else {
            return;
        };
        if self.resumes.len() < compare::MAX_RESUMES {
            self.resumes.extend(compare::resume_note(record));
        }
        if record["loss"].as_f64().is_some() {
            self.steps = self.steps.max(step as usize);
        }
        if let (Some(_), Some(val)) = (record["train_loss"].as_f64(), record["val_loss"].as_f64()) {
            self.steps = self.steps.max(step as usize);
            if self
                .best_val
                .is_none_or(|(_, best)| val.total_cmp(&best).is_lt())
            {
                self.best_val = Some((step, val));
            }
        }
        let Some(seconds) = record["elapsed_s"].as_f64() else {
            return;
        };
        if self.wall.is_none_or(|(last, _)| step >= last) {
            self.wall = Some((step, seconds));
        }
        if let Some(rate) = record["tokens_per_s"].as_f64() {
            self.stride = self.stride.max(1);
            if self.seen.is_multiple_of(self.stride) {
                self.rates.push(rate);
                if self.rates.len() > RATES_KEPT {
                    let mut i = 0;
                    self.rates.retain(|_| {
                        i += 1;
                        i % 2 == 1
                    });
                    self.stride *= 2;
                }
            }
            self.seen += 1;
        }
    }

    /// Reads what was appended to `path` since the last call (all of it if the file
    /// was replaced or shrank); the bytes read.
    fn update(&mut self, path: &Path) -> u64 {
        let Ok(mut file) = File::open(path) else {
            *self = Self::default();
            return 0;
        };
        let Ok(meta) = file.metadata() else { return 0 };
        if !meta.is_file() {
            *self = Self::default();
            return 0;
        }
        #[cfg(unix)]
        let identity = {
            use std::os::unix::fs::MetadataExt;
            (meta.dev(), meta.ino())
        };
        #[cfg(not(unix))]
        let identity = (0, 0);
        if self.file != Some(identity) || meta.len() < self.lines.next {
            *self = Self {
                file: Some(identity),
                ..Self::default()
            };
        }
        let Lines {
            next,
            skipped,
            skipping,
        } = self.lines;
        let mut not_records = 0;
        let read = read_lines(
            &mut file,
            next,
            u64::MAX,
            skipping,
            |line| match serde_json::from_str::<Value>(&String::from_utf8_lossy(line)) {
                Ok(record) if is_record(&record) => self.add(&record),
                _ if line.iter().all(u8::is_ascii_whitespace) => {}
                _ => not_records += 1,
            },
        );
        if let Ok(lines) = read {
            self.lines = Lines {
                skipped: skipped + lines.skipped + not_records,
                ..lines
            };
        }
        self.lines.next.saturating_sub(next)
    }

    fn median_rate(&self) -> Option<f64> {
        let mut v: Vec<f64> = self
            .rates
            .iter()
            .copied()
            .filter(|x| x.is_finite())
            .collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(v[v.len() / 2])
    }
}

/// A run's settings and parameter count from its config.toml (none before its first
/// checkpoint); an error names the file only by its name.
fn read_settings(
    dir: &Path,
    real: &Path,
) -> Result<(BTreeMap<String, String>, Option<usize>), String> {
    let path = dir.join(CONFIG_FILE);
    let Some(path) = within(real, &path).filter(|p| p.is_file()) else {
        if present(&path) && within(real, &path).is_none() {
            return Err(format!("{CONFIG_FILE} leads out of --runs; refused"));
        }
        return Ok((BTreeMap::new(), None));
    };
    let mut text = String::new();
    let read = File::open(&path).and_then(|f| f.take(CONFIG_MAX).read_to_string(&mut text));
    if read.is_err() {
        return Ok((BTreeMap::new(), None));
    }
    let config =
        crate::config::Config::from_run_toml(&text).map_err(|e| format!("{CONFIG_FILE}: {e:#}"))?;
    let parameters = crate::model::ModelSpec::new(&config.model).len();
    let mut settings = compare::flatten(&config);
    // As `compare`: the process count is state.json's, a setting of its own.
    if let Some(state) = read_state(dir, real) {
        settings.insert(
            compare::RANKS.to_string(),
            compare::ranks_in(&state).to_string(),
        );
    }
    Ok((settings, Some(parameters)))
}

/// The run's state.json, where it is a readable file within --runs (a bounded read).
fn read_state(dir: &Path, real: &Path) -> Option<Value> {
    let path = within(real, &dir.join(STATE_FILE)).filter(|p| p.is_file())?;
    let mut text = String::new();
    File::open(&path)
        .and_then(|f| f.take(CONFIG_MAX).read_to_string(&mut text))
        .ok()?;
    serde_json::from_str(&text).ok()
}

/// `GET /api/runs`: each run's row of `tinygpt compare` (what differs, steps, best
/// validation loss, speed), and whether it has a checkpoint to sample.
pub async fn list(State(state): State<Shared>) -> Result<Json<Value>, ApiError> {
    let (root, real) = root_of(&state)?;
    let _turn = READING.acquire().await.map_err(|_| ApiError::stopping())?;
    let shared = Arc::clone(&state);
    let listed = tokio::task::spawn_blocking(move || {
        let dirs = run_folders(&root, &real);
        let mut summaries = shared
            .dashboard
            .summaries
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        summaries.retain(|dir, _| dirs.contains(dir));
        // A folder that cannot be read (being written, broken) is listed as such.
        let mut runs = Vec::new();
        let mut unreadable = Vec::new();
        let mut read = 0;
        for dir in &dirs {
            let name = dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let settings = match read_settings(dir, &real) {
                Ok(settings) => settings,
                Err(e) => {
                    unreadable.push(json!({"run": name, "error": hide_root(&e, &root, &real)}));
                    continue;
                }
            };
            let summary = summaries.entry(dir.clone()).or_default();
            let metrics = dir.join(METRICS_FILE);
            match within(&real, &metrics) {
                Some(path) => read += summary.update(&path),
                None if present(&metrics) => {
                    unreadable.push(json!({"run": name, "error": format!("{METRICS_FILE} leads out of --runs; refused")}));
                    continue;
                }
                None => *summary = Summary::default(),
            }
            let checkpoint = within(&real, &dir.join(STATE_FILE)).is_some();
            let summed = (
                summary.steps,
                summary.best_val,
                summary.median_rate(),
                summary.wall,
                summary.lines.skipped,
                summary.resumes.clone(),
            );
            runs.push((name, settings, checkpoint, summed));
        }
        let with_config: Vec<BTreeMap<String, String>> = runs
            .iter()
            .filter(|r| !r.1 .0.is_empty())
            .map(|r| r.1 .0.clone())
            .collect();
        let differing = compare::differing_used_keys(&with_config);
        let rows: Vec<Value> = runs
            .iter()
            .map(|(name, (settings, parameters), checkpoint, summed)| {
                let (steps, best_val, rate, wall, skipped, resumes) = summed;
                let (steps, best_val, rate, wall, skipped) = (*steps, *best_val, *rate, *wall, *skipped);
                let row = compare::Row {
                    run: name.clone(),
                    dir: None,
                    differs: if settings.is_empty() {
                        Vec::new()
                    } else {
                        compare::describe(&compare::without_unused(settings.clone()), &differing)
                    }
                    .into_iter()
                    .chain(resumes.iter().cloned())
                    .collect(),
                    parameters: *parameters,
                    steps,
                    best_val_loss: best_val.map(|b| b.1),
                    best_val_step: best_val.map(|b| b.0 as usize),
                    tokens_per_s: rate,
                    wall_s: wall.map(|w| w.1),
                };
                let mut value = serde_json::to_value(&row).unwrap_or(Value::Null);
                value["label"] = compare::label(&row).into();
                value["checkpoint"] = (*checkpoint).into();
                value["skipped_lines"] = skipped.into();
                value
            })
            .collect();
        if read > 1 << 20 {
            super::give_back_memory();
        }
        json!({ "runs": rows, "unreadable": unreadable })
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}")))?;
    Ok(Json(listed))
}

#[derive(Deserialize)]
pub struct From {
    #[serde(default)]
    from: u64,
    /// The `file` an earlier answer gave: another file under the name now (a run
    /// replaced by `mv` or rsync) is read from its start.
    #[serde(default)]
    file: String,
}

/// The identity of an open file, as the metrics feed names it (its device and inode;
/// "" where the platform has none).
fn file_identity(meta: &std::fs::Metadata) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        format!("{}-{}", meta.dev(), meta.ino())
    }
    #[cfg(not(unix))]
    {
        let _ = meta;
        String::new()
    }
}

/// Whether `record` is a metrics record a chart can draw: an object whose `step` is a
/// whole number (a hand-edited or foreign line may be any JSON at all).
fn is_record(record: &Value) -> bool {
    record.is_object() && record["step"].as_u64().is_some()
}

/// `GET /api/runs/{name}/metrics?from=BYTES&file=ID`: the records appended since byte
/// `from` of file `file`, where they were read from (`from`, or 0 where the file shrank
/// or is another now), the file's identity, where to ask from next, and how many lines
/// were skipped (longer than [`LINE_MAX`], or not a record). Only whole lines are read,
/// so a record being written is read next time; a run whose metrics.jsonl is missing
/// or not a file has none yet.
pub async fn metrics(
    State(state): State<Shared>,
    ApiPath(name): ApiPath<String>,
    ApiQuery(from): ApiQuery<From>,
) -> Result<Json<Value>, ApiError> {
    let (dir, real) = run_dir(&state, &name)?;
    let path = dir.join(METRICS_FILE);
    let path = match within(&real, &path) {
        Some(path) => path,
        None if present(&path) => {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!("run `{name}`'s {METRICS_FILE} leads out of --runs; refused"),
            ))
        }
        None => {
            return Ok(Json(
                json!({ "from": 0, "next": 0, "file": "", "records": [], "skipped": 0 }),
            ))
        }
    };
    let _turn = READING.acquire().await.map_err(|_| ApiError::stopping())?;
    type Read = (u64, String, Lines, Vec<Value>);
    let read = tokio::task::spawn_blocking(move || -> std::io::Result<Read> {
        let mut file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok((0, String::new(), Lines::default(), Vec::new()))
            }
            Err(e) => return Err(e),
        };
        let meta = file.metadata()?;
        if !meta.is_file() {
            return Ok((0, String::new(), Lines::default(), Vec::new()));
        }
        // A run started over (the file shrank, or is another file): from the start.
        let identity = file_identity(&meta);
        let replaced = !from.file.is_empty() && from.file != identity;
        let from = if from.from > meta.len() || replaced {
            0
        } else {
            from.from
        };
        // Inside a line (after one too long to read): the rest of it is skipped.
        let mut inside = false;
        if from > 0 {
            let mut byte = [0u8];
            file.seek(SeekFrom::Start(from - 1))?;
            file.read_exact(&mut byte)?;
            inside = byte[0] != b'\n';
        }
        let mut records = Vec::new();
        let mut not_records = 0;
        let mut lines = read_lines(&mut file, from, LINE_MAX as u64, inside, |line| {
            match serde_json::from_str::<Value>(&String::from_utf8_lossy(line)) {
                Ok(record) if is_record(&record) => records.push(record),
                // A blank line is no record, and no mistake either.
                _ if line.iter().all(u8::is_ascii_whitespace) => {}
                _ => not_records += 1,
            }
        })?;
        lines.skipped += not_records;
        Ok((from, identity, lines, records))
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}")))?
    .map_err(|e| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "run `{name}`'s {METRICS_FILE} cannot be read now ({}); try again",
                e.kind()
            ),
        )
    })?;
    let (from, file, lines, records) = read;
    Ok(Json(json!({
        "from": from,
        "next": lines.next,
        "file": file,
        "records": records,
        "skipped": lines.skipped,
    })))
}

/// A sample's prompt, and completions' sampling fields (checked as completions
/// checks them: the same bounds; `model`, if given, is the run's name).
#[derive(Deserialize)]
pub struct SampleRequest {
    #[serde(default)]
    prompt: String,
    #[serde(flatten)]
    sampling: SamplingFields,
}

impl Fields for SampleRequest {
    const FIELDS: &'static [&'static [&'static str]] = &[&["prompt"], SamplingFields::DRAWING];

    fn flattened(body: &Value) -> Option<serde_path_to_error::Error<serde_json::Error>> {
        SamplingFields::error_alone(body)
    }
}

/// The most tokens a dashboard sample draws (it decodes on its own, beside the batcher).
pub const SAMPLE_MAX_TOKENS: usize = 1000;

/// `POST /api/runs/{name}/sample`: a short sample from the run's latest checkpoint
/// (opened for this request, its hash checked as `generate` checks it; one at a time
/// beside the served model).
pub async fn sample(
    State(state): State<Shared>,
    ApiPath(name): ApiPath<String>,
    ApiJson(mut request): ApiJson<SampleRequest>,
) -> Result<Json<Value>, ApiError> {
    let (dir, real) = run_dir(&state, &name)?;
    if !present(&dir.join(STATE_FILE)) {
        return Err(ApiError::invalid(format!(
            "run `{name}` has no checkpoint yet (it writes one every checkpoint_interval steps)"
        )));
    }
    let run = crate::checkpoint::RunDir::new(&dir);
    for file in [
        run.file(STATE_FILE),
        run.file(CONFIG_FILE),
        run.file(TOKENIZER_FILE),
        run.file(MODEL_FILE),
        run.next_file(MODEL_FILE),
    ] {
        if present(&file) && within(&real, &file).is_none() {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "run `{name}`'s {} leads out of --runs; refused",
                    file.file_name().unwrap_or_default().to_string_lossy()
                ),
            ));
        }
    }
    let limits = Limits {
        max_n: 1,
        max_tokens: SAMPLE_MAX_TOKENS.min(state.options.max_tokens),
        min_tokens: 1,
        default_max_tokens: 200,
        max_tokens_from: if SAMPLE_MAX_TOKENS <= state.options.max_tokens {
            "a dashboard sample's limit"
        } else {
            "the server's --max-tokens"
        },
        echo_field: false,
    };
    request.sampling.temperature = request.sampling.temperature.or(Some(0.8));
    let settings = request.sampling.settings(&name, &limits)?;
    if settings.stream {
        return Err(ApiError::invalid(
            "stream is not supported here: a sample is answered whole",
        ));
    }
    static ONE_AT_A_TIME: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);
    let _turn = ONE_AT_A_TIME
        .acquire()
        .await
        .map_err(|_| ApiError::stopping())?;
    let stop = state.stop.clone();
    let (seed, prompt_text) = (settings.seed, request.prompt);
    let root = runs_dir(&state)?.clone();
    let text = tokio::task::spawn_blocking(move || -> anyhow::Result<String> {
        // A few tokens: the f32 weights read where they lie, not copied.
        let mut opened = crate::mapped::open_for_decoding(
            &dir,
            WeightFormat::F32,
            crate::mapped::Hold::InPlace,
        )?;
        // As generate: a checkpoint whose bytes do not match state.json's hash is refused.
        opened.verification.wait()?;
        let tokenizer = &opened.tokenizer;
        let block = opened.config.model.block_size;
        let mut prompt = if prompt_text.is_empty() {
            tokenizer.empty_prompt().ok_or_else(|| {
                anyhow::anyhow!(
                    "the prompt is empty and this vocabulary has no token to start from"
                )
            })?
        } else {
            tokenizer.encode(&prompt_text)?
        };
        // A sample of a run as `generate` draws it: a prompt longer than the context
        // keeps its last tokens. (The API refuses one instead, as OpenAI's does: a
        // client there asked for exactly that prompt.)
        if prompt.len() > block {
            prompt.drain(..prompt.len() - block);
        }
        let mut samplers = [Sampler::new(settings.params, seed)?];
        let options = GenerateOptions {
            max_new_tokens: settings.max_tokens,
            stop: settings.stop,
            mode: DecodeMode::Fast,
            weights: WeightFormat::F32,
            kv: crate::cpu::KvPrecision::F32,
            cancel: stop,
        };
        let weights = Arc::clone(&opened.weights);
        let samples = generate(
            Model::Cpu(&weights),
            tokenizer,
            &prompt,
            &mut samplers,
            &options,
            &mut |_, _| Ok(()),
        )?;
        Ok(samples
            .into_iter()
            .next()
            .map(|s| s.text)
            .unwrap_or_default())
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}")))?
    .map_err(|e| ApiError::invalid(hide_root(&format!("sampling {name}: {e:#}"), &root, &real)))?;
    Ok(Json(json!({ "run": name, "seed": seed, "text": text })))
}
