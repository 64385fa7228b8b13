//! Small files end to end (docs/ARCHITECTURE.md, "Small files"): an in-process cluster over a
//! local directory, small files packed into NVMe containers by the workers, compared byte for
//! byte with the same files stored unpacked, rewritten in the UFS, corrupted on disk, and
//! warmed up in batches.

use std::path::Path;
use std::time::{Duration, Instant};

use futures::StreamExt;
use rand::{Rng, SeedableRng};
use strata_client::{Client, JobState, LoadOptions};
use strata_testkit::{Cluster, ClusterOptions, eventually, pattern};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const LIVE: &[u8; 8] = b"STRATAPK";

/// Container files and live entries in a worker's NVMe tier, and block files beside them.
fn nvme_layout(dir: &Path) -> (usize, usize, usize) {
    let mut containers = 0;
    let mut entries = 0;
    if let Ok(packs) = std::fs::read_dir(dir.join("packs")) {
        for f in packs.flatten() {
            let bytes = std::fs::read(f.path()).unwrap();
            containers += 1;
            entries += bytes.windows(LIVE.len()).filter(|w| w == LIVE).count();
        }
    }
    let mut block_files = 0;
    if let Ok(shards) = std::fs::read_dir(dir.join("blocks")) {
        for shard in shards.flatten() {
            block_files += std::fs::read_dir(shard.path()).map(|d| d.count()).unwrap_or(0);
        }
    }
    (containers, entries, block_files)
}

/// Reads every `(path, bytes)` through `client`, 32 at a time, and checks each byte for byte.
async fn read_all_exact(client: &Client, files: &[(String, Vec<u8>)]) {
    futures::stream::iter(files)
        .map(|(path, want)| async move {
            let got = client.read_all(path).await.unwrap_or_else(|e| panic!("{path}: {e}"));
            assert!(
                got.len() == want.len() && got[..] == want[..],
                "{path}: wrong bytes ({} of {})",
                got.len(),
                want.len()
            );
        })
        .buffer_unordered(32)
        .collect::<Vec<()>>()
        .await;
}

