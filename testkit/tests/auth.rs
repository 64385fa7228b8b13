//! Tokens and roles on a real cluster (master + 2 workers, auth on): every control-plane RPC and
//! every data-plane op refused with the right error for no token, a wrong one, a revoked one,
//! the wrong role and a path outside the token's scope — and nothing changed by the refusals.

use std::time::Duration;

use strata_common::frame::{
    self, GrantKind, LeaseRelease, OpenBlock, RESPONSE_HEADER_LEN, RdmaEndpoint, ReadBlockRequest,
    RemoteRead, ResponseHeader, WriteBegin,
};
use strata_common::{BlockKey, ErrorKind};
use strata_proto::leader::{MasterConn, master_conn};
use strata_proto::*;
use strata_security::token::{Access, generate};
use strata_testkit::{Cluster, ClusterOptions, eventually};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tonic::transport::Endpoint;

fn conn(cluster: &Cluster, token: Option<&str>) -> MasterConn {
    master_conn(&cluster.master_addr(), token, |a| {
        Ok(Endpoint::from_shared(format!("http://{a}"))?.timeout(Duration::from_secs(10)))
    })
    .unwrap()
}

/// Every RPC of the service with the access it needs; the request names a path under
/// `/data/b` where it takes one.
const RPCS: &[(&str, Access)] = &[
    ("GetMembership", Access::Any),
    ("ListMounts", Access::Any),
    ("AddMount", Access::Admin),
    ("RemoveMount", Access::Admin),
    ("Stat", Access::Read),
    ("StatMany", Access::Read),
    ("List", Access::Read),
    ("Find", Access::Read),
    ("GetBlockLocations", Access::Read),
    ("Locate", Access::Read),
    ("Status", Access::Any),
    ("Delete", Access::Write),
    ("Mkdir", Access::Write),
    ("Invalidate", Access::Write),
    ("Rename", Access::Write),
    ("RegisterWorker", Access::Worker),
    ("Heartbeat", Access::Worker),
    ("WorkerMounts", Access::Worker),
    ("SubmitLoad", Access::Admin),
    ("GetJob", Access::Any),
    ("ListJobs", Access::Any),
    ("CancelJob", Access::Admin),
    ("AddSchedule", Access::Admin),
    ("ListSchedules", Access::Any),
    ("RemoveSchedule", Access::Admin),
    ("FetchLoadTasks", Access::Worker),
    ("ReportLoadTasks", Access::Worker),
    ("CreateToken", Access::Admin),
    ("ListTokens", Access::Admin),
    ("RevokeToken", Access::Admin),
    ("WorkerTokens", Access::Worker),
    ("CommitWrite", Access::Worker),
    ("UploadResult", Access::Worker),
    ("Sync", Access::Read),
    ("Pin", Access::Admin),
    ("Unpin", Access::Admin),
    ("ListPins", Access::Any),
    ("Free", Access::Admin),
    ("SetCacheTtl", Access::Admin),
    ("ListCacheTtls", Access::Any),
    ("ReportLineage", Access::Read),
    ("MarkLineage", Access::Read),
    ("LineageJob", Access::Read),
    ("LineageFile", Access::Read),
    ("ListLineageJobs", Access::Read),
];

/// RPCs that need a role but name no path: a token scoped anywhere may call them.
const UNSCOPED: &[&str] = &["MarkLineage"];

/// The job whose one record (a read of `/data/b/f.bin`) is there before any case runs: callers
/// scoped elsewhere must not see it.
const SEEN_JOB: &str = "seen-by-admins";

