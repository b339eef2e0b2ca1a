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
use bagstore_tests::{metric_sum, Api, Proc, TestEnv};
use serde_json::{json, Value};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[path = "../cpu.rs"]
mod cpu;
#[path = "../sibling.rs"]
mod sibling;

const USAGE: &str = "usage: bench_replicas [--secs S] [--clients C] [--batch B]\n\
  --secs S     seconds per phase (default 20)\n\
  --clients C  concurrent clients (default 16)\n\
  --batch B    entities per batch put (default 100)";

const INDEXES: &str = r#"
[[indexes]]
table = "index_user_published"
properties = [{ name = "user_id", type = "uuid" }, { name = "published", type = "int" }]
shard_on = "user_id"
"#;

/// Users the entities belong to (each has many, for "latest 20").
const USERS: u64 = 200;

#[derive(Debug, Clone, Copy)]
struct Options {
    secs: u64,
    clients: usize,
    batch: usize,
}

fn parse_args(args: &[String]) -> Result<Options, String> {
    let mut o = Options { secs: 20, clients: 16, batch: 100 };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().and_then(|v| v.parse::<u64>().ok()).filter(|v| *v > 0);
        match a.as_str() {
            "--secs" => o.secs = value().ok_or("--secs takes a positive number")?,
            "--clients" => o.clients = value().ok_or("--clients takes a positive number")? as usize,
            "--batch" => o.batch = value().ok_or("--batch takes a positive number")? as usize,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(o)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = match parse_args(&args) {
        Ok(o) => o,
        Err(e) if e.is_empty() => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("bench_replicas: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = sibling::locate_bagstore() {
        eprintln!("bench_replicas: {e}");
        return ExitCode::FAILURE;
    }
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
        let (n, lat) = load(&api, o, batch, ids.clone()).await;
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

/// `o.clients` clients putting new entities (`batch` per request) for
/// `o.secs` seconds: the entities acknowledged, and each request's latency.
async fn load(api: &Api, o: Options, batch: usize, ids: Arc<Mutex<Vec<String>>>) -> (u64, Vec<f64>) {
    let until = Instant::now() + Duration::from_secs(o.secs);
    let clients = (0..o.clients).map(|_| {
        let (api, ids) = (api.clone(), ids.clone());
        tokio::spawn(async move {
            let (mut n, mut lat) = (0u64, Vec::new());
            while Instant::now() < until {
                let items: Vec<(String, Value)> = (0..batch)
                    .map(|_| {
                        (schemas::EntityId(rand::random()).to_hex(), entity(rand::random::<u32>().into()))
                    })
                    .collect();
                let t = Instant::now();
                let ok: Vec<String> = if batch == 1 {
                    let (id, body) = &items[0];
                    let (status, _) = api.put(id, body).await;
                    if status == 201 {
                        vec![id.clone()]
                    } else {
                        Vec::new()
                    }
                } else {
                    let docs: Vec<Value> = items
                        .iter()
                        .map(|(id, b)| {
                            let mut doc = b.clone();
                            doc["id"] = json!(id);
                            doc
                        })
                        .collect();
                    let (_, body) = api.batch(&docs).await;
                    let answers = body["results"].as_array().cloned().unwrap_or_default();
                    items
                        .iter()
                        .zip(answers)
                        .filter(|(_, a)| a["version"].is_u64())
                        .map(|((id, _), _)| id.clone())
                        .collect()
                };
                lat.push(t.elapsed().as_secs_f64());
                n += ok.len() as u64;
                ids.lock().unwrap().extend(ok);
            }
            (n, lat)
        })
    });
    let mut total = (0, Vec::new());
    for c in futures::future::join_all(clients).await {
        let (n, lat) = c.expect("a load client");
        total.0 += n;
        total.1.extend(lat);
    }
    total
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

/// "p50 / p99" in milliseconds.
fn quantiles(mut lat: Vec<f64>) -> String {
    if lat.is_empty() {
        return "-".into();
    }
    lat.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| lat[((lat.len() as f64 * q).ceil() as usize).clamp(1, lat.len()) - 1] * 1e3;
    format!("{:.2} / {:.2} ms", at(0.5), at(0.99))
}

/// The cluster's servers, each with its name (`s0 primary`, `s1
/// replica`): a shard's first member is its primary here (no failover
/// runs).
struct Servers {
    all: Vec<(String, u32)>,
}

/// CPU seconds per 1000 entities: the primaries', the replicas' (sums),
/// and each server's.
struct Cpu {
    primaries: f64,
    replicas: f64,
    each: Vec<(String, f64)>,
}

impl Servers {
    fn of(cluster: &Cluster) -> Servers {
        let pid = |m: &bagstore_tests::replicated::Member| m.server.as_ref().expect("running").pid();
        let all = cluster
            .shards
            .iter()
            .enumerate()
            .flat_map(|(i, members)| {
                members.iter().enumerate().map(move |(m, member)| {
                    (format!("s{i} {}", if m == 0 { "primary" } else { "replica" }), pid(member))
                })
            })
            .collect();
        Servers { all }
    }

    /// The servers on core 0, `procs` and this process on the others.
    fn pin(&self, procs: &[&Proc]) -> anyhow::Result<()> {
        if cpu::online_cores() < 2 {
            return Ok(());
        }
        for (_, pid) in &self.all {
            cpu::pin(*pid, "0")?;
        }
        let rest = cpu::off_server_cores();
        for pid in procs.iter().map(|p| p.pid() as u32).chain([std::process::id()]) {
            cpu::pin(pid, &rest)?;
        }
        Ok(())
    }

    /// Each server's CPU ticks so far.
    fn ticks(&self) -> Vec<u64> {
        self.all.iter().map(|(_, pid)| cpu::cpu_ticks(*pid).unwrap_or(0)).collect()
    }

    /// CPU seconds per 1000 entities since `before`, of `n` entities.
    fn since(&self, before: &[u64], n: u64) -> Cpu {
        let each: Vec<(String, f64)> = self
            .all
            .iter()
            .zip(self.ticks().into_iter().zip(before))
            .map(|((name, _), (now, then))| {
                (name.clone(), now.saturating_sub(*then) as f64 / 100.0 / n.max(1) as f64 * 1000.0)
            })
            .collect();
        let sum = |role: &str| each.iter().filter(|(name, _)| name.ends_with(role)).map(|(_, c)| c).sum();
        Cpu { primaries: sum("primary"), replicas: sum("replica"), each }
    }
}

impl std::fmt::Display for Cpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "primaries {:.3}", self.primaries)?;
        if self.each.iter().any(|(name, _)| name.ends_with("replica")) {
            write!(f, ", replicas {:.3}", self.replicas)?;
        }
        let each: Vec<String> = self.each.iter().map(|(name, c)| format!("{name} {c:.3}")).collect();
        write!(f, " ({})", each.join(", "))
    }
}
