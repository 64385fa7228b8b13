//! Copies, renames and appends on an in-process cluster: a copy inside one mount made by the UFS
//! (no byte through the worker or the client), across mounts streamed through the worker's
//! block cache (a second copy of the same source reads nothing from the UFS), the fallback when
//! the UFS refuses a copy, the token checks of `Op::Copy` and `Rename`, renames in place and
//! their refusals, and appends on a local directory against their refusals elsewhere.

use std::collections::HashMap;
use std::time::Duration;

use strata_client::{Client, ClientError, CopiedBy, Moved};
use strata_common::ErrorKind;
use strata_common::frame::{
    self, CopyAnswer, CopyRequest, RESPONSE_HEADER_LEN, ResponseHeader, WriteBegin, WriteFlags,
};
use strata_testkit::{Cluster, ClusterOptions, TestUfs, pattern};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn writable(workers: usize) -> ClusterOptions {
    let mut opts = ClusterOptions { workers, ..ClusterOptions::default() };
    opts.mount_options.push(("mode".into(), "write-through".into()));
    opts
}

/// Mounts another local directory at `path` with `mode`; returns the directory.
async fn mount_dir(client: &Client, path: &str, mode: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let options: HashMap<String, String> = [
        ("mode".to_string(), mode.to_string()),
        ("block_size".to_string(), "1MiB".to_string()),
        ("metadata_ttl".to_string(), "60s".to_string()),
    ]
    .into();
    client.admin().add_mount(path, &format!("file://{}", dir.path().display()), options).await.unwrap();
    dir
}

