//! RDMA reads: the control exchange on a pooled TCP connection, the bytes one-sided.
//!
//! [`RdmaTransport`] asks the worker for a block range as a grant (`OpenBlock` → a
//! [`BlockGrant`] naming registered worker memory by `(addr, rkey)`), reads the bytes through a
//! [`RemoteReader`] without the worker's CPU on the path (an RDMA READ), and gives the lease
//! back (`Release`). Two readers: [`EmulatedReader`] sends `RemoteRead` frames over TCP (what
//! a NIC would do, done by the worker — always built, runs everywhere), and `VerbsReader`
//! posts real RDMA READs with libibverbs (feature `rdma`; compiled in CI, never run: no
//! device on the machines this was written on).
//!
//! Any failure of the RDMA path on a reachable worker — grants off or exhausted, a refused or
//! failed read, a malformed grant — falls back to a plain TCP read of the same range, so the
//! transport is always safe to turn on. A worker that cannot be reached is reported as such
//! (the client fails over to the next worker as with TCP).

#[cfg(feature = "rdma")]
mod verbs;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use strata_common::ErrorKind;
use strata_common::frame::{
    BlockGrant, GrantHandle, GrantKind, LeaseRelease, ReadBlockRequest, RemoteRead, Source,
};
use tokio::io::AsyncWriteExt;
use tracing::{debug, warn};

use crate::transport::{
    DataStream, Dial, Sink, TcpPool, TcpTransport, Transport, TransportError, read_response, reusable,
};
#[cfg(feature = "rdma")]
pub use verbs::VerbsReader;

/// Counter, label `reason` (`grant`/`read`): block reads that were asked over RDMA and served
/// over plain TCP instead.
pub const METRIC_RDMA_FALLBACKS: &str = "strata_client_rdma_fallbacks_total";

/// Which transport a client reads workers with ([`crate::ClientConfig::rdma`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RdmaMode {
    /// Plain framed TCP (the default).
    #[default]
    Off,
    /// [`RdmaTransport`] with [`EmulatedReader`]: the RDMA protocol over TCP frames.
    Emulated,
    /// [`RdmaTransport`] with `VerbsReader` (feature `rdma`). Without the feature, or without a
    /// device, the client logs a warning and reads over plain TCP.
    Verbs,
}

/// The one-sided read of granted worker memory.
#[async_trait]
pub trait RemoteReader: Send + Sync + 'static {
    /// Reads `len` bytes at `addr` of the region `rkey` names on the worker whose data plane is
    /// at `worker`. Exactly `len` bytes or an error.
    async fn read(&self, worker: &str, addr: u64, rkey: u32, len: u64) -> Result<Bytes, TransportError>;
}

/// The worker does the NIC's part: `RemoteRead` frames on pooled TCP connections, answered
/// from the granted region (or refused: stale lease, wrong rkey, out of bounds).
pub struct EmulatedReader {
    pool: TcpPool,
    request_timeout: Duration,
    next_req_id: AtomicU64,
}

impl EmulatedReader {
    /// `dial`: how connections are made (a `Duration` is plain TCP with that connect timeout).
    pub fn new(dial: impl Into<Dial>, request_timeout: Duration) -> Self {
        Self { pool: TcpPool::new(dial), request_timeout, next_req_id: AtomicU64::new(1) }
    }
}

#[async_trait]
impl RemoteReader for EmulatedReader {
    async fn read(&self, worker: &str, addr: u64, rkey: u32, len: u64) -> Result<Bytes, TransportError> {
        let req_id = self.next_req_id.fetch_add(1, Ordering::Relaxed);
        let mut stream = self.pool.checkout(worker).await?;
        let exchange = async {
            let frame = RemoteRead { req_id, addr, rkey, len }.encode();
            stream
                .write_all(&frame)
                .await
                .map_err(|source| TransportError::Io { addr: worker.to_string(), source })?;
            stream.flush().await.map_err(|source| TransportError::Io { addr: worker.to_string(), source })?;
            read_response(&mut stream, worker, req_id, len, Sink::New).await
        };
        let result = tokio::time::timeout(self.request_timeout, exchange)
            .await
            .unwrap_or_else(|_| Err(TransportError::Timeout { addr: worker.to_string() }));
        if reusable(&result) {
            self.pool.checkin(worker, stream);
        }
        result.map(|(bytes, _)| bytes.unwrap_or_default())
    }
}

