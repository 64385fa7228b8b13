//! The workers as the master sees them: membership (who is live, at which epoch) and the block
//! map (who holds what), fed by registrations and heartbeats and aged by the liveness tick.
//!
//! Invariant: a worker's blocks leave the block map in the same tick that takes it out of the
//! live set, and when it registers again (it sends a full report next), so the map does not
//! go on naming a worker that clients no longer place blocks on.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use strata_common::{Member, SharedClock};
use tracing::{info, warn};

use crate::blockmap::BlockMap;
use crate::error::OpError;
use crate::locks::lock;
use crate::membership::{Membership, WorkerEntry, WorkerRecord};
use crate::metrics_defs as m;
use crate::reports::{BlockReport, Tier, TierUsage, WorkerCounters};
use crate::store::MetaStore;

/// One heartbeat of a worker.
#[derive(Debug, Default)]
pub struct Heartbeat {
    pub worker_id: String,
    pub tiers: Vec<TierUsage>,
    pub counters: WorkerCounters,
    pub added: Vec<BlockReport>,
    pub removed: Vec<BlockReport>,
    /// `added` is the worker's whole block set: forget what it held before.
    pub full_report: bool,
    /// Bytes it holds of each mount with a quota or a cache TTL, by mount path.
    pub mount_bytes: Vec<(String, u64)>,
    /// The worker is draining: take it off the ring (it keeps beating until it stops).
    pub draining: bool,
}

/// What the master answers a heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeartbeatAnswer {
    /// The worker is unknown or was declared lost: it must register again.
    pub reregister: bool,
    pub membership_epoch: u64,
}

/// A worker in the cluster status.
pub struct WorkerStatus {
    pub record: WorkerRecord,
    pub since_heartbeat: Duration,
    pub blocks: u64,
}

pub struct ClusterStatus {
    pub membership_epoch: u64,
    pub workers: Vec<WorkerStatus>,
    pub totals: WorkerCounters,
    pub blocks: u64,
}

/// A block's holders: (worker id, its data address, tier).
pub type Holders = Vec<(String, String, Tier)>;

/// One version of a file, as its blocks are keyed.
#[derive(Debug, Clone)]
pub struct FileBlocks {
    pub file_id: String,
    pub version: String,
    pub size: u64,
    pub block_size: u64,
}

/// Where the cached blocks of some files are (`strata locate`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Locality {
    pub files: u64,
    pub blocks: u64,
    pub bytes: u64,
    /// Blocks (and their bytes) held by at least one worker.
    pub cached_blocks: u64,
    pub cached_bytes: u64,
    /// Each worker holding any of them, most bytes first, then by id.
    pub workers: Vec<WorkerShare>,
}

/// One worker's share of a [`Locality`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerShare {
    pub id: String,
    pub data_addr: String,
    pub node: String,
    pub live: bool,
    pub blocks: u64,
    pub bytes: u64,
}

pub struct Cluster {
    membership: Mutex<Membership>,
    blocks: Mutex<BlockMap>,
    /// Heartbeat times and the liveness timeout are read on this clock.
    clock: SharedClock,
    /// Where registrations are kept for a next leader (nothing with redb).
    store: Arc<dyn MetaStore>,
    /// Workers known from the store that have not registered with this master yet: their
    /// heartbeats are answered `reregister`, so each sends a full block report.
    unreported: Mutex<HashSet<String>>,
    /// What each worker that ever registered owns on its host (kept after it is lost: its
    /// files are still there).
    state_paths: Mutex<BTreeMap<String, Vec<String>>>,
}

impl Cluster {
    /// `first_epoch` should grow across master restarts (see [`Membership::new`]).
    pub fn new(
        worker_timeout: Duration,
        first_epoch: u64,
        clock: SharedClock,
        store: Arc<dyn MetaStore>,
    ) -> Self {
        Self {
            membership: Mutex::new(Membership::new(worker_timeout, first_epoch)),
            blocks: Mutex::new(BlockMap::default()),
            clock,
            store,
            unreported: Mutex::new(HashSet::new()),
            state_paths: Mutex::new(BTreeMap::new()),
        }
    }

    /// Every path a worker of the cluster owns, as the workers reported them.
    pub fn state_paths(&self) -> Vec<String> {
        let all = lock(&self.state_paths);
        let set: std::collections::BTreeSet<&String> = all.values().flatten().collect();
        set.into_iter().cloned().collect()
    }

