//! Which worker holds which block on which tier, from the workers' incremental reports.
//!
//! Advisory only: reads never consult it (placement is computed), so it may lag the workers by
//! one heartbeat. It answers `locations` for operators and the warmup planner.
//!
//! **Compact by construction**, because a cache holds tens of millions of blocks: a block is
//! not keyed by its strings. A (file id, version) pair is known by a 64-bit hash of the two (a
//! collision — about 3 in a million for 10 M cached versions — would only merge two versions'
//! entries in this advisory map, never touch data); a worker by a small index; a holder is 21
//! bits (worker index and tier bits) and three of them pack into one `u64` beside the block's
//! `u32` index. A version with one cached block costs one 24-byte map entry; a version with
//! more keeps two sorted vectors (12 bytes per block). Holders past three per block — rare: replicas are 1 to 3 —
//! spill into an overflow table. `bench/src/blockmap_bench.rs` measures the heap per entry with
//! a counting allocator.
//!
//! Dropping a worker scans every block (there is no per-worker index: it would double the
//! memory); a worker is dropped when it is lost or sends a full report, which is rare, and the
//! scan runs at memory speed (about 0.1 s per 10 M blocks here).
//!
//! Invariants: every (block, worker, tier) is held at most once; `total` and the per-worker
//! counts are the number of (block, tier) pairs held; no empty block or version is kept.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use crate::reports::{BlockReport, Tier};

/// Holder slots packed in a block's `u64`: 3 × 21 bits, and the top bit saying that more
/// holders are in the overflow table.
const SLOT_BITS: u32 = 21;
const SLOTS: u32 = 3;
const SLOT_MASK: u64 = (1 << SLOT_BITS) - 1;
const TIER_BITS: u32 = 3;
const OVERFLOW_FLAG: u64 = 1 << 63;
/// Largest worker index a slot holds (0 means an empty slot).
const MAX_WORKERS: u32 = (1 << (SLOT_BITS - TIER_BITS)) - 1;

fn tier_bit(t: Tier) -> u32 {
    match t {
        Tier::Memory => 1,
        Tier::Nvme => 2,
        Tier::Unspecified => 4,
    }
}

const TIERS: [Tier; 3] = [Tier::Memory, Tier::Nvme, Tier::Unspecified];

/// A holder: worker index (1-based) and the tiers it holds the block on, as a slot.
fn slot(worker: u32, tiers: u32) -> u32 {
    (worker << TIER_BITS) | tiers
}

fn slot_worker(s: u32) -> u32 {
    s >> TIER_BITS
}

fn slot_tiers(s: u32) -> u32 {
    s & ((1 << TIER_BITS) - 1)
}

/// Identity hashing for keys that are already uniform hashes.
#[derive(Default)]
struct PreHashed(u64);

impl Hasher for PreHashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = self.0.rotate_left(5) ^ u64::from_le_bytes(word);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 ^= v;
    }

    fn write_u32(&mut self, v: u32) {
        self.0 = self.0.rotate_left(7) ^ u64::from(v);
    }
}

type Fast<K, V> = HashMap<K, V, BuildHasherDefault<PreHashed>>;

/// The blocks of one version that some worker holds.
enum Blocks {
    One { index: u32, holders: u64 },
    Many(Box<Many>),
}

/// Sorted by index; `holders[i]` belongs to `indexes[i]`.
#[derive(Default)]
struct Many {
    indexes: Vec<u32>,
    holders: Vec<u64>,
}

fn version_key(file_id: &str, version: &str) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(file_id.as_bytes());
    h.update(&[0]);
    h.update(version.as_bytes());
    h.digest()
}

#[derive(Default)]
pub struct BlockMap {
    /// Worker id → index (1-based; 0 is an empty slot).
    worker_index: HashMap<String, u32>,
    /// Index - 1 → worker id and the (block, tier) pairs it holds.
    workers: Vec<Option<(String, u64)>>,
    free: Vec<u32>,
    versions: Fast<u64, Blocks>,
    /// Holders past the inline slots of a block, by (version, index).
    overflow: Fast<(u64, u32), Vec<u32>>,
    total: u64,
}

impl std::fmt::Debug for BlockMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockMap")
            .field("versions", &self.versions.len())
            .field("total", &self.total)
            .finish()
    }
}

