//! The Strata worker: holds blocks in DRAM and NVMe tiers over the UFS and serves byte ranges
//! of them on its data plane. See `tier` for the storage contract and `blockstore` for the
//! read path.

pub mod blockstore;
pub mod config;
pub mod dataplane;
pub mod lease;
pub mod loader;
mod master_link;
pub mod metrics_defs;
mod rdma;
pub mod shortcircuit;
pub mod sidecar;
pub mod tier;
mod writes;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use strata_ufs::UfsFactory;
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::info;

pub use blockstore::BlockStore;
pub use config::WorkerConfig;
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
    #[error("RDMA: {reason}")]
    Rdma { reason: String },
}

/// A running worker. Dropping it does not stop it: call [`WorkerHandle::shutdown`].
pub struct WorkerHandle {
    pub worker_id: String,
    pub data_addr: SocketAddr,
    pub http_addr: SocketAddr,
    pub store: Arc<BlockStore>,
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
    }

    /// Finishes queued NVMe writes, then stops.
    pub async fn shutdown(self) {
        self.store.flush().await;
        self.kill().await;
    }
}

/// The tiers and block store a worker (or a sidecar) serves from.
pub(crate) async fn open_store(
    config: &WorkerConfig,
    factory: Arc<dyn UfsFactory>,
) -> Result<Arc<BlockStore>, WorkerError> {
    let nvme_dir = config.nvme_dir();
    // Opening reads one header per block: keep that off the async threads.
    let nvme_err = |source| WorkerError::Nvme { dir: nvme_dir.display().to_string(), source };
    let (dir, capacity) = (nvme_dir.clone(), config.nvme_capacity);
    let opened = tokio::task::spawn_blocking(move || NvmeTier::open(dir, capacity))
        .await
        .map_err(|e| nvme_err(TierError::Io(std::io::Error::other(e))))?;
    let nvme: Arc<dyn Tier> = Arc::new(opened.map_err(nvme_err)?);
    let memory: Arc<dyn Tier> = Arc::new(MemoryTier::new(config.memory_capacity));
    let store = BlockStore::new(
        memory,
        nvme,
        factory,
        Duration::from_millis(config.ufs_timeout_ms),
        config.nvme_write_budget,
    );
    store.set_zero_copy(config.zero_copy);
    store.set_writeback_idle(Duration::from_millis(config.nvme_writeback_idle_ms));
    store.configure_short_circuit(config.into());
    Ok(Arc::new(store))
}

/// The task writing dirty DRAM blocks to NVMe while reads are quiet (see `BlockStore::keep`).
pub(crate) fn spawn_writeback(store: &Arc<BlockStore>, cancel: &CancellationToken) -> JoinHandle<()> {
    let (store, cancel) = (store.clone(), cancel.clone());
    tokio::spawn(async move { store.run_writeback(cancel).await })
}

/// `/metrics` and `/health` (healthy while the block store is alive) on `addr`.
pub(crate) async fn serve_ops(
    addr: SocketAddr,
    store: &Arc<BlockStore>,
) -> Result<(SocketAddr, JoinHandle<()>), WorkerError> {
    let health_store = Arc::downgrade(store);
    strata_proto::ops_http::serve(
        addr,
        Arc::new(move || if health_store.upgrade().is_some() { Ok(()) } else { Err("stopped".into()) }),
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
        let worker_id = match &config.worker_id {
            Some(id) => id.clone(),
            None => load_or_create_id(&config.data_dir)?,
        };
        let nvme_dir = config.nvme_dir();
        let store = open_store(&config, factory).await?;
        let grants = rdma::RdmaGrants::from_config(&config.rdma)
            .map_err(|e| WorkerError::Rdma { reason: e.to_string() })?;
        if let Some(grants) = grants {
            store.set_rdma(grants);
        }

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
        let dp = tokio::spawn(dataplane::serve(listener, store.clone(), cancel.clone()));

        let (http_addr, http_task) = serve_ops(config.http_addr, &store).await?;

        let client = master_link::connect(&config.master_addr).await.map_err(|e| {
            WorkerError::MasterAddr { addr: config.master_addr.clone(), reason: e.to_string() }
        })?;
        store.set_master(client.clone(), worker_id.clone());
        let identity = master_link::Identity {
            worker_id: worker_id.clone(),
            data_addr: format!("{host}:{}", data_addr.port()),
            http_addr: http_addr.to_string(),
        };
        let link = tokio::spawn(master_link::run(client.clone(), identity, store.clone(), cancel.clone()));
        let loader = tokio::spawn(loader::run(client, worker_id.clone(), store.clone(), cancel.clone()));
        let writeback = spawn_writeback(&store, &cancel);
        info!(worker = %worker_id, %data_addr, %http_addr, nvme_dir = %nvme_dir.display(), "worker started");
        Ok(WorkerHandle {
            worker_id,
            data_addr,
            http_addr,
            store,
            cancel,
            tasks: vec![dp, http_task, link, loader, writeback],
        })
    }
}
