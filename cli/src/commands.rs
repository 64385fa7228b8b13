use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use serde_json::json;
use strata_client::{Client, ClientConfig, FileInfo, TlsConfig};
use strata_common::units::parse_size;
use strata_master::{Master, MasterConfig};
use strata_ufs::OpendalFactory;
use strata_worker::{Worker, WorkerConfig};

use crate::{
    Cli, Command, MasterArgs, MountCommand, StandaloneArgs, TlsArgs, TokenCommand, TtlCommand, WorkerArgs,
};

/// The client TLS settings of this invocation (`--tls-*` over `STRATA_TLS_*`), set once in `run`.
static CLIENT_TLS: std::sync::OnceLock<TlsConfig> = std::sync::OnceLock::new();

/// How the CLI reaches the cluster: the master(s) and the token it presents.
pub struct Target {
    pub master: String,
    /// `--token-file`, read; `None` leaves the SDK's default (environment, standalone file).
    pub token: Option<String>,
    /// `--job` / `STRATA_JOB`: the job reads are recorded under.
    pub job: Option<String>,
    /// `--qos` / `STRATA_QOS`: the request class of the reads.
    pub qos: Option<strata_client::QosClass>,
}

pub async fn run(cli: Cli) -> Result<()> {
    let _ = CLIENT_TLS.set(cli.tls.apply(TlsConfig::default()));
    let token = match &cli.token_file {
        Some(file) => Some(strata_security::token::read_token_file(file)?),
        None => None,
    };
    let job = cli.job.as_deref().map(str::trim).filter(|j| !j.is_empty()).map(String::from);
    let qos = match cli.qos.as_deref().map(str::trim).filter(|q| !q.is_empty()) {
        Some(q) => Some(q.parse::<strata_client::QosClass>().map_err(|e| anyhow::anyhow!("--qos: {e}"))?),
        None => None,
    };
    let t = Target { master: cli.master.clone(), token, job, qos };
    match cli.command {
        Command::Standalone(args) => standalone(&t.master, args, &cli.tls).await,
        Command::Master(args) => master(args, &cli.tls).await,
        Command::Worker(args) => worker(&t, args, &cli.tls).await,
        Command::Mount(cmd) => mount(&t, cmd).await,
        Command::Ls { path, json } => ls(&t, &path, json).await,
        Command::Stat { path, sync, json } => stat(&t, &path, sync, json).await,
        Command::Cat { path } => cat(&t, &path).await,
        Command::Cp { path, dest } => cp(&t, &path, &dest).await,
        Command::Put { src, path, wait, timeout } => {
            put(&t, &src, &path, wait.then_some(timeout.as_str())).await
        }
        Command::Sync { path, wait, timeout, json } => {
            sync(&t, &path, wait.then_some(timeout.as_str()), json).await
        }
        Command::Status { json } => status(&t, json).await,
        Command::Locate { path, json } => locate(&t, &path, json).await,
        Command::Pin { path, tier, ttl, wait } => pin(&t, &path, &tier, ttl.as_deref(), &wait).await,
        Command::Unpin { path, wait } => {
            let p = connect(&t).await?.admin().unpin_waiting(&path, parse_wait(&wait)?).await?;
            eprintln!(
                "unpinned {} ({}){}",
                p.path,
                strata_client::pin_tier_name(p.tier),
                in_force(&p.applied)
            );
            Ok(())
        }
        Command::Pins { json } => pins(&t, json).await,
        Command::Ttl(cmd) => ttl_command(&t, cmd).await,
        Command::Free { path, wait } => free(&t, &path, &wait).await,
        Command::Warmup(args) => crate::warmup::warmup(&connect(&t).await?, args).await,
        Command::Job(cmd) => crate::warmup::job(&connect(&t).await?, cmd).await,
        Command::Token(cmd) => token_command(&t, cmd).await,
        Command::Lineage(cmd) => crate::lineage::run(&connect(&t).await?, t.job.as_deref(), cmd).await,
    }
}

fn load_toml<T: serde::de::DeserializeOwned + Default>(path: Option<&Path>) -> Result<T> {
    match path {
        None => Ok(T::default()),
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading config {}", p.display()))?;
            toml::from_str(&text).with_context(|| format!("parsing config {}", p.display()))
        }
    }
}

fn size(flag: &str, value: &str) -> Result<u64> {
    parse_size(value).with_context(|| format!("--{flag} {value:?}: expected a size such as 512MiB or 10GiB"))
}

async fn connect(target: &Target) -> Result<Client> {
    let mut config = ClientConfig::from_env(&target.master);
    if let Some(token) = &target.token {
        config.token = Some(strata_client::Token(token.clone()));
    }
    if target.job.is_some() {
        config.job = target.job.clone();
    }
    if let Some(qos) = target.qos {
        config.qos = qos;
    }
    connect_with(config).await
}

/// Connects with `config`, the invocation's TLS settings applied.
async fn connect_with(mut config: ClientConfig) -> Result<Client> {
    if let Some(tls) = CLIENT_TLS.get() {
        config.tls = tls.clone();
    }
    let master = config.master_addr.clone();
    Client::connect(config).await.map_err(|e| anyhow::anyhow!(e)).with_context(|| {
        format!("is a master running at {master}? (start one with `strata standalone`, or set --master / STRATA_MASTER)")
    })
}

/// Waits for Ctrl-C or SIGTERM (what Kubernetes sends a pod it stops), so both shut down
/// cleanly: queued NVMe writes finish, the sidecar's socket is removed.
async fn wait_for_shutdown() -> Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.context("waiting for Ctrl-C")?,
        _ = term.recv() => {}
    }
    eprintln!("strata: shutting down");
    Ok(())
}

