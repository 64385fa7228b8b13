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

mod batch;
mod error;
mod fsops;
mod health;
mod jobs;
mod lineage;
mod listings;
mod local;
pub mod outage;
mod prefetch;
mod rdma;
mod reader;
pub mod shortcircuit;
mod spread;
mod tokens;
pub mod transport;
mod upstream;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use strata_common::frame::{FileStat, ReadBlockRequest, StatRequest};
pub use strata_common::qos::{QOS_ENV, QosClass};
use strata_common::ring::DEFAULT_VNODES;
use strata_common::{BlockKey, BlockSlice, Member, Ring, SharedClock, block_slices, path};
use strata_proto::leader::{DEFAULT_FOLLOW_FOR, LeaderChannel};
use strata_proto::master_client::MasterClient;
use strata_proto::{AddMountRequest, ClusterStatus, Empty, ListRequest, MountInfo, RemoveMountRequest};
use tonic::transport::Endpoint;
use tracing::{debug, warn};
use transport::{Sink, Via};

use crate::listings::{ListKey, Listings, STALE_TOKEN};
use crate::outage::{FALLBACK_DEADLINE, Outage};

pub use batch::{MAX_BATCH_BYTES, ReadSpec, STAT_MANY_CHUNK};
pub use error::{ClientError, Result, Unserved};
pub use fsops::{Copied, CopiedBy, Moved, StrataWriter};
pub use health::HedgePolicy;
pub use jobs::job_finished;
pub use lineage::{JOB_ENV, LINEAGE_ENV, LINEAGE_FLUSH_ENV, LineageCounters, METRIC_LINEAGE_DROPPED};
pub use outage::{OUTAGE_GRACE_ENV, OutageCounters};
pub use prefetch::{MAX_HINTED_BLOCKS_PER_FILE, METRIC_PREFETCH_UNKNOWN, Prefetched};
#[cfg(feature = "rdma")]
pub use rdma::VerbsReader;
pub use rdma::{EmulatedReader, METRIC_RDMA_FALLBACKS, RdmaMode, RdmaTransport, RemoteReader};
pub use reader::StrataReader;
pub use strata_proto::{
    Applied, CacheTtlInfo, FreeResponse, LocateResponse, PinInfo, PinTier, WorkerLocality,
};
pub use strata_proto::{JobInfo, JobState, LoadOptions, ScheduleInfo, TokenInfo};
pub use strata_proto::{PendingFile, PersistState};
pub use strata_security::tls::TlsConfig;
#[cfg(any(test, feature = "testing"))]
pub use transport::FaultyTransport;
pub use transport::{Credentials, DataStream, Dial, TcpTransport, Transport, TransportError, UnixTransport};
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
/// Environment variable naming the sidecar's Unix socket (read by [`ClientConfig::new`]).
pub const SIDECAR_SOCKET_ENV: &str = "STRATA_SIDECAR_SOCKET";
/// Environment variable listing workers' data addresses (`host:port,host:port`) a client asks
/// for the cluster's view when the master is unreachable at start (read by [`ClientConfig::new`]).
pub const WORKERS_ENV: &str = "STRATA_WORKERS";

#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// The master's `host:port`, or the masters of an HA cluster as a comma-separated list
    /// (calls follow the leader).
    pub master_addr: String,
    /// How long a fetched membership and mount table are used before asking again.
    pub membership_refresh: Duration,
    /// Most blocks a sequential streaming reader fetches ahead (the window grows to it). Default 8.
    pub readahead_blocks: usize,
    /// Blocks of one `read_range` fetched concurrently.
    pub parallelism: usize,
    pub connect_timeout: Duration,
    /// Deadline of one block request to one worker.
    pub request_timeout: Duration,
    /// When a block read unanswered by one worker is sent to the next owner as well (the first
    /// answer is taken): after the worker's recent latency, between `hedge.min` and
    /// `hedge.max`. Default 100 ms to 700 ms, so a frozen worker never holds a read for a
    /// second; `max` zero turns it off.
    pub hedge: HedgePolicy,
    /// Largest `read_range` answered in one buffer; larger reads should stream.
    pub max_read_len: u64,
    /// Unix socket of the pod's sidecar worker: blocks are asked of it first, and of the
    /// cluster when it cannot serve. Default: `STRATA_SIDECAR_SOCKET` when set and non-empty.
    pub sidecar_socket: Option<PathBuf>,
    /// Read blocks by mapping a file descriptor the worker passes (short-circuit) instead of
    /// copying them through a socket: the sidecar's blocks, and the blocks of any worker on
    /// this host that serves a Unix socket (`strata worker --socket`; found in the membership
    /// and checked by its id, no configuration). Default true, unless `STRATA_SHORT_CIRCUIT`
    /// is `0`/`false`/`off`/`no`.
    pub short_circuit: bool,
    /// Bytes of whole-block short-circuit mappings kept for the next read of the same block,
    /// each for half its lease. A read of a kept block costs no round trip. The mappings are
    /// of the sidecar's page cache and shared memory (address space, not new memory), but they
    /// keep blocks the sidecar evicted alive until they go. 0 maps exactly each read's range
    /// and gives its lease back when its bytes are dropped. Default 1073741824 (1 GiB).
    pub short_circuit_cache_bytes: u64,
    /// Read workers through RDMA grants ([`RdmaTransport`]) instead of plain TCP. Default
    /// [`RdmaMode::Off`]; any RDMA failure falls back to TCP for that read.
    pub rdma: RdmaMode,
    /// How long, from the start of a master outage, the client serves the metadata it has
    /// (stats past their TTL, listings it saw whole) and stats workers make at the UFS; after
    /// it metadata calls fail, saying since when the master is unreachable. Default
    /// `STRATA_MASTER_OUTAGE_GRACE` (`5m`, `90s`; `0` serves nothing stale), else 5 minutes.
    pub master_outage_grace: Duration,
    /// Workers' data addresses (`host:port`) asked for their view of membership and mounts
    /// when the master is unreachable at start, after the sidecar. Default `STRATA_WORKERS`
    /// (comma-separated), else none.
    pub workers: Vec<String>,
    /// Most entries of listings kept (whole listings, least recently used dropped first) to
    /// answer `list`/`find` while the master is unreachable; 0 keeps none. Default 100000
    /// (about 20 MB). Listed files also become cached stats (so files just listed are read
    /// without asking the master) while the stat cache holds fewer than this many.
    pub listing_cache_entries: usize,
    /// Decides metadata TTLs, the membership refresh and how long short-circuit mappings are
    /// kept. Default the machine's clock; tests inject a `ManualClock` instead of sleeping.
    pub clock: SharedClock,
    /// TLS to the master and the workers' TCP data plane (a sidecar's Unix socket stays
    /// plain): on when `tls.ca` is set; `cert` + `key` are presented to servers that require
    /// client certificates; `server_name` is checked in every server's certificate instead of
    /// the host dialled. Default from `STRATA_TLS_CA`, `STRATA_TLS_CERT`, `STRATA_TLS_KEY`,
    /// `STRATA_TLS_SERVER_NAME` (see [`TlsConfig::from_env`]); none set: plain TCP.
    pub tls: TlsConfig,
    /// The node (host, Kubernetes node name) this client runs on: among a block's read
    /// replicas (the mount's `read_replicas`) one on the same node is asked first. Default
    /// `STRATA_NODE` when set and not blank (in Kubernetes, from `spec.nodeName`), else none.
    pub node: Option<String>,
    /// The token presented to the master (every call) and to workers (every new connection).
    /// Default: `STRATA_TOKEN`, else the file `STRATA_TOKEN_FILE` names, else the admin token
    /// of a standalone started in the current directory when it exists (see
    /// `strata_security::token::client_token_from_env`); `None` for a cluster with
    /// authentication off. Never printed (`Debug` shows whether one is set).
    pub token: Option<Token>,
    /// The job this client reads for: its reads are recorded under it (docs/LINEAGE.md).
    /// Default `STRATA_JOB` when set and not blank; `None` records them as `anonymous`.
    pub job: Option<String>,
    /// Record which file versions this client reads and report them to the master (see
    /// `job`). Default true, unless `STRATA_LINEAGE` is `0`/`false`/`off`/`no`.
    pub lineage: bool,
    /// How often recorded reads are sent to the master; a process killed without flushing
    /// loses at most this much of its record. Default `STRATA_LINEAGE_FLUSH` (`2s`, `500ms`),
    /// else 2 s.
    pub lineage_flush_interval: Duration,
    /// The request class of this client's reads on a busy worker (docs/QOS.md): `Latency`
    /// (inference, RAG, weight loading) is served first, `Background` last. Default
    /// `STRATA_QOS` (`latency`, `throughput`, `background`), else `Throughput`; a value that
    /// names no class fails [`Client::connect`].
    pub qos: QosClass,
}

