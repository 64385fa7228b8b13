//! Metadata while the master is unreachable.
//!
//! A master call that fails as an outage — kind `Unavailable` (a refused or broken connection,
//! a deadline, a master that says it is unavailable), never `not_found` or any other answer —
//! starts an outage. During it the client answers from what it has: the last stat of a path
//! (whatever its age), the last complete listing it saw (`listings`), its last membership and
//! mount table, and a stat a worker makes at the UFS for a path it never saw. That lasts for
//! `ClientConfig::master_outage_grace` from the start of the outage; after it, metadata calls
//! fail with an error saying since when the master has been unreachable. While the outage
//! lasts, calls that have an answer at hand ask the master at most once per probe period (and
//! with a short deadline), so a stopped master does not stall every read; the first answer
//! from the master ends the outage.
//!
//! One `warn!` line starts an outage and one `info!` line ends it; the counters
//! ([`OutageCounters`]) and metrics ([`METRIC_STALE_METADATA`] …) say how much was served stale.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::ClientError;

/// Environment variable that sets [`ClientConfig::master_outage_grace`](crate::ClientConfig)
/// (`5m`, `90s`, `0` to serve nothing stale).
pub const OUTAGE_GRACE_ENV: &str = "STRATA_MASTER_OUTAGE_GRACE";
/// Default of the outage grace.
pub const DEFAULT_OUTAGE_GRACE: Duration = Duration::from_secs(300);
/// Longest a master call may take when the caller has a cached answer to fall back on: a
/// stopped (not crashed) master accepts connections and never answers.
pub const FALLBACK_DEADLINE: Duration = Duration::from_secs(5);

/// Counter: metadata answers served from the client's cache because the master was
/// unreachable, by `kind` = `stat`/`listing`.
pub const METRIC_STALE_METADATA: &str = "strata_client_stale_metadata_total";
/// Counter: stats a worker or sidecar answered from the UFS because the master was unreachable.
pub const METRIC_WORKER_STATS: &str = "strata_client_worker_stats_total";
/// Counter: outages of the master this client went through.
pub const METRIC_MASTER_OUTAGES: &str = "strata_client_master_outages_total";
/// Counter: clients that started from a worker's or sidecar's view of the cluster.
pub const METRIC_STARTED_FROM_WORKER: &str = "strata_client_started_from_worker_view_total";

/// The grace from `STRATA_MASTER_OUTAGE_GRACE`, or the default (also for a value that does not
/// parse, which is logged).
pub fn grace_from_env() -> Duration {
    match std::env::var(OUTAGE_GRACE_ENV) {
        Ok(v) if !v.trim().is_empty() => strata_common::units::parse_duration(&v).unwrap_or_else(|| {
            warn!(value = %v, env = OUTAGE_GRACE_ENV, "not a duration (like 5m or 90s); using the default");
            DEFAULT_OUTAGE_GRACE
        }),
        _ => DEFAULT_OUTAGE_GRACE,
    }
}

/// What this client served while the master was unreachable (also counted as metrics).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    stale_stats: AtomicU64,
    stale_listings: AtomicU64,
    worker_stats: AtomicU64,
    outages: AtomicU64,
    started_from_worker: AtomicU64,
}

/// A snapshot of [`Client::outage_counters`](crate::Client::outage_counters).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutageCounters {
    /// Stats answered from the client's cache past their TTL (`strata_client_stale_metadata_total{kind="stat"}`).
    pub stale_stats: u64,
    /// Listing pages answered from the client's cache (`…{kind="listing"}`).
    pub stale_listings: u64,
    /// Stats a worker or sidecar made at the UFS (`strata_client_worker_stats_total`).
    pub worker_stats: u64,
    /// Outages begun (`strata_client_master_outages_total`).
    pub outages: u64,
    /// 1 when this client started from a worker's view (`strata_client_started_from_worker_view_total`).
    pub started_from_worker: u64,
}

#[derive(Debug, Default)]
struct State {
    /// When the outage began: on the client's clock, and as wall-clock ms for messages.
    since: Option<(Instant, i64)>,
    last_probe: Option<Instant>,
}

#[derive(Debug)]
pub(crate) struct Outage {
    grace: Duration,
    probe_every: Duration,
    master: String,
    state: Mutex<State>,
    counters: Counters,
}

/// Wall-clock milliseconds as `2026-12-01T12:00:00Z`.
pub(crate) fn utc(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .map_or_else(|| format!("{ms} ms"), |t| t.format("%Y-%m-%dT%H:%M:%SZ").to_string())
}

