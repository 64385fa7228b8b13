//! Mounts, jobs and schedules in etcd, shared by several masters, and the election of the one
//! that leads.
//!
//! Keys, under the prefix `/strata/`: `leader` (the leader's advertised rpc address, attached
//! to its lease), `mounts/<path>`, `jobs/<id>`, `schedules/<id>` (JSON records, as in redb),
//! `workers/<id>` (registered workers, so a new leader knows the ring at once), `tokens/<id>`
//! (token hashes with their roles and scopes, never a token), `writeback/<path>` (write-back
//! files acknowledged and not yet in the UFS), `lineage/<hash>` and `lineage_marks/<hash>`
//! (which jobs read which file versions, see `lineage`).
//!
//! Invariants:
//! - **One acting leader.** A master leads from the moment its transaction created `leader`
//!   (only if absent, attached to its lease) until it steps down. It steps down as soon as it
//!   cannot renew the lease for half the TTL, when etcd says the lease is gone, or on shutdown
//!   — before etcd can expire the lease and let a standby in.
//! - **Fencing.** Every write is a transaction guarded by `leader`'s create revision being the
//!   one this master's term created: a master that lost its lease (paused, partitioned) and did
//!   not notice yet cannot write; the write fails with [`StoreError::NotLeader`].
//! - The etcd client runs on its own small runtime, so lease renewals never wait behind the
//!   master's work, and the synchronous [`MetaStore`] calls block only their caller, each for at
//!   most the operation timeout.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, Txn, TxnOp};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{MetaStore, StoreError};
use crate::jobs::JobRecord;
use crate::membership::WorkerEntry;
use crate::mounts::MountRecord;
use crate::schedule::ScheduleRecord;

const PREFIX: &str = "/strata/";

/// What this master is, as the election sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Leading in the term whose `leader` key has this create revision.
    Leader { revision: i64 },
    /// Standing by; the leader's address when known.
    Standby { leader: Option<String> },
}

#[derive(Debug, Clone, Copy)]
struct Term {
    revision: i64,
}

/// The parsed `etcd://HOST:PORT[,HOST:PORT...]` value of `--meta`.
pub fn parse_endpoints(meta: &str) -> Result<Vec<String>, StoreError> {
    let rest = meta.strip_prefix("etcd://").ok_or_else(|| {
        StoreError::Config(format!("--meta {meta:?}: expected etcd://HOST:PORT[,HOST:PORT...]"))
    })?;
    let endpoints: Vec<String> = rest
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|e| if e.contains("://") { e.to_string() } else { format!("http://{e}") })
        .collect();
    if endpoints.is_empty() {
        return Err(StoreError::Config(format!("--meta {meta:?}: no etcd endpoint")));
    }
    Ok(endpoints)
}

/// A connection to etcd on its own runtime, the store over it, and the election.
pub struct Etcd {
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
    handle: tokio::runtime::Handle,
    client: Client,
    endpoints: Vec<String>,
    term: Mutex<Option<Term>>,
    /// Longest any single etcd operation may take.
    op_timeout: Duration,
}

fn etcd_err(endpoints: &[String], e: impl std::fmt::Display) -> StoreError {
    StoreError::Etcd(format!("etcd at {}: {e}", endpoints.join(",")))
}