/// The standalone worker's socket for processes on this machine, `<dir>/worker.sock`, unless
/// that path is too long for a Unix socket address (then clients read over TCP only).
fn local_socket_path(dir: &std::path::Path) -> Option<std::path::PathBuf> {
    let path = dir.join("worker.sock");
    if path.as_os_str().len() < strata_worker::sidecar::MAX_SOCKET_PATH {
        return Some(path);
    }
    eprintln!(
        "strata: {} is too long for a Unix socket; local clients read over TCP (use a shorter --dir)",
        path.display()
    );
    None
}

async fn standalone(master_addr: &str, args: StandaloneArgs, tls: &TlsArgs) -> Result<()> {
    let rpc_addr = match args.rpc_addr {
        Some(a) => a,
        None => master_addr
            .parse()
            .with_context(|| format!("--master {master_addr:?} is not an ip:port to listen on"))?,
    };
    let cwd = std::env::current_dir().context("the current directory")?;
    let dir = match &args.dir {
        Some(dir) => dir.clone(),
        None => {
            let legacy = cwd.join(".strata/master");
            if legacy.is_dir() {
                eprintln!(
                    "strata: note: {} holds state of an earlier standalone; this one keeps its state outside \
                     the directory it mounts (use --dir .strata to go on with the old one)",
                    legacy.parent().unwrap_or(&legacy).display()
                );
            }
            strata_security::token::standalone_state_dir(&cwd).unwrap_or_else(|| PathBuf::from(".strata"))
        }
    };
    create_private_dir(&dir)?;
    // The master and worker mark their own directories; this one holds them and the tokens.
    let dir =
        strata_ufs::mark_state_dir(&dir).with_context(|| format!("marking {} as state", dir.display()))?;
    let factory = Arc::new(OpendalFactory);
    let admin_token_file =
        args.admin_token_file.clone().unwrap_or_else(|| dir.join(strata_security::token::ADMIN_TOKEN_FILE));
    let master_cfg = MasterConfig {
        rpc_addr,
        http_addr: (rpc_addr.ip(), 0).into(),
        data_dir: dir.join("master"),
        auth: !args.no_auth,
        admin_token_file: Some(admin_token_file.clone()),
        // Off unless the --tls-* flags (or STRATA_TLS_*) say otherwise.
        tls: tls.apply(Default::default()),
        ..MasterConfig::default()
    };
    let worker_token_file = master_cfg.token_files().worker_file;
    // Read before anything starts, so a bad file is the only thing said.
    let tuned: WorkerConfig = load_toml(args.worker_config.as_deref())?;
    let master = Master::start(master_cfg, factory.clone())
        .await
        .with_context(|| format!("starting the master on {rpc_addr} (is another strata already running?)"))?;
    let worker_cfg = WorkerConfig {
        master_addr: master.rpc_addr.to_string(),
        data_addr: (rpc_addr.ip(), 0).into(),
        http_addr: (rpc_addr.ip(), 0).into(),
        data_dir: dir.join("worker"),
        memory_capacity: size("memory", &args.memory)?,
        nvme_capacity: size("nvme", &args.nvme)?,
        token: None,
        token_file: Some(worker_token_file).filter(|_| !args.no_auth),
        tls: tls.apply(Default::default()),
        node: strata_common::node_from_env().or_else(|| tuned.node.clone()),
        // Processes on this machine read the worker's blocks by mapping them (short-circuit).
        socket_path: local_socket_path(&dir),
        ..tuned
    };
    let worker = Worker::start(worker_cfg, factory).await.context("starting the worker")?;

    let mut client_cfg = ClientConfig::new(master.rpc_addr.to_string());
    client_cfg.token = match args.no_auth {
        true => None,
        false => Some(strata_client::Token(strata_security::token::read_token_file(&admin_token_file)?)),
    };
    let client = connect_with(client_cfg).await?;
    let mounts =
        if args.mounts.is_empty() { vec![format!("/local=file://{}", cwd.display())] } else { args.mounts };
    let existing = client.admin().mounts().await?;
    for spec in mounts {
        let (path, uri) =
            spec.split_once('=').with_context(|| format!("--mount {spec:?}: expected /PATH=URI"))?;
        match existing.iter().find(|m| m.path == path) {
            Some(m) if m.uri == uri => {}
            Some(m) => eprintln!(
                "strata: {path} stays mounted at {} (from an earlier run); `strata mount rm {path}` to change it",
                m.uri
            ),
            None => {
                let info = client
                    .admin()
                    .add_mount(path, uri, HashMap::new())
                    .await
                    .with_context(|| format!("mounting {uri} at {path}"))?;
                for w in &info.warnings {
                    eprintln!("strata: warning: {w}");
                }
            }
        }
    }
    let mounts = client.admin().mounts().await?;
    println!("strata standalone is running");
    println!("  master   {}  (metrics and health: http://{}/metrics)", master.rpc_addr, master.http_addr);
    println!(
        "  worker   {}  data plane {}  (http://{}/metrics)",
        worker.worker_id, worker.data_addr, worker.http_addr
    );
    if let Some(socket) = &worker.local_socket {
        println!("  local    unix:{}  (clients on this machine map blocks through it)", socket.display());
    }
    println!("  state    {}", dir.display());
    if args.no_auth {
        println!("  auth     off (--no-auth): anyone who reaches these ports can use them");
    } else {
        println!(
            "  auth     admin token in {} (the CLI finds it there when run from this directory)",
            admin_token_file.display()
        );
    }
    for m in &mounts {
        println!("  mount    {} -> {}", m.path, m.uri);
    }
    if let Some(m) = mounts.first() {
        println!("try:  strata ls {}    strata cat {}/<file>    strata status", m.path, m.path);
    }
    wait_for_shutdown().await?;
    worker.shutdown().await;
    master.shutdown().await;
    Ok(())
}

