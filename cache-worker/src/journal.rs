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
//! Blocking file calls run on the blocking pool, never on a runtime thread.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
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
        let error = Arc::new(FirstError::default());
        let (tx, rx) = tokio::sync::mpsc::channel(QUEUED);
        let disk = DiskWriter::new(file, file_path, direct, error.clone());
        tokio::task::spawn_blocking(move || disk.run(rx));
        Ok(JournalWriter {
            journal: self.clone(),
            tx: Some(tx),
            error,
            write_id: write_id.to_string(),
            path: path.to_string(),
            len: 0,
            done: false,
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

/// Bytes a journal writer holds before it writes them (one `O_DIRECT` write).
const WRITE_BUFFER: usize = 8 << 20;
/// Alignment `O_DIRECT` needs of buffers, offsets and lengths.
const ALIGN: usize = 4096;
/// Chunks queued to a journal's writer thread: the next frame is received while the previous
/// one is written.
const QUEUED: usize = 2;

enum Cmd {
    Data(Bytes),
    /// The bytes accepted so far (to write them through to the UFS instead).
    Written(tokio::sync::oneshot::Sender<io::Result<Bytes>>),
    /// Everything on disk and synced: (length, CRC32C).
    Finish(tokio::sync::oneshot::Sender<io::Result<(u64, u32)>>),
}

/// The first error of a journal's writer thread, seen by the next `write`.
#[derive(Default)]
struct FirstError(Mutex<Option<(Option<i32>, io::ErrorKind, String)>>);

impl FirstError {
    fn set(&self, e: &io::Error) {
        lock(&self.0).get_or_insert_with(|| (e.raw_os_error(), e.kind(), e.to_string()));
    }

    fn get(&self) -> Option<io::Error> {
        lock(&self.0).as_ref().map(|(code, kind, msg)| match code {
            Some(c) => io::Error::from_raw_os_error(*c),
            None => io::Error::new(*kind, msg.clone()),
        })
    }
}

/// A journal being written. Its bytes go to a thread of their own, which writes them with
/// `O_DIRECT` from one aligned buffer where the file system allows (no page-cache copy, nothing
/// left to flush at the end; a tmpfs does not) and plain writes otherwise, while the data plane
/// receives the next frame. Dropped without [`finish`](Self::finish), its data is deleted.
pub struct JournalWriter {
    journal: Arc<Journal>,
    tx: Option<tokio::sync::mpsc::Sender<Cmd>>,
    error: Arc<FirstError>,
    write_id: String,
    path: String,
    len: u64,
    done: bool,
}

/// The writer thread's side.
struct DiskWriter {
    file: File,
    /// The data file's path (its bytes are read back through another descriptor).
    path: PathBuf,
    direct: bool,
    buf: Vec<u8>,
    /// Where the aligned part of `buf` starts.
    start: usize,
    filled: usize,
    /// Bytes on disk.
    flushed: u64,
    /// Bytes received after an error (so `Written` still returns every accepted byte).
    after_error: Vec<u8>,
    crc: u32,
    error: Arc<FirstError>,
    failed: bool,
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

impl DiskWriter {
    fn new(file: File, path: PathBuf, direct: bool, error: Arc<FirstError>) -> Self {
        let (buf, start) = if direct {
            let buf = vec![0u8; WRITE_BUFFER + ALIGN];
            let start = buf.as_ptr().align_offset(ALIGN);
            (buf, start)
        } else {
            (Vec::new(), 0)
        };
        Self {
            file,
            path,
            direct,
            buf,
            start,
            filled: 0,
            flushed: 0,
            after_error: Vec::new(),
            crc: 0,
            error,
            failed: false,
        }
    }

    fn fail(&mut self, e: io::Error) {
        self.error.set(&e);
        self.failed = true;
    }

    fn data(&mut self, data: &[u8]) {
        self.crc = crc32c::crc32c_append(self.crc, data);
        if self.failed {
            self.after_error.extend_from_slice(data);
            return;
        }
        if !self.direct {
            match self.file.write_all(data) {
                Ok(()) => self.flushed += data.len() as u64,
                Err(e) => {
                    self.after_error.extend_from_slice(data);
                    self.fail(e);
                }
            }
            return;
        }
        let mut rest = data;
        while !rest.is_empty() {
            let n = rest.len().min(WRITE_BUFFER - self.filled);
            let at = self.start + self.filled;
            self.buf[at..at + n].copy_from_slice(&rest[..n]);
            self.filled += n;
            rest = &rest[n..];
            if self.filled == WRITE_BUFFER {
                let chunk = &self.buf[self.start..self.start + WRITE_BUFFER];
                match self.file.write_all_at(chunk, self.flushed) {
                    Ok(()) => {
                        self.flushed += WRITE_BUFFER as u64;
                        self.filled = 0;
                    }
                    Err(e) => {
                        // The buffer keeps its bytes; the rest waits beside it.
                        self.after_error.extend_from_slice(rest);
                        self.fail(e);
                        return;
                    }
                }
            }
        }
    }

    fn written(&self) -> io::Result<Bytes> {
        let mut out = vec![0u8; self.flushed as usize];
        File::open(&self.path)?.read_exact_at(&mut out, 0)?;
        out.extend_from_slice(&self.buf[self.start..self.start + self.filled]);
        out.extend_from_slice(&self.after_error);
        Ok(Bytes::from(out))
    }

    fn finish(&mut self) -> io::Result<(u64, u32)> {
        if let Some(e) = self.error.get() {
            return Err(e);
        }
        let result = self.write_tail_and_sync();
        if let Err(e) = &result {
            self.error.set(e);
            self.failed = true;
        }
        result
    }

    fn write_tail_and_sync(&mut self) -> io::Result<(u64, u32)> {
        let len = self.flushed + self.filled as u64;
        if self.direct && self.filled > 0 {
            // The tail, padded to the alignment, then the file cut to its length.
            let padded = self.filled.div_ceil(ALIGN) * ALIGN;
            self.buf[self.start + self.filled..self.start + padded].fill(0);
            self.file.write_all_at(&self.buf[self.start..self.start + padded], self.flushed)?;
            self.file.set_len(len)?;
        }
        self.file.sync_data()?;
        Ok((len, self.crc))
    }

    fn run(mut self, mut rx: tokio::sync::mpsc::Receiver<Cmd>) {
        while let Some(cmd) = rx.blocking_recv() {
            match cmd {
                Cmd::Data(data) => self.data(&data),
                Cmd::Written(reply) => {
                    let _ = reply.send(self.written());
                }
                Cmd::Finish(reply) => {
                    let finished = self.finish();
                    let ok = finished.is_ok();
                    let _ = reply.send(finished);
                    if ok {
                        return;
                    }
                    // Failed (a full disk): the bytes stay available to `Written`.
                }
            }
        }
    }
}

impl JournalWriter {
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn write_id(&self) -> &str {
        &self.write_id
    }

    fn gone() -> io::Error {
        io::Error::other("the journal writer stopped")
    }

    /// Queues `data` for the journal. An error of an earlier write is returned here (this one
    /// was not taken then); the bytes accepted so far stay available to [`written`](Self::written).
    pub async fn write(&mut self, data: Bytes) -> io::Result<()> {
        if let Some(e) = self.error.get() {
            return Err(e);
        }
        let len = data.len() as u64;
        let tx = self.tx.as_ref().ok_or_else(Self::gone)?;
        tx.send(Cmd::Data(data)).await.map_err(|_| Self::gone())?;
        self.len += len;
        Ok(())
    }

    /// The bytes accepted so far (to write them through to the UFS instead).
    pub async fn written(&self) -> io::Result<Bytes> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let tx = self.tx.as_ref().ok_or_else(Self::gone)?;
        tx.send(Cmd::Written(reply)).await.map_err(|_| Self::gone())?;
        answer.await.map_err(|_| Self::gone())?
    }

    /// Makes the journal durable: data written and synced, then the record written, fsynced
    /// and renamed into place, then the directory fsynced. When it fails the writer stays, so
    /// that the bytes can still be written elsewhere ([`written`](Self::written)).
    pub async fn finish(&mut self, mtime_ms: i64) -> io::Result<JournalRecord> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let tx = self.tx.as_ref().ok_or_else(Self::gone)?;
        tx.send(Cmd::Finish(reply)).await.map_err(|_| Self::gone())?;
        let (size, crc32c) = answer.await.map_err(|_| Self::gone())??;
        self.tx = None;
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
        // Closing the channel stops the thread (its file closes with it).
        self.tx = None;
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
