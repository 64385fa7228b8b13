//! The cluster never serves itself: a `file://` UFS that overlaps a master's or worker's own
//! files (state, tiers, journals, sockets, tokens, keys) shows none of them, by construction.
//!
//! Every process that owns files *claims* them in its [`StateFence`] at start: a directory it
//! owns gets a marker file ([`STATE_MARKER`]) and its resolved path is fenced; a file it owns
//! elsewhere (a token file, a TLS key, a socket) has its resolved path fenced. Processes tell
//! each other what they own (workers at registration, the master with the mount table), so a
//! worker also fences the master's files and the other workers'. Every `file://` UFS a process
//! opens goes through [`StateFence::wrap`], which puts a [`Fenced`] in front of it: before any
//! operation the path is resolved as the kernel would (symbolic links and `..` followed), and
//! an operation whose resolved path
//!
//! - lies outside the mount's own directory (a link leading out), or
//! - is or lies inside a fenced path, or inside a directory holding a marker,
//!
//! is refused with `PermissionDenied`; a listing leaves such entries out, and a recursive delete
//! or a rename of a directory that holds any of them is refused whole. The marker catches state
//! of processes that are not running or that this process was never told about; the fenced
//! paths catch files outside any marked directory. Names are never the test: a directory called
//! `.strata` with no marker is data like any other, and a state directory under any name is not.
//!
//! Resolution and the marker checks are a few `stat` calls per operation, made on a blocking
//! thread (a hung NFS directory must not stall the runtime); they are paid only when the UFS is
//! asked (a miss, a listing), never by a cached read.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::io;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use tracing::warn;

use crate::{
    ObjectMeta, Result, Ufs, UfsEntry, UfsError, UfsFactory, UfsSpec, UfsWrite, UfsWriter, WriteCapabilities,
};

/// The file that marks a directory as a Strata process's own: nothing at or below a directory
/// holding it is ever served, listed or written through a `file://` UFS.
pub const STATE_MARKER: &str = ".strata-state";

const MARKER_TEXT: &str = "This directory holds a Strata master's or worker's own state (tokens, tiers, journals).\n\
Strata never serves, lists or writes anything at or below it through a file:// mount.\n";

/// What the processes of a cluster own on their file systems, as resolved absolute paths.
#[derive(Clone, Default)]
pub struct StateFence {
    paths: Arc<RwLock<Paths>>,
}

#[derive(Default)]
struct Paths {
    /// Claimed by this process.
    own: BTreeSet<PathBuf>,
    /// Claimed by the other processes of the cluster, as they told us.
    learned: BTreeSet<PathBuf>,
}

impl std::fmt::Debug for StateFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateFence").field("paths", &self.paths()).finish()
    }
}

impl StateFence {
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes `dir` (and its parents) if missing, marks it as state and fences it. A directory
    /// inside one this fence claimed already is fenced without a marker of its own (the one
    /// above covers it, and its owner need not meet a stranger among its files).
    pub fn claim_dir(&self, dir: &Path) -> io::Result<PathBuf> {
        std::fs::create_dir_all(dir)?;
        let resolved = std::fs::canonicalize(dir)?;
        if !self.read().own.iter().any(|claimed| resolved.starts_with(claimed)) {
            mark_state_dir(&resolved)?;
        }
        self.write().own.insert(resolved.clone());
        Ok(resolved)
    }

    /// Fences a file this process owns (it need not exist yet: a token file created later, a
    /// socket bound later).
    pub fn claim_file(&self, file: &Path) -> io::Result<PathBuf> {
        let resolved = resolve(&std::path::absolute(file)?)?;
        self.write().own.insert(resolved.clone());
        Ok(resolved)
    }

    /// What this process claimed, to tell the others.
    pub fn own(&self) -> Vec<String> {
        self.read().own.iter().map(|p| p.display().to_string()).collect()
    }

