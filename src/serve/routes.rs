//! The HTTP routes: OpenAI's completions and chat completions (streamed as server-sent
//! events or whole), models, tokenize / detokenize, health, metrics, and the page's
//! own (`runs`, `page`). Every route but `/health` and the page's files asks for the
//! API key when the server has one, unknown routes too (401 before 404 or 405).

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as Sse, KeepAlive};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use subtle::ConstantTimeEq;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::batcher::{Event, Job};
use super::error::{ApiError, ApiJson, Fields};
use super::log::{Logged, Tokens};
use super::openai::{
    chat_logprobs, completion_logprobs, usage, ChatRequest, ChoiceResult, CompletionRequest,
    Limits, Prompt, Settings,
};
use super::{chat, log, page, runs, AppState, Ready, Shared};
use crate::generate::sample::Sampler;

pub fn router(state: Shared) -> Router {
    let api = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/chat/template", get(chat_template))
        .route("/props", get(props))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/tokenizer_info", get(tokenizer_info))
        .route("/metrics", get(metrics))
        .route("/api/runs", get(runs::list))
        .route("/api/runs/{name}/metrics", get(runs::metrics))
        .route("/api/runs/{name}/sample", post(runs::sample));
    let open = Router::new()
        .route("/health", get(health))
        .merge(page::routes());
    let mut app = api
        .merge(open)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.options.max_body_bytes))
        .layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            refuse_large_bodies,
        ))
        // Over every route, unknown ones too: without the key, 401 before 404 or 405
        // (which would tell what exists).
        .layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            require_key,
        ))
        .layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            count_refusals,
        ))
        .with_state(Arc::clone(&state));
    if let Some(origin) = &state.options.cors {
        let origin = HeaderValue::from_str(origin).unwrap_or(HeaderValue::from_static("null"));
        app = app.layer(
            tower_http::cors::CorsLayer::new()
                .allow_origin(origin)
                .allow_methods([Method::GET, Method::POST])
                .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE]),
        );
    }
    // Outermost: every request is logged, CORS preflights and refusals too.
    app.layer(middleware::from_fn(log::requests))
}

/// Whether a request may pass without the key: `GET /health` and the page's files.
fn open_route(request: &Request) -> bool {
    let path = request.uri().path();
    matches!(*request.method(), Method::GET | Method::HEAD)
        && (path == "/health" || page::is_page(path))
}

async fn require_key(State(state): State<Shared>, request: Request, next: Next) -> Response {
    if let Some(key) = state
        .options
        .api_key
        .as_ref()
        .filter(|_| !open_route(&request))
    {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            // The scheme's name is case-insensitive (RFC 9110, 11.1).
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim_start());
        // Compared in constant time: the answer's timing says nothing of the key.
        let matches = given.is_some_and(|g| bool::from(g.as_bytes().ct_eq(key.as_bytes())));
        if !matches {
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                "missing or wrong API key: send the header Authorization: Bearer <key>",
            )
            .with_code("invalid_api_key")
            .into_response();
        }
    }
    next.run(request).await
}

/// A body whose declared length is over `--max-body-bytes`: 413 at once, from the
/// header alone (waiting for the body would end in a 408 seconds later), naming the
/// limit; bodies of no declared length are held to it as they arrive.
async fn refuse_large_bodies(
    State(state): State<Shared>,
    request: Request,
    next: Next,
) -> Response {
    let limit = state.options.max_body_bytes;
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    match declared {
        Some(bytes) if bytes > limit as u64 => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the request body is {bytes} bytes; this server takes at most {limit} (serve --max-body-bytes)"
            ),
        )
        .into_response(),
        _ => next.run(request).await,
    }
}

/// Counts the requests answered with an error status, whoever refused them.
async fn count_refusals(State(state): State<Shared>, request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    if response.status().is_client_error() || response.status().is_server_error() {
        state
            .metrics
            .requests_rejected
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    response
}

async fn not_found(request: Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!(
            "no route {} {}: the API is under /v1 (completions, chat/completions, models)",
            request.method(),
            request.uri().path()
        ),
    )
}

