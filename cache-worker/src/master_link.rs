//! The worker's side of the control plane: register, heartbeat with usage, counters and block
//! deltas, and the mount table ([`MountSource`] for `mounts`). A master restart or a "lost"
//! verdict makes the worker register again and send a full block report; a failed heartbeat
//! makes the next report full, so no delta is ever lost.
//!
//! This is where the worker's own types become protobuf and back; nothing below it knows gRPC.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use strata_common::SharedClock;
use strata_common::background::{Backoff, sleep_or_cancel};
use strata_proto::leader::MasterConn;
use strata_proto::{
    BlockReport, CommitWriteRequest, Empty, HeartbeatRequest, JournalReport, RegisterWorkerRequest,
    Tier as ProtoTier, TierUsage, UploadResultRequest, WorkerCounters, WorkerMountsRequest,
    WorkerTokensRequest,
};
use strata_security::tls::ClientTls;
use strata_security::token::{Identity as TokenIdentity, Role, TokenTable};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::auth::{PeerAuth, Table};
use crate::blocks::BlockService;
use crate::metrics_defs as m;
use crate::mounts::{MountSnapshot, MountSource, MountSpec};
use crate::stats::CounterSnapshot;
use crate::tier::{Tier, TierEvent, TierKind};
use crate::view::LastView;
use crate::writeback::{CommitWrite, WriteBack, WriteBackMaster};

/// Most blocks one heartbeat reports: a full report of a worker holding millions of blocks goes
/// out as a sequence of heartbeats (sent back to back), each a bounded message.
pub const REPORT_CHUNK: usize = 10_000;

/// How the worker is reached, as it registers.
pub struct Identity {
    pub worker_id: String,
    pub data_addr: String,
    pub http_addr: String,
    /// Empty when not configured.
    pub node: String,
    /// Absolute path of its Unix socket for processes on its host; empty when none.
    pub local_socket: String,
    /// What it owns on its host (see `strata_ufs::StateFence`), for the cluster to fence.
    pub state_paths: Vec<String>,
}

/// A (lazily connected) gRPC client of the master, or of the masters of an HA cluster
/// (`master_addr` a comma-separated list): calls follow the leader through a failover. Every
/// call presents `token` (the worker's); with `tls`, over TLS (the worker's own certificate
/// presented when the master asks for one).
pub fn connect(
    master_addr: &str,
    token: Option<&str>,
    tls: Option<ClientTls>,
) -> Result<MasterConn, tonic::transport::Error> {
    strata_proto::leader::master_conn(master_addr, token, move |addr| {
        let endpoint = match &tls {
            Some(tls) => {
                tonic::transport::Endpoint::from_shared(format!("https://{addr}"))?.tls_config(tls.tonic())?
            }
            None => tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?,
        };
        Ok(endpoint.connect_timeout(Duration::from_secs(2)).timeout(Duration::from_secs(10)))
    })
}

/// The master as write-back needs it.
pub struct MasterWriteBack {
    pub client: MasterConn,
    pub worker_id: String,
}

#[async_trait]
impl WriteBackMaster for MasterWriteBack {
    async fn commit(&self, c: CommitWrite) -> Result<bool, String> {
        let req = CommitWriteRequest {
            worker_id: self.worker_id.clone(),
            path: c.path,
            write_id: c.write_id,
            size: c.size,
            mtime_ms: c.mtime_ms,
            holders: c.holders,
            persisted: c.persisted,
        };
        let resp = self.client.clone().commit_write(req).await.map_err(|s| s.message().to_string())?;
        Ok(resp.into_inner().upload)
    }

    async fn upload_result(
        &self,
        path: &str,
        write_id: &str,
        error: &str,
        gave_up: bool,
    ) -> Result<Vec<String>, String> {
        let req = UploadResultRequest {
            worker_id: self.worker_id.clone(),
            path: path.to_string(),
            write_id: write_id.to_string(),
            error: error.to_string(),
            gave_up,
        };
        let resp = self.client.clone().upload_result(req).await.map_err(|s| s.message().to_string())?;
        Ok(resp.into_inner().upload)
    }
}

/// The master as the source of a worker's (or sidecar's) mount table.
pub struct MasterMounts {
    pub client: MasterConn,
    pub worker_id: String,
}

