//! The chaos suite: a seeded, randomized, concurrent history against a full
//! bagstore (two writers, two indexers, a reader and a continuously
//! sweeping cleaner, each a separate `bagstore` process) while faults are
//! injected, checked against DESIGN's invariants W, I and R.
//!
//! Written once, run as a matrix (`tests/tests/chaos.rs`): librdkafka's
//! mock cluster (fault: broker down/up), a standalone `tansu` process
//! (fault: `kill -9` and restart with its data), and the mock cluster with
//! a replica per shard (faults: failovers too).
//!
//! Faults ([`Fault`]), one at a time, in a seeded order, each healed before
//! the next: `kill -9` of an indexer then a restart under its member name;
//! `kill -9` of a writer (relay leadership must move to the other writer)
//! then a restart; a broker outage; MySQL connections of the stack killed
//! with `KILL <id>` from a separate session; online moves of logical
//! shards, some killed mid-copy or mid-cutover and resumed (these run in
//! the background, so the next faults land during them); with a replica
//! per shard (the `failover` combination, on servers of its own),
//! `kill -9` of a shard's primary, the metadata shard's included, failed
//! over by the cleaners' coordinator, the dead server restarted as a
//! replica and taken back.
//!
//! Half the clients' plain puts carry an `Idempotency-Key` and are sent
//! again with it while their outcome is unknown (a 5xx, a lost
//! connection).
//!
//! Checked while it runs:
//! - Invariant R: every item of every successful query satisfies the
//!   query's conditions ([`model::matches`], a reference evaluator).
//! - Every acknowledged write is readable by id with at least its version
//!   (a 404 must be a tombstone of a later delete, checked in MySQL).
//!
//! Checked at the end, after the load stops and every fault is healed:
//! 1. with the cleaner stopped and the pipeline caught up (lag 0), every
//!    index table equals the rows computed from the final entities: the
//!    indexers alone lost and leaked nothing (Invariant I without help);
//! 2. the same after the cleaner ran again (it must not break anything);
//! 3. every acknowledged write is in the store (version ≥ acknowledged), or
//!    its entity was deleted later and the tombstone purged;
//! 4. per entity, the topic holds every committed version, first seen in
//!    version order (Invariant W; a version may jump after a delete whose
//!    tombstone was purged, as far as the logical shard's version floor),
//!    no version twice with different contents, and none above the
//!    stored one; each keyed put is on the topic at most once, at the
//!    version it was answered with;
//! 5. the expiring client's entities: expired ones invisible to every read,
//!    deleted (a tombstone one version up, or purged) and out of every
//!    index; the others visible as last written (see `expiry.rs`).
//!
//! Every process runs with expiry on and tombstones purged 2 s after the
//! delete (`expiry::CONFIG_TOML`).
//!
//! A failure prints the seed, the fault timeline and the history of the
//! entities involved. `BAGSTORE_TEST_SEED=<n>` replays the same random
//! choices (timing is real, so interleavings differ);
//! `BAGSTORE_CHAOS_FAULTS=<n>` sets faults per kind;
//! `BAGSTORE_CHAOS_SOAK_SECS=<s>` keeps injecting until that long has passed.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::model::{self, STANDARD_TABLES};
use crate::{eventually, metric_sum, Proc, TestEnv};

/// Partitions of the test topic (see [`TestEnv::config_toml`]).
const PARTITIONS: i32 = 4;

/// One kind of injected fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fault {
    /// `kill -9` one of the two indexers, restart it, wait for the group to
    /// own every partition again.
    IndexerKill,
    /// `kill -9` one of the two writers; the other must lead every shard's
    /// relay; restart it.
    WriterKill,
    /// Mock cluster: the broker goes down for 1–3 s.
    BrokerOutage,
    /// tansu: `kill -9` the broker process, restart it on its data.
    BrokerKill,
    /// `KILL <id>` of up to three of the stack's MySQL connections on one shard.
    MysqlKill,
    /// An online move of logical shards (`bagstore shards …` in the
    /// background while the next faults land): in turn a rebalance onto
    /// the shard added at the start, a move killed mid-copy then resumed,
    /// a move killed mid-cutover then resumed, a plain move.
    Move,
    /// With a replica per shard: `kill -9` of a shard's primary (the
    /// metadata shard's too), the cleaners' coordinator fails it over, the
    /// dead server is restarted where it was, as a replica, and taken back.
    Failover,
}

