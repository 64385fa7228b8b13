//! The namespace as a client sees it: stats, listings and the mutations that change them,
//! behind one trait, [`Metadata`], so a front end (the CLI, Python, a FUSE mount, an S3
//! gateway) can be written and tested against it without a cluster.
//!
//! [`MasterMetadata`] is the real one: it asks the master, keeps stats for their mount's
//! `metadata_ttl` and whole listings for outages, and while the master is unreachable answers
//! from what it has (for `master_outage_grace`) or asks a worker to stat at the UFS (see
//! `outage`). [`FakeMetadata`] (feature `testing`) is an in-memory namespace for tests.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;
use futures::StreamExt;
use strata_common::frame::{FileStat, StatRequest};
use strata_common::{ErrorKind, SharedClock, path};
use strata_proto::{DeleteRequest, InvalidateRequest, ListRequest, MkdirRequest, RenameRequest};
use tracing::debug;

use crate::listings::{ListKey, Listings, STALE_TOKEN};
use crate::master::MasterLink;
use crate::transport::{self, Dial, TransportError};
use crate::view::ClusterView;
use crate::{ClientError, FileInfo, MountInfo, Page, Persist, Result};

/// Paths per `StatMany` call: a message of a few hundred KiB, far below the master's limits.
pub const STAT_MANY_CHUNK: usize = 1_000;
/// `StatMany` calls in flight at once.
const STAT_MANY_CALLS: usize = 4;
/// Single stats in flight at once when a master cannot take `StatMany` (or is unreachable).
const SINGLE_STATS: usize = 16;

/// Stats, listings and namespace changes. Paths are Strata paths (`/mount/dir/file`); every
/// method normalises what it is given and refuses a malformed path as `InvalidArgument`.
/// Errors carry the kind the cluster gave (`NotFound`, `PermissionDenied`, ...).
#[async_trait]
pub trait Metadata: Send + Sync + 'static {
    /// The mount table as last learnt (no call).
    fn mounts(&self) -> Vec<MountInfo>;
    /// A file's or directory's metadata; `sync` asks the UFS past every cache.
    async fn stat(&self, path: &str, sync: bool) -> Result<FileInfo>;
    /// Many paths' metadata, one result per path in order; one path's failure is its own.
    async fn stat_many(&self, paths: &[&str]) -> Vec<Result<FileInfo>>;
    /// One page of a directory's children in name order (the file itself for a file), after
    /// `page_token` ("" for the first), at most `page_size` (0: the master's default).
    async fn list_page(&self, path: &str, page_token: &str, page_size: u32) -> Result<Page>;
    /// One page of every file under `path` (recursively, `max_depth` levels down, 0: all), in
    /// the listing order; `with_dirs` yields each directory just before what it holds.
    async fn find_page(
        &self,
        path: &str,
        page_token: &str,
        page_size: u32,
        max_depth: u32,
        with_dirs: bool,
    ) -> Result<Page>;
    /// Makes a directory and its parents (nothing to do if it exists).
    async fn mkdir(&self, path: &str) -> Result<()>;
    /// Deletes a file, or a directory (with everything under it when `recursive`).
    async fn delete(&self, path: &str, recursive: bool) -> Result<()>;
    /// Renames in place where the UFS can; `Ok(false)` when it cannot and nothing changed.
    async fn rename(&self, src: &str, dst: &str) -> Result<bool>;
    /// Forgets what is cached of `path`, here and wherever else it is kept.
    async fn invalidate(&self, path: &str) -> Result<()>;
    /// Forgets what this process cached of `path` (and below it with `subtree`): a change made
    /// another way (a write through a worker) must be seen by the next stat.
    fn forget(&self, path: &str, subtree: bool);
}

fn normalize(raw: &str) -> Result<String> {
    path::normalize(raw).map_err(|e| ClientError::InvalidArgument(e.to_string()))
}

