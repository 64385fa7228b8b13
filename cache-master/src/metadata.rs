//! The namespace side of the master: the mount table (durable in the store) and a cache of the
//! UFS's stats and listings in front of it. Every Strata path is resolved here.
//!
//! Invariants:
//! - a mount is in the store before it is visible in the table, and leaves the store before
//!   it leaves the table; every change bumps the mounts epoch workers follow;
//! - a cached stat or listing is served only while younger than its mount's `metadata_ttl`
//!   (zero: never cached), and a change made through the master (delete, mkdir, unmount)
//!   forgets what it made stale before it returns;
//! - a stat is answered from the cache when either the path's own stat or the fresh listing of
//!   its parent holds it — the one learnt last, so a stat made after a listing (a `sync` stat
//!   after a change) is not hidden by it. A path the listing lacks is asked of the UFS (a file
//!   made behind Strata's back since the listing exists), never answered "not found" from it.

use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use moka::future::Cache;
use strata_common::{SharedClock, block, path};
use strata_ufs::{ObjectMeta, StateFence, UfsEntry, UfsError, UfsFactory, UfsSpec};
use tracing::{info, warn};

use crate::error::OpError;
use crate::locks::{lock, read, write};
use crate::metrics_defs as m;
use crate::mounts::{Mount, MountError, MountRecord, MountTable};
use crate::store::MetaStore;
use crate::writeback::{PendingView, WriteBack};

/// What a write-back file not yet in the UFS looks like to clients.
fn pending_meta(p: &PendingView) -> ObjectMeta {
    ObjectMeta {
        is_dir: false,
        size: p.record.size,
        version: p.record.version(),
        mtime_ms: p.record.mtime_ms,
    }
}

/// A directory's sorted UFS entries with the write-back files pending at or under it: a file
/// replaces the UFS's entry of the same name, a deeper one shows as its first directory.
fn merge_pending(listed: &[UfsEntry], dir: &str, pending: &[PendingView]) -> Vec<UfsEntry> {
    let mut by_name: std::collections::BTreeMap<String, UfsEntry> =
        listed.iter().map(|e| (e.name.clone(), e.clone())).collect();
    let prefix = format!("{}/", dir.trim_end_matches('/'));
    for p in pending {
        let Some(below) = p.record.path.strip_prefix(&prefix) else { continue };
        match below.split_once('/') {
            None => {
                by_name
                    .insert(below.to_string(), UfsEntry { name: below.to_string(), meta: pending_meta(p) });
            }
            Some((sub, _)) => {
                by_name.entry(sub.to_string()).or_insert_with(|| UfsEntry {
                    name: sub.to_string(),
                    meta: ObjectMeta { is_dir: true, size: 0, version: String::new(), mtime_ms: 0 },
                });
            }
        }
    }
    by_name.into_values().collect()
}

/// A Strata path and where it lives.
pub struct Resolved {
    /// The normalised Strata path.
    pub path: String,
    pub mount: Arc<Mount>,
    /// The path relative to the mount's UFS root ("" for the mount point).
    pub rel: String,
}

impl Resolved {
    /// The identity blocks of this file are keyed by (see `strata_common::block`).
    pub fn file_id(&self) -> String {
        block::file_identity(&self.mount.record.uri, &self.rel, self.mount.block_size)
    }
}

/// One entry of a listing: a Strata path with its UFS metadata.
pub struct Entry {
    pub path: String,
    pub rel: String,
    pub meta: ObjectMeta,
}

struct Cached<T> {
    at: Instant,
    value: T,
}

/// A directory's cached listing, sorted by name.
type CachedListing = Arc<Cached<Arc<Vec<UfsEntry>>>>;

/// The listing of a path's parent for [`Metadata::cached_meta`].
enum ParentListing {
    /// Look it up.
    LookUp,
    /// Looked up by the caller already (for several paths of one directory).
    Known(Option<CachedListing>),
}

