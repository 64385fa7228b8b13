//! Which worker holds which block on which tier, from the workers' incremental reports.
//!
//! Advisory only: reads never consult it (placement is computed), so it may lag the workers by
//! one heartbeat. It answers `locations` for operators and the warmup planner.
//!
//! Invariant: the two indexes agree — a (worker, block, tier) is in `by_worker` exactly when
//! it is among that block's holders in `by_file`, and neither keeps an empty entry.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::reports::{BlockReport, Tier};

type BlockId = (String, String, u64); // (file_id, version, index)
/// (version, index) → holders as (worker, tier)
type VersionBlocks = BTreeMap<(String, u64), Vec<(String, Tier)>>;

#[derive(Debug, Default)]
pub struct BlockMap {
    /// worker → (block, tier) it holds
    by_worker: HashMap<String, HashSet<(BlockId, Tier)>>,
    /// file_id → (version, index) → holders
    by_file: HashMap<String, VersionBlocks>,
}

fn id_of(r: &BlockReport) -> BlockId {
    (r.file_id.clone(), r.version.clone(), r.index)
}

impl BlockMap {
    pub fn add(&mut self, worker: &str, report: &BlockReport) {
        let id = id_of(report);
        if self.by_worker.entry(worker.to_string()).or_default().insert((id.clone(), report.tier)) {
            self.by_file
                .entry(id.0)
                .or_default()
                .entry((id.1, id.2))
                .or_default()
                .push((worker.to_string(), report.tier));
        }
    }

    pub fn remove(&mut self, worker: &str, report: &BlockReport) {
        let id = id_of(report);
        let removed = self.by_worker.get_mut(worker).is_some_and(|s| s.remove(&(id.clone(), report.tier)));
        if removed {
            self.unindex(worker, &id, report.tier);
        }
    }

    fn unindex(&mut self, worker: &str, id: &BlockId, tier: Tier) {
        if let Some(versions) = self.by_file.get_mut(&id.0) {
            if let Some(holders) = versions.get_mut(&(id.1.clone(), id.2)) {
                holders.retain(|(w, t)| !(w == worker && *t == tier));
                if holders.is_empty() {
                    versions.remove(&(id.1.clone(), id.2));
                }
            }
            if versions.is_empty() {
                self.by_file.remove(&id.0);
            }
        }
    }

    /// Forgets everything a worker held (it was lost, or sends a full report next).
    pub fn drop_worker(&mut self, worker: &str) {
        if let Some(blocks) = self.by_worker.remove(worker) {
            for (id, tier) in blocks {
                self.unindex(worker, &id, tier);
            }
        }
    }

    /// Holders of each cached block of one version of a file, by block index.
    pub fn locations(&self, file_id: &str, version: &str) -> BTreeMap<u64, Vec<(String, Tier)>> {
        let mut out = BTreeMap::new();
        if let Some(versions) = self.by_file.get(file_id) {
            for ((v, index), holders) in versions {
                if v == version {
                    out.insert(*index, holders.clone());
                }
            }
        }
        out
    }

    pub fn worker_blocks(&self, worker: &str) -> u64 {
        self.by_worker.get(worker).map_or(0, |s| s.len() as u64)
    }

    pub fn total_blocks(&self) -> u64 {
        self.by_worker.values().map(|s| s.len() as u64).sum()
    }
}

#[cfg(test)]
mod tests {
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
}
