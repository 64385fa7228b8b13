//! The mount table: Strata path → UFS URI with options. Mount points are normalised absolute
//! paths that neither equal nor nest inside one another, so every path resolves to at most one
//! mount by prefix.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use strata_common::ErrorKind;
use strata_common::MountOptions;
use strata_common::path::{self, PathError};
use strata_ufs::{Ufs, UfsError, UfsFactory, UfsSpec};
use thiserror::Error;

/// What the store keeps of a mount.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountRecord {
    pub path: String,
    pub uri: String,
    #[serde(default)]
    pub options: BTreeMap<String, String>,
}

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum MountError {
    #[error("invalid mount point: {0}")]
    InvalidPath(#[from] PathError),
    #[error("the root '/' cannot be a mount point; mount under it, e.g. /data")]
    RootMount,
    #[error("{0} is already mounted")]
    AlreadyMounted(String),
    #[error("{new} would nest with the existing mount {existing}; mounts may not contain each other")]
    Nested { new: String, existing: String },
    #[error("mount option {key}={value:?}: {reason}")]
    BadOption { key: String, value: String, reason: String },
    #[error("mount {path} -> {uri}: {source}")]
    Ufs { path: String, uri: String, source: UfsError },
    #[error("no mount at {0}")]
    NotMounted(String),
}

impl MountError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            MountError::AlreadyMounted(_) => ErrorKind::AlreadyExists,
            MountError::NotMounted(_) => ErrorKind::NotFound,
            MountError::Ufs { source, .. } if source.is_temporary() => ErrorKind::Ufs,
            _ => ErrorKind::InvalidArgument,
        }
    }
}

/// A live mount: its record, parsed options and UFS handle.
pub struct Mount {
    pub record: MountRecord,
    pub block_size: u64,
    pub metadata_ttl: Duration,
    /// `mode=read-only` (the default) or `mode=write-through`: whether writes through Strata
    /// may reach this UFS.
    pub read_only: bool,
    /// `mode=write-back`: files are committed by workers and uploaded after.
    pub write_back: bool,
    /// `read_replicas`: how many of a block's first ring owners clients spread reads over.
    pub read_replicas: u32,
    /// `cache_ttl`: how long workers keep a block of the mount cached.
    pub cache_ttl: Option<std::time::Duration>,
    /// `quota`: bytes of the mount the cluster's tiers may hold together.
    pub quota: Option<u64>,
    /// `pack_threshold`: files under this (one block) are small files, loaded in batches.
    pub pack_threshold: u64,
    pub ufs: Arc<dyn Ufs>,
}

impl Mount {
    /// Parses and checks a record and opens its UFS (no I/O yet).
    pub fn open(record: MountRecord, factory: &dyn UfsFactory) -> Result<Self, MountError> {
        let path = path::normalize(&record.path)?;
        if path == "/" {
            return Err(MountError::RootMount);
        }
        let ufs_err = |source| MountError::Ufs { path: path.clone(), uri: record.uri.clone(), source };
        UfsSpec::parse(&record.uri).map_err(ufs_err)?;
        let options = MountOptions::parse(&record.options).map_err(|e| MountError::BadOption {
            key: e.key,
            value: e.value,
            reason: e.reason,
        })?;
        let ufs = factory.open(&record.uri, &record.options).map_err(ufs_err)?;
        Ok(Self {
            record: MountRecord { path, ..record },
            block_size: options.block_size,
            metadata_ttl: options.metadata_ttl,
            read_only: !options.mode.is_writable(),
            write_back: options.mode == strata_common::MountMode::WriteBack,
            read_replicas: options.read_replicas,
            cache_ttl: options.cache_ttl,
            quota: options.quota,
            pack_threshold: options.pack_threshold,
            ufs,
        })
    }
}

#[derive(Default)]
pub struct MountTable {
    mounts: BTreeMap<String, Arc<Mount>>,
}

