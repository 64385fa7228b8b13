//! The data plane against hostile peers, on real sockets: connection limits, stalled frames,
//! idle connections, and the sidecar socket's permissions and peer uid check.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_common::ErrorKind;
use strata_common::frame::{
    FileStat, Op, RESPONSE_HEADER_LEN, ReadBlockRequest, ReadMany, ResponseHeader, StatRequest, WriteBegin,
    request_header,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::WorkerConfig;
use crate::cache::BlockCache;
use crate::grants::Grants;
use crate::mounts::{MountSnapshot, MountSpec, Mounts, StaticMounts};

const OLD: &[u8] = b"the old contents of f.bin, which a stalled write must not touch";

/// A data plane over a write-through mount `/d` of a temporary directory holding `f.bin`.
struct Fixture {
    plane: DataPlane,
    dir: tempfile::TempDir,
    cancel: CancellationToken,
    /// Faults for the mount's UFS (the local directory, wrapped).
    ufs_faults: Arc<strata_ufs::testing::UfsFaults>,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// A reader token limited to `scope`, made the only token `f`'s data plane accepts.
fn only_reader_scoped_to(f: &Fixture, scope: &str) -> String {
    use strata_security::token::{Role, TokenRecord, TokenTable, generate};
    let token = generate();
    let reader = TokenRecord::new(&token, Role::Reader, Some(scope), "", 0).unwrap();
    f.plane.auth.set(crate::auth::Table {
        epoch: 1,
        enabled: true,
        tokens: TokenTable::new([(reader.hash.clone(), reader.identity())]),
    });
    token
}

/// `f`'s data plane served on a loopback port of its own, until `f` is dropped.
async fn serve_on_loopback(f: &Fixture) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(listener, f.plane.clone(), f.cancel.clone()));
    addr
}

fn fixture(config: WorkerConfig) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("f.bin"), OLD).unwrap();
    let (cache, counters) = BlockCache::dram_only(1 << 20);
    let factory = strata_ufs::testing::CountingFactory::new(Arc::new(strata_ufs::OpendalFactory));
    let ufs_faults = factory.faults.clone();
    let mounts = Arc::new(Mounts::new(Arc::new(factory), strata_ufs::StateFence::new()));
    mounts.set_source(Arc::new(StaticMounts(MountSnapshot {
        epoch: 1,
        mounts: vec![MountSpec {
            path: "/d".into(),
            uri: format!("file://{}", dir.path().display()),
            options: [("mode".to_string(), "write-through".to_string())].into(),
            block_size: 1024,
        }],
        state_paths: Vec::new(),
    })));
    let clock = strata_common::clock::system();
    let blocks = BlockService::for_tests(cache, counters, mounts);
    let plane = DataPlane {
        blocks: Arc::new(blocks),
        grants: Arc::new(Grants::from_config(&config, clock).unwrap()),
        view: Arc::new(LastView::default()),
        connections: Arc::new(Connections::from_config(&config)),
        writeback: None,
        handoff: None,
        prefetch: None,
        classes: Arc::new(crate::classes::ClassGate::default()),
        latency_lane: Arc::new(crate::dataplane::LatencyLane::new(true, Default::default())),
        // Limits and deadlines are what these tests are about: every peer is admitted by the
        // token check (tokens are tested in auth and testkit/tests/auth.rs).
        auth: Arc::new(crate::auth::PeerAuth::open()),
    };
    Fixture { plane, dir, cancel: CancellationToken::new(), ufs_faults }
}

async fn serve_tcp(config: WorkerConfig) -> (Fixture, SocketAddr) {
    let f = fixture(config);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(listener, f.plane.clone(), f.cancel.clone()));
    (f, addr)
}

fn limits(max: usize, per_peer: usize) -> WorkerConfig {
    WorkerConfig { max_connections: max, max_connections_per_peer: per_peer, ..WorkerConfig::default() }
}

