//! Load jobs (warmup) as a state machine without I/O: files come in from the job's listing,
//! become block tasks for the workers that own the blocks on the ring, and leave when every
//! task has reported. Time is an input (`now`), so tests drive leases and retry backoff.
//!
//! Invariants:
//! - a task targets the `replica`-th of the first `replicas` owners of its block on the
//!   current ring: the worker a client read goes to. When the ring changes, queued tasks are
//!   retargeted and tasks leased to a worker that left are queued again for the new owner;
//! - only the worker a task is leased to can complete it (a late report from a worker the task
//!   was taken from is ignored);
//! - a small file (one block, under its mount's `pack_threshold`) is not a task of its own: its
//!   load joins a batch for the same owner and replica, which becomes one task when it holds
//!   [`BATCH_FILES`] files or [`BATCH_BYTES`], or when the runner flushes (the listing paused or
//!   ended), so a worker fetches, stores (one packed append) and reports many small files at
//!   once. A batch's outcome is per file: the files that failed temporarily are retried as a
//!   smaller batch, the others finish. When the ring changes, a batch whose files now belong to
//!   several owners is split;
//! - progress is durable at a *prefix*: files are numbered in listing order (which is
//!   deterministic, see `strata_ufs::Ufs::list_recursive`) and the record's `cursor` is the last path
//!   such that it and every file before it have finished. A resumed job lists again after the
//!   cursor; the files it had in flight are loaded again (cheaply: the workers already hold
//!   their blocks), and none is counted twice.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::mem;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use strata_common::Ring;

/// Attempts of one block load before its file is failed.
pub const MAX_ATTEMPTS: u32 = 5;
/// A worker that took a task and did not report within this long loses it.
pub const LEASE: Duration = Duration::from_secs(60);
/// Failed files kept (with reasons) per job; the count goes on beyond.
pub const MAX_FAILURES_KEPT: usize = 1000;
/// Longest failure reason kept, so a job's failure list stays a bounded message (1,000 of them
/// fit in about 1 MiB).
pub const MAX_REASON_BYTES: usize = 1024;
/// Small files a batch task carries at most.
pub const BATCH_FILES: usize = 64;
/// Bytes of small files a batch task carries at most (it is full at the file that reaches it).
pub const BATCH_BYTES: u64 = 8 << 20;

/// `reason`, cut at a character boundary to [`MAX_REASON_BYTES`].
fn kept_reason(mut reason: String) -> String {
    if reason.len() > MAX_REASON_BYTES {
        let mut cut = MAX_REASON_BYTES - '…'.len_utf8();
        while !reason.is_char_boundary(cut) {
            cut -= 1;
        }
        reason.truncate(cut);
        reason.push('…');
    }
    reason
}

/// The job's options, as stored.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct LoadSettings {
    pub replicas: u32,
    pub bandwidth: u64,
    pub parallelism: u32,
    pub include: Vec<String>,
    pub exclude: Vec<String>,
    pub skip_cached: bool,
    pub verify: bool,
    pub sync: bool,
    pub dry_run: bool,
    pub metadata_only: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl Phase {
    pub fn is_final(self) -> bool {
        !matches!(self, Phase::Running)
    }

    /// The phase as the `state` label of `JOBS_FINISHED` and in logs: the protobuf enum's
    /// names, so dashboards read the same values as `strata job status --json`.
    pub fn label(self) -> &'static str {
        match self {
            Phase::Running => "JOB_STATE_RUNNING",
            Phase::Succeeded => "JOB_STATE_SUCCEEDED",
            Phase::Failed => "JOB_STATE_FAILED",
            Phase::Cancelled => "JOB_STATE_CANCELLED",
        }
    }
}

/// Counters of a set of files.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Progress {
    pub files_total: u64,
    pub files_done: u64,
    pub bytes_total: u64,
    pub bytes_done: u64,
    pub blocks_total: u64,
    pub blocks_done: u64,
    pub blocks_already_cached: u64,
    pub blocks_verify_loaded: u64,
    pub files_failed: u64,
    pub task_retries: u64,
}

impl Progress {
    fn add(&mut self, o: &Progress) {
        self.files_total += o.files_total;
        self.files_done += o.files_done;
        self.bytes_total += o.bytes_total;
        self.bytes_done += o.bytes_done;
        self.blocks_total += o.blocks_total;
        self.blocks_done += o.blocks_done;
        self.blocks_already_cached += o.blocks_already_cached;
        self.blocks_verify_loaded += o.blocks_verify_loaded;
        self.files_failed += o.files_failed;
        self.task_retries += o.task_retries;
    }
}

/// What the store keeps of a job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct JobRecord {
    pub id: String,
    pub path: String,
    pub settings: LoadSettings,
    pub phase: Phase,
    /// 1 = loading, 2 = verifying.
    pub pass: u32,
    /// Last path (relative to the UFS root) of the finished prefix of this pass's listing.
    pub cursor: Option<String>,
    /// Progress of every finished file (all passes, up to the cursor).
    pub done: Progress,
    pub failures: Vec<(String, String)>,
    /// Why the job as a whole failed (unknown path, vanished mount), if it did.
    pub error: Option<String>,
    pub created_ms: i64,
    pub finished_ms: i64,
    pub schedule_id: String,
    pub resumed: u32,
}

impl Default for JobRecord {
    fn default() -> Self {
        Self {
            id: String::new(),
            path: String::new(),
            settings: LoadSettings::default(),
            phase: Phase::Running,
            pass: 1,
            cursor: None,
            done: Progress::default(),
            failures: Vec::new(),
            error: None,
            created_ms: 0,
            finished_ms: 0,
            schedule_id: String::new(),
            resumed: 0,
        }
    }
}

/// One listed file entering a job, with its block tasks already split.
#[derive(Debug, Clone)]
pub struct FileIn {
    /// Strata path (what workers resolve).
    pub path: String,
    /// Path relative to the UFS root, in listing order.
    pub ufs_path: String,
    pub version: String,
    pub size: u64,
    pub block_size: u64,
    /// Blocks of this file that exist (for the totals).
    pub blocks: u64,
    /// (block index, placement hash, replica rank) for every load to do.
    pub loads: Vec<(u64, u64, usize)>,
    /// Loads not needed: the block map says the target already holds the block.
    pub skipped: u64,
    /// A small file (one block under its mount's `pack_threshold`): its loads join batches.
    pub small: bool,
}

