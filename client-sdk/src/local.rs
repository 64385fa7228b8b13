//! Workers on this client's host: a worker that also serves a Unix socket
//! (`strata worker --socket`) advertises it in the membership (`Member::local_socket`). A
//! client that can reach that socket is on the worker's host (a Unix socket does not cross
//! hosts), so it reads the worker's blocks by short-circuit — mapping the descriptors the
//! worker passes — instead of over TCP, with no sidecar and no configuration.
//!
//! Blocks smaller than [`MIN_MAPPED_BLOCK`] (small files) are read over TCP. Only grants
//! that cost the worker no copy are asked for (`GrantKind::FdNoCopy`): a block
//! on NVMe is mapped from its file, a DRAM block from a shared-memory copy the worker keeps
//! already (made for a sidecar-style reader); any other DRAM block is read over TCP, since
//! copying it into fresh shared memory for one read costs more than sending it.
//!
//! Invariants: a socket is used for a worker only after it answered a `View` with that
//! worker's id, so a stale socket file, another worker's socket at the same path (a reused
//! hostPath) or a sidecar never serves as the wrong worker; a socket that cannot be reached or
//! answers as someone else is not asked again for [`RECHECK`], so a remote worker costs one
//! `stat` per block read at most; any failure reads the block over TCP as before.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use strata_common::frame::GrantKind;
use strata_common::{Member, SharedClock};
use tracing::{debug, info};

use crate::shortcircuit::ShortCircuit;
use crate::transport::{Credentials, Dial, Via};

/// Smallest block mapped rather than sent: a mapping costs a grant round trip and a page-table
/// setup whatever the size, which a block this small costs less to send (measured on a warm
/// epoch of 256 KiB files: 8,447–8,906 files/s mapped against 10,506–13,696 over TCP).
pub(crate) const MIN_MAPPED_BLOCK: u64 = 1 << 20;

/// How long a socket found unreachable, or answering as another worker, is left alone.
const RECHECK: Duration = Duration::from_secs(30);

/// What is known of one worker's advertised socket.
enum Known {
    /// Answered as this worker: reads of its blocks are mapped through it.
    Mine(Arc<ShortCircuit>),
    /// Not this worker's from here (absent, unreachable, someone else's) until `until`.
    NotMine { until: Instant },
}

/// The short-circuit settings every local socket gets (the client's own).
pub(crate) struct LocalSettings {
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
    pub cache_bytes: u64,
    pub clock: SharedClock,
    pub credentials: Credentials,
}

/// The co-located workers this client has found, by (worker id, socket path).
pub(crate) struct LocalWorkers {
    settings: LocalSettings,
    known: Mutex<HashMap<(String, String), Known>>,
    /// One check at a time: a burst of first reads does not send a burst of `View`s.
    checking: tokio::sync::Mutex<()>,
}

impl LocalWorkers {
    pub(crate) fn new(settings: LocalSettings) -> Self {
        Self { settings, known: Mutex::new(HashMap::new()), checking: tokio::sync::Mutex::new(()) }
    }

    fn known(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Known>> {
        self.known.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The short-circuit to `member` if it is already known to be on this host (no I/O).
    pub(crate) fn found(&self, member: &Member) -> Option<Arc<ShortCircuit>> {
        if member.local_socket.is_empty() {
            return None;
        }
        match self.known().get(&(member.id.clone(), member.local_socket.clone())) {
            Some(Known::Mine(sc)) => Some(sc.clone()),
            _ => None,
        }
    }

    /// The short-circuit to `member` when it runs on this host, checking its socket the first
    /// time (and again [`RECHECK`] after a check that failed).
    pub(crate) async fn find(&self, member: &Member, dial: &Dial) -> Option<Arc<ShortCircuit>> {
        if member.local_socket.is_empty() {
            return None;
        }
        let key = (member.id.clone(), member.local_socket.clone());
        let settled = |known: &HashMap<_, Known>, now| match known.get(&key) {
            Some(Known::Mine(sc)) => Some(Some(sc.clone())),
            Some(Known::NotMine { until }) if now < *until => Some(None),
            _ => None,
        };
        if let Some(answer) = settled(&self.known(), self.settings.clock.now()) {
            return answer;
        }
        let _one_check = self.checking.lock().await;
        if let Some(answer) = settled(&self.known(), self.settings.clock.now()) {
            return answer;
        }
        let known = match self.check(member, dial).await {
            Ok(()) => {
                info!(worker = %member.id, socket = %member.local_socket, "worker on this host: reading its blocks by short-circuit");
                Known::Mine(Arc::new(ShortCircuit::new(
                    member.local_socket.clone(),
                    self.settings.connect_timeout,
                    self.settings.request_timeout,
                    self.settings.cache_bytes,
                    self.settings.clock.clone(),
                    self.settings.credentials.clone(),
                    // A first read of a DRAM block over TCP costs a copy; a grant of it would
                    // cost the worker a copy into fresh shared memory, which under memory
                    // pressure measured 10 ms per 4 MiB block against 1.2 ms over TCP.
                    GrantKind::FdNoCopy,
                )))
            }
            Err(why) => {
                debug!(worker = %member.id, socket = %member.local_socket, %why, "not reading this worker by short-circuit");
                Known::NotMine { until: self.settings.clock.now() + RECHECK }
            }
        };
        let mut map = self.known();
        // Entries of sockets a worker no longer advertises go when a new one is checked.
        map.retain(|(id, socket), _| id != &member.id || socket == &member.local_socket);
        map.insert(key.clone(), known);
        settled(&map, self.settings.clock.now()).flatten()
    }

    /// Whether `member`'s socket is reachable here and answers as `member`.
    async fn check(&self, member: &Member, dial: &Dial) -> Result<(), String> {
        let socket = member.local_socket.as_str();
        // Most clients are on other hosts: a stat, not a connect timeout, tells them.
        if !Path::new(socket).exists() {
            return Err("no such socket on this host".into());
        }
        let req_id = 1;
        let frame = strata_common::frame::view_request(req_id);
        let timeout = self.settings.connect_timeout.max(Duration::from_secs(1));
        let answer = crate::transport::ask(
            Via::Unix,
            socket,
            &frame,
            req_id,
            strata_proto::MAX_MESSAGE_BYTES as u64,
            dial,
            timeout,
        )
        .await
        .map_err(|e| e.to_string())?;
        let view = strata_proto::WorkerView::from_bytes(&answer).map_err(|e| e.to_string())?;
        if view.worker_id != member.id {
            return Err(format!("the socket answers as {:?}", view.worker_id));
        }
        Ok(())
    }

    /// Attempts read the framed way instead, through every local socket found.
    pub(crate) fn fallbacks(&self) -> crate::shortcircuit::ShortCircuitFallbacks {
        self.known()
            .values()
            .map(|k| match k {
                Known::Mine(sc) => sc.fallbacks(),
                Known::NotMine { .. } => Default::default(),
            })
            .fold(Default::default(), |a, b| a + b)
    }

    /// Block reads mapped through every local socket found.
    pub(crate) fn reads(&self) -> u64 {
        self.known()
            .values()
            .map(|k| match k {
                Known::Mine(sc) => sc.reads(),
                Known::NotMine { .. } => 0,
            })
            .sum()
    }
}