impl Etcd {
    /// Connects to etcd and checks it answers (a clear error now rather than a silent standby).
    pub async fn connect(meta: &str, op_timeout: Duration) -> Result<Arc<Self>, StoreError> {
        let endpoints = parse_endpoints(meta)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("strata-etcd")
            .enable_all()
            .build()
            .map_err(|e| StoreError::Etcd(format!("cannot start the etcd runtime: {e}")))?;
        let handle = runtime.handle().clone();
        let eps = endpoints.clone();
        let connect = async move {
            let options = ConnectOptions::new()
                .with_connect_timeout(op_timeout)
                .with_timeout(op_timeout)
                .with_keep_alive(Duration::from_secs(2), op_timeout)
                .with_require_leader(true);
            let mut client = Client::connect(&eps, Some(options)).await.map_err(|e| etcd_err(&eps, e))?;
            // One read proves the cluster answers and has quorum.
            tokio::time::timeout(op_timeout, client.get(format!("{PREFIX}leader"), None))
                .await
                .map_err(|_| etcd_err(&eps, format!("no answer within {op_timeout:?}")))?
                .map_err(|e| etcd_err(&eps, e))?;
            Ok::<_, StoreError>(client)
        };
        let client =
            handle.spawn(connect).await.map_err(|e| StoreError::Etcd(format!("etcd connect task: {e}")))?;
        let client = match client {
            Ok(c) => c,
            Err(e) => {
                runtime.shutdown_background();
                return Err(e);
            }
        };
        Ok(Arc::new(Self {
            runtime: Mutex::new(Some(runtime)),
            handle,
            client,
            endpoints,
            term: Mutex::new(None),
            op_timeout,
        }))
    }

