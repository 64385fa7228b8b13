//! The cluster as a sidecar worker's upstream: a block the sidecar misses is read from its
//! owner on the ring, with the client's failover to the next workers. (The trait is in
//! `strata_common::upstream`, so the worker does not depend on this crate.)

use async_trait::async_trait;
use bytes::Bytes;
use strata_common::upstream::{Upstream, UpstreamError, UpstreamRead};

use std::time::Duration;

use crate::{Client, ClientConfig, FileInfo, Result};

pub struct ClusterUpstream {
    client: Client,
}

impl ClusterUpstream {
    pub fn new(client: Client) -> Self {
        Self { client }
    }

    /// A client of the cluster at `master_addr` for a sidecar: it never routes through a
    /// sidecar socket itself (the pod's environment may name the sidecar's own), presents the
    /// sidecar's `token` (role `worker`), and one block request gives up after
    /// `request_timeout` (then the sidecar reads the UFS).
    pub async fn connect(
        master_addr: &str,
        token: Option<String>,
        request_timeout: Duration,
    ) -> Result<Self> {
        Self::connect_tls(master_addr, token, request_timeout, crate::TlsConfig::from_env()).await
    }

    /// [`connect`](Self::connect) with these TLS settings (the sidecar's own) instead of the
    /// environment's.
    pub async fn connect_tls(
        master_addr: &str,
        token: Option<String>,
        request_timeout: Duration,
        tls: crate::TlsConfig,
    ) -> Result<Self> {
        Ok(Self::new(Client::connect(cluster_config(master_addr, token, request_timeout, tls)).await?))
    }
}

/// A worker's or sidecar's client of its cluster: never through a sidecar socket (the pod's
/// environment may name the sidecar's own), presenting the worker's `token`.
fn cluster_config(
    master_addr: &str,
    token: Option<String>,
    request_timeout: Duration,
    tls: crate::TlsConfig,
) -> ClientConfig {
    let mut config = ClientConfig::new(master_addr);
    config.sidecar_socket = None;
    config.request_timeout = request_timeout;
    config.tls = tls;
    config.token = token.map(crate::Token);
    config
}

#[async_trait]
impl Upstream for ClusterUpstream {
    async fn read_block(&self, read: UpstreamRead<'_>) -> std::result::Result<Bytes, UpstreamError> {
        let info = FileInfo {
            path: read.path.to_string(),
            is_dir: false,
            size: read.file_size,
            version: read.version.to_string(),
            mtime_ms: 0,
            block_size: read.block_size,
            file_id: read.file_id.to_string(),
            holders: Vec::new(),
            persist: crate::Persist::Persisted,
        };
        self.client
            .read_range_of(&info, read.index * read.block_size, read.len)
            .await
            .map_err(|e| UpstreamError(e.to_string()))
    }
}

/// Peer fetch for a worker on the ring: a block this worker misses is asked of the workers that
/// held it before the ring changed (`Op::PeerRead`, answered from their tiers alone, never
/// fetched), and read from the UFS only when none has it. When a worker joins, the blocks it
/// now owns were owned by the next worker after it on the ring; when one leaves (or drains),
/// by the owner on the previous ring, which a draining worker still serves.
///
/// Peers are asked only where they may hold the block: for a block this worker is not the
/// first owner of (a read that came by failover, a hedge or a second replica: the owner likely
/// has it), for any block of a mount with `read_replicas` > 1 (clients spread its reads over
/// the first owners, so the copy may be on any of them, not only the first), and during
/// [`PEER_WINDOW`] after the ring changed for a block whose owner on the previous ring was
/// another worker — or, in the window after this worker started (it may have just joined, and
/// knows no previous ring), the next worker on the ring, which owned the block before. A peer
/// that answered [`MISS_STREAK`] such asks in a row with a miss (an empty cache, a fresh
/// cluster) is not asked again until the ring changes. On a ring that has not moved, the
/// owner's own miss of a block read from one replica goes straight to the UFS and costs no
/// peer round trip.
pub struct PeerUpstream {
    client: Client,
    /// This worker, never asked.
    me: String,
    rings: std::sync::Mutex<Rings>,
    request_timeout: Duration,
    /// When a miss on a mount this client did not know last made it refresh its view.
    refreshed_for_mount: std::sync::Mutex<Option<tokio::time::Instant>>,
    /// Connections to peers, kept between asks.
    peers: crate::transport::TcpPool,
}

struct Rings {
    current: Option<strata_common::Ring>,
    previous: Option<strata_common::Ring>,
    /// When the ring last changed (or the upstream started).
    changed_at: std::time::Instant,
    /// Misses in a row per peer (by id) from asks made for a ring change, since it last changed.
    misses: std::collections::HashMap<String, u32>,
}

/// How long after a ring change every miss asks its previous owners first: long enough for the
/// blocks that moved to be read once and so pulled across.
pub const PEER_WINDOW: Duration = Duration::from_secs(600);

