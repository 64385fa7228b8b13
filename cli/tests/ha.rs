//! Highly available masters on a real etcd, as processes: etcd members and `strata master`s and
//! `strata worker`s started here on 127.0.0.1 with ports picked at run time, the leader killed
//! with SIGKILL, etcd restarted or cut below quorum.
//!
//! etcd comes from `$STRATA_TEST_ETCD` or `etcd` on the PATH (Debian's `etcd-server`, which
//! `./test.sh` installs). Without it these tests fail, naming what to install: they are part of
//! the suite, not optional.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common;
use common::{Proc, admin_token_file, free_port, strata, wait_for, worker_token_file};

/// Leader lease of the masters under test (the default is 5 s; shorter keeps the tests quick).
const LEASE_MS: u64 = 2_000;

fn etcd_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("STRATA_TEST_ETCD") {
        return PathBuf::from(p);
    }
    for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
        let p = dir.join("etcd");
        if p.is_file() {
            return p;
        }
    }
    panic!(
        "etcd not found: these tests need a real etcd. Install it (Debian: apt-get install etcd-server) \
         or point STRATA_TEST_ETCD at the binary; ./test.sh does this for you"
    );
}

/// One etcd member.
struct EtcdMember {
    name: String,
    client_port: u16,
    peer_port: u16,
    dir: PathBuf,
    proc: Option<Proc>,
}

/// An etcd cluster of `n` members in `dir`.
struct EtcdCluster {
    members: Vec<EtcdMember>,
}

impl EtcdCluster {
    /// Pauses (`STOP`) or resumes (`CONT`) member `i`: an etcd that hangs.
    fn signal(&self, i: usize, sig: &str) {
        let pid = self.members[i].proc.as_ref().expect("running").0.id().to_string();
        assert!(Command::new("kill").args([&format!("-{sig}"), &pid]).status().unwrap().success());
    }

    /// Starts `n` members on ports picked now. A port picked by `free_port` can be taken by
    /// another test before etcd binds it; a member that exits before it is healthy is then
    /// retried, with every member on fresh ports (they name each other's peer ports).
    fn start(dir: &Path, n: usize) -> Self {
        for attempt in 0.. {
            let members: Vec<EtcdMember> = (0..n)
                .map(|i| EtcdMember {
                    name: format!("m{i}"),
                    client_port: free_port(),
                    peer_port: free_port(),
                    dir: dir.join(format!("a{attempt}-m{i}")),
                    proc: None,
                })
                .collect();
            let mut cluster = Self { members };
            for i in 0..n {
                cluster.start_member(i);
            }
            match (0..n).try_for_each(|i| cluster.wait_healthy_or_exit(i)) {
                Ok(()) => return cluster,
                Err(why) if attempt < 2 => eprintln!("etcd attempt {attempt}: {why}; again on fresh ports"),
                Err(why) => panic!("etcd did not start: {why}"),
            }
        }
        unreachable!()
    }

