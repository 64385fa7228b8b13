//! The worker's load lane: pulls warmup tasks from the master (long poll), loads each block
//! into the tiers, and reports the outcomes.
//!
//! Load traffic is a lower-priority lane than client reads:
//! - an AIMD window bounds the loads in flight: it grows by one per load started while no
//!   client read is in flight or recent, and halves when one is, down to a single load, so a
//!   training job's reads meet at most one competing UFS fetch per worker;
//! - a load about to start while client reads are active first waits (with growing pauses,
//!   capped, so warmup never starves completely);
//! - a per-worker byte pacer enforces the job's `bandwidth` cap on top.
//!
//! A task is one block, or a batch of small files (`LoadTask::files`): the batch's files are
//! fetched up to [`BATCH_PARALLELISM`] at a time and written to NVMe together (one packed
//! append). Every fetch holds one of the window's load slots ([`crate::qos::LoadSlot`]), so the
//! window bounds what is fetched at once whatever the tasks; a batch takes a few places of the
//! window in the task count, so several run at once and one's tail overlaps the next's start.
//!
//! A report that fails to reach the master is dropped: the master's lease on those tasks
//! expires and it hands them out again, so nothing is lost, only repeated (and a repeated
//! load of a cached block costs no UFS read).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use strata_common::background::{Backoff, sleep_or_cancel};
use strata_proto::leader::MasterConn;
use strata_proto::{
    FetchLoadTasksRequest, FileLoadOutcome, LoadTask, LoadTaskResult, ReportLoadTasksRequest,
};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::blocks::{BlockRead, BlockService, LoadGate};
use crate::metrics_defs as m;
use crate::qos::DEFAULT_LOAD_PARALLELISM;

/// Longest a load waits for client reads to go quiet before it starts anyway.
const MAX_YIELD: Duration = Duration::from_millis(200);
/// Files of a batch task fetched at once (at most: each fetch holds a load slot).
pub const BATCH_PARALLELISM: u32 = 16;
/// A batch starts a file only if the master said its job was running at most this long ago, and
/// at most a window's worth of files (the load window when it said so) on one answer; otherwise
/// it asks again first (an empty report). So a cancelled job's batch starts at most a window of
/// files more — one at parallelism 1, as a job of one-block tasks stops at its next task —
/// while a full window costs one question per window of files.
const STILL_RUNNING_FOR: Duration = Duration::from_millis(100);

/// Places of the load window a task takes in the loader's count of tasks: 1 for a block, an
/// eighth of the window for a batch (its fetches hold load slots, so this only decides how many
/// batches overlap: eight, enough to keep every small-file slot busy, while the window is full).
fn places(task: &LoadTask, window: u32) -> u32 {
    if task.files.is_empty() { 1 } else { (window / 8).max(1) }
}

/// Lets a batch's files start while the master runs their job.
struct JobGate {
    client: MasterConn,
    worker_id: String,
    job_id: String,
    blocks: Arc<BlockService>,
    confirmed: tokio::sync::Mutex<Confirmed>,
}

/// What the master last said of a batch's job.
struct Confirmed {
    at: Instant,
    running: bool,
    /// Files that may still start on that answer.
    starts_left: u32,
}

#[async_trait]
impl LoadGate for JobGate {
    async fn go_on(&self) -> bool {
        let mut c = self.confirmed.lock().await;
        if !c.running {
            return false;
        }
        if c.starts_left == 0 || c.at.elapsed() >= STILL_RUNNING_FOR {
            let req = ReportLoadTasksRequest { worker_id: self.worker_id.clone(), results: Vec::new() };
            match self.client.clone().report_load_tasks(req).await {
                Ok(resp) => {
                    c.running = resp.into_inner().running_jobs.contains(&self.job_id);
                    c.at = Instant::now();
                    c.starts_left = self.blocks.qos().window();
                }
                // The master cannot say: go on (a lost job's lease ends it anyway).
                Err(status) => {
                    debug!(job = %self.job_id, err = %status.message(), "cannot ask whether a job still runs");
                    c.starts_left = c.starts_left.max(1);
                }
            }
        }
        if c.running {
            c.starts_left -= 1;
        }
        c.running
    }
}

/// Paces bytes to a rate: each reservation starts when the previous ones have had their time.
#[derive(Debug)]
pub struct Pacer {
    next_free: Instant,
}

impl Pacer {
    pub fn new(now: Instant) -> Self {
        Self { next_free: now }
    }

    /// How long to wait before moving `bytes` at `rate` bytes/s (0 = unlimited).
    pub fn reserve(&mut self, now: Instant, bytes: u64, rate: u64) -> Duration {
        if rate == 0 {
            return Duration::ZERO;
        }
        let start = self.next_free.max(now);
        self.next_free = start + Duration::from_secs_f64(bytes as f64 / rate as f64);
        start - now
    }
}

