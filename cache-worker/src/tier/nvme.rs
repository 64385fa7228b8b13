//! NVMe tier: one file per block under `<dir>/blocks/<2 hex>/<32 hex>.blk`, where the hex is the
//! block key's 128-bit [`storage_id`](BlockKey::storage_id) and the 2-hex shard keeps
//! directories small.
//!
//! # On-disk format (little endian)
//!
//! ```text
//! magic b"STRATABK" (8) | version u32 = 1 | header_len u32 | data_len u64 | data_crc32c u32
//! | BlockKey::encode() | header_crc32c u32 (of every preceding header byte) | data
//! ```
//!
//! The full key is in the header because the file name is only a hash: a read checks that the
//! file holds the block that was asked for. `header_len` lets [`NvmeTier::open`] read just the
//! header of each file, so a restart costs one small read per block, not a read of the cache.
//!
//! # Invariants
//!
//! - A file under its real name is always complete: `put` writes `<name>.blk.tmp` and renames it,
//!   and `open` deletes leftover `*.tmp` files. There is no fsync per block: a process restart
//!   keeps the page cache, so the renamed file is intact; after a power loss a torn or stale file
//!   fails its header or data checksum and is dropped as corrupt, which for a cache only costs a
//!   refetch. An fsync per block would put a device flush on every cache fill.
//! - At most one operation touches a key's file at a time. Writing and deleting first turn the
//!   key's index slot `Busy`; a busy key is invisible to `get`/`contains`/`keys`, and `put` and
//!   `remove` of it wait until it settles. `get` only reads, and a `Ready` entry's file changes
//!   only after the entry left `Ready`, so a get that races with eviction reads either the whole
//!   old file (an unlinked file stays readable through an open handle) or nothing (a miss).
//! - Index entries carry a generation; a get that finds a file missing or corrupt only drops the
//!   entry if it still has the generation it read, so it never drops a newer copy of the block.
//! - `policy` ([`S3Fifo`]) holds exactly the ready blocks with their data lengths, so
//!   `policy.used()` is the sum of those; `reserved` is the data lengths of puts in flight, and
//!   `policy.used() + reserved <= capacity`. Headers are not counted: they are tens of bytes
//!   against blocks of megabytes. `TierUsage::used_bytes` reports `policy.used()`.
//! - Replaying the events yields the ready key set: `Added` when a block becomes ready (including
//!   blocks found by `open`), `Removed` when a ready block is evicted, removed, dropped as corrupt
//!   or found missing.
//! - A full disk (ENOSPC, or EDQUOT on a quota) lowers the tier's limit to what it holds when
//!   the write fails, so eviction makes room below what the disk really takes; the put is
//!   retried once after that eviction. The limit goes back to the configured capacity
//!   [`FULL_RETRY`] after the last such failure (another tenant may have freed space), and one
//!   failed write then finds out whether it is still full. Every failed write is counted by
//!   reason ([`DiskHealth`]).
//! - The index mutex is never held across an `.await` or file I/O. Bookkeeping that must follow
//!   file I/O of a put or delete lives in drop guards moved into the blocking task, so a cancelled
//!   caller cannot leave a key busy or space reserved forever.

use std::collections::HashMap;
use std::fmt;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;
use strata_common::BlockKey;
use tokio::sync::Notify;

use super::{
    Among, DiskHealth, Evicted, PinFilter, Result, S3Fifo, Tier, TierError, TierEvent, TierKind, TierUsage,
};
use crate::metrics_defs as m;

const MAGIC: &[u8; 8] = b"STRATABK";
const FORMAT_VERSION: u32 = 1;
/// magic, version, header_len, data_len, data_crc.
const FIXED_LEN: usize = 8 + 4 + 4 + 8 + 4;
const HEADER_CRC_LEN: usize = 4;
/// The smallest key encoding: two empty strings and an index.
const MIN_KEY_LEN: usize = 4 + 4 + 8;
/// Bounds what `open` will allocate for a header found on disk; real keys are far smaller.
const MAX_HEADER_LEN: usize = 1 << 20;
const BLOCKS_DIR: &str = "blocks";
const BLOCK_EXT: &str = "blk";
const TMP_SUFFIX: &str = ".tmp";
/// How long a limit lowered by a full disk holds before the configured capacity is tried again.
pub const FULL_RETRY: Duration = Duration::from_secs(60);

/// The NVMe tier. See the module docs for the file format and invariants.
pub struct NvmeTier {
    shared: Arc<Shared>,
}

struct Shared {
    dir: PathBuf,
    blocks_dir: PathBuf,
    capacity: u64,
    index: Mutex<Index>,
    corrupt: AtomicU64,
    /// Woken whenever a busy slot settles or reserved space is released.
    settled: Notify,
    pin_filter: OnceLock<PinFilter>,
    write_errors: WriteErrorCounts,
}

