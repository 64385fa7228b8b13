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
//! A report that fails to reach the master is dropped: the master's lease on those tasks
//! expires and it hands them out again, so nothing is lost, only repeated (and a repeated
//! load of a cached block costs no UFS read).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use strata_common::background::{Backoff, sleep_or_cancel};
use strata_proto::leader::MasterConn;
use strata_proto::{FetchLoadTasksRequest, LoadTask, LoadTaskResult, ReportLoadTasksRequest};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::blocks::{BlockRead, BlockService};
use crate::metrics_defs as m;
use crate::qos::DEFAULT_LOAD_PARALLELISM;

/// Longest a load waits for client reads to go quiet before it starts anyway.
const MAX_YIELD: Duration = Duration::from_millis(200);

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
    let mut running: JoinSet<LoadTaskResult> = JoinSet::new();
    let mut results: Vec<LoadTaskResult> = Vec::new();
    // Tasks fetched but not started: a batch can hold more than the job's parallelism allows.
    let mut backlog: std::collections::VecDeque<LoadTask> = std::collections::VecDeque::new();
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    while !cancel.is_cancelled() {
        while let Some(done) = running.try_join_next() {
            match done {
                Ok(r) => results.push(r),
                Err(e) => warn!(worker = %worker_id, err = %e, "load task panicked"),
            }
        }
        // Refill in batches: wait until half the window is free, then report everything done
        // and fetch a batch, so two RPCs serve many small loads instead of one each.
        let window = blocks.qos().window();
        if running.len() as u32 * 2 > window {
            tokio::select! {
                _ = cancel.cancelled() => break,
                Some(done) = running.join_next() => if let Ok(r) = done { results.push(r) },
            }
            continue;
        }
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
            while (running.len() as u32) < blocks.qos().window()
                && let Some(task) = backlog.pop_front()
            {
                running.spawn(load_one(blocks.clone(), pacer.clone(), task));
            }
            if !running.is_empty() {
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    Some(done) = running.join_next() => if let Ok(r) = done { results.push(r) },
                }
            }
            continue;
        }
        let room = window.saturating_sub(running.len() as u32).max(1);
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
                Some(done) = running.join_next() => if let Ok(r) = done { results.push(r) },
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

async fn load_one(blocks: Arc<BlockService>, pacer: Arc<Mutex<Pacer>>, task: LoadTask) -> LoadTaskResult {
    // Yield to client reads: wait for a quiet moment, with growing pauses, but not forever.
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
    let len = strata_common::block::block_len(task.file_size, task.block_size, task.index);
    let wait = pacer.lock().unwrap_or_else(|p| p.into_inner()).reserve(Instant::now(), len, task.bandwidth);
    if !wait.is_zero() {
        tokio::time::sleep(wait).await;
    }
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
            // A full disk is retried: the tier evicts down to what the disk takes meanwhile.
            result.temporary =
                e.kind().is_temporary() || matches!(e, crate::error::ServeError::DiskFull { .. });
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
