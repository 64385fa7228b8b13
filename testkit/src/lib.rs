//! An in-process Strata cluster for tests: a master and N workers on 127.0.0.1 port 0, a UFS
//! in a temporary directory (opendal's fs service) wrapped in a counting, fault-injecting
//! layer (and one counting reads per byte range), and helpers to kill and restart any part.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_client::{Client, ClientConfig};
use strata_master::{Master, MasterConfig, MasterHandle};
use strata_ufs::OpendalFactory;
use strata_ufs::testing::{CountingFactory, UfsCounters, UfsFaults};
use strata_worker::{Worker, WorkerConfig, WorkerHandle};
use tempfile::TempDir;

pub mod fault_proxy;
pub mod range_reads;
pub mod tls;
mod ufs;

pub use range_reads::RangeReads;
pub use strata_client;
pub use strata_common::testing::Tmpfs;
pub use strata_ufs;
pub use ufs::TestUfs;

#[derive(Debug, Clone)]
pub struct ClusterOptions {
    pub workers: usize,
    pub worker_timeout_ms: u64,
    pub heartbeat_interval_ms: u64,
    pub memory_capacity: u64,
    pub nvme_capacity: u64,
    /// Options of the `/data` mount (block_size, metadata_ttl, ...); they override the UFS's
    /// own (a test can point `endpoint` at a fault proxy).
    pub mount_options: Vec<(String, String)>,
    /// Require tokens (the default, as a real cluster does): the harness's clients present the
    /// admin token, its workers the worker token (`admin_token`, `worker_token`).
    pub auth: bool,
    /// TLS on both planes with these test certificates (`None`, the default: plain TCP);
    /// `client_auth` makes the master and workers require client certificates (mTLS).
    pub tls: Option<ClusterTls>,
    /// Each worker's NVMe tier on a tmpfs of this size (`mount -o size=`: "3m"), so a test
    /// can fill its disk; `None` (the default): a directory of the test's temporary directory.
    /// Needs root.
    pub nvme_disk: Option<&'static str>,
    /// The node each worker reports (worker `i` gets `nodes[i]`; none past the end), as
    /// `STRATA_NODE` would set it on a real host.
    pub nodes: Vec<String>,
    /// Each worker's `handoff_bandwidth`; 0 turns background hand-off off, so a test can
    /// measure peer fetch on demand alone.
    pub handoff_bandwidth: u64,
    /// Each worker also serves a Unix socket (`worker-<i>.sock` in the state directory), as
    /// `strata worker --socket` does, so the harness's clients read by short-circuit.
    pub local_sockets: bool,
    /// Each worker's `qos_slots` (answers sent at once before the rest wait by class).
    pub qos_slots: usize,
    /// Each worker's `qos_latency_slice_us` (its latency lane thread's scheduling slice).
    pub qos_latency_slice_us: u32,
}

#[derive(Debug, Clone)]
pub struct ClusterTls {
    pub pki: Arc<tls::TestPki>,
    pub client_auth: bool,
}

impl std::fmt::Debug for tls::TestPki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestPki").field("dir", &self.path("")).finish()
    }
}

impl Default for ClusterOptions {
    fn default() -> Self {
        Self {
            workers: 3,
            // Generous: a loaded CI machine can delay heartbeats by seconds.
            worker_timeout_ms: 5_000,
            heartbeat_interval_ms: 100,
            memory_capacity: 256 << 20,
            nvme_capacity: 1 << 30,
            mount_options: vec![("block_size".into(), "1MiB".into()), ("metadata_ttl".into(), "60s".into())],
            auth: true,
            tls: None,
            nvme_disk: None,
            nodes: Vec::new(),
            handoff_bandwidth: strata_worker::handoff::DEFAULT_HANDOFF_BANDWIDTH,
            local_sockets: false,
            qos_slots: strata_worker::classes::DEFAULT_QOS_SLOTS,
            qos_latency_slice_us: strata_worker::config::DEFAULT_QOS_LATENCY_SLICE_US,
        }
    }
}

pub struct Cluster {
    /// The UFS mounted at `/data`.
    pub ufs: TestUfs,
    state_dir: TempDir,
    pub factory: Arc<CountingFactory>,
    range_reads: Arc<RangeReads>,
    master: Option<MasterHandle>,
    master_config: MasterConfig,
    workers: Vec<Option<WorkerHandle>>,
    worker_configs: Vec<WorkerConfig>,
    tls: Option<ClusterTls>,
    /// The workers' NVMe disks when `nvme_disk` asked for them; unmounted after the workers stop.
    nvme_disks: Vec<Tmpfs>,
}

