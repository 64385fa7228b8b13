//! Who may hold a data-plane connection, decided at accept time: at most `max_connections`
//! open in this process, at most `max_connections_per_peer` from one TCP peer address, and on
//! a sidecar's Unix socket only the uids it allows (`SO_PEERCRED`). A connection over a limit
//! is answered with one error frame and closed at once by the accept loop ([`refuse`]): a
//! non-blocking send, a half-close, a non-blocking read of what the peer already sent (so the
//! close does not reset the frame away) and the close — never queued, never awaited.
//!
//! An admitted connection holds a [`Permit`] for its lifetime (inside its
//! [`Timed`](super::timed::Timed) stream); dropping it gives the places back.

use std::collections::HashMap;
use std::fmt;
use std::io::Read;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use strata_common::ErrorKind;
use strata_common::frame::{MAX_ERROR_MESSAGE, ResponseHeader};
use tracing::debug;

use super::timed::{Stall, Timeouts};
use crate::WorkerConfig;
use crate::metrics_defs as m;

/// The peer of an accepted connection, as the kernel tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Peer {
    Tcp(SocketAddr),
    /// A Unix-socket peer's credentials (`SO_PEERCRED`); `None` when the kernel gave none.
    Unix {
        uid: Option<u32>,
        pid: Option<i32>,
    },
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Peer::Tcp(addr) => addr.fmt(f),
            Peer::Unix { uid, pid } => {
                write!(f, "unix(uid={}, pid={})", opt(uid), opt(pid))
            }
        }
    }
}

fn opt<T: fmt::Display>(v: &Option<T>) -> String {
    v.as_ref().map_or_else(|| "?".to_string(), T::to_string)
}

/// Why a connection was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    MaxConnections(usize),
    PerPeer(usize, IpAddr),
    PeerUid(Option<u32>),
}

impl Refusal {
    /// The metric's `reason` label.
    fn reason(&self) -> &'static str {
        match self {
            Refusal::MaxConnections(_) => "max_connections",
            Refusal::PerPeer(..) => "per_peer",
            Refusal::PeerUid(_) => "peer_uid",
        }
    }

    fn kind(&self) -> ErrorKind {
        match self {
            Refusal::MaxConnections(_) | Refusal::PerPeer(..) => ErrorKind::ResourceExhausted,
            Refusal::PeerUid(_) => ErrorKind::PermissionDenied,
        }
    }

    fn message(&self) -> String {
        match self {
            Refusal::MaxConnections(n) => {
                format!("this worker has its limit of {n} data-plane connections open (max_connections)")
            }
            Refusal::PerPeer(n, ip) => {
                format!("{ip} has its limit of {n} data-plane connections open (max_connections_per_peer)")
            }
            Refusal::PeerUid(uid) => format!(
                "uid {} may not use this socket: only the sidecar's own uid, root and socket_allowed_uids",
                opt(uid)
            ),
        }
    }
}

/// What a worker counts of its connections (besides the process-wide metrics), for tests.
#[derive(Debug, Default)]
struct Counts {
    refused_max_connections: AtomicU64,
    refused_per_peer: AtomicU64,
    refused_peer_uid: AtomicU64,
    idle_timeouts: AtomicU64,
    frame_timeouts: AtomicU64,
    write_timeouts: AtomicU64,
}

/// The counts at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnectionSnapshot {
    pub open: usize,
    pub refused_max_connections: u64,
    pub refused_per_peer: u64,
    pub refused_peer_uid: u64,
    pub idle_timeouts: u64,
    pub frame_timeouts: u64,
    pub write_timeouts: u64,
}

/// The data plane's open connections and their limits, one per worker or sidecar.
#[derive(Debug)]
pub struct Connections {
    max_connections: usize,
    max_per_peer: usize,
    /// Unix-socket peers allowed besides root; holds the process's own uid.
    allowed_uids: Vec<u32>,
    timeouts: Timeouts,
    open: AtomicUsize,
    per_peer: Mutex<HashMap<IpAddr, usize>>,
    counts: Counts,
}

