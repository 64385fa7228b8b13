//! RDMA grants.
//!
//! `OpenBlock` asking for an RDMA grant reads the block range, places it in a region of
//! [`RegisteredMemory`] and answers a [`BlockGrant`] naming the region by `(addr, rkey)`; the
//! client then reads the bytes one-sided (an RDMA READ by its NIC, or — emulated — a
//! `RemoteRead` frame that this module answers the way a NIC would) and gives the lease back
//! with `Release`.
//!
//! Invariants:
//! - A region stays registered, unchanged, while its lease is live: the lease table
//!   ([`Leases`]) holds the region, and dropping it (release, or expiry swept by the next
//!   grant) is what frees or recycles the memory.
//! - A `RemoteRead` is served only from a live lease's region, only inside its bounds, and only
//!   with the region's rkey; anything else gets an error frame, never other memory. (A NIC
//!   enforces the same with the rkey and the MR bounds; the lease is our addition.)
//! - Registered memory is bounded (`[rdma] memory` bytes, `max_grants` leases): past either,
//!   grants are refused and the client reads over plain TCP.
//!
//! Two implementations of [`RegisteredMemory`]: [`EmulatedMemory`] (ordinary memory, always
//! built, `[rdma] mode = "emulated"`) and `verbs::VerbsMemory` (ibverbs, feature `rdma`,
//! `mode = "verbs"`). Both are served by the same code here; only the emulated one has ever run.

#[cfg(feature = "rdma")]
mod verbs;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use strata_common::frame::{RdmaEndpoint, RemoteRead};
use strata_common::{ErrorKind, SharedClock};
use thiserror::Error;

use super::lease::{Lease, LeaseError, Leases};
use crate::config::{RdmaConfig, RdmaMode};

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RdmaError {
    /// The registered-memory budget is spent: the client should read over TCP.
    #[error("{used} of {limit} registered bytes in use, {want} more asked")]
    MemoryExhausted { used: u64, want: u64, limit: u64 },
    #[error(transparent)]
    Lease(#[from] LeaseError),
    /// Opening the device, allocating or registering with it failed.
    #[cfg(feature = "rdma")]
    #[error("RDMA device: {0}")]
    Device(String),
    /// Emulated memory is read with `RemoteRead` frames; it has no queue pairs to connect.
    #[error("this worker's RDMA is emulated: read with RemoteRead frames")]
    NoQueuePairs,
    #[cfg(not(feature = "rdma"))]
    #[error("[rdma] mode = \"verbs\" needs a worker built with the `rdma` cargo feature")]
    NotBuilt,
}

/// A region of worker memory a remote peer can read, named by `(addr, rkey)`. Dropping the
/// last handle deregisters (or recycles) it.
pub(crate) trait Region: Send + Sync + 'static {
    /// The address a peer names in a READ (the region's first byte).
    fn addr(&self) -> u64;
    fn rkey(&self) -> u32;
    fn len(&self) -> u64;
    /// `len` bytes at `offset` of the region, as a READ returns them; the caller checked bounds.
    fn read(&self, offset: u64, len: u64) -> Bytes;
    /// The reader gave the lease back, so it has finished reading: the memory may be reused
    /// under the same key. (A lease that expires instead may still have a READ in flight, so
    /// its memory must be deregistered — its key invalidated — rather than reused.)
    fn mark_released(&self) {}
}

/// Where registered regions come from.
pub(crate) trait RegisteredMemory: Send + Sync + 'static {
    /// A region holding `bytes`: registered in place or copied into registered memory.
    fn register(&self, bytes: Bytes) -> Result<Arc<dyn Region>, RdmaError>;
    /// Bytes registered now.
    fn used(&self) -> u64;
    /// Connects a queue pair of this memory's device to a peer's, allowing it to READ regions;
    /// the returned value keeps the queue pair until dropped.
    fn connect(&self, remote: RdmaEndpoint) -> Result<(RdmaEndpoint, Box<dyn Send + Sync>), RdmaError> {
        let _ = remote;
        Err(RdmaError::NoQueuePairs)
    }
}

