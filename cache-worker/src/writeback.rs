//! The worker's half of write-back (docs/WRITEBACK.md): the journals it holds, their uploads to
//! the UFS, and the two calls it makes to the master — commit an acknowledged write, report an
//! upload's end — behind [`WriteBackMaster`] so the storage side never imports gRPC.
//!
//! An upload streams the journal to a UFS writer (multipart on object stores) and checks the
//! journal's CRC32C on the way: a journal that no longer matches is aborted before the object
//! is published. UFS errors are retried with backoff (`UPLOAD_ATTEMPTS`); every failed attempt
//! is reported, and the last one gives up (the master shows `failed` until `strata sync`).
//! Uploads per mount are capped (`upload_parallelism`) and paced (`upload_bandwidth`).

use std::collections::{HashMap, HashSet};
use std::io;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use strata_common::background::Backoff;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::journal::{Journal, JournalRecord};
use crate::metrics_defs as m;
use crate::mounts::Mounts;

/// Attempts of one upload before it gives up.
pub const UPLOAD_ATTEMPTS: u32 = 5;
/// Bytes read from a journal and handed to the UFS writer at a time.
const UPLOAD_CHUNK: usize = 8 << 20;

/// A write the primary commits with the master.
#[derive(Debug, Clone)]
pub struct CommitWrite {
    pub path: String,
    pub write_id: String,
    pub size: u64,
    pub mtime_ms: i64,
    /// Worker ids holding the journal, this worker first.
    pub holders: Vec<String>,
    /// Written through to the UFS already (disk-full fallback).
    pub persisted: bool,
}

/// The master as write-back needs it.
#[async_trait]
pub trait WriteBackMaster: Send + Sync + 'static {
    /// Records an acknowledged write; answers whether to upload it now.
    async fn commit(&self, c: CommitWrite) -> Result<bool, String>;
    /// Reports an upload's end (`error` empty: done); answers write ids to upload next.
    async fn upload_result(
        &self,
        path: &str,
        write_id: &str,
        error: &str,
        gave_up: bool,
    ) -> Result<Vec<String>, String>;
}

/// A journal as the heartbeat reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldReport {
    pub write_id: String,
    pub path: String,
    pub uploading: bool,
    pub age_ms: u64,
}

/// Per-mount caps on uploads.
struct MountCaps {
    slots: Semaphore,
    /// Bytes per second, 0 for none.
    bandwidth: u64,
    /// When the next byte may go (pacing shared by the mount's uploads).
    next_free: tokio::sync::Mutex<Instant>,
}

pub struct WriteBack {
    journal: Arc<Journal>,
    mounts: Arc<Mounts>,
    worker_id: String,
    master: OnceLock<Arc<dyn WriteBackMaster>>,
    uploading: Mutex<HashSet<String>>,
    caps: Mutex<HashMap<String, Arc<MountCaps>>>,
    cancel: CancellationToken,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why an upload attempt failed.
#[derive(Debug)]
enum UploadError {
    /// The journal is gone (dropped meanwhile): nothing to do.
    Gone,
    /// Worth another attempt.
    Retry(String),
    /// Another attempt would fail the same way.
    Fatal(String),
}

impl WriteBack {
    pub fn new(
        journal: Arc<Journal>,
        mounts: Arc<Mounts>,
        worker_id: String,
        cancel: CancellationToken,
    ) -> Self {
        Self {
            journal,
            mounts,
            worker_id,
            master: OnceLock::new(),
            uploading: Mutex::new(HashSet::new()),
            caps: Mutex::new(HashMap::new()),
            cancel,
        }
    }

    pub fn journal(&self) -> &Arc<Journal> {
        &self.journal
    }

    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }

    /// Sets the master link. Set once.
    pub fn set_master(&self, master: Arc<dyn WriteBackMaster>) {
        let _ = self.master.set(master);
    }

    pub async fn commit(&self, c: CommitWrite) -> Result<bool, String> {
        let master = self.master.get().ok_or("this worker has no master link")?;
        master.commit(c).await
    }