impl Connections {
    pub fn from_config(config: &WorkerConfig) -> Self {
        let ms = |v: u64| (v > 0).then(|| Duration::from_millis(v));
        // SAFETY: geteuid has no preconditions and cannot fail.
        let own_uid = unsafe { libc::geteuid() };
        let mut allowed_uids = config.socket_allowed_uids.clone();
        allowed_uids.push(own_uid);
        Self {
            max_connections: config.max_connections,
            max_per_peer: config.max_connections_per_peer,
            allowed_uids,
            timeouts: Timeouts { frame: ms(config.frame_timeout_ms), idle: ms(config.idle_timeout_ms) },
            open: AtomicUsize::new(0),
            per_peer: Mutex::new(HashMap::new()),
            counts: Counts::default(),
        }
    }

    pub fn snapshot(&self) -> ConnectionSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let c = &self.counts;
        ConnectionSnapshot {
            open: self.open.load(Ordering::Relaxed),
            refused_max_connections: get(&c.refused_max_connections),
            refused_per_peer: get(&c.refused_per_peer),
            refused_peer_uid: get(&c.refused_peer_uid),
            idle_timeouts: get(&c.idle_timeouts),
            frame_timeouts: get(&c.frame_timeouts),
            write_timeouts: get(&c.write_timeouts),
        }
    }

    /// A permit for a connection from `peer`, or why it is refused (counted).
    pub(crate) fn admit(self: &Arc<Self>, peer: &Peer) -> Result<Permit, Refusal> {
        let admitted = self.try_admit(peer);
        if let Err(refusal) = &admitted {
            let counter = match refusal {
                Refusal::MaxConnections(_) => &self.counts.refused_max_connections,
                Refusal::PerPeer(..) => &self.counts.refused_per_peer,
                Refusal::PeerUid(_) => &self.counts.refused_peer_uid,
            };
            counter.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(m::CONNECTIONS_REFUSED, "reason" => refusal.reason()).increment(1);
        }
        admitted
    }

    fn try_admit(self: &Arc<Self>, peer: &Peer) -> Result<Permit, Refusal> {
        let ip = match *peer {
            Peer::Tcp(addr) => Some(addr.ip()),
            Peer::Unix { uid, .. } => {
                if !uid.is_some_and(|u| u == 0 || self.allowed_uids.contains(&u)) {
                    return Err(Refusal::PeerUid(uid));
                }
                None
            }
        };
        let open = self.open.fetch_add(1, Ordering::Relaxed);
        let refuse = |refusal| {
            self.open.fetch_sub(1, Ordering::Relaxed);
            Err(refusal)
        };
        if self.max_connections > 0 && open >= self.max_connections {
            return refuse(Refusal::MaxConnections(self.max_connections));
        }
        let ip = ip.filter(|_| self.max_per_peer > 0);
        if let Some(ip) = ip {
            let mut per_peer = self.per_peer.lock().unwrap_or_else(|p| p.into_inner());
            let n = per_peer.entry(ip).or_default();
            if *n >= self.max_per_peer {
                return refuse(Refusal::PerPeer(self.max_per_peer, ip));
            }
            *n += 1;
        }
        metrics::gauge!(m::CONNECTIONS_OPEN).increment(1.0);
        Ok(Permit { connections: self.clone(), ip })
    }
}

/// One admitted connection's places in the limits, given back on drop.
#[derive(Debug)]
pub(crate) struct Permit {
    connections: Arc<Connections>,
    /// The peer address counted against `max_connections_per_peer`.
    ip: Option<IpAddr>,
}

impl Permit {
    pub(crate) fn timeouts(&self) -> Timeouts {
        self.connections.timeouts
    }

    pub(crate) fn count_stall(&self, stall: Stall) {
        let c = &self.connections.counts;
        let counter = match stall {
            Stall::Idle => &c.idle_timeouts,
            Stall::Frame => &c.frame_timeouts,
            Stall::Write => &c.write_timeouts,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(m::CONNECTION_TIMEOUTS, "phase" => stall.label()).increment(1);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(ip) = self.ip {
            let mut per_peer = self.connections.per_peer.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(n) = per_peer.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    per_peer.remove(&ip);
                }
            }
        }
        self.connections.open.fetch_sub(1, Ordering::Relaxed);
        metrics::gauge!(m::CONNECTIONS_OPEN).decrement(1.0);
    }
}

