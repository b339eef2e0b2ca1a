//! Benchmark of unique indexes (issue 34): what one unique index costs a
//! write, single and batch, against the same writes without it.
//!
//! ```sh
//! cargo build --release -p bagstore -p bench --bins
//! target/release/bench_unique [--secs S] [--clients C] [--batch B]
//! ```
//!
//! Two clusters, one after the other, on the same machine and alike but
//! for the index on `email`: two physical shards, each a private `mariadbd`
//! (no replicas), the real `bagstore` writer and indexer, a mock Kafka in
//! this process; the servers on core 0, everything else on the others.
//! Both index `user_id, published` (asynchronously, as `bench` does); the
//! second also declares `email` unique, and every entity has an email of
//! its own, so every write reserves and settles one key (on a shard of
//! its own, as the key's hash says). Phases: single puts, then batch puts,
//! C clients for S seconds each: entities per second, latency, and the
//! servers' CPU seconds per 1000 entities; then the ratios.

use bagstore_tests::replicated::Cluster;
use bagstore_tests::TestEnv;
use serde_json::{json, Value};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

#[path = "../cluster.rs"]
mod cluster;
#[path = "../cpu.rs"]
mod cpu;
#[path = "../sibling.rs"]
mod sibling;

use cluster::{load, options_or_exit, quantiles, Options, Servers, POSTS_INDEX as INDEXES};

const UNIQUE: &str = r#"
[[indexes]]
table = "index_email"
properties = [{ name = "email", type = "string", max_len = 64 }]
unique = true
"#;

/// Entity `i`: a post of one of 200 users, with an email of its own.
fn entity(i: u64) -> Value {
    json!({
        "user_id": format!("{:032x}", 0x5e5e_0000_0000u64 + i % 200),
        "published": 1_700_000_000 + i as i64,
        "title": format!("Post number {i} about bagstore, schemaless entities on sharded MySQL"),
        "email": format!("{:016x}@example.com", rand::random::<u64>()),
        "n": i,
    })
}

/// One phase's figures.
struct Figures {
    rate: f64,
    latency: String,
    cpu: f64,
}

#[tokio::main]
async fn main() -> ExitCode {
    let opts = match options_or_exit("bench_unique") {
        Ok(o) => o,
        Err(code) => return code,
    };
    let mut runs = Vec::new();
    for unique in [false, true] {
        match cluster_run(opts, unique).await {
            Ok(f) => runs.push(f),
            Err(e) => {
                eprintln!("bench_unique: {e:#}");
                return ExitCode::FAILURE;
            }
        }
    }
    println!(
        "\n| phase | unique index | entities/s | latency p50 / p99 | servers' CPU s per 1000 entities |"
    );
    println!("|---|---|---|---|---|");
    let phases = ["single puts".to_string(), format!("batch puts of {}", opts.batch)];
    for (p, phase) in phases.iter().enumerate() {
        for (unique, run) in [false, true].iter().zip(&runs) {
            let f = &run[p];
            let with = if *unique { "one" } else { "none" };
            println!("| {phase} | {with} | {:.0} | {} | {:.3} |", f.rate, f.latency, f.cpu);
        }
        let (none, one) = (&runs[0][p], &runs[1][p]);
        println!(
            "| {phase} | ratio one/none | {:.2}x | | {:.2}x |",
            one.rate / none.rate.max(1e-9),
            one.cpu / none.cpu.max(1e-9)
        );
    }
    ExitCode::SUCCESS
}

/// One cluster, with the unique index or without: each phase's figures.
async fn cluster_run(o: Options, unique: bool) -> anyhow::Result<Vec<Figures>> {
    let indexes = if unique { format!("{INDEXES}{UNIQUE}") } else { INDEXES.to_string() };
    let mut env = TestEnv::new(&format!("benchuniq{}", u8::from(unique)), &indexes).await;
    let cluster = Cluster::start(&mut env, 2, 0).await;
    let writer = env.spawn(&["writer"]).await;
    let indexer = env.spawn(&["indexer"]).await;
    let servers = Servers::of(&cluster);
    servers.pin(&[&writer, &indexer])?;
    let ids: Arc<Mutex<Vec<String>>> = Arc::default();
    let api = writer.api();
    let mut out = Vec::new();
    for batch in [1, o.batch] {
        let before = servers.ticks();
        let (n, lat) = load(&api, o, batch, ids.clone(), entity).await;
        anyhow::ensure!(n > 0, "no write was acknowledged");
        let cpu = servers.since(&before, n);
        let f = Figures { rate: n as f64 / o.secs as f64, latency: quantiles(lat), cpu: cpu.primaries };
        eprintln!(
            "bench_unique: unique {unique}, batch {batch}: {:.0} entities/s, {}, CPU {cpu}",
            f.rate, f.latency
        );
        out.push(f);
    }
    if unique {
        // Every acknowledged write holds its key: one held row each.
        let rows: i64 = env
            .fetch_all_shards::<(i64,)>("SELECT COUNT(*) FROM index_email WHERE token IS NULL")
            .await
            .iter()
            .map(|(_, (n,))| n)
            .sum();
        let acked = ids.lock().unwrap().len() as i64;
        anyhow::ensure!(rows == acked, "{rows} held key rows for {acked} acknowledged entities");
    }
    drop((writer, indexer));
    cluster.stop().await;
    Ok(out)
}
