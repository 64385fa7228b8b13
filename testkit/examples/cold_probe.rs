//! Where the time of a cold read goes, step by step, on the S3 named by STRATA_TEST_S3_*: direct
//! opendal 4 MiB ranges, the worker's own UFS read (`OpendalUfs::read_range`: If-Match, one
//! contiguous buffer), and cold 4 MiB blocks through a one-worker cluster, each at 1/4/8 in
//! flight. `--no-nvme` gives the worker no NVMe tier, to see what filling it costs;
//! `--write-through` writes each fetched block to NVMe at once instead of writing it back
//! later (the default). `--strata-only` skips the direct rows (for a profile); `--parallelism N`
//! sets the mount's `ufs_read_parallelism`; `--mib N` sizes the object (256 by default);
//! `--no-cut-through` makes the worker answer a cold read only once its whole block is in. Each
//! row ends with the CPU seconds this process (client and worker) and Garage spent on it, from
//! `/proc`, so a row bound by the two cores can be told from one bound by waiting.
//!
//! A last row reads 64 KiB at the start of each of 32 cold 4 MiB blocks, one at a time (a reader
//! of one record per block), next to direct reads of 64 KiB and of 4 MiB one at a time: with
//! cut-through such a read waits for the store's first 64 KiB, without it for the whole block.
//!
//! ```sh
//! source scripts/garage.sh && garage_start
//! cargo run --release -p strata-testkit --example cold_probe [-- --no-nvme | --write-through | --no-cut-through]
//! ```
use std::time::Instant;

use futures::StreamExt;
use strata_testkit::{Cluster, ClusterOptions, TestUfs, fill_pattern};
use strata_ufs::{OpendalUfs, Ufs};

const MIB: u64 = 1 << 20;

