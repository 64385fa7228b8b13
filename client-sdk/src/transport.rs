//! The data-plane transport seam. [`TcpTransport`] speaks the framed protocol of
//! `strata_common::frame` over pooled connections; [`UnixTransport`] speaks the same frames to
//! a sidecar worker's Unix socket. With the `testing` feature, `FaultyTransport` wraps any
//! transport and fails on demand, for tests.
//!
//! Both framed transports send many block ranges to one worker as one `ReadMany` request
//! ([`Transport::read_many`]) and read its answers one by one as they arrive; any other
//! transport reads them one after another, so the client's batched reads work over all.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::{BufMut, Bytes, BytesMut};
use futures::StreamExt;
use futures::stream::BoxStream;
use strata_common::ErrorKind;
use strata_common::frame::{RESPONSE_HEADER_LEN, ReadBlockRequest, ReadMany, ResponseHeader, Source};
use strata_security::tls::{ClientTls, ParkableSocket};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TransportError {
    #[error("cannot connect to {addr}: {source}")]
    Connect { addr: String, source: std::io::Error },
    #[error("connection to {addr} failed: {source}")]
    Io { addr: String, source: std::io::Error },
    #[error("{addr} timed out")]
    Timeout { addr: String },
    #[error("{addr} sent a malformed response: {reason}")]
    Protocol { addr: String, reason: String },
    #[error("{addr} answered {kind}: {message}")]
    Remote { addr: String, kind: ErrorKind, message: String },
    /// The TLS handshake failed, or a worker that speaks TLS refused a plain-text connection.
    #[error("TLS with {addr}: {source}")]
    Tls { addr: String, source: std::io::Error },
}

impl TransportError {
    /// Whether another worker may succeed where this one failed.
    pub fn try_next_worker(&self) -> bool {
        match self {
            // A worker at its connection limits refuses the connection: another has room.
            TransportError::Remote { kind: ErrorKind::ResourceExhausted, .. } => true,
            TransportError::Remote { kind, .. } => kind.is_temporary(),
            _ => true,
        }
    }
}

#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// Reads `req.len` bytes of one block from the worker at `addr`.
    async fn read_block(&self, addr: &str, req: &ReadBlockRequest)
    -> Result<(Bytes, Source), TransportError>;

    /// Reads `req.len` bytes of one block into `dst` (exactly that long). Transports that can
    /// receive straight into it do (TCP, Unix); the default reads a block and copies it.
    async fn read_block_into(
        &self,
        addr: &str,
        req: &ReadBlockRequest,
        dst: &mut [u8],
    ) -> Result<Source, TransportError> {
        let (bytes, source) = self.read_block(addr, req).await?;
        if bytes.len() != dst.len() {
            return Err(TransportError::Protocol {
                addr: addr.to_string(),
                reason: format!("{} bytes for a read of {}", bytes.len(), dst.len()),
            });
        }
        dst.copy_from_slice(&bytes);
        Ok(source)
    }

    /// Whether [`read_many`](Self::read_many) asks for many ranges in one round trip (the
    /// framed transports) rather than one after another (the default); the client batches
    /// reads only through a transport that does.
    fn batches_reads(&self) -> bool {
        false
    }

    /// Reads many block ranges from the worker at `addr`: the answers, in the order of
    /// `reqs`, each as [`read_block`](Self::read_block) answers it, as they arrive. The stream
    /// may end early after an error that broke the connection; the requests it did not answer
    /// were not served, and the caller asks elsewhere. A framed transport sends them as one
    /// `ReadMany`, so `reqs` must keep within its limits (`ReadMany::fits`); the default reads
    /// them one after another.
    fn read_many<'a>(
        &'a self,
        addr: &'a str,
        reqs: &'a [ReadBlockRequest],
    ) -> BoxStream<'a, Result<(Bytes, Source), TransportError>> {
        futures::stream::iter(reqs).then(move |req| self.read_block(addr, req)).boxed()
    }
}

/// The request id of a worker's answer to a frame it could not parse.
const REJECTED_REQ_ID: u64 = 0;

/// Where a response's payload goes: a new buffer, or the caller's.
pub(crate) enum Sink<'a> {
    New,
    Into(&'a mut [u8]),
}

impl Sink<'_> {
    /// One block read through `transport`: its bytes for `New`, `None` once they are in place.
    pub(crate) async fn read(
        &mut self,
        transport: &dyn Transport,
        addr: &str,
        req: &ReadBlockRequest,
    ) -> Result<Option<Bytes>, TransportError> {
        match self {
            Sink::New => transport.read_block(addr, req).await.map(|(bytes, _)| Some(bytes)),
            Sink::Into(dst) => transport.read_block_into(addr, req, dst).await.map(|_| None),
        }
    }

    /// Bytes that arrived another way (exactly the sink's length for `Into`), passed on.
    pub(crate) fn deliver(&mut self, bytes: Bytes) -> Option<Bytes> {
        match self {
            Sink::New => Some(bytes),
            Sink::Into(dst) => {
                dst.copy_from_slice(&bytes);
                None
            }
        }
    }
}

/// Framed TCP with a small pool of idle connections per worker.
pub struct TcpTransport {
    pool: TcpPool,
    request_timeout: Duration,
    next_req_id: AtomicU64,
}

/// Idle data-plane connections per worker.
pub(crate) struct TcpPool {
    idle: Mutex<HashMap<String, Vec<DataStream>>>,
    dial: Dial,
    max_idle_per_worker: usize,
}

impl TcpPool {
    pub(crate) fn new(dial: impl Into<Dial>) -> Self {
        Self { idle: Mutex::new(HashMap::new()), dial: dial.into(), max_idle_per_worker: 64 }
    }

    /// An idle connection to `addr`, or a new one.
    pub(crate) async fn checkout(&self, addr: &str) -> Result<DataStream, TransportError> {
        loop {
            let pooled = self.idle.lock().unwrap_or_else(|p| p.into_inner()).get_mut(addr).and_then(Vec::pop);
            match pooled {
                Some(stream) if stream.is_stale() => continue,
                Some(stream) => return Ok(stream),
                None => return connect_tcp(addr, &self.dial).await,
            }
        }
    }

