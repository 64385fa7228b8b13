//! `strata`: the command line of Strata. Thin: argument parsing, config loading, and output
//! formatting over the master, worker and client crates.

/// `println!` that returns the write error instead of panicking, so a reader that goes away
/// (`strata job history | head`) ends the command quietly (see `main`) rather than with a panic.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*)
    }};
}

/// `outln!` without the newline.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        write!(std::io::stdout().lock(), $($arg)*)
    }};
}

mod commands;
mod lineage;
mod openlineage;
mod warmup;

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// Strata: a distributed cache in front of the storage you already have (S3, HDFS, a local
/// directory) that feeds training and inference at DRAM/NVMe speed.
#[derive(Parser)]
#[command(name = "strata", version, about, long_about = None)]
struct Cli {
    /// The master's gRPC address (host:port), or the masters of an HA cluster as a
    /// comma-separated list (host:port,host:port,...): calls follow the leader.
    #[arg(long, global = true, env = "STRATA_MASTER", default_value = strata_common::DEFAULT_MASTER_ADDR)]
    master: String,
    /// File holding the token to present (see docs/SECURITY.md). Default: STRATA_TOKEN, else
    /// the file STRATA_TOKEN_FILE names, else the admin token of a standalone started in this
    /// directory (its state dir, or STRATA_DIR). `strata worker` presents it to the master and peers.
    #[arg(long, global = true, value_name = "FILE")]
    token_file: Option<PathBuf>,
    /// The job this command reads for: its reads are recorded under it (see docs/LINEAGE.md),
    /// and `strata lineage mark` marks it. Unset: reads are recorded as `anonymous`.
    #[arg(long, global = true, env = "STRATA_JOB", value_name = "NAME")]
    job: Option<String>,
    /// The request class of this command's reads on a busy worker (see docs/QOS.md): latency
    /// (served first), throughput (the default) or background (served last).
    #[arg(long, global = true, env = "STRATA_QOS", value_name = "CLASS")]
    qos: Option<String>,
    #[command(flatten)]
    tls: TlsArgs,
    #[command(subcommand)]
    command: Command,
}

/// TLS (see docs/SECURITY.md). The same files name what this process trusts and presents:
/// clients (and a worker's link to its master) speak TLS when --tls-ca is set; `master` and
/// `worker` serve TLS with --tls-cert and --tls-key (flags override the config file's [tls]).
#[derive(Args)]
struct TlsArgs {
    /// PEM CA bundle trusted for servers (and, with --tls-client-auth, for clients). Set: TLS on.
    #[arg(long = "tls-ca", global = true, env = "STRATA_TLS_CA", value_name = "PEM")]
    ca: Option<PathBuf>,
    /// PEM certificate presented: a master's or worker's server certificate, a client's for mTLS.
    #[arg(long = "tls-cert", global = true, env = "STRATA_TLS_CERT", value_name = "PEM")]
    cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long = "tls-key", global = true, env = "STRATA_TLS_KEY", value_name = "PEM")]
    key: Option<PathBuf>,
    /// Name checked in server certificates instead of the host dialled.
    #[arg(long = "tls-server-name", global = true, env = "STRATA_TLS_SERVER_NAME", value_name = "NAME")]
    server_name: Option<String>,
    /// `master`/`worker`: require clients to present a certificate signed by --tls-ca (mTLS).
    #[arg(long = "tls-client-auth", global = true, env = "STRATA_TLS_CLIENT_AUTH")]
    client_auth: bool,
}

impl TlsArgs {
    /// `tls` (from a config file, or the default) with the flags given on top.
    fn apply(&self, mut tls: strata_client::TlsConfig) -> strata_client::TlsConfig {
        if let Some(p) = &self.ca {
            tls.ca = Some(p.clone());
        }
        if let Some(p) = &self.cert {
            tls.cert = Some(p.clone());
        }
        if let Some(p) = &self.key {
            tls.key = Some(p.clone());
        }
        if let Some(n) = &self.server_name {
            tls.server_name = Some(n.clone());
        }
        tls.client_auth |= self.client_auth;
        tls
    }
}

