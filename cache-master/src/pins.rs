//! Pins and frees: what operators ask of the cache itself (see docs/CACHE_CONTROL.md).
//!
//! A pin keeps every cached block of the files under a path in one tier of every worker: the
//! tiers' eviction passes over them (`strata_worker::tier::PinFilter`). Pins are durable (the
//! metadata store, so they survive a master restart and a leader change) and may expire. The
//! master does not name blocks: it turns each pin into a prefix of the UFS identity blocks
//! are keyed by (`strata_common::block::file_identity`) and hands workers the whole list when
//! it changes (a pins epoch in the heartbeat), so a worker that restarts, or a block cached
//! after the pin, is covered without a word from the master.
//!
//! A free drops the cached blocks under a path now, on every live worker: the master queues it
//! with a sequence number, each worker takes the frees after the last it applied from its next
//! heartbeat and says how far it got in the one after. No UFS byte moves until a block is read
//! again.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use strata_common::{SharedClock, path};

use crate::error::OpError;
use crate::metrics_defs as m;
use crate::store::MetaStore;

/// The tier a pin holds blocks in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PinTier {
    Memory,
    Nvme,
}

impl PinTier {
    pub fn label(self) -> &'static str {
        match self {
            PinTier::Memory => "memory",
            PinTier::Nvme => "nvme",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinRecord {
    /// The normalised Strata path (a file or a directory).
    pub path: String,
    pub tier: PinTier,
    /// The bytes under the path when it was pinned (what the pin may hold).
    pub bytes: u64,
    /// Blocks whose file identity starts with this (at a path boundary) are pinned.
    pub ufs_prefix: String,
    pub created_unix_ms: i64,
    /// When the pin lapses by itself; `None` keeps it until `unpin`.
    pub expires_unix_ms: Option<i64>,
}

/// A path's cache TTL (`strata ttl set`): workers drop the blocks under it that long after
/// they stored them. Durable like a pin, and handed to workers with the pins.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheTtlRecord {
    pub path: String,
    pub ufs_prefix: String,
    pub cache_ttl_ms: u64,
    pub created_unix_ms: i64,
}

pub use strata_common::block::{identity_prefix as ufs_prefix, identity_under as covers};

/// Two paths overlap when one is the other or lies under it.
fn overlap(a: &str, b: &str) -> bool {
    path::strip_mount(a, b).is_some() || path::strip_mount(b, a).is_some()
}

/// Frees kept for workers that have not applied them yet; an older one is dropped (a worker
/// that far behind sends a full block report when it comes back, which frees nothing but is
/// honest about what it holds).
const FREES_KEPT: usize = 256;

#[derive(Debug)]
struct State {
    pins: BTreeMap<String, PinRecord>,
    cache_ttls: BTreeMap<String, CacheTtlRecord>,
    epoch: u64,
    /// (sequence, UFS prefix), oldest first.
    frees: VecDeque<(u64, String)>,
    last_free: u64,
    /// The last free each worker said it applied.
    applied: HashMap<String, u64>,
    /// The pins epoch each worker said it applied (pins and TTLs in force there).
    epochs_applied: HashMap<String, u64>,
}

pub struct Pins {
    store: Arc<dyn MetaStore>,
    state: Mutex<State>,
    /// Woken whenever a worker reports what it applied (see [`Pins::reported`]).
    reports: tokio::sync::Notify,
    /// Expiry is read on this clock's wall time.
    clock: SharedClock,
}

impl Pins {
    /// `first_epoch` should grow across master restarts (wall-clock millis), so a worker that
    /// held a previous master's list takes this one's.
    pub fn new(
        records: Vec<PinRecord>,
        cache_ttls: Vec<CacheTtlRecord>,
        store: Arc<dyn MetaStore>,
        clock: SharedClock,
    ) -> Self {
        let pins = records.into_iter().map(|r| (r.path.clone(), r)).collect();
        let cache_ttls = cache_ttls.into_iter().map(|r| (r.path.clone(), r)).collect();
        let first_epoch = clock.wall_ms().max(0) as u64;
        let state = State {
            pins,
            cache_ttls,
            epoch: first_epoch,
            frees: VecDeque::new(),
            // Sequences grow across restarts too: a worker's "applied" from before is below them.
            last_free: first_epoch,
            applied: HashMap::new(),
            epochs_applied: HashMap::new(),
        };
        Self::publish(&state);
        Self { clock, store, state: Mutex::new(state), reports: tokio::sync::Notify::new() }
    }

