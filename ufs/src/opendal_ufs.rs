//! The real UFS: an opendal `Operator` per mount.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::{self, BoxStream};
use futures::{StreamExt, TryStreamExt, future};
use opendal::layers::{RetryLayer, TimeoutLayer};
use opendal::options::{ReadOptions, ReaderOptions};
use opendal::{ErrorKind as OdErrorKind, Metadata, Operator};
use strata_common::mount_options::STRATA_MOUNT_OPTIONS;
use strata_common::units::parse_duration;

use crate::spec::UfsSpec;
use crate::{ObjectMeta, Result, Ufs, UfsEntry, UfsError, UfsFactory, UfsFile, synthetic_version};

/// Retries of a failed UFS request (with jittered exponential backoff) unless the mount sets
/// `ufs_retries`.
pub const DEFAULT_UFS_RETRIES: usize = 4;
/// Deadline of one UFS metadata request unless the mount sets `ufs_timeout`.
pub const DEFAULT_UFS_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest silence inside one UFS data transfer unless the mount sets `ufs_io_timeout`.
pub const DEFAULT_UFS_IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Requests one range read is split into unless the mount sets `ufs_read_parallelism`.
pub const DEFAULT_UFS_READ_PARALLELISM: usize = 1;
/// Smallest piece of a split range read: below it a request's fixed cost outweighs what the
/// parallel transfer saves.
pub const MIN_UFS_READ_PIECE: u64 = 1 << 20;

fn option<T>(
    options: &BTreeMap<String, String>,
    key: &str,
    default: T,
    parse: impl Fn(&str) -> Option<T>,
) -> Result<T> {
    match options.get(key) {
        None => Ok(default),
        Some(v) => {
            parse(v).ok_or_else(|| UfsError::InvalidConfig(format!("mount option {key}={v:?} is not valid")))
        }
    }
}

