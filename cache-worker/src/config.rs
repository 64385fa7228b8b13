//! The worker's configuration: a TOML file, every field optional (defaults below), overridable
//! by command-line flags and `STRATA_*` environment variables in the CLI.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use strata_security::tls::TlsConfig;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerConfig {
    /// The master's gRPC address (`host:port`). Default `127.0.0.1:19998` (`strata_common::DEFAULT_MASTER_ADDR`).
    pub master_addr: String,
    /// Data-plane (framed TCP) listen address. Default `127.0.0.1:29998`; port 0 picks one.
    pub data_addr: SocketAddr,
    /// HTTP address serving `/metrics` and `/health`. Default `127.0.0.1:29999`.
    pub http_addr: SocketAddr,
    /// Host name or IP clients use to reach the data plane. Default: the data address's IP
    /// (`127.0.0.1` when it listens on all addresses).
    pub advertise_host: Option<String>,
    /// The node (host, Kubernetes node name) this worker runs on, reported to the master so
    /// clients on the same node prefer it among a block's read replicas (`--node`). Default:
    /// `STRATA_NODE` when the CLI starts the worker (in Kubernetes, from `spec.nodeName`),
    /// else none.
    pub node: Option<String>,
    /// Stable worker id. Default: generated once and kept in `<data_dir>/worker-id`, so a
    /// restarted worker keeps its place on the ring and its NVMe blocks.
    pub worker_id: Option<String>,
    /// Directory for the worker id and, unless `nvme_dir` is set, the NVMe tier.
    /// Default `.strata/worker`.
    pub data_dir: PathBuf,
    /// DRAM tier capacity in bytes; 0 disables the tier. Default 536870912 (512 MiB).
    pub memory_capacity: u64,
    /// NVMe tier directory. Default `<data_dir>/nvme`.
    pub nvme_dir: Option<PathBuf>,
    /// NVMe tier capacity in bytes; 0 disables the tier. Default 10737418240 (10 GiB).
    pub nvme_capacity: u64,
    /// Directory of the write-back journals (files written to `mode=write-back` mounts, held
    /// until uploaded; fsynced before a write is acknowledged). Default `<nvme_dir>/journal`.
    pub journal_dir: Option<PathBuf>,
    /// Deadline of one UFS range read, in milliseconds. Default 30000.
    pub ufs_timeout_ms: u64,
    /// Bytes of blocks waiting to be written to NVMe; a miss waits when the budget is spent
    /// (backpressure instead of dropping writes). Default 268435456 (256 MiB).
    pub nvme_write_budget: u64,
    /// Sidecar mode (`strata worker --sidecar`): serve the data plane on `socket_path` to the
    /// processes of this pod only, never join the cluster's ring, and fetch misses from the
    /// cluster's workers before the UFS. Default false.
    pub sidecar: bool,
    /// Unix socket (`--socket`): the only data plane of a sidecar (required in sidecar mode);
    /// for a cluster worker, a second data plane beside TCP for processes on its host. The
    /// worker advertises it in the membership, so clients on the host find it themselves and
    /// read its blocks by mapping the descriptors it passes (short-circuit). Default: none.
    pub socket_path: Option<PathBuf>,
    /// File holding the token (role `worker`) this worker presents to the master and to other
    /// workers (`--token-file`; `STRATA_TOKEN` gives it directly). Without one, the master must
    /// run with authentication off.
    pub token_file: Option<PathBuf>,
    /// The token itself, given by the environment or by a process that starts a worker in
    /// itself (`strata standalone`); wins over `token_file`. Never written to a config file.
    #[serde(skip)]
    pub token: Option<String>,
    /// Answer `OpenBlock` on the Unix socket with a passed file descriptor the client maps
    /// (short-circuit reads, see docs/ARCHITECTURE.md); false refuses and clients read through
    /// the socket. Default true.
    pub short_circuit: bool,
    /// How long a short-circuit grant's lease lasts unless the client releases it, in
    /// milliseconds. Default 30000.
    pub short_circuit_lease_ms: u64,
    /// Bytes of shared-memory copies of DRAM blocks kept for short-circuit readers (on top of
    /// the DRAM tier). Default 268435456 (256 MiB).
    pub short_circuit_shm_bytes: u64,
    /// Blocks fetched for client reads stay in DRAM only until DRAM evicts them or client
    /// reads have been quiet this many milliseconds, then go to NVMe (write-back: a cold read
    /// does not compete with NVMe writes). 0 writes every fetched block to NVMe at once
    /// (write-through). Warmup loads always write through. Default 1000.
    pub nvme_writeback_idle_ms: u64,
    /// Serve NVMe blocks whose checksum was verified since start straight from their files
    /// (`sendfile`, passed descriptors) instead of reading and re-checking them on every read.
    /// Default true; false checks every NVMe read (see docs/ARCHITECTURE.md, "Zero copy").
    pub zero_copy: bool,
    /// Answer a client's cold block read as the block arrives from the UFS (cut-through)
    /// rather than once all of it is in: the read's first byte comes after the store's first
    /// byte of the range, not after the whole block. Only on stores that refuse other versions
    /// up front (`If-Match`). Default true (see docs/ARCHITECTURE.md, "Cut-through").
    pub cut_through: bool,
    /// RDMA grants on the TCP data plane (`[rdma]` table, see [`RdmaConfig`]). Default off.
    pub rdma: RdmaConfig,
    /// Data-plane connections open at once in this process (a worker's TCP connections, or a
    /// sidecar's Unix-socket connections: each process serves one of them); one more is
    /// answered with a `ResourceExhausted` error frame and closed. 0 means no limit.
    /// Default 16384: hundreds of client nodes of an HA cluster, each keeping a few dozen
    /// pooled connections to this worker, with room left under a 65536-descriptor limit.
    pub max_connections: usize,
    /// Data-plane TCP connections open at once from one peer IP address; one more is answered
    /// with a `ResourceExhausted` error frame and closed. 0 means no limit. Default 4096: a
    /// client process pools up to 64 idle connections per worker, and a training node may run
    /// dozens of such processes (8 GPUs × 8 loader processes × 64 = 4096) behind one address.
    pub max_connections_per_peer: usize,
    /// Once a peer has sent the first byte of a request frame, the whole frame (header and
    /// body, each `WriteData` of a write) must arrive within this many milliseconds; and a
    /// response must be taken by the peer within it once the socket pushes back. Otherwise the
    /// connection is closed. 0 means no limit. Default 60000: an 8 MiB `WriteData` body at
    /// 140 KB/s, far below any link a training job runs on.
    pub frame_timeout_ms: u64,
    /// A connection with no request started for this many milliseconds is closed (clients
    /// pool connections, so idle is normal, but an abandoned socket must go). 0 means no
    /// limit. Default 600000 (10 minutes).
    pub idle_timeout_ms: u64,
    /// Group of a sidecar's Unix socket (a name from /etc/group or a numeric gid): the socket
    /// is made `0660` and given to this group, so containers of the pod running as other uids
    /// but sharing the group (Kubernetes: the pod's `fsGroup` or a supplemental group) can
    /// connect. Default: none (the group the socket is created with: the sidecar's own, or
    /// the socket directory's when it is setgid, as a Kubernetes `fsGroup` volume is).
    pub socket_group: Option<String>,
    /// Uids besides the sidecar's own and root that may use its Unix socket, checked with
    /// `SO_PEERCRED` on every connection; any other uid is refused with a `PermissionDenied`
    /// error frame. Default empty: only the sidecar's own uid and root.
    pub socket_allowed_uids: Vec<u32>,
    /// TLS (`[tls]` table, see `strata_security::tls::TlsConfig`): `cert` + `key` make the TCP
    /// data plane speak TLS (the sidecar's Unix socket stays plain); `ca` makes the link to the
    /// master TLS, presenting `cert` when the master requires client certificates;
    /// `client_auth` requires clients of the data plane to present a certificate signed by
    /// `ca`. Default off.
    pub tls: TlsConfig,
    /// Per-tier watermarks (`[watermarks]` table, see [`Watermarks`]): a tier holding more
    /// than `high` percent of its capacity is evicted to `low` percent in the background.
    /// Default: NVMe 95 and 85, DRAM off (100).
    pub watermarks: Watermarks,
    /// How often the background upkeep (watermarks, mounts' `cache_ttl` and `quota`) runs, in
    /// milliseconds. Default 1000.
    pub upkeep_interval_ms: u64,
    /// Bytes per second this worker sends at most when it hands blocks off to their new
    /// owner after a ring change (background hand-off, see docs/CACHE_CONTROL.md); it also
    /// waits while client reads are in flight here. 0 turns background hand-off off (a
    /// drain still hands off, at the default rate). Default 104857600 (100 MiB/s).
    pub handoff_bandwidth: u64,
    /// Blocks named by one hand-off offer. Default 64.
    pub handoff_batch: usize,
    /// Blocks this worker has asked its peers to push and not received yet, at most; offers
    /// beyond are declined (and fetched on demand later). Default 256.
    pub handoff_queue: usize,
    /// Fetches of the prefetch lane (blocks clients hinted they will read next) in flight at
    /// once. Default 16.
    pub prefetch_parallelism: usize,
    /// Answers to clients sent at once before the rest wait their turn by request class
    /// (`STRATA_QOS`: latency first, then throughput, then background, with one turn in 8 for
    /// the lowest class waiting); latency answers may take half as many more. 0 turns the
    /// classes off. Default 8.
    pub qos_slots: usize,
    /// Client reads' UFS fetches in flight at once before the rest wait their turn by request
    /// class, as answers do; latency fetches may take half as many more. Loads (warmup,
    /// prefetch) take no place. 0 turns the gate off. Default 64.
    pub ufs_fetch_slots: usize,
    /// Serve latency-class connections on a runtime thread of their own (the latency lane),
    /// so a throughput flood on the shared runtime threads does not delay them. Default true.
    pub qos_latency_thread: bool,
    /// Scheduling priority (nice, -20..=19) of the latency lane's thread; below 0 needs
    /// `CAP_SYS_NICE`, without which the thread keeps the default. Default -10.
    pub qos_latency_nice: i32,
    /// Scheduling slice, in microseconds, the latency lane's thread asks the kernel for
    /// (100..=100000; 0 keeps the kernel's default). A waking thread with a shorter slice than
    /// the running one's takes the core at once on Linux 6.12 and later; a higher priority
    /// alone does not (docs/QOS.md). Needs no privilege. Default 100.
    pub qos_latency_slice_us: u32,
}

