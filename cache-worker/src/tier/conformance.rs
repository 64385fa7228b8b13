//! One behaviour suite every tier passes: what the [`Tier`] trait promises, checked through the
//! trait alone, against DRAM ([`MemoryTier`]) and NVMe ([`NvmeTier`] in a temporary directory,
//! its blocks in files of their own, and again packed in containers). Each tier's own tests
//! check its internals — its files, its eviction order step by step against the reference
//! S3-FIFO; this suite checks what a caller may count on from any of them, so a third tier (or
//! a wrapper) is one more line in [`suite!`]:
//! - a get or a range read returns exactly bytes stored under the key, or nothing; a block whose
//!   put returned `Ok` is there until it is removed or evicted, and only a put or an evict evicts;
//! - usage is the sum of the blocks held, never above the capacity; a capacity of 0 refuses
//!   every put and a block larger than the capacity is refused without evicting anything;
//! - eviction passes over pinned blocks, and a put only pinned blocks could make room for is
//!   refused with [`TierError::Pinned`], evicting nothing; `evict` takes only what it is told to;
//! - the event log replays to the key set;
//! - a scan larger than the tier does not flush a block read again (S3-FIFO, the tier docs).
//!
//! The property test at the end drives random operations against a tier and a `BTreeMap` model
//! that knows only what the contract says — which bytes each key may hold, which keys are pinned
//! — not the eviction order, so it would hold for any order the tiers chose.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use proptest::prelude::*;
use strata_common::BlockKey;

use super::nvme::NvmeOptions;
use super::{BlockPut, MemoryTier, NvmeTier, PutParams, Tier, TierError, TierEvent, TierKind, TierUsage};

/// The tiers the suite runs against.
#[derive(Debug, Clone, Copy)]
enum Flavor {
    Memory,
    /// NVMe, every block in a file of its own.
    Nvme,
    /// NVMe, every block put as a small file's ([`PutParams::packed`]), in containers small
    /// enough that sealing, dead entries and compaction all happen within a few operations.
    NvmePacked,
}

/// A tier under test, with how the suite's puts keep blocks and what must outlive the tier.
struct Subject {
    tier: Arc<dyn Tier>,
    params: PutParams,
    _dir: Option<tempfile::TempDir>,
}

impl Flavor {
    fn open(self, capacity: u64) -> Subject {
        let nvme = |options: NvmeOptions| {
            let dir = tempfile::tempdir().unwrap();
            let tier = NvmeTier::open_with(dir.path(), capacity, options).unwrap();
            (Arc::new(tier) as Arc<dyn Tier>, Some(dir))
        };
        let (tier, dir, packed) = match self {
            Flavor::Memory => (Arc::new(MemoryTier::new(capacity)) as Arc<dyn Tier>, None, false),
            Flavor::Nvme => {
                let (tier, dir) = nvme(NvmeOptions::default());
                (tier, dir, false)
            }
            Flavor::NvmePacked => {
                let (tier, dir) = nvme(NvmeOptions { container_bytes: 300 });
                (tier, dir, true)
            }
        };
        Subject { tier, params: PutParams { packed }, _dir: dir }
    }

    fn kind(self) -> TierKind {
        match self {
            Flavor::Memory => TierKind::Memory,
            Flavor::Nvme | Flavor::NvmePacked => TierKind::Nvme,
        }
    }
}

impl Subject {
    async fn put(&self, key: &BlockKey, data: Bytes) -> super::Result<()> {
        self.tier.put_with(key, data, self.params).await
    }

    async fn put_many(&self, blocks: impl IntoIterator<Item = (BlockKey, Bytes)>) -> Vec<super::Result<()>> {
        let blocks =
            blocks.into_iter().map(|(key, data)| BlockPut { key, data, params: self.params }).collect();
        self.tier.put_many(blocks).await
    }

    /// Installs a pin filter over a shared set of key indexes.
    fn pin_set(&self) -> Arc<Mutex<BTreeSet<u64>>> {
        let pins = Arc::new(Mutex::new(BTreeSet::new()));
        let set = Arc::clone(&pins);
        assert!(self.tier.set_pin_filter(Arc::new(move |k| set.lock().unwrap().contains(&k.index))));
        assert!(!self.tier.set_pin_filter(Arc::new(|_| false)), "a second pin filter is refused");
        pins
    }

    fn keys(&self) -> BTreeMap<BlockKey, u64> {
        self.tier.keys().into_iter().collect()
    }

