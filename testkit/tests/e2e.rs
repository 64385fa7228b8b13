//! The end-to-end tests, one module per file beside this one, built as one test binary: 25
//! binaries each linking the whole cluster took minutes of CI's build to link (see Cargo.toml).
//! nextest still runs every test in a process of its own.

mod auth;
mod batched;
mod cache_control;
mod cluster;
mod copy;
mod fanout;
mod full_disk;
mod handoff;
mod lineage;
mod outage;
mod prefetch;
mod qos;
mod quotas;
mod rdma;
mod read_replicas;
mod rebalance;
mod scale;
mod shortcircuit;
mod small_files;
mod tls;
mod ufs_faults;
mod ufs_suite;
mod warmup;
mod writeback;
mod writes;