async fn eventually(what: &str, within: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Sends `request` and reads one response: its header and payload.
async fn call<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    request: &[u8],
) -> (ResponseHeader, Vec<u8>) {
    stream.write_all(request).await.unwrap();
    response(stream).await
}

async fn response<S: AsyncRead + Unpin>(stream: &mut S) -> (ResponseHeader, Vec<u8>) {
    let mut head = [0u8; RESPONSE_HEADER_LEN];
    stream.read_exact(&mut head).await.unwrap();
    let head = ResponseHeader::decode(&head).unwrap();
    let mut payload = vec![0u8; head.payload_len as usize];
    stream.read_exact(&mut payload).await.unwrap();
    (head, payload)
}

/// A stat and a block read of `/d/f.bin`: what a normal client does.
async fn normal_client(stream: &mut TcpStream) {
    let read = whole_first_block(stream, "/d/f.bin", 1).await;
    let (head, payload) = call(stream, &read).await;
    assert!(head.status.is_ok(), "{head:?}");
    assert_eq!(payload, OLD);
}

/// The whole of block 0 of `path` as a read request, from the worker's stat of it.
async fn whole_first_block<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    path: &str,
    req_id: u64,
) -> Vec<u8> {
    let (head, payload) = call(stream, &StatRequest { req_id, path: path.into() }.encode()).await;
    assert!(head.status.is_ok(), "{head:?}: {}", String::from_utf8_lossy(&payload));
    let stat = FileStat::decode(&payload).unwrap();
    ReadBlockRequest {
        req_id: req_id + 1,
        path: stat.path,
        version: stat.version,
        file_size: stat.size,
        block_size: stat.block_size,
        block_index: 0,
        offset: 0,
        len: stat.size.min(stat.block_size),
    }
    .encode()
}

/// Cut-through, on a local directory standing in for a store that checks the version first: a
/// cold read is answered whole while the store is still holding the rest of the block back. A
/// fetch that breaks after the answer began closes the connection with the frame unfinished —
/// never a whole frame of a failed fetch — and the next connection reads the block whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_read_is_answered_as_its_block_arrives_and_a_broken_fetch_never_finishes_the_frame() {
    use std::sync::atomic::Ordering::SeqCst;
    let f = fixture(WorkerConfig::default());
    f.ufs_faults.claim_version_first.store(true, SeqCst);
    let addr = serve_on_loopback(&f).await;
    let within = Duration::from_secs(10);
    let gate = &f.ufs_faults.stream_gate;
    gate.held.store(true, SeqCst);
    let mut s = TcpStream::connect(addr).await.unwrap();
    let read = whole_first_block(&mut s, "/d/f.bin", 1).await;
    s.write_all(&read).await.unwrap();
    let (head, payload) = tokio::time::timeout(within, response(&mut s)).await.expect("answered early");
    assert_eq!((head.status, payload.as_slice()), (Ok(frame::Source::Ufs), OLD));
    // The store cannot end the block while the gate holds it: the answer came before it did.
    eventually("the store's read waits at the gate", within, || gate.waiting.load(SeqCst) == 1).await;
    // Counted once the answer's last byte is written, which the client may read first.
    eventually("the answer is counted", within, || f.plane.blocks.counters().cut_through_reads == 1).await;
    gate.held.store(false, SeqCst);
    gate.permits.add_permits(1);

    let data: Vec<u8> = (0..3000u32).map(|i| (i % 241) as u8).collect();
    std::fs::write(f.dir.path().join("g.bin"), &data).unwrap();
    f.ufs_faults.break_next_streams.store(1, SeqCst);
    let read = whole_first_block(&mut s, "/d/g.bin", 3).await;
    s.write_all(&read).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(within, s.read_to_end(&mut answer)).await.expect("closed").unwrap();
    assert!(answer.len() < RESPONSE_HEADER_LEN + 1024, "an unfinished frame: {} bytes", answer.len());
    assert_eq!(f.plane.blocks.counters().cut_through_aborts, 1);
    let mut again = TcpStream::connect(addr).await.unwrap();
    let read = whole_first_block(&mut again, "/d/g.bin", 5).await;
    let (head, payload) = call(&mut again, &read).await;
    assert!(head.status.is_ok(), "{head:?}");
    assert_eq!(payload, data[..1024], "the block, fetched again whole");
}

