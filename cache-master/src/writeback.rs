//! Files written to `mode=write-back` mounts and not yet in the UFS: the master's half of
//! write-back (docs/WRITEBACK.md). Workers hold the bytes in journals; the master holds, per
//! path, the last acknowledged version (durably, in the store), decides which holder uploads
//! it and when, and overlays these files on the UFS's metadata so every client sees them at once.
//!
//! Invariants:
//! - a record is in the store before its commit is answered (the commit is the acknowledgement
//!   a client waits for), and leaves it only when that version is in the UFS, a newer write or a
//!   delete replaced it;
//! - at most one upload per path runs at a time, and a newer version is uploaded only after an
//!   older one's upload ended, so the UFS ends with the last acknowledged version;
//! - an upload assigned to a worker that is no longer live, or that says it is not uploading
//!   it, is assigned again (to any live holder).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use strata_common::SharedClock;
use tracing::{info, warn};

use crate::error::OpError;
use crate::locks::lock;
use crate::metrics_defs as m;
use crate::store::MetaStore;

/// Versions of write-back files start with this, so anything that sees one (a worker asked for
/// a block, a client) knows its bytes are in journals, not in the UFS.
pub const VERSION_PREFIX: &str = strata_common::block::WRITE_BACK_VERSION_PREFIX;

/// A journal the master does not know is dropped only when older than this: a write whose
/// journals are durable but whose commit has not reached the master yet is never dropped.
pub const UNKNOWN_JOURNAL_GRACE_MS: u64 = 120_000;

/// The durable record of a pending file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingRecord {
    pub path: String,
    pub write_id: String,
    pub size: u64,
    pub mtime_ms: i64,
    /// Workers whose journals hold the file, the primary first.
    pub holders: Vec<String>,
    pub committed_unix_ms: i64,
    /// Why the upload gave up (retries spent); `None` while it may go on.
    #[serde(default)]
    pub failed: Option<String>,
}

impl PendingRecord {
    pub fn version(&self) -> String {
        format!("{VERSION_PREFIX}{}", self.write_id)
    }
}

/// Where a pending file stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PersistState {
    Pending,
    Uploading,
    Failed,
}

/// A pending file as clients see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingView {
    pub record: PendingRecord,
    pub state: PersistState,
    /// The worker uploading it (when `Uploading`).
    pub uploader: String,
    /// The last upload attempt's error, if it failed.
    pub error: String,
}

/// The upload running for a path (possibly of a version a newer one has replaced).
#[derive(Debug, Clone)]
struct Running {
    write_id: String,
    worker: String,
    /// The path was deleted while this upload ran: delete it from the UFS again when it ends.
    deleted: bool,
}

#[derive(Default)]
struct State {
    files: BTreeMap<String, PendingRecord>,
    running: HashMap<String, Running>,
    /// The last failed attempt's error per path (soft: the worker goes on retrying).
    last_error: HashMap<String, String>,
    /// Write ids decided since this master started (persisted, replaced, deleted): their
    /// journals are dropped at once. Bounded; an id it forgot waits out the grace instead.
    finished: HashSet<String>,
    finished_order: std::collections::VecDeque<String>,
    /// When finished ids were persisted (their journals outlive that by the grace).
    persisted_at: HashMap<String, std::time::Instant>,
}

/// Most finished write ids remembered.
const FINISHED_REMEMBERED: usize = 100_000;

impl State {
    fn finish(&mut self, write_id: &str) {
        if self.finished.insert(write_id.to_string()) {
            self.finished_order.push_back(write_id.to_string());
            if self.finished_order.len() > FINISHED_REMEMBERED
                && let Some(old) = self.finished_order.pop_front()
            {
                self.finished.remove(&old);
                self.persisted_at.remove(&old);
            }
        }
    }
}

/// What an upload's end asks of the caller.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct UploadEnded {
    /// Write ids the reporting worker should upload next.
    pub upload: Vec<String>,
    /// The path is now in the UFS: forget cached metadata of it.
    pub persisted: Option<String>,
    /// The path was deleted while its upload ran: delete it from the UFS.
    pub delete_again: Option<String>,
}

