//! The worker's write path (write-through): a file streamed on the data plane (see the write
//! frames in `strata_common::frame`) replaces the object in the UFS. Mount credentials stay in
//! the cluster: the client never talks to the UFS.
//!
//! Nothing is cached on the way: the new object has a new version, so its blocks get new keys
//! and the next read fetches them; blocks of the old version can no longer be asked for (a
//! client learns the new version from the master) and age out.

use std::io;
use std::time::Instant;

use bytes::BytesMut;
use strata_common::ErrorKind;
use strata_common::frame::{self, MAX_ERROR_MESSAGE, REQUEST_HEADER_LEN, ResponseHeader, Source, WriteBegin};
use strata_ufs::UfsError;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tracing::{debug, info};

use crate::blocks::BlockService;

/// Serves one write whose `WriteBegin` header (with `body_len`) was just read. Returns once the
/// write is answered; an `Err` means the connection must close.
/// `allow` says whether the connection's caller may write the path `WriteBegin` names.
pub(super) async fn serve_write<S>(
    stream: &mut S,
    blocks: &BlockService,
    body_len: usize,
    allow: impl FnOnce(&str) -> Result<(), (ErrorKind, String)>,
) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut ended = WriteOutcome::Refused;
    let result = write_file(stream, blocks, body_len, allow, &mut ended).await;
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
    body_len: usize,
    allow: impl FnOnce(&str) -> Result<(), (ErrorKind, String)>,
    ended: &mut WriteOutcome,
) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut body = vec![0u8; body_len];
    stream.read_exact(&mut body).await?;
    let begin = match WriteBegin::decode_body(&body) {
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
    let mut writer = match blocks.open_writer(&begin.path).await {
        Ok(w) => w,
        Err(e) => {
            debug!(path = %begin.path, err = %e, "write refused");
            return respond(stream, begin.req_id, Err((e.kind(), e.to_string()))).await;
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
            Ok((frame::Op::WriteEnd, _)) => break,
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