/// Calls `rpc` with a request that would change something if it were allowed.
async fn call(c: &mut MasterConn, rpc: &str) -> Result<(), tonic::Status> {
    let p = "/data/b/f.bin".to_string();
    match rpc {
        "GetMembership" => c.get_membership(Empty {}).await.map(drop),
        "ListMounts" => c.list_mounts(Empty {}).await.map(drop),
        "AddMount" => {
            let uri = "file:///tmp".to_string();
            c.add_mount(AddMountRequest { path: "/evil".into(), uri, options: Default::default() })
                .await
                .map(drop)
        }
        "RemoveMount" => c.remove_mount(RemoveMountRequest { path: "/data".into() }).await.map(drop),
        "Stat" => c.stat(strata_proto::StatRequest { path: p, sync: false }).await.map(drop),
        // A path refused is that path's error in the answer: raised here as the call's.
        "StatMany" => {
            let answer = c.stat_many(strata_proto::StatManyRequest { paths: vec![p] }).await?.into_inner();
            match answer.results.into_iter().next().and_then(|r| r.result) {
                Some(strata_proto::stat_many_result::Result::Error(e)) => Err(strata_proto::status(
                    ErrorKind::from_name(&e.kind).unwrap_or(ErrorKind::Internal),
                    e.message,
                )),
                _ => Ok(()),
            }
        }
        "List" => c.list(ListRequest { path: "/data/b".into(), ..Default::default() }).await.map(drop),
        "Find" => c.find(FindRequest { path: "/data/b".into(), ..Default::default() }).await.map(drop),
        "GetBlockLocations" => {
            c.get_block_locations(BlockLocationsRequest { path: p, ..Default::default() }).await.map(drop)
        }
        "Locate" => c.locate(strata_proto::LocateRequest { path: "/data/b".into() }).await.map(drop),
        "Status" => c.status(Empty {}).await.map(drop),
        "Delete" => c.delete(DeleteRequest { path: "/data/b".into(), recursive: true }).await.map(drop),
        "Mkdir" => c.mkdir(MkdirRequest { path: "/data/b/new".into() }).await.map(drop),
        "Invalidate" => c.invalidate(InvalidateRequest { path: p }).await.map(drop),
        "Rename" => c.rename(RenameRequest { src: p, dst: "/data/b/renamed.bin".into() }).await.map(drop),
        "RegisterWorker" => c
            .register_worker(RegisterWorkerRequest {
                worker_id: "impostor".into(),
                data_addr: "127.0.0.1:9".into(),
                ..Default::default()
            })
            .await
            .map(drop),
        "Heartbeat" => c
            .heartbeat(HeartbeatRequest { worker_id: "impostor".into(), ..Default::default() })
            .await
            .map(drop),
        "WorkerMounts" => c.worker_mounts(WorkerMountsRequest { worker_id: "x".into() }).await.map(drop),
        "SubmitLoad" => {
            c.submit_load(SubmitLoadRequest { path: "/data/b".into(), options: None }).await.map(drop)
        }
        "GetJob" => c.get_job(JobId { id: "no-such-job".into() }).await.map(drop),
        "ListJobs" => c.list_jobs(ListJobsRequest { finished: true, limit: 10 }).await.map(drop),
        "CancelJob" => c.cancel_job(JobId { id: "no-such-job".into() }).await.map(drop),
        "AddSchedule" => c
            .add_schedule(ScheduleRequest {
                cron: "0 1 * * *".into(),
                path: "/data/b".into(),
                ..Default::default()
            })
            .await
            .map(drop),
        "ListSchedules" => c.list_schedules(Empty {}).await.map(drop),
        "RemoveSchedule" => c.remove_schedule(ScheduleId { id: "no-such-schedule".into() }).await.map(drop),
        "FetchLoadTasks" => c
            .fetch_load_tasks(FetchLoadTasksRequest { worker_id: "impostor".into(), max: 1, wait_ms: 0 })
            .await
            .map(drop),
        "ReportLoadTasks" => c
            .report_load_tasks(ReportLoadTasksRequest { worker_id: "impostor".into(), results: vec![] })
            .await
            .map(drop),
        "CreateToken" => {
            c.create_token(CreateTokenRequest { role: "admin".into(), ..Default::default() }).await.map(drop)
        }
        "ListTokens" => c.list_tokens(Empty {}).await.map(drop),
        "RevokeToken" => c.revoke_token(RevokeTokenRequest { id: "000000000000".into() }).await.map(drop),
        "WorkerTokens" => c.worker_tokens(WorkerTokensRequest { worker_id: "x".into() }).await.map(drop),
        "CommitWrite" => c
            .commit_write(CommitWriteRequest {
                worker_id: "impostor".into(),
                path: p,
                write_id: "w1".into(),
                size: 1,
                holders: vec!["impostor".into()],
                ..Default::default()
            })
            .await
            .map(drop),
        "UploadResult" => c
            .upload_result(UploadResultRequest {
                worker_id: "impostor".into(),
                path: p,
                write_id: "w1".into(),
                ..Default::default()
            })
            .await
            .map(drop),
        "Sync" => c.sync(SyncRequest { path: p, retry_failed: true }).await.map(drop),
        "Pin" => {
            c.pin(PinRequest { path: p, tier: PinTier::Memory as i32, ttl_ms: 0, wait_ms: 1 }).await.map(drop)
        }
        "Unpin" => c.unpin(UnpinRequest { path: p, wait_ms: 1 }).await.map(drop),
        "ListPins" => c.list_pins(Empty {}).await.map(drop),
        "Free" => c.free(FreeRequest { path: p, wait_ms: 1 }).await.map(drop),
        "SetCacheTtl" => c
            .set_cache_ttl(strata_proto::SetCacheTtlRequest { path: p, cache_ttl_ms: 1000, wait_ms: 1 })
            .await
            .map(drop),
        "ListCacheTtls" => c.list_cache_ttls(Empty {}).await.map(drop),
        "ReportLineage" => c.report_lineage(lineage_report("reporter", &p)).await.map(drop),
        "MarkLineage" => c
            .mark_lineage(MarkLineageRequest { job: "marker".into(), label: "epoch=1".into() })
            .await
            .map(drop),
        // Query answers are filtered to the caller's scope: a record kept from it is raised here
        // as a refusal, so a leak fails the test like an allowed write.
        "LineageJob" => {
            let answer = c
                .lineage_job(LineageJobRequest { job: SEEN_JOB.into(), ..Default::default() })
                .await?
                .into_inner();
            match answer.records.iter().any(|r| r.path == p) {
                true => Ok(()),
                false => {
                    Err(strata_proto::status(ErrorKind::PermissionDenied, "the record was filtered out"))
                }
            }
        }
        "LineageFile" => c.lineage_file(LineageFileRequest { path: p, ..Default::default() }).await.map(drop),
        "ListLineageJobs" => {
            let jobs = c.list_lineage_jobs(Empty {}).await?.into_inner().jobs;
            match jobs.iter().any(|j| j.job == SEEN_JOB) {
                true => Ok(()),
                false => Err(strata_proto::status(ErrorKind::PermissionDenied, "the job was filtered out")),
            }
        }
        other => panic!("no call for {other}"),
    }
}

