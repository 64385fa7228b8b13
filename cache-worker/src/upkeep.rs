//! Background upkeep of the tiers, beside the eviction a put does to make room:
//!
//! - **Watermarks.** A tier holding more than its high watermark (a percentage of its
//!   capacity) is evicted down to its low watermark, in its own eviction order (S3-FIFO,
//!   pinned blocks passed over), so puts find room without evicting on the read path.
//! - **`cache_ttl`.** A block of a mount with `cache_ttl` is dropped from a tier once it has been
//!   held there that long (unless it is pinned in that tier). Its age counts from the first
//!   sweep that saw it in the tier, so it is at most one interval late; a block found on NVMe
//!   at start counts from then.
//! - **`quota`.** A mount with `quota` may hold that many bytes in the cluster's tiers; this
//!   worker keeps the mount within its share of the ring's hash space (`Ring::share`) of it,
//!   counting DRAM and NVMe bytes both. Over it, the mount's NVMe blocks go first (the colder
//!   copies), then its DRAM ones, each in the tier's eviction order. Between two sweeps a mount
//!   can exceed its share by what the worker stores in one interval.
//! - **Compaction.** Each tier compacts what its evictions left mostly dead (the NVMe tier's
//!   packed containers of small files), a bounded amount per sweep ([`Tier::compact`]).
//!
//! One [`Upkeep::sweep`] does all four; [`run`] calls it every interval. Time comes from the
//! injected clock, so tests step it.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use strata_common::block::{identity_prefix, identity_under};
use strata_common::{BlockKey, SharedClock};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::config::{Watermark, Watermarks};
use crate::metrics_defs as m;
use crate::pins::PinSet;
use crate::tier::{Compacted, Evicted, Tier, TierKind};

/// What upkeep needs of a mount.
#[derive(Debug, Clone, PartialEq)]
pub struct MountRule {
    /// The mount point, for reports.
    pub path: String,
    /// The file identities of its blocks start with this (`identity_prefix(uri, "")`).
    pub prefix: String,
    pub cache_ttl: Option<Duration>,
    /// This worker's share of the mount's quota, in bytes.
    pub quota_share: Option<u64>,
}

impl MountRule {
    /// The rule of the mount at `uri`, with this worker holding `ring_share` of the ring.
    pub fn new(
        path: &str,
        uri: &str,
        cache_ttl: Option<Duration>,
        quota: Option<u64>,
        ring_share: f64,
    ) -> Self {
        Self {
            path: path.to_string(),
            prefix: identity_prefix(uri, ""),
            cache_ttl,
            quota_share: quota.map(|q| (q as f64 * ring_share.clamp(0.0, 1.0)) as u64),
        }
    }

    fn holds(&self, key: &BlockKey) -> bool {
        identity_under(&self.prefix, &key.file)
    }
}

/// Where upkeep learns the mounts' rules (the mount table and the ring, in a worker).
pub trait Rules: Send + Sync + 'static {
    fn rules(&self) -> Vec<MountRule>;
}

impl<F: Fn() -> Vec<MountRule> + Send + Sync + 'static> Rules for F {
    fn rules(&self) -> Vec<MountRule> {
        self()
    }
}

/// A worker's rules: every mount in its table, with its quota shared by its place on the ring
/// the view holds. Until this worker is on that ring (before its first heartbeat, or a view
/// older than its registration) quotas wait: a share of 0 would evict the whole mount.
pub fn cluster_rules(
    mounts: Arc<crate::mounts::Mounts>,
    view: Arc<crate::view::LastView>,
    worker_id: String,
) -> impl Rules {
    let ring: Mutex<Option<(u64, f64)>> = Mutex::new(None);
    move || {
        let share = view.membership().map(|membership| {
            let mut cached = ring.lock().unwrap_or_else(|p| p.into_inner());
            match *cached {
                Some((epoch, share)) if epoch == membership.epoch => share,
                _ => {
                    let members = membership
                        .workers
                        .into_iter()
                        .map(|w| strata_common::Member {
                            id: w.id,
                            data_addr: w.data_addr,
                            node: w.node,
                            local_socket: w.local_socket,
                        })
                        .collect();
                    let ring = strata_common::Ring::new(
                        membership.epoch,
                        members,
                        strata_common::ring::DEFAULT_VNODES,
                    );
                    let share = ring.share(&worker_id);
                    *cached = Some((membership.epoch, share));
                    share
                }
            }
        });
        let share = share.filter(|s| *s > 0.0);
        mounts
            .all()
            .iter()
            .map(|m| {
                let quota = share.and(m.options.quota);
                MountRule::new(&m.path, &m.uri, m.options.cache_ttl, quota, share.unwrap_or(0.0))
            })
            .collect()
    }
}