pub struct Metadata {
    mounts: RwLock<MountTable>,
    mounts_epoch: Mutex<u64>,
    factory: Arc<dyn UfsFactory>,
    store: Arc<dyn MetaStore>,
    stats: Cache<String, Arc<Cached<ObjectMeta>>>,
    /// Directory listings sorted by name, weighed by their entries.
    lists: Cache<String, CachedListing>,
    /// Cached entries age on this clock.
    clock: SharedClock,
    /// Write-back files not yet in the UFS, overlaid on its metadata.
    pending: Arc<WriteBack>,
    /// What the cluster owns on its hosts; `factory` already puts every local UFS behind it.
    fence: StateFence,
}

/// UFS stats one [`Metadata::stat_many`] runs at once.
const STAT_MANY_CONCURRENCY: usize = 32;

/// Listed entries the cache holds per stat it holds (`cache_entries`): a listing entry is small,
/// and a directory of a million files must fit whole.
pub const LISTED_ENTRIES_PER_STAT: u64 = 10;

/// What [`Metadata::new`] starts from.
pub struct MetadataParams {
    pub mounts: MountTable,
    /// Should grow across restarts, like the membership epoch.
    pub first_epoch: u64,
    pub factory: Arc<dyn UfsFactory>,
    pub store: Arc<dyn MetaStore>,
    /// Stats kept; listings hold [`LISTED_ENTRIES_PER_STAT`] times as many entries in all.
    pub cache_entries: u64,
    pub clock: SharedClock,
    pub pending: Arc<WriteBack>,
    /// The fence `factory` opens local UFSs behind (see `strata_ufs::fence`).
    pub fence: StateFence,
}

impl Metadata {
    pub fn new(p: MetadataParams) -> Self {
        metrics::gauge!(m::MOUNTS).set(p.mounts.len() as f64);
        Self {
            mounts: RwLock::new(p.mounts),
            mounts_epoch: Mutex::new(p.first_epoch),
            factory: p.factory,
            store: p.store,
            stats: Cache::builder().max_capacity(p.cache_entries).build(),
            // A large directory must fit, or every page of its listing would list it again.
            lists: Cache::builder()
                .weigher(|_, l: &CachedListing| {
                    u32::try_from(l.value.len()).unwrap_or(u32::MAX).saturating_add(1)
                })
                .max_capacity(p.cache_entries.saturating_mul(LISTED_ENTRIES_PER_STAT))
                .build(),
            clock: p.clock,
            pending: p.pending,
            fence: p.fence,
        }
    }

    /// Every path of the cluster's own (this master's and its workers'), for the workers.
    pub fn state_paths(&self) -> Vec<String> {
        self.fence.paths().iter().map(|p| p.display().to_string()).collect()
    }

    /// Takes what the workers own (as they registered it). A change is a change of what every
    /// local mount may serve: cached metadata is forgotten, and the mounts epoch moves so that
    /// workers fetch the new paths with the table.
    pub fn learn_state_paths(&self, workers: Vec<String>) {
        if self.fence.learn(workers) {
            self.stats.invalidate_all();
            self.lists.invalidate_all();
            *lock(&self.mounts_epoch) += 1;
            info!(paths = self.fence.paths().len(), "the cluster's own paths changed");
        }
    }

    pub fn pending(&self) -> &Arc<WriteBack> {
        &self.pending
    }

    fn fresh<T>(&self, hit: &Cached<T>, mount: &Mount) -> bool {
        self.clock.now().saturating_duration_since(hit.at) < mount.metadata_ttl
    }

    fn cached<T>(&self, value: T) -> Arc<Cached<T>> {
        Arc::new(Cached { at: self.clock.now(), value })
    }

    pub fn resolve(&self, raw: &str) -> Result<Resolved, OpError> {
        let p = path::normalize(raw)?;
        let (mount, rel) = read(&self.mounts).resolve(&p).ok_or_else(|| OpError::NoMount(p.clone()))?;
        Ok(Resolved { path: p, mount, rel })
    }

