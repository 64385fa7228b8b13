//! Lineage: this client's reads, summed per (path, version) over a short window and reported
//! to the master under the job the client declared (`STRATA_JOB`, [`ClientConfig::job`]).
//!
//! The client records, not the workers: a short-circuit read (a mapped block the client keeps)
//! never reaches a worker, and a worker sees UFS identities rather than the paths a job asked
//! for. What a client reads is what it got, whichever way it came.
//!
//! Bounds: the window holds at most [`MAX_WINDOW`] (path, version) entries (beyond it new ones
//! are dropped and counted); it is sent every [`ClientConfig::lineage_flush_interval`], when it
//! reaches [`FLUSH_AT`] entries, before a mark, and by [`Client::flush_lineage`]. A process
//! killed without a flush loses at most its last window. A report that fails for a temporary
//! reason is kept whole and sent again, first, under the same id: when only its answer was lost,
//! the master recognises the id and does not count its reads twice.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use strata_proto::{
    LineageFileRequest, LineageJobRequest, LineageJobResponse, LineageMark, LineageRead, LineageRecord,
    MarkLineageRequest, ReportLineageRequest,
};
use tracing::{debug, warn};

use crate::{Client, ClientError, FileInfo, Inner, Result};

/// Environment variable naming the job a client reads for (read by `ClientConfig::new`).
pub const JOB_ENV: &str = "STRATA_JOB";
/// Environment variable turning lineage recording off (`0`, `false`, `off`, `no`).
pub const LINEAGE_ENV: &str = "STRATA_LINEAGE";
/// Environment variable setting [`ClientConfig::lineage_flush_interval`](crate::ClientConfig)
/// (`2s`, `500ms`, `1m`).
pub const LINEAGE_FLUSH_ENV: &str = "STRATA_LINEAGE_FLUSH";
/// Counter, label `why` (`window_full`, `refused`): reads this client could not report.
pub const METRIC_LINEAGE_DROPPED: &str = "strata_client_lineage_dropped_total";
/// Most (path, version) entries one window holds.
pub const MAX_WINDOW: usize = 100_000;
/// Entries at which the window is sent before its interval ends.
pub const FLUSH_AT: usize = 5_000;
/// Entries per report (the master's limit).
const REPORT_CHUNK: usize = 10_000;
/// Deadline of the last report of a dropped client.
const CALL_DEADLINE: Duration = crate::outage::FALLBACK_DEADLINE;

/// The job named in the environment, trimmed; `None` when unset or blank.
pub(crate) fn job_from_env() -> Option<String> {
    std::env::var(JOB_ENV).ok().map(|j| j.trim().to_string()).filter(|j| !j.is_empty())
}

/// How often recorded reads are sent to the master unless configured otherwise.
pub(crate) const DEFAULT_FLUSH_INTERVAL: Duration = Duration::from_secs(2);

/// The flush interval the environment sets; 2 s when unset or unreadable (said in the log).
pub(crate) fn flush_interval_from_env() -> Duration {
    const DEFAULT: Duration = DEFAULT_FLUSH_INTERVAL;
    match std::env::var(LINEAGE_FLUSH_ENV) {
        Err(_) => DEFAULT,
        Ok(v) => match strata_common::units::parse_duration(v.trim()) {
            Some(d) if !d.is_zero() => d,
            _ => {
                warn!(value = %v, "{LINEAGE_FLUSH_ENV} is not a duration such as 2s or 500ms; using 2s");
                DEFAULT
            }
        },
    }
}

pub(crate) fn enabled_by_env() -> bool {
    std::env::var(LINEAGE_ENV)
        .map(|v| !matches!(v.trim().to_ascii_lowercase().as_str(), "0" | "false" | "off" | "no"))
        .unwrap_or(true)
}

#[derive(Debug, Clone)]
struct Entry {
    version: String,
    ufs: String,
    bytes: u64,
    reads: u64,
    first_ms: i64,
    last_ms: i64,
}

#[derive(Default)]
struct Window {
    /// By path, then the versions of it read (almost always one).
    by_path: HashMap<String, Vec<Entry>>,
    entries: usize,
}

