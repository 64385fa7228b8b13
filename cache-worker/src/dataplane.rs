//! The data-plane server: framed requests (see `strata_common::frame`) on TCP and, for a
//! sidecar, on a Unix socket; one request at a time per connection. It translates each frame
//! into a storage request ([`BlockRead`]) for the block service, or a grant request for the
//! grants service, and writes the answer: payload bytes straight from the block's `Bytes`, a
//! verified NVMe block with `sendfile`, a grant with its descriptor passed alongside.
//!
//! The frame says what is asked (`OpenBlock` names its kind of grant); the socket only says
//! what it can carry: a descriptor grant asked on TCP is refused with an error frame, since
//! only a Unix socket can pass a descriptor.
//!
//! `Copy` makes one file a copy of another inside the cluster (by the UFS, or streamed through
//! this worker's blocks: `copy`), answered when the copy exists.
//! `ReadMany` asks for many block ranges in one round trip (an epoch over small files costs one
//! request per batch, not one per file): each item is checked and read as a `ReadBlock` is —
//! through the same [`BlockService::read_payload`], so DRAM, `sendfile`, misses and single
//! flight all apply — several at a time, and answered by its own response frame in the order
//! asked; an item refused or failed gets an error frame and the others are served.
//!
//! Two small requests answer metadata rather than bytes, for clients whose master is
//! unreachable: `View` (the worker's [`LastView`] of membership and mounts) and `Stat` (a path
//! stat at the UFS through the worker's mount, answered as the master would).
//!
//! A malformed frame gets an error frame and the connection is closed (its framing can no
//! longer be trusted); a request that is well-framed but wrong gets an error frame and the
//! connection stays usable. Either way the worker keeps serving everyone else.
//!
//! Hostile peers (docs/SECURITY.md, "Hostile connections"): a connection over the limits is
//! refused at accept ([`admission`]), and every admitted one runs under deadlines for idle
//! waits, stalled frames and untaken responses ([`timed`]), whatever the stream type.

mod admission;
mod copy;
mod lane;
mod timed;
mod write;

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::Arc;
use std::time::Instant;

use strata_common::fdpass::write_all_with_fd;
use strata_common::frame::{
    self, BlockGrant, FileStat, GrantKind, LeaseRelease, MAX_ERROR_MESSAGE, OpenBlock, REQUEST_HEADER_LEN,
    RdmaEndpoint, ReadBlockRequest, ReadMany, RemoteRead, ResponseHeader, Source, StatRequest,
    decode_request_header,
};
use strata_common::{ErrorKind, QosClass};
use strata_security::tls::{ParkableSocket, ServerTls};
use strata_security::token::Access;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use crate::auth::{PeerAuth, Refused, Session};
use crate::blocks::{BlockRead, BlockService, Payload, Served};
use crate::error::ServeError;
use crate::grants::Grants;
use crate::metrics_defs as m;
use crate::view::LastView;
pub use admission::{ConnectionSnapshot, Connections};
use admission::{Peer, Permit};
pub use lane::LatencyLane;
use lane::{Moving, Portability, Portable};
use timed::Timed;

/// Small payloads go out in one write with their header; large ones in two writes, without
/// copying the block.
const COALESCE_LIMIT: usize = 64 * 1024;
/// Items of one `ReadMany` read at once: enough to overlap the UFS fetches of a batch of cold
/// small files, few enough that one batch holds few blocks ahead of a slow reader.
const READ_MANY_CONCURRENCY: usize = 16;

/// What the data plane serves from: the storage API and the grants service.
#[derive(Clone)]
pub struct DataPlane {
    pub blocks: Arc<BlockService>,
    pub grants: Arc<Grants>,
    /// What the worker last learnt of the cluster, for `View` requests.
    pub view: Arc<LastView>,
    /// The token check every connection and request passes.
    pub auth: Arc<PeerAuth>,
    /// The open connections and their limits.
    pub connections: Arc<Connections>,
    /// Write-back journals and uploads (a worker's; a sidecar takes no write-back writes).
    pub writeback: Option<Arc<crate::writeback::WriteBack>>,
    /// Blocks handed off by their previous owners (a worker's; a sidecar is on no ring).
    pub handoff: Option<Arc<crate::handoff::Receiver>>,
    /// The prefetch lane (a worker's; a sidecar takes no hints).
    pub prefetch: Option<Arc<crate::prefetch::Prefetcher>>,
    /// The gate answers to clients pass by their connection's request class.
    pub classes: Arc<crate::classes::ClassGate>,
    /// The thread latency-class connections move to.
    pub latency_lane: Arc<LatencyLane>,
}

impl DataPlane {
    /// Tells the prefetch lane a client asked for a block (a hit, or a hint overtaken).
    fn reading(&self, req: &ReadBlockRequest) {
        if let Some(p) = &self.prefetch {
            p.on_read(&req.path, &req.version, req.block_index);
        }
    }
}

/// The wire request as a storage request.
fn block_read(req: &ReadBlockRequest) -> BlockRead {
    BlockRead {
        path: req.path.clone(),
        version: req.version.clone(),
        file_size: req.file_size,
        block_size: req.block_size,
        index: req.block_index,
        offset: req.offset,
        len: req.len,
    }
}

