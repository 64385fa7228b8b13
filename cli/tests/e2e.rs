//! The CLI's end-to-end tests, one module per file beside this one, built as one test binary
//! (see Cargo.toml). nextest still runs every test in a process of its own.

mod cli;
mod common;
mod dashboard;
mod drain;
mod fence;
mod gray;
mod ha;
mod k8s_manifests;
mod outage;
mod pins;
mod sidecar;
mod writeback;
