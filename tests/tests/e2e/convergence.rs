//! A seeded, randomized concurrent history: writers keep changing a small
//! key space (indexed values appear, change and vanish; arrays; partial
//! index conditions; deletes; conditional writes) while the indexer and a
//! cleaner sweeping as fast as it can both run. When the writers stop, the
//! pipeline has caught up and a full sweep has run, every index table must
//! equal exactly the rows computed here, independently, from the entities.
//!
//! `BAGSTORE_TEST_SEED=<n>` replays a history.

use bagstore_tests::model::{actual_rows, expected_rows, random_entity, row_differences};
use bagstore_tests::{eventually, metric_sum, Api, TestEnv, STANDARD_INDEXES};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

const KEYS: usize = 25;
const WRITERS: usize = 3;
const OPS_PER_WRITER: usize = 120;

fn id(i: usize) -> String {
    format!("{:032x}", 0xc0de_0000u64 + i as u64)
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
    let want = expected_rows(&entities, &bagstore_tests::model::Placement::even(env.dsns.len()));
    let have = actual_rows(&env).await;
    let failures = row_differences(&want, &have);
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