/// A tier's watermarks, in percent of its capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Watermark {
    /// Above this, upkeep evicts (1 to 100; 100 turns upkeep eviction off for the tier).
    pub high: u8,
    /// Down to this (at most `high`).
    pub low: u8,
}

impl Watermark {
    pub fn high_bytes(&self, capacity: u64) -> u64 {
        percent(capacity, self.high)
    }

    pub fn low_bytes(&self, capacity: u64) -> u64 {
        percent(capacity, self.low.min(self.high))
    }
}

fn percent(capacity: u64, pct: u8) -> u64 {
    (u128::from(capacity) * u128::from(pct.min(100)) / 100) as u64
}

impl Watermark {
    /// Never evicts ahead of puts.
    pub const OFF: Self = Self { high: 100, low: 100 };
}

/// `[watermarks]`: `memory = { high = 100, low = 100 }`, `nvme = { high = 95, low = 85 }`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Watermarks {
    /// Off by default: a DRAM put evicts in O(1) without I/O, so free DRAM kept in reserve
    /// would only be cache lost.
    pub memory: Watermark,
    /// 95 and 85 by default: room kept free on the disk absorbs bursts of writes without
    /// deleting files on the read path, and leaves slack for other users of the disk.
    pub nvme: Watermark,
}

impl Default for Watermarks {
    fn default() -> Self {
        Self { memory: Watermark::OFF, nvme: Watermark { high: 95, low: 85 } }
    }
}

