//! `strata-bench`: the data plane against this machine's own ceilings, measured in one run.
//!
//! ```sh
//! cargo run --release -p strata-bench --bin strata-bench                  # local dir UFS
//! cargo run --release -p strata-bench --bin strata-bench -- --ufs s3      # STRATA_TEST_S3_*
//! ```
//!
//! It starts an in-process cluster (a master and `--workers` workers on 127.0.0.1:0) over the
//! chosen UFS and measures, each next to the ceiling it is compared with:
//! - sequential read of one large file, cold (vs a direct opendal read of the same object,
//!   4 MiB ranges 4 in flight) and warm, through `read` and through `next_chunk` (vs a
//!   loopback TCP stream: the best of tokio task pairs and plain thread pairs, measured before
//!   the cluster starts and again after the warm reads);
//! - random reads of 4 KiB, 64 KiB and 1 MiB at concurrency 1, 8, 64 on the warm file (vs
//!   `pread` of the same sizes at the same concurrency from a page-cached local file);
//! - many small files, cold and warm (vs direct opendal reads of the same files);
//! - short-circuit reads from the cluster's workers through the sockets they advertise, and
//!   from a co-located sidecar (an in-process sidecar worker on a Unix
//!   socket, blocks in its DRAM tier or on its NVMe tier, the client mapping the descriptors it
//!   passes): warm sequential and random reads vs the same page-cache ceilings, next to the
//!   framed read through the same socket. Random short-circuit answers are copied into the
//!   reader's buffer, as `pread` copies;
//! - what TLS costs on the warm sequential read: each worker also serves its data plane with
//!   TLS on a second port (the same blocks in the same DRAM tier), a second client reads over
//!   it, and plain and TLS runs alternate (`--tls-rounds` each; the best of each is reported,
//!   every run is in the JSON). `--tls-only` skips everything but the ceiling and these rows.
//!
//! The table goes to stdout; `--json PATH` writes every figure machine-readably.

use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use futures::StreamExt;
use rand::Rng;
use serde_json::{Value, json};
use strata_bench::{direct_read, put_pattern_object};
use strata_client::{Client, FileInfo, QosClass};
use strata_common::sched::ThreadPriority;
use strata_testkit::{Cluster, ClusterOptions, TestUfs, fill_pattern};
use strata_worker::WorkerConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

#[derive(Parser, Debug)]
#[command(name = "strata-bench", about = "Strata's data plane against this machine's ceilings, in one run")]
struct Args {
    /// Under file system: `fs` (a temporary local directory) or `s3` (the endpoint in
    /// STRATA_TEST_S3_*, e.g. Garage from scripts/garage.sh).
    #[arg(long, default_value = "fs")]
    ufs: String,
    /// Size of the sequentially read file, MiB.
    #[arg(long, default_value_t = 1024)]
    size_mib: u64,
    /// Block size of the mount, MiB.
    #[arg(long, default_value_t = 4)]
    block_mib: u64,
    /// Workers in the cluster.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Seconds each random-read configuration runs.
    #[arg(long, default_value_t = 2.0)]
    secs: f64,
    /// Small files read cold then warm.
    #[arg(long, default_value_t = 1000)]
    small_files: u64,
    /// Size of each small file, KiB.
    #[arg(long, default_value_t = 64)]
    small_kib: u64,
    /// Largest readahead window of a sequential reader, blocks (the client's default if unset).
    #[arg(long)]
    readahead: Option<usize>,
    /// Skip the short-circuit (sidecar) rows.
    #[arg(long)]
    no_short_circuit: bool,
    /// Runs each of the warm sequential read with TLS off and on (alternating); 0 skips them.
    #[arg(long, default_value_t = 3)]
    tls_rounds: usize,
    /// Only the loopback ceiling and the TLS off/on rows.
    #[arg(long)]
    tls_only: bool,
    /// Write every figure as JSON to this file too.
    #[arg(long)]
    json: Option<PathBuf>,
    /// For each random-read configuration, print when its slow requests (over 10 ms) started,
    /// grouped into bursts, next to the lateness of a 1 ms timer on the runtime and on a plain
    /// thread: a burst both timers saw is the whole process (or the VM) stalling, one only the
    /// runtime timer saw is a runtime thread blocked, one neither saw is inside the read path.
    #[arg(long)]
    tail_probe: bool,
    /// Only the sequential rows and the random reads (no small files, TLS or short-circuit).
    #[arg(long)]
    random_only: bool,
    /// Warm sequential reads of the large file (the best is reported); raise it to profile
    /// the warm path, e.g. under `perf record`, with the cold read a small part of the run.
    #[arg(long, default_value_t = 2)]
    warm_rounds: usize,
    /// Runs each of warm 4 KiB random reads (concurrency 1 and 8) by a client recording lineage
    /// under a job and by one with lineage off, alternating; 0 skips them. The best of each is
    /// reported, every run is in the JSON.
    #[arg(long, default_value_t = 0)]
    lineage_rounds: usize,
    /// Runs of warm 4 KiB random reads (one at a time) alone, then during a flood of 1 MiB
    /// reads at 64 in flight by another client, the reader in the latency class and in the
    /// flood's (throughput) class, alternating; 0 skips them. Reports each p99 against the
    /// p99 alone (docs/QOS.md).
    #[arg(long, default_value_t = 0)]
    qos_rounds: usize,
    /// The workers' `qos_slots` (answers sent at once before the rest wait by class); unset:
    /// the worker's default.
    #[arg(long)]
    qos_slots: Option<usize>,
    /// The scheduling priority (nice, -20..19) of the measured 4 KiB reader's thread in the
    /// `--qos-rounds` rows, and of both threads of their plain-thread ceiling: -10 runs the
    /// reader as a latency-class process would be run on a shared host (`nice -n -10`, or CPUs
    /// of its own), at the priority of the worker's latency lane. Negative values need root.
    #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
    qos_reader_nice: i32,
    /// The scheduling slice, in microseconds, the measured reader's thread and the plain-thread
    /// ceiling's threads ask the kernel for (as the worker's latency lane does with
    /// `qos_latency_slice_us`); 0 keeps the kernel's default.
    #[arg(long, default_value_t = 0)]
    qos_reader_slice_us: u64,
    /// The workers' `qos_latency_slice_us`; unset: the worker's default.
    #[arg(long)]
    qos_lane_slice_us: Option<u32>,
    /// Workers answer a cold read only once its whole block is in (their `cut_through = false`),
    /// to compare with cut-through (the default).
    #[arg(long)]
    no_cut_through: bool,
}

