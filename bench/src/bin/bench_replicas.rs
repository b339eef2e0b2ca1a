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
//! a private `mariadbd` primary sized as `bench` sizes its servers (2 GiB
//! buffer pool, 512 MiB redo log, `sync_binlog=1`), first alone, then with one semi-sync
//! replica (`AFTER_SYNC`: a commit waits until the replica has it), the
//! real `bagstore` writer, indexer and readers, a mock Kafka in this
//! process. As `bench` does for its write phases, the MariaDB servers run
//! on core 0 and everything else on the other cores, so a server's CPU
//! figures are its own. Phases: single puts, then batch puts, each with C
//! clients for S seconds: entities per second, latency, and the CPU seconds
//! per 1000 entities of the primaries and of the replicas apart, and of
//! each server. Then the same two phases into the JSON table a user would
//! make instead (`json_table`), on the same servers with the same
//! replication, and the ratio of the primaries' CPU per entity, bagstore's
//! (measured until its index caught up) to the JSON table's. With the
//! replica: point gets and a query (the latest 20 of a user) through a
//! reader that reads the primaries and one that reads the replicas
//! (`reader.read_from`), p50 and p99 side by side.

use anyhow::{ensure, Context};
use bagstore_tests::replicated::{Cluster, Size};
use bagstore_tests::{metric_sum, Api, TestEnv};
use serde_json::{json, Value};
use sqlx::mysql::{MySqlConnectOptions, MySqlPool};
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use storage::conns::Conns;

#[path = "../cluster.rs"]
mod cluster;
#[path = "../cpu.rs"]
mod cpu;
#[path = "../json_table.rs"]
mod json_table;
#[path = "../sibling.rs"]
mod sibling;

