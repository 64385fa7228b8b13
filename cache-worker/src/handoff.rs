//! Background hand-off: when the ring changes, the blocks this worker holds whose first owner
//! is now another worker are pushed to that worker without waiting for a client read; a
//! draining worker (off the ring, still serving) pushes all of its blocks the same way.
//!
//! Why push and not pull: the cache knows a block by its [`BlockKey`] alone (no Strata path, no
//! file size), so the holder is the only one that can name what moved; it offers the keys in
//! batches ([`Op::HandOffOffer`](strata_common::frame::Op)), the receiver answers which it
//! wants (it lacks them and has room in its bounded queue; the rest are dropped and fetched on
//! demand later, from the peer first), and the holder pushes each wanted block
//! ([`Op::HandOffBlock`](strata_common::frame::Op)).
//!
//! Invariants:
//! - the sender reads its own tiers only ([`BlockCache::handoff_copy`]), never the UFS, and
//!   never counts the copy as a hit;
//! - it sends one block at a time, paced by a [`Throttle`] at the configured bandwidth, and
//!   waits while client reads are in flight here ([`Qos::busy`]), like the load lane; the
//!   receiver waits the same way before storing, up to [`RECEIVER_YIELD`];
//! - the sender keeps its copy: eviction takes it in time. It is what the new owner's peer
//!   fetch asks for an offer the receiver dropped, and it is a replica owner's copy whenever the
//!   block still has this worker among its owners, so dropping it would need a second ring
//!   lookup and cost a later failover read;
//! - a received block goes through the tiers' `put` like any other, so the receiver's pin set
//!   (rules by path prefix from the master) pins it exactly as it would a block it fetched; one
//!   pinned in DRAM is put in DRAM as well as on NVMe.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use strata_common::frame::{HandOffBlock, HandOffOffer};
use strata_common::ring::DEFAULT_VNODES;
use strata_common::upstream::PeerLink;
use strata_common::{BlockKey, Member, Ring, block};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::blocks::BlockService;
use crate::metrics_defs as m;
use crate::tier::PutParams;
use crate::view::LastView;

/// Default of `WorkerConfig::handoff_bandwidth`: bytes per second one worker sends.
pub const DEFAULT_HANDOFF_BANDWIDTH: u64 = 100 << 20;
/// Default of `WorkerConfig::handoff_batch`: blocks named by one offer.
pub const DEFAULT_HANDOFF_BATCH: usize = 64;
/// Default of `WorkerConfig::handoff_queue`: blocks a receiver has promised to take and not
/// received yet, at most; offers beyond are declined.
pub const DEFAULT_HANDOFF_QUEUE: usize = 256;
/// A promise the sender did not keep in this long (it stopped, the ring moved) frees its slot.
const PROMISE_EXPIRY: Duration = Duration::from_secs(30);
/// Longest a receiver waits for its client reads to pause before storing a pushed block.
pub const RECEIVER_YIELD: Duration = Duration::from_secs(1);
/// How often the sender looks for a new ring, and re-checks a busy lane.
const POLL: Duration = Duration::from_millis(20);
/// Longest one hand-off request may take before the block counts as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandOffConfig {
    /// Bytes per second sent at most; 0 turns background hand-off off (a drain still sends).
    pub bandwidth: u64,
    pub batch: usize,
    pub queue: usize,
}

impl Default for HandOffConfig {
    fn default() -> Self {
        Self {
            bandwidth: DEFAULT_HANDOFF_BANDWIDTH,
            batch: DEFAULT_HANDOFF_BATCH,
            queue: DEFAULT_HANDOFF_QUEUE,
        }
    }
}

/// A token bucket without I/O: time is a parameter. It allows a burst of one second's worth
/// (at least one block) and then `rate` bytes per second.
#[derive(Debug, Clone)]
pub struct Throttle {
    rate: u64,
    /// Bytes that may go now (negative: owed).
    credit: f64,
    at: Instant,
}

impl Throttle {
    pub fn new(rate: u64, now: Instant) -> Self {
        Self { rate: rate.max(1), credit: rate.max(1) as f64, at: now }
    }

    /// Takes `bytes` from the bucket at `now`; returns how long to wait before sending them.
    pub fn take(&mut self, bytes: u64, now: Instant) -> Duration {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = now.max(self.at);
        self.credit = (self.credit + elapsed * self.rate as f64).min(self.rate as f64);
        self.credit -= bytes as f64;
        if self.credit >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.credit / self.rate as f64)
        }
    }
}

