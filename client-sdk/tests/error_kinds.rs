//! Every error kind a server sends reaches the caller as that kind: from the master over real
//! gRPC (a tonic server), and from a worker in a data-plane error frame, through the client's
//! retries and failover.

use std::net::SocketAddr;

use strata_client::{Client, ClientConfig, ClientError};
use strata_common::ErrorKind;
use strata_common::frame::{
    Op, REQUEST_HEADER_LEN, ReadBlockRequest, ReadMany, ResponseHeader, StatRequest as FrameStat,
    decode_request_header,
};
use strata_proto::master_server::{Master, MasterServer};
use strata_proto::{
    AddMountRequest, BlockLocations, BlockLocationsRequest, CacheTtlInfo, CacheTtlList, ClusterStatus,
    CommitWriteRequest, CommitWriteResponse, CreateTokenRequest, CreateTokenResponse, DeleteRequest, Empty,
    FetchLoadTasksRequest, FileStatus, FindRequest, FindResponse, FreeRequest, FreeResponse,
    HeartbeatRequest, HeartbeatResponse, InvalidateRequest, JobId, JobInfo, JobList, LineageFileRequest,
    LineageFileResponse, LineageJobList, LineageJobRequest, LineageJobResponse, LineageMark, ListJobsRequest,
    ListRequest, ListResponse, LoadTasks, LocateRequest, LocateResponse, MarkLineageRequest, Member,
    Membership, MkdirRequest, MountInfo, MountList, PinInfo, PinList, PinRequest, RegisterWorkerRequest,
    RegisterWorkerResponse, RemoveMountRequest, RenameRequest, RenameResponse, ReportLineageRequest,
    ReportLineageResponse, ReportLoadTasksRequest, ReportLoadTasksResponse, RevokeTokenRequest, ScheduleId,
    ScheduleInfo, ScheduleList, ScheduleRequest, SetCacheTtlRequest, StatError, StatManyRequest,
    StatManyResponse, StatManyResult, StatRequest, SubmitLoadRequest, SyncRequest, SyncResponse, TokenInfo,
    TokenList, UnpinRequest, UploadResultRequest, UploadResultResponse, WorkerMountsRequest,
    WorkerTokenTable, WorkerTokensRequest,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tonic::{Request, Response, Status};

/// A master whose `stat` of `/master/<kind>` fails with that kind, and of `/worker/<kind>` finds
/// a small file that the one worker, at `worker`, fails to read with that kind. `StatMany`
/// answers the same per path, or (`stat_many` false) is unknown, as to a master older than it.
struct FakeMaster {
    worker: SocketAddr,
    stat_many: bool,
}

/// What the fake master's `stat` says of `path`.
fn fake_stat(path: String) -> Result<FileStatus, Status> {
    if path.starts_with("/master/") {
        return Err(strata_proto::status(kind_in(&path), format!("{path}: refused")));
    }
    Ok(FileStatus {
        file_id: path.clone(),
        path,
        size: 100,
        version: "v1".into(),
        block_size: 4096,
        ..FileStatus::default()
    })
}

/// The kind a fake server fails a path with: its last component names it.
fn kind_in(path: &str) -> ErrorKind {
    let name = path.rsplit('/').next().unwrap_or_default();
    ErrorKind::from_name(name).unwrap_or_else(|| panic!("{path} names no error kind"))
}

macro_rules! fake_master {
    ($($rpc:ident($req:ident) -> $resp:ident;)*) => {
        #[async_trait::async_trait]
        impl Master for FakeMaster {
            async fn get_membership(&self, _: Request<Empty>) -> Result<Response<Membership>, Status> {
                let worker = Member { id: "w1".into(), data_addr: self.worker.to_string(), suspect: false, node: String::new(), local_socket: String::new() };
                Ok(Response::new(Membership { epoch: 1, workers: vec![worker] }))
            }

            async fn list_mounts(&self, _: Request<Empty>) -> Result<Response<MountList>, Status> {
                Ok(Response::new(MountList::default()))
            }

            async fn stat(&self, req: Request<StatRequest>) -> Result<Response<FileStatus>, Status> {
                fake_stat(req.into_inner().path).map(Response::new)
            }

            async fn stat_many(&self, req: Request<StatManyRequest>) -> Result<Response<StatManyResponse>, Status> {
                use strata_proto::stat_many_result::Result as R;
                if !self.stat_many {
                    return Err(Status::unimplemented("stat_many"));
                }
                let results = req
                    .into_inner()
                    .paths
                    .into_iter()
                    .map(|path| StatManyResult {
                        result: Some(match fake_stat(path) {
                            Ok(status) => R::Status(status),
                            Err(s) => R::Error(StatError {
                                kind: strata_proto::kind_of(&s).as_str().to_string(),
                                message: s.message().to_string(),
                            }),
                        }),
                    })
                    .collect();
                Ok(Response::new(StatManyResponse { results }))
            }

            $(
                async fn $rpc(&self, _: Request<$req>) -> Result<Response<$resp>, Status> {
                    Err(Status::unimplemented(stringify!($rpc)))
                }
            )*
        }
    };
}

fake_master! {
    add_mount(AddMountRequest) -> MountInfo;
    remove_mount(RemoveMountRequest) -> Empty;
    list(ListRequest) -> ListResponse;
    find(FindRequest) -> FindResponse;
    get_block_locations(BlockLocationsRequest) -> BlockLocations;
    locate(LocateRequest) -> LocateResponse;
    status(Empty) -> ClusterStatus;
    delete(DeleteRequest) -> Empty;
    mkdir(MkdirRequest) -> Empty;
    invalidate(InvalidateRequest) -> Empty;
    rename(RenameRequest) -> RenameResponse;
    register_worker(RegisterWorkerRequest) -> RegisterWorkerResponse;
    heartbeat(HeartbeatRequest) -> HeartbeatResponse;
    worker_mounts(WorkerMountsRequest) -> MountList;
    submit_load(SubmitLoadRequest) -> JobInfo;
    get_job(JobId) -> JobInfo;
    list_jobs(ListJobsRequest) -> JobList;
    cancel_job(JobId) -> JobInfo;
    add_schedule(ScheduleRequest) -> ScheduleInfo;
    list_schedules(Empty) -> ScheduleList;
    remove_schedule(ScheduleId) -> Empty;
    fetch_load_tasks(FetchLoadTasksRequest) -> LoadTasks;
    report_load_tasks(ReportLoadTasksRequest) -> ReportLoadTasksResponse;
    create_token(CreateTokenRequest) -> CreateTokenResponse;
    list_tokens(Empty) -> TokenList;
    revoke_token(RevokeTokenRequest) -> TokenInfo;
    worker_tokens(WorkerTokensRequest) -> WorkerTokenTable;
    commit_write(CommitWriteRequest) -> CommitWriteResponse;
    upload_result(UploadResultRequest) -> UploadResultResponse;
    sync(SyncRequest) -> SyncResponse;
    pin(PinRequest) -> PinInfo;
    unpin(UnpinRequest) -> PinInfo;
    list_pins(Empty) -> PinList;
    free(FreeRequest) -> FreeResponse;
    set_cache_ttl(SetCacheTtlRequest) -> CacheTtlInfo;
    list_cache_ttls(Empty) -> CacheTtlList;
    report_lineage(ReportLineageRequest) -> ReportLineageResponse;
    mark_lineage(MarkLineageRequest) -> LineageMark;
    lineage_job(LineageJobRequest) -> LineageJobResponse;
    lineage_file(LineageFileRequest) -> LineageFileResponse;
    list_lineage_jobs(Empty) -> LineageJobList;
}

/// Answers every block read with an error frame of the kind its path names. A `BadFrame` is
/// answered as a real worker rejects a frame it cannot parse: under request id 0, and the
/// connection closed.
async fn fake_worker(listener: TcpListener) {
    loop {
        let Ok((stream, _)) = listener.accept().await else { return };
        tokio::spawn(serve(stream));
    }
}

async fn serve(mut stream: TcpStream) -> std::io::Result<()> {
    loop {
        let mut head = [0u8; REQUEST_HEADER_LEN];
        stream.read_exact(&mut head).await?;
        let (op, body_len) = decode_request_header(&head).expect("a request header");
        let mut body = vec![0u8; body_len];
        stream.read_exact(&mut body).await?;
        if op == Op::ReadMany {
            // Each item fails as its own read would; a bad frame rejects the whole request.
            for req in ReadMany::decode_body(&body).expect("a batch").items {
                if !answer_read(&mut stream, &req).await? {
                    return stream.shutdown().await;
                }
            }
            continue;
        }
        if op == Op::Stat {
            // Asked when the master answers `unavailable` (an outage): this worker cannot help.
            let req = FrameStat::decode_body(&body).expect("a stat request");
            let message = "no mounts here";
            let head = ResponseHeader {
                status: Err(ErrorKind::Unavailable),
                req_id: req.req_id,
                payload_len: message.len() as u64,
            };
            stream.write_all(&head.encode()).await?;
            stream.write_all(message.as_bytes()).await?;
            continue;
        }
        let req = ReadBlockRequest::decode_body(&body).expect("a read request");
        if !answer_read(&mut stream, &req).await? {
            return stream.shutdown().await;
        }
    }
}

/// Fails `req` with the kind its path names; `false` when the connection must close after.
async fn answer_read(stream: &mut TcpStream, req: &ReadBlockRequest) -> std::io::Result<bool> {
    let kind = kind_in(&req.path);
    let message = format!("{} failed", req.path);
    let req_id = if kind == ErrorKind::BadFrame { 0 } else { req.req_id };
    let head = ResponseHeader { status: Err(kind), req_id, payload_len: message.len() as u64 };
    stream.write_all(&head.encode()).await?;
    stream.write_all(message.as_bytes()).await?;
    Ok(kind != ErrorKind::BadFrame)
}

async fn client() -> Client {
    client_of(true).await
}

/// A client of a fake master that knows `StatMany` or not.
async fn client_of(stat_many: bool) -> Client {
    let worker = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let fake = FakeMaster { worker: worker.local_addr().unwrap(), stat_many };
    tokio::spawn(fake_worker(worker));
    let incoming = tonic::transport::server::TcpIncoming::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let master = incoming.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(MasterServer::new(fake))
            .serve_with_incoming(incoming),
    );
    let mut config = ClientConfig::new(master.to_string());
    config.sidecar_socket = None;
    config.short_circuit = false;
    // A master answering `unavailable` begins an outage, during which calls that can be answered
    // otherwise skip the master until the next probe: probe at every call, so that each kind
    // below is the master's answer.
    config.membership_refresh = std::time::Duration::ZERO;
    Client::connect(config).await.expect("the fake master answers")
}