use cluster::{closed_loop, load, options_or_exit, quantiles, Options, Servers, POSTS_INDEX as INDEXES};

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
    let cluster = Cluster::start_sized(&mut env, 2, replicas, Size::Bench).await;
    let writer = env.spawn(&["writer"]).await;
    let indexer = env.spawn(&["indexer"]).await;
    let servers = Servers::of(&cluster);
    servers.pin(&[&writer, &indexer])?;
    let ids: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut rows = Vec::new();
    let api = writer.api();
    let mut bagstore_cpu = Vec::new();
    for batch in [1, o.batch] {
        let before = servers.ticks();
        let (n, lat) = load(&api, o, batch, ids.clone(), entity).await;
        // The deferred work (the relay's outbox deletes, the index rows)
        // counts too.
        env.until_caught_up(&["index_user_published"]).await;
        let cpu = servers.since(&before, n);
        let what = if batch == 1 { "single puts".to_string() } else { format!("batch puts of {batch}") };
        say(&mut rows, write_row(replicas, &what, n, o.secs, lat, &cpu));
        bagstore_cpu.push(cpu.primaries);
    }
    let json = Json::create(&cluster, o.clients).await?;
    let mut json_cpu = Vec::new();
    for batch in [1, o.batch] {
        let before = servers.ticks();
        let (n, lat) = json.load(o, batch).await;
        let cpu = servers.since(&before, n);
        let what = if batch == 1 { "single inserts".to_string() } else { format!("inserts of {batch}") };
        say(&mut rows, write_row(replicas, &format!("JSON table: {what}"), n, o.secs, lat, &cpu));
        json_cpu.push(cpu.primaries);
    }
    json.replicated(&cluster).await?;
    let ratio = format!(
        "single {:.2}×, batch {:.2}×",
        bagstore_cpu[0] / json_cpu[0].max(1e-9),
        bagstore_cpu[1] / json_cpu[1].max(1e-9)
    );
    say(
        &mut rows,
        format!(
            "| {replicas} | primaries' CPU per entity, bagstore / JSON table (target ≤ 2.0 single, ≤ 2.5 batch) | \
             {ratio} | - | - |"
        ),
    );
    if replicas > 0 {
        env.until_caught_up(&["index_user_published"]).await;
        let ids = ids.lock().unwrap().clone();
        for from in ["primary", "replicas"] {
            let reader = env.spawn_env(&["reader"], &[("BAGSTORE_READER__READ_FROM", from)]).await;
            servers.pin(&[&reader])?;
            for (what, query) in [("point gets", false), ("latest 20 of a user", true)] {
                let lat = reads(&reader.api(), o, &ids, query).await?;
                let rate = lat.len() as f64 / o.secs as f64;
                say(
                    &mut rows,
                    format!(
                        "| {replicas} | {what} from the {from} | {rate:.0} reads/s | {} | - |",
                        quantiles(lat)
                    ),
                );
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

/// Adds `row` to the table, said on stderr as it is measured.
fn say(rows: &mut Vec<String>, row: String) {
    eprintln!("bench_replicas: {row}");
    rows.push(row);
}

/// A write phase's row: `n` entities in `secs` seconds, their latencies,
/// the servers' CPU.
fn write_row(
    replicas: u32,
    what: &str,
    n: u64,
    secs: u64,
    lat: Vec<f64>,
    cpu: &impl std::fmt::Display,
) -> String {
    format!("| {replicas} | {what} | {:.0} entities/s | {} | {cpu} |", n as f64 / secs as f64, quantiles(lat))
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

/// The JSON table (`json_table`) in database `bench_json` of each shard's
/// primary, documents placed by id as bagstore places entities; written
/// through reused connections, as `bench`'s contenders are.
struct Json {
    conns: Arc<Vec<Conns>>,
}

impl Json {
    async fn create(cluster: &Cluster, clients: usize) -> anyhow::Result<Json> {
        let mut conns = Vec::new();
        for (i, shard) in cluster.shards.iter().enumerate() {
            let server = shard[0].server.as_ref().context("a running primary")?;
            let root = MySqlPool::connect(&server.dsn("")).await?;
            sqlx::query("CREATE DATABASE IF NOT EXISTS bench_json").execute(&root).await?;
            root.close().await;
            let pool = MySqlPool::connect(&server.dsn("bench_json")).await?;
            sqlx::query(json_table::DDL).execute(&pool).await?;
            pool.close().await;
            let options = MySqlConnectOptions::from_str(&server.dsn("bench_json"))?;
            conns.push(Conns::new(i, options, clients as u32 + 4));
        }
        Ok(Json { conns: Arc::new(conns) })
    }

    /// `o.clients` clients inserting new documents (`batch` per request,
    /// one multi-row insert per shard, shards in parallel) for `o.secs`
    /// seconds.
    async fn load(&self, o: Options, batch: usize) -> (u64, Vec<f64>) {
        let conns = self.conns.clone();
        closed_loop(o, move || {
            let conns = conns.clone();
            async move {
                let mut per: Vec<Vec<([u8; 16], String)>> = vec![Vec::new(); conns.len()];
                for _ in 0..batch {
                    let id: [u8; 16] = rand::random();
                    let logical = schemas::logical_of(&id, schemas::shard::DEFAULT_LOGICAL_SHARDS);
                    per[logical as usize % conns.len()]
                        .push((id, entity(rand::random::<u32>().into()).to_string()));
                }
                let inserts = per.iter().enumerate().filter(|(_, docs)| !docs.is_empty()).map(|(s, docs)| {
                    let conns = conns.clone();
                    async move {
                        let sql = format!(
                            "{} {}",
                            json_table::INSERT_HEAD,
                            vec![json_table::ROW; docs.len()].join(", ")
                        );
                        let q = docs
                            .iter()
                            .fold(sqlx::query(&sql), |q, (id, doc)| q.bind(&id[..]).bind(doc.as_str()));
                        let mut t = conns[s].take().await.ok()?;
                        q.execute(&mut t.conn).await.ok()?;
                        conns[s].give_back(t);
                        Some(docs.len() as u64)
                    }
                });
                futures::future::join_all(inserts).await.into_iter().flatten().sum()
            }
        })
        .await
    }

    /// Every replica holds as many documents as its primary (within 60 s):
    /// the JSON table was written with the same replication as bagstore.
    async fn replicated(&self, cluster: &Cluster) -> anyhow::Result<()> {
        for shard in &cluster.shards {
            let count = |m: usize| async move {
                let server = shard[m].server.as_ref().context("a running server")?;
                let pool = MySqlPool::connect(&server.dsn("bench_json")).await?;
                let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM docs").fetch_one(&pool).await?;
                pool.close().await;
                anyhow::Ok(n)
            };
            let primary = count(0).await?;
            ensure!(primary > 0, "the JSON table holds no documents");
            for m in 1..shard.len() {
                let until = Instant::now() + Duration::from_secs(60);
                while count(m).await? != primary {
                    ensure!(
                        Instant::now() < until,
                        "a replica's JSON table did not reach its primary's {primary} documents"
                    );
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
        Ok(())
    }
}
