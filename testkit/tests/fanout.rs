//! Checkpoint load fan-out (issue 15): many processes loading one large file at the same moment
//! — each with its own client, straight from the cluster or through its pod's sidecar — cost the
//! UFS one read of each block, however many readers, sidecars and workers ask at once.
//!
//! Every reader is a separate `Client` (as separate processes are), all start together, and
//! each UFS read is slowed down so that their misses overlap: the test then checks the bytes
//! every reader got and, per block, how many times the UFS was read (the harness counts reads
//! per object and range). Each case runs with a DRAM tier and without one (blocks kept on NVMe
//! only), where a fetched block is in no tier until its NVMe write ends: some blocks were
//! fetched twice that way before the single flight stayed open until the write ended.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use strata_client::{Client, ClientConfig};
use strata_testkit::{Cluster, ClusterOptions, pattern};
use strata_worker::WorkerConfig;
use strata_worker::sidecar::{self, SidecarHandle};

const MIB: u64 = 1 << 20;
/// The harness's mount has 1 MiB blocks: 48 whole blocks and a short last one.
const BLOCK: u64 = MIB;
const SIZE: u64 = 48 * MIB + 4321;
const REL: &str = "ckpt/model.safetensors";
const PATH: &str = "/data/ckpt/model.safetensors";
/// Each UFS read first waits this long, so the readers' misses of a block overlap.
const UFS_READ_DELAY_MS: u64 = 50;

fn blocks() -> u64 {
    SIZE.div_ceil(BLOCK)
}

/// Where workers and sidecars keep blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tiers {
    /// DRAM over NVMe (the harness's defaults for workers; DRAM only for sidecars).
    Dram,
    /// No DRAM tier: NVMe only.
    NvmeOnly,
}

/// A cluster of 3 workers holding the checkpoint, its UFS reads slowed down.
async fn cluster_with_checkpoint(tiers: Tiers) -> (Cluster, Arc<Vec<u8>>) {
    let mut opts = ClusterOptions::default();
    if tiers == Tiers::NvmeOnly {
        opts.memory_capacity = 0;
    }
    let cluster = Cluster::start(opts).await;
    let data = Arc::new(pattern(SIZE as usize, 15));
    cluster.write_file(REL, &data);
    cluster.faults().read_delay_ms.store(UFS_READ_DELAY_MS, Ordering::SeqCst);
    (cluster, data)
}

/// Reads the checkpoint whole with each client, all starting at the same moment; returns what
/// each got and its failover count.
async fn load_concurrently(clients: Vec<Client>) -> Vec<(Bytes, u64)> {
    let start = Arc::new(tokio::sync::Barrier::new(clients.len()));
    let readers: Vec<_> = clients
        .into_iter()
        .map(|client| {
            let start = start.clone();
            tokio::spawn(async move {
                start.wait().await;
                let bytes = client.read_all(PATH).await.expect("checkpoint read");
                (bytes, client.failovers())
            })
        })
        .collect();
    let mut out = Vec::new();
    for r in readers {
        out.push(r.await.expect("reader task"));
    }
    out
}

fn assert_every_reader_got_the_file(got: &[(Bytes, u64)], data: &[u8]) {
    for (i, (bytes, failovers)) in got.iter().enumerate() {
        assert_eq!(bytes.len(), data.len(), "reader {i}: length");
        assert!(bytes[..] == data[..], "reader {i}: the bytes differ from the file");
        // A failover would send a block to a second worker, which fetches it again.
        assert_eq!(*failovers, 0, "reader {i} failed over to another worker");
    }
}

/// The UFS was read exactly once per block, each read exactly the block's range.
fn assert_each_block_read_once(cluster: &Cluster) {
    let expected: Vec<(Range<u64>, u64)> =
        (0..blocks()).map(|i| (i * BLOCK..((i + 1) * BLOCK).min(SIZE), 1)).collect();
    let reads = cluster.range_reads().of(REL);
    if reads != expected {
        let wrong: Vec<String> = expected
            .iter()
            .map(|(r, _)| (r, reads.iter().find(|(got, _)| got == r).map_or(0, |(_, n)| *n)))
            .filter(|(_, n)| *n != 1)
            .map(|(r, n)| format!("block {} read {n} times", r.start / BLOCK))
            .chain(
                reads
                    .iter()
                    .filter(|(r, _)| !expected.iter().any(|(e, _)| e == r))
                    .map(|(r, n)| format!("range {r:?} (not a block) read {n} times")),
            )
            .collect();
        let more = wrong.len().saturating_sub(8);
        let tail = if more > 0 { format!("; and {more} more") } else { String::new() };
        panic!(
            "each block must come from the UFS exactly once: {}{tail}",
            wrong[..wrong.len().min(8)].join("; ")
        );
    }
    assert_eq!(cluster.counters().bytes_read(), SIZE, "UFS bytes read in all");
}

