//! Errors as OpenAI's clients expect them: `{"error": {"message", "type", "code"}}` with
//! a 4xx status for anything the request got wrong, decided before a stream opens.

use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;
use serde_json::Value;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `code` (`model_not_found`, `context_length_exceeded`, ...).
    pub code: Option<&'static str>,
    /// OpenAI's `param`: the request field at fault.
    pub param: Option<String>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            code: None,
            param: None,
        }
    }

    /// 503: the server is stopping (Ctrl-C, SIGTERM); a client may retry elsewhere.
    pub fn stopping() -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "the server is stopping")
    }

    /// The error the decoding thread failed a request with (`Event::Failed`'s status,
    /// 503 where it is not one).
    pub fn failed(status: u16, message: impl Into<String>) -> Self {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
        Self::new(status, message)
    }

    /// 400: the request asks for something this server cannot give.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    /// OpenAI's `type` for the status.
    pub fn kind(status: StatusCode) -> &'static str {
        match status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            503 => "unavailable_error",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
    }

    /// The JSON body, also sent as a stream's last chunk when a stream fails.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": Self::kind(self.status),
                "param": self.param,
                "code": self.code.map_or(serde_json::Value::Null, Into::into),
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            // Clients back off and come again.
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// The fields a request body may hold (lists of them), besides those every route lets
/// pass ([`HARMLESS`]) and those refused unless neutral ([`UNSUPPORTED`]).
pub trait Fields {
    const FIELDS: &'static [&'static [&'static str]];

    /// Why a body does not deserialize, naming the field, where serde cannot: a part
    /// read through `#[serde(flatten)]` loses its fields' names, so it is read alone.
    fn flattened(_body: &Value) -> Option<serde_path_to_error::Error<serde_json::Error>> {
        None
    }
}

/// Fields OpenAI's clients and harnesses send that change nothing here: accepted and
/// ignored. (`add_special_tokens`: no token is ever added to a prompt here.)
pub const HARMLESS: [&str; 6] = [
    "user",
    "metadata",
    "store",
    "service_tier",
    "add_special_tokens",
    "parallel_tool_calls",
];

/// Whether a field's value changes nothing.
pub type Neutral = fn(&Value) -> bool;

/// Fields other servers take that would change the output here, each with the value
/// that changes nothing (sent by some clients as a default): accepted with that value
/// (or null), else a 400 naming the field.
pub const UNSUPPORTED: [(&str, Neutral); 20] = [
    ("logit_bias", |v| {
        v.as_object().is_some_and(|o| o.is_empty())
    }),
    ("min_tokens", |v| v.as_u64() == Some(0)),
    ("ignore_eos", |v| v.as_bool() == Some(false)),
    ("min_p", |v| v.as_f64() == Some(0.0)),
    ("typical_p", |v| v.as_f64() == Some(1.0)),
    ("tfs_z", |v| v.as_f64() == Some(1.0)),
    ("mirostat", |v| v.as_u64() == Some(0)),
    ("length_penalty", |v| v.as_f64() == Some(1.0)),
    ("response_format", |v| v["type"] == "text"),
    ("stop_token_ids", |v| {
        v.as_array().is_some_and(Vec::is_empty)
    }),
    ("bad_words", |v| v.as_array().is_some_and(Vec::is_empty)),
    ("allowed_token_ids", |_| false),
    ("include_stop_str_in_output", |v| v.as_bool() == Some(false)),
    ("use_beam_search", |v| v.as_bool() == Some(false)),
    ("prompt_logprobs", |_| false),
    ("guided_json", |_| false),
    ("guided_regex", |_| false),
    ("guided_choice", |_| false),
    ("grammar", |v| v.as_str() == Some("")),
    ("tool_choice", |v| v == "none" || v == "auto"),
];

/// Other tools' names for a field (transformers', Ollama's, llama.cpp's), offered
/// where a misspelling's distance would not find it.
const OTHER_NAMES: &[(&str, &str)] = &[
    ("max_new_tokens", "max_tokens"),
    ("max_length", "max_tokens"),
    ("num_predict", "max_tokens"),
    ("n_predict", "max_tokens"),
    ("num_return_sequences", "n"),
    ("stop_sequences", "stop"),
    ("random_seed", "seed"),
];

/// The first field of `body` that is neither one of `allowed` nor harmless: a 400
/// naming it (and the likeliest intended field, for a misspelling).
pub fn check_fields(body: &Value, lists: &[&[&str]]) -> Result<(), ApiError> {
    let Some(fields) = body.as_object() else {
        return Ok(());
    };
    let allowed: Vec<&str> = lists.iter().flat_map(|list| list.iter().copied()).collect();
    for (key, value) in fields {
        if allowed.contains(&key.as_str()) || HARMLESS.contains(&key.as_str()) {
            continue;
        }
        if let Some((_, neutral)) = UNSUPPORTED.iter().find(|(name, _)| name == key) {
            if value.is_null() || neutral(value) {
                continue;
            }
            return Err(ApiError::invalid(format!(
                "{key} is not supported by this server (it would change the output); leave it out"
            ))
            .with_param(key));
        }
        let other_servers = OTHER_NAMES
            .iter()
            .find(|(theirs, ours)| theirs == key && allowed.contains(ours))
            .map(|(_, ours)| ours);
        let hint = allowed
            .iter()
            .map(|name| (strsim::damerau_levenshtein(key, name), name))
            .filter(|&(d, name)| d <= 2.max(name.len() / 3))
            .min()
            .map(|(_, name)| name)
            .or(other_servers)
            .map_or(String::new(), |name| format!("; did you mean `{name}`?"));
        return Err(ApiError::invalid(format!("unknown field `{key}`{hint}")).with_param(key));
    }
    Ok(())
}

/// `Json`, its rejections (bad JSON, wrong types, too large, wrong content type, a
/// body that came too slowly) as OpenAI-shaped 4xx errors, and its fields checked
/// against `T`'s ([`check_fields`]).
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Fields> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let value = match Json::<Value>::from_request(req, state).await {
            Ok(Json(value)) => value,
            // OpenAI answers a body of the wrong shape with 400, as any bad request.
            Err(rejection) => {
                // A body that missed its deadlines (serve::conn): 408, and the
                // connection closes (its body was not read to the end).
                if let Some(late) = late_body(&rejection) {
                    return Err(ApiError::new(StatusCode::REQUEST_TIMEOUT, late));
                }
                let status = match rejection.status() {
                    StatusCode::UNPROCESSABLE_ENTITY => StatusCode::BAD_REQUEST,
                    other => other,
                };
                if status == StatusCode::PAYLOAD_TOO_LARGE {
                    return Err(ApiError::new(
                        status,
                        "the request body is larger than this server takes (serve --max-body-bytes)",
                    ));
                }
                return Err(ApiError::new(status, rejection.body_text()));
            }
        };
        if !value.is_object() {
            // serde would name our struct ("expected struct SamplingFields").
            return Err(ApiError::invalid(format!(
                "the request body is {}; send a JSON object of the request's fields ({{\"prompt\": ...}} or {{\"messages\": [...]}})",
                crate::util::json_kind(&value)
            )));
        }
        check_fields(&value, T::FIELDS)?;
        match serde_path_to_error::deserialize::<_, T>(&value) {
            Ok(request) => Ok(ApiJson(request)),
            Err(e) => {
                let e = match e.path().iter().next() {
                    None => T::flattened(&value).unwrap_or(e),
                    Some(_) => e,
                };
                let why = in_words(&e.inner().to_string());
                Err(match e.path().iter().next() {
                    // A field the request must have: named as the param, as OpenAI does.
                    None if why.starts_with("missing field `") => {
                        let field = why.split('`').nth(1).unwrap_or_default();
                        ApiError::invalid(format!("{field} is required; this request has none"))
                            .with_param(field)
                    }
                    None => ApiError::invalid(format!("the request body does not fit: {why}")),
                    Some(_) => {
                        let field = e.path().to_string();
                        ApiError::invalid(format!("{field}: {why}")).with_param(&field)
                    }
                })
            }
        }
    }
}