    /// Wall-clock milliseconds on the pins' clock.
    pub fn now_ms(&self) -> i64 {
        self.clock.wall_ms()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets the pin gauges from `state`.
    fn publish(state: &State) {
        for tier in [PinTier::Memory, PinTier::Nvme] {
            let pins = state.pins.values().filter(|p| p.tier == tier);
            let (n, bytes) = pins.fold((0u64, 0u64), |(n, b), p| (n + 1, b + p.bytes));
            metrics::gauge!(m::PINS, "tier" => tier.label()).set(n as f64);
            metrics::gauge!(m::PINNED_BYTES, "tier" => tier.label()).set(bytes as f64);
        }
    }

    /// Adds (or replaces, for the same path) a pin, durably.
    pub fn add(&self, record: PinRecord) -> Result<PinRecord, OpError> {
        self.store.put_pin(&record)?;
        let mut state = self.state();
        state.pins.insert(record.path.clone(), record.clone());
        state.epoch += 1;
        Self::publish(&state);
        Ok(record)
    }

    /// Removes the pin of exactly `path`.
    pub fn remove(&self, path: &str) -> Result<PinRecord, OpError> {
        let existing = self.state().pins.get(path).cloned();
        let Some(record) = existing else {
            return Err(OpError::NoPin(path.to_string()));
        };
        self.store.delete_pin(path)?;
        let mut state = self.state();
        state.pins.remove(path);
        state.epoch += 1;
        Self::publish(&state);
        Ok(record)
    }

    pub fn list(&self) -> Vec<PinRecord> {
        self.state().pins.values().cloned().collect()
    }

    pub fn epoch(&self) -> u64 {
        self.state().epoch
    }

    /// Sets (or replaces) the cache TTL of a path, durably.
    pub fn set_cache_ttl(&self, record: CacheTtlRecord) -> Result<CacheTtlRecord, OpError> {
        self.store.put_cache_ttl(&record)?;
        let mut state = self.state();
        state.cache_ttls.insert(record.path.clone(), record.clone());
        state.epoch += 1;
        Ok(record)
    }

    /// Clears the cache TTL of exactly `path`.
    pub fn clear_cache_ttl(&self, path: &str) -> Result<CacheTtlRecord, OpError> {
        let existing = self.state().cache_ttls.get(path).cloned();
        let Some(record) = existing else {
            return Err(OpError::NoCacheTtl(path.to_string()));
        };
        self.store.delete_cache_ttl(path)?;
        let mut state = self.state();
        state.cache_ttls.remove(path);
        state.epoch += 1;
        Ok(record)
    }

    pub fn cache_ttls(&self) -> Vec<CacheTtlRecord> {
        self.state().cache_ttls.values().cloned().collect()
    }

    /// The first pin on `path`, above it or below it.
    pub fn overlapping(&self, path: &str) -> Option<PinRecord> {
        self.state().pins.values().find(|p| overlap(&p.path, path)).cloned()
    }

    /// Bytes pinned in `tier` by pins other than the one of `except`.
    pub fn pinned_bytes(&self, tier: PinTier, except: &str) -> u64 {
        self.state().pins.values().filter(|p| p.tier == tier && p.path != except).map(|p| p.bytes).sum()
    }

    /// Drops the pins that expired by now.
    pub fn tick(&self) {
        for path in self.expire(self.clock.wall_ms()) {
            tracing::info!(path = %path, "pin expired");
        }
    }

    /// Drops the pins that expired by `now_unix_ms`; returns their paths.
    pub fn expire(&self, now_unix_ms: i64) -> Vec<String> {
        let expired: Vec<String> = self
            .state()
            .pins
            .values()
            .filter(|p| p.expires_unix_ms.is_some_and(|at| at <= now_unix_ms))
            .map(|p| p.path.clone())
            .collect();
        let mut gone = Vec::new();
        for path in expired {
            match self.remove(&path) {
                Ok(_) => gone.push(path),
                // Kept, and tried again at the next tick.
                Err(e) => tracing::warn!(path = %path, err = %e, "cannot drop an expired pin"),
            }
        }
        gone
    }

    /// Queues a free of the blocks under `ufs_prefix`; returns its sequence number.
    pub fn queue_free(&self, ufs_prefix: String) -> u64 {
        let mut state = self.state();
        state.last_free += 1;
        metrics::counter!(m::FREES).increment(1);
        let seq = state.last_free;
        state.frees.push_back((seq, ufs_prefix));
        while state.frees.len() > FREES_KEPT {
            state.frees.pop_front();
        }
        seq
    }

    /// What a worker that applied every free up to `applied` must apply now: the last sequence
    /// and the prefixes after `applied`. A worker new to this master (`applied` 0) has nothing
    /// of the past to drop; it starts at the last sequence.
    pub fn frees_after(&self, applied: u64) -> (u64, Vec<String>) {
        let state = self.state();
        if applied == 0 {
            return (state.last_free, Vec::new());
        }
        let prefixes = state.frees.iter().filter(|(seq, _)| *seq > applied).map(|(_, p)| p.clone()).collect();
        (state.last_free, prefixes)
    }

    /// A worker applied every free up to `seq`.
    pub fn applied(&self, worker_id: &str, seq: u64) {
        self.state().applied.insert(worker_id.to_string(), seq);
        self.reports.notify_waiters();
    }

    /// Resolves at the next report of a worker (a heartbeat's `frees_applied`, `pins_epoch`).
    /// Create it before checking what has been applied, so a report in between is not missed.
    pub fn reported(&self) -> tokio::sync::futures::Notified<'_> {
        self.reports.notified()
    }

