//! Every limit on hostile or careless input answers a clear 4xx problem
//! document and writes nothing: body size, batch size, batch-get size,
//! query `limit`, `in` list length, nesting depth, and a body that arrives
//! too slowly (or never) gets 408 after `http.request_timeout_ms`.
//!
//! The limits are set small through the environment, the way an operator
//! would, so the requests stay small.

use bagstore_tests::{Proc, TestEnv, STANDARD_INDEXES};
use reqwest::Method;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MAX_BODY: usize = 2048;
const MAX_BATCH: usize = 5;
const MAX_BATCH_GET: usize = 4;
const MAX_LIMIT: usize = 10;
const MAX_IN: usize = 3;
const REQUEST_TIMEOUT_MS: u64 = 500;

async fn dev_with_small_limits(env: &TestEnv) -> Proc {
    let (body, batch, get, limit, max_in, timeout) = (
        MAX_BODY.to_string(),
        MAX_BATCH.to_string(),
        MAX_BATCH_GET.to_string(),
        MAX_LIMIT.to_string(),
        MAX_IN.to_string(),
        REQUEST_TIMEOUT_MS.to_string(),
    );
    env.spawn_env(
        &["dev", "--http", "127.0.0.1:0"],
        &[
            ("BAGSTORE_WRITER__MAX_BODY_BYTES", &body),
            ("BAGSTORE_WRITER__MAX_BATCH", &batch),
            ("BAGSTORE_READER__MAX_BATCH_GET", &get),
            ("BAGSTORE_READER__MAX_LIMIT", &limit),
            ("BAGSTORE_READER__MAX_IN", &max_in),
            ("BAGSTORE_HTTP__REQUEST_TIMEOUT_MS", &timeout),
        ],
    )
    .await
}

fn id(n: usize) -> String {
    format!("{n:032x}")
}

