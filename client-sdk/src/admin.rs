//! Admin and cluster-wide calls — mounts, pins, cache TTLs, frees, status, block locations,
//! load jobs (`jobs`), tokens (`tokens`): each a thin wrapper over one master RPC, which checks
//! the caller's role. Kept apart from [`Client`]'s reads, stats and writes, which every front
//! end uses; get one with [`Client::admin`].

use std::collections::HashMap;
use std::time::Duration;

use strata_proto::leader::LeaderChannel;
use strata_proto::master_client::MasterClient;
use strata_proto::{AddMountRequest, ClusterStatus, Empty, RemoveMountRequest};

use crate::{
    CacheTtlInfo, Client, ClientError, FreeResponse, LocateResponse, MountInfo, PinInfo, PinTier, Result,
};

/// Admin and cluster-wide calls, sharing its [`Client`]'s connection to the master.
#[derive(Clone)]
pub struct AdminClient {
    client: Client,
}

impl Client {
    /// The admin calls (mounts, pins, TTLs, frees, status, jobs, tokens) over this client's
    /// connection to the master.
    pub fn admin(&self) -> AdminClient {
        AdminClient { client: self.clone() }
    }
}

/// A wait as the master takes it: zero asks for its default, anything else at least 1 ms.
fn wait_ms(wait: Duration) -> u64 {
    if wait.is_zero() { 0 } else { wait.as_millis().clamp(1, u64::MAX as u128) as u64 }
}

impl AdminClient {
    pub(crate) fn master(&self) -> MasterClient<LeaderChannel> {
        self.client.inner.master.client()
    }

