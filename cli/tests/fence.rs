//! The cluster never serves its own state (docs/SECURITY.md, "The cluster's own files"), end
//! to end with real processes: a standalone laid out as the quickstart laid it out before
//! (state in `./.strata`, inside the directory it mounts at `/local`), a second mount of the
//! parent directory that may be written, and readers and writers with scoped tokens going at
//! the state through the CLI, the SDK, a forged read straight to the worker, and links.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use strata_client::{Client, ClientConfig, FileInfo, Token};

use crate::common::{Proc, free_port};

/// `strata` as a user runs it: nothing of the test run's shared tokens, so the standalone
/// writes its own where the quickstart does.
fn plain_strata() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_strata"));
    for var in [
        "STRATA_MASTER",
        "STRATA_TOKEN",
        "STRATA_TOKEN_FILE",
        "STRATA_DIR",
        "STRATA_MASTER_ADMIN_TOKEN_FILE",
        "STRATA_MASTER_WORKER_TOKEN_FILE",
        "STRATA_SIDECAR_SOCKET",
        "STRATA_WORKERS",
    ] {
        c.env_remove(var);
    }
    c.env("RUST_LOG", "warn");
    c
}

struct Lab {
    tmp: tempfile::TempDir,
    /// Outside every mount: a file that grows while a warmup lists would fail it.
    _logs: tempfile::TempDir,
    master: String,
    _standalone: Proc,
    standalone_log: PathBuf,
}

impl Lab {
    fn proj(&self) -> PathBuf {
        self.tmp.path().join("proj")
    }

    fn state(&self) -> PathBuf {
        self.proj().join(".strata")
    }

    /// A CLI command presenting `token`.
    fn cli(&self, token: &str, args: &[&str]) -> Output {
        plain_strata()
            .env("STRATA_TOKEN", token)
            .arg("--master")
            .arg(&self.master)
            .args(args)
            .output()
            .unwrap()
    }

    fn admin(&self, args: &[&str]) -> Output {
        let token = std::fs::read_to_string(self.state().join("admin.token")).unwrap();
        self.cli(token.trim(), args)
    }

    /// A new token: the last line `token create` prints.
    fn token(&self, role: &str, prefix: &str) -> String {
        let out = self.admin(&["token", "create", "--role", role, "--prefix", prefix]);
        assert!(out.status.success(), "{}", err(&out));
        String::from_utf8(out.stdout).unwrap().lines().last().unwrap().to_string()
    }

    fn client(&self, rt: &tokio::runtime::Runtime, token: &str) -> Client {
        let mut config = ClientConfig::new(self.master.clone());
        config.token = Some(Token(token.to_string()));
        rt.block_on(Client::connect(config)).unwrap()
    }
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn out(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The names `strata ls` printed (the last column; directories end in `/`).
fn names(o: &Output) -> Vec<String> {
    out(o).lines().filter_map(|l| l.split_whitespace().last().map(String::from)).collect()
}

/// A refusal that says why: the state is never served, or a link leads out.
#[track_caller]
fn refused(o: &Output, why: &str) {
    assert!(!o.status.success(), "must be refused, printed {:?}", out(o));
    assert!(err(o).contains(why), "the refusal says {why:?}: {}", err(o));
}

/// The quickstart's directory with a standalone in it (state in `./.strata`, which is inside
/// `/local`), the parent directory mounted write-through at `/all`, and links in `data/`.
fn lab() -> Lab {
    let tmp = tempfile::tempdir().unwrap();
    let proj = tmp.path().join("proj");
    std::fs::create_dir_all(proj.join("data")).unwrap();
    std::fs::write(proj.join("data/a.txt"), b"alpha").unwrap();
    std::fs::write(tmp.path().join("outside.txt"), b"not yours").unwrap();
    std::os::unix::fs::symlink("a.txt", proj.join("data/in")).unwrap();
    std::os::unix::fs::symlink(tmp.path().join("outside.txt"), proj.join("data/out")).unwrap();
    std::os::unix::fs::symlink("../.strata/admin.token", proj.join("data/tok")).unwrap();
    let master = format!("127.0.0.1:{}", free_port());
    let logs = tempfile::tempdir().unwrap();
    let standalone_log = logs.path().join("standalone.log");
    let mut child = plain_strata()
        .current_dir(&proj)
        .args([
            "--master",
            &master,
            "standalone",
            "--memory",
            "64MiB",
            "--nvme",
            "256MiB",
            "--dir",
            ".strata",
        ])
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&standalone_log).unwrap())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(Instant::now() < deadline, "standalone did not start");
        match lines.next() {
            Some(Ok(line)) if line.starts_with("try:") => break,
            Some(Ok(_)) => {}
            other => panic!("standalone exited before starting: {other:?}"),
        }
    }
    std::thread::spawn(move || for _ in lines {});
    let lab = Lab { tmp, _logs: logs, master, _standalone: Proc(child), standalone_log };
    let parent = format!("file://{}", lab.tmp.path().display());
    let added = lab.admin(&["mount", "add", "/all", &parent, "-o", "mode=write-through"]);
    assert!(added.status.success(), "{}", err(&added));
    assert!(err(&added).contains("warning") && err(&added).contains("own state"), "{}", err(&added));
    lab
}

