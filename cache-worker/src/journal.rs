//! Write-back journals: the bytes of files written to a `mode=write-back` mount, held on this
//! worker's NVMe until their upload to the UFS is done (docs/WRITEBACK.md).
//!
//! One journal is two files in the journal directory: `<write_id>.data` (the file's bytes)
//! and `<write_id>.rec` (a JSON record: path, size, CRC32C). A journal is durable — and may be
//! acknowledged — once its data was fsynced and then its record was written, fsynced and
//! renamed into place (and the directory fsynced): the record is the commit point. At start,
//! data without a record (a write cut off before it was durable) is deleted, never uploaded;
//! a record whose data is missing or of the wrong length is deleted with its data.
//!
//! Blocking file calls run on the blocking pool or the journal's writer threads, never on a
//! runtime thread.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt};
use tracing::{info, warn};

/// What a durable journal holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalRecord {
    pub write_id: String,
    /// Strata path of the file.
    pub path: String,
    pub size: u64,
    /// CRC32C of the whole file, checked again while it is uploaded.
    pub crc32c: u32,
    /// When the write ended (wall clock, ms): the file's modification time.
    pub mtime_ms: i64,
}

struct Held {
    record: JournalRecord,
    durable_at: Instant,
}

pub struct Journal {
    dir: PathBuf,
    held: Mutex<BTreeMap<String, Held>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether an I/O error means the disk (or the user's quota) is full.
pub fn is_disk_full(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
        || e.kind() == io::ErrorKind::StorageFull
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> io::Result<T> + Send + 'static) -> io::Result<T> {
    tokio::task::spawn_blocking(f).await.map_err(io::Error::other)?
}

impl Journal {
    /// Opens (creating) the journal directory and recovers what it holds. Returns the journal
    /// and how many unfinished or broken journals were discarded.
    pub fn open(dir: impl Into<PathBuf>) -> io::Result<(Self, usize)> {
        let dir = dir.into();
        fs::create_dir_all(&dir)?;
        let mut records = BTreeMap::new();
        let mut data = Vec::new();
        for entry in fs::read_dir(&dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(id) = name.strip_suffix(".rec") {
                match fs::read(entry.path())
                    .map_err(|e| e.to_string())
                    .and_then(|b| serde_json::from_slice::<JournalRecord>(&b).map_err(|e| e.to_string()))
                {
                    Ok(r) if r.write_id == id => {
                        records.insert(id.to_string(), r);
                    }
                    Ok(_) | Err(_) => {
                        warn!(file = %entry.path().display(), "unreadable write-back journal record discarded");
                        let _ = fs::remove_file(entry.path());
                    }
                }
            } else if let Some(id) = name.strip_suffix(".data") {
                data.push(id.to_string());
            } else if name.ends_with(".tmp") {
                let _ = fs::remove_file(entry.path());
            }
        }
        let mut discarded = 0;
        for id in &data {
            if !records.contains_key(id) {
                // Never durable, so never acknowledged: it must not reach the UFS.
                info!(write_id = %id, "unfinished write-back journal discarded");
                let _ = fs::remove_file(dir.join(format!("{id}.data")));
                discarded += 1;
            }
        }
        let mut held = BTreeMap::new();
        let now = Instant::now();
        for (id, record) in records {
            let len = fs::metadata(dir.join(format!("{id}.data"))).map(|m| m.len()).ok();
            if len != Some(record.size) {
                warn!(write_id = %id, path = %record.path, ?len, size = record.size, "write-back journal without its bytes discarded");
                let _ = fs::remove_file(dir.join(format!("{id}.rec")));
                let _ = fs::remove_file(dir.join(format!("{id}.data")));
                discarded += 1;
                continue;
            }
            held.insert(id, Held { record, durable_at: now });
        }
        if !held.is_empty() || discarded > 0 {
            info!(dir = %dir.display(), held = held.len(), discarded, "write-back journals recovered");
        }
        Ok((Self { dir, held: Mutex::new(held) }, discarded))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn data_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.data"))
    }

    fn record_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.rec"))
    }

    /// Starts a journal. A write id this worker holds or is writing is refused.
    pub async fn begin(self: &Arc<Self>, write_id: &str, path: &str) -> io::Result<JournalWriter> {
        if lock(&self.held).contains_key(write_id) {
            return Err(io::Error::new(io::ErrorKind::AlreadyExists, format!("write {write_id} exists")));
        }
        let file_path = self.data_path(write_id);
        let opened = file_path.clone();
        let (file, direct) = blocking(move || open_journal_file(&opened)).await?;
        JournalWriter::start(self.clone(), file, direct, write_id, path).inspect_err(|_| {
            let _ = fs::remove_file(&file_path);
        })
    }

    pub fn get(&self, write_id: &str) -> Option<JournalRecord> {
        lock(&self.held).get(write_id).map(|h| h.record.clone())
    }

    /// Every durable journal, with how long ago it became durable (since this start).
    pub fn list(&self) -> Vec<(JournalRecord, std::time::Duration)> {
        lock(&self.held).values().map(|h| (h.record.clone(), h.durable_at.elapsed())).collect()
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        lock(&self.held).values().map(|h| h.record.size).sum()
    }

    /// `len` bytes at `offset` of a durable journal's data.
    pub async fn read_at(&self, write_id: &str, offset: u64, len: u64) -> io::Result<Bytes> {
        if self.get(write_id).is_none() {
            return Err(io::Error::new(io::ErrorKind::NotFound, format!("no write-back journal {write_id}")));
        }
        let file_path = self.data_path(write_id);
        blocking(move || {
            let file = File::open(file_path)?;
            let mut buf = vec![0u8; len as usize];
            file.read_exact_at(&mut buf, offset)?;
            Ok(Bytes::from(buf))
        })
        .await
    }

    /// Opens a durable journal's data for an upload (reading it whole).
    pub async fn open_data(&self, write_id: &str) -> io::Result<File> {
        let file_path = self.data_path(write_id);
        blocking(move || File::open(file_path)).await
    }

    /// Deletes a journal (its file was uploaded, replaced or never committed).
    pub fn remove(&self, write_id: &str) {
        lock(&self.held).remove(write_id);
        let _ = fs::remove_file(self.record_path(write_id));
        let _ = fs::remove_file(self.data_path(write_id));
    }
}

/// Bytes of one journal write. The data plane receives a file's bytes straight into aligned
/// buffers of this size and each full one goes to disk in one `pwrite` (`O_DIRECT` where the
/// file system allows): no second copy, and no fresh buffer per frame.
const WRITE_BUFFER: usize = 8 << 20;
/// Alignment `O_DIRECT` needs of buffers, offsets and lengths.
const ALIGN: usize = 4096;
/// Writes in flight per journal, each on a thread of its own: the disk gets the next buffer
/// while one is still being written, and one buffer's CRC overlaps the other's write.
const WRITERS: usize = 2;
/// Buffers a journal holds at most: one being received, the rest written or queued.
const BUFFERS: usize = WRITERS + 2;
/// Bytes received at a time and checksummed at once, while they are still in the CPU's cache:
/// a CRC over a whole 8 MiB buffer re-reads it from memory, and on this kind of VM that cost
/// the journal a fifth of its disk rate (the host's copy of the write competes for the same
/// memory bandwidth).
const RECEIVE_WINDOW: usize = 512 << 10;
/// Free buffers kept for the next journals (a new 8 MiB buffer is a new mapping whose pages
/// fault and are zeroed on first touch).
const POOLED: usize = 16;

static POOL: Mutex<Vec<Chunk>> = Mutex::new(Vec::new());

/// An aligned buffer of [`WRITE_BUFFER`] bytes, received into and written from.
struct Chunk {
    mem: Vec<u8>,
    /// Where the aligned part of `mem` starts.
    start: usize,
    filled: usize,
    /// CRC32C of the `filled` bytes.
    crc: u32,
}

impl Chunk {
    fn take() -> Self {
        if let Some(chunk) = lock(&POOL).pop() {
            return chunk;
        }
        let mem = vec![0u8; WRITE_BUFFER + ALIGN];
        let start = mem.as_ptr().align_offset(ALIGN);
        Self { mem, start, filled: 0, crc: 0 }
    }