/// A directory only its owner can enter (it holds tokens), made with its parents if missing.
fn create_private_dir(dir: &std::path::Path) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("creating {}", dir.display()))?;
    }
    let mode =
        std::fs::metadata(dir).with_context(|| format!("reading {}", dir.display()))?.permissions().mode();
    if mode & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("making {} private (0700)", dir.display()))?;
    }
    Ok(())
}

async fn master(args: MasterArgs, tls: &TlsArgs) -> Result<()> {
    let mut cfg: MasterConfig = load_toml(args.config.as_deref())?;
    cfg.tls = tls.apply(cfg.tls);
    if let Some(a) = args.rpc_addr {
        cfg.rpc_addr = a;
    }
    if let Some(a) = args.http_addr {
        cfg.http_addr = a;
    }
    if let Some(d) = args.data_dir {
        cfg.data_dir = d;
    }
    if let Some(m) = args.meta {
        cfg.meta = m;
    }
    if let Some(a) = args.advertise_addr {
        cfg.advertise_addr = Some(a);
    }
    if args.no_auth {
        cfg.auth = false;
    }
    if let Some(f) = args.admin_token_file {
        cfg.admin_token_file = Some(f);
    }
    if let Some(f) = args.worker_token_file {
        cfg.worker_token_file = Some(f);
    }
    let handle = Master::start(cfg, Arc::new(OpendalFactory)).await?;
    println!("master listening on {} (http {})", handle.rpc_addr, handle.http_addr);
    wait_for_shutdown().await?;
    handle.shutdown().await;
    Ok(())
}

async fn worker(target: &Target, args: WorkerArgs, tls: &TlsArgs) -> Result<()> {
    let mut cfg: WorkerConfig = load_toml(args.config.as_deref())?;
    cfg.tls = tls.apply(cfg.tls);
    if args.config.is_none() || std::env::var_os("STRATA_MASTER").is_some() {
        cfg.master_addr = target.master.clone();
    }
    // --token-file, else STRATA_TOKEN / STRATA_TOKEN_FILE, else the config's token_file.
    cfg.token = match &target.token {
        Some(t) => Some(t.clone()),
        None => {
            match std::env::var(strata_security::token::TOKEN_ENV).ok().filter(|t| !t.trim().is_empty()) {
                Some(t) => Some(t.trim().to_string()),
                None => {
                    match std::env::var_os(strata_security::token::TOKEN_FILE_ENV).filter(|v| !v.is_empty()) {
                        Some(file) => Some(strata_security::token::read_token_file(Path::new(&file))?),
                        None => None,
                    }
                }
            }
        }
    };
    if let Some(a) = args.data_addr {
        cfg.data_addr = a;
    }
    if let Some(a) = args.http_addr {
        cfg.http_addr = a;
    }
    if let Some(h) = args.advertise_host {
        cfg.advertise_host = Some(h);
    }
    // The flag, else the config file, else the environment (the downward API in Kubernetes).
    cfg.node =
        args.node.or(cfg.node.take()).or_else(strata_common::node_from_env).filter(|n| !n.trim().is_empty());
    if let Some(d) = args.data_dir {
        cfg.data_dir = d;
    }
    if let Some(m) = args.memory {
        cfg.memory_capacity = size("memory", &m)?;
    }
    if let Some(d) = args.journal_dir {
        cfg.journal_dir = Some(d);
    }
    if let Some(d) = args.nvme_dir {
        cfg.nvme_dir = Some(d);
    }
    if let Some(n) = args.nvme {
        cfg.nvme_capacity = size("nvme", &n)?;
    }
    cfg.sidecar |= args.sidecar;
    if let Some(s) = args.socket {
        cfg.socket_path = Some(s);
    }
    if let Some(g) = args.socket_group {
        cfg.socket_group = Some(g);
    }
    if cfg.sidecar {
        let timeout = std::time::Duration::from_millis(cfg.ufs_timeout_ms);
        let token = cfg.resolve_token()?;
        let upstream =
            strata_client::ClusterUpstream::connect_tls(&cfg.master_addr, token, timeout, cfg.tls.clone())
                .await
                .with_context(|| {
                    format!("sidecar: cannot reach the cluster through the master at {}", cfg.master_addr)
                })?;
        let handle = strata_worker::sidecar::start(cfg, Arc::new(OpendalFactory), Arc::new(upstream)).await?;
        println!("sidecar serving data on unix:{} (http {})", handle.socket_path.display(), handle.http_addr);
        wait_for_shutdown().await?;
        handle.shutdown().await;
        return Ok(());
    }
    let drain = match args.drain {
        false => None,
        true => Some(strata_common::units::parse_duration(&args.drain_timeout).with_context(|| {
            format!("--drain-timeout {:?}: expected a duration such as 3m or 90s", args.drain_timeout)
        })?),
    };
    let (master_addr, token, tls) = (cfg.master_addr.clone(), cfg.resolve_token()?, cfg.tls.clone());
    let handle = Worker::start(cfg, Arc::new(OpendalFactory)).await?;
    // Peer fetch: a block this worker misses is asked of its previous owners before the UFS.
    match strata_client::PeerUpstream::connect(&master_addr, &handle.worker_id, token, PEER_TIMEOUT, tls)
        .await
    {
        Ok(peers) => {
            let peers = Arc::new(peers);
            handle.blocks.set_upstream(peers.clone());
            // The same client pushes blocks to their new owners (hand-off, drain).
            handle.handoff.set_peer_link(peers);
        }
        Err(e) => tracing::warn!(err = %e, "no peer fetch or hand-off: misses go to the UFS"),
    }
    match &handle.local_socket {
        Some(socket) => println!(
            "worker {} serving data on {} and unix:{} (http {})",
            handle.worker_id,
            handle.data_addr,
            socket.display(),
            handle.http_addr
        ),
        None => {
            println!(
                "worker {} serving data on {} (http {})",
                handle.worker_id, handle.data_addr, handle.http_addr
            )
        }
    }
    wait_for_shutdown().await?;
    if let Some(timeout) = drain {
        let report = handle.drain(timeout).await;
        eprintln!(
            "strata: drain {}: {} blocks handed off, {} declined (the new owner had them), {} failed, {} not offered",
            if report.finished { "finished" } else { "deadline passed" },
            report.sent,
            report.declined,
            report.failed,
            report.left
        );
    }
    handle.shutdown().await;
    Ok(())
}