/// A listener the data plane accepts connections on.
trait Listener: Send + 'static {
    /// An accepted socket, before [`establish`](Self::establish) (refused at the limits as it is).
    type Accepted: AsFd + Send + 'static;
    type Stream: Connection;
    /// The next connection and its peer (for the limits and for logs).
    fn accept_one(&self) -> impl Future<Output = std::io::Result<(Self::Accepted, Peer)>> + Send;
    /// Turns an accepted socket into a connection (the TLS handshake, if any). It runs in the
    /// connection's own task, so a slow or silent peer never holds up accepting the next.
    fn establish(
        &self,
        accepted: Self::Accepted,
    ) -> impl Future<Output = std::io::Result<Self::Stream>> + Send + 'static;
}

impl Listener for TcpListener {
    type Accepted = tokio::net::TcpStream;
    type Stream = tokio::net::TcpStream;

    async fn accept_one(&self) -> std::io::Result<(Self::Accepted, Peer)> {
        let (stream, peer) = self.accept().await?;
        if let Err(e) = stream.set_nodelay(true) {
            debug!(%peer, err = %e, "cannot set TCP_NODELAY");
        }
        Ok((stream, Peer::Tcp(peer)))
    }

    fn establish(
        &self,
        accepted: Self::Accepted,
    ) -> impl Future<Output = std::io::Result<Self::Stream>> + Send + 'static {
        std::future::ready(Ok(accepted))
    }
}

impl Listener for UnixListener {
    type Accepted = tokio::net::UnixStream;
    type Stream = tokio::net::UnixStream;

    async fn accept_one(&self) -> std::io::Result<(Self::Accepted, Peer)> {
        let (stream, _) = self.accept().await?;
        // SO_PEERCRED: who connected, as the kernel saw it at connect().
        let peer = match stream.peer_cred() {
            Ok(cred) => Peer::Unix { uid: Some(cred.uid()), pid: cred.pid() },
            Err(e) => {
                debug!(err = %e, "no peer credentials on a Unix connection");
                Peer::Unix { uid: None, pid: None }
            }
        };
        Ok((stream, peer))
    }

    fn establish(
        &self,
        accepted: Self::Accepted,
    ) -> impl Future<Output = std::io::Result<Self::Stream>> + Send + 'static {
        std::future::ready(Ok(accepted))
    }
}

/// TCP whose connections complete a TLS handshake (within
/// [`HANDSHAKE_TIMEOUT`](strata_security::tls::HANDSHAKE_TIMEOUT)) before their first frame.
struct TlsListener {
    tcp: TcpListener,
    tls: ServerTls,
}

impl Listener for TlsListener {
    type Accepted = tokio::net::TcpStream;
    type Stream = TlsConnection;

    fn accept_one(&self) -> impl Future<Output = std::io::Result<(Self::Accepted, Peer)>> + Send {
        self.tcp.accept_one()
    }

    fn establish(
        &self,
        accepted: Self::Accepted,
    ) -> impl Future<Output = std::io::Result<Self::Stream>> + Send + 'static {
        let tls = self.tls.clone();
        async move { Ok(TlsConnection(tls.accept(ParkableSocket::new(accepted)).await?)) }
    }
}

/// A TLS data-plane connection. rustls may accept an answer's bytes and hold back part of
/// their ciphertext when the socket is full; a read (of the next request) first writes that
/// out, or the peer would wait for it while the worker waits for the peer.
pub(crate) struct TlsConnection(tokio_rustls::server::TlsStream<ParkableSocket>);

impl TlsConnection {
    /// Back in a runtime: the parked socket registered with the current one's reactor (the
    /// lane's).
    fn attach(mut self: Box<Self>) -> std::io::Result<Self> {
        self.0.get_mut().0.attach()?;
        Ok(*self)
    }
}

impl AsyncRead for TlsConnection {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = &mut self.get_mut().0;
        if this.get_ref().1.wants_write() {
            std::task::ready!(std::pin::Pin::new(&mut *this).poll_flush(cx))?;
        }
        std::pin::Pin::new(this).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConnection {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

/// What a connection's socket can do beyond bytes.
trait Connection: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    /// Sends a file region with `sendfile(2)`: from the page cache to the socket without passing
    /// through user space.
    fn send_file(
        &mut self,
        file: &std::fs::File,
        offset: u64,
        len: u64,
    ) -> impl Future<Output = std::io::Result<()>> + Send;

    /// Whether this kind of socket can pass a file descriptor.
    const PASSES_FDS: bool;

    /// Writes `bytes` with `fd` attached (only where [`PASSES_FDS`](Self::PASSES_FDS)).
    fn write_with_fd(
        &mut self,
        bytes: &[u8],
        fd: BorrowedFd<'_>,
    ) -> impl Future<Output = std::io::Result<()>> + Send;

    /// The socket out of its runtime, to be served on the latency lane; a connection that
    /// cannot move stays.
    fn portable(self) -> Portability<Self>
    where
        Self: Sized,
    {
        Portability::Stays(self)
    }
}

macro_rules! impl_send_file {
    () => {
        async fn send_file(&mut self, file: &std::fs::File, offset: u64, len: u64) -> std::io::Result<()> {
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
    };
}

impl Connection for tokio::net::TcpStream {
    impl_send_file!();

    const PASSES_FDS: bool = false;

    fn portable(self) -> Portability<Self> {
        match self.into_std() {
            Ok(s) => Portability::Moved(Portable::Tcp(s)),
            Err(e) => Portability::Failed(e),
        }
    }

    async fn write_with_fd(&mut self, _bytes: &[u8], _fd: BorrowedFd<'_>) -> std::io::Result<()> {
        Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "TCP cannot pass a descriptor"))
    }
}

