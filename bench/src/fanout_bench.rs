//! `fanout_bench`: checkpoint load fan-out (issue 15). Many processes of a job load the same
//! large file at the same moment; through Strata the UFS should serve each block once, and the
//! readers together should get far more than the UFS alone gives.
//!
//! ```sh
//! source scripts/garage.sh && garage_ensure && garage_start      # exports STRATA_TEST_S3_*
//! cargo run --release -p strata-bench --bin fanout_bench                        # 1 GiB, 8 readers
//! cargo run --release -p strata-bench --bin fanout_bench -- --size 256MiB --readers 4
//! ```
//!
//! It writes two files of `--size` to the UFS and reads each straight from it with opendal
//! (`--block` ranges, `--direct-in-flight` at a time: the same-run ceiling), then starts an
//! in-process cluster (a master and `--workers` workers on 127.0.0.1) and measures:
//! - one reader of the first file, cold;
//! - `--readers` readers of the second file, cold, all starting together, each with its own
//!   `Client` (its own connections and stat cache, as separate processes have; here they are
//!   tasks of this process and share its runtime with the cluster);
//! - unless `--no-direct-fanout`, the same number of readers reading the second file straight
//!   from the UFS with opendal (no Strata: what the job does without a cache).
//!
//! Every Strata reader streams the file with `StrataReader::next_chunk` and checks its CRC32C
//! against the file's. For each, it prints the wall time (first request to last byte of the
//! last reader), the aggregate rate (bytes delivered to all readers / wall time), the ratio to
//! the direct read, the bytes the workers read from the UFS (their own counters) and how many
//! blocks the UFS served more than once, and the load average. `--json PATH` writes the same.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use strata_bench::load_average;

use clap::Parser;
use serde_json::{Value, json};
use strata_bench::{direct_read, put_pattern_object};
use strata_client::Client;
use strata_testkit::{Cluster, ClusterOptions, TestUfs, fill_pattern};

const MIB: u64 = 1 << 20;
const SINGLE: &str = "single.bin";
const FANOUT: &str = "fanout.bin";

fn size(s: &str) -> Result<u64, String> {
    strata_common::units::parse_size(s)
        .ok_or_else(|| format!("{s:?}: expected a size such as 1GiB or 256MiB"))
}

#[derive(Parser, Debug)]
#[command(
    name = "fanout_bench",
    about = "Checkpoint load fan-out: N readers of one cold file through Strata"
)]
struct Args {
    /// Under file system: `s3` (the endpoint in STRATA_TEST_S3_*, e.g. Garage from
    /// scripts/garage.sh) or `fs` (a temporary local directory).
    #[arg(long, default_value = "s3")]
    ufs: String,
    /// Size of each file (`1GiB`, `256MiB`, or bytes).
    #[arg(long, default_value = "1GiB", value_parser = size)]
    size: u64,
    /// Concurrent readers of the fan-out file, each with its own client.
    #[arg(long, default_value_t = 8)]
    readers: usize,
    /// Workers in the cluster.
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// Block size of the mount (also the range size of the direct reads).
    #[arg(long, default_value = "4MiB", value_parser = size)]
    block: u64,
    /// Ranges in flight of a direct opendal read (the ceiling, and each direct fan-out reader).
    #[arg(long, default_value_t = 8)]
    direct_in_flight: usize,
    /// Skip the direct fan-out baseline (it reads the object `--readers` times from the UFS).
    #[arg(long)]
    no_direct_fanout: bool,
    /// Write every figure as JSON to this file too.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn mib_s(bytes: u64, took: Duration) -> f64 {
    bytes as f64 / MIB as f64 / took.as_secs_f64()
}

/// CRC32C of `fill_pattern(seed, ..)` over `size` bytes: what every reader must get.
fn pattern_crc(seed: u64, size: u64) -> u32 {
    let mut buf = vec![0u8; (16 * MIB) as usize];
    let (mut crc, mut off) = (0u32, 0u64);
    while off < size {
        let n = (16 * MIB).min(size - off) as usize;
        fill_pattern(seed, off, &mut buf[..n]);
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        off += n as u64;
    }
    crc
}

/// What the UFS served to the workers: their own counters, and the blocks of `rel` the UFS
/// served more than once (the harness counts reads per range).
#[derive(Debug, Clone, Copy, Default)]
struct UfsRead {
    bytes: u64,
    reads: u64,
}

fn ufs_read(cluster: &Cluster) -> UfsRead {
    let mut total = UfsRead::default();
    for i in 0..cluster.worker_count() {
        let c = cluster.worker(i).blocks.counters();
        total.bytes += c.ufs_bytes_read;
        total.reads += c.ufs_reads;
    }
    total
}

