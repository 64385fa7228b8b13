//! Every error kind a server sends reaches the caller as that kind: from the master over real
//! gRPC (a tonic server), and from a worker in a data-plane error frame, through the client's
//! retries and failover.

use std::net::SocketAddr;

use strata_client::{Client, ClientConfig, ClientError};
use strata_common::ErrorKind;
use strata_common::frame::{
    Op, REQUEST_HEADER_LEN, ReadBlockRequest, ResponseHeader, StatRequest as FrameStat, decode_request_header,
};
use strata_proto::master_server::{Master, MasterServer};
use strata_proto::{
    AddMountRequest, BlockLocations, BlockLocationsRequest, CacheTtlInfo, CacheTtlList, ClusterStatus,
    CommitWriteRequest, CommitWriteResponse, CreateTokenRequest, CreateTokenResponse, DeleteRequest, Empty,
    FetchLoadTasksRequest, FileStatus, FindRequest, FindResponse, FreeRequest, FreeResponse,
    HeartbeatRequest, HeartbeatResponse, InvalidateRequest, JobId, JobInfo, JobList, ListJobsRequest,
    ListRequest, ListResponse, LoadTasks, LocateRequest, LocateResponse, Member, Membership, MkdirRequest,
    MountInfo, MountList, PinInfo, PinList, PinRequest, RegisterWorkerRequest, RegisterWorkerResponse,
    RemoveMountRequest, RenameRequest, RenameResponse, ReportLoadTasksRequest, ReportLoadTasksResponse,
    RevokeTokenRequest, ScheduleId, ScheduleInfo, ScheduleList, ScheduleRequest, SetCacheTtlRequest,
    StatManyRequest, StatManyResponse,
    StatRequest, SubmitLoadRequest, SyncRequest, SyncResponse, TokenInfo, TokenList, UnpinRequest,
    UploadResultRequest, UploadResultResponse, WorkerMountsRequest, WorkerTokenTable, WorkerTokensRequest,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tonic::{Request, Response, Status};

/// A master whose `stat` of `/master/<kind>` fails with that kind, and of `/worker/<kind>` finds
/// a small file that the one worker, at `worker`, fails to read with that kind.
struct FakeMaster {
    worker: SocketAddr,
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
                let worker = Member { id: "w1".into(), data_addr: self.worker.to_string(), suspect: false, node: String::new() };
                Ok(Response::new(Membership { epoch: 1, workers: vec![worker] }))
            }

            async fn list_mounts(&self, _: Request<Empty>) -> Result<Response<MountList>, Status> {
                Ok(Response::new(MountList::default()))
            }

            async fn stat(&self, req: Request<StatRequest>) -> Result<Response<FileStatus>, Status> {
                let path = req.into_inner().path;
                if path.starts_with("/master/") {
                    return Err(strata_proto::status(kind_in(&path), format!("{path}: refused")));
                }
                Ok(Response::new(FileStatus {
                    file_id: path.clone(),
                    path,
                    size: 100,
                    version: "v1".into(),
                    block_size: 4096,
                    ..FileStatus::default()
                }))
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
    stat_many(StatManyRequest) -> StatManyResponse;
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
        let kind = kind_in(&req.path);
        let message = format!("{} failed", req.path);
        let req_id = if kind == ErrorKind::BadFrame { 0 } else { req.req_id };
        let head = ResponseHeader { status: Err(kind), req_id, payload_len: message.len() as u64 };
        stream.write_all(&head.encode()).await?;
        stream.write_all(message.as_bytes()).await?;
        if kind == ErrorKind::BadFrame {
            return stream.shutdown().await;
        }
    }
}

async fn client() -> Client {
    let worker = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let fake = FakeMaster { worker: worker.local_addr().unwrap() };
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
