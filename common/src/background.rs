//! Background loops: every periodic task of a service (master tickers, a worker's master link,
//! its loader, its write-back writer) waits with [`sleep_or_cancel`], backs off with [`Backoff`]
//! and runs under [`spawn_loop`], so cancellation and retry pacing are written once.

use std::future::Future;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Sleeps for `d` unless `cancel` fires first; `true` when it did (the loop should end).
pub async fn sleep_or_cancel(d: Duration, cancel: &CancellationToken) -> bool {
    tokio::select! {
        _ = cancel.cancelled() => true,
        _ = tokio::time::sleep(d) => false,
    }
}

/// Exponential backoff with jitter: each [`next_delay`](Self::next_delay) is a random duration between half
/// and all of the current step, and the step doubles up to `max`; [`reset`](Self::reset) after
/// a success. Jitter keeps many workers that lost the same master from retrying in lockstep.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    step: Duration,
    seed: u64,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
            ^ (&initial as *const Duration as u64);
        Self { initial, max: max.max(initial), step: initial, seed: seed | 1 }
    }

    /// The next delay to wait.
    pub fn next_delay(&mut self) -> Duration {
        // xorshift64: enough randomness to spread retries, no dependency.
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        let half = self.step / 2;
        let spread = half.as_nanos() as u64;
        let delay = half + Duration::from_nanos(if spread == 0 { 0 } else { self.seed % (spread + 1) });
        self.step = (self.step * 2).min(self.max);
        delay
    }

    pub fn reset(&mut self) {
        self.step = self.initial;
    }
}

/// Runs `tick` every `period` until `cancel` fires (the first run after one period). A tick
/// that takes longer than the period delays the next one; ticks never overlap.
pub fn spawn_loop<F, Fut>(period: Duration, cancel: CancellationToken, mut tick: F) -> JoinHandle<()>
where
    F: FnMut() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    tokio::spawn(async move {
        let mut interval = tokio::time::interval(period);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        interval.tick().await;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = interval.tick() => {}
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tick() => {}
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    #[test]
    fn backoff_doubles_with_jitter_up_to_its_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(800));
        let mut steps = Vec::new();
        for _ in 0..6 {
            steps.push(b.next_delay());
        }
        let caps = [100, 200, 400, 800, 800, 800];
        for (d, cap) in steps.iter().zip(caps) {
            let cap = Duration::from_millis(cap);
            assert!(*d >= cap / 2 && *d <= cap, "{d:?} outside {:?}..={cap:?}", cap / 2);
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }

    #[tokio::test(start_paused = true)]
    async fn a_loop_ticks_every_period_and_stops_when_cancelled() {
        let count = Arc::new(AtomicU32::new(0));
        let cancel = CancellationToken::new();
        let c = count.clone();
        let task = spawn_loop(Duration::from_secs(1), cancel.clone(), move || {
            let c = c.clone();
            async move {
                c.fetch_add(1, Ordering::SeqCst);
            }
        });
        tokio::time::sleep(Duration::from_millis(3500)).await;
        assert_eq!(count.load(Ordering::SeqCst), 3);
        cancel.cancel();
        task.await.unwrap();
        assert!(sleep_or_cancel(Duration::from_secs(60), &cancel).await, "a cancelled token ends the wait");
    }
}