fn options(memory: u64) -> ClusterOptions {
    ClusterOptions {
        workers: 3,
        memory_capacity: memory,
        nvme_capacity: 2 << 30,
        mount_options: vec![("metadata_ttl".into(), "10m".into())],
        ..ClusterOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn packed_and_unpacked_reads_of_the_same_ten_thousand_files_are_byte_identical() {
    // A DRAM tier far smaller than the files: most of them are read back from NVMe.
    let cluster = Cluster::start(options(24 * MIB)).await;
    // Mostly small files as in a training set (log-uniform, 1 B to 64 KiB), one in twenty up to
    // 1 MiB, and every edge of the threshold (1 MiB by default).
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    let mut sizes: Vec<usize> = (0..9_994)
        .map(|i| {
            let top: f64 = if i % 20 == 0 { 20.0 } else { 16.0 };
            2f64.powf(rng.random_range(0.0..top)) as usize
        })
        .collect();
    sizes.extend([1, (MIB - 1) as usize, MIB as usize, (MIB + 1) as usize, (4 * MIB) as usize, 0]);
    let files: Vec<(String, Vec<u8>)> = sizes
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let rel = format!("set/{:02}/f{i:05}.bin", i / 500);
            let data = pattern(len, 1000 + i as u64);
            cluster.write_file(&rel, &data);
            (rel, data)
        })
        .collect();
    let client = cluster.client().await;
    // The same directory mounted again with nothing packed (and another block size, so its
    // blocks have keys of their own rather than sharing the packed ones).
    let options = [("pack_threshold", "0"), ("block_size", "2MiB"), ("metadata_ttl", "10m")]
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .into_iter()
        .chain(cluster.ufs.mount_options())
        .collect();
    client.admin().add_mount("/plain", &cluster.ufs_uri(), options).await.expect("mount /plain");
    eventually("every worker knows /plain", Duration::from_secs(20), || async {
        let mut all = true;
        for i in 0..cluster.worker_count() {
            all &= cluster.worker(i).blocks.mounts().resolve("/plain/set").await.is_ok();
        }
        all
    })
    .await;

    let packed: Vec<(String, Vec<u8>)> =
        files.iter().map(|(rel, d)| (format!("/data/{rel}"), d.clone())).collect();
    let plain: Vec<(String, Vec<u8>)> =
        files.iter().map(|(rel, d)| (format!("/plain/{rel}"), d.clone())).collect();
    let started = Instant::now();
    read_all_exact(&client, &packed).await;
    read_all_exact(&client, &plain).await;
    // Everything on NVMe now (DRAM evictions were written back already; the rest is flushed).
    cluster.flush().await;
    let ufs_reads = cluster.ufs_reads();
    read_all_exact(&client, &packed).await;
    read_all_exact(&client, &plain).await;
    assert_eq!(cluster.ufs_reads(), ufs_reads, "the second pass came from the tiers");
    eprintln!("4 passes over {} files in {:?}", files.len(), started.elapsed());

    let small = sizes.iter().filter(|&&s| s > 0 && (s as u64) < MIB).count();
    // /plain: one block file per non-empty file (2 MiB blocks: two for the 4 MiB one); /data:
    // block files for the files of 1 MiB and more only.
    let plain_blocks: usize = sizes.iter().map(|&s| (s as u64).div_ceil(2 * MIB) as usize).sum();
    let big_blocks = sizes.iter().filter(|&&s| s as u64 >= MIB).count();
    let (mut containers, mut entries, mut block_files) = (0, 0, 0);
    for i in 0..cluster.worker_count() {
        let (c, e, b) = nvme_layout(&cluster.nvme_dir(i));
        containers += c;
        entries += e;
        block_files += b;
    }
    // Each small file once, packed (its /plain copy is a block file); the magic could only
    // appear by chance inside data, which these patterns do not produce.
    assert_eq!(entries, small, "every small file is one live entry");
    assert!(containers <= 3 * 4, "{containers} container files for {entries} entries");
    assert_eq!(block_files, plain_blocks + big_blocks, "/plain's blocks and /data's big ones are files");
    for i in 0..cluster.worker_count() {
        assert_eq!(cluster.worker(i).blocks.counters().corrupt_blocks, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rewritten_small_file_is_read_whole_in_its_new_version_after_the_ttl_never_mixed() {
    let mut opts = options(64 * MIB);
    opts.mount_options = vec![("metadata_ttl".into(), "1s".into())];
    let cluster = Cluster::start(opts).await;
    let old = pattern(200 * KIB as usize, 1);
    let new = pattern(200 * KIB as usize, 2);
    cluster.write_file("v/f.bin", &old);
    let client = cluster.client().await;
    assert_eq!(client.read_all("/data/v/f.bin").await.unwrap(), old);
    cluster.flush().await;
    // Same size, new bytes (and a new mtime: a local directory's version is mtime and size).
    std::thread::sleep(Duration::from_millis(20));
    cluster.write_file("v/f.bin", &new);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let got = client.read_all("/data/v/f.bin").await.unwrap();
        assert!(got == old || got == new, "a read mixed versions");
        if got == new {
            break;
        }
        assert!(Instant::now() < deadline, "the new version never showed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Both versions were cached as entries of their own; the old one is simply never read again.
    cluster.flush().await;
    let entries: usize = (0..cluster.worker_count()).map(|i| nvme_layout(&cluster.nvme_dir(i)).1).sum();
    assert_eq!(entries, 2, "one entry per version");
    assert_eq!(client.read_all("/data/v/f.bin").await.unwrap(), new);
}

/// Replaces one byte of `needle`'s first occurrence in any container file under `dir`;
/// returns whether it found one.
fn corrupt_in_containers(dir: &Path, needle: &[u8]) -> bool {
    let Ok(packs) = std::fs::read_dir(dir.join("packs")) else { return false };
    for f in packs.flatten() {
        let mut bytes = std::fs::read(f.path()).unwrap();
        if let Some(at) = bytes.windows(needle.len()).position(|w| w == needle) {
            bytes[at + needle.len() / 2] ^= 0x5a;
            std::fs::write(f.path(), bytes).unwrap();
            return true;
        }
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_corrupt_container_entry_is_detected_and_fetched_again() {
    // No DRAM tier: every read is an NVMe read (or a fetch).
    let cluster = Cluster::start(options(0)).await;
    let files: Vec<(String, Vec<u8>)> = (0..40)
        .map(|i| {
            let data = pattern(10 * KIB as usize + i * 13, 500 + i as u64);
            cluster.write_file(&format!("c/f{i}.bin"), &data);
            (format!("/data/c/f{i}.bin"), data)
        })
        .collect();
    let client = cluster.client().await;
    read_all_exact(&client, &files).await;
    cluster.flush().await;
    let victim = &files[17];
    let corrupted =
        (0..cluster.worker_count()).any(|i| corrupt_in_containers(&cluster.nvme_dir(i), &victim.1[..4096]));
    assert!(corrupted, "the file's bytes are in a container");
    // Every read of a packed entry checks it (entries are never sent zero-copy).
    let ufs_reads = cluster.ufs_reads();
    read_all_exact(&client, &files).await;
    assert_eq!(cluster.ufs_reads(), ufs_reads + 1, "only the corrupt file was fetched again");
    let corrupt: u64 =
        (0..cluster.worker_count()).map(|i| cluster.worker(i).blocks.counters().corrupt_blocks).sum();
    assert_eq!(corrupt, 1);
    // Fetched again into a new entry: the next read is a hit.
    read_all_exact(&client, &files).await;
    assert_eq!(cluster.ufs_reads(), ufs_reads + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_warmup_of_small_files_loads_them_in_batches_packed_on_nvme() {
    let cluster = Cluster::start(options(64 * MIB)).await;
    let files: Vec<(String, Vec<u8>)> = (0..1500)
        .map(|i| {
            let data = pattern(16 * KIB as usize, 7000 + i as u64);
            cluster.write_file(&format!("w/{:02}/f{i:04}.bin", i / 100), &data);
            (format!("/data/w/{:02}/f{i:04}.bin", i / 100), data)
        })
        .collect();
    let client = cluster.client().await;
    let job = client
        .admin()
        .submit_load("/data/w", LoadOptions { replicas: 1, ..Default::default() })
        .await
        .unwrap();
    let done = client.admin().wait_job(&job.id, Duration::from_millis(50), |_| {}).await.unwrap();
    assert_eq!(done.state(), JobState::Succeeded, "{done:?}");
    assert_eq!((done.files_done, done.blocks_done, done.files_failed), (1500, 1500, 0));
    // Loaded means on NVMe: every file is an entry, in a handful of containers, none a file.
    let (mut containers, mut entries, mut block_files) = (0, 0, 0);
    for i in 0..cluster.worker_count() {
        let (c, e, b) = nvme_layout(&cluster.nvme_dir(i));
        containers += c;
        entries += e;
        block_files += b;
    }
    assert_eq!((entries, block_files), (1500, 0));
    assert!(containers <= 3, "{containers} containers");
    let ufs_reads = cluster.ufs_reads();
    read_all_exact(&client, &files).await;
    assert_eq!(cluster.ufs_reads(), ufs_reads, "every read was a hit");
}
