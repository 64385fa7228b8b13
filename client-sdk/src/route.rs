//! Where a block is read from. Each place a client can read a block is a [`BlockSource`]: the
//! journals of a write-back file's holders, the sidecar's short-circuit grant, the sidecar's
//! socket, a worker on this host by short-circuit, one worker over the network, and the
//! block's owners on the placement ring. The read path is their composition:
//!
//! ```text
//! a write-back file not yet uploaded:  Chain[ holder, holder, … ]          (journals)
//! any other file:                      Chain[ sidecar grant, sidecar, Ring ]
//! Ring, per block:                     Chain[ first owner on this host, Hedged[ owner, owner, … ] ],
//!                                      once more on a refreshed ring when every owner failed
//! ```
//!
//! [`Chain`] asks its sources in order until one serves; [`Hedged`] asks the first, and the
//! next as well when one has not answered within its hedging deadline (see `health`), taking
//! the first answer. Every source answers with the bytes, or a [`Miss`] that says whether the
//! next source may do better ([`Miss::Next`]: the source is down, busy, or cannot serve this
//! way) or not ([`Miss::Final`]: a refusal any source would give — not found, the version
//! changed, permission denied). Every source is asked for the same file version, the one the
//! read was given: a read never mixes versions.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::{FuturesUnordered, StreamExt};
use strata_common::frame::ReadBlockRequest;
use strata_common::{BlockKey, Member};
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::health::Health;
use crate::local::{LocalWorkers, MIN_MAPPED_BLOCK};
use crate::shortcircuit::ShortCircuit;
use crate::spread::{self, InFlight};
use crate::transport::{Dial, Sink, Transport, TransportError};
use crate::view::ClusterView;
use crate::{
    ClientError, FileInfo, METRIC_FAILOVERS, METRIC_HEDGES, METRIC_LOCAL_READS, METRIC_SIDECAR_FALLBACKS,
};

/// What a source could not serve.
#[derive(Debug)]
pub(crate) enum Miss {
    /// Another source may serve it: this one is down, busy, frozen, or cannot serve it this way
    /// (the error, when there was one).
    Next(Option<TransportError>),
    /// A refusal every source would give: asking another is useless.
    Final(TransportError),
}

/// The bytes of a block range, or `None` once they are in the caller's buffer.
pub(crate) type Served = Option<Bytes>;

/// One block range to read, of one version of a file.
pub(crate) struct BlockAsk<'a> {
    pub(crate) info: &'a FileInfo,
    pub(crate) req: ReadBlockRequest,
}

impl<'a> BlockAsk<'a> {
    pub(crate) fn new(info: &'a FileInfo, index: u64, offset: u64, len: u64) -> Self {
        let req = ReadBlockRequest {
            req_id: 0,
            path: info.path.clone(),
            version: info.version.clone(),
            file_size: info.size,
            block_size: info.block_size,
            block_index: index,
            offset,
            len,
        };
        Self { info, req }
    }
}

/// A place a block can be read from.
#[async_trait]
pub(crate) trait BlockSource: Send + Sync {
    /// What it is known by, for logs and health (a worker's data address, a socket path).
    fn key(&self) -> &str;
    /// Reads `ask` into `sink`: the bytes for `Sink::New`, `None` once they are in place.
    async fn read(&self, ask: &BlockAsk<'_>, sink: &mut Sink<'_>) -> Result<Served, Miss>;
}

/// A transport error as a miss: the next source may do better unless it is a refusal any
/// worker would give.
fn miss(e: TransportError) -> Miss {
    if e.try_next_worker() { Miss::Next(Some(e)) } else { Miss::Final(e) }
}

/// Sources asked in order until one serves.
pub(crate) struct Chain {
    sources: Vec<Arc<dyn BlockSource>>,
}

impl Chain {
    pub(crate) fn new(sources: Vec<Arc<dyn BlockSource>>) -> Self {
        Self { sources }
    }
}

#[async_trait]
impl BlockSource for Chain {
    fn key(&self) -> &str {
        "chain"
    }

    async fn read(&self, ask: &BlockAsk<'_>, sink: &mut Sink<'_>) -> Result<Served, Miss> {
        let mut last = None;
        for source in &self.sources {
            match source.read(ask, sink).await {
                Ok(served) => return Ok(served),
                Err(Miss::Next(e)) => last = e.or(last),
                Err(fin @ Miss::Final(_)) => return Err(fin),
            }
        }
        Err(Miss::Next(last))
    }
}

