//! One behaviour suite, run through the whole cluster against every UFS available here: a
//! local directory (opendal fs) and a real S3 server (Garage, started by `./test.sh`).

use std::time::Duration;

use futures::StreamExt;
use strata_client::ClientError;
use strata_testkit::{Cluster, ClusterOptions, TestUfs, eventually, fill_pattern, pattern, peak_rss_bytes};
use strata_ufs::{OpendalUfs, Ufs, UfsError};
use tokio::io::AsyncReadExt;

const MIB: u64 = 1 << 20;

async fn cluster(ufs: TestUfs) -> Cluster {
    Cluster::start_with(ClusterOptions::default(), ufs).await
}

/// Writes many small objects concurrently, straight to the UFS.
async fn put_many(ufs: &TestUfs, objects: Vec<(String, Vec<u8>)>) {
    let op = ufs.operator();
    futures::stream::iter(objects)
        .for_each_concurrent(32, |(k, v)| {
            let op = op.clone();
            async move {
                op.write(&k, v).await.unwrap_or_else(|e| panic!("put {k}: {e}"));
            }
        })
        .await;
}

async fn list_paginates_past_1000_keys(ufs: TestUfs) {
    let c = cluster(ufs).await;
    let objects: Vec<_> = (0..1_050).map(|i| (format!("many/k{i:05}"), vec![(i % 251) as u8; 3])).collect();
    put_many(&c.ufs, objects).await;
    let client = c.client().await;
    let entries = client.list("/data/many").await.unwrap();
    let names: Vec<String> = entries.iter().map(|e| e.path.rsplit('/').next().unwrap().to_string()).collect();
    let expected: Vec<String> = (0..1_050).map(|i| format!("k{i:05}")).collect();
    assert_eq!(names, expected);
    assert!(entries.iter().all(|e| !e.is_dir && e.size == 3 && !e.version.is_empty()));
}

async fn stat_and_nested_prefixes(ufs: TestUfs) {
    let c = cluster(ufs).await;
    c.ufs.put("a/b/c/deep.bin", pattern(1234, 1)).await;
    c.ufs.put("a/top.bin", pattern(10, 2)).await;
    let client = c.client().await;
    let deep = client.stat("/data/a/b/c/deep.bin").await.unwrap();
    assert_eq!((deep.size, deep.is_dir), (1234, false));
    assert!(client.stat("/data/a/b").await.unwrap().is_dir);
    let top: Vec<(String, bool)> =
        client.list("/data/a").await.unwrap().into_iter().map(|e| (e.path, e.is_dir)).collect();
    assert_eq!(top, vec![("/data/a/b".to_string(), true), ("/data/a/top.bin".to_string(), false)]);
    assert_eq!(client.read_all("/data/a/b/c/deep.bin").await.unwrap(), pattern(1234, 1));
    let e = client.stat("/data/a/nope").await.unwrap_err();
    assert!(matches!(e, ClientError::NotFound(_)), "{e}");
}

async fn odd_key_names(ufs: TestUfs) {
    let c = cluster(ufs).await;
    let names = ["with space/file name.bin", "ünïcödé/数据 集.bin", "plus+and%percent.bin", "trailing.dot."];
    for (i, n) in names.iter().enumerate() {
        c.ufs.put(n, pattern(100 + i, i as u64)).await;
    }
    let client = c.client().await;
    for (i, n) in names.iter().enumerate() {
        let path = format!("/data/{n}");
        assert_eq!(client.read_all(&path).await.unwrap(), pattern(100 + i, i as u64), "{n}");
        assert_eq!(client.stat(&path).await.unwrap().size, 100 + i as u64);
    }
    let listed: Vec<String> =
        client.list("/data/ünïcödé").await.unwrap().into_iter().map(|e| e.path).collect();
    assert_eq!(listed, vec!["/data/ünïcödé/数据 集.bin".to_string()]);
}

async fn zero_byte_objects(ufs: TestUfs) {
    let c = cluster(ufs).await;
    c.ufs.put("empty.bin", Vec::new()).await;
    let client = c.client().await;
    let info = client.stat("/data/empty.bin").await.unwrap();
    assert_eq!((info.size, info.is_dir), (0, false));
    assert!(client.read_all("/data/empty.bin").await.unwrap().is_empty());
    let mut reader = client.open("/data/empty.bin").await.unwrap();
    let mut out = Vec::new();
    assert_eq!(reader.read_to_end(&mut out).await.unwrap(), 0);
    assert_eq!(c.ufs_reads(), 0, "nothing to fetch for an empty object");
}