/// What a heartbeat's journal report asks of the worker.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct JournalOrders {
    pub upload: Vec<String>,
    pub drop: Vec<String>,
}

/// One journal a worker reports.
#[derive(Debug, Clone)]
pub struct HeldJournal {
    pub write_id: String,
    pub path: String,
    pub uploading: bool,
    pub age_ms: u64,
}

/// A commit of a write a primary worker reports.
#[derive(Debug, Clone)]
pub struct Commit {
    pub worker_id: String,
    pub path: String,
    pub write_id: String,
    pub size: u64,
    pub mtime_ms: i64,
    pub holders: Vec<String>,
    /// Written through to the UFS by the primary (disk-full fallback): nothing to upload.
    pub persisted: bool,
}

pub struct WriteBack {
    store: Arc<dyn MetaStore>,
    clock: SharedClock,
    /// How long a persisted file's journals are kept for readers of its pending version.
    grace: Duration,
    state: Mutex<State>,
}

impl WriteBack {
    /// The pending files of the store. Uploads that were running are assigned again when their
    /// holders report.
    pub fn load(store: Arc<dyn MetaStore>, clock: SharedClock, grace: Duration) -> Result<Self, OpError> {
        let mut state = State::default();
        for record in store.load_pending()? {
            state.files.insert(record.path.clone(), record);
        }
        if !state.files.is_empty() {
            info!(files = state.files.len(), "write-back files still to upload");
        }
        let wb = Self { store, clock, grace, state: Mutex::new(state) };
        wb.gauges(&lock(&wb.state));
        Ok(wb)
    }

    /// Records an acknowledged write; answers whether the primary should upload it now.
    pub fn commit(&self, c: Commit) -> Result<bool, OpError> {
        if c.write_id.is_empty() || c.holders.first() != Some(&c.worker_id) {
            return Err(OpError::BadCommit(format!(
                "{}: a commit needs a write id and the committing worker as its first holder",
                c.path
            )));
        }
        let mut st = lock(&self.state);
        if c.persisted {
            // The UFS has this version already: an older pending one must never overwrite it.
            if st.files.contains_key(&c.path) {
                self.store.delete_pending(&c.path)?;
                if let Some(old) = st.files.remove(&c.path) {
                    st.finish(&old.write_id);
                }
            }
            st.finish(&c.write_id);
            st.last_error.remove(&c.path);
            self.gauges(&st);
            info!(path = %c.path, write_id = %c.write_id, "written through (write-back journal full)");
            return Ok(false);
        }
        let record = PendingRecord {
            path: c.path.clone(),
            write_id: c.write_id.clone(),
            size: c.size,
            mtime_ms: c.mtime_ms,
            holders: c.holders,
            committed_unix_ms: self.clock.wall_ms(),
            failed: None,
        };
        self.store.put_pending(&record)?;
        let replaced = st.files.insert(c.path.clone(), record);
        if let Some(old) = &replaced {
            st.finish(&old.write_id);
        }
        st.last_error.remove(&c.path);
        let upload_now = !st.running.contains_key(&c.path);
        if upload_now {
            st.running.insert(
                c.path.clone(),
                Running { write_id: c.write_id.clone(), worker: c.worker_id.clone(), deleted: false },
            );
        }
        self.gauges(&st);
        info!(
            path = %c.path, write_id = %c.write_id, bytes = c.size,
            replaced = replaced.map(|r| r.write_id).unwrap_or_default(), upload_now,
            "write-back file committed"
        );
        Ok(upload_now)
    }

