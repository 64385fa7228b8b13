//! Filling the cache: a whole block from a tier or, on a miss, fetched once however many ask at
//! the same moment (single flight per key) — from the upstream when there is one (a sidecar's
//! cluster), else from the UFS — and kept.
//!
//! A flight answers for its block until a tier holds it: a miss that looked in the tiers before
//! the block was kept either joins the flight or, once the flight is over, finds the block in a
//! tier when it looks again — never fetches it a second time. Without a DRAM tier the block is
//! in no tier until its NVMe write ends, so the flight stays open that long.
//!
//! Invariants: a block is kept only after a read of exactly its range at exactly its version
//! succeeded (the UFS refuses a changed object; an upstream answer of the wrong length is
//! dropped), so no half-written or mixed-version block is ever cached. A UFS fetch has one
//! deadline here (`ufs_timeout`, the whole block including the UFS layer's own retries); the
//! per-attempt timeouts inside it belong to the mount's UFS (its `ufs_timeout` and
//! `ufs_io_timeout` options) and only make a stalled attempt retry sooner.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use strata_common::BlockKey;
use strata_common::frame::Source;
use strata_common::upstream::{Upstream, UpstreamRead};
use tokio::sync::OnceCell;
use tracing::{debug, warn};

use crate::cache::{BlockCache, Durability, NvmeWrite};
use crate::error::ServeError;
use crate::metrics_defs as m;
use crate::mounts::WorkerMount;
use crate::stats::Counters;
use crate::tier::PutParams;

/// A block named and placed: what the fetcher needs to get it.
#[derive(Clone)]
pub struct Located {
    pub key: BlockKey,
    /// The normalised Strata path (what an upstream is asked for).
    pub path: String,
    pub mount: Arc<WorkerMount>,
    /// The file's path under the mount (what the UFS is asked for).
    pub rel: String,
    pub file_size: u64,
    /// Length of the whole block.
    pub block_len: u64,
    /// How the block is kept (a small file's is packed on NVMe).
    pub params: PutParams,
}

impl Located {
    /// Byte range of the block in the file.
    fn range(&self) -> std::ops::Range<u64> {
        let start = self.key.index * self.mount.block_size;
        start..start + self.block_len
    }
}

type Flights = Mutex<HashMap<BlockKey, Arc<OnceCell<Bytes>>>>;

pub struct Fetcher {
    cache: Arc<BlockCache>,
    counters: Arc<Counters>,
    inflight: Arc<Flights>,
    upstream: OnceLock<Arc<dyn Upstream>>,
    ufs_deadline: Duration,
}

impl Fetcher {
    pub fn new(cache: Arc<BlockCache>, counters: Arc<Counters>, ufs_deadline: Duration) -> Self {
        Self { cache, counters, inflight: Arc::default(), upstream: OnceLock::new(), ufs_deadline }
    }

    /// Makes misses ask `upstream` before the UFS (sidecar mode). Set once; later calls are
    /// ignored.
    pub fn set_upstream(&self, upstream: Arc<dyn Upstream>) {
        let _ = self.upstream.set(upstream);
    }

