//! What workers tell the master about themselves — tier usage, counters, the blocks they hold —
//! in the master's own types. The state machines (`membership.rs`, `blockmap.rs`) take these;
//! only the gRPC adapter (`rpc.rs`) knows their protobuf form.

/// A worker's storage tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Tier {
    /// Not said, or a tier this master does not know (a newer worker).
    #[default]
    Unspecified,
    Memory,
    Nvme,
}

/// Capacity and use of one tier of a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TierUsage {
    pub tier: Tier,
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub blocks: u64,
    /// The limit a full disk holds the tier at, below its capacity.
    pub full_limit: Option<u64>,
    /// Block writes refused by the tier's disk: ENOSPC, EDQUOT, other I/O errors.
    pub write_errors: [u64; 3],
}

/// A worker's cumulative counters, as of its last heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WorkerCounters {
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub ufs_reads: u64,
    pub ufs_bytes_read: u64,
    pub bytes_served: u64,
    pub corrupt_blocks: u64,
}

impl WorkerCounters {
    pub fn add(&mut self, o: &WorkerCounters) {
        self.cache_hits += o.cache_hits;
        self.cache_misses += o.cache_misses;
        self.ufs_reads += o.ufs_reads;
        self.ufs_bytes_read += o.ufs_bytes_read;
        self.bytes_served += o.bytes_served;
        self.corrupt_blocks += o.corrupt_blocks;
    }
}

/// One block a worker gained or dropped, on one tier.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BlockReport {
    pub file_id: String,
    pub version: String,
    pub index: u64,
    pub tier: Tier,
}
