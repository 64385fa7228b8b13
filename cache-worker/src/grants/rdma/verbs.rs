//! Registered memory on a real RDMA device through the `ibverbs` crate (feature `rdma`).
//!
//! **Compiled in CI, never run**: the machines this was written on have no RDMA device
//! (`ibverbs::devices()` fails). The protocol around it — grants, leases, bounds, release,
//! expiry, fallback — is the one the emulated memory runs through every test.
//!
//! Memory: a pool of registered buffers in power-of-two size classes (64 KiB and up),
//! registered once and recycled, because registering pins pages and is too slow for the read
//! path. A grant copies the block range into a free buffer; the buffer goes back to the pool
//! when the client releases the lease (its READ is complete by then). A lease that expires is
//! different — the client may still have a READ in flight — so its buffer is deregistered, which
//! invalidates the rkey: a late READ fails at the NIC instead of reading whatever block the
//! buffer holds next. The pool registers at most `[rdma] memory` bytes.
//!
//! Access: `ibverbs` registers every buffer with remote read *and write* (its only
//! `allocate`); the queue pairs this worker connects allow remote READ only, so a peer's WRITE
//! to a granted buffer fails at the worker's NIC.
//!
//! The device context, protection domain and completion queue live as long as the process
//! (they are leaked once per worker): `ibverbs` ties queue pairs and regions to them by
//! lifetime, and a worker serves until it exits.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use ibverbs::{CompletionQueue, Context, Gid, MemoryRegion, ProtectionDomain, QueuePair, QueuePairEndpoint};
use strata_common::frame::RdmaEndpoint;

use super::{RdmaError, Region, RegisteredMemory};

const MIN_CLASS: usize = 64 << 10;
/// READs a client may have outstanding on one queue pair.
const MAX_DEST_RD_ATOMIC: u8 = 16;

pub(crate) struct VerbsMemory {
    pool: &'static Pool,
}

struct Pool {
    ctx: &'static Context,
    pd: ProtectionDomain<'static>,
    cq: CompletionQueue<'static>,
    free: Mutex<HashMap<usize, Vec<MemoryRegion<u8>>>>,
    /// Bytes of buffers registered (in use or free).
    registered: AtomicU64,
    /// Bytes of buffers in use by a region.
    in_use: AtomicU64,
    limit: u64,
}

fn device_err(what: &str, e: impl std::fmt::Display) -> RdmaError {
    RdmaError::Device(format!("{what}: {e}"))
}

impl VerbsMemory {
    /// Opens the first RDMA device; fails when there is none (as on every machine this ran on).
    pub(crate) fn open(limit: u64) -> Result<Self, RdmaError> {
        let devices = ibverbs::devices().map_err(|e| device_err("listing RDMA devices", e))?;
        let device = devices.iter().next().ok_or_else(|| RdmaError::Device("no RDMA device".into()))?;
        let ctx = device.open().map_err(|e| device_err("opening the RDMA device", e))?;
        let ctx: &'static Context = Box::leak(Box::new(ctx));
        let pd = ctx.alloc_pd().map_err(|e| device_err("allocating a protection domain", e))?;
        let cq = ctx.create_cq(64, 0).map_err(|e| device_err("creating a completion queue", e))?;
        let pool = Box::leak(Box::new(Pool {
            ctx,
            pd,
            cq,
            free: Mutex::new(HashMap::new()),
            registered: AtomicU64::new(0),
            in_use: AtomicU64::new(0),
            limit,
        }));
        Ok(Self { pool })
    }
}

impl Pool {
    /// A registered buffer of `class` bytes: a free one, or a new one within the limit (free
    /// buffers of other classes are deregistered to make room).
    fn take(&self, class: usize) -> Result<MemoryRegion<u8>, RdmaError> {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(mr) = free.get_mut(&class).and_then(Vec::pop) {
            return Ok(mr);
        }
        let want = class as u64;
        while self.registered.load(Ordering::Acquire) + want > self.limit {
            let Some(victim) = free.values_mut().find_map(Vec::pop) else {
                return Err(RdmaError::MemoryExhausted {
                    used: self.in_use.load(Ordering::Acquire),
                    want,
                    limit: self.limit,
                });
            };
            self.registered.fetch_sub(victim.len() as u64, Ordering::AcqRel);
            drop(victim);
        }
        self.registered.fetch_add(want, Ordering::AcqRel);
        drop(free);
        self.pd.allocate::<u8>(class).map_err(|e| {
            self.registered.fetch_sub(want, Ordering::AcqRel);
            device_err("registering memory", e)
        })
    }