fn kind<T: std::fmt::Debug>(r: Result<T, ClientError>) -> ErrorKind {
    r.expect_err("must fail").kind()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_copy_inside_a_mount_is_made_by_the_ufs() {
    let cluster = Cluster::start(writable(2)).await;
    let client = cluster.client().await;
    let data = pattern(3 * 1024 * 1024 + 5, 1);
    cluster.write_file("src/a.bin", &data);
    std::fs::write(cluster.ufs.dir().join("old.bin"), b"the old, longer destination").unwrap();
    let before = cluster.counters().bytes_read();
    // A stat cached before the copy must not hide the new file.
    assert_eq!(client.stat("/data/old.bin").await.unwrap().size, 27);

    let copied = client.copy("/data/src/a.bin", "/data/new/deep/b.bin").await.unwrap();
    assert_eq!((copied.by, copied.bytes), (CopiedBy::Ufs, data.len() as u64));
    client.copy("/data/src/a.bin", "/data/old.bin").await.unwrap();
    assert_eq!(std::fs::read(cluster.ufs.dir().join("new/deep/b.bin")).unwrap(), data);
    assert_eq!(std::fs::read(cluster.ufs.dir().join("old.bin")).unwrap(), data);
    assert_eq!(cluster.counters().copies(), 2);
    assert_eq!(cluster.counters().bytes_read(), before, "no byte was read from the UFS by Strata");
    let served: u64 = (0..2).map(|i| cluster.worker(i).blocks.counters().bytes_served).sum();
    assert_eq!(served, 0, "no byte went through a worker");
    assert_eq!(client.stat("/data/old.bin").await.unwrap().size, data.len() as u64);
    assert_eq!(&client.read_all("/data/new/deep/b.bin").await.unwrap()[..], &data[..]);

    // The UFS refusing (S3 copies at most 5 GiB at once): the worker streams it instead.
    cluster.faults().refuse_next_copies.store(1, std::sync::atomic::Ordering::SeqCst);
    let copied = client.copy("/data/src/a.bin", "/data/c.bin").await.unwrap();
    assert_eq!(copied.by, CopiedBy::Worker);
    assert_eq!(std::fs::read(cluster.ufs.dir().join("c.bin")).unwrap(), data);
    let names: Vec<_> = std::fs::read_dir(cluster.ufs.dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".strata-partial"))
        .collect();
    assert!(names.is_empty(), "no staging file left: {names:?}");

    // What cannot be copied, and why.
    std::fs::create_dir(cluster.ufs.dir().join("emptydir")).unwrap();
    assert_eq!(kind(client.copy("/data/missing", "/data/x").await), ErrorKind::NotFound);
    assert_eq!(kind(client.copy("/data/src", "/data/x").await), ErrorKind::IsDirectory);
    assert_eq!(kind(client.copy("/data/c.bin", "/data/emptydir").await), ErrorKind::IsDirectory);
    assert_eq!(kind(client.copy("/data/c.bin", "/data/c.bin").await), ErrorKind::InvalidArgument);
    assert_eq!(kind(client.copy("/data/c.bin", "/data").await), ErrorKind::IsDirectory);
    assert_eq!(kind(client.copy("/data/c.bin", "/nowhere/x").await), ErrorKind::NotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_copy_across_mounts_streams_through_the_block_cache() {
    // One worker: it owns every block, so the second copy finds them all cached.
    let cluster = Cluster::start(writable(1)).await;
    let client = cluster.client().await;
    let other = mount_dir(&client, "/other", "write-through").await;
    let _ro = {
        let dir = tempfile::tempdir().unwrap();
        let options: HashMap<String, String> = [("block_size".to_string(), "1MiB".to_string())].into();
        client.admin().add_mount("/ro", &format!("file://{}", dir.path().display()), options).await.unwrap();
        dir
    };
    let data = pattern(5 * 1024 * 1024 + 3, 2);
    cluster.write_file("a.bin", &data);
    let reads = cluster.ufs_reads();

    let copied = client.copy("/data/a.bin", "/other/x/a.bin").await.unwrap();
    assert_eq!((copied.by, copied.bytes), (CopiedBy::Worker, data.len() as u64));
    assert_eq!(std::fs::read(other.path().join("x/a.bin")).unwrap(), data);
    assert_eq!(cluster.ufs_reads() - reads, 6, "each of the 6 blocks read once");

    let copied = client.copy("/data/a.bin", "/other/y.bin").await.unwrap();
    assert_eq!(copied.by, CopiedBy::Worker);
    assert_eq!(std::fs::read(other.path().join("y.bin")).unwrap(), data);
    assert_eq!(cluster.ufs_reads() - reads, 6, "the second copy read the cached blocks only");
    assert_eq!(cluster.counters().copies(), 0, "two mounts: never the UFS's own copy");

    // An empty file copies too (no block to read).
    cluster.write_file("empty.bin", b"");
    client.copy("/data/empty.bin", "/other/empty.bin").await.unwrap();
    assert_eq!(std::fs::read(other.path().join("empty.bin")).unwrap(), b"");

    // Onto a read-only mount: refused, nothing written.
    let e = client.copy("/data/a.bin", "/ro/a.bin").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
}

/// `Op::Copy` asks read on the source and write on the destination of the connection's token.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_copy_needs_read_on_the_source_and_write_on_the_destination() {
    let cluster = Cluster::start(writable(1)).await;
    let admin = cluster.client().await;
    cluster.write_file("a/f.bin", b"in a");
    cluster.write_file("b/f.bin", b"in b");
    let (_, reader) = admin.admin().create_token("reader", "", "reader").await.unwrap();
    let (_, writer_a) = admin.admin().create_token("writer", "/data/a", "writer of a").await.unwrap();
    let reader = cluster.client_with_token(Some(&reader)).await.unwrap();
    let writer_a = cluster.client_with_token(Some(&writer_a)).await.unwrap();

    let e = reader.copy("/data/a/f.bin", "/data/a/g.bin").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    // Its stat of the source is refused before any worker is asked.
    let e = writer_a.copy("/data/b/f.bin", "/data/a/g.bin").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    let e = writer_a.copy("/data/a/f.bin", "/data/b/g.bin").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    assert!(!cluster.ufs.dir().join("a/g.bin").exists() && !cluster.ufs.dir().join("b/g.bin").exists());
    writer_a.copy("/data/a/f.bin", "/data/a/g.bin").await.unwrap();
    assert_eq!(std::fs::read(cluster.ufs.dir().join("a/g.bin")).unwrap(), b"in a");

    // The worker checks on its own, whatever a client does first: a raw frame from the scoped
    // writer naming a source outside its scope.
    let mut s = cluster.dial(cluster.worker(0).data_addr).await;
    let token = cluster_token(&admin, "writer", "/data/a").await;
    s.write_all(&frame::auth_request(&token)).await.unwrap();
    let req = CopyRequest {
        req_id: 9,
        src: "/data/b/f.bin".into(),
        dst: "/data/a/h.bin".into(),
        version: String::new(),
        size: 0,
    };
    s.write_all(&req.encode()).await.unwrap();
    let (head, message) = answer(&mut s).await;
    assert_eq!((head.req_id, head.status), (9, Err(ErrorKind::PermissionDenied)), "{message}");
    // The connection stays usable: an allowed copy on it goes through.
    let req = CopyRequest { req_id: 10, src: "/data/a/f.bin".into(), ..req };
    s.write_all(&req.encode()).await.unwrap();
    let (head, payload) = answer(&mut s).await;
    assert_eq!((head.req_id, head.status.is_ok()), (10, true), "{payload}");
    assert!(cluster.ufs.dir().join("a/h.bin").exists());

    // Renames need write on both paths too.
    let e = reader.rename("/data/a/f.bin", "/data/a/r.bin").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    let e = writer_a.rename("/data/a/f.bin", "/data/b/r.bin").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    assert!(cluster.ufs.dir().join("a/f.bin").exists());
}

async fn cluster_token(admin: &Client, role: &str, prefix: &str) -> String {
    admin.admin().create_token(role, prefix, "raw frames").await.unwrap().1
}

/// One answer on a raw connection: its header, and its payload as text.
async fn answer(s: &mut tokio::net::TcpStream) -> (ResponseHeader, String) {
    let mut head = [0u8; RESPONSE_HEADER_LEN];
    tokio::time::timeout(Duration::from_secs(20), s.read_exact(&mut head)).await.unwrap().unwrap();
    let head = ResponseHeader::decode(&head).unwrap();
    let mut payload = vec![0u8; head.payload_len as usize];
    s.read_exact(&mut payload).await.unwrap();
    let text = match head.status {
        Ok(_) => format!("{:?}", CopyAnswer::decode(&payload)),
        Err(_) => String::from_utf8_lossy(&payload).into_owned(),
    };
    (head, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn renames_are_made_in_place_where_the_ufs_can() {
    let cluster = Cluster::start(writable(1)).await;
    let client = cluster.client().await;
    let other = mount_dir(&client, "/other", "write-through").await;
    cluster.write_file("d/one.bin", b"one");
    cluster.write_file("d/sub/two.bin", b"two");
    cluster.write_file("f.bin", b"file");
    cluster.write_file("g.bin", b"replaced");
    // Cached before (here, and on the master through this client): the rename forgets them.
    assert!(client.stat("/data/d/sub/two.bin").await.is_ok());
    assert!(client.stat("/data/d/one.bin").await.is_ok());
    assert!(client.stat("/data/g.bin").await.is_ok());

    assert!(client.rename("/data/f.bin", "/data/g.bin").await.unwrap(), "a file over a file");
    assert_eq!(std::fs::read(cluster.ufs.dir().join("g.bin")).unwrap(), b"file");
    assert_eq!(client.stat("/data/g.bin").await.unwrap().size, 4);
    assert!(client.rename("/data/d", "/data/e/moved").await.unwrap(), "a directory, parents made");
    assert_eq!(std::fs::read(cluster.ufs.dir().join("e/moved/sub/two.bin")).unwrap(), b"two");
    assert_eq!(kind(client.stat("/data/d/sub/two.bin").await), ErrorKind::NotFound);
    // A client that never saw them asks the master, whose cached stats went with the rename.
    let fresh = cluster.client().await;
    assert_eq!(kind(fresh.stat("/data/d/one.bin").await), ErrorKind::NotFound, "the master forgot");
    assert_eq!(fresh.stat("/data/e/moved/one.bin").await.unwrap().size, 3);
    assert_eq!(cluster.counters().renames(), 2);

    // Refused, and nothing changed.
    cluster.write_file("x/in.bin", b"x");
    assert_eq!(kind(client.rename("/data/g.bin", "/data/e").await), ErrorKind::IsDirectory);
    assert_eq!(kind(client.rename("/data/x", "/data/e").await), ErrorKind::AlreadyExists);
    assert_eq!(kind(client.rename("/data/x", "/data/g.bin").await), ErrorKind::AlreadyExists);
    assert_eq!(kind(client.rename("/data/x", "/data/x/y").await), ErrorKind::InvalidArgument);
    assert_eq!(kind(client.rename("/data/missing", "/data/y").await), ErrorKind::NotFound);
    assert_eq!(kind(client.rename("/data/x", "/data").await), ErrorKind::InvalidArgument, "a mount point");
    assert!(cluster.ufs.dir().join("x/in.bin").exists());

    // Across mounts: not in place; `move_file` copies through a worker, then deletes.
    assert!(!client.rename("/data/g.bin", "/other/g.bin").await.unwrap());
    assert!(cluster.ufs.dir().join("g.bin").exists());
    match client.move_file("/data/g.bin", "/other/g.bin").await.unwrap() {
        Moved::Copied(c) => assert_eq!((c.by, c.bytes), (CopiedBy::Worker, 4)),
        Moved::Renamed => panic!("two mounts cannot rename in place"),
    }
    assert_eq!(std::fs::read(other.path().join("g.bin")).unwrap(), b"file");
    assert!(!cluster.ufs.dir().join("g.bin").exists());
    assert_eq!(client.move_file("/data/x/in.bin", "/data/x/out.bin").await.unwrap(), Moved::Renamed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn appends_on_a_local_directory_and_refusals_elsewhere() {
    let cluster = Cluster::start(writable(1)).await;
    let client = cluster.client().await;
    cluster.write_file("log.txt", b"first\n");
    assert_eq!(client.stat("/data/log.txt").await.unwrap().size, 6);
    let mut w = client.append("/data/log.txt").await.unwrap();
    w.write(b"second\n").await.unwrap();
    assert_eq!(std::fs::read(cluster.ufs.dir().join("log.txt")).unwrap(), b"first\n", "not before close");
    let info = w.close().await.unwrap();
    assert_eq!(info.size, 13);
    assert_eq!(&client.read_all("/data/log.txt").await.unwrap()[..], b"first\nsecond\n");
    // Dropped before close: nothing changes.
    let mut w = client.append("/data/log.txt").await.unwrap();
    w.write(&pattern(3 << 20, 3)).await.unwrap();
    drop(w);
    // A new file is made by its first append.
    let mut w = client.append("/data/new/made.txt").await.unwrap();
    w.write(b"hello").await.unwrap();
    w.close().await.unwrap();
    assert_eq!(std::fs::read(cluster.ufs.dir().join("new/made.txt")).unwrap(), b"hello");
    strata_testkit::eventually("the dropped append was aborted", Duration::from_secs(20), || async {
        cluster.worker(0).blocks.counters().writes_aborted == 1
    })
    .await;
    assert_eq!(std::fs::read(cluster.ufs.dir().join("log.txt")).unwrap(), b"first\nsecond\n");

    // A write-back mount: the client refuses at once, and a worker asked anyway refuses too.
    let _wb = mount_dir(&client, "/wb", "write-back").await;
    let e = client.append("/wb/log.txt").await.err().expect("refused");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(e.to_string().contains("write-back"), "{e}");
    let mut s = cluster.dial(cluster.worker(0).data_addr).await;
    s.write_all(&frame::auth_request(&cluster.admin_token().unwrap())).await.unwrap();
    let begin = WriteBegin { req_id: 4, path: "/wb/log.txt".into(), write_back: None };
    s.write_all(&begin.encode_with(WriteFlags { append: true })).await.unwrap();
    let (head, message) = answer(&mut s).await;
    assert_eq!(head.status, Err(ErrorKind::InvalidArgument), "{message}");
    assert!(message.contains("write-through"), "{message}");
}

/// On S3 (Garage): a copy is a CopyObject, a rename is not possible in place (so `move_file`
/// copies and deletes), and appends are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_s3_copies_are_copy_object_and_appends_are_refused() {
    let cluster = Cluster::start_with(writable(1), TestUfs::s3()).await;
    let client = cluster.client().await;
    let data = pattern((2 << 20) + 11, 4);
    cluster.ufs.put("src/a.bin", data.clone()).await;
    let copied = client.copy("/data/src/a.bin", "/data/dst/b.bin").await.unwrap();
    assert_eq!((copied.by, copied.bytes), (CopiedBy::Ufs, data.len() as u64));
    assert_eq!(cluster.counters().bytes_read(), 0);
    assert_eq!(cluster.ufs.operator().read("dst/b.bin").await.unwrap().to_vec(), data);

    assert!(!client.rename("/data/dst/b.bin", "/data/dst/c.bin").await.unwrap(), "S3 cannot rename");
    match client.move_file("/data/dst/b.bin", "/data/dst/c.bin").await.unwrap() {
        Moved::Copied(c) => assert_eq!(c.by, CopiedBy::Ufs),
        Moved::Renamed => panic!("renamed on S3"),
    }
    assert!(!cluster.ufs.operator().exists("dst/b.bin").await.unwrap());
    assert_eq!(cluster.ufs.operator().read("dst/c.bin").await.unwrap().to_vec(), data);

    let e = client.append("/data/dst/c.bin").await.err().expect("refused");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(e.to_string().contains("cannot append"), "{e}");
}
