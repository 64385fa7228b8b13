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
//! - the disk ceiling in the journal's file system: 8 MiB writes of `--size` pattern bytes with
//!   `O_DIRECT`, then `fdatasync`, one stream and two at once (aggregate); the same buffered
//!   (what a journal does: write, then fsync at the end), one and two streams; and
//!   `dd if=/dev/zero bs=8M oflag=direct conv=fdatasync` as a cross-check;
//! - write-back: `create`/`write`/`close` of one `--size` file (the acknowledgement: every
//!   replica's journal fsynced and the master told), split into streaming (until the last
//!   `write` returned) and `close`; then until `sync_wait` returns (persisted in the UFS);
//! - write-through: the same file through `/wt` (acknowledged once the UFS has it);
//! - a direct multipart put of the same bytes with opendal: 16 MiB parts 4 in flight (a tuned
//!   client), and 8 MiB parts 4 in flight (what a worker's UFS writer does, ufs/src/write.rs);
//! - `--writers` concurrent write-back writers of `--size / --writers` bytes each: aggregate
//!   acknowledgement rate and the time until all are persisted;
//! - `--trials` write-back acknowledgements, each bracketed by the disk ceiling measured just
//!   before and just after it (the step `bracketed`): this disk's rate moves up to 2× from one
//!   minute to the next, so a ceiling measured at the start of a round says little about the
//!   moment of an acknowledgement ten steps later.
//!
//! Every step writes bytes no other step wrote (a per-step stamp in each 4 KiB page), so an
//! object store that deduplicates blocks (Garage does) stores each step anew. Steps alternate
//! their order from round to round. The ack ceiling is the disk's 1-stream O_DIRECT rate divided
//! by `write_replicas`: on one machine every replica's journal is on the same disk. Every figure
//! carries the CPU seconds this process (client, master, workers; not Garage) used meanwhile.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};
use strata_bench::load_average;

use bytes::Bytes;
use clap::Parser;
use serde_json::json;
use strata_client::Client;
use strata_testkit::{Cluster, ClusterOptions, TestUfs, fill_pattern};

const MIB: u64 = 1 << 20;
/// Bytes per `write` of the disk ceiling, and `dd`'s block size.
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
    /// Steps to run after the disk ceiling, comma-separated: write-back, write-through,
    /// direct, parallel, bracketed (default: all).
    #[arg(long, value_delimiter = ',', default_value = "write-back,write-through,direct,parallel,bracketed")]
    steps: Vec<String>,
    /// Write-back acknowledgements of the `bracketed` step, each between two measurements of
    /// the disk ceiling (1 and 2 O_DIRECT streams).
    #[arg(long, default_value_t = 5)]
    trials: usize,
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

fn mib_s(bytes: u64, took: Duration) -> f64 {
    bytes as f64 / MIB as f64 / took.as_secs_f64()
}

/// A moment, with the CPU time this process has used by then (every thread: the client, the
/// master, the workers and the disk-ceiling writers; not Garage, not `dd`).
#[derive(Clone, Copy)]
struct Mark {
    wall: Instant,
    cpu: f64,
}

/// Wall time and process CPU seconds between two moments.
#[derive(Clone, Copy, Debug)]
struct Spent {
    wall: Duration,
    /// NaN where it cannot be told apart (one writer among several).
    cpu: f64,
}

impl Mark {
    fn now() -> Self {
        Self { wall: Instant::now(), cpu: process_cpu_secs() }
    }

    fn spent(&self) -> Spent {
        Spent { wall: self.wall.elapsed(), cpu: process_cpu_secs() - self.cpu }
    }
}

