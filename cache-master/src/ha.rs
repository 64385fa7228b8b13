//! Several masters on etcd: one leads, the others stand by.
//!
//! Each master binds its ports at start and serves through a [`Gate`]. The election
//! (`store::etcd`) publishes this master's [`Role`]; on `Leader` the master loads mounts, jobs
//! and schedules from etcd, builds its parts exactly as a single master does (`start`), resumes
//! the jobs that were running, and opens the gate; on `Standby` it closes the gate *first* and
//! then stops the term's parts (job runners, scheduler, liveness tick). A closed gate answers
//! every RPC with `not_leader` naming the leader when known (`strata_proto::leader`).
//!
//! Between two terms nothing is kept in memory: the new term starts from etcd, where the
//! registered workers are too (so the ring is known at once); the block map is rebuilt from the
//! full report each worker sends when its first heartbeat to the new leader is answered
//! `reregister`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::BoxFuture;
use strata_common::SharedClock;
use strata_proto::master_server::MasterServer;
use strata_ufs::{StateFence, UfsFactory};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::body::Body;
use tonic::codegen::{Service, http};
use tonic::server::NamedService;
use tracing::{info, warn};

use crate::config::MasterConfig;
use crate::rpc::Rpc;
use crate::runner::JobRunner;
use crate::start::{
    MasterError, MasterService, bind_rpc, build_parts, load_state, master_service, resume_jobs,
    spawn_jobs_tick, spawn_liveness_tick,
};
use crate::store::MetaStore;
use crate::store::etcd::{Etcd, EtcdStore, Role};

#[derive(Clone)]
enum GateState {
    Leading(MasterService),
    Standby(Option<String>),
}

/// The master's gRPC service: the term's service while leading, `not_leader` otherwise.
#[derive(Clone)]
pub(crate) struct Gate {
    state: Arc<RwLock<GateState>>,
}

impl Gate {
    fn new() -> Self {
        Self { state: Arc::new(RwLock::new(GateState::Standby(None))) }
    }

    fn set(&self, state: GateState) {
        *self.state.write().unwrap_or_else(|p| p.into_inner()) = state;
    }
}

impl Service<http::Request<Body>> for Gate {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let state = self.state.read().unwrap_or_else(|p| p.into_inner()).clone();
        match state {
            GateState::Leading(mut svc) => Box::pin(async move { svc.call(req).await }),
            GateState::Standby(leader) => {
                let status = strata_proto::leader::not_leader(leader.as_deref());
                Box::pin(std::future::ready(Ok(status.into_http())))
            }
        }
    }
}

impl NamedService for Gate {
    const NAME: &'static str = <MasterServer<Rpc> as NamedService>::NAME;
}

/// What stops an HA master.
pub(crate) struct HaStop {
    etcd: Arc<Etcd>,
    cancel: CancellationToken,
    election: JoinHandle<()>,
    terms: JoinHandle<()>,
    tasks: Vec<JoinHandle<()>>,
}

impl HaStop {
    pub(crate) async fn shutdown(self) {
        // Resign (the election revokes the lease), then the term follower stops the parts.
        self.cancel.cancel();
        let _ = self.election.await;
        let _ = self.terms.await;
        for task in self.tasks {
            task.abort();
            let _ = task.await;
        }
        self.etcd.close();
    }
}