/// How long a worker waits for a peer's cached block before asking the next peer or the UFS:
/// a peer answers from its tiers, so anything slower is a peer in trouble.
const PEER_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(500);

async fn mount(target: &Target, cmd: MountCommand) -> Result<()> {
    let client = connect(target).await?;
    match cmd {
        MountCommand::Add { path, uri, options } => {
            let mut opts = HashMap::new();
            for o in options {
                let (k, v) =
                    o.split_once('=').with_context(|| format!("--option {o:?}: expected KEY=VALUE"))?;
                opts.insert(k.to_string(), v.to_string());
            }
            let m = client.admin().add_mount(&path, &uri, opts).await?;
            outln!(
                "mounted {} -> {} (block size {}, metadata ttl {} ms)",
                m.path,
                m.uri,
                m.block_size,
                m.metadata_ttl.as_millis()
            )?;
            for w in &m.warnings {
                eprintln!("strata: warning: {w}");
            }
        }
        MountCommand::Rm { path } => {
            client.admin().remove_mount(&path).await?;
            outln!("unmounted {path}")?;
        }
        MountCommand::Ls { json } => {
            let mounts = client.admin().mounts().await?;
            if json {
                let v: Vec<_> = mounts
                    .iter()
                    .map(|m| json!({"path": m.path, "uri": m.uri, "options": m.options, "block_size": m.block_size, "metadata_ttl_ms": m.metadata_ttl.as_millis() as u64}))
                    .collect();
                outln!("{}", serde_json::to_string_pretty(&v)?)?;
            } else {
                for m in mounts {
                    let mut opts: Vec<_> = m.options.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    opts.sort();
                    outln!("{}\t{}\t{}", m.path, m.uri, opts.join(","))?;
                }
            }
        }
    }
    Ok(())
}

fn info_json(f: &FileInfo) -> serde_json::Value {
    json!({"path": f.path, "is_dir": f.is_dir, "size": f.size, "version": f.version, "mtime_ms": f.mtime_ms, "block_size": f.block_size, "persist": f.persist.as_str(), "holders": f.holders.iter().map(|h| h.id.as_str()).collect::<Vec<_>>()})
}

/// Prints a listing page by page as the master sends it: a directory of millions of entries
/// never has to fit in memory (or in one message). `--json` writes the same array
/// `serde_json` would, one element at a time.
async fn ls(target: &Target, path: &str, as_json: bool) -> Result<()> {
    let client = connect(target).await?;
    let mut token = String::new();
    let mut first = true;
    loop {
        let (entries, next) = client.list_page(path, &token, 0).await?;
        for e in &entries {
            if as_json {
                let item = serde_json::to_string_pretty(&info_json(e))?;
                let indented: Vec<String> = item.lines().map(|l| format!("  {l}")).collect();
                out!("{}{}", if first { "[\n" } else { ",\n" }, indented.join("\n"))?;
            } else {
                let name = e.path.rsplit('/').next().unwrap_or(&e.path);
                if e.is_dir {
                    outln!("{:>14}  {name}/", "-")?;
                } else {
                    outln!("{:>14}  {name}", e.size)?;
                }
            }
            first = false;
        }
        match next {
            Some(next) => token = next,
            None => break,
        }
    }
    if as_json {
        outln!("{}", if first { "[]" } else { "\n]" })?;
    }
    Ok(())
}

/// The pins covering `path` (at it or above it), most specific first.
fn pins_covering<'p>(pins: &'p [strata_client::PinInfo], path: &str) -> Vec<&'p strata_client::PinInfo> {
    let mut covering: Vec<_> =
        pins.iter().filter(|p| strata_common::path::strip_mount(&p.path, path).is_some()).collect();
    covering.sort_by_key(|p| std::cmp::Reverse(p.path.len()));
    covering
}

/// The cache TTL that applies at `path` and what set it: the most specific path TTL (`ttl
/// /p`), else its mount's `cache_ttl` option (`mount /m`). `None` when neither, or when the
/// master cannot say.
async fn effective_cache_ttl(client: &Client, path: &str) -> Option<(u64, String)> {
    let under = |root: &str| strata_common::path::strip_mount(root, path).is_some();
    let ttls = client.admin().cache_ttls().await.unwrap_or_default();
    if let Some(t) = ttls.iter().filter(|t| under(&t.path)).max_by_key(|t| t.path.len()) {
        return Some((t.cache_ttl_ms, format!("ttl {}", t.path)));
    }
    let mounts = client.admin().mounts().await.ok()?;
    let mount = mounts.iter().filter(|m| under(&m.path)).max_by_key(|m| m.path.len())?;
    let ttl = strata_common::units::parse_duration(mount.options.get("cache_ttl")?)?;
    Some((ttl.as_millis() as u64, format!("mount {}", mount.path)))
}