/// One line of the report: a Strata figure next to its ceiling.
struct Row {
    name: String,
    unit: &'static str,
    value: f64,
    ceiling_name: &'static str,
    ceiling: f64,
    extra: Value,
}

/// A random-read row: ops/s and latency percentiles against `pread` of the same reads.
fn random_row(name: String, strata: &Latencies, ceiling: &Latencies) -> Row {
    Row {
        name,
        unit: "ops/s",
        value: strata.ops_per_sec(),
        ceiling_name: "pread from page cache",
        ceiling: ceiling.ops_per_sec(),
        extra: json!({
            "p50_us": strata.percentile_us(50.0), "p99_us": strata.percentile_us(99.0),
            "p999_us": strata.percentile_us(99.9),
            "ceiling_p50_us": ceiling.percentile_us(50.0), "ceiling_p99_us": ceiling.percentile_us(99.0),
        }),
    }
}

fn mib_s(bytes: u64, took: Duration) -> f64 {
    bytes as f64 / MIB as f64 / took.as_secs_f64()
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let size = args.size_mib * MIB;
    let ufs = match args.ufs.as_str() {
        "fs" => TestUfs::fs(),
        "s3" => TestUfs::s3(),
        other => panic!("--ufs {other}: expected fs or s3"),
    };
    let scratch = tempfile::tempdir().expect("scratch dir");
    let mut rows = Vec::new();

    eprintln!("ceiling: loopback TCP stream of {} MiB (tokio and thread pairs)", args.size_mib);
    let tcp = tcp_ceiling(size).await;

    eprintln!("writing the {} MiB file to the UFS ({})", args.size_mib, ufs.name());
    let op = ufs.operator();
    put_pattern_object(&op, "big.bin", size, 7).await;
    let local = scratch.path().join("big.local");
    write_local(&local, size);

    eprintln!("ceiling: page-cache read of a local file");
    let page_cache = page_cache_ceiling(&local, size);
    eprintln!("ceiling: direct opendal read of the object");
    let direct = direct_read(&op, "big.bin", size, 4 * MIB, 4).await;

    let opts = ClusterOptions {
        workers: args.workers,
        memory_capacity: size + 256 * MIB,
        nvme_capacity: 2 * size + 256 * MIB,
        mount_options: vec![
            ("block_size".into(), format!("{}MiB", args.block_mib)),
            ("metadata_ttl".into(), "1h".into()),
        ],
        // For the co-located row; the TCP rows' client turns short-circuit off.
        local_sockets: !args.no_short_circuit,
        qos_slots: args.qos_slots.unwrap_or(strata_worker::classes::DEFAULT_QOS_SLOTS),
        qos_latency_slice_us: args
            .qos_lane_slice_us
            .unwrap_or(strata_worker::config::DEFAULT_QOS_LATENCY_SLICE_US),
        ..ClusterOptions::default()
    };
    let cluster = Cluster::start_with(opts, ufs).await;
    for i in 0..args.workers {
        cluster.worker(i).blocks.set_cut_through(!args.no_cut_through);
    }
    let mut config = cluster.client_config();
    config.short_circuit = false;
    if let Some(blocks) = args.readahead {
        config.readahead_blocks = blocks;
    }
    let readahead = config.readahead_blocks;
    let client = Client::connect(config).await.expect("connect");

    eprintln!("strata: sequential cold, then warm");
    let cold = seq_read(&client, "/data/big.bin", size).await;
    let mut warm_best = Duration::MAX;
    let mut chunks_best = Duration::MAX;
    // Alternating, so both see the same machine, and the ceiling measured again among them:
    // the best of everything it measured is the one the warm rows are held to.
    for _ in 0..args.warm_rounds.max(1) {
        warm_best = warm_best.min(seq_read(&client, "/data/big.bin", size).await);
        chunks_best = chunks_best.min(seq_read_chunks(&client, "/data/big.bin", size).await);
    }
    let tcp = tcp.min(tcp_ceiling(size).await);
    rows.push(Row {
        name: format!("sequential {} MiB cold", args.size_mib),
        unit: "MiB/s",
        value: mib_s(size, cold),
        ceiling_name: "direct opendal read",
        ceiling: mib_s(size, direct),
        extra: json!({}),
    });
    let warm_row = |how: &str, took: Duration, extra: Value| Row {
        name: format!("sequential {} MiB warm{how}", args.size_mib),
        unit: "MiB/s",
        value: mib_s(size, took),
        ceiling_name: "loopback TCP stream",
        ceiling: mib_s(size, tcp),
        extra,
    };
    rows.push(warm_row("", warm_best, json!({"page_cache_read_mib_s": mib_s(size, page_cache)})));
    // `read` copies each block into the caller's buffer once more than the ceiling's receiver
    // does; `next_chunk` hands out the received block as it is, as the ceiling keeps its bytes.
    rows.push(warm_row(", next_chunk", chunks_best, json!({})));

    if args.tls_rounds > 0 {
        rows.extend(tls_rows(&args, &cluster, &client, size, tcp).await);
    }
    if args.tls_only {
        print_table(&args, readahead, &rows);
        write_json(&args, readahead, &rows, json!({"loopback_tcp_mib_s": mib_s(size, tcp)}));
        return;
    }

    let info = client.stat("/data/big.bin").await.expect("stat");
    let run_for = Duration::from_secs_f64(args.secs);
    for len in [4 * KIB, 64 * KIB, MIB] {
        for concurrency in [1usize, 8, 64] {
            eprintln!("random {} KiB reads at concurrency {concurrency}", len / KIB);
            let probe = args.tail_probe.then(|| TimerProbe::start(run_for));
            let strata = random_reads(&client, &info, len, concurrency, run_for, false).await;
            if let Some(probe) = probe {
                probe.report(&strata).await;
            }
            let ceiling = pread_ceiling(&local, size, len, concurrency, run_for);
            rows.push(random_row(format!("random {} KiB x{concurrency}", len / KIB), &strata, &ceiling));
        }
    }

    if args.lineage_rounds > 0 {
        rows.extend(lineage_rows(&args, &cluster, &info, run_for).await);
    }
    if args.qos_rounds > 0 {
        rows.extend(qos_rows(&args, &cluster, &info, run_for).await);
    }

    if args.random_only {
        print_table(&args, readahead, &rows);
        write_json(&args, readahead, &rows, json!({"loopback_tcp_mib_s": mib_s(size, tcp)}));
        return;
    }

    eprintln!("{} small files of {} KiB", args.small_files, args.small_kib);
    let small_len = args.small_kib * KIB;
    let names: Vec<String> =
        (0..args.small_files).map(|i| format!("small/{:02}/f{i:05}.bin", i / 1000)).collect();
    put_small(&op, &names, small_len).await;
    let direct_small = timed(read_small_direct(&op, &names)).await;
    let cold_small = timed(read_small(&client, &names)).await;
    let warm_small = timed(read_small(&client, &names)).await;
    let files_s = |d: Duration| names.len() as f64 / d.as_secs_f64();
    for (label, took) in [("cold", cold_small), ("warm", warm_small)] {
        rows.push(Row {
            name: format!("small files {} KiB {label}", args.small_kib),
            unit: "files/s",
            value: files_s(took),
            ceiling_name: "direct opendal reads",
            ceiling: files_s(direct_small),
            extra: json!({}),
        });
    }

    if !args.no_short_circuit {
        short_circuit_rows(&args, &cluster, &local, size, page_cache, &mut rows).await;
    }

    print_table(&args, readahead, &rows);
    let ceilings = json!({
        "loopback_tcp_mib_s": mib_s(size, tcp), "page_cache_read_mib_s": mib_s(size, page_cache),
        "direct_ufs_read_mib_s": mib_s(size, direct),
    });
    write_json(&args, readahead, &rows, ceilings);
}

