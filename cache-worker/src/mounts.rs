//! The worker's mount table: which UFS a Strata path is read from, with the mount's block size
//! and mode. It is filled from a [`MountSource`] — the master (`master_link`) in a worker or a
//! sidecar, an in-memory table in tests — when the master says the table changed, and once more
//! whenever a request names a path no known mount holds (a mount added since the last
//! heartbeat), so a new mount is usable at once.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock, RwLock};

use async_trait::async_trait;
use strata_common::block::{identity_prefix, identity_under};
use strata_common::{BlockKey, MountMode, MountOptions, path};
use strata_ufs::{StateFence, Ufs, UfsFactory};
use tracing::warn;

use crate::error::ServeError;

/// A mount as the master describes it to a worker (with the UFS credentials).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MountSpec {
    pub path: String,
    pub uri: String,
    pub options: BTreeMap<String, String>,
    /// The block size the master parsed from the options and every client computes with.
    pub block_size: u64,
}

/// The master's mount table at one epoch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MountSnapshot {
    pub epoch: u64,
    pub mounts: Vec<MountSpec>,
    /// What the cluster's other processes own on their hosts: fenced here too.
    pub state_paths: Vec<String>,
}

/// Where the table comes from.
#[async_trait]
pub trait MountSource: Send + Sync + 'static {
    async fn fetch(&self) -> Result<MountSnapshot, String>;
}

/// A mount as a worker needs it: where its blocks come from and how big they are.
pub struct WorkerMount {
    /// The mount point (Strata path).
    pub path: String,
    pub uri: String,
    pub block_size: u64,
    pub mode: MountMode,
    /// Every option Strata interprets (write-back's replicas, upload caps...).
    pub options: MountOptions,
    pub ufs: Arc<dyn Ufs>,
}

/// A path resolved to its mount.
pub struct Resolved {
    /// The normalised Strata path.
    pub path: String,
    pub mount: Arc<WorkerMount>,
    /// The path under the mount (empty for the mount point itself).
    pub rel: String,
}

pub struct Mounts {
    /// Opens every local UFS behind `fence`.
    factory: Arc<dyn UfsFactory>,
    fence: StateFence,
    table: RwLock<(u64, BTreeMap<String, Arc<WorkerMount>>)>,
    source: OnceLock<Arc<dyn MountSource>>,
}

impl Mounts {
    /// A table whose `file://` mounts never serve what `fence` holds (this process's own files,
    /// and those the master says the cluster's other processes own).
    pub fn new(factory: Arc<dyn UfsFactory>, fence: StateFence) -> Self {
        Self {
            factory: fence.wrap(factory),
            fence,
            table: RwLock::new((0, BTreeMap::new())),
            source: OnceLock::new(),
        }
    }

    /// What this process owns, to tell the master.
    pub fn own_state(&self) -> Vec<String> {
        self.fence.own()
    }

    /// Sets where the table is fetched from. Set once; later calls are ignored.
    pub fn set_source(&self, source: Arc<dyn MountSource>) {
        let _ = self.source.set(source);
    }

    /// Replaces the table. A mount whose options or UFS do not open here is skipped (and
    /// logged): its paths then fail as unmounted rather than the whole table failing.
    pub fn apply(&self, snapshot: &MountSnapshot) {
        self.fence.learn(snapshot.state_paths.iter().cloned());
        let mut table = BTreeMap::new();
        for m in &snapshot.mounts {
            let opened = MountOptions::parse(&m.options).map_err(|e| e.to_string()).and_then(|o| {
                self.factory.open(&m.uri, &m.options).map(|ufs| (o, ufs)).map_err(|e| e.to_string())
            });
            match opened {
                Ok((options, ufs)) => {
                    let mount = WorkerMount {
                        path: m.path.clone(),
                        uri: m.uri.clone(),
                        block_size: m.block_size,
                        mode: options.mode,
                        options,
                        ufs,
                    };
                    table.insert(m.path.clone(), Arc::new(mount));
                }
                Err(e) => warn!(mount = %m.path, err = %e, "cannot open mount's UFS on this worker"),
            }
        }
        *self.table.write().unwrap_or_else(|p| p.into_inner()) = (snapshot.epoch, table);
    }