/// What one run does; see the module docs for the environment overrides.
#[derive(Debug, Clone)]
pub struct ChaosConfig {
    pub seed: u64,
    pub faults: Vec<Fault>,
    pub faults_per_kind: usize,
    /// Keep injecting (cycling the schedule) until this much time passed.
    pub soak: Duration,
    /// Concurrent writing clients.
    pub clients: usize,
    /// Entity ids the clients write (a small key space means contention).
    pub keys: usize,
    /// Replicas per physical shard (see `matrix::Combination::replicas`).
    pub replicas: u32,
}

impl ChaosConfig {
    pub fn from_env(faults: &[Fault], default_per_kind: usize) -> ChaosConfig {
        let var = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
        ChaosConfig {
            seed: var("BAGSTORE_TEST_SEED").unwrap_or(20261122),
            faults: faults.to_vec(),
            faults_per_kind: var("BAGSTORE_CHAOS_FAULTS").map_or(default_per_kind, |n| n as usize),
            soak: Duration::from_secs(var("BAGSTORE_CHAOS_SOAK_SECS").unwrap_or(0)),
            clients: 4,
            keys: 40,
            replicas: 0,
        }
    }
}

fn entity_id(k: usize) -> String {
    format!("{:032x}", 0xc4a0_5000_0000u64 + k as u64)
}

/// How a write ended, as the client saw it.
#[derive(Debug, Clone)]
enum Outcome {
    /// 200/201: committed at this version.
    Acked(u64),
    /// 404 (delete of an absent entity) or 412 (precondition): nothing written.
    Rejected(u16),
    /// A 5xx, a timeout or a dropped connection: it may or may not have committed.
    Unknown(String),
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Acked(v) => write!(f, "acknowledged v{v}"),
            Outcome::Rejected(s) => write!(f, "rejected {s}"),
            Outcome::Unknown(why) => write!(f, "unknown ({why})"),
        }
    }
}

#[derive(Debug, Clone)]
struct OpRecord {
    at_ms: u128,
    client: usize,
    id: String,
    what: String,
    outcome: Outcome,
}

#[derive(Debug, Clone)]
struct FaultRecord {
    at_ms: u128,
    fault: Fault,
    detail: String,
}

#[derive(Debug, Default)]
struct Counters {
    acked: AtomicU64,
    rejected: AtomicU64,
    unknown: AtomicU64,
    queries_checked: AtomicU64,
    query_items_checked: AtomicU64,
    queries_unavailable: AtomicU64,
    gets_checked: AtomicU64,
    gets_unavailable: AtomicU64,
    max_lag_events: AtomicU64,
    max_lag_ms: AtomicU64,
    /// Rebalances after which two indexers kept claiming the same
    /// partitions (see `until_group_owns_everything`).
    overlaps: AtomicU64,
    /// 404s of the shared keys explained by a purged tombstone (the
    /// logical shard's version floor covers the acknowledged version).
    gets_purged: AtomicU64,
    /// The expiring client's.
    exp: ExpCounters,
    /// The unique-key competitors'.
    unique: UniqueCounters,
}

/// State the clients, the checker and the fault injector share.
#[derive(Debug)]
struct Shared {
    started: Instant,
    stop: AtomicBool,
    /// While set, the writing clients start no new request: a fault wants
    /// the indexers idle (see the stalled `IndexerKill`).
    paused: AtomicBool,
    /// One slot per writer process; `None` while it is dead.
    writers: RwLock<Vec<Option<String>>>,
    /// Each physical shard's primary (its DSN), as the last failover left
    /// them: the checker's direct reads follow it.
    primaries: RwLock<Vec<String>>,
    reader: String,
    ops: Mutex<Vec<OpRecord>>,
    /// Entity id → highest acknowledged version.
    max_acked: Mutex<HashMap<String, u64>>,
    /// The keyed puts (see `load::keyed_put`).
    keyed: Mutex<Vec<Keyed>>,
    /// Ids of entities created outside the shared key space (whatever the outcome).
    created: Mutex<Vec<String>>,
    /// The expiring client's model, per id ([`exp_id`]).
    expiring: Mutex<Vec<ExpEntity>>,
    failures: Mutex<Vec<String>>,
    counters: Counters,
    http: reqwest::Client,
}