fn process_cpu_secs() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a plain struct we own; all-zero bytes are a valid rusage, so it
    // is initialised even if the call failed.
    let usage = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr());
        usage.assume_init()
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// CPU seconds every core of the machine has been busy since boot (`/proc/stat`: everything
/// but idle and I/O wait), to tell how much of a round's CPU went to other processes.
fn machine_busy_secs() -> f64 {
    // SAFETY: sysconf only reads a constant of the system.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let fields: Vec<f64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal ...
    let busy: f64 =
        fields.iter().take(8).enumerate().filter(|(i, _)| *i != 3 && *i != 4).map(|(_, v)| v).sum();
    busy / ticks
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

/// How a ceiling stream writes: `O_DIRECT` (the page cache bypassed), or buffered as a journal
/// does. Both end with `fdatasync`, the durability a journal gives before its acknowledgement.
#[derive(Clone, Copy, PartialEq, Eq)]
enum DiskWrite {
    Direct,
    Buffered,
}

/// Writes `bytes` of pattern bytes (not zeros: a virtual disk may treat those apart) in 8 MiB
/// writes to a new file in each of `dirs` at once, then `fdatasync`s; returns the time until
/// every stream is durable.
fn disk_ceiling(dirs: &[&Path], bytes: u64, how: DiskWrite) -> Spent {
    let files: Vec<PathBuf> =
        dirs.iter().enumerate().map(|(i, d)| d.join(format!("disk-ceiling-{i}"))).collect();
    let started = Mark::now();
    std::thread::scope(|s| {
        for (i, f) in files.iter().enumerate() {
            s.spawn(move || write_stream(f, bytes, how, i as u64));
        }
    });
    let took = started.spent();
    for f in &files {
        let _ = std::fs::remove_file(f);
    }
    took
}

fn write_stream(path: &Path, bytes: u64, how: DiskWrite, seed: u64) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    if how == DiskWrite::Direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    let mut file = opts.open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    // O_DIRECT wants the buffer aligned to the device's block: take an aligned window.
    let mut backing = vec![0u8; (DD_BLOCK as usize) + PAGE];
    let start = backing.as_ptr().align_offset(PAGE);
    let buf = &mut backing[start..start + DD_BLOCK as usize];
    fill_pattern(seed, 0, buf);
    // Whole pages (O_DIRECT wants them): at most a page more than asked.
    let mut left = bytes.div_ceil(PAGE as u64) * PAGE as u64;
    while left > 0 {
        let n = left.min(DD_BLOCK) as usize;
        file.write_all(&buf[..n]).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        left -= n as u64;
    }
    file.sync_data().unwrap_or_else(|e| panic!("{}: fdatasync: {e}", path.display()));
}

/// `dd if=/dev/zero bs=8M oflag=direct conv=fdatasync` of `bytes` into `dir`: the textbook
/// figure, next to [`disk_ceiling`]'s.
fn dd_zeros(dir: &Path, bytes: u64) -> Spent {
    let file = dir.join("dd-ceiling");
    let started = Mark::now();
    let out = Command::new("dd")
        .arg("if=/dev/zero")
        .arg(format!("of={}", file.display()))
        .arg(format!("bs={}M", DD_BLOCK / MIB))
        .arg(format!("count={}", bytes.div_ceil(DD_BLOCK)))
        .arg("oflag=direct")
        .arg("conv=fdatasync")
        .output()
        .expect("dd runs");
    let took = started.spent();
    let _ = std::fs::remove_file(&file);
    assert!(out.status.success(), "dd failed: {}", String::from_utf8_lossy(&out.stderr));
    took
}

/// One file written through Strata: when its last `write` returned, when `close` did.
struct Written {
    started: Mark,
    streamed: Spent,
    acked: Spent,
    info: strata_client::FileInfo,
}

async fn write_file(client: &Client, path: &str, data: &[u8], write_size: u64) -> Written {
    let started = Mark::now();
    let mut w = client.create(path).await.unwrap_or_else(|e| panic!("create {path}: {e}"));
    for chunk in data.chunks(write_size as usize) {
        w.write(chunk).await.unwrap_or_else(|e| panic!("write {path}: {e}"));
    }
    let streamed = started.spent();
    let info = w.close().await.unwrap_or_else(|e| panic!("close {path}: {e}"));
    let acked = started.spent();
    assert_eq!(info.size, data.len() as u64, "{path}: size after close");
    Written { started, streamed, acked, info }
}

