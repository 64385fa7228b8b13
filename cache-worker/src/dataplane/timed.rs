//! Deadlines on one data-plane connection, as a wrapper around its stream ([`Timed`]), so no
//! read or write path needs its own `timeout` call and any stream (TCP, Unix, TLS) gets them.
//!
//! The wrapper follows the request framing in the bytes it reads ([`FrameTracker`], sans-IO):
//! - *idle* — no request started: reads wait at most `idle_timeout_ms` (clients pool
//!   connections, so idle is normal, but an abandoned socket must go);
//! - *in a frame* — from the first header byte to the last body byte, the whole frame must
//!   arrive within `frame_timeout_ms` of that first byte (a peer that sends a header and never
//!   the body is closed); every `WriteData` of a write is a frame of its own;
//! - *writing* — once a write is pending (the peer does not take our response) or a file or
//!   descriptor is being sent, everything written until the peer's next request must go out
//!   within `frame_timeout_ms`.
//!
//! Time spent serving a request (a UFS fetch, a write's commit) is not the peer's: no deadline
//! runs while the worker is not waiting on the socket. After `RdmaConnect` the connection only
//! says how long the client's queue pair lives and carries no frames, and after a malformed
//! header it is being closed (with its own short drain): both are left without read deadlines.
//!
//! A deadline that passes fails the pending call with `TimedOut`, and every later call too;
//! the connection then closes as after any I/O error. Each is counted once by phase.

use std::io;
use std::os::fd::BorrowedFd;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use strata_common::frame::{self, REQUEST_HEADER_LEN, decode_request_header};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

use super::Connection;
use super::admission::Permit;

/// The deadlines of a connection; `None` is no deadline.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Timeouts {
    /// A started request frame must arrive whole, and a pending response must be taken, within it.
    pub frame: Option<Duration>,
    /// A connection with no request started is closed after it.
    pub idle: Option<Duration>,
}

/// Which deadline passed, for the metric's `phase` label and the error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stall {
    Idle,
    Frame,
    Write,
}

impl Stall {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Stall::Idle => "idle",
            Stall::Frame => "frame",
            Stall::Write => "write",
        }
    }

    fn error(self) -> io::Error {
        let msg = match self {
            Stall::Idle => "no request within idle_timeout_ms",
            Stall::Frame => "request frame not received whole within frame_timeout_ms",
            Stall::Write => "response not taken by the peer within frame_timeout_ms",
        };
        io::Error::new(io::ErrorKind::TimedOut, msg)
    }
}

/// Where the peer is in its stream of request frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Between frames.
    Idle,
    /// `got` bytes of a header received.
    Header { got: usize },
    /// `left` bytes of the body to come; `unframed_after` for `RdmaConnect`, whose body ends the framing.
    Body { left: u64, unframed_after: bool },
    /// No more frames: after `RdmaConnect`, or after a malformed header.
    Unframed,
}

/// Follows frame boundaries in the bytes read from a connection (sans-IO).
#[derive(Debug)]
struct FrameTracker {
    phase: Phase,
    header: [u8; REQUEST_HEADER_LEN],
}

impl FrameTracker {
    fn new() -> Self {
        Self { phase: Phase::Idle, header: [0; REQUEST_HEADER_LEN] }
    }

    /// Takes bytes read; returns whether a frame started in them.
    fn feed(&mut self, mut bytes: &[u8]) -> bool {
        let mut started = false;
        while !bytes.is_empty() {
            match self.phase {
                Phase::Unframed => return started,
                Phase::Idle => {
                    started = true;
                    self.phase = Phase::Header { got: 0 };
                }
                Phase::Header { got } => {
                    let n = (REQUEST_HEADER_LEN - got).min(bytes.len());
                    self.header[got..got + n].copy_from_slice(&bytes[..n]);
                    bytes = &bytes[n..];
                    self.phase = if got + n < REQUEST_HEADER_LEN {
                        Phase::Header { got: got + n }
                    } else {
                        match decode_request_header(&self.header) {
                            Ok((op, len)) => Self::after_header(op == frame::Op::RdmaConnect, len as u64),
                            Err(_) => Phase::Unframed,
                        }
                    };
                }
                Phase::Body { left, unframed_after } => {
                    let n = left.min(bytes.len() as u64);
                    bytes = &bytes[n as usize..];
                    self.phase = Self::after_header(unframed_after, left - n);
                }
            }
        }
        started
    }