async fn method_not_allowed(request: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!(
            "{} is not allowed on {}",
            request.method(),
            request.uri().path()
        ),
    )
}

impl AppState {
    /// The loaded model, or 503 while it loads.
    pub fn ready(&self) -> Result<&Ready, ApiError> {
        self.ready
            .get()
            .ok_or_else(|| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the model is loading"))
    }

    fn limits(&self) -> Limits {
        Limits {
            max_n: self.options.parallel,
            max_tokens: self.options.max_tokens,
            min_tokens: 1,
            default_max_tokens: 16,
            max_tokens_from: "the server's --max-tokens",
            echo_field: false,
        }
    }
}

async fn health(State(state): State<Shared>) -> Response {
    match state.ready() {
        Ok(_) => Json(json!({"status": "ok"})).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn models(State(state): State<Shared>) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!({
        "object": "list",
        "data": [served_model(&state)?],
    })))
}

/// `GET /v1/models/{id}`: the served model, or OpenAI's 404 for any other.
async fn model(
    State(state): State<Shared>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<Value>, ApiError> {
    if id != state.model_id {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "the model `{id}` does not exist here; this server has `{}`",
                state.model_id
            ),
        )
        .with_code("model_not_found"));
    }
    Ok(Json(served_model(&state)?))
}

/// The served model as OpenAI's model object, with its shape.
fn served_model(state: &Shared) -> Result<Value, ApiError> {
    let ready = state.ready()?;
    Ok(json!({
        "id": state.model_id,
        "object": "model",
        "created": state.created,
        "owned_by": "tinygpt",
        "meta": {
            "parameters": ready.parameters,
            "context_length": ready.block_size,
            "vocab_size": ready.vocab_size,
        },
    }))
}

async fn props(State(state): State<Shared>) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    Ok(Json(json!({
        "model": state.model_id,
        "parameters": ready.parameters,
        "context_length": ready.block_size,
        "vocab_size": ready.vocab_size,
        "slots": state.options.parallel,
        "max_tokens": state.options.max_tokens,
        "chat_template": chat::DESCRIPTION,
        "runs": state.options.runs.is_some(),
    })))
}

async fn chat_template(State(state): State<Shared>) -> Result<Json<Value>, ApiError> {
    state.ready()?;
    let example = chat::render(
        &serde_json::from_value::<Vec<super::openai::Message>>(json!([
            {"role": "system", "content": "You are a poet."},
            {"role": "user", "content": "Speak of the sea."},
        ]))
        .expect("a valid example"),
    )?;
    Ok(Json(json!({
        "template": chat::DESCRIPTION,
        "stop": chat::STOPS,
        "example": example,
    })))
}

async fn metrics(State(state): State<Shared>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(state.options.parallel),
    )
        .into_response()
}

/// The most text `/tokenize` takes, in bytes.
pub const TOKENIZE_MAX_BYTES: usize = 1 << 20;
/// The most tokens `/tokenize` returns (ids or pieces).
pub const TOKENIZE_MAX_TOKENS: usize = 1 << 17;
/// Texts tokenized at once (each on a blocking thread, not a request thread).
static TOKENIZING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);

/// llama.cpp's `content` or vLLM's `prompt` (whose `add_special_tokens` changes
/// nothing here: no token is added to a prompt).
#[derive(Deserialize)]
struct TokenizeRequest {
    #[serde(alias = "prompt")]
    content: String,
    #[serde(default)]
    with_pieces: bool,
}