    /// Every block held reads back as `expected` says, and usage is their sum.
    async fn assert_holds(&self, expected: &BTreeMap<u64, Bytes>) {
        let keys = self.keys();
        let want: BTreeMap<BlockKey, u64> = expected.iter().map(|(i, d)| (key(*i), d.len() as u64)).collect();
        assert_eq!(keys, want);
        for (i, data) in expected {
            assert!(self.tier.contains(&key(*i)), "block {i}");
            assert_eq!(self.tier.get(&key(*i)).await.unwrap().as_ref(), Some(data), "block {i}");
        }
        let usage = self.tier.usage();
        assert_eq!((usage.used_bytes, usage.blocks), (keys.values().sum(), keys.len() as u64));
    }
}

fn key(i: u64) -> BlockKey {
    BlockKey::new(format!("s3://bucket/conformance/obj{i}"), "v1", i)
}

/// Bytes of block `i`, `variant` telling two contents of one key apart: every (key, variant)
/// gets its own pseudo-random sequence, so bytes of another key or another put are caught.
fn data(i: u64, variant: u64, len: usize) -> Bytes {
    let mut x = (i << 8 | variant) ^ 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            (x >> 56) as u8
        })
        .collect::<Vec<_>>()
        .into()
}

/// Applies events to a key set, checking each one makes sense where it lands.
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

async fn blocks_round_trip(f: Flavor) {
    let s = f.open(1 << 20);
    assert_eq!(s.tier.kind(), f.kind());
    let blocks: BTreeMap<u64, Bytes> =
        [(0, data(0, 0, 0)), (1, data(1, 0, 1)), (2, data(2, 0, 10_000)), (3, data(3, 0, 200_000))].into();
    for (i, d) in &blocks {
        s.put(&key(*i), d.clone()).await.unwrap();
        assert!(s.tier.contains(&key(*i)), "a block put is there at once");
    }
    s.assert_holds(&blocks).await;
    assert_eq!(
        s.tier.usage(),
        TierUsage { capacity_bytes: 1 << 20, used_bytes: 210_001, blocks: 4 },
        "usage counts the data"
    );
    assert_eq!(s.tier.get(&key(9)).await.unwrap(), None);
    assert_eq!(s.tier.get_range(&key(9), 0..0).await.unwrap(), None);
    assert!(!s.tier.contains(&key(9)));
    assert_eq!(s.tier.hits(&key(9)), 0, "an absent block has no hits");

    // Ranges are exactly their slice, wherever they fall (chunk boundaries of 64 KiB included).
    let d = &blocks[&3];
    for r in [0..0, 0..1, 5..70_000, 65_535..65_537, 131_072..200_000, 199_999..200_000, 200_000..200_000] {
        let got = s.tier.get_range(&key(3), r.start as u64..r.end as u64).await.unwrap();
        assert_eq!(got, Some(d.slice(r.clone())), "{r:?}");
    }
    assert_eq!(s.tier.get_range(&key(0), 0..0).await.unwrap(), Some(Bytes::new()));
    assert_eq!(s.tier.get_range(&key(2), 9_990..10_000).await.unwrap(), Some(blocks[&2].slice(9_990..)));

    // Reads never move a block's bytes: the same again, after the reads above counted hits.
    s.assert_holds(&blocks).await;
    for i in blocks.keys() {
        assert!(s.tier.hits(&key(*i)) <= 3, "S3-FIFO counts at most 3 hits");
    }
}

async fn a_removed_block_is_gone_and_removing_an_absent_one_is_fine(f: Flavor) {
    let s = f.open(1 << 20);
    for i in 0..3 {
        s.put(&key(i), data(i, 0, 100)).await.unwrap();
    }
    s.tier.drain_events();
    s.tier.remove(&key(1)).await.unwrap();
    s.tier.remove(&key(1)).await.unwrap();
    s.tier.remove(&key(7)).await.unwrap();
    assert_eq!(s.tier.drain_events(), vec![TierEvent::Removed { key: key(1) }]);
    assert_eq!(s.tier.get(&key(1)).await.unwrap(), None);
    assert_eq!(s.tier.get_range(&key(1), 0..10).await.unwrap(), None);
    s.assert_holds(&[(0, data(0, 0, 100)), (2, data(2, 0, 100))].into()).await;
    // Put again after a removal: it is a new block.
    s.put(&key(1), data(1, 1, 50)).await.unwrap();
    assert_eq!(s.tier.drain_events(), vec![TierEvent::Added { key: key(1), size: 50 }]);
    assert_eq!(s.tier.get(&key(1)).await.unwrap(), Some(data(1, 1, 50)));
}