/// The namespace the master serves, with this client's caches and its outage fallbacks.
pub struct MasterMetadata {
    master: Arc<MasterLink>,
    view: Arc<ClusterView>,
    /// Stats by normalised path, with when they were learnt.
    stats: Mutex<HashMap<String, (Instant, FileInfo)>>,
    listings: Listings,
    /// Listed files become cached stats while the cache holds fewer than this many.
    listing_cache_entries: usize,
    dial: Dial,
    /// Deadline of a metadata request asked of a worker.
    ask_timeout: std::time::Duration,
    clock: SharedClock,
}

impl MasterMetadata {
    pub(crate) fn new(
        master: Arc<MasterLink>,
        view: Arc<ClusterView>,
        dial: Dial,
        config: &crate::ClientConfig,
        stats: HashMap<String, (Instant, FileInfo)>,
    ) -> Self {
        Self {
            master,
            view,
            stats: Mutex::new(stats),
            listings: Listings::new(config.listing_cache_entries),
            listing_cache_entries: config.listing_cache_entries,
            dial,
            ask_timeout: config.connect_timeout.max(crate::outage::FALLBACK_DEADLINE),
            clock: config.clock.clone(),
        }
    }

    fn lock_stats(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Instant, FileInfo)>> {
        self.stats.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every cached stat (for a client made again after a fork).
    pub(crate) fn stats_snapshot(&self) -> HashMap<String, (Instant, FileInfo)> {
        self.lock_stats().clone()
    }

    /// Forgets every cached stat and listing (a mount went away).
    pub(crate) fn forget_all(&self) {
        self.lock_stats().clear();
        self.listings.forget("/");
    }

    /// The cached stat of `p` (normalised) while [`stat`](Metadata::stat) would use it.
    pub(crate) fn fresh_stat(&self, p: &str) -> Option<FileInfo> {
        let (at, info) = self.lock_stats().get(p).cloned()?;
        let age = self.clock.now().saturating_duration_since(at);
        (info.persist == Persist::Persisted && age < self.view.ttl_for(p)).then_some(info)
    }

    fn keep_stat(&self, p: String, info: &FileInfo) {
        let now = self.clock.now();
        self.lock_stats().insert(p, (now, info.clone()));
    }

    /// A path's stat made at the UFS by a worker (the sidecar first): `None` when no worker
    /// could be asked, else the answer, with the kind the worker sent for a refusal.
    async fn stat_at_worker(&self, p: &str) -> Option<Result<FileInfo>> {
        let req_id = 1;
        let frame = StatRequest { req_id, path: p.to_string() }.encode();
        for (via, addr) in self.view.worker_candidates(Some(p)) {
            match transport::ask(via, &addr, &frame, req_id, 1 << 20, &self.dial, self.ask_timeout).await {
                Ok(bytes) => match FileStat::decode(&bytes) {
                    Ok(stat) => return Some(Ok(FileInfo::from(stat))),
                    Err(e) => debug!(worker = %addr, err = %e, "a worker's stat did not decode"),
                },
                Err(TransportError::Remote { kind, message, .. }) if !kind.is_temporary() => {
                    return Some(Err(ClientError::from_kind(kind, message)));
                }
                Err(e) => {
                    debug!(worker = %addr, path = %p, err = %e, "a worker could not stat; asking the next")
                }
            }
        }
        None
    }

    /// A page the master answered, kept towards the whole listing.
    fn recorded(
        &self,
        key: &ListKey,
        token: &str,
        entries: Vec<strata_proto::FileStatus>,
        next: String,
    ) -> Page {
        let entries: Vec<FileInfo> = entries.into_iter().map(FileInfo::from).collect();
        let next = (!next.is_empty()).then_some(next);
        self.listings.record(key, token, &entries, next.as_deref());
        self.feed_stats(&entries);
        (entries, next)
    }

    /// A listing's files become cached stats (as if each had been stated now), so reading
    /// files just listed asks the master nothing. Directories are left out (a listed prefix of
    /// an object store says less than its stat), and so are write-back files not yet uploaded
    /// (`stat` never reuses them). A listing adds new paths only while the cache holds fewer
    /// than `listing_cache_entries` stats (it refreshes those it has at any size), so a
    /// listing of millions of files does not grow it without bound.
    fn feed_stats(&self, entries: &[FileInfo]) {
        let limit = self.listing_cache_entries;
        let files = entries.iter().filter(|e| !e.is_dir && e.persist == Persist::Persisted);
        let now = self.clock.now();
        let mut stats = self.lock_stats();
        for e in files {
            if stats.len() < limit || stats.contains_key(&e.path) {
                stats.insert(e.path.clone(), (now, e.clone()));
            }
        }
    }

    /// A page of a kept listing: while the master is unreachable (`outage` is its error, for
    /// when nothing is kept), or for a page token the cache handed out.
    fn cached_page(
        &self,
        key: &ListKey,
        token: &str,
        page_size: u32,
        outage: Option<ClientError>,
    ) -> Result<Page> {
        let outages = self.master.outage();
        outages.check_grace(self.clock.now())?;
        match (self.listings.page(key, token, page_size), outage) {
            (Some(page), _) => {
                if outages.in_outage() {
                    outages.served_stale_listing();
                }
                Ok(page)
            }
            (None, Some(e)) => Err(e),
            (None, None) => Err(ClientError::InvalidArgument(format!(
                "page token {token:?} is of a cached listing no longer held; list again"
            ))),
        }
    }

    /// One `StatMany` call for `chunk` (index in the caller's list, normalised path).
    async fn stat_chunk(&self, chunk: Vec<(usize, String)>) -> Vec<(usize, Result<FileInfo>)> {
        let cached_any = {
            let stats = self.lock_stats();
            chunk.iter().any(|(_, p)| stats.contains_key(p))
        };
        let fallback = cached_any || !self.view.worker_candidates(None).is_empty();
        let req = strata_proto::StatManyRequest { paths: chunk.iter().map(|(_, p)| p.clone()).collect() };
        let mut master = self.master.client();
        let mut unimplemented = false;
        let call = async {
            let answer = master.stat_many(req).await;
            // A master older than `StatMany`: ask it path by path.
            unimplemented = matches!(&answer, Err(s) if s.code() == tonic::Code::Unimplemented);
            answer
        };
        let answer = self.master.call("stat_many", fallback, call).await;
        let results = match answer {
            Ok(resp) if resp.results.len() == chunk.len() => resp.results,
            Ok(resp) => {
                let message = format!(
                    "the master answered {} results to a StatMany of {} paths",
                    resp.results.len(),
                    chunk.len()
                );
                return chunk
                    .into_iter()
                    .map(|(i, _)| {
                        (i, Err(ClientError::Remote { kind: ErrorKind::Internal, message: message.clone() }))
                    })
                    .collect();
            }
            Err(e) if e.is_master_outage() || unimplemented => {
                if !unimplemented {
                    debug!(paths = chunk.len(), err = %e, "master unreachable; stating path by path");
                }
                let stats = chunk.into_iter().map(|(i, p)| async move { (i, self.stat(&p, false).await) });
                return futures::stream::iter(stats).buffer_unordered(SINGLE_STATS).collect().await;
            }
            Err(e) => return chunk.into_iter().map(|(i, _)| (i, Err(e.duplicate()))).collect(),
        };
        let now = self.clock.now();
        let mut stats = self.lock_stats();
        chunk
            .into_iter()
            .zip(results)
            .map(|((i, p), result)| {
                use strata_proto::stat_many_result::Result as R;
                let answer = match result.result {
                    Some(R::Status(status)) => {
                        let info = FileInfo::from(status);
                        stats.insert(p, (now, info.clone()));
                        Ok(info)
                    }
                    Some(R::Error(e)) => {
                        let kind = ErrorKind::from_name(&e.kind).unwrap_or(ErrorKind::Internal);
                        Err(ClientError::from_kind(kind, e.message))
                    }
                    None => Err(ClientError::Remote {
                        kind: ErrorKind::Internal,
                        message: format!("the master answered nothing for {p}"),
                    }),
                };
                (i, answer)
            })
            .collect()
    }
}

#[async_trait]
impl Metadata for MasterMetadata {
    fn mounts(&self) -> Vec<MountInfo> {
        self.view.mounts().into_iter().map(MountInfo::from).collect()
    }

