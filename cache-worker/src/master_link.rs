//! The worker's side of the control plane: register, heartbeat with usage, counters and block
//! deltas, follow the mount table. A master restart or a "lost" verdict makes the worker
//! register again and send a full block report; a failed heartbeat makes the next report full,
//! so no delta is ever lost.

use std::sync::Arc;
use std::time::Duration;

use strata_proto::master_client::MasterClient;
use strata_proto::{BlockReport, HeartbeatRequest, RegisterWorkerRequest, Tier as ProtoTier, TierUsage};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tracing::{info, warn};

use crate::blockstore::BlockStore;
use crate::metrics_defs as m;
use crate::tier::{Tier, TierEvent, TierKind};

pub struct Identity {
    pub worker_id: String,
    pub data_addr: String,
    pub http_addr: String,
}

fn proto_tier(kind: TierKind) -> ProtoTier {
    match kind {
        TierKind::Memory => ProtoTier::Memory,
        TierKind::Nvme => ProtoTier::Nvme,
    }
}

fn usage(tier: &dyn Tier) -> TierUsage {
    let u = tier.usage();
    metrics::gauge!(m::TIER_USED_BYTES, "tier" => tier.kind().label()).set(u.used_bytes as f64);
    TierUsage {
        tier: proto_tier(tier.kind()) as i32,
        capacity_bytes: u.capacity_bytes,
        used_bytes: u.used_bytes,
        blocks: u.blocks,
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

pub async fn connect(master_addr: &str) -> Result<MasterClient<Channel>, tonic::transport::Error> {
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{master_addr}"))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(10));
    Ok(MasterClient::new(endpoint.connect_lazy()))
}

pub async fn run(
    client: MasterClient<Channel>,
    id: Identity,
    store: Arc<BlockStore>,
    cancel: CancellationToken,
) {
    let mut client = client;
    let mut interval = Duration::from_millis(1000);
    let mut registered = false;
    let mut full_report = true;
    let mut backoff = Duration::from_millis(100);
    let tiers: [Arc<dyn Tier>; 2] = [store.memory.clone(), store.nvme.clone()];
    while !cancel.is_cancelled() {
        if !registered {
            let req = RegisterWorkerRequest {
                worker_id: id.worker_id.clone(),
                data_addr: id.data_addr.clone(),
                http_addr: id.http_addr.clone(),
                tiers: tiers.iter().map(|t| usage(t.as_ref())).collect(),
            };
            match client.register_worker(req).await {
                Ok(resp) => {
                    let resp = resp.into_inner();
                    interval = Duration::from_millis(resp.heartbeat_interval_ms.max(10));
                    registered = true;
                    full_report = true;
                    backoff = Duration::from_millis(100);
                    info!(worker = %id.worker_id, epoch = resp.membership_epoch, "registered with master");
                    if resp.mounts_epoch != store.mounts_epoch() {
                        store.refresh_mounts().await;
                    }
                }
                Err(status) => {
                    warn!(worker = %id.worker_id, err = %status.message(), "registration failed; retrying");
                    sleep_or_cancel(backoff, &cancel).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            }
        }

        let (mut added, mut removed) = (Vec::new(), Vec::new());
        for tier in &tiers {
            let events = tier.drain_events();
            if full_report {
                added.extend(tier.keys().iter().map(|(k, size)| report(k, tier.kind(), *size)));
                continue;
            }
            for event in events {
                match event {
                    TierEvent::Added { key, size } => added.push(report(&key, tier.kind(), size)),
                    TierEvent::Removed { key } => removed.push(report(&key, tier.kind(), 0)),
                }
            }
        }
        let counters = store.counters();
        metrics::counter!(m::CORRUPT_BLOCKS).absolute(counters.corrupt_blocks);
        let req = HeartbeatRequest {
            worker_id: id.worker_id.clone(),
            tiers: tiers.iter().map(|t| usage(t.as_ref())).collect(),
            counters: Some(counters),
            added,
            removed,
            full_report,
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
                if resp.mounts_epoch != store.mounts_epoch() {
                    store.refresh_mounts().await;
                }
            }
            Err(status) => {
                metrics::counter!(m::HEARTBEAT_FAILURES).increment(1);
                warn!(worker = %id.worker_id, err = %status.message(), "heartbeat failed");
                // The deltas of this beat are gone: the next one reports everything.
                full_report = true;
            }
        }
        sleep_or_cancel(interval, &cancel).await;
    }
}

async fn sleep_or_cancel(d: Duration, cancel: &CancellationToken) {
    tokio::select! {
        _ = cancel.cancelled() => {}
        _ = tokio::time::sleep(d) => {}
    }
}