    /// Replaces what the other processes of the cluster own. Returns whether it changed.
    pub fn learn(&self, paths: impl IntoIterator<Item = String>) -> bool {
        let learned: BTreeSet<PathBuf> =
            paths.into_iter().filter(|p| p.starts_with('/')).map(PathBuf::from).collect();
        let mut guard = self.write();
        if guard.learned == learned {
            return false;
        }
        guard.learned = learned;
        true
    }

    /// Every fenced path: this process's and those it learnt.
    pub fn paths(&self) -> Vec<PathBuf> {
        let guard = self.read();
        guard.own.iter().chain(guard.learned.iter()).cloned().collect()
    }

    /// Checks a local directory about to be mounted: an error when it is, or lies inside, a
    /// fenced path or a marked directory (nothing in it could ever be served); otherwise the
    /// fenced paths inside it, which stay hidden (for a warning).
    pub fn check_root(&self, root: &Path) -> Result<Vec<PathBuf>> {
        let resolved = resolve(root).map_err(|e| io_err(&root.display().to_string(), e))?;
        if let Some(state) = self.state_holding(&resolved) {
            return Err(UfsError::InvalidConfig(format!(
                "{} lies inside Strata's own state ({}): a mount may not serve the cluster's files; \
                 mount a directory outside it",
                root.display(),
                state.display()
            )));
        }
        Ok(self.paths().into_iter().filter(|p| p.starts_with(&resolved)).collect())
    }

    /// The fenced path or marked directory `resolved` is at or under, if any, looking at every
    /// ancestor up to `/`.
    fn state_holding(&self, resolved: &Path) -> Option<PathBuf> {
        if let Some(p) = self.paths().into_iter().find(|p| resolved.starts_with(p)) {
            return Some(p);
        }
        resolved.ancestors().find(|a| has_marker(a)).map(Path::to_path_buf)
    }

    /// `factory` with every `file://` UFS it opens behind this fence.
    pub fn wrap(&self, factory: Arc<dyn UfsFactory>) -> Arc<dyn UfsFactory> {
        Arc::new(FencedFactory { inner: factory, fence: self.clone() })
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Paths> {
        self.paths.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Paths> {
        self.paths.write().unwrap_or_else(|p| p.into_inner())
    }
}

/// Makes `dir` (and its parents) if missing and marks it as state: every process's fence keeps
/// it and all below it out of every local mount, whoever made it (`strata standalone` marks the
/// directory that holds its master's and worker's). Returns it resolved.
pub fn mark_state_dir(dir: &Path) -> io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let marker = dir.join(STATE_MARKER);
    if std::fs::symlink_metadata(&marker).is_err() {
        std::fs::write(&marker, MARKER_TEXT)?;
    }
    std::fs::canonicalize(dir)
}

fn has_marker(dir: &Path) -> bool {
    std::fs::symlink_metadata(dir.join(STATE_MARKER)).is_ok()
}

/// `path` (absolute) with every symbolic link and `..` resolved, as far as it exists: the
/// deepest existing ancestor is canonicalized and the missing rest appended (a missing name
/// cannot be a link). A dangling link on the way is an error: where it leads cannot be checked.
fn resolve(path: &Path) -> io::Result<PathBuf> {
    let mut existing = path.to_path_buf();
    let mut missing: Vec<OsString> = Vec::new();
    loop {
        match std::fs::canonicalize(&existing) {
            Ok(mut out) => {
                for name in missing.iter().rev() {
                    out.push(name);
                }
                return Ok(out);
            }
            Err(e) if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::NotADirectory) => {
                if std::fs::symlink_metadata(&existing).is_ok_and(|m| m.file_type().is_symlink()) {
                    return Err(io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        "a symbolic link on the way leads nowhere (not followed)",
                    ));
                }
                match (existing.parent(), existing.file_name()) {
                    (Some(parent), Some(name)) => {
                        missing.push(name.to_owned());
                        existing = parent.to_path_buf();
                    }
                    _ => return Err(e),
                }
            }
            Err(e) => return Err(e),
        }
    }
}

