//! Foreground activity (client reads) and the window of background loads that yields to it.
//!
//! Client reads mark themselves with [`Qos::foreground`]; the load lane (`loader`) and the
//! NVMe write-back writer (`cache`) ask [`Qos::busy`] / [`Qos::quiet_for`] before they start
//! work, and the load window shrinks while reads are active (AIMD): a training job's reads meet
//! at most one competing UFS fetch per worker (or [`SMALL_PER_LOAD`] small files' fetches).
//! Every fetch of the load lane holds a [`LoadSlot`] — a whole place of the window for a block,
//! a [`SMALL_PER_LOAD`]th of one for a small file, whose fetch moves far fewer bytes and whose
//! speed on an object store is set by how many are in flight, not by bandwidth — so several
//! batches of small files keep the window full between them without ever exceeding it. Time
//! comes from the injected clock.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use strata_common::SharedClock;

use crate::metrics_defs as m;

/// Loads in flight when a task does not say (`parallelism` 0).
pub const DEFAULT_LOAD_PARALLELISM: u32 = 16;
/// A client read within this window counts as foreground activity.
pub const FOREGROUND_RECENT: Duration = Duration::from_millis(20);
/// Small files' fetches that take one place of the load window together: an object store
/// answers a small GET in tens of milliseconds whatever its size, so only many in flight
/// make a small-file warmup go at the store's speed (16 places: 64 small files in flight).
pub const SMALL_PER_LOAD: u32 = 4;

/// Foreground (client read) activity and the load window that yields to it.
pub struct Qos {
    clock: SharedClock,
    started: Instant,
    inflight: AtomicU64,
    /// Nanoseconds since `started` of the last client read's start or end.
    last_ns: AtomicU64,
    window: Mutex<Aimd>,
    /// Load fetches in flight, in [`SMALL_PER_LOAD`]ths of a place (each holds a [`LoadSlot`]).
    loading: AtomicU32,
    slot_freed: tokio::sync::Notify,
}

/// One fetch of the load lane in flight, for as long as it lives, with its share of the
/// window in [`SMALL_PER_LOAD`]ths of a place.
pub struct LoadSlot<'a>(&'a Qos, u32);

impl Drop for LoadSlot<'_> {
    fn drop(&mut self) {
        self.0.loading.fetch_sub(self.1, Ordering::AcqRel);
        self.0.slot_freed.notify_waiters();
    }
}

/// Marks one client read in flight for as long as it lives.
pub struct Foreground<'a>(&'a Qos);

impl Drop for Foreground<'_> {
    fn drop(&mut self) {
        self.0.touch();
        self.0.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Qos {
    pub fn new(clock: SharedClock) -> Self {
        Self {
            started: clock.now(),
            clock,
            inflight: AtomicU64::new(0),
            last_ns: AtomicU64::new(0),
            window: Mutex::new(Aimd::new(DEFAULT_LOAD_PARALLELISM)),
            loading: AtomicU32::new(0),
            slot_freed: tokio::sync::Notify::new(),
        }
    }

    /// A place for one load fetch — a whole one, or for a `small` file a [`SMALL_PER_LOAD`]th
    /// of one — once the window has room for it.
    pub async fn load_slot(&self, small: bool) -> LoadSlot<'_> {
        let share = if small { 1 } else { SMALL_PER_LOAD };
        loop {
            let freed = self.slot_freed.notified();
            let capacity = self.window() * SMALL_PER_LOAD;
            let now = self.loading.load(Ordering::Acquire);
            if now + share <= capacity
                && self
                    .loading
                    .compare_exchange(now, now + share, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                return LoadSlot(self, share);
            }
            if now + share > capacity {
                // A shrunk window frees no slot by itself: look again now and then.
                let _ = tokio::time::timeout(Duration::from_millis(50), freed).await;
            }
        }
    }

    pub fn foreground(&self) -> Foreground<'_> {
        self.inflight.fetch_add(1, Ordering::Relaxed);
        self.touch();
        Foreground(self)
    }

    fn since_start(&self) -> Duration {
        self.clock.now().saturating_duration_since(self.started)
    }

    fn touch(&self) {
        self.last_ns.store(self.since_start().as_nanos() as u64, Ordering::Relaxed);
    }

    /// Whether client reads are in flight or finished a moment ago.
    pub fn busy(&self) -> bool {
        if self.inflight.load(Ordering::Relaxed) > 0 {
            return true;
        }
        let last = Duration::from_nanos(self.last_ns.load(Ordering::Relaxed));
        last > Duration::ZERO && self.since_start().saturating_sub(last) < FOREGROUND_RECENT
    }

    /// How long no client read has been in flight (zero while one is).
    pub fn quiet_for(&self) -> Duration {
        if self.inflight.load(Ordering::Relaxed) > 0 {
            return Duration::ZERO;
        }
        let last = Duration::from_nanos(self.last_ns.load(Ordering::Relaxed));
        self.since_start().saturating_sub(last)
    }

    /// Loads that may be in flight now.
    pub fn window(&self) -> u32 {
        self.window.lock().unwrap_or_else(|p| p.into_inner()).current()
    }

    pub fn set_limit(&self, limit: u32) {
        self.window.lock().unwrap_or_else(|p| p.into_inner()).set_limit(limit);
    }

    /// One load is about to start while reads are (or are not) `busy`: the window follows.
    pub fn observe(&self, busy: bool) {
        let mut w = self.window.lock().unwrap_or_else(|p| p.into_inner());
        w.observe(busy);
        metrics::gauge!(m::LOAD_WINDOW).set(w.current() as f64);
    }
}

/// Additive-increase, multiplicative-decrease window (sans-IO).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Aimd {
    current: u32,
    limit: u32,
}

impl Aimd {
    pub fn new(limit: u32) -> Self {
        let limit = limit.max(1);
        Self { current: limit, limit }
    }

    pub fn current(&self) -> u32 {
        self.current
    }

    pub fn set_limit(&mut self, limit: u32) {
        self.limit = limit.max(1);
        self.current = self.current.min(self.limit);
    }

    pub fn observe(&mut self, busy: bool) {
        self.current = if busy { (self.current / 2).max(1) } else { (self.current + 1).min(self.limit) };
    }
}

#[cfg(test)]
mod tests {
    use strata_common::clock::ManualClock;

    use super::*;

    #[test]
    fn window_halves_under_foreground_and_grows_back() {
        let mut w = Aimd::new(8);
        assert_eq!(w.current(), 8);
        w.observe(true);
        assert_eq!(w.current(), 4);
        w.observe(true);
        w.observe(true);
        w.observe(true);
        assert_eq!(w.current(), 1, "never below one load");
        for _ in 0..3 {
            w.observe(false);
        }
        assert_eq!(w.current(), 4);
        for _ in 0..10 {
            w.observe(false);
        }
        assert_eq!(w.current(), 8, "capped at the limit");
        w.set_limit(2);
        assert_eq!(w.current(), 2);
    }

    #[test]
    fn foreground_reads_make_the_lane_busy_until_quiet() {
        let clock = ManualClock::new();
        let q = Qos::new(clock.clone());
        assert!(!q.busy());
        clock.advance(Duration::from_secs(1));
        let g = q.foreground();
        assert!(q.busy());
        assert_eq!(q.quiet_for(), Duration::ZERO);
        drop(g);
        assert!(q.busy(), "recent reads still count");
        clock.advance(FOREGROUND_RECENT + Duration::from_millis(5));
        assert!(!q.busy());
        assert_eq!(q.quiet_for(), FOREGROUND_RECENT + Duration::from_millis(5));
    }
}
