//! Mount URIs: which service, which root, which options — validated before anything is built.

use std::collections::BTreeMap;

use crate::{Result, UfsError};

/// A parsed mount URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UfsSpec {
    /// `file:///absolute/dir`
    Fs { root: String },
    /// `s3://bucket/optional/prefix`
    S3 { bucket: String, root: String },
}

impl UfsSpec {
    pub fn parse(uri: &str) -> Result<Self> {
        let (scheme, rest) = uri.split_once("://").ok_or_else(|| {
            UfsError::InvalidConfig(format!("{uri:?} is not a URI (expected scheme://...)"))
        })?;
        match scheme {
            "file" => {
                if !rest.starts_with('/') {
                    return Err(UfsError::InvalidConfig(format!(
                        "{uri:?}: file URIs need an absolute path (file:///dir)"
                    )));
                }
                let root = strata_common::path::normalize(rest)
                    .map_err(|e| UfsError::InvalidConfig(format!("{uri:?}: {e}")))?;
                Ok(UfsSpec::Fs { root })
            }
            "s3" => {
                let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
                if bucket.is_empty() {
                    return Err(UfsError::InvalidConfig(format!("{uri:?}: missing bucket name")));
                }
                let root = strata_common::path::normalize(&format!("/{prefix}"))
                    .map_err(|e| UfsError::InvalidConfig(format!("{uri:?}: {e}")))?;
                Ok(UfsSpec::S3 { bucket: bucket.to_string(), root })
            }
            other => Err(UfsError::UnsupportedScheme(other.to_string())),
        }
    }
}

/// Whether an option holds a credential that must never be logged or returned to clients.
pub fn is_secret_option(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    ["secret", "password", "token", "credential", "account_key", "sas"].iter().any(|s| k.contains(s))
}

/// A copy of `options` with secret values replaced by `***`.
pub fn redact_options(options: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    options
        .iter()
        .map(|(k, v)| (k.clone(), if is_secret_option(k) { "***".to_string() } else { v.clone() }))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_supported_uris() {
        assert_eq!(UfsSpec::parse("file:///tmp//x/").unwrap(), UfsSpec::Fs { root: "/tmp/x".into() });
        assert_eq!(
            UfsSpec::parse("s3://b/p/q").unwrap(),
            UfsSpec::S3 { bucket: "b".into(), root: "/p/q".into() }
        );
        assert_eq!(UfsSpec::parse("s3://b").unwrap(), UfsSpec::S3 { bucket: "b".into(), root: "/".into() });
    }

    #[test]
    fn rejects_bad_uris() {
        assert!(matches!(UfsSpec::parse("ftp://x/y"), Err(UfsError::UnsupportedScheme(s)) if s == "ftp"));
        assert!(matches!(UfsSpec::parse("/tmp/x"), Err(UfsError::InvalidConfig(_))));
        assert!(matches!(UfsSpec::parse("file://relative"), Err(UfsError::InvalidConfig(_))));
        assert!(matches!(UfsSpec::parse("file:///a/../b"), Err(UfsError::InvalidConfig(_))));
        assert!(matches!(UfsSpec::parse("s3:///x"), Err(UfsError::InvalidConfig(_))));
    }

    #[test]
    fn redacts_secrets() {
        let mut o = BTreeMap::new();
        o.insert("secret_access_key".to_string(), "s".to_string());
        o.insert("access_key_id".to_string(), "id".to_string());
        o.insert("session_token".to_string(), "t".to_string());
        let r = redact_options(&o);
        assert_eq!(r["secret_access_key"], "***");
        assert_eq!(r["session_token"], "***");
        assert_eq!(r["access_key_id"], "id");
    }
}