impl Connection for tokio::net::UnixStream {
    impl_send_file!();

    const PASSES_FDS: bool = true;

    fn portable(self) -> Portability<Self> {
        match self.into_std() {
            Ok(s) => Portability::Moved(Portable::Unix(s)),
            Err(e) => Portability::Failed(e),
        }
    }

    fn write_with_fd(
        &mut self,
        bytes: &[u8],
        fd: BorrowedFd<'_>,
    ) -> impl Future<Output = std::io::Result<()>> + Send {
        write_all_with_fd(self, bytes, fd)
    }
}

/// TLS encrypts in user space, so a file region is read and written through it (no
/// `sendfile`), and no descriptor can be passed.
impl Connection for TlsConnection {
    async fn send_file(&mut self, file: &std::fs::File, offset: u64, len: u64) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        const CHUNK: u64 = 256 * 1024;
        let mut buf = vec![0u8; len.min(CHUNK) as usize];
        let mut done = 0u64;
        while done < len {
            let want = (len - done).min(CHUNK) as usize;
            // A verified block's file, mostly in the page cache: as blocking as `sendfile` is.
            let n = file.read_at(&mut buf[..want], offset + done)?;
            if n == 0 {
                // As for `sendfile`: fewer bytes than announced, the connection must not go on.
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "block file ended before the range",
                ));
            }
            self.write_all(&buf[..n]).await?;
            done += n as u64;
        }
        Ok(())
    }

    const PASSES_FDS: bool = false;

    async fn write_with_fd(&mut self, _bytes: &[u8], _fd: BorrowedFd<'_>) -> std::io::Result<()> {
        Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "TLS cannot pass a descriptor"))
    }

    fn portable(mut self) -> Portability<Self> {
        match self.0.get_mut().0.park() {
            Ok(()) => Portability::Moved(Portable::Tls(Box::new(self))),
            Err(e) => Portability::Failed(e),
        }
    }
}

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

pub async fn serve(listener: TcpListener, plane: DataPlane, cancel: CancellationToken) {
    serve_on(listener, plane, cancel).await
}

/// Serves the data plane on TCP with TLS: every connection completes a handshake first.
pub async fn serve_tls(listener: TcpListener, tls: ServerTls, plane: DataPlane, cancel: CancellationToken) {
    serve_on(TlsListener { tcp: listener, tls }, plane, cancel).await
}

/// Serves the data plane on a Unix socket: the sidecar's route for the processes of its pod.
pub async fn serve_unix(listener: UnixListener, plane: DataPlane, cancel: CancellationToken) {
    serve_on(listener, plane, cancel).await
}

async fn serve_on<L: Listener>(listener: L, plane: DataPlane, cancel: CancellationToken) {
    let tracker = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            _ = cancel.cancelled() => break,
            a = listener.accept_one() => a,
        };
        match accepted {
            Ok((accepted, peer)) => match plane.connections.admit(&peer) {
                Ok(permit) => {
                    let establish = listener.establish(accepted);
                    spawn_connection(&tracker, establish, peer, permit, plane.clone(), cancel.clone())
                }
                Err(refusal) => admission::refuse(accepted, &peer, &refusal),
            },
            Err(e) => {
                warn!(err = %e, "accept failed");
                // Out of descriptors or a transient error: pause so a full table is not a spin.
                if strata_common::background::sleep_or_cancel(std::time::Duration::from_millis(50), &cancel)
                    .await
                {
                    break;
                }
            }
        }
    }
    tracker.close();
    tracker.wait().await;
}

fn spawn_connection<S: Connection>(
    tracker: &TaskTracker,
    establish: impl Future<Output = std::io::Result<S>> + Send + 'static,
    peer: Peer,
    permit: Permit,
    plane: DataPlane,
    cancel: CancellationToken,
) {
    let token = tracker.token();
    tracker.spawn(async move {
        let lane = plane.latency_lane.clone();
        let served = async {
            connection(Timed::new(establish.await?, permit), plane.clone(), ConnState::default()).await
        };
        tokio::select! {
            _ = cancel.cancelled() => {}
            r = served => match r {
                Ok(Some(moving)) => lane.serve(moving, plane, cancel, token),
                Ok(None) => {}
                Err(e) => debug!(%peer, err = %e, "data-plane connection ended"),
            }
        }
    });
}

/// What a connection established, carried along when it moves to the latency lane (see
/// [`lane`]): its session, its class, whether its first frame is still to come, and whether it
/// is on the lane already.
pub(crate) struct ConnState {
    session: Session,
    class: QosClass,
    first: bool,
    on_lane: bool,
}

