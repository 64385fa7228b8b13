//! The NVMe tier's containers in use: the appender (the open container, where each packed batch
//! is appended in one write), dead marks for entries that left, sealing a full container,
//! deleting a sealed one with nothing live left in it, and compaction, which moves the live
//! entries of mostly dead containers to the open one. A container file's format is
//! [`pack`](super::pack)'s.
//!
//! The appender mutex is only taken in blocking tasks, and the index mutex may be taken under
//! it, never the other way round (the parent module's lock order).

use std::fs::File;
use std::io;
use std::sync::{Arc, PoisonError};

use bytes::Bytes;
use strata_common::BlockKey;

use super::format::remove_quietly;
use super::index::{Container, PackAt, Slot};
use super::{Shared, pack};
use crate::metrics_defs as m;
use crate::tier::Compacted;
#[cfg(doc)]
use crate::tier::Tier;

/// Live bytes one [`Tier::compact`] call moves at most, so a compaction pass never holds the
/// disk for long; the next upkeep sweep goes on.
const COMPACT_BUDGET: u64 = 64 << 20;

/// The open container: where the next packed batch is appended.
pub(super) struct Appender {
    pub(super) seq: u32,
    pub(super) file: Arc<File>,
    pub(super) len: u64,
}

impl Shared {
    /// Blocking: appends whole entries for `entries` to the open container (opening one first
    /// when there is none or it is full) in one write, counts them in the container, and
    /// returns where each landed. Sealing a full container happens here too, after its last
    /// append was counted, so a container is never deleted while an append into it is in flight.
    pub(super) fn append(&self, entries: &[(BlockKey, Bytes)]) -> io::Result<Vec<PackAt>> {
        let mut appender = self.appender.lock().unwrap_or_else(PoisonError::into_inner);
        if appender.as_ref().is_none_or(|a| a.len >= self.options.container_bytes) {
            self.seal(appender.take());
            let seq = {
                let mut index = self.lock();
                let seq = index.next_container;
                index.next_container += 1;
                seq
            };
            let file = Arc::new(pack::create(&self.packs_dir, seq)?);
            self.lock().containers.insert(
                seq,
                Container { file: Arc::clone(&file), len: 0, live_bytes: 0, live_entries: 0, sealed: false },
            );
            *appender = Some(Appender { seq, file, len: 0 });
        }
        let open = appender.as_mut().expect("opened above");
        let mut buf = Vec::with_capacity(
            entries.iter().map(|(k, d)| pack::entry_len(k, d.len() as u64) as usize).sum(),
        );
        let mut places = Vec::with_capacity(entries.len());
        for (key, data) in entries {
            places.push(PackAt { container: open.seq, offset: open.len + buf.len() as u64 });
            pack::encode_entry(&mut buf, key, data);
        }
        pack::append(&open.file, open.len, &buf)?;
        open.len += buf.len() as u64;
        let mut index = self.lock();
        if let Some(c) = index.containers.get_mut(&open.seq) {
            c.len = open.len;
            c.live_bytes += buf.len() as u64;
            c.live_entries += entries.len() as u64;
        }
        drop(index);
        metrics::counter!(m::NVME_PACKED_APPENDS).increment(1);
        metrics::counter!(m::NVME_PACKED_ENTRIES).increment(entries.len() as u64);
        Ok(places)
    }

    /// Seals the container an appender had (if any), deleting it at once when nothing in it is
    /// live any more.
    pub(super) fn seal(&self, appender: Option<Appender>) {
        let Some(appender) = appender else { return };
        let empty = {
            let mut index = self.lock();
            if let Some(c) = index.containers.get_mut(&appender.seq) {
                c.sealed = true;
            }
            index.take_if_empty(appender.seq)
        };
        if empty {
            remove_quietly(&pack::container_path(&self.packs_dir, appender.seq), "empty container");
        }
    }

    /// Blocking: marks a retired entry (of `key`, `size` data bytes) dead on disk and gives its
    /// pages back, and deletes its container if that was the last ready entry of a sealed one.
    pub(super) fn mark_dead(&self, at: PackAt, key: &BlockKey, size: u64) -> io::Result<()> {
        let file = self.lock().container_file(at);
        let result = match file {
            Some(file) => pack::mark_dead(&file, at.offset, pack::header_len_for(key) as u64, size),
            // Deleted already: its last entry went before this one was marked.
            None => Ok(()),
        };
        self.drop_if_empty(at.container);
        result
    }

