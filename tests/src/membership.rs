//! Who really works on each partition: the scenario behind issue 17's "no
//! overlap, ever", written once and run against both brokers.
//!
//! The sequence that used to leave two indexers on the same partitions:
//! indexers A and B share an index's partitions; B freezes (SIGSTOP, a
//! stalled VM); C starts, so the group rebalances and waits for B, and A
//! sits in the rebalance (not in its steady state, where librdkafka's own
//! session timer would catch what follows). Then the broker goes away for
//! longer than the session timeout, so every session ends on the broker's
//! side while no member can hear of it. When the broker is back, B thaws.
//! A, told its member id is unknown, used to rejoin as a new member while
//! still fetching the partitions it held, which the group gave to C.
//!
//! Judged by each process's `bagstore_indexer_partition_events_total`
//! (events taken from a partition and applied, counted where the consumer
//! loop takes and applies them), never by what a process says it owns:
//! within a bounded time after the broker returns, every partition must be
//! fetched and applied by exactly one process, and stay so for a window in
//! which every partition has had writes. A process that says it holds more
//! partitions than it works on fails the window too: what it holds, the
//! group cannot give to a member that would work on it.

use serde_json::json;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{eventually, Proc, TestEnv};

/// The index the scenario runs (one group keeps the judgement readable).
pub const INDEX: &str = "index_user_id";
/// The test env's topic has 4 partitions.
pub const PARTITIONS: i32 = 4;
/// Longer than the test env's `session_timeout_ms` (6 s).
pub const OUTAGE: Duration = Duration::from_secs(9);
/// After the broker is back, by when every partition must have exactly one
/// worker: a member stuck in a join is rebuilt after twice the session
/// timeout (12 s), then a rebalance or two. On tansu a member whose
/// partitions the group gave away can go on fetching them for a while with
/// no commit refused and nothing to notice (seen for up to 8.5 s; one
/// worker per partition 4 to 23 s after the broker returned).
const SETTLE_WITHIN: Duration = Duration::from_secs(40);
/// How long the clean state must last to count.
const CLEAN_FOR: Duration = Duration::from_secs(5);

/// Per partition and stage ("fetched", "applied"): the count so far.
pub type Counts = BTreeMap<(i32, String), f64>;

pub async fn counts(p: &Proc) -> Counts {
    sample(p).await.0
}

/// A process's counts, and how many partitions it says it holds.
pub async fn sample(p: &Proc) -> (Counts, f64) {
    let text = p.api().metrics().await;
    let claimed = crate::metric_sum(&text, "bagstore_indexer_assigned_partitions", &[("index", INDEX)]);
    let mut out = Counts::new();
    for line in text.lines().filter(|l| l.starts_with("bagstore_indexer_partition_events_total{")) {
        let label = |name: &str| {
            let start = line.find(&format!("{name}=\""))? + name.len() + 2;
            let end = line[start..].find('"')? + start;
            Some(line[start..end].to_string())
        };
        if label("index").as_deref() != Some(INDEX) {
            continue;
        }
        let (Some(p), Some(stage)) = (label("partition"), label("stage")) else { continue };
        let value: f64 = line.rsplit(' ').next().and_then(|v| v.parse().ok()).unwrap_or(0.0);
        out.insert((p.parse().expect("partition number"), stage), value);
    }
    (out, claimed)
}

/// Which processes advanced each partition's counters between two samples.
fn workers(before: &[Counts], after: &[Counts]) -> BTreeMap<i32, Vec<usize>> {
    let mut by_partition: BTreeMap<i32, Vec<usize>> = (0..PARTITIONS).map(|p| (p, vec![])).collect();
    for (proc_no, (b, a)) in before.iter().zip(after).enumerate() {
        for ((partition, stage), n) in a {
            let was = b.get(&(*partition, stage.clone())).copied().unwrap_or(0.0);
            let who = by_partition.entry(*partition).or_default();
            if *n > was && !who.contains(&proc_no) {
                who.push(proc_no);
            }
        }
    }
    by_partition
}

