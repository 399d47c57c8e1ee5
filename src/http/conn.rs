//! Connections: the accept loop and what one connection may hold.
//!
//! axum's own `serve` has no read timeouts and no connection cap, so one
//! client could keep a connection (and what it reserved) forever. Here:
//!
//! - at most `--max-connections` are served at once; the next ones wait in
//!   the listen backlog;
//! - a request head must arrive within `--header-timeout-secs` (from the
//!   connection's start, or from the first byte of a later request);
//! - a keep-alive connection with no request in flight is closed after
//!   `--idle-timeout-secs`;
//! - a request body must keep up with `--body-min-rate` after a grace of
//!   `--body-timeout-secs` ([`TimedBody`]); a slower one fails the request, which
//!   is answered 408 and the connection closed;
//! - a request answered before its body was read to the end (refused
//!   early: unknown run, bad token) is answered with `Connection: close`,
//!   since hyper closes such a connection rather than read the rest: a
//!   client that reused it would find it closed under its next request.
//!
//! - a response must keep up with `--send-min-rate` once the client stops
//!   reading: the time the socket refuses bytes may not pass
//!   `--send-timeout-secs` plus one second per `--send-min-rate` bytes the
//!   response sent, else the connection is closed (a reader that never
//!   reads holds nothing for long);
//! - downloads (responses marked [`Download`]) give their connection's
//!   slot back and count against `--max-downloads` instead, closing the
//!   connection when done: downloads nobody reads never take the slots
//!   probes and control calls need; one past that budget is answered 503
//!   `too_many_downloads`.
//!
//! The head and idle clocks live in [`GuardedIo`], the socket wrapper: it
//! is what hyper polls while it waits for a head, and a request in flight
//! (counted by [`Activity`] from the handler's start to the end of its
//! response body) stops them.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::Router;
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::{Instant, Sleep};
use tower::ServiceExt;

use crate::config::ServeArgs;

/// The per-connection limits, from the command line.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub header: Duration,
    pub idle: Duration,
    pub body: Duration,
    /// Bytes per second that extend the body's deadline by one second.
    pub body_min_rate: u64,
    pub max_connections: usize,
    /// How long the socket may refuse a response's bytes beyond what
    /// `send_min_rate` earns.
    pub send: Duration,
    pub send_min_rate: u64,
    pub max_downloads: usize,
}

/// Marks a response as a download: its connection leaves the
/// `--max-connections` budget for `--max-downloads`.
#[derive(Debug, Clone, Copy)]
pub struct Download;

/// The gauges a listener keeps: connections served, downloads sent.
#[derive(Clone)]
pub struct ConnGauges {
    pub open: prometheus::IntGauge,
    pub downloads: prometheus::IntGauge,
}

impl ConnGauges {
    pub fn of(metrics: &crate::telemetry::Metrics) -> Self {
        ConnGauges {
            open: metrics.connections.clone(),
            downloads: metrics.downloads.clone(),
        }
    }
}

impl ConnLimits {
    pub fn from_args(args: &ServeArgs) -> Self {
        ConnLimits {
            header: Duration::from_secs(args.header_timeout_secs.max(1)),
            idle: Duration::from_secs(args.idle_timeout_secs.max(1)),
            body: Duration::from_secs(args.body_timeout_secs.max(1)),
            body_min_rate: args.body_min_rate.0.max(1),
            max_connections: args.max_connections.max(1),
            send: Duration::from_secs(args.send_timeout_secs.max(1)),
            send_min_rate: args.send_min_rate.0.max(1),
            max_downloads: args.max_downloads.unwrap_or(args.max_connections).max(1),
        }
    }
}

/// Serves `app` on `listener` until `shutdown` resolves; then stops
/// accepting and waits up to `drain` for the connections in flight.
/// `gauges` count the connections being served and the downloads.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    gauges: ConnGauges,
    shutdown: impl Future<Output = ()> + Send + 'static,
    drain: Duration,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let downloads = Arc::new(Semaphore::new(limits.max_downloads));
    let graceful = GracefulShutdown::new();
    let mut builder = Builder::new(TokioExecutor::new());
    // Our own clocks (GuardedIo) time the head; hyper's header timer would
    // also run while a keep-alive connection idles, merging the two limits.
    builder.http1().header_read_timeout(None);
    let mut shutdown = std::pin::pin!(shutdown);
    while let Some((slot, stream)) = next_connection(&listener, &slots, shutdown.as_mut()).await {
        let _ = stream.set_nodelay(true);
        let activity = Arc::new(Activity::new());
        let io = TokioIo::new(GuardedIo::new(stream, activity.clone(), limits));
        let app = app.clone();
        // The connection's slot, given back early when it turns into a
        // download.
        let slot = Arc::new(Mutex::new(Some(slot)));
        let budget = DownloadBudget {
            conn_slot: slot.clone(),
            downloads: downloads.clone(),
            gauge: gauges.downloads.clone(),
        };
        let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
            let guard = ActiveGuard::start(activity.clone());
            let http1 = req.version() <= http::Version::HTTP_11;
            // Set once the handler read the request body to its end (or
            // there was none).
            let read_out = Arc::new(AtomicBool::new(false));
            let req = req.map(|body| timed_body(body, limits, &read_out));
            answer(app.clone(), req, http1, read_out, guard, budget.clone())
        });
        let conn = builder.serve_connection_with_upgrades(io, service);
        let conn = graceful.watch(conn.into_owned());
        let open = gauges.open.clone();
        tokio::spawn(async move {
            open.inc();
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            open.dec();
            drop(slot);
        });
    }
    drop(listener);
    tracing::info!("shutting down: waiting for requests in flight");
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("requests still in flight after {drain:?}; stopping anyway");
    }
}

