//! Batched metadata and batched reads: what an epoch over many small files costs.
//!
//! Read one by one, 100,000 small files cost 100,000 stat round trips to the master and
//! 100,000 read round trips to the workers. Here:
//!
//! - [`Client::stat_many`] answers from the client's stat cache first (fed by listings too),
//!   then asks the master for the rest in `StatMany` calls of [`STAT_MANY_CHUNK`] paths, one
//!   result per path: a missing path is that path's error, not the batch's. While the master
//!   is unreachable each path falls back to [`Client::stat_with`] (stale stats, worker stats).
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
use strata_common::{BlockKey, BlockSlice, ErrorKind, block_slices, path};
use tracing::{debug, warn};

use crate::{Client, ClientError, FileInfo, Persist, Result, TransportError};

/// Paths per `StatMany` call (the master takes at most 10,000).
pub const STAT_MANY_CHUNK: usize = 1_000;
/// `StatMany` calls in flight at once.
const STAT_MANY_CALLS: usize = 4;
/// Paths stated one by one at once when the master cannot answer `StatMany`.
const SINGLE_STATS: usize = 16;
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
    /// Metadata of many paths, one result per path in order: from this client's cache when
    /// fresh (as [`stat`](Self::stat)), the rest in `StatMany` calls to the master (one per
    /// [`STAT_MANY_CHUNK`] paths), each result cached. One path's failure (not found, outside
    /// the token's scope) is its own. While the master is unreachable, each path is answered
    /// as [`stat`](Self::stat) answers it then.
    pub async fn stat_many(&self, paths: &[&str]) -> Vec<Result<FileInfo>> {
        let mut out: Vec<Option<Result<FileInfo>>> = (0..paths.len()).map(|_| None).collect();
        let mut ask = Vec::new();
        for (i, raw) in paths.iter().enumerate() {
            match path::normalize(raw) {
                Err(e) => out[i] = Some(Err(ClientError::InvalidArgument(e.to_string()))),
                Ok(p) => match self.fresh_stat(&p) {
                    Some(info) => out[i] = Some(Ok(info)),
                    None => ask.push((i, p)),
                },
            }
        }
        let chunks: Vec<Vec<(usize, String)>> = ask.chunks(STAT_MANY_CHUNK).map(<[_]>::to_vec).collect();
        let mut answers = futures::stream::iter(chunks)
            .map(|chunk| self.stat_chunk(chunk))
            .buffer_unordered(STAT_MANY_CALLS);
        while let Some(answered) = answers.next().await {
            for (i, answer) in answered {
                out[i] = Some(answer);
            }
        }
        out.into_iter().map(|answer| answer.expect("every path answered")).collect()
    }

    /// The cached stat of `p` (normalised) while [`stat`](Self::stat) would use it.
    fn fresh_stat(&self, p: &str) -> Option<FileInfo> {
        let (at, info) = self.inner.stats.lock().unwrap_or_else(|p| p.into_inner()).get(p).cloned()?;
        let age = self.inner.config.clock.now().saturating_duration_since(at);
        (info.persist == Persist::Persisted && age < self.ttl_for(p)).then_some(info)
    }

    /// One `StatMany` call for `chunk` (index in the caller's list, normalised path).
    async fn stat_chunk(&self, chunk: Vec<(usize, String)>) -> Vec<(usize, Result<FileInfo>)> {
        let cached_any = {
            let stats = self.inner.stats.lock().unwrap_or_else(|p| p.into_inner());
            chunk.iter().any(|(_, p)| stats.contains_key(p))
        };
        let fallback = cached_any || !self.worker_candidates(None).is_empty();
        let req = strata_proto::StatManyRequest { paths: chunk.iter().map(|(_, p)| p.clone()).collect() };
        let mut master = self.master();
        let mut unimplemented = false;
        let call = async {
            let answer = master.stat_many(req).await;
            // A master older than `StatMany`: ask it path by path.
            unimplemented = matches!(&answer, Err(s) if s.code() == tonic::Code::Unimplemented);
            answer
        };
        let answer = self.master_call("stat_many", fallback, call).await;
        let results = match answer {
            Ok(resp) if resp.results.len() == chunk.len() => resp.results,
            Ok(resp) => {
                let message = format!(
                    "the master answered {} results to a StatMany of {} paths",
                    resp.results.len(),
                    chunk.len()
                );
                return chunk
                    .into_iter()
                    .map(|(i, _)| {
                        (i, Err(ClientError::Remote { kind: ErrorKind::Internal, message: message.clone() }))
                    })
                    .collect();
            }
            Err(e) if e.is_master_outage() || unimplemented => {
                if !unimplemented {
                    debug!(paths = chunk.len(), err = %e, "master unreachable; stating path by path");
                }
                let stats =
                    chunk.into_iter().map(|(i, p)| async move { (i, self.stat_with(&p, false).await) });
                return futures::stream::iter(stats).buffer_unordered(SINGLE_STATS).collect().await;
            }
            Err(e) => return chunk.into_iter().map(|(i, _)| (i, Err(copy_of(&e)))).collect(),
        };
        let now = self.inner.config.clock.now();
        let mut stats = self.inner.stats.lock().unwrap_or_else(|p| p.into_inner());
        chunk
            .into_iter()
            .zip(results)
            .map(|((i, p), result)| {
                use strata_proto::stat_many_result::Result as R;
                let answer = match result.result {
                    Some(R::Status(status)) => {
                        let info = FileInfo::from(status);
                        stats.insert(p, (now, info.clone()));
                        Ok(info)
                    }
                    Some(R::Error(e)) => {
                        let kind = ErrorKind::from_name(&e.kind).unwrap_or(ErrorKind::Internal);
                        Err(ClientError::from_kind(kind, e.message))
                    }
                    None => Err(ClientError::Remote {
                        kind: ErrorKind::Internal,
                        message: format!("the master answered nothing for {p}"),
                    }),
                };
                (i, answer)
            })
            .collect()
    }

    /// Many ranges, one result per spec in order. Ranges within one block are read in
    /// `ReadMany` batches, grouped by the worker each would ask first; everything else, and
    /// whatever a batch did not serve, through the ordinary path (see the module).
    pub async fn read_many(&self, specs: &[ReadSpec]) -> Vec<Result<Bytes>> {
        let mut out: Vec<Option<Result<Bytes>>> = (0..specs.len()).map(|_| None).collect();
        let batching = self.inner.sidecar.is_none()
            && self.inner.short_circuit.is_none()
            && self.inner.transport.batches_reads();
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
                        Err(e) => (i, Err(copy_of(e))),
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
        let mut ring = match self.ring().await {
            Ok(ring) => ring,
            Err(_) => return items.into_iter().map(|(i, _)| (i, Outcome::Again)).collect(),
        };
        if ring.is_empty() {
            ring = self.inner.view.read().unwrap_or_else(|p| p.into_inner()).last_members.clone();
        }
        if ring.is_empty() {
            // The ordinary path says so ("no live workers"), after refreshing the membership.
            return items.into_iter().map(|(i, _)| (i, Outcome::Again)).collect();
        }
        let mut groups: BTreeMap<String, Vec<(usize, ReadBlockRequest)>> = BTreeMap::new();
        for (i, slice) in items {
            let info = &specs[i].info;
            let hash =
                BlockKey::new(info.file_id.clone(), info.version.clone(), slice.index).placement_hash();
            let owners = self
                .in_asking_order(ring.owners(hash, ring.members().len()), self.read_replicas_for(&info.path));
            let first = owners.first().expect("a ring with members has owners").data_addr.clone();
            let req = ReadBlockRequest {
                req_id: 0,
                path: info.path.clone(),
                version: info.version.clone(),
                file_size: info.size,
                block_size: info.block_size,
                block_index: slice.index,
                offset: slice.offset,
                len: slice.len,
            };
            groups.entry(first).or_default().push((i, req));
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
            .collect()
            .await
    }

    /// One `ReadMany` to the worker at `addr`. Answers are taken as they arrive; a worker that
    /// sends none within its hedging deadline (after the request, then after each answer) is
    /// left, and what it did not answer is read through the ordinary path.
    async fn read_batch(&self, addr: String, batch: Vec<(usize, ReadBlockRequest)>) -> Vec<(usize, Outcome)> {
        let health = &self.inner.health;
        let reqs: Vec<ReadBlockRequest> = batch.iter().map(|(_, req)| req.clone()).collect();
        let _counted = self.inner.in_flight.track(&addr);
        let started = tokio::time::Instant::now();
        let mut answers = self.inner.transport.read_many(&addr, &reqs);
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

/// The same error again, for each of several requests it ended.
fn copy_of(e: &ClientError) -> ClientError {
    match e {
        ClientError::InvalidArgument(m) => ClientError::InvalidArgument(m.clone()),
        ClientError::NotFound(m) => ClientError::NotFound(m.clone()),
        ClientError::IsDirectory(m) => ClientError::IsDirectory(m.clone()),
        ClientError::AlreadyExists(m) => ClientError::AlreadyExists(m.clone()),
        ClientError::PermissionDenied(m) => ClientError::PermissionDenied(m.clone()),
        ClientError::MasterUnavailable(m) => ClientError::MasterUnavailable(m.clone()),
        ClientError::Unavailable(u) => {
            ClientError::Remote { kind: u.kind(), message: format!("no worker could serve the read: {u}") }
        }
        ClientError::Changed(m) => ClientError::Changed(m.clone()),
        ClientError::Remote { kind, message } => {
            ClientError::Remote { kind: *kind, message: message.clone() }
        }
    }
}
