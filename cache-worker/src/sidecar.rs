//! Sidecar mode: a worker inside a training pod that serves that pod's processes over a Unix
//! socket (in an `emptyDir` both containers mount), keeps a small pod-local tier, and fetches a
//! miss from the cluster's workers before the UFS.
//!
//! Invariants: a sidecar never registers with the master, so it is never on the placement ring
//! and never in the block map — cluster clients cannot send it reads, and its blocks are not
//! counted as cluster copies. It still learns the mount table (with credentials, as a worker
//! does) so that it can read the UFS itself when the cluster cannot serve. Blocks it gets from
//! the cluster are keyed exactly as the cluster keys them (same file identity, version, index),
//! so a version change is caught the same way.
//!
//! The socket is `0660`, optionally given to `socket_group` (the pod's shared group), and every
//! connection's peer uid is checked (`SO_PEERCRED`) against the sidecar's own, root and
//! `socket_allowed_uids` (see the data plane's admission).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use strata_common::background::spawn_loop;
use strata_common::upstream::Upstream;
use strata_ufs::UfsFactory;
use tokio::net::UnixListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::blocks::BlockService;
use crate::grants::Grants;
use crate::{WorkerConfig, WorkerError, dataplane, master_link};

/// How often a sidecar asks the master for the mount table (workers learn changes from their
/// heartbeat answers; a sidecar has no heartbeat). An unknown mount is fetched at once anyway.
const MOUNT_REFRESH: Duration = Duration::from_secs(10);

