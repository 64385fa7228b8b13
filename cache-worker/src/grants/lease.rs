//! Leases on granted block ranges (`Op::OpenBlock`): short-circuit file descriptors and RDMA
//! regions.
//!
//! A grant hands a reader something the worker must not reuse or free while the reader may
//! still look at it. The table holds one value per lease (whatever pins the bytes: a memfd, a
//! registered region, the block's `Bytes`); the value is dropped — and the pin with it — when
//! the reader releases the lease or when it expires. Expiry is what keeps a crashed reader
//! from pinning memory forever; it is checked on every grant, so an idle table needs no timer.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use strata_common::SharedClock;
use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaseError {
    /// Too many leases are held: the reader should read the bytes the ordinary way.
    #[error("{held} leases held, the limit is {limit}")]
    Exhausted { held: usize, limit: usize },
}

/// A granted lease: its id and how long it lasts from now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub id: u64,
    pub ttl: Duration,
}

pub struct Leases<T> {
    clock: SharedClock,
    ttl: Duration,
    limit: usize,
    inner: Mutex<Inner<T>>,
}

struct Inner<T> {
    next_id: u64,
    held: HashMap<u64, (Instant, T)>,
}

impl<T: Clone> Leases<T> {
    /// A table whose leases last `ttl` and of which at most `limit` are held at once.
    pub fn new(ttl: Duration, limit: usize, clock: SharedClock) -> Self {
        Self { clock, ttl, limit, inner: Mutex::new(Inner { next_id: 1, held: HashMap::new() }) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner<T>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Holds `value` until the lease is released or expires.
    pub fn grant(&self, value: T) -> Result<Lease, LeaseError> {
        let now = self.clock.now();
        let (expired, id) = {
            let mut inner = self.lock();
            let expired = take_expired(&mut inner.held, now);
            if inner.held.len() >= self.limit {
                return Err(LeaseError::Exhausted { held: inner.held.len(), limit: self.limit });
            }
            let id = inner.next_id;
            inner.next_id += 1;
            inner.held.insert(id, (now + self.ttl, value));
            (expired, id)
        };
        // Dropped outside the lock: dropping a value may unmap or deregister memory.
        drop(expired);
        Ok(Lease { id, ttl: self.ttl })
    }

    /// The value of a live lease (for a read that names it, such as an emulated RDMA READ).
    pub fn get(&self, id: u64) -> Option<T> {
        let inner = self.lock();
        let (deadline, value) = inner.held.get(&id)?;
        (*deadline > self.clock.now()).then(|| value.clone())
    }

    /// Ends a lease early; `false` when it was unknown or already over.
    pub fn release(&self, id: u64) -> bool {
        let value = self.lock().held.remove(&id);
        value.is_some_and(|(deadline, _)| deadline > self.clock.now())
    }

    /// Leases held now, expired ones not yet swept included.
    pub fn held(&self) -> usize {
        self.lock().held.len()
    }
}

fn take_expired<T>(held: &mut HashMap<u64, (Instant, T)>, now: Instant) -> Vec<T> {
    let ids: Vec<u64> =
        held.iter().filter(|(_, (deadline, _))| *deadline <= now).map(|(id, _)| *id).collect();
    ids.into_iter().filter_map(|id| held.remove(&id)).map(|(_, v)| v).collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use strata_common::clock::{ManualClock, system};

    use super::*;

    #[test]
    fn a_value_is_held_until_released_and_then_dropped() {
        let leases = Leases::new(Duration::from_secs(60), 10, system());
        let pinned = Arc::new(5u8);
        let lease = leases.grant(pinned.clone()).unwrap();
        assert_eq!(Arc::strong_count(&pinned), 2);
        assert_eq!(leases.get(lease.id).as_deref(), Some(&5));
        assert!(leases.release(lease.id));
        assert_eq!(Arc::strong_count(&pinned), 1, "released: the pin is gone");
        assert!(!leases.release(lease.id), "a second release is a no-op");
        assert_eq!(leases.get(lease.id), None);
    }

    #[test]
    fn expired_leases_are_not_served_and_are_swept_by_the_next_grant() {
        let clock = ManualClock::new();
        let leases = Leases::new(Duration::from_millis(20), 10, clock.clone());
        let pinned = Arc::new(());
        let old = leases.grant(pinned.clone()).unwrap();
        clock.advance(Duration::from_millis(19));
        assert_eq!(leases.get(old.id), Some(pinned.clone()), "live until its ttl");
        clock.advance(Duration::from_millis(1));
        assert_eq!(leases.get(old.id), None, "an expired lease names nothing");
        assert_eq!(Arc::strong_count(&pinned), 2, "not yet swept");
        let new = leases.grant(Arc::new(())).unwrap();
        assert_ne!(new.id, old.id);
        assert_eq!(Arc::strong_count(&pinned), 1, "swept by the grant");
        assert_eq!(leases.held(), 1);
    }

    #[test]
    fn the_limit_refuses_new_leases_until_one_ends() {
        let leases = Leases::new(Duration::from_secs(60), 2, system());
        let a = leases.grant(1).unwrap();
        leases.grant(2).unwrap();
        assert_eq!(leases.grant(3), Err(LeaseError::Exhausted { held: 2, limit: 2 }));
        leases.release(a.id);
        assert!(leases.grant(3).is_ok());
    }
}