    /// Workers a previous leader registered (from the store): live from now, on the ring at
    /// once, declared lost after the timeout if silent, asked to register again (with a full
    /// block report) at their next heartbeat.
    pub fn preload(&self, workers: Vec<WorkerEntry>) {
        let now = self.clock.now();
        let mut mem = lock(&self.membership);
        let mut unreported = lock(&self.unreported);
        for w in workers {
            if !w.id.is_empty() && w.data_addr.parse::<SocketAddr>().is_ok() {
                lock(&self.state_paths).insert(w.id.clone(), w.state_paths.clone());
                mem.register(&w, now);
                unreported.insert(w.id);
            }
        }
        if !unreported.is_empty() {
            info!(workers = unreported.len(), epoch = mem.epoch(), "workers known from the store");
        }
    }

    pub fn register(&self, entry: WorkerEntry) -> Result<u64, OpError> {
        let id = entry.id.as_str();
        if id.is_empty() || entry.data_addr.parse::<SocketAddr>().is_err() {
            return Err(OpError::BadWorker);
        }
        let epoch = lock(&self.membership).register(&entry, self.clock.now());
        lock(&self.state_paths).insert(id.to_string(), entry.state_paths.clone());
        lock(&self.unreported).remove(id);
        // It will send a full report next: forget what it held before.
        lock(&self.blocks).drop_worker(id);
        if let Err(e) = self.store.put_worker(&entry) {
            warn!(worker = %id, err = %e, "cannot store the worker's registration");
        }
        info!(worker = %id, data_addr = %entry.data_addr, node = %entry.node, epoch, "worker registered");
        Ok(epoch)
    }

    pub fn heartbeat(&self, hb: Heartbeat) -> HeartbeatAnswer {
        let unreported = lock(&self.unreported).contains(&hb.worker_id);
        let mut mem = lock(&self.membership);
        if unreported || !mem.heartbeat(&hb.worker_id, self.clock.now()) {
            return HeartbeatAnswer { reregister: true, membership_epoch: mem.epoch() };
        }
        mem.update_stats(&hb.worker_id, hb.tiers, hb.counters, hb.mount_bytes);
        if hb.draining && !mem.workers().any(|w| w.id == hb.worker_id && w.draining) {
            mem.set_draining(&hb.worker_id);
            info!(worker = %hb.worker_id, epoch = mem.epoch(), "worker draining: off the ring");
        }
        let epoch = mem.epoch();
        drop(mem);
        let mut blocks = lock(&self.blocks);
        if hb.full_report {
            blocks.drop_worker(&hb.worker_id);
        }
        for r in &hb.added {
            blocks.add(&hb.worker_id, r);
        }
        for r in &hb.removed {
            blocks.remove(&hb.worker_id, r);
        }
        metrics::gauge!(m::BLOCKS).set(blocks.total_blocks() as f64);
        HeartbeatAnswer { reregister: false, membership_epoch: epoch }
    }

    /// Declares silent workers lost and drops their blocks.
    pub fn tick(&self) {
        let lost = lock(&self.membership).tick(self.clock.now());
        if !lost.is_empty() {
            let mut blocks = lock(&self.blocks);
            for id in &lost {
                warn!(worker = %id, "worker lost: no heartbeat within the timeout");
                blocks.drop_worker(id);
            }
            drop(blocks);
            let mut unreported = lock(&self.unreported);
            for id in &lost {
                unreported.remove(id);
                if let Err(e) = self.store.delete_worker(id) {
                    warn!(worker = %id, err = %e, "cannot forget the lost worker in the store");
                }
            }
            drop(unreported);
            let blocks = lock(&self.blocks);
            metrics::counter!(m::WORKERS_LOST).increment(lost.len() as u64);
            metrics::gauge!(m::BLOCKS).set(blocks.total_blocks() as f64);
        }
        metrics::gauge!(m::LIVE_WORKERS).set(lock(&self.membership).live_members().len() as f64);
    }

    /// The live set and its epoch, read together.
    pub fn live(&self) -> (u64, Vec<Member>) {
        let mem = lock(&self.membership);
        (mem.epoch(), mem.live_members())
    }

    /// Live workers whose last heartbeat is older than `after`.
    pub fn suspects(&self, after: Duration) -> HashSet<String> {
        let now = self.clock.now();
        lock(&self.membership)
            .workers()
            .filter(|w| w.live && now.saturating_duration_since(w.last_heartbeat) > after)
            .map(|w| w.id.clone())
            .collect()
    }

    /// The capacity of `tier` summed over the live workers, and how many live workers there are.
    pub fn tier_capacity(&self, tier: Tier) -> (u64, usize) {
        let mem = lock(&self.membership);
        let live: Vec<&WorkerRecord> = mem.workers().filter(|w| w.live).collect();
        let capacity =
            live.iter().flat_map(|w| &w.tiers).filter(|t| t.tier == tier).map(|t| t.capacity_bytes).sum();
        (capacity, live.len())
    }