    /// Keeps a connection that is in sync (a whole exchange done, nothing pending).
    pub(crate) fn checkin(&self, addr: &str, stream: DataStream) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let pool = idle.entry(addr.to_string()).or_default();
        if pool.len() < self.max_idle_per_worker {
            pool.push(stream);
        }
    }
}

impl TcpTransport {
    /// `dial`: how connections are made (a `Duration` is plain TCP with that connect timeout).
    pub fn new(dial: impl Into<Dial>, request_timeout: Duration) -> Self {
        Self { pool: TcpPool::new(dial), request_timeout, next_req_id: AtomicU64::new(1) }
    }
}

/// How data-plane connections to workers are made: the connect deadline; when the cluster
/// speaks TLS, the handshake (within its own deadline) before the connection is used; and the
/// token presented first on every connection.
#[derive(Debug, Clone)]
pub struct Dial {
    pub connect_timeout: Duration,
    pub tls: Option<ClientTls>,
    pub credentials: Credentials,
}

/// Plain TCP with this connect timeout, no token.
impl From<Duration> for Dial {
    fn from(connect_timeout: Duration) -> Self {
        Self { connect_timeout, tls: None, credentials: Credentials::none() }
    }
}

/// Who a new data-plane connection says it is: the `Auth` frame sent before anything else, when
/// the client has a token, and the `Class` frame of its request class. Cheap to clone.
#[derive(Clone, Default)]
pub struct Credentials {
    token: Option<Arc<str>>,
    class: strata_common::QosClass,
    /// The frames a new connection opens with, in one buffer so they leave in one write.
    opening: Option<Arc<[u8]>>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token.
        f.write_str(if self.token.is_some() { "Credentials(token)" } else { "Credentials(none)" })
    }
}

impl Credentials {
    /// No token: for a cluster with authentication off.
    pub fn none() -> Self {
        Self::default()
    }

    /// Presenting `token` (`None`: [`none`](Self::none)).
    pub fn token(token: Option<&str>) -> Self {
        Self { token: token.map(Arc::from), ..Self::default() }.framed()
    }

    /// Declaring `class` for every request on the connection (the default class needs no frame).
    pub fn with_class(self, class: strata_common::QosClass) -> Self {
        Self { class, ..self }.framed()
    }

    fn framed(self) -> Self {
        let mut opening = self.token.as_deref().map(strata_common::frame::auth_request).unwrap_or_default();
        if self.class != strata_common::QosClass::default() {
            opening.extend_from_slice(&strata_common::frame::class_request(self.class));
        }
        Self { opening: (!opening.is_empty()).then(|| Arc::from(opening)), ..self }
    }

    /// Sends the `Auth` and `Class` frames on a new connection. Not answered when accepted: a
    /// refusal comes back as the answer to the first request (an error frame for request 0), so
    /// a connection costs no extra round trip. (Flushed by the first request, which follows at
    /// once.)
    pub(crate) async fn present<S: AsyncWrite + Unpin>(
        &self,
        stream: &mut S,
        addr: &str,
    ) -> Result<(), TransportError> {
        if let Some(frames) = &self.opening {
            stream
                .write_all(frames)
                .await
                .map_err(|source| TransportError::Io { addr: addr.to_string(), source })?;
        }
        Ok(())
    }
}

/// A data-plane connection to a worker: plain TCP, or TLS over it. (The TLS state is boxed:
/// it is large, and a plain connection should not carry its size around.)
pub enum DataStream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<ParkableSocket>>),
}

/// A [`DataStream`] detached from its runtime (see [`DataStream::park`]).
pub(crate) enum ParkedStream {
    Plain(std::net::TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<ParkableSocket>>),
}

impl DataStream {
    /// Whether a pooled connection can no longer carry a request: the worker closed it while
    /// it sat idle (its idle timeout, a restart) or sent bytes nobody asked for.
    pub(crate) fn is_stale(&self) -> bool {
        let tcp = match self {
            DataStream::Plain(s) => Some(s),
            DataStream::Tls(s) => s.get_ref().0.live(),
        };
        tcp.is_none_or(|s| closed_or_unsolicited(s.as_fd()))
    }

    /// Detaches the connection from the current runtime (which may then shut down) and keeps
    /// its TLS session, for [`ParkedStream::attach`] in another. Only between exchanges: no
    /// bytes pending either way.
    pub(crate) fn park(self) -> std::io::Result<ParkedStream> {
        match self {
            DataStream::Plain(s) => Ok(ParkedStream::Plain(s.into_std()?)),
            DataStream::Tls(mut s) => {
                s.get_mut().0.park()?;
                Ok(ParkedStream::Tls(s))
            }
        }
    }
}

impl ParkedStream {
    /// Attaches the connection to the runtime this runs in.
    pub(crate) fn attach(self) -> std::io::Result<DataStream> {
        match self {
            ParkedStream::Plain(s) => Ok(DataStream::Plain(TcpStream::from_std(s)?)),
            ParkedStream::Tls(mut s) => {
                s.get_mut().0.attach()?;
                Ok(DataStream::Tls(s))
            }
        }
    }
}

macro_rules! delegate {
    ($self:ident, $s:ident => $e:expr) => {
        match $self.get_mut() {
            DataStream::Plain($s) => {
                let $s = std::pin::Pin::new($s);
                $e
            }
            DataStream::Tls($s) => {
                let $s = std::pin::Pin::new($s.as_mut());
                $e
            }
        }
    };
}

impl AsyncRead for DataStream {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        // rustls may hold back part of a request's ciphertext when the socket was full: out
        // with it before waiting for the answer (callers flush too; this makes it certain).
        if let DataStream::Tls(s) = &mut *self
            && s.get_ref().1.wants_write()
        {
            std::task::ready!(std::pin::Pin::new(s.as_mut()).poll_flush(cx))?;
        }
        delegate!(self, s => s.poll_read(cx, buf))
    }
}

