//! `strata worker --drain` with real processes: a master, two workers on a local-dir mount; the
//! worker started with `--drain` gets SIGTERM, hands its blocks to the other, and exits 0.

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;
use strata_client::{Client, ClientConfig, Token};

use crate::common;
use common::{admin_token_file, master_args, run_against, spawn_logged, ufs_files, wait_for, worker_args};

const FILES: usize = 30;
const FILE_LEN: usize = 256 * 1024;

fn worker_status(master: &str, id: &str) -> Option<Value> {
    let out = run_against(master, &["status", "--json"]);
    let status: Value = serde_json::from_slice(&out.stdout).ok()?;
    status["workers"].as_array()?.iter().find(|w| w["id"] == id).cloned()
}

async fn read_all_files(client: &Client, files: &[Vec<u8>]) {
    for (i, data) in files.iter().enumerate() {
        let path = format!("/data/f{i}.bin");
        assert_eq!(client.read_all(&path).await.unwrap()[..], data[..], "{path}");
    }
}

#[test]
fn a_worker_started_with_drain_hands_its_blocks_off_on_sigterm_and_exits_0() {
    let dir = tempfile::tempdir().unwrap();
    let ufs = dir.path().join("ufs");
    let files = ufs_files(&ufs, FILES, FILE_LEN, 31);
    let config = dir.path().join("master.toml");
    std::fs::write(&config, "worker_timeout_ms = 60000\nheartbeat_interval_ms = 200\n").unwrap();
    let args = master_args(&config, &dir.path().join("master"));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (_master, master) = spawn_logged(&args, "master listening on ", &dir.path().join("master.log"));
    let mut draining_args = worker_args(&master, &dir.path().join("worker-0"), "64MiB", "64MiB");
    draining_args.extend(["--drain", "--drain-timeout", "60s"].map(String::from));
    let draining_args: Vec<&str> = draining_args.iter().map(String::as_str).collect();
    let drain_log = dir.path().join("worker-0.log");
    let (mut leaving, leaving_id) = spawn_logged(&draining_args, "worker ", &drain_log);
    let staying_args = worker_args(&master, &dir.path().join("worker-1"), "64MiB", "64MiB");
    let staying_args: Vec<&str> = staying_args.iter().map(String::as_str).collect();
    let (_staying, staying_id) = spawn_logged(&staying_args, "worker ", &dir.path().join("worker-1.log"));
    wait_for("2 live workers", Duration::from_secs(30), || {
        let both = [&leaving_id, &staying_id]
            .iter()
            .all(|id| worker_status(&master, id).is_some_and(|w| w["live"] == true));
        both.then_some(())
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
    rt.block_on(read_all_files(&client, &files));
    let held = wait_for("the leaving worker's blocks reported", Duration::from_secs(30), || {
        let a = worker_status(&master, &leaving_id)?["blocks"].as_u64()?;
        let b = worker_status(&master, &staying_id)?["blocks"].as_u64()?;
        (a + b == FILES as u64 && a > 0).then_some(a)
    });

    let started = Instant::now();
    let ok = Command::new("kill").args(["-TERM", &leaving.0.id().to_string()]).status().unwrap().success();
    assert!(ok, "kill -TERM");
    let exit =
        wait_for("the drained worker to exit", Duration::from_secs(60), || leaving.0.try_wait().unwrap());
    let took = started.elapsed();
    let log = std::fs::read_to_string(&drain_log).unwrap_or_default();
    assert!(exit.success(), "a drained worker exits 0 ({exit:?}); its log:\n{log}");
    assert!(log.contains("drain finished"), "the drain went through every block; its log:\n{log}");

    // Every block is on the remaining worker, and a full re-read takes none from the UFS.
    let before = wait_for("the handed-off blocks reported", Duration::from_secs(30), || {
        let w = worker_status(&master, &staying_id)?;
        (w["blocks"].as_u64()? == FILES as u64).then_some(w)
    });
    client_refresh(&rt, &client);
    rt.block_on(read_all_files(&client, &files));
    let after = wait_for("the re-read counted", Duration::from_secs(30), || {
        let w = worker_status(&master, &staying_id)?;
        let hits = |w: &Value| w["cache_hits"].as_u64().unwrap_or(0);
        (hits(&w) >= hits(&before) + FILES as u64).then_some(w)
    });
    let refetched = after["ufs_reads"].as_u64().unwrap() - before["ufs_reads"].as_u64().unwrap();
    eprintln!(
        "drain (processes): {held} blocks handed off, exit 0 after {took:?}; the re-read cost {refetched} UFS reads"
    );
    assert_eq!(refetched, 0, "the remaining worker had every block");
}

fn client_refresh(rt: &tokio::runtime::Runtime, client: &Client) {
    rt.block_on(client.refresh_view()).unwrap();
}