async fn a_capacity_of_zero_refuses_every_put(f: Flavor) {
    let s = f.open(0);
    for len in [0, 1, 100] {
        match s.put(&key(1), data(1, 0, len)).await {
            Err(TierError::TooLarge { size, capacity: 0 }) => assert_eq!(size, len as u64),
            other => panic!("expected TooLarge, got {other:?}"),
        }
    }
    let results = s.put_many([(key(2), data(2, 0, 1)), (key(3), Bytes::new())]).await;
    assert!(results.iter().all(|r| matches!(r, Err(TierError::TooLarge { capacity: 0, .. }))), "{results:?}");
    assert_eq!(s.tier.get(&key(1)).await.unwrap(), None);
    assert!(!s.tier.contains(&key(1)));
    assert!(s.tier.keys().is_empty());
    assert_eq!(s.tier.usage(), TierUsage::default());
    assert!(s.tier.drain_events().is_empty());
}

async fn a_block_larger_than_the_tier_is_refused_without_evicting(f: Flavor) {
    let s = f.open(100);
    s.put(&key(1), data(1, 0, 60)).await.unwrap();
    s.tier.drain_events();
    match s.put(&key(2), data(2, 0, 101)).await {
        Err(TierError::TooLarge { size: 101, capacity: 100 }) => {}
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert!(s.tier.drain_events().is_empty(), "nothing evicted for a refused put");
    s.assert_holds(&[(1, data(1, 0, 60))].into()).await;
    // Exactly the capacity fits, evicting the rest.
    s.put(&key(3), data(3, 0, 100)).await.unwrap();
    s.assert_holds(&[(3, data(3, 0, 100))].into()).await;
    assert_eq!(s.tier.usage().used_bytes, 100);
}

async fn the_capacity_is_never_exceeded(f: Flavor) {
    let capacity = 1000;
    let s = f.open(capacity);
    let mut replayed = BTreeMap::new();
    for i in 0..60u64 {
        let len = (i as usize * 173) % 400;
        s.put(&key(i), data(i, 0, len)).await.unwrap();
        assert!(s.tier.contains(&key(i)), "the block just put is there");
        let keys = s.keys();
        let usage = s.tier.usage();
        assert!(usage.used_bytes <= capacity, "{usage:?}");
        assert_eq!(usage.capacity_bytes, capacity);
        assert_eq!((usage.used_bytes, usage.blocks), (keys.values().sum(), keys.len() as u64));
        replay(&mut replayed, s.tier.drain_events());
        assert_eq!(replayed, keys);
    }
    for (k, size) in s.keys() {
        let got = s.tier.get(&k).await.unwrap();
        assert_eq!(got, Some(data(k.index, 0, size as usize)), "block {}", k.index);
    }
}

async fn a_scan_larger_than_the_tier_does_not_flush_a_block_read_again(f: Flavor) {
    let s = f.open(1000);
    s.put(&key(0), data(0, 0, 100)).await.unwrap();
    s.tier.get(&key(0)).await.unwrap().unwrap();
    // Three times the capacity, each block read once (by its put) and never again.
    for i in 1..=30 {
        s.put(&key(i), data(i, 0, 100)).await.unwrap();
        assert!(s.tier.contains(&key(0)), "the block read again went at scan block {i}");
    }
    assert_eq!(s.tier.get(&key(0)).await.unwrap(), Some(data(0, 0, 100)));
}

async fn among_blocks_never_read_the_oldest_goes_first(f: Flavor) {
    let s = f.open(300);
    for i in 0..3 {
        s.put(&key(i), data(i, 0, 100)).await.unwrap();
    }
    s.tier.drain_events();
    s.put(&key(3), data(3, 0, 100)).await.unwrap();
    assert_eq!(
        s.tier.drain_events(),
        vec![TierEvent::Removed { key: key(0) }, TierEvent::Added { key: key(3), size: 100 }]
    );
    // Read again, 1 outlives 2 (never read since its put).
    s.tier.get(&key(1)).await.unwrap().unwrap();
    s.put(&key(4), data(4, 0, 100)).await.unwrap();
    assert!(s.tier.contains(&key(1)) && !s.tier.contains(&key(2)));
}

async fn pinned_blocks_are_passed_over_and_a_put_only_pins_could_serve_is_refused(f: Flavor) {
    let s = f.open(300);
    let pins = s.pin_set();
    for i in 0..3 {
        s.put(&key(i), data(i, 0, 100)).await.unwrap();
    }
    pins.lock().unwrap().insert(0);
    // 0 is the oldest, but pinned: 1 goes.
    s.put(&key(3), data(3, 0, 100)).await.unwrap();
    s.assert_holds(&[(0, data(0, 0, 100)), (2, data(2, 0, 100)), (3, data(3, 0, 100))].into()).await;

    pins.lock().unwrap().extend([2, 3]);
    s.tier.drain_events();
    match s.put(&key(4), data(4, 0, 100)).await {
        Err(TierError::Pinned { size: 100, pinned: 300, capacity: 300 }) => {}
        other => panic!("expected Pinned, got {other:?}"),
    }
    assert!(s.tier.drain_events().is_empty(), "nothing evicted for a refused put");
    // 200 bytes: the one unpinned block is not enough, so nothing is evicted either.
    pins.lock().unwrap().remove(&3);
    match s.put(&key(4), data(4, 0, 200)).await {
        Err(TierError::Pinned { size: 200, pinned: 200, capacity: 300 }) => {}
        other => panic!("expected Pinned, got {other:?}"),
    }
    assert!(s.tier.drain_events().is_empty(), "nothing evicted for a refused put");
    // Unpinned, 3 is evictable again at the next put.
    s.put(&key(4), data(4, 0, 100)).await.unwrap();
    s.assert_holds(&[(0, data(0, 0, 100)), (2, data(2, 0, 100)), (4, data(4, 0, 100))].into()).await;

    // `evict` passes over pinned blocks too, and `remove` ignores pins.
    let evicted = s.tier.evict(u64::MAX, &|_| true).await.unwrap();
    assert_eq!((evicted.blocks, evicted.bytes), (1, 100));
    s.assert_holds(&[(0, data(0, 0, 100)), (2, data(2, 0, 100))].into()).await;
    s.tier.remove(&key(2)).await.unwrap();
    assert!(!s.tier.contains(&key(2)));
}

async fn a_batch_refused_for_pins_only_where_a_put_would_be(f: Flavor) {
    // `put_many` gives each block what `put_with` would: here the second block of the batch
    // makes room by evicting the first, as a second put would, since only the third block is
    // pinned.
    let s = f.open(100);
    let pins = s.pin_set();
    s.put(&key(0), data(0, 0, 60)).await.unwrap();
    pins.lock().unwrap().insert(0);
    let results = s.put_many([(key(1), data(1, 0, 30)), (key(2), data(2, 0, 30))]).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    assert!(s.tier.contains(&key(0)) && s.tier.contains(&key(2)));
    assert!(s.tier.usage().used_bytes <= 100);
    // A block that only pins could make room for is refused in a batch as alone.
    let results = s.put_many([(key(3), data(3, 0, 50))]).await;
    assert!(
        matches!(results[..], [Err(TierError::Pinned { size: 50, pinned: 60, capacity: 100 })]),
        "{results:?}"
    );
}

async fn a_batch_gives_each_block_what_a_put_would(f: Flavor) {
    let s = f.open(10_000);
    let batch = vec![
        (key(0), data(0, 0, 500)),
        (key(1), data(1, 0, 20_000)), // larger than the tier
        (key(2), Bytes::new()),
        (key(0), data(0, 0, 500)), // the same block again
        (key(3), data(3, 0, 4_000)),
    ];
    let results = s.put_many(batch).await;
    assert_eq!(results.len(), 5);
    assert!(matches!(results[1], Err(TierError::TooLarge { size: 20_000, capacity: 10_000 })), "{results:?}");
    for i in [0, 2, 3, 4] {
        assert!(results[i].is_ok(), "block {i}: {:?}", results[i]);
    }
    s.assert_holds(&[(0, data(0, 0, 500)), (2, Bytes::new()), (3, data(3, 0, 4_000))].into()).await;
    let mut replayed = BTreeMap::new();
    replay(&mut replayed, s.tier.drain_events());
    assert_eq!(replayed, s.keys());
    // More than the tier holds in one batch: every put succeeds, the capacity holds.
    let results = s.put_many((10..40).map(|i| (key(i), data(i, 0, 1_000)))).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    assert!(s.tier.usage().used_bytes <= 10_000);
    for (k, size) in s.keys() {
        assert_eq!(s.tier.get(&k).await.unwrap().map(|b| b.len() as u64), Some(size));
    }
}

async fn a_reput_of_a_present_block_keeps_it(f: Flavor) {
    let s = f.open(1000);
    s.put(&key(1), data(1, 0, 100)).await.unwrap();
    s.tier.drain_events();
    s.put(&key(1), data(1, 0, 100)).await.unwrap();
    assert!(s.tier.drain_events().is_empty(), "the same block again changes nothing a master sees");
    assert_eq!(s.tier.get(&key(1)).await.unwrap(), Some(data(1, 0, 100)));
    // Other bytes under a key in the tier (keys carry the version, so a caller should never do
    // this): a get returns one of the puts whole, never a mix.
    s.put(&key(1), data(1, 1, 100)).await.unwrap();
    let got = s.tier.get(&key(1)).await.unwrap().unwrap();
    assert!(got == data(1, 0, 100) || got == data(1, 1, 100), "bytes of neither put");
}

async fn evict_takes_only_the_blocks_it_is_told_to(f: Flavor) {
    let s = f.open(10_000);
    for i in 0..10 {
        s.put(&key(i), data(i, 0, 100)).await.unwrap();
    }
    s.tier.drain_events();
    let even = |k: &BlockKey| k.index.is_multiple_of(2);
    let evicted = s.tier.evict(250, &even).await.unwrap();
    assert!(evicted.bytes >= 250 && evicted.blocks == 3, "{evicted:?}");
    let events = s.tier.drain_events();
    assert_eq!(events.len() as u64, evicted.blocks);
    for ev in &events {
        assert!(matches!(ev, TierEvent::Removed { key } if even(key)), "{ev:?}");
    }
    assert!((0..10).filter(|i| i % 2 == 1).all(|i| s.tier.contains(&key(i))));
    assert_eq!(s.tier.usage().used_bytes, 700);
    // Asked for more than there is, it takes every block it may; asked for nothing, none.
    let evicted = s.tier.evict(u64::MAX, &even).await.unwrap();
    assert_eq!((evicted.blocks, evicted.bytes), (2, 200));
    assert_eq!(s.tier.evict(0, &|_| true).await.unwrap().blocks, 0);
    assert_eq!(s.keys().len(), 5);
}

async fn events_replay_to_the_key_set(f: Flavor) {
    let s = f.open(250);
    let mut replayed = BTreeMap::new();
    let check = |replayed: &mut BTreeMap<BlockKey, u64>| {
        replay(replayed, s.tier.drain_events());
        assert_eq!(*replayed, s.keys());
        assert!(s.tier.drain_events().is_empty(), "a drain takes every event");
    };
    s.put(&key(1), data(1, 0, 100)).await.unwrap();
    s.put(&key(2), data(2, 0, 100)).await.unwrap();
    check(&mut replayed);
    s.put(&key(3), data(3, 0, 100)).await.unwrap(); // evicts
    s.put(&key(2), data(2, 0, 100)).await.unwrap(); // present: no event
    s.tier.remove(&key(2)).await.unwrap();
    s.tier.remove(&key(2)).await.unwrap(); // absent: no event
    check(&mut replayed);
    s.tier.evict(1, &|_| true).await.unwrap();
    let _ = s.put_many((4..8).map(|i| (key(i), data(i, 0, 60)))).await;
    check(&mut replayed);
    s.tier.compact().await.unwrap();
    check(&mut replayed);
}

async fn compaction_changes_nothing_a_caller_sees(f: Flavor) {
    let s = f.open(1 << 20);
    for i in 0..40 {
        s.put(&key(i), data(i, 0, 50 + i as usize)).await.unwrap();
    }
    for i in (0..40).filter(|i| i % 4 != 0) {
        s.tier.remove(&key(i)).await.unwrap();
    }
    s.tier.drain_events();
    let kept: BTreeMap<u64, Bytes> =
        (0..40).filter(|i| i % 4 == 0).map(|i| (i, data(i, 0, 50 + i as usize))).collect();
    for _ in 0..3 {
        s.tier.compact().await.unwrap();
        assert!(s.tier.drain_events().is_empty(), "compaction is not a change of the key set");
        s.assert_holds(&kept).await;
    }
}

async fn what_is_served_without_a_read_is_the_stored_bytes(f: Flavor) {
    use std::os::unix::fs::FileExt;
    let s = f.open(1 << 20);
    for i in 0..4 {
        s.put(&key(i), data(i, 0, 3000 * i as usize)).await.unwrap();
    }
    for i in 0..4 {
        let k = key(i);
        let want = data(i, 0, 3000 * i as usize);
        // `peek` (DRAM) is the stored bytes or nothing, and not a hit.
        let hits = s.tier.hits(&k);
        if let Some(got) = s.tier.peek(&k) {
            assert_eq!(got, want, "peek of block {i}");
        }
        assert_eq!(s.tier.hits(&k), hits, "a peek counted as a hit");
        // `open_verified` (NVMe) points at exactly the stored bytes, or sends the caller to `get`.
        s.tier.get(&k).await.unwrap().unwrap();
        if let Some(span) = s.tier.open_verified(&k) {
            assert_eq!(span.len, want.len() as u64);
            let mut buf = vec![0u8; span.len as usize];
            span.file.read_exact_at(&mut buf, span.offset).unwrap();
            assert_eq!(buf, want, "open_verified of block {i}");
        }
    }
    assert!(s.tier.peek(&key(9)).is_none() && s.tier.open_verified(&key(9)).is_none());
}

async fn the_eviction_sink_sees_each_eviction_with_its_bytes(f: Flavor) {
    let s = f.open(300);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&seen);
    if !s.tier.set_eviction_sink(Box::new(move |k, b| sink.lock().unwrap().push((k.clone(), b.clone())))) {
        return; // not every tier tells of evictions
    }
    for i in 0..3 {
        s.put(&key(i), data(i, 0, 100)).await.unwrap();
    }
    s.tier.remove(&key(1)).await.unwrap();
    assert!(seen.lock().unwrap().is_empty(), "a removal is not an eviction");
    s.tier.drain_events();
    for i in 3..6 {
        s.put(&key(i), data(i, 0, 100)).await.unwrap();
    }
    s.tier.evict(100, &|_| true).await.unwrap();
    let evicted: Vec<BlockKey> = s
        .tier
        .drain_events()
        .into_iter()
        .filter_map(|e| match e {
            TierEvent::Removed { key } => Some(key),
            TierEvent::Added { .. } => None,
        })
        .collect();
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    assert_eq!(seen.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>(), evicted);
    for (k, bytes) in seen {
        assert_eq!(bytes, data(k.index, 0, 100), "the sink got other bytes for {k}");
    }
}