/// The grants of one worker: its registered memory and the leases that hold regions of it.
pub(crate) struct RdmaGrants {
    memory: Box<dyn RegisteredMemory>,
    leases: Leases<Arc<dyn Region>>,
    /// Which lease a region's rkey belongs to; entries of ended leases are pruned on grant.
    by_rkey: Mutex<HashMap<u32, u64>>,
}

/// A live grant: what the `BlockGrant` answer carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Granted {
    pub lease: Lease,
    pub addr: u64,
    pub rkey: u32,
    pub len: u64,
}

impl RdmaGrants {
    pub(crate) fn new(
        memory: Box<dyn RegisteredMemory>,
        ttl: Duration,
        max_grants: usize,
        clock: SharedClock,
    ) -> Self {
        Self { memory, leases: Leases::new(ttl, max_grants, clock), by_rkey: Mutex::new(HashMap::new()) }
    }

    /// The grants a worker configured with `config` serves; `None` when RDMA is off.
    pub(crate) fn from_config(config: &RdmaConfig, clock: SharedClock) -> Result<Option<Self>, RdmaError> {
        let memory: Box<dyn RegisteredMemory> = match config.mode {
            RdmaMode::Off => return Ok(None),
            RdmaMode::Emulated => Box::new(EmulatedMemory::new(config.memory)),
            #[cfg(feature = "rdma")]
            RdmaMode::Verbs => Box::new(verbs::VerbsMemory::open(config.memory)?),
            #[cfg(not(feature = "rdma"))]
            RdmaMode::Verbs => return Err(RdmaError::NotBuilt),
        };
        let ttl = Duration::from_millis(config.grant_ttl_ms);
        Ok(Some(Self::new(memory, ttl, config.max_grants.max(1), clock)))
    }

    fn by_rkey(&self) -> std::sync::MutexGuard<'_, HashMap<u32, u64>> {
        self.by_rkey.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `bytes` and leases the region.
    pub(crate) fn grant(&self, bytes: Bytes) -> Result<Granted, RdmaError> {
        // A region is registered before its lease exists; a lease limit hit afterwards drops
        // the region again, so nothing stays registered without a lease.
        let region = self.memory.register(bytes)?;
        let (addr, rkey, len) = (region.addr(), region.rkey(), region.len());
        let lease = self.leases.grant(region)?;
        let mut by_rkey = self.by_rkey();
        by_rkey.retain(|_, id| self.leases.get(*id).is_some());
        by_rkey.insert(rkey, lease.id);
        Ok(Granted { lease, addr, rkey, len })
    }

    /// Ends a lease; `false` when it was unknown or already over.
    pub(crate) fn release(&self, lease_id: u64) -> bool {
        if let Some(region) = self.leases.get(lease_id) {
            region.mark_released();
            let mut by_rkey = self.by_rkey();
            if by_rkey.get(&region.rkey()) == Some(&lease_id) {
                by_rkey.remove(&region.rkey());
            }
        }
        self.leases.release(lease_id)
    }

    /// What a NIC answers to a READ of `(addr, rkey, len)`: the bytes of a live region, or a
    /// refusal that names nothing of the memory.
    pub(crate) fn read(&self, rr: &RemoteRead) -> Result<Bytes, (ErrorKind, String)> {
        let lease_id = self.by_rkey().get(&rr.rkey).copied();
        let region = lease_id.and_then(|id| self.leases.get(id)).filter(|r| r.rkey() == rr.rkey);
        let Some(region) = region else {
            return Err((ErrorKind::PermissionDenied, format!("rkey {:#x} names no live grant", rr.rkey)));
        };
        let start = region.addr();
        let inside =
            rr.addr >= start && rr.addr.checked_add(rr.len).is_some_and(|end| end <= start + region.len());
        if !inside {
            return Err((
                ErrorKind::PermissionDenied,
                format!("{} bytes at {:#x} are outside the granted region", rr.len, rr.addr),
            ));
        }
        Ok(region.read(rr.addr - start, rr.len))
    }

    /// See [`RegisteredMemory::connect`].
    pub(crate) fn connect(
        &self,
        remote: RdmaEndpoint,
    ) -> Result<(RdmaEndpoint, Box<dyn Send + Sync>), RdmaError> {
        self.memory.connect(remote)
    }

