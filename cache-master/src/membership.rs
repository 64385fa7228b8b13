//! Worker membership as a state machine without I/O: events in (`register`, `heartbeat`,
//! `tick(now)`), the live set and its epoch out. Time is a parameter, so tests drive the clock.
//!
//! Invariants: the epoch moves whenever the live set or a live worker's data address changes,
//! and never otherwise; a worker declared lost stays out until it registers again (its
//! heartbeats are refused), so a worker cannot slip back in without a full block report.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use strata_common::Member;

use crate::reports::{TierUsage, WorkerCounters};

#[derive(Debug, Clone)]
pub struct WorkerRecord {
    pub id: String,
    pub data_addr: String,
    pub http_addr: String,
    /// The node it runs on, as it reported (empty when not configured).
    pub node: String,
    /// Its Unix socket for processes on its host (empty when it serves none).
    pub local_socket: String,
    pub last_heartbeat: Instant,
    pub live: bool,
    /// Live but leaving (`strata worker --drain`): off the ring, still serving its peers.
    pub draining: bool,
    pub tiers: Vec<TierUsage>,
    pub counters: WorkerCounters,
    /// Bytes it holds of each mount with a quota or a cache TTL, by mount path.
    pub mount_bytes: Vec<(String, u64)>,
}

/// A registration: who a worker is, where it is reached and on which node it runs. The store
/// keeps it (with etcd), so a new leader knows the workers before they register with it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WorkerEntry {
    pub id: String,
    pub data_addr: String,
    pub http_addr: String,
    /// Empty when the worker reported none, or was stored by a master that predates nodes.
    #[serde(default)]
    pub node: String,
    /// Empty when the worker serves no local socket, or was stored by a master before them.
    #[serde(default)]
    pub local_socket: String,
    /// The paths the worker owns (see `strata_ufs::StateFence`): fenced in every `file://`
    /// mount of the cluster.
    #[serde(default)]
    pub state_paths: Vec<String>,
}

impl WorkerEntry {
    /// A worker on no particular node.
    pub fn new(id: &str, data_addr: &str, http_addr: &str) -> Self {
        Self {
            id: id.into(),
            data_addr: data_addr.into(),
            http_addr: http_addr.into(),
            node: String::new(),
            local_socket: String::new(),
            state_paths: Vec::new(),
        }
    }
}

#[derive(Debug)]
pub struct Membership {
    workers: BTreeMap<String, WorkerRecord>,
    epoch: u64,
    timeout: Duration,
}

