//! The `strata` binary end to end: a standalone cluster in a child process, client commands
//! against it, their output and exit codes.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common;
use common::free_port;

fn strata() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_strata"));
    c.env_remove("STRATA_MASTER")
        .env_remove("STRATA_TOKEN")
        .env_remove("STRATA_TOKEN_FILE")
        .env_remove("STRATA_DIR")
        .env("RUST_LOG", "warn");
    c
}

/// The admin token file of the standalone serving each master address these tests started.
static TOKEN_FILES: std::sync::Mutex<Vec<(String, std::path::PathBuf)>> = std::sync::Mutex::new(Vec::new());

fn token_file_of(master: &str) -> Option<std::path::PathBuf> {
    TOKEN_FILES.lock().unwrap().iter().rev().find(|(m, _)| m == master).map(|(_, f)| f.clone())
}

struct Standalone(Child);

impl Drop for Standalone {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_standalone(dir: &Path, master: &str, mount: &str) -> Standalone {
    let mut cmd = strata();
    cmd.stderr(Stdio::null());
    start_standalone_with(cmd, dir, master, mount)
}

/// A standalone started from `cmd` (its environment and stderr as the caller set them).
fn start_standalone_with(cmd: Command, dir: &Path, master: &str, mount: &str) -> Standalone {
    start_standalone_with_extra(cmd, dir, master, mount, &[])
}

/// [`start_standalone_with`], with `extra` arguments to `standalone`.
fn start_standalone_with_extra(
    mut cmd: Command,
    dir: &Path,
    master: &str,
    mount: &str,
    extra: &[&std::ffi::OsStr],
) -> Standalone {
    let mut child = cmd
        .args(["--master", master, "standalone", "--memory", "64MiB", "--nvme", "256MiB", "--mount", mount])
        .arg("--dir")
        .arg(dir)
        .args(extra)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        assert!(Instant::now() < deadline, "standalone did not start");
        match lines.next() {
            Some(Ok(line)) if line.contains("strata standalone is running") => break,
            Some(Ok(_)) => {}
            _ => panic!("standalone exited before starting: {:?}", child.try_wait()),
        }
    }
    // Keep draining stdout so the child never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    TOKEN_FILES.lock().unwrap().push((master.to_string(), dir.join("admin.token")));
    Standalone(child)
}

