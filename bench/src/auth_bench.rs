//! What tokens cost: new data-plane connections per second (connect, `Auth` frame, one `View`
//! request answered) and master calls per second (`GetMembership`, each call's token checked),
//! on two in-process clusters in the same run — one requiring tokens, one with authentication
//! off, the ceiling — measured alternately, several rounds each.
//!
//! ```text
//! cargo run --release -p strata-bench --bin auth_bench
//! cargo run --release -p strata-bench --bin auth_bench -- --connections 5000 --rounds 3
//! ```

use std::time::{Duration, Instant};
use strata_bench::load_average;

use clap::Parser;
use strata_common::frame::{self, RESPONSE_HEADER_LEN, ResponseHeader};
use strata_testkit::{Cluster, ClusterOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[derive(Parser)]
struct Args {
    /// New connections per round and cluster.
    #[arg(long, default_value_t = 3000)]
    connections: usize,
    /// Connections opened at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Master calls per round and cluster.
    #[arg(long, default_value_t = 5000)]
    calls: usize,
    /// Rounds, alternating the two clusters.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

/// One connection: connect, present `token`, ask for the worker's view, read the answer whole.
async fn one_connection(addr: &str, token: Option<&str>) {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.set_nodelay(true).expect("nodelay");
    let mut out = Vec::new();
    if let Some(t) = token {
        out.extend_from_slice(&frame::auth_request(t));
    }
    out.extend_from_slice(&frame::view_request(1));
    s.write_all(&out).await.expect("send");
    let mut head = [0u8; RESPONSE_HEADER_LEN];
    s.read_exact(&mut head).await.expect("answer");
    let head = ResponseHeader::decode(&head).expect("header");
    assert!(head.status.is_ok(), "refused: {:?}", head.status);
    let mut payload = vec![0u8; head.payload_len as usize];
    s.read_exact(&mut payload).await.expect("payload");
}

async fn connections_per_second(cluster: &Cluster, args: &Args) -> f64 {
    let addr = cluster.worker(0).data_addr.to_string();
    let token = cluster.admin_token();
    let started = Instant::now();
    let per_task = args.connections / args.concurrency.max(1);
    let mut tasks = Vec::new();
    for _ in 0..args.concurrency.max(1) {
        let (addr, token) = (addr.clone(), token.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..per_task {
                one_connection(&addr, token.as_deref()).await;
            }
        }));
    }
    for t in tasks {
        t.await.expect("connection task");
    }
    (per_task * args.concurrency.max(1)) as f64 / started.elapsed().as_secs_f64()
}

async fn calls_per_second(cluster: &Cluster, args: &Args) -> f64 {
    let client = cluster.client().await;
    let started = Instant::now();
    for _ in 0..args.calls {
        client.admin().status().await.expect("status");
    }
    args.calls as f64 / started.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    println!("load average at start: {}", load_average());
    let secured = Cluster::start(ClusterOptions { workers: 1, ..ClusterOptions::default() }).await;
    let open = Cluster::start(ClusterOptions { workers: 1, auth: false, ..ClusterOptions::default() }).await;
    // Both workers have learnt their tokens (or that there are none) once they are listed.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (mut on, mut off, mut calls_on, mut calls_off) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..args.rounds {
        let (a, b) = if round % 2 == 0 { (&secured, &open) } else { (&open, &secured) };
        for c in [a, b] {
            let conns = connections_per_second(c, &args).await;
            let calls = calls_per_second(c, &args).await;
            let label = if c.admin_token().is_some() { "tokens" } else { "off" };
            println!(
                "round {round} auth {label:>6}: {conns:>8.0} connections/s  {calls:>8.0} status calls/s"
            );
            if c.admin_token().is_some() {
                on.push(conns);
                calls_on.push(calls);
            } else {
                off.push(conns);
                calls_off.push(calls);
            }
        }
    }
    let (on, off) = (median(on), median(off));
    let (calls_on, calls_off) = (median(calls_on), median(calls_off));
    println!(
        "median: data plane {on:.0} vs {off:.0} connections/s = {:.2}x; control plane {calls_on:.0} vs {calls_off:.0} calls/s = {:.2}x (auth on vs off, same run); load {}",
        on / off,
        calls_on / calls_off,
        load_average()
    );
}