/// A multipart put of `data` straight to the UFS: `part`-byte parts, `in_flight` at a time.
async fn direct_put(op: &opendal::Operator, path: &str, data: &[u8], part: u64, in_flight: usize) -> Spent {
    let started = Mark::now();
    let mut w = op.writer_with(path).chunk(part as usize).concurrent(in_flight).await.expect("writer");
    for chunk in data.chunks(part as usize) {
        w.write(Bytes::copy_from_slice(chunk)).await.expect("put part");
    }
    w.close().await.expect("complete the upload");
    started.spent()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Step {
    WriteBack,
    WriteThrough,
    DirectTuned,
    DirectAsWorker,
    Parallel,
    Bracketed,
}

const STEPS: [Step; 6] = [
    Step::WriteBack,
    Step::WriteThrough,
    Step::DirectTuned,
    Step::DirectAsWorker,
    Step::Parallel,
    Step::Bracketed,
];

impl Step {
    /// The `--steps` word that selects it.
    fn name(self) -> &'static str {
        match self {
            Step::WriteBack => "write-back",
            Step::WriteThrough => "write-through",
            Step::DirectTuned | Step::DirectAsWorker => "direct",
            Step::Parallel => "parallel",
            Step::Bracketed => "bracketed",
        }
    }
}

/// What one round measured: time and CPU per figure.
#[derive(Default)]
struct Round {
    load_start: String,
    load_end: String,
    /// Wall time, the machine's busy CPU and this process's CPU over the round.
    whole: Option<(Spent, f64)>,
    spent: BTreeMap<&'static str, Spent>,
    trials: Vec<Trial>,
}

/// The disk ceiling at one moment: one `O_DIRECT` stream, and two at once (their aggregate).
#[derive(Clone, Copy)]
struct Ceiling {
    one: Spent,
    two: Spent,
}

impl Ceiling {
    /// MiB/s of the stronger of the two ways to write this disk.
    fn best_mib_s(&self, size: u64) -> f64 {
        mib_s(size, self.one.wall).max(mib_s(2 * size, self.two.wall))
    }
}

