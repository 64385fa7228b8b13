//! Who may call the master: the tokens it accepts and the layer that checks every call.
//!
//! [`Tokens`] holds what the master knows of tokens — records from the store (`strata token
//! create`), plus bootstrap tokens read from files at start (the admin token a standalone
//! writes to its state dir, the workers' token; in Kubernetes both come from a Secret) — as a
//! [`TokenTable`] by hash. [`Authed`] wraps the gRPC service: before any handler runs it reads
//! the `authorization: Bearer <token>` header, finds the caller, checks the role against the
//! access the method needs ([`access_of`]), and either refuses (`Unauthenticated` /
//! `PermissionDenied`, counted in `strata_master_auth_refused_total`, logged with the token's
//! id at most) or passes the [`Identity`] on in the request's extensions for the handlers'
//! path-scope checks ([`check_path`]).
//!
//! With authentication off (`auth = false`) every caller is [`Identity::unchecked`].

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use strata_common::SharedClock;
use strata_security::token::{
    self, Access, AuthError, Identity, Role, TokenRecord, TokenTable, read_or_create_token_file,
};
use tonic::body::Body;
use tonic::codegen::{Service, http};
use tonic::server::NamedService;
use tracing::{info, warn};

use crate::error::OpError;
use crate::metrics_defs as m;
use crate::store::MetaStore;

/// gRPC metadata (HTTP header) carrying the caller's token, as `Bearer <token>`.
pub const AUTHORIZATION: &str = "authorization";

/// The access each method needs, by its name in the service (`/strata.v1.Master/<name>`).
/// `None` for a name the service does not have (tonic answers it `UNIMPLEMENTED`).
pub fn access_of(method: &str) -> Option<Access> {
    Some(match method {
        "GetMembership" | "ListMounts" | "Status" | "GetJob" | "ListJobs" | "ListSchedules" | "ListPins"
        | "ListCacheTtls" => Access::Any,
        "Stat" | "StatMany" | "List" | "Find" | "GetBlockLocations" | "Locate" | "Sync" | "ReportLineage"
        | "MarkLineage" | "LineageJob" | "LineageFile" | "ListLineageJobs" => Access::Read,
        "Delete" | "Mkdir" | "Invalidate" | "Rename" => Access::Write,
        "AddMount" | "RemoveMount" | "SubmitLoad" | "CancelJob" | "AddSchedule" | "RemoveSchedule"
        | "CreateToken" | "ListTokens" | "RevokeToken" | "Pin" | "Unpin" | "Free" | "SetCacheTtl" => {
            Access::Admin
        }
        "RegisterWorker" | "Heartbeat" | "WorkerMounts" | "FetchLoadTasks" | "ReportLoadTasks"
        | "WorkerTokens" | "CommitWrite" | "UploadResult" => Access::Worker,
        _ => return None,
    })
}

/// Where a master finds its bootstrap tokens.
#[derive(Debug, Clone)]
pub struct Bootstrap {
    pub admin_file: PathBuf,
    pub worker_file: PathBuf,
}

struct State {
    /// Every token, by id: stored ones and those read from files.
    records: BTreeMap<String, TokenRecord>,
    table: Arc<TokenTable>,
    epoch: u64,
}

/// The tokens this master accepts.
pub struct Tokens {
    enabled: bool,
    store: Arc<dyn MetaStore>,
    clock: SharedClock,
    state: RwLock<State>,
}

