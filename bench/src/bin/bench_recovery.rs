//! Benchmark of index recovery after an indexer dies (issue 20, target 4):
//! the index lag while one of two indexers is killed with `kill -9` and
//! either started again at once under the same name (as Kubernetes
//! restarts a crashed container in its pod, `indexer.member`) or not
//! started again, on librdkafka's mock cluster and on the standalone tansu
//! broker. The indexers take their partitions by member leases; the runs
//! that weighed them against the broker's group protocol, dynamic and
//! static, are in docs/benchmarks-history.md (R4-R6).
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
//! level before the kill (its maximum, plus a tenth of a second of writes)
//! and stays there for a second. "Applied again" reads the indexers'
//! per-partition counters: the restarted one's first applied event, or
//! the survivor applying every partition. Prints a Markdown table.

#[path = "../hist.rs"]
mod hist;
#[path = "../sibling.rs"]
mod sibling;

use bagstore_tests::membership::{counts, Counts, PARTITIONS};
use bagstore_tests::{Proc, TestEnv, STANDARD_INDEXES};
use serde_json::json;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const USAGE: &str = "usage: bench_recovery [--rate R] [--broker mock|tansu|both] [--restart yes|no|both]\n\
  --rate R        single PUTs per second during the run (default 100)\n\
  --broker B      which broker to measure on (default both)\n\
  --restart X     whether the killed indexer is started again (default both)\n\
  --lag-secs S    per broker, first the max single-PUT rate and the index lag at 50% of it, phases of S s (default 15; 0: skip)\n\
  --fetch-wait MS the indexers' fetch wait, indexer.fetch_wait_ms (default bagstore's: 5 on the mock, as in bagstore dev; 20 on tansu)\n\
  --no-recovery   measure the lag only (no kills)";

const INDEX: &str = "index_user_id";
/// The session timeout the runs use (the test environments' setting).
const SESSION_TIMEOUT: Duration = Duration::from_millis(6000);
/// How long the lag must stay at its earlier level to count as back.
const STAYS: Duration = Duration::from_secs(1);

struct Options {
    rate: f64,
    brokers: Vec<&'static str>,
    restarts: Vec<bool>,
    /// Seconds of each lag phase (0: no lag measurement).
    lag_secs: f64,
    /// The indexers' `indexer.fetch_wait_ms`; bagstore's default if unset.
    fetch_wait_ms: Option<u64>,
    /// Measure the recovery after kills (`--no-recovery`: the lag only).
    recovery: bool,
}

impl Options {
    /// The indexers' fetch wait on `broker`: the one given, or the one
    /// bagstore gives them there (the mock is `bagstore dev`'s broker).
    fn fetch_wait_ms(&self, broker: &str) -> u64 {
        self.fetch_wait_ms.unwrap_or(match broker {
            "mock" => schemas::settings::EMBEDDED_FETCH_WAIT_MS,
            _ => schemas::settings::FETCH_WAIT_MS,
        })
    }
}

fn parse_args(args: &[String]) -> Result<Options, String> {
    let mut o = Options {
        rate: 100.0,
        brokers: vec!["mock", "tansu"],
        restarts: vec![true, false],
        lag_secs: 15.0,
        fetch_wait_ms: None,
        recovery: true,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--rate" => {
                let v = value()?;
                o.rate = v.parse().map_err(|_| format!("--rate: cannot parse {v:?}"))?;
            }
            "--broker" => o.brokers = pick(a, value()?, &[("mock", "mock"), ("tansu", "tansu")])?,
            "--restart" => o.restarts = pick(a, value()?, &[("yes", true), ("no", false)])?,
            "--lag-secs" => {
                let v = value()?;
                o.lag_secs = v.parse().map_err(|_| format!("--lag-secs: cannot parse {v:?}"))?;
            }
            "--fetch-wait" => {
                let v = value()?;
                o.fetch_wait_ms = Some(v.parse().map_err(|_| format!("--fetch-wait: cannot parse {v:?}"))?);
            }
            "--no-recovery" => o.recovery = false,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if !(o.rate > 0.0 && o.rate <= 2000.0) {
        return Err("--rate must be in (0, 2000]".into());
    }
    Ok(o)
}

