//! Short-circuit reads from the pod's sidecar worker, or from a cluster worker on this host
//! through the socket it advertises (`local`): instead of the block's bytes, the worker
//! answers `OpenBlock` with a [`BlockGrant`] and a file descriptor passed over the Unix socket
//! (SCM_RIGHTS) — the verified NVMe block file, or a sealed shared-memory copy of a DRAM block —
//! and the client maps it read-only. The returned [`Bytes`] points into the mapping: no copy
//! through a socket, no copy into a buffer.
//!
//! Invariants: what a descriptor names never changes while it is mapped (block files are
//! replaced by rename or deleted, never rewritten; shared memory is sealed against writes and
//! shrinking, which is checked here), so a mapping stays correct after the worker evicts the
//! block; the grant's range is checked against the file's size before mapping, so a wrong grant
//! is an error, never a SIGBUS. The lease is given back (a `Release` frame) when the last
//! `Bytes` of the mapping is dropped, best effort: a lease nobody gives back expires.
//! With a mapping cache (`ClientConfig::short_circuit_cache_bytes`), whole blocks are mapped
//! and kept for half their lease, so the next reads of a block cost no round trip; a kept
//! mapping is never used past that, so the worker's lease always outlives its use.
//! Any failure here is reported to the caller, which reads the block the framed way instead.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use strata_common::fdpass::read_exact_with_fds;
use strata_common::frame::{
    BlockGrant, GrantHandle, GrantKind, LeaseRelease, MAX_ERROR_MESSAGE, RESPONSE_HEADER_LEN,
    ReadBlockRequest, ResponseHeader,
};
use strata_common::{ErrorKind, SharedClock};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::transport::{Credentials, TransportError};

/// Counter: block reads served by mapping a descriptor the sidecar or a worker on this host passed.
pub const METRIC_SHORT_CIRCUIT_READS: &str = "strata_client_short_circuit_reads_total";
/// Counter, label `why`: short-circuit attempts read the framed way instead — `declined` (the
/// worker answered for this read only: a block it does not hold, a changed version, a block it
/// would have to copy to grant) or `failed` (a refusal, a broken answer or connection; the
/// client then stops trying for a moment).
pub const METRIC_SHORT_CIRCUIT_FALLBACKS: &str = "strata_client_short_circuit_fallbacks_total";
/// Environment variable that turns short-circuit reads off when `0`, `false`, `off` or `no`.
pub const SHORT_CIRCUIT_ENV: &str = "STRATA_SHORT_CIRCUIT";

/// After a failure that will likely repeat (the sidecar refuses grants, sends garbage), every
/// read goes the framed way for this long instead of paying a failed round trip each.
const BACKOFF: Duration = Duration::from_secs(10);
/// Longest a kept mapping is used, whatever lease the sidecar grants.
const MAX_KEEP: Duration = Duration::from_secs(3600);
/// Release frames kept for the next request when no idle connection could take them.
const MAX_QUEUED_RELEASES: usize = 4096;

/// Connections to the sidecar and the leases waiting to be given back; shared with every
/// mapping so that dropping one can release its lease.
struct Shared {
    idle: Mutex<Vec<UnixStream>>,
    releases: Mutex<Vec<u64>>,
    max_idle: usize,
}

impl Shared {
    /// Gives a lease back now on an idle connection if one can take the frame without
    /// blocking (this runs in `Drop`, possibly outside any runtime), else with the next request.
    fn release(&self, lease_id: u64) {
        let mut ids = std::mem::take(&mut *self.releases.lock().unwrap_or_else(|p| p.into_inner()));
        ids.push(lease_id);
        {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(stream) = idle.last() {
                let frames = encode_releases(&ids);
                match stream.try_write(&frames) {
                    Ok(n) if n == frames.len() => return,
                    // Half a frame went out: the connection is out of step; drop it (the worker
                    // closes its side on the torn frame) and send every id again later — a
                    // second release of a lease is harmless.
                    Ok(_) => drop(idle.pop()),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(_) => drop(idle.pop()),
                }
            }
        }
        let mut queued = self.releases.lock().unwrap_or_else(|p| p.into_inner());
        queued.extend(ids);
        if queued.len() > MAX_QUEUED_RELEASES {
            // Those leases expire on the worker anyway.
            let excess = queued.len() - MAX_QUEUED_RELEASES;
            queued.drain(..excess);
        }
    }

