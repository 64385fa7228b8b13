//! What a client is configured with. [`ClientConfig::new`] (and `Default`) read nothing: a
//! configuration is what the caller wrote, so a test or a library embedding the SDK is not
//! changed by the environment it happens to run in. [`ClientConfig::from_env`] is the one place
//! that reads the `STRATA_*` variables the command line tools and Python honour.

use std::path::PathBuf;
use std::time::Duration;

use strata_common::SharedClock;
use strata_common::qos::{QOS_ENV, QosClass};
use strata_security::tls::TlsConfig;

use crate::health::HedgePolicy;
use crate::rdma::RdmaMode;
use crate::{ClientError, Result, lineage, outage, shortcircuit};

/// Environment variable naming the sidecar's Unix socket (read by [`ClientConfig::from_env`]).
pub const SIDECAR_SOCKET_ENV: &str = "STRATA_SIDECAR_SOCKET";
/// Environment variable listing workers' data addresses (`host:port,host:port`) a client asks
/// for the cluster's view when the master is unreachable at start (read by
/// [`ClientConfig::from_env`]).
pub const WORKERS_ENV: &str = "STRATA_WORKERS";

#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// The master's `host:port`, or the masters of an HA cluster as a comma-separated list
    /// (calls follow the leader).
    pub master_addr: String,
    /// How long a fetched membership and mount table are used before asking again.
    pub membership_refresh: Duration,
    /// Most blocks a sequential streaming reader fetches ahead (the window grows to it). Default 8.
    pub readahead_blocks: usize,
    /// Blocks of one `read_range` fetched concurrently.
    pub parallelism: usize,
    pub connect_timeout: Duration,
    /// Deadline of one block request to one worker.
    pub request_timeout: Duration,
    /// When a block read unanswered by one worker is sent to the next owner as well (the first
    /// answer is taken): after the worker's recent latency, between `hedge.min` and
    /// `hedge.max`. Default 100 ms to 700 ms, so a frozen worker never holds a read for a
    /// second; `max` zero turns it off.
    pub hedge: HedgePolicy,
    /// Largest `read_range` answered in one buffer; larger reads should stream.
    pub max_read_len: u64,
    /// Unix socket of the pod's sidecar worker: blocks are asked of it first, and of the
    /// cluster when it cannot serve. Default none ([`from_env`](Self::from_env):
    /// `STRATA_SIDECAR_SOCKET` when set and non-empty).
    pub sidecar_socket: Option<PathBuf>,
    /// Read blocks by mapping a file descriptor the worker passes (short-circuit) instead of
    /// copying them through a socket: the sidecar's blocks, and the blocks of any worker on
    /// this host that serves a Unix socket (`strata worker --socket`; found in the membership
    /// and checked by its id, no configuration). Default true ([`from_env`](Self::from_env):
    /// false when `STRATA_SHORT_CIRCUIT` is `0`/`false`/`off`/`no`).
    pub short_circuit: bool,
    /// Bytes of whole-block short-circuit mappings kept for the next read of the same block,
    /// each for half its lease. A read of a kept block costs no round trip. The mappings are
    /// of the sidecar's page cache and shared memory (address space, not new memory), but they
    /// keep blocks the sidecar evicted alive until they go. 0 maps exactly each read's range
    /// and gives its lease back when its bytes are dropped. Default 1073741824 (1 GiB).
    pub short_circuit_cache_bytes: u64,
    /// Read workers through RDMA grants ([`RdmaTransport`]) instead of plain TCP. Default
    /// [`RdmaMode::Off`]; any RDMA failure falls back to TCP for that read.
    pub rdma: RdmaMode,
    /// How long, from the start of a master outage, the client serves the metadata it has
    /// (stats past their TTL, listings it saw whole) and stats workers make at the UFS; after
    /// it metadata calls fail, saying since when the master is unreachable. Default 5 minutes
    /// ([`from_env`](Self::from_env): `STRATA_MASTER_OUTAGE_GRACE`, `5m`, `90s`; `0` serves
    /// nothing stale).
    pub master_outage_grace: Duration,
    /// Workers' data addresses (`host:port`) asked for their view of membership and mounts
    /// when the master is unreachable at start, after the sidecar. Default none
    /// ([`from_env`](Self::from_env): `STRATA_WORKERS`, comma-separated).
    pub workers: Vec<String>,
    /// Most entries of listings kept (whole listings, least recently used dropped first) to
    /// answer `list`/`find` while the master is unreachable; 0 keeps none. Default 100000
    /// (about 20 MB). Listed files also become cached stats (so files just listed are read
    /// without asking the master) while the stat cache holds fewer than this many.
    pub listing_cache_entries: usize,
    /// Decides metadata TTLs, the membership refresh and how long short-circuit mappings are
    /// kept. Default the machine's clock; tests inject a `ManualClock` instead of sleeping.
    pub clock: SharedClock,
    /// TLS to the master and the workers' TCP data plane (a sidecar's Unix socket stays
    /// plain): on when `tls.ca` is set; `cert` + `key` are presented to servers that require
    /// client certificates; `server_name` is checked in every server's certificate instead of
    /// the host dialled. Default plain TCP ([`from_env`](Self::from_env): `STRATA_TLS_CA`,
    /// `STRATA_TLS_CERT`, `STRATA_TLS_KEY`, `STRATA_TLS_SERVER_NAME`, see
    /// [`TlsConfig::from_env`]).
    pub tls: TlsConfig,
    /// The node (host, Kubernetes node name) this client runs on: among a block's read
    /// replicas (the mount's `read_replicas`) one on the same node is asked first. Default
    /// none ([`from_env`](Self::from_env): `STRATA_NODE` when set and not blank; in Kubernetes,
    /// from `spec.nodeName`).
    pub node: Option<String>,
    /// The token presented to the master (every call) and to workers (every new connection);
    /// `None` for a cluster with authentication off. Default none
    /// ([`from_env`](Self::from_env): `STRATA_TOKEN`, else the file `STRATA_TOKEN_FILE` names,
    /// else the admin token of a standalone started in the current directory when it exists,
    /// see `strata_security::token::client_token_from_env`). Never printed (`Debug` shows
    /// whether one is set).
    pub token: Option<Token>,
    /// The job this client reads for: its reads are recorded under it (docs/LINEAGE.md);
    /// `None` records them as `anonymous`. Default none ([`from_env`](Self::from_env):
    /// `STRATA_JOB` when set and not blank).
    pub job: Option<String>,
    /// Record which file versions this client reads and report them to the master (see
    /// `job`). Default true ([`from_env`](Self::from_env): false when `STRATA_LINEAGE` is
    /// `0`/`false`/`off`/`no`).
    pub lineage: bool,
    /// How often recorded reads are sent to the master; a process killed without flushing
    /// loses at most this much of its record. Default 2 s ([`from_env`](Self::from_env):
    /// `STRATA_LINEAGE_FLUSH`, `2s`, `500ms`).
    pub lineage_flush_interval: Duration,
    /// The request class of this client's reads on a busy worker (docs/QOS.md): `Latency`
    /// (inference, RAG, weight loading) is served first, `Background` last. Default
    /// `Throughput` ([`from_env`](Self::from_env): `STRATA_QOS`, `latency`, `throughput`,
    /// `background`; a value that names no class is an error).
    pub qos: QosClass,
    /// What [`from_env`](Self::from_env) could not use, reported by [`Client::connect`]: a
    /// `STRATA_QOS` naming no class; a `STRATA_TOKEN_FILE` that cannot be read (only when no
    /// token was set after all).
    pub(crate) env_errors: EnvErrors,
}