impl BlockMap {
    fn index_of(&mut self, worker: &str) -> Option<u32> {
        if let Some(&i) = self.worker_index.get(worker) {
            return Some(i);
        }
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                let i = self.workers.len() as u32 + 1;
                if i > MAX_WORKERS {
                    return None;
                }
                self.workers.push(None);
                i
            }
        };
        self.workers[i as usize - 1] = Some((worker.to_string(), 0));
        self.worker_index.insert(worker.to_string(), i);
        Some(i)
    }

    fn count(&mut self, worker: u32, delta: i64) {
        if let Some((_, n)) = &mut self.workers[worker as usize - 1] {
            *n = n.saturating_add_signed(delta);
        }
        self.total = self.total.saturating_add_signed(delta);
    }

    pub fn add(&mut self, worker: &str, report: &BlockReport) {
        let Ok(index) = u32::try_from(report.index) else {
            // A block past 2^32 (a file of 16 TiB at the smallest block size): not tracked.
            return;
        };
        let Some(w) = self.index_of(worker) else { return };
        let key = version_key(&report.file_id, &report.version);
        let bit = tier_bit(report.tier);
        let holders = match self.versions.entry(key) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(Blocks::One { index, holders: 0 });
                match self.versions.get_mut(&key) {
                    Some(Blocks::One { holders, .. }) => holders,
                    _ => unreachable!("just inserted"),
                }
            }
            std::collections::hash_map::Entry::Occupied(o) => {
                let blocks = o.into_mut();
                holders_mut(blocks, index)
            }
        };
        if add_holder(holders, &mut self.overflow, key, index, w, bit) {
            self.count(w, 1);
        }
    }

    pub fn remove(&mut self, worker: &str, report: &BlockReport) {
        let Ok(index) = u32::try_from(report.index) else { return };
        let Some(&w) = self.worker_index.get(worker) else { return };
        let key = version_key(&report.file_id, &report.version);
        let Some(blocks) = self.versions.get_mut(&key) else { return };
        let Some(holders) = find_holders(blocks, index) else { return };
        if remove_holder(holders, &mut self.overflow, key, index, w, tier_bit(report.tier)) {
            let empty = *holders == 0;
            if empty {
                remove_block(blocks, index);
                if is_empty(blocks) {
                    self.versions.remove(&key);
                }
            }
            self.count(w, -1);
        }
    }

    /// Forgets everything a worker held (it was lost, or sends a full report next).
    pub fn drop_worker(&mut self, worker: &str) {
        let Some(w) = self.worker_index.remove(worker) else { return };
        let held = self.workers[w as usize - 1].take().map_or(0, |(_, n)| n);
        self.total -= held;
        self.free.push(w);
        let overflow = &mut self.overflow;
        self.versions.retain(|&key, blocks| match blocks {
            Blocks::One { index, holders } => {
                drop_from(holders, overflow, key, *index, w);
                *holders != 0
            }
            Blocks::Many(many) => {
                let Many { indexes, holders } = &mut **many;
                for (index, h) in indexes.iter().zip(holders.iter_mut()) {
                    drop_from(h, overflow, key, *index, w);
                }
                let mut i = 0;
                indexes.retain(|_| {
                    let keep = holders[i] != 0;
                    i += 1;
                    keep
                });
                holders.retain(|h| *h != 0);
                if indexes.capacity() > 2 * indexes.len() + 4 {
                    indexes.shrink_to_fit();
                    holders.shrink_to_fit();
                }
                !indexes.is_empty()
            }
        });
    }

    /// Holders of each cached block of one version of a file, by block index.
    pub fn locations(&self, file_id: &str, version: &str) -> BTreeMap<u64, Vec<(String, Tier)>> {
        let key = version_key(file_id, version);
        let mut out = BTreeMap::new();
        let mut emit = |index: u32, holders: u64| {
            let mut list = Vec::new();
            for s in slots_of(holders, &self.overflow, key, index) {
                let Some(Some((name, _))) = self.workers.get(slot_worker(s) as usize - 1) else { continue };
                for t in TIERS {
                    if slot_tiers(s) & tier_bit(t) != 0 {
                        list.push((name.clone(), t));
                    }
                }
            }
            list.sort();
            out.insert(u64::from(index), list);
        };
        match self.versions.get(&key) {
            Some(Blocks::One { index, holders }) => emit(*index, *holders),
            Some(Blocks::Many(many)) => {
                for (index, holders) in many.indexes.iter().zip(&many.holders) {
                    emit(*index, *holders);
                }
            }
            None => {}
        }
        out
    }

    pub fn worker_blocks(&self, worker: &str) -> u64 {
        self.worker_index
            .get(worker)
            .and_then(|&w| self.workers[w as usize - 1].as_ref())
            .map_or(0, |(_, n)| *n)
    }

    pub fn total_blocks(&self) -> u64 {
        self.total
    }
}

