//! Benchmark of the online backfill of a new index (issue 3): the backfill
//! rate (rows/s) over N entities on 2 shards while a writer runs at a steady
//! rate, and that writer's latency with and without the backfill running.
//!
//! ```sh
//! cargo build -p bagstore -p bagstore-tests --bins
//! target/debug/bench_backfill [--quick] [--entities N] [--phase-secs S] [--write-rate R] [--backfill-rate R]
//! ```
//!
//! It runs on the same local stack as the end-to-end suites (two private
//! `mariadbd`, a mock Kafka inside this process, the real `bagstore`
//! binary as separate processes):
//!
//! 1. migrate with `index_user_id` only; start a writer, an indexer and a reader;
//! 2. load N entities through `POST /v1/entities/batch` (1000 per request, 4 in flight);
//! 3. baseline: a steady writer (`PUT /v1/entities/{new id}` at a fixed rate) for a phase;
//! 4. add `index_link`, migrate (CREATING), start its indexer, then run
//!    `bagstore cleaner --index index_link` while the same steady writer runs;
//! 5. print a table (also written as JSON to `target/bench-backfill.json`);
//! 6. check that `index_link` holds exactly one row per entity; exit 1 if not.

#[path = "../burn.rs"]
mod burn;
#[path = "../sibling.rs"]
mod sibling;