    /// A path's metadata: from the cache while fresh (unless `sync`), else from the UFS.
    pub async fn stat(&self, raw: &str, sync: bool) -> Result<(Resolved, ObjectMeta), OpError> {
        let r = self.resolve(raw)?;
        if let Some(p) = self.pending.get(&r.path) {
            return Ok((r, pending_meta(&p)));
        }
        if !sync && let Some(meta) = self.cached_meta(&r, ParentListing::LookUp).await {
            return Ok((r, meta));
        }
        metrics::counter!(m::METADATA_CACHE, "result" => "miss").increment(1);
        self.stat_at_ufs(r).await
    }

    /// Many paths' metadata, one result per path in order: those the cache holds fresh first
    /// (the listing of a directory looked up once for all its paths asked), then the rest from
    /// the UFS, [`STAT_MANY_CONCURRENCY`] at a time.
    pub async fn stat_many(&self, raws: &[String]) -> Vec<Result<(Resolved, ObjectMeta), OpError>> {
        use futures::StreamExt;
        let mut out: Vec<Option<Result<(Resolved, ObjectMeta), OpError>>> = Vec::with_capacity(raws.len());
        let mut misses = Vec::new();
        let mut listings: std::collections::HashMap<String, Option<CachedListing>> =
            std::collections::HashMap::new();
        for (i, raw) in raws.iter().enumerate() {
            let r = match self.resolve(raw) {
                Ok(r) => r,
                Err(e) => {
                    out.push(Some(Err(e)));
                    continue;
                }
            };
            if let Some(p) = self.pending.get(&r.path) {
                out.push(Some(Ok((r, pending_meta(&p)))));
                continue;
            }
            let listing = match parent_of(&r) {
                Some(parent) => match listings.get(parent) {
                    Some(known) => known.clone(),
                    None => {
                        let found = self.lists.get(parent).await;
                        listings.insert(parent.to_string(), found.clone());
                        found
                    }
                },
                None => None,
            };
            match self.cached_meta(&r, ParentListing::Known(listing)).await {
                Some(meta) => out.push(Some(Ok((r, meta)))),
                None => {
                    metrics::counter!(m::METADATA_CACHE, "result" => "miss").increment(1);
                    out.push(None);
                    misses.push((i, r));
                }
            }
        }
        let mut asked = futures::stream::iter(misses)
            .map(|(i, r)| async move { (i, self.stat_at_ufs(r).await) })
            .buffer_unordered(STAT_MANY_CONCURRENCY);
        while let Some((i, answer)) = asked.next().await {
            out[i] = Some(answer);
        }
        out.into_iter().map(|answer| answer.expect("every path answered")).collect()
    }

    /// A path's fresh metadata from the cache, without I/O: its own cached stat or its entry in
    /// the fresh listing of its parent, whichever was learnt last.
    async fn cached_meta(&self, r: &Resolved, parent: ParentListing) -> Option<ObjectMeta> {
        let stat = self.stats.get(&r.path).await.filter(|hit| self.fresh(hit, &r.mount));
        let listing = match parent {
            ParentListing::Known(listing) => listing,
            ParentListing::LookUp => match parent_of(r) {
                Some(parent) => self.lists.get(parent).await,
                None => None,
            },
        };
        let listed = listing.filter(|l| self.fresh(l, &r.mount)).and_then(|l| {
            let name = r.path.rsplit('/').next()?;
            let i = l.value.binary_search_by(|e| e.name.as_str().cmp(name)).ok()?;
            Some((l.at, l.value[i].meta.clone()))
        });
        let (result, meta) = match (stat, listed) {
            (Some(hit), Some((at, _))) if hit.at >= at => ("hit", hit.value.clone()),
            (_, Some((_, meta))) => ("listing", meta),
            (Some(hit), None) => ("hit", hit.value.clone()),
            (None, None) => return None,
        };
        metrics::counter!(m::METADATA_CACHE, "result" => result).increment(1);
        Some(meta)
    }