/// See [`ClientConfig::env_errors`].
#[derive(Debug, Clone, Default)]
pub(crate) struct EnvErrors {
    pub(crate) qos: Option<String>,
    pub(crate) token_file: Option<String>,
}

impl ClientConfig {
    /// Fails as `Client::connect` must for what the environment got wrong.
    pub(crate) fn check_env(&self) -> Result<()> {
        if let Some(e) = &self.env_errors.qos {
            return Err(ClientError::InvalidArgument(e.clone()));
        }
        match (&self.token, &self.env_errors.token_file) {
            // Say why a token file named in the environment was not used, rather than let the
            // cluster answer "no token".
            (None, Some(e)) => Err(ClientError::InvalidArgument(e.clone())),
            _ => Ok(()),
        }
    }
}

/// A token, kept out of `Debug` output and logs.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(pub String);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(***)")
    }
}

/// The defaults, for the master at [`strata_common::DEFAULT_MASTER_ADDR`] (this host).
impl Default for ClientConfig {
    fn default() -> Self {
        Self::new(strata_common::DEFAULT_MASTER_ADDR)
    }
}

impl ClientConfig {
    /// The defaults, for the master(s) at `master_addr`; nothing is read from the environment.
    pub fn new(master_addr: impl Into<String>) -> Self {
        Self {
            master_addr: master_addr.into(),
            membership_refresh: Duration::from_secs(2),
            readahead_blocks: 8,
            parallelism: 16,
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(60),
            hedge: HedgePolicy::default(),
            max_read_len: 4 << 30,
            sidecar_socket: None,
            short_circuit: true,
            short_circuit_cache_bytes: 1 << 30,
            rdma: RdmaMode::Off,
            master_outage_grace: outage::DEFAULT_OUTAGE_GRACE,
            workers: Vec::new(),
            listing_cache_entries: 100_000,
            clock: strata_common::clock::system(),
            node: None,
            token: None,
            tls: TlsConfig::default(),
            job: None,
            lineage: true,
            lineage_flush_interval: lineage::DEFAULT_FLUSH_INTERVAL,
            qos: QosClass::default(),
            env_errors: EnvErrors::default(),
        }
    }

