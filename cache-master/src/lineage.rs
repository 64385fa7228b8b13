//! Lineage: which jobs read which version of which file, grouped by the marks each job made
//! in its run (docs/LINEAGE.md).
//!
//! Clients aggregate their reads per (path, version) over a short window and report them here
//! ([`Lineage::report`]); a job marks points of its run ([`Lineage::mark`]). A record is one
//! job's reads of one version of one file after one mark (its *segment*, 0 before the first
//! mark), by one token: bytes, reads, first and last read. Records merge in memory and in the
//! store in the same call, so what a report was acknowledged for survives a master restart.
//!
//! Bounds: a report holds at most [`MAX_REPORT`] entries; the master keeps at most
//! `max_records` records (the least recently read go first, counted) and forgets records and
//! marks older than the retention.
//!
//! Time: read times are the client's wall clock, corrected by the difference between the
//! master's clock and the client's when it sent the report, so reads and marks (master clock)
//! compare on one clock. A read belongs to the last mark made at or before it; a client's
//! window spans up to its flush interval, so a window of another process that straddles a mark
//! is grouped by its first read.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use strata_common::SharedClock;
use thiserror::Error;
use tracing::{info, warn};
use xxhash_rust::xxh3::xxh3_128;

use crate::metrics_defs as m;
use crate::store::{MetaStore, StoreError};

/// Most entries one report may hold (a client sends a larger window in several).
pub const MAX_REPORT: usize = 10_000;
/// The job of a client that declared none.
pub const ANONYMOUS: &str = "anonymous";
/// Longest job name, mark label or version accepted.
const MAX_NAME: usize = 512;
/// Records per query page when the request does not say, and the most a page holds.
const DEFAULT_PAGE: usize = 5_000;
const MAX_PAGE: usize = 50_000;
/// How often retention is applied (on the next report or mark after this much time).
const PRUNE_EVERY_MS: i64 = 60_000;
/// How long the master remembers a report's id, so a retry of a report it already applied (its
/// answer lost to a timeout) is acknowledged without counting its reads again. A client resends
/// a failed report within its flush interval or when the master answers again after an outage.
pub const REPORT_RECEIPT_MS: i64 = 15 * 60_000;
/// Most report ids remembered (the oldest go first): 16 MiB or so at the longest ids.
pub const MAX_RECEIPTS: usize = 100_000;
/// Longest report id accepted.
const MAX_REPORT_ID: usize = 128;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum LineageError {
    #[error("job name {0:?}: {1}")]
    BadJob(String, &'static str),
    #[error("mark label {0:?}: {1}")]
    BadLabel(String, &'static str),
    #[error("lineage report entry for {path:?}: {why}")]
    BadEntry { path: String, why: String },
    #[error("lineage report entry for {0:?}: outside the reporting token's scope")]
    OutOfScope(String),
    #[error("a lineage report holds at most {MAX_REPORT} entries, not {0}")]
    TooLarge(usize),
    #[error("no lineage recorded for job {0:?} (see `strata lineage jobs`)")]
    NoJob(String),
    #[error("job {job:?} has no mark {since:?} (see `strata lineage job {job}`)")]
    NoMark { job: String, since: String },
    #[error("malformed page token")]
    BadPageToken,
    #[error("lineage report id {0:?}: {1}")]
    BadReportId(String, &'static str),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl LineageError {
    pub fn kind(&self) -> strata_common::ErrorKind {
        use strata_common::ErrorKind as K;
        match self {
            Self::BadJob(..)
            | Self::BadLabel(..)
            | Self::BadEntry { .. }
            | Self::TooLarge(_)
            | Self::BadPageToken
            | Self::BadReportId(..) => K::InvalidArgument,
            Self::OutOfScope(_) => K::PermissionDenied,
            Self::NoJob(_) | Self::NoMark { .. } => K::NotFound,
            Self::Store(StoreError::NotLeader) => K::NotLeader,
            Self::Store(StoreError::Etcd(_)) => K::Unavailable,
            Self::Store(_) => K::Internal,
        }
    }
}

/// One job's reads of one version of one file in one segment, by one token (stored as JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LineageRecord {
    pub job: String,
    pub mark_seq: u64,
    pub path: String,
    pub version: String,
    /// The object in the UFS (mount URI joined with its relative path).
    #[serde(default)]
    pub ufs: String,
    pub reader: String,
    pub bytes: u64,
    pub reads: u64,
    pub first_read_ms: i64,
    pub last_read_ms: i64,
}

impl LineageRecord {
    fn key(&self) -> RecordKey {
        RecordKey {
            job: self.job.clone(),
            mark_seq: self.mark_seq,
            path: self.path.clone(),
            version: self.version.clone(),
            reader: self.reader.clone(),
        }
    }

    /// The record's key in the store: a hash, since names may hold any character.
    pub fn store_key(&self) -> String {
        self.key().store_key()
    }
}

/// A point a job marked in its run (stored as JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MarkRecord {
    pub job: String,
    pub seq: u64,
    pub label: String,
    pub at_ms: i64,
}

impl MarkRecord {
    pub fn store_key(&self) -> String {
        let encoded = serde_json::to_vec(&(&self.job, self.seq)).expect("strings and numbers serialise");
        format!("{:032x}", xxh3_128(&encoded))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
struct RecordKey {
    job: String,
    mark_seq: u64,
    path: String,
    version: String,
    reader: String,
}

impl RecordKey {
    fn store_key(&self) -> String {
        let encoded =
            serde_json::to_vec(&(&self.job, self.mark_seq, &self.path, &self.version, &self.reader))
                .expect("strings and numbers serialise");
        format!("{:032x}", xxh3_128(&encoded))
    }

    /// The smallest key of `job` in segment `seq` and after.
    fn first_of(job: &str, seq: u64) -> Self {
        Self {
            job: job.to_string(),
            mark_seq: seq,
            path: String::new(),
            version: String::new(),
            reader: String::new(),
        }
    }
}

/// One entry of a report, as the client sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadReport {
    pub path: String,
    pub version: String,
    pub ufs: String,
    pub bytes: u64,
    pub reads: u64,
    pub first_read_ms: i64,
    pub last_read_ms: i64,
}

#[derive(Debug, Clone, Copy)]
pub struct LineageSettings {
    /// Records and marks older than this are forgotten. Zero keeps them forever.
    pub retention: Duration,
    /// Most records kept; beyond it the least recently read are forgotten first.
    pub max_records: usize,
}

/// What a job query answers.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct JobLineage {
    pub job: String,
    pub marks: Vec<MarkRecord>,
    pub records: Vec<LineageRecord>,
    pub next_page_token: String,
}

/// One job, summed (`strata lineage jobs`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct JobSummary {
    pub job: String,
    pub files: u64,
    pub bytes: u64,
    pub first_read_ms: i64,
    pub last_read_ms: i64,
    pub marks: u64,
}

