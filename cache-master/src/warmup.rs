//! The I/O around the load-job state machine (`jobs.rs`) and the schedules (`schedule.rs`):
//! one runner task per running job streams the UFS listing into the job table, waits for the
//! workers to drain it, and stores progress; the gRPC handlers validate input and adapt.
//!
//! Memory stays bounded whatever the tree's size: the listing is a stream, and a runner stops
//! pulling from it while `WINDOW` files of its job are in flight.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use globset::{GlobSet, GlobSetBuilder};
use strata_common::ring::DEFAULT_VNODES;
use strata_common::{BlockKey, ErrorKind, Member, Ring, block, path};
use strata_ufs::ObjectMeta;
use tonic::Status;
use tracing::{info, warn};

use crate::jobs::{FileIn, JobInfo, JobRecord, LoadSettings, PassEnd};
use crate::metrics_defs as m;
use crate::schedule::{self, ScheduleRecord};
use crate::service::{CachedStat, State, err, lock, now_ms};

/// Files of one job in flight at most (listed, not yet finished).
const WINDOW: usize = 4096;
/// How often a runner stores progress while files finish.
const PERSIST_EVERY: Duration = Duration::from_millis(500);

/// Include/exclude globs. A pattern without `/` matches the file name at any depth; one with
/// `/` matches the path relative to the job's path (`**` spans directories).
pub(crate) struct Filter {
    include_names: GlobSet,
    include_paths: GlobSet,
    exclude_names: GlobSet,
    exclude_paths: GlobSet,
    any_include: bool,
}

impl Filter {
    pub(crate) fn new(include: &[String], exclude: &[String]) -> Result<Self, String> {
        let build = |patterns: &[String], with_slash: bool| -> Result<GlobSet, String> {
            let mut b = GlobSetBuilder::new();
            for p in patterns.iter().filter(|p| p.contains('/') == with_slash) {
                let glob = globset::GlobBuilder::new(p.trim_start_matches('/'))
                    .literal_separator(true)
                    .build()
                    .map_err(|e| format!("bad glob {p:?}: {e}"))?;
                b.add(glob);
            }
            b.build().map_err(|e| e.to_string())
        };
        Ok(Self {
            include_names: build(include, false)?,
            include_paths: build(include, true)?,
            exclude_names: build(exclude, false)?,
            exclude_paths: build(exclude, true)?,
            any_include: !include.is_empty(),
        })
    }

    pub(crate) fn accepts(&self, rel: &str) -> bool {
        let name = rel.rsplit('/').next().unwrap_or(rel);
        let hit = |names: &GlobSet, paths: &GlobSet| names.is_match(name) || paths.is_match(rel);
        (!self.any_include || hit(&self.include_names, &self.include_paths))
            && !hit(&self.exclude_names, &self.exclude_paths)
    }
}

