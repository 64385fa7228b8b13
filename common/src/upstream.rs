//! Where a sidecar worker fetches a missing block before the UFS: the cluster's workers. The
//! trait lives here so that the worker (which asks) and the client SDK (which answers, reading
//! from the ring owners) need not depend on each other.

use async_trait::async_trait;
use bytes::Bytes;

/// One whole block asked for, at the version the client read.
#[derive(Debug, Clone, Copy)]
pub struct UpstreamRead<'a> {
    /// Strata path of the file.
    pub path: &'a str,
    /// The UFS identity blocks are keyed (and placed on the ring) by.
    pub file_id: &'a str,
    pub version: &'a str,
    pub file_size: u64,
    pub block_size: u64,
    pub index: u64,
    /// Length of the whole block.
    pub len: u64,
}

#[derive(Debug, thiserror::Error)]
#[error("upstream cannot serve the block: {0}")]
pub struct UpstreamError(pub String);

/// An error is never final for the asker: it reads the UFS instead.
#[async_trait]
pub trait Upstream: Send + Sync + 'static {
    async fn read_block(&self, read: UpstreamRead<'_>) -> Result<Bytes, UpstreamError>;
}

/// How a worker reaches its peers' data planes for a hand-off (the client SDK dials them, with
/// the cluster's TLS and the worker's token): one request frame out, the answer's payload (at
/// most `max` bytes) back.
#[async_trait]
pub trait PeerLink: Send + Sync + 'static {
    async fn exchange(&self, addr: &str, frame: &[u8], req_id: u64, max: u64)
    -> Result<Bytes, UpstreamError>;
}