/// One sweep's work, for the log and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Swept {
    pub watermark: Evicted,
    pub expired: Evicted,
    pub quota: Evicted,
    /// What the tiers' compaction did.
    pub compacted: Compacted,
    /// Each mount's bytes in this worker's tiers after the sweep (mounts with a quota or a
    /// TTL only), by mount path.
    pub mount_bytes: Vec<(String, u64)>,
}

pub struct Upkeep {
    tiers: Vec<(Arc<dyn Tier>, Watermark)>,
    pins: Arc<PinSet>,
    rules: Box<dyn Rules>,
    clock: SharedClock,
    /// When a sweep first saw each block with a cache TTL in each tier, by its storage id (16
    /// bytes a block however long its name).
    first_seen: Mutex<HashMap<(TierKind, u128), Instant>>,
    /// The next walk over every block (TTLs, quotas) is not before this: a walk costs time
    /// under each tier's lock, so they are spaced to keep that under 1/20 of the time.
    next_walk: Mutex<Option<Instant>>,
    /// The last sweep's per-mount bytes, for heartbeats.
    last: Mutex<Vec<(String, u64)>>,
    /// Sweep only once the master's pins arrived (a worker): until then nothing says which
    /// blocks a restarted worker must keep.
    await_pins: bool,
}

impl Upkeep {
    pub fn new(
        tiers: &[Arc<dyn Tier>],
        watermarks: &Watermarks,
        pins: Arc<PinSet>,
        rules: impl Rules,
        clock: SharedClock,
    ) -> Self {
        let tiers = tiers
            .iter()
            .map(|t| {
                let mark = match t.kind() {
                    TierKind::Memory => watermarks.memory,
                    TierKind::Nvme => watermarks.nvme,
                };
                (t.clone(), mark)
            })
            .collect();
        Self {
            tiers,
            pins,
            rules: Box::new(rules),
            clock,
            first_seen: Mutex::default(),
            next_walk: Mutex::default(),
            last: Mutex::default(),
            await_pins: false,
        }
    }

    /// Makes sweeps wait for the first pins list from the master ([`PinSet::epoch`] > 0).
    pub fn awaiting_master_pins(mut self) -> Self {
        self.await_pins = true;
        self
    }