impl Cluster {
    /// A cluster with a temporary directory mounted at `/data`.
    pub async fn start(opts: ClusterOptions) -> Self {
        Self::start_with(opts, TestUfs::fs()).await
    }

    /// A cluster with `ufs` mounted at `/data`.
    pub async fn start_with(opts: ClusterOptions, ufs: TestUfs) -> Self {
        // Logs go to the test's captured output (shown when it fails); RUST_LOG filters them.
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let _ = tracing_subscriber::fmt().with_env_filter(filter).with_test_writer().try_init();
        let state_dir = tempfile::tempdir().expect("tempdir");
        let server_tls = opts.tls.as_ref().map(|t| t.pki.server(t.client_auth)).unwrap_or_default();
        let ranges = range_reads::RangeCountingFactory::new(Arc::new(OpendalFactory));
        let range_reads = ranges.reads.clone();
        let factory = Arc::new(CountingFactory::new(Arc::new(ranges)));
        let mut master_config = MasterConfig {
            rpc_addr: "127.0.0.1:0".parse().expect("addr"),
            http_addr: "127.0.0.1:0".parse().expect("addr"),
            data_dir: state_dir.path().join("master"),
            worker_timeout_ms: opts.worker_timeout_ms,
            heartbeat_interval_ms: opts.heartbeat_interval_ms,
            // Tests watch journals go once their file is uploaded.
            writeback_journal_grace_ms: 200,
            auth: opts.auth,
            tls: server_tls.clone(),
            ..MasterConfig::default()
        };
        let token_files = master_config.token_files();
        let master = Master::start(master_config.clone(), factory.clone()).await.expect("master starts");
        // Restarts come back on the same port, as a real master would.
        master_config.rpc_addr = master.rpc_addr;
        let nvme_disks: Vec<Tmpfs> = opts
            .nvme_disk
            .map(|size| {
                (0..opts.workers)
                    .map(|i| Tmpfs::new(state_dir.path().join(format!("nvme-{i}")), size))
                    .collect()
            })
            .unwrap_or_default();
        let worker_configs = (0..opts.workers)
            .map(|i| WorkerConfig {
                nvme_dir: nvme_disks.get(i).map(|d| d.path().to_path_buf()),
                // The journals stay off a disk a test fills.
                journal_dir: nvme_disks.get(i).map(|_| state_dir.path().join(format!("journal-{i}"))),
                master_addr: master.rpc_addr.to_string(),
                data_addr: "127.0.0.1:0".parse().expect("addr"),
                http_addr: "127.0.0.1:0".parse().expect("addr"),
                data_dir: state_dir.path().join(format!("worker-{i}")),
                memory_capacity: opts.memory_capacity,
                nvme_capacity: opts.nvme_capacity,
                token_file: Some(token_files.worker_file.clone()).filter(|_| opts.auth),
                tls: server_tls.clone(),
                node: opts.nodes.get(i).cloned(),
                // As quick as the harness's heartbeats, so TTLs and quotas act within a test.
                upkeep_interval_ms: 100,
                handoff_bandwidth: opts.handoff_bandwidth,
                socket_path: opts.local_sockets.then(|| state_dir.path().join(format!("worker-{i}.sock"))),
                qos_slots: opts.qos_slots,
                qos_latency_slice_us: opts.qos_latency_slice_us,
                ..WorkerConfig::default()
            })
            .collect();
        let mut cluster = Self {
            ufs,
            state_dir,
            factory,
            range_reads,
            master: Some(master),
            master_config,
            workers: Vec::new(),
            worker_configs,
            tls: opts.tls,
            nvme_disks,
        };
        // Peer fetch connects once every worker is live, so each worker's first view of the
        // cluster holds all of them: a worker whose peer client still lacked the last one
        // (until its next refresh) would send a second replica's fetch to a worker that is no
        // owner, which then caches a third copy.
        for i in 0..opts.workers {
            let w = cluster.start_worker(i).await;
            cluster.workers.push(Some(w));
        }
        cluster.wait_for_live_workers(opts.workers).await;
        for (i, w) in cluster.workers.iter().enumerate() {
            cluster.attach_peers(i, w.as_ref().expect("just started")).await;
        }
        let client = cluster.client().await;
        let options: HashMap<String, String> =
            cluster.ufs.mount_options().into_iter().chain(opts.mount_options).collect();
        client.admin().add_mount("/data", &cluster.ufs_uri(), options).await.expect("mount /data");
        // Every worker knows the mount before a test begins: a test that stops the master
        // right away must not find a worker that has not yet heard of /data from a heartbeat.
        for w in cluster.workers.iter().flatten() {
            w.blocks.mounts().resolve("/data").await.expect("every worker knows /data");
        }
        cluster
    }

