//! Back-pressure (issue 18): a flood of concurrent writes against a small
//! `writer.max_pending_writes` gets only 2xx and 429 (with `Retry-After`),
//! never more writes in hand than the bound, and every acknowledged write
//! is stored at its version.

use bagstore_tests::{metric_sum, TestEnv};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

const BOUND: usize = 100;
const WRITES: usize = 2000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_writes_gets_2xx_or_429_and_never_more_than_the_bound_in_hand() {
    let env = TestEnv::new("flood", "").await;
    env.migrate().await;
    let bound = BOUND.to_string();
    let writer = env
        .spawn_env(
            &["writer"],
            &[("BAGSTORE_WRITER__MAX_PENDING_WRITES", &bound), ("BAGSTORE_WRITER__MAX_BATCH", "100")],
        )
        .await;
    let reader = env.spawn(&["reader"]).await;

    // Watch the writer's own count of writes in hand while the flood runs.
    let watching = Arc::new(AtomicBool::new(true));
    let (flag, api) = (watching.clone(), writer.api());
    let watcher = tokio::spawn(async move {
        let mut peak = 0.0f64;
        while flag.load(Ordering::Relaxed) {
            peak = peak.max(metric_sum(&api.metrics().await, "bagstore_writer_pending_writes", &[]));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        peak
    });

    let http = reqwest::Client::builder().pool_max_idle_per_host(WRITES).build().unwrap();
    let mut flood = Vec::new();
    for n in 0..WRITES {
        let (http, url) = (http.clone(), writer.url.clone());
        flood.push(tokio::spawn(async move {
            let id = format!("{n:032x}");
            let r =
                http.put(format!("{url}/v1/entities/{id}")).json(&json!({"n": n})).send().await.expect("PUT");
            let status = r.status().as_u16();
            let retry_after = r.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string());
            let body: Value = r.json().await.unwrap_or(Value::Null);
            (id, status, retry_after, body)
        }));
    }
    let mut acked = Vec::new();
    let mut refused = 0;
    for f in flood {
        let (id, status, retry_after, body) = f.await.expect("a write task");
        match status {
            200 | 201 => acked.push((id, body["version"].as_u64().expect("a version"))),
            429 => {
                refused += 1;
                assert_eq!(retry_after.as_deref(), Some("1"), "429 without Retry-After");
                assert_eq!(body["type"], "/problems/overloaded", "{body}");
            }
            other => panic!("write {id} answered {other}: {body}"),
        }
    }
    watching.store(false, Ordering::Relaxed);
    let peak = watcher.await.expect("watcher");
    assert!(peak <= BOUND as f64, "{peak} writes in hand, over the bound of {BOUND}");
    assert!(refused > 0, "a flood of {WRITES} against a bound of {BOUND} refused nothing");
    let counted = metric_sum(&writer.api().metrics().await, "bagstore_writer_overload_refusals_total", &[]);
    assert_eq!(counted, refused as f64);
    // Every acknowledged write is stored, at its version.
    let api = reader.api();
    for chunk in acked.chunks(500) {
        let ids: Vec<&str> = chunk.iter().map(|(id, _)| id.as_str()).collect();
        let (status, body) = api.get_many(&ids).await;
        assert_eq!(status, 200, "{body}");
        let stored: std::collections::HashMap<&str, u64> = body["items"]
            .as_array()
            .expect("items")
            .iter()
            .map(|i| (i["id"].as_str().unwrap(), i["version"].as_u64().unwrap()))
            .collect();
        for (id, version) in chunk {
            assert_eq!(
                stored.get(id.as_str()),
                Some(version),
                "acknowledged write {id} not stored at its version"
            );
        }
    }
    eprintln!("flood: {} acknowledged, {refused} refused with 429, peak {peak} in hand", acked.len());
}