/// The fields /tokenize takes (llama.cpp's content, vLLM's prompt).
impl Fields for TokenizeRequest {
    const FIELDS: &'static [&'static [&'static str]] = &[&["content", "prompt", "with_pieces"]];
}

/// Texts past 64 KiB leave MiBs in glibc's free lists once tokenized: given back after.
const GIVE_BACK_AFTER_BYTES: usize = 1 << 16;

/// Tokenizes on a blocking thread (a long text must not hold up `/health`), at most
/// two texts at once, and writes the answer as one string (no JSON value per token):
/// memory for a 1 MiB text is a few times its size, given back after.
async fn tokenize(
    State(state): State<Shared>,
    ApiJson(request): ApiJson<TokenizeRequest>,
) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let TokenizeRequest {
        content,
        with_pieces,
    } = request;
    if content.len() > TOKENIZE_MAX_BYTES {
        return Err(ApiError::invalid(format!(
            "content is {} bytes; /tokenize takes at most {TOKENIZE_MAX_BYTES}: send it in parts",
            content.len()
        )));
    }
    let _turn = TOKENIZING
        .acquire()
        .await
        .map_err(|_| ApiError::stopping())?;
    let tokenizer = Arc::clone(&ready.tokenizer);
    let large = content.len() > GIVE_BACK_AFTER_BYTES;
    let body = tokio::task::spawn_blocking(move || -> Result<String, ApiError> {
        let ids = tokenizer
            .encode(&content)
            .map_err(|e| ApiError::invalid(format!("content cannot be tokenized: {e:#}")))?;
        drop(content);
        if ids.len() > TOKENIZE_MAX_TOKENS {
            return Err(ApiError::invalid(format!(
                "content is {} tokens; /tokenize returns at most {TOKENIZE_MAX_TOKENS}: send it in parts",
                ids.len()
            )));
        }
        let body = if with_pieces {
            let mut out = String::with_capacity(16 + ids.len() * 24);
            out.push_str("{\"tokens\":[");
            for (i, &id) in ids.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let bytes = tokenizer.token_bytes(id).unwrap_or_default();
                let piece = serde_json::to_string(&String::from_utf8_lossy(&bytes))
                    .unwrap_or_else(|_| "\"\"".into());
                out.push_str(&format!("{{\"id\":{id},\"piece\":{piece}}}"));
            }
            out.push_str("]}");
            out
        } else {
            format!(
                "{{\"tokens\":{}}}",
                serde_json::to_string(&ids).unwrap_or_else(|_| "[]".into())
            )
        };
        Ok(body)
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}")))??;
    if large {
        super::give_back_memory();
    }
    Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
}

#[derive(Deserialize)]
struct DetokenizeRequest {
    tokens: Vec<u32>,
}

impl Fields for DetokenizeRequest {
    const FIELDS: &'static [&'static [&'static str]] = &[&["tokens"]];
}

async fn detokenize(
    State(state): State<Shared>,
    ApiJson(request): ApiJson<DetokenizeRequest>,
) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    check_ids(ready, &request.tokens)?;
    let content = ready
        .tokenizer
        .decode(&request.tokens)
        .map_err(|e| ApiError::invalid(format!("{e:#}")))?;
    // llama.cpp's name for the text, and vLLM's.
    Ok(Json(json!({ "content": content, "prompt": content })))
}

/// What a client tokenizing on the server needs to know (vLLM's `/tokenizer_info`, which
/// lm-evaluation-harness reads): the special tokens and the context.
async fn tokenizer_info(State(state): State<Shared>) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    let tokenizer = &ready.tokenizer;
    let end_of_text = tokenizer
        .end_of_text()
        .and_then(|id| tokenizer.token_text(id));
    Ok(Json(json!({
        "tokenizer_class": "tinygpt",
        "eos_token": end_of_text,
        "bos_token": null,
        "pad_token": null,
        "model_max_length": ready.block_size,
        "vocab_size": tokenizer.vocab_size(),
    })))
}

