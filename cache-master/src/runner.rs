//! The I/O around the load-job state machine (`jobs.rs`) and the schedules (`schedule.rs`):
//! one runner task per running job streams the UFS listing into the job table, waits for the
//! workers to drain it, and stores progress; the jobs tick expires leases, follows membership
//! and fires due schedules.
//!
//! A [`JobRunner`] is handed everything it uses when the master starts (the store, the
//! metadata it resolves and stats paths through, the cluster whose live set makes the ring, a
//! cancellation token), and owns the job table and the schedules; nothing reaches into it.
//!
//! Invariants: a job is in the store before its runner starts and before its submitter hears
//! of it, and what is stored of its progress is the finished prefix of its listing (see
//! `jobs.rs`), so a restart resumes it without counting a file twice; memory stays bounded
//! whatever the tree's size, since the listing is a stream and a runner stops pulling from it
//! while `WINDOW` files of its job are in flight.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use strata_common::background::sleep_or_cancel;
use strata_common::ring::DEFAULT_VNODES;
use strata_common::{BlockKey, Ring, SharedClock, path};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::cluster::Cluster;
use crate::error::OpError;
use crate::filter::Filter;
use crate::jobs::{FileIn, JobInfo, JobRecord, Jobs, LoadSettings, LoadTask, LoadTaskResult, PassEnd};
use crate::locks::lock;
use crate::metadata::Metadata;
use crate::metrics_defs as m;
use crate::schedule::{self, ScheduleRecord, Schedules};
use crate::store::MetaStore;

/// Files of one job in flight at most (listed, not yet finished).
const WINDOW: usize = 4096;
/// How often a runner stores progress while files finish.
const PERSIST_EVERY: Duration = Duration::from_millis(500);
/// Longest a worker's poll for load tasks is held open.
const MAX_TASK_WAIT: Duration = Duration::from_secs(5);
/// How long small files may gather into batches while the listing goes on before the batches
/// so far are handed out anyway (a slow listing must not leave the workers idle).
const FLUSH_EVERY: Duration = Duration::from_millis(50);

/// Everything a [`JobRunner`] works with, handed over at start-up.
pub struct RunnerParams {
    /// The job table, with the jobs loaded from the store.
    pub jobs: Jobs,
    pub schedules: Schedules,
    pub store: Arc<dyn MetaStore>,
    /// Resolves and stats job paths, lists the UFS through the mount table.
    pub metadata: Arc<Metadata>,
    /// The live workers the job table's ring follows, and the block map.
    pub cluster: Arc<Cluster>,
    /// Stops every job runner when the master shuts down.
    pub cancel: CancellationToken,
    /// Leases, retry backoff and schedules are decided on this clock, and records stamped.
    pub clock: SharedClock,
    /// How often workers heartbeat: a verify pass waits three beats for block reports.
    pub heartbeat_interval: Duration,
    /// Finished jobs kept.
    pub job_history: usize,
}

pub struct JobRunner {
    jobs: Mutex<Jobs>,
    schedules: Mutex<Schedules>,
    store: Arc<dyn MetaStore>,
    metadata: Arc<Metadata>,
    cluster: Arc<Cluster>,
    /// Wakes workers long-polling for load tasks.
    task_ready: Notify,
    /// Wakes job runners when tasks report.
    progress: Notify,
    cancel: CancellationToken,
    runners: Mutex<Vec<JoinHandle<()>>>,
    clock: SharedClock,
    heartbeat_interval: Duration,
    job_history: usize,
}

impl JobRunner {
    pub fn new(p: RunnerParams) -> Self {
        Self {
            jobs: Mutex::new(p.jobs),
            schedules: Mutex::new(p.schedules),
            store: p.store,
            metadata: p.metadata,
            cluster: p.cluster,
            task_ready: Notify::new(),
            progress: Notify::new(),
            cancel: p.cancel,
            runners: Mutex::new(Vec::new()),
            clock: p.clock,
            heartbeat_interval: p.heartbeat_interval,
            job_history: p.job_history,
        }
    }

