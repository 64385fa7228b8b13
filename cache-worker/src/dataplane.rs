//! The data-plane server: framed TCP (see `strata_common::frame`), one request at a time per
//! connection, payload bytes written straight from the block's `Bytes`. The same protocol is
//! served over a Unix socket by a sidecar worker (`serve_unix`) to the processes of its pod.
//!
//! A malformed frame gets an error frame and the connection is closed (its framing can no
//! longer be trusted); a request that is well-framed but wrong gets an error frame and the
//! connection stays usable. Either way the worker keeps serving everyone else.

use std::sync::Arc;
use std::time::Instant;

use strata_common::ErrorKind;
use strata_common::frame::{
    self, MAX_ERROR_MESSAGE, REQUEST_HEADER_LEN, ReadBlockRequest, ResponseHeader, decode_request_header,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use crate::blockstore::BlockStore;
use crate::metrics_defs as m;

/// Small payloads go out in one write with their header; large ones in two writes, without
/// copying the block.
const COALESCE_LIMIT: usize = 64 * 1024;

/// A listener the data plane accepts connections on.
trait Listener: Send + 'static {
    type Stream: GrantStream;
    /// The next connection and a name of its peer for logs.
    fn accept_one(&self) -> impl Future<Output = std::io::Result<(Self::Stream, String)>> + Send;
}

impl Listener for TcpListener {
    type Stream = tokio::net::TcpStream;

    async fn accept_one(&self) -> std::io::Result<(Self::Stream, String)> {
        let (stream, peer) = self.accept().await?;
        if let Err(e) = stream.set_nodelay(true) {
            debug!(%peer, err = %e, "cannot set TCP_NODELAY");
        }
        Ok((stream, peer.to_string()))
    }
}

impl Listener for UnixListener {
    type Stream = tokio::net::UnixStream;

    async fn accept_one(&self) -> std::io::Result<(Self::Stream, String)> {
        let (stream, _) = self.accept().await?;
        Ok((stream, "unix".to_string()))
    }
}

/// The requests whose answer depends on the kind of socket: a grant (`OpenBlock`) is a passed
/// file descriptor on a Unix socket (`crate::shortcircuit`) and a registered memory region on
/// TCP (`crate::rdma`). Each method reads the request body (`body_len` bytes) itself.
pub(crate) trait GrantStream: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    fn open_block(
        &mut self,
        store: &Arc<BlockStore>,
        body_len: usize,
    ) -> impl Future<Output = std::io::Result<()>> + Send;
    fn release(
        &mut self,
        store: &Arc<BlockStore>,
        body_len: usize,
    ) -> impl Future<Output = std::io::Result<()>> + Send;
    fn remote_read(
        &mut self,
        store: &Arc<BlockStore>,
        body_len: usize,
    ) -> impl Future<Output = std::io::Result<()>> + Send;
}

pub async fn serve(listener: TcpListener, store: Arc<BlockStore>, cancel: CancellationToken) {
    serve_on(listener, store, cancel).await
}

/// Serves the data plane on a Unix socket: the sidecar's route for the processes of its pod.
pub async fn serve_unix(listener: UnixListener, store: Arc<BlockStore>, cancel: CancellationToken) {
    serve_on(listener, store, cancel).await
}

