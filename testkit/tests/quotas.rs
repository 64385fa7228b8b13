//! Per-mount quotas, cache TTLs and the NVMe watermark on an in-process cluster: each worker
//! keeps a mount within its ring share of the quota (and the master sums what they hold), a
//! mount's blocks leave the tiers once its `cache_ttl` passes, and a full NVMe tier is evicted
//! down to its low watermark in the background. Every read is checked byte for byte.

use std::time::Duration;

use strata_client::Client;
use strata_testkit::{Cluster, ClusterOptions, eventually, pattern};

const MIB: u64 = 1 << 20;
/// One block of 1 MiB with room for nothing else: a tier's bytes are its blocks' sizes.
const FILE: usize = MIB as usize;

fn options(mount: &[(&str, &str)]) -> ClusterOptions {
    let mut opts = ClusterOptions {
        workers: 3,
        memory_capacity: 4 * MIB,
        nvme_capacity: 64 * MIB,
        ..ClusterOptions::default()
    };
    opts.mount_options.extend(mount.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    opts
}

/// Writes `n` one-block files under `dir` in the UFS root; returns their paths under `mount`
/// and their bytes.
fn files(cluster: &Cluster, mount: &str, dir: &str, n: usize, seed: u64) -> Vec<(String, Vec<u8>)> {
    (0..n)
        .map(|i| {
            let data = pattern(FILE, seed + i as u64);
            cluster.write_file(&format!("{dir}/f{i}.bin"), &data);
            let under = if mount == "/data" { format!("/data/{dir}") } else { mount.to_string() };
            (format!("{under}/f{i}.bin"), data)
        })
        .collect()
}

async fn read_each(client: &Client, files: &[(String, Vec<u8>)]) {
    for (path, data) in files {
        let got = client.read_all(path).await.unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!(got[..], data[..], "{path}");
    }
}

/// Bytes every worker's tiers hold of blocks whose file identity contains `part`.
fn held(cluster: &Cluster, part: &str) -> Vec<u64> {
    (0..cluster.worker_count())
        .map(|i| {
            let cache = cluster.worker(i).blocks.cache().clone();
            cache
                .tiers()
                .iter()
                .flat_map(|t| t.keys())
                .filter(|(k, _)| k.file.contains(part))
                .map(|(_, size)| size)
                .sum()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_mount_stays_within_its_quota_across_workers_and_another_mount_is_untouched() {
    let quota = 8 * MIB;
    let cluster = Cluster::start(options(&[("quota", "8MiB")])).await;
    let client = cluster.client().await;
    // The control: a mount of a directory inside /data's, without a quota; its blocks are its
    // own, not /data's.
    let limited = files(&cluster, "/data", "limited", 32, 1);
    let plain = files(&cluster, "/plain", "plain", 24, 100);
    let plain_uri = format!("{}/plain", cluster.ufs_uri().trim_end_matches('/'));
    let block = [("block_size".to_string(), "1MiB".to_string())].into();
    client.admin().add_mount("/plain", &plain_uri, block).await.unwrap();

    read_each(&client, &limited).await;
    read_each(&client, &plain).await;
    cluster.flush().await;

    // Each worker evicts /data's blocks down to its share; together they hold at most the quota.
    eventually("the workers hold at most the quota of /data", Duration::from_secs(20), || async {
        let total: u64 = held(&cluster, "/limited/").iter().sum();
        total <= quota
    })
    .await;
    let limited_bytes = held(&cluster, "/limited/");
    let plain_bytes: u64 = held(&cluster, "/plain/").iter().sum();
    eprintln!("held of /data per worker {limited_bytes:?}, of /plain {plain_bytes}");
    assert!(
        plain_bytes > quota,
        "the mount without a quota keeps more than /data's quota ({plain_bytes} bytes)"
    );
    assert!(limited_bytes.iter().all(|b| *b > 0), "every worker keeps its share: {limited_bytes:?}");

    // The master sums what the workers report.
    eventually("the master reports /data's bytes against its quota", Duration::from_secs(10), || async {
        let status = client.admin().status().await.unwrap();
        status.mount_quotas.iter().any(|q| {
            q.path == "/data" && q.quota_bytes == quota && q.cached_bytes > 0 && q.cached_bytes <= quota
        }) && !status.mount_quotas.iter().any(|q| q.path == "/plain")
    })
    .await;

    // Evicted blocks come back from the UFS, exact.
    let before = cluster.ufs_reads();
    read_each(&client, &limited).await;
    assert!(cluster.ufs_reads() > before, "blocks over the quota were evicted, so some are read again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn blocks_leave_the_cache_once_their_mounts_cache_ttl_passes() {
    let cluster = Cluster::start(options(&[("cache_ttl", "2s")])).await;
    let client = cluster.client().await;
    let data = files(&cluster, "/data", "ttl", 6, 7);
    read_each(&client, &data).await;
    cluster.flush().await;
    // Within the TTL the blocks are cached: a re-read costs the UFS nothing.
    let before = cluster.ufs_reads();
    read_each(&client, &data).await;
    assert_eq!(cluster.ufs_reads(), before, "cached within the TTL");
    assert!(held(&cluster, "/ttl/").iter().sum::<u64>() >= 6 * MIB);

    eventually("every block of the mount has expired", Duration::from_secs(20), || async {
        held(&cluster, "/ttl/").iter().all(|b| *b == 0)
    })
    .await;
    let before = cluster.ufs_reads();
    read_each(&client, &data).await;
    assert_eq!(cluster.ufs_reads(), before + 6, "each expired block is read from the UFS once more");

    let status = client.admin().status().await.unwrap();
    let q = status.mount_quotas.iter().find(|q| q.path == "/data").expect("/data has a TTL");
    assert_eq!((q.cache_ttl_ms, q.quota_bytes), (2_000, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_nvme_tier_is_evicted_to_its_low_watermark() {
    // One worker, 12 blocks of NVMe: reading 30 fills it to the brim (a put only evicts what
    // it needs), and the default watermarks (95 / 85 %) take it down to 10 blocks.
    let opts = ClusterOptions { workers: 1, nvme_capacity: 12 * MIB, ..options(&[]) };
    let cluster = Cluster::start(opts).await;
    let client = cluster.client().await;
    let data = files(&cluster, "/data", "scan", 30, 50);
    read_each(&client, &data).await;
    cluster.flush().await;
    let nvme = || cluster.worker(0).blocks.cache().tier_usage().1;
    eventually("NVMe is at or below its low watermark", Duration::from_secs(20), || async {
        nvme().used_bytes <= 12 * MIB * 85 / 100
    })
    .await;
    eprintln!("NVMe after the scan: {:?}", nvme());
    assert!(nvme().blocks >= 9, "evicted to the low watermark, not emptied: {:?}", nvme());
    read_each(&client, &data).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paths_cache_ttl_expires_its_blocks_alone_and_survives_a_master_restart() {
    let mut cluster = Cluster::start(options(&[])).await;
    let client = cluster.client().await;
    let short = files(&cluster, "/data", "short", 4, 300);
    let long = files(&cluster, "/data", "long", 4, 400);
    let ttl = client.admin().set_cache_ttl("/data/short", Some(Duration::from_secs(2))).await.unwrap();
    assert_eq!((ttl.path.as_str(), ttl.cache_ttl_ms), ("/data/short", 2_000));
    // Durable: a restarted master lists it and hands it to the workers again.
    cluster.stop_master().await;
    cluster.start_master().await;
    cluster.wait_for_live_workers(3).await;
    let client = cluster.client().await;
    let ttls = client.admin().cache_ttls().await.unwrap();
    assert_eq!(
        ttls.iter().map(|t| (t.path.as_str(), t.cache_ttl_ms)).collect::<Vec<_>>(),
        [("/data/short", 2_000)]
    );

    read_each(&client, &short).await;
    read_each(&client, &long).await;
    cluster.flush().await;
    eventually("the blocks under /data/short expire", Duration::from_secs(20), || async {
        held(&cluster, "/short/").iter().all(|b| *b == 0)
    })
    .await;
    let before = cluster.ufs_reads();
    read_each(&client, &long).await;
    assert_eq!(cluster.ufs_reads(), before, "/data/long has no TTL: still cached");
    read_each(&client, &short).await;
    assert_eq!(cluster.ufs_reads(), before + 4, "each expired block is read again, exact");

    client.admin().set_cache_ttl("/data/short", None).await.unwrap();
    assert!(client.admin().cache_ttls().await.unwrap().is_empty());
    let e = client.admin().set_cache_ttl("/data/short", None).await.unwrap_err();
    assert_eq!(e.kind(), strata_common::ErrorKind::NotFound, "{e}");
    let e = client.admin().set_cache_ttl("/nowhere/x", Some(Duration::from_secs(5))).await.unwrap_err();
    assert_eq!(e.kind(), strata_common::ErrorKind::NotFound, "a path under no mount: {e}");
}
