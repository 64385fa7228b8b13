//! The write path end to end on an in-process cluster: files stream through a worker to the
//! UFS, a read-only mount refuses, metadata is not stale after a write, an unfinished write
//! leaves the old file, and a malformed frame inside a write is refused without harm.

use strata_client::ClientError;
use strata_common::ErrorKind;
use strata_common::frame::{
    Op, RESPONSE_HEADER_LEN, ReadBlockRequest, ResponseHeader, WriteBegin, request_header,
};
use strata_testkit::{Cluster, ClusterOptions, eventually, pattern};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn writable() -> ClusterOptions {
    let mut opts = ClusterOptions { workers: 2, ..ClusterOptions::default() };
    opts.mount_options.push(("mode".into(), "write-through".into()));
    opts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn writes_reach_the_ufs_and_metadata_follows() {
    let cluster = Cluster::start(writable()).await;
    let client = cluster.client().await;
    let data = pattern(3 * 1024 * 1024 + 17, 7);
    let mut w = client.create("/data/dir/new.bin").await.unwrap();
    for chunk in data.chunks(700_001) {
        w.write(chunk).await.unwrap();
    }
    let info = w.close().await.unwrap();
    assert_eq!(info.size, data.len() as u64);
    assert_eq!(std::fs::read(cluster.ufs.dir().join("dir/new.bin")).unwrap(), data, "the UFS has the bytes");
    assert_eq!(&client.read_all("/data/dir/new.bin").await.unwrap()[..], &data[..]);

    // Rewritten smaller: the cached stat (metadata_ttl is 60 s here) must not serve the old size.
    let mut w = client.create("/data/dir/new.bin").await.unwrap();
    w.write(b"short").await.unwrap();
    w.close().await.unwrap();
    assert_eq!(client.stat("/data/dir/new.bin").await.unwrap().size, 5);
    assert_eq!(&client.read_all("/data/dir/new.bin").await.unwrap()[..], b"short");
    let other = cluster.client().await;
    assert_eq!(other.stat("/data/dir/new.bin").await.unwrap().size, 5, "the master's cache was dropped");

    // A writer dropped before close leaves the old file.
    let mut w = client.create("/data/dir/new.bin").await.unwrap();
    w.write(&pattern(2 << 20, 9)).await.unwrap();
    drop(w);
    // The worker sees the connection close and aborts (and its hidden partial file is gone).
    let aborted = |c: &Cluster| {
        (0..c.worker_count()).map(|i| c.worker(i).blocks.counters().writes_aborted).sum::<u64>()
    };
    eventually("the worker aborted the write", std::time::Duration::from_secs(20), || async {
        aborted(&cluster) == 1
    })
    .await;
    let dir = cluster.ufs.dir().join("dir");
    assert!(
        std::fs::read_dir(&dir).unwrap().all(|e| !e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .ends_with(".strata-partial")),
        "no partial file is left"
    );
    assert_eq!(std::fs::read(cluster.ufs.dir().join("dir/new.bin")).unwrap(), b"short");

    // mkdir and delete through the master, listings follow.
    client.mkdir("/data/made/deep").await.unwrap();
    assert!(client.stat("/data/made/deep").await.unwrap().is_dir);
    let names: Vec<_> = client.list("/data/dir").await.unwrap().into_iter().map(|e| e.path).collect();
    assert_eq!(names, ["/data/dir/new.bin"]);
    client.delete("/data/dir/new.bin", false).await.unwrap();
    assert!(matches!(client.stat("/data/dir/new.bin").await, Err(ClientError::NotFound(_))));
    assert!(client.list("/data/dir").await.unwrap().is_empty());
    client.delete("/data/made", true).await.unwrap();
    assert!(!cluster.ufs.dir().join("made").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_only_mount_refuses_every_write() {
    let cluster = Cluster::start(ClusterOptions { workers: 1, ..ClusterOptions::default() }).await;
    cluster.write_file("kept.bin", b"kept");
    let client = cluster.client().await;
    assert!(matches!(client.create("/data/new.bin").await, Err(ClientError::PermissionDenied(_))));
    assert!(matches!(client.delete("/data/kept.bin", false).await, Err(ClientError::PermissionDenied(_))));
    assert!(matches!(client.mkdir("/data/d").await, Err(ClientError::PermissionDenied(_))));
    assert!(!cluster.ufs.dir().join("new.bin").exists() && !cluster.ufs.dir().join("d").exists());
    assert_eq!(std::fs::read(cluster.ufs.dir().join("kept.bin")).unwrap(), b"kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_malformed_frame_inside_a_write_aborts_it() {
    let cluster = Cluster::start(ClusterOptions { workers: 1, ..writable() }).await;
    cluster.write_file("old.bin", b"old");
    let mut s = cluster.dial(cluster.worker(0).data_addr).await;
    s.write_all(&WriteBegin { req_id: 5, path: "/data/old.bin".into(), write_back: None }.encode())
        .await
        .unwrap();
    let mut head = [0u8; RESPONSE_HEADER_LEN];
    s.read_exact(&mut head).await.unwrap();
    assert!(ResponseHeader::decode(&head).unwrap().status.is_ok(), "the write may start");
    s.write_all(&request_header(Op::WriteData, 4)).await.unwrap();
    s.write_all(b"new!").await.unwrap();
    // A read request in the middle of a write: the framing can no longer be trusted.
    let read = ReadBlockRequest {
        req_id: 6,
        path: "/data/old.bin".into(),
        version: "v".into(),
        file_size: 3,
        block_size: 1 << 20,
        block_index: 0,
        offset: 0,
        len: 3,
    };
    s.write_all(&read.encode()).await.unwrap();
    s.read_exact(&mut head).await.unwrap();
    let answer = ResponseHeader::decode(&head).unwrap();
    assert_eq!(answer.status, Err(ErrorKind::BadFrame));
    assert_eq!(std::fs::read(cluster.ufs.dir().join("old.bin")).unwrap(), b"old", "nothing was committed");
    // The worker serves everyone else.
    let client = cluster.client().await;
    assert_eq!(&client.read_all("/data/old.bin").await.unwrap()[..], b"old");
}

/// What the Python binding does around a fork: a writer parked in one runtime, that runtime
/// shut down (threads joined, tasks and the master channel gone), and the write finished in a
/// new runtime by a client made with new connections from the old one's cached metadata.
#[test]
fn a_parked_writer_and_a_client_go_on_in_a_new_runtime() {
    let rt = |name: &str| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(name)
            .enable_all()
            .build()
            .unwrap()
    };
    let cluster_rt = rt("cluster");
    let cluster = cluster_rt.block_on(Cluster::start(writable()));
    let data = pattern(5 * 1024 * 1024 + 3, 11);
    let first = rt("first");
    let (client, mut w) = first.block_on(async {
        let client = cluster.client().await;
        let mut w = client.create("/data/across.bin").await.unwrap();
        w.write(&data[..3 << 20]).await.unwrap();
        (client, w)
    });
    {
        let _in_runtime = first.enter();
        w.park().unwrap();
    }
    drop(first);
    let second = rt("second");
    second.block_on(async {
        let fresh = client.with_new_connections().unwrap();
        drop(w.rebind(fresh.clone()));
        w.write(&data[3 << 20..]).await.unwrap();
        let info = w.close().await.unwrap();
        assert_eq!(info.size, data.len() as u64);
        assert_eq!(&fresh.read_all("/data/across.bin").await.unwrap()[..], &data[..]);
    });
    assert_eq!(std::fs::read(cluster.ufs.dir().join("across.bin")).unwrap(), data);
    drop(client);
    drop(second);
    cluster_rt.block_on(async move { drop(cluster) });
}