    fn take_releases(&self) -> Vec<u64> {
        std::mem::take(&mut *self.releases.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

fn encode_releases(ids: &[u64]) -> Vec<u8> {
    ids.iter().flat_map(|&lease_id| LeaseRelease { lease_id, kind: GrantKind::Fd }.encode()).collect()
}

/// Short-circuit attempts a client read the framed way instead
/// ([`Client::short_circuit_fallbacks`](crate::Client::short_circuit_fallbacks)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShortCircuitFallbacks {
    /// The worker answered for that read only (a block it does not hold, a changed version, a
    /// block it would have to copy to grant): expected, e.g. for every DRAM-only block of a
    /// co-located worker.
    pub declined: u64,
    /// A refusal, a broken answer or connection: worth a look when it grows.
    pub failed: u64,
}

impl std::ops::Add for ShortCircuitFallbacks {
    type Output = Self;
    fn add(self, o: Self) -> Self {
        Self { declined: self.declined + o.declined, failed: self.failed + o.failed }
    }
}

/// Gives the lease back when dropped.
struct LeaseGuard {
    lease_id: u64,
    shared: Arc<Shared>,
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        self.shared.release(self.lease_id);
    }
}

/// The owner of the bytes a short-circuit read returns.
struct Mapped {
    map: memmap2::Mmap,
    _lease: LeaseGuard,
}

impl AsRef<[u8]> for Mapped {
    fn as_ref(&self) -> &[u8] {
        &self.map
    }
}

/// (path, version, block size, block index): a block of one version of a file.
type BlockId = (String, String, u64, u64);

/// Whole-block mappings kept for the next reads, least recently used out first.
struct MapCache {
    limit: u64,
    used: u64,
    tick: u64,
    /// The whole block, until when it may be used, and when it was last used.
    blocks: HashMap<BlockId, (Bytes, Instant, u64)>,
}

impl MapCache {
    /// The kept block, unless its time is up at `now` (then it is dropped: its lease goes back).
    fn get(&mut self, key: &BlockId, now: Instant, dropped: &mut Vec<Bytes>) -> Option<Bytes> {
        self.tick += 1;
        let tick = self.tick;
        let (bytes, until, used) = self.blocks.get_mut(key)?;
        if now < *until {
            *used = tick;
            return Some(bytes.clone());
        }
        self.evict(key, dropped);
        None
    }

    /// Keeps `bytes` (or returns what a concurrent read kept first), evicting the expired and
    /// then the least recently used to stay under the limit.
    fn insert(
        &mut self,
        key: BlockId,
        bytes: Bytes,
        until: Instant,
        now: Instant,
        dropped: &mut Vec<Bytes>,
    ) -> Bytes {
        if let Some(kept) = self.get(&key, now, dropped) {
            dropped.push(bytes);
            return kept;
        }
        let len = bytes.len() as u64;
        if len > self.limit {
            return bytes;
        }
        let expired: Vec<_> =
            self.blocks.iter().filter(|(_, v)| v.1 <= now).map(|(k, _)| k.clone()).collect();
        for k in expired {
            self.evict(&k, dropped);
        }
        while self.used + len > self.limit {
            let Some(oldest) = self.blocks.iter().min_by_key(|(_, v)| v.2).map(|(k, _)| k.clone()) else {
                break;
            };
            self.evict(&oldest, dropped);
        }
        self.used += len;
        self.blocks.insert(key, (bytes.clone(), until, self.tick));
        bytes
    }

