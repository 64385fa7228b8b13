//! Starting and stopping a master, step by step: open the store; load the mounts, jobs and
//! schedules it holds; build the state (metadata, cluster, job runner); bind the gRPC and HTTP
//! servers; spawn the background loops; resume the jobs that were running.
//!
//! Invariant: nothing is served before the durable state is loaded, and a job that was running
//! is counted as resumed in the store before its runner starts.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use strata_common::background::spawn_loop;
use strata_common::{SharedClock, clock};
use strata_proto::master_server::MasterServer;
use strata_security::tls::TlsError;
use strata_ufs::{StateFence, UfsFactory};
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::auth::{Authed, Tokens};
use crate::cluster::Cluster;
use crate::config::MasterConfig;
use crate::jobs::Jobs;
use crate::lineage::Lineage;
use crate::membership::WorkerEntry;
use crate::metadata::{Metadata, MetadataParams};
use crate::mounts::{Mount, MountTable};
use crate::pins::Pins;
use crate::rpc::Rpc;
use crate::runner::{JobRunner, RunnerParams};
use crate::schedule::Schedules;
use crate::store::{MetaStore, RedbStore, StoreError};
use crate::writeback::WriteBack;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum MasterError {
    #[error("cannot bind {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("tokens: {0}")]
    Tokens(#[from] crate::error::OpError),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("cannot claim {path} as the master's own: {source}")]
    State { path: String, source: std::io::Error },
}

/// A running master. Dropping it does not stop it: call [`MasterHandle::shutdown`].
pub struct MasterHandle {
    pub rpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    stop: Stop,
}

enum Stop {
    Single {
        store: Arc<dyn MetaStore>,
        runner: Arc<JobRunner>,
        cancel: CancellationToken,
        tasks: Vec<JoinHandle<()>>,
    },
    Ha(crate::ha::HaStop),
}

impl MasterHandle {
    /// Stops serving, closes connections and releases the store (with etcd: resigns, so a
    /// standby takes over at once).
    pub async fn shutdown(self) {
        match self.stop {
            Stop::Single { store, runner, cancel, tasks } => {
                cancel.cancel();
                runner.shutdown().await;
                for task in tasks {
                    task.abort();
                    let _ = task.await;
                }
                store.close();
            }
            Stop::Ha(ha) => ha.shutdown().await,
        }
    }
}

pub struct Master;

impl Master {
    /// Opens the store, loads the mounts, binds both ports and starts serving.
    pub async fn start(
        config: MasterConfig,
        factory: Arc<dyn UfsFactory>,
    ) -> Result<MasterHandle, MasterError> {
        Self::start_with_clock(config, factory, clock::system()).await
    }

    /// [`start`](Self::start) with every decision by elapsed time (worker liveness, metadata
    /// TTLs, task leases, schedules) and every timestamp read on `clock`: a test passes a
    /// `ManualClock` and moves time instead of sleeping.
    ///
    /// With `config.meta` naming etcd, the master joins the election and serves as a standby
    /// until it leads (see `ha`).
    pub async fn start_with_clock(
        config: MasterConfig,
        factory: Arc<dyn UfsFactory>,
        clock: SharedClock,
    ) -> Result<MasterHandle, MasterError> {
        // Certificates are read first: a master with bad TLS material starts nothing.
        let rpc_server = rpc_server(&config)?;
        let fence = claim_state(&config)?;
        let factory = fence.wrap(factory);
        if !config.meta.is_empty() {
            let (rpc_addr, http_addr, stop) =
                crate::ha::start(config, factory, fence, clock, rpc_server).await?;
            return Ok(MasterHandle { rpc_addr, http_addr, stop: Stop::Ha(stop) });
        }
        let store: Arc<dyn MetaStore> = Arc::new(RedbStore::open(&config.data_dir.join("master.redb"))?);
        let (stored, resume) = load_state(&config, store.clone(), factory.as_ref(), &clock)?;
        let mut parts = build_parts(&config, stored, factory, fence, clock);
        let cancel = parts.cancel.clone();

        // Both ports are bound before anything is spawned: a master that cannot start leaves no
        // server behind holding the store open.
        let (listener, rpc_addr) = bind_rpc(config.rpc_addr).await?;
        let (http_addr, http_task) = serve_http(config.http_addr, &parts.runner).await?;
        parts.rpc.leader = config.advertise_addr.clone().unwrap_or_else(|| rpc_addr.to_string());
        let pending = parts.rpc.metadata.pending().clone();
        let pins = parts.rpc.pins.clone();
        let server = spawn_rpc(rpc_server, listener, parts.rpc, cancel.clone());

        let ticker = spawn_liveness_tick(&config, parts.cluster, pending, pins, cancel.clone());
        resume_jobs(&parts.runner, resume, &config);
        let jobs_ticker = spawn_jobs_tick(parts.runner.clone(), cancel.clone());
        info!(%rpc_addr, %http_addr, "master started");
        let tasks = vec![server, http_task, ticker, jobs_ticker];
        Ok(MasterHandle {
            rpc_addr,
            http_addr,
            stop: Stop::Single { store, runner: parts.runner, cancel, tasks },
        })
    }
}

/// The store and what it holds, ready to serve.
pub(crate) struct Stored {
    store: Arc<dyn MetaStore>,
    mounts: MountTable,
    jobs: Jobs,
    schedules: Schedules,
    /// Workers a previous leader registered (etcd only).
    workers: Vec<WorkerEntry>,
    tokens: Arc<Tokens>,
    /// Write-back files acknowledged and not yet in the UFS.
    pending: Arc<WriteBack>,
    pins: Arc<Pins>,
    lineage: Arc<Lineage>,
}

/// The stored state, and the ids of the jobs that were running (to resume).
pub(crate) fn load_state(
    config: &MasterConfig,
    store: Arc<dyn MetaStore>,
    factory: &dyn UfsFactory,
    clock: &SharedClock,
) -> Result<(Stored, Vec<String>), MasterError> {
    let tokens = Arc::new(Tokens::load(
        config.auth,
        store.clone(),
        clock.clone(),
        Some(&config.token_files()),
        epoch_base(clock),
    )?);
    let mounts = load_mounts(store.as_ref(), factory)?;
    let (jobs, resume) = load_jobs(store.as_ref(), clock)?;
    let schedules = load_schedules(store.as_ref(), clock)?;
    let workers = store.load_workers()?;
    let grace = std::time::Duration::from_millis(config.writeback_journal_grace_ms);
    let pending = Arc::new(WriteBack::load(store.clone(), clock.clone(), grace)?);
    let pins =
        Arc::new(Pins::new(store.load_pins()?, store.load_cache_ttls()?, store.clone(), clock.clone()));
    let lineage = Arc::new(Lineage::load(store.clone(), clock.clone(), config.lineage_settings())?);
    info!(
        mounts = mounts.len(),
        resuming_jobs = resume.len(),
        workers = workers.len(),
        tokens = tokens.list().len(),
        pins = pins.list().len(),
        auth = config.auth,
        "master state loaded"
    );
    Ok((Stored { store, mounts, jobs, schedules, workers, tokens, pending, pins, lineage }, resume))
}

/// The master's parts, each handed what it uses, and the token that stops them.
pub(crate) struct Parts {
    pub(crate) cluster: Arc<Cluster>,
    pub(crate) runner: Arc<JobRunner>,
    pub(crate) rpc: Rpc,
    pub(crate) cancel: CancellationToken,
}

pub(crate) fn build_parts(
    config: &MasterConfig,
    stored: Stored,
    factory: Arc<dyn UfsFactory>,
    fence: StateFence,
    clock: SharedClock,
) -> Parts {
    let Stored { store, mounts, jobs, schedules, workers, tokens, pending, pins, lineage } = stored;
    let cancel = CancellationToken::new();
    let metadata = Arc::new(Metadata::new(MetadataParams {
        mounts,
        first_epoch: epoch_base(&clock),
        factory,
        store: store.clone(),
        cache_entries: config.metadata_cache_entries,
        clock: clock.clone(),
        pending,
        fence,
    }));
    let timeout = Duration::from_millis(config.worker_timeout_ms);
    let cluster = Arc::new(Cluster::new(timeout, epoch_base(&clock), clock.clone(), store.clone()));
    cluster.preload(workers);
    metadata.learn_state_paths(cluster.state_paths());
    let runner = Arc::new(JobRunner::new(RunnerParams {
        jobs,
        schedules,
        store,
        metadata: metadata.clone(),
        cluster: cluster.clone(),
        cancel: cancel.child_token(),
        clock,
        heartbeat_interval: Duration::from_millis(config.heartbeat_interval_ms),
        job_history: config.job_history,
    }));
    runner.prune_history();
    let rpc = Rpc {
        metadata,
        cluster: cluster.clone(),
        jobs: runner.clone(),
        heartbeat_interval_ms: config.heartbeat_interval_ms,
        leader: String::new(),
        tokens,
        pins,
        lineage,
    };
    Parts { cluster, runner, rpc, cancel }
}

/// Claims what this master owns — its data directory (marked), token files and TLS files — so
/// that no local mount serves them (see `strata_ufs::fence`).
fn claim_state(config: &MasterConfig) -> Result<StateFence, MasterError> {
    let fence = StateFence::new();
    let failed = |path: &std::path::Path| {
        let path = path.display().to_string();
        move |source| MasterError::State { path, source }
    };
    fence.claim_dir(&config.data_dir).map_err(failed(&config.data_dir))?;
    let tokens = config.token_files();
    let tls = [&config.tls.cert, &config.tls.key, &config.tls.ca];
    let files =
        [Some(&tokens.admin_file), Some(&tokens.worker_file)].into_iter().chain(tls.map(Option::as_ref));
    for file in files.flatten() {
        fence.claim_file(file).map_err(failed(file))?;
    }
    Ok(fence)
}

/// Wall-clock milliseconds: the first epochs and task ids, which must grow across restarts.
fn epoch_base(clock: &SharedClock) -> u64 {
    clock.wall_ms().max(0) as u64
}

fn load_mounts(store: &dyn MetaStore, factory: &dyn UfsFactory) -> Result<MountTable, MasterError> {
    let mut table = MountTable::default();
    for record in store.load_mounts()? {
        // A mount that no longer opens (option rules changed) is kept in the store and
        // reported, not dropped: losing a user's mount silently is worse.
        match Mount::open(record.clone(), factory) {
            Ok(mount) => {
                table.insert(mount);
            }
            Err(e) => warn!(mount = %record.path, err = %e, "stored mount cannot be opened; skipped"),
        }
    }
    Ok(table)
}

/// The job table with every stored job, and the ids of those to resume (each counted as
/// resumed in the store first).
fn load_jobs(store: &dyn MetaStore, clock: &SharedClock) -> Result<(Jobs, Vec<String>), MasterError> {
    // Task ids of this master start above the last one's, so a late report of an old task can
    // never complete a new one.
    let mut jobs = Jobs::new((epoch_base(clock) & 0xFFFF_FFFF_FFFF) << 16);
    let mut resume = Vec::new();
    for mut record in store.load_jobs()? {
        if !record.phase.is_final() {
            record.resumed += 1;
            store.put_job(&record)?;
            resume.push(record.id.clone());
        }
        jobs.insert(record);
    }
    Ok((jobs, resume))
}

fn load_schedules(store: &dyn MetaStore, clock: &SharedClock) -> Result<Schedules, MasterError> {
    let mut schedules = Schedules::default();
    let now_ms = clock.wall_ms();
    for record in store.load_schedules()? {
        let id = record.id.clone();
        if let Err(e) = schedules.insert(record, now_ms) {
            warn!(schedule = %id, err = %e, "stored schedule cannot be parsed; skipped");
        }
    }
    Ok(schedules)
}

pub(crate) async fn bind_rpc(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), MasterError> {
    let bind_err = |source| MasterError::Bind { addr, source };
    let listener = TcpListener::bind(addr).await.map_err(bind_err)?;
    let local = listener.local_addr().map_err(bind_err)?;
    Ok((listener, local))
}

/// `/metrics` and `/health`; healthy while the master's parts are alive.
async fn serve_http(
    addr: SocketAddr,
    runner: &Arc<JobRunner>,
) -> Result<(SocketAddr, JoinHandle<()>), MasterError> {
    let alive = Arc::downgrade(runner);
    let health = Arc::new(move || if alive.upgrade().is_some() { Ok(()) } else { Err("stopped".into()) });
    strata_proto::ops_http::serve(addr, health).await.map_err(|source| MasterError::Bind { addr, source })
}

/// The gRPC service a master serves: the handlers behind the token check.
pub(crate) type MasterService = Authed<MasterServer<Rpc>>;

/// The gRPC service over `rpc`, with the message limits, behind the token check.
pub(crate) fn master_service(rpc: Rpc) -> MasterService {
    let tokens = rpc.tokens.clone();
    let server = MasterServer::new(rpc)
        .max_decoding_message_size(strata_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(strata_proto::MAX_MESSAGE_BYTES);
    Authed::new(server, tokens)
}

/// The gRPC server, speaking TLS when `config.tls` has a certificate and key (and requiring
/// client certificates with `client_auth`).
pub(crate) fn rpc_server(config: &MasterConfig) -> Result<tonic::transport::Server, MasterError> {
    let builder = tonic::transport::Server::builder();
    match config.tls.server()? {
        Some(tls) => {
            Ok(builder.tls_config(tls.tonic()).map_err(|e| TlsError::Rustls(format!("gRPC server: {e}")))?)
        }
        None => Ok(builder),
    }
}

fn spawn_rpc(
    mut server: tonic::transport::Server,
    listener: TcpListener,
    rpc: Rpc,
    cancel: CancellationToken,
) -> JoinHandle<()> {
    // Without TCP_NODELAY (tonic leaves it unset on an accepted socket) a small answer waits
    // for the client's delayed ACK: every master call took ~40 ms, and each client's periodic
    // membership refresh stalled its reads for that long (strata-bench --tail-probe).
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let svc = master_service(rpc);
    tokio::spawn(async move {
        let result =
            server.add_service(svc).serve_with_incoming_shutdown(incoming, cancel.cancelled_owned()).await;
        if let Err(e) = result {
            warn!(err = %e, "master rpc server stopped");
        }
    })
}

/// Declares silent workers lost, a few times per timeout.
pub(crate) fn spawn_liveness_tick(
    config: &MasterConfig,
    cluster: Arc<Cluster>,
    pending: Arc<WriteBack>,
    pins: Arc<Pins>,
    cancel: CancellationToken,
) -> JoinHandle<()> {
    let every = Duration::from_millis((config.worker_timeout_ms / 4).clamp(10, 1000));
    spawn_loop(every, cancel, move || {
        cluster.tick();
        pending.tick();
        pins.tick();
        std::future::ready(())
    })
}

/// Expires leases, follows membership, fires schedules.
pub(crate) fn spawn_jobs_tick(runner: Arc<JobRunner>, cancel: CancellationToken) -> JoinHandle<()> {
    spawn_loop(Duration::from_millis(100), cancel, move || {
        let runner = runner.clone();
        async move { runner.tick().await }
    })
}

pub(crate) fn resume_jobs(runner: &Arc<JobRunner>, ids: Vec<String>, config: &MasterConfig) {
    // Resumed jobs wait for the workers to register again, so their tasks go to the owners on
    // the whole ring and not to whichever worker came back first.
    let settle = Duration::from_millis(config.heartbeat_interval_ms * 3).max(Duration::from_secs(1));
    for id in ids {
        info!(job = %id, "resuming load job");
        runner.spawn_runner(id, settle);
    }
}

#[cfg(test)]
mod tests {
    use strata_ufs::OpendalFactory;

    use super::*;

    #[tokio::test]
    async fn a_master_that_cannot_bind_leaves_its_store_free_for_the_next_attempt() {
        let dir = tempfile::tempdir().unwrap();
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let config = MasterConfig {
            rpc_addr: "127.0.0.1:0".parse().unwrap(),
            http_addr: taken.local_addr().unwrap(),
            data_dir: dir.path().to_path_buf(),
            ..MasterConfig::default()
        };
        let err =
            Master::start(config.clone(), Arc::new(OpendalFactory)).await.err().expect("http port taken");
        assert!(matches!(err, MasterError::Bind { addr, .. } if addr == config.http_addr), "{err}");
        let config = MasterConfig { http_addr: "127.0.0.1:0".parse().unwrap(), ..config };
        let master = Master::start(config, Arc::new(OpendalFactory)).await.expect("the store was released");
        master.shutdown().await;
    }
}
