//! NVMe tier: one file per block under `<dir>/blocks/<2 hex>/<32 hex>.blk`, where the hex is the
//! block key's 128-bit [`storage_id`](BlockKey::storage_id) and the 2-hex shard keeps
//! directories small — except the blocks of small files ([`PutParams::packed`]), which are
//! entries of shared, append-only container files under `<dir>/packs/` (see [`pack`]).
//!
//! Each block file is a header — the full key, the data's length and checksum — then the data,
//! then a checksum per 64 KiB chunk of it; [`format`] draws it, [`pack`] a container's entries.
//!
//! # Units
//!
//! The type and its [`Tier`] impl are here, as glue; the work is in private submodules, each
//! with its tests, over the state they share (`Shared` below and its [`index::Index`]):
//! - [`format`]: block files — a key's path, the header and checksums, reads that check them
//!   (whole or chunk by chunk), the write of a temporary file;
//! - [`index`]: the in-memory index — `Ready`/`Busy` slots with generations, the eviction
//!   order, reservations, the event log, the containers' live counts, the full-disk limit;
//! - [`guards`]: beginning a put or a remove under the index lock, and the drop guards that
//!   finish it whatever becomes of the caller; write failures and the full disk;
//! - [`read`]: checked reads of ready blocks, dropping what is corrupt or vanished;
//! - [`containers`]: the appender, dead marks, sealing and compaction of containers, whose file
//!   format is [`pack`]'s;
//! - [`recovery`]: `open` — scanning the directory, discarding temporary, malformed and
//!   surplus files and torn container tails, rebuilding the index.
//!
//! # Invariants
//!
//! - A file under its real name is always complete: `put` writes `<name>.blk.tmp` and renames it,
//!   and `open` deletes leftover `*.tmp` files. There is no fsync per block: a process restart
//!   keeps the page cache, so the renamed file is intact; after a power loss a torn or stale file
//!   fails its header or data checksum and is dropped as corrupt, which for a cache only costs a
//!   refetch. An fsync per block would put a device flush on every cache fill. Containers follow
//!   the same rule: a torn tail fails its checks and is cut off at `open`.
//! - At most one operation touches a key's file at a time. Writing and deleting first turn the
//!   key's index slot `Busy`; a busy key is invisible to `get`/`contains`/`keys`, and `put` and
//!   `remove` of it wait until it settles. `get` only reads, and a `Ready` entry's file changes
//!   only after the entry left `Ready`, so a get that races with eviction reads either the whole
//!   old file (an unlinked file stays readable through an open handle) or nothing (a miss). A
//!   packed entry's data is never rewritten: eviction marks its magic dead, and its container
//!   is deleted only once no ready entry is in it, so the same holds for entries.
//! - Index entries carry a generation; a get that finds a file missing or corrupt only drops the
//!   entry if it still has the generation it read, so it never drops a newer copy of the block.
//!   Compaction moving an entry gives it a new generation for the same reason.
//! - `policy` ([`S3Fifo`]) holds exactly the ready blocks with their data lengths, so
//!   `policy.used()` is the sum of those; `reserved` is the data lengths of puts in flight, and
//!   `policy.used() + reserved <= capacity`. Headers are not counted: they are tens of bytes
//!   against blocks of megabytes. `TierUsage::used_bytes` reports `policy.used()`. Dead entries
//!   of containers are not counted either: they occupy the disk until their container is
//!   compacted ([`Tier::compact`]: a sealed container at least half dead, or any container
//!   while the dead bytes exceed a quarter of the capacity) or empties.
//! - Each container's `live_bytes`/`live_entries` are exactly those of the ready entries that
//!   point into it (counted when an append lands, uncounted when the entry is retired or moved),
//!   and a sealed container with none is deleted.
//! - Replaying the events yields the ready key set: `Added` when a block becomes ready (including
//!   blocks found by `open`), `Removed` when a ready block is evicted, removed, dropped as corrupt
//!   or found missing. Moving an entry between containers is not a change of the key set.
//! - A full disk (ENOSPC, or EDQUOT on a quota) lowers the tier's limit to what it holds when
//!   the write fails, so eviction makes room below what the disk really takes; the put is
//!   retried once after that eviction. The limit goes back to the configured capacity
//!   [`FULL_RETRY`] after the last such failure (another tenant may have freed space), and one
//!   failed write then finds out whether it is still full. Every failed write is counted by
//!   reason ([`DiskHealth`]).
//! - The index mutex is never held across an `.await` or file I/O. Bookkeeping that must follow
//!   file I/O of a put or delete lives in drop guards moved into the blocking task, so a cancelled
//!   caller cannot leave a key busy or space reserved forever. The appender mutex (the open
//!   container) is only taken in blocking tasks, and the index mutex may be taken under it,
//!   never the other way round.

mod containers;
mod format;
mod guards;
mod index;
mod pack;
mod read;
mod recovery;
#[cfg(test)]
mod testing;

use std::fmt;
use std::fs;
use std::io;
use std::path::PathBuf;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use strata_common::BlockKey;
use tokio::sync::Notify;

pub use pack::DEFAULT_CONTAINER_BYTES;

