//! Write-back crash safety with real processes on a real S3 (Garage, from `./test.sh`): a master
//! and three `strata worker` processes, a `mode=write-back` mount with `write_replicas=2` whose
//! uploads are paced (`upload_bandwidth`) so a test can act between the acknowledgement and the
//! end of the upload; `kill -9`, restarts, and the objects in the bucket compared byte for byte.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;
use strata_testkit::{TestUfs, Tmpfs, pattern};

use crate::common;
use common::{Proc, master_args, spawn_logged, wait_for, worker_token_file};

/// `strata` as [`common::strata`], logging at info level (the tests read the logs).
fn strata() -> Command {
    let mut c = common::strata();
    c.env("RUST_LOG", "info");
    c
}

/// A master, three workers, and the Garage bucket under a fresh prefix.
struct Cluster {
    dir: tempfile::TempDir,
    _master: Proc,
    master: String,
    workers: Vec<Option<Proc>>,
    journal_dirs: Vec<Option<PathBuf>>,
    s3: TestUfs,
}

impl Cluster {
    fn start(journal_dirs: Vec<Option<PathBuf>>) -> Self {
        let s3 = TestUfs::s3();
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("master.toml");
        // Lost workers are noticed in 3 s, so a takeover fits a short test.
        std::fs::write(
            &config,
            "worker_timeout_ms = 3000\nheartbeat_interval_ms = 200\nwriteback_journal_grace_ms = 200\n",
        )
        .unwrap();
        let args = master_args(&config, &dir.path().join("master"));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (master_proc, master) =
            spawn_logged(&args, "master listening on ", &dir.path().join("master.log"));
        let mut cluster =
            Cluster { dir, _master: master_proc, master, workers: Vec::new(), journal_dirs, s3 };
        for i in 0..cluster.journal_dirs.len() {
            let w = cluster.spawn_worker(i);
            cluster.workers.push(Some(w));
        }
        cluster.wait_live(cluster.journal_dirs.len());
        cluster
    }