    /// Stops every runner and waits for them to end.
    pub async fn shutdown(&self) {
        self.cancel.cancel();
        let runners = std::mem::take(&mut *lock(&self.runners));
        for runner in runners {
            runner.abort();
            let _ = runner.await;
        }
    }

    // ---- jobs, as users see them ----

    /// Checks a job's input: the path exists, the globs parse, there are enough workers.
    async fn check_load(&self, path: &str, s: &LoadSettings) -> Result<String, OpError> {
        Filter::new(&s.include, &s.exclude)?;
        let live = self.cluster.live_count();
        if !s.dry_run && !s.metadata_only && s.replicas as usize > live {
            return Err(OpError::TooManyReplicas { replicas: s.replicas, live });
        }
        let (r, _) = self.metadata.stat(path, s.sync).await?;
        Ok(r.path)
    }

    /// Creates, stores and starts a job.
    pub async fn submit(
        self: &Arc<Self>,
        path: &str,
        settings: LoadSettings,
        schedule_id: &str,
    ) -> Result<JobInfo, OpError> {
        let p = self.check_load(path, &settings).await?;
        let id = format!("job-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        let record = JobRecord {
            id: id.clone(),
            path: p,
            settings,
            created_ms: self.clock.wall_ms(),
            schedule_id: schedule_id.to_string(),
            ..Default::default()
        };
        // A scheduled job is stored with its schedule, advanced past this time, in one write.
        let schedule = match schedule_id {
            "" => None,
            s => lock(&self.schedules).set_last_job(s, &id),
        };
        match schedule {
            Some(schedule) => self.store.put_job_and_schedule(&record, &schedule)?,
            None => self.store.put_job(&record)?,
        }
        info!(job = %id, path = %record.path, schedule = %schedule_id, "load job submitted");
        metrics::counter!(m::JOBS_SUBMITTED).increment(1);
        lock(&self.jobs).insert(record);
        self.spawn_runner(id.clone(), Duration::ZERO);
        lock(&self.jobs).info(&id).ok_or(OpError::JobVanished)
    }

    pub fn info(&self, id: &str) -> Result<JobInfo, OpError> {
        lock(&self.jobs).info(id).ok_or_else(|| OpError::NoJob(id.to_string()))
    }

    /// Jobs, newest first: the running ones, or all with `finished`; at most `limit`.
    pub fn list(&self, finished: bool, limit: usize) -> Vec<JobInfo> {
        let jobs = lock(&self.jobs);
        jobs.ids()
            .into_iter()
            .filter(|id| finished || jobs.is_running(id))
            .filter_map(|id| jobs.info(&id))
            .take(limit)
            .collect()
    }

    pub fn cancel(&self, id: &str) -> Result<JobInfo, OpError> {
        let result = lock(&self.jobs).cancel(id, self.clock.wall_ms());
        result.map_err(|_| OpError::NoJob(id.to_string()))?;
        let record = lock(&self.jobs).take_dirty(id);
        if let Some(record) = record {
            self.store.put_job(&record)?;
            info!(job = %id, "load job cancelled");
        }
        self.progress.notify_waiters();
        self.info(id)
    }

    /// Drops finished jobs beyond `job_history`, in memory and in the store.
    pub fn prune_history(&self) {
        let gone = lock(&self.jobs).prune_finished(self.job_history);
        for id in gone {
            if let Err(e) = self.store.delete_job(&id) {
                // Forgotten in memory all the same; a restart prunes it again.
                warn!(job = %id, err = %e, "cannot delete an old job from the store");
            }
        }
    }

    // ---- the workers' side ----

    /// Keeps the job table's ring at the membership's epoch.
    fn sync_ring(&self) {
        let (epoch, members) = self.cluster.live();
        let mut jobs = lock(&self.jobs);
        if jobs.ring().epoch() == epoch {
            return;
        }
        jobs.set_ring(Ring::new(epoch, members, DEFAULT_VNODES), self.clock.now());
        drop(jobs);
        self.task_ready.notify_waiters();
    }

