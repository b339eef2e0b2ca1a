//! A seeded, randomized concurrent history: writers keep changing a small
//! key space (indexed values appear, change and vanish; arrays; partial
//! index conditions; deletes; conditional writes) while the indexer and a
//! cleaner sweeping as fast as it can both run. When the writers stop, the
//! pipeline has caught up and a full sweep has run, every index table must
//! equal exactly the rows computed here, independently, from the entities.
//!
//! `BAGSTORE_TEST_SEED=<n>` replays a history.

use bagstore_tests::{eventually, metric_sum, Api, TestEnv, STANDARD_INDEXES};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Map, Value};
use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

const KEYS: usize = 25;
const WRITERS: usize = 3;
const OPS_PER_WRITER: usize = 120;

fn id(i: usize) -> String {
    format!("{:032x}", 0xc0de_0000u64 + i as u64)
}

const USERS: [&str; 4] = [
    "0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a",
    "1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b",
    "2c2c2c2c2c2c2c2c2c2c2c2c2c2c2c2c",
    "3d3d3d3d3d3d3d3d3d3d3d3d3d3d3d3d",
];

fn random_entity(rng: &mut StdRng) -> Value {
    let mut m = Map::new();
    let pick = |rng: &mut StdRng, xs: &[&str]| xs[rng.random_range(0..xs.len())].to_string();
    if rng.random_bool(0.8) {
        m.insert("user_id".into(), json!(pick(rng, &USERS)));
    }
    if rng.random_bool(0.8) {
        m.insert("first_name".into(), json!(pick(rng, &["Ann", "Bob", "Cy"])));
    }
    if rng.random_bool(0.8) {
        m.insert("last_name".into(), json!(pick(rng, &["Lee", "Kim"])));
    }
    match rng.random_range(0..10) {
        0 => {
            m.insert("bar".into(), json!("2"));
        }
        1 => {}
        _ => {
            m.insert("bar".into(), json!(rng.random_range(0..4)));
        }
    }
    if rng.random_bool(0.7) {
        m.insert("m".into(), json!(pick(rng, &["right", "left"])));
    }
    match rng.random_range(0..4) {
        0 => {}
        1 => {
            m.insert("tags".into(), json!(pick(rng, &["a", "b", "c", "d"])));
        }
        _ => {
            let n = rng.random_range(0..4);
            let mut tags: Vec<Value> = (0..n).map(|_| json!(pick(rng, &["a", "b", "c", "d"]))).collect();
            if rng.random_bool(0.2) {
                tags.push(json!(7));
            }
            m.insert("tags".into(), Value::Array(tags));
        }
    }
    m.insert("n".into(), json!(rng.random_range(0..1_000_000)));
    Value::Object(m)
}

/// One writer's history: (key, what it did, status).
type History = Vec<(usize, String, u16)>;

async fn writer(api: Api, seed: u64) -> History {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut history = Vec::new();
    for _ in 0..OPS_PER_WRITER {
        let k = rng.random_range(0..KEYS);
        let roll = rng.random_range(0..100);
        let (what, status) = if roll < 15 {
            ("delete".to_string(), api.delete(&id(k)).await.0)
        } else if roll < 30 {
            let v = rng.random_range(1..6).to_string();
            let body = random_entity(&mut rng);
            let s = api.put_with(&id(k), &body, ("If-Match", &format!("\"{v}\""))).await.0;
            (format!("put if-match {v} {body}"), s)
        } else {
            let body = random_entity(&mut rng);
            (format!("put {body}"), api.put(&id(k), &body).await.0)
        };
        assert!(matches!(status, 200 | 201 | 404 | 412), "unexpected status {status} for {what}");
        history.push((k, what, status));
    }
    history
}

/// (shard, key as text, entity id) for every row an index should hold,
/// derived here without bagstore's index code.
type Rows = BTreeSet<(usize, String, String)>;

fn shard(bytes: &[u8]) -> usize {
    schemas::shard_of(bytes, 2)
}

