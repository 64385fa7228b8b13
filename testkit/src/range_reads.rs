//! UFS range reads counted per object and byte range, so a test can say *which* block was
//! fetched twice (or never), not only how many reads the UFS served in all
//! ([`strata_ufs::testing::UfsCounters`]).
//!
//! A wrapper like the other test doubles: [`RangeCountingFactory`] wraps a factory, and every UFS
//! it opens counts each successful `read_range` under (path, range). The path is the one the
//! UFS was asked for (relative to the mount's root), so two mounts of different roots that hold
//! the same relative path share a count: the tests mount one UFS.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use strata_ufs::{ObjectMeta, Result, Ufs, UfsEntry, UfsFactory, UfsFile, UfsWrite};

/// Successful UFS range reads, per (path, byte range).
#[derive(Debug, Default)]
pub struct RangeReads {
    counts: Mutex<BTreeMap<(String, u64, u64), u64>>,
}

impl RangeReads {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<(String, u64, u64), u64>> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn record(&self, path: &str, range: &Range<u64>) {
        *self.lock().entry((path.to_string(), range.start, range.end)).or_default() += 1;
    }

    /// How many times each range of `path` (relative to the UFS root) was read, in range order.
    pub fn of(&self, path: &str) -> Vec<(Range<u64>, u64)> {
        self.lock()
            .iter()
            .filter(|((p, _, _), _)| p == path)
            .map(|((_, start, end), n)| (*start..*end, *n))
            .collect()
    }

    /// Bytes read of `path` in all (a range read twice counts twice).
    pub fn bytes_of(&self, path: &str) -> u64 {
        self.of(path).iter().map(|(r, n)| (r.end - r.start) * n).sum()
    }
}

/// Wraps another factory's UFSes so that their range reads are counted in `reads`.
pub struct RangeCountingFactory {
    pub inner: Arc<dyn UfsFactory>,
    pub reads: Arc<RangeReads>,
}

impl RangeCountingFactory {
    pub fn new(inner: Arc<dyn UfsFactory>) -> Self {
        Self { inner, reads: Arc::default() }
    }
}

impl UfsFactory for RangeCountingFactory {
    fn open(&self, uri: &str, options: &BTreeMap<String, String>) -> Result<Arc<dyn Ufs>> {
        Ok(Arc::new(RangeCountingUfs { inner: self.inner.open(uri, options)?, reads: self.reads.clone() }))
    }
}

struct RangeCountingUfs {
    inner: Arc<dyn Ufs>,
    reads: Arc<RangeReads>,
}

#[async_trait]
impl Ufs for RangeCountingUfs {
    fn as_write(&self) -> Option<&dyn UfsWrite> {
        self.inner.as_write()
    }

    async fn stat(&self, path: &str) -> Result<ObjectMeta> {
        self.inner.stat(path).await
    }

    async fn list(&self, dir: &str) -> Result<Vec<UfsEntry>> {
        self.inner.list(dir).await
    }

    fn list_recursive<'a>(
        &'a self,
        dir: &'a str,
        start_after: Option<&'a str>,
    ) -> BoxStream<'a, Result<UfsFile>> {
        self.inner.list_recursive(dir, start_after)
    }

    fn lists_recursively(&self) -> bool {
        self.inner.lists_recursively()
    }

    async fn read_range(&self, path: &str, range: Range<u64>, version: &str) -> Result<Bytes> {
        let bytes = self.inner.read_range(path, range.clone(), version).await?;
        self.reads.record(path, &range);
        Ok(bytes)
    }

    fn checks_version_first(&self) -> bool {
        self.inner.checks_version_first()
    }

    // The inner UFS's own stream (what production reads piece by piece), recorded once it ended
    // whole.
    fn read_stream<'a>(
        &'a self,
        path: &'a str,
        range: Range<u64>,
        version: &'a str,
    ) -> BoxStream<'a, Result<Bytes>> {
        use futures::{StreamExt, TryStreamExt, future, stream};
        let recorded = range.clone();
        self.inner
            .read_stream(path, range, version)
            .map_ok(Some)
            .chain(stream::once(async move {
                self.reads.record(path, &recorded);
                Ok(None)
            }))
            .try_filter_map(|piece| future::ready(Ok(piece)))
            .boxed()
    }
}

#[cfg(test)]
mod tests {
    use strata_ufs::OpendalFactory;

    use super::*;

    #[tokio::test]
    async fn reads_are_counted_per_path_and_range_and_failures_are_not() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.bin"), vec![7u8; 100]).unwrap();
        let factory = RangeCountingFactory::new(Arc::new(OpendalFactory));
        let ufs = factory.open(&format!("file://{}", dir.path().display()), &BTreeMap::new()).unwrap();
        let version = ufs.stat("a.bin").await.unwrap().version;
        for range in [0..10, 10..100, 0..10] {
            assert_eq!(
                ufs.read_range("a.bin", range.clone(), &version).await.unwrap().len() as u64,
                range.end - range.start
            );
        }
        assert!(ufs.read_range("missing.bin", 0..10, &version).await.is_err());
        assert_eq!(factory.reads.of("a.bin"), vec![(0..10, 2), (10..100, 1)]);
        assert_eq!(factory.reads.bytes_of("a.bin"), 110);
        assert!(factory.reads.of("missing.bin").is_empty());
    }
}
