//! The Strata worker: holds blocks in DRAM and NVMe tiers over the UFS and serves byte ranges
//! of them on its data plane.
//!
//! Modules, storage at the bottom and services on top; each imports only those below it:
//!
//! ```text
//! dataplane (framing, sockets, auth) ──▶ grants (fd, rdma, lease) ──┐
//! master_link (gRPC) · loader (warmup lane) · sidecar ────────┼──▶ blocks (storage API)
//!                                                              │      ├─▶ fetch (single flight, upstream, UFS)
//!                                                              │      ├─▶ mounts (mount table, MountSource)
//!                                                              │      └─▶ cache (DRAM ▸ NVMe, write-back) ─▶ tier
//!                                                              └──▶ qos, stats, error, config
//! ```
//!
//! Storage never imports a transport or gRPC: `blocks` takes its own request type
//! ([`BlockRead`]) and the data plane translates wire frames into it.

pub mod auth;
pub mod blocks;
pub mod cache;
pub mod classes;
pub mod config;
pub mod dataplane;
pub mod error;
pub mod fetch;
pub mod grants;
pub mod handoff;
pub mod journal;
pub mod loader;
mod master_link;
pub mod metrics_defs;
pub mod mounts;
pub mod pins;
pub mod prefetch;
pub mod qos;
pub mod sidecar;
pub mod stats;
pub mod tier;
pub mod upkeep;
pub mod view;
pub mod writeback;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use strata_common::SharedClock;
use strata_ufs::{StateFence, UfsFactory};
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::info;