pub struct OpendalUfs {
    pub(crate) op: Operator,
    /// The service can check a version on read (S3 `If-Match`); otherwise a read is followed by
    /// a stat that compares versions.
    conditional_reads: bool,
    /// How `list_recursive` runs on this service: a key-ordered paged listing (object stores),
    /// or a walk over directories.
    recursive_listing: RecursiveListing,
    /// Concurrent requests a range read is split into (pieces of at least
    /// [`MIN_UFS_READ_PIECE`]): one object-store stream runs at a fraction of the store's rate,
    /// so a cold block arrives sooner in parallel pieces.
    read_parallelism: usize,
    /// A local directory's root: listed here rather than by opendal, whose fs lister asserts
    /// (and panics, in a debug build) on a symbolic link to a directory.
    local_root: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RecursiveListing {
    /// Directory by directory ([`crate::walk`]).
    Walk,
    /// One recursive listing in key order; `start_after` sent to the service when it takes it,
    /// otherwise the keys up to it are skipped as they stream by.
    Ordered { start_after: bool },
}

impl OpendalUfs {
    pub fn open(uri: &str, options: &BTreeMap<String, String>) -> Result<Self> {
        opendal::install_default();
        let spec = UfsSpec::parse(uri)?;
        let mut config: Vec<(String, String)> = options
            .iter()
            .filter(|(k, _)| !STRATA_MOUNT_OPTIONS.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let scheme = match &spec {
            UfsSpec::Fs { root } => {
                // opendal's fs service creates a missing root; for a cache that turns a typo
                // into an empty mount, so a missing directory is an error here.
                match std::fs::metadata(root) {
                    Ok(m) if m.is_dir() => {}
                    Ok(_) => {
                        return Err(UfsError::InvalidConfig(format!("{root} is not a directory")));
                    }
                    Err(e) => return Err(UfsError::NotFound(format!("{root}: {e}"))),
                }
                config.push(("root".into(), root.clone()));
                "fs"
            }
            UfsSpec::S3 { bucket, root } | UfsSpec::Gcs { bucket, root } | UfsSpec::Oss { bucket, root } => {
                config.push(("bucket".into(), bucket.clone()));
                config.push(("root".into(), root.clone()));
                let region_known = options.contains_key("region")
                    || std::env::var_os("AWS_REGION").is_some()
                    || std::env::var_os("AWS_DEFAULT_REGION").is_some();
                if matches!(spec, UfsSpec::S3 { .. }) && !region_known {
                    // What most S3-compatible stores accept; AWS buckets elsewhere set `region`.
                    config.push(("region".into(), "us-east-1".into()));
                }
                match &spec {
                    UfsSpec::S3 { .. } => "s3",
                    UfsSpec::Gcs { .. } => "gcs",
                    _ => "oss",
                }
            }
            UfsSpec::Azblob { container, root } => {
                config.push(("container".into(), container.clone()));
                config.push(("root".into(), root.clone()));
                "azblob"
            }
            UfsSpec::Hdfs { name_node, root } => {
                config.push(("name_node".into(), name_node.clone()));
                config.push(("root".into(), root.clone()));
                "hdfs-native"
            }
            UfsSpec::Webhdfs { endpoint, root } => {
                config.push(("endpoint".into(), endpoint.clone()));
                config.push(("root".into(), root.clone()));
                "webhdfs"
            }
        };
        let retries =
            option(options, "ufs_retries", DEFAULT_UFS_RETRIES, |v| v.parse().ok().filter(|n| *n <= 20))?;
        let timeout = option(options, "ufs_timeout", DEFAULT_UFS_TIMEOUT, parse_duration)?;
        let io_timeout = option(options, "ufs_io_timeout", DEFAULT_UFS_IO_TIMEOUT, parse_duration)?;
        let read_parallelism = option(options, "ufs_read_parallelism", DEFAULT_UFS_READ_PARALLELISM, |v| {
            v.parse().ok().filter(|n| (1..=64).contains(n))
        })?;
        let op = Operator::via_iter(scheme, config)
            .map_err(|e| UfsError::InvalidConfig(e.to_string()))?
            // Inside the retries: each attempt gets its own deadline, so a stalled response is
            // abandoned and tried again instead of hanging the read.
            .layer(TimeoutLayer::new().with_timeout(timeout).with_io_timeout(io_timeout))
            .layer(
                RetryLayer::new()
                    .with_max_times(retries)
                    .with_jitter()
                    .with_min_delay(Duration::from_millis(50))
                    .with_max_delay(Duration::from_secs(2)),
            );
        let capability = op.info().capability();
        let conditional_reads = capability.read_with_if_match;
        // Object stores list keys in lexicographic order, page by page: a recursive listing is a
        // bounded-memory stream however many keys share one prefix. A file system's directory
        // order is arbitrary, so there the walk sorts one level at a time.
        let object_store = matches!(
            spec,
            UfsSpec::S3 { .. } | UfsSpec::Gcs { .. } | UfsSpec::Oss { .. } | UfsSpec::Azblob { .. }
        );
        let recursive_listing = if object_store && capability.list_with_recursive {
            RecursiveListing::Ordered { start_after: capability.list_with_start_after }
        } else {
            RecursiveListing::Walk
        };
        let local_root = match &spec {
            UfsSpec::Fs { root } => Some(std::path::PathBuf::from(root)),
            _ => None,
        };
        Ok(Self { op, conditional_reads, recursive_listing, read_parallelism, local_root })
    }
}

/// How many concurrent requests a range read of `len` bytes takes: up to `parallelism`, each
/// piece at least [`MIN_UFS_READ_PIECE`].
fn read_pieces(len: u64, parallelism: usize) -> usize {
    (len / MIN_UFS_READ_PIECE).clamp(1, parallelism.max(1) as u64) as usize
}

pub(crate) fn map_err(path: &str, err: opendal::Error) -> UfsError {
    match err.kind() {
        OdErrorKind::NotFound => UfsError::NotFound(path.to_string()),
        OdErrorKind::IsADirectory => UfsError::IsDirectory(path.to_string()),
        OdErrorKind::PermissionDenied => UfsError::PermissionDenied(format!("{path}: {err}")),
        OdErrorKind::ConditionNotMatch => UfsError::VersionChanged(path.to_string()),
        // A local directory says so when a parent of the path is a file (`mkdir -p` over it).
        OdErrorKind::AlreadyExists => UfsError::AlreadyExists(format!("{path}: {err}")),
        OdErrorKind::Unsupported => UfsError::Unsupported(format!("{path}: {err}")),
        OdErrorKind::ConfigInvalid => UfsError::InvalidConfig(err.to_string()),
        // opendal's fs service reports ENOTDIR as an unexpected (temporary) error; it is a
        // path that cannot exist, never worth another attempt.
        _ if io_kind(&err) == Some(std::io::ErrorKind::NotADirectory) => {
            UfsError::NotADirectory(format!("{path}: a parent of it is a file"))
        }
        _ if err.is_temporary() => UfsError::Temporary(format!("{path}: {err}")),
        _ => UfsError::Other(format!("{path}: {err}")),
    }
}

/// The kind of the OS error behind an opendal error, if one is.
fn io_kind(err: &opendal::Error) -> Option<std::io::ErrorKind> {
    let mut source = std::error::Error::source(err);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return Some(io.kind());
        }
        source = e.source();
    }
    None
}

