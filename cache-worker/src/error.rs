//! Why a block could not be served, read or written: the storage layer's one error type. It
//! travels to the client as an error frame whose kind is [`ServeError::kind`].

use strata_common::ErrorKind;
use strata_ufs::UfsError;
use thiserror::Error;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ServeError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0} is not under any mount")]
    NoMount(String),
    #[error(transparent)]
    Ufs(#[from] UfsError),
    #[error("UFS read of {0} timed out")]
    UfsTimeout(String),
    #[error("{0} is on a read-only mount (mount it with -o mode=write-through to write through Strata)")]
    ReadOnly(String),
    /// The NVMe tier's disk is full: the block was served, but not kept where it was asked for.
    #[error("block {block} is not on this worker's NVMe tier: {reason}")]
    DiskFull { block: String, reason: String },
    /// The work was given up because what asked for it no longer wants it (a cancelled load
    /// job's batch).
    #[error("{0}")]
    Cancelled(String),
}

impl ServeError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            ServeError::InvalidArgument(_) => ErrorKind::InvalidArgument,
            ServeError::NoMount(_) => ErrorKind::NotFound,
            ServeError::Ufs(e) => e.kind(),
            ServeError::UfsTimeout(_) => ErrorKind::Ufs,
            ServeError::ReadOnly(_) => ErrorKind::PermissionDenied,
            ServeError::DiskFull { .. } => ErrorKind::ResourceExhausted,
            ServeError::Cancelled(_) => ErrorKind::Unavailable,
        }
    }
}