/// A block load handed to a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadTask {
    pub task_id: u64,
    pub job_id: String,
    pub path: String,
    pub version: String,
    pub file_size: u64,
    pub block_size: u64,
    pub index: u64,
    /// The job's per-worker bandwidth cap, bytes per second; 0 = none.
    pub bandwidth: u64,
    /// The job's loads in flight per worker; 0 = the worker's default.
    pub parallelism: u32,
    /// A batch of small files (each its whole block 0); `path`, `version`, `file_size` and
    /// `index` are then unused.
    pub files: Vec<SmallFileLoad>,
}

/// One small file of a batch [`LoadTask`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SmallFileLoad {
    pub path: String,
    pub version: String,
    pub size: u64,
}

/// What became of one file of a batch task.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FileOutcome {
    pub ok: bool,
    pub already_cached: bool,
    pub error: String,
    pub temporary: bool,
}

/// A worker's outcome of one [`LoadTask`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadTaskResult {
    pub task_id: u64,
    pub job_id: String,
    pub ok: bool,
    /// The worker held the block already.
    pub already_cached: bool,
    pub error: String,
    /// The failure may go away: try again after a backoff.
    pub temporary: bool,
    /// A batch task's outcome per file, in its order (`ok`: every file loaded). Empty: the
    /// whole task had the outcome above.
    pub files: Vec<FileOutcome>,
}

/// A file that failed, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileFailure {
    pub path: String,
    pub reason: String,
}

/// A job as shown to users: its record with live progress (finished files and those in
/// flight).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobInfo {
    pub id: String,
    pub path: String,
    pub settings: LoadSettings,
    pub phase: Phase,
    pub pass: u32,
    pub listing_done: bool,
    pub progress: Progress,
    /// The job's own error first (if any), then failed files.
    pub failures: Vec<FileFailure>,
    pub created_ms: i64,
    pub finished_ms: i64,
    pub schedule_id: String,
    pub resumed: u32,
}

#[derive(Debug)]
struct FileState {
    ufs_path: String,
    path: String,
    size: u64,
    blocks_left: usize,
    failure: Option<String>,
    progress: Progress,
}

/// A small file waiting in, or carried by, a batch task.
#[derive(Debug, Clone)]
struct BatchFile {
    seq: u64,
    path: String,
    version: String,
    size: u64,
    hash: u64,
}

/// Small files gathering for one (job, replica, target) until they make a batch task.
#[derive(Debug, Default)]
struct Gathering {
    files: Vec<BatchFile>,
    bytes: u64,
    block_size: u64,
    replicas: usize,
}

#[derive(Debug, Clone)]
struct Task {
    job: String,
    seq: u64,
    path: String,
    version: String,
    file_size: u64,
    block_size: u64,
    index: u64,
    hash: u64,
    replica: usize,
    replicas: usize,
    target: Option<String>,
    leased_until: Option<Instant>,
    not_before: Instant,
    attempts: u32,
    /// A batch of small files (the fields above that name one block are unused then).
    files: Vec<BatchFile>,
}

#[derive(Debug)]
struct Job {
    record: JobRecord,
    /// Files of the current pass not yet in the prefix, by listing number.
    window: BTreeMap<u64, FileState>,
    next_seq: u64,
    listing_done: bool,
    /// The record changed since it was last taken for the store.
    dirty: bool,
}

impl Job {
    fn live_progress(&self) -> Progress {
        let mut p = self.record.done;
        for f in self.window.values() {
            p.add(&f.progress);
        }
        p
    }

    /// Moves finished files at the head of the window into the durable prefix.
    fn commit(&mut self) {
        while let Some(entry) = self.window.first_entry() {
            if entry.get().blocks_left > 0 {
                break;
            }
            let f = entry.remove();
            self.record.done.add(&f.progress);
            if let Some(reason) = f.failure
                && self.record.failures.len() < MAX_FAILURES_KEPT
            {
                self.record.failures.push((f.path, kept_reason(reason)));
            }
            self.record.cursor = Some(f.ufs_path);
            self.dirty = true;
        }
    }
}

/// What became of a job's listing pass once its window drained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PassEnd {
    /// Still listing, or files in flight.
    NotYet,
    /// The verify pass starts: list again from the beginning.
    Verify,
    /// The job reached a final phase.
    Finished(Phase),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobsError {
    NotFound(String),
}

#[derive(Debug)]
pub struct Jobs {
    jobs: BTreeMap<String, Job>,
    tasks: HashMap<u64, Task>,
    /// Queued (not leased) tasks per target worker.
    queues: HashMap<String, VecDeque<u64>>,
    /// Small files not yet in a batch task, by (job, replica, target).
    gathering: BTreeMap<(String, usize, Option<String>), Gathering>,
    ring: Ring,
    next_task: u64,
}

impl Jobs {
    /// `task_id_base` keeps task ids of a restarted master apart from the old one's, so a late
    /// report of an old task can never complete a new one.
    pub fn new(task_id_base: u64) -> Self {
        Self {
            jobs: BTreeMap::new(),
            tasks: HashMap::new(),
            queues: HashMap::new(),
            gathering: BTreeMap::new(),
            ring: Ring::default(),
            next_task: task_id_base,
        }
    }

    pub fn ring(&self) -> &Ring {
        &self.ring
    }

    /// Adds a job (new, or loaded from the store to resume).
    pub fn insert(&mut self, record: JobRecord) {
        let id = record.id.clone();
        self.jobs.insert(
            id,
            Job { record, window: BTreeMap::new(), next_seq: 0, listing_done: false, dirty: false },
        );
    }

    pub fn record(&self, id: &str) -> Option<&JobRecord> {
        self.jobs.get(id).map(|j| &j.record)
    }

    pub fn is_running(&self, id: &str) -> bool {
        self.jobs.get(id).is_some_and(|j| !j.record.phase.is_final())
    }

    /// Tasks in the table (queued or leased).
    pub fn task_count(&self) -> usize {
        self.tasks.len()
    }