/// Runs each behaviour above against every tier, as a test of its own.
macro_rules! suite {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(super::Flavor::Memory).await
                }
            )*
        }
        mod nvme {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(super::Flavor::Nvme).await
                }
            )*
        }
        mod nvme_packed {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(super::Flavor::NvmePacked).await
                }
            )*
        }
    };
}

suite!(
    blocks_round_trip,
    a_removed_block_is_gone_and_removing_an_absent_one_is_fine,
    a_capacity_of_zero_refuses_every_put,
    a_block_larger_than_the_tier_is_refused_without_evicting,
    the_capacity_is_never_exceeded,
    a_scan_larger_than_the_tier_does_not_flush_a_block_read_again,
    among_blocks_never_read_the_oldest_goes_first,
    pinned_blocks_are_passed_over_and_a_put_only_pins_could_serve_is_refused,
    a_batch_refused_for_pins_only_where_a_put_would_be,
    a_batch_gives_each_block_what_a_put_would,
    a_reput_of_a_present_block_keeps_it,
    evict_takes_only_the_blocks_it_is_told_to,
    events_replay_to_the_key_set,
    compaction_changes_nothing_a_caller_sees,
    what_is_served_without_a_read_is_the_stored_bytes,
    the_eviction_sink_sees_each_eviction_with_its_bytes,
);