    pub fn applied_by(&self, worker_id: &str) -> u64 {
        self.state().applied.get(worker_id).copied().unwrap_or(0)
    }

    /// A worker has the pins and TTLs of `epoch` in force (it says so in each heartbeat).
    pub fn epoch_applied(&self, worker_id: &str, epoch: u64) {
        let previous = self.state().epochs_applied.insert(worker_id.to_string(), epoch);
        if previous != Some(epoch) {
            self.reports.notify_waiters();
        }
    }

    /// The pins epoch a worker last said it has in force (0: none yet).
    pub fn epoch_applied_by(&self, worker_id: &str) -> u64 {
        self.state().epochs_applied.get(worker_id).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use strata_common::Clock;
    use strata_common::clock::ManualClock;

    use super::*;
    use crate::store::MemStore;

    /// Pins on a manual clock, and its first epoch (the clock's wall time).
    fn pins_on(records: Vec<PinRecord>, store: Arc<MemStore>) -> (Pins, u64) {
        let clock = ManualClock::new();
        let base = clock.wall_ms() as u64;
        (Pins::new(records, Vec::new(), store, clock), base)
    }

    fn pin(path: &str, tier: PinTier, bytes: u64, expires: Option<i64>) -> PinRecord {
        PinRecord {
            path: path.into(),
            tier,
            bytes,
            ufs_prefix: ufs_prefix("s3://b/p", path.trim_start_matches("/data")),
            created_unix_ms: 1,
            expires_unix_ms: expires,
        }
    }

    #[test]
    fn a_prefix_covers_its_files_and_directories_at_path_boundaries_only() {
        let p = ufs_prefix("s3://b/p/", "/models/llama/");
        assert_eq!(p, "s3://b/p/models/llama");
        assert!(covers(&p, "s3://b/p/models/llama#bs4194304"), "the file itself");
        assert!(covers(&p, "s3://b/p/models/llama/w.bin#bs4194304"), "a file below");
        assert!(!covers(&p, "s3://b/p/models/llama2/w.bin#bs4194304"), "a sibling with the same start");
        assert!(!covers(&p, "s3://b/p/models#bs4194304"));
        let root = ufs_prefix("s3://b/p", "");
        assert_eq!(root, "s3://b/p/");
        assert!(covers(&root, "s3://b/p/any/file#bs1"), "a pin of the mount point covers it all");
        assert!(!covers(&root, "s3://b/px/file#bs1"));
    }

    #[test]
    fn pins_are_durable_replace_by_path_and_move_the_epoch() {
        let store = Arc::new(MemStore::default());
        let (pins, base) = pins_on(Vec::new(), store.clone());
        pins.add(pin("/data/a", PinTier::Nvme, 10, None)).unwrap();
        pins.add(pin("/data/b", PinTier::Memory, 5, None)).unwrap();
        pins.add(pin("/data/a", PinTier::Nvme, 20, None)).unwrap();
        assert_eq!(pins.epoch(), base + 3);
        assert_eq!(pins.list().len(), 2);
        assert_eq!(pins.pinned_bytes(PinTier::Nvme, ""), 20, "the replaced pin counts once");
        assert_eq!(pins.pinned_bytes(PinTier::Nvme, "/data/a"), 0);
        assert_eq!(pins.overlapping("/data/a/x").map(|p| p.path), Some("/data/a".into()));
        assert_eq!(pins.overlapping("/data").map(|p| p.path), Some("/data/a".into()), "a pin below");
        assert!(pins.overlapping("/data/ab").is_none());

        // A new master (a restart, a new leader) starts from the store.
        let (again, _) = pins_on(store.load_pins().unwrap(), store.clone());
        assert_eq!(again.list(), pins.list());
        again.remove("/data/b").unwrap();
        assert!(matches!(again.remove("/data/b"), Err(OpError::NoPin(_))));
        assert_eq!(store.load_pins().unwrap().len(), 1);
    }

    #[test]
    fn expired_pins_are_dropped_from_the_store() {
        let store = Arc::new(MemStore::default());
        let (pins, _) = pins_on(Vec::new(), store.clone());
        pins.add(pin("/data/short", PinTier::Nvme, 1, Some(1_000))).unwrap();
        pins.add(pin("/data/forever", PinTier::Nvme, 1, None)).unwrap();
        assert!(pins.expire(999).is_empty());
        assert_eq!(pins.expire(1_000), vec!["/data/short".to_string()]);
        assert_eq!(
            store.load_pins().unwrap().into_iter().map(|p| p.path).collect::<Vec<_>>(),
            ["/data/forever"]
        );
    }

    #[test]
    fn workers_take_the_frees_after_the_last_they_applied() {
        let (pins, b) = pins_on(Vec::new(), Arc::new(MemStore::default()));
        assert_eq!(pins.frees_after(0), (b, Vec::new()));
        let first = pins.queue_free("s3://b/p/a".into());
        let second = pins.queue_free("s3://b/p/b".into());
        assert_eq!((first, second), (b + 1, b + 2));
        assert_eq!(pins.frees_after(b), (b + 2, vec!["s3://b/p/a".to_string(), "s3://b/p/b".to_string()]));
        assert_eq!(pins.frees_after(b + 1), (b + 2, vec!["s3://b/p/b".to_string()]));
        assert_eq!(pins.frees_after(0), (b + 2, Vec::new()), "a newcomer holds nothing freed before it");
        pins.applied("w1", b + 2);
        assert_eq!(pins.applied_by("w1"), b + 2);
        assert_eq!(pins.applied_by("w2"), 0);
    }
}