/// Warm 4 KiB random reads with lineage recorded (under a job) and off, alternating: what
/// recording costs a read.
async fn lineage_rows(args: &Args, cluster: &Cluster, info: &FileInfo, run_for: Duration) -> Vec<Row> {
    let client_with = |lineage: bool| {
        let mut config = cluster.client_config();
        config.short_circuit = false;
        config.lineage = lineage;
        config.job = lineage.then(|| "strata-bench".to_string());
        Client::connect(config)
    };
    let (on, off) = (client_with(true).await.expect("connect"), client_with(false).await.expect("connect"));
    let mut rows = Vec::new();
    for concurrency in [1usize, 8] {
        let (mut best_on, mut best_off) = (0.0f64, 0.0f64);
        let mut runs = Vec::new();
        for round in 0..args.lineage_rounds {
            eprintln!(
                "random 4 KiB x{concurrency}, lineage off then on ({}/{})",
                round + 1,
                args.lineage_rounds
            );
            let without = random_reads(&off, info, 4 * KIB, concurrency, run_for, false).await.ops_per_sec();
            let with = random_reads(&on, info, 4 * KIB, concurrency, run_for, false).await.ops_per_sec();
            best_off = best_off.max(without);
            best_on = best_on.max(with);
            runs.push(json!({"off_ops_s": without, "on_ops_s": with}));
        }
        rows.push(Row {
            name: format!("random 4 KiB x{concurrency}, lineage on"),
            unit: "ops/s",
            value: best_on,
            ceiling_name: "the same reads, lineage off",
            ceiling: best_off,
            extra: json!({"runs": runs, "reported": on.lineage_counters().reported}),
        });
    }
    on.flush_lineage().await.expect("lineage reported");
    rows
}