    fn evict(&mut self, key: &BlockId, dropped: &mut Vec<Bytes>) {
        if let Some((bytes, _, _)) = self.blocks.remove(key) {
            self.used -= bytes.len() as u64;
            dropped.push(bytes);
        }
    }
}

/// Short-circuit reads through one socket: the sidecar's, or a worker's on this host.
pub(crate) struct ShortCircuit {
    socket: String,
    /// Block reads served by a mapping (as [`METRIC_SHORT_CIRCUIT_READS`], for this socket).
    reads: AtomicU64,
    fallbacks: [AtomicU64; 2],
    cache: Mutex<MapCache>,
    shared: Arc<Shared>,
    connect_timeout: Duration,
    request_timeout: Duration,
    next_req_id: AtomicU64,
    backoff_until: Mutex<Option<Instant>>,
    clock: SharedClock,
    /// Presented on every new connection: the sidecar grants nothing to an unauthenticated peer.
    credentials: Credentials,
    /// `Fd` (the sidecar: it copies a DRAM block into shared memory when it must) or
    /// `FdNoCopy` (a cluster worker: a block only a copy could grant is read over TCP).
    kind: GrantKind,
}

impl ShortCircuit {
    pub(crate) fn new(
        socket: String,
        connect_timeout: Duration,
        request_timeout: Duration,
        cache_bytes: u64,
        clock: SharedClock,
        credentials: Credentials,
        kind: GrantKind,
    ) -> Self {
        Self {
            kind,
            socket,
            reads: AtomicU64::new(0),
            fallbacks: Default::default(),
            cache: Mutex::new(MapCache { limit: cache_bytes, used: 0, tick: 0, blocks: HashMap::new() }),
            shared: Arc::new(Shared {
                idle: Mutex::new(Vec::new()),
                releases: Mutex::new(Vec::new()),
                max_idle: 64,
            }),
            connect_timeout,
            request_timeout,
            next_req_id: AtomicU64::new(1),
            backoff_until: Mutex::new(None),
            clock,
            credentials,
        }
    }

    /// Block reads served by a mapping so far.
    pub(crate) fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    /// Attempts read the framed way instead, by why.
    pub(crate) fn fallbacks(&self) -> ShortCircuitFallbacks {
        ShortCircuitFallbacks {
            declined: self.fallbacks[0].load(Ordering::Relaxed),
            failed: self.fallbacks[1].load(Ordering::Relaxed),
        }
    }

