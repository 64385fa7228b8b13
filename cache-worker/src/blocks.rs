//! The storage API the services above (data plane, grants, loader, master link) use: a
//! [`BlockRead`] goes in — the worker's own request type, translated from the wire at the edge —
//! and the bytes, where they came from and the block's [`BlockKey`] come back, so no layer
//! resolves a mount or builds a key twice.
//!
//! Read path for one block range: resolve the path to its mount and name the block (key =
//! file identity of the mount's URI and path, the client's version, the index); then DRAM; a
//! verified NVMe block as its file (zero copy); any other NVMe hit (checked, and promoted to
//! DRAM from its second hit); else the single flight to the upstream (a sidecar's cluster, a
//! worker's peers) or the UFS (`fetch`). Every client read is foreground
//! activity for the QoS lane; a warmup load is not, and writes its block through to NVMe.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use strata_common::frame::Source;
use strata_common::upstream::Upstream;
use strata_common::{BlockKey, QosClass, SharedClock, block};
use strata_ufs::{UfsError, UfsWriter};

use crate::cache::{BlockCache, Durability};
use crate::classes::ClassGate;
use crate::error::ServeError;
use crate::fetch::{FetchFor, Fetcher, Located, Tap};
use crate::metrics_defs as m;
use crate::mounts::{Mounts, Resolved};
use crate::qos::Qos;
use crate::stats::{CounterSnapshot, Counters};
use crate::tier::{PutParams, TierError};

/// A read of one block range, as the storage layer takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRead {
    /// Strata path of the file.
    pub path: String,
    /// The file's UFS version as the client learnt it.
    pub version: String,
    pub file_size: u64,
    /// The block size the client computed with (must be the mount's).
    pub block_size: u64,
    pub index: u64,
    /// Offset of the range inside the block.
    pub offset: u64,
    pub len: u64,
}

impl BlockRead {
    /// The whole block `index` of a file.
    pub fn whole_block(path: &str, version: &str, file_size: u64, block_size: u64, index: u64) -> Self {
        Self {
            path: path.to_string(),
            version: version.to_string(),
            file_size,
            block_size,
            index,
            offset: 0,
            len: block::block_len(file_size, block_size, index),
        }
    }
}

/// The bytes of a block range as the data plane gets them to send.
#[derive(Debug)]
pub enum Payload {
    /// In memory (a DRAM block, or one just fetched).
    Bytes(Bytes),
    /// `len` bytes at `offset` of an open NVMe block file whose checksum was verified: sent
    /// with `sendfile`, or the descriptor passed to a co-located client, never copied through
    /// user space.
    File { file: std::fs::File, offset: u64, len: u64 },
}