    /// Files of the job in flight (listed, not yet in the prefix).
    pub fn window_len(&self, id: &str) -> usize {
        self.jobs.get(id).map_or(0, |j| j.window.len())
    }

    /// The record to store, if it changed since the last call.
    pub fn take_dirty(&mut self, id: &str) -> Option<JobRecord> {
        let job = self.jobs.get_mut(id)?;
        if !job.dirty {
            return None;
        }
        job.dirty = false;
        Some(job.record.clone())
    }

    /// A file of the current pass that was listed: its tasks are queued for their owners.
    pub fn add_file(&mut self, id: &str, file: FileIn, now: Instant) {
        let Some(job) = self.jobs.get_mut(id) else { return };
        if job.record.phase.is_final() {
            return;
        }
        let seq = job.next_seq;
        job.next_seq += 1;
        let first_pass = job.record.pass == 1;
        let mut progress = Progress::default();
        if first_pass {
            progress.files_total = 1;
            progress.bytes_total = file.size;
            progress.blocks_total = file.blocks * job.record.settings.replicas.max(1) as u64;
            progress.blocks_done = file.skipped;
        }
        progress.blocks_already_cached = file.skipped;
        let replicas = job.record.settings.replicas.max(1) as usize;
        let mut state = FileState {
            ufs_path: file.ufs_path,
            path: file.path.clone(),
            size: file.size,
            blocks_left: file.loads.len(),
            failure: None,
            progress,
        };
        if file.loads.is_empty() {
            Self::file_finished(&mut state, first_pass);
        }
        job.window.insert(seq, state);
        for (index, hash, replica) in file.loads {
            if file.small && index == 0 {
                let small = BatchFile {
                    seq,
                    path: file.path.clone(),
                    version: file.version.clone(),
                    size: file.size,
                    hash,
                };
                self.gather(id, small, replica, replicas, file.block_size, now);
                continue;
            }
            let task_id = self.next_task;
            self.next_task += 1;
            let target = target_of(&self.ring, hash, replicas, replica);
            if let Some(t) = &target {
                self.queues.entry(t.clone()).or_default().push_back(task_id);
            }
            self.tasks.insert(
                task_id,
                Task {
                    job: id.to_string(),
                    seq,
                    path: file.path.clone(),
                    version: file.version.clone(),
                    file_size: file.size,
                    block_size: file.block_size,
                    index,
                    hash,
                    replica,
                    replicas,
                    target,
                    leased_until: None,
                    not_before: now,
                    attempts: 0,
                    files: Vec::new(),
                },
            );
        }
        if let Some(job) = self.jobs.get_mut(id) {
            job.commit();
        }
        self.fail_unplaceable();
    }

    /// A small file's load joins the batch gathering for its owner; a full batch becomes a task.
    fn gather(
        &mut self,
        job: &str,
        file: BatchFile,
        replica: usize,
        replicas: usize,
        block_size: u64,
        now: Instant,
    ) {
        let target = target_of(&self.ring, file.hash, replicas, replica);
        let key = (job.to_string(), replica, target);
        let g = self.gathering.entry(key.clone()).or_default();
        g.bytes += file.size;
        g.block_size = block_size;
        g.replicas = replicas;
        g.files.push(file);
        if g.files.len() >= BATCH_FILES || g.bytes >= BATCH_BYTES {
            let g = self.gathering.remove(&key).expect("just filled");
            self.batch_task(&key.0, key.1, key.2, g, 0, now);
        }
    }

    /// Turns every gathering batch of job `id` into a task (the listing paused or ended);
    /// returns whether any was made.
    pub fn flush_batches(&mut self, id: &str, now: Instant) -> bool {
        let keys: Vec<_> = self.gathering.keys().filter(|(job, _, _)| job == id).cloned().collect();
        for key in &keys {
            let g = self.gathering.remove(key).expect("listed above");
            self.batch_task(&key.0, key.1, key.2.clone(), g, 0, now);
        }
        if !keys.is_empty() {
            self.fail_unplaceable();
        }
        !keys.is_empty()
    }

    /// Queues one batch task for `target` (none: no worker can take it; `fail_unplaceable`
    /// fails it).
    fn batch_task(
        &mut self,
        job: &str,
        replica: usize,
        target: Option<String>,
        g: Gathering,
        attempts: u32,
        not_before: Instant,
    ) {
        let task_id = self.next_task;
        self.next_task += 1;
        if let Some(t) = &target {
            self.queues.entry(t.clone()).or_default().push_back(task_id);
        }
        let first = g.files.first().cloned();
        self.tasks.insert(
            task_id,
            Task {
                job: job.to_string(),
                seq: first.as_ref().map_or(0, |f| f.seq),
                path: first.as_ref().map_or_else(String::new, |f| f.path.clone()),
                version: String::new(),
                file_size: 0,
                block_size: g.block_size,
                index: 0,
                hash: first.as_ref().map_or(0, |f| f.hash),
                replica,
                replicas: g.replicas,
                target,
                leased_until: None,
                not_before,
                attempts,
                files: g.files,
            },
        );
    }

    fn file_finished(f: &mut FileState, first_pass: bool) {
        if f.failure.is_some() {
            f.progress.files_failed += 1;
        } else if first_pass {
            f.progress.files_done += 1;
            f.progress.bytes_done += f.size;
        }
    }

    /// Up to `max` ready tasks for `worker`, leased to it until `now + LEASE`.
    pub fn fetch(&mut self, worker: &str, max: usize, now: Instant) -> Vec<LoadTask> {
        let Some(queue) = self.queues.get_mut(worker) else { return Vec::new() };
        let mut out = Vec::new();
        let mut deferred = VecDeque::new();
        while out.len() < max {
            let Some(task_id) = queue.pop_front() else { break };
            let Some(task) = self.tasks.get_mut(&task_id) else { continue };
            if task.not_before > now {
                deferred.push_back(task_id);
                continue;
            }
            task.leased_until = Some(now + LEASE);
            let settings = &self.jobs.get(&task.job).map(|j| j.record.settings.clone()).unwrap_or_default();
            out.push(LoadTask {
                task_id,
                job_id: task.job.clone(),
                path: task.path.clone(),
                version: task.version.clone(),
                file_size: task.file_size,
                block_size: task.block_size,
                index: task.index,
                bandwidth: settings.bandwidth,
                parallelism: settings.parallelism,
                files: task
                    .files
                    .iter()
                    .map(|f| SmallFileLoad { path: f.path.clone(), version: f.version.clone(), size: f.size })
                    .collect(),
            });
        }
        while let Some(t) = deferred.pop_back() {
            queue.push_front(t);
        }
        out
    }