    fn give_back(mut self) {
        self.filled = 0;
        self.crc = 0;
        let mut pool = lock(&POOL);
        if pool.len() < POOLED {
            pool.push(self);
        }
    }

    fn bytes(&self) -> &[u8] {
        &self.mem[self.start..self.start + self.filled]
    }

    fn space(&mut self) -> &mut [u8] {
        &mut self.mem[self.start + self.filled..self.start + WRITE_BUFFER]
    }

    /// Takes `n` more bytes, just written into [`space`](Self::space), into the CRC.
    fn filled_by(&mut self, n: usize) {
        let new = &self.mem[self.start + self.filled..self.start + self.filled + n];
        self.crc = crc32c::crc32c_append(self.crc, new);
        self.filled += n;
    }

    /// Receives `n` bytes of `stream`, a window at a time, each checksummed while it is hot.
    /// On an error none of the `n` bytes count, as if the read had not begun.
    async fn receive<R: AsyncRead + Unpin>(&mut self, stream: &mut R, n: usize) -> io::Result<()> {
        let (filled, crc) = (self.filled, self.crc);
        let mut left = n;
        while left > 0 {
            let w = left.min(RECEIVE_WINDOW);
            if let Err(e) = stream.read_exact(&mut self.space()[..w]).await {
                (self.filled, self.crc) = (filled, crc);
                return Err(e);
            }
            self.filled_by(w);
            left -= w;
        }
        Ok(())
    }

