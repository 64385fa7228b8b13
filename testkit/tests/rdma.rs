//! RDMA grants end to end, through the `Transport` trait, against in-process workers with the
//! **emulated** RDMA (`[rdma] mode = "emulated"`: the one-sided READ is a `RemoteRead` frame
//! the worker answers from the granted region). This machine has no RDMA device, so the verbs
//! reader and registered memory never run here; what these tests prove is the protocol they
//! share with the emulation — grants, bounds, rkeys, release, expiry, limits, fallback.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use strata_client::{
    Client, Credentials, Dial, EmulatedReader, FileInfo, RdmaMode as ClientRdma, RdmaTransport, RemoteReader,
    TcpTransport, Transport, TransportError,
};
use strata_common::ErrorKind;
use strata_common::frame::{
    BlockGrant, GrantHandle, GrantKind, LeaseRelease, REQUEST_HEADER_LEN, RESPONSE_HEADER_LEN, RdmaEndpoint,
    ReadBlockRequest, ResponseHeader,
};
use strata_testkit::{Cluster, ClusterOptions, pattern};
use strata_worker::config::{RdmaConfig, RdmaMode};
use strata_worker::{Worker, WorkerConfig, WorkerHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MIB: usize = 1 << 20;
const T: Duration = Duration::from_secs(10);

fn emulated() -> RdmaConfig {
    RdmaConfig { mode: RdmaMode::Emulated, ..RdmaConfig::default() }
}

/// A worker beside the cluster's, with its own RDMA settings.
async fn rdma_worker(cluster: &Cluster, name: &str, rdma: RdmaConfig) -> WorkerHandle {
    rdma_worker_with_clock(cluster, name, rdma, strata_common::clock::system()).await
}

/// An RDMA worker whose leases expire by `clock` (a test advances it instead of sleeping).
async fn rdma_worker_with_clock(
    cluster: &Cluster,
    name: &str,
    rdma: RdmaConfig,
    clock: strata_common::SharedClock,
) -> WorkerHandle {
    let config = WorkerConfig {
        master_addr: cluster.master_addr(),
        data_addr: "127.0.0.1:0".parse().unwrap(),
        http_addr: "127.0.0.1:0".parse().unwrap(),
        data_dir: cluster.state_dir().join(name),
        memory_capacity: 256 << 20,
        nvme_capacity: 1 << 30,
        rdma,
        token: cluster.worker_token(),
        ..WorkerConfig::default()
    };
    Worker::start_with_clock(config, cluster.factory.clone(), clock).await.expect("worker starts")
}

fn transport(cluster: &Cluster) -> RdmaTransport<EmulatedReader> {
    RdmaTransport::new(EmulatedReader::new(dial_of(cluster), T), dial_of(cluster), T)
}

/// How the test's transports connect: plain TCP, presenting the cluster's admin token.
fn dial_of(cluster: &Cluster) -> Dial {
    Dial { connect_timeout: T, tls: None, credentials: Credentials::token(cluster.admin_token().as_deref()) }
}

fn request(info: &FileInfo, block_index: u64, offset: u64, len: u64) -> ReadBlockRequest {
    ReadBlockRequest {
        req_id: 0,
        path: info.path.clone(),
        version: info.version.clone(),
        file_size: info.size,
        block_size: info.block_size,
        block_index,
        offset,
        len,
    }
}

fn expected(data: &[u8], req: &ReadBlockRequest) -> Vec<u8> {
    let start = (req.block_index * req.block_size + req.offset) as usize;
    data[start..start + req.len as usize].to_vec()
}

/// Waits (up to 10 s) until the worker holds `n` grants: a `Release` has no response, so the
/// client returns before the worker has processed it.
async fn wait_for_held(w: &WorkerHandle, n: usize) {
    let deadline = Instant::now() + T;
    while w.grants.rdma_grants_held() != n {
        assert!(Instant::now() < deadline, "{} grants held, waiting for {n}", w.grants.rdma_grants_held());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A grant taken by hand on `stream` (and kept until released).
async fn open_grant(stream: &mut TcpStream, req: &ReadBlockRequest) -> Result<BlockGrant, ErrorKind> {
    stream.write_all(&req.encode_open(GrantKind::Rdma)).await.unwrap();
    let (head, body) = response(stream).await;
    head.status.map(|_| BlockGrant::decode(&body).unwrap())
}

fn rdma_handle(g: &BlockGrant) -> (u64, u32) {
    match g.handle {
        GrantHandle::Rdma { addr, rkey } => (addr, rkey),
        other => panic!("not an RDMA grant: {other:?}"),
    }
}

fn refused(r: Result<Bytes, TransportError>) -> ErrorKind {
    match r {
        Err(TransportError::Remote { kind, .. }) => kind,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn random_ranges_over_emulated_rdma_equal_tcp_and_every_grant_is_released() {
    let cluster = Cluster::start(ClusterOptions { workers: 1, ..ClusterOptions::default() }).await;
    let w = rdma_worker(&cluster, "rdma-0", emulated()).await;
    let addr = w.data_addr.to_string();
    let data = pattern(3 * MIB + 12_345, 11);
    cluster.write_file("r.bin", &data);
    let info = cluster.client().await.stat("/data/r.bin").await.unwrap();
    let blocks = info.size.div_ceil(info.block_size);

    let rdma = transport(&cluster);
    let tcp = TcpTransport::new(dial_of(&cluster), T);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let reads = 150;
    for _ in 0..reads {
        let index = next() % blocks;
        let block_len = (info.size - index * info.block_size).min(info.block_size);
        let offset = next() % block_len;
        let len = 1 + next() % (block_len - offset);
        let req = request(&info, index, offset, len);
        let (via_rdma, _) = rdma.read_block(&addr, &req).await.unwrap();
        let (via_tcp, _) = tcp.read_block(&addr, &req).await.unwrap();
        assert_eq!(via_rdma.len() as u64, len);
        assert!(via_rdma == via_tcp, "block {index} [{offset}+{len}]: RDMA and TCP differ");
        assert!(
            via_rdma[..] == expected(&data, &req)[..],
            "block {index} [{offset}+{len}] differs from the file"
        );
    }
    // Whole blocks too, the common case.
    for index in 0..blocks {
        let len = (info.size - index * info.block_size).min(info.block_size);
        let req = request(&info, index, 0, len);
        let (got, _) = rdma.read_block(&addr, &req).await.unwrap();
        assert!(got[..] == expected(&data, &req)[..], "block {index}");
    }
    assert_eq!(rdma.remote_reads(), reads + blocks);
    assert_eq!(rdma.fallbacks(), 0, "every read went through a grant");
    wait_for_held(&w, 0).await;
    assert_eq!(w.grants.rdma_registered_bytes(), 0, "released grants hold no memory");
    w.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stale_foreign_and_out_of_bounds_remote_reads_are_refused() {
    let cluster = Cluster::start(ClusterOptions { workers: 1, ..ClusterOptions::default() }).await;
    let w = rdma_worker(&cluster, "rdma-0", emulated()).await;
    let clock = strata_common::clock::ManualClock::new();
    let short = rdma_worker_with_clock(
        &cluster,
        "rdma-short",
        RdmaConfig { grant_ttl_ms: 100, ..emulated() },
        clock.clone(),
    )
    .await;
    let data = pattern(2 * MIB, 5);
    cluster.write_file("s.bin", &data);
    let info = cluster.client().await.stat("/data/s.bin").await.unwrap();
    let reader = EmulatedReader::new(dial_of(&cluster), T);
    let addr = w.data_addr.to_string();

    let req = request(&info, 1, 1000, 5000);
    let mut control = cluster.dial(&addr).await;
    let grant = open_grant(&mut control, &req).await.unwrap();
    assert_eq!(grant.len, 5000);
    let (region, rkey) = rdma_handle(&grant);
    assert_eq!(w.grants.rdma_grants_held(), 1);

    // Inside the region: the bytes of the range.
    let got = reader.read(&addr, region, rkey, 5000).await.unwrap();
    assert!(got[..] == expected(&data, &req)[..]);
    let got = reader.read(&addr, region + 4000, rkey, 1000).await.unwrap();
    assert!(got[..] == data[MIB + 5000..MIB + 6000]);
    // A wrong key, or any byte outside the region: refused, nothing of the memory returned.
    assert_eq!(refused(reader.read(&addr, region, rkey ^ 1, 10).await), ErrorKind::PermissionDenied);
    assert_eq!(refused(reader.read(&addr, region, rkey, 5001).await), ErrorKind::PermissionDenied);
    assert_eq!(refused(reader.read(&addr, region + 4999, rkey, 2).await), ErrorKind::PermissionDenied);
    assert_eq!(refused(reader.read(&addr, region - 1, rkey, 1).await), ErrorKind::PermissionDenied);
    assert_eq!(refused(reader.read(&addr, region, rkey, u64::MAX).await), ErrorKind::PermissionDenied);
    // Another worker does not know this grant.
    assert_eq!(
        refused(reader.read(&short.data_addr.to_string(), region, rkey, 1).await),
        ErrorKind::PermissionDenied
    );

    // Released: the same read that worked is refused (a stale grant).
    control
        .write_all(&LeaseRelease { lease_id: grant.lease_id, kind: GrantKind::Rdma }.encode())
        .await
        .unwrap();
    wait_for_held(&w, 0).await;
    assert_eq!(refused(reader.read(&addr, region, rkey, 5000).await), ErrorKind::PermissionDenied);

    // Expired: refused without a release; the next grant sweeps it.
    let short_addr = short.data_addr.to_string();
    let mut control = cluster.dial(&short_addr).await;
    let old = open_grant(&mut control, &req).await.unwrap();
    assert_eq!(old.ttl_ms, 100);
    let (old_region, old_rkey) = rdma_handle(&old);
    clock.advance(Duration::from_millis(100));
    assert_eq!(refused(reader.read(&short_addr, old_region, old_rkey, 1).await), ErrorKind::PermissionDenied);
    let new = open_grant(&mut control, &req).await.unwrap();
    assert_eq!(short.grants.rdma_grants_held(), 1, "the expired grant was swept by the new one");
    let (new_region, new_rkey) = rdma_handle(&new);
    let got = reader.read(&short_addr, new_region, new_rkey, 5000).await.unwrap();
    assert!(got[..] == expected(&data, &req)[..]);
    w.kill().await;
    short.kill().await;
}

/// A reader that takes longer than a grant lives.
struct SlowReader(EmulatedReader, Duration);

#[async_trait]
impl RemoteReader for SlowReader {
    async fn read(&self, worker: &str, addr: u64, rkey: u32, len: u64) -> Result<Bytes, TransportError> {
        tokio::time::sleep(self.1).await;
        self.0.read(worker, addr, rkey, len).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rdma_off_exhausted_or_expired_grants_fall_back_to_tcp_with_the_right_bytes() {
    let cluster = Cluster::start(ClusterOptions { workers: 1, ..ClusterOptions::default() }).await;
    let limited = rdma_worker(&cluster, "rdma-limited", RdmaConfig { max_grants: 1, ..emulated() }).await;
    let small = rdma_worker(&cluster, "rdma-small", RdmaConfig { memory: 4096, ..emulated() }).await;
    let short = rdma_worker(&cluster, "rdma-short", RdmaConfig { grant_ttl_ms: 50, ..emulated() }).await;
    let data = pattern(2 * MIB + 77, 9);
    cluster.write_file("f.bin", &data);
    let info = cluster.client().await.stat("/data/f.bin").await.unwrap();
    let req = request(&info, 0, 300, 100_000);
    let want = expected(&data, &req);

    // RDMA off on the worker: the grant is refused, the bytes come over TCP.
    let off = transport(&cluster);
    let (got, _) = off.read_block(&cluster.worker(0).data_addr.to_string(), &req).await.unwrap();
    assert!(got[..] == want[..]);
    assert_eq!((off.remote_reads(), off.fallbacks()), (0, 1));

    // Lease limit reached (someone holds the only grant): TCP.
    let limited_addr = limited.data_addr.to_string();
    let mut holder = cluster.dial(&limited_addr).await;
    let held = open_grant(&mut holder, &req).await.unwrap();
    let t = transport(&cluster);
    let (got, _) = t.read_block(&limited_addr, &req).await.unwrap();
    assert!(got[..] == want[..]);
    assert_eq!((t.remote_reads(), t.fallbacks()), (0, 1));
    // Given back: the next read goes through a grant again.
    holder
        .write_all(&LeaseRelease { lease_id: held.lease_id, kind: GrantKind::Rdma }.encode())
        .await
        .unwrap();
    wait_for_held(&limited, 0).await;
    let (got, _) = t.read_block(&limited_addr, &req).await.unwrap();
    assert!(got[..] == want[..]);
    assert_eq!((t.remote_reads(), t.fallbacks()), (1, 1));

    // Registered memory too small for the range: TCP; a range that fits: RDMA.
    let t = transport(&cluster);
    let small_addr = small.data_addr.to_string();
    let (got, _) = t.read_block(&small_addr, &req).await.unwrap();
    assert!(got[..] == want[..]);
    let fits = request(&info, 1, 5, 4000);
    let (got, _) = t.read_block(&small_addr, &fits).await.unwrap();
    assert!(got[..] == expected(&data, &fits)[..]);
    assert_eq!((t.remote_reads(), t.fallbacks()), (1, 1));

    // The grant expires before the one-sided read: refused, then TCP.
    let t = RdmaTransport::new(
        SlowReader(EmulatedReader::new(dial_of(&cluster), T), Duration::from_millis(300)),
        dial_of(&cluster),
        T,
    );
    let (got, _) = t.read_block(&short.data_addr.to_string(), &req).await.unwrap();
    assert!(got[..] == want[..]);
    assert_eq!((t.remote_reads(), t.fallbacks()), (0, 1));

    // A changed file is not papered over by the fallback: the caller learns it.
    let stale = ReadBlockRequest { version: "m1-s1".into(), ..req.clone() };
    let err = transport(&cluster).read_block(&limited_addr, &stale).await.unwrap_err();
    assert!(matches!(err, TransportError::Remote { kind: ErrorKind::VersionChanged, .. }), "{err:?}");

    for w in [limited, small, short] {
        w.kill().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_configured_for_rdma_reads_whole_files_through_grants() {
    let cluster = Cluster::start(ClusterOptions { workers: 0, ..ClusterOptions::default() }).await;
    let workers = [
        rdma_worker(&cluster, "rdma-a", emulated()).await,
        rdma_worker(&cluster, "rdma-b", emulated()).await,
    ];
    cluster.wait_for_live_workers(2).await;
    let data = pattern(5 * MIB + 999, 3);
    cluster.write_file("c.bin", &data);

    let transport = Arc::new(transport(&cluster));
    let client = Client::connect_with_transport(cluster.client_config(), transport.clone()).await.unwrap();
    let got = client.read_all("/data/c.bin").await.unwrap();
    assert!(got[..] == data[..]);
    let got = client.read_range("/data/c.bin", MIB as u64 - 10, 2 * MIB as u64).await.unwrap();
    assert!(got[..] == data[MIB - 10..3 * MIB - 10]);
    assert!(transport.remote_reads() >= 6, "{} reads through grants", transport.remote_reads());
    assert_eq!(transport.fallbacks(), 0);

    // The config switch builds the same transport.
    let mut config = cluster.client_config();
    config.rdma = ClientRdma::Emulated;
    let client = Client::connect(config).await.unwrap();
    assert!(client.read_all("/data/c.bin").await.unwrap()[..] == data[..]);
    for w in &workers {
        wait_for_held(w, 0).await;
    }
    for w in workers {
        w.kill().await;
    }
}

/// Reads one response frame: its header and payload.
async fn response(stream: &mut TcpStream) -> (ResponseHeader, Vec<u8>) {
    let mut head = [0u8; RESPONSE_HEADER_LEN];
    stream.read_exact(&mut head).await.unwrap();
    let head = ResponseHeader::decode(&head).unwrap();
    let mut body = vec![0u8; head.payload_len as usize];
    stream.read_exact(&mut body).await.unwrap();
    (head, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queue_pair_setup_is_refused_without_a_device_and_bad_endpoints_close_the_connection() {
    let cluster = Cluster::start(ClusterOptions { workers: 1, ..ClusterOptions::default() }).await;
    let w = rdma_worker(&cluster, "rdma-0", emulated()).await;
    let endpoint = RdmaEndpoint { qp_num: 7, lid: 1, gid: None };
    // Emulated memory has no queue pairs; a worker with RDMA off has none either.
    for addr in [w.data_addr, cluster.worker(0).data_addr] {
        let mut s = cluster.dial(addr).await;
        s.write_all(&endpoint.encode_request()).await.unwrap();
        let (head, msg) = response(&mut s).await;
        assert_eq!(head.status, Err(ErrorKind::Unavailable), "{}", String::from_utf8_lossy(&msg));
    }
    // A malformed endpoint is a bad frame, and the connection is closed.
    let mut s = cluster.dial(w.data_addr).await;
    let mut frame = endpoint.encode_request();
    frame[REQUEST_HEADER_LEN + 6] = 9;
    s.write_all(&frame).await.unwrap();
    let (head, _) = response(&mut s).await;
    assert_eq!(head.status, Err(ErrorKind::BadFrame));
    let mut rest = Vec::new();
    assert_eq!(s.read_to_end(&mut rest).await.unwrap(), 0, "closed after the error frame");
    w.kill().await;
}
