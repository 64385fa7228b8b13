//! What an operation on the master's state can fail with. Every variant knows its
//! [`ErrorKind`], so the gRPC adapter maps it to a status in one place and a client keeps the
//! kind (not found, invalid argument, retryable UFS failure...) instead of parsing a message.
//! Messages are written for the user of the CLI: they name the path and say what to do.

use strata_common::ErrorKind;
use strata_common::path::PathError;
use strata_ufs::UfsError;
use thiserror::Error;

use crate::filter::FilterError;
use crate::mounts::MountError;
use crate::schedule::ScheduleError;
use crate::store::StoreError;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum OpError {
    #[error(transparent)]
    BadPath(#[from] PathError),
    #[error("{0} is not under any mount (see `strata mount ls`)")]
    NoMount(String),
    #[error(transparent)]
    Mount(#[from] MountError),
    #[error("{}", ufs_message(.path, .source))]
    Ufs { path: String, source: UfsError },
    #[error(
        "{path} is on the read-only mount {mount} (mount it with -o mode=write-through to write through Strata)"
    )]
    ReadOnly { path: String, mount: String },
    #[error("{0} is a mount point (`strata mount rm {0}` unmounts it)")]
    MountPoint(String),
    #[error("{0} exists and is a file")]
    FileExists(String),
    #[error("{0} is a directory")]
    IsDirectory(String),
    #[error("worker id and a data address host:port are required")]
    BadWorker,
    #[error("no job {0}")]
    NoJob(String),
    #[error("no schedule {0}")]
    NoSchedule(String),
    #[error(transparent)]
    Filter(#[from] FilterError),
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    #[error("--replicas {replicas} asks for more workers than the {live} live ones")]
    TooManyReplicas { replicas: u32, live: usize },
    /// A job submitted a moment ago is gone already (finished and pruned at once).
    #[error("job vanished")]
    JobVanished,
    #[error(transparent)]
    Auth(#[from] strata_security::token::AuthError),
    #[error(transparent)]
    TokenFile(#[from] strata_security::token::TokenFileError),
    #[error("no token {0} (see `strata token ls`)")]
    NoToken(String),
    #[error("token {id} is read from {file} at start: replace the file and restart the masters to rotate it")]
    FileToken { id: String, file: String },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0} is not pinned (see `strata pins`)")]
    NoPin(String),
    #[error("{0} has no cache TTL of its own (see `strata ttl ls`)")]
    NoCacheTtl(String),
    #[error(
        "pinning {path} ({bytes} bytes) in {tier} would pin more than the {capacity} bytes of {tier} on the {workers} live workers ({pinned} bytes are pinned already)"
    )]
    PinTooLarge { path: String, tier: &'static str, bytes: u64, pinned: u64, capacity: u64, workers: usize },
    #[error("{path} holds more than {max} files: pin or free a directory below it")]
    TooManyFiles { path: String, max: usize },
    #[error("{path} is pinned (by the pin of {pin}): `strata unpin {pin}` first")]
    Pinned { path: String, pin: String },
    /// A write-back commit or upload report the master cannot take.
    #[error("write-back: {0}")]
    BadCommit(String),
    #[error(transparent)]
    Lineage(#[from] crate::lineage::LineageError),
}

fn ufs_message(path: &str, e: &UfsError) -> String {
    match e {
        UfsError::NotFound(_) => format!("no such file or directory: {path}"),
        other => format!("{path}: {other}"),
    }
}

impl OpError {
    pub fn ufs(path: &str, source: UfsError) -> Self {
        Self::Ufs { path: path.to_string(), source }
    }

    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::BadPath(_)
            | Self::MountPoint(_)
            | Self::BadWorker
            | Self::Filter(_)
            | Self::Schedule(_)
            | Self::TooManyReplicas { .. }
            | Self::BadCommit(_) => ErrorKind::InvalidArgument,
            Self::NoMount(_)
            | Self::NoJob(_)
            | Self::NoSchedule(_)
            | Self::NoToken(_)
            | Self::NoPin(_)
            | Self::NoCacheTtl(_) => ErrorKind::NotFound,
            Self::PinTooLarge { .. } => ErrorKind::ResourceExhausted,
            Self::Pinned { .. } | Self::TooManyFiles { .. } => ErrorKind::InvalidArgument,
            Self::Auth(e) => e.kind(),
            Self::Lineage(e) => e.kind(),
            Self::FileToken { .. } => ErrorKind::InvalidArgument,
            Self::Mount(e) => e.kind(),
            Self::Ufs { source, .. } => source.kind(),
            Self::ReadOnly { .. } => ErrorKind::PermissionDenied,
            Self::FileExists(_) => ErrorKind::AlreadyExists,
            Self::IsDirectory(_) => ErrorKind::IsDirectory,
            // A leader that stepped down mid-call: the client sends it to the new leader.
            Self::Store(StoreError::NotLeader) => ErrorKind::NotLeader,
            Self::Store(StoreError::Etcd(_)) => ErrorKind::Unavailable,
            Self::Store(_) | Self::JobVanished | Self::TokenFile(_) => ErrorKind::Internal,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_and_messages_are_what_clients_act_on() {
        let e = OpError::ufs("/data/a", UfsError::NotFound("a".into()));
        assert_eq!(
            (e.kind(), e.to_string().as_str()),
            (ErrorKind::NotFound, "no such file or directory: /data/a")
        );
        let e = OpError::ufs("/data/a", UfsError::Temporary("503".into()));
        assert_eq!(e.kind(), ErrorKind::Ufs);
        assert!(e.to_string().starts_with("/data/a: "), "{e}");
        let e = OpError::from(MountError::AlreadyMounted("/data".into()));
        assert_eq!(e.kind(), ErrorKind::AlreadyExists);
        let e = OpError::TooManyReplicas { replicas: 4, live: 3 };
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.to_string().contains("--replicas 4"), "{e}");
        assert_eq!(OpError::from(StoreError::Closed).kind(), ErrorKind::Internal);
    }
}
