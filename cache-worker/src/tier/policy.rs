//! S3-FIFO eviction (Yang et al., "FIFO queues are all you need for cache eviction", SOSP '23)
//! over keys with byte sizes: which blocks a tier evicts, and in which order.
//!
//! LRU lets a one-pass scan larger than the cache flush everything, however hot. S3-FIFO admits
//! new keys into a small FIFO (a tenth of the capacity) and keeps in the main FIFO only keys that
//! were hit while in small, or that come back soon after small evicted them (a ghost FIFO
//! remembers those keys, without data). A scan flows through small and ghost and leaves main
//! alone, and a hit only bumps a counter: no list is reordered under the tier's lock.
//!
//! Rules (each entry has a two-bit hit count, `freq`):
//! - [`insert`](S3Fifo::insert) puts a key into main if it is in ghost (it came back: it is
//!   reused), else into small, with freq 0. It never evicts: call `victims` first.
//! - [`touch`](S3Fifo::touch) (a hit) sets freq to min(freq + 1, 3).
//! - [`victims`](S3Fifo::victims) evicts from small while small holds at least its share of
//!   the capacity (`capacity / 10`), else from main. Small's oldest entry moves to main's tail
//!   if its freq > 0 (keeping its freq), else it is evicted and its key goes into ghost. Main's
//!   oldest entry goes back to main's tail with freq − 1 if its freq > 0, else it is evicted.
//! - A pinned entry is never evicted. Small hands it to main as if it had been hit, and main
//!   passes it to its tail without aging it: a pinned block costs one look per pass over main,
//!   not one per put, and once unpinned it goes at main's next pass over it. Main is given up
//!   once it has passed over, in a row, as many pinned entries as it holds (an entry that joins
//!   it from small without being seen pinned starts that count again): every entry left in it
//!   is pinned, so eviction takes from small even below its share, and fails when small is
//!   empty too.
//! - `victims` frees enough or changes nothing: it plans the whole eviction on a read-only pass
//!   and commits the plan only when it frees enough, so a refused put moves nothing.
//! - [`remove`](S3Fifo::remove) forgets a key; it is not an eviction, so ghost does not learn it.
//!
//! Invariants:
//! - `entries` holds each live key once. A queue item `(key, seq)` is current when `seq` is its
//!   key's entry's `seq`; every live key has exactly one current item, in the queue its entry
//!   names. Other items (of keys removed since) are stale and skipped, which makes `remove`
//!   O(1); a queue whose stale items outnumber its live ones is compacted, so they cost O(1)
//!   amortized.
//! - `small_bytes` and `small_len` (`main_*`) are the total size and number of the live entries
//!   of small (main); `used()` is their sum.
//! - A key is never both live and in ghost. `ghost_keys` holds each ghost key once, with the seq
//!   of its current item in `ghost` and what it is charged; `ghost_bytes`, the sum of the
//!   charges (its size, at least 1 so empty blocks cannot grow ghost without bound), never
//!   exceeds main's share of the capacity once an operation returns.
//! - `victims` and eviction cost O(entries looked at): each is evicted, moved or aged once per
//!   look, so over a run that is O(1) amortized per eviction, plus one look per pinned entry per
//!   pass of main.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

/// The highest hit count: an entry survives at most this many passes of main without a hit.
const MAX_FREQ: u8 = 3;
/// Queue items a queue may hold beyond twice its live entries before it is compacted.
const STALE_SLACK: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Queue {
    Small,
    Main,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    size: u64,
    freq: u8,
    queue: Queue,
    seq: u64,
}

/// An S3-FIFO eviction policy over keys with byte sizes; see the module docs for the rules.
/// It only keeps the order: the caller stores the data and applies the evictions it returns.
#[derive(Debug)]
pub struct S3Fifo<K> {
    capacity: u64,
    entries: HashMap<K, Entry>,
    small: VecDeque<(K, u64)>,
    main: VecDeque<(K, u64)>,
    small_bytes: u64,
    small_len: usize,
    main_bytes: u64,
    main_len: usize,
    ghost: VecDeque<(K, u64)>,
    ghost_keys: HashMap<K, (u64, u64)>,
    ghost_bytes: u64,
    next_seq: u64,
}