impl Watermarks {
    /// Refuses marks outside 1–100 or a low above its high.
    pub fn check(&self) -> Result<(), String> {
        for (tier, m) in [("memory", self.memory), ("nvme", self.nvme)] {
            if !(1..=100).contains(&m.high) || m.low > m.high {
                return Err(format!(
                    "watermarks.{tier}: high = {} and low = {} must satisfy 0 <= low <= high <= 100, high >= 1",
                    m.high, m.low
                ));
            }
        }
        Ok(())
    }
}

/// How a worker answers `OpenBlock` on TCP (see docs/ARCHITECTURE.md, "RDMA").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RdmaMode {
    /// Grants are refused; clients that ask read over TCP instead.
    #[default]
    Off,
    /// Regions of ordinary worker memory, read by clients with `RemoteRead` frames over TCP:
    /// the RDMA protocol without a NIC (tests, and machines without RDMA).
    Emulated,
    /// Memory registered with the first RDMA device (ibverbs) and read by the client's NIC.
    /// Needs a build with the `rdma` feature; the worker does not start without a device.
    Verbs,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RdmaConfig {
    /// `off` (default), `emulated` or `verbs`.
    pub mode: RdmaMode,
    /// Bytes of granted (registered) memory held at once at most; a grant beyond it is refused
    /// and the client reads over TCP. Default 268435456 (256 MiB).
    pub memory: u64,
    /// Grants held at once at most. Default 1024.
    pub max_grants: usize,
    /// How long a grant lives unless the client releases it first, in milliseconds. Default 30000.
    pub grant_ttl_ms: u64,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        Self { mode: RdmaMode::Off, memory: 256 << 20, max_grants: 1024, grant_ttl_ms: 30_000 }
    }
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            master_addr: strata_common::DEFAULT_MASTER_ADDR.to_string(),
            data_addr: ([127, 0, 0, 1], 29998).into(),
            http_addr: ([127, 0, 0, 1], 29999).into(),
            advertise_host: None,
            node: None,
            worker_id: None,
            data_dir: PathBuf::from(".strata/worker"),
            memory_capacity: 512 << 20,
            nvme_dir: None,
            nvme_capacity: 10 << 30,
            journal_dir: None,
            ufs_timeout_ms: 30_000,
            nvme_write_budget: 256 << 20,
            sidecar: false,
            socket_path: None,
            token_file: None,
            token: None,
            short_circuit: true,
            short_circuit_lease_ms: 30_000,
            short_circuit_shm_bytes: 256 << 20,
            nvme_writeback_idle_ms: crate::cache::DEFAULT_WRITEBACK_IDLE.as_millis() as u64,
            zero_copy: true,
            cut_through: true,
            rdma: RdmaConfig::default(),
            max_connections: 16_384,
            max_connections_per_peer: 4096,
            frame_timeout_ms: 60_000,
            idle_timeout_ms: 600_000,
            socket_group: None,
            socket_allowed_uids: Vec::new(),
            tls: TlsConfig::default(),
            watermarks: Watermarks::default(),
            upkeep_interval_ms: 1000,
            handoff_bandwidth: crate::handoff::DEFAULT_HANDOFF_BANDWIDTH,
            handoff_batch: crate::handoff::DEFAULT_HANDOFF_BATCH,
            handoff_queue: crate::handoff::DEFAULT_HANDOFF_QUEUE,
            prefetch_parallelism: crate::prefetch::DEFAULT_PREFETCH_PARALLELISM,
            qos_slots: crate::classes::DEFAULT_QOS_SLOTS,
            ufs_fetch_slots: crate::classes::DEFAULT_UFS_FETCH_SLOTS,
            qos_latency_thread: true,
            qos_latency_nice: DEFAULT_QOS_LATENCY_NICE,
            qos_latency_slice_us: DEFAULT_QOS_LATENCY_SLICE_US,
        }
    }
}