/// Warm 4 KiB reads one at a time: alone, and during another client's flood of 1 MiB reads at
/// 64 in flight with the reader in the latency class (served on the worker's latency lane, and
/// with the lane off: on the shared runtime, ordered by the class gate alone) and in the flood's
/// class; p99 of each. Every client runs on a runtime of its own, as in another process.
async fn qos_rows(args: &Args, cluster: &Cluster, info: &FileInfo, run_for: Duration) -> Vec<Row> {
    let config_in = |qos: QosClass| {
        let mut config = cluster.client_config();
        config.short_circuit = false;
        config.lineage = false;
        config.qos = qos;
        config
    };
    let (latency, same, flood) =
        (config_in(QosClass::Latency), config_in(QosClass::Throughput), config_in(QosClass::Throughput));
    let lane = cluster.worker(0).latency_lane.clone();
    let nice = ThreadPriority {
        nice: args.qos_reader_nice,
        slice: (args.qos_reader_slice_us != 0).then(|| Duration::from_micros(args.qos_reader_slice_us)),
    };
    let p99 = |l: &Latencies| l.percentile_us(99.0) as f64;
    let mut runs = Vec::new();
    let (mut alone, mut with_lane, mut without_lane, mut same_class) = (vec![], vec![], vec![], vec![]);
    let mut alone_without_lane = Vec::new();
    let mut exchange_during = Vec::new();
    for round in 0..args.qos_rounds {
        eprintln!("4 KiB reads alone, then during a 1 MiB x64 flood ({}/{})", round + 1, args.qos_rounds);
        let alone_reads = |config: &strata_client::ClientConfig| {
            let (config, i) = (config.clone(), info.clone());
            tokio::task::spawn_blocking(move || reads_on_own_runtime(config, i, run_for, nice))
        };
        let a = alone_reads(&latency).await.expect("alone");
        // What the lane costs a reader with the worker otherwise idle: the same reads served on
        // the shared runtime.
        lane.set_enabled(false);
        let a_off = alone_reads(&latency).await.expect("alone, lane off");
        lane.set_enabled(true);
        let measure = |config: &strata_client::ClientConfig| {
            let (config, i) = (config.clone(), info.clone());
            move || reads_on_own_runtime(config, i, run_for, nice)
        };
        let (w, flood_w) = flood_and_measure(&flood, info, run_for, measure(&same)).await;
        lane.set_enabled(false);
        let (off, _) = flood_and_measure(&flood, info, run_for, measure(&latency)).await;
        lane.set_enabled(true);
        let (on, flood_l) = flood_and_measure(&flood, info, run_for, measure(&latency)).await;
        // What the machine gives any other request/answer exchange during the flood (which
        // saturates both cores): two plain threads over loopback TCP, a 32-byte request
        // answered with 4 KiB from memory, one at a time — each side sleeps in the kernel
        // between messages, as a worker and a client do.
        let (x, _) =
            flood_and_measure(&flood, info, run_for, move || thread_exchanges(4 * KIB, run_for, nice)).await;
        exchange_during.push(p99(&x));
        runs.push(json!({
            "alone_p99_us": p99(&a), "alone_no_lane_p99_us": p99(&a_off), "same_class_p99_us": p99(&w),
            "latency_class_lane_p99_us": p99(&on), "latency_class_no_lane_p99_us": p99(&off),
            "exchange_during_flood_p99_us": exchange_during.last(),
            "flood_mib_s_same": flood_w.ops_per_sec(), "flood_mib_s_latency": flood_l.ops_per_sec(),
        }));
        alone.push(p99(&a));
        alone_without_lane.push(p99(&a_off));
        same_class.push(p99(&w));
        with_lane.push(p99(&on));
        without_lane.push(p99(&off));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let alone = median(&mut alone);
    let exchange_during = median(&mut exchange_during);
    let with_lane = median(&mut with_lane);
    let alone_without_lane = median(&mut alone_without_lane);
    let counters = cluster.worker(0).classes.counters();
    vec![
        Row {
            name: "4 KiB p99 during a 1 MiB x64 flood, latency class".into(),
            unit: "us",
            value: with_lane,
            ceiling_name: "4 KiB p99 alone",
            ceiling: alone,
            extra: json!({
                "runs": runs, "worker_classes": format!("{counters:?}"), "lane_moved": lane.moved(),
                "reader_nice": nice.nice, "reader_slice_us": args.qos_reader_slice_us,
                "lane_slice_us": args.qos_lane_slice_us,
            }),
        },
        Row {
            name: "4 KiB p99 during a 1 MiB x64 flood, latency class, vs threads".into(),
            unit: "us",
            value: with_lane,
            ceiling_name: "4 KiB thread exchange p99 during the flood",
            ceiling: exchange_during,
            extra: json!({}),
        },
        Row {
            name: "4 KiB p99 alone, latency class, lane off".into(),
            unit: "us",
            value: alone_without_lane,
            ceiling_name: "4 KiB p99 alone (lane on)",
            ceiling: alone,
            extra: json!({}),
        },
        Row {
            name: "4 KiB p99 during a 1 MiB x64 flood, latency class, lane off".into(),
            unit: "us",
            value: median(&mut without_lane),
            ceiling_name: "4 KiB p99 alone",
            ceiling: alone,
            extra: json!({}),
        },
        Row {
            name: "4 KiB p99 during a 1 MiB x64 flood, the flood's class".into(),
            unit: "us",
            value: median(&mut same_class),
            ceiling_name: "4 KiB p99 alone",
            ceiling: alone,
            extra: json!({}),
        },
    ]
}

/// A client of `config` connected on a runtime (one thread) of its own, as another process's
/// would be, reading 4 KiB one at a time for `run_for` after a few warming reads.
fn reads_on_own_runtime(
    config: strata_client::ClientConfig,
    info: FileInfo,
    run_for: Duration,
    nice: ThreadPriority,
) -> Latencies {
    on_thread_at(nice, move || reads_on_runtime(config, info, run_for))
}

fn reads_on_runtime(config: strata_client::ClientConfig, info: FileInfo, run_for: Duration) -> Latencies {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(async move {
        let client = Client::connect(config).await.expect("connect");
        for _ in 0..16 {
            client.read_range_of(&info, 0, 4 * KIB).await.expect("warming read");
        }
        random_reads(&client, &info, 4 * KIB, 1, run_for, false).await
    })
}

/// `measure` on a blocking thread while a client of `flood` reads 1 MiB at 64 in flight — on a
/// runtime (two threads) of its own, as another process on the host would: sharing the
/// cluster's runtime, its tasks would queue ahead of the measured reader's in the process
/// itself.
async fn flood_and_measure(
    flood: &strata_client::ClientConfig,
    info: &FileInfo,
    run_for: Duration,
    measure: impl FnOnce() -> Latencies + Send + 'static,
) -> (Latencies, Latencies) {
    let (config, i) = (flood.clone(), info.clone());
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let flooding = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let client = Client::connect(config).await.expect("flood client connects");
            let _ = started_tx.send(());
            // A little longer than the measurement, so it runs inside the flood throughout.
            random_reads(&client, &i, MIB, 64, run_for + Duration::from_millis(300), false).await
        })
    });
    started_rx.await.expect("flood started");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let measured = tokio::task::spawn_blocking(measure).await.expect("measure");
    let flood =
        tokio::task::spawn_blocking(move || flooding.join().expect("flood thread")).await.expect("join");
    (measured, flood)
}

/// Every figure to `--json`, if given.
fn write_json(args: &Args, readahead: usize, rows: &[Row], ceilings: Value) {
    if let Some(path) = &args.json {
        let v = json!({
            "ufs": args.ufs, "size_mib": args.size_mib, "block_mib": args.block_mib, "workers": args.workers,
            "readahead_blocks": readahead,
            "ceilings": ceilings,
            "rows": rows.iter().map(|r| json!({
                "name": r.name, "unit": r.unit, "value": r.value, "ceiling_name": r.ceiling_name,
                "ceiling": r.ceiling, "ratio": r.value / r.ceiling, "extra": r.extra,
            })).collect::<Vec<_>>(),
        });
        std::fs::write(path, serde_json::to_string_pretty(&v).expect("json")).expect("write --json file");
    }
}

/// A transport that sends each worker's reads to another address of it (its TLS port).
struct Redirect {
    inner: strata_client::TcpTransport,
    to: std::collections::HashMap<String, String>,
}

#[async_trait::async_trait]
impl strata_client::Transport for Redirect {
    async fn read_block(
        &self,
        addr: &str,
        req: &strata_common::frame::ReadBlockRequest,
    ) -> Result<(bytes::Bytes, strata_common::frame::Source), strata_client::TransportError> {
        self.inner.read_block(self.to.get(addr).map_or(addr, String::as_str), req).await
    }

