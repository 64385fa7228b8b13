//! The listings a client has seen whole, kept to answer while the master is unreachable.
//!
//! Listings are paged (`list_page`, `find_page`). A listing is kept once the client has seen
//! every page of it in order, from the first to the last, however the caller paced them;
//! the pages of one walk are gathered under the token the next page must carry, so two walks
//! of one directory at once do not mix. The cache holds at most `max_entries` entries over all
//! listings and forgets the least recently used listing first; a listing larger than that is
//! never kept. While the master is down a page is answered from the kept listing: the first
//! page and any page whose master token was seen map to their place in it, and the next-page
//! tokens it hands out (`STALE_TOKEN…`) are served from the same snapshot even if the master
//! comes back mid-walk, so one walk never mixes two listings.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use crate::FileInfo;

/// Prefix of page tokens the cache hands out; the rest is the index of the page's first entry.
pub(crate) const STALE_TOKEN: &str = "strata-cached:";
/// Entries of a cached page when the caller asks for the master's default (0).
const DEFAULT_PAGE: usize = 1_000;
/// Walks being gathered at once; past it the gathering starts over.
const MAX_PARTIAL: usize = 256;

/// Which listing: one directory's children, or a recursive find to a depth.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum ListKey {
    List(String),
    Find(String, u32),
}

impl ListKey {
    fn path(&self) -> &str {
        match self {
            ListKey::List(p) | ListKey::Find(p, _) => p,
        }
    }
}

struct Listing {
    entries: Arc<Vec<FileInfo>>,
    /// Index of the first entry of the page each master token started.
    starts: HashMap<String, usize>,
    tick: u64,
}

#[derive(Default)]
struct Partial {
    entries: Vec<FileInfo>,
    starts: HashMap<String, usize>,
}

#[derive(Default)]
struct Inner {
    done: HashMap<ListKey, Listing>,
    lru: BTreeMap<u64, ListKey>,
    tick: u64,
    held: usize,
    partial: HashMap<(ListKey, String), Partial>,
}

pub(crate) struct Listings {
    max_entries: usize,
    inner: Mutex<Inner>,
}

/// A page: entries and the token of the next page.
pub(crate) use crate::types::Page;

impl Listings {
    pub(crate) fn new(max_entries: usize) -> Self {
        Self { max_entries, inner: Mutex::default() }
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A page the master answered for `key` at `token`, with the token of the next one.
    pub(crate) fn record(&self, key: &ListKey, token: &str, page: &[FileInfo], next: Option<&str>) {
        if self.max_entries == 0 {
            return;
        }
        let mut inner = self.inner();
        let mut walk = match inner.partial.remove(&(key.clone(), token.to_string())) {
            Some(walk) => walk,
            None if token.is_empty() => Partial::default(),
            // A walk that started before we saw it (or was dropped): nothing to gather.
            None => return,
        };
        walk.starts.insert(token.to_string(), walk.entries.len());
        walk.entries.extend_from_slice(page);
        if walk.entries.len() > self.max_entries {
            return;
        }
        match next {
            Some(next) => {
                if inner.partial.len() >= MAX_PARTIAL {
                    inner.partial.clear();
                }
                inner.partial.insert((key.clone(), next.to_string()), walk);
            }
            None => inner.commit(key.clone(), walk, self.max_entries),
        }
    }

    /// Whether a page of `key` at `token` could be answered from the cache.
    pub(crate) fn has(&self, key: &ListKey, token: &str) -> bool {
        self.inner()
            .done
            .get(key)
            .is_some_and(|l| token.starts_with(STALE_TOKEN) || l.starts.contains_key(token))
    }

    /// The page of the kept listing of `key` at `token` (a master token seen in the walk that
    /// was kept, or one this cache handed out), at most `page_size` entries (0: 1000).
    pub(crate) fn page(&self, key: &ListKey, token: &str, page_size: u32) -> Option<Page> {
        let mut inner = self.inner();
        inner.tick += 1;
        let tick = inner.tick;
        let listing = inner.done.get_mut(key)?;
        let start = match token.strip_prefix(STALE_TOKEN) {
            Some(index) => index.parse().ok()?,
            None => *listing.starts.get(token)?,
        };
        let old = std::mem::replace(&mut listing.tick, tick);
        let entries = listing.entries.clone();
        inner.lru.remove(&old);
        inner.lru.insert(tick, key.clone());
        let size = if page_size == 0 { DEFAULT_PAGE } else { page_size as usize };
        let start = start.min(entries.len());
        let end = start.saturating_add(size).min(entries.len());
        let next = (end < entries.len()).then(|| format!("{STALE_TOKEN}{end}"));
        Some((entries[start..end].to_vec(), next))
    }

    /// Forgets every listing that contains `path`, is of it, or is under it (after a change).
    pub(crate) fn forget(&self, path: &str) {
        let related = |p: &str| {
            p == path
                || path.strip_prefix(p).is_some_and(|r| r.starts_with('/') || p == "/")
                || p.strip_prefix(path).is_some_and(|r| r.starts_with('/'))
        };
        let mut inner = self.inner();
        let gone: Vec<ListKey> = inner.done.keys().filter(|k| related(k.path())).cloned().collect();
        for key in gone {
            inner.remove(&key);
        }
        inner.partial.retain(|(k, _), _| !related(k.path()));
    }

    /// Entries held over all kept listings.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.inner().held
    }
}

