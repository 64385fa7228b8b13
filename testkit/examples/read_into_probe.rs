//! A warm 1 GiB file read whole through a one-worker cluster two ways: `read_range_of` (a new
//! buffer per call, what `read_all` does) and `read_into` a reused caller buffer (each block
//! received from the socket straight into its place), alternating over several rounds.
//!
//! ```sh
//! cargo run --release -p strata-testkit --example read_into_probe
//! ```
use std::time::Instant;

use futures::StreamExt;

use strata_testkit::{Cluster, ClusterOptions, pattern};

const MIB: u64 = 1 << 20;

#[tokio::main]
async fn main() {
    let size = 1024 * MIB;
    let opts = ClusterOptions {
        workers: 1,
        memory_capacity: 2 * size,
        mount_options: vec![("block_size".into(), "4MiB".into()), ("metadata_ttl".into(), "1h".into())],
        ..ClusterOptions::default()
    };
    let cluster = Cluster::start(opts).await;
    let data = pattern(size as usize, 4);
    cluster.write_file("r.bin", &data);
    let client = cluster.client().await;
    let info = client.stat("/data/r.bin").await.unwrap();
    let mut buf = vec![0u8; size as usize];
    client.read_into(&info, 0, &mut buf).await.unwrap();
    assert!(buf == data);
    let rate = |t: Instant| size as f64 / MIB as f64 / t.elapsed().as_secs_f64();
    for round in 0..4 {
        let t = Instant::now();
        assert_eq!(client.read_range_of(&info, 0, size).await.unwrap().len() as u64, size);
        let allocating = rate(t);
        let t = Instant::now();
        client.read_into(&info, 0, &mut buf).await.unwrap();
        let in_place = rate(t);
        // What read_range_of did before: blocks into their own buffers, copied into a new one.
        let t = Instant::now();
        let mut out = bytes::BytesMut::with_capacity(size as usize);
        let mut blocks = futures::stream::iter((0..size / (4 * MIB)).map(|i| {
            let (client, info) = (&client, &info);
            async move { client.read_range_of(info, i * 4 * MIB, 4 * MIB).await.unwrap() }
        }))
        .buffered(16);
        while let Some(b) = blocks.next().await {
            out.extend_from_slice(&b);
        }
        let copied = rate(t);
        drop(out);
        println!(
            "round {round}: read_range_of (new buffer) {allocating:.0} MiB/s, read_into (reused buffer) {in_place:.0} MiB/s, blocks copied into a new buffer {copied:.0} MiB/s"
        );
    }
    assert!(buf == data);
}
