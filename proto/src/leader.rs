//! Following the leader among several masters.
//!
//! An HA cluster runs several masters; one leads and the others are standbys. Every RPC a
//! standby receives is answered with [`not_leader`]: gRPC `UNAVAILABLE`, error kind
//! [`ErrorKind::NotLeader`], and the leader's address in the [`LEADER_METADATA`] entry when it
//! is known. [`LeaderChannel`] is the client side of that contract, shared by the SDK, the
//! worker, the CLI and Python: a gRPC channel over a list of masters that sends each call to
//! the master it last found leading, follows a `strata-leader` hint, tries the next master when
//! one is unreachable, and keeps retrying for a bounded time (`follow_for`), so a failover
//! looks like one slow call to the caller, not an error. With a single master an unreachable
//! master fails the call at once, as a plain channel would.
//!
//! Retrying is decided on the error kind (data), never on a message. A call that reached a
//! master which then died may have been applied before the crash; it is sent again (every
//! master RPC is a read, an idempotent update, or a submit whose duplicate is visible as a
//! second job).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use http_body_util::BodyExt;
use strata_common::ErrorKind;
use tonic::body::Body;
use tonic::codegen::{Service, StdError, http};
use tonic::transport::{Channel, Endpoint};

/// gRPC metadata entry (ASCII) in which a standby names the leader's advertised `host:port`.
pub const LEADER_METADATA: &str = "strata-leader";

/// How long a call keeps following the leader (through an election) before it fails.
pub const DEFAULT_FOLLOW_FOR: Duration = Duration::from_secs(20);

/// A standby's answer: `UNAVAILABLE`, kind `not_leader`, the leader named when known.
pub fn not_leader(leader: Option<&str>) -> tonic::Status {
    let message = match leader {
        Some(addr) => format!("not the leader; the leader is {addr}"),
        None => "not the leader; no leader elected yet".to_string(),
    };
    let mut status = crate::status(ErrorKind::NotLeader, message);
    if let Some(value) = leader.and_then(|a| tonic::metadata::MetadataValue::try_from(a).ok()) {
        status.metadata_mut().insert(LEADER_METADATA, value);
    }
    status
}

/// The leader a status names, if it is a standby's answer that names one.
pub fn leader_hint(status: &tonic::Status) -> Option<String> {
    status.metadata().get(LEADER_METADATA).and_then(|v| v.to_str().ok()).map(str::to_string)
}

/// A gRPC client of the master(s), following the leader.
pub type MasterConn = crate::master_client::MasterClient<LeaderChannel>;