#[cfg(doc)]
use super::S3Fifo;
use super::{
    Among, BlockPut, Compacted, DiskHealth, Evicted, FileSpan, PinFilter, PutParams, Result, Tier, TierError,
    TierEvent, TierKind, TierUsage,
};
use containers::Appender;
use format::{BLOCKS_DIR, MAX_HEADER_LEN, block_path_in, header_len_for, trailer_len};
use guards::{BeginPut, BeginRemove, Deleting, PutJob, Retired, WriteErrorCounts};
use index::{Index, Slot};

/// How long a limit lowered by a full disk holds before the configured capacity is tried again.
pub const FULL_RETRY: Duration = Duration::from_secs(60);

/// How an NVMe tier is laid out (beyond its directory and capacity).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NvmeOptions {
    /// Bytes after which a container is sealed and the next batch opens a new one.
    pub container_bytes: u64,
}

impl Default for NvmeOptions {
    fn default() -> Self {
        Self { container_bytes: DEFAULT_CONTAINER_BYTES }
    }
}

/// The NVMe tier. See the module docs for the file format and invariants.
pub struct NvmeTier {
    shared: Arc<Shared>,
}

/// The state every unit of the tier works on: `NvmeTier` is a handle to it, and the blocking
/// tasks of puts, removes, reads and compaction hold it too (through their guards).
struct Shared {
    dir: PathBuf,
    blocks_dir: PathBuf,
    packs_dir: PathBuf,
    capacity: u64,
    options: NvmeOptions,
    index: Mutex<Index>,
    /// The container appends go to; only locked in blocking tasks.
    appender: Mutex<Option<Appender>>,
    corrupt: AtomicU64,
    /// Woken whenever a busy slot settles or reserved space is released.
    settled: Notify,
    pin_filter: OnceLock<PinFilter>,
    write_errors: WriteErrorCounts,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Index> {
        // Critical sections only do map updates and arithmetic kept consistent step by step, so
        // a poisoned lock still guards a usable index.
        self.index.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn block_path(&self, key: &BlockKey) -> PathBuf {
        block_path_in(&self.blocks_dir, key)
    }
}

fn join_error(e: tokio::task::JoinError) -> TierError {
    TierError::Io(io::Error::other(e))
}

impl NvmeTier {
    /// Opens (creating if needed) a tier in `dir` with the default layout; see
    /// [`open_with`](Self::open_with).
    pub fn open(dir: impl Into<PathBuf>, capacity_bytes: u64) -> Result<Self> {
        Self::open_with(dir, capacity_bytes, NvmeOptions::default())
    }

    /// Opens (creating if needed) a tier in `dir` and rebuilds its index from the block files'
    /// headers and the containers' entry headers.
    ///
    /// This is a synchronous function doing blocking I/O, meant for worker startup (call it from
    /// `spawn_blocking` if a runtime is already serving requests). Leftover `*.tmp` files are
    /// deleted; files whose header is malformed, whose length disagrees with the header, or
    /// that sit under the wrong name are deleted and counted in
    /// [`corrupt_blocks`](Tier::corrupt_blocks); a container's torn tail is cut off (counted
    /// once), and a corrupt entry inside it skipped when the entry after it checks out (counted).
    /// A block found twice (written again after a crash lost its dead mark) keeps its newest
    /// copy. If the blocks found exceed `capacity_bytes`, the oldest by mtime are dropped until
    /// they fit. Every block kept is reported as an `Added` event.
    ///
    /// The blocks kept enter the S3-FIFO main queue in mtime order, oldest first, with no hits
    /// (a container's entries take its mtime, in the order they were written): they were in the
    /// cache before the restart, so they had been admitted once, and in main a scan right after
    /// the restart (which goes through the small queue) cannot flush them. Main's first pass
    /// evicts them oldest written first, except those read since.
    pub fn open_with(dir: impl Into<PathBuf>, capacity_bytes: u64, options: NvmeOptions) -> Result<Self> {
        let dir = dir.into();
        let blocks_dir = dir.join(BLOCKS_DIR);
        let packs_dir = dir.join(pack::PACKS_DIR);
        let (index, corrupt) = recovery::recover(&dir, &blocks_dir, &packs_dir, capacity_bytes)?;
        Ok(Self {
            shared: Arc::new(Shared {
                dir,
                blocks_dir,
                packs_dir,
                capacity: capacity_bytes,
                options,
                index: Mutex::new(index),
                appender: Mutex::new(None),
                corrupt: AtomicU64::new(corrupt),
                settled: Notify::new(),
                pin_filter: OnceLock::new(),
                write_errors: WriteErrorCounts::default(),
            }),
        })
    }

    /// The file a block is (or would be) stored in when it is not packed. The path is a pure
    /// function of the key and the tier's directory; whether the file exists says nothing about
    /// the index.
    pub fn block_path(&self, key: &BlockKey) -> PathBuf {
        self.shared.block_path(key)
    }

    /// Where a ready block's data sits, for zero-copy serving (sendfile) and tests: `(path,
    /// data_offset, data_len)` — its own file, or its container. Counts as a hit. Nothing is
    /// verified here — the caller bypasses the checksums, and the file may be evicted (deleted)
    /// right after this returns, so it must treat a missing file or a short read as a miss.
    pub fn locate(&self, key: &BlockKey) -> Option<(PathBuf, u64, u64)> {
        let entry = self.shared.lock().touch(key)?;
        Some(match entry.packed {
            None => (self.block_path(key), header_len_for(key) as u64, entry.size),
            Some(at) => (
                pack::container_path(&self.shared.packs_dir, at.container),
                at.offset + pack::header_len_for(key) as u64,
                entry.size,
            ),
        })
    }

