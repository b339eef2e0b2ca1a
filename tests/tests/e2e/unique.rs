//! Unique indexes (issue 34): a write that would give a second live entity
//! a unique key is refused 409 `unique-violation` naming the holder, on
//! every write route, with nothing written; a key is freed by an update,
//! a delete and an expiry; partial and multi-valued unique indexes; racing
//! writers on three shards, exactly one winner; a writer killed between
//! reserving a key and committing leaves an orphan that blocks the key
//! only until its reservation runs out. The key rows end equal to the
//! truth: one held row per key a live entity holds, nothing else.

use bagstore_tests::{eventually, TestEnv};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Message};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub(crate) const UNIQUE_INDEXES: &str = r#"
[[indexes]]
table = "index_email"
properties = [{ name = "email", type = "string", max_len = 64 }]
unique = true

[[indexes]]
table = "index_handle"
properties = [{ name = "handle", type = "string", max_len = 32 }]
match_on = { kind = "user" }
unique = true

[[indexes]]
table = "index_alias"
properties = [{ name = "aliases", type = "string", max_len = 32 }]
unique = true
"#;

fn id(n: u64) -> String {
    format!("{n:032x}")
}

/// Asserts a 409 `unique-violation` naming `index` and `holder`.
fn assert_taken(reply: &(u16, Value), index: &str, holder: &str) {
    let (status, body) = reply;
    assert_eq!(*status, 409, "{body}");
    assert!(body["type"].as_str().unwrap_or_default().ends_with("/problems/unique-violation"), "{body}");
    assert_eq!((body["index"].as_str(), body["existing_id"].as_str()), (Some(index), Some(holder)), "{body}");
}

/// An env on three physical shards (the third a further database).
async fn three_shards(name: &str) -> TestEnv {
    let mut env = TestEnv::new(name, UNIQUE_INDEXES).await;
    env.dsns.push(env.extra_dsn(2));
    env.migrate().await;
    env
}

/// Every key row of `table` on every shard: `(key, holder, pending)`.
async fn key_rows(env: &TestEnv, table: &str, column: &str) -> BTreeSet<(String, String, bool)> {
    env.fetch_all_shards::<(Vec<u8>, String, i64)>(&format!(
        "SELECT `{column}`, LOWER(HEX(entity_id)), CAST(token IS NOT NULL AS SIGNED) FROM `{table}`"
    ))
    .await
    .into_iter()
    .map(|(_, (k, e, p))| (String::from_utf8(k).expect("utf-8"), e, p != 0))
    .collect()
}

