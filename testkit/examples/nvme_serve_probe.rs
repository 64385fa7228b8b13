//! What serving NVMe blocks from their files (`sendfile`, `zero_copy = true`) moves against
//! reading and checking them through memory (`zero_copy = false`): a one-worker cluster with no
//! DRAM tier, a 1 GiB file on a local UFS read once to fill NVMe, then read again sequentially
//! (4 MiB blocks, 8 in flight) and as random 64 KiB ranges (8 in flight), alternating the two
//! modes over several rounds. The block files stay in the page cache (warm NVMe).
//!
//! ```sh
//! cargo run --release -p strata-testkit --example nvme_serve_probe
//! ```
use std::time::Instant;

use futures::StreamExt;
use rand::Rng;
use strata_testkit::{Cluster, ClusterOptions, pattern};

const MIB: u64 = 1 << 20;

#[tokio::main]
async fn main() {
    let size = 1024 * MIB;
    let opts = ClusterOptions {
        workers: 1,
        memory_capacity: 0,
        nvme_capacity: 2 * size,
        mount_options: vec![("block_size".into(), "4MiB".into()), ("metadata_ttl".into(), "1h".into())],
        ..ClusterOptions::default()
    };
    let cluster = Cluster::start(opts).await;
    cluster.write_file("n.bin", &pattern(size as usize, 3));
    let client = cluster.client().await;
    let info = client.stat("/data/n.bin").await.unwrap();
    assert_eq!(client.read_all("/data/n.bin").await.unwrap().len() as u64, size);
    cluster.flush().await;
    let store = cluster.worker(0).blocks.cache();
    for round in 0..3 {
        for zero_copy in [true, false] {
            store.set_zero_copy(zero_copy);
            let t = Instant::now();
            futures::stream::iter(0..size / (4 * MIB))
                .map(|i| {
                    let (client, info) = (&client, &info);
                    async move { client.read_range_of(info, i * 4 * MIB, 4 * MIB).await.unwrap().len() }
                })
                .buffered(8)
                .for_each(|_| async {})
                .await;
            let seq = size as f64 / MIB as f64 / t.elapsed().as_secs_f64();
            let n = 4000u64;
            let offsets: Vec<u64> = (0..n).map(|_| rand::rng().random_range(0..size - 65536)).collect();
            let t = Instant::now();
            futures::stream::iter(offsets)
                .map(|o| {
                    let (client, info) = (&client, &info);
                    async move { client.read_range_of(info, o, 65536).await.unwrap().len() }
                })
                .buffered(8)
                .for_each(|_| async {})
                .await;
            let ops = n as f64 / t.elapsed().as_secs_f64();
            println!(
                "round {round} zero_copy={zero_copy:<5}: sequential 4 MiB x8 {seq:.0} MiB/s, random 64 KiB x8 {ops:.0} ops/s"
            );
        }
    }
}
