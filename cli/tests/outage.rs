//! Reads survive the master, with real processes: `strata master` and `strata worker` as child
//! processes, the master stopped with SIGSTOP (it accepts connections and never answers — a
//! hung or paused master, the hardest outage to notice) while a reader loop in this process
//! reads cached files and lists a directory through the SDK, and new `strata cat` processes
//! start from the worker's view (`STRATA_WORKERS`). The 60-second test is the only long one;
//! each test runs its own processes, so they run in parallel.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use strata_testkit::pattern;
use strata_testkit::strata_client::{Client, ClientConfig};

use crate::common;
use common::{Proc, admin_token_file, spawn_until, strata, worker_token_file};

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill").arg(format!("-{sig}")).arg(child.id().to_string()).status().unwrap();
    assert!(ok.success(), "kill -{sig}");
}

/// Spawns `strata ARGS` and returns it with the first capture of `prefix…` on its stdout.
fn spawn(args: &[&str], prefix: &str) -> (Proc, String) {
    let mut cmd = strata();
    cmd.args(args);
    spawn_until(cmd, prefix, Stdio::null())
}

/// A master and a worker process, and a UFS directory mounted at /out with a 1 s metadata TTL.
struct Split {
    master: Proc,
    master_addr: String,
    _worker: Proc,
    worker_addr: String,
    _dir: tempfile::TempDir,
}

