use strata_common::ErrorKind;
use thiserror::Error;

/// Errors a Strata client returns. Cache-node failures never surface here while any worker
/// (or the UFS through one) can still serve the bytes.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ClientError {
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("is a directory: {0}")]
    IsDirectory(String),
    #[error("already exists: {0}")]
    AlreadyExists(String),
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    #[error("master unavailable: {0}")]
    MasterUnavailable(String),
    #[error("no worker could serve the read: {0}")]
    Unavailable(String),
    #[error("{0} changed in the UFS while it was being read; reopen it to read the new version")]
    Changed(String),
    #[error("{kind}: {message}")]
    Remote { kind: ErrorKind, message: String },
}

impl ClientError {
    pub fn is_temporary(&self) -> bool {
        matches!(self, ClientError::MasterUnavailable(_) | ClientError::Unavailable(_))
            || matches!(self, ClientError::Remote { kind, .. } if kind.is_temporary())
    }

    pub(crate) fn from_kind(kind: ErrorKind, message: String) -> Self {
        match kind {
            ErrorKind::InvalidArgument | ErrorKind::BadFrame => ClientError::InvalidArgument(message),
            ErrorKind::NotFound => ClientError::NotFound(message),
            ErrorKind::IsDirectory => ClientError::IsDirectory(message),
            ErrorKind::AlreadyExists => ClientError::AlreadyExists(message),
            ErrorKind::PermissionDenied => ClientError::PermissionDenied(message),
            ErrorKind::VersionChanged => ClientError::Changed(message),
            kind => ClientError::Remote { kind, message },
        }
    }

    pub(crate) fn from_status(status: tonic::Status, master: &str) -> Self {
        let kind = strata_proto::kind_of(&status);
        if kind == ErrorKind::Unavailable {
            return ClientError::MasterUnavailable(format!("master at {master}: {}", status.message()));
        }
        Self::from_kind(kind, status.message().to_string())
    }
}

impl From<ClientError> for std::io::Error {
    fn from(e: ClientError) -> Self {
        use std::io::ErrorKind as K;
        let kind = match &e {
            ClientError::InvalidArgument(_) => K::InvalidInput,
            ClientError::NotFound(_) => K::NotFound,
            ClientError::IsDirectory(_) => K::IsADirectory,
            ClientError::AlreadyExists(_) => K::AlreadyExists,
            ClientError::PermissionDenied(_) => K::PermissionDenied,
            _ => K::Other,
        };
        std::io::Error::new(kind, e)
    }
}

pub type Result<T> = std::result::Result<T, ClientError>;
