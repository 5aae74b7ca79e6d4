//! One stderr line per request, as llama-server and vLLM log them: method, path,
//! status, tokens in and out where the route knows them, and milliseconds, e.g.
//! `POST /v1/completions 200 12+16 tokens 48 ms`. The line is written when the
//! answer's body is over, so a stream logs when it ends (with `client left` when its
//! client went away first). No request body, query string or header is logged.

use std::fmt::Write as _;
use std::io::Write as _;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use hyper::body::{Frame, SizeHint};

/// The longest path written (a longer one is cut, with `...`).
const MAX_PATH: usize = 200;

/// A request's tokens, filled in by the route that decodes it (completions, chat) as
/// it learns them; the log reads it when the answer ends. Tokens out are counted when
/// every choice has finished; before (a client that left, a failure), `?`.
#[derive(Default)]
pub struct Tokens {
    known: AtomicBool,
    prompt: AtomicUsize,
    completion: AtomicUsize,
    finished: AtomicBool,
}

impl Tokens {
    pub fn new(prompt: usize) -> Arc<Self> {
        let tokens = Arc::new(Self::default());
        tokens.prompt.store(prompt, Ordering::Relaxed);
        tokens.known.store(true, Ordering::Relaxed);
        tokens
    }

    /// The tokens drawn so far; `finished`: every choice has finished.
    pub fn set_completion(&self, completion: usize, finished: bool) {
        self.completion.store(completion, Ordering::Relaxed);
        self.finished.store(finished, Ordering::Relaxed);
    }
}

/// Rides on a response's extensions from the route to the log.
#[derive(Clone)]
pub struct Logged(pub Arc<Tokens>);

/// The middleware: times the request and logs it when its answer's body is over.
pub async fn requests(request: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = request.method().clone();
    let path = request.uri().path();
    let path = match path.char_indices().nth(MAX_PATH) {
        Some((at, _)) => format!("{}...", &path[..at]),
        None => path.to_string(),
    };
    let response = next.run(request).await;
    let status = response.status();
    let tokens = response
        .extensions()
        .get::<Logged>()
        .map(|l| Arc::clone(&l.0));
    let stream = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let line = Line {
        started,
        head: format!("{method} {path}"),
        status,
        tokens,
        stream,
        ended: false,
    };
    response.map(|body| {
        Body::new(LoggedBody {
            inner: body,
            line: Some(line),
        })
    })
}

/// What the line says, but the time, which is taken when it is written.
struct Line {
    started: Instant,
    head: String,
    status: StatusCode,
    tokens: Option<Arc<Tokens>>,
    /// A server-sent event stream: says so when dropped before its end.
    stream: bool,
    ended: bool,
}

impl Line {
    fn text(&self) -> String {
        let mut line = format!("{} {}", self.head, self.status.as_u16());
        if let Some(tokens) = self
            .tokens
            .as_ref()
            .filter(|t| t.known.load(Ordering::Relaxed))
        {
            let _ = write!(line, " {}+", tokens.prompt.load(Ordering::Relaxed));
            if tokens.finished.load(Ordering::Relaxed) {
                let _ = write!(line, "{}", tokens.completion.load(Ordering::Relaxed));
            } else {
                line.push('?');
            }
            line.push_str(" tokens");
        }
        let _ = write!(line, " {} ms", self.started.elapsed().as_millis());
        if self.stream && !self.ended {
            line.push_str(" (client left)");
        }
        line
    }
}

impl Drop for Line {
    fn drop(&mut self) {
        let mut line = self.text();
        line.push('\n');
        // One write: lines of requests ending together do not interleave. A closed
        // stderr is no reason to fail a request.
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }
}

/// An answer's body that writes its request's line when it is over (or dropped).
struct LoggedBody {
    inner: Body,
    line: Option<Line>,
}

impl LoggedBody {
    fn end(&mut self) {
        if let Some(mut line) = self.line.take() {
            line.ended = true;
        }
    }
}

impl hyper::body::Body for LoggedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => this.end(),
            Poll::Ready(Some(Ok(_))) if this.inner.is_end_stream() => this.end(),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