    /// Outcomes from `worker`. Returns the jobs whose windows changed.
    pub fn report(&mut self, worker: &str, results: &[LoadTaskResult], now: Instant) -> Vec<String> {
        let mut touched = Vec::new();
        for r in results {
            let Some(task) = self.tasks.get(&r.task_id) else { continue };
            if task.target.as_deref() != Some(worker) || task.leased_until.is_none() || task.job != r.job_id {
                continue;
            }
            let Some(job) = self.jobs.get_mut(&task.job) else {
                self.tasks.remove(&r.task_id);
                continue;
            };
            if !task.files.is_empty() {
                let job_id = task.job.clone();
                self.report_batch(r, now);
                if !touched.contains(&job_id) {
                    touched.push(job_id);
                }
                continue;
            }
            if !r.ok && r.temporary && task.attempts + 1 < MAX_ATTEMPTS {
                let task = self.tasks.get_mut(&r.task_id).expect("looked up above");
                task.attempts += 1;
                task.leased_until = None;
                task.not_before = now + backoff(task.attempts);
                self.queues.entry(worker.to_string()).or_default().push_back(r.task_id);
                if let Some(f) = job.window.get_mut(&task.seq) {
                    f.progress.task_retries += 1;
                }
                continue;
            }
            if let Some(job) = self.finish_task(r.task_id, r.ok, r.already_cached, &r.error)
                && !touched.contains(&job)
            {
                touched.push(job);
            }
        }
        touched
    }

    /// A batch task's outcome (the worker it was leased to is checked already): files that
    /// loaded or failed for good finish; those that failed temporarily go back as a smaller
    /// batch after a backoff, until their attempts run out.
    fn report_batch(&mut self, r: &LoadTaskResult, now: Instant) {
        let Some(task) = self.tasks.remove(&r.task_id) else { return };
        let whole = FileOutcome {
            ok: r.ok,
            already_cached: r.already_cached,
            error: r.error.clone(),
            temporary: r.temporary,
        };
        let mut retry = Vec::new();
        for (i, f) in task.files.iter().enumerate() {
            let outcome = if r.files.len() == task.files.len() { &r.files[i] } else { &whole };
            if !outcome.ok && outcome.temporary && task.attempts + 1 < MAX_ATTEMPTS {
                if let Some(state) = self.jobs.get_mut(&task.job).and_then(|j| j.window.get_mut(&f.seq)) {
                    state.progress.task_retries += 1;
                }
                retry.push(f.clone());
                continue;
            }
            self.finish_load(&task.job, f.seq, 0, outcome.ok, outcome.already_cached, &outcome.error);
        }
        if !retry.is_empty() {
            let attempts = task.attempts + 1;
            let g = Gathering {
                bytes: retry.iter().map(|f| f.size).sum(),
                files: retry,
                block_size: task.block_size,
                replicas: task.replicas,
            };
            self.batch_task(
                &task.job,
                task.replica,
                task.target.clone(),
                g,
                attempts,
                now + backoff(attempts),
            );
        }
        if let Some(job) = self.jobs.get_mut(&task.job) {
            job.commit();
        }
    }

    /// Removes a task with its outcome and advances its file; returns its job.
    fn finish_task(&mut self, task_id: u64, ok: bool, already_cached: bool, error: &str) -> Option<String> {
        let task = self.tasks.remove(&task_id)?;
        if !task.files.is_empty() {
            for f in &task.files {
                self.finish_load(&task.job, f.seq, 0, ok, already_cached, error);
            }
        } else {
            self.finish_load(&task.job, task.seq, task.index, ok, already_cached, error);
        }
        self.jobs.get_mut(&task.job)?.commit();
        Some(task.job)
    }

    /// One block load of file `seq` of `job_id` ended: its file advances (and finishes with its
    /// last block).
    fn finish_load(
        &mut self,
        job_id: &str,
        seq: u64,
        index: u64,
        ok: bool,
        already_cached: bool,
        error: &str,
    ) {
        let Some(job) = self.jobs.get_mut(job_id) else { return };
        let first_pass = job.record.pass == 1;
        let Some(f) = job.window.get_mut(&seq) else { return };
        f.blocks_left = f.blocks_left.saturating_sub(1);
        if ok {
            if first_pass {
                f.progress.blocks_done += 1;
            }
            if already_cached {
                f.progress.blocks_already_cached += 1;
            } else if !first_pass {
                f.progress.blocks_verify_loaded += 1;
            }
        } else if f.failure.is_none() {
            f.failure = Some(format!("block {index}: {error}"));
        }
        if f.blocks_left == 0 {
            Self::file_finished(f, first_pass);
        }
    }

    /// Fails the tasks no worker can take: the ring has fewer members than their replica
    /// rank needs (workers were lost below the job's `--replicas`). Waiting would hang the job.
    fn fail_unplaceable(&mut self) {
        if self.ring.is_empty() {
            // No membership yet (a master just started): wait for the workers to register.
            return;
        }
        let stuck: Vec<u64> =
            self.tasks.iter().filter(|(_, t)| t.target.is_none()).map(|(id, _)| *id).collect();
        let reason = format!("only {} live workers for this many replicas", self.ring.members().len());
        for id in stuck {
            self.finish_task(id, false, false, &reason);
        }
    }

