//! Reads into a caller's buffer, and the write side of the client: whole-file writes and appends
//! through a worker ([`StrataWriter`]), copies made by a worker ([`Client::copy`]: no byte of the
//! file through the client), renames, deletes and directories through the master.
//!
//! After any change the client forgets its own cached stat of the path and asks the master to
//! forget its cached metadata, so the next `stat`/`read` through any client of that master sees
//! the new size and version. Other clients' local stat caches may still hold the old version
//! for up to the mount's metadata TTL (the same bound as for changes made behind Strata's back).

use std::time::Duration;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use strata_common::frame::{
    self, CopyAnswer, CopyRequest, CopyVia, MAX_ERROR_MESSAGE, MAX_WRITE_CHUNK, Op, RESPONSE_HEADER_LEN,
    ResponseHeader, WriteBackCopy, WriteBegin, WriteFlags, request_header,
};
use strata_common::{BlockKey, MountMode, MountOptions, block_slices, path};
use strata_proto::{PendingFile, SyncRequest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tracing::warn;

use crate::transport::{DataStream, ParkedStream, Sink};
use crate::{Client, ClientError, FileInfo, Metadata, Result, TransportError};

/// Writes smaller than this are gathered into one data frame; larger ones go out as they are.
const GATHER: usize = 1 << 20;
/// Size of a gathered data frame.
const FRAME: usize = 4 << 20;
/// Bytes per read when a copy goes through this client (to a write-back mount).
const COPY_CHUNK: u64 = 8 << 20;
/// The slowest rate a worker's copy is allowed, on top of the request timeout, before the
/// client gives up waiting for its answer (a copy's time grows with its size).
const COPY_MIN_RATE: u64 = 4 << 20;
/// Frames queued per copy of a write to several workers (write-back with `write_replicas` > 1).
/// Each copy is sent by a task of its own, so each worker takes the stream at its own pace, up
/// to this many frames ahead of the slowest, instead of every frame waiting for both.
const QUEUED_FRAMES: usize = 4;

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

    /// Starts replacing the file at `path` (on a `mode=write-through` or `mode=write-back`
    /// mount) with the bytes written to the returned writer; the file changes when
    /// [`StrataWriter::close`] succeeds. On a write-back mount the bytes stream to the
    /// mount's `write_replicas` workers at once (the path's owners on the ring), and `close`
    /// returns once each holds them durably: the upload to the UFS follows in the background.
    pub async fn create(&self, raw: &str) -> Result<StrataWriter> {
        self.create_with(raw, WriteFlags::default()).await
    }

    /// Starts appending to the file at `path` (made empty if absent): its bytes followed by the
    /// ones written become the file when [`StrataWriter::close`] succeeds, and an aborted
    /// append changes nothing. Only on a `mode=write-through` mount whose UFS can append (a
    /// local directory); elsewhere `InvalidArgument` saying why, at once.
    pub async fn append(&self, raw: &str) -> Result<StrataWriter> {
        self.create_with(raw, WriteFlags { append: true }).await
    }

    async fn create_with(&self, raw: &str, flags: WriteFlags) -> Result<StrataWriter> {
        let p = path::normalize(raw).map_err(|e| ClientError::InvalidArgument(e.to_string()))?;
        // Any worker can write any file; placing by path spreads concurrent writers.
        let hash = BlockKey::new(p.clone(), String::new(), 0).placement_hash();
        let mut ring = self.ring().await?;
        if ring.is_empty() {
            ring = self.inner.view.read().last_members.clone();
        }
        let write_back = self.mount_options_of(&p).filter(|o| o.mode == MountMode::WriteBack);
        if flags.append && write_back.is_some() {
            return Err(ClientError::InvalidArgument(format!(
                "cannot append to {p}: it is on a write-back mount, whose journals take whole files \
                 (appends need mode=write-through)"
            )));
        }
        let copies = write_back.as_ref().map_or(1, |o| o.write_replicas as usize);
        let owners = ring.owners(hash, ring.members().len());
        if write_back.is_some() && owners.len() < copies {
            return Err(ClientError::unavailable(format!(
                "{p} is on a write-back mount that keeps {copies} copies (write_replicas), but only {} \
                 workers are live",
                owners.len()
            )));
        }
        let write_id = write_back.is_some().then(|| uuid::Uuid::new_v4().simple().to_string());
        let mut last_err = None;
        let mut opened: Vec<WriteCopy> = Vec::new();
        for owner in owners {
            if opened.len() == copies {
                break;
            }
            let write_back =
                write_id.as_ref().map(|id| WriteBackCopy { write_id: id.clone(), rank: opened.len() as u8 });
            match self.begin_write(&owner.data_addr, &p, write_back, flags).await {
                Ok(stream) => opened.push(WriteCopy {
                    worker_id: owner.id.clone(),
                    addr: owner.data_addr.clone(),
                    stream: Some(WriteConn::Live(stream)),
                }),
                Err(e) if e.try_next_worker() => {
                    warn!(worker = %owner.id, path = %p, err = %e, "cannot start a write; trying the next worker");
                    last_err = Some(e);
                }
                Err(e) => return Err(ClientError::from_transport(e)),
            }
        }
        if opened.len() < copies.max(1) {
            return Err(ClientError::unserved(last_err, "not enough live workers to take the write"));
        }
        Ok(StrataWriter {
            client: self.clone(),
            path: p,
            copies: opened,
            pumps: Vec::new(),
            dropped: Vec::new(),
            gathered: Vec::new(),
            written: 0,
        })
    }

    /// The options of the mount holding `p`, from the mount table this client knows.
    fn mount_options_of(&self, p: &str) -> Option<MountOptions> {
        self.inner.view.mount_options_of(p)
    }

    async fn begin_write(
        &self,
        addr: &str,
        p: &str,
        write_back: Option<WriteBackCopy>,
        flags: WriteFlags,
    ) -> std::result::Result<DataStream, TransportError> {
        let mut stream = crate::transport::connect_tcp(addr, self.dial()).await?;
        let begin = WriteBegin { req_id: 1, path: p.to_string(), write_back }.encode_with(flags);
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

    /// Makes the file `dst` a copy of the file `src` without the bytes passing through this
    /// client: a worker (the ring owner of `dst`, the next one if it cannot be reached; a holder
    /// of a write-back file not yet uploaded) has the UFS copy it, or streams it through its
    /// block cache, and answers once `dst` exists (`docs/ARCHITECTURE.md`, "Copies, renames and
    /// appends"). To a `mode=write-back` mount, whose files need several workers' journals, the
    /// copy goes through this client's reads and write path instead ([`CopiedBy::Client`]).
    pub async fn copy(&self, raw_src: &str, raw_dst: &str) -> Result<Copied> {
        let bad = |e: strata_common::path::PathError| ClientError::InvalidArgument(e.to_string());
        let src = path::normalize(raw_src).map_err(bad)?;
        let dst = path::normalize(raw_dst).map_err(bad)?;
        let info = self.stat(&src).await?;
        if info.is_dir {
            return Err(ClientError::IsDirectory(format!("{src} is a directory (copy its files)")));
        }
        if src == dst {
            return Err(ClientError::InvalidArgument(format!("cannot copy {src} onto itself")));
        }
        let copied = if self.mount_options_of(&dst).is_some_and(|o| o.mode == MountMode::WriteBack) {
            self.copy_through_client(&info, &dst).await
        } else {
            self.copy_by_worker(&info, &dst).await
        };
        // Whatever the outcome, what we knew of the destination may be stale now.
        let forgot = self.invalidate(&dst).await;
        let copied = copied?;
        if let Err(e) = forgot {
            warn!(path = %dst, err = %e, "copied, but the master's metadata cache was not invalidated");
        }
        Ok(copied)
    }

    async fn copy_by_worker(&self, src: &FileInfo, dst: &str) -> Result<Copied> {
        let write_back = src.persist != crate::Persist::Persisted;
        let req = CopyRequest {
            req_id: 1,
            src: src.path.clone(),
            dst: dst.to_string(),
            version: if write_back { src.version.clone() } else { String::new() },
            size: if write_back { src.size } else { 0 },
        };
        let workers = if write_back && !src.holders.is_empty() {
            src.holders.clone()
        } else {
            let mut ring = self.ring().await?;
            if ring.is_empty() {
                ring = self.inner.view.read().last_members.clone();
            }
            // The same worker a write of `dst` would go to.
            let hash = BlockKey::new(dst.to_string(), String::new(), 0).placement_hash();
            ring.owners(hash, ring.members().len()).into_iter().cloned().collect()
        };
        let timeout = self.config().request_timeout + Duration::from_secs(src.size / COPY_MIN_RATE);
        let frame = req.encode();
        let mut last_err = None;
        for worker in workers {
            let exchange = async {
                let mut stream = crate::transport::connect_tcp(&worker.data_addr, self.dial()).await?;
                stream.write_all(&frame).await.map_err(|e| io_err(&worker.data_addr, e))?;
                stream.flush().await.map_err(|e| io_err(&worker.data_addr, e))?;
                read_copy_answer(&mut stream, &worker.data_addr).await
            };
            let answer = tokio::time::timeout(timeout, exchange)
                .await
                .unwrap_or_else(|_| Err(TransportError::Timeout { addr: worker.data_addr.clone() }));
            match answer {
                Ok(a) => {
                    let by = match a.via {
                        CopyVia::Ufs => CopiedBy::Ufs,
                        CopyVia::Streamed => CopiedBy::Worker,
                    };
                    return Ok(Copied { by, bytes: a.bytes, worker: worker.id });
                }
                // A copy is idempotent (the destination is replaced whole), so any worker may
                // take it over.
                Err(e) if e.try_next_worker() => {
                    warn!(worker = %worker.id, src = %src.path, dst, err = %e, "copy failed; trying the next worker");
                    last_err = Some(e);
                }
                Err(e) => return Err(ClientError::from_transport(e)),
            }
        }
        Err(ClientError::unserved(last_err, "no live worker to make the copy"))
    }

    /// Reads `src` and writes it to `dst` through this client (a write-back destination).
    async fn copy_through_client(&self, src: &FileInfo, dst: &str) -> Result<Copied> {
        let mut w = self.create(dst).await?;
        let mut offset = 0;
        while offset < src.size {
            let len = (src.size - offset).min(COPY_CHUNK);
            let bytes = self.read_range_of(src, offset, len).await?;
            w.write(&bytes).await?;
            offset += len;
        }
        w.close().await?;
        Ok(Copied { by: CopiedBy::Client, bytes: src.size, worker: String::new() })
    }

    /// Renames a file or a directory in place through the master, whose UFS does it (a local
    /// directory, HDFS): `dst` is the new path exactly, a file there is replaced, a directory
    /// there refuses (`AlreadyExists`). `Ok(false)` when the rename cannot be made in place
    /// (another mount, a UFS that cannot rename such as an object store, write-back files not
    /// yet uploaded) and nothing changed: copy and delete instead ([`Client::move_file`] does
    /// for a file).
    pub async fn rename(&self, raw_src: &str, raw_dst: &str) -> Result<bool> {
        self.inner.metadata.rename(raw_src, raw_dst).await
    }

    /// Moves a file: renamed in place where the UFS can, else copied by a worker (see
    /// [`copy`](Self::copy)) and the source deleted once the copy exists.
    pub async fn move_file(&self, src: &str, dst: &str) -> Result<Moved> {
        if self.stat(src).await?.is_dir {
            return Err(ClientError::IsDirectory(format!("{src} is a directory (move_file moves files)")));
        }
        if self.rename(src, dst).await? {
            return Ok(Moved::Renamed);
        }
        let copied = self.copy(src, dst).await?;
        self.delete(src, false).await?;
        Ok(Moved::Copied(copied))
    }

    /// Deletes a file, or a directory (with everything under it when `recursive`).
    pub async fn delete(&self, raw: &str, recursive: bool) -> Result<()> {
        self.inner.metadata.delete(raw, recursive).await
    }

    /// Makes a directory and its parents (nothing to do if it exists).
    pub async fn mkdir(&self, raw: &str) -> Result<()> {
        self.inner.metadata.mkdir(raw).await
    }

    /// The write-back files at or under `path` not yet in the UFS (empty: all are). With
    /// `retry_failed`, uploads that gave up are queued again first.
    pub async fn sync(&self, raw: &str, retry_failed: bool) -> Result<Vec<PendingFile>> {
        let p = path::normalize(raw).map_err(|e| ClientError::InvalidArgument(e.to_string()))?;
        let master = &self.inner.master;
        let resp = master.ask("sync", master.client().sync(SyncRequest { path: p, retry_failed })).await?;
        Ok(resp.pending)
    }

    /// Waits until every write-back file at or under `path` is in the UFS (queuing failed
    /// uploads again once). An upload that fails again is an error naming the file and why;
    /// so is `timeout` passing first.
    pub async fn sync_wait(&self, raw: &str, timeout: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut pending = self.sync(raw, true).await?;
        let mut delay = Duration::from_millis(20);
        loop {
            if pending.is_empty() {
                return Ok(());
            }
            if let Some(f) = pending.iter().find(|f| f.state == strata_proto::PersistState::Failed as i32) {
                return Err(ClientError::Remote {
                    kind: strata_common::ErrorKind::Ufs,
                    message: format!("{}: upload failed: {}", f.path, f.error),
                });
            }
            if tokio::time::Instant::now() + delay > deadline {
                let first = &pending[0];
                // Not a worker that failed to serve: the files are safe, just not uploaded yet.
                return Err(ClientError::Remote {
                    kind: strata_common::ErrorKind::Unavailable,
                    message: format!(
                        "{} file(s) still not in the UFS after {timeout:?} (e.g. {}: {}{})",
                        pending.len(),
                        first.path,
                        crate::Persist::from_proto(first.state).as_str(),
                        if first.error.is_empty() {
                            String::new()
                        } else {
                            format!(", last error: {}", first.error)
                        }
                    ),
                });
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(500));
            pending = self.sync(raw, false).await?;
        }
    }

    /// Forgets cached metadata of `path` here and on the master.
    pub async fn invalidate(&self, raw: &str) -> Result<()> {
        self.inner.metadata.invalidate(raw).await
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

/// Reads a `Copy` answer: its [`CopyAnswer`], or the worker's error.
async fn read_copy_answer(
    stream: &mut DataStream,
    addr: &str,
) -> std::result::Result<CopyAnswer, TransportError> {
    let mut head = [0u8; RESPONSE_HEADER_LEN];
    crate::transport::read_head(stream, addr, &mut head).await?;
    let protocol = |reason: String| TransportError::Protocol { addr: addr.to_string(), reason };
    let head = ResponseHeader::decode(&head).map_err(|e| protocol(e.to_string()))?;
    match head.status {
        Ok(_) if head.payload_len == CopyAnswer::ENCODED_LEN as u64 => {
            let mut payload = [0u8; CopyAnswer::ENCODED_LEN];
            stream.read_exact(&mut payload).await.map_err(|source| io_err(addr, source))?;
            CopyAnswer::decode(&payload).map_err(|e| protocol(e.to_string()))
        }
        Ok(_) => Err(protocol(format!("a copy answer with {} bytes of payload", head.payload_len))),
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

/// Who made a copy ([`Client::copy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopiedBy {
    /// The UFS itself (S3 CopyObject, a local file copy): no byte through any Strata process.
    Ufs,
    /// A worker, reading the source's blocks through its cache into the destination's writer.
    Worker,
    /// This client (the destination is on a write-back mount).
    Client,
}

/// A copy made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Copied {
    pub by: CopiedBy,
    /// The size of the copy.
    pub bytes: u64,
    /// The worker that made it (empty for [`CopiedBy::Client`]).
    pub worker: String,
}

/// How [`Client::move_file`] moved a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Moved {
    Renamed,
    Copied(Copied),
}

/// A file being written through a worker (through several at once on a write-back mount).
/// Nothing is visible until [`close`](Self::close) succeeds; dropping the writer (or
/// [`abort`](Self::abort)) leaves the old file in place.
pub struct StrataWriter {
    client: Client,
    path: String,
    /// One stream per copy, the primary first — unless they are with `pumps`.
    copies: Vec<WriteCopy>,
    /// The copies while tasks of their own send them (several copies, between the first
    /// write and `settle`), the primary first.
    pumps: Vec<Pump>,
    /// Replicas whose stream failed, and why (said if the primary then refuses).
    dropped: Vec<String>,
    gathered: Vec<u8>,
    written: u64,
}

/// A copy being sent by a task of its own from a queue of frames; the task gives the copy
/// back, with how its sending ended, once the queue is closed and empty or a send failed.
struct Pump {
    worker_id: String,
    frames: Option<tokio::sync::mpsc::Sender<Bytes>>,
    task: tokio::task::JoinHandle<(WriteCopy, std::result::Result<(), String>)>,
}

impl Pump {
    fn start(mut copy: WriteCopy, timeout: Duration) -> Self {
        let (frames, mut queue) = tokio::sync::mpsc::channel::<Bytes>(QUEUED_FRAMES);
        let worker_id = copy.worker_id.clone();
        let task = tokio::spawn(async move {
            while let Some(frame) = queue.recv().await {
                if let Err(e) = copy.send(&frame, timeout).await {
                    return (copy, Err(e));
                }
            }
            (copy, Ok(()))
        });
        Self { worker_id, frames: Some(frames), task }
    }

    /// Closes the queue and waits until the task sent what it held.
    async fn finish(mut self) -> std::result::Result<WriteCopy, String> {
        self.frames = None;
        match (&mut self.task).await {
            Ok((copy, Ok(()))) => Ok(copy),
            Ok((_, Err(e))) => Err(e),
            Err(e) => Err(format!("write to {}: the sending task ended: {e}", self.worker_id)),
        }
    }
}

impl Drop for Pump {
    /// A dropped writer must not go on sending: its connection closes, and the worker
    /// discards what it got.
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One worker taking a copy of the write.
struct WriteCopy {
    worker_id: String,
    addr: String,
    stream: Option<WriteConn>,
}

/// The writer's connection: registered with the runtime, or parked (detached from it) between
/// calls of a host that may replace its runtime (the Python binding does, around `fork`).
enum WriteConn {
    Live(DataStream),
    Parked(ParkedStream),
}

impl WriteCopy {
    /// The connection, attached to the runtime this runs in.
    fn live(&mut self) -> Result<&mut DataStream> {
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

    fn park(&mut self) -> Result<()> {
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

    /// Sends `data` as data frames.
    async fn send(&mut self, mut data: &[u8], timeout: Duration) -> std::result::Result<(), String> {
        let addr = self.addr.clone();
        let stream = self.live().map_err(|e| e.to_string())?;
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
                    return Err(format!("write to {addr} failed: {e}"));
                }
                Err(_) => {
                    self.stream = None;
                    return Err(format!("write to {addr} timed out"));
                }
            }
            data = &data[n..];
        }
        Ok(())
    }

    /// Ends the stream (naming `holders` to a write-back primary) and reads the answer.
    async fn end(
        &mut self,
        holders: &[String],
        timeout: Duration,
    ) -> std::result::Result<(), TransportError> {
        let addr = self.addr.clone();
        let mut stream = match self.live() {
            Ok(_) => match self.stream.take() {
                Some(WriteConn::Live(s)) => s,
                _ => unreachable!("live attached it"),
            },
            Err(e) => return Err(TransportError::Protocol { addr, reason: e.to_string() }),
        };
        let end = async {
            stream.write_all(&frame::write_end(holders)).await.map_err(|e| io_err(&addr, e))?;
            stream.flush().await.map_err(|e| io_err(&addr, e))?;
            read_answer(&mut stream, &addr).await
        };
        tokio::time::timeout(timeout, end)
            .await
            .unwrap_or_else(|_| Err(TransportError::Timeout { addr: addr.clone() }))
    }
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

    /// Detaches the connections from the current runtime, so that the runtime can be shut down
    /// while the write stays open; the next write or `close` attaches them to the runtime it
    /// runs in. Must be called inside the runtime that owns the connections.
    /// With several copies, call [`settle`](Self::settle) first: their connections are with
    /// tasks of the runtime between the first write and `settle`.
    pub fn park(&mut self) -> Result<()> {
        if !self.pumps.is_empty() {
            return Err(ClientError::InvalidArgument(
                "a writer with copies being sent cannot be parked: settle it first".into(),
            ));
        }
        for copy in &mut self.copies {
            copy.park()?;
        }
        Ok(())
    }

    /// Continues the write with another client (of a new runtime) for the metadata calls at
    /// `close`; returns the one it used before. Call only while the connection is parked.
    pub fn rebind(&mut self, client: Client) -> Client {
        std::mem::replace(&mut self.client, client)
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

    /// Sends to every copy. The primary failing fails the write; a replica failing is dropped
    /// (the primary then decides whether enough copies are left). One copy is sent from the
    /// caller's bytes; several are queued to a task each (see [`QUEUED_FRAMES`]), so an error
    /// of theirs may surface at a later call or at `close`.
    async fn send(&mut self, data: &[u8]) -> Result<()> {
        let timeout = self.timeout();
        // Once queued, always queued: a replica dropped on the way leaves the primary with its task.
        if !self.pumps.is_empty() || self.copies.len() > 1 {
            return self.queue(data, timeout).await;
        }
        if self.copies.is_empty() {
            return Err(ClientError::InvalidArgument("writer is closed".into()));
        }
        let results = futures::future::join_all(self.copies.iter_mut().map(|c| c.send(data, timeout))).await;
        let mut kept = Vec::with_capacity(self.copies.len());
        let mut primary_err = None;
        for (i, (copy, result)) in std::mem::take(&mut self.copies).into_iter().zip(results).enumerate() {
            match result {
                Ok(()) => kept.push(copy),
                Err(e) if i == 0 => primary_err = Some(e),
                Err(e) => {
                    warn!(path = %self.path, worker = %copy.worker_id, err = %e, "a write-back replica failed; going on without it");
                    self.dropped.push(format!("{}: {e}", copy.worker_id));
                }
            }
        }
        if let Some(e) = primary_err {
            // Dropping the others aborts them.
            return Err(ClientError::unavailable(e));
        }
        self.copies = kept;
        Ok(())
    }

    /// Queues `data` to every copy's task (starting them on the first call), a frame at a time.
    async fn queue(&mut self, data: &[u8], timeout: Duration) -> Result<()> {
        if self.pumps.is_empty() {
            self.pumps =
                std::mem::take(&mut self.copies).into_iter().map(|c| Pump::start(c, timeout)).collect();
        }
        for frame in data.chunks(MAX_WRITE_CHUNK) {
            let frame = Bytes::copy_from_slice(frame);
            let mut i = 0;
            while i < self.pumps.len() {
                let taken = match &self.pumps[i].frames {
                    Some(frames) => frames.send(frame.clone()).await.is_ok(),
                    None => false,
                };
                if taken {
                    i += 1;
                    continue;
                }
                // Its task ended: it holds the reason.
                let pump = self.pumps.remove(i);
                let worker_id = pump.worker_id.clone();
                let reason = match pump.finish().await {
                    Ok(_) => format!("write to {worker_id}: the sending task stopped"),
                    Err(e) => e,
                };
                self.lost_copy(i, worker_id, reason)?;
            }
        }
        Ok(())
    }

    /// A copy failed: the primary (`rank` 0) fails the write (dropping the others aborts
    /// them), a replica is left out.
    fn lost_copy(&mut self, rank: usize, worker_id: String, reason: String) -> Result<()> {
        if rank == 0 {
            self.pumps.clear();
            self.copies.clear();
            return Err(ClientError::unavailable(reason));
        }
        warn!(path = %self.path, worker = %worker_id, err = %reason, "a write-back replica failed; going on without it");
        self.dropped.push(format!("{worker_id}: {reason}"));
        Ok(())
    }

    /// Waits until every queued frame was sent and takes the copies' connections back from
    /// their tasks (needed before [`park`](Self::park)). Errors as a write's.
    pub async fn settle(&mut self) -> Result<()> {
        if self.pumps.is_empty() {
            return Ok(());
        }
        let pumps = std::mem::take(&mut self.pumps);
        let mut copies = Vec::with_capacity(pumps.len());
        let mut failed = Vec::new();
        for (rank, pump) in pumps.into_iter().enumerate() {
            let worker_id = pump.worker_id.clone();
            match pump.finish().await {
                Ok(copy) => copies.push(copy),
                Err(e) => failed.push((rank, worker_id, e)),
            }
        }
        self.copies = copies;
        // The primary's failure first: it fails the write whatever the replicas did.
        failed.sort_by_key(|(rank, ..)| *rank);
        for (rank, worker_id, reason) in failed {
            self.lost_copy(rank, worker_id, reason)?;
        }
        Ok(())
    }

    /// Commits the file and returns its new metadata.
    pub async fn close(&mut self) -> Result<FileInfo> {
        if !self.gathered.is_empty() {
            let gathered = std::mem::take(&mut self.gathered);
            self.send(&gathered).await?;
        }
        self.settle().await?;
        if self.copies.is_empty() {
            return Err(ClientError::InvalidArgument("writer is closed".into()));
        }
        let timeout = self.timeout();
        let mut copies = std::mem::take(&mut self.copies);
        let mut primary = copies.remove(0);
        // Replicas first: each answers once its journal is durable.
        let ends = futures::future::join_all(copies.iter_mut().map(|c| c.end(&[], timeout))).await;
        let mut holders = Vec::new();
        for (copy, result) in copies.iter().zip(ends) {
            match result {
                Ok(()) => holders.push(copy.worker_id.clone()),
                Err(e) => {
                    warn!(path = %self.path, worker = %copy.worker_id, err = %e, "a write-back replica did not take the file");
                    self.dropped.push(format!("{}: {e}", copy.worker_id));
                }
            }
        }
        let answer = primary.end(&holders, timeout).await;
        // Whatever the outcome, what we knew of this file may be stale now.
        let forgot = self.client.invalidate(&self.path).await;
        if let Err(e) = answer {
            let mut e = ClientError::from_transport(e);
            if !self.dropped.is_empty() {
                e = e.with_context(&format!("replicas that failed: {}", self.dropped.join("; ")));
            }
            return Err(e);
        }
        if let Err(e) = forgot {
            warn!(path = %self.path, err = %e, "written, but the master's metadata cache was not invalidated");
        }
        self.client.stat_with(&self.path, true).await
    }

    /// Drops the write; the old file stays.
    pub fn abort(&mut self) {
        self.pumps.clear();
        self.copies.clear();
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
