//! Reads into a caller's buffer, and the write side of the client: whole-file writes through a
//! worker ([`StrataWriter`]), deletes and directories through the master.
//!
//! After any change the client forgets its own cached stat of the path and asks the master to
//! forget its cached metadata, so the next `stat`/`read` through any client of that master sees
//! the new size and version. Other clients' local stat caches may still hold the old version
//! for up to the mount's metadata TTL (the same bound as for changes made behind Strata's back).

use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use strata_common::frame::{
    MAX_ERROR_MESSAGE, MAX_WRITE_CHUNK, Op, RESPONSE_HEADER_LEN, ResponseHeader, WriteBegin, request_header,
};
use strata_common::{BlockKey, block_slices, path};
use strata_proto::{DeleteRequest, InvalidateRequest, MkdirRequest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tracing::warn;

use crate::transport::{DataStream, ParkedStream, Sink};
use crate::{Client, ClientError, FileInfo, Result, TransportError};

/// Writes smaller than this are gathered into one data frame; larger ones go out as they are.
const GATHER: usize = 1 << 20;
/// Size of a gathered data frame.
const FRAME: usize = 4 << 20;

impl Client {
    /// Fills `buf` with the bytes of one version of a file from `offset` (the caller sizes
    /// `buf` within the file). Blocks are fetched in parallel and each is received from the
    /// socket straight into its place in `buf`: no intermediate buffer, no copy.
    pub async fn read_into(&self, info: &FileInfo, offset: u64, buf: &mut [u8]) -> Result<()> {
        if info.is_dir {
            return Err(ClientError::IsDirectory(info.path.clone()));
        }
        if offset.checked_add(buf.len() as u64).is_none_or(|end| end > info.size) {
            return Err(ClientError::InvalidArgument(format!(
                "range {offset}+{} is outside {} ({} bytes)",
                buf.len(),
                info.path,
                info.size
            )));
        }
        let mut rest = buf;
        let mut reads = Vec::new();
        for slice in block_slices(info.size, info.block_size, offset, rest.len() as u64) {
            let (part, tail) = std::mem::take(&mut rest).split_at_mut(slice.len as usize);
            // Made here rather than in a stream combinator's closure, whose borrow of `part`
            // the compiler cannot prove general enough for a `Send` future.
            reads.push(self.read_slice_to(info, slice, Sink::Into(part)));
            rest = tail;
        }
        futures::stream::iter(reads)
            .buffer_unordered(self.config().parallelism.max(1))
            .try_for_each(|_| async { Ok(()) })
            .await
    }

    /// Starts replacing the file at `path` (on a `mode=write-through` mount) with the bytes
    /// written to the returned writer; the file changes when [`StrataWriter::close`] succeeds.
    pub async fn create(&self, raw: &str) -> Result<StrataWriter> {
        let p = path::normalize(raw).map_err(|e| ClientError::InvalidArgument(e.to_string()))?;
        // Any worker can write any file; placing by path spreads concurrent writers.
        let hash = BlockKey::new(p.clone(), String::new(), 0).placement_hash();
        let mut ring = self.ring().await?;
        if ring.is_empty() {
            ring = self.inner.view.read().unwrap_or_else(|p| p.into_inner()).last_members.clone();
        }
        let mut last_err = None;
        for owner in ring.owners(hash, ring.members().len()) {
            match self.begin_write(&owner.data_addr, &p).await {
                Ok(stream) => {
                    return Ok(StrataWriter {
                        client: self.clone(),
                        path: p,
                        addr: owner.data_addr.clone(),
                        stream: Some(WriteConn::Live(stream)),
                        gathered: Vec::new(),
                        written: 0,
                    });
                }
                Err(e) if e.try_next_worker() => {
                    warn!(worker = %owner.id, path = %p, err = %e, "cannot start a write; trying the next worker");
                    last_err = Some(e);
                }
                Err(e) => return Err(ClientError::from_transport(e)),
            }
        }
        Err(ClientError::unserved(last_err, "no live workers"))
    }

    async fn begin_write(&self, addr: &str, p: &str) -> std::result::Result<DataStream, TransportError> {
        let mut stream = crate::transport::connect_tcp(addr, self.dial()).await?;
        let begin = WriteBegin { req_id: 1, path: p.to_string() }.encode();
        let exchange = async {
            stream.write_all(&begin).await.map_err(|source| io_err(addr, source))?;
            stream.flush().await.map_err(|source| io_err(addr, source))?;
            read_answer(&mut stream, addr).await
        };
        tokio::time::timeout(self.config().request_timeout, exchange)
            .await
            .map_err(|_| TransportError::Timeout { addr: addr.to_string() })??;
        Ok(stream)
    }

    /// Deletes a file, or a directory (with everything under it when `recursive`).
    pub async fn delete(&self, raw: &str, recursive: bool) -> Result<()> {
        let p = path::normalize(raw).map_err(|e| ClientError::InvalidArgument(e.to_string()))?;
        let result = self.master().delete(DeleteRequest { path: p.clone(), recursive }).await;
        self.forget_local(&p, true);
        result.map_err(self.rpc_err("delete"))?;
        Ok(())
    }

    /// Makes a directory and its parents (nothing to do if it exists).
    pub async fn mkdir(&self, raw: &str) -> Result<()> {
        let p = path::normalize(raw).map_err(|e| ClientError::InvalidArgument(e.to_string()))?;
        let result = self.master().mkdir(MkdirRequest { path: p.clone() }).await;
        self.forget_local(&p, false);
        result.map_err(self.rpc_err("mkdir"))?;
        Ok(())
    }

    /// Forgets cached metadata of `path` here and on the master.
    pub async fn invalidate(&self, raw: &str) -> Result<()> {
        let p = path::normalize(raw).map_err(|e| ClientError::InvalidArgument(e.to_string()))?;
        self.forget_local(&p, false);
        self.master().invalidate(InvalidateRequest { path: p }).await.map_err(self.rpc_err("invalidate"))?;
        Ok(())
    }

    fn forget_local(&self, p: &str, subtree: bool) {
        self.inner.listings.forget(p);
        let mut stats = self.inner.stats.lock().unwrap_or_else(|p| p.into_inner());
        stats.remove(p);
        if subtree {
            let prefix = format!("{}/", p.trim_end_matches('/'));
            stats.retain(|k, _| !k.starts_with(&prefix));
        }
    }
}

fn io_err(addr: &str, source: std::io::Error) -> TransportError {
    TransportError::Io { addr: addr.to_string(), source }
}

/// Reads a payload-less answer: `Ok` or the worker's error.
async fn read_answer(stream: &mut DataStream, addr: &str) -> std::result::Result<(), TransportError> {
    let mut head = [0u8; RESPONSE_HEADER_LEN];
    crate::transport::read_head(stream, addr, &mut head).await?;
    let head = ResponseHeader::decode(&head)
        .map_err(|e| TransportError::Protocol { addr: addr.to_string(), reason: e.to_string() })?;
    match head.status {
        Ok(_) if head.payload_len == 0 => Ok(()),
        Ok(_) => Err(TransportError::Protocol {
            addr: addr.to_string(),
            reason: format!("a write answer with {} bytes of payload", head.payload_len),
        }),
        Err(kind) => {
            let mut msg = vec![0u8; head.payload_len.min(MAX_ERROR_MESSAGE as u64) as usize];
            stream.read_exact(&mut msg).await.map_err(|source| io_err(addr, source))?;
            Err(TransportError::Remote {
                addr: addr.to_string(),
                kind,
                message: String::from_utf8_lossy(&msg).into_owned(),
            })
        }
    }
}

/// A file being written through a worker. Nothing is visible until [`close`](Self::close)
/// succeeds; dropping the writer (or [`abort`](Self::abort)) leaves the old file in place.
pub struct StrataWriter {
    client: Client,
    path: String,
    addr: String,
    stream: Option<WriteConn>,
    gathered: Vec<u8>,
    written: u64,
}

/// The writer's connection: registered with the runtime, or parked (detached from it) between
/// calls of a host that may replace its runtime (the Python binding does, around `fork`).
enum WriteConn {
    Live(DataStream),
    Parked(ParkedStream),
}

impl StrataWriter {
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Bytes accepted so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    fn timeout(&self) -> Duration {
        self.client.config().request_timeout
    }

    /// Detaches the connection from the current runtime, so that the runtime can be shut down
    /// while the write stays open; the next write or `close` attaches it to the runtime it
    /// runs in. Must be called inside the runtime that owns the connection.
    pub fn park(&mut self) -> Result<()> {
        if !matches!(self.stream, Some(WriteConn::Live(_))) {
            return Ok(());
        }
        let Some(WriteConn::Live(stream)) = self.stream.take() else { unreachable!("checked above") };
        let parked = stream.park().map_err(|e| {
            ClientError::unavailable(format!("write to {}: cannot detach the connection: {e}", self.addr))
        })?;
        self.stream = Some(WriteConn::Parked(parked));
        Ok(())
    }

    /// Continues the write with another client (of a new runtime) for the metadata calls at
    /// `close`; returns the one it used before. Call only while the connection is parked.
    pub fn rebind(&mut self, client: Client) -> Client {
        std::mem::replace(&mut self.client, client)
    }

    /// The connection, attached to the runtime this runs in.
    fn live_stream(&mut self) -> Result<&mut DataStream> {
        let conn =
            self.stream.take().ok_or_else(|| ClientError::InvalidArgument("writer is closed".into()))?;
        let stream = match conn {
            WriteConn::Live(stream) => stream,
            WriteConn::Parked(parked) => parked.attach().map_err(|e| {
                ClientError::unavailable(format!("write to {}: cannot attach the connection: {e}", self.addr))
            })?,
        };
        match self.stream.insert(WriteConn::Live(stream)) {
            WriteConn::Live(stream) => Ok(stream),
            WriteConn::Parked(_) => unreachable!("just inserted"),
        }
    }

    /// Appends bytes. Small writes are gathered; large ones are sent without a copy.
    pub async fn write(&mut self, data: &[u8]) -> Result<()> {
        self.written += data.len() as u64;
        if data.len() < GATHER {
            self.gathered.extend_from_slice(data);
            if self.gathered.len() >= FRAME {
                let gathered = std::mem::take(&mut self.gathered);
                self.send(&gathered).await?;
                self.gathered = gathered;
                self.gathered.clear();
            }
            return Ok(());
        }
        if !self.gathered.is_empty() {
            let gathered = std::mem::take(&mut self.gathered);
            self.send(&gathered).await?;
            self.gathered = gathered;
            self.gathered.clear();
        }
        self.send(data).await
    }

    async fn send(&mut self, mut data: &[u8]) -> Result<()> {
        let addr = self.addr.clone();
        let timeout = self.timeout();
        let stream = self.live_stream()?;
        while !data.is_empty() {
            let n = data.len().min(MAX_WRITE_CHUNK);
            let frame = async {
                stream.write_all(&request_header(Op::WriteData, n)).await?;
                stream.write_all(&data[..n]).await?;
                // Nothing held back in TLS: the connection may be parked after this call.
                stream.flush().await
            };
            match tokio::time::timeout(timeout, frame).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    self.stream = None;
                    return Err(ClientError::unavailable(format!("write to {addr} failed: {e}")));
                }
                Err(_) => {
                    self.stream = None;
                    return Err(ClientError::unavailable(format!("write to {addr} timed out")));
                }
            }
            data = &data[n..];
        }
        Ok(())
    }

    /// Commits the file and returns its new metadata.
    pub async fn close(&mut self) -> Result<FileInfo> {
        if !self.gathered.is_empty() {
            let gathered = std::mem::take(&mut self.gathered);
            self.send(&gathered).await?;
        }
        self.live_stream()?;
        let Some(WriteConn::Live(mut stream)) = self.stream.take() else {
            unreachable!("live_stream attached it");
        };
        let addr = self.addr.clone();
        let end = async {
            stream.write_all(&request_header(Op::WriteEnd, 0)).await.map_err(|e| io_err(&addr, e))?;
            stream.flush().await.map_err(|e| io_err(&addr, e))?;
            read_answer(&mut stream, &addr).await
        };
        let answer = tokio::time::timeout(self.timeout(), end)
            .await
            .unwrap_or_else(|_| Err(TransportError::Timeout { addr: addr.clone() }));
        // Whatever the outcome, what we knew of this file may be stale now.
        let forgot = self.client.invalidate(&self.path).await;
        answer.map_err(ClientError::from_transport)?;
        if let Err(e) = forgot {
            warn!(path = %self.path, err = %e, "written, but the master's metadata cache was not invalidated");
        }
        self.client.stat_with(&self.path, true).await
    }

    /// Drops the write; the old file stays.
    pub fn abort(&mut self) {
        self.stream = None;
        self.gathered = Vec::new();
    }
}

impl Client {
    /// A streaming reader of a version of a file the caller already knows (e.g. to go on
    /// reading the same version in another process).
    pub fn reader_of(&self, info: FileInfo) -> crate::StrataReader {
        crate::StrataReader::new(self.clone(), info)
    }
}
