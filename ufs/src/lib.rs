//! The under file system (UFS) seam: everything Strata reads from the storage a team already
//! has goes through the [`Ufs`] trait.
//!
//! [`OpendalUfs`] is the real implementation (every opendal service Strata enables); the
//! wrappers in [`testing`] count and inject faults for tests. A mount's URI and options become
//! a `Ufs` through a [`UfsFactory`], so tests can hand the master and workers a counting or
//! failing UFS without touching their code.

mod opendal_ufs;
mod spec;
pub mod testing;

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use strata_common::ErrorKind;
use thiserror::Error;

pub use opendal_ufs::{
    DEFAULT_UFS_IO_TIMEOUT, DEFAULT_UFS_RETRIES, DEFAULT_UFS_TIMEOUT, OpendalFactory, OpendalUfs,
    STRATA_MOUNT_OPTIONS, parse_duration,
};
pub use spec::{SUPPORTED_SCHEMES, UfsSpec, is_secret_option, redact_options};

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum UfsError {
    #[error("not found: {0}")]
    NotFound(String),
    #[error("is a directory: {0}")]
    IsDirectory(String),
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    #[error("unsupported UFS scheme {0:?} (supported: file, s3, hdfs, webhdfs, gcs, azblob, oss)")]
    UnsupportedScheme(String),
    #[error("invalid UFS configuration: {0}")]
    InvalidConfig(String),
    #[error("object {0} changed while it was read")]
    VersionChanged(String),
    #[error("UFS request failed (temporary): {0}")]
    Temporary(String),
    #[error("UFS request failed: {0}")]
    Other(String),
}

impl UfsError {
    pub fn is_temporary(&self) -> bool {
        matches!(self, UfsError::Temporary(_))
    }

    /// The kind this error travels as over gRPC or the data plane.
    pub fn kind(&self) -> ErrorKind {
        match self {
            UfsError::NotFound(_) => ErrorKind::NotFound,
            UfsError::IsDirectory(_) => ErrorKind::IsDirectory,
            UfsError::UnsupportedScheme(_) | UfsError::InvalidConfig(_) => ErrorKind::InvalidArgument,
            UfsError::VersionChanged(_) => ErrorKind::VersionChanged,
            UfsError::PermissionDenied(_) | UfsError::Temporary(_) | UfsError::Other(_) => ErrorKind::Ufs,
        }
    }
}

pub type Result<T> = std::result::Result<T, UfsError>;

/// What Strata needs to know of an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectMeta {
    pub is_dir: bool,
    pub size: u64,
    /// The ETag, or `m<mtime ns>-s<size>` when the UFS has none; empty for directories.
    pub version: String,
    /// Last modification, milliseconds since the Unix epoch (0 when unknown).
    pub mtime_ms: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UfsEntry {
    /// Name inside the listed directory (no slashes).
    pub name: String,
    pub meta: ObjectMeta,
}

#[async_trait]
pub trait Ufs: Send + Sync + 'static {
    /// Metadata of a file or directory; `path` is relative to the UFS root ("" is the root).
    async fn stat(&self, path: &str) -> Result<ObjectMeta>;
    /// Direct children of a directory.
    async fn list(&self, dir: &str) -> Result<Vec<UfsEntry>>;
    /// Bytes `range` of a file, which must still be at `version`: if the object changed,
    /// `VersionChanged` — never bytes of another version.
    async fn read_range(&self, path: &str, range: Range<u64>, version: &str) -> Result<Bytes>;
}

/// Turns a mount's URI and options into a [`Ufs`].
pub trait UfsFactory: Send + Sync + 'static {
    fn open(&self, uri: &str, options: &BTreeMap<String, String>) -> Result<Arc<dyn Ufs>>;
}

/// The version string of an object without an ETag.
pub fn synthetic_version(mtime_ns: i128, size: u64) -> String {
    format!("m{mtime_ns}-s{size}")
}