fn lineage_report(job: &str, path: &str) -> ReportLineageRequest {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    ReportLineageRequest {
        job: job.into(),
        reads: vec![LineageRead {
            path: path.into(),
            version: "v1".into(),
            bytes: 6,
            reads: 1,
            first_read_ms: now,
            last_read_ms: now,
            ..Default::default()
        }],
        client_now_ms: now,
        ..Default::default()
    }
}

/// What the cluster looks like: mounts, jobs, schedules, tokens, files, workers.
async fn snapshot(cluster: &Cluster) -> String {
    let mut admin = conn(cluster, cluster.admin_token().as_deref());
    // Options as sorted pairs: a map's order is not part of what changed.
    let mounts: Vec<(String, String, std::collections::BTreeMap<String, String>)> = admin
        .list_mounts(Empty {})
        .await
        .unwrap()
        .into_inner()
        .mounts
        .into_iter()
        .map(|m| (m.path, m.uri, m.options.into_iter().collect()))
        .collect();
    let jobs = admin.list_jobs(ListJobsRequest { finished: true, limit: 0 }).await.unwrap().into_inner().jobs;
    let schedules = admin.list_schedules(Empty {}).await.unwrap().into_inner().schedules;
    let mut tokens: Vec<String> =
        admin.list_tokens(Empty {}).await.unwrap().into_inner().tokens.into_iter().map(|t| t.id).collect();
    tokens.sort();
    let workers: Vec<String> =
        admin.status(Empty {}).await.unwrap().into_inner().workers.into_iter().map(|w| w.id).collect();
    let files: Vec<String> = walkdir(cluster.ufs.dir());
    let pins = admin.list_pins(Empty {}).await.unwrap().into_inner().pins;
    let ttls = admin.list_cache_ttls(Empty {}).await.unwrap().into_inner().ttls;
    format!("{mounts:?}\n{jobs:?}\n{schedules:?}\n{tokens:?}\n{workers:?}\n{files:?}\n{pins:?}\n{ttls:?}")
}

