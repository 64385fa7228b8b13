//! The worker's last view of the cluster: the membership and the client-facing mount table
//! (secrets redacted by the master, exactly what any client gets) it last learnt, and when it
//! last heard from the master. `master_link` (or a sidecar's refresh loop) fills it; the data
//! plane hands it to a client that asks with a `View` frame, so that a client whose master is
//! unreachable can start from it. It lives in memory only: a worker restarted during a master
//! outage has no view to give until the master is back.

use std::sync::RwLock;
use std::sync::atomic::{AtomicI64, Ordering};

use strata_proto::{Membership, MountList, WorkerView};

#[derive(Debug, Default)]
pub struct LastView {
    view: RwLock<Option<(Membership, MountList)>>,
    /// Wall-clock ms of the last answer from the master (0: never).
    seen_ms: AtomicI64,
    /// Who answers: a client checks it before trusting a local socket to be this worker's.
    worker_id: String,
}

impl LastView {
    /// The view of the worker (or sidecar) `worker_id`, empty until the master is heard.
    pub fn new(worker_id: impl Into<String>) -> Self {
        Self { worker_id: worker_id.into(), ..Self::default() }
    }

    /// Replaces the view with what the master just said.
    pub fn set(&self, membership: Membership, mounts: MountList, now_ms: i64) {
        *self.view.write().unwrap_or_else(|p| p.into_inner()) = Some((membership, mounts));
        self.touch(now_ms);
    }

    /// Records that the master answered (a heartbeat) at `now_ms`.
    pub fn touch(&self, now_ms: i64) {
        self.seen_ms.fetch_max(now_ms, Ordering::Relaxed);
    }

    /// The membership held, if any (the hand-off's ring, the upkeep's quota shares).
    pub fn membership(&self) -> Option<Membership> {
        self.view.read().unwrap_or_else(|p| p.into_inner()).as_ref().map(|(m, _)| m.clone())
    }

    /// The epochs of the membership and the mount table held, if any.
    pub fn epochs(&self) -> Option<(u64, u64)> {
        let guard = self.view.read().unwrap_or_else(|p| p.into_inner());
        guard.as_ref().map(|(m, l)| (m.epoch, l.epoch))
    }

    /// The view as a `View` answer's payload, or `None` before the master was first heard.
    pub fn encoded(&self) -> Option<Vec<u8>> {
        let guard = self.view.read().unwrap_or_else(|p| p.into_inner());
        let (membership, mounts) = guard.as_ref()?;
        let view = WorkerView {
            membership: Some(membership.clone()),
            mounts: Some(mounts.clone()),
            master_seen_unix_ms: self.seen_ms.load(Ordering::Relaxed),
            worker_id: self.worker_id.clone(),
        };
        Some(view.to_bytes())
    }
}

#[cfg(test)]
mod tests {
    use strata_proto::{Member, MountInfo};

    use super::*;

    #[test]
    fn encodes_the_last_view_with_the_last_contact() {
        let view = LastView::new("w1");
        assert_eq!(view.encoded(), None, "nothing before the master was heard");
        let membership = Membership {
            epoch: 7,
            workers: vec![Member {
                id: "w1".into(),
                data_addr: "h:1".into(),
                suspect: false,
                node: "n1".into(),
                local_socket: "/run/strata/w1.sock".into(),
            }],
        };
        let mount = MountInfo {
            path: "/data".into(),
            uri: "s3://b/p".into(),
            options: [("secret_access_key".to_string(), "***".to_string())].into(),
            block_size: 4,
            metadata_ttl_ms: 10,
            read_replicas: 2,
            warnings: Vec::new(),
        };
        view.set(
            membership.clone(),
            MountList { epoch: 3, mounts: vec![mount], state_paths: Vec::new() },
            1_000,
        );
        view.touch(900);
        view.touch(2_000);
        assert_eq!(view.epochs(), Some((7, 3)));
        let back = WorkerView::from_bytes(&view.encoded().unwrap()).unwrap();
        assert_eq!(back.membership, Some(membership));
        assert_eq!(back.master_seen_unix_ms, 2_000, "the latest contact, never moving back");
        assert_eq!(back.worker_id, "w1", "who answers, for a client checking a local socket");
        assert_eq!(back.mounts.unwrap().mounts[0].options["secret_access_key"], "***");
    }
}
