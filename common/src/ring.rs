//! Consistent-hash placement ring with virtual nodes.
//!
//! Every client computes the owner of a block from the membership the master publishes, so no
//! read asks the master where a block lives. Workers are placed by their persistent id, not
//! their address, so a restarted worker (new port, same NVMe dir) keeps owning its blocks.

use xxhash_rust::xxh3::xxh3_64;

/// Virtual nodes per worker: enough for an even spread over a handful of workers.
pub const DEFAULT_VNODES: u32 = 128;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub id: String,
    /// `host:port` of the worker's data plane.
    pub data_addr: String,
    /// The node the worker runs on (`STRATA_NODE`), empty when unknown. Not part of
    /// placement: a worker's ring position depends on its id alone.
    pub node: String,
    /// The Unix socket a process on the worker's host reaches it at for short-circuit reads
    /// (`strata worker --socket`), empty when it serves none. Not part of placement.
    pub local_socket: String,
}

impl Member {
    /// A member whose node is unknown.
    pub fn new(id: impl Into<String>, data_addr: impl Into<String>) -> Self {
        Self { id: id.into(), data_addr: data_addr.into(), node: String::new(), local_socket: String::new() }
    }
}

#[derive(Debug, Clone, Default)]
pub struct Ring {
    epoch: u64,
    members: Vec<Member>,
    /// Sorted (hash, member index).
    points: Vec<(u64, usize)>,
}

impl Ring {
    pub fn new(epoch: u64, mut members: Vec<Member>, vnodes: u32) -> Self {
        members.sort_by(|a, b| a.id.cmp(&b.id));
        members.dedup_by(|a, b| a.id == b.id);
        let mut points = Vec::with_capacity(members.len() * vnodes as usize);
        for (i, m) in members.iter().enumerate() {
            for v in 0..vnodes {
                points.push((xxh3_64(format!("{}#{v}", m.id).as_bytes()), i));
            }
        }
        points.sort_unstable();
        Self { epoch, members, points }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn members(&self) -> &[Member] {
        &self.members
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    pub fn contains(&self, id: &str) -> bool {
        self.members.iter().any(|m| m.id == id)
    }

    /// The fraction of the hash space `id` is the first owner of (0 for a non-member): the
    /// share of the ring's blocks it is expected to hold, e.g. of a mount's cluster-wide quota.
    pub fn share(&self, id: &str) -> f64 {
        let Some(idx) = self.members.iter().position(|m| m.id == id) else { return 0.0 };
        if self.members.len() == 1 {
            return 1.0;
        }
        let last = self.points.last().map_or(0, |p| p.0);
        let mut owned: u128 = 0;
        let mut prev = last;
        for &(hash, member) in &self.points {
            // A point owns the hashes after the point before it, up to and including itself
            // (see `owners`), wrapping around at the first point.
            if member == idx {
                owned += u128::from(hash.wrapping_sub(prev));
            }
            prev = hash;
        }
        owned as f64 / (u64::MAX as f64 + 1.0)
    }

    /// Up to `n` distinct members in ring order starting at `hash`: the first is the owner,
    /// the rest are the failover order.
    pub fn owners(&self, hash: u64, n: usize) -> Vec<&Member> {
        let n = n.min(self.members.len());
        let mut out: Vec<&Member> = Vec::with_capacity(n);
        if n == 0 {
            return out;
        }
        let start = self.points.partition_point(|(h, _)| *h < hash);
        for step in 0..self.points.len() {
            let (_, idx) = self.points[(start + step) % self.points.len()];
            let m = &self.members[idx];
            if !out.iter().any(|o| o.id == m.id) {
                out.push(m);
                if out.len() == n {
                    break;
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(n: usize) -> Vec<Member> {
        (0..n).map(|i| Member::new(format!("w{i}"), format!("127.0.0.1:{}", 1000 + i))).collect()
    }

    #[test]
    fn owners_are_distinct_and_stable() {
        let ring = Ring::new(1, members(3), DEFAULT_VNODES);
        for h in [0u64, 1, u64::MAX, 12345678901234] {
            let o = ring.owners(h, 5);
            assert_eq!(o.len(), 3);
            assert_ne!(o[0].id, o[1].id);
            assert_ne!(o[1].id, o[2].id);
            assert_eq!(ring.owners(h, 1)[0].id, o[0].id);
        }
        assert!(Ring::new(1, vec![], 8).owners(5, 1).is_empty());
    }

    #[test]
    fn a_leave_moves_only_the_leavers_share() {
        let before = Ring::new(1, members(4), DEFAULT_VNODES);
        let mut m = members(4);
        m.remove(2);
        let after = Ring::new(2, m, DEFAULT_VNODES);
        let mut moved = 0;
        let mut owned_by_leaver = 0;
        for i in 0..20_000u64 {
            let h = xxh3_64(&i.to_le_bytes());
            let a = &before.owners(h, 1)[0].id;
            let b = &after.owners(h, 1)[0].id;
            if a == "w2" {
                owned_by_leaver += 1;
            }
            if a != b {
                moved += 1;
                assert_eq!(a, "w2", "only the leaver's blocks move");
            }
        }
        assert_eq!(moved, owned_by_leaver);
        // Even spread: each of 4 workers owns roughly a quarter.
        assert!((3_500..6_500).contains(&owned_by_leaver), "{owned_by_leaver}");
    }

    #[test]
    fn shares_sum_to_one_and_match_where_hashes_land() {
        let ring = Ring::new(1, members(4), DEFAULT_VNODES);
        let shares: Vec<f64> = ring.members().iter().map(|m| ring.share(&m.id)).collect();
        assert!((shares.iter().sum::<f64>() - 1.0).abs() < 1e-9, "{shares:?}");
        let mut landed = [0u32; 4];
        for i in 0..40_000u64 {
            let owner = &ring.owners(xxh3_64(&i.to_le_bytes()), 1)[0].id;
            landed[ring.members().iter().position(|m| &m.id == owner).unwrap()] += 1;
        }
        for (share, landed) in shares.iter().zip(landed) {
            let seen = f64::from(landed) / 40_000.0;
            assert!((share - seen).abs() < 0.02, "share {share}, {seen} of the hashes");
        }
        assert_eq!(ring.share("nobody"), 0.0);
        assert_eq!(Ring::new(1, members(1), 8).share("w0"), 1.0);
    }
}