fn walkdir(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let path = e.path();
        if path.is_dir() {
            out.push(format!("{}/", path.display()));
            out.extend(walkdir(&path));
        } else {
            out.push(format!("{} {}", path.display(), std::fs::read(&path).unwrap().len()));
        }
    }
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rpc_refuses_callers_without_the_right_token_role_or_scope() {
    let cluster = Cluster::start(ClusterOptions { workers: 2, ..ClusterOptions::default() }).await;
    cluster.write_file("a/f.bin", b"team a");
    cluster.write_file("b/f.bin", b"team b");
    let admin_client = cluster.client().await;
    let (_, reader) = admin_client.admin().create_token("reader", "/data/a", "reader a").await.unwrap();
    let (_, writer) = admin_client.admin().create_token("writer", "/data/a", "writer a").await.unwrap();
    let (revoked_info, revoked) =
        admin_client.admin().create_token("admin", "", "soon revoked").await.unwrap();
    admin_client.admin().revoke_token(&revoked_info.id).await.unwrap();
    let admin = cluster.admin_token().unwrap();
    let worker = cluster.worker_token().unwrap();
    conn(&cluster, Some(&admin)).report_lineage(lineage_report(SEEN_JOB, "/data/b/f.bin")).await.unwrap();

    // The table covers the whole service, as the .proto declares it.
    let proto = include_str!("../../proto/strata.proto");
    for line in proto.lines().filter_map(|l| l.trim().strip_prefix("rpc ")) {
        let name = line.split('(').next().unwrap().trim();
        assert!(RPCS.iter().any(|(n, _)| *n == name), "{name} is not covered by this test");
    }

    let before = snapshot(&cluster).await;
    let wrong = generate();
    // First the callers whose every call must be refused or be a read: the cluster must be
    // exactly as it was after them. Then a worker and an admin, whose role-allowed calls do
    // change it (an impostor registers, a mount goes), for their refusals alone.
    let cases: [(&str, Option<&str>); 7] = [
        ("no token", None),
        ("wrong token", Some(&wrong)),
        ("revoked token", Some(&revoked)),
        ("reader outside its scope", Some(&reader)),
        ("writer outside its scope", Some(&writer)),
        ("worker", Some(&worker)),
        ("admin", Some(&admin)),
    ];
    for (case, token) in cases {
        if case == "worker" {
            assert_eq!(snapshot(&cluster).await, before, "refused calls changed nothing");
        }
        let mut c = conn(&cluster, token);
        for &(rpc, access) in RPCS {
            let got = call(&mut c, rpc).await;
            let refused = match case {
                "no token" | "wrong token" | "revoked token" => Some(ErrorKind::Unauthenticated),
                // Scoped tokens name paths under /data/b, outside their scope; what their role
                // lacks is refused first, by the interceptor.
                "reader outside its scope" | "writer outside its scope" => Some(ErrorKind::PermissionDenied)
                    .filter(|_| access != Access::Any && !UNSCOPED.contains(&rpc)),
                "worker" => Some(ErrorKind::PermissionDenied)
                    .filter(|_| matches!(access, Access::Write | Access::Admin)),
                _ => Some(ErrorKind::PermissionDenied).filter(|_| access == Access::Worker),
            };
            match (refused, got) {
                (Some(kind), Err(status)) => {
                    assert_eq!(strata_proto::kind_of(&status), kind, "{case} calling {rpc}: {status:?}");
                    assert!(!status.message().contains("strata_"), "a refusal never echoes a token");
                }
                (Some(kind), Ok(())) => panic!("{case} calling {rpc} was allowed; expected {kind}"),
                (None, Err(status)) => {
                    let kind = strata_proto::kind_of(&status);
                    assert!(
                        !matches!(kind, ErrorKind::Unauthenticated | ErrorKind::PermissionDenied),
                        "{case} calling {rpc} was refused: {status:?}"
                    );
                }
                (None, Ok(())) => {}
            }
        }
    }
    assert_ne!(
        snapshot(&cluster).await,
        before,
        "the admin's calls did change the cluster: the check can fail"
    );
}