    pub(crate) fn rpc_err(&self, rpc: &'static str) -> impl Fn(tonic::Status) -> ClientError + '_ {
        self.client.inner.master.rpc_err(rpc)
    }

    /// The mount table, asked of the master now (secret options redacted).
    pub async fn mounts(&self) -> Result<Vec<MountInfo>> {
        let resp = self.master().list_mounts(Empty {}).await.map_err(self.rpc_err("list_mounts"))?;
        Ok(resp.into_inner().mounts.into_iter().map(MountInfo::from).collect())
    }

    pub async fn add_mount(
        &self,
        path: &str,
        uri: &str,
        options: HashMap<String, String>,
    ) -> Result<MountInfo> {
        let req = AddMountRequest { path: path.to_string(), uri: uri.to_string(), options };
        let info = self.master().add_mount(req).await.map_err(self.rpc_err("add_mount"))?.into_inner();
        self.client.refresh_view().await?;
        Ok(MountInfo::from(info))
    }

    pub async fn remove_mount(&self, path: &str) -> Result<()> {
        self.master()
            .remove_mount(RemoveMountRequest { path: path.to_string() })
            .await
            .map_err(self.rpc_err("remove_mount"))?;
        self.client.inner.metadata.forget_all();
        self.client.refresh_view().await
    }

    /// Pins the cached blocks of the files under `path` in `tier` of every worker (NVMe when
    /// unspecified), until [`unpin`](Self::unpin) or for `ttl`. Refused when the pins of the
    /// tier would exceed its capacity across the live workers. Answers once every live worker
    /// has the pin in force, or after 10 s: `applied` says which have not (see
    /// [`pin_waiting`](Self::pin_waiting)).
    pub async fn pin(&self, path: &str, tier: PinTier, ttl: Option<Duration>) -> Result<PinInfo> {
        self.pin_waiting(path, tier, ttl, Duration::ZERO).await
    }

    /// [`pin`](Self::pin), waiting at most `wait` (zero: the master's default, 10 s) for every
    /// live worker to have the pin in force.
    pub async fn pin_waiting(
        &self,
        path: &str,
        tier: PinTier,
        ttl: Option<Duration>,
        wait: Duration,
    ) -> Result<PinInfo> {
        let req = strata_proto::PinRequest {
            path: path.to_string(),
            tier: tier as i32,
            ttl_ms: ttl.map_or(0, |d| d.as_millis().min(u64::MAX as u128) as u64),
            wait_ms: wait_ms(wait),
        };
        Ok(self.master().pin(req).await.map_err(self.rpc_err("pin"))?.into_inner())
    }

    /// Removes the pin of exactly `path`; answers as [`pin`](Self::pin) does.
    pub async fn unpin(&self, path: &str) -> Result<PinInfo> {
        self.unpin_waiting(path, Duration::ZERO).await
    }

    /// [`unpin`](Self::unpin), waiting at most `wait` as [`pin_waiting`](Self::pin_waiting).
    pub async fn unpin_waiting(&self, path: &str, wait: Duration) -> Result<PinInfo> {
        let req = strata_proto::UnpinRequest { path: path.to_string(), wait_ms: wait_ms(wait) };
        Ok(self.master().unpin(req).await.map_err(self.rpc_err("unpin"))?.into_inner())
    }

    /// Sets the cache TTL of the blocks under `path` (a file or a directory): every worker drops
    /// one that long after it stored it, whatever its mount's `cache_ttl`. `None` clears the
    /// path's own TTL (`NotFound` when it has none). Answers as [`pin`](Self::pin) does.
    pub async fn set_cache_ttl(&self, path: &str, ttl: Option<Duration>) -> Result<CacheTtlInfo> {
        self.set_cache_ttl_waiting(path, ttl, Duration::ZERO).await
    }

    /// [`set_cache_ttl`](Self::set_cache_ttl), waiting at most `wait` as
    /// [`pin_waiting`](Self::pin_waiting).
    pub async fn set_cache_ttl_waiting(
        &self,
        path: &str,
        ttl: Option<Duration>,
        wait: Duration,
    ) -> Result<CacheTtlInfo> {
        let cache_ttl_ms = ttl.map_or(0, |d| (d.as_millis() as u64).max(1));
        let req =
            strata_proto::SetCacheTtlRequest { path: path.to_string(), cache_ttl_ms, wait_ms: wait_ms(wait) };
        Ok(self.master().set_cache_ttl(req).await.map_err(self.rpc_err("set_cache_ttl"))?.into_inner())
    }

    /// Every path's own cache TTL.
    pub async fn cache_ttls(&self) -> Result<Vec<CacheTtlInfo>> {
        let list = self.master().list_cache_ttls(Empty {}).await.map_err(self.rpc_err("list_cache_ttls"))?;
        Ok(list.into_inner().ttls)
    }

    pub async fn pins(&self) -> Result<Vec<PinInfo>> {
        Ok(self.master().list_pins(Empty {}).await.map_err(self.rpc_err("list_pins"))?.into_inner().pins)
    }

    /// Drops the cached blocks of the files under `path` from every live worker now (waiting up
    /// to `wait` for all of them); nothing moves from the UFS until they are read again.
    /// Refused for a pinned path.
    pub async fn free(&self, path: &str, wait: Duration) -> Result<FreeResponse> {
        let req = strata_proto::FreeRequest {
            path: path.to_string(),
            wait_ms: wait.as_millis().clamp(1, u64::MAX as u128) as u64,
        };
        Ok(self.master().free(req).await.map_err(self.rpc_err("free"))?.into_inner())
    }

    pub async fn status(&self) -> Result<ClusterStatus> {
        Ok(self.master().status(Empty {}).await.map_err(self.rpc_err("status"))?.into_inner())
    }

    /// Which workers (and nodes) hold how many blocks and bytes of the files under `path` (a
    /// file, or a directory and everything below it), from the master's block map, the
    /// workers holding most first. A path under no mount is `NotFound`.
    pub async fn locate(&self, path: &str) -> Result<LocateResponse> {
        let req = strata_proto::LocateRequest { path: path.to_string() };
        Ok(self.master().locate(req).await.map_err(self.rpc_err("locate"))?.into_inner())
    }

    /// Which workers hold which blocks of a file (from the master's block map), every page.
    pub async fn block_locations(&self, path: &str) -> Result<strata_proto::BlockLocations> {
        let mut from_index = 0;
        let mut all: Option<strata_proto::BlockLocations> = None;
        loop {
            let req = strata_proto::BlockLocationsRequest { path: path.to_string(), from_index, limit: 0 };
            let page = self
                .master()
                .get_block_locations(req)
                .await
                .map_err(self.rpc_err("get_block_locations"))?
                .into_inner();
            let next = page.next_index;
            match &mut all {
                Some(all) if all.version == page.version => all.blocks.extend(page.blocks),
                // The file changed between two pages: start over on the new version.
                Some(_) if from_index > 0 => {
                    from_index = 0;
                    all = None;
                    continue;
                }
                _ => all = Some(page),
            }
            if next == 0 {
                return Ok(all.expect("at least one page"));
            }
            from_index = next;
        }
    }
}
