//! Failover time of HA masters: three `strata master` processes on one etcd (both started
//! here on 127.0.0.1), the leader killed with SIGKILL, and the time until the first write
//! (an `AddMount`) succeeds on the new leader, through a client given the three masters. The
//! killed master is started again before the next run, so every run starts from three.
//!
//!   cargo build --release --bin strata --bin failover_bench
//!   target/release/failover_bench --runs 5 [--lease-ms 5000] [--etcd /usr/bin/etcd]
//!
//! Not in CI: it needs etcd and takes about (lease + a few s) per run.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use strata_bench::load_average;

use clap::Parser;
use strata_client::{Client, ClientConfig};

#[derive(Parser)]
struct Args {
    /// Leader kills to time.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// The masters' leader lease (leader_lease_ms), ms.
    #[arg(long, default_value_t = 5000)]
    lease_ms: u64,
    /// etcd binary.
    #[arg(long, default_value = "etcd")]
    etcd: PathBuf,
    /// strata binary (default: next to this one).
    #[arg(long)]
    strata: Option<PathBuf>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_master(strata: &Path, dir: &Path, addr: &str, meta: &str, lease_ms: u64) -> Proc {
    let config = dir.join(format!("{}.toml", addr.replace(':', "-")));
    std::fs::write(&config, format!("leader_lease_ms = {lease_ms}\n")).unwrap();
    let mut child = Command::new(strata)
        .args(["master", "--http-addr", "127.0.0.1:0", "--rpc-addr", addr, "--meta", meta, "--config"])
        .arg(&config)
        .arg("--data-dir")
        .arg(dir.join(addr.replace(':', "-")))
        // One admin token for the three masters, as a Kubernetes Secret gives them: the first
        // master creates the file, the others read it.
        .arg("--admin-token-file")
        .arg(dir.join("admin.token"))
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start strata master");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(matches!(lines.next(), Some(Ok(l)) if l.contains("master listening on")), "master did not start");
    std::thread::spawn(move || for _ in lines {});
    Proc(child)
}

fn etcd_healthy(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else { return false };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let mut out = String::new();
    write!(s, "GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").is_ok()
        && s.read_to_string(&mut out).is_ok()
        && out.contains("\"health\":\"true\"")
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let strata =
        args.strata.clone().unwrap_or_else(|| std::env::current_exe().unwrap().with_file_name("strata"));
    let dir = tempfile::tempdir().unwrap();
    let (client_port, peer_port) = (free_port(), free_port());
    let client_url = format!("http://127.0.0.1:{client_port}");
    let peer_url = format!("http://127.0.0.1:{peer_port}");
    let _etcd = Proc(
        Command::new(&args.etcd)
            .args(["--name", "m0", "--data-dir"])
            .arg(dir.path().join("etcd"))
            .args(["--listen-client-urls", &client_url, "--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("m0={peer_url}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcd"),
    );
    let meta = format!("etcd://127.0.0.1:{client_port}");
    let addrs: Vec<String> = (0..3).map(|_| format!("127.0.0.1:{}", free_port())).collect();
    // A master that finds etcd absent exits: wait for etcd to answer first.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !etcd_healthy(client_port) {
        assert!(Instant::now() < deadline, "etcd did not become healthy");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut masters: Vec<Option<Proc>> = addrs
        .iter()
        .map(|addr| Some(start_master(&strata, dir.path(), addr, &meta, args.lease_ms)))
        .collect();
    let list = addrs.join(",");
    let mut config = ClientConfig::new(list.clone());
    let token = strata_security_token(&dir.path().join("admin.token"));
    config.token = Some(strata_client::Token(token));
    let client = Client::connect(config).await.expect("client");
    let ufs = dir.path().join("ufs");
    std::fs::create_dir_all(&ufs).unwrap();
    let uri = format!("file://{}", ufs.display());
    client.admin().add_mount("/warm", &uri, Default::default()).await.expect("first write");

    println!(
        "failover: leader SIGKILL -> first successful AddMount on the new leader (lease {} ms)",
        args.lease_ms
    );
    let mut times = Vec::new();
    for run in 0..args.runs {
        let leader = client.admin().status().await.expect("status").leader;
        let i = addrs.iter().position(|a| *a == leader).expect("the leader is one of ours");
        let killed_at = Instant::now();
        masters[i] = None; // SIGKILL
        let path = format!("/run{run}");
        loop {
            if client.admin().add_mount(&path, &uri, Default::default()).await.is_ok() {
                break;
            }
            assert!(killed_at.elapsed() < Duration::from_secs(60), "no write within 60 s");
        }
        let took = killed_at.elapsed();
        let new = client.admin().status().await.expect("status").leader;
        println!(
            "run {run}: {:.2} s ({leader} -> {new}), load average {}",
            took.as_secs_f64(),
            load_average()
        );
        times.push(took.as_secs_f64());
        masters[i] = Some(start_master(&strata, dir.path(), &addrs[i], &meta, args.lease_ms));
    }
    times.sort_by(f64::total_cmp);
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    println!(
        "failover over {} runs: min {:.2} s, median {:.2} s, max {:.2} s, mean {:.2} s; load average {} (nproc {})",
        times.len(),
        times[0],
        times[times.len() / 2],
        times[times.len() - 1],
        mean,
        load_average(),
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
    );
}

fn strata_security_token(path: &Path) -> String {
    std::fs::read_to_string(path).expect("the first master wrote the admin token").trim().to_string()
}
