//! Every metric the worker emits, declared once (listed in docs/METRICS.md).

/// Counter, label `tier` (`memory`/`nvme`): block reads served from a tier.
pub const CACHE_HITS: &str = "strata_worker_cache_hits_total";
/// Counter: block reads that found the block in no tier.
pub const CACHE_MISSES: &str = "strata_worker_cache_misses_total";
/// Counter: range reads sent to the UFS (one per fetched block).
pub const UFS_READS: &str = "strata_worker_ufs_reads_total";
/// Counter, bytes: read from the UFS.
pub const UFS_BYTES: &str = "strata_worker_ufs_bytes_total";
/// Counter, label `kind`: UFS fetches that failed.
pub const UFS_ERRORS: &str = "strata_worker_ufs_errors_total";
/// Counter, bytes: payload bytes sent to clients.
pub const BYTES_SERVED: &str = "strata_worker_bytes_served_total";
/// Counter, label `tier`: blocks that failed validation (checksum, header) and were dropped.
pub const CORRUPT_BLOCKS: &str = "strata_worker_corrupt_blocks_total";
/// Counter, label `reason` (`no_space`: ENOSPC, `quota`: EDQUOT, `io`: any other failure):
/// NVMe block writes that failed. A full disk also lowers the tier's limit (see `strata status`).
pub const NVME_WRITE_ERRORS: &str = "strata_worker_nvme_write_errors_total";
/// Counter: appends to the NVMe tier's packed containers (one per batch of small blocks).
pub const NVME_PACKED_APPENDS: &str = "strata_worker_nvme_packed_appends_total";
/// Counter: small blocks written into packed containers (entries appended).
pub const NVME_PACKED_ENTRIES: &str = "strata_worker_nvme_packed_entries_total";
/// Counter: packed containers compaction deleted (after moving their live entries).
pub const NVME_COMPACTED_CONTAINERS: &str = "strata_worker_nvme_compacted_containers_total";
/// Counter: live entries compaction moved to another container.
pub const NVME_COMPACTED_ENTRIES: &str = "strata_worker_nvme_compacted_entries_total";
/// Counter, labels `tier` and `reason` (`watermark`: the tier was above its high watermark,
/// `ttl`: the mount's `cache_ttl` passed, `quota`: the mount was over its quota share): blocks
/// the worker's background upkeep evicted.
pub const UPKEEP_EVICTED_BLOCKS: &str = "strata_worker_upkeep_evicted_blocks_total";
/// Counter, bytes, labels `tier` and `reason` as above: bytes the background upkeep evicted.
pub const UPKEEP_EVICTED_BYTES: &str = "strata_worker_upkeep_evicted_bytes_total";
/// Counter, label `result` (`fetched`, `cached`, `failed`, `dropped`, `hit`, `late`): blocks of
/// the prefetch lane (docs/PYTHON.md, "Prefetch"): fetched ahead of the reader, already held,
/// failed, dropped before they started (the reader's window moved on), read after the lane
/// fetched them, or read before the lane got to them.
pub const PREFETCH: &str = "strata_worker_prefetch_total";
/// Counter, labels `class` (`latency`, `throughput`, `background`: the client's `STRATA_QOS`)
/// and `queued` (`true` when it waited for a place): answers to clients by request class.
pub const QOS_REQUESTS: &str = "strata_worker_qos_requests_total";
/// Histogram, seconds, label `class`: how long an answer waited for a place (queued ones).
pub const QOS_WAIT_SECONDS: &str = "strata_worker_qos_wait_seconds";
/// Counter, labels `class` and `queued`: client reads' UFS fetches by request class, and
/// whether they waited for one of the `ufs_fetch_slots` places.
pub const QOS_UFS_FETCHES: &str = "strata_worker_qos_ufs_fetches_total";
/// Histogram, seconds, label `class`: how long a UFS fetch waited for a place (queued ones).
pub const QOS_UFS_FETCH_WAIT_SECONDS: &str = "strata_worker_qos_ufs_fetch_wait_seconds";
/// Counter: latency-class connections moved to the latency lane's thread of their own.
pub const QOS_LANE_CONNECTIONS: &str = "strata_worker_qos_lane_connections_total";
/// Counter: `ReadMany` requests (many block ranges in one round trip) served.
pub const READ_MANY_REQUESTS: &str = "strata_worker_read_many_requests_total";
/// Counter: block ranges asked in `ReadMany` requests (each answered as a block read is).
pub const READ_MANY_ITEMS: &str = "strata_worker_read_many_items_total";
/// Counter, label `kind`: requests answered with an error frame.
pub const REQUEST_ERRORS: &str = "strata_worker_request_errors_total";
/// Counter, label `kind` (`unauthenticated`, `permission_denied`, `unavailable`: tokens not
/// learnt yet): data-plane connections closed by the token check before serving anything.
pub const AUTH_REFUSED: &str = "strata_worker_auth_refused_total";
/// Counter: cold block reads whose answer began before the block's last byte arrived from the
/// UFS (cut-through).
pub const CUT_THROUGH_READS: &str = "strata_worker_cut_through_reads_total";
/// Counter: cut-through answers cut off (their connection closed) because the fetch failed
/// after the answer began; the client sees a broken connection, never a short or wrong block.
pub const CUT_THROUGH_ABORTS: &str = "strata_worker_cut_through_aborts_total";
/// Histogram, seconds: time to serve one block read, label `source`.
pub const READ_SECONDS: &str = "strata_worker_read_seconds";
/// Gauge, bytes, label `tier`: bytes held.
pub const TIER_USED_BYTES: &str = "strata_worker_tier_used_bytes";
/// Counter: heartbeats that failed to reach the master.
pub const HEARTBEAT_FAILURES: &str = "strata_worker_heartbeat_failures_total";
/// Counter: blocks a sidecar fetched from the cluster's workers instead of the UFS.
pub const UPSTREAM_READS: &str = "strata_worker_upstream_reads_total";
/// Counter, bytes: fetched by a sidecar from the cluster's workers.
pub const UPSTREAM_BYTES: &str = "strata_worker_upstream_bytes_total";
/// Counter: sidecar fetches from the cluster that failed and went to the UFS instead.
pub const UPSTREAM_ERRORS: &str = "strata_worker_upstream_errors_total";
/// Counter, label `result` (`loaded`/`cached`/`failed`): warmup block loads.
pub const LOAD_BLOCKS: &str = "strata_worker_load_blocks_total";
/// Counter, bytes: fetched from the UFS by warmup loads.
pub const LOAD_BYTES: &str = "strata_worker_load_bytes_total";
/// Counter: warmup loads that waited for client reads to go quiet.
pub const LOAD_YIELDS: &str = "strata_worker_load_yields_total";
/// Gauge: warmup loads allowed in flight (the adaptive window).
pub const LOAD_WINDOW: &str = "strata_worker_load_window";
/// Counter, label `kind` (`file`/`shm`): short-circuit grants (a passed descriptor).
pub const SHORT_CIRCUIT_GRANTS: &str = "strata_worker_short_circuit_grants_total";
/// Counter, bytes: copied into shared memory for short-circuit grants of DRAM blocks.
pub const SHORT_CIRCUIT_SHM_BYTES: &str = "strata_worker_short_circuit_shm_bytes_total";
/// Gauge: short-circuit leases held.
pub const SHORT_CIRCUIT_LEASES: &str = "strata_worker_short_circuit_leases";
/// Counter, bytes: sent from verified NVMe block files with `sendfile`, never copied through
/// the worker's memory.
pub const ZERO_COPY_BYTES: &str = "strata_worker_zero_copy_bytes_total";
/// Counter, label `result` (`granted`/`refused`): RDMA grants (`OpenBlock` on TCP) answered.
pub const RDMA_GRANTS: &str = "strata_worker_rdma_grants_total";
/// Counter, label `result` (`committed`/`aborted`/`refused`): writes through this worker.
pub const WRITES: &str = "strata_worker_writes_total";
/// Gauge: data-plane connections open (TCP on a worker, the Unix socket on a sidecar).
pub const CONNECTIONS_OPEN: &str = "strata_worker_connections_open";
/// Counter, label `reason` (`max_connections`/`per_peer`/`peer_uid`): data-plane connections
/// refused at accept with an error frame.
pub const CONNECTIONS_REFUSED: &str = "strata_worker_connections_refused_total";
/// Counter, label `phase` (`frame`/`idle`/`write`): data-plane connections closed because the
/// peer stalled mid-frame, stayed idle too long, or did not take a response.
pub const CONNECTION_TIMEOUTS: &str = "strata_worker_connection_timeouts_total";
/// Gauge: bytes of write-back journals this worker holds (acknowledged, not yet dropped).
pub const WRITEBACK_JOURNAL_BYTES: &str = "strata_worker_writeback_journal_bytes";
/// Gauge: write-back journals this worker holds.
pub const WRITEBACK_JOURNALS: &str = "strata_worker_writeback_journals";
/// Counter: bytes this worker uploaded from write-back journals to the UFS (the upload rate).
pub const WRITEBACK_UPLOADED_BYTES: &str = "strata_worker_writeback_uploaded_bytes_total";
/// Counter, label `result` (`persisted`, `retried`, `failed`): upload attempts that ended.
pub const WRITEBACK_UPLOADS: &str = "strata_worker_writeback_uploads_total";
/// Counter, label `fallback` (`refused`, `write-through`): write-back writes whose journal
/// disk was full.
pub const WRITEBACK_DISK_FULL: &str = "strata_worker_writeback_disk_full_total";
/// Counter, label `direction` (`sent`/`received`): blocks handed off to their new owner after a
/// ring change or during a drain (see docs/CACHE_CONTROL.md, "When the ring changes").
pub const HANDOFF_BLOCKS: &str = "strata_worker_handoff_blocks_total";
/// Counter, bytes, label `direction` (`sent`/`received`): bytes of handed-off blocks.
pub const HANDOFF_BYTES: &str = "strata_worker_handoff_bytes_total";
/// Counter: blocks offered to this worker that it declined because its hand-off queue was full
/// (they are fetched on demand later, from the previous owner first).
pub const HANDOFF_DROPPED: &str = "strata_worker_handoff_dropped_offers_total";
