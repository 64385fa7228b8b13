//! `disk_bench`: the NVMe tier's engine in use (`NvmeTier`, a file per block through the page
//! cache) against a prototype io_uring / O_DIRECT engine on glommio (`glommio_engine`, slots in
//! one preallocated file), on the same directory, in one run.
//!
//! ```sh
//! cargo build --release -p strata-bench --features glommio --bin disk_bench
//! target/release/disk_bench --dir /path/on/the/nvme --blocks 256
//! ```
//!
//! Without the `glommio` feature only `NvmeTier` is measured. For each engine:
//! - sequential write of `--blocks` blocks of `--block-mib` MiB at 1 and 4 puts in flight: MB/s
//!   when the last `put` returned, and MB/s until the data is on stable storage (one `sync -f`
//!   of the filesystem for `NvmeTier`, one fdatasync of the slot file for glommio, at the end);
//! - sequential read back of every block (`get`, checksums verified), with the page cache
//!   dropped first (`echo 3 > /proc/sys/vm/drop_caches`, needs root) and warm;
//! - random reads of 4 KiB and 64 KiB at 4 KiB-aligned offsets inside random blocks, 1 and 32
//!   in flight, page cache dropped at the start and warm: ops/s, p50, p99. For `NvmeTier` this
//!   row reads and verifies the whole block (`Tier::get`), what the worker did before chunk
//!   checksums; the glommio engine reads and verifies the covering 4 KiB chunks only;
//! - `NvmeTier` only: the same random reads through `Tier::get_range` after reopening the tier,
//!   so every block is unverified and each read checks the 64 KiB chunks it touches — what the
//!   worker does now for a block it has not read whole since it started;
//! - `NvmeTier` only: the same random reads straight from the block file (`locate` + pread, no
//!   checksum — what the sendfile path serves), the bound of a buffered engine with range CRCs;
//! - glommio only: a channel round trip tokio → glommio → tokio without I/O.
//!
//! Results and the conclusion are in docs/BENCHMARKS.md, "Disk engine (NVMe tier)".

#[cfg(feature = "glommio")]
mod glommio_engine;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use bytes::Bytes;
use clap::Parser;
use futures::StreamExt;
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};
use strata_common::BlockKey;
use strata_worker::tier::{NvmeTier, Tier};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

#[derive(Parser, Debug)]
#[command(name = "disk_bench", about = "NVMe tier engines: file per block (page cache) vs glommio O_DIRECT")]
struct Args {
    /// Directory to benchmark in (a temporary directory under $TMPDIR if unset); each engine
    /// gets a subdirectory, removed at the end.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Blocks per sequential write run (two runs per engine, so 2 × blocks × block-mib on disk).
    #[arg(long, default_value_t = 256)]
    blocks: u64,
    /// Block size, MiB.
    #[arg(long, default_value_t = 4)]
    block_mib: usize,
    /// Seconds each random-read configuration runs.
    #[arg(long, default_value_t = 2.0)]
    secs: f64,
    /// Microseconds the glommio executor spins before parking when idle (0: park at once).
    #[arg(long, default_value_t = 0)]
    glommio_spin_us: u64,
    /// Only this engine: `nvme` or `glommio`.
    #[arg(long)]
    engine: Option<String>,
}

enum Engine {
    Nvme(NvmeTier),
    #[cfg(feature = "glommio")]
    Glommio(glommio_engine::GlommioEngine),
}

