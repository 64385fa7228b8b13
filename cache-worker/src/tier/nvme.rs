//! NVMe tier: one file per block under `<dir>/blocks/<2 hex>/<32 hex>.blk`, where the hex is the
//! block key's 128-bit [`storage_id`](BlockKey::storage_id) and the 2-hex shard keeps
//! directories small — except the blocks of small files ([`PutParams::packed`]), which are
//! entries of shared, append-only container files under `<dir>/packs/` (see [`pack`]).
//!
//! # On-disk format (little endian)
//!
//! ```text
//! magic b"STRATABK" (8) | version u32 = 2 | header_len u32 | data_len u64 | data_crc32c u32
//! | BlockKey::encode() | header_crc32c u32 (of every preceding header byte) | data
//! | chunk_crc32c u32 per 64 KiB of data (the last chunk may be shorter)
//! ```
//!
//! The chunk checksums let a read of part of a block it has not verified check only the
//! 64 KiB chunks the range touches ([`Tier::get_range`]): a 4 KiB read of a block after a
//! restart reads and checks 64 KiB, not 4 MiB. Version 1 files (no chunk checksums, written
//! before them) are still read; a range of one is read by checking the whole block. The data
//! starts right after the header in both, so where a block's bytes sit does not depend on the
//! version.
//!
//! The full key is in the header because the file name is only a hash: a read checks that the
//! file holds the block that was asked for. `header_len` lets [`NvmeTier::open`] read just the
//! header of each file, so a restart costs one small read per block, not a read of the cache.
//! A container entry has the same header under its own magic (see [`pack`]).
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

mod pack;

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

pub use pack::DEFAULT_CONTAINER_BYTES;

use super::{
    Among, BlockPut, Compacted, DiskHealth, Evicted, FileSpan, PinFilter, PutParams, Result, S3Fifo, Tier,
    TierError, TierEvent, TierKind, TierUsage,
};
use crate::metrics_defs as m;

const MAGIC: &[u8; 8] = b"STRATABK";
/// The format of container entries, and of block files written before chunk checksums.
const FORMAT_VERSION: u32 = 1;
/// The format of block files written now: version 1 plus the chunk checksums after the data.
const CHUNKED_FORMAT_VERSION: u32 = 2;
/// Bytes of data one chunk checksum covers.
pub const CHECKSUM_CHUNK: u64 = 64 << 10;
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
/// Live bytes one [`Tier::compact`] call moves at most, so a compaction pass never holds the
/// disk for long; the next upkeep sweep goes on.
const COMPACT_BUDGET: u64 = 64 << 20;

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

/// Where a packed entry starts: its container and the offset of its header there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PackAt {
    container: u32,
    offset: u64,
}

#[derive(Debug, Clone, Copy)]
struct Ready {
    size: u64,
    generation: u64,
    /// The file's data is known to match its checksum: this process wrote it from memory, or
    /// read and checked it since the tier opened. Only such blocks are served without a check
    /// ([`NvmeTier::open_verified`]).
    verified: bool,
    /// An entry of a container, not a file of its own.
    packed: Option<PackAt>,
}

#[derive(Debug, Clone, Copy)]
enum Slot {
    Ready(Ready),
    /// A write or a delete of the key's file is in flight.
    Busy,
}

/// A container file and what of it is live.
#[derive(Debug)]
struct Container {
    file: Arc<File>,
    /// Bytes appended (the file's length once sealed).
    len: u64,
    /// Header and data bytes of the ready entries in it.
    live_bytes: u64,
    live_entries: u64,
    /// No more appends: a newer container took over.
    sealed: bool,
}

impl Container {
    fn dead_bytes(&self) -> u64 {
        self.len.saturating_sub(self.live_bytes)
    }
}

/// The open container: where the next packed batch is appended.
struct Appender {
    seq: u32,
    file: Arc<File>,
    len: u64,
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
    containers: HashMap<u32, Container>,
    next_container: u32,
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
            containers: HashMap::new(),
            next_container: 0,
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