/// Why a grant-and-read did not return bytes.
enum Failed {
    /// The worker could not be reached or the control connection broke: a TCP read would fail
    /// the same way, so the error goes to the caller (which tries the next worker).
    Unreachable(TransportError),
    /// The worker answered but the range cannot be read over RDMA this time.
    Fallback(&'static str, TransportError),
    /// The worker refused the range itself (not found, changed version...): TCP would too.
    Final(TransportError),
}

/// [`Transport`] over RDMA grants: control over TCP, bytes through a [`RemoteReader`],
/// plain TCP when that fails.
pub struct RdmaTransport<R: RemoteReader> {
    reader: R,
    fallback: TcpTransport,
    control: TcpPool,
    request_timeout: Duration,
    next_req_id: AtomicU64,
    remote_reads: AtomicU64,
    fallbacks: AtomicU64,
}

impl<R: RemoteReader> RdmaTransport<R> {
    /// `dial`: how connections are made (a `Duration` is plain TCP with that connect timeout).
    pub fn new(reader: R, dial: impl Into<Dial>, request_timeout: Duration) -> Self {
        let dial = dial.into();
        Self {
            reader,
            fallback: TcpTransport::new(dial.clone(), request_timeout),
            control: TcpPool::new(dial),
            request_timeout,
            next_req_id: AtomicU64::new(1),
            remote_reads: AtomicU64::new(0),
            fallbacks: AtomicU64::new(0),
        }
    }

    /// Block reads served by a one-sided read.
    pub fn remote_reads(&self) -> u64 {
        self.remote_reads.load(Ordering::Relaxed)
    }

    /// Block reads that fell back to plain TCP.
    pub fn fallbacks(&self) -> u64 {
        self.fallbacks.load(Ordering::Relaxed)
    }

    async fn grant(
        &self,
        stream: &mut DataStream,
        addr: &str,
        req: &ReadBlockRequest,
    ) -> Result<(BlockGrant, Source), TransportError> {
        let io = |source| TransportError::Io { addr: addr.to_string(), source };
        stream.write_all(&req.encode_open(GrantKind::Rdma)).await.map_err(io)?;
        stream.flush().await.map_err(io)?;
        let (payload, source) =
            read_response(stream, addr, req.req_id, BlockGrant::ENCODED_LEN as u64, Sink::New).await?;
        let grant = BlockGrant::decode(&payload.unwrap_or_default()).map_err(|e| {
            TransportError::Protocol { addr: addr.to_string(), reason: format!("grant: {e}") }
        })?;
        Ok((grant, source))
    }

    async fn read_granted(&self, addr: &str, req: &ReadBlockRequest) -> Result<(Bytes, Source), Failed> {
        let mut req = req.clone();
        req.req_id = self.next_req_id.fetch_add(1, Ordering::Relaxed);
        let mut stream = self.control.checkout(addr).await.map_err(Failed::Unreachable)?;
        let granted = tokio::time::timeout(self.request_timeout, self.grant(&mut stream, addr, &req))
            .await
            .unwrap_or_else(|_| Err(TransportError::Timeout { addr: addr.to_string() }));
        let (grant, source) = match granted {
            Ok(g) => g,
            // A worker that does not know grants (older than them) rejects the frame as bad and
            // closes the connection: drop it, and read over TCP.
            Err(e @ TransportError::Remote { kind: ErrorKind::BadFrame, .. }) => {
                return Err(Failed::Fallback("grant", e));
            }
            Err(e @ TransportError::Remote { kind, .. }) => {
                self.control.checkin(addr, stream);
                return Err(if kind.is_temporary() {
                    Failed::Fallback("grant", e)
                } else {
                    Failed::Final(e)
                });
            }
            Err(e @ TransportError::Protocol { .. }) => return Err(Failed::Fallback("grant", e)),
            Err(e) => return Err(Failed::Unreachable(e)),
        };
        let read = match grant.handle {
            GrantHandle::Rdma { addr: region, rkey } if grant.len == req.len => {
                self.reader.read(addr, region, rkey, grant.len).await
            }
            other => Err(TransportError::Protocol {
                addr: addr.to_string(),
                reason: format!("grant of {} bytes as {other:?} for a read of {}", grant.len, req.len),
            }),
        };
        // Given back whatever the read did; no response, so the connection stays in sync.
        let release = LeaseRelease { lease_id: grant.lease_id, kind: GrantKind::Rdma }.encode();
        let released = async {
            stream.write_all(&release).await?;
            stream.flush().await
        };
        match released.await {
            Ok(()) => self.control.checkin(addr, stream),
            Err(e) => debug!(worker = addr, err = %e, "release not sent; the lease will expire"),
        }
        match read {
            Ok(bytes) if bytes.len() as u64 == req.len => Ok((bytes, source)),
            Ok(bytes) => Err(Failed::Fallback(
                "read",
                TransportError::Protocol {
                    addr: addr.to_string(),
                    reason: format!("{} bytes read of {}", bytes.len(), req.len),
                },
            )),
            Err(e) => Err(Failed::Fallback("read", e)),
        }
    }
}

#[async_trait]
impl<R: RemoteReader> Transport for RdmaTransport<R> {
    async fn read_block(
        &self,
        addr: &str,
        req: &ReadBlockRequest,
    ) -> Result<(Bytes, Source), TransportError> {
        match self.read_granted(addr, req).await {
            Ok(read) => {
                self.remote_reads.fetch_add(1, Ordering::Relaxed);
                Ok(read)
            }
            Err(Failed::Unreachable(e) | Failed::Final(e)) => Err(e),
            Err(Failed::Fallback(reason, e)) => {
                debug!(worker = addr, reason, err = %e, "RDMA read failed; reading over TCP");
                self.fallbacks.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(METRIC_RDMA_FALLBACKS, "reason" => reason).increment(1);
                self.fallback.read_block(addr, req).await
            }
        }
    }
}

/// The transport a client configured with `mode` reads workers with.
pub(crate) fn transport_for(mode: RdmaMode, dial: &Dial, request_timeout: Duration) -> Arc<dyn Transport> {
    let tcp = || -> Arc<dyn Transport> { Arc::new(TcpTransport::new(dial.clone(), request_timeout)) };
    match mode {
        RdmaMode::Off => tcp(),
        RdmaMode::Emulated => Arc::new(RdmaTransport::new(
            EmulatedReader::new(dial.clone(), request_timeout),
            dial.clone(),
            request_timeout,
        )),
        #[cfg(feature = "rdma")]
        RdmaMode::Verbs => match VerbsReader::open(dial.clone(), request_timeout) {
            Ok(reader) => Arc::new(RdmaTransport::new(reader, dial.clone(), request_timeout)),
            Err(e) => {
                warn!(err = %e, "no RDMA device; reading over TCP");
                tcp()
            }
        },
        #[cfg(not(feature = "rdma"))]
        RdmaMode::Verbs => {
            warn!("RDMA asked but this client was built without the `rdma` feature; reading over TCP");
            tcp()
        }
    }
}

#[cfg(test)]
mod tests {
    use strata_common::frame::{REQUEST_HEADER_LEN, ResponseHeader, decode_request_header};
    use tokio::io::AsyncReadExt;

