//! Reads survive the master: an in-process cluster whose master is stopped while clients go on
//! reading. Time in the client (metadata TTL, the outage grace) is a `ManualClock`, moved past
//! the TTL and past the grace instead of slept through.

use std::time::Duration;

use strata_client::{Client, ClientConfig, ClientError};
use strata_common::ErrorKind;
use strata_common::clock::ManualClock;
use strata_testkit::{Cluster, ClusterOptions, eventually, pattern};

const MIB: usize = 1 << 20;

fn manual_client_config(cluster: &Cluster, clock: &std::sync::Arc<ManualClock>) -> ClientConfig {
    let mut config = cluster.client_config();
    config.clock = clock.clone();
    config.master_outage_grace = Duration::from_secs(300);
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cached_stats_and_listings_outlive_their_ttl_while_the_master_is_down_until_the_grace() {
    let mut cluster = Cluster::start(ClusterOptions::default()).await;
    let a = pattern(2 * MIB + 5, 1);
    let b = pattern(1000, 2);
    cluster.write_file("dir/a.bin", &a);
    cluster.write_file("dir/b.bin", &b);
    cluster.write_file("dir/sub/c.bin", &b);
    let clock = ManualClock::new();
    let client = Client::connect(manual_client_config(&cluster, &clock)).await.unwrap();
    assert_eq!(client.read_all("/data/dir/a.bin").await.unwrap(), a);
    assert_eq!(client.read_all("/data/dir/b.bin").await.unwrap(), b);
    let listing = client.list("/data/dir").await.unwrap();
    assert_eq!(listing.len(), 3);
    // A listing walked in pages of one is kept as well, and served in pages.
    let (first, next) = client.list_page("/data/dir", "", 1).await.unwrap();
    let (_, next) = client.list_page("/data/dir", &next.unwrap(), 1).await.unwrap();
    let (_, end) = client.list_page("/data/dir", &next.unwrap(), 1).await.unwrap();
    assert_eq!(end, None);
    let (found, _) = client.find_page("/data/dir", "", 0, 0).await.unwrap();
    assert_eq!(found.len(), 3);

    cluster.stop_master().await;
    // Past the mount's metadata TTL (60 s): every cached stat has expired.
    clock.advance(Duration::from_secs(61));
    let ufs_reads = cluster.ufs_reads();
    assert_eq!(client.read_all("/data/dir/a.bin").await.unwrap(), a);
    assert_eq!(client.read_all("/data/dir/b.bin").await.unwrap(), b);
    assert_eq!(client.list("/data/dir").await.unwrap(), listing);
    let (page, next) = client.list_page("/data/dir", "", 1).await.unwrap();
    assert_eq!(page, first);
    let (page2, _) = client.list_page("/data/dir", &next.unwrap(), 1).await.unwrap();
    assert_eq!(page2[0], listing[1], "the cache's own page tokens walk the same snapshot");
    assert_eq!(client.find_page("/data/dir", "", 0, 0).await.unwrap().0, found);
    assert_eq!(cluster.ufs_reads(), ufs_reads, "cached blocks, cached metadata: no UFS read");
    let counters = client.outage_counters();
    assert_eq!(counters.outages, 1, "{counters:?}");
    assert!(counters.stale_stats >= 2 && counters.stale_listings >= 4, "{counters:?}");

    // A path never seen: a worker stats it at the UFS, and a missing one is not found.
    let fresh = pattern(3000, 3);
    cluster.write_file("dir/new.bin", &fresh);
    assert_eq!(client.read_all("/data/dir/new.bin").await.unwrap(), fresh);
    assert_eq!(client.outage_counters().worker_stats, 1);
    let missing = client.stat("/data/dir/nope").await.unwrap_err();
    assert_eq!(missing.kind(), ErrorKind::NotFound, "{missing}");
    // A listing never seen whole cannot be made up.
    let unseen = client.list("/data/dir/sub").await.unwrap_err();
    assert!(unseen.is_master_outage(), "{unseen}");

    // Past the grace (300 s from the first failure, at 61 s): a clear error, for stats and
    // listings.
    clock.advance(Duration::from_secs(301));
    let Err(err) = client.read_all("/data/dir/a.bin").await else { panic!("a read past the grace") };
    assert!(matches!(err, ClientError::MasterUnavailable(_)), "{err:?}");
    assert!(err.to_string().contains("unreachable since") && err.to_string().contains("grace"), "{err}");
    let err = client.list("/data/dir").await.unwrap_err();
    assert!(err.to_string().contains("unreachable since"), "{err}");

    // The master comes back: the next probe finds it and metadata is fresh again.
    cluster.start_master().await;
    clock.advance(Duration::from_secs(3));
    eventually("the master answers again", Duration::from_secs(10), || async {
        clock.advance(Duration::from_secs(3));
        client.stat("/data/dir/a.bin").await.is_ok()
    })
    .await;
    assert_eq!(client.read_all("/data/dir/a.bin").await.unwrap(), a);
    assert_eq!(client.list("/data/dir").await.unwrap().len(), 4);
    assert_eq!(client.outage_counters().outages, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_answer_of_the_master_is_never_an_outage() {
    let cluster = Cluster::start(ClusterOptions::default()).await;
    cluster.write_file("x.bin", b"hello");
    let clock = ManualClock::new();
    let client = Client::connect(manual_client_config(&cluster, &clock)).await.unwrap();
    assert_eq!(&client.read_all("/data/x.bin").await.unwrap()[..], b"hello");
    std::fs::remove_file(cluster.ufs.dir().join("x.bin")).unwrap();
    clock.advance(Duration::from_secs(61));
    client.invalidate("/data/x.bin").await.unwrap();
    let err = client.stat("/data/x.bin").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    assert_eq!(client.outage_counters(), Default::default(), "not_found is an answer, not an outage");
}

/// A client whose master is unreachable at start, pointed at `workers`.
fn bootstrap_config(cluster: &Cluster, workers: Vec<String>) -> ClientConfig {
    let mut config = cluster.client_config();
    config.workers = workers;
    config.connect_timeout = Duration::from_millis(500);
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_client_starts_from_a_workers_view_and_reads_during_the_outage() {
    let mut cluster = Cluster::start(ClusterOptions::default()).await;
    let data = pattern(3 * MIB, 7);
    cluster.write_file("warm.bin", &data);
    let client = cluster.client().await;
    assert_eq!(client.read_all("/data/warm.bin").await.unwrap(), data);
    let worker = cluster.worker(1).data_addr.to_string();
    // The worker learns the mount added after it registered with its next heartbeats.
    let mut dead_master = bootstrap_config(&cluster, vec![worker.clone()]);
    dead_master.master_addr = "127.0.0.1:1".into();
    // And every worker: the last to register may be missing from the view an earlier one got
    // at registration until a heartbeat brings the new epoch.
    eventually("the worker's view has the mount and every worker", Duration::from_secs(10), || async {
        match Client::connect(dead_master.clone()).await {
            Ok(c) => {
                c.read_all("/data/warm.bin").await.is_ok()
                    && c.ring().await.is_ok_and(|r| r.members().len() == 3)
            }
            Err(_) => false,
        }
    })
    .await;

    cluster.stop_master().await;
    let ufs_reads = cluster.ufs_reads();
    let started = Client::connect(bootstrap_config(&cluster, vec![worker])).await.unwrap();
    assert_eq!(started.outage_counters().started_from_worker, 1);
    let ring = started.ring().await.unwrap();
    assert_eq!(ring.members().len(), 3, "the whole membership, from one worker: {:?}", ring.members());
    assert_eq!(started.read_all("/data/warm.bin").await.unwrap(), data);
    assert_eq!(cluster.ufs_reads(), ufs_reads, "served from the workers' caches");
    let err = started.list("/data").await.unwrap_err();
    assert!(err.is_master_outage(), "nothing listed yet: {err}");

    // Without workers to ask, the client fails at once as before, saying so.
    let err = Client::connect(bootstrap_config(&cluster, vec![])).await.err().unwrap();
    assert!(err.is_master_outage(), "{err}");
    let err = Client::connect(bootstrap_config(&cluster, vec!["127.0.0.1:1".into()])).await.err().unwrap();
    assert!(err.to_string().contains("no worker or sidecar gave its view"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_keeps_serving_without_the_master_and_rereports_every_block_when_it_returns() {
    let mut cluster = Cluster::start(ClusterOptions::default()).await;
    let files: Vec<(String, Vec<u8>)> = (0..12)
        .map(|i| {
            let data = pattern(MIB + 17 * i, 100 + i as u64);
            cluster.write_file(&format!("blocks/f{i}.bin"), &data);
            (format!("/data/blocks/f{i}.bin"), data)
        })
        .collect();
    let client = cluster.client().await;
    for (path, data) in &files {
        assert_eq!(&client.read_all(path).await.unwrap(), data);
    }
    cluster.flush().await;
    let total_blocks = files.iter().map(|(_, d)| d.len().div_ceil(MIB) as u64).sum::<u64>();
    // Settled: every block (and its NVMe copy, written back at the flush) reported, the count
    // unchanged over several heartbeats.
    let seen = std::sync::Mutex::new(Vec::new());
    eventually("every block is in the block map", Duration::from_secs(20), || {
        let client = client.clone();
        let seen = &seen;
        async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let blocks = client.admin().status().await.unwrap().blocks;
            let mut seen = seen.lock().unwrap();
            seen.push(blocks);
            let last = &seen[seen.len().saturating_sub(6)..];
            last.len() == 6 && last.iter().all(|&b| b == last[0] && b >= total_blocks)
        }
    })
    .await;
    let before = *seen.lock().unwrap().last().unwrap();

    cluster.stop_master().await;
    let ufs_reads = cluster.ufs_reads();
    for (path, data) in &files {
        assert_eq!(&client.read_all(path).await.unwrap(), data);
    }
    assert_eq!(cluster.ufs_reads(), ufs_reads, "the workers served their blocks without the master");

    // The same master (its redb state) comes back; workers re-register and report in full.
    cluster.start_master().await;
    cluster.wait_for_live_workers(3).await;
    let last = std::sync::atomic::AtomicU64::new(0);
    let complete = tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            if let Ok(s) = client.admin().status().await {
                last.store(s.blocks, std::sync::atomic::Ordering::Relaxed);
                if s.blocks == before {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let last = last.into_inner();
    assert!(complete.is_ok(), "the block map has {last} blocks, {before} before the master stopped");
    for (path, data) in &files {
        let locations = client.admin().block_locations(path).await.unwrap();
        assert_eq!(locations.blocks.len(), data.len().div_ceil(MIB), "{path}");
        assert!(locations.blocks.iter().all(|b| !b.replicas.is_empty()), "{path}: a block without a holder");
    }
}