use anyhow::{bail, Context};
use bagstore_tests::{bagstore_bin, eventually, Api, Proc, TestEnv};
use burn::burn;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::process::{ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::MissedTickBehavior;
use uuid::Uuid;

const INDEX_USER_ID: &str = r#"
[[indexes]]
table = "index_user_id"
properties = [{ name = "user_id", type = "uuid" }]
shard_on = "user_id"
"#;

const INDEX_LINK: &str = r#"
[[indexes]]
table = "index_link"
properties = [{ name = "link", type = "string", max_len = 735 }]
shard_on = "link"
"#;

const LOAD_BATCH: usize = 1000;
const LOAD_IN_FLIGHT: usize = 4;
/// Tries per batch item (503 answers are retried).
const LOAD_ATTEMPTS: usize = 20;
/// The services log at the production level, whatever the harness's
/// test-time default is, so that logging does not skew the figures.
const SERVICE_ENV: &[(&str, &str)] = &[("RUST_LOG", "info")];
/// How long the indexers may take to work through the topic.
const CATCH_UP_DEADLINE: Duration = Duration::from_secs(900);

const USAGE: &str = "usage: bench_backfill [--quick] [--entities N] [--phase-secs S] [--write-rate R] \
                     [--backfill-rate R] [--follow-health]\n\
  --quick            smoke run: 5000 entities, 3 s phases\n\
  --entities N       entities loaded before the backfill (default 200000)\n\
  --phase-secs S     length of the baseline phase in seconds (default 15)\n\
  --write-rate R     steady writer, requests per second (default 200)\n\
  --backfill-rate R  cleaner --rate, rows per second; 0 is unlimited (default 0)\n\
  --follow-health    cleaner --follow-health: the pace follows the shards' health (under --backfill-rate if set)";

#[derive(Debug, Clone)]
struct Options {
    entities: usize,
    phase: Duration,
    write_rate: u32,
    backfill_rate: u64,
    follow_health: bool,
    quick: bool,
}

fn parse_args(args: &[String]) -> Result<Options, String> {
    fn value<T: std::str::FromStr>(flag: &str, v: Option<&String>) -> Result<T, String> {
        let v = v.ok_or_else(|| format!("{flag} needs a value"))?;
        v.parse().map_err(|_| format!("{flag}: cannot parse {v:?}"))
    }
    let (mut entities, mut phase_secs, mut write_rate, mut backfill_rate) = (None, None, None, None);
    let (mut quick, mut follow_health) = (false, false);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" => quick = true,
            "--follow-health" => follow_health = true,
            "--entities" => entities = Some(value::<usize>(a, it.next())?),
            "--phase-secs" => phase_secs = Some(value::<f64>(a, it.next())?),
            "--write-rate" => write_rate = Some(value::<u32>(a, it.next())?),
            "--backfill-rate" => backfill_rate = Some(value::<u64>(a, it.next())?),
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let phase_secs = phase_secs.unwrap_or(if quick { 3.0 } else { 15.0 });
    let write_rate = write_rate.unwrap_or(200);
    if !(phase_secs > 0.0 && phase_secs.is_finite()) {
        return Err("--phase-secs must be positive".into());
    }
    if write_rate == 0 {
        return Err("--write-rate must be positive".into());
    }
    Ok(Options {
        entities: entities.unwrap_or(if quick { 5000 } else { 200_000 }),
        phase: Duration::from_secs_f64(phase_secs),
        write_rate,
        backfill_rate: backfill_rate.unwrap_or(0),
        follow_health,
        quick,
    })
}

/// Where the JSON goes: `target/bench-backfill.json`, next to the profile directory.
fn json_path() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    match exe.parent().and_then(|p| p.parent()) {
        Some(target) => target.join("bench-backfill.json"),
        None => PathBuf::from("target/bench-backfill.json"),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = match parse_args(&args) {
        Ok(o) => o,
        Err(msg) => {
            if msg.is_empty() {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            eprintln!("bench_backfill: {msg}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    // Before the runtime starts any thread.
    if let Err(msg) = sibling::locate_bagstore() {
        eprintln!("bench_backfill: {msg}");
        return ExitCode::FAILURE;
    }
    bench(opts)
}

#[tokio::main]
async fn bench(opts: Options) -> ExitCode {
    match run(opts).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("bench_backfill: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn hex_id() -> String {
    Uuid::new_v4().simple().to_string()
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

// ---------------------------------------------------------------- load

fn loaded_entity(i: usize) -> Value {
    json!({
        "id": hex_id(),
        "user_id": hex_id(),
        "link": format!("http://friendfeed.com/e/{i}"),
        "title": format!("Entry number {i} from the bulk load"),
    })
}

/// Sends one batch; items answered 503 (the writer gave up on a deadlocked
/// shard transaction; these unconditional puts may simply be sent again)
/// are sent again after a backoff.
/// Returns the number of retried items.
async fn load_batch(api: Api, items: Vec<Value>) -> anyhow::Result<u64> {
    let mut pending = items;
    let mut retried = 0u64;
    for attempt in 0..LOAD_ATTEMPTS {
        let (status, body) = api.batch(&pending).await;
        if status != 200 {
            bail!("batch answered {status}: {body}");
        }
        let results = body["results"].as_array().context("batch answer without results")?;
        if results.len() != pending.len() {
            bail!("batch of {} answered {} results", pending.len(), results.len());
        }
        let mut again = Vec::new();
        for (item, r) in pending.iter().zip(results) {
            if r["version"].is_u64() {
                continue;
            }
            if r["status"] != 503 || attempt + 1 == LOAD_ATTEMPTS {
                bail!("a batch item was not stored: {r}");
            }
            again.push(item.clone());
        }
        if again.is_empty() {
            return Ok(retried);
        }
        retried += again.len() as u64;
        pending = again;
        let jitter = rand::random::<u64>() % 100;
        tokio::time::sleep(Duration::from_millis(50 * (attempt as u64 + 1) + jitter)).await;
    }
    unreachable!("the last attempt returns or fails")
}

/// Loads `n` entities, `LOAD_BATCH` per request, `LOAD_IN_FLIGHT` requests
/// at a time; returns how many items had to be retried.
async fn load(api: &Api, n: usize) -> anyhow::Result<u64> {
    let mut tasks: JoinSet<anyhow::Result<(usize, u64)>> = JoinSet::new();
    let (mut next, mut done, mut retried) = (0usize, 0usize, 0u64);
    let started = Instant::now();
    let mut shown = Instant::now();
    while next < n || !tasks.is_empty() {
        while next < n && tasks.len() < LOAD_IN_FLIGHT {
            let end = (next + LOAD_BATCH).min(n);
            let items: Vec<Value> = (next..end).map(loaded_entity).collect();
            let api = api.clone();
            tasks.spawn(async move {
                let len = items.len();
                Ok((len, load_batch(api, items).await?))
            });
            next = end;
        }
        if let Some(joined) = tasks.join_next().await {
            let (len, r) = joined.context("batch task")??;
            done += len;
            retried += r;
        }
        if shown.elapsed() >= Duration::from_secs(5) {
            shown = Instant::now();
            let t = secs(started.elapsed());
            println!(
                "  loaded {done}/{n} in {t:.0} s ({:.0} entities/s; {retried} items retried after 503)",
                done as f64 / t
            );
        }
    }
    Ok(retried)
}

// ------------------------------------------------------- steady writer

/// What the steady writer did during one phase.
#[derive(Debug, Default)]
struct WriterRun {
    /// Requests sent (one per tick; ticks the runtime could not honour are skipped).
    sent: u64,
    /// 201: a new entity (each has a link, so each must end up in index_link).
    created: u64,
    /// Any other success (not expected: every id is new).
    other_ok: u64,
    errors: u64,
    first_error: Option<String>,
    latencies_ms: Vec<f64>,
    elapsed: Duration,
}

impl WriterRun {
    fn record(&mut self, joined: Result<(Duration, u16), tokio::task::JoinError>) {
        match joined {
            Ok((latency, status)) => {
                self.latencies_ms.push(latency.as_secs_f64() * 1000.0);
                match status {
                    201 => self.created += 1,
                    200 => self.other_ok += 1,
                    s => {
                        self.errors += 1;
                        self.first_error.get_or_insert_with(|| format!("HTTP {s}"));
                    }
                }
            }
            Err(e) => {
                self.errors += 1;
                self.first_error.get_or_insert_with(|| format!("request task failed: {e}"));
            }
        }
    }
}

async fn one_put(api: Api) -> (Duration, u16) {
    let id = hex_id();
    let body = json!({
        "user_id": hex_id(),
        "link": format!("http://friendfeed.com/w/{id}"),
        "title": "Posted by the steady writer",
    });
    let t = Instant::now();
    let (status, _) = api.put(&id, &body).await;
    (t.elapsed(), status)
}

/// Sends one `PUT` of a new entity per tick (open loop: a slow answer does
/// not delay the next request) until `stop` turns true, then waits for the
/// requests in flight.
async fn steady_writer(api: Api, rate: u32, mut stop: watch::Receiver<bool>) -> WriterRun {
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(rate)));
    tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let mut tasks = JoinSet::new();
    let mut run = WriterRun::default();
    let started = Instant::now();
    loop {
        tokio::select! {
            biased;
            _ = stop.changed() => break,
            _ = tick.tick() => {
                tasks.spawn(one_put(api.clone()));
                run.sent += 1;
            }
        }
        while let Some(joined) = tasks.try_join_next() {
            run.record(joined);
        }
    }
    run.elapsed = started.elapsed();
    while let Some(joined) = tasks.join_next().await {
        run.record(joined);
    }
    run
}

#[derive(Debug, Clone, Copy)]
struct Latency {
    n: usize,
    p50: f64,
    p99: f64,
    max: f64,
    mean: f64,
}

/// Nearest-rank percentiles, in milliseconds.
fn latency(samples: &[f64]) -> Latency {
    let mut v = samples.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let pct = |p: f64| {
        if n == 0 {
            f64::NAN
        } else {
            let rank = ((p * n as f64).ceil() as usize).clamp(1, n);
            v[rank - 1]
        }
    };
    let mean = if n == 0 { f64::NAN } else { v.iter().sum::<f64>() / n as f64 };
    Latency { n, p50: pct(0.50), p99: pct(0.99), max: v.last().copied().unwrap_or(f64::NAN), mean }
}

// --------------------------------------------------- CPU accounting

/// `/proc/<pid>/stat`: (ppid, comm, utime + stime in clock ticks).
fn proc_stat(pid: u32) -> Option<(u32, String, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (open, close) = (s.find('(')?, s.rfind(')')?);
    let comm = s[open + 1..close].to_string();
    // After "comm)": state (field 3), ppid (4), …, utime (14), stime (15).
    let rest: Vec<&str> = s[close + 1..].split_whitespace().collect();
    let ppid = rest.get(1)?.parse().ok()?;
    let ticks = rest.get(11)?.parse::<u64>().ok()? + rest.get(12)?.parse::<u64>().ok()?;
    Some((ppid, comm, ticks))
}

fn proc_label(pid: u32, me: u32, comm: &str) -> String {
    if pid == me {
        return "bench client + mock Kafka".into();
    }
    if comm.starts_with("mariadbd") {
        return "mariadbd (both shards)".into();
    }
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let argv: Vec<String> = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let is_bagstore = argv.first().is_some_and(|a| a.ends_with("/bagstore") || a == "bagstore");
    match (is_bagstore, argv.get(1).map(String::as_str)) {
        (true, Some("indexer")) => match argv.iter().position(|a| a == "--index") {
            Some(i) => format!("bagstore indexer ({})", argv.get(i + 1).map_or("?", String::as_str)),
            None => "bagstore indexer (index_user_id)".into(),
        },
        (true, Some(cmd)) => format!("bagstore {cmd}"),
        _ => comm.to_string(),
    }
}

/// CPU time of this process and all its descendants (the `bagstore`
/// processes, the `mariadbd` servers), per process, sampled periodically so
/// a process that exits during the phase (the cleaner) is still counted.
#[derive(Debug, Default)]
struct CpuSampler {
    me: u32,
    /// pid → (label, ticks at the first sample or 0 if born later, latest ticks).
    procs: HashMap<u32, (String, u64, u64)>,
    samples: usize,
    machine_start: Option<(u64, u64)>,
    machine_end: Option<(u64, u64)>,
    loadavg_end: String,
}

/// `/proc/stat` first line: (busy, total) jiffies of the whole machine.
fn machine_jiffies() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/stat").ok()?;
    let f: Vec<u64> = s.lines().next()?.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
    let total: u64 = f.iter().take(8).sum();
    let idle = f.get(3)? + f.get(4)?;
    Some((total - idle, total))
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

impl CpuSampler {
    fn sample(&mut self) {
        let mut parent: HashMap<u32, u32> = HashMap::new();
        let mut stat: HashMap<u32, (String, u64)> = HashMap::new();
        if let Ok(dir) = std::fs::read_dir("/proc") {
            for entry in dir.flatten() {
                let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                    continue;
                };
                if let Some((ppid, comm, ticks)) = proc_stat(pid) {
                    parent.insert(pid, ppid);
                    stat.insert(pid, (comm, ticks));
                }
            }
        }
        let first = self.samples == 0;
        for (pid, (comm, ticks)) in &stat {
            // A descendant of this process?
            let (mut p, mut ours) = (*pid, false);
            for _ in 0..64 {
                if p == self.me {
                    ours = true;
                    break;
                }
                match parent.get(&p) {
                    Some(&pp) if pp != 0 => p = pp,
                    _ => break,
                }
            }
            if !ours {
                continue;
            }
            let entry = self
                .procs
                .entry(*pid)
                .or_insert_with(|| (proc_label(*pid, self.me, comm), if first { *ticks } else { 0 }, *ticks));
            entry.2 = entry.2.max(*ticks);
        }
        self.samples += 1;
    }

    /// Samples every 200 ms until `stop` turns true.
    async fn run(mut stop: watch::Receiver<bool>) -> CpuSampler {
        let mut s =
            CpuSampler { me: std::process::id(), machine_start: machine_jiffies(), ..Default::default() };
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                biased;
                _ = stop.changed() => break,
                _ = tick.tick() => s.sample(),
            }
        }
        s.sample();
        s.machine_end = machine_jiffies();
        s.loadavg_end = loadavg();
        s
    }

    /// CPU seconds per label during the phase (clock ticks are 1/100 s on Linux).
    fn per_label(&self) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for (label, first, last) in self.procs.values() {
            *out.entry(label.clone()).or_insert(0.0) += (last - first) as f64 / 100.0;
        }
        out.retain(|_, v| *v > 0.0);
        out
    }

    /// Cores the whole machine kept busy on average (ours and anyone else's).
    fn machine_cores_busy(&self, cores: usize) -> f64 {
        match (self.machine_start, self.machine_end) {
            (Some((b0, t0)), Some((b1, t1))) if t1 > t0 => (b1 - b0) as f64 / (t1 - t0) as f64 * cores as f64,
            _ => f64::NAN,
        }
    }
}

// ------------------------------------------------------------ backfill

#[derive(Debug, Default)]
struct BackfillRun {
    done_line: String,
    scanned: u64,
    rows_done: u64,
    rows_total: u64,
    reported_secs: f64,
    reported_rate: f64,
    wall: Duration,
}

/// The numbers of `backfill T done: ACTIVE; scanned X rows in this run (Y of Z) in S s, R rows/s`.
fn parse_done_line(line: &str) -> Option<(u64, u64, u64, f64, f64)> {
    let (_, tail) = line.split_once(" done: ")?;
    if !tail.starts_with("ACTIVE") {
        return None;
    }
    let numbers: Vec<&str> = tail
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter(|t| !t.is_empty() && t.chars().any(|c| c.is_ascii_digit()))
        .collect();
    if numbers.len() != 5 {
        return None;
    }
    Some((
        numbers[0].parse().ok()?,
        numbers[1].parse().ok()?,
        numbers[2].parse().ok()?,
        numbers[3].parse().ok()?,
        numbers[4].parse().ok()?,
    ))
}

/// `bagstore cleaner --index index_link --rate R`, echoing its progress lines.
async fn run_backfill(env: &TestEnv, rate: u64, follow_health: bool) -> anyhow::Result<BackfillRun> {
    let log = env.dir.path().join("cleaner-backfill.log");
    let rate = rate.to_string();
    let mut args = vec!["cleaner", "--index", "index_link", "--rate", &rate];
    if follow_health {
        args.push("--follow-health");
    }
    let started = Instant::now();
    let mut child = bagstore_tests::command(bagstore_bin())
        .args(env.args(&args))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log)?)
        .envs(SERVICE_ENV.iter().copied())
        .kill_on_drop(true)
        .spawn()
        .context("spawn bagstore cleaner")?;
    let mut lines = BufReader::new(child.stdout.take().context("piped stdout")?).lines();
    let mut done_line = None;
    while let Some(line) = lines.next_line().await? {
        println!("  | {line}");
        if line.starts_with("backfill index_link done: ") {
            done_line = Some(line);
        }
    }
    let status = child.wait().await?;
    let wall = started.elapsed();
    if !status.success() {
        let tail = std::fs::read_to_string(&log).unwrap_or_default();
        bail!("bagstore cleaner exited with {status}; its log:\n{tail}");
    }
    let done_line = done_line.context("the cleaner did not print its `done` line")?;
    let (scanned, rows_done, rows_total, reported_secs, reported_rate) =
        parse_done_line(&done_line).with_context(|| format!("cannot parse {done_line:?}"))?;
    Ok(BackfillRun { done_line, scanned, rows_done, rows_total, reported_secs, reported_rate, wall })
}