#[tokio::main]
async fn main() {
    let ufs = TestUfs::s3();
    let args: Vec<String> = std::env::args().collect();
    let mib = args.iter().position(|a| a == "--mib").map_or(256, |i| args[i + 1].parse().unwrap());
    let size = mib * MIB;
    let garage = garage_pid();
    let op = ufs.operator();
    let mut w = op.writer_with("p.bin").chunk(16 << 20).await.unwrap();
    let mut off = 0;
    while off < size {
        let mut buf = vec![0u8; (16 * MIB) as usize];
        fill_pattern(1, off, &mut buf);
        off += buf.len() as u64;
        w.write(buf).await.unwrap();
    }
    w.close().await.unwrap();
    let record_blocks = 32u64;
    let mut record = vec![0u8; (record_blocks * 4 * MIB) as usize];
    fill_pattern(2, 0, &mut record);
    op.write("q.bin", record).await.unwrap();
    // `--parallelism N`: the mount's `ufs_read_parallelism` (requests one block read is split into).
    let parallelism = args.iter().position(|a| a == "--parallelism").map(|i| args[i + 1].clone());
    let extra: Vec<(String, String)> =
        parallelism.iter().map(|p| ("ufs_read_parallelism".to_string(), p.clone())).collect();
    let options = ufs.mount_options().into_iter().chain(extra.clone()).collect();
    let u = OpendalUfs::open(&ufs.uri(), &options).unwrap();
    let version = u.stat("p.bin").await.unwrap().version;
    let direct_rows: &[usize] = if args.iter().any(|a| a == "--strata-only") { &[] } else { &[1, 4, 8] };
    for &inflight in direct_rows {
        let t = Instant::now();
        let cpu = Cpu::now(garage);
        futures::stream::iter((0..size).step_by(4 << 20))
            .map(|s| {
                let op = op.clone();
                async move { op.read_with("p.bin").range(s..s + (4 << 20)).await.unwrap().to_bytes().len() }
            })
            .buffered(inflight)
            .for_each(|_| async {})
            .await;
        let direct = size as f64 / MIB as f64 / t.elapsed().as_secs_f64();
        let direct_cpu = cpu.since();
        let t = Instant::now();
        let cpu = Cpu::now(garage);
        futures::stream::iter((0..size).step_by(4 << 20))
            .map(|s| {
                let (u, v) = (&u, &version);
                async move { u.read_range("p.bin", s..s + (4 << 20), v).await.unwrap().len() }
            })
            .buffered(inflight)
            .for_each(|_| async {})
            .await;
        let ufs_rate = size as f64 / MIB as f64 / t.elapsed().as_secs_f64();
        println!(
            "in flight {inflight}: direct {direct:.0} MiB/s ({direct_cpu}), OpendalUfs::read_range {ufs_rate:.0} MiB/s ({})",
            cpu.since()
        );
    }

    if !direct_rows.is_empty() {
        for len in [64 << 10, 4 << 20] {
            let mut waits = Vec::new();
            for i in 0..record_blocks {
                let t = Instant::now();
                let s = i * (4 << 20);
                op.read_with("q.bin").range(s..s + len).await.unwrap();
                waits.push(t.elapsed().as_secs_f64() * 1000.0);
            }
            println!("direct {} KiB one at a time: {}", len >> 10, summary(&mut waits));
        }
        // What a cut-through read of a block's first 64 KiB can wait for at best: the worker's
        // own request for the whole block (If-Match), until its first 64 KiB are in.
        let mut waits = Vec::new();
        let version = u.stat("q.bin").await.unwrap().version;
        for i in 0..record_blocks {
            let t = Instant::now();
            let s = i * (4 << 20);
            let mut pieces = u.read_stream("q.bin", s..s + (4 << 20), &version);
            let mut got = 0;
            while got < 64 << 10 {
                got += pieces.next().await.expect("a piece").unwrap().len();
            }
            waits.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        println!(
            "OpendalUfs::read_stream of 4 MiB, its first 64 KiB, one at a time: {}",
            summary(&mut waits)
        );
    }

    // Through a one-worker cluster: cold 4 MiB blocks at 1, 4 and 8 in flight (a fresh third of
    // the object each time), then the same reader path the benchmark uses.
    let opts = ClusterOptions {
        workers: 1,
        memory_capacity: 2 * size,
        nvme_capacity: if std::env::args().any(|a| a == "--no-nvme") { 0 } else { 2 * size },
        mount_options: [("block_size".into(), "4MiB".into()), ("metadata_ttl".into(), "1h".into())]
            .into_iter()
            .chain(extra)
            .collect(),
        ..ClusterOptions::default()
    };
    let cluster = Cluster::start_with(opts, ufs).await;
    if std::env::args().any(|a| a == "--write-through") {
        cluster.worker(0).blocks.cache().set_writeback_idle(std::time::Duration::ZERO);
    }
    let cut_through = !args.iter().any(|a| a == "--no-cut-through");
    cluster.worker(0).blocks.set_cut_through(cut_through);
    println!("cut-through: {cut_through}");
    let client = cluster.client().await;
    let info = client.stat("/data/p.bin").await.unwrap();
    let blocks = size / (4 << 20);
    for (inflight, range) in [(1usize, 0..blocks / 4), (4, blocks / 4..blocks / 2), (8, blocks / 2..blocks)] {
        let n = range.end - range.start;
        let t = Instant::now();
        let cpu = Cpu::now(garage);
        futures::stream::iter(range)
            .map(|i| {
                let (client, info) = (&client, &info);
                async move { client.read_range_of(info, i * (4 << 20), 4 << 20).await.unwrap().len() }
            })
            .buffered(inflight)
            .for_each(|_| async {})
            .await;
        let rate = (n * 4) as f64 / t.elapsed().as_secs_f64();
        println!("strata cold blocks, in flight {inflight}: {rate:.0} MiB/s ({})", cpu.since());
    }
    let records = client.stat("/data/q.bin").await.unwrap();
    // Each read after the one before, and again each once the block before is whole in the
    // cache (with cut-through an answer ends before its block's fetch does, and the next read
    // would otherwise share the store with that fetch's tail).
    let reads_before = cluster.ufs_reads();
    for (half, isolated) in [(0, false), (1, true)] {
        let mut waits = Vec::new();
        for i in half * record_blocks / 2..(half + 1) * record_blocks / 2 {
            // Every fetch of the blocks before this one has ended.
            let deadline = Instant::now() + std::time::Duration::from_secs(10);
            while isolated && cluster.ufs_reads() < reads_before + i && Instant::now() < deadline {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
            let t = Instant::now();
            client.read_range_of(&records, i * (4 << 20), 64 << 10).await.unwrap();
            waits.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        let how = if isolated { "each after the block before is cached" } else { "back to back" };
        println!("strata cold 64 KiB at a block's start, one at a time, {how}: {}", summary(&mut waits));
    }
}

/// "p50 X ms, mean Y ms" of `ms`.
fn summary(ms: &mut [f64]) -> String {
    ms.sort_by(f64::total_cmp);
    let mean = ms.iter().sum::<f64>() / ms.len() as f64;
    format!("p50 {:.2} ms, mean {mean:.2} ms", ms[ms.len() / 2])
}

/// CPU seconds spent so far by this process and by Garage, and the wall clock.
struct Cpu {
    garage: Option<u32>,
    own: f64,
    store: f64,
    at: Instant,
}

impl Cpu {
    fn now(garage: Option<u32>) -> Self {
        Self {
            garage,
            own: cpu_seconds("self"),
            store: garage.map_or(0.0, |p| cpu_seconds(&p.to_string())),
            at: Instant::now(),
        }
    }

    /// "cpu: this process X s, garage Y s, wall Z s" since `now`.
    fn since(&self) -> String {
        let own = cpu_seconds("self") - self.own;
        let store = self.garage.map_or(0.0, |p| cpu_seconds(&p.to_string())) - self.store;
        format!(
            "cpu: this process {own:.2} s, garage {store:.2} s, wall {:.2} s",
            self.at.elapsed().as_secs_f64()
        )
    }
}

/// utime + stime of `/proc/<pid>/stat`, in seconds.
fn cpu_seconds(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = [11, 12].iter().filter_map(|&i| fields.get(i)?.parse::<f64>().ok()).sum();
    // SAFETY: sysconf has no preconditions.
    ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

fn garage_pid() -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        (std::fs::read_to_string(e.path().join("comm")).ok()?.trim() == "garage").then_some(pid)
    })
}