/// A token, kept out of `Debug` output and logs.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(pub String);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(***)")
    }
}

/// The defaults, for the master at [`strata_common::DEFAULT_MASTER_ADDR`] (this host).
impl Default for ClientConfig {
    fn default() -> Self {
        Self::new(strata_common::DEFAULT_MASTER_ADDR)
    }
}

impl ClientConfig {
    pub fn new(master_addr: impl Into<String>) -> Self {
        Self {
            master_addr: master_addr.into(),
            membership_refresh: Duration::from_secs(2),
            readahead_blocks: 8,
            parallelism: 16,
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(60),
            hedge: HedgePolicy::default(),
            max_read_len: 4 << 30,
            sidecar_socket: std::env::var_os(SIDECAR_SOCKET_ENV).filter(|v| !v.is_empty()).map(PathBuf::from),
            short_circuit: shortcircuit::enabled_by_env(),
            short_circuit_cache_bytes: 1 << 30,
            rdma: RdmaMode::Off,
            master_outage_grace: outage::grace_from_env(),
            workers: std::env::var(WORKERS_ENV)
                .map(|v| v.split(',').map(str::trim).filter(|a| !a.is_empty()).map(String::from).collect())
                .unwrap_or_default(),
            listing_cache_entries: 100_000,
            clock: strata_common::clock::system(),
            node: strata_common::node_from_env(),
            token: token_from_env(),
            tls: TlsConfig::from_env(),
            job: lineage::job_from_env(),
            lineage: lineage::enabled_by_env(),
            lineage_flush_interval: lineage::flush_interval_from_env(),
            qos: QosClass::from_env().ok().flatten().unwrap_or_default(),
        }
    }
}

/// A wait as the master takes it: zero asks for its default, anything else at least 1 ms.
fn wait_ms(wait: Duration) -> u64 {
    if wait.is_zero() { 0 } else { wait.as_millis().clamp(1, u64::MAX as u128) as u64 }
}

/// The token the environment names (see [`ClientConfig::token`]). A `STRATA_TOKEN_FILE` that
/// cannot be read is reported when connecting ([`Client::connect`]).
fn token_from_env() -> Option<Token> {
    strata_security::token::client_token_from_env().ok().flatten().map(Token)
}

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

/// What `stat` and `list` return.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileInfo {
    pub path: String,
    pub is_dir: bool,
    pub size: u64,
    pub version: String,
    pub mtime_ms: i64,
    pub block_size: u64,
    /// The UFS identity blocks are keyed by.
    pub file_id: String,
    /// A file written to a write-back mount and not yet in the UFS: the live workers whose
    /// journals hold it (reads go to them), and where its upload stands.
    pub holders: Vec<Member>,
    pub persist: Persist,
}

/// Where a file written to a write-back mount stands (see docs/WRITEBACK.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Persist {
    /// In the UFS (every file not written through a write-back mount).
    #[default]
    Persisted,
    /// Acknowledged, held by workers' journals, waiting for its upload.
    Pending,
    Uploading,
    /// The upload gave up after its retries (`strata sync` queues it again).
    Failed,
}

impl Persist {
    pub fn as_str(self) -> &'static str {
        match self {
            Persist::Persisted => "persisted",
            Persist::Pending => "pending",
            Persist::Uploading => "uploading",
            Persist::Failed => "failed",
        }
    }

    pub(crate) fn from_proto(state: i32) -> Self {
        match strata_proto::PersistState::try_from(state) {
            Ok(strata_proto::PersistState::Pending) => Persist::Pending,
            Ok(strata_proto::PersistState::Uploading) => Persist::Uploading,
            Ok(strata_proto::PersistState::Failed) => Persist::Failed,
            _ => Persist::Persisted,
        }
    }
}

impl From<FileStat> for FileInfo {
    fn from(s: FileStat) -> Self {
        Self {
            path: s.path,
            is_dir: s.is_dir,
            size: s.size,
            version: s.version,
            mtime_ms: s.mtime_ms,
            block_size: s.block_size,
            file_id: s.file_id,
            holders: Vec::new(),
            persist: Persist::Persisted,
        }
    }
}

impl From<strata_proto::FileStatus> for FileInfo {
    fn from(s: strata_proto::FileStatus) -> Self {
        Self {
            path: s.path,
            is_dir: s.is_dir,
            size: s.size,
            version: s.version,
            mtime_ms: s.mtime_ms,
            block_size: s.block_size,
            file_id: s.file_id,
            holders: s
                .holders
                .into_iter()
                .map(|m| Member {
                    id: m.id,
                    data_addr: m.data_addr,
                    node: m.node,
                    local_socket: m.local_socket,
                })
                .collect(),
            persist: Persist::from_proto(s.persist),
        }
    }
}

#[derive(Clone)]
struct View {
    ring: Ring,
    /// The last ring that had members: when the master (rightly or not) reports no live
    /// worker, reads still try the workers it last knew before giving up.
    last_members: Ring,
    mounts: Vec<MountInfo>,
    /// Ids of workers the master says have stopped heartbeating (still on the ring): asked last.
    suspects: HashSet<String>,
    fetched: Instant,
}

