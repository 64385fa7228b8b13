//! Batched metadata and batched reads: what an epoch over many small files costs.
//!
//! Read one by one, 100,000 small files cost 100,000 stat round trips to the master and
//! 100,000 read round trips to the workers. Here:
//!
//! - [`Client::stat_many`] answers from the client's stat cache first (fed by listings too),
//!   then asks the master for the rest in `StatMany` calls of
//!   [`STAT_MANY_CHUNK`](crate::STAT_MANY_CHUNK) paths, one result per path: a missing path is
//!   that path's error, not the batch's (see `metadata`). While the master is unreachable each
//!   path falls back to [`Client::stat_with`] (stale stats, worker stats).
//! - [`Client::read_many`] groups the ranges that fall in one block by the worker the read
//!   would ask first (placement, read replicas and suspects as for a single read) and sends
//!   each group as `ReadMany` requests of at most [`MAX_READ_MANY_ITEMS`] items and
//!   [`MAX_BATCH_BYTES`], owners in parallel. Whatever a batch does not serve — a worker that
//!   fails or stalls past its hedging deadline (it is then suspect, asked last, as after a
//!   failed read), an item failing in a way another worker may not — is read again through the
//!   ordinary path, which fails over and hedges; an item whose file
//!   changed is stated again at the UFS and read once more, as `read_range` does. Ranges over
//!   several blocks, write-back files held in journals, and clients with a sidecar (whose
//!   socket or short-circuit grants are the cheaper route) take the ordinary path from the
//!   start.

use std::collections::{BTreeMap, HashMap};

use bytes::Bytes;
use futures::StreamExt;
use strata_common::frame::{MAX_READ_MANY_ITEMS, ReadBlockRequest, ReadMany};
use strata_common::{BlockSlice, ErrorKind, block_slices};
use tracing::{debug, warn};

use crate::route::BlockAsk;
use crate::{Client, ClientError, FileInfo, Result, TransportError};

/// Payload bytes one `ReadMany` asks for at most, so one batch's answers stay a bounded
/// amount of memory and a failed batch costs a bounded amount of reading again.
pub const MAX_BATCH_BYTES: u64 = 64 << 20;

/// One range of a batched read: `len` bytes from `offset` (fewer at the end of the file, none
/// past it) of the version `info` names.
#[derive(Debug, Clone)]
pub struct ReadSpec {
    pub info: FileInfo,
    pub offset: u64,
    pub len: u64,
}

/// What became of one item of a `ReadMany`.
enum Outcome {
    Done(Result<Bytes>),
    /// Not served by this worker (it failed, stalled, or the item failed in a way another
    /// worker may not): read it through the ordinary path.
    Again,
    /// The file changed since it was stated: state it again and read the new version.
    Changed,
}

impl Client {
    /// Many ranges, one result per spec in order. Ranges within one block are read in
    /// `ReadMany` batches, grouped by the worker each would ask first; everything else, and
    /// whatever a batch did not serve, through the ordinary path (see the module).
    pub async fn read_many(&self, specs: &[ReadSpec]) -> Vec<Result<Bytes>> {
        let mut out: Vec<Option<Result<Bytes>>> = (0..specs.len()).map(|_| None).collect();
        let route = &self.inner.route;
        let batching =
            route.sidecar.is_none() && route.short_circuit.is_none() && route.transport.batches_reads();
        let mut one_block = Vec::new();
        let mut ordinary = Vec::new();
        for (i, spec) in specs.iter().enumerate() {
            match single_block(spec, self.inner.config.max_read_len) {
                Some(slice) if batching => one_block.push((i, slice)),
                _ => ordinary.push(i),
            }
        }
        let mut changed = Vec::new();
        for (i, outcome) in self.read_batched(specs, one_block).await {
            match outcome {
                Outcome::Done(answer) => {
                    if let Ok(bytes) = &answer {
                        self.record_read(&specs[i].info, bytes.len() as u64);
                    }
                    out[i] = Some(answer)
                }
                Outcome::Again => ordinary.push(i),
                Outcome::Changed => changed.push(i),
            }
        }
        let reads = ordinary.into_iter().map(|i| {
            let spec = &specs[i];
            async move { (i, self.read_range_of(&spec.info, spec.offset, spec.len).await) }
        });
        let mut reads = futures::stream::iter(reads).buffer_unordered(self.inner.config.parallelism.max(1));
        while let Some((i, answer)) = reads.next().await {
            match answer {
                Err(ClientError::Changed(_)) => changed.push(i),
                answer => out[i] = Some(answer),
            }
        }
        for (i, answer) in self.read_changed(specs, changed).await {
            out[i] = Some(answer);
        }
        out.into_iter().map(|answer| answer.expect("every range answered")).collect()
    }