fn now_secs() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_secs_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_write_route_refuses_a_taken_key_and_update_delete_and_expiry_free_it() {
    let env = three_shards("unique").await;
    let dev = env
        .spawn_env(&["dev", "--http", "127.0.0.1:0"], &[("BAGSTORE_EXPIRY__PROPERTY", "expires_at")])
        .await;
    let api = dev.api();
    let (a, b, c, d) = (id(0xa), id(0xb), id(0xc), id(0xd));

    // PUT: the first holder wins; the second is refused, nothing written.
    assert_eq!(api.put(&a, &json!({"email": "ann@x"})).await.0, 201);
    assert_taken(&api.put(&b, &json!({"email": "ann@x"})).await, "index_email", &a);
    assert_eq!(api.get(&b).await.0, 404, "a refused write writes nothing");
    // POST.
    assert_taken(&api.post_entity(&json!({"email": "ann@x"})).await, "index_email", &a);
    // PATCH `$set` on the indexed property; the entity stays as it was.
    assert_eq!(api.put(&b, &json!({"email": "bob@x", "n": 1})).await.0, 201);
    assert_taken(&api.patch(&b, &json!({"$set": {"email": "ann@x"}})).await, "index_email", &a);
    let (_, got) = api.get(&b).await;
    assert_eq!((&got["version"], &got["properties"]["email"]), (&json!(1), &json!("bob@x")));
    // A failed precondition is 412, not 409.
    let stale = api.put_with(&b, &json!({"email": "ann@x"}), ("If-Match", "\"7\"")).await;
    assert_eq!(stale.0, 412, "{}", stale.1);
    // Batch: the refused item's problem, the others go on; two items
    // claiming one key, the first in order wins.
    let (status, body) = api
        .batch(&[
            json!({"id": c, "email": "cat@x"}),
            json!({"id": id(0xe), "email": "ann@x"}),
            json!({"id": d, "email": "cat@x"}),
            json!({"id": id(0xf), "email": "fay@x"}),
        ])
        .await;
    assert_eq!(status, 200, "{body}");
    let results = body["results"].as_array().expect("results");
    assert_eq!((&results[0]["version"], &results[3]["version"]), (&json!(1), &json!(1)), "{body}");
    for (i, holder) in [(1, &a), (2, &c)] {
        assert_taken(
            &(results[i]["status"].as_u64().unwrap_or(0) as u16, results[i].clone()),
            "index_email",
            holder,
        );
    }
    // Kafka ingest: refused, answered `ok: false` with the same problem.
    ingest_refused(&env, &id(0x10), &a).await;

    // A keyed write's 409 replays as 409 after the key is freed.
    let keyed = ("Idempotency-Key", "unique-k1");
    assert_taken(&api.put_with(&d, &json!({"email": "ann@x"}), keyed).await, "index_email", &a);

    // Freed by an update: a moves to another email, d takes ann@x.
    assert_eq!(api.put(&a, &json!({"email": "ann2@x"})).await.0, 200);
    assert_taken(&api.put_with(&d, &json!({"email": "ann@x"}), keyed).await, "index_email", &a);
    assert_eq!(api.put(&d, &json!({"email": "ann@x"})).await.0, 201);
    // Freed by a delete: b takes cat@x once c is deleted.
    assert_taken(&api.put(&b, &json!({"email": "cat@x"})).await, "index_email", &c);
    assert_eq!(api.delete(&c).await.0, 200);
    assert_eq!(api.put(&b, &json!({"email": "cat@x"})).await.0, 200);
    // Freed by expiry, from the expiry second on.
    let at = now_secs().ceil() + 3.0;
    assert_eq!(api.put(&id(0x20), &json!({"email": "eve@x", "expires_at": at as i64})).await.0, 201);
    assert_taken(&api.put(&id(0x21), &json!({"email": "eve@x"})).await, "index_email", &id(0x20));
    eventually("the expiry second to pass", Duration::from_secs(30), || async move {
        (now_secs() >= at).then_some(())
    })
    .await;
    assert_eq!(api.put(&id(0x21), &json!({"email": "eve@x"})).await.0, 201);

    // Partial: unique among entities that match `kind = "user"` only.
    assert_eq!(api.put(&id(0x30), &json!({"handle": "h", "kind": "user"})).await.0, 201);
    assert_eq!(api.put(&id(0x31), &json!({"handle": "h", "kind": "bot"})).await.0, 201);
    assert_taken(
        &api.put(&id(0x32), &json!({"handle": "h", "kind": "user"})).await,
        "index_handle",
        &id(0x30),
    );
    // Multi-valued: each element is a key.
    assert_eq!(api.put(&id(0x40), &json!({"aliases": ["x", "y"]})).await.0, 201);
    assert_taken(&api.put(&id(0x41), &json!({"aliases": ["y", "z"]})).await, "index_alias", &id(0x40));
    assert_eq!(api.put(&id(0x41), &json!({"aliases": ["z"]})).await.0, 201);

    // A query fixing the key: its one holder, without a write token, and
    // explain says at most one.
    let (status, q) = api.query(&json!({"where": {"email": "ann@x"}})).await;
    assert_eq!(status, 200, "{q}");
    let found: Vec<&str> = q["items"].as_array().unwrap().iter().map(|e| e["id"].as_str().unwrap()).collect();
    assert_eq!((found, &q["explain"]["at_most_one"]), (vec![d.as_str()], &json!(true)), "{q}");

    // The key rows are the truth: a held row per key a live entity holds.
    let emails = eventually("the email rows to settle", Duration::from_secs(30), || async {
        let rows = key_rows(&env, "index_email", "email").await;
        let want: BTreeSet<(String, String, bool)> =
            [("ann2@x", &a), ("ann@x", &d), ("cat@x", &b), ("eve@x", &id(0x21)), ("fay@x", &id(0xf))]
                .into_iter()
                .map(|(k, e)| (k.to_string(), e.to_string(), false))
                .collect();
        // The expired holder's row is taken over; nothing else is left.
        (rows == want).then_some(rows)
    })
    .await;
    assert_eq!(emails.len(), 5);
    let aliases = key_rows(&env, "index_alias", "aliases").await;
    let want: BTreeSet<_> =
        [("x", 0x40), ("y", 0x40), ("z", 0x41)].map(|(k, n)| (k.to_string(), id(n), false)).into();
    assert_eq!(aliases, want);
    let handles = key_rows(&env, "index_handle", "handle").await;
    assert_eq!(handles, BTreeSet::from([("h".to_string(), id(0x30), false)]));
}