/// Least time between two refreshes of the view forced by a miss on an unknown mount.
const UNKNOWN_MOUNT_REFRESH: Duration = Duration::from_millis(200);

/// How long a read replica waits for the block's first owner to fetch a block for it (see
/// [`PeerUpstream`]): a UFS read there, which may be slow; past it the replica reads the UFS
/// itself.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(5);

/// Most peers one miss asks before the UFS.
const PEERS_ASKED: usize = 2;

/// Misses in a row after which a peer asked because the ring changed is not asked again until
/// the next change: it holds none of the moved blocks (its cache is empty, or it held other
/// blocks), and every further ask would cost a round trip for nothing.
pub const MISS_STREAK: u32 = 16;

impl PeerUpstream {
    /// A client of the cluster at `master_addr` for worker `me`, presenting the worker's
    /// `token`; one peer request gives up after `request_timeout` (then the next peer, then
    /// the UFS).
    pub async fn connect(
        master_addr: &str,
        me: &str,
        token: Option<String>,
        request_timeout: Duration,
        tls: crate::TlsConfig,
    ) -> Result<Self> {
        let client = Client::connect(cluster_config(master_addr, token, request_timeout, tls)).await?;
        let rings = Rings {
            current: None,
            previous: None,
            changed_at: client.config().clock.now(),
            misses: std::collections::HashMap::new(),
        };
        Ok(Self {
            me: me.to_string(),
            rings: std::sync::Mutex::new(rings),
            request_timeout,
            refreshed_for_mount: std::sync::Mutex::new(None),
            peers: crate::transport::TcpPool::new(client.dial().clone()),
            client,
        })
    }

    /// The mount's `read_replicas`. A mount this client has not heard of was added since its
    /// view was fetched (a worker's client fetches it at start and every 2 s), so the view is
    /// older than the mount, and likely than the ring its peers are on: refresh it now (at
    /// most every [`UNKNOWN_MOUNT_REFRESH`]) rather than miss the peers for up to 2 s and read
    /// the UFS instead.
    async fn read_replicas(&self, path: &str) -> usize {
        if let Some(n) = self.client.mount_read_replicas(path) {
            return n;
        }
        let due = {
            let now = tokio::time::Instant::now();
            let mut last = self.refreshed_for_mount.lock().unwrap_or_else(|p| p.into_inner());
            let due = last.is_none_or(|at| now.duration_since(at) >= UNKNOWN_MOUNT_REFRESH);
            if due {
                *last = Some(now);
            }
            due
        };
        if due && let Err(e) = self.client.refresh_view().await {
            tracing::debug!(path, err = %e, "cannot refresh the view for a mount it does not know");
        }
        self.client.read_replicas_for(path)
    }

    /// The peers that may hold the block of a mount with `read_replicas`, most likely first,
    /// each with whether it is asked to fetch the block (the first owner, asked by another read
    /// replica) rather than only to look in its tiers, and whether it is asked only because the
    /// ring changed (its misses count towards [`MISS_STREAK`]).
    async fn candidates(&self, hash: u64, read_replicas: usize) -> Vec<(strata_common::Member, bool, bool)> {
        let ring = match self.client.ring().await {
            Ok(ring) => ring,
            Err(_) => return Vec::new(),
        };
        let now = self.client.config().clock.now();
        let mut rings = self.rings.lock().unwrap_or_else(|p| p.into_inner());
        if rings.current.as_ref().is_none_or(|c| c.epoch() != ring.epoch()) {
            if rings.current.is_some() {
                rings.changed_at = now;
                rings.misses.clear();
            }
            rings.previous = rings.current.replace(ring.clone());
        }
        let mine = ring.owners(hash, 1).first().is_some_and(|m| m.id == self.me);
        let changed_lately = now.saturating_duration_since(rings.changed_at) < PEER_WINDOW;
        if mine && read_replicas <= 1 && !changed_lately {
            return Vec::new();
        }
        // Only a ring change sends this miss to a peer: the one that owned the block before.
        let for_change = mine && read_replicas <= 1;
        // Every other read replica may hold it (then the owners before a change).
        let asked = PEERS_ASKED.max(read_replicas.saturating_sub(1));
        // A peer the master reports silent, or that just timed out here, would only hold the
        // miss for the peer timeout: it is skipped.
        let suspects = self.client.inner.view.read().suspects.clone();
        let health = &self.client.inner.route.ring.health;
        let t = tokio::time::Instant::now();
        let misses = &rings.misses;
        let mut out: Vec<strata_common::Member> = Vec::new();
        let mut push = |m: &strata_common::Member| {
            let trusted = !suspects.contains(&m.id) && !health.is_suspect(&m.data_addr, t);
            let hopeless = for_change && misses.get(&m.id).is_some_and(|n| *n >= MISS_STREAK);
            if trusted
                && !hopeless
                && m.id != self.me
                && !out.iter().any(|o| o.id == m.id)
                && out.len() < asked
            {
                out.push(m.clone());
            }
        };
        match &rings.previous {
            // The block's owner before the change, if it was another worker.
            Some(previous) if for_change => {
                if let Some(m) = previous.owners(hash, 1).first() {
                    push(m);
                }
            }
            // This worker started lately and knows no earlier ring: if it joined, the block
            // was the next worker's. (When this worker is not the owner, a read came here by
            // failover, a hedge or a second replica: the owners likely have it.)
            _ => {
                for m in ring.owners(hash, read_replicas.max(2)) {
                    push(m);
                }
                if let Some(previous) = &rings.previous
                    && let Some(m) = previous.owners(hash, 1).first()
                {
                    push(m);
                }
            }
        }
        let first = ring.owners(hash, 1).first().map(|m| m.id.clone());
        out.into_iter()
            .map(|m| {
                let forward = read_replicas > 1 && !mine && first.as_deref() == Some(m.id.as_str());
                (m, forward, for_change)
            })
            .collect()
    }

