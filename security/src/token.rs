//! Tokens, roles and path scopes.
//!
//! A token is 256 random bits written as `strata_<64 hex digits>`. Nobody stores it: the master
//! keeps its SHA-256 ([`hash`]) with the role and scope it was created with, workers receive
//! those hashes to check data-plane connections, and the caller alone holds the token. A
//! token's public name ([`token_id`]) is the first 12 hex digits of its hash: enough to list and
//! revoke it, useless to present.
//!
//! A call needs an [`Access`]; a [`Role`] grants some of them; a scope (a path prefix) narrows a
//! reader's or writer's token to one subtree. [`Identity::check`] is the one decision, used by
//! the master's interceptor and handlers and by the workers' data plane alike.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use rand::RngCore;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use strata_common::ErrorKind;
use thiserror::Error;

/// Every token starts with this, so a leaked one is recognisable (secret scanners, logs).
pub const TOKEN_PREFIX: &str = "strata_";
/// Random bytes in a token (256 bits).
const TOKEN_BYTES: usize = 32;
/// Longest token accepted anywhere (a presented value past it is refused unread).
pub const MAX_TOKEN_LEN: usize = 512;
/// Environment variable holding the token a client presents.
pub const TOKEN_ENV: &str = "STRATA_TOKEN";
/// Environment variable naming a file holding the token a client presents.
pub const TOKEN_FILE_ENV: &str = "STRATA_TOKEN_FILE";
/// The file, in a standalone's state directory, holding its admin token.
pub const ADMIN_TOKEN_FILE: &str = "admin.token";
/// The file, in a master's data directory, holding the token its workers present (unless
/// configured elsewhere).
pub const WORKER_TOKEN_FILE: &str = "worker.token";

/// What a caller is allowed to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Everything a writer can, plus mounts, load jobs, schedules and tokens.
    Admin,
    /// Read, and write or delete on write-enabled mounts.
    Writer,
    /// Read metadata and bytes.
    Reader,
    /// A worker or sidecar: read, register, heartbeat, load tasks, and the mounts' credentials.
    Worker,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::Admin, Role::Writer, Role::Reader, Role::Worker];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Writer => "writer",
            Role::Reader => "reader",
            Role::Worker => "worker",
        }
    }

    pub fn parse(s: &str) -> Result<Self, AuthError> {
        Self::ALL.into_iter().find(|r| r.as_str() == s).ok_or_else(|| AuthError::BadRole(s.to_string()))
    }

    /// Whether this role grants `access` (scope aside).
    pub fn grants(self, access: Access) -> bool {
        match access {
            Access::Any | Access::Read => true,
            Access::Write => matches!(self, Role::Admin | Role::Writer),
            Access::Admin => self == Role::Admin,
            // Credentials go to workers alone: not even an admin reads a mount's secret keys
            // back (it could mint a worker token, but that is a deliberate, listed act).
            Access::Worker => self == Role::Worker,
        }
    }

    /// Whether a token of this role may be narrowed to a path prefix.
    pub fn scopable(self) -> bool {
        matches!(self, Role::Reader | Role::Writer)
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one call needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    /// Any authenticated caller (membership, mount list without secrets, status, job info).
    Any,
    /// Read metadata or bytes of a path.
    Read,
    /// Change a path in the UFS (write, delete, mkdir) or the master's view of it.
    Write,
    /// Change the cluster: mounts, jobs, schedules, tokens.
    Admin,
    /// Act as a worker: register, heartbeat, load tasks, mount credentials, the token table.
    Worker,
}

impl Access {
    pub fn as_str(self) -> &'static str {
        match self {
            Access::Any => "any",
            Access::Read => "read",
            Access::Write => "write",
            Access::Admin => "admin",
            Access::Worker => "worker",
        }
    }
}

#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AuthError {
    #[error(
        "no token: set STRATA_TOKEN or --token-file (a standalone writes its admin token to <state dir>/admin.token)"
    )]
    Missing,
    #[error("unknown or revoked token")]
    Unknown,
    #[error("the token is not a Strata token (expected {TOKEN_PREFIX}<hex>, at most {MAX_TOKEN_LEN} bytes)")]
    Malformed,
    #[error("a {role} token may not {access}")]
    Role { role: Role, access: &'static str },
    #[error("a token scoped to {prefix} may not use {path}")]
    Scope { prefix: String, path: String },
    #[error("unknown role {0:?} (admin, writer, reader, worker)")]
    BadRole(String),
    #[error("only reader and writer tokens can be scoped to a path; a {0} token cannot")]
    NotScopable(Role),
    #[error("scope {0:?}: {1}")]
    BadScope(String, String),
}

