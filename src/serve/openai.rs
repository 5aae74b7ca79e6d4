//! OpenAI's request and response shapes for completions and chat completions, and
//! the checks that turn a request into decoding settings (or a 400 naming the field).
//!
//! Fields OpenAI's clients send that change nothing here (`user`, zero penalties) are
//! accepted; fields that would change the output but are not supported, and fields
//! not known at all (a misspelling: `temprature`), are refused with a 400 naming them
//! (`error::check_fields`).

use serde::Deserialize;
use serde_json::{json, Value};

use super::batcher::{Finish, TokenLogprob};
use super::error::{ApiError, Fields};
use crate::generate::sample::SamplingParams;

/// The sampling fields both endpoints share.
#[derive(Debug, Default, Deserialize)]
pub struct SamplingFields {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// Not OpenAI's, but llama.cpp's and vLLM's.
    pub top_k: Option<i64>,
    pub repetition_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub n: Option<i64>,
    pub stop: Option<StopField>,
    /// Any 64-bit seed `generate` prints (0 to 2^64 - 1), or a negative one (taken
    /// modulo 2^64, as `generate --seed` takes it).
    #[serde(default, deserialize_with = "any_seed")]
    pub seed: Option<u64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
}

/// A seed from -2^63 to 2^64 - 1, a negative one wrapped to u64.
fn any_seed<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    struct Seed;
    impl serde::de::Visitor<'_> for Seed {
        type Value = Option<u64>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a whole number from -9223372036854775808 to 18446744073709551615")
        }
        fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
            Ok(Some(v))
        }
        fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
            Ok(Some(v as u64))
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_none<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
    }
    d.deserialize_any(Seed)
}

impl SamplingFields {
    /// Its fields that say how to draw: what completions, chat and the dashboard's
    /// sample take.
    pub const DRAWING: &'static [&'static str] = &[
        "model",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
        "n",
        "stop",
        "seed",
    ];
    /// Its streaming fields: completions and chat take them, the sample does not.
    pub const STREAMING: &'static [&'static str] = &["stream", "stream_options"];

    /// Why `body`'s sampling fields do not deserialize, if they do not, with the field's
    /// name: flattened into a request, serde loses it (`Fields::flattened`).
    pub fn error_alone(body: &Value) -> Option<serde_path_to_error::Error<serde_json::Error>> {
        serde_path_to_error::deserialize::<_, SamplingFields>(body).err()
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "expected a string or a list of strings")]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Option<Prompt>,
    pub echo: Option<bool>,
    pub logprobs: Option<i64>,
    pub suffix: Option<String>,
    pub best_of: Option<i64>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

impl Fields for CompletionRequest {
    const FIELDS: &'static [&'static [&'static str]] = &[
        SamplingFields::DRAWING,
        SamplingFields::STREAMING,
        &["prompt", "echo", "logprobs", "suffix", "best_of"],
    ];

    fn flattened(body: &Value) -> Option<serde_path_to_error::Error<serde_json::Error>> {
        SamplingFields::error_alone(body)
    }
}

/// A prompt as OpenAI allows it: text or token ids, one or a list.
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "expected a string, a list of strings, a list of token ids (whole numbers from 0), or a list of such lists"
)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub tools: Option<Value>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

impl Fields for ChatRequest {
    const FIELDS: &'static [&'static [&'static str]] = &[
        SamplingFields::DRAWING,
        SamplingFields::STREAMING,
        &["messages", "logprobs", "top_logprobs", "tools"],
    ];

    fn flattened(body: &Value) -> Option<serde_path_to_error::Error<serde_json::Error>> {
        SamplingFields::error_alone(body)
    }
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
}

#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "expected a string or a list of parts ({\"type\": \"text\", \"text\": ...})"
)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// What the server allows and assumes where a request is silent.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Choices per request: at most the decoder's slots.
    pub max_n: usize,
    pub max_tokens: usize,
    /// The fewest a request may ask for: 0 where the prompt alone is wanted (echo).
    pub min_tokens: usize,
    /// Where a request gives no max_tokens.
    pub default_max_tokens: usize,
    /// What sets `max_tokens`, for a refusal to name.
    pub max_tokens_from: &'static str,
    /// Whether `echo` is a field here (completions), letting max_tokens be 0.
    pub echo_field: bool,
}

/// A request's decoding settings, checked.
#[derive(Debug, Clone)]
pub struct Settings {
    pub params: SamplingParams,
    pub n: usize,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub seed: u64,
    pub stream: bool,
    pub include_usage: bool,
}

