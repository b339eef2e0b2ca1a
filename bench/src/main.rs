//! `bench`: bagstore side by side with what a user would do otherwise, in
//! one run on the same two private `mariadbd` shards (same settings for
//! every contender, durable commits: `innodb_flush_log_at_trx_commit=1`),
//! with the same data and the same client concurrency.
//!
//! Contenders:
//! - **raw**: `INSERT` of the same encoded bodies into an `entities` table
//!   shaped like bagstore's (single-row transactions, and batches); no
//!   outbox, no Kafka. The physical limit of the write path.
//! - **json**: a table with a JSON column, virtual generated columns for the
//!   indexed properties and a secondary index on them; the same writes and
//!   the same queries. The native alternative.
//! - **bagstore**: the real `bagstore` writer, indexer and reader processes
//!   over HTTP, with librdkafka's mock Kafka in this process.
//!
//! Phases: load the same N entities into json and bagstore; queries
//! ("latest 20 of one user", a compound range, point gets; results are
//! compared between json and bagstore first); adding an index to the N
//! entities (bagstore's online backfill against `ALTER TABLE … ADD INDEX` on
//! a new generated column) while a steady writer measures its latency;
//! write throughput (raw, json, bagstore; single and batch); index lag
//! commit→applied at 50% and 90% of bagstore's maximum single-put rate;
//! moving a third of the entities onto a new shard while the steady writer
//! writes (`moves.rs`).
//!
//! Prints one Markdown table (absolute figures and ratios) and writes the
//! same to `target/bench.json`. `--quick` is the CI smoke run: small N,
//! short phases; it checks results (equal query answers, a complete
//! backfill) but asserts nothing about timings. `--help` lists the flags.

use anyhow::{bail, ensure, Context};
use bagstore_tests::{metric_sum, MariaDb, Proc};
use rdkafka::mocking::MockCluster;
use schemas::settings::{EMBEDDED_FETCH_WAIT_MS, FETCH_WAIT_MS};
use serde_json::{json, Value};
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use sqlx::Row;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use storage::conns::Conns;

mod floor;
mod json_table;
mod moves;

const USAGE: &str =
    "usage: bench [--quick] [--only-move] [--only-writes] [--only-reads] [--only-backfill] [--perf-reader FILE] [--entities N] [--phase-secs S] [--clients C] [--steady-rate R]\n\
  --quick          CI smoke run: 3000 entities, 2 s phases, 4 clients\n\
  --only-move      load bagstore's N entities, then run the move phase alone (for working on the mover)\n\
  --only-writes    load N entities, then run the write phases and MariaDB's cost per entity alone\n\
  --only-reads     load N entities, then run the query and point-get phases alone\n\
  --only-backfill  load N entities, then run the index builds (the backfills, their floor, the ALTER) alone\n\
  --perf-reader FILE  record the reader with `perf` during the point gets into FILE (for scripts/flamegraph)\n\
  --entities N     entities loaded before queries and the index build (default 1000000)\n\
  --phase-secs S   length of each measured phase (default 20)\n\
  --clients C      concurrent clients (connections, requests in flight) for every contender (default 16)\n\
  --steady-rate R  the steady writer during index builds, writes per second (default 200)\n\
  --backfill-rate R  cleaner --rate for bagstore's backfill, rows per second (default 0: unlimited)";

const SHARDS: usize = 2;
const USERS: usize = 1000;
/// Entities per batch write, for every contender.
const BATCH: usize = 100;
/// Events the main index may be behind while the load runs (it pauses
/// beyond): 10,000 per partition of lz4 events, far inside the mock
/// cluster's 5 MiB per partition.
const LOAD_MAX_LAG: i64 = 20_000;
/// Partitions of the change topic. librdkafka's mock broker finds a fetch
/// offset by walking the partition's message sets from the oldest (its
/// source: "FIXME: Maintain an index"), so its cost grows with the square of
/// the partition count at a given write rate; with 8 partitions that walk
/// took 11.6% of the machine in the single-put phase. A real broker looks
/// offsets up in an index. The bench runs one indexer per index, so 2
/// partitions (one per core) cost bagstore nothing else.
const PARTITIONS: i32 = 2;
const INDEX_MAIN: &str = "index_user_published";
const INDEX_NEW: &str = "index_link";
/// Built after `index_link`, by a backfill whose pace follows the shards' health.
const INDEX_PACED: &str = "index_paced";

#[derive(Debug, Clone)]
struct Options {
    quick: bool,
    /// Load bagstore alone, then go straight to the move phase.
    only_move: bool,
    /// After the load, only the write phases (for working on the write path).
    only_writes: bool,
    /// After the load, only the queries and point gets (the read path).
    only_reads: bool,
    /// After the load, only the index builds (for working on the backfill).
    only_backfill: bool,
    /// Where `perf record` writes the reader's profile during the point gets.
    perf_reader: Option<PathBuf>,
    entities: usize,
    phase: Duration,
    clients: usize,
    steady_rate: u32,
    /// `cleaner --rate` for the backfill (0: unlimited).
    backfill_rate: u64,
}

