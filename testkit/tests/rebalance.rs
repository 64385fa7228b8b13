//! Elasticity: when the ring changes, a block's new owner fetches it from the worker that held
//! it before (peer fetch) instead of the UFS. Background hand-off is off here, so what is
//! measured is the on-demand fetch alone (tests/handoff.rs measures the hand-off).

use strata_testkit::{Cluster, ClusterOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_added_to_a_warm_cluster_takes_its_blocks_from_peers_not_the_ufs() {
    let mut cluster =
        Cluster::start(ClusterOptions { handoff_bandwidth: 0, ..ClusterOptions::default() }).await;
    let client = cluster.client().await;
    let files = cluster.warm_files(&client, "warm", 40, 500).await;
    let warm = cluster.ufs_reads();
    assert_eq!(warm, 40, "one UFS read per block");

    let new = cluster.add_worker().await;
    client.refresh_view().await.unwrap();
    assert_eq!(client.ring().await.unwrap().members().len(), 4);
    for (path, data) in &files {
        assert_eq!(client.read_all(path).await.unwrap()[..], data[..], "{path} after the join");
    }
    let moved = cluster.worker(new).blocks.counters().upstream_reads;
    let refetched = cluster.ufs_reads() - warm;
    eprintln!("the new worker took {moved} blocks from peers; {refetched} UFS reads");
    assert!(moved >= 4, "the new worker owns a share of the blocks ({moved} came from peers)");
    assert!(
        refetched * 20 <= warm,
        "{refetched} of {warm} blocks were read from the UFS again (goal: at most 5%)"
    );
}
