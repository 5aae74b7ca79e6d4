//! Connections: the deadlines a request body must meet, and which connection gives way
//! when every one of `--max-connections` is taken.
//!
//! hyper bounds the headers (`--idle-timeout`, also between kept-alive requests); the
//! body is bounded here ([`Timed`]): it must end within `--idle-timeout` of its
//! headers, with no pause longer than [`GAP`] and, after its first [`GRACE`], at
//! least [`MIN_RATE`] bytes a second on average. A body that misses one is answered
//! 408 and its connection closed.
//!
//! When all connections are taken, a new one is not refused while another is only
//! waiting on its client (reading headers or a body, or idle between requests): the
//! one that has heard nothing from its client for longest is closed to make room
//! ([`Connections::admit`]). Connections being answered (a request read whole, its
//! answer running or streaming) are never closed for a newcomer; when every one is,
//! the newcomer is closed. So clients that hold connections without sending cannot
//! keep `/health` or anyone else out: each newcomer displaces one of them.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The longest pause between two pieces of a request body.
pub const GAP: Duration = Duration::from_secs(5);
/// How long a body may take before [`MIN_RATE`] applies.
pub const GRACE: Duration = Duration::from_secs(2);
/// The slowest a body may arrive after [`GRACE`], bytes a second on average.
pub const MIN_RATE: u64 = 1024;

/// The open connections.
pub struct Connections {
    max: usize,
    started: Instant,
    next_id: AtomicU64,
    open: Mutex<HashMap<u64, Arc<Conn>>>,
}

/// One connection, as the accept loop and the handlers see it.
pub struct Conn {
    /// Microseconds after the registry began when the client last sent something (or
    /// its last answer ended).
    heard: AtomicU64,
    /// Requests being answered (their answers not yet over).
    requests: AtomicUsize,
    /// Request bodies still arriving.
    bodies: AtomicUsize,
    close: tokio::sync::Notify,
    started: Instant,
}

impl Conn {
    fn hear(&self) {
        let us = self.started.elapsed().as_micros() as u64;
        self.heard.store(us, Ordering::Relaxed);
    }

    /// Whether the connection only waits on its client: nothing being answered, or a
    /// request whose body has not all come.
    fn waiting(&self) -> bool {
        self.requests.load(Ordering::Relaxed) == 0 || self.bodies.load(Ordering::Relaxed) > 0
    }

    /// Resolves when the connection is to be closed (displaced, or the server stops).
    pub async fn closed(&self) {
        self.close.notified().await;
    }
}

/// A registered connection; leaves the registry when dropped.
pub struct Admitted {
    id: u64,
    pub conn: Arc<Conn>,
    registry: Arc<Connections>,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.registry.lock().remove(&self.id);
    }
}

impl Connections {
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            max,
            started: Instant::now(),
            next_id: AtomicU64::new(0),
            open: Mutex::new(HashMap::new()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Conn>>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a new connection. When all are taken, the waiting connection that has
    /// heard from its client least recently is told to close and leaves the count; when
    /// none is waiting, None: the newcomer is to be closed.
    pub fn admit(self: &Arc<Self>) -> Option<Admitted> {
        let mut open = self.lock();
        if open.len() >= self.max {
            let victim = open
                .iter()
                .filter(|(_, c)| c.waiting())
                // The older connection first among equals.
                .min_by_key(|(&id, c)| (c.heard.load(Ordering::Relaxed), id))
                .map(|(&id, _)| id)?;
            if let Some(conn) = open.remove(&victim) {
                conn.close.notify_one();
            }
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            heard: AtomicU64::new(0),
            requests: AtomicUsize::new(0),
            bodies: AtomicUsize::new(0),
            close: tokio::sync::Notify::new(),
            started: self.started,
        });
        conn.hear();
        open.insert(id, Arc::clone(&conn));
        Some(Admitted {
            id,
            conn,
            registry: Arc::clone(self),
        })
    }

    /// Closes every connection that only waits on its client (at a stop: nothing of
    /// theirs would be answered).
    pub fn close_waiting(&self) {
        let mut open = self.lock();
        open.retain(|_, conn| {
            if conn.waiting() {
                conn.close.notify_one();
                false
            } else {
                true
            }
        });
    }
}

/// Counts a request as being answered until dropped (with its answer's body).
pub struct Answering(Arc<Conn>);

impl Answering {
    pub fn new(conn: &Arc<Conn>) -> Self {
        conn.hear();
        conn.requests.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(conn))
    }
}

impl Drop for Answering {
    fn drop(&mut self) {
        self.0.requests.fetch_sub(1, Ordering::Relaxed);
        self.0.hear();
    }
}