async fn stat(target: &Target, path: &str, sync: bool, as_json: bool) -> Result<()> {
    let client = connect(target).await?;
    let f = client.stat_with(path, sync).await?;
    // Pins are a separate question to the master; one that cannot answer it (an older
    // master) still gets the file's status.
    let pins = client.admin().pins().await.unwrap_or_default();
    let covering = pins_covering(&pins, &f.path);
    let cache_ttl = effective_cache_ttl(&client, &f.path).await;
    if as_json {
        let mut v = info_json(&f);
        let pins: Vec<_> = covering
            .iter()
            .map(|p| {
                json!({"path": p.path, "tier": strata_client::pin_tier_name(p.tier),
                       "expires_unix_ms": (p.expires_unix_ms != 0).then_some(p.expires_unix_ms)})
            })
            .collect();
        v.as_object_mut().expect("object").insert("pinned_by".into(), pins.into());
        let ttl = cache_ttl.map(|(ms, by)| json!({"cache_ttl_ms": ms, "set_by": by}));
        v.as_object_mut().expect("object").insert("cache_ttl".into(), ttl.into());
        outln!("{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        outln!("path:       {}", f.path)?;
        outln!("type:       {}", if f.is_dir { "directory" } else { "file" })?;
        if !f.is_dir {
            outln!("size:       {}", f.size)?;
            outln!("version:    {}", f.version)?;
            outln!("block size: {}", f.block_size)?;
            outln!("persisted:  {}", f.persist.as_str())?;
            if !f.holders.is_empty() {
                let ids: Vec<&str> = f.holders.iter().map(|h| h.id.as_str()).collect();
                outln!("journals:   {}", ids.join(", "))?;
            }
        }
        outln!("mtime (ms): {}", f.mtime_ms)?;
        for p in &covering {
            let until = if p.expires_unix_ms == 0 {
                String::new()
            } else {
                format!(" until {}", unix_ms_text(p.expires_unix_ms))
            };
            outln!("pinned:     {} by {}{until}", strata_client::pin_tier_name(p.tier), p.path)?;
        }
        if let Some((ms, by)) = &cache_ttl {
            let ttl = strata_common::units::format_duration(std::time::Duration::from_millis(*ms));
            outln!("cache ttl:  {ttl} ({by})")?;
        }
    }
    Ok(())
}

/// Streams a reader into a blocking writer a block at a time, each written from the buffer it
/// arrived in (`read` would copy it into another first). Tokio's stdout and file writers hop
/// to a blocking thread for every 8 KiB write, which capped `cat` at ~160 MB/s.
async fn stream_to(
    reader: &mut strata_client::StrataReader,
    out: &mut impl std::io::Write,
) -> std::io::Result<u64> {
    let mut total = 0u64;
    while let Some(chunk) = reader.next_chunk().await? {
        tokio::task::block_in_place(|| out.write_all(&chunk))?;
        total += chunk.len() as u64;
    }
    Ok(total)
}

async fn cat(target: &Target, path: &str) -> Result<()> {
    let client = connect(target).await?;
    let mut reader = client.open(path).await?;
    let mut stdout = std::io::stdout().lock();
    stream_to(&mut reader, &mut stdout).await.with_context(|| format!("reading {path}"))?;
    stdout.flush()?;
    report_lineage(&client).await;
    Ok(())
}

async fn cp(target: &Target, path: &str, dest: &Path) -> Result<()> {
    let client = connect(target).await?;
    let mut reader = client.open(path).await?;
    let dest = if dest.is_dir() {
        dest.join(path.rsplit('/').next().filter(|n| !n.is_empty()).context("source has no file name")?)
    } else {
        dest.to_path_buf()
    };
    // Written beside the destination and renamed, so a failed copy never leaves a torn file.
    let tmp = dest.with_extension("strata-partial");
    let mut file = std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let copied = stream_to(&mut reader, &mut file).await;
    let n = match copied {
        Ok(n) => n,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            bail!("reading {path}: {e}");
        }
    };
    file.sync_all()?;
    std::fs::rename(&tmp, &dest)?;
    eprintln!("copied {n} bytes to {}", dest.display());
    report_lineage(&client).await;
    Ok(())
}

/// Sends what this command read to the master's lineage before it exits; a failure is said,
/// not fatal: the bytes were read.
async fn report_lineage(client: &Client) {
    if let Err(e) = client.flush_lineage().await {
        eprintln!("warning: the read was not recorded in the lineage: {e}");
    }
}

fn parse_timeout(text: &str) -> Result<std::time::Duration> {
    strata_common::units::parse_duration(text)
        .with_context(|| format!("--timeout {text:?}: expected a duration such as 30s, 10m or 1h"))
}

