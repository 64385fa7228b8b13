//! The worker's write path: a file streamed on the data plane (see the write frames in
//! `strata_common::frame`) replaces the object in the UFS — at once (write-through), or through
//! this worker's write-back journal, uploaded later (write-back, docs/WRITEBACK.md). Mount
//! credentials stay in the cluster: the client never talks to the UFS.
//!
//! Nothing is cached on the way: the new object has a new version, so its blocks get new keys
//! and the next read fetches them; blocks of the old version can no longer be asked for (a
//! client learns the new version from the master) and age out. A write-back file is read from
//! its holders' journals until it is uploaded.

use std::io;
use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use strata_common::frame::{
    self, MAX_ERROR_MESSAGE, REQUEST_HEADER_LEN, ResponseHeader, Source, WriteBackCopy, WriteBegin,
};
use strata_common::{ErrorKind, MountMode, OnFull};
use strata_ufs::{UfsError, UfsWriter};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tracing::{debug, info, warn};

use crate::blocks::BlockService;
use crate::journal::{JournalWriter, ReceiveError, is_disk_full};
use crate::metrics_defs as m;
use crate::mounts::Resolved;
use crate::writeback::{CommitWrite, WriteBack};

/// Serves one write whose `WriteBegin` header (with `body_len`) was just read. Returns once the
/// write is answered; an `Err` means the connection must close.
/// `allow` says whether the connection's caller may write the path `WriteBegin` names.
pub(super) async fn serve_write<S>(
    stream: &mut S,
    blocks: &BlockService,
    writeback: Option<&Arc<WriteBack>>,
    body_len: usize,
    allow: impl FnOnce(&str) -> Result<(), (ErrorKind, String)>,
) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut ended = WriteOutcome::Refused;
    let result = write_file(stream, blocks, writeback, body_len, allow, &mut ended).await;
    blocks.count_write(ended.label());
    result
}

/// How a write ended, for the counters.
enum WriteOutcome {
    /// Never started: refused at `WriteBegin` (or its body was malformed).
    Refused,
    /// Started, then dropped: the old file stays.
    Aborted,
    Committed,
}

impl WriteOutcome {
    fn label(&self) -> &'static str {
        match self {
            WriteOutcome::Refused => "refused",
            WriteOutcome::Aborted => "aborted",
            WriteOutcome::Committed => "committed",
        }
    }
}