#[async_trait]
impl MountSource for MasterMounts {
    async fn fetch(&self) -> Result<MountSnapshot, String> {
        let req = WorkerMountsRequest { worker_id: self.worker_id.clone() };
        let list =
            self.client.clone().worker_mounts(req).await.map_err(|s| s.message().to_string())?.into_inner();
        Ok(MountSnapshot {
            epoch: list.epoch,
            mounts: list
                .mounts
                .into_iter()
                .map(|m| MountSpec {
                    path: m.path,
                    uri: m.uri,
                    options: m.options.into_iter().collect(),
                    block_size: m.block_size,
                })
                .collect(),
            state_paths: list.state_paths,
        })
    }
}

/// Asks the master for the membership and the client-facing mount table (secrets redacted)
/// and keeps them as the worker's last view, for clients that cannot reach the master.
pub async fn refresh_view(client: &MasterConn, view: &LastView, clock: &SharedClock) {
    let mut client = client.clone();
    let fetched = async {
        let membership = client.get_membership(Empty {}).await?.into_inner();
        let mounts = client.list_mounts(Empty {}).await?.into_inner();
        Ok::<_, tonic::Status>((membership, mounts))
    };
    match fetched.await {
        Ok((membership, mounts)) => view.set(membership, mounts, clock.wall_ms()),
        Err(status) => warn!(err = %status.message(), "cannot fetch the cluster view; keeping the last one"),
    }
}

/// Fetches the tokens the cluster accepts (hashes, roles, scopes) for the data plane's checks.
/// On failure the worker keeps the table it has (a master outage does not lock clients out).
pub async fn refresh_tokens(client: &MasterConn, worker_id: &str, auth: &PeerAuth) {
    let req = WorkerTokensRequest { worker_id: worker_id.to_string() };
    match client.clone().worker_tokens(req).await {
        Ok(answer) => {
            let answer = answer.into_inner();
            let entries = answer.tokens.into_iter().filter_map(|t| {
                let role = Role::parse(&t.role).ok()?;
                let prefix = Some(t.prefix).filter(|p| !p.is_empty());
                Some((t.hash, TokenIdentity { id: t.id, role, prefix }))
            });
            let tokens = TokenTable::new(entries);
            info!(
                epoch = answer.epoch,
                tokens = tokens.len(),
                enabled = answer.auth_enabled,
                "learnt the cluster's tokens"
            );
            auth.set(Table { epoch: answer.epoch, enabled: answer.auth_enabled, tokens });
        }
        Err(status) => {
            warn!(err = %status.message(), "cannot fetch the cluster's tokens; keeping the last ones")
        }
    }
}

/// How long a starting worker waits for the master's token table before it serves anyway (and
/// refuses everyone until it learns it).
const FIRST_TOKENS_WAIT: Duration = Duration::from_secs(3);

/// At start: the data plane's token check, with the table fetched (bounded by
/// [`FIRST_TOKENS_WAIT`]) and fetched again when a peer presents a token it does not know
/// (created a moment ago).
pub async fn learn_tokens(client: &MasterConn, worker_id: &str) -> Arc<PeerAuth> {
    let auth = Arc::new(PeerAuth::unknown());
    let _ = tokio::time::timeout(FIRST_TOKENS_WAIT, refresh_tokens(client, worker_id, &auth)).await;
    let (client, worker_id, weak) = (client.clone(), worker_id.to_string(), Arc::downgrade(&auth));
    auth.set_refresher(Box::new(move || {
        let (client, worker_id, weak) = (client.clone(), worker_id.clone(), weak.clone());
        Box::pin(async move {
            if let Some(auth) = weak.upgrade() {
                let _ =
                    tokio::time::timeout(FIRST_TOKENS_WAIT, refresh_tokens(&client, &worker_id, &auth)).await;
            }
        })
    }));
    auth
}

/// Whether the view is older than the epochs the master just announced.
fn view_is_behind(view: &LastView, membership_epoch: u64, mounts_epoch: u64) -> bool {
    view.epochs() != Some((membership_epoch, mounts_epoch))
}

fn proto_tier(kind: TierKind) -> ProtoTier {
    match kind {
        TierKind::Memory => ProtoTier::Memory,
        TierKind::Nvme => ProtoTier::Nvme,
    }
}

