//! The master's decisions by elapsed time — worker liveness, metadata TTLs, task leases,
//! schedules — on a `ManualClock`, through the gRPC API. A test moves time instead of sleeping
//! through it; the one wait left, for the master's background loops to run, is a poll with a
//! deadline.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_common::Clock;
use strata_common::clock::ManualClock;
use strata_master::{Master, MasterConfig, MasterHandle};
use strata_proto::leader::{MasterConn, master_conn};
use strata_proto::{
    AddMountRequest, Empty, FetchLoadTasksRequest, HeartbeatRequest, JobId, JobState, ListJobsRequest,
    ListRequest, LoadOptions, LoadTask, LoadTaskResult, RegisterWorkerRequest, ReportLoadTasksRequest,
    ScheduleId, ScheduleInfo, ScheduleRequest, StatRequest, SubmitLoadRequest,
};
use strata_ufs::OpendalFactory;
use tempfile::TempDir;

struct Fixture {
    master: MasterHandle,
    clock: Arc<ManualClock>,
    /// The admin token's client (mounts, jobs, schedules, reads).
    client: MasterConn,
    /// The workers' token's client (register, heartbeat, load tasks).
    worker: MasterConn,
    ufs: TempDir,
    _state: TempDir,
}

/// A master on a manual clock with a temporary directory mounted at `/data` (metadata TTL 10 s).
async fn start(worker_timeout_ms: u64) -> Fixture {
    let state = tempfile::tempdir().unwrap();
    let ufs = tempfile::tempdir().unwrap();
    let config = MasterConfig {
        rpc_addr: "127.0.0.1:0".parse().unwrap(),
        http_addr: "127.0.0.1:0".parse().unwrap(),
        data_dir: state.path().join("master"),
        worker_timeout_ms,
        heartbeat_interval_ms: 100,
        ..MasterConfig::default()
    };
    let clock = ManualClock::new();
    let master = Master::start_with_clock(config, Arc::new(OpendalFactory), clock.clone()).await.unwrap();
    let conn = |file: &str| {
        let token = strata_security::token::read_token_file(&state.path().join("master").join(file)).unwrap();
        master_conn(&master.rpc_addr.to_string(), Some(&token), |a| {
            tonic::transport::Endpoint::from_shared(format!("http://{a}"))
        })
        .unwrap()
    };
    let (mut client, worker) = (conn("admin.token"), conn("worker.token"));
    let options = [("metadata_ttl".to_string(), "10s".to_string())].into();
    let uri = format!("file://{}", ufs.path().display());
    client.add_mount(AddMountRequest { path: "/data".into(), uri, options }).await.unwrap();
    Fixture { master, clock, client, worker, ufs, _state: state }
}

impl Fixture {
    fn write(&self, rel: &str, len: usize) {
        std::fs::write(self.ufs.path().join(rel), vec![7u8; len]).unwrap();
    }

    async fn register(&mut self, id: &str) {
        let req = RegisterWorkerRequest {
            worker_id: id.into(),
            data_addr: "127.0.0.1:1".into(),
            http_addr: String::new(),
            tiers: Vec::new(),
            ..Default::default()
        };
        self.worker.register_worker(req).await.unwrap();
    }

    async fn live(&mut self, id: &str) -> bool {
        let status = self.client.status(Empty {}).await.unwrap().into_inner();
        status.workers.iter().any(|w| w.id == id && w.live)
    }

    async fn size(&mut self, path: &str) -> u64 {
        let req = StatRequest { path: path.into(), sync: false };
        self.client.stat(req).await.unwrap().into_inner().size
    }

    async fn fetch(&mut self, worker: &str, wait_ms: u64) -> Vec<LoadTask> {
        let req = FetchLoadTasksRequest { worker_id: worker.into(), max: 10, wait_ms };
        self.worker.fetch_load_tasks(req).await.unwrap().into_inner().tasks
    }
}