fn check_ids(ready: &Ready, ids: &[u32]) -> Result<(), ApiError> {
    let vocab = ready.tokenizer.vocab_size().min(ready.vocab_size);
    match ids.iter().find(|&&id| id as usize >= vocab) {
        Some(id) => Err(ApiError::invalid(format!(
            "token id {id} is outside the vocabulary of {vocab}"
        ))),
        None => Ok(()),
    }
}

/// A prompt's tokens, as `tinygpt generate` makes them: an empty prompt starts from
/// the end-of-text token (or a newline); longer than the context is refused.
fn prompt_tokens(ready: &Ready, text: &str) -> Result<Vec<u32>, ApiError> {
    let tokenizer = &ready.tokenizer;
    let ids = if text.is_empty() {
        tokenizer.empty_prompt().unwrap_or_default()
    } else {
        tokenizer
            .encode(text)
            .map_err(|e| ApiError::invalid(format!("the prompt cannot be tokenized: {e:#}")))?
    };
    if ids.is_empty() {
        return Err(ApiError::invalid(
            "the prompt is empty and this vocabulary has no token to start from: give a prompt",
        ));
    }
    check_length(ready, ids.len())?;
    Ok(ids)
}

fn check_length(ready: &Ready, tokens: usize) -> Result<(), ApiError> {
    if tokens > ready.block_size {
        return Err(ApiError::invalid(format!(
            "the prompt is {tokens} tokens, more than the model's context of {}; shorten it",
            ready.block_size
        ))
        .with_code("context_length_exceeded"));
    }
    Ok(())
}

/// What a request asks of the decoding loop besides its settings.
struct Ask {
    /// One or more prompts, each continued `n` times.
    prompts: Vec<Vec<u32>>,
    logprobs: Option<usize>,
    score_prompt: bool,
}

/// Hands the request to the decoding loop; 503 when the queue is full.
fn submit(
    state: &AppState,
    ready: &Ready,
    ask: Ask,
    settings: &Settings,
) -> Result<UnboundedReceiver<Event>, ApiError> {
    let choices = ask.prompts.len() * settings.n;
    if choices > state.options.parallel {
        return Err(ApiError::invalid(format!(
            "{} prompts of {} choices each make {choices} sequences; this server decodes at most {} at once (--parallel)",
            ask.prompts.len(),
            settings.n,
            state.options.parallel
        )));
    }
    // Each prompt's choice j draws with seed + j, as that prompt alone would.
    let samplers = (0..choices)
        .map(|i| {
            let seed = settings.seed.wrapping_add((i % settings.n) as u64);
            Sampler::new(settings.params.clone(), seed)
        })
        .collect::<anyhow::Result<Vec<_>>>()
        .map_err(|e| ApiError::invalid(format!("{e:#}")))?;
    let metrics = &state.metrics;
    let waiting = metrics
        .queued
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // Requests that can start now do not count against the queue (each takes at
    // least a slot): with --max-queue 0 an idle server still serves.
    let free = state
        .options
        .parallel
        .saturating_sub(metrics.running.load(std::sync::atomic::Ordering::Relaxed));
    if waiting >= state.options.max_queue + free {
        metrics
            .queued
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the server is busy ({waiting} requests wait for a slot); try again shortly"),
        ));
    }
    let (events, received) = unbounded_channel();
    let job = Job {
        prompts: ask.prompts,
        samplers,
        max_tokens: settings.max_tokens,
        stop: settings.stop.clone(),
        logprobs: ask.logprobs,
        score_prompt: ask.score_prompt,
        events,
    };
    if ready.jobs.send(job).is_err() {
        metrics
            .queued
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        return Err(ApiError::stopping());
    }
    Ok(received)
}

/// Which endpoint a response is shaped for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

async fn completions(
    State(state): State<Shared>,
    ApiJson(request): ApiJson<CompletionRequest>,
) -> Response {
    match completion(&state, request).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    }
}