    fn initial_cluster(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn start_member(&mut self, i: usize) {
        let initial = self.initial_cluster();
        let m = &mut self.members[i];
        let client = format!("http://127.0.0.1:{}", m.client_port);
        let peer = format!("http://127.0.0.1:{}", m.peer_port);
        std::fs::create_dir_all(m.dir.parent().expect("a member's directory has a parent")).unwrap();
        let log =
            std::fs::OpenOptions::new().create(true).append(true).open(m.dir.with_extension("log")).unwrap();
        let child = Command::new(etcd_binary())
            .args(["--name", &m.name, "--data-dir"])
            .arg(&m.dir)
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &initial, "--initial-cluster-state", "new"])
            .args(["--heartbeat-interval", "100", "--election-timeout", "1000"])
            .env("ETCD_UNSUPPORTED_ARCH", std::env::consts::ARCH)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start etcd");
        m.proc = Some(Proc(child));
    }

    fn wait_healthy(&mut self, i: usize) {
        if let Err(why) = self.wait_healthy_or_exit(i) {
            panic!("{why}");
        }
    }

    /// Waits until member `i` says it is healthy; an error (with its log) if it exits first.
    fn wait_healthy_or_exit(&mut self, i: usize) -> Result<(), String> {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let m = &mut self.members[i];
        loop {
            if http_get(m.client_port, "/health").is_some_and(|body| body.contains("\"health\":\"true\"")) {
                return Ok(());
            }
            if let Some(status) = m.proc.as_mut().and_then(|p| p.0.try_wait().ok().flatten()) {
                let log = std::fs::read_to_string(m.dir.with_extension("log")).unwrap_or_default();
                let tail: String = log.lines().rev().take(5).collect::<Vec<_>>().join(" | ");
                return Err(format!("etcd {} exited ({status}) before it was healthy: {tail}", m.name));
            }
            if std::time::Instant::now() > deadline {
                return Err(format!("etcd {} not healthy after 30 s", m.name));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill9(&mut self, i: usize) {
        if let Some(mut p) = self.members[i].proc.take() {
            p.kill9();
        }
    }

    fn meta(&self) -> String {
        let eps: Vec<String> = self.members.iter().map(|m| format!("127.0.0.1:{}", m.client_port)).collect();
        format!("etcd://{}", eps.join(","))
    }
}

fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

struct Master {
    addr: String,
    proc: Proc,
}

/// A master on etcd `meta`, its rpc port picked now.
fn start_master(dir: &Path, meta: &str) -> Master {
    let addr = format!("127.0.0.1:{}", free_port());
    let config = dir.join(format!("master-{addr}.toml").replace(':', "-"));
    std::fs::write(&config, format!("leader_lease_ms = {LEASE_MS}\nheartbeat_interval_ms = 200\n")).unwrap();
    let mut child = strata()
        .args(["master", "--http-addr", "127.0.0.1:0", "--rpc-addr", &addr, "--meta", meta, "--config"])
        .arg(&config)
        .arg("--data-dir")
        .arg(dir.join(format!("data-{addr}")))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    match lines.next() {
        Some(Ok(line)) if line.contains("master listening on") => {}
        other => panic!("master did not start: {other:?} {:?}", child.try_wait()),
    }
    std::thread::spawn(move || for _ in lines {});
    Master { addr, proc: Proc(child) }
}

fn start_worker(dir: &Path, masters: &str) -> Proc {
    let child = strata()
        .args(["--master", masters, "worker", "--data-addr", &format!("127.0.0.1:{}", free_port())])
        .arg("--token-file")
        .arg(worker_token_file())
        .args(["--http-addr", "127.0.0.1:0", "--memory", "256MiB", "--nvme", "256MiB", "--data-dir"])
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Proc(child)
}

fn run(masters: &str, args: &[&str]) -> Output {
    strata().arg("--master").arg(masters).args(args).output().unwrap()
}

fn json_of(o: &Output) -> Value {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stdout)))
}

/// The leader, as `strata status --json` reports it through the list of masters.
fn leader(masters: &str) -> String {
    let o = run(masters, &["status", "--json"]);
    json_of(&o)["leader"].as_str().unwrap().to_string()
}

/// Three masters on `etcd` and the comma-separated list of their addresses.
fn three_masters(dir: &Path, etcd: &EtcdCluster) -> (Vec<Master>, String) {
    let masters: Vec<Master> = (0..3).map(|_| start_master(dir, &etcd.meta())).collect();
    let list = masters.iter().map(|m| m.addr.as_str()).collect::<Vec<_>>().join(",");
    (masters, list)
}

fn kill_leader(masters: &mut [Master], list: &str) -> String {
    let old = leader(list);
    let m = masters.iter_mut().find(|m| m.addr == old).expect("the leader is one of ours");
    m.proc.kill9();
    old
}