    /// Reads again, once, the specs whose file changed since it was stated: each file stated
    /// anew at the UFS (once however many specs name it), its range read at the new version.
    async fn read_changed(&self, specs: &[ReadSpec], changed: Vec<usize>) -> Vec<(usize, Result<Bytes>)> {
        if changed.is_empty() {
            return Vec::new();
        }
        let mut by_path: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for i in changed {
            by_path.entry(specs[i].info.path.as_str()).or_default().push(i);
        }
        let parallelism = self.inner.config.parallelism.max(1);
        // Futures made in loops, not in combinators' closures over borrowed paths: the compiler
        // cannot prove those general enough for a `Send` future (a caller's spawned task).
        let mut restats = Vec::with_capacity(by_path.len());
        for &p in by_path.keys() {
            restats.push(async move { (p, self.stat_with(p, true).await) });
        }
        let restated: HashMap<&str, Result<FileInfo>> =
            futures::stream::iter(restats).buffer_unordered(parallelism).collect().await;
        let mut reads = Vec::new();
        for (p, indexes) in by_path {
            let info = &restated[p];
            for i in indexes {
                let spec = &specs[i];
                reads.push(async move {
                    match info {
                        Ok(info) => (i, self.read_range_of(info, spec.offset, spec.len).await),
                        Err(e) => (i, Err(e.duplicate())),
                    }
                });
            }
        }
        futures::stream::iter(reads).buffer_unordered(parallelism).collect().await
    }

    /// The one-block ranges `items` (spec index, block slice) in `ReadMany` batches: grouped by
    /// the worker each read asks first, cut to the batch limits, owners in parallel.
    async fn read_batched(
        &self,
        specs: &[ReadSpec],
        items: Vec<(usize, BlockSlice)>,
    ) -> Vec<(usize, Outcome)> {
        if items.is_empty() {
            return Vec::new();
        }
        let mut groups: BTreeMap<String, Vec<(usize, ReadBlockRequest)>> = BTreeMap::new();
        let mut again = Vec::new();
        for (i, slice) in items {
            let ask = BlockAsk::new(&specs[i].info, slice.index, slice.offset, slice.len);
            match self.inner.route.ring.owners_of(&ask).await.and_then(|owners| owners.into_iter().next()) {
                Some(first) => groups.entry(first.data_addr).or_default().push((i, ask.req)),
                // No worker known: the ordinary path says so ("no live workers"), after
                // refreshing the membership.
                None => again.push((i, Outcome::Again)),
            }
        }
        let mut batches = Vec::new();
        for (addr, group) in groups {
            let mut batch: Vec<(usize, ReadBlockRequest)> = Vec::new();
            let (mut body, mut bytes) = (0, 0);
            for (i, req) in group {
                let full = !ReadMany::fits(batch.len(), body, &req) || bytes + req.len > MAX_BATCH_BYTES;
                if full && !batch.is_empty() {
                    batches.push((addr.clone(), std::mem::take(&mut batch)));
                    (body, bytes) = (0, 0);
                }
                body += req.body_len();
                bytes += req.len;
                batch.push((i, req));
            }
            if !batch.is_empty() {
                batches.push((addr, batch));
            }
        }
        debug_assert!(batches.iter().all(|(_, b)| b.len() <= MAX_READ_MANY_ITEMS));
        futures::stream::iter(batches)
            .map(|(addr, batch)| self.read_batch(addr, batch))
            .buffer_unordered(self.inner.config.parallelism.max(1))
            .flat_map(futures::stream::iter)
            .chain(futures::stream::iter(again))
            .collect()
            .await
    }

