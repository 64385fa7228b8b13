//! The Strata client SDK: what every front end (CLI, Python, benchmarks) reads through.
//!
//! A read resolves the path's version and size through the master (cached for the mount's
//! metadata TTL), maps the byte range to blocks, and asks each block's owner — computed on
//! the placement ring from the membership the master publishes, never asked per block — over
//! the data plane. A worker that is down or fails is skipped for the next one on the ring (any
//! worker can fetch any block from the UFS); the caller only sees an error when no live worker
//! could serve. All blocks of one read come from one version of the file: a version change
//! mid-read is detected by the workers and the read is retried whole on the new version.
//!
//! In a pod with a sidecar worker (`ClientConfig::sidecar_socket`, env
//! `STRATA_SIDECAR_SOCKET`), every block is asked of the sidecar over its Unix socket first;
//! when the sidecar cannot serve (not running, timed out, a temporary error) the block is read
//! from the cluster over TCP as usual, so a missing sidecar slows a job down but never fails it.
//! Before the framed read, the sidecar is asked for a short-circuit grant (`shortcircuit`): a
//! passed file descriptor mapped in place; any failure there falls back to the framed read.
//!
//! When the master is unreachable (`outage`), the client answers metadata from what it has seen
//! (stats, whole listings, membership and mounts) for `master_outage_grace`, asks a worker to
//! stat at the UFS what it has not seen, and a client that cannot reach the master at start
//! starts from a worker's or the sidecar's last view of the cluster.
//!
//! The layers, each its own module: `config` (what a client is told), `master` (the link to
//! the master, and the outage state it moves), `view` (membership and mounts), `metadata` (the
//! [`Metadata`] trait: stats, listings and namespace changes, with the master-backed
//! implementation and an in-memory fake), `route` (where blocks are read from: one small source
//! per place, composed), `admin` (mounts, pins, jobs, tokens: [`AdminClient`]). [`Client`] is the
//! facade every front end holds: reads, streaming readers and writers over those layers.

mod admin;
mod batch;
mod config;
mod error;
mod fsops;
mod health;
mod jobs;
mod lineage;
mod listings;
mod local;
mod master;
mod metadata;
pub mod outage;
mod prefetch;
mod rdma;
mod reader;
mod route;
pub mod shortcircuit;
mod spread;
mod tokens;
pub mod transport;
mod types;
mod upstream;
mod view;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
pub use strata_common::qos::{QOS_ENV, QosClass};
use strata_common::{BlockSlice, Ring, block_slices};
use strata_proto::leader::{DEFAULT_FOLLOW_FOR, LeaderChannel};
use tonic::transport::Endpoint;
use tracing::debug;
use transport::Sink;

use crate::master::MasterLink;
use crate::route::{BlockAsk, Owners, RouteCounters, Router, Sidecar};
use crate::view::{ClusterView, View};

pub use admin::AdminClient;
pub use batch::{MAX_BATCH_BYTES, ReadSpec};
pub use config::{ClientConfig, SIDECAR_SOCKET_ENV, Token, WORKERS_ENV};
pub use error::{ClientError, Result, Unserved};
pub use fsops::{Copied, CopiedBy, Moved, StrataWriter};
pub use health::HedgePolicy;
pub use jobs::job_finished;
pub use lineage::{JOB_ENV, LINEAGE_ENV, LINEAGE_FLUSH_ENV, LineageCounters, METRIC_LINEAGE_DROPPED};
#[cfg(any(test, feature = "testing"))]
pub use metadata::FakeMetadata;
pub use metadata::{MasterMetadata, Metadata, STAT_MANY_CHUNK};
pub use outage::{OUTAGE_GRACE_ENV, OutageCounters};
pub use prefetch::{MAX_HINTED_BLOCKS_PER_FILE, METRIC_PREFETCH_UNKNOWN, Prefetched};
#[cfg(feature = "rdma")]
pub use rdma::VerbsReader;
pub use rdma::{EmulatedReader, METRIC_RDMA_FALLBACKS, RdmaMode, RdmaTransport, RemoteReader};
pub use reader::StrataReader;
pub use strata_proto::{
    Applied, CacheTtlInfo, FreeResponse, LocateResponse, PinInfo, PinTier, WorkerLocality,
};
pub use strata_proto::{ClusterStatus, JobInfo, JobState, LoadOptions, ScheduleInfo, TokenInfo};
pub use strata_proto::{PendingFile, PersistState};
pub use strata_security::tls::TlsConfig;
#[cfg(any(test, feature = "testing"))]
pub use transport::FaultyTransport;
pub use transport::{Credentials, DataStream, Dial, TcpTransport, Transport, TransportError, UnixTransport};
pub use types::{FileInfo, MountInfo, Page, Persist};
pub use upstream::{ClusterUpstream, PeerUpstream};

