//! Warmup end to end: load jobs on an in-process cluster (master + workers on 127.0.0.1:0, a
//! temporary directory as the UFS), across master and worker failures, with schedules.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use strata_client::{Client, ClientError, JobInfo, JobState, LoadOptions, ScheduleInfo};
use strata_common::BlockKey;
use strata_testkit::{Cluster, ClusterOptions, pattern};

const KIB: usize = 1 << 10;
const BLOCK: u64 = 64 * 1024;

fn options(workers: usize) -> ClusterOptions {
    ClusterOptions {
        workers,
        mount_options: vec![("block_size".into(), "64KiB".into()), ("metadata_ttl".into(), "5m".into())],
        ..ClusterOptions::default()
    }
}

async fn wait_job(client: &Client, id: &str, timeout: Duration) -> JobInfo {
    let deadline = Instant::now() + timeout;
    loop {
        let job = client.admin().job_status(id).await.expect("job status");
        if strata_client::job_finished(&job) {
            return job;
        }
        assert!(Instant::now() < deadline, "job {id} did not finish in {timeout:?}: {job:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls until `pred` holds for the job (reconnecting: the master may be restarting).
async fn wait_until(cluster: &Cluster, id: &str, pred: impl Fn(&JobInfo) -> bool) -> JobInfo {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(client) = Client::connect(cluster.client_config()).await
            && let Ok(job) = client.admin().job_status(id).await
            && pred(&job)
        {
            return job;
        }
        assert!(Instant::now() < deadline, "condition on job {id} never held");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Writes `n` small files under `dir`, each a few KiB, and returns their relative paths.
fn small_files(cluster: &Cluster, dir: &str, n: usize, seed: u64) -> Vec<String> {
    (0..n)
        .map(|i| {
            let rel = format!("{dir}/{:02}/f{i:05}.bin", i / 1000);
            cluster.write_file(&rel, &pattern(KIB + (i % 7) * 100, seed + i as u64));
            rel
        })
        .collect()
}

/// What keeps `rel` from having every block on the first `replicas` owners on the current
/// ring, if anything.
async fn off_owners(client: &Client, rel: &str, replicas: usize) -> Option<String> {
    let path = format!("/data/{rel}");
    let info = client.stat(&path).await.unwrap();
    let ring = client.ring().await.unwrap();
    let locations = client.admin().block_locations(&path).await.unwrap();
    let blocks = info.size.div_ceil(info.block_size);
    if locations.blocks.len() as u64 != blocks {
        return Some(format!("{path}: {} of {blocks} blocks cached", locations.blocks.len()));
    }
    for loc in &locations.blocks {
        let hash = BlockKey::new(info.file_id.clone(), info.version.clone(), loc.index).placement_hash();
        let owners: HashSet<String> = ring.owners(hash, replicas).iter().map(|m| m.id.clone()).collect();
        let holders: HashSet<String> = loc.replicas.iter().map(|r| r.worker_id.clone()).collect();
        assert_eq!(owners.len(), replicas);
        if !owners.is_subset(&holders) {
            return Some(format!("{path} block {}: owners {owners:?} held by {holders:?}", loc.index));
        }
    }
    None
}

/// Waits until every block of each of `rels` is held by the first `replicas` owners on the
/// current ring. The block map learns of loads with the workers' next heartbeats, so this polls
/// (with a deadline) instead of sleeping for a guessed number of them.
async fn wait_on_owners<'a>(client: &Client, rels: impl IntoIterator<Item = &'a String>, replicas: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    for rel in rels {
        while let Some(problem) = off_owners(client, rel, replicas).await {
            assert!(Instant::now() < deadline, "{problem}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Polls schedule `id` until `pred` holds: its times are the master's to decide.
async fn wait_schedule(client: &Client, id: &str, pred: impl Fn(&ScheduleInfo) -> bool) -> ScheduleInfo {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let info = client.admin().list_schedules().await.unwrap().into_iter().find(|s| s.id == id);
        match info {
            Some(info) if pred(&info) => return info,
            info => assert!(Instant::now() < deadline, "schedule {id}: condition never held: {info:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Reads every file and asserts that no read reached the UFS.
async fn read_all_from_cache(cluster: &Cluster, client: &Client, rels: &[String]) {
    let before = cluster.ufs_reads();
    futures::stream::iter(rels.iter().cloned())
        .map(|rel| {
            let client = client.clone();
            async move { client.read_all(&format!("/data/{rel}")).await.map(|b| b.len()) }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<_>>()
        .await
        .expect("reads");
    assert_eq!(cluster.ufs_reads(), before, "reads after warmup moved the UFS counter");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn warmup_of_a_prefix_caches_every_block_on_two_distinct_owners() {
    let cluster = Cluster::start(options(3)).await;
    let mut rels = small_files(&cluster, "ds/small", 10_000, 1);
    let mut large_bytes = 0u64;
    for i in 0..3 {
        let rel = format!("ds/large/l{i}.bin");
        let len = 2 * 1024 * KIB + 12_345 * (i + 1);
        cluster.write_file(&rel, &pattern(len, 100 + i as u64));
        large_bytes += len as u64;
        rels.push(rel);
    }
    cluster.write_file("elsewhere/not-loaded.bin", &pattern(10 * KIB, 7));
    let client = cluster.client().await;

    let started = Instant::now();
    let opts = LoadOptions { replicas: 2, ..Default::default() };
    let job = client.admin().submit_load("/data/ds", opts).await.unwrap();
    let job = wait_job(&client, &job.id, Duration::from_secs(240)).await;
    let took = started.elapsed();
    assert_eq!(job.state(), JobState::Succeeded, "{job:?}");
    assert_eq!((job.files_total, job.files_done, job.files_failed), (10_003, 10_003, 0));
    let small_bytes: u64 = (0..10_000).map(|i| (KIB + (i % 7) * 100) as u64).sum();
    assert_eq!(job.bytes_total, small_bytes + large_bytes);
    let large_blocks: u64 =
        (0..3).map(|i| ((2 * 1024 * KIB + 12_345 * (i + 1)) as u64).div_ceil(BLOCK)).sum();
    assert_eq!(job.blocks_total, (10_000 + large_blocks) * 2);
    assert_eq!(job.blocks_done, job.blocks_total);
    eprintln!("warmup of 10,003 files ({} blocks x2) took {took:?}", 10_000 + large_blocks);
    // Each block was read from the UFS once per replica at most: a second replica may take it
    // from the first (peer fetch) when the first has it by then.
    let blocks = 10_000 + large_blocks;
    let reads = cluster.ufs_reads();
    assert!((blocks..=blocks * 2).contains(&reads), "{reads} UFS reads for {blocks} blocks x2");

    wait_on_owners(&client, rels.iter().step_by(97).chain(rels.iter().rev().take(3)), 2).await;
    read_all_from_cache(&cluster, &client, &rels).await;
    let outside = client.admin().block_locations("/data/elsewhere/not-loaded.bin").await.unwrap();
    assert!(outside.blocks.is_empty(), "a file outside the prefix was loaded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_master_killed_mid_job_resumes_it_and_finishes() {
    // One task per block (nothing packed): progress becomes durable file by file.
    master_killed_mid_job(&[("pack_threshold", "0")], 60).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_master_killed_mid_job_of_small_file_batches_resumes_it_and_finishes() {
    // Batches of 64 files per owner: the durable prefix (every file up to it finished) moves
    // once every worker's first batch (files spread over the whole listing) has reported.
    master_killed_mid_job(&[], 3 * 64).await;
}

async fn master_killed_mid_job(mount_options: &[(&str, &str)], kill_after_files: u64) {
    let mut opts = options(3);
    opts.mount_options.extend(mount_options.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let mut cluster = Cluster::start(opts).await;
    let rels = small_files(&cluster, "resume", 300, 11);
    cluster.faults().read_delay_ms.store(20, Ordering::SeqCst);
    let client = cluster.client().await;
    let opts = LoadOptions { parallelism: 1, ..Default::default() };
    let id = client.admin().submit_load("/data/resume", opts).await.unwrap().id;
    let before = wait_until(&cluster, &id, |j| j.files_done >= kill_after_files).await;
    assert!(before.files_done < 300, "the job finished before the master could be killed");
    cluster.stop_master().await;
    cluster.start_master().await;
    let resumed = wait_until(&cluster, &id, |_| true).await;
    assert_eq!(resumed.resumed, 1);
    assert!(resumed.files_done > 0, "progress was lost: {resumed:?}");
    assert_eq!(resumed.state(), JobState::Running);
    let client = cluster.client().await;
    let done = wait_job(&client, &id, Duration::from_secs(60)).await;
    assert_eq!(done.state(), JobState::Succeeded, "{done:?}");
    // Files are counted once, however many times the job was resumed.
    assert_eq!((done.files_total, done.files_done), (300, 300));
    // Blocks loaded before the restart were not fetched again.
    assert!(cluster.ufs_reads() < 300 + 30, "{} UFS reads for 300 blocks", cluster.ufs_reads());
    cluster.faults().read_delay_ms.store(0, Ordering::SeqCst);
    read_all_from_cache(&cluster, &client, &rels).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_killed_mid_job_has_its_tasks_reassigned() {
    let mut cluster = Cluster::start(options(3)).await;
    let rels = small_files(&cluster, "lose", 300, 21);
    cluster.faults().read_delay_ms.store(20, Ordering::SeqCst);
    let client = cluster.client().await;
    // --verify: blocks the dead worker had loaded are loaded again on their new owners.
    let opts = LoadOptions { parallelism: 1, verify: true, ..Default::default() };
    let id = client.admin().submit_load("/data/lose", opts).await.unwrap().id;
    wait_until(&cluster, &id, |j| j.files_done >= 30).await;
    cluster.kill_worker(0).await;
    let done = wait_job(&client, &id, Duration::from_secs(90)).await;
    assert_eq!(done.state(), JobState::Succeeded, "{done:?}");
    assert_eq!((done.files_done, done.files_failed), (300, 0));
    cluster.faults().read_delay_ms.store(0, Ordering::SeqCst);
    cluster.wait_for_live_workers(2).await;
    wait_on_owners(&client, rels.iter().step_by(7), 1).await;
    read_all_from_cache(&cluster, &client, &rels).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn verify_loads_a_file_added_after_the_first_pass() {
    let cluster = Cluster::start(options(3)).await;
    small_files(&cluster, "v", 60, 31);
    cluster.faults().read_delay_ms.store(30, Ordering::SeqCst);
    let client = cluster.client().await;
    let opts = LoadOptions { parallelism: 1, verify: true, ..Default::default() };
    let id = client.admin().submit_load("/data/v", opts).await.unwrap().id;
    wait_until(&cluster, &id, |j| j.pass == 1 && j.listing_done).await;
    let late = "v/late/new.bin";
    cluster.write_file(late, &pattern(3 * BLOCK as usize + 5, 99));
    let done = wait_job(&client, &id, Duration::from_secs(60)).await;
    cluster.faults().read_delay_ms.store(0, Ordering::SeqCst);
    assert_eq!(done.state(), JobState::Succeeded, "{done:?}");
    assert_eq!(done.pass, 2);
    assert_eq!(done.blocks_verify_loaded, 4, "the verify pass loaded the late file's 4 blocks");
    wait_on_owners(&client, [&late.to_string()], 1).await;
    read_all_from_cache(&cluster, &client, &[late.to_string()]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_seconds_schedule_fires_on_time_never_twice_at_once_and_survives_restart() {
    // One-block tasks (nothing packed), so "one load at a time" is one file at a time.
    let mut opts = options(3);
    opts.mount_options.push(("pack_threshold".into(), "0".into()));
    let mut cluster = Cluster::start(opts).await;
    small_files(&cluster, "nightly", 12, 41);
    // The first run is slow (every block from a slow UFS): later times find it still running.
    // 12 one-block files on 3 workers, one load at a time: some worker loads 4 blocks, 4 s.
    cluster.faults().read_delay_ms.store(1_000, Ordering::SeqCst);
    let client = cluster.client().await;
    let opts = LoadOptions { parallelism: 1, ..Default::default() };
    let schedule = client.admin().add_schedule("* * * * * *", "", "/data/nightly", opts).await.unwrap();
    let started = Instant::now();
    wait_schedule(&client, &schedule.id, |s| s.skipped >= 2).await;
    cluster.faults().read_delay_ms.store(0, Ordering::SeqCst);

    let jobs_of = |jobs: Vec<JobInfo>| -> Vec<JobInfo> {
        let mut mine: Vec<JobInfo> = jobs.into_iter().filter(|j| j.schedule_id == schedule.id).collect();
        mine.sort_by_key(|j| j.created_ms);
        mine
    };
    // Until a second run has finished (a loaded CI machine stretches the slow first run).
    let (info, jobs) = loop {
        let info =
            client.admin().list_schedules().await.unwrap().into_iter().find(|s| s.id == schedule.id).unwrap();
        let jobs = jobs_of(client.admin().list_jobs(true, 0).await.unwrap());
        if jobs.len() >= 2 && jobs[1].finished_ms > 0 {
            break (info, jobs);
        }
        assert!(started.elapsed() < Duration::from_secs(60), "no second run in 60 s: {info:?} {jobs:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let elapsed = started.elapsed().as_secs();
    // A time may fire between the two reads above.
    assert!((info.fired as usize..=info.fired as usize + 1).contains(&jobs.len()), "{info:?} {jobs:?}");
    assert!(info.skipped >= 2, "times during the slow first run were skipped: {info:?}");
    // One decision per second of the schedule's life: never more, and (a loaded machine may
    // tick late) not far fewer.
    let decisions = info.fired + info.skipped;
    assert!(
        decisions <= elapsed + 1 && decisions * 2 + 2 >= elapsed,
        "{decisions} decisions in {elapsed} s: {info:?}"
    );
    for pair in jobs.windows(2) {
        assert!(
            pair[0].finished_ms > 0 && pair[1].created_ms >= pair[0].finished_ms,
            "two runs overlapped: {pair:?}"
        );
    }
    assert_eq!(jobs[0].state(), JobState::Succeeded);

    cluster.stop_master().await;
    cluster.start_master().await;
    let client = cluster.client().await;
    let after = client.admin().list_schedules().await.unwrap();
    assert!(after.iter().any(|s| s.id == schedule.id && s.fired >= info.fired), "schedule lost in a restart");
    client.admin().remove_schedule(&schedule.id).await.unwrap();
    // A witness on the same seconds: one tick decides every due schedule, and ticks never
    // overlap, so once the witness has decided, any fire of the removed schedule that raced the
    // removal has landed; two more decisions span times at which it would have fired again.
    let dry = LoadOptions { dry_run: true, ..Default::default() };
    let witness = client.admin().add_schedule("* * * * * *", "", "/data/nightly", dry).await.unwrap();
    wait_schedule(&client, &witness.id, |s| s.fired + s.skipped >= 1).await;
    let count = jobs_of(client.admin().list_jobs(true, 0).await.unwrap()).len();
    wait_schedule(&client, &witness.id, |s| s.fired + s.skipped >= 3).await;
    assert_eq!(
        jobs_of(client.admin().list_jobs(true, 0).await.unwrap()).len(),
        count,
        "fired after unschedule"
    );
    client.admin().remove_schedule(&witness.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_gets_a_clear_error_and_cancel_stops_a_job() {
    let cluster = Cluster::start(options(3)).await;
    small_files(&cluster, "b", 40, 51);
    let client = cluster.client().await;
    let e = client.admin().submit_load("/data/nope", LoadOptions::default()).await.unwrap_err();
    assert!(matches!(e, ClientError::NotFound(ref m) if m.contains("/data/nope")), "{e}");
    let e = client
        .admin()
        .submit_load("/data/b", LoadOptions { replicas: 4, ..Default::default() })
        .await
        .unwrap_err();
    assert!(matches!(e, ClientError::InvalidArgument(ref m) if m.contains("--replicas 4")), "{e}");
    let e = client
        .admin()
        .submit_load("/data/b", LoadOptions { include: vec!["[".into()], ..Default::default() })
        .await
        .unwrap_err();
    assert!(matches!(e, ClientError::InvalidArgument(ref m) if m.contains("bad glob")), "{e}");
    let e =
        client.admin().add_schedule("0 25 * * *", "", "/data/b", LoadOptions::default()).await.unwrap_err();
    assert!(matches!(e, ClientError::InvalidArgument(ref m) if m.contains("bad cron")), "{e}");
    let e = client
        .admin()
        .add_schedule("0 1 * * *", "Nowhere/Town", "/data/b", LoadOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(e, ClientError::InvalidArgument(ref m) if m.contains("time zone")), "{e}");
    let e = client.admin().job_status("job-missing").await.unwrap_err();
    assert!(matches!(e, ClientError::NotFound(_)), "{e}");

    // A dry run counts and loads nothing.
    let dry = client
        .admin()
        .submit_load("/data/b", LoadOptions { dry_run: true, ..Default::default() })
        .await
        .unwrap();
    let dry = wait_job(&client, &dry.id, Duration::from_secs(30)).await;
    assert_eq!((dry.state(), dry.files_total), (JobState::Succeeded, 40));
    assert_eq!(cluster.ufs_reads(), 0);

    cluster.faults().read_delay_ms.store(200, Ordering::SeqCst);
    let opts = LoadOptions { parallelism: 1, ..Default::default() };
    let job = client.admin().submit_load("/data/b", opts).await.unwrap();
    // Cancel while loads are running: once the first one has reached the (slowed) UFS.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while cluster.ufs_reads() == 0 {
        assert!(std::time::Instant::now() < deadline, "the job never started loading");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let cancelled = client.admin().cancel_job(&job.id).await.unwrap();
    assert_eq!(cancelled.state(), JobState::Cancelled);
    cluster.faults().read_delay_ms.store(0, Ordering::SeqCst);
    let reads = cluster.ufs_reads();
    // The one fixed wait left in the suite: proving that nothing more happens needs a window
    // in which it would have happened (loads at parallelism 1 run back to back).
    tokio::time::sleep(Duration::from_millis(500)).await;
    // What was in flight at the cancel finishes: at parallelism 1, one place of each worker's
    // window, which small files' fetches share SMALL_PER_LOAD at a time; nothing starts after.
    let in_flight = 3 * strata_worker::qos::SMALL_PER_LOAD as u64;
    assert!(cluster.ufs_reads() <= reads + in_flight, "loads went on after cancel");
    let again = client.admin().job_status(&job.id).await.unwrap();
    assert!(again.files_done < 40 && again.state() == JobState::Cancelled, "{again:?}");
}