    async fn read_block_into(
        &self,
        addr: &str,
        req: &strata_common::frame::ReadBlockRequest,
        dst: &mut [u8],
    ) -> Result<strata_common::frame::Source, strata_client::TransportError> {
        self.inner.read_block_into(self.to.get(addr).map_or(addr, String::as_str), req, dst).await
    }
}

/// Warm sequential reads of the same blocks with TLS off and on, alternating, next to the
/// loopback TCP ceiling.
async fn tls_rows(args: &Args, cluster: &Cluster, plain: &Client, size: u64, tcp: Duration) -> Vec<Row> {
    let pki = strata_testkit::tls::TestPki::new();
    let server = pki.server(false).server().expect("server TLS").expect("configured");
    let cancel = tokio_util::sync::CancellationToken::new();
    let mut to = std::collections::HashMap::new();
    for i in 0..cluster.worker_count() {
        let w = cluster.worker(i);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        to.insert(w.data_addr.to_string(), listener.local_addr().expect("addr").to_string());
        // A second listener over the same blocks, for this benchmark alone: it admits every
        // peer (the cluster's own listeners check tokens).
        let plane = strata_worker::dataplane::DataPlane {
            blocks: w.blocks.clone(),
            grants: w.grants.clone(),
            view: Default::default(),
            auth: Arc::new(strata_worker::auth::PeerAuth::open()),
            connections: Arc::new(strata_worker::dataplane::Connections::from_config(
                &WorkerConfig::default(),
            )),
            writeback: None,
            handoff: None,
            prefetch: None,
            classes: w.classes.clone(),
            latency_lane: w.latency_lane.clone(),
        };
        tokio::spawn(strata_worker::dataplane::serve_tls(listener, server.clone(), plane, cancel.clone()));
    }
    let mut config = cluster.client_config();
    if let Some(blocks) = args.readahead {
        config.readahead_blocks = blocks;
    }
    let dial = strata_client::Dial {
        connect_timeout: config.connect_timeout,
        tls: pki.client_without_cert().client().expect("client TLS"),
        credentials: strata_client::Credentials::token(cluster.admin_token().as_deref()),
    };
    let inner = strata_client::TcpTransport::new(dial, config.request_timeout);
    let tls =
        Client::connect_with_transport(config, Arc::new(Redirect { inner, to })).await.expect("connect");
    let (mut plain_runs, mut tls_runs) = (Vec::new(), Vec::new());
    for round in 0..args.tls_rounds {
        eprintln!("warm sequential, TLS off then on ({}/{})", round + 1, args.tls_rounds);
        plain_runs.push(mib_s(size, seq_read(plain, "/data/big.bin", size).await));
        tls_runs.push(mib_s(size, seq_read(&tls, "/data/big.bin", size).await));
    }
    cancel.cancel();
    let best = |runs: &[f64]| runs.iter().copied().fold(0.0, f64::max);
    let (plain_best, tls_best) = (best(&plain_runs), best(&tls_runs));
    vec![
        Row {
            name: format!("sequential {} MiB warm, TLS off", args.size_mib),
            unit: "MiB/s",
            value: plain_best,
            ceiling_name: "loopback TCP stream",
            ceiling: mib_s(size, tcp),
            extra: json!({"runs_mib_s": plain_runs}),
        },
        Row {
            name: format!("sequential {} MiB warm, TLS on", args.size_mib),
            unit: "MiB/s",
            value: tls_best,
            ceiling_name: "loopback TCP stream",
            ceiling: mib_s(size, tcp),
            extra: json!({"runs_mib_s": tls_runs, "tls_over_plain": tls_best / plain_best}),
        },
    ]
}

fn print_table(args: &Args, readahead: usize, rows: &[Row]) {
    println!(
        "strata-bench: ufs {}, {} worker(s), {} MiB blocks, readahead up to {readahead} blocks, {} cores",
        args.ufs,
        args.workers,
        args.block_mib,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!();
    println!("| benchmark | strata | ceiling | ratio | p50 / p99 / p99.9 µs (ceiling p50 / p99) |");
    println!("| --- | --- | --- | --- | --- |");
    for r in rows {
        let lat = match (r.extra.get("p50_us"), r.extra.get("ceiling_p50_us")) {
            (Some(_), Some(_)) => format!(
                "{} / {} / {} ({} / {})",
                r.extra["p50_us"],
                r.extra["p99_us"],
                r.extra["p999_us"],
                r.extra["ceiling_p50_us"],
                r.extra["ceiling_p99_us"]
            ),
            _ => String::new(),
        };
        println!(
            "| {} | {:.0} {} | {:.0} ({}) | {:.2}x | {lat} |",
            r.name,
            r.value,
            r.unit,
            r.ceiling,
            r.ceiling_name,
            r.value / r.ceiling
        );
    }
}

async fn timed<F: std::future::Future<Output = ()>>(f: F) -> Duration {
    let started = Instant::now();
    f.await;
    started.elapsed()
}

/// The loopback TCP ceiling: the best of two tokio task pairs and two plain thread pairs with
/// 4 MiB writes (either can be the faster on this VM from one run to the next).
async fn tcp_ceiling(size: u64) -> Duration {
    let mut best = Duration::MAX;
    for _ in 0..2 {
        best = best.min(tokio_pair(size).await);
        best = best.min(tokio::task::spawn_blocking(move || thread_pair(size)).await.expect("thread pair"));
    }
    best
}

fn thread_pair(size: u64) -> Duration {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let chunk = 4 * MIB;
    let sender = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().expect("accept");
        let buf = vec![7u8; chunk as usize];
        let mut sent = 0;
        while sent < size {
            let n = (size - sent).min(chunk) as usize;
            conn.write_all(&buf[..n]).expect("send");
            sent += n as u64;
        }
    });
    let mut conn = std::net::TcpStream::connect(addr).expect("connect");
    let mut buf = vec![0u8; chunk as usize];
    let started = Instant::now();
    let mut got = 0;
    while got < size {
        let n = conn.read(&mut buf).expect("receive");
        assert!(n > 0, "the sender closed early");
        got += n as u64;
    }
    let took = started.elapsed();
    sender.join().expect("sender");
    took
}

