//! The prefetch lane: whole blocks a reader said it will ask for next (a training job's sampler
//! knows its next files), fetched ahead of it in the order given.
//!
//! Each reader is a *stream* (an id the client picks). A hint message is the stream's whole
//! window of what comes next: it replaces what the stream hinted before, so blocks the reader
//! has passed are dropped without being fetched. Up to `parallelism` fetches run at once,
//! taken from the streams in turn; they share the single flight with client reads (a read of
//! a block being prefetched waits for that fetch) and are not slowed by client reads as the
//! warmup lane is: the lane sits above warmup and below client reads only in that its
//! parallelism is bounded and its work is dropped when the reader overtakes it.
//!
//! Counted (`strata_worker_prefetch_total{result}`): `fetched` (from the UFS or a peer),
//! `cached` (held already), `failed`, `dropped` (replaced before it started), `hit` (a client
//! read of a block the lane fetched, or is fetching: the read joins that fetch), `late` (a
//! client read of a block still waiting in the lane: the read fetches it, the lane drops it).
//! A block the lane is fetching is not queued again by the windows that follow.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use strata_common::frame::ReadBlockRequest;
use tokio_util::sync::CancellationToken;
use tracing::debug;
use xxhash_rust::xxh3::xxh3_64;

use crate::blocks::{BlockRead, BlockService};
use crate::metrics_defs as m;

/// Fetches of the lane in flight at once, by default.
pub const DEFAULT_PREFETCH_PARALLELISM: usize = 16;
/// Streams kept; a hint for a new stream beyond it drops the one hinted longest ago.
const MAX_STREAMS: usize = 1024;
/// Blocks the lane fetched and no client read yet, remembered to count hits.
const MAX_FETCHED: usize = 65_536;
/// A stream not hinted for this long is forgotten with what it still holds.
const STREAM_IDLE: Duration = Duration::from_secs(300);

/// (path, version, block index), hashed: what a hint and a read have in common.
type HintKey = u64;

fn hint_key(path: &str, version: &str, index: u64) -> HintKey {
    let mut buf = Vec::with_capacity(path.len() + version.len() + 10);
    buf.extend_from_slice(path.as_bytes());
    buf.push(0);
    buf.extend_from_slice(version.as_bytes());
    buf.push(0);
    buf.extend_from_slice(&index.to_le_bytes());
    xxh3_64(&buf)
}

struct Stream {
    pending: VecDeque<(HintKey, BlockRead)>,
    hinted_at: Instant,
}

#[derive(Default)]
struct State {
    streams: HashMap<u64, Stream>,
    /// Streams with pending blocks, in the order the lane serves them.
    turn: VecDeque<u64>,
    /// Blocks waiting in some stream and not started, by the stream holding them.
    queued: HashMap<HintKey, u64>,
    /// Blocks the lane is fetching that no read has asked for yet.
    in_flight: HashSet<HintKey>,
    /// Blocks the lane fetched that no read has asked for yet (oldest first, bounded).
    fetched: HashSet<HintKey>,
    fetched_order: VecDeque<HintKey>,
}

/// What the lane did (tests, `strata status`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PrefetchCounters {
    pub hinted: u64,
    pub fetched: u64,
    pub cached: u64,
    pub failed: u64,
    pub dropped: u64,
    pub hit: u64,
    pub late: u64,
}

#[derive(Default)]
struct Counts {
    hinted: AtomicU64,
    fetched: AtomicU64,
    cached: AtomicU64,
    failed: AtomicU64,
    dropped: AtomicU64,
    hit: AtomicU64,
    late: AtomicU64,
}

impl Counts {
    fn add(&self, result: &'static str, n: u64) {
        if n == 0 {
            return;
        }
        let c = match result {
            "hinted" => &self.hinted,
            "fetched" => &self.fetched,
            "cached" => &self.cached,
            "failed" => &self.failed,
            "dropped" => &self.dropped,
            "hit" => &self.hit,
            _ => &self.late,
        };
        c.fetch_add(n, Ordering::Relaxed);
        if result != "hinted" {
            metrics::counter!(m::PREFETCH, "result" => result).increment(n);
        }
    }
}

pub struct Prefetcher {
    state: Mutex<State>,
    wake: tokio::sync::Notify,
    counts: Counts,
}

impl Default for Prefetcher {
    fn default() -> Self {
        Self { state: Mutex::default(), wake: tokio::sync::Notify::new(), counts: Counts::default() }
    }
}

impl Prefetcher {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn counters(&self) -> PrefetchCounters {
        let c = &self.counts;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PrefetchCounters {
            hinted: get(&c.hinted),
            fetched: get(&c.fetched),
            cached: get(&c.cached),
            failed: get(&c.failed),
            dropped: get(&c.dropped),
            hit: get(&c.hit),
            late: get(&c.late),
        }
    }