/// One worker over the network (its data address), counted in flight while asked.
pub(crate) struct Worker {
    member: Member,
    transport: Arc<dyn Transport>,
    in_flight: Arc<InFlight>,
}

impl Worker {
    pub(crate) fn new(member: Member, transport: Arc<dyn Transport>, in_flight: Arc<InFlight>) -> Self {
        Self { member, transport, in_flight }
    }
}

#[async_trait]
impl BlockSource for Worker {
    fn key(&self) -> &str {
        &self.member.data_addr
    }

    async fn read(&self, ask: &BlockAsk<'_>, sink: &mut Sink<'_>) -> Result<Served, Miss> {
        let _counted = self.in_flight.track(&self.member.data_addr);
        sink.read(self.transport.as_ref(), &self.member.data_addr, &ask.req).await.map_err(|e| {
            if e.try_next_worker() {
                warn!(worker = %self.member.id, block = ask.req.block_index, path = %ask.req.path, err = %e, "worker failed; trying the next");
            }
            miss(e)
        })
    }
}

/// How a hedged read ended.
pub(crate) struct Won {
    pub(crate) served: Served,
    /// The position of the source that served it among those given.
    pub(crate) by: usize,
}

/// Sources asked as one hedged read: the first at once (into the caller's sink); the next at
/// once when one fails, and as well when none has answered within the hedging deadline of the
/// last asked, and so on down the list. The first answer wins; reads still pending are dropped
/// (their connections with them). Only the first read goes straight into the sink; another's
/// bytes are copied there, which costs a copy only when the first did not serve. Each source's
/// answers, failures and slowness go to `health`, keyed by its id.
pub(crate) struct Hedged<'h> {
    pub(crate) health: &'h Health,
    /// Counts hedges sent (the client's own count beside the metric).
    pub(crate) hedges: &'h AtomicU64,
}

type Pending<'a> = std::pin::Pin<Box<dyn Future<Output = (usize, Result<Served, Miss>)> + Send + 'a>>;

impl Hedged<'_> {
    pub(crate) async fn read(
        &self,
        sources: &[Arc<dyn BlockSource>],
        ask: &BlockAsk<'_>,
        sink: &mut Sink<'_>,
    ) -> Result<Won, Miss> {
        let health = self.health;
        let Some(first) = sources.first() else { return Err(Miss::Next(None)) };
        let started = Instant::now();
        let mut primary = Some(first.read(ask, sink));
        let mut others: FuturesUnordered<Pending<'_>> = FuturesUnordered::new();
        // Sources asked so far, each with when it was asked; `None` once it has answered or failed.
        let mut asked: Vec<Option<Instant>> = vec![Some(started)];
        let mut hedge_at = started + health.hedge_after(first.key());
        let mut last = None;
        let won = loop {
            let can_ask_more = asked.len() < sources.len();
            if primary.is_none() && others.is_empty() {
                if !can_ask_more {
                    break None;
                }
                // Nothing in flight: ask the next source now.
                hedge_at = Instant::now();
            }
            let idle = primary.is_none() && others.is_empty();
            let hedge = idle || health.hedging();
            tokio::select! {
                biased;
                answer = async { primary.as_mut().expect("guarded").await }, if primary.is_some() => {
                    primary = None;
                    let at = asked[0].take().expect("asked");
                    match judge(health, first.as_ref(), at, answer, &mut last) {
                        Some(Ok(served)) => break Some((0, served)),
                        Some(Err(fin)) => return Err(fin),
                        None => {}
                    }
                }
                Some((i, answer)) = others.next(), if !others.is_empty() => {
                    let at = asked[i].take().expect("asked");
                    match judge(health, sources[i].as_ref(), at, answer, &mut last) {
                        Some(Ok(served)) => break Some((i, served)),
                        Some(Err(fin)) => return Err(fin),
                        None => {}
                    }
                }
                () = tokio::time::sleep_until(hedge_at), if can_ask_more && hedge => {
                    let i = asked.len();
                    let source = sources[i].clone();
                    let racing = asked.iter().any(Option::is_some);
                    if racing && !health.take_hedge() {
                        // Out of hedges: wait for the reads in flight (their request timeout
                        // still ends them), look again at the next deadline.
                        hedge_at = Instant::now() + health.hedge_after(sources[i - 1].key());
                        continue;
                    }
                    if racing {
                        debug!(source = %source.key(), block = ask.req.block_index, path = %ask.req.path, "no answer within the hedging deadline; asking the next as well");
                        metrics::counter!(METRIC_HEDGES).increment(1);
                        self.hedges.fetch_add(1, Ordering::Relaxed);
                    }
                    let now = Instant::now();
                    asked.push(Some(now));
                    hedge_at = now + health.hedge_after(source.key());
                    others.push(Box::pin(async move {
                        let mut own = Sink::New;
                        (i, source.read(ask, &mut own).await)
                    }));
                }
            }
        };
        drop(primary);
        drop(others);
        let Some((by, served)) = won else { return Err(Miss::Next(last)) };
        // Those asked before the winner and still silent were outrun.
        let now = Instant::now();
        for (i, pending) in asked.iter().enumerate().take(by) {
            if pending.is_some() && health.outrun(sources[i].key(), now) {
                warn!(source = %sources[i].key(), block = ask.req.block_index, path = %ask.req.path, "slow to answer; asking it last for a while");
            }
        }
        let served = match served {
            // The first source's answer is in the sink already.
            Some(bytes) if by > 0 => sink.deliver(bytes),
            other => other,
        };
        Ok(Won { served, by })
    }
}