    /// What the heartbeat tells the master.
    pub fn reports(&self) -> Vec<HeldReport> {
        let uploading = lock(&self.uploading).clone();
        let held = self.journal.list();
        metrics::gauge!(m::WRITEBACK_JOURNAL_BYTES).set(held.iter().map(|(r, _)| r.size).sum::<u64>() as f64);
        metrics::gauge!(m::WRITEBACK_JOURNALS).set(held.len() as f64);
        held.into_iter()
            .map(|(r, age)| HeldReport {
                uploading: uploading.contains(&r.write_id),
                write_id: r.write_id,
                path: r.path,
                age_ms: age.as_millis() as u64,
            })
            .collect()
    }

    /// Deletes a journal the master no longer needs (not while it is being uploaded).
    pub fn drop_journal(&self, write_id: &str) {
        if lock(&self.uploading).contains(write_id) {
            return;
        }
        if let Some(r) = self.journal.get(write_id) {
            debug!(write_id, path = %r.path, "write-back journal dropped");
        }
        self.journal.remove(write_id);
    }

    /// Starts uploading a journal this worker holds (once: a second order while it runs is
    /// ignored).
    pub fn upload(self: &Arc<Self>, write_id: String) {
        if self.journal.get(&write_id).is_none() || !lock(&self.uploading).insert(write_id.clone()) {
            return;
        }
        let this = self.clone();
        tokio::spawn(async move {
            let cancel = this.cancel.clone();
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = this.clone().upload_with_retries(&write_id) => {}
            }
            lock(&this.uploading).remove(&write_id);
        });
    }

    async fn upload_with_retries(self: Arc<Self>, write_id: &str) {
        let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
        for attempt in 1..=UPLOAD_ATTEMPTS {
            let Some(record) = self.journal.get(write_id) else { return };
            let started = Instant::now();
            let outcome = self.upload_once(&record).await;
            let (error, gave_up) = match outcome {
                Ok(()) => {
                    metrics::counter!(m::WRITEBACK_UPLOADED_BYTES).increment(record.size);
                    metrics::counter!(m::WRITEBACK_UPLOADS, "result" => "persisted").increment(1);
                    let ms = started.elapsed().as_millis() as u64;
                    info!(path = %record.path, write_id, bytes = record.size, ms, "write-back file uploaded");
                    (String::new(), false)
                }
                Err(UploadError::Gone) => return,
                Err(UploadError::Retry(e)) => {
                    metrics::counter!(m::WRITEBACK_UPLOADS, "result" => "retried").increment(1);
                    warn!(path = %record.path, write_id, attempt, err = %e, "write-back upload failed");
                    (e, attempt == UPLOAD_ATTEMPTS)
                }
                Err(UploadError::Fatal(e)) => {
                    warn!(path = %record.path, write_id, err = %e, "write-back upload cannot succeed");
                    (e, true)
                }
            };
            if gave_up {
                metrics::counter!(m::WRITEBACK_UPLOADS, "result" => "failed").increment(1);
            }
            let next = self.report(&record, &error, gave_up).await;
            if error.is_empty() || gave_up {
                for id in next {
                    self.upload(id);
                }
                return;
            }
            tokio::time::sleep(backoff.next_delay()).await;
        }
    }

    /// Reports to the master, retrying until it answers (a lost report would leave the file
    /// `uploading` until this worker's next heartbeat shows it idle).
    async fn report(&self, record: &JournalRecord, error: &str, gave_up: bool) -> Vec<String> {
        let Some(master) = self.master.get() else { return Vec::new() };
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
        for _ in 0..20 {
            match master.upload_result(&record.path, &record.write_id, error, gave_up).await {
                Ok(next) => return next,
                Err(e) => {
                    debug!(path = %record.path, err = %e, "cannot report an upload; retrying");
                    tokio::time::sleep(backoff.next_delay()).await;
                }
            }
        }
        Vec::new()
    }

    fn caps(&self, mount_path: &str, parallelism: u32, bandwidth: u64) -> Arc<MountCaps> {
        let mut caps = lock(&self.caps);
        let entry = caps.entry(mount_path.to_string()).or_insert_with(|| {
            Arc::new(MountCaps {
                slots: Semaphore::new(parallelism as usize),
                bandwidth,
                next_free: tokio::sync::Mutex::new(Instant::now()),
            })
        });
        if entry.bandwidth != bandwidth {
            // The options changed: new caps for uploads from now on.
            *entry = Arc::new(MountCaps {
                slots: Semaphore::new(parallelism as usize),
                bandwidth,
                next_free: tokio::sync::Mutex::new(Instant::now()),
            });
        }
        entry.clone()
    }

    async fn upload_once(&self, record: &JournalRecord) -> Result<(), UploadError> {
        let resolved =
            self.mounts.resolve(&record.path).await.map_err(|e| UploadError::Retry(e.to_string()))?;
        let mount = resolved.mount;
        let ufs = mount
            .ufs
            .as_write()
            .ok_or_else(|| UploadError::Fatal(format!("the mount of {} cannot be written", record.path)))?;
        let caps = self.caps(&mount.path, mount.options.upload_parallelism, mount.options.upload_bandwidth);
        let _slot = caps.slots.acquire().await.map_err(|_| UploadError::Gone)?;
        let file = match self.journal.open_data(&record.write_id).await {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(UploadError::Gone),
            Err(e) => return Err(UploadError::Retry(format!("journal: {e}"))),
        };
        let file = Arc::new(file);
        let mut writer = ufs.writer(&resolved.rel).await.map_err(|e| classify(e.to_string(), &e))?;
        let mut offset = 0u64;
        let mut crc = 0u32;
        while offset < record.size {
            let len = (record.size - offset).min(UPLOAD_CHUNK as u64);
            let f = file.clone();
            let chunk = tokio::task::spawn_blocking(move || {
                use std::os::unix::fs::FileExt;
                let mut buf = vec![0u8; len as usize];
                f.read_exact_at(&mut buf, offset).map(|()| Bytes::from(buf))
            })
            .await
            .map_err(|e| UploadError::Retry(e.to_string()))
            .and_then(|r| r.map_err(|e| UploadError::Retry(format!("journal read: {e}"))));
            let chunk = match chunk {
                Ok(c) => c,
                Err(e) => {
                    let _ = writer.abort().await;
                    return Err(e);
                }
            };
            crc = crc32c::crc32c_append(crc, &chunk);
            offset += len;
            pace(&caps, len).await;
            if let Err(e) = writer.write(chunk).await {
                let _ = writer.abort().await;
                return Err(classify(e.to_string(), &e));
            }
        }
        if crc != record.crc32c {
            let _ = writer.abort().await;
            // The bytes on this disk changed since they were acknowledged: another holder's
            // copy must be uploaded instead.
            return Err(UploadError::Fatal(format!(
                "journal of {} on worker {} is corrupt (checksum mismatch)",
                record.path, self.worker_id
            )));
        }
        writer.close().await.map_err(|e| classify(e.to_string(), &e))
    }
}

fn classify(message: String, e: &strata_ufs::UfsError) -> UploadError {
    match e.kind() {
        strata_common::ErrorKind::PermissionDenied
        | strata_common::ErrorKind::InvalidArgument
        | strata_common::ErrorKind::IsDirectory => UploadError::Fatal(message),
        _ => UploadError::Retry(message),
    }
}

/// Waits until `len` more bytes fit the mount's bandwidth cap.
async fn pace(caps: &MountCaps, len: u64) {
    if caps.bandwidth == 0 {
        return;
    }
    let cost = Duration::from_secs_f64(len as f64 / caps.bandwidth as f64);
    let start = {
        let mut next = caps.next_free.lock().await;
        let start = (*next).max(Instant::now());
        *next = start + cost;
        start
    };
    tokio::time::sleep_until(tokio::time::Instant::from_std(start)).await;
}
