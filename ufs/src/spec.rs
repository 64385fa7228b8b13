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
    /// `hdfs://namenode:port/path` (native HDFS RPC, no JVM)
    Hdfs { name_node: String, root: String },
    /// `webhdfs://host:port/path` (HDFS over its REST API)
    Webhdfs { endpoint: String, root: String },
    /// `gcs://bucket/prefix`
    Gcs { bucket: String, root: String },
    /// `azblob://container/prefix` (account and endpoint come from options)
    Azblob { container: String, root: String },
    /// `oss://bucket/prefix` (endpoint from options)
    Oss { bucket: String, root: String },
}

/// The schemes [`UfsSpec::parse`] accepts.
pub const SUPPORTED_SCHEMES: &[&str] = &["file", "s3", "hdfs", "webhdfs", "gcs", "azblob", "oss"];

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
            "s3" | "gcs" | "azblob" | "oss" | "hdfs" | "webhdfs" => {
                let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
                if authority.is_empty() {
                    let what = if matches!(scheme, "hdfs" | "webhdfs") { "host:port" } else { "bucket name" };
                    return Err(UfsError::InvalidConfig(format!("{uri:?}: missing {what}")));
                }
                let root = strata_common::path::normalize(&format!("/{path}"))
                    .map_err(|e| UfsError::InvalidConfig(format!("{uri:?}: {e}")))?;
                let name = authority.to_string();
                Ok(match scheme {
                    "s3" => UfsSpec::S3 { bucket: name, root },
                    "gcs" => UfsSpec::Gcs { bucket: name, root },
                    "azblob" => UfsSpec::Azblob { container: name, root },
                    "oss" => UfsSpec::Oss { bucket: name, root },
                    "hdfs" => UfsSpec::Hdfs { name_node: format!("hdfs://{name}"), root },
                    _ => UfsSpec::Webhdfs { endpoint: format!("http://{name}"), root },
                })
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
        assert_eq!(
            UfsSpec::parse("hdfs://nn:8020/warehouse/x").unwrap(),
            UfsSpec::Hdfs { name_node: "hdfs://nn:8020".into(), root: "/warehouse/x".into() }
        );
        assert_eq!(
            UfsSpec::parse("webhdfs://nn:9870/w").unwrap(),
            UfsSpec::Webhdfs { endpoint: "http://nn:9870".into(), root: "/w".into() }
        );
        assert_eq!(
            UfsSpec::parse("gcs://g/p").unwrap(),
            UfsSpec::Gcs { bucket: "g".into(), root: "/p".into() }
        );
        assert_eq!(
            UfsSpec::parse("azblob://c").unwrap(),
            UfsSpec::Azblob { container: "c".into(), root: "/".into() }
        );
        assert_eq!(
            UfsSpec::parse("oss://o/a/b").unwrap(),
            UfsSpec::Oss { bucket: "o".into(), root: "/a/b".into() }
        );
    }

    #[test]
    fn rejects_bad_uris() {
        assert!(matches!(UfsSpec::parse("ftp://x/y"), Err(UfsError::UnsupportedScheme(s)) if s == "ftp"));
        assert!(matches!(UfsSpec::parse("/tmp/x"), Err(UfsError::InvalidConfig(_))));
        assert!(matches!(UfsSpec::parse("file://relative"), Err(UfsError::InvalidConfig(_))));
        assert!(matches!(UfsSpec::parse("file:///a/../b"), Err(UfsError::InvalidConfig(_))));
        assert!(matches!(UfsSpec::parse("s3:///x"), Err(UfsError::InvalidConfig(_))));
        assert!(
            matches!(UfsSpec::parse("hdfs:///x"), Err(UfsError::InvalidConfig(m)) if m.contains("host:port"))
        );
        assert!(matches!(UfsSpec::parse("s3://b/../etc"), Err(UfsError::InvalidConfig(_))));
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
