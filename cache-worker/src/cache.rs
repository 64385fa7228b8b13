//! The block cache: a DRAM tier over an NVMe tier, with NVMe write-back and a byte budget on
//! NVMe writes. It knows blocks by [`BlockKey`] only — no mounts, no UFS, no transport.
//!
//! Invariants:
//! - a lookup returns only what a tier returns, and tiers never return bytes that differ from
//!   what was stored under the key (see `tier`); a tier failure is a miss, never a failed read;
//! - a block kept with [`Durability::WriteBack`] is in DRAM and marked dirty *before* DRAM can
//!   evict it, so every dirty block reaches NVMe: when DRAM evicts it, when client reads have
//!   been quiet for the write-back idle time ([`BlockCache::run_writeback`]), or at
//!   [`BlockCache::flush`] (shutdown). What a crash loses is DRAM-only copies, which the UFS
//!   still has;
//! - NVMe writes wait for the byte budget instead of being dropped: a slow disk slows the
//!   misses that fill it down, it does not silently lose blocks;
//! - an NVMe block is promoted into DRAM on its second NVMe hit, not its first (see
//!   [`PROMOTE_AT_NVME_HITS`]): a one-pass read of NVMe blocks is served from NVMe and evicts
//!   nothing from DRAM;
//! - a block is kept with the [`PutParams`] it was fetched with (a small file's block is
//!   `packed`) wherever it goes to NVMe: at once, when DRAM evicts it, or by the write-back
//!   writer, which writes packed blocks in batches ([`WRITEBACK_BATCH_BYTES`]) so one append
//!   carries many small files.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use strata_common::BlockKey;
use strata_common::background::sleep_or_cancel;
use strata_common::frame::Source;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::metrics_defs as m;
use crate::qos::Qos;
use crate::stats::Counters;
use crate::tier::{BlockPut, PutParams, Tier, TierError, TierKind, TierUsage};

/// Default of `WorkerConfig::nvme_writeback_idle_ms`.
pub const DEFAULT_WRITEBACK_IDLE: Duration = Duration::from_millis(1000);
/// NVMe write budget is counted in KiB so a u32 of permits covers terabytes.
const BUDGET_UNIT: u64 = 1024;
/// The NVMe tier's hit count ([`Tier::hits`], just bumped by the `get` that found the block)
/// at which a lookup promotes the block into DRAM: its second hit since it was stored on NVMe,
/// less one per pass of the NVMe tier's main queue over it — the recent window. Reusing the
/// tier's S3-FIFO count costs no second map; a tier that does not count (0) never promotes.
pub const PROMOTE_AT_NVME_HITS: u8 = 2;
/// Bytes of packed (small-file) blocks the write-back writer hands the NVMe tier in one batch:
/// one container append for all of them, still short enough not to hold a read up.
pub const WRITEBACK_BATCH_BYTES: u64 = 4 << 20;
/// Blocks in one such batch at most.
const WRITEBACK_BATCH_BLOCKS: usize = 256;

/// When a block kept in the cache must be on NVMe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// In DRAM now, on NVMe when DRAM evicts it or reads go quiet (blocks fetched for reads).
    WriteBack,
    /// Queued for NVMe now (warmup: a block reported loaded is on NVMe).
    WriteThrough,
    /// In DRAM only; the caller writes it to NVMe itself (a warmup batch of small files
    /// settles all its blocks in one packed append, [`BlockCache::settle_many_on_nvme`]).
    ByCaller,
}

/// A queued NVMe write of one block: it has ended (written, or failed and logged) when this
/// task has.
pub type NvmeWrite = tokio::task::JoinHandle<()>;

/// A verified NVMe block's file, for serving without copying through memory: `len` bytes of
/// data at `data_offset`.
#[derive(Debug)]
pub struct FileRegion {
    pub file: std::fs::File,
    pub data_offset: u64,
    pub len: u64,
}

