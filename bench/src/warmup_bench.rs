//! Warmup benchmarks over an in-process cluster (3 workers).
//!
//! ```sh
//! source scripts/garage.sh && garage_start            # for s3; or export STRATA_TEST_S3_*
//! cargo run --release -p strata-bench --bin warmup_bench -- throughput s3 10000 1024
//! cargo run --release -p strata-bench --bin warmup_bench -- qos fs
//! ```
//!
//! `throughput UFS FILES MIB`: writes FILES small files (16 KiB) and one MIB-MiB file, reads
//! both straight from the UFS (opendal, 64 requests in flight for small files, 4 MiB ranges 16
//! in flight for the big one), then warms both up through Strata, and prints each rate and the
//! ratio warmup / direct.
//!
//! `qos UFS`: four readers re-read cached 256 KiB ranges of a hot set for a few seconds, first
//! alone, then while a warmup of a cold set runs; prints foreground p50/p99/max for both.

use std::time::{Duration, Instant};

use futures::StreamExt;
use rand::Rng;
use strata_bench::{direct_read, put_pattern_object};
use strata_client::{Client, JobState, LoadOptions};
use strata_testkit::{Cluster, ClusterOptions, TestUfs, fill_pattern};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn ufs_of(name: Option<&str>) -> TestUfs {
    match name {
        Some("s3") => TestUfs::s3(),
        _ => TestUfs::fs(),
    }
}

fn bytes(seed: u64, len: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len as usize];
    fill_pattern(seed, 0, &mut buf);
    buf
}

