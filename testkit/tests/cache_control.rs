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

    let pin = client.admin().pin("/data/hot", PinTier::Nvme, None).await.unwrap();
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
    let pins = client.admin().pins().await.unwrap();
    assert_eq!(pins.iter().map(|p| p.path.as_str()).collect::<Vec<_>>(), ["/data/hot"]);

    // Unpinned, the files are evictable again: no tier passes over them any more. (Whether
    // pressure then evicts them is the policy's call: S3-FIFO keeps blocks read this often.)
    client.admin().unpin("/data/hot").await.unwrap();
    wait_for_pins(&cluster, 0).await;
    for i in 0..cluster.worker_count() {
        let w = cluster.worker(i);
        for tier in w.blocks.cache().tiers() {
            for (key, _) in tier.keys().into_iter().filter(|(k, _)| k.file.contains("/hot/")) {
                assert!(!w.pins.is_pinned(&key, tier.kind()), "{key} is still pinned on worker {i}");
            }
        }
    }
    let e = client.admin().unpin("/data/hot").await.unwrap_err();
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
            client
                .admin()
                .block_locations(path)
                .await
                .is_ok_and(|l| l.blocks.iter().any(|b| !b.replicas.is_empty()))
        })
        .await;
    }

    let freed = client.admin().free("/data/free", Duration::from_secs(20)).await.unwrap();
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
    let e = client.admin().pin("/data/big", PinTier::Memory, None).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ResourceExhausted, "{e}");
    assert!(e.to_string().contains("would pin more than"), "{e}");
    assert!(client.admin().pins().await.unwrap().is_empty(), "a refused pin leaves nothing");

    client.admin().pin("/data/big/f1.bin", PinTier::Memory, None).await.unwrap();
    let e = client.admin().free("/data/big", Duration::from_secs(5)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(e.to_string().contains("strata unpin /data/big/f1.bin"), "{e}");
    let e = client.admin().pin("/nowhere/x", PinTier::Nvme, None).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    let e = client.admin().pin("/data/big/missing", PinTier::Nvme, None).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");

    // A pin with a TTL lapses by itself.
    client.admin().pin("/data/big/f2.bin", PinTier::Nvme, Some(Duration::from_millis(300))).await.unwrap();
    eventually("the pin with a TTL expires", Duration::from_secs(20), || async {
        client.admin().pins().await.unwrap().iter().all(|p| p.path != "/data/big/f2.bin")
    })
    .await;
}

/// One worker with 1 s heartbeats (the default), DRAM and NVMe smaller than a scan.
fn one_worker() -> ClusterOptions {
    ClusterOptions {
        workers: 1,
        heartbeat_interval_ms: 1_000,
        memory_capacity: 4 * MIB as u64,
        nvme_capacity: 8 * MIB as u64,
        ..ClusterOptions::default()
    }
}

/// UFS bytes read of `rel` (relative to the mount's directory) so far.
fn ufs_bytes(cluster: &Cluster, rel: &str) -> u64 {
    cluster.range_reads().bytes_of(rel)
}

/// A pin is in force when `pin` returns (issue 42): twenty rounds of pinning a file not yet
/// cached, reading it at once, scanning twice the cache, and reading it again — no wait, no
/// flush anywhere — and the second read moves no UFS byte. Before, the worker learnt the pin
/// with its next heartbeat, a second later, after the scan had evicted the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pin_holds_what_is_read_the_moment_it_returns() {
    let cluster = Cluster::start(one_worker()).await;
    let cold = files(&cluster, "cold", 16, 500);
    let client = cluster.client().await;
    for round in 0..20 {
        let data = pattern(3 * MIB, round);
        cluster.write_file(&format!("hot{round}.bin"), &data);
        let (path, rel) = (format!("/data/hot{round}.bin"), format!("hot{round}.bin"));
        let pin = client.admin().pin(&path, PinTier::Nvme, None).await.unwrap();
        let applied = pin.applied.expect("a pin says where it is in force");
        assert_eq!((applied.workers, applied.workers_applied), (1, 1), "round {round}: {applied:?}");
        assert_eq!(client.read_all(&path).await.unwrap()[..], data[..]);
        assert_eq!(ufs_bytes(&cluster, &rel), 3 * MIB as u64);
        read_each(&client, &cold).await;
        assert_eq!(client.read_all(&path).await.unwrap()[..], data[..]);
        assert_eq!(ufs_bytes(&cluster, &rel), 3 * MIB as u64, "round {round}: the pinned file was evicted");
        // Unpinned (in force at once too), so that the pins never outgrow the tier.
        let unpinned = client.admin().unpin(&path).await.unwrap();
        assert_eq!(unpinned.applied.map(|a| a.workers_applied), Some(1));
        assert!(cluster.worker(0).pins.is_empty(), "the unpin is in force when it returns");
    }
    // The control: the same sequence without a pin loses the file to the scan.
    let data = pattern(3 * MIB, 99);
    cluster.write_file("control.bin", &data);
    client.read_all("/data/control.bin").await.unwrap();
    read_each(&client, &cold).await;
    client.read_all("/data/control.bin").await.unwrap();
    assert!(ufs_bytes(&cluster, "control.bin") > 3 * MIB as u64, "the scan evicts what is not pinned");
}

