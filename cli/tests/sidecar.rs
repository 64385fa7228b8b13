//! Sidecar mode end to end: an in-process cluster (master + 2 workers), a `strata worker
//! --sidecar` child process on a Unix socket, and `strata cat` child processes that reach the
//! data only through that socket.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use std::time::{Duration, Instant};

use strata_testkit::{Cluster, ClusterOptions, pattern};

fn strata() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_strata"));
    c.env_remove("STRATA_MASTER").env_remove("STRATA_SIDECAR_SOCKET").env("RUST_LOG", "warn");
    c
}

struct Sidecar {
    child: Child,
    http: String,
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A sidecar process presenting the worker token in `token_file`.
fn start_sidecar(master: &str, socket: &Path, dir: &Path, token_file: &Path) -> Sidecar {
    let mut child = strata()
        .args(["--master", master, "worker", "--sidecar", "--http-addr", "127.0.0.1:0"])
        .arg("--token-file")
        .arg(token_file)
        .args(["--memory", "64MiB", "--nvme", "0"])
        .arg("--socket")
        .arg(socket)
        .arg("--data-dir")
        .arg(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let deadline = Instant::now() + Duration::from_secs(30);
    let http = loop {
        assert!(Instant::now() < deadline, "sidecar did not start");
        match lines.next() {
            Some(Ok(line)) if line.starts_with("sidecar serving data on unix:") => {
                let http = line.rsplit_once("(http ").unwrap().1.trim_end_matches(')');
                break http.to_string();
            }
            Some(Ok(_)) => {}
            _ => panic!("sidecar exited before starting: {:?}", child.try_wait()),
        }
    };
    std::thread::spawn(move || for _ in lines {});
    Sidecar { child, http }
}

/// Sum of every series of a counter in the Prometheus text of `http`'s /metrics.
fn metric(http: &str, name: &str) -> f64 {
    let mut stream = std::net::TcpStream::connect(http).unwrap();
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: {http}\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    text.lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{')))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `strata cat PATH` in a child process with the sidecar socket in its environment.
async fn cat(master: &str, token_file: &Path, socket: &Path, path: &str) -> Vec<u8> {
    let mut cmd = strata();
    cmd.args(["--master", master, "cat", path])
        .env("STRATA_SIDECAR_SOCKET", socket)
        .env("STRATA_TOKEN_FILE", token_file);
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap()).await.unwrap();
    assert!(out.status.success(), "cat failed: {}", String::from_utf8_lossy(&out.stderr));
    out.stdout
}

fn served_by_cluster(cluster: &Cluster, workers: &[usize]) -> u64 {
    workers.iter().map(|&i| cluster.worker(i).blocks.counters().bytes_served).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecar_serves_the_pod_over_its_socket_from_the_cluster_then_its_own_tier_then_the_ufs() {
    let mut cluster = Cluster::start(ClusterOptions { workers: 2, ..ClusterOptions::default() }).await;
    let size = 5 * (1 << 20) + 12_345; // 6 blocks of 1 MiB
    let data = pattern(size, 7);
    cluster.write_file("train/shard-0.bin", &data);
    cluster.write_file("train/shard-1.bin", &pattern(300_000, 8));
    let master = cluster.master_addr();
    let admin = cluster.admin_token_file().expect("auth on");
    let tmp = tempfile::tempdir().unwrap();
    let socket: PathBuf = tmp.path().join("run/strata.sock");

    // No sidecar at the configured socket: the client falls back to the cluster over TCP.
    let direct = cat(&master, &admin, &socket, "/data/train/shard-1.bin").await;
    assert!(direct == pattern(300_000, 8), "fallback read returned other bytes");
    let served_before = served_by_cluster(&cluster, &[0, 1]);
    assert_eq!(served_before, 300_000);

    let sidecar =
        start_sidecar(&master, &socket, &tmp.path().join("sidecar"), &cluster.worker_token_file().unwrap());
    assert!(socket.exists());

    // First read: every block misses the sidecar, which fetches it once from its cluster owner
    // (not the UFS), keeps it, and serves it over the socket.
    let first = cat(&master, &admin, &socket, "/data/train/shard-0.bin").await;
    assert!(first == data, "first read through the sidecar returned other bytes");
    assert_eq!(metric(&sidecar.http, "strata_worker_upstream_reads_total"), 6.0);
    assert_eq!(metric(&sidecar.http, "strata_worker_ufs_reads_total"), 0.0);
    assert_eq!(metric(&sidecar.http, "strata_worker_bytes_served_total"), size as f64);
    // The cluster sent each block once, to the sidecar; the client never read from it.
    assert_eq!(served_by_cluster(&cluster, &[0, 1]) - served_before, size as u64);
    let ufs_reads = cluster.ufs_reads();

    // With the cluster's workers gone there is no TCP route to any data: the second read can
    // only come from the sidecar's own tier.
    cluster.kill_worker(0).await;
    cluster.kill_worker(1).await;
    let second = cat(&master, &admin, &socket, "/data/train/shard-0.bin").await;
    assert!(second == data, "second read through the sidecar returned other bytes");
    assert_eq!(metric(&sidecar.http, "strata_worker_cache_hits_total"), 6.0);
    assert_eq!(metric(&sidecar.http, "strata_worker_upstream_reads_total"), 6.0);
    assert_eq!(metric(&sidecar.http, "strata_worker_bytes_served_total"), 2.0 * size as f64);
    assert_eq!(cluster.ufs_reads(), ufs_reads, "the UFS was read again");

    // A block the sidecar does not hold while the cluster cannot serve: the sidecar reads the
    // UFS itself.
    let other = cat(&master, &admin, &socket, "/data/train/shard-1.bin").await;
    assert!(other == pattern(300_000, 8), "UFS fallback through the sidecar returned other bytes");
    assert_eq!(metric(&sidecar.http, "strata_worker_upstream_errors_total"), 1.0);
    assert_eq!(metric(&sidecar.http, "strata_worker_ufs_reads_total"), 1.0);
    drop(sidecar);
}