/// Sends a put command for `entity` with the taken `ann@x` and waits for
/// its answer: `ok: false`, the unique-violation problem naming `holder`,
/// and a dead letter.
async fn ingest_refused(env: &TestEnv, entity: &str, holder: &str) {
    let producer: FutureProducer =
        ClientConfig::new().set("bootstrap.servers", env.brokers()).create().expect("producer");
    let command =
        json!({"op": "put", "id": entity, "properties": {"email": "ann@x"}, "correlation_id": "u1"});
    producer
        .send(
            FutureRecord::to("bagstore.ingest.v1").key(entity).payload(&command.to_string()),
            Duration::from_secs(5),
        )
        .await
        .expect("command sent");
    let brokers = env.brokers();
    let read = |topic: &'static str| {
        let brokers = brokers.clone();
        async move {
            tokio::task::spawn_blocking(move || {
                bagstore_tests::model::read_messages(&brokers, topic, 4, |m| {
                    serde_json::from_slice::<Value>(m.payload().expect("payload")).expect("JSON")
                })
            })
            .await
            .unwrap()
        }
    };
    let reply = eventually("the command answered", Duration::from_secs(60), || async {
        read("bagstore.ingest.v1.replies").await.into_iter().find(|r| r["correlation_id"] == "u1")
    })
    .await;
    assert_eq!(reply["ok"], json!(false), "{reply}");
    let p = &reply["problem"];
    assert_taken(&(p["status"].as_u64().unwrap_or(0) as u16, p.clone()), "index_email", holder);
    let dead = eventually("the dead letter", Duration::from_secs(30), || async {
        let all = read("bagstore.ingest.v1.dlq").await;
        (!all.is_empty()).then_some(all)
    })
    .await;
    assert_eq!(dead.len(), 1, "{dead:?}");
}

/// The physical shard (of three) of `bytes`: the map a new cluster makes
/// gives logical shard k to physical shard k mod 3.
fn shard_of(bytes: &[u8]) -> usize {
    schemas::logical_of(bytes, schemas::shard::DEFAULT_LOGICAL_SHARDS) as usize % 3
}

fn id_bytes(hex: &str) -> Vec<u8> {
    schemas::EntityId::parse(hex).expect("id").0.to_vec()
}

