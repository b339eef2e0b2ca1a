//! What the cluster benchmarks (`bench_replicas`, `bench_unique`) share:
//! their options, the write load, latency quantiles, and the servers'
//! CPU per 1000 entities (servers pinned to core 0, everything else to
//! the other cores, as `bench` does).

use bagstore_tests::replicated::Cluster;
use bagstore_tests::{Api, Proc};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::cpu;

/// The index both cluster benchmarks declare: a user's posts by time.
pub const POSTS_INDEX: &str = r#"
[[indexes]]
table = "index_user_published"
properties = [{ name = "user_id", type = "uuid" }, { name = "published", type = "int" }]
shard_on = "user_id"
"#;

/// The usage text of the benchmark `name`.
pub fn usage(name: &str) -> String {
    format!(
        "usage: {name} [--secs S] [--clients C] [--batch B]\n  --secs S     seconds per phase (default 20)\n  \
         --clients C  concurrent clients (default 16)\n  --batch B    entities per batch put (default 100)"
    )
}

/// Seconds per phase, concurrent clients, entities per batch put.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub secs: u64,
    pub clients: usize,
    pub batch: usize,
}

/// The options of the benchmark `name` from the command line, the
/// `bagstore` binary beside it located; the exit code when it is not to
/// run (`--help`, a bad argument, no `bagstore`).
pub fn options_or_exit(name: &str) -> Result<Options, std::process::ExitCode> {
    let usage = usage(name);
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = match parse_args(&args) {
        Ok(o) => o,
        Err(e) if e.is_empty() => {
            println!("{usage}");
            return Err(std::process::ExitCode::SUCCESS);
        }
        Err(e) => {
            eprintln!("{name}: {e}\n{usage}");
            return Err(std::process::ExitCode::from(2));
        }
    };
    if let Err(e) = crate::sibling::locate_bagstore() {
        eprintln!("{name}: {e}");
        return Err(std::process::ExitCode::FAILURE);
    }
    Ok(opts)
}

/// `--secs S --clients C --batch B` (defaults 20, 16, 100); `Err("")` for
/// `--help`.
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

/// `o.clients` clients, each calling `op` back to back for `o.secs`
/// seconds: the sum of what the calls returned (entities acknowledged),
/// and each call's latency.
pub async fn closed_loop<F, Fut>(o: Options, op: F) -> (u64, Vec<f64>)
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = u64> + Send,
{
    let until = Instant::now() + Duration::from_secs(o.secs);
    let clients = (0..o.clients).map(|_| {
        let op = op.clone();
        tokio::spawn(async move {
            let (mut n, mut lat) = (0u64, Vec::new());
            while Instant::now() < until {
                let t = Instant::now();
                n += op().await;
                lat.push(t.elapsed().as_secs_f64());
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

/// `o.clients` clients putting new entities (`batch` per request) for
/// `o.secs` seconds: the entities acknowledged, and each request's latency.
/// Entity `i`'s body comes from `entity`.
pub async fn load(
    api: &Api,
    o: Options,
    batch: usize,
    ids: Arc<Mutex<Vec<String>>>,
    entity: fn(u64) -> Value,
) -> (u64, Vec<f64>) {
    let api = api.clone();
    closed_loop(o, move || {
        let (api, ids) = (api.clone(), ids.clone());
        async move {
            let items: Vec<(String, Value)> = (0..batch)
                .map(|_| (schemas::EntityId(rand::random()).to_hex(), entity(rand::random::<u32>().into())))
                .collect();
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
            let n = ok.len() as u64;
            ids.lock().unwrap().extend(ok);
            n
        }
    })
    .await
}

/// "p50 / p99" in milliseconds.
pub fn quantiles(mut lat: Vec<f64>) -> String {
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
pub struct Servers {
    all: Vec<(String, u32)>,
}

/// CPU seconds per 1000 entities: the primaries', the replicas' (sums),
/// and each server's.
pub struct Cpu {
    pub primaries: f64,
    pub replicas: f64,
    pub each: Vec<(String, f64)>,
}

impl Servers {
    pub fn of(cluster: &Cluster) -> Servers {
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
    pub fn pin(&self, procs: &[&Proc]) -> anyhow::Result<()> {
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
    pub fn ticks(&self) -> Vec<u64> {
        self.all.iter().map(|(_, pid)| cpu::cpu_ticks(*pid).unwrap_or(0)).collect()
    }

    /// CPU seconds per 1000 entities since `before`, of `n` entities.
    pub fn since(&self, before: &[u64], n: u64) -> Cpu {
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