pub async fn run(
    client: MasterConn,
    worker_id: String,
    blocks: Arc<BlockService>,
    cancel: CancellationToken,
) {
    let mut client = client;
    let pacer = Arc::new(Mutex::new(Pacer::new(Instant::now())));
    // Each running task's result, with the places of the window it took.
    let mut running: JoinSet<(LoadTaskResult, u32)> = JoinSet::new();
    let mut in_flight: u32 = 0;
    let mut results: Vec<LoadTaskResult> = Vec::new();
    // Tasks fetched but not started: a batch can hold more than the job's parallelism allows.
    let mut backlog: VecDeque<LoadTask> = VecDeque::new();
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    // A finished task: its result to report, its places back. A panicked one is lost, and its
    // places with it, only until the set empties: the master's lease hands it out again.
    let finished = |done: Result<(LoadTaskResult, u32), tokio::task::JoinError>,
                    results: &mut Vec<LoadTaskResult>,
                    in_flight: &mut u32| match done {
        Ok((r, took)) => {
            *in_flight = in_flight.saturating_sub(took);
            results.push(r);
        }
        Err(e) => warn!(worker = %worker_id, err = %e, "load task panicked"),
    };
    while !cancel.is_cancelled() {
        while let Some(done) = running.try_join_next() {
            finished(done, &mut results, &mut in_flight);
        }
        if running.is_empty() {
            in_flight = 0;
        }
        // Refill in batches: wait until half the window is free, then report everything done
        // and fetch a batch, so two RPCs serve many small loads instead of one each.
        let window = blocks.qos().window();
        if in_flight * 2 > window {
            tokio::select! {
                _ = cancel.cancelled() => break,
                Some(done) = running.join_next() => finished(done, &mut results, &mut in_flight),
            }
            continue;
        }
        // Start what the backlog holds before reporting: a report's round trip must not leave
        // places of the window idle.
        start_backlog(&blocks, &pacer, &client, &worker_id, &mut backlog, &mut running, &mut in_flight);
        if !results.is_empty() {
            let req = ReportLoadTasksRequest {
                worker_id: worker_id.clone(),
                results: std::mem::take(&mut results),
            };
            match client.report_load_tasks(req).await {
                Ok(resp) => {
                    let running = resp.into_inner().running_jobs;
                    backlog.retain(|t| running.contains(&t.job_id));
                }
                Err(status) => {
                    warn!(worker = %worker_id, err = %status.message(), "load report lost; the master will reassign")
                }
            }
        }
        if !backlog.is_empty() {
            start_backlog(&blocks, &pacer, &client, &worker_id, &mut backlog, &mut running, &mut in_flight);
            if !running.is_empty() {
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    Some(done) = running.join_next() => finished(done, &mut results, &mut in_flight),
                }
            }
            continue;
        }
        let room = window.saturating_sub(in_flight).max(1);
        // Long-poll only when idle; with loads running, come back soon to report them.
        let wait_ms = if running.is_empty() { 1_000 } else { 0 };
        let fetched = tokio::select! {
            _ = cancel.cancelled() => break,
            r = client.fetch_load_tasks(FetchLoadTasksRequest { worker_id: worker_id.clone(), max: room, wait_ms }) => r,
        };
        let tasks = match fetched {
            Ok(resp) => {
                backoff.reset();
                resp.into_inner().tasks
            }
            Err(status) => {
                debug!(worker = %worker_id, err = %status.message(), "cannot fetch load tasks");
                sleep_or_cancel(backoff.next_delay(), &cancel).await;
                continue;
            }
        };
        if tasks.is_empty() && !running.is_empty() {
            tokio::select! {
                _ = cancel.cancelled() => break,
                Some(done) = running.join_next() => finished(done, &mut results, &mut in_flight),
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
        }
        if let Some(task) = tasks.first() {
            let limit = if task.parallelism == 0 { DEFAULT_LOAD_PARALLELISM } else { task.parallelism };
            blocks.qos().set_limit(limit);
        }
        backlog.extend(tasks);
    }
    running.abort_all();
}

/// Starts backlog tasks while the window has places for them.
fn start_backlog(
    blocks: &Arc<BlockService>,
    pacer: &Arc<Mutex<Pacer>>,
    client: &MasterConn,
    worker_id: &str,
    backlog: &mut VecDeque<LoadTask>,
    running: &mut JoinSet<(LoadTaskResult, u32)>,
    in_flight: &mut u32,
) {
    while *in_flight < blocks.qos().window()
        && let Some(task) = backlog.pop_front()
    {
        let took = places(&task, blocks.qos().window());
        *in_flight += took;
        let (blocks, pacer) = (blocks.clone(), pacer.clone());
        let gate = (!task.files.is_empty()).then(|| JobGate {
            client: client.clone(),
            worker_id: worker_id.to_string(),
            job_id: task.job_id.clone(),
            blocks: blocks.clone(),
            // The task was just handed out: the job runs; a window of files may start.
            confirmed: tokio::sync::Mutex::new(Confirmed {
                at: Instant::now(),
                running: true,
                starts_left: blocks.qos().window(),
            }),
        });
        running.spawn(async move {
            let result = match gate {
                Some(gate) => load_batch(blocks, pacer, task, gate).await,
                None => load_one(blocks, pacer, task).await,
            };
            (result, took)
        });
    }
}