    fn after_header(unframed_after: bool, left: u64) -> Phase {
        match (left, unframed_after) {
            (0, false) => Phase::Idle,
            (0, true) => Phase::Unframed,
            (left, _) => Phase::Body { left, unframed_after },
        }
    }
}

/// A data-plane stream under the connection's deadlines (see the module docs), holding the
/// connection's [`Permit`] for as long as it lives.
pub(crate) struct Timed<S> {
    inner: S,
    permit: Permit,
    timeouts: Timeouts,
    tracker: FrameTracker,
    /// The deadline of the frame being received, or of an idle wait once one began.
    read_deadline: Option<Instant>,
    /// The deadline of what is written since the last request started, once a write waited.
    write_deadline: Option<Instant>,
    read_timer: Option<Pin<Box<Sleep>>>,
    write_timer: Option<Pin<Box<Sleep>>>,
    /// Set once a deadline passed: every later call fails.
    stalled: Option<Stall>,
}

impl<S> Timed<S> {
    pub(crate) fn new(inner: S, permit: Permit) -> Self {
        let timeouts = permit.timeouts();
        Self {
            inner,
            permit,
            timeouts,
            tracker: FrameTracker::new(),
            read_deadline: None,
            write_deadline: None,
            read_timer: None,
            write_timer: None,
            stalled: None,
        }
    }

    /// Splits off the stream, keeping the deadlines, the frame tracker and the admission place
    /// for [`rejoin`](Timed::rejoin) around the same socket on another runtime. The timers
    /// belong to the runtime that armed them, so they are dropped and armed again by the next
    /// wait.
    pub(crate) fn split(self) -> (S, Timed<()>) {
        self.swap_inner(())
    }

    /// This stream's deadlines, tracker and place around `inner` instead, with no timer armed
    /// (a timer belongs to the runtime that armed it), and the stream it held.
    fn swap_inner<T>(self, inner: T) -> (S, Timed<T>) {
        let Self { inner: held, permit, timeouts, tracker, read_deadline, write_deadline, stalled, .. } =
            self;
        let timed = Timed {
            inner,
            permit,
            timeouts,
            tracker,
            read_deadline,
            write_deadline,
            read_timer: None,
            write_timer: None,
            stalled,
        };
        (held, timed)
    }

    fn on_read(&mut self, bytes: &[u8]) {
        if self.tracker.feed(bytes) {
            // A new request: the previous response was taken.
            self.write_deadline = None;
            self.read_deadline = self.timeouts.frame.map(|t| Instant::now() + t);
        }
        if matches!(self.tracker.phase, Phase::Idle | Phase::Unframed) {
            self.read_deadline = None;
        }
    }

    /// The read deadline and what passing it means, arming the idle one on the first wait.
    fn read_deadline(&mut self) -> Option<(Instant, Stall)> {
        match self.tracker.phase {
            Phase::Unframed => None,
            Phase::Idle => {
                let idle = self.timeouts.idle?;
                Some((*self.read_deadline.get_or_insert_with(|| Instant::now() + idle), Stall::Idle))
            }
            Phase::Header { .. } | Phase::Body { .. } => self.read_deadline.map(|d| (d, Stall::Frame)),
        }
    }

    /// The write deadline, armed on the first wait since the last request started.
    fn write_deadline(&mut self) -> Option<Instant> {
        let frame = self.timeouts.frame?;
        Some(*self.write_deadline.get_or_insert_with(|| Instant::now() + frame))
    }

    fn stall(&mut self, stall: Stall) -> io::Error {
        if self.stalled.is_none() {
            self.stalled = Some(stall);
            self.permit.count_stall(stall);
        }
        stall.error()
    }

    /// Fails the call if `deadline` passed (registering a wake-up for it otherwise).
    fn expired(timer: &mut Option<Pin<Box<Sleep>>>, deadline: Option<Instant>, cx: &mut Context<'_>) -> bool {
        let Some(deadline) = deadline else { return false };
        let timer = match timer {
            Some(t) => {
                if t.deadline() != deadline {
                    t.as_mut().reset(deadline);
                }
                t
            }
            None => timer.insert(Box::pin(tokio::time::sleep_until(deadline))),
        };
        timer.as_mut().poll(cx).is_ready()
    }