    fn put_back(&self, mr: MemoryRegion<u8>) {
        let class = mr.len();
        self.free.lock().unwrap_or_else(|p| p.into_inner()).entry(class).or_default().push(mr);
    }
}

struct VerbsRegion {
    mr: Option<MemoryRegion<u8>>,
    len: usize,
    pool: &'static Pool,
    /// Set when the lease was released (the reader is done): the buffer goes back to the pool
    /// under the same rkey. Otherwise (expired) it is deregistered, which invalidates the rkey,
    /// so a late READ fails at the NIC instead of reading the buffer's next block.
    released: AtomicBool,
}

impl VerbsRegion {
    fn mr(&self) -> &MemoryRegion<u8> {
        self.mr.as_ref().expect("present until drop")
    }
}

impl Region for VerbsRegion {
    fn addr(&self) -> u64 {
        self.mr().as_ptr() as u64
    }

    fn rkey(&self) -> u32 {
        self.mr().rkey().key
    }

    fn len(&self) -> u64 {
        self.len as u64
    }

    fn read(&self, offset: u64, len: u64) -> Bytes {
        Bytes::copy_from_slice(&self.mr()[offset as usize..(offset + len) as usize])
    }

    fn mark_released(&self) {
        self.released.store(true, Ordering::Release);
    }
}

impl Drop for VerbsRegion {
    fn drop(&mut self) {
        if let Some(mr) = self.mr.take() {
            self.pool.in_use.fetch_sub(mr.len() as u64, Ordering::AcqRel);
            if self.released.load(Ordering::Acquire) {
                self.pool.put_back(mr);
            } else {
                self.pool.registered.fetch_sub(mr.len() as u64, Ordering::AcqRel);
                drop(mr);
            }
        }
    }
}

impl RegisteredMemory for VerbsMemory {
    fn register(&self, bytes: Bytes) -> Result<Arc<dyn Region>, RdmaError> {
        let class = bytes.len().next_power_of_two().max(MIN_CLASS);
        let mut mr = self.pool.take(class)?;
        mr[..bytes.len()].copy_from_slice(&bytes);
        self.pool.in_use.fetch_add(class as u64, Ordering::AcqRel);
        Ok(Arc::new(VerbsRegion {
            mr: Some(mr),
            len: bytes.len(),
            pool: self.pool,
            released: AtomicBool::new(false),
        }))
    }

    fn used(&self) -> u64 {
        self.pool.in_use.load(Ordering::Acquire)
    }

    fn connect(&self, remote: RdmaEndpoint) -> Result<(RdmaEndpoint, Box<dyn Send + Sync>), RdmaError> {
        let pool = self.pool;
        let mut builder = pool.pd.create_qp(&pool.cq, &pool.cq, ibverbs::ibv_qp_type::IBV_QPT_RC);
        builder
            .set_access(ibverbs::ibv_access_flags::IBV_ACCESS_REMOTE_READ)
            .set_max_dest_rd_atomic(MAX_DEST_RD_ATOMIC);
        // `ibverbs` looks the index up by position in its (valid-entries-only) GID table and
        // asserts the entry there has that index: use the first entry where the two agree.
        let gid_index = pool
            .ctx
            .gid_table()
            .iter()
            .enumerate()
            .find(|(i, e)| e.gid_index as usize == *i)
            .map(|(_, e)| e.gid_index);
        let routed = remote.gid.is_some() && gid_index.is_some();
        if let Some(index) = gid_index.filter(|_| routed) {
            builder.set_gid_index(index);
        }
        let prepared = builder.build().map_err(|e| device_err("creating a queue pair", e))?;
        let local = prepared.endpoint();
        let remote = QueuePairEndpoint {
            num: remote.qp_num,
            lid: remote.lid,
            gid: remote.gid.filter(|_| routed).map(|raw| Gid::from(ibverbs_sys::ibv_gid { raw })),
        };
        let qp: QueuePair<'static> =
            prepared.handshake(remote).map_err(|e| device_err("connecting the queue pair", e))?;
        let local = RdmaEndpoint {
            qp_num: local.num,
            lid: local.lid,
            gid: local.gid.map(|gid| {
                let raw: ibverbs_sys::ibv_gid = gid.into();
                // SAFETY: every bit pattern of the union is a valid `[u8; 16]`.
                unsafe { raw.raw }
            }),
        };
        Ok((local, Box::new(qp)))
    }
}