    fn term(&self) -> Option<Term> {
        *self.term.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set_term(&self, term: Option<Term>) {
        *self.term.lock().unwrap_or_else(|p| p.into_inner()) = term;
    }

    /// Runs `fut` on the etcd runtime and waits for it (blocking the caller), at most the
    /// operation timeout.
    fn block_on<T, F>(&self, fut: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: Future<Output = Result<T, etcd_client::Error>> + Send + 'static,
    {
        let (tx, rx) = std::sync::mpsc::channel();
        let timeout = self.op_timeout;
        self.handle.spawn(async move {
            let _ = tx.send(tokio::time::timeout(timeout, fut).await);
        });
        match rx.recv_timeout(timeout + Duration::from_millis(500)) {
            Ok(Ok(Ok(v))) => Ok(v),
            Ok(Ok(Err(e))) => Err(etcd_err(&self.endpoints, e)),
            Ok(Err(_)) | Err(_) => Err(etcd_err(&self.endpoints, format!("no answer within {timeout:?}"))),
        }
    }

    fn load_all<T: serde::de::DeserializeOwned>(&self, table: &str) -> Result<Vec<T>, StoreError> {
        let mut client = self.client.clone();
        let prefix = format!("{PREFIX}{table}/");
        let resp =
            self.block_on(async move { client.get(prefix, Some(GetOptions::new().with_prefix())).await })?;
        let mut out = Vec::new();
        for kv in resp.kvs() {
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            let record = serde_json::from_slice(kv.value())
                .map_err(|e| StoreError::Corrupt { key, reason: e.to_string() })?;
            out.push(record);
        }
        Ok(out)
    }

    /// One write, fenced by this master's term: applied only while `leader` is the key this
    /// term created.
    fn fenced(&self, revision: i64, op: TxnOp) -> Result<(), StoreError> {
        self.fenced_all(revision, vec![op])
    }

    /// Several writes in one transaction, fenced as one.
    fn fenced_all(&self, revision: i64, ops: Vec<TxnOp>) -> Result<(), StoreError> {
        // Stepped down (or a later term): refused here, without asking etcd.
        let term = self.term().filter(|t| t.revision == revision).ok_or(StoreError::NotLeader)?;
        let mut client = self.client.clone();
        let txn = Txn::new()
            .when([Compare::create_revision(format!("{PREFIX}leader"), CompareOp::Equal, term.revision)])
            .and_then(ops);
        let resp = self.block_on(async move { client.txn(txn).await })?;
        if resp.succeeded() { Ok(()) } else { Err(StoreError::NotLeader) }
    }

    fn put_op(table: &str, key: &str, record: &impl serde::Serialize) -> Result<TxnOp, StoreError> {
        let value = serde_json::to_vec(record).map_err(|e| StoreError::Db(e.to_string()))?;
        Ok(TxnOp::put(format!("{PREFIX}{table}/{key}"), value, None))
    }

    fn put(
        &self,
        revision: i64,
        table: &str,
        key: &str,
        record: &impl serde::Serialize,
    ) -> Result<(), StoreError> {
        let value = serde_json::to_vec(record).map_err(|e| StoreError::Db(e.to_string()))?;
        self.fenced(revision, TxnOp::put(format!("{PREFIX}{table}/{key}"), value, None))
    }

    fn delete(&self, revision: i64, table: &str, key: &str) -> Result<(), StoreError> {
        self.fenced(revision, TxnOp::delete(format!("{PREFIX}{table}/{key}"), None))
    }

    /// Starts the election: campaigns for `leader` with `advertise` as its value, holds it on a
    /// lease of `ttl`, and publishes this master's role on the returned channel until `cancel`
    /// (which also resigns: the lease is revoked so a standby takes over at once).
    pub fn elect(
        self: &Arc<Self>,
        advertise: String,
        ttl: Duration,
        cancel: CancellationToken,
    ) -> (watch::Receiver<Role>, tokio::task::JoinHandle<()>) {
        let (tx, rx) = watch::channel(Role::Standby { leader: None });
        let this = self.clone();
        let task = self.handle.spawn(async move { this.election_loop(advertise, ttl, tx, cancel).await });
        (rx, task)
    }

    async fn election_loop(
        self: Arc<Self>,
        me: String,
        ttl: Duration,
        tx: watch::Sender<Role>,
        cancel: CancellationToken,
    ) {
        let poll = (ttl / 10).clamp(Duration::from_millis(100), Duration::from_millis(500));
        while !cancel.is_cancelled() {
            match self.campaign(&me, ttl).await {
                Ok(Campaign::Won { lease, revision, started }) => {
                    self.set_term(Some(Term { revision }));
                    info!(leader = %me, revision, "elected leader");
                    let _ = tx.send(Role::Leader { revision });
                    let why = self.hold(lease, ttl, started, &cancel).await;
                    // Step down first, then tell etcd: never act while the lease may be gone.
                    self.set_term(None);
                    let _ = tx.send(Role::Standby { leader: None });
                    warn!(leader = %me, reason = why, "stepped down");
                    let mut client = self.client.clone();
                    let _ = tokio::time::timeout(self.op_timeout, client.lease_revoke(lease)).await;
                }
                Ok(Campaign::Lost { leader }) => {
                    tx.send_if_modified(|role| {
                        let new = Role::Standby { leader: leader.clone() };
                        let changed = *role != new;
                        *role = new;
                        changed
                    });
                }
                Err(e) => {
                    warn!(err = %e, "etcd unreachable; standing by");
                    tx.send_if_modified(|role| {
                        let changed = *role != Role::Standby { leader: None };
                        *role = Role::Standby { leader: None };
                        changed
                    });
                }
            }
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep(poll) => {}
            }
        }
    }

    /// One attempt: if no one leads, create `leader` on a fresh lease.
    async fn campaign(&self, me: &str, ttl: Duration) -> Result<Campaign, StoreError> {
        let key = format!("{PREFIX}leader");
        let mut client = self.client.clone();
        let op = self.op_timeout;
        let timed = |e: tokio::time::error::Elapsed| etcd_err(&self.endpoints, e);
        let current = tokio::time::timeout(op, client.get(key.as_str(), None))
            .await
            .map_err(timed)?
            .map_err(|e| etcd_err(&self.endpoints, e))?;
        if let Some(kv) = current.kvs().first() {
            return Ok(Campaign::Lost { leader: Some(String::from_utf8_lossy(kv.value()).into_owned()) });
        }
        // Time runs from before the grant: the lease cannot outlive `started + ttl` in our eyes.
        let started = Instant::now();
        let secs = ttl.as_secs().max(2) as i64;
        let lease = tokio::time::timeout(op, client.lease_grant(secs, None))
            .await
            .map_err(timed)?
            .map_err(|e| etcd_err(&self.endpoints, e))?
            .id();
        let txn = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.as_str(), me, Some(PutOptions::new().with_lease(lease)))])
            .or_else([TxnOp::get(key.as_str(), None)]);
        let resp = match tokio::time::timeout(op, client.txn(txn)).await {
            Ok(Ok(resp)) => resp,
            Ok(Err(e)) => {
                let _ = tokio::time::timeout(op, client.lease_revoke(lease)).await;
                return Err(etcd_err(&self.endpoints, e));
            }
            Err(e) => return Err(timed(e)),
        };
        if resp.succeeded() {
            let revision = resp.header().map(|h| h.revision()).unwrap_or_default();
            return Ok(Campaign::Won { lease, revision, started });
        }
        let _ = tokio::time::timeout(op, client.lease_revoke(lease)).await;
        let leader = resp.op_responses().into_iter().find_map(|r| match r {
            etcd_client::TxnOpResponse::Get(g) => {
                g.kvs().first().map(|kv| String::from_utf8_lossy(kv.value()).into_owned())
            }
            _ => None,
        });
        Ok(Campaign::Lost { leader })
    }

    /// Keeps the lease alive until it cannot (or `cancel`); returns why it stopped.
    async fn hold(
        &self,
        lease: i64,
        ttl: Duration,
        started: Instant,
        cancel: &CancellationToken,
    ) -> &'static str {
        let mut client = self.client.clone();
        let every = ttl / 5;
        let mut last_renewed = started;
        let mut stream = None;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return "shutting down",
                _ = tokio::time::sleep(every) => {}
            }
            let sent = Instant::now();
            if stream.is_none() {
                stream = tokio::time::timeout(every, client.lease_keep_alive(lease))
                    .await
                    .ok()
                    .and_then(Result::ok);
            }
            let renewed = match stream.as_mut() {
                Some((keeper, responses)) => {
                    let once = async {
                        keeper.keep_alive().await?;
                        responses.message().await
                    };
                    match tokio::time::timeout(every, once).await {
                        Ok(Ok(Some(r))) if r.ttl() > 0 => Ok(()),
                        Ok(Ok(Some(_))) => return "the lease expired",
                        _ => Err(()),
                    }
                }
                None => Err(()),
            };
            match renewed {
                Ok(()) => last_renewed = sent,
                Err(()) => {
                    stream = None;
                    warn!(lease, "cannot renew the leader lease");
                }
            }
            if last_renewed.elapsed() >= ttl / 2 {
                return "the leader lease could not be renewed for half its TTL";
            }
        }
    }

    /// Stops the etcd runtime (after the election stopped).
    pub fn close(&self) {
        self.set_term(None);
        if let Some(rt) = self.runtime.lock().unwrap_or_else(|p| p.into_inner()).take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for Etcd {
    /// A runtime may not be dropped (blocking) inside another: stop it in the background.
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            rt.shutdown_background();
        }
    }
}