fn live_workers(list: &str) -> usize {
    let s = json_of(&run(list, &["status", "--json"]));
    s["workers"].as_array().map(|w| w.iter().filter(|w| w["live"] == true).count()).unwrap_or(0)
}

/// Files for a warmup: `n` files of `size` bytes, each with its own bytes.
fn write_dataset(dir: &Path, n: usize, size: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| {
            let data: Vec<u8> =
                (0..size).map(|j| ((j as u32).wrapping_mul(2654435761) >> 13) as u8 ^ i as u8).collect();
            std::fs::write(dir.join(format!("f{i:03}.bin")), &data).unwrap();
            data
        })
        .collect()
}

#[test]
fn leader_killed_during_a_warmup_and_a_reader_loop_loses_no_read_and_the_job_succeeds() {
    let tmp = tempfile::tempdir().unwrap();
    let ufs = tempfile::tempdir().unwrap();
    let etcd = EtcdCluster::start(&tmp.path().join("etcd"), 1);
    let (mut masters, list) = three_masters(tmp.path(), &etcd);
    let _worker = start_worker(&tmp.path().join("w1"), &list);
    let _worker2 = start_worker(&tmp.path().join("w2"), &list);
    let files = write_dataset(ufs.path(), 48, 2 << 20);
    let uri = format!("file://{}", ufs.path().display());
    let add = run(&list, &["mount", "add", "/d", &uri, "-o", "metadata_ttl=500ms", "-o", "block_size=1MiB"]);
    assert!(add.status.success(), "{}", String::from_utf8_lossy(&add.stderr));
    wait_for("two live workers", Duration::from_secs(30), || (live_workers(&list) == 2).then_some(()));

    // A reader loop through the SDK, reading every file again and again (stats hit the master
    // every 500 ms), counting failures.
    let stop = Arc::new(AtomicBool::new(false));
    let (reads, failures) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let reader = {
        let (stop, reads, failures, list) = (stop.clone(), reads.clone(), failures.clone(), list.clone());
        let files = files.clone();
        std::thread::spawn(move || {
            let rt =
                tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
            rt.block_on(async move {
                let mut config = strata_client::ClientConfig::new(list);
                let admin = strata_security::token::read_token_file(&admin_token_file()).unwrap();
                config.token = Some(strata_client::Token(admin));
                let client = strata_client::Client::connect(config).await.unwrap();
                let mut errors = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    for (i, want) in files.iter().enumerate().step_by(5) {
                        match client.read_all(&format!("/d/f{i:03}.bin")).await {
                            Ok(got) if got.as_ref() == want.as_slice() => {}
                            Ok(_) => errors.push(format!("f{i:03}: wrong bytes")),
                            Err(e) => errors.push(format!("f{i:03}: {e}")),
                        }
                        reads.fetch_add(1, Ordering::Relaxed);
                    }
                }
                failures.store(errors.len() as u64, Ordering::Relaxed);
                errors
            })
        })
    };

    // A warmup with a bandwidth cap, so the leader is killed while it runs.
    let submit = run(&list, &["warmup", "/d", "--detach", "--json", "--bandwidth", "20MiB"]);
    let job = json_of(&submit)["id"].as_str().unwrap().to_string();
    // `job status` exits non-zero until the job SUCCEEDED; its JSON is printed either way.
    wait_for("the job to load some blocks", Duration::from_secs(30), || {
        let o = run(&list, &["job", "status", &job, "--json"]);
        let s: Value = serde_json::from_slice(&o.stdout).ok()?;
        (s["blocks_done"].as_u64().unwrap_or(0) > 0).then_some(())
    });
    let reads_before = reads.load(Ordering::Relaxed);
    let killed_at = Instant::now();
    let old = kill_leader(&mut masters, &list);
    let new = wait_for("a new leader", Duration::from_secs(20), || {
        let o = run(&list, &["status", "--json"]);
        o.status.success().then(|| json_of(&o)["leader"].as_str().unwrap().to_string()).filter(|l| *l != old)
    });
    eprintln!("failover {old} -> {new} in {:?}", killed_at.elapsed());

    let done = wait_for("the job to finish", Duration::from_secs(90), || {
        let o = run(&list, &["job", "status", &job, "--json"]);
        let s: Value = serde_json::from_slice(&o.stdout).ok()?;
        (s["state"] != "RUNNING").then_some(s)
    });
    assert_eq!(done["state"], "SUCCEEDED", "{done}");
    assert!(done["resumed"].as_u64().unwrap() >= 1, "the new leader resumed the job: {done}");
    assert_eq!(done["files_done"], 48, "{done}");

    // Reads went on through the failover.
    wait_for("reads after the failover", Duration::from_secs(30), || {
        (reads.load(Ordering::Relaxed) > reads_before + 20).then_some(())
    });
    stop.store(true, Ordering::Relaxed);
    let errors = reader.join().unwrap();
    eprintln!("{} reads, {} failed", reads.load(Ordering::Relaxed), errors.len());
    assert!(errors.is_empty(), "{} failed reads: {errors:?}", errors.len());
    assert_eq!(failures.load(Ordering::Relaxed), 0);
}

