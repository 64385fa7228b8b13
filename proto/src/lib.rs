//! Generated control-plane types and the one place that maps Strata error kinds to
//! `tonic::Status` and back.

use strata_common::ErrorKind;

tonic::include_proto!("strata.v1");

pub mod ops_http;

/// Maps an error kind and message to a gRPC status. The kind survives the round trip through
/// [`kind_of`], so callers keep retryability as data.
pub fn status(kind: ErrorKind, message: impl Into<String>) -> tonic::Status {
    use tonic::Code;
    let code = match kind {
        ErrorKind::BadFrame | ErrorKind::InvalidArgument => Code::InvalidArgument,
        ErrorKind::NotFound => Code::NotFound,
        ErrorKind::VersionChanged => Code::Aborted,
        ErrorKind::Ufs => Code::Unavailable,
        ErrorKind::Unavailable => Code::Unavailable,
        ErrorKind::AlreadyExists => Code::AlreadyExists,
        ErrorKind::IsDirectory => Code::FailedPrecondition,
        ErrorKind::PermissionDenied => Code::PermissionDenied,
        _ => Code::Internal,
    };
    tonic::Status::new(code, message)
}

/// The error kind of a gRPC status (as produced by [`status`] or by the transport).
pub fn kind_of(status: &tonic::Status) -> ErrorKind {
    use tonic::Code;
    match status.code() {
        Code::InvalidArgument | Code::OutOfRange => ErrorKind::InvalidArgument,
        Code::NotFound => ErrorKind::NotFound,
        Code::Aborted => ErrorKind::VersionChanged,
        Code::AlreadyExists => ErrorKind::AlreadyExists,
        Code::FailedPrecondition => ErrorKind::IsDirectory,
        Code::PermissionDenied => ErrorKind::PermissionDenied,
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::ResourceExhausted => {
            ErrorKind::Unavailable
        }
        _ => ErrorKind::Internal,
    }
}

impl Tier {
    pub fn label(self) -> &'static str {
        match self {
            Tier::Memory => "memory",
            Tier::Nvme => "nvme",
            Tier::Unspecified => "unspecified",
        }
    }
}
