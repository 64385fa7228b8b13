//! The master at scale, over its real gRPC API: simulated workers report `--files` x `--blocks`
//! block entries (10 M files / 100 M entries by default) in the chunked heartbeats real workers
//! send; then the master's heap per entry (a counting allocator, not type sizes), `Stat` ops/s on
//! cached metadata with many callers, and listing entries/s of a large directory, page by page.
//!
//! ```text
//! cargo run --release -p strata-bench --bin master_bench                       # 10 M files, 100 M entries
//! cargo run --release -p strata-bench --bin master_bench -- --files 100000     # a quick look
//! ```
//!
//! Master, simulated workers and callers share this process (and the machine's cores), so the
//! rates are what one master answers while its own callers compete with it for CPU. `Stat` is
//! measured on raw RPCs: the client SDK would answer most of them from its own cache.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use strata_bench::load_average;

use clap::Parser;
use strata_bench::counting::{Counting, live};
use strata_master::{Master, MasterConfig};
use strata_proto::master_client::MasterClient;
use strata_proto::{
    AddMountRequest, BlockReport, HeartbeatRequest, ListRequest, RegisterWorkerRequest, StatRequest, Tier,
};
use tonic::codegen::InterceptedService;
use tonic::transport::Channel;

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[derive(Parser, Clone)]
struct Args {
    /// Files whose blocks the simulated workers report (one version each).
    #[arg(long, default_value_t = 10_000_000)]
    files: u64,
    /// Cached blocks per file (one holder each).
    #[arg(long, default_value_t = 10)]
    blocks: u64,
    /// Simulated workers, reporting concurrently.
    #[arg(long, default_value_t = 8)]
    workers: u64,
    /// Block reports per heartbeat (a real worker sends 10,000).
    #[arg(long, default_value_t = 10_000)]
    chunk: usize,
    /// Files in the directory that `Stat` and `List` are measured on (real files in a local
    /// directory mounted at /bench).
    #[arg(long, default_value_t = 100_000)]
    dir_files: u64,
    /// Concurrent `Stat` callers.
    #[arg(long, default_value_t = 32)]
    callers: usize,
    /// HTTP/2 connections the callers share.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Concurrent listers of the directory.
    #[arg(long, default_value_t = 4)]
    listers: usize,
    /// Seconds each rate is measured for.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
}

fn file_id(f: u64) -> String {
    // The shape of a real file identity: a hash of URI, path and block size.
    format!("{:016x}{:016x}-{:09}", f.wrapping_mul(0x9E37_79B9_7F4A_7C15), f ^ 0xdead_beef, f)
}

fn version(f: u64) -> String {
    format!("\"{:032x}\"", u128::from(f).wrapping_mul(0x2545_F491_4F6C_DD1D_0000_0001))
}

/// A client of the master presenting `token` on every call (the token check is part of what is
/// measured).
type Conn = MasterClient<InterceptedService<Channel, Bearer>>;

#[derive(Clone)]
struct Bearer(tonic::metadata::MetadataValue<tonic::metadata::Ascii>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        req.metadata_mut().insert("authorization", self.0.clone());
        Ok(req)
    }
}