    /// Fetches the table from the source now (a failure keeps the current table).
    pub async fn refresh(&self) {
        let Some(source) = self.source.get() else { return };
        match source.fetch().await {
            Ok(snapshot) => self.apply(&snapshot),
            Err(e) => warn!(err = %e, "cannot fetch mounts"),
        }
    }

    pub fn epoch(&self) -> u64 {
        self.table.read().unwrap_or_else(|p| p.into_inner()).0
    }

    /// Every mount in the table now.
    pub fn all(&self) -> Vec<Arc<WorkerMount>> {
        self.table.read().unwrap_or_else(|p| p.into_inner()).1.values().cloned().collect()
    }

    /// The `pack_threshold` of the mount a block belongs to (the mount whose UFS prefix is the
    /// longest that holds its file identity, as upkeep decides); 0 when no mount holds it.
    pub fn pack_threshold_of(&self, key: &BlockKey) -> u64 {
        let guard = self.table.read().unwrap_or_else(|p| p.into_inner());
        guard
            .1
            .values()
            .map(|m| (identity_prefix(&m.uri, ""), m.options.pack_threshold))
            .filter(|(prefix, _)| identity_under(prefix, &key.file))
            .max_by_key(|(prefix, _)| prefix.len())
            .map_or(0, |(_, threshold)| threshold)
    }

    fn lookup(&self, p: &str) -> Option<(Arc<WorkerMount>, String)> {
        let guard = self.table.read().unwrap_or_else(|p| p.into_inner());
        path::resolve_mount(&guard.1, p).map(|(_, m, rel)| (m.clone(), rel))
    }

    /// A Strata path normalised and resolved to its mount, asking the source for the table
    /// once when no known mount holds it.
    pub async fn resolve(&self, raw: &str) -> Result<Resolved, ServeError> {
        let p = path::normalize(raw).map_err(|e| ServeError::InvalidArgument(e.to_string()))?;
        let (mount, rel) = match self.lookup(&p) {
            Some(found) => found,
            None => {
                self.refresh().await;
                self.lookup(&p).ok_or_else(|| ServeError::NoMount(p.clone()))?
            }
        };
        Ok(Resolved { path: p, mount, rel })
    }
}

/// A fixed table, for tests.
#[cfg(any(test, feature = "testing"))]
pub struct StaticMounts(pub MountSnapshot);

#[cfg(any(test, feature = "testing"))]
#[async_trait]
impl MountSource for StaticMounts {
    async fn fetch(&self) -> Result<MountSnapshot, String> {
        Ok(self.0.clone())
    }
}

#[cfg(test)]
mod tests {
    use strata_ufs::OpendalFactory;

    use super::*;

    #[tokio::test]
    async fn an_unknown_path_asks_the_source_once_and_options_are_typed() {
        let dir = tempfile::tempdir().unwrap();
        let spec = |path: &str, mode: &str| MountSpec {
            path: path.into(),
            uri: format!("file://{}", dir.path().display()),
            options: [("mode".to_string(), mode.to_string())].into(),
            block_size: 1 << 20,
        };
        let mounts = Mounts::new(Arc::new(OpendalFactory), strata_ufs::StateFence::new());
        assert!(matches!(mounts.resolve("/a/x").await, Err(ServeError::NoMount(_))), "no source, no table");
        mounts.set_source(Arc::new(StaticMounts(MountSnapshot {
            epoch: 7,
            mounts: vec![spec("/a", "write-through"), spec("/b", "read-only"), spec("/bad", "sideways")],
            state_paths: Vec::new(),
        })));
        let r = mounts.resolve("//a/x/").await.unwrap();
        assert_eq!((r.path.as_str(), r.rel.as_str()), ("/a/x", "x"));
        assert_eq!((r.mount.block_size, r.mount.mode), (1 << 20, MountMode::WriteThrough));
        assert_eq!(mounts.epoch(), 7);
        assert_eq!(mounts.resolve("/b/y").await.unwrap().mount.mode, MountMode::ReadOnly);
        assert!(matches!(mounts.resolve("/bad/z").await, Err(ServeError::NoMount(_))), "bad options skip it");
        assert!(matches!(mounts.resolve("../etc").await, Err(ServeError::InvalidArgument(_))));
    }
}