    pub fn ufs_uri(&self) -> String {
        self.ufs.uri()
    }

    pub fn state_dir(&self) -> &Path {
        self.state_dir.path()
    }

    /// Worker `i`, with peer fetch as `strata worker` has it.
    async fn spawn_worker(&self, i: usize) -> WorkerHandle {
        let handle = self.start_worker(i).await;
        self.attach_peers(i, &handle).await;
        handle
    }

    /// Worker `i` without peer fetch ([`start_with`](Self::start_with) attaches it once every
    /// worker is live).
    async fn start_worker(&self, i: usize) -> WorkerHandle {
        Worker::start(self.worker_configs[i].clone(), self.factory.clone()).await.expect("worker starts")
    }

    /// Gives worker `i` peer fetch as `strata worker` has it.
    async fn attach_peers(&self, i: usize, handle: &WorkerHandle) {
        let config = &self.worker_configs[i];
        let token = config.resolve_token().expect("worker token");
        let tls = self.tls.as_ref().map(|t| t.pki.client()).unwrap_or_default();
        let peers = strata_client::PeerUpstream::connect(
            &config.master_addr,
            &handle.worker_id,
            token,
            Duration::from_millis(500),
            tls,
        )
        .await
        .expect("peer fetch connects");
        let peers = Arc::new(peers);
        handle.blocks.set_upstream(peers.clone());
        handle.handoff.set_peer_link(peers);
    }

    /// The cluster as a sidecar's upstream, presenting `token`, with this harness's client
    /// settings ([`client_config`](Self::client_config)).
    pub async fn sidecar_upstream(
        &self,
        token: Option<String>,
        request_timeout: Duration,
    ) -> strata_client::ClusterUpstream {
        let mut c = self.client_config();
        c.sidecar_socket = None;
        c.request_timeout = request_timeout;
        c.token = token.map(strata_client::Token);
        strata_client::ClusterUpstream::new(Client::connect(c).await.expect("the sidecar's cluster client"))
    }

    /// Starts one more worker (a new id and NVMe tier) and waits until the master lists it.
    pub async fn add_worker(&mut self) -> usize {
        let i = self.worker_configs.len();
        let mut config = self.worker_configs[0].clone();
        config.data_dir = self.state_dir.path().join(format!("worker-{i}"));
        config.node = None;
        self.worker_configs.push(config);
        let w = self.spawn_worker(i).await;
        self.workers.push(Some(w));
        self.wait_for_live_workers(self.workers.iter().flatten().count()).await;
        i
    }

    pub fn master_addr(&self) -> String {
        self.master_config.rpc_addr.to_string()
    }