/// The next connection and its slot; `None` once `shutdown` resolved.
async fn next_connection(
    listener: &TcpListener,
    slots: &Arc<Semaphore>,
    mut shutdown: Pin<&mut impl Future<Output = ()>>,
) -> Option<(tokio::sync::OwnedSemaphorePermit, TcpStream)> {
    loop {
        // Wait for a free slot before accepting: past the cap, clients wait
        // in the kernel's backlog instead of being served half-way.
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => slot.ok()?,
            _ = &mut shutdown => return None,
        };
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => return Some((slot, stream)),
                Err(e) => {
                    // Out of descriptors and the like: back off instead of
                    // spinning.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = &mut shutdown => return None,
        }
    }
}

/// A request body under the body clock ([`TimedBody`]); `read_out` is set
/// once it is read to its end (at once when there is none).
fn timed_body(body: hyper::body::Incoming, limits: ConnLimits, read_out: &Arc<AtomicBool>) -> Body {
    let body = Body::new(body);
    if http_body::Body::is_end_stream(&body) {
        read_out.store(true, Ordering::Relaxed);
        body
    } else {
        Body::new(TimedBody::new(body, limits, read_out.clone()))
    }
}

/// What a connection's downloads draw on: the connection's own slot (given
/// back when it turns into a download) and the `--max-downloads` budget.
#[derive(Clone)]
struct DownloadBudget {
    conn_slot: Arc<Mutex<Option<tokio::sync::OwnedSemaphorePermit>>>,
    downloads: Arc<Semaphore>,
    gauge: prometheus::IntGauge,
}

/// Answers one request. It counts as in flight (`guard`) until its
/// response body is sent (downloads and event streams included).
async fn answer(
    app: Router,
    req: Request,
    http1: bool,
    read_out: Arc<AtomicBool>,
    guard: ActiveGuard,
    budget: DownloadBudget,
) -> Result<axum::response::Response, std::convert::Infallible> {
    let response = app.oneshot(req).await?;
    let (mut response, download) = if response.extensions().get::<Download>().is_some() {
        budget.admit(response, http1)
    } else {
        (response, None)
    };
    if http1 && !read_out.load(Ordering::Relaxed) {
        // Answered before its body was read (refused early): hyper closes
        // the connection rather than read the rest, so say so, and the
        // client does not send its next request on a connection about to
        // close.
        response.headers_mut().insert(
            http::header::CONNECTION,
            http::HeaderValue::from_static("close"),
        );
    }
    Ok(response.map(|body| {
        Body::new(GuardedBody {
            body,
            _guard: guard,
            _download: download,
        })
    }))
}

impl DownloadBudget {
    /// A download takes a download slot, or is answered 503 when none is
    /// free.
    fn admit(
        &self,
        mut response: axum::response::Response,
        http1: bool,
    ) -> (axum::response::Response, Option<DownloadSlot>) {
        let Ok(permit) = self.downloads.clone().try_acquire_owned() else {
            return (too_many_downloads(), None);
        };
        if http1 {
            // One request at a time on this connection: the download is
            // all it does from now on.
            self.conn_slot
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            response.headers_mut().insert(
                http::header::CONNECTION,
                http::HeaderValue::from_static("close"),
            );
        }
        self.gauge.inc();
        let slot = DownloadSlot {
            _permit: permit,
            gauge: self.gauge.clone(),
        };
        (response, Some(slot))
    }
}

/// What one connection is doing, shared by its socket wrapper and its
/// requests.
struct Activity {
    inner: Mutex<ActivityState>,
}

