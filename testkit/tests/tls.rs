//! TLS on both planes, end to end: a cluster whose master and workers speak TLS serves exact
//! bytes (reads from DRAM and from NVMe files, writes); a plain-text client of a TLS cluster
//! and a TLS client of a plain cluster fail fast, saying TLS, on each plane; with client
//! certificates required (mTLS), a client without one or with one from another CA is refused.
//! Certificates are made in the test (`strata_testkit::tls::TestPki`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_client::{Client, ClientConfig, Dial, TcpTransport, TlsConfig, Transport, TransportError};
use strata_testkit::tls::TestPki;
use strata_testkit::{Cluster, ClusterOptions, ClusterTls, pattern};

const MIB: usize = 1 << 20;
/// Every refusal must come well within this (the handshake deadline is 10 s).
const PROMPT: Duration = Duration::from_secs(8);

fn tls_options(pki: &Arc<TestPki>, client_auth: bool) -> ClusterOptions {
    let mut opts = ClusterOptions { workers: 2, ..ClusterOptions::default() };
    opts.tls = Some(ClusterTls { pki: pki.clone(), client_auth });
    opts.mount_options.push(("mode".into(), "write-through".into()));
    opts
}

fn config_with(cluster: &Cluster, tls: TlsConfig) -> ClientConfig {
    let mut c = cluster.client_config();
    c.tls = tls;
    c.connect_timeout = Duration::from_secs(2);
    c
}

/// How a test connects to the cluster's workers: with `tls`, presenting the admin token.
fn dial(cluster: &Cluster, tls: &TlsConfig) -> Dial {
    Dial {
        connect_timeout: Duration::from_secs(2),
        tls: tls.client().expect("client TLS loads"),
        credentials: strata_testkit::strata_client::Credentials::token(cluster.admin_token().as_deref()),
    }
}

/// A read of the first MiB of `/data/f.bin` straight to worker 0.
async fn read_block_from(cluster: &Cluster, dial: Dial) -> Result<(), TransportError> {
    let data = pattern(MIB, 3);
    cluster.write_file("f.bin", &data);
    let info = cluster.client().await.stat("/data/f.bin").await.expect("stat through the cluster");
    let req = strata_testkit::first_block_read(&info);
    let transport = TcpTransport::new(dial, Duration::from_secs(20));
    let addr = cluster.worker(0).data_addr.to_string();
    let (bytes, _) = transport.read_block(&addr, &req).await?;
    assert!(bytes[..] == data[..]);
    Ok(())
}

