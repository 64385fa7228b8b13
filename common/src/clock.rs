//! Time as an input. Everything that decides by elapsed time — heartbeats and liveness, metadata
//! TTLs, leases, schedules — asks a [`Clock`] instead of `Instant::now()`, so a test advances a
//! [`ManualClock`] instead of sleeping. Waiting itself (a loop's period) stays on tokio's timer;
//! only the decisions read the clock.

use std::fmt;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// Monotonic now.
    fn now(&self) -> Instant;
    /// Wall-clock milliseconds since the Unix epoch.
    fn wall_ms(&self) -> i64;
}

pub type SharedClock = Arc<dyn Clock>;

/// The machine's clocks.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn wall_ms(&self) -> i64 {
        SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
    }
}

/// The machine's clocks, shared.
pub fn system() -> SharedClock {
    Arc::new(SystemClock)
}

/// A clock that moves only when told to (both its monotonic and its wall time), for tests.
#[cfg(any(test, feature = "testing"))]
#[derive(Debug)]
pub struct ManualClock {
    start: Instant,
    wall_start_ms: i64,
    elapsed: std::sync::Mutex<std::time::Duration>,
}

#[cfg(any(test, feature = "testing"))]
impl ManualClock {
    /// Starts at the machine's now.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            start: Instant::now(),
            wall_start_ms: SystemClock.wall_ms(),
            elapsed: std::sync::Mutex::new(std::time::Duration::ZERO),
        })
    }

    pub fn advance(&self, by: std::time::Duration) {
        *self.elapsed.lock().unwrap_or_else(|p| p.into_inner()) += by;
    }

    fn elapsed(&self) -> std::time::Duration {
        *self.elapsed.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(any(test, feature = "testing"))]
impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.start + self.elapsed()
    }

    fn wall_ms(&self) -> i64 {
        self.wall_start_ms + self.elapsed().as_millis() as i64
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_advanced() {
        let clock = ManualClock::new();
        let (t0, w0) = (clock.now(), clock.wall_ms());
        assert_eq!(clock.now(), t0);
        clock.advance(Duration::from_secs(90));
        assert_eq!(clock.now() - t0, Duration::from_secs(90));
        assert_eq!(clock.wall_ms() - w0, 90_000);
    }
}