    /// The bytes to write: the last, partial buffer of an `O_DIRECT` file padded to the
    /// alignment (the file is cut to its length at the end).
    fn padded_for(&mut self, direct: bool) -> &[u8] {
        let len = if direct { self.filled.div_ceil(ALIGN) * ALIGN } else { self.filled };
        self.mem[self.start + self.filled..self.start + len].fill(0);
        &self.mem[self.start..self.start + len]
    }
}

struct Job {
    offset: u64,
    chunk: Chunk,
}

/// What a journal's writer threads did.
#[derive(Default)]
struct Written {
    /// Every buffer the threads took, by offset: (length, CRC32C).
    pieces: BTreeMap<u64, (usize, u32)>,
    /// Bytes not on disk (their write failed, or came after a failure), by offset.
    kept: BTreeMap<u64, Vec<u8>>,
    /// The first write error.
    error: Option<(Option<i32>, io::ErrorKind, String)>,
}

impl Written {
    fn fail(&mut self, e: &io::Error) {
        self.error.get_or_insert_with(|| (e.raw_os_error(), e.kind(), e.to_string()));
    }

    fn error(&self) -> Option<io::Error> {
        self.error.as_ref().map(|(code, kind, msg)| match code {
            Some(c) => io::Error::from_raw_os_error(*c),
            None => io::Error::new(*kind, msg.clone()),
        })
    }

    /// Length and CRC32C of the pieces, in order.
    fn total(&self) -> (u64, u32) {
        self.pieces
            .values()
            .fold((0, 0), |(len, crc), &(n, c)| (len + n as u64, crc32c::crc32c_combine(crc, c, n)))
    }
}

/// A writer thread: write a buffer at its offset, give it back.
fn write_chunks(
    file: Arc<File>,
    direct: bool,
    jobs: Arc<Mutex<std::sync::mpsc::Receiver<Job>>>,
    written: Arc<Mutex<Written>>,
    done: tokio::sync::mpsc::UnboundedSender<Chunk>,
) {
    loop {
        let Ok(Job { offset, mut chunk }) = lock(&jobs).recv() else { return };
        let crc = chunk.crc;
        // Its own statement: a lock taken in a `match` scrutinee would be held through the
        // write, stalling the other writer and the receiver.
        let failed = lock(&written).error();
        let result = match failed {
            Some(e) => Err(e),
            None => file.write_all_at(chunk.padded_for(direct), offset),
        };
        {
            let mut w = lock(&written);
            w.pieces.insert(offset, (chunk.filled, crc));
            if let Err(e) = result {
                w.kept.insert(offset, chunk.bytes().to_vec());
                w.fail(&e);
            }
        }
        if let Err(returned) = done.send(chunk) {
            returned.0.give_back();
        }
    }
}

/// Why [`JournalWriter::receive`] failed.
#[derive(Debug)]
pub enum ReceiveError {
    /// Reading the stream failed: the bytes did not all arrive.
    Stream(io::Error),
    /// The journal's disk failed (e.g. it is full). Every byte was received and is kept for
    /// [`JournalWriter::written`].
    Disk(io::Error),
}

/// A journal being written. Its bytes are received straight into aligned buffers, which
/// [`WRITERS`] threads write at their offsets — with `O_DIRECT` where the file system allows (no
/// page-cache copy, nothing left to flush at the end; a tmpfs does not), plain writes otherwise
/// — while the data plane receives the next. Dropped without [`finish`](Self::finish), its data
/// is deleted.
pub struct JournalWriter {
    journal: Arc<Journal>,
    file: Arc<File>,
    direct: bool,
    jobs: Option<std::sync::mpsc::Sender<Job>>,
    returned: tokio::sync::mpsc::UnboundedReceiver<Chunk>,
    written: Arc<Mutex<Written>>,
    /// The buffer being received into.
    current: Option<Chunk>,
    /// Buffers with the threads.
    in_flight: usize,
    /// Bytes handed to the threads: the next buffer's offset.
    sent: u64,
    write_id: String,
    path: String,
    done: bool,
}

fn open_journal_file(path: &Path) -> io::Result<(File, bool)> {
    use std::os::unix::fs::OpenOptionsExt;
    match OpenOptions::new().write(true).create_new(true).custom_flags(libc::O_DIRECT).open(path) {
        Ok(f) => Ok((f, true)),
        // No O_DIRECT here (tmpfs, some network file systems): the page cache then.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            let _ = fs::remove_file(path);
            Ok((OpenOptions::new().write(true).create_new(true).open(path)?, false))
        }
        Err(e) => Err(e),
    }
}