/// The latency lane thread's nice: well ahead of the runtime threads at 0, short of the -20
/// an operator may keep for the host's own daemons.
pub const DEFAULT_QOS_LATENCY_NICE: i32 = -10;

/// The latency lane thread's slice: the shortest the kernel grants, so it preempts any thread
/// on a default slice when its request arrives. A lane answer takes tens of microseconds.
pub const DEFAULT_QOS_LATENCY_SLICE_US: u32 = 100;

impl WorkerConfig {
    /// Refuses a `qos_latency_nice` the kernel has no such priority for.
    pub fn check_qos(&self) -> Result<(), String> {
        if !(-20..=19).contains(&self.qos_latency_nice) {
            return Err(format!("qos_latency_nice = {}: must be between -20 and 19", self.qos_latency_nice));
        }
        let slice = self.qos_latency_slice_us;
        if slice != 0 && !(100..=100_000).contains(&slice) {
            return Err(format!(
                "qos_latency_slice_us = {slice}: must be 0 (the kernel's default) or between 100 and 100000"
            ));
        }
        Ok(())
    }

    /// What the latency lane's thread asks of the scheduler.
    pub fn qos_latency_priority(&self) -> strata_common::sched::ThreadPriority {
        strata_common::sched::ThreadPriority {
            nice: self.qos_latency_nice,
            slice: (self.qos_latency_slice_us != 0)
                .then(|| std::time::Duration::from_micros(self.qos_latency_slice_us.into())),
        }
    }