    /// A client's configuration presenting the admin token (none with `auth: false`). Reads
    /// hedge only after 2 s: tests that count UFS reads or bytes served exactly must not see a
    /// loaded CI machine's slow answer raced by a second worker (the hedging tests set their
    /// own policy).
    pub fn client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new(self.master_addr());
        c.membership_refresh = Duration::from_millis(200);
        c.request_timeout = Duration::from_secs(20);
        c.hedge = strata_client::HedgePolicy { min: Duration::from_secs(2), max: Duration::from_secs(5) };
        c.token = self.admin_token().map(strata_client::Token);
        // The cluster's TLS, never the environment's.
        c.tls = self.tls.as_ref().map(|t| t.pki.client()).unwrap_or_default();
        c
    }

    /// The admin token the master wrote at its first start; `None` with `auth: false`.
    pub fn admin_token(&self) -> Option<String> {
        self.master_config.auth.then(|| read_token(&self.master_config.token_files().admin_file))
    }

    /// The token the workers present; `None` with `auth: false`.
    pub fn worker_token(&self) -> Option<String> {
        self.master_config.auth.then(|| read_token(&self.master_config.token_files().worker_file))
    }

    /// A raw data-plane connection to `addr` that has presented the admin token (when auth is
    /// on): for tests that speak frames themselves.
    pub async fn dial(&self, addr: impl tokio::net::ToSocketAddrs) -> tokio::net::TcpStream {
        use tokio::io::AsyncWriteExt;
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect to the worker");
        if let Some(token) = self.admin_token() {
            s.write_all(&strata_common::frame::auth_request(&token)).await.expect("auth frame");
        }
        s
    }

    /// The file holding the admin token; `None` with `auth: false`.
    pub fn admin_token_file(&self) -> Option<PathBuf> {
        self.master_config.auth.then(|| self.master_config.token_files().admin_file)
    }

    /// The file holding the workers' token; `None` with `auth: false`.
    pub fn worker_token_file(&self) -> Option<PathBuf> {
        self.master_config.auth.then(|| self.master_config.token_files().worker_file)
    }

    /// A client presenting `token` (or none).
    pub async fn client_with_token(&self, token: Option<&str>) -> Result<Client, strata_client::ClientError> {
        let mut c = self.client_config();
        c.token = token.map(|t| strata_client::Token(t.to_string()));
        Client::connect(c).await
    }

    pub async fn client(&self) -> Client {
        Client::connect(self.client_config()).await.expect("client connects")
    }

    /// Writes `n` files of about 1 MiB each under `dir` of the `/data` mount (file `i` is
    /// `1 MiB - 7 i` bytes of `pattern(seed + i)`), reads each once through `client` checking
    /// its bytes, so the cluster holds them; returns their paths and bytes.
    pub async fn warm_files(
        &self,
        client: &Client,
        dir: &str,
        n: usize,
        seed: u64,
    ) -> Vec<(String, Vec<u8>)> {
        let files: Vec<(String, Vec<u8>)> = (0..n)
            .map(|i| {
                let data = pattern((1 << 20) - 7 * i, seed + i as u64);
                self.write_file(&format!("{dir}/f{i}.bin"), &data);
                (format!("/data/{dir}/f{i}.bin"), data)
            })
            .collect();
        for (path, data) in &files {
            let got = client.read_all(path).await.unwrap_or_else(|e| panic!("{path}: {e}"));
            assert!(got[..] == data[..], "{path}: wrong bytes");
        }
        files
    }

    /// Writes a file into a directory UFS (relative to the `/data` mount).
    pub fn write_file(&self, rel: &str, bytes: &[u8]) -> PathBuf {
        let path = self.ufs.dir().join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).expect("mkdir");
        }
        std::fs::write(&path, bytes).expect("write ufs file");
        path
    }

    pub fn counters(&self) -> &UfsCounters {
        &self.factory.counters
    }

    pub fn faults(&self) -> &UfsFaults {
        &self.factory.faults
    }

    /// UFS range reads that returned data, across every process part.
    pub fn ufs_reads(&self) -> u64 {
        self.factory.counters.reads()
    }

    /// The same reads per object and byte range: which block was fetched how many times, by
    /// every part that opens its UFS through [`Cluster::factory`] (master, workers, sidecars).
    pub fn range_reads(&self) -> &RangeReads {
        &self.range_reads
    }

    /// Worker `i`'s NVMe disk, when the cluster was started with `nvme_disk`.
    pub fn nvme_disk(&self, i: usize) -> &Path {
        self.nvme_disks[i].path()
    }

    pub fn worker(&self, i: usize) -> &WorkerHandle {
        self.workers[i].as_ref().expect("worker is running")
    }

    pub fn worker_count(&self) -> usize {
        self.workers.len()
    }

    pub fn nvme_dir(&self, i: usize) -> PathBuf {
        self.worker_configs[i].nvme_dir()
    }

    /// Waits until every running worker has written its queued NVMe blocks.
    pub async fn flush(&self) {
        for w in self.workers.iter().flatten() {
            w.blocks.flush().await;
        }
    }

    /// Drains worker `i` (`strata worker --drain` on SIGTERM): it leaves the ring, hands its
    /// blocks off within `timeout`, and stops. Returns what the drain did.
    pub async fn drain_worker(&mut self, i: usize, timeout: Duration) -> strata_worker::handoff::DrainReport {
        let w = self.workers[i].take().expect("worker running");
        let report = w.drain(timeout).await;
        w.shutdown().await;
        report
    }

    /// Stops worker `i` cleanly without draining (`strata worker` on SIGTERM).
    pub async fn stop_worker(&mut self, i: usize) {
        if let Some(w) = self.workers[i].take() {
            w.shutdown().await;
        }
    }

    pub async fn kill_worker(&mut self, i: usize) {
        if let Some(w) = self.workers[i].take() {
            w.kill().await;
        }
    }

    /// Stops worker `i` cleanly and starts it again (same id, NVMe tier and, port 0, a new data
    /// port); returns once the master lists it at its new address, so a client's next view has it.
    pub async fn restart_worker(&mut self, i: usize) {
        if let Some(w) = self.workers[i].take() {
            w.shutdown().await;
        }
        let w = self.spawn_worker(i).await;
        let (id, port) = (w.worker_id.clone(), w.data_addr.port());
        self.workers[i] = Some(w);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(client) = Client::connect(self.client_config()).await
                && let Ok(status) = client.admin().status().await
                && status
                    .workers
                    .iter()
                    .any(|w| w.id == id && w.live && w.data_addr.ends_with(&format!(":{port}")))
            {
                return;
            }
            assert!(Instant::now() < deadline, "timed out waiting for worker {id} to register again");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn stop_master(&mut self) {
        if let Some(m) = self.master.take() {
            m.shutdown().await;
        }
    }

    pub async fn start_master(&mut self) {
        // The old listener's port can take a moment to be free again.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match Master::start(self.master_config.clone(), self.factory.clone()).await {
                Ok(m) => {
                    self.master = Some(m);
                    return;
                }
                Err(e) if Instant::now() < deadline => {
                    eprintln!("master restart retry: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("master restart failed: {e}"),
            }
        }
    }

    /// Polls the master until exactly `n` workers are live.
    pub async fn wait_for_live_workers(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(client) = Client::connect(self.client_config()).await
                && let Ok(status) = client.admin().status().await
                && status.workers.iter().filter(|w| w.live).count() == n
            {
                return;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {n} live workers");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Token files shared by the tests of one process that start `strata` processes themselves:
/// made once, handed to every master as its bootstrap tokens (as a Kubernetes Secret would be),
/// to workers (`worker.token`) and to client commands (`admin.token`).
pub fn shared_token_file(name: &str) -> PathBuf {
    static DIR: std::sync::OnceLock<TempDir> = std::sync::OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        for name in [strata_security::token::ADMIN_TOKEN_FILE, strata_security::token::WORKER_TOKEN_FILE] {
            strata_security::token::read_or_create_token_file(&dir.path().join(name)).expect("token file");
        }
        dir
    });
    dir.path().join(name)
}

fn read_token(path: &Path) -> String {
    strata_security::token::read_token_file(path).expect("the master wrote its token file")
}

/// Polls `check` until it holds, failing the test with `what` after `within`: how a test waits
/// for something another task does (a heartbeat, a TTL, a release) without a fixed sleep.
pub async fn eventually<F, Fut>(what: &str, within: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out after {within:?} waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Deterministic pseudo-random bytes, so failures reproduce.
/// The data-plane request reading all of `info`, a file of one block, as its first block.
pub fn first_block_read(info: &strata_client::FileInfo) -> strata_common::frame::ReadBlockRequest {
    strata_common::frame::ReadBlockRequest {
        req_id: 0,
        path: info.path.clone(),
        version: info.version.clone(),
        file_size: info.size,
        block_size: info.block_size,
        block_index: 0,
        offset: 0,
        len: info.size,
    }
}

pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut out = vec![0u8; len];
    fill_pattern(seed, 0, &mut out);
    out
}

/// The bytes of [`pattern`] at any offset, so a stream of any size can be produced and checked
/// piece by piece without holding it.
pub fn fill_pattern(seed: u64, offset: u64, buf: &mut [u8]) {
    fn word(seed: u64, index: u64) -> [u8; 8] {
        // splitmix64
        let mut z = (seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)).to_le_bytes()
    }
    let mut pos = 0usize;
    while pos < buf.len() {
        let abs = offset + pos as u64;
        let w = word(seed, abs / 8);
        let start = (abs % 8) as usize;
        let n = (8 - start).min(buf.len() - pos);
        buf[pos..pos + n].copy_from_slice(&w[start..start + n]);
        pos += n;
    }
}

/// Peak resident memory of this process so far (VmHWM), in bytes.
pub fn peak_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}
