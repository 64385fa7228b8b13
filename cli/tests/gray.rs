//! Gray failures with real processes: a master, three `strata worker` processes on a local-dir
//! mount, and a reader loop checking every file's bytes while one worker is frozen with SIGSTOP
//! (how a hung disk, a long pause or a half-dead node looks: its connections are accepted by
//! the kernel and never answered). `kill -9` is covered by the crash tests; a freeze is the case
//! that used to stall reads for the request timeout.

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;
use strata_client::{Client, ClientConfig, Token};

use crate::common;
use common::{
    Proc, admin_token_file, master_args, run_against, spawn_logged, ufs_files, wait_for, worker_args,
};

const FILES: usize = 60;
const FILE_LEN: usize = 256 * 1024;

fn status(master: &str) -> Value {
    let out = run_against(master, &["status", "--json"]);
    serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
}

fn worker_state(master: &str, id: &str) -> Option<(bool, bool)> {
    status(master)["workers"]
        .as_array()?
        .iter()
        .find(|w| w["id"] == id)
        .map(|w| (w["live"] == true, w["suspect"] == true))
}

fn signal(proc: &Proc, sig: &str) {
    let ok = Command::new("kill").args([sig, &proc.0.id().to_string()]).status().unwrap().success();
    assert!(ok, "kill {sig}");
}

/// Reads every file once, checking its bytes; returns the slowest read and the failures.
async fn read_all_files(client: &Client, files: &[Vec<u8>]) -> (Duration, Vec<String>) {
    let mut slowest = Duration::ZERO;
    let mut failed = Vec::new();
    for (i, data) in files.iter().enumerate() {
        let path = format!("/data/f{i}.bin");
        let started = Instant::now();
        match client.read_all(&path).await {
            Ok(got) if got[..] == data[..] => {}
            Ok(got) => failed.push(format!("{path}: {} bytes differ from the source", got.len())),
            Err(e) => failed.push(format!("{path}: {e}")),
        }
        slowest = slowest.max(started.elapsed());
    }
    (slowest, failed)
}

#[test]
fn a_frozen_worker_fails_no_read_holds_none_for_a_second_and_is_reported_suspect() {
    let dir = tempfile::tempdir().unwrap();
    let ufs = dir.path().join("ufs");
    let files = ufs_files(&ufs, FILES, FILE_LEN, 7);
    let config = dir.path().join("master.toml");
    // Suspect after 2 s (three 200 ms heartbeats, 2 s at least); lost only after 60 s, so the
    // whole test runs with the frozen worker still on the ring: reads must route around it,
    // not wait for it to leave.
    std::fs::write(&config, "worker_timeout_ms = 60000\nheartbeat_interval_ms = 200\n").unwrap();
    let args = master_args(&config, &dir.path().join("master"));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (_master, master) = spawn_logged(&args, "master listening on ", &dir.path().join("master.log"));
    let workers: Vec<Proc> = (0..3)
        .map(|i| {
            let args = worker_args(&master, &dir.path().join(format!("worker-{i}")), "64MiB", "0");
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            spawn_logged(&args, " serving data on ", &dir.path().join(format!("worker-{i}.log"))).0
        })
        .collect();
    wait_for("3 live workers", Duration::from_secs(30), || {
        let live = status(&master)["workers"].as_array()?.iter().filter(|w| w["live"] == true).count();
        (live == 3).then_some(())
    });
    let uri = format!("file://{}", ufs.display());
    let out = run_against(
        &master,
        &["mount", "add", "/data", &uri, "-o", "block_size=1MiB", "-o", "metadata_ttl=600s"],
    );
    assert!(out.status.success(), "mount add: {}", String::from_utf8_lossy(&out.stderr));

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let mut client_config = ClientConfig::new(master.clone());
    client_config.token =
        Some(Token(std::fs::read_to_string(admin_token_file()).unwrap().trim().to_string()));
    client_config.sidecar_socket = None;
    let client = rt.block_on(Client::connect(client_config)).unwrap();
    let (_, failed) = rt.block_on(read_all_files(&client, &files));
    assert!(failed.is_empty(), "cold reads failed: {failed:?}");

    let frozen_id = std::fs::read_to_string(dir.path().join("worker-0").join("worker-id")).unwrap();
    let frozen_id = frozen_id.trim();
    signal(&workers[0], "-STOP");
    let frozen_at = Instant::now();
    let mut slowest = Duration::ZERO;
    let mut reads = 0;
    let mut reported_suspect = false;
    // Read through the freeze for a few seconds: the hedges of the first reads, the client's
    // own suspicion, then the master's (after 3 missed heartbeats) and its expiry and probes.
    while frozen_at.elapsed() < Duration::from_secs(6) || !reported_suspect {
        assert!(frozen_at.elapsed() < Duration::from_secs(30), "the master never reported the frozen worker");
        let (slow, failed) = rt.block_on(read_all_files(&client, &files));
        assert!(failed.is_empty(), "reads failed with a frozen worker: {failed:?}");
        slowest = slowest.max(slow);
        reads += FILES;
        reported_suspect = reported_suspect || worker_state(&master, frozen_id) == Some((true, true));
    }
    eprintln!("{reads} reads with a frozen worker, slowest {slowest:?}, {} hedged", client.hedged_reads());
    assert!(client.hedged_reads() > 0, "the frozen worker's reads were hedged");
    assert!(slowest < Duration::from_secs(1), "a read waited {slowest:?} on the frozen worker");

    // Thawed, it heartbeats again and is trusted again; reads stay correct throughout.
    signal(&workers[0], "-CONT");
    wait_for("the thawed worker to be trusted", Duration::from_secs(30), || {
        (worker_state(&master, frozen_id) == Some((true, false))).then_some(())
    });
    let (_, failed) = rt.block_on(read_all_files(&client, &files));
    assert!(failed.is_empty(), "reads after the thaw failed: {failed:?}");
}