    /// Up to `max` tasks for `worker`, waiting up to `wait` (at most `MAX_TASK_WAIT`) for one.
    pub async fn fetch_tasks(&self, worker: &str, max: usize, wait: Duration) -> Vec<LoadTask> {
        // The poll itself waits on tokio's timer; only the lease decisions read the clock.
        let deadline = Instant::now() + wait.min(MAX_TASK_WAIT);
        self.sync_ring();
        loop {
            let notified = self.task_ready.notified();
            let tasks = lock(&self.jobs).fetch(worker, max.max(1), self.clock.now());
            let now = Instant::now();
            if !tasks.is_empty() || now >= deadline {
                metrics::counter!(m::LOAD_TASKS_ASSIGNED).increment(tasks.len() as u64);
                return tasks;
            }
            // Tasks backing off become ready without a wake-up: look again soon.
            let _ = tokio::time::timeout((deadline - now).min(Duration::from_millis(100)), notified).await;
        }
    }

    /// Outcomes from `worker`; returns the jobs still running (a worker drops fetched tasks of
    /// any other).
    pub fn report(&self, worker: &str, results: &[LoadTaskResult]) -> Vec<String> {
        let (touched, running) = {
            let mut jobs = lock(&self.jobs);
            let touched = jobs.report(worker, results, self.clock.now());
            (touched, jobs.running_ids())
        };
        if !touched.is_empty() {
            self.progress.notify_waiters();
        }
        running
    }

    // ---- runners ----