/// One stream over 127.0.0.1 between two tasks, 1 MiB writes and reads.
async fn tokio_pair(size: u64) -> Duration {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let sender = tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.expect("accept");
        let buf = vec![7u8; MIB as usize];
        let mut sent = 0;
        while sent < size {
            let n = (size - sent).min(MIB) as usize;
            conn.write_all(&buf[..n]).await.expect("send");
            sent += n as u64;
        }
    });
    let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut buf = vec![0u8; MIB as usize];
    let started = Instant::now();
    let mut got = 0;
    while got < size {
        let n = conn.read(&mut buf).await.expect("receive");
        assert!(n > 0, "the sender closed early");
        got += n as u64;
    }
    let took = started.elapsed();
    sender.await.expect("sender");
    took
}

fn write_local(path: &Path, size: u64) {
    let mut f = std::fs::File::create(path).expect("create local file");
    let mut off = 0;
    let mut buf = vec![0u8; (16 * MIB) as usize];
    while off < size {
        let n = (16 * MIB).min(size - off) as usize;
        fill_pattern(3, off, &mut buf[..n]);
        std::io::Write::write_all(&mut f, &buf[..n]).expect("write local file");
        off += n as u64;
    }
}

/// A sequential read of a page-cached local file in 1 MiB reads (read once first to make sure
/// it is cached).
fn page_cache_ceiling(path: &Path, size: u64) -> Duration {
    page_cache_ceiling_by(path, size, MIB)
}

/// [`page_cache_ceiling`] in reads of `read_len` into one reused buffer: how large the
/// destination is decides whether the copy's writes stay in the CPU's cache, so a reader is held
/// to a read of the same size.
fn page_cache_ceiling_by(path: &Path, size: u64, read_len: u64) -> Duration {
    let read = || {
        let mut f = std::fs::File::open(path).expect("open local file");
        let mut buf = vec![0u8; read_len as usize];
        let started = Instant::now();
        let mut total = 0u64;
        loop {
            let n = f.read(&mut buf).expect("read local file");
            if n == 0 {
                break;
            }
            total += n as u64;
        }
        assert_eq!(total, size);
        started.elapsed()
    };
    read();
    read().min(read())
}

async fn seq_read(client: &Client, path: &str, size: u64) -> Duration {
    seq_read_by(client, path, size, 8 * MIB).await
}

/// [`seq_read`] in reads of `read_len` into one reused buffer.
async fn seq_read_by(client: &Client, path: &str, size: u64, read_len: u64) -> Duration {
    let mut buf = vec![0u8; read_len as usize];
    // Touched before the clock starts, as the ceiling's buffer is by its first read.
    buf.fill(1);
    let started = Instant::now();
    let mut reader = client.open(path).await.expect("open");
    let mut total = 0u64;
    loop {
        let k = reader.read(&mut buf).await.expect("read");
        if k == 0 {
            break;
        }
        total += k as u64;
    }
    assert_eq!(total, size);
    started.elapsed()
}

/// [`seq_read`] through [`StrataReader::next_chunk`](strata_client::StrataReader::next_chunk):
/// the blocks as received, not copied into a buffer of the caller's.
async fn seq_read_chunks(client: &Client, path: &str, size: u64) -> Duration {
    let started = Instant::now();
    let mut reader = client.open(path).await.expect("open");
    let mut total = 0u64;
    while let Some(chunk) = reader.next_chunk().await.expect("next_chunk") {
        total += chunk.len() as u64;
    }
    assert_eq!(total, size);
    started.elapsed()
}

/// Latencies of a closed-loop run.
struct Latencies {
    micros: Vec<u32>,
    took: Duration,
    /// (start since the run began, latency) of every request over [`SLOW_US`], µs.
    slow: Vec<(u32, u32)>,
}

/// What `--tail-probe` calls a slow request.
const SLOW_US: u32 = 10_000;
/// Timer lateness worth reporting.
const LATE: Duration = Duration::from_millis(5);

/// A 1 ms timer on the runtime and one on a plain thread, each recording when it woke late.
struct TimerProbe {
    runtime: tokio::task::JoinHandle<Vec<(u32, u32)>>,
    thread: std::thread::JoinHandle<Vec<(u32, u32)>>,
}

impl TimerProbe {
    fn start(run_for: Duration) -> Self {
        let started = Instant::now();
        let late = move |slept: Instant| {
            let over = slept.elapsed().saturating_sub(Duration::from_millis(1));
            (over > LATE).then(|| ((slept - started).as_micros() as u32, over.as_micros() as u32))
        };
        let runtime = tokio::spawn(async move {
            let mut seen = Vec::new();
            while started.elapsed() < run_for {
                let t = Instant::now();
                tokio::time::sleep(Duration::from_millis(1)).await;
                seen.extend(late(t));
            }
            seen
        });
        let thread = std::thread::spawn(move || {
            let mut seen = Vec::new();
            while started.elapsed() < run_for {
                let t = Instant::now();
                std::thread::sleep(Duration::from_millis(1));
                seen.extend(late(t));
            }
            seen
        });
        Self { runtime, thread }
    }

    async fn report(self, reads: &Latencies) {
        let runtime = self.runtime.await.expect("runtime probe");
        let thread = self.thread.join().expect("thread probe");
        // A request that started while the burst's first one was still waiting (or within 2 ms
        // after it ended) joins that burst: one stall delays every request in flight.
        let mut bursts: Vec<(u32, u32, u32)> = Vec::new(); // (first start, count, worst latency)
        let mut slow = reads.slow.clone();
        slow.sort_unstable();
        for (at, lat) in slow {
            match bursts.last_mut() {
                Some((first, n, worst)) if at <= *first + 2_000 + *worst => {
                    *n += 1;
                    *worst = (*worst).max(lat);
                }
                _ => bursts.push((at, 1, lat)),
            }
        }
        let ms = |us: u32| format!("{:.1}", us as f64 / 1000.0);
        let list = |v: &[(u32, u32)]| {
            v.iter().map(|(at, l)| format!("{}+{}", ms(*at), ms(*l))).collect::<Vec<_>>().join(" ")
        };
        eprintln!(
            "  slow (>{} ms): {} of {}; bursts (start ms, requests, worst ms): {}",
            SLOW_US / 1000,
            reads.slow.len(),
            reads.micros.len(),
            bursts
                .iter()
                .map(|(at, n, w)| format!("{}:{}x{}", ms(*at), n, ms(*w)))
                .collect::<Vec<_>>()
                .join(" ")
        );
        eprintln!("  runtime timer late (at+late ms): {}", list(&runtime));
        eprintln!("  thread timer late (at+late ms): {}", list(&thread));
    }
}