impl Default for ConnState {
    fn default() -> Self {
        // Until the client says otherwise (a `Class` frame after its `Auth`), the default class.
        Self { session: Session::default(), class: QosClass::default(), first: true, on_lane: false }
    }
}

/// Serves one connection's frames until it closes, or until it declares the latency class
/// while the lane is on: then it returns the connection for the lane to go on with.
async fn connection<S: Connection>(
    mut stream: Timed<S>,
    plane: DataPlane,
    state: ConnState,
) -> std::io::Result<Option<Moving>> {
    let mut header = [0u8; REQUEST_HEADER_LEN];
    let ConnState { mut session, mut class, mut first, on_lane } = state;
    loop {
        match stream.read_exact(&mut header).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        let decoded = decode_request_header(&header);
        if let Ok((frame::Op::Auth, len)) = decoded {
            let Some(token) =
                read_body(&mut stream, len, |b| frame::decode_auth_body(b).map(str::to_string)).await?
            else {
                return Ok(None);
            };
            match plane.auth.authenticate(&token).await {
                Ok(s) => session = s,
                Err(refused) => return refuse(&mut stream, refused).await.map(|()| None),
            }
            first = false;
            continue;
        }
        if std::mem::take(&mut first) && decoded.is_ok() {
            // A peer that did not open with an Auth frame, to a cluster that requires one,
            // gets nothing but that answer.
            if let Err(refused) = plane.auth.check(&mut session, Access::Any, None) {
                return refuse(&mut stream, refused).await.map(|()| None);
            }
        }
        match decoded {
            Ok((frame::Op::ReadBlock, len)) => {
                if let Some(req) = read_body(&mut stream, len, ReadBlockRequest::decode_body).await? {
                    match plane.auth.check(&mut session, Access::Read, Some(&req.path)) {
                        Ok(()) => {
                            plane.reading(&req);
                            serve_read(&mut stream, &plane, &req, class).await?
                        }
                        Err((kind, message)) => send_error(&mut stream, req.req_id, kind, &message).await?,
                    }
                }
            }
            Ok((frame::Op::ReadMany, len)) => {
                if let Some(batch) = read_body(&mut stream, len, ReadMany::decode_body).await? {
                    serve_read_many(&mut stream, &plane, &mut session, &batch.items, class).await?
                }
            }
            Ok((op @ (frame::Op::PeerRead | frame::Op::PeerFetch), len)) => {
                if let Some(req) = read_body(&mut stream, len, ReadBlockRequest::decode_body).await? {
                    let allowed = plane.auth.check(&mut session, Access::Read, Some(&req.path));
                    let answer = async {
                        if op == frame::Op::PeerFetch {
                            plane.blocks.fetched_range(&block_read(&req)).await
                        } else {
                            plane.blocks.cached_range(&block_read(&req)).await
                        }
                    };
                    match allowed {
                        Ok(()) => match answer.await {
                            Ok(Some((bytes, source))) => {
                                send_data(&mut stream, req.req_id, source, &bytes).await?
                            }
                            Ok(None) => {
                                let msg =
                                    format!("block {} of {} is not cached here", req.block_index, req.path);
                                send_error(&mut stream, req.req_id, ErrorKind::NotFound, &msg).await?
                            }
                            Err(e) => send_error(&mut stream, req.req_id, e.kind(), &e.to_string()).await?,
                        },
                        Err((kind, message)) => send_error(&mut stream, req.req_id, kind, &message).await?,
                    }
                }
            }
            Ok((op @ (frame::Op::HandOffOffer | frame::Op::HandOffBlock), len)) => {
                // Checked before the body is read: a pushed block's body may be as large as a
                // block, and only a worker may make this worker take one.
                if let Err(refused) = plane.auth.check(&mut session, Access::Worker, None) {
                    return refuse(&mut stream, refused).await.map(|()| None);
                }
                serve_handoff(&mut stream, plane.handoff.as_deref(), op, len).await?
            }
            Ok((frame::Op::WriteBegin, len)) => {
                let allow = |path: &str| plane.auth.check(&mut session, Access::Write, Some(path));
                write::serve_write(&mut stream, &plane.blocks, plane.writeback.as_ref(), len, allow).await?
            }
            Ok((frame::Op::Copy, len)) => {
                if let Some(req) = read_body(&mut stream, len, frame::CopyRequest::decode_body).await? {
                    let allowed = plane
                        .auth
                        .check(&mut session, Access::Read, Some(&req.src))
                        .and_then(|()| plane.auth.check(&mut session, Access::Write, Some(&req.dst)));
                    match allowed {
                        Ok(()) => copy::serve_copy(&mut stream, &plane.blocks, &req).await?,
                        Err((kind, message)) => send_error(&mut stream, req.req_id, kind, &message).await?,
                    }
                }
            }
            Ok((frame::Op::OpenBlock, len)) => {
                if let Some(open) = read_body(&mut stream, len, OpenBlock::decode_body).await? {
                    match plane.auth.check(&mut session, Access::Read, Some(&open.read.path)) {
                        Ok(()) => {
                            plane.reading(&open.read);
                            serve_open(&mut stream, &plane, &open).await?
                        }
                        Err((kind, message)) => {
                            send_error(&mut stream, open.read.req_id, kind, &message).await?
                        }
                    }
                }
            }
            Ok((frame::Op::Class, len)) => {
                if let Some(declared) = read_body(&mut stream, len, frame::decode_class_body).await? {
                    class = declared;
                    if class == QosClass::Latency && !on_lane && plane.latency_lane.enabled() {
                        let (socket, timed) = stream.split();
                        match socket.portable() {
                            Portability::Moved(socket) => {
                                let state = ConnState { session, class, first, on_lane: true };
                                return Ok(Some(Moving { socket, timed, state }));
                            }
                            Portability::Stays(socket) => stream = timed.rejoin(socket),
                            Portability::Failed(e) => return Err(e),
                        }
                    }
                }
            }
            Ok((frame::Op::Release, len)) => {
                // A release has no answer, so a bad one is not answered either: the lease expires.
                let mut body = vec![0u8; len];
                stream.read_exact(&mut body).await?;
                match LeaseRelease::decode_body(&body) {
                    Ok(r) => plane.grants.release(r.kind, r.lease_id),
                    Err(e) => debug!(err = %e, "malformed lease release ignored"),
                }
            }
            Ok((frame::Op::RemoteRead, len)) => {
                if let Some(rr) = read_body(&mut stream, len, RemoteRead::decode_body).await? {
                    let allowed = plane.auth.check(&mut session, Access::Read, None);
                    match allowed.and_then(|()| plane.grants.remote_read(&rr)) {
                        Ok(bytes) => send_data(&mut stream, rr.req_id, Source::Memory, &bytes).await?,
                        Err((kind, message)) => send_error(&mut stream, rr.req_id, kind, &message).await?,
                    }
                }
            }
            Ok((frame::Op::Prefetch, len)) => {
                if let Some(hints) = read_body(&mut stream, len, frame::PrefetchHints::decode_body).await? {
                    let refused = hints
                        .items
                        .iter()
                        .find_map(|r| plane.auth.check(&mut session, Access::Read, Some(&r.path)).err());
                    match (refused, &plane.prefetch) {
                        (Some((kind, message)), _) => {
                            send_error(&mut stream, hints.req_id, kind, &message).await?
                        }
                        (None, None) => {
                            let msg = "a sidecar takes no prefetch hints";
                            send_error(&mut stream, hints.req_id, ErrorKind::Unavailable, msg).await?
                        }
                        (None, Some(prefetch)) => {
                            let queued = prefetch.hint(hints.stream, &hints.items, Instant::now()) as u32;
                            send_data(&mut stream, hints.req_id, Source::Memory, &queued.to_le_bytes())
                                .await?
                        }
                    }
                }
            }
            Ok((frame::Op::View, len)) => {
                if let Some(req_id) = read_body(&mut stream, len, frame::decode_view_body).await? {
                    match plane.auth.check(&mut session, Access::Any, None).map(|()| plane.view.encoded()) {
                        Err((kind, message)) => send_error(&mut stream, req_id, kind, &message).await?,
                        Ok(Some(view)) => send_data(&mut stream, req_id, Source::Memory, &view).await?,
                        Ok(None) => {
                            let msg = "this worker has not heard from the master since it started";
                            send_error(&mut stream, req_id, ErrorKind::Unavailable, msg).await?
                        }
                    }
                }
            }
            Ok((frame::Op::Stat, len)) => {
                if let Some(req) = read_body(&mut stream, len, StatRequest::decode_body).await? {
                    if let Err((kind, message)) =
                        plane.auth.check(&mut session, Access::Read, Some(&req.path))
                    {
                        send_error(&mut stream, req.req_id, kind, &message).await?;
                        continue;
                    }
                    match stat(&plane, &req.path).await {
                        Ok(answer) => {
                            send_data(&mut stream, req.req_id, Source::Ufs, &answer.encode()).await?
                        }
                        // Not under a mount of a table never fetched: this worker cannot tell.
                        Err(ServeError::NoMount(p)) if plane.blocks.mounts().epoch() == 0 => {
                            let msg = format!("{p}: this worker has not learnt the mount table yet");
                            send_error(&mut stream, req.req_id, ErrorKind::Unavailable, &msg).await?
                        }
                        Err(e) => send_error(&mut stream, req.req_id, e.kind(), &e.to_string()).await?,
                    }
                }
            }
            // The connection becomes the lifetime of an RDMA queue pair.
            Ok((frame::Op::RdmaConnect, len)) => {
                if let Err(refused) = plane.auth.check(&mut session, Access::Read, None) {
                    return refuse(&mut stream, refused).await.map(|()| None);
                }
                return rdma_connect(&mut stream, &plane, len).await.map(|()| None);
            }
            Ok((op, _)) => {
                return reject(&mut stream, &format!("{op:?} outside a write")).await.map(|()| None);
            }
            Err(e) => return reject(&mut stream, &e.to_string()).await.map(|()| None),
        }
    }
}