fn start(ufs: &Path) -> Split {
    let dir = tempfile::tempdir().unwrap();
    let state = |name: &str| dir.path().join(name).display().to_string();
    let (master, master_addr) = spawn(
        &[
            "master",
            "--rpc-addr",
            "127.0.0.1:0",
            "--http-addr",
            "127.0.0.1:0",
            "--data-dir",
            &state("master"),
        ],
        "master listening on ",
    );
    let (worker, worker_addr) = spawn(
        &[
            "--master",
            &master_addr,
            "worker",
            "--data-addr",
            "127.0.0.1:0",
            "--http-addr",
            "127.0.0.1:0",
            "--data-dir",
            &state("worker"),
            "--memory",
            "64MiB",
            "--nvme",
            "256MiB",
            "--token-file",
            &worker_token_file().display().to_string(),
        ],
        " serving data on ",
    );
    let uri = format!("file://{}", ufs.display());
    let out = strata()
        .args(["--master", &master_addr, "mount", "add", "/out", &uri, "-o", "block_size=1MiB"])
        .args(["-o", "metadata_ttl=1s"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    Split { master, master_addr, _worker: worker, worker_addr, _dir: dir }
}

fn config(split: &Split, grace: Duration) -> ClientConfig {
    let mut c = ClientConfig::new(split.master_addr.clone());
    c.token = Some(strata_testkit::strata_client::Token(
        strata_security::token::read_token_file(&admin_token_file()).unwrap(),
    ));
    c.sidecar_socket = None;
    c.workers = Vec::new();
    c.master_outage_grace = grace;
    c
}

/// `strata cat PATH` in a new process that can only start from the worker's view.
fn cat_from_worker(split: &Split, path: &str) -> std::process::Output {
    strata()
        .args(["--master", &split.master_addr, "cat", path])
        .env("STRATA_WORKERS", &split.worker_addr)
        .output()
        .unwrap()
}

/// Waits until a new process can start from the worker's view (filled when it registered and
/// when a heartbeat announces a new mount epoch).
fn wait_for_worker_view(split: &Split, path: &str) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let out = strata()
            .args(["--master", "127.0.0.1:1", "cat", path])
            .env("STRATA_WORKERS", &split.worker_addr)
            .output()
            .unwrap();
        if out.status.success() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no view from the worker: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_master_stopped_for_a_minute_costs_cached_reads_and_listings_nothing() {
    let ufs = tempfile::tempdir().unwrap();
    std::fs::create_dir(ufs.path().join("set")).unwrap();
    let files: Vec<(String, Vec<u8>)> = (0..6u64)
        .map(|i| {
            let data = pattern((1 << 20) + 1000 * i as usize, i);
            std::fs::write(ufs.path().join(format!("set/f{i}.bin")), &data).unwrap();
            (format!("/out/set/f{i}.bin"), data)
        })
        .collect();
    let split = start(ufs.path());
    let client = Client::connect(config(&split, Duration::from_secs(300))).await.unwrap();
    for (path, data) in &files {
        assert_eq!(&client.read_all(path).await.unwrap(), data);
    }
    let listing = client.list("/out/set").await.unwrap();
    assert_eq!(listing.len(), files.len());
    wait_for_worker_view(&split, &files[0].0);

    signal(&split.master.0, "STOP");
    let stopped = Instant::now();
    let (mut reads, mut lists, mut failures, mut new_processes) = (0u64, 0u64, Vec::new(), 0);
    let mut next_process = stopped;
    while stopped.elapsed() < Duration::from_secs(60) {
        for (path, data) in &files {
            match client.read_all(path).await {
                Ok(got) if got == *data => reads += 1,
                Ok(_) => failures.push(format!("{path}: other bytes")),
                Err(e) => failures.push(format!("{path}: {e}")),
            }
        }
        match client.list("/out/set").await {
            Ok(got) if got == listing => lists += 1,
            Ok(got) => failures.push(format!("listing of {} entries", got.len())),
            Err(e) => failures.push(format!("list: {e}")),
        }
        if Instant::now() >= next_process {
            // A new client process during the outage starts from the worker's view.
            let (path, data) = &files[new_processes % files.len()];
            let out = cat_from_worker(&split, path);
            if !out.status.success() || &out.stdout != data {
                failures.push(format!("new process: {}", String::from_utf8_lossy(&out.stderr)));
            }
            new_processes += 1;
            next_process = Instant::now() + Duration::from_secs(15);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    signal(&split.master.0, "CONT");
    assert!(
        failures.is_empty(),
        "{} failures during the outage: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    let counters = client.outage_counters();
    eprintln!(
        "during 60 s without the master: {reads} reads, {lists} listings, {new_processes} new processes; {counters:?}"
    );
    assert!(
        reads >= 60 && lists >= 10 && new_processes >= 3,
        "{reads} reads, {lists} lists, {new_processes} new processes"
    );
    assert_eq!(counters.outages, 1, "{counters:?}");
    assert!(counters.stale_stats > 0 && counters.stale_listings > 0, "{counters:?}");

    // The master is back: metadata comes from it again (a new file is listed).
    std::fs::write(ufs.path().join("set/late.bin"), b"late").unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while client.list("/out/set").await.map_or(true, |l| l.len() != files.len() + 1) {
        assert!(Instant::now() < deadline, "the master's listings did not come back");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(&client.read_all("/out/set/late.bin").await.unwrap()[..], b"late");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_a_short_grace_metadata_fails_saying_since_when_and_comes_back_with_the_master() {
    let ufs = tempfile::tempdir().unwrap();
    std::fs::write(ufs.path().join("g.bin"), b"grace").unwrap();
    let split = start(ufs.path());
    // More than the 5 s a call with a cached answer gives a stopped master, which is when the
    // outage is noticed (and dated from).
    let client = Client::connect(config(&split, Duration::from_secs(8))).await.unwrap();
    assert_eq!(&client.read_all("/out/g.bin").await.unwrap()[..], b"grace");
    let listing = client.list("/out").await.unwrap();

    signal(&split.master.0, "STOP");
    tokio::time::sleep(Duration::from_millis(1100)).await; // past the 1 s TTL
    assert_eq!(&client.read_all("/out/g.bin").await.unwrap()[..], b"grace", "within the grace");
    assert_eq!(client.list("/out").await.unwrap(), listing);
    tokio::time::sleep(Duration::from_secs(4)).await;
    let err = client.read_all("/out/g.bin").await.unwrap_err();
    assert!(err.is_master_outage(), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("unreachable since") && msg.contains("outage grace of 8 s"), "{msg}");
    let err = client.list("/out").await.unwrap_err();
    assert!(err.to_string().contains("unreachable since"), "{err}");

    signal(&split.master.0, "CONT");
    let deadline = Instant::now() + Duration::from_secs(30);
    while client.read_all("/out/g.bin").await.is_err() {
        assert!(Instant::now() < deadline, "reads did not come back with the master");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(client.list("/out").await.unwrap(), listing);
}

#[test]
fn a_new_process_starts_from_the_sidecars_view_while_the_master_is_stopped() {
    let ufs = tempfile::tempdir().unwrap();
    let data = pattern(2 << 20, 9);
    std::fs::write(ufs.path().join("s.bin"), &data).unwrap();
    let split = start(ufs.path());
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("sidecar.sock");
    let (_sidecar, _) = spawn(
        &[
            "--master",
            &split.master_addr,
            "worker",
            "--sidecar",
            "--socket",
            &socket.display().to_string(),
            "--http-addr",
            "127.0.0.1:0",
            "--data-dir",
            &dir.path().join("sidecar").display().to_string(),
            "--memory",
            "64MiB",
            "--nvme",
            "0",
            "--token-file",
            &worker_token_file().display().to_string(),
        ],
        "sidecar serving data on ",
    );
    let cat = |master: &str| {
        strata()
            .args(["--master", master, "cat", "/out/s.bin"])
            .env("STRATA_SIDECAR_SOCKET", &socket)
            .output()
            .unwrap()
    };
    // The sidecar fetched its view at start; a warm read through it first.
    let out = cat(&split.master_addr);
    assert!(out.status.success() && out.stdout == data, "{}", String::from_utf8_lossy(&out.stderr));

    signal(&split.master.0, "STOP");
    let out = cat(&split.master_addr);
    signal(&split.master.0, "CONT");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.stdout == data, "other bytes");
}
