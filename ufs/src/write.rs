//! Writes through Strata: replace a whole object, delete, make a directory — and, where the
//! service can, copy or rename inside it and append to a file.
//!
//! Every change is all or nothing for a reader: a writer (and an appender, and a copy on a
//! local directory) fills a hidden staging file next to the target and renames it over the
//! target at `close`, as an object store publishes an object only when its upload completes.
//!
//! Kept apart from [`Ufs`](crate::Ufs) (which every UFS and test wrapper implements) as an
//! optional capability: [`Ufs::as_write`](crate::Ufs::as_write) answers `None` for a UFS that
//! cannot be written, and whether a *mount* may be written is the mount's `mode`, checked by
//! the master and the workers before they get here.

use async_trait::async_trait;
use bytes::Bytes;
use opendal::ErrorKind as OdErrorKind;

use crate::opendal_ufs::map_err;
use crate::{OpendalUfs, Result, UfsError};

/// Chunk a writer hands the service at a time (an S3 multipart part).
const WRITE_CHUNK: usize = 8 << 20;
/// Parts of one object uploaded at once: an object store's per-request latency, not its
/// bandwidth, bounds one part at a time (4 × 8 MiB buffered per writer).
const WRITE_PARTS_IN_FLIGHT: usize = 4;

/// What a writable UFS can do besides replacing whole objects.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteCapabilities {
    /// [`UfsWrite::copy`]: a copy made by the service, no bytes through the caller (S3
    /// CopyObject, a local `copy_file_range`).
    pub copy: bool,
    /// [`UfsWrite::rename`]: a file or a directory renamed in place (local directories, HDFS).
    pub rename: bool,
    /// [`UfsWrite::appender`]: appending to a file. Only where the append can be staged and
    /// published whole (copy, append, rename: a local directory); object stores cannot append
    /// to an object (S3's appends are for S3 Express directory buckets only).
    pub append: bool,
}

#[async_trait]
pub trait UfsWrite: Send + Sync {
    /// What this UFS can do beyond [`writer`](Self::writer), `delete` and `create_dir`.
    fn capabilities(&self) -> WriteCapabilities {
        WriteCapabilities::default()
    }

    /// Replaces the file `to` with a copy of the file `from` (both relative to the UFS root),
    /// made by the service: `Unsupported` where [`WriteCapabilities::copy`] is false, and
    /// possibly where the service refuses this copy (S3 copies at most 5 GiB at once).
    async fn copy(&self, from: &str, to: &str) -> Result<()> {
        Err(UfsError::Unsupported(format!("this UFS cannot copy {from} to {to} by itself")))
    }

    /// Renames the file or directory `from` to `to`, replacing a file at `to` (a directory
    /// at `to` must not exist): `Unsupported` where [`WriteCapabilities::rename`] is false.
    async fn rename(&self, from: &str, to: &str) -> Result<()> {
        Err(UfsError::Unsupported(format!("this UFS cannot rename {from} to {to} in place")))
    }

    /// A writer that appends to the file at `path` (made empty if absent): what was there
    /// followed by what is written becomes the file when it is closed, and nothing changes
    /// before. `Unsupported` where [`WriteCapabilities::append`] is false.
    async fn appender(&self, path: &str) -> Result<Box<dyn UfsWriter>> {
        Err(UfsError::Unsupported(format!("this UFS cannot append to {path}")))
    }

    /// A writer that replaces the object at `path` (relative to the UFS root) when it is
    /// closed; until then readers keep seeing the old object (or none).
    async fn writer(&self, path: &str) -> Result<Box<dyn UfsWriter>>;
    /// Deletes a file, or a directory (with everything under it when `recursive`).
    async fn delete(&self, path: &str, is_dir: bool, recursive: bool) -> Result<()>;
    /// Makes a directory (and its parents). On object stores a directory is an empty
    /// `path/` marker object.
    async fn create_dir(&self, path: &str) -> Result<()>;