#[derive(Subcommand)]
enum Command {
    /// Run a master and one worker in this process on embedded defaults (data under --dir),
    /// with a local directory mounted so you can read through the cache at once.
    Standalone(StandaloneArgs),
    /// Run a master.
    Master(MasterArgs),
    /// Run a worker; with --sidecar, a pod-local worker serving its pod over a Unix socket.
    Worker(WorkerArgs),
    /// Add, remove or list mounts (Strata path → UFS URI).
    #[command(subcommand)]
    Mount(MountCommand),
    /// List a directory.
    Ls {
        path: String,
        /// Print JSON (one array of entries).
        #[arg(long)]
        json: bool,
    },
    /// Show a file's or directory's metadata.
    Stat {
        path: String,
        /// Ask the UFS now instead of trusting cached metadata.
        #[arg(long)]
        sync: bool,
        #[arg(long)]
        json: bool,
    },
    /// Write a file's bytes to standard output.
    Cat { path: String },
    /// Copy a file out of Strata into a local file.
    Cp {
        path: String,
        /// Local destination file.
        dest: PathBuf,
    },
    /// Copy a local file (or `-`, standard input) into Strata, on a write-through or
    /// write-back mount. On a write-back mount it returns once the mount's `write_replicas`
    /// workers hold the file durably; the upload to the UFS follows (see `strata sync`).
    Put {
        /// Local source file, or `-` for standard input.
        src: PathBuf,
        /// Strata path to write.
        path: String,
        /// Wait until the file is in the UFS (write-back mounts) before returning.
        #[arg(long)]
        wait: bool,
        /// With --wait: give up after this long (e.g. 30s, 10m). Default 1h.
        #[arg(long, default_value = "1h")]
        timeout: String,
    },
    /// Show which files written to write-back mounts at or under PATH are not in the UFS yet
    /// (pending, uploading, or failed with the reason), queuing failed uploads again. With
    /// --wait, block until all are persisted: exit 0 once they are, non-zero if an upload
    /// fails or --timeout passes.
    Sync {
        path: String,
        #[arg(long)]
        wait: bool,
        /// With --wait: give up after this long (e.g. 30s, 10m). Default 1h.
        #[arg(long, default_value = "1h")]
        timeout: String,
        #[arg(long)]
        json: bool,
    },
    /// Pin the cached blocks of the files under PATH: the tier's eviction passes over them on
    /// every worker. It loads nothing: blocks are cached as they are read or warmed up
    /// (`strata warmup PATH`); what a worker already holds of PATH, in either tier, is moved
    /// into the pinned tier. Durable on the master; refused when the pins of the tier would
    /// exceed its capacity across the live workers. Returns once every live worker has the pin
    /// in force, or after --wait, naming the workers that have not (they apply it at their next
    /// heartbeat). See docs/CACHE_CONTROL.md.
    Pin {
        path: String,
        /// memory (DRAM) or nvme.
        #[arg(long, default_value = "nvme")]
        tier: String,
        /// Unpin by itself after this long (e.g. 12h, 7d). Default: until `strata unpin`.
        #[arg(long)]
        ttl: Option<String>,
        /// How long to wait for every live worker to have the pin in force.
        #[arg(long, default_value = "10s")]
        wait: String,
    },
    /// Remove the pin of PATH (exactly the path pinned). Returns once every live worker has
    /// dropped it, or after --wait, as `pin` does.
    Unpin {
        path: String,
        /// How long to wait for every live worker to drop the pin.
        #[arg(long, default_value = "10s")]
        wait: String,
    },
    /// List pins: path, tier, bytes when pinned, expiry.
    Pins {
        #[arg(long)]
        json: bool,
    },
    /// Drop the cached blocks of the files under PATH from every worker now. No byte moves
    /// from the UFS until they are read again. Refused for a pinned path (unpin it first).
    Free {
        path: String,
        /// How long to wait for every live worker to drop them (e.g. 10s).
        #[arg(long, default_value = "10s")]
        wait: String,
    },
    /// Cache TTLs of paths: workers drop a block under the path that long after they stored
    /// it (a path's TTL wins over its mount's `-o cache_ttl`). See docs/CACHE_CONTROL.md.
    #[command(subcommand)]
    Ttl(TtlCommand),
    /// Show which workers (and the nodes they run on) hold the cached blocks of the files
    /// under PATH — a file, or a directory and everything below it — from the master's block
    /// map: blocks and bytes per worker, most first, and how much of PATH is cached at all.
    /// Use it to check that a warmup landed where a job will read, or that reads of a
    /// read_replicas mount are spread (see docs/CACHE_CONTROL.md).
    #[command(
        after_help = "Examples:\n  strata locate /datasets/imagenet/train\n  strata locate /models/llama/model.safetensors --json"
    )]
    Locate {
        path: String,
        /// Print JSON: {path, files, blocks, bytes, cached_blocks, cached_bytes, workers: [...]}.
        #[arg(long)]
        json: bool,
    },
    /// Show workers, tiers, blocks and cache hit/miss counters.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Load a file or directory into the cache (a load job on the master) and follow it with a
    /// progress bar; exits 0 only when the job SUCCEEDED.
    Warmup(warmup::WarmupArgs),
    /// Load jobs and their schedules: ls, status, cancel, history, schedule, unschedule.
    #[command(subcommand)]
    Job(warmup::JobCommand),
    /// Tokens and their roles (admin): create, ls, revoke. See docs/SECURITY.md.
    #[command(subcommand)]
    Token(TokenCommand),
    /// Which jobs read which file versions, grouped by the marks of each run: job, file, jobs,
    /// mark, export (OpenLineage). See docs/LINEAGE.md.
    #[command(subcommand)]
    Lineage(lineage::LineageCommand),
}

