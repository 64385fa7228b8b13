//! The under file system (UFS) seam: everything Strata reads from the storage a team already
//! has goes through the [`Ufs`] trait.
//!
//! [`OpendalUfs`] is the real implementation (every opendal service Strata enables); the
//! wrappers in `testing` (feature `testing`, for other crates' tests) count and inject faults.
//! A mount's URI and options become a `Ufs` through a [`UfsFactory`], so tests can hand the
//! master and workers a counting or failing UFS without touching their code.

mod fence;
mod opendal_ufs;
mod spec;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
mod write;

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use strata_common::ErrorKind;
use thiserror::Error;

pub use fence::{Fenced, STATE_MARKER, StateFence, mark_state_dir};
pub use opendal_ufs::{
    DEFAULT_UFS_IO_TIMEOUT, DEFAULT_UFS_READ_PARALLELISM, DEFAULT_UFS_RETRIES, DEFAULT_UFS_TIMEOUT,
    MIN_UFS_READ_PIECE, OpendalFactory, OpendalUfs,
};
pub use spec::{SUPPORTED_SCHEMES, UfsSpec, is_secret_option, redact_options};
pub use write::{UfsWrite, UfsWriter, WriteCapabilities};

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum UfsError {
    #[error("not found: {0}")]
    NotFound(String),
    #[error("is a directory: {0}")]
    IsDirectory(String),
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    #[error("unsupported UFS scheme {0:?} (supported: file, s3, hdfs, webhdfs, gcs, azblob, oss)")]
    UnsupportedScheme(String),
    #[error("invalid UFS configuration: {0}")]
    InvalidConfig(String),
    #[error("object {0} changed while it was read")]
    VersionChanged(String),
    #[error("already exists: {0}")]
    AlreadyExists(String),
    /// A path runs through a file as if it were a directory (`a.bin/x`): there is no such path.
    #[error("not a directory: {0}")]
    NotADirectory(String),
    /// The service cannot do what was asked (copy, rename or append on a UFS without them).
    #[error("not supported: {0}")]
    Unsupported(String),
    #[error("UFS request failed (temporary): {0}")]
    Temporary(String),
    #[error("UFS request failed: {0}")]
    Other(String),
}

impl UfsError {
    pub fn is_temporary(&self) -> bool {
        matches!(self, UfsError::Temporary(_))
    }

    /// The kind this error travels as over gRPC or the data plane.
    pub fn kind(&self) -> ErrorKind {
        match self {
            UfsError::NotFound(_) => ErrorKind::NotFound,
            UfsError::IsDirectory(_) => ErrorKind::IsDirectory,
            UfsError::UnsupportedScheme(_) | UfsError::InvalidConfig(_) | UfsError::Unsupported(_) => {
                ErrorKind::InvalidArgument
            }
            UfsError::AlreadyExists(_) => ErrorKind::AlreadyExists,
            // No such path: what an object store answers for the same path, and what a caller
            // asking whether it exists needs to hear (the wire has no kind of its own for it).
            UfsError::NotADirectory(_) => ErrorKind::NotFound,
            UfsError::VersionChanged(_) => ErrorKind::VersionChanged,
            UfsError::PermissionDenied(_) => ErrorKind::PermissionDenied,
            UfsError::Temporary(_) | UfsError::Other(_) => ErrorKind::Ufs,
        }
    }
}

pub type Result<T> = std::result::Result<T, UfsError>;

/// What Strata needs to know of an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectMeta {
    pub is_dir: bool,
    pub size: u64,
    /// The ETag, or `m<mtime ns>-s<size>` when the UFS has none; empty for directories.
    pub version: String,
    /// Last modification, milliseconds since the Unix epoch (0 when unknown).
    pub mtime_ms: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UfsEntry {
    /// Name inside the listed directory (no slashes).
    pub name: String,
    pub meta: ObjectMeta,
}

