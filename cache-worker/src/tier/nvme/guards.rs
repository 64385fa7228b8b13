//! Puts and removes of an NVMe tier's blocks: begun under the index lock, finished by drop
//! guards. Beginning one (`begin_put`, `begin_remove`) turns the key's slot `Busy`, reserves the
//! put's bytes and retires its victims in one critical section; the file I/O then runs in a
//! blocking task that owns a guard (`PendingWrite`, `Deleting`) whose drop settles the index —
//! publishes the block if it was stored, releases the reservation, clears `Busy`, wakes the
//! waiters — whatever became of the caller, so a cancelled put leaves nothing busy or reserved.
//! Failed writes are counted here by reason, and a full disk lowers the tier's limit.

use std::fs;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use bytes::Bytes;
use strata_common::BlockKey;

#[cfg(doc)]
use super::FULL_RETRY;
use super::Shared;
use super::format::{encode_block, remove_quietly, tmp_path, write_block_file};
use super::index::{PackAt, Slot};
use crate::metrics_defs as m;
use crate::tier::{Result, TierError};

#[derive(Default)]
pub(super) struct WriteErrorCounts {
    pub(super) no_space: AtomicU64,
    pub(super) quota: AtomicU64,
    pub(super) io: AtomicU64,
}

/// Why a block file could not be written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WriteFailure {
    NoSpace,
    Quota,
    Io,
}

impl WriteFailure {
    fn of(e: &io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::StorageFull => WriteFailure::NoSpace,
            io::ErrorKind::QuotaExceeded => WriteFailure::Quota,
            _ => WriteFailure::Io,
        }
    }

    /// The `reason` label of `strata_worker_nvme_write_errors_total`.
    fn label(self) -> &'static str {
        match self {
            WriteFailure::NoSpace => "no_space",
            WriteFailure::Quota => "quota",
            WriteFailure::Io => "io",
        }
    }

    fn disk_full(self) -> bool {
        self != WriteFailure::Io
    }
}

/// A put in flight: the key is `Busy` and its size reserved until this is dropped, which
/// publishes the block if it was stored (at `packed` when it went into a container).
pub(super) struct PendingWrite {
    pub(super) shared: Arc<Shared>,
    pub(super) key: BlockKey,
    pub(super) size: u64,
    pub(super) stored: bool,
    pub(super) packed: Option<PackAt>,
}

impl Drop for PendingWrite {
    fn drop(&mut self) {
        let mut index = self.shared.lock();
        index.reserved -= self.size;
        index.clear_busy(&self.key);
        if self.stored {
            index.insert_ready(self.key.clone(), self.size, true, self.packed);
        }
        drop(index);
        self.shared.settled.notify_waiters();
    }
}

/// A retired block whose storage is to be given back: its file deleted, or its entry marked
/// dead.
pub(super) struct Retired {
    pub(super) key: BlockKey,
    pub(super) packed: Option<PackAt>,
    pub(super) size: u64,
}

/// Retired keys whose files are to be deleted (entries marked dead); their `Busy` slots clear
/// when this is dropped.
pub(super) struct Deleting {
    pub(super) shared: Arc<Shared>,
    pub(super) retired: Vec<Retired>,
}

