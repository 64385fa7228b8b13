//! TLS on both planes, from one configuration.
//!
//! A process names its PEM files once ([`TlsConfig`]); [`TlsConfig::server`] and
//! [`TlsConfig::client`] read them once and build, from the same bytes, both the tonic
//! configuration (gRPC control plane) and the rustls configuration (framed TCP data plane), so the
//! two planes cannot disagree on what is trusted or presented.
//!
//! - `cert` + `key`: what this process presents — as a server (master gRPC, worker data plane)
//!   and, to a server that requires client certificates, as a client (a worker to its master).
//! - `ca`: what it trusts — the servers it connects to and, with `client_auth`, its clients.
//! - `server_name`: the name checked in a server's certificate instead of the host part of the
//!   address dialled (one name every server certificate carries, for clusters whose workers
//!   advertise pod IPs).
//!
//! The crypto provider is ring, chosen explicitly: the S3 client brings aws-lc-rs into the
//! same process, and with two providers compiled in rustls would not pick one by itself.
//! Files are read when a configuration is built (start, or a client's connect); a rotated
//! certificate takes effect at the next start.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Once};
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncWrite};

/// Environment variable: PEM CA bundle a client trusts; set = TLS on, to masters and workers.
pub const CA_ENV: &str = "STRATA_TLS_CA";
/// Environment variable: PEM certificate chain a client presents (mTLS).
pub const CERT_ENV: &str = "STRATA_TLS_CERT";
/// Environment variable: PEM private key of [`CERT_ENV`].
pub const KEY_ENV: &str = "STRATA_TLS_KEY";
/// Environment variable: the name checked in every server's certificate instead of the host.
pub const SERVER_NAME_ENV: &str = "STRATA_TLS_SERVER_NAME";

/// How long a peer has to complete a TLS handshake before the connection is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Where a process finds its TLS material (PEM files). Everything unset (the default) is plain
/// TCP. A server speaks TLS when `cert` and `key` are set; a client when `ca` is set.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM certificate chain (leaf first) this process presents. Default none.
    pub cert: Option<PathBuf>,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1) of `cert`. Default none.
    pub key: Option<PathBuf>,
    /// PEM bundle of the CA certificates trusted for servers and, with `client_auth`, for
    /// clients. Default none.
    pub ca: Option<PathBuf>,
    /// Servers require clients to present a certificate signed by `ca` (mutual TLS).
    /// Default false.
    pub client_auth: bool,
    /// Name checked in servers' certificates instead of the host part of the address.
    /// Default none (the host, a DNS name or an IP).
    pub server_name: Option<String>,
}

