//! Bad input is refused with problem documents and writes nothing;
//! `migrate` is repeatable; `bagstore dev` keeps its data across restarts.

use bagstore_tests::{bagstore_bin, until_query_is, Proc, TestEnv, STANDARD_INDEXES};
use reqwest::Method;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_problem_document_and_nothing_is_written() {
    let env = TestEnv::new("badinput", STANDARD_INDEXES).await;
    let dev = env.dev().await;
    let api = dev.api();
    let good = "50000000000000000000000000000005";
    assert_eq!(api.put(good, &json!({"user_id": "5000aaaa5000aaaa5000aaaa5000aaaa"})).await.0, 201);

    let cases: Vec<(Method, String, Vec<u8>, u16, &str)> = vec![
        (Method::POST, "/v1/entities".into(), b"{\"a\": ".to_vec(), 400, "/problems/malformed-json"),
        (Method::POST, "/v1/entities".into(), b"[1, 2]".to_vec(), 400, "/problems/not-an-object"),
        (Method::POST, "/v1/entities".into(), b"\"text\"".to_vec(), 400, "/problems/not-an-object"),
        (Method::POST, "/v1/entities".into(), br#"{"id": "xyz"}"#.to_vec(), 400, "/problems/bad-id"),
        (Method::POST, "/v1/entities".into(), br#"{"id": 5}"#.to_vec(), 400, "/problems/bad-id"),
        (Method::POST, "/v1/entities".into(), br#"{"": 1}"#.to_vec(), 400, "/problems/bad-property-name"),
        (
            Method::POST,
            "/v1/entities".into(),
            br#"{"n": 18446744073709551615}"#.to_vec(),
            400,
            "/problems/bad-value",
        ),
        (Method::PUT, "/v1/entities/not-an-id".into(), b"{}".to_vec(), 400, "/problems/bad-id"),
        (
            Method::PUT,
            format!("/v1/entities/{good}"),
            br#"{"id": "60000000000000000000000000000006"}"#.to_vec(),
            400,
            "/problems/id-mismatch",
        ),
        (
            Method::POST,
            "/v1/entities".into(),
            format!("{{\"blob\": \"{}\"}}", "x".repeat((1 << 20) + 10)).into_bytes(),
            413,
            "/problems/body-too-large",
        ),
        (Method::POST, "/v1/entities/batch".into(), br#"{"items": []}"#.to_vec(), 400, "/problems/bad-batch"),
        (
            Method::POST,
            "/v1/query".into(),
            br#"{"index": "nope", "where": {"a": 1}}"#.to_vec(),
            400,
            "/problems/unknown-index",
        ),
        (
            Method::POST,
            "/v1/query".into(),
            br#"{"where": {"title": "x"}}"#.to_vec(),
            400,
            "/problems/no-usable-index",
        ),
        (
            Method::POST,
            "/v1/query".into(),
            br#"{"where": {"user_id": {"between": 1}}}"#.to_vec(),
            400,
            "/problems/bad-query",
        ),
        (Method::POST, "/v1/query".into(), br#"{"where": 7}"#.to_vec(), 400, "/problems/bad-query"),
        (
            Method::POST,
            "/v1/query".into(),
            br#"{"where": {"user_id": "nope"}}"#.to_vec(),
            400,
            "/problems/bad-query",
        ),
        (Method::GET, "/v1/nothing-here".into(), vec![], 404, "/problems/not-found"),
    ];
    for (method, path, body, status, kind) in cases {
        let (got, doc) = api.raw(method.clone(), &path, body).await;
        assert_eq!(got, status, "{method} {path}: {doc}");
        assert_eq!(doc["type"], kind, "{method} {path}: {doc}");
        assert_eq!(doc["status"], status);
        assert!(doc["detail"].as_str().is_some_and(|d| !d.is_empty()), "{doc}");
    }

    // The API describes itself; every documented path is a real route.
    let (s, spec) = api.raw(Method::GET, "/v1/openapi.json", vec![]).await;
    assert_eq!(s, 200);
    let paths = spec["paths"].as_object().unwrap();
    for p in [
        "/v1/entities",
        "/v1/entities/{id}",
        "/v1/entities/batch",
        "/v1/entities/get",
        "/v1/query",
        "/v1/indexes",
        "/v1/lag",
    ] {
        assert!(paths.contains_key(p), "{p} undocumented");
    }
    for p in paths.keys().filter(|p| !p.contains('{')) {
        let (s, _) = api.raw(Method::OPTIONS, p, vec![]).await;
        assert_ne!(s, 404, "{p} is documented but not served");
    }

    // Preconditions.
    let (s, doc) = api.put_with(good, &json!({"x": 1}), ("If-Match", "\"7\"")).await;
    assert_eq!((s, doc["current_version"].clone()), (412, json!(1)), "{doc}");
    let (s, doc) = api.put_with(good, &json!({"x": 1}), ("If-None-Match", "*")).await;
    assert_eq!((s, doc["type"].clone()), (412, json!("/problems/already-exists")));
    let (s, doc) = api.put_with(good, &json!({"x": 1}), ("If-Match", "\"1\"")).await;
    assert_eq!((s, doc["version"].clone()), (200, json!(2)));

    // A batch: the invalid item gets its problem, the valid one is written.
    let fresh = "70000000000000000000000000000007";
    let (s, doc) = api.batch(&[json!({"id": "bad"}), json!({"id": fresh, "k": 1}), json!([1])]).await;
    assert_eq!(s, 200);
    let results = doc["results"].as_array().unwrap();
    assert_eq!(results[0]["status"], 400);
    assert_eq!((results[1]["id"].clone(), results[1]["version"].clone()), (json!(fresh), json!(1)), "{doc}");
    assert_eq!(results[2]["type"], "/problems/not-an-object");

    // Exactly two entities exist: the first good one and the batch's valid item.
    assert_eq!(env.count_rows("entities").await, 2);
    let (s, doc) = api.get_many(&[good, fresh, "80000000000000000000000000000008"]).await;
    assert_eq!(s, 200);
    assert_eq!(doc["items"].as_array().unwrap().len(), 2);
    dev.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_is_repeatable_and_refuses_a_changed_index_definition() {
    let mut env = TestEnv::new("migrate", STANDARD_INDEXES).await;
    let first = env.migrate().await;
    assert!(first.contains("index index_user_id: ACTIVE"), "{first}");
    let second = env.migrate().await;
    assert_eq!(first, second);
    env.indexes_toml = STANDARD_INDEXES.replace("max_len = 64", "max_len = 32");
    let out = bagstore_tests::command(bagstore_bin())
        .args(["migrate", "--config"])
        .arg(env.config_path())
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("index \"index_tag\" already exists with another definition"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_started_as_the_readme_says_keeps_its_data_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("indexes.toml");
    std::fs::write(&config, STANDARD_INDEXES).unwrap();
    let data = dir.path().join("data");
    let args: Vec<String> = ["dev", "--http", "127.0.0.1:0", "--data-dir"]
        .iter()
        .map(|s| s.to_string())
        .chain([data.display().to_string(), "--config".into(), config.display().to_string()])
        .collect();
    let dev = Proc::start(&args, dir.path(), &[]).await.unwrap();
    // bagstore dev ready: http=<url> shards=<dsn>,<dsn> kafka=<bootstrap>
    let line = &dev.ready_line;
    assert!(line.starts_with("bagstore dev ready: http=http://127.0.0.1:"), "{line}");
    let shards = line.split_whitespace().find_map(|w| w.strip_prefix("shards=")).unwrap();
    assert_eq!(shards.split(',').count(), 2, "{line}");
    assert!(line.split_whitespace().any(|w| w.starts_with("kafka=")), "{line}");

    let api = dev.api();
    let id = "90000000000000000000000000000009";
    let user = "9999dddd9999dddd9999dddd9999dddd";
    assert_eq!(api.put(id, &json!({"user_id": user, "title": "kept"})).await.0, 201);
    until_query_is(&api, &json!({"where": {"user_id": user}}), &[id]).await;
    // On the embedded broker the indexers fetch with the short wait
    // (`schemas::settings::EMBEDDED_FETCH_WAIT_MS`, 5 ms; 20 ms elsewhere).
    let log = dev.log_text();
    let joins: Vec<&str> = log
        .lines()
        .filter(|l| {
            l.contains("\"assigning its partitions by member leases\"")
                && l.contains("\"consumer\":\"consumer index_")
        })
        .collect();
    assert!(joins.len() >= 4, "one per index:\n{log}");
    assert!(joins.iter().all(|l| l.contains("\"fetch_wait_ms\":5")), "{joins:#?}");
    assert_eq!(dev.terminate().await, Some(0));

    let dev = Proc::start(&args, dir.path(), &[]).await.unwrap();
    let api = dev.api();
    let (s, doc) = api.get(id).await;
    assert_eq!((s, doc["properties"]["title"].clone()), (200, json!("kept")));
    until_query_is(&api, &json!({"where": {"user_id": user}}), &[id]).await;
    // Writes after the restart flow through the fresh embedded Kafka.
    assert_eq!(api.put(id, &json!({"user_id": user, "title": "again"})).await.0, 200);
    let shard_dsns: Vec<String> = dev
        .ready_line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("shards="))
        .unwrap()
        .split(',')
        .map(str::to_string)
        .collect();
    assert_eq!(dev.terminate().await, Some(0));
    // Stopping dev stopped the mariadbd servers it started.
    for dsn in shard_dsns {
        assert!(sqlx::MySqlPool::connect(&dsn).await.is_err(), "{dsn} still answers after dev stopped");
    }
}

/// Every answer carries a request id (the caller's, when it sent one), and
/// the logs written while the request ran carry it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_has_an_id_in_its_answer_and_in_the_logs() {
    let env = TestEnv::new("requestid", STANDARD_INDEXES).await;
    let dev = env.dev().await;
    let http = reqwest::Client::new();
    let mut generated = Vec::new();
    for path in ["/health", "/v1/entities/not-an-id", "/no/such/route"] {
        let resp = http.get(format!("{}{path}", dev.url)).send().await.unwrap();
        let id = resp.headers().get("x-request-id").expect("a request id").to_str().unwrap().to_string();
        assert_eq!(id.len(), 16, "{path}: {id}");
        generated.push(id);
    }
    generated.dedup();
    assert_eq!(generated.len(), 3, "ids are per request: {generated:?}");
    let resp = http
        .post(format!("{}/v1/entities", dev.url))
        .header("x-request-id", "trace-me-42")
        .json(&json!({"user_id": "5000aaaa5000aaaa5000aaaa5000aaaa"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    assert_eq!(resp.headers()["x-request-id"], "trace-me-42");
    bagstore_tests::eventually("the request's log line", std::time::Duration::from_secs(10), || async {
        dev.log_text().lines().any(|l| l.contains("trace-me-42") && l.contains("answered")).then_some(())
    })
    .await;
    dev.terminate().await;
}