fn io_err(path: &str, e: io::Error) -> UfsError {
    match e.kind() {
        io::ErrorKind::NotFound => UfsError::NotFound(path.to_string()),
        io::ErrorKind::PermissionDenied => UfsError::PermissionDenied(format!("{path}: {e}")),
        _ => UfsError::Other(format!("{path}: {e}")),
    }
}

struct FencedFactory {
    inner: Arc<dyn UfsFactory>,
    fence: StateFence,
}

impl UfsFactory for FencedFactory {
    fn open(&self, uri: &str, options: &BTreeMap<String, String>) -> Result<Arc<dyn Ufs>> {
        let ufs = self.inner.open(uri, options)?;
        match UfsSpec::parse(uri)? {
            UfsSpec::Fs { root } => Ok(Arc::new(Fenced::new(ufs, Path::new(&root), self.fence.clone())?)),
            _ => Ok(ufs),
        }
    }
}

/// Why a path is refused.
enum Refusal {
    Outside,
    State,
    Marker,
}

impl Refusal {
    fn error(&self, path: &str) -> UfsError {
        let why = match self {
            Refusal::Outside => "a symbolic link leads outside the mount's directory (not followed)",
            Refusal::State => "inside a Strata master's or worker's own state (never served)",
            Refusal::Marker => "the name of Strata's state marker is reserved",
        };
        UfsError::PermissionDenied(format!("{path}: {why}"))
    }
}

/// What a check decides about one path, made on a blocking thread.
#[derive(Clone)]
struct Checker {
    /// The mount's directory, resolved.
    root: PathBuf,
    /// The mount's directory itself lies inside state (a marker above it).
    root_in_state: bool,
    fence: StateFence,
}

impl Checker {
    /// `rel` (relative to the root) resolved, or why it is refused.
    fn admit(&self, rel: &str) -> std::result::Result<PathBuf, (Refusal, Option<io::Error>)> {
        if self.root_in_state {
            return Err((Refusal::State, None));
        }
        let mut full = self.root.clone();
        for part in rel.split('/').filter(|p| !p.is_empty()) {
            if part == "." || part == ".." {
                return Err((Refusal::Outside, None));
            }
            full.push(part);
        }
        let resolved = resolve(&full).map_err(|e| (Refusal::Outside, Some(e)))?;
        if !resolved.starts_with(&self.root) {
            return Err((Refusal::Outside, None));
        }
        if resolved.file_name().is_some_and(|n| n == STATE_MARKER) {
            return Err((Refusal::Marker, None));
        }
        if self.fence.paths().iter().any(|p| resolved.starts_with(p)) {
            return Err((Refusal::State, None));
        }
        if resolved.ancestors().take_while(|a| a.starts_with(&self.root)).any(has_marker) {
            return Err((Refusal::State, None));
        }
        Ok(resolved)
    }