/// A worker that learns a pin moves what it holds of the path into the pinned tier before the
/// pin is reported in force: DRAM blocks not yet on NVMe are written there for an NVMe pin,
/// NVMe blocks are read into DRAM for a DRAM pin — so a scan right after evicts none of them.
/// (Writing DRAM blocks back when reads go quiet is turned off, so only the pin can move them.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pin_takes_in_what_the_worker_already_holds_in_either_tier() {
    use strata_worker::tier::TierKind::{self, Memory, Nvme};
    for case in ["dram, pinned on nvme", "nvme, pinned in dram", "dram, pinned in dram"] {
        let cluster = Cluster::start(ClusterOptions { nvme_capacity: 16 * MIB as u64, ..one_worker() }).await;
        let worker = cluster.worker(0);
        worker.blocks.cache().set_writeback_idle(Duration::from_secs(3600));
        let cold = files(&cluster, "cold", 24, 600);
        let client = cluster.client().await;
        let held_in = |kind: TierKind| {
            let tiers = worker.blocks.cache().tiers();
            let tier = tiers.iter().find(|t| t.kind() == kind).unwrap();
            tier.keys().iter().filter(|(k, _)| k.file.contains("/hot.bin")).count()
        };
        let data = pattern(2 * MIB, 1);
        cluster.write_file("hot.bin", &data);
        client.read_all("/data/hot.bin").await.unwrap();
        assert_eq!((held_in(Memory), held_in(Nvme)), (2, 0), "{case}: read into DRAM only");
        let tier = match case {
            "dram, pinned on nvme" => PinTier::Nvme,
            "nvme, pinned in dram" => {
                // DRAM evicts it (onto NVMe: it was dirty).
                read_each(&client, &cold[..6]).await;
                cluster.flush().await;
                assert_eq!((held_in(Memory), held_in(Nvme)), (0, 2), "{case}: on NVMe only");
                PinTier::Memory
            }
            _ => PinTier::Memory,
        };
        client.admin().pin("/data/hot.bin", tier, None).await.unwrap();
        let pinned_in = if tier == PinTier::Nvme { Nvme } else { Memory };
        assert_eq!(held_in(pinned_in), 2, "{case}: moved into the pinned tier before the pin answered");
        read_each(&client, &cold).await;
        cluster.flush().await;
        assert_eq!(held_in(pinned_in), 2, "{case}: kept through the scan");
        assert_eq!(client.read_all("/data/hot.bin").await.unwrap()[..], data[..]);
        assert_eq!(ufs_bytes(&cluster, "hot.bin"), 2 * MIB as u64, "{case}: no byte from the UFS again");
        if case == "dram, pinned in dram" {
            // A cache TTL is in force when `ttl set` returns, too.
            let ttl =
                client.admin().set_cache_ttl("/data/cold", Some(Duration::from_secs(3600))).await.unwrap();
            assert_eq!(ttl.applied.map(|a| (a.workers, a.workers_applied)), Some((1, 1)));
            assert!(worker.pins.has_cache_ttls());
        }
    }
}