// ------------------------------------------------------------------ model-based property test

const KEYS: u64 = 8;

#[derive(Debug, Clone)]
enum Op {
    /// A put of block `.0` with content variant `.1`.
    Put(u64, u64),
    /// One `put_many` of these (key, variant); keys pinned when it runs are left out (see
    /// `run`).
    PutMany(Vec<(u64, u64)>),
    Get(u64),
    /// A range of block `.0`, drawn inside it from the two numbers.
    GetRange(u64, u64, u64),
    Remove(u64),
    /// Evicts at least `.0` bytes of the blocks of parity `.1`.
    Evict(u64, u64),
    /// Which keys are pinned from now on (a bit per key).
    Pins(u8),
    Compact,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0..KEYS, 0u64..2).prop_map(|(k, v)| Op::Put(k, v)),
        2 => proptest::collection::vec((0..KEYS, 0u64..2), 1..5).prop_map(Op::PutMany),
        4 => (0..KEYS).prop_map(Op::Get),
        2 => (0..KEYS, any::<u64>(), any::<u64>()).prop_map(|(k, a, b)| Op::GetRange(k, a, b)),
        1 => (0..KEYS).prop_map(Op::Remove),
        1 => (0u64..300, 0u64..2).prop_map(|(b, p)| Op::Evict(b, p)),
        1 => any::<u8>().prop_map(|mask| Op::Pins(mask & (mask >> 3))),
        1 => Just(Op::Compact),
    ]
}