async fn range_reads_at_block_edges(ufs: TestUfs) {
    let c = cluster(ufs).await;
    let size = 3 * MIB + 17;
    let data = pattern(size as usize, 9);
    c.ufs.put("edges.bin", data.clone()).await;
    let client = c.client().await;
    for edge in [0, MIB, 2 * MIB, 3 * MIB, size] {
        for (back, len) in [(0u64, 1u64), (1, 1), (1, 2), (7, 20), (0, MIB), (1, MIB + 2)] {
            let off = edge.saturating_sub(back);
            let got = client.read_range("/data/edges.bin", off, len).await.unwrap();
            let end = (off + len).min(size) as usize;
            assert!(got[..] == data[off as usize..end], "edge {edge} off {off} len {len}");
        }
    }
}

/// `ufs_read_parallelism`: a block read as several concurrent range requests arrives whole and
/// exact, and a piece of another version fails the read instead of mixing versions.
async fn split_range_reads(ufs: TestUfs) {
    let c = cluster(ufs).await;
    let size = 9 * MIB + 5;
    let (v1, v2) = (pattern(size as usize, 21), pattern(size as usize, 22));
    c.ufs.put("split.bin", v1.clone()).await;
    let options: std::collections::BTreeMap<String, String> = c
        .ufs
        .mount_options()
        .into_iter()
        .chain([
            ("ufs_read_parallelism".to_string(), "4".to_string()),
            ("block_size".to_string(), "4MiB".to_string()),
        ])
        .collect();
    let client = c.client().await;
    client.admin().add_mount("/split", &c.ufs_uri(), options.clone().into_iter().collect()).await.unwrap();
    assert_eq!(client.read_all("/split/split.bin").await.unwrap(), v1);
    let got = client.read_range("/split/split.bin", 4 * MIB - 3, 4 * MIB + 6).await.unwrap();
    assert!(got[..] == v1[(4 * MIB - 3) as usize..(8 * MIB + 3) as usize]);

    let ufs = OpendalUfs::open(&c.ufs_uri(), &options).unwrap();
    let old = ufs.stat("split.bin").await.unwrap().version;
    assert!(ufs.read_range("split.bin", 0..4 * MIB, &old).await.unwrap()[..] == v1[..(4 * MIB) as usize]);
    c.ufs.put("split.bin", v2.clone()).await;
    let e = ufs.read_range("split.bin", 0..4 * MIB, &old).await.unwrap_err();
    assert!(matches!(e, UfsError::VersionChanged(_)), "{e}");
    let new = ufs.stat("split.bin").await.unwrap().version;
    assert!(ufs.read_range("split.bin", MIB..size, &new).await.unwrap()[..] == v2[MIB as usize..]);
    let e = OpendalUfs::open(&c.ufs_uri(), &[("ufs_read_parallelism".to_string(), "0".to_string())].into())
        .err()
        .expect("0 pieces is refused");
    assert!(e.to_string().contains("ufs_read_parallelism"), "{e}");
}

async fn ten_thousand_small_objects(ufs: TestUfs) {
    let c = cluster(ufs).await;
    let objects: Vec<_> =
        (0..10_000u64).map(|i| (format!("small/d{}/o{i}", i % 10), pattern(1024, i))).collect();
    put_many(&c.ufs, objects).await;
    let client = c.client().await;
    let listed = client.list("/data/small/d3").await.unwrap();
    assert_eq!(listed.len(), 1_000);
    let read_all = |pass: u32| {
        let client = client.clone();
        async move {
            futures::stream::iter(0..10_000u64)
                .for_each_concurrent(64, |i| {
                    let client = client.clone();
                    async move {
                        let got = client.read_all(&format!("/data/small/d{}/o{i}", i % 10)).await.unwrap();
                        assert!(got[..] == pattern(1024, i)[..], "object {i}, pass {pass}");
                    }
                })
                .await
        }
    };
    read_all(1).await;
    assert_eq!(c.ufs_reads(), 10_000);
    read_all(2).await;
    assert_eq!(c.ufs_reads(), 10_000, "the second pass is served from the tiers");
}

