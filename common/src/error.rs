//! Error kinds that cross a process boundary (gRPC status, data-plane error frame).
//!
//! Each boundary has its own `thiserror` enum; they all reduce to one of these kinds on the
//! wire, and whether a caller may retry is a property of the kind, not of a message string.

/// What went wrong, as far as a remote caller needs to know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(u8)]
pub enum ErrorKind {
    /// The request could not be parsed (bad frame, bad field encoding).
    BadFrame = 1,
    /// The request is well-formed but asks for something invalid (bad path, zero length...).
    InvalidArgument = 2,
    /// The path does not exist in the UFS or in the mount table.
    NotFound = 3,
    /// The object changed in the UFS since the caller learnt its version: re-stat and retry.
    VersionChanged = 4,
    /// The UFS failed or timed out; a later attempt may succeed.
    Ufs = 5,
    /// A bug or an unexpected local failure.
    Internal = 6,
    /// The server is shutting down or overloaded; another server may answer.
    Unavailable = 7,
    /// A mount or other object already exists.
    AlreadyExists = 8,
    /// A path is a directory where a file is needed.
    IsDirectory = 9,
    /// The mount (or the UFS) refuses the operation, e.g. a write to a read-only mount.
    PermissionDenied = 10,
    /// A message or a request is over a size limit (a gRPC message past the limit, too many
    /// entries asked at once): page it or narrow it.
    ResourceExhausted = 11,
    /// A standby master answered: the request belongs to the leader (named in the status's
    /// `strata-leader` metadata when known). Sending it to the leader may succeed.
    NotLeader = 12,
    /// The caller did not prove who it is: no token, an unknown or revoked one, or a data-plane
    /// request before the connection's auth frame. (A known caller whose role or path scope
    /// does not allow the request gets [`PermissionDenied`](Self::PermissionDenied).)
    Unauthenticated = 13,
}

impl ErrorKind {
    /// Every kind, for mappings and tests that must cover them all.
    pub const ALL: [ErrorKind; 13] = [
        Self::BadFrame,
        Self::InvalidArgument,
        Self::NotFound,
        Self::VersionChanged,
        Self::Ufs,
        Self::Internal,
        Self::Unavailable,
        Self::AlreadyExists,
        Self::IsDirectory,
        Self::PermissionDenied,
        Self::ResourceExhausted,
        Self::NotLeader,
        Self::Unauthenticated,
    ];

    /// Whether the same request may succeed if sent again (to this or another server).
    pub fn is_temporary(self) -> bool {
        matches!(self, ErrorKind::Ufs | ErrorKind::Unavailable | ErrorKind::Internal | ErrorKind::NotLeader)
    }

    pub fn from_u8(code: u8) -> Option<Self> {
        Some(match code {
            1 => Self::BadFrame,
            2 => Self::InvalidArgument,
            3 => Self::NotFound,
            4 => Self::VersionChanged,
            5 => Self::Ufs,
            6 => Self::Internal,
            7 => Self::Unavailable,
            8 => Self::AlreadyExists,
            9 => Self::IsDirectory,
            10 => Self::PermissionDenied,
            11 => Self::ResourceExhausted,
            12 => Self::NotLeader,
            13 => Self::Unauthenticated,
            _ => return None,
        })
    }

    /// The kind's name: a metric label, and how it travels in gRPC metadata ([`from_name`]
    /// reads it back), so it never changes once released.
    ///
    /// [`from_name`]: Self::from_name
    pub fn as_str(self) -> &'static str {
        match self {
            Self::BadFrame => "bad_frame",
            Self::InvalidArgument => "invalid_argument",
            Self::NotFound => "not_found",
            Self::VersionChanged => "version_changed",
            Self::Ufs => "ufs",
            Self::Internal => "internal",
            Self::Unavailable => "unavailable",
            Self::AlreadyExists => "already_exists",
            Self::IsDirectory => "is_directory",
            Self::PermissionDenied => "permission_denied",
            Self::ResourceExhausted => "resource_exhausted",
            Self::NotLeader => "not_leader",
            Self::Unauthenticated => "unauthenticated",
        }
    }
}

impl ErrorKind {
    /// The kind named `name` (as [`as_str`](Self::as_str) spells it), if any.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == name)
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for code in 0..=255u8 {
            if let Some(kind) = ErrorKind::from_u8(code) {
                assert_eq!(kind as u8, code);
            }
        }
        assert_eq!(ErrorKind::from_u8(0), None);
        assert_eq!(ErrorKind::from_u8(4), Some(ErrorKind::VersionChanged));
    }

    #[test]
    fn all_lists_every_code_and_names_round_trip() {
        let by_code: Vec<ErrorKind> = (0..=255u8).filter_map(ErrorKind::from_u8).collect();
        assert_eq!(by_code, ErrorKind::ALL, "ALL holds every kind, in code order");
        for kind in ErrorKind::ALL {
            assert_eq!(ErrorKind::from_name(kind.as_str()), Some(kind));
        }
        assert_eq!(ErrorKind::from_name("UFS"), None, "names are exact");
        assert_eq!(ErrorKind::from_name(""), None);
    }
}