/// The holders word of block `index` of a version, added if missing.
fn holders_mut(blocks: &mut Blocks, index: u32) -> &mut u64 {
    if let Blocks::One { index: i, holders } = blocks {
        if *i == index {
            // Borrow again through the match below (the borrow checker cannot see it ends here).
        } else {
            let mut many = Many::default();
            let (a, b) = if *i < index { ((*i, *holders), (index, 0)) } else { ((index, 0), (*i, *holders)) };
            many.indexes.extend([a.0, b.0]);
            many.holders.extend([a.1, b.1]);
            *blocks = Blocks::Many(Box::new(many));
        }
    }
    match blocks {
        Blocks::One { holders, .. } => holders,
        Blocks::Many(many) => {
            let pos = match many.indexes.binary_search(&index) {
                Ok(p) => p,
                Err(p) => {
                    many.indexes.insert(p, index);
                    many.holders.insert(p, 0);
                    p
                }
            };
            &mut many.holders[pos]
        }
    }
}

fn find_holders(blocks: &mut Blocks, index: u32) -> Option<&mut u64> {
    match blocks {
        Blocks::One { index: i, holders } => (*i == index).then_some(holders),
        Blocks::Many(many) => many.indexes.binary_search(&index).ok().map(|p| &mut many.holders[p]),
    }
}

fn remove_block(blocks: &mut Blocks, index: u32) {
    if let Blocks::Many(many) = blocks
        && let Ok(p) = many.indexes.binary_search(&index)
    {
        many.indexes.remove(p);
        many.holders.remove(p);
        if many.indexes.len() == 1 {
            *blocks = Blocks::One { index: many.indexes[0], holders: many.holders[0] };
        }
    }
}

fn is_empty(blocks: &Blocks) -> bool {
    match blocks {
        Blocks::One { holders, .. } => *holders == 0,
        Blocks::Many(many) => many.indexes.is_empty(),
    }
}

fn inline_slot(holders: u64, n: u32) -> u32 {
    ((holders >> (n * SLOT_BITS)) & SLOT_MASK) as u32
}

fn set_inline_slot(holders: &mut u64, n: u32, s: u32) {
    *holders &= !(SLOT_MASK << (n * SLOT_BITS));
    *holders |= u64::from(s) << (n * SLOT_BITS);
}

/// Every holder slot of a block: inline, then overflow.
fn slots_of(holders: u64, overflow: &Fast<(u64, u32), Vec<u32>>, key: u64, index: u32) -> Vec<u32> {
    let mut out: Vec<u32> = (0..SLOTS).map(|n| inline_slot(holders, n)).filter(|s| *s != 0).collect();
    if holders & OVERFLOW_FLAG != 0
        && let Some(more) = overflow.get(&(key, index))
    {
        out.extend(more);
    }
    out
}

/// Adds tier `bit` for worker `w`; `true` when it was not held before.
fn add_holder(
    holders: &mut u64,
    overflow: &mut Fast<(u64, u32), Vec<u32>>,
    key: u64,
    index: u32,
    w: u32,
    bit: u32,
) -> bool {
    for n in 0..SLOTS {
        let s = inline_slot(*holders, n);
        if s != 0 && slot_worker(s) == w {
            if slot_tiers(s) & bit != 0 {
                return false;
            }
            set_inline_slot(holders, n, s | bit);
            return true;
        }
    }
    if *holders & OVERFLOW_FLAG != 0
        && let Some(more) = overflow.get_mut(&(key, index))
        && let Some(s) = more.iter_mut().find(|s| slot_worker(**s) == w)
    {
        if slot_tiers(*s) & bit != 0 {
            return false;
        }
        *s |= bit;
        return true;
    }
    for n in 0..SLOTS {
        if inline_slot(*holders, n) == 0 {
            set_inline_slot(holders, n, slot(w, bit));
            return true;
        }
    }
    overflow.entry((key, index)).or_default().push(slot(w, bit));
    *holders |= OVERFLOW_FLAG;
    true
}

