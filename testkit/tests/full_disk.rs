//! A worker whose NVMe disk fills up (each worker's NVMe tier on a small tmpfs; root): reads
//! stay exact, the tier evicts down to what the disk takes, the failures are counted and shown
//! in the cluster status, and warmup reports a block done only once it is on NVMe.

use std::io::Write;
use std::time::Duration;

use strata_client::{Client, JobState, LoadOptions};
use strata_proto::Tier;
use strata_testkit::{Cluster, ClusterOptions, eventually, pattern};

const MIB: usize = 1 << 20;

fn one_worker_on(disk: &'static str, memory: u64) -> ClusterOptions {
    ClusterOptions {
        workers: 1,
        memory_capacity: memory,
        // Far more than the disk takes: the tier only learns the truth from the disk.
        nvme_capacity: 256 << 20,
        nvme_disk: Some(disk),
        ..ClusterOptions::default()
    }
}

/// The NVMe tier of the one worker, as the master's status shows it.
async fn nvme_status(client: &Client) -> strata_proto::TierUsage {
    let status = client.admin().status().await.expect("status");
    status.workers[0].tiers.iter().find(|t| t.tier == Tier::Nvme as i32).cloned().expect("an nvme tier")
}

/// Fills what is left of the disk at `dir` with a file of someone else's.
fn fill(dir: &std::path::Path) {
    let mut ballast = std::fs::File::create(dir.join("other-tenant")).unwrap();
    let chunk = vec![1u8; 64 << 10];
    while ballast.write_all(&chunk).is_ok() {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_nvme_disk_is_evicted_from_counted_shown_and_reads_stay_exact() {
    // 2 MiB of DRAM, a 6 MiB disk, 16 MiB of files: both tiers overflow.
    let cluster = Cluster::start(one_worker_on("6m", 2 << 20)).await;
    let files: Vec<Vec<u8>> = (0..4).map(|i| pattern(4 * MIB, i)).collect();
    for (i, f) in files.iter().enumerate() {
        cluster.write_file(&format!("f{i}.bin"), f);
    }
    let client = cluster.client().await;
    for round in 0..2 {
        for (i, f) in files.iter().enumerate() {
            let got = client.read_all(&format!("/data/f{i}.bin")).await.unwrap();
            assert!(got == *f, "round {round}: f{i}.bin differs");
        }
        cluster.worker(0).blocks.cache().nvme_writes_settled().await;
    }
    eventually("the status to show the full disk", Duration::from_secs(10), || async {
        let t = nvme_status(&client).await;
        t.disk_full && t.write_errors_no_space >= 1
    })
    .await;
    let nvme_now = nvme_status(&client).await;
    eprintln!("nvme tier after 2 x 16 MiB through a 6 MiB disk: {nvme_now:?}");
    assert!(nvme_now.full_limit_bytes < 6 << 20, "{nvme_now:?}");
    assert!(nvme_now.used_bytes <= nvme_now.full_limit_bytes, "{nvme_now:?}");
    assert_eq!(nvme_now.capacity_bytes, 256 << 20, "the configured capacity is still shown");
    assert_eq!((nvme_now.write_errors_quota, nvme_now.write_errors_io), (0, 0), "{nvme_now:?}");
    // Eviction keeps the tier below the disk: failed writes stay few, not one per block.
    assert!(nvme_now.write_errors_no_space <= 4, "{nvme_now:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn warmup_onto_a_full_disk_fails_its_blocks_saying_so_and_reads_still_work() {
    let cluster = Cluster::start(one_worker_on("2m", 64 << 20)).await;
    fill(cluster.nvme_disk(0));
    let a = pattern(3 * MIB / 2, 1);
    let b = pattern(MIB / 2, 2);
    cluster.write_file("w/a.bin", &a);
    cluster.write_file("w/b.bin", &b);
    let client = cluster.client().await;
    let admin = client.admin();
    let job = admin.submit_load("/data/w", LoadOptions::default()).await.unwrap();
    let waited = admin.wait_job(&job.id, Duration::from_millis(100), |_| {});
    let job = tokio::time::timeout(Duration::from_secs(60), waited).await.expect("the job ends").unwrap();
    // DRAM took every block, but the job asked for the cache's disk: nothing is done.
    assert_eq!(job.state(), JobState::Failed, "{job:?}");
    assert_eq!((job.files_failed, job.blocks_done), (2, 0), "{job:?}");
    for failure in &job.failures {
        assert!(failure.reason.contains("NVMe") && failure.reason.contains("full"), "{failure:?}");
    }
    let nvme = nvme_status(&client).await;
    assert!(nvme.disk_full && nvme.full_limit_bytes == 0 && nvme.write_errors_no_space >= 1, "{nvme:?}");
    // Served all the same, from DRAM and the UFS.
    assert_eq!(client.read_all("/data/w/a.bin").await.unwrap(), a);
    assert_eq!(client.read_all("/data/w/b.bin").await.unwrap(), b);
}