struct ActivityState {
    /// Requests whose response is not yet fully sent.
    in_flight: usize,
    /// When the connection last became idle (or was accepted).
    idle_since: Instant,
    /// When the first byte of the next request head arrived.
    head_started: Option<Instant>,
    /// No request has started on this connection yet.
    fresh: bool,
    /// Counts the times the connection went from idle to busy: the send
    /// clock starts over with each.
    busy_spells: u64,
    /// The task polling the socket, woken when the connection goes idle
    /// so that it arms the idle clock.
    reader: Option<Waker>,
}

impl Activity {
    fn new() -> Self {
        Activity {
            inner: Mutex::new(ActivityState {
                in_flight: 0,
                idle_since: Instant::now(),
                head_started: None,
                fresh: true,
                busy_spells: 0,
                reader: None,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ActivityState> {
        // A poisoned lock only means a panic elsewhere; the counters are
        // still meaningful.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// When the connection must be closed if nothing more arrives: `None`
    /// while a request is in flight (its body has its own clock).
    fn deadline(&self, limits: &ConnLimits) -> Option<Instant> {
        let s = self.lock();
        if s.in_flight > 0 {
            return None;
        }
        Some(match s.head_started {
            Some(at) => at + limits.header,
            None if s.fresh => s.idle_since + limits.header,
            None => s.idle_since + limits.idle,
        })
    }

    fn bytes_arrived(&self) {
        let mut s = self.lock();
        if s.in_flight == 0 && s.head_started.is_none() {
            s.head_started = Some(Instant::now());
        }
    }
}

/// Counts one request as in flight until dropped.
struct ActiveGuard(Arc<Activity>);

impl ActiveGuard {
    fn start(activity: Arc<Activity>) -> Self {
        {
            let mut s = activity.lock();
            if s.in_flight == 0 {
                s.busy_spells += 1;
            }
            s.in_flight += 1;
            s.fresh = false;
            s.head_started = None;
        }
        ActiveGuard(activity)
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        let reader = {
            let mut s = self.0.lock();
            s.in_flight = s.in_flight.saturating_sub(1);
            if s.in_flight > 0 {
                return;
            }
            s.idle_since = Instant::now();
            s.head_started = None;
            s.reader.take()
        };
        if let Some(w) = reader {
            w.wake();
        }
    }
}

/// The socket, with the head and idle clocks on its read side and the
/// send clock on its write side.
struct GuardedIo {
    io: TcpStream,
    activity: Arc<Activity>,
    limits: ConnLimits,
    timer: Option<(Instant, Pin<Box<Sleep>>)>,
    send: SendClock,
}

/// How long the socket has refused a busy spell's bytes, against what the
/// bytes it took earned (`--send-timeout-secs`, `--send-min-rate`).
#[derive(Default)]
struct SendClock {
    spell: u64,
    sent: u64,
    blocked: Duration,
    blocked_since: Option<Instant>,
    timer: Option<(Instant, Pin<Box<Sleep>>)>,
}

impl GuardedIo {
    fn new(io: TcpStream, activity: Arc<Activity>, limits: ConnLimits) -> Self {
        GuardedIo {
            io,
            activity,
            limits,
            timer: None,
            send: SendClock::default(),
        }
    }

    /// Counts a write's outcome on the send clock: `Err` once the socket
    /// has refused bytes for longer than the sent bytes allow.
    fn clock_write(
        &mut self,
        cx: &mut Context<'_>,
        out: Poll<std::io::Result<usize>>,
    ) -> Poll<std::io::Result<usize>> {
        let spell = self.activity.lock().busy_spells;
        let clock = &mut self.send;
        if clock.spell != spell {
            *clock = SendClock {
                spell,
                ..SendClock::default()
            };
        }
        match out {
            Poll::Ready(Ok(n)) => {
                if let Some(since) = clock.blocked_since.take() {
                    clock.blocked += since.elapsed();
                }
                clock.sent += n as u64;
                clock.timer = None;
                Poll::Ready(Ok(n))
            }
            Poll::Pending => {
                let now = Instant::now();
                let since = *clock.blocked_since.get_or_insert(now);
                let earned =
                    Duration::from_secs_f64(clock.sent as f64 / self.limits.send_min_rate as f64);
                let left = (self.limits.send + earned).saturating_sub(clock.blocked);
                let deadline = since + left;
                let stalled = || {
                    tracing::info!(
                        sent = clock.sent,
                        "a response was not read for too long; closing its connection"
                    );
                    Poll::Ready(Err(timed_out("response not read (send timeout)")))
                };
                match &mut clock.timer {
                    Some((at, sleep)) if *at == deadline => {
                        if sleep.as_mut().poll(cx).is_ready() {
                            return stalled();
                        }
                    }
                    _ => {
                        let mut sleep = Box::pin(tokio::time::sleep_until(deadline));
                        if sleep.as_mut().poll(cx).is_ready() {
                            return stalled();
                        }
                        clock.timer = Some((deadline, sleep));
                    }
                }
                Poll::Pending
            }
            other => other,
        }
    }
}

fn timed_out(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::TimedOut, what.to_string())
}

impl AsyncRead for GuardedIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.activity.bytes_arrived();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                this.activity.lock().reader = Some(cx.waker().clone());
                let Some(deadline) = this.activity.deadline(&this.limits) else {
                    this.timer = None;
                    return Poll::Pending;
                };
                match &mut this.timer {
                    Some((at, sleep)) if *at == deadline => {
                        if sleep.as_mut().poll(cx).is_ready() {
                            return Poll::Ready(Err(timed_out("connection idle or head too slow")));
                        }
                    }
                    _ => {
                        let mut sleep = Box::pin(tokio::time::sleep_until(deadline));
                        if sleep.as_mut().poll(cx).is_ready() {
                            return Poll::Ready(Err(timed_out("connection idle or head too slow")));
                        }
                        this.timer = Some((deadline, sleep));
                    }
                }
                Poll::Pending
            }
        }
    }
}