    /// A worker's report on an upload: success (`error` empty), a failed attempt it retries, or
    /// a failure it gave up on.
    pub fn upload_result(
        &self,
        worker: &str,
        path: &str,
        write_id: &str,
        error: &str,
        gave_up: bool,
        live: &HashSet<String>,
    ) -> Result<UploadEnded, OpError> {
        let mut st = lock(&self.state);
        let mut out = UploadEnded::default();
        let running = st.running.get(path).filter(|r| r.write_id == write_id && r.worker == worker).cloned();
        if !error.is_empty() && !gave_up {
            // Still retrying: only the reason changes.
            st.last_error.insert(path.to_string(), error.to_string());
            return Ok(out);
        }
        if running.is_some() {
            st.running.remove(path);
        }
        let current = st.files.get(path).filter(|r| r.write_id == write_id).cloned();
        if error.is_empty() {
            metrics::counter!(m::WRITEBACK_UPLOADS, "result" => "persisted").increment(1);
            st.finish(write_id);
            if current.is_some() {
                st.persisted_at.insert(write_id.to_string(), self.clock.now());
                self.store.delete_pending(path)?;
                st.files.remove(path);
                st.last_error.remove(path);
                out.persisted = Some(path.to_string());
                info!(path, write_id, worker, "write-back file persisted");
            }
            if running.is_some_and(|r| r.deleted) && !st.files.contains_key(path) {
                out.delete_again = Some(path.to_string());
            }
        } else if let Some(mut record) = current {
            metrics::counter!(m::WRITEBACK_UPLOADS, "result" => "failed").increment(1);
            warn!(path, write_id, worker, error, "write-back upload gave up");
            record.failed = Some(error.to_string());
            self.store.put_pending(&record)?;
            st.files.insert(path.to_string(), record);
        }
        // A newer version that waited for this upload goes next, preferably here.
        if let Some(next) = self.assign(&mut st, path, Some(worker), live) {
            out.upload.push(next);
        }
        self.gauges(&st);
        Ok(out)
    }

    /// Assigns the upload of `path`'s pending version if none runs: to `prefer` when it holds
    /// it, else (when `prefer` is `None`) to the first live holder. Returns the write id when
    /// the upload went to `prefer`.
    fn assign(
        &self,
        st: &mut State,
        path: &str,
        prefer: Option<&str>,
        live: &HashSet<String>,
    ) -> Option<String> {
        if st.running.contains_key(path) {
            return None;
        }
        let record = st.files.get(path).filter(|r| r.failed.is_none())?;
        let worker = match prefer {
            Some(w) if record.holders.iter().any(|h| h == w) => w.to_string(),
            Some(_) => return None,
            None => record.holders.iter().find(|h| live.contains(*h))?.clone(),
        };
        let write_id = record.write_id.clone();
        st.running.insert(path.to_string(), Running { write_id: write_id.clone(), worker, deleted: false });
        prefer.map(|_| write_id)
    }

    /// Reconciles a worker's journals with the pending files: which it should upload now and
    /// which it may delete.
    pub fn heartbeat(&self, worker: &str, held: &[HeldJournal], live: &HashSet<String>) -> JournalOrders {
        let mut st = lock(&self.state);
        let mut orders = JournalOrders::default();
        // Uploads given to workers that are gone are free again.
        st.running.retain(|_, r| live.contains(&r.worker));
        // A new master (restart, failover) learns which uploads run from the workers running
        // them. Never one this master saw end: a heartbeat built before the worker cleared its
        // flag can arrive after the upload's result, and must not bring it back.
        for j in held.iter().filter(|j| j.uploading) {
            if !st.running.contains_key(&j.path) && !st.finished.contains(&j.write_id) {
                let run =
                    Running { write_id: j.write_id.clone(), worker: worker.to_string(), deleted: false };
                st.running.insert(j.path.clone(), run);
            }
        }
        let mut holds: HashSet<&str> = HashSet::new();
        for j in held {
            holds.insert(&j.write_id);
            let wanted = st.files.get(&j.path).is_some_and(|r| r.write_id == j.write_id);
            let running_here = st.running.get(&j.path).is_some_and(|r| r.write_id == j.write_id);
            // A persisted version's journal serves readers that learnt it, for the grace.
            let in_grace = st
                .persisted_at
                .get(&j.write_id)
                .is_some_and(|at| self.clock.now().duration_since(*at) < self.grace);
            let decided = st.finished.contains(&j.write_id);
            if !wanted && !running_here && !in_grace && (decided || j.age_ms >= UNKNOWN_JOURNAL_GRACE_MS) {
                orders.drop.push(j.write_id.clone());
                continue;
            }
            let assigned_here =
                st.running.get(&j.path).is_some_and(|r| r.write_id == j.write_id && r.worker == worker);
            if assigned_here && !j.uploading {
                // It restarted, or lost the task: ask again.
                orders.upload.push(j.write_id.clone());
            }
        }
        // Pending files this worker holds with no upload running: take them.
        let paths: Vec<String> = st
            .files
            .values()
            .filter(|r| r.failed.is_none() && holds.contains(r.write_id.as_str()))
            .map(|r| r.path.clone())
            .collect();
        for path in paths {
            if let Some(id) = self.assign(&mut st, &path, Some(worker), live) {
                orders.upload.push(id);
            }
        }
        orders
    }

