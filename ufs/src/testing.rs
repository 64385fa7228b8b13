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
use futures::stream::BoxStream;

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
    /// Every read first sleeps this many milliseconds.
    pub read_delay_ms: AtomicU64,
    /// The next N writers refuse to open with a temporary error (a UFS answering 500s).
    pub fail_next_writes: AtomicU64,
    /// Writers opened (counted whether or not they then fail).
    pub writers_opened: AtomicU64,
    /// The next N copies by the service are refused (as S3 refuses a CopyObject over 5 GiB).
    pub refuse_next_copies: AtomicU64,
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
