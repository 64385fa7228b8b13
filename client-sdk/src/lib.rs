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

mod error;
mod fsops;
mod jobs;
mod rdma;
mod reader;
pub mod shortcircuit;
pub mod transport;
mod upstream;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use strata_common::frame::ReadBlockRequest;
use strata_common::ring::DEFAULT_VNODES;
use strata_common::{BlockKey, BlockSlice, Member, Ring, SharedClock, block_slices, path};
use strata_proto::leader::{DEFAULT_FOLLOW_FOR, LeaderChannel};
use strata_proto::master_client::MasterClient;
use strata_proto::{
    AddMountRequest, ClusterStatus, Empty, ListRequest, MountInfo, RemoveMountRequest, StatRequest,
};
use tonic::transport::Endpoint;
use tracing::{debug, warn};
use transport::Sink;

pub use error::{ClientError, Result, Unserved};
pub use fsops::StrataWriter;
pub use jobs::job_finished;
#[cfg(feature = "rdma")]
pub use rdma::VerbsReader;
pub use rdma::{EmulatedReader, METRIC_RDMA_FALLBACKS, RdmaMode, RdmaTransport, RemoteReader};
pub use reader::StrataReader;
pub use strata_proto::{JobInfo, JobState, LoadOptions, ScheduleInfo};
#[cfg(any(test, feature = "testing"))]
pub use transport::FaultyTransport;
pub use transport::{TcpTransport, Transport, TransportError, UnixTransport};
pub use upstream::ClusterUpstream;

/// Counter: block reads that a worker could not serve and the next worker on the ring did.
pub const METRIC_FAILOVERS: &str = "strata_client_failovers_total";
/// Counter: block reads the sidecar could not serve that went to the cluster over TCP.
pub const METRIC_SIDECAR_FALLBACKS: &str = "strata_client_sidecar_fallbacks_total";
/// Environment variable naming the sidecar's Unix socket (read by [`ClientConfig::new`]).
pub const SIDECAR_SOCKET_ENV: &str = "STRATA_SIDECAR_SOCKET";

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
    /// Largest `read_range` answered in one buffer; larger reads should stream.
    pub max_read_len: u64,
    /// Unix socket of the pod's sidecar worker: blocks are asked of it first, and of the
    /// cluster when it cannot serve. Default: `STRATA_SIDECAR_SOCKET` when set and non-empty.
    pub sidecar_socket: Option<PathBuf>,
    /// Read blocks the sidecar holds by mapping a file descriptor it passes (short-circuit)
    /// instead of copying them through the socket. Default true, unless `STRATA_SHORT_CIRCUIT`
    /// is `0`/`false`/`off`/`no`. Unused without `sidecar_socket`.
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
    /// Decides metadata TTLs, the membership refresh and how long short-circuit mappings are
    /// kept. Default the machine's clock; tests inject a `ManualClock` instead of sleeping.
    pub clock: SharedClock,
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
            max_read_len: 4 << 30,
            sidecar_socket: std::env::var_os(SIDECAR_SOCKET_ENV).filter(|v| !v.is_empty()).map(PathBuf::from),
            short_circuit: shortcircuit::enabled_by_env(),
            short_circuit_cache_bytes: 1 << 30,
            rdma: RdmaMode::Off,
            clock: strata_common::clock::system(),
        }
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
    fetched: Instant,
}

impl View {
    fn empty(now: Instant) -> Self {
        Self { ring: Ring::default(), last_members: Ring::default(), mounts: Vec::new(), fetched: now }
    }
}

