//! Reads of a `read_replicas=2` mount on an in-process cluster of three workers: they spread over
//! a block's first two ring owners (power of two choices), a replica that misses takes the block
//! from its peer rather than the UFS, a client with `node` set reads from the replica on its own
//! node, and `locate` says which workers and nodes hold a path.

use std::collections::HashMap;
use std::time::Duration;

use strata_client::{Client, JobState, LoadOptions};
use strata_common::{BlockKey, ErrorKind};
use strata_testkit::{Cluster, ClusterOptions, eventually, pattern};

/// Every file is exactly one block, so a worker's bytes served count its block reads.
const BLOCK: usize = 256 << 10;

fn options(nodes: &[&str]) -> ClusterOptions {
    ClusterOptions {
        mount_options: vec![
            ("block_size".into(), "256KiB".into()),
            ("metadata_ttl".into(), "5m".into()),
            ("read_replicas".into(), "2".into()),
        ],
        nodes: nodes.iter().map(|n| n.to_string()).collect(),
        ..ClusterOptions::default()
    }
}

/// A one-block file and its block's owners in ring order (worker indices in the cluster).
struct Placed {
    path: String,
    data: Vec<u8>,
    owners: Vec<usize>,
}

/// Writes `n` one-block files under `dir` and places each on the client's ring.
async fn place(cluster: &Cluster, client: &Client, dir: &str, n: usize) -> Vec<Placed> {
    let index: HashMap<String, usize> =
        (0..cluster.worker_count()).map(|i| (cluster.worker(i).worker_id.clone(), i)).collect();
    let ring = client.ring().await.unwrap();
    assert_eq!(ring.members().len(), cluster.worker_count());
    let mut out = Vec::new();
    for i in 0..n {
        let data = pattern(BLOCK, 1_000 + i as u64);
        cluster.write_file(&format!("{dir}/f{i}.bin"), &data);
        let path = format!("/data/{dir}/f{i}.bin");
        let info = client.stat(&path).await.unwrap();
        let hash = BlockKey::new(info.file_id, info.version, 0).placement_hash();
        let owners = ring.owners(hash, 3).iter().map(|m| index[&m.id]).collect();
        out.push(Placed { path, data, owners });
    }
    out
}

fn served(cluster: &Cluster) -> Vec<u64> {
    (0..cluster.worker_count()).map(|i| cluster.worker(i).blocks.counters().bytes_served).collect()
}

fn upstream_reads(cluster: &Cluster, i: usize) -> u64 {
    cluster.worker(i).blocks.counters().upstream_reads
}