    /// A path's metadata from the UFS, cached for the mount's TTL.
    async fn stat_at_ufs(&self, r: Resolved) -> Result<(Resolved, ObjectMeta), OpError> {
        let meta = if r.rel.is_empty() {
            // The mount point itself is a directory even if the UFS root has no entry.
            ObjectMeta { is_dir: true, size: 0, version: String::new(), mtime_ms: 0 }
        } else {
            match r.mount.ufs.stat(&r.rel).await {
                Ok(meta) => meta,
                // A directory only write-back files not yet uploaded make.
                Err(UfsError::NotFound(_)) if self.pending.has_children(&r.path) => {
                    return Ok((
                        r,
                        ObjectMeta { is_dir: true, size: 0, version: String::new(), mtime_ms: 0 },
                    ));
                }
                Err(e) => {
                    self.stats.invalidate(&r.path).await;
                    return Err(OpError::ufs(&r.path, e));
                }
            }
        };
        if !r.mount.metadata_ttl.is_zero() {
            self.stats.insert(r.path.clone(), self.cached(meta.clone())).await;
        }
        Ok((r, meta))
    }

    /// One page of a directory's entries, in name order (from the cache while fresh, unless
    /// `sync`), or a file as its own single entry, as `ls` does: at most `limit` entries whose
    /// names come after `after` ("" for the first page), and the name to continue after when
    /// more follow. A page boundary is a name, so a listing that changed between two pages
    /// still continues exactly after what was returned.
    pub async fn list_page(
        &self,
        raw: &str,
        sync: bool,
        after: &str,
        limit: usize,
    ) -> Result<(Arc<Mount>, Vec<Entry>, Option<String>), OpError> {
        let (r, meta) = self.stat(raw, sync).await?;
        if !meta.is_dir {
            let entry = Entry { path: r.path, rel: r.rel, meta };
            return Ok((r.mount, if after.is_empty() { vec![entry] } else { Vec::new() }, None));
        }
        // A later page reuses the listing the first one cached (unless it expired).
        let listed = self.dir_listing(&r.path, &r.rel, &r.mount, !(sync && after.is_empty())).await;
        let pending = self.pending.under(&r.path);
        let all = match listed {
            Ok(all) if pending.is_empty() => all,
            Ok(all) => Arc::new(merge_pending(&all, &r.path, &pending)),
            Err(UfsError::NotFound(_)) if !pending.is_empty() => {
                Arc::new(merge_pending(&[], &r.path, &pending))
            }
            Err(e) => return Err(OpError::ufs(&r.path, e)),
        };
        let start = if after.is_empty() { 0 } else { all.partition_point(|e| e.name.as_str() <= after) };
        let end = start.saturating_add(limit.max(1)).min(all.len());
        let entries = all[start..end]
            .iter()
            .map(|e| Entry {
                path: path::join(&r.path, &e.name),
                rel: if r.rel.is_empty() { e.name.clone() } else { format!("{}/{}", r.rel, e.name) },
                meta: e.meta.clone(),
            })
            .collect();
        let next = (end < all.len()).then(|| all[end - 1].name.clone());
        Ok((r.mount, entries, next))
    }

    /// A directory's entries sorted by name: the cached listing while fresh (when `use_cache`),
    /// else the UFS's, cached for the mount's TTL.
    async fn dir_listing(
        &self,
        path: &str,
        rel: &str,
        mount: &Mount,
        use_cache: bool,
    ) -> Result<Arc<Vec<UfsEntry>>, UfsError> {
        if use_cache
            && let Some(hit) = self.lists.get(path).await
            && self.fresh(&hit, mount)
        {
            return Ok(hit.value.clone());
        }
        let mut entries = mount.ufs.list(rel).await?;
        entries.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        let entries = Arc::new(entries);
        if !mount.metadata_ttl.is_zero() {
            self.lists.insert(path.to_string(), self.cached(entries.clone())).await;
        }
        Ok(entries)
    }

