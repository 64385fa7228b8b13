//! Hit ratios of the block tiers' eviction policy (S3-FIFO, `strata_worker::tier::S3Fifo`)
//! against plain LRU, replaying synthetic traces of equal-size blocks through both:
//!
//! - a hot set (20% of the cache) read twice, then read in turns with a one-pass scan of 3× the
//!   cache, in two interleavings: `stretches` (one pass over the hot set after every
//!   cache-sized stretch of the scan) and `uniform` (one hot read after every `--scan-per-hot`
//!   scan reads);
//! - Zipf-distributed reads over `--keys` keys with a cache of `--cache-fraction` of them, for
//!   s = 0.9 and 1.1 (the first 10% of the requests warm the cache and are not counted).
//!
//! ```text
//! cargo run --release -p strata-bench --bin eviction_bench
//! ```
//!
//! Only the policies run (no tier, no I/O): this measures which blocks stay, not how fast.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use clap::Parser;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use strata_worker::tier::S3Fifo;

#[derive(Parser)]
#[command(about = "Hit ratios of S3-FIFO (the block tiers' eviction) against LRU on synthetic traces")]
struct Args {
    /// Cache size in blocks for the scan traces.
    #[arg(long, default_value_t = 10_000)]
    capacity: u64,
    /// Scan reads between two hot-set reads in the `uniform` scan trace (above 4, a hot block's
    /// reuse distance exceeds the cache).
    #[arg(long, default_value_t = 5)]
    scan_per_hot: u64,
    /// Keys of the Zipf traces.
    #[arg(long, default_value_t = 100_000)]
    keys: u64,
    /// Cache size of the Zipf traces, as a fraction of the keys.
    #[arg(long, default_value_t = 0.1)]
    cache_fraction: f64,
    /// Requests of each Zipf trace.
    #[arg(long, default_value_t = 2_000_000)]
    requests: u64,
    /// Seed of the Zipf traces.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// A cache of unit-size blocks that says whether each access hit.
trait Policy {
    fn name(&self) -> &'static str;
    fn access(&mut self, key: u64) -> bool;
}

struct Fifo3(S3Fifo<u64>);

impl Policy for Fifo3 {
    fn name(&self) -> &'static str {
        "S3-FIFO"
    }

    fn access(&mut self, key: u64) -> bool {
        if self.0.touch(&key) {
            return true;
        }
        // What a tier's put does: make room, then insert.
        self.0.victims(1, |_| false).expect("nothing is pinned");
        self.0.insert(key, 1);
        false
    }
}

struct Lru {
    capacity: usize,
    ticks: HashMap<u64, u64>,
    order: BTreeMap<u64, u64>,
    next_tick: u64,
}

impl Lru {
    fn new(capacity: u64) -> Self {
        Self { capacity: capacity as usize, ticks: HashMap::new(), order: BTreeMap::new(), next_tick: 0 }
    }
}

impl Policy for Lru {
    fn name(&self) -> &'static str {
        "LRU"
    }

    fn access(&mut self, key: u64) -> bool {
        let tick = self.next_tick;
        self.next_tick += 1;
        let hit = match self.ticks.insert(key, tick) {
            Some(old) => {
                self.order.remove(&old);
                true
            }
            None => false,
        };
        if !hit
            && self.ticks.len() > self.capacity
            && let Some((_, oldest)) = self.order.pop_first()
        {
            self.ticks.remove(&oldest);
        }
        self.order.insert(tick, key);
        hit
    }
}

fn policies(capacity: u64) -> Vec<Box<dyn Policy>> {
    vec![Box::new(Fifo3(S3Fifo::new(capacity))), Box::new(Lru::new(capacity))]
}

#[derive(Default)]
struct Count {
    reads: u64,
    hits: u64,
}

impl Count {
    fn add(&mut self, hit: bool) {
        self.reads += 1;
        self.hits += hit as u64;
    }

    fn ratio(&self) -> f64 {
        self.hits as f64 / self.reads.max(1) as f64
    }
}

