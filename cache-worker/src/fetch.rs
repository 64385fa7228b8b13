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
//!
//! A client read's fetch first takes a place in the UFS fetch gate by the client's request
//! class (`ufs_fetch_slots`, docs/QOS.md), held while the store answers and given back before
//! the block is kept; loads (warmup, prefetch) take none — their lanes have windows of their
//! own. The place is the flight's: a reader joining a flight waits in its flier's class.
//!
//! Cut-through: the reader that flies a flight may pass a [`Tap`]; on a store that refuses
//! other versions before its first byte (`Ufs::checks_version_first`: `If-Match`) the block's
//! pieces then go to it as they arrive (in order, from the block's first byte), so its answer
//! can start, and end, before the last byte of the block is in. Every such byte is the version
//! asked for, whatever becomes of the rest of the fetch. Where the version can only be checked
//! after the last byte (a local directory) nothing is tapped: the reader must be told
//! `VersionChanged` cleanly, not given bytes of another version. The block is kept only once
//! the whole of it arrived. Readers joining the flight, and reads from an upstream, get the
//! whole block as before.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use strata_common::frame::Source;
use strata_common::upstream::{Upstream, UpstreamRead};
use strata_common::{BlockKey, QosClass};
use tokio::sync::OnceCell;
use tracing::{debug, warn};

use crate::cache::{BlockCache, Durability, NvmeWrite};
use crate::classes::ClassGate;
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

/// Whose miss a fetch serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FetchFor {
    /// A client's read, of this request class: waits for a place in the UFS fetch gate.
    Client(QosClass),
    /// A load (warmup, prefetch): its lane's window bounds it; no place is taken.
    Load,
}

type Flights = Mutex<HashMap<BlockKey, Arc<OnceCell<Bytes>>>>;

/// Where a cut-through fetch sends the block's pieces as they arrive (see the module's notes).
/// A closed receiver only stops the pieces; the fetch goes on for the cache.
pub type Tap = tokio::sync::mpsc::UnboundedSender<Bytes>;

pub struct Fetcher {
    cache: Arc<BlockCache>,
    counters: Arc<Counters>,
    inflight: Arc<Flights>,
    upstream: OnceLock<Arc<dyn Upstream>>,
    ufs_deadline: Duration,
    gate: Arc<ClassGate>,
}

impl Fetcher {
    /// Client reads' fetches pass `gate` (see [`ClassGate::for_ufs_fetches`]).
    pub fn new(
        cache: Arc<BlockCache>,
        counters: Arc<Counters>,
        ufs_deadline: Duration,
        gate: Arc<ClassGate>,
    ) -> Self {
        Self { cache, counters, inflight: Arc::default(), upstream: OnceLock::new(), ufs_deadline, gate }
    }

    /// The gate client reads' fetches pass.
    pub fn gate(&self) -> &Arc<ClassGate> {
        &self.gate
    }

    /// Makes misses ask `upstream` before the UFS (sidecar mode). Set once; later calls are
    /// ignored.
    pub fn set_upstream(&self, upstream: Arc<dyn Upstream>) {
        let _ = self.upstream.set(upstream);
    }

    /// The whole block from a tier or, on a miss, fetched once (for `whom`) and kept with
    /// `durability`.
    pub async fn block(
        &self,
        at: &Located,
        durability: Durability,
        whom: FetchFor,
    ) -> Result<(Bytes, Source), ServeError> {
        self.block_tapped(at, durability, whom, None).await
    }

    /// [`block`](Self::block), with the pieces of a UFS fetch this caller flies sent to `tap`
    /// as they arrive.
    pub async fn block_tapped(
        &self,
        at: &Located,
        durability: Durability,
        whom: FetchFor,
        tap: Option<&Tap>,
    ) -> Result<(Bytes, Source), ServeError> {
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
                let (bytes, write) = self.fetch(at, durability, whom, tap).await?;
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
        whom: FetchFor,
        tap: Option<&Tap>,
    ) -> Result<(Bytes, Option<NvmeWrite>), ServeError> {
        let bytes = {
            let _place = match whom {
                FetchFor::Client(class) => Some(self.gate.acquire(class).await),
                FetchFor::Load => None,
            };
            self.read_below(at, tap).await?
        };
        let write = self.cache.keep(&at.key, &bytes, durability, at.params).await;
        Ok((bytes, write))
    }