/// Why TLS material could not be loaded; every variant names the file.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TlsError {
    #[error("TLS: cannot read {what} {}: {source}", path.display())]
    Read { what: &'static str, path: PathBuf, source: std::io::Error },
    #[error("TLS: {what} {} is not valid PEM: {reason}", path.display())]
    Pem { what: &'static str, path: PathBuf, reason: String },
    #[error("TLS: {what} {} holds no {expected}", path.display())]
    Empty { what: &'static str, path: PathBuf, expected: &'static str },
    #[error("TLS: the key {} does not fit the certificate {}: {reason}", key.display(), cert.display())]
    KeyMismatch { cert: PathBuf, key: PathBuf, reason: String },
    #[error("TLS: {0}")]
    Incomplete(String),
    #[error("TLS: {0:?} is not a valid server name")]
    ServerName(String),
    #[error("TLS: {0}")]
    Rustls(String),
}

type Result<T> = std::result::Result<T, TlsError>;

impl TlsConfig {
    /// A client's settings from `STRATA_TLS_CA`, `STRATA_TLS_CERT`, `STRATA_TLS_KEY` and
    /// `STRATA_TLS_SERVER_NAME` (empty values count as unset).
    pub fn from_env() -> Self {
        let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
        Self {
            cert: var(CERT_ENV).map(PathBuf::from),
            key: var(KEY_ENV).map(PathBuf::from),
            ca: var(CA_ENV).map(PathBuf::from),
            client_auth: false,
            server_name: var(SERVER_NAME_ENV).and_then(|v| v.into_string().ok()),
        }
    }

    /// The server side: `None` when neither `cert` nor `key` is set (plain TCP).
    pub fn server(&self) -> Result<Option<ServerTls>> {
        let (cert_path, key_path) = match (&self.cert, &self.key) {
            (None, None) if self.client_auth => {
                return Err(TlsError::Incomplete("client_auth needs cert and key (and ca)".into()));
            }
            (None, None) => return Ok(None),
            (Some(c), Some(k)) => (c, k),
            _ => return Err(TlsError::Incomplete("a server needs both cert and key".into())),
        };
        install_default_provider();
        let cert_pem = read("certificate", cert_path)?;
        let key_pem = read("key", key_path)?;
        let certs = parse_certs("certificate", cert_path, &cert_pem)?;
        let key = parse_key(key_path, &key_pem)?;
        let builder = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Rustls(e.to_string()))?;
        let mut tonic = tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(&cert_pem, &key_pem))
            .timeout(HANDSHAKE_TIMEOUT);
        let builder = if self.client_auth {
            let ca_path = self
                .ca
                .as_ref()
                .ok_or_else(|| TlsError::Incomplete("client_auth needs ca (the clients' CA)".into()))?;
            let ca_pem = read("CA bundle", ca_path)?;
            let roots = root_store(ca_path, &ca_pem)?;
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .build()
                .map_err(|e| TlsError::Rustls(e.to_string()))?;
            tonic = tonic.client_ca_root(tonic::transport::Certificate::from_pem(&ca_pem));
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let config = builder.with_single_cert(certs, key).map_err(|e| TlsError::KeyMismatch {
            cert: cert_path.clone(),
            key: key_path.clone(),
            reason: e.to_string(),
        })?;
        Ok(Some(ServerTls { config: Arc::new(config), tonic }))
    }

    /// The client side: `None` when `ca` is not set (plain TCP).
    pub fn client(&self) -> Result<Option<ClientTls>> {
        let Some(ca_path) = &self.ca else {
            return Ok(None);
        };
        install_default_provider();
        let ca_pem = read("CA bundle", ca_path)?;
        let roots = root_store(ca_path, &ca_pem)?;
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Rustls(e.to_string()))?
            .with_root_certificates(roots);
        let mut tonic = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(&ca_pem))
            .timeout(HANDSHAKE_TIMEOUT);
        let config = match (&self.cert, &self.key) {
            (None, None) => builder.with_no_client_auth(),
            (Some(cert_path), Some(key_path)) => {
                let cert_pem = read("certificate", cert_path)?;
                let key_pem = read("key", key_path)?;
                let certs = parse_certs("certificate", cert_path, &cert_pem)?;
                let key = parse_key(key_path, &key_pem)?;
                tonic = tonic.identity(tonic::transport::Identity::from_pem(&cert_pem, &key_pem));
                builder.with_client_auth_cert(certs, key).map_err(|e| TlsError::KeyMismatch {
                    cert: cert_path.clone(),
                    key: key_path.clone(),
                    reason: e.to_string(),
                })?
            }
            _ => return Err(TlsError::Incomplete("a client certificate needs both cert and key".into())),
        };
        if let Some(name) = &self.server_name {
            ServerName::try_from(name.as_str()).map_err(|_| TlsError::ServerName(name.clone()))?;
            tonic = tonic.domain_name(name.clone());
        }
        Ok(Some(ClientTls { config: Arc::new(config), tonic, server_name: self.server_name.clone() }))
    }
}

/// A server's TLS: the tonic configuration for gRPC and the acceptor for the data plane.
#[derive(Clone)]
pub struct ServerTls {
    config: Arc<ServerConfig>,
    tonic: tonic::transport::ServerTlsConfig,
}

impl ServerTls {
    /// For `tonic::transport::Server::builder().tls_config(…)` (gRPC, ALPN h2).
    pub fn tonic(&self) -> tonic::transport::ServerTlsConfig {
        self.tonic.clone()
    }

    /// The data-plane handshake on an accepted connection, within [`HANDSHAKE_TIMEOUT`].
    pub async fn accept<IO>(&self, io: IO) -> std::io::Result<tokio_rustls::server::TlsStream<IO>>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        self.accept_within(io, HANDSHAKE_TIMEOUT).await
    }

    async fn accept_within<IO>(
        &self,
        io: IO,
        deadline: Duration,
    ) -> std::io::Result<tokio_rustls::server::TlsStream<IO>>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        let accept = tokio_rustls::TlsAcceptor::from(self.config.clone()).accept(io).into_fallible();
        match tokio::time::timeout(deadline, accept).await {
            Ok(Ok(stream)) => Ok(stream),
            Ok(Err((e, mut io))) => {
                // The alert saying why (a client certificate refused) is on its way to the peer,
                // which may already have sent its first request. Closing with those bytes unread
                // would reset the connection and destroy the alert in flight: half-close and
                // drain briefly instead, so the peer reads the reason.
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let _ = io.shutdown().await;
                let drain = async {
                    let mut sink = [0u8; 4096];
                    while matches!(io.read(&mut sink).await, Ok(n) if n > 0) {}
                };
                let _ = tokio::time::timeout(std::time::Duration::from_millis(200), drain).await;
                Err(handshake_error("TLS handshake failed", e))
            }
            Err(_) => Err(handshake_timed_out(deadline)),
        }
    }
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls").finish_non_exhaustive()
    }
}

