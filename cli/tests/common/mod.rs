//! What the CLI's real-process tests share: the `strata` command with the shared test tokens,
//! child processes killed when dropped, and waiting on a condition with a deadline.
//!
//! Each test file is its own crate and uses only part of this.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The admin token every cluster of these tests starts with (one file per test run).
pub fn admin_token_file() -> PathBuf {
    strata_testkit::shared_token_file("admin.token")
}

/// The worker token every cluster of these tests starts with.
pub fn worker_token_file() -> PathBuf {
    strata_testkit::shared_token_file("worker.token")
}

/// `strata` with the shared tokens (a master started with it bootstraps them, a client presents
/// the admin token), nothing of the caller's environment that would point it elsewhere, and
/// `RUST_LOG=warn`.
pub fn strata() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_strata"));
    c.env_remove("STRATA_MASTER")
        .env_remove("STRATA_TOKEN")
        .env("STRATA_TOKEN_FILE", admin_token_file())
        .env("STRATA_MASTER_ADMIN_TOKEN_FILE", admin_token_file())
        .env("STRATA_MASTER_WORKER_TOKEN_FILE", worker_token_file())
        .env_remove("STRATA_SIDECAR_SOCKET")
        .env_remove("STRATA_WORKERS")
        .env_remove("STRATA_MASTER_OUTAGE_GRACE")
        .env("RUST_LOG", "warn");
    c
}

/// A port free at the time of the call, for a server that must be told its address up front.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A child process, killed (SIGKILL, which also ends a stopped one) when dropped.
pub struct Proc(pub Child);

impl Proc {
    pub fn kill9(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Spawns `cmd` (stdout piped, stderr to `stderr`) and returns it with the first word after
/// `prefix` on its stdout; the rest of stdout is drained so the child never blocks on it.
pub fn spawn_until(mut cmd: Command, prefix: &str, stderr: impl Into<Stdio>) -> (Proc, String) {
    let what = format!("{cmd:?}");
    let mut child = cmd.stdout(Stdio::piped()).stderr(stderr).spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let deadline = Instant::now() + Duration::from_secs(30);
    let found = loop {
        assert!(Instant::now() < deadline, "{what} did not start");
        match lines.next() {
            Some(Ok(line)) => {
                if let Some(i) = line.find(prefix) {
                    break line[i + prefix.len()..].split_whitespace().next().unwrap().to_string();
                }
            }
            _ => panic!("{what} exited before starting"),
        }
    };
    std::thread::spawn(move || for _ in lines {});
    (Proc(child), found)
}

/// Polls `f` until it returns `Some`, or panics with `what` after `timeout`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `strata master` arguments: the config file, ports picked at run time, the data directory.
pub fn master_args(config: &std::path::Path, data_dir: &std::path::Path) -> Vec<String> {
    let mut args = vec!["master".to_string(), "--config".into(), config.display().to_string()];
    args.extend(["--rpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--data-dir"].map(String::from));
    args.push(data_dir.display().to_string());
    args
}

/// `strata worker` arguments for the master at `master`: ports picked at run time, the data
/// directory, the tier sizes and the shared worker token.
pub fn worker_args(master: &str, data_dir: &std::path::Path, memory: &str, nvme: &str) -> Vec<String> {
    let mut args = vec!["--master".to_string(), master.to_string(), "worker".into()];
    args.extend(["--data-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--data-dir"].map(String::from));
    args.push(data_dir.display().to_string());
    args.extend(["--memory".to_string(), memory.to_string(), "--nvme".into(), nvme.to_string()]);
    args.extend(["--token-file".to_string(), worker_token_file().display().to_string()]);
    args
}

/// Spawns `strata ARGS` (stderr appended to `log`) and returns it with the first word after
/// `prefix` on its stdout.
pub fn spawn_logged(args: &[&str], prefix: &str, log: &std::path::Path) -> (Proc, String) {
    let log = std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap();
    let mut cmd = strata();
    cmd.args(args);
    spawn_until(cmd, prefix, log)
}

/// `strata --master MASTER ARGS`, run to completion (the shared admin token via `strata()`).
pub fn run_against(master: &str, args: &[&str]) -> std::process::Output {
    strata().arg("--master").arg(master).args(args).output().unwrap()
}

/// Writes `n` files `f{i}.bin` of `len` bytes (`pattern(len, seed + i)`) into the directory
/// `ufs`, creating it; returns their bytes.
pub fn ufs_files(ufs: &std::path::Path, n: usize, len: usize, seed: u64) -> Vec<Vec<u8>> {
    std::fs::create_dir_all(ufs).unwrap();
    (0..n)
        .map(|i| {
            let data = strata_testkit::pattern(len, seed + i as u64);
            std::fs::write(ufs.join(format!("f{i}.bin")), &data).unwrap();
            data
        })
        .collect()
}