impl Shared {
    fn ms(&self) -> u128 {
        self.started.elapsed().as_millis()
    }

    fn fail(&self, what: String) {
        eprintln!("CHAOS CHECK FAILED at {} ms: {what}", self.ms());
        self.failures.lock().unwrap().push(what);
    }

    fn record(&self, client: usize, id: &str, what: String, outcome: Outcome) {
        let c = &self.counters;
        match &outcome {
            Outcome::Acked(v) => {
                c.acked.fetch_add(1, Ordering::Relaxed);
                let mut m = self.max_acked.lock().unwrap();
                let e = m.entry(id.to_string()).or_insert(0);
                *e = (*e).max(*v);
            }
            Outcome::Rejected(_) => {
                c.rejected.fetch_add(1, Ordering::Relaxed);
            }
            Outcome::Unknown(_) => {
                c.unknown.fetch_add(1, Ordering::Relaxed);
            }
        }
        let rec = OpRecord { at_ms: self.ms(), client, id: id.to_string(), what, outcome };
        self.ops.lock().unwrap().push(rec);
    }

    fn live_writer(&self, rng: &mut StdRng) -> Option<String> {
        let w = self.writers.read().unwrap();
        let live: Vec<&String> = w.iter().flatten().collect();
        (!live.is_empty()).then(|| live[rng.random_range(0..live.len())].clone())
    }

