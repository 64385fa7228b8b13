//! The cluster as a sidecar worker's upstream: a block the sidecar misses is read from its
//! owner on the ring, with the client's failover to the next workers. (The trait is in
//! `strata_common::upstream`, so the worker does not depend on this crate.)

use async_trait::async_trait;
use bytes::Bytes;
use strata_common::upstream::{Upstream, UpstreamError, UpstreamRead};

use std::time::Duration;

use crate::{Client, ClientConfig, FileInfo, Result};

pub struct ClusterUpstream {
    client: Client,
}

impl ClusterUpstream {
    pub fn new(client: Client) -> Self {
        Self { client }
    }

    /// A client of the cluster at `master_addr` for a sidecar: it never routes through a
    /// sidecar socket itself (the pod's environment may name the sidecar's own), presents the
    /// sidecar's `token` (role `worker`), and one block request gives up after
    /// `request_timeout` (then the sidecar reads the UFS).
    pub async fn connect(
        master_addr: &str,
        token: Option<String>,
        request_timeout: Duration,
    ) -> Result<Self> {
        Self::connect_tls(master_addr, token, request_timeout, crate::TlsConfig::from_env()).await
    }

    /// [`connect`](Self::connect) with these TLS settings (the sidecar's own) instead of the
    /// environment's.
    pub async fn connect_tls(
        master_addr: &str,
        token: Option<String>,
        request_timeout: Duration,
        tls: crate::TlsConfig,
    ) -> Result<Self> {
        let mut config = ClientConfig::new(master_addr);
        config.sidecar_socket = None;
        config.request_timeout = request_timeout;
        config.tls = tls;
        config.token = token.map(crate::Token);
        Ok(Self::new(Client::connect(config).await?))
    }
}

#[async_trait]
impl Upstream for ClusterUpstream {
    async fn read_block(&self, read: UpstreamRead<'_>) -> std::result::Result<Bytes, UpstreamError> {
        let info = FileInfo {
            path: read.path.to_string(),
            is_dir: false,
            size: read.file_size,
            version: read.version.to_string(),
            mtime_ms: 0,
            block_size: read.block_size,
            file_id: read.file_id.to_string(),
            holders: Vec::new(),
            persist: crate::Persist::Persisted,
        };
        self.client
            .read_range_of(&info, read.index * read.block_size, read.len)
            .await
            .map_err(|e| UpstreamError(e.to_string()))
    }
}