/// Polls `probe` until it answers, for at most 20 s.
async fn eventually<T, F, Fut>(what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: not within 20 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_silent_worker_is_lost_only_once_the_clock_passes_its_timeout() {
    let mut f = start(1_000).await;
    f.register("quiet").await;
    f.register("beating").await;
    f.clock.advance(Duration::from_millis(600));
    let beat = HeartbeatRequest { worker_id: "beating".into(), ..Default::default() };
    assert!(!f.worker.heartbeat(beat).await.unwrap().into_inner().reregister);
    f.clock.advance(Duration::from_millis(600));

    let client = f.client.clone();
    eventually("the quiet worker is declared lost", || {
        let mut client = client.clone();
        async move {
            let status = client.status(Empty {}).await.unwrap().into_inner();
            status.workers.iter().any(|w| w.id == "quiet" && !w.live).then_some(())
        }
    })
    .await;
    // Silent for 600 ms of the master's clock, however long the test took in real time.
    assert!(f.live("beating").await);
    let status = f.client.status(Empty {}).await.unwrap().into_inner();
    let beating = status.workers.iter().find(|w| w.id == "beating").unwrap();
    assert_eq!(beating.last_heartbeat_ms_ago, 600);
    let lost = HeartbeatRequest { worker_id: "quiet".into(), ..Default::default() };
    assert!(f.worker.heartbeat(lost).await.unwrap().into_inner().reregister, "a lost worker registers again");
    f.master.shutdown().await;
}

#[tokio::test]
async fn cached_stats_and_listings_last_their_ttl_on_the_clock() {
    let mut f = start(10_000).await;
    f.write("a.bin", 10);
    assert_eq!(f.size("/data/a.bin").await, 10);
    let names = |mut client: MasterConn| async move {
        let req = ListRequest { path: "/data".into(), sync: false, ..Default::default() };
        let entries = client.list(req).await.unwrap().into_inner().entries;
        entries.into_iter().map(|e| e.path).collect::<Vec<_>>()
    };
    assert_eq!(names(f.client.clone()).await, ["/data/a.bin"]);

    f.write("a.bin", 20);
    f.write("b.bin", 5);
    f.clock.advance(Duration::from_millis(9_999));
    assert_eq!(f.size("/data/a.bin").await, 10, "within the TTL the cached stat is served");
    assert_eq!(names(f.client.clone()).await, ["/data/a.bin"], "and the cached listing");
    f.clock.advance(Duration::from_millis(1));
    assert_eq!(f.size("/data/a.bin").await, 20, "at the TTL the UFS is asked again");
    assert_eq!(names(f.client.clone()).await, ["/data/a.bin", "/data/b.bin"]);
    f.master.shutdown().await;
}

#[tokio::test]
async fn a_task_not_reported_within_its_lease_is_handed_out_again() {
    // A timeout longer than the lease: the worker stays live while the lease runs out.
    let mut f = start(600_000).await;
    f.register("w").await;
    f.write("a.bin", 10);
    let opts = LoadOptions { replicas: 1, ..Default::default() };
    let req = SubmitLoadRequest { path: "/data".into(), options: Some(opts) };
    let job = f.client.submit_load(req).await.unwrap().into_inner();
    let client = f.worker.clone();
    let task = eventually("the job's task is handed out", || {
        let mut client = client.clone();
        async move {
            let req = FetchLoadTasksRequest { worker_id: "w".into(), max: 10, wait_ms: 1_000 };
            client.fetch_load_tasks(req).await.unwrap().into_inner().tasks.pop()
        }
    })
    .await;
    assert!(f.fetch("w", 0).await.is_empty(), "leased");

    f.clock.advance(Duration::from_secs(60));
    let again = eventually("the task comes back after its lease", || {
        let mut client = client.clone();
        async move {
            let req = FetchLoadTasksRequest { worker_id: "w".into(), max: 10, wait_ms: 100 };
            client.fetch_load_tasks(req).await.unwrap().into_inner().tasks.pop()
        }
    })
    .await;
    assert_eq!(again.task_id, task.task_id);
    let done =
        LoadTaskResult { task_id: again.task_id, job_id: job.id.clone(), ok: true, ..Default::default() };
    let report = ReportLoadTasksRequest { worker_id: "w".into(), results: vec![done] };
    f.worker.report_load_tasks(report).await.unwrap();
    let info = eventually("the job succeeds", || {
        let mut client = client.clone();
        let id = job.id.clone();
        async move {
            let info = client.get_job(JobId { id }).await.unwrap().into_inner();
            (info.state() != JobState::Running).then_some(info)
        }
    })
    .await;
    assert_eq!(info.state(), JobState::Succeeded, "{info:?}");
    assert_eq!(info.blocks_done, 1);
    f.master.shutdown().await;
}

async fn add_hourly(client: &mut MasterConn) -> ScheduleInfo {
    let req = ScheduleRequest {
        cron: "0 * * * *".into(),
        tz: String::new(),
        path: "/data".into(),
        options: Some(LoadOptions { dry_run: true, ..Default::default() }),
    };
    client.add_schedule(req).await.unwrap().into_inner()
}

/// Polls until the schedule has decided (fired or skipped) `n` times.
async fn decided(client: &MasterConn, id: &str, n: u64) -> ScheduleInfo {
    eventually("the schedule's time is decided", || {
        let mut client = client.clone();
        let id = id.to_string();
        async move {
            let all = client.list_schedules(Empty {}).await.unwrap().into_inner().schedules;
            all.into_iter().find(|s| s.id == id && s.fired + s.skipped >= n)
        }
    })
    .await
}

#[tokio::test]
async fn schedules_fire_when_the_clock_reaches_their_time_and_never_after_removal() {
    let mut f = start(10_000).await;
    f.write("a.bin", 10);
    let kept = add_hourly(&mut f.client).await;
    let removed = add_hourly(&mut f.client).await;
    f.client.remove_schedule(ScheduleId { id: removed.id.clone() }).await.unwrap();
    assert!(kept.next_fire_ms > f.clock.wall_ms());
    assert!(kept.next_fire_ms % 3_600_000 < 1_000, "on the hour (to the second)");
    assert_eq!(removed.next_fire_ms, kept.next_fire_ms, "both due at the same tick");

    f.clock.advance(Duration::from_millis((kept.next_fire_ms - f.clock.wall_ms()) as u64));
    let first = decided(&f.client, &kept.id, 1).await;
    assert_eq!((first.fired, first.next_fire_ms), (1, kept.next_fire_ms + 3_600_000));
    // A second time, on a later tick: the first tick (where the removed schedule would have
    // fired too) is then over.
    f.clock.advance(Duration::from_secs(3_600));
    let second = decided(&f.client, &kept.id, 2).await;
    assert_eq!(second.next_fire_ms, kept.next_fire_ms + 2 * 3_600_000);

    let jobs =
        f.client.list_jobs(ListJobsRequest { finished: true, limit: 0 }).await.unwrap().into_inner().jobs;
    assert!(!jobs.is_empty());
    assert!(jobs.iter().all(|j| j.schedule_id == kept.id), "a removed schedule fired: {jobs:?}");
    let schedules = f.client.list_schedules(Empty {}).await.unwrap().into_inner().schedules;
    assert_eq!(schedules.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), [kept.id.as_str()]);
    f.master.shutdown().await;
}