    /// The token this worker presents: `token`, else the one in `token_file`, else none.
    pub fn resolve_token(&self) -> Result<Option<String>, strata_security::token::TokenFileError> {
        match (&self.token, &self.token_file) {
            (Some(t), _) => Ok(Some(t.clone())),
            (None, Some(file)) => strata_security::token::read_token_file(file).map(Some),
            (None, None) => Ok(None),
        }
    }

    pub fn nvme_dir(&self) -> PathBuf {
        self.nvme_dir.clone().unwrap_or_else(|| self.data_dir.join("nvme"))
    }

    pub fn journal_dir(&self) -> PathBuf {
        self.journal_dir.clone().unwrap_or_else(|| self.nvme_dir().join("journal"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_toml_takes_defaults_and_unknown_fields_fail() {
        let c: WorkerConfig = toml::from_str("memory_capacity = 1024\nnvme_dir = \"/tmp/x\"").unwrap();
        assert_eq!(c.memory_capacity, 1024);
        assert_eq!(c.nvme_dir(), PathBuf::from("/tmp/x"));
        assert_eq!(c.nvme_capacity, WorkerConfig::default().nvme_capacity);
        assert!(toml::from_str::<WorkerConfig>("memory = 5").is_err());
        let c: WorkerConfig =
            toml::from_str("[tls]\ncert = \"/etc/strata/tls.crt\"\nkey = \"/k\"\nclient_auth = true")
                .unwrap();
        assert_eq!(c.tls.cert, Some(PathBuf::from("/etc/strata/tls.crt")));
        assert!(c.tls.client_auth && c.tls.ca.is_none());
        assert!(toml::from_str::<WorkerConfig>("[tls]\ncrt = \"/x\"").is_err());
        let c: WorkerConfig = toml::from_str("[watermarks]\nnvme = { high = 90, low = 70 }").unwrap();
        assert_eq!((c.watermarks.nvme.high, c.watermarks.nvme.low), (90, 70));
        assert_eq!(c.watermarks.memory, Watermark::OFF);
        assert_eq!(c.watermarks.nvme.low_bytes(1000), 700);
        assert!(c.watermarks.check().is_ok());
        assert!(c.check_qos().is_ok());
        let bad_nice = WorkerConfig { qos_latency_nice: -21, ..WorkerConfig::default() };
        assert!(bad_nice.check_qos().unwrap_err().contains("qos_latency_nice = -21"));
        let bad_slice = WorkerConfig { qos_latency_slice_us: 50, ..WorkerConfig::default() };
        assert!(bad_slice.check_qos().unwrap_err().contains("qos_latency_slice_us = 50"));
        let no_slice = WorkerConfig { qos_latency_slice_us: 0, ..WorkerConfig::default() };
        assert_eq!(no_slice.check_qos(), Ok(()));
        assert_eq!(no_slice.qos_latency_priority().slice, None);
        let bad = Watermarks { memory: Watermark { high: 80, low: 90 }, ..Watermarks::default() };
        assert!(bad.check().unwrap_err().contains("watermarks.memory"));
    }
}