/// The blocks in `held` whose first owner on `ring` is not `me`, by that owner.
pub fn plan(
    held: impl IntoIterator<Item = (BlockKey, u64)>,
    ring: &Ring,
    me: &str,
) -> BTreeMap<String, (Member, Vec<(BlockKey, u64)>)> {
    let mut out: BTreeMap<String, (Member, Vec<(BlockKey, u64)>)> = BTreeMap::new();
    for (key, len) in held {
        let Some(owner) = ring.owners(key.placement_hash(), 1).first().copied() else { continue };
        if owner.id != me {
            out.entry(owner.id.clone()).or_insert_with(|| (owner.clone(), Vec::new())).1.push((key, len));
        }
    }
    out
}

/// What the receiver has promised to take: bounded, and a promise not kept expires.
#[derive(Debug)]
pub struct Promises {
    limit: usize,
    pending: HashMap<BlockKey, Instant>,
}

impl Promises {
    pub fn new(limit: usize) -> Self {
        Self { limit: limit.max(1), pending: HashMap::new() }
    }

    /// Which of `offered` to ask for: those `have` says are missing, while there is room.
    pub fn answer(
        &mut self,
        offered: &[(BlockKey, u64)],
        have: impl Fn(&BlockKey) -> bool,
        now: Instant,
    ) -> Vec<u8> {
        self.pending.retain(|_, at| now.saturating_duration_since(*at) < PROMISE_EXPIRY);
        offered
            .iter()
            .map(|(key, _)| {
                if have(key) {
                    return 0;
                }
                if self.pending.contains_key(key) || self.pending.len() < self.limit {
                    self.pending.insert(key.clone(), now);
                    1
                } else {
                    metrics::counter!(m::HANDOFF_DROPPED).increment(1);
                    0
                }
            })
            .collect()
    }

    /// Whether `key` was promised (and is not any more).
    pub fn arrived(&mut self, key: &BlockKey) -> bool {
        self.pending.remove(key).is_some()
    }
}

/// The receiving side, shared by the data plane's connections.
pub struct Receiver {
    blocks: Arc<BlockService>,
    /// The master's pins: a block pinned in DRAM goes to DRAM too, as a fetched one would.
    pins: Arc<crate::pins::PinSet>,
    promises: std::sync::Mutex<Promises>,
    /// Blocks received and kept, since start.
    pub received: AtomicU64,
}

impl Receiver {
    pub fn new(blocks: Arc<BlockService>, pins: Arc<crate::pins::PinSet>, queue: usize) -> Self {
        Self {
            blocks,
            pins,
            promises: std::sync::Mutex::new(Promises::new(queue)),
            received: AtomicU64::new(0),
        }
    }

    pub fn offer(&self, offer: &HandOffOffer) -> Vec<u8> {
        let cache = self.blocks.cache();
        let mut promises = self.promises.lock().unwrap_or_else(|p| p.into_inner());
        promises.answer(&offer.blocks, |k| cache.contains(k), Instant::now())
    }

    /// Stores a pushed block; `false` when it was not asked for (it is dropped then).
    pub async fn take(&self, block: HandOffBlock) -> bool {
        if !self.promises.lock().unwrap_or_else(|p| p.into_inner()).arrived(&block.key) {
            return false;
        }
        let until = Instant::now() + RECEIVER_YIELD;
        while self.blocks.qos().busy() && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let len = block.data.len() as u64;
        let in_memory = self.pins.is_pinned(&block.key, crate::tier::TierKind::Memory);
        // The push carries no file size; a whole small file is recognised from its key.
        let threshold = self.blocks.mounts().pack_threshold_of(&block.key);
        let params = PutParams { packed: block::is_small_file_block(&block.key, len, threshold) };
        if let Err(e) = self.blocks.cache().store_handed_off(&block.key, block.data, in_memory, params).await
        {
            debug!(block = %block.key, err = %e, "handed-off block not kept");
            return false;
        }
        metrics::counter!(m::HANDOFF_BLOCKS, "direction" => "received").increment(1);
        metrics::counter!(m::HANDOFF_BYTES, "direction" => "received").increment(len);
        self.received.fetch_add(1, Ordering::Relaxed);
        true
    }
}

/// Progress of the sender, for drains and tests.
#[derive(Debug, Default)]
pub struct Progress {
    /// Blocks pushed and kept by their new owner, since start.
    pub sent: AtomicU64,
    /// Blocks the new owner declined (it had them, or its queue was full), since start.
    pub declined: AtomicU64,
    /// Blocks that could not be sent (peer down, block gone), since start.
    pub failed: AtomicU64,
    /// Membership epoch of the last pass that went through every block it planned.
    pub completed_epoch: AtomicU64,
    /// Whether that pass ran with this worker off the ring (a drain).
    pub completed_off_ring: AtomicBool,
    /// Blocks the pass under way still has to offer.
    pub left: AtomicU64,
}