#[async_trait]
pub trait Ufs: Send + Sync + 'static {
    /// The write side of this UFS, if it has one (see [`UfsWrite`]).
    fn as_write(&self) -> Option<&dyn UfsWrite> {
        None
    }

    /// Metadata of a file or directory; `path` is relative to the UFS root ("" is the root).
    async fn stat(&self, path: &str) -> Result<ObjectMeta>;
    /// Direct children of a directory.
    async fn list(&self, dir: &str) -> Result<Vec<UfsEntry>>;
    /// Bytes `range` of a file, which must still be at `version`: if the object changed,
    /// `VersionChanged` — never bytes of another version.
    async fn read_range(&self, path: &str, range: Range<u64>, version: &str) -> Result<Bytes>;

    /// The bytes of `range` as they arrive, in order: what [`read_range`](Self::read_range)
    /// returns, in pieces, so a caller can pass the first ones on before the last arrive.
    ///
    /// A version check that can only be made once every byte is read (a store without
    /// conditional reads) ends the stream with `VersionChanged` *after* the bytes of another
    /// version went by: a caller must not let anyone take the bytes as the file's before the
    /// stream ended without an error and with exactly `range`'s length. The default yields the
    /// whole range at once; a wrapper around another UFS must forward this (and
    /// [`checks_version_first`](Self::checks_version_first)), or reads through it lose their
    /// cut-through.
    fn read_stream<'a>(
        &'a self,
        path: &'a str,
        range: Range<u64>,
        version: &'a str,
    ) -> BoxStream<'a, Result<Bytes>> {
        futures::stream::once(self.read_range(path, range, version)).boxed()
    }

    /// Whether a read of another version is refused before its first byte (a conditional read:
    /// `If-Match`), so every byte [`read_stream`](Self::read_stream) yields is of the version
    /// asked even if the stream fails later. False (the default) when the version can only be
    /// checked after the last byte.
    fn checks_version_first(&self) -> bool {
        false
    }

    /// Every file under `dir` (recursively; `dir` itself when it is a file), as a stream in an
    /// order that is the same on every call. With `start_after` (a path this listing yielded
    /// before) only the files after it come, so a consumer can resume where it stopped.
    ///
    /// The default walks [`Ufs::list`] depth first in [`path_order`]: memory is one directory
    /// level per depth, and subtrees wholly before `start_after` are not listed again. Object
    /// stores override it with their own key-ordered, paged listing, whose memory is one page
    /// however flat the prefix is.
    fn list_recursive<'a>(
        &'a self,
        dir: &'a str,
        start_after: Option<&'a str>,
    ) -> BoxStream<'a, Result<UfsFile>> {
        walk(Plain(self), dir, start_after)
    }

    /// Whether [`Ufs::list_recursive`] is the service's own ordered listing that starts after a
    /// key (one request per page), rather than a walk over [`Ufs::list`]. A caller with cached
    /// listings walks them instead when it is not ([`walk`]).
    fn lists_recursively(&self) -> bool {
        false
    }
}

/// A file found by [`Ufs::list_recursive`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UfsFile {
    /// Relative to the UFS root (as `stat` and `read_range` take it).
    pub path: String,
    pub meta: ObjectMeta,
}

/// The order [`Ufs::list_recursive`] yields paths in: component by component, so a directory's
/// whole subtree sorts between its name and the next sibling's.
pub fn path_order(a: &str, b: &str) -> std::cmp::Ordering {
    a.split('/').cmp(b.split('/'))
}

/// What a depth-first walk reads of a tree: a path's metadata and a directory's entries. A
/// [`Ufs`] walks its own [`Ufs::list`] (the default [`Ufs::list_recursive`]); a caller that
/// keeps listings (the master's metadata cache) walks through them with [`walk`], so paging
/// through a large directory lists it once rather than once per page.
#[async_trait]
pub trait DirTree: Send + Sync {
    async fn stat(&self, path: &str) -> Result<ObjectMeta>;
    /// A directory's direct children sorted by name (names hold no `/`).
    async fn list_sorted(&self, dir: &str) -> Result<Arc<Vec<UfsEntry>>>;
}

/// A [`Ufs`] as a [`DirTree`], listing it afresh each time.
struct Plain<'a, U: ?Sized>(&'a U);

#[async_trait]
impl<U: Ufs + ?Sized> DirTree for Plain<'_, U> {
    async fn stat(&self, path: &str) -> Result<ObjectMeta> {
        self.0.stat(path).await
    }

    async fn list_sorted(&self, dir: &str) -> Result<Arc<Vec<UfsEntry>>> {
        let mut entries = self.0.list(dir).await?;
        for e in &mut entries {
            let trimmed = e.name.trim_end_matches('/').len();
            e.name.truncate(trimmed);
        }
        entries.retain(|e| !e.name.is_empty());
        entries.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        Ok(Arc::new(entries))
    }
}

/// One directory level of a walk: its sorted entries and the next one to visit.
struct Level {
    base: String,
    entries: Arc<Vec<UfsEntry>>,
    next: usize,
}

impl Level {
    /// The level from its first entry not wholly before `start_after`: one after it in
    /// [`path_order`], or a directory that is it or holds it (a walk that yields directories
    /// may stop right after one, before what it holds). Siblings' paths sort as their names do,
    /// so that entry is found by bisection, not by a scan.
    fn new(base: &str, entries: Arc<Vec<UfsEntry>>, start_after: Option<&str>) -> Self {
        let next = match start_after {
            None => 0,
            Some(after) => entries.partition_point(|e| {
                let path = join(base, &e.name);
                let holds_after = e.meta.is_dir
                    && after.strip_prefix(path.as_str()).is_some_and(|r| r.is_empty() || r.starts_with('/'));
                path_order(&path, after) != std::cmp::Ordering::Greater && !holds_after
            }),
        };
        Self { base: base.to_string(), entries, next }
    }
}