/// Records a source's answer (asked at `at`) in its health and says what it means for the
/// read: served, a final refusal, or (`None`) ask the next.
fn judge(
    health: &Health,
    source: &dyn BlockSource,
    at: Instant,
    answer: Result<Served, Miss>,
    last: &mut Option<TransportError>,
) -> Option<Result<Served, Miss>> {
    match answer {
        Ok(served) => {
            health.answered(source.key(), at.elapsed());
            Some(Ok(served))
        }
        Err(Miss::Next(e)) => {
            health.failed(source.key(), Instant::now());
            *last = e.or(last.take());
            None
        }
        Err(fin) => {
            health.answered(source.key(), at.elapsed());
            Some(Err(fin))
        }
    }
}

/// The sidecar's short-circuit grants: its blocks mapped in place. Any failure, or an answer of
/// the wrong length, is a miss: the sidecar's socket is asked next.
pub(crate) struct SidecarGrant(pub(crate) ShortCircuit);

#[async_trait]
impl BlockSource for SidecarGrant {
    fn key(&self) -> &str {
        "sidecar short-circuit"
    }

    async fn read(&self, ask: &BlockAsk<'_>, sink: &mut Sink<'_>) -> Result<Served, Miss> {
        if self.0.backing_off() {
            return Err(Miss::Next(None));
        }
        match self.0.read_block(&ask.req).await {
            Ok(bytes) if bytes.len() as u64 == ask.req.len => Ok(sink.deliver(bytes)),
            Ok(bytes) => {
                debug!(block = ask.req.block_index, path = %ask.req.path, got = bytes.len(), "short-circuit read of the wrong length; reading through the socket");
                Err(Miss::Next(None))
            }
            Err(e) => {
                debug!(block = ask.req.block_index, path = %ask.req.path, err = %e, "short-circuit read failed; reading through the socket");
                Err(Miss::Next(None))
            }
        }
    }
}

/// The sidecar's socket. When it cannot serve (not running, timed out, a temporary error) the
/// cluster is asked next; a refusal any worker would give ends the read.
pub(crate) struct Sidecar {
    pub(crate) socket: String,
    pub(crate) transport: Arc<dyn Transport>,
}

#[async_trait]
impl BlockSource for Sidecar {
    fn key(&self) -> &str {
        &self.socket
    }

    async fn read(&self, ask: &BlockAsk<'_>, sink: &mut Sink<'_>) -> Result<Served, Miss> {
        match sink.read(self.transport.as_ref(), &self.socket, &ask.req).await {
            Ok(served) => Ok(served),
            // Any worker would answer the same (not found, version changed): no fallback.
            Err(e @ TransportError::Remote { kind, .. }) if !kind.is_temporary() => Err(Miss::Final(e)),
            Err(e) => {
                debug!(socket = %self.socket, block = ask.req.block_index, path = %ask.req.path, err = %e, "sidecar failed; reading from the cluster");
                metrics::counter!(METRIC_SIDECAR_FALLBACKS).increment(1);
                Err(Miss::Next(Some(e)))
            }
        }
    }
}