impl AuthError {
    /// How it travels: who the caller is was not proven, or it was and the answer is no.
    pub fn kind(&self) -> ErrorKind {
        match self {
            AuthError::Missing | AuthError::Unknown | AuthError::Malformed => ErrorKind::Unauthenticated,
            AuthError::Role { .. } | AuthError::Scope { .. } => ErrorKind::PermissionDenied,
            AuthError::BadRole(_) | AuthError::NotScopable(_) | AuthError::BadScope(..) => {
                ErrorKind::InvalidArgument
            }
        }
    }

    /// A short label for metrics and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            AuthError::Missing => "missing",
            AuthError::Unknown => "unknown",
            AuthError::Malformed => "malformed",
            AuthError::Role { .. } => "role",
            AuthError::Scope { .. } => "scope",
            AuthError::BadRole(_) | AuthError::NotScopable(_) | AuthError::BadScope(..) => "invalid",
        }
    }
}

/// A new token: 256 bits from the operating system's generator.
pub fn generate() -> String {
    let mut bytes = [0u8; TOKEN_BYTES];
    rand::rng().fill_bytes(&mut bytes);
    let mut token = String::with_capacity(TOKEN_PREFIX.len() + 2 * TOKEN_BYTES);
    token.push_str(TOKEN_PREFIX);
    for b in bytes {
        token.push_str(&format!("{b:02x}"));
    }
    token
}

/// What is stored of a token: the hex SHA-256 of its text.
pub fn hash(token: &str) -> String {
    let digest = Sha256::digest(token.as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// A token's public name: the first 12 hex digits of its hash.
pub fn token_id(hash: &str) -> String {
    hash.chars().take(12).collect()
}

/// A scope as stored: `None` for the whole namespace, else a normalised absolute prefix.
pub fn parse_scope(prefix: Option<&str>) -> Result<Option<String>, AuthError> {
    match prefix.map(str::trim).filter(|p| !p.is_empty()) {
        None => Ok(None),
        Some(p) => {
            let normal = strata_common::path::normalize(p)
                .map_err(|e| AuthError::BadScope(p.to_string(), e.to_string()))?;
            Ok(if normal == "/" { None } else { Some(normal) })
        }
    }
}

/// Whether `path` (normalised) lies in the subtree at `prefix` (normalised): the prefix itself
/// or below it, never a sibling that merely starts with the same letters.
pub fn in_scope(prefix: &str, path: &str) -> bool {
    prefix == "/"
        || path == prefix
        || (path.len() > prefix.len() && path.starts_with(prefix) && path.as_bytes()[prefix.len()] == b'/')
}

/// A stored token: everything but the token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRecord {
    /// [`token_id`] of the hash.
    pub id: String,
    /// [`hash`] of the token.
    pub hash: String,
    pub role: Role,
    /// Path prefix the token is limited to (reader and writer only).
    #[serde(default)]
    pub prefix: Option<String>,
    /// A label for people (`team-a training`).
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub created_ms: i64,
    /// Where the token comes from when it is not in the store: the file a master reads it from
    /// at start (bootstrap tokens: rotated by replacing the file, not revocable by id).
    #[serde(default)]
    pub file: Option<PathBuf>,
}

impl TokenRecord {
    /// A record for `token` with this role and scope (checked).
    pub fn new(
        token: &str,
        role: Role,
        prefix: Option<&str>,
        name: &str,
        created_ms: i64,
    ) -> Result<Self, AuthError> {
        let prefix = parse_scope(prefix)?;
        if prefix.is_some() && !role.scopable() {
            return Err(AuthError::NotScopable(role));
        }
        let hash = hash(token);
        Ok(Self { id: token_id(&hash), hash, role, prefix, name: name.to_string(), created_ms, file: None })
    }

    pub fn identity(&self) -> Identity {
        Identity { id: self.id.clone(), role: self.role, prefix: self.prefix.clone() }
    }
}

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The token's id (for logs; never the token).
    pub id: String,
    pub role: Role,
    pub prefix: Option<String>,
}

impl Identity {
    /// The caller of a cluster with authentication off: allowed everything.
    pub fn unchecked() -> Self {
        Self { id: "-".to_string(), role: Role::Admin, prefix: None }
    }

    /// Whether this caller may do `access`, on `path` when the call names one (normalised).
    pub fn check(&self, access: Access, path: Option<&str>) -> Result<(), AuthError> {
        if self.id == "-" {
            return Ok(());
        }
        if !self.role.grants(access) {
            return Err(AuthError::Role { role: self.role, access: verb(access) });
        }
        match (&self.prefix, path) {
            (Some(prefix), Some(path)) if !in_scope(prefix, path) => {
                Err(AuthError::Scope { prefix: prefix.clone(), path: path.to_string() })
            }
            _ => Ok(()),
        }
    }
}

