//! The UFSes tests run against: a temporary directory, or a real S3 server (Garage in
//! `./test.sh`, or any endpoint named by `STRATA_TEST_S3_*`).

use std::collections::BTreeMap;
use std::path::Path;

use opendal::Operator;
use tempfile::TempDir;

pub enum TestUfs {
    Fs {
        dir: TempDir,
    },
    S3 {
        endpoint: String,
        bucket: String,
        region: String,
        access_key: String,
        secret_key: String,
        prefix: String,
    },
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!(
            "{name} is not set: S3 tests need a real S3 endpoint. `./test.sh` starts Garage and sets \
             STRATA_TEST_S3_ENDPOINT, _BUCKET, _REGION, _ACCESS_KEY and _SECRET_KEY; set them yourself \
             to test against MinIO or AWS"
        )
    })
}

impl TestUfs {
    pub fn fs() -> Self {
        TestUfs::Fs { dir: tempfile::tempdir().expect("tempdir") }
    }

    /// The S3 endpoint from the environment, under a fresh prefix so tests never see each
    /// other's objects.
    pub fn s3() -> Self {
        TestUfs::S3 {
            endpoint: env("STRATA_TEST_S3_ENDPOINT"),
            bucket: env("STRATA_TEST_S3_BUCKET"),
            region: std::env::var("STRATA_TEST_S3_REGION").unwrap_or_else(|_| "us-east-1".into()),
            access_key: env("STRATA_TEST_S3_ACCESS_KEY"),
            secret_key: env("STRATA_TEST_S3_SECRET_KEY"),
            prefix: format!("t-{}", uuid::Uuid::new_v4().simple()),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            TestUfs::Fs { .. } => "fs",
            TestUfs::S3 { .. } => "s3",
        }
    }

    pub fn dir(&self) -> &Path {
        match self {
            TestUfs::Fs { dir } => dir.path(),
            TestUfs::S3 { .. } => panic!("an S3 UFS has no local directory"),
        }
    }

    pub fn uri(&self) -> String {
        match self {
            TestUfs::Fs { dir } => format!("file://{}", dir.path().display()),
            TestUfs::S3 { bucket, prefix, .. } => format!("s3://{bucket}/{prefix}"),
        }
    }

    /// Options a mount of this UFS needs (credentials, endpoint).
    pub fn mount_options(&self) -> Vec<(String, String)> {
        match self {
            TestUfs::Fs { .. } => Vec::new(),
            TestUfs::S3 { endpoint, region, access_key, secret_key, .. } => vec![
                ("endpoint".into(), endpoint.clone()),
                ("region".into(), region.clone()),
                ("access_key_id".into(), access_key.clone()),
                ("secret_access_key".into(), secret_key.clone()),
            ],
        }
    }

    /// `endpoint` as a socket address (for a fault proxy in front of it).
    pub fn endpoint_addr(&self) -> std::net::SocketAddr {
        match self {
            TestUfs::S3 { endpoint, .. } => endpoint
                .trim_start_matches("http://")
                .trim_end_matches('/')
                .parse()
                .expect("STRATA_TEST_S3_ENDPOINT must be http://ip:port for the fault tests"),
            TestUfs::Fs { .. } => panic!("an fs UFS has no endpoint"),
        }
    }

    /// Direct access to the same root, bypassing Strata (to write test objects and to measure).
    /// A server's temporary errors (a busy store answering 503) are retried with backoff, as the
    /// product's own UFS layer does: a fixture must not fail a test on what a client rides out.
    pub fn operator(&self) -> Operator {
        opendal::install_default();
        let mut config: BTreeMap<String, String> = BTreeMap::new();
        let scheme = match self {
            TestUfs::Fs { dir } => {
                config.insert("root".into(), dir.path().display().to_string());
                "fs"
            }
            TestUfs::S3 { bucket, prefix, .. } => {
                config.insert("bucket".into(), bucket.clone());
                config.insert("root".into(), format!("/{prefix}"));
                config.extend(self.mount_options());
                "s3"
            }
        };
        Operator::via_iter(scheme, config).expect("operator").layer(
            opendal::layers::RetryLayer::new()
                .with_max_times(8)
                .with_jitter()
                .with_min_delay(std::time::Duration::from_millis(50))
                .with_max_delay(std::time::Duration::from_secs(2)),
        )
    }

    pub async fn put(&self, rel: &str, bytes: Vec<u8>) {
        self.operator().write(rel, bytes).await.unwrap_or_else(|e| panic!("put {rel}: {e}"));
    }

    pub async fn delete(&self, rel: &str) {
        self.operator().delete(rel).await.unwrap_or_else(|e| panic!("delete {rel}: {e}"));
    }
}
