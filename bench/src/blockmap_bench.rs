//! The master's block map at scale: heap bytes per (block, holder) entry, measured by a counting
//! allocator (not estimated from type sizes), and how fast it takes reports, answers
//! `locations` and drops a worker.
//!
//! ```text
//! cargo run --release -p strata-bench --bin blockmap_bench -- --files 1000000 --blocks 10
//! cargo run --release -p strata-bench --bin blockmap_bench -- --files 10000000 --blocks 1
//! ```
//!
//! File ids and versions look like real ones (a 43-character file identity, an S3 ETag); each
//! block goes to `--holders` workers of `--workers`, on NVMe, and every fourth one also to DRAM
//! of its first holder (as a hot block is). `--previous N` also loads N entries into the map as
//! it was before it was made compact (strings in two indexes), for the comparison in the same
//! run.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Instant;

use clap::Parser;
use strata_bench::counting::{Counting, live};
use strata_master::for_benchmarks::{BlockMap, BlockReport, Tier};

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[derive(Parser)]
struct Args {
    /// Files (one version each).
    #[arg(long, default_value_t = 1_000_000)]
    files: u64,
    /// Cached blocks per file.
    #[arg(long, default_value_t = 10)]
    blocks: u64,
    /// Workers holding each block.
    #[arg(long, default_value_t = 1)]
    holders: u64,
    /// Workers in the cluster.
    #[arg(long, default_value_t = 8)]
    workers: u64,
    /// Also load this many entries into the previous map, for comparison.
    #[arg(long, default_value_t = 0)]
    previous: u64,
}

fn file_id(f: u64) -> String {
    // The shape of `strata_common::block::file_identity`: a hash of URI, path and block size.
    format!("{:016x}{:016x}-{:09}", f.wrapping_mul(0x9E37_79B9_7F4A_7C15), f ^ 0xdead_beef, f)
}

fn version(f: u64) -> String {
    format!("\"{:032x}\"", u128::from(f).wrapping_mul(0x2545_F491_4F6C_DD1D_0000_0001))
}

/// Every report of the run, generated on the fly (not stored: they would dwarf the map).
fn reports(args: &Args, mut each: impl FnMut(&str, &BlockReport)) {
    let workers: Vec<String> = (0..args.workers).map(|w| format!("worker-{w:032x}")).collect();
    for f in 0..args.files {
        let (fid, ver) = (file_id(f), version(f));
        for b in 0..args.blocks {
            for h in 0..args.holders {
                let w = &workers[((f * 31 + b + h) % args.workers) as usize];
                let r =
                    BlockReport { file_id: fid.clone(), version: ver.clone(), index: b, tier: Tier::Nvme };
                each(w, &r);
                if h == 0 && b % 4 == 0 {
                    each(w, &BlockReport { tier: Tier::Memory, ..r });
                }
            }
        }
    }
}

/// The block map as it was before: (file, version, index) strings in a per-worker set and a
/// per-file tree (kept here only to measure it in the same run).
type PreviousId = (String, String, u64);
type PreviousHolders = BTreeMap<(String, u64), Vec<(String, Tier)>>;

#[derive(Default)]
struct PreviousMap {
    by_worker: HashMap<String, HashSet<(PreviousId, Tier)>>,
    by_file: HashMap<String, PreviousHolders>,
}

impl PreviousMap {
    fn add(&mut self, worker: &str, r: &BlockReport) {
        let id = (r.file_id.clone(), r.version.clone(), r.index);
        if self.by_worker.entry(worker.to_string()).or_default().insert((id.clone(), r.tier)) {
            self.by_file
                .entry(id.0)
                .or_default()
                .entry((id.1, id.2))
                .or_default()
                .push((worker.to_string(), r.tier));
        }
    }
}

fn main() {
    let args = Args::parse();
    let before = live();
    let mut map = BlockMap::default();
    let t = Instant::now();
    let mut entries = 0u64;
    reports(&args, |w, r| {
        map.add(w, r);
        entries += 1;
    });
    let load = t.elapsed();
    let bytes = live() - before;
    assert_eq!(map.total_blocks(), entries, "every report is one (block, holder, tier) entry");
    println!(
        "block map: {} files x {} blocks x {} holders = {} entries (block, holder, tier) in {:.1} s \
         ({:.2} M reports/s)",
        args.files,
        args.blocks,
        args.holders,
        entries,
        load.as_secs_f64(),
        entries as f64 / load.as_secs_f64() / 1e6
    );
    let pairs = args.files * args.blocks * args.holders;
    println!(
        "heap: {:.1} MiB = {:.1} bytes per (block, holder) ({} of them), {:.1} per (block, holder, tier)",
        bytes as f64 / (1 << 20) as f64,
        bytes as f64 / pairs as f64,
        pairs,
        bytes as f64 / entries as f64
    );

    let t = Instant::now();
    let lookups = args.files.min(1_000_000);
    let mut found = 0usize;
    for f in 0..lookups {
        found += map.locations(&file_id(f * 7 % args.files), &version(f * 7 % args.files)).len();
    }
    let dt = t.elapsed();
    assert!(found as u64 >= lookups, "every file has blocks");
    println!("locations: {:.0} files/s ({} lookups)", lookups as f64 / dt.as_secs_f64(), lookups);

    let t = Instant::now();
    map.drop_worker(&format!("worker-{:032x}", 0));
    println!(
        "drop a worker of {}: {:.3} s, {} entries left",
        args.workers,
        t.elapsed().as_secs_f64(),
        map.total_blocks()
    );
    drop(map);

    if args.previous > 0 {
        let cut = Args { files: (args.previous / (args.blocks * args.holders).max(1)).max(1), ..args };
        let before = live();
        let mut old = PreviousMap::default();
        let mut n = 0u64;
        reports(&cut, |w, r| {
            old.add(w, r);
            n += 1;
        });
        let bytes = live() - before;
        let pairs = cut.files * cut.blocks * cut.holders;
        println!(
            "previous map: {} (block, holder), heap {:.1} MiB = {:.1} bytes per (block, holder), {:.1} per (block, holder, tier)",
            pairs,
            bytes as f64 / (1 << 20) as f64,
            bytes as f64 / pairs as f64,
            bytes as f64 / n as f64
        );
        drop(old);
    }
}