    /// Whether the directory `resolved` holds state anywhere below it (so it may be neither
    /// deleted whole nor renamed). Walks the tree without following links.
    fn holds_state(&self, resolved: &Path) -> bool {
        if self.fence.paths().iter().any(|p| p.starts_with(resolved)) {
            return true;
        }
        let mut stack = vec![resolved.to_path_buf()];
        while let Some(dir) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else { continue };
            for entry in entries.flatten() {
                if entry.file_name() == STATE_MARKER {
                    return true;
                }
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    stack.push(entry.path());
                }
            }
        }
        false
    }

    /// Which entries of the listing of `dir` may be shown: `Keep`, `Drop`, or `Follow` (a link
    /// kept, whose metadata must be its target's).
    fn sort_listing(&self, dir: &str, names: Vec<String>) -> Vec<Shown> {
        let Ok(dir_resolved) = self.admit(dir) else {
            return names.iter().map(|_| Shown::Drop).collect();
        };
        // The directories a walk went through to get here: a link back to one of them is a loop.
        let mut chain: Option<Vec<PathBuf>> = None;
        let fenced = self.fence.paths();
        names
            .into_iter()
            .map(|name| {
                let full = dir_resolved.join(&name);
                let Ok(meta) = std::fs::symlink_metadata(&full) else { return Shown::Drop };
                if name == STATE_MARKER || fenced.iter().any(|p| full.starts_with(p)) {
                    return Shown::Drop;
                }
                if meta.file_type().is_dir() {
                    return if has_marker(&full) { Shown::Drop } else { Shown::Keep };
                }
                if !meta.file_type().is_symlink() {
                    return Shown::Keep;
                }
                let rel =
                    if dir.is_empty() { name.clone() } else { format!("{}/{name}", dir.trim_matches('/')) };
                let Ok(target) = self.admit(&rel) else { return Shown::Drop };
                if target.is_dir() {
                    let chain = chain.get_or_insert_with(|| self.chain(dir));
                    if chain.iter().any(|c| c == &target) {
                        return Shown::Drop;
                    }
                }
                Shown::Follow(rel)
            })
            .collect()
    }

    /// The resolved directories from the root down to `dir`, one per component of `dir`.
    fn chain(&self, dir: &str) -> Vec<PathBuf> {
        let mut out = vec![self.root.clone()];
        let mut rel = String::new();
        for part in dir.split('/').filter(|p| !p.is_empty()) {
            if !rel.is_empty() {
                rel.push('/');
            }
            rel.push_str(part);
            if let Ok(r) = self.admit(&rel) {
                out.push(r);
            }
        }
        out
    }
}

enum Shown {
    Keep,
    Drop,
    Follow(String),
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| UfsError::Other(format!("path check did not finish: {e}")))
}

/// A local-directory UFS that refuses every path leading outside its directory or into
/// Strata's own state (see the module's documentation).
pub struct Fenced {
    inner: Arc<dyn Ufs>,
    checker: Checker,
}

impl Fenced {
    pub fn new(inner: Arc<dyn Ufs>, root: &Path, fence: StateFence) -> Result<Self> {
        let resolved = std::fs::canonicalize(root).map_err(|e| io_err(&root.display().to_string(), e))?;
        let root_in_state = resolved.ancestors().any(has_marker);
        if root_in_state {
            warn!(root = %root.display(), "a mount's directory lies inside Strata's own state: nothing in it is served");
        }
        Ok(Self { inner, checker: Checker { root: resolved, root_in_state, fence } })
    }

    async fn admit(&self, rel: &str) -> Result<PathBuf> {
        let checker = self.checker.clone();
        let owned = rel.to_string();
        match blocking(move || checker.admit(&owned)).await? {
            Ok(resolved) => Ok(resolved),
            Err((refusal, io)) => {
                let path = if rel.is_empty() { "/" } else { rel };
                let err = match io {
                    Some(e) if e.kind() != io::ErrorKind::PermissionDenied => io_err(path, e),
                    Some(e) => UfsError::PermissionDenied(format!("{path}: {e}")),
                    None => refusal.error(path),
                };
                warn!(path, err = %err, "refused a path outside the mount's directory or in Strata's state");
                Err(err)
            }
        }
    }

    /// A directory about to be deleted whole or renamed must hold no state.
    async fn admit_whole(&self, rel: &str) -> Result<()> {
        let resolved = self.admit(rel).await?;
        let checker = self.checker.clone();
        if blocking(move || resolved.is_dir() && checker.holds_state(&resolved)).await? {
            return Err(UfsError::PermissionDenied(format!(
                "{rel}: holds a Strata master's or worker's own state, which is never deleted or moved \
                 through a mount"
            )));
        }
        Ok(())
    }

    fn write_side(&self) -> Result<&dyn UfsWrite> {
        self.inner.as_write().ok_or_else(|| UfsError::Unsupported("this UFS cannot be written".into()))
    }
}