    /// New membership: retarget queued tasks, take back tasks leased to workers that left.
    /// Batches whose files now have several owners are split by owner, and small files still
    /// gathering follow their new owners.
    pub fn set_ring(&mut self, ring: Ring, now: Instant) {
        self.ring = ring;
        self.queues.clear();
        for ((job, replica, _), g) in mem::take(&mut self.gathering) {
            let (block_size, replicas) = (g.block_size, g.replicas);
            for f in g.files {
                self.gather(&job, f, replica, replicas, block_size, now);
            }
        }
        let mut ids: Vec<u64> = self.tasks.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            let Some(task) = self.tasks.get(&id) else { continue };
            if !task.files.is_empty() {
                let targets: Vec<Option<String>> = task
                    .files
                    .iter()
                    .map(|f| target_of(&self.ring, f.hash, task.replicas, task.replica))
                    .collect();
                if targets.iter().any(|t| *t != targets[0]) {
                    let task = self.tasks.remove(&id).expect("looked up above");
                    let mut groups: BTreeMap<Option<String>, Gathering> = BTreeMap::new();
                    for (f, t) in task.files.into_iter().zip(targets) {
                        let g = groups.entry(t).or_default();
                        g.bytes += f.size;
                        g.block_size = task.block_size;
                        g.replicas = task.replicas;
                        g.files.push(f);
                    }
                    for (target, g) in groups {
                        self.batch_task(
                            &task.job,
                            task.replica,
                            target,
                            g,
                            task.attempts,
                            task.not_before.min(now),
                        );
                    }
                    continue;
                }
            }
            let Some(task) = self.tasks.get_mut(&id) else { continue };
            let target = match task.files.first() {
                Some(f) => target_of(&self.ring, f.hash, task.replicas, task.replica),
                None => target_of(&self.ring, task.hash, task.replicas, task.replica),
            };
            // A lease stays where it is only if that worker is still this replica's owner.
            if task.leased_until.is_some() && target.is_some() && target == task.target {
                continue;
            }
            task.leased_until = None;
            task.target = target;
            task.not_before = task.not_before.min(now);
            if let Some(t) = &task.target {
                self.queues.entry(t.clone()).or_default().push_back(id);
            }
        }
        self.fail_unplaceable();
    }

    /// Takes back expired leases. Returns whether any task became ready again.
    pub fn tick(&mut self, now: Instant) -> bool {
        let mut requeued = false;
        for (id, task) in self.tasks.iter_mut() {
            if task.leased_until.is_some_and(|until| until <= now) {
                task.leased_until = None;
                if let Some(t) = &task.target {
                    self.queues.entry(t.clone()).or_default().push_back(*id);
                    requeued = true;
                }
            }
        }
        requeued
    }

    /// The listing of the current pass is complete: small files still gathering go out as
    /// batches.
    pub fn listing_done(&mut self, id: &str, now: Instant) {
        self.flush_batches(id, now);
        if let Some(job) = self.jobs.get_mut(id) {
            job.listing_done = true;
        }
    }

    /// Where a pass stands; moves the job to its next pass or final phase when it is over.
    pub fn end_of_pass(&mut self, id: &str, now_ms: i64) -> PassEnd {
        let Some(job) = self.jobs.get_mut(id) else { return PassEnd::Finished(Phase::Cancelled) };
        if job.record.phase.is_final() {
            return PassEnd::Finished(job.record.phase);
        }
        if !job.listing_done || !job.window.is_empty() {
            return PassEnd::NotYet;
        }
        let s = &job.record.settings;
        job.dirty = true;
        if job.record.pass == 1 && s.verify && !s.dry_run && !s.metadata_only {
            job.record.pass = 2;
            job.record.cursor = None;
            job.listing_done = false;
            job.next_seq = 0;
            return PassEnd::Verify;
        }
        let phase = if job.record.done.files_failed > 0 { Phase::Failed } else { Phase::Succeeded };
        job.record.phase = phase;
        job.record.finished_ms = now_ms;
        PassEnd::Finished(phase)
    }

    /// Ends a job with an error of its own (not of a file): unknown path, lost mount.
    pub fn fail(&mut self, id: &str, reason: String, now_ms: i64) {
        self.finish(id, Phase::Failed, Some(reason), now_ms);
    }

    pub fn cancel(&mut self, id: &str, now_ms: i64) -> Result<(), JobsError> {
        if !self.jobs.contains_key(id) {
            return Err(JobsError::NotFound(id.to_string()));
        }
        if self.is_running(id) {
            self.finish(id, Phase::Cancelled, None, now_ms);
        }
        Ok(())
    }

    fn finish(&mut self, id: &str, phase: Phase, error: Option<String>, now_ms: i64) {
        let Some(job) = self.jobs.get_mut(id) else { return };
        if job.record.phase.is_final() {
            return;
        }
        job.record.phase = phase;
        job.record.error = error;
        job.record.finished_ms = now_ms;
        job.window.clear();
        job.dirty = true;
        self.tasks.retain(|_, t| t.job != id);
        self.gathering.retain(|(job, _, _), _| job != id);
        for q in self.queues.values_mut() {
            q.retain(|t| self.tasks.contains_key(t));
        }
    }

    pub fn info(&self, id: &str) -> Option<JobInfo> {
        let job = self.jobs.get(id)?;
        let r = &job.record;
        let p = job.live_progress();
        let mut failures: Vec<FileFailure> = r
            .failures
            .iter()
            .map(|(path, reason)| FileFailure { path: path.clone(), reason: reason.clone() })
            .collect();
        for f in job.window.values() {
            if let Some(reason) = &f.failure
                && f.blocks_left == 0
                && failures.len() < MAX_FAILURES_KEPT
            {
                failures.push(FileFailure { path: f.path.clone(), reason: kept_reason(reason.clone()) });
            }
        }
        if let Some(e) = &r.error {
            failures.insert(0, FileFailure { path: r.path.clone(), reason: e.clone() });
        }
        Some(JobInfo {
            id: r.id.clone(),
            path: r.path.clone(),
            settings: r.settings.clone(),
            phase: r.phase,
            pass: r.pass,
            listing_done: job.listing_done,
            progress: p,
            failures,
            created_ms: r.created_ms,
            finished_ms: r.finished_ms,
            schedule_id: r.schedule_id.clone(),
            resumed: r.resumed,
        })
    }

    /// Forgets the oldest finished jobs beyond the newest `keep`, so history cannot grow without
    /// bound; returns their ids to delete from the store. Running jobs are always kept.
    pub fn prune_finished(&mut self, keep: usize) -> Vec<String> {
        let mut finished: Vec<(i64, i64, String)> = self
            .jobs
            .values()
            .filter(|j| j.record.phase.is_final())
            .map(|j| (j.record.finished_ms, j.record.created_ms, j.record.id.clone()))
            .collect();
        let excess = finished.len().saturating_sub(keep);
        finished.sort();
        let gone: Vec<String> = finished.into_iter().take(excess).map(|(_, _, id)| id).collect();
        for id in &gone {
            self.jobs.remove(id);
        }
        gone
    }

    pub fn running_ids(&self) -> Vec<String> {
        self.jobs.values().filter(|j| !j.record.phase.is_final()).map(|j| j.record.id.clone()).collect()
    }

    /// Job ids, newest first.
    pub fn ids(&self) -> Vec<String> {
        let mut ids: Vec<(i64, String)> =
            self.jobs.values().map(|j| (j.record.created_ms, j.record.id.clone())).collect();
        ids.sort_by(|a, b| b.cmp(a));
        ids.into_iter().map(|(_, id)| id).collect()
    }
}