    pub fn live_count(&self) -> usize {
        lock(&self.membership).live_members().len()
    }

    /// Holders of each cached block of one version of a file, by block index.
    pub fn block_locations(&self, file_id: &str, version: &str) -> BTreeMap<u64, Holders> {
        let addrs: HashMap<String, String> =
            lock(&self.membership).workers().map(|w| (w.id.clone(), w.data_addr.clone())).collect();
        let locations = lock(&self.blocks).locations(file_id, version);
        locations
            .into_iter()
            .map(|(index, holders)| {
                let holders = holders
                    .into_iter()
                    .map(|(worker, tier)| {
                        let addr = addrs.get(&worker).cloned().unwrap_or_default();
                        (worker, addr, tier)
                    })
                    .collect();
                (index, holders)
            })
            .collect()
    }

    /// Which workers hold how much of `files`, from the block map.
    pub fn locate(&self, files: &[FileBlocks]) -> Locality {
        let mut out = Locality { files: files.len() as u64, ..Locality::default() };
        let mut shares: HashMap<String, WorkerShare> = HashMap::new();
        {
            let blocks = lock(&self.blocks);
            for f in files {
                out.blocks += strata_common::block::block_count(f.size, f.block_size);
                out.bytes += f.size;
                for (index, holders) in blocks.locations(&f.file_id, &f.version) {
                    let len = strata_common::block::block_len(f.size, f.block_size, index);
                    if len == 0 || holders.is_empty() {
                        // A report of a block past the end (a stale size): not part of the file.
                        continue;
                    }
                    out.cached_blocks += 1;
                    out.cached_bytes += len;
                    // A worker holding the block in DRAM and on NVMe is listed once per tier.
                    let mut workers: Vec<String> = holders.into_iter().map(|(w, _)| w).collect();
                    workers.sort_unstable();
                    workers.dedup();
                    for worker in workers {
                        let share = shares.entry(worker).or_default();
                        share.blocks += 1;
                        share.bytes += len;
                    }
                }
            }
        }
        let mem = lock(&self.membership);
        let records: HashMap<&str, &WorkerRecord> = mem.workers().map(|w| (w.id.as_str(), w)).collect();
        out.workers = shares
            .into_iter()
            .map(|(id, share)| {
                let record = records.get(id.as_str());
                WorkerShare {
                    data_addr: record.map(|w| w.data_addr.clone()).unwrap_or_default(),
                    node: record.map(|w| w.node.clone()).unwrap_or_default(),
                    live: record.is_some_and(|w| w.live),
                    id,
                    ..share
                }
            })
            .collect();
        out.workers.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.id.cmp(&b.id)));
        out
    }

    /// The workers holding each cached block of one version of a file, by block index.
    pub fn holders(&self, file_id: &str, version: &str) -> BTreeMap<u64, Vec<(String, Tier)>> {
        lock(&self.blocks).locations(file_id, version)
    }

    pub fn status(&self) -> ClusterStatus {
        let mem = lock(&self.membership);
        let blocks = lock(&self.blocks);
        let now = self.clock.now();
        let mut totals = WorkerCounters::default();
        let workers = mem
            .workers()
            .map(|w| {
                totals.add(&w.counters);
                WorkerStatus {
                    record: w.clone(),
                    since_heartbeat: now.saturating_duration_since(w.last_heartbeat),
                    blocks: blocks.worker_blocks(&w.id),
                }
            })
            .collect();
        ClusterStatus { membership_epoch: mem.epoch(), workers, totals, blocks: blocks.total_blocks() }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use strata_common::clock::ManualClock;

    use super::*;
    use crate::store::MemStore;

    fn beat(id: &str) -> Heartbeat {
        Heartbeat {
            worker_id: id.into(),
            tiers: Vec::new(),
            counters: WorkerCounters::default(),
            added: Vec::new(),
            removed: Vec::new(),
            full_report: false,
            mount_bytes: Vec::new(),
            draining: false,
        }
    }

    #[test]
    fn a_new_leader_knows_the_workers_of_the_last_and_asks_each_for_a_full_report() {
        let store = Arc::new(MemStore::default());
        let clock = ManualClock::new();
        let old = Cluster::new(Duration::from_secs(10), 1, clock.clone(), store.clone());
        old.register(WorkerEntry::new("w1", "127.0.0.1:1", "127.0.0.1:2")).unwrap();
        old.register(WorkerEntry::new("w2", "127.0.0.1:3", "127.0.0.1:4")).unwrap();
        assert_eq!(store.load_workers().unwrap().len(), 2);

        let new = Cluster::new(Duration::from_secs(10), 100, clock.clone(), store.clone());
        new.preload(store.load_workers().unwrap());
        // On the ring at once, before any of them spoke to the new leader.
        assert_eq!(new.live_count(), 2);
        assert!(new.heartbeat(beat("w1")).reregister, "a full report is asked for");
        new.register(WorkerEntry::new("w1", "127.0.0.1:1", "127.0.0.1:2")).unwrap();
        assert!(!new.heartbeat(beat("w1")).reregister);
        assert!(new.heartbeat(beat("w2")).reregister);

        // A silent one is lost after the timeout and forgotten in the store.
        clock.advance(Duration::from_secs(11));
        assert!(!new.heartbeat(beat("w1")).reregister);
        new.tick();
        assert_eq!(new.live_count(), 1);
        let ids: Vec<String> = store.load_workers().unwrap().into_iter().map(|w| w.id).collect();
        assert_eq!(ids, ["w1"]);

        // A deposed leader's store refuses the write; the registration still answers.
        store.deposed.store(true, Ordering::SeqCst);
        assert!(new.register(WorkerEntry::new("w3", "127.0.0.1:5", "127.0.0.1:6")).is_ok());
        assert_eq!(store.load_workers().unwrap().len(), 1);
    }

    #[test]
    fn locate_sums_each_workers_blocks_and_bytes_most_first() {
        let clock = ManualClock::new();
        let cluster = Cluster::new(Duration::from_secs(10), 1, clock, Arc::new(MemStore::default()));
        let on = |id: &str, port: u16, node: &str| WorkerEntry {
            node: node.into(),
            ..WorkerEntry::new(id, &format!("127.0.0.1:{port}"), "127.0.0.1:9")
        };
        cluster.register(on("w1", 1, "n1")).unwrap();
        cluster.register(on("w2", 2, "n2")).unwrap();
        let block = |file: &str, index| BlockReport {
            file_id: file.into(),
            version: "v1".into(),
            index,
            tier: Tier::Memory,
        };
        // f: 2.5 blocks of 100 bytes; w1 holds blocks 0 and 2 (100 + 50), w2 blocks 0 and 1.
        // g: one block of 10 bytes on w2; its v0 on w1 is not the version asked.
        let mut hb = beat("w1");
        hb.added = vec![block("f", 0), block("f", 2), BlockReport { version: "v0".into(), ..block("g", 0) }];
        cluster.heartbeat(hb);
        let mut hb = beat("w2");
        // Block 0 of f on both of w2's tiers counts once.
        let on_nvme = BlockReport { tier: Tier::Nvme, ..block("f", 0) };
        hb.added = vec![block("f", 0), on_nvme, block("f", 1), block("g", 0)];
        cluster.heartbeat(hb);
        let file =
            |id: &str, size| FileBlocks { file_id: id.into(), version: "v1".into(), size, block_size: 100 };
        let got = cluster.locate(&[file("f", 250), file("g", 10), file("h", 0)]);
        assert_eq!((got.files, got.blocks, got.bytes), (3, 4, 260));
        assert_eq!((got.cached_blocks, got.cached_bytes), (4, 260));
        let rows: Vec<(&str, &str, u64, u64, bool)> =
            got.workers.iter().map(|w| (w.id.as_str(), w.node.as_str(), w.blocks, w.bytes, w.live)).collect();
        assert_eq!(rows, [("w2", "n2", 3, 210, true), ("w1", "n1", 2, 150, true)]);
        assert_eq!(got.workers[0].data_addr, "127.0.0.1:2");
        assert_eq!(cluster.locate(&[file("nothing", 0)]).workers, []);
    }

    #[test]
    fn a_silent_worker_is_suspect_before_it_is_lost_and_not_after_it_beats_again() {
        let clock = ManualClock::new();
        let cluster = Cluster::new(Duration::from_secs(10), 1, clock.clone(), Arc::new(MemStore::default()));
        cluster.register(WorkerEntry::new("w1", "127.0.0.1:1", "127.0.0.1:2")).unwrap();
        cluster.register(WorkerEntry::new("w2", "127.0.0.1:3", "127.0.0.1:4")).unwrap();
        let epoch = cluster.live().0;
        clock.advance(Duration::from_secs(4));
        cluster.heartbeat(beat("w1"));
        let after = Duration::from_secs(3);
        assert_eq!(cluster.suspects(after), HashSet::from(["w2".to_string()]));
        // Suspicion moves no placement: the live set and its epoch stay.
        assert_eq!(cluster.live().0, epoch);
        assert_eq!(cluster.live_count(), 2);
        cluster.heartbeat(beat("w2"));
        assert!(cluster.suspects(after).is_empty());
        // A lost worker is no longer a suspect: it is off the ring.
        clock.advance(Duration::from_secs(11));
        cluster.tick();
        assert!(cluster.suspects(after).is_empty());
    }
}