#[async_trait]
impl Ufs for Fenced {
    fn as_write(&self) -> Option<&dyn UfsWrite> {
        self.inner.as_write().map(|_| self as &dyn UfsWrite)
    }

    async fn stat(&self, path: &str) -> Result<ObjectMeta> {
        self.admit(path).await?;
        self.inner.stat(path).await
    }

    async fn list(&self, dir: &str) -> Result<Vec<UfsEntry>> {
        self.admit(dir).await?;
        let entries = self.inner.list(dir).await?;
        let names: Vec<String> = entries.iter().map(|e| e.name.trim_end_matches('/').to_string()).collect();
        let checker = self.checker.clone();
        let owned = dir.to_string();
        let shown = blocking(move || checker.sort_listing(&owned, names)).await?;
        let mut out = Vec::with_capacity(entries.len());
        for (entry, shown) in entries.into_iter().zip(shown) {
            match shown {
                Shown::Keep => out.push(entry),
                Shown::Drop => {}
                // The listing describes the link itself; a read follows it: show what a read gets.
                Shown::Follow(rel) => match self.inner.stat(&rel).await {
                    Ok(meta) => out.push(UfsEntry { name: entry.name, meta }),
                    Err(UfsError::NotFound(_)) => {}
                    Err(e) => return Err(e),
                },
            }
        }
        Ok(out)
    }

    async fn read_range(&self, path: &str, range: Range<u64>, version: &str) -> Result<Bytes> {
        self.admit(path).await?;
        self.inner.read_range(path, range, version).await
    }

    fn read_stream<'a>(
        &'a self,
        path: &'a str,
        range: Range<u64>,
        version: &'a str,
    ) -> BoxStream<'a, Result<Bytes>> {
        futures::stream::once(self.admit(path))
            .map(move |admitted| match admitted {
                Ok(_) => self.inner.read_stream(path, range.clone(), version),
                Err(e) => futures::stream::once(async move { Err(e) }).boxed(),
            })
            .flatten()
            .boxed()
    }

    fn checks_version_first(&self) -> bool {
        self.inner.checks_version_first()
    }

    // `list_recursive` stays the default walk over this type's own `list`, so it sees only
    // what a listing shows (the inner UFS's own recursive listing would not be fenced).
}

#[async_trait]
impl UfsWrite for Fenced {
    fn capabilities(&self) -> WriteCapabilities {
        self.inner.as_write().map(|w| w.capabilities()).unwrap_or_default()
    }

    async fn copy(&self, from: &str, to: &str) -> Result<()> {
        self.admit(from).await?;
        self.admit(to).await?;
        self.write_side()?.copy(from, to).await
    }

    async fn rename(&self, from: &str, to: &str) -> Result<()> {
        self.admit_whole(from).await?;
        self.admit(to).await?;
        self.write_side()?.rename(from, to).await
    }

    async fn appender(&self, path: &str) -> Result<Box<dyn UfsWriter>> {
        self.admit(path).await?;
        self.write_side()?.appender(path).await
    }

    async fn writer(&self, path: &str) -> Result<Box<dyn UfsWriter>> {
        self.admit(path).await?;
        self.write_side()?.writer(path).await
    }

    async fn delete(&self, path: &str, is_dir: bool, recursive: bool) -> Result<()> {
        if is_dir && recursive {
            self.admit_whole(path).await?;
        } else {
            self.admit(path).await?;
        }
        self.write_side()?.delete(path, is_dir, recursive).await
    }

    async fn create_dir(&self, path: &str) -> Result<()> {
        self.admit(path).await?;
        self.write_side()?.create_dir(path).await
    }