#[derive(Default)]
struct State {
    records: BTreeMap<RecordKey, LineageRecord>,
    /// Each job's marks in order of `seq`.
    marks: HashMap<String, Vec<MarkRecord>>,
    last_prune_ms: i64,
}

/// (reporting token, job, report id): whose report a receipt is for.
type ReceiptKey = (String, String, String);

/// The ids of reports applied lately, with what each answered. In memory only: a report retried
/// across a master restart or failover can count twice (docs/LINEAGE.md).
#[derive(Default)]
struct Receipts {
    answered: HashMap<ReceiptKey, usize>,
    /// When each was applied, oldest first.
    order: std::collections::VecDeque<(i64, ReceiptKey)>,
}

impl Receipts {
    fn forget_before(&mut self, horizon: i64) {
        while self.order.front().is_some_and(|(at, _)| *at < horizon) || self.order.len() > MAX_RECEIPTS {
            if let Some((_, key)) = self.order.pop_front() {
                self.answered.remove(&key);
            }
        }
    }
}

pub struct Lineage {
    store: Arc<dyn MetaStore>,
    clock: SharedClock,
    settings: LineageSettings,
    state: Mutex<State>,
    /// Held across a report with an id, from the check to the receipt, so a retry that arrives
    /// while the original is still being applied waits for it and is then answered from it.
    receipts: Mutex<Receipts>,
}

/// A job name as recorded: `anonymous` for none; control characters and overlong names refused.
pub fn job_name(raw: &str) -> Result<String, LineageError> {
    let name = raw.trim();
    if name.is_empty() {
        return Ok(ANONYMOUS.to_string());
    }
    check_name(name).map_err(|why| LineageError::BadJob(raw.to_string(), why))?;
    Ok(name.to_string())
}

fn check_name(name: &str) -> Result<(), &'static str> {
    if name.len() > MAX_NAME {
        return Err("longer than 512 bytes");
    }
    if name.chars().any(char::is_control) {
        return Err("holds a control character");
    }
    Ok(())
}

