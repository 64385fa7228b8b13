//! DRAM tier: blocks kept as [`Bytes`] in a map, bounded by the sum of their lengths, with
//! S3-FIFO eviction ([`S3Fifo`]).
//!
//! Invariants (all state sits behind one mutex, so every operation sees them hold):
//! - `policy` holds exactly the keys of `entries`, each with its block's length, so
//!   `policy.used()` is the sum of the stored lengths; it never exceeds the capacity because
//!   every insertion first evicts what `policy.victims` names. A hit (`get`, a re-put of the
//!   same size) is a `touch`: O(1), nothing reordered.
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

use std::collections::HashMap;
use std::fmt;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use async_trait::async_trait;
use bytes::Bytes;
use strata_common::BlockKey;

use super::{
    Among, Evicted, EvictionSink, PinFilter, Result, S3Fifo, Tier, TierError, TierEvent, TierKind, TierUsage,
};

/// The DRAM tier. A capacity of 0 disables it: every `put` is refused with `TooLarge` and every
/// `get` misses.
pub struct MemoryTier {
    capacity: u64,
    inner: Mutex<Inner>,
    eviction_sink: OnceLock<EvictionSink>,
    pin_filter: OnceLock<PinFilter>,
}

struct Inner {
    entries: HashMap<BlockKey, Bytes>,
    policy: S3Fifo<BlockKey>,
    events: Vec<TierEvent>,
}

impl Inner {
    /// Counts a hit on `key` and returns its bytes.
    fn touch(&mut self, key: &BlockKey) -> Option<Bytes> {
        let data = self.entries.get(key)?.clone();
        self.policy.touch(key);
        Some(data)
    }

    fn insert(&mut self, key: BlockKey, data: Bytes) {
        let size = data.len() as u64;
        self.policy.insert(key.clone(), size);
        self.events.push(TierEvent::Added { key: key.clone(), size });
        self.entries.insert(key, data);
    }

    fn remove(&mut self, key: &BlockKey) -> Option<Bytes> {
        let data = self.entries.remove(key)?;
        self.policy.remove(key);
        self.events.push(TierEvent::Removed { key: key.clone() });
        Some(data)
    }
}

