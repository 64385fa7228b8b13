//! Request classes (`STRATA_QOS`) on a real cluster: a client's class reaches the worker with
//! its connections, a latency reader never waits behind a throughput flood, a latency
//! connection is served on the worker's thread of its own (the latency lane), and a class the
//! worker does not know is refused. (The gate's ordering — latency, throughput, background,
//! with a floor — is tested beside it, in the worker's `classes` module.)

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use strata_client::{Client, QosClass};
use strata_common::ErrorKind;
use strata_common::frame::{self, RESPONSE_HEADER_LEN, ResponseHeader};
use strata_testkit::{Cluster, ClusterOptions, ClusterTls, eventually, first_block_read, pattern};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn client_in(cluster: &Cluster, qos: QosClass) -> Client {
    let mut config = cluster.client_config();
    config.qos = qos;
    Client::connect(config).await.expect("client connects")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_clients_class_reaches_the_worker_with_its_reads() {
    let cluster = Cluster::start(ClusterOptions { workers: 1, ..ClusterOptions::default() }).await;
    let bytes = pattern(64 * 1024, 7);
    cluster.write_file("f.bin", &bytes);
    let reads = [(QosClass::Latency, 3u64), (QosClass::Throughput, 1), (QosClass::Background, 2)];
    for (class, n) in reads {
        let client = client_in(&cluster, class).await;
        assert_eq!(client.qos(), class);
        for _ in 0..n {
            assert_eq!(&client.read_all("/data/f.bin").await.unwrap()[..], &bytes[..]);
        }
    }
    let counters = cluster.worker(0).classes.counters();
    for (class, n) in reads {
        assert_eq!(counters[class as usize].served, n, "{class}: {counters:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_latency_reader_never_waits_behind_a_throughput_flood() {
    // One place for the flood's answers; latency readers have a place of their own.
    let cluster =
        Cluster::start(ClusterOptions { workers: 1, qos_slots: 1, ..ClusterOptions::default() }).await;
    let big = pattern(8 << 20, 3);
    cluster.write_file("big.bin", &big);
    let small = pattern(4096, 5);
    cluster.write_file("small.bin", &small);
    let flood = client_in(&cluster, QosClass::Throughput).await;
    let latency = client_in(&cluster, QosClass::Latency).await;
    assert_eq!(&flood.read_all("/data/big.bin").await.unwrap()[..], &big[..]);
    assert_eq!(&latency.read_all("/data/small.bin").await.unwrap()[..], &small[..]);

    let stop = Arc::new(AtomicBool::new(false));
    let info = flood.stat("/data/big.bin").await.unwrap();
    let flooders: Vec<_> = (0..16u64)
        .map(|i| {
            let (flood, info, stop, big) = (flood.clone(), info.clone(), stop.clone(), big.clone());
            tokio::spawn(async move {
                let mut block = i % 8;
                while !stop.load(Ordering::Relaxed) {
                    let offset = block << 20;
                    let got = flood.read_range_of(&info, offset, 1 << 20).await.unwrap();
                    assert_eq!(&got[..], &big[offset as usize..][..1 << 20]);
                    block = (block + 1) % 8;
                }
            })
        })
        .collect();
    let latency_reads = eventually("the flood queued behind its one place", Duration::from_secs(30), || {
        let (latency, small) = (latency.clone(), small.clone());
        let worker = cluster.worker(0);
        async move {
            assert_eq!(&latency.read_all("/data/small.bin").await.unwrap()[..], &small[..]);
            worker.classes.counters()[QosClass::Throughput as usize].queued >= 20
        }
    });
    latency_reads.await;
    stop.store(true, Ordering::Relaxed);
    for f in flooders {
        f.await.unwrap();
    }
    let counters = cluster.worker(0).classes.counters();
    let latency_counted = counters[QosClass::Latency as usize];
    assert!(latency_counted.served >= 2, "{counters:?}");
    assert_eq!(latency_counted.queued, 0, "a latency read waited: {counters:?}");
}

/// The worker's runtime threads all busy — here blocked outright, the extreme of a flood that
/// keeps them from polling sockets — and a latency client's pooled connection still answered,
/// since it moved to the lane's thread; a throughput client's, on the shared runtime, waits.
#[test]
fn a_latency_connection_is_answered_while_the_shared_runtime_is_stuck() {
    latency_connection_answered_while_the_shared_runtime_is_stuck(None);
}

/// The same over TLS: the connection moves with its TLS session.
#[test]
fn a_latency_tls_connection_is_answered_while_the_shared_runtime_is_stuck() {
    let pki = Arc::new(strata_testkit::tls::TestPki::new());
    latency_connection_answered_while_the_shared_runtime_is_stuck(Some(ClusterTls {
        pki,
        client_auth: false,
    }));
}

fn latency_connection_answered_while_the_shared_runtime_is_stuck(tls: Option<ClusterTls>) {
    let shared =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let cluster =
        shared.block_on(Cluster::start(ClusterOptions { workers: 1, tls, ..ClusterOptions::default() }));
    let small = pattern(4096, 5);
    cluster.write_file("small.bin", &small);
    // The clients on a runtime of their own, as in another process.
    let own = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let (latency, throughput, info) = own.block_on(async {
        let latency = client_in(&cluster, QosClass::Latency).await;
        let throughput = client_in(&cluster, QosClass::Throughput).await;
        // Warm: the block in the worker's memory, one pooled connection per client.
        assert_eq!(&latency.read_all("/data/small.bin").await.unwrap()[..], &small[..]);
        assert_eq!(&throughput.read_all("/data/small.bin").await.unwrap()[..], &small[..]);
        let info = latency.stat("/data/small.bin").await.unwrap();
        (latency, throughput, info)
    });
    let lane = cluster.worker(0).latency_lane.clone();
    assert_eq!(lane.moved(), 1, "only the latency client's connection moves");

    let threads = 2;
    let (stuck_tx, stuck_rx) = std::sync::mpsc::channel();
    let releases: Vec<_> = (0..threads)
        .map(|_| {
            let (release, released) = std::sync::mpsc::channel::<()>();
            let stuck = stuck_tx.clone();
            shared.spawn(async move {
                stuck.send(()).unwrap();
                let _ = released.recv();
            });
            release
        })
        .collect();
    for _ in 0..threads {
        stuck_rx.recv_timeout(Duration::from_secs(30)).expect("every shared runtime thread blocked");
    }
    let (got, waiting) = own.block_on(async {
        let (throughput, stat) = (throughput.clone(), info.clone());
        let waiting = tokio::spawn(async move { throughput.read_range_of(&stat, 0, 4096).await });
        let got = tokio::time::timeout(Duration::from_secs(30), latency.read_range_of(&info, 0, 4096))
            .await
            .expect("the latency read is answered while the shared runtime is stuck");
        (got, waiting)
    });
    assert_eq!(&got.unwrap()[..], &small[..]);
    assert!(!waiting.is_finished(), "the throughput read was served by a stuck runtime");
    drop(releases);
    let got = own.block_on(async { waiting.await.unwrap() });
    assert_eq!(&got.unwrap()[..], &small[..], "the throughput read is answered once the runtime runs");
    assert_eq!(cluster.worker(0).classes.counters()[QosClass::Latency as usize].served, 2);
    drop((latency, throughput));
    shared.block_on(async move { drop(cluster) });
}

#[tokio::test]
async fn a_class_the_worker_does_not_know_is_refused() {
    let cluster =
        Cluster::start(ClusterOptions { workers: 1, auth: false, ..ClusterOptions::default() }).await;
    let bytes = pattern(1000, 9);
    cluster.write_file("f.bin", &bytes);
    let client = cluster.client().await;
    let info = client.stat("/data/f.bin").await.unwrap();
    let read = frame::ReadBlockRequest { req_id: 1, ..first_block_read(&info) };
    let addr = cluster.worker(0).data_addr.to_string();
    let answer = |frames: Vec<u8>| {
        let addr = addr.clone();
        async move {
            let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
            s.write_all(&frames).await.unwrap();
            let mut head = [0u8; RESPONSE_HEADER_LEN];
            tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut head)).await.unwrap().unwrap();
            let head = ResponseHeader::decode(&head).unwrap();
            let mut payload = vec![0u8; head.payload_len as usize];
            s.read_exact(&mut payload).await.unwrap();
            (head, payload)
        }
    };
    // A known class: served as before.
    let (head, payload) = answer([frame::class_request(QosClass::Background), read.encode()].concat()).await;
    assert!(head.status.is_ok(), "{head:?}");
    assert_eq!(payload, bytes);
    // An unknown one: a clear error, nothing served.
    let mut bad = frame::class_request(QosClass::Background);
    *bad.last_mut().unwrap() = 9;
    let (head, payload) = answer([bad, read.encode()].concat()).await;
    assert_eq!(head.status, Err(ErrorKind::BadFrame), "{}", String::from_utf8_lossy(&payload));
    assert_eq!(cluster.worker(0).classes.counters()[QosClass::Background as usize].served, 1);
}
