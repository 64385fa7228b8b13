//! The Strata master: worker membership, the mount table, a metadata cache over the UFS, the
//! block map, load jobs with their schedules, and the durable store behind them. It is never on
//! the data path of a read.
//!
//! Modules import one way, each only from the layers below it:
//!
//! 1. `start`: [`Master::start`] opens the store, loads the state, builds the parts below,
//!    binds the servers, spawns the background loops, resumes jobs; `ha` does the same for
//!    each term a master leads with etcd, and answers as a standby between terms;
//! 2. `rpc`: the gRPC adapter, the only module that knows protobuf, behind `auth` (the token
//!    check every call passes first, and the accepted tokens);
//! 3. `runner`: load jobs and schedules with their I/O (listing, store, notifications);
//! 4. `metadata` (mount table and metadata cache) and `cluster` (membership and block map);
//! 5. `error`: what the layers above fail with, wrapping the errors of those below;
//! 6. `store`: the durable records in redb, or in etcd with the leader election;
//! 7. without I/O: the state machines `jobs`, `schedule`, `membership`, `blockmap`, the
//!    `mounts` table, `filter`, `reports`; and `config`, `locks`, `metrics_defs`.

pub mod auth;
mod blockmap;
mod cluster;
pub mod config;
mod error;
mod filter;
mod ha;
mod jobs;
pub mod lineage;
mod locks;
mod membership;
mod metadata;
pub mod metrics_defs;
mod mounts;
pub mod pins;
mod reports;
mod rpc;
mod runner;
mod schedule;
mod start;
mod store;
mod writeback;

pub use config::MasterConfig;

/// The block map and what workers report, for the benchmark that measures its memory
/// (`bench/src/blockmap_bench.rs`); not an API.
#[doc(hidden)]
pub mod for_benchmarks {
    pub use crate::blockmap::BlockMap;
    pub use crate::reports::{BlockReport, Tier};
}
pub use start::{Master, MasterError, MasterHandle};
pub use store::StoreError;