/// A local directory's entries, described as a stat of each describes it: a symbolic link as
/// what it leads to (a dangling one is left out), a file's version from its mtime and size.
/// Names that are not UTF-8 cannot be Strata paths and are left out, like writes in progress.
fn list_local(root: &std::path::Path, rel: &str) -> Result<Vec<UfsEntry>> {
    let dir = if rel.is_empty() { root.to_path_buf() } else { root.join(rel) };
    let io = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::NotFound => UfsError::NotFound(rel.to_string()),
        std::io::ErrorKind::NotADirectory => UfsError::NotADirectory(format!("{rel}: not a directory")),
        std::io::ErrorKind::PermissionDenied => UfsError::PermissionDenied(format!("{rel}: {e}")),
        _ => UfsError::Other(format!("{rel}: {e}")),
    };
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).map_err(io)? {
        let entry = entry.map_err(io)?;
        let Ok(name) = entry.file_name().into_string() else { continue };
        if crate::write::is_staging_name(&name) {
            continue;
        }
        // Gone meanwhile, or a link leading nowhere.
        let Ok(meta) = std::fs::metadata(entry.path()) else { continue };
        let mtime_ns = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos() as i128);
        let is_dir = meta.is_dir();
        let size = if is_dir { 0 } else { meta.len() };
        let version = if is_dir { String::new() } else { synthetic_version(mtime_ns, size) };
        out.push(UfsEntry {
            name,
            meta: ObjectMeta { is_dir, size, version, mtime_ms: (mtime_ns / 1_000_000) as i64 },
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

fn to_meta(meta: &Metadata) -> ObjectMeta {
    let mtime: Option<SystemTime> = meta.last_modified().map(Into::into);
    let mtime_ns =
        mtime.and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map(|d| d.as_nanos() as i128).unwrap_or(0);
    let is_dir = meta.is_dir();
    let size = if is_dir { 0 } else { meta.content_length() };
    let version = if is_dir {
        String::new()
    } else {
        match meta.etag() {
            Some(etag) if !etag.is_empty() => etag.to_string(),
            _ => synthetic_version(mtime_ns, size),
        }
    };
    ObjectMeta { is_dir, size, version, mtime_ms: (mtime_ns / 1_000_000) as i64 }
}

#[async_trait]
impl Ufs for OpendalUfs {
    fn as_write(&self) -> Option<&dyn crate::UfsWrite> {
        Some(self)
    }

    async fn stat(&self, path: &str) -> Result<ObjectMeta> {
        if path.is_empty() {
            // opendal answers a stat of an object store's root without a request; listing one
            // entry really reaches the endpoint and checks the bucket and the credentials.
            use futures::TryStreamExt;
            let mut lister = self.op.lister_with("/").limit(1).await.map_err(|e| map_err("/", e))?;
            lister.try_next().await.map_err(|e| map_err("/", e))?;
            return Ok(ObjectMeta { is_dir: true, size: 0, version: String::new(), mtime_ms: 0 });
        }
        let meta = match self.op.stat(path).await {
            // Object stores have no directories: a prefix with children is one.
            Err(e) if e.kind() == OdErrorKind::NotFound && !path.is_empty() => {
                let dir = format!("{}/", path.trim_end_matches('/'));
                match self.op.stat(&dir).await {
                    Ok(m) => m,
                    Err(_) => return Err(map_err(path, e)),
                }
            }
            other => other.map_err(|e| map_err(path, e))?,
        };
        Ok(to_meta(&meta))
    }

    async fn list(&self, dir: &str) -> Result<Vec<UfsEntry>> {
        if let Some(root) = &self.local_root {
            let (root, rel) = (root.clone(), dir.trim_matches('/').to_string());
            return tokio::task::spawn_blocking(move || list_local(&root, &rel))
                .await
                .map_err(|e| UfsError::Other(format!("{dir}: listing did not finish: {e}")))?;
        }
        let dir_path =
            if dir.is_empty() { "/".to_string() } else { format!("{}/", dir.trim_end_matches('/')) };
        let entries = self.op.list(&dir_path).await.map_err(|e| map_err(dir, e))?;
        let mut out = Vec::with_capacity(entries.len());
        for entry in entries {
            let (path, meta) = entry.into_parts();
            let name = path.trim_end_matches('/').rsplit('/').next().unwrap_or("").to_string();
            // opendal lists the directory itself as an entry on some services.
            if name.is_empty()
                || path.trim_end_matches('/') == dir_path.trim_end_matches('/')
                || crate::write::is_staging_name(&name)
            {
                continue;
            }
            out.push(UfsEntry { name, meta: to_meta(&meta) });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    async fn read_range(&self, path: &str, range: Range<u64>, version: &str) -> Result<Bytes> {
        if range.is_empty() {
            return Ok(Bytes::new());
        }
        let mut opts = ReadOptions { range: range.clone().into(), ..Default::default() };
        let pieces = read_pieces(range.end - range.start, self.read_parallelism);
        if pieces > 1 {
            // Every piece is its own request with the same If-Match, so a version change
            // between pieces fails the read rather than mixing versions.
            opts.concurrent = pieces;
            opts.chunk = Some((range.end - range.start).div_ceil(pieces as u64) as usize);
        }
        if self.conditional_reads {
            opts.if_match = Some(version.to_string());
        }
        let buf = self.op.read_options(path, opts).await.map_err(|e| map_err(path, e))?;
        if !self.conditional_reads {
            let now = self.stat(path).await?;
            if now.version != version {
                return Err(UfsError::VersionChanged(path.to_string()));
            }
        }
        let bytes = buf.to_bytes();
        if bytes.len() as u64 != range.end - range.start {
            // A short read means the object shrank: it is not the version we were asked for.
            return Err(UfsError::VersionChanged(path.to_string()));
        }
        Ok(bytes)
    }

    fn read_stream<'a>(
        &'a self,
        path: &'a str,
        range: Range<u64>,
        version: &'a str,
    ) -> BoxStream<'a, Result<Bytes>> {
        if range.is_empty() {
            return stream::empty().boxed();
        }
        let mut opts = ReaderOptions::default();
        let pieces = read_pieces(range.end - range.start, self.read_parallelism);
        if pieces > 1 {
            // As in `read_range`: every piece carries the same If-Match.
            opts.concurrent = pieces;
            opts.chunk = Some((range.end - range.start).div_ceil(pieces as u64) as usize);
        }
        if self.conditional_reads {
            opts.if_match = Some(version.to_string());
        }
        let body = stream::once(async move {
            let reader = self.op.reader_options(path, opts).await.map_err(|e| map_err(path, e))?;
            let buffers = reader.into_stream(range).await.map_err(|e| map_err(path, e))?;
            // A buffer may hold several pieces; each goes on as it is, uncopied.
            Ok::<_, UfsError>(
                buffers
                    .map_err(move |e| map_err(path, e))
                    .map_ok(|buf| stream::iter(Iterator::map(buf, Ok)))
                    .try_flatten(),
            )
        })
        .try_flatten();
        // Without conditional reads the version can only be checked after the last byte.
        let check = stream::once(async move {
            if !self.conditional_reads && self.stat(path).await?.version != version {
                return Err(UfsError::VersionChanged(path.to_string()));
            }
            Ok(None)
        });
        body.map_ok(Some).chain(check).try_filter_map(|piece| future::ready(Ok(piece))).boxed()
    }

    fn checks_version_first(&self) -> bool {
        self.conditional_reads
    }

    fn lists_recursively(&self) -> bool {
        matches!(self.recursive_listing, RecursiveListing::Ordered { start_after: true })
    }

    fn list_recursive<'a>(
        &'a self,
        dir: &'a str,
        start_after: Option<&'a str>,
    ) -> BoxStream<'a, Result<UfsFile>> {
        let RecursiveListing::Ordered { start_after: service_skips } = self.recursive_listing else {
            return crate::walk(crate::Plain(self), dir, start_after);
        };
        let root = dir.trim_matches('/');
        let one = |item: Result<UfsFile>| stream::iter([item]).boxed();
        stream::once(async move {
            match self.stat(root).await {
                Ok(_) if start_after == Some(root) => stream::empty().boxed(),
                Ok(meta) if !meta.is_dir => one(Ok(UfsFile { path: root.to_string(), meta })),
                Ok(_) => {
                    let list_dir = if root.is_empty() { "/".to_string() } else { format!("{root}/") };
                    let mut lister = self.op.lister_with(&list_dir).recursive(true);
                    if service_skips && let Some(after) = start_after {
                        lister = lister.start_after(after);
                    }
                    match lister.await {
                        Ok(lister) => lister
                            .filter_map(move |entry| {
                                future::ready(match entry {
                                    Err(e) => Some(Err(map_err(root, e))),
                                    Ok(entry) => {
                                        let (path, meta) = entry.into_parts();
                                        let listed_after = start_after.is_none_or(|a| path.as_str() > a);
                                        let name = path.rsplit('/').next().unwrap_or("");
                                        let staging = crate::write::is_staging_name(name);
                                        (!meta.is_dir() && !path.ends_with('/') && listed_after && !staging)
                                            .then(|| Ok(UfsFile { meta: to_meta(&meta), path }))
                                    }
                                })
                            })
                            .boxed(),
                        Err(e) => one(Err(map_err(root, e))),
                    }
                }
                Err(e) => one(Err(e)),
            }
        })
        .flatten()
        .boxed()
    }
}