/// Connects to etcd, binds both ports, serves as a standby and joins the election.
pub(crate) async fn start(
    config: MasterConfig,
    factory: Arc<dyn UfsFactory>,
    fence: StateFence,
    clock: SharedClock,
    rpc_server: tonic::transport::Server,
) -> Result<(SocketAddr, SocketAddr, HaStop), MasterError> {
    let ttl = Duration::from_millis(config.leader_lease_ms.max(2_000));
    let op_timeout = (ttl / 3).clamp(Duration::from_millis(500), Duration::from_secs(3));
    let deadline = std::time::Instant::now() + Duration::from_millis(config.meta_connect_timeout_ms);
    let etcd = loop {
        match Etcd::connect(&config.meta, op_timeout).await {
            Ok(etcd) => break etcd,
            Err(e @ crate::store::StoreError::Etcd(_)) if std::time::Instant::now() < deadline => {
                warn!(err = %e, "etcd not reachable yet; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e.into()),
        }
    };
    let (listener, rpc_addr) = match bind_rpc(config.rpc_addr).await {
        Ok(bound) => bound,
        Err(e) => {
            etcd.close();
            return Err(e);
        }
    };
    let health = Arc::new(|| Ok(()));
    let (http_addr, http_task) = match strata_proto::ops_http::serve(config.http_addr, health).await {
        Ok(served) => served,
        Err(source) => {
            etcd.close();
            return Err(MasterError::Bind { addr: config.http_addr, source });
        }
    };
    let advertise = config.advertise_addr.clone().unwrap_or_else(|| rpc_addr.to_string());
    let cancel = CancellationToken::new();
    let gate = Gate::new();
    let server = spawn_gated(rpc_server, listener, gate.clone(), cancel.clone());
    let (roles, election) = etcd.elect(advertise.clone(), ttl, cancel.clone());
    let follower = TermFollower { config, factory, fence, clock, etcd: etcd.clone(), gate, advertise };
    let terms = tokio::spawn(follower.run(roles));
    info!(%rpc_addr, %http_addr, "master started as a standby");
    Ok((rpc_addr, http_addr, HaStop { etcd, cancel, election, terms, tasks: vec![server, http_task] }))
}

fn spawn_gated(
    mut server: tonic::transport::Server,
    listener: tokio::net::TcpListener,
    gate: Gate,
    cancel: CancellationToken,
) -> JoinHandle<()> {
    // Without TCP_NODELAY (tonic leaves it unset on an accepted socket) a small answer waits
    // for the client's delayed ACK: every master call took ~40 ms, and each client's periodic
    // membership refresh stalled its reads for that long (strata-bench --tail-probe).
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tokio::spawn(async move {
        let result =
            server.add_service(gate).serve_with_incoming_shutdown(incoming, cancel.cancelled_owned()).await;
        if let Err(e) = result {
            warn!(err = %e, "master rpc server stopped");
        }
    })
}

/// One leader term's running parts.
struct Term {
    runner: Arc<JobRunner>,
    cancel: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl Term {
    async fn stop(self) {
        self.cancel.cancel();
        self.runner.shutdown().await;
        for task in self.tasks {
            task.abort();
            let _ = task.await;
        }
    }
}

struct TermFollower {
    config: MasterConfig,
    factory: Arc<dyn UfsFactory>,
    fence: StateFence,
    clock: SharedClock,
    etcd: Arc<Etcd>,
    gate: Gate,
    advertise: String,
}

impl TermFollower {
    async fn run(self, mut roles: watch::Receiver<Role>) {
        let mut term: Option<(i64, Term)> = None;
        loop {
            let role = roles.borrow_and_update().clone();
            match role {
                Role::Leader { revision } => {
                    if term.as_ref().is_none_or(|(r, _)| *r != revision) {
                        if let Some((_, old)) = term.take() {
                            self.gate.set(GateState::Standby(None));
                            old.stop().await;
                        }
                        match self.lead(revision) {
                            Ok(t) => term = Some((revision, t)),
                            // Loading failed (etcd trouble): stay closed; the next role change
                            // (or this retry) tries again.
                            Err(e) => {
                                warn!(err = %e, "cannot load the state as the new leader; retrying");
                                tokio::select! {
                                    _ = tokio::time::sleep(Duration::from_millis(500)) => continue,
                                    changed = roles.changed() => if changed.is_err() { break } else { continue },
                                }
                            }
                        }
                    }
                }
                Role::Standby { leader } => {
                    self.gate.set(GateState::Standby(leader));
                    if let Some((revision, old)) = term.take() {
                        old.stop().await;
                        info!(revision, "leader term over; standing by");
                    }
                }
            }
            if roles.changed().await.is_err() {
                break;
            }
        }
        self.gate.set(GateState::Standby(None));
        if let Some((_, old)) = term.take() {
            old.stop().await;
        }
    }

    /// Loads the state as the leader of term `revision`, starts its parts, opens the gate.
    fn lead(&self, revision: i64) -> Result<Term, MasterError> {
        let store: Arc<dyn MetaStore> = Arc::new(EtcdStore { etcd: self.etcd.clone(), revision });
        let (stored, resume) = load_state(&self.config, store, self.factory.as_ref(), &self.clock)?;
        let mut parts =
            build_parts(&self.config, stored, self.factory.clone(), self.fence.clone(), self.clock.clone());
        parts.rpc.leader = self.advertise.clone();
        let pending = parts.rpc.metadata.pending().clone();
        let pins = parts.rpc.pins.clone();
        let ticker =
            spawn_liveness_tick(&self.config, parts.cluster.clone(), pending, pins, parts.cancel.clone());
        let jobs_ticker = spawn_jobs_tick(parts.runner.clone(), parts.cancel.clone());
        resume_jobs(&parts.runner, resume, &self.config);
        self.gate.set(GateState::Leading(master_service(parts.rpc)));
        info!(revision, leader = %self.advertise, "leading");
        Ok(Term { runner: parts.runner, cancel: parts.cancel, tasks: vec![ticker, jobs_ticker] })
    }
}
