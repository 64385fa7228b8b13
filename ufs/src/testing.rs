//! Wrappers for tests: count what reaches the UFS, and make it fail or stall on demand.
//!
//! Built only for tests (this crate's, and other crates' through the `testing` feature), so no
//! production binary carries a UFS that can be told to fail.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::{self, BoxStream};
use futures::{StreamExt, TryStreamExt, future};

use crate::{ObjectMeta, Result, Ufs, UfsEntry, UfsError, UfsFactory, UfsFile};

/// Counters shared by every UFS a [`CountingFactory`] opens.
#[derive(Debug, Default)]
pub struct UfsCounters {
    pub stats: AtomicU64,
    pub lists: AtomicU64,
    pub reads: AtomicU64,
    pub bytes_read: AtomicU64,
    /// Copies made by the service ([`UfsWrite::copy`](crate::UfsWrite::copy)), renames in
    /// place, and appenders opened.
    pub copies: AtomicU64,
    pub renames: AtomicU64,
    pub appends: AtomicU64,
}

impl UfsCounters {
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::SeqCst)
    }
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::SeqCst)
    }
    pub fn stats(&self) -> u64 {
        self.stats.load(Ordering::SeqCst)
    }
    pub fn copies(&self) -> u64 {
        self.copies.load(Ordering::SeqCst)
    }
    pub fn renames(&self) -> u64 {
        self.renames.load(Ordering::SeqCst)
    }
}

/// Faults to inject, shared by every UFS a [`CountingFactory`] opens.
#[derive(Debug, Default)]
pub struct UfsFaults {
    /// The next N reads fail with a temporary error.
    pub fail_next_reads: AtomicU64,
    /// The next N streamed reads ([`Ufs::read_stream`]) yield the first half of their first
    /// piece, then fail with a temporary error: a store whose connection breaks in the middle of
    /// a body.
    pub break_next_streams: AtomicU64,
    /// Says the store refuses other versions before the first byte
    /// ([`Ufs::checks_version_first`]) whatever the inner UFS says: a local directory standing
    /// in for an object store with `If-Match`.
    pub claim_version_first: std::sync::atomic::AtomicBool,
    /// Holds streamed reads after their first piece, as a slow store would.
    pub stream_gate: StreamGate,
    /// Every read first sleeps this many milliseconds.
    pub read_delay_ms: AtomicU64,
    /// The next N writers refuse to open with a temporary error (a UFS answering 500s).
    pub fail_next_writes: AtomicU64,
    /// Writers opened (counted whether or not they then fail).
    pub writers_opened: AtomicU64,
    /// The next N copies by the service are refused (as S3 refuses a CopyObject over 5 GiB).
    pub refuse_next_copies: AtomicU64,
}

/// While `held`, every streamed read waits once it has yielded `after_bytes` (and at least one
/// piece), before its next piece or its end, for a permit of `permits`, one per read.
pub struct StreamGate {
    pub held: std::sync::atomic::AtomicBool,
    pub after_bytes: AtomicU64,
    pub permits: tokio::sync::Semaphore,
    /// Streamed reads waiting at the gate now.
    pub waiting: AtomicU64,
}

impl Default for StreamGate {
    fn default() -> Self {
        Self {
            held: false.into(),
            after_bytes: AtomicU64::new(0),
            permits: tokio::sync::Semaphore::new(0),
            waiting: AtomicU64::new(0),
        }
    }
}

impl std::fmt::Debug for StreamGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamGate").field("held", &self.held).field("waiting", &self.waiting).finish()
    }
}