    /// A pending file at exactly `path`.
    pub fn get(&self, path: &str) -> Option<PendingView> {
        let st = lock(&self.state);
        st.files.get(path).map(|r| view(&st, r))
    }

    /// Pending files at or under `path`, in path order.
    pub fn under(&self, path: &str) -> Vec<PendingView> {
        let st = lock(&self.state);
        let prefix = format!("{}/", path.trim_end_matches('/'));
        st.files
            .range(path.to_string()..)
            .take_while(|(p, _)| p.as_str() == path || p.starts_with(&prefix) || path == "/")
            .filter(|(p, _)| p.as_str() == path || p.starts_with(&prefix))
            .map(|(_, r)| view(&st, r))
            .collect()
    }

    /// Whether any pending file lies strictly under `dir` (which then exists as a directory).
    pub fn has_children(&self, dir: &str) -> bool {
        let st = lock(&self.state);
        let prefix = format!("{}/", dir.trim_end_matches('/'));
        st.files.range(prefix.clone()..).next().is_some_and(|(p, _)| p.starts_with(&prefix))
    }

    /// Forgets pending files at or under `path` (a delete). An upload running for one of them
    /// is marked so the caller deletes its object again when it ends.
    pub fn forget_under(&self, path: &str) -> Result<usize, OpError> {
        let mut st = lock(&self.state);
        let gone: Vec<String> = {
            let prefix = format!("{}/", path.trim_end_matches('/'));
            st.files.keys().filter(|p| p.as_str() == path || p.starts_with(&prefix)).cloned().collect()
        };
        for p in &gone {
            self.store.delete_pending(p)?;
            if let Some(old) = st.files.remove(p) {
                st.finish(&old.write_id);
            }
            st.last_error.remove(p);
            if let Some(r) = st.running.get_mut(p) {
                r.deleted = true;
            }
        }
        self.gauges(&st);
        Ok(gone.len())
    }

    /// Queues failed uploads at or under `path` again.
    pub fn retry_failed(&self, path: &str) -> Result<usize, OpError> {
        let mut st = lock(&self.state);
        let prefix = format!("{}/", path.trim_end_matches('/'));
        let failed: Vec<PendingRecord> = st
            .files
            .values()
            .filter(|r| r.failed.is_some() && (r.path == path || r.path.starts_with(&prefix) || path == "/"))
            .cloned()
            .collect();
        for mut r in failed.iter().cloned() {
            r.failed = None;
            self.store.put_pending(&r)?;
            st.files.insert(r.path.clone(), r);
        }
        Ok(failed.len())
    }

    fn gauges(&self, st: &State) {
        let now = self.clock.wall_ms();
        let bytes: u64 = st.files.values().map(|r| r.size).sum();
        let oldest = st.files.values().map(|r| r.committed_unix_ms).min().map_or(0, |t| now - t);
        metrics::gauge!(m::WRITEBACK_PENDING_FILES).set(st.files.len() as f64);
        metrics::gauge!(m::WRITEBACK_PENDING_BYTES).set(bytes as f64);
        metrics::gauge!(m::WRITEBACK_OLDEST_PENDING).set(oldest.max(0) as f64 / 1000.0);
    }

    /// Refreshes the age gauge (the liveness tick calls it).
    pub fn tick(&self) {
        self.gauges(&lock(&self.state));
    }
}

