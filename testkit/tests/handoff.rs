//! Background hand-off and drain: when the ring changes, a block's previous owner pushes it to
//! the new owner without waiting for a client read; a draining worker pushes all of its blocks
//! before it stops. Both are measured in UFS reads of a full re-read afterwards.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use strata_common::BlockKey;
use strata_testkit::{Cluster, ClusterOptions};
use strata_worker::handoff;

const FILES: usize = 40;

async fn warm_cluster() -> (Cluster, strata_client::Client, Vec<(String, Vec<u8>)>, u64) {
    let cluster = Cluster::start(ClusterOptions::default()).await;
    let client = cluster.client().await;
    let files = cluster.warm_files(&client, "warm", FILES, 900).await;
    let warm = cluster.ufs_reads();
    assert_eq!(warm, FILES as u64, "one UFS read per block");
    (cluster, client, files, warm)
}

async fn reread(client: &strata_client::Client, files: &[(String, Vec<u8>)]) {
    for (path, data) in files {
        assert_eq!(client.read_all(path).await.unwrap()[..], data[..], "{path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_joining_worker_receives_the_blocks_it_now_owns_without_a_client_read() {
    let (mut cluster, client, files, warm) = warm_cluster().await;
    let started = Instant::now();
    let new = cluster.add_worker().await;
    client.refresh_view().await.unwrap();
    let ring = client.ring().await.unwrap();
    assert_eq!(ring.members().len(), 4);
    let new_id = cluster.worker(new).worker_id.clone();
    // What the old workers hold that the new one now owns first.
    let moved: HashSet<BlockKey> = (0..new)
        .flat_map(|i| {
            let w = cluster.worker(i);
            handoff::plan(w.blocks.cache().held_blocks(), &ring, &w.worker_id)
                .remove(&new_id)
                .map(|(_, list)| list.into_iter().map(|(k, _)| k).collect::<Vec<_>>())
                .unwrap_or_default()
        })
        .collect();
    assert!(moved.len() >= 4, "the new worker owns a share of the blocks ({} of them)", moved.len());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let missing = moved.iter().filter(|k| !cluster.worker(new).blocks.cache().contains(k)).count();
        if missing == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{missing} of {} blocks not handed off in 30 s", moved.len());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = started.elapsed();
    assert_eq!(cluster.ufs_reads(), warm, "a hand-off never reads the UFS");
    let received = cluster.worker(new).handoff.receiver.received.load(std::sync::atomic::Ordering::Relaxed);

    reread(&client, &files).await;
    let refetched = cluster.ufs_reads() - warm;
    let peer_reads = cluster.worker(new).blocks.counters().upstream_reads;
    eprintln!(
        "join: {} blocks handed off to the new worker ({received} received) in {took:?} with no client read; \
         the full re-read then took {peer_reads} blocks from peers and {refetched} from the UFS",
        moved.len()
    );
    assert!(received as usize >= moved.len());
    assert!(
        refetched * 20 <= warm,
        "{refetched} of {warm} blocks were read from the UFS again (goal: at most 5%)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_drained_worker_hands_its_blocks_off_and_a_stopped_one_does_not() {
    // Drain: worker 0 leaves gracefully.
    let (mut cluster, client, files, warm) = warm_cluster().await;
    let held = cluster.worker(0).blocks.cache().held_blocks().len();
    assert!(held >= 4, "worker 0 holds a share of the blocks ({held})");
    let started = Instant::now();
    let report = cluster.drain_worker(0, Duration::from_secs(60)).await;
    let took = started.elapsed();
    assert!(report.finished, "the drain went through every block: {report:?}");
    assert_eq!(report.left, 0);
    assert_eq!(cluster.ufs_reads(), warm, "a drain never reads the UFS");
    client.refresh_view().await.unwrap();
    assert_eq!(client.ring().await.unwrap().members().len(), 2, "the drained worker is off the ring");
    reread(&client, &files).await;
    let refetched = cluster.ufs_reads() - warm;
    eprintln!(
        "drain: worker 0 held {held} blocks, handed off {} ({} declined, {} failed) in {took:?}; \
         the re-read without it cost {refetched} UFS reads of {warm}",
        report.sent, report.declined, report.failed
    );
    assert!(report.sent as usize + report.declined as usize >= held);
    assert!(
        refetched * 20 <= warm,
        "{refetched} of {warm} blocks were read from the UFS again (goal: at most 5%)"
    );

    // Control: the same, but worker 0 just stops (no drain): its blocks come from the UFS again.
    let (mut cluster, client, files, warm) = warm_cluster().await;
    let held = cluster.worker(0).blocks.cache().held_blocks().len() as u64;
    cluster.stop_worker(0).await;
    cluster.wait_for_live_workers(2).await;
    client.refresh_view().await.unwrap();
    reread(&client, &files).await;
    let refetched = cluster.ufs_reads() - warm;
    eprintln!(
        "control: a stopped worker held {held} blocks; the re-read without it cost {refetched} UFS reads"
    );
    assert!(
        refetched >= held,
        "without a drain, the stopped worker's {held} blocks are read from the UFS again"
    );
    assert!(refetched * 20 > warm, "so the drain is what kept the UFS reads down");
}
