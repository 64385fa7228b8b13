//! The gRPC adapter: each handler counts the request, translates protobuf into the master's own
//! types, calls the metadata, the cluster or the job runner, and translates back. Errors leave
//! through [`status`], the one place an [`OpError`] becomes a `tonic::Status` (keeping its
//! kind). No decision is made here; protobuf types go no deeper than this file.

use std::sync::Arc;
use std::time::Duration;

use strata_proto as pb;
use strata_proto::master_server::Master as MasterRpc;
use strata_security::token::{Access, Identity, TokenRecord};
use strata_ufs::{ObjectMeta, redact_options};
use tonic::{Request, Response, Status};

use crate::auth::{Tokens, check_path};
use crate::cluster::{Cluster, FileBlocks, Heartbeat};
use crate::error::OpError;
use crate::jobs::{FileOutcome, JobInfo, LoadSettings, LoadTask, LoadTaskResult, Phase};
use crate::lineage::ReadReport;
use crate::metadata::Metadata;
use crate::metrics_defs as m;
use crate::mounts::{Mount, MountRecord};
use crate::pins::{PinRecord, PinTier, Pins};
use crate::reports::{BlockReport, Tier, TierUsage, WorkerCounters};
use crate::runner::JobRunner;
use crate::schedule::ScheduleRecord;
use crate::writeback::{Commit, HeldJournal, PersistState};

type RpcResult<T> = Result<Response<T>, Status>;

/// Counts a failed request and maps its error to a status with the same kind.
fn status(rpc: &'static str) -> impl Fn(OpError) -> Status {
    move |e| {
        let kind = e.kind();
        metrics::counter!(m::RPC_ERRORS, "rpc" => rpc, "kind" => kind.as_str()).increment(1);
        strata_proto::status(kind, e.to_string())
    }
}

/// Entries per page when the request does not say.
pub const DEFAULT_PAGE: usize = 1_000;
/// Most entries a page holds, whatever the request asks (bounded messages).
pub const MAX_PAGE: usize = 10_000;
/// Most paths one `StatMany` asks (a larger call is refused: the client sends chunks).
pub const MAX_STAT_MANY: usize = 10_000;
/// Most blocks one `GetBlockLocations` answer holds.
const MAX_BLOCKS_PER_ANSWER: usize = 10_000;

fn page_size(asked: u32) -> usize {
    if asked == 0 { DEFAULT_PAGE } else { (asked as usize).min(MAX_PAGE) }
}

fn count(rpc: &'static str) {
    metrics::counter!(m::RPC_REQUESTS, "rpc" => rpc).increment(1);
}

#[derive(Clone)]
pub struct Rpc {
    pub metadata: Arc<Metadata>,
    pub cluster: Arc<Cluster>,
    pub jobs: Arc<JobRunner>,
    /// Told to each worker when it registers.
    pub heartbeat_interval_ms: u64,
    /// This master's advertised rpc address, reported as the leader by `Status`.
    pub leader: String,
    pub tokens: Arc<Tokens>,
    pub pins: Arc<Pins>,
    pub lineage: Arc<crate::lineage::Lineage>,
}

#[tonic::async_trait]
impl MasterRpc for Rpc {
    async fn get_membership(&self, _: Request<pb::Empty>) -> RpcResult<pb::Membership> {
        count("get_membership");
        let (epoch, members) = self.cluster.live();
        let suspects = self.cluster.suspects(self.suspect_after());
        let workers = members
            .into_iter()
            .map(|w| pb::Member {
                suspect: suspects.contains(&w.id),
                id: w.id,
                data_addr: w.data_addr,
                node: w.node,
                local_socket: w.local_socket,
            })
            .collect();
        Ok(Response::new(pb::Membership { epoch, workers }))
    }

    async fn list_mounts(&self, _: Request<pb::Empty>) -> RpcResult<pb::MountList> {
        count("list_mounts");
        Ok(Response::new(self.mount_list(false)))
    }

    async fn add_mount(&self, req: Request<pb::AddMountRequest>) -> RpcResult<pb::MountInfo> {
        const RPC: &str = "add_mount";
        count(RPC);
        let req = req.into_inner();
        let record = MountRecord { path: req.path, uri: req.uri, options: req.options.into_iter().collect() };
        let (mount, warnings) = self.metadata.add_mount(record).await.map_err(status(RPC))?;
        Ok(Response::new(pb::MountInfo { warnings, ..mount_info(&mount, false) }))
    }