async fn put(target: &Target, src: &Path, path: &str, wait: Option<&str>) -> Result<()> {
    let timeout = wait.map(parse_timeout).transpose()?;
    let client = connect(target).await?;
    let mut input: Box<dyn std::io::Read + Send> = if src == Path::new("-") {
        Box::new(std::io::stdin())
    } else {
        Box::new(std::fs::File::open(src).with_context(|| format!("opening {}", src.display()))?)
    };
    let mut writer = client.create(path).await?;
    let mut buf = vec![0u8; 8 << 20];
    loop {
        let n = tokio::task::block_in_place(|| input.read(&mut buf))
            .with_context(|| format!("reading {}", src.display()))?;
        if n == 0 {
            break;
        }
        // An error drops the writer, which aborts the write: the old file stays.
        writer.write(&buf[..n]).await?;
    }
    let info = writer.close().await?;
    eprintln!("wrote {} bytes to {} ({})", info.size, info.path, info.persist.as_str());
    if let Some(timeout) = timeout {
        client.sync_wait(&info.path, timeout).await?;
        eprintln!("{} is in the UFS", info.path);
    }
    Ok(())
}

fn unix_ms_text(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms).map_or_else(|| ms.to_string(), |t| t.to_rfc3339())
}

fn parse_wait(wait: &str) -> Result<std::time::Duration> {
    strata_common::units::parse_duration(wait)
        .with_context(|| format!("--wait {wait:?}: expected a duration such as 10s"))
}

/// How far a change of pins or TTLs got: "; in force on N of M workers", and a warning naming
/// the live workers that had not applied it when the master answered.
fn in_force(applied: &Option<strata_client::Applied>) -> String {
    let Some(a) = applied else { return String::new() };
    if !a.pending.is_empty() {
        eprintln!(
            "strata: warning: not in force yet on {} of {} live workers ({}): they apply it at their next \
             heartbeat; a frozen or unreachable one when it answers again, before it evicts anything",
            a.pending.len(),
            a.workers,
            a.pending.join(", ")
        );
    }
    format!("; in force on {} of {} workers", a.workers_applied, a.workers)
}

async fn pin(target: &Target, path: &str, tier: &str, ttl: Option<&str>, wait: &str) -> Result<()> {
    let tier = strata_client::parse_pin_tier(tier).map_err(|e| anyhow::anyhow!("--{e}"))?;
    let ttl = ttl
        .map(|t| {
            strata_common::units::parse_duration(t)
                .filter(|d| !d.is_zero())
                .with_context(|| format!("--ttl {t:?}: expected a duration such as 30m, 12h or 7d"))
        })
        .transpose()?;
    let p = connect(target).await?.admin().pin_waiting(path, tier, ttl, parse_wait(wait)?).await?;
    let until = if p.expires_unix_ms == 0 {
        String::new()
    } else {
        format!(" until {}", unix_ms_text(p.expires_unix_ms))
    };
    // What the pin holds is what the workers hold: say so, the output must not promise a load.
    eprintln!(
        "pinned {} in {} ({} bytes){until}{}; blocks not cached yet are kept once read or warmed up",
        p.path,
        strata_client::pin_tier_name(p.tier),
        p.bytes,
        in_force(&p.applied)
    );
    Ok(())
}

async fn pins(target: &Target, as_json: bool) -> Result<()> {
    let pins = connect(target).await?.admin().pins().await?;
    if as_json {
        let items: Vec<_> = pins
            .iter()
            .map(|p| {
                json!({"path": p.path, "tier": strata_client::pin_tier_name(p.tier), "bytes": p.bytes,
                       "created_unix_ms": p.created_unix_ms,
                       "expires_unix_ms": (p.expires_unix_ms != 0).then_some(p.expires_unix_ms)})
            })
            .collect();
        outln!("{}", serde_json::to_string_pretty(&items)?)?;
    } else if pins.is_empty() {
        eprintln!("nothing is pinned");
    } else {
        for p in &pins {
            let until =
                if p.expires_unix_ms == 0 { "-".to_string() } else { unix_ms_text(p.expires_unix_ms) };
            outln!("{:<6} {:>14}  {:<25}  {}", strata_client::pin_tier_name(p.tier), p.bytes, until, p.path)?;
        }
    }
    Ok(())
}

async fn ttl_command(target: &Target, cmd: TtlCommand) -> Result<()> {
    let client = connect(target).await?;
    match cmd {
        TtlCommand::Set { path, ttl, wait } => {
            let d = strata_common::units::parse_duration(&ttl)
                .filter(|d| !d.is_zero())
                .with_context(|| format!("TTL {ttl:?}: expected a duration such as 30m, 12h or 7d"))?;
            let r = client.admin().set_cache_ttl_waiting(&path, Some(d), parse_wait(&wait)?).await?;
            eprintln!(
                "blocks under {} now leave the cache {} after a worker stores them{}",
                r.path,
                strata_common::units::format_duration(d),
                in_force(&r.applied)
            );
        }
        TtlCommand::Clear { path, wait } => {
            let r = client.admin().set_cache_ttl_waiting(&path, None, parse_wait(&wait)?).await?;
            eprintln!("cleared the cache TTL of {}{}", r.path, in_force(&r.applied));
        }
        TtlCommand::Ls { json } => {
            let ttls = client.admin().cache_ttls().await?;
            let text = |ms: u64| strata_common::units::format_duration(std::time::Duration::from_millis(ms));
            if json {
                let items: Vec<_> = ttls
                    .iter()
                    .map(|t| json!({"path": t.path, "cache_ttl_ms": t.cache_ttl_ms, "cache_ttl": text(t.cache_ttl_ms), "created_unix_ms": t.created_unix_ms}))
                    .collect();
                outln!("{}", serde_json::to_string_pretty(&items)?)?;
            } else if ttls.is_empty() {
                eprintln!("no path has a cache TTL of its own (mounts may: strata mount ls)");
            } else {
                for t in &ttls {
                    outln!("{:<8} {}", text(t.cache_ttl_ms), t.path)?;
                }
            }
        }
    }
    Ok(())
}