/// What a drain did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainReport {
    pub sent: u64,
    pub declined: u64,
    pub failed: u64,
    /// Blocks not offered yet when the deadline came (0 when the drain finished).
    pub left: u64,
    pub finished: bool,
}

pub struct Sender {
    pub blocks: Arc<BlockService>,
    pub view: Arc<LastView>,
    pub me: String,
    pub config: HandOffConfig,
    pub link: Arc<std::sync::OnceLock<Arc<dyn PeerLink>>>,
    pub draining: Arc<AtomicBool>,
    pub progress: Arc<Progress>,
}

/// The ring of the worker's last view, and whether `me` is on it.
fn ring_of(view: &LastView, me: &str) -> Option<(Ring, bool)> {
    let membership = view.membership()?;
    let members: Vec<Member> = membership
        .workers
        .into_iter()
        .map(|w| Member { id: w.id, data_addr: w.data_addr, node: w.node, local_socket: w.local_socket })
        .collect();
    let on = members.iter().any(|w| w.id == me);
    Some((Ring::new(membership.epoch, members, DEFAULT_VNODES), on))
}

impl Sender {
    /// Watches the view and runs a pass on every new membership epoch, until `cancel`.
    pub async fn run(self, cancel: CancellationToken) {
        let mut done_epoch = None;
        while !cancel.is_cancelled() {
            let epoch = self.view.epochs().map(|(m, _)| m);
            let wanted = self.config.bandwidth > 0 || self.draining.load(Ordering::Relaxed);
            if epoch.is_some() && epoch != done_epoch && wanted && self.link.get().is_some() {
                if let Some(finished) = self.pass(&cancel).await {
                    done_epoch = Some(finished);
                }
                continue;
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(POLL) => {}
            }
        }
    }