async fn completion(state: &Shared, request: CompletionRequest) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let echo = request.echo.unwrap_or(false);
    let mut limits = state.limits();
    limits.echo_field = true;
    if echo {
        // The prompt alone, scored: what evaluation harnesses ask for.
        limits.min_tokens = 0;
    }
    let settings = request.sampling.settings(&state.model_id, &limits)?;
    if request.best_of.is_some_and(|b| b as usize != settings.n) {
        return Err(
            ApiError::invalid("best_of is not supported (leave it out, or equal to n)")
                .with_param("best_of"),
        );
    }
    if request.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(
            ApiError::invalid("suffix is not supported: this model only continues text")
                .with_param("suffix"),
        );
    }
    let logprobs = match request.logprobs {
        None => None,
        Some(k @ 0..=5) => Some(k as usize),
        Some(k) => {
            return Err(
                ApiError::invalid(format!("logprobs {k} must be 0 to 5")).with_param("logprobs")
            )
        }
    };
    let score_prompt = echo && logprobs.is_some();
    if score_prompt && settings.stream {
        return Err(ApiError::invalid(
            "echo with logprobs is answered whole: leave out stream",
        ));
    }
    let prompts: Vec<(String, Vec<u32>)> = match request.prompt {
        None => vec![(String::new(), prompt_tokens(ready, "")?)],
        Some(Prompt::Text(text)) => vec![text_prompt(ready, text)?],
        Some(Prompt::Texts(texts)) => texts
            .into_iter()
            .map(|text| text_prompt(ready, text))
            .collect::<Result<_, _>>()?,
        Some(Prompt::Tokens(ids)) => vec![tokens_prompt(ready, ids)?],
        Some(Prompt::TokenLists(lists)) => lists
            .into_iter()
            .map(|ids| tokens_prompt(ready, ids))
            .collect::<Result<_, _>>()?,
    };
    let (texts, prompts): (Vec<String>, Vec<Vec<u32>>) = prompts.into_iter().unzip();
    let lengths: Vec<usize> = prompts.iter().map(Vec::len).collect();
    let ask = Ask {
        prompts,
        logprobs,
        score_prompt,
    };
    let events = submit(state, ready, ask, &settings)?;
    let mut reply = Reply::new(state, Kind::Completion, &settings, &lengths, events);
    if echo {
        reply.echo(texts, score_prompt);
    }
    Ok(reply.respond(settings.stream).await)
}

fn text_prompt(ready: &Ready, text: String) -> Result<(String, Vec<u32>), ApiError> {
    let ids = prompt_tokens(ready, &text)?;
    Ok((text, ids))
}

fn tokens_prompt(ready: &Ready, ids: Vec<u32>) -> Result<(String, Vec<u32>), ApiError> {
    if ids.is_empty() {
        return Err(ApiError::invalid("the prompt is an empty list of tokens").with_param("prompt"));
    }
    check_ids(ready, &ids)?;
    check_length(ready, ids.len())?;
    let text = ready.tokenizer.decode(&ids).unwrap_or_default();
    Ok((text, ids))
}

async fn chat_completions(
    State(state): State<Shared>,
    ApiJson(request): ApiJson<ChatRequest>,
) -> Response {
    match chat_completion(&state, request).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    }
}