impl Tokens {
    /// The tokens of the store and of the bootstrap files. A bootstrap file that does not exist
    /// gets a new token (mode 0600) whose record goes to the store — so it can be revoked, and
    /// every master of an HA cluster accepts it; a file that exists (a Kubernetes Secret, or a
    /// token written by an earlier start) is read and accepted as it is.
    pub fn load(
        enabled: bool,
        store: Arc<dyn MetaStore>,
        clock: SharedClock,
        bootstrap: Option<&Bootstrap>,
        first_epoch: u64,
    ) -> Result<Self, OpError> {
        let mut records: BTreeMap<String, TokenRecord> =
            store.load_tokens()?.into_iter().map(|r| (r.id.clone(), r)).collect();
        if let (true, Some(files)) = (enabled, bootstrap) {
            for (file, role, name) in [
                (&files.admin_file, Role::Admin, "bootstrap admin"),
                (&files.worker_file, Role::Worker, "bootstrap worker"),
            ] {
                let existed = file.exists();
                let token = read_or_create_token_file(file)?;
                let mut record = TokenRecord::new(&token, role, None, name, clock.wall_ms())?;
                if records.contains_key(&record.id) {
                    continue;
                }
                if existed {
                    record.file = Some(file.clone());
                } else {
                    store.put_token(&record)?;
                    info!(token = %record.id, role = %role, file = %file.display(), "created a bootstrap token");
                }
                records.insert(record.id.clone(), record);
            }
        }
        let table = Arc::new(table_of(&records));
        Ok(Self { enabled, store, clock, state: RwLock::new(State { records, table, epoch: first_epoch }) })
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Who presents `token` (`None`: no token was sent).
    pub fn verify(&self, token: Option<&str>) -> Result<Identity, AuthError> {
        if !self.enabled {
            return Ok(Identity::unchecked());
        }
        let table = self.state.read().unwrap_or_else(|p| p.into_inner()).table.clone();
        table.verify(token.unwrap_or(""))
    }

    /// A new token of `role`, limited to `prefix` when given: the token (shown once) and its record.
    pub fn create(&self, role: &str, prefix: &str, name: &str) -> Result<(String, TokenRecord), OpError> {
        let role = Role::parse(role)?;
        let token = token::generate();
        let prefix = Some(prefix).filter(|p| !p.is_empty());
        let record = TokenRecord::new(&token, role, prefix, name, self.clock.wall_ms())?;
        self.store.put_token(&record)?;
        self.change(|records| {
            records.insert(record.id.clone(), record.clone());
        });
        info!(token = %record.id, role = %role, prefix = record.prefix.as_deref().unwrap_or("/"), "token created");
        Ok((token, record))
    }

    /// Every token's record, by id.
    pub fn list(&self) -> Vec<TokenRecord> {
        self.state.read().unwrap_or_else(|p| p.into_inner()).records.values().cloned().collect()
    }

    /// Revokes the token with this id: refused at once by the master, by workers within a
    /// heartbeat.
    pub fn revoke(&self, id: &str) -> Result<TokenRecord, OpError> {
        let record = self
            .state
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .records
            .get(id)
            .cloned()
            .ok_or_else(|| OpError::NoToken(id.to_string()))?;
        if let Some(file) = &record.file {
            return Err(OpError::FileToken { id: id.to_string(), file: file.display().to_string() });
        }
        self.store.delete_token(id)?;
        self.change(|records| {
            records.remove(id);
        });
        info!(token = %id, "token revoked");
        Ok(record)
    }

    /// Changes whenever the accepted tokens change (workers fetch the table again).
    pub fn epoch(&self) -> u64 {
        self.state.read().unwrap_or_else(|p| p.into_inner()).epoch
    }

    /// The epoch and every record, for a worker's data-plane checks.
    pub fn for_workers(&self) -> (u64, Vec<TokenRecord>) {
        let state = self.state.read().unwrap_or_else(|p| p.into_inner());
        (state.epoch, state.records.values().cloned().collect())
    }

    fn change(&self, f: impl FnOnce(&mut BTreeMap<String, TokenRecord>)) {
        let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
        f(&mut state.records);
        state.table = Arc::new(table_of(&state.records));
        state.epoch += 1;
    }
}

fn table_of(records: &BTreeMap<String, TokenRecord>) -> TokenTable {
    TokenTable::new(records.values().map(|r| (r.hash.clone(), r.identity())))
}

/// The token in a request's `authorization: Bearer <token>` header.
fn bearer(headers: &http::HeaderMap) -> Option<&str> {
    let value = headers.get(AUTHORIZATION)?.to_str().ok()?;
    value.strip_prefix("Bearer ").map(str::trim)
}

/// The path-scope check of a handler whose request names `path`: the caller (put in the
/// request by [`Authed`]) must be allowed `access` on it. A request without an identity did not
/// pass through [`Authed`] (a unit test calling the handler directly) and is not checked.
pub fn check_path<T>(req: &tonic::Request<T>, access: Access, path: &str) -> Result<(), tonic::Status> {
    let Some(identity) = req.extensions().get::<Identity>() else {
        return Ok(());
    };
    if identity.prefix.is_none() {
        return Ok(());
    }
    let normal = strata_common::path::normalize(path)
        .map_err(|e| strata_proto::status(strata_common::ErrorKind::InvalidArgument, e.to_string()))?;
    identity.check(access, Some(&normal)).map_err(|e| {
        metrics::counter!(m::AUTH_REFUSED, "rpc" => "path_scope", "reason" => e.reason()).increment(1);
        warn!(token = %identity.id, path = %normal, reason = e.reason(), "request refused");
        strata_proto::status(e.kind(), e.to_string())
    })
}

/// The master's gRPC service behind the token check.
#[derive(Clone)]
pub struct Authed<S> {
    inner: S,
    tokens: Arc<Tokens>,
}

impl<S> Authed<S> {
    pub fn new(inner: S, tokens: Arc<Tokens>) -> Self {
        Self { inner, tokens }
    }
}

impl<S> Service<http::Request<Body>> for Authed<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = std::convert::Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<Body>) -> Self::Future {
        let method = req.uri().path().rsplit('/').next().unwrap_or_default();
        let Some(access) = access_of(method) else {
            // Not a method of the service: the inner service answers UNIMPLEMENTED.
            return Box::pin(self.inner.call(req));
        };
        let checked = self
            .tokens
            .verify(bearer(req.headers()))
            .and_then(|identity| identity.check(access, None).map(|()| identity));
        match checked {
            Ok(identity) => {
                req.extensions_mut().insert(identity);
                Box::pin(self.inner.call(req))
            }
            Err(e) => {
                let rpc = method.to_string();
                metrics::counter!(m::AUTH_REFUSED, "rpc" => rpc.clone(), "reason" => e.reason()).increment(1);
                // The token's id when it is a known one; never the token itself.
                let token = bearer(req.headers())
                    .and_then(|t| self.tokens.verify(Some(t)).ok())
                    .map(|i| i.id)
                    .unwrap_or_else(|| "-".to_string());
                warn!(%rpc, %token, reason = e.reason(), "request refused");
                let status = strata_proto::status(e.kind(), format!("{method}: {e}"));
                Box::pin(std::future::ready(Ok(status.into_http())))
            }
        }
    }
}

impl<S: NamedService> NamedService for Authed<S> {
    const NAME: &'static str = S::NAME;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every method of the service (read from the .proto itself) has an access: a method added
    /// later without one would be refused to everyone, and this says so first.
    #[test]
    fn every_rpc_has_an_access() {
        let proto = include_str!("../../proto/strata.proto");
        let methods: Vec<&str> = proto
            .lines()
            .filter_map(|l| l.trim().strip_prefix("rpc "))
            .map(|l| l.split('(').next().unwrap().trim())
            .collect();
        assert!(methods.len() > 25, "{methods:?}");
        for m in methods {
            assert!(access_of(m).is_some(), "{m} has no access in auth::access_of");
        }
        assert_eq!(access_of("WorkerMounts"), Some(Access::Worker), "credentials go to workers alone");
    }
}