#[test]
fn a_schedule_fires_once_per_time_across_a_failover() {
    let tmp = tempfile::tempdir().unwrap();
    let ufs = tempfile::tempdir().unwrap();
    let etcd = EtcdCluster::start(&tmp.path().join("etcd"), 1);
    let (mut masters, list) = three_masters(tmp.path(), &etcd);
    let _worker = start_worker(&tmp.path().join("w1"), &list);
    write_dataset(ufs.path(), 2, 1 << 10);
    let uri = format!("file://{}", ufs.path().display());
    assert!(run(&list, &["mount", "add", "/d", &uri]).status.success());
    wait_for("a live worker", Duration::from_secs(30), || (live_workers(&list) == 1).then_some(()));
    // Every 4 seconds.
    let s = json_of(&run(&list, &["job", "schedule", "--cron", "*/4 * * * * *", "/d", "--json"]));
    let id = s["id"].as_str().unwrap().to_string();
    let fired = |list: &str| -> u64 {
        let all = json_of(&run(list, &["job", "schedules", "--json"]));
        all.as_array().unwrap().iter().find(|s| s["id"] == id.as_str()).unwrap()["fired"].as_u64().unwrap()
    };
    wait_for("a first fire", Duration::from_secs(15), || (fired(&list) >= 1).then_some(()));
    kill_leader(&mut masters, &list);
    let after_failover = fired(&list);
    wait_for("two more fires on the new leader", Duration::from_secs(20), || {
        (fired(&list) >= after_failover + 2).then_some(())
    });
    let fires = fired(&list);
    let history = json_of(&run(&list, &["job", "history", "--limit", "100", "--json"]));
    let mut created: Vec<u64> = history
        .as_array()
        .unwrap()
        .iter()
        .filter(|j| j["schedule_id"] == id.as_str())
        .map(|j| j["created_ms"].as_u64().unwrap())
        .collect();
    created.sort();
    // One job per fire, and never two for one time (fires are 4 s apart).
    assert!(
        created.len() as u64 >= fires.saturating_sub(1) && created.len() as u64 <= fires,
        "{created:?} vs {fires}"
    );
    for pair in created.windows(2) {
        assert!(pair[1] - pair[0] >= 2_000, "two jobs for one time: {created:?}");
    }
}