async fn free(target: &Target, path: &str, wait: &str) -> Result<()> {
    let r = connect(target).await?.admin().free(path, parse_wait(wait)?).await?;
    let pending = if r.workers_pending.is_empty() {
        String::new()
    } else {
        format!(" ({} will at their next heartbeat)", r.workers_pending.join(", "))
    };
    eprintln!(
        "freed {} cached blocks ({} bytes) of {path}; {} of {} workers dropped them{pending}",
        r.blocks, r.bytes, r.workers_done, r.workers,
    );
    Ok(())
}

async fn sync(target: &Target, path: &str, wait: Option<&str>, as_json: bool) -> Result<()> {
    let timeout = wait.map(parse_timeout).transpose()?;
    let client = connect(target).await?;
    let pending = client.sync(path, true).await?;
    let state = |s: i32| {
        strata_client::PersistState::try_from(s).map_or("unknown", |s| match s {
            strata_client::PersistState::Persisted => "persisted",
            strata_client::PersistState::Pending => "pending",
            strata_client::PersistState::Uploading => "uploading",
            strata_client::PersistState::Failed => "failed",
        })
    };
    if as_json {
        let items: Vec<_> = pending
            .iter()
            .map(|p| {
                json!({"path": p.path, "size": p.size, "state": state(p.state), "error": p.error,
                       "holders": p.holders, "uploader": p.uploader, "committed_unix_ms": p.committed_unix_ms})
            })
            .collect();
        outln!("{}", serde_json::to_string_pretty(&items)?)?;
    } else if pending.is_empty() {
        eprintln!("everything under {path} is in the UFS");
    } else {
        for p in &pending {
            let why = if p.error.is_empty() { String::new() } else { format!("  ({})", p.error) };
            outln!("{:<10} {:>14}  {}{why}", state(p.state), p.size, p.path)?;
        }
    }
    if let Some(timeout) = timeout {
        client.sync_wait(path, timeout).await?;
        eprintln!("everything under {path} is in the UFS");
    }
    Ok(())
}

async fn locate(target: &Target, path: &str, as_json: bool) -> Result<()> {
    let r = connect(target).await?.admin().locate(path).await?;
    if as_json {
        let workers: Vec<_> = r
            .workers
            .iter()
            .map(|w| {
                json!({"worker_id": w.worker_id, "node": w.node, "data_addr": w.data_addr, "live": w.live,
                       "blocks": w.blocks, "bytes": w.bytes})
            })
            .collect();
        let out = json!({"path": r.path, "files": r.files, "blocks": r.blocks, "bytes": r.bytes,
                         "cached_blocks": r.cached_blocks, "cached_bytes": r.cached_bytes, "workers": workers});
        outln!("{}", serde_json::to_string_pretty(&out)?)?;
        return Ok(());
    }
    let share = |part: u64, whole: u64| if whole == 0 { 0.0 } else { 100.0 * part as f64 / whole as f64 };
    outln!(
        "{}: {} files, {} blocks, {} bytes; cached {} blocks, {} bytes ({:.1}%)",
        r.path,
        r.files,
        r.blocks,
        r.bytes,
        r.cached_blocks,
        r.cached_bytes,
        share(r.cached_bytes, r.bytes)
    )?;
    if r.workers.is_empty() {
        eprintln!("no worker holds a block of {}", r.path);
        return Ok(());
    }
    outln!("{:<24} {:<20} {:>8} {:>16} {:>7}", "WORKER", "NODE", "BLOCKS", "BYTES", "OF PATH")?;
    for w in &r.workers {
        let node = if w.node.is_empty() { "-" } else { w.node.as_str() };
        let lost = if w.live { "" } else { "  (lost)" };
        outln!(
            "{:<24} {:<20} {:>8} {:>16} {:>6.1}%{lost}",
            w.worker_id,
            node,
            w.blocks,
            w.bytes,
            share(w.bytes, r.bytes)
        )?;
    }
    Ok(())
}