    /// Leases held now (expired ones not yet swept included).
    pub(crate) fn held(&self) -> usize {
        self.leases.held()
    }

    /// Bytes registered now.
    pub(crate) fn registered_bytes(&self) -> u64 {
        self.memory.used()
    }
}

/// Ordinary memory standing in for registered memory: a region pins the block's `Bytes` (no
/// copy) and is named by the bytes' address and a random rkey. Bounded by a byte budget.
pub(crate) struct EmulatedMemory {
    budget: Arc<Budget>,
}

struct Budget {
    used: AtomicU64,
    limit: u64,
}

impl Budget {
    fn take(&self, want: u64) -> Result<(), RdmaError> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(want).filter(|&n| n <= self.limit)
            })
            .map(drop)
            .map_err(|used| RdmaError::MemoryExhausted { used, want, limit: self.limit })
    }

    fn give_back(&self, n: u64) {
        self.used.fetch_sub(n, Ordering::AcqRel);
    }
}

impl EmulatedMemory {
    pub(crate) fn new(limit: u64) -> Self {
        Self { budget: Arc::new(Budget { used: AtomicU64::new(0), limit }) }
    }
}

struct EmulatedRegion {
    bytes: Bytes,
    rkey: u32,
    budget: Arc<Budget>,
}

impl Region for EmulatedRegion {
    fn addr(&self) -> u64 {
        self.bytes.as_ptr() as u64
    }

    fn rkey(&self) -> u32 {
        self.rkey
    }

    fn len(&self) -> u64 {
        self.bytes.len() as u64
    }

    fn read(&self, offset: u64, len: u64) -> Bytes {
        self.bytes.slice(offset as usize..(offset + len) as usize)
    }
}

impl Drop for EmulatedRegion {
    fn drop(&mut self) {
        self.budget.give_back(self.bytes.len() as u64);
    }
}

impl RegisteredMemory for EmulatedMemory {
    fn register(&self, bytes: Bytes) -> Result<Arc<dyn Region>, RdmaError> {
        self.budget.take(bytes.len() as u64)?;
        // Unguessable like a device's key, so a stale or forged key does not hit a live region
        // by luck. A collision with a live region's key only makes the older grant unreadable
        // (refused: its reader falls back to TCP), never serves the wrong bytes.
        let rkey = (uuid::Uuid::new_v4().as_u128() as u32).max(1);
        Ok(Arc::new(EmulatedRegion { bytes, rkey, budget: self.budget.clone() }))
    }