enum Campaign {
    Won { lease: i64, revision: i64, started: Instant },
    Lost { leader: Option<String> },
}

/// The durable records in etcd for one leader term; every write is fenced by the term's
/// revision, so a store outliving its term writes nothing.
pub struct EtcdStore {
    pub etcd: Arc<Etcd>,
    pub revision: i64,
}

/// Most writes in one etcd transaction (etcd's `--max-txn-ops` defaults to 128).
const MAX_TXN_OPS: usize = 100;

impl EtcdStore {
    /// Writes in transactions of at most [`MAX_TXN_OPS`], each fenced and applied whole. A
    /// failure part way leaves the earlier chunks written; lineage tolerates it: its book in
    /// memory is unchanged, so the client's retry of the report writes the right totals over
    /// them.
    fn in_chunks(&self, mut ops: Vec<TxnOp>) -> Result<(), StoreError> {
        while !ops.is_empty() {
            let rest = ops.split_off(ops.len().min(MAX_TXN_OPS));
            self.etcd.fenced_all(self.revision, ops)?;
            ops = rest;
        }
        Ok(())
    }
}

impl MetaStore for EtcdStore {
    fn load_mounts(&self) -> Result<Vec<MountRecord>, StoreError> {
        self.etcd.load_all("mounts")
    }

