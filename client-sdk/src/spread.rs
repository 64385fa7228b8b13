//! Which of a block's read replicas a read asks first.
//!
//! A mount's `read_replicas=N` lets a client read a block from any of its first N ring owners.
//! The first one asked is chosen among those N (the *candidates*: the ones neither the master
//! nor this client suspects) in this order:
//!
//! 1. a candidate on the client's own node (`ClientConfig::node`, `STRATA_NODE`), when there is
//!    one: its bytes never cross the network between nodes;
//! 2. otherwise the *power of two choices* on this client's own reads in flight per worker:
//!    two candidates drawn at random, the one with fewer block reads in flight wins (a tie goes
//!    to the first drawn, itself random). Two random choices keep every worker's queue within
//!    a small constant of the others' without any coordination between clients, where one
//!    random choice lets queues drift apart (Mitzenmacher, "The Power of Two Choices in
//!    Randomized Load Balancing", 2001); counting only this client's reads needs no state from
//!    anyone else, and a worker that is slow for this client has more of its reads in flight.
//!
//! The chosen one goes first; the others follow in ring order (trusted owners, then suspects)
//! for failover and hedging, exactly as with one read replica. With N = 1, or no candidate
//! beside the first owner, the order is the ring's and nothing here is consulted.
//!
//! Invariant: the count of a worker in [`InFlight`] is the number of [`InFlightGuard`]s of its
//! address alive, so a read that is dropped (a hedge that lost, a cancelled read) leaves the
//! count as it found it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rand::Rng;

/// Block reads this client has in flight, per worker data address.
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    counts: Mutex<HashMap<String, Arc<AtomicUsize>>>,
}

/// One block read in flight to a worker; counted until dropped.
#[derive(Debug)]
pub(crate) struct InFlightGuard(Arc<AtomicUsize>);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl InFlight {
    /// Counts a read to `addr` until the guard is dropped.
    pub(crate) fn track(&self, addr: &str) -> InFlightGuard {
        let count = {
            let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
            match counts.get(addr) {
                Some(c) => c.clone(),
                None => counts.entry(addr.to_string()).or_default().clone(),
            }
        };
        count.fetch_add(1, Ordering::Relaxed);
        InFlightGuard(count)
    }

    /// Reads in flight to `addr` now.
    pub(crate) fn get(&self, addr: &str) -> usize {
        let counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        counts.get(addr).map_or(0, |c| c.load(Ordering::Relaxed))
    }
}

/// What the choice knows of one candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Candidate {
    /// On the client's own node.
    pub local: bool,
    /// This client's block reads in flight to it.
    pub in_flight: usize,
}

/// The candidate to ask first (an index into `candidates`, which must not be empty): a local
/// one if any (the power of two choices among several), else the power of two choices among
/// all.
pub(crate) fn choose(candidates: &[Candidate], rng: &mut impl Rng) -> usize {
    debug_assert!(!candidates.is_empty(), "a block has at least one owner to ask");
    let local: Vec<usize> = (0..candidates.len()).filter(|&i| candidates[i].local).collect();
    let pool: Vec<usize> = if local.is_empty() { (0..candidates.len()).collect() } else { local };
    if pool.len() < 2 {
        return pool.first().copied().unwrap_or(0);
    }
    let a = rng.random_range(0..pool.len());
    // A second draw among the others: two distinct candidates.
    let b = (a + rng.random_range(1..pool.len())) % pool.len();
    let (a, b) = (pool[a], pool[b]);
    if candidates[b].in_flight < candidates[a].in_flight { b } else { a }
}