    /// [`new`](Self::new) with what the `STRATA_*` environment variables set (each field's
    /// documentation names its variable): what the CLI and Python use. A token file named by
    /// `STRATA_TOKEN_FILE` that cannot be read (and no token set after all), or a `STRATA_QOS`
    /// that names no class, fails [`Client::connect`](crate::Client::connect) with the reason.
    pub fn from_env(master_addr: impl Into<String>) -> Self {
        let mut env_errors = EnvErrors::default();
        let token = match strata_security::token::client_token_from_env() {
            Ok(token) => token.map(Token),
            Err(e) => {
                env_errors.token_file = Some(e.to_string());
                None
            }
        };
        let qos = match QosClass::from_env() {
            Ok(qos) => qos.unwrap_or_default(),
            Err(e) => {
                env_errors.qos = Some(format!("{QOS_ENV}: {e}"));
                QosClass::default()
            }
        };
        Self {
            sidecar_socket: std::env::var_os(SIDECAR_SOCKET_ENV).filter(|v| !v.is_empty()).map(PathBuf::from),
            short_circuit: shortcircuit::enabled_by_env(),
            master_outage_grace: outage::grace_from_env(),
            workers: std::env::var(WORKERS_ENV)
                .map(|v| v.split(',').map(str::trim).filter(|a| !a.is_empty()).map(String::from).collect())
                .unwrap_or_default(),
            node: strata_common::node_from_env(),
            token,
            tls: TlsConfig::from_env(),
            job: lineage::job_from_env(),
            lineage: lineage::enabled_by_env(),
            lineage_flush_interval: lineage::flush_interval_from_env(),
            qos,
            env_errors,
            ..Self::new(master_addr)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_reads_nothing_from_the_environment() {
        // SAFETY: this test process's environment, set before anything reads it here; the
        // variables are ones no other test of this crate sets.
        unsafe {
            std::env::set_var(SIDECAR_SOCKET_ENV, "/tmp/sidecar.sock");
            std::env::set_var("STRATA_TOKEN", "strata_from_env");
        }
        let plain = ClientConfig::new("m:1");
        assert!(plain.sidecar_socket.is_none() && plain.token.is_none());
        let from_env = ClientConfig::from_env("m:1");
        assert_eq!(from_env.sidecar_socket, Some(PathBuf::from("/tmp/sidecar.sock")));
        assert_eq!(from_env.token, Some(Token("strata_from_env".into())));
        // SAFETY: as above.
        unsafe {
            std::env::remove_var(SIDECAR_SOCKET_ENV);
            std::env::remove_var("STRATA_TOKEN");
        }
    }
}
