//! The dashboard's data: the run folders under `--runs`, compared as `tinygpt compare`
//! compares them, their metrics.jsonl read incrementally while `train` appends to it,
//! and samples from any of their checkpoints.

use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::ApiError;
use super::error::ApiJson;
use super::Shared;
use crate::compare;
use crate::cpu::WeightFormat;
use crate::generate::sample::{Sampler, SamplingParams};
use crate::generate::{generate, DecodeMode, GenerateOptions, Model};

/// Metrics bytes one poll returns at most (the page asks again for the rest).
const METRICS_CHUNK: u64 = 4 << 20;

fn runs_dir(state: &Shared) -> Result<&PathBuf, ApiError> {
    state.options.runs.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "no runs are shown: start the server with --runs checkpoints/",
        )
    })
}

/// The run folder `name` names (one folder under --runs, nothing else).
fn run_dir(state: &Shared, name: &str) -> Result<PathBuf, ApiError> {
    let root = runs_dir(state)?;
    let plain = !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains(['/', '\\'])
        && !name.starts_with('.');
    let dir = root.join(name);
    if !plain || !dir.is_dir() {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no run `{name}` under {}", root.display()),
        ));
    }
    Ok(dir)
}

/// Folders under --runs that hold a run (metrics.jsonl or config.toml).
fn run_folders(root: &std::path::Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.is_dir()
                && (p.join(crate::checkpoint::METRICS_FILE).exists()
                    || p.join(crate::checkpoint::CONFIG_FILE).exists())
        })
        .collect();
    dirs.sort();
    dirs
}

/// `GET /api/runs`: each run's row of `tinygpt compare` (what differs, steps, best
/// validation loss, speed), and whether it has a checkpoint to sample.
pub async fn list(State(state): State<Shared>) -> Result<Json<Value>, ApiError> {
    let root = runs_dir(&state)?.clone();
    let listed = tokio::task::spawn_blocking(move || {
        let dirs = run_folders(&root);
        // A folder that cannot be read (being written, broken) is listed as such.
        let mut runs = Vec::new();
        let mut unreadable = Vec::new();
        for dir in &dirs {
            match compare::Run::read(dir) {
                Ok(run) => runs.push(run),
                Err(e) => unreadable.push(json!({
                    "run": dir.file_name().map(|n| n.to_string_lossy().into_owned()),
                    "error": format!("{e:#}"),
                })),
            }
        }
        let rows = compare::rows(&runs);
        let rows: Vec<Value> = rows
            .iter()
            .zip(&runs)
            .map(|(row, run)| {
                let mut value = serde_json::to_value(row).unwrap_or(Value::Null);
                value["label"] = compare::label(row).into();
                value["checkpoint"] = run.dir.join(crate::checkpoint::STATE_FILE).exists().into();
                value
            })
            .collect();
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
}

/// `GET /api/runs/{name}/metrics?from=BYTES`: the records appended since byte `from`,
/// and where to ask from next. Only whole lines are read, so a record being written is
/// read next time.
pub async fn metrics(
    State(state): State<Shared>,
    Path(name): Path<String>,
    Query(from): Query<From>,
) -> Result<Json<Value>, ApiError> {
    let path = run_dir(&state, &name)?.join(crate::checkpoint::METRICS_FILE);
    let read = tokio::task::spawn_blocking(move || -> std::io::Result<(u64, Vec<Value>)> {
        let mut file = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((0, Vec::new())),
            Err(e) => return Err(e),
        };
        let len = file.metadata()?.len();
        // A run started over (the file shrank): read it from the start.
        let from = if from.from > len { 0 } else { from.from };
        file.seek(SeekFrom::Start(from))?;
        let mut bytes = Vec::new();
        file.take(METRICS_CHUNK).read_to_end(&mut bytes)?;
        let whole = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        let records = String::from_utf8_lossy(&bytes[..whole])
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        Ok((from + whole as u64, records))
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}")))?
    .map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("reading {name}'s metrics: {e}"),
        )
    })?;
    Ok(Json(json!({ "next": read.0, "records": read.1 })))
}

#[derive(Deserialize)]
pub struct SampleRequest {
    #[serde(default)]
    prompt: String,
    max_tokens: Option<usize>,
    temperature: Option<f64>,
    seed: Option<u64>,
}

/// `POST /api/runs/{name}/sample`: a short sample from the run's latest checkpoint
/// (opened mapped for this request; one at a time beside the served model).
pub async fn sample(
    State(state): State<Shared>,
    Path(name): Path<String>,
    ApiJson(request): ApiJson<SampleRequest>,
) -> Result<Json<Value>, ApiError> {
    let dir = run_dir(&state, &name)?;
    if !dir.join(crate::checkpoint::STATE_FILE).exists() {
        return Err(ApiError::invalid(format!(
            "run `{name}` has no checkpoint yet (it writes one every checkpoint_interval steps)"
        )));
    }
    let max_tokens = request.max_tokens.unwrap_or(200);
    if !(1..=1000).contains(&max_tokens) {
        return Err(ApiError::invalid("max_tokens must be 1 to 1000"));
    }
    let params = SamplingParams {
        temperature: request.temperature.unwrap_or(0.8),
        ..SamplingParams::default()
    };
    params
        .validate()
        .map_err(|e| ApiError::invalid(format!("{e:#}")))?;
    static ONE_AT_A_TIME: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);
    let _turn = ONE_AT_A_TIME
        .acquire()
        .await
        .map_err(|_| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the server is stopping"))?;
    let stop = state.stop.clone();
    let seed = request.seed.unwrap_or_else(rand::random);
    let text = tokio::task::spawn_blocking(move || -> anyhow::Result<String> {
        let opened = crate::mapped::open_for_decoding(&dir, WeightFormat::F32)?;
        let tokenizer = &opened.tokenizer;
        let block = opened.config.model.block_size;
        let mut prompt = if request.prompt.is_empty() {
            tokenizer.empty_prompt().ok_or_else(|| {
                anyhow::anyhow!(
                    "the prompt is empty and this vocabulary has no token to start from"
                )
            })?
        } else {
            tokenizer.encode(&request.prompt)?
        };
        if prompt.len() > block {
            prompt.drain(..prompt.len() - block);
        }
        let mut samplers = [Sampler::new(params, seed)?];
        let options = GenerateOptions {
            max_new_tokens: max_tokens,
            stop: Vec::new(),
            mode: DecodeMode::Fast,
            weights: WeightFormat::F32,
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
    .map_err(|e| ApiError::invalid(format!("sampling {name}: {e:#}")))?;
    Ok(Json(json!({ "run": name, "seed": seed, "text": text })))
}