#[derive(Default)]
struct WriteErrorCounts {
    no_space: AtomicU64,
    quota: AtomicU64,
    io: AtomicU64,
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

#[derive(Debug, Clone, Copy)]
struct Ready {
    size: u64,
    generation: u64,
    /// The file's data is known to match its checksum: this process wrote it from memory, or
    /// read and checked it since the tier opened. Only such blocks are served without a check
    /// ([`NvmeTier::open_verified`]).
    verified: bool,
}

#[derive(Debug, Clone, Copy)]
enum Slot {
    Ready(Ready),
    /// A write or a delete of the key's file is in flight.
    Busy,
}

struct Index {
    slots: HashMap<BlockKey, Slot>,
    /// The ready blocks' eviction order.
    policy: S3Fifo<BlockKey>,
    next_generation: u64,
    reserved: u64,
    events: Vec<TierEvent>,
    /// The limit a full disk set (below the capacity), and when the disk was last found full.
    full: Option<(u64, Instant)>,
}

impl Index {
    fn new(capacity: u64) -> Self {
        Self {
            slots: HashMap::new(),
            policy: S3Fifo::new(capacity),
            next_generation: 0,
            reserved: 0,
            events: Vec::new(),
            full: None,
        }
    }

    /// The most bytes the tier may hold now: the capacity, or less while the disk is full.
    fn limit(&mut self, capacity: u64, now: Instant) -> u64 {
        match self.full {
            Some((limit, at)) if now.duration_since(at) < FULL_RETRY => limit.min(capacity),
            Some(_) => {
                self.full = None;
                capacity
            }
            None => capacity,
        }
    }

    /// Counts a hit on a ready block.
    fn touch(&mut self, key: &BlockKey) -> Option<Ready> {
        let Some(Slot::Ready(ready)) = self.slots.get(key) else {
            return None;
        };
        self.policy.touch(key);
        Some(*ready)
    }

    fn insert_ready(&mut self, key: BlockKey, size: u64, verified: bool) {
        self.policy.insert(key.clone(), size);
        self.publish(key, size, verified);
    }

    /// A block found by `open`: it was kept before the restart, so it starts in the policy's
    /// main queue (see [`NvmeTier::open`]).
    fn insert_recovered(&mut self, key: BlockKey, size: u64) {
        self.policy.insert_main(key.clone(), size);
        self.publish(key, size, false);
    }

    fn publish(&mut self, key: BlockKey, size: u64, verified: bool) {
        let ready = Ready { size, generation: self.next_generation, verified };
        self.next_generation += 1;
        self.events.push(TierEvent::Added { key: key.clone(), size });
        self.slots.insert(key, Slot::Ready(ready));
    }

    /// Takes a ready block out of service, leaving its slot `Busy` for the caller to delete the
    /// file and then [`clear_busy`](Self::clear_busy).
    fn retire(&mut self, key: &BlockKey) -> Option<Ready> {
        let slot = self.slots.get_mut(key)?;
        let Slot::Ready(ready) = *slot else {
            return None;
        };
        *slot = Slot::Busy;
        // A no-op for an eviction: `victims` already took the key out of the policy.
        self.policy.remove(key);
        self.events.push(TierEvent::Removed { key: key.clone() });
        Some(ready)
    }

    fn clear_busy(&mut self, key: &BlockKey) {
        if matches!(self.slots.get(key), Some(Slot::Busy)) {
            self.slots.remove(key);
        }
    }