    /// One page of every file under a path (recursively; the file itself when it is one), in
    /// the UFS's deterministic listing order: at most `limit` files after the one whose path
    /// under the mount is `after` ("" for the first page), only those at most `max_depth`
    /// levels below (0: all), and where to continue when more follow. The UFS is listed as a
    /// stream from `after`, so memory is one page whatever the tree's size.
    pub async fn find_page(
        &self,
        raw: &str,
        sync: bool,
        after: &str,
        limit: usize,
        max_depth: usize,
    ) -> Result<(Arc<Mount>, Vec<Entry>, Option<String>), OpError> {
        self.find_page_with(raw, sync, after, limit, max_depth, false).await
    }

    /// [`find_page`](Self::find_page), with every directory below the path too (`with_dirs`),
    /// each just before what it holds, on mounts walked directory by directory (local
    /// directories, HDFS): their empty directories exist and no file implies them. An object
    /// store's recursive listing names files only (its directories are their parents).
    pub async fn find_page_with(
        &self,
        raw: &str,
        sync: bool,
        after: &str,
        limit: usize,
        max_depth: usize,
        with_dirs: bool,
    ) -> Result<(Arc<Mount>, Vec<Entry>, Option<String>), OpError> {
        use futures::StreamExt;
        let (r, meta) = self.stat(raw, sync).await?;
        if !meta.is_dir {
            let entry = Entry { path: r.path, rel: r.rel, meta };
            return Ok((r.mount, if after.is_empty() { vec![entry] } else { Vec::new() }, None));
        }
        let base_depth = if r.rel.is_empty() { 0 } else { r.rel.split('/').count() };
        let mount = r.mount.clone();
        let after = (!after.is_empty()).then_some(after);
        // A walk goes through the cached listings, so the pages of a large directory list it
        // once, not once per page; a service's own ordered listing starts at the page.
        let tree = CachedTree { metadata: self, mount: &mount };
        // A walk goes through cached directory listings, which answer stats already; a
        // service's own recursive listing caches nothing, so its files become cached stats (a
        // reader of what was found, through another client or `StatMany`, then costs no UFS
        // request).
        let feeds_stats = mount.ufs.lists_recursively() && !mount.metadata_ttl.is_zero();
        let mut listing = if mount.ufs.lists_recursively() {
            mount.ufs.list_recursive(&r.rel, after)
        } else if with_dirs {
            strata_ufs::walk_with_dirs(tree, &r.rel, after)
        } else {
            strata_ufs::walk(tree, &r.rel, after)
        };
        // Write-back files not yet in the UFS join the listing in its order (the UFS's copy of
        // a path that has one pending is the older version: the pending one wins).
        let mut pending: std::collections::VecDeque<(String, ObjectMeta)> = self
            .pending
            .under(&r.path)
            .iter()
            .filter_map(|p| {
                let rel = p.record.path.strip_prefix(&mount.record.path)?.trim_start_matches('/').to_string();
                after.is_none_or(|a| rel.as_str() > a).then(|| (rel, pending_meta(p)))
            })
            .collect();
        let mut entries = Vec::new();
        let mut last_seen = None;
        loop {
            let listed = match listing.next().await {
                Some(file) => Some(file.map_err(|e| OpError::ufs(&r.path, e))?),
                None => None,
            };
            let mut next: Vec<(String, ObjectMeta)> = Vec::new();
            while pending.front().is_some_and(|(rel, _)| listed.as_ref().is_none_or(|f| rel <= &f.path)) {
                next.extend(pending.pop_front());
            }
            if let Some(file) = listed {
                if next.last().is_none_or(|(rel, _)| rel != &file.path) {
                    next.push((file.path, file.meta));
                }
            } else if next.is_empty() {
                break;
            }
            for (rel, meta) in next {
                if entries.len() >= limit.max(1) {
                    // One more exists: the page ends at the last one returned (or skipped).
                    drop(listing);
                    return Ok((r.mount, entries, last_seen));
                }
                let depth = rel.split('/').count() - base_depth;
                last_seen = Some(rel.clone());
                if max_depth > 0 && depth > max_depth {
                    continue;
                }
                let strata_path = path::join(&mount.record.path, &rel);
                if feeds_stats && !meta.is_dir && !meta.version.starts_with(crate::writeback::VERSION_PREFIX)
                {
                    self.stats.insert(strata_path.clone(), self.cached(meta.clone())).await;
                }
                entries.push(Entry { path: strata_path, rel, meta });
            }
        }
        drop(listing);
        Ok((r.mount, entries, None))
    }