/// A running sidecar. Dropping it does not stop it: call [`SidecarHandle::shutdown`].
pub struct SidecarHandle {
    pub socket_path: PathBuf,
    pub http_addr: std::net::SocketAddr,
    pub blocks: Arc<BlockService>,
    pub grants: Arc<Grants>,
    /// The data plane's open connections, limits and refusal/timeout counts.
    pub connections: Arc<dataplane::Connections>,
    cancel: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl SidecarHandle {
    pub async fn shutdown(self) {
        self.blocks.flush().await;
        self.cancel.cancel();
        for task in self.tasks {
            task.abort();
            let _ = task.await;
        }
        let _ = std::fs::remove_file(&self.socket_path);
    }
}

/// Starts a sidecar: `config.socket_path` is required; `data_addr` is not used (a sidecar has
/// no TCP data plane). `upstream` is the cluster (the client SDK's `ClusterUpstream`), asked
/// for a miss before the UFS; the master gives the mount table.
pub async fn start(
    config: WorkerConfig,
    factory: Arc<dyn UfsFactory>,
    upstream: Arc<dyn Upstream>,
) -> Result<SidecarHandle, WorkerError> {
    start_with_clock(config, factory, upstream, strata_common::clock::system()).await
}

/// [`start`] with `clock` deciding leases and quiet times (tests).
pub async fn start_with_clock(
    config: WorkerConfig,
    factory: Arc<dyn UfsFactory>,
    upstream: Arc<dyn Upstream>,
    clock: strata_common::SharedClock,
) -> Result<SidecarHandle, WorkerError> {
    let socket_path = config.socket_path.clone().ok_or(WorkerError::Sidecar {
        reason: "sidecar mode needs a socket path (--socket or socket_path)".into(),
    })?;
    config.watermarks.check().map_err(WorkerError::Config)?;
    config.check_qos().map_err(WorkerError::Config)?;
    let worker_id =
        config.worker_id.clone().unwrap_or_else(|| format!("sidecar-{}", uuid::Uuid::new_v4().simple()));
    let blocks = crate::open_blocks(&config, factory, clock.clone()).await?;
    let grants = Arc::new(Grants::from_config(&config, clock.clone())?);
    blocks.set_upstream(upstream);
    let token = config.resolve_token()?;
    let master = master_link::connect(&config.master_addr, token.as_deref(), config.tls.client()?)
        .map_err(|e| WorkerError::MasterAddr { addr: config.master_addr.clone(), reason: e.to_string() })?;
    blocks.mounts().set_source(Arc::new(master_link::MasterMounts {
        client: master.clone(),
        worker_id: worker_id.clone(),
    }));
    blocks.mounts().refresh().await;
    let view = Arc::new(crate::view::LastView::new(worker_id.clone()));
    master_link::refresh_view(&master, &view, &clock).await;
    let auth = master_link::learn_tokens(&master, &worker_id).await;

    let listener = bind_socket(&socket_path, config.socket_group.as_deref())?;

    let cancel = CancellationToken::new();
    let connections = Arc::new(dataplane::Connections::from_config(&config));
    let plane = dataplane::DataPlane {
        blocks: blocks.clone(),
        grants: grants.clone(),
        view: view.clone(),
        auth: auth.clone(),
        connections: connections.clone(),
        writeback: None,
        handoff: None,
        prefetch: None,
        classes: Arc::new(crate::classes::ClassGate::default()),
        latency_lane: Arc::new(dataplane::LatencyLane::new(
            config.qos_latency_thread,
            config.qos_latency_priority(),
        )),
    };
    let dp = tokio::spawn(dataplane::serve_unix(listener, plane, cancel.clone()));
    let (http_addr, http_task) = crate::serve_ops(config.http_addr, &blocks).await?;
    // A sidecar is not on the ring, so quotas (shared by ring position) never apply to it;
    // watermarks and mounts' cache TTLs do.
    let tiers: Vec<Arc<dyn crate::tier::Tier>> = blocks.cache().tiers().into_iter().cloned().collect();
    let upkeep = Arc::new(crate::upkeep::Upkeep::new(
        &tiers,
        &config.watermarks,
        crate::pins::PinSet::new(),
        crate::upkeep::cluster_rules(blocks.mounts().clone(), view.clone(), worker_id.clone()),
        clock.clone(),
    ));
    let upkeep_task = tokio::spawn(crate::upkeep::run(
        upkeep,
        std::time::Duration::from_millis(config.upkeep_interval_ms),
        cancel.clone(),
    ));
    let refresher = {
        let blocks = blocks.clone();
        let worker_id = worker_id.clone();
        spawn_loop(MOUNT_REFRESH, cancel.clone(), move || {
            let (blocks, master, view, clock) = (blocks.clone(), master.clone(), view.clone(), clock.clone());
            let (auth, worker_id) = (auth.clone(), worker_id.clone());
            async move {
                blocks.mounts().refresh().await;
                // A sidecar never heartbeats: its view and tokens are refreshed with its mounts.
                master_link::refresh_view(&master, &view, &clock).await;
                master_link::refresh_tokens(&master, &worker_id, &auth).await;
            }
        })
    };
    info!(sidecar = %worker_id, socket = %socket_path.display(), %http_addr, "sidecar started");
    let writeback = crate::spawn_writeback(&blocks, &cancel);
    Ok(SidecarHandle {
        socket_path,
        http_addr,
        blocks,
        grants,
        connections,
        cancel,
        tasks: vec![dp, http_task, refresher, writeback, upkeep_task],
    })
}

/// Bytes a Unix socket's path may have (`sun_path` holds 108 with its terminating NUL).
pub const MAX_SOCKET_PATH: usize = 108;

/// Binds a data-plane socket (a sidecar's, or a worker's for its host) at `path`, mode `0660`,
/// given to `group` when set.
pub(crate) fn bind_socket(socket_path: &Path, group: Option<&str>) -> Result<UnixListener, WorkerError> {
    let socket_err = |source| WorkerError::Socket { path: socket_path.display().to_string(), source };
    if socket_path.as_os_str().len() >= MAX_SOCKET_PATH {
        return Err(socket_err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "a Unix socket's path must be shorter than {MAX_SOCKET_PATH} bytes: choose a shorter one"
            ),
        )));
    }
    let gid = group
        .map(resolve_group)
        .transpose()
        .map_err(|e| WorkerError::Sidecar { reason: format!("socket_group: {e}") })?;
    // A socket file left by an earlier container of this pod would make bind fail.
    match std::fs::remove_file(socket_path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(socket_err(e)),
    }
    if let Some(parent) = socket_path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(socket_err)?;
    }
    let listener = UnixListener::bind(socket_path).map_err(socket_err)?;
    // Owner and group only: a training container running as another uid shares the group
    // (Kubernetes: the pod's fsGroup), and its uid must still pass the SO_PEERCRED check.
    // The group first, so the socket is never open to a group it was not meant for.
    if gid.is_some() {
        std::os::unix::fs::chown(socket_path, None, gid).map_err(socket_err)?;
    }
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(socket_path, std::fs::Permissions::from_mode(0o660)).map_err(socket_err)?;
    }
    Ok(listener)
}

/// A group name (looked up in /etc/group) or a numeric gid.
fn resolve_group(group: &str) -> Result<u32, String> {
    if let Ok(gid) = group.parse::<u32>() {
        return Ok(gid);
    }
    let groups = std::fs::read_to_string("/etc/group").map_err(|e| format!("/etc/group: {e}"))?;
    group_in(&groups, group).ok_or_else(|| format!("no group {group:?} in /etc/group (give a numeric gid)"))
}