/// The version a file's blocks are keyed by (`m<mtime ns>-s<size>`): what an attacker who
/// knows the file's times would forge.
fn version_of(path: &Path) -> String {
    let meta = std::fs::metadata(path).unwrap();
    let ns = meta.modified().unwrap().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    format!("m{ns}-s{}", meta.len())
}

#[test]
fn no_reader_or_writer_reaches_the_cluster_state_through_any_mount() {
    let lab = lab();
    let banner = std::fs::read_to_string(&lab.standalone_log).unwrap();
    assert!(banner.contains("own state"), "the standalone warns that /local holds its state: {banner}");
    let admin_token = std::fs::read_to_string(lab.state().join("admin.token")).unwrap();
    let worker_token = std::fs::read_to_string(lab.state().join("master/worker.token")).unwrap();
    let reader = lab.token("reader", "/local");
    let all_reader = lab.token("reader", "/all");
    let writer = lab.token("writer", "/all");

    // Listing: the state is not there, data is.
    let ls = lab.cli(&reader, &["ls", "/local"]);
    assert!(ls.status.success(), "{}", err(&ls));
    assert_eq!(names(&ls), ["data/"], "the state directory is not listed");
    let ls_all = lab.cli(&all_reader, &["ls", "/all/proj"]);
    assert!(ls_all.status.success(), "{}", err(&ls_all));
    assert_eq!(names(&ls_all), ["data/"], "nor through a mount of the parent");
    refused(&lab.cli(&reader, &["ls", "/local/.strata"]), "state");

    // Stat, read, copy out: through both mounts, whatever the path's spelling.
    for (token, path) in [
        (&reader, "/local/.strata"),
        (&reader, "/local/.strata/admin.token"),
        (&reader, "/local/.strata/master/worker.token"),
        (&reader, "/local/.strata/master/master.redb"),
        (&reader, "/local/.strata/.strata-state"),
        (&all_reader, "/all/proj/.strata/admin.token"),
        (&all_reader, "/all/proj/.strata/master/worker.token"),
    ] {
        refused(&lab.cli(token, &["stat", path]), "state");
        refused(&lab.cli(token, &["cat", path]), "state");
        let stolen = lab.tmp.path().join("stolen");
        refused(&lab.cli(token, &["cp", path, stolen.to_str().unwrap()]), "state");
        assert!(!stolen.exists());
    }

    // Links: inside the mount followed, out of it or into the state refused and not listed.
    let cat_in = lab.cli(&reader, &["cat", "/local/data/in"]);
    assert!(cat_in.status.success() && cat_in.stdout == b"alpha", "{}", err(&cat_in));
    refused(&lab.cli(&reader, &["cat", "/local/data/out"]), "outside the mount");
    refused(&lab.cli(&reader, &["cat", "/local/data/tok"]), "state");
    let ls_data = names(&lab.cli(&reader, &["ls", "/local/data"]));
    assert_eq!(ls_data, ["a.txt", "in"], "links out of the mount or into the state are not listed");

    // Warmup, locate: of the state refused; of the whole mount, nothing of the state loaded.
    refused(&lab.admin(&["warmup", "/local/.strata"]), "state");
    refused(&lab.cli(&reader, &["locate", "/local/.strata"]), "state");
    let warm = lab.admin(&["warmup", "/all"]);
    assert!(warm.status.success(), "{}{}", out(&warm), err(&warm));

    let rt = tokio::runtime::Runtime::new().unwrap();
    let sdk = lab.client(&rt, &all_reader);
    rt.block_on(async {
        // A find of everything lists no state file and no link that leads out.
        let mut found = Vec::new();
        let mut page = String::new();
        loop {
            let (entries, next) = sdk.find_page_with_dirs("/all", &page, 1000, 0).await.unwrap();
            found.extend(entries.into_iter().map(|e| e.path));
            match next {
                Some(n) => page = n,
                None => break,
            }
        }
        assert!(found.iter().any(|p| p == "/all/proj/data/a.txt"), "{found:?}");
        // (`data/out` leads to a file inside `/all`'s directory: followed there, not under /local.)
        assert!(found.iter().any(|p| p == "/all/proj/data/out"), "{found:?}");
        assert!(found.iter().all(|p| !p.contains(".strata") && !p.ends_with("/tok")), "{found:?}");
        // A read sent straight to the worker, its version forged from the file's times: the
        // worker refuses to fetch it, the master never having said it exists.
        for (path, file) in [
            ("/all/proj/.strata/admin.token", lab.state().join("admin.token")),
            ("/all/proj/.strata/master/worker.token", lab.state().join("master/worker.token")),
        ] {
            let size = std::fs::metadata(&file).unwrap().len();
            let forged = FileInfo {
                path: path.to_string(),
                is_dir: false,
                size,
                version: version_of(&file),
                mtime_ms: 0,
                block_size: 4 << 20,
                file_id: String::new(),
                holders: Vec::new(),
                persist: Default::default(),
            };
            let e = sdk.read_range_of(&forged, 0, size).await.expect_err("a forged read must fail");
            assert!(e.to_string().contains("state"), "{e}");
        }
    });

    // A writer of the parent mount cannot replace, delete, move or copy over the state.
    let writer_sdk = lab.client(&rt, &writer);
    rt.block_on(async {
        let mut w = writer_sdk.create("/all/proj/.strata/admin.token").await.map(Some).unwrap_or(None);
        if let Some(w) = w.as_mut() {
            let wrote = async {
                w.write(b"strata_attacker").await?;
                w.close().await
            };
            assert!(wrote.await.is_err(), "the write is refused at the latest when it is closed");
        }
        for result in [
            writer_sdk.delete("/all/proj/.strata/admin.token", false).await,
            writer_sdk.delete("/all/proj/.strata", true).await,
            writer_sdk.delete("/all/proj", true).await,
            writer_sdk.mkdir("/all/proj/.strata/x").await,
            writer_sdk.rename("/all/proj/.strata", "/all/moved").await.map(|_| ()),
            writer_sdk.rename("/all/proj/data/a.txt", "/all/proj/.strata/admin.token").await.map(|_| ()),
            writer_sdk.copy("/all/proj/data/a.txt", "/all/proj/.strata/admin.token").await.map(|_| ()),
            writer_sdk.copy("/all/proj/.strata/admin.token", "/all/stolen").await.map(|_| ()),
        ] {
            let e = result.expect_err("a change to the state must be refused");
            assert!(e.to_string().contains("state"), "{e}");
        }
        // The writer's own data is written as before.
        let mut ok = writer_sdk.create("/all/proj/data/b.txt").await.unwrap();
        ok.write(b"beta").await.unwrap();
        ok.close().await.unwrap();
    });
    assert_eq!(std::fs::read(lab.proj().join("data/b.txt")).unwrap(), b"beta");
    assert!(!lab.tmp.path().join("stolen").exists() && !lab.tmp.path().join("moved").exists());
    assert_eq!(std::fs::read_to_string(lab.state().join("admin.token")).unwrap(), admin_token);
    assert_eq!(std::fs::read_to_string(lab.state().join("master/worker.token")).unwrap(), worker_token);
    // The cluster still works on its own state, and no output ever carried a token.
    let status = lab.admin(&["status"]);
    assert!(status.status.success(), "{}", err(&status));

    // A mount of a directory inside the state is refused outright.
    let inside = format!("file://{}", lab.state().join("master").display());
    refused(&lab.admin(&["mount", "add", "/steal", &inside]), "own state");
}

