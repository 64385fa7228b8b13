//! Every metric the master emits, declared once (listed in docs/METRICS.md).

/// Counter, label `rpc`: control-plane requests served.
pub const RPC_REQUESTS: &str = "strata_master_rpc_requests_total";
/// Counter, labels `rpc`, `kind`: control-plane requests that failed.
pub const RPC_ERRORS: &str = "strata_master_rpc_errors_total";
/// Gauge: live workers.
pub const LIVE_WORKERS: &str = "strata_master_live_workers";
/// Counter: workers declared lost after missing heartbeats.
pub const WORKERS_LOST: &str = "strata_master_workers_lost_total";
/// Counter, label `result` (`hit`/`miss`): metadata cache lookups.
pub const METADATA_CACHE: &str = "strata_master_metadata_cache_total";
/// Gauge: blocks in the block map.
pub const BLOCKS: &str = "strata_master_blocks";
/// Gauge: mounts in the mount table.
pub const MOUNTS: &str = "strata_master_mounts";