impl StreamGate {
    async fn pass(&self) {
        if self.held.load(Ordering::SeqCst) {
            self.waiting.fetch_add(1, Ordering::SeqCst);
            self.permits.acquire().await.expect("never closed").forget();
            self.waiting.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

pub struct CountingUfs {
    inner: Arc<dyn Ufs>,
    counters: Arc<UfsCounters>,
    faults: Arc<UfsFaults>,
}

#[async_trait]
impl Ufs for CountingUfs {
    fn as_write(&self) -> Option<&dyn crate::UfsWrite> {
        self.inner.as_write().map(|_| self as &dyn crate::UfsWrite)
    }

    async fn stat(&self, path: &str) -> Result<ObjectMeta> {
        self.counters.stats.fetch_add(1, Ordering::SeqCst);
        self.inner.stat(path).await
    }

    async fn list(&self, dir: &str) -> Result<Vec<UfsEntry>> {
        self.counters.lists.fetch_add(1, Ordering::SeqCst);
        self.inner.list(dir).await
    }

    // The inner UFS's own recursive listing (an object store's ordered one), not a walk over
    // this wrapper's `list`: tests must see what production does.
    fn list_recursive<'a>(
        &'a self,
        dir: &'a str,
        start_after: Option<&'a str>,
    ) -> BoxStream<'a, Result<UfsFile>> {
        self.counters.lists.fetch_add(1, Ordering::SeqCst);
        self.inner.list_recursive(dir, start_after)
    }

    fn lists_recursively(&self) -> bool {
        self.inner.lists_recursively()
    }

    async fn read_range(&self, path: &str, range: Range<u64>, version: &str) -> Result<Bytes> {
        let delay = self.faults.read_delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        let injected = self
            .faults
            .fail_next_reads
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if injected {
            return Err(UfsError::Temporary(format!("{path}: injected fault")));
        }
        let bytes = self.inner.read_range(path, range, version).await?;
        self.counters.reads.fetch_add(1, Ordering::SeqCst);
        self.counters.bytes_read.fetch_add(bytes.len() as u64, Ordering::SeqCst);
        Ok(bytes)
    }

    fn checks_version_first(&self) -> bool {
        self.faults.claim_version_first.load(Ordering::SeqCst) || self.inner.checks_version_first()
    }

    fn read_stream<'a>(
        &'a self,
        path: &'a str,
        range: Range<u64>,
        version: &'a str,
    ) -> BoxStream<'a, Result<Bytes>> {
        let opened = async move {
            let delay = self.faults.read_delay_ms.load(Ordering::SeqCst);
            if delay > 0 {
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            let take = |n: &AtomicU64| {
                n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
            };
            if take(&self.faults.fail_next_reads) {
                return Err(UfsError::Temporary(format!("{path}: injected fault")));
            }
            let pieces = self.inner.read_stream(path, range, version);
            let pieces = if take(&self.faults.break_next_streams) {
                let broken = UfsError::Temporary(format!("{path}: injected fault in the first piece"));
                let half = pieces.take(1).map_ok(|piece| piece.slice(..piece.len() / 2));
                half.chain(stream::once(future::ready(Err(broken)))).boxed()
            } else {
                pieces
            };
            // The gate stands before the first item (the next piece, or the end of the stream)
            // after `after_bytes` went by.
            let gate = &self.faults.stream_gate;
            let after = gate.after_bytes.load(Ordering::SeqCst);
            let (mut yielded, mut pieces_yielded, mut gated) = (0u64, 0usize, false);
            let pieces = pieces
                .map(Some)
                .chain(stream::once(future::ready(None)))
                .then(move |item| {
                    let at_gate = !gated && pieces_yielded > 0 && yielded >= after;
                    gated |= at_gate;
                    if let Some(Ok(piece)) = &item {
                        yielded += piece.len() as u64;
                        pieces_yielded += 1;
                    }
                    async move {
                        if at_gate {
                            gate.pass().await;
                        }
                        item
                    }
                })
                .filter_map(future::ready);
            let counted = pieces
                .inspect_ok(|piece| {
                    self.counters.bytes_read.fetch_add(piece.len() as u64, Ordering::SeqCst);
                })
                .map_ok(Some)
                .chain(stream::once(async {
                    self.counters.reads.fetch_add(1, Ordering::SeqCst);
                    Ok(None)
                }))
                .try_filter_map(|piece| future::ready(Ok(piece)));
            Ok(counted)
        };
        stream::once(opened).try_flatten().boxed()
    }
}

#[async_trait]
impl crate::UfsWrite for CountingUfs {
    async fn writer(&self, path: &str) -> Result<Box<dyn crate::UfsWriter>> {
        self.faults.writers_opened.fetch_add(1, Ordering::SeqCst);
        let injected = self
            .faults
            .fail_next_writes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if injected {
            return Err(UfsError::Temporary(format!("{path}: injected write fault (503)")));
        }
        self.inner.as_write().expect("as_write checked it").writer(path).await
    }

    async fn delete(&self, path: &str, is_dir: bool, recursive: bool) -> Result<()> {
        self.inner.as_write().expect("as_write checked it").delete(path, is_dir, recursive).await
    }

    async fn create_dir(&self, path: &str) -> Result<()> {
        self.inner.as_write().expect("as_write checked it").create_dir(path).await
    }

    fn capabilities(&self) -> crate::WriteCapabilities {
        self.inner.as_write().expect("as_write checked it").capabilities()
    }

    async fn copy(&self, from: &str, to: &str) -> Result<()> {
        self.counters.copies.fetch_add(1, Ordering::SeqCst);
        let refused = self
            .faults
            .refuse_next_copies
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if refused {
            return Err(UfsError::Other(format!("{from}: injected refusal of a copy (InvalidRequest)")));
        }
        self.inner.as_write().expect("as_write checked it").copy(from, to).await
    }

    async fn rename(&self, from: &str, to: &str) -> Result<()> {
        self.counters.renames.fetch_add(1, Ordering::SeqCst);
        self.inner.as_write().expect("as_write checked it").rename(from, to).await
    }

    async fn appender(&self, path: &str) -> Result<Box<dyn crate::UfsWriter>> {
        self.counters.appends.fetch_add(1, Ordering::SeqCst);
        self.inner.as_write().expect("as_write checked it").appender(path).await
    }

    async fn check_write(&self, path: &str) -> Result<()> {
        self.inner.as_write().expect("as_write checked it").check_write(path).await
    }
}

/// Wraps another factory's UFSes in [`CountingUfs`].
pub struct CountingFactory {
    pub inner: Arc<dyn UfsFactory>,
    pub counters: Arc<UfsCounters>,
    pub faults: Arc<UfsFaults>,
}

impl CountingFactory {
    pub fn new(inner: Arc<dyn UfsFactory>) -> Self {
        Self { inner, counters: Arc::default(), faults: Arc::default() }
    }
}

impl UfsFactory for CountingFactory {
    fn open(&self, uri: &str, options: &BTreeMap<String, String>) -> Result<Arc<dyn Ufs>> {
        Ok(Arc::new(CountingUfs {
            inner: self.inner.open(uri, options)?,
            counters: self.counters.clone(),
            faults: self.faults.clone(),
        }))
    }
}