    /// The metadata a load job loads a listed file at: what clients will be told by `stat`. A
    /// fresh cached stat wins over the listing (clients read that version until the TTL ends);
    /// with `refresh`, or without one, the listing's metadata becomes the cached stat.
    pub async fn listed_meta(
        &self,
        strata_path: &str,
        listed: ObjectMeta,
        refresh: bool,
        mount: &Mount,
    ) -> ObjectMeta {
        if !refresh
            && let Some(hit) = self.stats.get(strata_path).await
            && self.fresh(&hit, mount)
        {
            return hit.value.clone();
        }
        if !mount.metadata_ttl.is_zero() {
            self.stats.insert(strata_path.to_string(), self.cached(listed.clone())).await;
        }
        listed
    }

    /// A path on a mount that may be written through Strata (`mode=write-through`).
    fn writable(&self, raw: &str) -> Result<Resolved, OpError> {
        let r = self.resolve(raw)?;
        if r.mount.read_only || r.mount.ufs.as_write().is_none() {
            return Err(OpError::ReadOnly { path: r.path, mount: r.mount.record.path.clone() });
        }
        Ok(r)
    }

    fn read_only(r: &Resolved) -> OpError {
        OpError::ReadOnly { path: r.path.clone(), mount: r.mount.record.path.clone() }
    }

    pub async fn delete(&self, raw: &str, recursive: bool) -> Result<(), OpError> {
        let r = self.writable(raw)?;
        if r.rel.is_empty() {
            return Err(OpError::MountPoint(r.path));
        }
        // Write-back files not yet uploaded go first, so no later upload brings them back.
        let is_pending_file = self.pending.get(&r.path).is_some();
        if !is_pending_file && !recursive && self.pending.has_children(&r.path) {
            let msg = format!("{} is a directory that is not empty (delete it recursively)", r.path);
            return Err(OpError::ufs(&r.path, UfsError::IsDirectory(msg)));
        }
        let forgotten = self.pending.forget_under(&r.path)?;
        let meta = match r.mount.ufs.stat(&r.rel).await {
            Ok(meta) => meta,
            Err(UfsError::NotFound(_)) if forgotten > 0 => {
                self.forget(&r.path, !is_pending_file).await;
                info!(path = %r.path, files = forgotten, "deleted before its upload");
                return Ok(());
            }
            Err(e) => return Err(OpError::ufs(&r.path, e)),
        };
        let ufs = r.mount.ufs.as_write().ok_or_else(|| Self::read_only(&r))?;
        let result = ufs.delete(&r.rel, meta.is_dir, recursive).await;
        self.forget(&r.path, meta.is_dir).await;
        result.map_err(|e| OpError::ufs(&r.path, e))?;
        info!(path = %r.path, dir = meta.is_dir, "deleted");
        Ok(())
    }

    pub async fn mkdir(&self, raw: &str) -> Result<(), OpError> {
        let r = self.writable(raw)?;
        if r.rel.is_empty() {
            return Ok(());
        }
        match r.mount.ufs.stat(&r.rel).await {
            Ok(meta) if !meta.is_dir => return Err(OpError::FileExists(r.path)),
            Ok(_) => return Ok(()),
            Err(_) => {}
        }
        let ufs = r.mount.ufs.as_write().ok_or_else(|| Self::read_only(&r))?;
        let result = ufs.create_dir(&r.rel).await;
        self.forget(&r.path, false).await;
        result.map_err(|e| OpError::ufs(&r.path, e))
    }