/// The asking order of a block's owners: `trusted` owners in ring order, then `suspect` ones;
/// the first `read_replicas` ring owners that are trusted are the candidates, and the chosen
/// one moves to the front. `ring_rank` says where each trusted owner is in ring order
/// (0 = the first owner), `candidate` describes it.
pub(crate) fn asking_order<T: Copy>(
    trusted: Vec<(T, usize, Candidate)>,
    suspect: Vec<T>,
    read_replicas: usize,
    rng: &mut impl Rng,
) -> (Vec<T>, Option<Candidate>) {
    let candidates: Vec<usize> = (0..trusted.len()).filter(|&i| trusted[i].1 < read_replicas).collect();
    let mut order: Vec<T> = trusted.iter().map(|(t, _, _)| *t).collect();
    // Candidates are a prefix of the trusted owners (both in ring order): one candidate, or
    // none, leaves the ring's order as it is.
    let pick = if candidates.len() > 1 {
        let described: Vec<Candidate> = candidates.iter().map(|&i| trusted[i].2).collect();
        let pick = candidates[choose(&described, rng)];
        let first = order.remove(pick);
        order.insert(0, first);
        Some(pick)
    } else {
        candidates.first().copied()
    };
    order.extend(suspect);
    (order, pick.map(|i| trusted[i].2))
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    fn c(in_flight: usize) -> Candidate {
        Candidate { local: false, in_flight }
    }

    #[test]
    fn the_less_loaded_of_two_wins_every_time() {
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..200 {
            assert_eq!(choose(&[c(3), c(1)], &mut rng), 1);
            assert_eq!(choose(&[c(0), c(5)], &mut rng), 0);
        }
    }

    #[test]
    fn equal_loads_are_split_about_evenly() {
        let mut rng = StdRng::seed_from_u64(11);
        let mut wins = [0u32; 2];
        for _ in 0..10_000 {
            wins[choose(&[c(2), c(2)], &mut rng)] += 1;
        }
        assert!(wins.iter().all(|&w| (4_500..=5_500).contains(&w)), "{wins:?}");
    }

    #[test]
    fn among_many_the_most_loaded_never_wins_and_the_least_often_does() {
        // With two distinct draws, the most loaded of four loses every comparison it is in;
        // the least loaded wins every one it is in (half of the draws).
        let mut rng = StdRng::seed_from_u64(3);
        let loads = [c(9), c(0), c(4), c(4)];
        let mut wins = [0u32; 4];
        for _ in 0..12_000 {
            wins[choose(&loads, &mut rng)] += 1;
        }
        assert_eq!(wins[0], 0, "{wins:?}");
        assert!((5_500..=6_500).contains(&wins[1]), "{wins:?}");
    }

    #[test]
    fn a_local_candidate_wins_whatever_its_load() {
        let mut rng = StdRng::seed_from_u64(5);
        let loads = [c(0), Candidate { local: true, in_flight: 50 }, c(0)];
        for _ in 0..100 {
            assert_eq!(choose(&loads, &mut rng), 1);
        }
        // Two local ones: the less loaded of them.
        let loads = [Candidate { local: true, in_flight: 8 }, c(0), Candidate { local: true, in_flight: 2 }];
        for _ in 0..100 {
            assert_eq!(choose(&loads, &mut rng), 2);
        }
        assert_eq!(choose(&[c(4)], &mut rng), 0);
    }

    #[test]
    fn only_the_first_read_replicas_are_candidates_and_the_rest_keep_ring_order() {
        let mut rng = StdRng::seed_from_u64(1);
        // Ring order a, b, c, d; b is suspect. With 2 read replicas the candidates are a
        // alone among the trusted (b is suspect): no choice, ring order, suspects last.
        let trusted = vec![("a", 0, c(5)), ("c", 2, c(0)), ("d", 3, c(0))];
        let (order, chosen) = asking_order(trusted.clone(), vec!["b"], 2, &mut rng);
        assert_eq!(order, ["a", "c", "d", "b"]);
        assert_eq!(chosen, Some(c(5)));
        // With 3, a and c are candidates and c (idle) wins; d and the suspect follow.
        let (order, _) = asking_order(trusted.clone(), vec!["b"], 3, &mut rng);
        assert_eq!(order, ["c", "a", "d", "b"]);
        // One read replica: the ring's order whatever the loads.
        let (order, _) = asking_order(trusted, vec!["b"], 1, &mut rng);
        assert_eq!(order, ["a", "c", "d", "b"]);
        // A first owner that is suspect leaves the second as the lone candidate: it goes first.
        let trusted = vec![("b", 1, c(0)), ("c", 2, c(0))];
        let (order, _) = asking_order(trusted, vec!["a"], 2, &mut rng);
        assert_eq!(order, ["b", "c", "a"]);
    }

    #[test]
    fn in_flight_counts_follow_the_guards() {
        let f = InFlight::default();
        let a = f.track("h:1");
        let b = f.track("h:1");
        let _c = f.track("h:2");
        assert_eq!((f.get("h:1"), f.get("h:2"), f.get("h:3")), (2, 1, 0));
        drop(a);
        drop(b);
        assert_eq!(f.get("h:1"), 0);
    }
}