impl State {
    /// Keeps the job table's ring at the membership's epoch.
    pub(crate) fn sync_ring(&self) {
        let (epoch, members) = {
            let mem = lock(&self.membership);
            (mem.epoch(), mem.live_members())
        };
        let mut jobs = lock(&self.jobs);
        if jobs.ring().epoch() == epoch {
            return;
        }
        let members = members.into_iter().map(|w| Member { id: w.id, data_addr: w.data_addr }).collect();
        jobs.set_ring(Ring::new(epoch, members, DEFAULT_VNODES), Instant::now());
        drop(jobs);
        self.task_ready.notify_waiters();
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

    /// Checks a job's input: the path exists, the globs parse, there are enough workers.
    async fn check_load(&self, rpc: &'static str, path: &str, s: &LoadSettings) -> Result<String, Status> {
        Filter::new(&s.include, &s.exclude).map_err(|e| err(rpc, ErrorKind::InvalidArgument, e))?;
        let live = lock(&self.membership).live_members().len();
        if !s.dry_run && !s.metadata_only && s.replicas as usize > live {
            return Err(err(
                rpc,
                ErrorKind::InvalidArgument,
                format!("--replicas {} asks for more workers than the {live} live ones", s.replicas),
            ));
        }
        let (p, _, _, _) = self.stat_path(rpc, path, s.sync).await?;
        Ok(p)
    }

    /// Creates, stores and starts a job.
    pub(crate) async fn submit(
        self: &Arc<Self>,
        rpc: &'static str,
        path: &str,
        settings: LoadSettings,
        schedule_id: &str,
    ) -> Result<JobInfo, Status> {
        let p = self.check_load(rpc, path, &settings).await?;
        let id = format!("job-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        let record = JobRecord {
            id: id.clone(),
            path: p,
            settings,
            created_ms: now_ms(),
            schedule_id: schedule_id.to_string(),
            ..Default::default()
        };
        self.store.put_job(&record).map_err(|e| err(rpc, ErrorKind::Internal, e.to_string()))?;
        info!(job = %id, path = %record.path, schedule = %schedule_id, "load job submitted");
        metrics::counter!(m::JOBS_SUBMITTED).increment(1);
        lock(&self.jobs).insert(record);
        self.spawn_runner(id.clone(), Duration::ZERO);
        lock(&self.jobs).info(&id).ok_or_else(|| err(rpc, ErrorKind::Internal, "job vanished"))
    }

    pub(crate) fn spawn_runner(self: &Arc<Self>, id: String, delay: Duration) {
        let st = self.clone();
        let cancel = self.jobs_cancel.clone();
        let handle = tokio::spawn(async move {
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = async {
                    tokio::time::sleep(delay).await;
                    st.run_job(&id).await;
                } => {}
            }
        });
        let mut runners = lock(&self.runners);
        runners.retain(|h| !h.is_finished());
        runners.push(handle);
    }