impl AsyncWrite for DataStream {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        delegate!(self, s => s.poll_write(cx, buf))
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        delegate!(self, s => s.poll_flush(cx))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        delegate!(self, s => s.poll_shutdown(cx))
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        delegate!(self, s => s.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            DataStream::Plain(s) => s.is_write_vectored(),
            DataStream::Tls(s) => s.is_write_vectored(),
        }
    }
}

/// A new data-plane connection to a worker, with Nagle off (requests are small and answered at
/// once), and the TLS handshake done when `dial` says TLS.
pub(crate) async fn connect_tcp(addr: &str, dial: &Dial) -> Result<DataStream, TransportError> {
    let stream = tokio::time::timeout(dial.connect_timeout, TcpStream::connect(addr))
        .await
        .map_err(|_| TransportError::Timeout { addr: addr.to_string() })?
        .map_err(|source| TransportError::Connect { addr: addr.to_string(), source })?;
    stream.set_nodelay(true).map_err(|source| TransportError::Connect { addr: addr.to_string(), source })?;
    let mut stream = match &dial.tls {
        None => DataStream::Plain(stream),
        Some(tls) => match tls.connect(addr, ParkableSocket::new(stream)).await {
            Ok(stream) => DataStream::Tls(Box::new(stream)),
            Err(source) => return Err(TransportError::Tls { addr: addr.to_string(), source }),
        },
    };
    if let Err(e) = dial.credentials.present(&mut stream, addr).await {
        let source = match e {
            TransportError::Io { source, .. } => source,
            other => return Err(other),
        };
        return Err(why_write_failed(&mut stream, addr, source).await);
    }
    Ok(stream)
}

/// Why a connection to the server at `addr` fails when TLS is the cause, probed on a new
/// connection (only after a failure: gRPC reports a TLS mismatch as a bare transport error). A
/// plain client: the server answers a request with a TLS alert. A TLS client: the handshake
/// fails, or the server sends an alert right after it (a client certificate it refuses, under
/// TLS 1.3). `None` when nothing TLS-specific shows within a second.
pub(crate) async fn tls_diagnosis(addr: &str, dial: &Dial) -> Option<String> {
    const WAIT: Duration = Duration::from_secs(1);
    let probe = async {
        let mut stream = match connect_tcp(addr, dial).await {
            Err(e @ TransportError::Tls { .. }) => return Some(e.to_string()),
            Err(_) => return None,
            Ok(stream) => stream,
        };
        let mut buf = [0u8; 8];
        match &dial.tls {
            Some(_) => match tokio::time::timeout(WAIT, stream.read(&mut buf)).await {
                Ok(Err(e)) => Some(format!("TLS with {addr}: {e}")),
                _ => None,
            },
            None => {
                // The start of an HTTP/2 connection, as gRPC would send it.
                stream.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.ok()?;
                let n = tokio::time::timeout(WAIT, stream.read(&mut buf)).await.ok()?.ok()?;
                (n >= 2 && buf[0] == 0x15 && buf[1] == 0x03)
                    .then(|| format!("{addr} answered with a TLS alert: it requires TLS (set STRATA_TLS_CA)"))
            }
        }
    };
    tokio::time::timeout(dial.connect_timeout + 2 * WAIT, probe).await.ok().flatten()
}

/// Reads a response header. A worker that speaks TLS answers a plain-text request with a TLS
/// alert record (`0x15 0x03 …`) and closes: said as such, not as a malformed response.
pub(crate) async fn read_head<S: AsyncRead + Unpin>(
    stream: &mut S,
    addr: &str,
    head: &mut [u8; RESPONSE_HEADER_LEN],
) -> Result<(), TransportError> {
    let io = |source| TransportError::Io { addr: addr.to_string(), source };
    let mut got = 0;
    while got < head.len() {
        match stream.read(&mut head[got..]).await {
            Ok(0) if got >= 2 && head[0] == 0x15 && head[1] == 0x03 => {
                return Err(TransportError::Tls {
                    addr: addr.to_string(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        "the worker answered with a TLS alert: it requires TLS (set STRATA_TLS_CA)",
                    ),
                });
            }
            Ok(0) => return Err(io(std::io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) => return Err(io(e)),
        }
    }
    Ok(())
}

/// One request and its response on a connection that is in sync (no bytes pending); the
/// payload lands in `sink` (`None` returned for `Sink::Into`).
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    addr: &str,
    req: &ReadBlockRequest,
    sink: Sink<'_>,
) -> Result<(Option<Bytes>, Source), TransportError> {
    let sent = async {
        stream.write_all(&req.encode()).await?;
        // A no-op on plain TCP; TLS may hold back the record otherwise.
        stream.flush().await
    };
    if let Err(e) = sent.await {
        return Err(why_write_failed(stream, addr, e).await);
    }
    read_response(stream, addr, req.req_id, req.len, sink).await
}

/// The error of a write that failed because the server closed the connection: the reason it
/// gave before closing when there is one to read — a TLS alert (a client certificate it
/// refused), an error frame (a refused token, its connection limits) — rather than "broken
/// pipe". Looked for briefly; `e` when nothing explains it.
pub(crate) async fn why_write_failed<S: AsyncRead + Unpin>(
    stream: &mut S,
    addr: &str,
    e: std::io::Error,
) -> TransportError {
    let fallback = || TransportError::Io { addr: addr.to_string(), source: e };
    let mut head = [0u8; RESPONSE_HEADER_LEN];
    let read = tokio::time::timeout(Duration::from_millis(200), read_head(stream, addr, &mut head)).await;
    match read {
        Ok(Err(tls @ TransportError::Tls { .. })) => tls,
        // A TLS stream reports the server's alert as the read's error.
        Ok(Err(TransportError::Io { source, .. })) if source.kind() == std::io::ErrorKind::InvalidData => {
            TransportError::Tls { addr: addr.to_string(), source }
        }
        Ok(Ok(())) => match ResponseHeader::decode(&head) {
            Ok(ResponseHeader { status: Err(kind), payload_len, .. }) => {
                let mut message =
                    vec![0u8; payload_len.min(strata_common::frame::MAX_ERROR_MESSAGE as u64) as usize];
                match tokio::time::timeout(Duration::from_millis(200), stream.read_exact(&mut message)).await
                {
                    Ok(Ok(_)) => TransportError::Remote {
                        addr: addr.to_string(),
                        kind,
                        message: String::from_utf8_lossy(&message).into_owned(),
                    },
                    _ => fallback(),
                }
            }
            _ => fallback(),
        },
        _ => fallback(),
    }
}