#[tokio::test]
async fn every_kind_the_master_sends_reaches_the_caller() {
    let client = client().await;
    for kind in ErrorKind::ALL {
        let e = client.stat(&format!("/master/{kind}")).await.expect_err("the master fails it");
        assert_eq!(e.kind(), kind, "{e}");
        assert_eq!(e.is_temporary(), kind.is_temporary(), "{e}");
        assert!(e.to_string().contains(&format!("/master/{kind}: refused")), "{e}");
    }
    let e = client.stat("/master/ufs").await.unwrap_err();
    assert!(!matches!(e, ClientError::MasterUnavailable(_)), "a UFS failure is not a master outage: {e}");
}

#[tokio::test]
async fn every_kind_a_worker_sends_reaches_the_caller() {
    let client = client().await;
    for kind in ErrorKind::ALL {
        let path = format!("/worker/{kind}");
        let e = client.read_range(&path, 0, 100).await.expect_err("the worker fails it");
        assert_eq!(e.kind(), kind, "{e}");
        assert!(e.to_string().contains(&format!("{path} failed")), "{e}");
        let mut buf = [0u8; 100];
        let info = client.stat(&path).await.unwrap();
        let e = client.read_into(&info, 0, &mut buf).await.expect_err("the worker fails it");
        assert_eq!(e.kind(), kind, "read_into: {e}");
    }
}