impl Payload {
    pub fn len(&self) -> u64 {
        match self {
            Payload::Bytes(b) => b.len() as u64,
            Payload::File { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A served range: its bytes, where they were found, and the block's key.
#[derive(Debug)]
pub struct Served {
    pub payload: Payload,
    pub source: Source,
    pub key: BlockKey,
}

/// Says whether a batch load may start its next block (a load job's batch asks whether the job
/// still runs).
#[async_trait::async_trait]
pub trait LoadGate: Send + Sync {
    async fn go_on(&self) -> bool;
}

/// A block of a batch load: where it is, its bytes when this load fetched them into DRAM, and
/// whether a tier or a peer had it already.
type Fetched = (Located, Option<Bytes>, bool);

/// What a load task did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadOutcome {
    pub already_cached: bool,
    /// Length of the block.
    pub bytes: u64,
}

pub struct BlockService {
    /// Write-back journals: the bytes of files not yet in the UFS (a worker's; none in a sidecar).
    journal: std::sync::OnceLock<Arc<crate::journal::Journal>>,
    cache: Arc<BlockCache>,
    fetcher: Fetcher,
    mounts: Arc<Mounts>,
    qos: Qos,
    counters: Arc<Counters>,
    /// Whether a client's cold read is answered as the block arrives from the UFS
    /// (`cut_through`, see `fetch`).
    cut_through: std::sync::atomic::AtomicBool,
}

impl BlockService {
    /// A service over `cache` and `mounts` with a 10 s UFS deadline, no UFS fetch gate and the
    /// system clock: for tests of what sits above it.
    #[cfg(test)]
    pub(crate) fn for_tests(cache: Arc<BlockCache>, counters: Arc<Counters>, mounts: Arc<Mounts>) -> Self {
        Self::new(
            cache,
            counters,
            mounts,
            Duration::from_secs(10),
            Arc::new(crate::classes::ClassGate::for_ufs_fetches(0)),
            strata_common::clock::system(),
        )
    }

    /// `counters` must be the ones `cache` counts into.
    pub fn new(
        cache: Arc<BlockCache>,
        counters: Arc<Counters>,
        mounts: Arc<Mounts>,
        ufs_deadline: Duration,
        fetch_gate: Arc<ClassGate>,
        clock: SharedClock,
    ) -> Self {
        Self {
            journal: std::sync::OnceLock::new(),
            fetcher: Fetcher::new(cache.clone(), counters.clone(), ufs_deadline, fetch_gate),
            cache,
            mounts,
            qos: Qos::new(clock),
            counters,
            cut_through: std::sync::atomic::AtomicBool::new(true),
        }
    }

    /// Turns cut-through answers of cold reads on or off (the worker's `cut_through`).
    pub fn set_cut_through(&self, on: bool) {
        self.cut_through.store(on, Ordering::Relaxed);
    }

    pub fn cut_through(&self) -> bool {
        self.cut_through.load(Ordering::Relaxed)
    }

    /// Counts a cut-through answer that ended: whole, or cut off after the fetch failed.
    pub fn count_cut_through(&self, whole: bool) {
        if whole {
            self.counters.cut_through_reads.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(m::CUT_THROUGH_READS).increment(1);
        } else {
            self.counters.cut_through_aborts.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(m::CUT_THROUGH_ABORTS).increment(1);
        }
    }

    pub fn cache(&self) -> &Arc<BlockCache> {
        &self.cache
    }

    pub fn mounts(&self) -> &Arc<Mounts> {
        &self.mounts
    }

    /// The gate client reads' UFS fetches pass by request class.
    pub fn fetch_gate(&self) -> &Arc<ClassGate> {
        self.fetcher.gate()
    }

    /// Foreground activity, which the loader and the write-back writer yield to.
    pub fn qos(&self) -> &Qos {
        &self.qos
    }

    /// Serves write-back versions from `journal`. Set once.
    pub fn set_journal(&self, journal: Arc<crate::journal::Journal>) {
        let _ = self.journal.set(journal);
    }

    /// A range of a write-back file not yet uploaded, from this worker's journal of it.
    async fn read_journal(&self, r: &BlockRead, at: &Located, write_id: &str) -> Result<Bytes, ServeError> {
        // Uploaded (and its grace over) or replaced since the client learnt this version: the
        // client re-reads the path's current one. The error names the path, as for a UFS change.
        let gone = || {
            tracing::debug!(path = %at.path, version = %r.version, "no journal of this version here");
            ServeError::Ufs(UfsError::VersionChanged(at.path.clone()))
        };
        let journal = self.journal.get().ok_or_else(gone)?;
        let record = journal.get(write_id).ok_or_else(gone)?;
        if record.path != at.path || record.size != r.file_size {
            return Err(gone());
        }
        let offset = r.index * r.block_size + r.offset;
        let bytes = journal.read_at(write_id, offset, r.len).await.map_err(|e| {
            ServeError::Ufs(UfsError::Other(format!("write-back journal of {}: {e}", at.path)))
        })?;
        self.served(bytes.len() as u64);
        Ok(bytes)
    }

    /// Makes misses ask `upstream` before the UFS (sidecar mode). Set once.
    pub fn set_upstream(&self, upstream: Arc<dyn Upstream>) {
        self.fetcher.set_upstream(upstream);
    }

    /// Checks a read against the mount table and names its block.
    pub async fn locate(&self, r: &BlockRead) -> Result<Located, ServeError> {
        let resolved = self.mounts.resolve(&r.path).await?;
        let (p, mount, rel) = (resolved.path, resolved.mount, resolved.rel);
        if rel.is_empty() {
            return Err(ServeError::InvalidArgument(format!("{p} is a mount point, not a file")));
        }
        if r.block_size != mount.block_size {
            return Err(ServeError::InvalidArgument(format!(
                "block size {} does not match the mount's {} (stale client mount table?)",
                r.block_size, mount.block_size
            )));
        }
        if r.version.is_empty() {
            return Err(ServeError::InvalidArgument("empty version".into()));
        }
        let block_len = block::block_len(r.file_size, r.block_size, r.index);
        if block_len == 0 {
            return Err(ServeError::InvalidArgument(format!(
                "block {} is past the end of a {}-byte file",
                r.index, r.file_size
            )));
        }
        let key = BlockKey::new(
            block::file_identity(&mount.uri, &rel, mount.block_size),
            r.version.clone(),
            r.index,
        );
        let params = PutParams {
            packed: block::is_small_file(r.file_size, mount.block_size, mount.options.pack_threshold),
        };
        Ok(Located { key, path: p, mount, rel, file_size: r.file_size, block_len, params })
    }

    /// [`locate`](Self::locate), and the requested range checked against the block.
    async fn locate_range(&self, r: &BlockRead) -> Result<Located, ServeError> {
        let at = self.locate(r).await?;
        if r.len == 0 || r.offset.checked_add(r.len).is_none_or(|end| end > at.block_len) {
            return Err(ServeError::InvalidArgument(format!(
                "range {}+{} outside block {} of {} bytes",
                r.offset, r.len, r.index, at.block_len
            )));
        }
        Ok(at)
    }

    fn served(&self, bytes: u64) {
        self.counters.bytes_served.fetch_add(bytes, Ordering::Relaxed);
        metrics::counter!(m::BYTES_SERVED).increment(bytes);
    }

    /// One block range as bytes in memory, for a client of the default request class. `Ok`
    /// holds exactly `r.len` bytes.
    pub async fn read(&self, r: &BlockRead) -> Result<(Bytes, Source), ServeError> {
        let _foreground = self.qos.foreground();
        let at = self.locate_range(r).await?;
        if let Some(id) = block::write_back_id(&r.version) {
            return Ok((self.read_journal(r, &at, id).await?, Source::Nvme));
        }
        self.read_bytes(r, &at, QosClass::default(), None).await
    }

    /// One block range like [`read`](Self::read), but a block that is only on NVMe (and
    /// verified) comes back as a file region instead of being read into memory. It is not
    /// promoted to DRAM then: the page cache holds it as well as DRAM would. A miss is fetched
    /// in the client's request `class`.
    pub async fn read_payload(&self, r: &BlockRead, class: QosClass) -> Result<Served, ServeError> {
        self.read_payload_tapped(r, class, None).await
    }

    /// [`read_payload`](Self::read_payload) from the tiers (and write-back journals) alone:
    /// `None` on a miss, which is neither fetched nor counted.
    pub async fn read_payload_cached(&self, r: &BlockRead) -> Result<Option<Served>, ServeError> {
        let _foreground = self.qos.foreground();
        let at = self.locate_range(r).await?;
        if let Some(served) = self.journal_or_verified_file(r, &at).await? {
            return Ok(Some(served));
        }
        let range = r.offset..r.offset + r.len;
        let found = if r.len < at.block_len {
            self.cache.lookup_range(&at.key, range).await
        } else {
            self.cache.lookup(&at.key).await
        };
        Ok(found.map(|(bytes, source)| {
            self.served(bytes.len() as u64);
            Served { payload: Payload::Bytes(bytes), source, key: at.key }
        }))
    }

    /// [`read_payload`](Self::read_payload), with the pieces of a UFS fetch this read flies sent
    /// to `tap` as they arrive (cut-through; see `fetch`). Whatever went to the tap, the result
    /// is the read's outcome: only an `Ok` makes those pieces the file's bytes.
    pub async fn read_payload_tapped(
        &self,
        r: &BlockRead,
        class: QosClass,
        tap: Option<&Tap>,
    ) -> Result<Served, ServeError> {
        let _foreground = self.qos.foreground();
        let at = self.locate_range(r).await?;
        if let Some(served) = self.journal_or_verified_file(r, &at).await? {
            return Ok(served);
        }
        let (bytes, source) = self.read_bytes(r, &at, class, tap).await?;
        Ok(Served { payload: Payload::Bytes(bytes), source, key: at.key })
    }

    /// The answers that come before any look-up of the block's bytes: a write-back file's from
    /// its journal, and a verified NVMe block as its file (served without a copy, not promoted).
    async fn journal_or_verified_file(
        &self,
        r: &BlockRead,
        at: &Located,
    ) -> Result<Option<Served>, ServeError> {
        let key = at.key.clone();
        if let Some(id) = block::write_back_id(&r.version) {
            let bytes = self.read_journal(r, at, id).await?;
            return Ok(Some(Served { payload: Payload::Bytes(bytes), source: Source::Nvme, key }));
        }
        let Some(region) = self.cache.open_verified(&at.key, at.block_len) else { return Ok(None) };
        self.served(r.len);
        self.counters.zero_copy_bytes.fetch_add(r.len, Ordering::Relaxed);
        let payload = Payload::File { file: region.file, offset: region.data_offset + r.offset, len: r.len };
        Ok(Some(Served { payload, source: Source::Nvme, key }))
    }

    /// The range as a verified NVMe block file (in DRAM as well or not), with the block's key:
    /// nothing is fetched or read, and only a range served so counts as served.
    pub async fn verified_file(&self, r: &BlockRead) -> Result<(Option<Payload>, BlockKey), ServeError> {
        let at = self.locate_range(r).await?;
        if block::write_back_id(&r.version).is_some() {
            return Ok((None, at.key));
        }
        let Some(region) = self.cache.open_verified_file(&at.key, at.block_len) else {
            return Ok((None, at.key));
        };
        self.served(r.len);
        self.counters.zero_copy_bytes.fetch_add(r.len, Ordering::Relaxed);
        let payload = Payload::File { file: region.file, offset: region.data_offset + r.offset, len: r.len };
        Ok((Some(payload), at.key))
    }

    /// A block range from the tiers alone, for a peer (`Op::PeerRead`): `None` on a miss, which
    /// is never fetched (the asking peer reads the UFS itself). Write-back journals are not
    /// served this way: their readers ask the holders.
    pub async fn cached_range(&self, r: &BlockRead) -> Result<Option<(Bytes, Source)>, ServeError> {
        let at = self.locate_range(r).await?;
        if block::write_back_id(&r.version).is_some() {
            return Ok(None);
        }
        let Some((bytes, source)) = self.cache.lookup(&at.key).await else { return Ok(None) };
        let start = r.offset as usize;
        // Not counted as served: the peer counts what it takes (its upstream reads), and
        // `bytes_served` stays what clients got.
        Ok(Some((bytes.slice(start..start + r.len as usize), source)))
    }

    /// A block range for a read replica that missed it (`Op::PeerFetch`): from the tiers, or
    /// fetched through the single flight every other miss of the block here shares. Not counted
    /// as served (the asking replica serves its client). Write-back journals are not served
    /// this way, as with [`cached_range`](Self::cached_range).
    pub async fn fetched_range(&self, r: &BlockRead) -> Result<Option<(Bytes, Source)>, ServeError> {
        if block::write_back_id(&r.version).is_some() {
            return Ok(None);
        }
        let at = self.locate_range(r).await?;
        // The asking replica's client's class is not sent along: peer traffic goes in the default.
        let (bytes, source) =
            self.fetcher.block(&at, Durability::WriteBack, FetchFor::Client(QosClass::default())).await?;
        let start = r.offset as usize;
        Ok(Some((bytes.slice(start..start + r.len as usize), source)))
    }

    async fn read_bytes(
        &self,
        r: &BlockRead,
        at: &Located,
        class: QosClass,
        tap: Option<&Tap>,
    ) -> Result<(Bytes, Source), ServeError> {
        // Part of a cached block: only that part is read (and checked) from NVMe.
        if r.len < at.block_len
            && let Some((out, source)) = self.cache.lookup_range(&at.key, r.offset..r.offset + r.len).await
        {
            self.served(out.len() as u64);
            return Ok((out, source));
        }
        let (bytes, source) =
            self.fetcher.block_tapped(at, Durability::WriteBack, FetchFor::Client(class), tap).await?;
        let start = r.offset as usize;
        let out = bytes.slice(start..start + r.len as usize);
        self.served(out.len() as u64);
        Ok((out, source))
    }

    /// Makes sure a whole block is cached (a warmup task). Shares the single flight with
    /// client reads, so a block a client is fetching at the same moment is fetched once.
    pub async fn load(&self, r: &BlockRead) -> Result<LoadOutcome, ServeError> {
        let at = self.locate(r).await?;
        if block::write_back_id(&r.version).is_some() {
            return Err(ServeError::InvalidArgument(format!(
                "{} is a write-back file not uploaded yet: its holders' journals serve it",
                at.path
            )));
        }
        let on_nvme =
            |e: TierError| ServeError::DiskFull { block: at.key.to_string(), reason: e.to_string() };
        if self.cache.contains(&at.key) {
            self.cache.settle_on_nvme(&at.key, None, at.params).await.map_err(on_nvme)?;
            return Ok(LoadOutcome { already_cached: true, bytes: at.block_len });
        }
        let (bytes, source) = self.fetcher.block(&at, Durability::WriteThrough, FetchFor::Load).await?;
        self.cache.settle_on_nvme(&at.key, Some(bytes), at.params).await.map_err(on_nvme)?;
        Ok(LoadOutcome { already_cached: !matches!(source, Source::Ufs), bytes: at.block_len })
    }

    /// Makes sure many whole blocks are cached (a warmup batch of small files): fetched
    /// `parallelism` at a time (sharing the single flight with client reads, as `load` does),
    /// kept in DRAM, then settled on NVMe together, so the small files' blocks of the batch
    /// cost one packed append. One outcome per read, in order. A read the gate does not let
    /// start (its job was cancelled) is given up as [`ServeError::Cancelled`].
    pub async fn load_many(
        &self,
        reads: &[BlockRead],
        parallelism: usize,
        gate: &dyn LoadGate,
    ) -> Vec<Result<LoadOutcome, ServeError>> {
        use futures::StreamExt;
        // The futures are made up front: a lazily mapping stream would hold a closure over a
        // borrowed read across awaits, which a spawned (Send) task cannot prove general enough.
        let loads: Vec<_> = reads.iter().map(|r| self.fetch_for_load(r, gate)).collect();
        let fetched: Vec<Result<Fetched, ServeError>> =
            futures::stream::iter(loads).buffered(parallelism.max(1)).collect().await;
        let settle: Vec<(BlockKey, Option<Bytes>, PutParams)> = fetched
            .iter()
            .filter_map(|f| f.as_ref().ok())
            .map(|(at, bytes, _)| (at.key.clone(), bytes.clone(), at.params))
            .collect();
        let mut settled = self.cache.settle_many_on_nvme(settle).await.into_iter();
        fetched
            .into_iter()
            .map(|f| {
                let (at, _, already_cached) = f?;
                match settled.next() {
                    Some(Err(e)) => {
                        Err(ServeError::DiskFull { block: at.key.to_string(), reason: e.to_string() })
                    }
                    _ => Ok(LoadOutcome { already_cached, bytes: at.block_len }),
                }
            })
            .collect()
    }

    /// One block of a batch load: named, and fetched into DRAM unless a tier holds it (then
    /// `None`); whether it was cached before.
    async fn fetch_for_load(&self, r: &BlockRead, gate: &dyn LoadGate) -> Result<Fetched, ServeError> {
        let at = self.locate(r).await?;
        // The slot first: the gate's answer is for a file about to start, not one that will
        // wait behind others for a place.
        let _slot = self.qos.load_slot(at.params.packed).await;
        if !gate.go_on().await {
            return Err(ServeError::Cancelled(format!("{}: its load job was cancelled", r.path)));
        }
        if block::write_back_id(&r.version).is_some() {
            return Err(ServeError::InvalidArgument(format!(
                "{} is a write-back file not uploaded yet: its holders' journals serve it",
                at.path
            )));
        }
        if self.cache.contains(&at.key) {
            return Ok((at, None, true));
        }
        let (bytes, source) = self.fetcher.block(&at, Durability::ByCaller, FetchFor::Load).await?;
        let cached = !matches!(source, Source::Ufs);
        Ok((at, Some(bytes), cached))
    }

    /// A Strata path resolved to its mount, if the mount may be written.
    pub async fn writable(&self, raw: &str) -> Result<Resolved, ServeError> {
        let resolved = self.mounts.resolve(raw).await?;
        if resolved.rel.is_empty() {
            return Err(ServeError::Ufs(UfsError::IsDirectory(format!(
                "{} is a mount point",
                resolved.path
            ))));
        }
        let Some(ufs) = resolved.mount.ufs.as_write().filter(|_| resolved.mount.mode.is_writable()) else {
            return Err(ServeError::ReadOnly(resolved.path));
        };
        // Now, not when a write-back upload reaches the UFS: a write acknowledged into the
        // journal must not be one the UFS will refuse for where it goes (the cluster's state).
        ufs.check_write(&resolved.rel).await?;
        Ok(resolved)
    }

    /// A UFS writer for a Strata path, if its mount may be written.
    pub async fn open_writer(&self, raw: &str) -> Result<Box<dyn UfsWriter>, ServeError> {
        Self::writer_of(&self.writable(raw).await?).await
    }

    /// A UFS writer for a path [`writable`](Self::writable) resolved.
    pub async fn writer_of(resolved: &Resolved) -> Result<Box<dyn UfsWriter>, ServeError> {
        let ufs = resolved.mount.ufs.as_write().ok_or_else(|| ServeError::ReadOnly(resolved.path.clone()))?;
        Ok(ufs.writer(&resolved.rel).await?)
    }

    /// Counts a write through this worker that ended as `result` (`committed`, `aborted`,
    /// `refused`).
    pub fn count_write(&self, result: &'static str) {
        match result {
            "committed" => self.counters.writes_committed.fetch_add(1, Ordering::Relaxed),
            "aborted" => self.counters.writes_aborted.fetch_add(1, Ordering::Relaxed),
            _ => 0,
        };
        metrics::counter!(m::WRITES, "result" => result).increment(1);
    }

    pub fn counters(&self) -> CounterSnapshot {
        self.counters.snapshot(self.cache.corrupt_blocks())
    }

    /// Writes every dirty DRAM block to NVMe and waits for queued NVMe writes (shutdown).
    pub async fn flush(&self) {
        self.cache.flush().await;
    }
}