    /// One walk over the held blocks at the view's ring; the epoch when it went through all.
    async fn pass(&self, cancel: &CancellationToken) -> Option<u64> {
        let (ring, on_ring) = ring_of(&self.view, &self.me)?;
        let epoch = ring.epoch();
        let link = self.link.get()?.clone();
        let held = self.blocks.cache().held_blocks();
        let plan = plan(held, &ring, &self.me);
        let total: usize = plan.values().map(|(_, v)| v.len()).sum();
        self.progress.left.store(total as u64, Ordering::Relaxed);
        if total > 0 {
            info!(
                epoch,
                blocks = total,
                receivers = plan.len(),
                on_ring,
                "handing blocks off to their new owners"
            );
        }
        // A drain sends at the configured rate even when background hand-off is off.
        let rate = if self.config.bandwidth > 0 { self.config.bandwidth } else { DEFAULT_HANDOFF_BANDWIDTH };
        let mut throttle = Throttle::new(rate, Instant::now());
        let mut req_id = 0u64;
        for (_, (to, list)) in plan {
            for batch in list.chunks(self.config.batch.max(1)) {
                if cancel.is_cancelled() || self.view.epochs().map(|(m, _)| m) != Some(epoch) {
                    return None;
                }
                req_id += 1;
                let offer = HandOffOffer { req_id, blocks: batch.to_vec() };
                let wanted = match exchange(
                    &*link,
                    &to.data_addr,
                    &offer.encode(),
                    req_id,
                    batch.len() as u64,
                )
                .await
                {
                    Ok(answer) if answer.len() == batch.len() => answer.to_vec(),
                    Ok(answer) => {
                        warn!(to = %to.id, got = answer.len(), offered = batch.len(), "malformed hand-off answer");
                        vec![0; batch.len()]
                    }
                    Err(e) => {
                        debug!(to = %to.id, err = %e, "hand-off offer failed");
                        self.progress.failed.fetch_add(batch.len() as u64, Ordering::Relaxed);
                        self.progress.left.fetch_sub(batch.len() as u64, Ordering::Relaxed);
                        continue;
                    }
                };
                for ((key, _), want) in batch.iter().zip(wanted) {
                    self.progress.left.fetch_sub(1, Ordering::Relaxed);
                    if want == 0 {
                        self.progress.declined.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    while self.blocks.qos().busy() && !cancel.is_cancelled() {
                        tokio::time::sleep(POLL).await;
                    }
                    let Some(data) = self.blocks.cache().handoff_copy(key).await else {
                        self.progress.failed.fetch_add(1, Ordering::Relaxed);
                        continue;
                    };
                    let wait = throttle.take(data.len() as u64, Instant::now());
                    if !wait.is_zero() {
                        tokio::time::sleep(wait).await;
                    }
                    req_id += 1;
                    let len = data.len() as u64;
                    let push = HandOffBlock { req_id, key: key.clone(), data };
                    match exchange(&*link, &to.data_addr, &push.encode(), req_id, 0).await {
                        Ok(_) => {
                            self.progress.sent.fetch_add(1, Ordering::Relaxed);
                            metrics::counter!(m::HANDOFF_BLOCKS, "direction" => "sent").increment(1);
                            metrics::counter!(m::HANDOFF_BYTES, "direction" => "sent").increment(len);
                        }
                        Err(e) => {
                            debug!(to = %to.id, block = %key, err = %e, "hand-off push failed");
                            self.progress.failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }
        }
        self.progress.completed_off_ring.store(!on_ring, Ordering::Relaxed);
        self.progress.completed_epoch.store(epoch, Ordering::Relaxed);
        Some(epoch)
    }
}

async fn exchange(
    link: &dyn PeerLink,
    addr: &str,
    frame: &[u8],
    req_id: u64,
    max: u64,
) -> Result<Bytes, String> {
    tokio::time::timeout(REQUEST_TIMEOUT, link.exchange(addr, frame, req_id, max))
        .await
        .map_err(|_| format!("{addr}: no answer in {REQUEST_TIMEOUT:?}"))?
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u64) -> BlockKey {
        BlockKey::new(format!("file:///u/f{i}#bs4"), "v1", i)
    }

    #[test]
    fn a_throttle_allows_a_second_of_burst_then_paces_at_its_rate() {
        let t0 = Instant::now();
        let mut t = Throttle::new(1000, t0);
        assert_eq!(t.take(1000, t0), Duration::ZERO, "the first second's worth goes at once");
        assert_eq!(t.take(500, t0), Duration::from_millis(500));
        // Half a second later the debt is paid: the next 250 bytes wait 250 ms.
        assert_eq!(t.take(250, t0 + Duration::from_millis(500)), Duration::from_millis(250));
        // A long idle time refills no more than one second's worth.
        let later = t0 + Duration::from_secs(60);
        assert_eq!(t.take(1000, later), Duration::ZERO);
        assert_eq!(t.take(100, later), Duration::from_millis(100));
    }

    #[test]
    fn a_block_is_planned_for_its_first_owner_unless_that_is_me() {
        let members: Vec<Member> =
            ["a", "b", "c"].iter().map(|id| Member::new(*id, format!("{id}:1"))).collect();
        let ring = Ring::new(1, members, DEFAULT_VNODES);
        let held: Vec<(BlockKey, u64)> = (0..300).map(|i| (key(i), 4)).collect();
        let plan = plan(held.clone(), &ring, "a");
        assert!(!plan.contains_key("a"));
        let planned: usize = plan.values().map(|(_, v)| v.len()).sum();
        let mine = held.iter().filter(|(k, _)| ring.owners(k.placement_hash(), 1)[0].id == "a").count();
        assert_eq!(planned + mine, 300, "every block is either kept or planned once");
        for (id, (member, list)) in &plan {
            assert_eq!(&member.id, id);
            assert!(list.iter().all(|(k, _)| &ring.owners(k.placement_hash(), 1)[0].id == id));
        }
        // Off the ring (a drain), everything goes.
        let without_me =
            Ring::new(2, ring.members().iter().filter(|m| m.id != "a").cloned().collect(), DEFAULT_VNODES);
        assert_eq!(super::plan(held, &without_me, "a").values().map(|(_, v)| v.len()).sum::<usize>(), 300);
    }

    #[test]
    fn a_receiver_asks_only_for_what_it_lacks_and_declines_beyond_its_queue() {
        let t0 = Instant::now();
        let mut p = Promises::new(2);
        let offered: Vec<(BlockKey, u64)> = (0..4).map(|i| (key(i), 4)).collect();
        let have_1 = |k: &BlockKey| k.index == 1;
        assert_eq!(p.answer(&offered, have_1, t0), vec![1, 0, 1, 0], "room for two");
        // Offered again before it arrived: still promised, and nothing new fits.
        assert_eq!(p.answer(&offered, have_1, t0), vec![1, 0, 1, 0]);
        assert!(p.arrived(&key(0)));
        assert!(!p.arrived(&key(0)), "a block is taken once");
        assert!(!p.arrived(&key(3)), "never promised");
        assert_eq!(
            p.answer(&offered, have_1, t0),
            vec![1, 0, 1, 0],
            "the slot freed by block 0 goes to it again"
        );
        // Promises not kept expire.
        assert_eq!(p.answer(&offered[3..], |_| false, t0 + PROMISE_EXPIRY), vec![1]);
    }
}