impl Lineage {
    /// The lineage the store holds, retention applied.
    pub fn load(
        store: Arc<dyn MetaStore>,
        clock: SharedClock,
        settings: LineageSettings,
    ) -> Result<Self, StoreError> {
        let (records, marks) = store.load_lineage()?;
        let mut state = State::default();
        for r in records {
            state.records.insert(r.key(), r);
        }
        for mark in marks {
            state.marks.entry(mark.job.clone()).or_default().push(mark);
        }
        for marks in state.marks.values_mut() {
            marks.sort_by_key(|m| m.seq);
        }
        let lineage = Self { store, clock, settings, state: Mutex::new(state), receipts: Mutex::default() };
        {
            let mut state = lineage.lock();
            let now = lineage.clock.wall_ms();
            if let Err(e) = lineage.prune(&mut state, now) {
                warn!(err = %e, "lineage past its retention could not be dropped from the store; trying again later");
            }
            info!(records = state.records.len(), jobs = state.marks.len(), "lineage loaded");
            metrics::gauge!(m::LINEAGE_RECORDS).set(state.records.len() as f64);
        }
        Ok(lineage)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// [`Lineage::report`] once per `report_id` (the client's id for this report, the same on
    /// every retry of it): a report with an id applied in the last [`REPORT_RECEIPT_MS`] is
    /// answered as it was then, not counted again. An empty id is applied every time.
    pub fn report_once(
        &self,
        job: &str,
        reader: &str,
        report_id: &str,
        reads: Vec<ReadReport>,
        client_now_ms: i64,
        in_scope: impl Fn(&str) -> bool,
    ) -> Result<usize, LineageError> {
        if report_id.is_empty() {
            return self.report(job, reader, reads, client_now_ms, in_scope);
        }
        if report_id.len() > MAX_REPORT_ID {
            return Err(LineageError::BadReportId(report_id.into(), "longer than 128 bytes"));
        }
        if report_id.chars().any(char::is_control) {
            return Err(LineageError::BadReportId(report_id.into(), "holds a control character"));
        }
        let key = (reader.to_string(), job_name(job)?, report_id.to_string());
        let mut receipts = self.receipts.lock().unwrap_or_else(|p| p.into_inner());
        let now = self.clock.wall_ms();
        receipts.forget_before(now.saturating_sub(REPORT_RECEIPT_MS));
        if let Some(&recorded) = receipts.answered.get(&key) {
            metrics::counter!(m::LINEAGE_REPEATED_REPORTS).increment(1);
            info!(job = %key.1, report = %key.2, "a lineage report sent again was already recorded; not counted twice");
            return Ok(recorded);
        }
        let recorded = self.report(job, reader, reads, client_now_ms, in_scope)?;
        receipts.answered.insert(key.clone(), recorded);
        receipts.order.push_back((now, key));
        receipts.forget_before(now.saturating_sub(REPORT_RECEIPT_MS));
        Ok(recorded)
    }

    /// Merges one client's window of reads into the job's records. `reader` is the reporting
    /// token's id; `in_scope` says whether it may read a path (entries outside are refused, the
    /// whole report with them). Returns the entries recorded.
    pub fn report(
        &self,
        job: &str,
        reader: &str,
        reads: Vec<ReadReport>,
        client_now_ms: i64,
        in_scope: impl Fn(&str) -> bool,
    ) -> Result<usize, LineageError> {
        let job = job_name(job)?;
        if reads.len() > MAX_REPORT {
            return Err(LineageError::TooLarge(reads.len()));
        }
        let mut checked = Vec::with_capacity(reads.len());
        for r in reads {
            let path = strata_common::path::normalize(&r.path)
                .map_err(|e| LineageError::BadEntry { path: r.path.clone(), why: e.to_string() })?;
            if let Err(why) = check_name(&r.version) {
                return Err(LineageError::BadEntry { path, why: format!("version {why}") });
            }
            if r.ufs.len() > strata_common::path::MAX_PATH_LEN + MAX_NAME
                || r.ufs.chars().any(char::is_control)
            {
                return Err(LineageError::BadEntry { path, why: "malformed UFS location".into() });
            }
            if !in_scope(&path) {
                return Err(LineageError::OutOfScope(path));
            }
            checked.push(ReadReport { path, ..r });
        }
        let now = self.clock.wall_ms();
        // The client's clock against ours; unknown (0): taken as ours.
        let skew = if client_now_ms > 0 { now - client_now_ms } else { 0 };
        let mut state = self.lock();
        let marks = state.marks.get(&job).cloned().unwrap_or_default();
        let mut merged: BTreeMap<RecordKey, LineageRecord> = BTreeMap::new();
        for r in checked {
            let last = r.last_read_ms.saturating_add(skew).min(now);
            let first = r.first_read_ms.saturating_add(skew).min(last);
            let mark_seq = marks.iter().rev().find(|m| m.at_ms <= first).map_or(0, |m| m.seq);
            let record = LineageRecord {
                job: job.clone(),
                mark_seq,
                path: r.path,
                version: r.version,
                ufs: r.ufs,
                reader: reader.to_string(),
                bytes: r.bytes,
                reads: r.reads.max(1),
                first_read_ms: first,
                last_read_ms: last,
            };
            let key = record.key();
            let base = merged.remove(&key).or_else(|| state.records.get(&key).cloned());
            merged.insert(key, merge(base, record));
        }
        let changed: Vec<LineageRecord> = merged.values().cloned().collect();
        self.store.put_lineage(&changed, &[])?;
        let recorded = changed.len();
        state.records.extend(merged);
        metrics::counter!(m::LINEAGE_REPORTS).increment(1);
        self.bound(&mut state);
        if now - state.last_prune_ms >= PRUNE_EVERY_MS
            && let Err(e) = self.prune(&mut state, now)
        {
            warn!(err = %e, "lineage past its retention could not be dropped from the store; trying again later");
        }
        metrics::gauge!(m::LINEAGE_RECORDS).set(state.records.len() as f64);
        Ok(recorded)
    }

    /// Marks a point in `job`'s run: reads from now on are grouped under it.
    pub fn mark(&self, job: &str, label: &str) -> Result<MarkRecord, LineageError> {
        let job = job_name(job)?;
        let label = label.trim();
        if label.is_empty() {
            return Err(LineageError::BadLabel(label.to_string(), "empty"));
        }
        check_name(label).map_err(|why| LineageError::BadLabel(label.to_string(), why))?;
        let mut state = self.lock();
        let now = self.clock.wall_ms();
        let marks = state.marks.entry(job.clone()).or_default();
        let last = marks.last();
        let mark = MarkRecord {
            job,
            seq: last.map_or(1, |m| m.seq + 1),
            label: label.to_string(),
            // Marks stay in order even if the clock steps back.
            at_ms: last.map_or(now, |m| m.at_ms.max(now)),
        };
        self.store.put_lineage(&[], std::slice::from_ref(&mark))?;
        marks.push(mark.clone());
        Ok(mark)
    }

    /// `job`'s marks and its records from the segment `since` names on (empty: all; `#N`: mark
    /// number N; else the last mark with that label), those whose path `visible` allows, a
    /// page at a time in (segment, path, version, reader) order.
    pub fn job(
        &self,
        job: &str,
        since: &str,
        page_token: &str,
        page_size: usize,
        visible: impl Fn(&str) -> bool,
    ) -> Result<JobLineage, LineageError> {
        let job = job_name(job)?;
        let state = self.lock();
        let marks = state.marks.get(&job).cloned().unwrap_or_default();
        let first = RecordKey::first_of(&job, 0);
        let has_records = state.records.range(first..).next().is_some_and(|(k, _)| k.job == job);
        if marks.is_empty() && !has_records {
            return Err(LineageError::NoJob(job));
        }
        let since_seq = since_seq(&job, &marks, since)?;
        let start = match page_token {
            "" => std::ops::Bound::Included(RecordKey::first_of(&job, since_seq)),
            token => {
                let key: RecordKey = decode_token(token)?;
                if key.job != job {
                    return Err(LineageError::BadPageToken);
                }
                std::ops::Bound::Excluded(key)
            }
        };
        let size = page(page_size);
        let mut records = Vec::new();
        let mut next_page_token = String::new();
        for (key, record) in state.records.range((start, std::ops::Bound::Unbounded)) {
            if key.job != job {
                break;
            }
            if !visible(&record.path) {
                continue;
            }
            if records.len() == size {
                next_page_token = encode_token(&records.last().map(LineageRecord::key).expect("a full page"));
                break;
            }
            records.push(record.clone());
        }
        Ok(JobLineage { job, marks, records, next_page_token })
    }

    /// Every job's reads of `path`, a page at a time in (job, segment, version, reader) order.
    pub fn file(
        &self,
        path: &str,
        page_token: &str,
        page_size: usize,
    ) -> Result<(Vec<LineageRecord>, String), LineageError> {
        let path = strata_common::path::normalize(path)
            .map_err(|e| LineageError::BadEntry { path: path.to_string(), why: e.to_string() })?;
        let after: Option<RecordKey> = match page_token {
            "" => None,
            token => Some(decode_token(token)?),
        };
        let size = page(page_size);
        let state = self.lock();
        let mut records = Vec::new();
        let mut next = String::new();
        for (key, record) in &state.records {
            if record.path != path || after.as_ref().is_some_and(|a| key <= a) {
                continue;
            }
            if records.len() == size {
                next = encode_token(&records.last().map(LineageRecord::key).expect("a full page"));
                break;
            }
            records.push(record.clone());
        }
        Ok((records, next))
    }

    /// Every job with lineage, summed over the records `visible` allows.
    pub fn jobs(&self, visible: impl Fn(&str) -> bool) -> Vec<JobSummary> {
        let state = self.lock();
        // Per job: its sums, and the (path, version) pairs it read.
        type Summing<'a> = (JobSummary, std::collections::HashSet<(&'a str, &'a str)>);
        let mut out: BTreeMap<&str, Summing<'_>> = BTreeMap::new();
        for (job, marks) in &state.marks {
            let entry = out.entry(job).or_default();
            entry.0.marks = marks.len() as u64;
        }
        for record in state.records.values().filter(|r| visible(&r.path)) {
            let (sum, files) = out.entry(&record.job).or_default();
            files.insert((&record.path, &record.version));
            sum.bytes += record.bytes;
            sum.first_read_ms = if sum.first_read_ms == 0 {
                record.first_read_ms
            } else {
                sum.first_read_ms.min(record.first_read_ms)
            };
            sum.last_read_ms = sum.last_read_ms.max(record.last_read_ms);
        }
        out.into_iter()
            .map(|(job, (sum, files))| JobSummary { job: job.to_string(), files: files.len() as u64, ..sum })
            .collect()
    }

    /// Keeps at most `max_records`, forgetting the least recently read (a tenth more than the
    /// excess at once, so a full book does not sort on every report).
    fn bound(&self, state: &mut State) {
        let max = self.settings.max_records.max(1);
        if state.records.len() <= max {
            return;
        }
        let excess = state.records.len() - max;
        let drop_n = (excess + max / 10).min(state.records.len());
        let mut by_age: Vec<(i64, RecordKey)> =
            state.records.iter().map(|(k, r)| (r.last_read_ms, k.clone())).collect();
        by_age.select_nth_unstable_by_key(drop_n - 1, |(at, _)| *at);
        let gone: Vec<RecordKey> = by_age.into_iter().take(drop_n).map(|(_, k)| k).collect();
        let keys: Vec<String> = gone.iter().map(RecordKey::store_key).collect();
        match self.store.delete_lineage(&keys, &[]) {
            Ok(()) => {
                for k in &gone {
                    state.records.remove(k);
                }
                metrics::counter!(m::LINEAGE_DROPPED, "why" => "max_records").increment(gone.len() as u64);
                warn!(
                    dropped = gone.len(),
                    max,
                    "lineage holds more records than lineage_max_records; the least recently read were forgotten"
                );
            }
            Err(e) => {
                warn!(err = %e, "lineage over its bound could not be trimmed in the store; trying again later")
            }
        }
    }

    /// Forgets records last read, and marks made, before the retention; a job's last mark stays
    /// while the job has records, so its numbering goes on.
    fn prune(&self, state: &mut State, now: i64) -> Result<(), StoreError> {
        state.last_prune_ms = now;
        if self.settings.retention.is_zero() {
            return Ok(());
        }
        let horizon = now.saturating_sub(self.settings.retention.as_millis().min(i64::MAX as u128) as i64);
        let old: Vec<RecordKey> =
            state.records.iter().filter(|(_, r)| r.last_read_ms < horizon).map(|(k, _)| k.clone()).collect();
        let mut jobs_with_records: std::collections::HashSet<&str> = std::collections::HashSet::new();
        let old_set: std::collections::HashSet<&RecordKey> = old.iter().collect();
        for k in state.records.keys().filter(|k| !old_set.contains(k)) {
            jobs_with_records.insert(&k.job);
        }
        let mut old_marks = Vec::new();
        for (job, marks) in &state.marks {
            let keep_last = jobs_with_records.contains(job.as_str());
            for (i, mark) in marks.iter().enumerate() {
                let last = i + 1 == marks.len();
                if mark.at_ms < horizon && !(last && keep_last) {
                    old_marks.push(mark.clone());
                }
            }
        }
        if old.is_empty() && old_marks.is_empty() {
            return Ok(());
        }
        let record_keys: Vec<String> = old.iter().map(RecordKey::store_key).collect();
        let mark_keys: Vec<String> = old_marks.iter().map(MarkRecord::store_key).collect();
        self.store.delete_lineage(&record_keys, &mark_keys)?;
        for k in &old {
            state.records.remove(k);
        }
        for mark in &old_marks {
            if let Some(marks) = state.marks.get_mut(&mark.job) {
                marks.retain(|m| m.seq != mark.seq);
                if marks.is_empty() {
                    state.marks.remove(&mark.job);
                }
            }
        }
        metrics::counter!(m::LINEAGE_DROPPED, "why" => "retention").increment(old.len() as u64);
        info!(records = old.len(), marks = old_marks.len(), "lineage past its retention dropped");
        Ok(())
    }

    /// Applies retention now (tests; the master does it as reports arrive).
    pub fn prune_now(&self) -> Result<(), StoreError> {
        let mut state = self.lock();
        let now = self.clock.wall_ms();
        self.prune(&mut state, now)
    }
}

fn merge(base: Option<LineageRecord>, new: LineageRecord) -> LineageRecord {
    match base {
        None => new,
        Some(old) => LineageRecord {
            bytes: old.bytes.saturating_add(new.bytes),
            reads: old.reads.saturating_add(new.reads),
            first_read_ms: old.first_read_ms.min(new.first_read_ms),
            last_read_ms: old.last_read_ms.max(new.last_read_ms),
            // The location of the latest report (a mount moved to another URI).
            ufs: if new.ufs.is_empty() { old.ufs } else { new.ufs },
            ..new
        },
    }
}

fn since_seq(job: &str, marks: &[MarkRecord], since: &str) -> Result<u64, LineageError> {
    let since = since.trim();
    if since.is_empty() {
        return Ok(0);
    }
    let found = match since.strip_prefix('#').and_then(|n| n.parse::<u64>().ok()) {
        Some(seq) => marks.iter().find(|m| m.seq == seq),
        None => marks.iter().rev().find(|m| m.label == since),
    };
    found
        .map(|m| m.seq)
        .ok_or_else(|| LineageError::NoMark { job: job.to_string(), since: since.to_string() })
}

fn page(asked: usize) -> usize {
    if asked == 0 { DEFAULT_PAGE } else { asked.min(MAX_PAGE) }
}

fn encode_token(key: &RecordKey) -> String {
    serde_json::to_string(key).expect("strings and numbers serialise")
}

fn decode_token(token: &str) -> Result<RecordKey, LineageError> {
    serde_json::from_str(token).map_err(|_| LineageError::BadPageToken)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::RedbStore;
    use strata_common::Clock;
    use strata_common::clock::ManualClock;

    const DAY: Duration = Duration::from_secs(86_400);

    fn read(path: &str, version: &str, bytes: u64, at: i64) -> ReadReport {
        ReadReport {
            path: path.into(),
            version: version.into(),
            ufs: format!("file:///ufs{path}"),
            bytes,
            reads: 1,
            first_read_ms: at,
            last_read_ms: at,
        }
    }

    fn open(
        dir: &std::path::Path,
        clock: &Arc<ManualClock>,
        settings: LineageSettings,
    ) -> (Arc<RedbStore>, Lineage) {
        let store = Arc::new(RedbStore::open(&dir.join("master.redb")).unwrap());
        let lineage = Lineage::load(store.clone(), clock.clone(), settings).unwrap();
        (store, lineage)
    }

    fn settings() -> LineageSettings {
        LineageSettings { retention: 30 * DAY, max_records: 1000 }
    }

    fn all(_: &str) -> bool {
        true
    }

    #[test]
    fn reads_merge_by_segment_and_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new();
        let (store, lineage) = open(dir.path(), &clock, settings());
        let t0 = clock.wall_ms();
        lineage
            .report(
                "train",
                "-",
                vec![read("/d/a", "v1", 10, t0 - 5), read("/d/b", "v1", 20, t0 - 4)],
                t0,
                all,
            )
            .unwrap();
        // The same file again in another window: one record, summed.
        lineage.report("train", "-", vec![read("/d/a", "v1", 5, t0 - 1)], t0, all).unwrap();
        clock.advance(Duration::from_secs(1));
        let mark = lineage.mark("train", "epoch=1").unwrap();
        assert_eq!((mark.seq, mark.at_ms), (1, t0 + 1000));
        clock.advance(Duration::from_secs(1));
        let t2 = clock.wall_ms();
        lineage.report("train", "-", vec![read("/d/a", "v2", 7, t2)], t2, all).unwrap();
        // A late report of a read made before the mark still lands before it.
        lineage.report("train", "-", vec![read("/d/c", "v1", 3, t0 + 500)], t2, all).unwrap();

        let check = |lineage: &Lineage| {
            let all_of = lineage.job("train", "", "", 0, all).unwrap();
            let got: Vec<(u64, &str, &str, u64, u64)> = all_of
                .records
                .iter()
                .map(|r| (r.mark_seq, r.path.as_str(), r.version.as_str(), r.bytes, r.reads))
                .collect();
            assert_eq!(
                got,
                vec![
                    (0, "/d/a", "v1", 15, 2),
                    (0, "/d/b", "v1", 20, 1),
                    (0, "/d/c", "v1", 3, 1),
                    (1, "/d/a", "v2", 7, 1)
                ]
            );
            assert_eq!(all_of.marks.len(), 1);
            let since = lineage.job("train", "epoch=1", "", 0, all).unwrap();
            assert_eq!(since.records.len(), 1);
            assert_eq!(since.records[0].version, "v2");
            assert_eq!(lineage.job("train", "#1", "", 0, all).unwrap().records, since.records);
            assert!(matches!(lineage.job("train", "epoch=9", "", 0, all), Err(LineageError::NoMark { .. })));
        };
        check(&lineage);
        drop(lineage);
        store.close();
        drop(store);
        let (_store, lineage) = open(dir.path(), &clock, settings());
        check(&lineage);
        // Numbering goes on after the restart.
        assert_eq!(lineage.mark("train", "epoch=2").unwrap().seq, 2);
    }