fn target_of(ring: &Ring, hash: u64, replicas: usize, replica: usize) -> Option<String> {
    ring.owners(hash, replicas).get(replica).map(|m| m.id.clone())
}

/// Delay before retry `attempt` (1-based): 200 ms doubling, at most 10 s.
pub fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(200u64.saturating_mul(1 << attempt.saturating_sub(1).min(16)))
        .min(Duration::from_secs(10))
}

#[cfg(test)]
mod tests {

    #[test]
    fn failure_reasons_are_bounded_at_a_character_boundary() {
        assert_eq!(kept_reason("short".into()), "short");
        let long = "é".repeat(MAX_REASON_BYTES);
        let kept = kept_reason(long);
        assert!(kept.len() <= MAX_REASON_BYTES, "{} bytes", kept.len());
        assert!(kept.ends_with('…') && kept.starts_with("éé"));
    }

    use strata_common::Member;
    use strata_common::ring::DEFAULT_VNODES;

    use super::*;

    fn ring(ids: &[&str]) -> Ring {
        let members = ids.iter().map(|id| Member::new(*id, "127.0.0.1:1")).collect();
        Ring::new(1, members, DEFAULT_VNODES)
    }

    fn job(id: &str, replicas: u32) -> JobRecord {
        JobRecord {
            id: id.into(),
            path: "/data".into(),
            settings: LoadSettings { replicas, ..Default::default() },
            ..Default::default()
        }
    }

    fn file(name: &str, blocks: u64, replicas: usize) -> FileIn {
        let loads =
            (0..blocks).flat_map(|i| (0..replicas).map(move |r| (i, xxhash_like(name, i), r))).collect();
        FileIn {
            path: format!("/data/{name}"),
            ufs_path: name.into(),
            version: "v1".into(),
            size: blocks * 10,
            block_size: 10,
            blocks,
            loads,
            skipped: 0,
            small: false,
        }
    }

    /// A one-block file under the packing threshold: its load goes into a batch.
    fn small_file(name: &str, replicas: usize) -> FileIn {
        FileIn { small: true, size: 7, ..file(name, 1, replicas) }
    }

    fn xxhash_like(name: &str, i: u64) -> u64 {
        strata_common::BlockKey::new(name, "v1", i).placement_hash()
    }

    fn ok(t: &LoadTask) -> LoadTaskResult {
        LoadTaskResult { task_id: t.task_id, job_id: t.job_id.clone(), ok: true, ..Default::default() }
    }

    fn drain(jobs: &mut Jobs, workers: &[&str], now: Instant) -> Vec<(String, LoadTask)> {
        workers
            .iter()
            .flat_map(|w| jobs.fetch(w, 1000, now).into_iter().map(move |t| (w.to_string(), t)))
            .collect()
    }

    #[test]
    fn replicas_go_to_distinct_owners_and_the_job_succeeds() {
        let now = Instant::now();
        let mut jobs = Jobs::new(1);
        jobs.set_ring(ring(&["a", "b", "c"]), now);
        jobs.insert(job("j", 2));
        jobs.add_file("j", file("f1", 3, 2), now);
        jobs.add_file("j", file("f2", 1, 2), now);
        jobs.listing_done("j", now);
        let tasks = drain(&mut jobs, &["a", "b", "c"], now);
        assert_eq!(tasks.len(), 8);
        for (w, t) in &tasks {
            let owners = jobs.ring().owners(xxhash_like(t.path.trim_start_matches("/data/"), t.index), 2);
            assert!(owners.iter().any(|o| &o.id == w), "task on an owner");
        }
        for block in [0u64, 1, 2] {
            let holders: Vec<_> = tasks
                .iter()
                .filter(|(_, t)| t.path == "/data/f1" && t.index == block)
                .map(|(w, _)| w)
                .collect();
            assert_eq!(holders.len(), 2);
            assert_ne!(holders[0], holders[1]);
        }
        assert_eq!(jobs.end_of_pass("j", 5), PassEnd::NotYet);
        for (w, t) in &tasks {
            jobs.report(w, &[ok(t)], now);
        }
        assert_eq!(jobs.end_of_pass("j", 5), PassEnd::Finished(Phase::Succeeded));
        let info = jobs.info("j").unwrap();
        let p = info.progress;
        assert_eq!((p.files_done, p.files_total, p.blocks_done, p.blocks_total), (2, 2, 8, 8));
        assert_eq!(jobs.record("j").unwrap().cursor.as_deref(), Some("f2"));
    }

