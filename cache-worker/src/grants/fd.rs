//! Descriptor grants (short-circuit reads for clients on the same host): the range as a
//! [`BlockGrant`] whose file descriptor the data plane passes with the answer (SCM_RIGHTS) and
//! the client maps read-only.
//!
//! - A block served from NVMe ([`Payload::File`]): the verified block file's own descriptor;
//!   the grant's offset is the range's place in the file.
//! - A block in memory ([`Payload::Bytes`]): a copy in a sealed memfd (no more writes, no
//!   shrinking or growing), so the client can trust that it never changes. Whole DRAM blocks
//!   are copied once and kept in a small cache bounded in bytes, so a hot block costs one copy,
//!   not one per reader.
//!
//! Invariants: nothing a descriptor names is ever modified — block files are replaced by rename
//! or deleted, memfds are sealed — so a mapping stays correct after the block is evicted or
//! the worker is gone (the descriptor keeps the inode or the memory alive). Every grant holds a
//! lease, released by the client's `Release` or expired after the TTL; a lease on a cached
//! shared-memory copy pins it, and the lease limit bounds the grants one pod holds. Errors are ordinary error frames
//! and the connection stays in step; a malformed body closes it like any malformed frame.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use strata_common::frame::{BlockGrant, GrantHandle, Source};
use strata_common::{BlockKey, SharedClock};

use super::GrantError;
use super::lease::Leases;
use crate::blocks::{BlockRead, BlockService, Payload, Served};
use crate::config::WorkerConfig;
use crate::metrics_defs as m;

/// How a worker serves short-circuit grants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShortCircuitConfig {
    /// Off: every `OpenBlock` is refused and clients read through the socket.
    pub enabled: bool,
    /// How long a grant's lease lasts unless released.
    pub lease_ttl: Duration,
    /// Most leases held at once; more grants are refused until some end.
    pub max_leases: usize,
    /// Bytes of shared-memory copies of DRAM blocks kept for the next reader.
    pub shm_cache_bytes: u64,
}

impl Default for ShortCircuitConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            lease_ttl: Duration::from_secs(30),
            max_leases: 4096,
            shm_cache_bytes: 256 << 20,
        }
    }
}

impl From<&WorkerConfig> for ShortCircuitConfig {
    fn from(c: &WorkerConfig) -> Self {
        Self {
            enabled: c.short_circuit,
            lease_ttl: Duration::from_millis(c.short_circuit_lease_ms),
            shm_cache_bytes: c.short_circuit_shm_bytes,
            ..Self::default()
        }
    }
}

/// A worker's descriptor grants: the lease table and the shared-memory copies.
pub struct FdGrants {
    enabled: bool,
    /// A lease pins the cached shared-memory copy it names (so the copy is not freed while a
    /// reader may map it); a block file or a one-off copy needs no pin — the reader's own
    /// descriptor keeps it alive — and holding its descriptor here would only spend this
    /// process's descriptor limit on every lease.
    leases: Leases<Option<Arc<OwnedFd>>>,
    shm: Mutex<ShmCache>,
}