    /// Bytes of container files no ready entry uses (waiting for compaction), and how many
    /// container files there are.
    pub fn dead_bytes(&self) -> (u64, usize) {
        let index = self.shared.lock();
        (index.dead_bytes(), index.containers.len())
    }

    /// A put of one block, retried once after a full disk (see the module docs).
    async fn put_inner(&self, key: &BlockKey, data: Bytes, params: PutParams) -> Result<()> {
        let size = data.len() as u64;
        let capacity = self.shared.capacity;
        if capacity == 0 || size > capacity {
            return Err(TierError::TooLarge { size, capacity });
        }
        if header_len_for(key) > MAX_HEADER_LEN {
            // `open` would reject such a header, so never write one.
            return Err(TierError::Io(io::Error::new(
                io::ErrorKind::InvalidInput,
                "block key too long for the block header",
            )));
        }
        for attempt in 0..2 {
            let job = loop {
                // Registered before looking at the index, so a settle between the look and the
                // await still wakes us.
                let mut settled = pin!(self.shared.settled.notified());
                settled.as_mut().enable();
                match self.shared.begin_put(key, size) {
                    BeginPut::Present => return Ok(()),
                    BeginPut::Write(job) => break job,
                    BeginPut::Wait => settled.await,
                    BeginPut::Pinned(pinned) => return Err(TierError::Pinned { size, pinned, capacity }),
                    BeginPut::NoRoom(held) => return Err(TierError::DiskFull { size, held, quota: false }),
                }
            };
            let data = data.clone();
            let shared = Arc::clone(&self.shared);
            let write = move || {
                if params.packed { PutJob::run_packed(&shared, vec![(job, data)]) } else { job.run(data) }
            };
            match tokio::task::spawn_blocking(write).await.map_err(join_error)? {
                Err(TierError::DiskFull { quota, .. }) => {
                    let held = self.shared.disk_was_full();
                    tracing::warn!(block = %key, tier = "nvme", held_bytes = held, capacity_bytes = capacity, attempt,
                        "disk full: the tier now holds at most what it held");
                    if attempt == 1 {
                        return Err(TierError::DiskFull { size, held, quota });
                    }
                }
                done => return done,
            }
        }
        unreachable!("the second attempt returns")
    }
}

impl fmt::Debug for NvmeTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let usage = self.usage();
        f.debug_struct("NvmeTier")
            .field("dir", &self.shared.dir)
            .field("capacity_bytes", &usage.capacity_bytes)
            .field("used_bytes", &usage.used_bytes)
            .field("blocks", &usage.blocks)
            .finish()
    }
}

#[async_trait]
impl Tier for NvmeTier {
    fn kind(&self) -> TierKind {
        TierKind::Nvme
    }

    /// A ready block's file, opened, with where its data sits — for serving without copying it
    /// through user space (sendfile, a passed descriptor). Only blocks whose checksum was
    /// verified since the tier opened qualify (`None` otherwise: read it with `get`, which
    /// checks it and makes it qualify). Counts as a hit.
    ///
    /// The open descriptor keeps the data readable even if the block is evicted right after:
    /// block files are only ever replaced by rename or deleted, never rewritten in place. A
    /// packed entry never qualifies: its container holds other files (a passed descriptor
    /// would hand them out), and an evicted entry's pages are punched out of it, so every read
    /// of one goes through [`get`](Tier::get) and its checksum.
    ///
    /// Bit rot on the device after the check goes unnoticed until the worker restarts (which
    /// makes every block unverified again); that is the price of not reading every block
    /// through the CPU (`zero_copy = false` in the worker config turns it off).
    fn open_verified(&self, key: &BlockKey) -> Option<FileSpan> {
        let entry = {
            let mut index = self.shared.lock();
            // Only a block that qualifies counts as a hit here: the caller reads any other one
            // with `get` or `get_range`, which count it.
            match index.slots.get(key) {
                Some(Slot::Ready(ready)) if ready.verified && ready.packed.is_none() => index.touch(key)?,
                _ => return None,
            }
        };
        let file = fs::File::open(self.block_path(key)).ok()?;
        let offset = header_len_for(key) as u64;
        // A file of another length is not the one the index describes (either format).
        let on_disk = file.metadata().ok()?.len();
        let data_end = offset + entry.size;
        (on_disk == data_end || on_disk == data_end + trailer_len(entry.size) as u64).then_some(FileSpan {
            file,
            offset,
            len: entry.size,
        })
    }