    fn ready_generation(&self, key: &BlockKey) -> Option<u64> {
        match self.slots.get(key) {
            Some(Slot::Ready(ready)) => Some(ready.generation),
            _ => None,
        }
    }
}

/// The file name of a key, relative to the blocks directory.
fn block_path_in(blocks_dir: &Path, key: &BlockKey) -> PathBuf {
    let hex = format!("{:032x}", key.storage_id());
    blocks_dir.join(&hex[..2]).join(format!("{hex}.{BLOCK_EXT}"))
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(TMP_SUFFIX);
    PathBuf::from(name)
}

fn header_len_for(key: &BlockKey) -> usize {
    FIXED_LEN + key.encode().len() + HEADER_CRC_LEN
}

fn encode_header(key: &BlockKey, data: &[u8]) -> Vec<u8> {
    let key_enc = key.encode();
    let header_len = FIXED_LEN + key_enc.len() + HEADER_CRC_LEN;
    let mut header = Vec::with_capacity(header_len);
    header.extend_from_slice(MAGIC);
    header.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    header.extend_from_slice(&(header_len as u32).to_le_bytes());
    header.extend_from_slice(&(data.len() as u64).to_le_bytes());
    header.extend_from_slice(&crc32c::crc32c(data).to_le_bytes());
    header.extend_from_slice(&key_enc);
    let crc = crc32c::crc32c(&header);
    header.extend_from_slice(&crc.to_le_bytes());
    header
}

fn le_u32(buf: &[u8], at: usize) -> u32 {
    let mut raw = [0u8; 4];
    raw.copy_from_slice(&buf[at..at + 4]);
    u32::from_le_bytes(raw)
}

fn le_u64(buf: &[u8], at: usize) -> u64 {
    let mut raw = [0u8; 8];
    raw.copy_from_slice(&buf[at..at + 8]);
    u64::from_le_bytes(raw)
}

/// Why a block file was rejected; logged as the `reason` field.
type Malformed = &'static str;

/// Validates the fixed prefix (at least `FIXED_LEN` bytes) and returns the full header length.
fn header_len_of(prefix: &[u8]) -> std::result::Result<usize, Malformed> {
    if prefix.len() < FIXED_LEN {
        return Err("truncated header");
    }
    if &prefix[..MAGIC.len()] != MAGIC {
        return Err("bad magic");
    }
    if le_u32(prefix, 8) != FORMAT_VERSION {
        return Err("unsupported format version");
    }
    let header_len = le_u32(prefix, 12) as usize;
    if !(FIXED_LEN + MIN_KEY_LEN + HEADER_CRC_LEN..=MAX_HEADER_LEN).contains(&header_len) {
        return Err("bad header length");
    }
    Ok(header_len)
}

struct Header {
    header_len: usize,
    data_len: u64,
    data_crc: u32,
    key: BlockKey,
}

/// Parses and checksums the header at the start of `buf`.
fn parse_header(buf: &[u8]) -> std::result::Result<Header, Malformed> {
    let header_len = header_len_of(buf)?;
    let header = buf.get(..header_len).ok_or("truncated header")?;
    let (body, crc) = header.split_at(header_len - HEADER_CRC_LEN);
    if crc32c::crc32c(body) != le_u32(crc, 0) {
        return Err("header checksum mismatch");
    }
    let key_enc = &body[FIXED_LEN..];
    match BlockKey::decode(key_enc) {
        Some((key, used)) if used == key_enc.len() => {
            Ok(Header { header_len, data_len: le_u64(body, 16), data_crc: le_u32(body, 24), key })
        }
        _ => Err("malformed key"),
    }
}

enum ReadOutcome {
    Hit(Bytes),
    Missing,
    Corrupt(Malformed),
}

/// Reads and fully validates one block file.
fn read_block(path: &Path, key: &BlockKey) -> io::Result<ReadOutcome> {
    let buf = match fs::read(path) {
        Ok(buf) => buf,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(ReadOutcome::Missing),
        Err(e) => return Err(e),
    };
    let header = match parse_header(&buf) {
        Ok(header) => header,
        Err(reason) => return Ok(ReadOutcome::Corrupt(reason)),
    };
    if header.key != *key {
        return Ok(ReadOutcome::Corrupt("key mismatch"));
    }
    if (buf.len() - header.header_len) as u64 != header.data_len {
        return Ok(ReadOutcome::Corrupt("length mismatch"));
    }
    // Slicing the buffer hands out the data without copying it past the header.
    let data = Bytes::from(buf).slice(header.header_len..);
    if crc32c::crc32c(&data) != header.data_crc {
        return Ok(ReadOutcome::Corrupt("data checksum mismatch"));
    }
    Ok(ReadOutcome::Hit(data))
}

/// Reads only the header of a block file found by `open`.
fn scan_block(path: &Path) -> io::Result<std::result::Result<(BlockKey, u64, SystemTime), Malformed>> {
    let mut file = File::open(path)?;
    let meta = file.metadata()?;
    let mut buf = vec![0u8; FIXED_LEN];
    if meta.len() < FIXED_LEN as u64 {
        return Ok(Err("truncated header"));
    }
    file.read_exact(&mut buf)?;
    let header_len = match header_len_of(&buf) {
        Ok(len) => len,
        Err(reason) => return Ok(Err(reason)),
    };
    if header_len as u64 > meta.len() {
        return Ok(Err("truncated header"));
    }
    buf.resize(header_len, 0);
    file.read_exact(&mut buf[FIXED_LEN..])?;
    let header = match parse_header(&buf) {
        Ok(header) => header,
        Err(reason) => return Ok(Err(reason)),
    };
    if header.header_len as u64 + header.data_len != meta.len() {
        return Ok(Err("length mismatch"));
    }
    // Without an mtime the block just counts as oldest, which only matters for eviction order.
    let mtime = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
    Ok(Ok((header.key, header.data_len, mtime)))
}

fn write_block_file(tmp: &Path, header: &[u8], data: &[u8]) -> io::Result<()> {
    let mut file = match File::create(tmp) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            // Shard directories are created on first use (or were removed behind our back).
            if let Some(parent) = tmp.parent() {
                fs::create_dir_all(parent)?;
            }
            File::create(tmp)?
        }
        Err(e) => return Err(e),
    };
    file.write_all(header)?;
    file.write_all(data)
}

/// Deletes a file whose absence is what we want anyway; failures are logged, not returned.
fn remove_quietly(path: &Path, what: &'static str) {
    if let Err(e) = fs::remove_file(path)
        && e.kind() != io::ErrorKind::NotFound
    {
        tracing::warn!(path = %path.display(), tier = "nvme", error = %e, what, "could not delete file");
    }
}

fn join_error(e: tokio::task::JoinError) -> TierError {
    TierError::Io(io::Error::other(e))
}

/// A put in flight: the key is `Busy` and its size reserved until this is dropped, which
/// publishes the block if it was stored.
struct PendingWrite {
    shared: Arc<Shared>,
    key: BlockKey,
    size: u64,
    stored: bool,
}

impl Drop for PendingWrite {
    fn drop(&mut self) {
        let mut index = self.shared.lock();
        index.reserved -= self.size;
        index.clear_busy(&self.key);
        if self.stored {
            index.insert_ready(self.key.clone(), self.size, true);
        }
        drop(index);
        self.shared.settled.notify_waiters();
    }
}

/// Retired keys whose files are to be deleted; their `Busy` slots clear when this is dropped.
struct Deleting {
    shared: Arc<Shared>,
    keys: Vec<BlockKey>,
}