    /// A cached stat of a write-back file not yet uploaded is not reused: its state is stale
    /// once the upload lands, and its `wb-` version names journals the holders drop a grace
    /// later (the master's `writeback_journal_grace_ms`, which a longer `metadata_ttl` would
    /// outlive). The master answers it from its table of pending files, without the UFS.
    ///
    /// While the master is unreachable (for up to `master_outage_grace`): the last stat of the
    /// path, however old, unless `sync`; else a stat a worker makes at the UFS.
    async fn stat(&self, raw: &str, sync: bool) -> Result<FileInfo> {
        let p = normalize(raw)?;
        let cached = self.lock_stats().get(&p).cloned();
        if !sync
            && let Some((at, info)) = &cached
            && info.persist == Persist::Persisted
            && self.clock.now().saturating_duration_since(*at) < self.view.ttl_for(&p)
        {
            return Ok(info.clone());
        }
        let fallback = (!sync && cached.is_some()) || !self.view.worker_candidates(None).is_empty();
        let mut master = self.master.client();
        let req = strata_proto::StatRequest { path: p.clone(), sync };
        let info = match self.master.call("stat", fallback, master.stat(req)).await {
            Ok(status) => FileInfo::from(status),
            Err(e) if e.is_master_outage() => {
                let outages = self.master.outage();
                outages.check_grace(self.clock.now())?;
                match cached {
                    Some((_, info)) if !sync => {
                        outages.served_stale_stat();
                        return Ok(info);
                    }
                    _ => match self.stat_at_worker(&p).await {
                        Some(answer) => {
                            let info = answer?;
                            outages.served_worker_stat();
                            info
                        }
                        None => return Err(e),
                    },
                }
            }
            Err(e) => return Err(e),
        };
        self.keep_stat(p, &info);
        Ok(info)
    }

