//! `Idempotency-Key` (issue 18): a retried POST after the writer died
//! between commit and answer gets the first answer and one entity exists;
//! a retry within the window writes nothing; the same key with another body
//! is a 422; keyed PATCHes count once; two tries of one key at once apply
//! once.

use bagstore_tests::{eventually, TestEnv};
use serde_json::{json, Value};
use std::time::Duration;

async fn post(base: &str, key: &str, body: &Value) -> Result<(u16, Value), reqwest::Error> {
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/entities"))
        .header("idempotency-key", key)
        .json(body)
        .send()
        .await?;
    let status = r.status().as_u16();
    Ok((status, r.json().await.unwrap_or(Value::Null)))
}

async fn patch(base: &str, id: &str, key: &str, body: &Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .patch(format!("{base}/v1/entities/{id}"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("PATCH");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn entity_rows(env: &TestEnv) -> Vec<(String, u64)> {
    let rows: Vec<(usize, (String, u64))> =
        env.fetch_all_shards("SELECT LOWER(HEX(id)), CAST(version AS UNSIGNED) FROM entities").await;
    rows.into_iter().map(|(_, r)| r).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_keyed_write_gets_the_first_answer_and_writes_once() {
    let env = TestEnv::new("idempotency", "").await;
    env.migrate().await;
    // This writer exits right after committing a keyed write, before it
    // answers: the client sees its request fail, outcome unknown.
    let doomed = env.spawn_env(&["writer"], &[("BAGSTORE_WRITER__DRILL_EXIT_AFTER_COMMIT", "true")]).await;
    let body = json!({"order": 42, "item": "book"});
    let first = post(&doomed.url, "order-42", &body).await;
    assert!(first.is_err(), "the drill writer answered: {first:?}");
    let rows = entity_rows(&env).await;
    assert_eq!(rows.len(), 1, "the write committed before the writer died: {rows:?}");

    // The client retries against a writer that lives.
    let writer = env.spawn(&["writer"]).await;
    let (status, answer) = post(&writer.url, "order-42", &body).await.expect("POST");
    assert_eq!(status, 201, "the first answer, created: {answer}");
    assert_eq!((answer["id"].as_str(), answer["version"].as_u64()), (Some(rows[0].0.as_str()), Some(1)));
    assert_eq!(entity_rows(&env).await, rows, "the retry wrote nothing");

    // Again, and again: the same answer, nothing written.
    for _ in 0..2 {
        let (status, again) = post(&writer.url, "order-42", &body).await.expect("POST");
        assert_eq!((status, &again), (201, &answer));
    }
    assert_eq!(entity_rows(&env).await, rows);

    // The same key with another body is refused and writes nothing.
    let (status, problem) = post(&writer.url, "order-42", &json!({"order": 43})).await.expect("POST");
    assert_eq!(
        (status, problem["type"].as_str()),
        (422, Some("/problems/idempotency-key-reused")),
        "{problem}"
    );
    assert_eq!(entity_rows(&env).await, rows);

    // Keyed increments count once per key.
    let id = rows[0].0.clone();
    for key in ["inc-1", "inc-1", "inc-2", "inc-1"] {
        let (status, b) = patch(&writer.url, &id, key, &json!({"$inc": {"n": 1}})).await;
        assert_eq!(status, 200, "{b}");
    }
    let stored = entity_rows(&env).await;
    assert_eq!(stored, vec![(id.clone(), 3)], "two distinct keys, two versions");

    // A bad key is refused.
    let (status, _) = post(&writer.url, "has space", &body).await.expect("POST");
    assert_eq!(status, 400);
    assert_eq!(entity_rows(&env).await.len(), 1);
}

async fn post_batch(base: &str, key: &str, items: &Value) -> Result<(u16, Value), reqwest::Error> {
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/entities/batch"))
        .header("idempotency-key", key)
        .json(&json!({ "entities": items }))
        .send()
        .await?;
    let status = r.status().as_u16();
    Ok((status, r.json().await.unwrap_or(Value::Null)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_keyed_batch_answers_every_item_as_first_and_writes_once() {
    let env = TestEnv::new("idembatch", "").await;
    env.migrate().await;
    let doomed = env.spawn_env(&["writer"], &[("BAGSTORE_WRITER__DRILL_EXIT_AFTER_COMMIT", "true")]).await;
    // Items with and without ids, spread over both shards; one invalid.
    let mut items: Vec<Value> = (0..20).map(|n| json!({"id": format!("{:032x}", n + 1), "n": n})).collect();
    items.extend((0..20).map(|n| json!({"n": 100 + n})));
    items.push(json!({"id": "not-an-id"}));
    let items = Value::Array(items);
    let first = post_batch(&doomed.url, "batch-7", &items).await;
    assert!(first.is_err(), "the drill writer answered: {first:?}");
    // The drill exits after a shard's transaction commits (the other's may
    // or may not have).
    assert!(!entity_rows(&env).await.is_empty(), "nothing committed");

    let writer = env.spawn(&["writer"]).await;
    let (status, answer) = post_batch(&writer.url, "batch-7", &items).await.expect("batch");
    assert_eq!(status, 200, "{answer}");
    let results = answer["results"].as_array().expect("results").clone();
    assert_eq!(results.len(), 41);
    assert_eq!(results[40]["status"].as_u64(), Some(400), "the invalid item: {}", results[40]);
    let stored = entity_rows(&env).await;
    assert_eq!(stored.len(), 40, "every valid item exactly once");
    assert!(stored.iter().all(|(_, v)| *v == 1), "nothing written twice: {stored:?}");
    for r in &results[..40] {
        assert_eq!(r["version"].as_u64(), Some(1), "{r}");
    }
    // Retried again: the same answers, nothing written.
    let (status, again) = post_batch(&writer.url, "batch-7", &items).await.expect("batch");
    assert_eq!((status, &again["results"]), (200, &answer["results"]));
    assert_eq!(entity_rows(&env).await, stored);
    // The same key with another body: 422, and nothing of it is written.
    let other = json!([{"id": format!("{:032x}", 999), "n": 1}, {"id": format!("{:032x}", 1), "n": -1}]);
    let (status, problem) = post_batch(&writer.url, "batch-7", &other).await.expect("batch");
    assert_eq!(
        (status, problem["type"].as_str()),
        (422, Some("/problems/idempotency-key-reused")),
        "{problem}"
    );
    assert_eq!(entity_rows(&env).await, stored);
}

/// A refusal is the first answer too: a keyed PATCH refused by its
/// `If-Match` is refused again on retry, with the version it was refused
/// at, even after the entity reached the version it asked for (without the
/// record, the retry would apply there); a keyed upsert-less PATCH of a
/// missing entity stays 404 after the entity is created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_keyed_write_that_was_refused_is_refused_the_same_way() {
    let env = TestEnv::new("idemrefused", "").await;
    env.migrate().await;
    let writer = env.spawn(&["writer", "--http", "127.0.0.1:0"]).await;
    let reader = env.spawn(&["reader", "--http", "127.0.0.1:0"]).await;
    let (base, api, read) = (writer.url.clone(), writer.api(), reader.api());
    let id = format!("{:032x}", 0xbad5eedu64);
    assert_eq!(api.put(&id, &json!({"n": 0})).await.0, 201);
    let keyed_if_match = |key: &'static str| {
        let (base, id) = (base.clone(), id.clone());
        async move {
            let r = reqwest::Client::new()
                .patch(format!("{base}/v1/entities/{id}"))
                .header("idempotency-key", key)
                .header("if-match", "\"2\"")
                .header("content-type", "application/json")
                .body(json!({"$inc": {"n": 1}}).to_string())
                .send()
                .await
                .expect("PATCH");
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let (status, first) = keyed_if_match("refused-once").await;
    assert_eq!((status, &first["current_version"]), (412, &json!(1)), "{first}");
    // The entity reaches version 2, which the refused request asked for.
    assert_eq!(api.put(&id, &json!({"n": 10})).await.0, 200);
    let (status, again) = keyed_if_match("refused-once").await;
    assert_eq!((status, &again), (412, &first), "the retry got another answer");
    // A new key is a new request: it applies at version 2.
    let (status, fresh) = keyed_if_match("a-new-key").await;
    assert_eq!((status, &fresh["version"]), (200, &json!(3)), "{fresh}");
    assert_eq!(read.get(&id).await.1["properties"], json!({"n": 11}));

    let missing = format!("{:032x}", 0xab5e17u64);
    let (status, _) = patch(&base, &missing, "missing-once", &json!({"$set": {"a": 1}})).await;
    assert_eq!(status, 404);
    assert_eq!(api.put(&missing, &json!({"a": 0})).await.0, 201);
    let (status, _) = patch(&base, &missing, "missing-once", &json!({"$set": {"a": 1}})).await;
    assert_eq!(status, 404, "the retry of a refused patch applied");
    assert_eq!(read.get(&missing).await.1["properties"], json!({"a": 0}));
}

/// Two tries of one keyed write that run at the same time in two writers (a
/// client's retry racing its first try, or two ingest members replaying one
/// command) apply once: both wait on the entity's row lock, and the second
/// then finds the first's record and answers what it answered. The barrier
/// is a transaction of the test's own holding that row lock until both
/// tries are waiting on it (under READ COMMITTED, a locking read of an
/// absent key locks nothing, so reading the records before the row lock
/// let both tries find none and both write).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tries_of_one_key_at_once_apply_once() {
    let env = TestEnv::new("idemrace", "").await;
    env.migrate().await;
    // Two writer processes, one try each: one process would group the two
    // into one transaction, which already answers the second from the first.
    let writer = env.spawn(&["writer", "--http", "127.0.0.1:0"]).await;
    let other = env.spawn(&["writer", "--http", "127.0.0.1:0"]).await;
    let id = format!("{:032x}", 0x7ace0001u64);
    assert_eq!(writer.api().put(&id, &json!({"n": 0})).await.0, 201);
    let (shard, _): (usize, (String,)) = env
        .fetch_all_shards::<(String,)>(&format!(
            "SELECT LOWER(HEX(id)) FROM entities WHERE id = UNHEX('{id}')"
        ))
        .await
        .pop()
        .expect("the entity's row");
    let pool = env.pool(shard).await;
    let mut barrier = pool.begin().await.unwrap();
    sqlx::query(&format!("SELECT version FROM entities WHERE id = UNHEX('{id}') FOR UPDATE"))
        .execute(&mut *barrier)
        .await
        .unwrap();
    let tries: Vec<_> = [&writer, &other]
        .into_iter()
        .map(|w| {
            let (base, id) = (w.url.clone(), id.clone());
            tokio::spawn(async move { patch(&base, &id, "raced-once", &json!({"$inc": {"n": 1}})).await })
        })
        .collect();
    let watch = &pool;
    eventually("both tries to wait on the entity's row lock", Duration::from_secs(20), || async move {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE DB = DATABASE() \
             AND INFO LIKE 'SELECT % FROM entities % WHERE id IN (?) FOR UPDATE'",
        )
        .fetch_one(watch)
        .await
        .unwrap();
        (waiting == 2).then_some(())
    })
    .await;
    barrier.commit().await.unwrap();
    let mut answers = Vec::new();
    for t in tries {
        answers.push(t.await.unwrap());
    }
    assert_eq!(answers[0], answers[1], "the two tries were answered differently");
    assert_eq!((answers[0].0, &answers[0].1["version"]), (200, &json!(2)), "{answers:?}");
    assert_eq!(entity_rows(&env).await, vec![(id, 2)], "the key applied twice");
}

/// `PUT` and `DELETE` of `/v1/entities/{id}` take an `Idempotency-Key`
/// as the other writes do: a retry gets the first answer and writes
/// nothing (a conditional `PUT`'s retry is not refused by the version its
/// own first try made), the same key with another body is a 422, and a
/// keyed `DELETE` deletes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_puts_and_deletes_of_an_id_apply_once() {
    let env = TestEnv::new("idemput", "").await;
    env.migrate().await;
    let writer = env.spawn(&["writer", "--http", "127.0.0.1:0"]).await;
    let reader = env.spawn(&["reader", "--http", "127.0.0.1:0"]).await;
    let (base, api, read) = (writer.url.clone(), writer.api(), reader.api());
    let id = format!("{:032x}", 0x9e7_0000_u64);
    assert_eq!(api.put(&id, &json!({"n": 0})).await.0, 201);
    let send =
        |method: reqwest::Method, key: &'static str, if_match: Option<&'static str>, body: Option<Value>| {
            let url = format!("{base}/v1/entities/{id}");
            async move {
                let mut req = reqwest::Client::new().request(method, url).header("idempotency-key", key);
                if let Some(v) = if_match {
                    req = req.header("if-match", v);
                }
                if let Some(b) = body {
                    req = req.json(&b);
                }
                let r = req.send().await.expect("request");
                (r.status().as_u16(), r.json::<Value>().await.unwrap_or(Value::Null))
            }
        };
    let put = |key, body| send(reqwest::Method::PUT, key, Some("\"1\""), Some(body));
    let (status, first) = put("put-once", json!({"n": 1})).await;
    assert_eq!((status, &first["version"]), (200, &json!(2)), "{first}");
    let (status, again) = put("put-once", json!({"n": 1})).await;
    assert_eq!((status, &again["version"]), (200, &json!(2)), "the retry got another answer: {again}");
    let (status, reused) = put("put-once", json!({"n": 2})).await;
    assert_eq!((status, &reused["type"]), (422, &json!("/problems/idempotency-key-reused")), "{reused}");
    assert_eq!(read.get(&id).await.1["version"], json!(2), "a retry wrote a version");

    let delete = |key| send(reqwest::Method::DELETE, key, None, None);
    let (status, gone) = delete("delete-once").await;
    assert_eq!((status, &gone["version"]), (200, &json!(3)), "{gone}");
    let (status, again) = delete("delete-once").await;
    assert_eq!(
        (status, &again["version"]),
        (200, &json!(3)),
        "the retried delete got another answer: {again}"
    );
    assert_eq!(delete("a-new-key").await.0, 404, "a new key is a new request");
    let rows = entity_rows(&env).await;
    assert!(rows.contains(&(id.clone(), 3)), "one tombstone at version 3: {rows:?}");
}