/// What the contract lets the tier hold: per key in the tier, every content it may return (the
/// puts since it was last absent: a re-put of other bytes may keep either). The eviction order
/// is not modelled, so after an operation that may evict the model learns from `keys()` which
/// blocks went, and checks only that those could go.
#[derive(Debug, Default)]
struct Model {
    may_hold: BTreeMap<u64, Vec<Bytes>>,
}

impl Model {
    fn allows(&self, k: u64, got: &Bytes) -> bool {
        self.may_hold.get(&k).is_some_and(|all| all.contains(got))
    }
}

/// Why a put of `size` bytes should fail, or `None` when it should succeed, in a tier whose
/// blocks held and pinned add up to `pinned_bytes`: every other block held is evictable to make
/// room, so only the capacity and the pinned bytes decide (and a block already there is kept).
fn put_verdict(capacity: u64, size: u64, present: bool, pinned_bytes: u64) -> Option<TierError> {
    if capacity == 0 || size > capacity {
        return Some(TierError::TooLarge { size, capacity });
    }
    if present || pinned_bytes + size <= capacity {
        return None;
    }
    Some(TierError::Pinned { size, pinned: pinned_bytes, capacity })
}

fn same_refusal(want: &TierError, got: &TierError) -> bool {
    match (want, got) {
        (TierError::TooLarge { size: a, capacity: b }, TierError::TooLarge { size: c, capacity: d }) => {
            (a, b) == (c, d)
        }
        (
            TierError::Pinned { size: a, pinned: b, capacity: c },
            TierError::Pinned { size: d, pinned: e, capacity: g },
        ) => (a, b, c) == (d, e, g),
        _ => false,
    }
}

