//! Prefetch hints end to end (docs/PYTHON.md, "Prefetch"): an in-process cluster over a local
//! directory; a client hints the files it will read next, the workers owning them fetch them
//! in their prefetch lane, and the reads that follow are served from the cache.

use std::time::Duration;

use strata_testkit::{Cluster, ClusterOptions, eventually, pattern};

fn counters(cluster: &Cluster) -> strata_worker::prefetch::PrefetchCounters {
    let mut sum = strata_worker::prefetch::PrefetchCounters::default();
    for i in 0..cluster.worker_count() {
        let c = cluster.worker(i).prefetch.counters();
        sum.hinted += c.hinted;
        sum.fetched += c.fetched;
        sum.cached += c.cached;
        sum.failed += c.failed;
        sum.dropped += c.dropped;
        sum.hit += c.hit;
        sum.late += c.late;
    }
    sum
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hinted_files_are_fetched_ahead_and_read_from_the_cache() {
    let cluster = Cluster::start(ClusterOptions { workers: 2, ..Default::default() }).await;
    let files: Vec<(String, Vec<u8>)> = (0..20)
        .map(|i| {
            let data = pattern(64 * 1024 + i, i as u64);
            cluster.write_file(&format!("set/f{i:02}.bin"), &data);
            (format!("/data/set/f{i:02}.bin"), data)
        })
        .collect();
    let client = cluster.client().await;
    let mut window: Vec<&str> = files.iter().map(|(p, _)| p.as_str()).collect();
    window.insert(5, "/data/set/missing.bin");
    window.push("/data/set");
    let hinted = client.prefetch(7, &window).await.unwrap();
    assert_eq!(hinted.unknown, 2, "a missing path and a directory are skipped");
    assert_eq!(hinted.queued, 20);
    eventually("the lane fetched every hinted file", Duration::from_secs(20), || async {
        counters(&cluster).fetched == 20
    })
    .await;
    let ufs_reads = cluster.ufs_reads();
    for (path, data) in &files {
        assert_eq!(&client.read_all(path).await.unwrap(), data);
    }
    assert_eq!(cluster.ufs_reads(), ufs_reads, "every hinted read came from the cache");
    let c = counters(&cluster);
    assert_eq!((c.hit, c.late, c.failed), (20, 0, 0), "{c:?}");

    // The same window again: the lane finds the blocks held and fetches nothing. An empty
    // window clears the stream.
    client.prefetch(7, &window).await.unwrap();
    eventually("the lane found every block held", Duration::from_secs(20), || async {
        counters(&cluster).cached == 20
    })
    .await;
    assert_eq!(counters(&cluster).fetched, 20);
    assert_eq!(cluster.ufs_reads(), ufs_reads);
    let cleared = client.prefetch(7, &[]).await.unwrap();
    assert_eq!((cleared.queued, cleared.unknown), (0, 0));
    assert_eq!(cleared.workers, 2, "both workers were told the stream's window is empty");
}