async fn two_gib_object_streams_in_bounded_memory(ufs: TestUfs) {
    let opts =
        ClusterOptions { memory_capacity: 64 * MIB, nvme_capacity: 512 * MIB, ..ClusterOptions::default() };
    let c = Cluster::start_with(opts, ufs).await;
    let size: u64 = 2 << 30;
    let seed = 77;
    let chunk = 8 * MIB;
    let mut writer = c.ufs.operator().writer_with("huge.bin").chunk(chunk as usize).await.unwrap();
    let mut offset = 0;
    while offset < size {
        let mut buf = vec![0u8; chunk as usize];
        fill_pattern(seed, offset, &mut buf);
        writer.write(buf).await.unwrap();
        offset += chunk;
    }
    writer.close().await.unwrap();
    let before = peak_rss_bytes();

    let client = c.client().await;
    let mut reader = client.open("/data/huge.bin").await.unwrap();
    assert_eq!(reader.info().size, size);
    let mut buf = vec![0u8; MIB as usize];
    let mut expected = vec![0u8; MIB as usize];
    let mut pos = 0u64;
    loop {
        let n = reader.read(&mut buf).await.unwrap();
        if n == 0 {
            break;
        }
        fill_pattern(seed, pos, &mut expected[..n]);
        assert!(buf[..n] == expected[..n], "bytes differ at {pos}");
        pos += n as u64;
    }
    assert_eq!(pos, size);
    let peak = peak_rss_bytes();
    println!("2 GiB streamed: peak RSS {} MiB (before the read {} MiB)", peak >> 20, before >> 20);
    assert!(peak < 1 << 30, "memory must stay bounded while streaming 2 GiB: peak {} MiB", peak >> 20);
}

async fn overwritten_and_deleted_objects(ufs: TestUfs) {
    let c = cluster(ufs).await;
    let client = c.client().await;
    let options = c
        .ufs
        .mount_options()
        .into_iter()
        .chain([
            ("metadata_ttl".to_string(), "300ms".to_string()),
            ("block_size".to_string(), "1MiB".to_string()),
        ])
        .collect();
    client.admin().add_mount("/fresh", &c.ufs_uri(), options).await.unwrap();
    let (v1, v2, v3) =
        (pattern(2 * MIB as usize, 1), pattern(2 * MIB as usize, 2), pattern(2 * MIB as usize, 3));
    c.ufs.put("obj.bin", v1.clone()).await;
    assert_eq!(client.read_all("/fresh/obj.bin").await.unwrap(), v1);
    let old = client.stat("/fresh/obj.bin").await.unwrap().version;

    // Overwritten: `stat --sync` sees the new version at once, and reads follow it.
    c.ufs.put("obj.bin", v2.clone()).await;
    let within = client.read_all("/fresh/obj.bin").await.unwrap();
    assert!(within[..] == v1[..] || within[..] == v2[..], "a read mixed versions");
    let synced = client.stat_with("/fresh/obj.bin", true).await.unwrap();
    assert_ne!(synced.version, old, "a new object has a new version");
    assert_eq!(client.read_all("/fresh/obj.bin").await.unwrap(), v2);

    // Overwritten again: without --sync, the new bytes come once the TTL has passed.
    c.ufs.put("obj.bin", v3.clone()).await;
    eventually("the new bytes are read after the TTL", Duration::from_secs(20), || async {
        let got = client.read_all("/fresh/obj.bin").await.unwrap();
        assert!(got[..] == v2[..] || got[..] == v3[..], "a read mixed versions");
        got[..] == v3[..]
    })
    .await;

    // Deleted: a clear not-found, at once with --sync and for everyone after the TTL.
    c.ufs.delete("obj.bin").await;
    let e = client.stat_with("/fresh/obj.bin", true).await.unwrap_err();
    assert!(matches!(e, ClientError::NotFound(_)), "{e}");
    eventually("the deletion is seen after the TTL", Duration::from_secs(20), || async {
        match client.read_all("/fresh/obj.bin").await {
            Err(ClientError::NotFound(_)) => true,
            Err(e) => panic!("a deleted object must read as not found: {e}"),
            Ok(got) => {
                assert!(got[..] == v3[..], "until the TTL passes, the last version, whole");
                false
            }
        }
    })
    .await;
}

macro_rules! suite {
    ($($name:ident),* $(,)?) => {
        mod fs {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name(strata_testkit::TestUfs::fs()).await
                }
            )*
        }
        mod s3 {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name(strata_testkit::TestUfs::s3()).await
                }
            )*
        }
    };
}

suite!(
    list_paginates_past_1000_keys,
    stat_and_nested_prefixes,
    odd_key_names,
    zero_byte_objects,
    range_reads_at_block_edges,
    split_range_reads,
    ten_thousand_small_objects,
    two_gib_object_streams_in_bounded_memory,
    overwritten_and_deleted_objects,
);
