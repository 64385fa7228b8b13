//! Batched metadata and batched reads, end to end on the in-process cluster: what reading many
//! small files costs in round trips to the master and to the workers, and that batching changes
//! none of the answers (bytes, errors, failover, a file changed under the reader).
//!
//! Master round trips are counted by the master's own `strata_master_rpc_requests_total`
//! (the process's Prometheus recorder, which the in-process master writes to); data-plane
//! requests by a counting wrapper around the client's real TCP transport.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use strata_client::{
    Client, ClientConfig, ClientError, Credentials, Dial, FaultyTransport, FileInfo, HedgePolicy, ReadSpec,
    TcpTransport, Transport, TransportError,
};
use strata_common::ErrorKind;
use strata_common::frame::{ReadBlockRequest, Source};
use strata_testkit::{Cluster, ClusterOptions, eventually, pattern};

/// The master's request counters are process-wide: tests of this file run one at a time, so
/// each counts its own requests under any test runner.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Requests of `rpc` the master has served so far (in this process).
fn master_rpcs(rpc: &str) -> u64 {
    let text = strata_proto::ops_http::metrics_handle().render();
    let key = format!("strata_master_rpc_requests_total{{rpc=\"{rpc}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&key))
        .map_or(0, |v| v.trim().parse::<f64>().expect("a count") as u64)
}

/// Writes `n` small files (`len(i)` bytes of `pattern(seed + i)`) under `dir` of `/data`.
fn small_files(cluster: &Cluster, dir: &str, n: usize, seed: u64) -> Vec<(String, Vec<u8>)> {
    (0..n)
        .map(|i| {
            let data = pattern(1 + (i * 997) % 20_000, seed + i as u64);
            cluster.write_file(&format!("{dir}/f{i:04}.bin"), &data);
            (format!("/data/{dir}/f{i:04}.bin"), data)
        })
        .collect()
}

/// Data-plane requests a client sent, counted around its transport (the real TCP one).
struct Counting {
    inner: Arc<dyn Transport>,
    singles: AtomicU64,
    batches: AtomicU64,
    items: AtomicU64,
}

#[async_trait::async_trait]
impl Transport for Counting {
    async fn read_block(
        &self,
        addr: &str,
        req: &ReadBlockRequest,
    ) -> Result<(Bytes, Source), TransportError> {
        self.singles.fetch_add(1, Ordering::SeqCst);
        self.inner.read_block(addr, req).await
    }

    async fn read_block_into(
        &self,
        addr: &str,
        req: &ReadBlockRequest,
        dst: &mut [u8],
    ) -> Result<Source, TransportError> {
        self.singles.fetch_add(1, Ordering::SeqCst);
        self.inner.read_block_into(addr, req, dst).await
    }

    fn batches_reads(&self) -> bool {
        self.inner.batches_reads()
    }

    fn read_many<'a>(
        &'a self,
        addr: &'a str,
        reqs: &'a [ReadBlockRequest],
    ) -> BoxStream<'a, Result<(Bytes, Source), TransportError>> {
        self.batches.fetch_add(1, Ordering::SeqCst);
        self.items.fetch_add(reqs.len() as u64, Ordering::SeqCst);
        self.inner.read_many(addr, reqs)
    }
}

/// The TCP transport a client of `cluster` with `config` uses.
fn tcp(cluster: &Cluster, config: &ClientConfig) -> TcpTransport {
    let dial = Dial {
        connect_timeout: config.connect_timeout,
        tls: None,
        credentials: Credentials::token(cluster.admin_token().as_deref()),
    };
    TcpTransport::new(dial, config.request_timeout)
}

/// A client of `cluster` (with `config`) whose data-plane requests through `transport` are
/// counted.
async fn counted_over(config: ClientConfig, transport: Arc<dyn Transport>) -> (Client, Arc<Counting>) {
    let counting = Arc::new(Counting {
        inner: transport,
        singles: AtomicU64::new(0),
        batches: AtomicU64::new(0),
        items: AtomicU64::new(0),
    });
    let client = Client::connect_with_transport(config, counting.clone()).await.expect("client connects");
    (client, counting)
}

/// A client of `cluster` whose data-plane requests are counted.
async fn counted_client(cluster: &Cluster) -> (Client, Arc<Counting>) {
    let config = cluster.client_config();
    let transport = Arc::new(tcp(cluster, &config));
    counted_over(config, transport).await
}