/// A client command against `master`, presenting the admin token of the standalone serving it.
fn run(master: &str, args: &[&str]) -> Output {
    let mut cmd = strata();
    if let Some(file) = token_file_of(master) {
        cmd.env("STRATA_TOKEN_FILE", file);
    }
    cmd.arg("--master").arg(master).args(args).output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn standalone_serves_the_cli_and_reports_clear_errors() {
    let state = tempfile::tempdir().unwrap();
    let ufs = tempfile::tempdir().unwrap();
    let data: Vec<u8> = (0..5_000_000u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    std::fs::create_dir(ufs.path().join("sub")).unwrap();
    std::fs::write(ufs.path().join("sub/blob.bin"), &data).unwrap();
    let master = format!("127.0.0.1:{}", free_port());
    let mount = format!("/d=file://{}", ufs.path().display());
    let node = start_standalone(state.path(), &master, &mount);

    let cat = run(&master, &["cat", "/d/sub/blob.bin"]);
    assert!(cat.status.success(), "{}", stderr(&cat));
    assert!(cat.stdout == data, "cat returned other bytes");
    // The address also comes from STRATA_MASTER.
    let again = strata()
        .env("STRATA_MASTER", &master)
        .env("STRATA_TOKEN_FILE", token_file_of(&master).unwrap())
        .args(["cat", "/d/sub/blob.bin"])
        .output()
        .unwrap();
    assert!(again.status.success() && again.stdout == data);

    let stat = run(&master, &["stat", "--json", "/d/sub/blob.bin"]);
    let v: serde_json::Value = serde_json::from_slice(&stat.stdout).unwrap();
    assert_eq!(v["size"], 5_000_000);
    assert_eq!(v["is_dir"], false);
    let ls = run(&master, &["ls", "/d/sub"]);
    assert!(String::from_utf8_lossy(&ls.stdout).contains("blob.bin"));

    let out = tempfile::tempdir().unwrap();
    let cp = run(&master, &["cp", "/d/sub/blob.bin", out.path().to_str().unwrap()]);
    assert!(cp.status.success(), "{}", stderr(&cp));
    assert!(std::fs::read(out.path().join("blob.bin")).unwrap() == data);

    // Two cats and a cp of a 2-block file: 2 misses, then hits; the UFS was read once.
    // One heartbeat carries the counters: poll the status until it has.
    let deadline = Instant::now() + Duration::from_secs(30);
    let s = loop {
        let status = run(&master, &["status", "--json"]);
        assert!(status.status.success(), "{}", stderr(&status));
        let s: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
        let seen = |k: &str| s["totals"][k].as_u64().unwrap_or(0);
        if (seen("cache_misses") >= 2 && seen("cache_hits") >= 4) || Instant::now() > deadline {
            break s;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(s["totals"]["cache_misses"], 2, "{s}");
    assert_eq!(s["totals"]["cache_hits"], 4, "{s}");
    assert_eq!(s["totals"]["ufs_bytes_read"], 5_000_000, "{s}");
    assert_eq!(s["workers"][0]["ufs_bytes_read"], 5_000_000, "{s}");
    assert_eq!(s["workers"][0]["live"], true);

    for (args, expected) in [
        (vec!["cat", "/d/sub/missing.bin"], "not found"),
        (vec!["cat", "/nowhere/x"], "not under any mount"),
        (vec!["cat", "relative/x"], "not absolute"),
        (vec!["cat", "/d/../etc/passwd"], ".."),
        (vec!["cat", "/d/sub"], "is a directory"),
        (vec!["mount", "add", "/bad", "ftp://host/x"], "unsupported"),
        (vec!["mount", "add", "/d/inner", "file:///tmp"], "nest"),
        (vec!["mount", "add", "/m", "file:///tmp", "-o", "block_size=12"], "block_size"),
    ] {
        let o = run(&master, &args);
        assert!(!o.status.success(), "{args:?} should fail");
        assert!(stderr(&o).contains(expected), "{args:?}: {}", stderr(&o));
    }
    let o = run(&format!("127.0.0.1:{}", free_port()), &["status"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("master"), "{}", stderr(&o));

    // Mounts survive a restart of the whole node.
    let o = run(&master, &["mount", "add", "/extra", &format!("file://{}", ufs.path().display())]);
    assert!(o.status.success(), "{}", stderr(&o));
    drop(node);
    let _node = start_standalone(state.path(), &master, &mount);
    let ls = run(&master, &["mount", "ls", "--json"]);
    let mounts: serde_json::Value = serde_json::from_slice(&ls.stdout).unwrap();
    let paths: Vec<&str> = mounts.as_array().unwrap().iter().map(|m| m["path"].as_str().unwrap()).collect();
    assert_eq!(paths, vec!["/d", "/extra"]);
    let cat = run(&master, &["cat", "/extra/sub/blob.bin"]);
    assert!(cat.status.success() && cat.stdout == data);
}

/// `strata locate` names the worker holding a path's blocks and the node it reported
/// (`STRATA_NODE`), as a table and as JSON; a path under no mount fails clearly.
#[test]
fn locate_reports_the_worker_and_node_holding_a_path() {
    let state = tempfile::tempdir().unwrap();
    let ufs = tempfile::tempdir().unwrap();
    std::fs::create_dir(ufs.path().join("sub")).unwrap();
    std::fs::write(ufs.path().join("sub/a.bin"), vec![7u8; 5_000_000]).unwrap();
    std::fs::write(ufs.path().join("sub/b.bin"), vec![8u8; 1_000]).unwrap();
    let master = format!("127.0.0.1:{}", free_port());
    let mount = format!("/d=file://{}", ufs.path().display());
    let mut cmd = strata();
    cmd.stderr(Stdio::null()).env("STRATA_NODE", "rack1-node7");
    let _node = start_standalone_with(cmd, state.path(), &master, &mount);

    let help = run(&master, &["locate", "--help"]);
    assert!(String::from_utf8_lossy(&help.stdout).contains("block map"), "{}", stderr(&help));
    let cat = run(&master, &["cat", "/d/sub/a.bin"]);
    assert!(cat.status.success(), "{}", stderr(&cat));

    // Blocks reach the block map with the next heartbeat.
    let deadline = Instant::now() + Duration::from_secs(30);
    let v = loop {
        let o = run(&master, &["locate", "--json", "/d/sub"]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        if v["cached_blocks"] == 2 || Instant::now() > deadline {
            break v;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!((v["files"].as_u64(), v["blocks"].as_u64()), (Some(2), Some(3)), "{v}");
    assert_eq!((v["cached_blocks"].as_u64(), v["cached_bytes"].as_u64()), (Some(2), Some(5_000_000)), "{v}");
    assert_eq!(v["workers"].as_array().map(Vec::len), Some(1), "{v}");
    assert_eq!(v["workers"][0]["node"], "rack1-node7", "{v}");
    assert_eq!(
        (v["workers"][0]["blocks"].as_u64(), v["workers"][0]["bytes"].as_u64()),
        (Some(2), Some(5_000_000))
    );

    let o = run(&master, &["status"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.lines().any(|l| l.starts_with("worker ") && l.contains(" node rack1-node7 ")), "{text}");

    let table = run(&master, &["locate", "/d/sub"]);
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains("WORKER") && text.contains("NODE"), "{text}");
    assert!(text.lines().any(|l| l.contains("rack1-node7") && l.contains("5000000")), "{text}");

    let o = run(&master, &["locate", "/nowhere/x"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("not under any mount"), "{}", stderr(&o));
}

/// `strata standalone --worker-config` tunes its worker from a TOML file, and a file with a key
/// no worker has stops the start with the file and the key named.
#[test]
fn standalone_takes_worker_settings_from_a_file() {
    let state = tempfile::tempdir().unwrap();
    let ufs = tempfile::tempdir().unwrap();
    let master = format!("127.0.0.1:{}", free_port());
    let mount = format!("/d=file://{}", ufs.path().display());
    let bad = state.path().join("bad.toml");
    std::fs::write(&bad, "prefetch_paralelism = 64\n").unwrap();
    let o = strata()
        .args(["--master", &master, "standalone", "--memory", "64MiB", "--nvme", "256MiB", "--mount", &mount])
        .arg("--dir")
        .arg(state.path().join("bad"))
        .arg("--worker-config")
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!o.status.success());
    let said = stderr(&o);
    assert!(said.contains("bad.toml") && said.contains("prefetch_paralelism"), "{said}");
    assert!(std::net::TcpStream::connect(&master).is_err(), "nothing was started");

    let good = state.path().join("worker.toml");
    std::fs::write(&good, "prefetch_parallelism = 32\nnode = \"from-file\"\n").unwrap();
    let mut cmd = strata();
    cmd.stderr(Stdio::null()).env_remove("STRATA_NODE");
    let _node = start_standalone_with_extra(
        cmd,
        &state.path().join("node"),
        &master,
        &mount,
        &["--worker-config".as_ref(), good.as_os_str()],
    );
    let o = run(&master, &["status"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.lines().any(|l| l.starts_with("worker ") && l.contains(" node from-file ")), "{text}");
    std::fs::write(ufs.path().join("a.bin"), vec![3u8; 5_000_000]).unwrap();
    let cat = run(&master, &["cat", "/d/a.bin"]);
    assert!(cat.status.success() && cat.stdout == vec![3u8; 5_000_000], "{}", stderr(&cat));
}

/// `strata ttl` sets, lists and clears a path's cache TTL; `strata stat` shows the pins and
/// the cache TTL in force at a path (the path's own, else its mount's); `strata status` lists
/// a mount with a quota and a TTL and what the workers hold of it.
#[test]
fn ttl_stat_and_status_show_cache_control() {
    let state = tempfile::tempdir().unwrap();
    let ufs = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(ufs.path().join("sub/tmp")).unwrap();
    std::fs::write(ufs.path().join("sub/tmp/a.bin"), vec![7u8; 3_000]).unwrap();
    std::fs::write(ufs.path().join("sub/b.bin"), vec![8u8; 1_000]).unwrap();
    let master = format!("127.0.0.1:{}", free_port());
    let mount = format!("/d=file://{}", ufs.path().display());
    let _node = start_standalone(state.path(), &master, &mount);
    let uri = format!("file://{}/sub", ufs.path().display());
    let o = run(&master, &["mount", "add", "/q", &uri, "-o", "quota=64MiB", "-o", "cache_ttl=7d"]);
    assert!(o.status.success(), "{}", stderr(&o));

    let o = run(&master, &["ttl", "set", "/q/tmp", "6h"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("6h"), "{}", stderr(&o));
    let o = run(&master, &["ttl", "ls", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (v[0]["path"].as_str(), v[0]["cache_ttl_ms"].as_u64()),
        (Some("/q/tmp"), Some(21_600_000)),
        "{v}"
    );
    let o = run(&master, &["pin", "/q/tmp", "--tier", "memory"]);
    assert!(o.status.success(), "{}", stderr(&o));

    let o = run(&master, &["stat", "/q/tmp/a.bin"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("pinned:     memory by /q/tmp"), "{text}");
    assert!(text.contains("cache ttl:  6h (ttl /q/tmp)"), "{text}");
    let o = run(&master, &["stat", "/q/b.bin"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("cache ttl:  7d (mount /q)") && !text.contains("pinned:"), "{text}");
    let o = run(&master, &["stat", "--json", "/q/tmp/a.bin"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["pinned_by"][0]["tier"], "memory", "{v}");
    assert_eq!(v["cache_ttl"]["cache_ttl_ms"], 21_600_000, "{v}");

    let cat = run(&master, &["cat", "/q/b.bin"]);
    assert!(cat.status.success(), "{}", stderr(&cat));
    // The worker reports what it holds of /q with its heartbeats, after its upkeep counted it.
    let deadline = Instant::now() + Duration::from_secs(30);
    let v = loop {
        let o = run(&master, &["status", "--json"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        if v["mount_quotas"][0]["cached_bytes"].as_u64() >= Some(1_000) || Instant::now() > deadline {
            break v;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let q = &v["mount_quotas"][0];
    assert_eq!((q["path"].as_str(), q["quota_bytes"].as_u64()), (Some("/q"), Some(64 << 20)), "{v}");
    assert_eq!(q["cache_ttl_ms"].as_u64(), Some(7 * 86_400_000), "{v}");
    assert!(q["cached_bytes"].as_u64() >= Some(1_000), "{v}");
    let o = run(&master, &["status"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.lines().any(|l| l.starts_with("mount /q: ")
            && l.contains("of quota 67108864")
            && l.contains("cache_ttl 7d")),
        "{text}"
    );

    let o = run(&master, &["ttl", "clear", "/q/tmp"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = run(&master, &["ttl", "clear", "/q/tmp"]);
    assert!(!o.status.success() && stderr(&o).contains("no cache TTL"), "{}", stderr(&o));
    for (args, expected) in [
        (vec!["ttl", "set", "/q/tmp", "soon"], "expected a duration"),
        (vec!["ttl", "set", "/nowhere/x", "1h"], "not under any mount"),
        (vec!["mount", "add", "/bad", "file:///tmp", "-o", "quota=lots"], "quota"),
        (vec!["mount", "add", "/bad", "file:///tmp", "-o", "cache_ttl=0"], "cache_ttl"),
    ] {
        let o = run(&master, &args);
        assert!(!o.status.success(), "{args:?} should fail");
        assert!(stderr(&o).contains(expected), "{args:?}: {}", stderr(&o));
    }
}

/// A log written to a file (`2> strata.log`, a service manager's capture) is plain text: colour
/// codes are for a terminal only.
#[test]
fn a_log_that_is_not_a_terminal_has_no_colour_codes() {
    let state = tempfile::tempdir().unwrap();
    let ufs = tempfile::tempdir().unwrap();
    let log = state.path().join("strata.log");
    let mut cmd = strata();
    cmd.env("RUST_LOG", "info").stderr(std::fs::File::create(&log).unwrap());
    let master = format!("127.0.0.1:{}", free_port());
    let mount = format!("/d=file://{}", ufs.path().display());
    drop(start_standalone_with(cmd, &state.path().join("node"), &master, &mount));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("INFO") && text.contains("mount added"), "RUST_LOG=info is obeyed: {text}");
    assert!(!text.contains('\u{1b}'), "no escape codes: {text:?}");
}

#[test]
fn warmup_loads_a_directory_and_job_commands_report_it() {
    let state = tempfile::tempdir().unwrap();
    let ufs = tempfile::tempdir().unwrap();
    std::fs::create_dir(ufs.path().join("train")).unwrap();
    let mut bytes_total = 0;
    for i in 0..20u32 {
        let data = vec![i as u8; 100_000 + i as usize * 3];
        bytes_total += data.len() as u64;
        std::fs::write(ufs.path().join(format!("train/f{i:02}.bin")), &data).unwrap();
    }
    let master = format!("127.0.0.1:{}", free_port());
    let mount = format!("/d=file://{}", ufs.path().display());
    let _node = start_standalone(state.path(), &master, &mount);

    let dry = run(&master, &["warmup", "--dry-run", "--json", "/d/train"]);
    assert!(dry.status.success(), "{}", stderr(&dry));
    let v: serde_json::Value = serde_json::from_slice(&dry.stdout).unwrap();
    assert_eq!((v["files_total"].as_u64(), v["bytes_total"].as_u64()), (Some(20), Some(bytes_total)));
    assert_eq!(v["blocks_done"], 0, "a dry run loads nothing");

    let warm = run(&master, &["warmup", "--json", "/d/train"]);
    assert!(warm.status.success(), "{}", stderr(&warm));
    let v: serde_json::Value = serde_json::from_slice(&warm.stdout).unwrap();
    assert_eq!(v["state"], "SUCCEEDED", "{v}");
    assert_eq!((v["files_done"].as_u64(), v["bytes_done"].as_u64()), (Some(20), Some(bytes_total)));
    let id = v["id"].as_str().unwrap().to_string();

    let status = run(&master, &["job", "status", "--json", &id]);
    assert!(status.status.success(), "{}", stderr(&status));
    let s: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!((s["id"].as_str(), s["state"].as_str()), (Some(id.as_str()), Some("SUCCEEDED")));
    let history = run(&master, &["job", "history"]);
    assert!(String::from_utf8_lossy(&history.stdout).contains(&id), "history lists the job");

    // Detached: the id at once, then the job can be followed with `job status`.
    let detached = run(&master, &["warmup", "--detach", "--json", "/d/train/f03.bin"]);
    assert!(detached.status.success(), "{}", stderr(&detached));
    let d: serde_json::Value = serde_json::from_slice(&detached.stdout).unwrap();
    assert!(d["id"].as_str().is_some_and(|i| !i.is_empty() && i != id));

    // Failures: exit code non-zero with a message naming the problem.
    let missing = run(&master, &["warmup", "/d/nope"]);
    assert!(!missing.status.success());
    assert!(stderr(&missing).contains("/d/nope"), "{}", stderr(&missing));
    let bad_cron = run(&master, &["job", "schedule", "--cron", "every night", "/d/train"]);
    assert!(!bad_cron.status.success());
    assert!(stderr(&bad_cron).contains("cron"), "{}", stderr(&bad_cron));
    let too_many = run(&master, &["warmup", "--replicas", "3", "/d/train"]);
    assert!(!too_many.status.success());
    assert!(stderr(&too_many).contains("replicas"), "{}", stderr(&too_many));
    let unknown_job = run(&master, &["job", "status", "no-such-job"]);
    assert!(!unknown_job.status.success());
    assert!(stderr(&unknown_job).contains("no-such-job"), "{}", stderr(&unknown_job));

    // A reader that goes away early is not an error.
    let mut child = strata()
        .env("STRATA_TOKEN_FILE", token_file_of(&master).unwrap())
        .args(["--master", &master, "job", "history"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
}

#[test]
fn ls_of_a_100k_entry_directory_streams_pages() {
    // Before paging this failed at 60,000 entries: "decoded message length too large".
    let state = tempfile::tempdir().unwrap();
    let ufs = tempfile::tempdir().unwrap();
    let flat = ufs.path().join("flat");
    std::fs::create_dir(&flat).unwrap();
    for i in 0..100_000u32 {
        std::fs::write(flat.join(format!("sample-{i:06}.json")), b"{}").unwrap();
    }
    let master = format!("127.0.0.1:{}", free_port());
    let _s = start_standalone(state.path(), &master, &format!("/d=file://{}", ufs.path().display()));
    let ls = run(&master, &["ls", "/d/flat"]);
    assert!(ls.status.success(), "{}", stderr(&ls));
    let out = String::from_utf8(ls.stdout).unwrap();
    let names: Vec<&str> = out.lines().map(|l| l.split_whitespace().last().unwrap()).collect();
    assert_eq!(names.len(), 100_000);
    assert_eq!((names[0], names[99_999]), ("sample-000000.json", "sample-099999.json"));
    assert!(names.windows(2).all(|w| w[0] < w[1]), "in name order, once each");
    let json = run(&master, &["ls", "--json", "/d/flat"]);
    assert!(json.status.success(), "{}", stderr(&json));
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 100_000);
    assert_eq!(v[12_345]["path"], "/d/flat/sample-012345.json");
    let empty = ufs.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let none = run(&master, &["ls", "--json", "/d/empty"]);
    assert_eq!(serde_json::from_slice::<serde_json::Value>(&none.stdout).unwrap(), serde_json::json!([]));
}

/// `strata token create|ls|revoke` and what each role may do, through the CLI.
#[test]
fn tokens_have_roles_scopes_and_can_be_revoked() {
    let state = tempfile::tempdir().unwrap();
    let ufs = tempfile::tempdir().unwrap();
    for dir in ["a", "b"] {
        std::fs::create_dir(ufs.path().join(dir)).unwrap();
        std::fs::write(ufs.path().join(dir).join("f.txt"), dir.repeat(100)).unwrap();
    }
    let master = format!("127.0.0.1:{}", free_port());
    let _node = start_standalone(state.path(), &master, &format!("/d=file://{}", ufs.path().display()));

    let created =
        run(&master, &["token", "create", "--role", "reader", "--prefix", "/d/a", "--name", "team a"]);
    assert!(created.status.success(), "{}", stderr(&created));
    let out = String::from_utf8(created.stdout).unwrap();
    let reader = out.lines().last().unwrap().to_string();
    assert!(
        reader.starts_with("strata_") && !reader.contains(' '),
        "the token alone on the last line: {out}"
    );
    let as_reader = |args: &[&str]| {
        strata().env("STRATA_TOKEN", &reader).arg("--master").arg(&master).args(args).output().unwrap()
    };
    let cat = as_reader(&["cat", "/d/a/f.txt"]);
    assert!(cat.status.success() && cat.stdout == "a".repeat(100).as_bytes(), "{}", stderr(&cat));
    let outside = as_reader(&["cat", "/d/b/f.txt"]);
    assert!(!outside.status.success());
    assert!(stderr(&outside).contains("scoped to /d/a"), "{}", stderr(&outside));
    let admin_only = as_reader(&["mount", "add", "/x", &format!("file://{}", ufs.path().display())]);
    assert!(!admin_only.status.success());
    assert!(stderr(&admin_only).contains("reader token may not"), "{}", stderr(&admin_only));
    assert!(!run(&master, &["mount", "ls"]).stdout.is_empty());
    let mounts = String::from_utf8(run(&master, &["mount", "ls"]).stdout).unwrap();
    assert!(!mounts.contains("/x"), "nothing was mounted: {mounts}");

    let ls = run(&master, &["token", "ls", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&ls.stdout).unwrap();
    let id = reader_id(&v, "team a");
    assert!(!String::from_utf8_lossy(&ls.stdout).contains(&reader), "token ls never shows a token");
    let revoked = run(&master, &["token", "revoke", &id]);
    assert!(revoked.status.success(), "{}", stderr(&revoked));
    let after = as_reader(&["cat", "/d/a/f.txt"]);
    assert!(!after.status.success());
    assert!(stderr(&after).contains("unknown or revoked token"), "{}", stderr(&after));
    let again = run(&master, &["token", "revoke", &id]);
    assert!(!again.status.success() && stderr(&again).contains(&id), "{}", stderr(&again));

    let scoped_admin = run(&master, &["token", "create", "--role", "admin", "--prefix", "/d"]);
    assert!(!scoped_admin.status.success());
    assert!(stderr(&scoped_admin).contains("only reader and writer"), "{}", stderr(&scoped_admin));
    let bad_role = run(&master, &["token", "create", "--role", "root"]);
    assert!(
        !bad_role.status.success() && stderr(&bad_role).contains("unknown role"),
        "{}",
        stderr(&bad_role)
    );
}

fn reader_id(tokens: &serde_json::Value, name: &str) -> String {
    let t = tokens.as_array().unwrap().iter().find(|t| t["name"] == name).expect("the token is listed");
    assert_eq!((t["role"].as_str(), t["prefix"].as_str()), (Some("reader"), Some("/d/a")));
    t["id"].as_str().unwrap().to_string()
}

/// `strata lineage`: reads of `cat` and `cp` recorded under `--job` / `STRATA_JOB` with the
/// exact version each read (a file rewritten between two jobs: each names its own), grouped by
/// marks, queried as text and JSON, by file, and exported as OpenLineage events.
#[test]
fn lineage_names_the_versions_each_job_read() {
    let dir = tempfile::tempdir().unwrap();
    let ufs = tempfile::tempdir().unwrap();
    std::fs::write(ufs.path().join("a.bin"), vec![1u8; 3000]).unwrap();
    std::fs::write(ufs.path().join("b.bin"), vec![2u8; 5000]).unwrap();
    let master = format!("127.0.0.1:{}", free_port());
    let _node = start_standalone(dir.path(), &master, &format!("/d=file://{}", ufs.path().display()));
    let version = |path: &str| -> String {
        let o = run(&master, &["stat", "--sync", "--json", path]);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["version"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let ok = |o: Output| {
        assert!(o.status.success(), "{}", stderr(&o));
        o
    };
    let (a1, b1) = (version("/d/a.bin"), version("/d/b.bin"));
    ok(run(&master, &["--job", "train", "cat", "/d/a.bin"]));
    ok(run(&master, &["--job", "train", "lineage", "mark", "epoch=1"]));
    let copy = dir.path().join("b.copy");
    ok(run(&master, &["--job", "train", "cp", "/d/b.bin", copy.to_str().unwrap()]));
    // Rewritten in the UFS: the next job reads another version.
    std::fs::write(ufs.path().join("b.bin"), vec![3u8; 7000]).unwrap();
    let b2 = version("/d/b.bin");
    assert_ne!(b1, b2);
    let mut eval = strata();
    eval.env("STRATA_JOB", "eval").env("STRATA_TOKEN_FILE", token_file_of(&master).unwrap());
    ok(eval.args(["--master", &master, "cat", "/d/b.bin"]).output().unwrap());
    // No job: anonymous.
    ok(run(&master, &["cat", "/d/a.bin"]));

    let job = |name: &str, extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["lineage", "job", name, "--json"];
        args.extend_from_slice(extra);
        serde_json::from_slice(&ok(run(&master, &args)).stdout).unwrap()
    };
    let versions = |v: &serde_json::Value| -> Vec<(String, String, u64)> {
        v["files"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| {
                (
                    f["path"].as_str().unwrap().into(),
                    f["version"].as_str().unwrap().into(),
                    f["bytes"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    let train = job("train", &[]);
    assert_eq!(
        versions(&train),
        vec![("/d/a.bin".into(), a1.clone(), 3000), ("/d/b.bin".into(), b1.clone(), 5000)]
    );
    assert_eq!(train["marks"][0]["label"], "epoch=1");
    let marks_of = |v: &serde_json::Value, path: &str| {
        v["files"].as_array().unwrap().iter().find(|f| f["path"] == path).unwrap()["marks"].clone()
    };
    assert_eq!(marks_of(&train, "/d/a.bin"), serde_json::json!([0]));
    assert_eq!(marks_of(&train, "/d/b.bin"), serde_json::json!([1]));
    assert_eq!(versions(&job("train", &["--since", "epoch=1"])), vec![("/d/b.bin".into(), b1.clone(), 5000)]);
    assert_eq!(versions(&job("eval", &[])), vec![("/d/b.bin".into(), b2.clone(), 7000)]);
    assert_eq!(versions(&job("anonymous", &[])), vec![("/d/a.bin".into(), a1, 3000)]);

    let file: serde_json::Value =
        serde_json::from_slice(&ok(run(&master, &["lineage", "file", "/d/b.bin", "--json"])).stdout).unwrap();
    let readers: Vec<(String, String)> = file["reads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["job"].as_str().unwrap().into(), r["version"].as_str().unwrap().into()))
        .collect();
    assert_eq!(readers, vec![("eval".into(), b2), ("train".into(), b1)]);
    let text = String::from_utf8(ok(run(&master, &["lineage", "jobs"])).stdout).unwrap();
    assert!(text.contains("train") && text.contains("eval") && text.contains("anonymous"), "{text}");

    let unknown = run(&master, &["lineage", "job", "nobody", "--json"]);
    assert!(!unknown.status.success());
    assert!(stderr(&unknown).contains("no lineage recorded for job"), "{}", stderr(&unknown));
    let bad_mark = run(&master, &["lineage", "job", "train", "--since", "epoch=9"]);
    assert!(stderr(&bad_mark).contains("no mark"), "{}", stderr(&bad_mark));
    let mut no_job = strata();
    no_job.env_remove("STRATA_JOB").env("STRATA_TOKEN_FILE", token_file_of(&master).unwrap());
    let o = no_job.args(["--master", &master, "lineage", "mark", "x"]).output().unwrap();
    assert!(!o.status.success() && stderr(&o).contains("--job"), "{}", stderr(&o));

    let events = dir.path().join("train.jsonl");
    ok(run(&master, &["lineage", "export", "train", "--output", events.to_str().unwrap()]));
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(&events).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    // Two segments (before the mark, after it), a START and a COMPLETE each.
    assert_eq!(lines.len(), 4, "{lines:?}");
    assert!(lines.iter().all(|e| e["job"]["name"] == "train"));
}