impl AsyncWrite for GuardedIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let out = Pin::new(&mut this.io).poll_write(cx, buf);
        this.clock_write(cx, out)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let out = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.clock_write(cx, out)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// A request body that fails once it falls behind the minimum rate: its
/// deadline is `start + body_timeout + received / body_min_rate`, the rule
/// Apache's `mod_reqtimeout` uses (a fixed gap timeout would let one byte
/// a second through forever).
pub struct TimedBody {
    inner: Body,
    limits: ConnLimits,
    started: Instant,
    received: u64,
    sleep: Pin<Box<Sleep>>,
    /// Set when the body has been read to its end.
    read_out: Arc<AtomicBool>,
}

/// The error a [`TimedBody`] ends with; the push and JSON readers turn it
/// into a 408.
#[derive(Debug, thiserror::Error)]
#[error(
    "the request body arrived too slowly: {received} bytes after {elapsed:.1} s \
     (at least {min_rate} bytes/s are needed after the first {grace} s)"
)]
pub struct BodyTimedOut {
    pub received: u64,
    pub elapsed: f64,
    pub min_rate: u64,
    pub grace: u64,
}

impl TimedBody {
    fn new(inner: Body, limits: ConnLimits, read_out: Arc<AtomicBool>) -> Self {
        let started = Instant::now();
        TimedBody {
            inner,
            limits,
            started,
            received: 0,
            sleep: Box::pin(tokio::time::sleep_until(started + limits.body)),
            read_out,
        }
    }

    fn deadline(&self) -> Instant {
        let earned =
            Duration::from_secs_f64(self.received as f64 / self.limits.body_min_rate as f64);
        self.started + self.limits.body + earned
    }
}

impl http_body::Body for TimedBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    self.received += data.len() as u64;
                    let deadline = self.deadline();
                    self.sleep.as_mut().reset(deadline);
                }
                if self.inner.is_end_stream() {
                    self.read_out.store(true, Ordering::Relaxed);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => {
                self.read_out.store(true, Ordering::Relaxed);
                Poll::Ready(None)
            }
            Poll::Pending => {
                if self.sleep.as_mut().poll(cx).is_ready() {
                    let err = BodyTimedOut {
                        received: self.received,
                        elapsed: self.started.elapsed().as_secs_f64(),
                        min_rate: self.limits.body_min_rate,
                        grace: self.limits.body.as_secs(),
                    };
                    tracing::info!("{err}; cutting the request");
                    return Poll::Ready(Some(Err(Box::new(err))));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Whether `err` (a body read error, at any depth) is a [`BodyTimedOut`].
pub fn is_body_timeout(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if e.is::<BodyTimedOut>() {
            return true;
        }
        cur = e.source();
    }
    false
}

/// A download's place in the `--max-downloads` budget, held until its
/// body is sent or dropped.
struct DownloadSlot {
    _permit: tokio::sync::OwnedSemaphorePermit,
    gauge: prometheus::IntGauge,
}

impl Drop for DownloadSlot {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// 503 `too_many_downloads`: every download slot is taken.
fn too_many_downloads() -> axum::response::Response {
    use axum::response::IntoResponse;
    let mut resp = super::error::ApiError::new(
        http::StatusCode::SERVICE_UNAVAILABLE,
        "too_many_downloads",
        "every download slot (--max-downloads) is taken; retry later",
    )
    .into_response();
    resp.headers_mut().insert(
        http::header::RETRY_AFTER,
        http::HeaderValue::from_static("1"),
    );
    resp
}

/// A response body that keeps its request counted as in flight (and a
/// download's slot taken).
struct GuardedBody {
    body: Body,
    _guard: ActiveGuard,
    _download: Option<DownloadSlot>,
}

impl http_body::Body for GuardedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