impl Outage {
    pub(crate) fn new(grace: Duration, probe_every: Duration, master: &str) -> Self {
        Self {
            grace,
            probe_every,
            master: master.to_string(),
            state: Mutex::default(),
            counters: Counters::default(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn in_outage(&self) -> bool {
        self.state().since.is_some()
    }

    /// Whether a call with an answer at hand should ask the master now: always outside an
    /// outage, once per probe period during one (the caller that gets `true` is the probe).
    pub(crate) fn should_ask(&self, now: Instant) -> bool {
        let mut state = self.state();
        if state.since.is_none() {
            return true;
        }
        let due = state.last_probe.is_none_or(|at| now.saturating_duration_since(at) >= self.probe_every);
        if due {
            state.last_probe = Some(now);
        }
        due
    }

    /// A master call made at `asked` (`asked_wall_ms` on the wall clock) failed as an outage
    /// at `now`; the next probe is due a probe period after `now`.
    pub(crate) fn failed(&self, asked: Instant, asked_wall_ms: i64, now: Instant, err: &ClientError) {
        self.begin(now, asked, asked_wall_ms, err.to_string());
    }

    /// Begins an outage (if none is on) that started at `since` (`since_wall_ms`).
    fn begin(&self, now: Instant, since: Instant, since_wall_ms: i64, reason: String) {
        let mut state = self.state();
        state.last_probe = Some(now);
        if state.since.is_some() {
            return;
        }
        state.since = Some((since, since_wall_ms));
        drop(state);
        self.counters.outages.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(METRIC_MASTER_OUTAGES).increment(1);
        let until = since_wall_ms.saturating_add(self.grace.as_millis() as i64);
        warn!(
            master = %self.master,
            since = %utc(since_wall_ms),
            until = %utc(until),
            err = %reason,
            "master unreachable since {}; serving cached metadata up to {}",
            utc(since_wall_ms),
            utc(until)
        );
    }

    /// Starts the client in an outage that began when a worker last heard from the master
    /// (`seen_wall_ms`), so a client started late in an outage gets no more grace than one
    /// that lived through it.
    pub(crate) fn started_from_worker(
        &self,
        now: Instant,
        wall_now_ms: i64,
        seen_wall_ms: i64,
        source: &str,
    ) {
        let ago = Duration::from_millis(wall_now_ms.saturating_sub(seen_wall_ms).max(0) as u64);
        let since = now.checked_sub(ago).unwrap_or(now);
        self.counters.started_from_worker.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(METRIC_STARTED_FROM_WORKER).increment(1);
        info!(master = %self.master, worker = %source, master_seen = %utc(seen_wall_ms), "master unreachable at start; started from a worker's view of the cluster");
        self.begin(now, since, seen_wall_ms, format!("started from {source}'s view"));
    }

    /// The master answered: the outage, if any, is over.
    pub(crate) fn recovered(&self, now: Instant) {
        let Some((since, since_wall)) = self.state().since.take() else { return };
        info!(
            master = %self.master,
            since = %utc(since_wall),
            down_s = now.saturating_duration_since(since).as_secs(),
            "master reachable again; metadata comes from it again"
        );
    }

    /// `Ok` while cached metadata may still be served; after the grace, the error to return.
    pub(crate) fn check_grace(&self, now: Instant) -> Result<(), ClientError> {
        let Some((since, since_wall)) = self.state().since else { return Ok(()) };
        let down = now.saturating_duration_since(since);
        if down <= self.grace {
            return Ok(());
        }
        Err(ClientError::MasterUnavailable(format!(
            "master at {} unreachable since {} ({} s), longer than the outage grace of {} s: cached metadata is no longer served",
            self.master,
            utc(since_wall),
            down.as_secs(),
            self.grace.as_secs()
        )))
    }

    pub(crate) fn served_stale_stat(&self) {
        self.counters.stale_stats.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(METRIC_STALE_METADATA, "kind" => "stat").increment(1);
    }

    pub(crate) fn served_stale_listing(&self) {
        self.counters.stale_listings.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(METRIC_STALE_METADATA, "kind" => "listing").increment(1);
    }

    pub(crate) fn served_worker_stat(&self) {
        self.counters.worker_stats.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(METRIC_WORKER_STATS).increment(1);
    }

    pub(crate) fn counters(&self) -> OutageCounters {
        let c = &self.counters;
        OutageCounters {
            stale_stats: c.stale_stats.load(Ordering::Relaxed),
            stale_listings: c.stale_listings.load(Ordering::Relaxed),
            worker_stats: c.worker_stats.load(Ordering::Relaxed),
            outages: c.outages.load(Ordering::Relaxed),
            started_from_worker: c.started_from_worker.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn down() -> ClientError {
        ClientError::MasterUnavailable("connection refused".into())
    }

    #[test]
    fn an_outage_is_served_for_the_grace_then_fails_saying_since_when() {
        let t0 = Instant::now();
        let o = Outage::new(Duration::from_secs(60), Duration::from_secs(2), "m:1");
        assert!(o.should_ask(t0) && o.check_grace(t0).is_ok() && !o.in_outage());
        o.failed(t0, 1_764_590_400_000, t0, &down());
        o.failed(t0 + Duration::from_secs(1), 0, t0 + Duration::from_secs(1), &down());
        assert_eq!(o.counters().outages, 1, "one outage, however many failures");
        assert!(!o.should_ask(t0 + Duration::from_secs(1)), "probed at the failure");
        assert!(o.should_ask(t0 + Duration::from_secs(3)));
        assert!(!o.should_ask(t0 + Duration::from_secs(4)), "one probe per period");
        assert!(o.check_grace(t0 + Duration::from_secs(60)).is_ok());
        let err = o.check_grace(t0 + Duration::from_secs(61)).unwrap_err();
        assert_eq!(err.kind(), strata_common::ErrorKind::Unavailable);
        assert!(err.to_string().contains("unreachable since 2025-12-01T12:00:00Z (61 s)"), "{err}");
        o.recovered(t0 + Duration::from_secs(62));
        assert!(!o.in_outage() && o.check_grace(t0 + Duration::from_secs(500)).is_ok());
        assert!(o.should_ask(t0 + Duration::from_secs(62)));
    }

    #[test]
    fn a_client_started_from_a_worker_inherits_the_outage_start() {
        let t0 = Instant::now() + Duration::from_secs(1000);
        let o = Outage::new(Duration::from_secs(60), Duration::from_secs(2), "m:1");
        o.started_from_worker(t0, 100_000, 50_000, "w:1");
        assert!(o.check_grace(t0 + Duration::from_secs(10)).is_ok());
        assert!(o.check_grace(t0 + Duration::from_secs(11)).is_err(), "50 s had passed at start");
        assert_eq!(o.counters().started_from_worker, 1);
    }
}