/// Answers a refused connection with one error frame and closes it, without waiting: a
/// non-blocking send into the empty send buffer, a half-close so the frame is followed by a
/// FIN, and a non-blocking read of what the peer already sent (unread bytes at close would
/// make the kernel send a reset, which can destroy the frame before the peer reads it).
pub(crate) fn refuse<S: AsFd>(stream: S, peer: &Peer, refusal: &Refusal) {
    let message = refusal.message();
    let msg = &message.as_bytes()[..message.len().min(MAX_ERROR_MESSAGE)];
    let head =
        ResponseHeader { status: Err(refusal.kind()), req_id: 0, payload_len: msg.len() as u64 }.encode();
    let mut frame = Vec::with_capacity(head.len() + msg.len());
    frame.extend_from_slice(&head);
    frame.extend_from_slice(msg);
    let socket = socket2::SockRef::from(&stream);
    let sent = socket.send(&frame);
    let _ = socket.shutdown(std::net::Shutdown::Write);
    let mut sink = [0u8; 1024];
    let _ = (&*socket).read(&mut sink);
    debug!(%peer, reason = refusal.reason(), sent = sent.is_ok(), "data-plane connection refused");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connections(max: usize, per_peer: usize, uids: Vec<u32>) -> Arc<Connections> {
        Arc::new(Connections::from_config(&WorkerConfig {
            max_connections: max,
            max_connections_per_peer: per_peer,
            socket_allowed_uids: uids,
            ..WorkerConfig::default()
        }))
    }

    fn tcp(ip: [u8; 4], port: u16) -> Peer {
        Peer::Tcp((ip, port).into())
    }

    #[test]
    fn limits_count_open_connections_and_give_places_back() {
        let c = connections(3, 2, vec![]);
        let a1 = c.admit(&tcp([10, 0, 0, 1], 1)).unwrap();
        let a2 = c.admit(&tcp([10, 0, 0, 1], 2)).unwrap();
        assert_eq!(c.admit(&tcp([10, 0, 0, 1], 3)).unwrap_err(), Refusal::PerPeer(2, [10, 0, 0, 1].into()));
        let b1 = c.admit(&tcp([10, 0, 0, 2], 1)).unwrap();
        assert_eq!(c.admit(&tcp([10, 0, 0, 3], 1)).unwrap_err(), Refusal::MaxConnections(3));
        assert_eq!(c.snapshot().open, 3, "refusals hold no place");
        drop(a1);
        let a3 = c.admit(&tcp([10, 0, 0, 1], 4)).unwrap();
        drop((a2, a3, b1));
        let s = c.snapshot();
        assert_eq!((s.open, s.refused_per_peer, s.refused_max_connections), (0, 1, 1));
        assert!(c.per_peer.lock().unwrap().is_empty());
    }

    #[test]
    fn zero_is_no_limit() {
        let c = connections(0, 0, vec![]);
        let permits: Vec<_> = (0..100).map(|p| c.admit(&tcp([10, 0, 0, 1], p)).unwrap()).collect();
        assert_eq!(c.snapshot().open, 100);
        drop(permits);
        assert_eq!(c.snapshot().open, 0);
    }

    #[test]
    fn unix_peers_are_checked_by_uid() {
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        let c = connections(10, 1, vec![4242]);
        for uid in [me, 0, 4242] {
            // The per-peer limit is for addresses: many from one uid are fine.
            let _a = c.admit(&Peer::Unix { uid: Some(uid), pid: None }).unwrap();
            let _b = c.admit(&Peer::Unix { uid: Some(uid), pid: None }).unwrap();
        }
        let other = if me == 4243 { 4244 } else { 4243 };
        assert_eq!(
            c.admit(&Peer::Unix { uid: Some(other), pid: None }).unwrap_err(),
            Refusal::PeerUid(Some(other))
        );
        assert_eq!(c.admit(&Peer::Unix { uid: None, pid: None }).unwrap_err(), Refusal::PeerUid(None));
        assert_eq!(c.snapshot().refused_peer_uid, 2);
        assert_eq!(c.snapshot().open, 0);
    }
}
