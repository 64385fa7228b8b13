//! Strata paths: absolute, `/`-separated, normalised, never escaping their root.
//!
//! Every path that enters the system from a user goes through [`normalize`] once, so the rest
//! of the code can compare and prefix-match paths as plain strings.

use thiserror::Error;

/// Longest path accepted anywhere (bytes).
pub const MAX_PATH_LEN: usize = 4096;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PathError {
    #[error("path is empty")]
    Empty,
    #[error("path {0:?} is not absolute (it must start with '/')")]
    NotAbsolute(String),
    #[error("path {0:?} contains '..' or '.' components, which are not allowed")]
    DotComponent(String),
    #[error("path {0:?} contains a NUL byte or a backslash")]
    BadCharacter(String),
    #[error("path is longer than {MAX_PATH_LEN} bytes")]
    TooLong,
}

/// Normalises a user path: must start with `/`, no `.`/`..` components, no NUL; repeated and
/// trailing slashes are dropped. The root is `/`.
pub fn normalize(path: &str) -> Result<String, PathError> {
    if path.is_empty() {
        return Err(PathError::Empty);
    }
    if path.len() > MAX_PATH_LEN {
        return Err(PathError::TooLong);
    }
    if !path.starts_with('/') {
        return Err(PathError::NotAbsolute(path.to_string()));
    }
    if path.contains('\0') || path.contains('\\') {
        return Err(PathError::BadCharacter(path.to_string()));
    }
    let mut out = String::with_capacity(path.len());
    for component in path.split('/').filter(|c| !c.is_empty()) {
        if component == "." || component == ".." {
            return Err(PathError::DotComponent(path.to_string()));
        }
        out.push('/');
        out.push_str(component);
    }
    if out.is_empty() {
        out.push('/');
    }
    Ok(out)
}

/// If `path` is `mount` or lies under it, the remainder without a leading slash
/// (`""` for the mount point itself). Both must be normalised.
pub fn strip_mount<'a>(mount: &str, path: &'a str) -> Option<&'a str> {
    if mount == "/" {
        return Some(path.trim_start_matches('/'));
    }
    let rest = path.strip_prefix(mount)?;
    if rest.is_empty() { Some("") } else { rest.strip_prefix('/') }
}

/// The entry of a mount map (mount point → anything) holding a normalised path, and the path
/// relative to that mount. Mount points never nest, so the greatest key not after `path` is
/// the only candidate.
pub fn resolve_mount<'m, T>(
    mounts: &'m std::collections::BTreeMap<String, T>,
    path: &str,
) -> Option<(&'m str, &'m T, String)> {
    use std::ops::Bound;
    let (point, value) = mounts.range::<str, _>((Bound::Unbounded, Bound::Included(path))).next_back()?;
    let rel = strip_mount(point, path)?;
    Some((point.as_str(), value, rel.to_string()))
}

/// Joins a normalised directory and a child name.
pub fn join(dir: &str, name: &str) -> String {
    if dir == "/" { format!("/{name}") } else { format!("{dir}/{name}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalizes_and_rejects() {
        assert_eq!(normalize("/a//b/").unwrap(), "/a/b");
        assert_eq!(normalize("/").unwrap(), "/");
        assert_eq!(normalize("//").unwrap(), "/");
        assert_eq!(normalize("a/b"), Err(PathError::NotAbsolute("a/b".into())));
        assert_eq!(normalize("/a/../b"), Err(PathError::DotComponent("/a/../b".into())));
        assert_eq!(normalize("/a/./b"), Err(PathError::DotComponent("/a/./b".into())));
        assert_eq!(normalize(""), Err(PathError::Empty));
        assert!(matches!(normalize("/a\0"), Err(PathError::BadCharacter(_))));
        assert_eq!(normalize(&format!("/{}", "x".repeat(MAX_PATH_LEN))), Err(PathError::TooLong));
        // Names that merely contain dots are fine.
        assert_eq!(normalize("/a/..b/c.").unwrap(), "/a/..b/c.");
    }

    #[test]
    fn strips_mounts_on_component_boundaries() {
        assert_eq!(strip_mount("/data", "/data/x/y"), Some("x/y"));
        assert_eq!(strip_mount("/data", "/data"), Some(""));
        assert_eq!(strip_mount("/data", "/database/x"), None);
        assert_eq!(strip_mount("/", "/x"), Some("x"));
        assert_eq!(join("/", "a"), "/a");
        assert_eq!(join("/d", "a"), "/d/a");
    }
}
