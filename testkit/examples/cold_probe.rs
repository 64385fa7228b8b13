//! Where the time of a cold read goes, step by step, on the S3 named by STRATA_TEST_S3_*: direct
//! opendal 4 MiB ranges, the worker's own UFS read (`OpendalUfs::read_range`: If-Match, one
//! contiguous buffer), and cold 4 MiB blocks through a one-worker cluster, each at 1/4/8 in
//! flight. `--no-nvme` gives the worker no NVMe tier, to see what filling it costs;
//! `--write-through` writes each fetched block to NVMe at once instead of writing it back
//! later (the default).
//!
//! ```sh
//! source scripts/garage.sh && garage_start
//! cargo run --release -p strata-testkit --example cold_probe [-- --no-nvme | --write-through]
//! ```
use std::time::Instant;

use futures::StreamExt;
use strata_testkit::{Cluster, ClusterOptions, TestUfs, fill_pattern};
use strata_ufs::{OpendalUfs, Ufs};

const MIB: u64 = 1 << 20;

#[tokio::main]
async fn main() {
    let ufs = TestUfs::s3();
    let size = 256 * MIB;
    let op = ufs.operator();
    let mut w = op.writer_with("p.bin").chunk(16 << 20).await.unwrap();
    let mut off = 0;
    while off < size {
        let mut buf = vec![0u8; (16 * MIB) as usize];
        fill_pattern(1, off, &mut buf);
        off += buf.len() as u64;
        w.write(buf).await.unwrap();
    }
    w.close().await.unwrap();
    let options = ufs.mount_options().into_iter().collect();
    let u = OpendalUfs::open(&ufs.uri(), &options).unwrap();
    let version = u.stat("p.bin").await.unwrap().version;
    for inflight in [1usize, 4, 8] {
        let t = Instant::now();
        futures::stream::iter((0..size).step_by(4 << 20))
            .map(|s| {
                let op = op.clone();
                async move { op.read_with("p.bin").range(s..s + (4 << 20)).await.unwrap().to_bytes().len() }
            })
            .buffered(inflight)
            .for_each(|_| async {})
            .await;
        let direct = size as f64 / MIB as f64 / t.elapsed().as_secs_f64();
        let t = Instant::now();
        futures::stream::iter((0..size).step_by(4 << 20))
            .map(|s| {
                let (u, v) = (&u, &version);
                async move { u.read_range("p.bin", s..s + (4 << 20), v).await.unwrap().len() }
            })
            .buffered(inflight)
            .for_each(|_| async {})
            .await;
        let ufs_rate = size as f64 / MIB as f64 / t.elapsed().as_secs_f64();
        println!(
            "in flight {inflight}: direct {direct:.0} MiB/s, OpendalUfs::read_range {ufs_rate:.0} MiB/s"
        );
    }

    // Through a one-worker cluster: cold 4 MiB blocks at 1, 4 and 8 in flight (a fresh third of
    // the object each time), then the same reader path the benchmark uses.
    let opts = ClusterOptions {
        workers: 1,
        memory_capacity: 2 * size,
        nvme_capacity: if std::env::args().any(|a| a == "--no-nvme") { 0 } else { 2 * size },
        mount_options: vec![("block_size".into(), "4MiB".into()), ("metadata_ttl".into(), "1h".into())],
        ..ClusterOptions::default()
    };
    let cluster = Cluster::start_with(opts, ufs).await;
    if std::env::args().any(|a| a == "--write-through") {
        cluster.worker(0).blocks.cache().set_writeback_idle(std::time::Duration::ZERO);
    }
    let client = cluster.client().await;
    let info = client.stat("/data/p.bin").await.unwrap();
    let blocks = size / (4 << 20);
    for (inflight, range) in [(1usize, 0..blocks / 4), (4, blocks / 4..blocks / 2), (8, blocks / 2..blocks)] {
        let n = range.end - range.start;
        let t = Instant::now();
        futures::stream::iter(range)
            .map(|i| {
                let (client, info) = (&client, &info);
                async move { client.read_range_of(info, i * (4 << 20), 4 << 20).await.unwrap().len() }
            })
            .buffered(inflight)
            .for_each(|_| async {})
            .await;
        let rate = (n * 4) as f64 / t.elapsed().as_secs_f64();
        println!("strata cold blocks, in flight {inflight}: {rate:.0} MiB/s");
    }
}