fn verb(access: Access) -> &'static str {
    match access {
        Access::Any | Access::Read => "read",
        Access::Write => "write",
        Access::Admin => "administer the cluster",
        Access::Worker => "act as a worker",
    }
}

/// The tokens a server accepts, by hash. Cheap to share behind an `Arc`; replaced whole when
/// tokens change.
#[derive(Debug, Clone, Default)]
pub struct TokenTable {
    by_hash: HashMap<String, Identity>,
}

impl TokenTable {
    pub fn new(records: impl IntoIterator<Item = (String, Identity)>) -> Self {
        Self { by_hash: records.into_iter().collect() }
    }

    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// Who holds the token whose [`hash`] this is, if it is still accepted.
    pub fn verify_hash(&self, hash: &str) -> Option<Identity> {
        self.by_hash.get(hash).cloned()
    }

    /// Who presents `token` (an empty one is no token).
    pub fn verify(&self, token: &str) -> Result<Identity, AuthError> {
        if token.is_empty() {
            return Err(AuthError::Missing);
        }
        if token.len() > MAX_TOKEN_LEN || !token.starts_with(TOKEN_PREFIX) {
            return Err(AuthError::Malformed);
        }
        // Looked up by hash: the comparison is of digests, so its timing says nothing about
        // how close a guess was to a real token.
        self.by_hash.get(&hash(token)).cloned().ok_or(AuthError::Unknown)
    }
}

#[derive(Debug, Error)]
pub enum TokenFileError {
    #[error("reading token file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("writing token file {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("token file {0} is empty")]
    Empty(PathBuf),
}

/// The token in a file (surrounding whitespace ignored).
pub fn read_token_file(path: &Path) -> Result<String, TokenFileError> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| TokenFileError::Read { path: path.to_path_buf(), source })?;
    let token = text.trim();
    if token.is_empty() {
        return Err(TokenFileError::Empty(path.to_path_buf()));
    }
    Ok(token.to_string())
}

/// The token in `path`, or a new one written there (mode 0600, created exclusively so two
/// starting processes cannot each write their own).
pub fn read_or_create_token_file(path: &Path) -> Result<String, TokenFileError> {
    use std::os::unix::fs::OpenOptionsExt;
    let write_err = |source| TokenFileError::Write { path: path.to_path_buf(), source };
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(write_err)?;
    }
    let token = generate();
    match std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path) {
        Ok(mut file) => {
            file.write_all(format!("{token}\n").as_bytes()).map_err(write_err)?;
            file.sync_all().map_err(write_err)?;
            Ok(token)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => read_token_file(path),
        Err(e) => Err(write_err(e)),
    }
}

/// Where `strata standalone` run in `dir` keeps its state by default: outside `dir`, which it
/// mounts (so its tokens are never in a directory it serves), under the user's state directory
/// — `$XDG_STATE_HOME/strata/standalone/<name>-<hash>`, else `~/.local/state/...` — named after
/// `dir` and a hash of its resolved path, so that a CLI run in the same directory finds it.
/// `None` without a home directory.
pub fn standalone_state_dir(dir: &Path) -> Option<PathBuf> {
    let base = match std::env::var_os("XDG_STATE_HOME").filter(|v| !v.is_empty()) {
        Some(state) => PathBuf::from(state),
        None => PathBuf::from(std::env::var_os("HOME").filter(|v| !v.is_empty())?).join(".local/state"),
    };
    let resolved = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let digest = Sha256::digest(resolved.as_os_str().as_encoded_bytes());
    let short: String = digest.iter().take(4).map(|b| format!("{b:02x}")).collect();
    let name: String = resolved
        .file_name()
        .map(|n| {
            // Short enough that `<dir>/worker.sock` stays within a Unix socket's path limit.
            n.to_string_lossy()
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || "-_.".contains(*c))
                .take(32)
                .collect()
        })
        .filter(|n: &String| !n.is_empty())
        .unwrap_or_else(|| "root".to_string());
    Some(base.join("strata/standalone").join(format!("{name}-{short}")))
}

