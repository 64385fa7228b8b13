//! Generated control-plane types and the one place that maps Strata error kinds to
//! `tonic::Status` and back.

use strata_common::ErrorKind;

tonic::include_proto!("strata.v1");

pub mod leader;
pub mod ops_http;

/// gRPC metadata entry that carries a Strata status's exact [`ErrorKind`] (its
/// [`as_str`](ErrorKind::as_str) name). Several kinds share a status code (`Ufs` and
/// `Unavailable` are both `UNAVAILABLE`, `BadFrame` and `InvalidArgument` both
/// `INVALID_ARGUMENT`), so the code alone cannot bring the kind back.
pub const ERROR_KIND_METADATA: &str = "strata-error-kind";

/// Largest gRPC message either side sends or accepts, set explicitly on every server and
/// client (tonic's default is 4 MiB). Whatever grows with data is paged or chunked well below
/// it (listings, block reports, block locations); a message over it is refused as
/// `ResourceExhausted`, named by the call.
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;

impl WorkerView {
    /// The view as the payload of a data-plane `View` answer.
    pub fn to_bytes(&self) -> Vec<u8> {
        prost::Message::encode_to_vec(self)
    }

    /// A view from a `View` answer's payload.
    pub fn from_bytes(buf: &[u8]) -> Result<Self, prost::DecodeError> {
        prost::Message::decode(buf)
    }
}

/// Maps an error kind and message to a gRPC status: the nearest standard code, for clients
/// that only know gRPC, and the kind itself in [`ERROR_KIND_METADATA`], which [`kind_of`]
/// reads back exactly.
pub fn status(kind: ErrorKind, message: impl Into<String>) -> tonic::Status {
    let mut status = tonic::Status::new(code_of(kind), message);
    status
        .metadata_mut()
        .insert(ERROR_KIND_METADATA, tonic::metadata::MetadataValue::from_static(kind.as_str()));
    status
}

/// The error kind of a gRPC status: the one [`status`] put in it, or, for a status from the
/// transport or a server that does not send the kind, the nearest kind to its code.
pub fn kind_of(status: &tonic::Status) -> ErrorKind {
    status
        .metadata()
        .get(ERROR_KIND_METADATA)
        .and_then(|v| v.to_str().ok())
        .and_then(ErrorKind::from_name)
        .unwrap_or_else(|| kind_of_code(status.code()))
}

fn code_of(kind: ErrorKind) -> tonic::Code {
    use tonic::Code;
    match kind {
        ErrorKind::BadFrame | ErrorKind::InvalidArgument => Code::InvalidArgument,
        ErrorKind::NotFound => Code::NotFound,
        ErrorKind::VersionChanged => Code::Aborted,
        ErrorKind::Ufs | ErrorKind::Unavailable | ErrorKind::NotLeader => Code::Unavailable,
        ErrorKind::AlreadyExists => Code::AlreadyExists,
        ErrorKind::IsDirectory => Code::FailedPrecondition,
        ErrorKind::PermissionDenied => Code::PermissionDenied,
        ErrorKind::Unauthenticated => Code::Unauthenticated,
        ErrorKind::ResourceExhausted => Code::ResourceExhausted,
        _ => Code::Internal,
    }
}

fn kind_of_code(code: tonic::Code) -> ErrorKind {
    use tonic::Code;
    match code {
        Code::InvalidArgument => ErrorKind::InvalidArgument,
        // tonic refuses a message over its size limit with OUT_OF_RANGE.
        Code::OutOfRange | Code::ResourceExhausted => ErrorKind::ResourceExhausted,
        Code::NotFound => ErrorKind::NotFound,
        Code::Aborted => ErrorKind::VersionChanged,
        Code::AlreadyExists => ErrorKind::AlreadyExists,
        Code::FailedPrecondition => ErrorKind::IsDirectory,
        Code::PermissionDenied => ErrorKind::PermissionDenied,
        Code::Unauthenticated => ErrorKind::Unauthenticated,
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled => ErrorKind::Unavailable,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_survives_a_status() {
        for kind in ErrorKind::ALL {
            let status = status(kind, "boom");
            assert_eq!(kind_of(&status), kind);
            assert_eq!(status.message(), "boom");
            // What a server puts on the wire and a client parses back.
            let mut headers = tonic::codegen::http::HeaderMap::new();
            status.add_header(&mut headers).unwrap();
            let parsed = tonic::Status::from_header_map(&headers).expect("a grpc-status header");
            assert_eq!(kind_of(&parsed), kind, "{headers:?}");
            assert_eq!(parsed.code(), status.code());
        }
    }

    #[test]
    fn a_status_without_the_kind_falls_back_to_its_code() {
        use tonic::Code;
        for (code, kind) in [
            (Code::Unavailable, ErrorKind::Unavailable),
            (Code::DeadlineExceeded, ErrorKind::Unavailable),
            (Code::InvalidArgument, ErrorKind::InvalidArgument),
            (Code::NotFound, ErrorKind::NotFound),
            (Code::Aborted, ErrorKind::VersionChanged),
            (Code::Unknown, ErrorKind::Internal),
        ] {
            assert_eq!(kind_of(&tonic::Status::new(code, "x")), kind, "{code:?}");
        }
        let mut unknown = tonic::Status::new(Code::NotFound, "from a newer server");
        unknown.metadata_mut().insert(ERROR_KIND_METADATA, "quota_exceeded".parse().unwrap());
        assert_eq!(kind_of(&unknown), ErrorKind::NotFound, "an unknown kind name falls back to the code");
    }
}