    fn poll_writing<T>(
        &mut self,
        cx: &mut Context<'_>,
        op: impl FnOnce(Pin<&mut S>, &mut Context<'_>) -> Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>>
    where
        S: Unpin,
    {
        if let Some(stall) = self.stalled {
            return Poll::Ready(Err(stall.error()));
        }
        match op(Pin::new(&mut self.inner), cx) {
            Poll::Pending => {
                let deadline = self.write_deadline();
                if Self::expired(&mut self.write_timer, deadline, cx) {
                    return Poll::Ready(Err(self.stall(Stall::Write)));
                }
                Poll::Pending
            }
            ready => ready,
        }
    }
}

impl Timed<()> {
    /// The deadlines and place [`split`](Timed::split) off, around `inner`.
    pub(crate) fn rejoin<S>(self, inner: S) -> Timed<S> {
        self.swap_inner(inner).1
    }
}

/// Runs a write that bypasses `poll_write` (a file, a descriptor) under the write deadline
/// (the pieces of a [`Timed`] it needs, since `op` borrows the stream).
async fn bounded_write(
    stalled: &mut Option<Stall>,
    write_deadline: &mut Option<Instant>,
    timeouts: Timeouts,
    permit: &Permit,
    op: impl Future<Output = io::Result<()>>,
) -> io::Result<()> {
    if let Some(stall) = *stalled {
        return Err(stall.error());
    }
    let Some(frame) = timeouts.frame else { return op.await };
    let deadline = *write_deadline.get_or_insert_with(|| Instant::now() + frame);
    match tokio::time::timeout_at(deadline, op).await {
        Ok(r) => r,
        Err(_) => {
            *stalled = Some(Stall::Write);
            permit.count_stall(Stall::Write);
            Err(Stall::Write.error())
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Timed<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(stall) = this.stalled {
            return Poll::Ready(Err(stall.error()));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Pending => {
                let deadline = this.read_deadline();
                if Self::expired(&mut this.read_timer, deadline.map(|(d, _)| d), cx) {
                    let stall = deadline.map_or(Stall::Frame, |(_, s)| s);
                    return Poll::Ready(Err(this.stall(stall)));
                }
                Poll::Pending
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Ready(Ok(())) => {
                let filled = buf.filled();
                if filled.len() > before {
                    this.on_read(&filled[before..]);
                }
                Poll::Ready(Ok(()))
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Timed<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.get_mut().poll_writing(cx, |s, cx| s.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_writing(cx, |s, cx| s.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().poll_writing(cx, |s, cx| s.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().poll_writing(cx, |s, cx| s.poll_shutdown(cx))
    }
}

impl<S: Connection> Connection for Timed<S> {
    const PASSES_FDS: bool = S::PASSES_FDS;

    async fn send_file(&mut self, file: &std::fs::File, offset: u64, len: u64) -> io::Result<()> {
        let Self { inner, permit, timeouts, write_deadline, stalled, .. } = self;
        bounded_write(stalled, write_deadline, *timeouts, permit, inner.send_file(file, offset, len)).await
    }

    async fn write_with_fd(&mut self, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<()> {
        let Self { inner, permit, timeouts, write_deadline, stalled, .. } = self;
        bounded_write(stalled, write_deadline, *timeouts, permit, inner.write_with_fd(bytes, fd)).await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use strata_common::frame::{Op, request_header};
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    use super::*;
    use crate::WorkerConfig;
    use crate::dataplane::admission::{Connections, Peer};

    #[test]
    fn the_tracker_follows_frames_byte_by_byte_and_in_bulk() {
        let mut frames = request_header(Op::WriteData, 5).to_vec();
        frames.extend_from_slice(b"hello");
        frames.extend_from_slice(&request_header(Op::WriteEnd, 0));
        frames.extend_from_slice(&request_header(Op::Stat, 3));
        frames.extend_from_slice(b"abc");

        let mut t = FrameTracker::new();
        let mut starts = 0;
        let mut idle_after = Vec::new();
        for (i, b) in frames.iter().enumerate() {
            starts += t.feed(std::slice::from_ref(b)) as usize;
            if t.phase == Phase::Idle {
                idle_after.push(i + 1);
            }
        }
        assert_eq!(starts, 3);
        assert_eq!(idle_after, vec![17, 29, 44], "idle exactly at each frame's end");

        let mut t = FrameTracker::new();
        assert!(t.feed(&frames));
        assert_eq!(t.phase, Phase::Idle);
        assert!(!t.feed(&[]));
        assert!(t.feed(&frames[..3]));
        assert_eq!(t.phase, Phase::Header { got: 3 });
        assert!(!t.feed(&frames[3..14]));
        assert_eq!(t.phase, Phase::Body { left: 3, unframed_after: false });
    }

    #[test]
    fn rdma_connect_and_a_bad_header_end_the_framing() {
        let mut t = FrameTracker::new();
        let mut rdma = request_header(Op::RdmaConnect, 2).to_vec();
        rdma.extend_from_slice(b"qp");
        t.feed(&rdma);
        assert_eq!(t.phase, Phase::Unframed);
        assert!(!t.feed(&request_header(Op::Stat, 3)), "nothing after it is a frame");

        let mut t = FrameTracker::new();
        t.feed(b"GET / HTTP/1.1\r\n");
        assert_eq!(t.phase, Phase::Unframed);
    }

    fn timed(
        frame_ms: u64,
        idle_ms: u64,
        buffer: usize,
    ) -> (Timed<DuplexStream>, DuplexStream, Arc<Connections>) {
        let connections = Arc::new(Connections::from_config(&WorkerConfig {
            frame_timeout_ms: frame_ms,
            idle_timeout_ms: idle_ms,
            ..WorkerConfig::default()
        }));
        let permit = connections.admit(&Peer::Tcp(([127, 0, 0, 1], 1).into())).unwrap();
        let (ours, theirs) = tokio::io::duplex(buffer);
        (Timed::new(ours, permit), theirs, connections)
    }

    #[tokio::test]
    async fn a_frame_must_arrive_whole_within_the_frame_timeout() {
        let (mut stream, mut peer, connections) = timed(200, 60_000, 1 << 16);
        // A steady frame slower than nothing but within the deadline is fine.
        peer.write_all(&request_header(Op::WriteData, 4)).await.unwrap();
        let mut header = [0u8; REQUEST_HEADER_LEN];
        stream.read_exact(&mut header).await.unwrap();
        let reader = async {
            let mut body = [0u8; 4];
            stream.read_exact(&mut body).await.map(|_| body)
        };
        let writer = async {
            for b in b"data" {
                tokio::time::sleep(Duration::from_millis(20)).await;
                peer.write_all(&[*b]).await.unwrap();
            }
        };
        let (body, ()) = tokio::join!(reader, writer);
        assert_eq!(&body.unwrap(), b"data");

        // A header and half a body, then nothing: closed at the deadline, counted once.
        peer.write_all(&request_header(Op::WriteData, 100)).await.unwrap();
        peer.write_all(&[0; 50]).await.unwrap();
        stream.read_exact(&mut header).await.unwrap();
        let started = std::time::Instant::now();
        let mut body = [0u8; 100];
        let err = stream.read_exact(&mut body).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
        assert_eq!(
            stream.read(&mut body).await.unwrap_err().kind(),
            io::ErrorKind::TimedOut,
            "and stays failed"
        );
        let s = connections.snapshot();
        assert_eq!((s.frame_timeouts, s.idle_timeouts, s.write_timeouts), (1, 0, 0));
        drop(stream);
        assert_eq!(connections.snapshot().open, 0, "the permit went with the stream");
    }

    #[tokio::test]
    async fn an_idle_wait_has_its_own_longer_deadline() {
        let (mut stream, mut peer, connections) = timed(50, 400, 1 << 16);
        let mut header = [0u8; REQUEST_HEADER_LEN];
        // Idle longer than the frame timeout between frames is fine.
        let read = stream.read_exact(&mut header);
        let write = async {
            tokio::time::sleep(Duration::from_millis(150)).await;
            peer.write_all(&request_header(Op::WriteEnd, 0)).await.unwrap();
        };
        let (r, ()) = tokio::join!(read, write);
        r.unwrap();
        let started = std::time::Instant::now();
        let err = stream.read_exact(&mut header).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= Duration::from_millis(350), "{:?}", started.elapsed());
        let s = connections.snapshot();
        assert_eq!((s.frame_timeouts, s.idle_timeouts), (0, 1));
    }

    #[tokio::test]
    async fn a_peer_that_does_not_take_a_response_is_dropped() {
        let (mut stream, peer, connections) = timed(200, 60_000, 1024);
        let err = stream.write_all(&vec![7u8; 1 << 20]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(connections.snapshot().write_timeouts, 1);
        drop(peer);
    }

    #[tokio::test]
    async fn after_rdma_connect_the_connection_may_stay_quiet() {
        let (mut stream, mut peer, _connections) = timed(50, 50, 1 << 16);
        peer.write_all(&request_header(Op::RdmaConnect, 0)).await.unwrap();
        let mut header = [0u8; REQUEST_HEADER_LEN];
        stream.read_exact(&mut header).await.unwrap();
        let mut sink = [0u8; 8];
        let quiet = tokio::time::timeout(Duration::from_millis(300), stream.read(&mut sink)).await;
        assert!(quiet.is_err(), "no deadline closed it: {quiet:?}");
    }
}