    /// A writing client's next turn: waits while the load is paused or no
    /// writer is up; a live writer's base URL, or `None` once the load stops.
    async fn next_turn(&self, rng: &mut StdRng) -> Option<String> {
        while !self.stop.load(Ordering::Relaxed) {
            if self.paused.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
            match self.live_writer(rng) {
                Some(base) => return Some(base),
                None => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
        None
    }

    /// Sends a request; `Err` for transport failures (refused, reset, timeout).
    async fn send(&self, req: reqwest::RequestBuilder) -> Result<(u16, Value), String> {
        let resp = req.timeout(Duration::from_secs(15)).send().await.map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        let text = resp.text().await.map_err(|e| e.to_string())?;
        Ok((status, serde_json::from_str(&text).unwrap_or(Value::Null)))
    }
}

mod expiry;
mod faults;
mod load;
pub mod matrix;
mod report;
mod unique;

use expiry::*;
use faults::*;
use load::*;
use unique::*;

/// Runs the suite; panics (after printing the seed, the fault timeline and
/// the history of the entities involved) if any check failed.
pub async fn run(env: &mut TestEnv, cfg: ChaosConfig) {
    let kind = if env.kafka.tansu().is_some() { "tansu" } else { "mock" };
    eprintln!(
        "chaos ({kind}) seed {} (replay with BAGSTORE_TEST_SEED={}), {} faults per kind",
        cfg.seed, cfg.seed, cfg.faults_per_kind
    );
    // Expiry on, tombstones purged 2 s after the delete: for every process.
    env.indexes_toml.push_str(CONFIG_TOML);
    env.indexes_toml.push_str(UNIQUE_TOML);
    // With moves, a third shard, owning nothing until the first move
    // fault rebalances onto it during the load.
    let shards = if cfg.faults.contains(&Fault::Move) { 3 } else { 2 };
    let cluster = if cfg.replicas > 0 {
        Some(crate::replicated::Cluster::start(env, shards, cfg.replicas).await)
    } else {
        env.migrate().await;
        if shards == 3 {
            let dsn = env.extra_dsn(env.dsns.len());
            let (ok, out, err) = env.run(&env.args(&["shards", "add", "s2", &dsn]), &[]).await;
            assert!(ok, "shards add: {out}{err}");
            env.dsns.push(dsn);
        }
        None
    };
    let mut stack = Stack {
        writers: vec![Some(env.spawn(&["writer"]).await), Some(env.spawn(&["writer"]).await)],
        indexers: vec![Some(faults::indexer(env, 0).await), Some(faults::indexer(env, 1).await)],
        reader: env.spawn(&["reader"]).await,
        cleaner: Some(env.spawn_env(&["cleaner"], &cleaner_env(cluster.is_some())).await),
        mover: None,
        moves: MoveLog::default(),
    };
    let first = until_group_owns_everything(env, &stack.indexers).await;
    assert_eq!(first, None, "two fresh indexers claimed the same partitions");

    let shared = Arc::new(Shared {
        started: Instant::now(),
        stop: AtomicBool::new(false),
        paused: AtomicBool::new(false),
        writers: RwLock::new(stack.writers.iter().map(|w| w.as_ref().map(|p| p.url.clone())).collect()),
        primaries: RwLock::new(env.dsns.clone()),
        reader: stack.reader.url.clone(),
        ops: Mutex::new(Vec::new()),
        max_acked: Mutex::new(HashMap::new()),
        keyed: Mutex::new(Vec::new()),
        created: Mutex::new(Vec::new()),
        expiring: Mutex::new(vec![ExpEntity::default(); EXP_KEYS]),
        failures: Mutex::new(Vec::new()),
        counters: Counters::default(),
        http: reqwest::Client::new(),
    });
    let cleaner_url = Arc::new(RwLock::new(stack.cleaner.as_ref().unwrap().url.clone()));
    let mut tasks = Vec::new();
    for n in 0..cfg.clients {
        tasks.push(tokio::spawn(client(shared.clone(), n, cfg.seed, cfg.keys)));
    }
    tasks.push(tokio::spawn(expiring_client(shared.clone(), cfg.seed)));
    tasks.push(tokio::spawn(unique_client(shared.clone(), cfg.seed)));
    tasks.push(tokio::spawn(checker(shared.clone(), cfg.seed, cfg.keys)));
    tasks.push(tokio::spawn(monitor(shared.clone(), env.kafka_settings(), cleaner_url.clone())));

    // The fault schedule: every kind `faults_per_kind` times, in a seeded order.
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let mut servers = Servers::connect(env, cluster).await;
    let mut timeline: Vec<FaultRecord> = Vec::new();
    let mut per_kind: BTreeMap<Fault, usize> = BTreeMap::new();
    let t0 = Instant::now();
    loop {
        let mut schedule: Vec<Fault> =
            cfg.faults.iter().flat_map(|f| std::iter::repeat_n(*f, cfg.faults_per_kind)).collect();
        schedule.shuffle(&mut rng);
        for fault in schedule {
            tokio::time::sleep(Duration::from_millis(rng.random_range(500..2000))).await;
            check_broker(env).await;
            let at_ms = shared.ms();
            let detail = inject(fault, env, &mut stack, &shared, &mut rng, &mut servers, cfg.keys).await;
            eprintln!("chaos fault at {at_ms} ms: {fault:?}: {detail}");
            timeline.push(FaultRecord { at_ms, fault, detail });
            *per_kind.entry(fault).or_default() += 1;
        }
        if t0.elapsed() >= cfg.soak {
            break;
        }
    }
    // Moves still running finish under load.
    finish_moves(env, &mut stack, &shared).await;
    // A little load after the last fault, then stop.
    tokio::time::sleep(Duration::from_secs(2)).await;
    check_broker(env).await;
    shared.stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.expect("a chaos task panicked");
    }
    let load_secs = shared.started.elapsed().as_secs_f64();
    // Every expiry the expiring client left passes, and the cleaner that
    // ran during the load deletes those entities.
    let exp_fin = exp_final(&shared);
    let exp_delete_wait = until_expired_are_deleted(env, &exp_fin).await;

    // End checks, stage 1: the indexers alone. The cleaner that swept
    // during the load must have found no drift: with a lossless pipeline
    // everything it saw missing or left over was lag, which it must tell
    // apart (a lossy indexer shows up here, even though the cleaner then
    // repaired its damage).
    let load_cleaner = stack.cleaner.take().expect("cleaner");
    let m = load_cleaner.api().metrics().await;
    let load_drift: Vec<String> = STANDARD_TABLES
        .iter()
        .flat_map(|t| ["missing", "dangling"].map(|k| (*t, k)))
        .filter_map(|(t, k)| {
            let n = metric_sum(&m, "bagstore_cleaner_drift_found_total", &[("index", t), ("kind", k)]);
            // Fixed: rows the cleaner wrote or deleted (a missing row's
            // repair may then be undone as overtaken by a newer write).
            let f = metric_sum(&m, "bagstore_cleaner_drift_fixed_total", &[("index", t), ("kind", k)]);
            (n > 0.0).then(|| format!("{t} {k} {n} (fixed {f})"))
        })
        .collect();
    if !load_drift.is_empty() {
        shared.fail(format!("the cleaner found drift during the load: {}", load_drift.join(", ")));
    }
    let swept = metric_sum(&m, "bagstore_cleaner_sweeps_total", &[]);
    let mut expired_total = metric_sum(&m, "bagstore_cleaner_expired_total", &[]);
    let mut purged_total = metric_sum(&m, "bagstore_cleaner_tombstones_purged_total", &[]);
    let cleaner_code = load_cleaner.terminate().await;
    if cleaner_code != Some(0) {
        shared.fail(format!("the cleaner exited with {cleaner_code:?} on SIGTERM"));
    }
    check_broker(env).await;
    env.until_caught_up(&STANDARD_TABLES).await;
    let entities = final_entities(&shared, cfg.keys).await;
    let want = model::expected_rows(&entities, &model::Placement::load(env).await);
    for d in model::row_differences(&want, &model::actual_rows(env).await) {
        // With the entity's rows in that index as stored (shard:version).
        let table = d.split(':').next().unwrap_or_default();
        let id = d.rsplit('"').nth(1).unwrap_or_default();
        let versions = model::row_versions(env, table, id).await;
        shared.fail(format!("after catch-up, cleaner stopped: {d}; its rows there: {versions}"));
    }
    let exp_sum = check_expiring(&shared, env, &exp_fin).await;

    // Stage 2: a cleaner sweeps again and must leave the tables exact.
    let cleaner = env.spawn_env(&["cleaner"], &cleaner_env(servers.cluster.is_some())).await;
    let sweeps =
        || async { metric_sum(&cleaner.api().metrics().await, "bagstore_cleaner_sweeps_total", &[]) };
    let s0 = sweeps().await;
    eventually("two cleaner sweeps", Duration::from_secs(60), || async {
        (sweeps().await >= s0 + 2.0).then_some(())
    })
    .await;
    let m = cleaner.api().metrics().await;
    let drift = metric_sum(&m, "bagstore_cleaner_drift_found_total", &[]);
    expired_total += metric_sum(&m, "bagstore_cleaner_expired_total", &[]);
    purged_total += metric_sum(&m, "bagstore_cleaner_tombstones_purged_total", &[]);
    for d in model::row_differences(&want, &model::actual_rows(env).await) {
        shared.fail(format!("after a cleaner sweep: {d}"));
    }
    let rows: usize = want.values().map(BTreeSet::len).sum();
    let handles = check_unique(&shared, env).await;

    // Invariant W: acknowledged writes are stored (or were deleted later,
    // and the tombstone purged); the topic has every version in order.
    let stored = model::stored_versions(env).await;
    let brokers = env.brokers();
    let topic = env.topic.clone();
    let events = tokio::task::spawn_blocking(move || model::read_topic(&brokers, &topic, PARTITIONS))
        .await
        .expect("topic read");
    // After `stored`: a row purged since has its floor raised already.
    let floors = version_floors(env).await;
    let newest = newest_on_topic(&events);
    let mut purged_ids = 0;
    for (id, v) in shared.max_acked.lock().unwrap().iter() {
        match (stored.get(id), newest.get(id)) {
            (Some(have), _) if have >= v => {}
            (None, Some((last, schemas::event::Op::Delete))) if last >= v => purged_ids += 1,
            (have, last) => shared.fail(format!(
                "entity {id}: version {v} was acknowledged but the store has {have:?} and the topic's newest is {last:?}"
            )),
        }
    }
    for breach in check_versions(&events, &stored, &floors) {
        shared.fail(format!("Invariant W: {breach}"));
    }
    let (keyed_breaches, retried) = check_keyed(&shared, &events);
    for breach in keyed_breaches {
        shared.fail(format!("idempotency: {breach}"));
    }
    // The public change stream (on by default) carries the same versions
    // in the same order per entity.
    let brokers = env.brokers();
    let (stream, truncated) = tokio::task::spawn_blocking(move || {
        model::read_change_stream(&brokers, "bagstore.changes.v1", PARTITIONS)
    })
    .await
    .expect("change stream read");
    for breach in model::check_change_stream(&stream, truncated, &events) {
        shared.fail(format!("Invariant W, change stream: {breach}"));
    }
    let stale = model::stale_redeliveries(&events);

    // The report.
    let c = &shared.counters;
    let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let mut report = String::new();
    writeln!(report, "chaos report ({kind} broker, seed {}):", cfg.seed).ok();
    writeln!(
        report,
        "  load: {load_secs:.0} s, {} clients over {} ids; writes acknowledged {}, rejected (404/412) {}, outcome unknown (5xx/connection lost) {}",
        cfg.clients,
        cfg.keys,
        n(&c.acked),
        n(&c.rejected),
        n(&c.unknown)
    )
    .ok();
    writeln!(
        report,
        "  keyed puts: {}, {retried} of them sent again after an unknown outcome; each on the topic at most once, at the version answered",
        shared.keyed.lock().unwrap().len()
    )
    .ok();
    writeln!(
        report,
        "  unique-key competitors ({UNIQUE_IDS} ids): {} writes refused 409 unique-violation; at the end {handles} handles held, \
         each by one live entity, and the unique index's rows exactly those",
        n(&c.unique.refused)
    )
    .ok();
    let kinds: Vec<String> = per_kind.iter().map(|(k, v)| format!("{k:?} x{v}")).collect();
    writeln!(report, "  faults injected: {}", kinds.join(", ")).ok();
    if let Some(t) = env.kafka.tansu() {
        let crashes = t.crashes();
        writeln!(report, "  broker self-crashes (each a failure): {}", crashes.len()).ok();
        for why in crashes {
            shared.fail(format!("the tansu broker crashed on its own: {why}"));
        }
    }
    writeln!(report, "  max index lag observed: {} events, {} ms", n(&c.max_lag_events), n(&c.max_lag_ms))
        .ok();
    if stack.moves.started > 0 {
        writeln!(report, "  {}", stack.moves.summary()).ok();
    }
    if !servers.failovers.is_empty() {
        writeln!(report, "  {}", servers.summary()).ok();
    }
    // The move fault must have done what it is for: three moves or more,
    // one killed mid-copy and one killed mid-cutover, each then finished.
    let m = &stack.moves;
    if cfg.faults.contains(&Fault::Move)
        && cfg.faults_per_kind >= 3
        && (m.started < 3 || m.killed_mid_copy == 0 || m.killed_mid_cutover == 0 || m.done.len() < 3)
    {
        shared.fail(format!("the move fault fell short of its plan: {}", m.summary()));
    }
    writeln!(
        report,
        "  stale redeliveries on the topic (an event after a newer version of its entity): {} events of {} entities",
        stale.values().map(Vec::len).sum::<usize>(),
        stale.len()
    )
    .ok();
    writeln!(
        report,
        "  indexer restarts after which two indexers kept claiming the same partitions (each a failure): {}",
        n(&c.overlaps)
    )
    .ok();
    writeln!(
        report,
        "  checks during load: {} queries ({} items) re-checked for Invariant R ({} unavailable), {} gets of acknowledged writes ({} unavailable)",
        n(&c.queries_checked),
        n(&c.query_items_checked),
        n(&c.queries_unavailable),
        n(&c.gets_checked),
        n(&c.gets_unavailable)
    )
    .ok();
    let e = &c.exp;
    writeln!(
        report,
        "  expiring client ({EXP_KEYS} ids): writes acknowledged {}, {} of them with an expiry 1-7 s ahead ({} in fractional seconds); \
         rewritten before the expiry {} times with a later one, {} without one; re-created after expiring {}; \
         conditional writes refused (412) {}; bad expiries refused (422) {}; reads checked {} ({} hid an expired entity, {} unavailable)",
        n(&e.acked),
        n(&e.with_expiry),
        n(&e.fractional),
        n(&e.extended),
        n(&e.cleared),
        n(&e.recreated),
        n(&e.refused),
        n(&e.bad_expiry),
        n(&e.reads),
        n(&e.hidden),
        n(&e.unavailable)
    )
    .ok();
    writeln!(
        report,
        "  expiry at the end: {} entities expired (rows: {} tombstones, {} purged), {} visible; all deleted {} ms after the latest expiry; \
         the cleaners expired {expired_total} entities and purged {purged_total} tombstones; \
         {purged_ids} acknowledged ids had their rows purged; {} gets of shared keys found a purged row",
        exp_sum.expired,
        exp_sum.tombstones,
        exp_sum.purged,
        exp_sum.visible,
        exp_delete_wait.as_millis(),
        n(&c.gets_purged)
    )
    .ok();
    writeln!(
        report,
        "  cleaner during the load: {swept} full sweeps, drift found {}",
        if load_drift.is_empty() { "none".to_string() } else { load_drift.join(", ") }
    )
    .ok();
    writeln!(
        report,
        "  checks at the end: {} live entities, {rows} index rows compared exactly twice (cleaner stopped; after 2 sweeps, drift found by that cleaner {drift}); {} stored versions against {} topic events",
        entities.len(),
        stored.len(),
        events.len()
    )
    .ok();
    eprint!("{report}");
    if let Ok(path) = std::env::var("BAGSTORE_CHAOS_REPORT") {
        std::fs::write(path, &report).ok();
    }
    std::fs::write(env.dir.path().join("chaos-report.txt"), &report).ok();

    let failures = shared.failures.lock().unwrap().clone();
    if !failures.is_empty() {
        let history = report::history(&shared, &timeline, &failures, cfg.keys, &events);
        eprint!("{history}");
        std::fs::write(env.dir.path().join("chaos-failures.txt"), &history).ok();
        panic!("chaos seed {}: {} checks failed; first: {}", cfg.seed, failures.len(), failures[0]);
    }
    assert!(n(&c.acked) > 100, "too few writes were acknowledged for the run to mean anything");
    assert!(n(&c.queries_checked) > 20, "too few queries were checked");
    for f in &cfg.faults {
        assert!(
            per_kind.get(f).copied().unwrap_or(0) >= cfg.faults_per_kind,
            "{f:?} was not injected enough"
        );
    }

    cleaner.terminate().await;
    for p in stack.writers.into_iter().chain(stack.indexers).flatten() {
        p.terminate().await;
    }
    stack.reader.terminate().await;
    // Stopped before the run's directory goes: a server still shutting
    // down as it is deleted leaves its files behind.
    if let Some(cluster) = servers.cluster.take() {
        cluster.stop().await;
    }
}

/// The live entities (id → properties) as the reader returns them.
async fn final_entities(shared: &Shared, keys: usize) -> HashMap<String, Value> {
    let mut ids: Vec<String> = (0..keys).map(entity_id).collect();
    ids.extend(shared.created.lock().unwrap().iter().cloned());
    ids.extend((0..EXP_KEYS).map(exp_id));
    let mut out = HashMap::new();
    for chunk in ids.chunks(500) {
        let req = shared.http.post(format!("{}/v1/entities/get", shared.reader)).json(&json!({"ids": chunk}));
        let (status, body) = shared.send(req).await.expect("batch get");
        assert_eq!(status, 200, "{body}");
        for e in body["items"].as_array().expect("items") {
            out.insert(e["id"].as_str().unwrap().to_string(), e["properties"].clone());
        }
    }
    out
}