async fn write_file<S>(
    stream: &mut S,
    blocks: &BlockService,
    writeback: Option<&Arc<WriteBack>>,
    body_len: usize,
    allow: impl FnOnce(&str) -> Result<(), (ErrorKind, String)>,
    ended: &mut WriteOutcome,
) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut body = vec![0u8; body_len];
    stream.read_exact(&mut body).await?;
    let (begin, flags) = match WriteBegin::decode(&body) {
        Ok(b) => b,
        Err(e) => {
            respond(stream, 0, Err((ErrorKind::BadFrame, e.to_string()))).await?;
            return Err(io::Error::new(io::ErrorKind::InvalidData, e));
        }
    };
    if let Err(refused) = allow(&begin.path) {
        debug!(path = %begin.path, err = %refused.1, "write refused");
        return respond(stream, begin.req_id, Err(refused)).await;
    }
    let started = Instant::now();
    let resolved = match blocks.writable(&begin.path).await {
        Ok(r) => r,
        Err(e) => {
            debug!(path = %begin.path, err = %e, "write refused");
            return respond(stream, begin.req_id, Err((e.kind(), e.to_string()))).await;
        }
    };
    if flags.append
        && let Err(refused) = appendable(&resolved)
    {
        debug!(path = %begin.path, err = %refused.1, "append refused");
        return respond(stream, begin.req_id, Err(refused)).await;
    }
    match (resolved.mount.mode, &begin.write_back, writeback) {
        (MountMode::WriteBack, Some(copy), Some(wb)) => {
            return write_back(stream, wb, &resolved, &begin, copy, ended).await;
        }
        (MountMode::WriteBack, None, _) => {
            let msg = format!(
                "{} is on the write-back mount {}: this client writes through only (upgrade it)",
                resolved.path, resolved.mount.path
            );
            return respond(stream, begin.req_id, Err((ErrorKind::InvalidArgument, msg))).await;
        }
        (MountMode::WriteBack, Some(_), None) => {
            let msg = "this process (a sidecar) does not take write-back writes".to_string();
            return respond(stream, begin.req_id, Err((ErrorKind::Unavailable, msg))).await;
        }
        (_, Some(_), _) => {
            let msg = format!(
                "the mount {} is {} now, not write-back (stale client mount table?)",
                resolved.mount.path, resolved.mount.mode
            );
            return respond(stream, begin.req_id, Err((ErrorKind::InvalidArgument, msg))).await;
        }
        (_, None, _) => {}
    }
    let opened = if flags.append {
        appender_of(&resolved).await
    } else {
        BlockService::writer_of(&resolved).await.map_err(|e| (e.kind(), e.to_string()))
    };
    let mut writer = match opened {
        Ok(w) => w,
        Err(refused) => {
            debug!(path = %begin.path, err = %refused.1, "write refused");
            return respond(stream, begin.req_id, Err(refused)).await;
        }
    };
    // From here on a write that does not commit is an abort.
    *ended = WriteOutcome::Aborted;
    respond(stream, begin.req_id, Ok(())).await?;
    // The first failure is kept and answered at WriteEnd; data frames after it are read and
    // dropped so the connection's framing stays intact.
    let mut failed: Option<UfsError> = None;
    let mut written = 0u64;
    let mut header = [0u8; REQUEST_HEADER_LEN];
    loop {
        if let Err(e) = stream.read_exact(&mut header).await {
            // The client went away before WriteEnd: the old object stays.
            let _ = writer.abort().await;
            return Err(e);
        }
        match frame::decode_request_header(&header) {
            Ok((frame::Op::WriteData, len)) => {
                let mut data = BytesMut::zeroed(len);
                if let Err(e) = stream.read_exact(&mut data).await {
                    let _ = writer.abort().await;
                    return Err(e);
                }
                if failed.is_none() {
                    written += len as u64;
                    if let Err(e) = writer.write(data.freeze()).await {
                        failed = Some(e);
                    }
                }
            }
            Ok((frame::Op::WriteEnd, len)) => {
                // A write-through stream ends with an empty body; anything else is dropped.
                let mut body = vec![0u8; len];
                if let Err(e) = stream.read_exact(&mut body).await {
                    let _ = writer.abort().await;
                    return Err(e);
                }
                break;
            }
            Ok((op, _)) => {
                let _ = writer.abort().await;
                let msg = format!("{op:?} inside a write");
                respond(stream, begin.req_id, Err((ErrorKind::BadFrame, msg.clone()))).await?;
                return Err(io::Error::new(io::ErrorKind::InvalidData, msg));
            }
            Err(e) => {
                let _ = writer.abort().await;
                respond(stream, begin.req_id, Err((ErrorKind::BadFrame, e.to_string()))).await?;
                return Err(io::Error::new(io::ErrorKind::InvalidData, e));
            }
        }
    }
    let outcome = match failed {
        Some(e) => {
            let _ = writer.abort().await;
            Err(e)
        }
        None => writer.close().await,
    };
    match outcome {
        Ok(()) => {
            *ended = WriteOutcome::Committed;
            info!(path = %begin.path, bytes = written, ms = started.elapsed().as_millis() as u64, "file written");
            respond(stream, begin.req_id, Ok(())).await
        }
        Err(e) => {
            debug!(path = %begin.path, err = %e, "write failed");
            respond(stream, begin.req_id, Err((e.kind(), format!("{}: {e}", begin.path)))).await
        }
    }
}

