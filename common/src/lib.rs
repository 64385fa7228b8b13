//! Vocabulary shared by every Strata crate: paths, block keys and ranges, the placement ring,
//! the data-plane frame format and the error kinds that cross process boundaries.
//!
//! This crate must stay free of tonic, opendal and foyer: it is what the client, the master and
//! the worker agree on, and it is cheap to depend on. It also holds the few runtime helpers
//! both sides of a connection or every service share: descriptor passing, background loops, the
//! clock.

pub mod background;
pub mod block;
pub mod clock;
pub mod error;
pub mod fdpass;
pub mod frame;
pub mod mount_options;
pub mod path;
pub mod qos;
pub mod ring;
pub mod sched;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod units;
pub mod upstream;

pub use block::{BlockKey, BlockSlice, block_slices};
pub use clock::{Clock, SharedClock};
pub use error::ErrorKind;
pub use mount_options::{MountMode, MountOptions, OnFull};
pub use qos::QosClass;
pub use ring::{Member, Ring};

/// Default block size of a mount: 4 MiB.
pub const DEFAULT_BLOCK_SIZE: u64 = 4 * 1024 * 1024;
/// Largest block size a mount may choose; frames and buffers are sized against it.
pub const MAX_BLOCK_SIZE: u64 = 256 * 1024 * 1024;
/// Default metadata TTL of a mount, in milliseconds.
pub const DEFAULT_METADATA_TTL_MS: u64 = 10_000;
/// Port of the master's gRPC endpoint unless configured otherwise.
pub const DEFAULT_MASTER_PORT: u16 = 19998;
/// Where clients and workers look for the master unless told otherwise (`--master`,
/// `STRATA_MASTER`): this host, on [`DEFAULT_MASTER_PORT`].
pub const DEFAULT_MASTER_ADDR: &str = "127.0.0.1:19998";

/// Environment variable naming the node (host, Kubernetes node name) a process runs on: a
/// worker reports it to the master, a client prefers read replicas on the same node. In
/// Kubernetes it comes from the downward API (`spec.nodeName`).
pub const NODE_ENV: &str = "STRATA_NODE";

/// The node [`NODE_ENV`] names, when it is set and not blank.
pub fn node_from_env() -> Option<String> {
    std::env::var(NODE_ENV).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
}

/// The masters named by a `--master` / `STRATA_MASTER` value: one `host:port`, or several
/// separated by commas (the masters of an HA cluster, in the order to try them). Blanks around
/// entries are ignored; the list is deduplicated keeping the first occurrence. Every client of
/// the master (SDK, worker, CLI, Python) reads the value through this one function.
pub fn master_addrs(value: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for addr in value.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        if !out.iter().any(|known| known == addr) {
            out.push(addr.to_string());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_default_master_address_uses_the_default_port() {
        let addr: std::net::SocketAddr = super::DEFAULT_MASTER_ADDR.parse().unwrap();
        assert_eq!(addr.port(), super::DEFAULT_MASTER_PORT);
        assert!(addr.ip().is_loopback());
    }

    #[test]
    fn master_lists_split_on_commas_trimmed_and_deduplicated() {
        assert_eq!(super::master_addrs("a:1"), ["a:1"]);
        assert_eq!(super::master_addrs(" a:1, b:2,,a:1 ,c:3 "), ["a:1", "b:2", "c:3"]);
        assert!(super::master_addrs(" , ").is_empty());
    }
}
