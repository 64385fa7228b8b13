//! The worker's configuration: a TOML file, every field optional (defaults below), overridable
//! by command-line flags and `STRATA_*` environment variables in the CLI.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerConfig {
    /// The master's gRPC address (`host:port`). Default `127.0.0.1:19998`.
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
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            master_addr: "127.0.0.1:19998".to_string(),
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
    }
}