pub use blocks::{BlockRead, BlockService};
use cache::{BlockCache, CacheConfig};
pub use config::WorkerConfig;
pub use grants::Grants;
use mounts::Mounts;
use stats::Counters;
use tier::{MemoryTier, NvmeTier, Tier, TierError};

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum WorkerError {
    #[error("cannot bind {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error("NVMe tier at {dir}: {source}")]
    Nvme { dir: String, source: TierError },
    #[error("worker id file {path}: {source}")]
    Identity { path: String, source: std::io::Error },
    #[error("invalid master address {addr:?}: {reason}")]
    MasterAddr { addr: String, reason: String },
    #[error("Unix socket {path}: {source}")]
    Socket { path: String, source: std::io::Error },
    #[error("sidecar: {reason}")]
    Sidecar { reason: String },
    #[error(transparent)]
    Tls(#[from] strata_security::tls::TlsError),
    #[error("RDMA: {0}")]
    Rdma(#[from] grants::RdmaError),
    #[error("worker token: {0}")]
    Token(#[from] strata_security::token::TokenFileError),
    #[error("invalid worker configuration: {0}")]
    Config(String),
    #[error("write-back journal at {dir}: {source}")]
    Journal { dir: String, source: std::io::Error },
    #[error("cannot claim {path} as the worker's own: {source}")]
    State { path: String, source: std::io::Error },
}

/// A running worker. Dropping it does not stop it: call [`WorkerHandle::shutdown`].
pub struct WorkerHandle {
    pub worker_id: String,
    pub data_addr: SocketAddr,
    pub http_addr: SocketAddr,
    pub blocks: Arc<BlockService>,
    pub grants: Arc<Grants>,
    /// The data plane's open connections, limits and refusal/timeout counts.
    pub connections: Arc<dataplane::Connections>,
    /// The pins and frees this worker applies, as the master last told it.
    pub pins: Arc<pins::PinSet>,
    /// Hand-off of blocks to their new owners (ring changes, drains).
    pub handoff: HandOff,
    /// The Unix socket it serves processes on its host at (`WorkerConfig::socket_path`, made
    /// absolute), removed when it stops.
    pub local_socket: Option<PathBuf>,
    /// The prefetch lane (blocks clients hinted they will read next).
    pub prefetch: Arc<prefetch::Prefetcher>,
    /// The gate answers to clients pass by request class (`STRATA_QOS`).
    pub classes: Arc<classes::ClassGate>,
    /// The thread latency-class connections are served on.
    pub latency_lane: Arc<dataplane::LatencyLane>,
    cancel: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl WorkerHandle {
    /// Stops at once: open connections are dropped mid-request (what a crash looks like to
    /// clients); queued NVMe writes are not waited for.
    pub async fn kill(self) {
        self.cancel.cancel();
        for task in self.tasks {
            task.abort();
            let _ = task.await;
        }
        if let Some(path) = &self.local_socket {
            let _ = std::fs::remove_file(path);
        }
    }

    /// Leaves the cluster gracefully: tells the master it is draining (the master takes it off
    /// the ring at once; it keeps serving, peer reads included), hands every block it holds to
    /// its new owner, and returns once that is done or `timeout` has passed, saying what was
    /// left. Stop it afterwards ([`shutdown`](Self::shutdown)).
    pub async fn drain(&self, timeout: Duration) -> handoff::DrainReport {
        use std::sync::atomic::Ordering::Relaxed;
        let p = &self.handoff.progress;
        let before = (p.sent.load(Relaxed), p.declined.load(Relaxed), p.failed.load(Relaxed));
        self.handoff.draining.store(true, Relaxed);
        info!(worker = %self.worker_id, timeout_ms = timeout.as_millis() as u64, "draining");
        let deadline = tokio::time::Instant::now() + timeout;
        let finished = loop {
            // A pass at a ring without this worker, not older than the drain, went through all.
            let epoch = self.handoff.view.epochs().map(|(m, _)| m);
            let off_ring = self
                .handoff
                .view
                .membership()
                .is_some_and(|m| !m.workers.iter().any(|w| w.id == self.worker_id));
            if off_ring
                && p.completed_off_ring.load(Relaxed)
                && Some(p.completed_epoch.load(Relaxed)) == epoch
            {
                break true;
            }
            if tokio::time::Instant::now() >= deadline {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let report = handoff::DrainReport {
            sent: p.sent.load(Relaxed) - before.0,
            declined: p.declined.load(Relaxed) - before.1,
            failed: p.failed.load(Relaxed) - before.2,
            left: if finished { 0 } else { p.left.load(Relaxed).max(1) },
            finished,
        };
        if finished {
            info!(worker = %self.worker_id, sent = report.sent, declined = report.declined, failed = report.failed, "drained: every block handed off");
        } else {
            tracing::warn!(worker = %self.worker_id, sent = report.sent, failed = report.failed, left = p.left.load(Relaxed), "drain deadline passed before every block was handed off; the rest will be read from the UFS again");
        }
        report
    }

    /// Finishes queued NVMe writes, then stops.
    pub async fn shutdown(self) {
        self.blocks.flush().await;
        self.kill().await;
    }
}

/// A worker's hand-off state: the receiving side its data plane serves, the sender's progress,
/// and how it reaches its peers (set once the caller has a cluster client, see
/// [`HandOff::set_peer_link`]).
#[derive(Clone)]
pub struct HandOff {
    pub receiver: Arc<handoff::Receiver>,
    pub progress: Arc<handoff::Progress>,
    draining: Arc<std::sync::atomic::AtomicBool>,
    link: Arc<std::sync::OnceLock<Arc<dyn strata_common::upstream::PeerLink>>>,
    view: Arc<view::LastView>,
}

impl HandOff {
    /// Hand-off starts once this is set (a worker without it sends nothing, but receives).
    pub fn set_peer_link(&self, link: Arc<dyn strata_common::upstream::PeerLink>) {
        let _ = self.link.set(link);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// The storage stack a worker (or a sidecar) serves from: tiers, cache, mount table, fetcher.
pub(crate) async fn open_blocks(
    config: &WorkerConfig,
    factory: Arc<dyn UfsFactory>,
    clock: SharedClock,
) -> Result<Arc<BlockService>, WorkerError> {
    let nvme_dir = config.nvme_dir();
    // Opening reads one header per block: keep that off the async threads.
    let nvme_err = |source| WorkerError::Nvme { dir: nvme_dir.display().to_string(), source };
    let (dir, capacity) = (nvme_dir.clone(), config.nvme_capacity);
    let opened = tokio::task::spawn_blocking(move || NvmeTier::open(dir, capacity))
        .await
        .map_err(|e| nvme_err(TierError::Io(std::io::Error::other(e))))?;
    let nvme: Arc<dyn Tier> = Arc::new(opened.map_err(nvme_err)?);
    let memory: Arc<dyn Tier> = Arc::new(MemoryTier::new(config.memory_capacity));
    let counters = Arc::new(Counters::default());
    let cache_config = CacheConfig {
        nvme_write_budget: config.nvme_write_budget,
        writeback_idle: Duration::from_millis(config.nvme_writeback_idle_ms),
        zero_copy: config.zero_copy,
    };
    let cache = Arc::new(BlockCache::new(memory, nvme, cache_config, counters.clone()));
    let mounts = Arc::new(Mounts::new(factory, claim_state(config)?));
    let blocks = BlockService::new(
        cache,
        counters,
        mounts,
        Duration::from_millis(config.ufs_timeout_ms),
        Arc::new(classes::ClassGate::for_ufs_fetches(config.ufs_fetch_slots)),
        clock,
    );
    blocks.set_cut_through(config.cut_through);
    Ok(Arc::new(blocks))
}

/// Claims what this worker (or sidecar) owns — its data, NVMe and journal directories (marked),
/// its socket, token and TLS files — so that no local mount serves them (`strata_ufs::fence`).
fn claim_state(config: &WorkerConfig) -> Result<StateFence, WorkerError> {
    let fence = StateFence::new();
    let failed = |path: &Path| {
        let path = path.display().to_string();
        move |source| WorkerError::State { path, source }
    };
    for dir in [config.data_dir.clone(), config.nvme_dir(), config.journal_dir()] {
        fence.claim_dir(&dir).map_err(failed(&dir))?;
    }
    let tls = [&config.tls.cert, &config.tls.key, &config.tls.ca];
    let files = [&config.socket_path, &config.token_file].into_iter().chain(tls);
    for file in files.filter_map(Option::as_ref) {
        fence.claim_file(file).map_err(failed(file))?;
    }
    Ok(fence)
}

/// The writer moving dirty DRAM blocks to NVMe while reads are quiet (see `cache`).
pub(crate) fn spawn_writeback(blocks: &Arc<BlockService>, cancel: &CancellationToken) -> JoinHandle<()> {
    let (blocks, cancel) = (blocks.clone(), cancel.clone());
    tokio::spawn(async move { blocks.cache().run_writeback(blocks.qos(), cancel).await })
}

/// `/metrics` and `/health` (healthy while the block service is alive) on `addr`.
pub(crate) async fn serve_ops(
    addr: SocketAddr,
    blocks: &Arc<BlockService>,
) -> Result<(SocketAddr, JoinHandle<()>), WorkerError> {
    let health = Arc::downgrade(blocks);
    strata_proto::ops_http::serve(
        addr,
        Arc::new(move || if health.upgrade().is_some() { Ok(()) } else { Err("stopped".into()) }),
    )
    .await
    .map_err(|source| WorkerError::Bind { addr, source })
}

fn load_or_create_id(dir: &Path) -> Result<String, WorkerError> {
    let path = dir.join("worker-id");
    let io = |source| WorkerError::Identity { path: path.display().to_string(), source };
    match std::fs::read_to_string(&path) {
        Ok(id) if !id.trim().is_empty() => return Ok(id.trim().to_string()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    std::fs::create_dir_all(dir).map_err(io)?;
    let id = format!("worker-{}", uuid::Uuid::new_v4().simple());
    std::fs::write(&path, &id).map_err(io)?;
    Ok(id)
}

pub struct Worker;

impl Worker {
    pub async fn start(
        config: WorkerConfig,
        factory: Arc<dyn UfsFactory>,
    ) -> Result<WorkerHandle, WorkerError> {
        Self::start_with_clock(config, factory, strata_common::clock::system()).await
    }

    /// [`start`](Self::start) with `clock` deciding leases and quiet times (tests).
    pub async fn start_with_clock(
        config: WorkerConfig,
        factory: Arc<dyn UfsFactory>,
        clock: SharedClock,
    ) -> Result<WorkerHandle, WorkerError> {
        config.watermarks.check().map_err(WorkerError::Config)?;
        config.check_qos().map_err(WorkerError::Config)?;
        let worker_id = match &config.worker_id {
            Some(id) => id.clone(),
            None => load_or_create_id(&config.data_dir)?,
        };
        let blocks = open_blocks(&config, factory, clock.clone()).await?;
        let grants = Arc::new(Grants::from_config(&config, clock.clone())?);
        let token = config.resolve_token()?;
        let server_tls = config.tls.server()?;
        let master =
            master_link::connect(&config.master_addr, token.as_deref(), config.tls.client()?).map_err(
                |e| WorkerError::MasterAddr { addr: config.master_addr.clone(), reason: e.to_string() },
            )?;
        blocks.mounts().set_source(Arc::new(master_link::MasterMounts {
            client: master.clone(),
            worker_id: worker_id.clone(),
        }));

        let listener = TcpListener::bind(config.data_addr)
            .await
            .map_err(|source| WorkerError::Bind { addr: config.data_addr, source })?;
        let data_addr =
            listener.local_addr().map_err(|source| WorkerError::Bind { addr: config.data_addr, source })?;
        let host = match &config.advertise_host {
            Some(h) => h.clone(),
            None if data_addr.ip().is_unspecified() => "127.0.0.1".to_string(),
            None => data_addr.ip().to_string(),
        };
        let cancel = CancellationToken::new();
        let journal_dir = config.journal_dir();
        let journal = tokio::task::spawn_blocking(move || journal::Journal::open(journal_dir))
            .await
            .map_err(std::io::Error::other)
            .and_then(|opened| opened)
            .map_err(|source| WorkerError::Journal {
                dir: config.journal_dir().display().to_string(),
                source,
            })?
            .0;
        let writeback = Arc::new(writeback::WriteBack::new(
            Arc::new(journal),
            blocks.mounts().clone(),
            worker_id.clone(),
            cancel.clone(),
        ));
        writeback.set_master(Arc::new(master_link::MasterWriteBack {
            client: master.clone(),
            worker_id: worker_id.clone(),
        }));
        blocks.set_journal(writeback.journal().clone());
        let view = Arc::new(view::LastView::new(worker_id.clone()));
        let auth = master_link::learn_tokens(&master, &worker_id).await;
        let connections = Arc::new(dataplane::Connections::from_config(&config));
        let pins = pins::PinSet::new();
        let handoff = HandOff {
            receiver: Arc::new(handoff::Receiver::new(blocks.clone(), pins.clone(), config.handoff_queue)),
            progress: Arc::new(handoff::Progress::default()),
            draining: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            link: Arc::new(std::sync::OnceLock::new()),
            view: view.clone(),
        };
        let prefetch = Arc::new(prefetch::Prefetcher::default());
        let classes = Arc::new(classes::ClassGate::with_slots(config.qos_slots));
        let latency_lane =
            Arc::new(dataplane::LatencyLane::new(config.qos_latency_thread, config.qos_latency_priority()));
        let plane = dataplane::DataPlane {
            blocks: blocks.clone(),
            grants: grants.clone(),
            view: view.clone(),
            auth: auth.clone(),
            connections: connections.clone(),
            writeback: Some(writeback.clone()),
            handoff: Some(handoff.receiver.clone()),
            prefetch: Some(prefetch.clone()),
            classes: classes.clone(),
            latency_lane: latency_lane.clone(),
        };
        // Bound before the TCP plane starts, so a bad socket path fails the start cleanly.
        let local = match &config.socket_path {
            Some(path) => {
                let path = std::path::absolute(path)
                    .map_err(|source| WorkerError::Socket { path: path.display().to_string(), source })?;
                let listener = sidecar::bind_socket(&path, config.socket_group.as_deref())?;
                Some((path, listener))
            }
            None => None,
        };
        let mut local_socket = None;
        let mut tasks = vec![tokio::spawn(prefetch::run(
            prefetch.clone(),
            blocks.clone(),
            config.prefetch_parallelism,
            cancel.clone(),
        ))];
        if let Some((path, listener)) = local {
            tasks.push(tokio::spawn(dataplane::serve_unix(listener, plane.clone(), cancel.clone())));
            local_socket = Some(path);
        }
        tasks.push(match server_tls {
            Some(tls) => tokio::spawn(dataplane::serve_tls(listener, tls, plane, cancel.clone())),
            None => tokio::spawn(dataplane::serve(listener, plane, cancel.clone())),
        });
        let (http_addr, http_task) = serve_ops(config.http_addr, &blocks).await?;

        let identity = master_link::Identity {
            worker_id: worker_id.clone(),
            data_addr: format!("{host}:{}", data_addr.port()),
            http_addr: http_addr.to_string(),
            node: config.node.clone().unwrap_or_default(),
            local_socket: local_socket.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
            state_paths: blocks.mounts().own_state(),
        };
        let tiers: Vec<Arc<dyn tier::Tier>> = blocks.cache().tiers().into_iter().cloned().collect();
        pins.install(&tiers);
        let upkeep = Arc::new(
            upkeep::Upkeep::new(
                &tiers,
                &config.watermarks,
                pins.clone(),
                upkeep::cluster_rules(blocks.mounts().clone(), view.clone(), worker_id.clone()),
                clock.clone(),
            )
            .awaiting_master_pins(),
        );
        let upkeep_task = tokio::spawn(upkeep::run(
            upkeep.clone(),
            Duration::from_millis(config.upkeep_interval_ms),
            cancel.clone(),
        ));
        let sender = handoff::Sender {
            blocks: blocks.clone(),
            view: view.clone(),
            me: worker_id.clone(),
            config: handoff::HandOffConfig {
                bandwidth: config.handoff_bandwidth,
                batch: config.handoff_batch,
                queue: config.handoff_queue,
            },
            link: handoff.link.clone(),
            draining: handoff.draining.clone(),
            progress: handoff.progress.clone(),
        };
        let handing_off = tokio::spawn(sender.run(cancel.clone()));
        let linked = master_link::Linked {
            blocks: blocks.clone(),
            view,
            auth,
            writeback,
            pins: pins.clone(),
            upkeep,
            draining: handoff.draining.clone(),
        };
        let link = tokio::spawn(master_link::run(master.clone(), identity, linked, clock, cancel.clone()));
        let loader = tokio::spawn(loader::run(master, worker_id.clone(), blocks.clone(), cancel.clone()));
        let writeback = spawn_writeback(&blocks, &cancel);
        info!(worker = %worker_id, %data_addr, %http_addr, node = config.node.as_deref().unwrap_or(""), local_socket = ?local_socket, nvme_dir = %config.nvme_dir().display(), "worker started");
        Ok(WorkerHandle {
            worker_id,
            data_addr,
            http_addr,
            blocks,
            grants,
            connections,
            pins,
            handoff,
            local_socket,
            prefetch,
            classes,
            latency_lane,
            cancel,
            tasks: {
                tasks.extend([http_task, link, loader, writeback, upkeep_task, handing_off]);
                tasks
            },
        })
    }
}