fn view(st: &State, r: &PendingRecord) -> PendingView {
    let running = st.running.get(&r.path).filter(|run| run.write_id == r.write_id);
    let state = match (&r.failed, running) {
        (Some(_), _) => PersistState::Failed,
        (None, Some(_)) => PersistState::Uploading,
        (None, None) => PersistState::Pending,
    };
    PendingView {
        record: r.clone(),
        state,
        uploader: running.map(|run| run.worker.clone()).unwrap_or_default(),
        error: r.failed.clone().or_else(|| st.last_error.get(&r.path).cloned()).unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemStore;

    fn wb() -> (WriteBack, Arc<MemStore>) {
        let store = Arc::new(MemStore::default());
        (WriteBack::load(store.clone(), strata_common::clock::system(), Duration::ZERO).unwrap(), store)
    }

    fn commit(w: &WriteBack, path: &str, id: &str, holders: &[&str]) -> bool {
        w.commit(Commit {
            worker_id: holders[0].to_string(),
            path: path.into(),
            write_id: id.into(),
            size: 10,
            mtime_ms: 1,
            holders: holders.iter().map(|h| h.to_string()).collect(),
            persisted: false,
        })
        .unwrap()
    }

    fn live(ids: &[&str]) -> HashSet<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    fn journal(id: &str, path: &str, uploading: bool, age_ms: u64) -> HeldJournal {
        HeldJournal { write_id: id.into(), path: path.into(), uploading, age_ms }
    }

    #[test]
    fn the_last_acknowledged_version_is_uploaded_last() {
        let (w, store) = wb();
        let all = live(&["a", "b"]);
        assert!(commit(&w, "/m/f", "v1", &["a", "b"]), "nothing runs: upload at once");
        assert_eq!(w.get("/m/f").unwrap().state, PersistState::Uploading);
        assert!(!commit(&w, "/m/f", "v2", &["b", "a"]), "v1's upload runs: v2 waits");
        assert_eq!(w.get("/m/f").unwrap().record.write_id, "v2");
        assert_eq!(w.get("/m/f").unwrap().state, PersistState::Pending);
        // v1 lands in the UFS: not persisted (v2 is the file), and v2 goes next, here.
        let ended = w.upload_result("a", "/m/f", "v1", "", false, &all).unwrap();
        assert_eq!(ended, UploadEnded { upload: vec!["v2".into()], persisted: None, delete_again: None });
        let ended = w.upload_result("a", "/m/f", "v2", "", false, &all).unwrap();
        assert_eq!(ended.persisted.as_deref(), Some("/m/f"));
        assert!(w.get("/m/f").is_none());
        assert!(store.pending.lock().unwrap().is_empty(), "the record left the store");
        // Both journals are known finished: dropped at once, whatever their age.
        let orders =
            w.heartbeat("b", &[journal("v1", "/m/f", false, 0), journal("v2", "/m/f", false, 0)], &all);
        assert_eq!(orders.drop, vec!["v1".to_string(), "v2".to_string()]);
    }

    #[test]
    fn an_upload_of_a_lost_worker_goes_to_a_live_holder() {
        let (w, _) = wb();
        assert!(commit(&w, "/m/f", "v1", &["a", "b"]));
        // `a` is gone: `b` holds the journal and takes the upload on its next heartbeat.
        let orders = w.heartbeat("b", &[journal("v1", "/m/f", false, 5)], &live(&["b"]));
        assert_eq!(orders, JournalOrders { upload: vec!["v1".into()], drop: vec![] });
        assert_eq!(w.get("/m/f").unwrap().uploader, "b");
        // While `b` uploads, its heartbeat changes nothing; a report it is not uploading
        // (it restarted) gets the order again.
        let orders = w.heartbeat("b", &[journal("v1", "/m/f", true, 5)], &live(&["b"]));
        assert_eq!(orders, JournalOrders::default());
        let orders = w.heartbeat("b", &[journal("v1", "/m/f", false, 5)], &live(&["b"]));
        assert_eq!(orders.upload, vec!["v1".to_string()]);
    }

    #[test]
    fn a_new_master_learns_running_uploads_from_heartbeats() {
        let (w, store) = wb();
        assert!(commit(&w, "/m/f", "v1", &["a", "b"]));
        let again = WriteBack::load(store, strata_common::clock::system(), Duration::ZERO).unwrap();
        let all = live(&["a", "b"]);
        // `a` still uploads v1: `b` must not be given a second upload of the path.
        assert_eq!(again.heartbeat("a", &[journal("v1", "/m/f", true, 5)], &all), JournalOrders::default());
        assert_eq!(again.heartbeat("b", &[journal("v1", "/m/f", false, 5)], &all), JournalOrders::default());
        assert_eq!(again.get("/m/f").unwrap().uploader, "a");
    }

    #[test]
    fn a_persisted_files_journals_serve_its_readers_for_the_grace() {
        let store = Arc::new(MemStore::default());
        let clock = strata_common::clock::ManualClock::new();
        let w = WriteBack::load(store, clock.clone(), Duration::from_secs(60)).unwrap();
        let all = live(&["a", "b"]);
        assert!(commit(&w, "/m/f", "v1", &["a", "b"]));
        w.upload_result("a", "/m/f", "v1", "", false, &all).unwrap();
        let held = [journal("v1", "/m/f", false, 5)];
        assert_eq!(w.heartbeat("b", &held, &all), JournalOrders::default());
        clock.advance(Duration::from_secs(61));
        assert_eq!(w.heartbeat("b", &held, &all).drop, vec!["v1".to_string()]);
    }

    #[test]
    fn a_stale_uploading_report_never_brings_back_an_upload_that_ended() {
        let (w, _) = wb();
        let all = live(&["a", "b"]);
        assert!(commit(&w, "/m/f", "v1", &["a", "b"]));
        w.upload_result("a", "/m/f", "v1", "", false, &all).unwrap();
        assert!(commit(&w, "/m/f", "v2", &["a", "b"]));
        w.upload_result("a", "/m/f", "v2", "", false, &all).unwrap();
        // Built while v1 was uploading, delivered after both ended.
        let stale = w.heartbeat("a", &[journal("v1", "/m/f", true, 5)], &all);
        assert!(stale.upload.is_empty(), "{stale:?}");
        let next = w.heartbeat("a", &[journal("v1", "/m/f", false, 5)], &all);
        assert!(next.upload.is_empty(), "v1 must never be uploaded over v2: {next:?}");
        assert!(w.under("/").is_empty());
    }

    #[test]
    fn unknown_journals_wait_out_the_grace() {
        let (w, _) = wb();
        let all = live(&["a"]);
        let young = journal("x", "/m/g", false, UNKNOWN_JOURNAL_GRACE_MS - 1);
        assert_eq!(
            w.heartbeat("a", &[young], &all),
            JournalOrders::default(),
            "its commit may be on the way"
        );
        let old = journal("x", "/m/g", false, UNKNOWN_JOURNAL_GRACE_MS);
        assert_eq!(w.heartbeat("a", &[old], &all).drop, vec!["x".to_string()]);
    }

    #[test]
    fn a_failed_upload_waits_for_sync_and_survives_a_restart() {
        let (w, store) = wb();
        let all = live(&["a", "b"]);
        assert!(commit(&w, "/m/d/f", "v1", &["a", "b"]));
        let ended = w.upload_result("a", "/m/d/f", "v1", "503 slow down", false, &all).unwrap();
        assert_eq!(ended, UploadEnded::default(), "still retrying");
        assert_eq!(w.get("/m/d/f").unwrap().error, "503 slow down");
        w.upload_result("a", "/m/d/f", "v1", "403 denied", true, &all).unwrap();
        let v = w.get("/m/d/f").unwrap();
        assert_eq!((v.state, v.error.as_str()), (PersistState::Failed, "403 denied"));
        assert_eq!(w.heartbeat("a", &[journal("v1", "/m/d/f", false, 9)], &all), JournalOrders::default());
        // A new master (restart or failover) knows it from the store, failed.
        let again = WriteBack::load(store.clone(), strata_common::clock::system(), Duration::ZERO).unwrap();
        assert_eq!(again.get("/m/d/f").unwrap().state, PersistState::Failed);
        assert_eq!(again.retry_failed("/m").unwrap(), 1);
        let orders = again.heartbeat("b", &[journal("v1", "/m/d/f", false, 9)], &all);
        assert_eq!(orders.upload, vec!["v1".to_string()]);
    }

    #[test]
    fn a_delete_wins_over_a_running_upload_and_listings_see_directories() {
        let (w, _) = wb();
        let all = live(&["a"]);
        assert!(commit(&w, "/m/d/e/f", "v1", &["a"]));
        assert!(w.has_children("/m/d") && w.has_children("/m") && !w.has_children("/m/d/e/f"));
        assert_eq!(w.under("/m").len(), 1);
        assert!(w.under("/m/d/e/f2").is_empty());
        assert_eq!(w.forget_under("/m/d").unwrap(), 1);
        assert!(w.get("/m/d/e/f").is_none());
        let ended = w.upload_result("a", "/m/d/e/f", "v1", "", false, &all).unwrap();
        assert_eq!(ended.delete_again.as_deref(), Some("/m/d/e/f"), "the upload brought it back");
        assert_eq!(ended.persisted, None);
    }

    #[test]
    fn a_write_through_fallback_supersedes_the_pending_version() {
        let (w, _) = wb();
        assert!(commit(&w, "/m/f", "v1", &["a"]));
        let persisted = Commit {
            worker_id: "b".into(),
            path: "/m/f".into(),
            write_id: "v2".into(),
            size: 3,
            mtime_ms: 2,
            holders: vec!["b".into()],
            persisted: true,
        };
        assert!(!w.commit(persisted).unwrap());
        assert!(w.get("/m/f").is_none());
        let bad = Commit {
            holders: vec![],
            ..Commit {
                worker_id: "b".into(),
                path: "/m/f".into(),
                write_id: "v3".into(),
                size: 0,
                mtime_ms: 0,
                holders: vec![],
                persisted: false,
            }
        };
        assert!(w.commit(bad).is_err(), "a commit must name its primary first");
    }
}

/// The guarantee against a model: whatever interleaving of commits, uploads that end or fail,
/// workers that die and come back, heartbeats and deletes, once every worker is back and every
/// upload has run, the UFS holds exactly the last acknowledged version of each path (nothing
/// for a path deleted since), and no holder dropped a journal the master still needed.
#[cfg(test)]
mod model {
    use std::collections::{BTreeMap, BTreeSet};

    use proptest::prelude::*;

    use super::*;
    use crate::store::MemStore;

    const WORKERS: [&str; 3] = ["a", "b", "c"];
    const PATHS: [&str; 3] = ["/m/x", "/m/y", "/m/d/z"];

    #[derive(Debug, Clone)]
    enum Op {
        Commit { path: usize, primary: usize, replica: usize },
        Finish { worker: usize, pick: usize },
        Fail { worker: usize, pick: usize, gave_up: bool },
        Kill { worker: usize },
        Restart { worker: usize },
        Heartbeat { worker: usize },
        Delete { path: usize },
        Retry,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0..3usize, 0..3usize, 1..3usize).prop_map(|(path, primary, d)| Op::Commit { path, primary, replica: (primary + d) % 3 }),
            3 => (0..3usize, 0..4usize).prop_map(|(worker, pick)| Op::Finish { worker, pick }),
            1 => (0..3usize, 0..4usize, any::<bool>()).prop_map(|(worker, pick, gave_up)| Op::Fail { worker, pick, gave_up }),
            1 => (0..3usize).prop_map(|worker| Op::Kill { worker }),
            1 => (0..3usize).prop_map(|worker| Op::Restart { worker }),
            3 => (0..3usize).prop_map(|worker| Op::Heartbeat { worker }),
            1 => (0..3usize).prop_map(|path| Op::Delete { path }),
            1 => Just(Op::Retry),
        ]
    }

    #[derive(Default)]
    struct World {
        live: BTreeSet<usize>,
        /// Per worker: write id → path of the journals on its disk.
        journals: [BTreeMap<String, String>; 3],
        /// Per worker: uploads it runs (write ids).
        running: [BTreeSet<String>; 3],
        ufs: BTreeMap<String, String>,
        last: BTreeMap<String, Option<String>>,
        next_id: u32,
    }

    impl World {
        fn live_ids(&self) -> HashSet<String> {
            self.live.iter().map(|&i| WORKERS[i].to_string()).collect()
        }

        fn start_upload(&mut self, worker: usize, id: String) {
            if self.journals[worker].contains_key(&id) {
                self.running[worker].insert(id);
            }
        }

        fn end_upload(&mut self, wb: &WriteBack, worker: usize, pick: usize, error: Option<bool>) {
            let Some(id) = self.running[worker].iter().nth(pick % self.running[worker].len().max(1)).cloned()
            else {
                return;
            };
            let path = self.journals[worker][&id].clone();
            let (message, gave_up) = match error {
                None => {
                    self.ufs.insert(path.clone(), id.clone());
                    ("", false)
                }
                Some(gave_up) => ("503", gave_up),
            };
            if error.is_none() || gave_up {
                self.running[worker].remove(&id);
            }
            let ended =
                wb.upload_result(WORKERS[worker], &path, &id, message, gave_up, &self.live_ids()).unwrap();
            if let Some(p) = ended.delete_again {
                self.ufs.remove(&p);
            }
            for next in ended.upload {
                self.start_upload(worker, next);
            }
        }

        fn heartbeat(&mut self, wb: &WriteBack, worker: usize) {
            if !self.live.contains(&worker) {
                return;
            }
            let held: Vec<HeldJournal> = self.journals[worker]
                .iter()
                .map(|(id, path)| HeldJournal {
                    write_id: id.clone(),
                    path: path.clone(),
                    uploading: self.running[worker].contains(id),
                    age_ms: 0,
                })
                .collect();
            let orders = wb.heartbeat(WORKERS[worker], &held, &self.live_ids());
            for id in orders.drop {
                if !self.running[worker].contains(&id) {
                    self.journals[worker].remove(&id);
                }
            }
            for id in orders.upload {
                self.start_upload(worker, id);
            }
        }

        fn apply(&mut self, wb: &WriteBack, op: Op) {
            match op {
                Op::Commit { path, primary, replica } => {
                    if !self.live.contains(&primary) || !self.live.contains(&replica) {
                        return;
                    }
                    self.next_id += 1;
                    let id = format!("w{}", self.next_id);
                    let p = PATHS[path].to_string();
                    self.journals[primary].insert(id.clone(), p.clone());
                    self.journals[replica].insert(id.clone(), p.clone());
                    let upload = wb
                        .commit(Commit {
                            worker_id: WORKERS[primary].into(),
                            path: p.clone(),
                            write_id: id.clone(),
                            size: 1,
                            mtime_ms: 0,
                            holders: vec![WORKERS[primary].into(), WORKERS[replica].into()],
                            persisted: false,
                        })
                        .unwrap();
                    self.last.insert(p, Some(id.clone()));
                    if upload {
                        self.start_upload(primary, id);
                    }
                }
                Op::Finish { worker, pick } => self.end_upload(wb, worker, pick, None),
                Op::Fail { worker, pick, gave_up } => self.end_upload(wb, worker, pick, Some(gave_up)),
                Op::Kill { worker } => {
                    self.live.remove(&worker);
                    self.running[worker].clear();
                }
                Op::Restart { worker } => {
                    self.live.insert(worker);
                }
                Op::Heartbeat { worker } => self.heartbeat(wb, worker),
                Op::Delete { path } => {
                    let p = PATHS[path].to_string();
                    wb.forget_under(&p).unwrap();
                    // The master's delete removes the UFS's object too.
                    self.ufs.remove(&p);
                    self.last.insert(p, None);
                }
                Op::Retry => {
                    wb.retry_failed("/").unwrap();
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]
        #[test]
        fn the_ufs_ends_with_the_last_acknowledged_versions(ops in proptest::collection::vec(op(), 1..60)) {
            let wb = WriteBack::load(Arc::new(MemStore::default()), strata_common::clock::system(), Duration::ZERO).unwrap();
            let mut world = World { live: (0..3).collect(), ..World::default() };
            for op in ops {
                world.apply(&wb, op);
            }
            // Every worker back; uploads run to the end.
            world.live = (0..3).collect();
            for _ in 0..20 {
                wb.retry_failed("/").unwrap();
                for w in 0..3 {
                    world.heartbeat(&wb, w);
                }
                for w in 0..3 {
                    while !world.running[w].is_empty() {
                        world.end_upload(&wb, w, 0, None);
                    }
                }
            }
            prop_assert!(wb.under("/").is_empty(), "still pending: {:?}", wb.under("/"));
            for (path, last) in &world.last {
                prop_assert_eq!(world.ufs.get(path), last.as_ref(), "{}", path);
            }
        }
    }
}
