//! Who may use this worker's data plane.
//!
//! The master tells its workers which tokens it accepts — hashes with their roles and scopes,
//! never a token (`WorkerTokens`, fetched again whenever a heartbeat announces a new tokens
//! epoch) — so a worker checks a connection's `Auth` frame itself, without asking the master
//! per connection, and goes on checking through a master outage. A revoked token stops working
//! here at the next heartbeat (a sidecar: its next refresh), on connections already open too:
//! each request re-checks its session when the table changed.
//!
//! Until it has learnt the table a worker serves nobody (`unavailable`, so a client tries
//! another worker): it cannot tell whether the cluster requires tokens.
//!
//! A token the table does not know may be one created a moment ago: before refusing it, the
//! worker asks the master for the table again. Such fetches are coalesced and spaced: one
//! fetch that starts after a connection asked answers it and every connection waiting with it,
//! and fetches start at least [`UNKNOWN_REFRESH_EVERY`] apart, so a flood of garbage tokens
//! costs the master two calls a second, not one per connection.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;

use strata_common::ErrorKind;
use strata_security::token::{self, Access, Identity, TokenTable};

/// The tokens the cluster accepts, as last learnt from the master.
pub struct Table {
    pub epoch: u64,
    /// False: the master runs with authentication off and every peer is admitted.
    pub enabled: bool,
    pub tokens: TokenTable,
}

/// A refused request: the kind and message of its error frame.
pub type Refused = (ErrorKind, String);

/// Least time between two table fetches caused by unknown tokens.
pub const UNKNOWN_REFRESH_EVERY: Duration = Duration::from_millis(500);

/// Fetches the table from the master and [`PeerAuth::set`]s it.
pub type Refresher = Box<dyn Fn() -> BoxFuture<'static, ()> + Send + Sync>;

/// The data plane's token check.
pub struct PeerAuth {
    table: RwLock<Option<Arc<Table>>>,
    refresher: RwLock<Option<Arc<Refresher>>>,
    /// When the last fetch caused by an unknown token started (one fetch at a time).
    last_unknown_refresh: tokio::sync::Mutex<Option<Instant>>,
}

/// Who a connection proved to be (its `Auth` frame), and against which table.
#[derive(Default)]
pub struct Session {
    proven: Option<Proven>,
}

struct Proven {
    hash: String,
    identity: Identity,
    epoch: u64,
}

impl PeerAuth {
    /// A worker that has not learnt the tokens yet.
    pub fn unknown() -> Self {
        Self {
            table: RwLock::new(None),
            refresher: RwLock::new(None),
            last_unknown_refresh: tokio::sync::Mutex::new(None),
        }
    }

    /// How to fetch the table again when a token is unknown.
    pub fn set_refresher(&self, refresher: Refresher) {
        *self.refresher.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(refresher));
    }

    /// Every peer admitted (authentication off): for tests that run a data plane without a
    /// master.
    pub fn open() -> Self {
        let auth = Self::unknown();
        auth.set(Table { epoch: 0, enabled: false, tokens: TokenTable::default() });
        auth
    }

    pub fn set(&self, table: Table) {
        *self.table.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(table));
    }

    /// The epoch of the table held, if any.
    pub fn epoch(&self) -> Option<u64> {
        self.current().map(|t| t.epoch)
    }

    fn current(&self) -> Option<Arc<Table>> {
        self.table.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// A connection's `Auth` frame: the session it opens, or why not. A token the table does
    /// not know (or a table not learnt yet) makes the worker fetch the table once before it
    /// refuses (rate-limited, see the module).
    pub async fn authenticate(&self, token: &str) -> Result<Session, Refused> {
        match self.authenticate_now(token) {
            Err((ErrorKind::Unauthenticated | ErrorKind::Unavailable, _))
                if self.refresh_for_unknown().await =>
            {
                self.authenticate_now(token)
            }
            other => other,
        }
    }

    /// Makes sure a fetch of the table started after now has finished (see the module);
    /// whether one could (a refresher is set).
    async fn refresh_for_unknown(&self) -> bool {
        let Some(refresher) = self.refresher.read().unwrap_or_else(|p| p.into_inner()).clone() else {
            return false;
        };
        let asked = Instant::now();
        let mut last = self.last_unknown_refresh.lock().await;
        if last.is_some_and(|started| started >= asked) {
            // A fetch that started after this connection asked finished while it waited.
            return true;
        }
        if let Some(started) = *last {
            tokio::time::sleep_until((started + UNKNOWN_REFRESH_EVERY).into()).await;
        }
        *last = Some(Instant::now());
        refresher().await;
        true
    }

    fn authenticate_now(&self, token: &str) -> Result<Session, Refused> {
        let table = self.current().ok_or_else(not_learnt)?;
        if !table.enabled {
            return Ok(Session::default());
        }
        let identity = table.tokens.verify(token).map_err(|e| (e.kind(), e.to_string()))?;
        Ok(Session { proven: Some(Proven { hash: token::hash(token), identity, epoch: table.epoch }) })
    }

    /// Whether `session` may do `access` (on `path`, when the request names one).
    pub fn check(&self, session: &mut Session, access: Access, path: Option<&str>) -> Result<(), Refused> {
        let table = self.current().ok_or_else(not_learnt)?;
        if !table.enabled {
            return Ok(());
        }
        let Some(proven) = session.proven.as_mut() else {
            return Err((
                ErrorKind::Unauthenticated,
                "this cluster requires a token: send an Auth frame first (clients: STRATA_TOKEN)".to_string(),
            ));
        };
        if proven.epoch != table.epoch {
            // The tokens changed since the connection proved itself: it may have been revoked
            // (or its role changed).
            proven.identity = table.tokens.verify_hash(&proven.hash).ok_or_else(|| {
                (ErrorKind::Unauthenticated, "the connection's token was revoked".to_string())
            })?;
            proven.epoch = table.epoch;
        }
        let normal = match path {
            None => None,
            Some(p) => match strata_common::path::normalize(p) {
                Ok(n) => Some(n),
                // A path that is not one: the request itself says so, unless the scope must judge it.
                Err(e) if proven.identity.prefix.is_some() => {
                    return Err((ErrorKind::InvalidArgument, e.to_string()));
                }
                Err(_) => None,
            },
        };
        proven.identity.check(access, normal.as_deref()).map_err(|e| (e.kind(), e.to_string()))
    }
}