async fn serve_read<S: Connection>(
    stream: &mut S,
    plane: &DataPlane,
    req: &ReadBlockRequest,
    class: QosClass,
) -> std::io::Result<()> {
    let started = Instant::now();
    let read = block_read(req);
    // A cold block's UFS fetch waits for a fetch place by class; the answer for an answer place.
    let read = if plane.blocks.cut_through() {
        match plane.blocks.read_payload_cached(&read).await.transpose() {
            Some(found) => found,
            None => return serve_miss_cut_through(stream, plane, req, read, class, started).await,
        }
    } else {
        plane.blocks.read_payload(&read, class).await
    };
    plane.classes.step_aside(class).await;
    let _place = plane.classes.acquire(class).await;
    answer_read(stream, req, read, started).await
}

/// A miss answered by cut-through: the read runs as a task of its own, so a flight goes on to
/// fill the cache even once its answer is complete, and the answer follows its pieces.
async fn serve_miss_cut_through<S: Connection>(
    stream: &mut S,
    plane: &DataPlane,
    req: &ReadBlockRequest,
    read: BlockRead,
    class: QosClass,
    started: Instant,
) -> std::io::Result<()> {
    let (tap, pieces) = tokio::sync::mpsc::unbounded_channel();
    let blocks = plane.blocks.clone();
    // The tap is dropped when the read ends, which ends the forwarding.
    let reading = tokio::spawn(async move { blocks.read_payload_tapped(&read, class, Some(&tap)).await });
    let outcome = async {
        reading.await.unwrap_or_else(|e| Err(ServeError::Cancelled(format!("the block read stopped: {e}"))))
    };
    let Some(begun) = forward_pieces(stream, plane, req, class, pieces).await? else {
        // Nothing went out: a joined flight, an upstream's block, or a fetch that failed before
        // the range's first byte arrived (answered with a clean error frame).
        let read = outcome.await;
        plane.classes.step_aside(class).await;
        let _place = plane.classes.acquire(class).await;
        return answer_read(stream, req, read, started).await;
    };
    let finished = |plane: &DataPlane| {
        plane.blocks.count_cut_through(true);
        metrics::histogram!(m::READ_SECONDS, "source" => "ufs").record(started.elapsed().as_secs_f64());
    };
    if begun.sent == req.len {
        // The store vouched for every byte as it came (`If-Match`): the block's fetch goes on
        // for the cache alone.
        finished(plane);
        return Ok(());
    }
    match outcome.await {
        Ok(Served { payload: Payload::Bytes(bytes), .. }) if bytes.len() as u64 == req.len => {
            // Whatever the pieces did not bring (they always bring the range today).
            stream.write_all(&bytes[begun.sent as usize..]).await?;
            finished(plane);
            Ok(())
        }
        Ok(_) => {
            plane.blocks.count_cut_through(false);
            Err(std::io::Error::other("a cut-through read was answered otherwise"))
        }
        Err(e) => {
            // The header promised the whole range: a frame cut short is all the client can be
            // told, and it never completes with bytes of a failed fetch.
            plane.blocks.count_cut_through(false);
            warn!(path = %req.path, block = req.block_index, err = %e, sent = begun.sent, "block fetch failed after its answer began; closing the connection");
            Err(std::io::Error::other(format!("block fetch failed after its answer began: {e}")))
        }
    }
}