    async fn run_job(self: &Arc<Self>, id: &str) {
        loop {
            let pass_result = self.list_pass(id).await;
            if let Err(reason) = pass_result {
                warn!(job = %id, %reason, "load job failed");
                lock(&self.jobs).fail(id, reason, now_ms());
                self.persist_job(id);
                self.finished(id);
                return;
            }
            lock(&self.jobs).listing_done(id);
            loop {
                let notified = self.progress.notified();
                let end = lock(&self.jobs).end_of_pass(id, now_ms());
                self.persist_job(id);
                match end {
                    PassEnd::NotYet => {
                        let _ = tokio::time::timeout(PERSIST_EVERY, notified).await;
                    }
                    PassEnd::Verify => {
                        // Let the workers' block reports of the first pass reach the block map.
                        let beat = Duration::from_millis(self.config.heartbeat_interval_ms);
                        tokio::time::sleep(beat * 3).await;
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

    /// Drops finished jobs beyond `job_history`, in memory and in the store.
    pub(crate) fn prune_history(&self) {
        let gone = lock(&self.jobs).prune_finished(self.config.job_history);
        for id in gone {
            if let Err(e) = self.store.delete_job(&id) {
                // Forgotten in memory all the same; a restart prunes it again.
                warn!(job = %id, err = %e, "cannot delete an old job from the store");
            }
        }
    }

    /// One listing pass of a job, from its cursor; returns when everything is listed (or the
    /// job ended meanwhile). `Err` fails the job as a whole.
    async fn list_pass(self: &Arc<Self>, id: &str) -> Result<(), String> {
        let Some(record) = lock(&self.jobs).record(id).cloned() else { return Ok(()) };
        let s = &record.settings;
        let filter = Filter::new(&s.include, &s.exclude)?;
        let (_, mount, root) =
            self.resolve("submit_load", &record.path).map_err(|e| e.message().to_string())?;
        let replicas = s.replicas.max(1) as usize;
        let mut listing = mount.ufs.list_recursive(&root, record.cursor.as_deref());
        let mut last_persist = Instant::now();
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
            let meta = self
                .listed_meta(&strata_path, file.meta, s.sync || s.metadata_only, mount.metadata_ttl)
                .await;
            let file_id = block::file_identity(&mount.record.uri, &file.path, mount.block_size);
            let blocks = meta.size.div_ceil(mount.block_size);
            let mut loads = Vec::new();
            let mut skipped = 0;
            if !s.dry_run && !s.metadata_only {
                let check_cached = s.skip_cached || record.pass == 2;
                let held = if check_cached {
                    lock(&self.blocks).locations(&file_id, &meta.version)
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
                version: meta.version,
                size: meta.size,
                block_size: mount.block_size,
                blocks,
                loads,
                skipped,
            };
            lock(&self.jobs).add_file(id, file_in, Instant::now());
            if has_loads {
                self.task_ready.notify_waiters();
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
                let _ = tokio::time::timeout(PERSIST_EVERY, notified).await;
            }
        }
        Ok(())
    }

    /// The metadata a job loads a listed file at: what clients will be told by `stat`. A fresh
    /// cached stat wins over the listing (clients read that version until the TTL ends); with
    /// `refresh`, or without one, the listing's metadata becomes the cached stat.
    async fn listed_meta(
        &self,
        strata_path: &str,
        listed: ObjectMeta,
        refresh: bool,
        ttl: Duration,
    ) -> ObjectMeta {
        if !refresh
            && let Some(hit) = self.stats.get(strata_path).await
            && hit.at.elapsed() < ttl
        {
            return hit.meta.clone();
        }
        if !ttl.is_zero() {
            self.stats
                .insert(
                    strata_path.to_string(),
                    Arc::new(CachedStat { at: Instant::now(), meta: listed.clone() }),
                )
                .await;
        }
        listed
    }

    /// Periodic work: expired leases, membership changes, due schedules.
    pub(crate) async fn jobs_tick(self: &Arc<Self>) {
        self.sync_ring();
        if lock(&self.jobs).tick(Instant::now()) {
            self.task_ready.notify_waiters();
        }
        let now = now_ms();
        let (fires, changed) = {
            let jobs = lock(&self.jobs);
            lock(&self.schedules).due(now, |job| jobs.is_running(job))
        };
        for record in changed {
            if let Err(e) = self.store.put_schedule(&record) {
                warn!(schedule = %record.id, err = %e, "cannot store schedule");
            }
        }
        for fire in fires {
            match self.submit("schedule", &fire.path, fire.settings, &fire.schedule_id).await {
                Ok(job) => {
                    let record = lock(&self.schedules).set_last_job(&fire.schedule_id, &job.id);
                    if let Some(record) = record
                        && let Err(e) = self.store.put_schedule(&record)
                    {
                        warn!(schedule = %record.id, err = %e, "cannot store schedule");
                    }
                }
                Err(status) => {
                    warn!(schedule = %fire.schedule_id, err = %status.message(), "scheduled load job not submitted")
                }
            }
        }
    }

    pub(crate) async fn add_schedule(
        &self,
        rpc: &'static str,
        cron: &str,
        tz: &str,
        path: &str,
        settings: LoadSettings,
    ) -> Result<ScheduleRecord, Status> {
        schedule::parse(cron, tz).map_err(|e| err(rpc, ErrorKind::InvalidArgument, e.to_string()))?;
        let p = self.check_load(rpc, path, &settings).await?;
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
            created_ms: now_ms(),
        };
        let mut schedules = lock(&self.schedules);
        let stored = schedules
            .insert(record, now_ms())
            .map_err(|e| err(rpc, ErrorKind::InvalidArgument, e.to_string()))?
            .clone();
        if let Err(e) = self.store.put_schedule(&stored) {
            schedules.remove(&stored.id);
            return Err(err(rpc, ErrorKind::Internal, e.to_string()));
        }
        info!(schedule = %stored.id, cron = %stored.cron, tz = %stored.tz, path = %stored.path, "schedule added");
        Ok(stored)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_names_anywhere_and_paths_from_the_job_root() {
        let f = Filter::new(&["*.bin".into()], &["skip/**".into()]).unwrap();
        assert!(f.accepts("a.bin"));
        assert!(f.accepts("deep/dir/a.bin"));
        assert!(!f.accepts("a.txt"));
        assert!(!f.accepts("skip/x/a.bin"));
        let all = Filter::new(&[], &["*.tmp".into()]).unwrap();
        assert!(all.accepts("x/y"));
        assert!(!all.accepts("x/y.tmp"));
        assert!(Filter::new(&["a[".into()], &[]).err().is_some_and(|e| e.contains("bad glob")));
    }
}