fn usage(tier: &dyn Tier) -> TierUsage {
    let u = tier.usage();
    let disk = tier.disk_health();
    metrics::gauge!(m::TIER_USED_BYTES, "tier" => tier.kind().label()).set(u.used_bytes as f64);
    TierUsage {
        tier: proto_tier(tier.kind()) as i32,
        capacity_bytes: u.capacity_bytes,
        used_bytes: u.used_bytes,
        blocks: u.blocks,
        disk_full: disk.limit_bytes.is_some(),
        full_limit_bytes: disk.limit_bytes.unwrap_or(0),
        write_errors_no_space: disk.no_space_errors,
        write_errors_quota: disk.quota_errors,
        write_errors_io: disk.io_errors,
    }
}

fn report(key: &strata_common::BlockKey, tier: TierKind, size: u64) -> BlockReport {
    BlockReport {
        file_id: key.file.clone(),
        version: key.version.clone(),
        index: key.index,
        tier: proto_tier(tier) as i32,
        size,
    }
}

fn pin_rule(rule: &strata_proto::PinRule) -> (String, TierKind) {
    let tier = match strata_proto::PinTier::try_from(rule.tier) {
        Ok(strata_proto::PinTier::Memory) => TierKind::Memory,
        _ => TierKind::Nvme,
    };
    (rule.ufs_prefix.clone(), tier)
}

fn proto_counters(c: CounterSnapshot) -> WorkerCounters {
    WorkerCounters {
        cache_hits: c.cache_hits,
        cache_misses: c.cache_misses,
        ufs_reads: c.ufs_reads,
        ufs_bytes_read: c.ufs_bytes_read,
        bytes_served: c.bytes_served,
        corrupt_blocks: c.corrupt_blocks,
    }
}

/// What the heartbeat loop keeps up to date and reports on.
pub struct Linked {
    pub blocks: Arc<BlockService>,
    pub view: Arc<LastView>,
    pub auth: Arc<PeerAuth>,
    pub writeback: Arc<WriteBack>,
    /// Installed in the tiers by the caller; kept up to date here.
    pub pins: Arc<crate::pins::PinSet>,
    /// Its per-mount bytes go out with every heartbeat.
    pub upkeep: Arc<crate::upkeep::Upkeep>,
    /// Set when the worker starts draining: every heartbeat from then on says so.
    pub draining: Arc<std::sync::atomic::AtomicBool>,
}