/// Whether a file of this mount may be appended to: a write-through mount whose UFS can append
/// (stage, append, rename: a local directory). Object stores cannot append to an object, and a
/// write-back mount's journal holds whole files only.
fn appendable(resolved: &Resolved) -> Result<(), (ErrorKind, String)> {
    let mount = &resolved.mount;
    if mount.mode != MountMode::WriteThrough {
        let msg = format!(
            "cannot append to {}: the mount {} is {}, and appends need mode=write-through",
            resolved.path, mount.path, mount.mode
        );
        return Err((ErrorKind::InvalidArgument, msg));
    }
    match mount.ufs.as_write().map(|w| w.capabilities().append) {
        Some(true) => Ok(()),
        _ => {
            let scheme = mount.uri.split("://").next().unwrap_or_default();
            let msg = format!(
                "cannot append to {}: the UFS of {} ({scheme}) cannot append to a file (object stores \
                 cannot; write the whole file instead)",
                resolved.path, mount.path
            );
            Err((ErrorKind::InvalidArgument, msg))
        }
    }
}

/// A UFS writer that appends to the file (checked [`appendable`]).
async fn appender_of(resolved: &Resolved) -> Result<Box<dyn UfsWriter>, (ErrorKind, String)> {
    let ufs =
        resolved.mount.ufs.as_write().ok_or_else(|| {
            (ErrorKind::PermissionDenied, format!("{} is on a read-only mount", resolved.path))
        })?;
    ufs.appender(&resolved.rel).await.map_err(|e| (e.kind(), format!("{}: {e}", resolved.path)))
}

async fn respond<S: AsyncWrite + Unpin>(
    stream: &mut S,
    req_id: u64,
    outcome: Result<(), (ErrorKind, String)>,
) -> io::Result<()> {
    let (status, msg) = match &outcome {
        Ok(()) => (Ok(Source::Ufs), &b""[..]),
        Err((kind, m)) => (Err(*kind), &m.as_bytes()[..m.len().min(MAX_ERROR_MESSAGE)]),
    };
    let head = ResponseHeader { status, req_id, payload_len: msg.len() as u64 }.encode();
    let mut out = Vec::with_capacity(head.len() + msg.len());
    out.extend_from_slice(&head);
    out.extend_from_slice(msg);
    stream.write_all(&out).await?;
    stream.flush().await
}

/// Where a write-back copy's bytes go: the journal, or — the primary's journal disk being full
/// and the mount saying `on_full=write-through` — the UFS directly.
enum Sink {
    Journal(JournalWriter),
    Through(Box<dyn UfsWriter>),
}

/// Why a write-back copy failed, answered at `WriteEnd`.
struct Failed {
    kind: ErrorKind,
    message: String,
}