async fn chat_completion(state: &Shared, request: ChatRequest) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let mut limits = state.limits();
    // A chat reply runs to the end of the assistant's turn.
    limits.default_max_tokens = 256;
    let mut settings = request.sampling.settings(&state.model_id, &limits)?;
    let logprobs = match (request.logprobs.unwrap_or(false), request.top_logprobs) {
        (false, None) => None,
        (false, Some(_)) => {
            return Err(
                ApiError::invalid("top_logprobs needs logprobs: true").with_param("top_logprobs")
            )
        }
        (true, None) => Some(0),
        (true, Some(k @ 0..=20)) => Some(k as usize),
        (true, Some(k)) => {
            return Err(
                ApiError::invalid(format!("top_logprobs {k} must be 0 to 20"))
                    .with_param("top_logprobs"),
            )
        }
    };
    if request.tools.is_some() {
        return Err(ApiError::invalid("tools are not supported by a base model"));
    }
    let prompt_text = chat::render(&request.messages)?;
    let prompt = prompt_tokens(ready, &prompt_text).map_err(|mut e| {
        if e.code.is_none() {
            e.message = format!(
                "{}; a char-level model reads only the characters it was trained on, the chat template's \"User:\" and \"Assistant:\" included (GET /v1/chat/template): use /v1/completions with a prompt of your own",
                e.message
            );
        }
        e
    })?;
    settings.stop.extend(chat::STOPS.map(String::from));
    let prompt_len = prompt.len();
    let ask = Ask {
        prompts: vec![prompt],
        logprobs,
        score_prompt: false,
    };
    let events = submit(state, ready, ask, &settings)?;
    let reply = Reply::new(state, Kind::Chat, &settings, &[prompt_len], events);
    Ok(reply.respond(settings.stream).await)
}

/// A request's answer being put together from its events.
struct Reply {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    prompt_tokens: usize,
    /// Each prompt's text, shown before its choices' (`echo`); none without echo.
    echoes: Vec<String>,
    /// Choices per prompt: choice i continues prompt i / n.
    n: usize,
    /// Whether the choices' logprobs begin with the prompt's tokens'.
    scored: bool,
    choices: Vec<ChoiceResult>,
    events: UnboundedReceiver<Event>,
    /// Whether the stream's last chunk has gone out.
    ended: bool,
    /// An event read while gathering text, not yet answered.
    held: Option<Event>,
    /// The tokens in and out, for the request's log line.
    logged: Arc<Tokens>,
}

impl Reply {
    /// The reply to `prompts.len()` prompts of these lengths, `settings.n` choices each.
    fn new(
        state: &AppState,
        kind: Kind,
        settings: &Settings,
        prompts: &[usize],
        events: UnboundedReceiver<Event>,
    ) -> Self {
        let prefix = match kind {
            Kind::Completion => "cmpl",
            Kind::Chat => "chatcmpl",
        };
        Self {
            kind,
            id: format!("{prefix}-{:016x}", rand::random::<u64>()),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: state.model_id.clone(),
            include_usage: settings.include_usage,
            prompt_tokens: prompts.iter().sum(),
            echoes: Vec::new(),
            n: settings.n,
            scored: false,
            choices: vec![ChoiceResult::default(); prompts.len() * settings.n],
            events,
            ended: false,
            held: None,
            logged: Tokens::new(prompts.iter().sum()),
        }
    }

    /// Shows each prompt's text before its choices'; `scored`: their logprobs begin
    /// with the prompt's tokens'.
    fn echo(&mut self, texts: Vec<String>, scored: bool) {
        self.echoes = texts;
        self.scored = scored;
    }

    /// The text shown before choice `i`'s.
    fn echo_of(&self, i: usize) -> &str {
        self.echoes.get(i / self.n).map_or("", String::as_str)
    }

    async fn respond(mut self, stream: bool) -> Response {
        let logged = Logged(Arc::clone(&self.logged));
        let mut response = if stream {
            // The status waits for the request's first event (its first text, after
            // its turn in the queue and its prompt): a request that never began (the
            // server stopping while it queued, a prompt the decoder failed on) is
            // answered with its error's status, not a 200 with the error inside.
            match self.events.recv().await {
                Some(Event::Failed { status, message }) => {
                    ApiError::failed(status, message).into_response()
                }
                None => ApiError::stopping().into_response(),
                Some(first) => {
                    self.held = Some(first);
                    axum::response::sse::Sse::new(self.into_stream())
                        .keep_alive(KeepAlive::default())
                        .into_response()
                }
            }
        } else {
            match self.whole().await {
                Ok(body) => Json(body).into_response(),
                Err(e) => e.into_response(),
            }
        };
        response.extensions_mut().insert(logged);
        response
    }