    /// Whether a write to `path` would be refused for where it goes (a local directory's
    /// fenced state, see `fence`), checked before a write is accepted that reaches the UFS
    /// only later (write-back). Ok by default: most services refuse nothing by path.
    async fn check_write(&self, _path: &str) -> Result<()> {
        Ok(())
    }
}

#[async_trait]
pub trait UfsWriter: Send {
    async fn write(&mut self, data: Bytes) -> Result<()>;
    /// Makes what was written the object.
    async fn close(&mut self) -> Result<()>;
    /// Drops what was written; the old object stays.
    async fn abort(&mut self) -> Result<()>;
}

struct OpendalWriter {
    path: String,
    inner: opendal::Writer,
    op: opendal::Operator,
    /// Where the bytes go until `close` renames them over `path`, on services that write in
    /// place (a local directory truncates the file when the writer opens): an unfinished write
    /// must leave the old file, as it does on object stores, which publish at close.
    staging: Option<String>,
}

const STAGING_SUFFIX: &str = ".strata-partial";

/// Whether a listed name is a write in progress: listings hide them, because a writer that
/// was dropped (a client gone mid-write) may leave one for a moment after its client moved on.
pub(crate) fn is_staging_name(name: &str) -> bool {
    name.starts_with('.') && name.ends_with(STAGING_SUFFIX)
}

/// A hidden name next to `path` for a write in progress (`*.strata-partial`).
fn staging_name(path: &str) -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (dir, name) = path.rsplit_once('/').map_or(("", path), |(d, n)| (d, n));
    let unique = format!(".{name}.{}-{n}{STAGING_SUFFIX}", std::process::id());
    if dir.is_empty() { unique } else { format!("{dir}/{unique}") }
}

#[async_trait]
impl UfsWriter for OpendalWriter {
    async fn write(&mut self, data: Bytes) -> Result<()> {
        self.inner.write(data).await.map_err(|e| map_err(&self.path, e))
    }

    async fn close(&mut self) -> Result<()> {
        let closed = self.inner.close().await.map(|_| ()).map_err(|e| map_err(&self.path, e));
        let Some(staging) = self.staging.take() else {
            return closed;
        };
        let renamed = match closed {
            // A rename over a directory fails as an unexpected (and retried) error: say what
            // it is instead.
            Ok(()) if self.op.stat(&self.path).await.is_ok_and(|m| m.is_dir()) => {
                Err(UfsError::IsDirectory(format!("{} is a directory", self.path)))
            }
            Ok(()) => self.op.rename(&staging, &self.path).await.map_err(|e| map_err(&self.path, e)),
            Err(e) => Err(e),
        };
        if renamed.is_err() {
            let _ = self.op.delete(&staging).await;
        }
        renamed
    }

    async fn abort(&mut self) -> Result<()> {
        let aborted = self.inner.abort().await.map_err(|e| map_err(&self.path, e));
        match self.staging.take() {
            // The staging file is all there is to drop (a local directory's writer cannot
            // abort by itself, having no temporary file of its own).
            Some(staging) => match self.op.delete(&staging).await {
                Ok(()) => Ok(()),
                Err(e) => Err(map_err(&self.path, e)),
            },
            None => aborted,
        }
    }
}

fn dir_path(path: &str) -> String {
    format!("{}/", path.trim_end_matches('/'))
}

#[async_trait]
impl UfsWrite for OpendalUfs {
    fn capabilities(&self) -> WriteCapabilities {
        let cap = self.op.info().capability();
        WriteCapabilities {
            copy: cap.copy,
            rename: cap.rename,
            append: cap.write_can_append && cap.copy && cap.rename,
        }
    }

    async fn copy(&self, from: &str, to: &str) -> Result<()> {
        let caps = self.capabilities();
        if !caps.copy {
            return Err(UfsError::Unsupported(format!("this UFS cannot copy {from} to {to} by itself")));
        }
        if !caps.rename {
            // An object store's copy publishes the object whole.
            return self.op.copy(from, to).await.map(|_| ()).map_err(|e| map_err(from, e));
        }
        // A file system copies into the target as it goes: stage, then rename over it.
        let staging = staging_name(to);
        let copied = match self.op.copy(from, &staging).await {
            Ok(_) => self.op.rename(&staging, to).await.map_err(|e| map_err(to, e)),
            Err(e) => Err(map_err(from, e)),
        };
        if copied.is_err() {
            let _ = self.op.delete(&staging).await;
        }
        copied
    }