impl Deleting {
    /// Deletes every file and marks every entry dead (deleting containers that emptied),
    /// returning the first error other than "already gone".
    pub(super) fn delete_files(&self) -> io::Result<()> {
        let mut first_err = None;
        for r in &self.retired {
            let result = match r.packed {
                None => match fs::remove_file(self.shared.block_path(&r.key)) {
                    Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
                    other => other,
                },
                Some(at) => self.shared.mark_dead(at, &r.key, r.size),
            };
            if let Err(e) = result {
                tracing::warn!(block = %r.key, tier = "nvme", error = %e, "could not delete block");
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl Drop for Deleting {
    fn drop(&mut self) {
        if self.retired.is_empty() {
            return;
        }
        let mut index = self.shared.lock();
        for r in &self.retired {
            index.clear_busy(&r.key);
        }
        drop(index);
        self.shared.settled.notify_waiters();
    }
}

pub(super) struct PutJob {
    pub(super) pending: PendingWrite,
    pub(super) victims: Deleting,
}

impl PutJob {
    /// Blocking: gives back the victims' storage (an eviction that fails to delete leaves an
    /// orphan file the index no longer counts, which `open` re-indexes later; the new block is
    /// still worth writing).
    fn evict_victims(victims: Deleting) {
        for r in &victims.retired {
            tracing::debug!(block = %r.key, tier = "nvme", "evicted");
        }
        let _ = victims.delete_files();
    }

    /// Blocking: evicts, then writes and publishes the block.
    pub(super) fn run(self, data: Bytes) -> Result<()> {
        let PutJob { mut pending, victims } = self;
        Self::evict_victims(victims);

        let path = pending.shared.block_path(&pending.key);
        let tmp = tmp_path(&path);
        let (header, trailer) = encode_block(&pending.key, &data);
        match write_block_file(&tmp, &header, &data, &trailer).and_then(|()| fs::rename(&tmp, &path)) {
            Ok(()) => {
                pending.stored = true;
                Ok(())
            }
            Err(e) => {
                remove_quietly(&tmp, "temporary block file");
                Err(pending.shared.write_failed(&pending.key, pending.size, &e))
            }
        }
        // `pending` drops here, before the caller sees the result, so a successful put is
        // visible in the index by the time it returns.
    }

    /// Blocking: evicts for every job, then appends all their blocks to the open container in
    /// one write and publishes them. One result for the batch: its blocks land together or not
    /// at all.
    pub(super) fn run_packed(shared: &Arc<Shared>, jobs: Vec<(PutJob, Bytes)>) -> Result<()> {
        let mut pendings = Vec::with_capacity(jobs.len());
        let mut entries = Vec::with_capacity(jobs.len());
        for (job, data) in jobs {
            Self::evict_victims(job.victims);
            entries.push((job.pending.key.clone(), data));
            pendings.push(job.pending);
        }
        match shared.append(&entries) {
            Ok(places) => {
                for (pending, at) in pendings.iter_mut().zip(places) {
                    pending.stored = true;
                    pending.packed = Some(at);
                }
                Ok(())
            }
            Err(e) => {
                let size = pendings.iter().map(|p| p.size).sum();
                Err(shared.write_failed(&pendings[0].key, size, &e))
            }
        }
        // The pendings drop here and publish what was stored.
    }
}

pub(super) enum BeginPut {
    Present,
    Wait,
    Write(PutJob),
    /// Only pinned blocks (of these many bytes) could make room.
    Pinned(u64),
    /// The disk is full: the tier holds at most these many bytes for now, less than the block.
    NoRoom(u64),
}

pub(super) enum BeginRemove {
    Absent,
    Wait,
    Delete(Deleting),
}

impl Shared {
    fn count_write_error(&self, failure: WriteFailure) {
        let counter = match failure {
            WriteFailure::NoSpace => &self.write_errors.no_space,
            WriteFailure::Quota => &self.write_errors.quota,
            WriteFailure::Io => &self.write_errors.io,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(m::NVME_WRITE_ERRORS, "reason" => failure.label()).increment(1);
    }

    /// Counts and logs a failed write of `size` bytes (a block, or a packed batch starting with
    /// `key`) and turns it into the put's error.
    fn write_failed(&self, key: &BlockKey, size: u64, e: &io::Error) -> TierError {
        let failure = WriteFailure::of(e);
        self.count_write_error(failure);
        tracing::warn!(block = %key, tier = "nvme", error = %e, reason = failure.label(), "block write failed");
        if failure.disk_full() {
            return TierError::DiskFull { size, held: 0, quota: failure == WriteFailure::Quota };
        }
        TierError::Io(io::Error::new(e.kind(), e.to_string()))
    }

    /// The disk refused a write for want of space: from now on (for [`FULL_RETRY`]) the tier
    /// holds no more than it does now, so the next put evicts to make room. Returns that limit.
    pub(super) fn disk_was_full(&self) -> u64 {
        let mut index = self.lock();
        let held = index.policy.used() + index.reserved;
        let limit = index.full.map_or(held, |(limit, _)| limit.min(held));
        index.full = Some((limit, Instant::now()));
        limit
    }

    pub(super) fn begin_put(self: &Arc<Self>, key: &BlockKey, size: u64) -> BeginPut {
        let mut index = self.lock();
        match index.slots.get(key) {
            Some(Slot::Ready(_)) => {
                index.touch(key);
                return BeginPut::Present;
            }
            Some(Slot::Busy) => return BeginPut::Wait,
            None => {}
        }
        let limit = index.limit(self.capacity, Instant::now());
        // Space held by other puts in flight cannot be evicted; wait for them rather than
        // overshoot the limit. They always finish, so this cannot wait forever.
        if index.reserved + size > limit {
            if index.reserved == 0 {
                return BeginPut::NoRoom(limit);
            }
            return BeginPut::Wait;
        }
        let pinned = self.pin_filter.get();
        // Room below the limit: the policy evicts down to its capacity, so ask it for the gap too.
        let need = index.reserved + size + (self.capacity - limit);
        let victims = match index.policy.victims(need, |k| pinned.is_some_and(|is_pinned| is_pinned(k))) {
            Ok(victims) => victims,
            // Pins leave room for the block beside them, but puts in flight hold it: once they
            // land they are evictable, as they would be had this put come after them, so wait
            // for them rather than refuse a put a caller alone would see succeed.
            Err(pinned_bytes) if index.reserved > 0 && pinned_bytes + size <= limit => return BeginPut::Wait,
            Err(pinned_bytes) => return BeginPut::Pinned(pinned_bytes),
        };
        let retired = victims
            .into_iter()
            .filter_map(|victim| {
                let ready = index.retire(&victim)?;
                Some(Retired { key: victim, packed: ready.packed, size: ready.size })
            })
            .collect();
        index.slots.insert(key.clone(), Slot::Busy);
        index.reserved += size;
        drop(index);
        BeginPut::Write(PutJob {
            pending: PendingWrite {
                shared: Arc::clone(self),
                key: key.clone(),
                size,
                stored: false,
                packed: None,
            },
            victims: Deleting { shared: Arc::clone(self), retired },
        })
    }

    pub(super) fn begin_remove(self: &Arc<Self>, key: &BlockKey) -> BeginRemove {
        let mut index = self.lock();
        match index.slots.get(key) {
            None => BeginRemove::Absent,
            Some(Slot::Busy) => BeginRemove::Wait,
            Some(Slot::Ready(_)) => {
                let ready = index.retire(key).expect("ready");
                drop(index);
                BeginRemove::Delete(Deleting {
                    shared: Arc::clone(self),
                    retired: vec![Retired { key: key.clone(), packed: ready.packed, size: ready.size }],
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::fs::File;
    use std::io::Write;
    use std::pin::pin;
    use std::time::Duration;

    use super::super::NvmeTier;
    use super::super::format::TMP_SUFFIX;
    use super::super::testing::{block_files, data_for, files_with_suffix, key, key_set, replay};
    use super::*;
    use crate::tier::Tier;

    #[tokio::test]
    async fn cancelled_put_still_settles() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        {
            // Polled once (the write is handed to the blocking pool), then dropped.
            let k = key(1);
            let put = tier.put(&k, data_for(1, 1000));
            tokio::select! {
                biased;
                _ = put => {}
                _ = std::future::ready(()) => {}
            }
        }
        // The write finishes on its own and publishes the block...
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !tier.contains(&key(1)) {
            assert!(tokio::time::Instant::now() < deadline, "cancelled put never settled");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // ...and neither its slot nor its reservation is left behind.
        assert_eq!(tier.get(&key(1)).await.unwrap(), Some(data_for(1, 1000)));
        tier.put(&key(2), data_for(2, (1 << 20) - 1000)).await.unwrap();
        tier.remove(&key(1)).await.unwrap();
        assert_eq!(tier.usage().used_bytes, (1 << 20) - 1000);
    }

    #[tokio::test]
    async fn puts_and_removes_wait_for_writes_in_flight() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 100).unwrap();
        // Start a write without running it: key 1 is busy and 80 bytes are reserved.
        let BeginPut::Write(job) = tier.shared.begin_put(&key(1), 80) else {
            panic!("expected a write to start");
        };
        assert!(!tier.contains(&key(1)));
        assert_eq!(tier.get(&key(1)).await.unwrap(), None);

        let k1 = key(1);
        let k2 = key(2);
        let mut other = pin!(tier.put(&k2, data_for(2, 50)));
        let mut same = pin!(tier.put(&k1, data_for(1, 80)));
        let mut removal = pin!(tier.remove(&k1));
        let wait = Duration::from_millis(50);
        assert!(tokio::time::timeout(wait, other.as_mut()).await.is_err(), "overshot capacity");
        assert!(tokio::time::timeout(wait, same.as_mut()).await.is_err(), "second write of a busy key");
        assert!(tokio::time::timeout(wait, removal.as_mut()).await.is_err(), "removed a busy key");

        tokio::task::spawn_blocking(move || job.run(data_for(1, 80))).await.unwrap().unwrap();
        same.await.unwrap();
        assert_eq!(tier.get(&key(1)).await.unwrap(), Some(data_for(1, 80)));
        removal.await.unwrap();
        other.await.unwrap();
        assert_eq!(key_set(&tier), [(key(2), 50)].into_iter().collect());
        assert_eq!(block_files(dir.path()), [tier.block_path(&key(2))].into_iter().collect());
        let mut replayed = BTreeMap::new();
        replay(&mut replayed, tier.drain_events());
        assert_eq!(replayed, key_set(&tier));
    }

    #[tokio::test]
    async fn a_put_waits_for_puts_in_flight_rather_than_be_refused_for_pins() {
        // Alone, the second put would evict the first to make room beside the pinned block (and
        // a `put_many` of both must give it what a put would); while the first is in flight its
        // bytes cannot be evicted, so the second waits for it to land instead of being refused.
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 100).unwrap();
        assert!(tier.set_pin_filter(Arc::new(|k: &BlockKey| k.index == 0)));
        tier.put(&key(0), data_for(0, 60)).await.unwrap();
        let BeginPut::Write(job) = tier.shared.begin_put(&key(1), 30) else {
            panic!("expected a write to start");
        };
        let k2 = key(2);
        let mut second = pin!(tier.put(&k2, data_for(2, 30)));
        let wait = Duration::from_millis(50);
        assert!(
            tokio::time::timeout(wait, second.as_mut()).await.is_err(),
            "refused while a put was in flight"
        );

        tokio::task::spawn_blocking(move || job.run(data_for(1, 30))).await.unwrap().unwrap();
        second.await.unwrap();
        assert_eq!(key_set(&tier), [(key(0), 60), (key(2), 30)].into_iter().collect());
        // Only pins in the way and nothing in flight: refused at once, nothing evicted.
        tier.drain_events();
        match tier.put(&key(3), data_for(3, 50)).await {
            Err(TierError::Pinned { size: 50, pinned: 60, capacity: 100 }) => {}
            other => panic!("expected Pinned, got {other:?}"),
        }
        assert!(tier.drain_events().is_empty());
    }

    #[test]
    fn concurrent_ops_keep_index_and_disk_consistent() {
        const CAPACITY: u64 = 1500;
        fn size_of(k: u64) -> usize {
            (k as usize * 137) % 700
        }
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let tier = Arc::new(NvmeTier::open(dir.path(), CAPACITY).unwrap());
        rt.block_on(async {
            let mut tasks = Vec::new();
            for t in 0..8u64 {
                let tier = Arc::clone(&tier);
                tasks.push(tokio::spawn(async move {
                    let mut state = t.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                    for _ in 0..200 {
                        state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                        let k = (state >> 33) % 16;
                        let data = data_for(k, size_of(k));
                        match (state >> 20) % 5 {
                            0 | 1 => tier.put(&key(k), data).await.unwrap(),
                            2 | 3 => {
                                if let Some(got) = tier.get(&key(k)).await.unwrap() {
                                    assert_eq!(got, data);
                                }
                            }
                            _ => tier.remove(&key(k)).await.unwrap(),
                        }
                        let index = tier.shared.lock();
                        assert!(
                            index.policy.used() + index.reserved <= CAPACITY,
                            "over capacity: used {} reserved {}",
                            index.policy.used(),
                            index.reserved
                        );
                    }
                }));
            }
            for task in tasks {
                task.await.unwrap();
            }
        });
        let keys = key_set(&tier);
        let mut replayed = BTreeMap::new();
        replay(&mut replayed, tier.drain_events());
        assert_eq!(replayed, keys);
        assert_eq!(block_files(dir.path()), keys.keys().map(|k| tier.block_path(k)).collect());
        assert!(files_with_suffix(dir.path(), ".tmp").is_empty());
        assert_eq!(tier.usage().used_bytes, keys.values().sum::<u64>());
        assert_eq!(tier.corrupt_blocks(), 0);
        for k in keys.keys() {
            let got = rt.block_on(tier.get(k)).unwrap();
            assert_eq!(got, Some(data_for(k.index, size_of(k.index))));
        }
        let index = tier.shared.lock();
        assert_eq!(index.reserved, 0);
        assert!(index.slots.values().all(|s| matches!(s, Slot::Ready(_))));
    }

    #[tokio::test]
    async fn a_full_disk_lowers_the_limit_evicts_and_retries_once() {
        let root = tempfile::tempdir().unwrap();
        let disk = strata_common::testing::Tmpfs::new(root.path().join("disk"), "4m");
        // The tier is told it has 64 MiB; the disk under it takes 4.
        let tier = NvmeTier::open(disk.path(), 64 << 20).unwrap();
        let block = 1 << 20;
        for i in 0..12 {
            tier.put(&key(i), data_for(i, block)).await.unwrap_or_else(|e| panic!("put {i}: {e}"));
        }
        let health = tier.disk_health();
        assert_eq!(
            health.no_space_errors, 1,
            "one failed write, then eviction stays below the disk: {health:?}"
        );
        assert_eq!((health.quota_errors, health.io_errors), (0, 0));
        let limit = health.limit_bytes.expect("a full disk lowers the limit");
        assert!((block as u64..4 << 20).contains(&limit), "limit {limit}");
        let usage = tier.usage();
        assert!(usage.used_bytes <= limit && usage.capacity_bytes == 64 << 20, "{usage:?}");
        // The newest blocks are there and intact; the oldest made room.
        assert_eq!(tier.get(&key(11)).await.unwrap(), Some(data_for(11, block)));
        assert_eq!(tier.get(&key(0)).await.unwrap(), None);
        for (k, size) in tier.keys() {
            let i = k.index;
            assert_eq!(tier.get(&k).await.unwrap(), Some(data_for(i, size as usize)), "block {i}");
        }
        assert!(files_with_suffix(disk.path(), TMP_SUFFIX).is_empty(), "no half-written file is left");
    }

    #[tokio::test]
    async fn a_disk_another_tenant_filled_refuses_the_block_and_leaves_nothing() {
        let root = tempfile::tempdir().unwrap();
        let disk = strata_common::testing::Tmpfs::new(root.path().join("disk"), "2m");
        let tier = NvmeTier::open(disk.path(), 64 << 20).unwrap();
        // Fill the disk with someone else's file, to the last byte it takes.
        let mut ballast = File::create(disk.path().join("ballast")).unwrap();
        let chunk = vec![7u8; 64 << 10];
        while ballast.write_all(&chunk).is_ok() {}
        drop(ballast);
        let err = tier.put(&key(1), data_for(1, 256 << 10)).await.unwrap_err();
        assert!(matches!(err, TierError::DiskFull { held: 0, quota: false, .. }), "{err:?}");
        assert!(err.to_string().contains("ENOSPC"), "{err}");
        assert_eq!(tier.disk_health().limit_bytes, Some(0));
        assert_eq!(tier.disk_health().no_space_errors, 1, "the retry saw the limit and did not write");
        assert_eq!(tier.get(&key(1)).await.unwrap(), None);
        assert_eq!(tier.usage().used_bytes, 0);
        assert!(files_with_suffix(disk.path(), TMP_SUFFIX).is_empty());
        let events = tier.drain_events();
        assert!(events.is_empty(), "nothing was added: {events:?}");
    }
}