/// What `victims` would do, worked out without changing anything.
struct Plan<K> {
    /// Items taken from the front of small and of main (stale ones included).
    small_taken: usize,
    main_taken: usize,
    /// Entries that end up at main's tail, oldest first, with their freq then.
    appended: VecDeque<(K, u8)>,
    /// Evicted keys, in order, with whether they left from small (and so go into ghost).
    evicted: Vec<(K, bool)>,
}

impl<K: Clone + Eq + Hash> S3Fifo<K> {
    pub fn new(capacity: u64) -> Self {
        Self {
            capacity,
            entries: HashMap::new(),
            small: VecDeque::new(),
            main: VecDeque::new(),
            small_bytes: 0,
            small_len: 0,
            main_bytes: 0,
            main_len: 0,
            ghost: VecDeque::new(),
            ghost_keys: HashMap::new(),
            ghost_bytes: 0,
            next_seq: 0,
        }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The total size of the live entries.
    pub fn used(&self) -> u64 {
        self.small_bytes + self.main_bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn contains(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    /// A live entry's hit count (0 to 3), `None` for an absent key.
    pub fn freq(&self, key: &K) -> Option<u8> {
        self.entries.get(key).map(|e| e.freq)
    }

    /// Whether small evicted the key recently enough that inserting it again goes into main.
    pub fn in_ghost(&self, key: &K) -> bool {
        self.ghost_keys.contains_key(key)
    }

    fn small_share(&self) -> u64 {
        self.capacity / 10
    }

    fn ghost_limit(&self) -> u64 {
        self.capacity - self.small_share()
    }

    fn bump_seq(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        seq
    }

    fn is_current(&self, key: &K, seq: u64) -> bool {
        self.entries.get(key).is_some_and(|e| e.seq == seq)
    }

    /// Stores a key of `size` bytes: into main if it is in ghost, else into small. A live key
    /// is replaced (forgetting its hits). Nothing is evicted: make room with `victims` first.
    pub fn insert(&mut self, key: K, size: u64) {
        self.remove(&key);
        let queue = if self.forget_ghost(&key) { Queue::Main } else { Queue::Small };
        self.push(key, size, queue, 0);
    }

    /// Stores a key straight into main's tail, as one known to be worth keeping (what a tier
    /// had before a restart); otherwise like [`insert`](Self::insert).
    pub fn insert_main(&mut self, key: K, size: u64) {
        self.remove(&key);
        self.forget_ghost(&key);
        self.push(key, size, Queue::Main, 0);
    }

    fn push(&mut self, key: K, size: u64, queue: Queue, freq: u8) {
        let seq = self.bump_seq();
        match queue {
            Queue::Small => {
                self.small_bytes += size;
                self.small_len += 1;
                self.small.push_back((key.clone(), seq));
            }
            Queue::Main => {
                self.main_bytes += size;
                self.main_len += 1;
                self.main.push_back((key.clone(), seq));
            }
        }
        self.entries.insert(key, Entry { size, freq, queue, seq });
    }

    /// Counts a hit; `false` for an absent key.
    pub fn touch(&mut self, key: &K) -> bool {
        let Some(entry) = self.entries.get_mut(key) else {
            return false;
        };
        entry.freq = (entry.freq + 1).min(MAX_FREQ);
        true
    }

    /// Forgets a live key (ghost does not learn it), returning its size.
    pub fn remove(&mut self, key: &K) -> Option<u64> {
        let entry = self.take(key)?;
        let entries = &self.entries;
        let (queue, live) = match entry.queue {
            Queue::Small => (&mut self.small, self.small_len),
            Queue::Main => (&mut self.main, self.main_len),
        };
        if queue.len() > 2 * live + STALE_SLACK {
            queue.retain(|(k, seq)| entries.get(k).is_some_and(|e| e.seq == *seq));
        }
        Some(entry.size)
    }

    /// Drops a live entry and its bytes, leaving its queue item stale.
    fn take(&mut self, key: &K) -> Option<Entry> {
        let entry = self.entries.remove(key)?;
        match entry.queue {
            Queue::Small => {
                self.small_bytes -= entry.size;
                self.small_len -= 1;
            }
            Queue::Main => {
                self.main_bytes -= entry.size;
                self.main_len -= 1;
            }
        }
        Some(entry)
    }

    /// Takes a key out of ghost; whether it was there.
    fn forget_ghost(&mut self, key: &K) -> bool {
        let Some((_, charge)) = self.ghost_keys.remove(key) else {
            return false;
        };
        self.ghost_bytes -= charge;
        if self.ghost.len() > 2 * self.ghost_keys.len() + STALE_SLACK {
            let keys = &self.ghost_keys;
            self.ghost.retain(|(k, seq)| keys.get(k).is_some_and(|(s, _)| s == seq));
        }
        true
    }

    fn remember_in_ghost(&mut self, key: K, size: u64) {
        let seq = self.bump_seq();
        let charge = size.max(1);
        self.ghost.push_back((key.clone(), seq));
        self.ghost_keys.insert(key, (seq, charge));
        self.ghost_bytes += charge;
        while self.ghost_bytes > self.ghost_limit() {
            let Some((key, seq)) = self.ghost.pop_front() else { break };
            if let Some(&(current, charge)) = self.ghost_keys.get(&key)
                && current == seq
            {
                self.ghost_keys.remove(&key);
                self.ghost_bytes -= charge;
            }
        }
    }

    /// Evicts entries until `need` more bytes fit beside the rest within the capacity, and
    /// returns them in eviction order (an empty list when they already fit). Entries
    /// `is_pinned` names are passed over. When evicting every unpinned entry would not make
    /// room, nothing changes and the error is the bytes of the pinned entries.
    pub fn victims(&mut self, need: u64, mut is_pinned: impl FnMut(&K) -> bool) -> Result<Vec<K>, u64> {
        let to_free = (self.used() + need).saturating_sub(self.capacity);
        if to_free == 0 {
            return Ok(Vec::new());
        }
        let plan = self.plan(to_free, &mut is_pinned)?;
        Ok(self.commit(plan))
    }

    /// Evicts at least `bytes` bytes of the entries `keep` does not name — every one of them
    /// when they hold less — in the order `victims` takes them, and returns them in that order.
    /// Upkeep beside puts calls it: a tier above its high watermark (`keep` names the pinned
    /// entries), a mount above its quota (`keep` names every entry of other mounts too).
    pub fn evict_among(&mut self, bytes: u64, mut keep: impl FnMut(&K) -> bool) -> Vec<K> {
        let evictable: u64 = self.entries.iter().filter(|(key, _)| !keep(key)).map(|(_, e)| e.size).sum();
        let to_free = bytes.min(evictable);
        if to_free == 0 {
            return Vec::new();
        }
        // `victims` frees what keeps `need` more bytes within the capacity: ask for exactly
        // `to_free` beyond what fits. It cannot fail, since that many bytes are evictable.
        let need = self.capacity.saturating_sub(self.used()) + to_free;
        self.victims(need, keep).unwrap_or_default()
    }

    /// The next current item of `queue` at or after `*taken`, advancing `*taken` past it.
    fn next_current<'a>(&'a self, queue: &'a VecDeque<(K, u64)>, taken: &mut usize) -> Option<&'a K> {
        while let Some((key, seq)) = queue.get(*taken) {
            *taken += 1;
            if self.is_current(key, *seq) {
                return Some(key);
            }
        }
        None
    }

    fn plan(&self, to_free: u64, is_pinned: &mut impl FnMut(&K) -> bool) -> Result<Plan<K>, u64> {
        let mut plan = Plan { small_taken: 0, main_taken: 0, appended: VecDeque::new(), evicted: Vec::new() };
        let (mut small_bytes, mut small_len, mut main_len) =
            (self.small_bytes, self.small_len, self.main_len);
        let mut freed = 0;
        // Pinned entries main passed over in a row; once it reaches main_len, all of main is pinned.
        let mut pinned_in_a_row = 0;
        while freed < to_free {
            let main_all_pinned = pinned_in_a_row >= main_len;
            if small_len > 0 && (small_bytes >= self.small_share() || main_all_pinned) {
                let key = self.next_current(&self.small, &mut plan.small_taken).expect("small_len counts it");
                let entry = self.entries[key];
                small_bytes -= entry.size;
                small_len -= 1;
                if entry.freq > 0 {
                    plan.appended.push_back((key.clone(), entry.freq));
                    main_len += 1;
                    pinned_in_a_row = 0;
                } else if is_pinned(key) {
                    plan.appended.push_back((key.clone(), entry.freq));
                    main_len += 1;
                    if main_all_pinned {
                        pinned_in_a_row += 1;
                    }
                } else {
                    freed += entry.size;
                    plan.evicted.push((key.clone(), true));
                }
            } else if !main_all_pinned {
                let (key, freq) = match self.next_current(&self.main, &mut plan.main_taken) {
                    Some(key) => (key.clone(), self.entries[key].freq),
                    None => plan.appended.pop_front().expect("main_len counts it"),
                };
                if is_pinned(&key) {
                    pinned_in_a_row += 1;
                    plan.appended.push_back((key, freq));
                } else if freq > 0 {
                    pinned_in_a_row = 0;
                    plan.appended.push_back((key, freq - 1));
                } else {
                    pinned_in_a_row = 0;
                    freed += self.entries[&key].size;
                    main_len -= 1;
                    plan.evicted.push((key, false));
                }
            } else {
                // Everything left is pinned.
                return Err(self.used() - freed);
            }
        }
        Ok(plan)
    }

    fn commit(&mut self, plan: Plan<K>) -> Vec<K> {
        // Every current item taken is now either evicted or appended.
        self.small.drain(..plan.small_taken);
        self.main.drain(..plan.main_taken);
        let mut victims = Vec::with_capacity(plan.evicted.len());
        for (key, from_small) in plan.evicted {
            let entry = self.take(&key).expect("planned victims are live");
            if from_small {
                self.remember_in_ghost(key.clone(), entry.size);
            }
            victims.push(key);
        }
        for (key, freq) in plan.appended {
            let seq = self.bump_seq();
            let entry = self.entries.get_mut(&key).expect("planned entries are live");
            if entry.queue == Queue::Small {
                self.small_bytes -= entry.size;
                self.small_len -= 1;
                self.main_bytes += entry.size;
                self.main_len += 1;
            }
            *entry = Entry { queue: Queue::Main, freq, seq, ..*entry };
            self.main.push_back((key, seq));
        }
        victims
    }

    /// The live entries with their sizes: small oldest first, then main oldest first — the
    /// order eviction looks at them in (a hit or pinned entry is passed to main's tail).
    pub fn iter(&self) -> impl Iterator<Item = (&K, u64)> {
        self.small
            .iter()
            .chain(&self.main)
            .filter(|(key, seq)| self.is_current(key, *seq))
            .map(|(key, _)| (key, self.entries[key].size))
    }

    /// Ghost keys, oldest first.
    #[cfg(test)]
    fn ghost_iter(&self) -> impl Iterator<Item = &K> {
        self.ghost
            .iter()
            .filter(|(key, seq)| self.ghost_keys.get(key).is_some_and(|(s, _)| s == seq))
            .map(|(key, _)| key)
    }

    /// Which queue a live key is in: `Some(true)` for small.
    #[cfg(test)]
    fn in_small(&self, key: &K) -> Option<bool> {
        self.entries.get(key).map(|e| e.queue == Queue::Small)
    }
}

/// The same rules written the plain way — queues as `VecDeque`s searched linearly, eviction on
/// a copy that is kept only when it freed enough — for property tests of [`S3Fifo`] and of the
/// tiers built on it.
#[cfg(test)]
pub(crate) mod reference {
    use std::collections::VecDeque;

    #[derive(Debug, Clone)]
    pub(crate) struct Reference<K> {
        capacity: u64,
        /// `(key, size, freq)`, oldest first.
        small: VecDeque<(K, u64, u8)>,
        main: VecDeque<(K, u64, u8)>,
        /// `(key, size)`, oldest first.
        ghost: VecDeque<(K, u64)>,
    }

    impl<K: Clone + Eq> Reference<K> {
        pub(crate) fn new(capacity: u64) -> Self {
            Self { capacity, small: VecDeque::new(), main: VecDeque::new(), ghost: VecDeque::new() }
        }

        pub(crate) fn used(&self) -> u64 {
            self.small.iter().chain(&self.main).map(|e| e.1).sum()
        }

        /// Live keys with sizes: small oldest first, then main.
        pub(crate) fn entries(&self) -> Vec<(K, u64)> {
            self.small.iter().chain(&self.main).map(|e| (e.0.clone(), e.1)).collect()
        }

        pub(crate) fn ghost(&self) -> Vec<K> {
            self.ghost.iter().map(|g| g.0.clone()).collect()
        }

        pub(crate) fn contains(&self, key: &K) -> bool {
            self.small.iter().chain(&self.main).any(|e| e.0 == *key)
        }

        pub(crate) fn freq(&self, key: &K) -> Option<u8> {
            self.small.iter().chain(&self.main).find(|e| e.0 == *key).map(|e| e.2)
        }

        pub(crate) fn in_small(&self, key: &K) -> Option<bool> {
            if self.small.iter().any(|e| e.0 == *key) {
                Some(true)
            } else {
                self.main.iter().any(|e| e.0 == *key).then_some(false)
            }
        }

        pub(crate) fn insert(&mut self, key: K, size: u64) {
            self.remove(&key);
            let before = self.ghost.len();
            self.ghost.retain(|g| g.0 != key);
            if self.ghost.len() < before {
                self.main.push_back((key, size, 0));
            } else {
                self.small.push_back((key, size, 0));
            }
        }

        pub(crate) fn insert_main(&mut self, key: K, size: u64) {
            self.remove(&key);
            self.ghost.retain(|g| g.0 != key);
            self.main.push_back((key, size, 0));
        }

        pub(crate) fn touch(&mut self, key: &K) -> bool {
            match self.small.iter_mut().chain(&mut self.main).find(|e| e.0 == *key) {
                Some(e) => {
                    e.2 = (e.2 + 1).min(3);
                    true
                }
                None => false,
            }
        }

        pub(crate) fn remove(&mut self, key: &K) -> Option<u64> {
            for queue in [&mut self.small, &mut self.main] {
                if let Some(pos) = queue.iter().position(|e| e.0 == *key) {
                    return queue.remove(pos).map(|e| e.1);
                }
            }
            None
        }

        pub(crate) fn victims(&mut self, need: u64, is_pinned: impl Fn(&K) -> bool) -> Result<Vec<K>, u64> {
            let mut next = self.clone();
            let mut victims = Vec::new();
            let share = self.capacity / 10;
            let mut pinned_in_a_row = 0;
            while next.used() + need > self.capacity {
                let small_bytes: u64 = next.small.iter().map(|e| e.1).sum();
                let main_all_pinned = pinned_in_a_row >= next.main.len();
                if !next.small.is_empty() && (small_bytes >= share || main_all_pinned) {
                    let (key, size, freq) = next.small.pop_front().unwrap();
                    if freq > 0 {
                        next.main.push_back((key, size, freq));
                        pinned_in_a_row = 0;
                    } else if is_pinned(&key) {
                        next.main.push_back((key, size, freq));
                        if main_all_pinned {
                            pinned_in_a_row += 1;
                        }
                    } else {
                        next.ghost.push_back((key.clone(), size.max(1)));
                        while next.ghost.iter().map(|g| g.1).sum::<u64>() > self.capacity - share {
                            next.ghost.pop_front();
                        }
                        victims.push(key);
                    }
                } else if !main_all_pinned {
                    let (key, size, freq) = next.main.pop_front().unwrap();
                    if is_pinned(&key) {
                        pinned_in_a_row += 1;
                        next.main.push_back((key, size, freq));
                    } else if freq > 0 {
                        pinned_in_a_row = 0;
                        next.main.push_back((key, size, freq - 1));
                    } else {
                        pinned_in_a_row = 0;
                        victims.push(key);
                    }
                } else {
                    return Err(self
                        .small
                        .iter()
                        .chain(&self.main)
                        .filter(|e| is_pinned(&e.0))
                        .map(|e| e.1)
                        .sum());
                }
            }
            *self = next;
            Ok(victims)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::reference::Reference;
    use super::*;

    fn keys(policy: &S3Fifo<u64>) -> Vec<u64> {
        policy.iter().map(|(k, _)| *k).collect()
    }

    /// Evicts what `size` more bytes need, then inserts: what a tier's put does.
    fn put(policy: &mut S3Fifo<u64>, key: u64, size: u64) -> Vec<u64> {
        let victims = policy.victims(size, |_| false).unwrap();
        policy.insert(key, size);
        victims
    }

    #[test]
    fn a_new_key_is_evicted_before_one_that_was_hit() {
        let mut policy = S3Fifo::new(30);
        for k in 0..3 {
            put(&mut policy, k, 10);
        }
        assert!(policy.touch(&0));
        assert!(!policy.touch(&9));
        // 0 was hit: it moves to main, and 1 (not hit) goes, remembered in ghost.
        assert_eq!(put(&mut policy, 3, 10), vec![1]);
        assert_eq!(keys(&policy), vec![2, 3, 0]);
        assert_eq!(policy.in_small(&0), Some(false));
        assert!(policy.in_ghost(&1));
        // Back soon after it left: 1 is reused, so it goes straight into main.
        assert_eq!(put(&mut policy, 1, 10), vec![2]);
        assert_eq!(policy.in_small(&1), Some(false));
        assert!(!policy.in_ghost(&1));
        assert_eq!(keys(&policy), vec![3, 0, 1]);
        assert_eq!(policy.used(), 30);
        assert_eq!(policy.len(), 3);
    }

    #[test]
    fn main_gives_each_hit_a_pass_before_evicting() {
        let mut policy = S3Fifo::new(100);
        for k in 0..10 {
            policy.insert_main(k, 10);
        }
        policy.touch(&0);
        policy.touch(&0);
        policy.touch(&1);
        // Small is empty, so main evicts: 0 and 1 are passed to the tail (a hit less each).
        assert_eq!(policy.victims(30, |_| false).unwrap(), vec![2, 3, 4]);
        assert_eq!(keys(&policy), vec![5, 6, 7, 8, 9, 0, 1]);
        assert_eq!((policy.freq(&0), policy.freq(&1)), (Some(1), Some(0)));
        assert!(policy.ghost_iter().next().is_none(), "main's victims are not remembered");
        assert_eq!(policy.victims(100, |_| false).unwrap(), vec![5, 6, 7, 8, 9, 1, 0]);
        assert!(policy.is_empty());
        assert_eq!(policy.used(), 0);
    }

    #[test]
    fn hits_are_capped_at_three() {
        let mut policy = S3Fifo::new(100);
        policy.insert_main(0, 10);
        for _ in 0..10 {
            policy.touch(&0);
        }
        assert_eq!(policy.freq(&0), Some(3));
    }

    #[test]
    fn a_refused_eviction_changes_nothing() {
        let mut policy = S3Fifo::new(30);
        for k in 0..3 {
            put(&mut policy, k, 10);
        }
        policy.touch(&2);
        let before: Vec<_> = keys(&policy);
        // 0 and 1 pinned: evicting 2 frees 10, not 20.
        assert_eq!(policy.victims(20, |k| *k < 2), Err(20));
        assert_eq!(keys(&policy), before);
        assert_eq!(policy.freq(&2), Some(1));
        assert!(policy.ghost_iter().next().is_none());
        // A pinned entry is handed to main and passed over.
        assert_eq!(policy.victims(10, |k| *k == 0), Ok(vec![1]));
        assert_eq!(keys(&policy), vec![2, 0]);
        assert_eq!(policy.in_small(&0), Some(false));
        assert_eq!(policy.victims(40, |_| true), Err(20), "more than the capacity");
        assert_eq!(policy.victims(0, |_| true), Ok(vec![]), "nothing to free");
    }

    #[test]
    fn removed_keys_leave_no_trace_and_stale_items_are_compacted() {
        let mut policy = S3Fifo::new(1 << 20);
        for k in 0..1000 {
            put(&mut policy, k, 1);
        }
        for k in 0..990 {
            assert_eq!(policy.remove(&k), Some(1));
        }
        assert_eq!(policy.remove(&0), None);
        assert!(policy.small.len() <= 2 * policy.small_len + STALE_SLACK);
        assert_eq!(keys(&policy), (990..1000).collect::<Vec<_>>());
        assert!(!policy.in_ghost(&0), "a removal is not an eviction");
        assert_eq!(policy.used(), 10);
    }

    #[test]
    fn ghost_stays_within_mains_share() {
        let mut policy = S3Fifo::new(100);
        // A scan of empty and full-size blocks: both are remembered, neither without bound.
        for k in 0..1000 {
            put(&mut policy, k, if k % 2 == 0 { 0 } else { 10 });
            assert!(policy.ghost_bytes <= 90);
            assert!(policy.ghost.len() <= 2 * policy.ghost_keys.len() + STALE_SLACK + 1);
        }
        assert!(policy.ghost_iter().count() > 0 && !policy.in_ghost(&1));
    }

    /// A plain LRU over unit-size keys, to compare hit ratios with.
    struct Lru {
        capacity: usize,
        order: VecDeque<u64>,
    }

    impl Lru {
        fn access(&mut self, key: u64) -> bool {
            let hit = match self.order.iter().position(|&k| k == key) {
                Some(pos) => {
                    self.order.remove(pos);
                    true
                }
                None => false,
            };
            if !hit && self.order.len() == self.capacity {
                self.order.pop_front();
            }
            self.order.push_back(key);
            hit
        }
    }

    fn s3fifo_access(policy: &mut S3Fifo<u64>, key: u64) -> bool {
        if policy.touch(&key) {
            return true;
        }
        put(policy, key, 1);
        false
    }

    /// The goal: a hot set of 20% of the capacity, read twice, then read in turns with
    /// capacity-sized stretches of a one-pass scan of 3× the capacity. LRU loses the hot set to
    /// every stretch; S3-FIFO keeps it in main while the scan goes through small and ghost.
    #[test]
    fn a_hot_set_survives_a_scan_of_three_times_the_capacity() {
        const CAPACITY: u64 = 1000;
        let hot: Vec<u64> = (0..CAPACITY / 5).collect();
        let mut scan = (1_000_000..1_000_000 + 3 * CAPACITY).peekable();
        let mut policy = S3Fifo::new(CAPACITY);
        let mut lru = Lru { capacity: CAPACITY as usize, order: VecDeque::new() };
        let mut hot_reads = 0;
        let (mut policy_hits, mut lru_hits) = (0, 0);
        for &k in hot.iter().chain(&hot) {
            s3fifo_access(&mut policy, k);
            lru.access(k);
        }
        while scan.peek().is_some() {
            for k in scan.by_ref().take(CAPACITY as usize) {
                assert!(!s3fifo_access(&mut policy, k) && !lru.access(k));
            }
            for &k in &hot {
                hot_reads += 1;
                policy_hits += s3fifo_access(&mut policy, k) as u32;
                lru_hits += lru.access(k) as u32;
            }
            assert!(policy.used() <= CAPACITY);
        }
        let policy_ratio = f64::from(policy_hits) / f64::from(hot_reads);
        let lru_ratio = f64::from(lru_hits) / f64::from(hot_reads);
        assert!(policy_ratio >= 0.9, "S3-FIFO hot-set hit ratio {policy_ratio}");
        assert!(lru_ratio < 0.2, "LRU hot-set hit ratio {lru_ratio}");
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// A tier's put: make room, then insert (skipped when it is refused).
        Put(u64, u64),
        /// Recovery of a block found at start.
        PutMain(u64, u64),
        Touch(u64),
        Remove(u64),
        /// Make room for this many bytes, nothing inserted.
        Victims(u64),
        /// Which keys are pinned from now on (a bit per key).
        Pins(u16),
        /// Upkeep: evict this many bytes of the keys outside a mask (a bit per key).
        EvictAmong(u64, u16),
    }

    const KEYS: u64 = 12;

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0..KEYS, 0u64..30).prop_map(|(k, s)| Op::Put(k, s)),
            1 => (0..KEYS, 0u64..30).prop_map(|(k, s)| Op::PutMain(k, s)),
            5 => (0..KEYS).prop_map(Op::Touch),
            1 => (0..KEYS).prop_map(Op::Remove),
            1 => (0u64..120).prop_map(Op::Victims),
            1 => any::<u16>().prop_map(|mask| Op::Pins(mask & (mask >> 3))),
            1 => (0u64..120, any::<u16>()).prop_map(|(b, mask)| Op::EvictAmong(b, mask)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn behaves_like_the_reference(
            capacity in 1u64..120,
            ops in proptest::collection::vec(op(), 1..150),
        ) {
            let mut policy = S3Fifo::new(capacity);
            let mut model = Reference::new(capacity);
            let mut pins = 0u16;
            for op in ops {
                let pinned = |k: &u64| pins & (1 << k) != 0;
                match op {
                    Op::Put(k, size) | Op::PutMain(k, size) => {
                        // Like the tiers: a key is only inserted while absent.
                        policy.remove(&k);
                        model.remove(&k);
                        if size <= capacity {
                            let got = policy.victims(size, pinned);
                            prop_assert_eq!(&got, &model.victims(size, pinned));
                            if got.is_ok() {
                                if matches!(op, Op::Put(..)) {
                                    policy.insert(k, size);
                                    model.insert(k, size);
                                } else {
                                    policy.insert_main(k, size);
                                    model.insert_main(k, size);
                                }
                                prop_assert!(policy.used() <= capacity);
                            }
                        }
                    }
                    Op::Touch(k) => prop_assert_eq!(policy.touch(&k), model.touch(&k)),
                    Op::Remove(k) => prop_assert_eq!(policy.remove(&k), model.remove(&k)),
                    Op::Victims(need) => {
                        let got = policy.victims(need, pinned);
                        prop_assert_eq!(&got, &model.victims(need, pinned));
                        if got.is_ok() {
                            prop_assert!(policy.used() + need <= capacity);
                        }
                    }
                    Op::Pins(mask) => pins = mask,
                    Op::EvictAmong(bytes, mask) => {
                        let keep = |k: &u64| pinned(k) || mask & (1 << k) != 0;
                        let evictable: u64 =
                            policy.iter().filter(|(k, _)| !keep(k)).map(|(_, s)| s).sum();
                        let used = policy.used();
                        let got = policy.evict_among(bytes, keep);
                        let to_free = bytes.min(evictable);
                        if to_free > 0 {
                            let expected = model.victims(capacity - used + to_free, keep);
                            prop_assert_eq!(Ok(got.clone()), expected);
                        } else {
                            prop_assert!(got.is_empty());
                        }
                        prop_assert!(got.iter().all(|k| !keep(k)), "a kept entry evicted");
                        prop_assert!(used - policy.used() >= to_free, "freed too little");
                    }
                }
                let entries: Vec<(u64, u64)> = policy.iter().map(|(k, s)| (*k, s)).collect();
                prop_assert_eq!(&entries, &model.entries());
                prop_assert_eq!(policy.ghost_iter().copied().collect::<Vec<_>>(), model.ghost());
                prop_assert_eq!(policy.used(), model.used());
                prop_assert_eq!(policy.len(), entries.len());
                let live: BTreeSet<u64> = entries.iter().map(|e| e.0).collect();
                prop_assert_eq!(live.len(), entries.len(), "a key listed twice");
                for k in 0..KEYS {
                    prop_assert_eq!(policy.contains(&k), model.contains(&k));
                    prop_assert_eq!(policy.freq(&k), model.freq(&k));
                    prop_assert_eq!(policy.in_small(&k), model.in_small(&k));
                    prop_assert!(!(policy.contains(&k) && policy.in_ghost(&k)));
                }
                prop_assert!(policy.ghost_bytes <= capacity - capacity / 10);
            }
        }
    }
}