    async fn rename(&self, from: &str, to: &str) -> Result<()> {
        if !self.capabilities().rename {
            return Err(UfsError::Unsupported(format!("this UFS cannot rename {from} to {to} in place")));
        }
        let (from, to) = (from.trim_end_matches('/'), to.trim_end_matches('/'));
        self.op.rename(from, to).await.map_err(|e| map_err(from, e))
    }

    async fn appender(&self, path: &str) -> Result<Box<dyn UfsWriter>> {
        if !self.capabilities().append {
            return Err(UfsError::Unsupported(format!("this UFS cannot append to {path}")));
        }
        if path.is_empty() || path.ends_with('/') {
            return Err(UfsError::IsDirectory(path.to_string()));
        }
        let existing = match crate::Ufs::stat(self, path).await {
            Ok(meta) if meta.is_dir => return Err(UfsError::IsDirectory(path.to_string())),
            Ok(_) => true,
            Err(UfsError::NotFound(_)) => false,
            Err(e) => return Err(e),
        };
        let staging = staging_name(path);
        let opened = async {
            if existing {
                self.op.copy(path, &staging).await.map_err(|e| map_err(path, e))?;
            }
            self.op.writer_with(&staging).append(true).chunk(WRITE_CHUNK).await.map_err(|e| map_err(path, e))
        };
        match opened.await {
            Ok(inner) => Ok(Box::new(OpendalWriter {
                path: path.to_string(),
                inner,
                op: self.op.clone(),
                staging: Some(staging),
            })),
            Err(e) => {
                let _ = self.op.delete(&staging).await;
                Err(e)
            }
        }
    }

    async fn writer(&self, path: &str) -> Result<Box<dyn UfsWriter>> {
        if path.is_empty() || path.ends_with('/') {
            return Err(UfsError::IsDirectory(path.to_string()));
        }
        let staging = self.op.info().capability().rename.then(|| staging_name(path));
        let target = staging.as_deref().unwrap_or(path);
        let inner = self
            .op
            .writer_with(target)
            .chunk(WRITE_CHUNK)
            .concurrent(WRITE_PARTS_IN_FLIGHT)
            .await
            .map_err(|e| map_err(path, e))?;
        Ok(Box::new(OpendalWriter { path: path.to_string(), inner, op: self.op.clone(), staging }))
    }

    async fn delete(&self, path: &str, is_dir: bool, recursive: bool) -> Result<()> {
        if !is_dir {
            return self.op.delete(path).await.map_err(|e| map_err(path, e));
        }
        let dir = dir_path(path);
        if recursive {
            return self.op.delete_with(&dir).recursive(true).await.map_err(|e| map_err(path, e));
        }
        // opendal's fs service refuses to remove a non-empty directory, but an object store
        // would drop the marker and leave the children: check here so both refuse alike.
        let mut lister = self.op.lister_with(&dir).limit(2).await.map_err(|e| map_err(path, e))?;
        use futures::TryStreamExt;
        while let Some(entry) = lister.try_next().await.map_err(|e| map_err(path, e))? {
            if entry.path().trim_end_matches('/') != dir.trim_end_matches('/') {
                let msg = format!("{path} is a directory that is not empty (delete it recursively)");
                return Err(UfsError::IsDirectory(msg));
            }
        }
        match self.op.delete(&dir).await {
            Err(e) if e.kind() == OdErrorKind::NotFound => Ok(()),
            other => other.map_err(|e| map_err(path, e)),
        }
    }

    async fn create_dir(&self, path: &str) -> Result<()> {
        self.op.create_dir(&dir_path(path)).await.map_err(|e| map_err(path, e))
    }
}