/// One data-plane exchange on a new connection: the Auth frame when `token` is given, then
/// `frame`; the answer's status (kind) and message.
async fn exchange(addr: &str, token: Option<&str>, frame: &[u8]) -> Result<Vec<u8>, (ErrorKind, String)> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    if let Some(t) = token {
        s.write_all(&frame::auth_request(t)).await.unwrap();
    }
    s.write_all(frame).await.unwrap();
    let mut head = [0u8; RESPONSE_HEADER_LEN];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut head)).await.expect("an answer").unwrap();
    let head = ResponseHeader::decode(&head).unwrap();
    let mut payload = vec![0u8; head.payload_len.min(1 << 20) as usize];
    s.read_exact(&mut payload).await.unwrap();
    match head.status {
        Ok(_) => Ok(payload),
        Err(kind) => Err((kind, String::from_utf8_lossy(&payload).into_owned())),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_data_plane_op_refuses_callers_without_the_right_token_role_or_scope() {
    let cluster = Cluster::start(ClusterOptions { workers: 1, ..ClusterOptions::default() }).await;
    cluster.write_file("a/f.bin", b"team a");
    cluster.write_file("b/f.bin", b"team b");
    let admin_client = cluster.client().await;
    let b = admin_client.stat("/data/b/f.bin").await.unwrap();
    let (_, reader) = admin_client.admin().create_token("reader", "/data/a", "").await.unwrap();
    let (revoked_info, revoked) = admin_client.admin().create_token("writer", "", "").await.unwrap();
    let addr = cluster.worker(0).data_addr.to_string();
    let admin = cluster.admin_token().unwrap();

    let read = ReadBlockRequest {
        req_id: 5,
        path: b.path.clone(),
        version: b.version.clone(),
        file_size: b.size,
        block_size: b.block_size,
        block_index: 0,
        offset: 0,
        len: b.size,
    };
    let frames: Vec<(&str, Vec<u8>, Access)> = vec![
        ("ReadBlock", read.encode(), Access::Read),
        ("PeerRead", read.encode_peer(), Access::Read),
        ("PeerFetch", read.encode_peer_fetch(), Access::Read),
        ("OpenBlock", OpenBlock { read: read.clone(), kind: GrantKind::Rdma }.encode(), Access::Read),
        (
            "WriteBegin",
            WriteBegin { req_id: 5, path: "/data/b/f.bin".into(), write_back: None }.encode(),
            Access::Write,
        ),
        ("ReadMany", frame::ReadMany { items: vec![read.clone()] }.encode(), Access::Read),
        ("Stat", frame::StatRequest { req_id: 5, path: "/data/b/f.bin".into() }.encode(), Access::Read),
        (
            "Copy",
            frame::CopyRequest {
                req_id: 5,
                src: "/data/b/f.bin".into(),
                dst: "/data/b/copy.bin".into(),
                version: String::new(),
                size: 0,
            }
            .encode(),
            Access::Write,
        ),
        (
            "Prefetch",
            frame::PrefetchHints { req_id: 5, stream: 1, items: vec![read.clone()] }.encode(),
            Access::Read,
        ),
        ("View", frame::view_request(5), Access::Any),
        ("RemoteRead", RemoteRead { req_id: 5, addr: 0, rkey: 1, len: 1 }.encode(), Access::Any),
        ("RdmaConnect", RdmaEndpoint { qp_num: 1, lid: 0, gid: None }.encode_request(), Access::Any),
        // A release has no answer: sent before a read, which must then be refused.
        (
            "Release",
            [LeaseRelease { lease_id: 1, kind: GrantKind::Fd }.encode(), read.encode()].concat(),
            Access::Read,
        ),
        // Only a worker may make this worker take blocks.
        (
            "HandOffOffer",
            frame::HandOffOffer { req_id: 5, blocks: vec![(BlockKey::new(&b.path, &b.version, 0), b.size)] }
                .encode(),
            Access::Worker,
        ),
        (
            "HandOffBlock",
            frame::HandOffBlock {
                req_id: 5,
                key: BlockKey::new(&b.path, &b.version, 0),
                data: bytes::Bytes::from_static(b"forged"),
            }
            .encode(),
            Access::Worker,
        ),
    ];
    // The table covers every op the codec knows, but those that are no request of their own.
    const NOT_REQUESTS: &[&str] = &[
        "Auth",      // the token itself, tested by every row
        "WriteData", // parts of a write its WriteBegin opened (refused above)
        "WriteEnd",
        "Class", // how to schedule later requests: no access of its own (testkit/tests/qos.rs)
    ];
    for code in 0..=u8::MAX {
        let mut header = frame::request_header(frame::Op::View, 0);
        header[4] = code;
        if let Ok((op, _)) = frame::decode_request_header(&header) {
            let name = format!("{op:?}");
            assert!(
                frames.iter().any(|(n, ..)| *n == name) || NOT_REQUESTS.contains(&name.as_str()),
                "{name} is not covered by this test"
            );
        }
    }
    // The admin reads the block: the check can pass.
    assert_eq!(exchange(&addr, Some(&admin), &read.encode()).await.unwrap(), b"team b");
    // The revocation reaches the worker within a heartbeat.
    admin_client.admin().revoke_token(&revoked_info.id).await.unwrap();
    eventually("the worker learnt the revocation", Duration::from_secs(10), || {
        let (addr, revoked, frame) = (addr.clone(), revoked.clone(), frame::view_request(1));
        async move { exchange(&addr, Some(&revoked), &frame).await.is_err() }
    })
    .await;

    let wrong = generate();
    for (op, frame, access) in &frames {
        for (case, token) in [
            ("no token", None),
            ("wrong", Some(wrong.as_str())),
            ("revoked", Some(&revoked)),
            ("reader", Some(&reader)),
        ] {
            let got = exchange(&addr, token, frame).await;
            let expected = match case {
                "reader" if *access == Access::Any => None,
                "reader" => Some(ErrorKind::PermissionDenied),
                _ => Some(ErrorKind::Unauthenticated),
            };
            match (expected, got) {
                (Some(kind), Err((k, message))) => {
                    assert_eq!(k, kind, "{case} {op}: {message}");
                }
                (Some(kind), Ok(_)) => panic!("{case} {op} was served; expected {kind}"),
                (None, Err((k, message))) => assert!(
                    !matches!(k, ErrorKind::Unauthenticated | ErrorKind::PermissionDenied),
                    "{case} {op} refused: {message}"
                ),
                (None, Ok(_)) => {}
            }
        }
    }
    let on_disk = std::fs::read(cluster.ufs.dir().join("b/f.bin")).unwrap();
    assert_eq!(on_disk, b"team b", "no refused write touched the file");
    assert!(!cluster.ufs.dir().join("b/copy.bin").exists(), "no refused copy made a file");
    // In its scope, the reader reads.
    let a = admin_client.stat("/data/a/f.bin").await.unwrap();
    let read_a =
        ReadBlockRequest { path: a.path, version: a.version, file_size: a.size, len: a.size, ..read };
    assert_eq!(exchange(&addr, Some(&reader), &read_a.encode()).await.unwrap(), b"team a");
}

#[tokio::test]
async fn a_cluster_with_auth_off_serves_everyone() {
    let cluster =
        Cluster::start(ClusterOptions { workers: 1, auth: false, ..ClusterOptions::default() }).await;
    cluster.write_file("f.bin", b"open");
    assert!(cluster.admin_token().is_none());
    let client = cluster.client_with_token(None).await.unwrap();
    assert_eq!(&client.read_all("/data/f.bin").await.unwrap()[..], b"open");
    // A token is accepted (and ignored) too, so clients configured for a secured cluster work.
    let with = cluster.client_with_token(Some(&generate())).await.unwrap();
    assert_eq!(&with.read_all("/data/f.bin").await.unwrap()[..], b"open");
}
