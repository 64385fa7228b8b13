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
    /// Deadline of one UFS range read, in milliseconds. Default 30000.
    pub ufs_timeout_ms: u64,
    /// Bytes of blocks waiting to be written to NVMe; a miss waits when the budget is spent
    /// (backpressure instead of dropping writes). Default 268435456 (256 MiB).
    pub nvme_write_budget: u64,
    /// Sidecar mode (`strata worker --sidecar`): serve the data plane on `socket_path` to the
    /// processes of this pod only, never join the cluster's ring, and fetch misses from the
    /// cluster's workers before the UFS. Default false.
    pub sidecar: bool,
    /// Unix socket a sidecar serves on (`--socket`); required in sidecar mode, unused otherwise.
    pub socket_path: Option<PathBuf>,
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
    /// RDMA grants on the TCP data plane (`[rdma]` table, see [`RdmaConfig`]). Default off.
    pub rdma: RdmaConfig,
    /// TLS (`[tls]` table, see `strata_security::tls::TlsConfig`): `cert` + `key` make the TCP
    /// data plane speak TLS (the sidecar's Unix socket stays plain); `ca` makes the link to the
    /// master TLS, presenting `cert` when the master requires client certificates;
    /// `client_auth` requires clients of the data plane to present a certificate signed by
    /// `ca`. Default off.
    pub tls: TlsConfig,
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
            worker_id: None,
            data_dir: PathBuf::from(".strata/worker"),
            memory_capacity: 512 << 20,
            nvme_dir: None,
            nvme_capacity: 10 << 30,
            ufs_timeout_ms: 30_000,
            nvme_write_budget: 256 << 20,
            sidecar: false,
            socket_path: None,
            short_circuit: true,
            short_circuit_lease_ms: 30_000,
            short_circuit_shm_bytes: 256 << 20,
            nvme_writeback_idle_ms: crate::cache::DEFAULT_WRITEBACK_IDLE.as_millis() as u64,
            zero_copy: true,
            rdma: RdmaConfig::default(),
            tls: TlsConfig::default(),
        }
    }
}

impl WorkerConfig {
    pub fn nvme_dir(&self) -> PathBuf {
        self.nvme_dir.clone().unwrap_or_else(|| self.data_dir.join("nvme"))
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
    }
}