    /// The block from the upstream, else from the UFS within the fetch deadline.
    async fn read_below(&self, at: &Located, tap: Option<&Tap>) -> Result<Bytes, ServeError> {
        if let Some(bytes) = self.ask_upstream(at).await {
            return Ok(bytes);
        }
        let read = async {
            match tap.filter(|_| at.mount.ufs.checks_version_first()) {
                Some(tap) => read_tapped(at, tap).await,
                None => at.mount.ufs.read_range(&at.rel, at.range(), &at.key.version).await,
            }
        };
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
        Ok(bytes)
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

/// The block from the UFS piece by piece, each piece sent to `tap` as it arrives, and the
/// whole block once every byte is in (one copy to make it contiguous, as a read of the whole
/// range makes). A block of the wrong length is of another version.
async fn read_tapped(at: &Located, tap: &Tap) -> strata_ufs::Result<Bytes> {
    use futures::StreamExt;
    let mut pieces = at.mount.ufs.read_stream(&at.rel, at.range(), &at.key.version);
    let (mut first, mut joined): (Option<Bytes>, Option<bytes::BytesMut>) = (None, None);
    while let Some(piece) = pieces.next().await {
        let piece = piece?;
        // A closed receiver means the reader no longer wants the pieces; the cache still does.
        let _ = tap.send(piece.clone());
        match (&mut joined, first.take()) {
            (Some(buf), _) => buf.extend_from_slice(&piece),
            (None, None) => first = Some(piece),
            (None, Some(earlier)) => {
                let mut buf = bytes::BytesMut::with_capacity(at.block_len as usize);
                buf.extend_from_slice(&earlier);
                buf.extend_from_slice(&piece);
                joined = Some(buf);
            }
        }
    }
    let bytes = match joined {
        Some(buf) => buf.freeze(),
        None => first.unwrap_or_default(),
    };
    if bytes.len() as u64 != at.block_len {
        return Err(strata_ufs::UfsError::VersionChanged(at.rel.clone()));
    }
    Ok(bytes)
}

/// Removes a flight whose block a tier now holds from the map (unless another replaced it).
fn end_flight(inflight: &Flights, key: &BlockKey, cell: &Arc<OnceCell<Bytes>>) {
    let mut flights = inflight.lock().unwrap_or_else(|p| p.into_inner());
    if flights.get(key).is_some_and(|c| Arc::ptr_eq(c, cell)) {
        flights.remove(key);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use async_trait::async_trait;
    use strata_common::{MountMode, MountOptions};
    use strata_ufs::{ObjectMeta, Ufs, UfsEntry};

    use super::*;

    /// A UFS whose reads record their start and then wait for a permit the test hands out.
    struct HeldUfs {
        started: Mutex<Vec<String>>,
        go: tokio::sync::Semaphore,
    }

    impl Default for HeldUfs {
        fn default() -> Self {
            Self { started: Mutex::default(), go: tokio::sync::Semaphore::new(0) }
        }
    }

    #[async_trait]
    impl Ufs for HeldUfs {
        async fn stat(&self, path: &str) -> strata_ufs::Result<ObjectMeta> {
            Err(strata_ufs::UfsError::NotFound(path.into()))
        }
        async fn list(&self, _dir: &str) -> strata_ufs::Result<Vec<UfsEntry>> {
            Ok(Vec::new())
        }
        async fn read_range(
            &self,
            path: &str,
            range: std::ops::Range<u64>,
            _version: &str,
        ) -> strata_ufs::Result<Bytes> {
            self.started.lock().unwrap().push(path.to_string());
            self.go.acquire().await.expect("never closed").forget();
            Ok(Bytes::from(vec![7u8; (range.end - range.start) as usize]))
        }
    }

    /// A UFS whose streamed reads yield the range's first half at once and the second when the
    /// test hands out a permit — or, told to, a temporary error in its place.
    struct HalvesUfs {
        second: tokio::sync::Semaphore,
        break_next: std::sync::atomic::AtomicBool,
        reads: std::sync::atomic::AtomicUsize,
        /// Says it refuses other versions up front (as a store with `If-Match`).
        conditional: bool,
    }

    impl Default for HalvesUfs {
        fn default() -> Self {
            let second = tokio::sync::Semaphore::new(0);
            Self { second, break_next: false.into(), reads: 0.into(), conditional: false }
        }
    }

    #[async_trait]
    impl Ufs for HalvesUfs {
        async fn stat(&self, path: &str) -> strata_ufs::Result<ObjectMeta> {
            Err(strata_ufs::UfsError::NotFound(path.into()))
        }
        async fn list(&self, _dir: &str) -> strata_ufs::Result<Vec<UfsEntry>> {
            Ok(Vec::new())
        }
        async fn read_range(
            &self,
            _path: &str,
            range: std::ops::Range<u64>,
            _version: &str,
        ) -> strata_ufs::Result<Bytes> {
            Ok(halves_of(range).concat().into())
        }
        fn checks_version_first(&self) -> bool {
            self.conditional
        }
        fn read_stream<'a>(
            &'a self,
            _path: &'a str,
            range: std::ops::Range<u64>,
            _version: &'a str,
        ) -> futures::stream::BoxStream<'a, strata_ufs::Result<Bytes>> {
            use futures::StreamExt;
            self.reads.fetch_add(1, Ordering::SeqCst);
            let [first, second] = halves_of(range);
            let broken = self.break_next.swap(false, Ordering::SeqCst);
            let later = async move {
                self.second.acquire().await.expect("never closed").forget();
                if broken { Err(strata_ufs::UfsError::Temporary("cut".into())) } else { Ok(second) }
            };
            futures::stream::iter([Ok(first)]).chain(futures::stream::once(later)).boxed()
        }
    }

    fn halves_of(range: std::ops::Range<u64>) -> [Bytes; 2] {
        let bytes: Vec<u8> = range.map(|i| (i % 251) as u8).collect();
        let (a, b) = bytes.split_at(bytes.len() / 2);
        [Bytes::copy_from_slice(a), Bytes::copy_from_slice(b)]
    }

    #[tokio::test]
    async fn the_flier_s_tap_sees_each_piece_as_it_arrives_and_a_joiner_gets_the_whole_block() {
        let fetcher = Arc::new(fetcher(ClassGate::new(0, 0, 0)));
        let ufs = Arc::new(HalvesUfs { conditional: true, ..HalvesUfs::default() });
        let at = located(&ufs, "halves");
        let (tap, mut pieces) = tokio::sync::mpsc::unbounded_channel();
        let flier = {
            let (fetcher, at) = (fetcher.clone(), at.clone());
            tokio::spawn(async move {
                let whom = FetchFor::Client(QosClass::Throughput);
                fetcher.block_tapped(&at, Durability::WriteBack, whom, Some(&tap)).await
            })
        };
        let [first, second] = halves_of(0..100);
        assert_eq!(pieces.recv().await, Some(first.clone()), "the first half, before the second exists");
        let (joiner_tap, mut joiner_pieces) = tokio::sync::mpsc::unbounded_channel();
        let joiner = {
            let (fetcher, at) = (fetcher.clone(), at.clone());
            tokio::spawn(async move {
                let whom = FetchFor::Client(QosClass::Latency);
                fetcher.block_tapped(&at, Durability::WriteBack, whom, Some(&joiner_tap)).await
            })
        };
        // The second miss can only join: the flight is held open by the UFS.
        until("the joiner missed", || fetcher.counters.misses.load(Ordering::SeqCst) == 2).await;
        ufs.second.add_permits(1);
        assert_eq!(pieces.recv().await, Some(second));
        let whole = Bytes::from([first, halves_of(0..100)[1].clone()].concat());
        assert_eq!(flier.await.unwrap().unwrap().0, whole);
        assert_eq!(joiner.await.unwrap().unwrap().0, whole);
        assert_eq!(pieces.recv().await, None, "the tap closes with the fetch");
        assert_eq!(joiner_pieces.recv().await, None, "a joiner's tap sees nothing");
        assert_eq!(ufs.reads.load(Ordering::SeqCst), 1);
        let (_, source) = fetcher.block(&at, Durability::WriteBack, FetchFor::Load).await.unwrap();
        assert_eq!(source, Source::Memory, "kept once whole");
    }

    #[tokio::test]
    async fn a_stream_broken_midway_fails_the_fetch_after_its_tap_saw_a_piece_and_keeps_nothing() {
        let fetcher = fetcher(ClassGate::new(0, 0, 0));
        let ufs = Arc::new(HalvesUfs { conditional: true, ..HalvesUfs::default() });
        let at = located(&ufs, "broken");
        ufs.break_next.store(true, Ordering::SeqCst);
        ufs.second.add_permits(2);
        let (tap, mut pieces) = tokio::sync::mpsc::unbounded_channel();
        let whom = FetchFor::Client(QosClass::Throughput);
        let failed = fetcher.block_tapped(&at, Durability::WriteBack, whom, Some(&tap)).await;
        assert!(matches!(failed, Err(ServeError::Ufs(_))), "{:?}", failed.map(|(b, _)| b.len()));
        assert_eq!(pieces.recv().await, Some(halves_of(0..100)[0].clone()));
        let (again, source) = fetcher.block(&at, Durability::WriteBack, whom).await.unwrap();
        assert_eq!((again.len(), source), (100, Source::Ufs), "fetched again, not kept broken");
        assert_eq!(ufs.reads.load(Ordering::SeqCst), 1, "the second fetch read the whole range at once");
    }

    #[tokio::test]
    async fn a_store_that_checks_the_version_after_the_last_byte_is_not_tapped() {
        let fetcher = fetcher(ClassGate::new(0, 0, 0));
        let ufs = Arc::new(HalvesUfs::default());
        let at = located(&ufs, "after");
        let (tap, mut pieces) = tokio::sync::mpsc::unbounded_channel();
        let whom = FetchFor::Client(QosClass::Throughput);
        let (bytes, _) = fetcher.block_tapped(&at, Durability::WriteBack, whom, Some(&tap)).await.unwrap();
        drop(tap);
        assert_eq!(bytes, Bytes::from(halves_of(0..100).concat()));
        assert_eq!(pieces.recv().await, None, "read whole, as without a tap");
        assert_eq!(ufs.reads.load(Ordering::SeqCst), 0, "not streamed");
    }

    fn fetcher(gate: ClassGate) -> Fetcher {
        let (cache, counters) = BlockCache::dram_only(1 << 20);
        Fetcher::new(cache, counters, Duration::from_secs(30), Arc::new(gate))
    }

    fn located<U: Ufs>(ufs: &Arc<U>, name: &str) -> Located {
        let mount = Arc::new(WorkerMount {
            path: "/d".into(),
            uri: "held://".into(),
            block_size: 1024,
            mode: MountMode::ReadOnly,
            options: MountOptions::default(),
            ufs: ufs.clone(),
        });
        Located {
            key: BlockKey::new(format!("held://{name}"), "v1".to_string(), 0),
            path: format!("/d/{name}"),
            mount,
            rel: name.to_string(),
            file_size: 100,
            block_len: 100,
            params: PutParams::default(),
        }
    }

    async fn until(what: &str, mut check: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !check() {
            assert!(Instant::now() < deadline, "timed out waiting until {what}");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    #[tokio::test]
    async fn client_fetches_wait_for_a_place_by_class_and_loads_take_none() {
        // One place, no latency reserve, no floor: the order is the classes' alone.
        let fetcher = Arc::new(fetcher(ClassGate::new(1, 0, 0)));
        let ufs = Arc::new(HeldUfs::default());
        let fetch = |name: &'static str, whom: FetchFor| {
            let (fetcher, at) = (fetcher.clone(), located(&ufs, name));
            tokio::spawn(async move { fetcher.block(&at, Durability::WriteBack, whom).await.map(|(b, _)| b) })
        };
        let started = |n: usize| ufs.started.lock().unwrap().len() >= n;
        let queued = || fetcher.gate().counters().iter().map(|c| c.queued).sum::<u64>();

        let mut tasks = vec![fetch("holder", FetchFor::Client(QosClass::Throughput))];
        until("the holder's read started", || started(1)).await;
        for (i, (name, class)) in [
            ("background", QosClass::Background),
            ("throughput", QosClass::Throughput),
            ("latency", QosClass::Latency),
        ]
        .into_iter()
        .enumerate()
        {
            tasks.push(fetch(name, FetchFor::Client(class)));
            until("the fetch waits for a place", || queued() == i as u64 + 1).await;
        }
        tasks.push(fetch("load", FetchFor::Load));
        until("the load reached the UFS past the full gate", || started(2)).await;
        // Each permit lets the oldest read waiting in the UFS finish; a client fetch's place then
        // goes to the highest class waiting. The holder's ends first, then the load's (which
        // frees no place), then each client fetch's in turn.
        for (permits, reached) in [(1, 3), (2, 4), (1, 5)] {
            ufs.go.add_permits(permits);
            until("the next fetch reached the UFS", || started(reached)).await;
        }
        ufs.go.add_permits(1);
        for task in tasks {
            assert_eq!(task.await.unwrap().unwrap().len(), 100);
        }
        assert_eq!(*ufs.started.lock().unwrap(), ["holder", "load", "latency", "throughput", "background"]);
        let counters = fetcher.gate().counters();
        assert_eq!(
            [counters[0].served, counters[1].served, counters[2].served],
            [1, 2, 1],
            "loads are not counted"
        );
    }

    #[tokio::test]
    async fn a_joined_flight_takes_one_place_and_a_cached_block_none() {
        let fetcher = fetcher(ClassGate::new(1, 0, 0));
        let ufs = Arc::new(HeldUfs::default());
        let at = located(&ufs, "shared");
        ufs.go.add_permits(1);
        let (a, b) = tokio::join!(
            fetcher.block(&at, Durability::WriteBack, FetchFor::Client(QosClass::Throughput)),
            fetcher.block(&at, Durability::WriteBack, FetchFor::Client(QosClass::Latency)),
        );
        assert_eq!((a.unwrap().0, b.unwrap().0.len()), (Bytes::from(vec![7u8; 100]), 100));
        let (_, source) =
            fetcher.block(&at, Durability::WriteBack, FetchFor::Client(QosClass::Latency)).await.unwrap();
        assert_eq!(source, Source::Memory);
        assert_eq!(ufs.started.lock().unwrap().len(), 1, "one fetch for the block");
        let served: u64 = fetcher.gate().counters().iter().map(|c| c.served).sum();
        assert_eq!(served, 1, "only the flight's fetch took a place");
    }
}
