//! Grants: a block range handed to a reader as something it reads itself instead of bytes sent
//! through the socket — a file descriptor (short-circuit, `fd`) or a registered memory region
//! (RDMA, `rdma`) — held by a lease until the reader releases it or it expires (`lease`).
//!
//! The data plane owns this service and asks it for the kind of grant the `OpenBlock` frame
//! names; which socket the request came on decides nothing here (the data plane refuses a
//! descriptor grant where it cannot pass a descriptor). Grants read through the storage API
//! ([`BlockService`]) like any read, so they count as foreground reads and share its single
//! flight.

mod fd;
mod lease;
mod rdma;

use std::os::fd::OwnedFd;
use std::sync::Arc;

use bytes::Bytes;
use strata_common::frame::{BlockGrant, GrantHandle, GrantKind, RdmaEndpoint, RemoteRead, Source};
use strata_common::{ErrorKind, SharedClock};
use thiserror::Error;
use tracing::debug;

use crate::blocks::{BlockRead, BlockService};
use crate::config::WorkerConfig;
use crate::error::ServeError;
use crate::metrics_defs as m;

pub use fd::{FdGrants, ShortCircuitConfig};
pub use lease::{Lease, LeaseError, Leases};
pub use rdma::RdmaError;
use rdma::RdmaGrants;

/// Why a grant was not given; travels as an error frame.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum GrantError {
    #[error(transparent)]
    Serve(#[from] ServeError),
    /// Grants of this kind are off, or their limits are reached: the reader should read the
    /// bytes the ordinary way.
    #[error("{0}")]
    Refused(String),
    /// A no-copy grant asked for a block that only a copy could grant (in DRAM, not on NVMe,
    /// no kept shared-memory copy): about this block only, read it the ordinary way.
    #[error("{0}: only a copy could grant it (a DRAM block); read it framed")]
    WouldCopy(String),
}

impl GrantError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            GrantError::Serve(e) => e.kind(),
            GrantError::Refused(_) => ErrorKind::Unavailable,
            // Not temporary: the reader goes on asking for grants of other blocks.
            GrantError::WouldCopy(_) => ErrorKind::ResourceExhausted,
        }
    }
}

/// A grant given: the answer, where the bytes were found, and for a descriptor grant the
/// descriptor to pass with it.
pub struct Granted {
    pub grant: BlockGrant,
    pub source: Source,
    pub fd: Option<Arc<OwnedFd>>,
}

pub struct Grants {
    fd: FdGrants,
    rdma: Option<RdmaGrants>,
}

impl Grants {
    /// The grants a worker configured with `config` serves.
    pub fn from_config(config: &WorkerConfig, clock: SharedClock) -> Result<Self, RdmaError> {
        Ok(Self {
            fd: FdGrants::new(config.into(), clock.clone()),
            rdma: RdmaGrants::from_config(&config.rdma, clock)?,
        })
    }

    /// Descriptor grants only, with `config` (a sidecar, tests).
    pub fn fd_only(config: ShortCircuitConfig, clock: SharedClock) -> Self {
        Self { fd: FdGrants::new(config, clock), rdma: None }
    }

    pub fn fd(&self) -> &FdGrants {
        &self.fd
    }

    /// Grants the range `r` as `kind`.
    pub async fn open(
        &self,
        blocks: &BlockService,
        kind: GrantKind,
        r: &BlockRead,
    ) -> Result<Granted, GrantError> {
        match kind {
            GrantKind::Fd | GrantKind::FdNoCopy => {
                let (grant, fd, source) = self.fd.grant(blocks, r, kind == GrantKind::Fd).await?;
                Ok(Granted { grant, source, fd: Some(fd) })
            }
            GrantKind::Rdma => {
                let rdma = self.rdma()?;
                let (bytes, source) = blocks.read(r).await?;
                match rdma.grant(bytes) {
                    Ok(g) => {
                        metrics::counter!(m::RDMA_GRANTS, "result" => "granted").increment(1);
                        let grant = BlockGrant {
                            lease_id: g.lease.id,
                            ttl_ms: g.lease.ttl.as_millis() as u64,
                            len: g.len,
                            handle: GrantHandle::Rdma { addr: g.addr, rkey: g.rkey },
                        };
                        Ok(Granted { grant, source, fd: None })
                    }
                    Err(e) => {
                        metrics::counter!(m::RDMA_GRANTS, "result" => "refused").increment(1);
                        debug!(path = %r.path, block = r.index, err = %e, "RDMA grant refused");
                        Err(GrantError::Refused(e.to_string()))
                    }
                }
            }
        }
    }

    /// Ends a lease early. A lease already over (expired, or never ours) is not an error.
    pub fn release(&self, kind: GrantKind, lease_id: u64) {
        match kind {
            GrantKind::Fd | GrantKind::FdNoCopy => self.fd.release(lease_id),
            GrantKind::Rdma => {
                if let Some(rdma) = &self.rdma {
                    rdma.release(lease_id);
                }
            }
        }
    }

    fn rdma(&self) -> Result<&RdmaGrants, GrantError> {
        self.rdma.as_ref().ok_or_else(|| GrantError::Refused("RDMA grants are off on this worker".into()))
    }

    /// What a NIC answers to a READ of granted memory (the emulated one-sided read).
    pub fn remote_read(&self, rr: &RemoteRead) -> Result<Bytes, (ErrorKind, String)> {
        let rdma = self.rdma().map_err(|e| (e.kind(), e.to_string()))?;
        rdma.read(rr)
    }

    /// Connects a queue pair of the RDMA device to a peer's; the returned value keeps it.
    pub fn connect_rdma(
        &self,
        remote: RdmaEndpoint,
    ) -> Result<(RdmaEndpoint, Box<dyn Send + Sync>), GrantError> {
        self.rdma()?.connect(remote).map_err(|e| GrantError::Refused(e.to_string()))
    }

    /// RDMA grants held now (0 when RDMA is off).
    pub fn rdma_grants_held(&self) -> usize {
        self.rdma.as_ref().map_or(0, |g| g.held())
    }

    /// Bytes of memory registered for RDMA grants now (0 when RDMA is off).
    pub fn rdma_registered_bytes(&self) -> u64 {
        self.rdma.as_ref().map_or(0, |g| g.registered_bytes())
    }
}