/// The token a client presents when none is given explicitly: `STRATA_TOKEN`, else the file
/// `STRATA_TOKEN_FILE` names, else a standalone's admin token when that file exists and is
/// readable — in `STRATA_DIR` when set, else in the state directory of a standalone run in the
/// current directory ([`standalone_state_dir`]), else in `./.strata` (a standalone started with
/// `--dir .strata`). `None` when there is none (a cluster with authentication off needs none).
pub fn client_token_from_env() -> Result<Option<String>, TokenFileError> {
    if let Ok(token) = std::env::var(TOKEN_ENV) {
        let token = token.trim();
        if !token.is_empty() {
            return Ok(Some(token.to_string()));
        }
    }
    if let Some(path) = std::env::var_os(TOKEN_FILE_ENV).filter(|v| !v.is_empty()) {
        return read_token_file(Path::new(&path)).map(Some);
    }
    let candidates: Vec<PathBuf> = match std::env::var_os("STRATA_DIR").filter(|v| !v.is_empty()) {
        Some(dir) => vec![PathBuf::from(dir)],
        None => standalone_state_dir(Path::new(".")).into_iter().chain([PathBuf::from(".strata")]).collect(),
    };
    Ok(candidates.iter().find_map(|dir| read_token_file(&dir.join(ADMIN_TOKEN_FILE)).ok()))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn tokens_are_long_random_and_recognisable() {
        let a = generate();
        let b = generate();
        assert_ne!(a, b);
        assert!(a.starts_with(TOKEN_PREFIX));
        assert_eq!(a.len(), TOKEN_PREFIX.len() + 64, "256 bits in hex");
        assert_eq!(hash(&a).len(), 64);
        assert_eq!(token_id(&hash(&a)).len(), 12);
    }

    #[test]
    fn roles_grant_what_their_names_say() {
        use Access::*;
        let table = [
            (Role::Admin, [true, true, true, true, false]),
            (Role::Writer, [true, true, true, false, false]),
            (Role::Reader, [true, true, false, false, false]),
            (Role::Worker, [true, true, false, false, true]),
        ];
        for (role, expect) in table {
            let got = [Any, Read, Write, Admin, Worker].map(|a| role.grants(a));
            assert_eq!(got, expect, "{role}");
            assert_eq!(Role::parse(role.as_str()).unwrap(), role);
        }
        assert!(matches!(Role::parse("root"), Err(AuthError::BadRole(_))));
    }

    #[test]
    fn a_table_knows_its_tokens_and_nothing_else() {
        let token = generate();
        let record = TokenRecord::new(&token, Role::Reader, Some("/data/team-a/"), "a", 1).unwrap();
        assert_eq!(record.prefix.as_deref(), Some("/data/team-a"));
        let table = TokenTable::new([(record.hash.clone(), record.identity())]);
        let id = table.verify(&token).unwrap();
        assert_eq!(id.role, Role::Reader);
        assert_eq!(table.verify(""), Err(AuthError::Missing));
        assert_eq!(table.verify(&generate()), Err(AuthError::Unknown));
        assert_eq!(table.verify("password"), Err(AuthError::Malformed));
        assert_eq!(table.verify(&format!("{TOKEN_PREFIX}{}", "0".repeat(600))), Err(AuthError::Malformed));
        assert_eq!(AuthError::Unknown.kind(), ErrorKind::Unauthenticated);
        assert!(id.check(Access::Read, Some("/data/team-a/x")).is_ok());
        assert!(id.check(Access::Read, Some("/data/team-a")).is_ok());
        let sibling = id.check(Access::Read, Some("/data/team-ab/x")).unwrap_err();
        assert_eq!(sibling.kind(), ErrorKind::PermissionDenied);
        assert!(id.check(Access::Read, Some("/data")).is_err(), "the parent is outside the scope");
        assert!(matches!(id.check(Access::Write, Some("/data/team-a/x")), Err(AuthError::Role { .. })));
        assert!(id.check(Access::Any, None).is_ok());
    }

    #[test]
    fn only_readers_and_writers_are_scoped() {
        let t = generate();
        assert_eq!(
            TokenRecord::new(&t, Role::Admin, Some("/x"), "", 0),
            Err(AuthError::NotScopable(Role::Admin))
        );
        assert!(
            TokenRecord::new(&t, Role::Admin, Some("/"), "", 0).unwrap().prefix.is_none(),
            "/ is everything"
        );
        assert!(matches!(
            TokenRecord::new(&t, Role::Reader, Some("relative"), "", 0),
            Err(AuthError::BadScope(..))
        ));
    }

    #[test]
    fn token_files_are_private_and_kept() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/admin.token");
        let first = read_or_create_token_file(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(read_or_create_token_file(&path).unwrap(), first, "an existing token is kept");
        std::fs::write(&path, "  \n").unwrap();
        assert!(matches!(read_token_file(&path), Err(TokenFileError::Empty(_))));
    }

    proptest! {
        /// The scope check against a reference: a path is in a scope iff the scope's components
        /// are a prefix of the path's components.
        #[test]
        fn scope_matches_components(
            prefix in proptest::collection::vec("[ab]{1,2}", 1..4),
            path in proptest::collection::vec("[ab]{1,2}", 0..5),
        ) {
            let p = format!("/{}", prefix.join("/"));
            let q = if path.is_empty() { "/".to_string() } else { format!("/{}", path.join("/")) };
            let reference = path.len() >= prefix.len() && path[..prefix.len()] == prefix[..];
            prop_assert_eq!(in_scope(&p, &q), reference, "{} in {}", q, p);
        }
    }
}