    fn put_mount(&self, record: &MountRecord) -> Result<(), StoreError> {
        self.etcd.put(self.revision, "mounts", &record.path, record)
    }

    fn delete_mount(&self, path: &str) -> Result<(), StoreError> {
        self.etcd.delete(self.revision, "mounts", path)
    }

    fn load_jobs(&self) -> Result<Vec<JobRecord>, StoreError> {
        self.etcd.load_all("jobs")
    }

    fn put_job(&self, record: &JobRecord) -> Result<(), StoreError> {
        self.etcd.put(self.revision, "jobs", &record.id, record)
    }

    fn delete_job(&self, id: &str) -> Result<(), StoreError> {
        self.etcd.delete(self.revision, "jobs", id)
    }

    fn load_schedules(&self) -> Result<Vec<ScheduleRecord>, StoreError> {
        self.etcd.load_all("schedules")
    }

    fn put_job_and_schedule(&self, job: &JobRecord, schedule: &ScheduleRecord) -> Result<(), StoreError> {
        let ops =
            vec![Etcd::put_op("jobs", &job.id, job)?, Etcd::put_op("schedules", &schedule.id, schedule)?];
        self.etcd.fenced_all(self.revision, ops)
    }

    fn put_schedule(&self, record: &ScheduleRecord) -> Result<(), StoreError> {
        self.etcd.put(self.revision, "schedules", &record.id, record)
    }

    fn delete_schedule(&self, id: &str) -> Result<(), StoreError> {
        self.etcd.delete(self.revision, "schedules", id)
    }

    fn load_workers(&self) -> Result<Vec<WorkerEntry>, StoreError> {
        self.etcd.load_all("workers")
    }

    fn put_worker(&self, entry: &WorkerEntry) -> Result<(), StoreError> {
        self.etcd.put(self.revision, "workers", &entry.id, entry)
    }

    fn delete_worker(&self, id: &str) -> Result<(), StoreError> {
        self.etcd.delete(self.revision, "workers", id)
    }

    fn load_tokens(&self) -> Result<Vec<strata_security::token::TokenRecord>, StoreError> {
        self.etcd.load_all("tokens")
    }

    fn put_token(&self, record: &strata_security::token::TokenRecord) -> Result<(), StoreError> {
        self.etcd.put(self.revision, "tokens", &record.id, record)
    }

    fn delete_token(&self, id: &str) -> Result<(), StoreError> {
        self.etcd.delete(self.revision, "tokens", id)
    }

    fn load_pending(&self) -> Result<Vec<crate::writeback::PendingRecord>, StoreError> {
        self.etcd.load_all("writeback")
    }

    fn put_pending(&self, record: &crate::writeback::PendingRecord) -> Result<(), StoreError> {
        self.etcd.put(self.revision, "writeback", &record.path, record)
    }

    fn delete_pending(&self, path: &str) -> Result<(), StoreError> {
        self.etcd.delete(self.revision, "writeback", path)
    }

    fn load_pins(&self) -> Result<Vec<crate::pins::PinRecord>, StoreError> {
        self.etcd.load_all("pins")
    }

    fn put_pin(&self, record: &crate::pins::PinRecord) -> Result<(), StoreError> {
        self.etcd.put(self.revision, "pins", &record.path, record)
    }

    fn delete_pin(&self, path: &str) -> Result<(), StoreError> {
        self.etcd.delete(self.revision, "pins", path)
    }

    fn load_cache_ttls(&self) -> Result<Vec<crate::pins::CacheTtlRecord>, StoreError> {
        self.etcd.load_all("cache_ttls")
    }

    fn put_cache_ttl(&self, record: &crate::pins::CacheTtlRecord) -> Result<(), StoreError> {
        self.etcd.put(self.revision, "cache_ttls", &record.path, record)
    }

