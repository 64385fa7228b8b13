//! Block tiers: DRAM and NVMe, each bounded in bytes with S3-FIFO eviction ([`policy`]: a scan
//! larger than the tier does not flush what is read again) that passes over pinned blocks (a
//! [`PinFilter`] names them).
//!
//! The contract every tier keeps:
//! - `get` never returns bytes that differ from what `put` stored under that key: the NVMe tier
//!   checks a header (key, length) and a CRC32C of the data on every read; a mismatch deletes
//!   the block, counts it in `corrupt_blocks`, and is reported as a miss (`Ok(None)`).
//! - a block that `put` returned `Ok` for is in the tier (on disk for NVMe) until it is evicted,
//!   and every insertion and eviction is visible through [`Tier::drain_events`], which the
//!   worker turns into block reports for the master.
//! - the NVMe tier survives a restart: [`NvmeTier::open`] rebuilds its index from the block
//!   files' headers and the packed containers' entries, discarding temporary and malformed files
//!   and torn container tails.
//! - a block put with [`PutParams::packed`] (a small file's) is stored like any other as far as
//!   this contract goes; the NVMe tier keeps it as an entry of a shared container file instead
//!   of a file of its own (see `nvme`), so many small blocks cost one file and one write.
//!
//! `conformance` (tests only) checks this contract, through the trait alone, against every tier.

#[cfg(test)]
mod conformance;
mod memory;
mod nvme;
pub mod policy;

use async_trait::async_trait;
use bytes::Bytes;
use strata_common::BlockKey;
use thiserror::Error;

pub use memory::MemoryTier;
pub use nvme::NvmeTier;
pub use policy::S3Fifo;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TierError {
    #[error("tier I/O failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("block of {size} bytes does not fit a tier of {capacity} bytes")]
    TooLarge { size: u64, capacity: u64 },
    /// The disk under the tier is full (ENOSPC, or EDQUOT when `quota`), even after evicting to
    /// make room: the tier holds at most `held` bytes for now.
    #[error("the disk under the tier is full ({}): no room for a block of {size} bytes beside the {held} bytes it holds", if *quota { "EDQUOT, a quota" } else { "ENOSPC" })]
    DiskFull { size: u64, held: u64, quota: bool },
    /// Only pinned blocks could make room: nothing was evicted.
    #[error("no room for a block of {size} bytes: {pinned} of the tier's {capacity} bytes are pinned")]
    Pinned { size: u64, pinned: u64, capacity: u64 },
}

pub type Result<T> = std::result::Result<T, TierError>;

/// How a block is to be kept.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct PutParams {
    /// A block of a small file (below its mount's `pack_threshold`): the NVMe tier packs it
    /// with others into a container file, written in one append with the rest of its batch,
    /// instead of a file of its own. Tiers without files ignore it.
    pub packed: bool,
}

/// One block of a [`Tier::put_many`].
#[derive(Debug, Clone)]
pub struct BlockPut {
    pub key: BlockKey,
    pub data: Bytes,
    pub params: PutParams,
}

/// What one [`Tier::compact`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Compacted {
    /// Container files rewritten (their live entries moved) or deleted.
    pub containers: u64,
    /// Live entries moved to another container.
    pub moved: u64,
    /// Bytes of the containers' files given back to the disk.
    pub reclaimed_bytes: u64,
}

/// Where a block's data sits in its own file, for serving it without copying it through memory
/// (`sendfile`, a descriptor passed to a co-located client): the file holds this block alone
/// and is never modified — replaced by rename or deleted.
#[derive(Debug)]
pub struct FileSpan {
    pub file: std::fs::File,
    /// Offset and length of the block's data in the file.
    pub offset: u64,
    pub len: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TierKind {
    Memory,
    Nvme,
}

impl TierKind {
    pub fn label(self) -> &'static str {
        match self {
            TierKind::Memory => "memory",
            TierKind::Nvme => "nvme",
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierUsage {
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub blocks: u64,
}

/// What a tier's disk did to its writes: failures by reason, and the lower limit a full disk
/// set (`None`: the configured capacity holds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiskHealth {
    pub limit_bytes: Option<u64>,
    /// Writes refused with ENOSPC.
    pub no_space_errors: u64,
    /// Writes refused with EDQUOT.
    pub quota_errors: u64,
    /// Writes that failed otherwise (EIO, a read-only remount...).
    pub io_errors: u64,
}

/// What one [`Tier::evict`] took out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Evicted {
    pub blocks: u64,
    pub bytes: u64,
}

/// Names the blocks a [`Tier::evict`] may take.
pub type Among<'a> = &'a (dyn Fn(&BlockKey) -> bool + Send + Sync);

/// A change of a tier's contents, for the master's block map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TierEvent {
    Added { key: BlockKey, size: u64 },
    Removed { key: BlockKey },
}

/// Told of every block a tier evicts to make room (not of removals), with its bytes. It runs
/// under the tier's lock, so it must be quick and must not call back into the tier.
pub type EvictionSink = Box<dyn Fn(&BlockKey, &Bytes) + Send + Sync>;