/// One copy of a write-back write: rank 0 (the primary) commits it with the master once the
/// replicas the client names at `WriteEnd` and its own journal hold it durably; a replica
/// answers once its journal does.
async fn write_back<S>(
    stream: &mut S,
    wb: &Arc<WriteBack>,
    resolved: &Resolved,
    begin: &WriteBegin,
    copy: &WriteBackCopy,
    ended: &mut WriteOutcome,
) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let started = Instant::now();
    let options = &resolved.mount.options;
    let primary = copy.rank == 0;
    let full_message = |e: &io::Error| {
        format!(
            "{}: the write-back journal disk of worker {} is full ({e}); nothing was written \
             (the mount's on_full=write-through would write it through to the UFS instead)",
            resolved.path,
            wb.worker_id()
        )
    };
    let mut failed: Option<Failed> = None;
    let mut sink = match wb.journal().begin(&copy.write_id, &resolved.path).await {
        Ok(j) => Some(Sink::Journal(j)),
        Err(e) if is_disk_full(&e) && primary && options.on_full == OnFull::WriteThrough => {
            metrics::counter!(m::WRITEBACK_DISK_FULL, "fallback" => "write-through").increment(1);
            match BlockService::writer_of(resolved).await {
                Ok(w) => Some(Sink::Through(w)),
                Err(e) => return respond(stream, begin.req_id, Err((e.kind(), e.to_string()))).await,
            }
        }
        Err(e) if is_disk_full(&e) => {
            metrics::counter!(m::WRITEBACK_DISK_FULL, "fallback" => "refused").increment(1);
            return respond(stream, begin.req_id, Err((ErrorKind::ResourceExhausted, full_message(&e))))
                .await;
        }
        Err(e) => {
            let msg = format!("{}: write-back journal: {e}", resolved.path);
            return respond(stream, begin.req_id, Err((ErrorKind::Internal, msg))).await;
        }
    };
    *ended = WriteOutcome::Aborted;
    respond(stream, begin.req_id, Ok(())).await?;
    let mut header = [0u8; REQUEST_HEADER_LEN];
    let replicas = loop {
        // The client went away before WriteEnd: the journal (dropped with `sink`) goes.
        if let Err(e) = stream.read_exact(&mut header).await {
            abort_sink(sink).await;
            return Err(e);
        }
        match frame::decode_request_header(&header) {
            Ok((frame::Op::WriteData, len)) => {
                // A journal receives straight into its aligned buffers; a disk error there
                // comes once the frame is in, which the journal then holds (`data` is empty).
                let (written, data) = match sink.as_mut() {
                    Some(Sink::Journal(j)) if failed.is_none() => match j.receive(stream, len).await {
                        Ok(()) => (Ok(()), Bytes::new()),
                        Err(ReceiveError::Disk(e)) => (Err(e), Bytes::new()),
                        Err(ReceiveError::Stream(e)) => {
                            abort_sink(sink).await;
                            return Err(e);
                        }
                    },
                    _ => {
                        let mut data = BytesMut::zeroed(len);
                        if let Err(e) = stream.read_exact(&mut data).await {
                            abort_sink(sink).await;
                            return Err(e);
                        }
                        if failed.is_some() {
                            continue;
                        }
                        let data = data.freeze();
                        let written = match sink.as_mut() {
                            Some(Sink::Through(w)) => w.write(data.clone()).await.map_err(io::Error::other),
                            _ => Ok(()),
                        };
                        (written, data)
                    }
                };
                let Err(e) = written else { continue };
                if is_disk_full(&e) && primary && options.on_full == OnFull::WriteThrough {
                    metrics::counter!(m::WRITEBACK_DISK_FULL, "fallback" => "write-through").increment(1);
                    match switch_to_ufs(resolved, sink.take(), data).await {
                        Ok(w) => sink = Some(Sink::Through(w)),
                        Err(f) => failed = Some(f),
                    }
                } else if is_disk_full(&e) {
                    metrics::counter!(m::WRITEBACK_DISK_FULL, "fallback" => "refused").increment(1);
                    failed = Some(Failed { kind: ErrorKind::ResourceExhausted, message: full_message(&e) });
                } else {
                    let kind = if matches!(sink, Some(Sink::Through(_))) {
                        ErrorKind::Ufs
                    } else {
                        ErrorKind::Internal
                    };
                    failed = Some(Failed { kind, message: format!("{}: {e}", resolved.path) });
                }
                if failed.is_some() {
                    // Free the journal disk now, not when the client ends the stream.
                    abort_sink(sink.take()).await;
                }
            }
            Ok((frame::Op::WriteEnd, len)) => {
                let mut body = vec![0u8; len];
                if let Err(e) = stream.read_exact(&mut body).await {
                    abort_sink(sink).await;
                    return Err(e);
                }
                match frame::decode_write_end(&body) {
                    Ok(holders) => break holders,
                    Err(e) => {
                        abort_sink(sink).await;
                        respond(stream, begin.req_id, Err((ErrorKind::BadFrame, e.to_string()))).await?;
                        return Err(io::Error::new(io::ErrorKind::InvalidData, e));
                    }
                }
            }
            Ok((op, _)) => {
                abort_sink(sink).await;
                let msg = format!("{op:?} inside a write");
                respond(stream, begin.req_id, Err((ErrorKind::BadFrame, msg.clone()))).await?;
                return Err(io::Error::new(io::ErrorKind::InvalidData, msg));
            }
            Err(e) => {
                abort_sink(sink).await;
                respond(stream, begin.req_id, Err((ErrorKind::BadFrame, e.to_string()))).await?;
                return Err(io::Error::new(io::ErrorKind::InvalidData, e));
            }
        }
    };
    if let Some(f) = failed {
        abort_sink(sink).await;
        debug!(path = %resolved.path, err = %f.message, "write-back write failed");
        return respond(stream, begin.req_id, Err((f.kind, f.message))).await;
    }
    let mtime_ms = strata_common::clock::system().wall_ms();
    let outcome = match sink {
        Some(Sink::Journal(mut j)) => match j.finish(mtime_ms).await {
            Ok(_) if !primary => Ok(()),
            Ok(record) => commit_primary(wb, resolved, copy, record.size, mtime_ms, replicas).await,
            // The disk filled up with the last bytes (they are written behind the stream).
            Err(e) if is_disk_full(&e) && primary && options.on_full == OnFull::WriteThrough => {
                metrics::counter!(m::WRITEBACK_DISK_FULL, "fallback" => "write-through").increment(1);
                match switch_to_ufs(resolved, Some(Sink::Journal(j)), Bytes::new()).await {
                    Ok(mut w) => match w.close().await {
                        Ok(()) => commit_through(wb, resolved, copy, mtime_ms).await,
                        Err(e) => Err((e.kind(), format!("{}: {e}", resolved.path))),
                    },
                    Err(f) => Err((f.kind, f.message)),
                }
            }
            Err(e) if is_disk_full(&e) => {
                metrics::counter!(m::WRITEBACK_DISK_FULL, "fallback" => "refused").increment(1);
                Err((ErrorKind::ResourceExhausted, full_message(&e)))
            }
            Err(e) => Err((ErrorKind::Internal, format!("{}: write-back journal: {e}", resolved.path))),
        },
        Some(Sink::Through(mut w)) => match w.close().await {
            Ok(()) => commit_through(wb, resolved, copy, mtime_ms).await,
            Err(e) => Err((e.kind(), format!("{}: {e}", resolved.path))),
        },
        None => Err((ErrorKind::Internal, "write-back sink lost".to_string())),
    };
    match outcome {
        Ok(()) => {
            *ended = WriteOutcome::Committed;
            let ms = started.elapsed().as_millis() as u64;
            info!(path = %resolved.path, write_id = %copy.write_id, rank = copy.rank, ms, "write-back copy durable");
            respond(stream, begin.req_id, Ok(())).await
        }
        Err((kind, message)) => {
            // Not acknowledged: this copy must never be uploaded.
            wb.journal().remove(&copy.write_id);
            debug!(path = %resolved.path, err = %message, "write-back write failed");
            respond(stream, begin.req_id, Err((kind, message))).await
        }
    }
}