impl SamplingFields {
    pub fn settings(&self, served: &str, limits: &Limits) -> Result<Settings, ApiError> {
        if let Some(model) = &self.model {
            if model != served {
                return Err(ApiError::new(
                    axum::http::StatusCode::NOT_FOUND,
                    format!("the model `{model}` does not exist here; this server has `{served}` (GET /v1/models)"),
                )
                .with_code("model_not_found"));
            }
        }
        // OpenAI's newer name and its older one: either, or both alike.
        let (field, asked) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(a), Some(b)) if a != b => {
                return Err(ApiError::invalid(format!(
                    "max_completion_tokens {a} and max_tokens {b} differ; send one of them"
                ))
                .with_param("max_tokens"))
            }
            (Some(m), _) => ("max_completion_tokens", Some(m)),
            (None, m) => ("max_tokens", m),
        };
        let max_tokens = match asked {
            None => limits.default_max_tokens.min(limits.max_tokens),
            Some(m) if m >= limits.min_tokens as i64 && m as u64 <= limits.max_tokens as u64 => {
                m as usize
            }
            Some(m) => {
                let zero = match (limits.echo_field, limits.min_tokens) {
                    (true, 1) => "; 0 with echo: true (the prompt alone, scored)",
                    _ => "",
                };
                return Err(ApiError::invalid(format!(
                    "{field} {m} must be {} to {} ({}){zero}",
                    limits.min_tokens, limits.max_tokens, limits.max_tokens_from,
                ))
                .with_param(field));
            }
        };
        let n = match self.n {
            None => 1,
            Some(n) if n >= 1 && n as u64 <= limits.max_n as u64 => n as usize,
            Some(n) => {
                return Err(ApiError::invalid(format!(
                    "n {n} must be 1 to {} (the server decodes {} at once: --parallel)",
                    limits.max_n,
                    match limits.max_n {
                        1 => "one sequence".to_string(),
                        many => format!("{many} sequences"),
                    }
                ))
                .with_param("n"))
            }
        };
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(format!(
                "temperature {temperature} must be 0 to 2 (0 is greedy)"
            ))
            .with_param("temperature"));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(
                ApiError::invalid(format!("top_p {top_p} must be in (0, 1]")).with_param("top_p"),
            );
        }
        let top_k = match self.top_k {
            None | Some(-1) => 0,
            Some(k) if k >= 0 => k as usize,
            Some(k) => {
                return Err(ApiError::invalid(format!(
                    "top_k {k} must be 0 (or -1) for all tokens, or a positive count"
                ))
                .with_param("top_k"))
            }
        };
        let repetition_penalty = self.repetition_penalty.unwrap_or(1.0);
        if !(repetition_penalty.is_finite() && repetition_penalty > 0.0) {
            return Err(ApiError::invalid(format!(
                "repetition_penalty {repetition_penalty} must be positive (1 disables it)"
            ))
            .with_param("repetition_penalty"));
        }
        for (name, value) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if value.is_some_and(|v| v != 0.0) {
                return Err(ApiError::invalid(format!(
                    "{name} is not supported; use repetition_penalty (1.1 is a mild one)"
                ))
                .with_param(name));
            }
        }
        let stop = match &self.stop {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s.clone()],
            Some(StopField::Many(list)) => list.clone(),
        };
        if stop.len() > 16 || stop.iter().any(|s| s.len() > 256) {
            return Err(
                ApiError::invalid("stop takes at most 16 strings of at most 256 bytes")
                    .with_param("stop"),
            );
        }
        let stream = self.stream.unwrap_or(false);
        let include_usage = self
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return Err(
                ApiError::invalid("stream_options is only allowed when stream is true")
                    .with_param("stream_options"),
            );
        }
        Ok(Settings {
            params: SamplingParams {
                temperature,
                top_k,
                top_p,
                repetition_penalty,
            },
            n,
            max_tokens,
            stop,
            // `generate --seed S`: sample i draws with seed S + i.
            seed: self.seed.unwrap_or_else(rand::random),
            stream,
            include_usage,
        })
    }
}

/// `{prompt_tokens, completion_tokens, total_tokens}`.
pub fn usage(prompt: usize, completion: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    })
}

/// One choice's result, gathered from its events.
#[derive(Debug, Default, Clone)]
pub struct ChoiceResult {
    pub text: String,
    pub tokens: Vec<TokenLogprob>,
    pub finish: Option<Finish>,
    pub completion_tokens: usize,
    /// Chat: whether the reply's content has begun (its leading whitespace is trimmed
    /// until then, from the text and from the tokens alike).
    pub reply_started: bool,
}

