//! Request classes on a busy worker (`STRATA_QOS`, docs/QOS.md): answers to clients are sent
//! through a gate of a few places. While places are free nobody waits; once they are taken,
//! the next free place goes to the highest class waiting (latency, then throughput, then
//! background), except that every `floor`th hand-over goes to the lowest class waiting, so a
//! flood of latency reads slows the others without starving them. Latency requests also have
//! a reserve of places the other classes cannot take, so a latency read never waits for a
//! throughput flood's answers to drain.
//!
//! The gate bounds how many answers are being written at once, not how many requests are
//! open: a flood's requests beyond the places wait parked, costing no runtime time, so a
//! latency request's task finds a short run queue. A cold block holds no answer place while
//! the store answers: client reads' UFS fetches pass a gate of their own, the same kind with
//! its own places (`ufs_fetch_slots`, see `fetch`).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use strata_common::QosClass;
use tokio::sync::oneshot;

use crate::metrics_defs as m;

/// Places for answers being sent at once (`qos_slots`).
pub const DEFAULT_QOS_SLOTS: usize = 8;
/// Places for client reads' UFS fetches in flight at once (`ufs_fetch_slots`): enough for a
/// worker's store bandwidth with 4 MiB blocks (64 × 4 MiB = 256 MiB in flight), so the gate
/// orders classes only under a flood, never slows one reader.
pub const DEFAULT_UFS_FETCH_SLOTS: usize = 64;
/// One hand-over in this many goes to the lowest class waiting.
pub const DEFAULT_QOS_FLOOR: u32 = 8;
/// A latency answer within this window makes the other classes step aside once per answer.
pub const LATENCY_RECENT: Duration = Duration::from_millis(50);

/// The metrics a gate counts into: what it lets through, and how long the waiting ones waited.
#[derive(Debug, Clone, Copy)]
struct GateMetrics {
    requests: &'static str,
    wait_seconds: &'static str,
}

const ANSWERS: GateMetrics = GateMetrics { requests: m::QOS_REQUESTS, wait_seconds: m::QOS_WAIT_SECONDS };
const UFS_FETCHES: GateMetrics =
    GateMetrics { requests: m::QOS_UFS_FETCHES, wait_seconds: m::QOS_UFS_FETCH_WAIT_SECONDS };

/// The gate; one per worker for answers, shared by its connections, and one for client reads'
/// UFS fetches.
pub struct ClassGate {
    metrics: GateMetrics,
    slots: usize,
    latency_reserve: usize,
    floor: u32,
    state: Mutex<GateState>,
    served: [AtomicU64; 3],
    queued: [AtomicU64; 3],
    created: Instant,
    /// Nanoseconds after `created` of the last latency answer's start, plus one (0: none yet).
    latency_seen: AtomicU64,
}

#[derive(Default)]
struct GateState {
    in_use: usize,
    waiting: [VecDeque<oneshot::Sender<()>>; 3],
    handed: u32,
}

/// Requests of each class the gate let through, and how many of them had to wait.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClassCounters {
    pub served: u64,
    pub queued: u64,
}

/// A place in the gate, for as long as it lives.
pub struct ClassPermit<'a> {
    gate: Option<&'a ClassGate>,
}

impl Drop for ClassPermit<'_> {
    fn drop(&mut self) {
        if let Some(gate) = self.gate {
            gate.release();
        }
    }
}

/// A waiter whose future was dropped (its connection closed) gives back a place handed to it
/// in the meantime.
struct Waiting<'a> {
    gate: &'a ClassGate,
    rx: Option<oneshot::Receiver<()>>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Some(mut rx) = self.rx.take() {
            rx.close();
            if rx.try_recv().is_ok() {
                self.gate.release();
            }
        }
    }
}

impl Default for ClassGate {
    fn default() -> Self {
        Self::with_slots(DEFAULT_QOS_SLOTS)
    }
}

impl ClassGate {
    /// `slots` places, half as many more for latency, the default floor; 0: no gate.
    pub fn with_slots(slots: usize) -> Self {
        Self::new(slots, slots.div_ceil(2), DEFAULT_QOS_FLOOR)
    }

    /// `slots` places for client reads' UFS fetches, half as many more for latency, the default
    /// floor; 0: no gate. Counted in the `strata_worker_qos_ufs_fetch*` metrics.
    pub fn for_ufs_fetches(slots: usize) -> Self {
        Self { metrics: UFS_FETCHES, ..Self::with_slots(slots) }
    }

    /// `slots` 0: no gate (every request goes at once, counted).
    pub fn new(slots: usize, latency_reserve: usize, floor: u32) -> Self {
        Self {
            metrics: ANSWERS,
            slots,
            latency_reserve,
            floor,
            state: Mutex::new(GateState::default()),
            served: Default::default(),
            queued: Default::default(),
            created: Instant::now(),
            latency_seen: AtomicU64::new(0),
        }
    }