impl MemoryTier {
    pub fn new(capacity_bytes: u64) -> Self {
        Self {
            capacity: capacity_bytes,
            inner: Mutex::new(Inner {
                entries: HashMap::new(),
                policy: S3Fifo::new(capacity_bytes),
                events: Vec::new(),
            }),
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
        if let Some(stored) = inner.entries.get_mut(key)
            && stored.len() as u64 == size
        {
            *stored = data;
            inner.policy.touch(key);
            return Ok(());
        }
        // A different size changes what the master was told, so it is a removal plus an
        // insertion; removing first also frees its bytes before anything else is evicted.
        // (A refused put has then dropped the old size too: it was being replaced anyway.)
        inner.remove(key);
        let pinned = self.pin_filter.get();
        let victims = match inner.policy.victims(size, |k| pinned.is_some_and(|is_pinned| is_pinned(k))) {
            Ok(victims) => victims,
            Err(pinned) => return Err(TierError::Pinned { size, pinned, capacity: self.capacity }),
        };
        for victim in victims {
            // The policy has let it go already; this drops the bytes and tells the master.
            let Some(bytes) = inner.remove(&victim) else {
                continue;
            };
            tracing::trace!(block = %victim, tier = "memory", size = bytes.len(), "evicted");
            if let Some(sink) = self.eviction_sink.get() {
                sink(&victim, &bytes);
            }
        }
        debug_assert!(inner.policy.used() + size <= self.capacity);
        inner.insert(key.clone(), data);
        Ok(())
    }

    async fn remove(&self, key: &BlockKey) -> Result<()> {
        self.lock().remove(key);
        Ok(())
    }

    async fn evict(&self, bytes: u64, among: Among<'_>) -> Result<Evicted> {
        let pinned = self.pin_filter.get();
        let mut inner = self.lock();
        let victims =
            inner.policy.evict_among(bytes, |k| !among(k) || pinned.is_some_and(|is_pinned| is_pinned(k)));
        let mut evicted = Evicted::default();
        for victim in victims {
            let Some(data) = inner.remove(&victim) else { continue };
            evicted.blocks += 1;
            evicted.bytes += data.len() as u64;
            if let Some(sink) = self.eviction_sink.get() {
                sink(&victim, &data);
            }
        }
        Ok(evicted)
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
        self.lock().entries.get(key).cloned()
    }

    fn hits(&self, key: &BlockKey) -> u8 {
        self.lock().policy.freq(key).unwrap_or(0)
    }

    fn usage(&self) -> TierUsage {
        let inner = self.lock();
        TierUsage {
            capacity_bytes: self.capacity,
            used_bytes: inner.policy.used(),
            blocks: inner.entries.len() as u64,
        }
    }

    fn keys(&self) -> Vec<(BlockKey, u64)> {
        self.lock().entries.iter().map(|(k, data)| (k.clone(), data.len() as u64)).collect()
    }

    fn drain_events(&self) -> Vec<TierEvent> {
        std::mem::take(&mut self.lock().events)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::super::policy::reference::Reference;
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
    async fn a_block_that_was_hit_outlives_newer_ones() {
        let tier = MemoryTier::new(30);
        for i in 0..3 {
            tier.put(&key(i), block(10, i as u8)).await.unwrap();
        }
        // Key 0 is hit, so making room passes it on to the main queue and evicts key 1.
        assert_eq!(tier.get(&key(0)).await.unwrap(), Some(block(10, 0)));
        tier.put(&key(3), block(10, 3)).await.unwrap();
        assert!(!tier.contains(&key(1)));
        assert!(tier.contains(&key(0)) && tier.contains(&key(2)) && tier.contains(&key(3)));

        // A 20-byte block needs two evictions, from the small queue oldest first: key 2, then
        // key 3 — not key 0, although LRU would take it before key 3.
        tier.put(&key(4), block(20, 4)).await.unwrap();
        assert_eq!(key_set(&tier).into_keys().collect::<Vec<_>>(), vec![key(0), key(4)]);
        assert_eq!(tier.usage(), TierUsage { capacity_bytes: 30, used_bytes: 30, blocks: 2 });
        assert_eq!(tier.get(&key(2)).await.unwrap(), None);
        assert_eq!(tier.hits(&key(0)), 1);
        assert_eq!(tier.hits(&key(2)), 0);
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

    /// The tier's expected behaviour: the reference S3-FIFO for the order, a map for the bytes.
    struct Model {
        capacity: u64,
        policy: Reference<BlockKey>,
        data: BTreeMap<BlockKey, Bytes>,
    }

    impl Model {
        fn get(&mut self, key: &BlockKey) -> Option<Bytes> {
            self.policy.touch(key);
            self.data.get(key).cloned()
        }

        /// The evicted blocks, or the error the put gets.
        fn put(
            &mut self,
            key: &BlockKey,
            data: Bytes,
            pinned: impl Fn(&BlockKey) -> bool,
        ) -> std::result::Result<Vec<(BlockKey, Bytes)>, TierError> {
            let size = data.len() as u64;
            if self.capacity == 0 || size > self.capacity {
                return Err(TierError::TooLarge { size, capacity: self.capacity });
            }
            if self.data.get(key).is_some_and(|d| d.len() as u64 == size) {
                self.data.insert(key.clone(), data);
                self.policy.touch(key);
                return Ok(Vec::new());
            }
            self.remove(key);
            let victims = self.policy.victims(size, pinned).map_err(|pinned| TierError::Pinned {
                size,
                pinned,
                capacity: self.capacity,
            })?;
            let evicted = victims.into_iter().map(|k| (k.clone(), self.data.remove(&k).unwrap())).collect();
            self.policy.insert(key.clone(), size);
            self.data.insert(key.clone(), data);
            Ok(evicted)
        }

        fn remove(&mut self, key: &BlockKey) {
            self.policy.remove(key);
            self.data.remove(key);
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Put(u64, usize),
        Get(u64),
        Remove(u64),
        /// Which keys are pinned from now on (a bit per key).
        Pins(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u64..8, 0usize..48).prop_map(|(k, len)| Op::Put(k, len)),
            3 => (0u64..8).prop_map(Op::Get),
            1 => (0u64..8).prop_map(Op::Remove),
            1 => any::<u8>().prop_map(|mask| Op::Pins(mask & (mask >> 2))),
        ]
    }

    proptest! {
        #[test]
        fn behaves_like_the_reference_s3fifo(
            capacity in prop_oneof![Just(0u64), 1u64..120],
            ops in proptest::collection::vec(op(), 1..80),
        ) {
            let rt = rt();
            let tier = MemoryTier::new(capacity);
            let pins = std::sync::Arc::new(Mutex::new(0u8));
            let tier_pins = pins.clone();
            let is_pinned = move |k: &BlockKey, mask: u8| mask & (1 << k.index) != 0;
            tier.set_pin_filter(std::sync::Arc::new(move |k| is_pinned(k, *tier_pins.lock().unwrap())));
            let evicted = std::sync::Arc::new(Mutex::new(Vec::new()));
            let sink = evicted.clone();
            tier.set_eviction_sink(Box::new(move |k, b| sink.lock().unwrap().push((k.clone(), b.clone()))));
            let mut model = Model { capacity, policy: Reference::new(capacity), data: BTreeMap::new() };
            let mut replayed = BTreeMap::new();
            for (seq, op) in ops.into_iter().enumerate() {
                let mask = *pins.lock().unwrap();
                match op {
                    Op::Put(k, len) => {
                        // The fill byte changes with every put so a stale block is caught.
                        let data = block(len, seq as u8);
                        let expected = model.put(&key(k), data.clone(), |k| is_pinned(k, mask));
                        let res = rt.block_on(tier.put(&key(k), data));
                        match (&expected, &res) {
                            (Ok(victims), Ok(())) => {
                                prop_assert_eq!(&std::mem::take(&mut *evicted.lock().unwrap()), victims);
                            }
                            (Err(TierError::TooLarge { .. }), Err(TierError::TooLarge { .. })) => {}
                            (
                                Err(TierError::Pinned { pinned: want, .. }),
                                Err(TierError::Pinned { pinned: got, .. }),
                            ) => prop_assert_eq!(want, got),
                            _ => {
                                return Err(TestCaseError::fail(format!("expected {expected:?}, got {res:?}")));
                            }
                        }
                        prop_assert!(evicted.lock().unwrap().is_empty(), "evicted for a refused put");
                    }
                    Op::Get(k) => {
                        let got = rt.block_on(tier.get(&key(k))).unwrap();
                        prop_assert_eq!(got, model.get(&key(k)));
                    }
                    Op::Remove(k) => {
                        model.remove(&key(k));
                        rt.block_on(tier.remove(&key(k))).unwrap();
                    }
                    Op::Pins(mask) => *pins.lock().unwrap() = mask,
                }
                let expected: BTreeMap<BlockKey, u64> =
                    model.data.iter().map(|(k, d)| (k.clone(), d.len() as u64)).collect();
                prop_assert_eq!(&key_set(&tier), &expected);
                prop_assert_eq!(tier.usage(), TierUsage {
                    capacity_bytes: capacity,
                    used_bytes: model.policy.used(),
                    blocks: model.data.len() as u64,
                });
                prop_assert!(model.policy.used() <= capacity);
                replay(&mut replayed, tier.drain_events());
                prop_assert_eq!(&replayed, &expected);
                for (k, data) in &model.data {
                    prop_assert!(tier.contains(k));
                    prop_assert_eq!(tier.peek(k), Some(data.clone()));
                    prop_assert_eq!(tier.hits(k), model.policy.freq(k).unwrap());
                }
            }
        }
    }
}