/// The deadlines a request body must meet.
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    pub total: Duration,
    pub gap: Duration,
    pub grace: Duration,
    pub min_rate: u64,
}

impl Deadlines {
    /// The server's: the whole body within `total` (--idle-timeout), [`GAP`],
    /// [`GRACE`], [`MIN_RATE`].
    pub fn new(total: Duration) -> Self {
        Self {
            total,
            gap: GAP.min(total),
            grace: GRACE,
            min_rate: MIN_RATE,
        }
    }
}

/// Why a body was cut off: answered 408.
#[derive(Debug)]
pub struct BodyTimeout(pub String);

impl std::fmt::Display for BodyTimeout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BodyTimeout {}

/// A request body held to [`Deadlines`].
pub struct Timed<B> {
    inner: B,
    /// Set while the body is still coming.
    conn: Option<Arc<Conn>>,
    deadlines: Deadlines,
    started: Instant,
    last: Instant,
    received: u64,
    timer: Pin<Box<Sleep>>,
}

impl<B: Body> Timed<B> {
    pub fn new(inner: B, conn: &Arc<Conn>, deadlines: Deadlines) -> Self {
        let now = Instant::now();
        let coming = !inner.is_end_stream();
        if coming {
            conn.bodies.fetch_add(1, Ordering::Relaxed);
        }
        let mut timed = Self {
            inner,
            conn: coming.then(|| Arc::clone(conn)),
            deadlines,
            started: now,
            last: now,
            received: 0,
            timer: Box::pin(tokio::time::sleep_until(now)),
        };
        let deadline = timed.deadline();
        timed.timer.as_mut().reset(deadline);
        timed
    }

    /// When the next piece must have come: the earliest of the whole body's deadline,
    /// the last piece plus the gap, and the time by which what has come meets the rate.
    fn deadline(&self) -> Instant {
        let d = &self.deadlines;
        let by_rate = self.started
            + d.grace
            + Duration::from_secs_f64(self.received as f64 / d.min_rate.max(1) as f64);
        (self.started + d.total).min(self.last + d.gap).min(by_rate)
    }

    fn ended(&mut self) {
        if let Some(conn) = self.conn.take() {
            conn.bodies.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn timeout(&self) -> BodyTimeout {
        let d = &self.deadlines;
        let waited = self.started.elapsed().as_secs_f64();
        BodyTimeout(format!(
            "the request body did not arrive in time ({} bytes in {waited:.1} s): a body must come whole within {} s, with no pause over {} s and at least {} bytes a second after its first {} s",
            self.received,
            d.total.as_secs_f64(),
            d.gap.as_secs_f64(),
            d.min_rate,
            d.grace.as_secs_f64(),
        ))
    }
}

impl<B> Drop for Timed<B> {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            conn.bodies.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl<B> Body for Timed<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if this.conn.is_none() && this.inner.is_end_stream() {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.received += data.len() as u64;
                }
                this.last = Instant::now();
                if let Some(conn) = &this.conn {
                    conn.hear();
                }
                if this.inner.is_end_stream() {
                    this.ended();
                } else {
                    let deadline = this.deadline();
                    this.timer.as_mut().reset(deadline);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                this.ended();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                this.ended();
                Poll::Ready(Some(Err(e.into())))
            }
            Poll::Pending if this.conn.is_none() => Poll::Pending,
            Poll::Pending => match this.timer.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    let error = this.timeout();
                    this.ended();
                    Poll::Ready(Some(Err(Box::new(error))))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// An answer's body that counts its request as answered until it is dropped.
pub struct Counted<B> {
    inner: B,
    _answering: Answering,
}

impl<B> Counted<B> {
    pub fn new(inner: B, answering: Answering) -> Self {
        Self {
            inner,
            _answering: answering,
        }
    }
}

impl<B: Body + Unpin> Body for Counted<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The service for one connection: each request's body held to `deadlines`, counted
/// while it is answered, then handed to `app`.
pub fn service(
    app: axum::Router,
    conn: Arc<Conn>,
    deadlines: Deadlines,
) -> impl hyper::service::Service<
    hyper::Request<hyper::body::Incoming>,
    Response = hyper::Response<Counted<axum::body::Body>>,
    Error = Infallible,
    Future = impl Future<Output = Result<hyper::Response<Counted<axum::body::Body>>, Infallible>> + Send,
> + Clone {
    let app = hyper_util::service::TowerToHyperService::new(app);
    hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
        let answering = Answering::new(&conn);
        let request = request.map(|body| Timed::new(body, &conn, deadlines));
        let call = hyper::service::Service::call(&app, request);
        async move {
            let response = call.await?;
            Ok(response.map(|body| Counted::new(body, answering)))
        }
    })
}