/// Runs `f`, which must fail within [`PROMPT`]; returns the error's text.
async fn refused<T, E: std::fmt::Display>(
    what: &str,
    f: impl std::future::Future<Output = Result<T, E>>,
) -> String {
    let started = Instant::now();
    let result = tokio::time::timeout(PROMPT, f).await.unwrap_or_else(|_| panic!("{what}: hung"));
    let Err(err) = result else { panic!("{what}: succeeded") };
    let err = err.to_string();
    eprintln!("{what}: {err}");
    assert!(started.elapsed() < PROMPT, "{what}: took {:?}", started.elapsed());
    err
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tls_cluster_serves_exact_bytes_on_both_planes() {
    let pki = Arc::new(TestPki::new());
    // No DRAM tier: the second read comes from NVMe block files, through the TLS fallback of
    // `sendfile`.
    let cluster = Cluster::start(ClusterOptions { memory_capacity: 0, ..tls_options(&pki, false) }).await;
    let data = pattern(5 * MIB + 123, 7);
    cluster.write_file("big.bin", &data);
    let client = cluster.client().await;
    // Cold (UFS), then NVMe twice: the first NVMe read verifies the block's checksum, later
    // ones send the verified file region (`send_file`, which TLS does by reading and writing).
    for round in ["cold", "nvme", "nvme verified"] {
        let got = client.read_all("/data/big.bin").await.unwrap();
        assert!(got[..] == data[..], "{round} read differs");
        cluster.flush().await;
    }
    let got = client.read_range("/data/big.bin", MIB as u64 - 5, 2 * MIB as u64).await.unwrap();
    assert!(got[..] == data[MIB - 5..3 * MIB - 5]);

    // The write path goes through TLS too.
    let written = pattern(3 * MIB + 1, 8);
    let mut w = client.create("/data/out/new.bin").await.unwrap();
    for chunk in written.chunks(700_000) {
        w.write(chunk).await.unwrap();
        w.park().unwrap();
    }
    w.close().await.unwrap();
    assert!(std::fs::read(cluster.ufs.dir().join("out/new.bin")).unwrap() == written);
    assert!(client.read_all("/data/out/new.bin").await.unwrap()[..] == written[..]);

    // A latency-class client's TLS connections move to the latency lane with their sessions,
    // and are served exact bytes there.
    let mut config = cluster.client_config();
    config.qos = strata_client::QosClass::Latency;
    let latency = Client::connect(config).await.unwrap();
    assert!(latency.read_all("/data/big.bin").await.unwrap()[..] == data[..], "latency-class read differs");
    let got = latency.read_range("/data/big.bin", MIB as u64 - 5, 2 * MIB as u64).await.unwrap();
    assert!(got[..] == data[MIB - 5..3 * MIB - 5], "latency-class range differs");
    let moved: u64 = (0..cluster.worker_count()).map(|i| cluster.worker(i).latency_lane.moved()).sum();
    assert!(moved > 0, "no TLS connection moved to the latency lane");
    let served: u64 = (0..cluster.worker_count())
        .map(|i| cluster.worker(i).classes.counters()[strata_client::QosClass::Latency as usize].served)
        .sum();
    assert!(served > 0, "the reads were served in the latency class");

    // And the data plane really is TLS: a read through a TLS transport works.
    read_block_from(&cluster, dial(&cluster, &pki.client())).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plain_text_to_a_tls_cluster_fails_fast_saying_tls() {
    let pki = Arc::new(TestPki::new());
    let cluster = Cluster::start(tls_options(&pki, false)).await;
    let err =
        refused("plain client, TLS master", Client::connect(config_with(&cluster, TlsConfig::default())))
            .await;
    assert!(err.contains("TLS"), "{err}");
    let err = refused(
        "plain data plane, TLS worker",
        read_block_from(&cluster, dial(&cluster, &TlsConfig::default())),
    )
    .await;
    assert!(err.contains("TLS"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tls_to_a_plain_cluster_fails_fast_saying_tls() {
    let pki = TestPki::new();
    let cluster = Cluster::start(ClusterOptions { workers: 1, ..ClusterOptions::default() }).await;
    let err = refused("TLS client, plain master", Client::connect(config_with(&cluster, pki.client()))).await;
    assert!(err.contains("TLS"), "{err}");
    let err =
        refused("TLS data plane, plain worker", read_block_from(&cluster, dial(&cluster, &pki.client())))
            .await;
    assert!(err.contains("TLS handshake"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mutual_tls_refuses_clients_without_a_certificate_of_the_cluster_ca() {
    let pki = Arc::new(TestPki::new());
    let cluster = Cluster::start(tls_options(&pki, true)).await;
    // The cluster's own client (with its certificate) works on both planes.
    let client = cluster.client().await;
    cluster.write_file("m.bin", b"mutual");
    assert_eq!(&client.read_all("/data/m.bin").await.unwrap()[..], b"mutual");
    read_block_from(&cluster, dial(&cluster, &pki.client())).await.unwrap();

    // No certificate.
    let bare = pki.client_without_cert();
    let err = refused("no client certificate, master", async {
        Client::connect(config_with(&cluster, bare.clone())).await?.admin().status().await
    })
    .await;
    assert!(err.contains("TLS"), "{err}");
    let err =
        refused("no client certificate, worker", read_block_from(&cluster, dial(&cluster, &bare))).await;
    assert!(err.to_lowercase().contains("certificate"), "{err}");

    // A certificate from another CA (the client still trusts the cluster's CA).
    let other = TestPki::new();
    let foreign = TlsConfig {
        cert: Some(other.path("client.crt")),
        key: Some(other.path("client.key")),
        ..pki.client_without_cert()
    };
    let err = refused("foreign client certificate, master", async {
        Client::connect(config_with(&cluster, foreign.clone())).await?.admin().status().await
    })
    .await;
    assert!(err.contains("TLS"), "{err}");
    let err =
        refused("foreign client certificate, worker", read_block_from(&cluster, dial(&cluster, &foreign)))
            .await;
    assert!(err.contains("alert") && (err.contains("UnknownCA") || err.contains("Certificate")), "{err}");
}
