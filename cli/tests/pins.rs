//! Pins in force when `strata pin` answers, with real processes: a master and three workers,
//! one of them frozen with SIGSTOP while the pin is issued. The command must say which worker
//! has not applied it, and the pin must hold on the others through a scan of the whole cache.

use std::io::{Read, Write};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use strata_client::{Client, ClientConfig, Token};

use crate::common;
use common::{
    Proc, admin_token_file, master_args, run_against, spawn_logged, ufs_files, wait_for, worker_args,
};

const MIB: usize = 1 << 20;

fn json(master: &str, args: &[&str]) -> Value {
    let out = run_against(master, args);
    serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
}

fn signal(proc: &Proc, sig: &str) {
    let ok = Command::new("kill").args([sig, &proc.0.id().to_string()]).status().unwrap().success();
    assert!(ok, "kill {sig}");
}

/// A counter of a worker's own `/metrics` (summed over its labels), read now.
fn metric(http_addr: &str, name: &str) -> f64 {
    let mut s = std::net::TcpStream::connect(http_addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    body.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The workers holding a cached block of `path`, by the master's block map.
fn holders(master: &str, path: &str) -> Vec<String> {
    json(master, &["locate", path, "--json"])["workers"]
        .as_array()
        .map(|ws| ws.iter().filter_map(|w| w["worker_id"].as_str().map(String::from)).collect())
        .unwrap_or_default()
}

#[test]
fn a_pin_issued_while_a_worker_is_frozen_says_so_and_holds_on_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let ufs = dir.path().join("ufs");
    let hot = ufs_files(&ufs.join("hot"), 6, MIB, 1);
    let cold = ufs_files(&ufs.join("cold"), 60, MIB, 100);
    let config = dir.path().join("master.toml");
    // The frozen worker stays live (on the ring, owed the pin) for the whole test.
    std::fs::write(&config, "worker_timeout_ms = 60000\nheartbeat_interval_ms = 500\n").unwrap();
    let args = master_args(&config, &dir.path().join("master"));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (_master, master) = spawn_logged(&args, "master listening on ", &dir.path().join("master.log"));
    let workers: Vec<Proc> = (0..3)
        .map(|i| {
            let args = worker_args(&master, &dir.path().join(format!("worker-{i}")), "2MiB", "6MiB");
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            spawn_logged(&args, " serving data on ", &dir.path().join(format!("worker-{i}.log"))).0
        })
        .collect();
    let ids: Vec<String> = (0..3)
        .map(|i| {
            std::fs::read_to_string(dir.path().join(format!("worker-{i}/worker-id"))).unwrap().trim().into()
        })
        .collect();
    let http: Vec<String> = wait_for("3 live workers", Duration::from_secs(30), || {
        let status = json(&master, &["status", "--json"]);
        let ws = status["workers"].as_array()?;
        let addr = |id: &str| {
            ws.iter().find(|w| w["id"] == id && w["live"] == true)?["http_addr"].as_str().map(String::from)
        };
        ids.iter().map(|id| addr(id)).collect::<Option<Vec<String>>>()
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
    let read = |dir: &str, files: &[Vec<u8>]| {
        rt.block_on(async {
            for (i, data) in files.iter().enumerate() {
                let got = client.read_all(&format!("/data/{dir}/f{i}.bin")).await.unwrap();
                assert!(got[..] == data[..], "/data/{dir}/f{i}.bin");
            }
        })
    };
    read("hot", &hot);
    // Which worker holds each hot file (one block each), once the block map has heard.
    let held_by: Vec<String> = (0..hot.len())
        .map(|i| {
            wait_for("the block map to list a hot file", Duration::from_secs(30), || {
                holders(&master, &format!("/data/hot/f{i}.bin")).into_iter().next()
            })
        })
        .collect();
    let on_others: Vec<usize> = (0..hot.len()).filter(|&i| held_by[i] != ids[0]).collect();
    assert!(!on_others.is_empty(), "some hot file is held by a worker that stays up: {held_by:?}");

    signal(&workers[0], "-STOP");
    let pin = run_against(&master, &["pin", "/data/hot", "--wait", "3s"]);
    let said = String::from_utf8_lossy(&pin.stderr).into_owned();
    assert!(pin.status.success(), "{said}");
    assert!(said.contains("in force on 2 of 3 workers"), "{said}");
    assert!(
        said.contains("not in force yet on 1 of 3") && said.contains(&ids[0]),
        "names the frozen worker: {said}"
    );

    let ufs_bytes_before: f64 = http[1..].iter().map(|h| metric(h, "strata_worker_ufs_bytes_total")).sum();
    // A scan of ten times the cluster's cache, read around the frozen worker.
    read("cold", &cold);
    let ufs_bytes_scan: f64 = http[1..].iter().map(|h| metric(h, "strata_worker_ufs_bytes_total")).sum();
    assert!(
        ufs_bytes_scan - ufs_bytes_before >= (40 * MIB) as f64,
        "the scan went through the others' caches"
    );
    rt.block_on(async {
        for &i in &on_others {
            let got = client.read_all(&format!("/data/hot/f{i}.bin")).await.unwrap();
            assert!(got[..] == hot[i][..]);
        }
    });
    let ufs_bytes_after: f64 = http[1..].iter().map(|h| metric(h, "strata_worker_ufs_bytes_total")).sum();
    assert_eq!(
        ufs_bytes_after, ufs_bytes_scan,
        "the pinned files held by live workers were kept through the scan"
    );
    signal(&workers[0], "-CONT");
}