/// One write-back acknowledgement of the `bracketed` step, with the ceilings measured just
/// before and just after it.
struct Trial {
    before: Ceiling,
    acked: Spent,
    streamed: Spent,
    after: Ceiling,
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
        let two: Vec<&Path> = (0..2).map(|i| dirs[i % dirs.len()].as_path()).collect();
        let mut took = |key: &'static str, d: Spent| {
            round.spent.insert(key, d);
            settle();
            d.wall
        };
        let one = took("disk_direct_1", disk_ceiling(&two[..1], size, DiskWrite::Direct));
        let direct2 = took("disk_direct_2", disk_ceiling(&two, size, DiskWrite::Direct));
        let buffered1 = took("disk_buffered_1", disk_ceiling(&two[..1], size, DiskWrite::Buffered));
        let buffered2 = took("disk_buffered_2", disk_ceiling(&two, size, DiskWrite::Buffered));
        let zeros = took("dd_zeros_1", dd_zeros(two[0], size));
        eprintln!(
            "  disk, O_DIRECT + fdatasync: 1 stream {:.0} MiB/s, 2 streams {:.0} MiB/s aggregate; buffered + \
             fdatasync, 1 stream {:.0} MiB/s, 2 streams {:.0} MiB/s; dd if=/dev/zero {:.0} MiB/s",
            mib_s(size, one),
            mib_s(2 * size, direct2),
            mib_s(size, buffered1),
            mib_s(2 * size, buffered2),
            mib_s(size, zeros)
        );
    }

    /// The disk ceiling now, each stream count after a settled disk.
    fn ceiling_now(&self) -> Ceiling {
        let dirs: Vec<PathBuf> =
            (0..self.cluster.worker_count().min(2)).map(|i| self.cluster.nvme_dir(i)).collect();
        let two: Vec<&Path> = (0..2).map(|i| dirs[i % dirs.len()].as_path()).collect();
        let one = disk_ceiling(&two[..1], self.args.size, DiskWrite::Direct);
        settle();
        let both = disk_ceiling(&two, self.args.size, DiskWrite::Direct);
        settle();
        Ceiling { one, two: both }
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
                let persisted = w.started.spent();
                let obj = self.op.stat(&format!("wb/ckpt-r{r}.bin")).await.expect("in the UFS");
                assert_eq!(obj.content_length(), size);
                round.spent.insert("wb_streamed", w.streamed);
                round.spent.insert("wb_ack", w.acked);
                round.spent.insert("wb_persisted", persisted);
                eprintln!(
                    "  write-back: streamed {:.2} s, ack {:.2} s ({:.0} MiB/s, {:.1} CPU s), persisted {:.2} s",
                    w.streamed.wall.as_secs_f64(),
                    w.acked.wall.as_secs_f64(),
                    mib_s(size, w.acked.wall),
                    w.acked.cpu,
                    persisted.wall.as_secs_f64()
                );
                self.client.delete(&path, false).await.expect("delete");
            }
            Step::WriteThrough => {
                let path = format!("/wt/ckpt-r{r}.bin");
                let w = write_file(&self.client, &path, &self.data, self.args.write_size).await;
                let obj = self.op.stat(&format!("wt/ckpt-r{r}.bin")).await.expect("in the UFS");
                assert_eq!(obj.content_length(), size);
                round.spent.insert("wt_ack", w.acked);
                eprintln!(
                    "  write-through: ack {:.2} s ({:.0} MiB/s)",
                    w.acked.wall.as_secs_f64(),
                    mib_s(size, w.acked.wall)
                );
                self.client.delete(&path, false).await.expect("delete");
            }
            Step::DirectTuned | Step::DirectAsWorker => {
                let (key, part, in_flight) = if step == Step::DirectTuned {
                    ("direct_16x4", 16 * MIB, 4)
                } else {
                    ("direct_8x4", 8 * MIB, 4)
                };
                let path = format!("direct/{key}-r{r}.bin");
                let took = direct_put(&self.op, &path, &self.data, part, in_flight).await;
                assert_eq!(self.op.stat(&path).await.expect("stat").content_length(), size);
                round.spent.insert(key, took);
                eprintln!(
                    "  direct put, {} MiB parts x{in_flight}: {:.2} s ({:.0} MiB/s)",
                    part / MIB,
                    took.wall.as_secs_f64(),
                    mib_s(size, took.wall)
                );
                self.op.delete(&path).await.expect("delete");
            }
            Step::Parallel => {
                let n = self.args.writers;
                let each = size / n;
                let dir = format!("/wb/par-r{r}");
                let started = Mark::now();
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
                    last_stream = last_stream.max(t.await.expect("writer").streamed.wall);
                }
                let acked = started.spent();
                self.client.sync_wait(&dir, Duration::from_secs(1800)).await.expect("persisted");
                let persisted = started.spent();
                round.spent.insert("par_streamed", Spent { wall: last_stream, cpu: f64::NAN });
                round.spent.insert("par_ack", acked);
                round.spent.insert("par_persisted", persisted);
                eprintln!(
                    "  {n} write-back writers x {} MiB: all acked {:.2} s ({:.0} MiB/s aggregate), persisted {:.2} s",
                    each / MIB,
                    acked.wall.as_secs_f64(),
                    mib_s(each * n, acked.wall),
                    persisted.wall.as_secs_f64()
                );
                self.client.delete(&dir, true).await.expect("delete");
            }
            Step::Bracketed => {
                let mut before = self.ceiling_now();
                for t in 0..self.args.trials {
                    if t > 0 {
                        self.fresh_bytes();
                    }
                    let path = format!("/wb/trial-r{r}-{t}.bin");
                    let w = write_file(&self.client, &path, &self.data, self.args.write_size).await;
                    // The upload reads the journal and Garage writes to the same disk: let it
                    // finish before the next ceiling.
                    self.client.sync_wait(&path, Duration::from_secs(1800)).await.expect("persisted");
                    self.client.delete(&path, false).await.expect("delete");
                    settle();
                    let after = self.ceiling_now();
                    let trial = Trial { before, acked: w.acked, streamed: w.streamed, after };
                    let ceiling = (before.best_mib_s(size) + after.best_mib_s(size))
                        / 2.0
                        / self.args.write_replicas as f64;
                    eprintln!(
                        "  bracketed trial {}: ack {:.0} MiB/s, ack ceiling (mean of the stronger ceiling before \
                         and after / {}) {ceiling:.0} MiB/s: {:.2}x",
                        t + 1,
                        mib_s(size, w.acked.wall),
                        self.args.write_replicas,
                        mib_s(size, w.acked.wall) / ceiling
                    );
                    round.trials.push(trial);
                    before = after;
                }
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
        // Figures of skipped steps are NaN and their rows left out.
        let s = |k: &str| round.spent.get(k).map_or(f64::NAN, |t| t.wall.as_secs_f64());
        let cpu = |k: &str| round.spent.get(k).map_or(f64::NAN, |t| t.cpu);
        let rate = |bytes: u64, k: &str| bytes as f64 / MIB as f64 / s(k);
        let ack_ceiling = rate(size, "disk_direct_1") / replicas;
        let ack_ceiling2 = rate(2 * size, "disk_direct_2") / replicas;
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
        if let Some((spent, machine)) = round.whole {
            println!(
                "CPU over the round: {:.0} s wall x {} cores; busy {machine:.0} s, of which this process {:.0} s \
                 (the rest: Garage, kernel threads, other processes)",
                spent.wall.as_secs_f64(),
                std::thread::available_parallelism().map_or(1, |n| n.get()),
                spent.cpu
            );
        }
        let direct_head = if direct.is_finite() { format!("{direct:.0}") } else { "not run".into() };
        println!(
            "| figure | seconds | CPU s | MiB/s | x ack ceiling ({ack_ceiling:.0}) | x ack ceiling, 2 streams \
             ({ack_ceiling2:.0}) | x direct put ({direct_head}) |"
        );
        println!("| --- | --- | --- | --- | --- | --- | --- |");
        let disk = |name: &str, k: &'static str, bytes: u64| (name.to_string(), k, bytes, false);
        let strata = |name: String, k: &'static str, bytes: u64| (name, k, bytes, true);
        let figures = [
            disk("disk: O_DIRECT 8 MiB writes + fdatasync, 1 stream", "disk_direct_1", size),
            disk("disk: O_DIRECT, 2 streams at once (aggregate)", "disk_direct_2", 2 * size),
            disk("disk: buffered 8 MiB writes + fdatasync (as a journal), 1 stream", "disk_buffered_1", size),
            disk("disk: buffered + fdatasync, 2 streams at once (aggregate)", "disk_buffered_2", 2 * size),
            disk("disk: dd if=/dev/zero bs=8M oflag=direct conv=fdatasync", "dd_zeros_1", size),
            strata("write-back: last write returned".into(), "wb_streamed", size),
            strata("write-back: acknowledged (close returned)".into(), "wb_ack", size),
            strata("write-back: persisted (sync_wait returned, from create)".into(), "wb_persisted", size),
            strata("write-through: acknowledged (close returned)".into(), "wt_ack", size),
            strata("direct put: 16 MiB parts, 4 in flight".into(), "direct_16x4", size),
            strata("direct put: 8 MiB parts, 4 in flight (a worker's UFS writer)".into(), "direct_8x4", size),
            strata(
                format!("{} write-back writers x {} MiB: last write returned", args.writers, each / MIB),
                "par_streamed",
                each * args.writers,
            ),
            strata(
                format!("{} write-back writers x {} MiB: all acknowledged", args.writers, each / MIB),
                "par_ack",
                each * args.writers,
            ),
            strata(
                format!("{} write-back writers: all persisted", args.writers),
                "par_persisted",
                each * args.writers,
            ),
        ];
        let mut rows = Vec::new();
        for (name, k, bytes, ratios) in figures {
            if !round.spent.contains_key(k) {
                continue;
            }
            let v = rate(bytes, k);
            let ratio =
                |c: f64| if ratios && c.is_finite() { format!("{:.2}x", v / c) } else { String::new() };
            let cpu_s = if cpu(k).is_finite() { format!("{:.1}", cpu(k)) } else { String::new() };
            println!(
                "| {name} | {:.2} | {cpu_s} | {v:.0} | {} | {} | {} |",
                s(k),
                ratio(ack_ceiling),
                ratio(ack_ceiling2),
                ratio(direct)
            );
            let cpu_json = if cpu(k).is_finite() { json!(cpu(k)) } else { json!(null) };
            rows.push(
                json!({"figure": name, "key": k, "seconds": s(k), "cpu_seconds": cpu_json, "mib_s": v}),
            );
        }
        if round.spent.contains_key("wb_ack") {
            let wb = rate(size, "wb_ack");
            let vs_direct = if direct.is_finite() {
                format!(", {:.2}x the direct put's rate", wb / direct)
            } else {
                String::new()
            };
            println!(
                "write-back ack: {:.2}x of the ack ceiling (1-stream O_DIRECT / {replicas}), {:.2}x with 2 \
                 streams{vs_direct}; streaming {:.2} s + close (journal fsync, commit) {:.2} s",
                wb / ack_ceiling,
                wb / ack_ceiling2,
                s("wb_streamed"),
                s("wb_ack") - s("wb_streamed")
            );
        }
        let trials = report_trials(size, replicas, &round.trials);
        let (wall, cpu_process, cpu_machine) =
            round.whole.map_or((f64::NAN, f64::NAN, f64::NAN), |(t, m)| (t.wall.as_secs_f64(), t.cpu, m));
        all.push(json!({
            "round": r + 1, "load_start": round.load_start, "load_end": round.load_end,
            "round_seconds": wall, "round_cpu_process_seconds": cpu_process, "round_cpu_machine_busy_seconds": cpu_machine,
            "ack_ceiling_mib_s": ack_ceiling, "ack_ceiling_2_streams_mib_s": ack_ceiling2,
            "direct_put_mib_s": direct, "rows": rows, "bracketed": trials,
        }));
    }
    json!({
        "size_bytes": size, "writers": args.writers, "workers": args.workers,
        "write_replicas": args.write_replicas, "write_size": args.write_size, "ufs": args.ufs, "rounds": all,
    })
}