fn whole(info: FileInfo) -> ReadSpec {
    ReadSpec { info, offset: 0, len: u64::MAX }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_just_listed_are_read_without_asking_the_master_and_stated_from_its_listing() {
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(ClusterOptions::default()).await;
    let files = small_files(&cluster, "listed", 40, 1);
    let client = cluster.client().await;

    let listed = client.list("/data/listed").await.unwrap();
    assert_eq!(listed.len(), files.len());
    let stats_before = master_rpcs("stat");
    for (path, data) in &files {
        assert_eq!(client.read_all(path).await.unwrap(), &data[..], "{path}");
    }
    assert_eq!(master_rpcs("stat") - stats_before, 0, "a listed file's stat comes from the listing");

    // The same through a recursive find (fsspec's find/glob).
    let found = cluster.client().await;
    let (page, next) = found.find_page("/data/listed", "", 0, 0).await.unwrap();
    assert_eq!((page.len(), next), (files.len(), None));
    let stats_before = master_rpcs("stat");
    for (path, data) in files.iter().step_by(7) {
        assert_eq!(found.read_all(path).await.unwrap(), &data[..], "{path}");
    }
    assert_eq!(master_rpcs("stat") - stats_before, 0);

    // A client that listed nothing asks the master, which answers from the listing it holds:
    // no UFS request, and the very stat the listing carried.
    let fresh = cluster.client().await;
    let ufs_stats = cluster.counters().stats();
    let stats_before = master_rpcs("stat");
    for entry in &listed {
        assert_eq!(&fresh.stat(&entry.path).await.unwrap(), entry);
    }
    assert_eq!(master_rpcs("stat") - stats_before, listed.len() as u64);
    assert_eq!(cluster.counters().stats() - ufs_stats, 0, "the master stated every file from its listing");

    // A file made behind Strata's back since the listing is not in it: the UFS is asked.
    cluster.write_file("listed/late.bin", b"late");
    assert_eq!(fresh.read_all("/data/listed/late.bin").await.unwrap(), &b"late"[..]);
    assert!(cluster.counters().stats() > ufs_stats, "asked of the UFS");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stat_many_is_one_call_with_one_answer_per_path_each_its_own_error() {
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(ClusterOptions::default()).await;
    let files = small_files(&cluster, "team/a", 30, 2);
    cluster.write_file("other/secret.bin", b"not for team a");
    let mut paths: Vec<String> = files.iter().map(|(p, _)| p.clone()).collect();
    paths.extend(
        ["/data/team/a/missing.bin", "/data/other/secret.bin", "/data/team/a", "/data/../x"]
            .map(String::from),
    );
    let asked: Vec<&str> = paths.iter().map(String::as_str).collect();

    let client = cluster.client().await;
    let (calls, stats) = (master_rpcs("stat_many"), master_rpcs("stat"));
    let many = client.stat_many(&asked).await;
    assert_eq!((master_rpcs("stat_many") - calls, master_rpcs("stat") - stats), (1, 0), "one call");
    assert_eq!(many.len(), asked.len());
    // The same answers as one stat per path, from a client that cached nothing.
    let single = cluster.client().await;
    for (path, answer) in asked.iter().zip(&many) {
        match (answer, single.stat(path).await) {
            (Ok(a), Ok(b)) => assert_eq!(a, &b, "{path}"),
            (Err(a), Err(b)) => assert_eq!(a.kind(), b.kind(), "{path}: {a} / {b}"),
            (a, b) => panic!("{path}: {a:?} / {b:?}"),
        }
    }
    let kinds: Vec<Option<ErrorKind>> =
        many[files.len()..].iter().map(|a| a.as_ref().err().map(ClientError::kind)).collect();
    assert_eq!(kinds, [Some(ErrorKind::NotFound), None, None, Some(ErrorKind::InvalidArgument)]);
    assert!(many[files.len() + 2].as_ref().unwrap().is_dir);
    // Stated once, cached: a second round asks the master nothing.
    let calls = master_rpcs("stat_many");
    let again = client.stat_many(&asked[..files.len()]).await;
    assert!(again.iter().all(Result::is_ok));
    assert_eq!(master_rpcs("stat_many") - calls, 0);

    // A token limited to /data/team: a path outside it is that path's error, not the call's.
    let admin = cluster.client().await;
    let (_, token) = admin.admin().create_token("reader", "/data/team", "team").await.unwrap();
    let scoped = cluster.client_with_token(Some(&token)).await.unwrap();
    let answers = scoped.stat_many(&[asked[0], "/data/other/secret.bin", asked[1]]).await;
    assert_eq!(answers[0].as_ref().unwrap(), many[0].as_ref().unwrap());
    assert_eq!(answers[1].as_ref().unwrap_err().kind(), ErrorKind::PermissionDenied, "{:?}", answers[1]);
    assert_eq!(answers[2].as_ref().unwrap(), many[1].as_ref().unwrap());

    // More than a call may carry is refused as such, naming the limit.
    let token = cluster.admin_token();
    let mut master = strata_proto::leader::master_conn(&cluster.master_addr(), token.as_deref(), |a| {
        tonic::transport::Endpoint::from_shared(format!("http://{a}"))
    })
    .unwrap();
    let over = strata_proto::StatManyRequest { paths: vec!["/data/team/a/f0000.bin".to_string(); 10_001] };
    let refused = master.stat_many(over).await.unwrap_err();
    assert_eq!(strata_proto::kind_of(&refused), ErrorKind::ResourceExhausted, "{refused:?}");
    assert!(refused.message().contains("10000"), "{}", refused.message());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_many_reads_small_files_from_every_worker_in_a_few_requests() {
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(ClusterOptions::default()).await;
    const N: usize = 300;
    let files = small_files(&cluster, "epoch", N, 3);
    let (client, counted) = counted_client(&cluster).await;
    let (calls, stats) = (master_rpcs("stat_many"), master_rpcs("stat"));
    let paths: Vec<&str> = files.iter().map(|(p, _)| p.as_str()).collect();
    let infos: Vec<FileInfo> = client.stat_many(&paths).await.into_iter().map(Result::unwrap).collect();
    assert_eq!((master_rpcs("stat_many") - calls, master_rpcs("stat") - stats), (1, 0));

    let served_before: Vec<u64> =
        (0..cluster.worker_count()).map(|i| cluster.worker(i).blocks.counters().bytes_served).collect();
    let started = Instant::now();
    let read = client.read_many(&infos.into_iter().map(whole).collect::<Vec<_>>()).await;
    let took = started.elapsed();
    let plain = cluster.client().await;
    for ((path, data), got) in files.iter().zip(read) {
        let got = got.unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!(got, &data[..], "{path}");
        assert_eq!(got, plain.read_all(path).await.unwrap(), "{path}: as read_all reads it");
    }
    let (batches, items, singles) = (
        counted.batches.load(Ordering::SeqCst),
        counted.items.load(Ordering::SeqCst),
        counted.singles.load(Ordering::SeqCst),
    );
    // Grouped by first owner: one request per worker (about 100 files each, under 256).
    assert_eq!((items, singles), (N as u64, 0), "every file in a batch");
    assert!(batches <= cluster.worker_count() as u64, "{batches} requests for {N} files");
    for (i, before) in served_before.iter().enumerate() {
        let served = cluster.worker(i).blocks.counters().bytes_served - before;
        assert!(served > 0, "worker {i} served part of the batch");
    }
    eprintln!(
        "{N} small files: {batches} data-plane requests (not {N}), 1 StatMany (not {N} stats), {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_batch_still_yields_every_file() {
    let _serial = SERIAL.lock().await;
    let mut cluster = Cluster::start(ClusterOptions::default()).await;
    let files = small_files(&cluster, "doomed", 120, 4);
    let (client, counted) = counted_client(&cluster).await;
    let infos: Vec<FileInfo> = client.list("/data/doomed").await.unwrap();
    assert_eq!(infos.len(), files.len());
    // Cold files fetched slowly, so the batches are still being answered when a worker dies.
    cluster.faults().read_delay_ms.store(100, Ordering::SeqCst);
    let misses = |c: &Cluster| -> u64 {
        (0..c.worker_count()).map(|i| c.worker(i).blocks.counters().cache_misses).sum()
    };
    let reader = client.clone();
    let batch =
        tokio::spawn(
            async move { reader.read_many(&infos.into_iter().map(whole).collect::<Vec<_>>()).await },
        );
    eventually("the batches reached the workers", Duration::from_secs(20), || {
        let m = misses(&cluster);
        async move { m > 0 }
    })
    .await;
    assert!(!batch.is_finished(), "the worker must die while the batch is being read");
    cluster.kill_worker(1).await;
    let read = tokio::time::timeout(Duration::from_secs(60), batch).await.expect("the batch ends").unwrap();
    cluster.faults().read_delay_ms.store(0, Ordering::SeqCst);
    for ((path, data), got) in files.iter().zip(read) {
        assert_eq!(got.unwrap_or_else(|e| panic!("{path}: {e}")), &data[..], "{path}");
    }
    // What the dead worker had not answered was read one by one, from the next owners.
    assert!(counted.singles.load(Ordering::SeqCst) > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_changed_between_stat_and_read_is_read_whole_at_its_new_version() {
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(ClusterOptions::default()).await;
    let files = small_files(&cluster, "moving", 12, 5);
    // One file of two blocks too: a read of it takes the ordinary path, and must follow as well.
    let big = pattern((3 << 20) / 2, 77);
    cluster.write_file("moving/big.bin", &big);
    let (client, _) = counted_client(&cluster).await;
    let listed = client.list("/data/moving").await.unwrap();
    let mut specs: Vec<ReadSpec> = listed.iter().cloned().map(whole).collect();
    // The range of one file, from the middle to past its end.
    assert_eq!(listed[6].path, "/data/moving/f0005.bin");
    specs.push(ReadSpec { offset: 100, ..whole(listed[6].clone()) });
    // Changed in the UFS after the client stated them: new bytes and sizes.
    let changed = pattern(25_000, 99);
    cluster.write_file("moving/f0003.bin", &changed);
    cluster.write_file("moving/f0005.bin", &changed[..7_000]);
    let big2 = pattern(big.len() + 10_000, 78);
    cluster.write_file("moving/big.bin", &big2);

    let read = client.read_many(&specs).await;
    let got: Vec<Bytes> = read.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(got[0], &big2[..], "the two-block file, at its new version");
    for (i, (path, data)) in files.iter().enumerate() {
        let want: &[u8] = match i {
            3 => &changed,
            5 => &changed[..7_000],
            _ => data,
        };
        assert_eq!(got[i + 1], want, "{path}");
    }
    assert_eq!(got[files.len() + 1], &changed[100..7_000], "the range, of the new version");
    // The new versions are what the client states now.
    assert_eq!(client.stat("/data/moving/f0003.bin").await.unwrap().size, changed.len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_worker_costs_a_batch_its_hedging_deadline_not_the_request_timeout() {
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(ClusterOptions::default()).await;
    let files = small_files(&cluster, "frozen", 90, 6);
    let mut config = cluster.client_config();
    config.hedge = HedgePolicy { min: Duration::from_millis(100), max: Duration::from_millis(400) };
    config.request_timeout = Duration::from_secs(30);
    let faulty = Arc::new(FaultyTransport::new(Arc::new(tcp(&cluster, &config))));
    let (client, counted) = counted_over(config, faulty.clone()).await;
    let infos = client.list("/data/frozen").await.unwrap();
    // Accepts the batch and never answers: a stopped process, a hung disk.
    faulty.frozen.lock().unwrap().push(cluster.worker(0).data_addr.to_string());
    let started = Instant::now();
    let specs: Vec<ReadSpec> = infos.into_iter().map(whole).collect();
    // Bounded, so a regression fails here instead of holding the test run.
    let read =
        tokio::time::timeout(Duration::from_secs(20), client.read_many(&specs)).await.expect("not held");
    let took = started.elapsed();
    for ((path, data), got) in files.iter().zip(read) {
        assert_eq!(got.unwrap_or_else(|e| panic!("{path}: {e}")), &data[..], "{path}");
    }
    let (batches, singles) = (counted.batches.load(Ordering::SeqCst), counted.singles.load(Ordering::SeqCst));
    assert!(
        batches <= 3 && singles > 0,
        "the frozen worker's files were read one by one ({batches}, {singles})"
    );
    assert!(took < Duration::from_secs(10), "{took:?}: the frozen worker's batch was left at its deadline");
}

/// The stream of one `read_many` as a client would consume it, on the real transport: answers in
/// order, a missing file's error among them, and the same again on the connection kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tcp_transport_reads_a_batch_in_one_request_and_keeps_the_connection() {
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(ClusterOptions { workers: 1, ..ClusterOptions::default() }).await;
    let files = small_files(&cluster, "raw", 5, 7);
    let client = cluster.client().await;
    let listed = client.list("/data/raw").await.unwrap();
    let mut reqs: Vec<ReadBlockRequest> = listed.iter().map(strata_testkit::first_block_read).collect();
    reqs.insert(2, ReadBlockRequest { path: "/data/raw/none.bin".into(), ..reqs[0].clone() });
    let dial = Dial {
        connect_timeout: Duration::from_secs(2),
        tls: None,
        credentials: Credentials::token(cluster.admin_token().as_deref()),
    };
    let tcp = TcpTransport::new(dial, Duration::from_secs(20));
    let addr = cluster.worker(0).data_addr.to_string();
    for round in 0..2 {
        let answers: Vec<_> = tcp.read_many(&addr, &reqs).collect().await;
        assert_eq!(answers.len(), reqs.len(), "round {round}");
        let mut data = files.iter().map(|(_, d)| d);
        for (i, answer) in answers.into_iter().enumerate() {
            match answer {
                Err(TransportError::Remote { kind, .. }) if i == 2 => assert_eq!(kind, ErrorKind::NotFound),
                Ok((bytes, _)) if i != 2 => assert_eq!(bytes, &data.next().unwrap()[..]),
                other => panic!("item {i}: {other:?}"),
            }
        }
    }
}