fn blocks_read_twice(cluster: &Cluster, rel: &str) -> usize {
    cluster.range_reads().of(rel).iter().filter(|(_, n)| *n > 1).count()
}

/// One reader: the whole file through a `StrataReader`, each block as it comes, checked.
async fn read_whole(client: &Client, path: &str, size: u64, crc: u32) -> Duration {
    let started = Instant::now();
    let mut reader = client.open(path).await.expect("open");
    let (mut got, mut sum) = (0u64, 0u32);
    while let Some(chunk) = reader.next_chunk().await.expect("read") {
        sum = crc32c::crc32c_append(sum, &chunk);
        got += chunk.len() as u64;
    }
    assert_eq!(got, size, "{path}: short read");
    assert_eq!(sum, crc, "{path}: the bytes differ from the file's");
    started.elapsed()
}

/// A measured figure.
struct Row {
    name: String,
    readers: usize,
    wall: Duration,
    /// Each reader's own time, shortest and longest.
    per_reader: (Duration, Duration),
    /// Bytes delivered to all readers.
    delivered: u64,
    ceiling: f64,
    ufs_bytes: u64,
    ufs_reads: u64,
    blocks_read_twice: Option<usize>,
    load: String,
}

impl Row {
    fn aggregate(&self) -> f64 {
        mib_s(self.delivered, self.wall)
    }

    fn json(&self) -> Value {
        json!({
            "name": self.name, "readers": self.readers, "wall_s": self.wall.as_secs_f64(),
            "reader_min_s": self.per_reader.0.as_secs_f64(), "reader_max_s": self.per_reader.1.as_secs_f64(),
            "aggregate_mib_s": self.aggregate(), "ceiling_mib_s": self.ceiling,
            "ratio": self.aggregate() / self.ceiling, "ufs_bytes_read": self.ufs_bytes,
            "ufs_reads": self.ufs_reads, "blocks_read_twice": self.blocks_read_twice,
            "load_average_after": self.load,
        })
    }
}