// ------------------------------------------------------- verification

async fn total_lag(env: &TestEnv, table: &str) -> Option<i64> {
    let k = env.kafka_settings();
    let lag = service::kafka::group_lag(&k, &k.group_for(table)).await.ok()?;
    Some(lag.iter().map(|p| p.lag()).sum())
}

/// Like `TestEnv::until_caught_up`, with a deadline long enough for a
/// debug build to work through hundreds of thousands of events.
async fn wait_caught_up(env: &TestEnv, tables: &[&str]) {
    eventually("outbox empty and the index groups caught up", CATCH_UP_DEADLINE, || async {
        if env.count_rows("outbox").await != 0 {
            return None;
        }
        for t in tables {
            if total_lag(env, t).await? != 0 {
                return None;
            }
        }
        Some(())
    })
    .await
}

async fn index_state(api: &Api, table: &str) -> Option<String> {
    let (status, body) = api.indexes().await;
    if status != 200 {
        return None;
    }
    body["indexes"]
        .as_array()?
        .iter()
        .find(|i| i["table"] == table)
        .and_then(|i| i["state"].as_str().map(str::to_string))
}

// --------------------------------------------------------------- report

/// `git describe --always --dirty` of the workspace this binary was built
/// in, as it is now (the binaries may be older than that).
fn workspace_now() -> String {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    bagstore_tests::std_command("git")
        .args(["-C", root, "describe", "--always", "--dirty"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "?".into())
}

fn machine() -> (usize, String) {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let mem = bagstore_tests::std_command("free")
        .arg("-g")
        .output()
        .ok()
        .and_then(|o| {
            let text = String::from_utf8_lossy(&o.stdout).into_owned();
            let line = text.lines().find(|l| l.starts_with("Mem:"))?.to_string();
            line.split_whitespace().nth(1).map(|t| format!("{t} GiB"))
        })
        .unwrap_or_else(|| "?".into());
    (cores, mem)
}

fn ms(v: f64) -> String {
    if v.is_nan() {
        "–".into()
    } else {
        format!("{v:.1}")
    }
}

fn latency_json(l: &Latency) -> Value {
    json!({"requests": l.n, "p50_ms": l.p50, "p99_ms": l.p99, "max_ms": l.max, "mean_ms": l.mean})
}

fn writer_json(w: &WriterRun, l: &Latency) -> Value {
    json!({
        "sent": w.sent,
        "created": w.created,
        "other_ok": w.other_ok,
        "errors": w.errors,
        "first_error": w.first_error,
        "seconds": secs(w.elapsed),
        "achieved_rate": w.sent as f64 / secs(w.elapsed),
        "latency": latency_json(l),
    })
}

fn cpu_json(c: &CpuSampler, cores: usize) -> Value {
    json!({
        "cpu_seconds": c.per_label(),
        "machine_cores_busy": c.machine_cores_busy(cores),
        "loadavg_at_end": c.loadavg_end,
    })
}

// ------------------------------------------------------------------ run

async fn run(opts: Options) -> anyhow::Result<bool> {
    let (cores, mem) = machine();
    let n = opts.entities;
    println!(
        "bench_backfill: {n} entities on 2 shards; steady writer {} req/s; baseline {:.0} s; backfill --rate {}{}{}",
        opts.write_rate,
        secs(opts.phase),
        opts.backfill_rate,
        if opts.follow_health { " --follow-health" } else { "" },
        if opts.quick { " (--quick)" } else { "" }
    );
    println!("machine: {cores} CPUs, {mem} memory; load average {}", loadavg());
    println!("bagstore binary: {}; workspace now at {}", bagstore_bin().display(), workspace_now());

    // 1. The stack, with index_user_id only.
    let mut env = TestEnv::new("bench", INDEX_USER_ID).await;
    env.migrate().await;
    let writer = env.spawn_env(&["writer"], SERVICE_ENV).await;
    let indexer = env.spawn_env(&["indexer"], SERVICE_ENV).await;
    let reader = env.spawn_env(&["reader"], SERVICE_ENV).await;
    let api = writer.api();
    let rapi = reader.api();
    println!(
        "stack ready: writer {}, reader {}; logs in {}",
        writer.url,
        reader.url,
        env.dir.path().display()
    );

    let outcome = measure(&opts, &mut env, &api, &rapi, cores, &mem).await;
    if !matches!(outcome, Ok(true)) {
        env.dir.disable_cleanup(true);
        eprintln!("process logs kept in {}", env.dir.path().display());
    }
    let procs: Vec<Proc> = vec![writer, indexer, reader];
    for p in procs {
        p.terminate().await;
    }
    outcome
}

async fn measure(
    opts: &Options,
    env: &mut TestEnv,
    api: &Api,
    rapi: &Api,
    cores: usize,
    mem: &str,
) -> anyhow::Result<bool> {
    let n = opts.entities;

    // 2. Load.
    println!("loading {n} entities ({LOAD_BATCH} per batch, {LOAD_IN_FLIGHT} batches in flight)…");
    let t = Instant::now();
    let load_retried = load(api, n).await?;
    let load_time = t.elapsed();
    let load_rate = n as f64 / secs(load_time);
    println!(
        "loaded {n} entities in {:.1} s: {load_rate:.0} entities/s ({load_retried} items retried after 503)",
        secs(load_time)
    );
    let t = Instant::now();
    wait_caught_up(env, &["index_user_id"]).await;
    let user_id_catch_up = t.elapsed();
    println!("index_user_id caught up {:.1} s after the load", secs(user_id_catch_up));

    // 3. Baseline: the steady writer alone.
    println!("baseline: steady writer at {} req/s for {:.0} s…", opts.write_rate, secs(opts.phase));
    let (stop, stopped) = watch::channel(false);
    let cpu = tokio::spawn(CpuSampler::run(stopped.clone()));
    let w = tokio::spawn(steady_writer(api.clone(), opts.write_rate, stopped));
    tokio::time::sleep(opts.phase).await;
    stop.send(true).ok();
    let base = w.await.context("baseline writer")?;
    let base_cpu = cpu.await.context("baseline sampler")?;
    let base_lat = latency(&base.latencies_ms);
    println!(
        "baseline: {} requests, {} errors; p50 {} ms, p99 {} ms, max {} ms",
        base_lat.n,
        base.errors,
        ms(base_lat.p50),
        ms(base_lat.p99),
        ms(base_lat.max)
    );

    // 4. The new index, its indexer, and the backfill under the same writer.
    env.indexes_toml.push_str(INDEX_LINK);
    let out = env.migrate().await;
    if !out.contains("index index_link: CREATING") {
        bail!("migrate did not register index_link as CREATING:\n{out}");
    }
    println!("migrate: index_link is CREATING");
    let link_indexer = env.spawn_env(&["indexer", "--index", "index_link"], SERVICE_ENV).await;
    let lag_at_start = total_lag(env, "index_link").await;
    println!(
        "backfill: cleaner --index index_link --rate {} with the steady writer running…",
        opts.backfill_rate
    );
    let (stop, stopped) = watch::channel(false);
    let cpu = tokio::spawn(CpuSampler::run(stopped.clone()));
    let w = tokio::spawn(steady_writer(api.clone(), opts.write_rate, stopped));
    let backfill = run_backfill(env, opts.backfill_rate, opts.follow_health).await;
    stop.send(true).ok();
    let during = w.await.context("backfill-phase writer")?;
    let during_cpu = cpu.await.context("backfill-phase sampler")?;
    let backfill = backfill?;
    let during_lat = latency(&during.latencies_ms);
    let lag_at_end = total_lag(env, "index_link").await;
    println!(
        "backfill: {} rows in {:.1} s wall; writer {} requests, {} errors; p50 {} ms, p99 {} ms, max {} ms",
        backfill.scanned,
        secs(backfill.wall),
        during_lat.n,
        during.errors,
        ms(during_lat.p50),
        ms(during_lat.p99),
        ms(during_lat.max)
    );

    // 6. Exactness: one index_link row per entity, loaded or written.
    let t = Instant::now();
    let (stop, stopped) = watch::channel(false);
    let cpu = tokio::spawn(CpuSampler::run(stopped));
    wait_caught_up(env, &["index_user_id", "index_link"]).await;
    let link_catch_up = t.elapsed();
    stop.send(true).ok();
    let after_cpu = cpu.await.context("catch-up sampler")?;
    env.until_caught_up(&["index_link"]).await;
    let expected = n as i64 + base.created as i64 + during.created as i64;
    let count = tokio::time::timeout(
        Duration::from_secs(30),
        eventually("index_link to hold one row per entity", Duration::from_secs(60), || async {
            (env.count_rows("index_link").await == expected).then_some(())
        }),
    )
    .await
    .is_ok();
    let rows = env.count_rows("index_link").await;
    let entities = env.count_rows("entities").await;
    let state = eventually("the reader to see index_link", Duration::from_secs(10), || async {
        index_state(rapi, "index_link").await
    })
    .await;
    let exact = count && rows == expected && entities == expected && state == "ACTIVE";
    let writer_errors = base.errors + during.errors + base.other_ok + during.other_ok;
    println!(
        "verify: index_link rows {rows}, entities {entities}, expected {expected} ({n} loaded + {} + {} \
         written); reader says {state}; index_link caught up {:.1} s after the backfill → {}",
        base.created,
        during.created,
        secs(link_catch_up),
        if exact { "OK" } else { "MISMATCH" }
    );
    link_indexer.terminate().await;

    // The control: the same writer beside a load that is not bagstore's,
    // as many cores busy as the backfill added.
    let extra_cores = (during_cpu.machine_cores_busy(cores) - base_cpu.machine_cores_busy(cores)).max(0.0);
    println!(
        "control: steady writer beside a CPU burner of {extra_cores:.2} cores for {:.0} s…",
        secs(opts.phase)
    );
    let burning = Arc::new(AtomicBool::new(false));
    let burners = burn(extra_cores, burning.clone());
    let (stop, stopped) = watch::channel(false);
    let w = tokio::spawn(steady_writer(api.clone(), opts.write_rate, stopped));
    tokio::time::sleep(opts.phase).await;
    stop.send(true).ok();
    let burned = w.await.context("control writer");
    burning.store(true, Ordering::Relaxed);
    for b in burners {
        b.join().ok();
    }
    let burned_lat = latency(&burned?.latencies_ms);

    // 5. The table and the JSON.
    let wall_rate = backfill.scanned as f64 / secs(backfill.wall);
    let ratio = during_lat.p99 / base_lat.p99;
    let base_rate = base.sent as f64 / secs(base.elapsed);
    let during_rate = during.sent as f64 / secs(during.elapsed);
    let date = bagstore_tests::std_command("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let rate_name = match (opts.backfill_rate, opts.follow_health) {
        (0, false) => "unlimited".to_string(),
        (0, true) => "following health".to_string(),
        (r, false) => format!("{r} rows/s"),
        (r, true) => format!("following health, ≤ {r} rows/s"),
    };
    let mut table = String::new();
    let mut row =
        |k: &str, a: String, b: String, c: String| table.push_str(&format!("| {k} | {a} | {b} | {c} |\n"));
    let none = String::new;
    row("", "**baseline**".into(), "**during backfill**".into(), "**index_link catch-up**".into());
    row("---", "---:".into(), "---:".into(), "---:".into());
    row("entities loaded", n.to_string(), none(), none());
    row("load: items retried after a 503 (deadlock)", load_retried.to_string(), none(), none());
    row(
        "load (batch 1000, 4 in flight)",
        format!("{:.1} s, {load_rate:.0} entities/s", secs(load_time)),
        none(),
        none(),
    );
    row(
        "backfill rows (this run / total)",
        none(),
        format!("{} ({} of {})", backfill.scanned, backfill.rows_done, backfill.rows_total),
        none(),
    );
    row(
        "backfill rate, bagstore's line",
        none(),
        format!("{:.0} rows/s ({:.1} s)", backfill.reported_rate, backfill.reported_secs),
        none(),
    );
    row(
        "backfill rate, wall clock (spawn → exit)",
        none(),
        format!("{wall_rate:.0} rows/s ({:.1} s)", secs(backfill.wall)),
        none(),
    );
    row(
        "writer requests (achieved rate)",
        format!("{} ({base_rate:.0}/s)", base.sent),
        format!("{} ({during_rate:.0}/s)", during.sent),
        none(),
    );
    row("writer errors", base.errors.to_string(), during.errors.to_string(), none());
    row("writer p50 (ms)", ms(base_lat.p50), ms(during_lat.p50), none());
    row("writer p99 (ms)", ms(base_lat.p99), ms(during_lat.p99), none());
    row("writer max (ms)", ms(base_lat.max), ms(during_lat.max), none());
    row("writer p99 ratio (during / baseline)", none(), format!("{ratio:.2}×"), none());
    row(
        &format!("control: writer p99 beside a CPU burner of {extra_cores:.2} cores (the backfill's extra)"),
        ms(base_lat.p99),
        ms(burned_lat.p99),
        none(),
    );
    row(
        "writer p99 ratio (during the backfill / beside the burner)",
        none(),
        format!("{:.2}×", during_lat.p99 / burned_lat.p99),
        none(),
    );
    let lag = |l: Option<i64>| l.map_or("?".into(), |l| l.to_string());
    row(
        "index_link group lag, events (start → end of phase)",
        none(),
        format!("{} → {}", lag(lag_at_start), lag(lag_at_end)),
        format!("{} → 0", lag(lag_at_end)),
    );
    row(
        "phase wall time (s)",
        format!("{:.1}", secs(base.elapsed)),
        format!("{:.1}", secs(backfill.wall)),
        format!("{:.1}", secs(link_catch_up)),
    );
    row(
        &format!("machine cores busy (of {cores}), all processes"),
        format!("{:.2}", base_cpu.machine_cores_busy(cores)),
        format!("{:.2}", during_cpu.machine_cores_busy(cores)),
        format!("{:.2}", after_cpu.machine_cores_busy(cores)),
    );
    let base_by = base_cpu.per_label();
    let during_by = during_cpu.per_label();
    let after_by = after_cpu.per_label();
    let labels: std::collections::BTreeSet<&String> =
        base_by.keys().chain(during_by.keys()).chain(after_by.keys()).collect();
    for label in labels {
        let a = base_by.get(label).copied().unwrap_or(0.0);
        let b = during_by.get(label).copied().unwrap_or(0.0);
        let c = after_by.get(label).copied().unwrap_or(0.0);
        if a + b + c >= 0.05 {
            row(&format!("CPU s: {label}"), format!("{a:.1}"), format!("{b:.1}"), format!("{c:.1}"));
        }
    }
    println!();
    println!("bench_backfill results ({date}; {cores} CPUs, {mem}; backfill {rate_name}):");
    print!("{table}");
    println!("verification: {}", if exact { "OK" } else { "FAILED" });

    let report = json!({
        "date": date,
        "workspace_at_run": workspace_now(),
        "bagstore_bin": bagstore_bin().display().to_string(),
        "machine": {"cpus": cores, "memory": mem},
        "options": {
            "entities": n,
            "phase_secs": secs(opts.phase),
            "write_rate": opts.write_rate,
            "backfill_rate": opts.backfill_rate,
            "follow_health": opts.follow_health,
            "quick": opts.quick,
        },
        "load": {"seconds": secs(load_time), "entities_per_sec": load_rate, "items_retried_after_503": load_retried, "index_user_id_catch_up_secs": secs(user_id_catch_up)},
        "backfill": {
            "done_line": backfill.done_line,
            "scanned": backfill.scanned,
            "rows_done": backfill.rows_done,
            "rows_total": backfill.rows_total,
            "reported_secs": backfill.reported_secs,
            "reported_rows_per_sec": backfill.reported_rate,
            "wall_secs": secs(backfill.wall),
            "wall_rows_per_sec": wall_rate,
            "index_link_lag_at_start": lag_at_start,
            "index_link_lag_at_end": lag_at_end,
            "index_link_catch_up_secs": secs(link_catch_up),
        },
        "writer": {
            "baseline": writer_json(&base, &base_lat),
            "during_backfill": writer_json(&during, &during_lat),
            "beside_burner": {"extra_cores": extra_cores, "latency_ms": latency_json(&burned_lat)},
            "p99_ratio": ratio,
        },
        "cpu": {"baseline": cpu_json(&base_cpu, cores), "during_backfill": cpu_json(&during_cpu, cores),
            "index_link_catch_up": cpu_json(&after_cpu, cores)},
        "verify": {
            "index_link_rows": rows,
            "entities": entities,
            "expected": expected,
            "index_link_state": state,
            "ok": exact,
        },
    });
    let path = json_path();
    std::fs::write(&path, serde_json::to_string_pretty(&report)? + "\n")
        .with_context(|| format!("writing {}", path.display()))?;
    println!("JSON: {}", path.display());
    if writer_errors > 0 {
        println!(
            "note: the steady writer saw {writer_errors} failed or unexpected answers (first: {:?})",
            base.first_error.as_ref().or(during.first_error.as_ref())
        );
    }
    Ok(exact)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_done_line_parses() {
        let l = "backfill index_link done: ACTIVE; scanned 2000 rows in this run (2000 of 2000) in 1.5s, 1333 rows/s";
        assert_eq!(parse_done_line(l), Some((2000, 2000, 2000, 1.5, 1333.0)));
        assert_eq!(parse_done_line("backfill index_link: 10/20 rows (50.0%), 5 rows/s"), None);
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=200).map(f64::from).collect();
        let l = latency(&v);
        assert_eq!((l.n, l.p50, l.p99, l.max), (200, 100.0, 198.0, 200.0));
        assert!(latency(&[]).p99.is_nan());
    }

    #[test]
    fn arguments() {
        let a = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
        let o = parse_args(&a("--quick --write-rate 50")).unwrap();
        assert_eq!(
            (o.entities, o.phase, o.write_rate, o.backfill_rate),
            (5000, Duration::from_secs(3), 50, 0)
        );
        let o = parse_args(&a("--entities 10 --quick --backfill-rate 300")).unwrap();
        assert_eq!((o.entities, o.backfill_rate), (10, 300));
        assert!(parse_args(&a("--entities")).is_err());
        assert!(parse_args(&a("--bogus")).is_err());
    }
}