impl MountTable {
    /// Checks that `mount` may join the table.
    pub fn check_new(&self, mount: &Mount) -> Result<(), MountError> {
        let new = &mount.record.path;
        if self.mounts.contains_key(new) {
            return Err(MountError::AlreadyMounted(new.clone()));
        }
        for existing in self.mounts.keys() {
            if path::strip_mount(existing, new).is_some() || path::strip_mount(new, existing).is_some() {
                return Err(MountError::Nested { new: new.clone(), existing: existing.clone() });
            }
        }
        Ok(())
    }

    pub fn insert(&mut self, mount: Mount) -> Arc<Mount> {
        let mount = Arc::new(mount);
        self.mounts.insert(mount.record.path.clone(), mount.clone());
        mount
    }

    pub fn remove(&mut self, path: &str) -> Option<Arc<Mount>> {
        self.mounts.remove(path)
    }

    /// The mount holding a normalised path, and the path relative to the mount's UFS root.
    pub fn resolve(&self, path: &str) -> Option<(Arc<Mount>, String)> {
        path::resolve_mount(&self.mounts, path).map(|(_, mount, rel)| (mount.clone(), rel))
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<Mount>> {
        self.mounts.values()
    }

    pub fn len(&self) -> usize {
        self.mounts.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_ufs::OpendalFactory;

    fn record(path: &str, uri: &str) -> MountRecord {
        MountRecord { path: path.into(), uri: uri.into(), options: BTreeMap::new() }
    }

    #[test]
    fn validates_mount_points() {
        let f = OpendalFactory;
        let mut table = MountTable::default();
        let m = Mount::open(record("/data/", "file:///tmp"), &f).unwrap();
        assert_eq!(m.record.path, "/data");
        assert_eq!(m.block_size, strata_common::DEFAULT_BLOCK_SIZE);
        table.check_new(&m).unwrap();
        table.insert(m);

        let dup = Mount::open(record("/data", "file:///tmp"), &f).unwrap();
        assert!(matches!(table.check_new(&dup), Err(MountError::AlreadyMounted(_))));
        let nested = Mount::open(record("/data/x", "file:///tmp"), &f).unwrap();
        assert!(matches!(table.check_new(&nested), Err(MountError::Nested { .. })));
        let sibling = Mount::open(record("/database", "file:///tmp"), &f).unwrap();
        table.check_new(&sibling).unwrap();
        table.insert(sibling);

        assert!(matches!(Mount::open(record("data", "file:///tmp"), &f), Err(MountError::InvalidPath(_))));
        assert!(matches!(Mount::open(record("/a/../b", "file:///tmp"), &f), Err(MountError::InvalidPath(_))));
        assert!(matches!(Mount::open(record("/", "file:///tmp"), &f), Err(MountError::RootMount)));
        assert!(matches!(
            Mount::open(record("/x", "gopher://h/p"), &f),
            Err(MountError::Ufs { source: UfsError::UnsupportedScheme(_), .. })
        ));

        let (m, rel) = table.resolve("/data/a/b.bin").unwrap();
        assert_eq!((m.record.path.as_str(), rel.as_str()), ("/data", "a/b.bin"));
        let (m, rel) = table.resolve("/database").unwrap();
        assert_eq!((m.record.path.as_str(), rel.as_str()), ("/database", ""));
        assert!(table.resolve("/other/x").is_none());
        assert!(table.resolve("/dat").is_none());
    }

    #[test]
    fn parses_options() {
        let f = OpendalFactory;
        let mut r = record("/d", "file:///tmp");
        r.options.insert("block_size".into(), "1MiB".into());
        r.options.insert("metadata_ttl".into(), "250ms".into());
        let m = Mount::open(r.clone(), &f).unwrap();
        assert_eq!(m.block_size, 1 << 20);
        assert_eq!(m.metadata_ttl, Duration::from_millis(250));
        r.options.insert("block_size".into(), "12".into());
        assert!(matches!(Mount::open(r.clone(), &f), Err(MountError::BadOption { .. })));
        r.options.insert("block_size".into(), "4MiB".into());
        r.options.insert("metadata_ttl".into(), "soon".into());
        assert!(matches!(Mount::open(r, &f), Err(MountError::BadOption { .. })));
    }
}