struct Inner {
    config: ClientConfig,
    master: MasterClient<LeaderChannel>,
    transport: Arc<dyn Transport>,
    /// The sidecar's socket path and the transport that reaches it.
    sidecar: Option<(String, Arc<dyn Transport>)>,
    /// Short-circuit reads through the sidecar's socket, when enabled.
    short_circuit: Option<shortcircuit::ShortCircuit>,
    view: RwLock<View>,
    stats: Mutex<HashMap<String, (Instant, FileInfo)>>,
    failovers: std::sync::atomic::AtomicU64,
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
        let transport = rdma::transport_for(config.rdma, config.connect_timeout, config.request_timeout);
        Self::connect_with_transport(config, transport).await
    }

    pub async fn connect_with_transport(config: ClientConfig, transport: Arc<dyn Transport>) -> Result<Self> {
        let channel = master_channel(&config)?;
        // Fail fast when no master answers at all; which one leads is the channel's business.
        let mut last_err = None;
        for addr in channel.masters() {
            match master_endpoint(&config, addr)?.connect().await {
                Ok(_) => {
                    last_err = None;
                    break;
                }
                Err(e) => last_err = Some(e),
            }
        }
        if let Some(e) = last_err {
            return Err(ClientError::MasterUnavailable(format!(
                "cannot reach the master at {}: {}",
                config.master_addr,
                error_chain(&e)
            )));
        }
        let view = View::empty(config.clock.now());
        let client = Self::assemble(config, transport, channel, view, HashMap::new());
        client.refresh_view().await?;
        Ok(client)
    }

    /// A client with this one's configuration and cached metadata (membership, mounts, stats)
    /// and none of its connections, for another tokio runtime: the Python binding makes one
    /// after a fork shut its runtime down, so the first read after the fork costs a data-plane
    /// connection, not a master round trip. The master is connected on first use. Call inside
    /// the runtime that will run it.
    pub fn with_new_connections(&self) -> Result<Self> {
        let config = self.inner.config.clone();
        let channel = master_channel(&config)?;
        let transport = rdma::transport_for(config.rdma, config.connect_timeout, config.request_timeout);
        let view = self.inner.view.read().unwrap_or_else(|p| p.into_inner()).clone();
        let stats = self.inner.stats.lock().unwrap_or_else(|p| p.into_inner()).clone();
        Ok(Self::assemble(config, transport, channel, view, stats))
    }

    fn assemble(
        config: ClientConfig,
        transport: Arc<dyn Transport>,
        channel: LeaderChannel,
        view: View,
        stats: HashMap<String, (Instant, FileInfo)>,
    ) -> Self {
        let sidecar = config.sidecar_socket.as_ref().map(|p| {
            let t: Arc<dyn Transport> =
                Arc::new(UnixTransport::new(config.connect_timeout, config.request_timeout));
            (p.display().to_string(), t)
        });
        let short_circuit = config.sidecar_socket.as_ref().filter(|_| config.short_circuit).map(|p| {
            shortcircuit::ShortCircuit::new(
                p.display().to_string(),
                config.connect_timeout,
                config.request_timeout,
                config.short_circuit_cache_bytes,
                config.clock.clone(),
            )
        });
        Self {
            inner: Arc::new(Inner {
                master: MasterClient::new(channel)
                    .max_decoding_message_size(strata_proto::MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(strata_proto::MAX_MESSAGE_BYTES),
                transport,
                sidecar,
                short_circuit,
                view: RwLock::new(view),
                stats: Mutex::new(stats),
                failovers: Default::default(),
                config,
            }),
        }
    }

    /// Block reads that another worker served after the owner failed (as the
    /// `strata_client_failovers_total` metric, for this client alone).
    pub fn failovers(&self) -> u64 {
        self.inner.failovers.load(std::sync::atomic::Ordering::Relaxed)
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
        let mut master = self.master();
        let membership =
            master.get_membership(Empty {}).await.map_err(self.rpc_err("get_membership"))?.into_inner();
        let mounts = master.list_mounts(Empty {}).await.map_err(self.rpc_err("list_mounts"))?.into_inner();
        let members =
            membership.workers.into_iter().map(|w| Member { id: w.id, data_addr: w.data_addr }).collect();
        let ring = Ring::new(membership.epoch, members, DEFAULT_VNODES);
        debug!(epoch = ring.epoch(), workers = ring.members().len(), "membership refreshed");
        let mut view = self.inner.view.write().unwrap_or_else(|p| p.into_inner());
        if !ring.is_empty() {
            view.last_members = ring.clone();
        }
        view.ring = ring;
        view.mounts = mounts.mounts;
        view.fetched = self.inner.config.clock.now();
        drop(view);
        Ok(())
    }

    async fn fresh_view(&self) -> Result<()> {
        let fetched = self.inner.view.read().unwrap_or_else(|p| p.into_inner()).fetched;
        let stale = self.inner.config.clock.now().saturating_duration_since(fetched)
            > self.inner.config.membership_refresh;
        if stale && let Err(e) = self.refresh_view().await {
            // Cached reads go on while the master restarts: keep the last view.
            warn!(err = %e, "cannot refresh membership; using the last one");
        }
        Ok(())
    }

    /// The placement ring in use (after refreshing it if it is older than the refresh period).
    pub async fn ring(&self) -> Result<Ring> {
        self.fresh_view().await?;
        Ok(self.inner.view.read().unwrap_or_else(|p| p.into_inner()).ring.clone())
    }

    fn ttl_for(&self, p: &str) -> Duration {
        let view = self.inner.view.read().unwrap_or_else(|p| p.into_inner());
        view.mounts
            .iter()
            .find(|m| path::strip_mount(&m.path, p).is_some())
            .map_or(Duration::ZERO, |m| Duration::from_millis(m.metadata_ttl_ms))
    }

    /// Metadata of a file or directory. `sync` bypasses every cache and asks the UFS.
    pub async fn stat_with(&self, raw: &str, sync: bool) -> Result<FileInfo> {
        let p = path::normalize(raw).map_err(|e| ClientError::InvalidArgument(e.to_string()))?;
        if !sync {
            let ttl = self.ttl_for(&p);
            if let Some((at, info)) = self.inner.stats.lock().unwrap_or_else(|p| p.into_inner()).get(&p)
                && self.inner.config.clock.now().saturating_duration_since(*at) < ttl
            {
                return Ok(info.clone());
            }
        }
        let status = self
            .master()
            .stat(StatRequest { path: p.clone(), sync })
            .await
            .map_err(self.rpc_err("stat"))?
            .into_inner();
        let info = FileInfo::from(status);
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
        let req = ListRequest { path: p, sync: false, page_token: page_token.to_string(), page_size };
        let resp = self.master().list(req).await.map_err(self.rpc_err("list"))?.into_inner();
        let next = (!resp.next_page_token.is_empty()).then_some(resp.next_page_token);
        Ok((resp.entries.into_iter().map(FileInfo::from).collect(), next))
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
        let req = strata_proto::FindRequest {
            path: p,
            sync: false,
            page_token: page_token.to_string(),
            page_size,
            max_depth,
        };
        let resp = self.master().find(req).await.map_err(self.rpc_err("find"))?.into_inner();
        let next = (!resp.next_page_token.is_empty()).then_some(resp.next_page_token);
        Ok((resp.entries.into_iter().map(FileInfo::from).collect(), next))
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

    /// [`read_slice`](Self::read_slice) into `sink`: a new buffer (returned) or the caller's.
    async fn read_slice_to(
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
            for (attempt, owner) in ring.owners(hash, ring.members().len()).into_iter().enumerate() {
                match sink.read(self.inner.transport.as_ref(), &owner.data_addr, &req).await {
                    Ok(bytes) => {
                        if attempt > 0 || round > 0 {
                            metrics::counter!(METRIC_FAILOVERS).increment(1);
                            self.inner.failovers.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        return Ok(bytes);
                    }
                    Err(e) if e.try_next_worker() => {
                        warn!(worker = %owner.id, block = slice.index, path = %info.path, err = %e, "worker failed; trying the next");
                        last_err = Some(e);
                    }
                    Err(e) => return Err(ClientError::from_transport(e)),
                }
            }
        }
        Err(ClientError::unserved(last_err, "no worker answered"))
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
        self.refresh_view().await
    }

    pub async fn status(&self) -> Result<ClusterStatus> {
        Ok(self.master().status(Empty {}).await.map_err(self.rpc_err("status"))?.into_inner())
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

/// A master's gRPC endpoint with the client's timeouts.
fn master_endpoint(config: &ClientConfig, addr: &str) -> Result<Endpoint> {
    endpoint_for(addr, config.connect_timeout)
        .map_err(|e| ClientError::InvalidArgument(format!("master address {addr:?}: {e}")))
}

fn endpoint_for(
    addr: &str,
    connect_timeout: Duration,
) -> std::result::Result<Endpoint, tonic::transport::Error> {
    Ok(Endpoint::from_shared(format!("http://{addr}"))?
        .connect_timeout(connect_timeout)
        .timeout(Duration::from_secs(30)))
}

/// The channel to the master, or to the masters of an HA cluster (`master_addr` a
/// comma-separated list), following the leader.
fn master_channel(config: &ClientConfig) -> Result<LeaderChannel> {
    let masters = strata_common::master_addrs(&config.master_addr);
    if masters.is_empty() {
        return Err(ClientError::InvalidArgument(format!("no master address in {:?}", config.master_addr)));
    }
    for addr in &masters {
        master_endpoint(config, addr)?;
    }
    let connect_timeout = config.connect_timeout;
    LeaderChannel::new(masters, move |addr| endpoint_for(addr, connect_timeout), DEFAULT_FOLLOW_FOR)
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