    /// Renames a file or a directory in place through the UFS: `dst` is the new path exactly
    /// (its parents are made); a file there is replaced, a directory there refuses. `Ok(false)`
    /// when it cannot be done in place and nothing changed — the paths are on two mounts, the
    /// UFS cannot rename (object stores), or write-back files not yet uploaded are involved —
    /// so the caller copies and deletes instead.
    pub async fn rename(&self, src: &str, dst: &str) -> Result<bool, OpError> {
        let s = self.writable(src)?;
        let d = self.writable(dst)?;
        for r in [&s, &d] {
            if r.rel.is_empty() {
                return Err(OpError::MountPoint(r.path.clone()));
            }
        }
        if s.path == d.path {
            // Nothing to move; only the source must exist.
            ufs_stat(&s).await?;
            return Ok(true);
        }
        if d.path.starts_with(&format!("{}/", s.path)) {
            let msg = format!("moving {} into itself", s.path);
            return Err(OpError::ufs(&d.path, UfsError::Unsupported(msg)));
        }
        let pending = |p: &str| self.pending.get(p).is_some() || self.pending.has_children(p);
        let in_place = Arc::ptr_eq(&s.mount, &d.mount)
            && s.mount.ufs.as_write().is_some_and(|w| w.capabilities().rename);
        if !in_place || pending(&s.path) || pending(&d.path) {
            return Ok(false);
        }
        let meta = ufs_stat(&s).await?;
        match d.mount.ufs.stat(&d.rel).await {
            Ok(existing) if existing.is_dir && !meta.is_dir => return Err(OpError::IsDirectory(d.path)),
            Ok(existing) if existing.is_dir => {
                let msg = format!("{} is a directory that exists", d.path);
                return Err(OpError::ufs(&d.path, UfsError::AlreadyExists(msg)));
            }
            Ok(_) if meta.is_dir => return Err(OpError::FileExists(d.path)),
            Ok(_) | Err(UfsError::NotFound(_)) => {}
            Err(e) => return Err(OpError::ufs(&d.path, e)),
        }
        let ufs = s.mount.ufs.as_write().ok_or_else(|| Self::read_only(&s))?;
        let result = ufs.rename(&s.rel, &d.rel).await;
        self.forget(&s.path, meta.is_dir).await;
        self.forget(&d.path, meta.is_dir).await;
        result.map_err(|e| OpError::ufs(&s.path, e))?;
        info!(src = %s.path, dst = %d.path, dir = meta.is_dir, "renamed");
        Ok(true)
    }

    /// Forgets what the cache knows of a path (and of its parents' listings).
    pub async fn invalidate(&self, raw: &str) -> Result<(), OpError> {
        let r = self.resolve(raw)?;
        self.forget(&r.path, false).await;
        Ok(())
    }

    /// Forgets cached metadata a change at `p` makes stale: its own, and the listings (and
    /// stats: an object store's directory exists only while it has children) of its parents.
    async fn forget(&self, p: &str, subtree: bool) {
        if subtree {
            self.stats.invalidate_all();
            self.lists.invalidate_all();
            return;
        }
        self.stats.invalidate(p).await;
        self.lists.invalidate(p).await;
        let mut cur = p;
        while let Some((parent, _)) = cur.rsplit_once('/') {
            let parent = if parent.is_empty() { "/" } else { parent };
            self.stats.invalidate(parent).await;
            self.lists.invalidate(parent).await;
            if parent == "/" {
                break;
            }
            cur = parent;
        }
    }