    fn delete_cache_ttl(&self, path: &str) -> Result<(), StoreError> {
        self.etcd.delete(self.revision, "cache_ttls", path)
    }

    /// The connection outlives a term; it is closed with the master ([`Etcd::close`]).
    fn load_lineage(
        &self,
    ) -> Result<(Vec<crate::lineage::LineageRecord>, Vec<crate::lineage::MarkRecord>), StoreError> {
        Ok((self.etcd.load_all("lineage")?, self.etcd.load_all("lineage_marks")?))
    }

    fn put_lineage(
        &self,
        records: &[crate::lineage::LineageRecord],
        marks: &[crate::lineage::MarkRecord],
    ) -> Result<(), StoreError> {
        let mut ops = Vec::with_capacity(records.len() + marks.len());
        for r in records {
            ops.push(Etcd::put_op("lineage", &r.store_key(), r)?);
        }
        for m in marks {
            ops.push(Etcd::put_op("lineage_marks", &m.store_key(), m)?);
        }
        self.in_chunks(ops)
    }

    fn delete_lineage(&self, record_keys: &[String], mark_keys: &[String]) -> Result<(), StoreError> {
        let ops = record_keys
            .iter()
            .map(|k| TxnOp::delete(format!("{PREFIX}lineage/{k}"), None))
            .chain(mark_keys.iter().map(|k| TxnOp::delete(format!("{PREFIX}lineage_marks/{k}"), None)))
            .collect();
        self.in_chunks(ops)
    }