/// A cut-through answer under way: the payload bytes written, and the answer place it holds.
struct Begun<'a> {
    sent: u64,
    _place: crate::classes::ClassPermit<'a>,
}

/// Writes the answer to `req` from the block's `pieces` as they arrive — the header once the
/// range's first byte is in, then the range's bytes — until the range is whole or the pieces
/// stop. `None` when nothing was written (no piece of the range came).
async fn forward_pieces<'a, S: Connection>(
    stream: &mut S,
    plane: &'a DataPlane,
    req: &ReadBlockRequest,
    class: QosClass,
    mut pieces: tokio::sync::mpsc::UnboundedReceiver<bytes::Bytes>,
) -> std::io::Result<Option<Begun<'a>>> {
    let (start, end) = (req.offset, req.offset + req.len);
    let (mut at, mut begun): (u64, Option<Begun<'a>>) = (0, None);
    while let Some(first) = pieces.recv().await {
        let (mut out, mut len) = (Vec::new(), 0u64);
        let sent = begun.as_ref().map_or(0, |b| b.sent);
        // Whatever else has arrived goes out in the same write.
        let mut next = Some(first);
        while let Some(piece) = next.take().or_else(|| pieces.try_recv().ok()) {
            let from = (start + sent + len).max(at);
            let to = end.min(at + piece.len() as u64);
            if from < to {
                out.push(piece.slice((from - at) as usize..(to - at) as usize));
                len += to - from;
            }
            at += piece.len() as u64;
        }
        if out.is_empty() {
            continue;
        }
        if begun.is_none() {
            plane.classes.step_aside(class).await;
            let place = plane.classes.acquire(class).await;
            let head = ResponseHeader { status: Ok(Source::Ufs), req_id: req.req_id, payload_len: req.len };
            out.insert(0, bytes::Bytes::copy_from_slice(&head.encode()));
            begun = Some(Begun { sent: 0, _place: place });
        }
        write_all_pieces(stream, out).await?;
        let b = begun.as_mut().expect("begun above");
        b.sent += len;
        if b.sent == req.len {
            break;
        }
    }
    Ok(begun)
}