    /// `stream`'s new window: these whole blocks, in this order, replacing what it hinted
    /// before (what of that has not started is dropped). Blocks the lane fetched and nobody
    /// read yet are not asked again. Returns how many were queued.
    pub fn hint(&self, stream: u64, items: &[ReadBlockRequest], now: Instant) -> usize {
        let mut guard = self.lock();
        let state = &mut *guard;
        let mut dropped = 0;
        if let Some(old) = state.streams.remove(&stream) {
            for (key, _) in old.pending {
                if state.queued.get(&key) == Some(&stream) {
                    state.queued.remove(&key);
                    dropped += 1;
                }
            }
        }
        // Forget idle streams, and the oldest beyond the bound.
        let idle: Vec<u64> = state
            .streams
            .iter()
            .filter(|(_, s)| now.duration_since(s.hinted_at) > STREAM_IDLE)
            .map(|(id, _)| *id)
            .collect();
        let mut gone = idle;
        if state.streams.len() >= MAX_STREAMS
            && let Some((&oldest, _)) = state.streams.iter().min_by_key(|(_, s)| s.hinted_at)
        {
            gone.push(oldest);
        }
        for id in gone {
            if let Some(old) = state.streams.remove(&id) {
                for (key, _) in old.pending {
                    if state.queued.get(&key) == Some(&id) {
                        state.queued.remove(&key);
                        dropped += 1;
                    }
                }
            }
        }
        let mut pending = VecDeque::with_capacity(items.len());
        for req in items {
            let key = hint_key(&req.path, &req.version, req.block_index);
            if state.fetched.contains(&key)
                || state.queued.contains_key(&key)
                || state.in_flight.contains(&key)
            {
                continue;
            }
            state.queued.insert(key, stream);
            pending.push_back((
                key,
                BlockRead::whole_block(
                    &req.path,
                    &req.version,
                    req.file_size,
                    req.block_size,
                    req.block_index,
                ),
            ));
        }
        let queued = pending.len();
        if queued > 0 {
            state.streams.insert(stream, Stream { pending, hinted_at: now });
            if !state.turn.contains(&stream) {
                state.turn.push_back(stream);
            }
        }
        drop(guard);
        self.counts.add("hinted", items.len() as u64);
        self.counts.add("dropped", dropped);
        if queued > 0 {
            self.wake.notify_waiters();
        }
        queued
    }

    /// A client read of a block: a hit when the lane fetched it or is fetching it (the read
    /// joins that fetch), late when it still waits there (the read fetches it; the lane will
    /// not).
    pub fn on_read(&self, path: &str, version: &str, index: u64) {
        let key = hint_key(path, version, index);
        let mut state = self.lock();
        if state.fetched.remove(&key) || state.in_flight.remove(&key) {
            drop(state);
            self.counts.add("hit", 1);
        } else if state.queued.remove(&key).is_some() {
            drop(state);
            self.counts.add("late", 1);
        }
    }

    /// The next block to fetch: from the stream whose turn it is, skipping blocks read meanwhile.
    fn next(&self) -> Option<(HintKey, BlockRead)> {
        let mut state = self.lock();
        let state = &mut *state;
        while let Some(stream) = state.turn.pop_front() {
            let Some(s) = state.streams.get_mut(&stream) else { continue };
            while let Some((key, read)) = s.pending.pop_front() {
                if state.queued.get(&key) != Some(&stream) {
                    continue;
                }
                state.queued.remove(&key);
                state.in_flight.insert(key);
                if s.pending.is_empty() {
                    state.streams.remove(&stream);
                } else {
                    state.turn.push_back(stream);
                }
                return Some((key, read));
            }
            state.streams.remove(&stream);
        }
        None
    }

    /// The lane's fetch of `key` ended (`held`: the block is in the cache). Remembered for the
    /// read that will count it a hit, unless that read came while it was being fetched.
    fn done(&self, key: HintKey, held: bool) {
        let mut state = self.lock();
        let unread = state.in_flight.remove(&key);
        if held && unread && state.fetched.insert(key) {
            state.fetched_order.push_back(key);
        }
        while state.fetched_order.len() > MAX_FETCHED {
            if let Some(old) = state.fetched_order.pop_front() {
                state.fetched.remove(&old);
            }
        }
    }
}