/// Tokens live in etcd: one created through a leader works through the next, and a revocation
/// through the new leader holds.
#[test]
fn tokens_created_before_a_failover_work_after_it_and_revocations_hold() {
    let tmp = tempfile::tempdir().unwrap();
    let etcd = EtcdCluster::start(&tmp.path().join("etcd"), 1);
    let (mut masters, list) = three_masters(tmp.path(), &etcd);
    let created = run(&list, &["token", "create", "--role", "reader", "--name", "before failover"]);
    assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stderr));
    let stdout = String::from_utf8(created.stdout).unwrap();
    let reader = stdout.lines().last().unwrap().to_string();
    let as_reader = |args: &[&str]| {
        strata()
            .env_remove("STRATA_TOKEN_FILE")
            .env("STRATA_TOKEN", &reader)
            .arg("--master")
            .arg(&list)
            .args(args)
            .output()
            .unwrap()
    };
    assert!(as_reader(&["status"]).status.success());

    let old = kill_leader(&mut masters, &list);
    wait_for("a new leader", Duration::from_secs(30), || {
        let o = run(&list, &["status", "--json"]);
        (o.status.success() && json_of(&o)["leader"].as_str() != Some(old.as_str())).then_some(())
    });
    let after = as_reader(&["status"]);
    assert!(
        after.status.success(),
        "the token is known to the new leader: {}",
        String::from_utf8_lossy(&after.stderr)
    );
    let tokens = json_of(&run(&list, &["token", "ls", "--json"]));
    let id = tokens.as_array().unwrap().iter().find(|t| t["name"] == "before failover").unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(run(&list, &["token", "revoke", &id]).status.success());
    let refused = as_reader(&["status"]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("unknown or revoked token"));
}

#[test]
fn an_etcd_restart_keeps_mounts_and_jobs() {
    let tmp = tempfile::tempdir().unwrap();
    let ufs = tempfile::tempdir().unwrap();
    let mut etcd = EtcdCluster::start(&tmp.path().join("etcd"), 1);
    let (masters, list) = three_masters(tmp.path(), &etcd);
    write_dataset(ufs.path(), 1, 1 << 10);
    let uri = format!("file://{}", ufs.path().display());
    assert!(run(&list, &["mount", "add", "/d", &uri]).status.success());
    let dry = json_of(&run(&list, &["warmup", "/d", "--dry-run", "--json"]));
    let job = dry["id"].as_str().unwrap().to_string();

    // A standby asked alone names the leader, and the client follows it there.
    let leader_now = leader(&list);
    for m in &masters {
        assert_eq!(leader(&m.addr), leader_now, "asked {}", m.addr);
    }

    etcd.kill9(0);
    etcd.start_member(0);
    etcd.wait_healthy(0);
    let mounts = wait_for("the mounts through a leader", Duration::from_secs(30), || {
        let o = run(&list, &["mount", "ls", "--json"]);
        o.status.success().then(|| json_of(&o))
    });
    assert_eq!(mounts[0]["path"], "/d", "{mounts}");
    let j = json_of(&run(&list, &["job", "status", &job, "--json"]));
    assert_eq!(j["state"], "SUCCEEDED", "{j}");
}

#[test]
fn an_etcd_that_refuses_or_hangs_is_a_clear_error_at_start() {
    let tmp = tempfile::tempdir().unwrap();
    let refused = format!("etcd://127.0.0.1:{}", free_port());
    let hangs = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let hangs_meta = format!("etcd://{}", hangs.local_addr().unwrap());
    for (meta, expected) in
        [(refused.as_str(), "etcd at"), (hangs_meta.as_str(), "etcd at"), ("redis://x", "etcd://")]
    {
        let started = Instant::now();
        let o = strata()
            .args([
                "master",
                "--rpc-addr",
                "127.0.0.1:0",
                "--http-addr",
                "127.0.0.1:0",
                "--meta",
                meta,
                "--data-dir",
            ])
            .arg(tmp.path())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{meta}: started");
        assert!(err.contains(expected), "{meta}: {err}");
        assert!(started.elapsed() < Duration::from_secs(15), "{meta}: took {:?}", started.elapsed());
    }
}