impl Membership {
    /// `first_epoch` should grow across master restarts (the master uses wall-clock millis), so
    /// a client never mistakes an old membership for a newer one.
    pub fn new(timeout: Duration, first_epoch: u64) -> Self {
        Self { workers: BTreeMap::new(), epoch: first_epoch, timeout }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Adds or refreshes a worker. The epoch moves when the live set, an address, a node or a
    /// local socket changes (clients read both from the membership to choose local replicas).
    pub fn register(&mut self, entry: &WorkerEntry, now: Instant) -> u64 {
        let WorkerEntry { id, data_addr, http_addr, node, local_socket, state_paths: _ } = entry;
        let changed = match self.workers.get(id) {
            Some(w) => {
                !w.live || w.data_addr != *data_addr || w.node != *node || w.local_socket != *local_socket
            }
            None => true,
        };
        let record = self.workers.entry(id.to_string()).or_insert_with(|| WorkerRecord {
            id: id.to_string(),
            data_addr: String::new(),
            http_addr: String::new(),
            node: String::new(),
            local_socket: String::new(),
            last_heartbeat: now,
            live: true,
            draining: false,
            tiers: Vec::new(),
            mount_bytes: Vec::new(),
            counters: WorkerCounters::default(),
        });
        record.data_addr = data_addr.to_string();
        record.http_addr = http_addr.to_string();
        record.node = node.to_string();
        record.local_socket = local_socket.to_string();
        record.last_heartbeat = now;
        record.live = true;
        // A draining worker that registers again (a new master) says so in its next beat.
        let was_draining = std::mem::take(&mut record.draining);
        if changed || was_draining {
            self.epoch += 1;
        }
        self.epoch
    }

    /// Records a heartbeat. `false` means the worker is unknown or was declared lost and must
    /// register again.
    pub fn heartbeat(&mut self, id: &str, now: Instant) -> bool {
        match self.workers.get_mut(id) {
            Some(w) if w.live => {
                w.last_heartbeat = now;
                true
            }
            _ => false,
        }
    }

    /// Takes a live worker off the ring for good (it is draining); the epoch moves the first
    /// time. `false` when the worker is not live.
    pub fn set_draining(&mut self, id: &str) -> bool {
        match self.workers.get_mut(id) {
            Some(w) if w.live => {
                if !w.draining {
                    w.draining = true;
                    self.epoch += 1;
                }
                true
            }
            _ => false,
        }
    }

    pub fn update_stats(
        &mut self,
        id: &str,
        tiers: Vec<TierUsage>,
        counters: WorkerCounters,
        mount_bytes: Vec<(String, u64)>,
    ) {
        if let Some(w) = self.workers.get_mut(id) {
            w.tiers = tiers;
            w.counters = counters;
            w.mount_bytes = mount_bytes;
        }
    }

    /// Declares workers lost whose last heartbeat is older than the timeout; returns them.
    pub fn tick(&mut self, now: Instant) -> Vec<String> {
        let mut lost = Vec::new();
        let mut ring_moved = false;
        for w in self.workers.values_mut() {
            if w.live && now.saturating_duration_since(w.last_heartbeat) > self.timeout {
                w.live = false;
                // A drained worker left the ring when it began draining.
                ring_moved |= !std::mem::take(&mut w.draining);
                lost.push(w.id.clone());
            }
        }
        if ring_moved {
            self.epoch += 1;
        }
        lost
    }

    pub fn live_members(&self) -> Vec<Member> {
        self.workers
            .values()
            .filter(|w| w.live && !w.draining)
            .map(|w| Member {
                id: w.id.clone(),
                data_addr: w.data_addr.clone(),
                node: w.node.clone(),
                local_socket: w.local_socket.clone(),
            })
            .collect()
    }

    pub fn workers(&self) -> impl Iterator<Item = &WorkerRecord> {
        self.workers.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lost_workers_leave_the_live_set_and_bump_the_epoch() {
        let t0 = Instant::now();
        let mut m = Membership::new(Duration::from_secs(3), 100);
        assert_eq!(m.register(&WorkerEntry::new("a", "h:1", "h:2"), t0), 101);
        assert_eq!(m.register(&WorkerEntry::new("b", "h:3", "h:4"), t0), 102);
        // Re-registering unchanged does not move the epoch.
        assert_eq!(m.register(&WorkerEntry::new("a", "h:1", "h:2"), t0), 102);
        assert!(m.heartbeat("a", t0 + Duration::from_secs(2)));
        assert!(m.tick(t0 + Duration::from_secs(3)).is_empty());
        assert_eq!(m.tick(t0 + Duration::from_secs(4)), vec!["b".to_string()]);
        assert_eq!(m.epoch(), 103);
        assert_eq!(m.live_members().iter().map(|w| w.id.as_str()).collect::<Vec<_>>(), vec!["a"]);
        // A lost worker's heartbeat is refused until it registers again.
        assert!(!m.heartbeat("b", t0 + Duration::from_secs(5)));
        assert!(!m.heartbeat("zzz", t0));
        // Coming back on a new port moves the epoch.
        assert_eq!(m.register(&WorkerEntry::new("b", "h:9", "h:4"), t0 + Duration::from_secs(5)), 104);
        assert_eq!(m.live_members().len(), 2);
    }

    #[test]
    fn a_draining_worker_leaves_the_ring_at_once_and_its_loss_moves_nothing_more() {
        let t0 = Instant::now();
        let mut m = Membership::new(Duration::from_secs(5), 100);
        m.register(&WorkerEntry::new("a", "h:1", "h:2"), t0);
        m.register(&WorkerEntry::new("b", "h:3", "h:4"), t0);
        assert!(m.set_draining("a"));
        assert_eq!(m.epoch(), 103);
        assert!(m.set_draining("a"), "saying it again moves nothing");
        assert_eq!(m.epoch(), 103);
        assert_eq!(m.live_members().iter().map(|w| w.id.as_str()).collect::<Vec<_>>(), ["b"]);
        assert!(m.heartbeat("a", t0), "it still beats while it hands its blocks off");
        m.heartbeat("b", t0 + Duration::from_secs(5));
        assert_eq!(m.tick(t0 + Duration::from_secs(6)), vec!["a".to_string()]);
        assert_eq!(m.epoch(), 103, "the ring did not change when the drained worker stopped");
        assert!(!m.set_draining("zz"));
    }

    #[test]
    fn a_workers_node_is_in_the_membership_and_a_new_node_moves_the_epoch() {
        let t0 = Instant::now();
        let mut m = Membership::new(Duration::from_secs(3), 100);
        let on_n1 = WorkerEntry { node: "n1".into(), ..WorkerEntry::new("a", "h:1", "h:2") };
        assert_eq!(m.register(&on_n1, t0), 101);
        assert_eq!(m.live_members()[0].node, "n1");
        assert_eq!(m.register(&on_n1, t0), 101);
        let on_n2 = WorkerEntry { node: "n2".into(), ..on_n1 };
        assert_eq!(m.register(&on_n2, t0), 102, "clients must learn the new node");
        assert_eq!(m.live_members()[0].node, "n2");
    }
}