impl Engine {
    fn name(&self) -> &'static str {
        match self {
            Engine::Nvme(_) => "NvmeTier (file per block, buffered)",
            #[cfg(feature = "glommio")]
            Engine::Glommio(_) => "glommio (O_DIRECT slots)",
        }
    }

    async fn put(&self, key: &BlockKey, data: Bytes) -> anyhow::Result<()> {
        match self {
            Engine::Nvme(t) => Ok(t.put(key, data).await?),
            #[cfg(feature = "glommio")]
            Engine::Glommio(g) => Ok(g.put(key, data).await?),
        }
    }

    async fn get(&self, key: &BlockKey) -> anyhow::Result<Option<Bytes>> {
        match self {
            Engine::Nvme(t) => Ok(t.get(key).await?),
            #[cfg(feature = "glommio")]
            Engine::Glommio(g) => Ok(g.get(key).await?),
        }
    }

    async fn read(&self, key: &BlockKey, offset: usize, len: usize) -> anyhow::Result<Option<Bytes>> {
        match self {
            // The tier's only verified read is the whole block; the worker slices it the same way.
            Engine::Nvme(t) => Ok(t.get(key).await?.map(|b| b.slice(offset..(offset + len).min(b.len())))),
            #[cfg(feature = "glommio")]
            Engine::Glommio(g) => Ok(g.read(key, offset, len).await?),
        }
    }

    fn as_nvme(&self) -> Option<&NvmeTier> {
        match self {
            Engine::Nvme(t) => Some(t),
            #[cfg(feature = "glommio")]
            Engine::Glommio(_) => None,
        }
    }

    /// `NvmeTier` only: the range straight from the block file through the page cache, via
    /// `locate` + pread — what the sendfile path serves, with no checksum verified. The lower
    /// bound of a buffered engine that could verify ranges (per-chunk CRCs), not an engine.
    async fn read_unverified(
        &self,
        key: &BlockKey,
        offset: usize,
        len: usize,
    ) -> anyhow::Result<Option<Bytes>> {
        let Some(t) = self.as_nvme() else { bail!("unverified reads exist for NvmeTier only") };
        let Some((path, data_offset, data_len)) = t.locate(key) else { return Ok(None) };
        let len = len.min((data_len as usize).saturating_sub(offset));
        let read = tokio::task::spawn_blocking(move || -> std::io::Result<Bytes> {
            let mut buf = vec![0u8; len];
            std::fs::File::open(path)?.read_exact_at(&mut buf, data_offset + offset as u64)?;
            Ok(Bytes::from(buf))
        });
        Ok(Some(read.await??))
    }

    /// Makes everything `put` returned for durable.
    async fn sync(&self, dir: &Path) -> anyhow::Result<()> {
        match self {
            Engine::Nvme(_) => sync_fs(dir).await,
            #[cfg(feature = "glommio")]
            Engine::Glommio(g) => Ok(g.sync().await?),
        }
    }

    fn corrupt_blocks(&self) -> u64 {
        match self {
            Engine::Nvme(t) => t.corrupt_blocks(),
            #[cfg(feature = "glommio")]
            Engine::Glommio(g) => g.corrupt_blocks(),
        }
    }
}

/// `sync -f`: syncfs(2) of the filesystem holding `dir`, i.e. every dirty page the tier left.
async fn sync_fs(dir: &Path) -> anyhow::Result<()> {
    let status = tokio::process::Command::new("sync").arg("-f").arg(dir).status().await?;
    ensure!(status.success(), "sync -f {} failed: {status}", dir.display());
    Ok(())
}

/// Writes back and drops the page cache, so the next reads come from the device. Needs root.
async fn drop_caches(dir: &Path) -> anyhow::Result<()> {
    sync_fs(dir).await?;
    std::fs::write("/proc/sys/vm/drop_caches", "3").context("echo 3 > /proc/sys/vm/drop_caches (root?)")
}

struct Row {
    engine: &'static str,
    test: String,
    cache: &'static str,
    value: String,
    p50_us: Option<f64>,
    p99_us: Option<f64>,
}

fn mb_s(bytes: usize, took: Duration) -> String {
    format!("{:.0} MB/s", bytes as f64 / 1e6 / took.as_secs_f64())
}

fn key(set: &str, i: u64) -> BlockKey {
    BlockKey::new(format!("disk-bench/{set}"), "v1", i)
}

/// Puts blocks `0..n` of `set` with `depth` puts in flight; returns the time to the last `put`.
async fn write_set(
    engine: &Engine,
    set: &str,
    n: u64,
    pool: &[Bytes],
    depth: usize,
) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let mut puts = futures::stream::iter(0..n)
        .map(|i| engine.put_owned(key(set, i), pool[i as usize % pool.len()].clone()))
        .buffer_unordered(depth);
    while let Some(done) = puts.next().await {
        done?;
    }
    Ok(start.elapsed())
}

/// Gets blocks `0..n` of `set` in order with `depth` in flight, checking each is whole.
async fn read_set(
    engine: &Engine,
    set: &str,
    n: u64,
    block: usize,
    depth: usize,
) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let mut gets = futures::stream::iter(0..n).map(|i| engine.get_owned(key(set, i))).buffered(depth);
    while let Some(got) = gets.next().await {
        match got? {
            Some(b) if b.len() == block => {}
            Some(b) => bail!("{}: block of {} bytes, expected {block}", engine.name(), b.len()),
            None => bail!("{}: block missing (corrupt: {})", engine.name(), engine.corrupt_blocks()),
        }
    }
    Ok(start.elapsed())
}

impl Engine {
    async fn put_owned(&self, key: BlockKey, data: Bytes) -> anyhow::Result<()> {
        self.put(&key, data).await
    }