    /// A verified block's range is read without a check (as `open_verified` serves it); an
    /// unverified one's is checked chunk by chunk, and does not make the block verified (only
    /// a whole read does). Packed entries, small, are read whole.
    async fn get_range(&self, key: &BlockKey, range: std::ops::Range<u64>) -> Result<Option<Bytes>> {
        let touched = {
            let mut index = self.shared.lock();
            match index.slots.get(key) {
                // `get` counts the hit of a packed entry, so it is not counted here as well.
                Some(Slot::Ready(ready)) if ready.packed.is_some() => None,
                _ => Some(index.touch(key)),
            }
        };
        let entry = match touched {
            Some(Some(entry)) => entry,
            Some(None) => return Ok(None),
            None => {
                return Ok(self.get(key).await?.map(|b| b.slice(range.start as usize..range.end as usize)));
            }
        };
        if range.end > entry.size || range.start > range.end {
            return Err(TierError::Io(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("range {range:?} is past the block's {} bytes", entry.size),
            )));
        }
        let shared = Arc::clone(&self.shared);
        let key = key.clone();
        let read = tokio::task::spawn_blocking(move || shared.read_range_checked(&key, entry, range));
        read.await.map_err(join_error)?.map_err(TierError::Io)
    }

    async fn get(&self, key: &BlockKey) -> Result<Option<Bytes>> {
        // A compaction may move the entry between the look-up and the read; the moved copy has
        // a new generation, so look again once rather than report a miss.
        for _ in 0..2 {
            let (entry, file) = {
                let mut index = self.shared.lock();
                let Some(entry) = index.touch(key) else {
                    return Ok(None);
                };
                let file = entry.packed.and_then(|at| index.container_file(at));
                (entry, file)
            };
            let shared = Arc::clone(&self.shared);
            let key_owned = key.clone();
            let read = tokio::task::spawn_blocking(move || shared.read_checked(&key_owned, entry, file));
            match read.await.map_err(join_error)?? {
                Some(data) => return Ok(Some(data)),
                None if entry.packed.is_some()
                    && self.shared.lock().ready_generation(key).is_some_and(|g| g != entry.generation) => {}
                None => return Ok(None),
            }
        }
        Ok(None)
    }

    async fn put(&self, key: &BlockKey, data: Bytes) -> Result<()> {
        self.put_inner(key, data, PutParams::default()).await
    }

    async fn put_with(&self, key: &BlockKey, data: Bytes, params: PutParams) -> Result<()> {
        self.put_inner(key, data, params).await
    }

    /// Packed blocks that can start at once are appended in one write; the others (not packed,
    /// waiting on a write of the same key, refused, or after a failed batch) go one by one.
    async fn put_many(&self, blocks: Vec<BlockPut>) -> Vec<Result<()>> {
        let capacity = self.shared.capacity;
        let mut results: Vec<Option<Result<()>>> = (0..blocks.len()).map(|_| None).collect();
        let mut batch: Vec<(usize, PutJob, Bytes)> = Vec::new();
        for (i, b) in blocks.iter().enumerate() {
            let size = b.data.len() as u64;
            if !b.params.packed || capacity == 0 || size > capacity || header_len_for(&b.key) > MAX_HEADER_LEN
            {
                continue;
            }
            match self.shared.begin_put(&b.key, size) {
                BeginPut::Present => results[i] = Some(Ok(())),
                BeginPut::Write(job) => batch.push((i, job, b.data.clone())),
                BeginPut::Pinned(pinned) => {
                    results[i] = Some(Err(TierError::Pinned { size, pinned, capacity }))
                }
                // Waiting here would hold the jobs already begun; these go one by one below.
                BeginPut::Wait | BeginPut::NoRoom(_) => {}
            }
        }
        if !batch.is_empty() {
            let (indexes, jobs): (Vec<usize>, Vec<(PutJob, Bytes)>) =
                batch.into_iter().map(|(i, job, data)| (i, (job, data))).unzip();
            let shared = Arc::clone(&self.shared);
            let written = tokio::task::spawn_blocking(move || PutJob::run_packed(&shared, jobs)).await;
            match written.map_err(join_error).and_then(|r| r) {
                Ok(()) => {
                    for i in indexes {
                        results[i] = Some(Ok(()));
                    }
                }
                Err(TierError::DiskFull { .. }) => {
                    let held = self.shared.disk_was_full();
                    tracing::warn!(
                        tier = "nvme",
                        held_bytes = held,
                        capacity_bytes = capacity,
                        blocks = indexes.len(),
                        "disk full: the tier now holds at most what it held; the batch's blocks are retried one by one"
                    );
                }
                Err(e) => {
                    tracing::debug!(tier = "nvme", err = %e, "packed batch failed; its blocks are retried one by one");
                }
            }
        }
        let mut out = Vec::with_capacity(blocks.len());
        for (b, result) in blocks.into_iter().zip(results) {
            out.push(match result {
                Some(r) => r,
                None => self.put_inner(&b.key, b.data, b.params).await,
            });
        }
        out
    }

    async fn compact(&self) -> Result<Compacted> {
        let shared = Arc::clone(&self.shared);
        Ok(tokio::task::spawn_blocking(move || shared.compact()).await.map_err(join_error)??)
    }

    async fn evict(&self, bytes: u64, among: Among<'_>) -> Result<Evicted> {
        let shared = &self.shared;
        let pinned = shared.pin_filter.get();
        let mut evicted = Evicted::default();
        let retired = {
            let mut index = shared.lock();
            let victims = index
                .policy
                .evict_among(bytes, |k| !among(k) || pinned.is_some_and(|is_pinned| is_pinned(k)));
            victims
                .into_iter()
                .filter_map(|victim| {
                    let ready = index.retire(&victim)?;
                    evicted.blocks += 1;
                    evicted.bytes += ready.size;
                    Some(Retired { key: victim, packed: ready.packed, size: ready.size })
                })
                .collect()
        };
        let deleting = Deleting { shared: Arc::clone(shared), retired };
        let deleted = tokio::task::spawn_blocking(move || deleting.delete_files());
        deleted.await.map_err(join_error)??;
        Ok(evicted)
    }

    async fn remove(&self, key: &BlockKey) -> Result<()> {
        let deleting = loop {
            let mut settled = pin!(self.shared.settled.notified());
            settled.as_mut().enable();
            match self.shared.begin_remove(key) {
                BeginRemove::Absent => return Ok(()),
                BeginRemove::Delete(deleting) => break deleting,
                BeginRemove::Wait => settled.await,
            }
        };
        let deleted = tokio::task::spawn_blocking(move || deleting.delete_files());
        Ok(deleted.await.map_err(join_error)??)
    }

    fn contains(&self, key: &BlockKey) -> bool {
        matches!(self.shared.lock().slots.get(key), Some(Slot::Ready(_)))
    }

    fn usage(&self) -> TierUsage {
        let index = self.shared.lock();
        TierUsage {
            capacity_bytes: self.shared.capacity,
            used_bytes: index.policy.used(),
            blocks: index.policy.len() as u64,
        }
    }

    fn keys(&self) -> Vec<(BlockKey, u64)> {
        let index = self.shared.lock();
        index
            .slots
            .iter()
            .filter_map(|(key, slot)| match slot {
                Slot::Ready(ready) => Some((key.clone(), ready.size)),
                Slot::Busy => None,
            })
            .collect()
    }

    fn drain_events(&self) -> Vec<TierEvent> {
        std::mem::take(&mut self.shared.lock().events)
    }

    fn set_pin_filter(&self, filter: PinFilter) -> bool {
        self.shared.pin_filter.set(filter).is_ok()
    }

    fn hits(&self, key: &BlockKey) -> u8 {
        self.shared.lock().policy.freq(key).unwrap_or(0)
    }

    fn corrupt_blocks(&self) -> u64 {
        self.shared.corrupt.load(Ordering::Relaxed)
    }

    fn disk_health(&self) -> DiskHealth {
        let limit = self.shared.lock().limit(self.shared.capacity, Instant::now());
        let errors = &self.shared.write_errors;
        DiskHealth {
            limit_bytes: (limit < self.shared.capacity).then_some(limit),
            no_space_errors: errors.no_space.load(Ordering::Relaxed),
            quota_errors: errors.quota.load(Ordering::Relaxed),
            io_errors: errors.io.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::fs::File;
    use std::path::Path;
    use std::time::{Duration, SystemTime};

    use proptest::prelude::*;

    use super::super::policy::reference::Reference;
    use super::recovery::Place;
    use super::testing::{
        HEADER_BYTE, block_files, container_entries, data_for, files_with_suffix, flip_byte, key, key_set,
        replay,
    };
    use super::*;

    #[tokio::test]
    async fn round_trip_including_empty_block() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        let big = data_for(1, 10_000);
        tier.put(&key(1), big.clone()).await.unwrap();
        tier.put(&key(2), Bytes::new()).await.unwrap();

        assert_eq!(tier.get(&key(1)).await.unwrap(), Some(big.clone()));
        assert_eq!(tier.get(&key(2)).await.unwrap(), Some(Bytes::new()));
        assert_eq!(tier.get(&key(3)).await.unwrap(), None);
        assert!(tier.contains(&key(1)) && tier.contains(&key(2)) && !tier.contains(&key(3)));
        assert_eq!(tier.usage(), TierUsage { capacity_bytes: 1 << 20, used_bytes: 10_000, blocks: 2 });
        assert_eq!(
            block_files(dir.path()),
            [tier.block_path(&key(1)), tier.block_path(&key(2))].into_iter().collect()
        );
        let path = tier.block_path(&key(1));
        let hex = format!("{:032x}", key(1).storage_id());
        assert_eq!(path, dir.path().join("blocks").join(&hex[..2]).join(format!("{hex}.blk")));

        // `locate` points at exactly the data bytes of the file.
        let (loc_path, offset, len) = tier.locate(&key(1)).unwrap();
        assert_eq!(loc_path, path);
        let file = fs::read(&path).unwrap();
        assert_eq!(
            file.len() as u64,
            offset + len + trailer_len(len) as u64,
            "header, data, chunk checksums"
        );
        assert_eq!(&file[offset as usize..(offset + len) as usize], &big[..]);
        assert_eq!(&file[..8], b"STRATABK");
        assert_eq!(tier.locate(&key(3)), None);

        let mut replayed = BTreeMap::new();
        replay(&mut replayed, tier.drain_events());
        assert_eq!(replayed, key_set(&tier));
        assert_eq!(tier.corrupt_blocks(), 0);
    }

    #[tokio::test]
    async fn eviction_deletes_the_evicted_files() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 300).unwrap();
        for i in 0..3 {
            tier.put(&key(i), data_for(i, 100)).await.unwrap();
        }
        assert_eq!(block_files(dir.path()).len(), 3);
        // A hit on 0 by a read and on 1 by a re-put, so 2 is the one evicted.
        assert!(tier.get(&key(0)).await.unwrap().is_some());
        tier.put(&key(1), data_for(1, 100)).await.unwrap();
        tier.put(&key(3), data_for(3, 100)).await.unwrap();
        assert_eq!(
            block_files(dir.path()),
            [0, 1, 3].into_iter().map(|i| tier.block_path(&key(i))).collect()
        );
        // 250 bytes need three evictions: 3 from the small queue, then 0 and 1 from main once
        // the pass that aged their hit comes round again.
        tier.put(&key(4), data_for(4, 250)).await.unwrap();
        assert_eq!(block_files(dir.path()), [tier.block_path(&key(4))].into_iter().collect());
        assert_eq!(tier.usage(), TierUsage { capacity_bytes: 300, used_bytes: 250, blocks: 1 });

        let mut replayed = BTreeMap::new();
        replay(&mut replayed, tier.drain_events());
        assert_eq!(replayed, key_set(&tier));
    }

    #[tokio::test]
    async fn pinned_files_are_passed_over_and_a_put_only_pins_could_serve_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 300).unwrap();
        let pinned = Arc::new(Mutex::new(std::collections::HashSet::new()));
        let set = pinned.clone();
        assert!(tier.set_pin_filter(Arc::new(move |k| set.lock().unwrap().contains(k))));
        for i in 0..3 {
            tier.put(&key(i), data_for(i, 100)).await.unwrap();
        }
        pinned.lock().unwrap().insert(key(0));
        tier.put(&key(3), data_for(3, 100)).await.unwrap();
        assert_eq!(
            block_files(dir.path()),
            [0, 2, 3].into_iter().map(|i| tier.block_path(&key(i))).collect()
        );
        pinned.lock().unwrap().extend([key(2), key(3)]);
        match tier.put(&key(4), data_for(4, 100)).await {
            Err(TierError::Pinned { size: 100, pinned: 300, capacity: 300 }) => {}
            other => panic!("expected Pinned, got {other:?}"),
        }
        assert_eq!(block_files(dir.path()).len(), 3, "nothing evicted for a refused put");
        pinned.lock().unwrap().remove(&key(3));
        tier.put(&key(4), data_for(4, 100)).await.unwrap();
        assert_eq!(
            block_files(dir.path()),
            [0, 2, 4].into_iter().map(|i| tier.block_path(&key(i))).collect()
        );
        let mut replayed = BTreeMap::new();
        replay(&mut replayed, tier.drain_events());
        assert_eq!(replayed, key_set(&tier));
    }

    #[tokio::test]
    async fn zero_capacity_and_too_large_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path().join("off"), 0).unwrap();
        match tier.put(&key(1), Bytes::new()).await {
            Err(TierError::TooLarge { size: 0, capacity: 0 }) => {}
            other => panic!("expected TooLarge, got {other:?}"),
        }
        assert_eq!(tier.get(&key(1)).await.unwrap(), None);
        assert!(block_files(&dir.path().join("off")).is_empty());

        let tier = NvmeTier::open(dir.path().join("small"), 100).unwrap();
        tier.put(&key(1), data_for(1, 60)).await.unwrap();
        match tier.put(&key(2), data_for(2, 101)).await {
            Err(TierError::TooLarge { size: 101, capacity: 100 }) => {}
            other => panic!("expected TooLarge, got {other:?}"),
        }
        assert!(tier.contains(&key(1)));
        assert_eq!(block_files(&dir.path().join("small")).len(), 1);
    }

    #[tokio::test]
    async fn reput_of_present_key_is_a_noop_refresh() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        tier.put(&key(1), data_for(1, 40)).await.unwrap();
        tier.drain_events();
        let mtime = fs::metadata(tier.block_path(&key(1))).unwrap().modified().unwrap();
        tier.put(&key(1), data_for(9, 40)).await.unwrap();
        assert!(tier.drain_events().is_empty());
        assert_eq!(tier.get(&key(1)).await.unwrap(), Some(data_for(1, 40)));
        assert_eq!(fs::metadata(tier.block_path(&key(1))).unwrap().modified().unwrap(), mtime);
    }

    #[tokio::test]
    async fn remove_deletes_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        tier.put(&key(1), data_for(1, 40)).await.unwrap();
        tier.drain_events();
        tier.remove(&key(1)).await.unwrap();
        tier.remove(&key(1)).await.unwrap();
        assert!(block_files(dir.path()).is_empty());
        assert_eq!(tier.drain_events(), vec![TierEvent::Removed { key: key(1) }]);
        assert_eq!(tier.usage().used_bytes, 0);
        assert_eq!(tier.get(&key(1)).await.unwrap(), None);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Put(u64),
        Get(u64),
        Remove(u64),
        CorruptData(u64),
        CorruptHeader(u64),
        Reopen,
        /// Which keys are pinned from now on (a bit per key).
        Pins(u8),
        Compact,
    }

    const KEYS: u64 = 6;

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0..KEYS).prop_map(Op::Put),
            4 => (0..KEYS).prop_map(Op::Get),
            1 => (0..KEYS).prop_map(Op::Remove),
            1 => (0..KEYS).prop_map(Op::CorruptData),
            1 => (0..KEYS).prop_map(Op::CorruptHeader),
            1 => Just(Op::Reopen),
            1 => any::<u8>().prop_map(|mask| Op::Pins(mask & (mask >> 2))),
            1 => Just(Op::Compact),
        ]
    }

    /// Reference model: the reference S3-FIFO over key indexes. Blocks are immutable per key,
    /// so a key always has the same size and bytes. A reopen recovers blocks in mtime order,
    /// which the test sets from the model's order (mtimes of real writes are too coarse to
    /// predict), so the model knows the recovered order too.
    struct Model {
        capacity: u64,
        sizes: Vec<u64>,
        /// Which keys are small files' blocks, packed in containers (a bit per key).
        packed: u8,
        policy: Reference<u64>,
        bad_data: BTreeSet<u64>,
        bad_header: BTreeSet<u64>,
        corrupt: u64,
    }

    impl Model {
        fn present(&self) -> Vec<u64> {
            self.policy.entries().into_iter().map(|(k, _)| k).collect()
        }

        fn forget(&mut self, k: u64) {
            self.policy.remove(&k);
            self.bad_data.remove(&k);
            self.bad_header.remove(&k);
        }

        fn is_bad(&self, k: u64) -> bool {
            self.bad_data.contains(&k) || self.bad_header.contains(&k)
        }

        fn is_packed(&self, k: u64) -> bool {
            self.packed & (1 << k) != 0
        }
    }
    fn check_state(
        tier: &NvmeTier,
        dir: &Path,
        model: &Model,
        replayed: &mut BTreeMap<BlockKey, u64>,
    ) -> std::result::Result<(), TestCaseError> {
        let expected: BTreeMap<BlockKey, u64> =
            model.present().into_iter().map(|k| (key(k), model.sizes[k as usize])).collect();
        prop_assert_eq!(&key_set(tier), &expected);
        prop_assert_eq!(
            tier.usage(),
            TierUsage {
                capacity_bytes: model.capacity,
                used_bytes: model.policy.used(),
                blocks: expected.len() as u64,
            }
        );
        prop_assert!(model.policy.used() <= model.capacity);
        prop_assert_eq!(tier.corrupt_blocks(), model.corrupt);
        replay(replayed, tier.drain_events());
        prop_assert_eq!(&*replayed, &expected);
        let on_disk: BTreeSet<PathBuf> =
            expected.keys().filter(|k| !model.is_packed(k.index)).map(|k| tier.block_path(k)).collect();
        prop_assert_eq!(block_files(dir), on_disk);
        let packed: BTreeMap<BlockKey, u64> =
            expected.iter().filter(|(k, _)| model.is_packed(k.index)).map(|(k, s)| (k.clone(), *s)).collect();
        // Entries with a flipped header byte fail the scan's check until they are read.
        if model.bad_header.iter().all(|k| !model.is_packed(*k)) {
            prop_assert_eq!(container_entries(dir), packed);
        }
        let index = tier.shared.lock();
        for (seq, c) in &index.containers {
            let (bytes, entries) = index
                .slots
                .iter()
                .filter_map(|(k, slot)| match slot {
                    Slot::Ready(r) if r.packed.is_some_and(|at| at.container == *seq) => {
                        Some(pack::entry_len(k, r.size))
                    }
                    _ => None,
                })
                .fold((0, 0), |(b, n), len| (b + len, n + 1));
            prop_assert_eq!((c.live_bytes, c.live_entries), (bytes, entries), "container {} counts", seq);
            prop_assert!(!c.sealed || entries > 0, "an empty sealed container was kept");
        }
        drop(index);
        prop_assert!(files_with_suffix(dir, ".tmp").is_empty());
        for k in model.present() {
            prop_assert_eq!(tier.hits(&key(k)), model.policy.freq(&k).unwrap());
        }
        Ok(())
    }

    /// `locate` without counting a hit (the model counts hits exactly).
    fn locate_quietly(tier: &NvmeTier, k: &BlockKey) -> (PathBuf, u64, u64) {
        let ready = match tier.shared.lock().slots.get(k) {
            Some(Slot::Ready(r)) => *r,
            _ => panic!("{k} is not ready"),
        };
        match ready.packed {
            None => (tier.block_path(k), header_len_for(k) as u64, ready.size),
            Some(at) => (
                pack::container_path(&tier.shared.packs_dir, at.container),
                at.offset + pack::header_len_for(k) as u64,
                ready.size,
            ),
        }
    }

    fn open_pinned(dir: &Path, capacity: u64, pins: &Arc<Mutex<u8>>) -> NvmeTier {
        // Containers of 100 bytes hold one to a few entries, so sealing, dead entries and
        // compaction all happen within a few operations.
        let tier = NvmeTier::open_with(dir, capacity, NvmeOptions { container_bytes: 100 }).unwrap();
        let pins = Arc::clone(pins);
        tier.set_pin_filter(Arc::new(move |k| *pins.lock().unwrap() & (1 << k.index) != 0));
        tier
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn behaves_like_the_reference_s3fifo_across_restarts(
            capacity in prop_oneof![Just(0u64), 1u64..200],
            sizes in proptest::collection::vec(0u64..64, KEYS as usize),
            packed in any::<u8>(),
            ops in proptest::collection::vec(op(), 1..50),
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let dir = tempfile::tempdir().unwrap();
            let pins = Arc::new(Mutex::new(0u8));
            let mut tier = open_pinned(dir.path(), capacity, &pins);
            let mut model = Model {
                capacity,
                sizes: sizes.clone(),
                packed,
                policy: Reference::new(capacity),
                bad_data: BTreeSet::new(),
                bad_header: BTreeSet::new(),
                corrupt: 0,
            };
            let mut replayed = BTreeMap::new();
            for op in ops {
                let mask = *pins.lock().unwrap();
                match op {
                    Op::Put(k) => {
                        let size = sizes[k as usize];
                        let params = PutParams { packed: model.is_packed(k) };
                        let res = rt.block_on(tier.put_with(&key(k), data_for(k, size as usize), params));
                        if capacity == 0 || size > capacity {
                            let refused_too_large = matches!(res, Err(TierError::TooLarge { .. }));
                            prop_assert!(refused_too_large, "expected TooLarge, got {:?}", res);
                        } else if model.policy.contains(&k) {
                            prop_assert!(res.is_ok(), "put failed: {:?}", res);
                            model.policy.touch(&k);
                        } else {
                            match model.policy.victims(size, |x| mask & (1 << x) != 0) {
                                Ok(victims) => {
                                    prop_assert!(res.is_ok(), "put failed: {:?}", res);
                                    // Evicted in the model's order, then the block is added.
                                    let mut expected: Vec<TierEvent> =
                                        victims.iter().map(|&v| TierEvent::Removed { key: key(v) }).collect();
                                    expected.push(TierEvent::Added { key: key(k), size });
                                    let events = tier.drain_events();
                                    prop_assert_eq!(&events, &expected);
                                    replay(&mut replayed, events);
                                    for v in victims {
                                        model.forget(v);
                                    }
                                    model.policy.insert(k, size);
                                }
                                Err(pinned) => {
                                    let refused = matches!(res, Err(TierError::Pinned { pinned: p, .. }) if p == pinned);
                                    prop_assert!(refused, "expected Pinned of {}, got {:?}", pinned, res);
                                }
                            }
                        }
                    }
                    Op::Get(k) => {
                        let got = rt.block_on(tier.get(&key(k))).unwrap();
                        if !model.policy.contains(&k) {
                            prop_assert_eq!(got, None);
                        } else if model.is_bad(k) {
                            prop_assert_eq!(got, None);
                            prop_assert!(!tier.block_path(&key(k)).exists());
                            prop_assert!(!tier.contains(&key(k)));
                            model.forget(k);
                            model.corrupt += 1;
                        } else {
                            prop_assert_eq!(got, Some(data_for(k, sizes[k as usize] as usize)));
                            model.policy.touch(&k);
                        }
                    }
                    Op::Remove(k) => {
                        rt.block_on(tier.remove(&key(k))).unwrap();
                        model.forget(k);
                    }
                    Op::CorruptData(k) => {
                        if model.policy.contains(&k) && !model.is_bad(k) && sizes[k as usize] > 0 {
                            let (path, offset, len) = locate_quietly(&tier, &key(k));
                            flip_byte(&path, (offset + len) as usize - 1);
                            model.bad_data.insert(k);
                        }
                    }
                    Op::CorruptHeader(k) => {
                        // Two bad headers side by side in a container would cut what follows
                        // them (recovery skips one bad entry only when the next checks out).
                        let another_packed_bad = model.bad_header.iter().any(|b| model.is_packed(*b));
                        if model.policy.contains(&k) && !model.is_bad(k) && !(model.is_packed(k) && another_packed_bad) {
                            let (path, offset, _) = locate_quietly(&tier, &key(k));
                            let start = offset as usize - header_len_for(&key(k));
                            flip_byte(&path, start + HEADER_BYTE);
                            model.bad_header.insert(k);
                        }
                    }
                    Op::Reopen => {
                        // Recovery order is mtime order: block files get the model's order; a
                        // container's entries take its mtime, in offset order.
                        let present = model.present();
                        let base = SystemTime::now() - Duration::from_secs(10_000);
                        let mut order = Vec::new();
                        for (i, &k) in present.iter().enumerate() {
                            let ready = match tier.shared.lock().slots.get(&key(k)) {
                                Some(Slot::Ready(r)) => *r,
                                _ => unreachable!("present in the model, so ready"),
                            };
                            match ready.packed {
                                None => {
                                    let path = tier.block_path(&key(k));
                                    let mtime = base + Duration::from_secs(i as u64);
                                    File::options().write(true).open(&path).unwrap().set_modified(mtime).unwrap();
                                    order.push(((mtime, Place::File(path)), k));
                                }
                                Some(at) => {
                                    let path = pack::container_path(&dir.path().join(pack::PACKS_DIR), at.container);
                                    let mtime = fs::metadata(&path).unwrap().modified().unwrap();
                                    order.push(((mtime, Place::Packed(at.container, at.offset)), k));
                                }
                            }
                        }
                        order.sort();
                        let present: Vec<u64> = order.into_iter().map(|(_, k)| k).collect();
                        drop(tier);
                        tier = open_pinned(dir.path(), capacity, &pins);
                        // Headers are checked on open, data only on read; the counter
                        // restarts with the process.
                        let dropped = std::mem::take(&mut model.bad_header);
                        model.corrupt = dropped.len() as u64;
                        model.policy = Reference::new(capacity);
                        for k in present.into_iter().filter(|k| !dropped.contains(k)) {
                            model.policy.insert_main(k, sizes[k as usize]);
                        }
                        replayed.clear();
                    }
                    Op::Pins(mask) => *pins.lock().unwrap() = mask,
                    Op::Compact => {
                        // Moves entries between containers: no key, size, order or event
                        // changes — except that a moved entry's data is checked, so a corrupt
                        // one it came across is dropped as a read would drop it.
                        rt.block_on(tier.compact()).unwrap();
                        for k in model.bad_data.clone() {
                            if model.is_packed(k) && !tier.contains(&key(k)) {
                                model.forget(k);
                                model.corrupt += 1;
                            }
                        }
                    }
                }
                check_state(&tier, dir.path(), &model, &mut replayed)?;
            }
        }
    }
}