impl View {
    fn empty(now: Instant) -> Self {
        Self {
            ring: Ring::default(),
            last_members: Ring::default(),
            mounts: Vec::new(),
            suspects: HashSet::new(),
            fetched: now,
        }
    }
}

struct Inner {
    config: ClientConfig,
    /// How data-plane connections are made (timeout, TLS), from `config`.
    dial: Dial,
    master: MasterClient<LeaderChannel>,
    transport: Arc<dyn Transport>,
    /// The sidecar's socket path and the transport that reaches it.
    sidecar: Option<(String, Arc<dyn Transport>)>,
    /// Short-circuit reads through the sidecar's socket, when enabled.
    short_circuit: Option<shortcircuit::ShortCircuit>,
    /// Short-circuit reads through the sockets of workers on this host, when enabled.
    local: Option<local::LocalWorkers>,
    view: RwLock<View>,
    /// Held while a stale view is refreshed, so concurrent readers wait for one refresh
    /// instead of each calling the master (64 readers made 64 call pairs at once).
    refreshing: tokio::sync::Mutex<()>,
    /// Refreshes attempted (failed ones too): a reader that waited behind one does not try again.
    refresh_attempts: std::sync::atomic::AtomicU64,
    stats: Mutex<HashMap<String, (Instant, FileInfo)>>,
    failovers: std::sync::atomic::AtomicU64,
    hedges: std::sync::atomic::AtomicU64,
    local_reads: std::sync::atomic::AtomicU64,
    health: health::Health,
    /// Block reads in flight per worker, for choosing among read replicas.
    in_flight: spread::InFlight,
    outage: Outage,
    listings: Listings,
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
        if config.token.is_none() {
            // Say why a token file named in the environment was not used, rather than let the
            // cluster answer "no token".
            strata_security::token::client_token_from_env()
                .map_err(|e| ClientError::InvalidArgument(e.to_string()))?;
        }
        QosClass::from_env().map_err(|e| ClientError::InvalidArgument(format!("{QOS_ENV}: {e}")))?;
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
            if can_bootstrap { FALLBACK_DEADLINE.max(config.connect_timeout) } else { Duration::MAX };
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
            None => client.refresh_view_with(can_bootstrap).await,
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
        let candidates = self.worker_candidates(None);
        for (via, addr) in &candidates {
            let answer = transport::ask(
                *via,
                addr,
                &frame,
                req_id,
                strata_proto::MAX_MESSAGE_BYTES as u64,
                &self.inner.dial,
                self.ask_timeout(),
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
            self.set_view(view.membership.unwrap_or_default(), view.mounts.unwrap_or_default().mounts);
            let clock = &self.inner.config.clock;
            self.inner.outage.started_from_worker(
                clock.now(),
                clock.wall_ms(),
                view.master_seen_unix_ms,
                addr,
            );
            return self.inner.outage.check_grace(clock.now());
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

    /// Deadline of a metadata request asked of a worker.
    fn ask_timeout(&self) -> Duration {
        self.inner.config.connect_timeout.max(FALLBACK_DEADLINE)
    }

    /// How this client makes data-plane connections (timeout, TLS).
    pub(crate) fn dial(&self) -> &Dial {
        &self.inner.dial
    }

    /// Who to ask for metadata when the master is unreachable: the sidecar, then the workers
    /// of the last membership (ordered by the placement of `key`, to spread the asking), then
    /// the configured ones; at most 4 over TCP.
    fn worker_candidates(&self, key: Option<&str>) -> Vec<(Via, String)> {
        let mut out = Vec::new();
        if let Some(socket) = &self.inner.config.sidecar_socket {
            out.push((Via::Unix, socket.display().to_string()));
        }
        let view = self.inner.view.read().unwrap_or_else(|p| p.into_inner());
        let ring = if view.ring.is_empty() { &view.last_members } else { &view.ring };
        let hash = BlockKey::new(key.unwrap_or("/").to_string(), String::new(), 0).placement_hash();
        let known = ring.owners(hash, ring.members().len()).into_iter().map(|m| m.data_addr.clone());
        let mut tcp: Vec<String> = Vec::new();
        for addr in known.chain(self.inner.config.workers.iter().cloned()) {
            if !tcp.contains(&addr) && tcp.len() < 4 {
                tcp.push(addr);
            }
        }
        out.extend(tcp.into_iter().map(|a| (Via::Tcp, a)));
        out
    }

    /// A path's stat made at the UFS by a worker (the sidecar first): `None` when no worker
    /// could be asked, else the answer, with the kind the worker sent for a refusal.
    async fn stat_at_worker(&self, p: &str) -> Option<Result<FileInfo>> {
        let req_id = 1;
        let frame = StatRequest { req_id, path: p.to_string() }.encode();
        for (via, addr) in self.worker_candidates(Some(p)) {
            match transport::ask(via, &addr, &frame, req_id, 1 << 20, &self.inner.dial, self.ask_timeout())
                .await
            {
                Ok(bytes) => match FileStat::decode(&bytes) {
                    Ok(stat) => return Some(Ok(FileInfo::from(stat))),
                    Err(e) => debug!(worker = %addr, err = %e, "a worker's stat did not decode"),
                },
                Err(TransportError::Remote { kind, message, .. }) if !kind.is_temporary() => {
                    return Some(Err(ClientError::from_kind(kind, message)));
                }
                Err(e) => {
                    debug!(worker = %addr, path = %p, err = %e, "a worker could not stat; asking the next")
                }
            }
        }
        None
    }

    /// What this client served while the master was unreachable.
    pub fn outage_counters(&self) -> OutageCounters {
        self.inner.outage.counters()
    }

    /// A call to the master that moves the outage state. With `fallback` (the caller can
    /// answer without the master) it is skipped during an outage unless a probe is due, and
    /// bounded by [`FALLBACK_DEADLINE`]; either way it fails as `MasterUnavailable`.
    async fn master_call<T>(
        &self,
        rpc: &'static str,
        fallback: bool,
        call: impl Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T> {
        let clock = &self.inner.config.clock;
        let master = &self.inner.config.master_addr;
        if fallback && !self.inner.outage.should_ask(clock.now()) {
            return Err(ClientError::MasterUnavailable(format!(
                "master at {master} is unreachable (asked again in a moment)"
            )));
        }
        // An outage begins when the call that found it was made, not when it gave up.
        let (asked, asked_wall) = (clock.now(), clock.wall_ms());
        let answer = if fallback {
            match tokio::time::timeout(FALLBACK_DEADLINE, call).await {
                Ok(answer) => answer.map_err(self.rpc_err(rpc)),
                Err(_) => Err(ClientError::MasterUnavailable(format!(
                    "master at {master}: no answer to {rpc} within {} s",
                    FALLBACK_DEADLINE.as_secs()
                ))),
            }
        } else {
            call.await.map_err(self.rpc_err(rpc))
        };
        match &answer {
            Err(e) if e.is_master_outage() => self.inner.outage.failed(asked, asked_wall, clock.now(), e),
            // Any answer, even a refusal, is the master being there.
            _ => self.inner.outage.recovered(clock.now()),
        }
        answer.map(tonic::Response::into_inner)
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
        let view = self.inner.view.read().unwrap_or_else(|p| p.into_inner()).clone();
        let stats = self.inner.stats.lock().unwrap_or_else(|p| p.into_inner()).clone();
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
        let sidecar = config.sidecar_socket.as_ref().map(|p| {
            let t: Arc<dyn Transport> = Arc::new(UnixTransport::with_credentials(
                config.connect_timeout,
                config.request_timeout,
                credentials.clone(),
            ));
            (p.display().to_string(), t)
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
        let flush_every = config.lineage_flush_interval;
        let inner = Arc::new(Inner {
            master: MasterClient::new(channel)
                .max_decoding_message_size(strata_proto::MAX_MESSAGE_BYTES)
                .max_encoding_message_size(strata_proto::MAX_MESSAGE_BYTES),
            transport,
            sidecar,
            short_circuit,
            local,
            view: RwLock::new(view),
            refreshing: tokio::sync::Mutex::new(()),
            refresh_attempts: Default::default(),
            stats: Mutex::new(stats),
            failovers: Default::default(),
            hedges: Default::default(),
            local_reads: Default::default(),
            health: health::Health::new(config.hedge),
            in_flight: spread::InFlight::default(),
            outage: Outage::new(config.master_outage_grace, config.membership_refresh, &config.master_addr),
            listings: Listings::new(config.listing_cache_entries),
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
        self.inner.failovers.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Block reads sent to a second worker because the first was slow to answer (as the
    /// `strata_client_hedged_reads_total` metric, for this client alone).
    pub fn hedged_reads(&self) -> u64 {
        self.inner.hedges.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Block reads served by mapping a descriptor a worker passed — the sidecar, or a worker on
    /// this host — rather than bytes through a socket (as the
    /// `strata_client_short_circuit_reads_total` metric, for this client alone).
    pub fn short_circuit_reads(&self) -> u64 {
        self.inner.short_circuit.as_ref().map_or(0, |sc| sc.reads())
            + self.inner.local.as_ref().map_or(0, |l| l.reads())
    }

    /// Short-circuit attempts this client read through a socket or over TCP instead, by why
    /// (as the `strata_client_short_circuit_fallbacks_total` metric, for this client alone).
    pub fn short_circuit_fallbacks(&self) -> shortcircuit::ShortCircuitFallbacks {
        self.inner.short_circuit.as_ref().map(|sc| sc.fallbacks()).unwrap_or_default()
            + self.inner.local.as_ref().map(|l| l.fallbacks()).unwrap_or_default()
    }

    /// Block reads first sent to a read replica on this client's node (as the
    /// `strata_client_local_reads_total` metric, for this client alone).
    pub fn local_reads(&self) -> u64 {
        self.inner.local_reads.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn config(&self) -> &ClientConfig {
        &self.inner.config
    }

    fn master(&self) -> MasterClient<LeaderChannel> {
        self.inner.master.clone()
    }

    /// How a failed call of `rpc` becomes an error: with its kind, and naming the call when it
    /// was refused for its size.
    fn rpc_err(&self, rpc: &'static str) -> impl Fn(tonic::Status) -> ClientError + '_ {
        move |status| ClientError::from_status(rpc, status, &self.inner.config.master_addr)
    }

    /// Fetches membership and mounts from the master now.
    pub async fn refresh_view(&self) -> Result<()> {
        self.refresh_view_with(false).await
    }

    /// [`refresh_view`](Self::refresh_view); with `fallback` when the caller can go on with the
    /// view it has (see [`master_call`](Self::master_call)).
    async fn refresh_view_with(&self, fallback: bool) -> Result<()> {
        let mut master = self.master();
        let membership =
            self.master_call("get_membership", fallback, master.get_membership(Empty {})).await?;
        let mounts = self.master_call("list_mounts", fallback, master.list_mounts(Empty {})).await?;
        self.set_view(membership, mounts.mounts);
        Ok(())
    }

    fn set_view(&self, membership: strata_proto::Membership, mounts: Vec<MountInfo>) {
        let suspects = membership.workers.iter().filter(|w| w.suspect).map(|w| w.id.clone()).collect();
        let members = membership
            .workers
            .into_iter()
            .map(|w| Member { id: w.id, data_addr: w.data_addr, node: w.node, local_socket: w.local_socket })
            .collect();
        let ring = Ring::new(membership.epoch, members, DEFAULT_VNODES);
        debug!(epoch = ring.epoch(), workers = ring.members().len(), "membership refreshed");
        let mut view = self.inner.view.write().unwrap_or_else(|p| p.into_inner());
        if !ring.is_empty() {
            view.last_members = ring.clone();
        }
        view.ring = ring;
        view.mounts = mounts;
        view.suspects = suspects;
        view.fetched = self.inner.config.clock.now();
    }

    async fn fresh_view(&self) -> Result<()> {
        let stale = || {
            let fetched = self.inner.view.read().unwrap_or_else(|p| p.into_inner()).fetched;
            self.inner.config.clock.now().saturating_duration_since(fetched)
                > self.inner.config.membership_refresh
        };
        if !stale() {
            return Ok(());
        }
        use std::sync::atomic::Ordering::Relaxed;
        let attempts = self.inner.refresh_attempts.load(Relaxed);
        let _one_refresh = self.inner.refreshing.lock().await;
        // Another reader refreshed it (or tried, and the master is away) while this one waited.
        if self.inner.refresh_attempts.load(Relaxed) != attempts || !stale() {
            return Ok(());
        }
        self.inner.refresh_attempts.fetch_add(1, Relaxed);
        if let Err(e) = self.refresh_view_with(true).await {
            // Cached reads go on while the master is away: keep the last view (an outage is
            // logged once, by `outage`).
            if e.is_master_outage() {
                debug!(err = %e, "cannot refresh membership; using the last one");
            } else {
                warn!(err = %e, "cannot refresh membership; using the last one");
            }
        }
        Ok(())
    }

    /// The placement ring in use (after refreshing it if it is older than the refresh period).
    pub async fn ring(&self) -> Result<Ring> {
        self.fresh_view().await?;
        Ok(self.inner.view.read().unwrap_or_else(|p| p.into_inner()).ring.clone())
    }

    /// How many of a block's first ring owners a read of `p` may ask first (its mount's
    /// `read_replicas`; 1 for a path under no known mount, or a master that does not say).
    pub(crate) fn read_replicas_for(&self, p: &str) -> usize {
        self.mount_read_replicas(p).unwrap_or(1)
    }

    /// The `read_replicas` of the mount holding `p`, `None` when this client knows no such mount.
    pub(crate) fn mount_read_replicas(&self, p: &str) -> Option<usize> {
        let view = self.inner.view.read().unwrap_or_else(|p| p.into_inner());
        view.mounts
            .iter()
            .find(|m| path::strip_mount(&m.path, p).is_some())
            .map(|m| m.read_replicas.max(1) as usize)
    }

    fn ttl_for(&self, p: &str) -> Duration {
        let view = self.inner.view.read().unwrap_or_else(|p| p.into_inner());
        view.mounts
            .iter()
            .find(|m| path::strip_mount(&m.path, p).is_some())
            .map_or(Duration::ZERO, |m| Duration::from_millis(m.metadata_ttl_ms))
    }

    /// Metadata of a file or directory. `sync` bypasses every cache and asks the UFS.
    ///
    /// A cached stat of a write-back file not yet uploaded is not reused: its state is stale
    /// once the upload lands, and its `wb-` version names journals the holders drop a grace
    /// later (the master's `writeback_journal_grace_ms`, which a longer `metadata_ttl` would
    /// outlive). The master answers it from its table of pending files, without the UFS.
    ///
    /// While the master is unreachable (for up to `master_outage_grace`): the last stat of the
    /// path, however old, unless `sync`; else a stat a worker makes at the UFS.
    pub async fn stat_with(&self, raw: &str, sync: bool) -> Result<FileInfo> {
        let p = path::normalize(raw).map_err(|e| ClientError::InvalidArgument(e.to_string()))?;
        let cached = self.inner.stats.lock().unwrap_or_else(|p| p.into_inner()).get(&p).cloned();
        if !sync
            && let Some((at, info)) = &cached
            && info.persist == Persist::Persisted
            && self.inner.config.clock.now().saturating_duration_since(*at) < self.ttl_for(&p)
        {
            return Ok(info.clone());
        }
        let fallback = (!sync && cached.is_some()) || !self.worker_candidates(None).is_empty();
        let mut master = self.master();
        let req = strata_proto::StatRequest { path: p.clone(), sync };
        let info = match self.master_call("stat", fallback, master.stat(req)).await {
            Ok(status) => FileInfo::from(status),
            Err(e) if e.is_master_outage() => {
                self.inner.outage.check_grace(self.inner.config.clock.now())?;
                match cached {
                    Some((_, info)) if !sync => {
                        self.inner.outage.served_stale_stat();
                        return Ok(info);
                    }
                    _ => match self.stat_at_worker(&p).await {
                        Some(answer) => {
                            let info = answer?;
                            self.inner.outage.served_worker_stat();
                            info
                        }
                        None => return Err(e),
                    },
                }
            }
            Err(e) => return Err(e),
        };
        let now = self.inner.config.clock.now();
        self.inner.stats.lock().unwrap_or_else(|p| p.into_inner()).insert(p, (now, info.clone()));
        Ok(info)
    }

    pub async fn stat(&self, path: &str) -> Result<FileInfo> {
        self.stat_with(path, false).await
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
    pub async fn list_page(
        &self,
        raw: &str,
        page_token: &str,
        page_size: u32,
    ) -> Result<(Vec<FileInfo>, Option<String>)> {
        let p = path::normalize(raw).map_err(|e| ClientError::InvalidArgument(e.to_string()))?;
        let key = ListKey::List(p.clone());
        if page_token.starts_with(STALE_TOKEN) {
            return self.cached_page(&key, page_token, page_size, None);
        }
        let fallback = self.inner.listings.has(&key, page_token);
        let req = ListRequest { path: p, sync: false, page_token: page_token.to_string(), page_size };
        let mut master = self.master();
        match self.master_call("list", fallback, master.list(req)).await {
            Ok(resp) => Ok(self.recorded(&key, page_token, resp.entries, resp.next_page_token)),
            Err(e) if e.is_master_outage() => self.cached_page(&key, page_token, page_size, Some(e)),
            Err(e) => Err(e),
        }
    }

    /// A page the master answered, kept towards the whole listing.
    fn recorded(
        &self,
        key: &ListKey,
        token: &str,
        entries: Vec<strata_proto::FileStatus>,
        next: String,
    ) -> (Vec<FileInfo>, Option<String>) {
        let entries: Vec<FileInfo> = entries.into_iter().map(FileInfo::from).collect();
        let next = (!next.is_empty()).then_some(next);
        self.inner.listings.record(key, token, &entries, next.as_deref());
        self.feed_stats(&entries);
        (entries, next)
    }

    /// A listing's files become cached stats (as if each had been stated now), so reading
    /// files just listed asks the master nothing. Directories are left out (a listed prefix of
    /// an object store says less than its stat), and so are write-back files not yet uploaded
    /// (`stat_with` never reuses them). A listing adds new paths only while the cache holds
    /// fewer than `listing_cache_entries` stats (it refreshes those it has at any size), so a
    /// listing of millions of files does not grow it without bound.
    fn feed_stats(&self, entries: &[FileInfo]) {
        let limit = self.inner.config.listing_cache_entries;
        let files = entries.iter().filter(|e| !e.is_dir && e.persist == Persist::Persisted);
        let now = self.inner.config.clock.now();
        let mut stats = self.inner.stats.lock().unwrap_or_else(|p| p.into_inner());
        for e in files {
            if stats.len() < limit || stats.contains_key(&e.path) {
                stats.insert(e.path.clone(), (now, e.clone()));
            }
        }
    }

    /// A page of a kept listing: while the master is unreachable (`outage` is its error, for
    /// when nothing is kept), or for a page token the cache handed out.
    fn cached_page(
        &self,
        key: &ListKey,
        token: &str,
        page_size: u32,
        outage: Option<ClientError>,
    ) -> Result<(Vec<FileInfo>, Option<String>)> {
        self.inner.outage.check_grace(self.inner.config.clock.now())?;
        match (self.inner.listings.page(key, token, page_size), outage) {
            (Some(page), _) => {
                if self.inner.outage.in_outage() {
                    self.inner.outage.served_stale_listing();
                }
                Ok(page)
            }
            (None, Some(e)) => Err(e),
            (None, None) => Err(ClientError::InvalidArgument(format!(
                "page token {token:?} is of a cached listing no longer held; list again"
            ))),
        }
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
    ) -> Result<(Vec<FileInfo>, Option<String>)> {
        let p = path::normalize(raw).map_err(|e| ClientError::InvalidArgument(e.to_string()))?;
        let key = ListKey::Find(p.clone(), max_depth);
        if page_token.starts_with(STALE_TOKEN) {
            return self.cached_page(&key, page_token, page_size, None);
        }
        let fallback = self.inner.listings.has(&key, page_token);
        let req = strata_proto::FindRequest {
            path: p,
            sync: false,
            page_token: page_token.to_string(),
            page_size,
            max_depth,
            with_dirs: false,
        };
        let mut master = self.master();
        match self.master_call("find", fallback, master.find(req)).await {
            Ok(resp) => Ok(self.recorded(&key, page_token, resp.entries, resp.next_page_token)),
            Err(e) if e.is_master_outage() => self.cached_page(&key, page_token, page_size, Some(e)),
            Err(e) => Err(e),
        }
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

    /// One block's part of a read, from its owner or, failing that, the next workers on the ring.
    async fn read_slice(&self, info: &FileInfo, slice: BlockSlice) -> Result<Bytes> {
        Ok(self.read_slice_to(info, slice, Sink::New).await?.unwrap_or_default())
    }

    /// [`read_slice`](Self::read_slice) into `sink`: a new buffer (returned) or the caller's;
    /// recorded for lineage once served, whichever way it was.
    async fn read_slice_to(
        &self,
        info: &FileInfo,
        slice: BlockSlice,
        sink: Sink<'_>,
    ) -> Result<Option<Bytes>> {
        let served = self.serve_slice(info, slice, sink).await?;
        self.record_read(info, slice.len);
        Ok(served)
    }

    async fn serve_slice(
        &self,
        info: &FileInfo,
        slice: BlockSlice,
        mut sink: Sink<'_>,
    ) -> Result<Option<Bytes>> {
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
        if !info.holders.is_empty() {
            return self.read_from_holders(info, slice, &req, sink).await;
        }
        if let Some(short_circuit) = &self.inner.short_circuit
            && !short_circuit.backing_off()
        {
            match short_circuit.read_block(&req).await {
                Ok(bytes) if bytes.len() as u64 == slice.len => return Ok(sink.deliver(bytes)),
                Ok(bytes) => {
                    debug!(block = slice.index, path = %info.path, got = bytes.len(), "short-circuit read of the wrong length; reading through the socket");
                }
                Err(e) => {
                    debug!(block = slice.index, path = %info.path, err = %e, "short-circuit read failed; reading through the socket");
                }
            }
        }
        if let Some((socket, sidecar)) = &self.inner.sidecar {
            match sink.read(sidecar.as_ref(), socket, &req).await {
                Ok(bytes) => return Ok(bytes),
                // Any worker would answer the same (not found, version changed): no fallback.
                Err(TransportError::Remote { kind, message, .. }) if !kind.is_temporary() => {
                    return Err(ClientError::from_kind(kind, message));
                }
                Err(e) => {
                    debug!(socket = %socket, block = slice.index, path = %info.path, err = %e, "sidecar failed; reading from the cluster");
                    metrics::counter!(METRIC_SIDECAR_FALLBACKS).increment(1);
                }
            }
        }
        let hash = BlockKey::new(info.file_id.clone(), info.version.clone(), slice.index).placement_hash();
        let mut last_err: Option<TransportError> = None;
        for round in 0..2 {
            if round == 1 {
                // Every worker we knew failed: the membership may have moved under us.
                self.refresh_view().await.ok();
            }
            let mut ring = self.ring().await?;
            if ring.is_empty() {
                ring = self.inner.view.read().unwrap_or_else(|p| p.into_inner()).last_members.clone();
            }
            if ring.is_empty() {
                return Err(ClientError::unavailable("no live workers in the cluster"));
            }
            let owners = self
                .in_asking_order(ring.owners(hash, ring.members().len()), self.read_replicas_for(&info.path));
            if round == 0
                && let Some(first) = owners.first()
                && let Some(bytes) = self.read_local(first, &req).await
            {
                return Ok(sink.deliver(bytes));
            }
            match self.read_from_owners(&owners, &req, &mut sink).await {
                Asked::Served { bytes, by } => {
                    if by > 0 || round > 0 {
                        metrics::counter!(METRIC_FAILOVERS).increment(1);
                        self.inner.failovers.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    return Ok(bytes);
                }
                Asked::Refused(e) => return Err(ClientError::from_transport(e)),
                Asked::Failed(e) => last_err = e.or(last_err),
            }
        }
        Err(ClientError::unserved(last_err, "no worker answered"))
    }

    /// The block `req` asks of `owner` by short-circuit, when `owner` runs on this host and
    /// serves a socket; `None` (read it over TCP) otherwise or when that fails for any reason.
    async fn read_local(&self, owner: &Member, req: &ReadBlockRequest) -> Option<Bytes> {
        let block_len = strata_common::block::block_len(req.file_size, req.block_size, req.block_index);
        if block_len < local::MIN_MAPPED_BLOCK {
            return None;
        }
        let local = self.inner.local.as_ref()?.find(owner, &self.inner.dial).await?;
        if local.backing_off() {
            return None;
        }
        match local.read_block(req).await {
            Ok(bytes) if bytes.len() as u64 == req.len => Some(bytes),
            Ok(bytes) => {
                debug!(worker = %owner.id, block = req.block_index, path = %req.path, got = bytes.len(), "short-circuit read of the wrong length; reading over TCP");
                None
            }
            Err(e) => {
                debug!(worker = %owner.id, block = req.block_index, path = %req.path, err = %e, "short-circuit read failed; reading over TCP");
                None
            }
        }
    }

    /// A block's owners (in ring order) in the order they are asked: those neither the master
    /// nor this client suspects first, each group in ring order (so placement, and with it the
    /// cache, holds) — except that with `read_replicas` > 1 the first one asked is chosen among
    /// the first `read_replicas` owners: one on this client's node, else the less busy of two
    /// (`spread`).
    fn in_asking_order<'r>(&self, owners: Vec<&'r Member>, read_replicas: usize) -> Vec<&'r Member> {
        let now = tokio::time::Instant::now();
        let view = self.inner.view.read().unwrap_or_else(|p| p.into_inner());
        let node = self.inner.config.node.as_deref().filter(|n| !n.is_empty());
        let mut trusted = Vec::with_capacity(owners.len());
        let mut suspect = Vec::new();
        for (rank, m) in owners.into_iter().enumerate() {
            if view.suspects.contains(&m.id) || self.inner.health.is_suspect(&m.data_addr, now) {
                suspect.push(m);
            } else {
                // Only candidates need their load; the rest keep their place whatever it is.
                let in_flight = if rank < read_replicas { self.inner.in_flight.get(&m.data_addr) } else { 0 };
                // A worker whose socket answered here is on this host, whatever nodes say.
                let local = node.is_some_and(|n| n == m.node)
                    || self.inner.local.as_ref().is_some_and(|l| l.found(m).is_some());
                trusted.push((m, rank, spread::Candidate { local, in_flight }));
            }
        }
        drop(view);
        let (order, first) = spread::asking_order(trusted, suspect, read_replicas, &mut rand::rng());
        if first.is_some_and(|c| c.local) {
            metrics::counter!(METRIC_LOCAL_READS).increment(1);
            self.inner.local_reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        order
    }

    /// One block read from `owners`, hedged: the first is asked (into `sink`); when it fails
    /// the next is asked at once, and when it has not answered within its hedging deadline the
    /// next is asked as well while it goes on, and so on down the list. The first answer wins
    /// and the reads still pending are dropped (their connections with them, so none is reused
    /// out of sync). Only the first read goes straight into `sink`; any other's bytes are
    /// copied there, which costs a copy only when the first did not serve.
    async fn read_from_owners(
        &self,
        owners: &[&Member],
        req: &ReadBlockRequest,
        sink: &mut Sink<'_>,
    ) -> Asked {
        use futures::stream::{FuturesUnordered, StreamExt};
        use tokio::time::Instant;

        let transport = self.inner.transport.as_ref();
        let health = &self.inner.health;
        let Some(first) = owners.first() else { return Asked::Failed(None) };
        let started = Instant::now();
        let in_flight = &self.inner.in_flight;
        let mut primary = Some(Box::pin(async {
            let _counted = in_flight.track(&first.data_addr);
            sink.read(transport, &first.data_addr, req).await
        }));
        let mut others: FuturesUnordered<OtherRead<'_>> = FuturesUnordered::new();
        // Owners asked so far, each with when it was asked; `None` once it has answered or failed.
        let mut asked: Vec<Option<Instant>> = vec![Some(started)];
        let mut hedge_at = started + health.hedge_after(&first.data_addr);
        let mut last_err = None;
        let won = loop {
            let can_ask_more = asked.len() < owners.len();
            if primary.is_none() && others.is_empty() {
                if !can_ask_more {
                    break None;
                }
                // Nothing in flight: ask the next owner now.
                hedge_at = Instant::now();
            }
            let idle = primary.is_none() && others.is_empty();
            let hedge = idle || health.hedging();
            tokio::select! {
                biased;
                answer = async { primary.as_mut().expect("guarded").await }, if primary.is_some() => {
                    primary = None;
                    let at = asked[0].take().expect("asked");
                    match judge(health, first, req, at, answer, &mut last_err) {
                        Judged::Won(bytes) => break Some((0, bytes)),
                        Judged::Next => {}
                        Judged::Refused(e) => return Asked::Refused(e),
                    }
                }
                Some((i, answer)) = others.next(), if !others.is_empty() => {
                    let at = asked[i].take().expect("asked");
                    match judge(health, owners[i], req, at, answer, &mut last_err) {
                        Judged::Won(bytes) => break Some((i, Some(bytes))),
                        Judged::Next => {}
                        Judged::Refused(e) => return Asked::Refused(e),
                    }
                }
                () = tokio::time::sleep_until(hedge_at), if can_ask_more && hedge => {
                    let i = asked.len();
                    let owner = owners[i];
                    let racing = asked.iter().any(Option::is_some);
                    if racing && !health.take_hedge() {
                        // Out of hedges: wait for the reads in flight (their request timeout
                        // still ends them), look again at the next deadline.
                        hedge_at = Instant::now() + health.hedge_after(&owners[i - 1].data_addr);
                        continue;
                    }
                    if racing {
                        debug!(worker = %owner.id, block = req.block_index, path = %req.path, "no answer within the hedging deadline; asking the next owner as well");
                        metrics::counter!(METRIC_HEDGES).increment(1);
                        self.inner.hedges.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    let now = Instant::now();
                    asked.push(Some(now));
                    hedge_at = now + health.hedge_after(&owner.data_addr);
                    let addr = owner.data_addr.clone();
                    others.push(Box::pin(async move {
                        let _counted = in_flight.track(&addr);
                        (i, transport.read_block(&addr, req).await.map(|(bytes, _)| bytes))
                    }));
                }
            }
        };
        drop(primary);
        drop(others);
        let Some((by, bytes)) = won else { return Asked::Failed(last_err) };
        // Those asked before the winner and still silent were outrun.
        let now = Instant::now();
        for (i, pending) in asked.iter().enumerate().take(by) {
            if pending.is_some() && health.outrun(&owners[i].data_addr, now) {
                warn!(worker = %owners[i].id, block = req.block_index, path = %req.path, "worker is slow to answer; asking it last for a while");
            }
        }
        let bytes = match bytes {
            // The first owner's answer is in the sink already.
            Some(bytes) if by > 0 => sink.deliver(bytes),
            other => other,
        };
        Asked::Served { bytes, by }
    }

    /// A block range of a write-back file not yet uploaded, from the workers whose journals
    /// hold it (spread over them by block, the next on failure).
    async fn read_from_holders(
        &self,
        info: &FileInfo,
        slice: BlockSlice,
        req: &ReadBlockRequest,
        mut sink: Sink<'_>,
    ) -> Result<Option<Bytes>> {
        let n = info.holders.len();
        let mut last_err = None;
        for i in 0..n {
            let holder = &info.holders[(slice.index as usize + i) % n];
            match sink.read(self.inner.transport.as_ref(), &holder.data_addr, req).await {
                Ok(bytes) => return Ok(bytes),
                Err(e) if e.try_next_worker() => {
                    warn!(worker = %holder.id, block = slice.index, path = %info.path, err = %e, "journal holder failed; trying the next");
                    last_err = Some(e);
                }
                Err(e) => return Err(ClientError::from_transport(e)),
            }
        }
        Err(ClientError::unserved(last_err, "no worker holding the file's journal answered"))
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

    pub async fn mounts(&self) -> Result<Vec<MountInfo>> {
        let resp = self.master().list_mounts(Empty {}).await.map_err(self.rpc_err("list_mounts"))?;
        Ok(resp.into_inner().mounts)
    }

    pub async fn add_mount(
        &self,
        path: &str,
        uri: &str,
        options: HashMap<String, String>,
    ) -> Result<MountInfo> {
        let req = AddMountRequest { path: path.to_string(), uri: uri.to_string(), options };
        let info = self.master().add_mount(req).await.map_err(self.rpc_err("add_mount"))?.into_inner();
        self.refresh_view().await?;
        Ok(info)
    }

    pub async fn remove_mount(&self, path: &str) -> Result<()> {
        self.master()
            .remove_mount(RemoveMountRequest { path: path.to_string() })
            .await
            .map_err(self.rpc_err("remove_mount"))?;
        self.inner.stats.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.inner.listings.forget("/");
        self.refresh_view().await
    }

    /// Pins the cached blocks of the files under `path` in `tier` of every worker (NVMe when
    /// unspecified), until [`unpin`](Self::unpin) or for `ttl`. Refused when the pins of the
    /// tier would exceed its capacity across the live workers. Answers once every live worker
    /// has the pin in force, or after 10 s: `applied` says which have not (see
    /// [`pin_waiting`](Self::pin_waiting)).
    pub async fn pin(&self, path: &str, tier: PinTier, ttl: Option<Duration>) -> Result<PinInfo> {
        self.pin_waiting(path, tier, ttl, Duration::ZERO).await
    }

    /// [`pin`](Self::pin), waiting at most `wait` (zero: the master's default, 10 s) for every
    /// live worker to have the pin in force.
    pub async fn pin_waiting(
        &self,
        path: &str,
        tier: PinTier,
        ttl: Option<Duration>,
        wait: Duration,
    ) -> Result<PinInfo> {
        let req = strata_proto::PinRequest {
            path: path.to_string(),
            tier: tier as i32,
            ttl_ms: ttl.map_or(0, |d| d.as_millis().min(u64::MAX as u128) as u64),
            wait_ms: wait_ms(wait),
        };
        Ok(self.master().pin(req).await.map_err(self.rpc_err("pin"))?.into_inner())
    }

    /// Removes the pin of exactly `path`; answers as [`pin`](Self::pin) does.
    pub async fn unpin(&self, path: &str) -> Result<PinInfo> {
        self.unpin_waiting(path, Duration::ZERO).await
    }

    /// [`unpin`](Self::unpin), waiting at most `wait` as [`pin_waiting`](Self::pin_waiting).
    pub async fn unpin_waiting(&self, path: &str, wait: Duration) -> Result<PinInfo> {
        let req = strata_proto::UnpinRequest { path: path.to_string(), wait_ms: wait_ms(wait) };
        Ok(self.master().unpin(req).await.map_err(self.rpc_err("unpin"))?.into_inner())
    }

    /// Sets the cache TTL of the blocks under `path` (a file or a directory): every worker drops
    /// one that long after it stored it, whatever its mount's `cache_ttl`. `None` clears the
    /// path's own TTL (`NotFound` when it has none). Answers as [`pin`](Self::pin) does.
    pub async fn set_cache_ttl(&self, path: &str, ttl: Option<Duration>) -> Result<CacheTtlInfo> {
        self.set_cache_ttl_waiting(path, ttl, Duration::ZERO).await
    }

    /// [`set_cache_ttl`](Self::set_cache_ttl), waiting at most `wait` as
    /// [`pin_waiting`](Self::pin_waiting).
    pub async fn set_cache_ttl_waiting(
        &self,
        path: &str,
        ttl: Option<Duration>,
        wait: Duration,
    ) -> Result<CacheTtlInfo> {
        let cache_ttl_ms = ttl.map_or(0, |d| (d.as_millis() as u64).max(1));
        let req =
            strata_proto::SetCacheTtlRequest { path: path.to_string(), cache_ttl_ms, wait_ms: wait_ms(wait) };
        Ok(self.master().set_cache_ttl(req).await.map_err(self.rpc_err("set_cache_ttl"))?.into_inner())
    }

    /// Every path's own cache TTL.
    pub async fn cache_ttls(&self) -> Result<Vec<CacheTtlInfo>> {
        let list = self.master().list_cache_ttls(Empty {}).await.map_err(self.rpc_err("list_cache_ttls"))?;
        Ok(list.into_inner().ttls)
    }

    pub async fn pins(&self) -> Result<Vec<PinInfo>> {
        Ok(self.master().list_pins(Empty {}).await.map_err(self.rpc_err("list_pins"))?.into_inner().pins)
    }

    /// Drops the cached blocks of the files under `path` from every live worker now (waiting up
    /// to `wait` for all of them); nothing moves from the UFS until they are read again.
    /// Refused for a pinned path.
    pub async fn free(&self, path: &str, wait: Duration) -> Result<FreeResponse> {
        let req = strata_proto::FreeRequest {
            path: path.to_string(),
            wait_ms: wait.as_millis().clamp(1, u64::MAX as u128) as u64,
        };
        Ok(self.master().free(req).await.map_err(self.rpc_err("free"))?.into_inner())
    }

    pub async fn status(&self) -> Result<ClusterStatus> {
        Ok(self.master().status(Empty {}).await.map_err(self.rpc_err("status"))?.into_inner())
    }

    /// Which workers (and nodes) hold how many blocks and bytes of the files under `path` (a
    /// file, or a directory and everything below it), from the master's block map, the
    /// workers holding most first. A path under no mount is `NotFound`.
    pub async fn locate(&self, path: &str) -> Result<LocateResponse> {
        let req = strata_proto::LocateRequest { path: path.to_string() };
        Ok(self.master().locate(req).await.map_err(self.rpc_err("locate"))?.into_inner())
    }

    /// Which workers hold which blocks of a file (from the master's block map), every page.
    pub async fn block_locations(&self, path: &str) -> Result<strata_proto::BlockLocations> {
        let mut from_index = 0;
        let mut all: Option<strata_proto::BlockLocations> = None;
        loop {
            let req = strata_proto::BlockLocationsRequest { path: path.to_string(), from_index, limit: 0 };
            let page = self
                .master()
                .get_block_locations(req)
                .await
                .map_err(self.rpc_err("get_block_locations"))?
                .into_inner();
            let next = page.next_index;
            match &mut all {
                Some(all) if all.version == page.version => all.blocks.extend(page.blocks),
                // The file changed between two pages: start over on the new version.
                Some(_) if from_index > 0 => {
                    from_index = 0;
                    all = None;
                    continue;
                }
                _ => all = Some(page),
            }
            if next == 0 {
                return Ok(all.expect("at least one page"));
            }
            from_index = next;
        }
    }
}

/// A block read from an owner other than the first: its position in the owners and its bytes.
type OtherRead<'a> =
    std::pin::Pin<Box<dyn Future<Output = (usize, std::result::Result<Bytes, TransportError>)> + Send + 'a>>;

/// What one owner's answer to a hedged block read means.
enum Judged<T> {
    Won(T),
    /// It failed in a way another owner may not: ask the next.
    Next,
    /// A refusal any worker would give.
    Refused(TransportError),
}

/// Records `owner`'s answer (asked at `at`) in its health and says what it means for the read.
fn judge<T>(
    health: &health::Health,
    owner: &Member,
    req: &ReadBlockRequest,
    at: tokio::time::Instant,
    answer: std::result::Result<T, TransportError>,
    last_err: &mut Option<TransportError>,
) -> Judged<T> {
    match answer {
        Ok(bytes) => {
            health.answered(&owner.data_addr, at.elapsed());
            Judged::Won(bytes)
        }
        Err(e) if e.try_next_worker() => {
            warn!(worker = %owner.id, block = req.block_index, path = %req.path, err = %e, "worker failed; trying the next");
            health.failed(&owner.data_addr, tokio::time::Instant::now());
            *last_err = Some(e);
            Judged::Next
        }
        Err(e) => {
            health.answered(&owner.data_addr, at.elapsed());
            Judged::Refused(e)
        }
    }
}

/// How a hedged block read ([`Client::read_from_owners`]) ended.
enum Asked {
    /// The `by`-th owner asked served it (the bytes for `Sink::New`, `None` once in the sink).
    Served { bytes: Option<Bytes>, by: usize },
    /// A refusal any worker would give (not found, changed, denied): asking others is useless.
    Refused(TransportError),
    /// Every owner failed; the last error.
    Failed(Option<TransportError>),
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
