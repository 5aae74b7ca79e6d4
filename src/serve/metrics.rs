//! The server's counters, written by the HTTP side and the decoding loop, read as
//! Prometheus text at `GET /metrics`.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How far back `tokens_per_second` looks.
const RATE_WINDOW: Duration = Duration::from_secs(5);

#[derive(Default)]
pub struct Metrics {
    /// Requests answered with an error status.
    pub requests_rejected: AtomicU64,
    /// Requests whose client went away before the end.
    pub cancelled: AtomicU64,
    pub failed: AtomicU64,
    pub completed: AtomicU64,
    /// Requests waiting for slots, and decoding.
    pub queued: AtomicUsize,
    pub running: AtomicUsize,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub passes: AtomicU64,
    pub pass_rows: AtomicU64,
    pub pass_micros: AtomicU64,
    /// (when, generated tokens by then) after each pass, over the last RATE_WINDOW.
    recent: Mutex<VecDeque<(Instant, u64)>>,
}

impl Metrics {
    pub fn record_pass(&self, rows: usize, took: Duration) {
        self.passes.fetch_add(1, Ordering::Relaxed);
        self.pass_rows.fetch_add(rows as u64, Ordering::Relaxed);
        self.pass_micros
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
        let now = Instant::now();
        let generated = self.generated_tokens.load(Ordering::Relaxed);
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        recent.push_back((now, generated));
        while recent
            .front()
            .is_some_and(|&(t, _)| now.duration_since(t) > RATE_WINDOW)
        {
            recent.pop_front();
        }
    }

    /// Tokens generated per second over the last few seconds (0 when idle).
    pub fn tokens_per_second(&self) -> f64 {
        let recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        match (recent.front(), recent.back()) {
            (Some(&(t0, n0)), Some(&(_, n1))) if now.duration_since(t0) <= RATE_WINDOW => {
                let span = now.duration_since(t0).as_secs_f64().max(1e-3);
                (n1 - n0) as f64 / span
            }
            _ => 0.0,
        }
    }

    /// The Prometheus text exposition format (version 0.0.4).
    pub fn render(&self, slots: usize) -> String {
        let mut out = String::new();
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut line = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(
                out,
                "# HELP tinygpt_{name} {help}\n# TYPE tinygpt_{name} {kind}\ntinygpt_{name} {value}"
            );
        };
        line(
            "requests_total",
            "counter",
            "Completion requests answered in full.",
            load(&self.completed).to_string(),
        );
        line(
            "requests_rejected_total",
            "counter",
            "Requests answered with an error status (4xx, 5xx).",
            load(&self.requests_rejected).to_string(),
        );
        line(
            "requests_cancelled_total",
            "counter",
            "Requests whose client went away before the end.",
            load(&self.cancelled).to_string(),
        );
        line(
            "requests_failed_total",
            "counter",
            "Requests ended by a decoding error.",
            load(&self.failed).to_string(),
        );
        line(
            "requests_queued",
            "gauge",
            "Requests waiting for a slot.",
            self.queued.load(Ordering::Relaxed).to_string(),
        );
        line(
            "requests_running",
            "gauge",
            "Requests decoding now.",
            self.running.load(Ordering::Relaxed).to_string(),
        );
        line(
            "slots",
            "gauge",
            "Sequences decoded at once (--parallel).",
            slots.to_string(),
        );
        line(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens read.",
            load(&self.prompt_tokens).to_string(),
        );
        line(
            "generated_tokens_total",
            "counter",
            "Tokens generated.",
            load(&self.generated_tokens).to_string(),
        );
        line(
            "tokens_per_second",
            "gauge",
            "Tokens generated per second over the last 5 seconds.",
            format!("{:.2}", self.tokens_per_second()),
        );
        line(
            "decode_passes_total",
            "counter",
            "Passes of the model (one token for every generating sequence).",
            load(&self.passes).to_string(),
        );
        line(
            "decode_rows_total",
            "counter",
            "Rows run in those passes (generated tokens and prompt positions).",
            load(&self.pass_rows).to_string(),
        );
        line(
            "decode_seconds_total",
            "counter",
            "Time spent in passes.",
            format!("{:.6}", load(&self.pass_micros) as f64 / 1e6),
        );
        out
    }
}
