//! `Op::Copy`: a file copied to another path by the worker, so no byte of it crosses the
//! client's connection (fsspec's `cp_file`, `copy`, and a `mv` where the UFS cannot rename).
//!
//! Two ways, chosen here:
//! - **by the UFS** — source and destination on the same mount, whose UFS copies by itself
//!   ([`WriteCapabilities::copy`](strata_ufs::WriteCapabilities): S3 CopyObject, a local
//!   directory's file copy, staged and renamed): no byte passes through the worker either. A
//!   service that refuses this copy (S3 copies at most 5 GiB at once) falls back to:
//! - **streamed** — the source's blocks read through this worker's [`BlockService`] (cached
//!   blocks are not read from the UFS again; missed ones are fetched once and kept) into the
//!   destination mount's UFS writer, the one writes use: a local directory stages the file and
//!   renames it at the end, an object store publishes it when its upload completes. Reads run
//!   ahead of the writer by at most [`READ_AHEAD_BYTES`].
//!
//! The answer comes once the destination exists in the UFS. The destination must be on a
//! `mode=write-through` mount: a write-back mount's files go through the journals of
//! `write_replicas` workers, which one worker's copy cannot make, so the client copies those
//! through its own write path instead (docs/PYTHON.md, "Copies and moves"). The token was
//! checked by the caller: read on the source, write on the destination.

use std::time::Instant;

use futures::{StreamExt, TryStreamExt};
use strata_common::frame::{CopyAnswer, CopyRequest, CopyVia, Source};
use strata_common::{ErrorKind, MountMode, block};
use strata_ufs::{UfsError, UfsWriter};
use thiserror::Error;
use tokio::io::AsyncWrite;
use tracing::{debug, info, warn};

use crate::blocks::{BlockRead, BlockService};
use crate::error::ServeError;
use crate::mounts::Resolved;

/// Bytes of source blocks read ahead of the destination's writer.
const READ_AHEAD_BYTES: u64 = 32 << 20;

/// Why a copy failed, answered with its kind.
#[derive(Debug, Error)]
enum CopyError {
    #[error(transparent)]
    Serve(#[from] ServeError),
    #[error("{path}: {source}")]
    Ufs { path: String, source: UfsError },
    #[error("{0}")]
    Invalid(String),
}

impl CopyError {
    fn kind(&self) -> ErrorKind {
        match self {
            CopyError::Serve(e) => e.kind(),
            CopyError::Ufs { source, .. } => source.kind(),
            CopyError::Invalid(_) => ErrorKind::InvalidArgument,
        }
    }

    fn ufs(path: &str) -> impl FnOnce(UfsError) -> CopyError + '_ {
        move |source| CopyError::Ufs { path: path.to_string(), source }
    }
}

/// Serves one `Copy` whose token checks passed; an `Err` means the connection must close.
pub(super) async fn serve_copy<S: AsyncWrite + Unpin>(
    stream: &mut S,
    blocks: &BlockService,
    req: &CopyRequest,
) -> std::io::Result<()> {
    let started = Instant::now();
    let mut started_writing = false;
    match copy_file(blocks, req, &mut started_writing).await {
        Ok(answer) => {
            blocks.count_write("committed");
            let via = match answer.via {
                CopyVia::Ufs => "ufs",
                CopyVia::Streamed => "streamed",
            };
            let ms = started.elapsed().as_millis() as u64;
            info!(src = %req.src, dst = %req.dst, via, bytes = answer.bytes, ms, "file copied");
            super::send_data(stream, req.req_id, Source::Ufs, &answer.encode()).await
        }
        Err(e) => {
            blocks.count_write(if started_writing { "aborted" } else { "refused" });
            debug!(src = %req.src, dst = %req.dst, err = %e, "copy failed");
            super::send_error(stream, req.req_id, e.kind(), &e.to_string()).await
        }
    }
}