/// Batched: every path's kind through `StatMany` (or, from a master without it, path by path),
/// and every worker kind through `ReadMany`, each path its own error.
#[tokio::test]
async fn every_kind_reaches_the_caller_through_stat_many_and_read_many() {
    // A bad frame ends a batch (the worker closes the connection): last, so that every other
    // kind is answered within the batch, item by item.
    let mut kinds = ErrorKind::ALL.to_vec();
    kinds.rotate_left(1);
    assert_eq!(kinds.last(), Some(&ErrorKind::BadFrame));
    for stat_many in [true, false] {
        let client = client_of(stat_many).await;
        let masters: Vec<String> = kinds.iter().map(|k| format!("/master/{k}")).collect();
        let workers: Vec<String> = kinds.iter().map(|k| format!("/worker/{k}")).collect();
        let asked: Vec<&str> = masters.iter().chain(&workers).map(String::as_str).collect();
        let stats = client.stat_many(&asked).await;
        assert_eq!(stats.len(), asked.len());
        let mut specs = Vec::new();
        for ((path, kind), stat) in asked.iter().zip(kinds.iter().chain(&kinds)).zip(stats) {
            if path.starts_with("/master/") {
                let e = stat.expect_err("the master fails it");
                assert_eq!(e.kind(), *kind, "stat_many={stat_many}: {e}");
                assert!(e.to_string().contains(&format!("{path}: refused")), "{e}");
            } else {
                let info = stat.unwrap_or_else(|e| panic!("{path}: {e}"));
                specs.push(strata_client::ReadSpec { info, offset: 0, len: 100 });
            }
        }
        let read = client.read_many(&specs).await;
        for (kind, answer) in kinds.iter().zip(read) {
            let e = answer.expect_err("the worker fails it");
            assert_eq!(e.kind(), *kind, "read_many: {e}");
            assert!(e.to_string().contains(&format!("/worker/{kind} failed")), "{e}");
        }
    }
}