    /// Counts a ring-change ask's answer: a miss lengthens the peer's streak, a hit ends it.
    fn count_answer(&self, peer: &str, hit: bool) {
        let mut rings = self.rings.lock().unwrap_or_else(|p| p.into_inner());
        let streak = rings.misses.entry(peer.to_string()).or_default();
        *streak = if hit { 0 } else { streak.saturating_add(1) };
    }
}

#[async_trait]
impl Upstream for PeerUpstream {
    async fn read_block(&self, read: UpstreamRead<'_>) -> std::result::Result<Bytes, UpstreamError> {
        let hash = strata_common::BlockKey::new(read.file_id, read.version, read.index).placement_hash();
        let req = strata_common::frame::ReadBlockRequest {
            req_id: 1,
            path: read.path.to_string(),
            version: read.version.to_string(),
            file_size: read.file_size,
            block_size: read.block_size,
            block_index: read.index,
            offset: 0,
            len: read.len,
        };
        let (look, fetch) = (req.encode_peer(), req.encode_peer_fetch());
        let mut why = Vec::new();
        let read_replicas = self.read_replicas(read.path).await;
        for (peer, forward, for_change) in self.candidates(hash, read_replicas).await {
            // Two read replicas missing one cold block at once would both read the UFS: the one
            // that is not its first owner has the first owner fetch it instead (a plain read,
            // which that worker's single flight shares with its own miss and any other).
            let (frame, timeout) =
                if forward { (&fetch, FORWARD_TIMEOUT) } else { (&look, self.request_timeout) };
            let answer = crate::transport::ask_pooled(
                &self.peers,
                &peer.data_addr,
                frame,
                req.req_id,
                read.len,
                timeout,
            )
            .await;
            if for_change {
                match &answer {
                    Ok(_) => self.count_answer(&peer.id, true),
                    Err(crate::TransportError::Remote {
                        kind: strata_common::ErrorKind::NotFound, ..
                    }) => self.count_answer(&peer.id, false),
                    // Down, slow or refusing: says nothing of what it holds.
                    Err(_) => {}
                }
            }
            match answer {
                Ok(bytes) if bytes.len() as u64 == read.len => return Ok(bytes),
                Ok(bytes) => why.push(format!("{}: {} bytes for {}", peer.id, bytes.len(), read.len)),
                Err(e) => {
                    // A fetch that timed out may only have met a slow UFS.
                    let slow_fetch = forward && matches!(e, crate::TransportError::Timeout { .. });
                    if !slow_fetch && !matches!(e, crate::TransportError::Remote { .. }) {
                        // Down or frozen: not asked again for a while.
                        self.client
                            .inner
                            .route
                            .ring
                            .health
                            .failed(&peer.data_addr, tokio::time::Instant::now());
                    }
                    why.push(format!("{}: {e}", peer.id))
                }
            }
        }
        Err(UpstreamError(if why.is_empty() { "no peer to ask".into() } else { why.join("; ") }))
    }
}

/// Longest one hand-off exchange may take: a whole block pushed and stored by a receiver that
/// first lets its own client reads go (see `strata_worker::handoff`).
const HANDOFF_TIMEOUT: Duration = Duration::from_secs(10);

/// A worker's hand-off to its peers goes through the same dialing (TLS, the worker's token) as
/// its peer reads.
#[async_trait]
impl strata_common::upstream::PeerLink for PeerUpstream {
    async fn exchange(
        &self,
        addr: &str,
        frame: &[u8],
        req_id: u64,
        max: u64,
    ) -> std::result::Result<Bytes, UpstreamError> {
        crate::transport::ask_pooled(&self.peers, addr, frame, req_id, max, HANDOFF_TIMEOUT)
            .await
            .map_err(|e| UpstreamError(e.to_string()))
    }
}
