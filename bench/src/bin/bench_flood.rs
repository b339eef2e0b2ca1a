//! Benchmark of the writer under a flood (issue 18): the writer's peak RSS
//! while many more writes arrive at once than it admits, with the bound on
//! (`writer.max_pending_writes`) and, side by side in the same run, with a
//! bound too high to matter (what the writer did before it had one).
//!
//! ```sh
//! cargo build --release -p bagstore -p bench --bins
//! target/release/bench_flood [--writes N] [--rounds R] [--body-bytes B] [--bound K]
//! ```
//!
//! Same local stack as the end-to-end suites (two private `mariadbd`, a mock
//! Kafka in this process, the real `bagstore writer` as a process). Each
//! round sends N concurrent `PUT`s of B-byte bodies; RSS is sampled every
//! 10 ms, and the process's own high-water mark (`VmHWM`) read at the end.
//! Prints a Markdown table. (That every acknowledged write is stored is
//! the end-to-end test `backpressure`.)

use bagstore_tests::{Proc, TestEnv};
use serde_json::json;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const USAGE: &str = "usage: bench_flood [--writes N] [--rounds R] [--body-bytes B] [--bound K]\n\
  --writes N      concurrent writes per round (default 2000)\n\
  --rounds R      rounds per configuration (default 5)\n\
  --body-bytes B  size of each entity's text property (default 16384)\n\
  --bound K       writer.max_pending_writes of the bounded run (default 100)";

struct Options {
    writes: usize,
    rounds: usize,
    body_bytes: usize,
    bound: usize,
}

fn parse_args(args: &[String]) -> Result<Options, String> {
    let mut o = Options { writes: 2000, rounds: 5, body_bytes: 16384, bound: 100 };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut num = || -> Result<usize, String> {
            let v = it.next().ok_or_else(|| format!("{a} needs a value"))?;
            v.parse().map_err(|_| format!("{a}: cannot parse {v:?}"))
        };
        match a.as_str() {
            "--writes" => o.writes = num()?,
            "--rounds" => o.rounds = num()?,
            "--body-bytes" => o.body_bytes = num()?,
            "--bound" => o.bound = num()?,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if o.writes == 0 || o.rounds == 0 || o.bound == 0 {
        return Err("--writes, --rounds and --bound must be positive".into());
    }
    Ok(o)
}

fn status_kb(pid: i32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
}

/// One configuration's figures.
struct Run {
    bound: usize,
    acked: u64,
    refused: u64,
    other: u64,
    secs: f64,
    peak_rss_kb: u64,
    hwm_kb: u64,
}

async fn flood(env: &TestEnv, o: &Options, bound: usize, id_base: usize) -> anyhow::Result<Run> {
    let b = bound.to_string();
    // A batch may not be larger than the bound (the settings check).
    let max_batch = bound.min(1000).to_string();
    let vars = [
        ("BAGSTORE_WRITER__MAX_PENDING_WRITES", b.as_str()),
        ("BAGSTORE_WRITER__MAX_BATCH", max_batch.as_str()),
        ("RUST_LOG", "warn"),
    ];
    let writer: Proc = env.spawn_env(&["writer"], &vars).await;
    let pid = writer.pid();
    let sampling = Arc::new(AtomicBool::new(true));
    let peak = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (on, peak) = (sampling.clone(), peak.clone());
        tokio::spawn(async move {
            while on.load(Ordering::Relaxed) {
                if let Some(kb) = status_kb(pid, "VmRSS:") {
                    peak.fetch_max(kb, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };
    let http = reqwest::Client::builder().pool_max_idle_per_host(o.writes).build()?;
    let text = "x".repeat(o.body_bytes);
    let (mut acked, mut refused, mut other) = (0, 0, 0);
    let started = Instant::now();
    for round in 0..o.rounds {
        let mut tasks = Vec::with_capacity(o.writes);
        for n in 0..o.writes {
            let id = format!("{:032x}", id_base + round * o.writes + n);
            let req =
                http.put(format!("{}/v1/entities/{id}", writer.url)).json(&json!({"n": n, "text": text}));
            tasks.push(tokio::spawn(async move { req.send().await.map(|r| r.status().as_u16()) }));
        }
        for t in tasks {
            match t.await? {
                Ok(200 | 201) => acked += 1,
                Ok(429) => refused += 1,
                _ => other += 1,
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let hwm_kb = status_kb(pid, "VmHWM:").unwrap_or(0);
    sampling.store(false, Ordering::Relaxed);
    sampler.await?;
    writer.terminate().await;
    Ok(Run { bound, acked, refused, other, secs, peak_rss_kb: peak.load(Ordering::Relaxed), hwm_kb })
}

async fn run(o: Options) -> anyhow::Result<()> {
    let env = TestEnv::new("benchflood", "").await;
    env.migrate().await;
    let bounded = flood(&env, &o, o.bound, 0).await?;
    let unbounded = flood(&env, &o, 1_000_000_000, o.rounds * o.writes).await?;
    println!(
        "## Writer under a flood: {} rounds of {} concurrent PUTs of {} B bodies\n",
        o.rounds, o.writes, o.body_bytes
    );
    println!("| writer.max_pending_writes | acknowledged | 429 | other | writes/s acknowledged | peak RSS (sampled) | VmHWM |");
    println!("|---|---|---|---|---|---|---|");
    for r in [&bounded, &unbounded] {
        let bound = if r.bound >= 1_000_000_000 { "unbounded".to_string() } else { r.bound.to_string() };
        println!(
            "| {bound} | {} | {} | {} | {:.0} | {:.1} MiB | {:.1} MiB |",
            r.acked,
            r.refused,
            r.other,
            r.acked as f64 / r.secs,
            r.peak_rss_kb as f64 / 1024.0,
            r.hwm_kb as f64 / 1024.0
        );
    }
    println!("\npeak RSS bounded / unbounded: {:.2}", bounded.hwm_kb as f64 / unbounded.hwm_kb.max(1) as f64);
    anyhow::ensure!(bounded.other == 0 && unbounded.other == 0, "answers other than 2xx and 429");
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let o = match parse_args(&args) {
        Ok(o) => o,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("bench_flood: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("a runtime");
    match rt.block_on(run(o)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench_flood: {e:#}");
            ExitCode::FAILURE
        }
    }
}