/// Cache misses the workers counted: more than the blocks when concurrent misses of a block
/// joined one fetch, which is what these tests are about.
fn worker_misses(cluster: &Cluster) -> u64 {
    (0..cluster.worker_count()).map(|i| cluster.worker(i).blocks.counters().cache_misses).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_clients_loading_one_checkpoint_fetch_each_block_from_the_ufs_once() {
    eight_clients(Tiers::Dram).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_clients_of_workers_without_dram_fetch_each_block_from_the_ufs_once() {
    eight_clients(Tiers::NvmeOnly).await;
}

async fn eight_clients(tiers: Tiers) {
    let (cluster, data) = cluster_with_checkpoint(tiers).await;
    let mut clients = Vec::new();
    for _ in 0..8 {
        clients.push(cluster.client().await);
    }

    let got = load_concurrently(clients).await;

    assert_every_reader_got_the_file(&got, &data);
    assert_each_block_read_once(&cluster);
    let ufs_bytes: u64 =
        (0..cluster.worker_count()).map(|i| cluster.worker(i).blocks.counters().ufs_bytes_read).sum();
    assert_eq!(ufs_bytes, SIZE, "the workers' own count of UFS bytes");
    assert_eq!(
        (0..cluster.worker_count()).map(|i| cluster.worker(i).blocks.counters().bytes_served).sum::<u64>(),
        8 * SIZE,
        "the workers served every reader the whole file"
    );
    let misses = worker_misses(&cluster);
    assert!(misses > blocks(), "{misses} misses for {} blocks: the readers never overlapped", blocks());
}

/// A sidecar of a pod (its own directory and socket), with the cluster as its upstream.
async fn start_sidecar(cluster: &Cluster, dir: &Path, tiers: Tiers) -> SidecarHandle {
    let (memory_capacity, nvme_capacity) = match tiers {
        Tiers::Dram => (2 * SIZE, 0),
        Tiers::NvmeOnly => (0, 2 * SIZE),
    };
    let config = WorkerConfig {
        master_addr: cluster.master_addr(),
        http_addr: "127.0.0.1:0".parse().unwrap(),
        data_dir: dir.join("sidecar"),
        memory_capacity,
        nvme_capacity,
        sidecar: true,
        socket_path: Some(dir.join("strata.sock")),
        token: cluster.worker_token(),
        ..WorkerConfig::default()
    };
    let upstream = cluster
        .sidecar_upstream(config.token.clone(), std::time::Duration::from_millis(config.ufs_timeout_ms))
        .await;
    sidecar::start(config, cluster.factory.clone(), Arc::new(upstream)).await.expect("sidecar starts")
}

/// A client of the pod whose sidecar listens on `socket`: short-circuit (mapping the blocks the
/// sidecar passes) or framed reads through the socket.
async fn pod_client(cluster: &Cluster, socket: &Path, short_circuit: bool) -> Client {
    let mut config: ClientConfig = cluster.client_config();
    config.sidecar_socket = Some(socket.to_path_buf());
    config.short_circuit = short_circuit;
    Client::connect(config).await.expect("client connects")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_sidecars_with_two_clients_each_fetch_each_block_from_the_ufs_once() {
    four_sidecars(Tiers::Dram).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_sidecars_and_workers_without_dram_fetch_each_block_from_the_ufs_once() {
    four_sidecars(Tiers::NvmeOnly).await;
}

async fn four_sidecars(tiers: Tiers) {
    let (cluster, data) = cluster_with_checkpoint(tiers).await;
    let tmp = tempfile::tempdir().unwrap();
    let mut sidecars = Vec::new();
    let mut clients = Vec::new();
    for pod in 0..4 {
        let sidecar = start_sidecar(&cluster, &tmp.path().join(format!("pod-{pod}")), tiers).await;
        // One process of the pod maps what the sidecar passes, the other reads through the
        // socket: both paths share the sidecar's single flight.
        clients.push(pod_client(&cluster, &sidecar.socket_path, true).await);
        clients.push(pod_client(&cluster, &sidecar.socket_path, false).await);
        sidecars.push(sidecar);
    }

    let got = load_concurrently(clients).await;

    assert_every_reader_got_the_file(&got, &data);
    assert_each_block_read_once(&cluster);
    for (pod, sidecar) in sidecars.iter().enumerate() {
        let c = sidecar.blocks.counters();
        assert_eq!(c.ufs_reads, 0, "sidecar {pod} read the UFS itself (its upstream failed)");
        assert_eq!(c.upstream_reads, blocks(), "sidecar {pod} asks the cluster once per block");
    }
    // Only the sidecars asked the cluster: no client went around its sidecar.
    let served: u64 =
        (0..cluster.worker_count()).map(|i| cluster.worker(i).blocks.counters().bytes_served).sum();
    assert_eq!(served, 4 * SIZE, "the cluster served each sidecar the file once");
    let sidecar_misses: u64 = sidecars.iter().map(|s| s.blocks.counters().cache_misses).sum();
    assert!(
        sidecar_misses > 4 * blocks(),
        "{sidecar_misses} sidecar misses for 4 × {} blocks: a pod's two readers never overlapped",
        blocks()
    );
    let misses = worker_misses(&cluster);
    assert!(
        misses > blocks(),
        "{misses} worker misses for {} blocks: the sidecars never overlapped",
        blocks()
    );
    drop(got);
    for sidecar in sidecars {
        sidecar.shutdown().await;
    }
}