impl Window {
    /// Adds to an entry, or makes one if there is room; false when there was none.
    fn add(
        &mut self,
        path: &str,
        version: &str,
        ufs: impl FnOnce() -> String,
        e: (u64, u64, i64, i64),
    ) -> bool {
        let (bytes, reads, first, last) = e;
        if let Some(versions) = self.by_path.get_mut(path)
            && let Some(entry) = versions.iter_mut().find(|v| v.version == version)
        {
            entry.bytes = entry.bytes.saturating_add(bytes);
            entry.reads = entry.reads.saturating_add(reads);
            entry.first_ms = entry.first_ms.min(first);
            entry.last_ms = entry.last_ms.max(last);
            return true;
        }
        if self.entries >= MAX_WINDOW {
            return false;
        }
        self.entries += 1;
        let entry =
            Entry { version: version.to_string(), ufs: ufs(), bytes, reads, first_ms: first, last_ms: last };
        self.by_path.entry(path.to_string()).or_default().push(entry);
        true
    }

    fn into_reads(self) -> Vec<LineageRead> {
        let mut out = Vec::with_capacity(self.entries);
        for (path, versions) in self.by_path {
            for e in versions {
                out.push(LineageRead {
                    path: path.clone(),
                    version: e.version,
                    ufs: e.ufs,
                    bytes: e.bytes,
                    reads: e.reads,
                    first_read_ms: e.first_ms,
                    last_read_ms: e.last_ms,
                });
            }
        }
        out
    }
}

/// The UFS location of a file: its identity without the block-size suffix.
fn ufs_location(file_id: &str) -> String {
    match file_id.rfind("#bs") {
        Some(i) if file_id[i + 3..].bytes().all(|b| b.is_ascii_digit()) => file_id[..i].to_string(),
        _ => file_id.to_string(),
    }
}

/// A window (or part of one) on its way to the master, under the id its retries keep.
#[derive(Debug, Clone, PartialEq)]
struct Report {
    id: String,
    reads: Vec<LineageRead>,
}

pub(crate) struct Recorder {
    job: String,
    /// The process the window belongs to: a forked child starts with an empty one, so the
    /// parent's reads are never reported twice.
    pid: u32,
    /// Unique to this recorder (a child process's is new): report ids are `<prefix>-<n>`.
    id_prefix: String,
    next_report: AtomicU64,
    window: Mutex<Window>,
    /// Reports that failed for a temporary reason, oldest first, sent again before the window.
    unsent: Mutex<VecDeque<Report>>,
    wake: tokio::sync::Notify,
    /// Held while a window is sent, so reports leave in order and a mark waits for them.
    sending: tokio::sync::Mutex<()>,
    dropped: AtomicU64,
    reported: AtomicU64,
}

impl Recorder {
    pub(crate) fn new(job: Option<&str>) -> Self {
        Self {
            job: job.unwrap_or_default().to_string(),
            pid: std::process::id(),
            id_prefix: uuid::Uuid::new_v4().simple().to_string(),
            next_report: AtomicU64::new(0),
            window: Mutex::default(),
            unsent: Mutex::default(),
            wake: tokio::sync::Notify::new(),
            sending: tokio::sync::Mutex::new(()),
            dropped: AtomicU64::new(0),
            reported: AtomicU64::new(0),
        }
    }