    async fn get_owned(&self, key: BlockKey) -> anyhow::Result<Option<Bytes>> {
        self.get(&key).await
    }
}

/// One random-read configuration over the blocks of [`READ_SET`].
#[derive(Clone, Copy)]
struct RandomRun {
    blocks: u64,
    block: usize,
    /// Bytes per read, at a random 4 KiB-aligned offset of a random block.
    size: usize,
    concurrency: usize,
    secs: f64,
    path: ReadPath,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReadPath {
    /// `Engine::read`: the whole block read and verified (NvmeTier), or the covering chunks
    /// (glommio).
    Checked,
    /// `Tier::get_range` of an unverified block: the covering 64 KiB chunks read and verified.
    Chunks,
    /// `Engine::read_unverified`: locate + pread, no check.
    Unverified,
}

/// The write set every read test reads.
const READ_SET: &str = "d1";

/// `run.concurrency` tasks reading for `run.secs`; returns (ops/s, p50 µs, p99 µs).
async fn random_reads(engine: &Arc<Engine>, run: RandomRun) -> anyhow::Result<(f64, f64, f64)> {
    let RandomRun { blocks: n, block, size, concurrency, secs, path } = run;
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let start = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|t| {
            let engine = Arc::clone(engine);
            tokio::spawn(async move {
                let mut rng = StdRng::seed_from_u64(t as u64);
                let mut lat = Vec::new();
                let slots = (block - size) / (4 * KIB) + 1;
                while Instant::now() < deadline {
                    let k = key(READ_SET, rng.random_range(0..n));
                    let offset = rng.random_range(0..slots) * 4 * KIB;
                    let began = Instant::now();
                    let read = match path {
                        ReadPath::Checked => engine.read(&k, offset, size).await?,
                        ReadPath::Unverified => engine.read_unverified(&k, offset, size).await?,
                        ReadPath::Chunks => {
                            let Some(t) = engine.as_nvme() else {
                                bail!("get_range is measured on NvmeTier")
                            };
                            t.get_range(&k, offset as u64..(offset + size) as u64).await?
                        }
                    };
                    match read {
                        Some(b) if b.len() == size => {}
                        other => bail!("{}: bad random read: {:?}", engine.name(), other.map(|b| b.len())),
                    }
                    lat.push(began.elapsed());
                }
                anyhow::Ok(lat)
            })
        })
        .collect();
    let mut lat = Vec::new();
    for task in tasks {
        lat.extend(task.await??);
    }
    let took = start.elapsed();
    lat.sort_unstable();
    let pct = |p: f64| lat[((lat.len() - 1) as f64 * p / 100.0).round() as usize].as_secs_f64() * 1e6;
    Ok((lat.len() as f64 / took.as_secs_f64(), pct(50.0), pct(99.0)))
}

