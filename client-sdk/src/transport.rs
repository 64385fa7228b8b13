//! The data-plane transport seam. [`TcpTransport`] speaks the framed protocol of
//! `strata_common::frame` over pooled connections; [`UnixTransport`] speaks the same frames to
//! a sidecar worker's Unix socket; [`FaultyTransport`] wraps any transport and fails on demand,
//! for tests.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::{BufMut, Bytes, BytesMut};
use strata_common::ErrorKind;
use strata_common::frame::{RESPONSE_HEADER_LEN, ReadBlockRequest, ResponseHeader, Source};
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
}

impl TransportError {
    /// Whether another worker may succeed where this one failed.
    pub fn try_next_worker(&self) -> bool {
        match self {
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
}

/// Framed TCP with a small pool of idle connections per worker.
pub struct TcpTransport {
    idle: Mutex<HashMap<String, Vec<TcpStream>>>,
    connect_timeout: Duration,
    request_timeout: Duration,
    max_idle_per_worker: usize,
    next_req_id: AtomicU64,
}

impl TcpTransport {
    pub fn new(connect_timeout: Duration, request_timeout: Duration) -> Self {
        Self {
            idle: Mutex::new(HashMap::new()),
            connect_timeout,
            request_timeout,
            max_idle_per_worker: 64,
            next_req_id: AtomicU64::new(1),
        }
    }

    async fn checkout(&self, addr: &str) -> Result<TcpStream, TransportError> {
        if let Some(stream) =
            self.idle.lock().unwrap_or_else(|p| p.into_inner()).get_mut(addr).and_then(Vec::pop)
        {
            return Ok(stream);
        }
        connect_tcp(addr, self.connect_timeout).await
    }

    fn checkin(&self, addr: &str, stream: TcpStream) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let pool = idle.entry(addr.to_string()).or_default();
        if pool.len() < self.max_idle_per_worker {
            pool.push(stream);
        }
    }
}

/// A new data-plane connection to a worker, with Nagle off (requests are small and answered at once).
pub(crate) async fn connect_tcp(addr: &str, timeout: Duration) -> Result<TcpStream, TransportError> {
    let stream = tokio::time::timeout(timeout, TcpStream::connect(addr))
        .await
        .map_err(|_| TransportError::Timeout { addr: addr.to_string() })?
        .map_err(|source| TransportError::Connect { addr: addr.to_string(), source })?;
    stream.set_nodelay(true).map_err(|source| TransportError::Connect { addr: addr.to_string(), source })?;
    Ok(stream)
}

/// One request and its response on a connection that is in sync (no bytes pending).
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    addr: &str,
    req: &ReadBlockRequest,
) -> Result<(Bytes, Source), TransportError> {
    let io = |source| TransportError::Io { addr: addr.to_string(), source };
    stream.write_all(&req.encode()).await.map_err(io)?;
    let mut head = [0u8; RESPONSE_HEADER_LEN];
    stream.read_exact(&mut head).await.map_err(io)?;
    let head = ResponseHeader::decode(&head)
        .map_err(|e| TransportError::Protocol { addr: addr.to_string(), reason: e.to_string() })?;
    let expected = match head.status {
        Ok(_) => req.len,
        Err(_) => head.payload_len.min(strata_common::frame::MAX_ERROR_MESSAGE as u64),
    };
    if head.req_id != req.req_id || head.payload_len != expected {
        return Err(TransportError::Protocol {
            addr: addr.to_string(),
            reason: format!(
                "response {}/{} bytes for request {}/{}",
                head.req_id, head.payload_len, req.req_id, req.len
            ),
        });
    }
    // Filled straight from the socket: no zeroing pass over a multi-MiB block first.
    let want = head.payload_len as usize;
    let mut buf = BytesMut::with_capacity(want);
    while buf.len() < want {
        let left = want - buf.len();
        if stream.read_buf(&mut (&mut buf).limit(left)).await.map_err(io)? == 0 {
            return Err(io(std::io::ErrorKind::UnexpectedEof.into()));
        }
    }
    match head.status {
        Ok(source) => Ok((buf.freeze(), source)),
        Err(kind) => Err(TransportError::Remote {
            addr: addr.to_string(),
            kind,
            message: String::from_utf8_lossy(&buf).into_owned(),
        }),
    }
}

#[async_trait]
impl Transport for TcpTransport {
    async fn read_block(
        &self,
        addr: &str,
        req: &ReadBlockRequest,
    ) -> Result<(Bytes, Source), TransportError> {
        let mut req = req.clone();
        req.req_id = self.next_req_id.fetch_add(1, Ordering::Relaxed);
        let mut stream = self.checkout(addr).await?;
        let result = tokio::time::timeout(self.request_timeout, exchange(&mut stream, addr, &req))
            .await
            .unwrap_or_else(|_| Err(TransportError::Timeout { addr: addr.to_string() }));
        // Only a connection that completed a whole exchange is known to be in sync.
        if matches!(result, Ok(_) | Err(TransportError::Remote { .. })) {
            self.checkin(addr, stream);
        }
        result
    }
}

/// The framed protocol over a Unix socket, to the sidecar worker of this pod; `addr` is the
/// socket's path. Keeps a few idle connections, like [`TcpTransport`].
pub struct UnixTransport {
    idle: Mutex<Vec<UnixStream>>,
    connect_timeout: Duration,
    request_timeout: Duration,
    max_idle: usize,
    next_req_id: AtomicU64,
}

impl UnixTransport {
    pub fn new(connect_timeout: Duration, request_timeout: Duration) -> Self {
        Self {
            idle: Mutex::new(Vec::new()),
            connect_timeout,
            request_timeout,
            max_idle: 64,
            next_req_id: AtomicU64::new(1),
        }
    }
}

#[async_trait]
impl Transport for UnixTransport {
    async fn read_block(
        &self,
        addr: &str,
        req: &ReadBlockRequest,
    ) -> Result<(Bytes, Source), TransportError> {
        let mut req = req.clone();
        req.req_id = self.next_req_id.fetch_add(1, Ordering::Relaxed);
        let pooled = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut stream = match pooled {
            Some(s) => s,
            None => tokio::time::timeout(self.connect_timeout, UnixStream::connect(addr))
                .await
                .map_err(|_| TransportError::Timeout { addr: addr.to_string() })?
                .map_err(|source| TransportError::Connect { addr: addr.to_string(), source })?,
        };
        let result = tokio::time::timeout(self.request_timeout, exchange(&mut stream, addr, &req))
            .await
            .unwrap_or_else(|_| Err(TransportError::Timeout { addr: addr.to_string() }));
        if matches!(result, Ok(_) | Err(TransportError::Remote { .. })) {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            if idle.len() < self.max_idle {
                idle.push(stream);
            }
        }
        result
    }
}

/// Fails reads to chosen workers, for tests of failover.
pub struct FaultyTransport {
    inner: Arc<dyn Transport>,
    /// Reads to these addresses fail as if the connection was refused.
    pub down: Mutex<Vec<String>>,
    /// The next N reads (to any address) fail.
    pub fail_next: AtomicU64,
}

impl FaultyTransport {
    pub fn new(inner: Arc<dyn Transport>) -> Self {
        Self { inner, down: Mutex::new(Vec::new()), fail_next: AtomicU64::new(0) }
    }
}

#[async_trait]
impl Transport for FaultyTransport {
    async fn read_block(
        &self,
        addr: &str,
        req: &ReadBlockRequest,
    ) -> Result<(Bytes, Source), TransportError> {
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
        self.inner.read_block(addr, req).await
    }
}