/// `n` ids whose entities live on physical shard `shard`, from `from` on.
fn ids_on(shard: usize, n: usize, from: u64) -> Vec<String> {
    (from..).map(id).filter(|i| shard_of(&id_bytes(i)) == shard).take(n).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_racing_writers_on_two_shards_for_a_key_on_a_third_exactly_one_wins() {
    let env = three_shards("uniquerace").await;
    let dev = env.dev().await;
    let api = dev.api();
    for round in 0..20u64 {
        // The key on shard 2, the sixteen entities on shards 0 and 1.
        let key = (0..).map(|n| format!("race{round}.{n}@x")).find(|k| shard_of(k.as_bytes()) == 2).unwrap();
        let mut ids = ids_on(0, 8, round << 32);
        ids.extend(ids_on(1, 8, round << 32));
        let writes = ids.iter().map(|i| {
            let api = api.clone();
            let body = json!({"email": key});
            async move { (i.clone(), api.put(i, &body).await) }
        });
        let answers = futures::future::join_all(writes).await;
        let winners: Vec<&String> = answers.iter().filter(|(_, r)| r.0 == 201).map(|(i, _)| i).collect();
        assert_eq!(winners.len(), 1, "round {round}: {answers:?}");
        let winner = winners[0];
        for (i, r) in answers.iter().filter(|(i, _)| i != winner) {
            assert_taken(r, "index_email", winner);
            assert_eq!(api.get(i).await.0, 404, "round {round}: a loser wrote");
        }
        let (status, q) = api.query(&json!({"where": {"email": key}})).await;
        assert_eq!(status, 200);
        assert_eq!(q["items"].as_array().map(Vec::len), Some(1), "round {round}: {q}");
    }
    // One held row per round's key, its winner's.
    let rows = key_rows(&env, "index_email", "email").await;
    assert_eq!(rows.len(), 20, "{rows:?}");
    assert!(rows.iter().all(|(_, _, pending)| !pending), "{rows:?}");
}

/// A writer that exits (as `kill -9`) right after its first reservation,
/// asked to put `email` on `entity`: it dies without answering.
async fn dies_reserving(env: &TestEnv, reservation_ms: &str, entity: &str, email: &str) {
    let doomed = env
        .spawn_env(
            &["writer", "--http", "127.0.0.1:0"],
            &[
                ("BAGSTORE_WRITER__DRILL_EXIT_AFTER_RESERVE", "true"),
                ("BAGSTORE_WRITER__UNIQUE_RESERVATION_MS", reservation_ms),
            ],
        )
        .await;
    let (api, entity, body) = (doomed.api(), entity.to_string(), json!({ "email": email }));
    let died = tokio::spawn(async move { api.put(&entity, &body).await });
    assert!(died.await.is_err(), "the drill's writer answered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_killed_between_reserving_and_committing_blocks_the_key_only_until_taken_over_or_cleaned() {
    let env = three_shards("uniquekill").await;
    let reservation_ms = "3000";
    let second = id(0x52);
    dies_reserving(&env, reservation_ms, &id(0x51), "orphan@x").await;
    // Its reservation is left, pending, naming an entity that never was.
    let rows = key_rows(&env, "index_email", "email").await;
    assert_eq!(rows, BTreeSet::from([("orphan@x".to_string(), id(0x51), true)]));
    let writer = env
        .spawn_env(
            &["writer", "--http", "127.0.0.1:0"],
            &[("BAGSTORE_WRITER__UNIQUE_RESERVATION_MS", reservation_ms)],
        )
        .await;
    let started = std::time::Instant::now();
    let (status, body) = writer.api().put(&second, &json!({"email": "orphan@x"})).await;
    let waited = started.elapsed();
    assert_eq!(status, 201, "{body}");
    assert!(waited < Duration::from_millis(3000 + 5000), "the orphan blocked the key for {waited:?}");
    let rows = key_rows(&env, "index_email", "email").await;
    assert_eq!(rows, BTreeSet::from([("orphan@x".to_string(), second.clone(), false)]));
    // A second orphan no writer wants: the cleaner removes it once its
    // reservation ran out.
    dies_reserving(&env, reservation_ms, &id(0x53), "lone@x").await;
    assert_eq!(key_rows(&env, "index_email", "email").await.len(), 2);
    let _cleaner = env
        .spawn_env(&["cleaner", "--http", "127.0.0.1:0"], &[("BAGSTORE_CLEANER__INTERVAL_MS", "200")])
        .await;
    eventually("the cleaner to remove the orphan", Duration::from_secs(60), || async {
        let rows = key_rows(&env, "index_email", "email").await;
        (rows == BTreeSet::from([("orphan@x".to_string(), second.clone(), false)])).then_some(())
    })
    .await;
    // The dead writes' tokens are revoked: they can never commit.
    let revoked: Vec<(usize, (i64,))> =
        env.fetch_all_shards("SELECT COUNT(*) FROM bagstore_unique_claims WHERE NOT claimed").await;
    assert_eq!(revoked.iter().map(|(_, (n,))| n).sum::<i64>(), 2, "{revoked:?}");
    let stored: Vec<(usize, (i64,))> = env
        .fetch_all_shards(&format!(
            "SELECT COUNT(*) FROM entities WHERE id IN (UNHEX('{}'), UNHEX('{}'))",
            id(0x51),
            id(0x53)
        ))
        .await;
    assert_eq!(stored.iter().map(|(_, (n,))| n).sum::<i64>(), 0, "a dead write's entity was stored");
}

/// `index_email`'s entry in `GET /v1/indexes`.
async fn email_index(api: &bagstore_tests::Api) -> Value {
    let (status, body) = api.indexes().await;
    assert_eq!(status, 200, "{body}");
    body["indexes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["table"] == "index_email")
        .cloned()
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_over_duplicates_is_conflicted_until_they_are_fixed_then_enforces() {
    let mut env = TestEnv::new("uniquefill", "").await;
    env.migrate().await;
    let plain = env.dev().await;
    let (a, b, c, d) = (id(0x61), id(0x62), id(0x63), id(0x64));
    for (i, email) in [(&a, "dup@x"), (&b, "dup@x"), (&c, "one@x")] {
        assert_eq!(plain.api().put(i, &json!({"email": email})).await.0, 201);
    }
    plain.terminate().await;
    // The unique index added over data that already has a duplicate.
    env.indexes_toml = UNIQUE_INDEXES.to_string();
    env.migrate().await;
    let dev = env.dev().await;
    let api = dev.api();
    let entry = eventually("the backfill to find the clash", Duration::from_secs(60), || async {
        let e = email_index(&api).await;
        (e["state"] == "CONFLICTED").then_some(e)
    })
    .await;
    let mut pair = [a.clone(), b.clone()];
    pair.sort();
    assert_eq!(entry["conflicts"], json!([{"key": ["dup@x"], "ids": pair}]), "{entry}");
    // Not enforced while CONFLICTED.
    assert_eq!(api.put(&d, &json!({"email": "dup@x"})).await.0, 201);
    // The data fixed, the backfill run again completes and enforces.
    assert_eq!(api.delete(&b).await.0, 200);
    assert_eq!(api.delete(&d).await.0, 200);
    let (ok, out, err) = env.run(&env.args(&["cleaner", "--index", "index_email"]), &[]).await;
    assert!(ok, "{out}{err}");
    let entry = email_index(&api).await;
    assert_eq!((&entry["state"], entry.get("conflicts")), (&json!("ACTIVE"), None), "{entry}");
    // The backfill returns once every writer enforces it (they read the
    // catalog every second; it waits three, then looks again at what was
    // written meanwhile).
    assert_taken(&api.put(&id(0x65), &json!({"email": "one@x"})).await, "index_email", &c);
    assert_taken(&api.put(&b, &json!({"email": "dup@x"})).await, "index_email", &a);
    let rows = key_rows(&env, "index_email", "email").await;
    let want: BTreeSet<_> =
        [("dup@x", &a), ("one@x", &c)].map(|(k, e)| (k.to_string(), e.clone(), false)).into();
    assert_eq!(rows, want);
}
