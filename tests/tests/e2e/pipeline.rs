//! End-to-end: put → outbox → Kafka → indexer → index tables → reader,
//! through real InnoDB shards, a Kafka-protocol broker and the real binary.

use bagstore_tests::{eventually, metric_sum, until_query_is, TestEnv, STANDARD_INDEXES};
use serde_json::{json, Value};
use std::time::Duration;

const SEED_ID: &str = "71f0c4d2291844cca2df6f486e96e37c";
const SEED_USER: &str = "f48b0440ca0c4f66991c4d5f6a078eaf";

fn seed_entity() -> Value {
    json!({
        "id": SEED_ID,
        "user_id": SEED_USER,
        "feed_id": SEED_USER,
        "title": "We just launched a new backend system for FriendFeed!",
        "link": "http://friendfeed.com/e/71f0c4d2-2918-44cc-a2df-6f486e96e37c",
        "published": 1235697046,
        "updated": 1235697046,
    })
}

fn by_user(user: &str) -> Value {
    json!({"index": "index_user_id", "where": {"user_id": user}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_seed_entity_is_found_through_its_index_and_follows_updates_and_deletes() {
    let env = TestEnv::new("seed", STANDARD_INDEXES).await;
    let dev = env.dev().await;
    let api = dev.api();

    let (status, body) = api.post_entity(&seed_entity()).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!((body["id"].clone(), body["version"].clone()), (json!(SEED_ID), json!(1)), "{body}");
    assert_eq!(body["write_token"], format!("{SEED_ID}.1"));

    let (status, got) = api.get(SEED_ID).await;
    assert_eq!(status, 200);
    let mut expected = seed_entity();
    expected.as_object_mut().unwrap().remove("id");
    assert_eq!(got["properties"], expected);
    assert_eq!(got["version"], 1);
    assert_eq!(got["id"], SEED_ID);
    // The dashed form names the same entity.
    assert_eq!(api.get("71f0c4d2-2918-44cc-a2df-6f486e96e37c").await.0, 200);

    until_query_is(&api, &by_user(SEED_USER), &[SEED_ID]).await;
    // A uuid-typed condition compares bytes: the dashed upper-case form finds it too.
    until_query_is(&api, &by_user("F48B0440-CA0C-4F66-991C-4D5F6A078EAF"), &[SEED_ID]).await;

    let new_user = "0123456789abcdef0123456789abcdef";
    let mut moved = seed_entity();
    moved["user_id"] = json!(new_user);
    let (status, body) = api.put(SEED_ID, &moved).await;
    assert_eq!((status, body["version"].clone()), (200, json!(2)));
    until_query_is(&api, &by_user(new_user), &[SEED_ID]).await;
    until_query_is(&api, &by_user(SEED_USER), &[]).await;

    let (status, body) = api.delete(SEED_ID).await;
    assert_eq!((status, body["version"].clone()), (200, json!(3)));
    assert_eq!(api.get(SEED_ID).await.0, 404);
    assert_eq!(api.delete(SEED_ID).await.0, 404);
    until_query_is(&api, &by_user(new_user), &[]).await;
    until_query_is(&api, &by_user(SEED_USER), &[]).await;
    // The index tables end empty: the delete removed the row, not just hid it.
    eventually("index_user_id to be empty", Duration::from_secs(10), || async {
        (env.count_rows("index_user_id").await == 0).then_some(())
    })
    .await;
    // Re-creating continues the version sequence from the tombstone.
    let (status, body) = api.put(SEED_ID, &seed_entity()).await;
    assert_eq!((status, body["version"].clone()), (201, json!(4)));
    until_query_is(&api, &by_user(SEED_USER), &[SEED_ID]).await;
    dev.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compound_partial_in_and_array_indexes_answer_exactly() {
    let env = TestEnv::new("shapes", STANDARD_INDEXES).await;
    let dev = env.dev().await;
    let api = dev.api();
    let put = |id: &'static str, body: Value| {
        let api = api.clone();
        async move {
            let (s, b) = api.put(id, &body).await;
            assert!(s == 201 || s == 200, "{b}");
        }
    };
    let a = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    let b = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";
    let c = "cccccccccccccccccccccccccccccccc";
    let d = "dddddddddddddddddddddddddddddddd";
    put(a, json!({"first_name": "Bret", "last_name": "Taylor", "bar": 1, "m": "right", "tags": ["x", "y"]}))
        .await;
    put(b, json!({"first_name": "Bret", "bar": 1, "m": "wrong", "tags": "y"})).await;
    put(c, json!({"first_name": "Paul", "last_name": "Buchheit", "bar": 2, "m": "right", "tags": []})).await;
    put(d, json!({"first_name": "Bret", "last_name": "Taylor", "bar": "1", "m": "right", "tags": ["z", 5]}))
        .await;

    let name = |f: Value, l: Value| json!({"where": {"first_name": f, "last_name": l}});
    until_query_is(&api, &name(json!("Bret"), json!("Taylor")), &[a, d]).await;
    until_query_is(
        &api,
        &name(json!({"in": ["Bret", "Paul"]}), json!({"in": ["Taylor", "Buchheit"]})),
        &[a, c, d],
    )
    .await;
    // Conditions beyond the index are filters on the fetched entity.
    until_query_is(&api, &json!({"where": {"first_name": "Bret", "last_name": "Taylor", "bar": 1}}), &[a])
        .await;
    // Partial index: only m = "right" entities, and only int bars.
    until_query_is(&api, &json!({"index": "index_foo", "where": {"bar": 1}}), &[a]).await;
    until_query_is(&api, &json!({"index": "index_foo", "where": {"bar": {"in": [1, 2]}}}), &[a, c]).await;
    // Arrays are indexed once per element.
    until_query_is(&api, &json!({"where": {"tags": "y"}}), &[a, b]).await;
    until_query_is(&api, &json!({"where": {"tags": "z"}}), &[d]).await;
    until_query_is(&api, &json!({"where": {"tags": {"in": ["x", "z"]}}}), &[a, d]).await;

    // The partial index holds only matching rows, and the compound one only
    // entities with both names: counted in the tables themselves.
    assert_eq!(env.count_rows("index_foo").await, 2);
    assert_eq!(env.count_rows("index_user_name").await, 3);
    assert_eq!(env.count_rows("index_tag").await, 4);

    // Leaving the partial index: m changes → the row goes.
    put(a, json!({"first_name": "Bret", "last_name": "Taylor", "bar": 1, "m": "left", "tags": ["x", "y"]}))
        .await;
    until_query_is(&api, &json!({"index": "index_foo", "where": {"bar": 1}}), &[]).await;
    eventually("index_foo to shrink", Duration::from_secs(10), || async {
        (env.count_rows("index_foo").await == 1).then_some(())
    })
    .await;
    dev.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hand_made_index_rows_never_reach_query_results() {
    let env = TestEnv::new("invariant_r", STANDARD_INDEXES).await;
    // The in-process cleaner would repair the hand-made rows this test
    // plants (that is its job, tested elsewhere); here it sleeps after its
    // first cycle so the reader alone faces them.
    let dev = env
        .spawn_env(&["dev", "--http", "127.0.0.1:0"], &[("BAGSTORE_CLEANER__INTERVAL_MS", "600000")])
        .await;
    let api = dev.api();
    let user = "5555aaaa5555aaaa5555aaaa5555aaaa";
    let other_user = "6666bbbb6666bbbb6666bbbb6666bbbb";
    let real = "10000000000000000000000000000001";
    let elsewhere = "20000000000000000000000000000002";
    api.put(real, &json!({"user_id": user, "first_name": "A", "last_name": "B"})).await;
    api.put(elsewhere, &json!({"user_id": other_user, "first_name": "A", "last_name": "C"})).await;
    until_query_is(&api, &json!({"where": {"user_id": user}}), &[real]).await;
    until_query_is(&api, &json!({"where": {"user_id": other_user}}), &[elsewhere]).await;

    // Rows on the shard that owns `user`: one pointing at an entity that
    // does not match, one at an id that does not exist.
    let user_bytes = hex(user);
    let shard = schemas::shard::initial_position_of(&user_bytes, env.dsns.len());
    let pool = env.pool(shard).await;
    for (entity, version) in [(hex(elsewhere), 1u64), (hex("30000000000000000000000000000003"), 9)] {
        sqlx::query("INSERT INTO index_user_id (user_id, entity_id, version, logical) VALUES (?, ?, ?, ?)")
            .bind(&user_bytes)
            .bind(&entity)
            .bind(version)
            .bind(schemas::logical_of(&user_bytes, 4096))
            .execute(&pool)
            .await
            .unwrap();
    }
    // And a compound-index row for a name the entity does not have.
    let name_shard = schemas::shard::initial_position_of(b"A", env.dsns.len());
    let name_pool = env.pool(name_shard).await;
    sqlx::query(
        "INSERT INTO index_user_name (first_name, last_name, entity_id, version, logical) VALUES ('A', 'Z', ?, 1, ?)",
    )
    .bind(hex(real))
    .bind(schemas::logical_of(b"A", 4096))
    .execute(&name_pool)
    .await
    .unwrap();

    let (status, body) = api.query(&json!({"where": {"user_id": user}})).await;
    assert_eq!(status, 200);
    let ids: Vec<&str> =
        body["items"].as_array().unwrap().iter().map(|e| e["id"].as_str().unwrap()).collect();
    assert_eq!(ids, vec![real], "{body}");
    assert_eq!(body["explain"]["index_rows_read"], 3, "{body}");
    assert_eq!(body["explain"]["dropped_by_refilter"], 2, "{body}");
    assert!(api.query_ids(&json!({"where": {"first_name": "A", "last_name": "Z"}})).await.is_empty());
    let metrics = api.metrics().await;
    assert!(
        metric_sum(&metrics, "bagstore_reader_refilter_dropped_total", &[("index", "index_user_id")]) >= 2.0
    );
    dev.terminate().await;
}

fn hex(s: &str) -> Vec<u8> {
    schemas::EntityId::parse(s).unwrap().0.to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writes_of_one_new_id_get_distinct_versions() {
    let env = TestEnv::new("samenewid", STANDARD_INDEXES).await;
    let dev = env.dev().await;
    let api = dev.api();
    // Rounds of 8 simultaneous PUTs, each round on an id nobody wrote yet:
    // the first to commit creates it, every other one must either get its
    // own later version or be retried into one, never share version 1.
    for round in 0..5u64 {
        let id = format!("{:032x}", 0x5a5e_0000u64 + round);
        let puts: Vec<_> = (0..8)
            .map(|n| {
                let (api, id) = (api.clone(), id.clone());
                tokio::spawn(
                    async move { api.put(&id, &json!({"user_id": format!("{:032x}", n + 1)})).await },
                )
            })
            .collect();
        let mut versions = Vec::new();
        for p in puts {
            let (status, body) = p.await.unwrap();
            assert!(status == 200 || status == 201, "{status} {body}");
            versions.push(body["version"].as_u64().unwrap());
        }
        versions.sort();
        assert_eq!(versions, (1..=8).collect::<Vec<u64>>(), "round {round}: versions {versions:?}");
        assert_eq!(api.get(&id).await.1["version"], 8);
    }
    dev.terminate().await;
}

/// How long a write may take to show up through its index right after
/// `dev`'s ready line. Steady state on the two-core test machine (the
/// same writes and queries once the first are found, measured by this
/// test and printed): 25 to 60 ms from the write's answer to the query
/// finding it. 1 s leaves room for a loaded machine while still telling a
/// consumer that holds its partitions from one still taking them:
/// before the ready line waited for that, the first write here took 2.8
/// and 3.1 s (3.2 s in the report that asked for this).
const FRESH_AFTER_READY: Duration = Duration::from_secs(1);

/// From a write's answer to its entity being found through `q`, polling
/// every 5 ms for up to `within` and then a while longer (so a failure
/// says how long it really took); None if it never showed up.
async fn found_after(api: &bagstore_tests::Api, q: &Value, id: &str, within: Duration) -> Option<Duration> {
    let start = std::time::Instant::now();
    while start.elapsed() < within + Duration::from_secs(10) {
        if api.query_ids(q).await == [id.to_string()] {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    None
}

/// "Ready means ready": a write made right after `dev`'s ready line is
/// found through its index as fast as in steady state, because the ready
/// line waits until every index consumer holds its partitions (and has
/// claimed them). Two indexes, each written right after the line; then
/// the same again in steady state, for the comparison in the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_right_after_the_ready_line_is_found_through_its_index_at_steady_state_speed() {
    let env = TestEnv::new("readymeans", STANDARD_INDEXES).await;
    let dev = env.dev().await;
    let api = dev.api();
    let cases = |round: u64| {
        let user = format!("{:032x}", 0x7eadu64 << 32 | round);
        let tag = format!("fresh-{round}");
        [
            (
                format!("{:032x}", 0x1000 + round),
                json!({"user_id": user}),
                json!({"where": {"user_id": user}}),
            ),
            (format!("{:032x}", 0x2000 + round), json!({"tags": [tag]}), json!({"where": {"tags": tag}})),
        ]
    };
    let mut after_ready = Vec::new();
    for (id, body, q) in cases(0) {
        let (status, reply) = api.put(&id, &body).await;
        assert_eq!(status, 201, "{reply}");
        after_ready.push(found_after(&api, &q, &id, FRESH_AFTER_READY).await);
    }
    let mut steady = Vec::new();
    for round in 1..=3 {
        for (id, body, q) in cases(round) {
            let (status, reply) = api.put(&id, &body).await;
            assert_eq!(status, 201, "{reply}");
            steady.push(found_after(&api, &q, &id, FRESH_AFTER_READY).await);
        }
    }
    eprintln!("found through the index: right after ready {after_ready:?}; steady state {steady:?}");
    for took in after_ready.iter().chain(&steady) {
        assert!(
            took.is_some_and(|t| t <= FRESH_AFTER_READY),
            "a write took {took:?} to be found through its index (bound {FRESH_AFTER_READY:?}); \
             right after the ready line {after_ready:?}, in steady state {steady:?}"
        );
    }
    dev.terminate().await;
}