/// The value of an either-or flag: one of `choices` (by name), or every
/// one ("both" for a pair, "all" for more).
fn pick<T: Copy>(flag: &str, value: &str, choices: &[(&str, T)]) -> Result<Vec<T>, String> {
    let every = if choices.len() == 2 { "both" } else { "all" };
    match choices.iter().find(|(name, _)| *name == value) {
        Some((_, v)) => Ok(vec![*v]),
        None if value == every => Ok(choices.iter().map(|(_, v)| *v).collect()),
        None => {
            let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
            Err(format!("{flag}: {value:?} is not {} or {every}", names.join(", ")))
        }
    }
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
    if let Err(e) = sibling::locate_bagstore() {
        eprintln!("bench_recovery: {e}");
        return ExitCode::FAILURE;
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
    restarted: bool,
    /// Whether the two indexers were applying (lag low) within 60 s.
    formed: bool,
    before_max: i64,
    peak: i64,
    /// The lag counted as back: the maximum before the kill, or a tenth
    /// of a second of writes.
    level: i64,
    /// From the kill until the lag is back (and stays).
    back_after_kill: Option<Duration>,
    /// From the restart (when there is one) until the lag is back.
    back_after_restart: Option<Duration>,
    /// The issue's own words: from the restart until the restarted indexer
    /// applies events again, or (not restarted) from the kill until the
    /// survivor applies events of every partition.
    applied_again: Option<Duration>,
}

async fn run(opts: Options) -> anyhow::Result<()> {
    let mut outcomes = Vec::new();
    let mut lags = Vec::new();
    for broker in &opts.brokers {
        if *broker == "tansu" && bagstore_tests::tansu::tansu_bin().is_none() {
            eprintln!("bench_recovery: no tansu binary (set BAGSTORE_TANSU or run scripts/test once); skipping tansu");
            continue;
        }
        if opts.lag_secs > 0.0 {
            let l = lag_at_half(broker, Duration::from_secs_f64(opts.lag_secs), opts.fetch_wait_ms(broker))
                .await?;
            eprintln!("{broker}: {l:?}");
            lags.push(l);
        }
        for restarted in opts.restarts.clone().into_iter().filter(|_| opts.recovery) {
            let o = measure(broker, restarted, opts.rate, opts.fetch_wait_ms(broker)).await?;
            eprintln!(
                "{broker} {}: peak {} messages, back {:?} after the kill",
                if restarted { "restarted" } else { "not restarted" },
                o.peak,
                o.back_after_kill
            );
            outcomes.push(o);
        }
    }
    if !lags.is_empty() {
        println!(
            "\nIndex lag, commit → applied ({INDEX}; one writer, one indexer; {} s phases)\n",
            opts.lag_secs
        );
        println!("| broker | indexer fetch wait | max single-PUT rate | lag at 50% of it: p50 | p99 | max bucket | events | PUTs failed | commit → fetched: p50 | p99 | bare producer → bare consumer: p50 | p99 |");
        println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for l in &lags {
            println!(
                "| {} | {} ms | {:.0}/s | {:.1} ms | {:.1} ms | ≤ {:.0} ms | {:.0} | {} | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms |",
                l.broker,
                l.fetch_wait_ms,
                l.max_rate,
                l.p50_ms,
                l.p99_ms,
                l.max_ms,
                l.events,
                l.failed,
                l.fetched_p50_ms,
                l.fetched_p99_ms,
                l.bare_p50_ms,
                l.bare_p99_ms
            );
        }
    }
    if !opts.recovery {
        return Ok(());
    }
    println!(
        "\nIndex recovery after `kill -9` of one of two indexers ({INDEX}; {} single PUTs/s; session timeout {} ms)\n",
        opts.rate,
        SESSION_TIMEOUT.as_millis()
    );
    println!("| broker | killed indexer | lag before (max msgs) | peak lag (msgs) | back after the kill | back after the restart | applied again |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    let secs = |d: Option<Duration>| {
        d.map_or("not within 60 s".to_string(), |d| format!("{:.2} s", d.as_secs_f64()))
    };
    for o in &outcomes {
        let killed = if o.restarted { "restarted at once" } else { "not restarted" };
        // A lag that never rose above its level before the kill has nothing to come back from.
        let back = |d: Option<Duration>| {
            if o.peak <= o.level {
                "never above its level".to_string()
            } else {
                secs(d)
            }
        };
        if !o.formed {
            println!(
                "| {} | {killed} | the two indexers did not start applying within 60 s | | | | |",
                o.broker
            );
            continue;
        }
        let again = if o.restarted {
            "after the restart, by it"
        } else {
            "after the kill, every partition by the survivor"
        };
        println!(
            "| {} | {killed} | {} | {} | {} | {} | {} {again} |",
            o.broker,
            o.before_max,
            o.peak,
            back(o.back_after_kill),
            if o.restarted { back(o.back_after_restart) } else { "-".into() },
            secs(o.applied_again),
        );
    }
    Ok(())
}

/// The index lag at half the maximum write rate, on one broker.
#[derive(Debug)]
struct Lag {
    broker: &'static str,
    fetch_wait_ms: u64,
    max_rate: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    events: f64,
    failed: u64,
    /// Commit → fetched by a bare consumer of the change topic (the
    /// relay's and the broker's part of the lag): p50, p99 (ms).
    fetched_p50_ms: f64,
    fetched_p99_ms: f64,
    /// Produce → fetched on the same broker with no bagstore in the way
    /// (the broker's own share): p50, p99 (ms).
    bare_p50_ms: f64,
    bare_p99_ms: f64,
}

/// The max single-PUT rate (16 clients in a closed loop for `phase`), then
/// an open loop at half of it for `phase`, with the indexer's
/// commit→applied histogram read before and after.
async fn lag_at_half(broker: &'static str, phase: Duration, fetch_wait_ms: u64) -> anyhow::Result<Lag> {
    let env = match broker {
        "mock" => TestEnv::new(&format!("lag{broker}"), STANDARD_INDEXES).await,
        _ => TestEnv::with_tansu(&format!("lag{broker}"), STANDARD_INDEXES).await,
    };
    env.migrate().await;
    let writer = env.spawn(&["writer", "--http", "127.0.0.1:0"]).await;
    let indexer = indexer(&env, "indexer-a", fetch_wait_ms).await;
    let http = reqwest::Client::new();
    // Applying: a first write shows up in the histogram.
    let scrape = || async {
        let text = http.get(format!("{}/metrics", indexer.url)).send().await.ok()?.text().await.ok()?;
        Some(hist::buckets(&text, "bagstore_indexer_event_lag_seconds", INDEX))
    };
    let joined = Instant::now();
    let mut i = 1u64 << 40;
    loop {
        i += 1;
        put(&http, &writer.url, i).await;
        if scrape().await.is_some_and(|b| b.last().is_some_and(|x| x.1 > 0.0)) {
            break;
        }
        anyhow::ensure!(
            joined.elapsed() < Duration::from_secs(60),
            "{broker}: the indexer applied nothing within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The max rate: 16 clients, one PUT at a time each.
    let done = Arc::new(AtomicU64::new(0));
    let next = Arc::new(AtomicU64::new(2u64 << 40));
    let started = Instant::now();
    let clients: Vec<_> = (0..16)
        .map(|_| {
            let (done, next, http, base) = (done.clone(), next.clone(), http.clone(), writer.url.clone());
            tokio::spawn(async move {
                while started.elapsed() < phase {
                    if put(&http, &base, next.fetch_add(1, Ordering::Relaxed)).await {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for c in clients {
        let _ = c.await;
    }
    let max_rate = done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
    // Caught up again before the lag phase.
    let k = env.kafka_settings();
    let settle = Instant::now();
    while service::kafka::group_lag(&k, &k.group_for(INDEX))
        .await
        .map_or(true, |p| p.iter().map(|x| x.lag()).sum::<i64>() > 0)
    {
        anyhow::ensure!(settle.elapsed() < Duration::from_secs(120), "{broker}: the index did not catch up");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let before = scrape().await.unwrap_or_default();
    let stop = Arc::new(AtomicBool::new(false));
    let probe = fetch_probe(&env, stop.clone())?;
    let failed = Arc::new(AtomicU64::new(0));
    let load = open_load(&writer.url, max_rate / 2.0, 3u64 << 40, stop.clone(), failed.clone());
    tokio::time::sleep(phase).await;
    stop.store(true, Ordering::Relaxed);
    for l in load {
        let _ = l.await;
    }
    let mut fetched = probe.await?;
    fetched.sort_by(f64::total_cmp);
    let at = |q: f64| {
        fetched.get(((fetched.len() as f64 * q) as usize).min(fetched.len().saturating_sub(1))).copied()
    };
    let settle = Instant::now();
    while service::kafka::group_lag(&k, &k.group_for(INDEX))
        .await
        .map_or(true, |p| p.iter().map(|x| x.lag()).sum::<i64>() > 0)
    {
        anyhow::ensure!(settle.elapsed() < Duration::from_secs(120), "{broker}: the index did not catch up");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let after = scrape().await.unwrap_or_default();
    let mut bare = broker_floor(&env, max_rate / 2.0, phase, fetch_wait_ms).await?;
    anyhow::ensure!(!bare.is_empty(), "{broker}: the bare consumer fetched nothing");
    bare.sort_by(f64::total_cmp);
    let bare_at = |q: f64| bare[((bare.len() as f64 * q) as usize).min(bare.len() - 1)];
    Ok(Lag {
        fetch_wait_ms,
        broker,
        max_rate,
        p50_ms: hist::quantile(&before, &after, 0.5),
        p99_ms: hist::quantile(&before, &after, 0.99),
        max_ms: hist::max_bucket(&before, &after),
        events: after.last().map_or(0.0, |x| x.1) - before.last().map_or(0.0, |x| x.1),
        failed: failed.load(Ordering::Relaxed),
        fetched_p50_ms: at(0.5).unwrap_or(0.0),
        fetched_p99_ms: at(0.99).unwrap_or(0.0),
        bare_p50_ms: bare_at(0.5),
        bare_p99_ms: bare_at(0.99),
    })
}

/// The broker alone: a producer with the relay's settings sends messages
/// stamped with the time they were handed to it, at `rate` for `phase`, to
/// a topic of their own; a consumer with the indexers' fetch settings notes
/// each one's produce → fetched time (ms). What target 3 leaves to
/// bagstore on this broker is the lag beyond this.
async fn broker_floor(
    env: &TestEnv,
    rate: f64,
    phase: Duration,
    fetch_wait_ms: u64,
) -> anyhow::Result<Vec<f64>> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    use rdkafka::Message;
    const TOPIC: &str = "bench-broker-floor";
    let k = env.kafka_settings();
    match &env.kafka {
        // The mock cluster has no admin API to create topics with.
        bagstore_tests::Kafka::Mock(c) => c.create_topic(TOPIC, k.partitions, 1)?,
        bagstore_tests::Kafka::Tansu(_) => service::kafka::ensure_topics(&k, &[TOPIC]).await?,
    }
    let consumer: BaseConsumer =
        service::kafka::create(&service::kafka::consumer_config(&k, "bench-broker-floor", fetch_wait_ms))?;
    let md = consumer.fetch_metadata(Some(TOPIC), Duration::from_secs(10))?;
    let mut tpl = rdkafka::TopicPartitionList::new();
    for t in md.topics() {
        for p in t.partitions() {
            tpl.add_partition_offset(TOPIC, p.id(), rdkafka::Offset::End)?;
        }
    }
    consumer.assign(&tpl)?;
    let stop = Arc::new(AtomicBool::new(false));
    let fetched = {
        let stop = stop.clone();
        tokio::task::spawn_blocking(move || {
            let mut out = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
                    let now = schemas::clock::now_micros();
                    if let Some(sent) = m.payload().and_then(|b| <[u8; 8]>::try_from(b).ok()) {
                        out.push((now - i64::from_le_bytes(sent)).max(0) as f64 / 1e3);
                    }
                }
            }
            out
        })
    };
    // The consumer holds its partitions at their end before the first send.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let producer: BaseProducer = service::kafka::create(&service::kafka::relay_producer_config(&k))?;
    let sent = tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        let mut n = 0u64;
        while started.elapsed() < phase {
            let due = (started.elapsed().as_secs_f64() * rate) as u64;
            while n < due {
                let stamp = schemas::clock::now_micros().to_le_bytes();
                let key = n.to_le_bytes();
                if producer.send(BaseRecord::to(TOPIC).key(&key[..]).payload(&stamp[..])).is_ok() {
                    n += 1;
                } else {
                    break;
                }
            }
            producer.poll(Duration::from_millis(1));
        }
        let _ = producer.flush(Duration::from_secs(10));
        n
    })
    .await?;
    // Everything sent has had time to be fetched.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    let out = fetched.await?;
    eprintln!("broker floor: {sent} sent, {} fetched", out.len());
    Ok(out)
}

/// A consumer of the change topic from its end, with the indexers' fetch
/// settings, that notes each event's commit → fetched time (ms) until
/// `stop`.
fn fetch_probe(env: &TestEnv, stop: Arc<AtomicBool>) -> anyhow::Result<tokio::task::JoinHandle<Vec<f64>>> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::Message;
    let k = env.kafka_settings();
    let consumer: BaseConsumer = service::kafka::create(&service::kafka::consumer_config(
        &k,
        "bench-fetch-probe",
        schemas::settings::FETCH_WAIT_MS,
    ))?;
    let md = consumer.fetch_metadata(Some(&k.topic), Duration::from_secs(10))?;
    let mut tpl = rdkafka::TopicPartitionList::new();
    for t in md.topics() {
        for p in t.partitions() {
            tpl.add_partition_offset(&k.topic, p.id(), rdkafka::Offset::End)?;
        }
    }
    consumer.assign(&tpl)?;
    Ok(tokio::task::spawn_blocking(move || {
        let mut out = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
                let now = schemas::clock::now_micros();
                if let Some(e) = m.payload().and_then(|b| schemas::event::ChangeEvent::decode(b).ok()) {
                    out.push((now - e.committed_at_us).max(0) as f64 / 1e3);
                }
            }
        }
        out
    }))
}

/// Single PUTs at `rate` (ids from `first` on, each a new user id) until
/// `stop`, from eight clients that take turns at the ticks (a slow answer
/// delays, never piles up connections); failures are counted.
fn open_load(
    base: &str,
    rate: f64,
    first: u64,
    stop: Arc<AtomicBool>,
    failed: Arc<AtomicU64>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let ticks = Arc::new(tokio::sync::Mutex::new({
        let mut t = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    }));
    let next = Arc::new(AtomicU64::new(first));
    let http = reqwest::Client::new();
    (0..8)
        .map(|_| {
            let (stop, failed, ticks, next, http) =
                (stop.clone(), failed.clone(), ticks.clone(), next.clone(), http.clone());
            let base = base.to_string();
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    ticks.lock().await.tick().await;
                    if !put(&http, &base, next.fetch_add(1, Ordering::Relaxed)).await {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect()
}

/// One PUT of entity `i`; whether it was stored.
async fn put(http: &reqwest::Client, base: &str, i: u64) -> bool {
    let id = format!("{:032x}", 0x7ec0_0000_0000u64 + i);
    let body = json!({"user_id": format!("{i:032x}"), "n": i});
    http.put(format!("{base}/v1/entities/{id}"))
        .json(&body)
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
}

/// An indexer of [`INDEX`], the member `name`, fetching with a wait of
/// `fetch_wait_ms`.
async fn indexer(env: &TestEnv, name: &str, fetch_wait_ms: u64) -> Proc {
    let fetch_wait = fetch_wait_ms.to_string();
    let vars = [
        ("BAGSTORE_KAFKA__SESSION_TIMEOUT_MS", "6000"),
        ("BAGSTORE_INDEXER__FETCH_WAIT_MS", fetch_wait.as_str()),
        ("BAGSTORE_INDEXER__MEMBER", name),
    ];
    env.spawn_env(&["indexer", "--index", INDEX, "--http", "127.0.0.1:0"], &vars).await
}

async fn group_lag(env: &TestEnv) -> Option<i64> {
    let k = env.kafka_settings();
    let parts = service::kafka::group_lag(&k, &k.group_for(INDEX)).await.ok()?;
    Some(parts.iter().map(|p| p.lag()).sum())
}

async fn measure(
    broker: &'static str,
    restarted: bool,
    rate: f64,
    fetch_wait_ms: u64,
) -> anyhow::Result<Outcome> {
    let name = format!("recovery{}{}", &broker[..1], u8::from(restarted));
    let env = match broker {
        "mock" => TestEnv::new(&name, STANDARD_INDEXES).await,
        _ => TestEnv::with_tansu(&name, STANDARD_INDEXES).await,
    };
    env.migrate().await;
    let writer = env.spawn(&["writer", "--http", "127.0.0.1:0"]).await;
    let doomed = indexer(&env, "indexer-a", fetch_wait_ms).await;
    let survivor = indexer(&env, "indexer-b", fetch_wait_ms).await;

    let stop = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(AtomicU64::new(0));
    let load = open_load(&writer.url, rate, 0, stop.clone(), failed.clone());

    let forming = Instant::now();
    loop {
        if group_lag(&env).await.is_some_and(|l| l < (rate as i64).max(20)) {
            break;
        }
        if forming.elapsed() > Duration::from_secs(60) {
            stop.store(true, Ordering::Relaxed);
            return Ok(Outcome {
                broker,
                restarted,
                formed: false,
                before_max: 0,
                peak: 0,
                level: 0,
                back_after_kill: None,
                back_after_restart: None,
                applied_again: None,
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
    // Back: at most the level before plus one sample's writes (a tenth of
    // a second): the lag read from the broker is a sawtooth of the 500 ms
    // offset commits, and one indexer doing both shares peaks a little
    // higher than two did.
    let level = before_max + (rate / 10.0) as i64;

    // BENCH_RECOVERY_TRACE=1: every lag sample after the kill, on stderr.
    let trace = std::env::var_os("BENCH_RECOVERY_TRACE").is_some();
    let survivor_at_kill = counts(&survivor).await;
    let killed_at = Instant::now();
    doomed.kill9().await;
    let mut restarted_at = None;
    let mut again = None;
    if restarted {
        restarted_at = Some(Instant::now());
        again = Some(indexer(&env, "indexer-a", fetch_wait_ms).await);
    }
    let mut peak = 0;
    let mut calm_since: Option<Instant> = None;
    let mut back_at = None;
    let mut applied_again = None;
    while killed_at.elapsed() < Duration::from_secs(60) {
        let sampled = Instant::now();
        if applied_again.is_none() {
            let done = match &again {
                Some(p) => applied(&Counts::new(), &counts(p).await) > 0,
                None => applied(&survivor_at_kill, &counts(&survivor).await) == PARTITIONS as usize,
            };
            if done {
                applied_again = Some(sampled.duration_since(restarted_at.unwrap_or(killed_at)));
            }
        }
        if back_at.is_some() {
            if applied_again.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        if let Some(l) = group_lag(&env).await {
            if trace {
                eprintln!("{:.1} s after the kill: lag {l}", sampled.duration_since(killed_at).as_secs_f64());
            }
            peak = peak.max(l);
            if l <= level {
                let since = *calm_since.get_or_insert(sampled);
                // Only after a rise: the first samples may predate the kill's effect.
                if peak > level && sampled.duration_since(since) >= STAYS {
                    back_at = Some(since);
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
        restarted,
        formed: true,
        before_max,
        peak,
        level,
        back_after_kill: back_at.map(|t| t.duration_since(killed_at)),
        back_after_restart: back_at.zip(restarted_at).map(|(t, r)| t.saturating_duration_since(r)),
        applied_again,
    })
}

/// How many partitions of [`INDEX`] had events applied from `before` to `after`.
fn applied(before: &Counts, after: &Counts) -> usize {
    after
        .iter()
        .filter(|((_, stage), n)| stage == "applied" && **n > 0.0)
        .filter(|(k, n)| before.get(*k).is_none_or(|b| *n > b))
        .count()
}