/// The quickstart as it is now: the state outside the directory the standalone mounts, the
/// token file 0600 in a 0700 directory, found by a CLI run from the same directory.
#[test]
fn the_quickstart_keeps_its_state_and_tokens_outside_the_mounted_directory() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let (cwd, xdg, elsewhere) = (tmp.path().join("proj"), tmp.path().join("xdg"), tmp.path().join("other"));
    for d in [&cwd, &xdg, &elsewhere] {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::write(cwd.join("hello.txt"), b"hi").unwrap();
    let master = format!("127.0.0.1:{}", free_port());
    let mut child = plain_strata()
        .current_dir(&cwd)
        .env("XDG_STATE_HOME", &xdg)
        .args(["--master", &master, "standalone", "--memory", "64MiB", "--nvme", "256MiB"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut printed = String::new();
    loop {
        match lines.next() {
            Some(Ok(line)) => {
                printed.push_str(&line);
                printed.push('\n');
                if line.starts_with("try:") {
                    break;
                }
            }
            other => panic!("standalone exited before starting: {other:?}"),
        }
    }
    std::thread::spawn(move || for _ in lines {});
    let _node = Proc(child);
    assert!(!cwd.join(".strata").exists(), "nothing of the cluster's in the mounted directory");
    let states: Vec<PathBuf> =
        std::fs::read_dir(xdg.join("strata/standalone")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(states.len(), 1, "{states:?}");
    let state = &states[0];
    assert!(state.file_name().unwrap().to_string_lossy().starts_with("proj-"), "{state:?}");
    assert!(printed.contains(&state.display().to_string()), "the banner says where: {printed}");
    let token_file = state.join("admin.token");
    assert_eq!(std::fs::metadata(&token_file).unwrap().permissions().mode() & 0o777, 0o600);
    assert_eq!(std::fs::metadata(state).unwrap().permissions().mode() & 0o777, 0o700);

    let here = plain_strata()
        .current_dir(&cwd)
        .env("XDG_STATE_HOME", &xdg)
        .args(["--master", &master, "cat", "/local/hello.txt"])
        .output()
        .unwrap();
    assert!(here.status.success() && here.stdout == b"hi", "{}", err(&here));
    let away = plain_strata()
        .current_dir(&elsewhere)
        .env("XDG_STATE_HOME", &xdg)
        .args(["--master", &master, "ls", "/local"])
        .output()
        .unwrap();
    assert!(!away.status.success(), "a CLI run elsewhere has no token");
    assert!(err(&away).contains("no token") && err(&away).contains("STRATA_TOKEN"), "{}", err(&away));
    let flag = plain_strata()
        .current_dir(&elsewhere)
        .args(["--master", &master, "--token-file"])
        .arg(&token_file)
        .args(["ls", "/local"])
        .output()
        .unwrap();
    assert!(flag.status.success(), "--token-file: {}", err(&flag));
}