fn run(f: Flavor, capacity: u64, sizes: &[u64], ops: Vec<Op>) -> std::result::Result<(), TestCaseError> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let s = f.open(capacity);
    let pins = s.pin_set();
    let mut model = Model::default();
    let mut replayed = BTreeMap::new();
    let size = |k: u64| sizes[k as usize];
    for op in ops {
        let before = s.keys();
        let pinned: BTreeSet<u64> = pins.lock().unwrap().clone();
        let pinned_bytes: u64 =
            before.iter().filter(|(k, _)| pinned.contains(&k.index)).map(|(_, s)| s).sum();
        // Keys an operation must leave in the tier: pinned ones, and for a read every one.
        let mut must_stay: BTreeSet<u64> =
            before.keys().map(|k| k.index).filter(|k| pinned.contains(k)).collect();
        let mut must_hold: BTreeSet<u64> = BTreeSet::new();
        match op {
            Op::Put(k, v) => {
                let d = data(k, v, size(k) as usize);
                let res = rt.block_on(s.put(&key(k), d.clone()));
                match put_verdict(capacity, size(k), before.contains_key(&key(k)), pinned_bytes) {
                    None => {
                        prop_assert!(res.is_ok(), "put {}: {:?}", k, res);
                        model.may_hold.entry(k).or_default().push(d);
                        must_hold.insert(k);
                    }
                    Some(want) => {
                        let refused = res.as_ref().is_err_and(|e| same_refusal(&want, e));
                        prop_assert!(refused, "put {}: expected {:?}, got {:?}", k, want, res);
                        must_stay.extend(before.keys().map(|k| k.index));
                    }
                }
            }
            Op::PutMany(blocks) => {
                // Pinned keys are left out, so the pinned bytes cannot change within the batch
                // and each block's verdict is known up front — but for a block that was in the
                // tier before: an earlier block of the batch may have evicted it or not.
                let blocks: Vec<(u64, u64)> =
                    blocks.into_iter().filter(|(k, _)| !pinned.contains(k)).collect();
                let results = rt.block_on(
                    s.put_many(blocks.iter().map(|&(k, v)| (key(k), data(k, v, size(k) as usize)))),
                );
                prop_assert_eq!(results.len(), blocks.len());
                let mut landed = BTreeSet::new();
                for (&(k, v), res) in blocks.iter().zip(&results) {
                    let was_there = before.contains_key(&key(k)) || landed.contains(&k);
                    let absent_verdict = put_verdict(capacity, size(k), false, pinned_bytes);
                    let ok = match (&absent_verdict, res) {
                        (None, Ok(())) => true,
                        (None, Err(e)) => {
                            return Err(TestCaseError::fail(format!("batch put {k}: {e:?}")));
                        }
                        (Some(TierError::Pinned { .. }), Ok(())) if was_there => true,
                        (Some(want), Err(e)) if same_refusal(want, e) => false,
                        (Some(want), res) => {
                            return Err(TestCaseError::fail(format!(
                                "batch put {k}: expected {want:?}, got {res:?}"
                            )));
                        }
                    };
                    if ok {
                        model.may_hold.entry(k).or_default().push(data(k, v, size(k) as usize));
                        landed.insert(k);
                    }
                }
                // Which blocks of the batch are still there is up to the tier: the contract
                // gives each block the result a put would, not an order among them, so one may
                // evict another.
            }
            Op::Get(k) => {
                let got = rt.block_on(s.tier.get(&key(k))).unwrap();
                if before.contains_key(&key(k)) {
                    let got = got.unwrap_or_default();
                    prop_assert!(model.allows(k, &got), "get {} returned bytes never put under it", k);
                } else {
                    prop_assert_eq!(got, None, "get {} of an absent block", k);
                }
                must_stay.extend(before.keys().map(|k| k.index));
            }
            Op::GetRange(k, a, b) => {
                let len = size(k);
                let start = a % (len + 1);
                let end = start + b % (len - start + 1);
                let got = rt.block_on(s.tier.get_range(&key(k), start..end)).unwrap();
                if before.contains_key(&key(k)) {
                    let got = got.unwrap_or_default();
                    let allowed =
                        model.may_hold[&k].iter().any(|d| d.slice(start as usize..end as usize) == got);
                    prop_assert!(allowed, "range {}..{} of {} is not bytes put under it", start, end, k);
                } else {
                    prop_assert_eq!(got, None, "range of an absent block {}", k);
                }
                must_stay.extend(before.keys().map(|k| k.index));
            }
            Op::Remove(k) => {
                rt.block_on(s.tier.remove(&key(k))).unwrap();
                must_stay = before.keys().map(|k| k.index).filter(|i| *i != k).collect();
                prop_assert!(!s.tier.contains(&key(k)));
            }
            Op::Evict(bytes, parity) => {
                let among = |k: &BlockKey| k.index % 2 == parity;
                let evicted = rt.block_on(s.tier.evict(bytes, &among)).unwrap();
                let after = s.keys();
                let gone: Vec<(&BlockKey, &u64)> =
                    before.iter().filter(|(k, _)| !after.contains_key(k)).collect();
                for (k, _) in &gone {
                    prop_assert!(among(k) && !pinned.contains(&k.index), "evict took {}", k);
                }
                prop_assert_eq!(evicted.blocks, gone.len() as u64);
                prop_assert_eq!(evicted.bytes, gone.iter().map(|(_, s)| **s).sum::<u64>());
                let evictable: u64 = before
                    .iter()
                    .filter(|(k, _)| among(k) && !pinned.contains(&k.index))
                    .map(|(_, s)| s)
                    .sum();
                prop_assert!(evicted.bytes >= bytes.min(evictable), "{:?} of {} asked", evicted, bytes);
                must_stay.extend(before.keys().map(|k| k.index).filter(|i| i % 2 != parity));
            }
            Op::Pins(mask) => {
                *pins.lock().unwrap() = (0..KEYS).filter(|k| mask & (1 << k) != 0).collect();
                must_stay.extend(before.keys().map(|k| k.index));
            }
            Op::Compact => {
                rt.block_on(s.tier.compact()).unwrap();
                must_stay.extend(before.keys().map(|k| k.index));
            }
        }

        let after = s.keys();
        let held: BTreeSet<u64> = after.keys().map(|k| k.index).collect();
        for k in &must_stay {
            prop_assert!(held.contains(k), "block {} went, though nothing could evict it", k);
        }
        for k in &must_hold {
            prop_assert!(held.contains(k), "block {} was put but is not in the tier", k);
        }
        // The model forgets what went; whatever is held was put, at a size it was put with.
        model.may_hold.retain(|k, _| held.contains(k));
        for (k, size) in &after {
            prop_assert!(model.may_hold.contains_key(&k.index), "block {} is held but was never put", k);
            prop_assert!(model.may_hold[&k.index].iter().any(|d| d.len() as u64 == *size));
            prop_assert!(s.tier.contains(k));
        }
        let usage = s.tier.usage();
        prop_assert_eq!(
            usage,
            TierUsage {
                capacity_bytes: capacity,
                used_bytes: after.values().sum(),
                blocks: after.len() as u64
            }
        );
        prop_assert!(usage.used_bytes <= capacity, "{:?}", usage);
        replay(&mut replayed, s.tier.drain_events());
        prop_assert_eq!(&replayed, &after, "the events do not replay to the key set");
    }
    // Every block held reads back whole as one of its puts.
    for k in s.keys().keys() {
        let got = rt.block_on(s.tier.get(k)).unwrap();
        prop_assert!(got.is_some_and(|d| model.allows(k.index, &d)), "block {} reads back wrong", k);
    }
    Ok(())
}

fn sizes() -> impl Strategy<Value = Vec<u64>> {
    proptest::collection::vec(prop_oneof![1 => Just(0u64), 8 => 1u64..120], KEYS as usize)
}

fn capacity() -> impl Strategy<Value = u64> {
    prop_oneof![1 => Just(0u64), 9 => 1u64..400]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn memory_keeps_the_contract_under_random_operations(
        capacity in capacity(), sizes in sizes(), ops in proptest::collection::vec(op(), 1..60),
    ) {
        run(Flavor::Memory, capacity, &sizes, ops)?;
    }

    #[test]
    fn nvme_keeps_the_contract_under_random_operations(
        capacity in capacity(), sizes in sizes(), ops in proptest::collection::vec(op(), 1..60),
    ) {
        run(Flavor::Nvme, capacity, &sizes, ops)?;
    }

    #[test]
    fn packed_nvme_keeps_the_contract_under_random_operations(
        capacity in capacity(), sizes in sizes(), ops in proptest::collection::vec(op(), 1..60),
    ) {
        run(Flavor::NvmePacked, capacity, &sizes, ops)?;
    }
}