/// A client writing entities with random `user_id`s (so every partition
/// gets events) until it is stopped. Failed writes are of no concern here
/// (the writer goes away at the end of the test); the acknowledged ones
/// are counted, so a failure can say whether there was anything to apply.
#[derive(Debug)]
pub struct SteadyWrites {
    on: Arc<AtomicBool>,
    acknowledged: Arc<AtomicU64>,
}

impl SteadyWrites {
    pub fn stop(&self) {
        self.on.store(false, Ordering::Relaxed);
    }

    /// Writes acknowledged so far.
    pub fn acknowledged(&self) -> u64 {
        self.acknowledged.load(Ordering::Relaxed)
    }
}

pub fn steady_writes(base: String) -> SteadyWrites {
    let writes = SteadyWrites { on: Arc::new(AtomicBool::new(true)), acknowledged: Arc::default() };
    let (on, acknowledged) = (writes.on.clone(), writes.acknowledged.clone());
    tokio::spawn(async move {
        let http = reqwest::Client::new();
        let mut ticker = tokio::time::interval(Duration::from_millis(10));
        while on.load(Ordering::Relaxed) {
            ticker.tick().await;
            let id = uuid::Uuid::new_v4().simple().to_string();
            let body = json!({ "user_id": uuid::Uuid::new_v4().to_string() });
            let sent = http.put(format!("{base}/v1/entities/{id}")).json(&body).send().await;
            if sent.is_ok_and(|r| r.status().is_success()) {
                acknowledged.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    writes
}

/// Sum of one process's applied counters.
fn applied(c: &Counts) -> f64 {
    c.iter().filter(|((_, s), _)| s == "applied").map(|(_, n)| n).sum()
}

/// Runs the scenario. `outage` takes the broker away for [`OUTAGE`] and brings it back. Returns a line for the
/// test's output: how long the processes overlapped and how long until
/// each partition had one worker.
pub async fn no_partition_is_worked_twice_after_an_outage<F, Fut>(env: &TestEnv, outage: F) -> String
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    env.migrate().await;
    let writer = env.spawn(&["writer"]).await;
    let writing = steady_writes(writer.url.clone());
    let a = env.spawn(&["indexer", "--index", INDEX]).await;
    let b = env.spawn(&["indexer", "--index", INDEX]).await;
    eventually("indexers A and B to share the partitions", Duration::from_secs(60), || async {
        let (ca, cb) = (counts(&a).await, counts(&b).await);
        (applied(&ca) > 0.0 && applied(&cb) > 0.0).then_some(())
    })
    .await;
    let b_before = counts(&b).await;
    eventually("B to go on applying", Duration::from_secs(30), || async {
        (applied(&counts(&b).await) > applied(&b_before)).then_some(())
    })
    .await;

    b.signal("STOP");
    let c = env.spawn(&["indexer", "--index", INDEX]).await;
    // The scenario's timing, not a wait for a state: C's lease joins the
    // member list and A reshares at its next read of it, while frozen B
    // still holds its share; then the broker goes.
    tokio::time::sleep(Duration::from_secs(2)).await;
    outage().await;
    let back = Instant::now();
    b.signal("CONT");

    let procs = [&a, &b, &c];
    let mut prev = vec![counts(&a).await, counts(&b).await, counts(&c).await];
    let mut phantom = String::new();
    let mut clean_since: Option<Instant> = None;
    let mut overlap_seen = Duration::ZERO;
    let mut last_overlap = String::new();
    let step = Duration::from_millis(500);
    loop {
        tokio::time::sleep(step).await;
        let mut now = Vec::new();
        let mut claims = Vec::new();
        for p in procs {
            let (c, claimed) = sample(p).await;
            now.push(c);
            claims.push(claimed);
        }
        let who = workers(&prev, &now);
        prev = now;
        // A process that says it holds partitions it does not work on is
        // holding them away from the group.
        let worked: Vec<f64> =
            (0..procs.len()).map(|i| who.values().filter(|w| w.contains(&i)).count() as f64).collect();
        let honest = claims == worked;
        if !honest {
            phantom = format!(
                "{:.1} s after the broker returned, partitions held (A, B, C): {claims:?}, worked on: {worked:?}",
                back.elapsed().as_secs_f64()
            );
        }
        let twice: Vec<_> = who.iter().filter(|(_, w)| w.len() > 1).collect();
        if !twice.is_empty() {
            overlap_seen += step;
            last_overlap =
                format!("{:.1} s after the broker returned: {twice:?}", back.elapsed().as_secs_f64());
            clean_since = None;
        } else if honest && who.values().all(|w| w.len() == 1) {
            // Every partition advanced, each in one process, and every
            // process works on what it holds.
            clean_since.get_or_insert_with(Instant::now);
        } else {
            // A rebalance pause, or partitions held and not worked on.
            clean_since = None;
        }
        if clean_since.is_some_and(|t| t.elapsed() >= CLEAN_FOR) {
            break;
        }
        assert!(
            back.elapsed() < SETTLE_WITHIN + CLEAN_FOR,
            "{:?} after the broker returned, the partitions still do not have one worker each; \
             the last overlap (partition -> processes, 0 = A, 1 = B, 2 = C): {last_overlap:?}; the last \
             time partitions were held and not worked on: {phantom:?}; logs: {}",
            back.elapsed(),
            env.dir.path().display()
        );
    }
    writing.stop();
    let mut rejoins = Vec::new();
    for p in procs {
        rejoins.push(crate::metric_sum(
            &p.api().metrics().await,
            "bagstore_indexer_consumer_rejoins_total",
            &[],
        ));
    }
    format!(
        "one worker per partition {:.1} s after the broker returned; overlap seen for about {:.1} s \
         ({last_overlap}); rejoins after a lost assignment (A, B, C): {rejoins:?}",
        back.elapsed().as_secs_f64() - CLEAN_FOR.as_secs_f64(),
        overlap_seen.as_secs_f64(),
    )
}

/// How long after an indexer freezes the survivor must be working on every
/// partition: the frozen member's session (or member lease) ends, 6 s
/// here, then a rebalance (or the survivor's next read of the leases).
pub const TAKEOVER_WITHIN: Duration = Duration::from_secs(30);

/// Indexers A and B share an index's partitions; B freezes (SIGSTOP) and
/// stays frozen. Within [`TAKEOVER_WITHIN`] A must apply events of every
/// partition: each partition's applied count at A rises at least once
/// after the freeze (frozen B applies nothing, so a rise of one of B's
/// partitions is A's takeover). Judged per partition over the whole wait,
/// not in one short window: on a loaded machine the writes can be too few
/// for every partition to get an event in any given half second. Returns
/// how long until the last partition rose.
pub async fn a_frozen_indexers_partitions_go_to_the_survivor(env: &TestEnv) -> Duration {
    env.migrate().await;
    let writer = env.spawn(&["writer"]).await;
    let writing = steady_writes(writer.url.clone());
    let a = env.spawn(&["indexer", "--index", INDEX]).await;
    let b = env.spawn(&["indexer", "--index", INDEX]).await;
    eventually("indexers A and B to share the partitions", Duration::from_secs(60), || async {
        let (ca, cb) = (counts(&a).await, counts(&b).await);
        (applied(&ca) > 0.0 && applied(&cb) > 0.0).then_some(())
    })
    .await;
    b.signal("STOP");
    let frozen = Instant::now();
    let at_freeze = counts(&a).await;
    let acknowledged_at_freeze = writing.acknowledged();
    let mut rose: BTreeMap<i32, Duration> = BTreeMap::new();
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = counts(&a).await;
        for partition in 0..PARTITIONS {
            let key = (partition, "applied".to_string());
            let was = at_freeze.get(&key).copied().unwrap_or(0.0);
            if now.get(&key).is_some_and(|n| *n > was) {
                rose.entry(partition).or_insert_with(|| frozen.elapsed());
            }
        }
        if rose.len() == PARTITIONS as usize {
            break;
        }
        assert!(
            frozen.elapsed() < TAKEOVER_WITHIN,
            "{:?} after indexer B froze, A has applied events of only these partitions since \
             (partition -> when first): {rose:?}; writes acknowledged since the freeze: {}; logs: {}",
            frozen.elapsed(),
            writing.acknowledged() - acknowledged_at_freeze,
            env.dir.path().display()
        );
    }
    let took = rose.values().max().copied().unwrap_or_default();
    writing.stop();
    b.signal("CONT");
    took
}