/// The gid of `name` in the text of an /etc/group file (`name:password:gid:members`).
fn group_in(etc_group: &str, name: &str) -> Option<u32> {
    etc_group.lines().find_map(|line| {
        let mut fields = line.split(':');
        (fields.next()? == name).then_some(())?;
        fields.nth(1)?.parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use async_trait::async_trait;
    use bytes::Bytes;
    use strata_common::frame::Source;
    use strata_common::upstream::{UpstreamError, UpstreamRead};
    use strata_ufs::OpendalFactory;
    use strata_ufs::testing::CountingFactory;

    use super::*;
    use crate::blocks::BlockRead;
    use crate::cache::BlockCache;
    use crate::mounts::{MountSnapshot, MountSpec, Mounts, StaticMounts};

    /// An upstream that answers from a script: the block's bytes, a wrong length, or an error.
    struct ScriptedUpstream {
        answers: Mutex<Vec<Result<Bytes, UpstreamError>>>,
        asked: Mutex<Vec<(String, String, u64, u64)>>,
    }

    #[async_trait]
    impl Upstream for ScriptedUpstream {
        async fn read_block(&self, read: UpstreamRead<'_>) -> Result<Bytes, UpstreamError> {
            self.asked.lock().unwrap().push((
                read.path.to_string(),
                read.version.to_string(),
                read.index,
                read.len,
            ));
            self.answers.lock().unwrap().remove(0)
        }
    }

    #[test]
    fn groups_resolve_by_number_or_name() {
        assert_eq!(resolve_group("10001"), Ok(10001));
        let etc = "root:x:0:\n# comment\nstrata:x:10001:alice,bob\nbad:x:notanumber:\n";
        assert_eq!(group_in(etc, "strata"), Some(10001));
        assert_eq!(group_in(etc, "root"), Some(0));
        assert_eq!(group_in(etc, "bad"), None);
        assert_eq!(group_in(etc, "missing"), None);
        assert!(resolve_group("surely-no-such-group-here").is_err());
    }

    #[tokio::test]
    async fn a_miss_asks_the_upstream_first_and_falls_back_to_the_ufs() {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..2500u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(dir.path().join("f.bin"), &data).unwrap();
        let factory = Arc::new(CountingFactory::new(Arc::new(OpendalFactory)));
        let (cache, counters) = BlockCache::dram_only(1 << 20);
        let mounts = Arc::new(Mounts::new(factory.clone(), strata_ufs::StateFence::new()));
        let uri = format!("file://{}", dir.path().display());
        mounts.set_source(Arc::new(StaticMounts(MountSnapshot {
            epoch: 1,
            mounts: vec![MountSpec {
                path: "/d".into(),
                uri: uri.clone(),
                options: Default::default(),
                block_size: 1024,
            }],
            state_paths: Vec::new(),
        })));
        let blocks = BlockService::for_tests(cache, counters, mounts);
        let version = factory.open(&uri, &Default::default()).unwrap().stat("f.bin").await.unwrap().version;
        let upstream = Arc::new(ScriptedUpstream {
            answers: Mutex::new(vec![
                Ok(Bytes::from(data[..1024].to_vec())),
                Ok(Bytes::from_static(b"short")),
                Err(UpstreamError("no live workers".into())),
            ]),
            asked: Mutex::new(Vec::new()),
        });
        blocks.set_upstream(upstream.clone());
        let req = |index: u64, len: u64| BlockRead {
            path: "/d/f.bin".into(),
            version: version.clone(),
            file_size: data.len() as u64,
            block_size: 1024,
            index,
            offset: 0,
            len,
        };

        // Block 0 comes from the upstream and is kept: the second read is a memory hit.
        let (bytes, _) = blocks.read(&req(0, 1024)).await.unwrap();
        assert_eq!(&bytes[..], &data[..1024]);
        assert_eq!(blocks.read(&req(0, 1024)).await.unwrap().1, Source::Memory);
        // Block 1: the upstream sends a wrong length, so the UFS is read. Block 2 (the last,
        // 452 bytes): the upstream fails, so the UFS is read.
        assert_eq!(&blocks.read(&req(1, 1024)).await.unwrap().0[..], &data[1024..2048]);
        assert_eq!(&blocks.read(&req(2, 452)).await.unwrap().0[..], &data[2048..]);

        assert_eq!(blocks.counters().upstream_reads, 1);
        assert_eq!(factory.counters.reads(), 2, "only the blocks the upstream could not serve");
        let asked = upstream.asked.lock().unwrap().clone();
        assert_eq!(
            asked,
            vec![
                ("/d/f.bin".to_string(), version.clone(), 0, 1024),
                ("/d/f.bin".to_string(), version.clone(), 1, 1024),
                ("/d/f.bin".to_string(), version.clone(), 2, 452),
            ]
        );
    }
}