fn parse_args(args: &[String]) -> Result<Options, String> {
    fn value<T: std::str::FromStr>(flag: &str, v: Option<&String>) -> Result<T, String> {
        let v = v.ok_or_else(|| format!("{flag} needs a value"))?;
        v.parse().map_err(|_| format!("{flag}: cannot parse {v:?}"))
    }
    let mut quick = false;
    let mut only_move = false;
    let mut only_writes = false;
    let mut only_reads = false;
    let mut only_backfill = false;
    let mut perf_reader = None;
    let mut backfill_rate = 0;
    let (mut entities, mut phase, mut clients, mut rate) = (None, None, None, None);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" => quick = true,
            "--only-move" => only_move = true,
            "--only-writes" => only_writes = true,
            "--only-reads" => only_reads = true,
            "--only-backfill" => only_backfill = true,
            "--perf-reader" => perf_reader = Some(value::<PathBuf>(a, it.next())?),
            "--entities" => entities = Some(value::<usize>(a, it.next())?),
            "--phase-secs" => phase = Some(value::<f64>(a, it.next())?),
            "--clients" => clients = Some(value::<usize>(a, it.next())?),
            "--steady-rate" => rate = Some(value::<u32>(a, it.next())?),
            "--backfill-rate" => backfill_rate = value::<u64>(a, it.next())?,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let o = Options {
        quick,
        only_move,
        only_writes,
        only_reads,
        only_backfill,
        perf_reader,
        entities: entities.unwrap_or(if quick { 3000 } else { 1_000_000 }),
        phase: Duration::from_secs_f64(phase.unwrap_or(if quick { 2.0 } else { 20.0 })),
        clients: clients.unwrap_or(if quick { 4 } else { 16 }),
        steady_rate: rate.unwrap_or(if quick { 50 } else { 200 }),
        backfill_rate,
    };
    if [o.only_move, o.only_writes, o.only_reads, o.only_backfill].iter().filter(|on| **on).count() > 1 {
        return Err("--only-move, --only-writes, --only-reads and --only-backfill exclude each other".into());
    }
    if o.entities < 100 || o.clients == 0 || o.steady_rate == 0 || o.phase.is_zero() {
        return Err(
            "--entities must be at least 100; --clients, --steady-rate and --phase-secs positive".into()
        );
    }
    Ok(o)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = match parse_args(&args) {
        Ok(o) => o,
        Err(msg) if msg.is_empty() => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(msg) => {
            eprintln!("bench: {msg}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = sibling::locate_bagstore() {
        eprintln!("bench: {e}");
        return ExitCode::FAILURE;
    }
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    match rt.block_on(run(opts)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench: failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}

// ---------------------------------------------------------------- data

/// A well-spread id for entity number `i` (the same in every contender).
fn entity_id(i: u64) -> String {
    let h = xxhash_rust::xxh3::xxh3_128(&i.to_le_bytes());
    format!("{h:032x}")
}

fn user_id(u: usize) -> String {
    format!("{:032x}", 0x5e5e_0000_0000u64 + u as u64)
}

/// Entity number `i`: a post of user `i % USERS`, published at `i` seconds
/// after an epoch, with a unique link (the property indexed later).
fn entity(i: u64) -> Value {
    json!({
        "user_id": user_id(i as usize % USERS),
        "published": 1_700_000_000i64 + i as i64,
        "title": format!("Post number {i} about bagstore, schemaless entities on sharded MySQL"),
        "link": format!("https://example.com/posts/{i:012}"),
        "n": i,
    })
}

fn shard_of_hex(id: &str) -> usize {
    schemas::shard::initial_position_of(&hex16(id), SHARDS)
}

fn hex16(id: &str) -> [u8; 16] {
    schemas::EntityId::parse(id).expect("a hex id").0
}

/// Ids handed out to write phases, above the loaded range.
static NEXT_ID: AtomicU64 = AtomicU64::new(1 << 40);

fn fresh() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

// ---------------------------------------------------------------- figures

#[derive(Debug, Clone, Copy, Default)]
struct Latency {
    n: usize,
    p50: f64,
    p99: f64,
    max: f64,
}

/// Milliseconds, from samples in seconds.
fn latency(samples: &mut [f64]) -> Latency {
    if samples.is_empty() {
        return Latency::default();
    }
    samples.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| samples[((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len()) - 1] * 1e3;
    Latency { n: samples.len(), p50: at(0.50), p99: at(0.99), max: samples[samples.len() - 1] * 1e3 }
}

/// What a measured phase produced.
#[derive(Debug, Clone, Copy, Default)]
struct Run {
    /// Rows (entities) per second, or operations per second for reads.
    rate: f64,
    latency: Latency,
    errors: u64,
}

/// One line of the report: a name, a figure, and the comparison.
#[derive(Debug, Default)]
struct Report {
    rows: Vec<(String, String, String)>,
    json: BTreeMap<String, Value>,
}

impl Report {
    fn section(&mut self, title: &str) {
        self.rows.push((format!("**{title}**"), String::new(), String::new()));
    }

    fn line(&mut self, key: &str, what: &str, figure: String, note: String) {
        eprintln!("bench: {what}: {figure} {note}");
        self.rows.push((what.to_string(), figure, note));
        self.json.insert(key.to_string(), json!({"what": what}));
    }

    fn value(&mut self, key: &str, v: Value) {
        self.json.insert(key.to_string(), v);
    }

    fn run(&mut self, key: &str, what: &str, r: &Run, unit: &str) {
        self.line(
            key,
            what,
            format!("{:.0} {unit}", r.rate),
            format!(
                "p50 {:.2} ms, p99 {:.2} ms, max {:.1} ms ({} errors)",
                r.latency.p50, r.latency.p99, r.latency.max, r.errors
            ),
        );
        self.value(key, run_json(what, r));
    }

    fn markdown(&self) -> String {
        let mut s = String::from("| measure | figure | detail |\n| --- | ---: | --- |\n");
        for (a, b, c) in &self.rows {
            s.push_str(&format!("| {a} | {b} | {c} |\n"));
        }
        s
    }
}

fn run_json(what: &str, r: &Run) -> Value {
    json!({"what": what, "rate": r.rate, "p50_ms": r.latency.p50, "p99_ms": r.latency.p99,
           "max_ms": r.latency.max, "samples": r.latency.n, "errors": r.errors})
}

fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 {
        format!("{:.2}×", a / b)
    } else {
        "n/a".into()
    }
}

// ---------------------------------------------------------------- load drivers

/// What closed-loop workers did: every operation's latency (s) and the
/// time they ran. Tallies of alternating rounds add up.
#[derive(Debug, Default)]
struct Tally {
    secs: f64,
    rows_per_op: usize,
    samples: Vec<f64>,
    errors: u64,
}

impl Tally {
    fn add(&mut self, other: Tally) {
        self.secs += other.secs;
        self.rows_per_op = other.rows_per_op;
        self.samples.extend(other.samples);
        self.errors += other.errors;
    }

    fn run(mut self) -> Run {
        Run {
            rate: (self.samples.len() * self.rows_per_op) as f64 / self.secs.max(1e-9),
            latency: latency(&mut self.samples),
            errors: self.errors,
        }
    }
}

/// Runs `clients` closed-loop workers for `phase`; each call of `op` does
/// one operation of `rows` rows and returns Ok or an error.
async fn closed_loop<F, Fut>(clients: usize, phase: Duration, rows: usize, op: F) -> Run
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send,
{
    closed_loop_tally(clients, phase, rows, Arc::new(op)).await.run()
}

async fn closed_loop_tally<F, Fut>(clients: usize, phase: Duration, rows: usize, op: Arc<F>) -> Tally
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send,
{
    let until = Instant::now() + phase;
    let start = Instant::now();
    let errors = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (op, errors) = (op.clone(), errors.clone());
        tasks.push(tokio::spawn(async move {
            let mut samples = Vec::new();
            while Instant::now() < until {
                let t = Instant::now();
                match op().await {
                    Ok(()) => samples.push(t.elapsed().as_secs_f64()),
                    Err(e) => {
                        if errors.fetch_add(1, Ordering::Relaxed) == 0 {
                            eprintln!("bench: first error of a phase: {e:#}");
                        }
                    }
                }
            }
            samples
        }));
    }
    let mut samples = Vec::new();
    for t in tasks {
        samples.extend(t.await.expect("worker"));
    }
    Tally {
        secs: start.elapsed().as_secs_f64(),
        rows_per_op: rows,
        samples,
        errors: errors.load(Ordering::Relaxed),
    }
}

/// Rounds of a read comparison: `ROUNDS` short turns each, alternating, so a
/// slow spell of this shared machine falls on both contenders, not on one.
const ROUNDS: u32 = 4;

/// Two read contenders side by side: `ROUNDS` alternating turns of
/// `phase / ROUNDS` each, their latencies pooled. Returns each one's run and
/// what the machine spent during its own turns.
async fn side_by_side<FA, FutA, FB, FutB>(
    world: &World,
    clients: usize,
    phase: Duration,
    a: FA,
    b: FB,
) -> ((Run, Usage), (Run, Usage))
where
    FA: Fn() -> FutA + Send + Sync + 'static,
    FutA: std::future::Future<Output = anyhow::Result<()>> + Send,
    FB: Fn() -> FutB + Send + Sync + 'static,
    FutB: std::future::Future<Output = anyhow::Result<()>> + Send,
{
    let (a, b) = (Arc::new(a), Arc::new(b));
    let turn = phase / ROUNDS;
    let (mut ta, mut tb) = (Tally::default(), Tally::default());
    let (mut ua, mut ub) = (Usage::default(), Usage::default());
    for _ in 0..ROUNDS {
        let u0 = world.usage().await;
        ta.add(closed_loop_tally(clients, turn, 1, a.clone()).await);
        let u1 = world.usage().await;
        tb.add(closed_loop_tally(clients, turn, 1, b.clone()).await);
        let u2 = world.usage().await;
        ua.add(&u1, &u0);
        ub.add(&u2, &u1);
    }
    ((ta.run(), ua), (tb.run(), ub))
}

/// An open-loop writer: starts one `op` every `1/rate` s until `stop`,
/// however slow the answers are, and times each.
async fn open_loop<F, Fut>(rate: f64, stop: Arc<AtomicBool>, op: F) -> Run
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let op = Arc::new(op);
    let samples = Arc::new(Mutex::new(Vec::new()));
    let errors = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut inflight = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let (op, samples, errors) = (op.clone(), samples.clone(), errors.clone());
        inflight.push(tokio::spawn(async move {
            let t = Instant::now();
            match op().await {
                Ok(()) => samples.lock().unwrap().push(t.elapsed().as_secs_f64()),
                Err(_) => {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
        if inflight.len() > 4096 {
            inflight.retain(|h| !h.is_finished());
        }
    }
    for h in inflight {
        let _ = h.await;
    }
    let secs = start.elapsed().as_secs_f64();
    let mut s = samples.lock().unwrap().clone();
    Run { rate: s.len() as f64 / secs, latency: latency(&mut s), errors: errors.load(Ordering::Relaxed) }
}

/// The steady writer alone for `d`: its run, what the machine spent
/// meanwhile, and the seconds that took.
async fn steady_alone<F, Fut>(
    world: &World,
    rate: f64,
    d: Duration,
    op: F,
) -> anyhow::Result<(Run, Usage, f64)>
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let before = world.usage().await;
    let t = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let steady = tokio::spawn(open_loop(rate, stop.clone(), op));
    tokio::time::sleep(d).await;
    stop.store(true, Ordering::Relaxed);
    let run = steady.await?;
    let secs = t.elapsed().as_secs_f64();
    let mut spent = Usage::default();
    spent.add(&world.usage().await, &before);
    Ok((run, spent, secs))
}

// ---------------------------------------------------------------- peak memory

/// The processes of the run, labelled: their largest resident set (kB,
/// sampled every 200 ms) and the CPU they used.
#[derive(Debug, Default)]
struct ProcSampler {
    pids: Mutex<Vec<(String, u32)>>,
    peak_kb: Mutex<BTreeMap<String, u64>>,
    /// Per pid, the CPU ticks last read: a process that has exited (the
    /// backfilling cleaner) keeps counting what it used.
    last_ticks: Mutex<BTreeMap<u32, u64>>,
}

fn rss_kb(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
}

impl ProcSampler {
    fn watch(&self, label: &str, pid: u32) {
        self.pids.lock().unwrap().push((label.to_string(), pid));
    }

    /// CPU ticks used so far, per label (processes that share a label add up).
    fn cpu(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for (label, pid) in self.pids.lock().unwrap().iter() {
            if let Some(t) = self.ticks(*pid) {
                *out.entry(short_label(label)).or_insert(0) += t;
            }
        }
        out
    }

    /// `pid`'s CPU ticks now, or the last read if it has exited.
    fn ticks(&self, pid: u32) -> Option<u64> {
        let mut last = self.last_ticks.lock().unwrap();
        match cpu_ticks(pid) {
            Some(t) => {
                last.insert(pid, t);
                Some(t)
            }
            None => last.get(&pid).copied(),
        }
    }

    fn sample(&self) {
        let pids = self.pids.lock().unwrap().clone();
        let mut peak = self.peak_kb.lock().unwrap();
        for (label, pid) in pids {
            self.ticks(pid);
            if let Some(kb) = rss_kb(pid) {
                let e = peak.entry(label).or_insert(0);
                *e = (*e).max(kb);
            }
        }
    }
}

/// "mariadbd shard 0" and "mariadbd shard 1" count together, and so on.
fn short_label(label: &str) -> String {
    match label {
        l if l.starts_with("mariadbd") => "mariadbd".into(),
        l if l.starts_with("bagstore indexer") => "indexer".into(),
        l if l.starts_with("bagstore writer") => "writer".into(),
        l if l.starts_with("bagstore reader") => "reader".into(),
        l if l.starts_with("bench") => "client".into(),
        l => l.trim_start_matches("bagstore ").to_string(),
    }
}

/// CPU seconds per 1000 operations used by each process group between two snapshots.
fn cpu_per_k(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>, rows: f64, unit: &str) -> String {
    let mut parts = Vec::new();
    for (label, t) in after {
        let used = t.saturating_sub(before.get(label).copied().unwrap_or(0)) as f64 / 100.0;
        if used > 0.0 && rows > 0.0 {
            parts.push(format!("{label} {:.2}", used / rows * 1000.0));
        }
    }
    format!("CPU s per 1000 {unit}: {}", parts.join(", "))
}

// ---------------------------------------------------------------- the world

struct World {
    dir: tempfile::TempDir,
    servers: Vec<MariaDb>,
    /// Per shard: bagstore's database.
    bag_dsns: Vec<String>,
    /// Per shard: the raw and json contenders' database.
    native: Arc<Native>,
    kafka: MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
    topic: String,
    http: reqwest::Client,
    procs: Arc<ProcSampler>,
}

/// What the machine spent: CPU ticks per process group, and the statements
/// the MariaDB servers ran, their fsyncs and redo-log writes (`Questions`,
/// `Innodb_data_fsyncs`, `Innodb_log_writes`, summed over the servers).
#[derive(Debug, Clone, Default)]
struct Usage {
    cpu: BTreeMap<String, u64>,
    statements: u64,
    fsyncs: u64,
    log_writes: u64,
    /// Rows written, updated and deleted (`Handler_write`, `_update`,
    /// `_delete`: MariaDB 10.11 has no `Innodb_rows_*` counters).
    row_writes: u64,
    /// Binary log group commits: one binlog fsync each with `sync_binlog=1`.
    binlog_syncs: u64,
    /// Bytes written to the binary logs (`Binlog_bytes_written`).
    binlog_bytes: u64,
    /// Statements by kind (`Com_select`, `Com_insert`, …, without `Com_`).
    kinds: BTreeMap<String, u64>,
}

impl Usage {
    /// Adds what was spent between `before` and `after`.
    fn add(&mut self, after: &Usage, before: &Usage) {
        for (label, t) in &after.cpu {
            let used = t.saturating_sub(before.cpu.get(label).copied().unwrap_or(0));
            *self.cpu.entry(label.clone()).or_insert(0) += used;
        }
        self.statements += after.statements.saturating_sub(before.statements);
        self.fsyncs += after.fsyncs.saturating_sub(before.fsyncs);
        self.log_writes += after.log_writes.saturating_sub(before.log_writes);
        self.row_writes += after.row_writes.saturating_sub(before.row_writes);
        self.binlog_syncs += after.binlog_syncs.saturating_sub(before.binlog_syncs);
        self.binlog_bytes += after.binlog_bytes.saturating_sub(before.binlog_bytes);
        for (kind, n) in &after.kinds {
            let done = n.saturating_sub(before.kinds.get(kind).copied().unwrap_or(0));
            *self.kinds.entry(kind.clone()).or_insert(0) += done;
        }
    }

    /// CPU ticks of the MariaDB servers.
    fn mariadbd_ticks(&self) -> u64 {
        self.cpu.iter().filter(|(label, _)| label.starts_with("mariadbd")).map(|(_, t)| *t).sum()
    }

    /// What MariaDB spent per `ops` entities written: "mariadbd CPU s per
    /// 1000 …; statements, row writes, InnoDB and binlog fsyncs per …".
    fn mysql_per_entity(&self, ops: f64) -> String {
        let per = |n: u64| n as f64 / ops.max(1.0);
        let kinds: Vec<String> =
            self.kinds.iter().filter(|(_, n)| **n > 0).map(|(k, n)| format!("{k} {:.2}", per(*n))).collect();
        format!(
            "mariadbd CPU s per 1000: {:.3}; per entity: statements {:.2} ({}), row writes {:.2}, InnoDB fsyncs {:.3}, binlog fsyncs {:.3}, binlog bytes {:.0}",
            self.mariadbd_ticks() as f64 / 100.0 / ops.max(1.0) * 1000.0,
            per(self.statements),
            kinds.join(", "),
            per(self.row_writes),
            per(self.fsyncs),
            per(self.binlog_syncs),
            per(self.binlog_bytes)
        )
    }

    /// "cores busy: <group> 0.42, …; InnoDB fsyncs/s …, log writes/s …"
    /// over `secs`.
    fn busy(&self, secs: f64) -> String {
        let groups: Vec<String> = self
            .cpu
            .iter()
            .filter(|(_, t)| **t > 0)
            .map(|(label, t)| format!("{label} {:.2}", *t as f64 / 100.0 / secs))
            .collect();
        format!(
            "cores busy: {} (all {:.2}); InnoDB fsyncs/s {:.0}, log writes/s {:.0}",
            groups.join(", "),
            self.cores(secs),
            self.fsyncs as f64 / secs,
            self.log_writes as f64 / secs
        )
    }

    /// Cores busy over `secs`, every watched process together.
    fn cores(&self, secs: f64) -> f64 {
        self.cpu.values().sum::<u64>() as f64 / 100.0 / secs
    }

    /// "CPU s per 1000 <unit>: …; MariaDB statements per <unit>: …" for
    /// `ops` operations.
    fn per_op(&self, ops: f64, unit: &str) -> String {
        let per = self.statements as f64 / ops.max(1.0);
        format!(
            "{}; MariaDB statements per {}: {per:.2}",
            cpu_per_k(&BTreeMap::new(), &self.cpu, ops, unit),
            match unit {
                "queries" => "query",
                other => other.trim_end_matches('s'),
            }
        )
    }
}

/// A backfill run beside the steady writer, and its control.
struct Backfilled {
    secs: f64,
    during: Run,
    /// The same writer beside a CPU burner as big as the backfill's extra.
    burned: Run,
    extra_cores: f64,
    during_use: (Usage, f64),
    burned_use: (Usage, f64),
}

/// How the bench runs a backfill: `cleaner --index` arguments and
/// `BAGSTORE_…` settings.
#[derive(Clone, Copy)]
struct Backfill<'a> {
    args: &'a [&'a str],
    env: &'a [(&'a str, &'a str)],
}

/// Backfills `index` (created by `migrate`, CREATING) with `bagstore
/// cleaner --index <index> <args>` while `steady` writes at `rate`, checks
/// the index holds one row per live entity, then runs the control: the
/// same writer beside a load that is not bagstore's, as many cores busy as
/// the backfill added over `base`.
async fn backfill_beside_writer<F, Fut>(
    world: &World,
    index: &str,
    how: Backfill<'_>,
    base: (&Usage, f64),
    rate: f64,
    d: Duration,
    steady: F,
) -> anyhow::Result<Backfilled>
where
    F: Fn() -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let indexer = world.bagstore(&["indexer", "--index", index], true).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let before = world.usage().await;
    let writer = tokio::spawn(open_loop(rate, stop.clone(), steady.clone()));
    let t = Instant::now();
    let mut child = bagstore_tests::command(bagstore_tests::bagstore_bin())
        .args(["cleaner", "--index", index])
        .args(how.args)
        .arg("--config")
        .arg(world.config(true))
        .env("RUST_LOG", "warn")
        .envs(how.env.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    if let Some(pid) = child.id() {
        world.procs.watch(&format!("bagstore cleaner --index (backfill {index})"), pid);
    }
    let status = child.wait().await?;
    let secs = t.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let during = writer.await?;
    let mut during_use = Usage::default();
    during_use.add(&world.usage().await, &before);
    ensure!(status.success(), "the backfill of {index} failed: {status}");
    world.caught_up(index, Duration::from_secs(3600)).await?;
    let mut rows = 0i64;
    let mut live = 0i64;
    for dsn in &world.bag_dsns {
        let pool = MySqlPool::connect(dsn).await?;
        rows +=
            sqlx::query_scalar::<_, i64>(&format!("SELECT COUNT(*) FROM {index} WHERE removed_us IS NULL"))
                .fetch_one(&pool)
                .await?;
        live += sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM entities WHERE body IS NOT NULL")
            .fetch_one(&pool)
            .await?;
        pool.close().await;
    }
    ensure!(rows == live, "{index} holds {rows} rows for {live} entities");
    indexer.terminate().await;
    let extra_cores = (during_use.cores(secs) - base.0.cores(base.1)).max(0.0);
    let stop = Arc::new(AtomicBool::new(false));
    let burners = burn(extra_cores, stop.clone());
    let burned = steady_alone(world, rate, d, steady).await;
    stop.store(true, Ordering::Relaxed);
    for b in burners {
        b.join().expect("burner");
    }
    let (burned, burned_use, burned_secs) = burned?;
    Ok(Backfilled {
        secs,
        during,
        burned,
        extra_cores,
        during_use: (during_use, secs),
        burned_use: (burned_use, burned_secs),
    })
}

impl World {
    async fn usage(&self) -> Usage {
        let mut u = Usage { cpu: self.procs.cpu(), ..Usage::default() };
        for pool in &self.native.pools {
            let rows: Vec<(String, String)> = sqlx::query_as(
                "SHOW GLOBAL STATUS WHERE Variable_name IN ('Questions', 'Innodb_data_fsyncs', 'Innodb_log_writes', \
                 'Handler_write', 'Handler_update', 'Handler_delete', 'Binlog_group_commits', 'Binlog_bytes_written', \
                 'Com_select', 'Com_insert', 'Com_update', 'Com_delete', 'Com_begin', 'Com_commit', 'Com_rollback', \
                 'Com_set_option')",
            )
            .fetch_all(pool)
            .await
            .unwrap_or_default();
            for (name, v) in rows {
                let v = v.parse::<u64>().unwrap_or(0);
                match name.as_str() {
                    "Questions" => u.statements += v,
                    "Innodb_data_fsyncs" => u.fsyncs += v,
                    "Innodb_log_writes" => u.log_writes += v,
                    "Binlog_group_commits" => u.binlog_syncs += v,
                    "Binlog_bytes_written" => u.binlog_bytes += v,
                    kind if kind.starts_with("Com_") => {
                        *u.kinds.entry(kind["Com_".len()..].to_string()).or_insert(0) += v
                    }
                    _ => u.row_writes += v,
                }
            }
        }
        u
    }

    /// What was spent since `last` for `ops` operations (see
    /// `Usage::per_op`); moves `last` on.
    async fn usage_step(&self, last: &mut Usage, ops: f64, unit: &str) -> String {
        self.spent_since(last).await.per_op(ops, unit)
    }

    /// What was spent since `last`; moves `last` on.
    async fn spent_since(&self, last: &mut Usage) -> Usage {
        let now = self.usage().await;
        let mut spent = Usage::default();
        spent.add(&now, last);
        *last = now;
        spent
    }

    fn config(&self, with_new_index: bool) -> PathBuf {
        self.config_file("bagstore.toml", &self.bag_dsns, with_new_index)
    }

    /// A config naming `dsns` as bagstore's shards, written to `file`. The
    /// broker is librdkafka's mock cluster, as in `bagstore dev`, so the
    /// indexers' fetch wait is the one `bagstore dev` gives them.
    fn config_file(&self, file: &str, dsns: &[String], with_new_index: bool) -> PathBuf {
        let shards: Vec<String> = dsns.iter().map(|d| format!("{d:?}")).collect();
        let mut toml = format!(
            "[mysql]\nshards = [{}]\nmax_connections = 32\n\n[kafka]\nbrokers = {:?}\ntopic = {:?}\npartitions = {PARTITIONS}\nreplication_factor = 1\n\n\
             [http]\naddr = \"127.0.0.1:0\"\n\n\
             [indexer]\nfetch_wait_ms = {EMBEDDED_FETCH_WAIT_MS}\n\n\
             [[indexes]]\ntable = \"{INDEX_MAIN}\"\nproperties = [{{ name = \"user_id\", type = \"uuid\" }}, {{ name = \"published\", type = \"int\" }}]\nshard_on = \"user_id\"\n",
            shards.join(", "),
            self.kafka.bootstrap_servers(),
            self.topic,
        );
        if with_new_index {
            for table in [INDEX_NEW, INDEX_PACED] {
                toml.push_str(&format!(
                    "\n[[indexes]]\ntable = \"{table}\"\nproperties = [{{ name = \"link\", type = \"string\", max_len = 200 }}]\n"
                ));
            }
        }
        let p = self.dir.path().join(file);
        std::fs::write(&p, toml).expect("config");
        p
    }

    async fn bagstore(&self, args: &[&str], new_index: bool) -> anyhow::Result<Proc> {
        self.bagstore_with(args, new_index, &[]).await
    }

    /// [`World::bagstore`] with settings overridden by `BAGSTORE_…` variables.
    async fn bagstore_with(
        &self,
        args: &[&str],
        new_index: bool,
        env: &[(&str, &str)],
    ) -> anyhow::Result<Proc> {
        let mut all: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        all.push("--config".into());
        all.push(self.config(new_index).display().to_string());
        let mut vars = vec![("RUST_LOG", "warn")];
        vars.extend_from_slice(env);
        let p = Proc::start(&all, self.dir.path(), &vars).await?;
        self.procs.watch(&format!("bagstore {}", args.join(" ")), p.pid() as u32);
        Ok(p)
    }

    async fn migrate(&self, new_index: bool) -> anyhow::Result<()> {
        let out = bagstore_tests::command(bagstore_tests::bagstore_bin())
            .arg("migrate")
            .arg("--config")
            .arg(self.config(new_index))
            .output()
            .await?;
        ensure!(out.status.success(), "migrate failed: {}", String::from_utf8_lossy(&out.stderr));
        Ok(())
    }

    /// The settings a client of the bench's Kafka needs.
    fn kafka_settings(&self) -> schemas::settings::KafkaSettings {
        schemas::settings::KafkaSettings {
            brokers: self.kafka.bootstrap_servers(),
            topic: self.topic.clone(),
            ..Default::default()
        }
    }

    /// Waits until the outbox is empty and `index`'s group has applied everything.
    async fn caught_up(&self, index: &str, deadline: Duration) -> anyhow::Result<Duration> {
        let k = self.kafka_settings();
        let start = Instant::now();
        loop {
            let mut outbox = 0;
            for (shard, d) in self.bag_dsns.iter().enumerate() {
                let pool = MySqlPool::connect(d).await?;
                outbox += storage::outbox::outbox_backlog(shard, &pool).await?.rows;
                pool.close().await;
            }
            if outbox == 0 {
                let lag: i64 =
                    service::kafka::group_lag(&k, &k.group_for(index)).await?.iter().map(|p| p.lag()).sum();
                if lag == 0 {
                    return Ok(start.elapsed());
                }
            }
            ensure!(start.elapsed() < deadline, "{index} did not catch up within {deadline:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The servers' settings, every contender's the same, as production runs
/// MySQL: the binary log on, each commit's binlog write synced
/// (`sync_binlog=1`) as well as its redo log.
fn server_options(quick: bool, server_id: usize) -> devstack::mariadb::MariaDbOptions {
    let mut o = devstack::mariadb::MariaDbOptions::bench_sized(quick);
    o.ephemeral = true;
    o.extra_args.extend([
        "--log-bin=binlog".into(),
        "--binlog-format=ROW".into(),
        format!("--server-id={}", server_id + 1),
    ]);
    o
}

impl ProcSampler {
    /// For the write phases, on two cores or more: the MariaDB servers get
    /// core 0 to themselves, and every other watched process (this one: the
    /// clients and the mock Kafka; bagstore's) the others, so MariaDB's CPU
    /// figures are not its neighbours'. `false` lets every process use
    /// every core again: the load and the other phases run unpinned (on
    /// one core, the indexer fell so far behind the load that the mock
    /// cluster dropped events it had not read: it keeps 5 MiB or 100,000
    /// messages per partition). Returns what the report says of it.
    fn pin_for_writes(&self, on: bool) -> anyhow::Result<String> {
        let cores = online_cores();
        if cores < 2 {
            return Ok("not pinned: one core".into());
        }
        let all = format!("0-{}", cores - 1);
        let rest = off_server_cores();
        for (label, pid) in self.pids.lock().unwrap().iter() {
            if cpu_ticks(*pid).is_none() {
                continue; // exited
            }
            let cores = match (on, label.starts_with("mariadbd")) {
                (false, _) => all.as_str(),
                (true, true) => "0",
                (true, false) => rest.as_str(),
            };
            pin(*pid, cores)?;
        }
        Ok(format!("mariadbd pinned to core 0, everything else to core(s) {rest}"))
    }
}

async fn setup(opts: &Options) -> anyhow::Result<World> {
    let dir = tempfile::Builder::new().prefix("bagstore-bench-").tempdir()?;
    let mut servers = Vec::new();
    for i in 0..SHARDS {
        let server =
            MariaDb::start_with(&dir.path().join(format!("shard-{i}")), server_options(opts.quick, i))
                .await?;
        let root = MySqlPool::connect(&server.dsn("")).await?;
        let (log_bin, sync_binlog): (i64, i64) =
            sqlx::query_as("SELECT CAST(@@log_bin AS SIGNED), CAST(@@sync_binlog AS SIGNED)")
                .fetch_one(&root)
                .await?;
        ensure!(log_bin == 1 && sync_binlog == 1, "shard {i}: log_bin {log_bin}, sync_binlog {sync_binlog}");
        root.close().await;
        servers.push(server);
    }
    let procs = Arc::new(ProcSampler::default());
    for (i, s) in servers.iter().enumerate() {
        procs.watch(&format!("mariadbd shard {i}"), s.pid());
    }
    procs.watch("bench (load generator, mock Kafka)", std::process::id());
    let bag_dsns: Vec<String> = servers.iter().map(|s| s.dsn("bench_bag")).collect();
    let mut pools = Vec::new();
    let mut conns = Vec::new();
    for (i, s) in servers.iter().enumerate() {
        let root = MySqlPool::connect(&s.dsn("")).await?;
        sqlx::query("CREATE DATABASE IF NOT EXISTS bench_native").execute(&root).await?;
        root.close().await;
        let pool = MySqlPoolOptions::new()
            .max_connections(opts.clients as u32 + 4)
            .connect(&s.dsn("bench_native"))
            .await?;
        sqlx::query(&storage::ddl::entities()).execute(&pool).await?;
        sqlx::query(json_table::DDL).execute(&pool).await?;
        pools.push(pool);
        let options = sqlx::mysql::MySqlConnectOptions::from_str(&s.dsn("bench_native"))?;
        conns.push(Conns::new(i, options, opts.clients as u32 + 4));
    }
    let native = Arc::new(Native { pools, conns });
    floor::create_tables(&native).await?;
    let kafka = MockCluster::new(1)?;
    let topic = "bench.entity-changes".to_string();
    kafka.create_topic(&topic, PARTITIONS, 1)?;
    kafka.create_topic(&format!("{topic}.dlq"), 1, 1)?;
    kafka.create_topic("bagstore.changes.v1", PARTITIONS, 1)?;
    for t in ["bagstore.ingest.v1", "bagstore.ingest.v1.dlq", "bagstore.ingest.v1.replies"] {
        kafka.create_topic(t, PARTITIONS, 1)?;
    }
    let http = reqwest::Client::builder().pool_max_idle_per_host(opts.clients * 2).build()?;
    Ok(World { dir, servers, bag_dsns, native, kafka, topic, http, procs })
}

// ---------------------------------------------------------------- contenders

/// The raw and JSON contenders' database on each server. Their statements
/// run on reused connections without a ping, as bagstore's hot paths do
/// (`storage::conns`): sqlx's pool would add two pings to every statement
/// and make the contenders slower than they need to be. The pools serve the
/// setup, the `ALTER`s and the status reads.
struct Native {
    pools: Vec<MySqlPool>,
    conns: Vec<Conns>,
}

impl Native {
    async fn execute(&self, shard: usize, q: MyQuery<'_>) -> anyhow::Result<()> {
        let mut t = self.conns[shard].take().await?;
        q.execute(&mut t.conn).await?;
        self.conns[shard].give_back(t);
        Ok(())
    }

    async fn fetch_all(&self, shard: usize, q: MyQuery<'_>) -> anyhow::Result<Vec<sqlx::mysql::MySqlRow>> {
        let mut t = self.conns[shard].take().await?;
        let rows = q.fetch_all(&mut t.conn).await?;
        self.conns[shard].give_back(t);
        Ok(rows)
    }
}

type MyQuery<'q> = sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments>;

/// One multi-row INSERT per shard, shards in parallel: `head`, then one
/// `tuple` per row; the row's id is bound first, `bind` binds the rest.
async fn insert_by_shard<T: Send + Sync + 'static>(
    native: Arc<Native>,
    items: Vec<(String, T)>,
    head: &'static str,
    tuple: &'static str,
    bind: for<'q> fn(MyQuery<'q>, &'q T) -> MyQuery<'q>,
) -> anyhow::Result<()> {
    let mut per: Vec<Vec<(String, T)>> = (0..SHARDS).map(|_| Vec::new()).collect();
    for (id, v) in items {
        per[shard_of_hex(&id)].push((id, v));
    }
    let jobs = per.into_iter().enumerate().filter(|(_, v)| !v.is_empty()).map(|(s, rows)| {
        let native = native.clone();
        async move {
            let sql = format!("{head} {}", vec![tuple; rows.len()].join(", "));
            let mut q = sqlx::query(&sql);
            for (id, v) in &rows {
                q = bind(q.bind(hex16(id).to_vec()), v);
            }
            native.execute(s, q).await
        }
    });
    for r in futures::future::join_all(jobs).await {
        r?;
    }
    Ok(())
}

/// The raw contender's multi-row insert into `entities`: this, then one
/// [`RAW_ROW`] per row (id, logical shard, encoded body).
const RAW_HEAD: &str = "INSERT INTO entities (id, logical, version, updated, body) VALUES";
const RAW_ROW: &str = "(?, ?, 1, NOW(6), ?)";

/// Raw rows shaped like bagstore's `entities` (logical shard included),
/// bodies already encoded.
async fn raw_insert(native: Arc<Native>, items: Vec<(String, Vec<u8>)>) -> anyhow::Result<()> {
    let items: Vec<(String, (u16, Vec<u8>))> = items
        .into_iter()
        .map(|(id, body)| {
            let logical = schemas::logical_of(&hex16(&id), schemas::shard::DEFAULT_LOGICAL_SHARDS);
            (id, (logical, body))
        })
        .collect();
    insert_by_shard(native, items, RAW_HEAD, RAW_ROW, |q, (logical, body)| q.bind(*logical).bind(&body[..]))
        .await
}

/// JSON documents into the native table.
async fn json_insert(native: Arc<Native>, items: Vec<(String, String)>) -> anyhow::Result<()> {
    insert_by_shard(native, items, json_table::INSERT_HEAD, json_table::ROW, |q, doc| q.bind(doc.as_str()))
        .await
}

fn body_of(i: u64) -> Vec<u8> {
    let bag = schemas::value::bag_from_json(&entity(i)).expect("a bag");
    schemas::codec::encode_body(&bag)
}

async fn bag_put(http: reqwest::Client, base: Arc<String>, i: u64) -> anyhow::Result<()> {
    let r = http.put(format!("{base}/v1/entities/{}", entity_id(i))).json(&entity(i)).send().await?;
    ensure!(r.status().is_success(), "put answered {}", r.status());
    Ok(())
}

async fn bag_batch(http: reqwest::Client, base: Arc<String>, ids: Vec<u64>) -> anyhow::Result<()> {
    let items: Vec<Value> = ids
        .iter()
        .map(|i| {
            let mut e = entity(*i);
            e["id"] = json!(entity_id(*i));
            e
        })
        .collect();
    let r = http.post(format!("{base}/v1/entities/batch")).json(&json!({"entities": items})).send().await?;
    ensure!(r.status().is_success(), "batch answered {}", r.status());
    let doc: Value = r.json().await?;
    let bad = doc["results"].as_array().map_or(0, |a| a.iter().filter(|x| x["version"].is_null()).count());
    ensure!(bad == 0, "{bad} batch items failed: {doc}");
    Ok(())
}

/// "Latest 20 of one user" (and a range on `published`), natively: both
/// shards (the table is sharded by entity id), merged by `published` desc.
async fn json_latest(native: &Native, user: &str, range: Option<(i64, i64)>) -> anyhow::Result<Vec<String>> {
    let sql = match range {
        None => "SELECT LOWER(HEX(id)) AS id, doc, published FROM docs WHERE user_id = ? ORDER BY published DESC LIMIT 20",
        Some(_) => "SELECT LOWER(HEX(id)) AS id, doc, published FROM docs WHERE user_id = ? AND published >= ? AND published < ? ORDER BY published DESC LIMIT 20",
    };
    let jobs = (0..SHARDS).map(|s| {
        let mut q = sqlx::query(sql).bind(user);
        if let Some((a, b)) = range {
            q = q.bind(a).bind(b);
        }
        native.fetch_all(s, q)
    });
    let mut rows: Vec<(i64, String)> = Vec::new();
    for r in futures::future::join_all(jobs).await {
        for row in r? {
            // A client of the native table parses the documents it reads,
            // as bagstore's client parses the answer.
            let doc: Vec<u8> = row.try_get("doc")?;
            let _: Value = serde_json::from_slice(&doc)?;
            rows.push((row.try_get("published")?, row.try_get("id")?));
        }
    }
    rows.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| b.1.cmp(&a.1)));
    rows.truncate(20);
    Ok(rows.into_iter().map(|(_, id)| id).collect())
}

async fn bag_latest(
    http: &reqwest::Client,
    base: &str,
    user: &str,
    range: Option<(i64, i64)>,
) -> anyhow::Result<Vec<String>> {
    let mut w = json!({"user_id": user});
    if let Some((a, b)) = range {
        w["published"] = json!({"gte": a, "lt": b});
    }
    let q = json!({"index": INDEX_MAIN, "where": w, "order": "desc", "limit": 20});
    let r = http.post(format!("{base}/v1/query")).json(&q).send().await?;
    ensure!(r.status().is_success(), "query answered {}", r.status());
    let doc: Value = r.json().await?;
    Ok(doc["items"]
        .as_array()
        .context("items")?
        .iter()
        .map(|e| e["id"].as_str().unwrap_or("").to_string())
        .collect())
}

// ---------------------------------------------------------------- histogram

#[path = "burn.rs"]
mod burn;
#[path = "cpu.rs"]
mod cpu;
#[path = "hist.rs"]
mod hist;
#[path = "sibling.rs"]
mod sibling;
use burn::burn;
use cpu::{cpu_ticks, off_server_cores, online_cores, pin};
use hist::{buckets, max_bucket, quantile};

// ---------------------------------------------------------------- the run

async fn run(opts: Options) -> anyhow::Result<()> {
    let started = Instant::now();
    eprintln!("bench: {opts:?}");
    let world = setup(&opts).await?;
    let sampler = world.procs.clone();
    let sampling = Arc::new(AtomicBool::new(true));
    let s2 = sampling.clone();
    let rss_task = tokio::spawn(async move {
        while s2.load(Ordering::Relaxed) {
            sampler.sample();
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    let mut report = Report::default();
    let result = phases(&opts, &world, &mut report).await;
    sampling.store(false, Ordering::Relaxed);
    let _ = rss_task.await;
    world.procs.sample();
    result?;

    report.section("Peak resident memory during the run");
    let peaks = world.procs.peak_kb.lock().unwrap().clone();
    for (label, kb) in &peaks {
        report.line(&format!("rss {label}"), label, format!("{:.0} MiB", *kb as f64 / 1024.0), String::new());
    }
    report.value("peak_rss_kb", json!(peaks));
    let (cores, mem) = machine();
    report.value(
        "machine",
        json!({"cores": cores, "memory": mem, "quick": opts.quick, "entities": opts.entities,
               "clients": opts.clients, "phase_secs": opts.phase.as_secs_f64(), "total_secs": started.elapsed().as_secs_f64()}),
    );
    println!("\n{}", report.markdown());
    println!("machine: {cores} cores, {mem}; total {:.0} s", started.elapsed().as_secs_f64());
    let path = json_path(opts.quick);
    std::fs::write(&path, serde_json::to_string_pretty(&report.json)?)?;
    println!("figures written to {}", path.display());
    for s in world.servers {
        let _ = s.stop().await;
    }
    drop(world.dir);
    Ok(())
}

fn json_path(quick: bool) -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    let name = if quick { "bench-quick.json" } else { "bench.json" };
    match exe.parent().and_then(Path::parent) {
        Some(target) => target.join(name),
        None => PathBuf::from(name),
    }
}

/// The machine's cores, whatever this process is pinned to (which
/// `available_parallelism` would report).
fn machine() -> (usize, String) {
    let cores = online_cores();
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().next().map(|l| l.split_whitespace().nth(1).unwrap_or("0").to_string()))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or("?".to_string(), |kb| format!("{:.0} GiB", kb / 1024.0 / 1024.0));
    (cores, mem)
}

async fn phases(opts: &Options, world: &World, report: &mut Report) -> anyhow::Result<()> {
    let n = opts.entities as u64;
    let c = opts.clients;
    let d = opts.phase;
    world.migrate(false).await?;
    let mut writer = world.bagstore(&["writer"], false).await?;
    let mut indexer = world.bagstore(&["indexer", "--index", INDEX_MAIN], false).await?;
    let reader = world.bagstore(&["reader"], false).await?;
    let mut wbase = Arc::new(writer.url.clone());
    let native = world.native.clone();
    let http = world.http.clone();
    // The indexer holds its partitions before bagstore's load starts: a
    // group still joining reads nothing, and the mock cluster drops what a
    // partition holds beyond 5 MiB (a short load used to lose its first
    // events that way, and the answers check then failed).
    until_assigned(&http, &indexer).await?;

    // ---- Load the same N entities into json and bagstore.
    report.section(&format!("Loading {n} entities (batches of {BATCH}, {c} clients)"));
    let next = Arc::new(AtomicU64::new(0));
    let t = Instant::now();
    let load_json = if opts.only_move {
        0
    } else {
        let (next, native) = (next.clone(), native.clone());
        closed_loop_until(c, move || {
            let (next, native) = (next.clone(), native.clone());
            async move {
                let from = next.fetch_add(BATCH as u64, Ordering::Relaxed);
                if from >= n {
                    return Ok(false);
                }
                let items = (from..(from + BATCH as u64).min(n))
                    .map(|i| (entity_id(i), entity(i).to_string()))
                    .collect();
                json_insert(native, items).await.map(|_| true)
            }
        })
        .await?
    };
    let json_secs = t.elapsed().as_secs_f64();
    if !opts.only_move {
        report.line(
            "load_json",
            "json: load",
            format!("{:.0} entities/s", n as f64 / json_secs),
            format!("{load_json} batches, {json_secs:.1} s"),
        );
    }
    let next = Arc::new(AtomicU64::new(0));
    let t = Instant::now();
    // The loaders wait while the index is far behind: librdkafka's mock
    // cluster keeps only 5 MiB or 100,000 messages per partition, and an
    // indexer more than that behind would never see the events it dropped.
    let paused = Arc::new(AtomicBool::new(false));
    let watch_stop = Arc::new(AtomicBool::new(false));
    let watch = {
        let (paused, stop) = (paused.clone(), watch_stop.clone());
        let k = world.kafka_settings();
        tokio::spawn(async move {
            let mut paused_for = Duration::ZERO;
            while !stop.load(Ordering::Relaxed) {
                let lag: i64 = match service::kafka::group_lag(&k, &k.group_for(INDEX_MAIN)).await {
                    Ok(parts) => parts.iter().map(|p| p.lag()).sum(),
                    Err(_) => 0,
                };
                paused.store(lag > LOAD_MAX_LAG, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(200)).await;
                if lag > LOAD_MAX_LAG {
                    paused_for += Duration::from_millis(200);
                }
            }
            paused_for
        })
    };
    {
        let (next, http, wbase) = (next.clone(), http.clone(), wbase.clone());
        let paused = paused.clone();
        closed_loop_until(c, move || {
            let (next, http, wbase, paused) = (next.clone(), http.clone(), wbase.clone(), paused.clone());
            async move {
                while paused.load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let from = next.fetch_add(BATCH as u64, Ordering::Relaxed);
                if from >= n {
                    return Ok(false);
                }
                bag_batch(http, wbase, (from..(from + BATCH as u64).min(n)).collect()).await.map(|_| true)
            }
        })
        .await?;
    }
    let bag_secs = t.elapsed().as_secs_f64();
    watch_stop.store(true, Ordering::Relaxed);
    let paused_secs = watch.await?.as_secs_f64();
    let idx_secs = world.caught_up(INDEX_MAIN, Duration::from_secs(3600)).await?.as_secs_f64();
    report.line(
        "load_bagstore",
        "bagstore: load (batch API)",
        format!("{:.0} entities/s", n as f64 / bag_secs),
        if opts.only_move {
            format!("{bag_secs:.1} s (paused {paused_secs:.1} s for the index); index caught up {idx_secs:.1} s later")
        } else {
            format!(
                "{bag_secs:.1} s (paused {paused_secs:.1} s for the index); index caught up {idx_secs:.1} s later ({})",
                ratio(json_secs, bag_secs)
            )
        },
    );
    if opts.only_move {
        let (h, wb) = (http.clone(), wbase.clone());
        let third =
            moves::move_phase(opts, world, report, move || bag_put(h.clone(), wb.clone(), fresh())).await?;
        for p in [writer, indexer, reader] {
            p.terminate().await;
        }
        let _ = third.stop().await;
        return Ok(());
    }
    if opts.only_writes {
        let (writer, _) = write_phases(opts, world, report, writer).await?;
        for p in [writer, indexer, reader] {
            p.terminate().await;
        }
        return Ok(());
    }

    if !opts.only_backfill {
        query_phases(opts, world, report, &reader).await?;
        if opts.only_reads {
            for p in [writer, indexer, reader] {
                p.terminate().await;
            }
            return Ok(());
        }
    }

    // ---- Adding an index to the N entities while a steady writer writes.
    report.section(&format!(
        "Adding an index on `link` to {n} entities, steady writer at {}/s",
        opts.steady_rate
    ));
    let rate = opts.steady_rate as f64;
    let (h, wb) = (http.clone(), wbase.clone());
    let bag_steady = move || bag_put(h.clone(), wb.clone(), fresh());
    // The unlimited backfill of `index_link`, then the one of `index_paced`
    // whose pace follows the shards' health; each with its CPU-burner
    // control. `index_paced` is dropped after, so the moves later copy what
    // they copied before it existed.
    let (bag_base, base_use, base_secs) = steady_alone(world, rate, d, bag_steady.clone()).await?;
    world.migrate(true).await?;
    let rate_arg = opts.backfill_rate.to_string();
    let unlimited = backfill_beside_writer(
        world,
        INDEX_NEW,
        Backfill { args: &["--rate", &rate_arg], env: &[] },
        (&base_use, base_secs),
        rate,
        d,
        bag_steady.clone(),
    )
    .await?;
    let paced = backfill_beside_writer(
        world,
        INDEX_PACED,
        Backfill { args: &["--rate", "0", "--follow-health"], env: &[] },
        (&base_use, base_secs),
        rate,
        d,
        bag_steady.clone(),
    )
    .await?;
    for index in [INDEX_PACED] {
        let dropped = bagstore_tests::command(bagstore_tests::bagstore_bin())
            .args(["index", "drop", index, "--config"])
            .arg(world.config(true))
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .status()
            .await?;
        ensure!(dropped.success(), "bagstore index drop {index}: {dropped}");
    }
    let nat = native.clone();
    let json_steady = move || {
        let nat = nat.clone();
        let i = fresh();
        async move { json_insert(nat, vec![(entity_id(i), entity(i).to_string())]).await }
    };
    let (json_base, json_during, alter_secs, json_use) = {
        let (base, base_use, base_secs) = steady_alone(world, rate, d, json_steady.clone()).await?;
        let stop = Arc::new(AtomicBool::new(false));
        let before = world.usage().await;
        let steady = tokio::spawn(open_loop(rate, stop.clone(), json_steady.clone()));
        let t = Instant::now();
        // MariaDB cannot add a virtual column and its index in one online
        // ALTER: the column first (instant), then the index without locking.
        let alters = world.native.pools.iter().map(|p| async move {
            sqlx::query(
                "ALTER TABLE docs ADD COLUMN link VARCHAR(200) AS (JSON_VALUE(doc, '$.link')) VIRTUAL",
            )
            .execute(p)
            .await?;
            sqlx::query("ALTER TABLE docs ADD INDEX docs_link (link), ALGORITHM=INPLACE, LOCK=NONE")
                .execute(p)
                .await
        });
        for r in futures::future::join_all(alters).await {
            r.context("ALTER TABLE docs ADD INDEX")?;
        }
        let secs = t.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
        let during = steady.await?;
        let mut during_use = Usage::default();
        during_use.add(&world.usage().await, &before);
        (base, during, secs, [(base_use, base_secs), (during_use, secs)])
    };
    report.line(
        "backfill_bagstore",
        &format!("bagstore: online backfill (cleaner --index, --rate {})", opts.backfill_rate),
        format!("{:.1} s", unlimited.secs),
        format!("{:.0} rows/s", n as f64 / unlimited.secs),
    );
    report.line(
        "alter_json",
        "json: ALTER TABLE … ADD INDEX (both shards at once)",
        format!("{alter_secs:.1} s"),
        format!(
            "{:.0} rows/s; bagstore is {} as fast",
            n as f64 / alter_secs,
            ratio(alter_secs, unlimited.secs)
        ),
    );
    // What MariaDB itself does with the backfill's rows on this machine,
    // unpinned and with no steady writer: the backfill's statements from a
    // plain client.
    let secs = floor::load_index_rows(native.clone(), n, c).await?;
    report.line(
        "floor_backfill_live",
        "floor: the backfill's index rows as INSERTs of 1000, into a live table",
        format!("{:.0} rows/s", n as f64 / secs),
        format!("{secs:.1} s; bagstore's backfill is {} as fast", ratio(secs, unlimited.secs)),
    );
    // The same statements beside the steady writer, as the backfill ran
    // (issue 35's target is against this one): on two cores the writer
    // takes a core's worth of CPU from whatever runs beside it.
    let stop = Arc::new(AtomicBool::new(false));
    let beside_writer = tokio::spawn(open_loop(rate, stop.clone(), bag_steady.clone()));
    let beside = floor::load_index_rows(native.clone(), n, c).await;
    stop.store(true, Ordering::Relaxed);
    let beside_run = beside_writer.await?;
    let beside = beside?;
    report.line(
        "floor_backfill_beside",
        "floor: the same INSERTs beside the steady writer (target: backfill ≥ 0.9×)",
        format!("{:.0} rows/s", n as f64 / beside),
        format!(
            "{beside:.1} s, the writer's p99 {:.2} ms; bagstore's backfill is {} as fast",
            beside_run.latency.p99,
            ratio(beside, unlimited.secs)
        ),
    );
    report.line(
        "backfill_paced",
        "bagstore: online backfill following health (cleaner --index --follow-health)",
        format!("{:.1} s", paced.secs),
        format!("{:.0} rows/s", n as f64 / paced.secs),
    );
    report.run("steady_bagstore_base", "bagstore steady writer, before", &bag_base, "writes/s");
    for (key, what, b) in
        [("", "the backfill", &unlimited), ("_paced", "the backfill following health", &paced)]
    {
        report.run(
            &format!("steady_bagstore_during{key}"),
            &format!("bagstore steady writer, during {what}"),
            &b.during,
            "writes/s",
        );
        report.line(
            &format!("steady_bagstore_ratio{key}"),
            &format!("bagstore writer p99, during {what} / before"),
            ratio(b.during.latency.p99, bag_base.latency.p99),
            String::new(),
        );
        report.run(
            &format!("steady_bagstore_burner{key}"),
            &format!(
                "bagstore steady writer beside a CPU burner of {:.2} cores ({what}'s extra)",
                b.extra_cores
            ),
            &b.burned,
            "writes/s",
        );
        report.line(
            &format!("steady_bagstore_burner_ratio{key}"),
            &format!("bagstore writer p99, beside the burner of {what} / before"),
            ratio(b.burned.latency.p99, bag_base.latency.p99),
            String::new(),
        );
        report.line(
            &format!("steady_bagstore_vs_burner{key}"),
            &format!(
                "bagstore writer p99, during {what} / beside its burner (target ≤ 1.5 following health)"
            ),
            ratio(b.during.latency.p99, b.burned.latency.p99),
            String::new(),
        );
    }
    report.run("steady_json_base", "json steady writer, before", &json_base, "writes/s");
    report.run("steady_json_during", "json steady writer, during the ALTER", &json_during, "writes/s");
    report.line(
        "steady_json_ratio",
        "json writer p99, during / before",
        ratio(json_during.latency.p99, json_base.latency.p99),
        String::new(),
    );
    let phases = [
        ("bagstore steady writer, before", &(base_use, base_secs)),
        ("during the backfill", &unlimited.during_use),
        ("beside the CPU burner", &unlimited.burned_use),
        ("during the backfill following health", &paced.during_use),
        ("beside its CPU burner", &paced.burned_use),
        ("json steady writer, before", &json_use[0]),
        ("during the ALTER", &json_use[1]),
    ];
    for (i, (what, (u, secs))) in phases.into_iter().enumerate() {
        report.line(&format!("build_cpu_{i}"), &format!("CPU, {what}"), String::new(), u.busy(*secs));
    }
    if opts.only_backfill {
        for p in [writer, indexer, reader] {
            p.terminate().await;
        }
        return Ok(());
    }

    // ---- Write throughput, same client concurrency.
    let (writer_now, max_rate) = write_phases(opts, world, report, writer).await?;
    writer = writer_now;
    wbase = Arc::new(writer.url.clone());

    // ---- Index lag at 50% and 90% of the maximum single-put rate.
    report.section(&format!(
        "Index lag, commit → applied (`{INDEX_MAIN}`; max single-put rate {max_rate:.0}/s)"
    ));
    // Then 50% again with the indexers' fetch wait on other brokers (20 ms,
    // `schemas::settings::FETCH_WAIT_MS`; 5 ms on this one), side by side
    // in this run.
    let mut p50s = Vec::new();
    for (share, fetch_wait) in [(0.5, None), (0.9, None), (0.5, Some(FETCH_WAIT_MS))] {
        if let Some(ms) = fetch_wait {
            indexer.terminate().await;
            let ms = ms.to_string();
            indexer = world
                .bagstore_with(
                    &["indexer", "--index", INDEX_MAIN],
                    false,
                    &[("BAGSTORE_INDEXER__FETCH_WAIT_MS", &ms)],
                )
                .await?;
            until_assigned(&http, &indexer).await?;
        }
        let scrape = || async { http.get(format!("{}/metrics", indexer.url)).send().await?.text().await };
        let before = buckets(&scrape().await?, "bagstore_indexer_event_lag_seconds", INDEX_MAIN);
        let stop = Arc::new(AtomicBool::new(false));
        let (h, wb) = (http.clone(), wbase.clone());
        let steady = tokio::spawn(open_loop(max_rate * share, stop.clone(), move || {
            bag_put(h.clone(), wb.clone(), fresh())
        }));
        tokio::time::sleep(d).await;
        stop.store(true, Ordering::Relaxed);
        let w = steady.await?;
        world.caught_up(INDEX_MAIN, Duration::from_secs(600)).await?;
        let after = buckets(&scrape().await?, "bagstore_indexer_event_lag_seconds", INDEX_MAIN);
        let events = after.last().map_or(0.0, |x| x.1) - before.last().map_or(0.0, |x| x.1);
        let (p50, p99, max) =
            (quantile(&before, &after, 0.5), quantile(&before, &after, 0.99), max_bucket(&before, &after));
        let pct = (share * 100.0) as u32;
        let (key, label) = match fetch_wait {
            None => (format!("lag_{pct}"), format!("lag at {pct}% ({:.0} writes/s achieved)", w.rate)),
            Some(ms) => (
                format!("lag_{pct}_fetch_wait_{ms}"),
                format!("lag at {pct}%, indexer fetch.wait.max.ms {ms} ({:.0} writes/s achieved)", w.rate),
            ),
        };
        report.line(
            &key,
            &label,
            format!("p99 {p99:.1} ms"),
            format!(
                "p50 {p50:.1} ms, max ≤ {max:.0} ms, {events:.0} events; write p99 {:.1} ms",
                w.latency.p99
            ),
        );
        report.value(&key, json!({"share": share, "rate": w.rate, "p50_ms": p50, "p99_ms": p99, "max_bucket_ms": max, "events": events}));
        if share == 0.5 {
            p50s.push((p50, p99));
        }
    }
    if let [(now50, now99), (old50, old99)] = p50s[..] {
        report.line(
            "lag_fetch_wait_ratio",
            "lag at 50%: fetch wait 5 ms / 20 ms",
            format!("p50 {}", ratio(now50, old50)),
            format!("p99 {}", ratio(now99, old99)),
        );
    }
    let m = http.get(format!("{}/metrics", indexer.url)).send().await?.text().await?;
    ensure!(
        metric_sum(&m, "bagstore_indexer_events_applied_total", &[]) > 0.0,
        "the indexer applied nothing"
    );

    // ---- Moving a third of the logical shards onto a new physical shard.
    let (h, wb) = (http.clone(), wbase.clone());
    let third =
        moves::move_phase(opts, world, report, move || bag_put(h.clone(), wb.clone(), fresh())).await?;
    writer.terminate().await;
    indexer.terminate().await;
    reader.terminate().await;
    let _ = third.stop().await;
    Ok(())
}

/// The queries ("latest 20 of one user", a compound range) and point
/// gets, bagstore against the JSON table, answers compared first.
async fn query_phases(
    opts: &Options,
    world: &World,
    report: &mut Report,
    reader: &Proc,
) -> anyhow::Result<()> {
    let (n, c, d) = (opts.entities as u64, opts.clients, opts.phase);
    let (native, http, rbase) = (world.native.clone(), world.http.clone(), reader.url.clone());
    // ---- Queries: same answers first, then latency.
    let users: Vec<String> = (0..USERS).map(user_id).collect();
    let span = n as i64 / 4;
    let range_of = move |u: usize| -> (i64, i64) {
        let lo = 1_700_000_000i64 + (u as i64 * 7919) % (n as i64 - span).max(1);
        (lo, lo + span)
    };
    for u in (0..USERS).step_by(USERS / 20) {
        let a = json_latest(&world.native, &users[u], None).await?;
        let b = bag_latest(&http, &rbase, &users[u], None).await?;
        ensure!(a == b, "latest-20 answers differ for user {u}: json {a:?} bagstore {b:?}");
        let r = Some(range_of(u));
        let a = json_latest(&world.native, &users[u], r).await?;
        let b = bag_latest(&http, &rbase, &users[u], r).await?;
        if a != b {
            // What each side's ids hold, as the other side stores them.
            let mut seen = Vec::new();
            for id in a.iter().chain(&b) {
                let got = http.get(format!("{rbase}/v1/entities/{id}")).send().await?.text().await?;
                let q = sqlx::query("SELECT CAST(user_id AS CHAR) AS u, published FROM docs WHERE id = ?")
                    .bind(hex16(id).to_vec());
                let row = world.native.fetch_all(shard_of_hex(id), q).await?.pop();
                let json_side =
                    row.map(|r| (r.try_get::<String, _>("u").ok(), r.try_get::<i64, _>("published").ok()));
                seen.push(format!("{id}: json {json_side:?}; bagstore {got}"));
            }
            bail!(
                "range {r:?} answers differ for user {u} ({}): json {a:?} bagstore {b:?}\n{}",
                users[u],
                seen.join("\n")
            );
        }
    }
    report.section(&format!(
        "Queries ({c} clients, {:.0} s each in {ROUNDS} alternating turns; answers checked equal first)",
        d.as_secs_f64()
    ));
    let pick = Arc::new(AtomicU64::new(0));
    let mut q_cpu: Vec<(String, String)> = Vec::new();
    for (key, what, range) in [
        ("latest20", "latest 20 of one user", false),
        ("range", "compound range (user, published window)", true),
    ] {
        let users_j = Arc::new(users.clone());
        let (p, nat) = (pick.clone(), native.clone());
        let json_op = move || {
            let u = p.fetch_add(1, Ordering::Relaxed) as usize % USERS;
            let (users, nat) = (users_j.clone(), nat.clone());
            async move { json_latest(&nat, &users[u], range.then(|| range_of(u))).await.map(|_| ()) }
        };
        let users_b = Arc::new(users.clone());
        let (p, h, rb) = (pick.clone(), http.clone(), Arc::new(rbase.clone()));
        let bag_op = move || {
            let u = p.fetch_add(1, Ordering::Relaxed) as usize % USERS;
            let (users, h, rb) = (users_b.clone(), h.clone(), rb.clone());
            async move { bag_latest(&h, &rb, &users[u], range.then(|| range_of(u))).await.map(|_| ()) }
        };
        let ((rj, uj), (rbag, ub)) = side_by_side(world, c, d, json_op, bag_op).await;
        q_cpu.push((format!("json: {what}"), uj.per_op(rj.latency.n as f64, "queries")));
        q_cpu.push((format!("bagstore: {what}"), ub.per_op(rbag.latency.n as f64, "queries")));
        report.run(&format!("{key}_json"), &format!("json: {what}"), &rj, "queries/s");
        report.run(&format!("{key}_bagstore"), &format!("bagstore: {what}"), &rbag, "queries/s");
        report.line(
            &format!("{key}_ratio"),
            &format!("{what}: p99 bagstore / json"),
            ratio(rbag.latency.p99, rj.latency.p99),
            format!("p50 {}", ratio(rbag.latency.p50, rj.latency.p50)),
        );
    }
    let (p, nat) = (pick.clone(), native.clone());
    let json_get = move || {
        let i = p.fetch_add(7, Ordering::Relaxed) % n;
        let nat = nat.clone();
        async move {
            let id = entity_id(i);
            let q = sqlx::query("SELECT doc FROM docs WHERE id = ?").bind(hex16(&id).to_vec());
            let row = nat.fetch_all(shard_of_hex(&id), q).await?.pop();
            let doc: Vec<u8> = row.with_context(|| format!("json: {id} missing"))?.try_get("doc")?;
            let _: Value = serde_json::from_slice(&doc)?;
            Ok(())
        }
    };
    let (p, h, rb) = (pick.clone(), http.clone(), Arc::new(rbase.clone()));
    let bag_get = move || {
        let i = p.fetch_add(7, Ordering::Relaxed) % n;
        let (h, rb) = (h.clone(), rb.clone());
        async move {
            let r = h.get(format!("{rb}/v1/entities/{}", entity_id(i))).send().await?;
            ensure!(r.status().is_success(), "get answered {}", r.status());
            let _: Value = r.json().await?;
            Ok(())
        }
    };
    let perf = match &opts.perf_reader {
        Some(file) => Some(Perf::record(reader.pid() as u32, file)?),
        None => None,
    };
    let ((gj, ugj), (gb, ugb)) = side_by_side(world, c, d, json_get, bag_get).await;
    q_cpu.push(("json: point get by id".to_string(), ugj.per_op(gj.latency.n as f64, "gets")));
    q_cpu.push(("bagstore: point get by id".to_string(), ugb.per_op(gb.latency.n as f64, "gets")));
    if let Some(p) = perf {
        p.stop().await?;
    }
    report.run("get_json", "json: point get by id", &gj, "gets/s");
    report.run("get_bagstore", "bagstore: point get by id", &gb, "gets/s");
    report.line(
        "get_ratio",
        "point get: p99 bagstore / json",
        ratio(gb.latency.p99, gj.latency.p99),
        format!("p50 {}", ratio(gb.latency.p50, gj.latency.p50)),
    );

    for (i, (what, line)) in q_cpu.iter().enumerate() {
        report.line(&format!("qcpu_{i}"), &format!("CPU, {what}"), String::new(), line.clone());
    }
    Ok(())
}

/// The write phases, pinned (see `ProcSampler::pin_for_writes`): raw,
/// json and bagstore, single and batch, then bagstore's again with the
/// change stream off; then what each cost MariaDB per entity (issue 20's
/// first target). Restarts bagstore's writer on the way (the runs with the
/// stream off need their own); returns the new one and bagstore's maximum
/// single-put rate.
async fn write_phases(
    opts: &Options,
    world: &World,
    report: &mut Report,
    mut writer: Proc,
) -> anyhow::Result<(Proc, f64)> {
    let (c, d) = (opts.clients, opts.phase);
    let native = world.native.clone();
    let http = world.http.clone();
    let wbase = Arc::new(writer.url.clone());
    report.section(&format!("Writes ({c} clients, {:.0} s each, new ids)", d.as_secs_f64()));
    let mut cpu_lines = Vec::new();
    // MariaDB's work per entity for each contender (issue 20): bagstore's
    // measured until its indexes caught up, so the deferred work (the
    // relay's outbox deletes, the index rows) counts too.
    let mut mysql_lines: Vec<(&str, Usage, f64)> = Vec::new();
    let pinning = world.procs.pin_for_writes(true)?;
    let mut cpu0 = world.usage().await;
    let secs = d.as_secs_f64();
    let one_raw = {
        let nat = native.clone();
        closed_loop(c, d, 1, move || {
            let nat = nat.clone();
            let i = fresh();
            async move { raw_insert(nat, vec![(entity_id(i), body_of(i))]).await }
        })
        .await
    };
    let spent = world.spent_since(&mut cpu0).await;
    cpu_lines.push(("raw single".to_string(), spent.per_op(one_raw.rate * secs, "rows")));
    mysql_lines.push(("raw single", spent, one_raw.rate * secs));
    let batch_raw = {
        let nat = native.clone();
        closed_loop(c, d, BATCH, move || {
            let nat = nat.clone();
            let items: Vec<(String, Vec<u8>)> =
                (0..BATCH).map(|_| fresh()).map(|i| (entity_id(i), body_of(i))).collect();
            async move { raw_insert(nat, items).await }
        })
        .await
    };
    let spent = world.spent_since(&mut cpu0).await;
    cpu_lines.push(("raw batch".to_string(), spent.per_op(batch_raw.rate * secs, "rows")));
    mysql_lines.push(("raw batch", spent, batch_raw.rate * secs));
    let one_json = {
        let nat = native.clone();
        closed_loop(c, d, 1, move || {
            let nat = nat.clone();
            let i = fresh();
            async move { json_insert(nat, vec![(entity_id(i), entity(i).to_string())]).await }
        })
        .await
    };
    let spent = world.spent_since(&mut cpu0).await;
    cpu_lines.push(("json single".to_string(), spent.per_op(one_json.rate * secs, "rows")));
    mysql_lines.push(("json single", spent, one_json.rate * secs));
    let batch_json = {
        let nat = native.clone();
        closed_loop(c, d, BATCH, move || {
            let nat = nat.clone();
            let items: Vec<(String, String)> =
                (0..BATCH).map(|_| fresh()).map(|i| (entity_id(i), entity(i).to_string())).collect();
            async move { json_insert(nat, items).await }
        })
        .await
    };
    let spent = world.spent_since(&mut cpu0).await;
    cpu_lines.push(("json batch".to_string(), spent.per_op(batch_json.rate * secs, "rows")));
    mysql_lines.push(("json batch", spent, batch_json.rate * secs));
    // The design's floors (see `floor`): its rows, without and then with
    // the reads that open bagstore's write transactions; each measured
    // until its deferred rows are written.
    let mut floors = Vec::new();
    for (what, kind, rows) in [
        ("floor capture single", floor::Floor::Capture, 1),
        ("floor capture batch", floor::Floor::Capture, BATCH),
        ("floor outbox single", floor::Floor::Outbox, 1),
        ("floor outbox batch", floor::Floor::Outbox, BATCH),
        ("floor reads single", floor::Floor::Reads, 1),
        ("floor reads batch", floor::Floor::Reads, BATCH),
    ] {
        let readers = if kind.streams_binlog() {
            let ports: Vec<u16> = world.servers.iter().map(|s| s.port()).collect();
            Some(floor::BinlogReaders::start(&native, &ports, world.dir.path(), &off_server_cores()).await?)
        } else {
            None
        };
        let deferred = Arc::new(floor::Deferred::start(native.clone(), kind));
        let run = {
            let (nat, def) = (native.clone(), deferred.clone());
            closed_loop(c, d, rows, move || {
                let (nat, def) = (nat.clone(), def.clone());
                let items: Vec<u64> = (0..rows).map(|_| fresh()).collect();
                async move { floor::write(nat, &def, kind, items).await }
            })
            .await
        };
        Arc::into_inner(deferred).context("the floor's clients are done")?.finish().await?;
        if let Some(r) = readers {
            r.stop()?;
        }
        let spent = world.spent_since(&mut cpu0).await;
        cpu_lines.push((
            format!("{what} (until its deferred rows were written)"),
            spent.per_op(run.rate * secs, "rows"),
        ));
        mysql_lines.push((what, spent, run.rate * secs));
        floors.push((what, run));
    }
    let one_bag = {
        let (h, wb) = (http.clone(), wbase.clone());
        closed_loop(c, d, 1, move || bag_put(h.clone(), wb.clone(), fresh())).await
    };
    world.caught_up(INDEX_MAIN, Duration::from_secs(3600)).await?;
    let spent = world.spent_since(&mut cpu0).await;
    cpu_lines.push((
        "bagstore single (until the index caught up)".to_string(),
        spent.per_op(one_bag.rate * secs, "rows"),
    ));
    mysql_lines.push(("bagstore single", spent, one_bag.rate * secs));
    let batch_bag = {
        let (h, wb) = (http.clone(), wbase.clone());
        closed_loop(c, d, BATCH, move || {
            bag_batch(h.clone(), wb.clone(), (0..BATCH).map(|_| fresh()).collect())
        })
        .await
    };
    world.caught_up(INDEX_MAIN, Duration::from_secs(3600)).await?;
    let spent = world.spent_since(&mut cpu0).await;
    cpu_lines.push((
        "bagstore batch (until the index caught up)".to_string(),
        spent.per_op(batch_bag.rate * secs, "rows"),
    ));
    mysql_lines.push(("bagstore batch", spent, batch_bag.rate * secs));
    // The same two runs with the public change stream off: what the stream
    // costs per write (the relay's second message per row, its JSON).
    // Only one writer at a time, so the relay that publishes these rows is
    // this one's.
    writer.terminate().await;
    let quiet = world.bagstore_with(&["writer"], false, &[("BAGSTORE_CHANGES__ENABLED", "false")]).await?;
    world.procs.pin_for_writes(true)?;
    let qbase = Arc::new(quiet.url.clone());
    world.caught_up(INDEX_MAIN, Duration::from_secs(3600)).await?;
    let mut cpu0 = world.usage().await;
    let one_quiet = {
        let (h, wb) = (http.clone(), qbase.clone());
        closed_loop(c, d, 1, move || bag_put(h.clone(), wb.clone(), fresh())).await
    };
    world.caught_up(INDEX_MAIN, Duration::from_secs(3600)).await?;
    cpu_lines.push((
        "bagstore single, change stream off (until the index caught up)".to_string(),
        world.usage_step(&mut cpu0, one_quiet.rate * secs, "rows").await,
    ));
    let batch_quiet = {
        let (h, wb) = (http.clone(), qbase.clone());
        closed_loop(c, d, BATCH, move || {
            bag_batch(h.clone(), wb.clone(), (0..BATCH).map(|_| fresh()).collect())
        })
        .await
    };
    world.caught_up(INDEX_MAIN, Duration::from_secs(3600)).await?;
    cpu_lines.push((
        "bagstore batch, change stream off (until the index caught up)".to_string(),
        world.usage_step(&mut cpu0, batch_quiet.rate * secs, "rows").await,
    ));
    quiet.terminate().await;
    world.procs.pin_for_writes(false)?;
    writer = world.bagstore(&["writer"], false).await?;
    report.run("put_raw", "raw: single-row INSERT (autocommit)", &one_raw, "rows/s");
    report.run("put_json", "json: single-row INSERT", &one_json, "rows/s");
    report.run("put_bagstore", "bagstore: PUT /v1/entities/{id}", &one_bag, "rows/s");
    report.line(
        "put_ratio",
        "single: bagstore / raw (target ≥ 0.6)",
        ratio(one_bag.rate, one_raw.rate),
        format!("bagstore / json {}", ratio(one_bag.rate, one_json.rate)),
    );
    report.run(
        "batch_raw",
        &format!("raw: INSERT of {BATCH} rows (one statement per shard)"),
        &batch_raw,
        "rows/s",
    );
    report.run(
        "batch_json",
        &format!("json: INSERT of {BATCH} rows (one statement per shard)"),
        &batch_json,
        "rows/s",
    );
    report.run(
        "batch_bagstore",
        &format!("bagstore: POST /v1/entities/batch of {BATCH}"),
        &batch_bag,
        "rows/s",
    );
    report.line(
        "batch_ratio",
        "batch: bagstore / raw (target ≥ 0.8)",
        ratio(batch_bag.rate, batch_raw.rate),
        format!("bagstore / json {}", ratio(batch_bag.rate, batch_json.rate)),
    );
    report.run("put_bagstore_nostream", "bagstore: PUT, change stream off", &one_quiet, "rows/s");
    report.run("batch_bagstore_nostream", "bagstore: batch, change stream off", &batch_quiet, "rows/s");
    for (what, run) in &floors {
        report.run(&what.replace(' ', "_"), &format!("{what} (see `bench/src/floor.rs`)"), run, "rows/s");
    }
    report.line(
        "stream_cost",
        "change stream on / off, throughput",
        format!("single {}", ratio(one_bag.rate, one_quiet.rate)),
        format!(
            "batch {}; p99 single {} batch {}",
            ratio(batch_bag.rate, batch_quiet.rate),
            ratio(one_bag.latency.p99, one_quiet.latency.p99),
            ratio(batch_bag.latency.p99, batch_quiet.latency.p99)
        ),
    );

    report.section("Where the CPU went during the write phases (processes grouped; both cores = 2 s per s)");
    for (i, (what, line)) in cpu_lines.iter().enumerate() {
        report.line(&format!("cpu_{i}"), what, String::new(), line.clone());
    }

    // ---- MariaDB's cost per entity written (issue 20's first target).
    report.section(&format!("MariaDB's work per entity written (binary log on, sync_binlog=1; {})", pinning));
    for (what, u, rows) in &mysql_lines {
        let key = format!("mysql_{}", what.replace(' ', "_"));
        report.line(&key, &format!("MariaDB, {what}"), String::new(), u.mysql_per_entity(*rows));
        report.value(
            &key,
            json!({"rows": rows, "mariadbd_cpu_s_per_1000": u.mariadbd_ticks() as f64 / 100.0 / rows.max(1.0) * 1000.0,
                   "statements": u.statements, "row_writes": u.row_writes, "innodb_fsyncs": u.fsyncs, "binlog_fsyncs": u.binlog_syncs,
                   "binlog_bytes": u.binlog_bytes, "statement_kinds": u.kinds}),
        );
    }
    let per = |what: &str| {
        mysql_lines
            .iter()
            .find(|(w, _, _)| *w == what)
            .map(|(_, u, rows)| u.mariadbd_ticks() as f64 / rows.max(1.0))
            .unwrap_or(0.0)
    };
    report.line(
        "mysql_cpu_ratio",
        "mariadbd CPU per entity: bagstore / raw (target ≤ 1.5)",
        format!("single {}", ratio(per("bagstore single"), per("raw single"))),
        format!("batch {}", ratio(per("bagstore batch"), per("raw batch"))),
    );
    // Against what a user would pick instead (issue 35): the JSON table
    // with the same index, its generated columns and secondary index.
    report.line(
        "mysql_cpu_json_ratio",
        "mariadbd CPU per entity: bagstore / json (target ≤ 2.0 single, ≤ 2.5 batch)",
        format!("single {}", ratio(per("bagstore single"), per("json single"))),
        format!("batch {}", ratio(per("bagstore batch"), per("json batch"))),
    );
    // What the design's rows cost (the floors against raw), and what
    // bagstore adds to them (bagstore against the floor of its design).
    for (key, what, over, under) in [
        (
            "mysql_floor_capture_ratio",
            "mariadbd CPU per entity: floor with capture (entity + index row) / raw",
            "floor capture",
            "raw",
        ),
        (
            "mysql_floor_outbox_ratio",
            "mariadbd CPU per entity: floor with an outbox / raw",
            "floor outbox",
            "raw",
        ),
        (
            "mysql_over_floor_ratio",
            "mariadbd CPU per entity: bagstore / floor with an outbox",
            "bagstore",
            "floor outbox",
        ),
        // The design's rows against what a user picks instead (issue 35).
        (
            "mysql_floor_outbox_json_ratio",
            "mariadbd CPU per entity: floor with an outbox / json",
            "floor outbox",
            "json",
        ),
        // The same with the reads that open each of bagstore's write
        // transactions: the design's floor whole, and what bagstore's
        // implementation adds to it.
        (
            "mysql_floor_reads_json_ratio",
            "mariadbd CPU per entity: floor with an outbox and the write's reads / json",
            "floor reads",
            "json",
        ),
        (
            "mysql_over_floor_reads_ratio",
            "mariadbd CPU per entity: bagstore / floor with an outbox and the write's reads",
            "bagstore",
            "floor reads",
        ),
    ] {
        report.line(
            key,
            what,
            format!("single {}", ratio(per(&format!("{over} single")), per(&format!("{under} single")))),
            format!("batch {}", ratio(per(&format!("{over} batch")), per(&format!("{under} batch")))),
        );
    }

    Ok((writer, one_bag.rate))
}

/// `perf record` of one process (`--perf-reader`): CPU-clock samples with
/// DWARF call graphs, so release code without frame pointers unwinds;
/// `scripts/flamegraph` draws them.
struct Perf {
    child: tokio::process::Child,
}

impl Perf {
    fn record(pid: u32, file: &Path) -> anyhow::Result<Perf> {
        let child = tokio::process::Command::new("perf")
            .args(["record", "-e", "cpu-clock", "-F", "199", "--call-graph", "dwarf,16384", "-p"])
            .arg(pid.to_string())
            .arg("-o")
            .arg(file)
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("perf record (Debian's linux-perf)")?;
        Ok(Perf { child })
    }

    /// Stops the recording as Ctrl-C would, so perf writes its file out.
    async fn stop(mut self) -> anyhow::Result<()> {
        let pid = self.child.id().context("perf exited early")?;
        let sent = tokio::process::Command::new("kill").args(["-INT", &pid.to_string()]).status().await?;
        ensure!(sent.success(), "kill -INT {pid}: {sent}");
        let status = self.child.wait().await?;
        // perf ends on the SIGINT itself, or exits 0 or 130 after it.
        use std::os::unix::process::ExitStatusExt;
        let stopped = status.success() || status.code() == Some(130) || status.signal() == Some(libc::SIGINT);
        ensure!(stopped, "perf record: {status}");
        Ok(())
    }
}

/// Waits until `indexer` holds every partition of the change topic.
async fn until_assigned(http: &reqwest::Client, indexer: &Proc) -> anyhow::Result<()> {
    let since = Instant::now();
    loop {
        let m = http.get(format!("{}/metrics", indexer.url)).send().await?.text().await?;
        if metric_sum(&m, "bagstore_indexer_assigned_partitions", &[]) >= PARTITIONS as f64 {
            return Ok(());
        }
        ensure!(since.elapsed() < Duration::from_secs(60), "the indexer got no partitions within 60 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Like [`closed_loop`], until `op` says there is nothing left (Ok(false)).
async fn closed_loop_until<F, Fut>(clients: usize, op: F) -> anyhow::Result<u64>
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = anyhow::Result<bool>> + Send,
{
    let op = Arc::new(op);
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let op = op.clone();
        tasks.push(tokio::spawn(async move {
            let mut done = 0u64;
            while op().await? {
                done += 1;
            }
            Ok::<_, anyhow::Error>(done)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    if total == 0 {
        bail!("nothing was loaded");
    }
    Ok(total)
}