    fn count_read(&self) {
        metrics::counter!(METRIC_SHORT_CIRCUIT_READS).increment(1);
        self.reads.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether a recent failure says not to try now.
    pub(crate) fn backing_off(&self) -> bool {
        let mut until = self.backoff_until.lock().unwrap_or_else(|p| p.into_inner());
        match *until {
            Some(t) if self.clock.now() < t => true,
            Some(_) => {
                *until = None;
                false
            }
            None => false,
        }
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, MapCache> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `req.len` bytes of one block, mapped from the descriptor the sidecar passes (or from
    /// the kept mapping of the whole block).
    pub(crate) async fn read_block(&self, req: &ReadBlockRequest) -> Result<Bytes, TransportError> {
        let (start, end) = (req.offset as usize, (req.offset + req.len) as usize);
        if self.cache().limit == 0 {
            return self.read_mapped(req).await.map(|(bytes, _)| bytes);
        }
        let key = (req.path.clone(), req.version.clone(), req.block_size, req.block_index);
        // Mappings are dropped (and their leases released) outside the lock.
        let mut dropped = Vec::new();
        let kept = self.cache().get(&key, self.clock.now(), &mut dropped);
        drop(dropped);
        if let Some(whole) = kept
            && end <= whole.len()
        {
            self.count_read();
            return Ok(whole.slice(start..end));
        }
        let len = strata_common::block::block_len(req.file_size, req.block_size, req.block_index);
        let whole_req = ReadBlockRequest { offset: 0, len, ..req.clone() };
        let (whole, ttl) = self.read_mapped(&whole_req).await?;
        if end > whole.len() {
            return Err(TransportError::Protocol {
                addr: self.socket.clone(),
                reason: format!("range {start}..{end} outside a block of {}", whole.len()),
            });
        }
        let mut dropped = Vec::new();
        // Half the lease: the worker's pin always outlives our use, whatever the clocks do.
        let until = self.clock.now() + (ttl / 2).min(MAX_KEEP);
        let whole = self.cache().insert(key, whole, until, self.clock.now(), &mut dropped);
        drop(dropped);
        Ok(whole.slice(start..end))
    }

    async fn read_mapped(&self, req: &ReadBlockRequest) -> Result<(Bytes, Duration), TransportError> {
        let result = self.try_read_block(req).await;
        match &result {
            Ok(_) => self.count_read(),
            Err(e) => {
                // A refusal or a broken answer will come again; a missing block, a changed
                // version or a block only a copy could grant is about this read only.
                let repeats = match e {
                    TransportError::Remote { kind, .. } => kind.is_temporary(),
                    _ => true,
                };
                let why = if repeats { "failed" } else { "declined" };
                metrics::counter!(METRIC_SHORT_CIRCUIT_FALLBACKS, "why" => why).increment(1);
                self.fallbacks[usize::from(repeats)].fetch_add(1, Ordering::Relaxed);
                if repeats {
                    *self.backoff_until.lock().unwrap_or_else(|p| p.into_inner()) =
                        Some(self.clock.now() + BACKOFF);
                }
            }
        }
        result
    }

    async fn try_read_block(&self, req: &ReadBlockRequest) -> Result<(Bytes, Duration), TransportError> {
        let addr = self.socket.as_str();
        let mut req = req.clone();
        req.req_id = self.next_req_id.fetch_add(1, Ordering::Relaxed);
        let pooled = loop {
            match self.shared.idle.lock().unwrap_or_else(|p| p.into_inner()).pop() {
                Some(s) if crate::transport::closed_or_unsolicited(std::os::fd::AsFd::as_fd(&s)) => continue,
                other => break other,
            }
        };
        let mut stream = match pooled {
            Some(s) => s,
            None => crate::transport::connect_unix(addr, self.connect_timeout, &self.credentials).await?,
        };
        let result = tokio::time::timeout(self.request_timeout, self.exchange(&mut stream, &req))
            .await
            .unwrap_or_else(|_| Err(TransportError::Timeout { addr: addr.to_string() }));
        // Only a connection that completed a whole exchange is known to be in step (and not
        // one whose frame the worker rejected: it closes the connection after saying so).
        if crate::transport::reusable(&result) {
            let mut idle = self.shared.idle.lock().unwrap_or_else(|p| p.into_inner());
            if idle.len() < self.shared.max_idle {
                idle.push(stream);
            }
        }
        let (grant, fd) = result?;
        // From here on the lease is ours to give back, whatever happens.
        let lease = LeaseGuard { lease_id: grant.lease_id, shared: self.shared.clone() };
        let ttl = Duration::from_millis(grant.ttl_ms);
        map_grant(grant, fd, req.len, lease)
            .map(|bytes| (bytes, ttl))
            .map_err(|reason| TransportError::Protocol { addr: addr.to_string(), reason })
    }

    async fn exchange(
        &self,
        stream: &mut UnixStream,
        req: &ReadBlockRequest,
    ) -> Result<(BlockGrant, OwnedFd), TransportError> {
        let addr = self.socket.as_str();
        let io = |source| TransportError::Io { addr: addr.to_string(), source };
        let protocol = |reason: String| TransportError::Protocol { addr: addr.to_string(), reason };
        let mut out = encode_releases(&self.shared.take_releases());
        out.extend_from_slice(&req.encode_open(self.kind));
        stream.write_all(&out).await.map_err(io)?;

        let mut fds = Vec::new();
        let mut head = [0u8; RESPONSE_HEADER_LEN];
        read_exact_with_fds(stream, &mut head, &mut fds).await.map_err(io)?;
        let head = ResponseHeader::decode(&head).map_err(|e| protocol(e.to_string()))?;
        // A rejected frame is answered under request id 0 (the worker could not read ours).
        let rejected = head.req_id == 0 && head.status == Err(ErrorKind::BadFrame);
        if head.req_id != req.req_id && !rejected {
            return Err(protocol(format!("response to request {} for request {}", head.req_id, req.req_id)));
        }
        match head.status {
            Err(kind) => {
                if head.payload_len > MAX_ERROR_MESSAGE as u64 || !fds.is_empty() {
                    return Err(protocol("malformed error response".into()));
                }
                let mut message = vec![0u8; head.payload_len as usize];
                stream.read_exact(&mut message).await.map_err(io)?;
                Err(TransportError::Remote {
                    addr: addr.to_string(),
                    kind,
                    message: String::from_utf8_lossy(&message).into_owned(),
                })
            }
            Ok(_) => {
                if head.payload_len != BlockGrant::ENCODED_LEN as u64 {
                    return Err(protocol(format!("a grant of {} bytes", head.payload_len)));
                }
                let mut body = [0u8; BlockGrant::ENCODED_LEN];
                read_exact_with_fds(stream, &mut body, &mut fds).await.map_err(io)?;
                let grant = BlockGrant::decode(&body).map_err(|e| protocol(e.to_string()))?;
                if fds.len() != 1 {
                    return Err(protocol(format!("a grant with {} descriptors", fds.len())));
                }
                Ok((grant, fds.pop().expect("one descriptor")))
            }
        }
    }
}

/// Maps exactly the granted range of `fd` read-only, after checking that the grant is what
/// was asked for and lies inside a file that cannot shrink under the mapping.
fn map_grant(grant: BlockGrant, fd: OwnedFd, want: u64, lease: LeaseGuard) -> Result<Bytes, String> {
    let GrantHandle::Fd { offset } = grant.handle else {
        return Err("a grant without a file descriptor".into());
    };
    if grant.len != want || want == 0 {
        return Err(format!("a grant of {} bytes for a read of {want}", grant.len));
    }
    let len = usize::try_from(want).map_err(|_| "a grant larger than the address space".to_string())?;
    check_sealed(fd.as_fd())?;
    let file = File::from(fd);
    let size = file.metadata().map_err(|e| format!("cannot stat the granted descriptor: {e}"))?.len();
    if offset.checked_add(want).is_none_or(|end| end > size) {
        return Err(format!("a grant of {want} bytes at {offset} in a file of {size}"));
    }
    // SAFETY: the mapping is read-only and inside the file's current size; the worker never
    // writes to or truncates a block file it serves (it replaces files by rename) and the
    // shared memory it passes is sealed against writing and shrinking (checked above), so the
    // bytes stay as they are for as long as the mapping lives.
    // Populated up front: the caller reads every byte of the range, and one populate pass is
    // cheaper than a page fault per few pages.
    let map = unsafe { memmap2::MmapOptions::new().offset(offset).len(len).populate().map(&file) }
        .map_err(|e| format!("cannot map the granted descriptor: {e}"))?;
    // The mapping keeps the file (or shared memory) alive; the descriptor is not needed.
    drop(file);
    Ok(Bytes::from_owner(Mapped { map, _lease: lease }))
}

/// Shared memory must be sealed against writes and shrinking before it is trusted; a regular
/// file (which cannot carry seals) is trusted as a block file.
fn check_sealed(fd: BorrowedFd<'_>) -> Result<(), String> {
    // SAFETY: F_GET_SEALS only reads the descriptor's seal set.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        let err = io::Error::last_os_error();
        return if err.raw_os_error() == Some(libc::EINVAL) {
            Ok(())
        } else {
            Err(format!("cannot read the descriptor's seals: {err}"))
        };
    }
    let needed = libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK;
    if seals & needed != needed {
        return Err("shared memory that is not sealed against writes".into());
    }
    Ok(())
}

/// Whether `STRATA_SHORT_CIRCUIT` leaves short-circuit reads on (anything but an explicit off).
pub(crate) fn enabled_by_env() -> bool {
    std::env::var(SHORT_CIRCUIT_ENV)
        .map(|v| !matches!(v.trim().to_ascii_lowercase().as_str(), "0" | "false" | "off" | "no"))
        .unwrap_or(true)
}

#[cfg(test)]
mod tests {
    use std::io::{Seek, Write};

    use super::*;

    fn pair() -> (UnixStream, UnixStream) {
        UnixStream::pair().unwrap()
    }

    fn file_with(bytes: &[u8]) -> File {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(bytes).unwrap();
        f.rewind().unwrap();
        f
    }

    fn guard() -> LeaseGuard {
        let shared =
            Arc::new(Shared { idle: Mutex::new(Vec::new()), releases: Mutex::new(Vec::new()), max_idle: 1 });
        LeaseGuard { lease_id: 7, shared }
    }

    fn grant(offset: u64, len: u64) -> BlockGrant {
        BlockGrant { lease_id: 7, ttl_ms: 1000, len, handle: GrantHandle::Fd { offset } }
    }

    #[test]
    fn a_grant_maps_exactly_its_range_and_outlives_the_file() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 253) as u8).collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("block");
        std::fs::write(&path, &data).unwrap();
        let fd = OwnedFd::from(File::open(&path).unwrap());
        let bytes = map_grant(grant(4097, 3001), fd, 3001, guard()).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(&bytes[..], &data[4097..7098], "the unlinked file's bytes are still mapped");
    }