#[derive(Debug, Clone, Copy)]
pub struct CacheConfig {
    /// Bytes of NVMe writes queued at most before a miss waits.
    pub nvme_write_budget: u64,
    /// Quiet time before dirty DRAM blocks go to NVMe; zero writes through at once.
    pub writeback_idle: Duration,
    /// Serve verified NVMe blocks as file regions.
    pub zero_copy: bool,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self { nvme_write_budget: 256 << 20, writeback_idle: DEFAULT_WRITEBACK_IDLE, zero_copy: true }
    }
}

pub struct BlockCache {
    memory: Arc<dyn Tier>,
    nvme: Arc<dyn Tier>,
    nvme_budget: Arc<Semaphore>,
    nvme_budget_units: u32,
    writeback: Arc<Writeback>,
    /// Quiet time (ms) before write-back; zero is write-through.
    writeback_idle_ms: AtomicU64,
    zero_copy: AtomicBool,
    counters: Arc<Counters>,
}

#[derive(Default)]
struct Writeback {
    /// Blocks in DRAM only, with how they are to be kept on NVMe.
    dirty: Mutex<HashMap<BlockKey, PutParams>>,
    evicted: Mutex<Vec<BlockPut>>,
}

impl Writeback {
    /// The DRAM tier's eviction sink: a dirty block leaving DRAM must reach NVMe.
    fn on_evict(&self, key: &BlockKey, bytes: &Bytes) {
        if let Some(params) = lock(&self.dirty).remove(key) {
            lock(&self.evicted).push(BlockPut { key: key.clone(), data: bytes.clone(), params });
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl BlockCache {
    /// A cache of `memory` bytes of DRAM and no NVMe, default settings, with its counters: for
    /// tests of what sits above the cache.
    #[cfg(test)]
    pub(crate) fn dram_only(memory: u64) -> (Arc<Self>, Arc<Counters>) {
        let counters = Arc::new(Counters::default());
        let cache = Self::new(
            Arc::new(crate::tier::MemoryTier::new(memory)),
            Arc::new(crate::tier::MemoryTier::new(0)),
            CacheConfig::default(),
            counters.clone(),
        );
        (Arc::new(cache), counters)
    }

    pub fn new(
        memory: Arc<dyn Tier>,
        nvme: Arc<dyn Tier>,
        config: CacheConfig,
        counters: Arc<Counters>,
    ) -> Self {
        let units = (config.nvme_write_budget / BUDGET_UNIT).clamp(1, u32::MAX as u64 / 2) as u32;
        let writeback = Arc::new(Writeback::default());
        let sink = Arc::clone(&writeback);
        let can_write_back = memory.set_eviction_sink(Box::new(move |key, bytes| sink.on_evict(key, bytes)));
        // Without an eviction sink a dirty block could leave DRAM unseen: write through then.
        let idle = if can_write_back { config.writeback_idle } else { Duration::ZERO };
        Self {
            memory,
            nvme,
            nvme_budget: Arc::new(Semaphore::new(units as usize)),
            nvme_budget_units: units,
            writeback,
            writeback_idle_ms: AtomicU64::new(idle.as_millis() as u64),
            zero_copy: AtomicBool::new(config.zero_copy),
            counters,
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

    /// The tiers, top first (for block reports).
    pub fn tiers(&self) -> [&Arc<dyn Tier>; 2] {
        [&self.memory, &self.nvme]
    }

    pub fn contains(&self, key: &BlockKey) -> bool {
        self.memory.contains(key) || self.nvme.contains(key)
    }

    /// Every block held, once (a block in both tiers is listed with its DRAM copy's size).
    pub fn held_blocks(&self) -> Vec<(BlockKey, u64)> {
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for tier in [&self.memory, &self.nvme] {
            for (key, size) in tier.keys() {
                if seen.insert(key.clone()) {
                    out.push((key, size));
                }
            }
        }
        out
    }

    /// A block's bytes for handing it off: DRAM without counting a hit, else NVMe. A hand-off
    /// is not a read of the block, so it must not make the block look hot here.
    pub async fn handoff_copy(&self, key: &BlockKey) -> Option<Bytes> {
        if let Some(b) = self.memory.peek(key) {
            return Some(b);
        }
        self.nvme.get(key).await.ok().flatten()
    }

    /// Keeps a block handed off by its previous owner: on NVMe (it is not being read now, so
    /// it takes no DRAM from blocks that are), in DRAM when there is no NVMe tier or `in_memory`
    /// (a block pinned in DRAM) asks for it as well.
    pub async fn store_handed_off(
        &self,
        key: &BlockKey,
        bytes: Bytes,
        in_memory: bool,
        params: PutParams,
    ) -> Result<(), TierError> {
        let on_nvme = self.nvme.usage().capacity_bytes > 0;
        if in_memory || !on_nvme {
            self.memory.put(key, bytes.clone()).await?;
            // The DRAM tier may have evicted dirty blocks to make room: they must reach NVMe.
            self.persist_evicted().await;
        }
        if on_nvme { self.nvme.put_with(key, bytes, params).await } else { Ok(()) }
    }

    /// The whole block from DRAM, without touching NVMe.
    pub async fn memory_get(&self, key: &BlockKey) -> Option<Bytes> {
        self.memory.get(key).await.ok().flatten()
    }

    /// A block that is on NVMe only and whose checksum is verified, as its file (zero copy).
    /// `None` when zero copy is off, the block is in DRAM (serve that), or it is not verified.
    pub fn open_verified(&self, key: &BlockKey, block_len: u64) -> Option<FileRegion> {
        if self.memory.contains(key) {
            return None;
        }
        self.open_verified_file(key, block_len)
    }

    /// [`open_verified`](Self::open_verified), also when the block is in DRAM as well: a
    /// descriptor grant of the file costs no copy, where one of the DRAM block costs a copy.
    pub fn open_verified_file(&self, key: &BlockKey, block_len: u64) -> Option<FileRegion> {
        if !self.zero_copy.load(Ordering::Relaxed) {
            return None;
        }
        let span = self.nvme.open_verified(key)?;
        if span.len != block_len {
            return None;
        }
        self.hit(TierKind::Nvme);
        Some(FileRegion { file: span.file, data_offset: span.offset, len: span.len })
    }

    /// The whole block from a tier: DRAM, else NVMe (promoted to DRAM from its second hit).
    pub async fn lookup(&self, key: &BlockKey) -> Option<(Bytes, Source)> {
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
                if self.nvme.hits(key) >= PROMOTE_AT_NVME_HITS {
                    if let Err(e) = self.memory.put(key, b.clone()).await {
                        debug!(block = %key, tier = "memory", err = %e, "promotion skipped");
                    }
                    self.persist_evicted().await;
                }
                Some((b, Source::Nvme))
            }
            Ok(None) => None,
            Err(e) => {
                warn!(block = %key, tier = "nvme", err = %e, "tier read failed");
                None
            }
        }
    }

    /// Bytes `range` of a cached block: a slice of the DRAM copy, or from NVMe only what the
    /// range needs (a block not yet verified is checked 64 KiB chunk by chunk, not whole). A
    /// block hit often enough to be promoted is read whole then, as [`lookup`](Self::lookup)
    /// does.
    pub async fn lookup_range(&self, key: &BlockKey, range: std::ops::Range<u64>) -> Option<(Bytes, Source)> {
        let (start, end) = (range.start as usize, range.end as usize);
        match self.memory.get(key).await {
            Ok(Some(b)) => {
                self.hit(TierKind::Memory);
                return Some((b.slice(start..end), Source::Memory));
            }
            Ok(None) => {}
            Err(e) => warn!(block = %key, tier = "memory", err = %e, "tier read failed"),
        }
        if self.nvme.hits(key).saturating_add(1) >= PROMOTE_AT_NVME_HITS {
            return self.lookup(key).await.map(|(b, source)| (b.slice(start..end), source));
        }
        match self.nvme.get_range(key, range).await {
            Ok(Some(b)) => {
                self.hit(TierKind::Nvme);
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

    /// Caches a fetched block in DRAM and, for NVMe, either queues its write now
    /// (`WriteThrough`, or write-back off, or no room in DRAM) or marks it dirty.
    ///
    /// Returns the NVMe write when DRAM did not take the block (no DRAM tier, or a block larger
    /// than it): until that write ends no tier holds the block, so whoever must find it again
    /// (the fetcher's single flight) waits for it.
    pub async fn keep(
        &self,
        key: &BlockKey,
        bytes: &Bytes,
        durability: Durability,
        params: PutParams,
    ) -> Option<NvmeWrite> {
        let write_back = durability == Durability::WriteBack
            && self.writeback_idle_ms.load(Ordering::Relaxed) > 0
            && self.nvme.usage().capacity_bytes > 0;
        // Dirty before it is in DRAM: an eviction right after the put must see it dirty.
        if write_back {
            lock(&self.writeback.dirty).insert(key.clone(), params);
        }
        let in_memory = match self.memory.put(key, bytes.clone()).await {
            Ok(()) => true,
            Err(e) => {
                debug!(block = %key, tier = "memory", err = %e, "not cached in memory");
                false
            }
        };
        let mut only_write = None;
        if durability == Durability::ByCaller {
            self.persist_evicted().await;
            return None;
        }
        if !write_back || !in_memory {
            if write_back {
                lock(&self.writeback.dirty).remove(key);
            }
            let write =
                self.write_nvme(vec![BlockPut { key: key.clone(), data: bytes.clone(), params }]).await;
            if !in_memory {
                only_write = write;
            }
        }
        self.persist_evicted().await;
        only_write
    }

    /// Queues the NVMe writes of dirty blocks DRAM has evicted (waiting for budget): the
    /// packed ones as batches, the others one by one.
    async fn persist_evicted(&self) {
        let evicted = std::mem::take(&mut *lock(&self.writeback.evicted));
        for batch in batches(evicted) {
            self.write_nvme(batch).await;
        }
    }

    /// Queues the NVMe writes of up to `limit` dirty blocks still in DRAM; how many it took.
    async fn persist_dirty(&self, limit: usize) -> usize {
        let keys: Vec<(BlockKey, PutParams)> = {
            let mut dirty = lock(&self.writeback.dirty);
            let keys: Vec<(BlockKey, PutParams)> =
                dirty.iter().take(limit).map(|(k, p)| (k.clone(), *p)).collect();
            for (key, _) in &keys {
                dirty.remove(key);
            }
            keys
        };
        let taken = keys.len();
        // Gone from DRAM meanwhile (evicted while not dirty, or removed): nothing to keep.
        let blocks = keys
            .into_iter()
            .filter_map(|(key, params)| Some(BlockPut { data: self.memory.peek(&key)?, key, params }))
            .collect();
        for batch in batches(blocks) {
            self.write_nvme(batch).await;
        }
        taken
    }

    /// Writes one dirty DRAM block to NVMe — or, for a packed one, a batch of packed ones (up
    /// to [`WRITEBACK_BATCH_BYTES`]) in one append — and waits until it is written; `false` when
    /// none is left. A little at a time, so a read that starts meanwhile shares the machine with
    /// at most one write (queuing many at once stalled reads for seconds on two cores).
    async fn write_back_one(&self) -> bool {
        let taken: Vec<(BlockKey, PutParams)> = {
            let mut dirty = lock(&self.writeback.dirty);
            let Some((first, params)) = dirty.iter().next().map(|(k, p)| (k.clone(), *p)) else {
                return false;
            };
            let mut taken = vec![(first, params)];
            if params.packed {
                let mut bytes = 0u64;
                for (key, p) in dirty.iter() {
                    if taken.len() >= WRITEBACK_BATCH_BLOCKS || bytes >= WRITEBACK_BATCH_BYTES {
                        break;
                    }
                    if p.packed && *key != taken[0].0 {
                        bytes += self.memory.peek(key).map_or(0, |b| b.len() as u64);
                        taken.push((key.clone(), *p));
                    }
                }
            }
            for (key, _) in &taken {
                dirty.remove(key);
            }
            taken
        };
        let blocks: Vec<BlockPut> = taken
            .into_iter()
            .filter_map(|(key, params)| Some(BlockPut { data: self.memory.peek(&key)?, key, params }))
            .collect();
        let keys: Vec<BlockKey> = blocks.iter().map(|b| b.key.clone()).collect();
        for (key, result) in keys.iter().zip(self.nvme.put_many(blocks).await) {
            if let Err(e) = result {
                debug!(block = %key, tier = "nvme", err = %e, "not written back to nvme");
            }
        }
        true
    }

    /// The write-back writer: writes dirty DRAM blocks to NVMe whenever client reads (`qos`)
    /// have been quiet for the write-back idle time, until `cancel`.
    pub async fn run_writeback(&self, qos: &Qos, cancel: CancellationToken) {
        loop {
            let idle = Duration::from_millis(self.writeback_idle_ms.load(Ordering::Relaxed));
            let wait = if idle.is_zero() { DEFAULT_WRITEBACK_IDLE } else { idle / 4 };
            if sleep_or_cancel(wait, &cancel).await {
                return;
            }
            while !cancel.is_cancelled() && qos.quiet_for() >= idle && self.write_back_one().await {}
        }
    }

    /// Queues an NVMe write of one block or one batch of packed blocks, waiting for budget
    /// when too many bytes are already queued; the write itself runs on its own task, returned.
    async fn write_nvme(&self, blocks: Vec<BlockPut>) -> Option<NvmeWrite> {
        let bytes: u64 = blocks.iter().map(|b| b.data.len() as u64).sum();
        let units = (bytes / BUDGET_UNIT + 1).min(self.nvme_budget_units as u64) as u32;
        let Ok(permit) = self.nvme_budget.clone().acquire_many_owned(units).await else {
            return None;
        };
        let nvme = self.nvme.clone();
        Some(tokio::spawn(async move {
            let keys: Vec<BlockKey> = blocks.iter().map(|b| b.key.clone()).collect();
            for (key, result) in keys.iter().zip(nvme.put_many(blocks).await) {
                if let Err(e) = result {
                    debug!(block = %key, tier = "nvme", err = %e, "not cached on nvme");
                }
            }
            drop(permit);
        }))
    }

    /// Moves the blocks `selected` picks that this cache holds into `tier` (a pin just learnt,
    /// see `pins`), and returns once they are there: to NVMe, the dirty DRAM copies are written
    /// now (the DRAM copy stays) rather than when DRAM evicts them or reads go quiet; to DRAM,
    /// blocks on NVMe only are read in (until DRAM has no room left for them). A block that
    /// cannot move stays where it is and is logged. Returns how many moved.
    pub async fn gather_pinned(&self, tier: TierKind, selected: impl Fn(&BlockKey) -> bool) -> usize {
        match tier {
            TierKind::Nvme => {
                if self.nvme.usage().capacity_bytes == 0 {
                    return 0;
                }
                let taken: Vec<(BlockKey, PutParams)> = {
                    let mut dirty = lock(&self.writeback.dirty);
                    let keys: Vec<(BlockKey, PutParams)> =
                        dirty.iter().filter(|(k, _)| selected(k)).map(|(k, p)| (k.clone(), *p)).collect();
                    for (key, _) in &keys {
                        dirty.remove(key);
                    }
                    keys
                };
                let blocks: Vec<BlockPut> = taken
                    .into_iter()
                    .filter_map(|(key, params)| Some(BlockPut { data: self.memory.peek(&key)?, key, params }))
                    .collect();
                let moved = blocks.len();
                for batch in batches(blocks) {
                    if let Some(write) = self.write_nvme(batch).await {
                        let _ = write.await;
                    }
                }
                moved
            }
            TierKind::Memory => {
                let mut moved = 0;
                for (key, _) in self.nvme.keys() {
                    if !selected(&key) || self.memory.contains(&key) {
                        continue;
                    }
                    let bytes = match self.nvme.get(&key).await {
                        Ok(Some(b)) => b,
                        Ok(None) => continue,
                        Err(e) => {
                            warn!(block = %key, tier = "nvme", err = %e, "cannot read a pinned block to move it");
                            continue;
                        }
                    };
                    match self.memory.put(&key, bytes).await {
                        Ok(()) => moved += 1,
                        Err(e) => {
                            warn!(block = %key, tier = "memory", err = %e, "a pinned block stays on NVMe");
                            break;
                        }
                    }
                    self.persist_evicted().await;
                }
                moved
            }
        }
    }

    /// Makes sure a block is on NVMe when this worker has an NVMe tier, writing it from `bytes`
    /// (or from DRAM) and waiting for the write, so a warmup load is reported done only once
    /// its block is in the capacity tier. A write already in flight for it is waited for, and a
    /// full disk is evicted from and retried once by the tier itself.
    pub async fn settle_on_nvme(
        &self,
        key: &BlockKey,
        bytes: Option<Bytes>,
        params: PutParams,
    ) -> Result<(), TierError> {
        if self.nvme.usage().capacity_bytes == 0 || self.nvme.contains(key) {
            return Ok(());
        }
        match bytes.or_else(|| self.memory.peek(key)) {
            Some(bytes) => self.nvme.put_with(key, bytes, params).await,
            // Neither tier has it any more (evicted from DRAM meanwhile): the tier's put of it
            // may still be settling, so ask once more before saying it is not there.
            None => match self.nvme.get(key).await? {
                Some(_) => Ok(()),
                None => {
                    Err(TierError::Io(std::io::Error::other("the block left DRAM before it reached NVMe")))
                }
            },
        }
    }

    /// [`settle_on_nvme`](Self::settle_on_nvme) for many blocks at once (a warmup batch of small
    /// files): the ones not on NVMe yet go to the tier in one `put_many`, so packed ones cost
    /// one append. One result per block, in order.
    pub async fn settle_many_on_nvme(
        &self,
        blocks: Vec<(BlockKey, Option<Bytes>, PutParams)>,
    ) -> Vec<Result<(), TierError>> {
        if self.nvme.usage().capacity_bytes == 0 {
            return blocks.iter().map(|_| Ok(())).collect();
        }
        let mut results: Vec<Option<Result<(), TierError>>> = Vec::with_capacity(blocks.len());
        let mut puts = Vec::new();
        let mut put_at = Vec::new();
        let mut missing = Vec::new();
        for (i, (key, bytes, params)) in blocks.into_iter().enumerate() {
            if self.nvme.contains(&key) {
                results.push(Some(Ok(())));
                continue;
            }
            results.push(None);
            match bytes.or_else(|| self.memory.peek(&key)) {
                Some(data) => {
                    put_at.push(i);
                    puts.push(BlockPut { key, data, params });
                }
                None => missing.push((i, key, params)),
            }
        }
        for (i, result) in put_at.into_iter().zip(self.nvme.put_many(puts).await) {
            results[i] = Some(result);
        }
        for (i, key, params) in missing {
            results[i] = Some(self.settle_on_nvme(&key, None, params).await);
        }
        results.into_iter().map(|r| r.unwrap_or(Ok(()))).collect()
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
    pub fn tier_usage(&self) -> (TierUsage, TierUsage) {
        (self.memory.usage(), self.nvme.usage())
    }

    /// Blocks held in DRAM only, waiting for write-back to NVMe.
    pub fn dirty_blocks(&self) -> usize {
        lock(&self.writeback.dirty).len()
    }

    /// Corrupt blocks both tiers detected (and dropped) since start.
    pub fn corrupt_blocks(&self) -> u64 {
        self.memory.corrupt_blocks() + self.nvme.corrupt_blocks()
    }
}

/// Blocks grouped for NVMe writes: packed ones in batches of up to [`WRITEBACK_BATCH_BYTES`]
/// and [`WRITEBACK_BATCH_BLOCKS`], every other one alone.
fn batches(blocks: Vec<BlockPut>) -> Vec<Vec<BlockPut>> {
    let mut out = Vec::new();
    let mut packed: Vec<BlockPut> = Vec::new();
    let mut packed_bytes = 0u64;
    for b in blocks {
        if !b.params.packed {
            out.push(vec![b]);
            continue;
        }
        packed_bytes += b.data.len() as u64;
        packed.push(b);
        if packed_bytes >= WRITEBACK_BATCH_BYTES || packed.len() >= WRITEBACK_BATCH_BLOCKS {
            out.push(std::mem::take(&mut packed));
            packed_bytes = 0;
        }
    }
    if !packed.is_empty() {
        out.push(packed);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::{MemoryTier, NvmeTier};

    fn cache(dir: &std::path::Path, memory_bytes: u64) -> (BlockCache, Arc<dyn Tier>, Arc<dyn Tier>) {
        let memory: Arc<dyn Tier> = Arc::new(MemoryTier::new(memory_bytes));
        let nvme: Arc<dyn Tier> = Arc::new(NvmeTier::open(dir, 1 << 20).unwrap());
        let config = CacheConfig { zero_copy: false, ..CacheConfig::default() };
        let cache = BlockCache::new(memory.clone(), nvme.clone(), config, Arc::new(Counters::default()));
        (cache, memory, nvme)
    }

    fn key(i: u64) -> BlockKey {
        BlockKey::new(format!("s3://bucket/obj{i}"), "v1", i)
    }

    #[tokio::test]
    async fn an_nvme_block_is_promoted_on_its_second_hit_not_its_first() {
        let dir = tempfile::tempdir().unwrap();
        let (cache, memory, nvme) = cache(dir.path(), 1 << 20);
        let data = Bytes::from(vec![7u8; 4096]);
        nvme.put(&key(0), data.clone()).await.unwrap();

        assert_eq!(cache.lookup(&key(0)).await, Some((data.clone(), Source::Nvme)));
        assert!(!memory.contains(&key(0)), "one NVMe hit does not promote");
        assert_eq!(cache.lookup(&key(0)).await, Some((data.clone(), Source::Nvme)));
        assert!(memory.contains(&key(0)), "the second one does");
        assert_eq!(cache.lookup(&key(0)).await, Some((data, Source::Memory)));
        assert_eq!(cache.lookup(&key(1)).await, None);
    }

    #[tokio::test]
    async fn a_one_pass_read_of_nvme_blocks_leaves_dram_alone() {
        let dir = tempfile::tempdir().unwrap();
        let (cache, memory, nvme) = cache(dir.path(), 8192);
        let hot = Bytes::from(vec![1u8; 4096]);
        memory.put(&key(0), hot.clone()).await.unwrap();
        for i in 1..=20 {
            nvme.put(&key(i), Bytes::from(vec![i as u8; 4096])).await.unwrap();
        }
        for i in 1..=20 {
            assert_eq!(cache.lookup(&key(i)).await.unwrap().1, Source::Nvme);
        }
        assert_eq!(memory.usage().blocks, 1);
        assert_eq!(cache.lookup(&key(0)).await, Some((hot, Source::Memory)));
    }
}