/// A client's TLS: the tonic configuration for gRPC and the connector for the data plane.
#[derive(Clone)]
pub struct ClientTls {
    config: Arc<ClientConfig>,
    tonic: tonic::transport::ClientTlsConfig,
    server_name: Option<String>,
}

impl ClientTls {
    /// For `Endpoint::tls_config(…)`: checks the `server_name` override, else the URI's host.
    pub fn tonic(&self) -> tonic::transport::ClientTlsConfig {
        self.tonic.clone()
    }

    /// The name checked in the certificate of the server at `addr` (`host:port`): the
    /// `server_name` override, else the host.
    pub fn server_name_for(&self, addr: &str) -> Result<ServerName<'static>> {
        let name = match &self.server_name {
            Some(name) => name.as_str(),
            None => host_of(addr),
        };
        ServerName::try_from(name.to_string()).map_err(|_| TlsError::ServerName(name.to_string()))
    }

    /// The data-plane handshake with the server at `addr` on `io`, within [`HANDSHAKE_TIMEOUT`].
    /// Errors say "TLS handshake" (a server that speaks plain TCP fails here).
    pub async fn connect<IO>(
        &self,
        addr: &str,
        io: IO,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<IO>>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        self.connect_within(addr, io, HANDSHAKE_TIMEOUT).await
    }

    async fn connect_within<IO>(
        &self,
        addr: &str,
        io: IO,
        deadline: Duration,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<IO>>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        let name = self
            .server_name_for(addr)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
        let connect = tokio_rustls::TlsConnector::from(self.config.clone()).connect(name, io);
        match tokio::time::timeout(deadline, connect).await {
            Ok(result) => {
                result.map_err(|e| handshake_error("TLS handshake failed (does the server speak TLS?)", e))
            }
            Err(_) => Err(handshake_timed_out(deadline)),
        }
    }
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls").field("server_name", &self.server_name).finish_non_exhaustive()
    }
}

/// The host part of `host:port`, `[v6]:port`, or a bare host.
fn host_of(addr: &str) -> &str {
    if let Some(rest) = addr.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match addr.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') && port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => addr,
    }
}

fn handshake_timed_out(deadline: Duration) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("TLS handshake not done within {:.1} s", deadline.as_secs_f64()),
    )
}

fn handshake_error(what: &str, e: std::io::Error) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// ring, for every configuration this module builds.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Makes ring the process's default provider (once), for the configurations tonic builds itself
/// (its server side asks for the default). A default someone installed first is kept.
fn install_default_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| TlsError::Read { what, path: path.to_path_buf(), source })
}

fn parse_certs(what: &'static str, path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem { what, path: path.to_path_buf(), reason: e.to_string() })?;
    if certs.is_empty() {
        return Err(TlsError::Empty { what, path: path.to_path_buf(), expected: "CERTIFICATE section" });
    }
    Ok(certs)
}

fn parse_key(path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => {
            TlsError::Empty { what: "key", path: path.to_path_buf(), expected: "PRIVATE KEY section" }
        }
        e => TlsError::Pem { what: "key", path: path.to_path_buf(), reason: e.to_string() },
    })
}

fn root_store(path: &Path, pem: &[u8]) -> Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    for cert in parse_certs("CA bundle", path, pem)? {
        roots.add(cert).map_err(|e| TlsError::Pem {
            what: "CA bundle",
            path: path.to_path_buf(),
            reason: format!("a certificate is not a usable trust anchor: {e}"),
        })?;
    }
    Ok(roots)
}

