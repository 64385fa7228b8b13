//! The worker's read path: DRAM, then NVMe (promoting hits), then one UFS fetch per block
//! shared by every concurrent miss. A sidecar worker has an [`Upstream`] (the cluster's
//! workers) that a miss asks before the UFS.
//!
//! Invariants: a block is cached only after a UFS read of exactly its range at exactly the
//! requested version succeeded (the UFS refuses a changed object), so no half-written or
//! mixed-version block is ever stored; an NVMe write is reported to the master only once the
//! file is in place; tier failures degrade to misses, never to failed reads.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use strata_common::frame::{ReadBlockRequest, Source};
use strata_common::{BlockKey, ErrorKind, block, path};
use strata_proto::master_client::MasterClient;
use strata_proto::{MountList, WorkerCounters, WorkerMountsRequest};
use strata_ufs::{Ufs, UfsError, UfsFactory};
use thiserror::Error;
use tokio::sync::{OnceCell, Semaphore};
use tonic::transport::Channel;
use tracing::{debug, warn};

use crate::loader::Qos;
use crate::metrics_defs as m;
use crate::tier::{Tier, TierKind};

/// Why a block read failed; travels to the client as an error frame.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ServeError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0} is not under any mount")]
    NoMount(String),
    #[error(transparent)]
    Ufs(#[from] UfsError),
    #[error("UFS read of {0} timed out")]
    UfsTimeout(String),
    #[error("{0} is on a read-only mount (mount it with -o mode=write-through to write through Strata)")]
    ReadOnly(String),
}

impl ServeError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            ServeError::InvalidArgument(_) => ErrorKind::InvalidArgument,
            ServeError::NoMount(_) => ErrorKind::NotFound,
            ServeError::Ufs(e) => e.kind(),
            ServeError::UfsTimeout(_) => ErrorKind::Ufs,
            ServeError::ReadOnly(_) => ErrorKind::PermissionDenied,
        }
    }
}

/// A mount as a worker needs it: where its blocks come from and how big they are.
pub struct WorkerMount {
    pub uri: String,
    pub block_size: u64,
    pub ufs: Arc<dyn Ufs>,
    /// The mount's `mode` is `write-through`: clients may write files through this worker.
    pub writable: bool,
}

/// One whole block a sidecar asks its upstream for, at the version the client read.
#[derive(Debug, Clone, Copy)]
pub struct UpstreamRead<'a> {
    /// Strata path of the file.
    pub path: &'a str,
    /// The UFS identity blocks are keyed (and placed on the ring) by.
    pub file_id: &'a str,
    pub version: &'a str,
    pub file_size: u64,
    pub block_size: u64,
    pub index: u64,
    /// Length of the whole block.
    pub len: u64,
}

#[derive(Debug, Error)]
#[error("upstream cannot serve the block: {0}")]
pub struct UpstreamError(pub String);

/// Where a miss is fetched before the UFS: for a sidecar, the cluster's workers (one origin
/// fetch for the whole cluster). An error is never final: the block is read from the UFS.
#[async_trait]
pub trait Upstream: Send + Sync + 'static {
    async fn read_block(&self, read: UpstreamRead<'_>) -> Result<Bytes, UpstreamError>;
}

/// What a load task did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadOutcome {
    pub already_cached: bool,
    /// Length of the block.
    pub bytes: u64,
}

#[derive(Default)]
pub struct Counters {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub ufs_reads: AtomicU64,
    pub ufs_bytes: AtomicU64,
    pub bytes_served: AtomicU64,
    /// Blocks a sidecar got from its upstream (the cluster) instead of the UFS.
    pub upstream_reads: AtomicU64,
    /// Bytes served as NVMe file regions ([`Payload::File`]) rather than through memory.
    pub zero_copy_bytes: AtomicU64,
}