    pub(super) fn drop_if_empty(&self, seq: u32) {
        if self.lock().take_if_empty(seq) {
            remove_quietly(&pack::container_path(&self.packs_dir, seq), "empty container");
        }
    }

    /// Blocking: one compaction pass — sealed containers with no live entry are deleted, and
    /// those at least half dead (a quarter, while the dead bytes of all containers exceed a
    /// quarter of the capacity) have their live entries moved to the open container and are
    /// deleted, most dead first, until [`COMPACT_BUDGET`] live bytes have moved.
    pub(super) fn compact(&self) -> io::Result<Compacted> {
        let candidates: Vec<(u32, Arc<File>, u64)> = {
            let index = self.lock();
            let pressure = index.dead_bytes() > self.capacity / 4;
            let mut found: Vec<(u64, u32, Arc<File>, u64)> = index
                .containers
                .iter()
                .filter(|(_, c)| {
                    let dead = c.dead_bytes();
                    c.sealed && (c.live_entries == 0 || dead * 2 >= c.len || (pressure && dead * 4 >= c.len))
                })
                .map(|(seq, c)| (c.dead_bytes(), *seq, Arc::clone(&c.file), c.len))
                .collect();
            found.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            found.into_iter().map(|(_, seq, file, len)| (seq, file, len)).collect()
        };
        let mut done = Compacted::default();
        let mut budget = COMPACT_BUDGET;
        for (seq, file, len) in candidates {
            let live = self.lock().containers.get(&seq).map_or(0, |c| c.live_bytes);
            if live > budget {
                continue;
            }
            budget -= live;
            let moved = self.compact_container(seq, &file, len)?;
            done.moved += moved;
            if !self.lock().containers.contains_key(&seq) {
                done.containers += 1;
                done.reclaimed_bytes += len;
            }
        }
        if done.containers > 0 {
            tracing::debug!(
                tier = "nvme",
                containers = done.containers,
                moved = done.moved,
                reclaimed_bytes = done.reclaimed_bytes,
                "containers compacted"
            );
            metrics::counter!(m::NVME_COMPACTED_CONTAINERS).increment(done.containers);
            metrics::counter!(m::NVME_COMPACTED_ENTRIES).increment(done.moved);
        }
        Ok(done)
    }

    /// Blocking: moves the ready entries of sealed container `seq` (`len` bytes) to the open
    /// container and deletes it once none is left in it; returns how many it moved.
    pub(super) fn compact_container(&self, seq: u32, file: &File, len: u64) -> io::Result<u64> {
        use std::os::unix::fs::FileExt;
        let mut buf = vec![0u8; usize::try_from(len).map_err(io::Error::other)?];
        file.read_exact_at(&mut buf, 0)?;
        let buf = Bytes::from(buf);
        // (key, generation, where it was, its data)
        let mut moving: Vec<(BlockKey, u64, PackAt, Bytes)> = Vec::new();
        let mut corrupt: Vec<(BlockKey, u64)> = Vec::new();
        for (offset, header) in pack::walk(&buf) {
            let at = PackAt { container: seq, offset };
            let generation = match self.lock().slots.get(&header.key) {
                Some(Slot::Ready(r)) if r.packed == Some(at) => r.generation,
                // Dead, or not the copy the index serves.
                _ => continue,
            };
            let start = offset as usize + header.header_len;
            let data = buf.slice(start..start + header.data_len as usize);
            if crc32c::crc32c(&data) == header.data_crc {
                moving.push((header.key, generation, at, data));
            } else {
                corrupt.push((header.key, generation));
            }
        }
        for (key, generation) in corrupt {
            self.drop_corrupt(&key, generation, "data checksum mismatch");
        }
        if moving.is_empty() {
            self.drop_if_empty(seq);
            return Ok(0);
        }
        let entries: Vec<(BlockKey, Bytes)> =
            moving.iter().map(|(k, _, _, d)| (k.clone(), d.clone())).collect();
        let places = self.append(&entries)?;
        let mut moved = 0;
        let mut garbage = Vec::new();
        {
            let mut index = self.lock();
            for ((key, generation, old, data), new) in moving.into_iter().zip(places) {
                let size = data.len() as u64;
                let still_here = matches!(index.slots.get(&key),
                    Some(Slot::Ready(r)) if r.generation == generation && r.packed == Some(old));
                if still_here {
                    let fresh = index.bump_generation();
                    if let Some(Slot::Ready(r)) = index.slots.get_mut(&key) {
                        r.packed = Some(new);
                        r.generation = fresh;
                        r.verified = true;
                    }
                    index.uncount(old.container, &key, size);
                    moved += 1;
                } else {
                    // Evicted or removed while it was copied: the copy is not wanted.
                    index.uncount(new.container, &key, size);
                    garbage.push((new, key, size));
                }
            }
        }
        for (at, key, size) in garbage {
            self.mark_dead(at, &key, size)?;
        }
        self.drop_if_empty(seq);
        Ok(moved)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::fs;
    use std::path::Path;
    use std::sync::atomic::Ordering;

    use proptest::prelude::*;

    use super::super::testing::{
        block_files, container_entries, container_files, data_for, flip_byte, key_set, replay, small_key,
        small_puts,
    };
    use super::super::{NvmeOptions, NvmeTier};
    use super::*;
    use crate::tier::{PutParams, Tier, TierEvent};

    #[tokio::test]
    async fn a_batch_of_small_blocks_is_one_append_to_one_container_and_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 64 << 20).unwrap();
        let results = tier.put_many(small_puts(0..300, |i| 1 + (i as usize * 977) % 20_000)).await;
        assert!(results.iter().all(Result::is_ok), "{results:?}");
        assert!(block_files(dir.path()).is_empty(), "small blocks get no file of their own");
        assert_eq!(container_files(dir.path()).len(), 1);
        for i in 0..300 {
            let want = data_for(i, 1 + (i as usize * 977) % 20_000);
            assert_eq!(tier.get(&small_key(i)).await.unwrap(), Some(want));
        }
        // An entry is never served without its checksum (no sendfile, no passed descriptor).
        assert!(tier.open_verified(&small_key(7)).is_none());
        let before = key_set(&tier);
        drop(tier);

