//! Cache control on an in-process cluster: pins hold blocks through pressure, a worker restart
//! and a master restart; `free` drops blocks without moving a UFS byte; what cannot be done is
//! refused clearly (a pin beyond the tier's capacity, a free of a pinned path).

use std::time::Duration;

use strata_client::{Client, PinTier};
use strata_common::ErrorKind;
use strata_testkit::{Cluster, ClusterOptions, eventually, pattern};

const MIB: usize = 1 << 20;

fn small_cluster() -> ClusterOptions {
    ClusterOptions {
        workers: 2,
        memory_capacity: 4 * MIB as u64,
        nvme_capacity: 12 * MIB as u64,
        ..ClusterOptions::default()
    }
}

/// Writes `n` files of one block each under `dir`; returns their paths and bytes.
fn files(cluster: &Cluster, dir: &str, n: usize, seed: u64) -> Vec<(String, Vec<u8>)> {
    (0..n)
        .map(|i| {
            let data = pattern(MIB - 100, seed + i as u64);
            cluster.write_file(&format!("{dir}/f{i}.bin"), &data);
            (format!("/data/{dir}/f{i}.bin"), data)
        })
        .collect()
}

async fn read_each(client: &Client, files: &[(String, Vec<u8>)]) {
    for (path, data) in files {
        let got = client.read_all(path).await.unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!(got[..], data[..], "{path}");
    }
}

async fn wait_for_pins(cluster: &Cluster, n: usize) {
    eventually("every worker applies the pins", Duration::from_secs(20), || async {
        (0..cluster.worker_count()).all(|i| cluster.worker(i).pins.len() == n)
    })
    .await;
}

