//! Lineage end to end (docs/LINEAGE.md): an in-process cluster, clients declaring a job, reads
//! through every path (short-circuit mappings, batched small files, a streaming reader) recorded
//! with their versions, reported in the background, kept across a master restart, and kept by
//! the client while the master is down.

use std::time::Duration;

use strata_client::{Client, ReadSpec};
use strata_testkit::{Cluster, ClusterOptions, eventually, pattern};
use tokio::io::AsyncReadExt;

const MIB: usize = 1 << 20;

/// (path, version, bytes) of each file `job` read, summed over marks.
async fn read_by(client: &Client, job: &str) -> Vec<(String, String, u64)> {
    let Ok(found) = client.lineage_job(job, "").await else { return Vec::new() };
    let mut files: std::collections::BTreeMap<(String, String), u64> = Default::default();
    for r in found.records {
        *files.entry((r.path, r.version)).or_default() += r.bytes;
    }
    files.into_iter().map(|((p, v), b)| (p, v, b)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_read_path_is_recorded_and_kept_across_master_restarts_and_outages() {
    let mut cluster =
        Cluster::start(ClusterOptions { workers: 2, local_sockets: true, ..Default::default() }).await;
    let big = pattern(3 * MIB, 1);
    cluster.write_file("big.bin", &big);
    cluster.write_file("stream.bin", &pattern(MIB + 17, 2));
    for i in 0..10 {
        cluster.write_file(&format!("small/f{i}.bin"), &pattern(8192, 10 + i));
    }
    let mut config = cluster.client_config();
    config.job = Some("train-7".into());
    config.lineage_flush_interval = Duration::from_millis(100);
    let client = Client::connect(config).await.unwrap();
    let admin = cluster.client().await;

    // Cold over TCP, then (its blocks on the workers' NVMe) by mapping them: both recorded.
    assert_eq!(client.read_all("/data/big.bin").await.unwrap(), big);
    cluster.flush().await;
    assert_eq!(client.read_all("/data/big.bin").await.unwrap(), big);
    assert!(
        client.short_circuit_reads() > 0,
        "the big file was read by mapping a co-located worker's blocks"
    );
    let mut infos = Vec::new();
    for i in 0..10 {
        infos.push(client.stat(&format!("/data/small/f{i}.bin")).await.unwrap());
    }
    let specs: Vec<ReadSpec> =
        infos.iter().map(|info| ReadSpec { info: info.clone(), offset: 0, len: u64::MAX }).collect();
    for answer in client.read_many(&specs).await {
        assert_eq!(answer.unwrap().len(), 8192);
    }
    let mut reader = client.open("/data/stream.bin").await.unwrap();
    let mut streamed = Vec::new();
    reader.read_to_end(&mut streamed).await.unwrap();
    assert_eq!(streamed.len(), MIB + 17);

    let mut expected = vec![
        ("/data/big.bin".to_string(), client.stat("/data/big.bin").await.unwrap().version, 6 * MIB as u64),
        (
            "/data/stream.bin".to_string(),
            client.stat("/data/stream.bin").await.unwrap().version,
            (MIB + 17) as u64,
        ),
    ];
    expected.extend(infos.iter().map(|i| (i.path.clone(), i.version.clone(), 8192)));
    expected.sort();
    // No explicit flush: the client reports on its own within its interval.
    eventually("the reads are reported", Duration::from_secs(20), || async {
        read_by(&admin, "train-7").await == expected
    })
    .await;

    cluster.stop_master().await;
    cluster.start_master().await;
    let admin = cluster.client().await;
    assert_eq!(read_by(&admin, "train-7").await, expected, "lineage survives a master restart");

    // The master goes away: reads go on, and what they read waits in the client.
    cluster.stop_master().await;
    assert_eq!(client.read_all("/data/big.bin").await.unwrap(), big);
    assert!(client.flush_lineage().await.is_err());
    assert!(client.lineage_counters().pending > 0);
    cluster.start_master().await;
    let admin = cluster.client().await;
    expected[0].2 += 3 * MIB as u64;
    eventually("the window read during the outage is reported", Duration::from_secs(30), || async {
        read_by(&admin, "train-7").await == expected
    })
    .await;
    assert_eq!(client.lineage_counters().dropped, 0);
}

/// A report sent again under the id it went out with (its answer lost to a timeout) is
/// acknowledged and not counted twice; the same reads under a new id are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_resent_under_its_id_is_counted_once() {
    use strata_proto::leader::master_conn;
    use strata_proto::{LineageRead, ReportLineageRequest};

    let cluster = Cluster::start(ClusterOptions::default()).await;
    let admin = cluster.client().await;
    let mut master = master_conn(&cluster.master_addr(), cluster.admin_token().as_deref(), |a| {
        Ok(tonic::transport::Endpoint::from_shared(format!("http://{a}"))?.timeout(Duration::from_secs(10)))
    })
    .unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    let report = |id: &str| ReportLineageRequest {
        job: "resent".into(),
        reads: vec![LineageRead {
            path: "/data/a.bin".into(),
            version: "v1".into(),
            bytes: 100,
            reads: 2,
            first_read_ms: now,
            last_read_ms: now,
            ..Default::default()
        }],
        client_now_ms: now,
        report_id: id.into(),
    };
    for _ in 0..3 {
        let answer = master.report_lineage(report("client-1-0")).await.unwrap().into_inner();
        assert_eq!(answer.recorded, 1);
    }
    let totals = || async {
        let records = admin.lineage_job("resent", "").await.unwrap().records;
        (records.iter().map(|r| r.bytes).sum::<u64>(), records.iter().map(|r| r.reads).sum::<u64>())
    };
    assert_eq!(totals().await, (100, 2), "three sends of one report count once");
    master.report_lineage(report("client-1-1")).await.unwrap();
    assert_eq!(totals().await, (200, 4), "a new report of the same reads counts");
    let refused = master.report_lineage(report(&"x".repeat(200))).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
}