impl FdGrants {
    pub fn new(config: ShortCircuitConfig, clock: SharedClock) -> Self {
        Self {
            enabled: config.enabled,
            leases: Leases::new(config.lease_ttl, config.max_leases, clock),
            shm: Mutex::new(ShmCache {
                limit: config.shm_cache_bytes,
                used: 0,
                tick: 0,
                blocks: HashMap::new(),
            }),
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Leases held now (expired ones are swept by the next grant).
    pub fn held_leases(&self) -> usize {
        self.leases.held()
    }

    /// DRAM blocks kept as shared memory, and their bytes.
    pub fn shm_cached(&self) -> (usize, u64) {
        let shm = self.shm();
        (shm.blocks.len(), shm.used)
    }

    fn shm(&self) -> std::sync::MutexGuard<'_, ShmCache> {
        self.shm.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn release(&self, lease_id: u64) {
        self.leases.release(lease_id);
        metrics::gauge!(m::SHORT_CIRCUIT_LEASES).set(self.leases.held() as f64);
    }

    /// Reads the range and leases a descriptor that holds it. Without `copy`, only a
    /// descriptor that costs no copy: a verified block file (even of a block in DRAM as well)
    /// or a kept shared-memory copy; nothing is fetched, and anything else is
    /// [`GrantError::WouldCopy`].
    pub(super) async fn grant(
        &self,
        blocks: &BlockService,
        r: &BlockRead,
        copy: bool,
    ) -> Result<(BlockGrant, Arc<OwnedFd>, Source), GrantError> {
        if !self.enabled {
            return Err(GrantError::Refused("short-circuit reads are off on this worker".into()));
        }
        let (fd, offset, kind, pin, source) = if copy {
            let Served { payload, source, key } =
                blocks.read_payload(r, strata_common::QosClass::default()).await?;
            match payload {
                Payload::File { file, offset, .. } => {
                    (Arc::new(OwnedFd::from(file)), offset, "file", None, source)
                }
                Payload::Bytes(range) => {
                    let (fd, offset, cached) = self.shared_memory(blocks, &key, r, range).await?;
                    let pin = cached.then(|| fd.clone());
                    (fd, offset, "shm", pin, source)
                }
            }
        } else {
            match blocks.verified_file(r).await? {
                (Some(Payload::File { file, offset, .. }), _) => {
                    (Arc::new(OwnedFd::from(file)), offset, "file", None, Source::Nvme)
                }
                (_, key) => match self.shm().get(&key) {
                    Some(fd) => (fd.clone(), r.offset, "shm", Some(fd), Source::Memory),
                    None => return Err(GrantError::WouldCopy(format!("{} block {}", r.path, r.index))),
                },
            }
        };
        let lease = self.leases.grant(pin).map_err(|e| GrantError::Refused(e.to_string()))?;
        metrics::counter!(m::SHORT_CIRCUIT_GRANTS, "kind" => kind).increment(1);
        metrics::gauge!(m::SHORT_CIRCUIT_LEASES).set(self.leases.held() as f64);
        let grant = BlockGrant {
            lease_id: lease.id,
            ttl_ms: lease.ttl.as_millis() as u64,
            len: r.len,
            handle: GrantHandle::Fd { offset },
        };
        Ok((grant, fd, source))
    }

    /// A sealed memfd holding the range, the range's offset in it, and whether it is the cached
    /// copy of the whole block (when the block is in DRAM) rather than a one-off copy of the
    /// range.
    async fn shared_memory(
        &self,
        blocks: &BlockService,
        key: &BlockKey,
        r: &BlockRead,
        range: Bytes,
    ) -> Result<(Arc<OwnedFd>, u64, bool), GrantError> {
        if let Some(fd) = self.shm().get(key) {
            return Ok((fd, r.offset, true));
        }
        let block_len = strata_common::block::block_len(r.file_size, r.block_size, r.index);
        if let Some(whole) = blocks.cache().memory_get(key).await
            && whole.len() as u64 == block_len
        {
            let fd = Arc::new(copy_to_memfd(whole).await?);
            let mut shm = self.shm();
            // A block larger than the whole cache is handed out but not kept.
            let kept = block_len <= shm.limit;
            return Ok((shm.insert(key.clone(), fd, block_len), r.offset, kept));
        }
        Ok((Arc::new(copy_to_memfd(range).await?), 0, false))
    }
}

/// Shared-memory copies of whole DRAM blocks, least recently used out first.
struct ShmCache {
    limit: u64,
    used: u64,
    tick: u64,
    blocks: HashMap<BlockKey, (Arc<OwnedFd>, u64, u64)>,
}

impl ShmCache {
    fn get(&mut self, key: &BlockKey) -> Option<Arc<OwnedFd>> {
        self.tick += 1;
        let tick = self.tick;
        self.blocks.get_mut(key).map(|(fd, _, used)| {
            *used = tick;
            fd.clone()
        })
    }

    /// Keeps `fd` for `key` (or returns the copy a concurrent reader kept first).
    fn insert(&mut self, key: BlockKey, fd: Arc<OwnedFd>, len: u64) -> Arc<OwnedFd> {
        if let Some(existing) = self.get(&key) {
            return existing;
        }
        if len > self.limit {
            return fd;
        }
        while self.used + len > self.limit {
            let Some(oldest) =
                self.blocks.iter().min_by_key(|(_, (_, _, used))| *used).map(|(k, _)| k.clone())
            else {
                break;
            };
            if let Some((_, n, _)) = self.blocks.remove(&oldest) {
                self.used -= n;
            }
        }
        self.used += len;
        self.blocks.insert(key, (fd.clone(), len, self.tick));
        fd
    }
}

async fn copy_to_memfd(bytes: Bytes) -> Result<OwnedFd, GrantError> {
    let len = bytes.len() as u64;
    // A multi-MiB copy is too long to run on an async worker thread.
    let fd = tokio::task::spawn_blocking(move || sealed_memfd(&bytes))
        .await
        .map_err(|e| GrantError::Refused(format!("shared-memory copy failed: {e}")))?
        .map_err(|e| GrantError::Refused(format!("cannot create shared memory: {e}")))?;
    metrics::counter!(m::SHORT_CIRCUIT_SHM_BYTES).increment(len);
    Ok(fd)
}

/// A memfd holding `bytes`, sealed so that neither side can ever change or resize it.
pub(crate) fn sealed_memfd(bytes: &[u8]) -> std::io::Result<OwnedFd> {
    // SAFETY: a valid NUL-terminated name; the flags are plain bits.
    let raw =
        unsafe { libc::memfd_create(c"strata-block".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a new descriptor that nothing else owns.
    let mut file = File::from(unsafe { OwnedFd::from_raw_fd(raw) });
    file.write_all(bytes)?;
    let seals = libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: F_ADD_SEALS on a memfd we own; it has no writable mappings, so sealing succeeds.
    if unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&file), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file.into())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;

    #[test]
    fn a_sealed_memfd_holds_the_bytes_and_refuses_every_change() {
        let data: Vec<u8> = (0..5000u32).map(|i| (i % 241) as u8).collect();
        let file = File::from(sealed_memfd(&data).unwrap());
        let mut back = vec![0u8; data.len()];
        file.read_exact_at(&mut back, 0).unwrap();
        assert_eq!(back, data);
        assert!(file.write_at(b"x", 0).is_err(), "writes are sealed");
        assert!(file.set_len(10).is_err(), "shrinking is sealed");
        assert!(file.set_len(10_000).is_err(), "growing is sealed");
    }

    fn key(i: u64) -> BlockKey {
        BlockKey::new("f", "v", i)
    }

    fn fd() -> Arc<OwnedFd> {
        Arc::new(sealed_memfd(b"x").unwrap())
    }

    #[test]
    fn the_shm_cache_keeps_its_byte_limit_and_drops_the_least_recently_used() {
        let mut cache = ShmCache { limit: 100, used: 0, tick: 0, blocks: HashMap::new() };
        let a = cache.insert(key(1), fd(), 40);
        cache.insert(key(2), fd(), 40);
        assert!(Arc::ptr_eq(&cache.get(&key(1)).unwrap(), &a), "1 is now the most recently used");
        cache.insert(key(3), fd(), 40);
        assert_eq!(cache.used, 80);
        assert!(cache.get(&key(2)).is_none(), "2 was the least recently used");
        assert!(cache.get(&key(1)).is_some() && cache.get(&key(3)).is_some());
        // A second copy of a cached block is not kept: the first one is handed out.
        assert!(Arc::ptr_eq(&cache.insert(key(1), fd(), 40), &a));
        // A block larger than the whole cache is passed through, not kept.
        cache.insert(key(9), fd(), 101);
        assert!(cache.get(&key(9)).is_none());
        assert_eq!(cache.used, 80);
    }
}