async fn bench_engine(engine: Engine, dir: &Path, args: &Args, pool: &[Bytes]) -> anyhow::Result<Vec<Row>> {
    let engine = Arc::new(engine);
    let name = engine.name();
    let block = args.block_mib * MIB;
    let n = args.blocks;
    let total = n as usize * block;
    let mut rows = Vec::new();
    let mut row = |test: String, cache: &'static str, value: String, lat: Option<(f64, f64)>| {
        let lat_text = lat.map_or(String::new(), |(p50, p99)| format!("p50 {p50:.0} µs, p99 {p99:.0} µs"));
        println!("  {test:<48} {cache:<8} {value:>14} {lat_text}");
        rows.push(Row {
            engine: name,
            test,
            cache,
            value,
            p50_us: lat.map(|l| l.0),
            p99_us: lat.map(|l| l.1),
        });
    };
    println!("{name}:");

    // Sequential writes: set "d1" at depth 1 (the set every read uses), "d4" at depth 4.
    for (set, depth) in [(READ_SET, 1), ("d4", 4)] {
        drop_caches(dir).await?;
        let put = write_set(&engine, set, n, pool, depth).await?;
        let synced = Instant::now();
        engine.sync(dir).await?;
        let durable = put + synced.elapsed();
        row(format!("seq write {n}×{} MiB, {depth} in flight", args.block_mib), "-", mb_s(total, put), None);
        row(format!("  … until durable (+ final sync), {depth} in flight"), "-", mb_s(total, durable), None);
    }

    for depth in [1, 4] {
        drop_caches(dir).await?;
        let cold = read_set(&engine, READ_SET, n, block, depth).await?;
        row(
            format!("seq read {n}×{} MiB, {depth} in flight", args.block_mib),
            "dropped",
            mb_s(total, cold),
            None,
        );
        let warm = read_set(&engine, READ_SET, n, block, depth).await?;
        row(
            format!("seq read {n}×{} MiB, {depth} in flight", args.block_mib),
            "warm",
            mb_s(total, warm),
            None,
        );
    }

    // The unverified and chunk passes exist for NvmeTier only: see `ReadPath`.
    let passes: &[ReadPath] = if engine.as_nvme().is_some() {
        &[ReadPath::Checked, ReadPath::Unverified, ReadPath::Chunks]
    } else {
        &[ReadPath::Checked]
    };
    let mut engine = engine;
    for &path in passes {
        if path == ReadPath::Chunks {
            // Reopened, every block is unverified, and range reads do not verify it.
            let capacity = engine.as_nvme().map(|t| t.usage().capacity_bytes).unwrap_or_default();
            drop(engine);
            engine = Arc::new(Engine::Nvme(NvmeTier::open(dir, capacity)?));
        }
        for size in [4 * KIB, 64 * KIB] {
            for concurrency in [1, 32] {
                let how = match path {
                    ReadPath::Checked if engine.as_nvme().is_some() => ": whole block get (checked)",
                    ReadPath::Checked => "",
                    ReadPath::Unverified => ": locate+pread, UNVERIFIED",
                    ReadPath::Chunks => ": get_range, 64 KiB chunks checked",
                };
                let test = format!("random {} KiB reads, {concurrency} in flight{how}", size / KIB);
                let run = RandomRun { blocks: n, block, size, concurrency, secs: args.secs, path };
                drop_caches(dir).await?;
                let (ops, p50, p99) = random_reads(&engine, run).await?;
                row(test.clone(), "dropped", format!("{ops:.0} ops/s"), Some((p50, p99)));
                // Warm: every block read once, so a buffered engine serves from the page cache
                // (for the chunk pass without verifying anything, so its blocks stay unverified).
                if path == ReadPath::Chunks {
                    warm_unverified(&engine, n, block).await?;
                } else {
                    read_set(&engine, READ_SET, n, block, 4).await?;
                }
                let (ops, p50, p99) = random_reads(&engine, run).await?;
                row(test, "warm", format!("{ops:.0} ops/s"), Some((p50, p99)));
            }
        }
    }
    #[cfg(feature = "glommio")]
    if let Engine::Glommio(g) = &*engine {
        let mut lat = Vec::new();
        let secs = args.secs.min(1.0);
        let deadline = Instant::now() + Duration::from_secs_f64(secs);
        while Instant::now() < deadline {
            let began = Instant::now();
            g.ping().await?;
            lat.push(began.elapsed());
        }
        lat.sort_unstable();
        let pct = |p: f64| lat[((lat.len() - 1) as f64 * p / 100.0).round() as usize].as_secs_f64() * 1e6;
        let rate = format!("{:.0} ops/s", lat.len() as f64 / secs);
        row(
            "channel round trip tokio → glommio → tokio, no I/O".into(),
            "-",
            rate,
            Some((pct(50.0), pct(99.0))),
        );
    }
    ensure!(
        engine.corrupt_blocks() == 0,
        "{name}: {} corrupt blocks during the run",
        engine.corrupt_blocks()
    );
    Ok(rows)
}

/// Reads every block of the read set through the page cache without verifying it.
async fn warm_unverified(engine: &Arc<Engine>, n: u64, block: usize) -> anyhow::Result<()> {
    for i in 0..n {
        engine.read_unverified(&key(READ_SET, i), 0, block).await?;
    }
    Ok(())
}

/// Blocks of random bytes; block `i` of a set uses `pool[i % len]` (content does not matter to
/// the device, and generating a fresh block per put would time the RNG).
fn data_pool(block: usize) -> Vec<Bytes> {
    let mut rng = StdRng::seed_from_u64(42);
    (0..8)
        .map(|_| {
            let mut v = vec![0u8; block];
            rng.fill_bytes(&mut v);
            Bytes::from(v)
        })
        .collect()
}

#[cfg(feature = "glommio")]
async fn start_glommio(dir: &Path, slots: u64, max_block: usize, spin_us: u64) -> anyhow::Result<Engine> {
    let spin_before_park = (spin_us > 0).then(|| Duration::from_micros(spin_us));
    let config = glommio_engine::EngineConfig { dir: dir.to_path_buf(), slots, max_block, spin_before_park };
    let engine = glommio_engine::GlommioEngine::start(config).await.context("starting the glommio engine")?;
    Ok(Engine::Glommio(engine))
}