/// Writes `pieces` in order, as few writes as the stream allows.
async fn write_all_pieces<S: AsyncWrite + Unpin>(
    stream: &mut S,
    mut pieces: Vec<bytes::Bytes>,
) -> std::io::Result<()> {
    let mut first = 0;
    while first < pieces.len() {
        let slices: Vec<std::io::IoSlice<'_>> =
            pieces[first..].iter().map(|p| std::io::IoSlice::new(p)).collect();
        let mut n = stream.write_vectored(&slices).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        while n > 0 {
            let head = &mut pieces[first];
            if n >= head.len() {
                n -= head.len();
                first += 1;
            } else {
                *head = head.slice(n..);
                n = 0;
            }
        }
    }
    Ok(())
}

/// A `ReadMany`: every item's access checked, the items read [`READ_MANY_CONCURRENCY`] at a
/// time, and each answered in the order asked as its own `ReadBlock` would be, so the client
/// matches answers to items by position and request id alike.
async fn serve_read_many<S: Connection>(
    stream: &mut S,
    plane: &DataPlane,
    session: &mut Session,
    items: &[ReadBlockRequest],
    class: QosClass,
) -> std::io::Result<()> {
    use futures::StreamExt;
    metrics::counter!(m::READ_MANY_REQUESTS).increment(1);
    metrics::counter!(m::READ_MANY_ITEMS).increment(items.len() as u64);
    // Checked up front: the check needs the session mutably, the reads run side by side.
    let allowed: Vec<Result<(), Refused>> =
        items.iter().map(|req| plane.auth.check(session, Access::Read, Some(&req.path))).collect();
    // Made here rather than in a stream combinator's closure, whose borrows the compiler
    // cannot prove general enough for the connection's `Send` future.
    let reads: Vec<_> =
        items.iter().zip(allowed).map(|(req, allowed)| read_item(plane, req, allowed, class)).collect();
    let mut answers = futures::stream::iter(reads).buffered(READ_MANY_CONCURRENCY);
    while let Some((req, read, started)) = answers.next().await {
        plane.classes.step_aside(class).await;
        let _place = plane.classes.acquire(class).await;
        match read {
            Ok(read) => answer_read(stream, req, read, started).await?,
            Err((kind, message)) => send_error(stream, req.req_id, kind, &message).await?,
        }
    }
    Ok(())
}

/// One item of a `ReadMany`: its read (when allowed) and when it began.
async fn read_item<'a>(
    plane: &'a DataPlane,
    req: &'a ReadBlockRequest,
    allowed: Result<(), Refused>,
    class: QosClass,
) -> (&'a ReadBlockRequest, Result<Result<Served, ServeError>, Refused>, Instant) {
    let started = Instant::now();
    let read = match allowed {
        Ok(()) => {
            plane.reading(req);
            Ok(plane.blocks.read_payload(&block_read(req), class).await)
        }
        Err(refused) => Err(refused),
    };
    (req, read, started)
}

/// Answers one block read with its payload (from memory, or `sendfile` from its block file) or
/// its error frame.
async fn answer_read<S: Connection>(
    stream: &mut S,
    req: &ReadBlockRequest,
    read: Result<Served, ServeError>,
    started: Instant,
) -> std::io::Result<()> {
    match read {
        Ok(Served { payload, source, .. }) => {
            match payload {
                Payload::Bytes(bytes) => send_data(stream, req.req_id, source, &bytes).await?,
                Payload::File { file, offset, len } => {
                    let head = ResponseHeader { status: Ok(source), req_id: req.req_id, payload_len: len };
                    stream.write_all(&head.encode()).await?;
                    stream.send_file(&file, offset, len).await?;
                    metrics::counter!(m::ZERO_COPY_BYTES).increment(len);
                }
            }
            let label = match source {
                Source::Memory => "memory",
                Source::Nvme => "nvme",
                Source::Ufs => "ufs",
            };
            metrics::histogram!(m::READ_SECONDS, "source" => label).record(started.elapsed().as_secs_f64());
            Ok(())
        }
        Err(e) => {
            debug!(path = %req.path, block = req.block_index, err = %e, "block read failed");
            send_error(stream, req.req_id, e.kind(), &e.to_string()).await
        }
    }
}

/// A path's metadata from the UFS through this worker's mount, as the master's `Stat` answers it.
async fn stat(plane: &DataPlane, raw: &str) -> Result<FileStat, ServeError> {
    let resolved = plane.blocks.mounts().resolve(raw).await?;
    let meta = resolved.mount.ufs.stat(&resolved.rel).await?;
    let file_id = if meta.is_dir {
        String::new()
    } else {
        strata_common::block::file_identity(&resolved.mount.uri, &resolved.rel, resolved.mount.block_size)
    };
    Ok(FileStat {
        path: resolved.path,
        is_dir: meta.is_dir,
        size: meta.size,
        version: meta.version,
        mtime_ms: meta.mtime_ms,
        block_size: resolved.mount.block_size,
        file_id,
    })
}

