//! What a client call can fail with. Every error has the [`ErrorKind`] it arrived as (from the
//! master over gRPC, from a worker in a data-plane error frame) or the client decided on, so a
//! caller acts on [`ClientError::kind`] and never on a message.

use strata_common::ErrorKind;
use thiserror::Error;

use crate::TransportError;

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
    Unavailable(Unserved),
    #[error("{0} changed in the UFS while it was being read; reopen it to read the new version")]
    Changed(String),
    /// Any other kind a server answered with (`Ufs`, `Internal`, `BadFrame`...).
    #[error("{kind}: {message}")]
    Remote { kind: ErrorKind, message: String },
}

/// Why no worker served a request, and the kind of the last failure: `Unavailable` when no
/// worker could be reached, or what the last one answered (`Ufs` when every worker relayed a
/// failing UFS), so a caller can tell a storage outage from a cache outage.
#[derive(Debug)]
pub struct Unserved {
    kind: ErrorKind,
    message: String,
}

impl Unserved {
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn message(&self) -> &str {
        &self.message
    }
}

impl std::fmt::Display for Unserved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl ClientError {
    /// The kind of this error; for an error a server sent, exactly the kind it sent.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ClientError::InvalidArgument(_) => ErrorKind::InvalidArgument,
            ClientError::NotFound(_) => ErrorKind::NotFound,
            ClientError::IsDirectory(_) => ErrorKind::IsDirectory,
            ClientError::AlreadyExists(_) => ErrorKind::AlreadyExists,
            ClientError::PermissionDenied(_) => ErrorKind::PermissionDenied,
            ClientError::MasterUnavailable(_) => ErrorKind::Unavailable,
            ClientError::Unavailable(unserved) => unserved.kind,
            ClientError::Changed(_) => ErrorKind::VersionChanged,
            ClientError::Remote { kind, .. } => *kind,
        }
    }

    pub fn is_temporary(&self) -> bool {
        self.kind().is_temporary()
    }

    /// Whether this is the master being unreachable (a failed or timed-out connection, or the
    /// master saying `unavailable`), as opposed to any answer it gave — `not_found`, a UFS
    /// failure it relayed. Only this starts serving cached metadata.
    pub fn is_master_outage(&self) -> bool {
        matches!(self, ClientError::MasterUnavailable(_))
    }

    pub(crate) fn from_kind(kind: ErrorKind, message: String) -> Self {
        match kind {
            ErrorKind::InvalidArgument => ClientError::InvalidArgument(message),
            ErrorKind::NotFound => ClientError::NotFound(message),
            ErrorKind::IsDirectory => ClientError::IsDirectory(message),
            ErrorKind::AlreadyExists => ClientError::AlreadyExists(message),
            ErrorKind::PermissionDenied => ClientError::PermissionDenied(message),
            ErrorKind::VersionChanged => ClientError::Changed(message),
            kind => ClientError::Remote { kind, message },
        }
    }

    /// The error of a failed call of `rpc` to the master at `master`.
    pub(crate) fn from_status(rpc: &str, status: tonic::Status, master: &str) -> Self {
        let kind = strata_proto::kind_of(&status);
        match kind {
            ErrorKind::Unavailable => {
                ClientError::MasterUnavailable(format!("master at {master}: {}", status.message()))
            }
            ErrorKind::ResourceExhausted => ClientError::Remote {
                kind,
                message: format!(
                    "{rpc} to the master at {master}: {} (ask for less at once)",
                    status.message()
                ),
            },
            _ => Self::from_kind(kind, status.message().to_string()),
        }
    }

    /// The same error, its message followed by `context`.
    pub(crate) fn with_context(self, context: &str) -> Self {
        let add = |m: String| format!("{m} ({context})");
        match self {
            ClientError::InvalidArgument(m) => ClientError::InvalidArgument(add(m)),
            ClientError::NotFound(m) => ClientError::NotFound(add(m)),
            ClientError::IsDirectory(m) => ClientError::IsDirectory(add(m)),
            ClientError::AlreadyExists(m) => ClientError::AlreadyExists(add(m)),
            ClientError::PermissionDenied(m) => ClientError::PermissionDenied(add(m)),
            ClientError::MasterUnavailable(m) => ClientError::MasterUnavailable(add(m)),
            ClientError::Unavailable(u) => {
                ClientError::Unavailable(Unserved { kind: u.kind, message: add(u.message) })
            }
            ClientError::Changed(m) => ClientError::Changed(add(m)),
            ClientError::Remote { kind, message } => ClientError::Remote { kind, message: add(message) },
        }
    }

    /// No worker could be reached or kept the connection (`Unavailable`).
    pub(crate) fn unavailable(message: impl Into<String>) -> Self {
        ClientError::Unavailable(Unserved { kind: ErrorKind::Unavailable, message: message.into() })
    }

    /// Every worker tried failed, the last one with `last` (`None`: there was none to try).
    pub(crate) fn unserved(last: Option<TransportError>, none_tried: &str) -> Self {
        match last {
            None => Self::unavailable(none_tried),
            Some(e) => {
                let kind = match &e {
                    TransportError::Remote { kind, .. } => *kind,
                    _ => ErrorKind::Unavailable,
                };
                ClientError::Unavailable(Unserved { kind, message: e.to_string() })
            }
        }
    }

    /// The same error again, for each of several requests it ended.
    pub(crate) fn duplicate(&self) -> ClientError {
        match self {
            ClientError::InvalidArgument(m) => ClientError::InvalidArgument(m.clone()),
            ClientError::NotFound(m) => ClientError::NotFound(m.clone()),
            ClientError::IsDirectory(m) => ClientError::IsDirectory(m.clone()),
            ClientError::AlreadyExists(m) => ClientError::AlreadyExists(m.clone()),
            ClientError::PermissionDenied(m) => ClientError::PermissionDenied(m.clone()),
            ClientError::MasterUnavailable(m) => ClientError::MasterUnavailable(m.clone()),
            ClientError::Unavailable(u) => ClientError::Remote {
                kind: u.kind(),
                message: format!("no worker could serve the read: {u}"),
            },
            ClientError::Changed(m) => ClientError::Changed(m.clone()),
            ClientError::Remote { kind, message } => {
                ClientError::Remote { kind: *kind, message: message.clone() }
            }
        }
    }

    /// The error a request ends with when a worker failed it and no other is asked.
    pub(crate) fn from_transport(e: TransportError) -> Self {
        match e {
            TransportError::Remote { kind, message, .. } => Self::from_kind(kind, message),
            e => Self::unserved(Some(e), ""),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_a_server_sends_is_the_kind_of_the_error() {
        for kind in ErrorKind::ALL {
            assert_eq!(ClientError::from_kind(kind, "m".into()).kind(), kind);
            let status = strata_proto::status(kind, "m");
            assert_eq!(ClientError::from_status("stat", status, "master:1").kind(), kind);
        }
    }

    #[test]
    fn a_ufs_failure_on_the_master_is_not_the_master_being_down() {
        let e = ClientError::from_status(
            "stat",
            strata_proto::status(ErrorKind::Ufs, "/data/x: slow down"),
            "m:1",
        );
        assert!(matches!(e, ClientError::Remote { kind: ErrorKind::Ufs, .. }), "{e:?}");
        assert!(e.is_temporary());
        let down = ClientError::from_status("stat", tonic::Status::unavailable("connection refused"), "m:1");
        assert!(matches!(down, ClientError::MasterUnavailable(_)), "{down:?}");
        assert_eq!(down.to_string(), "master unavailable: master at m:1: connection refused");
    }

    #[test]
    fn a_read_no_worker_served_keeps_the_kind_of_the_last_failure() {
        let ufs = TransportError::Remote { addr: "w:1".into(), kind: ErrorKind::Ufs, message: "503".into() };
        let e = ClientError::unserved(Some(ufs), "no worker answered");
        assert_eq!(e.kind(), ErrorKind::Ufs);
        assert_eq!(e.to_string(), "no worker could serve the read: w:1 answered ufs: 503");
        let refused = TransportError::Timeout { addr: "w:2".into() };
        assert_eq!(ClientError::unserved(Some(refused), "").kind(), ErrorKind::Unavailable);
        let none = ClientError::unserved(None, "no live workers");
        assert_eq!(none.kind(), ErrorKind::Unavailable);
        assert_eq!(none.to_string(), "no worker could serve the read: no live workers");
        assert!(e.is_temporary() && none.is_temporary());
    }
}