/// Reads three times the cluster's whole cache of other files, then flushes NVMe writes.
async fn pressure(cluster: &Cluster, client: &Client, cold: &[(String, Vec<u8>)]) {
    read_each(client, cold).await;
    cluster.flush().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pinned_files_stay_cached_through_pressure_and_restarts() {
    let mut cluster = Cluster::start(small_cluster()).await;
    let hot = files(&cluster, "hot", 4, 1);
    let cold = files(&cluster, "cold", 48, 100);
    let client = cluster.client().await;

    let pin = client.pin("/data/hot", PinTier::Nvme, None).await.unwrap();
    eprintln!("pinned");
    assert_eq!(pin.bytes, 4 * (MIB as u64 - 100), "the pin knows what it holds");
    wait_for_pins(&cluster, 1).await;
    read_each(&client, &hot).await;
    cluster.flush().await;

    pressure(&cluster, &client, &cold).await;
    let before = cluster.ufs_reads();
    read_each(&client, &hot).await;
    assert_eq!(cluster.ufs_reads(), before, "pinned files were evicted under pressure");

    // The control: an unpinned file of the same size is gone after the same pressure.
    let probe = &cold[0];
    pressure(&cluster, &client, &cold[1..]).await;
    let before = cluster.ufs_reads();
    read_each(&client, std::slice::from_ref(probe)).await;
    assert_eq!(cluster.ufs_reads(), before + 1, "pressure evicts what is not pinned");

    eprintln!("restarting a worker");
    // A restarted worker recovers its NVMe blocks and learns the pins again.
    cluster.restart_worker(0).await;
    wait_for_pins(&cluster, 1).await;
    client.refresh_view().await.unwrap();
    pressure(&cluster, &client, &cold).await;
    let before = cluster.ufs_reads();
    read_each(&client, &hot).await;
    assert_eq!(cluster.ufs_reads(), before, "pins hold across a worker restart");

    eprintln!("restarting the master");
    // The pin is durable on the master.
    cluster.stop_master().await;
    cluster.start_master().await;
    cluster.wait_for_live_workers(2).await;
    let client = cluster.client().await;
    let pins = client.pins().await.unwrap();
    assert_eq!(pins.iter().map(|p| p.path.as_str()).collect::<Vec<_>>(), ["/data/hot"]);

    // Unpinned, the files are evictable again: no tier passes over them any more. (Whether
    // pressure then evicts them is the policy's call: S3-FIFO keeps blocks read this often.)
    client.unpin("/data/hot").await.unwrap();
    wait_for_pins(&cluster, 0).await;
    for i in 0..cluster.worker_count() {
        let w = cluster.worker(i);
        for tier in w.blocks.cache().tiers() {
            for (key, _) in tier.keys().into_iter().filter(|(k, _)| k.file.contains("/hot/")) {
                assert!(!w.pins.is_pinned(&key, tier.kind()), "{key} is still pinned on worker {i}");
            }
        }
    }
    let e = client.unpin("/data/hot").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn free_drops_cached_blocks_and_moves_no_ufs_byte_until_they_are_read() {
    let cluster = Cluster::start(small_cluster()).await;
    let data = files(&cluster, "free", 3, 7);
    let kept = files(&cluster, "kept", 2, 70);
    let client = cluster.client().await;
    read_each(&client, &data).await;
    read_each(&client, &kept).await;
    assert_eq!(cluster.ufs_reads(), 5);
    // The block map hears of cached blocks at the workers' next heartbeats.
    for (path, _) in &data {
        eventually("the block map lists the block", Duration::from_secs(20), || async {
            client.block_locations(path).await.is_ok_and(|l| l.blocks.iter().any(|b| !b.replicas.is_empty()))
        })
        .await;
    }

    let freed = client.free("/data/free", Duration::from_secs(20)).await.unwrap();
    assert!(freed.blocks >= 3, "{freed:?}");
    assert_eq!((freed.workers, freed.workers_done), (2, 2), "{freed:?}");
    assert_eq!(cluster.ufs_reads(), 5, "a free reads nothing");
    for i in 0..cluster.worker_count() {
        let held = cluster.worker(i).blocks.cache().tiers().iter().flat_map(|t| t.keys()).count();
        let kept_here = cluster
            .worker(i)
            .blocks
            .cache()
            .tiers()
            .iter()
            .flat_map(|t| t.keys())
            .filter(|(k, _)| k.file.contains("/kept/"))
            .count();
        assert_eq!(held, kept_here, "worker {i} still holds freed blocks");
    }
    read_each(&client, &kept).await;
    assert_eq!(cluster.ufs_reads(), 5, "what was not freed stays cached");
    read_each(&client, &data).await;
    assert_eq!(cluster.ufs_reads(), 8, "freed blocks come back from the UFS when read again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn what_cannot_be_done_is_refused_clearly() {
    let cluster = Cluster::start(small_cluster()).await;
    let _big = files(&cluster, "big", 10, 3);
    let client = cluster.client().await;
    // 10 MiB into 2 × 4 MiB of DRAM.
    let e = client.pin("/data/big", PinTier::Memory, None).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ResourceExhausted, "{e}");
    assert!(e.to_string().contains("would pin more than"), "{e}");
    assert!(client.pins().await.unwrap().is_empty(), "a refused pin leaves nothing");

    client.pin("/data/big/f1.bin", PinTier::Memory, None).await.unwrap();
    let e = client.free("/data/big", Duration::from_secs(5)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(e.to_string().contains("strata unpin /data/big/f1.bin"), "{e}");
    let e = client.pin("/nowhere/x", PinTier::Nvme, None).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    let e = client.pin("/data/big/missing", PinTier::Nvme, None).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");

    // A pin with a TTL lapses by itself.
    client.pin("/data/big/f2.bin", PinTier::Nvme, Some(Duration::from_millis(300))).await.unwrap();
    eventually("the pin with a TTL expires", Duration::from_secs(20), || async {
        client.pins().await.unwrap().iter().all(|p| p.path != "/data/big/f2.bin")
    })
    .await;
}