    /// Each mount's bytes in this worker's tiers at the last sweep (mounts with a quota or a
    /// TTL only).
    pub fn mount_bytes(&self) -> Vec<(String, u64)> {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub async fn sweep(&self) -> Swept {
        if self.await_pins && self.pins.epoch() == 0 {
            return Swept::default();
        }
        let now = self.clock.now();
        let rules = self.rules.rules();
        let mut swept = Swept::default();
        let wanted = self.pins.has_cache_ttls()
            || rules.iter().any(|r| r.cache_ttl.is_some() || r.quota_share.is_some());
        let due = self.next_walk.lock().unwrap_or_else(|p| p.into_inner()).is_none_or(|at| now >= at);
        if wanted && due {
            let started = std::time::Instant::now();
            let keys: Vec<Vec<(BlockKey, u64)>> = self.tiers.iter().map(|(t, _)| t.keys()).collect();
            let expired = self.expire(&rules, &keys, now, &mut swept.expired).await;
            self.enforce_quotas(&rules, &keys, &expired, &mut swept).await;
            // A walk of a few thousand blocks takes microseconds and runs every sweep; one of
            // millions is spaced out.
            let spacing = started.elapsed() * 20;
            *self.next_walk.lock().unwrap_or_else(|p| p.into_inner()) =
                (spacing > Duration::from_millis(100)).then(|| now + spacing);
            *self.last.lock().unwrap_or_else(|p| p.into_inner()) = swept.mount_bytes.clone();
        } else if !wanted {
            *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Vec::new();
            self.first_seen.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }
        for (tier, mark) in &self.tiers {
            let usage = tier.usage();
            if usage.capacity_bytes == 0 || usage.used_bytes <= mark.high_bytes(usage.capacity_bytes) {
                continue;
            }
            let excess = usage.used_bytes - mark.low_bytes(usage.capacity_bytes);
            match tier.evict(excess, &|_| true).await {
                Ok(evicted) => {
                    count(tier.kind(), "watermark", evicted);
                    add(&mut swept.watermark, evicted);
                }
                Err(e) => {
                    warn!(tier = tier.kind().label(), err = %e, "cannot evict down to the low watermark")
                }
            }
        }
        // After the evictions above, so what they left dead is compacted in the same sweep.
        for (tier, _) in &self.tiers {
            match tier.compact().await {
                Ok(c) => {
                    swept.compacted.containers += c.containers;
                    swept.compacted.moved += c.moved;
                    swept.compacted.reclaimed_bytes += c.reclaimed_bytes;
                }
                Err(e) => warn!(tier = tier.kind().label(), err = %e, "compaction failed"),
            }
        }
        if swept.watermark.blocks + swept.expired.blocks + swept.quota.blocks + swept.compacted.containers > 0
        {
            debug!(?swept, "upkeep evicted or compacted");
        }
        swept
    }

    /// Drops the blocks whose cache TTL passed; returns them (tier, storage id).
    async fn expire(
        &self,
        rules: &[MountRule],
        keys: &[Vec<(BlockKey, u64)>],
        now: Instant,
        expired: &mut Evicted,
    ) -> HashSet<(TierKind, u128)> {
        let mut due = Vec::new();
        let mut gone = HashSet::new();
        {
            let mut seen = self.first_seen.lock().unwrap_or_else(|p| p.into_inner());
            let mut present = HashSet::new();
            for ((tier, _), keys) in self.tiers.iter().zip(keys) {
                let kind = tier.kind();
                for (key, size) in keys {
                    let Some(ttl) = self.cache_ttl_of(rules, key) else { continue };
                    let id = (kind, key.storage_id());
                    let at = *seen.entry(id).or_insert(now);
                    if now.duration_since(at) >= ttl && !self.pins.is_pinned(key, kind) {
                        due.push((tier.clone(), key.clone(), *size));
                    }
                    present.insert(id);
                }
            }
            seen.retain(|k, _| present.contains(k));
        }
        for (tier, key, size) in due {
            match tier.remove(&key).await {
                Ok(()) => {
                    let one = Evicted { blocks: 1, bytes: size };
                    count(tier.kind(), "ttl", one);
                    add(expired, one);
                    let id = (tier.kind(), key.storage_id());
                    self.first_seen.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
                    gone.insert(id);
                }
                Err(e) => {
                    warn!(block = %key, tier = tier.kind().label(), err = %e, "cannot drop an expired block")
                }
            }
        }
        gone
    }

    /// A block's cache TTL: the most specific path rule's (`strata ttl set`), else its mount's
    /// `cache_ttl`. A path rule on the mount point itself wins over the mount option.
    fn cache_ttl_of(&self, rules: &[MountRule], key: &BlockKey) -> Option<Duration> {
        let mount = rule_of(rules, key).map(|i| &rules[i]);
        match (self.pins.cache_ttl(key), mount) {
            (Some((len, ttl)), Some(m)) if len >= m.prefix.trim_end_matches('/').len() => Some(ttl),
            (Some(_), Some(m)) => m.cache_ttl,
            (Some((_, ttl)), None) => Some(ttl),
            (None, m) => m.and_then(|m| m.cache_ttl),
        }
    }

    async fn enforce_quotas(
        &self,
        rules: &[MountRule],
        keys: &[Vec<(BlockKey, u64)>],
        expired: &HashSet<(TierKind, u128)>,
        swept: &mut Swept,
    ) {
        let mut bytes: Vec<u64> = vec![0; rules.len()];
        for ((tier, _), keys) in self.tiers.iter().zip(keys) {
            for (key, size) in keys {
                if let Some(i) = rule_of(rules, key)
                    && (expired.is_empty() || !expired.contains(&(tier.kind(), key.storage_id())))
                {
                    bytes[i] += size;
                }
            }
        }
        for (rule, held) in rules.iter().zip(bytes.iter_mut()) {
            if let Some(share) = rule.quota_share
                && *held > share
            {
                let before = *held;
                // NVMe first: its copies are the colder ones, and DRAM often holds the same
                // blocks again.
                for kind in [TierKind::Nvme, TierKind::Memory] {
                    let Some((tier, _)) = self.tiers.iter().find(|(t, _)| t.kind() == kind) else { continue };
                    if *held <= share {
                        break;
                    }
                    match tier
                        .evict(*held - share, &|k| {
                            rule_of(rules, k).is_some_and(|i| rules[i].path == rule.path)
                        })
                        .await
                    {
                        Ok(evicted) => {
                            count(kind, "quota", evicted);
                            add(&mut swept.quota, evicted);
                            *held = held.saturating_sub(evicted.bytes);
                        }
                        Err(e) => {
                            warn!(mount = %rule.path, tier = kind.label(), err = %e, "cannot evict a mount over its quota")
                        }
                    }
                }
                info!(mount = %rule.path, share, before, after = *held, "mount over its quota share: evicted");
            }
        }
        swept.mount_bytes = rules
            .iter()
            .zip(bytes)
            .filter(|(r, _)| r.cache_ttl.is_some() || r.quota_share.is_some())
            .map(|(r, bytes)| (r.path.clone(), bytes))
            .collect();
    }
}

/// The mount a block belongs to: the one whose prefix is the longest that holds it (a mount of
/// `s3://b/x/sub` inside one of `s3://b/x` takes the blocks below `sub`).
fn rule_of(rules: &[MountRule], key: &BlockKey) -> Option<usize> {
    rules.iter().enumerate().filter(|(_, r)| r.holds(key)).max_by_key(|(_, r)| r.prefix.len()).map(|(i, _)| i)
}

fn add(total: &mut Evicted, more: Evicted) {
    total.blocks += more.blocks;
    total.bytes += more.bytes;
}

fn count(tier: TierKind, reason: &'static str, evicted: Evicted) {
    if evicted.blocks > 0 {
        metrics::counter!(m::UPKEEP_EVICTED_BLOCKS, "tier" => tier.label(), "reason" => reason)
            .increment(evicted.blocks);
        metrics::counter!(m::UPKEEP_EVICTED_BYTES, "tier" => tier.label(), "reason" => reason)
            .increment(evicted.bytes);
    }
}

/// Sweeps every `interval` until cancelled.
pub async fn run(upkeep: Arc<Upkeep>, interval: Duration, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(interval.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        upkeep.sweep().await;
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use strata_common::block::file_identity;
    use strata_common::clock::ManualClock;

    use super::*;
    use crate::tier::MemoryTier;

    const KIB: u64 = 1024;

    fn key(mount_uri: &str, file: &str, index: u64) -> BlockKey {
        BlockKey::new(file_identity(mount_uri, file, KIB), "v1", index)
    }

    fn marks(high: u8, low: u8) -> Watermarks {
        let mark = Watermark { high, low };
        Watermarks { memory: mark, nvme: mark }
    }

    async fn fill(tier: &Arc<dyn Tier>, uri: &str, blocks: u64) {
        for i in 0..blocks {
            tier.put(&key(uri, "f", i), Bytes::from(vec![7; KIB as usize])).await.unwrap();
        }
    }

    #[tokio::test]
    async fn a_tier_above_its_high_watermark_is_evicted_to_its_low_one_in_policy_order() {
        let tier: Arc<dyn Tier> = Arc::new(MemoryTier::new(10 * KIB));
        let upkeep = Upkeep::new(
            std::slice::from_ref(&tier),
            &marks(90, 60),
            PinSet::new(),
            Vec::new,
            ManualClock::new(),
        );
        fill(&tier, "s3://b/a", 9).await;
        assert_eq!(upkeep.sweep().await, Swept::default(), "at 90 %, not above it");
        fill(&tier, "s3://b/b", 1).await;
        let swept = upkeep.sweep().await;
        assert_eq!(swept.watermark, Evicted { blocks: 4, bytes: 4 * KIB });
        assert_eq!(tier.usage().used_bytes, 6 * KIB);
        // S3-FIFO without hits evicts the oldest first.
        assert!(!tier.contains(&key("s3://b/a", "f", 0)) && tier.contains(&key("s3://b/a", "f", 4)));
    }

    #[tokio::test]
    async fn a_worker_sweeps_nothing_before_it_knows_the_pins() {
        let tier: Arc<dyn Tier> = Arc::new(MemoryTier::new(10 * KIB));
        let pins = PinSet::new();
        pins.install(std::slice::from_ref(&tier));
        let upkeep = Upkeep::new(
            std::slice::from_ref(&tier),
            &marks(50, 50),
            pins.clone(),
            Vec::new,
            ManualClock::new(),
        )
        .awaiting_master_pins();
        fill(&tier, "s3://b/a", 10).await;
        assert_eq!(upkeep.sweep().await, Swept::default(), "a restarted worker's pinned blocks wait");
        pins.replace(3, vec![(identity_prefix("s3://b/a", "f"), TierKind::Memory)]);
        assert_eq!(upkeep.sweep().await.watermark.blocks, 0, "now known: pinned, so kept");
        pins.replace(4, Vec::new());
        assert_eq!(upkeep.sweep().await.watermark.blocks, 5);
    }

    #[tokio::test]
    async fn blocks_expire_after_the_mounts_cache_ttl_unless_pinned() {
        let tier: Arc<dyn Tier> = Arc::new(MemoryTier::new(100 * KIB));
        let clock = ManualClock::new();
        let pins = PinSet::new();
        pins.install(std::slice::from_ref(&tier));
        let rules = || {
            vec![
                MountRule::new("/ttl", "s3://b/ttl", Some(Duration::from_secs(60)), None, 1.0),
                MountRule::new("/keep", "s3://b/keep", None, None, 1.0),
            ]
        };
        let upkeep =
            Upkeep::new(std::slice::from_ref(&tier), &marks(100, 100), pins.clone(), rules, clock.clone());
        fill(&tier, "s3://b/ttl", 3).await;
        fill(&tier, "s3://b/keep", 2).await;
        pins.replace(1, vec![(identity_prefix("s3://b/ttl", "f"), TierKind::Memory)]);
        tier.put(&key("s3://b/ttl", "g", 0), Bytes::from(vec![1; KIB as usize])).await.unwrap();
        assert_eq!(upkeep.sweep().await.expired, Evicted::default(), "first seen now");
        clock.advance(Duration::from_secs(30));
        tier.put(&key("s3://b/ttl", "h", 0), Bytes::from(vec![1; KIB as usize])).await.unwrap();
        assert_eq!(upkeep.sweep().await.expired, Evicted::default());
        clock.advance(Duration::from_secs(30));
        // g is 60 s old; h 30 s; f's blocks are pinned; /keep has no TTL.
        assert_eq!(upkeep.sweep().await.expired, Evicted { blocks: 1, bytes: KIB });
        assert!(!tier.contains(&key("s3://b/ttl", "g", 0)));
        assert!(tier.contains(&key("s3://b/ttl", "h", 0)) && tier.contains(&key("s3://b/ttl", "f", 2)));
        clock.advance(Duration::from_secs(30));
        assert_eq!(upkeep.sweep().await.expired.blocks, 1, "h in its turn");
        pins.replace(2, Vec::new());
        assert_eq!(upkeep.sweep().await.expired.blocks, 3, "unpinned blocks past their TTL go");
        assert_eq!(tier.usage().used_bytes, 2 * KIB, "the other mount's blocks stay");
    }

    #[tokio::test]
    async fn a_paths_cache_ttl_wins_over_its_mounts_and_applies_where_the_mount_has_none() {
        let tier: Arc<dyn Tier> = Arc::new(MemoryTier::new(100 * KIB));
        let clock = ManualClock::new();
        let pins = PinSet::new();
        let rules = || {
            vec![
                MountRule::new("/m", "s3://b/m", Some(Duration::from_secs(600)), None, 1.0),
                MountRule::new("/n", "s3://b/n", None, None, 1.0),
            ]
        };
        let upkeep =
            Upkeep::new(std::slice::from_ref(&tier), &marks(100, 100), pins.clone(), rules, clock.clone());
        for (uri, file) in
            [("s3://b/m", "fast/a"), ("s3://b/m", "slow/a"), ("s3://b/n", "x/a"), ("s3://b/n", "y/a")]
        {
            tier.put(&key(uri, file, 0), Bytes::from(vec![1; KIB as usize])).await.unwrap();
        }
        pins.replace_cache_ttls(vec![
            (identity_prefix("s3://b/m", "fast"), Duration::from_secs(60)),
            (identity_prefix("s3://b/n", "x"), Duration::from_secs(60)),
        ]);
        assert_eq!(upkeep.sweep().await.expired.blocks, 0);
        clock.advance(Duration::from_secs(61));
        assert_eq!(upkeep.sweep().await.expired.blocks, 2, "m/fast and n/x, by their paths' TTL");
        assert!(!tier.contains(&key("s3://b/m", "fast/a", 0)) && !tier.contains(&key("s3://b/n", "x/a", 0)));
        assert!(tier.contains(&key("s3://b/m", "slow/a", 0)), "the mount's 10 minutes hold for the rest");
        // A rule on the mount point itself overrides the mount's option.
        pins.replace_cache_ttls(vec![(identity_prefix("s3://b/m", ""), Duration::from_secs(3600))]);
        clock.advance(Duration::from_secs(600));
        assert_eq!(upkeep.sweep().await.expired.blocks, 0, "an hour now, not 10 minutes");
        assert!(tier.contains(&key("s3://b/n", "y/a", 0)), "no TTL at all");
    }

    #[tokio::test]
    async fn a_mount_over_its_quota_share_loses_its_own_blocks_nvme_first() {
        let memory: Arc<dyn Tier> = Arc::new(MemoryTier::new(100 * KIB));
        let dir = tempfile::tempdir().unwrap();
        let nvme: Arc<dyn Tier> =
            Arc::new(crate::tier::NvmeTier::open(dir.path().to_path_buf(), 100 * KIB).unwrap());
        // /q with a quota, and a mount inside it without one.
        let quota_upkeep = |quota: u64, ring_share: f64| {
            let rules = move || {
                vec![
                    MountRule::new("/q", "s3://b/q", None, Some(quota), ring_share),
                    MountRule::new("/inner", "s3://b/q/inner", None, None, ring_share),
                ]
            };
            Upkeep::new(
                &[memory.clone(), nvme.clone()],
                &marks(100, 100),
                PinSet::new(),
                rules,
                ManualClock::new(),
            )
        };
        // Half the ring: a 12 KiB quota leaves this worker 6 KiB of the mount.
        let upkeep = quota_upkeep(12 * KIB, 0.5);
        fill(&memory, "s3://b/q", 4).await;
        fill(&nvme, "s3://b/q", 4).await;
        fill(&nvme, "s3://b/other", 10).await;
        // A mount inside it takes its own blocks: they do not count against /q's quota.
        fill(&nvme, "s3://b/q/inner", 3).await;
        let swept = upkeep.sweep().await;
        assert_eq!(swept.quota, Evicted { blocks: 2, bytes: 2 * KIB });
        assert_eq!(swept.mount_bytes, vec![("/q".to_string(), 6 * KIB)]);
        assert_eq!((memory.usage().blocks, nvme.usage().blocks), (4, 15), "NVMe gave up two of its four");
        assert_eq!(upkeep.mount_bytes(), swept.mount_bytes);
        // More than NVMe holds of it: then DRAM.
        let upkeep = quota_upkeep(KIB, 1.0);
        assert_eq!(upkeep.sweep().await.quota.blocks, 5);
        assert_eq!((memory.usage().blocks, nvme.usage().blocks), (1, 13), "other mounts untouched");
    }
}