/// The TCP socket under a TLS session: registered with a runtime's reactor, or parked (a plain
/// socket out of any runtime). tokio-rustls cannot rebuild a stream from a socket and a session,
/// so a TLS connection that changes runtimes — a client's across the runtimes the Python binding
/// replaces around `fork`, a worker's on its way to the latency lane — parks and attaches its
/// socket inside the stream that keeps the session, with whatever it has decrypted or still has
/// to send.
pub struct ParkableSocket {
    live: Option<tokio::net::TcpStream>,
    parked: Option<std::net::TcpStream>,
}

impl ParkableSocket {
    pub fn new(stream: tokio::net::TcpStream) -> Self {
        Self { live: Some(stream), parked: None }
    }

    /// The socket, while it is registered with a runtime.
    pub fn live(&self) -> Option<&tokio::net::TcpStream> {
        self.live.as_ref()
    }

    /// Takes the socket out of its runtime's reactor (which may then shut down). Only between
    /// exchanges: nothing polls a parked socket.
    pub fn park(&mut self) -> std::io::Result<()> {
        let live = self.live.take().ok_or_else(|| std::io::Error::other("already parked"))?;
        self.parked = Some(live.into_std()?);
        Ok(())
    }

    /// Registers the parked socket with the reactor of the runtime this runs in.
    pub fn attach(&mut self) -> std::io::Result<()> {
        let parked = self.parked.take().ok_or_else(|| std::io::Error::other("not parked"))?;
        self.live = Some(tokio::net::TcpStream::from_std(parked)?);
        Ok(())
    }

    fn live_mut(&mut self) -> std::io::Result<std::pin::Pin<&mut tokio::net::TcpStream>> {
        match &mut self.live {
            Some(s) => Ok(std::pin::Pin::new(s)),
            None => Err(std::io::Error::other("the connection is parked")),
        }
    }
}

impl AsyncRead for ParkableSocket {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.get_mut().live_mut()?.poll_read(cx, buf)
    }
}