    /// This recorder's unsent window moved to a new one for the same process (a client rebuilt
    /// after its runtime was shut down for a fork); a child process gets a fresh one.
    pub(crate) fn carried_over(&self) -> Self {
        let fresh = Self::new(Some(&self.job));
        if self.pid == std::process::id() {
            *fresh.lock() = std::mem::take(&mut *self.lock());
            *fresh.lock_unsent() = std::mem::take(&mut *self.lock_unsent());
        }
        fresh
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Window> {
        self.window.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_unsent(&self) -> std::sync::MutexGuard<'_, VecDeque<Report>> {
        self.unsent.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Entries recorded and not yet acknowledged: the window and the unsent reports.
    fn pending(&self) -> usize {
        self.lock().entries + self.lock_unsent().iter().map(|r| r.reads.len()).sum::<usize>()
    }

    pub(crate) fn record(&self, info: &FileInfo, bytes: u64, now_ms: i64) {
        let (added, entries) = {
            let mut w = self.lock();
            let added =
                w.add(&info.path, &info.version, || ufs_location(&info.file_id), (bytes, 1, now_ms, now_ms));
            (added, w.entries)
        };
        if !added {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(METRIC_LINEAGE_DROPPED, "why" => "window_full").increment(1);
        }
        if entries == FLUSH_AT {
            self.wake.notify_one();
        }
    }

    #[cfg(test)]
    fn take(&self) -> Vec<LineageRead> {
        std::mem::take(&mut *self.lock()).into_reads()
    }

    /// What to send now, in order: the reports that failed before (their ids unchanged), then
    /// the window in reports of at most [`REPORT_CHUNK`] entries under new ids.
    fn outgoing(&self) -> Vec<Report> {
        let mut out: Vec<Report> = self.lock_unsent().drain(..).collect();
        let window = std::mem::take(&mut *self.lock()).into_reads();
        for chunk in window.chunks(REPORT_CHUNK) {
            let n = self.next_report.fetch_add(1, Ordering::Relaxed);
            out.push(Report { id: format!("{}-{n}", self.id_prefix), reads: chunk.to_vec() });
        }
        out
    }

    /// Keeps reports that could not be sent, in order, for the next flush. They hold at most
    /// [`MAX_WINDOW`] entries; the oldest reports beyond that are dropped and counted.
    fn keep_unsent(&self, reports: Vec<Report>) {
        let mut unsent = self.lock_unsent();
        unsent.extend(reports);
        let mut held: usize = unsent.iter().map(|r| r.reads.len()).sum();
        let mut lost = 0u64;
        while held > MAX_WINDOW {
            let Some(oldest) = unsent.pop_front() else { break };
            held -= oldest.reads.len();
            lost += oldest.reads.len() as u64;
        }
        if lost > 0 {
            self.dropped.fetch_add(lost, Ordering::Relaxed);
            metrics::counter!(METRIC_LINEAGE_DROPPED, "why" => "window_full").increment(lost);
        }
    }
}

/// What this client's lineage recording did (for tests and `read_counters`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LineageCounters {
    /// (path, version) entries the master acknowledged.
    pub reported: u64,
    /// Reads not reported: the window was full, or the master refused them.
    pub dropped: u64,
    /// Entries waiting in this process's window.
    pub pending: u64,
}

/// Sends the window every `interval`, or sooner when it fills, while the client lives.
pub(crate) fn spawn_flusher(inner: Weak<Inner>, recorder: Arc<Recorder>, interval: Duration) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        loop {
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = recorder.wake.notified() => {}
            }
            let Some(inner) = inner.upgrade() else { return };
            let client = Client { inner };
            if let Err(e) = client.flush_lineage().await {
                debug!(err = %e, "lineage report failed; sent again with the next window");
            }
        }
    });
}

impl Client {
    pub(crate) fn record_read(&self, info: &FileInfo, bytes: u64) {
        if let Some(recorder) = &self.inner.lineage {
            recorder.record(info, bytes, self.inner.config.clock.wall_ms());
        }
    }

    /// The job this client reports its reads under (`None`: anonymous, or lineage off).
    pub fn job(&self) -> Option<&str> {
        self.inner.lineage.as_ref().map(|r| r.job.as_str()).filter(|j| !j.is_empty())
    }

    /// The request class this client's reads are scheduled by on a busy worker.
    pub fn qos(&self) -> crate::QosClass {
        self.inner.config.qos
    }

    pub fn lineage_counters(&self) -> LineageCounters {
        match &self.inner.lineage {
            None => LineageCounters::default(),
            Some(r) => LineageCounters {
                reported: r.reported.load(Ordering::Relaxed),
                dropped: r.dropped.load(Ordering::Relaxed),
                // Another process's window (inherited through a fork) is not this one's to send.
                pending: if r.pid == std::process::id() { r.pending() as u64 } else { 0 },
            },
        }
    }

    /// Sends the reads recorded so far to the master now. A temporary failure keeps them for
    /// the next attempt (and is returned); a refusal drops them, counted and logged.
    pub async fn flush_lineage(&self) -> Result<()> {
        let Some(recorder) = self.inner.lineage.clone() else { return Ok(()) };
        let _in_order = recorder.sending.lock().await;
        let mut reports = recorder.outgoing().into_iter();
        while let Some(report) = reports.next() {
            let req = ReportLineageRequest {
                job: recorder.job.clone(),
                reads: report.reads.clone(),
                client_now_ms: self.inner.config.clock.wall_ms(),
                report_id: report.id.clone(),
            };
            let entries = report.reads.len() as u64;
            // As a call with a cached answer: during a master outage it is not even tried until
            // a probe is due, and a stopped master holds it for at most FALLBACK_DEADLINE.
            let err = match self
                .inner
                .master
                .call("ReportLineage", true, self.inner.master.client().report_lineage(req))
                .await
            {
                Ok(_) => {
                    recorder.reported.fetch_add(entries, Ordering::Relaxed);
                    continue;
                }
                Err(e) => e,
            };
            if err.is_temporary() || err.is_master_outage() {
                // The master may have applied it and only the answer been lost: it goes again
                // as it is, under its id, never merged into newer reads.
                recorder.keep_unsent(std::iter::once(report).chain(reports).collect());
                return Err(err);
            }
            recorder.dropped.fetch_add(entries, Ordering::Relaxed);
            metrics::counter!(METRIC_LINEAGE_DROPPED, "why" => "refused").increment(entries);
            warn!(job = %recorder.job, entries, report = %report.id, err = %err, "the master refused a lineage report; its reads are not recorded");
        }
        Ok(())
    }

