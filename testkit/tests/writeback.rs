//! Write-back end to end on an in-process cluster (3 workers, `write_replicas=2`): a write is
//! acknowledged from the journals and visible at once, uploaded in the background, the last
//! acknowledged version wins, a failing UFS is retried and then reported, a lost uploader's
//! holder takes over, a delete before the upload keeps the file out of the UFS, and a client's
//! stat cached before the upload is not served after it.

use std::sync::atomic::Ordering;
use std::time::Duration;

use strata_client::{Client, ClientError, Persist};
use strata_testkit::{Cluster, ClusterOptions, eventually, pattern};

fn write_back() -> ClusterOptions {
    let mut opts = ClusterOptions { workers: 3, ..ClusterOptions::default() };
    opts.mount_options.push(("mode".into(), "write-back".into()));
    opts.mount_options.push(("write_replicas".into(), "2".into()));
    opts
}

async fn write(client: &Client, path: &str, data: &[u8]) -> strata_client::FileInfo {
    let mut w = client.create(path).await.unwrap();
    for chunk in data.chunks(1_000_003) {
        w.write(chunk).await.unwrap();
    }
    w.close().await.unwrap()
}

fn journals(cluster: &Cluster) -> usize {
    (0..cluster.worker_count())
        .filter_map(|i| std::fs::read_dir(cluster.nvme_dir(i).join("journal")).ok())
        .map(|d| d.count())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn acknowledged_visible_at_once_then_persisted() {
    let cluster = Cluster::start(write_back()).await;
    // Uploads fail for now: the file must be served from the journals alone.
    cluster.faults().fail_next_writes.store(1_000, Ordering::SeqCst);
    let client = cluster.client().await;
    let data = pattern(3 * 1024 * 1024 + 17, 3);
    let info = write(&client, "/data/ckpt/step-1.pt", &data).await;
    assert!(info.version.starts_with("wb-"), "{}", info.version);
    assert_eq!(info.holders.len(), 2, "two workers hold it");
    assert_ne!(info.holders[0].id, info.holders[1].id);
    assert!(!cluster.ufs.dir().join("ckpt/step-1.pt").exists(), "not in the UFS yet");

    // Another client sees it, lists it and reads its bytes.
    let other = cluster.client().await;
    let seen = other.stat("/data/ckpt/step-1.pt").await.unwrap();
    assert_eq!((seen.size, seen.version.as_str()), (data.len() as u64, info.version.as_str()));
    assert_ne!(seen.persist, Persist::Persisted);
    let names: Vec<_> = other.list("/data/ckpt").await.unwrap().into_iter().map(|e| e.path).collect();
    assert_eq!(names, ["/data/ckpt/step-1.pt"]);
    assert!(other.stat("/data/ckpt").await.unwrap().is_dir, "a directory only a pending file makes");
    assert_eq!(&other.read_all("/data/ckpt/step-1.pt").await.unwrap()[..], &data[..]);
    assert_eq!(
        &other.read_range("/data/ckpt/step-1.pt", 1_048_570, 20).await.unwrap()[..],
        &data[1_048_570..1_048_590]
    );
    let pending = other.sync("/data", false).await.unwrap();
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].path, "/data/ckpt/step-1.pt");

    // The UFS heals: the upload lands, the file is the UFS's, the journals go.
    cluster.faults().fail_next_writes.store(0, Ordering::SeqCst);
    client.sync_wait("/data/ckpt", Duration::from_secs(60)).await.unwrap();
    assert_eq!(std::fs::read(cluster.ufs.dir().join("ckpt/step-1.pt")).unwrap(), data);
    let persisted = other.stat_with("/data/ckpt/step-1.pt", true).await.unwrap();
    assert!(!persisted.version.starts_with("wb-"), "{}", persisted.version);
    assert_eq!(persisted.persist, Persist::Persisted);
    assert_eq!(&other.read_all("/data/ckpt/step-1.pt").await.unwrap()[..], &data[..]);
    eventually("the holders drop their journals", Duration::from_secs(20), || async {
        journals(&cluster) == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stat_cached_before_the_upload_is_not_served_after_it() {
    let cluster = Cluster::start(write_back()).await;
    cluster.faults().fail_next_writes.store(1_000, Ordering::SeqCst);
    let client = cluster.client().await;
    let data = pattern(2 << 20, 4);
    // `close` caches the write-back stat (the mount's metadata TTL is 60 s).
    let info = write(&client, "/data/cached.bin", &data).await;
    assert!(info.version.starts_with("wb-"), "{}", info.version);
    cluster.faults().fail_next_writes.store(0, Ordering::SeqCst);
    client.sync_wait("/data/cached.bin", Duration::from_secs(60)).await.unwrap();
    eventually("the holders drop their journals", Duration::from_secs(20), || async {
        journals(&cluster) == 0
    })
    .await;
    // The journals the cached version names are gone (the testkit's master keeps them 200 ms
    // after the upload; a mount's metadata TTL can outlive any grace): stat and open must see
    // the UFS's version.
    let now = client.stat("/data/cached.bin").await.unwrap();
    assert_eq!(now.persist, Persist::Persisted);
    assert!(!now.version.starts_with("wb-"), "{}", now.version);
    let mut read = Vec::new();
    let mut r = client.open("/data/cached.bin").await.unwrap();
    tokio::io::AsyncReadExt::read_to_end(&mut r, &mut read).await.unwrap();
    assert_eq!(read, data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_last_acknowledged_version_wins() {
    let cluster = Cluster::start(write_back()).await;
    let client = cluster.client().await;
    // The first upload attempts fail, so version 1 is still pending (or uploading) when
    // versions 2 and 3 are acknowledged.
    cluster.faults().fail_next_writes.store(2, Ordering::SeqCst);
    let v1 = pattern(2 << 20, 1);
    let v2 = pattern(1 << 20, 2);
    let v3 = pattern(3 << 20, 3);
    write(&client, "/data/f.bin", &v1).await;
    write(&client, "/data/f.bin", &v2).await;
    let last = write(&client, "/data/f.bin", &v3).await;
    assert_eq!(client.stat("/data/f.bin").await.unwrap().version, last.version);
    assert_eq!(&client.read_all("/data/f.bin").await.unwrap()[..], &v3[..]);
    client.sync_wait("/data/f.bin", Duration::from_secs(60)).await.unwrap();
    assert_eq!(std::fs::read(cluster.ufs.dir().join("f.bin")).unwrap(), v3);
    eventually("every journal is dropped", Duration::from_secs(20), || async { journals(&cluster) == 0 })
        .await;
    assert_eq!(std::fs::read(cluster.ufs.dir().join("f.bin")).unwrap(), v3, "no stale upload came after");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_upload_is_reported_and_sync_retries_it() {
    let cluster = Cluster::start(write_back()).await;
    let client = cluster.client().await;
    cluster.faults().fail_next_writes.store(u64::MAX / 2, Ordering::SeqCst);
    let data = pattern(100_000, 5);
    write(&client, "/data/x/y.bin", &data).await;
    eventually("the upload gives up", Duration::from_secs(60), || async {
        client.stat_with("/data/x/y.bin", true).await.is_ok_and(|i| i.persist == Persist::Failed)
    })
    .await;
    let pending = client.sync("/data/x", false).await.unwrap();
    assert!(pending[0].error.contains("injected write fault"), "{:?}", pending[0].error);
    // Still readable, and still not in the UFS.
    assert_eq!(&client.read_all("/data/x/y.bin").await.unwrap()[..], &data[..]);
    let e = client.sync_wait("/data/x", Duration::from_secs(1)).await.unwrap_err();
    assert!(e.to_string().contains("/data/x/y.bin"), "{e}");
    cluster.faults().fail_next_writes.store(0, Ordering::SeqCst);
    client.sync_wait("/data/x", Duration::from_secs(60)).await.unwrap();
    assert_eq!(std::fs::read(cluster.ufs.dir().join("x/y.bin")).unwrap(), data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_other_holder_uploads_when_the_primary_dies() {
    let mut cluster = Cluster::start(write_back()).await;
    let client = cluster.client().await;
    cluster.faults().fail_next_writes.store(u64::MAX / 2, Ordering::SeqCst);
    let data = pattern(5 << 20, 7);
    let info = write(&client, "/data/big.bin", &data).await;
    let primary = info.holders[0].id.clone();
    let index = (0..cluster.worker_count()).find(|&i| cluster.worker(i).worker_id == primary).unwrap();
    cluster.kill_worker(index).await;
    cluster.faults().fail_next_writes.store(0, Ordering::SeqCst);
    client.sync_wait("/data/big.bin", Duration::from_secs(90)).await.unwrap();
    assert_eq!(std::fs::read(cluster.ufs.dir().join("big.bin")).unwrap(), data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_delete_before_the_upload_keeps_it_out_of_the_ufs() {
    let cluster = Cluster::start(write_back()).await;
    let client = cluster.client().await;
    cluster.faults().fail_next_writes.store(1_000, Ordering::SeqCst);
    write(&client, "/data/tmp/a.bin", &pattern(1000, 1)).await;
    write(&client, "/data/tmp/b.bin", &pattern(1000, 2)).await;
    let e = client.delete("/data/tmp", false).await.unwrap_err();
    assert!(e.to_string().contains("not empty"), "{e}");
    client.delete("/data/tmp/a.bin", false).await.unwrap();
    assert!(matches!(client.stat("/data/tmp/a.bin").await, Err(ClientError::NotFound(_))));
    client.delete("/data/tmp", true).await.unwrap();
    assert!(matches!(client.stat("/data/tmp/b.bin").await, Err(ClientError::NotFound(_))));
    cluster.faults().fail_next_writes.store(0, Ordering::SeqCst);
    client.sync_wait("/data", Duration::from_secs(30)).await.unwrap();
    eventually("every journal is dropped", Duration::from_secs(20), || async { journals(&cluster) == 0 })
        .await;
    assert!(!cluster.ufs.dir().join("tmp/a.bin").exists() && !cluster.ufs.dir().join("tmp/b.bin").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn too_few_workers_is_a_clear_error() {
    let mut opts = write_back();
    opts.mount_options.push(("write_replicas".into(), "4".into()));
    let cluster = Cluster::start(opts).await;
    let client = cluster.client().await;
    let e = client.create("/data/a.bin").await.err().expect("refused");
    assert!(e.to_string().contains("write_replicas"), "{e}");
}

/// The copies of a write are sent by a task each (frames queued): a replica lost mid-stream is
/// left out and the primary then refuses the write — nothing is acknowledged, nothing stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_lost_mid_stream_fails_the_write_and_leaves_nothing() {
    let mut cluster = Cluster::start(write_back()).await;
    let client = cluster.client().await;
    let data = pattern(24 << 20, 11);
    let mut w = client.create("/data/lost-replica.bin").await.unwrap();
    w.write(&data[..8 << 20]).await.unwrap();
    // The replica is the path's second owner on the ring.
    let ring = client.ring().await.unwrap();
    let owners =
        ring.owners(strata_common::BlockKey::new("/data/lost-replica.bin", "", 0).placement_hash(), 2);
    let replica = owners[1].id.clone();
    let index = (0..cluster.worker_count()).find(|&i| cluster.worker(i).worker_id == replica).unwrap();
    cluster.kill_worker(index).await;
    let mut result = Ok(());
    for chunk in data[8 << 20..].chunks(1 << 20) {
        result = w.write(chunk).await;
        if result.is_err() {
            break;
        }
    }
    assert!(result.is_ok(), "a replica's failure does not fail a write: {result:?}");
    let e = w.close().await.expect_err("two copies were asked for, one is left");
    assert!(e.to_string().contains(&replica), "the error names the lost replica: {e}");
    assert!(matches!(client.stat("/data/lost-replica.bin").await, Err(ClientError::NotFound(_))));
    // The killed worker's unfinished journal waits for its restart, which discards it.
    let live_journals = || {
        (0..cluster.worker_count())
            .filter(|&i| i != index)
            .filter_map(|i| std::fs::read_dir(cluster.nvme_dir(i).join("journal")).ok())
            .map(|d| d.count())
            .sum::<usize>()
    };
    eventually("no live worker keeps a journal", Duration::from_secs(20), || async { live_journals() == 0 })
        .await;
}

/// A writer dropped with frames still queued sends nothing more: no file, no journal.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dropped_writer_with_queued_frames_leaves_nothing() {
    let cluster = Cluster::start(write_back()).await;
    let client = cluster.client().await;
    let mut w = client.create("/data/dropped.bin").await.unwrap();
    w.write(&pattern(20 << 20, 5)).await.unwrap();
    drop(w);
    eventually("no journal is left", Duration::from_secs(20), || async { journals(&cluster) == 0 }).await;
    assert!(matches!(client.stat("/data/dropped.bin").await, Err(ClientError::NotFound(_))));
    // And the next write of the path goes through whole.
    let data = pattern(9 << 20, 6);
    write(&client, "/data/dropped.bin", &data).await;
    assert_eq!(&client.read_all("/data/dropped.bin").await.unwrap()[..], &data[..]);
}