/// serde's words for JSON's types, as a client writes them: `expected i64` is
/// `expected a whole number`, `expected struct Message` is `expected an object`.
fn in_words(serde_says: &str) -> String {
    let text = [
        ("expected i64", "expected a whole number"),
        ("expected u64", "expected a whole number from 0"),
        ("expected u32", "expected a whole number from 0"),
        ("expected f64", "expected a number"),
        ("expected a boolean", "expected true or false"),
        ("expected a sequence", "expected an array"),
        ("expected a map", "expected an object"),
        ("invalid type: sequence", "invalid type: an array"),
        ("invalid type: map", "invalid type: an object"),
        ("floating point `", "the decimal number `"),
        ("integer `", "the whole number `"),
    ]
    .iter()
    .fold(serde_says.to_string(), |text, (from, to)| {
        text.replace(from, to)
    });
    // Our structs' names mean nothing to a client: "expected struct StreamOptions".
    match text.find("expected struct ") {
        Some(at) => {
            let name_end = text[at + "expected struct ".len()..]
                .find(|c: char| !c.is_alphanumeric() && c != '_')
                .map_or(text.len(), |end| at + "expected struct ".len() + end);
            format!("{}expected an object{}", &text[..at], &text[name_end..])
        }
        None => text,
    }
}

/// `Path`, its rejections (a segment that is not UTF-8, ...) as OpenAI-shaped 400s.
pub struct ApiPath<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(value)) => Ok(ApiPath(value)),
            Err(rejection) => Err(ApiError::invalid(rejection.body_text())),
        }
    }
}

/// `Query`, its rejections (`?from=abc`) as OpenAI-shaped 400s.
pub struct ApiQuery<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(value)) => Ok(ApiQuery(value)),
            Err(rejection) => Err(ApiError::invalid(rejection.body_text())),
        }
    }
}

/// The deadline a body missed, if that is why it could not be read.
fn late_body(error: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(late) = e.downcast_ref::<super::conn::BodyTimeout>() {
            return Some(late.0.clone());
        }
        next = e.source();
    }
    None
}
