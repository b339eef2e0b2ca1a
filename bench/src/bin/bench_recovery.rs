//! Benchmark of index recovery after an indexer dies (issue 20, target 4):
//! the index lag while one of two indexers is killed with `kill -9` and
//! either started again at once under the same name (as Kubernetes
//! restarts a crashed container in its pod) or not started again, with
//! dynamic group membership and with static membership (KIP-345's
//! `group.instance.id`, set through `kafka.options`), on librdkafka's mock
//! cluster and on the standalone tansu broker.
//!
//! ```sh
//! cargo build --release -p bagstore -p bench --bins
//! target/release/bench_recovery [--rate R] [--broker mock|tansu|both]
//! ```
//!
//! Same local stack as the end-to-end suites (two private `mariadbd`, the
//! real `bagstore` processes; tansu needs `BAGSTORE_TANSU` or the build
//! `scripts/test` makes, and PostgreSQL). A steady open loop of single
//! `PUT`s runs throughout; the index group's lag (messages not committed,
//! read from the broker every 100 ms) is the measure. "Back" is the time
//! from the kill (and from the restart) until the lag is back to its
//! level before the kill and stays there for a second. Prints a Markdown
//! table.

use bagstore_tests::{Proc, TestEnv, STANDARD_INDEXES};
use serde_json::json;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const USAGE: &str = "usage: bench_recovery [--rate R] [--broker mock|tansu|both] [--membership dynamic|static|both] [--restart yes|no|both]\n\
  --rate R        single PUTs per second during the run (default 100)\n\
  --broker B      which broker to measure on (default both)\n\
  --membership M  which group membership (default both)\n\
  --restart X     whether the killed indexer is started again (default both)";

const INDEX: &str = "index_user_id";
/// The session timeout the runs use (the test environments' setting).
const SESSION_TIMEOUT: Duration = Duration::from_millis(6000);
/// How long the lag must stay at its earlier level to count as back.
const STAYS: Duration = Duration::from_secs(1);

struct Options {
    rate: f64,
    brokers: Vec<&'static str>,
    memberships: Vec<&'static str>,
    restarts: Vec<bool>,
}