    fn completion_tokens(&self) -> usize {
        self.choices.iter().map(|c| c.completion_tokens).sum()
    }

    fn all_done(&self) -> bool {
        self.choices.iter().all(|c| c.finish.is_some())
    }

    /// Waits for every choice, then the whole response.
    async fn whole(mut self) -> Result<Value, ApiError> {
        while !self.all_done() {
            match self.events.recv().await {
                Some(Event::Text {
                    choice,
                    text,
                    mut tokens,
                }) => {
                    let c = &mut self.choices[choice];
                    let text = if self.kind == Kind::Chat {
                        c.trim_reply_start(&text, &mut tokens)
                    } else {
                        &text
                    };
                    c.text.push_str(text);
                    c.tokens.extend(tokens);
                }
                Some(Event::Done {
                    choice,
                    finish,
                    completion_tokens,
                    ..
                }) => {
                    let c = &mut self.choices[choice];
                    c.finish = Some(finish);
                    c.completion_tokens = completion_tokens;
                    self.logged
                        .set_completion(self.completion_tokens(), self.all_done());
                }
                Some(Event::Failed { status, message }) => {
                    return Err(ApiError::failed(status, message));
                }
                None => return Err(ApiError::stopping()),
            }
        }
        let choices: Vec<Value> = self
            .choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let finish = c.finish.map(|f| f.as_str());
                let echo = self.echo_of(i);
                // Scored prompt tokens come first: their offsets count from the start.
                let offset = if self.scored { 0 } else { echo.len() };
                match self.kind {
                    Kind::Completion => json!({
                        "index": i,
                        "text": format!("{echo}{}", c.text),
                        "logprobs": if c.tokens.is_empty() { Value::Null } else { completion_logprobs(&c.tokens, offset) },
                        "finish_reason": finish,
                    }),
                    Kind::Chat => json!({
                        "index": i,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": if c.tokens.is_empty() { Value::Null } else { chat_logprobs(&c.tokens) },
                        "finish_reason": finish,
                    }),
                }
            })
            .collect();
        Ok(json!({
            "id": self.id,
            "object": match self.kind { Kind::Completion => "text_completion", Kind::Chat => "chat.completion" },
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(self.prompt_tokens, self.completion_tokens()),
        }))
    }

    /// A chunk with these choices (`usage: null` on each when usage comes last).
    fn chunk(&self, choices: Vec<Value>) -> Sse {
        let mut chunk = json!({
            "id": self.id,
            "object": match self.kind { Kind::Completion => "text_completion", Kind::Chat => "chat.completion.chunk" },
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if self.include_usage {
            chunk["usage"] = Value::Null;
        }
        Sse::default().data(chunk.to_string())
    }

    /// A choice's text chunk (None: nothing to show yet).
    fn text_choice(
        &mut self,
        choice: usize,
        text: &str,
        tokens: &mut [super::batcher::TokenLogprob],
    ) -> Option<Value> {
        Some(match self.kind {
            Kind::Completion => {
                let c = &mut self.choices[choice];
                let offset = c.text.len();
                c.text.push_str(text);
                let logprobs = if tokens.is_empty() {
                    Value::Null
                } else {
                    completion_logprobs(tokens, offset)
                };
                json!({"index": choice, "text": text, "logprobs": logprobs, "finish_reason": Value::Null})
            }
            Kind::Chat => {
                let c = &mut self.choices[choice];
                let text = c.trim_reply_start(text, tokens);
                if text.is_empty() && tokens.is_empty() {
                    return None;
                }
                c.text.push_str(text);
                let logprobs = if tokens.is_empty() {
                    Value::Null
                } else {
                    chat_logprobs(tokens)
                };
                json!({"index": choice, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": Value::Null})
            }
        })
    }

    /// The chunks for one event; the stream ends after the last.
    fn on_event(&mut self, event: Option<Event>) -> Vec<Sse> {
        let mut out = Vec::new();
        match event {
            Some(Event::Text {
                choice,
                text,
                mut tokens,
            }) => {
                if let Some(c) = self.text_choice(choice, &text, &mut tokens) {
                    out.push(self.chunk(vec![c]));
                }
            }
            Some(Event::Done {
                choice,
                finish,
                completion_tokens,
                ..
            }) => {
                self.choices[choice].finish = Some(finish);
                self.choices[choice].completion_tokens = completion_tokens;
                self.logged
                    .set_completion(self.completion_tokens(), self.all_done());
                let c = match self.kind {
                    Kind::Completion => {
                        json!({"index": choice, "text": "", "logprobs": Value::Null, "finish_reason": finish.as_str()})
                    }
                    Kind::Chat => {
                        json!({"index": choice, "delta": {}, "logprobs": Value::Null, "finish_reason": finish.as_str()})
                    }
                };
                out.push(self.chunk(vec![c]));
                if self.all_done() {
                    if self.include_usage {
                        let mut last = json!({
                            "id": self.id,
                            "object": match self.kind { Kind::Completion => "text_completion", Kind::Chat => "chat.completion.chunk" },
                            "created": self.created,
                            "model": self.model,
                            "choices": [],
                        });
                        last["usage"] = usage(self.prompt_tokens, self.completion_tokens());
                        out.push(Sse::default().data(last.to_string()));
                    }
                    out.push(Sse::default().data("[DONE]"));
                    self.ended = true;
                }
            }
            Some(Event::Failed { status, message }) => {
                let error = ApiError::failed(status, message);
                out.push(Sse::default().data(error.body().to_string()));
                self.ended = true;
            }
            None => {
                let error = ApiError::stopping();
                out.push(Sse::default().data(error.body().to_string()));
                self.ended = true;
            }
        }
        out
    }

    /// The first chunks: chat's role, completions' echoed prompt.
    fn opening(&mut self) -> Vec<Sse> {
        let mut chunks = Vec::new();
        for i in 0..self.choices.len() {
            let echo = self.echo_of(i).to_string();
            let choice = match self.kind {
                Kind::Chat => Some(
                    json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": Value::Null, "finish_reason": Value::Null}),
                ),
                Kind::Completion if !echo.is_empty() => self.text_choice(i, &echo, &mut []),
                Kind::Completion => None,
            };
            chunks.extend(choice.map(|c| self.chunk(vec![c])));
        }
        chunks
    }

    fn into_stream(mut self) -> impl Stream<Item = Result<Sse, Infallible>> {
        let opening = self.opening();
        let rest = stream::unfold(Some(self), |reply| async move {
            let mut reply = reply?;
            let event = match reply.held.take() {
                Some(held) => Some(held),
                None => reply.events.recv().await,
            };
            // Text that piled up while the client read (a busy server outruns its
            // clients) goes out as one chunk per choice: fewer events to write and parse.
            let event = match event {
                Some(Event::Text {
                    choice,
                    mut text,
                    mut tokens,
                }) => {
                    while let Ok(next) = reply.events.try_recv() {
                        match next {
                            Event::Text {
                                choice: c,
                                text: more,
                                tokens: t,
                            } if c == choice => {
                                text.push_str(&more);
                                tokens.extend(t);
                            }
                            other => {
                                reply.held = Some(other);
                                break;
                            }
                        }
                    }
                    Some(Event::Text {
                        choice,
                        text,
                        tokens,
                    })
                }
                other => other,
            };
            let mut chunks = reply.on_event(event);
            if let Some(held) = reply.held.take() {
                if !reply.ended {
                    chunks.extend(reply.on_event(Some(held)));
                }
            }
            let next = (!reply.ended).then_some(reply);
            Some((stream::iter(chunks), next))
        })
        .flatten();
        stream::iter(opening).chain(rest).map(Ok)
    }
}