/// Reads the response to request `req_id`: a success must carry `expected` payload bytes,
/// which land in `sink` (`None` returned for `Sink::Into`); an error frame becomes
/// [`TransportError::Remote`] with the kind it carries. An error frame for request 0 answers
/// this request too: a worker that cannot parse a frame never learns its id and rejects it as
/// `BadFrame` under id 0 (client ids start at 1).
pub(crate) async fn read_response<S: AsyncRead + Unpin>(
    stream: &mut S,
    addr: &str,
    req_id: u64,
    expected: u64,
    sink: Sink<'_>,
) -> Result<(Option<Bytes>, Source), TransportError> {
    let io = |source| TransportError::Io { addr: addr.to_string(), source };
    let protocol = |reason: String| TransportError::Protocol { addr: addr.to_string(), reason };
    let mut head = [0u8; RESPONSE_HEADER_LEN];
    read_head(stream, addr, &mut head).await?;
    let head = ResponseHeader::decode(&head).map_err(|e| protocol(e.to_string()))?;
    let want = match head.status {
        Ok(_) => expected,
        Err(_) => head.payload_len.min(strata_common::frame::MAX_ERROR_MESSAGE as u64),
    };
    let ours = head.req_id == req_id || (head.req_id == REJECTED_REQ_ID && head.status.is_err());
    if !ours || head.payload_len != want {
        return Err(protocol(format!(
            "response {}/{} bytes for request {req_id}/{expected}",
            head.req_id, head.payload_len
        )));
    }
    let want = want as usize;
    if let (Ok(source), Sink::Into(dst)) = (head.status, sink) {
        if dst.len() != want {
            return Err(protocol(format!("a buffer of {} bytes for a read of {want}", dst.len())));
        }
        stream.read_exact(dst).await.map_err(io)?;
        return Ok((None, source));
    }
    // Filled straight from the socket: no zeroing pass over a multi-MiB block first.
    let mut buf = BytesMut::with_capacity(want);
    while buf.len() < want {
        let left = want - buf.len();
        if stream.read_buf(&mut (&mut buf).limit(left)).await.map_err(io)? == 0 {
            return Err(io(std::io::ErrorKind::UnexpectedEof.into()));
        }
    }
    match head.status {
        Ok(source) => Ok((Some(buf.freeze()), source)),
        Err(kind) => Err(TransportError::Remote {
            addr: addr.to_string(),
            kind,
            message: String::from_utf8_lossy(&buf).into_owned(),
        }),
    }
}

/// A pool of idle framed connections ([`TcpTransport`], [`UnixTransport`]).
trait Pool: Send + Sync {
    type Stream: AsyncRead + AsyncWrite + Unpin + Send;
    /// An idle connection to `addr`, or a new one.
    fn checkout(&self, addr: &str) -> impl Future<Output = Result<Self::Stream, TransportError>> + Send;
    /// Keeps a connection that is in sync for the next request.
    fn checkin(&self, addr: &str, stream: Self::Stream);
    fn next_req_id(&self) -> u64;
    fn request_timeout(&self) -> Duration;
}

/// One request on a pooled connection, under the request timeout.
async fn pooled_call<P: Pool>(
    pool: &P,
    addr: &str,
    req: &ReadBlockRequest,
    sink: Sink<'_>,
) -> Result<(Option<Bytes>, Source), TransportError> {
    let mut req = req.clone();
    req.req_id = pool.next_req_id();
    let mut stream = pool.checkout(addr).await?;
    let result = tokio::time::timeout(pool.request_timeout(), exchange(&mut stream, addr, &req, sink))
        .await
        .unwrap_or_else(|_| Err(TransportError::Timeout { addr: addr.to_string() }));
    // Only a connection that completed a whole exchange is known to be in sync.
    if reusable(&result) {
        pool.checkin(addr, stream);
    }
    result
}