async fn status(target: &Target, as_json: bool) -> Result<()> {
    let client = connect(target).await?;
    let s = client.admin().status().await?;
    let totals = s.totals.unwrap_or_default();
    let counters = |c: &strata_proto::WorkerCounters| {
        json!({"cache_hits": c.cache_hits, "cache_misses": c.cache_misses, "ufs_reads": c.ufs_reads,
               "ufs_bytes_read": c.ufs_bytes_read, "bytes_served": c.bytes_served, "corrupt_blocks": c.corrupt_blocks})
    };
    let tier_name =
        |t: i32| strata_proto::Tier::try_from(t).unwrap_or(strata_proto::Tier::Unspecified).label();
    if as_json {
        let workers: Vec<_> = s
            .workers
            .iter()
            .map(|w| {
                let tiers: Vec<_> = w
                    .tiers
                    .iter()
                    .map(|t| json!({"tier": tier_name(t.tier), "capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes, "blocks": t.blocks,
                        "disk_full": t.disk_full, "full_limit_bytes": t.full_limit_bytes,
                        "write_errors": {"no_space": t.write_errors_no_space, "quota": t.write_errors_quota, "io": t.write_errors_io}}))
                    .collect();
                let mount_bytes: serde_json::Map<String, serde_json::Value> =
                    w.mount_usage.iter().map(|u| (u.path.clone(), u.bytes.into())).collect();
                let mut v = json!({"id": w.id, "data_addr": w.data_addr, "http_addr": w.http_addr, "node": w.node, "live": w.live, "suspect": w.suspect, "draining": w.draining,
                    "last_heartbeat_ms_ago": w.last_heartbeat_ms_ago, "blocks": w.blocks, "tiers": tiers, "mount_bytes": mount_bytes});
                v.as_object_mut().expect("object").extend(
                    counters(&w.counters.unwrap_or_default()).as_object().expect("object").clone(),
                );
                v
            })
            .collect();
        let mut total = counters(&totals);
        total.as_object_mut().expect("object").insert("blocks".into(), s.blocks.into());
        let quotas: Vec<_> = s
            .mount_quotas
            .iter()
            .map(|q| json!({"path": q.path, "quota_bytes": q.quota_bytes, "cached_bytes": q.cached_bytes, "cache_ttl_ms": q.cache_ttl_ms}))
            .collect();
        let out = json!({"leader": s.leader, "membership_epoch": s.membership_epoch, "mounts": s.mounts, "workers": workers, "totals": total,
            "mount_quotas": quotas});
        outln!("{}", serde_json::to_string_pretty(&out)?)?;
        return Ok(());
    }
    outln!(
        "leader {}  membership epoch {}  mounts {}  blocks {}",
        s.leader,
        s.membership_epoch,
        s.mounts,
        s.blocks
    )?;
    outln!(
        "cache hits {}  misses {}  ufs reads {}  ufs bytes {}  served bytes {}",
        totals.cache_hits,
        totals.cache_misses,
        totals.ufs_reads,
        totals.ufs_bytes_read,
        totals.bytes_served
    )?;
    for q in &s.mount_quotas {
        let quota = if q.quota_bytes > 0 {
            format!(
                "{} of quota {} bytes cached ({:.1}%)",
                q.cached_bytes,
                q.quota_bytes,
                q.cached_bytes as f64 * 100.0 / q.quota_bytes as f64
            )
        } else {
            format!("{} bytes cached, no quota", q.cached_bytes)
        };
        let ttl = if q.cache_ttl_ms > 0 {
            format!(
                "  cache_ttl {}",
                strata_common::units::format_duration(std::time::Duration::from_millis(q.cache_ttl_ms))
            )
        } else {
            String::new()
        };
        outln!("mount {}: {quota}{ttl}", q.path)?;
    }
    for w in &s.workers {
        let c = w.counters.unwrap_or_default();
        let node = if w.node.is_empty() { String::new() } else { format!(" node {}", w.node) };
        outln!(
            "worker {} {}{node} {} (heartbeat {} ms ago) blocks {} hits {} misses {} ufs bytes {}",
            w.id,
            w.data_addr,
            match (w.live, w.suspect, w.draining) {
                (true, _, true) => "DRAINING",
                (true, false, false) => "live",
                (true, true, false) => "SUSPECT",
                (false, _, _) => "LOST",
            },
            w.last_heartbeat_ms_ago,
            w.blocks,
            c.cache_hits,
            c.cache_misses,
            c.ufs_bytes_read
        )?;
        for t in &w.tiers {
            let errors = t.write_errors_no_space + t.write_errors_quota + t.write_errors_io;
            let full = if t.disk_full {
                format!("  DISK FULL: holds at most {} bytes for now", t.full_limit_bytes)
            } else {
                String::new()
            };
            let failed = if errors > 0 {
                format!(
                    "  write errors: {} no space, {} quota, {} i/o",
                    t.write_errors_no_space, t.write_errors_quota, t.write_errors_io
                )
            } else {
                String::new()
            };
            outln!(
                "    {:<7} {} / {} bytes, {} blocks{full}{failed}",
                tier_name(t.tier),
                t.used_bytes,
                t.capacity_bytes,
                t.blocks
            )?;
        }
    }
    Ok(())
}

async fn token_command(target: &Target, cmd: TokenCommand) -> Result<()> {
    let client = connect(target).await?;
    match cmd {
        TokenCommand::Create { role, prefix, name } => {
            let (info, token) =
                client.admin().create_token(&role, prefix.as_deref().unwrap_or(""), &name).await?;
            let scope = if info.prefix.is_empty() { "all paths".to_string() } else { info.prefix.clone() };
            outln!(
                "created token {}: role {}, scope {}; shown once, store it now:",
                info.id,
                info.role,
                scope
            )?;
            // Alone on the last line: scripts take `| tail -n1`.
            outln!("{token}")?;
        }
        TokenCommand::Ls { json } => {
            let tokens = client.admin().list_tokens().await?;
            if json {
                let v: Vec<_> = tokens
                    .iter()
                    .map(|t| json!({"id": t.id, "role": t.role, "prefix": t.prefix, "name": t.name, "created_ms": t.created_ms, "file": t.file}))
                    .collect();
                outln!("{}", serde_json::to_string_pretty(&v)?)?;
            } else {
                outln!("ID\tROLE\tSCOPE\tNAME\tCREATED")?;
                for t in tokens {
                    let scope = if t.prefix.is_empty() { "/" } else { t.prefix.as_str() };
                    let created = chrono::DateTime::from_timestamp_millis(t.created_ms)
                        .map(|d| d.format("%Y-%m-%d %H:%M:%SZ").to_string())
                        .unwrap_or_default();
                    let name =
                        if t.file.is_empty() { t.name } else { format!("{} (file {})", t.name, t.file) };
                    outln!("{}\t{}\t{}\t{}\t{}", t.id, t.role, scope, name, created)?;
                }
            }
        }
        TokenCommand::Revoke { id } => {
            let t = client.admin().revoke_token(&id).await?;
            outln!(
                "revoked token {} ({}{})",
                t.id,
                t.role,
                if t.name.is_empty() { String::new() } else { format!(", {}", t.name) }
            )?;
        }
    }
    Ok(())
}