fn join(base: &str, name: &str) -> String {
    if base.is_empty() { name.to_string() } else { format!("{base}/{name}") }
}

/// Every file under `dir` of `tree` (`dir` itself when it is a file), depth first in
/// [`path_order`], after `start_after` when given: memory is one directory listing per depth,
/// subtrees wholly before `start_after` are not listed, and only the files yielded are copied.
pub fn walk<'a, T: DirTree + 'a>(
    tree: T,
    dir: &'a str,
    start_after: Option<&'a str>,
) -> BoxStream<'a, Result<UfsFile>> {
    walk_with(tree, dir, start_after, false)
}

/// [`walk`], yielding every directory below `dir` too (its `meta.is_dir` set) just before what
/// it holds — empty ones included, which no list of files can imply. A directory may be the
/// `start_after` of a later walk, which then goes on inside it.
pub fn walk_with_dirs<'a, T: DirTree + 'a>(
    tree: T,
    dir: &'a str,
    start_after: Option<&'a str>,
) -> BoxStream<'a, Result<UfsFile>> {
    walk_with(tree, dir, start_after, true)
}

fn walk_with<'a, T: DirTree + 'a>(
    tree: T,
    dir: &'a str,
    start_after: Option<&'a str>,
    dirs: bool,
) -> BoxStream<'a, Result<UfsFile>> {
    enum Step {
        Start,
        Walking(Vec<Level>),
        Done,
    }
    futures::stream::unfold((tree, Step::Start), move |(tree, step)| async move {
        let mut stack = match step {
            Step::Done => return None,
            Step::Start => {
                let root = dir.trim_matches('/');
                match tree.stat(root).await {
                    Ok(_) if start_after == Some(root) => return None,
                    Ok(meta) if !meta.is_dir => {
                        return Some((Ok(UfsFile { path: root.to_string(), meta }), (tree, Step::Done)));
                    }
                    Ok(_) => {}
                    Err(e) => return Some((Err(e), (tree, Step::Done))),
                }
                match tree.list_sorted(root).await {
                    Ok(entries) => vec![Level::new(root, entries, start_after)],
                    Err(e) => return Some((Err(e), (tree, Step::Done))),
                }
            }
            Step::Walking(stack) => stack,
        };
        loop {
            let top = stack.last_mut()?;
            let Some(entry) = top.entries.get(top.next) else {
                stack.pop();
                continue;
            };
            top.next += 1;
            let path = join(&top.base, &entry.name);
            let meta = entry.meta.clone();
            if !meta.is_dir {
                return Some((Ok(UfsFile { path, meta }), (tree, Step::Walking(stack))));
            }
            match tree.list_sorted(&path).await {
                Ok(entries) => stack.push(Level::new(&path, entries, start_after)),
                Err(e) => return Some((Err(e), (tree, Step::Done))),
            }
            // Yielded before by the walk that stopped at or inside it.
            let seen = start_after.is_some_and(|a| path_order(&path, a) != std::cmp::Ordering::Greater);
            if dirs && !seen {
                return Some((Ok(UfsFile { path, meta }), (tree, Step::Walking(stack))));
            }
        }
    })
    .boxed()
}

/// Turns a mount's URI and options into a [`Ufs`].
pub trait UfsFactory: Send + Sync + 'static {
    fn open(&self, uri: &str, options: &BTreeMap<String, String>) -> Result<Arc<dyn Ufs>>;
}