/// Many reads as one `ReadMany` on a pooled connection: the request goes out when the stream
/// is first polled, and each poll reads the next answer (under the request timeout). An item's
/// error frame leaves the connection in step and the stream goes on; any other failure (or a
/// rejection of the whole frame, under request id 0) ends it. The connection goes back to the
/// pool once every answer was read; a stream dropped before that drops it (it is out of step).
fn pooled_many<'a, P: Pool>(
    pool: &'a P,
    addr: &'a str,
    reqs: &'a [ReadBlockRequest],
) -> BoxStream<'a, Result<(Bytes, Source), TransportError>> {
    struct State<S> {
        stream: Option<S>,
        ids: Vec<u64>,
        next: usize,
    }
    let ids: Vec<u64> = reqs.iter().map(|_| pool.next_req_id()).collect();
    let first = State { stream: None, ids, next: 0 };
    futures::stream::unfold(Some(first), move |state| async move {
        let mut state = state?;
        let req = reqs.get(state.next)?;
        let timeout = pool.request_timeout();
        let timed_out = || TransportError::Timeout { addr: addr.to_string() };
        if state.stream.is_none() {
            let items = reqs
                .iter()
                .zip(&state.ids)
                .map(|(req, &req_id)| ReadBlockRequest { req_id, ..req.clone() })
                .collect();
            let frame = ReadMany { items }.encode();
            let sent = async {
                let mut stream = pool.checkout(addr).await?;
                let written = async {
                    stream.write_all(&frame).await?;
                    stream.flush().await
                };
                match written.await {
                    Ok(()) => Ok(stream),
                    Err(e) => Err(why_write_failed(&mut stream, addr, e).await),
                }
            };
            match tokio::time::timeout(timeout, sent).await {
                Ok(Ok(stream)) => state.stream = Some(stream),
                Ok(Err(e)) => return Some((Err(e), None)),
                Err(_) => return Some((Err(timed_out()), None)),
            }
        }
        let stream = state.stream.as_mut().expect("sent above");
        let read = read_response(stream, addr, state.ids[state.next], req.len, Sink::New);
        let answer = match tokio::time::timeout(timeout, read).await {
            Ok(answer) => answer.map(|(bytes, source)| (bytes.unwrap_or_default(), source)),
            Err(_) => Err(timed_out()),
        };
        state.next += 1;
        if !reusable(&answer) {
            return Some((answer, None));
        }
        if state.next == reqs.len() {
            // Every answer read: in step for the next request, whether or not we are polled again.
            pool.checkin(addr, state.stream.take().expect("sent above"));
            return Some((answer, None));
        }
        Some((answer, Some(state)))
    })
    .boxed()
}

/// Whether a connection can be reused after an exchange ended with `result`: only one that
/// completed a whole exchange is known to be in sync, and not one the worker closes after
/// saying why: a refused token, a frame rejected as bad, its connection limits.
pub(crate) fn reusable<T>(result: &Result<T, TransportError>) -> bool {
    match result {
        Ok(_) => true,
        Err(TransportError::Remote { kind, .. }) => !matches!(
            kind,
            ErrorKind::BadFrame
                | ErrorKind::Unauthenticated
                | ErrorKind::Unavailable
                | ErrorKind::ResourceExhausted
        ),
        Err(_) => false,
    }
}

/// The [`Transport`] of a framed [`Pool`].
macro_rules! pooled_transport {
    ($pool:ty) => {
        #[async_trait]
        impl Transport for $pool {
            async fn read_block(
                &self,
                addr: &str,
                req: &ReadBlockRequest,
            ) -> Result<(Bytes, Source), TransportError> {
                let (bytes, source) = pooled_call(self, addr, req, Sink::New).await?;
                Ok((bytes.unwrap_or_default(), source))
            }

            async fn read_block_into(
                &self,
                addr: &str,
                req: &ReadBlockRequest,
                dst: &mut [u8],
            ) -> Result<Source, TransportError> {
                pooled_call(self, addr, req, Sink::Into(dst)).await.map(|(_, source)| source)
            }

            fn batches_reads(&self) -> bool {
                true
            }

            fn read_many<'a>(
                &'a self,
                addr: &'a str,
                reqs: &'a [ReadBlockRequest],
            ) -> BoxStream<'a, Result<(Bytes, Source), TransportError>> {
                pooled_many(self, addr, reqs)
            }
        }
    };
}

impl Pool for TcpTransport {
    type Stream = DataStream;

    async fn checkout(&self, addr: &str) -> Result<DataStream, TransportError> {
        self.pool.checkout(addr).await
    }

    fn checkin(&self, addr: &str, stream: DataStream) {
        self.pool.checkin(addr, stream)
    }

    fn next_req_id(&self) -> u64 {
        self.next_req_id.fetch_add(1, Ordering::Relaxed)
    }

    fn request_timeout(&self) -> Duration {
        self.request_timeout
    }
}

pooled_transport!(TcpTransport);

/// The framed protocol over a Unix socket, to the sidecar worker of this pod; `addr` is the
/// socket's path. Keeps a few idle connections, like [`TcpTransport`].
pub struct UnixTransport {
    idle: Mutex<Vec<UnixStream>>,
    connect_timeout: Duration,
    request_timeout: Duration,
    max_idle: usize,
    next_req_id: AtomicU64,
    credentials: Credentials,
}

impl UnixTransport {
    /// Without a token (a cluster with authentication off).
    pub fn new(connect_timeout: Duration, request_timeout: Duration) -> Self {
        Self::with_credentials(connect_timeout, request_timeout, Credentials::none())
    }

    /// Presenting `credentials` on every new connection.
    pub fn with_credentials(
        connect_timeout: Duration,
        request_timeout: Duration,
        credentials: Credentials,
    ) -> Self {
        Self {
            idle: Mutex::new(Vec::new()),
            connect_timeout,
            request_timeout,
            max_idle: 64,
            next_req_id: AtomicU64::new(1),
            credentials,
        }
    }
}

impl Pool for UnixTransport {
    type Stream = UnixStream;

    async fn checkout(&self, addr: &str) -> Result<UnixStream, TransportError> {
        loop {
            match self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop() {
                Some(stream) if closed_or_unsolicited(stream.as_fd()) => continue,
                Some(stream) => return Ok(stream),
                None => break,
            }
        }
        connect_unix(addr, self.connect_timeout, &self.credentials).await
    }

    fn checkin(&self, _addr: &str, stream: UnixStream) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < self.max_idle {
            idle.push(stream);
        }
    }

    fn next_req_id(&self) -> u64 {
        self.next_req_id.fetch_add(1, Ordering::Relaxed)
    }

    fn request_timeout(&self) -> Duration {
        self.request_timeout
    }
}

pooled_transport!(UnixTransport);