    #[test]
    fn a_grant_past_the_end_or_of_the_wrong_size_or_unsealed_is_refused() {
        let fd = || OwnedFd::from(file_with(&[1u8; 100]));
        assert!(map_grant(grant(90, 20), fd(), 20, guard()).unwrap_err().contains("in a file of 100"));
        assert!(map_grant(grant(0, 20), fd(), 10, guard()).is_err());
        let rdma = BlockGrant { handle: GrantHandle::Rdma { addr: 0, rkey: 1 }, ..grant(0, 10) };
        assert!(map_grant(rdma, fd(), 10, guard()).is_err());
        // Shared memory without seals could change under the reader.
        // SAFETY: a valid NUL-terminated name.
        let raw =
            unsafe { libc::memfd_create(c"test".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        assert!(raw >= 0);
        // SAFETY: memfd_create returned a new descriptor we own.
        let mut shm = File::from(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) });
        shm.write_all(&[5u8; 64]).unwrap();
        let unsealed = shm.try_clone().unwrap();
        assert!(map_grant(grant(0, 64), unsealed.into(), 64, guard()).unwrap_err().contains("sealed"));
        let seals = libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        // SAFETY: F_ADD_SEALS on a memfd we own.
        assert_eq!(unsafe { libc::fcntl(shm.as_raw_fd(), libc::F_ADD_SEALS, seals) }, 0);
        assert_eq!(&map_grant(grant(8, 16), shm.into(), 16, guard()).unwrap()[..], &[5u8; 16]);
    }