    fn insert_ready(&mut self, key: BlockKey, size: u64, verified: bool, packed: Option<PackAt>) {
        self.policy.insert(key.clone(), size);
        self.publish(key, size, verified, packed);
    }

    /// A block found by `open`: it was kept before the restart, so it starts in the policy's
    /// main queue (see [`NvmeTier::open`]).
    fn insert_recovered(&mut self, key: BlockKey, size: u64, packed: Option<PackAt>) {
        self.policy.insert_main(key.clone(), size);
        self.publish(key, size, false, packed);
    }

    fn publish(&mut self, key: BlockKey, size: u64, verified: bool, packed: Option<PackAt>) {
        let ready = Ready { size, generation: self.bump_generation(), verified, packed };
        self.events.push(TierEvent::Added { key: key.clone(), size });
        self.slots.insert(key, Slot::Ready(ready));
    }

    fn bump_generation(&mut self) -> u64 {
        let generation = self.next_generation;
        self.next_generation += 1;
        generation
    }

    /// Takes a ready block out of service, leaving its slot `Busy` for the caller to delete the
    /// file (or mark the entry dead) and then [`clear_busy`](Self::clear_busy).
    fn retire(&mut self, key: &BlockKey) -> Option<Ready> {
        let slot = self.slots.get_mut(key)?;
        let Slot::Ready(ready) = *slot else {
            return None;
        };
        *slot = Slot::Busy;
        // A no-op for an eviction: `victims` already took the key out of the policy.
        self.policy.remove(key);
        self.events.push(TierEvent::Removed { key: key.clone() });
        if let Some(at) = ready.packed {
            self.uncount(at.container, key, ready.size);
        }
        Some(ready)
    }

