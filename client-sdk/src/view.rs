//! The client's view of the cluster: the membership as a placement ring, the mount table, and
//! the workers the master suspects — fetched from the master, refreshed when older than
//! `membership_refresh` (one refresh at a time however many readers find it stale), kept as it
//! was while the master is unreachable, or taken from a worker's or the sidecar's last view
//! when the client starts during an outage.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use strata_common::ring::DEFAULT_VNODES;
use strata_common::{BlockKey, Member, MountOptions, Ring, SharedClock, path};
use strata_proto::{Empty, MountInfo};
use tracing::{debug, warn};

use crate::master::MasterLink;
use crate::transport::Via;
use crate::{ClientConfig, Result};

#[derive(Clone)]
pub(crate) struct View {
    pub(crate) ring: Ring,
    /// The last ring that had members: when the master (rightly or not) reports no live
    /// worker, reads still try the workers it last knew before giving up.
    pub(crate) last_members: Ring,
    pub(crate) mounts: Vec<MountInfo>,
    /// Ids of workers the master says have stopped heartbeating (still on the ring): asked last.
    pub(crate) suspects: HashSet<String>,
    pub(crate) fetched: Instant,
}

impl View {
    pub(crate) fn empty(now: Instant) -> Self {
        Self {
            ring: Ring::default(),
            last_members: Ring::default(),
            mounts: Vec::new(),
            suspects: HashSet::new(),
            fetched: now,
        }
    }

    /// The ring to read from: the live one, else the last one that had members.
    pub(crate) fn usable_ring(&self) -> &Ring {
        if self.ring.is_empty() { &self.last_members } else { &self.ring }
    }
}

pub(crate) struct ClusterView {
    state: RwLock<View>,
    master: Arc<MasterLink>,
    /// Held while a stale view is refreshed, so concurrent readers wait for one refresh
    /// instead of each calling the master (64 readers made 64 call pairs at once).
    refreshing: tokio::sync::Mutex<()>,
    /// Refreshes attempted (failed ones too): a reader that waited behind one does not try again.
    refresh_attempts: AtomicU64,
    clock: SharedClock,
    refresh_every: Duration,
    sidecar_socket: Option<PathBuf>,
    workers: Vec<String>,
}

impl ClusterView {
    pub(crate) fn new(master: Arc<MasterLink>, config: &ClientConfig, view: View) -> Self {
        Self {
            state: RwLock::new(view),
            master,
            refreshing: tokio::sync::Mutex::new(()),
            refresh_attempts: AtomicU64::new(0),
            clock: config.clock.clone(),
            refresh_every: config.membership_refresh,
            sidecar_socket: config.sidecar_socket.clone(),
            workers: config.workers.clone(),
        }
    }

    /// A copy of the view as it is now.
    pub(crate) fn snapshot(&self) -> View {
        self.read().clone()
    }

