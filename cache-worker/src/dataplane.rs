//! The data-plane server: framed TCP (see `strata_common::frame`), one request at a time per
//! connection, payload bytes written straight from the block's `Bytes`, or for a verified NVMe
//! block sent from its file with `sendfile`. The same protocol is
//! served over a Unix socket by a sidecar worker (`serve_unix`) to the processes of its pod.
//!
//! A malformed frame gets an error frame and the connection is closed (its framing can no
//! longer be trusted); a request that is well-framed but wrong gets an error frame and the
//! connection stays usable. Either way the worker keeps serving everyone else.

use std::os::fd::{AsRawFd, RawFd};
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

use crate::blockstore::{BlockStore, Payload};
use crate::metrics_defs as m;

/// Small payloads go out in one write with their header; large ones in two writes, without
/// copying the block.
const COALESCE_LIMIT: usize = 64 * 1024;

/// A listener the data plane accepts connections on.
trait Listener: Send + 'static {
    type Stream: GrantStream + SendFile;
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
    /// `Op::RdmaConnect`: serves the rest of the connection. Refused unless overridden (TCP).
    fn rdma_connect(
        &mut self,
        store: &Arc<BlockStore>,
        body_len: usize,
    ) -> impl Future<Output = std::io::Result<()>> + Send
    where
        Self: Sized,
    {
        let _ = (store, body_len);
        async move { reject(self, "RdmaConnect is served on TCP only").await }
    }
}

/// Sends a file region to the socket with `sendfile(2)`: the bytes go from the page cache to
/// the socket without passing through user space (and without the copy and checksum pass of a
/// tier read).
pub(crate) trait SendFile {
    fn send_file(
        &mut self,
        file: &std::fs::File,
        offset: u64,
        len: u64,
    ) -> impl Future<Output = std::io::Result<()>> + Send;
}

macro_rules! impl_send_file {
    ($stream:ty) => {
        impl SendFile for $stream {
            async fn send_file(
                &mut self,
                file: &std::fs::File,
                offset: u64,
                len: u64,
            ) -> std::io::Result<()> {
                let mut offset = offset;
                let mut left = len;
                while left > 0 {
                    self.writable().await?;
                    let sent = self.try_io(tokio::io::Interest::WRITABLE, || {
                        sendfile_once(self.as_raw_fd(), file.as_raw_fd(), &mut offset, left)
                    });
                    match sent {
                        Ok(0) => {
                            // The file is shorter than the index said: the peer gets fewer bytes
                            // than announced, so the connection must not go on.
                            return Err(std::io::Error::new(
                                std::io::ErrorKind::UnexpectedEof,
                                "block file ended before the range",
                            ));
                        }
                        Ok(n) => left -= n as u64,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) => return Err(e),
                    }
                }
                Ok(())
            }
        }
    };
}

impl_send_file!(tokio::net::TcpStream);
impl_send_file!(tokio::net::UnixStream);

/// One `sendfile(2)` call of at most `left` bytes from `*offset`, which it advances.
fn sendfile_once(socket: RawFd, file: RawFd, offset: &mut u64, left: u64) -> std::io::Result<usize> {
    // Linux sends at most 0x7ffff000 bytes per call.
    let count = left.min(0x7fff_f000) as usize;
    let mut off = *offset as libc::off_t;
    // SAFETY: both descriptors are open for the duration of the call (borrowed from live
    // objects) and `off` is a valid, exclusively borrowed off_t.
    let n = unsafe { libc::sendfile(socket, file, &mut off, count) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    *offset = off as u64;
    Ok(n as usize)
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

fn spawn_connection<S: GrantStream + SendFile>(
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

async fn connection<S: GrantStream + SendFile>(mut stream: S, store: Arc<BlockStore>) -> std::io::Result<()> {
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
            // The connection becomes the lifetime of an RDMA queue pair (`crate::rdma`).
            Ok((frame::Op::RdmaConnect, len)) => return stream.rdma_connect(&store, len).await,
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
        match store.read_payload(&req).await {
            Ok((payload, source)) => {
                match payload {
                    Payload::Bytes(bytes) => send_data(&mut stream, req.req_id, source, &bytes).await?,
                    Payload::File { file, offset, len } => {
                        let head =
                            ResponseHeader { status: Ok(source), req_id: req.req_id, payload_len: len };
                        stream.write_all(&head.encode()).await?;
                        stream.send_file(&file, offset, len).await?;
                        metrics::counter!(m::ZERO_COPY_BYTES).increment(len);
                    }
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

/// Reads a request body of `body_len` bytes and decodes it. A malformed one is answered as a
/// malformed frame ([`reject`]: the connection closes) and gives `None`.
pub(crate) async fn read_body<S, T>(
    stream: &mut S,
    body_len: usize,
    decode: impl FnOnce(&[u8]) -> Result<T, frame::FrameError>,
) -> std::io::Result<Option<T>>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut body = vec![0u8; body_len];
    stream.read_exact(&mut body).await?;
    match decode(&body) {
        Ok(v) => Ok(Some(v)),
        Err(e) => reject(stream, &e.to_string()).await.map(|()| None),
    }
}

/// A data response: the header, then `payload` (in one write when small, else without copying it).
pub(crate) async fn send_data<S: AsyncWrite + Unpin>(
    stream: &mut S,
    req_id: u64,
    source: frame::Source,
    payload: &[u8],
) -> std::io::Result<()> {
    let head = ResponseHeader { status: Ok(source), req_id, payload_len: payload.len() as u64 }.encode();
    if payload.len() <= COALESCE_LIMIT {
        let mut out = Vec::with_capacity(head.len() + payload.len());
        out.extend_from_slice(&head);
        out.extend_from_slice(payload);
        stream.write_all(&out).await
    } else {
        stream.write_all(&head).await?;
        stream.write_all(payload).await
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