    fn used(&self) -> u64 {
        self.budget.used.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use strata_common::clock::{ManualClock, system};

    fn grants(memory: u64, max: usize, ttl_ms: u64) -> RdmaGrants {
        RdmaGrants::new(Box::new(EmulatedMemory::new(memory)), Duration::from_millis(ttl_ms), max, system())
    }

    fn rr(g: &Granted, offset: u64, len: u64) -> RemoteRead {
        RemoteRead { req_id: 1, addr: g.addr + offset, rkey: g.rkey, len }
    }

    #[test]
    fn a_granted_region_is_read_inside_its_bounds_only() {
        let grants = grants(1 << 20, 8, 60_000);
        let data: Bytes = (0..=255u8).cycle().take(10_000).collect::<Vec<_>>().into();
        let g = grants.grant(data.clone()).unwrap();
        assert_eq!(g.len, 10_000);
        assert_eq!(grants.read(&rr(&g, 0, 10_000)).unwrap(), data);
        assert_eq!(grants.read(&rr(&g, 1234, 77)).unwrap(), data.slice(1234..1311));
        assert_eq!(grants.read(&rr(&g, 10_000, 0)).unwrap().len(), 0, "empty read at the end");
        for (addr, len) in
            [(g.addr + 9_999, 2), (g.addr - 1, 1), (g.addr + 10_001, 0), (g.addr, u64::MAX), (u64::MAX, 1)]
        {
            let err = grants.read(&RemoteRead { req_id: 1, addr, rkey: g.rkey, len }).unwrap_err();
            assert_eq!(err.0, ErrorKind::PermissionDenied, "{addr:#x}+{len}");
        }
        let wrong_key = RemoteRead { rkey: g.rkey.wrapping_add(1), ..rr(&g, 0, 1) };
        assert_eq!(grants.read(&wrong_key).unwrap_err().0, ErrorKind::PermissionDenied);
    }

    #[test]
    fn released_and_expired_grants_are_refused_and_give_their_memory_back() {
        let grants = grants(1 << 20, 8, 60_000);
        let g = grants.grant(Bytes::from(vec![7u8; 4096])).unwrap();
        assert_eq!((grants.held(), grants.registered_bytes()), (1, 4096));
        assert!(grants.release(g.lease.id));
        assert!(!grants.release(g.lease.id), "twice");
        assert_eq!((grants.held(), grants.registered_bytes()), (0, 0));
        assert_eq!(grants.read(&rr(&g, 0, 1)).unwrap_err().0, ErrorKind::PermissionDenied);

        let clock = ManualClock::new();
        let short = RdmaGrants::new(
            Box::new(EmulatedMemory::new(1 << 20)),
            Duration::from_millis(20),
            8,
            clock.clone(),
        );
        let old = short.grant(Bytes::from(vec![1u8; 100])).unwrap();
        clock.advance(Duration::from_millis(20));
        assert_eq!(short.read(&rr(&old, 0, 1)).unwrap_err().0, ErrorKind::PermissionDenied, "expired");
        let new = short.grant(Bytes::from(vec![2u8; 50])).unwrap();
        assert_eq!((short.held(), short.registered_bytes()), (1, 50), "the expired grant was swept");
        assert_eq!(short.read(&rr(&new, 0, 50)).unwrap(), Bytes::from(vec![2u8; 50]));
    }

    #[test]
    fn grants_beyond_the_memory_or_lease_limit_are_refused_and_register_nothing() {
        let grants = grants(10_000, 2, 60_000);
        let a = grants.grant(Bytes::from(vec![0u8; 6000])).unwrap();
        assert!(matches!(
            grants.grant(Bytes::from(vec![0u8; 6000])),
            Err(RdmaError::MemoryExhausted { used: 6000, want: 6000, limit: 10_000 })
        ));
        grants.grant(Bytes::from(vec![0u8; 100])).unwrap();
        assert!(matches!(grants.grant(Bytes::from(vec![0u8; 1])), Err(RdmaError::Lease(_))));
        assert_eq!(grants.registered_bytes(), 6100, "the refused region was dropped");
        grants.release(a.lease.id);
        assert!(grants.grant(Bytes::from(vec![0u8; 6000])).is_ok());
    }

    #[test]
    fn the_rdma_table_parses_and_rejects_unknown_modes_and_fields() {
        let c: crate::WorkerConfig = toml::from_str("[rdma]\nmode = \"emulated\"\nmax_grants = 4").unwrap();
        assert_eq!(c.rdma, RdmaConfig { mode: RdmaMode::Emulated, max_grants: 4, ..RdmaConfig::default() });
        assert_eq!(crate::WorkerConfig::default().rdma.mode, RdmaMode::Off);
        assert!(toml::from_str::<crate::WorkerConfig>("[rdma]\nmode = \"fast\"").is_err());
        assert!(toml::from_str::<crate::WorkerConfig>("[rdma]\nttl = 5").is_err());
    }

    #[test]
    fn config_off_builds_nothing_and_verbs_needs_the_feature() {
        assert!(RdmaGrants::from_config(&RdmaConfig::default(), system()).unwrap().is_none());
        let emulated = RdmaConfig { mode: RdmaMode::Emulated, ..RdmaConfig::default() };
        assert!(RdmaGrants::from_config(&emulated, system()).unwrap().is_some());
        #[cfg(not(feature = "rdma"))]
        {
            let verbs = RdmaConfig { mode: RdmaMode::Verbs, ..RdmaConfig::default() };
            assert!(matches!(RdmaGrants::from_config(&verbs, system()), Err(RdmaError::NotBuilt)));
        }
    }
}
