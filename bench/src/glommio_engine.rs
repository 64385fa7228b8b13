//! A prototype NVMe engine on glommio (io_uring, O_DIRECT), good enough to measure against the
//! file-per-block `NvmeTier` — not a tier: no eviction, no index rebuild on open, no `Tier` impl.
//!
//! One glommio executor thread owns one preallocated file of fixed-size slots; the tokio side
//! sends requests over an unbounded channel and gets answers on oneshot channels (both tokio
//! channels, which only need wakers, not a tokio runtime, so the glommio side can await them).
//! Every request runs as its own glommio task, so 32 concurrent callers put 32 reads in flight.
//!
//! # Slot format (little endian), slot `i` at byte `i * slot_len`
//!
//! ```text
//! page 0:      magic b"STRATASL" (8) | version u32 = 1 | data_len u64 | chunk u32 | key_len u32
//!              | BlockKey::encode() | zero padding | header_crc32c u32 in the page's last 4 bytes
//! page 1..:    crc32c of every `CHUNK` bytes of data, zero padded to whole pages
//! then:        data, zero padded to a whole page
//! ```
//!
//! `header_crc32c` covers page 0 (but its own 4 bytes) and the whole chunk-CRC table, so one
//! check validates key, length and table. Per-chunk CRCs (instead of the tier's one CRC of the
//! whole block) are what let a 4 KiB read inside a block be verified by reading the header
//! region and the covering chunks only, not the whole 4 MiB.
//!
//! Durability: `put` returns when the O_DIRECT write completed, i.e. the device acknowledged
//! it — no fdatasync per block, the same choice as `NvmeTier` (which returns once the data is in
//! the page cache). A torn slot fails its checksums and is a miss. [`GlommioEngine::sync`]
//! issues one fdatasync for the whole file.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::io;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use glommio::io::{DmaFile, OpenOptions};
use glommio::{LocalExecutorBuilder, Placement};
use strata_common::BlockKey;
use tokio::sync::{mpsc, oneshot};

const MAGIC: &[u8; 8] = b"STRATASL";
const FORMAT_VERSION: u32 = 1;
/// Checksum granularity: the smallest read that can be verified on its own.
pub const CHUNK: usize = 4096;
/// O_DIRECT alignment used for every offset and length (the filesystem's is ≤ 4 KiB).
const PAGE: usize = 4096;
/// magic | version | data_len | chunk | key_len
const FIXED_LEN: usize = 8 + 4 + 8 + 4 + 4;

fn align_up(v: usize) -> usize {
    v.div_ceil(PAGE) * PAGE
}

fn le_u32(buf: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(buf[at..at + 4].try_into().expect("4 bytes"))
}

fn le_u64(buf: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(buf[at..at + 8].try_into().expect("8 bytes"))
}