/// Counter: block reads that a worker could not serve and the next worker on the ring did.
pub const METRIC_FAILOVERS: &str = "strata_client_failovers_total";
/// Counter: block reads sent to a second worker because the first had not answered within its
/// hedging deadline (see [`HedgePolicy`]).
pub const METRIC_HEDGES: &str = "strata_client_hedged_reads_total";
/// Counter: block reads first sent to a read replica on the client's own node
/// ([`ClientConfig::node`]).
pub const METRIC_LOCAL_READS: &str = "strata_client_local_reads_total";
/// Counter: block reads the sidecar could not serve that went to the cluster over TCP.
pub const METRIC_SIDECAR_FALLBACKS: &str = "strata_client_sidecar_fallbacks_total";

/// The name of a pin's tier (`PinInfo::tier`) as the front ends show it.
pub fn pin_tier_name(tier: i32) -> &'static str {
    match PinTier::try_from(tier) {
        Ok(PinTier::Memory) => "memory",
        _ => "nvme",
    }
}

/// The tier a user names for a pin: `memory` (or `dram`) or `nvme`.
pub fn parse_pin_tier(name: &str) -> std::result::Result<PinTier, String> {
    match name {
        "memory" | "dram" => Ok(PinTier::Memory),
        "nvme" => Ok(PinTier::Nvme),
        other => Err(format!("tier {other:?}: expected memory or nvme")),
    }
}

struct Inner {
    config: ClientConfig,
    /// How data-plane connections are made (timeout, TLS), from `config`.
    dial: Dial,
    master: Arc<MasterLink>,
    view: Arc<ClusterView>,
    metadata: Arc<MasterMetadata>,
    /// Where blocks are read from, in which order (`route`).
    route: Router,
    counters: Arc<RouteCounters>,
    /// This client's reads not yet reported (none when lineage is off).
    lineage: Option<Arc<lineage::Recorder>>,
    /// Workers each prefetch stream last hinted.
    prefetch: prefetch::Streams,
}

impl Drop for Inner {
    fn drop(&mut self) {
        lineage::report_on_drop(self);
    }
}