/// `rounds` passes over `files` by each of `readers` concurrent tasks, checking every byte.
async fn read_concurrently(client: &Client, files: &[&Placed], readers: usize, rounds: usize) {
    let mut tasks = Vec::new();
    for r in 0..readers {
        let client = client.clone();
        let files: Vec<(String, Vec<u8>)> = files.iter().map(|f| (f.path.clone(), f.data.clone())).collect();
        tasks.push(tokio::spawn(async move {
            for round in 0..rounds {
                // Each reader starts at another file, so reads of one block overlap.
                for k in 0..files.len() {
                    let (path, data) = &files[(k + r + round) % files.len()];
                    let got = client.read_all(path).await.unwrap_or_else(|e| panic!("{path}: {e}"));
                    assert!(got[..] == data[..], "{path}: wrong bytes");
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

async fn warm(client: &Client, path: &str, replicas: u32) {
    let job = client.admin().submit_load(path, LoadOptions { replicas, ..Default::default() }).await.unwrap();
    let job = client.admin().wait_job(&job.id, Duration::from_millis(50), |_| {}).await.unwrap();
    assert_eq!(job.state(), JobState::Succeeded, "{job:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reads_spread_over_both_replicas_and_the_second_takes_blocks_from_the_first() {
    let cluster = Cluster::start(options(&[])).await;
    let client = cluster.client().await;
    let files = place(&cluster, &client, "spread", 90).await;
    // One copy of every block, on its first owner.
    warm(&client, "/data/spread", 1).await;
    assert_eq!(cluster.ufs_reads(), 90, "the warmup read each block from the UFS once");

    // The blocks owned first by A and second by B: A's reads of them are first-owner reads,
    // B's are second-replica reads, and C (the third owner) should serve none.
    let (a, b) = (files[0].owners[0], files[0].owners[1]);
    let c = 3 - a - b;
    let pair: Vec<&Placed> = files.iter().filter(|f| f.owners[..2] == [a, b]).collect();
    assert!(pair.len() >= 6, "{} of 90 files have owners ({a}, {b})", pair.len());
    let before = served(&cluster);
    let b_upstream = upstream_reads(&cluster, b);

    let (readers, rounds) = (8, 6);
    read_concurrently(&client, &pair, readers, rounds).await;

    let after = served(&cluster);
    let by = |i: usize| after[i] - before[i];
    let total = (pair.len() * readers * rounds * BLOCK) as u64;
    eprintln!(
        "{} files x {} reads: first owner served {} blocks, second {}, third {}; hedges {}",
        pair.len(),
        readers * rounds,
        by(a) / BLOCK as u64,
        by(b) / BLOCK as u64,
        by(c) / BLOCK as u64,
        client.hedged_reads()
    );
    assert_eq!(by(a) + by(b) + by(c), total, "every read was served once");
    assert_eq!(by(c), 0, "the third owner is not a read replica");
    // Power of two choices among two splits reads about evenly; a quarter each is far from
    // what chance allows either way (hundreds of reads).
    assert!(by(a) * 4 >= total, "the first owner served {} of {total} bytes", by(a));
    assert!(by(b) * 4 >= total, "the second replica served {} of {total} bytes", by(b));
    // B held none of these blocks: it took each from A once (peer fetch), never from the UFS.
    assert_eq!(upstream_reads(&cluster, b) - b_upstream, pair.len() as u64, "one peer fetch per block");
    assert_eq!(cluster.ufs_reads(), 90, "spreading reads cost no UFS read once a copy existed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_block_read_once_through_either_replica_is_never_read_from_the_ufs_again() {
    let cluster = Cluster::start(options(&[])).await;
    let client = cluster.client().await;
    let files = place(&cluster, &client, "cold", 30).await;
    // One read of each: whichever replica it went to fetched the block from the UFS.
    for f in &files {
        assert!(client.read_all(&f.path).await.unwrap()[..] == f.data[..], "{}", f.path);
    }
    assert_eq!(cluster.ufs_reads(), 30);
    // Now both replicas of every block are read, concurrently; the one without a copy takes it
    // from the one with it, whichever of the two that is (the first owner of a read_replicas
    // mount asks its peers too).
    let all: Vec<&Placed> = files.iter().collect();
    read_concurrently(&client, &all, 6, 4).await;
    assert_eq!(cluster.ufs_reads(), 30, "one UFS read per block in all");
    let taken: u64 = (0..3).map(|i| upstream_reads(&cluster, i)).sum();
    assert!(taken > 0, "the second copies came from peers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_reads_from_the_replica_on_its_own_node() {
    let cluster = Cluster::start(options(&["node-0", "node-1", "node-2"])).await;
    let mut config = cluster.client_config();
    config.node = Some("node-1".into());
    let client = Client::connect(config).await.unwrap();
    eventually("the client sees every worker's node", Duration::from_secs(10), || async {
        client.refresh_view().await.is_ok()
            && client.ring().await.is_ok_and(|r| r.members().iter().all(|m| m.node.starts_with("node-")))
    })
    .await;
    let files = place(&cluster, &client, "local", 45).await;
    warm(&client, "/data/local", 2).await;
    let (near, far): (Vec<&Placed>, Vec<&Placed>) = files.iter().partition(|f| f.owners[..2].contains(&1));
    assert!(near.len() >= 10 && far.len() >= 5, "{} near, {} far", near.len(), far.len());

    let before = served(&cluster);
    read_concurrently(&client, &near, 4, 5).await;
    let after = served(&cluster);
    let reads = (near.len() * 4 * 5) as u64;
    let near_total = reads * BLOCK as u64;
    assert_eq!(after[1] - before[1], near_total, "worker 1 (node-1) served every read it is a replica of");
    assert_eq!(client.local_reads(), reads, "each was sent to the local replica first");

    // Blocks whose replicas are both elsewhere are read from them: locality never widens the
    // candidates beyond the mount's read_replicas.
    let before = served(&cluster);
    read_concurrently(&client, &far, 2, 2).await;
    let after = served(&cluster);
    assert_eq!(after[1], before[1], "worker 1 is not a replica of these");
    assert_eq!(client.local_reads(), reads, "no local replica to prefer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn locate_says_which_workers_and_nodes_hold_a_path() {
    let cluster = Cluster::start(options(&["node-a", "node-b", "node-c"])).await;
    let client = cluster.client().await;
    let files = place(&cluster, &client, "loc", 12).await;
    cluster.write_file("loc/sub/extra.bin", &pattern(3 * BLOCK + 10, 9));
    warm(&client, "/data/loc", 2).await;
    let nodes = ["node-a", "node-b", "node-c"];

    // 12 one-block files and one of 4 blocks, each block on two workers.
    let blocks = 12 + 4;
    let bytes = (12 * BLOCK + 3 * BLOCK + 10) as u64;
    eventually(
        "the block map lists every loaded block on both replicas",
        Duration::from_secs(20),
        || async {
            let r = client.admin().locate("/data/loc").await.unwrap();
            let done =
                r.cached_blocks == blocks && r.workers.iter().map(|w| w.blocks).sum::<u64>() == 2 * blocks;
            if !done {
                eprintln!("not yet: {r:?}");
            }
            done
        },
    )
    .await;
    let r = client.admin().locate("/data/loc").await.unwrap();
    assert_eq!((r.path.as_str(), r.files, r.blocks, r.bytes), ("/data/loc", 13, blocks, bytes));
    assert_eq!(r.cached_bytes, bytes);
    assert_eq!(r.workers.iter().map(|w| w.blocks).sum::<u64>(), 2 * blocks, "two replicas of each");
    assert_eq!(r.workers.iter().map(|w| w.bytes).sum::<u64>(), 2 * bytes);
    assert!(r.workers.windows(2).all(|w| w[0].bytes >= w[1].bytes), "most bytes first: {:?}", r.workers);
    for w in &r.workers {
        let i =
            (0..3).find(|&i| cluster.worker(i).worker_id == w.worker_id).expect("a worker of the cluster");
        assert_eq!(w.node, nodes[i], "{w:?}");
        assert!(w.live);
    }

    // One file: exactly its block's first two owners, a block each.
    let f = &files[0];
    let r = client.admin().locate(&f.path).await.unwrap();
    assert_eq!((r.files, r.blocks, r.cached_blocks), (1, 1, 1));
    let mut holders: Vec<&str> = r.workers.iter().map(|w| w.node.as_str()).collect();
    holders.sort();
    let mut owners: Vec<&str> = f.owners[..2].iter().map(|&i| nodes[i]).collect();
    owners.sort();
    assert_eq!(holders, owners);

    // Nothing cached yet: no worker, nothing cached.
    cluster.write_file("cold/x.bin", &pattern(10, 1));
    let r = client.admin().locate("/data/cold").await.unwrap();
    assert_eq!((r.files, r.cached_blocks, r.workers.len()), (1, 0, 0));

    let e = client.admin().locate("/elsewhere/x").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    assert!(e.to_string().contains("not under any mount"), "{e}");
}

/// Two readers of one cold file at the same moment, each on the node of another of its read
/// replicas, cost the UFS one read: the replica that is not the block's first owner has the
/// first owner fetch it (one single flight there) instead of reading the UFS beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_cold_reads_through_both_replicas_read_the_ufs_once() {
    let cluster = Cluster::start(options(&["node-0", "node-1", "node-2"])).await;
    let on = |node: &str| {
        let mut config = cluster.client_config();
        config.node = Some(node.into());
        Client::connect(config)
    };
    let (x, y) = (on("node-0").await.unwrap(), on("node-1").await.unwrap());
    for c in [&x, &y] {
        eventually("the client sees every worker's node", Duration::from_secs(10), || async {
            c.refresh_view().await.is_ok()
                && c.ring().await.is_ok_and(|r| r.members().iter().all(|m| m.node.starts_with("node-")))
        })
        .await;
    }
    let files = place(&cluster, &x, "cold", 40).await;
    let both: Vec<&Placed> =
        files.iter().filter(|f| f.owners[..2].contains(&0) && f.owners[..2].contains(&1)).collect();
    assert!(both.len() >= 5, "{} files on workers 0 and 1", both.len());
    // A slow store makes the two misses overlap.
    cluster.faults().read_delay_ms.store(100, std::sync::atomic::Ordering::SeqCst);
    let before = cluster.ufs_reads();
    for f in &both {
        let (a, b) = tokio::join!(x.read_all(&f.path), y.read_all(&f.path));
        assert!(a.unwrap() == f.data && b.unwrap() == f.data, "{}: wrong bytes", f.path);
    }
    assert_eq!(cluster.ufs_reads() - before, both.len() as u64, "one UFS read per block");
    assert_eq!(
        x.local_reads() + y.local_reads(),
        2 * both.len() as u64,
        "each reader asked its own node first"
    );
}

/// A load submitted right after a worker joined plans on the ring with that worker (the
/// master's job table used to follow membership only on its 100 ms tick, so a job listed
/// in between put the new worker's blocks on the others).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_load_submitted_as_a_worker_joins_puts_each_block_on_its_owners() {
    let mut cluster = Cluster::start(ClusterOptions { workers: 2, ..options(&[]) }).await;
    let joined = cluster.add_worker().await;
    let client = cluster.client().await;
    let files = place(&cluster, &client, "join", 24).await;
    warm(&client, "/data/join", 2).await;
    let held = |i: usize| cluster.worker(i).blocks.cache().held_blocks().len();
    for i in 0..3 {
        let owned = files.iter().filter(|f| f.owners[..2].contains(&i)).count();
        assert_eq!(held(i), owned, "worker {i} (joined last: {}) holds the blocks it owns", i == joined);
    }
}