    /// The whole block from a tier or, on a miss, fetched once and kept with `durability`.
    pub async fn block(&self, at: &Located, durability: Durability) -> Result<(Bytes, Source), ServeError> {
        if let Some(found) = self.cache.lookup(&at.key).await {
            return Ok(found);
        }
        self.counters.misses.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(m::CACHE_MISSES).increment(1);
        let cell = self
            .inflight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(at.key.clone())
            .or_default()
            .clone();
        // Set when this caller flew the flight: the NVMe write its block waits on, if any.
        let flown: Mutex<Option<Option<NvmeWrite>>> = Mutex::new(None);
        let result = cell
            .get_or_try_init(|| async {
                // A flight that just ended may have left the block in a tier after our first look.
                if let Some((b, _)) = self.cache.lookup(&at.key).await {
                    *flown.lock().unwrap_or_else(|p| p.into_inner()) = Some(None);
                    return Ok(b);
                }
                let (bytes, write) = self.fetch(at, durability).await?;
                *flown.lock().unwrap_or_else(|p| p.into_inner()) = Some(write);
                Ok(bytes)
            })
            .await
            .cloned();
        // The caller that flew it ends the flight, once a tier holds the block. (A failed flight
        // stays: the next miss tries again in it.)
        match flown.into_inner().unwrap_or_else(|p| p.into_inner()) {
            None => {}
            Some(None) => end_flight(&self.inflight, &at.key, &cell),
            Some(Some(write)) => {
                let (inflight, key) = (self.inflight.clone(), at.key.clone());
                tokio::spawn(async move {
                    let _ = write.await;
                    end_flight(&inflight, &key, &cell);
                });
            }
        }
        result.map(|b| (b, Source::Ufs))
    }

    /// The block from the upstream or the UFS, kept; and its NVMe write when no other tier took it.
    async fn fetch(
        &self,
        at: &Located,
        durability: Durability,
    ) -> Result<(Bytes, Option<NvmeWrite>), ServeError> {
        if let Some(bytes) = self.ask_upstream(at).await {
            let write = self.cache.keep(&at.key, &bytes, durability, at.params).await;
            return Ok((bytes, write));
        }
        let read = at.mount.ufs.read_range(&at.rel, at.range(), &at.key.version);
        let bytes = match tokio::time::timeout(self.ufs_deadline, read).await {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => {
                metrics::counter!(m::UFS_ERRORS, "kind" => e.kind().as_str()).increment(1);
                return Err(e.into());
            }
            Err(_) => {
                metrics::counter!(m::UFS_ERRORS, "kind" => "timeout").increment(1);
                return Err(ServeError::UfsTimeout(at.rel.clone()));
            }
        };
        self.counters.ufs_reads.fetch_add(1, Ordering::Relaxed);
        self.counters.ufs_bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        metrics::counter!(m::UFS_READS).increment(1);
        metrics::counter!(m::UFS_BYTES).increment(bytes.len() as u64);
        let write = self.cache.keep(&at.key, &bytes, durability, at.params).await;
        Ok((bytes, write))
    }

    /// The block from the upstream, when there is one and it answers with the whole block.
    async fn ask_upstream(&self, at: &Located) -> Option<Bytes> {
        let upstream = self.upstream.get()?;
        let read = UpstreamRead {
            path: &at.path,
            file_id: &at.key.file,
            version: &at.key.version,
            file_size: at.file_size,
            block_size: at.mount.block_size,
            index: at.key.index,
            len: at.block_len,
        };
        match upstream.read_block(read).await {
            Ok(bytes) if bytes.len() as u64 == at.block_len => {
                self.counters.upstream_reads.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(m::UPSTREAM_READS).increment(1);
                metrics::counter!(m::UPSTREAM_BYTES).increment(at.block_len);
                Some(bytes)
            }
            Ok(bytes) => {
                metrics::counter!(m::UPSTREAM_ERRORS).increment(1);
                warn!(block = %at.key, got = bytes.len(), want = at.block_len, "upstream sent a block of the wrong length; reading the UFS");
                None
            }
            Err(e) => {
                metrics::counter!(m::UPSTREAM_ERRORS).increment(1);
                debug!(block = %at.key, err = %e, "upstream failed; reading the UFS");
                None
            }
        }
    }
}

/// Removes a flight whose block a tier now holds from the map (unless another replaced it).
fn end_flight(inflight: &Flights, key: &BlockKey, cell: &Arc<OnceCell<Bytes>>) {
    let mut flights = inflight.lock().unwrap_or_else(|p| p.into_inner());
    if flights.get(key).is_some_and(|c| Arc::ptr_eq(c, cell)) {
        flights.remove(key);
    }
}