    /// Validates a new mount, reaches its UFS once, stores it, then shows it.
    /// Adds a mount; the warnings are for the caller (the mount is in force).
    ///
    /// A local directory that lies inside the cluster's own state is refused (nothing in it
    /// could be served); one that holds some of it is mounted with that part fenced, and a
    /// warning says so.
    pub async fn add_mount(&self, record: MountRecord) -> Result<(Arc<Mount>, Vec<String>), OpError> {
        let mut warnings = Vec::new();
        if let Ok(UfsSpec::Fs { root }) = UfsSpec::parse(&record.uri) {
            let inside = self.fence.check_root(std::path::Path::new(&root)).map_err(|source| {
                MountError::Ufs { path: record.path.clone(), uri: record.uri.clone(), source }
            })?;
            if !inside.is_empty() {
                let list: Vec<String> = inside.iter().map(|p| p.display().to_string()).collect();
                warn!(mount = %record.path, uri = %record.uri, state = ?list, "a mount's directory holds Strata's own state: it stays hidden");
                warnings.push(format!(
                    "{} holds Strata's own state ({}): it is never served, listed or written through {}",
                    record.uri,
                    list.join(", "),
                    record.path
                ));
            }
        }
        let mount = Mount::open(record, self.factory.as_ref())?;
        read(&self.mounts).check_new(&mount)?;
        // Reach the UFS once now, so a wrong root fails here and not at the first read.
        if let Err(source) = mount.ufs.stat("").await {
            let (path, uri) = (mount.record.path.clone(), mount.record.uri.clone());
            return Err(MountError::Ufs { path, uri, source }.into());
        }
        let mount = {
            let mut table = write(&self.mounts);
            // Checked again under the write lock: another add may have raced us.
            table.check_new(&mount)?;
            self.store.put_mount(&mount.record)?;
            info!(mount = %mount.record.path, uri = %mount.record.uri, "mount added");
            let mount = table.insert(mount);
            metrics::gauge!(m::MOUNTS).set(table.len() as f64);
            mount
        };
        *lock(&self.mounts_epoch) += 1;
        Ok((mount, warnings))
    }

    pub fn remove_mount(&self, raw: &str) -> Result<(), OpError> {
        let p = path::normalize(raw)?;
        {
            let mut table = write(&self.mounts);
            if table.resolve(&p).is_none_or(|(m, rel)| !rel.is_empty() || m.record.path != p) {
                return Err(MountError::NotMounted(p).into());
            }
            self.store.delete_mount(&p)?;
            table.remove(&p);
            metrics::gauge!(m::MOUNTS).set(table.len() as f64);
            info!(mount = %p, "mount removed");
        }
        self.stats.invalidate_all();
        self.lists.invalidate_all();
        *lock(&self.mounts_epoch) += 1;
        Ok(())
    }

    /// The mount table and its epoch.
    pub fn mounts(&self) -> (u64, Vec<Arc<Mount>>) {
        let table = read(&self.mounts);
        (self.mounts_epoch(), table.iter().cloned().collect())
    }

    pub fn mounts_epoch(&self) -> u64 {
        *lock(&self.mounts_epoch)
    }

    pub fn mount_count(&self) -> usize {
        read(&self.mounts).len()
    }
}

/// A path's metadata straight from its UFS (a change about to be made must not act on a cached
/// stat).
async fn ufs_stat(r: &Resolved) -> Result<ObjectMeta, OpError> {
    r.mount.ufs.stat(&r.rel).await.map_err(|e| OpError::ufs(&r.path, e))
}

/// The Strata path of the directory whose listing holds `r`; `None` for a mount point.
fn parent_of(r: &Resolved) -> Option<&str> {
    if r.rel.is_empty() {
        return None;
    }
    let (parent, _) = r.path.rsplit_once('/')?;
    Some(if parent.is_empty() { "/" } else { parent })
}

/// A mount's tree as the metadata cache sees it, for walks.
struct CachedTree<'a> {
    metadata: &'a Metadata,
    mount: &'a Mount,
}

#[async_trait::async_trait]
impl strata_ufs::DirTree for CachedTree<'_> {
    async fn stat(&self, rel: &str) -> Result<ObjectMeta, UfsError> {
        self.mount.ufs.stat(rel).await
    }

    async fn list_sorted(&self, rel: &str) -> Result<Arc<Vec<UfsEntry>>, UfsError> {
        let path = path::join(&self.mount.record.path, rel);
        self.metadata.dir_listing(&path, rel, self.mount, true).await
    }
}