/// `readers` each run `read` at the same moment; the wall time runs from their common start to
/// the last one's end.
async fn together<F, Fut>(readers: usize, read: F) -> (Duration, (Duration, Duration))
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Duration> + Send + 'static,
{
    let start = Arc::new(tokio::sync::Barrier::new(readers + 1));
    let tasks: Vec<_> = (0..readers)
        .map(|i| {
            let start = start.clone();
            let read = read(i);
            tokio::spawn(async move {
                start.wait().await;
                read.await
            })
        })
        .collect();
    start.wait().await;
    let started = Instant::now();
    let mut times = Vec::new();
    for t in tasks {
        times.push(t.await.expect("reader"));
    }
    let wall = started.elapsed();
    let min = times.iter().min().copied().unwrap_or_default();
    let max = times.iter().max().copied().unwrap_or_default();
    (wall, (min, max))
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    assert!(args.readers > 0, "--readers must be at least 1");
    let size = args.size;
    let ufs = match args.ufs.as_str() {
        "s3" => TestUfs::s3(),
        "fs" => TestUfs::fs(),
        other => panic!("--ufs {other}: expected s3 or fs"),
    };
    let load_at_start = load_average();
    eprintln!("load average at start: {load_at_start}");

    eprintln!("writing two {} MiB files to the UFS ({})", size / MIB, ufs.name());
    let op = ufs.operator();
    put_pattern_object(&op, SINGLE, size, 1).await;
    put_pattern_object(&op, FANOUT, size, 2).await;
    let (single_crc, fanout_crc) = (pattern_crc(1, size), pattern_crc(2, size));

    eprintln!("ceiling: direct opendal reads of both objects ({} in flight)", args.direct_in_flight);
    let direct_single = mib_s(size, direct_read(&op, SINGLE, size, args.block, args.direct_in_flight).await);
    let direct_fanout = mib_s(size, direct_read(&op, FANOUT, size, args.block, args.direct_in_flight).await);
    let ceiling_name = format!("direct opendal read of the same object, {} in flight", args.direct_in_flight);

    let opts = ClusterOptions {
        workers: args.workers,
        memory_capacity: size + 256 * MIB,
        nvme_capacity: 2 * size + 256 * MIB,
        mount_options: vec![
            ("block_size".into(), format!("{}", args.block)),
            ("metadata_ttl".into(), "1h".into()),
        ],
        ..ClusterOptions::default()
    };
    let cluster = Cluster::start_with(opts, ufs).await;
    let mut rows = Vec::new();

    eprintln!("strata: one reader of a cold file");
    let client = cluster.client().await;
    let before = ufs_read(&cluster);
    let (wall, per_reader) = together(1, |_| {
        let client = client.clone();
        async move { read_whole(&client, &format!("/data/{SINGLE}"), size, single_crc).await }
    })
    .await;
    let after = ufs_read(&cluster);
    rows.push(Row {
        name: "1 reader, cold".into(),
        readers: 1,
        wall,
        per_reader,
        delivered: size,
        ceiling: direct_single,
        ufs_bytes: after.bytes - before.bytes,
        ufs_reads: after.reads - before.reads,
        blocks_read_twice: Some(blocks_read_twice(&cluster, SINGLE)),
        load: load_average(),
    });
    // The blocks it fetched go to NVMe once reads are quiet: not during the next figure.
    cluster.flush().await;

    eprintln!("strata: {} readers of another cold file, each with its own client", args.readers);
    let mut clients = Vec::new();
    for _ in 0..args.readers {
        clients.push(Client::connect(cluster.client_config()).await.expect("client connects"));
    }
    let before = ufs_read(&cluster);
    let (wall, per_reader) = together(args.readers, |i| {
        let client = clients[i].clone();
        async move { read_whole(&client, &format!("/data/{FANOUT}"), size, fanout_crc).await }
    })
    .await;
    let after = ufs_read(&cluster);
    let failovers: u64 = clients.iter().map(Client::failovers).sum();
    rows.push(Row {
        name: format!("{} readers, cold, separate clients", args.readers),
        readers: args.readers,
        wall,
        per_reader,
        delivered: size * args.readers as u64,
        ceiling: direct_fanout,
        ufs_bytes: after.bytes - before.bytes,
        ufs_reads: after.reads - before.reads,
        blocks_read_twice: Some(blocks_read_twice(&cluster, FANOUT)),
        load: load_average(),
    });
    cluster.flush().await;

    if !args.no_direct_fanout {
        eprintln!("baseline: {} readers straight from the UFS (no Strata)", args.readers);
        let (wall, per_reader) = together(args.readers, |_| {
            let (op, block, in_flight) = (op.clone(), args.block, args.direct_in_flight);
            async move { direct_read(&op, FANOUT, size, block, in_flight).await }
        })
        .await;
        rows.push(Row {
            name: format!("{} readers straight from the UFS (opendal, no Strata)", args.readers),
            readers: args.readers,
            wall,
            per_reader,
            delivered: size * args.readers as u64,
            ceiling: direct_fanout,
            ufs_bytes: size * args.readers as u64,
            ufs_reads: size.div_ceil(args.block) * args.readers as u64,
            blocks_read_twice: None,
            load: load_average(),
        });
    }

    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "fanout_bench: ufs {}, {} worker(s), {} MiB files, {} MiB blocks, {cores} cores; load average at start {load_at_start}",
        args.ufs,
        args.workers,
        size / MIB,
        args.block / MIB,
    );
    println!(
        "ceiling: {ceiling_name}: {direct_single:.0} MiB/s (first file), {direct_fanout:.0} MiB/s (second)"
    );
    println!("client failovers during the fan-out: {failovers}");
    println!();
    println!(
        "| figure | wall | per reader (min–max) | aggregate | ceiling | ratio | UFS bytes read (× file) | blocks from the UFS twice | load after |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in &rows {
        println!(
            "| {} | {:.2} s | {:.2}–{:.2} s | {:.0} MiB/s | {:.0} MiB/s | {:.2}x | {} MiB ({:.2}×, {} reads) | {} | {} |",
            r.name,
            r.wall.as_secs_f64(),
            r.per_reader.0.as_secs_f64(),
            r.per_reader.1.as_secs_f64(),
            r.aggregate(),
            r.ceiling,
            r.aggregate() / r.ceiling,
            r.ufs_bytes / MIB,
            r.ufs_bytes as f64 / size as f64,
            r.ufs_reads,
            r.blocks_read_twice.map_or("-".into(), |n| n.to_string()),
            r.load,
        );
    }
    if let Some(path) = &args.json {
        let out = json!({
            "ufs": args.ufs, "workers": args.workers, "size": size, "block": args.block,
            "readers": args.readers, "cores": cores, "load_average_at_start": load_at_start,
            "ceiling": ceiling_name, "direct_single_mib_s": direct_single,
            "direct_fanout_mib_s": direct_fanout, "failovers": failovers,
            "rows": rows.iter().map(Row::json).collect::<Vec<_>>(),
        });
        std::fs::write(path, serde_json::to_string_pretty(&out).expect("json")).expect("write --json");
    }
}