impl Deleting {
    /// Deletes every file, returning the first error other than "already gone".
    fn delete_files(&self) -> io::Result<()> {
        let mut first_err = None;
        for key in &self.keys {
            match fs::remove_file(self.shared.block_path(key)) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(block = %key, tier = "nvme", error = %e, "could not delete block file");
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl Drop for Deleting {
    fn drop(&mut self) {
        if self.keys.is_empty() {
            return;
        }
        let mut index = self.shared.lock();
        for key in &self.keys {
            index.clear_busy(key);
        }
        drop(index);
        self.shared.settled.notify_waiters();
    }
}

struct PutJob {
    pending: PendingWrite,
    victims: Deleting,
}

impl PutJob {
    /// Blocking: evicts, then writes and publishes the block.
    fn run(self, data: Bytes) -> Result<()> {
        let PutJob { mut pending, victims } = self;
        for key in &victims.keys {
            tracing::debug!(block = %key, tier = "nvme", "evicted");
        }
        // An eviction that fails to delete leaves an orphan file the index no longer counts;
        // the new block is still worth writing, and `open` re-indexes the orphan later.
        let _ = victims.delete_files();
        drop(victims);

        let path = pending.shared.block_path(&pending.key);
        let tmp = tmp_path(&path);
        let header = encode_header(&pending.key, &data);
        match write_block_file(&tmp, &header, &data).and_then(|()| fs::rename(&tmp, &path)) {
            Ok(()) => {
                pending.stored = true;
                Ok(())
            }
            Err(e) => {
                remove_quietly(&tmp, "temporary block file");
                let failure = WriteFailure::of(&e);
                pending.shared.count_write_error(failure);
                tracing::warn!(block = %pending.key, tier = "nvme", error = %e, reason = failure.label(), "block write failed");
                if failure.disk_full() {
                    return Err(TierError::DiskFull {
                        size: pending.size,
                        held: 0,
                        quota: failure == WriteFailure::Quota,
                    });
                }
                Err(e.into())
            }
        }
        // `pending` drops here, before the caller sees the result, so a successful put is
        // visible in the index by the time it returns.
    }
}

enum BeginPut {
    Present,
    Wait,
    Write(PutJob),
    /// Only pinned blocks (of these many bytes) could make room.
    Pinned(u64),
    /// The disk is full: the tier holds at most these many bytes for now, less than the block.
    NoRoom(u64),
}

enum BeginRemove {
    Absent,
    Wait,
    Delete(Deleting),
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

    fn count_write_error(&self, failure: WriteFailure) {
        let counter = match failure {
            WriteFailure::NoSpace => &self.write_errors.no_space,
            WriteFailure::Quota => &self.write_errors.quota,
            WriteFailure::Io => &self.write_errors.io,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(m::NVME_WRITE_ERRORS, "reason" => failure.label()).increment(1);
    }

    /// The disk refused a write for want of space: from now on (for [`FULL_RETRY`]) the tier
    /// holds no more than it does now, so the next put evicts to make room. Returns that limit.
    fn disk_was_full(&self) -> u64 {
        let mut index = self.lock();
        let held = index.policy.used() + index.reserved;
        let limit = index.full.map_or(held, |(limit, _)| limit.min(held));
        index.full = Some((limit, Instant::now()));
        limit
    }

    fn begin_put(self: &Arc<Self>, key: &BlockKey, size: u64) -> BeginPut {
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
            Err(pinned_bytes) => return BeginPut::Pinned(pinned_bytes),
        };
        for victim in &victims {
            index.retire(victim);
        }
        index.slots.insert(key.clone(), Slot::Busy);
        index.reserved += size;
        drop(index);
        BeginPut::Write(PutJob {
            pending: PendingWrite { shared: Arc::clone(self), key: key.clone(), size, stored: false },
            victims: Deleting { shared: Arc::clone(self), keys: victims },
        })
    }

    fn begin_remove(self: &Arc<Self>, key: &BlockKey) -> BeginRemove {
        let mut index = self.lock();
        match index.slots.get(key) {
            None => BeginRemove::Absent,
            Some(Slot::Busy) => BeginRemove::Wait,
            Some(Slot::Ready(_)) => {
                index.retire(key);
                drop(index);
                BeginRemove::Delete(Deleting { shared: Arc::clone(self), keys: vec![key.clone()] })
            }
        }
    }

    /// Blocking: reads the block of a ready entry, dropping it if it is missing or corrupt.
    fn read_checked(&self, key: &BlockKey, entry: Ready) -> io::Result<Option<Bytes>> {
        let path = self.block_path(key);
        match read_block(&path, key)? {
            ReadOutcome::Hit(data) if data.len() as u64 == entry.size => {
                if !entry.verified
                    && let Some(Slot::Ready(ready)) = self.lock().slots.get_mut(key)
                    && ready.generation == entry.generation
                {
                    ready.verified = true;
                }
                Ok(Some(data))
            }
            // A valid file of another length means the file was replaced behind our back; the
            // index's accounting would be wrong, so treat it like any other bad file.
            ReadOutcome::Hit(_) => {
                self.drop_corrupt(key, entry.generation, &path, "length differs from index");
                Ok(None)
            }
            ReadOutcome::Corrupt(reason) => {
                self.drop_corrupt(key, entry.generation, &path, reason);
                Ok(None)
            }
            ReadOutcome::Missing => {
                let mut index = self.lock();
                if index.ready_generation(key) == Some(entry.generation) {
                    index.retire(key);
                    index.clear_busy(key);
                    tracing::debug!(block = %key, tier = "nvme", "block file vanished; dropped from index");
                }
                Ok(None)
            }
        }
    }

    fn drop_corrupt(&self, key: &BlockKey, generation: u64, path: &Path, reason: Malformed) {
        {
            let mut index = self.lock();
            // Another generation means the entry was evicted and rewritten while we read: what
            // we read may be the old file, and the new one is not ours to delete.
            if index.ready_generation(key) != Some(generation) {
                return;
            }
            index.retire(key);
        }
        self.corrupt.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(block = %key, tier = "nvme", reason, "corrupt block dropped");
        remove_quietly(path, "corrupt block file");
        self.lock().clear_busy(key);
        self.settled.notify_waiters();
    }
}

impl NvmeTier {
    /// Opens (creating if needed) a tier in `dir` and rebuilds its index from the block files'
    /// headers.
    ///
    /// This is a synchronous function doing blocking I/O, meant for worker startup (call it from
    /// `spawn_blocking` if a runtime is already serving requests). Leftover `*.tmp` files are
    /// deleted; files whose header is malformed, whose length disagrees with the header, or
    /// that sit under the wrong name are deleted and counted in
    /// [`corrupt_blocks`](Tier::corrupt_blocks). If the blocks found exceed `capacity_bytes`,
    /// the oldest by mtime are deleted until they fit. Every block kept is reported as an
    /// `Added` event.
    ///
    /// The blocks kept enter the S3-FIFO main queue in mtime order, oldest first, with no hits:
    /// they were in the cache before the restart, so they had been admitted once, and in main
    /// a scan right after the restart (which goes through the small queue) cannot flush them.
    /// Main's first pass evicts them oldest written first, except those read since.
    pub fn open(dir: impl Into<PathBuf>, capacity_bytes: u64) -> Result<Self> {
        let dir = dir.into();
        let blocks_dir = dir.join(BLOCKS_DIR);
        fs::create_dir_all(&blocks_dir)?;

        let mut found = Vec::new();
        let mut corrupt = 0u64;
        for shard in fs::read_dir(&blocks_dir)? {
            let shard = shard?;
            if !shard.file_type()?.is_dir() {
                continue;
            }
            for entry in fs::read_dir(shard.path())? {
                let entry = entry?;
                let path = entry.path();
                let name = entry.file_name();
                let Some(name) = name.to_str() else { continue };
                if name.ends_with(TMP_SUFFIX) {
                    remove_quietly(&path, "temporary block file");
                    continue;
                }
                if !name.ends_with(&format!(".{BLOCK_EXT}")) {
                    continue;
                }
                let reason = match scan_block(&path) {
                    Ok(Ok((key, size, mtime))) if block_path_in(&blocks_dir, &key) == path => {
                        found.push((mtime, path, key, size));
                        continue;
                    }
                    Ok(Ok(_)) => "file name does not match key",
                    Ok(Err(reason)) => reason,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                    Err(e) => {
                        tracing::warn!(path = %path.display(), tier = "nvme", error = %e, "unreadable block file");
                        "unreadable"
                    }
                };
                tracing::warn!(path = %path.display(), tier = "nvme", reason, "corrupt block dropped");
                remove_quietly(&path, "corrupt block file");
                corrupt += 1;
            }
        }

        // Oldest first: over capacity the oldest go, and main is filled in this order so its
        // first pass evicts the least recently written first.
        found.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        let mut total: u64 = found.iter().map(|f| f.3).sum();
        let mut evicted = 0u64;
        let mut index = Index::new(capacity_bytes);
        for (_, path, key, size) in found {
            if total > capacity_bytes {
                remove_quietly(&path, "block file over capacity");
                total -= size;
                evicted += 1;
                continue;
            }
            index.insert_recovered(key, size);
        }
        tracing::info!(
            dir = %dir.display(),
            tier = "nvme",
            blocks = index.policy.len(),
            used_bytes = index.policy.used(),
            capacity_bytes,
            corrupt,
            evicted,
            "nvme tier opened"
        );
        Ok(Self {
            shared: Arc::new(Shared {
                dir,
                blocks_dir,
                capacity: capacity_bytes,
                index: Mutex::new(index),
                corrupt: AtomicU64::new(corrupt),
                settled: Notify::new(),
                pin_filter: OnceLock::new(),
                write_errors: WriteErrorCounts::default(),
            }),
        })
    }

    /// The file a block is (or would be) stored in. The path is a pure function of the key and
    /// the tier's directory; whether the file exists says nothing about the index.
    pub fn block_path(&self, key: &BlockKey) -> PathBuf {
        self.shared.block_path(key)
    }

    /// Where a ready block's data sits, for zero-copy serving (sendfile): `(path, data_offset,
    /// data_len)`. Counts as a hit. Nothing is verified here — the caller bypasses the
    /// checksums, and the file may be evicted (deleted) right after this returns, so it must
    /// treat a missing file or a short read as a miss.
    pub fn locate(&self, key: &BlockKey) -> Option<(PathBuf, u64, u64)> {
        let entry = self.shared.lock().touch(key)?;
        Some((self.block_path(key), header_len_for(key) as u64, entry.size))
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

    /// A ready block's file, opened, with the offset and length of its data — for serving
    /// without copying it through user space (sendfile, a passed descriptor). Only blocks whose
    /// checksum was verified since the tier opened qualify (`None` otherwise: read it with
    /// `get`, which checks it and makes it qualify). Counts as a hit.
    ///
    /// The open descriptor keeps the data readable even if the block is evicted right after:
    /// files are only ever replaced by rename or deleted, never rewritten in place.
    ///
    /// Bit rot on the device after the check goes unnoticed until the worker restarts (which
    /// makes every block unverified again); that is the price of not reading every block
    /// through the CPU (`zero_copy = false` in the worker config turns it off).
    fn open_verified(&self, key: &BlockKey) -> Option<(fs::File, u64, u64)> {
        let entry = self.shared.lock().touch(key)?;
        if !entry.verified {
            return None;
        }
        let file = fs::File::open(self.block_path(key)).ok()?;
        let offset = header_len_for(key) as u64;
        // A file of another length is not the one the index describes.
        let on_disk = file.metadata().ok()?.len();
        (on_disk == offset + entry.size).then_some((file, offset, entry.size))
    }

    async fn get(&self, key: &BlockKey) -> Result<Option<Bytes>> {
        let Some(entry) = self.shared.lock().touch(key) else {
            return Ok(None);
        };
        let shared = Arc::clone(&self.shared);
        let key = key.clone();
        let read = tokio::task::spawn_blocking(move || shared.read_checked(&key, entry));
        Ok(read.await.map_err(join_error)??)
    }

    async fn put(&self, key: &BlockKey, data: Bytes) -> Result<()> {
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
        // A full disk: evict down to what it holds and try once more (see the module docs).
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
            match tokio::task::spawn_blocking(move || job.run(data)).await.map_err(join_error)? {
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

    async fn evict(&self, bytes: u64, among: Among<'_>) -> Result<Evicted> {
        let shared = &self.shared;
        let pinned = shared.pin_filter.get();
        let mut evicted = Evicted::default();
        let keys = {
            let mut index = shared.lock();
            let victims = index
                .policy
                .evict_among(bytes, |k| !among(k) || pinned.is_some_and(|is_pinned| is_pinned(k)));
            victims
                .into_iter()
                .filter(|victim| {
                    let Some(ready) = index.retire(victim) else { return false };
                    evicted.blocks += 1;
                    evicted.bytes += ready.size;
                    true
                })
                .collect()
        };
        let deleting = Deleting { shared: Arc::clone(shared), keys };
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
    use std::time::Duration;

    use proptest::prelude::*;

    use super::super::policy::reference::Reference;
    use super::*;

    fn key(i: u64) -> BlockKey {
        BlockKey::new(format!("s3://bucket/dir/obj{i}"), "etag-1", i)
    }

    fn data_for(i: u64, len: usize) -> Bytes {
        (0..len).map(|j| (i as usize * 31 + j * 7) as u8).collect::<Vec<_>>().into()
    }

    fn files_with_suffix(dir: &Path, suffix: &str) -> BTreeSet<PathBuf> {
        let mut out = BTreeSet::new();
        let Ok(shards) = fs::read_dir(dir.join(BLOCKS_DIR)) else {
            return out;
        };
        for shard in shards {
            let shard = shard.unwrap();
            if !shard.file_type().unwrap().is_dir() {
                continue;
            }
            for entry in fs::read_dir(shard.path()).unwrap() {
                let path = entry.unwrap().path();
                if path.to_str().unwrap().ends_with(suffix) {
                    out.insert(path);
                }
            }
        }
        out
    }

    fn block_files(dir: &Path) -> BTreeSet<PathBuf> {
        files_with_suffix(dir, ".blk")
    }

    fn key_set(tier: &NvmeTier) -> BTreeMap<BlockKey, u64> {
        tier.keys().into_iter().collect()
    }

    fn replay(state: &mut BTreeMap<BlockKey, u64>, events: Vec<TierEvent>) {
        for ev in events {
            match ev {
                TierEvent::Added { key, size } => {
                    assert!(state.insert(key, size).is_none(), "Added for a key already present");
                }
                TierEvent::Removed { key } => {
                    assert!(state.remove(&key).is_some(), "Removed for an absent key");
                }
            }
        }
    }

    /// Inverts one byte of a file in place.
    fn flip_byte(path: &Path, offset: usize) {
        let mut buf = fs::read(path).unwrap();
        buf[offset] ^= 0xff;
        fs::write(path, buf).unwrap();
    }

    /// An offset inside the key's file name, i.e. in the checksummed header.
    const HEADER_BYTE: usize = FIXED_LEN + 4 + 1;

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
        assert_eq!(file.len() as u64, offset + len);
        assert_eq!(&file[offset as usize..], &big[..]);
        assert_eq!(&file[..8], b"STRATABK");
        assert_eq!(tier.locate(&key(3)), None);

        let mut replayed = BTreeMap::new();
        replay(&mut replayed, tier.drain_events());
        assert_eq!(replayed, key_set(&tier));
        assert_eq!(tier.corrupt_blocks(), 0);
    }

    #[tokio::test]
    async fn reopen_keeps_blocks_and_reports_them() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        for i in 0..3 {
            tier.put(&key(i), data_for(i, 100 * i as usize)).await.unwrap();
        }
        let before = key_set(&tier);
        drop(tier);

        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(key_set(&tier), before);
        let mut replayed = BTreeMap::new();
        replay(&mut replayed, tier.drain_events());
        assert_eq!(replayed, before);
        for i in 0..3 {
            assert_eq!(tier.get(&key(i)).await.unwrap(), Some(data_for(i, 100 * i as usize)));
        }
        assert_eq!(tier.usage().used_bytes, 300);
        assert_eq!(tier.corrupt_blocks(), 0);
    }

    async fn assert_dropped_as_corrupt(tier: &NvmeTier, k: &BlockKey) {
        let path = tier.block_path(k);
        assert_eq!(tier.get(k).await.unwrap(), None);
        assert_eq!(tier.corrupt_blocks(), 1);
        assert!(!path.exists(), "corrupt file must be deleted");
        assert!(!tier.contains(k));
        assert!(tier.drain_events().contains(&TierEvent::Removed { key: k.clone() }));
        // Already gone: a second read is a plain miss, not a second corruption.
        assert_eq!(tier.get(k).await.unwrap(), None);
        assert_eq!(tier.corrupt_blocks(), 1);
    }

    #[tokio::test]
    async fn flipped_data_byte_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        tier.put(&key(1), data_for(1, 500)).await.unwrap();
        tier.put(&key(2), data_for(2, 500)).await.unwrap();
        let path = tier.block_path(&key(1));
        let len = fs::metadata(&path).unwrap().len() as usize;
        flip_byte(&path, len - 100);
        assert_dropped_as_corrupt(&tier, &key(1)).await;
        assert_eq!(tier.usage().used_bytes, 500);
        assert_eq!(tier.get(&key(2)).await.unwrap(), Some(data_for(2, 500)));
    }

    #[tokio::test]
    async fn corrupt_header_is_dropped_on_get() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        tier.put(&key(1), data_for(1, 500)).await.unwrap();
        flip_byte(&tier.block_path(&key(1)), HEADER_BYTE);
        assert_dropped_as_corrupt(&tier, &key(1)).await;
        assert_eq!(tier.usage().used_bytes, 0);
    }

    #[tokio::test]
    async fn truncated_file_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        tier.put(&key(1), data_for(1, 500)).await.unwrap();
        let path = tier.block_path(&key(1));
        let file = File::options().write(true).open(&path).unwrap();
        file.set_len(file.metadata().unwrap().len() - 1).unwrap();
        drop(file);
        assert_dropped_as_corrupt(&tier, &key(1)).await;
    }

    #[tokio::test]
    async fn wrong_key_in_file_is_dropped() {
        // What a storage-id collision would look like: the file under B's name holds A.
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        tier.put(&key(1), data_for(1, 64)).await.unwrap();
        tier.put(&key(2), data_for(2, 64)).await.unwrap();
        fs::copy(tier.block_path(&key(1)), tier.block_path(&key(2))).unwrap();
        assert_dropped_as_corrupt(&tier, &key(2)).await;
        assert_eq!(tier.get(&key(1)).await.unwrap(), Some(data_for(1, 64)));
    }

    #[tokio::test]
    async fn malformed_files_are_dropped_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        for i in 0..4 {
            tier.put(&key(i), data_for(i, 300)).await.unwrap();
        }
        flip_byte(&tier.block_path(&key(0)), HEADER_BYTE);
        let truncated = File::options().write(true).open(tier.block_path(&key(1))).unwrap();
        truncated.set_len(20).unwrap();
        drop(truncated);
        // A valid block under a name that is not its key's.
        let misplaced = tier.block_path(&key(2)).with_file_name(format!("{:032x}.blk", 7u128));
        fs::rename(tier.block_path(&key(2)), &misplaced).unwrap();
        drop(tier);

        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(tier.corrupt_blocks(), 3);
        assert_eq!(key_set(&tier), [(key(3), 300)].into_iter().collect());
        assert_eq!(block_files(dir.path()), [tier.block_path(&key(3))].into_iter().collect());
        assert_eq!(tier.drain_events(), vec![TierEvent::Added { key: key(3), size: 300 }]);
        assert_eq!(tier.get(&key(3)).await.unwrap(), Some(data_for(3, 300)));
    }

    #[tokio::test]
    async fn missing_file_is_a_miss_not_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        tier.put(&key(1), data_for(1, 10)).await.unwrap();
        tier.drain_events();
        fs::remove_file(tier.block_path(&key(1))).unwrap();
        assert_eq!(tier.get(&key(1)).await.unwrap(), None);
        assert_eq!(tier.corrupt_blocks(), 0);
        assert!(!tier.contains(&key(1)));
        assert_eq!(tier.usage().used_bytes, 0);
        assert_eq!(tier.drain_events(), vec![TierEvent::Removed { key: key(1) }]);
    }