pub struct BlockStore {
    pub(crate) memory: Arc<dyn Tier>,
    pub(crate) nvme: Arc<dyn Tier>,
    factory: Arc<dyn UfsFactory>,
    mounts: RwLock<(u64, BTreeMap<String, Arc<WorkerMount>>)>,
    inflight: Mutex<HashMap<BlockKey, Arc<OnceCell<Bytes>>>>,
    nvme_budget: Arc<Semaphore>,
    nvme_budget_units: u32,
    ufs_timeout: Duration,
    pub counters: Counters,
    /// Foreground activity, which the loader yields to.
    pub qos: Qos,
    /// Where to fetch the mount table when a request names a mount this worker has not heard
    /// of yet (it was added since the last heartbeat).
    master: Mutex<Option<(MasterClient<Channel>, String)>>,
    /// Set on a sidecar: misses ask it before the UFS.
    upstream: OnceLock<Arc<dyn Upstream>>,
    /// Set when RDMA grants are on (`crate::rdma`): the registered regions and their leases.
    pub(crate) rdma: OnceLock<Arc<crate::rdma::RdmaGrants>>,
    /// Whether verified NVMe blocks may be served as file regions ([`Payload::File`]).
    zero_copy: AtomicBool,
    /// Write-back to NVMe (see [`keep`](Self::keep)): blocks in DRAM not yet on NVMe, and
    /// dirty blocks DRAM evicted that are waiting for their NVMe write.
    writeback: Arc<Writeback>,
    /// How long client reads must have been quiet before dirty DRAM blocks are written to
    /// NVMe; zero writes every fetched block through at once.
    writeback_idle_ms: AtomicU64,
    /// Short-circuit grants: leases and shared-memory copies (`crate::shortcircuit`).
    pub(crate) short_circuit: OnceLock<crate::shortcircuit::ShortCircuit>,
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

#[derive(Default)]
struct Writeback {
    dirty: Mutex<HashSet<BlockKey>>,
    evicted: Mutex<Vec<(BlockKey, Bytes)>>,
}

impl Writeback {
    /// The DRAM tier's eviction sink: a dirty block leaving DRAM must reach NVMe.
    fn on_evict(&self, key: &BlockKey, bytes: &Bytes) {
        if lock(&self.dirty).remove(key) {
            lock(&self.evicted).push((key.clone(), bytes.clone()));
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Default of `WorkerConfig::nvme_writeback_idle_ms`.
pub const DEFAULT_WRITEBACK_IDLE: Duration = Duration::from_millis(1000);
/// NVMe write budget is counted in KiB so a u32 of permits covers terabytes.
const BUDGET_UNIT: u64 = 1024;

impl BlockStore {
    pub fn new(
        memory: Arc<dyn Tier>,
        nvme: Arc<dyn Tier>,
        factory: Arc<dyn UfsFactory>,
        ufs_timeout: Duration,
        nvme_write_budget: u64,
    ) -> Self {
        let units = (nvme_write_budget / BUDGET_UNIT).clamp(1, u32::MAX as u64 / 2) as u32;
        let writeback = Arc::new(Writeback::default());
        let sink = Arc::clone(&writeback);
        let write_back = memory.set_eviction_sink(Box::new(move |key, bytes| sink.on_evict(key, bytes)));
        let writeback_idle = if write_back { DEFAULT_WRITEBACK_IDLE } else { Duration::ZERO };
        Self {
            memory,
            nvme,
            factory,
            mounts: RwLock::new((0, BTreeMap::new())),
            inflight: Mutex::new(HashMap::new()),
            nvme_budget: Arc::new(Semaphore::new(units as usize)),
            nvme_budget_units: units,
            ufs_timeout,
            counters: Counters::default(),
            qos: Qos::default(),
            master: Mutex::new(None),
            upstream: OnceLock::new(),
            rdma: OnceLock::new(),
            zero_copy: AtomicBool::new(true),
            writeback,
            writeback_idle_ms: AtomicU64::new(writeback_idle.as_millis() as u64),
            short_circuit: OnceLock::new(),
        }
    }

    /// Sets how long client reads must be quiet before blocks they fetched, held in DRAM only,
    /// are written to NVMe; zero writes every fetched block to NVMe at once (write-through).
    /// Blocks DRAM evicts are written at once either way.
    pub fn set_writeback_idle(&self, idle: Duration) {
        self.writeback_idle_ms.store(idle.as_millis() as u64, Ordering::Relaxed);
    }

    /// Turns serving NVMe blocks as file regions (sendfile, passed descriptors) on or off.
    pub fn set_zero_copy(&self, on: bool) {
        self.zero_copy.store(on, Ordering::Relaxed);
    }

    /// Replaces the mount table with the master's (including UFS options).
    pub fn set_mounts(&self, list: &MountList) {
        let mut table = BTreeMap::new();
        for m in &list.mounts {
            let options = m.options.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            match self.factory.open(&m.uri, &options) {
                Ok(ufs) => {
                    table.insert(
                        m.path.clone(),
                        Arc::new(WorkerMount {
                            uri: m.uri.clone(),
                            block_size: m.block_size,
                            ufs,
                            writable: strata_common::MountOptions::parse(&m.options)
                                .is_ok_and(|o| o.mode.is_writable()),
                        }),
                    );
                }
                Err(e) => {
                    warn!(mount = %m.path, err = %e, "cannot open mount's UFS on this worker")
                }
            }
        }
        *self.mounts.write().unwrap_or_else(|p| p.into_inner()) = (list.epoch, table);
    }

    /// Makes misses ask `upstream` before the UFS (sidecar mode). Set once; later calls are
    /// ignored.
    pub fn set_upstream(&self, upstream: Arc<dyn Upstream>) {
        let _ = self.upstream.set(upstream);
    }

    pub fn set_master(&self, client: MasterClient<Channel>, worker_id: String) {
        *self.master.lock().unwrap_or_else(|p| p.into_inner()) = Some((client, worker_id));
    }

    pub async fn refresh_mounts(&self) {
        let master = self.master.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some((mut client, worker_id)) = master {
            match client.worker_mounts(WorkerMountsRequest { worker_id }).await {
                Ok(list) => self.set_mounts(&list.into_inner()),
                Err(status) => warn!(err = %status.message(), "cannot fetch mounts"),
            }
        }
    }

    pub fn mounts_epoch(&self) -> u64 {
        self.mounts.read().unwrap_or_else(|p| p.into_inner()).0
    }

    pub(crate) fn resolve(&self, p: &str) -> Option<(Arc<WorkerMount>, String)> {
        let guard = self.mounts.read().unwrap_or_else(|p| p.into_inner());
        path::resolve_mount(&guard.1, p).map(|(_, m, rel)| (m.clone(), rel))
    }

    /// Serves one block range. `Ok((bytes, source))` holds exactly `req.len` bytes.
    pub async fn read(&self, req: &ReadBlockRequest) -> Result<(Bytes, Source), ServeError> {
        let _foreground = self.qos.foreground();
        let (key, mount, rel, block_len) = self.locate_range(req).await?;
        self.read_bytes(req, &key, &mount, &rel, block_len).await
    }

    /// Serves one block range like [`read`](Self::read), but a block that is only on NVMe
    /// (and verified) comes back as a file region instead of being read into memory. It is
    /// not promoted to DRAM then: the page cache holds it as well as DRAM would.
    pub async fn read_payload(&self, req: &ReadBlockRequest) -> Result<(Payload, Source), ServeError> {
        let _foreground = self.qos.foreground();
        let (key, mount, rel, block_len) = self.locate_range(req).await?;
        if self.zero_copy.load(Ordering::Relaxed)
            && !self.memory.contains(&key)
            && let Some((file, data_offset, len)) = self.nvme.open_verified(&key)
            && len == block_len
        {
            self.hit(TierKind::Nvme);
            self.served(req.len);
            self.counters.zero_copy_bytes.fetch_add(req.len, Ordering::Relaxed);
            let region = Payload::File { file, offset: data_offset + req.offset, len: req.len };
            return Ok((region, Source::Nvme));
        }
        let (bytes, source) = self.read_bytes(req, &key, &mount, &rel, block_len).await?;
        Ok((Payload::Bytes(bytes), source))
    }

    /// [`locate`](Self::locate), and the requested range checked against the block.
    async fn locate_range(
        &self,
        req: &ReadBlockRequest,
    ) -> Result<(BlockKey, Arc<WorkerMount>, String, u64), ServeError> {
        let located = self.locate(req).await?;
        let block_len = located.3;
        if req.len == 0 || req.offset.checked_add(req.len).is_none_or(|end| end > block_len) {
            return Err(ServeError::InvalidArgument(format!(
                "range {}+{} outside block {} of {} bytes",
                req.offset, req.len, req.block_index, block_len
            )));
        }
        Ok(located)
    }

    fn served(&self, bytes: u64) {
        self.counters.bytes_served.fetch_add(bytes, Ordering::Relaxed);
        metrics::counter!(m::BYTES_SERVED).increment(bytes);
    }

    async fn read_bytes(
        &self,
        req: &ReadBlockRequest,
        key: &BlockKey,
        mount: &WorkerMount,
        rel: &str,
        block_len: u64,
    ) -> Result<(Bytes, Source), ServeError> {
        let (bytes, source) =
            self.block(req, key, mount, rel, req.block_index * req.block_size, block_len, false).await?;
        let start = req.offset as usize;
        let out = bytes.slice(start..start + req.len as usize);
        self.served(out.len() as u64);
        Ok((out, source))
    }

    /// Makes sure a whole block is cached (a warmup task): `Ok(true)` when a tier already held
    /// it, `Ok(false)` when it was fetched from the UFS now. Shares the single flight with
    /// client reads, so a block a client is fetching at the same moment is fetched once.
    pub async fn load(&self, req: &ReadBlockRequest) -> Result<LoadOutcome, ServeError> {
        let (key, mount, rel, block_len) = self.locate(req).await?;
        if self.memory.contains(&key) || self.nvme.contains(&key) {
            return Ok(LoadOutcome { already_cached: true, bytes: block_len });
        }
        let (_, source) =
            self.block(req, &key, &mount, &rel, req.block_index * req.block_size, block_len, true).await?;
        Ok(LoadOutcome { already_cached: !matches!(source, Source::Ufs), bytes: block_len })
    }

    /// A Strata path normalized and resolved to its mount (asking the master for the mount
    /// table once when no known mount holds it) and the path under the mount.
    pub(crate) async fn resolve_path(
        &self,
        raw: &str,
    ) -> Result<(String, Arc<WorkerMount>, String), ServeError> {
        let p = path::normalize(raw).map_err(|e| ServeError::InvalidArgument(e.to_string()))?;
        let (mount, rel) = match self.resolve(&p) {
            Some(found) => found,
            None => {
                self.refresh_mounts().await;
                self.resolve(&p).ok_or_else(|| ServeError::NoMount(p.clone()))?
            }
        };
        Ok((p, mount, rel))
    }

    /// Checks a request against the mount table and names its block: (key, mount, path
    /// relative to the mount, length of the whole block).
    async fn locate(
        &self,
        req: &ReadBlockRequest,
    ) -> Result<(BlockKey, Arc<WorkerMount>, String, u64), ServeError> {
        let (p, mount, rel) = self.resolve_path(&req.path).await?;
        if rel.is_empty() {
            return Err(ServeError::InvalidArgument(format!("{p} is a mount point, not a file")));
        }
        if req.block_size != mount.block_size {
            return Err(ServeError::InvalidArgument(format!(
                "block size {} does not match the mount's {} (stale client mount table?)",
                req.block_size, mount.block_size
            )));
        }
        if req.version.is_empty() {
            return Err(ServeError::InvalidArgument("empty version".into()));
        }
        let block_len = block::block_len(req.file_size, req.block_size, req.block_index);
        if block_len == 0 {
            return Err(ServeError::InvalidArgument(format!(
                "block {} is past the end of a {}-byte file",
                req.block_index, req.file_size
            )));
        }
        let key = BlockKey::new(
            block::file_identity(&mount.uri, &rel, mount.block_size),
            req.version.clone(),
            req.block_index,
        );
        Ok((key, mount, rel, block_len))
    }

    /// A whole block from a tier or, on a miss, fetched once however many ask at the same
    /// time. `write_through` (warmup loads) puts a fetched block on NVMe at once instead of
    /// when DRAM evicts it or reads go quiet.
    #[allow(clippy::too_many_arguments)]
    async fn block(
        &self,
        req: &ReadBlockRequest,
        key: &BlockKey,
        mount: &WorkerMount,
        rel: &str,
        start: u64,
        len: u64,
        write_through: bool,
    ) -> Result<(Bytes, Source), ServeError> {
        if let Some(b) = self.lookup_tiers(key).await {
            return Ok(b);
        }
        self.counters.misses.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(m::CACHE_MISSES).increment(1);
        let cell = {
            let mut inflight = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
            inflight.entry(key.clone()).or_default().clone()
        };
        let result = cell
            .get_or_try_init(|| async {
                // A flight that just finished may have filled DRAM after our first look.
                if let Ok(Some(b)) = self.memory.get(key).await {
                    return Ok(b);
                }
                self.fetch(req, key, mount, rel, start, len, write_through).await
            })
            .await
            .cloned();
        {
            let mut inflight = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
            if inflight.get(key).is_some_and(|c| Arc::ptr_eq(c, &cell) && c.initialized()) {
                inflight.remove(key);
            }
        }
        result.map(|b| (b, Source::Ufs))
    }

    async fn lookup_tiers(&self, key: &BlockKey) -> Option<(Bytes, Source)> {
        match self.memory.get(key).await {
            Ok(Some(b)) => {
                self.hit(TierKind::Memory);
                return Some((b, Source::Memory));
            }
            Ok(None) => {}
            Err(e) => warn!(block = %key, tier = "memory", err = %e, "tier read failed"),
        }
        match self.nvme.get(key).await {
            Ok(Some(b)) => {
                self.hit(TierKind::Nvme);
                if let Err(e) = self.memory.put(key, b.clone()).await {
                    debug!(block = %key, tier = "memory", err = %e, "promotion skipped");
                }
                self.persist_evicted().await;
                Some((b, Source::Nvme))
            }
            Ok(None) => None,
            Err(e) => {
                warn!(block = %key, tier = "nvme", err = %e, "tier read failed");
                None
            }
        }
    }

    fn hit(&self, tier: TierKind) {
        self.counters.hits.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(m::CACHE_HITS, "tier" => tier.label()).increment(1);
    }

    #[allow(clippy::too_many_arguments)]
    async fn fetch(
        &self,
        req: &ReadBlockRequest,
        key: &BlockKey,
        mount: &WorkerMount,
        rel: &str,
        start: u64,
        len: u64,
        write_through: bool,
    ) -> Result<Bytes, ServeError> {
        if let Some(upstream) = self.upstream.get() {
            let read = UpstreamRead {
                path: &req.path,
                file_id: &key.file,
                version: &key.version,
                file_size: req.file_size,
                block_size: req.block_size,
                index: key.index,
                len,
            };
            match upstream.read_block(read).await {
                Ok(bytes) if bytes.len() as u64 == len => {
                    self.counters.upstream_reads.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!(m::UPSTREAM_READS).increment(1);
                    metrics::counter!(m::UPSTREAM_BYTES).increment(len);
                    self.keep(key, &bytes, write_through).await;
                    return Ok(bytes);
                }
                Ok(bytes) => {
                    metrics::counter!(m::UPSTREAM_ERRORS).increment(1);
                    warn!(block = %key, got = bytes.len(), want = len, "upstream sent a block of the wrong length; reading the UFS");
                }
                Err(e) => {
                    metrics::counter!(m::UPSTREAM_ERRORS).increment(1);
                    debug!(block = %key, err = %e, "upstream failed; reading the UFS");
                }
            }
        }
        let read = mount.ufs.read_range(rel, start..start + len, &key.version);
        let bytes = match tokio::time::timeout(self.ufs_timeout, read).await {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => {
                metrics::counter!(m::UFS_ERRORS, "kind" => e.kind().as_str()).increment(1);
                return Err(e.into());
            }
            Err(_) => {
                metrics::counter!(m::UFS_ERRORS, "kind" => "timeout").increment(1);
                return Err(ServeError::UfsTimeout(rel.to_string()));
            }
        };
        self.counters.ufs_reads.fetch_add(1, Ordering::Relaxed);
        self.counters.ufs_bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        metrics::counter!(m::UFS_READS).increment(1);
        metrics::counter!(m::UFS_BYTES).increment(bytes.len() as u64);
        self.keep(key, &bytes, write_through).await;
        Ok(bytes)
    }

    /// Caches a fetched block in DRAM and, for NVMe, either queues its write now
    /// (`write_through`, or write-back off, or no room in DRAM) or marks it dirty: it is then
    /// written when DRAM evicts it, when client reads have been quiet for
    /// `writeback_idle`, or at [`flush`](Self::flush) (shutdown). A cold read thus does not
    /// share the disk and the CPU with NVMe writes of the blocks it is reading; what a crash
    /// loses is DRAM-only copies, which the UFS still has.
    async fn keep(&self, key: &BlockKey, bytes: &Bytes, write_through: bool) {
        let write_back = !write_through
            && self.writeback_idle_ms.load(Ordering::Relaxed) > 0
            && self.nvme.usage().capacity_bytes > 0;
        // Dirty before it is in DRAM: an eviction right after the put must see it dirty.
        if write_back {
            lock(&self.writeback.dirty).insert(key.clone());
        }
        let in_memory = match self.memory.put(key, bytes.clone()).await {
            Ok(()) => true,
            Err(e) => {
                debug!(block = %key, tier = "memory", err = %e, "not cached in memory");
                false
            }
        };
        if !write_back || !in_memory {
            if write_back {
                lock(&self.writeback.dirty).remove(key);
            }
            self.write_nvme(key.clone(), bytes.clone()).await;
        }
        self.persist_evicted().await;
    }

    /// Queues the NVMe writes of dirty blocks DRAM has evicted (waiting for budget: a slow
    /// disk slows the misses that evict).
    async fn persist_evicted(&self) {
        let evicted = std::mem::take(&mut *lock(&self.writeback.evicted));
        for (key, bytes) in evicted {
            self.write_nvme(key, bytes).await;
        }
    }

    /// Queues the NVMe writes of up to `limit` dirty blocks still in DRAM; how many it took.
    async fn persist_dirty(&self, limit: usize) -> usize {
        let keys: Vec<BlockKey> = {
            let mut dirty = lock(&self.writeback.dirty);
            let keys: Vec<BlockKey> = dirty.iter().take(limit).cloned().collect();
            for key in &keys {
                dirty.remove(key);
            }
            keys
        };
        for key in &keys {
            // Gone from DRAM meanwhile (evicted while not dirty, or removed): nothing to keep.
            if let Some(bytes) = self.memory.peek(key) {
                self.write_nvme(key.clone(), bytes).await;
            }
        }
        keys.len()
    }

    /// Writes one dirty DRAM block to NVMe and waits until it is written; `false` when none is
    /// left. One at a time, so a read that starts meanwhile shares the machine with at most one
    /// block write (queuing many at once stalled reads for seconds on two cores).
    async fn write_back_one(&self) -> bool {
        let key = {
            let mut dirty = lock(&self.writeback.dirty);
            let Some(key) = dirty.iter().next().cloned() else {
                return false;
            };
            dirty.remove(&key);
            key
        };
        if let Some(bytes) = self.memory.peek(&key)
            && let Err(e) = self.nvme.put(&key, bytes).await
        {
            debug!(block = %key, tier = "nvme", err = %e, "not written back to nvme");
        }
        true
    }

    /// Writes dirty DRAM blocks to NVMe whenever client reads have been quiet for the
    /// write-back idle time, until `cancel`.
    pub async fn run_writeback(&self, cancel: tokio_util::sync::CancellationToken) {
        loop {
            let idle = Duration::from_millis(self.writeback_idle_ms.load(Ordering::Relaxed));
            let wait = if idle.is_zero() { DEFAULT_WRITEBACK_IDLE } else { idle / 4 };
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
            while !cancel.is_cancelled() && self.qos.quiet_for() >= idle && self.write_back_one().await {}
        }
    }

    /// Queues an NVMe write, waiting for budget when too many bytes are already queued: a
    /// slow disk slows misses down instead of silently losing blocks.
    async fn write_nvme(&self, key: BlockKey, bytes: Bytes) {
        let units = (bytes.len() as u64 / BUDGET_UNIT + 1).min(self.nvme_budget_units as u64) as u32;
        let Ok(permit) = self.nvme_budget.clone().acquire_many_owned(units).await else {
            return;
        };
        let nvme = self.nvme.clone();
        tokio::spawn(async move {
            if let Err(e) = nvme.put(&key, bytes).await {
                debug!(block = %key, tier = "nvme", err = %e, "not cached on nvme");
            }
            drop(permit);
        });
    }

    /// Writes every dirty DRAM block to NVMe and waits until every queued NVMe write has
    /// finished (shutdown, tests).
    pub async fn flush(&self) {
        self.persist_evicted().await;
        while self.persist_dirty(usize::MAX).await > 0 {}
        self.nvme_writes_settled().await;
    }

    /// Waits until the NVMe writes queued so far have finished, without writing dirty blocks.
    pub async fn nvme_writes_settled(&self) {
        if let Ok(all) = self.nvme_budget.acquire_many(self.nvme_budget_units).await {
            drop(all);
        }
    }

    /// What the DRAM and NVMe tiers hold now.
    pub fn tier_usage(&self) -> (crate::tier::TierUsage, crate::tier::TierUsage) {
        (self.memory.usage(), self.nvme.usage())
    }

    /// Blocks held in DRAM only, waiting for write-back to NVMe.
    pub fn dirty_blocks(&self) -> usize {
        lock(&self.writeback.dirty).len()
    }

    pub fn counters(&self) -> WorkerCounters {
        let c = &self.counters;
        WorkerCounters {
            cache_hits: c.hits.load(Ordering::Relaxed),
            cache_misses: c.misses.load(Ordering::Relaxed),
            ufs_reads: c.ufs_reads.load(Ordering::Relaxed),
            ufs_bytes_read: c.ufs_bytes.load(Ordering::Relaxed),
            bytes_served: c.bytes_served.load(Ordering::Relaxed),
            corrupt_blocks: self.memory.corrupt_blocks() + self.nvme.corrupt_blocks(),
        }
    }
}
