//! An HTTP fault proxy for UFS tests: sits between Strata and a real S3 server and, request by
//! request, passes through, answers with an injected error status, stalls, or cuts a response
//! short. Every forwarded request is rewritten to `Connection: close`, so each request arrives
//! on a fresh connection and is subject to the plan.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// Forward to the server.
    Pass,
    /// Answer with this HTTP status and S3 error code, e.g. 503 `SlowDown`.
    Status(u16, &'static str),
    /// Accept the request and never answer.
    Stall,
    /// Forward, but deliver only the first N bytes of the response, then stall.
    Truncate(usize),
    /// Close the connection without answering.
    Reset,
}

struct State {
    upstream: SocketAddr,
    plan: Mutex<VecDeque<Fault>>,
    default: Mutex<Fault>,
    requests: AtomicU64,
}

pub struct FaultProxy {
    pub addr: SocketAddr,
    state: Arc<State>,
    task: JoinHandle<()>,
}

impl FaultProxy {
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy addr");
        let state = Arc::new(State {
            upstream,
            plan: Mutex::new(VecDeque::new()),
            default: Mutex::new(Fault::Pass),
            requests: AtomicU64::new(0),
        });
        let accept_state = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(handle(conn, accept_state.clone()));
            }
        });
        Self { addr, state, task }
    }

    /// The next request (after those already planned) gets `fault`.
    pub fn push(&self, fault: Fault) {
        self.state.plan.lock().unwrap().push_back(fault);
    }

    /// What requests get when nothing is planned.
    pub fn set_default(&self, fault: Fault) {
        *self.state.default.lock().unwrap() = fault;
    }

    pub fn clear(&self) {
        self.state.plan.lock().unwrap().clear();
        self.set_default(Fault::Pass);
    }

    /// Requests seen so far.
    pub fn requests(&self) -> u64 {
        self.state.requests.load(Ordering::SeqCst)
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn read_head(conn: &mut TcpStream) -> Option<(Vec<u8>, Vec<u8>)> {
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    loop {
        let n = conn.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buf.split_off(end + 4);
            return Some((buf, rest));
        }
        if buf.len() > 64 * 1024 {
            return None;
        }
    }
}

fn close_connection(head: &[u8]) -> Vec<u8> {
    let text = String::from_utf8_lossy(head);
    let mut out = String::with_capacity(text.len() + 20);
    for line in text.split("\r\n").filter(|l| !l.is_empty()) {
        if !line.to_ascii_lowercase().starts_with("connection:") {
            out.push_str(line);
            out.push_str("\r\n");
        }
    }
    out.push_str("Connection: close\r\n\r\n");
    out.into_bytes()
}

async fn stall(mut conn: TcpStream) {
    // Hold the connection until the client gives up (or two minutes pass).
    let mut sink = [0u8; 1024];
    let _ = tokio::time::timeout(Duration::from_secs(120), async {
        while matches!(conn.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
}

async fn handle(mut conn: TcpStream, state: Arc<State>) {
    let Some((head, early_body)) = read_head(&mut conn).await else { return };
    state.requests.fetch_add(1, Ordering::SeqCst);
    let fault =
        state.plan.lock().unwrap().pop_front().unwrap_or_else(|| state.default.lock().unwrap().clone());
    match fault {
        Fault::Reset => drop(conn),
        Fault::Stall => stall(conn).await,
        Fault::Status(code, s3_code) => {
            let body = format!(
                "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{s3_code}</Code><Message>injected by the test proxy</Message></Error>"
            );
            let resp = format!(
                "HTTP/1.1 {code} Injected\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = conn.write_all(resp.as_bytes()).await;
            let _ = conn.shutdown().await;
        }
        Fault::Pass | Fault::Truncate(_) => {
            let Ok(mut up) = TcpStream::connect(state.upstream).await else { return };
            if up.write_all(&close_connection(&head)).await.is_err()
                || up.write_all(&early_body).await.is_err()
            {
                return;
            }
            let (mut cr, mut cw) = conn.into_split();
            let (mut ur, mut uw) = up.into_split();
            let upload = tokio::spawn(async move {
                let _ = tokio::io::copy(&mut cr, &mut uw).await;
                cr
            });
            let limit = match fault {
                Fault::Truncate(n) => n,
                _ => usize::MAX,
            };
            let mut sent = 0usize;
            let mut chunk = vec![0u8; 64 * 1024];
            loop {
                let n = match ur.read(&mut chunk).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                let take = n.min(limit - sent);
                if cw.write_all(&chunk[..take]).await.is_err() {
                    break;
                }
                sent += take;
                if sent >= limit {
                    // Half a response, then silence: the client must time out.
                    tokio::time::sleep(Duration::from_secs(120)).await;
                    break;
                }
            }
            let _ = cw.shutdown().await;
            upload.abort();
        }
    }
}