/// Drops an unfinished copy: a journal is deleted with its writer, a UFS write is aborted.
async fn abort_sink(sink: Option<Sink>) {
    if let Some(Sink::Through(mut w)) = sink {
        let _ = w.abort().await;
    }
}

/// The primary's journal filled up mid-stream: what it holds plus `data` go to a UFS writer,
/// which takes the rest of the stream.
async fn switch_to_ufs(
    resolved: &Resolved,
    sink: Option<Sink>,
    data: Bytes,
) -> Result<Box<dyn UfsWriter>, Failed> {
    let ufs_err = |e: UfsError| Failed { kind: e.kind(), message: format!("{}: {e}", resolved.path) };
    let mut writer = BlockService::writer_of(resolved)
        .await
        .map_err(|e| Failed { kind: e.kind(), message: e.to_string() })?;
    if let Some(Sink::Journal(mut j)) = sink {
        let so_far = j.written().await.map_err(|e| Failed {
            kind: ErrorKind::Internal,
            message: format!("{}: write-back journal: {e}", resolved.path),
        })?;
        warn!(path = %resolved.path, bytes = so_far.len(), "write-back journal disk full; writing through");
        writer.write(so_far).await.map_err(ufs_err)?;
        // `j` drops here, deleting the partial journal.
    }
    if !data.is_empty() {
        writer.write(data).await.map_err(ufs_err)?;
    }
    Ok(writer)
}