    #[test]
    fn a_report_sent_again_under_its_id_counts_once_for_a_while() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new();
        let (_store, lineage) = open(dir.path(), &clock, settings());
        let t0 = clock.wall_ms();
        let reads = || vec![read("/d/a", "v1", 10, t0), read("/d/b", "v1", 1, t0)];
        let totals = |lineage: &Lineage| -> (u64, u64) {
            let records = lineage.job("j", "", "", 0, all).unwrap().records;
            (records.iter().map(|r| r.bytes).sum(), records.iter().map(|r| r.reads).sum())
        };
        assert_eq!(lineage.report_once("j", "tok", "c1-0", reads(), t0, all).unwrap(), 2);
        // The retry of a report whose answer was lost: answered as before, not counted again.
        assert_eq!(lineage.report_once("j", "tok", "c1-0", reads(), t0, all).unwrap(), 2);
        assert_eq!(totals(&lineage), (11, 2));
        // Another report of the same client, the same id from another token or for another
        // job, and a report without an id are each counted.
        lineage.report_once("j", "tok", "c1-1", reads(), t0, all).unwrap();
        lineage.report_once("j", "other", "c1-0", reads(), t0, all).unwrap();
        lineage.report_once("j", "tok", "", reads(), t0, all).unwrap();
        lineage.report_once("j", "tok", "", reads(), t0, all).unwrap();
        assert_eq!(totals(&lineage), (55, 10));
        lineage.report_once("k", "tok", "c1-0", reads(), t0, all).unwrap();
        assert_eq!(totals(&lineage), (55, 10), "job k's records are its own");
        // A refused report leaves no receipt: sent again after a fix, it counts.
        let bad = vec![read("no/leading/slash\0", "v1", 1, t0), read("/d/c", "\u{7}", 1, t0)];
        assert!(lineage.report_once("j", "tok", "c1-2", bad, t0, all).is_err());
        lineage.report_once("j", "tok", "c1-2", vec![read("/d/c", "v1", 1, t0)], t0, all).unwrap();
        assert_eq!(totals(&lineage), (56, 11));
        // Past the receipt's time the id is forgotten (the client resends long before that).
        clock.advance(Duration::from_millis(REPORT_RECEIPT_MS as u64 + 1));
        let t1 = clock.wall_ms();
        lineage.report_once("j", "tok", "c1-0", vec![read("/d/a", "v1", 10, t1)], t1, all).unwrap();
        assert_eq!(totals(&lineage), (66, 12));
        // Malformed ids are refused with the reason.
        let long = "x".repeat(129);
        for (id, why) in [(long.as_str(), "longer than 128 bytes"), ("a\nb", "control character")] {
            let err = lineage.report_once("j", "tok", id, reads(), t1, all).unwrap_err();
            assert!(err.to_string().contains(why), "{err}");
            assert_eq!(err.kind(), strata_common::ErrorKind::InvalidArgument);
        }
    }

    #[test]
    fn receipts_are_bounded() {
        let mut receipts = Receipts::default();
        for i in 0..MAX_RECEIPTS + 3 {
            let key = ("t".to_string(), "j".to_string(), format!("r{i}"));
            receipts.answered.insert(key.clone(), 1);
            receipts.order.push_back((0, key));
            receipts.forget_before(0);
        }
        assert_eq!(receipts.answered.len(), MAX_RECEIPTS);
        assert!(!receipts.answered.contains_key(&("t".into(), "j".into(), "r2".into())));
        assert!(receipts.answered.contains_key(&("t".into(), "j".into(), "r3".into())));
    }

    #[test]
    fn a_clients_clock_is_corrected_and_no_read_is_in_the_future() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new();
        let (_store, lineage) = open(dir.path(), &clock, settings());
        lineage.mark("j", "start").unwrap();
        let now = clock.wall_ms();
        // The client's clock runs an hour ahead: its read a second ago is after the mark.
        let ahead = now + 3_600_000;
        lineage.report("j", "-", vec![read("/x", "v", 1, ahead - 1000)], ahead, all).unwrap();
        let r = &lineage.job("j", "", "", 0, all).unwrap().records[0];
        assert_eq!((r.first_read_ms, r.mark_seq), (now - 1000, 0));
        // A read stamped after the report was sent is clamped to now.
        lineage.report("j", "-", vec![read("/y", "v", 1, now + 50_000)], now, all).unwrap();
        let r =
            lineage.job("j", "", "", 0, all).unwrap().records.into_iter().find(|r| r.path == "/y").unwrap();
        assert_eq!((r.last_read_ms, r.mark_seq), (now, 1));
    }

    #[test]
    fn bad_reports_are_refused_whole() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new();
        let (_store, lineage) = open(dir.path(), &clock, settings());
        let now = clock.wall_ms();
        let bad =
            lineage.report("j", "-", vec![read("/ok", "v", 1, now), read("relative", "v", 1, now)], now, all);
        assert!(matches!(bad, Err(LineageError::BadEntry { .. })), "{bad:?}");
        let scoped =
            lineage.report("j", "-", vec![read("/team-b/x", "v", 1, now)], now, |p| p.starts_with("/team-a"));
        assert_eq!(scoped.unwrap_err().kind(), strata_common::ErrorKind::PermissionDenied);
        assert!(matches!(lineage.report("j\u{1}x", "-", vec![], now, all), Err(LineageError::BadJob(..))));
        let many = vec![read("/a", "v", 1, now); MAX_REPORT + 1];
        assert!(matches!(lineage.report("j", "-", many, now, all), Err(LineageError::TooLarge(_))));
        assert!(matches!(lineage.mark("j", "  "), Err(LineageError::BadLabel(..))));
        // Nothing of a refused report was kept.
        assert!(matches!(lineage.job("j", "", "", 0, all), Err(LineageError::NoJob(_))));
        // No job: anonymous.
        lineage.report("", "-", vec![read("/a", "v", 1, now)], now, all).unwrap();
        assert_eq!(lineage.job(ANONYMOUS, "", "", 0, all).unwrap().records.len(), 1);
    }

    #[test]
    fn retention_forgets_old_records_and_marks_but_keeps_numbering() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new();
        let (store, lineage) = open(dir.path(), &clock, settings());
        let now = clock.wall_ms();
        lineage.report("old", "-", vec![read("/a", "v", 1, now)], now, all).unwrap();
        lineage.mark("kept", "m1").unwrap();
        lineage.report("kept", "-", vec![read("/a", "v", 1, now)], now, all).unwrap();
        clock.advance(20 * DAY);
        let later = clock.wall_ms();
        lineage.report("kept", "-", vec![read("/b", "v", 1, later)], later, all).unwrap();
        clock.advance(15 * DAY);
        lineage.prune_now().unwrap();
        assert!(matches!(lineage.job("old", "", "", 0, all), Err(LineageError::NoJob(_))));
        let kept = lineage.job("kept", "", "", 0, all).unwrap();
        assert_eq!(kept.records.iter().map(|r| r.path.as_str()).collect::<Vec<_>>(), vec!["/b"]);
        // Its only mark is older than the retention, and stays: the next one is number 2.
        assert_eq!(kept.marks.len(), 1);
        assert_eq!(lineage.mark("kept", "m2").unwrap().seq, 2);
        // And the store forgot them too.
        drop(lineage);
        let reopened = Lineage::load(store, clock.clone(), settings()).unwrap();
        assert!(matches!(reopened.job("old", "", "", 0, all), Err(LineageError::NoJob(_))));
    }

    #[test]
    fn the_book_is_bounded_and_pages_walk_it_whole() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new();
        let (_store, lineage) =
            open(dir.path(), &clock, LineageSettings { retention: Duration::ZERO, max_records: 100 });
        let now = clock.wall_ms();
        let reads: Vec<ReadReport> =
            (0..150).map(|i| read(&format!("/f{i:03}"), "v", 1, now - 1000 + i)).collect();
        lineage.report("j", "-", reads, now, all).unwrap();
        let mut seen = Vec::new();
        let mut token = String::new();
        loop {
            let page = lineage.job("j", "", &token, 7, all).unwrap();
            assert!(page.records.len() <= 7);
            seen.extend(page.records.into_iter().map(|r| r.path));
            if page.next_page_token.is_empty() {
                break;
            }
            token = page.next_page_token;
        }
        // At most 100 kept; the least recently read (the first files) went first.
        assert!(seen.len() <= 100 && seen.len() >= 90, "{}", seen.len());
        assert_eq!(seen.last().map(String::as_str), Some("/f149"));
        assert!(!seen.contains(&"/f000".to_string()));
        let mut sorted = seen.clone();
        sorted.sort();
        assert_eq!(seen, sorted, "pages are in order, none repeated");
        assert!(matches!(lineage.job("j", "", "not a token", 0, all), Err(LineageError::BadPageToken)));
    }

    #[test]
    fn a_file_query_lists_every_job_and_version() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new();
        let (_store, lineage) = open(dir.path(), &clock, settings());
        let now = clock.wall_ms();
        lineage
            .report("a", "-", vec![read("/d/x", "v1", 1, now), read("/d/y", "v1", 1, now)], now, all)
            .unwrap();
        lineage.report("b", "-", vec![read("/d/x", "v2", 2, now)], now, all).unwrap();
        let (records, next) = lineage.file("/d/x", "", 0).unwrap();
        assert!(next.is_empty());
        let got: Vec<(&str, &str)> = records.iter().map(|r| (r.job.as_str(), r.version.as_str())).collect();
        assert_eq!(got, vec![("a", "v1"), ("b", "v2")]);
        let jobs = lineage.jobs(all);
        assert_eq!(
            jobs.iter().map(|j| (j.job.as_str(), j.files)).collect::<Vec<_>>(),
            vec![("a", 2), ("b", 1)]
        );
        // A token scoped elsewhere sees none of a job's files.
        assert_eq!(lineage.jobs(|p| p.starts_with("/e")).iter().map(|j| j.files).sum::<u64>(), 0);
    }
}
