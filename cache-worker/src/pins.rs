//! The pins and frees a worker applies, as the master hands them out in heartbeat answers (see
//! docs/CACHE_CONTROL.md): a pin is a prefix of file identities and a tier, and the tiers'
//! eviction asks [`PinSet::is_pinned`] before taking a block; a free drops every cached block
//! under a prefix now.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use strata_common::BlockKey;
use strata_common::block::identity_under;
use tracing::{debug, info};

use crate::tier::{Tier, TierKind};

/// The pins this worker applies: the master's list as of `epoch`.
#[derive(Debug, Default)]
pub struct PinSet {
    epoch: AtomicU64,
    rules: RwLock<Vec<(String, TierKind)>>,
    /// Paths' cache TTLs (`strata ttl set`), as (UFS prefix, TTL); they come and go with the
    /// pins' epoch.
    cache_ttls: RwLock<Vec<(String, std::time::Duration)>>,
    /// The last free applied (the master's sequence), 0 before the first heartbeat answer.
    frees_applied: AtomicU64,
}

impl PinSet {
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// Makes each tier's eviction pass over the blocks pinned in it.
    pub fn install(self: &Arc<Self>, tiers: &[Arc<dyn Tier>]) {
        for tier in tiers {
            let pins = self.clone();
            let kind = tier.kind();
            if !tier.set_pin_filter(Arc::new(move |key| pins.is_pinned(key, kind))) {
                debug!(tier = kind.label(), "this tier takes no pins");
            }
        }
    }

    pub fn is_pinned(&self, key: &BlockKey, tier: TierKind) -> bool {
        let rules = self.rules.read().unwrap_or_else(|p| p.into_inner());
        rules.iter().any(|(prefix, t)| *t == tier && identity_under(prefix, &key.file))
    }

    /// How many pins apply.
    pub fn len(&self) -> usize {
        self.rules.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Takes the master's whole list as of `epoch`.
    pub fn replace(&self, epoch: u64, rules: Vec<(String, TierKind)>) {
        self.replace_rules(rules);
        self.set_epoch(epoch);
    }

    /// Takes the master's whole list, in force in the tiers' eviction from now on; returns the
    /// rules that are new (their blocks may be in the other tier: see
    /// [`PinSet::apply`]). The epoch is not moved: the caller says when the list is applied.
    pub fn replace_rules(&self, rules: Vec<(String, TierKind)>) -> Vec<(String, TierKind)> {
        let mut current = self.rules.write().unwrap_or_else(|p| p.into_inner());
        let added = rules.iter().filter(|r| !current.contains(r)).cloned().collect();
        *current = rules;
        added
    }

    /// The list of `epoch` is in force here (reported to the master with the next heartbeat).
    pub fn set_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::Release);
        info!(epoch, pins = self.len(), "pins updated");
    }

    /// Takes the master's list as of `epoch` and puts it in force: the tiers' eviction passes
    /// over the pinned blocks at once, and what `cache` holds of a newly pinned path in the
    /// other tier is moved into the pinned one (written to NVMe, or read into DRAM) before the
    /// epoch moves — so when the master hears the epoch, the pin holds whatever comes next.
    pub async fn apply(&self, cache: &crate::cache::BlockCache, epoch: u64, rules: Vec<(String, TierKind)>) {
        for (prefix, tier) in self.replace_rules(rules) {
            let moved = cache.gather_pinned(tier, |k| identity_under(&prefix, &k.file)).await;
            if moved > 0 {
                info!(prefix = %prefix, tier = tier.label(), blocks = moved, "pinned blocks moved into their tier");
            }
        }
        self.set_epoch(epoch);
    }

    /// Takes the master's whole list of paths' cache TTLs (with the pins of the same epoch).
    pub fn replace_cache_ttls(&self, rules: Vec<(String, std::time::Duration)>) {
        *self.cache_ttls.write().unwrap_or_else(|p| p.into_inner()) = rules;
    }

    /// The cache TTL of the most specific path rule holding `key`, with the length of its
    /// prefix (so the caller can weigh it against a mount's own `cache_ttl`).
    pub fn cache_ttl(&self, key: &BlockKey) -> Option<(usize, std::time::Duration)> {
        let rules = self.cache_ttls.read().unwrap_or_else(|p| p.into_inner());
        rules
            .iter()
            .filter(|(prefix, _)| identity_under(prefix, &key.file))
            .max_by_key(|(prefix, _)| prefix.len())
            .map(|(prefix, ttl)| (prefix.len(), *ttl))
    }

    pub fn has_cache_ttls(&self) -> bool {
        !self.cache_ttls.read().unwrap_or_else(|p| p.into_inner()).is_empty()
    }

    pub fn frees_applied(&self) -> u64 {
        self.frees_applied.load(Ordering::Acquire)
    }

    /// Drops every cached block under `prefixes` from `tiers` (pins notwithstanding: the master
    /// refuses a free of a pinned path), then records `through` as applied. Returns the blocks
    /// dropped.
    pub async fn free(&self, tiers: &[Arc<dyn Tier>], prefixes: &[String], through: u64) -> usize {
        let mut dropped = 0;
        if !prefixes.is_empty() {
            for tier in tiers {
                for (key, _) in tier.keys() {
                    if prefixes.iter().any(|p| identity_under(p, &key.file)) {
                        match tier.remove(&key).await {
                            Ok(()) => dropped += 1,
                            Err(e) => {
                                debug!(block = %key, tier = tier.kind().label(), err = %e, "cannot free a block")
                            }
                        }
                    }
                }
            }
            info!(prefixes = prefixes.len(), blocks = dropped, "freed cached blocks");
        }
        self.frees_applied.store(through, Ordering::Release);
        dropped
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::tier::MemoryTier;

    fn key(file: &str, index: u64) -> BlockKey {
        BlockKey::new(file, "v1", index)
    }

    #[tokio::test]
    async fn pins_hold_blocks_in_their_tier_and_frees_drop_what_they_name() {
        let memory: Arc<dyn Tier> = Arc::new(MemoryTier::new(3 * 100));
        let tiers = vec![memory.clone()];
        let pins = PinSet::new();
        pins.install(&tiers);
        pins.replace(7, vec![("s3://b/hot".to_string(), TierKind::Memory)]);
        assert_eq!(pins.epoch(), 7);
        assert!(pins.is_pinned(&key("s3://b/hot/a#bs100", 0), TierKind::Memory));
        assert!(!pins.is_pinned(&key("s3://b/hot/a#bs100", 0), TierKind::Nvme), "another tier");
        assert!(!pins.is_pinned(&key("s3://b/hotter#bs100", 0), TierKind::Memory));

        memory.put(&key("s3://b/hot/a#bs100", 0), Bytes::from(vec![1; 100])).await.unwrap();
        for i in 0..10 {
            memory.put(&key("s3://b/cold#bs100", i), Bytes::from(vec![2; 100])).await.unwrap();
        }
        assert!(memory.contains(&key("s3://b/hot/a#bs100", 0)), "pressure passed over the pinned block");

        pins.replace(8, Vec::new());
        let dropped = pins.free(&tiers, &["s3://b/cold".to_string()], 42).await;
        assert_eq!(dropped, 2, "the two cold blocks the tier held");
        assert_eq!(pins.frees_applied(), 42);
        assert!(memory.contains(&key("s3://b/hot/a#bs100", 0)), "a free drops only what it names");
        assert_eq!(memory.keys().len(), 1);
    }
}