    /// An entry of `key` left container `seq` (retired or moved).
    fn uncount(&mut self, seq: u32, key: &BlockKey, size: u64) {
        if let Some(c) = self.containers.get_mut(&seq) {
            c.live_bytes = c.live_bytes.saturating_sub(pack::entry_len(key, size));
            c.live_entries = c.live_entries.saturating_sub(1);
        }
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

    /// The file of a packed entry's container.
    fn container_file(&self, at: PackAt) -> Option<Arc<File>> {
        self.containers.get(&at.container).map(|c| Arc::clone(&c.file))
    }

    /// Takes a sealed container with no ready entry out of the table; the caller deletes its
    /// file.
    fn take_if_empty(&mut self, seq: u32) -> bool {
        let empty = self.containers.get(&seq).is_some_and(|c| c.sealed && c.live_entries == 0);
        if empty {
            self.containers.remove(&seq);
        }
        empty
    }

    fn dead_bytes(&self) -> u64 {
        self.containers.values().map(Container::dead_bytes).sum()
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

/// The header and the chunk-checksum trailer of a block file (format 2). One pass over the
/// data: the whole-data checksum is combined from the chunks'.
fn encode_block(key: &BlockKey, data: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let mut trailer = Vec::with_capacity(trailer_len(data.len() as u64));
    let mut data_crc = 0;
    for chunk in data.chunks(CHECKSUM_CHUNK as usize) {
        let crc = crc32c::crc32c(chunk);
        trailer.extend_from_slice(&crc.to_le_bytes());
        data_crc = crc32c::crc32c_combine(data_crc, crc, chunk.len());
    }
    (encode_header(key, CHUNKED_FORMAT_VERSION, data.len() as u64, data_crc), trailer)
}

fn encode_header(key: &BlockKey, version: u32, data_len: u64, data_crc: u32) -> Vec<u8> {
    let key_enc = key.encode();
    let header_len = FIXED_LEN + key_enc.len() + HEADER_CRC_LEN;
    let mut header = Vec::with_capacity(header_len);
    header.extend_from_slice(MAGIC);
    header.extend_from_slice(&version.to_le_bytes());
    header.extend_from_slice(&(header_len as u32).to_le_bytes());
    header.extend_from_slice(&data_len.to_le_bytes());
    header.extend_from_slice(&data_crc.to_le_bytes());
    header.extend_from_slice(&key_enc);
    let crc = crc32c::crc32c(&header);
    header.extend_from_slice(&crc.to_le_bytes());
    header
}

/// Bytes of the chunk checksums after `data_len` bytes of data (format 2).
fn trailer_len(data_len: u64) -> usize {
    data_len.div_ceil(CHECKSUM_CHUNK) as usize * 4
}

/// Bytes after the data in a block file of `version`.
fn trailer_len_of(version: u32, data_len: u64) -> u64 {
    if version == CHUNKED_FORMAT_VERSION { trailer_len(data_len) as u64 } else { 0 }
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
    if !matches!(le_u32(prefix, 8), FORMAT_VERSION | CHUNKED_FORMAT_VERSION) {
        return Err("unsupported format version");
    }
    let header_len = le_u32(prefix, 12) as usize;
    if !(FIXED_LEN + MIN_KEY_LEN + HEADER_CRC_LEN..=MAX_HEADER_LEN).contains(&header_len) {
        return Err("bad header length");
    }
    Ok(header_len)
}

struct Header {
    version: u32,
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
        Some((key, used)) if used == key_enc.len() => Ok(Header {
            version: le_u32(body, 8),
            header_len,
            data_len: le_u64(body, 16),
            data_crc: le_u32(body, 24),
            key,
        }),
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
    let data_end = header.header_len as u64 + header.data_len;
    if buf.len() as u64 != data_end + trailer_len_of(header.version, header.data_len) {
        return Ok(ReadOutcome::Corrupt("length mismatch"));
    }
    // Slicing the buffer hands out the data without copying it past the header.
    let data = Bytes::from(buf).slice(header.header_len..data_end as usize);
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
    if header.header_len as u64 + header.data_len + trailer_len_of(header.version, header.data_len)
        != meta.len()
    {
        return Ok(Err("length mismatch"));
    }
    // Without an mtime the block just counts as oldest, which only matters for eviction order.
    let mtime = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
    Ok(Ok((header.key, header.data_len, mtime)))
}

/// Reads `range` of the data of one block file, checking only the chunks it touches (format 2;
/// a format 1 file is read and checked whole). `Hit` holds exactly the range.
fn read_block_range(path: &Path, key: &BlockKey, range: std::ops::Range<u64>) -> io::Result<ReadOutcome> {
    use std::os::unix::fs::FileExt;
    let file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(ReadOutcome::Missing),
        Err(e) => return Err(e),
    };
    let file_len = file.metadata()?.len();
    let header_len = header_len_for(key);
    if file_len < header_len as u64 {
        return Ok(ReadOutcome::Corrupt("truncated header"));
    }
    let mut head = vec![0u8; header_len];
    file.read_exact_at(&mut head, 0)?;
    let header = match parse_header(&head) {
        Ok(header) if header.header_len == header_len => header,
        Ok(_) => return Ok(ReadOutcome::Corrupt("key mismatch")),
        Err(reason) => return Ok(ReadOutcome::Corrupt(reason)),
    };
    if header.key != *key {
        return Ok(ReadOutcome::Corrupt("key mismatch"));
    }
    let data_end = header_len as u64 + header.data_len;
    if file_len != data_end + trailer_len_of(header.version, header.data_len) {
        return Ok(ReadOutcome::Corrupt("length mismatch"));
    }
    if range.end > header.data_len || range.start > range.end {
        return Ok(ReadOutcome::Corrupt("range past the block"));
    }
    if header.version != CHUNKED_FORMAT_VERSION {
        return Ok(match read_block(path, key)? {
            ReadOutcome::Hit(data) => ReadOutcome::Hit(data.slice(range.start as usize..range.end as usize)),
            other => other,
        });
    }
    let first = range.start / CHECKSUM_CHUNK;
    let last = range.end.div_ceil(CHECKSUM_CHUNK).max(first + 1);
    let chunks_start = first * CHECKSUM_CHUNK;
    let chunks_end = (last * CHECKSUM_CHUNK).min(header.data_len);
    let mut data = vec![0u8; (chunks_end - chunks_start) as usize];
    file.read_exact_at(&mut data, header_len as u64 + chunks_start)?;
    let mut crcs = vec![0u8; ((last - first) * 4) as usize];
    if !crcs.is_empty() {
        file.read_exact_at(&mut crcs, data_end + first * 4)?;
    }
    for (chunk, crc) in data.chunks(CHECKSUM_CHUNK as usize).zip(crcs.chunks_exact(4)) {
        if crc32c::crc32c(chunk) != le_u32(crc, 0) {
            return Ok(ReadOutcome::Corrupt("chunk checksum mismatch"));
        }
    }
    let from = (range.start - chunks_start) as usize;
    Ok(ReadOutcome::Hit(Bytes::from(data).slice(from..from + (range.end - range.start) as usize)))
}

fn write_block_file(tmp: &Path, header: &[u8], data: &[u8], trailer: &[u8]) -> io::Result<()> {
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
    file.write_all(data)?;
    file.write_all(trailer)
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
/// publishes the block if it was stored (at `packed` when it went into a container).
struct PendingWrite {
    shared: Arc<Shared>,
    key: BlockKey,
    size: u64,
    stored: bool,
    packed: Option<PackAt>,
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
struct Retired {
    key: BlockKey,
    packed: Option<PackAt>,
    size: u64,
}

/// Retired keys whose files are to be deleted (entries marked dead); their `Busy` slots clear
/// when this is dropped.
struct Deleting {
    shared: Arc<Shared>,
    retired: Vec<Retired>,
}

impl Deleting {
    /// Deletes every file and marks every entry dead (deleting containers that emptied),
    /// returning the first error other than "already gone".
    fn delete_files(&self) -> io::Result<()> {
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

struct PutJob {
    pending: PendingWrite,
    victims: Deleting,
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
    fn run(self, data: Bytes) -> Result<()> {
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
    fn run_packed(shared: &Arc<Shared>, jobs: Vec<(PutJob, Bytes)>) -> Result<()> {
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

    fn begin_remove(self: &Arc<Self>, key: &BlockKey) -> BeginRemove {
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

    /// Blocking: appends whole entries for `entries` to the open container (opening one first
    /// when there is none or it is full) in one write, counts them in the container, and
    /// returns where each landed. Sealing a full container happens here too, after its last
    /// append was counted, so a container is never deleted while an append into it is in flight.
    fn append(&self, entries: &[(BlockKey, Bytes)]) -> io::Result<Vec<PackAt>> {
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
    fn seal(&self, appender: Option<Appender>) {
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
    fn mark_dead(&self, at: PackAt, key: &BlockKey, size: u64) -> io::Result<()> {
        let file = self.lock().container_file(at);
        let result = match file {
            Some(file) => pack::mark_dead(&file, at.offset, pack::header_len_for(key) as u64, size),
            // Deleted already: its last entry went before this one was marked.
            None => Ok(()),
        };
        self.drop_if_empty(at.container);
        result
    }

    fn drop_if_empty(&self, seq: u32) {
        if self.lock().take_if_empty(seq) {
            remove_quietly(&pack::container_path(&self.packs_dir, seq), "empty container");
        }
    }

    /// Blocking: reads the block of a ready entry, dropping it if it is missing or corrupt.
    fn read_checked(
        &self,
        key: &BlockKey,
        entry: Ready,
        file: Option<Arc<File>>,
    ) -> io::Result<Option<Bytes>> {
        let outcome = match (entry.packed, file) {
            (None, _) => read_block(&self.block_path(key), key)?,
            (Some(at), Some(file)) => match pack::read_entry(&file, at.offset, key, entry.size)? {
                pack::EntryRead::Hit(data) => ReadOutcome::Hit(data),
                pack::EntryRead::Dead => ReadOutcome::Missing,
                pack::EntryRead::Corrupt(reason) => ReadOutcome::Corrupt(reason),
            },
            (Some(_), None) => ReadOutcome::Missing,
        };
        match outcome {
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
                self.drop_corrupt(key, entry.generation, "length differs from index");
                Ok(None)
            }
            ReadOutcome::Corrupt(reason) => {
                self.drop_corrupt(key, entry.generation, reason);
                Ok(None)
            }
            ReadOutcome::Missing => {
                let retired = {
                    let mut index = self.lock();
                    (index.ready_generation(key) == Some(entry.generation))
                        .then(|| index.retire(key))
                        .flatten()
                };
                if let Some(ready) = retired {
                    tracing::debug!(block = %key, tier = "nvme", "block file vanished; dropped from index");
                    if let Some(at) = ready.packed {
                        self.drop_if_empty(at.container);
                    }
                    self.lock().clear_busy(key);
                    self.settled.notify_waiters();
                }
                Ok(None)
            }
        }
    }

    /// Blocking: a range of an unpacked ready block (see [`Tier::get_range`]), dropping the
    /// block if what the range touches is corrupt.
    fn read_range_checked(
        &self,
        key: &BlockKey,
        entry: Ready,
        range: std::ops::Range<u64>,
    ) -> io::Result<Option<Bytes>> {
        let path = self.block_path(key);
        if entry.verified {
            use std::os::unix::fs::FileExt;
            let file = match File::open(&path) {
                Ok(file) => file,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(e),
            };
            let mut data = vec![0u8; (range.end - range.start) as usize];
            return match file.read_exact_at(&mut data, header_len_for(key) as u64 + range.start) {
                Ok(()) => Ok(Some(Bytes::from(data))),
                // Evicted and replaced by a shorter file under our feet: a miss.
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(None),
                Err(e) => Err(e),
            };
        }
        match read_block_range(&path, key, range)? {
            ReadOutcome::Hit(data) => Ok(Some(data)),
            ReadOutcome::Corrupt(reason) => {
                self.drop_corrupt(key, entry.generation, reason);
                Ok(None)
            }
            // The whole-block read settles the index for a vanished file.
            ReadOutcome::Missing => self.read_checked(key, entry, None).map(|_| None),
        }
    }

    fn drop_corrupt(&self, key: &BlockKey, generation: u64, reason: Malformed) {
        let (packed, size) = {
            let mut index = self.lock();
            // Another generation means the entry was evicted and rewritten (or moved) while we
            // read: what we read may be the old copy, and the new one is not ours to delete.
            if index.ready_generation(key) != Some(generation) {
                return;
            }
            match index.retire(key) {
                Some(r) => (r.packed, r.size),
                None => return,
            }
        };
        self.corrupt.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(block = %key, tier = "nvme", reason, packed = packed.is_some(), "corrupt block dropped");
        match packed {
            None => remove_quietly(&self.block_path(key), "corrupt block file"),
            Some(at) => {
                if let Err(e) = self.mark_dead(at, key, size) {
                    tracing::warn!(block = %key, tier = "nvme", error = %e, "could not mark a corrupt entry dead");
                }
            }
        }
        self.lock().clear_busy(key);
        self.settled.notify_waiters();
    }
}

/// Where a block found by `open` is stored, ordered for ties of equal mtimes: files by path,
/// then entries by container and offset (their write order).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Place {
    File(PathBuf),
    Packed(u32, u64),
}

/// A block found by `open`.
struct Recovered {
    mtime: SystemTime,
    place: Place,
    key: BlockKey,
    size: u64,
}

impl Shared {
    /// Blocking: one compaction pass — sealed containers with no live entry are deleted, and
    /// those at least half dead (a quarter, while the dead bytes of all containers exceed a
    /// quarter of the capacity) have their live entries moved to the open container and are
    /// deleted, most dead first, until [`COMPACT_BUDGET`] live bytes have moved.
    fn compact(&self) -> io::Result<Compacted> {
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
    fn compact_container(&self, seq: u32, file: &File, len: u64) -> io::Result<u64> {
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
        fs::create_dir_all(&blocks_dir)?;
        fs::create_dir_all(&packs_dir)?;

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
                        found.push(Recovered { mtime, place: Place::File(path), key, size });
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

        let mut containers: HashMap<u32, Container> = HashMap::new();
        let mut next_container = 0u32;
        for (seq, path) in pack::list(&packs_dir)? {
            next_container = next_container.max(seq.saturating_add(1));
            let scanned = match pack::scan(&path) {
                Ok(scanned) => scanned,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => {
                    tracing::warn!(path = %path.display(), tier = "nvme", error = %e, "unreadable container dropped");
                    remove_quietly(&path, "unreadable container");
                    corrupt += 1;
                    continue;
                }
            };
            if let Some(reason) = scanned.cut {
                tracing::warn!(path = %path.display(), tier = "nvme", reason, at = scanned.len, "container tail cut off");
                corrupt += 1;
            }
            if scanned.skipped > 0 {
                tracing::warn!(path = %path.display(), tier = "nvme", entries = scanned.skipped, "corrupt container entries dropped");
                corrupt += scanned.skipped;
            }
            for f in scanned.live {
                found.push(Recovered {
                    mtime: scanned.mtime,
                    place: Place::Packed(seq, f.offset),
                    key: f.key,
                    size: f.size,
                });
            }
            containers.insert(
                seq,
                Container {
                    file: Arc::new(scanned.file),
                    len: scanned.len,
                    live_bytes: 0,
                    live_entries: 0,
                    sealed: true,
                },
            );
        }

        // Oldest first: over capacity the oldest go, and main is filled in this order so its
        // first pass evicts the least recently written first.
        found.sort_by(|a, b| (a.mtime, &a.place).cmp(&(b.mtime, &b.place)));
        let discard = |containers: &HashMap<u32, Container>, r: &Recovered, what: &'static str| match &r.place
        {
            Place::File(path) => remove_quietly(path, what),
            Place::Packed(seq, offset) => {
                let header_len = pack::header_len_for(&r.key) as u64;
                if let Some(c) = containers.get(seq)
                    && let Err(e) = pack::mark_dead(&c.file, *offset, header_len, r.size)
                {
                    tracing::warn!(block = %r.key, tier = "nvme", error = %e, what, "could not mark an entry dead");
                }
            }
        };
        // A key found twice keeps its newest copy.
        let mut newest: HashMap<&BlockKey, usize> = HashMap::new();
        for (i, r) in found.iter().enumerate() {
            newest.insert(&r.key, i);
        }
        let keep: Vec<bool> = found.iter().enumerate().map(|(i, r)| newest[&r.key] == i).collect();
        drop(newest);
        let mut total: u64 = found.iter().zip(&keep).filter(|(_, k)| **k).map(|(r, _)| r.size).sum();
        let mut evicted = 0u64;
        let mut index = Index::new(capacity_bytes);
        for (r, kept) in found.into_iter().zip(keep) {
            if !kept {
                discard(&containers, &r, "older copy of a block");
                continue;
            }
            if total > capacity_bytes {
                discard(&containers, &r, "block over capacity");
                total -= r.size;
                evicted += 1;
                continue;
            }
            let packed = match r.place {
                Place::File(_) => None,
                Place::Packed(seq, offset) => {
                    if let Some(c) = containers.get_mut(&seq) {
                        c.live_bytes += pack::entry_len(&r.key, r.size);
                        c.live_entries += 1;
                    }
                    Some(PackAt { container: seq, offset })
                }
            };
            index.insert_recovered(r.key, r.size, packed);
        }
        let empty: Vec<u32> =
            containers.iter().filter(|(_, c)| c.live_entries == 0).map(|(s, _)| *s).collect();
        for seq in empty {
            containers.remove(&seq);
            remove_quietly(&pack::container_path(&packs_dir, seq), "empty container");
        }
        index.containers = containers;
        index.next_container = next_container;
        tracing::info!(
            dir = %dir.display(),
            tier = "nvme",
            blocks = index.policy.len(),
            used_bytes = index.policy.used(),
            containers = index.containers.len(),
            dead_bytes = index.dead_bytes(),
            capacity_bytes,
            corrupt,
            evicted,
            "nvme tier opened"
        );
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
    async fn a_range_of_an_unverified_block_checks_only_the_chunks_it_touches() {
        let dir = tempfile::tempdir().unwrap();
        let len = 4 * (1 << 20) + 100; // the last chunk is short
        let data = data_for(1, len);
        {
            let tier = NvmeTier::open(dir.path(), 64 << 20).unwrap();
            tier.put(&key(1), data.clone()).await.unwrap();
            tier.put(&key(2), data_for(2, len)).await.unwrap();
            // Written by this process: verified, read without a check.
            assert_eq!(tier.get_range(&key(1), 5..70_000).await.unwrap().unwrap(), data.slice(5..70_000));
        }
        // Reopened: nothing is verified; ranges are checked chunk by chunk.
        let tier = NvmeTier::open(dir.path(), 64 << 20).unwrap();
        let c = CHECKSUM_CHUNK as usize;
        for range in [0..1, c - 1..c + 1, 1000..300_000, len - 100..len, len - 1..len, 7..7, 0..len] {
            let got = tier.get_range(&key(1), range.start as u64..range.end as u64).await.unwrap();
            assert_eq!(got.unwrap(), data.slice(range.clone()), "{range:?}");
        }
        assert!(tier.get_range(&key(1), 0..len as u64 + 1).await.is_err(), "a range past the block");
        // A range read does not verify the block: only a whole read does.
        assert!(tier.open_verified(&key(1)).is_none());

        // Bit rot in chunk 10: ranges elsewhere are intact and served; one touching it drops
        // the block.
        let path = tier.block_path(&key(1));
        flip_byte(&path, header_len_for(&key(1)) + 10 * c + 5);
        assert_eq!(tier.get_range(&key(1), 0..4096).await.unwrap().unwrap(), data.slice(0..4096));
        assert_eq!(
            tier.get_range(&key(1), (9 * c) as u64..(10 * c) as u64).await.unwrap().unwrap(),
            data.slice(9 * c..10 * c)
        );
        assert_eq!(tier.get_range(&key(1), (10 * c + 4) as u64..(10 * c + 5) as u64).await.unwrap(), None);
        assert_eq!(tier.corrupt_blocks(), 1);
        assert!(!path.exists(), "the corrupt block's file is deleted");
        assert!(!tier.contains(&key(1)));

        // A whole read checks the whole-data checksum, combined from the chunks' at write.
        assert_eq!(tier.get(&key(2)).await.unwrap().unwrap(), data_for(2, len));
        assert!(tier.open_verified(&key(2)).is_some(), "a whole read verifies the block");
    }

    #[tokio::test]
    async fn a_corrupt_chunk_checksum_drops_the_block() {
        let dir = tempfile::tempdir().unwrap();
        let data = data_for(3, 200_000);
        NvmeTier::open(dir.path(), 1 << 20).unwrap().put(&key(3), data.clone()).await.unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        let path = tier.block_path(&key(3));
        // The second of four chunk checksums, after the data.
        flip_byte(&path, header_len_for(&key(3)) + data.len() + 4 + 1);
        assert_eq!(tier.get_range(&key(3), 0..10).await.unwrap().unwrap(), data.slice(0..10));
        assert_eq!(tier.get_range(&key(3), 70_000..70_010).await.unwrap(), None);
        assert_eq!(tier.corrupt_blocks(), 1);
    }

    #[tokio::test]
    async fn format_1_block_files_are_still_read() {
        let dir = tempfile::tempdir().unwrap();
        let data = data_for(4, 300_000);
        let path = block_path_in(&dir.path().join(BLOCKS_DIR), &key(4));
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        let header = encode_header(&key(4), FORMAT_VERSION, data.len() as u64, crc32c::crc32c(&data));
        fs::write(&path, [&header[..], &data[..]].concat()).unwrap();

        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        assert!(tier.contains(&key(4)), "open indexes a format 1 file");
        assert_eq!(
            tier.get_range(&key(4), 70_000..70_100).await.unwrap().unwrap(),
            data.slice(70_000..70_100)
        );
        assert_eq!(tier.get(&key(4)).await.unwrap().unwrap(), data);
        let span = tier.open_verified(&key(4)).expect("verified by the whole read");
        assert_eq!((span.offset, span.len), (header.len() as u64, data.len() as u64));

        // Its data checksum still guards it.
        flip_byte(&path, header.len() + 123);
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(tier.get_range(&key(4), 0..10).await.unwrap(), None);
        assert_eq!(tier.corrupt_blocks(), 1);
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
        assert_eq!(tier.shared.read_checked(&k, stale, None).unwrap(), None);
        assert_eq!(tier.corrupt_blocks(), 0);
        assert!(path.exists() && tier.contains(&k));

        fs::remove_file(&path).unwrap();
        assert_eq!(tier.shared.read_checked(&k, stale, None).unwrap(), None);
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

    /// The live entries of every container, read from disk without repairing anything: every
    /// live entry must check out; a dead one only needs its lengths (a corrupt entry dropped on
    /// a read is marked dead with its bad header).
    fn container_entries(dir: &Path) -> BTreeMap<BlockKey, u64> {
        let mut out = BTreeMap::new();
        for (_, path) in pack::list(&dir.join(pack::PACKS_DIR)).unwrap() {
            let buf = fs::read(&path).unwrap();
            let mut pos = 0;
            while pos < buf.len() {
                let entry = &buf[pos..];
                if &entry[..8] == pack::DEAD_MAGIC {
                    pos += le_u32(entry, 12) as usize + le_u64(entry, 16) as usize;
                    continue;
                }
                let (_, header) = pack::parse_entry_header(entry).expect("a live container entry went bad");
                assert!(out.insert(header.key, header.data_len).is_none(), "a key live twice on disk");
                pos += header.header_len + header.data_len as usize;
            }
            assert_eq!(pos, buf.len(), "a container ends inside an entry: {path:?}");
        }
        out
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

    fn small_key(i: u64) -> BlockKey {
        BlockKey::new(format!("s3://bucket/small/f{i:05}#bs4194304"), format!("etag-{i}"), 0)
    }

    fn small_puts(range: std::ops::Range<u64>, len: impl Fn(u64) -> usize) -> Vec<BlockPut> {
        range
            .map(|i| BlockPut {
                key: small_key(i),
                data: data_for(i, len(i)),
                params: PutParams { packed: true },
            })
            .collect()
    }

    fn container_files(dir: &Path) -> Vec<PathBuf> {
        pack::list(&dir.join(pack::PACKS_DIR)).unwrap().into_iter().map(|(_, p)| p).collect()
    }

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

    #[tokio::test]
    async fn evicted_and_removed_entries_stay_gone_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        // Room for 10 blocks of 1000 bytes.
        let tier = NvmeTier::open(dir.path(), 10_000).unwrap();
        for r in tier.put_many(small_puts(0..10, |_| 1000)).await {
            r.unwrap();
        }
        for r in tier.put_many(small_puts(10..14, |_| 1000)).await {
            r.unwrap();
        }
        tier.remove(&small_key(12)).await.unwrap();
        let kept = key_set(&tier);
        assert_eq!(kept.len(), 9, "4 evicted for the second batch, 1 removed");
        drop(tier);
        let tier = NvmeTier::open(dir.path(), 10_000).unwrap();
        assert_eq!(key_set(&tier), kept, "no evicted or removed block comes back");
        assert_eq!(tier.get(&small_key(12)).await.unwrap(), None);
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
    async fn a_corrupt_header_inside_a_container_costs_that_entry_alone_on_restart() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        for r in tier.put_many(small_puts(0..5, |_| 3000)).await {
            r.unwrap();
        }
        let (path, offset, _) = tier.locate(&small_key(1)).unwrap();
        let start = offset as usize - pack::header_len_for(&small_key(1));
        flip_byte(&path, start + HEADER_BYTE);
        drop(tier);
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(tier.corrupt_blocks(), 1);
        let keys: Vec<u64> = key_set(&tier).keys().map(|k| k.version[5..].parse().unwrap()).collect();
        assert_eq!(keys, vec![0, 2, 3, 4]);
        // A torn tail (a crash in the middle of an append) cuts the last entry only.
        let (path, offset, len) = tier.locate(&small_key(4)).unwrap();
        drop(tier);
        File::options().write(true).open(&path).unwrap().set_len(offset + len - 1).unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(key_set(&tier).len(), 3);
        assert_eq!(tier.get(&small_key(3)).await.unwrap(), Some(data_for(3, 3000)));
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