/// Removes tier `bit` of worker `w`; `true` when it was held. A freed inline slot takes a
/// holder back from the overflow table.
fn remove_holder(
    holders: &mut u64,
    overflow: &mut Fast<(u64, u32), Vec<u32>>,
    key: u64,
    index: u32,
    w: u32,
    bit: u32,
) -> bool {
    for n in 0..SLOTS {
        let s = inline_slot(*holders, n);
        if s != 0 && slot_worker(s) == w {
            if slot_tiers(s) & bit == 0 {
                return false;
            }
            let left = s & !bit;
            set_inline_slot(holders, n, if slot_tiers(left) == 0 { 0 } else { left });
            refill(holders, overflow, key, index);
            return true;
        }
    }
    if *holders & OVERFLOW_FLAG == 0 {
        return false;
    }
    let Some(more) = overflow.get_mut(&(key, index)) else { return false };
    let Some(p) = more.iter().position(|s| slot_worker(*s) == w) else { return false };
    if slot_tiers(more[p]) & bit == 0 {
        return false;
    }
    more[p] &= !bit;
    if slot_tiers(more[p]) == 0 {
        more.swap_remove(p);
    }
    if more.is_empty() {
        overflow.remove(&(key, index));
        *holders &= !OVERFLOW_FLAG;
    }
    true
}

/// Moves overflow holders into free inline slots.
fn refill(holders: &mut u64, overflow: &mut Fast<(u64, u32), Vec<u32>>, key: u64, index: u32) {
    if *holders & OVERFLOW_FLAG == 0 {
        return;
    }
    let Some(more) = overflow.get_mut(&(key, index)) else {
        *holders &= !OVERFLOW_FLAG;
        return;
    };
    for n in 0..SLOTS {
        if inline_slot(*holders, n) == 0
            && let Some(s) = more.pop()
        {
            set_inline_slot(holders, n, s);
        }
    }
    if more.is_empty() {
        overflow.remove(&(key, index));
        *holders &= !OVERFLOW_FLAG;
    }
}