fn parse_args(args: &[String]) -> Result<Options, String> {
    let mut o = Options {
        rate: 100.0,
        brokers: vec!["mock", "tansu"],
        memberships: vec!["dynamic", "static"],
        restarts: vec![true, false],
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--rate" => {
                let v = value()?;
                o.rate = v.parse().map_err(|_| format!("--rate: cannot parse {v:?}"))?;
            }
            "--broker" => {
                o.brokers = match value()?.as_str() {
                    "mock" => vec!["mock"],
                    "tansu" => vec!["tansu"],
                    "both" => vec!["mock", "tansu"],
                    other => return Err(format!("--broker: {other:?} is not mock, tansu or both")),
                }
            }
            "--membership" => {
                o.memberships = match value()?.as_str() {
                    "dynamic" => vec!["dynamic"],
                    "static" => vec!["static"],
                    "both" => vec!["dynamic", "static"],
                    other => return Err(format!("--membership: {other:?} is not dynamic, static or both")),
                }
            }
            "--restart" => {
                o.restarts = match value()?.as_str() {
                    "yes" => vec![true],
                    "no" => vec![false],
                    "both" => vec![true, false],
                    other => return Err(format!("--restart: {other:?} is not yes, no or both")),
                }
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if !(o.rate > 0.0 && o.rate <= 2000.0) {
        return Err("--rate must be in (0, 2000]".into());
    }
    Ok(o)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = match parse_args(&args) {
        Ok(o) => o,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("bench_recovery: {e}");
            }
            eprintln!("{USAGE}");
            return if e.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(2) };
        }
    };
    if std::env::var_os("BAGSTORE_BIN").is_none() {
        // This binary lives in target/<profile>/, next to `bagstore`.
        let bin = std::env::current_exe().map(|e| e.with_file_name("bagstore")).unwrap_or_default();
        if !bin.exists() {
            eprintln!("bench_recovery: {} is missing: build the workspace first", bin.display());
            return ExitCode::FAILURE;
        }
        std::env::set_var("BAGSTORE_BIN", &bin);
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    match rt.block_on(run(opts)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench_recovery: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// One measured kill.
struct Outcome {
    broker: &'static str,
    membership: &'static str,
    restarted: bool,
    /// Whether the two indexers were applying (lag low) within 60 s.
    formed: bool,
    before_max: i64,
    peak: i64,
    /// From the kill until the lag is back (and stays).
    back_after_kill: Option<Duration>,
    /// From the restart (when there is one) until the lag is back.
    back_after_restart: Option<Duration>,
}

async fn run(opts: Options) -> anyhow::Result<()> {
    let mut outcomes = Vec::new();
    for broker in &opts.brokers {
        if *broker == "tansu" && bagstore_tests::tansu::tansu_bin().is_none() {
            eprintln!("bench_recovery: no tansu binary (set BAGSTORE_TANSU or run scripts/test once); skipping tansu");
            continue;
        }
        for membership in opts.memberships.clone() {
            for restarted in opts.restarts.clone() {
                let o = measure(broker, membership, restarted, opts.rate).await?;
                eprintln!(
                    "{broker} {membership} {}: peak {} messages, back {:?} after the kill",
                    if restarted { "restarted" } else { "not restarted" },
                    o.peak,
                    o.back_after_kill
                );
                outcomes.push(o);
            }
        }
    }
    println!(
        "\nIndex recovery after `kill -9` of one of two indexers ({INDEX}; {} single PUTs/s; session timeout {} ms)\n",
        opts.rate,
        SESSION_TIMEOUT.as_millis()
    );
    println!("| broker | membership | killed indexer | lag before (max msgs) | peak lag (msgs) | back after the kill | back after the restart |");
    println!("|---|---|---|---:|---:|---:|---:|");
    let secs = |d: Option<Duration>| {
        d.map_or("not within 60 s".to_string(), |d| format!("{:.2} s", d.as_secs_f64()))
    };
    for o in &outcomes {
        let killed = if o.restarted { "restarted at once" } else { "not restarted" };
        if !o.formed {
            println!(
                "| {} | {} | {killed} | the two indexers did not start applying within 60 s | | | |",
                o.broker, o.membership
            );
            continue;
        }
        println!(
            "| {} | {} | {killed} | {} | {} | {} | {} |",
            o.broker,
            o.membership,
            o.before_max,
            o.peak,
            secs(o.back_after_kill),
            if o.restarted { secs(o.back_after_restart) } else { "-".into() }
        );
    }
    Ok(())
}

/// An indexer of [`INDEX`]; a static member (Kafka's `group.instance.id`,
/// through `kafka.options`) named `name`, or a dynamic one.
async fn indexer(env: &TestEnv, name: &str, membership: &str) -> Proc {
    let options = format!("{{\"group.instance.id\" = \"{name}\"}}");
    let mut vars = vec![("BAGSTORE_KAFKA__SESSION_TIMEOUT_MS", "6000")];
    if membership == "static" {
        vars.push(("BAGSTORE_KAFKA__OPTIONS", options.as_str()));
    }
    env.spawn_env(&["indexer", "--index", INDEX, "--http", "127.0.0.1:0"], &vars).await
}

async fn group_lag(env: &TestEnv) -> Option<i64> {
    let k = env.kafka_settings();
    let parts = service::kafka::group_lag(&k, &k.group_for(INDEX)).await.ok()?;
    Some(parts.iter().map(|p| p.lag()).sum())
}

async fn measure(
    broker: &'static str,
    membership: &'static str,
    restarted: bool,
    rate: f64,
) -> anyhow::Result<Outcome> {
    let name = format!("recovery{}{}{}", &broker[..1], &membership[..1], u8::from(restarted));
    let env = match broker {
        "mock" => TestEnv::new(&name, STANDARD_INDEXES).await,
        _ => TestEnv::with_tansu(&name, STANDARD_INDEXES).await,
    };
    env.migrate().await;
    let writer = env.spawn(&["writer", "--http", "127.0.0.1:0"]).await;
    let doomed = indexer(&env, "indexer-a", membership).await;
    let _survivor = indexer(&env, "indexer-b", membership).await;

    // The load: single PUTs at `rate`, each a new user id, from eight
    // clients that take turns at the ticks (a slow answer delays, never
    // piles up connections).
    let stop = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(AtomicU64::new(0));
    let ticks = Arc::new(tokio::sync::Mutex::new({
        let mut t = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    }));
    let next = Arc::new(AtomicU64::new(0));
    let http = reqwest::Client::new();
    let load: Vec<_> = (0..8)
        .map(|_| {
            let (stop, failed, ticks, next, http) =
                (stop.clone(), failed.clone(), ticks.clone(), next.clone(), http.clone());
            let base = writer.url.clone();
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    ticks.lock().await.tick().await;
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let id = format!("{:032x}", 0x7ec0_0000_0000u64 + i);
                    let body = json!({"user_id": format!("{i:032x}"), "n": i});
                    let ok = http
                        .put(format!("{base}/v1/entities/{id}"))
                        .json(&body)
                        .send()
                        .await
                        .is_ok_and(|r| r.status().is_success());
                    if !ok {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();

    // Both members hold partitions and the lag is steady: 5 s of samples.
    let forming = Instant::now();
    loop {
        if group_lag(&env).await.is_some_and(|l| l < (rate as i64).max(20)) {
            break;
        }
        if forming.elapsed() > Duration::from_secs(60) {
            stop.store(true, Ordering::Relaxed);
            return Ok(Outcome {
                broker,
                membership,
                restarted,
                formed: false,
                before_max: 0,
                peak: 0,
                back_after_kill: None,
                back_after_restart: None,
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut before_max = 0;
    let warm = Instant::now();
    while warm.elapsed() < Duration::from_secs(5) {
        if let Some(l) = group_lag(&env).await {
            before_max = before_max.max(l);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Back: at most the level before, or a tenth of a second of writes.
    let level = before_max.max((rate / 10.0) as i64);

    let killed_at = Instant::now();
    doomed.kill9().await;
    let mut restarted_at = None;
    let mut _again = None;
    if restarted {
        restarted_at = Some(Instant::now());
        _again = Some(indexer(&env, "indexer-a", membership).await);
    }
    let mut peak = 0;
    let mut calm_since: Option<Instant> = None;
    let mut back_at = None;
    while killed_at.elapsed() < Duration::from_secs(60) {
        let sampled = Instant::now();
        if let Some(l) = group_lag(&env).await {
            peak = peak.max(l);
            if l <= level {
                let since = *calm_since.get_or_insert(sampled);
                // Only after a rise: the first samples may predate the kill's effect.
                if peak > level && sampled.duration_since(since) >= STAYS {
                    back_at = Some(since);
                    break;
                }
            } else {
                calm_since = None;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for l in load {
        let _ = l.await;
    }
    let failed = failed.load(Ordering::Relaxed);
    if failed > 0 {
        eprintln!("bench_recovery: {failed} PUTs failed during the run");
    }
    Ok(Outcome {
        broker,
        membership,
        restarted,
        formed: true,
        before_max,
        peak,
        back_after_kill: back_at.map(|t| t.duration_since(killed_at)),
        back_after_restart: back_at.zip(restarted_at).map(|(t, r)| t.saturating_duration_since(r)),
    })
}
