//! S3 faults between the workers and a real S3 server (Garage), injected by an HTTP proxy:
//! 500s and 503 SlowDown, stalls, cut responses, refused connections, wrong credentials.
//! One worker, so a fault cannot be papered over by failing over to another worker.

use std::time::{Duration, Instant};

use strata_client::ClientError;
use strata_testkit::fault_proxy::{Fault, FaultProxy};
use strata_testkit::{Cluster, ClusterOptions, TestUfs, pattern};

const MIB: usize = 1 << 20;

async fn setup(extra: &[(&str, &str)]) -> (Cluster, FaultProxy) {
    let ufs = TestUfs::s3();
    let proxy = FaultProxy::start(ufs.endpoint_addr()).await;
    let mut mount_options = vec![
        ("endpoint".to_string(), proxy.endpoint()),
        ("block_size".to_string(), "1MiB".to_string()),
        ("metadata_ttl".to_string(), "60s".to_string()),
    ];
    mount_options.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let opts = ClusterOptions { workers: 1, mount_options, ..ClusterOptions::default() };
    (Cluster::start_with(opts, ufs).await, proxy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transient_500s_are_retried_away() {
    let (c, proxy) = setup(&[("ufs_retries", "3")]).await;
    let data = pattern(MIB / 2, 1);
    c.ufs.put("r.bin", data.clone()).await;
    let client = c.client().await;
    client.stat("/data/r.bin").await.unwrap(); // metadata cached: only the GET meets the faults
    let before = proxy.requests();
    proxy.push(Fault::Status(500, "InternalError"));
    proxy.push(Fault::Status(503, "SlowDown"));
    proxy.push(Fault::Reset);
    assert_eq!(client.read_all("/data/r.bin").await.unwrap(), data);
    assert_eq!(proxy.requests() - before, 4, "three failed attempts, then the one that succeeded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn persistent_slowdown_becomes_a_clear_temporary_error() {
    let (c, proxy) = setup(&[("ufs_retries", "2")]).await;
    c.ufs.put("s.bin", pattern(1000, 2)).await;
    let client = c.client().await;
    client.stat("/data/s.bin").await.unwrap();
    proxy.set_default(Fault::Status(503, "SlowDown"));
    let e = client.read_all("/data/s.bin").await.map(|_| ()).expect_err("must fail");
    assert!(e.is_temporary(), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("SlowDown") || msg.contains("503"), "{msg}");
    assert!(proxy.requests() >= 3, "the worker retried before giving up");
    // Once the store recovers, the same read works: the error was not cached.
    proxy.clear();
    assert_eq!(client.read_all("/data/s.bin").await.unwrap(), pattern(1000, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stalled_response_hits_the_deadline() {
    let (c, proxy) = setup(&[("ufs_retries", "1"), ("ufs_timeout", "1s"), ("ufs_io_timeout", "1s")]).await;
    c.ufs.put("stall.bin", pattern(1000, 3)).await;
    let client = c.client().await;
    client.stat("/data/stall.bin").await.unwrap();
    proxy.set_default(Fault::Stall);
    let started = Instant::now();
    let e = client.read_all("/data/stall.bin").await.map(|_| ()).expect_err("must fail");
    let took = started.elapsed();
    assert!(took < Duration::from_secs(20), "the deadline was not enforced: {took:?}");
    assert!(e.is_temporary(), "{e}");
    proxy.clear();
    assert_eq!(client.read_all("/data/stall.bin").await.unwrap(), pattern(1000, 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cut_response_never_leaves_half_a_block_cached() {
    let (c, proxy) = setup(&[("ufs_retries", "1"), ("ufs_io_timeout", "1s")]).await;
    let data = pattern(MIB, 4);
    c.ufs.put("cut.bin", data.clone()).await;
    let client = c.client().await;
    client.stat("/data/cut.bin").await.unwrap();
    // The response is cut after 64 KiB and goes silent; opendal resumes such reads from where
    // they stopped, so every later request fails outright: the block arrives only in part.
    proxy.push(Fault::Truncate(64 * 1024));
    proxy.set_default(Fault::Status(500, "InternalError"));
    let e =
        client.read_all("/data/cut.bin").await.map(|_| ()).expect_err("a read of cut responses must fail");
    assert!(e.is_temporary(), "{e}");
    assert_eq!(c.ufs_reads(), 0, "no UFS read completed");
    proxy.clear();
    let got = client.read_all("/data/cut.bin").await.unwrap();
    assert!(got[..] == data[..], "the whole block, fetched again, not the cut one");
    assert_eq!(c.ufs_reads(), 1);
    c.flush().await;
    assert!(client.read_all("/data/cut.bin").await.unwrap()[..] == data[..]);
    assert_eq!(c.ufs_reads(), 1, "now it is cached");
}

/// Cut-through on a store with `If-Match` (Garage): a cold read of a block's first 64 KiB is
/// answered from the first bytes the store sends while the rest of the block is still held back
/// (the UFS stream waits once 64 KiB went by); the block is kept only once it arrived whole.
/// Without cut-through the read would wait for the whole block.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cold_read_of_a_block_s_start_is_answered_before_the_block_is_in() {
    use std::sync::atomic::Ordering::SeqCst;
    let (c, _proxy) = setup(&[]).await;
    let data = pattern(MIB, 5);
    c.ufs.put("head.bin", data.clone()).await;
    let client = c.client().await;
    let info = client.stat("/data/head.bin").await.unwrap();
    let gate = &c.faults().stream_gate;
    gate.after_bytes.store(64 * 1024, SeqCst);
    gate.held.store(true, SeqCst);
    let head = client.read_range_of(&info, 0, 64 * 1024).await.expect("answered from the first bytes");
    assert!(head[..] == data[..64 * 1024]);
    // The fetch reaches the gate once it has passed the 64 KiB on, and the worker counts the
    // answer once its last byte is written: the client may see the bytes before either.
    let deadline = Instant::now() + Duration::from_secs(10);
    while gate.waiting.load(SeqCst) != 1 {
        assert!(Instant::now() < deadline, "the rest of the block is never held back");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    while c.worker(0).blocks.counters().cut_through_reads != 1 {
        assert!(Instant::now() < deadline, "the cut-through answer is never counted");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(c.ufs_reads(), 0, "the block has not arrived whole");
    gate.held.store(false, SeqCst);
    gate.permits.add_permits(1);
    let whole = client.read_range_of(&info, 0, MIB as u64).await.unwrap();
    assert!(whole[..] == data[..], "the whole block");
    assert_eq!(c.ufs_reads(), 1, "fetched once: the second read joined the flight or found the block");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unreachable_endpoints_and_wrong_credentials_fail_at_mount_time() {
    let (c, _proxy) = setup(&[]).await;
    let client = c.client().await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let mut options: std::collections::HashMap<String, String> = c.ufs.mount_options().into_iter().collect();
    options.insert("endpoint".into(), format!("http://{closed}"));
    options.insert("ufs_retries".into(), "1".into());
    let e = client
        .admin()
        .add_mount("/refused", &c.ufs_uri(), options.clone())
        .await
        .map(|_| ())
        .expect_err("must fail");
    assert!(e.to_string().contains("/refused"), "the error names the mount: {e}");

    let mut wrong = c.ufs.mount_options().into_iter().collect::<std::collections::HashMap<_, _>>();
    wrong.insert("secret_access_key".into(), "not-the-secret".into());
    let e =
        client.admin().add_mount("/badkey", &c.ufs_uri(), wrong).await.map(|_| ()).expect_err("must fail");
    let msg = e.to_string();
    assert!(msg.contains("/badkey"), "the error names the mount: {msg}");
    assert!(!msg.contains("not-the-secret"), "secrets never appear in errors: {msg}");
    assert!(!matches!(e, ClientError::NotFound(_)), "{e}");
    let mounts: Vec<String> = client.admin().mounts().await.unwrap().into_iter().map(|m| m.path).collect();
    assert_eq!(mounts, vec!["/data".to_string()], "failed mounts are not added");
    // And the mount that exists never shows its secret.
    let shown = &client.admin().mounts().await.unwrap()[0];
    assert_eq!(shown.options.get("secret_access_key").map(String::as_str), Some("***"));
}

/// A warmup of a prefix with millions of keys lists it as a stream of pages (memory: one page)
/// and, after a master restart, resumes after its cursor without listing the keys before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flat_prefix_lists_page_by_page_and_resumes_after_a_key() {
    use futures::StreamExt;
    use strata_ufs::{OpendalUfs, Ufs};

    let ufs = TestUfs::s3();
    let keys: Vec<String> = (0..1_050).map(|i| format!("flat/k{i:05}")).collect();
    let op = ufs.operator();
    futures::stream::iter(keys.clone())
        .for_each_concurrent(32, |k| {
            let op = op.clone();
            async move {
                op.write(&k, vec![1u8; 3]).await.unwrap_or_else(|e| panic!("put {k}: {e}"));
            }
        })
        .await;
    let proxy = FaultProxy::start(ufs.endpoint_addr()).await;
    let mut options: std::collections::BTreeMap<String, String> = ufs.mount_options().into_iter().collect();
    options.insert("endpoint".into(), proxy.endpoint());
    let direct = OpendalUfs::open(&ufs.uri(), &options).unwrap();

    let mut listing = direct.list_recursive("flat", None);
    let (mut seen, mut requests_at) = (Vec::new(), Vec::new());
    while let Some(file) = listing.next().await {
        seen.push(file.unwrap().path);
        requests_at.push(proxy.requests());
    }
    assert_eq!(seen, keys, "every key once, in key order");
    // The store pages at 1,000 keys: the second page is asked for only when the stream reaches
    // it, so the listing never holds more than a page.
    assert!(requests_at[..1000].iter().all(|r| *r == requests_at[0]), "{:?}", &requests_at[..1000]);
    assert!(requests_at[1000..].iter().all(|r| *r == requests_at[0] + 1));

    let before = proxy.requests();
    direct.stat("flat").await.unwrap();
    let stat_cost = proxy.requests() - before;
    let before = proxy.requests();
    let rest: Vec<String> =
        direct.list_recursive("flat", Some("flat/k01020")).map(|f| f.unwrap().path).collect().await;
    assert_eq!(rest, keys[1021..]);
    assert_eq!(proxy.requests() - before, stat_cost + 1, "one page, starting after the cursor");
}