fn expected(entities: &HashMap<String, Value>) -> HashMap<&'static str, Rows> {
    let mut out: HashMap<&'static str, Rows> = HashMap::new();
    for (eid, p) in entities {
        if let Some(u) = p["user_id"].as_str() {
            let bytes: Vec<u8> =
                (0..16).map(|i| u8::from_str_radix(&u[2 * i..2 * i + 2], 16).unwrap()).collect();
            out.entry("index_user_id").or_default().insert((shard(&bytes), u.to_string(), eid.clone()));
        }
        if let (Some(f), Some(l)) = (p["first_name"].as_str(), p["last_name"].as_str()) {
            out.entry("index_user_name").or_default().insert((
                shard(f.as_bytes()),
                format!("{f}|{l}"),
                eid.clone(),
            ));
        }
        if let (Some(bar), Some("right")) = (p["bar"].as_i64(), p["m"].as_str()) {
            out.entry("index_foo").or_default().insert((
                shard(&bar.to_be_bytes()),
                bar.to_string(),
                eid.clone(),
            ));
        }
        let tags: Vec<&str> = match &p["tags"] {
            Value::String(s) => vec![s.as_str()],
            Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
            _ => vec![],
        };
        for t in tags {
            out.entry("index_tag").or_default().insert((shard(t.as_bytes()), t.to_string(), eid.clone()));
        }
    }
    out
}

async fn actual(env: &TestEnv) -> HashMap<&'static str, Rows> {
    let queries = [
        ("index_user_id", "SELECT LOWER(HEX(user_id)), LOWER(HEX(entity_id)) FROM index_user_id"),
        (
            "index_user_name",
            "SELECT CONCAT(CAST(first_name AS CHAR), '|', CAST(last_name AS CHAR)), LOWER(HEX(entity_id)) \
             FROM index_user_name",
        ),
        ("index_foo", "SELECT CAST(bar AS CHAR), LOWER(HEX(entity_id)) FROM index_foo"),
        ("index_tag", "SELECT CAST(tags AS CHAR), LOWER(HEX(entity_id)) FROM index_tag"),
    ];
    let mut out: HashMap<&'static str, Rows> = HashMap::new();
    for s in 0..env.dsns.len() {
        let pool = env.pool(s).await;
        for (table, sql) in queries {
            let rows: Vec<(String, String)> = sqlx::query_as(sql).fetch_all(&pool).await.unwrap();
            let set = out.entry(table).or_default();
            for (key, eid) in rows {
                set.insert((s, key, eid));
            }
        }
        pool.close().await;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn indexes_converge_exactly_under_concurrent_writes_indexer_and_cleaner() {
    let seed: u64 = std::env::var("BAGSTORE_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(20261122);
    eprintln!("convergence seed: {seed} (replay with BAGSTORE_TEST_SEED={seed})");
    let env = TestEnv::new("converge", STANDARD_INDEXES).await;
    let dev =
        env.spawn_env(&["dev", "--http", "127.0.0.1:0"], &[("BAGSTORE_CLEANER__INTERVAL_MS", "0")]).await;
    let api = dev.api();

    let writers: Vec<_> = (0..WRITERS).map(|w| tokio::spawn(writer(api.clone(), seed + w as u64))).collect();
    let mut history: History = Vec::new();
    for w in writers {
        history.extend(w.await.unwrap());
    }
    assert!(history.iter().any(|(_, _, s)| *s == 412), "the history exercised no failed precondition");

    env.until_caught_up(&["index_user_id", "index_user_name", "index_foo", "index_tag"]).await;
    // A full sweep that starts after the catch-up: wait for two completions.
    let sweeps = || async { metric_sum(&api.metrics().await, "bagstore_cleaner_sweeps_total", &[]) };
    let s0 = sweeps().await;
    eventually("two more cleaner sweeps", Duration::from_secs(60), || async {
        (sweeps().await >= s0 + 2.0).then_some(())
    })
    .await;

    let mut entities = HashMap::new();
    for k in 0..KEYS {
        let (status, body) = api.get(&id(k)).await;
        if status == 200 {
            entities.insert(id(k), body["properties"].clone());
        }
    }
    let want = expected(&entities);
    let have = actual(&env).await;
    let mut failures = Vec::new();
    for table in ["index_user_id", "index_user_name", "index_foo", "index_tag"] {
        let (w, h) =
            (want.get(table).cloned().unwrap_or_default(), have.get(table).cloned().unwrap_or_default());
        for missing in w.difference(&h) {
            failures.push(format!("{table}: missing {missing:?}"));
        }
        for dangling in h.difference(&w) {
            failures.push(format!("{table}: dangling {dangling:?}"));
        }
    }
    if !failures.is_empty() {
        let bad: BTreeSet<String> =
            failures.iter().filter_map(|f| f.split('"').rev().nth(1).map(str::to_string)).collect();
        for (k, what, status) in &history {
            if bad.contains(&id(*k)) {
                eprintln!("history {}: {status} {what}", id(*k));
            }
        }
        panic!("seed {seed}: index tables differ from the entities:\n{}", failures.join("\n"));
    }
    let total: usize = want.values().map(BTreeSet::len).sum();
    eprintln!("converged: {} entities, {total} index rows, {} operations", entities.len(), history.len());
    dev.terminate().await;
}
