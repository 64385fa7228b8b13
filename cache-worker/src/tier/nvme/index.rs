//! The in-memory index of an NVMe tier: a slot per key — `Ready`, with its size, generation and
//! where it is stored, or `Busy` while a write or a delete of its storage is in flight — the
//! ready blocks' S3-FIFO order, the bytes reserved by puts in flight, the event log, the
//! containers' live counts, and the limit a full disk set. Bookkeeping only: nothing here does
//! file I/O, which is what lets the tier hold the index lock briefly and never across I/O (see
//! the parent module's invariants).

use std::collections::HashMap;
use std::fs::File;
use std::sync::Arc;
use std::time::Instant;

use strata_common::BlockKey;

#[cfg(doc)]
use super::NvmeTier;
use super::{FULL_RETRY, pack};
use crate::tier::{S3Fifo, TierEvent};

/// Where a packed entry starts: its container and the offset of its header there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PackAt {
    pub(super) container: u32,
    pub(super) offset: u64,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Ready {
    pub(super) size: u64,
    pub(super) generation: u64,
    /// The file's data is known to match its checksum: this process wrote it from memory, or
    /// read and checked it since the tier opened. Only such blocks are served without a check
    /// ([`NvmeTier::open_verified`]).
    pub(super) verified: bool,
    /// An entry of a container, not a file of its own.
    pub(super) packed: Option<PackAt>,
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Slot {
    Ready(Ready),
    /// A write or a delete of the key's file is in flight.
    Busy,
}

/// A container file and what of it is live.
#[derive(Debug)]
pub(super) struct Container {
    pub(super) file: Arc<File>,
    /// Bytes appended (the file's length once sealed).
    pub(super) len: u64,
    /// Header and data bytes of the ready entries in it.
    pub(super) live_bytes: u64,
    pub(super) live_entries: u64,
    /// No more appends: a newer container took over.
    pub(super) sealed: bool,
}

impl Container {
    pub(super) fn dead_bytes(&self) -> u64 {
        self.len.saturating_sub(self.live_bytes)
    }
}

pub(super) struct Index {
    pub(super) slots: HashMap<BlockKey, Slot>,
    /// The ready blocks' eviction order.
    pub(super) policy: S3Fifo<BlockKey>,
    pub(super) next_generation: u64,
    pub(super) reserved: u64,
    pub(super) events: Vec<TierEvent>,
    /// The limit a full disk set (below the capacity), and when the disk was last found full.
    pub(super) full: Option<(u64, Instant)>,
    pub(super) containers: HashMap<u32, Container>,
    pub(super) next_container: u32,
}

impl Index {
    pub(super) fn new(capacity: u64) -> Self {
        Self {
            slots: HashMap::new(),
            policy: S3Fifo::new(capacity),
            next_generation: 0,
            reserved: 0,
            events: Vec::new(),
            full: None,
            containers: HashMap::new(),
            next_container: 0,
        }
    }

    /// The most bytes the tier may hold now: the capacity, or less while the disk is full.
    pub(super) fn limit(&mut self, capacity: u64, now: Instant) -> u64 {
        match self.full {
            Some((limit, at)) if now.duration_since(at) < FULL_RETRY => limit.min(capacity),
            Some(_) => {
                self.full = None;
                capacity
            }
            None => capacity,
        }
    }

    /// Counts a hit on a ready block.
    pub(super) fn touch(&mut self, key: &BlockKey) -> Option<Ready> {
        let Some(Slot::Ready(ready)) = self.slots.get(key) else {
            return None;
        };
        self.policy.touch(key);
        Some(*ready)
    }

    pub(super) fn insert_ready(&mut self, key: BlockKey, size: u64, verified: bool, packed: Option<PackAt>) {
        self.policy.insert(key.clone(), size);
        self.publish(key, size, verified, packed);
    }

    /// A block found by `open`: it was kept before the restart, so it starts in the policy's
    /// main queue (see [`NvmeTier::open`]).
    pub(super) fn insert_recovered(&mut self, key: BlockKey, size: u64, packed: Option<PackAt>) {
        self.policy.insert_main(key.clone(), size);
        self.publish(key, size, false, packed);
    }

    fn publish(&mut self, key: BlockKey, size: u64, verified: bool, packed: Option<PackAt>) {
        let ready = Ready { size, generation: self.bump_generation(), verified, packed };
        self.events.push(TierEvent::Added { key: key.clone(), size });
        self.slots.insert(key, Slot::Ready(ready));
    }

    pub(super) fn bump_generation(&mut self) -> u64 {
        let generation = self.next_generation;
        self.next_generation += 1;
        generation
    }

    /// Takes a ready block out of service, leaving its slot `Busy` for the caller to delete the
    /// file (or mark the entry dead) and then [`clear_busy`](Self::clear_busy).
    pub(super) fn retire(&mut self, key: &BlockKey) -> Option<Ready> {
        let slot = self.slots.get_mut(key)?;
        let Slot::Ready(ready) = *slot else {
            return None;
        };
        *slot = Slot::Busy;
        // A no-op for an eviction: `victims` already took the key out of the policy.
        self.policy.remove(key);
        self.events.push(TierEvent::Removed { key: key.clone() });
        if let Some(at) = ready.packed {
            self.uncount(at.container, key, ready.size);
        }
        Some(ready)
    }

    /// An entry of `key` left container `seq` (retired or moved).
    pub(super) fn uncount(&mut self, seq: u32, key: &BlockKey, size: u64) {
        if let Some(c) = self.containers.get_mut(&seq) {
            c.live_bytes = c.live_bytes.saturating_sub(pack::entry_len(key, size));
            c.live_entries = c.live_entries.saturating_sub(1);
        }
    }

    pub(super) fn clear_busy(&mut self, key: &BlockKey) {
        if matches!(self.slots.get(key), Some(Slot::Busy)) {
            self.slots.remove(key);
        }
    }

    pub(super) fn ready_generation(&self, key: &BlockKey) -> Option<u64> {
        match self.slots.get(key) {
            Some(Slot::Ready(ready)) => Some(ready.generation),
            _ => None,
        }
    }

    /// The file of a packed entry's container.
    pub(super) fn container_file(&self, at: PackAt) -> Option<Arc<File>> {
        self.containers.get(&at.container).map(|c| Arc::clone(&c.file))
    }

    /// Takes a sealed container with no ready entry out of the table; the caller deletes its
    /// file.
    pub(super) fn take_if_empty(&mut self, seq: u32) -> bool {
        let empty = self.containers.get(&seq).is_some_and(|c| c.sealed && c.live_entries == 0);
        if empty {
            self.containers.remove(&seq);
        }
        empty
    }

    pub(super) fn dead_bytes(&self) -> u64 {
        self.containers.values().map(Container::dead_bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_set_by_a_full_disk_lapses_after_the_retry_period() {
        let t0 = Instant::now();
        let mut index = Index::new(100);
        assert_eq!(index.limit(100, t0), 100);
        index.full = Some((40, t0));
        assert_eq!(index.limit(100, t0 + FULL_RETRY / 2), 40);
        assert_eq!(index.limit(100, t0 + FULL_RETRY), 100, "the capacity is tried again");
        assert!(index.full.is_none());
    }
}
