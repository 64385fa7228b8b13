//! What this client has seen of each worker's data plane: how long its block reads take (for
//! the hedging deadline) and whether it is suspect (asked last for a while).
//!
//! A worker that is down refuses connections and costs a read nothing: the next owner is
//! asked at once. A worker that is frozen (stopped, a hung disk, a long pause, half a
//! partition) accepts connections and never answers; without a deadline a read waits for the
//! request timeout. So a block read that has not answered within the worker's hedging deadline
//! is sent to the next owner as well, and the first answer is taken (see
//! `Client::read_from_owners`).
//!
//! The deadline follows the worker's recent latency the way TCP's retransmission timeout does
//! (a smoothed mean plus four mean deviations), bounded by [`HedgePolicy::min`] and
//! [`HedgePolicy::max`]; a worker not heard from yet gets the maximum. A worker that fails a
//! read, or is outrun [`STRIKES`] times in a row (a hedge answered while it had not), is suspect
//! for [`SUSPECT_FOR`]: reads ask it after the other owners, so a frozen worker costs one
//! deadline per client per period instead of one per read. Any answer from it clears that.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Outruns in a row that make a worker suspect. One slow answer (a cold block fetched from the
/// UFS while the hedge found it cached) is not enough.
pub(crate) const STRIKES: u32 = 2;
/// How long a worker that failed or was outrun is asked last.
pub(crate) const SUSPECT_FOR: Duration = Duration::from_secs(3);

/// Bounds of the hedging deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HedgePolicy {
    /// Never hedge sooner: a block fetched cold from the UFS takes tens of milliseconds, and a
    /// hedge of it is a second UFS fetch.
    pub min: Duration,
    /// Never wait longer for one worker before asking the next; also the deadline of a worker
    /// not heard from yet. `Duration::ZERO` turns hedging off (reads wait for the request
    /// timeout, then fail over).
    pub max: Duration,
}

impl Default for HedgePolicy {
    fn default() -> Self {
        Self { min: Duration::from_millis(100), max: Duration::from_millis(700) }
    }
}

#[derive(Debug, Default)]
struct Seen {
    /// Smoothed latency and mean deviation of answered reads, seconds.
    srtt: Option<f64>,
    rttvar: f64,
    strikes: u32,
    suspect_until: Option<Instant>,
}

/// Per-worker health, keyed by data address.
#[derive(Debug, Default)]
pub(crate) struct Health {
    policy: HedgePolicy,
    seen: Mutex<HashMap<String, Seen>>,
    /// Hedges this client may send now: each answered read earns [`HEDGE_SHARE`] of one, up to
    /// [`HEDGE_BURST`], each hedge spends one. On a cluster that is slow everywhere (a loaded
    /// UFS), hedges would double the load that made reads slow; the budget keeps them to about
    /// one read in twenty, while a frozen worker needs only [`STRIKES`] of them to be asked last.
    budget: Mutex<f64>,
}

/// The budget's share of a hedge earned by each answered read.
pub(crate) const HEDGE_SHARE: f64 = 0.05;
/// The most hedges the budget holds (and starts with).
pub(crate) const HEDGE_BURST: f64 = 10.0;

impl Health {
    pub(crate) fn new(policy: HedgePolicy) -> Self {
        Self { policy, seen: Mutex::default(), budget: Mutex::new(HEDGE_BURST) }
    }

    pub(crate) fn hedging(&self) -> bool {
        !self.policy.max.is_zero()
    }

    /// Takes one hedge from the budget; `false` when it is spent.
    pub(crate) fn take_hedge(&self) -> bool {
        let mut budget = self.budget.lock().unwrap_or_else(|p| p.into_inner());
        if *budget >= 1.0 {
            *budget -= 1.0;
            true
        } else {
            false
        }
    }

    fn with<T>(&self, addr: &str, f: impl FnOnce(&mut Seen) -> T) -> T {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        f(seen.entry(addr.to_string()).or_default())
    }

    /// How long a read from `addr` may go unanswered before the next owner is asked as well.
    pub(crate) fn hedge_after(&self, addr: &str) -> Duration {
        let HedgePolicy { min, max } = self.policy;
        let estimate = self.with(addr, |s| s.srtt.map(|srtt| srtt + 4.0 * s.rttvar));
        match estimate {
            Some(secs) => Duration::from_secs_f64(secs).clamp(min, max.max(min)),
            None => max.max(min),
        }
    }