/// The primary's journal is durable: with the replicas' it makes `write_replicas` copies, or
/// the write is refused (or, `on_full=write-through`, written through from the journal).
async fn commit_primary(
    wb: &Arc<WriteBack>,
    resolved: &Resolved,
    copy: &WriteBackCopy,
    size: u64,
    mtime_ms: i64,
    replicas: Vec<String>,
) -> Result<(), (ErrorKind, String)> {
    let mut holders = vec![wb.worker_id().to_string()];
    for r in replicas {
        if !holders.contains(&r) {
            holders.push(r);
        }
    }
    let wanted = resolved.mount.options.write_replicas as usize;
    if holders.len() < wanted {
        if resolved.mount.options.on_full == OnFull::WriteThrough {
            warn!(path = %resolved.path, copies = holders.len(), wanted, "too few write-back copies; writing through");
            let bytes =
                wb.journal().read_at(&copy.write_id, 0, size).await.map_err(|e| {
                    (ErrorKind::Internal, format!("{}: write-back journal: {e}", resolved.path))
                })?;
            let mut w = BlockService::writer_of(resolved).await.map_err(|e| (e.kind(), e.to_string()))?;
            let written = match w.write(bytes).await {
                Ok(()) => w.close().await,
                Err(e) => {
                    let _ = w.abort().await;
                    Err(e)
                }
            };
            written.map_err(|e| (e.kind(), format!("{}: {e}", resolved.path)))?;
            wb.journal().remove(&copy.write_id);
            return commit_through(wb, resolved, copy, mtime_ms).await;
        }
        return Err((
            ErrorKind::Unavailable,
            format!(
                "{}: only {} of the {wanted} workers the mount's write_replicas asks for hold the file \
                 durably; not acknowledged",
                resolved.path,
                holders.len()
            ),
        ));
    }
    let commit = CommitWrite {
        path: resolved.path.clone(),
        write_id: copy.write_id.clone(),
        size,
        mtime_ms,
        holders,
        persisted: false,
    };
    match wb.commit(commit).await {
        Ok(upload_now) => {
            if upload_now {
                wb.upload(copy.write_id.clone());
            }
            Ok(())
        }
        Err(e) => Err((
            ErrorKind::Unavailable,
            format!("{}: the master did not take the write ({e}); not acknowledged", resolved.path),
        )),
    }
}

/// A write-back write that went through to the UFS: the master must know, so no older
/// pending version is uploaded over it.
async fn commit_through(
    wb: &Arc<WriteBack>,
    resolved: &Resolved,
    copy: &WriteBackCopy,
    mtime_ms: i64,
) -> Result<(), (ErrorKind, String)> {
    let commit = CommitWrite {
        path: resolved.path.clone(),
        write_id: copy.write_id.clone(),
        size: 0,
        mtime_ms,
        holders: vec![wb.worker_id().to_string()],
        persisted: true,
    };
    wb.commit(commit).await.map(|_| ()).map_err(|e| {
        (
            ErrorKind::Unavailable,
            format!("{}: written to the UFS, but the master was not told ({e})", resolved.path),
        )
    })
}