/// Registers and heartbeats until `cancel`, keeping `view` up to the epochs the master announces.
pub async fn run(
    client: MasterConn,
    id: Identity,
    parts: Linked,
    clock: SharedClock,
    cancel: CancellationToken,
) {
    let Linked { blocks, view, auth, writeback, pins, upkeep, draining } = parts;
    let mut client = client;
    let mut interval = Duration::from_millis(1000);
    let mut registered = false;
    let mut full_report = true;
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    let tiers: Vec<Arc<dyn Tier>> = blocks.cache().tiers().into_iter().cloned().collect();
    // Blocks of a full report not sent yet.
    let mut backlog: Vec<BlockReport> = Vec::new();
    // A change the master waits on (pins, frees) was just applied: tell it with the next beat.
    let mut report_now = false;
    while !cancel.is_cancelled() {
        if !registered {
            // The tokens before the registration: clients route to this worker once the master
            // lists it, and it must be able to check them by then.
            if auth.epoch().is_none() {
                refresh_tokens(&client, &id.worker_id, &auth).await;
            }
            let req = RegisterWorkerRequest {
                worker_id: id.worker_id.clone(),
                data_addr: id.data_addr.clone(),
                http_addr: id.http_addr.clone(),
                tiers: tiers.iter().map(|t| usage(t.as_ref())).collect(),
                node: id.node.clone(),
                local_socket: id.local_socket.clone(),
                state_paths: id.state_paths.clone(),
            };
            match client.register_worker(req).await {
                Ok(resp) => {
                    let resp = resp.into_inner();
                    interval = Duration::from_millis(resp.heartbeat_interval_ms.max(10));
                    registered = true;
                    full_report = true;
                    backoff.reset();
                    info!(worker = %id.worker_id, epoch = resp.membership_epoch, "registered with master");
                    if resp.mounts_epoch != blocks.mounts().epoch() {
                        blocks.mounts().refresh().await;
                    }
                    if auth.epoch() != Some(resp.tokens_epoch) {
                        refresh_tokens(&client, &id.worker_id, &auth).await;
                    }
                    refresh_view(&client, &view, &clock).await;
                }
                Err(status) => {
                    warn!(worker = %id.worker_id, err = %status.message(), "registration failed; retrying");
                    sleep_or_cancel(backoff.next_delay(), &cancel).await;
                    continue;
                }
            }
        }

        let (mut added, mut removed) = (Vec::new(), Vec::new());
        let starts_full_report = full_report;
        if starts_full_report {
            backlog.clear();
        }
        for tier in &tiers {
            let events = tier.drain_events();
            if starts_full_report {
                backlog.extend(tier.keys().iter().map(|(k, size)| report(k, tier.kind(), *size)));
                continue;
            }
            for event in events {
                match event {
                    TierEvent::Added { key, size } => added.push(report(&key, tier.kind(), size)),
                    TierEvent::Removed { key } => removed.push(report(&key, tier.kind(), 0)),
                }
            }
        }
        // The rest of a full report rides on the next heartbeats, a chunk each; a removal in
        // `removed` after its block's `added` in an earlier chunk leaves the master right.
        let take = backlog.len().min(REPORT_CHUNK.saturating_sub(added.len()).max(1));
        added.extend(backlog.drain(..take));
        let counters = blocks.counters();
        metrics::counter!(m::CORRUPT_BLOCKS).absolute(counters.corrupt_blocks);
        let req = HeartbeatRequest {
            worker_id: id.worker_id.clone(),
            tiers: tiers.iter().map(|t| usage(t.as_ref())).collect(),
            counters: Some(proto_counters(counters)),
            added,
            removed,
            full_report: starts_full_report,
            mount_usage: upkeep
                .mount_bytes()
                .into_iter()
                .map(|(path, bytes)| strata_proto::MountUsage { path, bytes })
                .collect(),
            journals: writeback
                .reports()
                .into_iter()
                .map(|j| JournalReport {
                    write_id: j.write_id,
                    path: j.path,
                    uploading: j.uploading,
                    age_ms: j.age_ms,
                })
                .collect(),
            pins_epoch: pins.epoch(),
            frees_applied: pins.frees_applied(),
            draining: draining.load(std::sync::atomic::Ordering::Relaxed),
        };
        match client.heartbeat(req).await {
            Ok(resp) => {
                let resp = resp.into_inner();
                full_report = false;
                if resp.reregister {
                    info!(worker = %id.worker_id, "master asked to register again");
                    registered = false;
                    continue;
                }
                if resp.mounts_epoch != blocks.mounts().epoch() {
                    blocks.mounts().refresh().await;
                }
                if auth.epoch() != Some(resp.tokens_epoch) {
                    refresh_tokens(&client, &id.worker_id, &auth).await;
                }
                for id in resp.drop {
                    writeback.drop_journal(&id);
                }
                if resp.pins_included {
                    pins.replace_cache_ttls(
                        resp.cache_ttls
                            .iter()
                            .map(|r| (r.ufs_prefix.clone(), Duration::from_millis(r.cache_ttl_ms)))
                            .collect(),
                    );
                    pins.apply(blocks.cache(), resp.pins_epoch, resp.pins.iter().map(pin_rule).collect())
                        .await;
                    // The master holds `strata pin` (and ttl, unpin) until we say so: at once.
                    report_now = true;
                }
                if resp.last_free != pins.frees_applied() {
                    pins.free(&tiers, &resp.free, resp.last_free).await;
                    report_now = true;
                }
                for id in resp.upload {
                    writeback.upload(id);
                }
                view.touch(clock.wall_ms());
                if view_is_behind(&view, resp.membership_epoch, resp.mounts_epoch) {
                    refresh_view(&client, &view, &clock).await;
                }
            }
            Err(status) => {
                metrics::counter!(m::HEARTBEAT_FAILURES).increment(1);
                warn!(worker = %id.worker_id, err = %status.message(), "heartbeat failed");
                // The deltas of this beat are gone: the next one reports everything.
                full_report = true;
                backlog.clear();
            }
        }
        if (backlog.is_empty() && !std::mem::take(&mut report_now)) || full_report {
            sleep_or_cancel(interval, &cancel).await;
        }
    }
}
