//! Short-circuit reads end to end: an in-process cluster, an in-process sidecar on a Unix
//! socket, and clients that map the descriptors the sidecar passes — and fall back to the
//! framed read, then to the cluster, whenever anything about a grant is wrong.

use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use std::time::{Duration, Instant};

use bytes::Bytes;
use strata_client::{Client, ClientConfig};
use strata_common::ErrorKind;
use strata_common::fdpass::{read_exact_with_fds, write_all_with_fd};
use strata_common::frame::{
    self, BlockGrant, GrantHandle, GrantKind, Op, REQUEST_HEADER_LEN, RESPONSE_HEADER_LEN, ReadBlockRequest,
    ResponseHeader, Source,
};
use strata_testkit::{Cluster, ClusterOptions, pattern};
use strata_worker::WorkerConfig;
use strata_worker::sidecar::{self, SidecarHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

const MIB: usize = 1 << 20;

async fn cluster() -> Cluster {
    Cluster::start(ClusterOptions { workers: 1, ..ClusterOptions::default() }).await
}

async fn start_sidecar(cluster: &Cluster, dir: &Path, tune: impl FnOnce(&mut WorkerConfig)) -> SidecarHandle {
    start_sidecar_with_clock(cluster, dir, tune, strata_common::clock::system()).await
}

/// A sidecar whose leases expire by `clock` (a test advances it instead of sleeping).
async fn start_sidecar_with_clock(
    cluster: &Cluster,
    dir: &Path,
    tune: impl FnOnce(&mut WorkerConfig),
    clock: strata_common::SharedClock,
) -> SidecarHandle {
    let mut config = WorkerConfig {
        master_addr: cluster.master_addr(),
        http_addr: "127.0.0.1:0".parse().unwrap(),
        data_dir: dir.join("sidecar"),
        memory_capacity: 64 << 20,
        nvme_capacity: 0,
        sidecar: true,
        socket_path: Some(dir.join("strata.sock")),
        token: cluster.worker_token(),
        ..WorkerConfig::default()
    };
    tune(&mut config);
    let upstream = cluster
        .sidecar_upstream(config.token.clone(), std::time::Duration::from_millis(config.ufs_timeout_ms))
        .await;
    sidecar::start_with_clock(config, cluster.factory.clone(), std::sync::Arc::new(upstream), clock)
        .await
        .expect("sidecar starts")
}

/// A client of the sidecar without a mapping cache: each read maps exactly its range and
/// gives its lease back when its bytes are dropped.
async fn client(cluster: &Cluster, socket: &Path, short_circuit: bool) -> Client {
    client_with_cache(cluster, socket, short_circuit, 0).await
}

async fn client_with_cache(
    cluster: &Cluster,
    socket: &Path,
    short_circuit: bool,
    cache_bytes: u64,
) -> Client {
    let mut config: ClientConfig = cluster.client_config();
    config.sidecar_socket = Some(socket.to_path_buf());
    config.short_circuit = short_circuit;
    config.short_circuit_cache_bytes = cache_bytes;
    Client::connect(config).await.expect("client connects")
}

fn served_by_cluster(cluster: &Cluster) -> u64 {
    cluster.worker(0).blocks.counters().bytes_served
}

/// Polls until the sidecar holds no lease (the client's releases are asynchronous).
async fn wait_for_no_leases(sidecar: &SidecarHandle) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while sidecar.grants.fd().held_leases() != 0 {
        assert!(Instant::now() < deadline, "{} leases still held", sidecar.grants.fd().held_leases());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Byte ranges that start and end in odd places, cross block boundaries, and hit the short
/// last block.
fn odd_ranges(size: usize) -> Vec<(usize, usize)> {
    vec![(0, size), (1, 1), (MIB - 3, 7), (MIB + 4095, MIB + 2), (size - 5, 5), (12_345, 77_777)]
}

async fn check_ranges(client: &Client, path: &str, data: &[u8]) -> Vec<Bytes> {
    let mut held = Vec::new();
    for (offset, len) in odd_ranges(data.len()) {
        let got = client.read_range(path, offset as u64, len as u64).await.unwrap();
        assert!(got[..] == data[offset..offset + len], "range {offset}+{len} differs");
        held.push(got);
    }
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dram_blocks_are_mapped_from_shared_memory_copied_once_and_their_leases_end() {
    let cluster = cluster().await;
    let size = 3 * MIB + 12_345;
    let data = pattern(size, 11);
    cluster.write_file("sc/dram.bin", &data);
    let tmp = tempfile::tempdir().unwrap();
    let sidecar = start_sidecar(&cluster, tmp.path(), |_| {}).await;
    let client = client(&cluster, &sidecar.socket_path, true).await;

    let held = check_ranges(&client, "/data/sc/dram.bin", &data).await;
    let sc = sidecar.grants.fd();
    // Reads of one block return the mapping itself, which holds its lease; reads across
    // blocks are assembled into a new buffer and have given their leases back.
    assert!(sc.held_leases() >= 3, "each single-block read holds a grant");
    assert_eq!(sc.shm_cached(), (4, size as u64), "each DRAM block copied to shared memory once");
    assert_eq!(sidecar.blocks.counters().upstream_reads, 4);

    // A second pass maps the same copies again: nothing more is copied or fetched.
    let again = check_ranges(&client, "/data/sc/dram.bin", &data).await;
    assert_eq!(sc.shm_cached(), (4, size as u64));
    assert_eq!(sidecar.blocks.counters().upstream_reads, 4);
    drop(held);
    drop(again);
    wait_for_no_leases(&sidecar).await;
    sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_whole_block_mappings_serve_later_reads_until_half_their_lease() {
    let cluster = cluster().await;
    let size = 2 * MIB + 77;
    let data = pattern(size, 13);
    cluster.write_file("sc/kept.bin", &data);
    let tmp = tempfile::tempdir().unwrap();
    // One clock for the sidecar's leases and the client's kept mappings, advanced by the test.
    let clock = strata_common::clock::ManualClock::new();
    let sidecar =
        start_sidecar_with_clock(&cluster, tmp.path(), |c| c.short_circuit_lease_ms = 600, clock.clone())
            .await;
    let mut config: ClientConfig = cluster.client_config();
    config.sidecar_socket = Some(sidecar.socket_path.clone());
    config.short_circuit_cache_bytes = 64 << 20;
    config.clock = clock.clone();
    let client = Client::connect(config).await.expect("client connects");
    let sc = sidecar.grants.fd();

    for (offset, len) in [(0, 10), (5000, 100_000), (MIB - 1, 1), (7, MIB - 7)] {
        let got = client.read_range("/data/sc/kept.bin", offset as u64, len as u64).await.unwrap();
        assert!(got[..] == data[offset..offset + len], "range {offset}+{len} differs");
    }
    assert_eq!(sc.held_leases(), 1, "one grant of the whole block served every read of it");
    let tail = client.read_range("/data/sc/kept.bin", (size - 3) as u64, 3).await.unwrap();
    assert!(tail[..] == data[size - 3..]);
    assert_eq!(sc.held_leases(), 2);
    drop(tail);
    assert_eq!(sc.held_leases(), 2, "the client keeps its mappings, and their leases");

    // Past half the lease a kept mapping is not used: the block is granted again, and the
    // expired mappings are let go with their leases.
    clock.advance(Duration::from_millis(400));
    let again = client.read_range("/data/sc/kept.bin", 123, 456).await.unwrap();
    assert!(again[..] == data[123..579]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while sc.held_leases() != 1 {
        assert!(Instant::now() < deadline, "{} leases held", sc.held_leases());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvme_blocks_are_mapped_from_their_block_files() {
    let cluster = cluster().await;
    let size = 3 * MIB - 999;
    let data = pattern(size, 12);
    cluster.write_file("sc/nvme.bin", &data);
    let tmp = tempfile::tempdir().unwrap();
    let sidecar = start_sidecar(&cluster, tmp.path(), |c| {
        c.memory_capacity = 0;
        c.nvme_capacity = 64 << 20;
    })
    .await;
    let client = client(&cluster, &sidecar.socket_path, true).await;
    // The first read fetches the blocks from the cluster (granted as shared memory, since
    // they are not on the sidecar's disk yet); the next ones map the NVMe files.
    let first = client.read_all("/data/sc/nvme.bin").await.unwrap();
    assert!(first[..] == data[..]);
    sidecar.blocks.flush().await;
    let before = sidecar.blocks.counters().zero_copy_bytes;
    let held = check_ranges(&client, "/data/sc/nvme.bin", &data).await;
    let from_files = sidecar.blocks.counters().zero_copy_bytes - before;
    let asked: usize = odd_ranges(size).iter().map(|r| r.1).sum();
    assert_eq!(from_files, asked as u64, "every byte came from a block file");
    assert_eq!(sidecar.grants.fd().shm_cached().0, 0, "no DRAM tier, no cached copy");
    drop((first, held));
    wait_for_no_leases(&sidecar).await;
    sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mapped_block_keeps_its_bytes_after_eviction_and_after_the_sidecar_is_gone() {
    let cluster = cluster().await;
    let a = pattern(MIB, 21);
    let b = pattern(4 * MIB, 22);
    cluster.write_file("sc/a.bin", &a);
    cluster.write_file("sc/b.bin", &b);
    let tmp = tempfile::tempdir().unwrap();

    // DRAM: two blocks of DRAM and one block of shared-memory copies.
    let dram = start_sidecar(&cluster, &tmp.path().join("dram"), |c| {
        c.memory_capacity = 2 * MIB as u64;
        c.short_circuit_shm_bytes = MIB as u64;
    })
    .await;
    // NVMe: two blocks of disk, no DRAM.
    let nvme = start_sidecar(&cluster, &tmp.path().join("nvme"), |c| {
        c.memory_capacity = 0;
        c.nvme_capacity = 2 * MIB as u64;
    })
    .await;

    let mut mapped = Vec::new();
    for (tier, sidecar) in [("dram", &dram), ("nvme", &nvme)] {
        let client = client(&cluster, &sidecar.socket_path, true).await;
        let warm = client.read_all("/data/sc/a.bin").await.unwrap();
        sidecar.blocks.flush().await;
        drop(warm);
        let held = client.read_range("/data/sc/a.bin", 100, (MIB - 200) as u64).await.unwrap();
        assert!(sidecar.grants.fd().held_leases() >= 1);
        let a_blocks: Vec<_> = sidecar.blocks.cache().held_blocks().into_iter().map(|(k, _)| k).collect();
        // Fill the tiers with another file, then evict what is left of a.bin everywhere: a
        // block hit while in S3-FIFO's small queue moves to main and may outlive a one-pass
        // read of b.bin (that is the policy's scan resistance: it happens when b's blocks,
        // fetched side by side by readahead, are put before their own first hits).
        let other = client.read_all("/data/sc/b.bin").await.unwrap();
        assert!(other[..] == b[..]);
        sidecar.blocks.flush().await;
        for t in sidecar.blocks.cache().tiers() {
            t.evict(u64::MAX, &|k| a_blocks.contains(k)).await.unwrap();
        }
        let fetched = sidecar.blocks.counters().upstream_reads;
        let reread = client.read_all("/data/sc/a.bin").await.unwrap();
        assert!(reread[..] == a[..]);
        assert_eq!(
            sidecar.blocks.counters().upstream_reads,
            fetched + 1,
            "{tier}: a.bin was evicted, so it was fetched again (tiers now: {:?})",
            sidecar.blocks.cache().tier_usage()
        );
        assert!(held[..] == a[100..MIB - 100], "the mapped block changed after eviction");
        mapped.push(held);
    }
    dram.shutdown().await;
    nvme.shutdown().await;
    for held in &mapped {
        assert!(held[..] == a[100..MIB - 100], "the mapped block changed after the sidecar stopped");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opting_out_on_either_side_reads_through_the_socket() {
    let cluster = cluster().await;
    let data = pattern(3 * MIB + 5, 31);
    cluster.write_file("sc/opt.bin", &data);
    let tmp = tempfile::tempdir().unwrap();

    let off = start_sidecar(&cluster, &tmp.path().join("off"), |c| c.short_circuit = false).await;
    let client_on = client(&cluster, &off.socket_path, true).await;
    let held = check_ranges(&client_on, "/data/sc/opt.bin", &data).await;
    assert_eq!(off.grants.fd().held_leases(), 0);
    assert_eq!(off.grants.fd().shm_cached().0, 0);
    assert!(off.blocks.counters().bytes_served > 0, "served through the socket");
    assert_eq!(served_by_cluster(&cluster), data.len() as u64, "the cluster only filled the sidecar");
    drop(held);

    let on = start_sidecar(&cluster, &tmp.path().join("on"), |_| {}).await;
    let client_off = client(&cluster, &on.socket_path, false).await;
    let held = check_ranges(&client_off, "/data/sc/opt.bin", &data).await;
    assert_eq!(on.grants.fd().held_leases(), 0);
    assert_eq!(on.grants.fd().shm_cached().0, 0);
    drop(held);

    // The environment variable turns it off too, for a configuration read from it.
    // SAFETY: nextest runs each test in a process of its own; nothing else reads it meanwhile.
    unsafe { std::env::set_var(strata_client::shortcircuit::SHORT_CIRCUIT_ENV, "0") };
    assert!(!ClientConfig::from_env("127.0.0.1:1").short_circuit);
    assert!(ClientConfig::new("127.0.0.1:1").short_circuit, "a configuration of its own reads nothing");
    unsafe { std::env::remove_var(strata_client::shortcircuit::SHORT_CIRCUIT_ENV) };
    assert!(ClientConfig::from_env("127.0.0.1:1").short_circuit);
    off.shutdown().await;
    on.shutdown().await;
}

/// What a broken sidecar does with an `OpenBlock`.
#[derive(Clone, Copy, Debug)]
enum Misbehaviour {
    Refuse,
    Garbage,
    Close,
    GrantWithoutFd,
    GrantPastTheEnd,
    UnsealedSharedMemory,
    WrongLength,
}

/// A fake sidecar: misbehaves on every `OpenBlock` and closes on anything else, so that the
/// client's framed read through the socket fails as well and only the cluster can serve.
async fn fake_sidecar(listener: UnixListener, how: Misbehaviour) {
    loop {
        let Ok((mut stream, _)) = listener.accept().await else { return };
        tokio::spawn(async move {
            let mut header = [0u8; REQUEST_HEADER_LEN];
            while stream.read_exact(&mut header).await.is_ok() {
                let Ok((op, len)) = frame::decode_request_header(&header) else { return };
                let mut body = vec![0u8; len];
                if stream.read_exact(&mut body).await.is_err() || op != Op::OpenBlock {
                    return;
                }
                let req = ReadBlockRequest::decode_body(&body).unwrap();
                let grant = |offset| {
                    let g = BlockGrant {
                        lease_id: 1,
                        ttl_ms: 1000,
                        len: req.len,
                        handle: GrantHandle::Fd { offset },
                    };
                    let head =
                        ResponseHeader { status: Ok(Source::Memory), req_id: req.req_id, payload_len: 40 }
                            .encode();
                    [&head[..], &g.encode()[..]].concat()
                };
                let small_file = || {
                    let mut f = tempfile::tempfile().unwrap();
                    std::io::Write::write_all(&mut f, &[0u8; 10]).unwrap();
                    OwnedFd::from(f)
                };
                let sent = match how {
                    Misbehaviour::Refuse => {
                        let msg = b"no";
                        let head = ResponseHeader {
                            status: Err(ErrorKind::Unavailable),
                            req_id: req.req_id,
                            payload_len: 2,
                        }
                        .encode();
                        stream.write_all(&[&head[..], msg].concat()).await
                    }
                    Misbehaviour::Garbage => stream.write_all(&[0xAB; 64]).await,
                    Misbehaviour::Close => return,
                    Misbehaviour::GrantWithoutFd => stream.write_all(&grant(0)).await,
                    Misbehaviour::GrantPastTheEnd => {
                        let fd = small_file();
                        write_all_with_fd(&mut stream, &grant(0), fd.as_fd()).await
                    }
                    Misbehaviour::UnsealedSharedMemory => {
                        let mut f = std::fs::File::from(unsealed_memfd());
                        std::io::Write::write_all(&mut f, &vec![0u8; req.len as usize]).unwrap();
                        write_all_with_fd(&mut stream, &grant(0), f.as_fd()).await
                    }
                    Misbehaviour::WrongLength => {
                        let mut bytes = grant(0);
                        bytes[RESPONSE_HEADER_LEN + 24..RESPONSE_HEADER_LEN + 32]
                            .copy_from_slice(&(req.len + 1).to_le_bytes());
                        let fd = small_file();
                        write_all_with_fd(&mut stream, &bytes, fd.as_fd()).await
                    }
                };
                if sent.is_err() {
                    return;
                }
            }
        });
    }
}

/// An unsealed memfd: what a careless sidecar might pass.
fn unsealed_memfd() -> OwnedFd {
    // SAFETY: a valid NUL-terminated name and plain flags.
    let raw =
        unsafe { libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    assert!(raw >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: a new descriptor nobody else owns.
    unsafe { OwnedFd::from_raw_fd(raw) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_that_refuses_sends_garbage_or_closes_leaves_reads_correct() {
    let cluster = cluster().await;
    let data = pattern(2 * MIB + 333, 41);
    cluster.write_file("sc/broken.bin", &data);
    let tmp = tempfile::tempdir().unwrap();
    for (i, how) in [
        Misbehaviour::Refuse,
        Misbehaviour::Garbage,
        Misbehaviour::Close,
        Misbehaviour::GrantWithoutFd,
        Misbehaviour::GrantPastTheEnd,
        Misbehaviour::UnsealedSharedMemory,
        Misbehaviour::WrongLength,
    ]
    .into_iter()
    .enumerate()
    {
        let socket: PathBuf = tmp.path().join(format!("fake-{i}.sock"));
        let listener = UnixListener::bind(&socket).unwrap();
        let server = tokio::spawn(fake_sidecar(listener, how));
        let client = client(&cluster, &socket, true).await;
        let before = served_by_cluster(&cluster);
        let got = client.read_range("/data/sc/broken.bin", 1000, MIB as u64).await.unwrap();
        assert!(got[..] == data[1000..1000 + MIB], "{how:?}: wrong bytes");
        assert_eq!(served_by_cluster(&cluster) - before, MIB as u64, "{how:?}: not read from the cluster");
        server.abort();
    }
}

async fn open_block(
    stream: &mut UnixStream,
    req: &ReadBlockRequest,
) -> (ResponseHeader, Vec<u8>, Vec<OwnedFd>) {
    stream.write_all(&req.encode_open(GrantKind::Fd)).await.unwrap();
    let mut fds = Vec::new();
    let mut head = [0u8; RESPONSE_HEADER_LEN];
    read_exact_with_fds(stream, &mut head, &mut fds).await.unwrap();
    let head = ResponseHeader::decode(&head).unwrap();
    let mut payload = vec![0u8; head.payload_len as usize];
    read_exact_with_fds(stream, &mut payload, &mut fds).await.unwrap();
    (head, payload, fds)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_open_blocks_get_error_frames_and_unreleased_leases_expire() {
    let cluster = cluster().await;
    let data = pattern(MIB + 10, 51);
    cluster.write_file("sc/raw.bin", &data);
    let tmp = tempfile::tempdir().unwrap();
    let clock = strata_common::clock::ManualClock::new();
    let sidecar =
        start_sidecar_with_clock(&cluster, tmp.path(), |c| c.short_circuit_lease_ms = 300, clock.clone())
            .await;
    let client = client(&cluster, &sidecar.socket_path, true).await;
    let info = client.stat("/data/sc/raw.bin").await.unwrap();
    let req = ReadBlockRequest {
        req_id: 5,
        path: info.path.clone(),
        version: info.version.clone(),
        file_size: info.size,
        block_size: info.block_size,
        block_index: 0,
        offset: 10,
        len: 1000,
    };
    let mut stream = UnixStream::connect(&sidecar.socket_path).await.unwrap();
    if let Some(token) = cluster.admin_token() {
        stream.write_all(&strata_common::frame::auth_request(&token)).await.unwrap();
    }

    // Well-framed but wrong: an error frame, and the connection stays usable.
    let outside = ReadBlockRequest { offset: MIB as u64 - 10, len: 11, ..req.clone() };
    let (head, message, fds) = open_block(&mut stream, &outside).await;
    assert_eq!(head.status, Err(ErrorKind::InvalidArgument), "{}", String::from_utf8_lossy(&message));
    assert!(fds.is_empty());
    let elsewhere = ReadBlockRequest { path: "/nowhere/x.bin".into(), ..req.clone() };
    assert_eq!(open_block(&mut stream, &elsewhere).await.0.status, Err(ErrorKind::NotFound));

    // A good one on the same connection: a grant and one descriptor holding the range.
    let (head, payload, mut fds) = open_block(&mut stream, &req).await;
    assert_eq!(head.req_id, 5);
    let grant = BlockGrant::decode(&payload).unwrap();
    assert_eq!(grant.len, 1000);
    assert_eq!(grant.ttl_ms, 300);
    assert_eq!(fds.len(), 1);
    let GrantHandle::Fd { offset } = grant.handle else { panic!("not an fd grant") };
    let file = std::fs::File::from(fds.pop().unwrap());
    let mut buf = vec![0u8; 1000];
    std::os::unix::fs::FileExt::read_exact_at(&file, &mut buf, offset).unwrap();
    assert!(buf[..] == data[10..1010]);
    assert_eq!(sidecar.grants.fd().held_leases(), 1);

    // This reader never releases: the lease expires, and the next grant sweeps it.
    clock.advance(Duration::from_millis(300));
    let bytes = client.read_range("/data/sc/raw.bin", 0, 10).await.unwrap();
    assert!(bytes[..] == data[..10]);
    drop(bytes);
    wait_for_no_leases(&sidecar).await;

    // A malformed body: an error frame, then the connection is closed.
    let mut bad = frame::request_header(Op::OpenBlock, 10).to_vec();
    bad.extend_from_slice(&[0xFF; 10]);
    stream.write_all(&bad).await.unwrap();
    let mut head = [0u8; RESPONSE_HEADER_LEN];
    stream.read_exact(&mut head).await.unwrap();
    assert_eq!(ResponseHeader::decode(&head).unwrap().status, Err(ErrorKind::BadFrame));
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).await.unwrap();
    assert!(rest.len() <= frame::MAX_ERROR_MESSAGE, "only the error message follows, then EOF");
    sidecar.shutdown().await;
}

/// Workers that also serve Unix sockets, as `strata worker --socket` does: clients on their
/// host find them in the membership, with no sidecar and nothing configured. Without DRAM,
/// every block a worker holds is on NVMe, which it grants with no copy.
async fn cluster_with_local_sockets(workers: usize, memory_capacity: u64) -> Cluster {
    let opts = ClusterOptions { workers, local_sockets: true, memory_capacity, ..ClusterOptions::default() };
    Cluster::start(opts).await
}

async fn client_without_sidecar(cluster: &Cluster, short_circuit: bool) -> Client {
    let mut config: ClientConfig = cluster.client_config();
    config.sidecar_socket = None;
    config.short_circuit = short_circuit;
    Client::connect(config).await.expect("client connects")
}

/// Reads of whole-MiB blocks a [`check_ranges`] makes (a co-located worker's shorter blocks,
/// here the file's last one, are read over TCP: too small to be worth a mapping).
fn full_blocks_touched(size: usize) -> u64 {
    let full = size / MIB;
    odd_ranges(size)
        .iter()
        .map(|&(offset, len)| (offset / MIB..=(offset + len - 1) / MIB).filter(|&b| b < full).count() as u64)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_on_a_workers_host_maps_its_blocks_without_a_sidecar() {
    let mut cluster = cluster_with_local_sockets(1, 0).await;
    let size = 3 * MIB + 12_345;
    let data = pattern(size, 61);
    cluster.write_file("local/a.bin", &data);
    let worker = cluster.worker(0);
    let socket = worker.local_socket.clone().expect("the worker serves a socket");
    assert!(socket.is_absolute() && socket.exists(), "{}", socket.display());

    let client = client_without_sidecar(&cluster, true).await;
    // Not cached yet: a no-copy grant fetches nothing, so the first read goes over TCP.
    let first = client.read_all("/data/local/a.bin").await.unwrap();
    assert!(first[..] == data[..]);
    assert_eq!(client.short_circuit_reads(), 0);
    worker.blocks.flush().await;
    let held = check_ranges(&client, "/data/local/a.bin", &data).await;
    assert_eq!(
        client.short_circuit_reads(),
        full_blocks_touched(size),
        "every full block read was a mapping"
    );
    assert!(worker.grants.fd().held_leases() >= 1, "the kept mappings hold leases");
    drop(held);

    // Opted out: the same bytes over TCP, no grant asked.
    let tcp = client_without_sidecar(&cluster, false).await;
    let served = served_by_cluster(&cluster);
    check_ranges(&tcp, "/data/local/a.bin", &data).await;
    assert_eq!(tcp.short_circuit_reads(), 0);
    let asked: usize = odd_ranges(size).iter().map(|r| r.1).sum();
    assert_eq!(served_by_cluster(&cluster) - served, asked as u64, "every byte went over TCP");

    // A worker stopped with its clients' mappings alive: the bytes stay (a mapping names an
    // unchanging file or sealed memory), and its socket file goes.
    let mapped = client.read_range("/data/local/a.bin", 7, MIB as u64).await.unwrap();
    cluster.stop_worker(0).await;
    assert!(!socket.exists(), "a stopped worker removes its socket");
    assert!(mapped[..] == data[7..7 + MIB]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_missing_or_answering_as_another_worker_is_not_used() {
    let cluster = cluster_with_local_sockets(2, 0).await;
    let data = pattern(8 * MIB + 3, 62);
    cluster.write_file("local/b.bin", &data);
    let (w0, w1) = (cluster.worker(0), cluster.worker(1));
    // Every block on the workers' disks, where a grant would cost no copy.
    let warm = cluster.client().await.read_all("/data/local/b.bin").await.unwrap();
    assert!(warm[..] == data[..]);
    w0.blocks.flush().await;
    w1.blocks.flush().await;
    let (s0, s1) = (w0.local_socket.clone().unwrap(), w1.local_socket.clone().unwrap());
    // What a reused path looks like: w0's advertised path now reaches w1, and w1's path is gone.
    std::fs::rename(&s1, &s0).unwrap();

    let client = client_without_sidecar(&cluster, true).await;
    let got = client.read_all("/data/local/b.bin").await.unwrap();
    assert!(got[..] == data[..], "wrong bytes");
    assert_eq!(client.short_circuit_reads(), 0, "neither socket is trusted as its worker's");
    assert_eq!(w0.grants.fd().held_leases() + w1.grants.fd().held_leases(), 0, "no grant was asked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dram_block_of_a_co_located_worker_is_read_over_tcp_not_copied_into_shared_memory() {
    let cluster = cluster_with_local_sockets(1, 64 << 20).await;
    let data = pattern(2 * MIB + 77, 63);
    cluster.write_file("local/dram.bin", &data);
    let worker = cluster.worker(0);
    let client = client_without_sidecar(&cluster, true).await;
    for _ in 0..2 {
        let got = client.read_all("/data/local/dram.bin").await.unwrap();
        assert!(got[..] == data[..]);
    }
    assert_eq!(client.short_circuit_reads(), 0, "DRAM blocks are not granted by copy");
    let fallbacks = client.short_circuit_fallbacks();
    assert!(fallbacks.declined >= 1 && fallbacks.failed == 0, "declined, not failed: {fallbacks:?}");
    assert_eq!(worker.grants.fd().shm_cached(), (0, 0), "no shared-memory copy was made");
    assert_eq!(worker.grants.fd().held_leases(), 0);

    // A DRAM block that a copying reader (a sidecar-style client) had copied already is
    // granted from that copy.
    let info = client.stat("/data/local/dram.bin").await.unwrap();
    let req = ReadBlockRequest { req_id: 1, len: MIB as u64, ..strata_testkit::first_block_read(&info) };
    let socket = worker.local_socket.clone().unwrap();
    let mut stream = UnixStream::connect(&socket).await.unwrap();
    if let Some(token) = cluster.admin_token() {
        stream.write_all(&strata_common::frame::auth_request(&token)).await.unwrap();
    }
    let (head, _, fds) = open_block(&mut stream, &req).await;
    assert!(head.status.is_ok() && fds.len() == 1, "a copying grant is still served");
    assert_eq!(worker.grants.fd().shm_cached().0, 1);
    let before = client.short_circuit_reads();
    let got = client.read_range("/data/local/dram.bin", 5, 1000).await.unwrap();
    assert!(got[..] == data[5..1005]);
    assert_eq!(client.short_circuit_reads(), before + 1, "mapped from the kept copy");
}
