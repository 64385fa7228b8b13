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
        let file = blocking(move || OpenOptions::new().write(true).create_new(true).open(file_path)).await?;
        Ok(JournalWriter {
            journal: self.clone(),
            file: Some(file),
            write_id: write_id.to_string(),
            path: path.to_string(),
            len: 0,
            crc: 0,
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

/// A journal being written. Dropped without [`finish`](Self::finish), its data is deleted.
pub struct JournalWriter {
    journal: Arc<Journal>,
    file: Option<File>,
    write_id: String,
    path: String,
    len: u64,
    crc: u32,
    done: bool,
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

    pub async fn write(&mut self, data: Bytes) -> io::Result<()> {
        let mut file = self.file.take().ok_or_else(|| io::Error::other("journal writer closed"))?;
        let (file, written) = tokio::task::spawn_blocking(move || {
            let r = file.write_all(&data).map(|()| data);
            (file, r)
        })
        .await
        .map_err(io::Error::other)?;
        self.file = Some(file);
        let data = written?;
        self.crc = crc32c::crc32c_append(self.crc, &data);
        self.len += data.len() as u64;
        Ok(())
    }

    /// The bytes written so far (to write them through to the UFS instead).
    pub async fn written(&self) -> io::Result<Bytes> {
        let (journal, id, len) = (self.journal.clone(), self.write_id.clone(), self.len);
        blocking(move || {
            let file = File::open(journal.data_path(&id))?;
            let mut buf = vec![0u8; len as usize];
            file.read_exact_at(&mut buf, 0)?;
            Ok(Bytes::from(buf))
        })
        .await
    }

    /// Makes the journal durable: data fsynced, then the record written, fsynced and renamed
    /// into place, then the directory fsynced.
    pub async fn finish(mut self, mtime_ms: i64) -> io::Result<JournalRecord> {
        let file = self.file.take().ok_or_else(|| io::Error::other("journal writer closed"))?;
        let record = JournalRecord {
            write_id: self.write_id.clone(),
            path: self.path.clone(),
            size: self.len,
            crc32c: self.crc,
            mtime_ms,
        };
        let (journal, rec) = (self.journal.clone(), record.clone());
        let result = blocking(move || {
            file.sync_data()?;
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
        let mut half = journal.begin("w2", "/wb/b").await.unwrap();
        half.write(Bytes::from_static(b"half")).await.unwrap();
        std::mem::forget(half); // the process dies here: no drop, no record
        assert!(dir.path().join("w2.data").exists());
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
}