async fn connect(addr: &str, token: &str) -> anyhow::Result<Conn> {
    let channel = Channel::from_shared(format!("http://{addr}"))?.connect().await?;
    let bearer = Bearer(format!("Bearer {token}").parse()?);
    Ok(MasterClient::with_interceptor(channel, bearer)
        .max_decoding_message_size(strata_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(strata_proto::MAX_MESSAGE_BYTES))
}

/// The token in a file the master wrote at start.
fn token(path: &std::path::Path) -> anyhow::Result<String> {
    Ok(std::fs::read_to_string(path)?.trim().to_string())
}

/// One simulated worker: registers, then sends the blocks of every file `f` with
/// `f % workers == w` as a full report in chunks, as a restarted worker does.
async fn report(addr: String, worker_token: String, args: Args, w: u64) -> anyhow::Result<u64> {
    let mut master = connect(&addr, &worker_token).await?;
    let worker_id = format!("bench-worker-{w:04}");
    master
        .register_worker(RegisterWorkerRequest {
            worker_id: worker_id.clone(),
            data_addr: format!("127.0.0.1:{}", 40000 + w),
            http_addr: String::new(),
            tiers: Vec::new(),
            ..Default::default()
        })
        .await?;
    let mut sent = 0u64;
    let mut chunk = Vec::with_capacity(args.chunk);
    let mut first = true;
    let mut f = w;
    loop {
        if f < args.files {
            let (fid, ver) = (file_id(f), version(f));
            for index in 0..args.blocks {
                chunk.push(BlockReport {
                    file_id: fid.clone(),
                    version: ver.clone(),
                    index,
                    tier: Tier::Nvme as i32,
                    size: 4 << 20,
                });
            }
            f += args.workers;
        }
        if chunk.len() >= args.chunk || (f >= args.files && (!chunk.is_empty() || first)) {
            sent += chunk.len() as u64;
            let resp = master
                .heartbeat(HeartbeatRequest {
                    worker_id: worker_id.clone(),
                    tiers: Vec::new(),
                    counters: None,
                    added: std::mem::take(&mut chunk),
                    removed: Vec::new(),
                    full_report: first,
                    journals: Vec::new(),
                    pins_epoch: 0,
                    frees_applied: 0,
                    mount_usage: Vec::new(),
                    draining: false,
                })
                .await?
                .into_inner();
            anyhow::ensure!(!resp.reregister, "the master forgot {worker_id} mid-report");
            first = false;
        }
        if f >= args.files && chunk.is_empty() {
            return Ok(sent);
        }
    }
}

struct Rate {
    ops: f64,
    p50_us: u128,
    p99_us: u128,
}

/// `Stat` of random cached paths (or, with `stat` false, `ListMounts`) from `args.callers`
/// concurrent callers for `args.seconds`.
async fn rate(channels: &[Conn], args: &Args, paths: Arc<Vec<String>>, stat: bool) -> anyhow::Result<Rate> {
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
    let t = Instant::now();
    let mut callers = Vec::new();
    for c in 0..args.callers {
        let (mut master, paths) = (channels[c % channels.len()].clone(), paths.clone());
        callers.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut i = c.wrapping_mul(7919);
            while Instant::now() < deadline {
                i = (i + 104_729) % paths.len();
                let s = Instant::now();
                if stat {
                    master.stat(StatRequest { path: paths[i].clone(), sync: false }).await?;
                } else {
                    master.list_mounts(strata_proto::Empty {}).await?;
                }
                lat.push(s.elapsed());
            }
            anyhow::Ok(lat)
        }));
    }
    let mut lat = Vec::new();
    for c in callers {
        lat.extend(c.await??);
    }
    let dt = t.elapsed().as_secs_f64();
    lat.sort();
    let pct = |q: f64| lat[((lat.len() as f64 - 1.0) * q) as usize].as_micros();
    Ok(Rate { ops: lat.len() as f64 / dt, p50_us: pct(0.5), p99_us: pct(0.99) })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    println!("load average at start: {}", load_average());
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("ufs/dir");
    std::fs::create_dir_all(&dir)?;
    for i in 0..args.dir_files {
        std::fs::write(dir.join(format!("sample-{i:08}.bin")), b"")?;
    }

    let config = MasterConfig {
        rpc_addr: "127.0.0.1:0".parse()?,
        http_addr: "127.0.0.1:0".parse()?,
        data_dir: tmp.path().join("master"),
        // The simulated workers report and go quiet: they must not be declared lost meanwhile.
        worker_timeout_ms: 24 * 3600 * 1000,
        metadata_cache_entries: args.dir_files * 2 + 1000,
        ..MasterConfig::default()
    };
    let master = Master::start(config, Arc::new(strata_ufs::OpendalFactory)).await?;
    let addr = master.rpc_addr.to_string();
    let admin_token = token(&tmp.path().join("master/admin.token"))?;
    let worker_token = token(&tmp.path().join("master/worker.token"))?;
    let mut admin = connect(&addr, &admin_token).await?;
    admin
        .add_mount(AddMountRequest {
            path: "/bench".into(),
            uri: format!("file://{}", tmp.path().join("ufs").display()),
            options: HashMap::from([("metadata_ttl".to_string(), "1h".to_string())]),
        })
        .await?;

    // ---- block reports ----
    let before = live();
    let t = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..args.workers {
        tasks.push(tokio::spawn(report(addr.clone(), worker_token.clone(), args.clone(), w)));
    }
    let mut entries = 0u64;
    for task in tasks {
        entries += task.await??;
    }
    let load_time = t.elapsed();
    let status = admin.status(strata_proto::Empty {}).await?.into_inner();
    let held: u64 = status.workers.iter().map(|w| w.blocks).sum();
    anyhow::ensure!(held == entries, "the master holds {held} of {entries} reported blocks");
    let bytes = live() - before;
    println!(
        "block reports: {} files x {} blocks = {} entries from {} workers in {:.1} s ({:.2} M entries/s), load {}",
        args.files,
        args.blocks,
        entries,
        args.workers,
        load_time.as_secs_f64(),
        entries as f64 / load_time.as_secs_f64() / 1e6,
        load_average()
    );
    println!(
        "master heap for them: {:.1} MiB = {:.1} bytes per (block, holder) entry (goal <= 64)",
        bytes as f64 / (1 << 20) as f64,
        bytes as f64 / entries as f64
    );

    // ---- stat ----
    let paths: Arc<Vec<String>> =
        Arc::new((0..args.dir_files).map(|i| format!("/bench/dir/sample-{i:08}.bin")).collect());
    let t = Instant::now();
    for p in paths.iter() {
        admin.stat(StatRequest { path: p.clone(), sync: false }).await?;
    }
    println!(
        "stat, first (cold: the UFS is asked), one caller: {:.0} ops/s",
        paths.len() as f64 / t.elapsed().as_secs_f64()
    );
    let mut channels = Vec::new();
    for _ in 0..args.connections.max(1) {
        channels.push(connect(&addr, &admin_token).await?);
    }
    let stat = rate(&channels, &args, paths.clone(), true).await?;
    let noop = rate(&channels, &args, paths.clone(), false).await?;
    println!(
        "stat, cached metadata, {} callers on {} connections: {:.0} ops/s (goal >= 33,000), p50 {} us, p99 {} us; \
         the same callers' ListMounts (an RPC that does no work, the ceiling): {:.0} ops/s; ratio {:.2}; load {}",
        args.callers,
        channels.len(),
        stat.ops,
        stat.p50_us,
        stat.p99_us,
        noop.ops,
        stat.ops / noop.ops,
        load_average()
    );

    // ---- listing ----
    let dir_files = args.dir_files;
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
    let t = Instant::now();
    let mut listers = Vec::new();
    for l in 0..args.listers.max(1) {
        let mut master = channels[l % channels.len()].clone();
        listers.push(tokio::spawn(async move {
            let (mut listed, mut rounds, mut fastest) = (0u64, 0u64, Duration::MAX);
            while Instant::now() < deadline {
                let round = Instant::now();
                let mut token = String::new();
                loop {
                    let page = master
                        .list(ListRequest {
                            path: "/bench/dir".into(),
                            sync: false,
                            page_token: token,
                            page_size: 0,
                        })
                        .await?
                        .into_inner();
                    listed += page.entries.len() as u64;
                    token = page.next_page_token;
                    if token.is_empty() {
                        break;
                    }
                }
                rounds += 1;
                fastest = fastest.min(round.elapsed());
            }
            anyhow::ensure!(listed == rounds * dir_files, "a listing missed entries");
            anyhow::Ok((listed, rounds, fastest))
        }));
    }
    let (mut listed, mut rounds, mut fastest) = (0u64, 0u64, Duration::MAX);
    for l in listers {
        let (n, r, f) = l.await??;
        (listed, rounds, fastest) = (listed + n, rounds + r, fastest.min(f));
    }
    println!(
        "list /bench/dir ({} entries, default pages of 1,000), {} listers: {:.0} entries/s over {} listings \
         (one listing alone at best {:.0} entries/s), load {}",
        args.dir_files,
        args.listers.max(1),
        listed as f64 / t.elapsed().as_secs_f64(),
        rounds,
        args.dir_files as f64 / fastest.as_secs_f64(),
        load_average()
    );

    master.shutdown().await;
    Ok(())
}