    #[test]
    fn the_mapping_cache_keeps_its_limit_and_never_serves_an_expired_block() {
        let mut cache = MapCache { limit: 100, used: 0, tick: 0, blocks: HashMap::new() };
        let key = |i: u64| ("/p".to_string(), "v".to_string(), 64, i);
        let now = Instant::now();
        let later = now + Duration::from_secs(60);
        let mut dropped = Vec::new();
        cache.insert(key(1), Bytes::from(vec![1u8; 40]), later, now, &mut dropped);
        cache.insert(key(2), Bytes::from(vec![2u8; 40]), later, now, &mut dropped);
        assert_eq!(cache.get(&key(1), now, &mut dropped).unwrap()[0], 1);
        cache.insert(key(3), Bytes::from(vec![3u8; 40]), later, now, &mut dropped);
        assert_eq!(cache.used, 80);
        assert_eq!(dropped.len(), 1, "the least recently used block went");
        assert!(cache.get(&key(2), now, &mut dropped).is_none());
        // A concurrent second mapping of a kept block is dropped; the first one is served.
        let kept = cache.insert(key(1), Bytes::from(vec![9u8; 40]), later, now, &mut dropped);
        assert_eq!(kept[0], 1);
        // Past its time a block is not served, and is let go.
        let past = now;
        cache.insert(key(4), Bytes::from(vec![4u8; 10]), past, now, &mut dropped);
        let before = dropped.len();
        assert!(cache.get(&key(4), now, &mut dropped).is_none());
        assert_eq!(dropped.len(), before + 1);
        assert_eq!(cache.used, 80);
    }

    #[tokio::test]
    async fn dropping_the_bytes_sends_the_release_on_an_idle_connection() {
        let (a, mut b) = pair();
        let shared =
            Arc::new(Shared { idle: Mutex::new(vec![a]), releases: Mutex::new(Vec::new()), max_idle: 1 });
        let fd = OwnedFd::from(file_with(&[3u8; 50]));
        let bytes =
            map_grant(grant(0, 50), fd, 50, LeaseGuard { lease_id: 41, shared: shared.clone() }).unwrap();
        let slice = bytes.slice(10..20);
        drop(bytes);
        assert!(shared.releases.lock().unwrap().is_empty());
        drop(slice);
        let mut frame = vec![0u8; LeaseRelease { lease_id: 41, kind: GrantKind::Fd }.encode().len()];
        b.read_exact(&mut frame).await.unwrap();
        assert_eq!(frame, LeaseRelease { lease_id: 41, kind: GrantKind::Fd }.encode());

        // No idle connection: the release waits for the next request.
        shared.idle.lock().unwrap().clear();
        shared.release(42);
        assert_eq!(shared.take_releases(), vec![42]);
    }
}
