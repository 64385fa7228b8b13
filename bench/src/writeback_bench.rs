//! `writeback_bench`: a checkpoint written through a write-back mount against the disk its
//! journals live on and against a direct multipart put (issue 15).
//!
//! ```sh
//! source scripts/garage.sh && garage_ensure && garage_start     # exports STRATA_TEST_S3_*
//! cargo run --release -p strata-bench --bin writeback_bench                       # 2 GiB, 4 writers
//! cargo run --release -p strata-bench --bin writeback_bench -- --size 256MiB --rounds 2
//! ```
//!
//! It starts an in-process cluster (a master and `--workers` workers on 127.0.0.1, each with its
//! NVMe tier and write-back journal in a temporary directory on this machine's disk) and mounts
//! two prefixes of the same bucket: `/wb` (`mode=write-back`, `write_replicas`) and `/wt`
//! (`mode=write-through`). Each round measures, with `sync` and a pause between steps:
//! - the disk ceiling: `dd if=/dev/zero bs=8M oflag=direct` of `--size` bytes into the journal's
//!   file system, one stream, then two streams at once (aggregate), then two buffered streams
//!   with `conv=fdatasync` (what two journals do: write, then fsync at the end);
//! - write-back: `create`/`write`/`close` of one `--size` file (the acknowledgement: every
//!   replica's journal fsynced and the master told), split into streaming (until the last
//!   `write` returned) and `close`; then until `sync_wait` returns (persisted in the UFS);
//! - write-through: the same file through `/wt` (acknowledged once the UFS has it);
//! - a direct multipart put of the same bytes with opendal: 16 MiB parts 4 in flight (a tuned
//!   client), and 8 MiB parts 1 in flight (what a worker's UFS writer does);
//! - `--writers` concurrent write-back writers of `--size / --writers` bytes each: aggregate
//!   acknowledgement rate and the time until all are persisted.
//!
//! Every step writes bytes no other step wrote (a per-step stamp in each 4 KiB page), so an
//! object store that deduplicates blocks (Garage does) stores each step anew. Steps alternate
//! their order from round to round. The ack ceiling is the disk's O_DIRECT rate divided by
//! `write_replicas`: on one machine every replica's journal is on the same disk.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use serde_json::json;
use strata_client::Client;
use strata_testkit::{Cluster, ClusterOptions, TestUfs, fill_pattern};

const MIB: u64 = 1 << 20;
/// `dd` block size, and the bytes per `write` of a direct put part.
const DD_BLOCK: u64 = 8 * MIB;
/// Bytes of a page that carry the step's stamp.
const PAGE: usize = 4096;

#[derive(Parser, Debug)]
#[command(
    name = "writeback_bench",
    about = "Write-back checkpoints against the disk ceiling and a direct put"
)]
struct Args {
    /// Bytes of the checkpoint (e.g. 2GiB, 256MiB).
    #[arg(long, default_value = "2GiB", value_parser = parse_size)]
    size: u64,
    /// Concurrent writers of the last step; each writes size / writers bytes.
    #[arg(long, default_value_t = 4)]
    writers: u64,
    /// Workers in the cluster.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// `write_replicas` of the write-back mount.
    #[arg(long, default_value_t = 2)]
    write_replicas: u32,
    /// Bytes per `StrataWriter::write` call (e.g. 8MiB).
    #[arg(long, default_value = "8MiB", value_parser = parse_size)]
    write_size: u64,
    /// Rounds; each measures every step once, in the reverse order of the previous round.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Under file system: `s3` (STRATA_TEST_S3_*, e.g. Garage) or `fs` (a local directory; a
    /// quick check only: the "direct put" is then a file write).
    #[arg(long, default_value = "s3")]
    ufs: String,
    /// Write every figure as JSON to this file too.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn parse_size(s: &str) -> Result<u64, String> {
    strata_common::units::parse_size(s)
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("{s:?}: expected a size such as 2GiB"))
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

fn mib_s(bytes: u64, took: Duration) -> f64 {
    bytes as f64 / MIB as f64 / took.as_secs_f64()
}

/// Writes back dirty pages (other steps' leftovers: Garage does not fsync) and lets the disk
/// settle, so a step does not pay for the one before it.
fn settle() {
    let _ = Command::new("sync").status();
    std::thread::sleep(Duration::from_secs(1));
}

