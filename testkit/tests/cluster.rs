//! End-to-end tests over an in-process cluster (master + workers on 127.0.0.1:0, UFS = a temp
//! directory through opendal's fs service).

use std::time::Duration;

use proptest::prelude::*;
use strata_client::ClientError;
use strata_testkit::{Cluster, ClusterOptions, eventually, pattern};

const MIB: usize = 1 << 20;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap()
}

#[test]
fn random_ranges_read_through_the_cluster_equal_the_source() {
    let rt = rt();
    let cluster = rt.block_on(Cluster::start(ClusterOptions::default()));
    let sizes = [0usize, 1, MIB, MIB + 1, 50 * MIB];
    let files: Vec<(String, Vec<u8>)> = sizes
        .iter()
        .enumerate()
        .map(|(i, &size)| {
            let name = format!("sizes/f{i}.bin");
            let data = pattern(size, i as u64 + 1);
            cluster.write_file(&name, &data);
            (format!("/data/{name}"), data)
        })
        .collect();
    let client = rt.block_on(cluster.client());
    // Whole files first, including the empty one.
    for (path, data) in &files {
        let got = rt.block_on(client.read_all(path)).unwrap();
        assert_eq!(got.len(), data.len(), "{path}");
        assert!(got[..] == data[..], "{path} differs");
    }
    let mut runner =
        proptest::test_runner::TestRunner::new(ProptestConfig { cases: 200, ..ProptestConfig::default() });
    runner
        .run(&(0usize..files.len(), any::<u64>(), any::<u64>()), |(f, a, b)| {
            let (path, data) = &files[f];
            let size = data.len() as u64;
            // Offsets up to a block past the end, lengths up to 3 blocks.
            let offset = a % (size + MIB as u64 + 1);
            let len = b % (3 * MIB as u64 + 2);
            let got = rt.block_on(client.read_range(path, offset, len)).unwrap();
            let start = (offset as usize).min(data.len());
            let end = (offset.saturating_add(len) as usize).min(data.len());
            prop_assert_eq!(got.len(), end - start);
            prop_assert!(got[..] == data[start..end], "{} [{}+{}] differs", path, offset, len);
            // The same range received straight into a caller's buffer; the bytes past it stay
            // untouched.
            let info = rt.block_on(client.stat(path)).unwrap();
            let n = end - start;
            let mut buf = vec![0xA5u8; n + 3];
            rt.block_on(client.read_into(&info, start as u64, &mut buf[..n])).unwrap();
            prop_assert!(
                buf[..n] == data[start..end],
                "{} [{}+{}] differs read into a buffer",
                path,
                offset,
                len
            );
            prop_assert!(buf[n..].iter().all(|&b| b == 0xA5), "bytes past the read were written");
            Ok(())
        })
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn second_read_is_served_from_the_tiers() {
    let cluster = Cluster::start(ClusterOptions::default()).await;
    let data = pattern(10 * MIB + 123, 7);
    cluster.write_file("warm.bin", &data);
    let client = cluster.client().await;
    assert_eq!(client.read_all("/data/warm.bin").await.unwrap(), data);
    let after_first = cluster.ufs_reads();
    assert_eq!(after_first, 11, "one UFS read per block");
    for _ in 0..3 {
        assert_eq!(client.read_all("/data/warm.bin").await.unwrap(), data);
        assert_eq!(
            client.read_range("/data/warm.bin", 5 * MIB as u64 - 3, 7).await.unwrap(),
            data[5 * MIB - 3..5 * MIB + 4]
        );
    }
    assert_eq!(cluster.ufs_reads(), after_first, "warm reads must not touch the UFS");

    // A reader's chunks are the file in order, each up to the end of its block, mixed with
    // reads and seeks.
    {
        use tokio::io::{AsyncReadExt, AsyncSeekExt};
        let mut reader = client.open("/data/warm.bin").await.unwrap();
        let mut head = [0u8; 100];
        reader.read_exact(&mut head).await.unwrap();
        let mut got = head.to_vec();
        while let Some(chunk) = reader.next_chunk().await.unwrap() {
            assert!(!chunk.is_empty());
            assert_eq!((got.len() + chunk.len()) % MIB, data.len().min(got.len() + chunk.len()) % MIB);
            got.extend_from_slice(&chunk);
        }
        assert!(got == data, "chunks differ from the file");
        reader.seek(std::io::SeekFrom::Start(3 * MIB as u64 - 5)).await.unwrap();
        assert_eq!(reader.next_chunk().await.unwrap().unwrap(), data[3 * MIB - 5..3 * MIB]);
        assert_eq!(reader.next_chunk().await.unwrap().unwrap(), data[3 * MIB..4 * MIB]);
    }

    // The master's status sums the workers' counters (reported by heartbeat).
    // Misses are reported long before the last hits: wait for both.
    eventually("a heartbeat reported the misses and hits", Duration::from_secs(20), || async {
        let totals = client.admin().status().await.unwrap().totals.unwrap();
        totals.cache_misses >= 11 && totals.cache_hits >= 33
    })
    .await;
    let status = client.admin().status().await.unwrap();
    let totals = status.totals.unwrap();
    assert_eq!(totals.cache_misses, 11);
    assert_eq!(totals.ufs_bytes_read, data.len() as u64);
    assert!(totals.cache_hits >= 33, "{totals:?}");
    // Each worker serves Prometheus metrics and a health check on its HTTP port.
    let metrics = http_get(cluster.worker(0).http_addr, "/metrics").await;
    assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
    assert!(metrics.contains("strata_worker_cache_misses_total"), "{metrics}");
    assert!(metrics.contains("strata_worker_ufs_bytes_total"), "{metrics}");
    let health = http_get(cluster.worker(1).http_addr, "/health").await;
    assert!(health.starts_with("HTTP/1.1 200") && health.ends_with("ok\n"), "{health}");
    // The block map knows where the blocks are.
    let locations = client.admin().block_locations("/data/warm.bin").await.unwrap();
    assert_eq!(locations.blocks.len(), 11);
    assert!(locations.blocks.iter().all(|b| !b.replicas.is_empty()));
}

async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_cold_readers_fetch_each_block_once() {
    let cluster = Cluster::start(ClusterOptions::default()).await;
    let data = pattern(20 * MIB + 5, 11);
    cluster.write_file("hot.bin", &data);
    // Slow UFS reads widen the window in which the 32 readers overlap.
    cluster.faults().read_delay_ms.store(50, std::sync::atomic::Ordering::SeqCst);
    let client = cluster.client().await;
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move { client.read_all("/data/hot.bin").await })
        })
        .collect();
    for t in tasks {
        assert!(t.await.unwrap().unwrap() == data[..]);
    }
    // A worker that did not answer in time makes the client ask the next one (a failover, or a
    // hedge), which may fetch the block too; without either, every block was fetched once.
    let asked_twice = client.failovers() + client.hedged_reads();
    if asked_twice == 0 {
        assert_eq!(cluster.ufs_reads(), 21, "exactly one UFS fetch per block");
    } else {
        eprintln!("{asked_twice} failovers and hedges under load; UFS reads {}", cluster.ufs_reads());
        assert!(cluster.ufs_reads() <= 21 + asked_twice);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn restarted_workers_serve_their_nvme_blocks_without_the_ufs() {
    let opts = ClusterOptions { memory_capacity: 4 * MIB as u64, ..ClusterOptions::default() };
    let mut cluster = Cluster::start(opts).await;
    let data = pattern(12 * MIB, 3);
    cluster.write_file("persist.bin", &data);
    let client = cluster.client().await;
    assert_eq!(client.read_all("/data/persist.bin").await.unwrap(), data);
    cluster.flush().await;
    let before = cluster.ufs_reads();
    let ids: Vec<String> = (0..3).map(|i| cluster.worker(i).worker_id.clone()).collect();
    for (i, id) in ids.iter().enumerate() {
        cluster.restart_worker(i).await;
        assert_eq!(&cluster.worker(i).worker_id, id, "a restarted worker keeps its id");
    }
    cluster.wait_for_live_workers(3).await;
    client.refresh_view().await.unwrap(); // the new ports
    assert_eq!(client.read_all("/data/persist.bin").await.unwrap(), data);
    assert_eq!(cluster.ufs_reads(), before, "restarted workers served from NVMe");
}

fn block_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "blk") {
                out.push(p);
            }
        }
    }
    out
}