impl Latencies {
    fn ops_per_sec(&self) -> f64 {
        self.micros.len() as f64 / self.took.as_secs_f64()
    }

    fn percentile_us(&self, p: f64) -> u32 {
        if self.micros.is_empty() {
            return 0;
        }
        let mut sorted = self.micros.clone();
        sorted.sort_unstable();
        let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
        sorted[rank]
    }
}

/// `copy_out` copies every answer into a buffer of the reader's, as `pread` does: a mapped
/// answer is otherwise never touched, and the comparison would flatter it.
async fn random_reads(
    client: &Client,
    info: &FileInfo,
    len: u64,
    concurrency: usize,
    run_for: Duration,
    copy_out: bool,
) -> Latencies {
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let client = client.clone();
            let info = info.clone();
            tokio::spawn(async move {
                let mut micros = Vec::new();
                let mut slow = Vec::new();
                let mut buf = vec![0u8; if copy_out { len as usize } else { 0 }];
                while started.elapsed() < run_for {
                    let offset = rand::rng().random_range(0..info.size - len);
                    let t = Instant::now();
                    let bytes = client.read_range_of(&info, offset, len).await.expect("random read");
                    if copy_out {
                        buf.copy_from_slice(&bytes);
                    }
                    let us = t.elapsed().as_micros() as u32;
                    micros.push(us);
                    if us > SLOW_US {
                        slow.push(((t - started).as_micros() as u32, us));
                    }
                    assert_eq!(bytes.len() as u64, len);
                }
                (micros, slow)
            })
        })
        .collect();
    let mut micros = Vec::new();
    let mut slow = Vec::new();
    for t in tasks {
        let (m, s) = t.await.expect("reader task");
        micros.extend(m);
        slow.extend(s);
    }
    Latencies { micros, took: started.elapsed(), slow }
}

/// Request/answer exchanges between two plain threads over loopback TCP: 32 bytes asked, `len`
/// answered, one at a time, for `run_for`.
fn thread_exchanges(len: u64, run_for: Duration, nice: ThreadPriority) -> Latencies {
    on_thread_at(nice, move || exchanges(len, run_for, nice))
}

/// Runs `f` on a new thread scheduled at `priority` and returns its result.
fn on_thread_at<T: Send + 'static>(priority: ThreadPriority, f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        set_thread_priority(priority);
        f()
    })
    .join()
    .expect("measuring thread")
}

fn set_thread_priority(priority: ThreadPriority) {
    if let Err(e) = priority.apply_to_current_thread() {
        panic!("{e}");
    }
}

fn exchanges(len: u64, run_for: Duration, nice: ThreadPriority) -> Latencies {
    use std::io::Write;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = std::thread::spawn(move || {
        set_thread_priority(nice);
        let (mut s, _) = listener.accept().expect("accept");
        s.set_nodelay(true).expect("nodelay");
        let answer = vec![7u8; len as usize];
        let mut ask = [0u8; 32];
        while s.read_exact(&mut ask).is_ok() {
            if s.write_all(&answer).is_err() {
                break;
            }
        }
    });
    let mut c = std::net::TcpStream::connect(addr).expect("connect");
    c.set_nodelay(true).expect("nodelay");
    let mut answer = vec![0u8; len as usize];
    let started = Instant::now();
    let mut micros = Vec::new();
    while started.elapsed() < run_for {
        let t = Instant::now();
        c.write_all(&[1u8; 32]).expect("ask");
        c.read_exact(&mut answer).expect("answer");
        micros.push(t.elapsed().as_micros() as u32);
    }
    drop(c);
    server.join().expect("server thread");
    Latencies { micros, took: started.elapsed(), slow: Vec::new() }
}

/// The same random reads as `pread` on a page-cached local file, one thread per reader.
fn pread_ceiling(path: &Path, size: u64, len: u64, concurrency: usize, run_for: Duration) -> Latencies {
    let file = Arc::new(std::fs::File::open(path).expect("open local file"));
    let started = Instant::now();
    let threads: Vec<_> = (0..concurrency)
        .map(|_| {
            let file = file.clone();
            std::thread::spawn(move || {
                let mut buf = vec![0u8; len as usize];
                let mut micros = Vec::new();
                while started.elapsed() < run_for {
                    let offset = rand::rng().random_range(0..size - len);
                    let t = Instant::now();
                    file.read_exact_at(&mut buf, offset).expect("pread");
                    micros.push(t.elapsed().as_micros() as u32);
                }
                micros
            })
        })
        .collect();
    let mut micros = Vec::new();
    for t in threads {
        micros.extend(t.join().expect("pread thread"));
    }
    Latencies { micros, took: started.elapsed(), slow: Vec::new() }
}

async fn put_small(op: &opendal::Operator, names: &[String], len: u64) {
    futures::stream::iter(names.iter().enumerate())
        .for_each_concurrent(64, |(i, name)| {
            let op = op.clone();
            async move {
                let mut buf = vec![0u8; len as usize];
                fill_pattern(i as u64, 0, &mut buf);
                op.write(name, buf).await.expect("write small file");
            }
        })
        .await;
}

const SMALL_CONCURRENCY: usize = 16;

async fn read_small_direct(op: &opendal::Operator, names: &[String]) {
    futures::stream::iter(names)
        .for_each_concurrent(SMALL_CONCURRENCY, |name| {
            let op = op.clone();
            async move {
                op.read(name).await.expect("direct small read");
            }
        })
        .await;
}

async fn read_small(client: &Client, names: &[String]) {
    futures::stream::iter(names)
        .for_each_concurrent(SMALL_CONCURRENCY, |name| {
            let client = client.clone();
            async move {
                client.read_all(&format!("/data/{name}")).await.expect("strata small read");
            }
        })
        .await;
}