/// The lane's fetchers, `parallelism` of them, until `cancel`.
pub async fn run(
    prefetcher: Arc<Prefetcher>,
    blocks: Arc<BlockService>,
    parallelism: usize,
    cancel: CancellationToken,
) {
    let fetchers = (0..parallelism.max(1)).map(|_| {
        let (p, blocks, cancel) = (prefetcher.clone(), blocks.clone(), cancel.clone());
        async move {
            loop {
                let woken = p.wake.notified();
                let Some((key, read)) = p.next() else {
                    tokio::select! {
                        () = cancel.cancelled() => return,
                        () = woken => continue,
                    }
                };
                match blocks.load(&read).await {
                    Ok(outcome) => {
                        p.counts.add(if outcome.already_cached { "cached" } else { "fetched" }, 1);
                        p.done(key, true);
                    }
                    Err(e) => {
                        p.counts.add("failed", 1);
                        p.done(key, false);
                        debug!(path = %read.path, index = read.index, err = %e, "prefetch of a block failed");
                    }
                }
            }
        }
    });
    futures::future::join_all(fetchers).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(path: &str, index: u64) -> ReadBlockRequest {
        ReadBlockRequest {
            req_id: 0,
            path: path.into(),
            version: "v".into(),
            file_size: 10,
            block_size: 4,
            block_index: index,
            offset: 0,
            len: 0,
        }
    }

    #[test]
    fn a_new_window_replaces_the_old_and_streams_take_turns() {
        let p = Prefetcher::default();
        let now = Instant::now();
        assert_eq!(p.hint(1, &[req("/a", 0), req("/b", 0), req("/c", 0)], now), 3);
        assert_eq!(p.hint(2, &[req("/x", 0), req("/y", 0)], now), 2);
        let order: Vec<String> = (0..2).map(|_| p.next().unwrap().1.path).collect();
        assert_eq!(order, vec!["/a", "/x"]);
        // Stream 1 moved on: /b is dropped, /c kept, /d added.
        assert_eq!(p.hint(1, &[req("/c", 0), req("/d", 0)], now), 2);
        assert_eq!(p.counters().dropped, 2, "/b and the /c it replaced");
        // A client read of /y before the lane got to it: late, and not fetched.
        p.on_read("/y", "v", 0);
        let rest: Vec<String> = std::iter::from_fn(|| p.next()).map(|(_, r)| r.path).collect();
        assert_eq!(rest, vec!["/c", "/d"]);
        assert_eq!(p.counters().late, 1);
    }

    #[test]
    fn a_fetched_block_counts_one_hit_and_is_not_hinted_again() {
        let p = Prefetcher::default();
        let now = Instant::now();
        p.hint(1, &[req("/a", 0), req("/a", 1)], now);
        let (key, _) = p.next().unwrap();
        p.done(key, true);
        assert_eq!(p.hint(1, &[req("/a", 0), req("/a", 1)], now), 1, "the fetched block is not queued again");
        p.on_read("/a", "v", 0);
        p.on_read("/a", "v", 0);
        assert_eq!(p.counters().hit, 1);
        // Another version is another block.
        p.on_read("/a", "w", 1);
        assert_eq!(p.counters().late, 0);
        p.on_read("/a", "v", 1);
        assert_eq!(p.counters().late, 1);
    }

    #[test]
    fn a_block_being_fetched_is_not_queued_again_and_a_read_of_it_is_a_hit() {
        let p = Prefetcher::default();
        let now = Instant::now();
        p.hint(1, &[req("/a", 0), req("/b", 0)], now);
        let (a, read) = p.next().unwrap();
        assert_eq!(read.path, "/a");
        // The reader's next window still names /a, whose fetch is under way: only /b and /c.
        assert_eq!(p.hint(1, &[req("/a", 0), req("/b", 0), req("/c", 0)], now), 2);
        let rest: Vec<String> = std::iter::from_fn(|| p.next()).map(|(_, r)| r.path).collect();
        assert_eq!(rest, vec!["/b", "/c"], "/a is fetched once");
        // The reader asks for /a while the lane fetches it: it joins that fetch, a hit.
        p.on_read("/a", "v", 0);
        assert_eq!(p.counters().hit, 1);
        p.done(a, true);
        p.on_read("/a", "v", 0);
        assert_eq!(p.counters().hit, 1, "counted once");
        // A failed fetch is forgotten: the block may be hinted again.
        p.hint(2, &[req("/z", 0)], now);
        let (z, _) = p.next().unwrap();
        p.done(z, false);
        assert_eq!(p.hint(2, &[req("/z", 0)], now), 1);
    }

    #[test]
    fn idle_streams_are_forgotten() {
        let p = Prefetcher::default();
        let t0 = Instant::now();
        p.hint(1, &[req("/a", 0)], t0);
        p.hint(2, &[req("/b", 0)], t0 + STREAM_IDLE + Duration::from_secs(1));
        let left: Vec<String> = std::iter::from_fn(|| p.next()).map(|(_, r)| r.path).collect();
        assert_eq!(left, vec!["/b"]);
        assert_eq!(p.counters().dropped, 1);
    }
}