#[test]
fn masters_step_down_when_etcd_loses_quorum_and_lead_again_after() {
    let tmp = tempfile::tempdir().unwrap();
    let mut etcd = EtcdCluster::start(&tmp.path().join("etcd"), 3);
    let (masters, list) = three_masters(tmp.path(), &etcd);
    let first = leader(&list);
    etcd.kill9(1);
    etcd.kill9(2);
    // Every master, asked alone, answers that it does not lead: no one acts as the leader.
    wait_for("every master to stand by", Duration::from_secs(20), || {
        masters
            .iter()
            .all(|m| {
                let o = run(&m.addr, &["status"]);
                !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("not the leader")
            })
            .then_some(())
    });
    etcd.start_member(1);
    etcd.start_member(2);
    let again = wait_for("a leader again", Duration::from_secs(40), || {
        let o = run(&list, &["status", "--json"]);
        o.status.success().then(|| json_of(&o)["leader"].as_str().unwrap().to_string())
    });
    assert!(masters.iter().any(|m| m.addr == again), "{again} (was {first})");
}

#[test]
fn masters_step_down_while_etcd_hangs_and_lead_again_when_it_answers() {
    let tmp = tempfile::tempdir().unwrap();
    let etcd = EtcdCluster::start(&tmp.path().join("etcd"), 1);
    let (masters, list) = three_masters(tmp.path(), &etcd);
    let first = leader(&list);
    etcd.signal(0, "STOP");
    let stopped = Instant::now();
    wait_for("every master to stand by", Duration::from_secs(20), || {
        masters
            .iter()
            .all(|m| {
                let o = run(&m.addr, &["status"]);
                !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("not the leader")
            })
            .then_some(())
    });
    // Within half the lease plus one renewal attempt, well before etcd could expire it.
    assert!(stopped.elapsed() < Duration::from_millis(LEASE_MS * 3), "{:?}", stopped.elapsed());
    etcd.signal(0, "CONT");
    let again = wait_for("a leader again", Duration::from_secs(30), || {
        let o = run(&list, &["status", "--json"]);
        o.status.success().then(|| json_of(&o)["leader"].as_str().unwrap().to_string())
    });
    assert!(masters.iter().any(|m| m.addr == again), "{again} (was {first})");
}

#[test]
fn a_master_started_before_etcd_waits_for_it_when_told_to() {
    let tmp = tempfile::tempdir().unwrap();
    let etcd_dir = tmp.path().join("etcd");
    // The ports are picked now; etcd starts after the master.
    let mut etcd = EtcdCluster {
        members: vec![EtcdMember {
            name: "m0".into(),
            client_port: free_port(),
            peer_port: free_port(),
            dir: etcd_dir.join("m0"),
            proc: None,
        }],
    };
    let addr = format!("127.0.0.1:{}", free_port());
    let config = tmp.path().join("master.toml");
    std::fs::write(&config, format!("leader_lease_ms = {LEASE_MS}\nmeta_connect_timeout_ms = 30000\n"))
        .unwrap();
    let master = strata()
        .args([
            "master",
            "--http-addr",
            "127.0.0.1:0",
            "--rpc-addr",
            &addr,
            "--meta",
            &etcd.meta(),
            "--config",
        ])
        .arg(&config)
        .arg("--data-dir")
        .arg(tmp.path().join("data"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut master = Proc(master);
    // etcd starts after the master, and answers about a second later: the master's first
    // attempts are refused, and it keeps trying instead of exiting.
    etcd.start_member(0);
    etcd.wait_healthy(0);
    assert!(master.0.try_wait().unwrap().is_none(), "the master gave up");
    let leader = wait_for("the master to lead", Duration::from_secs(30), || {
        let o = run(&addr, &["status", "--json"]);
        o.status.success().then(|| json_of(&o)["leader"].as_str().unwrap().to_string())
    });
    assert_eq!(leader, addr);
}
