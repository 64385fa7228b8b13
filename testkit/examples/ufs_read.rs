//! Read throughput of one large object: straight from the UFS with opendal, then through a
//! one-worker Strata cluster cold and warm, in one run.
//!
//! ```sh
//! source scripts/garage.sh && garage_start      # or export STRATA_TEST_S3_* yourself
//! cargo run --release -p strata-testkit --example ufs_read -- s3 1024   # UFS, MiB
//! ```

use std::time::Instant;

use futures::StreamExt;
use strata_testkit::{Cluster, ClusterOptions, TestUfs, fill_pattern};
use tokio::io::AsyncReadExt;

const MIB: u64 = 1 << 20;

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let ufs = match args.next().as_deref() {
        Some("fs") => TestUfs::fs(),
        _ => TestUfs::s3(),
    };
    let mib: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(1024);
    let size = mib * MIB;
    let name = ufs.name();

    let op = ufs.operator();
    eprintln!("writing {mib} MiB to {name}");
    let mut writer = op.writer_with("big.bin").chunk(16 << 20).await.expect("writer");
    let mut off = 0;
    while off < size {
        let mut buf = vec![0u8; (16 * MIB).min(size - off) as usize];
        fill_pattern(1, off, &mut buf);
        off += buf.len() as u64;
        writer.write(buf).await.expect("write");
    }
    writer.close().await.expect("close");

    // Direct: 4 MiB ranges, 4 in flight (what a tuned client of the store would do).
    eprintln!("reading it directly");
    let started = Instant::now();
    let n: u64 = StreamExt::buffered(
        futures::stream::iter((0..size).step_by(4 << 20).map(|start| {
            let op = op.clone();
            async move {
                let end = (start + (4 << 20)).min(size);
                op.read_with("big.bin").range(start..end).await.expect("range read").len() as u64
            }
        })),
        4,
    )
    .fold(0u64, |acc, n| async move { acc + n })
    .await;
    assert_eq!(n, size);
    let direct = started.elapsed();
    eprintln!("reading it through strata");

    let opts = ClusterOptions {
        workers: 1,
        memory_capacity: size + 64 * MIB,
        nvme_capacity: 2 * size,
        mount_options: vec![("block_size".into(), "4MiB".into()), ("metadata_ttl".into(), "10m".into())],
        ..ClusterOptions::default()
    };
    let cluster = Cluster::start_with(opts, ufs).await;
    let client = cluster.client().await;
    let read = || {
        let client = client.clone();
        async move {
            let started = Instant::now();
            let mut reader = client.open("/data/big.bin").await.expect("open");
            let mut buf = vec![0u8; 8 << 20];
            let mut total = 0u64;
            loop {
                let k = reader.read(&mut buf).await.expect("read");
                if k == 0 {
                    break;
                }
                total += k as u64;
            }
            assert_eq!(total, size);
            started.elapsed()
        }
    };
    let cold = read().await;
    let warm = read().await;
    let warm2 = read().await;
    let rate = |d: std::time::Duration| size as f64 / MIB as f64 / d.as_secs_f64();
    println!("{mib} MiB object on {name}, one worker, 4 MiB blocks, readahead 4");
    println!("| read | seconds | MiB/s | vs direct |");
    println!("| --- | --- | --- | --- |");
    for (label, d) in [
        ("direct opendal", direct),
        ("strata cold", cold),
        ("strata warm", warm),
        ("strata warm again", warm2),
    ] {
        println!("| {label} | {:.2} | {:.0} | {:.2}x |", d.as_secs_f64(), rate(d), rate(d) / rate(direct));
    }
}