    /// From this client's cache when fresh (as [`stat`](Metadata::stat)), the rest in
    /// `StatMany` calls to the master (one per [`STAT_MANY_CHUNK`] paths), each result cached.
    /// While the master is unreachable, each path is answered as `stat` answers it then.
    async fn stat_many(&self, paths: &[&str]) -> Vec<Result<FileInfo>> {
        let mut out: Vec<Option<Result<FileInfo>>> = (0..paths.len()).map(|_| None).collect();
        let mut ask = Vec::new();
        for (i, raw) in paths.iter().enumerate() {
            match normalize(raw) {
                Err(e) => out[i] = Some(Err(e)),
                Ok(p) => match self.fresh_stat(&p) {
                    Some(info) => out[i] = Some(Ok(info)),
                    None => ask.push((i, p)),
                },
            }
        }
        let chunks: Vec<Vec<(usize, String)>> = ask.chunks(STAT_MANY_CHUNK).map(<[_]>::to_vec).collect();
        let mut answers = futures::stream::iter(chunks)
            .map(|chunk| self.stat_chunk(chunk))
            .buffer_unordered(STAT_MANY_CALLS);
        while let Some(answered) = answers.next().await {
            for (i, answer) in answered {
                out[i] = Some(answer);
            }
        }
        out.into_iter().map(|answer| answer.expect("every path answered")).collect()
    }