/// Marks every page of `buf` with `stamp`: the same pattern, bytes no other step wrote.
fn stamp(buf: &mut [u8], stamp: u64) {
    for page in buf.chunks_mut(PAGE) {
        let n = page.len().min(8);
        page[..n].copy_from_slice(&stamp.to_le_bytes()[..n]);
    }
}

/// The device holding `dir` (for the report).
fn device_of(dir: &Path) -> String {
    Command::new("df")
        .arg("-P")
        .arg(dir)
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().nth(1).and_then(|l| l.split_whitespace().next()).map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

/// `dd` of `bytes` into a file in each of `dirs` at once; returns the time until all finished.
fn dd(dirs: &[&Path], bytes: u64, direct: bool) -> Duration {
    let count = bytes.div_ceil(DD_BLOCK);
    let files: Vec<PathBuf> =
        dirs.iter().enumerate().map(|(i, d)| d.join(format!("dd-ceiling-{i}"))).collect();
    let started = Instant::now();
    let children: Vec<_> = files
        .iter()
        .map(|f| {
            let mut c = Command::new("dd");
            c.arg("if=/dev/zero")
                .arg(format!("of={}", f.display()))
                .arg(format!("bs={}M", DD_BLOCK / MIB))
                .arg(format!("count={count}"))
                .arg(if direct { "oflag=direct" } else { "conv=fdatasync" })
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped());
            c.spawn().expect("dd starts")
        })
        .collect();
    for child in children {
        let out = child.wait_with_output().expect("dd runs");
        assert!(out.status.success(), "dd failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let took = started.elapsed();
    for f in &files {
        let _ = std::fs::remove_file(f);
    }
    took
}

/// One file written through Strata: when its last `write` returned, when `close` did.
struct Written {
    started: Instant,
    streamed: Duration,
    acked: Duration,
    info: strata_client::FileInfo,
}

async fn write_file(client: &Client, path: &str, data: &[u8], write_size: u64) -> Written {
    let started = Instant::now();
    let mut w = client.create(path).await.unwrap_or_else(|e| panic!("create {path}: {e}"));
    for chunk in data.chunks(write_size as usize) {
        w.write(chunk).await.unwrap_or_else(|e| panic!("write {path}: {e}"));
    }
    let streamed = started.elapsed();
    let info = w.close().await.unwrap_or_else(|e| panic!("close {path}: {e}"));
    let acked = started.elapsed();
    assert_eq!(info.size, data.len() as u64, "{path}: size after close");
    Written { started, streamed, acked, info }
}

/// A multipart put of `data` straight to the UFS: `part`-byte parts, `in_flight` at a time.
async fn direct_put(
    op: &opendal::Operator,
    path: &str,
    data: &[u8],
    part: u64,
    in_flight: usize,
) -> Duration {
    let started = Instant::now();
    let mut w = op.writer_with(path).chunk(part as usize).concurrent(in_flight).await.expect("writer");
    for chunk in data.chunks(part as usize) {
        w.write(Bytes::copy_from_slice(chunk)).await.expect("put part");
    }
    w.close().await.expect("complete the upload");
    started.elapsed()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Step {
    WriteBack,
    WriteThrough,
    DirectTuned,
    DirectSerial,
    Parallel,
}

const STEPS: [Step; 5] =
    [Step::WriteBack, Step::WriteThrough, Step::DirectTuned, Step::DirectSerial, Step::Parallel];

/// What one round measured: seconds per figure.
#[derive(Default)]
struct Round {
    load_start: String,
    load_end: String,
    secs: BTreeMap<&'static str, f64>,
}

struct Bench {
    args: Args,
    cluster: Cluster,
    client: Client,
    op: opendal::Operator,
    data: Arc<Vec<u8>>,
    stamps: u64,
}

impl Bench {
    /// Stamps the buffer for a new step (no writer holds it between steps).
    fn fresh_bytes(&mut self) {
        self.stamps += 1;
        let data = Arc::get_mut(&mut self.data).expect("no writer holds the buffer between steps");
        stamp(data, self.stamps);
    }

    fn ceilings(&self, round: &mut Round) {
        let size = self.args.size;
        let dirs: Vec<PathBuf> =
            (0..self.cluster.worker_count().min(2)).map(|i| self.cluster.nvme_dir(i)).collect();
        let one = dd(&[&dirs[0]], size, true);
        settle();
        let two: Vec<&Path> = (0..2).map(|i| dirs[i % dirs.len()].as_path()).collect();
        let direct2 = dd(&two, size, true);
        settle();
        let buffered2 = dd(&two, size, false);
        settle();
        round.secs.insert("dd_direct_1", one.as_secs_f64());
        round.secs.insert("dd_direct_2", direct2.as_secs_f64());
        round.secs.insert("dd_fdatasync_2", buffered2.as_secs_f64());
        eprintln!(
            "  dd O_DIRECT: 1 stream {:.0} MiB/s, 2 streams {:.0} MiB/s aggregate; buffered+fdatasync 2 streams {:.0} MiB/s",
            mib_s(size, one),
            mib_s(2 * size, direct2),
            mib_s(2 * size, buffered2)
        );
    }

    async fn step(&mut self, step: Step, r: usize, round: &mut Round) {
        self.fresh_bytes();
        let size = self.args.size;
        match step {
            Step::WriteBack => {
                let path = format!("/wb/ckpt-r{r}.bin");
                let w = write_file(&self.client, &path, &self.data, self.args.write_size).await;
                assert_eq!(
                    w.info.holders.len(),
                    self.args.write_replicas as usize,
                    "{path}: journals holding it"
                );
                self.client.sync_wait(&path, Duration::from_secs(1800)).await.expect("persisted");
                let persisted = w.started.elapsed();
                let obj = self.op.stat(&format!("wb/ckpt-r{r}.bin")).await.expect("in the UFS");
                assert_eq!(obj.content_length(), size);
                round.secs.insert("wb_streamed", w.streamed.as_secs_f64());
                round.secs.insert("wb_ack", w.acked.as_secs_f64());
                round.secs.insert("wb_persisted", persisted.as_secs_f64());
                eprintln!(
                    "  write-back: streamed {:.2} s, ack {:.2} s ({:.0} MiB/s), persisted {:.2} s",
                    w.streamed.as_secs_f64(),
                    w.acked.as_secs_f64(),
                    mib_s(size, w.acked),
                    persisted.as_secs_f64()
                );
                self.client.delete(&path, false).await.expect("delete");
            }
            Step::WriteThrough => {
                let path = format!("/wt/ckpt-r{r}.bin");
                let w = write_file(&self.client, &path, &self.data, self.args.write_size).await;
                let obj = self.op.stat(&format!("wt/ckpt-r{r}.bin")).await.expect("in the UFS");
                assert_eq!(obj.content_length(), size);
                round.secs.insert("wt_ack", w.acked.as_secs_f64());
                eprintln!(
                    "  write-through: ack {:.2} s ({:.0} MiB/s)",
                    w.acked.as_secs_f64(),
                    mib_s(size, w.acked)
                );
                self.client.delete(&path, false).await.expect("delete");
            }
            Step::DirectTuned | Step::DirectSerial => {
                let (key, part, in_flight) = if step == Step::DirectTuned {
                    ("direct_16x4", 16 * MIB, 4)
                } else {
                    ("direct_8x1", 8 * MIB, 1)
                };
                let path = format!("direct/{key}-r{r}.bin");
                let took = direct_put(&self.op, &path, &self.data, part, in_flight).await;
                assert_eq!(self.op.stat(&path).await.expect("stat").content_length(), size);
                round.secs.insert(key, took.as_secs_f64());
                eprintln!(
                    "  direct put, {} MiB parts x{in_flight}: {:.2} s ({:.0} MiB/s)",
                    part / MIB,
                    took.as_secs_f64(),
                    mib_s(size, took)
                );
                self.op.delete(&path).await.expect("delete");
            }
            Step::Parallel => {
                let n = self.args.writers;
                let each = size / n;
                let dir = format!("/wb/par-r{r}");
                let started = Instant::now();
                let tasks: Vec<_> = (0..n)
                    .map(|i| {
                        let (client, data, write_size) =
                            (self.client.clone(), self.data.clone(), self.args.write_size);
                        let path = format!("{dir}/part-{i}.bin");
                        tokio::spawn(async move {
                            let slice = &data[(i * each) as usize..((i + 1) * each) as usize];
                            write_file(&client, &path, slice, write_size).await
                        })
                    })
                    .collect();
                let mut last_stream = Duration::ZERO;
                for t in tasks {
                    last_stream = last_stream.max(t.await.expect("writer").streamed);
                }
                let acked = started.elapsed();
                self.client.sync_wait(&dir, Duration::from_secs(1800)).await.expect("persisted");
                let persisted = started.elapsed();
                round.secs.insert("par_streamed", last_stream.as_secs_f64());
                round.secs.insert("par_ack", acked.as_secs_f64());
                round.secs.insert("par_persisted", persisted.as_secs_f64());
                eprintln!(
                    "  {n} write-back writers x {} MiB: all acked {:.2} s ({:.0} MiB/s aggregate), persisted {:.2} s",
                    each / MIB,
                    acked.as_secs_f64(),
                    mib_s(each * n, acked),
                    persisted.as_secs_f64()
                );
                self.client.delete(&dir, true).await.expect("delete");
            }
        }
        settle();
    }

    /// One small file through each mount and a small direct put: connections, mount tables
    /// and the upload path warmed before anything is timed.
    async fn warm_up(&self) {
        let small = &self.data[..(8 * MIB).min(self.args.size) as usize];
        for path in ["/wb/warm.bin", "/wt/warm.bin"] {
            write_file(&self.client, path, small, self.args.write_size).await;
            self.client.sync_wait(path, Duration::from_secs(120)).await.expect("warm-up persisted");
            self.client.delete(path, false).await.expect("delete");
        }
        direct_put(&self.op, "direct/warm.bin", small, 16 * MIB, 4).await;
        self.op.delete("direct/warm.bin").await.expect("delete");
    }
}

fn report(args: &Args, rounds: &[Round]) -> serde_json::Value {
    let size = args.size;
    let replicas = args.write_replicas as f64;
    let each = size / args.writers;
    let mut all = Vec::new();
    for (r, round) in rounds.iter().enumerate() {
        let s = |k: &str| round.secs[k];
        let rate = |bytes: u64, k: &str| bytes as f64 / MIB as f64 / s(k);
        let disk1 = rate(size, "dd_direct_1");
        let disk2 = rate(2 * size, "dd_direct_2");
        let ack_ceiling = disk1 / replicas;
        let ack_ceiling2 = disk2 / replicas;
        let direct = rate(size, "direct_16x4");
        println!();
        println!(
            "round {} (load average {} at start, {} at end), {} MiB, write_replicas {}, {} workers:",
            r + 1,
            round.load_start,
            round.load_end,
            size / MIB,
            args.write_replicas,
            args.workers
        );
        println!(
            "| figure | seconds | MiB/s | x ack ceiling ({ack_ceiling:.0}) | x ack ceiling, 2 streams ({ack_ceiling2:.0}) | x direct put ({direct:.0}) |"
        );
        println!("| --- | --- | --- | --- | --- | --- |");
        let row = |name: String, k: &str, bytes: u64, ratios: bool| {
            let v = rate(bytes, k);
            let (a, b, c) = if ratios {
                (
                    format!("{:.2}x", v / ack_ceiling),
                    format!("{:.2}x", v / ack_ceiling2),
                    format!("{:.2}x", v / direct),
                )
            } else {
                (String::new(), String::new(), String::new())
            };
            println!("| {name} | {:.2} | {v:.0} | {a} | {b} | {c} |", s(k));
            json!({"figure": name, "key": k, "seconds": s(k), "mib_s": v})
        };
        let mut rows = vec![
            row("disk: dd O_DIRECT bs=8M, 1 stream".into(), "dd_direct_1", size, false),
            row("disk: dd O_DIRECT, 2 streams at once (aggregate)".into(), "dd_direct_2", 2 * size, false),
            row(
                "disk: dd conv=fdatasync, 2 streams at once (aggregate)".into(),
                "dd_fdatasync_2",
                2 * size,
                false,
            ),
            row("write-back: last write returned".into(), "wb_streamed", size, true),
            row("write-back: acknowledged (close returned)".into(), "wb_ack", size, true),
            row("write-back: persisted (sync_wait returned, from create)".into(), "wb_persisted", size, true),
            row("write-through: acknowledged (close returned)".into(), "wt_ack", size, true),
            row("direct put: 16 MiB parts, 4 in flight".into(), "direct_16x4", size, true),
            row(
                "direct put: 8 MiB parts, 1 in flight (a worker's UFS writer)".into(),
                "direct_8x1",
                size,
                true,
            ),
            row(
                format!("{} write-back writers x {} MiB: all acknowledged", args.writers, each / MIB),
                "par_ack",
                each * args.writers,
                true,
            ),
            row(
                format!("{} write-back writers: all persisted", args.writers),
                "par_persisted",
                each * args.writers,
                true,
            ),
        ];
        rows.push(json!({"figure": "write-back: close alone (fsync + commit)", "seconds": s("wb_ack") - s("wb_streamed")}));
        println!(
            "write-back ack: {:.2}x of the ack ceiling (1-stream O_DIRECT / {replicas}), {:.2}x with 2 streams, {:.2}x the direct put's rate; \
             streaming {:.2} s + close (journal fsync, commit) {:.2} s",
            rate(size, "wb_ack") / ack_ceiling,
            rate(size, "wb_ack") / ack_ceiling2,
            rate(size, "wb_ack") / direct,
            s("wb_streamed"),
            s("wb_ack") - s("wb_streamed")
        );
        all.push(json!({
            "round": r + 1, "load_start": round.load_start, "load_end": round.load_end,
            "ack_ceiling_mib_s": ack_ceiling, "ack_ceiling_2_streams_mib_s": ack_ceiling2,
            "direct_put_mib_s": direct, "rows": rows,
        }));
    }
    json!({
        "size_bytes": size, "writers": args.writers, "workers": args.workers,
        "write_replicas": args.write_replicas, "write_size": args.write_size, "ufs": args.ufs, "rounds": all,
    })
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    assert!(
        args.writers > 0 && args.size >= args.writers,
        "--writers must be between 1 and the size in bytes"
    );
    assert!(args.workers as u32 >= args.write_replicas, "--workers must be at least --write-replicas");
    println!("load average at start: {}", load_average());
    let ufs = match args.ufs.as_str() {
        "s3" => TestUfs::s3(),
        "fs" => TestUfs::fs(),
        other => panic!("--ufs {other}: expected s3 or fs"),
    };
    let op = ufs.operator();
    let base = ufs.uri();
    let mut ufs_options: std::collections::HashMap<String, String> =
        ufs.mount_options().into_iter().collect();
    ufs_options.insert("block_size".into(), "4MiB".into());
    ufs_options.insert("metadata_ttl".into(), "1h".into());
    let opts = ClusterOptions {
        workers: args.workers,
        memory_capacity: 256 * MIB,
        nvme_capacity: 1 << 30,
        ..ClusterOptions::default()
    };
    let cluster = Cluster::start_with(opts, ufs).await;
    let mut config = cluster.client_config();
    // A 2 GiB journal's fsync, or a write-through's last part, can take longer than the
    // harness's default.
    config.request_timeout = Duration::from_secs(600);
    let client = Client::connect(config).await.expect("connect");
    if cluster.ufs.name() == "fs" {
        // A directory mount's root must exist.
        for d in ["wb", "wt"] {
            std::fs::create_dir_all(cluster.ufs.dir().join(d)).expect("mount directory");
        }
    }
    let mut wb = ufs_options.clone();
    wb.insert("mode".into(), "write-back".into());
    wb.insert("write_replicas".into(), args.write_replicas.to_string());
    client.add_mount("/wb", &format!("{base}/wb"), wb).await.expect("mount /wb");
    let mut wt = ufs_options;
    wt.insert("mode".into(), "write-through".into());
    client.add_mount("/wt", &format!("{base}/wt"), wt).await.expect("mount /wt");

    let journal_fs = cluster.nvme_dir(0);
    println!(
        "{} MiB checkpoint, {} writes; {} workers, journals under {} (device {}); ufs {} ({base})",
        args.size / MIB,
        args.write_size / MIB,
        args.workers,
        journal_fs.display(),
        device_of(&journal_fs),
        args.ufs
    );
    eprintln!("generating {} MiB of test bytes", args.size / MIB);
    let mut data = vec![0u8; args.size as usize];
    fill_pattern(15, 0, &mut data);
    let mut bench = Bench { args, cluster, client, op, data: Arc::new(data), stamps: 0 };
    bench.warm_up().await;
    settle();

    let mut rounds = Vec::new();
    for r in 0..bench.args.rounds {
        let mut round = Round { load_start: load_average(), ..Round::default() };
        eprintln!("round {} (load {})", r + 1, round.load_start);
        bench.ceilings(&mut round);
        let mut order = STEPS.to_vec();
        if r % 2 == 1 {
            order.reverse();
        }
        for step in order {
            bench.step(step, r, &mut round).await;
        }
        round.load_end = load_average();
        rounds.push(round);
    }
    let v = report(&bench.args, &rounds);
    println!("\nload average at end: {}", load_average());
    if let Some(path) = &bench.args.json {
        std::fs::write(path, serde_json::to_string_pretty(&v).expect("json")).expect("write --json file");
    }
}