    /// A read from `addr` answered (bytes or a refusal only a live worker sends) after `took`.
    pub(crate) fn answered(&self, addr: &str, took: Duration) {
        let sample = took.as_secs_f64();
        self.with(addr, |s| {
            // RFC 6298's gains: 1/8 for the mean, 1/4 for the deviation.
            match s.srtt {
                None => {
                    s.srtt = Some(sample);
                    s.rttvar = sample / 2.0;
                }
                Some(srtt) => {
                    s.rttvar = 0.75 * s.rttvar + 0.25 * (srtt - sample).abs();
                    s.srtt = Some(0.875 * srtt + 0.125 * sample);
                }
            }
            s.strikes = 0;
            s.suspect_until = None;
        });
        let mut budget = self.budget.lock().unwrap_or_else(|p| p.into_inner());
        *budget = (*budget + HEDGE_SHARE).min(HEDGE_BURST);
    }

    /// A read from `addr` failed in a way another worker may not (refused, reset, timed out).
    pub(crate) fn failed(&self, addr: &str, now: Instant) {
        self.with(addr, |s| s.suspect_until = Some(now + SUSPECT_FOR));
    }

    /// Another owner answered a read while `addr`, asked first, had not; `true` when that makes
    /// it suspect.
    pub(crate) fn outrun(&self, addr: &str, now: Instant) -> bool {
        self.with(addr, |s| {
            s.strikes += 1;
            if s.strikes >= STRIKES {
                s.suspect_until = Some(now + SUSPECT_FOR);
                true
            } else {
                false
            }
        })
    }

    pub(crate) fn is_suspect(&self, addr: &str, now: Instant) -> bool {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.get(addr).and_then(|s| s.suspect_until).is_some_and(|until| now < until)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_deadline_follows_latency_within_its_bounds() {
        let h = Health::new(HedgePolicy { min: 20 * MS, max: 500 * MS });
        assert_eq!(h.hedge_after("a"), 500 * MS, "a worker not heard from gets the maximum");
        for _ in 0..50 {
            h.answered("a", MS);
        }
        assert_eq!(h.hedge_after("a"), 20 * MS, "fast answers: the floor");
        for _ in 0..50 {
            h.answered("b", 100 * MS);
            h.answered("b", 300 * MS);
        }
        let b = h.hedge_after("b");
        assert!(b > 300 * MS && b <= 500 * MS, "{b:?} covers the slow half of a bimodal worker");
        for _ in 0..50 {
            h.answered("c", 5000 * MS);
        }
        assert_eq!(h.hedge_after("c"), 500 * MS, "slow answers: the ceiling");
    }

    #[test]
    fn hedges_are_budgeted_to_a_share_of_answered_reads() {
        let h = Health::new(HedgePolicy::default());
        let burst = HEDGE_BURST as usize;
        assert_eq!((0..burst + 5).filter(|_| h.take_hedge()).count(), burst, "a burst, then none");
        for _ in 0..(1.0 / HEDGE_SHARE) as usize {
            h.answered("a", MS);
        }
        assert!(h.take_hedge(), "twenty answers earn one hedge");
        assert!(!h.take_hedge());
    }

    #[test]
    fn suspicion_takes_a_failure_or_repeated_outruns_and_an_answer_clears_it() {
        let h = Health::new(HedgePolicy::default());
        let t0 = Instant::now();
        assert!(!h.outrun("a", t0), "one slow answer is not enough");
        assert!(!h.is_suspect("a", t0));
        assert!(h.outrun("a", t0));
        assert!(h.is_suspect("a", t0));
        assert!(!h.is_suspect("a", t0 + SUSPECT_FOR), "suspicion expires");
        h.answered("a", MS);
        assert!(!h.outrun("a", t0), "an answer resets the strikes");

        h.failed("b", t0);
        assert!(h.is_suspect("b", t0 + SUSPECT_FOR / 2));
        h.answered("b", MS);
        assert!(!h.is_suspect("b", t0 + SUSPECT_FOR / 2), "an answer clears suspicion");
    }
}