async fn serve_on<L: Listener>(listener: L, store: Arc<BlockStore>, cancel: CancellationToken) {
    let tracker = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            _ = cancel.cancelled() => break,
            a = listener.accept_one() => a,
        };
        match accepted {
            Ok((stream, peer)) => spawn_connection(&tracker, stream, peer, store.clone(), cancel.clone()),
            Err(e) => {
                warn!(err = %e, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
    tracker.close();
    tracker.wait().await;
}

fn spawn_connection<S: GrantStream>(
    tracker: &TaskTracker,
    stream: S,
    peer: String,
    store: Arc<BlockStore>,
    cancel: CancellationToken,
) {
    tracker.spawn(async move {
        tokio::select! {
            _ = cancel.cancelled() => {}
            r = connection(stream, store) => {
                if let Err(e) = r {
                    debug!(%peer, err = %e, "data-plane connection ended");
                }
            }
        }
    });
}

async fn connection<S: GrantStream>(mut stream: S, store: Arc<BlockStore>) -> std::io::Result<()> {
    let mut header = [0u8; REQUEST_HEADER_LEN];
    let mut body = Vec::new();
    loop {
        match stream.read_exact(&mut header).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let body_len = match decode_request_header(&header) {
            Ok((frame::Op::ReadBlock, len)) => len,
            Ok((frame::Op::WriteBegin, len)) => {
                crate::writes::serve_write(&mut stream, &store, len).await?;
                continue;
            }
            Ok((frame::Op::OpenBlock, len)) => {
                stream.open_block(&store, len).await?;
                continue;
            }
            Ok((frame::Op::Release, len)) => {
                stream.release(&store, len).await?;
                continue;
            }
            Ok((frame::Op::RemoteRead, len)) => {
                stream.remote_read(&store, len).await?;
                continue;
            }
            Ok((op, _)) => return reject(&mut stream, &format!("{op:?} outside a write")).await,
            Err(e) => return reject(&mut stream, &e.to_string()).await,
        };
        body.resize(body_len, 0);
        stream.read_exact(&mut body).await?;
        let req = match ReadBlockRequest::decode_body(&body) {
            Ok(r) => r,
            Err(e) => return reject(&mut stream, &e.to_string()).await,
        };
        let started = Instant::now();
        match store.read(&req).await {
            Ok((bytes, source)) => {
                let head = ResponseHeader {
                    status: Ok(source),
                    req_id: req.req_id,
                    payload_len: bytes.len() as u64,
                }
                .encode();
                if bytes.len() <= COALESCE_LIMIT {
                    let mut out = Vec::with_capacity(head.len() + bytes.len());
                    out.extend_from_slice(&head);
                    out.extend_from_slice(&bytes);
                    stream.write_all(&out).await?;
                } else {
                    stream.write_all(&head).await?;
                    stream.write_all(&bytes).await?;
                }
                let label = match source {
                    frame::Source::Memory => "memory",
                    frame::Source::Nvme => "nvme",
                    frame::Source::Ufs => "ufs",
                };
                metrics::histogram!(m::READ_SECONDS, "source" => label)
                    .record(started.elapsed().as_secs_f64());
            }
            Err(e) => {
                debug!(path = %req.path, block = req.block_index, err = %e, "block read failed");
                send_error(&mut stream, req.req_id, e.kind(), &e.to_string()).await?;
            }
        }
    }
}

/// Answers a malformed frame and closes the connection. The peer may have sent more bytes we
/// will never read; closing with them unread makes the kernel send a reset that can destroy our
/// error frame in flight, so we half-close first and drain briefly.
pub(crate) async fn reject<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    message: &str,
) -> std::io::Result<()> {
    send_error(stream, 0, ErrorKind::BadFrame, message).await?;
    stream.shutdown().await?;
    let mut sink = [0u8; 4096];
    let drain = async {
        let mut left = 1 << 20;
        while left > 0 {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left -= n.min(left),
            }
        }
    };
    let _ = tokio::time::timeout(std::time::Duration::from_millis(200), drain).await;
    Ok(())
}

pub(crate) async fn send_error<S: AsyncWrite + Unpin>(
    stream: &mut S,
    req_id: u64,
    kind: ErrorKind,
    message: &str,
) -> std::io::Result<()> {
    metrics::counter!(m::REQUEST_ERRORS, "kind" => kind.as_str()).increment(1);
    let mut msg = message.as_bytes();
    if msg.len() > MAX_ERROR_MESSAGE {
        msg = &msg[..MAX_ERROR_MESSAGE];
    }
    let head = ResponseHeader { status: Err(kind), req_id, payload_len: msg.len() as u64 }.encode();
    let mut out = Vec::with_capacity(head.len() + msg.len());
    out.extend_from_slice(&head);
    out.extend_from_slice(msg);
    stream.write_all(&out).await
}