async fn serve_open<S: Connection>(
    stream: &mut S,
    plane: &DataPlane,
    open: &OpenBlock,
) -> std::io::Result<()> {
    let req_id = open.read.req_id;
    if open.kind.is_fd() && !S::PASSES_FDS {
        return send_error(stream, req_id, ErrorKind::Unavailable, "descriptor grants need a Unix socket")
            .await;
    }
    let granted = match plane.grants.open(&plane.blocks, open.kind, &block_read(&open.read)).await {
        Ok(g) => g,
        Err(e) => {
            debug!(path = %open.read.path, block = open.read.block_index, kind = ?open.kind, err = %e, "grant refused");
            return send_error(stream, req_id, e.kind(), &e.to_string()).await;
        }
    };
    let head =
        ResponseHeader { status: Ok(granted.source), req_id, payload_len: BlockGrant::ENCODED_LEN as u64 }
            .encode();
    let mut out = Vec::with_capacity(head.len() + BlockGrant::ENCODED_LEN);
    out.extend_from_slice(&head);
    out.extend_from_slice(&granted.grant.encode());
    let Some(fd) = granted.fd else {
        return stream.write_all(&out).await;
    };
    let sent = stream.write_with_fd(&out, fd.as_fd()).await;
    if sent.is_err() {
        // The reader never got the descriptor: nothing to keep for it.
        plane.grants.release(GrantKind::Fd, granted.grant.lease_id);
    }
    sent
}

async fn rdma_connect<S: Connection>(
    stream: &mut S,
    plane: &DataPlane,
    body_len: usize,
) -> std::io::Result<()> {
    let Some(remote) = read_body(stream, body_len, RdmaEndpoint::decode).await? else {
        return Ok(());
    };
    let (local, queue_pair) = match plane.grants.connect_rdma(remote) {
        Ok(c) => c,
        Err(e) => return send_error(stream, 0, e.kind(), &e.to_string()).await,
    };
    send_data(stream, 0, Source::Memory, &local.encode()).await?;
    // The client's READs go to the queue pair, not through this socket; the socket only says
    // how long the client is there. Anything it sends is ignored.
    let mut sink = [0u8; 64];
    while stream.read(&mut sink).await? > 0 {}
    drop(queue_pair);
    Ok(())
}

/// Reads a request body of `body_len` bytes and decodes it. A malformed one is answered as a
/// malformed frame ([`reject`]: the connection closes) and gives `None`.
async fn read_body<S, T>(
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
async fn send_data<S: AsyncWrite + Unpin>(
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

/// Answers a malformed frame and closes the connection (see [`close_with`]).
async fn reject<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, message: &str) -> std::io::Result<()> {
    close_with(stream, ErrorKind::BadFrame, message).await
}

/// A hand-off offer or pushed block from a peer worker (its role already checked).
async fn serve_handoff<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    receiver: Option<&crate::handoff::Receiver>,
    op: frame::Op,
    len: usize,
) -> std::io::Result<()> {
    const NO_RING: &str = "this worker takes no hand-offs (a sidecar is on no ring)";
    if op == frame::Op::HandOffOffer {
        let Some(offer) = read_body(stream, len, frame::HandOffOffer::decode_body).await? else {
            return Ok(());
        };
        return match receiver {
            Some(receiver) => send_data(stream, offer.req_id, Source::Memory, &receiver.offer(&offer)).await,
            None => send_error(stream, offer.req_id, ErrorKind::Unavailable, NO_RING).await,
        };
    }
    let Some(block) = read_body(stream, len, frame::HandOffBlock::decode_body).await? else { return Ok(()) };
    let req_id = block.req_id;
    match receiver {
        Some(receiver) if receiver.take(block).await => send_data(stream, req_id, Source::Memory, &[]).await,
        Some(_) => {
            send_error(stream, req_id, ErrorKind::Unavailable, "hand-off block not asked for or not kept")
                .await
        }
        None => send_error(stream, req_id, ErrorKind::Unavailable, NO_RING).await,
    }
}

/// Answers a peer that did not prove who it is (or that this worker cannot check yet) and
/// closes the connection: nothing it sent after is read.
async fn refuse<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, refused: Refused) -> std::io::Result<()> {
    let (kind, message) = refused;
    metrics::counter!(m::AUTH_REFUSED, "kind" => kind.as_str()).increment(1);
    debug!(%kind, %message, "data-plane connection refused");
    close_with(stream, kind, &message).await
}

/// Sends an error frame for request 0 (the answer to whatever the peer sent) and closes. The
/// peer may have sent more bytes we will never read; closing with them unread makes the kernel
/// send a reset that can destroy our error frame in flight, so we half-close first and drain
/// briefly.
async fn close_with<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    kind: ErrorKind,
    message: &str,
) -> std::io::Result<()> {
    send_error(stream, 0, kind, message).await?;
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

async fn send_error<S: AsyncWrite + Unpin>(
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

#[cfg(test)]
mod tests;