impl ChoiceResult {
    /// A chat reply's next text and tokens with the reply's leading whitespace taken
    /// off both: the template ends at "Assistant:" and a model answers " Hello", whose
    /// space is not content. The tokens' bytes then spell the content as OpenAI's do
    /// (a whitespace-only token keeps its logprob with no text). ASCII whitespace only,
    /// so a token's bytes and its text lose the same characters.
    pub fn trim_reply_start<'t>(&mut self, text: &'t str, tokens: &mut [TokenLogprob]) -> &'t str {
        let text = if self.text.is_empty() {
            text.trim_start_matches(|c: char| c.is_ascii_whitespace())
        } else {
            text
        };
        for t in tokens {
            if self.reply_started {
                break;
            }
            trim_piece(&mut t.token);
            for (alternative, _) in &mut t.top {
                trim_piece(alternative);
            }
            self.reply_started = !t.token.bytes.is_empty();
        }
        text
    }
}

/// `piece` without its leading ASCII whitespace.
fn trim_piece(piece: &mut super::batcher::Piece) {
    let kept = piece.bytes.iter().position(|b| !b.is_ascii_whitespace());
    piece.bytes.drain(..kept.unwrap_or(piece.bytes.len()));
    piece.text = piece
        .text
        .trim_start_matches(|c: char| c.is_ascii_whitespace())
        .to_string();
}

/// Completions' `logprobs` object for `tokens`, offsets counted from `offset` (the text
/// before them).
pub fn completion_logprobs(tokens: &[TokenLogprob], mut offset: usize) -> Value {
    let mut text_offset = Vec::with_capacity(tokens.len());
    for t in tokens {
        text_offset.push(offset);
        offset += t.token.text.len();
    }
    json!({
        "tokens": tokens.iter().map(|t| t.token.text.clone()).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        // A prompt's first token has neither (nothing predicts it).
        "top_logprobs": tokens.iter().map(|t| match t.logprob {
            None => Value::Null,
            Some(_) => t.top.iter().map(|(p, lp)| (p.text.clone(), json!(lp))).collect::<serde_json::Map<_, _>>().into(),
        }).collect::<Vec<_>>(),
        "text_offset": text_offset,
    })
}

/// Chat's `logprobs` object for `tokens`: each token's text, bytes and log-probability,
/// with the most likely alternatives'.
pub fn chat_logprobs(tokens: &[TokenLogprob]) -> Value {
    let entry = |piece: &super::batcher::Piece, logprob: Option<f32>| json!({"token": piece.text, "logprob": logprob, "bytes": piece.bytes});
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = entry(&t.token, t.logprob);
            e["top_logprobs"] = t.top.iter().map(|(p, lp)| entry(p, Some(*lp))).collect();
            e
        })
        .collect();
    json!({ "content": content, "refusal": null })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::batcher::Piece;

    fn token(text: &str, alternatives: &[&str]) -> TokenLogprob {
        let piece = |t: &str| Piece {
            text: t.to_string(),
            bytes: t.as_bytes().to_vec(),
        };
        TokenLogprob {
            token: piece(text),
            logprob: Some(-1.0),
            top: alternatives.iter().map(|a| (piece(a), -0.5)).collect(),
        }
    }

    /// The reply " \n Hi there" in three events: its leading whitespace leaves the text
    /// and the tokens alike, the tokens' bytes spell the content, every token keeps its
    /// logprob, and whitespace after the content begins stays.
    #[test]
    fn a_chat_reply_loses_its_leading_whitespace_from_text_and_tokens() {
        let mut choice = ChoiceResult::default();
        let events: [(&str, Vec<TokenLogprob>); 3] = [
            (" \n", vec![token(" ", &[" H", "\n"]), token("\n", &["x"])]),
            (" Hi", vec![token(" H", &[" A"]), token("i", &[])]),
            (" there", vec![token(" there", &["\n"])]),
        ];
        let mut tokens = Vec::new();
        for (text, mut event_tokens) in events {
            let text = choice.trim_reply_start(text, &mut event_tokens);
            choice.text.push_str(text);
            tokens.extend(event_tokens);
        }
        assert_eq!(choice.text, "Hi there");
        let spelled: Vec<u8> = tokens.iter().flat_map(|t| t.token.bytes.clone()).collect();
        assert_eq!(spelled, choice.text.as_bytes());
        let texts: Vec<&str> = tokens.iter().map(|t| t.token.text.as_str()).collect();
        assert_eq!(texts, ["", "", "H", "i", " there"]);
        assert!(tokens.iter().all(|t| t.logprob == Some(-1.0)));
        // Alternatives at a trimmed place are trimmed as the token is; later ones not.
        let tops: Vec<Vec<&str>> = tokens
            .iter()
            .map(|t| t.top.iter().map(|(p, _)| p.text.as_str()).collect())
            .collect();
        assert_eq!(tops[0], ["H", ""]);
        assert_eq!(tops[2], ["A"]);
        assert_eq!(tops[4], ["\n"]);
    }
}