    async fn list_page(&self, raw: &str, page_token: &str, page_size: u32) -> Result<Page> {
        let p = normalize(raw)?;
        let key = ListKey::List(p.clone());
        if page_token.starts_with(STALE_TOKEN) {
            return self.cached_page(&key, page_token, page_size, None);
        }
        let fallback = self.listings.has(&key, page_token);
        let req = ListRequest { path: p, sync: false, page_token: page_token.to_string(), page_size };
        let mut master = self.master.client();
        match self.master.call("list", fallback, master.list(req)).await {
            Ok(resp) => Ok(self.recorded(&key, page_token, resp.entries, resp.next_page_token)),
            Err(e) if e.is_master_outage() => self.cached_page(&key, page_token, page_size, Some(e)),
            Err(e) => Err(e),
        }
    }

    /// Without directories, pages are kept towards the whole listing for outages; with them
    /// (`find_page_with_dirs`), the master is asked every time (a caller falls back to a find
    /// without directories during an outage).
    async fn find_page(
        &self,
        raw: &str,
        page_token: &str,
        page_size: u32,
        max_depth: u32,
        with_dirs: bool,
    ) -> Result<Page> {
        let p = normalize(raw)?;
        let req = strata_proto::FindRequest {
            path: p.clone(),
            sync: false,
            page_token: page_token.to_string(),
            page_size,
            max_depth,
            with_dirs,
        };
        let mut master = self.master.client();
        if with_dirs {
            let resp = self.master.ask("find", master.find(req)).await?;
            let next = (!resp.next_page_token.is_empty()).then_some(resp.next_page_token);
            return Ok((resp.entries.into_iter().map(FileInfo::from).collect(), next));
        }
        let key = ListKey::Find(p, max_depth);
        if page_token.starts_with(STALE_TOKEN) {
            return self.cached_page(&key, page_token, page_size, None);
        }
        let fallback = self.listings.has(&key, page_token);
        match self.master.call("find", fallback, master.find(req)).await {
            Ok(resp) => Ok(self.recorded(&key, page_token, resp.entries, resp.next_page_token)),
            Err(e) if e.is_master_outage() => self.cached_page(&key, page_token, page_size, Some(e)),
            Err(e) => Err(e),
        }
    }

    async fn mkdir(&self, raw: &str) -> Result<()> {
        let p = normalize(raw)?;
        let result =
            self.master.ask("mkdir", self.master.client().mkdir(MkdirRequest { path: p.clone() })).await;
        self.forget(&p, false);
        result.map(drop)
    }

    async fn delete(&self, raw: &str, recursive: bool) -> Result<()> {
        let p = normalize(raw)?;
        let req = DeleteRequest { path: p.clone(), recursive };
        let result = self.master.ask("delete", self.master.client().delete(req)).await;
        self.forget(&p, true);
        result.map(drop)
    }

    async fn rename(&self, raw_src: &str, raw_dst: &str) -> Result<bool> {
        let (src, dst) = (normalize(raw_src)?, normalize(raw_dst)?);
        let req = RenameRequest { src: src.clone(), dst: dst.clone() };
        let result = self.master.ask("rename", self.master.client().rename(req)).await;
        self.forget(&src, true);
        self.forget(&dst, true);
        Ok(result?.renamed)
    }

    async fn invalidate(&self, raw: &str) -> Result<()> {
        let p = normalize(raw)?;
        self.forget(&p, false);
        self.master.ask("invalidate", self.master.client().invalidate(InvalidateRequest { path: p })).await?;
        Ok(())
    }

    fn forget(&self, p: &str, subtree: bool) {
        self.listings.forget(p);
        let mut stats = self.lock_stats();
        stats.remove(p);
        if subtree {
            let prefix = format!("{}/", p.trim_end_matches('/'));
            stats.retain(|k, _| !k.starts_with(&prefix));
        }
    }
}

#[cfg(any(test, feature = "testing"))]
pub use fake::FakeMetadata;

#[cfg(any(test, feature = "testing"))]
mod fake {
    use std::collections::BTreeMap;

    use super::*;