fn not_learnt() -> Refused {
    (
        ErrorKind::Unavailable,
        "this worker has not learnt the cluster's tokens from the master yet".to_string(),
    )
}

#[cfg(test)]
mod tests {
    use strata_security::token::{Role, TokenRecord, generate};

    use super::*;

    fn table(epoch: u64, records: &[&TokenRecord]) -> Table {
        Table {
            epoch,
            enabled: true,
            tokens: TokenTable::new(records.iter().map(|r| (r.hash.clone(), r.identity()))),
        }
    }

    #[tokio::test]
    async fn sessions_follow_the_table_and_its_revocations() {
        let auth = PeerAuth::unknown();
        assert_eq!(auth.authenticate("x").await.err().map(|e| e.0), Some(ErrorKind::Unavailable));
        let reader = generate();
        let reader_rec = TokenRecord::new(&reader, Role::Reader, Some("/a"), "", 0).unwrap();
        let writer = generate();
        let writer_rec = TokenRecord::new(&writer, Role::Writer, None, "", 0).unwrap();
        auth.set(table(1, &[&reader_rec, &writer_rec]));

        let mut none = Session::default();
        let refused = auth.check(&mut none, Access::Read, Some("/a/f")).unwrap_err();
        assert_eq!(refused.0, ErrorKind::Unauthenticated);
        assert_eq!(auth.authenticate(&generate()).await.err().map(|e| e.0), Some(ErrorKind::Unauthenticated));

        let mut r = auth.authenticate(&reader).await.unwrap();
        auth.check(&mut r, Access::Read, Some("/a/f")).unwrap();
        assert_eq!(
            auth.check(&mut r, Access::Read, Some("/b/f")).unwrap_err().0,
            ErrorKind::PermissionDenied
        );
        assert_eq!(
            auth.check(&mut r, Access::Write, Some("/a/f")).unwrap_err().0,
            ErrorKind::PermissionDenied
        );
        assert_eq!(
            auth.check(&mut r, Access::Read, Some("/a/../b")).unwrap_err().0,
            ErrorKind::InvalidArgument
        );
        let mut w = auth.authenticate(&writer).await.unwrap();
        auth.check(&mut w, Access::Write, Some("/b/f")).unwrap();

        // The reader's token is revoked: its open session stops working.
        auth.set(table(2, &[&writer_rec]));
        assert_eq!(auth.check(&mut r, Access::Read, Some("/a/f")).unwrap_err().0, ErrorKind::Unauthenticated);
        auth.check(&mut w, Access::Write, Some("/b/f")).unwrap();

        // Authentication off: everyone, even without an Auth frame.
        auth.set(Table { epoch: 3, enabled: false, tokens: TokenTable::default() });
        auth.check(&mut Session::default(), Access::Write, Some("/x")).unwrap();
    }

    #[tokio::test]
    async fn an_unknown_token_fetches_the_table_once_before_it_is_refused() {
        let auth = Arc::new(PeerAuth::unknown());
        auth.set(table(1, &[]));
        let fresh = generate();
        let record = TokenRecord::new(&fresh, Role::Reader, None, "", 0).unwrap();
        let fetches: Arc<std::sync::Mutex<Vec<Instant>>> = Arc::default();
        let (a, f, r) = (auth.clone(), fetches.clone(), record.clone());
        auth.set_refresher(Box::new(move || {
            let (a, f, r) = (a.clone(), f.clone(), r.clone());
            Box::pin(async move {
                f.lock().unwrap().push(Instant::now());
                a.set(table(2, &[&r]));
            })
        }));
        // Created a moment ago: the first connection that presents it fetches the table.
        auth.authenticate(&fresh).await.unwrap();
        assert_eq!(fetches.lock().unwrap().len(), 1);
        // 40 connections with garbage at once: one or two fetches answer them all.
        let garbage: Vec<_> = (0..40)
            .map(|_| {
                let auth = auth.clone();
                tokio::spawn(async move { auth.authenticate(&generate()).await.is_err() })
            })
            .collect();
        for g in garbage {
            assert!(g.await.unwrap(), "garbage is refused");
        }
        let times = fetches.lock().unwrap().clone();
        assert!(times.len() <= 3, "coalesced: {} fetches", times.len());
        assert!(times.windows(2).all(|w| w[1] - w[0] >= UNKNOWN_REFRESH_EVERY), "spaced: {times:?}");
        // A token created after a fetch is still found: the next fetch starts after it asks.
        let later = generate();
        let later_record = TokenRecord::new(&later, Role::Writer, None, "", 0).unwrap();
        let (a, r1, r2) = (auth.clone(), record.clone(), later_record.clone());
        auth.set_refresher(Box::new(move || {
            let (a, r1, r2) = (a.clone(), r1.clone(), r2.clone());
            Box::pin(async move { a.set(table(3, &[&r1, &r2])) })
        }));
        auth.authenticate(&later).await.unwrap();
    }
}