impl AsyncWrite for ParkableSocket {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.get_mut().live_mut()?.poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.get_mut().live_mut()?.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.live.as_ref().is_some_and(|s| s.is_write_vectored())
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.get_mut().live_mut()?.poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.get_mut().live_mut()?.poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A socket parked in one runtime and attached in another carries the bytes on, and is
    /// refused, not polled, while parked.
    #[test]
    fn a_parked_socket_refuses_io_and_carries_on_in_the_next_runtime() {
        use std::io::{Read, Write};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let first = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let mut socket = first.block_on(async {
            let mut socket = ParkableSocket::new(tokio::net::TcpStream::connect(addr).await.unwrap());
            socket.write_all(b"one").await.unwrap();
            assert!(socket.attach().is_err(), "attached while live");
            socket.park().unwrap();
            assert!(socket.park().is_err(), "parked twice");
            assert!(socket.live().is_none());
            assert!(socket.write_all(b"x").await.is_err(), "written while parked");
            socket
        });
        drop(first);
        let (mut peer, _) = listener.accept().unwrap();
        let mut got = [0u8; 3];
        peer.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"one");
        peer.write_all(b"two").unwrap();
        let second = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        second.block_on(async {
            socket.attach().unwrap();
            let mut got = [0u8; 3];
            socket.read_exact(&mut got).await.unwrap();
            assert_eq!(&got, b"two");
        });
    }

    struct Files {
        dir: tempfile::TempDir,
    }

    impl Files {
        fn path(&self, name: &str) -> PathBuf {
            self.dir.path().join(name)
        }
    }

    /// A CA, a server certificate for 127.0.0.1 signed by it, and a second unrelated key.
    fn files() -> Files {
        let dir = tempfile::tempdir().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        let other = rcgen::KeyPair::generate().unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
        std::fs::write(dir.path().join("cert.pem"), cert.pem()).unwrap();
        std::fs::write(dir.path().join("key.pem"), key.serialize_pem()).unwrap();
        std::fs::write(dir.path().join("other.pem"), other.serialize_pem()).unwrap();
        std::fs::write(dir.path().join("garbage.pem"), "-----BEGIN CERTIFICATE-----\n!!!\n").unwrap();
        std::fs::write(dir.path().join("empty.pem"), "nothing here\n").unwrap();
        Files { dir }
    }

    fn server(f: &Files, cert: &str, key: &str) -> TlsConfig {
        TlsConfig {
            cert: Some(f.path(cert)),
            key: Some(f.path(key)),
            ca: Some(f.path("ca.pem")),
            ..Default::default()
        }
    }

    #[test]
    fn unset_is_plain_and_good_files_load_both_sides() {
        assert!(TlsConfig::default().server().unwrap().is_none());
        assert!(TlsConfig::default().client().unwrap().is_none());
        let f = files();
        let mtls = TlsConfig { client_auth: true, ..server(&f, "cert.pem", "key.pem") };
        assert!(mtls.server().unwrap().is_some());
        let client = mtls.client().unwrap().unwrap();
        assert_eq!(
            client.server_name_for("127.0.0.1:7").unwrap(),
            ServerName::try_from("127.0.0.1").unwrap()
        );
    }

    #[test]
    fn a_missing_file_is_named() {
        let f = files();
        let err = server(&f, "nope.pem", "key.pem").server().unwrap_err();
        assert!(matches!(err, TlsError::Read { .. }), "{err}");
        assert!(err.to_string().contains("nope.pem") && err.to_string().contains("certificate"), "{err}");
        let err = TlsConfig { ca: Some(f.path("nope-ca.pem")), ..Default::default() }.client().unwrap_err();
        assert!(err.to_string().contains("nope-ca.pem") && err.to_string().contains("CA bundle"), "{err}");
    }

    #[test]
    fn a_key_that_does_not_match_the_certificate_is_refused() {
        let f = files();
        let err = server(&f, "cert.pem", "other.pem").server().unwrap_err();
        assert!(matches!(err, TlsError::KeyMismatch { .. }), "{err}");
        assert!(err.to_string().contains("other.pem") && err.to_string().contains("cert.pem"), "{err}");
        let err = server(&f, "cert.pem", "other.pem").client().unwrap_err();
        assert!(matches!(err, TlsError::KeyMismatch { .. }), "{err}");
    }

    #[test]
    fn garbage_or_empty_pem_is_refused_with_the_file() {
        let f = files();
        let err = server(&f, "garbage.pem", "key.pem").server().unwrap_err();
        assert!(matches!(err, TlsError::Pem { .. }), "{err}");
        assert!(err.to_string().contains("garbage.pem"), "{err}");
        let err = server(&f, "empty.pem", "key.pem").server().unwrap_err();
        assert!(matches!(err, TlsError::Empty { .. }), "{err}");
        let err = server(&f, "cert.pem", "empty.pem").server().unwrap_err();
        assert!(err.to_string().contains("empty.pem") && err.to_string().contains("PRIVATE KEY"), "{err}");
        let err = TlsConfig { ca: Some(f.path("empty.pem")), ..Default::default() }.client().unwrap_err();
        assert!(err.to_string().contains("CA bundle"), "{err}");
    }

    #[test]
    fn half_configured_is_an_error_not_plain_text() {
        let f = files();
        let only_cert = TlsConfig { cert: Some(f.path("cert.pem")), ..Default::default() };
        assert!(matches!(only_cert.server(), Err(TlsError::Incomplete(_))));
        let no_ca = TlsConfig { client_auth: true, ca: None, ..server(&f, "cert.pem", "key.pem") };
        assert!(matches!(no_ca.server(), Err(TlsError::Incomplete(_))));
        let bad_name =
            TlsConfig { server_name: Some("not a name!".into()), ..server(&f, "cert.pem", "key.pem") };
        assert!(matches!(bad_name.client(), Err(TlsError::ServerName(_))));
    }

    /// A peer that connects and says nothing (or a server that never answers) is given up on
    /// at the deadline, on both sides, with an error that says so.
    #[tokio::test]
    async fn a_silent_peer_times_out_the_handshake() {
        let f = files();
        let config = server(&f, "cert.pem", "key.pem");
        let (server, client) = (config.server().unwrap().unwrap(), config.client().unwrap().unwrap());
        let deadline = Duration::from_millis(200);

        let (_silent_client, io) = tokio::io::duplex(1 << 16);
        let err = server.accept_within(io, deadline).await.expect_err("a silent client");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert!(err.to_string().contains("TLS handshake not done within 0.2 s"), "{err}");

        let (_silent_server, io) = tokio::io::duplex(1 << 16);
        let err = client.connect_within("127.0.0.1:7", io, deadline).await.expect_err("a silent server");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert!(err.to_string().contains("TLS handshake not done within 0.2 s"), "{err}");
    }

    #[test]
    fn the_host_of_an_address() {
        assert_eq!(host_of("worker-1.strata:29998"), "worker-1.strata");
        assert_eq!(host_of("10.0.0.7:29998"), "10.0.0.7");
        assert_eq!(host_of("[::1]:29998"), "::1");
        assert_eq!(host_of("localhost"), "localhost");
    }
}