/// A new connection to a worker's Unix socket at `path`.
/// Whether an idle socket has been closed by its peer or holds bytes nobody asked for: a
/// non-blocking peek, which consumes nothing. A pooled connection in either state is dropped
/// rather than used (the first request on it would fail, and be retried elsewhere).
pub(crate) fn closed_or_unsolicited(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    use std::os::fd::AsRawFd;
    let mut byte = 0u8;
    // SAFETY: `fd` is an open socket borrowed for the call; the buffer is one valid byte.
    let n =
        unsafe { libc::recv(fd.as_raw_fd(), (&raw mut byte).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    if n < 0 {
        let err = std::io::Error::last_os_error();
        return err.kind() != std::io::ErrorKind::WouldBlock;
    }
    true
}

/// A new connection to a worker's Unix socket at `path` that has presented `credentials`.
pub(crate) async fn connect_unix(
    path: &str,
    timeout: Duration,
    credentials: &Credentials,
) -> Result<UnixStream, TransportError> {
    let mut stream = tokio::time::timeout(timeout, UnixStream::connect(path))
        .await
        .map_err(|_| TransportError::Timeout { addr: path.to_string() })?
        .map_err(|source| TransportError::Connect { addr: path.to_string(), source })?;
    credentials.present(&mut stream, path).await?;
    Ok(stream)
}

/// How a metadata request reaches a worker: its TCP data port or a sidecar's Unix socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Via {
    Tcp,
    Unix,
}

/// One metadata request (`View`, `Stat`) on a new connection — these are rare, asked only
/// while the master is unreachable — and the answer's payload (at most `max` bytes), or the
/// worker's error with the exact kind it sent.
pub(crate) async fn ask(
    via: Via,
    addr: &str,
    frame: &[u8],
    req_id: u64,
    max: u64,
    dial: &Dial,
    request_timeout: Duration,
) -> Result<Bytes, TransportError> {
    let exchange = async {
        match via {
            Via::Tcp => ask_on(&mut connect_tcp(addr, dial).await?, addr, frame, req_id, max).await,
            Via::Unix => {
                let mut stream = connect_unix(addr, dial.connect_timeout, &dial.credentials).await?;
                ask_on(&mut stream, addr, frame, req_id, max).await
            }
        }
    };
    tokio::time::timeout(request_timeout, exchange)
        .await
        .unwrap_or_else(|_| Err(TransportError::Timeout { addr: addr.to_string() }))
}

/// [`ask`] on a connection from `pool` (kept for the next ask when the exchange left it in
/// sync): what workers ask each other for blocks (`PeerRead`, `PeerFetch`) often enough that a
/// connection (and a TLS handshake) per ask would cost more than the answer.
pub(crate) async fn ask_pooled(
    pool: &TcpPool,
    addr: &str,
    frame: &[u8],
    req_id: u64,
    max: u64,
    request_timeout: Duration,
) -> Result<Bytes, TransportError> {
    let exchange = async {
        let mut stream = pool.checkout(addr).await?;
        let answer = ask_on(&mut stream, addr, frame, req_id, max).await;
        if reusable(&answer) {
            pool.checkin(addr, stream);
        }
        answer
    };
    tokio::time::timeout(request_timeout, exchange)
        .await
        .unwrap_or_else(|_| Err(TransportError::Timeout { addr: addr.to_string() }))
}

async fn ask_on<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    addr: &str,
    frame: &[u8],
    req_id: u64,
    max: u64,
) -> Result<Bytes, TransportError> {
    let io = |source| TransportError::Io { addr: addr.to_string(), source };
    stream.write_all(frame).await.map_err(io)?;
    stream.flush().await.map_err(io)?;
    let mut head = [0u8; RESPONSE_HEADER_LEN];
    read_head(stream, addr, &mut head).await?;
    let head = ResponseHeader::decode(&head)
        .map_err(|e| TransportError::Protocol { addr: addr.to_string(), reason: e.to_string() })?;
    let limit = if head.status.is_ok() { max } else { strata_common::frame::MAX_ERROR_MESSAGE as u64 };
    let ours = head.req_id == req_id || (head.req_id == REJECTED_REQ_ID && head.status.is_err());
    if !ours || head.payload_len > limit {
        return Err(TransportError::Protocol {
            addr: addr.to_string(),
            reason: format!("response {}/{} bytes for request {req_id}", head.req_id, head.payload_len),
        });
    }
    let mut buf = vec![0u8; head.payload_len as usize];
    stream.read_exact(&mut buf).await.map_err(io)?;
    match head.status {
        Ok(_) => Ok(Bytes::from(buf)),
        Err(kind) => Err(TransportError::Remote {
            addr: addr.to_string(),
            kind,
            message: String::from_utf8_lossy(&buf).into_owned(),
        }),
    }
}

#[cfg(any(test, feature = "testing"))]
pub use faulty::FaultyTransport;

/// A test double: built for this crate's tests and, through the `testing` feature, for other
/// crates' tests, never into a production binary.
#[cfg(any(test, feature = "testing"))]
mod faulty {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    use async_trait::async_trait;
    use bytes::Bytes;
    use futures::StreamExt;
    use futures::stream::BoxStream;
    use strata_common::frame::{ReadBlockRequest, Source};

    use super::{Transport, TransportError};

    /// Fails reads to chosen workers, for tests of failover.
    pub struct FaultyTransport {
        inner: Arc<dyn Transport>,
        /// Reads to these addresses fail as if the connection was refused.
        pub down: Mutex<Vec<String>>,
        /// Reads to these addresses never answer, as a stopped process's accepted connection.
        pub frozen: Mutex<Vec<String>>,
        /// The next N reads (to any address) fail.
        pub fail_next: AtomicU64,
        /// The highest block index asked so far, to any address: what a reader fetched ahead.
        pub highest_block_asked: AtomicU64,
    }

    impl FaultyTransport {
        pub fn new(inner: Arc<dyn Transport>) -> Self {
            Self {
                inner,
                down: Mutex::new(Vec::new()),
                frozen: Mutex::new(Vec::new()),
                fail_next: AtomicU64::new(0),
                highest_block_asked: AtomicU64::new(0),
            }
        }
    }