/// Yields to client reads (waits for a quiet moment, with growing pauses, but not forever),
/// then waits for the pacer to let `bytes` through.
async fn before_load(blocks: &BlockService, pacer: &Mutex<Pacer>, bytes: u64, bandwidth: u64) {
    let busy = blocks.qos().busy();
    blocks.qos().observe(busy);
    if busy {
        metrics::counter!(m::LOAD_YIELDS).increment(1);
        let deadline = Instant::now() + MAX_YIELD;
        let mut pause = Duration::from_millis(2);
        while blocks.qos().busy() && Instant::now() < deadline {
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }
    let wait = pacer.lock().unwrap_or_else(|p| p.into_inner()).reserve(Instant::now(), bytes, bandwidth);
    if !wait.is_zero() {
        tokio::time::sleep(wait).await;
    }
}

/// Whether a failed load may succeed if tried again: a temporary error, or a full disk (the tier
/// evicts down to what the disk takes meanwhile).
fn retryable(e: &crate::error::ServeError) -> bool {
    e.kind().is_temporary() || matches!(e, crate::error::ServeError::DiskFull { .. })
}

/// A batch of small files: fetched up to [`BATCH_PARALLELISM`] at a time (each fetch holding a
/// load slot), settled on NVMe together; files not started once `gate` says the job no longer
/// runs are given up.
async fn load_batch(
    blocks: Arc<BlockService>,
    pacer: Arc<Mutex<Pacer>>,
    task: LoadTask,
    gate: JobGate,
) -> LoadTaskResult {
    let bytes = task.files.iter().map(|f| f.size).sum();
    before_load(&blocks, &pacer, bytes, task.bandwidth).await;
    let reads: Vec<BlockRead> = task
        .files
        .iter()
        .map(|f| BlockRead::whole_block(&f.path, &f.version, f.size, task.block_size, 0))
        .collect();
    let outcomes = blocks.load_many(&reads, BATCH_PARALLELISM as usize, &gate).await;
    let mut result = LoadTaskResult {
        task_id: task.task_id,
        job_id: task.job_id.clone(),
        ok: true,
        already_cached: true,
        ..Default::default()
    };
    for (f, outcome) in task.files.iter().zip(outcomes) {
        let file = match outcome {
            Ok(o) => {
                let label = if o.already_cached { "cached" } else { "loaded" };
                metrics::counter!(m::LOAD_BLOCKS, "result" => label).increment(1);
                if !o.already_cached {
                    metrics::counter!(m::LOAD_BYTES).increment(o.bytes);
                }
                FileLoadOutcome { ok: true, already_cached: o.already_cached, ..Default::default() }
            }
            Err(e) => {
                metrics::counter!(m::LOAD_BLOCKS, "result" => "failed").increment(1);
                debug!(path = %f.path, err = %e, "load of a batched file failed");
                FileLoadOutcome {
                    ok: false,
                    already_cached: false,
                    error: e.to_string(),
                    temporary: retryable(&e),
                }
            }
        };
        result.ok &= file.ok;
        result.already_cached &= file.already_cached;
        result.files.push(file);
    }
    result
}

async fn load_one(blocks: Arc<BlockService>, pacer: Arc<Mutex<Pacer>>, task: LoadTask) -> LoadTaskResult {
    let len = strata_common::block::block_len(task.file_size, task.block_size, task.index);
    before_load(&blocks, &pacer, len, task.bandwidth).await;
    let _slot = blocks.qos().load_slot(false).await;
    let read = BlockRead::whole_block(&task.path, &task.version, task.file_size, task.block_size, task.index);
    let mut result =
        LoadTaskResult { task_id: task.task_id, job_id: task.job_id.clone(), ..Default::default() };
    match blocks.load(&read).await {
        Ok(outcome) => {
            result.ok = true;
            result.already_cached = outcome.already_cached;
            let label = if outcome.already_cached { "cached" } else { "loaded" };
            metrics::counter!(m::LOAD_BLOCKS, "result" => label).increment(1);
            if !outcome.already_cached {
                metrics::counter!(m::LOAD_BYTES).increment(outcome.bytes);
            }
        }
        Err(e) => {
            metrics::counter!(m::LOAD_BLOCKS, "result" => "failed").increment(1);
            debug!(path = %task.path, index = task.index, err = %e, "load task failed");
            result.temporary = retryable(&e);
            result.error = e.to_string();
        }
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pacer_spaces_reservations_at_the_rate() {
        let t0 = Instant::now();
        let mut p = Pacer::new(t0);
        assert_eq!(p.reserve(t0, 1000, 0), Duration::ZERO, "0 means unlimited");
        assert_eq!(p.reserve(t0, 1000, 1000), Duration::ZERO);
        assert_eq!(p.reserve(t0, 500, 1000), Duration::from_secs(1));
        assert_eq!(p.reserve(t0, 500, 1000), Duration::from_millis(1500));
        // After idling, the next reservation starts at once.
        let later = t0 + Duration::from_secs(10);
        assert_eq!(p.reserve(later, 500, 1000), Duration::ZERO);
    }
}