    fn worker_dir(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("worker-{i}"))
    }

    fn journal_dir(&self, i: usize) -> PathBuf {
        self.journal_dirs[i].clone().unwrap_or_else(|| self.worker_dir(i).join("nvme").join("journal"))
    }

    fn spawn_worker(&self, i: usize) -> Proc {
        let data = self.worker_dir(i).display().to_string();
        let mut args = vec![
            "--master".to_string(),
            self.master.clone(),
            "worker".into(),
            "--data-addr".into(),
            "127.0.0.1:0".into(),
            "--http-addr".into(),
            "127.0.0.1:0".into(),
            "--data-dir".into(),
            data,
            "--memory".into(),
            "64MiB".into(),
            "--nvme".into(),
            "256MiB".into(),
            "--token-file".into(),
            worker_token_file().display().to_string(),
        ];
        if let Some(j) = &self.journal_dirs[i] {
            args.extend(["--journal-dir".into(), j.display().to_string()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        spawn_logged(&args, " serving data on ", &self.dir.path().join(format!("worker-{i}.log"))).0
    }

    fn worker_id(&self, i: usize) -> String {
        std::fs::read_to_string(self.worker_dir(i).join("worker-id")).unwrap().trim().to_string()
    }

    fn index_of(&self, id: &str) -> usize {
        (0..self.workers.len()).find(|&i| self.worker_id(i) == id).expect("a worker of this cluster")
    }

    fn kill9(&mut self, i: usize) {
        if let Some(mut p) = self.workers[i].take() {
            // SIGKILL: no shutdown, no flush, the journal as the disk has it.
            p.0.kill().unwrap();
            p.0.wait().unwrap();
        }
    }

    fn restart(&mut self, i: usize) {
        let w = self.spawn_worker(i);
        self.workers[i] = Some(w);
    }

    fn run(&self, args: &[&str]) -> Output {
        strata().arg("--master").arg(&self.master).args(args).output().unwrap()
    }

    fn live(&self) -> usize {
        let out = self.run(&["status", "--json"]);
        serde_json::from_slice::<Value>(&out.stdout)
            .ok()
            .and_then(|s| s["workers"].as_array().map(|w| w.iter().filter(|w| w["live"] == true).count()))
            .unwrap_or(0)
    }

    fn wait_live(&self, n: usize) {
        wait_for(&format!("{n} live workers"), Duration::from_secs(30), || (self.live() == n).then_some(()));
    }

    /// Mounts the bucket's prefix `sub` at `path` with write-back and `options`.
    fn mount(&self, path: &str, sub: &str, options: &[&str]) {
        let uri = format!("{}/{sub}", self.s3.uri());
        let mut args = vec!["mount".to_string(), "add".into(), path.into(), uri];
        for (k, v) in self.s3.mount_options() {
            args.extend(["-o".into(), format!("{k}={v}")]);
        }
        for o in ["block_size=1MiB", "metadata_ttl=60s"].iter().chain(options) {
            args.extend(["-o".into(), o.to_string()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = self.run(&args);
        assert!(out.status.success(), "mount add: {}", stderr(&out));
    }

    /// `strata put - PATH` with `data` on standard input.
    fn put(&self, path: &str, data: &[u8]) -> Output {
        let mut child = strata()
            .args(["--master", &self.master, "put", "-", path])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(data).unwrap();
        child.wait_with_output().unwrap()
    }

    fn stat(&self, path: &str) -> Value {
        let out = self.run(&["stat", "--json", path]);
        assert!(out.status.success(), "stat {path}: {}", stderr(&out));
        serde_json::from_slice(&out.stdout).unwrap()
    }

    fn sync_wait(&self, path: &str) {
        let out = self.run(&["sync", "--wait", "--timeout", "120s", path]);
        assert!(out.status.success(), "sync --wait {path}: {}", stderr(&out));
    }

    /// Every object under the test's prefix, with its bytes.
    fn objects(&self) -> Vec<(String, Vec<u8>)> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let op = self.s3.operator();
            let mut out = Vec::new();
            for e in op.list_with("/").recursive(true).await.unwrap() {
                if e.metadata().is_file() {
                    let bytes = op.read(e.path()).await.unwrap().to_vec();
                    out.push((e.path().to_string(), bytes));
                }
            }
            out.sort();
            out
        })
    }

    /// The journals' files (not the marker that says the directory is the worker's own).
    fn journal_files(&self, i: usize) -> Vec<String> {
        std::fs::read_dir(self.journal_dir(i))
            .map(|d| {
                d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .filter(|name| name != strata_ufs::STATE_MARKER)
                    .collect()
            })
            .unwrap_or_default()
    }
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn holders(stat: &Value) -> Vec<String> {
    stat["holders"].as_array().unwrap().iter().map(|h| h.as_str().unwrap().to_string()).collect()
}

/// Uploads of at most 2 MiB/s: a 12 MiB file's upload is its first 8 MiB part, then 4 s of
/// waiting before the rest — the window the crash tests act in.
const PACED: &[&str] = &["mode=write-back", "write_replicas=2", "upload_bandwidth=2MiB"];

#[test]
fn kill_9_of_the_uploading_primary_the_other_replica_uploads() {
    let mut c = Cluster::start(vec![None, None, None]);
    c.mount("/wb", "wb", PACED);
    let data = pattern(12 << 20, 1);
    let out = c.put("/wb/ckpt/step-1.pt", &data);
    assert!(out.status.success(), "put: {}", stderr(&out));
    let stat = c.stat("/wb/ckpt/step-1.pt");
    assert_ne!(stat["persist"], "persisted", "{stat}");
    let held = holders(&stat);
    assert_eq!(held.len(), 2, "{stat}");
    c.kill9(c.index_of(&held[0]));
    // Still readable from the other journal while nobody has uploaded it.
    let cat = c.run(&["cat", "/wb/ckpt/step-1.pt"]);
    assert!(cat.status.success() && cat.stdout == data, "cat after the kill: {}", stderr(&cat));
    c.sync_wait("/wb/ckpt/step-1.pt");
    let objects = c.objects();
    assert_eq!(
        objects.len(),
        1,
        "one whole object, no partial one: {:?}",
        objects.iter().map(|o| &o.0).collect::<Vec<_>>()
    );
    assert_eq!(objects[0].0, "wb/ckpt/step-1.pt");
    assert!(objects[0].1 == data, "the bytes in the bucket are the acknowledged ones");
    assert_eq!(c.stat("/wb/ckpt/step-1.pt")["persist"], "persisted");
}

#[test]
fn both_holders_killed_and_restarted_resume_the_upload_from_their_journals() {
    let mut c = Cluster::start(vec![None, None, None]);
    c.mount("/wb", "wb", PACED);
    let data = pattern(12 << 20, 2);
    let out = c.put("/wb/model.bin", &data);
    assert!(out.status.success(), "put: {}", stderr(&out));
    let held: Vec<usize> = holders(&c.stat("/wb/model.bin")).iter().map(|h| c.index_of(h)).collect();
    for &i in &held {
        c.kill9(i);
    }
    for &i in &held {
        c.restart(i);
    }
    c.wait_live(3);
    c.sync_wait("/wb/model.bin");
    let objects = c.objects();
    assert_eq!(objects.len(), 1);
    assert!(objects[0].1 == data, "the bytes in the bucket are the acknowledged ones");
    wait_for("the journals to be dropped", Duration::from_secs(30), || {
        held.iter().all(|&i| c.journal_files(i).is_empty()).then_some(())
    });
}

#[test]
fn a_half_written_unacknowledged_file_is_discarded_at_restart_never_uploaded() {
    let mut c = Cluster::start(vec![None, None, None]);
    c.mount("/wb", "wb", PACED);
    let mut writer = strata()
        .args(["--master", &c.master, "put", "-", "/wb/half.bin"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = writer.stdin.take().unwrap();
    stdin.write_all(&pattern(6 << 20, 3)).unwrap();
    stdin.flush().unwrap();
    // The copies are being written: journal data on two workers, no record yet.
    let writing =
        || (0..3).filter(|&i| c.journal_files(i).iter().any(|f| f.ends_with(".data"))).collect::<Vec<_>>();
    wait_for("the copies to reach the journals", Duration::from_secs(30), || {
        (writing().len() == 2).then_some(())
    });
    let held = writing();
    for &i in &held {
        c.kill9(i);
    }
    drop(stdin);
    let _ = writer.kill();
    let _ = writer.wait();
    for &i in &held {
        c.restart(i);
    }
    c.wait_live(3);
    for &i in &held {
        assert!(c.journal_files(i).is_empty(), "worker {i} kept {:?}", c.journal_files(i));
    }
    let out = c.run(&["stat", "/wb/half.bin"]);
    assert!(!out.status.success(), "an unacknowledged file is not visible");
    c.sync_wait("/wb");
    assert!(c.objects().is_empty(), "nothing reached the bucket");
}

#[test]
fn concurrent_writers_of_one_path_leave_one_whole_version() {
    let c = Cluster::start(vec![None, None, None]);
    c.mount("/wb", "wb", &["mode=write-back", "write_replicas=2"]);
    let versions: Vec<Vec<u8>> = (0..4).map(|i| pattern((3 << 20) + i * 4096, 10 + i as u64)).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = versions.iter().map(|v| s.spawn(|| c.put("/wb/same.bin", v))).collect();
        for h in handles {
            let out = h.join().unwrap();
            assert!(out.status.success(), "put: {}", stderr(&out));
        }
    });
    c.sync_wait("/wb/same.bin");
    let objects = c.objects();
    assert_eq!(objects.len(), 1);
    assert!(versions.contains(&objects[0].1), "the object is one writer's whole file");
    let cat = c.run(&["cat", "/wb/same.bin"]);
    assert!(cat.stdout == objects[0].1, "Strata serves the version the bucket has");
}

#[test]
fn bad_writes_are_clear_errors_and_leave_nothing() {
    let c = Cluster::start(vec![None, None, None]);
    c.mount("/wb", "wb", &["mode=write-back", "write_replicas=2"]);
    c.mount("/ro", "ro", &[]);
    let out = c.put("/ro/a.bin", b"x");
    assert!(!out.status.success() && stderr(&out).contains("read-only"), "{}", stderr(&out));
    let out = c.put("/nowhere/a.bin", b"x");
    assert!(!out.status.success() && stderr(&out).contains("not under any mount"), "{}", stderr(&out));
    let out = c.put("/wb/../../etc/passwd", b"x");
    assert!(!out.status.success(), "{}", stderr(&out));
    let out = c.run(&["sync", "--wait", "--timeout", "soon", "/wb"]);
    assert!(!out.status.success() && stderr(&out).contains("--timeout"), "{}", stderr(&out));
    c.sync_wait("/wb");
    assert!(c.objects().is_empty(), "nothing reached the bucket");
}

#[test]
fn a_full_journal_disk_refuses_or_writes_through_as_the_mount_says() {
    let disks = tempfile::tempdir().unwrap();
    let tmpfs: Vec<Tmpfs> = (0..3).map(|i| Tmpfs::new(disks.path().join(format!("j{i}")), "4m")).collect();
    let c = Cluster::start(tmpfs.iter().map(|t| Some(t.path().to_path_buf())).collect());
    c.mount("/full", "full", &["mode=write-back", "write_replicas=2"]);
    c.mount("/through", "through", &["mode=write-back", "write_replicas=2", "on_full=write-through"]);
    let big = pattern(12 << 20, 4);

    let out = c.put("/full/a.bin", &big);
    assert!(!out.status.success(), "a write larger than the journal disk is refused");
    assert!(stderr(&out).contains("full"), "{}", stderr(&out));
    assert!(!c.run(&["stat", "/full/a.bin"]).status.success(), "nothing half-written is visible");
    // The disk is not left full: a file that fits goes through, and every partial journal went.
    let small = pattern(1 << 20, 5);
    let out = c.put("/full/small.bin", &small);
    assert!(out.status.success(), "put: {}", stderr(&out));
    c.sync_wait("/full");

    let out = c.put("/through/a.bin", &big);
    assert!(out.status.success(), "on_full=write-through: {}", stderr(&out));
    assert_eq!(c.stat("/through/a.bin")["persist"], "persisted", "written through: in the bucket at once");
    let objects = c.objects();
    let names: Vec<&str> = objects.iter().map(|o| o.0.as_str()).collect();
    assert_eq!(names, ["full/small.bin", "through/a.bin"]);
    assert!(objects[0].1 == small && objects[1].1 == big);
    wait_for("every journal to be dropped", Duration::from_secs(30), || {
        (0..3).all(|i| c.journal_files(i).is_empty()).then_some(())
    });
}