#[derive(Subcommand)]
enum TtlCommand {
    /// Set the cache TTL of the files at or under PATH (e.g. `strata ttl set /data/tmp 6h`).
    /// Returns once every live worker has it in force, or after --wait, as `pin` does.
    Set {
        path: String,
        /// How long a worker keeps a block after storing it: 30m, 12h, 7d.
        ttl: String,
        /// How long to wait for every live worker to have it in force.
        #[arg(long, default_value = "10s")]
        wait: String,
    },
    /// Clear PATH's own cache TTL (its mount's `cache_ttl`, if any, applies again).
    Clear {
        path: String,
        /// How long to wait for every live worker to have it in force.
        #[arg(long, default_value = "10s")]
        wait: String,
    },
    /// List paths with their own cache TTL.
    Ls {
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum TokenCommand {
    /// Create a token; prints a line describing it, then the token alone on the last line
    /// (shown once: the master keeps only its hash).
    Create {
        /// admin (mounts, jobs, schedules, tokens), writer (read, write/delete on write-enabled
        /// mounts), reader, or worker (for workers and sidecars: receives mount credentials).
        #[arg(long)]
        role: String,
        /// Limit a reader or writer token to this path and everything below it.
        #[arg(long, value_name = "/PATH")]
        prefix: Option<String>,
        /// A label shown by `token ls` (who or what uses the token).
        #[arg(long, default_value = "")]
        name: String,
    },
    /// List tokens: id, role, scope, name, creation time (never the tokens).
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Revoke a token by its id (from `token ls`): the master refuses it at once, workers
    /// within a heartbeat.
    Revoke { id: String },
}

#[derive(Args)]
struct StandaloneArgs {
    /// Directory for all state (master store, tokens, worker id, NVMe tier). Default: outside
    /// the current directory (which the standalone mounts), in
    /// ~/.local/state/strata/standalone/<dir name>-<hash> ($XDG_STATE_HOME when set), where a
    /// CLI run from the same directory finds the admin token. The cluster never serves its
    /// own state, wherever it is (see docs/SECURITY.md).
    #[arg(long, env = "STRATA_DIR")]
    dir: Option<PathBuf>,
    /// Mounts to create at start, as /PATH=URI (repeatable). Default: /local=file://<current dir>.
    #[arg(long = "mount", value_name = "/PATH=URI")]
    mounts: Vec<String>,
    /// Master gRPC listen address (defaults to --master).
    #[arg(long)]
    rpc_addr: Option<std::net::SocketAddr>,
    /// DRAM tier size, e.g. 512MiB.
    #[arg(long, default_value = "512MiB")]
    memory: String,
    /// NVMe tier size, e.g. 10GiB.
    #[arg(long, default_value = "10GiB")]
    nvme: String,
    /// Accept every caller without a token (a machine nobody else can reach). By default the
    /// standalone writes an admin token to <dir>/admin.token (mode 0600), which the CLI run
    /// from the same directory finds.
    #[arg(long)]
    no_auth: bool,
    /// Read the admin token from this file instead (e.g. a Kubernetes Secret); created with a
    /// new token when it does not exist. Default <dir>/admin.token.
    #[arg(long, env = "STRATA_MASTER_ADMIN_TOKEN_FILE", value_name = "FILE")]
    admin_token_file: Option<PathBuf>,
    /// TOML file of worker settings for the standalone's worker (the worker keys of
    /// docs/CONFIGURATION.md, e.g. `prefetch_parallelism = 64`). The standalone's own choices
    /// win over it: the master address, listen addresses, data directory, token, socket and the
    /// tiers (--memory, --nvme); STRATA_NODE wins over its `node`.
    #[arg(long, value_name = "FILE")]
    worker_config: Option<PathBuf>,
}

#[derive(Args)]
struct MasterArgs {
    /// TOML config file (see docs/CONFIGURATION.md); flags override it.
    #[arg(long, env = "STRATA_MASTER_CONFIG")]
    config: Option<PathBuf>,
    /// gRPC listen address.
    #[arg(long, env = "STRATA_MASTER_RPC_ADDR")]
    rpc_addr: Option<std::net::SocketAddr>,
    /// /metrics and /health listen address.
    #[arg(long, env = "STRATA_MASTER_HTTP_ADDR")]
    http_addr: Option<std::net::SocketAddr>,
    /// Directory of the durable store.
    #[arg(long, env = "STRATA_MASTER_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// Where mounts, jobs and schedules live: empty for redb in --data-dir (one master), or
    /// etcd://HOST:PORT[,HOST:PORT...] for several masters with an elected leader.
    #[arg(long, env = "STRATA_MASTER_META")]
    meta: Option<String>,
    /// The host:port clients reach this master at (default: --rpc-addr as bound); standbys
    /// name the leader by it.
    #[arg(long, env = "STRATA_MASTER_ADVERTISE_ADDR")]
    advertise_addr: Option<String>,
    /// Accept every caller without a token (config `auth = false`). Anyone who reaches the
    /// port can then read mount credentials' effects, change mounts and delete files.
    #[arg(long)]
    no_auth: bool,
    /// File holding the admin token: read when it exists (e.g. a Kubernetes Secret), else
    /// created with a new token (mode 0600). Default <data dir>/admin.token.
    #[arg(long, env = "STRATA_MASTER_ADMIN_TOKEN_FILE", value_name = "FILE")]
    admin_token_file: Option<PathBuf>,
    /// File holding the token workers present, read or created the same way. Default
    /// <data dir>/worker.token.
    #[arg(long, env = "STRATA_MASTER_WORKER_TOKEN_FILE", value_name = "FILE")]
    worker_token_file: Option<PathBuf>,
}

#[derive(Args)]
struct WorkerArgs {
    /// TOML config file (see docs/CONFIGURATION.md); flags override it.
    #[arg(long, env = "STRATA_WORKER_CONFIG")]
    config: Option<PathBuf>,
    /// Data-plane listen address.
    #[arg(long, env = "STRATA_WORKER_DATA_ADDR")]
    data_addr: Option<std::net::SocketAddr>,
    /// /metrics and /health listen address.
    #[arg(long, env = "STRATA_WORKER_HTTP_ADDR")]
    http_addr: Option<std::net::SocketAddr>,
    /// Host clients use to reach this worker.
    #[arg(long, env = "STRATA_WORKER_ADVERTISE_HOST")]
    advertise_host: Option<String>,
    /// The node (host, Kubernetes node name) this worker runs on, reported to the master:
    /// clients with the same STRATA_NODE prefer this worker among a block's read replicas.
    /// Default: the config file's `node`, else STRATA_NODE.
    #[arg(long, value_name = "NAME")]
    node: Option<String>,
    /// Directory for the worker id and (by default) the NVMe tier.
    #[arg(long, env = "STRATA_WORKER_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// DRAM tier size, e.g. 4GiB.
    #[arg(long, env = "STRATA_WORKER_MEMORY")]
    memory: Option<String>,
    /// NVMe tier directory.
    #[arg(long, env = "STRATA_WORKER_NVME_DIR")]
    nvme_dir: Option<PathBuf>,
    /// NVMe tier size, e.g. 100GiB.
    #[arg(long, env = "STRATA_WORKER_NVME")]
    nvme: Option<String>,
    /// Directory of the write-back journals (files on write-back mounts until uploaded).
    /// Default <nvme dir>/journal.
    #[arg(long, env = "STRATA_WORKER_JOURNAL_DIR")]
    journal_dir: Option<PathBuf>,
    /// Sidecar mode: serve this pod's processes on --socket only, never join the cluster's
    /// ring, fetch misses from the cluster's workers before the UFS.
    #[arg(long, env = "STRATA_WORKER_SIDECAR")]
    sidecar: bool,
    /// Unix socket to serve the data plane on as well. A sidecar serves only there (its
    /// clients find it through STRATA_SIDECAR_SOCKET); a cluster worker serves it beside TCP
    /// and advertises it, so clients on its host find it themselves and read its blocks by
    /// mapping them (short-circuit), with no sidecar.
    #[arg(long, env = "STRATA_WORKER_SOCKET", value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Group (name or gid) given the socket (mode 0660), e.g. the pod's fsGroup: its members'
    /// uids must also be allowed (socket_allowed_uids in the config file).
    #[arg(long, env = "STRATA_WORKER_SOCKET_GROUP", value_name = "GROUP")]
    socket_group: Option<String>,
    /// On SIGTERM/SIGINT, leave gracefully: the master takes this worker off the ring at once,
    /// it hands every block it holds to the block's new owner, then exits 0 (see
    /// docs/CACHE_CONTROL.md, "When the ring changes"). Without it, stop at once.
    #[arg(long, env = "STRATA_WORKER_DRAIN")]
    drain: bool,
    /// Longest a drain lasts before the worker exits anyway, logging what was not handed off,
    /// e.g. 3m. Keep it below the pod's terminationGracePeriodSeconds.
    #[arg(long, env = "STRATA_WORKER_DRAIN_TIMEOUT", value_name = "DURATION", default_value = "3m")]
    drain_timeout: String,
}

#[derive(Subcommand)]
enum MountCommand {
    /// Mount a UFS URI (file:///dir, s3://bucket/prefix) at a Strata path.
    Add {
        /// Absolute Strata path, e.g. /data.
        path: String,
        /// UFS URI, e.g. file:///mnt/datasets or s3://bucket/prefix.
        uri: String,
        /// Mount option KEY=VALUE (repeatable): block_size=4MiB, metadata_ttl=10s,
        /// read_replicas=1 (owners a block's reads spread over), cache_ttl=7d (how long a
        /// worker keeps a block), quota=2TiB (bytes of the mount the cluster may cache),
        /// mode=read-only|write-through|write-back, and for write-back write_replicas=2,
        /// upload_parallelism=4, upload_bandwidth=200MiB, on_full=refuse|write-through (see
        /// docs/CONFIGURATION.md); and the UFS's own options (endpoint, region, access_key_id, ...).
        #[arg(long = "option", short = 'o', value_name = "KEY=VALUE")]
        options: Vec<String>,
    },
    /// Remove a mount (cached blocks age out; the UFS is untouched).
    Rm { path: String },
    /// List mounts (secret options are shown as ***).
    Ls {
        #[arg(long)]
        json: bool,
    },
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let serving = matches!(cli.command, Command::Standalone(_) | Command::Master(_) | Command::Worker(_));
    let default_filter = if serving { "info" } else { "warn" };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal: a log file or a collector would keep
        // them as escape noise in every line.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("strata: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(commands::run(cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) if e.chain().any(is_broken_pipe) => {
            // What a command killed by SIGPIPE exits with, without its noise.
            std::process::ExitCode::from(141)
        }
        Err(e) => {
            eprintln!("strata: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn is_broken_pipe(e: &(dyn std::error::Error + 'static)) -> bool {
    e.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
}