impl JournalWriter {
    fn start(
        journal: Arc<Journal>,
        file: File,
        direct: bool,
        write_id: &str,
        path: &str,
    ) -> io::Result<Self> {
        let file = Arc::new(file);
        let (jobs, queue) = std::sync::mpsc::channel();
        let queue = Arc::new(Mutex::new(queue));
        let (done, returned) = tokio::sync::mpsc::unbounded_channel();
        let written = Arc::new(Mutex::new(Written::default()));
        // Threads of their own, not the runtime's blocking pool: they live as long as the
        // stream, and enough concurrent writes would otherwise take every pool thread and leave
        // none for the `finish` that would free them.
        for _ in 0..WRITERS {
            let (file, queue, written, done) = (file.clone(), queue.clone(), written.clone(), done.clone());
            std::thread::Builder::new()
                .name("strata-journal".into())
                .spawn(move || write_chunks(file, direct, queue, written, done))?;
        }
        Ok(Self {
            journal,
            file,
            direct,
            jobs: Some(jobs),
            returned,
            written,
            current: None,
            in_flight: 0,
            sent: 0,
            write_id: write_id.to_string(),
            path: path.to_string(),
            done: false,
        })
    }

    /// Bytes received: those handed to the threads and those in the buffer being filled.
    pub fn len(&self) -> u64 {
        self.sent + self.current.as_ref().map_or(0, |c| c.filled as u64)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn write_id(&self) -> &str {
        &self.write_id
    }

    fn gone() -> io::Error {
        io::Error::other("the journal writer stopped")
    }

    fn error(&self) -> Option<io::Error> {
        lock(&self.written).error()
    }

    /// A buffer to receive into: one the threads gave back, a pooled one, or — with
    /// [`BUFFERS`] out — the next one they give back.
    async fn free_chunk(&mut self) -> io::Result<Chunk> {
        let chunk = match self.returned.try_recv() {
            Ok(chunk) => chunk,
            Err(_) if self.in_flight + 1 < BUFFERS => return Ok(Chunk::take()),
            Err(_) => self.returned.recv().await.ok_or_else(Self::gone)?,
        };
        self.in_flight -= 1;
        Ok(Chunk { filled: 0, crc: 0, ..chunk })
    }

    fn submit(&mut self, chunk: Chunk) -> io::Result<()> {
        let offset = self.sent;
        self.sent += chunk.filled as u64;
        let jobs = self.jobs.as_ref().ok_or_else(Self::gone)?;
        jobs.send(Job { offset, chunk }).map_err(|_| Self::gone())?;
        self.in_flight += 1;
        Ok(())
    }

    /// Waits until the threads wrote every buffer they were given.
    async fn drain(&mut self) -> io::Result<()> {
        while self.in_flight > 0 {
            let chunk = self.returned.recv().await.ok_or_else(Self::gone)?;
            self.in_flight -= 1;
            chunk.give_back();
        }
        Ok(())
    }

    /// Receives `len` bytes of `stream` into the journal. A disk error (this write's or an
    /// earlier one's) is returned once the bytes are in: they stay available to
    /// [`written`](Self::written).
    pub async fn receive<R: AsyncRead + Unpin>(
        &mut self,
        stream: &mut R,
        mut len: usize,
    ) -> Result<(), ReceiveError> {
        while len > 0 {
            let mut chunk = match self.current.take() {
                Some(chunk) => chunk,
                None => self.free_chunk().await.map_err(ReceiveError::Disk)?,
            };
            let n = len.min(WRITE_BUFFER - chunk.filled);
            if let Err(e) = chunk.receive(stream, n).await {
                self.current = Some(chunk);
                return Err(ReceiveError::Stream(e));
            }
            len -= n;
            if chunk.filled == WRITE_BUFFER {
                self.submit(chunk).map_err(ReceiveError::Disk)?;
            } else {
                self.current = Some(chunk);
            }
        }
        match self.error() {
            Some(e) => Err(ReceiveError::Disk(e)),
            None => Ok(()),
        }
    }

    /// Takes `data` into the journal (as [`receive`](Self::receive) does).
    pub async fn write(&mut self, data: Bytes) -> io::Result<()> {
        let mut reader = &data[..];
        self.receive(&mut reader, data.len()).await.map_err(|e| match e {
            ReceiveError::Stream(e) | ReceiveError::Disk(e) => e,
        })
    }

    /// The bytes accepted so far (to write them through to the UFS instead).
    pub async fn written(&mut self) -> io::Result<Bytes> {
        self.drain().await?;
        let pieces: Vec<(u64, usize, Option<Vec<u8>>)> = {
            let w = lock(&self.written);
            w.pieces.iter().map(|(&offset, &(len, _))| (offset, len, w.kept.get(&offset).cloned())).collect()
        };
        let tail = self.current.as_ref().map(|c| c.bytes().to_vec()).unwrap_or_default();
        let data_path = self.journal.data_path(&self.write_id);
        let total = self.len() as usize;
        blocking(move || {
            let mut out = Vec::with_capacity(total);
            let mut file = None;
            for (offset, len, kept) in pieces {
                match kept {
                    Some(bytes) => out.extend_from_slice(&bytes),
                    None => {
                        let file = match &mut file {
                            Some(f) => f,
                            None => file.insert(File::open(&data_path)?),
                        };
                        let at = out.len();
                        out.resize(at + len, 0);
                        file.read_exact_at(&mut out[at..], offset)?;
                    }
                }
            }
            out.extend_from_slice(&tail);
            Ok(Bytes::from(out))
        })
        .await
    }

    /// Makes the journal durable: data written and synced, then the record written, fsynced
    /// and renamed into place, then the directory fsynced. When it fails the writer stays, so
    /// that the bytes can still be written elsewhere ([`written`](Self::written)).
    pub async fn finish(&mut self, mtime_ms: i64) -> io::Result<JournalRecord> {
        if let Some(chunk) = self.current.take() {
            if chunk.filled > 0 {
                self.submit(chunk)?;
            } else {
                chunk.give_back();
            }
        }
        self.drain().await?;
        if let Some(e) = self.error() {
            return Err(e);
        }
        let (size, crc32c) = lock(&self.written).total();
        let (file, direct) = (self.file.clone(), self.direct);
        let synced = blocking(move || {
            if direct && size % ALIGN as u64 != 0 {
                file.set_len(size)?;
            }
            file.sync_data()
        })
        .await;
        if let Err(e) = synced {
            lock(&self.written).fail(&e);
            return Err(e);
        }
        self.jobs = None;
        let record = JournalRecord {
            write_id: self.write_id.clone(),
            path: self.path.clone(),
            size,
            crc32c,
            mtime_ms,
        };
        let (journal, rec) = (self.journal.clone(), record.clone());
        let result = blocking(move || {
            let tmp = journal.dir.join(format!("{}.rec.tmp", rec.write_id));
            let mut out = File::create(&tmp)?;
            out.write_all(&serde_json::to_vec(&rec).map_err(io::Error::other)?)?;
            out.sync_all()?;
            fs::rename(&tmp, journal.record_path(&rec.write_id))?;
            File::open(&journal.dir)?.sync_all()
        })
        .await;
        if let Err(e) = result {
            let _ = fs::remove_file(self.journal.dir.join(format!("{}.rec.tmp", self.write_id)));
            let _ = fs::remove_file(self.journal.record_path(&self.write_id));
            return Err(e);
        }
        self.done = true;
        lock(&self.journal.held)
            .insert(self.write_id.clone(), Held { record: record.clone(), durable_at: Instant::now() });
        Ok(record)
    }
}

impl Drop for JournalWriter {
    fn drop(&mut self) {
        // Closing the queue stops the threads once they wrote what they hold (the file closes
        // with the last of them).
        self.jobs = None;
        if let Some(chunk) = self.current.take() {
            chunk.give_back();
        }
        while let Ok(chunk) = self.returned.try_recv() {
            chunk.give_back();
        }
        if !self.done {
            let _ = fs::remove_file(self.journal.data_path(&self.write_id));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn durable_journals_survive_a_restart_and_unfinished_ones_do_not() {
        let dir = tempfile::tempdir().unwrap();
        let (journal, _) = Journal::open(dir.path()).unwrap();
        let journal = Arc::new(journal);
        let mut w = journal.begin("w1", "/wb/a").await.unwrap();
        w.write(Bytes::from_static(b"hello ")).await.unwrap();
        w.write(Bytes::from_static(b"world")).await.unwrap();
        let rec = w.finish(7).await.unwrap();
        assert_eq!((rec.size, rec.crc32c), (11, crc32c::crc32c(b"hello world")));
        assert!(journal.begin("w1", "/wb/a").await.is_err(), "a held id is not written twice");
        // A process that died mid-write left data and no record.
        fs::write(dir.path().join("w2.data"), b"half").unwrap();
        drop(journal);

        let (journal, discarded) = Journal::open(dir.path()).unwrap();
        assert_eq!(discarded, 1);
        assert!(!dir.path().join("w2.data").exists(), "never durable: gone");
        assert_eq!(journal.get("w1"), Some(rec));
        assert_eq!(&journal.read_at("w1", 6, 5).await.unwrap()[..], b"world");
        journal.remove("w1");
        assert!(journal.list().is_empty());
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[tokio::test]
    async fn a_record_without_its_bytes_is_discarded() {
        let dir = tempfile::tempdir().unwrap();
        let (journal, _) = Journal::open(dir.path()).unwrap();
        let journal = Arc::new(journal);
        let mut w = journal.begin("w1", "/wb/a").await.unwrap();
        w.write(Bytes::from_static(b"0123456789")).await.unwrap();
        w.finish(1).await.unwrap();
        drop(journal);
        // Bytes lost behind the record's back (a truncated file).
        OpenOptions::new().write(true).open(dir.path().join("w1.data")).unwrap().set_len(4).unwrap();
        let (journal, discarded) = Journal::open(dir.path()).unwrap();
        assert_eq!((discarded, journal.list().len()), (1, 0));
    }

    #[tokio::test]
    async fn a_dropped_writer_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Arc::new(Journal::open(dir.path()).unwrap().0);
        let mut w = journal.begin("w1", "/wb/a").await.unwrap();
        w.write(Bytes::from_static(b"abc")).await.unwrap();
        assert_eq!(&w.written().await.unwrap()[..], b"abc");
        drop(w);
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[tokio::test]
    async fn a_stream_cut_mid_frame_keeps_only_whole_frames() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Arc::new(Journal::open(dir.path()).unwrap().0);
        let mut w = journal.begin("w1", "/wb/a").await.unwrap();
        let first: Vec<u8> = (0..WRITE_BUFFER + 10).map(|i| i as u8).collect();
        w.write(Bytes::from(first.clone())).await.unwrap();
        let mut short: &[u8] = b"0123456789";
        assert!(matches!(w.receive(&mut short, 20).await, Err(ReceiveError::Stream(_))));
        assert_eq!(w.len(), first.len() as u64);
        // Cut after whole receive windows were taken in (and checksummed): they do not count.
        let windows = vec![7u8; 2 * RECEIVE_WINDOW + 10];
        let mut cut: &[u8] = &windows;
        assert!(matches!(w.receive(&mut cut, 3 * RECEIVE_WINDOW).await, Err(ReceiveError::Stream(_))));
        assert_eq!(w.len(), first.len() as u64);
        assert_eq!(&w.written().await.unwrap()[..], &first[..]);
        drop(w);
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    /// The CRC taken window by window as bytes arrive is the CRC of the file, also after a cut
    /// frame was rolled back.
    #[tokio::test]
    async fn the_record_carries_the_crc_of_exactly_the_kept_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Arc::new(Journal::open(dir.path()).unwrap().0);
        let mut w = journal.begin("w1", "/wb/a").await.unwrap();
        let first: Vec<u8> = (0..WRITE_BUFFER + RECEIVE_WINDOW + 3).map(|i| (i * 7) as u8).collect();
        w.write(Bytes::from(first.clone())).await.unwrap();
        let junk = vec![9u8; RECEIVE_WINDOW + 1];
        let mut cut: &[u8] = &junk;
        assert!(matches!(w.receive(&mut cut, 2 * RECEIVE_WINDOW).await, Err(ReceiveError::Stream(_))));
        let second: Vec<u8> = (0..RECEIVE_WINDOW * 3 + 5).map(|i| (i * 13) as u8).collect();
        w.write(Bytes::from(second.clone())).await.unwrap();
        let record = w.finish(0).await.unwrap();
        let whole = [first, second].concat();
        assert_eq!(record.size, whole.len() as u64);
        assert_eq!(record.crc32c, crc32c::crc32c(&whole));
        assert_eq!(fs::read(dir.path().join("w1.data")).unwrap(), whole);
    }

    /// More journals open at once than the runtime has blocking threads: each journal's writers
    /// are threads of their own, so every `finish` still finds a blocking thread.
    #[test]
    fn more_open_journals_than_blocking_threads_all_finish() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .max_blocking_threads(4)
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let journal = Arc::new(Journal::open(dir.path()).unwrap().0);
        let all = async {
            let mut writers = Vec::new();
            for i in 0..8 {
                let mut w = journal.begin(&format!("w{i}"), "/wb/f").await.unwrap();
                w.write(Bytes::from(vec![i as u8; WRITE_BUFFER + 3])).await.unwrap();
                writers.push(w);
            }
            for w in &mut writers {
                w.finish(1).await.unwrap();
            }
        };
        runtime.block_on(async {
            tokio::time::timeout(std::time::Duration::from_secs(60), all)
                .await
                .expect("every journal finishes")
        });
        assert_eq!(journal.list().len(), 8);
    }

    /// Sizes around the O_DIRECT buffer and alignment: what comes back is what went in, and
    /// its CRC (ext4 here takes O_DIRECT; a tmpfs takes the buffered path).
    #[tokio::test]
    async fn direct_and_buffered_journals_hold_every_byte() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Arc::new(Journal::open(dir.path()).unwrap().0);
        let sizes = [
            0usize,
            1,
            4095,
            4096,
            4097,
            WRITE_BUFFER - 1,
            WRITE_BUFFER,
            WRITE_BUFFER + 4097,
            3 * WRITE_BUFFER + 5,
        ];
        for (i, size) in sizes.into_iter().enumerate() {
            let data: Vec<u8> = (0..size).map(|j| (j * 31 + i) as u8).collect();
            let id = format!("w{i}");
            let mut w = journal.begin(&id, "/wb/f").await.unwrap();
            for piece in data.chunks(1_000_003) {
                w.write(Bytes::copy_from_slice(piece)).await.unwrap();
            }
            assert_eq!(&w.written().await.unwrap()[..], &data[..], "{size} bytes so far");
            let rec = w.finish(1).await.unwrap();
            assert_eq!((rec.size, rec.crc32c), (size as u64, crc32c::crc32c(&data)), "{size}");
            assert_eq!(fs::metadata(dir.path().join(format!("{id}.data"))).unwrap().len(), size as u64);
            if size > 0 {
                assert_eq!(&journal.read_at(&id, 0, size as u64).await.unwrap()[..], &data[..], "{size}");
            }
        }
    }
}
