//! Every metric the master emits, declared once (listed in docs/METRICS.md).

/// Counter, label `rpc`: control-plane requests served.
pub const RPC_REQUESTS: &str = "strata_master_rpc_requests_total";
/// Counter, labels `rpc`, `kind`: control-plane requests that failed.
pub const RPC_ERRORS: &str = "strata_master_rpc_errors_total";
/// Counter, labels `rpc` (the method, or `path_scope`), `reason` (`missing`, `unknown`,
/// `malformed`, `role`, `scope`): calls refused by the token check.
pub const AUTH_REFUSED: &str = "strata_master_auth_refused_total";
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
/// Counter: load jobs submitted (by hand or by a schedule).
pub const JOBS_SUBMITTED: &str = "strata_master_jobs_submitted_total";
/// Counter, label `state` (`JOB_STATE_SUCCEEDED`/`_FAILED`/`_CANCELLED`): load jobs that ended.
pub const JOBS_FINISHED: &str = "strata_master_jobs_finished_total";
/// Counter: block load tasks handed to workers (a retried task counts again).
pub const LOAD_TASKS_ASSIGNED: &str = "strata_master_load_tasks_assigned_total";
/// Gauge: write-back files acknowledged and not yet in the UFS.
pub const WRITEBACK_PENDING_FILES: &str = "strata_master_writeback_pending_files";
/// Gauge: bytes of those files.
pub const WRITEBACK_PENDING_BYTES: &str = "strata_master_writeback_pending_bytes";
/// Gauge: seconds since the oldest of them was acknowledged (0 when none is pending).
pub const WRITEBACK_OLDEST_PENDING: &str = "strata_master_writeback_oldest_pending_seconds";
/// Counter, label `result` (`persisted`, `failed`): write-back uploads that ended.
pub const WRITEBACK_UPLOADS: &str = "strata_master_writeback_uploads_total";
/// Gauge, label `tier` (`memory`/`nvme`): pins in force.
pub const PINS: &str = "strata_master_pins";
/// Gauge, label `tier`: bytes under those pins when they were made.
pub const PINNED_BYTES: &str = "strata_master_pinned_bytes";
/// Gauge: lineage records kept (one job's reads of one file version after one mark).
pub const LINEAGE_RECORDS: &str = "strata_master_lineage_records";
/// Counter: lineage reports merged (one per client flush).
pub const LINEAGE_REPORTS: &str = "strata_master_lineage_reports_total";
/// Counter, label `why` (`retention`, `max_records`): lineage records forgotten.
pub const LINEAGE_DROPPED: &str = "strata_master_lineage_dropped_total";
/// Counter: lineage reports received again after they were applied (a client's retry after a
/// lost answer), answered without counting their reads twice.
pub const LINEAGE_REPEATED_REPORTS: &str = "strata_master_lineage_repeated_reports_total";
/// Counter: frees queued (`strata free`).
pub const FREES: &str = "strata_master_frees_total";