    /// One `ReadMany` to the worker at `addr`. Answers are taken as they arrive; a worker that
    /// sends none within its hedging deadline (after the request, then after each answer) is
    /// left, and what it did not answer is read through the ordinary path.
    async fn read_batch(&self, addr: String, batch: Vec<(usize, ReadBlockRequest)>) -> Vec<(usize, Outcome)> {
        let ring = &self.inner.route.ring;
        let health = &ring.health;
        let reqs: Vec<ReadBlockRequest> = batch.iter().map(|(_, req)| req.clone()).collect();
        let _counted = ring.in_flight.track(&addr);
        let started = tokio::time::Instant::now();
        let mut answers = ring.transport.read_many(&addr, &reqs);
        let mut outcomes = Vec::with_capacity(batch.len());
        for (k, (i, req)) in batch.iter().enumerate() {
            let next = if health.hedging() {
                let deadline = health.hedge_after(&addr);
                match tokio::time::timeout(deadline, answers.next()).await {
                    Ok(next) => next,
                    Err(_) => {
                        // A whole hedging deadline without one answer, with the batch's reads in
                        // flight, is what a failed read is: asked last for a while, so the rest
                        // go to the next owners at once rather than each wait for a hedge.
                        health.failed(&addr, tokio::time::Instant::now());
                        warn!(worker = %addr, waited = ?deadline, left = batch.len() - k, "batched read stalled; asking the next owners");
                        break;
                    }
                }
            } else {
                answers.next().await
            };
            let Some(answer) = next else { break };
            let outcome = match answer {
                Ok((bytes, _)) => {
                    if k == 0 {
                        // Only the first answer measures one read; later ones were read alongside.
                        health.answered(&addr, started.elapsed());
                    }
                    Outcome::Done(Ok(bytes))
                }
                Err(TransportError::Remote { kind: ErrorKind::VersionChanged, .. }) => Outcome::Changed,
                // A worker that does not know `ReadMany` rejects the whole frame.
                Err(e @ TransportError::Remote { kind: ErrorKind::BadFrame, .. }) => {
                    debug!(worker = %addr, err = %e, "batched read refused; reading one by one");
                    Outcome::Again
                }
                Err(e) if e.try_next_worker() => {
                    if !matches!(e, TransportError::Remote { .. }) {
                        health.failed(&addr, tokio::time::Instant::now());
                    }
                    debug!(worker = %addr, block = req.block_index, path = %req.path, err = %e, "batched read failed; reading again one by one");
                    Outcome::Again
                }
                Err(e) => Outcome::Done(Err(ClientError::from_transport(e))),
            };
            outcomes.push((*i, outcome));
        }
        drop(answers);
        let answered = outcomes.len();
        outcomes.extend(batch[answered..].iter().map(|(i, _)| (*i, Outcome::Again)));
        outcomes
    }
}

/// The one block `spec`'s range falls in, when it is one block of a file (the rest, and
/// anything `read_range_of` refuses, take the ordinary path).
fn single_block(spec: &ReadSpec, max_read_len: u64) -> Option<BlockSlice> {
    let info = &spec.info;
    if info.is_dir || info.block_size == 0 || !info.holders.is_empty() {
        return None;
    }
    let len = spec.len.min(info.size.saturating_sub(spec.offset));
    if len > max_read_len {
        return None;
    }
    match block_slices(info.size, info.block_size, spec.offset, len).as_slice() {
        [slice] => Some(*slice),
        _ => None,
    }
}
