//! DRAM tier: blocks kept as [`Bytes`] in a map, bounded by the sum of their lengths, with exact
//! LRU eviction.
//!
//! Invariants (all state sits behind one mutex, so every operation sees them hold):
//! - `used` is the sum of the lengths of the stored blocks and never exceeds the capacity.
//! - `lru` holds exactly one tick per stored block and each entry remembers its tick, so the first
//!   entry of `lru` is the least recently used block. Ticks only grow, so a refresh is a
//!   remove + insert in `lru`, O(log n).
//! - Replaying `events` (since the last drain, on top of what was drained before) yields exactly
//!   the current key set: every insertion pushes `Added`, every eviction or removal `Removed`.
//!   A re-put of the same size swaps the bytes in place and pushes nothing, because the master's
//!   view (key and size) does not change.
//! - Blocks are stored and returned as `Bytes` handles: a hit is a reference-count bump, never a
//!   copy. The accounting uses the handle's length; a `Bytes` that is a slice of a larger buffer
//!   keeps that whole buffer alive, which callers avoid by handing in block-sized buffers.
//!
//! The event queue is drained by the worker's block reporter; it is not bounded here because
//! dropping events would break the replay invariant the master relies on.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use async_trait::async_trait;
use bytes::Bytes;
use strata_common::BlockKey;

use super::{EvictionSink, PinFilter, Result, Tier, TierError, TierEvent, TierKind, TierUsage};

/// The DRAM tier. A capacity of 0 disables it: every `put` is refused with `TooLarge` and every
/// `get` misses.
pub struct MemoryTier {
    capacity: u64,
    inner: Mutex<Inner>,
    eviction_sink: OnceLock<EvictionSink>,
    pin_filter: OnceLock<PinFilter>,
}

struct Entry {
    data: Bytes,
    tick: u64,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<BlockKey, Entry>,
    lru: BTreeMap<u64, BlockKey>,
    next_tick: u64,
    used: u64,
    events: Vec<TierEvent>,
}

impl Inner {
    fn bump_tick(&mut self) -> u64 {
        let tick = self.next_tick;
        self.next_tick += 1;
        tick
    }

    /// Marks `key` most recently used and returns its bytes.
    fn touch(&mut self, key: &BlockKey) -> Option<Bytes> {
        let tick = self.next_tick;
        let entry = self.entries.get_mut(key)?;
        self.next_tick += 1;
        if let Some(k) = self.lru.remove(&entry.tick) {
            self.lru.insert(tick, k);
        }
        entry.tick = tick;
        Some(entry.data.clone())
    }

    fn insert(&mut self, key: BlockKey, data: Bytes) {
        let size = data.len() as u64;
        let tick = self.bump_tick();
        self.lru.insert(tick, key.clone());
        self.used += size;
        self.events.push(TierEvent::Added { key: key.clone(), size });
        self.entries.insert(key, Entry { data, tick });
    }

    fn remove(&mut self, key: &BlockKey) -> Option<Entry> {
        let entry = self.entries.remove(key)?;
        self.lru.remove(&entry.tick);
        self.used -= entry.data.len() as u64;
        self.events.push(TierEvent::Removed { key: key.clone() });
        Some(entry)
    }

    /// The least recently used blocks that are not pinned whose bytes make room for `size`
    /// more, oldest first; `Err(pinned bytes)` when evicting every unpinned block would not.
    fn victims(
        &self,
        size: u64,
        capacity: u64,
        pinned: Option<&PinFilter>,
    ) -> std::result::Result<Vec<BlockKey>, u64> {
        let mut victims = Vec::new();
        let mut freed = 0;
        let mut pinned_bytes = 0;
        for key in self.lru.values() {
            if self.used - freed + size <= capacity {
                return Ok(victims);
            }
            let len = self.entries.get(key).map_or(0, |e| e.data.len() as u64);
            if pinned.is_some_and(|is_pinned| is_pinned(key)) {
                pinned_bytes += len;
                continue;
            }
            freed += len;
            victims.push(key.clone());
        }
        if self.used - freed + size <= capacity { Ok(victims) } else { Err(pinned_bytes) }
    }

