//! What the SDK answers with: its own types, not the wire's, so the protocol can change
//! without every front end changing with it.

use std::collections::BTreeMap;
use std::time::Duration;

use strata_common::Member;
use strata_common::frame::FileStat;

/// What `stat` and `list` return.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileInfo {
    pub path: String,
    pub is_dir: bool,
    pub size: u64,
    pub version: String,
    pub mtime_ms: i64,
    pub block_size: u64,
    /// The UFS identity blocks are keyed by.
    pub file_id: String,
    /// A file written to a write-back mount and not yet in the UFS: the live workers whose
    /// journals hold it (reads go to them), and where its upload stands.
    pub holders: Vec<Member>,
    pub persist: Persist,
}

/// Where a file written to a write-back mount stands (see docs/WRITEBACK.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Persist {
    /// In the UFS (every file not written through a write-back mount).
    #[default]
    Persisted,
    /// Acknowledged, held by workers' journals, waiting for its upload.
    Pending,
    Uploading,
    /// The upload gave up after its retries (`strata sync` queues it again).
    Failed,
}

impl Persist {
    pub fn as_str(self) -> &'static str {
        match self {
            Persist::Persisted => "persisted",
            Persist::Pending => "pending",
            Persist::Uploading => "uploading",
            Persist::Failed => "failed",
        }
    }

    pub(crate) fn from_proto(state: i32) -> Self {
        match strata_proto::PersistState::try_from(state) {
            Ok(strata_proto::PersistState::Pending) => Persist::Pending,
            Ok(strata_proto::PersistState::Uploading) => Persist::Uploading,
            Ok(strata_proto::PersistState::Failed) => Persist::Failed,
            _ => Persist::Persisted,
        }
    }
}

impl From<FileStat> for FileInfo {
    fn from(s: FileStat) -> Self {
        Self {
            path: s.path,
            is_dir: s.is_dir,
            size: s.size,
            version: s.version,
            mtime_ms: s.mtime_ms,
            block_size: s.block_size,
            file_id: s.file_id,
            holders: Vec::new(),
            persist: Persist::Persisted,
        }
    }
}

impl From<strata_proto::FileStatus> for FileInfo {
    fn from(s: strata_proto::FileStatus) -> Self {
        Self {
            path: s.path,
            is_dir: s.is_dir,
            size: s.size,
            version: s.version,
            mtime_ms: s.mtime_ms,
            block_size: s.block_size,
            file_id: s.file_id,
            holders: s
                .holders
                .into_iter()
                .map(|m| Member {
                    id: m.id,
                    data_addr: m.data_addr,
                    node: m.node,
                    local_socket: m.local_socket,
                })
                .collect(),
            persist: Persist::from_proto(s.persist),
        }
    }
}

/// A page of a listing: the entries, and the token of the next page when there is one.
pub type Page = (Vec<FileInfo>, Option<String>);

/// A mount, as the master describes it to clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountInfo {
    /// The Strata path it is mounted at.
    pub path: String,
    /// The UFS it serves (`file:///dir`, `s3://bucket/prefix`).
    pub uri: String,
    /// Its options; secret values (keys, passwords, tokens) are `***` in answers to clients.
    pub options: BTreeMap<String, String>,
    pub block_size: u64,
    /// How long a stat or listing of it is reused before the UFS is asked again.
    pub metadata_ttl: Duration,
    /// How many of a block's first ring owners a read may be sent to (at least 1).
    pub read_replicas: u32,
    /// What the master said when the mount was added (empty in a listing of mounts).
    pub warnings: Vec<String>,
}

impl From<strata_proto::MountInfo> for MountInfo {
    fn from(m: strata_proto::MountInfo) -> Self {
        Self {
            path: m.path,
            uri: m.uri,
            options: m.options.into_iter().collect(),
            block_size: m.block_size,
            metadata_ttl: Duration::from_millis(m.metadata_ttl_ms),
            read_replicas: m.read_replicas.max(1),
            warnings: m.warnings,
        }
    }
}