async fn put_many(op: &opendal::Operator, prefix: &str, n: u64, len: u64) {
    futures::stream::iter(0..n)
        .map(|i| {
            let op = op.clone();
            let path = format!("{prefix}/{:02}/f{i:05}.bin", i / 1000);
            async move { op.write(&path, bytes(i, len)).await.expect("write small file") }
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await;
}

async fn warm(client: &Client, path: &str, opts: LoadOptions) -> Duration {
    let started = Instant::now();
    let job = client.admin().submit_load(path, opts).await.expect("submit");
    let done = client.admin().wait_job(&job.id, Duration::from_millis(50), |_| {}).await.expect("job");
    assert_eq!(done.state(), JobState::Succeeded, "{done:?}");
    started.elapsed()
}

fn rate(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e6
}

async fn throughput(ufs: TestUfs, files: u64, big_mib: u64) {
    let name = ufs.name();
    let op = ufs.operator();
    let small = 16 * KIB;
    put_many(&op, "small", files, small).await;
    put_pattern_object(&op, "big.bin", big_mib * MIB, 7).await;

    // Direct reads from the UFS.
    let started = Instant::now();
    let lister = futures::stream::iter(0..files)
        .map(|i| {
            let op = op.clone();
            async move { op.read(&format!("small/{:02}/f{i:05}.bin", i / 1000)).await.expect("read").len() }
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await;
    let direct_small = started.elapsed();
    assert_eq!(lister.len() as u64, files);
    let size = big_mib * MIB;
    let direct_big = direct_read(&op, "big.bin", size, 4 * MIB, 16).await;

    let opts = ClusterOptions {
        workers: 3,
        memory_capacity: 512 * MIB,
        nvme_capacity: 4 << 30,
        mount_options: vec![("block_size".into(), "4MiB".into()), ("metadata_ttl".into(), "10m".into())],
        ..ClusterOptions::default()
    };
    let cluster = Cluster::start_with(opts, ufs).await;
    let client = cluster.client().await;
    let warm_small = warm(&client, "/data/small", LoadOptions { replicas: 1, ..Default::default() }).await;
    let warm_big = warm(&client, "/data/big.bin", LoadOptions { replicas: 1, ..Default::default() }).await;

    let small_bytes = files * small;
    println!("ufs {name}, 3 workers, block 4 MiB");
    println!(
        "{files} small files ({} KiB): direct {:.1} s ({:.0} files/s, {:.1} MB/s); warmup {:.1} s ({:.0} files/s, {:.1} MB/s); warmup/direct {:.2}",
        small / KIB,
        direct_small.as_secs_f64(),
        files as f64 / direct_small.as_secs_f64(),
        rate(small_bytes, direct_small),
        warm_small.as_secs_f64(),
        files as f64 / warm_small.as_secs_f64(),
        rate(small_bytes, warm_small),
        direct_small.as_secs_f64() / warm_small.as_secs_f64()
    );
    println!(
        "one {big_mib} MiB file: direct {:.1} s ({:.1} MB/s); warmup {:.1} s ({:.1} MB/s); warmup/direct {:.2}",
        direct_big.as_secs_f64(),
        rate(size, direct_big),
        warm_big.as_secs_f64(),
        rate(size, warm_big),
        direct_big.as_secs_f64() / warm_big.as_secs_f64()
    );
}

/// Latencies of 256 KiB reads of cached hot files by 4 readers for `d`.
async fn foreground(client: &Client, hot: &[String], d: Duration) -> Vec<Duration> {
    let deadline = Instant::now() + d;
    let readers = (0..4).map(|_| {
        let client = client.clone();
        let hot = hot.to_vec();
        tokio::spawn(async move {
            let mut lat = Vec::new();
            while Instant::now() < deadline {
                let (pick, block) = {
                    let mut rng = rand::rng();
                    (rng.random_range(0..hot.len()), rng.random_range(0..15u64))
                };
                let path = &hot[pick];
                let off = block * 256 * KIB;
                let t = Instant::now();
                client.read_range(path, off, 256 * KIB).await.expect("foreground read");
                lat.push(t.elapsed());
            }
            lat
        })
    });
    let mut all = Vec::new();
    for h in readers {
        all.extend(h.await.expect("reader"));
    }
    all.sort();
    all
}

fn pct(lat: &[Duration], p: f64) -> f64 {
    lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)].as_secs_f64() * 1e3
}

async fn qos(ufs: TestUfs) {
    let name = ufs.name();
    let opts = ClusterOptions {
        workers: 3,
        memory_capacity: 512 * MIB,
        nvme_capacity: 4 << 30,
        mount_options: vec![("block_size".into(), "1MiB".into()), ("metadata_ttl".into(), "10m".into())],
        ..ClusterOptions::default()
    };
    let cluster = Cluster::start_with(opts, ufs).await;
    let op = cluster.ufs.operator();
    let hot: Vec<String> = (0..32).map(|i| format!("hot/h{i}.bin")).collect();
    for (i, p) in hot.iter().enumerate() {
        op.write(p, bytes(i as u64, 4 * MIB)).await.expect("write hot");
    }
    put_many(&op, "cold", 600, MIB).await;
    let client = cluster.client().await;
    warm(&client, "/data/hot", LoadOptions::default()).await;
    let hot: Vec<String> = hot.iter().map(|p| format!("/data/{p}")).collect();

    let d = Duration::from_secs(6);
    let alone = foreground(&client, &hot, d).await;
    let job = client.admin().submit_load("/data/cold", LoadOptions::default()).await.expect("submit");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let with = foreground(&client, &hot, d).await;
    let progress = client.admin().job_status(&job.id).await.expect("status");
    let done = client.admin().wait_job(&job.id, Duration::from_millis(100), |_| {}).await.expect("job");
    println!("ufs {name}, 3 workers, 4 readers of cached 256 KiB ranges for {} s", d.as_secs());
    for (label, lat) in [("alone", &alone), ("with warmup", &with)] {
        println!(
            "  {label:<12} reads {:>6}  p50 {:.2} ms  p99 {:.2} ms  max {:.2} ms",
            lat.len(),
            pct(lat, 0.5),
            pct(lat, 0.99),
            lat.last().map_or(0.0, |l| l.as_secs_f64() * 1e3)
        );
    }
    println!(
        "  warmup meanwhile: {} of 600 MiB files loaded during the foreground window; job {:?}",
        progress.files_done,
        done.state()
    );
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("throughput") => {
            let files = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(10_000);
            let mib = args.get(3).and_then(|a| a.parse().ok()).unwrap_or(1024);
            throughput(ufs_of(args.get(1).map(String::as_str)), files, mib).await
        }
        Some("qos") => qos(ufs_of(args.get(1).map(String::as_str))).await,
        _ => eprintln!("usage: warmup_bench throughput [fs|s3] [FILES] [MIB] | qos [fs|s3]"),
    }
}