impl Inner {
    fn remove(&mut self, key: &ListKey) {
        if let Some(old) = self.done.remove(key) {
            self.held -= old.entries.len();
            self.lru.remove(&old.tick);
        }
    }

    fn commit(&mut self, key: ListKey, walk: Partial, max_entries: usize) {
        self.remove(&key);
        self.tick += 1;
        self.held += walk.entries.len();
        self.lru.insert(self.tick, key.clone());
        self.done
            .insert(key, Listing { entries: Arc::new(walk.entries), starts: walk.starts, tick: self.tick });
        while self.held > max_entries {
            let Some((_, oldest)) = self.lru.pop_first() else { break };
            if let Some(old) = self.done.remove(&oldest) {
                self.held -= old.entries.len();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(name: &str) -> FileInfo {
        FileInfo {
            path: format!("/d/{name}"),
            is_dir: false,
            size: 1,
            version: "v".into(),
            mtime_ms: 0,
            block_size: 1,
            file_id: name.into(),
            holders: Vec::new(),
            persist: Default::default(),
        }
    }

    fn names(page: &Page) -> (Vec<String>, Option<String>) {
        (page.0.iter().map(|e| e.path.clone()).collect(), page.1.clone())
    }

    #[test]
    fn a_listing_seen_whole_is_served_by_pages_from_any_token_it_saw() {
        let l = Listings::new(100);
        let key = ListKey::List("/d".into());
        l.record(&key, "", &[f("a"), f("b")], Some("t1"));
        assert!(l.page(&key, "", 0).is_none(), "not kept before the last page");
        l.record(&key, "t1", &[f("c")], None);
        let all = l.page(&key, "", 0).unwrap();
        assert_eq!(names(&all), (vec!["/d/a".into(), "/d/b".into(), "/d/c".into()], None));
        assert_eq!(names(&l.page(&key, "t1", 0).unwrap()).0, vec!["/d/c".to_string()]);
        let first = l.page(&key, "", 2).unwrap();
        assert_eq!(first.1.as_deref(), Some("strata-cached:2"));
        assert_eq!(
            names(&l.page(&key, first.1.as_deref().unwrap(), 2).unwrap()),
            (vec!["/d/c".into()], None)
        );
        assert!(l.page(&key, "unknown", 0).is_none());
        assert!(l.page(&ListKey::Find("/d".into(), 0), "", 0).is_none(), "a find is another listing");
    }

    #[test]
    fn a_walk_joined_midway_or_too_large_is_not_kept_and_lru_bounds_entries() {
        let l = Listings::new(3);
        let a = ListKey::List("/a".into());
        l.record(&a, "t5", &[f("x")], None);
        assert!(l.page(&a, "", 0).is_none(), "joined midway");
        l.record(&a, "", &[f("1"), f("2"), f("3"), f("4")], None);
        assert!(l.page(&a, "", 0).is_none(), "larger than the whole cache");
        l.record(&a, "", &[f("1"), f("2")], None);
        let b = ListKey::Find("/b".into(), 0);
        l.record(&b, "", &[f("1")], None);
        assert_eq!(l.held(), 3);
        l.page(&a, "", 0).unwrap();
        let c = ListKey::List("/c".into());
        l.record(&c, "", &[f("1")], None);
        assert!(l.page(&b, "", 0).is_none(), "least recently used went first");
        assert!(l.page(&a, "", 0).is_some() && l.page(&c, "", 0).is_some());
        assert_eq!(l.held(), 3);
    }

    #[test]
    fn a_change_forgets_the_listings_around_it() {
        let l = Listings::new(100);
        for p in ["/", "/d", "/d/e", "/dd"] {
            l.record(&ListKey::List(p.into()), "", &[f("x")], None);
        }
        l.forget("/d/x");
        assert!(l.page(&ListKey::List("/".into()), "", 0).is_none());
        assert!(l.page(&ListKey::List("/d".into()), "", 0).is_none());
        assert!(l.page(&ListKey::List("/d/e".into()), "", 0).is_some(), "a sibling stays");
        assert!(l.page(&ListKey::List("/dd".into()), "", 0).is_some());
        assert_eq!(l.held(), 2);
    }
}