/// Removes every tier of worker `w` from a block.
fn drop_from(holders: &mut u64, overflow: &mut Fast<(u64, u32), Vec<u32>>, key: u64, index: u32, w: u32) {
    for n in 0..SLOTS {
        let s = inline_slot(*holders, n);
        if s != 0 && slot_worker(s) == w {
            set_inline_slot(holders, n, 0);
        }
    }
    if *holders & OVERFLOW_FLAG != 0
        && let Some(more) = overflow.get_mut(&(key, index))
    {
        more.retain(|s| slot_worker(*s) != w);
        if more.is_empty() {
            overflow.remove(&(key, index));
            *holders &= !OVERFLOW_FLAG;
        }
    }
    refill(holders, overflow, key, index);
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeSet, HashSet};

    use proptest::prelude::*;

    use super::*;

    fn report(file: &str, index: u64, tier: Tier) -> BlockReport {
        BlockReport { file_id: file.into(), version: "v1".into(), index, tier }
    }

    #[test]
    fn tracks_holders_per_block_and_tier() {
        let mut map = BlockMap::default();
        map.add("w1", &report("f", 0, Tier::Memory));
        map.add("w1", &report("f", 0, Tier::Nvme));
        map.add("w2", &report("f", 1, Tier::Nvme));
        map.add("w2", &report("f", 1, Tier::Nvme)); // duplicate report is idempotent
        let loc = map.locations("f", "v1");
        assert_eq!(loc[&0].len(), 2);
        assert_eq!(loc[&1], vec![("w2".to_string(), Tier::Nvme)]);
        assert!(map.locations("f", "v2").is_empty());
        assert_eq!(map.total_blocks(), 3);

        map.remove("w1", &report("f", 0, Tier::Memory));
        assert_eq!(map.locations("f", "v1")[&0], vec![("w1".to_string(), Tier::Nvme)]);
        map.drop_worker("w1");
        assert_eq!(map.locations("f", "v1").keys().copied().collect::<Vec<_>>(), vec![1]);
        assert_eq!(map.worker_blocks("w1"), 0);
        assert_eq!(map.worker_blocks("w2"), 1);
    }

    #[test]
    fn more_holders_than_inline_slots_spill_and_come_back() {
        let mut map = BlockMap::default();
        let workers: Vec<String> = (0..6).map(|i| format!("w{i}")).collect();
        for w in &workers {
            map.add(w, &report("f", 7, Tier::Nvme));
        }
        assert_eq!(map.locations("f", "v1")[&7].len(), 6);
        assert!(!map.overflow.is_empty());
        for w in &workers[..4] {
            map.remove(w, &report("f", 7, Tier::Nvme));
        }
        let left: Vec<String> = map.locations("f", "v1")[&7].iter().map(|(w, _)| w.clone()).collect();
        assert_eq!(left, ["w4", "w5"]);
        assert!(map.overflow.is_empty(), "the spilled holders moved back inline");
        map.drop_worker("w4");
        map.drop_worker("w5");
        assert!(map.versions.is_empty() && map.total_blocks() == 0);
    }

    /// The map as it was before it was made compact: strings and sets, obviously right.
    #[derive(Default)]
    struct Reference {
        held: HashMap<String, HashSet<(String, String, u64, Tier)>>,
    }

    impl Reference {
        fn add(&mut self, w: &str, r: &BlockReport) {
            self.held.entry(w.into()).or_default().insert((
                r.file_id.clone(),
                r.version.clone(),
                r.index,
                r.tier,
            ));
        }
        fn remove(&mut self, w: &str, r: &BlockReport) {
            if let Some(s) = self.held.get_mut(w) {
                s.remove(&(r.file_id.clone(), r.version.clone(), r.index, r.tier));
            }
        }
        fn locations(&self, f: &str, v: &str) -> BTreeMap<u64, Vec<(String, Tier)>> {
            let mut out: BTreeMap<u64, Vec<(String, Tier)>> = BTreeMap::new();
            for (w, set) in &self.held {
                for (ff, vv, i, t) in set {
                    if ff == f && vv == v {
                        out.entry(*i).or_default().push((w.clone(), *t));
                    }
                }
            }
            out.values_mut().for_each(|l| l.sort());
            out
        }
        fn total(&self) -> u64 {
            self.held.values().map(|s| s.len() as u64).sum()
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Add(u8, u8, u8, u8, u8),
        Remove(u8, u8, u8, u8, u8),
        Drop(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        let fields = || (0u8..7, 0u8..3, 0u8..2, 0u8..6, 0u8..3);
        prop_oneof![
            6 => fields().prop_map(|(w, f, v, i, t)| Op::Add(w, f, v, i, t)),
            3 => fields().prop_map(|(w, f, v, i, t)| Op::Remove(w, f, v, i, t)),
            1 => (0u8..7).prop_map(Op::Drop),
        ]
    }

    fn tier(t: u8) -> Tier {
        [Tier::Memory, Tier::Nvme, Tier::Unspecified][t as usize]
    }

    proptest! {
        #[test]
        fn behaves_like_the_reference(ops in proptest::collection::vec(op(), 1..300)) {
            let mut map = BlockMap::default();
            let mut model = Reference::default();
            let rep = |f: u8, v: u8, i: u8, t: u8| BlockReport {
                file_id: format!("file-{f}"), version: format!("v{v}"), index: u64::from(i) * 3, tier: tier(t),
            };
            for op in ops {
                match op {
                    Op::Add(w, f, v, i, t) => {
                        let w = format!("w{w}");
                        map.add(&w, &rep(f, v, i, t));
                        model.add(&w, &rep(f, v, i, t));
                    }
                    Op::Remove(w, f, v, i, t) => {
                        let w = format!("w{w}");
                        map.remove(&w, &rep(f, v, i, t));
                        model.remove(&w, &rep(f, v, i, t));
                    }
                    Op::Drop(w) => {
                        let w = format!("w{w}");
                        map.drop_worker(&w);
                        model.held.remove(&w);
                    }
                }
                prop_assert_eq!(map.total_blocks(), model.total());
            }
            let mut seen = BTreeSet::new();
            for f in 0..3u8 {
                for v in 0..2u8 {
                    let (f, v) = (format!("file-{f}"), format!("v{v}"));
                    prop_assert_eq!(map.locations(&f, &v), model.locations(&f, &v));
                    seen.insert((f, v));
                }
            }
            for w in 0..7u8 {
                let w = format!("w{w}");
                let expected = model.held.get(&w).map_or(0, |s| s.len() as u64);
                prop_assert_eq!(map.worker_blocks(&w), expected);
            }
            let versions_expected = seen.iter().filter(|(f, v)| !model.locations(f, v).is_empty()).count();
            prop_assert_eq!(map.versions.len(), versions_expected, "no empty version is kept");
        }
    }
}