    /// Runs a job (new, or resumed after `delay`) in its own task until it ends or the master
    /// stops.
    pub fn spawn_runner(self: &Arc<Self>, id: String, delay: Duration) {
        let runner = self.clone();
        let cancel = self.cancel.clone();
        let handle = tokio::spawn(async move {
            if sleep_or_cancel(delay, &cancel).await {
                return;
            }
            // The job's own waits (for reports, for the listing) end with the master too.
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = runner.run_job(&id) => {}
            }
        });
        let mut runners = lock(&self.runners);
        runners.retain(|h| !h.is_finished());
        runners.push(handle);
    }

    /// Hands out the batches of small files job `id` is gathering.
    fn flush(&self, id: &str) {
        if lock(&self.jobs).flush_batches(id, self.clock.now()) {
            self.task_ready.notify_waiters();
        }
    }

    fn persist_job(&self, id: &str) {
        let record = lock(&self.jobs).take_dirty(id);
        if let Some(record) = record
            && let Err(e) = self.store.put_job(&record)
        {
            // The job goes on; a restart would resume it from an older cursor.
            warn!(job = %id, err = %e, "cannot store job progress");
        }
    }

    async fn run_job(&self, id: &str) {
        loop {
            let pass_result = self.list_pass(id).await;
            if let Err(reason) = pass_result {
                warn!(job = %id, %reason, "load job failed");
                lock(&self.jobs).fail(id, reason, self.clock.wall_ms());
                self.persist_job(id);
                self.finished(id);
                return;
            }
            lock(&self.jobs).listing_done(id, self.clock.now());
            self.task_ready.notify_waiters();
            loop {
                let notified = self.progress.notified();
                let end = lock(&self.jobs).end_of_pass(id, self.clock.wall_ms());
                self.persist_job(id);
                match end {
                    PassEnd::NotYet => {
                        let _ = tokio::time::timeout(PERSIST_EVERY, notified).await;
                    }
                    PassEnd::Verify => {
                        // Let the workers' block reports of the first pass reach the block map.
                        if sleep_or_cancel(self.heartbeat_interval * 3, &self.cancel).await {
                            return;
                        }
                        break;
                    }
                    PassEnd::Finished(_) => {
                        self.finished(id);
                        return;
                    }
                }
            }
        }
    }

    fn finished(&self, id: &str) {
        if let Some(info) = lock(&self.jobs).info(id) {
            let state = info.phase.label();
            let (files, failed) = (info.progress.files_done, info.progress.files_failed);
            info!(job = %id, state, files, failed, "load job ended");
            metrics::counter!(m::JOBS_FINISHED, "state" => state).increment(1);
        }
        self.prune_history();
        self.progress.notify_waiters();
    }

    /// One listing pass of a job, from its cursor; returns when everything is listed (or the
    /// job ended meanwhile). `Err` fails the job as a whole, with the reason to show.
    async fn list_pass(&self, id: &str) -> Result<(), String> {
        let Some(record) = lock(&self.jobs).record(id).cloned() else { return Ok(()) };
        let s = &record.settings;
        let filter = Filter::new(&s.include, &s.exclude).map_err(|e| e.to_string())?;
        let resolved = self.metadata.resolve(&record.path).map_err(|e| e.to_string())?;
        let (mount, root) = (resolved.mount, resolved.rel);
        let replicas = s.replicas.max(1) as usize;
        // Plan on the membership as it is now, not as the last tick saw it: a worker that
        // registered since would otherwise be missing, and its blocks loaded on the others.
        self.sync_ring();
        let mut listing = mount.ufs.list_recursive(&root, record.cursor.as_deref());
        // Pacing the store's writes is not a decision about the job: real time, like any wait.
        let mut last_persist = Instant::now();
        let mut last_flush = Instant::now();
        while let Some(item) = listing.next().await {
            let file = item.map_err(|e| format!("listing {}: {e}", record.path))?;
            let rel_to_job = match file.path.strip_prefix(root.as_str()) {
                Some(rest) if !rest.is_empty() => rest.trim_start_matches('/'),
                _ => file.path.rsplit('/').next().unwrap_or(&file.path),
            };
            if !filter.accepts(rel_to_job) {
                continue;
            }
            if !lock(&self.jobs).is_running(id) {
                return Ok(());
            }
            let strata_path = path::join(&mount.record.path, &file.path);
            let meta =
                self.metadata.listed_meta(&strata_path, file.meta, s.sync || s.metadata_only, &mount).await;
            let file_id =
                strata_common::block::file_identity(&mount.record.uri, &file.path, mount.block_size);
            let blocks = meta.size.div_ceil(mount.block_size);
            let mut loads = Vec::new();
            let mut skipped = 0;
            if !s.dry_run && !s.metadata_only {
                let check_cached = s.skip_cached || record.pass == 2;
                let held = if check_cached {
                    self.cluster.holders(&file_id, &meta.version)
                } else {
                    Default::default()
                };
                let jobs = lock(&self.jobs);
                for index in 0..blocks {
                    let hash = BlockKey::new(file_id.clone(), meta.version.clone(), index).placement_hash();
                    let owners = jobs.ring().owners(hash, replicas);
                    for r in 0..replicas {
                        let cached = owners.get(r).is_some_and(|o| {
                            held.get(&index).is_some_and(|h| h.iter().any(|(w, _)| *w == o.id))
                        });
                        if cached {
                            skipped += 1;
                        } else {
                            loads.push((index, hash, r));
                        }
                    }
                }
            }
            let has_loads = !loads.is_empty();
            let file_in = FileIn {
                path: strata_path,
                ufs_path: file.path,
                small: strata_common::block::is_small_file(meta.size, mount.block_size, mount.pack_threshold),
                version: meta.version,
                size: meta.size,
                block_size: mount.block_size,
                blocks,
                loads,
                skipped,
            };
            let before = lock(&self.jobs).task_count();
            lock(&self.jobs).add_file(id, file_in, self.clock.now());
            // Small files gather into batches: workers hear of a task when one is made, and
            // batches still gathering go out when the listing slows down or pauses.
            if has_loads && lock(&self.jobs).task_count() > before {
                self.task_ready.notify_waiters();
            }
            if last_flush.elapsed() >= FLUSH_EVERY {
                self.flush(id);
                last_flush = Instant::now();
            }
            loop {
                let notified = self.progress.notified();
                if last_persist.elapsed() >= PERSIST_EVERY {
                    self.persist_job(id);
                    last_persist = Instant::now();
                }
                if lock(&self.jobs).window_len(id) < WINDOW {
                    break;
                }
                // The window is full: what is gathering must go out, or nothing would drain it.
                self.flush(id);
                last_flush = Instant::now();
                let _ = tokio::time::timeout(PERSIST_EVERY, notified).await;
            }
        }
        Ok(())
    }

    // ---- the periodic tick and schedules ----

    /// Periodic work: expired leases, membership changes, due schedules.
    pub async fn tick(self: &Arc<Self>) {
        self.sync_ring();
        if lock(&self.jobs).tick(self.clock.now()) {
            self.task_ready.notify_waiters();
        }
        let now = self.clock.wall_ms();
        let (fires, changed) = {
            let jobs = lock(&self.jobs);
            lock(&self.schedules).due(now, |job| jobs.is_running(job))
        };
        // A fired time is stored in one write with the job it created (`submit`): with several
        // masters either that write landed (the next leader sees the schedule advanced and the
        // job) or it did not (the next leader fires the time) — once, never twice. A time that
        // fires nothing (skipped, or the job refused) is stored alone.
        for record in changed.iter().filter(|r| !fires.iter().any(|f| f.schedule_id == r.id)) {
            if let Err(e) = self.store.put_schedule(record) {
                warn!(schedule = %record.id, err = %e, "cannot store schedule");
            }
        }
        for fire in fires {
            if let Err(e) = self.submit(&fire.path, fire.settings, &fire.schedule_id).await {
                warn!(schedule = %fire.schedule_id, err = %e, "scheduled load job not submitted");
                if matches!(e, OpError::Store(_)) {
                    continue;
                }
                let record = changed.iter().find(|r| r.id == fire.schedule_id);
                if let Some(record) = record
                    && let Err(e) = self.store.put_schedule(record)
                {
                    warn!(schedule = %record.id, err = %e, "cannot store schedule");
                }
            }
        }
    }

    /// Validates, stores and arms a schedule.
    pub async fn add_schedule(
        &self,
        cron: &str,
        tz: &str,
        path: &str,
        settings: LoadSettings,
    ) -> Result<ScheduleRecord, OpError> {
        schedule::parse(cron, tz)?;
        let p = self.check_load(path, &settings).await?;
        let record = ScheduleRecord {
            id: format!("sched-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]),
            cron: cron.to_string(),
            tz: if tz.is_empty() { "UTC".to_string() } else { tz.to_string() },
            path: p,
            settings,
            next_fire_ms: 0,
            last_job_id: String::new(),
            fired: 0,
            skipped: 0,
            created_ms: self.clock.wall_ms(),
        };
        let mut schedules = lock(&self.schedules);
        let stored = schedules.insert(record, self.clock.wall_ms())?.clone();
        if let Err(e) = self.store.put_schedule(&stored) {
            schedules.remove(&stored.id);
            return Err(e.into());
        }
        info!(schedule = %stored.id, cron = %stored.cron, tz = %stored.tz, path = %stored.path, "schedule added");
        Ok(stored)
    }

    pub fn schedules(&self) -> Vec<ScheduleRecord> {
        lock(&self.schedules).records().cloned().collect()
    }

    pub fn remove_schedule(&self, id: &str) -> Result<(), OpError> {
        let mut schedules = lock(&self.schedules);
        if schedules.get(id).is_none() {
            return Err(OpError::NoSchedule(id.to_string()));
        }
        self.store.delete_schedule(id)?;
        schedules.remove(id);
        info!(schedule = %id, "schedule removed");
        Ok(())
    }
}