async fn copy_file(
    blocks: &BlockService,
    req: &CopyRequest,
    started_writing: &mut bool,
) -> Result<CopyAnswer, CopyError> {
    let src = blocks.mounts().resolve(&req.src).await?;
    let dst = blocks.writable(&req.dst).await?;
    if src.rel.is_empty() {
        return Err(CopyError::Serve(UfsError::IsDirectory(format!("{} is a mount point", src.path)).into()));
    }
    if src.path == dst.path {
        return Err(CopyError::Invalid(format!("cannot copy {} onto itself", src.path)));
    }
    if dst.mount.mode != MountMode::WriteThrough {
        return Err(CopyError::Invalid(format!(
            "cannot copy to {}: the mount {} is {}; a worker copies to write-through mounts only \
             (clients copy to write-back mounts through their own write path)",
            dst.path, dst.mount.path, dst.mount.mode
        )));
    }
    let ufs = dst.mount.ufs.as_write().ok_or_else(|| ServeError::ReadOnly(dst.path.clone()))?;
    match dst.mount.ufs.stat(&dst.rel).await {
        Ok(meta) if meta.is_dir => {
            return Err(CopyError::Serve(
                UfsError::IsDirectory(format!("{} is a directory", dst.path)).into(),
            ));
        }
        Ok(_) | Err(UfsError::NotFound(_)) => {}
        Err(e) => return Err(CopyError::ufs(&dst.path)(e)),
    }
    // A write-back version lives in its holders' journals, not in the UFS: stream it.
    let write_back = block::write_back_id(&req.version).is_some();
    let (version, size) = if write_back {
        (req.version.clone(), req.size)
    } else {
        let meta = src.mount.ufs.stat(&src.rel).await.map_err(CopyError::ufs(&src.path))?;
        if meta.is_dir {
            return Err(CopyError::Serve(
                UfsError::IsDirectory(format!("{} is a directory", src.path)).into(),
            ));
        }
        (meta.version, meta.size)
    };
    let same_ufs = std::sync::Arc::ptr_eq(&src.mount, &dst.mount);
    if same_ufs && !write_back && ufs.capabilities().copy {
        *started_writing = true;
        match ufs.copy(&src.rel, &dst.rel).await {
            Ok(()) => return Ok(CopyAnswer { via: CopyVia::Ufs, bytes: size }),
            Err(e @ (UfsError::NotFound(_) | UfsError::PermissionDenied(_) | UfsError::IsDirectory(_))) => {
                return Err(CopyError::Ufs {
                    path: format!("copy of {} to {}", src.path, dst.path),
                    source: e,
                });
            }
            Err(e) => {
                warn!(src = %src.path, dst = %dst.path, err = %e, "the UFS refused the copy; streaming it");
            }
        }
    }
    let mut writer = BlockService::writer_of(&dst).await?;
    *started_writing = true;
    match stream_blocks(blocks, &src, &version, size, &dst.path, writer.as_mut()).await {
        Ok(()) => {
            writer.close().await.map_err(CopyError::ufs(&dst.path))?;
            Ok(CopyAnswer { via: CopyVia::Streamed, bytes: size })
        }
        Err(e) => {
            let _ = writer.abort().await;
            Err(e)
        }
    }
}

/// Every block of one version of `src`, in order, read through the block service (at most
/// [`READ_AHEAD_BYTES`] ahead) into `writer`.
async fn stream_blocks(
    blocks: &BlockService,
    src: &Resolved,
    version: &str,
    size: u64,
    dst: &str,
    writer: &mut dyn UfsWriter,
) -> Result<(), CopyError> {
    let block_size = src.mount.block_size;
    let ahead = (READ_AHEAD_BYTES / block_size.max(1)).max(1) as usize;
    let mut reads = futures::stream::iter(0..block::block_count(size, block_size))
        .map(|index| {
            let read = BlockRead::whole_block(&src.path, version, size, block_size, index);
            async move { blocks.read(&read).await.map(|(bytes, _)| bytes) }
        })
        .buffered(ahead);
    while let Some(bytes) = reads.try_next().await? {
        writer.write(bytes).await.map_err(CopyError::ufs(dst))?;
    }
    Ok(())
}