    /// Whether a latency answer started within [`LATENCY_RECENT`]. An answer of another class
    /// then yields to the runtime once before it is written: the gate orders the answers that
    /// wait for a place, but a latency request whose task is queued on the runtime behind a
    /// flood's (each about to write a large answer) would otherwise wait for all of them.
    pub fn latency_recent(&self) -> bool {
        match self.latency_seen.load(Ordering::Relaxed) {
            0 => false,
            seen => self.created.elapsed().as_nanos() as u64 + 1 - seen < LATENCY_RECENT.as_nanos() as u64,
        }
    }

    /// Steps aside once (a yield) when latency answers are being served and `class` is not
    /// latency; marks latency as active when it is.
    pub async fn step_aside(&self, class: QosClass) {
        if self.slots == 0 {
            return;
        }
        if class == QosClass::Latency {
            self.latency_seen.store(self.created.elapsed().as_nanos() as u64 + 1, Ordering::Relaxed);
        } else if self.latency_recent() {
            tokio::task::yield_now().await;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn limit(&self, class: QosClass) -> usize {
        match class {
            QosClass::Latency => self.slots + self.latency_reserve,
            _ => self.slots,
        }
    }

    /// A place for one request of `class`: at once when one is free and nobody of the same or
    /// a higher class waits, else when the gate hands one over.
    pub async fn acquire(&self, class: QosClass) -> ClassPermit<'_> {
        let i = class as usize;
        self.served[i].fetch_add(1, Ordering::Relaxed);
        let label = class.as_str();
        if self.slots == 0 {
            metrics::counter!(self.metrics.requests, "class" => label, "queued" => "false").increment(1);
            return ClassPermit { gate: None };
        }
        let rx = {
            let mut state = self.lock();
            // Waiters that went away are skipped by hand-overs; pruned here too, so a newcomer
            // never queues behind nobody.
            for w in &mut state.waiting[..=i] {
                while w.front().is_some_and(oneshot::Sender::is_closed) {
                    w.pop_front();
                }
            }
            let ahead = state.waiting[..=i].iter().any(|w| !w.is_empty());
            if !ahead && state.in_use < self.limit(class) {
                state.in_use += 1;
                drop(state);
                metrics::counter!(self.metrics.requests, "class" => label, "queued" => "false").increment(1);
                return ClassPermit { gate: Some(self) };
            }
            let (tx, rx) = oneshot::channel();
            state.waiting[i].push_back(tx);
            rx
        };
        self.queued[i].fetch_add(1, Ordering::Relaxed);
        metrics::counter!(self.metrics.requests, "class" => label, "queued" => "true").increment(1);
        let started = Instant::now();
        let mut waiting = Waiting { gate: self, rx: Some(rx) };
        // The sender lives in the gate until it is used: an error cannot happen while `self`
        // is borrowed, and would mean the place was never counted.
        let handed = waiting.rx.as_mut().expect("set above").await.is_ok();
        waiting.rx = None;
        metrics::histogram!(self.metrics.wait_seconds, "class" => label)
            .record(started.elapsed().as_secs_f64());
        ClassPermit { gate: handed.then_some(self) }
    }

    fn release(&self) {
        let mut state = self.lock();
        state.in_use -= 1;
        loop {
            let floor_turn = self.floor > 0 && state.handed % self.floor == self.floor - 1;
            let order: [QosClass; 3] = if floor_turn {
                [QosClass::Background, QosClass::Throughput, QosClass::Latency]
            } else {
                QosClass::ALL
            };
            let in_use = state.in_use;
            let Some(class) =
                order.into_iter().find(|&c| !state.waiting[c as usize].is_empty() && in_use < self.limit(c))
            else {
                return;
            };
            let tx = state.waiting[class as usize].pop_front().expect("not empty");
            // A waiter that went away (its connection closed) takes nothing.
            if tx.send(()).is_ok() {
                state.in_use += 1;
                state.handed = state.handed.wrapping_add(1);
            }
        }
    }

    /// Per class, highest first: requests let through and how many of them waited.
    pub fn counters(&self) -> [ClassCounters; 3] {
        std::array::from_fn(|i| ClassCounters {
            served: self.served[i].load(Ordering::Relaxed),
            queued: self.queued[i].load(Ordering::Relaxed),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    /// Starts a waiter of `class` that records its turn in `order` and holds its place until
    /// told to go.
    fn waiter(
        gate: &Arc<ClassGate>,
        class: QosClass,
        name: &'static str,
        order: &Arc<Mutex<Vec<&'static str>>>,
    ) -> (tokio::task::JoinHandle<()>, oneshot::Sender<()>) {
        let (go, hold) = oneshot::channel::<()>();
        let (gate, order) = (gate.clone(), order.clone());
        let task = tokio::spawn(async move {
            let _permit = gate.acquire(class).await;
            order.lock().unwrap().push(name);
            let _ = hold.await;
        });
        (task, go)
    }

    async fn queued(gate: &ClassGate, n: usize) {
        while gate.lock().waiting.iter().map(VecDeque::len).sum::<usize>() < n {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn free_places_are_taken_at_once_and_then_handed_over_by_class() {
        let gate = Arc::new(ClassGate::new(1, 0, 0));
        let order = Arc::new(Mutex::new(Vec::new()));
        let (first, release_first) = waiter(&gate, QosClass::Background, "holder", &order);
        while order.lock().unwrap().is_empty() {
            tokio::task::yield_now().await;
        }
        // Queued lowest first: each must still go in class order.
        let mut goes = Vec::new();
        let mut tasks = Vec::new();
        for (i, (class, name)) in [
            (QosClass::Background, "background"),
            (QosClass::Throughput, "throughput 1"),
            (QosClass::Throughput, "throughput 2"),
            (QosClass::Latency, "latency"),
        ]
        .into_iter()
        .enumerate()
        {
            let (task, go) = waiter(&gate, class, name, &order);
            queued(&gate, i + 1).await;
            tasks.push(task);
            goes.push(go);
        }
        release_first.send(()).unwrap();
        first.await.unwrap();
        for go in goes {
            go.send(()).unwrap();
        }
        // Each release hands the place on to the next in class order.
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(
            *order.lock().unwrap(),
            ["holder", "latency", "throughput 1", "throughput 2", "background"]
        );
        let counters = gate.counters();
        assert_eq!(counters[0], ClassCounters { served: 1, queued: 1 });
        assert_eq!(counters[1], ClassCounters { served: 2, queued: 2 });
        assert_eq!(counters[2], ClassCounters { served: 2, queued: 1 });
        assert_eq!(gate.lock().in_use, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_floor_gives_the_lowest_class_a_turn_under_a_latency_flood() {
        let gate = Arc::new(ClassGate::new(1, 0, 4));
        let holder = gate.acquire(QosClass::Latency).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let (background, go_background) = waiter(&gate, QosClass::Background, "background", &order);
        queued(&gate, 1).await;
        let mut latency = Vec::new();
        for i in 0..6 {
            latency.push(waiter(&gate, QosClass::Latency, ["l0", "l1", "l2", "l3", "l4", "l5"][i], &order));
            queued(&gate, i + 2).await;
        }
        drop(holder);
        go_background.send(()).unwrap();
        let (tasks, goes): (Vec<_>, Vec<_>) = latency.into_iter().unzip();
        for go in goes {
            go.send(()).unwrap();
        }
        background.await.unwrap();
        for task in tasks {
            task.await.unwrap();
        }
        // Hand-overs 1..3 go to latency; the 4th (a floor turn) to background.
        assert_eq!(*order.lock().unwrap(), ["l0", "l1", "l2", "background", "l3", "l4", "l5"]);
    }

    #[tokio::test(start_paused = true)]
    async fn latency_takes_its_reserve_while_the_others_wait() {
        let gate = ClassGate::new(2, 1, 8);
        let a = gate.acquire(QosClass::Throughput).await;
        let b = gate.acquire(QosClass::Throughput).await;
        // Full for throughput, not for latency.
        let latency =
            tokio::time::timeout(std::time::Duration::from_secs(1), gate.acquire(QosClass::Latency))
                .await
                .expect("the latency reserve was free");
        let blocked =
            tokio::time::timeout(std::time::Duration::from_secs(1), gate.acquire(QosClass::Throughput)).await;
        assert!(blocked.is_err(), "a third throughput answer waits");
        drop((a, b, latency));
        assert_eq!(gate.lock().in_use, 0, "the timed-out waiter gave back nothing it was not given");
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_that_goes_away_leaves_no_place_taken() {
        let gate = Arc::new(ClassGate::new(1, 0, 0));
        let held = gate.acquire(QosClass::Throughput).await;
        let g = gate.clone();
        let gone = tokio::spawn(async move {
            let _p = g.acquire(QosClass::Throughput).await;
        });
        queued(&gate, 1).await;
        gone.abort();
        let _ = gone.await;
        drop(held);
        assert_eq!(gate.lock().in_use, 0);
        let _again = gate.acquire(QosClass::Background).await;
        assert_eq!(gate.lock().in_use, 1);
    }

    #[tokio::test]
    async fn other_classes_step_aside_only_while_latency_answers_are_recent() {
        let gate = ClassGate::default();
        assert!(!gate.latency_recent(), "no latency answer yet");
        gate.step_aside(QosClass::Throughput).await;
        assert!(!gate.latency_recent(), "a throughput answer marks nothing");
        gate.step_aside(QosClass::Latency).await;
        assert!(gate.latency_recent());
        let off = ClassGate::new(0, 0, 0);
        off.step_aside(QosClass::Latency).await;
        assert!(!off.latency_recent(), "classes off: nothing is marked");
    }

    #[tokio::test]
    async fn no_slots_means_no_gate() {
        let gate = ClassGate::new(0, 0, 0);
        let permits: Vec<_> =
            futures::future::join_all((0..100).map(|_| gate.acquire(QosClass::Background))).await;
        assert_eq!(permits.len(), 100);
        assert_eq!(gate.counters()[2].served, 100);
    }
}
