//! `tinygpt serve` over real HTTP: the real binary on a tiny checkpoint, a real HTTP
//! client (ureq), real signals. The openai Python client and a headless browser are
//! driven by tools/serve-clients.sh.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;
use common::{succeeds, tinygpt};
#[path = "common/server.rs"]
mod server;
use server::{agent, get, post, post_with, run_row, trained, Server};

/// A streamed request's `data:` payloads, in order.
fn stream(url: &str, body: &Value) -> Vec<String> {
    let mut response = agent()
        .post(url)
        .header("content-type", "application/json")
        .send(body.to_string())
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let content_type = response.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        content_type.starts_with("text/event-stream"),
        "{content_type}"
    );
    let mut text = String::new();
    response
        .body_mut()
        .as_reader()
        .read_to_string(&mut text)
        .unwrap();
    text.split("\n\n")
        .filter_map(|event| event.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(String::from)
        .collect()
}

/// Streamed completion text per choice, the finish reasons, and the usage chunk.
fn streamed_text(events: &[String], n: usize) -> (Vec<String>, Vec<String>, Option<Value>) {
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let mut texts = vec![String::new(); n];
    let mut finishes = vec![String::new(); n];
    let mut usage = None;
    for event in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(event).unwrap();
        if !chunk["usage"].is_null() {
            usage = Some(chunk["usage"].clone());
        }
        for choice in chunk["choices"].as_array().unwrap() {
            let i = choice["index"].as_u64().unwrap() as usize;
            if let Some(t) = choice["text"].as_str() {
                texts[i].push_str(t);
            }
            if let Some(t) = choice["delta"]["content"].as_str() {
                texts[i].push_str(t);
            }
            if let Some(f) = choice["finish_reason"].as_str() {
                finishes[i] = f.to_string();
            }
        }
    }
    (texts, finishes, usage)
}