    async fn remove_mount(&self, req: Request<pb::RemoveMountRequest>) -> RpcResult<pb::Empty> {
        const RPC: &str = "remove_mount";
        count(RPC);
        self.metadata.remove_mount(&req.into_inner().path).map_err(status(RPC))?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn stat(&self, req: Request<pb::StatRequest>) -> RpcResult<pb::FileStatus> {
        const RPC: &str = "stat";
        count(RPC);
        check_path(&req, Access::Read, &req.get_ref().path)?;
        let req = req.into_inner();
        let (r, meta) = self.metadata.stat(&req.path, req.sync).await.map_err(status(RPC))?;
        Ok(Response::new(self.with_pending(file_status(&r.path, &r.mount, &r.rel, &meta))))
    }

    async fn stat_many(&self, req: Request<pb::StatManyRequest>) -> RpcResult<pb::StatManyResponse> {
        const RPC: &str = "stat_many";
        count(RPC);
        let asked = req.get_ref().paths.len();
        if asked > MAX_STAT_MANY {
            let kind = strata_common::ErrorKind::ResourceExhausted;
            metrics::counter!(m::RPC_ERRORS, "rpc" => RPC, "kind" => kind.as_str()).increment(1);
            let message = format!("StatMany of {asked} paths: at most {MAX_STAT_MANY} per call");
            return Err(strata_proto::status(kind, message));
        }
        // Each path is checked as `Stat` checks its one: a path outside the token's scope is
        // that path's error, not the call's.
        let allowed: Vec<Result<(), Status>> =
            req.get_ref().paths.iter().map(|p| check_path(&req, Access::Read, p)).collect();
        let paths = req.into_inner().paths;
        let wanted: Vec<String> =
            paths.iter().zip(&allowed).filter(|(_, ok)| ok.is_ok()).map(|(p, _)| p.clone()).collect();
        let mut stated = self.metadata.stat_many(&wanted).await.into_iter();
        let failed = |kind: strata_common::ErrorKind, message: String| {
            metrics::counter!(m::RPC_ERRORS, "rpc" => RPC, "kind" => kind.as_str()).increment(1);
            pb::stat_many_result::Result::Error(pb::StatError { kind: kind.as_str().to_string(), message })
        };
        let results = allowed
            .into_iter()
            .map(|allowed| {
                let result = match allowed {
                    Err(refused) => failed(strata_proto::kind_of(&refused), refused.message().to_string()),
                    Ok(()) => match stated.next().expect("one answer per path asked") {
                        Ok((r, meta)) => pb::stat_many_result::Result::Status(
                            self.with_pending(file_status(&r.path, &r.mount, &r.rel, &meta)),
                        ),
                        Err(e) => failed(e.kind(), e.to_string()),
                    },
                };
                pb::StatManyResult { result: Some(result) }
            })
            .collect();
        Ok(Response::new(pb::StatManyResponse { results }))
    }

    async fn list(&self, req: Request<pb::ListRequest>) -> RpcResult<pb::ListResponse> {
        const RPC: &str = "list";
        count(RPC);
        check_path(&req, Access::Read, &req.get_ref().path)?;
        let req = req.into_inner();
        let (mount, entries, next) = self
            .metadata
            .list_page(&req.path, req.sync, &req.page_token, page_size(req.page_size))
            .await
            .map_err(status(RPC))?;
        let entries = entries
            .iter()
            .map(|e| self.with_pending(file_status(&e.path, &mount, &e.rel, &e.meta)))
            .collect();
        Ok(Response::new(pb::ListResponse { entries, next_page_token: next.unwrap_or_default() }))
    }

    async fn find(&self, req: Request<pb::FindRequest>) -> RpcResult<pb::FindResponse> {
        const RPC: &str = "find";
        count(RPC);
        check_path(&req, Access::Read, &req.get_ref().path)?;
        let req = req.into_inner();
        let (mount, entries, next) = self
            .metadata
            .find_page_with(
                &req.path,
                req.sync,
                &req.page_token,
                page_size(req.page_size),
                req.max_depth as usize,
                req.with_dirs,
            )
            .await
            .map_err(status(RPC))?;
        let entries = entries
            .iter()
            .map(|e| self.with_pending(file_status(&e.path, &mount, &e.rel, &e.meta)))
            .collect();
        Ok(Response::new(pb::FindResponse { entries, next_page_token: next.unwrap_or_default() }))
    }

    async fn delete(&self, req: Request<pb::DeleteRequest>) -> RpcResult<pb::Empty> {
        const RPC: &str = "delete";
        count(RPC);
        check_path(&req, Access::Write, &req.get_ref().path)?;
        let req = req.into_inner();
        self.metadata.delete(&req.path, req.recursive).await.map_err(status(RPC))?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn mkdir(&self, req: Request<pb::MkdirRequest>) -> RpcResult<pb::Empty> {
        const RPC: &str = "mkdir";
        count(RPC);
        check_path(&req, Access::Write, &req.get_ref().path)?;
        self.metadata.mkdir(&req.into_inner().path).await.map_err(status(RPC))?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn rename(&self, req: Request<pb::RenameRequest>) -> RpcResult<pb::RenameResponse> {
        const RPC: &str = "rename";
        count(RPC);
        check_path(&req, Access::Write, &req.get_ref().src)?;
        check_path(&req, Access::Write, &req.get_ref().dst)?;
        let req = req.into_inner();
        let renamed = self.metadata.rename(&req.src, &req.dst).await.map_err(status(RPC))?;
        Ok(Response::new(pb::RenameResponse { renamed }))
    }

    async fn invalidate(&self, req: Request<pb::InvalidateRequest>) -> RpcResult<pb::Empty> {
        const RPC: &str = "invalidate";
        count(RPC);
        check_path(&req, Access::Write, &req.get_ref().path)?;
        self.metadata.invalidate(&req.into_inner().path).await.map_err(status(RPC))?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn get_block_locations(
        &self,
        req: Request<pb::BlockLocationsRequest>,
    ) -> RpcResult<pb::BlockLocations> {
        const RPC: &str = "get_block_locations";
        count(RPC);
        check_path(&req, Access::Read, &req.get_ref().path)?;
        let req = req.into_inner();
        let (r, meta) = self.metadata.stat(&req.path, false).await.map_err(status(RPC))?;
        if meta.is_dir {
            return Err(status(RPC)(OpError::IsDirectory(r.path)));
        }
        let limit = page_size(req.limit).min(MAX_BLOCKS_PER_ANSWER);
        let mut located: Vec<_> = self
            .cluster
            .block_locations(&r.file_id(), &meta.version)
            .into_iter()
            .filter(|(index, _)| *index >= req.from_index)
            .take(limit + 1)
            .collect();
        let next_index = if located.len() > limit { located.pop().map_or(0, |(i, _)| i) } else { 0 };
        let blocks = located
            .into_iter()
            .map(|(index, holders)| pb::BlockLocation {
                index,
                replicas: holders
                    .into_iter()
                    .map(|(worker_id, data_addr, tier)| pb::Replica {
                        worker_id,
                        data_addr,
                        tier: proto_tier(tier) as i32,
                    })
                    .collect(),
            })
            .collect();
        Ok(Response::new(pb::BlockLocations { path: r.path, version: meta.version, blocks, next_index }))
    }

    async fn locate(&self, req: Request<pb::LocateRequest>) -> RpcResult<pb::LocateResponse> {
        const RPC: &str = "locate";
        count(RPC);
        check_path(&req, Access::Read, &req.get_ref().path)?;
        let r = self.metadata.resolve(&req.into_inner().path).map_err(status(RPC))?;
        let located = self.cluster.locate(&self.files_under(&r.path).await.map_err(status(RPC))?);
        let workers = located
            .workers
            .into_iter()
            .map(|w| pb::WorkerLocality {
                worker_id: w.id,
                data_addr: w.data_addr,
                node: w.node,
                blocks: w.blocks,
                bytes: w.bytes,
                live: w.live,
            })
            .collect();
        Ok(Response::new(pb::LocateResponse {
            path: r.path,
            files: located.files,
            blocks: located.blocks,
            bytes: located.bytes,
            cached_blocks: located.cached_blocks,
            cached_bytes: located.cached_bytes,
            workers,
        }))
    }

    async fn status(&self, _: Request<pb::Empty>) -> RpcResult<pb::ClusterStatus> {
        count("status");
        let status = self.cluster.status();
        let suspect_after = self.suspect_after();
        let (_, mounts) = self.metadata.mounts();
        let mount_quotas = mounts
            .iter()
            .filter(|m| m.quota.is_some() || m.cache_ttl.is_some())
            .map(|m| pb::MountQuota {
                path: m.record.path.clone(),
                quota_bytes: m.quota.unwrap_or(0),
                cached_bytes: status
                    .workers
                    .iter()
                    .filter(|w| w.record.live)
                    .flat_map(|w| &w.record.mount_bytes)
                    .filter(|(path, _)| *path == m.record.path)
                    .map(|(_, bytes)| bytes)
                    .sum(),
                cache_ttl_ms: m.cache_ttl.map_or(0, |d| d.as_millis() as u64),
            })
            .collect();
        let workers = status
            .workers
            .into_iter()
            .map(|w| pb::WorkerStatus {
                mount_usage: w
                    .record
                    .mount_bytes
                    .iter()
                    .map(|(path, bytes)| pb::MountUsage { path: path.clone(), bytes: *bytes })
                    .collect(),
                suspect: w.record.live && w.since_heartbeat > suspect_after,
                last_heartbeat_ms_ago: w.since_heartbeat.as_millis() as u64,
                tiers: w.record.tiers.iter().map(proto_tier_usage).collect(),
                counters: Some(proto_counters(&w.record.counters)),
                blocks: w.blocks,
                id: w.record.id,
                data_addr: w.record.data_addr,
                http_addr: w.record.http_addr,
                node: w.record.node,
                live: w.record.live,
                draining: w.record.draining,
            })
            .collect();
        Ok(Response::new(pb::ClusterStatus {
            membership_epoch: status.membership_epoch,
            workers,
            totals: Some(proto_counters(&status.totals)),
            blocks: status.blocks,
            mounts: self.metadata.mount_count() as u64,
            leader: self.leader.clone(),
            mount_quotas,
        }))
    }

    async fn register_worker(
        &self,
        req: Request<pb::RegisterWorkerRequest>,
    ) -> RpcResult<pb::RegisterWorkerResponse> {
        const RPC: &str = "register_worker";
        count(RPC);
        let req = req.into_inner();
        let entry = crate::membership::WorkerEntry {
            id: req.worker_id,
            data_addr: req.data_addr,
            http_addr: req.http_addr,
            node: req.node,
            local_socket: req.local_socket,
            state_paths: req.state_paths,
        };
        let epoch = self.cluster.register(entry).map_err(status(RPC))?;
        self.metadata.learn_state_paths(self.cluster.state_paths());
        Ok(Response::new(pb::RegisterWorkerResponse {
            membership_epoch: epoch,
            heartbeat_interval_ms: self.heartbeat_interval_ms,
            mounts_epoch: self.metadata.mounts_epoch(),
            tokens_epoch: self.tokens.epoch(),
        }))
    }

    async fn heartbeat(&self, req: Request<pb::HeartbeatRequest>) -> RpcResult<pb::HeartbeatResponse> {
        count("heartbeat");
        let req = req.into_inner();
        let mounts_epoch = self.metadata.mounts_epoch();
        let answer = self.cluster.heartbeat(Heartbeat {
            worker_id: req.worker_id.clone(),
            tiers: req.tiers.iter().map(tier_usage).collect(),
            counters: req.counters.as_ref().map(counters).unwrap_or_default(),
            added: req.added.iter().map(block_report).collect(),
            removed: req.removed.iter().map(block_report).collect(),
            full_report: req.full_report,
            mount_bytes: req.mount_usage.iter().map(|u| (u.path.clone(), u.bytes)).collect(),
            draining: req.draining,
        });
        let held: Vec<HeldJournal> = req
            .journals
            .into_iter()
            .map(|j| HeldJournal {
                write_id: j.write_id,
                path: j.path,
                uploading: j.uploading,
                age_ms: j.age_ms,
            })
            .collect();
        let orders = if answer.reregister {
            Default::default()
        } else {
            self.metadata.pending().heartbeat(&req.worker_id, &held, &self.live_ids())
        };
        let pins_epoch = self.pins.epoch();
        let pins_included = req.pins_epoch != pins_epoch;
        let pins = if pins_included { self.pins.list().iter().map(pin_rule).collect() } else { Vec::new() };
        let cache_ttls = if pins_included {
            self.pins
                .cache_ttls()
                .iter()
                .map(|r| pb::CacheTtlRule { ufs_prefix: r.ufs_prefix.clone(), cache_ttl_ms: r.cache_ttl_ms })
                .collect()
        } else {
            Vec::new()
        };
        if req.frees_applied != 0 {
            self.pins.applied(&req.worker_id, req.frees_applied);
        }
        self.pins.epoch_applied(&req.worker_id, req.pins_epoch);
        let (last_free, free) = self.pins.frees_after(req.frees_applied);
        Ok(Response::new(pb::HeartbeatResponse {
            reregister: answer.reregister,
            membership_epoch: answer.membership_epoch,
            mounts_epoch,
            tokens_epoch: self.tokens.epoch(),
            upload: orders.upload,
            drop: orders.drop,
            pins_epoch,
            pins,
            pins_included,
            cache_ttls,
            free,
            last_free,
        }))
    }

    async fn commit_write(&self, req: Request<pb::CommitWriteRequest>) -> RpcResult<pb::CommitWriteResponse> {
        const RPC: &str = "commit_write";
        count(RPC);
        let req = req.into_inner();
        let r = self.metadata.resolve(&req.path).map_err(status(RPC))?;
        if !r.mount.write_back || r.rel.is_empty() {
            let msg = format!("{} is not a file on a write-back mount", r.path);
            return Err(status(RPC)(OpError::BadCommit(msg)));
        }
        let upload = self
            .metadata
            .pending()
            .commit(Commit {
                worker_id: req.worker_id,
                path: r.path.clone(),
                write_id: req.write_id,
                size: req.size,
                mtime_ms: req.mtime_ms,
                holders: req.holders,
                persisted: req.persisted,
            })
            .map_err(status(RPC))?;
        // Stats and listings cached from the UFS are older than this file.
        self.metadata.invalidate(&r.path).await.map_err(status(RPC))?;
        Ok(Response::new(pb::CommitWriteResponse { upload }))
    }

    async fn upload_result(
        &self,
        req: Request<pb::UploadResultRequest>,
    ) -> RpcResult<pb::UploadResultResponse> {
        const RPC: &str = "upload_result";
        count(RPC);
        let req = req.into_inner();
        let ended = self
            .metadata
            .pending()
            .upload_result(
                &req.worker_id,
                &req.path,
                &req.write_id,
                &req.error,
                req.gave_up,
                &self.live_ids(),
            )
            .map_err(status(RPC))?;
        if let Some(path) = &ended.persisted {
            self.metadata.invalidate(path).await.map_err(status(RPC))?;
        }
        if let Some(path) = ended.delete_again {
            // Deleted while its upload ran: the upload brought it back.
            if let Err(e) = self.metadata.delete(&path, false).await {
                tracing::warn!(path, err = %e, "cannot delete a file whose upload ended after its delete");
            }
        }
        Ok(Response::new(pb::UploadResultResponse { upload: ended.upload }))
    }

    async fn sync(&self, req: Request<pb::SyncRequest>) -> RpcResult<pb::SyncResponse> {
        const RPC: &str = "sync";
        count(RPC);
        check_path(&req, Access::Read, &req.get_ref().path)?;
        let req = req.into_inner();
        let r = self.metadata.resolve(&req.path).map_err(status(RPC))?;
        let pending = self.metadata.pending();
        if req.retry_failed {
            pending.retry_failed(&r.path).map_err(status(RPC))?;
        }
        let pending = pending
            .under(&r.path)
            .into_iter()
            .map(|v| pb::PendingFile {
                state: persist_state(v.state) as i32,
                path: v.record.path,
                write_id: v.record.write_id,
                size: v.record.size,
                error: v.error,
                holders: v.record.holders,
                committed_unix_ms: v.record.committed_unix_ms,
                uploader: v.uploader,
            })
            .collect();
        Ok(Response::new(pb::SyncResponse { pending }))
    }

    async fn pin(&self, req: Request<pb::PinRequest>) -> RpcResult<pb::PinInfo> {
        const RPC: &str = "pin";
        count(RPC);
        let req = req.into_inner();
        let r = self.metadata.resolve(&req.path).map_err(status(RPC))?;
        let tier = match pb::PinTier::try_from(req.tier) {
            Ok(pb::PinTier::Memory) => PinTier::Memory,
            _ => PinTier::Nvme,
        };
        let bytes: u64 = self.files_under(&r.path).await.map_err(status(RPC))?.iter().map(|f| f.size).sum();
        let (capacity, workers) = self.cluster.tier_capacity(match tier {
            PinTier::Memory => Tier::Memory,
            PinTier::Nvme => Tier::Nvme,
        });
        let pinned = self.pins.pinned_bytes(tier, &r.path);
        if pinned.saturating_add(bytes) > capacity {
            return Err(status(RPC)(OpError::PinTooLarge {
                path: r.path,
                tier: tier.label(),
                bytes,
                pinned,
                capacity,
                workers,
            }));
        }
        let now = self.pins.now_ms();
        let record = PinRecord {
            ufs_prefix: crate::pins::ufs_prefix(&r.mount.record.uri, &r.rel),
            path: r.path,
            tier,
            bytes,
            created_unix_ms: now,
            expires_unix_ms: (req.ttl_ms > 0)
                .then(|| now.saturating_add(req.ttl_ms.min(i64::MAX as u64) as i64)),
        };
        let record = self.pins.add(record).map_err(status(RPC))?;
        tracing::info!(path = %record.path, tier = record.tier.label(), bytes = record.bytes, "pinned");
        let applied = self.pins_in_force(req.wait_ms).await;
        Ok(Response::new(pb::PinInfo { applied: Some(applied), ..pin_info(&record) }))
    }

    async fn unpin(&self, req: Request<pb::UnpinRequest>) -> RpcResult<pb::PinInfo> {
        const RPC: &str = "unpin";
        count(RPC);
        let req = req.into_inner();
        let path = strata_common::path::normalize(&req.path).map_err(|e| status(RPC)(OpError::BadPath(e)))?;
        let record = self.pins.remove(&path).map_err(status(RPC))?;
        tracing::info!(path = %record.path, "unpinned");
        let applied = self.pins_in_force(req.wait_ms).await;
        Ok(Response::new(pb::PinInfo { applied: Some(applied), ..pin_info(&record) }))
    }

    async fn set_cache_ttl(&self, req: Request<pb::SetCacheTtlRequest>) -> RpcResult<pb::CacheTtlInfo> {
        const RPC: &str = "set_cache_ttl";
        count(RPC);
        let req = req.into_inner();
        let record = if req.cache_ttl_ms == 0 {
            let path =
                strata_common::path::normalize(&req.path).map_err(|e| status(RPC)(OpError::BadPath(e)))?;
            let record = self.pins.clear_cache_ttl(&path).map_err(status(RPC))?;
            tracing::info!(path = %record.path, "cache TTL cleared");
            record
        } else {
            let r = self.metadata.resolve(&req.path).map_err(status(RPC))?;
            let record = crate::pins::CacheTtlRecord {
                ufs_prefix: crate::pins::ufs_prefix(&r.mount.record.uri, &r.rel),
                path: r.path,
                cache_ttl_ms: req.cache_ttl_ms,
                created_unix_ms: self.pins.now_ms(),
            };
            let record = self.pins.set_cache_ttl(record).map_err(status(RPC))?;
            tracing::info!(path = %record.path, cache_ttl_ms = record.cache_ttl_ms, "cache TTL set");
            record
        };
        let applied = self.pins_in_force(req.wait_ms).await;
        Ok(Response::new(pb::CacheTtlInfo { applied: Some(applied), ..cache_ttl_info(&record) }))
    }

    async fn list_cache_ttls(&self, _: Request<pb::Empty>) -> RpcResult<pb::CacheTtlList> {
        count("list_cache_ttls");
        Ok(Response::new(pb::CacheTtlList {
            ttls: self.pins.cache_ttls().iter().map(cache_ttl_info).collect(),
        }))
    }

    async fn list_pins(&self, _: Request<pb::Empty>) -> RpcResult<pb::PinList> {
        count("list_pins");
        Ok(Response::new(pb::PinList { pins: self.pins.list().iter().map(pin_info).collect() }))
    }

    async fn free(&self, req: Request<pb::FreeRequest>) -> RpcResult<pb::FreeResponse> {
        const RPC: &str = "free";
        count(RPC);
        let req = req.into_inner();
        let r = self.metadata.resolve(&req.path).map_err(status(RPC))?;
        if let Some(pin) = self.pins.overlapping(&r.path) {
            return Err(status(RPC)(OpError::Pinned { path: r.path, pin: pin.path }));
        }
        let live = self.live_ids();
        // What the block map lists now, to say what the free dropped.
        let (mut blocks, mut bytes) = (0u64, 0u64);
        for f in self.files_under(&r.path).await.map_err(status(RPC))? {
            for (index, holders) in self.cluster.block_locations(&f.file_id, &f.version) {
                // One copy per worker: a block in a worker's DRAM and on its NVMe is listed once
                // per tier, but it is one block that worker drops.
                let mut workers: Vec<&String> =
                    holders.iter().map(|(w, _, _)| w).filter(|w| live.contains(*w)).collect();
                workers.sort_unstable();
                workers.dedup();
                let on_live = workers.len() as u64;
                blocks += on_live;
                bytes += on_live * strata_common::block::block_len(f.size, f.block_size, index);
            }
        }
        let seq = self.pins.queue_free(crate::pins::ufs_prefix(&r.mount.record.uri, &r.rel));
        let applied = self.wait_applied(req.wait_ms, |w| self.pins.applied_by(w) >= seq).await;
        tracing::info!(path = %r.path, blocks, bytes, workers = applied.workers, done = applied.workers_applied, "freed");
        Ok(Response::new(pb::FreeResponse {
            blocks,
            bytes,
            workers: applied.workers,
            workers_done: applied.workers_applied,
            workers_pending: applied.pending,
        }))
    }

    async fn worker_mounts(&self, _: Request<pb::WorkerMountsRequest>) -> RpcResult<pb::MountList> {
        count("worker_mounts");
        let list = self.mount_list(true);
        Ok(Response::new(pb::MountList { state_paths: self.metadata.state_paths(), ..list }))
    }

    async fn submit_load(&self, req: Request<pb::SubmitLoadRequest>) -> RpcResult<pb::JobInfo> {
        const RPC: &str = "submit_load";
        count(RPC);
        let req = req.into_inner();
        let settings = load_settings(req.options.unwrap_or_default());
        let info = self.jobs.submit(&req.path, settings, "").await.map_err(status(RPC))?;
        Ok(Response::new(job_info(info)))
    }

    async fn get_job(&self, req: Request<pb::JobId>) -> RpcResult<pb::JobInfo> {
        const RPC: &str = "get_job";
        count(RPC);
        let info = self.jobs.info(&req.into_inner().id).map_err(status(RPC))?;
        Ok(Response::new(job_info(info)))
    }

    async fn list_jobs(&self, req: Request<pb::ListJobsRequest>) -> RpcResult<pb::JobList> {
        count("list_jobs");
        let req = req.into_inner();
        let limit = if req.limit == 0 { usize::MAX } else { req.limit as usize };
        // Counts only: a history of 1,000 jobs with 1,000 failures each would not fit one
        // message. `GetJob` has a job's failures.
        let jobs = self
            .jobs
            .list(req.finished, limit)
            .into_iter()
            .map(|j| pb::JobInfo { failures: Vec::new(), ..job_info(j) })
            .collect();
        Ok(Response::new(pb::JobList { jobs }))
    }

    async fn cancel_job(&self, req: Request<pb::JobId>) -> RpcResult<pb::JobInfo> {
        const RPC: &str = "cancel_job";
        count(RPC);
        let info = self.jobs.cancel(&req.into_inner().id).map_err(status(RPC))?;
        Ok(Response::new(job_info(info)))
    }

    async fn add_schedule(&self, req: Request<pb::ScheduleRequest>) -> RpcResult<pb::ScheduleInfo> {
        const RPC: &str = "add_schedule";
        count(RPC);
        let req = req.into_inner();
        let settings = load_settings(req.options.unwrap_or_default());
        let record =
            self.jobs.add_schedule(&req.cron, &req.tz, &req.path, settings).await.map_err(status(RPC))?;
        Ok(Response::new(schedule_info(&record)))
    }

    async fn list_schedules(&self, _: Request<pb::Empty>) -> RpcResult<pb::ScheduleList> {
        count("list_schedules");
        let schedules = self.jobs.schedules().iter().map(schedule_info).collect();
        Ok(Response::new(pb::ScheduleList { schedules }))
    }

    async fn remove_schedule(&self, req: Request<pb::ScheduleId>) -> RpcResult<pb::Empty> {
        const RPC: &str = "remove_schedule";
        count(RPC);
        self.jobs.remove_schedule(&req.into_inner().id).map_err(status(RPC))?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn fetch_load_tasks(&self, req: Request<pb::FetchLoadTasksRequest>) -> RpcResult<pb::LoadTasks> {
        let req = req.into_inner();
        let wait = Duration::from_millis(req.wait_ms);
        let tasks = self.jobs.fetch_tasks(&req.worker_id, req.max as usize, wait).await;
        Ok(Response::new(pb::LoadTasks { tasks: tasks.into_iter().map(load_task).collect() }))
    }

    async fn report_load_tasks(
        &self,
        req: Request<pb::ReportLoadTasksRequest>,
    ) -> RpcResult<pb::ReportLoadTasksResponse> {
        let req = req.into_inner();
        let results: Vec<LoadTaskResult> = req.results.iter().map(load_task_result).collect();
        let running_jobs = self.jobs.report(&req.worker_id, &results);
        Ok(Response::new(pb::ReportLoadTasksResponse { running_jobs }))
    }

    async fn create_token(&self, req: Request<pb::CreateTokenRequest>) -> RpcResult<pb::CreateTokenResponse> {
        const RPC: &str = "create_token";
        count(RPC);
        let req = req.into_inner();
        let (token, record) = self.tokens.create(&req.role, &req.prefix, &req.name).map_err(status(RPC))?;
        Ok(Response::new(pb::CreateTokenResponse { info: Some(token_info(&record)), token }))
    }

    async fn list_tokens(&self, _: Request<pb::Empty>) -> RpcResult<pb::TokenList> {
        count("list_tokens");
        Ok(Response::new(pb::TokenList { tokens: self.tokens.list().iter().map(token_info).collect() }))
    }

    async fn revoke_token(&self, req: Request<pb::RevokeTokenRequest>) -> RpcResult<pb::TokenInfo> {
        const RPC: &str = "revoke_token";
        count(RPC);
        let record = self.tokens.revoke(&req.into_inner().id).map_err(status(RPC))?;
        Ok(Response::new(token_info(&record)))
    }

    async fn report_lineage(
        &self,
        req: Request<pb::ReportLineageRequest>,
    ) -> RpcResult<pb::ReportLineageResponse> {
        count("ReportLineage");
        let identity = req.extensions().get::<Identity>().cloned();
        let reader = identity.as_ref().map_or_else(|| "-".to_string(), |i| i.id.clone());
        let r = req.into_inner();
        let reads = r
            .reads
            .into_iter()
            .map(|e| ReadReport {
                path: e.path,
                version: e.version,
                ufs: e.ufs,
                bytes: e.bytes,
                reads: e.reads,
                first_read_ms: e.first_read_ms,
                last_read_ms: e.last_read_ms,
            })
            .collect();
        let recorded = self
            .lineage
            .report_once(&r.job, &reader, &r.report_id, reads, r.client_now_ms, |p| {
                may_read(identity.as_ref(), p)
            })
            .map_err(|e| status("ReportLineage")(e.into()))?;
        Ok(Response::new(pb::ReportLineageResponse { recorded: recorded as u32 }))
    }

    async fn mark_lineage(&self, req: Request<pb::MarkLineageRequest>) -> RpcResult<pb::LineageMark> {
        count("MarkLineage");
        let r = req.into_inner();
        let mark = self.lineage.mark(&r.job, &r.label).map_err(|e| status("MarkLineage")(e.into()))?;
        Ok(Response::new(lineage_mark(mark)))
    }

    async fn lineage_job(&self, req: Request<pb::LineageJobRequest>) -> RpcResult<pb::LineageJobResponse> {
        count("LineageJob");
        let identity = req.extensions().get::<Identity>().cloned();
        let r = req.into_inner();
        let found = self
            .lineage
            .job(&r.job, &r.since, &r.page_token, r.page_size as usize, |p| may_read(identity.as_ref(), p))
            .map_err(|e| status("LineageJob")(e.into()))?;
        Ok(Response::new(pb::LineageJobResponse {
            job: found.job,
            marks: found.marks.into_iter().map(lineage_mark).collect(),
            records: found.records.into_iter().map(lineage_record).collect(),
            next_page_token: found.next_page_token,
        }))
    }

    async fn lineage_file(&self, req: Request<pb::LineageFileRequest>) -> RpcResult<pb::LineageFileResponse> {
        count("LineageFile");
        check_path(&req, Access::Read, &req.get_ref().path)?;
        let r = req.into_inner();
        let (records, next_page_token) = self
            .lineage
            .file(&r.path, &r.page_token, r.page_size as usize)
            .map_err(|e| status("LineageFile")(e.into()))?;
        Ok(Response::new(pb::LineageFileResponse {
            records: records.into_iter().map(lineage_record).collect(),
            next_page_token,
        }))
    }

    async fn list_lineage_jobs(&self, req: Request<pb::Empty>) -> RpcResult<pb::LineageJobList> {
        count("ListLineageJobs");
        let identity = req.extensions().get::<Identity>().cloned();
        let jobs = self.lineage.jobs(|p| may_read(identity.as_ref(), p));
        Ok(Response::new(pb::LineageJobList {
            jobs: jobs
                .into_iter()
                .map(|j| pb::LineageJob {
                    job: j.job,
                    files: j.files,
                    bytes: j.bytes,
                    first_read_ms: j.first_read_ms,
                    last_read_ms: j.last_read_ms,
                    marks: j.marks,
                })
                .collect(),
        }))
    }

    async fn worker_tokens(&self, _: Request<pb::WorkerTokensRequest>) -> RpcResult<pb::WorkerTokenTable> {
        count("worker_tokens");
        let (epoch, records) = self.tokens.for_workers();
        let tokens = records
            .into_iter()
            .map(|r| pb::WorkerTokenEntry {
                hash: r.hash,
                role: r.role.as_str().to_string(),
                prefix: r.prefix.unwrap_or_default(),
                id: r.id,
            })
            .collect();
        Ok(Response::new(pb::WorkerTokenTable { epoch, auth_enabled: self.tokens.enabled(), tokens }))
    }
}

/// Whether the caller may read `path` (no identity: a unit test calling the handler directly).
fn may_read(identity: Option<&Identity>, path: &str) -> bool {
    identity.is_none_or(|i| i.check(Access::Read, Some(path)).is_ok())
}

fn lineage_mark(m: crate::lineage::MarkRecord) -> pb::LineageMark {
    pb::LineageMark { job: m.job, seq: m.seq, label: m.label, at_ms: m.at_ms }
}

fn lineage_record(r: crate::lineage::LineageRecord) -> pb::LineageRecord {
    pb::LineageRecord {
        job: r.job,
        path: r.path,
        version: r.version,
        ufs: r.ufs,
        bytes: r.bytes,
        reads: r.reads,
        first_read_ms: r.first_read_ms,
        last_read_ms: r.last_read_ms,
        mark_seq: r.mark_seq,
        reader: r.reader,
    }
}

fn token_info(r: &TokenRecord) -> pb::TokenInfo {
    pb::TokenInfo {
        id: r.id.clone(),
        role: r.role.as_str().to_string(),
        prefix: r.prefix.clone().unwrap_or_default(),
        name: r.name.clone(),
        created_ms: r.created_ms,
        file: r.file.as_ref().map(|f| f.display().to_string()).unwrap_or_default(),
    }
}

/// The least time without a heartbeat that makes a live worker suspect.
const SUSPECT_FLOOR_MS: u64 = 2_000;

/// Most files a pin or a free walks (its size, its blocks): a larger tree is refused rather
/// than walked for minutes inside one call.
const MAX_FILES_WALKED: usize = 1_000_000;

impl Rpc {
    /// Every file under `path` (the file itself for a file), through the paged walk of `find`.
    async fn files_under(&self, path: &str) -> Result<Vec<FileBlocks>, OpError> {
        let mut files = Vec::new();
        let mut after = String::new();
        loop {
            let (mount, entries, next) = self.metadata.find_page(path, false, &after, MAX_PAGE, 0).await?;
            for e in entries.into_iter().filter(|e| !e.meta.is_dir) {
                files.push(FileBlocks {
                    file_id: strata_common::block::file_identity(&mount.record.uri, &e.rel, mount.block_size),
                    version: e.meta.version,
                    size: e.meta.size,
                    block_size: mount.block_size,
                });
            }
            if files.len() > MAX_FILES_WALKED {
                return Err(OpError::TooManyFiles { path: path.to_string(), max: MAX_FILES_WALKED });
            }
            match next {
                Some(n) => after = n,
                None => return Ok(files),
            }
        }
    }

    /// How long a live worker may go without a heartbeat before clients are told to ask it
    /// last: three heartbeat intervals and at least 2 s, so late beats of a busy worker (its
    /// heartbeat shares the runtime with its reads) do not send reads, and with them UFS
    /// fetches, to the next owner.
    fn suspect_after(&self) -> Duration {
        Duration::from_millis(self.heartbeat_interval_ms.saturating_mul(3).max(SUSPECT_FLOOR_MS))
    }

    /// Waits until every live worker has the pins and TTLs as they are now in force (it applied
    /// their epoch: pins protect what it holds, see the worker's `pins`), or `wait_ms` passed.
    async fn pins_in_force(&self, wait_ms: u64) -> pb::Applied {
        let epoch = self.pins.epoch();
        self.wait_applied(wait_ms, |w| self.pins.epoch_applied_by(w) >= epoch).await
    }

    /// Waits until `applied` holds for every live worker, woken by their reports, for at most
    /// `wait_ms` (0: 10 s; at most 10 min). Says which had not when it ended.
    async fn wait_applied(&self, wait_ms: u64, applied: impl Fn(&str) -> bool) -> pb::Applied {
        let wait = Duration::from_millis(if wait_ms == 0 { 10_000 } else { wait_ms.min(600_000) });
        let deadline = tokio::time::Instant::now() + wait;
        let live = self.live_ids();
        loop {
            let report = self.pins.reported();
            let mut pending: Vec<String> = live.iter().filter(|w| !applied(w)).cloned().collect();
            if pending.is_empty() || tokio::time::Instant::now() >= deadline {
                pending.sort_unstable();
                return pb::Applied {
                    workers: live.len() as u32,
                    workers_applied: (live.len() - pending.len()) as u32,
                    pending,
                };
            }
            let _ = tokio::time::timeout_at(deadline, report).await;
        }
    }

    fn live_ids(&self) -> std::collections::HashSet<String> {
        self.cluster.live().1.into_iter().map(|m| m.id).collect()
    }

    /// A write-back file not yet in the UFS carries its live holders and its state.
    fn with_pending(&self, mut status: pb::FileStatus) -> pb::FileStatus {
        if status.is_dir || !status.version.starts_with(crate::writeback::VERSION_PREFIX) {
            return status;
        }
        let Some(view) = self.metadata.pending().get(&status.path) else { return status };
        let live = self.cluster.live().1;
        status.holders = view
            .record
            .holders
            .iter()
            .filter_map(|h| live.iter().find(|m| &m.id == h))
            .map(|m| pb::Member {
                id: m.id.clone(),
                data_addr: m.data_addr.clone(),
                suspect: false,
                node: m.node.clone(),
                local_socket: m.local_socket.clone(),
            })
            .collect();
        status.persist = persist_state(view.state) as i32;
        status
    }

    fn mount_list(&self, with_secrets: bool) -> pb::MountList {
        let (epoch, mounts) = self.metadata.mounts();
        let mounts = mounts.iter().map(|m| mount_info(m, with_secrets)).collect();
        pb::MountList { epoch, mounts, state_paths: Vec::new() }
    }
}

// ---- own types <-> protobuf ----

fn persist_state(s: PersistState) -> pb::PersistState {
    match s {
        PersistState::Pending => pb::PersistState::Pending,
        PersistState::Uploading => pb::PersistState::Uploading,
        PersistState::Failed => pb::PersistState::Failed,
    }
}

fn proto_pin_tier(tier: PinTier) -> pb::PinTier {
    match tier {
        PinTier::Memory => pb::PinTier::Memory,
        PinTier::Nvme => pb::PinTier::Nvme,
    }
}

fn cache_ttl_info(r: &crate::pins::CacheTtlRecord) -> pb::CacheTtlInfo {
    pb::CacheTtlInfo {
        path: r.path.clone(),
        cache_ttl_ms: r.cache_ttl_ms,
        created_unix_ms: r.created_unix_ms,
        applied: None,
    }
}

fn pin_rule(p: &PinRecord) -> pb::PinRule {
    pb::PinRule { ufs_prefix: p.ufs_prefix.clone(), tier: proto_pin_tier(p.tier) as i32 }
}

fn pin_info(p: &PinRecord) -> pb::PinInfo {
    pb::PinInfo {
        path: p.path.clone(),
        tier: proto_pin_tier(p.tier) as i32,
        bytes: p.bytes,
        created_unix_ms: p.created_unix_ms,
        expires_unix_ms: p.expires_unix_ms.unwrap_or(0),
        applied: None,
    }
}

fn file_status(path: &str, mount: &Mount, rel: &str, meta: &ObjectMeta) -> pb::FileStatus {
    pb::FileStatus {
        path: path.to_string(),
        is_dir: meta.is_dir,
        size: meta.size,
        version: meta.version.clone(),
        mtime_ms: meta.mtime_ms,
        block_size: mount.block_size,
        file_id: if meta.is_dir {
            String::new()
        } else {
            strata_common::block::file_identity(&mount.record.uri, rel, mount.block_size)
        },
        holders: Vec::new(),
        persist: pb::PersistState::Persisted as i32,
    }
}

/// A mount as clients see it (credentials redacted) or as workers need it (`with_secrets`).
fn mount_info(mount: &Mount, with_secrets: bool) -> pb::MountInfo {
    let options =
        if with_secrets { mount.record.options.clone() } else { redact_options(&mount.record.options) };
    pb::MountInfo {
        path: mount.record.path.clone(),
        uri: mount.record.uri.clone(),
        options: options.into_iter().collect(),
        block_size: mount.block_size,
        metadata_ttl_ms: mount.metadata_ttl.as_millis() as u64,
        read_replicas: mount.read_replicas,
        warnings: Vec::new(),
    }
}

fn tier(t: i32) -> Tier {
    match pb::Tier::try_from(t) {
        Ok(pb::Tier::Memory) => Tier::Memory,
        Ok(pb::Tier::Nvme) => Tier::Nvme,
        _ => Tier::Unspecified,
    }
}

fn proto_tier(t: Tier) -> pb::Tier {
    match t {
        Tier::Unspecified => pb::Tier::Unspecified,
        Tier::Memory => pb::Tier::Memory,
        Tier::Nvme => pb::Tier::Nvme,
    }
}

fn tier_usage(u: &pb::TierUsage) -> TierUsage {
    TierUsage {
        tier: tier(u.tier),
        capacity_bytes: u.capacity_bytes,
        used_bytes: u.used_bytes,
        blocks: u.blocks,
        full_limit: u.disk_full.then_some(u.full_limit_bytes),
        write_errors: [u.write_errors_no_space, u.write_errors_quota, u.write_errors_io],
    }
}

fn proto_tier_usage(u: &TierUsage) -> pb::TierUsage {
    pb::TierUsage {
        tier: proto_tier(u.tier) as i32,
        capacity_bytes: u.capacity_bytes,
        used_bytes: u.used_bytes,
        blocks: u.blocks,
        disk_full: u.full_limit.is_some(),
        full_limit_bytes: u.full_limit.unwrap_or(0),
        write_errors_no_space: u.write_errors[0],
        write_errors_quota: u.write_errors[1],
        write_errors_io: u.write_errors[2],
    }
}

fn counters(c: &pb::WorkerCounters) -> WorkerCounters {
    WorkerCounters {
        cache_hits: c.cache_hits,
        cache_misses: c.cache_misses,
        ufs_reads: c.ufs_reads,
        ufs_bytes_read: c.ufs_bytes_read,
        bytes_served: c.bytes_served,
        corrupt_blocks: c.corrupt_blocks,
    }
}

fn proto_counters(c: &WorkerCounters) -> pb::WorkerCounters {
    pb::WorkerCounters {
        cache_hits: c.cache_hits,
        cache_misses: c.cache_misses,
        ufs_reads: c.ufs_reads,
        ufs_bytes_read: c.ufs_bytes_read,
        bytes_served: c.bytes_served,
        corrupt_blocks: c.corrupt_blocks,
    }
}

fn block_report(r: &pb::BlockReport) -> BlockReport {
    BlockReport { file_id: r.file_id.clone(), version: r.version.clone(), index: r.index, tier: tier(r.tier) }
}

fn load_settings(o: pb::LoadOptions) -> LoadSettings {
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

fn load_options(s: &LoadSettings) -> pb::LoadOptions {
    pb::LoadOptions {
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

fn job_state(p: Phase) -> pb::JobState {
    match p {
        Phase::Running => pb::JobState::Running,
        Phase::Succeeded => pb::JobState::Succeeded,
        Phase::Failed => pb::JobState::Failed,
        Phase::Cancelled => pb::JobState::Cancelled,
    }
}

fn job_info(j: JobInfo) -> pb::JobInfo {
    let p = j.progress;
    pb::JobInfo {
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
            .map(|f| pb::FileFailure { path: f.path, reason: f.reason })
            .collect(),
        created_ms: j.created_ms,
        finished_ms: j.finished_ms,
        schedule_id: j.schedule_id,
        resumed: j.resumed,
        task_retries: p.task_retries,
    }
}

fn load_task(t: LoadTask) -> pb::LoadTask {
    pb::LoadTask {
        task_id: t.task_id,
        job_id: t.job_id,
        path: t.path,
        version: t.version,
        file_size: t.file_size,
        block_size: t.block_size,
        index: t.index,
        bandwidth: t.bandwidth,
        parallelism: t.parallelism,
        files: t
            .files
            .into_iter()
            .map(|f| pb::SmallFileLoad { path: f.path, version: f.version, size: f.size })
            .collect(),
    }
}

fn load_task_result(r: &pb::LoadTaskResult) -> LoadTaskResult {
    LoadTaskResult {
        task_id: r.task_id,
        job_id: r.job_id.clone(),
        ok: r.ok,
        already_cached: r.already_cached,
        error: r.error.clone(),
        temporary: r.temporary,
        files: r
            .files
            .iter()
            .map(|f| FileOutcome {
                ok: f.ok,
                already_cached: f.already_cached,
                error: f.error.clone(),
                temporary: f.temporary,
            })
            .collect(),
    }
}

fn schedule_info(r: &ScheduleRecord) -> pb::ScheduleInfo {
    pb::ScheduleInfo {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_keep_their_kind_through_the_status() {
        for (e, kind) in [
            (OpError::NoJob("j".into()), strata_common::ErrorKind::NotFound),
            (OpError::TooManyReplicas { replicas: 4, live: 3 }, strata_common::ErrorKind::InvalidArgument),
            (
                OpError::ReadOnly { path: "/d/a".into(), mount: "/d".into() },
                strata_common::ErrorKind::PermissionDenied,
            ),
            (OpError::IsDirectory("/d".into()), strata_common::ErrorKind::IsDirectory),
        ] {
            let message = e.to_string();
            let s = status("test")(e);
            assert_eq!(strata_proto::kind_of(&s), kind);
            assert_eq!(s.message(), message);
        }
    }

    #[test]
    fn options_round_trip_and_replicas_default_to_one() {
        let o = pb::LoadOptions {
            replicas: 0,
            include: vec!["*.bin".into()],
            verify: true,
            ..Default::default()
        };
        let s = load_settings(o.clone());
        assert_eq!(s.replicas, 1);
        assert_eq!(load_options(&s), pb::LoadOptions { replicas: 1, ..o });
        for t in [Tier::Unspecified, Tier::Memory, Tier::Nvme] {
            assert_eq!(tier(proto_tier(t) as i32), t);
        }
        assert_eq!(tier(99), Tier::Unspecified);
    }
}