/// Says whether a block is pinned in a tier: eviction passes over it, and a `put` that only
/// pinned blocks could make room for is refused with [`TierError::Pinned`] without evicting
/// anything. It runs under the tier's lock, so it must be quick and must not call back into
/// the tier. What is pinned may change from one call to the next (the filter reads a shared pin
/// set); a block unpinned is evictable again at the next `put`. `remove` ignores pins.
pub type PinFilter = std::sync::Arc<dyn Fn(&BlockKey) -> bool + Send + Sync>;

#[async_trait]
pub trait Tier: Send + Sync + 'static {
    fn kind(&self) -> TierKind;
    /// The block's bytes, or `None` on a miss (including a corrupt block, which is dropped).
    async fn get(&self, key: &BlockKey) -> Result<Option<Bytes>>;
    /// Bytes `range` of the block (within it), or `None` on a miss. A tier that can check part
    /// of a block (the NVMe tier's chunk checksums) reads and checks only what the range
    /// needs; a corrupt part drops the block as `get` does.
    async fn get_range(&self, key: &BlockKey, range: std::ops::Range<u64>) -> Result<Option<Bytes>> {
        Ok(self.get(key).await?.map(|b| b.slice(range.start as usize..range.end as usize)))
    }
    /// Stores a block, evicting blocks by S3-FIFO to make room. A block larger than
    /// the capacity is refused with `TooLarge`; a capacity of 0 disables the tier (every `put`
    /// is refused that way, every `get` misses).
    async fn put(&self, key: &BlockKey, data: Bytes) -> Result<()>;
    /// [`put`](Self::put) with how the block is to be kept.
    async fn put_with(&self, key: &BlockKey, data: Bytes, _params: PutParams) -> Result<()> {
        self.put(key, data).await
    }
    /// Stores many blocks; one result per block, in order, each as `put_with` would give it.
    /// The NVMe tier writes the packed ones of the batch in one append.
    async fn put_many(&self, blocks: Vec<BlockPut>) -> Vec<Result<()>> {
        let mut out = Vec::with_capacity(blocks.len());
        for b in blocks {
            out.push(self.put_with(&b.key, b.data, b.params).await);
        }
        out
    }
    /// Rewrites or deletes storage whose blocks are mostly gone (the NVMe tier's packed
    /// containers), within a bounded amount of work per call; the worker's upkeep calls it.
    async fn compact(&self) -> Result<Compacted> {
        Ok(Compacted::default())
    }
    async fn remove(&self, key: &BlockKey) -> Result<()>;
    /// Evicts, in the tier's eviction order and passing over pinned blocks, at least `bytes`
    /// bytes of the blocks `among` names (every one of them when they hold less), as a put
    /// making room would (the eviction sink is told). The worker's upkeep calls it: a tier
    /// above its high watermark, a mount above its quota. A tier without an eviction order
    /// evicts nothing.
    async fn evict(&self, _bytes: u64, _among: Among<'_>) -> Result<Evicted> {
        Ok(Evicted::default())
    }
    fn contains(&self, key: &BlockKey) -> bool;
    fn usage(&self) -> TierUsage;
    /// Every block held now, with its size (for a full block report).
    fn keys(&self) -> Vec<(BlockKey, u64)>;
    /// Events since the previous call, oldest first.
    fn drain_events(&self) -> Vec<TierEvent>;
    /// A block's file opened for zero-copy serving, with where its data sits, when the tier
    /// keeps blocks in files and this one's checksum is known good; `None` sends the caller to
    /// [`get`](Self::get).
    fn open_verified(&self, _key: &BlockKey) -> Option<FileSpan> {
        None
    }
    /// Installs the sink told of evictions; `false` when the tier does not support one (or
    /// already has one).
    fn set_eviction_sink(&self, _sink: EvictionSink) -> bool {
        false
    }
    /// Installs the filter that says which blocks are pinned; `false` when the tier does not
    /// support one (or already has one).
    fn set_pin_filter(&self, _filter: PinFilter) -> bool {
        false
    }
    /// A block's bytes without counting as a hit (so eviction is not affected); `None` on a
    /// miss or where looking costs I/O.
    fn peek(&self, _key: &BlockKey) -> Option<Bytes> {
        None
    }
    /// The block's recent hits as its eviction policy counts them (S3-FIFO's 0 to 3: hits since
    /// it was stored, less one per pass of the main queue over it); 0 for an absent block or a
    /// tier that does not count.
    fn hits(&self, _key: &BlockKey) -> u8 {
        0
    }
    /// Corrupt blocks detected (and dropped) since start.
    fn corrupt_blocks(&self) -> u64 {
        0
    }
    /// Write failures since start and whether a full disk lowered the limit; a tier without a
    /// disk has none.
    fn disk_health(&self) -> DiskHealth {
        DiskHealth::default()
    }
}
