//! Prefetch hints: a reader that knows its next files (a training job's sampler) tells the
//! workers that will serve them, so their blocks are fetched before it asks.
//!
//! [`Client::prefetch`] takes a stream's whole window — the next files in the order they will
//! be read — and sends each worker the blocks of that window it is the first owner of, in
//! order. Each message replaces what the stream hinted to that worker before (workers that get
//! nothing of the new window are sent an empty one), so hints the reader has passed are dropped
//! there rather than fetched late. Paths that do not exist (or are directories, or write-back
//! files not uploaded yet) are skipped and counted.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;

use strata_common::frame::{PrefetchHints, ReadBlockRequest};
use strata_common::{BlockKey, block};
use tracing::debug;

use crate::transport::{self, Via};
use crate::{Client, ClientError, Result};

/// Counter: hinted paths skipped because they do not name a file the cluster can prefetch.
pub const METRIC_PREFETCH_UNKNOWN: &str = "strata_client_prefetch_unknown_total";
/// Blocks hinted per file at most: the rest of a large file is the streaming reader's
/// readahead's to fetch.
pub const MAX_HINTED_BLOCKS_PER_FILE: u64 = 4;

/// Workers each stream last sent a window to.
#[derive(Default)]
pub(crate) struct Streams {
    hinted: Mutex<HashMap<u64, HashSet<String>>>,
}

/// What one [`Client::prefetch`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Prefetched {
    /// Blocks the workers queued (those they had fetched for this stream already are not).
    pub queued: u64,
    /// Hinted paths skipped: missing, a directory, not under a mount, or not uploaded yet.
    pub unknown: u64,
    /// Workers the window was sent to.
    pub workers: usize,
}

impl Client {
    /// Tells the workers that `paths`, in this order, are what `stream` reads next (its whole
    /// window: it replaces the stream's previous one). An empty list clears the stream.
    pub async fn prefetch(&self, stream: u64, paths: &[&str]) -> Result<Prefetched> {
        let mut out = Prefetched::default();
        let stats = if paths.is_empty() { Vec::new() } else { self.stat_many(paths).await };
        let ring = self.ring().await?;
        let mut windows: BTreeMap<String, Vec<ReadBlockRequest>> = BTreeMap::new();
        for (raw, stat) in paths.iter().zip(stats) {
            let info = match stat {
                Ok(info) if !info.is_dir && info.holders.is_empty() && info.size > 0 => info,
                Ok(_)
                | Err(
                    ClientError::NotFound(_) | ClientError::IsDirectory(_) | ClientError::InvalidArgument(_),
                ) => {
                    out.unknown += 1;
                    debug!(path = %raw, "prefetch hint for a path that names no readable file; skipped");
                    continue;
                }
                Err(e) => return Err(e),
            };
            let blocks = block::block_count(info.size, info.block_size).min(MAX_HINTED_BLOCKS_PER_FILE);
            for index in 0..blocks {
                let hash = BlockKey::new(info.file_id.clone(), info.version.clone(), index).placement_hash();
                let owners = self.inner.route.ring.in_asking_order(
                    ring.owners(hash, ring.members().len()),
                    self.read_replicas_for(&info.path),
                );
                let Some(first) = owners.first() else { continue };
                let window = windows.entry(first.data_addr.clone()).or_default();
                let req = ReadBlockRequest {
                    req_id: 0,
                    path: info.path.clone(),
                    version: info.version.clone(),
                    file_size: info.size,
                    block_size: info.block_size,
                    block_index: index,
                    offset: 0,
                    len: 0,
                };
                let body: usize = window.iter().map(ReadBlockRequest::body_len).sum();
                // Past a message's limits the window ends: its tail is hinted by the next call.
                if PrefetchHints::fits(window.len(), body, &req) {
                    window.push(req);
                }
            }
        }
        if out.unknown > 0 {
            metrics::counter!(METRIC_PREFETCH_UNKNOWN).increment(out.unknown);
        }
        let previous = {
            let mut streams = self.inner.prefetch.hinted.lock().unwrap_or_else(|p| p.into_inner());
            let now: HashSet<String> = windows.keys().cloned().collect();
            let previous = if now.is_empty() { streams.remove(&stream) } else { streams.insert(stream, now) };
            previous.unwrap_or_default()
        };
        for addr in previous {
            windows.entry(addr).or_default();
        }
        let asks = windows.into_iter().map(|(addr, items)| async move {
            let req_id = 1;
            let frame = PrefetchHints { req_id, stream, items }.encode();
            let answer = transport::ask(
                Via::Tcp,
                &addr,
                &frame,
                req_id,
                64,
                self.dial(),
                self.inner.config.connect_timeout.max(crate::outage::FALLBACK_DEADLINE),
            )
            .await;
            (addr, answer)
        });
        for (addr, answer) in futures::future::join_all(asks).await {
            out.workers += 1;
            match answer {
                Ok(bytes) if bytes.len() == 4 => {
                    out.queued += u64::from(u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes")))
                }
                Ok(bytes) => {
                    debug!(worker = %addr, len = bytes.len(), "a prefetch answer of the wrong length")
                }
                // A hint is advice: a worker that cannot take it costs the reader a cold read.
                Err(e) => debug!(worker = %addr, err = %e, "a worker did not take prefetch hints"),
            }
        }
        Ok(out)
    }
}