    pub(crate) fn read(&self) -> std::sync::RwLockReadGuard<'_, View> {
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a membership and mount table (from the master, or a worker's last view).
    pub(crate) fn set(&self, membership: strata_proto::Membership, mounts: Vec<MountInfo>) {
        let suspects = membership.workers.iter().filter(|w| w.suspect).map(|w| w.id.clone()).collect();
        let members = membership
            .workers
            .into_iter()
            .map(|w| Member { id: w.id, data_addr: w.data_addr, node: w.node, local_socket: w.local_socket })
            .collect();
        let ring = Ring::new(membership.epoch, members, DEFAULT_VNODES);
        debug!(epoch = ring.epoch(), workers = ring.members().len(), "membership refreshed");
        let mut view = self.state.write().unwrap_or_else(|p| p.into_inner());
        if !ring.is_empty() {
            view.last_members = ring.clone();
        }
        view.ring = ring;
        view.mounts = mounts;
        view.suspects = suspects;
        view.fetched = self.clock.now();
    }

    /// Fetches membership and mounts from the master now; with `fallback` when the caller can
    /// go on with the view it has (see [`MasterLink::call`]).
    pub(crate) async fn refresh(&self, fallback: bool) -> Result<()> {
        let mut master = self.master.client();
        let membership =
            self.master.call("get_membership", fallback, master.get_membership(Empty {})).await?;
        let mounts = self.master.call("list_mounts", fallback, master.list_mounts(Empty {})).await?;
        self.set(membership, mounts.mounts);
        Ok(())
    }

    /// Refreshes the view if it is older than the refresh period; a failure keeps the last one.
    pub(crate) async fn fresh(&self) {
        let stale = || {
            let fetched = self.read().fetched;
            self.clock.now().saturating_duration_since(fetched) > self.refresh_every
        };
        if !stale() {
            return;
        }
        let attempts = self.refresh_attempts.load(Ordering::Relaxed);
        let _one_refresh = self.refreshing.lock().await;
        // Another reader refreshed it (or tried, and the master is away) while this one waited.
        if self.refresh_attempts.load(Ordering::Relaxed) != attempts || !stale() {
            return;
        }
        self.refresh_attempts.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.refresh(true).await {
            // Cached reads go on while the master is away: keep the last view (an outage is
            // logged once, by `outage`).
            if e.is_master_outage() {
                debug!(err = %e, "cannot refresh membership; using the last one");
            } else {
                warn!(err = %e, "cannot refresh membership; using the last one");
            }
        }
    }

    /// The placement ring in use (after refreshing it if it is older than the refresh period).
    pub(crate) async fn ring(&self) -> Ring {
        self.fresh().await;
        self.read().ring.clone()
    }

    /// The mount holding `p` (normalised) — the longest mount point over it, as the master
    /// resolves paths —, as last known.
    fn mount_of<T>(&self, p: &str, f: impl FnOnce(&MountInfo) -> T) -> Option<T> {
        let view = self.read();
        view.mounts
            .iter()
            .filter(|m| path::strip_mount(&m.path, p).is_some())
            .max_by_key(|m| m.path.len())
            .map(f)
    }

    /// The `read_replicas` of the mount holding `p`, `None` when this client knows no such mount.
    pub(crate) fn mount_read_replicas(&self, p: &str) -> Option<usize> {
        self.mount_of(p, |m| m.read_replicas.max(1) as usize)
    }

    /// How many of a block's first ring owners a read of `p` may ask first (its mount's
    /// `read_replicas`; 1 for a path under no known mount, or a master that does not say).
    pub(crate) fn read_replicas_for(&self, p: &str) -> usize {
        self.mount_read_replicas(p).unwrap_or(1)
    }

    /// The `metadata_ttl` of the mount holding `p`; zero (cache nothing) for an unknown mount.
    pub(crate) fn ttl_for(&self, p: &str) -> Duration {
        self.mount_of(p, |m| Duration::from_millis(m.metadata_ttl_ms)).unwrap_or(Duration::ZERO)
    }

    /// The options Strata interprets of the mount holding `p`.
    pub(crate) fn mount_options_of(&self, p: &str) -> Option<MountOptions> {
        self.mount_of(p, |m| MountOptions::parse(&m.options).ok()).flatten()
    }

    /// The mount table as last known.
    pub(crate) fn mounts(&self) -> Vec<MountInfo> {
        self.read().mounts.clone()
    }

    /// Who to ask for metadata when the master is unreachable: the sidecar, then the workers
    /// of the last membership (ordered by the placement of `key`, to spread the asking), then
    /// the configured ones; at most 4 over TCP.
    pub(crate) fn worker_candidates(&self, key: Option<&str>) -> Vec<(Via, String)> {
        let mut out = Vec::new();
        if let Some(socket) = &self.sidecar_socket {
            out.push((Via::Unix, socket.display().to_string()));
        }
        let view = self.read();
        let ring = view.usable_ring();
        let hash = BlockKey::new(key.unwrap_or("/").to_string(), String::new(), 0).placement_hash();
        let known = ring.owners(hash, ring.members().len()).into_iter().map(|m| m.data_addr.clone());
        let mut tcp: Vec<String> = Vec::new();
        for addr in known.chain(self.workers.iter().cloned()) {
            if !tcp.contains(&addr) && tcp.len() < 4 {
                tcp.push(addr);
            }
        }
        out.extend(tcp.into_iter().map(|a| (Via::Tcp, a)));
        out
    }
}