    fn close(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One etcd member on free ports, killed when dropped (`$STRATA_TEST_ETCD` or `etcd` on the
    /// PATH; without it the test fails, as the rest of the suite's etcd tests do).
    struct LocalEtcd {
        child: std::process::Child,
        port: u16,
        _dir: tempfile::TempDir,
    }

    impl Drop for LocalEtcd {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    fn local_etcd() -> LocalEtcd {
        let bin = std::env::var_os("STRATA_TEST_ETCD")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| "etcd".into());
        let port = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let (client, peer) = (port(), port());
        let dir = tempfile::tempdir().unwrap();
        let (c, p) = (format!("http://127.0.0.1:{client}"), format!("http://127.0.0.1:{peer}"));
        let child = std::process::Command::new(bin)
            .args(["--name", "m0", "--data-dir"])
            .arg(dir.path())
            .args(["--listen-client-urls", &c, "--advertise-client-urls", &c])
            .args(["--listen-peer-urls", &p, "--initial-advertise-peer-urls", &p])
            .args(["--initial-cluster", &format!("m0={p}")])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("etcd is needed: install etcd-server (./test.sh does) or set STRATA_TEST_ETCD");
        LocalEtcd { child, port: client, _dir: dir }
    }

    async fn connect(port: u16) -> Arc<Etcd> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match Etcd::connect(&format!("etcd://127.0.0.1:{port}"), Duration::from_secs(2)).await {
                Ok(e) => return e,
                Err(e) if Instant::now() > deadline => panic!("{e}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// A lineage write larger than one etcd transaction is split, and a new leader loads it
    /// whole; deletes are split likewise.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lineage_larger_than_a_transaction_round_trips() {
        use crate::lineage::{LineageRecord, MarkRecord};
        let etcd = local_etcd();
        let a = connect(etcd.port).await;
        let Ok(Campaign::Won { revision, .. }) = a.campaign("a:1", Duration::from_secs(5)).await else {
            panic!("a leads")
        };
        a.set_term(Some(Term { revision }));
        let store = EtcdStore { etcd: a.clone(), revision };
        let records: Vec<LineageRecord> = (0..250)
            .map(|i| LineageRecord {
                job: "train".into(),
                mark_seq: i % 3,
                path: format!("/d/f{i}"),
                version: "v1".into(),
                ufs: format!("s3://b/f{i}"),
                reader: "-".into(),
                bytes: i,
                reads: 1,
                first_read_ms: 5,
                last_read_ms: 6,
            })
            .collect();
        let mark = MarkRecord { job: "train".into(), seq: 1, label: "epoch=1".into(), at_ms: 5 };
        store.put_lineage(&records, std::slice::from_ref(&mark)).unwrap();
        let (mut loaded, marks) = store.load_lineage().unwrap();
        loaded.sort_by_key(|r| r.bytes);
        assert_eq!(loaded, records);
        assert_eq!(marks, vec![mark.clone()]);
        let gone: Vec<String> = records[..120].iter().map(LineageRecord::store_key).collect();
        store.delete_lineage(&gone, &[mark.store_key()]).unwrap();
        let (loaded, marks) = store.load_lineage().unwrap();
        assert_eq!((loaded.len(), marks.len()), (130, 0));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_deposed_leader_cannot_write_even_before_it_notices() {
        let etcd = local_etcd();
        let (a, b) = (connect(etcd.port).await, connect(etcd.port).await);
        let ttl = Duration::from_secs(2);
        let Ok(Campaign::Won { revision: ra, .. }) = a.campaign("a:1", ttl).await else { panic!("a leads") };
        a.set_term(Some(Term { revision: ra }));
        let store_a = EtcdStore { etcd: a.clone(), revision: ra };
        let mount = MountRecord { path: "/m".into(), uri: "file:///tmp".into(), options: Default::default() };
        store_a.put_mount(&mount).unwrap();
        assert!(matches!(b.campaign("b:1", ttl).await, Ok(Campaign::Lost { leader: Some(l) }) if l == "a:1"));

        // a's lease is gone (as after a long pause) but a has not noticed: b takes over.
        let mut raw = a.client.clone();
        raw.delete(format!("{PREFIX}leader"), None).await.unwrap();
        let Ok(Campaign::Won { revision: rb, .. }) = b.campaign("b:1", ttl).await else { panic!("b leads") };
        b.set_term(Some(Term { revision: rb }));
        // etcd refuses a's write: its term's revision is no longer the leader key's.
        let err = store_a.put_mount(&MountRecord { path: "/late".into(), ..mount.clone() }).unwrap_err();
        assert!(matches!(err, StoreError::NotLeader), "{err}");
        let err = store_a.put_job_and_schedule(&Default::default(), &sample_schedule()).unwrap_err();
        assert!(matches!(err, StoreError::NotLeader), "{err}");
        // b writes, and reads what a wrote while it led.
        let store_b = EtcdStore { etcd: b.clone(), revision: rb };
        store_b.put_mount(&MountRecord { path: "/b".into(), ..mount.clone() }).unwrap();
        let paths: Vec<String> = store_b.load_mounts().unwrap().into_iter().map(|m| m.path).collect();
        assert_eq!(paths, ["/b", "/m"]);
        // A stepped-down master refuses locally, without asking etcd.
        a.set_term(None);
        assert!(matches!(store_a.delete_mount("/m"), Err(StoreError::NotLeader)));
        a.close();
        b.close();
    }

    fn sample_schedule() -> ScheduleRecord {
        ScheduleRecord {
            id: "s1".into(),
            cron: "0 1 * * *".into(),
            tz: "UTC".into(),
            path: "/m".into(),
            settings: Default::default(),
            next_fire_ms: 5,
            last_job_id: String::new(),
            fired: 0,
            skipped: 0,
            created_ms: 1,
        }
    }

    #[test]
    fn endpoints_parse() {
        assert_eq!(parse_endpoints("etcd://a:2379").unwrap(), ["http://a:2379"]);
        assert_eq!(parse_endpoints("etcd://a:2379, b:2379").unwrap(), ["http://a:2379", "http://b:2379"]);
        assert!(matches!(parse_endpoints("redis://a"), Err(StoreError::Config(_))));
        assert!(matches!(parse_endpoints("etcd://"), Err(StoreError::Config(_))));
    }
}
