//! Certificates made for a test (rcgen): a CA, a server certificate for 127.0.0.1 and
//! localhost (also usable as a client certificate, as a worker presents it to its master), and
//! a client certificate, written as PEM files into a temporary directory.

use std::path::PathBuf;

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa, KeyPair};
use strata_client::TlsConfig;
use tempfile::TempDir;

pub struct TestPki {
    dir: TempDir,
}

impl Default for TestPki {
    fn default() -> Self {
        Self::new()
    }
}

impl TestPki {
    /// A new CA (unrelated to any other `TestPki`'s) and certificates it signed.
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        // A name of its own: another `TestPki`'s CA is a different CA, not a namesake.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("strata test CA {} {n}", std::process::id());
        ca_params.distinguished_name.push(rcgen::DnType::CommonName, name);
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().expect("key")).expect("ca");
        let issue = |names: Vec<String>, usages: Vec<ExtendedKeyUsagePurpose>, stem: &str| {
            let key = KeyPair::generate().expect("key");
            let mut params = CertificateParams::new(names).expect("params");
            params.extended_key_usages = usages;
            let cert = params.signed_by(&key, &ca).expect("sign");
            std::fs::write(dir.path().join(format!("{stem}.crt")), cert.pem()).expect("write cert");
            std::fs::write(dir.path().join(format!("{stem}.key")), key.serialize_pem()).expect("write key");
        };
        use ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};
        issue(vec!["127.0.0.1".into(), "localhost".into()], vec![ServerAuth, ClientAuth], "server");
        issue(vec!["strata-client".into()], vec![ClientAuth], "client");
        std::fs::write(dir.path().join("ca.crt"), ca.pem()).expect("write ca");
        Self { dir }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// A master's or worker's settings: its certificate, the CA, and client certificates
    /// required with `client_auth`.
    pub fn server(&self, client_auth: bool) -> TlsConfig {
        TlsConfig {
            cert: Some(self.path("server.crt")),
            key: Some(self.path("server.key")),
            ca: Some(self.path("ca.crt")),
            client_auth,
            server_name: None,
        }
    }

    /// A client's settings: trusts the CA and presents the client certificate.
    pub fn client(&self) -> TlsConfig {
        TlsConfig {
            cert: Some(self.path("client.crt")),
            key: Some(self.path("client.key")),
            ca: Some(self.path("ca.crt")),
            ..TlsConfig::default()
        }
    }

    /// A client's settings without a certificate of its own.
    pub fn client_without_cert(&self) -> TlsConfig {
        TlsConfig { ca: Some(self.path("ca.crt")), ..TlsConfig::default() }
    }
}