/// A worker on this host, read by mapping the blocks it passes through its Unix socket. Blocks
/// too small to be worth a mapping, a worker elsewhere, and any failure are misses: it is read
/// over TCP next.
pub(crate) struct LocalWorker<'a> {
    pub(crate) member: &'a Member,
    pub(crate) local: &'a LocalWorkers,
    pub(crate) dial: &'a Dial,
}

#[async_trait]
impl BlockSource for LocalWorker<'_> {
    fn key(&self) -> &str {
        &self.member.local_socket
    }

    async fn read(&self, ask: &BlockAsk<'_>, sink: &mut Sink<'_>) -> Result<Served, Miss> {
        let req = &ask.req;
        let block_len = strata_common::block::block_len(req.file_size, req.block_size, req.block_index);
        if block_len < MIN_MAPPED_BLOCK {
            return Err(Miss::Next(None));
        }
        let Some(local) = self.local.find(self.member, self.dial).await else { return Err(Miss::Next(None)) };
        if local.backing_off() {
            return Err(Miss::Next(None));
        }
        match local.read_block(req).await {
            Ok(bytes) if bytes.len() as u64 == req.len => Ok(sink.deliver(bytes)),
            Ok(bytes) => {
                debug!(worker = %self.member.id, block = req.block_index, path = %req.path, got = bytes.len(), "short-circuit read of the wrong length; reading over TCP");
                Err(Miss::Next(None))
            }
            Err(e) => {
                debug!(worker = %self.member.id, block = req.block_index, path = %req.path, err = %e, "short-circuit read failed; reading over TCP");
                Err(Miss::Next(None))
            }
        }
    }
}

/// What the read path counts, for this client alone (beside the process-wide metrics).
#[derive(Debug, Default)]
pub(crate) struct RouteCounters {
    pub(crate) failovers: AtomicU64,
    pub(crate) hedges: AtomicU64,
    pub(crate) local_reads: AtomicU64,
}

/// A block's owners on the placement ring, as the [`ClusterView`] has it: ordered for asking
/// (see [`Owners::in_asking_order`]), the first one read by short-circuit when it runs on this
/// host, then all of them hedged; when every owner failed, once more on a ring refreshed from
/// the master (the membership may have moved under the read).
pub(crate) struct Owners {
    pub(crate) view: Arc<ClusterView>,
    pub(crate) transport: Arc<dyn Transport>,
    pub(crate) health: Health,
    pub(crate) in_flight: Arc<InFlight>,
    pub(crate) local: Option<LocalWorkers>,
    pub(crate) dial: Dial,
    /// This client's node, for read replicas on the same node.
    pub(crate) node: Option<String>,
    pub(crate) counters: Arc<RouteCounters>,
}

impl Owners {
    /// A block's owners (in ring order) in the order they are asked: those neither the master
    /// nor this client suspects first, each group in ring order (so placement, and with it the
    /// cache, holds) — except that with `read_replicas` > 1 the first one asked is chosen among
    /// the first `read_replicas` owners: one on this client's node, else the less busy of two
    /// (`spread`).
    pub(crate) fn in_asking_order<'r>(
        &self,
        owners: Vec<&'r Member>,
        read_replicas: usize,
    ) -> Vec<&'r Member> {
        let now = Instant::now();
        let view = self.view.read();
        let node = self.node.as_deref().filter(|n| !n.is_empty());
        let mut trusted = Vec::with_capacity(owners.len());
        let mut suspect = Vec::new();
        for (rank, m) in owners.into_iter().enumerate() {
            if view.suspects.contains(&m.id) || self.health.is_suspect(&m.data_addr, now) {
                suspect.push(m);
            } else {
                // Only candidates need their load; the rest keep their place whatever it is.
                let in_flight = if rank < read_replicas { self.in_flight.get(&m.data_addr) } else { 0 };
                // A worker whose socket answered here is on this host, whatever nodes say.
                let local = node.is_some_and(|n| n == m.node)
                    || self.local.as_ref().is_some_and(|l| l.found(m).is_some());
                trusted.push((m, rank, spread::Candidate { local, in_flight }));
            }
        }
        drop(view);
        let (order, first) = spread::asking_order(trusted, suspect, read_replicas, &mut rand::rng());
        if first.is_some_and(|c| c.local) {
            metrics::counter!(METRIC_LOCAL_READS).increment(1);
            self.counters.local_reads.fetch_add(1, Ordering::Relaxed);
        }
        order
    }

    /// The owners of `ask`'s block, in asking order, on the ring in use (or the last one that
    /// had members); `None` when no worker is known at all.
    pub(crate) async fn owners_of(&self, ask: &BlockAsk<'_>) -> Option<Vec<Member>> {
        let mut ring = self.view.ring().await;
        if ring.is_empty() {
            ring = self.view.read().last_members.clone();
        }
        if ring.is_empty() {
            return None;
        }
        let hash = BlockKey::new(ask.info.file_id.clone(), ask.info.version.clone(), ask.req.block_index)
            .placement_hash();
        let owners = ring.owners(hash, ring.members().len());
        Some(
            self.in_asking_order(owners, self.view.read_replicas_for(&ask.info.path))
                .into_iter()
                .cloned()
                .collect(),
        )
    }
}