    /// Marks a point in this client's job (`label`, e.g. `epoch=3 step=12000`): the reads so
    /// far are sent first, so they are grouped before it.
    pub async fn lineage_mark(&self, label: &str) -> Result<LineageMark> {
        let job = self.inner.lineage.as_ref().map(|r| r.job.clone()).unwrap_or_default();
        self.lineage_mark_for(&job, label).await
    }

    /// [`lineage_mark`](Self::lineage_mark) for a named job (`strata lineage mark --job`).
    pub async fn lineage_mark_for(&self, job: &str, label: &str) -> Result<LineageMark> {
        self.flush_lineage().await?;
        let req = MarkLineageRequest { job: job.to_string(), label: label.to_string() };
        self.inner.master.call("MarkLineage", false, self.inner.master.client().mark_lineage(req)).await
    }

    /// What `job` read (every page), from the mark `since` names on (empty: all; `#N`: mark
    /// number N; else the last mark with that label).
    pub async fn lineage_job(&self, job: &str, since: &str) -> Result<LineageJobResponse> {
        let mut all = LineageJobResponse::default();
        let mut page_token = String::new();
        loop {
            let req = LineageJobRequest {
                job: job.to_string(),
                since: since.to_string(),
                page_token: page_token.clone(),
                page_size: 0,
            };
            let page = self
                .inner
                .master
                .call("LineageJob", false, self.inner.master.client().lineage_job(req))
                .await?;
            all.job = page.job;
            all.marks = page.marks;
            all.records.extend(page.records);
            if page.next_page_token.is_empty() {
                return Ok(all);
            }
            page_token = page.next_page_token;
        }
    }

    /// Every job's reads of `path` (every page).
    pub async fn lineage_file(&self, raw: &str) -> Result<Vec<LineageRecord>> {
        let path =
            strata_common::path::normalize(raw).map_err(|e| ClientError::InvalidArgument(e.to_string()))?;
        let mut all = Vec::new();
        let mut page_token = String::new();
        loop {
            let req = LineageFileRequest { path: path.clone(), page_token: page_token.clone(), page_size: 0 };
            let page = self
                .inner
                .master
                .call("LineageFile", false, self.inner.master.client().lineage_file(req))
                .await?;
            all.extend(page.records);
            if page.next_page_token.is_empty() {
                return Ok(all);
            }
            page_token = page.next_page_token;
        }
    }

    /// Every job with lineage the caller may see.
    pub async fn lineage_jobs(&self) -> Result<Vec<strata_proto::LineageJob>> {
        let master = &self.inner.master;
        let list = master
            .call("ListLineageJobs", false, master.client().list_lineage_jobs(strata_proto::Empty {}))
            .await?;
        Ok(list.jobs)
    }
}