/// Reads until the worker closes the connection (end of stream or a reset).
async fn closed<S: AsyncRead + Unpin>(stream: &mut S) {
    let mut sink = [0u8; 256];
    loop {
        match stream.read(&mut sink).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

/// The one error frame a refused connection gets, then the end of the stream.
async fn refused<S: AsyncRead + Unpin>(stream: &mut S) -> (ErrorKind, String) {
    let (head, payload) = response(stream).await;
    assert_eq!(head.req_id, 0);
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest).await;
    assert!(rest.is_empty(), "nothing after the error frame");
    (head.status.unwrap_err(), String::from_utf8(payload).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_stalled_headers_is_closed_within_the_frame_timeout_while_others_are_served() {
    const FLOOD: usize = 500;
    let frame = Duration::from_millis(2000);
    let (f, addr) = serve_tcp(WorkerConfig {
        frame_timeout_ms: frame.as_millis() as u64,
        ..limits(FLOOD + 10, FLOOD + 10)
    })
    .await;
    let mut flood = Vec::with_capacity(FLOOD);
    let started = Instant::now();
    for _ in 0..FLOOD {
        let mut s = TcpStream::connect(addr).await.unwrap();
        // A header announcing a body that never comes.
        s.write_all(&request_header(Op::Stat, 40)).await.unwrap();
        flood.push(s);
    }
    let sent = started.elapsed();
    eventually("the flood is held", frame, || f.plane.connections.snapshot().open == FLOOD).await;
    // Served while the flood is held.
    let mut client = TcpStream::connect(addr).await.unwrap();
    normal_client(&mut client).await;
    assert_eq!(f.plane.connections.snapshot().frame_timeouts, 0, "served during the flood");

    let all_closed = tokio::time::timeout(Duration::from_secs(20), async {
        for s in &mut flood {
            closed(s).await;
        }
    });
    all_closed.await.expect("every stalled connection is closed");
    // The last header went out at `sent`; its connection had `frame` from then, plus slack for
    // a loaded machine.
    assert!(started.elapsed() < sent + frame + Duration::from_secs(4), "{:?}", started.elapsed());
    eventually("all counted and their places given back", Duration::from_secs(5), || {
        let s = f.plane.connections.snapshot();
        s.frame_timeouts == FLOOD as u64 && s.open == 1
    })
    .await;
    normal_client(&mut client).await;
    let s = f.plane.connections.snapshot();
    assert_eq!((s.open, s.idle_timeouts, s.write_timeouts, s.refused_max_connections), (1, 0, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_over_the_per_peer_limit_is_refused_with_resource_exhausted() {
    let (f, addr) = serve_tcp(limits(100, 3)).await;
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        normal_client(&mut s).await;
        held.push(s);
    }
    let mut fourth = TcpStream::connect(addr).await.unwrap();
    let (kind, msg) = refused(&mut fourth).await;
    assert_eq!(kind, ErrorKind::ResourceExhausted);
    assert!(msg.contains("max_connections_per_peer") && msg.contains("127.0.0.1"), "{msg}");

    // Another address is another peer.
    let other = TcpSocket::new_v4().unwrap();
    other.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    let mut other = other.connect(addr).await.unwrap();
    normal_client(&mut other).await;

    // A place given back is taken again.
    drop(held.pop());
    eventually("the place is given back", Duration::from_secs(5), || {
        f.plane.connections.snapshot().open == 3
    })
    .await;
    let mut again = TcpStream::connect(addr).await.unwrap();
    normal_client(&mut again).await;
    let s = f.plane.connections.snapshot();
    assert_eq!((s.refused_per_peer, s.refused_max_connections, s.open), (1, 0, 4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_over_the_worker_limit_is_refused_with_resource_exhausted() {
    let (f, addr) = serve_tcp(limits(3, 0)).await;
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        normal_client(&mut s).await;
        held.push(s);
    }
    for _ in 0..2 {
        let mut over = TcpStream::connect(addr).await.unwrap();
        let (kind, msg) = refused(&mut over).await;
        assert_eq!(kind, ErrorKind::ResourceExhausted);
        assert!(msg.contains("limit of 3") && msg.contains("(max_connections)"), "{msg}");
    }
    // The refused ones never held a place: the held ones are still served.
    for s in &mut held {
        normal_client(s).await;
    }
    let s = f.plane.connections.snapshot();
    assert_eq!((s.refused_max_connections, s.refused_per_peer, s.open), (2, 0, 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_whose_data_stalls_midway_is_closed_and_commits_nothing() {
    let (f, addr) = serve_tcp(WorkerConfig { frame_timeout_ms: 300, ..WorkerConfig::default() }).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    let (head, _) =
        call(&mut s, &WriteBegin { req_id: 5, path: "/d/f.bin".into(), write_back: None }.encode()).await;
    assert!(head.status.is_ok(), "{head:?}");
    // One whole data frame, then half of the next one.
    s.write_all(&request_header(Op::WriteData, 4)).await.unwrap();
    s.write_all(b"new!").await.unwrap();
    s.write_all(&request_header(Op::WriteData, 1000)).await.unwrap();
    s.write_all(&[b'x'; 500]).await.unwrap();
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(10), closed(&mut s)).await.expect("closed");
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    eventually("the write is aborted", Duration::from_secs(5), || {
        f.plane.blocks.counters().writes_aborted == 1
    })
    .await;
    assert_eq!(f.plane.blocks.counters().writes_committed, 0);
    assert_eq!(f.plane.connections.snapshot().frame_timeouts, 1);
    assert_eq!(std::fs::read(f.dir.path().join("f.bin")).unwrap(), OLD, "the old object is untouched");
    let names: Vec<_> = std::fs::read_dir(f.dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, vec!["f.bin".to_string()], "no partial file left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_is_closed_after_the_idle_timeout() {
    let idle = Duration::from_millis(300);
    let (f, addr) = serve_tcp(WorkerConfig {
        idle_timeout_ms: idle.as_millis() as u64,
        frame_timeout_ms: 100,
        ..WorkerConfig::default()
    })
    .await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    normal_client(&mut s).await;
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(10), closed(&mut s)).await.expect("closed");
    assert!(started.elapsed() >= idle - Duration::from_millis(50), "{:?}", started.elapsed());
    eventually("counted and the place given back", Duration::from_secs(5), || {
        let s = f.plane.connections.snapshot();
        s.idle_timeouts == 1 && s.open == 0
    })
    .await;
    assert_eq!(f.plane.connections.snapshot().frame_timeouts, 0);
}

// ---- the sidecar's Unix socket -------------------------------------------------------------

/// What the child process of [`unix_client_child`] is told, by environment.
const CHILD_SOCKET: &str = "STRATA_TEST_UNIX_CLIENT_SOCKET";

/// Not a test of its own: run as another uid by the sidecar tests (the test binary started
/// again with this test alone), it connects to the socket, asks a `Stat` and prints the answer.
#[test]
fn unix_client_child() {
    use std::io::{Read, Write};
    let Some(path) = std::env::var_os(CHILD_SOCKET) else { return };
    let mut s = match std::os::unix::net::UnixStream::connect(path) {
        Ok(s) => s,
        Err(e) => {
            println!("CHILD connect-error {:?}", e.kind());
            return;
        }
    };
    // A refused connection may be closed before the request goes out (EPIPE on a Unix
    // socket); its error frame is waiting to be read all the same.
    let _ = s.write_all(&StatRequest { req_id: 1, path: "/d/f.bin".into() }.encode());
    let mut head = [0u8; RESPONSE_HEADER_LEN];
    s.read_exact(&mut head).unwrap();
    let head = ResponseHeader::decode(&head).unwrap();
    let mut payload = vec![0u8; head.payload_len as usize];
    s.read_exact(&mut payload).unwrap();
    match head.status {
        Ok(_) => println!("CHILD ok size={}", FileStat::decode(&payload).unwrap().size),
        Err(kind) => println!("CHILD error {kind:?} {}", String::from_utf8_lossy(&payload)),
    }
}

/// Runs [`unix_client_child`] as `uid`:`gid` (no other groups) against `socket`; its line.
async fn child_as(uid: u32, gid: u32, socket: &Path) -> String {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "dataplane::tests::unix_client_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_SOCKET, socket)
        .uid(uid)
        .gid(gid);
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap()).await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    // libtest may print its "test NAME ... " before the line on the same line.
    stdout.lines().find_map(|l| l.split_once("CHILD ").map(|(_, answer)| answer.to_string())).unwrap_or_else(
        || panic!("no answer from the child: {stdout} {}", String::from_utf8_lossy(&out.stderr)),
    )
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_socket_is_0660_of_its_group_and_checks_the_peer_uid() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if !is_root() {
        eprintln!("skipped: needs root to connect as other uids");
        return;
    }
    const GROUP: u32 = 4242;
    const ALLOWED: u32 = 65534;
    const STRANGER: u32 = 65533;
    let f = fixture(WorkerConfig { socket_allowed_uids: vec![ALLOWED], ..WorkerConfig::default() });
    let sockets = tempfile::tempdir().unwrap();
    std::fs::set_permissions(sockets.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = sockets.path().join("strata.sock");
    let listener = crate::sidecar::bind_socket(&path, Some(&GROUP.to_string())).unwrap();
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o660);
    assert_eq!(meta.gid(), GROUP);
    tokio::spawn(serve_unix(listener, f.plane.clone(), f.cancel.clone()));

    // In the group and allowed: served.
    assert_eq!(child_as(ALLOWED, GROUP, &path).await, format!("ok size={}", OLD.len()));
    // In the group but not allowed: the uid check refuses it.
    let answer = child_as(STRANGER, GROUP, &path).await;
    assert!(answer.starts_with("error PermissionDenied uid 65533 may not use this socket"), "{answer}");
    // Allowed but outside the group: the file mode keeps it out before the check.
    assert_eq!(child_as(ALLOWED, ALLOWED, &path).await, "connect-error PermissionDenied");
    // Root (this process) may always.
    let mut s = tokio::net::UnixStream::connect(&path).await.unwrap();
    let (head, _) = call(&mut s, &StatRequest { req_id: 1, path: "/d/f.bin".into() }.encode()).await;
    assert!(head.status.is_ok());

    let s = f.plane.connections.snapshot();
    assert_eq!((s.refused_peer_uid, s.refused_per_peer, s.refused_max_connections), (1, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_only_the_own_uid_and_root_may_use_the_socket() {
    if !is_root() {
        eprintln!("skipped: needs root to connect as other uids");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let f = fixture(WorkerConfig::default());
    let sockets = tempfile::tempdir().unwrap();
    std::fs::set_permissions(sockets.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = sockets.path().join("strata.sock");
    let listener = crate::sidecar::bind_socket(&path, Some("4243")).unwrap();
    tokio::spawn(serve_unix(listener, f.plane.clone(), f.cancel.clone()));
    let answer = child_as(65534, 4243, &path).await;
    assert!(answer.starts_with("error PermissionDenied"), "{answer}");
    assert_eq!(f.plane.connections.snapshot().refused_peer_uid, 1);
}

#[tokio::test]
async fn a_hand_off_takes_the_offered_blocks_it_has_room_for_and_refuses_the_rest() {
    let mut f = fixture(WorkerConfig::default());
    let receiver =
        Arc::new(crate::handoff::Receiver::new(f.plane.blocks.clone(), crate::pins::PinSet::new(), 1));
    f.plane.handoff = Some(receiver.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(listener, f.plane.clone(), f.cancel.clone()));
    let mut stream = TcpStream::connect(addr).await.unwrap();

    use strata_common::BlockKey;
    let (a, b) = (BlockKey::new("file:///u/a#bs4", "v1", 0), BlockKey::new("file:///u/b#bs4", "v1", 0));
    let offer = frame::HandOffOffer { req_id: 1, blocks: vec![(a.clone(), 4), (b.clone(), 4)] };
    let (head, wanted) = call(&mut stream, &offer.encode()).await;
    assert!(head.status.is_ok(), "{head:?}");
    assert_eq!(wanted, vec![1, 0], "a queue of one takes the first block offered");

    let push = |req_id, key: &BlockKey| {
        frame::HandOffBlock { req_id, key: key.clone(), data: bytes::Bytes::from_static(b"abcd") }.encode()
    };
    let (head, _) = call(&mut stream, &push(2, &a)).await;
    assert!(head.status.is_ok(), "{head:?}");
    assert_eq!(f.plane.blocks.cache().memory_get(&a).await.as_deref(), Some(&b"abcd"[..]));
    let (head, _) = call(&mut stream, &push(3, &b)).await;
    assert_eq!(head.status.err(), Some(ErrorKind::Unavailable), "a block not asked for is refused");
    assert!(!f.plane.blocks.cache().contains(&b));
    assert_eq!(receiver.received.load(std::sync::atomic::Ordering::Relaxed), 1);
}

/// A path's stat asked on `s`, which must succeed.
async fn stat_of(s: &mut TcpStream, req_id: u64, path: &str) -> FileStat {
    let (head, payload) = call(s, &StatRequest { req_id, path: path.into() }.encode()).await;
    assert!(head.status.is_ok(), "{head:?}: {}", String::from_utf8_lossy(&payload));
    FileStat::decode(&payload).unwrap()
}

/// A read of `path` as a client sends it after a stat: `len` bytes at `offset` of block `index`.
fn read_of(req_id: u64, stat: &FileStat, index: u64, offset: u64, len: u64) -> ReadBlockRequest {
    ReadBlockRequest {
        req_id,
        path: stat.path.clone(),
        version: stat.version.clone(),
        file_size: stat.size,
        block_size: stat.block_size,
        block_index: index,
        offset,
        len,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_many_answers_each_item_in_order_and_a_refused_or_missing_item_fails_alone() {
    let f = fixture(WorkerConfig::default());
    let a: Vec<u8> = (0..3000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::create_dir(f.dir.path().join("ok")).unwrap();
    std::fs::write(f.dir.path().join("ok/a.bin"), &a).unwrap();
    std::fs::write(f.dir.path().join("ok/b.bin"), b"small b").unwrap();
    // A reader limited to /d/ok: /d/f.bin is outside its scope.
    let token = only_reader_scoped_to(&f, "/d/ok");
    let addr = serve_on_loopback(&f).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&frame::auth_request(&token)).await.unwrap();
    let (sa, sb) = (stat_of(&mut s, 1, "/d/ok/a.bin").await, stat_of(&mut s, 2, "/d/ok/b.bin").await);
    assert_eq!(sa.block_size, 1024);
    let outside = FileStat { path: "/d/f.bin".into(), size: OLD.len() as u64, ..sb.clone() };
    let missing = FileStat { path: "/d/ok/missing.bin".into(), ..sb.clone() };
    let items = vec![
        read_of(11, &sa, 1, 10, 100),
        read_of(12, &outside, 0, 0, OLD.len() as u64),
        read_of(13, &missing, 0, 0, 7),
        read_of(14, &sb, 0, 0, 7),
        read_of(15, &sa, 2, 0, 3000 - 2048),
    ];
    s.write_all(&ReadMany { items }.encode()).await.unwrap();
    let mut answers = Vec::new();
    for _ in 0..5 {
        answers.push(response(&mut s).await);
    }
    let ids: Vec<u64> = answers.iter().map(|(h, _)| h.req_id).collect();
    assert_eq!(ids, vec![11, 12, 13, 14, 15], "one answer per item, in the order asked");
    assert_eq!(answers[0].1, &a[1024 + 10..1024 + 110]);
    assert_eq!(answers[1].0.status, Err(ErrorKind::PermissionDenied), "{:?}", answers[1]);
    assert_eq!(answers[2].0.status, Err(ErrorKind::NotFound), "{}", String::from_utf8_lossy(&answers[2].1));
    assert_eq!(answers[3].1, b"small b");
    assert_eq!(answers[4].1, &a[2048..]);
    assert!(answers[0].0.status.is_ok() && answers[3].0.status.is_ok() && answers[4].0.status.is_ok());

    // The connection stays in step: an ordinary read follows on it.
    let (head, payload) = call(&mut s, &read_of(16, &sb, 0, 6, 1).encode()).await;
    assert_eq!((head.req_id, payload.as_slice()), (16, &b"b"[..]), "{head:?}");
    // A batch of no items is malformed: rejected under request id 0, and the connection closes.
    let mut empty = request_header(Op::ReadMany, 4).to_vec();
    empty.extend_from_slice(&0u32.to_le_bytes());
    let (head, _) = call(&mut s, &empty).await;
    assert_eq!((head.req_id, head.status), (0, Err(ErrorKind::BadFrame)));
    tokio::time::timeout(Duration::from_secs(10), closed(&mut s)).await.expect("closed");
}

/// A connection that declares the latency class moves to the lane's thread with what it had
/// established: its token's scope still applies, it still holds its admission place, and its
/// idle deadline still closes it (counted, the place given back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_latency_connection_moves_to_the_lane_with_its_session_place_and_deadlines() {
    let idle = Duration::from_millis(300);
    let f = fixture(WorkerConfig { idle_timeout_ms: idle.as_millis() as u64, ..WorkerConfig::default() });
    std::fs::create_dir(f.dir.path().join("ok")).unwrap();
    std::fs::write(f.dir.path().join("ok/b.bin"), b"small b").unwrap();
    let token = only_reader_scoped_to(&f, "/d/ok");
    let addr = serve_on_loopback(&f).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    let opening =
        [frame::auth_request(&token), frame::class_request(strata_common::QosClass::Latency)].concat();
    s.write_all(&opening).await.unwrap();
    let sb = stat_of(&mut s, 1, "/d/ok/b.bin").await;
    assert_eq!(f.plane.latency_lane.moved(), 1, "the connection moved");
    let (head, payload) = call(&mut s, &read_of(2, &sb, 0, 0, 7).encode()).await;
    assert_eq!((head.status, payload.as_slice()), (Ok(Source::Ufs), &b"small b"[..]), "{head:?}");
    let outside = FileStat { path: "/d/f.bin".into(), size: OLD.len() as u64, ..sb.clone() };
    let (head, _) = call(&mut s, &read_of(3, &outside, 0, 0, OLD.len() as u64).encode()).await;
    assert_eq!(head.status, Err(ErrorKind::PermissionDenied), "the token's scope moved with it");
    assert_eq!(f.plane.connections.snapshot().open, 1, "its place moved with it");
    let counters = f.plane.classes.counters();
    assert_eq!(counters[strata_common::QosClass::Latency as usize].served, 1, "{counters:?}");
    tokio::time::timeout(Duration::from_secs(10), closed(&mut s)).await.expect("closed when idle");
    eventually("counted and the place given back", Duration::from_secs(5), || {
        let s = f.plane.connections.snapshot();
        s.idle_timeouts == 1 && s.open == 0
    })
    .await;
}
