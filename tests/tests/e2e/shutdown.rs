//! Graceful shutdown under load: SIGTERM to each service while writes flow.
//!
//! - A writer stops accepting, finishes requests in flight, and its relays
//!   drain the outbox before exiting; nothing acknowledged is lost and no
//!   event is published twice (a published row left in the outbox would be
//!   sent again by the next leader).
//! - An indexer finishes the batch in hand and commits offsets for exactly
//!   what it applied: the index equals the events below the committed
//!   offsets, no more, no less.
//! - The reader answers every query it accepted; the cleaner stops.
//! - Each exits with status 0 within a bound.

use bagstore_tests::{eventually, metric_sum, model, Proc, TestEnv};
use serde_json::json;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

const ONE_INDEX: &str = r#"
[[indexes]]
table = "index_user_id"
properties = [{ name = "user_id", type = "uuid" }]
"#;

const KEYS: u64 = 60;
/// Longest a service may take to exit after SIGTERM here (test config:
/// `http.shutdown_grace_ms` 3 s, `kafka.message_timeout_ms` 3 s).
const EXIT_BOUND: Duration = Duration::from_secs(20);

fn entity_id(k: u64) -> String {
    format!("{:032x}", 0x5d00_0000u64 + k)
}

/// The load: clients writing through whichever writers are listed.
struct Load {
    writers: RwLock<Vec<String>>,
    stop: AtomicBool,
    /// Entity id → highest acknowledged version.
    acked: Mutex<HashMap<String, u64>>,
    acked_count: AtomicU64,
    lost_connections: AtomicU64,
    failures: Mutex<Vec<String>>,
}

async fn writing_client(load: Arc<Load>, n: u64) {
    let http = reqwest::Client::new();
    let mut i = 0u64;
    while !load.stop.load(Ordering::Relaxed) {
        i += 1;
        let Some(base) = ({
            let w = load.writers.read().unwrap();
            (!w.is_empty()).then(|| w[(i as usize) % w.len()].clone())
        }) else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let id = entity_id((n * 7919 + i) % KEYS);
        let user = format!("{:016x}{:016x}", n + 1, i);
        let sent = http
            .put(format!("{base}/v1/entities/{id}"))
            .json(&json!({"user_id": user}))
            .timeout(Duration::from_secs(15))
            .send()
            .await;
        match sent {
            Ok(r) if r.status().is_success() => {
                let body: serde_json::Value = r.json().await.unwrap_or_default();
                let v = body["version"].as_u64().unwrap_or(0);
                let mut a = load.acked.lock().unwrap();
                let e = a.entry(id).or_insert(0);
                *e = (*e).max(v);
                load.acked_count.fetch_add(1, Ordering::Relaxed);
            }
            Ok(r) => {
                let status = r.status();
                let text = r.text().await.unwrap_or_default();
                load.failures.lock().unwrap().push(format!("write answered {status} {text}"));
            }
            Err(_) => {
                // No answer: this writer stopped listening (refused, or an
                // idle keep-alive connection it closed). Not acknowledged,
                // so not counted; use the others.
                load.lost_connections.fetch_add(1, Ordering::Relaxed);
                load.writers.write().unwrap().retain(|w| *w != base);
            }
        }
    }
}

/// SIGTERM, and how long the exit took.
async fn stop(p: Proc, what: &str) -> Duration {
    let t = Instant::now();
    let code = p.terminate().await;
    let took = t.elapsed();
    assert_eq!(code, Some(0), "{what} exit status after SIGTERM");
    assert!(took < EXIT_BOUND, "{what} took {took:?} to stop");
    eprintln!("{what} stopped in {} ms", took.as_millis());
    took
}

async fn until_more_acks(load: &Load, more: u64) {
    let base = load.acked_count.load(Ordering::Relaxed);
    eventually("the load to make progress", Duration::from_secs(30), || async {
        (load.acked_count.load(Ordering::Relaxed) >= base + more).then_some(())
    })
    .await;
}