    fn evict(&mut self, key: &BlockKey) -> Option<(BlockKey, Bytes)> {
        let entry = self.remove(key)?;
        tracing::trace!(block = %key, tier = "memory", size = entry.data.len(), "evicted");
        Some((key.clone(), entry.data))
    }
}

impl MemoryTier {
    pub fn new(capacity_bytes: u64) -> Self {
        Self {
            capacity: capacity_bytes,
            inner: Mutex::new(Inner::default()),
            eviction_sink: OnceLock::new(),
            pin_filter: OnceLock::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // No critical section can panic half-way through an update (they only do map and
        // arithmetic work that is checked by the invariants), so a poisoned lock still guards
        // consistent state and is safe to keep using.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl fmt::Debug for MemoryTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let usage = self.usage();
        f.debug_struct("MemoryTier")
            .field("capacity_bytes", &usage.capacity_bytes)
            .field("used_bytes", &usage.used_bytes)
            .field("blocks", &usage.blocks)
            .finish()
    }
}

#[async_trait]
impl Tier for MemoryTier {
    fn kind(&self) -> TierKind {
        TierKind::Memory
    }

    async fn get(&self, key: &BlockKey) -> Result<Option<Bytes>> {
        Ok(self.lock().touch(key))
    }

    async fn put(&self, key: &BlockKey, data: Bytes) -> Result<()> {
        let size = data.len() as u64;
        if self.capacity == 0 || size > self.capacity {
            return Err(TierError::TooLarge { size, capacity: self.capacity });
        }
        let mut inner = self.lock();
        if let Some(entry) = inner.entries.get_mut(key)
            && entry.data.len() as u64 == size
        {
            entry.data = data;
            inner.touch(key);
            return Ok(());
        }
        // A different size changes what the master was told, so it is a removal plus an
        // insertion; removing first also frees its bytes before anything else is evicted.
        // (A refused put has then dropped the old size too: it was being replaced anyway.)
        inner.remove(key);
        let victims = match inner.victims(size, self.capacity, self.pin_filter.get()) {
            Ok(victims) => victims,
            Err(pinned) => return Err(TierError::Pinned { size, pinned, capacity: self.capacity }),
        };
        for victim in victims {
            let Some((evicted, bytes)) = inner.evict(&victim) else {
                continue;
            };
            if let Some(sink) = self.eviction_sink.get() {
                sink(&evicted, &bytes);
            }
        }
        debug_assert!(inner.used + size <= self.capacity);
        inner.insert(key.clone(), data);
        Ok(())
    }

    async fn remove(&self, key: &BlockKey) -> Result<()> {
        self.lock().remove(key);
        Ok(())
    }

    fn contains(&self, key: &BlockKey) -> bool {
        self.lock().entries.contains_key(key)
    }

    fn set_eviction_sink(&self, sink: EvictionSink) -> bool {
        self.eviction_sink.set(sink).is_ok()
    }

    fn set_pin_filter(&self, filter: PinFilter) -> bool {
        self.pin_filter.set(filter).is_ok()
    }

    fn peek(&self, key: &BlockKey) -> Option<Bytes> {
        self.lock().entries.get(key).map(|e| e.data.clone())
    }

    fn usage(&self) -> TierUsage {
        let inner = self.lock();
        TierUsage {
            capacity_bytes: self.capacity,
            used_bytes: inner.used,
            blocks: inner.entries.len() as u64,
        }
    }

    fn keys(&self) -> Vec<(BlockKey, u64)> {
        self.lock().entries.iter().map(|(k, e)| (k.clone(), e.data.len() as u64)).collect()
    }