fn generate_json(
    dir: &Path,
    prompt: &str,
    seed: u64,
    samples: usize,
    tokens: usize,
) -> Vec<String> {
    let out = tinygpt(
        dir,
        &[
            "generate",
            "--checkpoint",
            "checkpoints/exp",
            "--json",
            "--prompt",
            prompt,
            "--seed",
            &seed.to_string(),
            "--num-samples",
            &samples.to_string(),
            "--max-new-tokens",
            &tokens.to_string(),
            "--temperature",
            "0.9",
            "--top-k",
            "20",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect()
}

/// Two choices of a seeded request against `generate --num-samples 2` with the same
/// seed and settings: the same texts. (generate's texts, the request, the response.)
fn same_as_generate(dir: &Path, completions: &str) -> (Vec<String>, Value, Value) {
    let expected = generate_json(dir, "To be", 7, 2, 60);
    let request = json!({"prompt": "To be", "seed": 7, "n": 2, "max_tokens": 60, "temperature": 0.9, "top_k": 20});
    let (status, body) = post(completions, &request.to_string());
    assert_eq!(status, 200, "{body}");
    let texts: Vec<&str> = body["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert_eq!(
        texts, expected,
        "the server's choices are generate's samples"
    );
    (expected, request, body)
}

/// Seeds past 2^63 (half of those `generate` prints) reproduce `generate`'s text, and
/// a negative one is taken modulo 2^64 as `generate --seed` takes it.
#[test]
fn every_seed_generate_prints_is_a_seed_here() {
    let dir = trained();
    let server = Server::start(dir.path(), &["--max-queue", "0"]);
    let url = server.url("/v1/completions");
    let big: u64 = 18_446_744_073_709_551_611;
    let expected = generate_json(dir.path(), "To be", big, 1, 20);
    for seed in [json!(big), json!(-5)] {
        let request = json!({"prompt": "To be", "seed": seed, "max_tokens": 20, "temperature": 0.9, "top_k": 20});
        // --max-queue 0: none may wait, but an idle server serves.
        let (status, body) = post(&url, &request.to_string());
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["choices"][0]["text"], expected[0], "seed {seed}");
    }
    let (status, error) = post(&url, r#"{"prompt": "T", "seed": 1.5}"#);
    assert_eq!(status, 400, "{error}");
}

#[test]
fn completions_match_generate_stream_and_stop_across_tokens() {
    let dir = trained();
    let server = Server::start(dir.path(), &["--parallel", "4"]);
    let completions = server.url("/v1/completions");

    // Same seed and settings as `generate`: the same text, for every choice.
    let (expected, request, body) = same_as_generate(dir.path(), &completions);
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["usage"]["prompt_tokens"], 5);
    assert_eq!(body["usage"]["completion_tokens"], 120);
    assert_eq!(body["choices"][0]["finish_reason"], "length");

    // Streamed: the chunks add up to the same text, then usage, then [DONE].
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = stream(&completions, &streamed);
    let (chunks, finishes, usage) = streamed_text(&events, 2);
    assert_eq!(chunks, expected);
    assert_eq!(finishes, ["length", "length"]);
    assert_eq!(usage.unwrap()["completion_tokens"], 120);

    // A stop string of several characters (several tokens of this char model) cuts the
    // text before it, and no chunk ever shows a piece of it.
    let text = &expected[0];
    let cut = text.char_indices().nth(20).map_or(0, |(i, _)| i);
    let stop: String = text[cut..].chars().take(3).collect();
    let before = &text[..text.find(&stop).unwrap()];
    let mut stopped = json!({"prompt": "To be", "seed": 7, "max_tokens": 60, "temperature": 0.9, "top_k": 20, "stop": [stop.clone()]});
    let (_, body) = post(&completions, &stopped.to_string());
    assert_eq!(body["choices"][0]["text"], *before);
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    stopped["stream"] = json!(true);
    let events = stream(&completions, &stopped);
    let (chunks, finishes, _) = streamed_text(&events, 1);
    assert_eq!(chunks[0], *before);
    assert_eq!(finishes[0], "stop");
    assert!(
        events.iter().all(|e| !e.contains(&stop)),
        "a chunk showed the stop string"
    );
    // With logprobs, the tokens are those of the text: none of the stop string's.
    stopped["stream"] = json!(false);
    stopped["logprobs"] = json!(1);
    let (_, body) = post(&completions, &stopped.to_string());
    let tokens: Vec<&str> = body["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens.concat(), *before, "{body}");

    // Logprobs: one per generated token, each <= 0, the top alternatives ordered.
    let (_, body) = post(
        &completions,
        &json!({"prompt": "To be", "seed": 1, "max_tokens": 12, "logprobs": 3}).to_string(),
    );
    let lp = &body["choices"][0]["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(
        tokens.concat(),
        body["choices"][0]["text"].as_str().unwrap()
    );
    for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let chosen = lp["token_logprobs"][i].as_f64().unwrap();
        assert!(chosen <= 0.0);
        let values: Vec<f64> = top
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert!(!values.is_empty() && values.len() <= 3);
        let best = values.iter().cloned().fold(f64::MIN, f64::max);
        assert!(
            chosen <= best + 1e-6,
            "the drawn token is not likelier than the top"
        );
    }

    // Chat: the template's prompt, the reply as a message; streamed as deltas.
    let chat = json!({"messages": [{"role": "user", "content": "Who is there?"}], "seed": 3, "max_tokens": 20});
    let (status, body) = post(&server.url("/v1/chat/completions"), &chat.to_string());
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    let reply = body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let mut chat_stream = chat.clone();
    chat_stream["stream"] = json!(true);
    let events = stream(&server.url("/v1/chat/completions"), &chat_stream);
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(first["object"], "chat.completion.chunk");
    let (deltas, _, _) = streamed_text(&events, 1);
    assert_eq!(deltas[0], reply);

    // Tokenize and detokenize round-trip; models lists the run.
    let (_, tokens) = post(&server.url("/tokenize"), r#"{"content": "To be"}"#);
    assert_eq!(tokens["tokens"].as_array().unwrap().len(), 5);
    let (_, back) = post(
        &server.url("/detokenize"),
        &json!({"tokens": tokens["tokens"]}).to_string(),
    );
    assert_eq!(back["content"], "To be");
    let (status, models) = get(&server.url("/v1/models"), &[]);
    assert_eq!(status, 200);
    assert!(models.contains("\"id\":\"exp\""), "{models}");
    let (status, metrics) = get(&server.url("/metrics"), &[]);
    assert_eq!(status, 200);
    assert!(
        metrics.contains("tinygpt_generated_tokens_total "),
        "{metrics}"
    );
}

/// A request that joins while another generates does not change either's text: the
/// batch is cached-vs-batched equal to each decoded alone.
#[test]
fn requests_joining_midway_decode_as_if_alone() {
    let dir = trained();
    let server = Server::start(dir.path(), &["--parallel", "4", "--max-tokens", "1000000"]);
    let url = server.url("/v1/completions");
    let body = |seed: u64, tokens: usize| json!({"prompt": "Whe", "seed": seed, "max_tokens": tokens, "temperature": 1.0});
    let text = |body: &Value| post(&url, &body.to_string()).1["choices"][0]["text"].clone();
    let alone_a = text(&body(11, 3000));
    let alone_a = alone_a.as_str().unwrap();
    let alone_b = text(&body(12, 40));
    // A streams for as long as the test reads it (its first 3,000 tokens are the ones
    // drawn alone: a token's draw does not depend on how many are asked for); B is sent
    // once A's first tokens have arrived, so the two share passes whatever the timing.
    let mut streamed = body(11, 1_000_000);
    streamed["stream"] = json!(true);
    let mut a = agent()
        .post(&url)
        .header("content-type", "application/json")
        .send(streamed.to_string())
        .unwrap();
    let mut reader = BufReader::new(a.body_mut().as_reader());
    let mut joined_a = String::new();
    let mut events = 0;
    let mut line = String::new();
    let mut read_a = |until: &dyn Fn(usize, &str) -> bool| {
        while !until(events, &joined_a) {
            line.clear();
            let read = reader.read_line(&mut line).unwrap();
            assert_ne!(read, 0, "A's stream ended after {events} events");
            if let Some(data) = line.trim_end().strip_prefix("data: ") {
                let chunk: Value = serde_json::from_str(data).unwrap();
                joined_a.push_str(chunk["choices"][0]["text"].as_str().unwrap_or(""));
                events += 1;
            }
        }
    };
    read_a(&|events, _| events >= 5);
    let running = get(&server.url("/metrics"), &[]).1;
    assert!(running.contains("tinygpt_requests_running 1"), "{running}");
    let joined_b = text(&body(12, 40));
    read_a(&|_, text| text.len() >= alone_a.len());
    drop(reader);
    drop(a);
    assert!(
        joined_a.starts_with(alone_a),
        "A's text changed when B joined:\n{joined_a}\nvs alone\n{alone_a}"
    );
    assert_eq!(joined_b, alone_b);
}

#[test]
fn bad_requests_are_4xx_with_openai_errors() {
    let dir = trained();
    let server = Server::start(dir.path(), &["--parallel", "2", "--max-body-bytes", "2000"]);
    let url = server.url("/v1/completions");
    let refused = |body: &str, status: u16, kind: &str| {
        let (got, error) = post(&url, body);
        assert_eq!(got, status, "{body:.80}: {error}");
        assert_eq!(error["error"]["type"], kind, "{body:.80}: {error}");
        assert!(error["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    };
    for body in [
        "{not json",
        r#"{"prompt": 3.5}"#,
        r#"{"prompt": "T", "max_tokens": 0}"#,
        r#"{"prompt": "T", "n": 3}"#,
        r#"{"prompt": "T", "temperature": -1}"#,
        r#"{"prompt": "T", "top_p": 0}"#,
        r#"{"prompt": "T", "logprobs": 9}"#,
        r#"{"prompt": [1, 2, 999]}"#,
        r#"{"prompt": ["a", "b", "c"]}"#,
        r#"{"prompt": ["a", "b"], "n": 2}"#,
        r#"{"prompt": []}"#,
        r#"{"prompt": "T", "echo": true, "logprobs": 1, "stream": true}"#,
        &json!({"prompt": "a".repeat(40)}).to_string(),
    ] {
        refused(body, 400, "invalid_request_error");
    }
    refused(
        r#"{"prompt": "T", "model": "gpt-4"}"#,
        404,
        "not_found_error",
    );
    // Another tool's name for a field is answered with ours; a typo inside
    // stream_options is named, not dropped.
    for (body, hint) in [
        (
            r#"{"prompt": "T", "max_new_tokens": 2}"#,
            "did you mean `max_tokens`?",
        ),
        (
            r#"{"prompt": "T", "num_predict": 2}"#,
            "did you mean `max_tokens`?",
        ),
        (
            r#"{"prompt": "T", "stream": true, "stream_options": {"include_usag": true}}"#,
            "include_usag",
        ),
    ] {
        let (status, error) = post(&url, body);
        assert_eq!(status, 400, "{body}: {error}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains(hint), "{body}: {message}");
    }
    // GET /v1/models/{id}: the served model, or OpenAI's 404.
    let (status, model) = get(&server.url("/v1/models/exp"), &[]);
    assert_eq!(status, 200, "{model}");
    let model: Value = serde_json::from_str(&model).unwrap();
    assert_eq!(model["id"], "exp");
    assert_eq!(model["object"], "model");
    let (status, missing) = get(&server.url("/v1/models/gpt-4"), &[]);
    assert_eq!(status, 404, "{missing}");
    assert!(missing.contains("model_not_found"), "{missing}");
    let too_large = json!({"prompt": "x".repeat(3000)}).to_string();
    refused(&too_large, 413, "invalid_request_error");
    let (_, error) = post(&url, &too_large);
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("--max-body-bytes")),
        "{error}"
    );
    // A huge declared length is refused from the header, before any body comes.
    let asked = Instant::now();
    let mut raw = std::net::TcpStream::connect(server.address()).unwrap();
    std::io::Write::write_all(
        &mut raw,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 99999999999\r\n\r\n{",
    )
    .unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut head = [0u8; 12];
    raw.read_exact(&mut head).unwrap();
    assert_eq!(&head, b"HTTP/1.1 413", "{}", String::from_utf8_lossy(&head));
    assert!(
        asked.elapsed() < Duration::from_secs(1),
        "{:?}",
        asked.elapsed()
    );
    let (status, error) = post(&server.url("/v1/chat/completions"), r#"{"messages": []}"#);
    assert_eq!(status, 400, "{error}");
    let (status, error) = post(
        &server.url("/v1/chat/completions"),
        r#"{"messages": [{"role": "wizard", "content": "hi"}]}"#,
    );
    assert_eq!(status, 400, "{error}");
    for body in [
        r#"{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}"#,
        r#"{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21}"#,
    ] {
        let (status, error) = post(&server.url("/v1/chat/completions"), body);
        assert_eq!(status, 400, "{body}: {error}");
    }
    let (status, body) = get(&server.url("/v1/nothing"), &[]);
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("\"error\""));
    let mut response = agent().put(&url).send("{}").unwrap();
    assert_eq!(response.status().as_u16(), 405);
    assert!(response
        .body_mut()
        .read_to_string()
        .unwrap()
        .contains("\"error\""));
    // Without a JSON content type.
    let mut response = agent().post(&url).send(r#"{"prompt": "x"}"#).unwrap();
    assert_eq!(response.status().as_u16(), 415);
    assert!(response
        .body_mut()
        .read_to_string()
        .unwrap()
        .contains("\"error\""));
    // The server is still there.
    let (status, _) = get(&server.url("/health"), &[]);
    assert_eq!(status, 200);
}

/// lm-evaluation-harness's `local-completions` against the server, request for request:
/// it finds the server's tokenizer (`/tokenizer_info`, then `/tokenize` with vLLM's
/// fields), then scores contexts and continuations given as token lists, several a
/// request, with `echo` and `logprobs` (max_tokens 1). Each prompt token's logprob is the
/// model's: their sum is minus what `tinygpt eval` (the training engine's forward, not
/// the decoder) sums for the same text. A list of prompts decodes each as it decodes
/// alone; `max_tokens` 0 with `echo` scores the prompt and draws nothing.
#[test]
fn evaluation_harnesses_score_prompts_as_eval_does() {
    let dir = trained();
    let server = Server::start(dir.path(), &["--parallel", "4", "--max-tokens", "1000000"]);

    let (status, info) = get(&server.url("/tokenizer_info"), &[]);
    assert_eq!(status, 200, "{info}");
    let info: Value = serde_json::from_str(&info).unwrap();
    assert!(
        info.as_object().unwrap().contains_key("eos_token"),
        "{info}"
    );
    assert_eq!(info["model_max_length"], 32, "{info}");
    let text = "To be, or not to be, that is th"; // 31 tokens of a context of 32
    let (status, tokens) = post(
        &server.url("/tokenize"),
        &json!({"prompt": text, "add_special_tokens": false}).to_string(),
    );
    assert_eq!(status, 200, "{tokens}");
    let ids: Vec<u64> = tokens["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(ids.len(), 31);
    let (status, back) = post(
        &server.url("/detokenize"),
        &json!({ "tokens": ids }).to_string(),
    );
    assert_eq!(
        (status, back["prompt"].as_str()),
        (200, Some(text)),
        "{back}"
    );

    // The loglikelihood request, two prompts in one: the text, and its first 10 tokens.
    let short = ids[..10].to_vec();
    let (status, scored) = post(
        &server.url("/v1/completions"),
        &json!({"model": "exp", "prompt": [ids, short], "temperature": 0, "max_tokens": 1,
                "logprobs": 1, "seed": 1234, "echo": true})
        .to_string(),
    );
    assert_eq!(status, 200, "{scored}");
    let choices = scored["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    for (choice, prompt) in choices.iter().zip([&ids, &short]) {
        let logprobs = &choice["logprobs"];
        let token_logprobs = logprobs["token_logprobs"].as_array().unwrap();
        let top = logprobs["top_logprobs"].as_array().unwrap();
        // The prompt's tokens, then the one drawn.
        assert_eq!(token_logprobs.len(), prompt.len() + 1, "{choice}");
        assert_eq!(top.len(), prompt.len() + 1);
        assert!(token_logprobs[0].is_null() && top[0].is_null(), "{choice}");
        assert_eq!(logprobs["text_offset"][0], 0);
        assert!(choice["text"]
            .as_str()
            .unwrap()
            .starts_with(&text[..prompt.len()]));
        for (lp, best) in token_logprobs[1..].iter().zip(&top[1..]) {
            // lm-eval's greedy test: the token's logprob against the best one's.
            let best = best.as_object().unwrap();
            assert_eq!(best.len(), 1, "{best:?}");
            let (lp, best) = (lp.as_f64().unwrap(), best.values().next().unwrap());
            assert!(lp <= 0.0 && lp <= best.as_f64().unwrap() + 1e-6);
        }
    }
    let prompt_sum: f64 = choices[0]["logprobs"]["token_logprobs"].as_array().unwrap()[1..=30]
        .iter()
        .map(|v| v.as_f64().unwrap())
        .sum();
    std::fs::write(dir.path().join("text.txt"), text).unwrap();
    let eval = succeeds(
        dir.path(),
        &[
            "eval",
            "--checkpoint",
            "checkpoints/exp",
            "--text",
            "text.txt",
            "--json",
        ],
    );
    let eval: Value = serde_json::from_slice(&eval.stdout).unwrap();
    assert_eq!(eval["predictions"], 30, "{eval}");
    let total = eval["loss"].as_f64().unwrap() * 30.0;
    assert!(
        (prompt_sum + total).abs() <= 1e-4 * total,
        "the prompt's logprobs sum to {prompt_sum}, eval's losses to {total}"
    );

    // max_tokens 0: the prompt scored, nothing drawn.
    let (status, alone) = post(
        &server.url("/v1/completions"),
        &json!({"prompt": text, "max_tokens": 0, "logprobs": 0, "echo": true}).to_string(),
    );
    assert_eq!(status, 200, "{alone}");
    let choice = &alone["choices"][0];
    assert_eq!(choice["text"], text);
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(alone["usage"]["completion_tokens"], 0);
    let lps = choice["logprobs"]["token_logprobs"].as_array().unwrap();
    assert_eq!(lps.len(), 31);
    let again: f64 = lps[1..].iter().map(|v| v.as_f64().unwrap()).sum();
    assert!((again - prompt_sum).abs() < 1e-5, "{again} vs {prompt_sum}");
    // And scored beside two streams that generate (their first text has come): the same.
    let url = server.url("/v1/completions");
    // Streams that run until the test has scored (the server allows a million tokens).
    let busy = json!({"prompt": "To", "n": 2, "max_tokens": 1_000_000, "stream": true});
    let scored = Arc::new(AtomicBool::new(false));
    let (started, generating) = std::sync::mpsc::channel();
    let busy = {
        let scored = Arc::clone(&scored);
        std::thread::spawn(move || {
            let mut response = agent()
                .post(&url)
                .header("content-type", "application/json")
                .send(busy.to_string())
                .unwrap();
            let lines = BufReader::new(response.body_mut().as_reader()).lines();
            let (mut events, mut after) = (0, 0);
            for line in lines.map_while(Result::ok) {
                if line.starts_with("data: ") {
                    events += 1;
                    if events == 1 {
                        started.send(()).unwrap();
                    }
                    if line.contains("finish_reason\":\"") {
                        break;
                    }
                    // Read on a little past the scoring, then hang up.
                    if scored.load(Ordering::Relaxed) {
                        after += 1;
                        if after > 100 {
                            break;
                        }
                    }
                }
            }
            (events, after)
        })
    };
    generating
        .recv_timeout(Duration::from_secs(30))
        .expect("the streams began");
    let (status, beside) = post(
        &server.url("/v1/completions"),
        &json!({"prompt": text, "max_tokens": 0, "logprobs": 0, "echo": true}).to_string(),
    );
    scored.store(true, Ordering::Relaxed);
    assert_eq!(status, 200, "{beside}");
    let lps = beside["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap();
    let beside: f64 = lps[1..].iter().map(|v| v.as_f64().unwrap()).sum();
    assert!(
        (beside - prompt_sum).abs() < 1e-4 * total,
        "{beside} vs {prompt_sum}"
    );
    let (events, after) = busy.join().unwrap();
    assert!(
        after > 100,
        "the streams ended ({events} events) instead of running on past the scoring"
    );

    // A list of prompts with n = 2: choice i continues prompt i / 2, as that prompt
    // alone with the same seed does.
    let ask = |prompt: Value, n: usize| {
        let body = json!({"prompt": prompt, "n": n, "max_tokens": 8, "seed": 7});
        let (status, body) = post(&server.url("/v1/completions"), &body.to_string());
        assert_eq!(status, 200, "{body}");
        let texts: Vec<String> = body["choices"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(i, c)| {
                assert_eq!(c["index"], i);
                c["text"].as_str().unwrap().to_string()
            })
            .collect();
        (texts, body["usage"]["prompt_tokens"].clone())
    };
    let (both, usage) = ask(json!(["To be", "Whether"]), 2);
    assert_eq!(usage, 5 + 7);
    assert_eq!(both[..2], ask(json!("To be"), 2).0[..]);
    assert_eq!(both[2..], ask(json!("Whether"), 2).0[..]);
}

#[test]
fn the_api_key_guards_every_route_but_health() {
    let dir = trained();
    let server = Server::start(dir.path(), &["--api-key", "s3cret"]);
    let (status, body) = get(&server.url("/v1/models"), &[]);
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("authentication_error"), "{body}");
    let (status, _) = get(
        &server.url("/v1/models"),
        &[("authorization", "Bearer wrong")],
    );
    assert_eq!(status, 401);
    // The scheme's name in any case, as RFC 9110 has it.
    for scheme in ["Bearer", "bearer", "BEARER"] {
        let (status, _) = get(
            &server.url("/v1/models"),
            &[("authorization", format!("{scheme} s3cret").as_str())],
        );
        assert_eq!(status, 200, "{scheme}");
    }
    let (status, _) = get(&server.url("/v1/models"), &[("authorization", "s3cret")]);
    assert_eq!(status, 401, "a key with no scheme");
    let (status, _) = post(
        &server.url("/v1/completions"),
        r#"{"prompt": "To", "max_tokens": 2}"#,
    );
    assert_eq!(status, 401);
    let (status, _) = post_with(
        &server.url("/v1/completions"),
        r#"{"prompt": "To", "max_tokens": 2}"#,
        &[("authorization", "Bearer s3cret")],
    );
    assert_eq!(status, 200);
    for open in ["/health", "/", "/app.js"] {
        let (status, _) = get(&server.url(open), &[]);
        assert_eq!(status, 200, "{open}");
    }
    // No CORS unless asked for.
    let response = agent()
        .get(&server.url("/health"))
        .header("origin", "http://elsewhere.example")
        .call()
        .unwrap();
    assert!(response
        .headers()
        .get("access-control-allow-origin")
        .is_none());
    drop(server);

    // Open to the network without a key: said as it starts (right after the line
    // saying where); with a key, or on loopback alone, not.
    let note = "note: this answers anyone who can reach port ";
    let told = |extra: &[&str]| {
        let server = Server::start(dir.path(), extra);
        let start = Instant::now();
        while !server.log.lock().unwrap().contains(note)
            && start.elapsed() < Duration::from_millis(500)
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        let log = server.log.lock().unwrap().clone();
        log
    };
    let open = told(&["--host", "0.0.0.0"]);
    assert!(
        open.contains(note) && open.contains("give --api-key KEY"),
        "{open}"
    );
    for guarded in [&["--host", "0.0.0.0", "--api-key", "k"][..], &[]] {
        let log = told(guarded);
        assert!(!log.contains(note), "{guarded:?}: {log}");
    }
}

#[test]
fn a_full_queue_answers_503_and_a_disconnect_frees_the_slot() {
    let dir = trained();
    let server = Server::start(
        dir.path(),
        &[
            "--parallel",
            "1",
            "--max-queue",
            "1",
            "--max-tokens",
            "1000000",
        ],
    );
    let url = server.url("/v1/completions");
    // A holds the only slot: a stream that would run for minutes.
    let mut a = agent()
        .post(&url)
        .header("content-type", "application/json")
        .send(json!({"prompt": "To", "max_tokens": 1000000, "stream": true}).to_string())
        .unwrap();
    let mut reader = BufReader::new(a.body_mut().as_reader());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.starts_with("data: "), "{line}");
    // B waits in the queue.
    let b = {
        let url = url.clone();
        std::thread::spawn(move || post(&url, r#"{"prompt": "To", "max_tokens": 5}"#))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !get(&server.url("/metrics"), &[])
        .1
        .contains("tinygpt_requests_queued 1")
    {
        assert!(Instant::now() < deadline, "B never queued");
        std::thread::sleep(Duration::from_millis(10));
    }
    // C finds the queue full.
    let mut response = agent()
        .post(&url)
        .header("content-type", "application/json")
        .send(r#"{"prompt": "To", "max_tokens": 5}"#)
        .unwrap();
    assert_eq!(response.status().as_u16(), 503);
    assert_eq!(response.headers()["retry-after"], "1");
    let error: Value =
        serde_json::from_str(&response.body_mut().read_to_string().unwrap()).unwrap();
    assert_eq!(error["error"]["type"], "unavailable_error");
    // A's client goes away: B gets the slot and finishes.
    drop(reader);
    drop(a);
    let started = Instant::now();
    let (status, body) = b.join().unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 5);
    assert!(started.elapsed() < Duration::from_secs(10));
    let (_, metrics) = get(&server.url("/metrics"), &[]);
    assert!(
        metrics.contains("tinygpt_requests_cancelled_total 1"),
        "{metrics}"
    );
    assert!(metrics.contains("tinygpt_requests_running 0"), "{metrics}");
    // The log: A's stream, cut by its client, with its tokens out unknown; C's 503.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let log = server.log.lock().unwrap().clone();
        let left = log.lines().any(|l| {
            l.starts_with("POST /v1/completions 200 2+? tokens ")
                && l.ends_with(" ms (client left)")
        });
        let full = log
            .lines()
            .any(|l| l.starts_with("POST /v1/completions 503 "));
        if left && full {
            break;
        }
        assert!(Instant::now() < deadline, "{log}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(unix)]
#[test]
fn sigterm_ends_streams_with_a_finish_reason_and_exits_143() {
    let dir = trained();
    let mut server = Server::start(dir.path(), &["--max-tokens", "1000000", "--parallel", "1"]);
    let url = server.url("/v1/completions");
    let long = json!({"prompt": "To", "max_tokens": 1000000, "stream": true});
    let running = {
        let (url, long) = (url.clone(), long.clone());
        std::thread::spawn(move || stream(&url, &long))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !get(&server.url("/metrics"), &[])
        .1
        .contains("tinygpt_requests_running 1")
    {
        assert!(Instant::now() < deadline, "the stream never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    // A second stream waits for the only slot: its status waits for its first text,
    // so the stop reaches it as a 503, not as a 200 with an error inside.
    let queued = std::thread::spawn(move || post(&url, &long.to_string()));
    while !get(&server.url("/metrics"), &[])
        .1
        .contains("tinygpt_requests_queued 1")
    {
        assert!(Instant::now() < deadline, "the second stream never queued");
        std::thread::sleep(Duration::from_millis(10));
    }
    let signalled = Instant::now();
    server.signal(libc::SIGTERM);
    let events = running.join().unwrap();
    let (_, finishes, _) = streamed_text(&events, 1);
    let (status, error) = queued.join().unwrap();
    assert_eq!(status, 503, "{error}");
    assert_eq!(error["error"]["type"], "unavailable_error", "{error}");
    assert_eq!(finishes[0], "length");
    let code = server.wait(Duration::from_secs(10));
    assert_eq!(code, Some(143), "{}", server.log.lock().unwrap());
    assert!(
        signalled.elapsed() < Duration::from_secs(5),
        "{:?}",
        signalled.elapsed()
    );
}

#[test]
fn the_dashboard_reads_runs_as_they_grow() {
    let dir = trained();
    let server = Server::start(dir.path(), &["--runs", "checkpoints"]);
    let (status, body) = get(&server.url("/api/runs"), &[]);
    assert_eq!(status, 200, "{body}");
    let runs: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(runs["runs"][0]["run"], "exp");
    assert_eq!(runs["runs"][0]["checkpoint"], true);
    let (_, body) = get(&server.url("/api/runs/exp/metrics?from=0"), &[]);
    let first: Value = serde_json::from_str(&body).unwrap();
    let records = first["records"].as_array().unwrap().len();
    assert!(records > 0);
    // A line appended (half of it first) appears once whole, and only then.
    let metrics = dir.path().join("checkpoints/exp/metrics.jsonl");
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(&metrics)
        .unwrap();
    use std::io::Write;
    file.write_all(br#"{"step": 99, "loss": 1.5, "#).unwrap();
    let next = first["next"].as_u64().unwrap();
    let (_, body) = get(
        &server.url(&format!("/api/runs/exp/metrics?from={next}")),
        &[],
    );
    let partial: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(partial["records"].as_array().unwrap().len(), 0);
    assert_eq!(partial["next"], next);
    file.write_all(b"\"lr\": 0.001}\n").unwrap();
    let (_, body) = get(
        &server.url(&format!("/api/runs/exp/metrics?from={next}")),
        &[],
    );
    let grown: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(grown["records"][0]["step"], 99);
    // Lines that are JSON but no record (a step that is not a whole number, an array)
    // are skipped and counted, not handed to the charts; a blank line is neither.
    let next = grown["next"].as_u64().unwrap();
    file.write_all(b"{\"step\": \"x\", \"loss\": 2}\n[1, 2]\n\n{\"step\": 100, \"loss\": 1.4}\n")
        .unwrap();
    let (_, body) = get(
        &server.url(&format!("/api/runs/exp/metrics?from={next}")),
        &[],
    );
    let mixed: Value = serde_json::from_str(&body).unwrap();
    let steps: Vec<&Value> = mixed["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| &r["step"])
        .collect();
    assert_eq!(steps, [&Value::from(100)], "{body}");
    assert_eq!(mixed["skipped"], 2, "{body}");
    // A resume that changed a setting (as training logs it) is part of what the run's
    // row says differs, as in `tinygpt compare`.
    file.write_all(b"{\"step\": 100, \"resumed\": {\"train.max_iters\": [\"40\", \"80\"]}}\n")
        .unwrap();
    let (_, body) = get(&server.url("/api/runs"), &[]);
    let listed: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(listed["runs"][0]["skipped_lines"], 2, "{body}");
    let differs = listed["runs"][0]["differs"].as_array().unwrap();
    assert!(
        differs.contains(&Value::from("resumed at 100: max_iters 40->80")),
        "{body}"
    );
    // A copy whose state.json says two ranks trained it (as a data-parallel run's does:
    // tests/parallel.rs makes one): the process count differs, as in `tinygpt compare`.
    let wide = dir.path().join("checkpoints/wide");
    std::fs::create_dir(&wide).unwrap();
    for file in ["config.toml", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(
            dir.path().join("checkpoints/exp").join(file),
            wide.join(file),
        )
        .unwrap();
    }
    let state = std::fs::read_to_string(dir.path().join("checkpoints/exp/state.json")).unwrap();
    let mut state: Value = serde_json::from_str(&state).unwrap();
    state["ranks"] = 2.into();
    std::fs::write(wide.join("state.json"), state.to_string()).unwrap();
    let (_, body) = get(&server.url("/api/runs"), &[]);
    let listed: Value = serde_json::from_str(&body).unwrap();
    let row = |name: &str| run_row(&listed, name);
    assert_eq!(row("wide")["differs"][0], "ranks=2", "{body}");
    assert_eq!(row("exp")["differs"][0], "ranks=1", "{body}");
    // The file replaced by another (as `mv` or rsync does), longer than the offset the
    // page holds: read from the start, and said so.
    let file_id = mixed["file"].as_str().unwrap().to_string();
    let next = mixed["next"].as_u64().unwrap();
    let replacement = dir.path().join("replacement.jsonl");
    let longer: String = (0..2000)
        .map(|step| format!("{{\"step\": {step}, \"loss\": 3.0}}\n"))
        .collect();
    std::fs::write(&replacement, longer).unwrap();
    std::fs::rename(&replacement, &metrics).unwrap();
    let (_, body) = get(
        &server.url(&format!("/api/runs/exp/metrics?from={next}&file={file_id}")),
        &[],
    );
    let replaced: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(replaced["from"], 0, "{body:.300}");
    assert_ne!(replaced["file"], file_id.as_str());
    assert_eq!(replaced["records"][0]["step"], 0, "{body:.300}");
    // Paths outside the runs folder are not runs.
    let (status, _) = get(&server.url("/api/runs/..%2F..%2Fetc/metrics"), &[]);
    assert_eq!(status, 404);
    let (status, sample) = post(
        &server.url("/api/runs/exp/sample"),
        r#"{"prompt": "To", "max_tokens": 10, "seed": 1}"#,
    );
    assert_eq!(status, 200, "{sample}");
    assert_eq!(sample["text"].as_str().unwrap().chars().count(), 10);
}

/// A connection that sends nothing is closed after --idle-timeout; one that keeps
/// sending requests is not.
#[test]
fn idle_connections_are_closed() {
    use std::io::Write;
    let dir = trained();
    let server = Server::start(dir.path(), &["--idle-timeout", "2"]);
    let address = server.base.trim_start_matches("http://").to_string();
    // Timed from before the connection: the server's clock starts later, at its accept.
    let started = Instant::now();
    let mut idle = std::net::TcpStream::connect(&address).unwrap();
    idle.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut buffer = [0u8; 64];
    let read = idle.read(&mut buffer).unwrap_or(0);
    assert_eq!(
        read, 0,
        "the server answered a connection that sent nothing"
    );
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(1900) && waited < Duration::from_secs(12),
        "{waited:?}"
    );
    // Kept alive and busy: three requests on one connection.
    let mut busy = std::net::TcpStream::connect(&address).unwrap();
    busy.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    for _ in 0..3 {
        busy.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut answer = Vec::new();
        while !answer.ends_with(br#"{"status":"ok"}"#) {
            let n = busy.read(&mut buffer).unwrap();
            assert!(
                n > 0,
                "closed while busy: {}",
                String::from_utf8_lossy(&answer)
            );
            answer.extend_from_slice(&buffer[..n]);
        }
        assert!(
            answer.starts_with(b"HTTP/1.1 200"),
            "{}",
            String::from_utf8_lossy(&answer)
        );
        // Idle for a quarter of the timeout between requests.
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The CUDA decoder serves too: its passes of rows at their own positions run under the
/// CPU emulator here (on a GPU with `--device cuda`), with `generate`'s text.
#[test]
fn the_cuda_decoder_serves_under_the_emulator() {
    if !cfg!(feature = "cuda-emulator") {
        eprintln!(
            "SKIPPED: serving on the emulated CUDA decoder (build with --features cuda-emulator)"
        );
        return;
    }
    let dir = trained();
    let server = Server::start_with(
        dir.path(),
        &["--parallel", "4"],
        &[("TINYGPT_EMULATE_CUDA", "1")],
    );
    assert!(
        server
            .log
            .lock()
            .unwrap()
            .contains("CUDA decoder under the CPU emulator"),
        "{}",
        server.log.lock().unwrap()
    );
    same_as_generate(dir.path(), &server.url("/v1/completions"));
    // A prompt scored at every position (its 31 rows' logits in one pass): the same
    // log-probabilities as the CPU's.
    let cpu = Server::start(dir.path(), &["--parallel", "4"]);
    let scored = |server: &Server| -> Vec<f64> {
        let body = json!({"prompt": "To be, or not to be, that is th", "max_tokens": 0,
                          "echo": true, "logprobs": 2});
        let (status, body) = post(&server.url("/v1/completions"), &body.to_string());
        assert_eq!(status, 200, "{body}");
        body["choices"][0]["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()[1..]
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect()
    };
    let (emulated, want) = (scored(&server), scored(&cpu));
    assert_eq!(emulated.len(), 30);
    for (k, (a, b)) in emulated.iter().zip(&want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
            "token {k}: {a} vs {b}"
        );
    }
}

/// Each request writes one stderr line when its answer is over: method, path, status,
/// tokens in+out where the route decodes, milliseconds; a stream when it ends. No
/// body is logged.
#[test]
fn each_request_logs_one_line() {
    let dir = trained();
    let server = Server::start(dir.path(), &[]);
    // The line for `head` (method, path, status and what follows up to " ms").
    let line_for = |head: &str| -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let log = server.log.lock().unwrap().clone();
            if let Some(line) = log.lines().find(|l| l.starts_with(head)) {
                return line.to_string();
            }
            assert!(Instant::now() < deadline, "no line `{head}...` in:\n{log}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let ms = |line: &str| -> u64 {
        let rest = line.strip_suffix(" ms").unwrap_or_else(|| panic!("{line}"));
        rest.rsplit(' ').next().unwrap().parse().expect(line)
    };

    let (status, body) = post(
        &server.url("/v1/completions"),
        r#"{"prompt": "To be", "max_tokens": 6, "seed": 1}"#,
    );
    assert_eq!(status, 200, "{body}");
    let (p, c) = (
        body["usage"]["prompt_tokens"].as_u64().unwrap(),
        body["usage"]["completion_tokens"].as_u64().unwrap(),
    );
    let line = line_for("POST /v1/completions 200 ");
    assert!(
        line.starts_with(&format!("POST /v1/completions 200 {p}+{c} tokens ")),
        "{line}"
    );
    ms(&line);

    // A refusal: the status, no tokens, not the body.
    let (status, error) = post(
        &server.url("/v1/completions"),
        r#"{"prompt": "secret words", "temprature": 0.5}"#,
    );
    assert_eq!(status, 400, "{error}");
    let line = line_for("POST /v1/completions 400 ");
    assert!(!line.contains("tokens"), "{line}");
    ms(&line);
    let (status, _) = get(&server.url("/v1/nothing"), &[]);
    assert_eq!(status, 404);
    ms(&line_for("GET /v1/nothing 404 "));

    // A stream logs when it ends, with the tokens the usage chunk gives.
    let events = stream(
        &server.url("/v1/chat/completions"),
        &json!({"messages": [{"role": "user", "content": "Who is there?"}], "max_tokens": 5,
                "stream": true, "stream_options": {"include_usage": true}}),
    );
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    let usage = &usage["usage"];
    let line = line_for("POST /v1/chat/completions 200 ");
    assert!(
        line.starts_with(&format!(
            "POST /v1/chat/completions 200 {}+{} tokens ",
            usage["prompt_tokens"], usage["completion_tokens"]
        )),
        "{line}: {usage}"
    );
    ms(&line);

    let log = server.log.lock().unwrap().clone();
    assert!(!log.contains("secret"), "{log}");
    // One line each, nothing for requests not made.
    for head in [
        "POST /v1/completions 200",
        "POST /v1/completions 400",
        "GET /v1/nothing",
    ] {
        assert_eq!(
            log.lines().filter(|l| l.starts_with(head)).count(),
            1,
            "{log}"
        );
    }
}
