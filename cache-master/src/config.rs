//! The master's configuration: a TOML file, every field optional (defaults below), overridable
//! by command-line flags and `STRATA_*` environment variables in the CLI.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use strata_security::tls::TlsConfig;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MasterConfig {
    /// gRPC address for clients and workers. Default `127.0.0.1:19998`.
    pub rpc_addr: SocketAddr,
    /// HTTP address serving `/metrics` and `/health`. Default `127.0.0.1:19999`.
    pub http_addr: SocketAddr,
    /// Directory of the durable store (`master.redb`). Default `.strata/master`.
    pub data_dir: PathBuf,
    /// A worker silent for this long (milliseconds) is declared lost and leaves the ring.
    /// Default 10000.
    pub worker_timeout_ms: u64,
    /// How often workers heartbeat (milliseconds); told to each worker when it registers.
    /// Default 1000.
    pub heartbeat_interval_ms: u64,
    /// How long workers keep the journal of a write-back file after its upload, in
    /// milliseconds, so that readers that learnt its pending version (a client caches a stat
    /// for the mount's `metadata_ttl`) go on reading it from the journals. Default 60000.
    pub writeback_journal_grace_ms: u64,
    /// Entries kept in the metadata (stat and listing) cache. Default 100000.
    pub metadata_cache_entries: u64,
    /// Finished load jobs kept for `strata job ls|status|history`; older ones are forgotten
    /// (running jobs always stay). Default 1000.
    pub job_history: usize,
    /// Where mounts, jobs, schedules and worker membership are kept. Empty (the default): an
    /// embedded redb file in `data_dir`, for a single master. `etcd://HOST:PORT[,HOST:PORT...]`:
    /// an etcd cluster shared by several masters, of which one leads (elected with an etcd
    /// lease) and the others stand by.
    pub meta: String,
    /// The `host:port` clients and workers reach this master's gRPC endpoint at, told to them by
    /// standbys (`strata-leader`) and shown by `strata status`. Default: `rpc_addr` as bound.
    pub advertise_addr: Option<String>,
    /// With etcd: the leader's lease TTL (milliseconds). A leader that cannot renew it for half
    /// this time steps down; a standby takes over at most about this long after the leader
    /// died. Default 5000 (etcd's minimum is about 1500).
    pub leader_lease_ms: u64,
    /// With etcd: how long a starting master keeps trying to reach etcd (milliseconds) before
    /// it exits with the error. Default 0: one attempt, a clear error at once. Deployments that
    /// start masters and etcd together (the Helm chart) set it so the masters wait for etcd.
    pub meta_connect_timeout_ms: u64,
    /// Require a token on every call (and workers on every data-plane connection). Default
    /// true; false lets anyone who reaches the ports do anything (a laptop, a test).
    pub auth: bool,
    /// File holding the admin token: read at start when it exists (a Kubernetes Secret, or the
    /// token an earlier start wrote), else created with a new token (mode 0600). Default
    /// `<data_dir>/admin.token` (`strata standalone`: `<state dir>/admin.token`).
    pub admin_token_file: Option<PathBuf>,
    /// File holding the token workers present, read or created like `admin_token_file`.
    /// Default `<data_dir>/worker.token`.
    pub worker_token_file: Option<PathBuf>,
    /// TLS on the gRPC endpoint (`[tls]` table, see `strata_security::tls::TlsConfig`): `cert`
    /// and `key` make it speak TLS; `client_auth` (with `ca`) requires every client and worker
    /// to present a certificate signed by `ca`. Default off.
    pub tls: TlsConfig,
    /// Days lineage (which jobs read which file versions) is kept after its last read; 0
    /// keeps it forever. Default 30.
    pub lineage_retention_days: u64,
    /// Most lineage records kept (one job's reads of one file version after one mark, about
    /// 300 bytes of memory each); beyond it the least recently read are forgotten first, and
    /// counted. Default 1000000.
    pub lineage_max_records: usize,
}

impl MasterConfig {
    pub fn lineage_settings(&self) -> crate::lineage::LineageSettings {
        crate::lineage::LineageSettings {
            retention: std::time::Duration::from_secs(self.lineage_retention_days.saturating_mul(86_400)),
            max_records: self.lineage_max_records,
        }
    }

    /// The admin and worker token files, defaults filled in.
    pub fn token_files(&self) -> crate::auth::Bootstrap {
        crate::auth::Bootstrap {
            admin_file: self
                .admin_token_file
                .clone()
                .unwrap_or_else(|| self.data_dir.join(strata_security::token::ADMIN_TOKEN_FILE)),
            worker_file: self
                .worker_token_file
                .clone()
                .unwrap_or_else(|| self.data_dir.join(strata_security::token::WORKER_TOKEN_FILE)),
        }
    }
}

impl Default for MasterConfig {
    fn default() -> Self {
        Self {
            rpc_addr: ([127, 0, 0, 1], strata_common::DEFAULT_MASTER_PORT).into(),
            http_addr: ([127, 0, 0, 1], 19999).into(),
            data_dir: PathBuf::from(".strata/master"),
            worker_timeout_ms: 10_000,
            heartbeat_interval_ms: 1_000,
            writeback_journal_grace_ms: 60_000,
            metadata_cache_entries: 100_000,
            job_history: 1000,
            meta: String::new(),
            advertise_addr: None,
            leader_lease_ms: 5_000,
            meta_connect_timeout_ms: 0,
            auth: true,
            admin_token_file: None,
            worker_token_file: None,
            tls: TlsConfig::default(),
            lineage_retention_days: 30,
            lineage_max_records: 1_000_000,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_toml_takes_defaults_and_unknown_fields_fail() {
        let c: MasterConfig = toml::from_str("worker_timeout_ms = 500").unwrap();
        assert_eq!(c.worker_timeout_ms, 500);
        assert_eq!(c.rpc_addr, MasterConfig::default().rpc_addr);
        let err = toml::from_str::<MasterConfig>("worker_timeout = 5").unwrap_err();
        assert!(err.to_string().contains("unknown field"), "{err}");
    }
}
