//! The master process: state, the gRPC adapter over it, background liveness ticks.
//!
//! Handlers are thin: they normalise input, call into the state (membership, mounts, block
//! map, metadata cache) and map errors to `tonic::Status` through `strata_proto::status`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use moka::future::Cache;
use strata_common::{ErrorKind, block, path};
use strata_proto::master_server::{Master as MasterRpc, MasterServer};
use strata_proto::{
    AddMountRequest, BlockLocation, BlockLocations, BlockLocationsRequest, ClusterStatus, DeleteRequest,
    Empty, FetchLoadTasksRequest, FileStatus, HeartbeatRequest, HeartbeatResponse, InvalidateRequest, JobId,
    JobInfo, JobList, ListJobsRequest, ListRequest, ListResponse, LoadTasks, MkdirRequest, MountInfo,
    MountList, RegisterWorkerRequest, RegisterWorkerResponse, RemoveMountRequest, Replica,
    ReportLoadTasksRequest, ReportLoadTasksResponse, ScheduleId, ScheduleInfo, ScheduleList, ScheduleRequest,
    StatRequest, SubmitLoadRequest, WorkerMountsRequest, WorkerStatus,
};
use strata_ufs::{ObjectMeta, UfsEntry, UfsFactory, redact_options};
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use crate::blockmap::BlockMap;
use crate::config::MasterConfig;
use crate::jobs::{
    JobInfo as Job, Jobs, LoadSettings, LoadTask as Task, LoadTaskResult as TaskResult, Phase,
};
use crate::membership::Membership;
use crate::metrics_defs as m;
use crate::mounts::{Mount, MountError, MountRecord, MountTable};
use crate::reports::{
    BlockReport as Report, Tier as OwnTier, TierUsage as Usage, WorkerCounters as Counters,
};
use crate::schedule::{ScheduleRecord, Schedules};
use crate::store::{MetaStore, RedbStore, StoreError};

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum MasterError {
    #[error("cannot bind {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error(transparent)]
    Store(#[from] StoreError),
}

type RpcResult<T> = Result<Response<T>, Status>;

pub(crate) struct CachedStat {
    pub(crate) at: Instant,
    pub(crate) meta: ObjectMeta,
}

struct CachedList {
    at: Instant,
    entries: Vec<UfsEntry>,
}

pub(crate) struct State {
    pub(crate) config: MasterConfig,
    pub(crate) membership: Mutex<Membership>,
    mounts: RwLock<MountTable>,
    mounts_epoch: Mutex<u64>,
    pub(crate) blocks: Mutex<BlockMap>,
    pub(crate) store: Arc<dyn MetaStore>,
    factory: Arc<dyn UfsFactory>,
    pub(crate) stats: Cache<String, Arc<CachedStat>>,
    lists: Cache<String, Arc<CachedList>>,
    pub(crate) jobs: Mutex<Jobs>,
    pub(crate) schedules: Mutex<Schedules>,
    /// Wakes workers long-polling for load tasks.
    pub(crate) task_ready: Notify,
    /// Wakes job runners (and followers) when tasks report.
    pub(crate) progress: Notify,
    /// Stops every job runner when the master shuts down.
    pub(crate) jobs_cancel: CancellationToken,
    pub(crate) runners: Mutex<Vec<JoinHandle<()>>>,
}

/// Wall-clock milliseconds since the Unix epoch.
pub(crate) fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn err(rpc: &'static str, kind: ErrorKind, msg: impl Into<String>) -> Status {
    metrics::counter!(m::RPC_ERRORS, "rpc" => rpc, "kind" => kind.as_str()).increment(1);
    strata_proto::status(kind, msg)
}

fn mount_err(rpc: &'static str, e: MountError) -> Status {
    err(rpc, e.kind(), e.to_string())
}

fn ufs_err(rpc: &'static str, path: &str, e: strata_ufs::UfsError) -> Status {
    let msg = match &e {
        strata_ufs::UfsError::NotFound(_) => format!("no such file or directory: {path}"),
        other => format!("{path}: {other}"),
    };
    err(rpc, e.kind(), msg)
}

fn now_epoch_base() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

impl State {
    pub(crate) fn resolve(
        &self,
        rpc: &'static str,
        raw: &str,
    ) -> Result<(String, Arc<Mount>, String), Status> {
        let p = path::normalize(raw).map_err(|e| err(rpc, ErrorKind::InvalidArgument, e.to_string()))?;
        let mounts = self.mounts.read().unwrap_or_else(|p| p.into_inner());
        let (mount, rel) = mounts.resolve(&p).ok_or_else(|| {
            err(rpc, ErrorKind::NotFound, format!("{p} is not under any mount (see `strata mount ls`)"))
        })?;
        Ok((p, mount, rel))
    }

    pub(crate) async fn stat_path(
        &self,
        rpc: &'static str,
        raw: &str,
        sync: bool,
    ) -> Result<(String, Arc<Mount>, String, ObjectMeta), Status> {
        let (p, mount, rel) = self.resolve(rpc, raw)?;
        let cached = if sync { None } else { self.stats.get(&p).await };
        if let Some(hit) = cached.filter(|hit| hit.at.elapsed() < mount.metadata_ttl) {
            metrics::counter!(m::METADATA_CACHE, "result" => "hit").increment(1);
            return Ok((p, mount, rel, hit.meta.clone()));
        }
        metrics::counter!(m::METADATA_CACHE, "result" => "miss").increment(1);
        let meta = if rel.is_empty() {
            // The mount point itself is a directory even if the UFS root has no entry.
            ObjectMeta { is_dir: true, size: 0, version: String::new(), mtime_ms: 0 }
        } else {
            match mount.ufs.stat(&rel).await {
                Ok(meta) => meta,
                Err(e) => {
                    self.stats.invalidate(&p).await;
                    return Err(ufs_err(rpc, &p, e));
                }
            }
        };
        if !mount.metadata_ttl.is_zero() {
            self.stats
                .insert(p.clone(), Arc::new(CachedStat { at: Instant::now(), meta: meta.clone() }))
                .await;
        }
        Ok((p, mount, rel, meta))
    }

    fn file_status(path: &str, mount: &Mount, rel: &str, meta: &ObjectMeta) -> FileStatus {
        FileStatus {
            path: path.to_string(),
            is_dir: meta.is_dir,
            size: meta.size,
            version: meta.version.clone(),
            mtime_ms: meta.mtime_ms,
            block_size: mount.block_size,
            file_id: if meta.is_dir {
                String::new()
            } else {
                block::file_identity(&mount.record.uri, rel, mount.block_size)
            },
        }
    }

    fn mount_info(mount: &Mount, with_secrets: bool) -> MountInfo {
        let options =
            if with_secrets { mount.record.options.clone() } else { redact_options(&mount.record.options) };
        MountInfo {
            path: mount.record.path.clone(),
            uri: mount.record.uri.clone(),
            options: options.into_iter().collect::<HashMap<_, _>>(),
            block_size: mount.block_size,
            metadata_ttl_ms: mount.metadata_ttl.as_millis() as u64,
        }
    }

    fn mount_list(&self, with_secrets: bool) -> MountList {
        let mounts = self.mounts.read().unwrap_or_else(|p| p.into_inner());
        MountList {
            epoch: *lock(&self.mounts_epoch),
            mounts: mounts.iter().map(|m| Self::mount_info(m, with_secrets)).collect(),
        }
    }

    /// A path on a mount that may be written through Strata (`mode=write-through`).
    fn writable(&self, rpc: &'static str, raw: &str) -> Result<(String, Arc<Mount>, String), Status> {
        let (p, mount, rel) = self.resolve(rpc, raw)?;
        if mount.read_only || mount.ufs.as_write().is_none() {
            return Err(err(
                rpc,
                ErrorKind::PermissionDenied,
                format!(
                    "{p} is on the read-only mount {} (mount it with -o mode=write-through to write through Strata)",
                    mount.record.path
                ),
            ));
        }
        Ok((p, mount, rel))
    }

    /// Forgets cached metadata a change at `p` makes stale: its own, and the listings (and
    /// stats: an object store's directory exists only while it has children) of its parents.
    async fn forget(&self, p: &str, subtree: bool) {
        if subtree {
            self.stats.invalidate_all();
            self.lists.invalidate_all();
            return;
        }
        self.stats.invalidate(p).await;
        self.lists.invalidate(p).await;
        let mut cur = p;
        while let Some((parent, _)) = cur.rsplit_once('/') {
            let parent = if parent.is_empty() { "/" } else { parent };
            self.stats.invalidate(parent).await;
            self.lists.invalidate(parent).await;
            if parent == "/" {
                break;
            }
            cur = parent;
        }
    }

    fn tick(&self) {
        let lost = lock(&self.membership).tick(Instant::now());
        if !lost.is_empty() {
            let mut blocks = lock(&self.blocks);
            for id in &lost {
                warn!(worker = %id, "worker lost: no heartbeat within the timeout");
                blocks.drop_worker(id);
            }
            metrics::counter!(m::WORKERS_LOST).increment(lost.len() as u64);
            metrics::gauge!(m::BLOCKS).set(blocks.total_blocks() as f64);
        }
        metrics::gauge!(m::LIVE_WORKERS).set(lock(&self.membership).live_members().len() as f64);
    }
}

// ---- own types <-> protobuf ----

fn tier(t: i32) -> OwnTier {
    match strata_proto::Tier::try_from(t) {
        Ok(strata_proto::Tier::Memory) => OwnTier::Memory,
        Ok(strata_proto::Tier::Nvme) => OwnTier::Nvme,
        _ => OwnTier::Unspecified,
    }
}

fn proto_tier(t: OwnTier) -> strata_proto::Tier {
    match t {
        OwnTier::Unspecified => strata_proto::Tier::Unspecified,
        OwnTier::Memory => strata_proto::Tier::Memory,
        OwnTier::Nvme => strata_proto::Tier::Nvme,
    }
}

fn tier_usage(u: &strata_proto::TierUsage) -> Usage {
    Usage { tier: tier(u.tier), capacity_bytes: u.capacity_bytes, used_bytes: u.used_bytes, blocks: u.blocks }
}

fn proto_tier_usage(u: &Usage) -> strata_proto::TierUsage {
    strata_proto::TierUsage {
        tier: proto_tier(u.tier) as i32,
        capacity_bytes: u.capacity_bytes,
        used_bytes: u.used_bytes,
        blocks: u.blocks,
    }
}

fn counters(c: &strata_proto::WorkerCounters) -> Counters {
    Counters {
        cache_hits: c.cache_hits,
        cache_misses: c.cache_misses,
        ufs_reads: c.ufs_reads,
        ufs_bytes_read: c.ufs_bytes_read,
        bytes_served: c.bytes_served,
        corrupt_blocks: c.corrupt_blocks,
    }
}

fn proto_counters(c: &Counters) -> strata_proto::WorkerCounters {
    strata_proto::WorkerCounters {
        cache_hits: c.cache_hits,
        cache_misses: c.cache_misses,
        ufs_reads: c.ufs_reads,
        ufs_bytes_read: c.ufs_bytes_read,
        bytes_served: c.bytes_served,
        corrupt_blocks: c.corrupt_blocks,
    }
}

fn block_report(r: &strata_proto::BlockReport) -> Report {
    Report { file_id: r.file_id.clone(), version: r.version.clone(), index: r.index, tier: tier(r.tier) }
}

fn load_settings(o: strata_proto::LoadOptions) -> LoadSettings {
    LoadSettings {
        replicas: o.replicas.max(1),
        bandwidth: o.bandwidth,
        parallelism: o.parallelism,
        include: o.include,
        exclude: o.exclude,
        skip_cached: o.skip_cached,
        verify: o.verify,
        sync: o.sync,
        dry_run: o.dry_run,
        metadata_only: o.metadata_only,
    }
}

fn load_options(s: &LoadSettings) -> strata_proto::LoadOptions {
    strata_proto::LoadOptions {
        replicas: s.replicas,
        bandwidth: s.bandwidth,
        parallelism: s.parallelism,
        include: s.include.clone(),
        exclude: s.exclude.clone(),
        skip_cached: s.skip_cached,
        verify: s.verify,
        sync: s.sync,
        dry_run: s.dry_run,
        metadata_only: s.metadata_only,
    }
}

fn job_state(p: Phase) -> strata_proto::JobState {
    match p {
        Phase::Running => strata_proto::JobState::Running,
        Phase::Succeeded => strata_proto::JobState::Succeeded,
        Phase::Failed => strata_proto::JobState::Failed,
        Phase::Cancelled => strata_proto::JobState::Cancelled,
    }
}

fn job_info(j: Job) -> strata_proto::JobInfo {
    let p = j.progress;
    strata_proto::JobInfo {
        id: j.id,
        path: j.path,
        options: Some(load_options(&j.settings)),
        state: job_state(j.phase) as i32,
        pass: j.pass,
        listing_done: j.listing_done,
        files_total: p.files_total,
        files_done: p.files_done,
        bytes_total: p.bytes_total,
        bytes_done: p.bytes_done,
        blocks_total: p.blocks_total,
        blocks_done: p.blocks_done,
        blocks_already_cached: p.blocks_already_cached,
        blocks_verify_loaded: p.blocks_verify_loaded,
        files_failed: p.files_failed,
        failures: j
            .failures
            .into_iter()
            .map(|f| strata_proto::FileFailure { path: f.path, reason: f.reason })
            .collect(),
        created_ms: j.created_ms,
        finished_ms: j.finished_ms,
        schedule_id: j.schedule_id,
        resumed: j.resumed,
        task_retries: p.task_retries,
    }
}

fn load_task(t: Task) -> strata_proto::LoadTask {
    strata_proto::LoadTask {
        task_id: t.task_id,
        job_id: t.job_id,
        path: t.path,
        version: t.version,
        file_size: t.file_size,
        block_size: t.block_size,
        index: t.index,
        bandwidth: t.bandwidth,
        parallelism: t.parallelism,
    }
}

fn load_task_result(r: &strata_proto::LoadTaskResult) -> TaskResult {
    TaskResult {
        task_id: r.task_id,
        job_id: r.job_id.clone(),
        ok: r.ok,
        already_cached: r.already_cached,
        error: r.error.clone(),
        temporary: r.temporary,
    }
}

pub(crate) fn schedule_info(r: &ScheduleRecord) -> strata_proto::ScheduleInfo {
    strata_proto::ScheduleInfo {
        id: r.id.clone(),
        cron: r.cron.clone(),
        tz: r.tz.clone(),
        path: r.path.clone(),
        options: Some(load_options(&r.settings)),
        next_fire_ms: r.next_fire_ms,
        last_job_id: r.last_job_id.clone(),
        fired: r.fired,
        skipped: r.skipped,
        created_ms: r.created_ms,
    }
}

#[derive(Clone)]
struct Rpc(Arc<State>);

/// Longest a worker's poll for load tasks is held open.
const MAX_TASK_WAIT: Duration = Duration::from_secs(5);

#[tonic::async_trait]
impl MasterRpc for Rpc {
    async fn get_membership(&self, _: Request<Empty>) -> RpcResult<strata_proto::Membership> {
        metrics::counter!(m::RPC_REQUESTS, "rpc" => "get_membership").increment(1);
        let mem = lock(&self.0.membership);
        Ok(Response::new(strata_proto::Membership {
            epoch: mem.epoch(),
            workers: mem
                .live_members()
                .into_iter()
                .map(|w| strata_proto::Member { id: w.id, data_addr: w.data_addr })
                .collect(),
        }))
    }

    async fn list_mounts(&self, _: Request<Empty>) -> RpcResult<MountList> {
        metrics::counter!(m::RPC_REQUESTS, "rpc" => "list_mounts").increment(1);
        Ok(Response::new(self.0.mount_list(false)))
    }

    async fn add_mount(&self, req: Request<AddMountRequest>) -> RpcResult<MountInfo> {
        const RPC: &str = "add_mount";
        metrics::counter!(m::RPC_REQUESTS, "rpc" => RPC).increment(1);
        let req = req.into_inner();
        let record = MountRecord { path: req.path, uri: req.uri, options: req.options.into_iter().collect() };
        let mount = Mount::open(record, self.0.factory.as_ref()).map_err(|e| mount_err(RPC, e))?;
        self.0
            .mounts
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .check_new(&mount)
            .map_err(|e| mount_err(RPC, e))?;
        // Reach the UFS once now, so a wrong root fails here and not at the first read.
        let root = mount.ufs.stat("").await;
        if let Err(e) = root {
            let e =
                MountError::Ufs { path: mount.record.path.clone(), uri: mount.record.uri.clone(), source: e };
            return Err(mount_err(RPC, e));
        }
        let info = State::mount_info(&mount, false);
        {
            let mut table = self.0.mounts.write().unwrap_or_else(|p| p.into_inner());
            // Checked again under the write lock: another add may have raced us.
            table.check_new(&mount).map_err(|e| mount_err(RPC, e))?;
            self.0
                .store
                .put_mount(&mount.record)
                .map_err(|e| err(RPC, ErrorKind::Internal, e.to_string()))?;
            info!(mount = %mount.record.path, uri = %mount.record.uri, "mount added");
            table.insert(mount);
            metrics::gauge!(m::MOUNTS).set(table.len() as f64);
        }
        *lock(&self.0.mounts_epoch) += 1;
        Ok(Response::new(info))
    }

    async fn remove_mount(&self, req: Request<RemoveMountRequest>) -> RpcResult<Empty> {
        const RPC: &str = "remove_mount";
        metrics::counter!(m::RPC_REQUESTS, "rpc" => RPC).increment(1);
        let p = path::normalize(&req.into_inner().path)
            .map_err(|e| err(RPC, ErrorKind::InvalidArgument, e.to_string()))?;
        {
            let mut table = self.0.mounts.write().unwrap_or_else(|p| p.into_inner());
            if table.resolve(&p).is_none_or(|(m, rel)| !rel.is_empty() || m.record.path != p) {
                return Err(mount_err(RPC, MountError::NotMounted(p)));
            }
            self.0.store.delete_mount(&p).map_err(|e| err(RPC, ErrorKind::Internal, e.to_string()))?;
            table.remove(&p);
            metrics::gauge!(m::MOUNTS).set(table.len() as f64);
            info!(mount = %p, "mount removed");
        }
        self.0.stats.invalidate_all();
        self.0.lists.invalidate_all();
        *lock(&self.0.mounts_epoch) += 1;
        Ok(Response::new(Empty {}))
    }

    async fn stat(&self, req: Request<StatRequest>) -> RpcResult<FileStatus> {
        metrics::counter!(m::RPC_REQUESTS, "rpc" => "stat").increment(1);
        let req = req.into_inner();
        let (p, mount, rel, meta) = self.0.stat_path("stat", &req.path, req.sync).await?;
        Ok(Response::new(State::file_status(&p, &mount, &rel, &meta)))
    }

    async fn list(&self, req: Request<ListRequest>) -> RpcResult<ListResponse> {
        const RPC: &str = "list";
        metrics::counter!(m::RPC_REQUESTS, "rpc" => RPC).increment(1);
        let req = req.into_inner();
        let (p, mount, rel, meta) = self.0.stat_path(RPC, &req.path, req.sync).await?;
        if !meta.is_dir {
            // Listing a file lists that file, as `ls` does.
            return Ok(Response::new(ListResponse {
                entries: vec![State::file_status(&p, &mount, &rel, &meta)],
            }));
        }
        let cached = if req.sync { None } else { self.0.lists.get(&p).await };
        let entries = match cached {
            Some(hit) if hit.at.elapsed() < mount.metadata_ttl => hit,
            _ => {
                let entries = mount.ufs.list(&rel).await.map_err(|e| ufs_err(RPC, &p, e))?;
                let fresh = Arc::new(CachedList { at: Instant::now(), entries });
                if !mount.metadata_ttl.is_zero() {
                    self.0.lists.insert(p.clone(), fresh.clone()).await;
                }
                fresh
            }
        };
        let out = entries
            .entries
            .iter()
            .map(|e| {
                let child_rel = if rel.is_empty() { e.name.clone() } else { format!("{rel}/{}", e.name) };
                State::file_status(&path::join(&p, &e.name), &mount, &child_rel, &e.meta)
            })
            .collect();
        Ok(Response::new(ListResponse { entries: out }))
    }

    async fn delete(&self, req: Request<DeleteRequest>) -> RpcResult<Empty> {
        const RPC: &str = "delete";
        metrics::counter!(m::RPC_REQUESTS, "rpc" => RPC).increment(1);
        let req = req.into_inner();
        let (p, mount, rel) = self.0.writable(RPC, &req.path)?;
        if rel.is_empty() {
            let msg = format!("{p} is a mount point (`strata mount rm {p}` unmounts it)");
            return Err(err(RPC, ErrorKind::InvalidArgument, msg));
        }
        let meta = mount.ufs.stat(&rel).await.map_err(|e| ufs_err(RPC, &p, e))?;
        let ufs = mount.ufs.as_write().ok_or_else(|| err(RPC, ErrorKind::PermissionDenied, p.clone()))?;
        let result = ufs.delete(&rel, meta.is_dir, req.recursive).await;
        self.0.forget(&p, meta.is_dir).await;
        result.map_err(|e| ufs_err(RPC, &p, e))?;
        info!(path = %p, dir = meta.is_dir, "deleted");
        Ok(Response::new(Empty {}))
    }

    async fn mkdir(&self, req: Request<MkdirRequest>) -> RpcResult<Empty> {
        const RPC: &str = "mkdir";
        metrics::counter!(m::RPC_REQUESTS, "rpc" => RPC).increment(1);
        let (p, mount, rel) = self.0.writable(RPC, &req.into_inner().path)?;
        if rel.is_empty() {
            return Ok(Response::new(Empty {}));
        }
        match mount.ufs.stat(&rel).await {
            Ok(meta) if !meta.is_dir => {
                return Err(err(RPC, ErrorKind::AlreadyExists, format!("{p} exists and is a file")));
            }
            Ok(_) => return Ok(Response::new(Empty {})),
            Err(_) => {}
        }
        let ufs = mount.ufs.as_write().ok_or_else(|| err(RPC, ErrorKind::PermissionDenied, p.clone()))?;
        let result = ufs.create_dir(&rel).await;
        self.0.forget(&p, false).await;
        result.map_err(|e| ufs_err(RPC, &p, e))?;
        Ok(Response::new(Empty {}))
    }

    async fn invalidate(&self, req: Request<InvalidateRequest>) -> RpcResult<Empty> {
        const RPC: &str = "invalidate";
        metrics::counter!(m::RPC_REQUESTS, "rpc" => RPC).increment(1);
        let (p, _, _) = self.0.resolve(RPC, &req.into_inner().path)?;
        self.0.forget(&p, false).await;
        Ok(Response::new(Empty {}))
    }

    async fn get_block_locations(&self, req: Request<BlockLocationsRequest>) -> RpcResult<BlockLocations> {
        const RPC: &str = "get_block_locations";
        metrics::counter!(m::RPC_REQUESTS, "rpc" => RPC).increment(1);
        let (p, mount, rel, meta) = self.0.stat_path(RPC, &req.into_inner().path, false).await?;
        if meta.is_dir {
            return Err(err(RPC, ErrorKind::IsDirectory, format!("{p} is a directory")));
        }
        let file_id = block::file_identity(&mount.record.uri, &rel, mount.block_size);
        let addrs: HashMap<String, String> =
            lock(&self.0.membership).workers().map(|w| (w.id.clone(), w.data_addr.clone())).collect();
        let locations = lock(&self.0.blocks).locations(&file_id, &meta.version);
        let blocks = locations
            .into_iter()
            .map(|(index, holders)| BlockLocation {
                index,
                replicas: holders
                    .into_iter()
                    .map(|(worker_id, tier)| Replica {
                        data_addr: addrs.get(&worker_id).cloned().unwrap_or_default(),
                        worker_id,
                        tier: proto_tier(tier) as i32,
                    })
                    .collect(),
            })
            .collect();
        Ok(Response::new(BlockLocations { path: p, version: meta.version, blocks }))
    }

    async fn status(&self, _: Request<Empty>) -> RpcResult<ClusterStatus> {
        metrics::counter!(m::RPC_REQUESTS, "rpc" => "status").increment(1);
        let mem = lock(&self.0.membership);
        let blocks = lock(&self.0.blocks);
        let now = Instant::now();
        let mut totals = Counters::default();
        let workers: Vec<WorkerStatus> = mem
            .workers()
            .map(|w| {
                totals.add(&w.counters);
                WorkerStatus {
                    id: w.id.clone(),
                    data_addr: w.data_addr.clone(),
                    http_addr: w.http_addr.clone(),
                    live: w.live,
                    last_heartbeat_ms_ago: now.saturating_duration_since(w.last_heartbeat).as_millis() as u64,
                    tiers: w.tiers.iter().map(proto_tier_usage).collect(),
                    counters: Some(proto_counters(&w.counters)),
                    blocks: blocks.worker_blocks(&w.id),
                }
            })
            .collect();
        Ok(Response::new(ClusterStatus {
            membership_epoch: mem.epoch(),
            workers,
            totals: Some(proto_counters(&totals)),
            blocks: blocks.total_blocks(),
            mounts: self.0.mounts.read().unwrap_or_else(|p| p.into_inner()).len() as u64,
        }))
    }

    async fn register_worker(
        &self,
        req: Request<RegisterWorkerRequest>,
    ) -> RpcResult<RegisterWorkerResponse> {
        const RPC: &str = "register_worker";
        metrics::counter!(m::RPC_REQUESTS, "rpc" => RPC).increment(1);
        let req = req.into_inner();
        if req.worker_id.is_empty() || req.data_addr.parse::<SocketAddr>().is_err() {
            return Err(err(
                RPC,
                ErrorKind::InvalidArgument,
                "worker id and a data address host:port are required",
            ));
        }
        let epoch =
            lock(&self.0.membership).register(&req.worker_id, &req.data_addr, &req.http_addr, Instant::now());
        // It will send a full report next: forget what it held before.
        lock(&self.0.blocks).drop_worker(&req.worker_id);
        info!(worker = %req.worker_id, data_addr = %req.data_addr, epoch, "worker registered");
        Ok(Response::new(RegisterWorkerResponse {
            membership_epoch: epoch,
            heartbeat_interval_ms: self.0.config.heartbeat_interval_ms,
            mounts_epoch: *lock(&self.0.mounts_epoch),
        }))
    }

    async fn heartbeat(&self, req: Request<HeartbeatRequest>) -> RpcResult<HeartbeatResponse> {
        metrics::counter!(m::RPC_REQUESTS, "rpc" => "heartbeat").increment(1);
        let req = req.into_inner();
        let mounts_epoch = *lock(&self.0.mounts_epoch);
        let mut mem = lock(&self.0.membership);
        if !mem.heartbeat(&req.worker_id, Instant::now()) {
            return Ok(Response::new(HeartbeatResponse {
                reregister: true,
                membership_epoch: mem.epoch(),
                mounts_epoch,
            }));
        }
        let tiers = req.tiers.iter().map(tier_usage).collect();
        mem.update_stats(&req.worker_id, tiers, req.counters.as_ref().map(counters).unwrap_or_default());
        let epoch = mem.epoch();
        drop(mem);
        let mut blocks = lock(&self.0.blocks);
        if req.full_report {
            blocks.drop_worker(&req.worker_id);
        }
        for r in &req.added {
            blocks.add(&req.worker_id, &block_report(r));
        }
        for r in &req.removed {
            blocks.remove(&req.worker_id, &block_report(r));
        }
        metrics::gauge!(m::BLOCKS).set(blocks.total_blocks() as f64);
        Ok(Response::new(HeartbeatResponse { reregister: false, membership_epoch: epoch, mounts_epoch }))
    }

    async fn worker_mounts(&self, _: Request<WorkerMountsRequest>) -> RpcResult<MountList> {
        metrics::counter!(m::RPC_REQUESTS, "rpc" => "worker_mounts").increment(1);
        Ok(Response::new(self.0.mount_list(true)))
    }

    async fn submit_load(&self, req: Request<SubmitLoadRequest>) -> RpcResult<JobInfo> {
        const RPC: &str = "submit_load";
        metrics::counter!(m::RPC_REQUESTS, "rpc" => RPC).increment(1);
        let req = req.into_inner();
        let settings = load_settings(req.options.unwrap_or_default());
        Ok(Response::new(job_info(self.0.submit(RPC, &req.path, settings, "").await?)))
    }

    async fn get_job(&self, req: Request<JobId>) -> RpcResult<JobInfo> {
        const RPC: &str = "get_job";
        metrics::counter!(m::RPC_REQUESTS, "rpc" => RPC).increment(1);
        let id = req.into_inner().id;
        let info = lock(&self.0.jobs).info(&id);
        info.map(|i| Response::new(job_info(i)))
            .ok_or_else(|| err(RPC, ErrorKind::NotFound, format!("no job {id}")))
    }

    async fn list_jobs(&self, req: Request<ListJobsRequest>) -> RpcResult<JobList> {
        metrics::counter!(m::RPC_REQUESTS, "rpc" => "list_jobs").increment(1);
        let req = req.into_inner();
        let limit = if req.limit == 0 { usize::MAX } else { req.limit as usize };
        let jobs = lock(&self.0.jobs);
        let out = jobs
            .ids()
            .into_iter()
            .filter(|id| req.finished || jobs.is_running(id))
            .filter_map(|id| jobs.info(&id).map(job_info))
            .take(limit)
            .collect();
        Ok(Response::new(JobList { jobs: out }))
    }

    async fn cancel_job(&self, req: Request<JobId>) -> RpcResult<JobInfo> {
        const RPC: &str = "cancel_job";
        metrics::counter!(m::RPC_REQUESTS, "rpc" => RPC).increment(1);
        let id = req.into_inner().id;
        let result = lock(&self.0.jobs).cancel(&id, now_ms());
        result.map_err(|_| err(RPC, ErrorKind::NotFound, format!("no job {id}")))?;
        let record = lock(&self.0.jobs).take_dirty(&id);
        if let Some(record) = record {
            self.0.store.put_job(&record).map_err(|e| err(RPC, ErrorKind::Internal, e.to_string()))?;
            info!(job = %id, "load job cancelled");
        }
        self.0.progress.notify_waiters();
        let info = lock(&self.0.jobs).info(&id);
        info.map(|i| Response::new(job_info(i)))
            .ok_or_else(|| err(RPC, ErrorKind::NotFound, format!("no job {id}")))
    }

    async fn add_schedule(&self, req: Request<ScheduleRequest>) -> RpcResult<ScheduleInfo> {
        const RPC: &str = "add_schedule";
        metrics::counter!(m::RPC_REQUESTS, "rpc" => RPC).increment(1);
        let req = req.into_inner();
        let settings = load_settings(req.options.unwrap_or_default());
        let record = self.0.add_schedule(RPC, &req.cron, &req.tz, &req.path, settings).await?;
        Ok(Response::new(schedule_info(&record)))
    }

    async fn list_schedules(&self, _: Request<Empty>) -> RpcResult<ScheduleList> {
        metrics::counter!(m::RPC_REQUESTS, "rpc" => "list_schedules").increment(1);
        let schedules = lock(&self.0.schedules).records().map(schedule_info).collect();
        Ok(Response::new(ScheduleList { schedules }))
    }

    async fn remove_schedule(&self, req: Request<ScheduleId>) -> RpcResult<Empty> {
        const RPC: &str = "remove_schedule";
        metrics::counter!(m::RPC_REQUESTS, "rpc" => RPC).increment(1);
        let id = req.into_inner().id;
        let mut schedules = lock(&self.0.schedules);
        if schedules.get(&id).is_none() {
            return Err(err(RPC, ErrorKind::NotFound, format!("no schedule {id}")));
        }
        self.0.store.delete_schedule(&id).map_err(|e| err(RPC, ErrorKind::Internal, e.to_string()))?;
        schedules.remove(&id);
        info!(schedule = %id, "schedule removed");
        Ok(Response::new(Empty {}))
    }

    async fn fetch_load_tasks(&self, req: Request<FetchLoadTasksRequest>) -> RpcResult<LoadTasks> {
        let req = req.into_inner();
        let deadline = Instant::now() + Duration::from_millis(req.wait_ms).min(MAX_TASK_WAIT);
        self.0.sync_ring();
        loop {
            let notified = self.0.task_ready.notified();
            let tasks = lock(&self.0.jobs).fetch(&req.worker_id, req.max.max(1) as usize, Instant::now());
            let now = Instant::now();
            if !tasks.is_empty() || now >= deadline {
                metrics::counter!(m::LOAD_TASKS_ASSIGNED).increment(tasks.len() as u64);
                return Ok(Response::new(LoadTasks { tasks: tasks.into_iter().map(load_task).collect() }));
            }
            // Tasks backing off become ready without a wake-up: look again soon.
            let _ = tokio::time::timeout((deadline - now).min(Duration::from_millis(100)), notified).await;
        }
    }

    async fn report_load_tasks(
        &self,
        req: Request<ReportLoadTasksRequest>,
    ) -> RpcResult<ReportLoadTasksResponse> {
        let req = req.into_inner();
        let (touched, running_jobs) = {
            let mut jobs = lock(&self.0.jobs);
            let results: Vec<TaskResult> = req.results.iter().map(load_task_result).collect();
            let touched = jobs.report(&req.worker_id, &results, Instant::now());
            (touched, jobs.running_ids())
        };
        if !touched.is_empty() {
            self.0.progress.notify_waiters();
        }
        Ok(Response::new(ReportLoadTasksResponse { running_jobs }))
    }
}

/// A running master. Dropping it does not stop it: call [`MasterHandle::shutdown`].
pub struct MasterHandle {
    pub rpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    state: Arc<State>,
    cancel: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl MasterHandle {
    /// Stops serving, closes connections and releases the store.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        self.state.jobs_cancel.cancel();
        let runners = std::mem::take(&mut *lock(&self.state.runners));
        for runner in runners {
            runner.abort();
            let _ = runner.await;
        }
        for task in self.tasks {
            task.abort();
            let _ = task.await;
        }
        self.state.store.close();
    }
}

pub struct Master;

impl Master {
    /// Opens the store, loads the mounts, binds both ports and starts serving.
    pub async fn start(
        config: MasterConfig,
        factory: Arc<dyn UfsFactory>,
    ) -> Result<MasterHandle, MasterError> {
        let store: Arc<dyn MetaStore> = Arc::new(RedbStore::open(&config.data_dir.join("master.redb"))?);
        let mut table = MountTable::default();
        for record in store.load_mounts()? {
            // A mount that no longer opens (option rules changed) is kept in the store and
            // reported, not dropped: losing a user's mount silently is worse.
            match Mount::open(record.clone(), factory.as_ref()) {
                Ok(mount) => {
                    table.insert(mount);
                }
                Err(e) => {
                    warn!(mount = %record.path, err = %e, "stored mount cannot be opened; skipped")
                }
            }
        }
        let mut jobs = Jobs::new((now_epoch_base() & 0xFFFF_FFFF_FFFF) << 16);
        let mut resume = Vec::new();
        for mut record in store.load_jobs()? {
            if !record.phase.is_final() {
                record.resumed += 1;
                store.put_job(&record)?;
                resume.push(record.id.clone());
            }
            jobs.insert(record);
        }
        let mut schedules = Schedules::default();
        for record in store.load_schedules()? {
            let id = record.id.clone();
            if let Err(e) = schedules.insert(record, now_ms()) {
                warn!(schedule = %id, err = %e, "stored schedule cannot be parsed; skipped");
            }
        }
        info!(mounts = table.len(), resuming_jobs = resume.len(), "master state loaded");
        metrics::gauge!(m::MOUNTS).set(table.len() as f64);
        let state = Arc::new(State {
            membership: Mutex::new(Membership::new(
                Duration::from_millis(config.worker_timeout_ms),
                now_epoch_base(),
            )),
            mounts: RwLock::new(table),
            mounts_epoch: Mutex::new(now_epoch_base()),
            blocks: Mutex::new(BlockMap::default()),
            store,
            factory,
            stats: Cache::builder().max_capacity(config.metadata_cache_entries).build(),
            lists: Cache::builder().max_capacity(config.metadata_cache_entries / 10 + 1).build(),
            jobs: Mutex::new(jobs),
            schedules: Mutex::new(schedules),
            task_ready: Notify::new(),
            progress: Notify::new(),
            jobs_cancel: CancellationToken::new(),
            runners: Mutex::new(Vec::new()),
            config,
        });
        state.prune_history();
        let cancel = CancellationToken::new();

        let listener = TcpListener::bind(state.config.rpc_addr)
            .await
            .map_err(|source| MasterError::Bind { addr: state.config.rpc_addr, source })?;
        let rpc_addr = listener
            .local_addr()
            .map_err(|source| MasterError::Bind { addr: state.config.rpc_addr, source })?;
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let svc = MasterServer::new(Rpc(state.clone()));
        let shutdown = cancel.clone();
        let server = tokio::spawn(async move {
            let result = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(incoming, shutdown.cancelled_owned())
                .await;
            if let Err(e) = result {
                warn!(err = %e, "master rpc server stopped");
            }
        });

        let health_state = Arc::downgrade(&state);
        let (http_addr, http_task) = strata_proto::ops_http::serve(
            state.config.http_addr,
            Arc::new(move || if health_state.upgrade().is_some() { Ok(()) } else { Err("stopped".into()) }),
        )
        .await
        .map_err(|source| MasterError::Bind { addr: state.config.http_addr, source })?;

        let tick_state = state.clone();
        let tick_every = Duration::from_millis((state.config.worker_timeout_ms / 4).clamp(10, 1000));
        let ticker = tokio::spawn(async move {
            let mut interval = tokio::time::interval(tick_every);
            loop {
                interval.tick().await;
                tick_state.tick();
            }
        });
        // Resumed jobs wait for the workers to register again, so their tasks go to the owners
        // on the whole ring and not to whichever worker came back first.
        let settle =
            Duration::from_millis(state.config.heartbeat_interval_ms * 3).max(Duration::from_secs(1));
        for id in resume {
            info!(job = %id, "resuming load job");
            state.spawn_runner(id, settle);
        }
        let jobs_state = state.clone();
        let jobs_ticker = tokio::spawn(async move {
            let mut interval = tokio::time::interval(Duration::from_millis(100));
            loop {
                interval.tick().await;
                jobs_state.jobs_tick().await;
            }
        });
        info!(%rpc_addr, %http_addr, "master started");
        Ok(MasterHandle {
            rpc_addr,
            http_addr,
            state,
            cancel,
            tasks: vec![server, http_task, ticker, jobs_ticker],
        })
    }
}