/// Hot keys are `0..hot`, scan keys start far above them.
fn scan_trace(args: &Args, uniform: bool) {
    let capacity = args.capacity;
    let hot = capacity / 5;
    let scan_len = 3 * capacity;
    let first_scan_key = 1 << 40;
    let what = if uniform {
        format!("uniform, {} scan reads per hot read", args.scan_per_hot)
    } else {
        "stretches of one cache of scan between hot passes".to_string()
    };
    println!("hot set {hot} blocks of a {capacity}-block cache, scan {scan_len} blocks ({what}):");
    for mut policy in policies(capacity) {
        let started = Instant::now();
        for k in (0..hot).chain(0..hot) {
            policy.access(k);
        }
        let (mut hot_count, mut all) = (Count::default(), Count::default());
        let mut next_hot = 0;
        let mut read_hot = |policy: &mut Box<dyn Policy>, hot_count: &mut Count, all: &mut Count| {
            let hit = policy.access(next_hot);
            next_hot = (next_hot + 1) % hot;
            hot_count.add(hit);
            all.add(hit);
        };
        for (i, scan_key) in (first_scan_key..first_scan_key + scan_len).enumerate() {
            all.add(policy.access(scan_key));
            let i = i as u64 + 1;
            if uniform && i.is_multiple_of(args.scan_per_hot) {
                read_hot(&mut policy, &mut hot_count, &mut all);
            }
            if !uniform && (i.is_multiple_of(capacity) || i == scan_len) {
                for _ in 0..hot {
                    read_hot(&mut policy, &mut hot_count, &mut all);
                }
            }
        }
        println!(
            "  {:<8} hot-set hit ratio {:.3}   overall {:.3}   ({} hot reads, {:.0} ns/access)",
            policy.name(),
            hot_count.ratio(),
            all.ratio(),
            hot_count.reads,
            started.elapsed().as_nanos() as f64 / (2 * hot + all.reads) as f64
        );
    }
}

/// Ranks 1..=n with P(k) ∝ k^-s, by inverting the cumulative distribution (exact, O(log n)
/// per sample after an O(n) table).
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: u64, s: f64) -> Self {
        let mut cdf = Vec::with_capacity(n as usize);
        let mut total = 0.0;
        for k in 1..=n {
            total += (k as f64).powf(-s);
            cdf.push(total);
        }
        for p in &mut cdf {
            *p /= total;
        }
        Self { cdf }
    }

    /// A rank from 0 (the most popular) to n - 1.
    fn sample(&self, rng: &mut impl Rng) -> u64 {
        let u: f64 = rng.random();
        self.cdf.partition_point(|&p| p < u).min(self.cdf.len() - 1) as u64
    }
}

fn zipf_trace(args: &Args, s: f64) {
    let capacity = ((args.keys as f64 * args.cache_fraction) as u64).max(1);
    let zipf = Zipf::new(args.keys, s);
    let warmup = args.requests / 10;
    println!(
        "Zipf s={s}: {} keys, cache {capacity} blocks, {} requests ({warmup} warm-up):",
        args.keys, args.requests
    );
    for mut policy in policies(capacity) {
        // The same trace for every policy.
        let mut rng = StdRng::seed_from_u64(args.seed);
        let started = Instant::now();
        let mut count = Count::default();
        for i in 0..args.requests {
            let hit = policy.access(zipf.sample(&mut rng));
            if i >= warmup {
                count.add(hit);
            }
        }
        println!(
            "  {:<8} hit ratio {:.3}   ({:.0} ns/access, sampling included)",
            policy.name(),
            count.ratio(),
            started.elapsed().as_nanos() as f64 / args.requests as f64
        );
    }
}

fn main() {
    let args = Args::parse();
    assert!(args.capacity >= 5 && args.scan_per_hot > 0, "--capacity of 5 or more, --scan-per-hot above 0");
    assert!(args.keys > 0 && args.cache_fraction > 0.0, "--keys and --cache-fraction above 0");
    println!("eviction_bench (load average {})", strata_bench::load_average());
    scan_trace(&args, false);
    scan_trace(&args, true);
    for s in [0.9, 1.1] {
        zipf_trace(&args, s);
    }
}