/// (entity, user_id, version) of every live row in the index, on every shard.
async fn index_rows(env: &TestEnv) -> BTreeSet<(String, String, u64)> {
    let rows: Vec<(usize, (String, String, u64))> = env
        .fetch_all_shards(
            "SELECT LOWER(HEX(entity_id)), LOWER(HEX(user_id)), CAST(version AS UNSIGNED) FROM index_user_id \
             WHERE removed_us IS NULL",
        )
        .await;
    rows.into_iter().map(|(_, r)| r).collect()
}

fn user_of(e: &schemas::event::ChangeEvent) -> String {
    match e.after.as_ref().and_then(|b| b.get("user_id")) {
        Some(schemas::value::Value::String(s)) => s.clone(),
        other => panic!("event without a user_id: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_to_each_service_under_load_loses_nothing_and_leaves_nothing_half_done() {
    let env = TestEnv::new("shutdown", ONE_INDEX).await;
    env.migrate().await;
    let w1 = env.spawn(&["writer"]).await;
    eventually("the first writer to lead both relays", Duration::from_secs(30), || async {
        let m = w1.api().metrics().await;
        (metric_sum(&m, "bagstore_writer_relay_leader", &[]) == 2.0).then_some(())
    })
    .await;
    // Writer 2's relay lingers 400 ms per round, so rows are waiting in its
    // outbox when it is told to stop: only a draining relay empties it.
    let w2 = env.spawn_env(&["writer"], &[("BAGSTORE_KAFKA__OPTIONS", r#"{ "linger.ms" = "400" }"#)]).await;
    let indexer = env.spawn(&["indexer"]).await;
    let reader = env.spawn(&["reader"]).await;
    eventually("the indexer to own the 4 partitions", Duration::from_secs(60), || async {
        let m = indexer.api().metrics().await;
        (metric_sum(&m, "bagstore_indexer_assigned_partitions", &[]) == 4.0).then_some(())
    })
    .await;

    let load = Arc::new(Load {
        writers: RwLock::new(vec![w1.url.clone(), w2.url.clone()]),
        stop: AtomicBool::new(false),
        acked: Mutex::new(HashMap::new()),
        acked_count: AtomicU64::new(0),
        lost_connections: AtomicU64::new(0),
        failures: Mutex::new(Vec::new()),
    });
    let clients: Vec<_> = (0..3).map(|n| tokio::spawn(writing_client(load.clone(), n))).collect();
    until_more_acks(&load, 100).await;

    // The relay leader stops while the other writer keeps committing.
    stop(w1, "writer 1 (relay leader)").await;
    until_more_acks(&load, 100).await;

    // The indexer stops mid-stream: it must commit offsets for exactly what it applied.
    stop(indexer, "indexer").await;
    let k = env.kafka_settings();
    let committed: HashMap<i32, i64> = service::kafka::group_lag(&k, &k.group_for("index_user_id"))
        .await
        .unwrap()
        .into_iter()
        .map(|p| (p.partition, p.committed.unwrap_or(0)))
        .collect();
    let (brokers, topic) = (env.brokers(), env.topic.clone());
    let events = tokio::task::spawn_blocking(move || model::read_topic(&brokers, &topic, 4)).await.unwrap();
    let mut applied: HashMap<String, (u64, String)> = HashMap::new();
    for e in events.iter().filter(|e| e.offset < committed[&e.partition]) {
        let slot = applied.entry(e.event.id.to_hex()).or_insert((0, String::new()));
        if e.event.version > slot.0 {
            *slot = (e.event.version, user_of(&e.event));
        }
    }
    let want: BTreeSet<(String, String, u64)> =
        applied.into_iter().map(|(id, (v, user))| (id, user, v)).collect();
    let committed_events: i64 = committed.values().sum();
    assert!(committed_events > 0, "the indexer committed nothing");
    assert_eq!(
        index_rows(&env).await,
        want,
        "the index must hold exactly the events below the committed offsets {committed:?}"
    );
    until_more_acks(&load, 50).await;

    // The cleaner sweeps under load, then stops. (It starts only now: while
    // the indexer lags it may write rows ahead of it, which would blur the
    // exact offset check above.)
    let cleaner = env.spawn_env(&["cleaner"], &[("BAGSTORE_CLEANER__INTERVAL_MS", "100")]).await;
    eventually("a cleaner sweep", Duration::from_secs(30), || async {
        let m = cleaner.api().metrics().await;
        (metric_sum(&m, "bagstore_cleaner_sweeps_total", &[]) >= 1.0).then_some(())
    })
    .await;
    stop(cleaner, "cleaner").await;

    // The reader answers what it accepted, then refuses connections.
    let q_stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (qs, rurl, qa) = (q_stop.clone(), reader.url.clone(), answered.clone());
    let querier = tokio::spawn(async move {
        let http = reqwest::Client::new();
        let (mut ok, mut refused) = (0u64, 0u64);
        while !qs.load(Ordering::Relaxed) {
            let q = json!({"where": {"user_id": "0000000000000001000000000000000a"}});
            match http.post(format!("{rurl}/v1/query")).json(&q).send().await {
                Ok(r) => {
                    assert_eq!(r.status(), 200, "a query during the reader's shutdown");
                    let body: serde_json::Value = r.json().await.expect("a whole answer");
                    assert!(body["items"].is_array());
                    ok += 1;
                    qa.fetch_add(1, Ordering::Relaxed);
                }
                Err(_) => {
                    // Not accepted (refused, or a keep-alive connection the
                    // stopping server closed while idle). An accepted query
                    // must get a whole 200 answer, checked above.
                    refused += 1;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
        (ok, refused)
    });
    // Stop the reader only once it has answered queries: a fixed wait
    // found none answered yet on a loaded machine.
    eventually("the reader to answer queries", Duration::from_secs(30), || async {
        (answered.load(Ordering::Relaxed) >= 3).then_some(())
    })
    .await;
    stop(reader, "reader").await;
    q_stop.store(true, Ordering::Relaxed);
    let (ok, refused) = querier.await.unwrap();
    assert!(ok > 0 && refused > 0, "queries answered {ok}, refused after the stop {refused}");

    // The last writer stops under load: its relays drain the outbox first.
    until_more_acks(&load, 50).await;
    stop(w2, "writer 2 (the last one)").await;
    assert_eq!(env.count_rows("outbox").await, 0, "the stopping relay left rows in the outbox");
    load.stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    let failures = load.failures.lock().unwrap().clone();
    assert!(failures.is_empty(), "{failures:#?}");

    // Nothing lost, nothing sent twice, the index complete after a new indexer.
    let stored = model::stored_versions(&env).await;
    for (id, v) in load.acked.lock().unwrap().iter() {
        assert!(stored.get(id).copied().unwrap_or(0) >= *v, "{id}: acknowledged version {v} lost");
    }
    let indexer = env.spawn(&["indexer"]).await;
    env.until_caught_up(&["index_user_id"]).await;
    let (brokers, topic) = (env.brokers(), env.topic.clone());
    let events = tokio::task::spawn_blocking(move || model::read_topic(&brokers, &topic, 4)).await.unwrap();
    let mut seen = BTreeSet::new();
    for e in &events {
        assert!(
            seen.insert((e.event.id.to_hex(), e.event.version)),
            "{} version {} was published twice",
            e.event.id.to_hex(),
            e.event.version
        );
    }
    let breaches = model::check_topic_order(&events, &stored);
    assert!(breaches.is_empty(), "{breaches:#?}");
    let mut last: HashMap<String, &schemas::event::ChangeEvent> = HashMap::new();
    for e in &events {
        let id = e.event.id.to_hex();
        if last.get(&id).is_none_or(|l| l.version < e.event.version) {
            last.insert(id, &e.event);
        }
    }
    let want: BTreeSet<(String, String, u64)> =
        last.iter().map(|(id, e)| (id.clone(), user_of(e), e.version)).collect();
    assert_eq!(index_rows(&env).await, want);
    eprintln!(
        "shutdown under load: {} writes acknowledged, {} events on the topic, {} connections refused by stopped writers",
        load.acked_count.load(Ordering::Relaxed),
        events.len(),
        load.lost_connections.load(Ordering::Relaxed)
    );
    indexer.terminate().await;
}