/// A last, best-effort report of the window when the client goes away inside a runtime (a
/// command that read and exits flushes explicitly instead: nothing waits for this one).
pub(crate) fn report_on_drop(inner: &mut Inner) {
    let Some(recorder) = inner.lineage.take() else { return };
    if recorder.pid != std::process::id() {
        return;
    }
    let reports = recorder.outgoing();
    if reports.is_empty() {
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
    let mut master = inner.master.client();
    let job = recorder.job.clone();
    let now = inner.config.clock.wall_ms();
    runtime.spawn(async move {
        for report in reports {
            let req = ReportLineageRequest {
                job: job.clone(),
                reads: report.reads,
                client_now_ms: now,
                report_id: report.id,
            };
            if let Ok(Err(e)) = tokio::time::timeout(CALL_DEADLINE, master.report_lineage(req)).await {
                debug!(err = %e, "last lineage report of a dropped client failed");
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(path: &str, version: &str) -> FileInfo {
        FileInfo {
            path: path.into(),
            is_dir: false,
            size: 10,
            version: version.into(),
            mtime_ms: 0,
            block_size: 4,
            file_id: format!("s3://b{path}#bs4"),
            holders: Vec::new(),
            persist: crate::Persist::Persisted,
        }
    }

    #[test]
    fn a_window_sums_per_path_and_version_and_is_bounded() {
        let r = Recorder::new(Some("j"));
        r.record(&info("/a", "v1"), 4, 10);
        r.record(&info("/a", "v1"), 6, 30);
        r.record(&info("/a", "v2"), 1, 20);
        let mut reads = r.take();
        reads.sort_by(|x, y| x.version.cmp(&y.version));
        assert_eq!(reads.len(), 2);
        assert_eq!(
            (reads[0].bytes, reads[0].reads, reads[0].first_read_ms, reads[0].last_read_ms),
            (10, 2, 10, 30)
        );
        assert_eq!(reads[0].ufs, "s3://b/a");
        assert_eq!(reads[1].version, "v2");
        assert!(r.take().is_empty(), "taken once");

        for i in 0..MAX_WINDOW + 5 {
            r.record(&info(&format!("/f{i}"), "v"), 1, 1);
        }
        assert_eq!(r.lock().entries, MAX_WINDOW);
        assert_eq!(r.dropped.load(Ordering::Relaxed), 5);
        // A file already in the window still counts when it is full.
        r.record(&info("/f0", "v"), 1, 2);
        assert_eq!(r.dropped.load(Ordering::Relaxed), 5);
    }

    #[test]
    fn an_unsent_report_goes_again_first_as_it_was_under_its_id() {
        let r = Recorder::new(None);
        r.record(&info("/a", "v1"), 4, 10);
        let first = r.outgoing();
        assert_eq!(first.len(), 1);
        r.record(&info("/a", "v1"), 1, 50);
        r.keep_unsent(first.clone());
        assert_eq!(r.pending(), 2, "the unsent report and the new window");
        let again = r.outgoing();
        assert_eq!(again.len(), 2);
        assert_eq!(again[0], first[0], "the same id and reads, not merged with newer ones");
        assert_ne!(again[1].id, first[0].id);
        assert_eq!((again[1].reads[0].bytes, again[1].reads[0].first_read_ms), (1, 50));
        assert!(r.outgoing().is_empty());

        // Kept reports are bounded: the oldest go first, counted.
        let big = |n: usize, id: &str| Report {
            id: id.into(),
            reads: (0..n).map(|i| LineageRead { path: format!("/f{i}"), ..Default::default() }).collect(),
        };
        r.keep_unsent(vec![big(MAX_WINDOW / 2, "old")]);
        r.keep_unsent(vec![big(MAX_WINDOW / 2, "newer-1"), big(10, "newer-2")]);
        let kept: Vec<String> = r.lock_unsent().iter().map(|x| x.id.clone()).collect();
        assert_eq!(kept, vec!["newer-1".to_string(), "newer-2".into()]);
        assert_eq!(r.dropped.load(Ordering::Relaxed), (MAX_WINDOW / 2) as u64);
    }

    #[test]
    fn report_ids_differ_between_recorders_and_a_window_larger_than_a_report_splits() {
        let (a, b) = (Recorder::new(None), Recorder::new(None));
        a.record(&info("/a", "v1"), 1, 1);
        b.record(&info("/a", "v1"), 1, 1);
        assert_ne!(a.outgoing()[0].id, b.outgoing()[0].id);
        for i in 0..REPORT_CHUNK + 1 {
            a.record(&info(&format!("/f{i}"), "v"), 1, 1);
        }
        let reports = a.outgoing();
        assert_eq!(reports.iter().map(|x| x.reads.len()).collect::<Vec<_>>(), vec![REPORT_CHUNK, 1]);
        assert_ne!(reports[0].id, reports[1].id);
    }

    #[test]
    fn a_carried_window_stays_in_its_process() {
        let r = Recorder::new(Some("j"));
        r.record(&info("/a", "v1"), 4, 10);
        let moved = r.carried_over();
        assert_eq!(moved.lock().entries, 1);
        assert_eq!(r.lock().entries, 0);
        let mut child = Recorder::new(Some("j"));
        child.pid = 0; // as if made in another process
        child.record(&info("/a", "v1"), 4, 10);
        assert_eq!(child.carried_over().lock().entries, 0);
    }

    #[test]
    fn ufs_location_drops_only_the_block_size_suffix() {
        assert_eq!(ufs_location("s3://b/x#bs4194304"), "s3://b/x");
        assert_eq!(ufs_location("s3://b/x#bsy"), "s3://b/x#bsy");
        assert_eq!(ufs_location("file:///d/a#bs#bs1"), "file:///d/a#bs");
    }
}