    use super::*;

    fn request(len: u64) -> ReadBlockRequest {
        ReadBlockRequest {
            req_id: 0,
            path: "/data/f".into(),
            version: "v".into(),
            file_size: len,
            block_size: len,
            block_index: 0,
            offset: 0,
            len,
        }
    }

    /// A worker from before grants: `OpenBlock` is an unknown op to it (a bad frame, and the
    /// connection closed), reads are answered with `len` bytes of 0xab.
    async fn old_worker() -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut head = [0u8; REQUEST_HEADER_LEN];
                    while s.read_exact(&mut head).await.is_ok() {
                        let (op, len) = decode_request_header(&head).unwrap();
                        let mut body = vec![0u8; len];
                        s.read_exact(&mut body).await.unwrap();
                        if op != strata_common::frame::Op::ReadBlock {
                            let msg = b"unknown op 5";
                            let h = ResponseHeader {
                                status: Err(ErrorKind::BadFrame),
                                req_id: 0,
                                payload_len: msg.len() as u64,
                            };
                            s.write_all(&h.encode()).await.unwrap();
                            s.write_all(msg).await.unwrap();
                            return;
                        }
                        let req = ReadBlockRequest::decode_body(&body).unwrap();
                        let h = ResponseHeader {
                            status: Ok(Source::Memory),
                            req_id: req.req_id,
                            payload_len: req.len,
                        };
                        s.write_all(&h.encode()).await.unwrap();
                        s.write_all(&vec![0xab; req.len as usize]).await.unwrap();
                    }
                });
            }
        });
        addr
    }

    #[tokio::test]
    async fn a_worker_that_does_not_know_grants_is_read_over_tcp() {
        let addr = old_worker().await;
        let t = RdmaTransport::new(
            EmulatedReader::new(Duration::from_secs(5), Duration::from_secs(5)),
            Duration::from_secs(5),
            Duration::from_secs(5),
        );
        for _ in 0..3 {
            let (bytes, _) = t.read_block(&addr, &request(1000)).await.unwrap();
            assert_eq!(bytes, Bytes::from(vec![0xab; 1000]));
        }
        assert_eq!((t.remote_reads(), t.fallbacks()), (0, 3));
    }

    #[tokio::test]
    async fn an_unreachable_worker_is_an_error_not_a_fallback() {
        // A port nobody listens on: the grant cannot even be asked.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        drop(listener);
        let t = RdmaTransport::new(
            EmulatedReader::new(Duration::from_secs(1), Duration::from_secs(1)),
            Duration::from_secs(1),
            Duration::from_secs(1),
        );
        let err = t.read_block(&addr, &request(10)).await.unwrap_err();
        assert!(matches!(err, TransportError::Connect { .. }), "{err:?}");
        assert_eq!((t.remote_reads(), t.fallbacks()), (0, 0));
    }
}
