//! The Strata master: worker membership, the mount table, a metadata cache over the UFS, the
//! block map, and the durable store behind them. It is never on the data path of a read.

mod blockmap;
pub mod config;
pub mod jobs;
mod membership;
pub mod metrics_defs;
pub mod mounts;
mod reports;
pub mod schedule;
mod service;
pub mod store;
mod warmup;

pub use config::MasterConfig;
pub use service::{Master, MasterError, MasterHandle};