/// A client of the masters named by a `--master` value (one `host:port` or a comma-separated
/// list), each reached through `make`'s endpoint, with the message limits set.
pub fn master_conn(
    masters: &str,
    token: Option<&str>,
    make: impl Fn(&str) -> Result<Endpoint, tonic::transport::Error> + Send + Sync + 'static,
) -> Result<MasterConn, tonic::transport::Error> {
    let channel = LeaderChannel::new(strata_common::master_addrs(masters), token, make, DEFAULT_FOLLOW_FOR)?;
    Ok(crate::master_client::MasterClient::new(channel)
        .max_decoding_message_size(crate::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(crate::MAX_MESSAGE_BYTES))
}

type MakeEndpoint = dyn Fn(&str) -> Result<Endpoint, tonic::transport::Error> + Send + Sync;

/// A gRPC channel over the masters of a cluster that follows the leader. Cheap to clone.
#[derive(Clone)]
pub struct LeaderChannel {
    inner: Arc<Inner>,
}

struct Inner {
    masters: Vec<String>,
    make: Box<MakeEndpoint>,
    follow_for: Duration,
    channels: Mutex<HashMap<String, Channel>>,
    /// The master the last call succeeded on (or was told leads).
    current: Mutex<String>,
    /// `Bearer <token>`, sent with every call.
    authorization: Option<http::HeaderValue>,
}

impl LeaderChannel {
    /// A lazily connected channel over `masters` (at least one), each reached through the
    /// endpoint `make` builds for its `host:port` (timeouts, message limits), presenting `token`
    /// on every call (`None`: no token, for a cluster with authentication off).
    pub fn new(
        masters: Vec<String>,
        token: Option<&str>,
        make: impl Fn(&str) -> Result<Endpoint, tonic::transport::Error> + Send + Sync + 'static,
        follow_for: Duration,
    ) -> Result<Self, tonic::transport::Error> {
        let mut channels = HashMap::new();
        for addr in &masters {
            channels.insert(addr.clone(), make(addr)?.connect_lazy());
        }
        let current = masters.first().cloned().unwrap_or_default();
        Ok(Self {
            inner: Arc::new(Inner {
                masters,
                make: Box::new(make),
                follow_for,
                channels: Mutex::new(channels),
                current: Mutex::new(current),
                authorization: token.map(bearer),
            }),
        })
    }

    /// The masters this channel knows, in the order given.
    pub fn masters(&self) -> &[String] {
        &self.inner.masters
    }

    /// The master calls go to now (the last one found leading).
    pub fn current(&self) -> String {
        self.inner.current.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set_current(&self, addr: &str) {
        *self.inner.current.lock().unwrap_or_else(|p| p.into_inner()) = addr.to_string();
    }

    fn channel(&self, addr: &str) -> Result<Channel, tonic::transport::Error> {
        let mut channels = self.inner.channels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = channels.get(addr) {
            return Ok(c.clone());
        }
        // A leader named by a hint that is not in the list (another spelling of its address).
        let c = (self.inner.make)(addr)?.connect_lazy();
        channels.insert(addr.to_string(), c.clone());
        Ok(c)
    }

    /// The master after `addr` in the list (the first when `addr` is not in it).
    fn next_after(&self, addr: &str) -> String {
        let masters = &self.inner.masters;
        match masters.iter().position(|m| m == addr) {
            Some(i) => masters[(i + 1) % masters.len()].clone(),
            None => masters.first().cloned().unwrap_or_default(),
        }
    }

    async fn call_following(self, req: http::Request<Body>) -> Result<http::Response<Body>, StdError> {
        let (parts, body) = req.into_parts();
        // Every master RPC is unary: the request is small and can be sent again.
        let body = body.collect().await.map_err(|e| -> StdError { Box::new(e) })?.to_bytes();
        let started = Instant::now();
        let mut addr = self.current();
        let mut failures_in_a_row = 0u32;
        loop {
            let mut request = http::Request::new(Body::new(http_body_util::Full::new(body.clone())));
            *request.method_mut() = parts.method.clone();
            *request.uri_mut() = parts.uri.clone();
            *request.version_mut() = parts.version;
            *request.headers_mut() = parts.headers.clone();
            if let Some(auth) = &self.inner.authorization {
                request.headers_mut().insert(http::header::AUTHORIZATION, auth.clone());
            }
            *request.extensions_mut() = parts.extensions.clone();
            let mut channel = self.channel(&addr).map_err(|e| -> StdError { Box::new(e) })?;
            let out_of_time = started.elapsed() >= self.inner.follow_for;
            let sent = match futures::future::poll_fn(|cx| channel.poll_ready(cx)).await {
                Ok(()) => channel.call(request).await,
                Err(e) => Err(e),
            };
            let next = match sent {
                Ok(response) => match tonic::Status::from_header_map(response.headers()) {
                    Some(status) if crate::kind_of(&status) == ErrorKind::NotLeader && !out_of_time => {
                        match leader_hint(&status) {
                            Some(leader) if leader != addr => leader,
                            // Asked one master alone and it names no leader: that is the answer.
                            _ if self.inner.masters.len() < 2 => return Ok(response),
                            _ => self.next_after(&addr),
                        }
                    }
                    _ => {
                        self.set_current(&addr);
                        return Ok(response);
                    }
                },
                // One master and it is unreachable: nobody else to ask (a restart is waited
                // out by the caller, which keeps its cached view).
                Err(e) if out_of_time || self.inner.masters.len() < 2 => return Err(Box::new(e)),
                Err(_) => self.next_after(&addr),
            };
            failures_in_a_row += 1;
            // Going round the whole list without an answer: an election is under way.
            if failures_in_a_row as usize >= self.inner.masters.len().max(1) {
                let pause = Duration::from_millis(50 * u64::from(failures_in_a_row.min(10)));
                tokio::time::sleep(pause).await;
            }
            addr = next;
        }
    }
}

/// The `authorization` value presenting `token`, marked sensitive (never logged by hyper).
fn bearer(token: &str) -> http::HeaderValue {
    // A token with bytes a header cannot carry is no Strata token: the master refuses what is
    // sent instead as malformed, which says so.
    let mut value = http::HeaderValue::from_str(&format!("Bearer {token}"))
        .unwrap_or_else(|_| http::HeaderValue::from_static("Bearer not-a-token"));
    value.set_sensitive(true);
    value
}

impl Service<http::Request<Body>> for LeaderChannel {
    type Response = http::Response<Body>;
    type Error = StdError;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        Box::pin(self.clone().call_following(req))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_standby_answer_names_the_leader_and_is_temporary() {
        let status = not_leader(Some("10.0.0.2:19998"));
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert_eq!(crate::kind_of(&status), ErrorKind::NotLeader);
        assert!(crate::kind_of(&status).is_temporary());
        assert_eq!(status.message(), "not the leader; the leader is 10.0.0.2:19998");
        assert_eq!(leader_hint(&status).as_deref(), Some("10.0.0.2:19998"));
        let mut headers = http::HeaderMap::new();
        status.add_header(&mut headers).unwrap();
        let parsed = tonic::Status::from_header_map(&headers).unwrap();
        assert_eq!(leader_hint(&parsed).as_deref(), Some("10.0.0.2:19998"));
        let none = not_leader(None);
        assert_eq!(none.message(), "not the leader; no leader elected yet");
        assert_eq!(leader_hint(&none), None);
    }

    #[tokio::test]
    async fn next_after_goes_round_the_list() {
        let ch = LeaderChannel::new(
            vec!["127.0.0.1:1".into(), "127.0.0.1:2".into()],
            None,
            |a| Endpoint::from_shared(format!("http://{a}")),
            DEFAULT_FOLLOW_FOR,
        );
        let ch = ch.unwrap();
        assert_eq!(ch.next_after("127.0.0.1:1"), "127.0.0.1:2");
        assert_eq!(ch.next_after("127.0.0.1:2"), "127.0.0.1:1");
        assert_eq!(ch.next_after("elsewhere:3"), "127.0.0.1:1");
    }
}