    async fn check_write(&self, path: &str) -> Result<()> {
        self.admit(path).await.map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;
    use crate::OpendalFactory;

    struct Lab {
        dir: tempfile::TempDir,
        fence: StateFence,
        ufs: Arc<dyn Ufs>,
    }

    /// A served directory `srv` holding data, a marked state directory `srv/.strata` with a
    /// token, a token file claimed outside any marked directory, and a secret outside `srv`.
    fn lab() -> Lab {
        let dir = tempfile::tempdir().unwrap();
        let srv = dir.path().join("srv");
        std::fs::create_dir_all(srv.join("data/sub")).unwrap();
        std::fs::write(srv.join("data/a.bin"), b"hello").unwrap();
        std::fs::write(srv.join("data/sub/b.bin"), b"world").unwrap();
        std::fs::write(dir.path().join("secret.txt"), b"outside").unwrap();
        let fence = StateFence::new();
        fence.claim_dir(&srv.join(".strata")).unwrap();
        std::fs::write(srv.join(".strata/admin.token"), b"strata_x").unwrap();
        std::fs::write(srv.join("worker.token"), b"strata_w").unwrap();
        fence.claim_file(&srv.join("worker.token")).unwrap();
        let factory = fence.wrap(Arc::new(OpendalFactory));
        let ufs = factory.open(&format!("file://{}", srv.display()), &BTreeMap::new()).unwrap();
        Lab { dir, fence, ufs }
    }

    fn names(entries: &[UfsEntry]) -> Vec<&str> {
        entries.iter().map(|e| e.name.as_str()).collect()
    }

    fn denied<T>(r: Result<T>) -> String {
        match r {
            Err(UfsError::PermissionDenied(m)) => m,
            Err(e) => panic!("expected permission denied, got {e:?}"),
            Ok(_) => panic!("expected permission denied, got a success"),
        }
    }

    #[tokio::test]
    async fn state_is_not_listed_read_or_statted() {
        let lab = lab();
        let root = lab.ufs.list("").await.unwrap();
        assert_eq!(names(&root), ["data"], "neither the state directory nor the claimed token file");
        for path in [".strata", ".strata/admin.token", ".strata/nope", "worker.token", ".strata/../.strata"] {
            let m = denied(lab.ufs.stat(path).await);
            assert!(m.contains("state") || m.contains("outside"), "{path}: {m}");
        }
        denied(lab.ufs.read_range(".strata/admin.token", 0..4, "v").await);
        let streamed: Vec<_> = lab.ufs.read_stream(".strata/admin.token", 0..4, "v").collect().await;
        assert!(matches!(streamed.as_slice(), [Err(UfsError::PermissionDenied(_))]));
        denied(lab.ufs.list(".strata").await);
        let all: Vec<String> = lab.ufs.list_recursive("", None).map(|f| f.unwrap().path).collect().await;
        assert_eq!(all, ["data/a.bin", "data/sub/b.bin"]);
        assert_eq!(lab.ufs.stat("data/a.bin").await.unwrap().size, 5, "data is served as before");
    }

    #[tokio::test]
    async fn state_cannot_be_written_deleted_or_moved() {
        let lab = lab();
        let w = lab.ufs.as_write().unwrap();
        denied(w.writer(".strata/admin.token").await);
        denied(w.writer("worker.token").await);
        denied(w.appender(".strata/admin.token").await);
        denied(w.delete(".strata/admin.token", false, false).await);
        denied(w.delete(".strata", true, true).await);
        denied(w.create_dir(".strata/x").await);
        denied(w.copy("data/a.bin", ".strata/admin.token").await);
        denied(w.copy(".strata/admin.token", "data/stolen").await);
        denied(w.rename(".strata", "moved").await);
        denied(w.rename("data/a.bin", ".strata/admin.token").await);
        denied(w.writer("data/.strata-state").await);
        let m = denied(w.delete("", true, true).await);
        assert!(m.contains("holds"), "{m}");
        // A directory holding a claimed file cannot be renamed away either.
        std::fs::create_dir(lab.dir.path().join("srv/data/keys")).unwrap();
        lab.fence.claim_file(&lab.dir.path().join("srv/data/keys/tls.key")).unwrap();
        denied(w.rename("data", "elsewhere").await);
        let srv = lab.dir.path().join("srv");
        assert_eq!(std::fs::read(srv.join(".strata/admin.token")).unwrap(), b"strata_x");
        assert_eq!(std::fs::read(srv.join("worker.token")).unwrap(), b"strata_w");
        // Everything else is written as before.
        w.delete("data/sub", true, true).await.unwrap();
        assert!(!srv.join("data/sub").exists());
    }

    #[tokio::test]
    async fn links_are_followed_only_inside_the_mount() {
        let lab = lab();
        let srv = lab.dir.path().join("srv");
        symlink(lab.dir.path().join("secret.txt"), srv.join("data/out")).unwrap();
        symlink(lab.dir.path(), srv.join("data/up")).unwrap();
        symlink(srv.join(".strata/admin.token"), srv.join("data/tok")).unwrap();
        symlink(srv.join(".strata"), srv.join("data/st")).unwrap();
        symlink("a.bin", srv.join("data/in")).unwrap();
        symlink("sub", srv.join("data/subdir")).unwrap();
        symlink("..", srv.join("data/sub/loop")).unwrap();
        symlink("nowhere", srv.join("data/dangling")).unwrap();
        let listed = lab.ufs.list("data").await.unwrap();
        assert_eq!(names(&listed), ["a.bin", "in", "sub", "subdir"]);
        let stat = lab.ufs.stat("data/a.bin").await.unwrap();
        assert_eq!(listed[1].meta, stat, "a link inside is listed as what it leads to");
        assert!(listed[3].meta.is_dir);
        for p in ["data/out", "data/up/secret.txt", "data/tok", "data/st/admin.token", "data/dangling/x"] {
            denied(lab.ufs.stat(p).await);
        }
        denied(lab.ufs.read_range("data/out", 0..7, "v").await);
        let v = lab.ufs.stat("data/in").await.unwrap().version;
        assert_eq!(&lab.ufs.read_range("data/in", 0..5, &v).await.unwrap()[..], b"hello");
        // A link back up the tree is not walked into (a walk would never end).
        assert_eq!(names(&lab.ufs.list("data/sub").await.unwrap()), ["b.bin"]);
        let all: Vec<String> = lab.ufs.list_recursive("data", None).map(|f| f.unwrap().path).collect().await;
        assert_eq!(all, ["data/a.bin", "data/in", "data/sub/b.bin", "data/subdir/b.bin"]);
    }

    #[tokio::test]
    async fn learnt_paths_are_fenced_and_a_mount_inside_state_serves_nothing() {
        let lab = lab();
        let srv = lab.dir.path().join("srv");
        std::fs::create_dir(srv.join("data/other-worker")).unwrap();
        let other = std::fs::canonicalize(srv.join("data/other-worker")).unwrap();
        assert!(lab.fence.learn([other.display().to_string()]));
        assert!(!lab.fence.learn([other.display().to_string()]), "the same paths are no change");
        denied(lab.ufs.stat("data/other-worker").await);
        assert_eq!(names(&lab.ufs.list("data").await.unwrap()), ["a.bin", "sub"]);

        let inside = format!("file://{}", srv.join(".strata").display());
        let e = lab.fence.check_root(&srv.join(".strata")).unwrap_err();
        assert!(e.to_string().contains("inside Strata's own state"), "{e}");
        let ufs = lab.fence.wrap(Arc::new(OpendalFactory)).open(&inside, &BTreeMap::new()).unwrap();
        denied(ufs.stat("admin.token").await);
        denied(ufs.list("").await);
        let contained = lab.fence.check_root(&srv).unwrap();
        assert!(contained.iter().any(|p| p.ends_with(".strata")), "{contained:?}");
    }

    #[test]
    fn a_name_alone_is_not_state() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join(".strata")).unwrap();
        let checker = Checker {
            root: std::fs::canonicalize(dir.path()).unwrap(),
            root_in_state: false,
            fence: StateFence::new(),
        };
        assert!(checker.admit(".strata").is_ok(), "an unmarked directory is data, whatever its name");
    }
}