    fn drain_events(&self) -> Vec<TierEvent> {
        std::mem::take(&mut self.lock().events)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    fn key(i: u64) -> BlockKey {
        BlockKey::new(format!("s3://bucket/obj{i}"), "v1", i)
    }

    fn block(len: usize, fill: u8) -> Bytes {
        Bytes::from(vec![fill; len])
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
    }

    fn key_set(tier: &MemoryTier) -> BTreeMap<BlockKey, u64> {
        tier.keys().into_iter().collect()
    }

    fn replay(state: &mut BTreeMap<BlockKey, u64>, events: Vec<TierEvent>) {
        for ev in events {
            match ev {
                TierEvent::Added { key, size } => {
                    assert!(state.insert(key, size).is_none(), "Added for a key already present");
                }
                TierEvent::Removed { key } => {
                    assert!(state.remove(&key).is_some(), "Removed for an absent key");
                }
            }
        }
    }

    #[tokio::test]
    async fn the_eviction_sink_sees_evictions_with_their_bytes_but_not_removals() {
        let tier = MemoryTier::new(20);
        let seen = std::sync::Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        assert!(
            tier.set_eviction_sink(Box::new(move |k, b| sink.lock().unwrap().push((k.clone(), b.clone()))))
        );
        assert!(!tier.set_eviction_sink(Box::new(|_, _| {})), "one sink only");
        tier.put(&key(0), block(10, 0)).await.unwrap();
        tier.put(&key(1), block(10, 1)).await.unwrap();
        tier.remove(&key(1)).await.unwrap();
        assert!(seen.lock().unwrap().is_empty(), "a removal is not an eviction");
        tier.put(&key(2), block(10, 2)).await.unwrap();
        tier.put(&key(3), block(10, 3)).await.unwrap();
        assert_eq!(*seen.lock().unwrap(), vec![(key(0), block(10, 0))]);
        assert_eq!(tier.peek(&key(2)), Some(block(10, 2)));
        // Peeking is not a use: key 2 is still the oldest.
        tier.put(&key(4), block(10, 4)).await.unwrap();
        assert_eq!(seen.lock().unwrap().last().unwrap().0, key(2));
    }

    #[tokio::test]
    async fn pinned_blocks_are_passed_over_and_a_put_only_pins_could_serve_is_refused() {
        let tier = MemoryTier::new(30);
        let pinned = std::sync::Arc::new(Mutex::new(std::collections::HashSet::new()));
        let set = pinned.clone();
        assert!(tier.set_pin_filter(std::sync::Arc::new(move |k| set.lock().unwrap().contains(k))));
        for i in 0..3 {
            tier.put(&key(i), block(10, i as u8)).await.unwrap();
        }
        pinned.lock().unwrap().insert(key(0));
        // Key 0 is the oldest but pinned: key 1 goes.
        tier.put(&key(3), block(10, 3)).await.unwrap();
        assert_eq!(key_set(&tier).into_keys().collect::<Vec<_>>(), vec![key(0), key(2), key(3)]);
        pinned.lock().unwrap().extend([key(2), key(3)]);
        tier.drain_events();
        match tier.put(&key(4), block(10, 4)).await {
            Err(TierError::Pinned { size: 10, pinned: 30, capacity: 30 }) => {}
            other => panic!("expected Pinned, got {other:?}"),
        }
        assert!(tier.drain_events().is_empty(), "nothing evicted for a refused put");
        // 20 bytes: one unpinned block is not enough, so nothing is evicted either.
        pinned.lock().unwrap().remove(&key(2));
        assert!(matches!(tier.put(&key(4), block(20, 4)).await, Err(TierError::Pinned { pinned: 20, .. })));
        assert!(tier.contains(&key(2)));
        tier.put(&key(4), block(10, 4)).await.unwrap();
        assert_eq!(key_set(&tier).into_keys().collect::<Vec<_>>(), vec![key(0), key(3), key(4)]);
    }

    #[tokio::test]
    async fn evicts_least_recently_used_first() {
        let tier = MemoryTier::new(30);
        for i in 0..3 {
            tier.put(&key(i), block(10, i as u8)).await.unwrap();
        }
        // Refresh key 0 so key 1 becomes the oldest.
        assert_eq!(tier.get(&key(0)).await.unwrap(), Some(block(10, 0)));
        tier.put(&key(3), block(10, 3)).await.unwrap();
        assert!(!tier.contains(&key(1)));
        assert!(tier.contains(&key(0)) && tier.contains(&key(2)) && tier.contains(&key(3)));

        // A 20-byte block needs two evictions: key 2 then key 0 (key 3 is the newest).
        tier.put(&key(4), block(20, 4)).await.unwrap();
        assert_eq!(key_set(&tier).into_keys().collect::<Vec<_>>(), vec![key(3), key(4)]);
        assert_eq!(tier.usage(), TierUsage { capacity_bytes: 30, used_bytes: 30, blocks: 2 });
        assert_eq!(tier.get(&key(2)).await.unwrap(), None);
    }

    #[tokio::test]
    async fn zero_capacity_disables_the_tier() {
        let tier = MemoryTier::new(0);
        for len in [0, 1] {
            match tier.put(&key(1), block(len, 1)).await {
                Err(TierError::TooLarge { size, capacity: 0 }) => assert_eq!(size, len as u64),
                other => panic!("expected TooLarge, got {other:?}"),
            }
        }
        assert_eq!(tier.get(&key(1)).await.unwrap(), None);
        assert!(!tier.contains(&key(1)));
        assert_eq!(tier.usage(), TierUsage::default());
        assert!(tier.drain_events().is_empty());
    }

    #[tokio::test]
    async fn too_large_is_refused_without_evicting() {
        let tier = MemoryTier::new(100);
        tier.put(&key(1), block(60, 1)).await.unwrap();
        tier.drain_events();
        match tier.put(&key(2), block(101, 2)).await {
            Err(TierError::TooLarge { size: 101, capacity: 100 }) => {}
            other => panic!("expected TooLarge, got {other:?}"),
        }
        assert!(tier.contains(&key(1)));
        assert!(tier.drain_events().is_empty());
        // Exactly the capacity fits (evicting the rest).
        tier.put(&key(3), block(100, 3)).await.unwrap();
        assert_eq!(tier.usage().used_bytes, 100);
        assert!(!tier.contains(&key(1)));
    }

    #[tokio::test]
    async fn events_replay_to_the_key_set() {
        let tier = MemoryTier::new(25);
        let mut replayed = BTreeMap::new();
        tier.put(&key(1), block(10, 1)).await.unwrap();
        tier.put(&key(2), block(10, 2)).await.unwrap();
        replay(&mut replayed, tier.drain_events());
        assert_eq!(replayed, key_set(&tier));

        tier.put(&key(3), block(10, 3)).await.unwrap(); // evicts 1
        tier.put(&key(2), block(10, 9)).await.unwrap(); // same size: no events
        tier.put(&key(3), block(5, 3)).await.unwrap(); // new size: Removed + Added
        tier.remove(&key(2)).await.unwrap();
        tier.remove(&key(2)).await.unwrap(); // absent: no event
        let events = tier.drain_events();
        assert_eq!(
            events,
            vec![
                TierEvent::Removed { key: key(1) },
                TierEvent::Added { key: key(3), size: 10 },
                TierEvent::Removed { key: key(3) },
                TierEvent::Added { key: key(3), size: 5 },
                TierEvent::Removed { key: key(2) },
            ]
        );
        replay(&mut replayed, events);
        assert_eq!(replayed, key_set(&tier));
        assert!(tier.drain_events().is_empty());
    }

    #[tokio::test]
    async fn reput_same_size_replaces_bytes_and_refreshes() {
        let tier = MemoryTier::new(20);
        tier.put(&key(1), block(10, 1)).await.unwrap();
        tier.put(&key(2), block(10, 2)).await.unwrap();
        tier.put(&key(1), block(10, 7)).await.unwrap();
        assert_eq!(tier.get(&key(1)).await.unwrap(), Some(block(10, 7)));
        // Key 1 was refreshed by the re-put, so key 2 goes.
        tier.put(&key(3), block(10, 3)).await.unwrap();
        assert!(tier.contains(&key(1)) && !tier.contains(&key(2)));
    }

    #[tokio::test]
    async fn hits_share_the_stored_buffer() {
        let tier = MemoryTier::new(1 << 20);
        let data = Bytes::from(vec![5u8; 4096]);
        tier.put(&key(1), data.clone()).await.unwrap();
        let got = tier.get(&key(1)).await.unwrap().unwrap();
        assert_eq!(got.as_ptr(), data.as_ptr());
        assert_eq!(got.len(), data.len());
    }

    /// Reference LRU: a vector ordered from least to most recently used.
    struct Model {
        capacity: u64,
        order: Vec<(BlockKey, Bytes)>,
    }

    impl Model {
        fn used(&self) -> u64 {
            self.order.iter().map(|(_, d)| d.len() as u64).sum()
        }

        fn position(&self, key: &BlockKey) -> Option<usize> {
            self.order.iter().position(|(k, _)| k == key)
        }

        fn get(&mut self, key: &BlockKey) -> Option<Bytes> {
            let entry = self.order.remove(self.position(key)?);
            let data = entry.1.clone();
            self.order.push(entry);
            Some(data)
        }

        fn put(&mut self, key: &BlockKey, data: Bytes) -> bool {
            let size = data.len() as u64;
            if self.capacity == 0 || size > self.capacity {
                return false;
            }
            if let Some(pos) = self.position(key) {
                self.order.remove(pos);
            }
            while self.used() + size > self.capacity {
                self.order.remove(0);
            }
            self.order.push((key.clone(), data));
            true
        }

        fn remove(&mut self, key: &BlockKey) {
            if let Some(pos) = self.position(key) {
                self.order.remove(pos);
            }
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Put(u64, usize),
        Get(u64),
        Remove(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u64..8, 0usize..48).prop_map(|(k, len)| Op::Put(k, len)),
            3 => (0u64..8).prop_map(Op::Get),
            1 => (0u64..8).prop_map(Op::Remove),
        ]
    }

    proptest! {
        #[test]
        fn behaves_like_a_reference_lru(
            capacity in prop_oneof![Just(0u64), 1u64..120],
            ops in proptest::collection::vec(op(), 1..80),
        ) {
            let rt = rt();
            let tier = MemoryTier::new(capacity);
            let mut model = Model { capacity, order: Vec::new() };
            let mut replayed = BTreeMap::new();
            for (seq, op) in ops.into_iter().enumerate() {
                match op {
                    Op::Put(k, len) => {
                        // The fill byte changes with every put so a stale block is caught.
                        let data = block(len, seq as u8);
                        let accepted = model.put(&key(k), data.clone());
                        let res = rt.block_on(tier.put(&key(k), data));
                        if accepted {
                            prop_assert!(res.is_ok(), "put refused: {:?}", res);
                        } else {
                            let refused_too_large = matches!(res, Err(TierError::TooLarge { .. }));
                            prop_assert!(refused_too_large, "expected TooLarge, got {:?}", res);
                        }
                    }
                    Op::Get(k) => {
                        let got = rt.block_on(tier.get(&key(k))).unwrap();
                        prop_assert_eq!(got, model.get(&key(k)));
                    }
                    Op::Remove(k) => {
                        model.remove(&key(k));
                        rt.block_on(tier.remove(&key(k))).unwrap();
                    }
                }
                let expected: BTreeMap<BlockKey, u64> =
                    model.order.iter().map(|(k, d)| (k.clone(), d.len() as u64)).collect();
                prop_assert_eq!(&key_set(&tier), &expected);
                prop_assert_eq!(tier.usage(), TierUsage {
                    capacity_bytes: capacity,
                    used_bytes: model.used(),
                    blocks: model.order.len() as u64,
                });
                prop_assert!(model.used() <= capacity);
                replay(&mut replayed, tier.drain_events());
                prop_assert_eq!(&replayed, &expected);
                for (k, _) in &model.order {
                    prop_assert!(tier.contains(k));
                }
            }
        }
    }
}
