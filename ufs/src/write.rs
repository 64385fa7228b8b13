//! Writes through Strata: replace a whole object, delete, make a directory.
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

#[async_trait]
pub trait UfsWrite: Send + Sync {
    /// A writer that replaces the object at `path` (relative to the UFS root) when it is
    /// closed; until then readers keep seeing the old object (or none).
    async fn writer(&self, path: &str) -> Result<Box<dyn UfsWriter>>;
    /// Deletes a file, or a directory (with everything under it when `recursive`).
    async fn delete(&self, path: &str, is_dir: bool, recursive: bool) -> Result<()>;
    /// Makes a directory (and its parents). On object stores a directory is an empty
    /// `path/` marker object.
    async fn create_dir(&self, path: &str) -> Result<()>;
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
}

#[async_trait]
impl UfsWriter for OpendalWriter {
    async fn write(&mut self, data: Bytes) -> Result<()> {
        self.inner.write(data).await.map_err(|e| map_err(&self.path, e))
    }

    async fn close(&mut self) -> Result<()> {
        self.inner.close().await.map(|_| ()).map_err(|e| map_err(&self.path, e))
    }

    async fn abort(&mut self) -> Result<()> {
        self.inner.abort().await.map_err(|e| map_err(&self.path, e))
    }
}

fn dir_path(path: &str) -> String {
    format!("{}/", path.trim_end_matches('/'))
}

#[async_trait]
impl UfsWrite for OpendalUfs {
    async fn writer(&self, path: &str) -> Result<Box<dyn UfsWriter>> {
        if path.is_empty() || path.ends_with('/') {
            return Err(UfsError::IsDirectory(path.to_string()));
        }
        let inner = self.op.writer_with(path).chunk(WRITE_CHUNK).await.map_err(|e| map_err(path, e))?;
        Ok(Box::new(OpendalWriter { path: path.to_string(), inner }))
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