    /// An in-memory namespace: files and directories by path, under the mounts it is given.
    /// Directories are implied by the files below them or made by `mkdir`. For tests of what
    /// sits on [`Metadata`] (front ends, the read path) without a cluster.
    #[derive(Default)]
    pub struct FakeMetadata {
        mounts: Vec<MountInfo>,
        entries: Mutex<BTreeMap<String, FileInfo>>,
        /// Calls that reached the fake, by method name.
        pub calls: Mutex<BTreeMap<&'static str, u64>>,
    }

    impl FakeMetadata {
        pub fn new(mounts: Vec<MountInfo>) -> Self {
            Self { mounts, ..Self::default() }
        }

        /// Adds (or replaces) a file of `size` bytes at `version`, with its parent directories.
        pub fn put_file(&self, raw: &str, size: u64, version: &str) -> FileInfo {
            let p = normalize(raw).expect("a valid path");
            let block_size = self.mount(&p).map_or(1 << 20, |m| m.block_size);
            let info = FileInfo {
                path: p.clone(),
                is_dir: false,
                size,
                version: version.to_string(),
                mtime_ms: 0,
                block_size,
                file_id: format!("fake://{p}"),
                holders: Vec::new(),
                persist: Persist::Persisted,
            };
            let mut entries = self.entries.lock().unwrap();
            let mut parent = p.as_str();
            while let Some((up, _)) = parent.rsplit_once('/') {
                if up.is_empty() {
                    break;
                }
                entries.entry(up.to_string()).or_insert_with(|| dir(up, block_size));
                parent = up;
            }
            entries.insert(p, info.clone());
            info
        }

        /// How many calls of `method` reached the fake.
        pub fn calls_of(&self, method: &str) -> u64 {
            self.calls.lock().unwrap().get(method).copied().unwrap_or(0)
        }

        fn count(&self, method: &'static str) {
            *self.calls.lock().unwrap().entry(method).or_default() += 1;
        }

        fn mount(&self, p: &str) -> Option<&MountInfo> {
            self.mounts
                .iter()
                .filter(|m| path::strip_mount(&m.path, p).is_some())
                .max_by_key(|m| m.path.len())
        }

        fn lookup(&self, p: &str) -> Result<FileInfo> {
            if self.mounts.iter().any(|m| m.path == p) {
                return Ok(dir(p, self.mount(p).map_or(1 << 20, |m| m.block_size)));
            }
            if self.mount(p).is_none() {
                return Err(ClientError::NotFound(format!("{p}: no mount holds it")));
            }
            self.entries.lock().unwrap().get(p).cloned().ok_or_else(|| ClientError::NotFound(p.to_string()))
        }

        /// The children of `p` (a directory), sorted by path.
        fn children(&self, p: &str) -> Vec<FileInfo> {
            let prefix = if p == "/" { "/".to_string() } else { format!("{p}/") };
            let entries = self.entries.lock().unwrap();
            entries
                .range(prefix.clone()..)
                .take_while(|(k, _)| k.starts_with(&prefix))
                .filter(|(k, _)| !k[prefix.len()..].contains('/'))
                .map(|(_, v)| v.clone())
                .collect()
        }
    }

    fn dir(p: &str, block_size: u64) -> FileInfo {
        FileInfo {
            path: p.to_string(),
            is_dir: true,
            size: 0,
            version: String::new(),
            mtime_ms: 0,
            block_size,
            file_id: String::new(),
            holders: Vec::new(),
            persist: Persist::Persisted,
        }
    }

    /// A page of `all` after the token (the index of its first entry), at most `size` (0: all).
    fn paged(all: Vec<FileInfo>, token: &str, size: u32) -> Result<Page> {
        let start: usize = if token.is_empty() {
            0
        } else {
            token.parse().map_err(|_| ClientError::InvalidArgument(format!("page token {token:?}")))?
        };
        let size = if size == 0 { usize::MAX } else { size as usize };
        let end = start.saturating_add(size).min(all.len());
        let next = (end < all.len()).then(|| end.to_string());
        Ok((all.get(start..end).unwrap_or_default().to_vec(), next))
    }