#[async_trait]
impl BlockSource for Owners {
    fn key(&self) -> &str {
        "ring"
    }

    async fn read(&self, ask: &BlockAsk<'_>, sink: &mut Sink<'_>) -> Result<Served, Miss> {
        let mut last = None;
        for round in 0..2 {
            if round == 1 {
                // Every worker we knew failed: the membership may have moved under us.
                self.view.refresh(false).await.ok();
            }
            let Some(owners) = self.owners_of(ask).await else {
                return Err(Miss::Next(last));
            };
            if round == 0
                && let (Some(first), Some(local)) = (owners.first(), &self.local)
            {
                let here = LocalWorker { member: first, local, dial: &self.dial };
                if let Ok(served) = here.read(ask, sink).await {
                    return Ok(served);
                }
            }
            let sources: Vec<Arc<dyn BlockSource>> = owners
                .into_iter()
                .map(|m| {
                    Arc::new(Worker::new(m, self.transport.clone(), self.in_flight.clone()))
                        as Arc<dyn BlockSource>
                })
                .collect();
            let hedged = Hedged { health: &self.health, hedges: &self.counters.hedges };
            match hedged.read(&sources, ask, sink).await {
                Ok(won) => {
                    if won.by > 0 || round > 0 {
                        metrics::counter!(METRIC_FAILOVERS).increment(1);
                        self.counters.failovers.fetch_add(1, Ordering::Relaxed);
                    }
                    return Ok(won.served);
                }
                Err(fin @ Miss::Final(_)) => return Err(fin),
                Err(Miss::Next(e)) => last = e.or(last),
            }
        }
        Err(Miss::Next(last))
    }
}

/// The read path of a client: what it asks, in which order (see the module).
pub(crate) struct Router {
    /// The sidecar's grants and socket, then the ring.
    cluster: Chain,
    pub(crate) ring: Arc<Owners>,
    pub(crate) sidecar: Option<Arc<Sidecar>>,
    pub(crate) short_circuit: Option<Arc<SidecarGrant>>,
    pub(crate) transport: Arc<dyn Transport>,
}

impl Router {
    pub(crate) fn new(ring: Owners, sidecar: Option<Sidecar>, short_circuit: Option<ShortCircuit>) -> Self {
        let ring = Arc::new(ring);
        let sidecar = sidecar.map(Arc::new);
        let short_circuit = short_circuit.map(|sc| Arc::new(SidecarGrant(sc)));
        let mut sources: Vec<Arc<dyn BlockSource>> = Vec::new();
        if let Some(grant) = &short_circuit {
            sources.push(grant.clone());
        }
        if let Some(sidecar) = &sidecar {
            sources.push(sidecar.clone());
        }
        sources.push(ring.clone());
        let transport = ring.transport.clone();
        Self { cluster: Chain::new(sources), ring, sidecar, short_circuit, transport }
    }

    /// One block range of `info` (a part of one block), into `sink`.
    pub(crate) async fn read(&self, ask: &BlockAsk<'_>, sink: &mut Sink<'_>) -> crate::Result<Served> {
        if !ask.info.holders.is_empty() {
            return self.read_journal(ask, sink).await;
        }
        self.cluster.read(ask, sink).await.map_err(|m| match m {
            Miss::Final(e) => ClientError::from_transport(e),
            Miss::Next(e) => match e {
                None if self.ring.view.read().usable_ring().is_empty() => {
                    ClientError::unavailable("no live workers in the cluster")
                }
                e => ClientError::unserved(e, "no worker answered"),
            },
        })
    }