/// Damages blocks behind the glommio engine's back and checks that reads turn them into
/// misses — the benchmark's own guard that the prototype verifies what it serves.
#[cfg(feature = "glommio")]
async fn self_check_glommio(dir: &Path, pool: &[Bytes]) -> anyhow::Result<()> {
    use std::os::unix::fs::FileExt;

    use glommio_engine::GlommioEngine;

    let block = pool[0].len();
    let config = glommio_engine::EngineConfig {
        dir: dir.to_path_buf(),
        slots: 3,
        max_block: block,
        spin_before_park: None,
    };
    let engine = GlommioEngine::start(config).await?;
    for i in 0..3 {
        engine.put(&key("check", i), pool[i as usize].clone()).await?;
    }
    for i in 0..3 {
        let got = engine.get(&key("check", i)).await?;
        ensure!(got.as_deref() == Some(&pool[i as usize][..]), "self-check: block {i} read back differently");
        let range = engine.read(&key("check", i), 5000, 70000).await?;
        ensure!(
            range.as_deref() == Some(&pool[i as usize][5000..75000]),
            "self-check: range of block {i} differs"
        );
    }
    // Slots are handed out from 0 upwards, so block i sits in slot i.
    let file = std::fs::OpenOptions::new().write(true).open(dir.join("slots.dat"))?;
    let (_, data0) = GlommioEngine::slot_offsets(0, block);
    file.write_all_at(&[!pool[0][block / 2]], data0 + (block / 2) as u64)?;
    let (header1, _) = GlommioEngine::slot_offsets(1, block);
    file.write_all_at(&[0xff], header1 + 30)?;
    file.sync_all()?;
    ensure!(engine.get(&key("check", 0)).await?.is_none(), "self-check: flipped data byte was served");
    ensure!(engine.read(&key("check", 1), 0, 4096).await?.is_none(), "self-check: damaged header was served");
    ensure!(engine.read(&key("check", 2), 0, 4096).await?.is_some(), "self-check: intact block missed");
    ensure!(
        engine.corrupt_blocks() == 2,
        "self-check: {} corrupt blocks counted, expected 2",
        engine.corrupt_blocks()
    );
    drop(engine);
    std::fs::remove_dir_all(dir)?;
    println!("glommio self-check passed (round trip, ranges, damaged data and header are misses)");
    Ok(())
}

fn print_table(rows: &[Row]) {
    println!("\n| engine | test | page cache | throughput | p50 µs | p99 µs |");
    println!("|---|---|---|---|---|---|");
    let us = |v: Option<f64>| v.map_or("".to_string(), |v| format!("{v:.0}"));
    for r in rows {
        println!(
            "| {} | {} | {} | {} | {} | {} |",
            r.engine,
            r.test,
            r.cache,
            r.value,
            us(r.p50_us),
            us(r.p99_us)
        );
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let tmp;
    let root = match &args.dir {
        Some(dir) => dir.clone(),
        None => {
            tmp = tempfile::Builder::new().prefix("disk_bench").tempdir()?;
            tmp.path().to_path_buf()
        }
    };
    let block = args.block_mib * MIB;
    let pool = data_pool(block);
    let wants = |e: &str| args.engine.as_deref().is_none_or(|w| w == e);
    println!("disk_bench: dir {}, {} blocks × {} MiB per set", root.display(), args.blocks, args.block_mib);

    let mut rows = Vec::new();
    if wants("nvme") {
        let dir = root.join("nvme");
        // Room for both write sets; nothing is evicted during the run.
        let capacity = 2 * args.blocks * block as u64 + block as u64;
        let tier = NvmeTier::open(&dir, capacity)?;
        rows.extend(bench_engine(Engine::Nvme(tier), &dir, &args, &pool).await?);
        std::fs::remove_dir_all(&dir)?;
    }
    #[cfg(feature = "glommio")]
    if wants("glommio") {
        self_check_glommio(&root.join("glommio-check"), &pool).await?;
        let dir = root.join("glommio");
        let engine = start_glommio(&dir, 2 * args.blocks, block, args.glommio_spin_us).await?;
        rows.extend(bench_engine(engine, &dir, &args, &pool).await?);
        std::fs::remove_dir_all(&dir)?;
    }
    #[cfg(not(feature = "glommio"))]
    if wants("glommio") {
        println!("(built without the `glommio` feature: only NvmeTier measured)");
    }
    print_table(&rows);
    Ok(())
}