/// Builds an [`OpendalUfs`] per mount.
#[derive(Debug, Default, Clone, Copy)]
pub struct OpendalFactory;

impl UfsFactory for OpendalFactory {
    fn open(&self, uri: &str, options: &BTreeMap<String, String>) -> Result<Arc<dyn Ufs>> {
        Ok(Arc::new(OpendalUfs::open(uri, options)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn fs_stat_list_and_versioned_reads() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/a.bin"), b"hello world").unwrap();
        let ufs = OpendalUfs::open(&format!("file://{}", dir.path().display()), &BTreeMap::new()).unwrap();

        let meta = ufs.stat("sub/a.bin").await.unwrap();
        assert_eq!(meta.size, 11);
        assert!(!meta.is_dir);
        assert!(meta.version.starts_with('m') && meta.version.ends_with("-s11"), "{}", meta.version);
        assert!(ufs.stat("sub").await.unwrap().is_dir);
        assert!(matches!(ufs.stat("nope").await, Err(UfsError::NotFound(_))));

        let names: Vec<_> =
            ufs.list("sub").await.unwrap().into_iter().map(|e| (e.name, e.meta.size)).collect();
        assert_eq!(names, vec![("a.bin".to_string(), 11)]);
        let root: Vec<_> = ufs.list("").await.unwrap().into_iter().map(|e| (e.name, e.meta.is_dir)).collect();
        assert_eq!(root, vec![("sub".to_string(), true)]);

        assert_eq!(&ufs.read_range("sub/a.bin", 6..11, &meta.version).await.unwrap()[..], b"world");
        // A read against a version the object no longer has is refused, not served.
        assert!(matches!(
            ufs.read_range("sub/a.bin", 0..5, "m1-s11").await,
            Err(UfsError::VersionChanged(_))
        ));
    }

    /// A streamed read yields exactly the range's bytes, in order; against a version the file no
    /// longer has, its last item is `VersionChanged` (a local directory can only tell once the
    /// bytes are read), and a missing file fails at once.
    #[tokio::test]
    async fn a_streamed_read_is_the_range_and_ends_in_an_error_for_another_version() {
        use futures::TryStreamExt;
        let dir = tempfile::tempdir().unwrap();
        let ufs = OpendalUfs::open(&format!("file://{}", dir.path().display()), &BTreeMap::new()).unwrap();
        let data: Vec<u8> = (0..3 << 20).map(|i: u32| (i % 251) as u8).collect();
        std::fs::write(dir.path().join("big"), &data).unwrap();
        let version = ufs.stat("big").await.unwrap().version;
        let range = 1000..(3 << 20) - 7;
        let pieces: Vec<Bytes> = ufs.read_stream("big", range.clone(), &version).try_collect().await.unwrap();
        assert_eq!(pieces.concat(), &data[range.start as usize..range.end as usize]);
        assert_eq!(pieces.concat(), ufs.read_range("big", range.clone(), &version).await.unwrap());

        let mut stale = ufs.read_stream("big", range.clone(), "m1-s3");
        let mut got = 0;
        let end = loop {
            match stale.try_next().await {
                Ok(Some(piece)) => got += piece.len(),
                Ok(None) => break None,
                Err(e) => break Some(e),
            }
        };
        assert!(matches!(end, Some(UfsError::VersionChanged(_))), "{end:?} after {got} bytes");
        let missing: Result<Vec<Bytes>> = ufs.read_stream("nope", 0..10, &version).try_collect().await;
        assert!(matches!(missing, Err(UfsError::NotFound(_))), "{missing:?}");
    }

    /// A write in progress on a local directory stages under a hidden name; a listing (one
    /// level or recursive) never shows it, even while it exists, and shows the file once closed.
    #[tokio::test]
    async fn writes_in_progress_are_not_listed() {
        use futures::StreamExt;
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("d")).unwrap();
        let ufs = OpendalUfs::open(&format!("file://{}", dir.path().display()), &BTreeMap::new()).unwrap();
        let mut w = ufs.as_write().unwrap().writer("d/f.bin").await.unwrap();
        // More than a chunk, so the writer has flushed to the staging file.
        w.write(Bytes::from(vec![7u8; 9 << 20])).await.unwrap();
        let staged = std::fs::read_dir(dir.path().join("d")).unwrap().count();
        assert_eq!(staged, 1, "the staging file exists on disk");
        assert!(ufs.list("d").await.unwrap().is_empty());
        let all: Vec<_> = ufs.list_recursive("", None).collect().await;
        assert!(all.is_empty(), "{:?}", all.iter().map(|f| f.as_ref().map(|f| &f.path)).collect::<Vec<_>>());
        w.close().await.unwrap();
        let names: Vec<_> = ufs.list("d").await.unwrap().into_iter().map(|e| e.name).collect();
        assert_eq!(names, ["f.bin"]);
    }
}

#[cfg(test)]
mod write_capability_tests {
    use super::*;
    use crate::{UfsWrite, WriteCapabilities};