    #[tokio::test]
    async fn tmp_leftovers_are_removed_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        tier.put(&key(1), data_for(1, 10)).await.unwrap();
        let path = tier.block_path(&key(1));
        drop(tier);
        let beside = tmp_path(&path);
        fs::write(&beside, b"half a blo").unwrap();
        fs::create_dir_all(dir.path().join("blocks/ab")).unwrap();
        let lone = dir.path().join("blocks/ab/abababababababababababababababab.blk.tmp");
        fs::write(&lone, b"").unwrap();

        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        assert!(!beside.exists() && !lone.exists());
        assert!(files_with_suffix(dir.path(), ".tmp").is_empty());
        assert_eq!(tier.corrupt_blocks(), 0);
        assert_eq!(tier.get(&key(1)).await.unwrap(), Some(data_for(1, 10)));
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
    async fn open_evicts_oldest_mtime_over_capacity() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        let now = SystemTime::now();
        for (i, age_secs) in [(0u64, 10u64), (1, 30), (2, 20)] {
            tier.put(&key(i), data_for(i, 100)).await.unwrap();
            let file = File::options().write(true).open(tier.block_path(&key(i))).unwrap();
            file.set_modified(now - Duration::from_secs(age_secs)).unwrap();
        }
        drop(tier);

        let tier = NvmeTier::open(dir.path(), 200).unwrap();
        assert_eq!(key_set(&tier), [(key(0), 100), (key(2), 100)].into_iter().collect());
        assert_eq!(block_files(dir.path()).len(), 2);
        assert!(!tier.block_path(&key(1)).exists());
        assert_eq!(tier.corrupt_blocks(), 0);
        let mut replayed = BTreeMap::new();
        replay(&mut replayed, tier.drain_events());
        assert_eq!(replayed, key_set(&tier));
        // Recovered blocks start in mtime order: 2 is older than 0, so it goes first.
        tier.put(&key(5), data_for(5, 100)).await.unwrap();
        assert!(tier.contains(&key(0)) && !tier.contains(&key(2)));
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
    async fn stale_reads_never_drop_a_newer_copy() {
        // A get that looked the block up, then lost a race with eviction and a re-put, must
        // neither count nor delete the new copy, whatever it finds on disk.
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        let k = key(1);
        tier.put(&k, data_for(1, 64)).await.unwrap();
        let stale = tier.shared.lock().touch(&k).unwrap();
        tier.remove(&k).await.unwrap();
        tier.put(&k, data_for(1, 64)).await.unwrap();
        let path = tier.block_path(&k);

        flip_byte(&path, HEADER_BYTE);
        assert_eq!(tier.shared.read_checked(&k, stale).unwrap(), None);
        assert_eq!(tier.corrupt_blocks(), 0);
        assert!(path.exists() && tier.contains(&k));

        fs::remove_file(&path).unwrap();
        assert_eq!(tier.shared.read_checked(&k, stale).unwrap(), None);
        assert!(tier.contains(&k), "stale miss dropped the current entry");

        // The current generation is handled as usual.
        assert_eq!(tier.get(&k).await.unwrap(), None);
        assert!(!tier.contains(&k));
        assert_eq!(tier.corrupt_blocks(), 0);
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
        ]
    }

    /// Reference model: the reference S3-FIFO over key indexes. Blocks are immutable per key,
    /// so a key always has the same size and bytes. A reopen recovers blocks in mtime order,
    /// which the test sets from the model's order (mtimes of real writes are too coarse to
    /// predict), so the model knows the recovered order too.
    struct Model {
        capacity: u64,
        sizes: Vec<u64>,
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
        let on_disk: BTreeSet<PathBuf> = expected.keys().map(|k| tier.block_path(k)).collect();
        prop_assert_eq!(block_files(dir), on_disk);
        prop_assert!(files_with_suffix(dir, ".tmp").is_empty());
        for k in model.present() {
            prop_assert_eq!(tier.hits(&key(k)), model.policy.freq(&k).unwrap());
        }
        Ok(())
    }

    fn open_pinned(dir: &Path, capacity: u64, pins: &Arc<Mutex<u8>>) -> NvmeTier {
        let tier = NvmeTier::open(dir, capacity).unwrap();
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
            ops in proptest::collection::vec(op(), 1..50),
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let dir = tempfile::tempdir().unwrap();
            let pins = Arc::new(Mutex::new(0u8));
            let mut tier = open_pinned(dir.path(), capacity, &pins);
            let mut model = Model {
                capacity,
                sizes: sizes.clone(),
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
                        let res = rt.block_on(tier.put(&key(k), data_for(k, size as usize)));
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
                            let path = tier.block_path(&key(k));
                            let len = fs::metadata(&path).unwrap().len() as usize;
                            flip_byte(&path, len - 1);
                            model.bad_data.insert(k);
                        }
                    }
                    Op::CorruptHeader(k) => {
                        if model.policy.contains(&k) && !model.is_bad(k) {
                            flip_byte(&tier.block_path(&key(k)), HEADER_BYTE);
                            model.bad_header.insert(k);
                        }
                    }
                    Op::Reopen => {
                        // Recovery order is mtime order: make it the model's order.
                        let present = model.present();
                        let base = SystemTime::now() - Duration::from_secs(10_000);
                        for (i, &k) in present.iter().enumerate() {
                            let file = File::options().write(true).open(tier.block_path(&key(k))).unwrap();
                            file.set_modified(base + Duration::from_secs(i as u64)).unwrap();
                        }
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
                }
                check_state(&tier, dir.path(), &model, &mut replayed)?;
            }
        }
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

    #[test]
    fn a_limit_set_by_a_full_disk_lapses_after_the_retry_period() {
        let t0 = Instant::now();
        let mut index = Index::new(100);
        assert_eq!(index.limit(100, t0), 100);
        index.full = Some((40, t0));
        assert_eq!(index.limit(100, t0 + FULL_RETRY / 2), 40);
        assert_eq!(index.limit(100, t0 + FULL_RETRY), 100, "the capacity is tried again");
        assert!(index.full.is_none());
    }
}