    #[async_trait]
    impl Metadata for FakeMetadata {
        fn mounts(&self) -> Vec<MountInfo> {
            self.mounts.clone()
        }

        async fn stat(&self, raw: &str, _sync: bool) -> Result<FileInfo> {
            self.count("stat");
            self.lookup(&normalize(raw)?)
        }

        async fn stat_many(&self, paths: &[&str]) -> Vec<Result<FileInfo>> {
            self.count("stat_many");
            paths.iter().map(|p| normalize(p).and_then(|p| self.lookup(&p))).collect()
        }

        async fn list_page(&self, raw: &str, page_token: &str, page_size: u32) -> Result<Page> {
            self.count("list_page");
            let p = normalize(raw)?;
            let info = self.lookup(&p)?;
            let all = if info.is_dir { self.children(&p) } else { vec![info] };
            paged(all, page_token, page_size)
        }

        async fn find_page(
            &self,
            raw: &str,
            page_token: &str,
            page_size: u32,
            max_depth: u32,
            with_dirs: bool,
        ) -> Result<Page> {
            self.count("find_page");
            let p = normalize(raw)?;
            let info = self.lookup(&p)?;
            if !info.is_dir {
                return paged(vec![info], page_token, page_size);
            }
            let prefix = if p == "/" { "/".to_string() } else { format!("{p}/") };
            let depth = |k: &str| k[prefix.len()..].matches('/').count() as u32 + 1;
            let mut all: Vec<FileInfo> = self
                .entries
                .lock()
                .unwrap()
                .range(prefix.clone()..)
                .take_while(|(k, _)| k.starts_with(&prefix))
                .filter(|(k, v)| (with_dirs || !v.is_dir) && (max_depth == 0 || depth(k) <= max_depth))
                .map(|(_, v)| v.clone())
                .collect();
            all.sort_by(|a, b| a.path.split('/').cmp(b.path.split('/')));
            paged(all, page_token, page_size)
        }

        async fn mkdir(&self, raw: &str) -> Result<()> {
            self.count("mkdir");
            let p = normalize(raw)?;
            let block_size = self.mount(&p).map_or(1 << 20, |m| m.block_size);
            self.entries.lock().unwrap().entry(p.clone()).or_insert_with(|| dir(&p, block_size));
            Ok(())
        }

        async fn delete(&self, raw: &str, recursive: bool) -> Result<()> {
            self.count("delete");
            let p = normalize(raw)?;
            let info = self.lookup(&p)?;
            if info.is_dir && !self.children(&p).is_empty() && !recursive {
                return Err(ClientError::from_kind(
                    ErrorKind::InvalidArgument,
                    format!("{p}: directory not empty"),
                ));
            }
            let prefix = format!("{p}/");
            self.entries.lock().unwrap().retain(|k, _| k != &p && !k.starts_with(&prefix));
            Ok(())
        }

        async fn rename(&self, raw_src: &str, raw_dst: &str) -> Result<bool> {
            self.count("rename");
            let (src, dst) = (normalize(raw_src)?, normalize(raw_dst)?);
            self.lookup(&src)?;
            let mut entries = self.entries.lock().unwrap();
            let prefix = format!("{src}/");
            let moved: Vec<(String, FileInfo)> = entries
                .iter()
                .filter(|(k, _)| **k == src || k.starts_with(&prefix))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            for (k, mut v) in moved {
                entries.remove(&k);
                let to = format!("{dst}{}", &k[src.len()..]);
                v.path = to.clone();
                entries.insert(to, v);
            }
            Ok(true)
        }

        async fn invalidate(&self, raw: &str) -> Result<()> {
            self.count("invalidate");
            normalize(raw).map(drop)
        }

        fn forget(&self, _path: &str, _subtree: bool) {}
    }
}