    fn local() -> (tempfile::TempDir, OpendalUfs) {
        let dir = tempfile::tempdir().unwrap();
        let ufs = OpendalUfs::open(&format!("file://{}", dir.path().display()), &BTreeMap::new()).unwrap();
        (dir, ufs)
    }

    fn names(dir: &std::path::Path) -> Vec<String> {
        let mut n: Vec<_> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        n.sort();
        n
    }

    #[tokio::test]
    async fn a_local_directory_copies_renames_and_appends() {
        let (dir, ufs) = local();
        let caps = ufs.capabilities();
        assert_eq!(caps, WriteCapabilities { copy: true, rename: true, append: true });
        std::fs::write(dir.path().join("a.bin"), b"hello").unwrap();

        // A copy makes the target's parents and leaves no staging file behind.
        ufs.copy("a.bin", "deep/er/b.bin").await.unwrap();
        assert_eq!(std::fs::read(dir.path().join("deep/er/b.bin")).unwrap(), b"hello");
        assert_eq!(names(&dir.path().join("deep/er")), ["b.bin"]);
        // Over an existing file: replaced.
        std::fs::write(dir.path().join("c.bin"), b"old and longer").unwrap();
        ufs.copy("a.bin", "c.bin").await.unwrap();
        assert_eq!(std::fs::read(dir.path().join("c.bin")).unwrap(), b"hello");
        assert!(matches!(ufs.copy("missing", "x").await, Err(UfsError::NotFound(_))));

        // Files and whole directories rename in place.
        ufs.rename("c.bin", "moved/c.bin").await.unwrap();
        assert!(!dir.path().join("c.bin").exists());
        ufs.rename("deep", "deeper").await.unwrap();
        assert_eq!(std::fs::read(dir.path().join("deeper/er/b.bin")).unwrap(), b"hello");
        assert!(!dir.path().join("deep").exists());

        // An append publishes the old bytes and the new ones at close, not before.
        let mut w = ufs.appender("a.bin").await.unwrap();
        w.write(Bytes::from_static(b", world")).await.unwrap();
        assert_eq!(std::fs::read(dir.path().join("a.bin")).unwrap(), b"hello");
        w.close().await.unwrap();
        assert_eq!(std::fs::read(dir.path().join("a.bin")).unwrap(), b"hello, world");
        // Aborted: the file stays as it was, and no staging file is left.
        let mut w = ufs.appender("a.bin").await.unwrap();
        w.write(Bytes::from_static(b"!!!")).await.unwrap();
        w.abort().await.unwrap();
        assert_eq!(std::fs::read(dir.path().join("a.bin")).unwrap(), b"hello, world");
        // A missing file is created by its first append.
        let mut w = ufs.appender("new/log.txt").await.unwrap();
        w.write(Bytes::from_static(b"line\n")).await.unwrap();
        w.close().await.unwrap();
        assert_eq!(std::fs::read(dir.path().join("new/log.txt")).unwrap(), b"line\n");
        assert!(matches!(ufs.appender("deeper").await, Err(UfsError::IsDirectory(_))));
        assert_eq!(names(dir.path()), ["a.bin", "deeper", "moved", "new"]);
    }