    #[test]
    fn temporary_failures_retry_with_backoff_then_fail_the_file() {
        let t0 = Instant::now();
        let mut jobs = Jobs::new(1);
        jobs.set_ring(ring(&["a"]), t0);
        jobs.insert(job("j", 1));
        jobs.add_file("j", file("f", 1, 1), t0);
        jobs.listing_done("j", t0);
        let mut now = t0;
        for attempt in 1..MAX_ATTEMPTS {
            let t = jobs.fetch("a", 10, now).pop().expect("task ready");
            let fail = LoadTaskResult {
                task_id: t.task_id,
                job_id: "j".into(),
                ok: false,
                temporary: true,
                error: "ufs 503".into(),
                ..Default::default()
            };
            jobs.report("a", &[fail], now);
            assert!(jobs.fetch("a", 10, now).is_empty(), "backing off");
            now += backoff(attempt);
        }
        let t = jobs.fetch("a", 10, now).pop().expect("last attempt");
        let fail = LoadTaskResult {
            task_id: t.task_id,
            job_id: "j".into(),
            temporary: true,
            error: "ufs 503".into(),
            ..Default::default()
        };
        jobs.report("a", &[fail], now);
        assert_eq!(jobs.end_of_pass("j", 9), PassEnd::Finished(Phase::Failed));
        let info = jobs.info("j").unwrap();
        assert_eq!(info.progress.files_failed, 1);
        assert_eq!(info.progress.task_retries, (MAX_ATTEMPTS - 1) as u64);
        assert!(info.failures[0].reason.contains("ufs 503"), "{:?}", info.failures);
    }

    #[test]
    fn a_lost_worker_s_tasks_move_to_the_new_owner_and_late_reports_are_ignored() {
        let now = Instant::now();
        let mut jobs = Jobs::new(1);
        jobs.set_ring(ring(&["a", "b", "c"]), now);
        jobs.insert(job("j", 1));
        for i in 0..30 {
            jobs.add_file("j", file(&format!("f{i:02}"), 1, 1), now);
        }
        jobs.listing_done("j", now);
        let leased = jobs.fetch("a", 1000, now);
        assert!(!leased.is_empty());
        jobs.set_ring(ring(&["b", "c"]), now);
        // The lost worker's late report completes nothing.
        assert!(jobs.report("a", &[ok(&leased[0])], now).is_empty());
        let tasks = drain(&mut jobs, &["b", "c"], now);
        assert_eq!(tasks.len(), 30, "every task, including a's, is on b or c");
        for (w, t) in &tasks {
            jobs.report(w, &[ok(t)], now);
        }
        assert_eq!(jobs.end_of_pass("j", 1), PassEnd::Finished(Phase::Succeeded));
    }

    #[test]
    fn tasks_no_worker_can_take_fail_their_file_instead_of_hanging() {
        let now = Instant::now();
        let mut jobs = Jobs::new(1);
        jobs.set_ring(ring(&["a", "b"]), now);
        jobs.insert(job("j", 2));
        jobs.add_file("j", file("f", 1, 2), now);
        jobs.listing_done("j", now);
        let a = jobs.fetch("a", 10, now);
        let b = jobs.fetch("b", 10, now);
        assert_eq!(a.len() + b.len(), 2);
        // One worker is lost: the second replica has nowhere to go.
        jobs.set_ring(ring(&["a"]), now);
        for t in jobs.fetch("a", 10, now).iter().chain(a.iter()) {
            jobs.report("a", &[ok(t)], now);
        }
        assert_eq!(jobs.end_of_pass("j", 1), PassEnd::Finished(Phase::Failed));
        let info = jobs.info("j").unwrap();
        assert!(info.failures[0].reason.contains("only 1 live workers"), "{:?}", info.failures);
    }

    #[test]
    fn expired_leases_are_handed_out_again() {
        let now = Instant::now();
        let mut jobs = Jobs::new(1);
        jobs.set_ring(ring(&["a"]), now);
        jobs.insert(job("j", 1));
        jobs.add_file("j", file("f", 1, 1), now);
        assert_eq!(jobs.fetch("a", 10, now).len(), 1);
        assert!(!jobs.tick(now + LEASE / 2));
        assert!(jobs.fetch("a", 10, now).is_empty());
        assert!(jobs.tick(now + LEASE));
        assert_eq!(jobs.fetch("a", 10, now + LEASE).len(), 1);
    }

    #[test]
    fn the_cursor_only_passes_files_whose_predecessors_finished() {
        let now = Instant::now();
        let mut jobs = Jobs::new(1);
        jobs.set_ring(ring(&["a"]), now);
        jobs.insert(job("j", 1));
        jobs.add_file("j", file("f1", 1, 1), now);
        jobs.add_file("j", file("f2", 1, 1), now);
        let tasks = jobs.fetch("a", 10, now);
        let f2 = tasks.iter().find(|t| t.path == "/data/f2").unwrap();
        jobs.report("a", &[ok(f2)], now);
        assert_eq!(jobs.record("j").unwrap().cursor, None, "f1 still in flight");
        assert_eq!(jobs.info("j").unwrap().progress.files_done, 1);
        let f1 = tasks.iter().find(|t| t.path == "/data/f1").unwrap();
        jobs.report("a", &[ok(f1)], now);
        let dirty = jobs.take_dirty("j").expect("progress to store");
        assert_eq!(dirty.cursor.as_deref(), Some("f2"));
        assert_eq!(dirty.done.files_done, 2);
        assert!(jobs.take_dirty("j").is_none());
    }

    #[test]
    fn verify_pass_follows_and_cancel_drops_tasks() {
        let now = Instant::now();
        let mut jobs = Jobs::new(1);
        jobs.set_ring(ring(&["a"]), now);
        jobs.insert(JobRecord {
            settings: LoadSettings { replicas: 1, verify: true, ..Default::default() },
            ..job("j", 1)
        });
        jobs.listing_done("j", now);
        assert_eq!(jobs.end_of_pass("j", 1), PassEnd::Verify);
        assert_eq!(jobs.record("j").unwrap().pass, 2);
        jobs.add_file("j", file("late", 2, 1), now);
        jobs.cancel("j", 2).unwrap();
        assert!(jobs.fetch("a", 10, now).is_empty());
        assert_eq!(jobs.end_of_pass("j", 3), PassEnd::Finished(Phase::Cancelled));
        assert_eq!(jobs.cancel("nope", 1), Err(JobsError::NotFound("nope".into())));
    }