/// A cheap-to-clone handle; clones share connections and caches.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl Client {
    /// Connects to the master (failing fast if it is unreachable) with the TCP transport, or
    /// RDMA grants as `config.rdma` says.
    pub async fn connect(config: ClientConfig) -> Result<Self> {
        config.check_env()?;
        let transport = rdma::transport_for(config.rdma, &dial(&config)?, config.request_timeout);
        Self::connect_with_transport(config, transport).await
    }

    /// When the master cannot be reached and a sidecar or workers are configured
    /// (`sidecar_socket`, `workers`), the client starts from the first one's last view of the
    /// membership and mounts, in an outage that began when that worker last heard from the
    /// master (see [`outage`]).
    pub async fn connect_with_transport(config: ClientConfig, transport: Arc<dyn Transport>) -> Result<Self> {
        let dial = dial(&config)?;
        let channel = master_channel(&config, &dial)?;
        let can_bootstrap = config.sidecar_socket.is_some() || !config.workers.is_empty();
        // A stopped master accepts the connection and never answers: bounded when there is
        // somewhere else to start from.
        let deadline =
            if can_bootstrap { outage::FALLBACK_DEADLINE.max(config.connect_timeout) } else { Duration::MAX };
        // Fail fast when no master answers at all; which one leads is the channel's business.
        let mut last_err = None;
        for addr in channel.masters() {
            match tokio::time::timeout(deadline, master_endpoint(&dial, addr)?.connect()).await {
                Ok(Ok(_)) => {
                    last_err = None;
                    break;
                }
                Ok(Err(e)) => last_err = Some(format!("{addr}: {}", error_chain(&e))),
                Err(_) => last_err = Some(format!("{addr}: no connection within {} s", deadline.as_secs())),
            }
        }
        let unreachable = match last_err {
            None => None,
            Some(e) => {
                let over = if config.tls.ca.is_some() { " over TLS" } else { "" };
                let err = ClientError::MasterUnavailable(format!(
                    "cannot reach the master at {}{over}: {e}",
                    config.master_addr
                ));
                if !can_bootstrap {
                    return Err(err);
                }
                Some(err)
            }
        };
        let first_master = channel.masters().first().cloned().unwrap_or_default();
        let view = View::empty(config.clock.now());
        let recorder = config.lineage.then(|| Arc::new(lineage::Recorder::new(config.job.as_deref())));
        let client = Self::assemble(config, dial, transport, channel, view, HashMap::new(), recorder);
        let refreshed = match unreachable {
            None => client.inner.view.refresh(can_bootstrap).await,
            Some(err) => Err(err),
        };
        // gRPC reports a TLS mismatch as a bare "transport error": say what it is.
        let refreshed = match refreshed {
            Err(e) if !matches!(e, ClientError::NotFound(_) | ClientError::PermissionDenied(_)) => {
                match transport::tls_diagnosis(&first_master, &client.inner.dial).await {
                    Some(why) => {
                        let what = match e {
                            ClientError::MasterUnavailable(m) => m,
                            other => other.to_string(),
                        };
                        Err(ClientError::MasterUnavailable(format!("{what}; {why}")))
                    }
                    None => Err(e),
                }
            }
            other => other,
        };
        match refreshed {
            Ok(()) => Ok(client),
            Err(e) if can_bootstrap && e.is_master_outage() => {
                client.start_from_worker_view(e).await?;
                Ok(client)
            }
            Err(e) => Err(e),
        }
    }

    /// Takes the membership and mounts of the first worker (the sidecar first) that answers a
    /// `View`, and begins an outage as of when that worker last heard from the master.
    async fn start_from_worker_view(&self, master_err: ClientError) -> Result<()> {
        let req_id = 1;
        let frame = strata_common::frame::view_request(req_id);
        let candidates = self.inner.view.worker_candidates(None);
        let timeout = self.inner.config.connect_timeout.max(outage::FALLBACK_DEADLINE);
        for (via, addr) in &candidates {
            let answer = transport::ask(
                *via,
                addr,
                &frame,
                req_id,
                strata_proto::MAX_MESSAGE_BYTES as u64,
                &self.inner.dial,
                timeout,
            )
            .await;
            let view = match answer.map(|b| strata_proto::WorkerView::from_bytes(&b)) {
                Ok(Ok(view)) => view,
                Ok(Err(e)) => {
                    debug!(worker = %addr, err = %e, "a worker's view did not decode");
                    continue;
                }
                Err(e) => {
                    debug!(worker = %addr, err = %e, "no view of the cluster from this worker");
                    continue;
                }
            };
            self.inner.view.set(view.membership.unwrap_or_default(), view.mounts.unwrap_or_default().mounts);
            let clock = &self.inner.config.clock;
            let outages = self.inner.master.outage();
            outages.started_from_worker(clock.now(), clock.wall_ms(), view.master_seen_unix_ms, addr);
            return outages.check_grace(clock.now());
        }
        let why = match master_err {
            ClientError::MasterUnavailable(m) => m,
            other => other.to_string(),
        };
        let asked: Vec<&str> = candidates.iter().map(|(_, a)| a.as_str()).collect();
        Err(ClientError::MasterUnavailable(format!(
            "{why}; and no worker or sidecar gave its view of the cluster (asked: {})",
            asked.join(", ")
        )))
    }

    /// How this client makes data-plane connections (timeout, TLS).
    pub(crate) fn dial(&self) -> &Dial {
        &self.inner.dial
    }

    /// What this client served while the master was unreachable.
    pub fn outage_counters(&self) -> OutageCounters {
        self.inner.master.outage().counters()
    }

    /// A client with this one's configuration and cached metadata (membership, mounts, stats)
    /// and none of its connections, for another tokio runtime: the Python binding makes one
    /// after a fork shut its runtime down, so the first read after the fork costs a data-plane
    /// connection, not a master round trip. The master is connected on first use. Call inside
    /// the runtime that will run it.
    pub fn with_new_connections(&self) -> Result<Self> {
        let config = self.inner.config.clone();
        let dial = self.inner.dial.clone();
        let channel = master_channel(&config, &dial)?;
        let transport = rdma::transport_for(config.rdma, &dial, config.request_timeout);
        let view = self.inner.view.snapshot();
        let stats = self.inner.metadata.stats_snapshot();
        let recorder = self.inner.lineage.as_ref().map(|r| Arc::new(r.carried_over()));
        Ok(Self::assemble(config, dial, transport, channel, view, stats, recorder))
    }

    fn assemble(
        config: ClientConfig,
        dial: Dial,
        transport: Arc<dyn Transport>,
        channel: LeaderChannel,
        view: View,
        stats: HashMap<String, (Instant, FileInfo)>,
        recorder: Option<Arc<lineage::Recorder>>,
    ) -> Self {
        let credentials = dial.credentials.clone();
        let master = Arc::new(MasterLink::new(channel, &config));
        let cluster = Arc::new(ClusterView::new(master.clone(), &config, view));
        let metadata =
            Arc::new(MasterMetadata::new(master.clone(), cluster.clone(), dial.clone(), &config, stats));
        let sidecar = config.sidecar_socket.as_ref().map(|p| Sidecar {
            socket: p.display().to_string(),
            transport: Arc::new(UnixTransport::with_credentials(
                config.connect_timeout,
                config.request_timeout,
                credentials.clone(),
            )),
        });
        let short_circuit = config.sidecar_socket.as_ref().filter(|_| config.short_circuit).map(|p| {
            shortcircuit::ShortCircuit::new(
                p.display().to_string(),
                config.connect_timeout,
                config.request_timeout,
                config.short_circuit_cache_bytes,
                config.clock.clone(),
                credentials.clone(),
                strata_common::frame::GrantKind::Fd,
            )
        });
        let local = config.short_circuit.then(|| {
            local::LocalWorkers::new(local::LocalSettings {
                connect_timeout: config.connect_timeout,
                request_timeout: config.request_timeout,
                cache_bytes: config.short_circuit_cache_bytes,
                clock: config.clock.clone(),
                credentials: credentials.clone(),
            })
        });
        let counters = Arc::new(RouteCounters::default());
        let owners = Owners {
            view: cluster.clone(),
            transport,
            health: health::Health::new(config.hedge),
            in_flight: Arc::default(),
            local,
            dial: dial.clone(),
            node: config.node.clone(),
            counters: counters.clone(),
        };
        let flush_every = config.lineage_flush_interval;
        let inner = Arc::new(Inner {
            route: Router::new(owners, sidecar, short_circuit),
            counters,
            master,
            view: cluster,
            metadata,
            lineage: recorder.clone(),
            prefetch: Default::default(),
            config,
            dial,
        });
        if let Some(recorder) = recorder {
            lineage::spawn_flusher(Arc::downgrade(&inner), recorder, flush_every);
        }
        Self { inner }
    }

    /// Block reads that another worker served after the owner failed (as the
    /// `strata_client_failovers_total` metric, for this client alone).
    pub fn failovers(&self) -> u64 {
        self.inner.counters.failovers.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Block reads sent to a second worker because the first was slow to answer (as the
    /// `strata_client_hedged_reads_total` metric, for this client alone).
    pub fn hedged_reads(&self) -> u64 {
        self.inner.counters.hedges.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Block reads served by mapping a descriptor a worker passed — the sidecar, or a worker on
    /// this host — rather than bytes through a socket (as the
    /// `strata_client_short_circuit_reads_total` metric, for this client alone).
    pub fn short_circuit_reads(&self) -> u64 {
        let route = &self.inner.route;
        route.short_circuit.as_ref().map_or(0, |sc| sc.0.reads())
            + route.ring.local.as_ref().map_or(0, |l| l.reads())
    }

    /// Short-circuit attempts this client read through a socket or over TCP instead, by why
    /// (as the `strata_client_short_circuit_fallbacks_total` metric, for this client alone).
    pub fn short_circuit_fallbacks(&self) -> shortcircuit::ShortCircuitFallbacks {
        let route = &self.inner.route;
        route.short_circuit.as_ref().map(|sc| sc.0.fallbacks()).unwrap_or_default()
            + route.ring.local.as_ref().map(|l| l.fallbacks()).unwrap_or_default()
    }

    /// Block reads first sent to a read replica on this client's node (as the
    /// `strata_client_local_reads_total` metric, for this client alone).
    pub fn local_reads(&self) -> u64 {
        self.inner.counters.local_reads.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn config(&self) -> &ClientConfig {
        &self.inner.config
    }

    /// The namespace (stats, listings, changes) this client reads through, as the trait a
    /// front end is written against.
    pub fn metadata(&self) -> Arc<dyn Metadata> {
        self.inner.metadata.clone()
    }

    /// The mount table as last learnt (no call; refreshed with the membership).
    pub fn known_mounts(&self) -> Vec<MountInfo> {
        self.inner.metadata.mounts()
    }

    /// The `read_replicas` of the mount holding `path` (normalised), `None` when this client
    /// knows no such mount.
    pub fn mount_read_replicas(&self, path: &str) -> Option<usize> {
        self.inner.view.mount_read_replicas(path)
    }

    /// How many of a block's first ring owners a read of `path` may ask first (1 for a path
    /// under no known mount).
    pub fn read_replicas_for(&self, path: &str) -> usize {
        self.inner.view.read_replicas_for(path)
    }

    /// Fetches membership and mounts from the master now.
    pub async fn refresh_view(&self) -> Result<()> {
        self.inner.view.refresh(false).await
    }

    /// The placement ring in use (after refreshing it if it is older than the refresh period).
    pub async fn ring(&self) -> Result<Ring> {
        Ok(self.inner.view.ring().await)
    }

    /// Metadata of a file or directory. `sync` bypasses every cache and asks the UFS (see
    /// [`MasterMetadata`] for what is cached and what an outage serves).
    pub async fn stat_with(&self, raw: &str, sync: bool) -> Result<FileInfo> {
        self.inner.metadata.stat(raw, sync).await
    }

    pub async fn stat(&self, path: &str) -> Result<FileInfo> {
        self.stat_with(path, false).await
    }

    /// Metadata of many paths, one result per path in order (see [`Metadata::stat_many`]).
    pub async fn stat_many(&self, paths: &[&str]) -> Vec<Result<FileInfo>> {
        self.inner.metadata.stat_many(paths).await
    }

    /// Children of a directory (or the file itself), every page of them. For a directory too
    /// large to hold, use [`list_page`](Self::list_page).
    pub async fn list(&self, raw: &str) -> Result<Vec<FileInfo>> {
        let mut all = Vec::new();
        let mut token = String::new();
        loop {
            let (page, next) = self.list_page(raw, &token, 0).await?;
            all.extend(page);
            match next {
                Some(next) => token = next,
                None => return Ok(all),
            }
        }
    }

    /// One page of a directory's children in name order (the file itself for a file): those
    /// after `page_token` ("" for the first page), at most `page_size` (0: the master's
    /// default), and the token of the next page when there is one.
    pub async fn list_page(&self, raw: &str, page_token: &str, page_size: u32) -> Result<Page> {
        self.inner.metadata.list_page(raw, page_token, page_size).await
    }

    /// One page of every file under `raw` (recursively; the file itself for a file), in the
    /// UFS's listing order: those after `page_token`, at most `page_size`, only `max_depth`
    /// levels down (0: all), and the token of the next page when there is one. One stream for
    /// `find`, `glob` and `du` instead of a listing per directory.
    pub async fn find_page(
        &self,
        raw: &str,
        page_token: &str,
        page_size: u32,
        max_depth: u32,
    ) -> Result<Page> {
        self.inner.metadata.find_page(raw, page_token, page_size, max_depth, false).await
    }

    /// [`find_page`](Client::find_page) with every directory below `raw` too, each just before
    /// what it holds, on mounts listed directory by directory (a local directory, HDFS: their
    /// empty directories exist and no file implies them); an object store's names files only.
    /// Asks the master every time: pages with directories are not kept for outages (a caller
    /// falls back to `find_page` then).
    pub async fn find_page_with_dirs(
        &self,
        raw: &str,
        page_token: &str,
        page_size: u32,
        max_depth: u32,
    ) -> Result<Page> {
        self.inner.metadata.find_page(raw, page_token, page_size, max_depth, true).await
    }

    /// `len` bytes from `offset` (fewer at the end of the file, none past it).
    pub async fn read_range(&self, path: &str, offset: u64, len: u64) -> Result<Bytes> {
        let info = self.stat(path).await?;
        match self.read_range_of(&info, offset, len).await {
            Err(ClientError::Changed(_)) => {
                // Our idea of the version was stale: learn the new one and read it whole.
                let info = self.stat_with(path, true).await?;
                self.read_range_of(&info, offset, len).await
            }
            other => other,
        }
    }

    /// The whole file.
    pub async fn read_all(&self, path: &str) -> Result<Bytes> {
        self.read_range(path, 0, u64::MAX).await
    }

    /// Reads a range of one known version of a file.
    pub async fn read_range_of(&self, info: &FileInfo, offset: u64, len: u64) -> Result<Bytes> {
        if info.is_dir {
            return Err(ClientError::IsDirectory(info.path.clone()));
        }
        let len = len.min(info.size.saturating_sub(offset));
        if len > self.inner.config.max_read_len {
            return Err(ClientError::InvalidArgument(format!(
                "a read of {len} bytes exceeds the limit of {} bytes; use a streaming reader",
                self.inner.config.max_read_len
            )));
        }
        let slices = block_slices(info.size, info.block_size, offset, len);
        match slices.len() {
            0 => return Ok(Bytes::new()),
            1 => return self.read_slice(info, slices[0]).await,
            _ => {}
        }
        // Received in place (see `read_into`) rather than block by block and then copied.
        let mut out = vec![0u8; len as usize];
        self.read_into(info, offset, &mut out).await?;
        Ok(Bytes::from(out))
    }

    /// One block's part of a read, from wherever the read path finds it (`route`).
    async fn read_slice(&self, info: &FileInfo, slice: BlockSlice) -> Result<Bytes> {
        Ok(self.read_slice_to(info, slice, Sink::New).await?.unwrap_or_default())
    }

    /// [`read_slice`](Self::read_slice) into `sink`: a new buffer (returned) or the caller's;
    /// recorded for lineage once served, whichever way it was.
    async fn read_slice_to(
        &self,
        info: &FileInfo,
        slice: BlockSlice,
        mut sink: Sink<'_>,
    ) -> Result<Option<Bytes>> {
        let ask = BlockAsk::new(info, slice.index, slice.offset, slice.len);
        let served = self.inner.route.read(&ask, &mut sink).await?;
        self.record_read(info, slice.len);
        Ok(served)
    }

    /// A streaming reader of one version of the file, with sequential readahead.
    pub async fn open(&self, path: &str) -> Result<StrataReader> {
        let info = self.stat(path).await?;
        if info.is_dir {
            return Err(ClientError::IsDirectory(info.path));
        }
        Ok(StrataReader::new(self.clone(), info))
    }

    pub(crate) async fn read_block_of(&self, info: &FileInfo, index: u64) -> Result<Bytes> {
        let len = strata_common::block::block_len(info.size, info.block_size, index);
        self.read_slice(info, BlockSlice { index, offset: 0, len }).await
    }
}

/// How data-plane connections are made: the connect timeout, TLS when `config.tls` says (its
/// files read here, once per client), and the token presented on each.
fn dial(config: &ClientConfig) -> Result<Dial> {
    let tls = config.tls.client().map_err(|e| ClientError::InvalidArgument(e.to_string()))?;
    let credentials =
        transport::Credentials::token(config.token.as_ref().map(|t| t.0.as_str())).with_class(config.qos);
    Ok(Dial { connect_timeout: config.connect_timeout, tls, credentials })
}

/// A master's gRPC endpoint with the client's timeouts.
fn master_endpoint(dial: &Dial, addr: &str) -> Result<Endpoint> {
    endpoint_for(addr, dial)
        .map_err(|e| ClientError::InvalidArgument(format!("master address {addr:?}: {e}")))
}

/// `https://` with the same TLS as the data plane when the client speaks TLS.
fn endpoint_for(addr: &str, dial: &Dial) -> std::result::Result<Endpoint, tonic::transport::Error> {
    let endpoint = match &dial.tls {
        Some(tls) => Endpoint::from_shared(format!("https://{addr}"))?.tls_config(tls.tonic())?,
        None => Endpoint::from_shared(format!("http://{addr}"))?,
    };
    Ok(endpoint.connect_timeout(dial.connect_timeout).timeout(Duration::from_secs(30)))
}

/// The channel to the master, or to the masters of an HA cluster (`master_addr` a
/// comma-separated list), following the leader.
fn master_channel(config: &ClientConfig, dial: &Dial) -> Result<LeaderChannel> {
    let masters = strata_common::master_addrs(&config.master_addr);
    if masters.is_empty() {
        return Err(ClientError::InvalidArgument(format!("no master address in {:?}", config.master_addr)));
    }
    for addr in &masters {
        master_endpoint(dial, addr)?;
    }
    let dial = dial.clone();
    let token = config.token.as_ref().map(|t| t.0.as_str());
    LeaderChannel::new(masters, token, move |addr| endpoint_for(addr, &dial), DEFAULT_FOLLOW_FOR)
        .map_err(|e| ClientError::InvalidArgument(format!("master address {:?}: {e}", config.master_addr)))
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
}
