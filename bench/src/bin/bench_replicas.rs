//! Benchmark of replication (issue 33): what a semi-synchronous replica
//! costs a write, and what a read costs from a replica against the
//! primary.
//!
//! ```sh
//! cargo build --release -p bagstore -p bench --bins
//! target/release/bench_replicas [--secs S] [--clients C] [--batch B]
//! ```
//!
//! Two clusters, one after the other, on the same machine and alike but
//! for the replicas: two physical shards (the metadata shard is one), each
//! a private `mariadbd` primary, first alone, then with one semi-sync
//! replica (`AFTER_SYNC`: a commit waits until the replica has it), the
//! real `bagstore` writer, indexer and readers, a mock Kafka in this
//! process. As `bench` does for its write phases, the MariaDB servers run
//! on core 0 and everything else on the other cores, so a server's CPU
//! figures are its own. Phases: single puts, then batch puts, each with C
//! clients for S seconds: entities per second, latency, and the CPU seconds
//! per 1000 entities of the primaries and of the replicas apart, and of
//! each server. With the
//! replica: point gets and a query (the latest 20 of a user) through a
//! reader that reads the primaries and one that reads the replicas
//! (`reader.read_from`), p50 and p99 side by side.

use anyhow::{ensure, Context};
use bagstore_tests::replicated::Cluster;
use bagstore_tests::{metric_sum, Api, TestEnv};
use serde_json::{json, Value};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[path = "../cluster.rs"]
mod cluster;
#[path = "../cpu.rs"]
mod cpu;
#[path = "../sibling.rs"]
mod sibling;

use cluster::{load, options_or_exit, quantiles, Options, Servers, POSTS_INDEX as INDEXES};

/// Users the entities belong to (each has many, for "latest 20").
const USERS: u64 = 200;

#[tokio::main]
async fn main() -> ExitCode {
    let opts = match options_or_exit("bench_replicas") {
        Ok(o) => o,
        Err(code) => return code,
    };
    let mut table = Vec::new();
    for replicas in [0, 1] {
        match cluster_run(opts, replicas).await {
            Ok(rows) => table.extend(rows),
            Err(e) => {
                eprintln!("bench_replicas: {e:#}");
                return ExitCode::FAILURE;
            }
        }
    }
    println!("\n| replicas per shard | phase | figure | latency p50 / p99 | CPU s per 1000 entities |");
    println!("|---|---|---|---|---|");
    for row in table {
        println!("{row}");
    }
    ExitCode::SUCCESS
}

/// One cluster with `replicas` replicas per shard: its phases' report rows.
async fn cluster_run(o: Options, replicas: u32) -> anyhow::Result<Vec<String>> {
    let mut env = TestEnv::new(&format!("benchrepl{replicas}"), INDEXES).await;
    let cluster = Cluster::start(&mut env, 2, replicas).await;
    let writer = env.spawn(&["writer"]).await;
    let indexer = env.spawn(&["indexer"]).await;
    let servers = Servers::of(&cluster);
    servers.pin(&[&writer, &indexer])?;
    let ids: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut rows = Vec::new();
    let api = writer.api();
    for batch in [1, o.batch] {
        let before = servers.ticks();
        let (n, lat) = load(&api, o, batch, ids.clone(), entity).await;
        let cpu = servers.since(&before, n);
        let what = if batch == 1 { "single puts".to_string() } else { format!("batch puts of {batch}") };
        rows.push(format!(
            "| {replicas} | {what} | {:.0} entities/s | {} | {cpu} |",
            n as f64 / o.secs as f64,
            quantiles(lat),
        ));
        eprintln!("bench_replicas: {}", rows.last().expect("pushed"));
    }
    if replicas > 0 {
        env.until_caught_up(&["index_user_published"]).await;
        let ids = ids.lock().unwrap().clone();
        for from in ["primary", "replicas"] {
            let reader = env.spawn_env(&["reader"], &[("BAGSTORE_READER__READ_FROM", from)]).await;
            servers.pin(&[&reader])?;
            for (what, query) in [("point gets", false), ("latest 20 of a user", true)] {
                let lat = reads(&reader.api(), o, &ids, query).await?;
                let rate = lat.len() as f64 / o.secs as f64;
                rows.push(format!(
                    "| {replicas} | {what} from the {from} | {rate:.0} reads/s | {} | - |",
                    quantiles(lat)
                ));
                eprintln!("bench_replicas: {}", rows.last().expect("pushed"));
            }
            // The reads went where they were sent.
            let m = reader.api().metrics().await;
            let target = if from == "primary" { "primary" } else { "replica" };
            let routed = metric_sum(&m, "bagstore_reader_routed_total", &[("target", target)]);
            let other = metric_sum(&m, "bagstore_reader_routed_total", &[]) - routed;
            ensure!(
                routed > 0.0 && other <= routed / 100.0,
                "reads meant for the {from}: {routed} went there, {other} elsewhere"
            );
            drop(reader);
        }
    }
    drop((writer, indexer));
    cluster.stop().await;
    Ok(rows)
}

/// Entity number `i` of the load: a post of one of [`USERS`].
fn entity(i: u64) -> Value {
    json!({
        "user_id": user_id(i % USERS),
        "published": 1_700_000_000 + i as i64,
        "title": format!("Post number {i} about bagstore, schemaless entities on sharded MySQL"),
        "n": i,
    })
}

fn user_id(u: u64) -> String {
    format!("{:032x}", 0x5e5e_0000_0000u64 + u)
}

/// `o.clients` clients reading through `api` for `o.secs` seconds: point
/// gets of `ids`, or the latest 20 of a user; each read's latency. Every
/// answer must be a 200.
async fn reads(api: &Api, o: Options, ids: &[String], query: bool) -> anyhow::Result<Vec<f64>> {
    ensure!(!ids.is_empty(), "nothing was written to read");
    let until = Instant::now() + Duration::from_secs(o.secs);
    let clients = (0..o.clients).map(|_| {
        let (api, ids) = (api.clone(), ids.to_vec());
        tokio::spawn(async move {
            let mut lat = Vec::new();
            while Instant::now() < until {
                let pick = rand::random::<u64>();
                let t = Instant::now();
                let (status, body) = if query {
                    let user = user_id(pick % USERS);
                    api.query(&json!({"index": "index_user_published", "where": {"user_id": user}, "order": "desc", "limit": 20})).await
                } else {
                    api.get(&ids[pick as usize % ids.len()]).await
                };
                lat.push(t.elapsed().as_secs_f64());
                let good = status == 200 && (!query || body["items"].is_array());
                if !good {
                    return Err(anyhow::anyhow!("a read answered {status}: {body}"));
                }
            }
            Ok(lat)
        })
    });
    let mut all = Vec::new();
    for c in futures::future::join_all(clients).await {
        all.extend(c.context("a read client")??);
    }
    Ok(all)
}