/// Warm reads from a sidecar on this host: through short-circuit grants (with whole-block
/// mappings kept by the client, and mapping each read's range anew), and framed through the
/// same socket for comparison. One sidecar keeps blocks in DRAM (granted as shared-memory
/// copies), one on NVMe (granted as the block files themselves).
async fn short_circuit_rows(
    args: &Args,
    cluster: &Cluster,
    local: &Path,
    size: u64,
    page_cache: Duration,
    rows: &mut Vec<Row>,
) {
    // The cluster's own workers, found through the sockets they advertise: no sidecar.
    let mut config = cluster.client_config();
    config.short_circuit = true;
    config.short_circuit_cache_bytes = size + 256 * MIB;
    if let Some(blocks) = args.readahead {
        config.readahead_blocks = blocks;
    }
    let co_located = Client::connect(config).await.expect("connect");
    // What a second of quiet reads does (nvme_writeback_idle_ms): the blocks reach NVMe, whose
    // files a worker grants with no copy (a DRAM-only block is read over TCP).
    for i in 0..args.workers {
        cluster.worker(i).blocks.flush().await;
    }
    eprintln!("short-circuit from the cluster's workers on this host: warm sequential reads");
    // In 8 MiB reads (as every sequential row) and in 1 MiB reads, each held to a page-cache
    // read of the same size, alternated.
    let (mut best, mut best_1m) = (Duration::MAX, Duration::MAX);
    let (mut page_cache_8m, mut page_cache_1m) = (Duration::MAX, page_cache);
    for _ in 0..3 {
        best = best.min(seq_read(&co_located, "/data/big.bin", size).await);
        page_cache_8m = page_cache_8m.min(page_cache_ceiling_by(local, size, 8 * MIB));
        best_1m = best_1m.min(seq_read_by(&co_located, "/data/big.bin", size, MIB).await);
        page_cache_1m = page_cache_1m.min(page_cache_ceiling_by(local, size, MIB));
    }
    assert!(co_located.short_circuit_reads() > 0, "the workers' sockets were not used");
    for (value, ceiling, reads) in [(best, page_cache_8m, "8 MiB"), (best_1m, page_cache_1m, "1 MiB")] {
        rows.push(Row {
            name: format!(
                "sequential {} MiB warm, short-circuit from co-located workers, kept mappings, {reads} reads",
                args.size_mib
            ),
            unit: "MiB/s",
            value: mib_s(size, value),
            ceiling_name: "page-cache read of the same size",
            ceiling: mib_s(size, ceiling),
            extra: json!({}),
        });
    }
    drop(co_located);

    let dir = tempfile::tempdir().expect("sidecar dir");
    for tier in ["dram", "nvme"] {
        let mut config = WorkerConfig {
            master_addr: cluster.master_addr(),
            http_addr: "127.0.0.1:0".parse().expect("addr"),
            data_dir: dir.path().join(tier),
            sidecar: true,
            socket_path: Some(dir.path().join(format!("{tier}.sock"))),
            ..WorkerConfig::default()
        };
        if tier == "dram" {
            config.memory_capacity = size + 256 * MIB;
            config.nvme_capacity = 0;
            // Room for a shared-memory copy of every block: the warm figure is the steady state.
            config.short_circuit_shm_bytes = size + 256 * MIB;
        } else {
            config.memory_capacity = 0;
            config.nvme_capacity = size + 256 * MIB;
        }
        config.token = cluster.worker_token();
        let upstream = strata_client::ClusterUpstream::connect(
            &config.master_addr,
            config.token.clone(),
            Duration::from_millis(config.ufs_timeout_ms),
        )
        .await
        .expect("cluster client");
        let sidecar = strata_worker::sidecar::start(config, cluster.factory.clone(), Arc::new(upstream))
            .await
            .expect("sidecar");
        let connect = |short_circuit: bool, cache_bytes: u64| {
            let mut c = cluster.client_config();
            c.sidecar_socket = Some(sidecar.socket_path.clone());
            c.short_circuit = short_circuit;
            c.short_circuit_cache_bytes = cache_bytes;
            if let Some(blocks) = args.readahead {
                c.readahead_blocks = blocks;
            }
            Client::connect(c)
        };
        // Kept mappings with room for the whole file (the default keeps 1 GiB), none, and no
        // short-circuit at all.
        let kept = connect(true, size + 256 * MIB).await.expect("connect");
        let mapped = connect(true, 0).await.expect("connect");
        let framed = connect(false, 0).await.expect("connect");
        eprintln!("short-circuit ({tier}): filling the sidecar, then warm sequential reads");
        seq_read(&framed, "/data/big.bin", size).await;
        sidecar.blocks.flush().await;
        let clients = [
            (&kept, "short-circuit, kept mappings"),
            (&mapped, "short-circuit, map per read"),
            (&framed, "sidecar socket, framed"),
        ];
        for (client, how) in clients {
            let mut best = Duration::MAX;
            for _ in 0..3 {
                best = best.min(seq_read(client, "/data/big.bin", size).await);
            }
            rows.push(Row {
                name: format!("sequential {} MiB warm, {how} ({tier})", args.size_mib),
                unit: "MiB/s",
                value: mib_s(size, best),
                ceiling_name: "page-cache read",
                ceiling: mib_s(size, page_cache),
                extra: json!({}),
            });
        }
        let info = mapped.stat("/data/big.bin").await.expect("stat");
        let run_for = Duration::from_secs_f64(args.secs);
        for (len, concurrency, client, how) in [
            (4 * KIB, 1usize, &kept, "kept mappings"),
            (4 * KIB, 8, &kept, "kept mappings"),
            (4 * KIB, 1, &mapped, "map per read"),
            (MIB, 1, &kept, "kept mappings"),
            (MIB, 8, &kept, "kept mappings"),
            (MIB, 1, &mapped, "map per read"),
        ] {
            eprintln!(
                "short-circuit ({tier}, {how}): random {} KiB reads at concurrency {concurrency}",
                len / KIB
            );
            let strata = random_reads(client, &info, len, concurrency, run_for, true).await;
            let ceiling = pread_ceiling(local, size, len, concurrency, run_for);
            let name = format!("random {} KiB x{concurrency}, short-circuit, {how} ({tier})", len / KIB);
            rows.push(random_row(name, &strata, &ceiling));
        }
        sidecar.shutdown().await;
    }
}