    #[test]
    fn small_files_go_out_in_batches_of_one_owner_and_the_job_succeeds() {
        let now = Instant::now();
        let mut jobs = Jobs::new(1);
        jobs.set_ring(ring(&["a", "b", "c"]), now);
        jobs.insert(job("j", 1));
        for i in 0..300 {
            jobs.add_file("j", small_file(&format!("s{i:03}"), 1), now);
        }
        jobs.add_file("j", file("big", 3, 1), now);
        let early = drain(&mut jobs, &["a", "b", "c"], now);
        assert!(
            early.iter().all(|(_, t)| t.files.len() == BATCH_FILES || t.files.is_empty()),
            "only full batches before a flush"
        );
        jobs.listing_done("j", now);
        let tasks: Vec<_> = early.into_iter().chain(drain(&mut jobs, &["a", "b", "c"], now)).collect();
        let batched: usize = tasks.iter().map(|(_, t)| t.files.len()).sum();
        assert_eq!(batched, 300, "every small file once");
        assert_eq!(
            tasks.iter().filter(|(_, t)| t.files.is_empty()).count(),
            3,
            "the big file's blocks stay tasks"
        );
        assert!(tasks.len() < 20, "{} tasks for 301 files", tasks.len());
        for (w, t) in &tasks {
            for f in &t.files {
                let owner = &jobs.ring().owners(xxhash_like(f.path.trim_start_matches("/data/"), 0), 1)[0].id;
                assert_eq!(owner, w, "{} is batched for its owner", f.path);
                assert_eq!((f.version.as_str(), f.size), ("v1", 7));
            }
        }
        for (w, t) in &tasks {
            let mut r = ok(t);
            r.files = t.files.iter().map(|_| FileOutcome { ok: true, ..Default::default() }).collect();
            jobs.report(w, &[r], now);
        }
        assert_eq!(jobs.end_of_pass("j", 5), PassEnd::Finished(Phase::Succeeded));
        let p = jobs.info("j").unwrap().progress;
        assert_eq!((p.files_done, p.files_total, p.blocks_done, p.blocks_total), (301, 301, 303, 303));
        assert_eq!(jobs.record("j").unwrap().cursor.as_deref(), Some("big"));
    }

    #[test]
    fn a_batch_retries_only_its_files_that_failed_temporarily() {
        let t0 = Instant::now();
        let mut jobs = Jobs::new(1);
        jobs.set_ring(ring(&["a"]), t0);
        jobs.insert(job("j", 1));
        for i in 0..5 {
            jobs.add_file("j", small_file(&format!("s{i}"), 1), t0);
        }
        jobs.listing_done("j", t0);
        let t = jobs.fetch("a", 10, t0).pop().expect("one batch");
        assert_eq!(t.files.len(), 5);
        let outcome = |ok: bool, temporary: bool| FileOutcome {
            ok,
            temporary,
            error: "ufs 503".into(),
            ..Default::default()
        };
        let mut r = ok(&t);
        r.ok = false;
        // s0 ok, s1 and s3 temporary, s2 gone for good, s4 ok.
        r.files = vec![
            outcome(true, false),
            outcome(false, true),
            outcome(false, false),
            outcome(false, true),
            outcome(true, false),
        ];
        jobs.report("a", &[r], t0);
        assert!(jobs.fetch("a", 10, t0).is_empty(), "the retry backs off");
        let retry = jobs.fetch("a", 10, t0 + backoff(1)).pop().expect("retry batch");
        let names: Vec<&str> = retry.files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(names, ["/data/s1", "/data/s3"]);
        let mut r = ok(&retry);
        r.files = vec![outcome(true, false), outcome(true, false)];
        jobs.report("a", &[r], t0 + backoff(1));
        assert_eq!(jobs.end_of_pass("j", 9), PassEnd::Finished(Phase::Failed));
        let info = jobs.info("j").unwrap();
        assert_eq!((info.progress.files_done, info.progress.files_failed), (4, 1));
        assert_eq!(info.progress.task_retries, 2);
        assert_eq!(info.failures.len(), 1);
        assert!(
            info.failures[0].path == "/data/s2" && info.failures[0].reason.contains("ufs 503"),
            "{:?}",
            info.failures
        );
    }

    #[test]
    fn a_ring_change_splits_batches_by_their_new_owners() {
        let now = Instant::now();
        let mut jobs = Jobs::new(1);
        jobs.set_ring(ring(&["a"]), now);
        jobs.insert(job("j", 1));
        for i in 0..40 {
            jobs.add_file("j", small_file(&format!("s{i:02}"), 1), now);
        }
        jobs.flush_batches("j", now);
        for i in 40..50 {
            jobs.add_file("j", small_file(&format!("s{i:02}"), 1), now);
        }
        // One batch queued for a, ten files still gathering for a; then b and c join.
        jobs.set_ring(ring(&["a", "b", "c"]), now);
        jobs.listing_done("j", now);
        let tasks = drain(&mut jobs, &["a", "b", "c"], now);
        assert_eq!(tasks.iter().map(|(_, t)| t.files.len()).sum::<usize>(), 50);
        assert!(tasks.iter().map(|(w, _)| w).collect::<std::collections::BTreeSet<_>>().len() == 3);
        for (w, t) in &tasks {
            for f in &t.files {
                let owner = &jobs.ring().owners(xxhash_like(f.path.trim_start_matches("/data/"), 0), 1)[0].id;
                assert_eq!(owner, w);
            }
            let mut r = ok(t);
            r.files = t.files.iter().map(|_| FileOutcome { ok: true, ..Default::default() }).collect();
            jobs.report(w, &[r], now);
        }
        assert_eq!(jobs.end_of_pass("j", 1), PassEnd::Finished(Phase::Succeeded));
    }

    #[test]
    fn history_keeps_the_newest_finished_jobs_and_every_running_one() {
        let mut jobs = Jobs::new(0);
        for (i, id) in ["old", "mid", "new"].iter().enumerate() {
            jobs.insert(job(id, 1));
            jobs.cancel(id, 100 + i as i64).unwrap();
        }
        jobs.insert(job("running", 1));
        assert_eq!(jobs.prune_finished(2), ["old"]);
        assert_eq!(jobs.prune_finished(2), Vec::<String>::new(), "nothing more to forget");
        assert_eq!(jobs.prune_finished(0), ["mid", "new"]);
        assert_eq!(jobs.ids(), ["running"], "a running job is never forgotten");
    }
}
