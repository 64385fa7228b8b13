//! The latency lane (docs/QOS.md): connections that declare the latency class are served on a
//! runtime thread of their own.
//!
//! Why a thread, when the class gate already orders answers: on a worker whose runtime threads
//! are busy with a throughput flood, a latency request waits twice before the gate sees it —
//! its socket's readiness waits for a busy runtime thread to poll the reactor, and its task then
//! waits behind the flood's connection tasks in the run queue. Neither is an answer the gate
//! can reorder. A thread of its own sleeps in its own `epoll_wait` and is woken by the kernel
//! when its request arrives, as a plain blocking server is.
//!
//! A connection moves after its `Class` frame: its socket is taken out of the shared runtime's
//! reactor and registered with the lane's, with its deadlines, its admission place and its
//! authenticated session. A TLS connection moves whole: its socket changes reactors inside the
//! stream that keeps its TLS session. Everything a latency request starts that is not its own
//! answer stays — a cold block's UFS fetch joins the single flight wherever it runs.
//!
//! The thread starts with the first latency connection, so a worker no latency client uses
//! never has it, and stops when the last connection on it ends after the worker dropped it.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use strata_common::sched::ThreadPriority;
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::task_tracker::TaskTrackerToken;
use tracing::{debug, warn};

use super::timed::Timed;
use super::{ConnState, DataPlane, connection};
use crate::metrics_defs as m;

/// A data-plane socket out of any runtime, on its way to the lane.
pub(crate) enum Portable {
    Tcp(std::net::TcpStream),
    Unix(std::os::unix::net::UnixStream),
    /// A TLS connection, its socket parked inside the stream that keeps its session.
    Tls(Box<super::TlsConnection>),
}

/// What [`Connection::portable`](super::Connection::portable) made of a connection.
pub(crate) enum Portability<S> {
    /// The socket, out of its runtime's reactor.
    Moved(Portable),
    /// A kind of connection that does not move: served where it is.
    Stays(S),
    /// Taking it out of the reactor failed: the connection is closed.
    Failed(std::io::Error),
}

/// A connection on its way to the lane: its socket, its deadlines and place, and what it
/// established.
pub(crate) struct Moving {
    pub(crate) socket: Portable,
    pub(crate) timed: Timed<()>,
    pub(crate) state: ConnState,
}
/// The lane of one worker (or sidecar).
pub struct LatencyLane {
    enabled: AtomicBool,
    priority: ThreadPriority,
    running: Mutex<Option<Running>>,
    moved: AtomicU64,
}

struct Running {
    handle: Handle,
    /// Dropped with the lane, which ends the thread once its last connection has ended.
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl LatencyLane {
    /// A lane that is used (`enabled`) or not (latency connections then stay on the shared
    /// runtime, where only the class gate orders them), its thread scheduled at `priority`
    /// (`qos_latency_nice`, `qos_latency_slice_us`).
    pub fn new(enabled: bool, priority: ThreadPriority) -> Self {
        Self {
            enabled: AtomicBool::new(enabled),
            priority,
            running: Mutex::new(None),
            moved: AtomicU64::new(0),
        }
    }

    /// Whether new latency connections move to the lane (those already there stay).
    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// Turns the lane on or off for connections that declare their class from now on: for a
    /// benchmark comparing both in one run.
    pub fn set_enabled(&self, enabled: bool) {
        self.enabled.store(enabled, Ordering::Relaxed);
    }

    /// Connections moved to the lane so far.
    pub fn moved(&self) -> u64 {
        self.moved.load(Ordering::Relaxed)
    }

    /// Serves `moving` on the lane's thread until it closes or `cancel` fires; `token` keeps
    /// the listener's tracker waiting for it as for its other connections.
    pub(crate) fn serve(
        &self,
        moving: Moving,
        plane: DataPlane,
        cancel: CancellationToken,
        token: TaskTrackerToken,
    ) {
        let handle = match self.handle() {
            Ok(handle) => handle,
            Err(e) => {
                // Without a thread the connection cannot be served anywhere: it was already
                // taken out of the shared reactor. The client sees a closed connection and
                // retries, as after any worker-side close.
                warn!(err = %e, "cannot start the latency lane's thread; connection closed");
                return;
            }
        };
        self.moved.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(m::QOS_LANE_CONNECTIONS).increment(1);
        handle.spawn(async move {
            let _token = token;
            let Moving { socket, timed, state } = moving;
            let served = async {
                // `from_std` registers the socket with the current runtime's reactor: this thread's.
                match socket {
                    Portable::Tcp(s) => {
                        connection(timed.rejoin(tokio::net::TcpStream::from_std(s)?), plane, state).await
                    }
                    Portable::Unix(s) => {
                        connection(timed.rejoin(tokio::net::UnixStream::from_std(s)?), plane, state).await
                    }
                    Portable::Tls(tls) => connection(timed.rejoin(tls.attach()?), plane, state).await,
                }
            };
            let ended = tokio::select! {
                _ = cancel.cancelled() => Ok(None),
                r = served => r,
            };
            match ended {
                Ok(Some(_)) => debug!("a latency-lane connection asked to move again; closed"),
                Ok(None) => {}
                Err(e) => debug!(err = %e, "latency-lane connection ended"),
            }
        });
    }

    fn handle(&self) -> std::io::Result<Handle> {
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = running.as_ref() {
            return Ok(r.handle.clone());
        }
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let priority = self.priority;
        let handle = runtime.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new().name("strata-latency".into()).spawn(move || {
            // So the kernel runs this thread when its request arrives rather than after the
            // shared runtime's threads' slices: on a host whose cores a flood keeps busy, that
            // wait is most of a latency answer's (docs/QOS.md).
            if let Err(err) = priority.apply_to_current_thread() {
                warn!(%err, "the latency lane's thread keeps part of the default scheduling");
            }
            // Returns when the lane is dropped; dropping the runtime then ends what is left.
            runtime.block_on(async {
                let _ = stopped.await;
            });
        })?;
        *running = Some(Running { handle: handle.clone(), _stop: stop });
        Ok(handle)
    }
}

#[cfg(test)]
mod tests {
    use strata_common::sched::{current_thread_nice, current_thread_slice};

    use super::*;

    /// The lane's thread runs at the configured priority where the process may set it (root or
    /// `CAP_SYS_NICE`), and at the default where it may not, serving either way.
    #[test]
    fn the_lane_thread_runs_at_its_priority_and_starts_once() {
        let slice = std::time::Duration::from_micros(100);
        let lane = LatencyLane::new(true, ThreadPriority { nice: -5, slice: Some(slice) });
        let first = lane.handle().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        first.spawn(async move {
            let name = std::thread::current().name().map(str::to_string);
            tx.send((current_thread_nice().unwrap(), current_thread_slice().unwrap(), name)).unwrap();
        });
        let (nice, thread_slice, name) = rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
        assert_eq!(name.as_deref(), Some("strata-latency"));
        assert_eq!(thread_slice, slice, "a slice needs no privilege");
        // SAFETY: reads this process's effective user id.
        let privileged = unsafe { libc::geteuid() } == 0;
        if privileged {
            assert_eq!(nice, -5);
        } else {
            assert!(nice == -5 || nice == 0, "nice {nice}");
        }
        let again = lane.handle().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        again.spawn(async move { tx.send(std::thread::current().name().map(str::to_string)).unwrap() });
        assert_eq!(
            rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap().as_deref(),
            Some("strata-latency")
        );
        assert!(first.id() == again.id(), "one thread per lane");
    }
}