/// A one-worker cluster holding `data` as one NVMe block file of its own (not packed), with
/// the data byte at `rot_at` flipped and the worker restarted, so DRAM is empty and the block
/// unverified; and a client that knows the restarted worker.
async fn one_rotten_nvme_block(name: &str, data: &[u8], rot_at: usize) -> (Cluster, strata_client::Client) {
    let opts = ClusterOptions {
        workers: 1,
        mount_options: vec![("pack_threshold".into(), "0".into())],
        ..ClusterOptions::default()
    };
    let mut cluster = Cluster::start(opts).await;
    cluster.write_file(name, data);
    let client = cluster.client().await;
    assert_eq!(client.read_all(&format!("/data/{name}")).await.unwrap(), data);
    cluster.flush().await;
    let files = block_files(&cluster.nvme_dir(0));
    assert_eq!(files.len(), 1, "one block on NVMe");
    // The file is a small header, the data, then 4 bytes of checksum per 64 KiB.
    let mut raw = std::fs::read(&files[0]).unwrap();
    let header = raw.len() - data.len() - 4 * data.len().div_ceil(65536);
    raw[header + rot_at] ^= 0xff;
    std::fs::write(&files[0], &raw).unwrap();
    cluster.restart_worker(0).await;
    cluster.wait_for_live_workers(1).await;
    client.refresh_view().await.unwrap(); // the restarted worker's new port
    (cluster, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_corrupted_nvme_block_is_detected_and_refetched() {
    // A block file of its own (packed small files: tests/small_files.rs).
    let data = pattern(MIB / 2, 5);
    let (cluster, client) = one_rotten_nvme_block("c.bin", &data, MIB / 4).await;
    let before = cluster.ufs_reads();
    assert_eq!(client.read_all("/data/c.bin").await.unwrap(), data, "corrupt bytes are never served");
    assert_eq!(cluster.ufs_reads(), before + 1, "the corrupt block was fetched again");
    assert_eq!(cluster.worker(0).blocks.counters().corrupt_blocks, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_small_read_of_an_nvme_block_checks_only_its_own_64_kib() {
    // Rot in the data's sixth 64 KiB chunk.
    let data = pattern(4 * MIB, 6);
    let (cluster, client) = one_rotten_nvme_block("r.bin", &data, 5 * 65536 + 100).await;
    let before = cluster.ufs_reads();

    // 4 KiB across the first two chunks: served from NVMe with those two checked; a check of
    // the whole block would have found the rot.
    let off = 65536 - 2048;
    let got = client.read_range("/data/r.bin", off, 4096).await.unwrap();
    assert!(got[..] == data[off as usize..off as usize + 4096]);
    assert_eq!(cluster.ufs_reads(), before, "served from NVMe");
    assert_eq!(cluster.worker(0).blocks.counters().corrupt_blocks, 0);

    // 4 KiB in the rotten chunk: detected, dropped, fetched again; the bytes are right. (This
    // second hit also promotes the block to DRAM, which reads and checks it whole.)
    let off = 5 * 65536 + 64;
    let got = client.read_range("/data/r.bin", off, 4096).await.unwrap();
    assert!(got[..] == data[off as usize..off as usize + 4096], "corrupt bytes are never served");
    assert_eq!(cluster.worker(0).blocks.counters().corrupt_blocks, 1);
    assert_eq!(cluster.ufs_reads(), before + 1, "the corrupt block was fetched again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn blocks_read_by_clients_reach_nvme_when_dram_evicts_them_or_at_flush() {
    // DRAM holds 3 of the file's 8 blocks; idle write-back is pushed out of the test's way.
    let opts = ClusterOptions { workers: 1, memory_capacity: 3 * MIB as u64, ..ClusterOptions::default() };
    let mut cluster = Cluster::start(opts).await;
    let store = cluster.worker(0).blocks.cache().clone();
    store.set_writeback_idle(Duration::from_secs(3600));
    let data = pattern(8 * MIB, 31);
    cluster.write_file("wb.bin", &data);
    let client = cluster.client().await;
    assert_eq!(client.read_all("/data/wb.bin").await.unwrap(), data);
    store.nvme_writes_settled().await;
    let nvme_blocks = |c: &Cluster| c.worker(0).blocks.cache().tier_usage().1.blocks;
    assert_eq!(nvme_blocks(&cluster), 5, "exactly the 5 blocks DRAM evicted were written");
    assert_eq!(store.dirty_blocks(), 3, "the 3 in DRAM wait");
    store.flush().await;
    assert_eq!(nvme_blocks(&cluster), 8, "flush writes the rest");
    assert_eq!(store.dirty_blocks(), 0);

    // None was lost on the way: after a restart every block comes from NVMe.
    let ufs_reads = cluster.ufs_reads();
    cluster.restart_worker(0).await;
    cluster.wait_for_live_workers(1).await;
    assert_eq!(client.read_all("/data/wb.bin").await.unwrap(), data);
    assert_eq!(cluster.ufs_reads(), ufs_reads);

    // Quiet reads hand dirty blocks to the idle writer.
    let more = pattern(2 * MIB, 32);
    cluster.write_file("wb2.bin", &more);
    let store = cluster.worker(0).blocks.cache().clone();
    store.set_writeback_idle(Duration::from_millis(50));
    assert_eq!(client.read_all("/data/wb2.bin").await.unwrap(), more);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while store.dirty_blocks() > 0 {
        assert!(std::time::Instant::now() < deadline, "idle write-back never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn verified_nvme_blocks_are_sent_from_their_files_and_unverified_ones_are_checked_first() {
    // No DRAM tier: every hit after the first read is an NVMe hit.
    let opts = ClusterOptions { workers: 1, memory_capacity: 0, ..ClusterOptions::default() };
    let mut cluster = Cluster::start(opts).await;
    let data = pattern(5 * MIB + 4321, 21);
    cluster.write_file("z.bin", &data);
    let client = cluster.client().await;
    assert_eq!(client.read_all("/data/z.bin").await.unwrap(), data);
    cluster.flush().await;
    let ufs_reads = cluster.ufs_reads();
    let zero_copy = |c: &Cluster| c.worker(0).blocks.counters().zero_copy_bytes;

    // Written by this worker from memory: verified, so sent with sendfile.
    assert_eq!(client.read_all("/data/z.bin").await.unwrap(), data);
    assert_eq!(zero_copy(&cluster), data.len() as u64, "every byte came from the block files");
    for (offset, len) in [(0, 1), (MIB - 3, 7), (2 * MIB + 5, MIB), (5 * MIB, 4321), (4 * MIB + 17, 99_999)] {
        let got = client.read_range("/data/z.bin", offset as u64, len as u64).await.unwrap();
        assert_eq!(&got[..], &data[offset..offset + len], "range {offset}+{len}");
    }
    assert_eq!(cluster.ufs_reads(), ufs_reads, "no block was fetched again");

    // After a restart nothing is verified: the first read checks every block (no sendfile),
    // the next one sends them from their files.
    cluster.restart_worker(0).await;
    cluster.wait_for_live_workers(1).await;
    assert_eq!(client.read_all("/data/z.bin").await.unwrap(), data);
    assert_eq!(zero_copy(&cluster), 0, "unverified blocks go through the checksum");
    assert_eq!(client.read_all("/data/z.bin").await.unwrap(), data);
    assert_eq!(zero_copy(&cluster), data.len() as u64);

    // Turned off, every read goes through the checksum again.
    cluster.worker(0).blocks.cache().set_zero_copy(false);
    assert_eq!(client.read_all("/data/z.bin").await.unwrap(), data);
    assert_eq!(zero_copy(&cluster), data.len() as u64);
    assert_eq!(cluster.ufs_reads(), ufs_reads);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_killed_mid_read_costs_no_read_and_leaves_the_ring() {
    let mut cluster =
        Cluster::start(ClusterOptions { worker_timeout_ms: 2_000, ..ClusterOptions::default() }).await;
    let data = std::sync::Arc::new(pattern(24 * MIB, 9));
    cluster.write_file("big.bin", &data);
    cluster.faults().read_delay_ms.store(30, std::sync::atomic::Ordering::SeqCst);
    let client = cluster.client().await;
    let rounds_done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let readers: Vec<_> = (0..4)
        .map(|i| {
            let client = client.clone();
            let data = data.clone();
            let rounds_done = rounds_done.clone();
            tokio::spawn(async move {
                for round in 0..6u64 {
                    let off = (i * 3 + round) * 1_000_003 % (20 * MIB as u64);
                    let got = client.read_range("/data/big.bin", off, 3 * MIB as u64).await.unwrap();
                    assert!(
                        got[..] == data[off as usize..off as usize + 3 * MIB],
                        "reader {i} round {round}"
                    );
                    rounds_done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
            })
        })
        .collect();
    // Kill it while the readers are in their rounds (each needs ~5 UFS-delayed blocks).
    eventually("the readers got going", Duration::from_secs(30), || async {
        rounds_done.load(std::sync::atomic::Ordering::SeqCst) >= 1
    })
    .await;
    let victim = cluster.worker(1).worker_id.clone();
    cluster.kill_worker(1).await;
    for r in readers {
        r.await.expect("every read returned correct bytes");
    }
    // After the liveness timeout the master drops it and clients stop placing blocks on it.
    cluster.wait_for_live_workers(2).await;
    client.refresh_view().await.unwrap();
    let ring = client.ring().await.unwrap();
    assert!(!ring.contains(&victim));
    assert_eq!(ring.members().len(), 2);
    let status = client.admin().status().await.unwrap();
    assert!(status.workers.iter().any(|w| w.id == victim && !w.live));
    assert_eq!(client.read_all("/data/big.bin").await.unwrap()[..], data[..]);
}

/// A worker that accepts requests and never answers (a stopped process, a hung disk) must not
/// hold reads: each is hedged to the next owner within the hedging deadline, and after two
/// outruns the client asks that worker last.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_worker_fails_no_read_and_holds_none_past_its_hedging_deadline() {
    use std::sync::Arc;
    use strata_client::{Client, Credentials, Dial, FaultyTransport, HedgePolicy, TcpTransport};

    let cluster = Cluster::start(ClusterOptions::default()).await;
    let files: Vec<(String, Vec<u8>)> = (0..24)
        .map(|i| {
            let data = pattern(256 * 1024 + i * 17, i as u64 + 40);
            cluster.write_file(&format!("frozen/f{i}.bin"), &data);
            (format!("/data/frozen/f{i}.bin"), data)
        })
        .collect();
    let mut config = cluster.client_config();
    let hedge = HedgePolicy { min: Duration::from_millis(20), max: Duration::from_millis(300) };
    config.hedge = hedge;
    let dial = Dial {
        connect_timeout: config.connect_timeout,
        tls: None,
        credentials: Credentials::token(config.token.as_ref().map(|t| t.0.as_str())),
    };
    let faulty = Arc::new(FaultyTransport::new(Arc::new(TcpTransport::new(dial, config.request_timeout))));
    let client = Client::connect_with_transport(config, faulty.clone()).await.unwrap();
    for (path, data) in &files {
        assert_eq!(client.read_all(path).await.unwrap()[..], data[..], "{path} cold");
    }
    assert_eq!(client.hedged_reads(), 0, "healthy workers answer within their deadline");

    let frozen = cluster.worker(0).data_addr.to_string();
    faulty.frozen.lock().unwrap().push(frozen.clone());
    let mut slowest = Duration::ZERO;
    for round in 0..3 {
        for (path, data) in &files {
            let started = std::time::Instant::now();
            let got = client.read_all(path).await.unwrap_or_else(|e| panic!("{path} round {round}: {e}"));
            slowest = slowest.max(started.elapsed());
            assert_eq!(got[..], data[..], "{path} round {round}");
        }
    }
    let hedged = client.hedged_reads();
    assert!(hedged >= 2, "reads the frozen worker owns were hedged ({hedged})");
    // Suspect after two outruns, the frozen worker is asked last: a few hedges, not one per
    // read of its blocks (a third of 72 reads).
    assert!(hedged <= 6, "{hedged} hedges: the frozen worker kept being asked first");
    assert!(
        slowest < hedge.max + Duration::from_millis(600),
        "a read waited {slowest:?} on a frozen worker (hedging after at most {:?})",
        hedge.max
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_master_keeps_mounts_and_reads_continue() {
    let mut cluster = Cluster::start(ClusterOptions::default()).await;
    let data = pattern(3 * MIB, 21);
    cluster.write_file("m.bin", &data);
    let client = cluster.client().await;
    let same_blocks = [("block_size".to_string(), "1MiB".to_string())].into();
    client.admin().add_mount("/second", &cluster.ufs_uri(), same_blocks).await.unwrap();
    assert_eq!(client.read_all("/data/m.bin").await.unwrap(), data);

    cluster.stop_master().await;
    // Cached reads do not need the master: metadata and membership are cached in the client.
    assert_eq!(client.read_all("/data/m.bin").await.unwrap(), data);

    cluster.start_master().await;
    let mounts: Vec<String> =
        cluster.client().await.admin().mounts().await.unwrap().into_iter().map(|m| m.path).collect();
    assert_eq!(mounts, vec!["/data".to_string(), "/second".to_string()]);
    cluster.wait_for_live_workers(3).await;
    // Workers re-report their blocks after re-registering.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let status = client.admin().status().await.unwrap();
        if status.blocks >= 3 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "blocks were not re-reported");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let before = cluster.ufs_reads();
    assert_eq!(client.read_all("/second/m.bin").await.unwrap(), data);
    assert_eq!(client.read_all("/data/m.bin").await.unwrap(), data);
    assert_eq!(cluster.ufs_reads(), before, "both mounts share the cached blocks of one UFS object");
}

fn set_mtime(path: &std::path::Path, secs_from_epoch: u64) {
    let f = std::fs::File::options().write(true).open(path).unwrap();
    f.set_modified(std::time::UNIX_EPOCH + Duration::from_secs(secs_from_epoch)).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_changed_file_is_read_whole_in_its_new_version() {
    let cluster = Cluster::start(ClusterOptions::default()).await;
    let client = cluster.client().await;
    client
        .admin()
        .add_mount(
            "/fresh",
            &cluster.ufs_uri(),
            [
                ("metadata_ttl".to_string(), "300ms".to_string()),
                ("block_size".to_string(), "1MiB".to_string()),
            ]
            .into(),
        )
        .await
        .unwrap();
    let v1 = pattern(2 * MIB, 1);
    let v2 = pattern(2 * MIB, 2);
    let path = cluster.write_file("v.bin", &v1);
    set_mtime(&path, 1_000_000);
    assert_eq!(client.read_all("/fresh/v.bin").await.unwrap(), v1);
    // Only the first block of v2's predecessor gets cached by this partial read... then the
    // object changes under the same size.
    std::fs::write(&path, &v2).unwrap();
    set_mtime(&path, 2_000_000);
    // Within the TTL the old version may still be served, but only whole.
    let within = client.read_all("/fresh/v.bin").await.unwrap();
    assert!(within[..] == v1[..] || within[..] == v2[..], "a read mixed versions");
    // Once the 300 ms TTL has passed (on the client and the master), the new version is read;
    // every read until then is one whole version.
    eventually("the new version is read after the TTL", Duration::from_secs(20), || async {
        let got = client.read_all("/fresh/v.bin").await.unwrap();
        assert!(got[..] == v1[..] || got[..] == v2[..], "a read mixed versions");
        got[..] == v2[..]
    })
    .await;

    // A block missing from the cache is fetched against the version the client holds: when
    // the object changed, the worker refuses, and the client re-reads everything at the new
    // version instead of stitching old and new blocks together.
    let v3 = pattern(2 * MIB, 3);
    let path = cluster.write_file("w.bin", &v1);
    set_mtime(&path, 1_000_000);
    assert_eq!(client.read_range("/fresh/w.bin", 0, 10).await.unwrap(), v1[..10]);
    std::fs::write(&path, &v3).unwrap();
    set_mtime(&path, 3_000_000);
    let got = client.read_all("/fresh/w.bin").await.unwrap();
    assert!(got[..] == v3[..], "expected the whole new version");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_paths_and_lengths_get_clear_errors() {
    let cluster = Cluster::start(ClusterOptions { workers: 1, ..ClusterOptions::default() }).await;
    let data = pattern(1000, 4);
    cluster.write_file("small.bin", &data);
    let client = cluster.client().await;
    for bad in ["/data/../etc/passwd", "data/small.bin", "", "/data/./small.bin"] {
        let e = client.read_all(bad).await.unwrap_err();
        assert!(matches!(e, ClientError::InvalidArgument(_)), "{bad:?}: {e}");
    }
    let e = client.read_all("/nomount/x").await.unwrap_err();
    assert!(matches!(&e, ClientError::NotFound(m) if m.contains("not under any mount")), "{e}");
    let e = client.read_all("/data/missing.bin").await.unwrap_err();
    assert!(matches!(e, ClientError::NotFound(_)), "{e}");
    let e = client.read_all("/data").await.unwrap_err();
    assert!(matches!(e, ClientError::IsDirectory(_)), "{e}");
    assert!(client.read_range("/data/small.bin", 10, 0).await.unwrap().is_empty());
    assert_eq!(client.read_range("/data/small.bin", 990, u64::MAX).await.unwrap(), data[990..]);
    assert!(client.read_range("/data/small.bin", 5000, 10).await.unwrap().is_empty());

    let mut small = cluster.client_config();
    small.max_read_len = 100;
    let limited = strata_client::Client::connect(small).await.unwrap();
    let e = limited.read_all("/data/small.bin").await.unwrap_err();
    assert!(matches!(&e, ClientError::InvalidArgument(m) if m.contains("exceeds")), "{e}");

    // Mount table validation.
    for (path, uri, what) in [
        ("relative", "file:///tmp", "absolute"),
        ("/a/../b", "file:///tmp", ".."),
        ("/x", "ftp://host/dir", "unsupported"),
        ("/data", "file:///tmp", "already mounted"),
        ("/data/inner", "file:///tmp", "nest"),
        ("/y", "file:///definitely/not/here", "file:///definitely/not/here"),
    ] {
        let e = client.admin().add_mount(path, uri, Default::default()).await.unwrap_err();
        assert!(e.to_string().contains(what), "{path} {uri}: {e}");
    }
    let e = client.admin().remove_mount("/never").await.unwrap_err();
    assert!(matches!(e, ClientError::NotFound(_)), "{e}");
}

mod raw_frames {
    use super::*;
    use strata_common::ErrorKind;
    use strata_common::frame::{RESPONSE_HEADER_LEN, ReadBlockRequest, ResponseHeader};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    async fn response(s: &mut TcpStream) -> (ResponseHeader, Vec<u8>) {
        let mut h = [0u8; RESPONSE_HEADER_LEN];
        s.read_exact(&mut h).await.unwrap();
        let h = ResponseHeader::decode(&h).unwrap();
        let mut body = vec![0u8; h.payload_len as usize];
        s.read_exact(&mut body).await.unwrap();
        (h, body)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn malformed_frames_get_error_frames_and_the_worker_keeps_serving() {
        let cluster = Cluster::start(ClusterOptions { workers: 1, ..ClusterOptions::default() }).await;
        let data = pattern(5000, 8);
        cluster.write_file("f.bin", &data);
        let client = cluster.client().await;
        let info = client.stat("/data/f.bin").await.unwrap();
        let addr = cluster.worker(0).data_addr;
        let good = ReadBlockRequest {
            req_id: 7,
            path: "/data/f.bin".into(),
            version: info.version.clone(),
            file_size: info.size,
            block_size: info.block_size,
            block_index: 0,
            offset: 100,
            len: 50,
        };

        // Garbage: an error frame, then the connection is closed.
        let mut s = cluster.dial(addr).await;
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
        let (h, msg) = response(&mut s).await;
        assert_eq!(h.status, Err(ErrorKind::BadFrame));
        assert!(String::from_utf8_lossy(&msg).contains("magic"));
        let mut rest = Vec::new();
        assert_eq!(s.read_to_end(&mut rest).await.unwrap(), 0, "connection closed");

        // A truncated body inside a well-formed header.
        let mut s = cluster.dial(addr).await;
        let mut frame = good.encode();
        let body_len = (frame.len() - 12) as u32 - 5;
        frame[8..12].copy_from_slice(&body_len.to_le_bytes());
        frame.truncate(frame.len() - 5);
        s.write_all(&frame).await.unwrap();
        let (h, _) = response(&mut s).await;
        assert_eq!(h.status, Err(ErrorKind::BadFrame));

        // Well-formed but wrong requests: error frames, the connection stays usable.
        let mut s = cluster.dial(addr).await;
        for (bad, kind) in [
            (ReadBlockRequest { len: 0, ..good.clone() }, ErrorKind::InvalidArgument),
            (ReadBlockRequest { len: u64::MAX, ..good.clone() }, ErrorKind::InvalidArgument),
            (ReadBlockRequest { block_index: 99, ..good.clone() }, ErrorKind::InvalidArgument),
            (ReadBlockRequest { path: "/data/../f.bin".into(), ..good.clone() }, ErrorKind::InvalidArgument),
            (ReadBlockRequest { path: "/elsewhere/f.bin".into(), ..good.clone() }, ErrorKind::NotFound),
            (ReadBlockRequest { block_size: 4096, ..good.clone() }, ErrorKind::InvalidArgument),
            (ReadBlockRequest { version: "m1-s5000".into(), ..good.clone() }, ErrorKind::VersionChanged),
        ] {
            s.write_all(&bad.encode()).await.unwrap();
            let (h, msg) = response(&mut s).await;
            assert_eq!(h.status, Err(kind), "{bad:?}: {}", String::from_utf8_lossy(&msg));
            assert_eq!(h.req_id, 7);
        }
        s.write_all(&good.encode()).await.unwrap();
        let (h, body) = response(&mut s).await;
        assert!(h.status.is_ok());
        assert_eq!(body, data[100..150]);

        // And everyone else was served all along.
        assert_eq!(client.read_all("/data/f.bin").await.unwrap(), data);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sequential_reader_fetches_ahead_and_its_window_doubles_with_each_block() {
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use strata_client::{Client, Credentials, Dial, FaultyTransport, TcpTransport};

    let cluster = Cluster::start(ClusterOptions::default()).await;
    let blocks = 24;
    let data = pattern(blocks * MIB, 77);
    cluster.write_file("ahead.bin", &data);
    let mut config = cluster.client_config();
    config.readahead_blocks = 8;
    let dial = Dial {
        connect_timeout: config.connect_timeout,
        tls: None,
        credentials: Credentials::token(config.token.as_ref().map(|t| t.0.as_str())),
    };
    // Injects no fault: it records the highest block asked around the real TCP transport.
    let asked = Arc::new(FaultyTransport::new(Arc::new(TcpTransport::new(dial, config.request_timeout))));
    let highest = || asked.highest_block_asked.load(Ordering::SeqCst);
    let client = Client::connect_with_transport(config, asked.clone()).await.unwrap();
    let mut reader = client.open("/data/ahead.bin").await.unwrap();
    assert_eq!(reader.info().block_size, MIB as u64, "the harness mounts /data with 1 MiB blocks");

    let mut got = Vec::with_capacity(data.len());
    // Blocks 0..=3 read one after another: windows 0 (the first block tells nothing), 1, 2, 4.
    for _ in 0..4 {
        got.extend_from_slice(&reader.next_chunk().await.unwrap().expect("a block"));
    }
    eventually("the reader fetches four blocks past block 3", Duration::from_secs(10), || async {
        highest() >= 7
    })
    .await;
    // The next one doubles the window to the client's limit of 8 blocks ahead.
    got.extend_from_slice(&reader.next_chunk().await.unwrap().expect("a block"));
    eventually("the reader fetches eight blocks past block 4", Duration::from_secs(10), || async {
        highest() >= 12
    })
    .await;
    while let Some(chunk) = reader.next_chunk().await.unwrap() {
        got.extend_from_slice(&chunk);
    }
    assert!(got == data, "the bytes read ahead are the file's");
    assert_eq!(highest(), blocks as u64 - 1, "nothing is asked past the last block");
}