        let tier = NvmeTier::open(dir.path(), 64 << 20).unwrap();
        assert_eq!(key_set(&tier), before);
        let mut replayed = BTreeMap::new();
        replay(&mut replayed, tier.drain_events());
        assert_eq!(replayed, before);
        for i in (0..300).step_by(7) {
            assert_eq!(
                tier.get(&small_key(i)).await.unwrap(),
                Some(data_for(i, 1 + (i as usize * 977) % 20_000))
            );
        }
        assert_eq!(tier.corrupt_blocks(), 0);
    }

    /// Bytes the file system holds for a file (its blocks, not its length).
    fn allocated(path: &Path) -> u64 {
        use std::os::unix::fs::MetadataExt;
        fs::metadata(path).unwrap().blocks() * 512
    }

    #[tokio::test]
    async fn an_evicted_entry_gives_its_pages_back_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 64 << 20).unwrap();
        for r in tier.put_many(small_puts(0..40, |_| 256 << 10)).await {
            r.unwrap();
        }
        let container = &container_files(dir.path())[0];
        let before = allocated(container);
        assert!(before >= 40 * (256 << 10), "{before}");
        for i in 0..30 {
            tier.remove(&small_key(i)).await.unwrap();
        }
        let after = allocated(container);
        // What is left: the live ten, and a header and at most two partial pages per dead one.
        assert!(after <= 10 * (256 << 10) + 30 * 3 * 4096 + 4096, "{before} -> {after} bytes on disk");
        for i in 30..40 {
            assert_eq!(tier.get(&small_key(i)).await.unwrap(), Some(data_for(i, 256 << 10)));
        }
        drop(tier);
        let tier = NvmeTier::open(dir.path(), 64 << 20).unwrap();
        assert_eq!(tier.usage().blocks, 10);
        assert_eq!(tier.corrupt_blocks(), 0, "punched entries are dead, not corrupt");
    }

    #[tokio::test]
    async fn a_full_disk_of_packed_blocks_evicts_and_takes_the_next_batch() {
        let root = tempfile::tempdir().unwrap();
        let disk = strata_common::testing::Tmpfs::new(root.path().join("disk"), "4m");
        // The tier is told it has 64 MiB; the disk under it takes 4.
        let tier = NvmeTier::open(disk.path(), 64 << 20).unwrap();
        for b in 0..6u64 {
            let results = tier.put_many(small_puts(b * 4..b * 4 + 4, |_| 256 << 10)).await;
            assert!(results.iter().all(Result::is_ok), "batch {b}: {results:?}");
        }
        let health = tier.disk_health();
        assert!(health.no_space_errors >= 1, "{health:?}");
        assert!(health.limit_bytes.is_some_and(|l| l < 4 << 20), "{health:?}");
        for i in 20..24 {
            assert_eq!(
                tier.get(&small_key(i)).await.unwrap(),
                Some(data_for(i, 256 << 10)),
                "the newest batch"
            );
        }
        for (k, size) in tier.keys() {
            assert_eq!(tier.get(&k).await.unwrap().map(|b| b.len() as u64), Some(size));
        }
        assert_eq!(tier.corrupt_blocks(), 0);
    }

    #[tokio::test]
    async fn a_corrupt_entry_is_dropped_counted_and_stored_again() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        for r in tier.put_many(small_puts(0..5, |_| 4096)).await {
            r.unwrap();
        }
        let (path, offset, len) = tier.locate(&small_key(2)).unwrap();
        flip_byte(&path, (offset + len / 2) as usize);
        // Zero copy would skip the check: only a checked read finds it.
        let _ = tier.drain_events();
        assert_eq!(tier.get(&small_key(2)).await.unwrap(), None);
        assert_eq!(tier.corrupt_blocks(), 1);
        assert_eq!(tier.drain_events(), vec![TierEvent::Removed { key: small_key(2) }]);
        for i in [0, 1, 3, 4] {
            assert_eq!(tier.get(&small_key(i)).await.unwrap(), Some(data_for(i, 4096)), "neighbours intact");
        }
        // Fetched again, it gets a new entry.
        tier.put_with(&small_key(2), data_for(2, 4096), PutParams { packed: true }).await.unwrap();
        assert_eq!(tier.get(&small_key(2)).await.unwrap(), Some(data_for(2, 4096)));
        drop(tier);
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(tier.get(&small_key(2)).await.unwrap(), Some(data_for(2, 4096)));
        assert_eq!(tier.corrupt_blocks(), 0, "the bad copy was marked dead, not found again");
    }

    #[tokio::test]
    async fn compaction_moves_the_live_entries_of_mostly_dead_containers_and_frees_their_files() {
        let dir = tempfile::tempdir().unwrap();
        let tier =
            NvmeTier::open_with(dir.path(), 64 << 20, NvmeOptions { container_bytes: 40_000 }).unwrap();
        // Ten batches of ten 4 KiB blocks: ten containers.
        for b in 0..10 {
            for r in tier.put_many(small_puts(b * 10..b * 10 + 10, |_| 4096)).await {
                r.unwrap();
            }
        }
        assert_eq!(container_files(dir.path()).len(), 10);
        // Every container loses 7 of its 10; the first one all of them.
        for i in 0..100u64 {
            if i % 10 < 7 || i < 10 {
                tier.remove(&small_key(i)).await.unwrap();
            }
        }
        assert_eq!(
            container_files(dir.path()).len(),
            9,
            "a sealed container with nothing live is deleted at once"
        );
        let (dead_before, _) = tier.dead_bytes();
        let done = tier.compact().await.unwrap();
        assert!(done.moved == 8 * 3 && done.containers == 8, "{done:?}");
        let (dead_after, containers) = tier.dead_bytes();
        assert!(dead_after < dead_before / 4, "{dead_before} -> {dead_after}");
        assert_eq!(containers, container_files(dir.path()).len());
        assert!(containers <= 3, "{containers} containers left");
        for i in 0..100u64 {
            let want = (i % 10 >= 7 && i >= 10).then(|| data_for(i, 4096));
            assert_eq!(tier.get(&small_key(i)).await.unwrap(), want, "block {i}");
        }
        assert!(
            tier.drain_events()
                .iter()
                .all(|e| matches!(e, TierEvent::Added { .. } | TierEvent::Removed { .. }))
        );
        let kept = key_set(&tier);
        drop(tier);
        let tier = NvmeTier::open(dir.path(), 64 << 20).unwrap();
        assert_eq!(key_set(&tier), kept);
        assert_eq!(tier.corrupt_blocks(), 0);
    }

    #[test]
    fn reads_during_compaction_never_miss_and_never_return_other_bytes() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let tier = Arc::new(
            NvmeTier::open_with(dir.path(), 64 << 20, NvmeOptions { container_bytes: 64 << 10 }).unwrap(),
        );
        rt.block_on(async {
            for b in 0..20 {
                for r in
                    tier.put_many(small_puts(b * 20..b * 20 + 20, |i| 1000 + (i as usize % 7) * 900)).await
                {
                    r.unwrap();
                }
            }
            // Two thirds of every container die: all of them qualify.
            for i in (0..400u64).filter(|i| i % 3 != 1) {
                tier.remove(&small_key(i)).await.unwrap();
            }
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let mut readers = Vec::new();
            for t in 0..3u64 {
                let (tier, stop) = (Arc::clone(&tier), Arc::clone(&stop));
                readers.push(tokio::spawn(async move {
                    let mut reads = 0u64;
                    let mut i = t;
                    while !stop.load(Ordering::Relaxed) || reads < 200 {
                        let k = 1 + 3 * (i % 133);
                        let got = tier.get(&small_key(k)).await.unwrap();
                        assert_eq!(got, Some(data_for(k, 1000 + (k as usize % 7) * 900)), "block {k}");
                        reads += 1;
                        i += 3;
                    }
                    reads
                }));
            }
            let mut moved = 0;
            for _ in 0..10 {
                moved += tier.compact().await.unwrap().moved;
            }
            stop.store(true, Ordering::Relaxed);
            for r in readers {
                assert!(r.await.unwrap() >= 200);
            }
            // The open container is not compacted; every sealed one's live entries moved.
            assert!(moved >= 100, "{moved} of 133 live entries moved");
        });
        assert_eq!(tier.corrupt_blocks(), 0);
    }

    #[derive(Debug, Clone)]
    enum PackOp {
        Put(u64),
        PutMany(u64, u64),
        Remove(u64),
        Compact,
        Reopen,
    }

    fn pack_op() -> impl Strategy<Value = PackOp> {
        prop_oneof![
            3 => (0u64..24).prop_map(PackOp::Put),
            2 => (0u64..24, 1u64..8).prop_map(|(a, n)| PackOp::PutMany(a, n)),
            3 => (0u64..24).prop_map(PackOp::Remove),
            1 => Just(PackOp::Compact),
            1 => Just(PackOp::Reopen),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// The packed index against a reference map (key → bytes), with a capacity no put
        /// exceeds, so only removals kill entries: after every operation the tier holds exactly
        /// the map, every byte reads back, and the containers on disk hold exactly its live
        /// entries, however containers were sealed, compacted and reopened.
        #[test]
        fn the_packed_index_matches_a_reference_map(
            container_bytes in 100u64..3000,
            ops in proptest::collection::vec(pack_op(), 1..60),
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let dir = tempfile::tempdir().unwrap();
            let options = NvmeOptions { container_bytes };
            let mut tier = NvmeTier::open_with(dir.path(), 1 << 20, options).unwrap();
            let mut model: BTreeMap<u64, Bytes> = BTreeMap::new();
            let size = |i: u64| (i as usize * 37) % 500;
            for op in ops {
                match op {
                    PackOp::Put(i) => {
                        rt.block_on(tier.put_with(&small_key(i), data_for(i, size(i)), PutParams { packed: true })).unwrap();
                        model.insert(i, data_for(i, size(i)));
                    }
                    PackOp::PutMany(a, n) => {
                        for r in rt.block_on(tier.put_many(small_puts(a..a + n, size))) {
                            r.unwrap();
                        }
                        for i in a..a + n {
                            model.insert(i, data_for(i, size(i)));
                        }
                    }
                    PackOp::Remove(i) => {
                        rt.block_on(tier.remove(&small_key(i))).unwrap();
                        model.remove(&i);
                    }
                    PackOp::Compact => {
                        rt.block_on(tier.compact()).unwrap();
                    }
                    PackOp::Reopen => {
                        drop(tier);
                        tier = NvmeTier::open_with(dir.path(), 1 << 20, options).unwrap();
                    }
                }
                let expected: BTreeMap<BlockKey, u64> = model.iter().map(|(i, d)| (small_key(*i), d.len() as u64)).collect();
                prop_assert_eq!(&key_set(&tier), &expected);
                prop_assert_eq!(container_entries(dir.path()), expected);
                prop_assert!(block_files(dir.path()).is_empty());
                for (i, data) in &model {
                    prop_assert_eq!(rt.block_on(tier.get(&small_key(*i))).unwrap(), Some(data.clone()));
                }
                prop_assert_eq!(tier.corrupt_blocks(), 0);
                let index = tier.shared.lock();
                let dead: u64 = index.containers.values().map(Container::dead_bytes).sum();
                let on_disk: u64 = container_files(dir.path()).iter().map(|p| fs::metadata(p).unwrap().len()).sum();
                let live: u64 = index.containers.values().map(|c| c.live_bytes).sum();
                prop_assert_eq!(live + dead, on_disk, "the containers' counts are their files");
            }
        }
    }
}