/// `levels` nested arrays around `null`.
fn nested(levels: usize) -> Value {
    (0..levels).fold(Value::Null, |v, _| json!([v]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_limit_answers_a_clear_4xx_and_writes_nothing() {
    let env = TestEnv::new("limits", STANDARD_INDEXES).await;
    let dev = dev_with_small_limits(&env).await;
    let api = dev.api();

    let entity = |n: usize| json!({"id": id(n), "first_name": "ada", "last_name": format!("l{n}")});
    let batch = |n: usize| json!({"entities": (1..=n).map(entity).collect::<Vec<_>>()});
    let ids = |n: usize| json!({"ids": (1..=n).map(id).collect::<Vec<_>>()});
    let big = json!({"blob": "x".repeat(MAX_BODY)});
    let in_list = |n: usize| json!({"where": {"first_name": {"in": (0..n).map(|i| format!("n{i}")).collect::<Vec<_>>()}}});

    let refused: Vec<(Method, String, Value, u16, &str, &str)> = vec![
        (Method::POST, "/v1/entities".into(), big.clone(), 413, "/problems/body-too-large", "2048 byte"),
        (
            Method::PUT,
            format!("/v1/entities/{}", id(1)),
            big.clone(),
            413,
            "/problems/body-too-large",
            "2048",
        ),
        (
            Method::POST,
            "/v1/entities/batch".into(),
            batch(MAX_BATCH + 1),
            413,
            "/problems/batch-too-large",
            "5",
        ),
        (Method::POST, "/v1/entities/get".into(), ids(MAX_BATCH_GET + 1), 400, "/problems/too-many-ids", "4"),
        (
            Method::POST,
            "/v1/query".into(),
            json!({"where": {"first_name": "ada"}, "limit": MAX_LIMIT + 1}),
            400,
            "/problems/bad-query",
            "from 1 to 10",
        ),
        (Method::POST, "/v1/query".into(), in_list(MAX_IN + 1), 400, "/problems/bad-query", "1 to 3 values"),
        (
            // Two `in` lists of 2 expand to 4 index keys, over max_in.
            Method::POST,
            "/v1/query".into(),
            json!({"where": {"first_name": {"in": ["a", "b"]}, "last_name": {"in": ["c", "d"]}}}),
            400,
            "/problems/bad-query",
            "4 index keys",
        ),
        (
            Method::POST,
            "/v1/query".into(),
            json!({"where": {"first_name": "a"}, "consistent_with": (1..=MAX_IN + 1).map(|n| format!("{}.1", id(n))).collect::<Vec<_>>()}),
            400,
            "/problems/bad-query",
            "at most 3 tokens",
        ),
        (
            // serde_json's recursion limit: 128 levels including the entity object.
            Method::POST,
            "/v1/entities".into(),
            json!({"deep": nested(127)}),
            400,
            "/problems/malformed-json",
            "recursion limit",
        ),
    ];
    for (method, path, body, status, kind, says) in refused {
        let (got, doc) = api.raw(method.clone(), &path, serde_json::to_vec(&body).unwrap()).await;
        assert_eq!((got, doc["type"].as_str()), (status, Some(kind)), "{method} {path}: {doc}");
        assert_eq!(doc["status"], status, "{doc}");
        let detail = doc["detail"].as_str().unwrap_or_default();
        assert!(detail.contains(says), "{method} {path}: detail {detail:?} should mention {says:?}");
    }
    assert_eq!(env.count_rows("entities").await, 0, "a refused request wrote an entity");
    assert_eq!(env.count_rows("outbox").await, 0, "a refused request wrote an event");

    // Each limit is exact: at the limit, the same requests succeed.
    let (s, doc) =
        api.raw(Method::POST, "/v1/entities/batch", serde_json::to_vec(&batch(MAX_BATCH)).unwrap()).await;
    assert_eq!(s, 200, "{doc}");
    assert!(doc["results"].as_array().unwrap().iter().all(|r| r["version"] == 1), "{doc}");
    assert_eq!(env.count_rows("entities").await, MAX_BATCH as i64);
    let (s, doc) =
        api.raw(Method::POST, "/v1/entities/get", serde_json::to_vec(&ids(MAX_BATCH_GET)).unwrap()).await;
    assert_eq!((s, doc["items"].as_array().map(Vec::len)), (200, Some(MAX_BATCH_GET)), "{doc}");
    for q in [json!({"where": {"first_name": "ada"}, "limit": MAX_LIMIT, "allow_partial": true}), {
        let mut q = in_list(MAX_IN);
        q["allow_partial"] = json!(true);
        q
    }] {
        let (s, doc) = api.query(&q).await;
        assert_eq!(s, 200, "{q}: {doc}");
    }

    // The deepest body the writer accepts is stored and reads back intact:
    // the decoder's depth limit is above the writer's. (The answer nests two
    // levels deeper than the entity, past serde_json's own parsing limit,
    // so it is compared as text.)
    let (s, doc) = api.put(&id(99), &json!({"deep": nested(126)})).await;
    assert_eq!(s, 201, "{doc}");
    let resp = reqwest::get(format!("{}/v1/entities/{}", dev.url, id(99))).await.unwrap();
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.unwrap();
    let want = format!("\"deep\":{}null{}", "[".repeat(126), "]".repeat(126));
    assert!(text.contains(&want), "{text}");
    dev.terminate().await;
}

/// What came back on a raw connection: status, headers (lowercase) and body.
#[derive(Debug)]
struct RawReply {
    status: u16,
    head: String,
    body: Value,
}

/// Reads one response: headers, then `Content-Length` bytes of body. It
/// does not wait for the close, which may arrive as a reset when the
/// server drops a connection with body bytes still unread.
async fn read_response(stream: &mut tokio::net::tcp::OwnedReadHalf) -> RawReply {
    let mut bytes = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = bytes.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&bytes[..end]).to_ascii_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            if bytes.len() >= end + 4 + len {
                let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
                let body = serde_json::from_slice(&bytes[end + 4..end + 4 + len]).unwrap_or(Value::Null);
                return RawReply { status, head, body };
            }
        }
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => {
                panic!("connection ended before a whole response: {:?}", String::from_utf8_lossy(&bytes))
            }
            Ok(n) => bytes.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Sends headers and the start of a body that claims 100 bytes, then either
/// stalls (`trickle` false) or sends one more byte every 100 ms, and waits
/// (bounded) for the answer.
async fn slow_request(addr: String, method: String, path: String, trickle: bool) -> (RawReply, Duration) {
    let stream = TcpStream::connect(&addr).await.expect("connect");
    let (mut rx, mut tx) = stream.into_split();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"a\": "
    );
    tx.write_all(head.as_bytes()).await.expect("send headers");
    let started = Instant::now();
    let sender = tokio::spawn(async move {
        if trickle {
            // 90 more bytes at 10 per second: the body would take 9 s.
            for _ in 0..90 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if tx.write_all(b" ").await.is_err() {
                    break;
                }
            }
        }
        // Hold the write half open: a stalled client never finishes.
        tokio::time::sleep(Duration::from_secs(30)).await;
        drop(tx);
    });
    let reply = tokio::time::timeout(Duration::from_secs(10), read_response(&mut rx))
        .await
        .unwrap_or_else(|_| panic!("{method} {path}: no answer within 10 s to a stalled body"));
    sender.abort();
    (reply, started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_sends_its_body_too_slowly_gets_408_and_nothing_is_written() {
    let env = TestEnv::new("slowbody", STANDARD_INDEXES).await;
    let dev = dev_with_small_limits(&env).await;
    let addr = dev.url.trim_start_matches("http://").to_string();

    let cases = [
        ("POST", "/v1/entities".to_string(), false),
        ("PUT", format!("/v1/entities/{}", id(7)), true),
        ("POST", "/v1/entities/batch".to_string(), false),
        ("POST", "/v1/query".to_string(), true),
        ("POST", "/v1/entities/get".to_string(), false),
    ];
    // All at once: one stalled client does not hold up another.
    let runs: Vec<_> = cases
        .iter()
        .map(|(m, p, trickle)| tokio::spawn(slow_request(addr.clone(), m.to_string(), p.clone(), *trickle)))
        .collect();
    let mut replies = Vec::new();
    for run in runs {
        replies.push(run.await.expect("slow client task"));
    }
    for ((method, path, _), (reply, took)) in cases.iter().zip(replies) {
        assert_eq!(reply.status, 408, "{method} {path}: {}\n{}", reply.head, reply.body);
        assert!(reply.head.contains("content-type: application/problem+json"), "{}", reply.head);
        assert!(reply.head.contains("connection: close"), "{}", reply.head);
        assert_eq!(reply.body["type"], "/problems/request-timeout", "{}", reply.body);
        assert_eq!(reply.body["status"], 408);
        assert!(reply.body["detail"].as_str().unwrap_or_default().contains("500 ms"), "{}", reply.body);
        // It is the configured timeout that answered, not an early refusal.
        assert!(
            took >= Duration::from_millis(REQUEST_TIMEOUT_MS - 50),
            "{method} {path} answered after {took:?}"
        );
    }
    // The server still serves well-behaved clients, and nothing was written.
    let (s, _) = dev.api().get(&id(7)).await;
    assert_eq!(s, 404);
    assert_eq!(env.count_rows("entities").await, 0);
    assert_eq!(env.count_rows("outbox").await, 0);
    dev.terminate().await;
}
