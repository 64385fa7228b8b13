//! The worker's own counters (besides the metrics, which are process-wide): what a heartbeat
//! reports to the master and what tests assert on, per worker even when several run in one
//! process.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Default)]
pub struct Counters {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub ufs_reads: AtomicU64,
    pub ufs_bytes: AtomicU64,
    pub bytes_served: AtomicU64,
    /// Blocks a sidecar got from its upstream (the cluster) instead of the UFS.
    pub upstream_reads: AtomicU64,
    /// Bytes served as NVMe file regions rather than through memory.
    pub zero_copy_bytes: AtomicU64,
    /// Writes through this worker that were committed to the UFS, and those that ended
    /// without a commit (the client went away or failed; the old file stays).
    pub writes_committed: AtomicU64,
    pub writes_aborted: AtomicU64,
    /// Cold reads answered as their block arrived (cut-through), and those of them cut off
    /// because the fetch failed after the answer began.
    pub cut_through_reads: AtomicU64,
    pub cut_through_aborts: AtomicU64,
}

/// The counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CounterSnapshot {
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub ufs_reads: u64,
    pub ufs_bytes_read: u64,
    pub bytes_served: u64,
    pub upstream_reads: u64,
    pub zero_copy_bytes: u64,
    pub writes_committed: u64,
    pub writes_aborted: u64,
    pub cut_through_reads: u64,
    pub cut_through_aborts: u64,
    pub corrupt_blocks: u64,
}

impl Counters {
    pub fn snapshot(&self, corrupt_blocks: u64) -> CounterSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CounterSnapshot {
            cache_hits: get(&self.hits),
            cache_misses: get(&self.misses),
            ufs_reads: get(&self.ufs_reads),
            ufs_bytes_read: get(&self.ufs_bytes),
            bytes_served: get(&self.bytes_served),
            upstream_reads: get(&self.upstream_reads),
            zero_copy_bytes: get(&self.zero_copy_bytes),
            writes_committed: get(&self.writes_committed),
            writes_aborted: get(&self.writes_aborted),
            cut_through_reads: get(&self.cut_through_reads),
            cut_through_aborts: get(&self.cut_through_aborts),
            corrupt_blocks,
        }
    }
}
