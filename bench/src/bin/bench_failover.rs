//! Benchmark of failover (issue 33): the write unavailability of a shard
//! whose primary is killed with `kill -9`, over several failovers run by
//! the coordinator (`mysql.failover_after_ms`, 2000 by default here).
//!
//! ```sh
//! cargo build --release -p bagstore -p bench --bins
//! target/release/bench_failover [--failovers N] [--after-ms MS]
//! ```
//!
//! Same local stack as the end-to-end suites: private `mariadbd` servers
//! (`s0` alone, `s1` a primary and two semi-sync replicas, so a promoted
//! replica has another to acknowledge its writes at once), a mock Kafka in
//! this process, the real `bagstore writer` and `bagstore cleaner` (the
//! coordinator) as processes. A client writes entities of `s1` without
//! pause. Each round kills `s1`'s primary, measures from the kill to the
//! acknowledgement of the first write sent after it, restarts the dead server as a
//! replica on its port and waits for the coordinator to take it back.
//! Prints each failover's figure (with the coordinator's and the writer's
//! warnings meanwhile), the median and the maximum.

use bagstore_tests::replicated::{start_on, two_shards, ADMIN_ENV};
use bagstore_tests::{eventually, TestEnv};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[path = "../sibling.rs"]
mod sibling;

const USAGE: &str = "usage: bench_failover [--failovers N] [--after-ms MS]\n\
  --failovers N  primaries killed, one after another (default 5)\n\
  --after-ms MS  mysql.failover_after_ms of the coordinator (default 2000)";

fn parse_args(args: &[String]) -> Result<(usize, u64), String> {
    let (mut n, mut after) = (5usize, 2000u64);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let v = || it.clone().next().cloned().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--failovers" => n = v()?.parse().map_err(|_| "--failovers takes a number".to_string())?,
            "--after-ms" => after = v()?.parse().map_err(|_| "--after-ms takes a number".to_string())?,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
        it.next();
    }
    if n == 0 || after == 0 {
        return Err("--failovers and --after-ms must be positive".into());
    }
    Ok((n, after))
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (n, after) = match parse_args(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!(
                "{}{USAGE}",
                if e.is_empty() { String::new() } else { format!("bench_failover: {e}\n") }
            );
            return if e.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(2) };
        }
    };
    if let Err(e) = sibling::locate_bagstore() {
        eprintln!("bench_failover: {e}");
        return ExitCode::FAILURE;
    }
    match run(n, after).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench_failover: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(n: usize, after: u64) -> anyhow::Result<()> {
    let mut env = TestEnv::new("benchfailover", "").await;
    // Each server with the number of its directory (`m<i>`, see two_shards).
    let mut servers: Vec<(devstack::mariadb::MariaDb, usize)> =
        two_shards(&mut env, 2).await.into_iter().enumerate().map(|(i, s)| (s, i)).collect();
    let after_ms = after.to_string();
    let mut cleaner_env = ADMIN_ENV.to_vec();
    cleaner_env.push(("BAGSTORE_MYSQL__FAILOVER_AFTER_MS", &after_ms));
    let cleaner = env.spawn_env(&["cleaner"], &cleaner_env).await;
    let writer = env.spawn(&["writer"]).await;
    let toml = std::fs::read_to_string(env.config_path())?;
    let settings = schemas::Settings::from_toml_and_env(&toml, Vec::new())?;
    let shards = storage::Shards::connect(&settings.mysql).await?;

    // Acknowledged writes of s1: when each was sent, and acknowledged.
    let acked: Arc<Mutex<Vec<(Instant, Instant)>>> = Arc::default();
    let stop: Arc<AtomicBool> = Arc::default();
    let client = {
        let (api, acked, stop, shards) = (writer.api(), acked.clone(), stop.clone(), shards.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let id = schemas::EntityId(rand::random());
                if shards.of_id(&id) != 1 {
                    continue;
                }
                let sent = Instant::now();
                if api.put(&id.to_hex(), &serde_json::json!({"v": 1})).await.0 == 201 {
                    acked.lock().unwrap().push((sent, Instant::now()));
                }
            }
        })
    };
    let mut figures = Vec::new();
    // How many lines of each process's log the rounds before printed.
    let mut seen = [0usize; 2];
    for round in 1..=n {
        let primary = s1_primary(&env).await;
        let i = servers
            .iter()
            .position(|(s, _)| primary.contains(&format!(":{}/", s.port())))
            .expect("s1's primary");
        let (dead, home) = servers.remove(i);
        let (port, pid) = (dead.port(), dead.pid());
        assert!(bagstore_tests::std_command("kill").args(["-9", &pid.to_string()]).status()?.success());
        let killed = Instant::now();
        drop(dead);
        // A write sent before the kill may be answered just after it (it
        // committed before): the first write sent after the kill counts.
        let first = eventually(
            "a write of s1 sent after the kill acknowledged",
            Duration::from_secs(120),
            || async { acked.lock().unwrap().iter().find(|(sent, _)| *sent > killed).map(|(_, at)| *at) },
        )
        .await;
        let unavailable = first - killed;
        figures.push(unavailable);
        println!("failover {round}: writes to s1 unavailable for {} ms", unavailable.as_millis());
        // What the coordinator and the writer said meanwhile (warnings and
        // errors): an outlier says where its time went.
        for (k, (name, p)) in [("cleaner", &cleaner), ("writer", &writer)].into_iter().enumerate() {
            let log = p.log_text();
            let lines: Vec<&str> = log.lines().collect();
            for line in &lines[seen[k].min(lines.len())..] {
                let moved = line.contains("moved to another server") || line.contains("reload");
                if moved || line.contains("\"level\":\"WARN\"") || line.contains("\"level\":\"ERROR\"") {
                    println!("  {name}: {line}");
                }
            }
            seen[k] = lines.len();
        }
        let dir = env.dir.path().join(format!("m{home}"));
        let revived = start_on(&dir, home as u32 + 1, true, Some(port)).await;
        let listed = format!(":{port}/");
        eventually("the coordinator to take the dead server back", Duration::from_secs(120), || async {
            s1_replicas_online(&env).await.iter().any(|a| a.contains(&listed)).then_some(())
        })
        .await;
        servers.push((revived, home));
    }
    stop.store(true, Ordering::Relaxed);
    client.await?;
    figures.sort();
    let ms = |d: Duration| d.as_millis();
    println!(
        "\n| failovers | failover_after_ms | write unavailability median | max |\n|---|---|---|---|\n| {n} | {after} | {} ms | {} ms |",
        ms(figures[figures.len() / 2]),
        ms(*figures.last().expect("at least one"))
    );
    shards.close().await;
    drop((writer, cleaner));
    for (s, _) in servers {
        s.stop().await?;
    }
    Ok(())
}

async fn s1_doc(env: &TestEnv) -> serde_json::Value {
    let (ok, out, err) = env.run(&env.args(&["shards", "list", "--json"]), &[]).await;
    assert!(ok, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).expect("shards list --json");
    doc["shards"].as_array().unwrap().iter().find(|s| s["name"] == "s1").cloned().expect("s1")
}

async fn s1_primary(env: &TestEnv) -> String {
    s1_doc(env).await["address"].as_str().unwrap_or_default().to_string()
}

async fn s1_replicas_online(env: &TestEnv) -> Vec<String> {
    let doc = s1_doc(env).await;
    doc["servers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["role"] == "replica" && s["state"] == "online")
        .filter_map(|s| s["address"].as_str().map(String::from))
        .collect()
}