    /// A path through a file cannot exist: a stat says so (a local directory's ENOTDIR is not
    /// taken for a temporary failure), and a write under it says the file is in the way.
    #[tokio::test]
    async fn a_path_through_a_file_is_not_found_and_cannot_be_written() {
        let (dir, ufs) = local();
        std::fs::write(dir.path().join("f"), b"x").unwrap();
        let e = crate::Ufs::stat(&ufs, "f/sub").await.unwrap_err();
        assert!(matches!(e, UfsError::NotADirectory(_)), "{e}");
        assert_eq!(e.kind(), strata_common::ErrorKind::NotFound);
        // As `mkdir -p` says: the file is in the way of its directory (EEXIST), or of one below
        // it (ENOTDIR).
        for (path, blocked) in [("f/x", "already exists"), ("f/sub/x", "not a directory")] {
            // The service opens the file at the first write, or at close.
            let written = async {
                let mut w = ufs.writer(path).await?;
                w.write(Bytes::from_static(b"y")).await?;
                w.close().await
            };
            let e = written.await.expect_err("refused");
            assert!(e.to_string().starts_with(blocked), "{path}: {e}");
        }
    }
}

#[cfg(test)]
mod config_tests {
    use super::*;

    fn opts(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// Every supported service builds from a URI and options without contacting anything
    /// (there is no HDFS, GCS, Azure or OSS endpoint here; `mount add` reaches the UFS after).
    #[test]
    fn every_supported_scheme_builds() {
        for (uri, options) in [
            ("s3://bucket/prefix", opts(&[("endpoint", "http://127.0.0.1:1"), ("region", "garage")])),
            ("hdfs://127.0.0.1:8020/warehouse", opts(&[])),
            ("webhdfs://127.0.0.1:9870/warehouse", opts(&[("user_name", "etl")])),
            ("gcs://bucket/p", opts(&[("credential", "e30=")])),
            ("azblob://container/p", opts(&[("account_name", "a"), ("endpoint", "http://127.0.0.1:1")])),
            ("oss://bucket/p", opts(&[("endpoint", "http://127.0.0.1:1")])),
        ] {
            if let Err(e) = OpendalUfs::open(uri, &options) {
                panic!("{uri}: {e}");
            }
        }
    }

    #[test]
    fn strata_options_are_validated_and_not_passed_to_opendal() {
        let ok = opts(&[
            ("ufs_retries", "2"),
            ("ufs_timeout", "3s"),
            ("ufs_io_timeout", "500ms"),
            ("ufs_read_parallelism", "8"),
            ("block_size", "1MiB"),
        ]);
        OpendalUfs::open("s3://b", &ok).unwrap();
        for (k, v) in [
            ("ufs_retries", "many"),
            ("ufs_timeout", "10"),
            ("ufs_io_timeout", "soon"),
            ("ufs_read_parallelism", "0"),
            ("ufs_read_parallelism", "65"),
        ] {
            let e = OpendalUfs::open("s3://b", &opts(&[(k, v)])).err().expect("must fail");
            assert!(e.to_string().contains(k), "{e}");
        }
    }

    #[test]
    fn a_range_read_splits_into_pieces_of_at_least_a_mib() {
        const MIB: u64 = 1 << 20;
        assert_eq!(read_pieces(4 * MIB, 1), 1, "parallelism 1 never splits");
        assert_eq!(read_pieces(4 * MIB, 4), 4);
        assert_eq!(read_pieces(4 * MIB, 16), 4, "no piece under 1 MiB");
        assert_eq!(read_pieces(MIB + MIB / 2, 4), 1);
        assert_eq!(read_pieces(100, 4), 1);
        assert_eq!(read_pieces(64 * MIB, 8), 8);
    }

    #[test]
    fn a_missing_local_root_is_refused_not_created() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("typo");
        let e = OpendalUfs::open(&format!("file://{}", missing.display()), &opts(&[])).err().unwrap();
        assert!(matches!(e, UfsError::NotFound(_)), "{e}");
        assert!(!missing.exists());
    }
}