    impl FaultyTransport {
        /// Notes the blocks `reqs` ask for; the injected failure for a read to `addr`, if any.
        fn check(&self, addr: &str, reqs: &[ReadBlockRequest]) -> Result<(), TransportError> {
            let highest = reqs.iter().map(|r| r.block_index).max().unwrap_or(0);
            self.highest_block_asked.fetch_max(highest, Ordering::SeqCst);
            let refused = || TransportError::Connect {
                addr: addr.to_string(),
                source: std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "injected fault"),
            };
            if self.down.lock().unwrap_or_else(|p| p.into_inner()).iter().any(|a| a == addr) {
                return Err(refused());
            }
            if self.fail_next.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
                return Err(refused());
            }
            Ok(())
        }

        /// Never returns for a frozen address (the caller's deadline or hedge ends the wait).
        async fn freeze(&self, addr: &str) {
            if self.frozen.lock().unwrap_or_else(|p| p.into_inner()).iter().any(|a| a == addr) {
                std::future::pending::<()>().await;
            }
        }
    }

    #[async_trait]
    impl Transport for FaultyTransport {
        async fn read_block(
            &self,
            addr: &str,
            req: &ReadBlockRequest,
        ) -> Result<(Bytes, Source), TransportError> {
            self.check(addr, std::slice::from_ref(req))?;
            self.freeze(addr).await;
            self.inner.read_block(addr, req).await
        }

        async fn read_block_into(
            &self,
            addr: &str,
            req: &ReadBlockRequest,
            dst: &mut [u8],
        ) -> Result<Source, TransportError> {
            self.check(addr, std::slice::from_ref(req))?;
            self.freeze(addr).await;
            self.inner.read_block_into(addr, req, dst).await
        }

        fn batches_reads(&self) -> bool {
            self.inner.batches_reads()
        }

        /// The whole batch fails (or never answers) as one read to `addr` would.
        fn read_many<'a>(
            &'a self,
            addr: &'a str,
            reqs: &'a [ReadBlockRequest],
        ) -> BoxStream<'a, Result<(Bytes, Source), TransportError>> {
            if let Err(e) = self.check(addr, reqs) {
                return futures::stream::once(std::future::ready(Err(e))).boxed();
            }
            futures::stream::once(self.freeze(addr))
                .flat_map(move |()| self.inner.read_many(addr, reqs))
                .boxed()
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        struct Ok1;

        #[async_trait]
        impl Transport for Ok1 {
            async fn read_block(
                &self,
                _: &str,
                _: &ReadBlockRequest,
            ) -> Result<(Bytes, Source), TransportError> {
                Ok((Bytes::from_static(b"x"), Source::Memory))
            }
        }

        #[tokio::test]
        async fn fails_reads_to_down_workers_and_the_next_n() {
            let faulty = FaultyTransport::new(Arc::new(Ok1));
            let req = ReadBlockRequest {
                req_id: 1,
                path: "/f".into(),
                version: "v".into(),
                file_size: 1,
                block_size: 1,
                block_index: 0,
                offset: 0,
                len: 1,
            };
            faulty.down.lock().unwrap().push("down:1".into());
            faulty.fail_next.store(1, Ordering::SeqCst);
            assert!(matches!(faulty.read_block("up:1", &req).await, Err(TransportError::Connect { .. })));
            assert!(faulty.read_block("up:1", &req).await.is_ok(), "only the next one failed");
            assert!(matches!(faulty.read_block("down:1", &req).await, Err(TransportError::Connect { .. })));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error_frame(req_id: u64, kind: ErrorKind, message: &str) -> Vec<u8> {
        let head = ResponseHeader { status: Err(kind), req_id, payload_len: message.len() as u64 };
        [&head.encode()[..], message.as_bytes()].concat()
    }

    async fn answer(frame: &[u8], req_id: u64) -> Result<(Option<Bytes>, Source), TransportError> {
        read_response(&mut &frame[..], "w:1", req_id, 10, Sink::New).await
    }

    /// A worker closes a pooled connection that idled past its idle timeout: the pool drops it
    /// and dials anew, so the next read does not fail (on a one-worker cluster, there is no
    /// other worker to retry on).
    #[tokio::test]
    async fn a_pooled_connection_the_worker_closed_is_replaced_not_used() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let pool = TcpPool::new(Duration::from_secs(2));
        let first = pool.checkout(&addr).await.unwrap();
        let (accepted, _) = listener.accept().await.unwrap();
        assert!(!first.is_stale(), "an open, quiet connection is fine");
        pool.checkin(&addr, first);
        drop(accepted);
        // The close reaches this side's socket; wait for it with a deadline, not a sleep.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let closed =
                pool.idle.lock().unwrap().get(&addr).is_some_and(|v| v.iter().all(DataStream::is_stale));
            if closed {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "the close never arrived");
            tokio::task::yield_now().await;
        }
        let second = pool.checkout(&addr).await.unwrap();
        let (mut accepted, _) = tokio::time::timeout(Duration::from_secs(5), listener.accept())
            .await
            .expect("dialled anew")
            .unwrap();
        let mut second = second;
        second.write_all(b"ping").await.unwrap();
        second.flush().await.unwrap();
        let mut got = [0u8; 4];
        accepted.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
    }

    #[tokio::test]
    async fn every_kind_survives_an_error_frame() {
        for kind in ErrorKind::ALL {
            let got = answer(&error_frame(7, kind, "boom"), 7).await;
            match got {
                Err(TransportError::Remote { kind: k, message, .. }) => {
                    assert_eq!((k, message.as_str()), (kind, "boom"));
                }
                other => panic!("{kind}: {other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn a_rejected_frame_is_a_bad_frame_and_ends_the_connection() {
        let got = answer(&error_frame(0, ErrorKind::BadFrame, "unknown op 9"), 7).await;
        assert!(matches!(got, Err(TransportError::Remote { kind: ErrorKind::BadFrame, .. })), "{got:?}");
        assert!(!reusable(&got), "the worker closes the connection after a rejection");
        let other = answer(&error_frame(7, ErrorKind::NotFound, "x"), 7).await;
        assert!(reusable(&other), "an answered request leaves the connection in sync");
        let stray = answer(&error_frame(6, ErrorKind::NotFound, "x"), 7).await;
        assert!(matches!(stray, Err(TransportError::Protocol { .. })), "{stray:?}");
    }

    #[tokio::test]
    async fn a_worker_at_its_connection_limit_sends_the_read_elsewhere() {
        let msg = "this worker has its limit of 3 data-plane connections open (max_connections)";
        let got = answer(&error_frame(0, ErrorKind::ResourceExhausted, msg), 7).await;
        assert!(!reusable(&got), "the worker closed the refused connection");
        assert!(got.unwrap_err().try_next_worker(), "another worker may have room");
        let not_found = answer(&error_frame(7, ErrorKind::NotFound, "x"), 7).await;
        assert!(!not_found.unwrap_err().try_next_worker(), "any worker would answer the same");
    }

    /// A batch is one request whose answers come back one by one, an item's error among them;
    /// the connection is kept for the next batch. A worker that rejects the whole frame (one that
    /// does not know `ReadMany`) ends the stream early, leaving the rest unanswered.
    #[tokio::test]
    async fn a_batch_is_one_request_answered_in_order_on_a_kept_connection() {
        use strata_common::frame::{Op, REQUEST_HEADER_LEN, decode_request_header};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicU64::new(0));
        let counted = accepted.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else { return };
                counted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    loop {
                        let mut head = [0u8; REQUEST_HEADER_LEN];
                        if stream.read_exact(&mut head).await.is_err() {
                            return;
                        }
                        let (op, len) = decode_request_header(&head).unwrap();
                        let mut body = vec![0u8; len];
                        stream.read_exact(&mut body).await.unwrap();
                        assert_eq!(op, Op::ReadMany);
                        let batch = ReadMany::decode_body(&body).unwrap();
                        for req in batch.items {
                            let reply = match req.block_index {
                                3 => error_frame(req.req_id, ErrorKind::NotFound, "not here"),
                                9 => error_frame(0, ErrorKind::BadFrame, "unknown op 17"),
                                i => {
                                    let payload = format!("block {i}");
                                    let head = ResponseHeader {
                                        status: Ok(Source::Memory),
                                        req_id: req.req_id,
                                        payload_len: payload.len() as u64,
                                    };
                                    [&head.encode()[..], payload.as_bytes()].concat()
                                }
                            };
                            stream.write_all(&reply).await.unwrap();
                            if req.block_index == 9 {
                                return;
                            }
                        }
                    }
                });
            }
        });
        let tcp = TcpTransport::new(Duration::from_secs(2), Duration::from_secs(5));
        let req = |block_index| ReadBlockRequest {
            req_id: 0,
            path: "/d/f".into(),
            version: "v".into(),
            file_size: 100,
            block_size: 10,
            block_index,
            offset: 0,
            len: 7,
        };
        let reqs: Vec<ReadBlockRequest> = (0..5).map(req).collect();
        for _ in 0..2 {
            let answers: Vec<_> = tcp.read_many(&addr, &reqs).collect().await;
            assert_eq!(answers.len(), 5);
            for (i, answer) in answers.into_iter().enumerate() {
                match answer {
                    Ok((bytes, Source::Memory)) if i != 3 => assert_eq!(bytes, format!("block {i}")),
                    Err(TransportError::Remote { kind: ErrorKind::NotFound, .. }) if i == 3 => {}
                    other => panic!("item {i}: {other:?}"),
                }
            }
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "both batches on one connection");
        assert!(tcp.batches_reads());

        let rejected = [req(0), req(9), req(1)];
        let answers: Vec<_> = tcp.read_many(&addr, &rejected).collect().await;
        assert_eq!(answers.len(), 2, "nothing after the rejection: {answers:?}");
        assert!(matches!(answers[1], Err(TransportError::Remote { kind: ErrorKind::BadFrame, .. })));
        // The rejecting connection was not kept: the next batch dials anew and is served.
        let answers: Vec<_> = tcp.read_many(&addr, &reqs[..1]).collect().await;
        assert!(matches!(&answers[..], [Ok(_)]), "{answers:?}");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    /// Peer asks share connections: ten asks of one worker, a miss among them, open one.
    #[tokio::test]
    async fn pooled_asks_reuse_one_connection_misses_included() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicU64::new(0));
        let counted = accepted.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else { return };
                counted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    loop {
                        let mut head = [0u8; strata_common::frame::REQUEST_HEADER_LEN];
                        if stream.read_exact(&mut head).await.is_err() {
                            return;
                        }
                        let (_, len) = strata_common::frame::decode_request_header(&head).unwrap();
                        let mut body = vec![0u8; len];
                        stream.read_exact(&mut body).await.unwrap();
                        let req = ReadBlockRequest::decode_body(&body).unwrap();
                        let reply = if req.block_index == 3 {
                            error_frame(req.req_id, ErrorKind::NotFound, "not cached here")
                        } else {
                            let head = ResponseHeader {
                                status: Ok(Source::Memory),
                                req_id: req.req_id,
                                payload_len: 4,
                            };
                            [&head.encode()[..], b"data"].concat()
                        };
                        stream.write_all(&reply).await.unwrap();
                    }
                });
            }
        });
        let pool = TcpPool::new(Duration::from_secs(2));
        for index in 0..10 {
            let req = ReadBlockRequest {
                req_id: index + 1,
                path: "/d/f".into(),
                version: "v".into(),
                file_size: 100,
                block_size: 10,
                block_index: index,
                offset: 0,
                len: 4,
            };
            let got =
                ask_pooled(&pool, &addr, &req.encode_peer(), req.req_id, 4, Duration::from_secs(5)).await;
            match index {
                3 => assert!(
                    matches!(got, Err(TransportError::Remote { kind: ErrorKind::NotFound, .. })),
                    "{got:?}"
                ),
                _ => assert_eq!(got.unwrap(), Bytes::from_static(b"data")),
            }
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "one connection for every ask");
    }
}