/// The version string of an object without an ETag.
pub fn synthetic_version(mtime_ns: i128, size: u64) -> String {
    format!("m{mtime_ns}-s{size}")
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// A tree of files by path; directories are implied by the paths.
    struct Tree(BTreeSet<&'static str>, std::sync::Mutex<Vec<String>>);

    fn tree(paths: &[&'static str]) -> Tree {
        Tree(paths.iter().copied().collect(), Default::default())
    }

    #[async_trait]
    impl Ufs for Tree {
        async fn stat(&self, path: &str) -> Result<ObjectMeta> {
            let file = ObjectMeta { is_dir: false, size: 1, version: "v".into(), mtime_ms: 0 };
            let dir = ObjectMeta { is_dir: true, size: 0, version: String::new(), mtime_ms: 0 };
            if self.0.contains(path) {
                Ok(file)
            } else if path.is_empty() || self.0.iter().any(|p| p.starts_with(&format!("{path}/"))) {
                Ok(dir)
            } else {
                Err(UfsError::NotFound(path.into()))
            }
        }

        async fn list(&self, dir: &str) -> Result<Vec<UfsEntry>> {
            self.1.lock().unwrap().push(dir.to_string());
            let prefix = if dir.is_empty() { String::new() } else { format!("{dir}/") };
            let mut names = BTreeSet::new();
            for p in self.0.iter().filter_map(|p| p.strip_prefix(prefix.as_str())) {
                names.insert(p.split('/').next().unwrap_or(p).to_string());
            }
            let mut out = Vec::new();
            // Unsorted on purpose: the walk must not rely on the service's order.
            for name in names.into_iter().rev() {
                let meta = self.stat(&format!("{prefix}{name}")).await?;
                out.push(UfsEntry { name, meta });
            }
            Ok(out)
        }

        async fn read_range(&self, _: &str, _: Range<u64>, _: &str) -> Result<Bytes> {
            Ok(Bytes::new())
        }
    }

    fn walk_all(tree: &Tree, dir: &str) -> Vec<String> {
        walk_after(tree, dir, None)
    }

    fn walk_after(tree: &Tree, dir: &str, after: Option<&str>) -> Vec<String> {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(tree.list_recursive(dir, after).map(|r| r.unwrap().path).collect())
    }

    #[test]
    fn recursive_listing_is_depth_first_in_path_order() {
        let tree = tree(&["a.bin", "a/x", "a/b/y", "a-b", "c/d/e/f", "b"]);
        let got = walk_all(&tree, "");
        assert_eq!(got, ["a/b/y", "a/x", "a-b", "a.bin", "b", "c/d/e/f"]);
        let mut sorted = got.clone();
        sorted.sort_by(|x, y| path_order(x, y));
        assert_eq!(got, sorted, "the order is path_order, so a cursor can resume after any path");
        assert_eq!(walk_all(&tree, "a"), ["a/b/y", "a/x"]);
        assert_eq!(walk_all(&tree, "a/x"), ["a/x"], "a file lists itself");
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let first = rt.block_on(async { tree.list_recursive("nope", None).next().await });
        assert!(matches!(first, Some(Err(UfsError::NotFound(_)))));
    }

    fn walk_dirs_after(tree: &Tree, dir: &str, after: Option<&str>) -> Vec<String> {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(
            walk_with_dirs(Plain(tree), dir, after)
                .map(|r| {
                    let f = r.unwrap();
                    if f.meta.is_dir { format!("{}/", f.path) } else { f.path }
                })
                .collect(),
        )
    }

    #[test]
    fn a_walk_with_directories_yields_each_before_its_contents_and_resumes_inside_one() {
        let paths = ["a.bin", "a/x", "a/b/y", "a-b", "c/d/e/f", "b"];
        let full = walk_dirs_after(&tree(&paths), "", None);
        assert_eq!(
            full,
            ["a/", "a/b/", "a/b/y", "a/x", "a-b", "a.bin", "b", "c/", "c/d/", "c/d/e/", "c/d/e/f"]
        );
        for (i, after) in full.iter().enumerate() {
            let after = after.trim_end_matches('/');
            assert_eq!(
                walk_dirs_after(&tree(&paths), "", Some(after)),
                full[i + 1..],
                "resumed after {after}"
            );
        }
        assert_eq!(
            walk_dirs_after(&tree(&paths), "a", None),
            ["a/b/", "a/b/y", "a/x"],
            "the root is not its own entry"
        );
        assert_eq!(
            walk_all(&tree(&paths), ""),
            ["a/b/y", "a/x", "a-b", "a.bin", "b", "c/d/e/f"],
            "files only"
        );
    }

    #[test]
    fn a_resumed_walk_yields_exactly_the_rest_and_skips_finished_subtrees() {
        let paths = ["a.bin", "a/x", "a/b/y", "a/b/z", "a-b", "c/d/e/f", "c/g", "b"];
        let full = walk_all(&tree(&paths), "");
        for (i, after) in full.iter().enumerate() {
            assert_eq!(walk_after(&tree(&paths), "", Some(after)), full[i + 1..], "resumed after {after}");
        }
        let t = tree(&paths);
        assert_eq!(walk_after(&t, "", Some("a-b")), ["a.bin", "b", "c/d/e/f", "c/g"]);
        let listed = t.1.lock().unwrap().clone();
        assert!(
            !listed.iter().any(|d| d.starts_with('a')),
            "finished subtrees are not listed again: {listed:?}"
        );
        assert_eq!(walk_after(&tree(&paths), "a/x", Some("a/x")), Vec::<String>::new(), "a finished file");
    }
}