fn invalid(msg: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

pub struct EngineConfig {
    /// Directory of the slot file (`slots.dat`), created if missing.
    pub dir: PathBuf,
    /// Number of slots, i.e. blocks the engine can hold (there is no eviction).
    pub slots: u64,
    /// Largest block, bytes; every slot is sized for it.
    pub max_block: usize,
    /// How long the executor spins before it parks when idle. A parked executor costs a
    /// thread wake-up per request that arrives over the channel; spinning trades a core for it.
    pub spin_before_park: Option<Duration>,
}

enum Request {
    Put { key: BlockKey, data: Bytes, reply: oneshot::Sender<io::Result<()>> },
    Get { key: BlockKey, reply: oneshot::Sender<io::Result<Option<Bytes>>> },
    Read { key: BlockKey, offset: usize, len: usize, reply: oneshot::Sender<io::Result<Option<Bytes>>> },
    Sync { reply: oneshot::Sender<io::Result<()>> },
    Ping { reply: oneshot::Sender<io::Result<()>> },
}

/// The tokio-side handle. Dropping it closes the channel, which ends the glommio thread.
pub struct GlommioEngine {
    tx: Option<mpsc::UnboundedSender<Request>>,
    thread: Option<glommio::ExecutorJoinHandle<()>>,
    corrupt: Arc<AtomicU64>,
}

fn gone() -> io::Error {
    io::Error::other("glommio engine thread stopped")
}

impl GlommioEngine {
    /// Starts the executor thread, creates and preallocates the slot file.
    pub async fn start(config: EngineConfig) -> io::Result<Self> {
        std::fs::create_dir_all(&config.dir)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let (ready_tx, ready_rx) = oneshot::channel();
        let corrupt = Arc::new(AtomicU64::new(0));
        let corrupt_in = Arc::clone(&corrupt);
        let mut builder = LocalExecutorBuilder::new(Placement::Unbound).name("strata-glommio");
        if let Some(spin) = config.spin_before_park {
            builder = builder.spin_before_park(spin);
        }
        let thread = builder
            .spawn(move || async move {
                match State::open(config, corrupt_in).await {
                    Ok(state) => {
                        let _ = ready_tx.send(Ok(()));
                        serve(Rc::new(state), rx).await;
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            })
            .map_err(io::Error::from)?;
        ready_rx.await.map_err(|_| gone())??;
        Ok(Self { tx: Some(tx), thread: Some(thread), corrupt })
    }

    async fn call<T>(&self, make: impl FnOnce(oneshot::Sender<io::Result<T>>) -> Request) -> io::Result<T> {
        let (reply, rx) = oneshot::channel();
        self.tx.as_ref().ok_or_else(gone)?.send(make(reply)).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }

    /// Stores a block; a key already present (or being written) is left as it is.
    pub async fn put(&self, key: &BlockKey, data: Bytes) -> io::Result<()> {
        self.call(|reply| Request::Put { key: key.clone(), data, reply }).await
    }

    /// The whole block, every chunk verified; `None` on a miss or a corrupt slot.
    pub async fn get(&self, key: &BlockKey) -> io::Result<Option<Bytes>> {
        self.call(|reply| Request::Get { key: key.clone(), reply }).await
    }

    /// `len` bytes at `offset` of the block (clamped to its end), reading and verifying only the
    /// header region and the chunks covering the range.
    pub async fn read(&self, key: &BlockKey, offset: usize, len: usize) -> io::Result<Option<Bytes>> {
        self.call(|reply| Request::Read { key: key.clone(), offset, len, reply }).await
    }

    /// One fdatasync of the slot file: everything `put` returned for is on stable storage.
    pub async fn sync(&self) -> io::Result<()> {
        self.call(|reply| Request::Sync { reply }).await
    }

    /// A round trip through the channels and the executor without I/O: what crossing from
    /// tokio to glommio and back costs on every request.
    pub async fn ping(&self) -> io::Result<()> {
        self.call(|reply| Request::Ping { reply }).await
    }

    pub fn corrupt_blocks(&self) -> u64 {
        self.corrupt.load(Ordering::Relaxed)
    }

    /// Byte offset in `slots.dat` of slot `slot`'s header and of its data, for the self-check
    /// that damages blocks behind the engine's back.
    pub fn slot_offsets(slot: u64, max_block: usize) -> (u64, u64) {
        let (_, header_len, slot_len) = layout(max_block);
        let start = slot * slot_len as u64;
        (start, start + header_len as u64)
    }
}

impl Drop for GlommioEngine {
    fn drop(&mut self) {
        // Closing the channel ends `serve`; then the thread can be joined.
        self.tx.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// `(chunks per max block, header region length, slot length)`.
fn layout(max_block: usize) -> (usize, usize, usize) {
    let chunks = max_block.div_ceil(CHUNK);
    let header_len = PAGE + align_up(chunks * 4);
    (chunks, header_len, header_len + align_up(max_block))
}

struct Slot {
    index: u64,
    len: usize,
}

#[derive(Default)]
struct Index {
    blocks: HashMap<BlockKey, Slot>,
    /// Keys whose write is in flight: they own a slot but are not readable yet.
    writing: HashSet<BlockKey>,
    free: Vec<u64>,
}

struct State {
    file: DmaFile,
    header_len: usize,
    slot_len: usize,
    max_block: usize,
    index: RefCell<Index>,
    corrupt: Arc<AtomicU64>,
    /// Requests in flight, so `serve` can wait for them before closing the file.
    in_flight: Cell<usize>,
}

impl State {
    async fn open(config: EngineConfig, corrupt: Arc<AtomicU64>) -> io::Result<Self> {
        let (_, header_len, slot_len) = layout(config.max_block);
        let path = config.dir.join("slots.dat");
        // glommio 0.9 probes io_uring polling support with an O_DIRECT read at offset 0 of the
        // file being opened; on an empty file that read succeeds without reaching the device, so
        // glommio wrongly picks the poll ring (virtio-blk here has none) and every later read
        // fails with EOPNOTSUPP. A page of real data on disk makes the probe honest. Blocking
        // std I/O is fine here: it runs once, before the engine serves anything.
        {
            let mut file = std::fs::File::create(&path)?;
            std::io::Write::write_all(&mut file, &[0u8; PAGE])?;
            file.sync_all()?;
        }
        let file = OpenOptions::new().read(true).write(true).dma_open(&path).await?;
        // Allocating extents up front keeps block allocation out of the write path: an
        // O_DIRECT write into a hole turns into a synchronous allocation in the kernel.
        file.pre_allocate(config.slots * slot_len as u64, false).await?;
        let index = Index { free: (0..config.slots).rev().collect(), ..Index::default() };
        Ok(Self {
            file,
            header_len,
            slot_len,
            max_block: config.max_block,
            index: RefCell::new(index),
            corrupt,
            in_flight: Cell::new(0),
        })
    }

    fn slot_pos(&self, slot: u64) -> u64 {
        slot * self.slot_len as u64
    }

    /// Header page plus chunk-CRC table of `data` stored under `key`, `header_len` bytes.
    fn encode_header(&self, key: &BlockKey, data: &[u8], out: &mut [u8]) -> io::Result<()> {
        let key_enc = key.encode();
        if FIXED_LEN + key_enc.len() + 4 > PAGE {
            return Err(invalid("block key too long for the slot header"));
        }
        out[..self.header_len].fill(0);
        out[..8].copy_from_slice(MAGIC);
        out[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        out[12..20].copy_from_slice(&(data.len() as u64).to_le_bytes());
        out[20..24].copy_from_slice(&(CHUNK as u32).to_le_bytes());
        out[24..28].copy_from_slice(&(key_enc.len() as u32).to_le_bytes());
        out[FIXED_LEN..FIXED_LEN + key_enc.len()].copy_from_slice(&key_enc);
        for (i, chunk) in data.chunks(CHUNK).enumerate() {
            let at = PAGE + 4 * i;
            out[at..at + 4].copy_from_slice(&crc32c::crc32c(chunk).to_le_bytes());
        }
        let crc = header_crc(&out[..self.header_len]);
        out[PAGE - 4..PAGE].copy_from_slice(&crc.to_le_bytes());
        Ok(())
    }

    /// Checks the header region read from a slot against the key and length the index holds.
    fn check_header(&self, header: &[u8], key: &BlockKey, len: usize) -> Result<(), &'static str> {
        if header.len() < self.header_len {
            return Err("short header read");
        }
        if &header[..8] != MAGIC || le_u32(header, 8) != FORMAT_VERSION {
            return Err("bad magic or version");
        }
        if header_crc(&header[..self.header_len]) != le_u32(header, PAGE - 4) {
            return Err("header checksum mismatch");
        }
        let key_len = le_u32(header, 24) as usize;
        if FIXED_LEN + key_len + 4 > PAGE || header[FIXED_LEN..FIXED_LEN + key_len] != key.encode()[..] {
            return Err("key mismatch");
        }
        if le_u64(header, 12) != len as u64 || le_u32(header, 20) as usize != CHUNK {
            return Err("length mismatch");
        }
        Ok(())
    }

    /// Verifies `data`, which starts at chunk `first_chunk` of the block.
    fn check_chunks(&self, header: &[u8], first_chunk: usize, data: &[u8]) -> Result<(), &'static str> {
        for (i, chunk) in data.chunks(CHUNK).enumerate() {
            if crc32c::crc32c(chunk) != le_u32(header, PAGE + 4 * (first_chunk + i)) {
                return Err("data checksum mismatch");
            }
        }
        Ok(())
    }

    /// Drops a block that failed a check: a miss, counted, its slot reused.
    fn drop_corrupt(&self, key: &BlockKey, reason: &'static str) {
        let mut index = self.index.borrow_mut();
        if let Some(slot) = index.blocks.remove(key) {
            index.free.push(slot.index);
        }
        self.corrupt.fetch_add(1, Ordering::Relaxed);
        eprintln!("glommio engine: corrupt block {key} dropped: {reason}");
    }

    async fn put(&self, key: BlockKey, data: Bytes) -> io::Result<()> {
        if data.len() > self.max_block {
            return Err(invalid("block larger than the slot size"));
        }
        let slot = {
            let mut index = self.index.borrow_mut();
            if index.blocks.contains_key(&key) || index.writing.contains(&key) {
                return Ok(());
            }
            let slot = index.free.pop().ok_or_else(|| io::Error::other("no free slot (no eviction)"))?;
            index.writing.insert(key.clone());
            slot
        };
        let result = self.write_slot(slot, &key, &data).await;
        let mut index = self.index.borrow_mut();
        index.writing.remove(&key);
        match result {
            Ok(()) => {
                index.blocks.insert(key, Slot { index: slot, len: data.len() });
                Ok(())
            }
            Err(e) => {
                index.free.push(slot);
                Err(e)
            }
        }
    }

    async fn write_slot(&self, slot: u64, key: &BlockKey, data: &[u8]) -> io::Result<()> {
        let total = self.header_len + align_up(data.len());
        // O_DIRECT needs an aligned buffer, so the block is copied once into DMA memory; header
        // and data go down in one write so a slot is never half-new after a clean completion.
        let mut buf = self.file.alloc_dma_buffer(total);
        let bytes = buf.as_bytes_mut();
        self.encode_header(key, data, bytes)?;
        bytes[self.header_len..self.header_len + data.len()].copy_from_slice(data);
        bytes[self.header_len + data.len()..].fill(0);
        let written = self.file.write_at(buf, self.slot_pos(slot)).await?;
        if written != total {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "short O_DIRECT write"));
        }
        Ok(())
    }

    fn lookup(&self, key: &BlockKey) -> Option<(u64, usize)> {
        self.index.borrow().blocks.get(key).map(|s| (s.index, s.len))
    }

    async fn get(&self, key: BlockKey) -> io::Result<Option<Bytes>> {
        let Some((slot, len)) = self.lookup(&key) else { return Ok(None) };
        let total = self.header_len + align_up(len);
        let read = self.file.read_at_aligned(self.slot_pos(slot), total).await?;
        if read.len() < self.header_len + len {
            self.drop_corrupt(&key, "short read");
            return Ok(None);
        }
        let (header, rest) = read.split_at(self.header_len);
        let data = &rest[..len];
        if let Err(reason) =
            self.check_header(header, &key, len).and_then(|()| self.check_chunks(header, 0, data))
        {
            self.drop_corrupt(&key, reason);
            return Ok(None);
        }
        // The DMA buffer belongs to this thread's reactor (not Send): tokio gets a copy.
        Ok(Some(Bytes::copy_from_slice(data)))
    }

    async fn read(&self, key: BlockKey, offset: usize, len: usize) -> io::Result<Option<Bytes>> {
        let Some((slot, block_len)) = self.lookup(&key) else { return Ok(None) };
        let end = offset.saturating_add(len).min(block_len);
        if offset >= end {
            return Ok(Some(Bytes::new()));
        }
        let first_chunk = offset / CHUNK;
        let chunks_start = first_chunk * CHUNK;
        let chunks_end = end.div_ceil(CHUNK) * CHUNK;
        let pos = self.slot_pos(slot);
        // Header and data are independent reads: submitting both before awaiting either keeps
        // the range read at one device round trip.
        let (header, data) = futures::join!(
            self.file.read_at_aligned(pos, self.header_len),
            self.file
                .read_at_aligned(pos + (self.header_len + chunks_start) as u64, chunks_end - chunks_start),
        );
        let (header, data) = (header?, data?);
        let valid = (chunks_end.min(block_len)) - chunks_start;
        if data.len() < valid {
            self.drop_corrupt(&key, "short read");
            return Ok(None);
        }
        let data = &data[..valid];
        if let Err(reason) = self
            .check_header(&header, &key, block_len)
            .and_then(|()| self.check_chunks(&header, first_chunk, data))
        {
            self.drop_corrupt(&key, reason);
            return Ok(None);
        }
        Ok(Some(Bytes::copy_from_slice(&data[offset - chunks_start..end - chunks_start])))
    }
}

fn header_crc(region: &[u8]) -> u32 {
    let crc = crc32c::crc32c(&region[..PAGE - 4]);
    crc32c::crc32c_append(crc, &region[PAGE..])
}

async fn serve(state: Rc<State>, mut rx: mpsc::UnboundedReceiver<Request>) {
    while let Some(request) = rx.recv().await {
        let state = Rc::clone(&state);
        state.in_flight.set(state.in_flight.get() + 1);
        glommio::spawn_local(async move {
            // A caller that gave up dropped its receiver; the answer is simply discarded.
            match request {
                Request::Put { key, data, reply } => drop(reply.send(state.put(key, data).await)),
                Request::Get { key, reply } => drop(reply.send(state.get(key).await)),
                Request::Read { key, offset, len, reply } => {
                    drop(reply.send(state.read(key, offset, len).await))
                }
                Request::Ping { reply } => drop(reply.send(Ok(()))),
                Request::Sync { reply } => drop(reply.send(state.file.fdatasync().await.map_err(Into::into))),
            }
            state.in_flight.set(state.in_flight.get() - 1);
        })
        .detach();
    }
    // Let detached requests finish before the executor (and the file) goes away.
    while state.in_flight.get() > 0 {
        glommio::timer::sleep(Duration::from_millis(1)).await;
    }
}