    /// A block range of a write-back file not yet uploaded, from the workers whose journals
    /// hold it (spread over them by block, the next on failure).
    async fn read_journal(&self, ask: &BlockAsk<'_>, sink: &mut Sink<'_>) -> crate::Result<Served> {
        let holders = &ask.info.holders;
        let n = holders.len();
        let first = ask.req.block_index as usize % n;
        let sources: Vec<Arc<dyn BlockSource>> = (0..n)
            .map(|i| {
                let m = holders[(first + i) % n].clone();
                Arc::new(Worker::new(m, self.transport.clone(), self.ring.in_flight.clone()))
                    as Arc<dyn BlockSource>
            })
            .collect();
        Chain::new(sources).read(ask, sink).await.map_err(|m| match m {
            Miss::Final(e) => ClientError::from_transport(e),
            Miss::Next(e) => ClientError::unserved(e, "no worker holding the file's journal answered"),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use strata_common::ErrorKind;

    use super::*;
    use crate::HedgePolicy;

    /// What a fake source does when asked.
    #[derive(Clone)]
    enum Does {
        Serve(&'static [u8]),
        /// Fails as a worker that is down does.
        Fail,
        /// A refusal every worker would give.
        Refuse(ErrorKind),
        /// Never answers (a frozen worker).
        Freeze,
    }

    struct Fake {
        id: String,
        does: Does,
        /// The version of each request it was asked.
        asked: Mutex<Vec<String>>,
    }

    impl Fake {
        fn new(id: &str, does: Does) -> Arc<Self> {
            Arc::new(Self { id: id.into(), does, asked: Mutex::default() })
        }

        fn asked(&self) -> Vec<String> {
            self.asked.lock().unwrap().clone()
        }
    }

    #[async_trait]
    impl BlockSource for Fake {
        fn key(&self) -> &str {
            &self.id
        }

        async fn read(&self, ask: &BlockAsk<'_>, sink: &mut Sink<'_>) -> Result<Served, Miss> {
            self.asked.lock().unwrap().push(ask.req.version.clone());
            match self.does.clone() {
                Does::Serve(bytes) => Ok(sink.deliver(Bytes::from_static(bytes))),
                Does::Fail => Err(miss(TransportError::Connect {
                    addr: self.id.clone(),
                    source: std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
                })),
                Does::Refuse(kind) => Err(miss(TransportError::Remote {
                    addr: self.id.clone(),
                    kind,
                    message: "refused".into(),
                })),
                Does::Freeze => std::future::pending().await,
            }
        }
    }

    fn info(version: &str) -> FileInfo {
        FileInfo {
            path: "/d/f".into(),
            is_dir: false,
            size: 5,
            version: version.into(),
            mtime_ms: 0,
            block_size: 1 << 20,
            file_id: "fake:///d/f".into(),
            holders: Vec::new(),
            persist: crate::Persist::Persisted,
        }
    }

    fn sources(fakes: &[&Arc<Fake>]) -> Vec<Arc<dyn BlockSource>> {
        fakes.iter().map(|f| (*f).clone() as Arc<dyn BlockSource>).collect()
    }

    #[tokio::test]
    async fn a_chain_asks_in_order_until_one_serves_and_stops_at_a_refusal() {
        let info = info("v1");
        let ask = BlockAsk::new(&info, 0, 0, 5);
        let (grant, sidecar, ring) = (
            Fake::new("grant", Does::Fail),
            Fake::new("sidecar", Does::Fail),
            Fake::new("ring", Does::Serve(b"hello")),
        );
        let chain = Chain::new(sources(&[&grant, &sidecar, &ring]));
        let got = chain.read(&ask, &mut Sink::New).await.unwrap();
        assert_eq!(got.as_deref(), Some(&b"hello"[..]));
        assert_eq!((grant.asked().len(), sidecar.asked().len(), ring.asked().len()), (1, 1, 1));

        // A refusal any source would give ends the read: the ring is not asked.
        let (sidecar, ring) =
            (Fake::new("sidecar", Does::Refuse(ErrorKind::NotFound)), Fake::new("ring", Does::Serve(b"x")));
        let chain = Chain::new(sources(&[&sidecar, &ring]));
        let e = chain.read(&ask, &mut Sink::New).await.unwrap_err();
        assert!(matches!(e, Miss::Final(TransportError::Remote { kind: ErrorKind::NotFound, .. })), "{e:?}");
        assert!(ring.asked().is_empty());

        // Nothing serves: the last failure is what the caller hears.
        let chain = Chain::new(sources(&[&Fake::new("a", Does::Fail), &Fake::new("b", Does::Fail)]));
        match chain.read(&ask, &mut Sink::New).await.unwrap_err() {
            Miss::Next(Some(TransportError::Connect { addr, .. })) => assert_eq!(addr, "b"),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_hedged_read_goes_past_a_frozen_source_within_the_hedging_deadline() {
        let info = info("v1");
        let ask = BlockAsk::new(&info, 0, 0, 5);
        let health =
            Health::new(HedgePolicy { min: Duration::from_millis(100), max: Duration::from_millis(700) });
        let hedges = AtomicU64::new(0);
        let (frozen, next) = (Fake::new("frozen", Does::Freeze), Fake::new("next", Does::Serve(b"hello")));
        let started = Instant::now();
        let mut buf = [0u8; 5];
        let won = Hedged { health: &health, hedges: &hedges }
            .read(&sources(&[&frozen, &next]), &ask, &mut Sink::Into(&mut buf))
            .await
            .unwrap();
        assert_eq!((won.by, won.served), (1, None), "the second served, into the caller's buffer");
        assert_eq!(&buf, b"hello");
        let waited = started.elapsed();
        assert!(waited >= Duration::from_millis(700) && waited < Duration::from_millis(800), "{waited:?}");
        assert_eq!(hedges.load(Ordering::Relaxed), 1);
        // Outrun twice, the frozen source is suspect: asked last for a while.
        Hedged { health: &health, hedges: &hedges }
            .read(&sources(&[&frozen, &next]), &ask, &mut Sink::New)
            .await
            .unwrap();
        assert!(health.is_suspect("frozen", Instant::now()));
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_source_is_passed_at_once_and_a_refusal_is_final() {
        let info = info("v1");
        let ask = BlockAsk::new(&info, 0, 0, 5);
        let health = Health::new(HedgePolicy::default());
        let hedges = AtomicU64::new(0);
        let started = Instant::now();
        let (down, up) = (Fake::new("down", Does::Fail), Fake::new("up", Does::Serve(b"hello")));
        let won = Hedged { health: &health, hedges: &hedges }
            .read(&sources(&[&down, &up]), &ask, &mut Sink::New)
            .await
            .unwrap();
        assert_eq!((won.by, won.served.as_deref()), (1, Some(&b"hello"[..])));
        assert_eq!(started.elapsed(), Duration::ZERO, "no deadline waited for a worker that is down");
        assert_eq!(hedges.load(Ordering::Relaxed), 0, "failing over is not hedging");

        let (changed, other) =
            (Fake::new("a", Does::Refuse(ErrorKind::VersionChanged)), Fake::new("b", Does::Serve(b"x")));
        let e = Hedged { health: &health, hedges: &hedges }
            .read(&sources(&[&changed, &other]), &ask, &mut Sink::New)
            .await
            .err()
            .expect("refused");
        assert!(matches!(e, Miss::Final(TransportError::Remote { kind: ErrorKind::VersionChanged, .. })));
        assert!(other.asked().is_empty(), "a changed version is not asked of another worker");
    }

    #[tokio::test]
    async fn every_source_is_asked_for_the_version_the_read_was_given() {
        let v1 = info("v1");
        let (a, b) = (Fake::new("a", Does::Fail), Fake::new("b", Does::Serve(b"hello")));
        let chain = Chain::new(sources(&[&a, &b]));
        chain.read(&BlockAsk::new(&v1, 0, 0, 5), &mut Sink::New).await.unwrap();
        let v2 = info("v2");
        chain.read(&BlockAsk::new(&v2, 0, 0, 5), &mut Sink::New).await.unwrap();
        assert_eq!(a.asked(), ["v1", "v2"]);
        assert_eq!(
            b.asked(),
            ["v1", "v2"],
            "a read never mixes versions: each ask names the one it was given"
        );
    }
}
