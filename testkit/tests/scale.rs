//! The control plane at the sizes training data has every day: a directory of 100,000 entries
//! listed page by page (never one message), a recursive find over a tree, and a worker holding
//! 100,000 blocks that restarts and reports all of them again (its full report in chunks).
//! Before paging, the listing failed at 60,000 entries ("decoded message length too large")
//! and so did every heartbeat of a worker with 60,000 warm files.

use std::collections::HashSet;
use std::time::Duration;

use strata_testkit::{Cluster, ClusterOptions, eventually};

const ENTRIES: usize = 100_000;

fn options(workers: usize) -> ClusterOptions {
    ClusterOptions {
        workers,
        memory_capacity: 0,
        nvme_capacity: 4 << 30,
        mount_options: vec![("block_size".into(), "4KiB".into()), ("metadata_ttl".into(), "10m".into())],
        ..ClusterOptions::default()
    }
}

/// `n` one-byte files in `dir` (names sort as their numbers do).
fn tiny_files(cluster: &Cluster, dir: &str, n: usize) {
    let root = cluster.ufs.dir().join(dir);
    std::fs::create_dir_all(&root).unwrap();
    for i in 0..n {
        std::fs::write(root.join(format!("f{i:06}")), [i as u8]).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_directory_of_100k_entries_lists_in_pages_and_find_streams_a_tree() {
    let cluster = Cluster::start(options(1)).await;
    tiny_files(&cluster, "flat", ENTRIES);
    let client = cluster.client().await;

    // Page by page: each bounded, in name order, no entry twice or missing.
    let (mut token, mut pages, mut seen) = (String::new(), 0, Vec::with_capacity(ENTRIES));
    loop {
        let (page, next) = client.list_page("/data/flat", &token, 0).await.unwrap();
        assert!(page.len() <= 1_000, "a page of {} entries", page.len());
        seen.extend(page.into_iter().map(|e| e.path));
        pages += 1;
        match next {
            Some(n) => token = n,
            None => break,
        }
    }
    assert_eq!(seen.len(), ENTRIES);
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "name order, no duplicate");
    assert_eq!(seen[0], "/data/flat/f000000");
    assert_eq!(pages, ENTRIES / 1_000);
    // A larger page size is honoured up to the cap.
    let (big, _) = client.list_page("/data/flat", "", 50_000).await.unwrap();
    assert_eq!(big.len(), 10_000, "pages are capped at 10,000 entries");
    // The whole listing through the SDK's convenience call.
    assert_eq!(client.list("/data/flat").await.unwrap().len(), ENTRIES);

    // find over the flat directory: 100 pages, but the directory is listed by the UFS once
    // (the walk goes through the master's cached listing; bisection finds each page's start).
    let lists_before = cluster.counters().lists.load(std::sync::atomic::Ordering::SeqCst);
    let (mut token, mut found) = (String::new(), 0usize);
    loop {
        let (page, next) = client.find_page("/data/flat", &token, 0, 0).await.unwrap();
        found += page.len();
        match next {
            Some(n) => token = n,
            None => break,
        }
    }
    assert_eq!(found, ENTRIES);
    let lists = cluster.counters().lists.load(std::sync::atomic::Ordering::SeqCst) - lists_before;
    assert!(lists <= 1, "a paged find listed the directory {lists} times");

    // find: every file of a tree in one paged stream, depth-limited on request.
    for d in 0..30 {
        for f in 0..10 {
            cluster.write_file(&format!("tree/d{d:02}/sub/f{f}.bin"), b"x");
        }
        cluster.write_file(&format!("tree/d{d:02}/top.bin"), b"yy");
    }
    let (mut token, mut found) = (String::new(), Vec::new());
    loop {
        let (page, next) = client.find_page("/data/tree", &token, 100, 0).await.unwrap();
        assert!(page.len() <= 100);
        found.extend(page.into_iter().map(|e| (e.path, e.size)));
        match next {
            Some(n) => token = n,
            None => break,
        }
    }
    assert_eq!(found.len(), 30 * 11);
    assert_eq!(found.iter().map(|(p, _)| p).collect::<HashSet<_>>().len(), found.len(), "no file twice");
    assert!(found.iter().any(|(p, s)| p == "/data/tree/d07/sub/f3.bin" && *s == 1));
    let (shallow, next) = client.find_page("/data/tree", "", 1_000, 2).await.unwrap();
    assert!(next.is_none());
    assert_eq!(shallow.len(), 30, "only the files two levels down: d*/top.bin");
    assert!(shallow.iter().all(|e| e.path.ends_with("/top.bin")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_holding_100k_blocks_restarts_and_reports_all_of_them() {
    use bytes::Bytes;
    use strata_common::BlockKey;
    use strata_worker::tier::{NvmeTier, Tier};

    let mut cluster = Cluster::start(options(1)).await;
    // One real file, read (so cached and on NVMe after a flush)...
    cluster.write_file("warm/real.bin", b"real bytes");
    let client = cluster.client().await;
    assert_eq!(&client.read_all("/data/warm/real.bin").await.unwrap()[..], b"real bytes");
    cluster.flush().await;
    // ...and 99,999 more blocks put straight into the stopped worker's NVMe tier: what a
    // worker that warmed a dataset of small files holds (a warmup of them all takes minutes).
    // Their identities are as long as deep object keys make them (~200 bytes), so the full
    // report (~25 MB) is over the 16 MiB message limit: it only arrives in chunks.
    cluster.kill_worker(0).await;
    let tier = NvmeTier::open(cluster.nvme_dir(0), 4 << 30).unwrap();
    for i in 1..ENTRIES {
        let id = format!(
            "s3://training-data-bucket/datasets/vision/imagenet-21k/processed/resized-256/train/\
             class-{:05}/shard-{:06}/sample-{i:08}-augmented-variant-original.jpg#bs4194304",
            i % 21_000,
            i / 1_000
        );
        let key = BlockKey::new(id, "\"0123456789abcdef0123456789abcdef\"", 0);
        tier.put(&key, Bytes::from_static(b"b")).await.unwrap();
    }
    assert_eq!(tier.usage().blocks, ENTRIES as u64);
    drop(tier);

    // Restarted: it registers again and its full report arrives in chunks, every block of it.
    cluster.restart_worker(0).await;
    cluster.wait_for_live_workers(1).await;
    eventually("the restarted worker reported all 100k blocks", Duration::from_secs(120), || async {
        client.admin().status().await.map(|s| s.blocks).unwrap_or(0) == ENTRIES as u64
    })
    .await;
    let status = client.admin().status().await.unwrap();
    assert_eq!(status.workers[0].blocks, ENTRIES as u64);
    client.refresh_view().await.unwrap();
    let before = cluster.ufs_reads();
    assert_eq!(&client.read_all("/data/warm/real.bin").await.unwrap()[..], b"real bytes");
    assert_eq!(cluster.ufs_reads(), before, "served from the restarted worker's NVMe");
}