/// Prints the `bracketed` trials of a round and returns them as JSON. Each acknowledgement is
/// compared with the ack ceiling around it: the stronger of 1 stream and 2 streams' aggregate,
/// divided by the replicas (on one machine every replica's journal is on this disk), as the mean
/// of the measurement before and the one after, and as the higher of the two.
fn report_trials(size: u64, replicas: f64, trials: &[Trial]) -> serde_json::Value {
    if trials.is_empty() {
        return json!([]);
    }
    println!();
    println!(
        "bracketed write-back acknowledgements ({} MiB each; ack ceiling = the stronger of 1 O_DIRECT stream and 2 \
         streams' aggregate, / {replicas}, measured just before and just after):",
        size / MIB
    );
    println!(
        "| trial | disk before: 1 stream / 2 streams (MiB/s) | acknowledged MiB/s (streaming + close, s) | CPU s \
         | disk after: 1 / 2 | x mean ack ceiling | x higher ack ceiling |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    let mut out = Vec::new();
    let mut vs_mean = Vec::new();
    for (i, t) in trials.iter().enumerate() {
        let ack = mib_s(size, t.acked.wall);
        let (b, a) = (t.before.best_mib_s(size) / replicas, t.after.best_mib_s(size) / replicas);
        let (mean, higher) = ((b + a) / 2.0, b.max(a));
        vs_mean.push(ack / mean);
        let pair =
            |c: &Ceiling| format!("{:.0} / {:.0}", mib_s(size, c.one.wall), mib_s(2 * size, c.two.wall));
        println!(
            "| {} | {} | {ack:.0} ({:.2} + {:.2}) | {:.1} | {} | {:.2}x | {:.2}x |",
            i + 1,
            pair(&t.before),
            t.streamed.wall.as_secs_f64(),
            (t.acked.wall - t.streamed.wall).as_secs_f64(),
            t.acked.cpu,
            pair(&t.after),
            ack / mean,
            ack / higher
        );
        out.push(json!({
            "trial": i + 1, "ack_mib_s": ack, "ack_seconds": t.acked.wall.as_secs_f64(),
            "streamed_seconds": t.streamed.wall.as_secs_f64(), "ack_cpu_seconds": t.acked.cpu,
            "before_1_stream_mib_s": mib_s(size, t.before.one.wall),
            "before_2_streams_mib_s": mib_s(2 * size, t.before.two.wall),
            "after_1_stream_mib_s": mib_s(size, t.after.one.wall),
            "after_2_streams_mib_s": mib_s(2 * size, t.after.two.wall),
            "ack_ceiling_mean_mib_s": mean, "ack_ceiling_higher_mib_s": higher,
            "x_mean_ceiling": ack / mean, "x_higher_ceiling": ack / higher,
        }));
    }
    vs_mean.sort_by(f64::total_cmp);
    println!(
        "x mean ack ceiling: median {:.2}, lowest {:.2}; {} of {} trials at 0.8x or more",
        vs_mean[vs_mean.len() / 2],
        vs_mean[0],
        vs_mean.iter().filter(|&&x| x >= 0.8).count(),
        vs_mean.len()
    );
    json!(out)
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    assert!(
        args.writers > 0 && args.size >= args.writers,
        "--writers must be between 1 and the size in bytes"
    );
    assert!(args.workers as u32 >= args.write_replicas, "--workers must be at least --write-replicas");
    for step in &args.steps {
        assert!(
            STEPS.iter().any(|s| s.name() == step),
            "--steps {step}: expected write-back, write-through, direct, parallel or bracketed"
        );
    }
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
    client.admin().add_mount("/wb", &format!("{base}/wb"), wb).await.expect("mount /wb");
    let mut wt = ufs_options;
    wt.insert("mode".into(), "write-through".into());
    client.admin().add_mount("/wt", &format!("{base}/wt"), wt).await.expect("mount /wt");

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
        let (started, machine) = (Mark::now(), machine_busy_secs());
        eprintln!("round {} (load {})", r + 1, round.load_start);
        bench.ceilings(&mut round);
        let mut order: Vec<Step> =
            STEPS.into_iter().filter(|s| bench.args.steps.iter().any(|w| w == s.name())).collect();
        if r % 2 == 1 {
            order.reverse();
        }
        for step in order {
            bench.step(step, r, &mut round).await;
        }
        round.load_end = load_average();
        round.whole = Some((started.spent(), machine_busy_secs() - machine));
        rounds.push(round);
    }
    let v = report(&bench.args, &rounds);
    println!("\nload average at end: {}", load_average());
    if let Some(path) = &bench.args.json {
        std::fs::write(path, serde_json::to_string_pretty(&v).expect("json")).expect("write --json file");
    }
}
