//! The hot paths: group commit, ping-free connections, remembered entity
//! locations.
//!
//! - Single writes that queue behind a busy shard commit together in one
//!   transaction, and each still gets its own answer (201, 412, 404).
//! - A connection killed on the server costs no request: the reader runs
//!   its read again on a new connection, and the writer moves a write whose
//!   BEGIN found the connection dead to a new one.
//! - The reader fetches entities it has seen by their row's clustered key;
//!   a remembered key that no longer holds the entity costs a second
//!   statement (by id), never a wrong or missing answer.
//! - A batch on a store whose tables are still small locks only the rows
//!   and keys it asks for (its locking reads name their key: a scan would
//!   wait on every row another transaction holds).
//! - Index rows say where their entity's row is (written by the indexer
//!   from the change event, by the backfill, repaired by the cleaner), so a
//!   query reads entities by clustered key; a wrong or missing location
//!   costs a fetch by id, never a wrong answer.

use bagstore_tests::{eventually, metric_sum, TestEnv, STANDARD_INDEXES};
use schemas::EntityId;
use serde_json::json;
use sqlx::MySqlPool;
use std::time::Duration;

/// `count` ids (hex) that live on `shard` of 2, made from `seed`.
pub(crate) fn ids_on(shard: usize, seed: u8, count: usize) -> Vec<String> {
    (0u32..)
        .map(|i| {
            let mut b = [seed; 16];
            b[..4].copy_from_slice(&i.to_be_bytes());
            EntityId(b)
        })
        .filter(|id| schemas::shard::initial_position_of(id.as_bytes(), 2) == shard)
        .take(count)
        .map(|id| id.to_hex())
        .collect()
}

/// Write transactions (their locking read) waiting for the table lock.
async fn writes_waiting_on_lock(admin: &MySqlPool, db: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.processlist \
         WHERE db = ? AND state LIKE 'Waiting for table%' AND info LIKE '%FOR UPDATE%'",
    )
    .bind(db)
    .fetch_one(admin)
    .await
    .expect("processlist")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_writes_queued_behind_a_busy_shard_commit_together_and_keep_their_own_answers() {
    let env = TestEnv::new("group", STANDARD_INDEXES).await;
    let dev = env.dev().await;
    let api = dev.api();
    let ids = ids_on(0, 0x5a, 11);
    let (existing, blockers, fresh, absent) = (&ids[0], &ids[1..3], &ids[3..10], &ids[10]);
    assert_eq!(api.put(existing, &json!({"user_id": existing, "n": 1})).await.0, 201);

    // Hold shard 0's entities table, so both commit slots of shard 0 block.
    let admin = env.pool(0).await;
    let db = env.dsns[0].rsplit('/').next().unwrap().to_string();
    let mut lock = admin.acquire().await.expect("connection");
    sqlx::query(&format!("LOCK TABLES `{db}`.`entities` WRITE")).execute(&mut *lock).await.expect("lock");
    // One blocker at a time: two sent together can queue before a slot
    // takes them, and then share one transaction, leaving a slot free.
    let mut blocked = Vec::new();
    for (n, id) in blockers.iter().enumerate() {
        let (api, id) = (api.clone(), id.clone());
        blocked.push(tokio::spawn(async move { api.put(&id, &json!({"n": 0})).await }));
        eventually(
            &format!("{} commit slot(s) wait for the lock", n + 1),
            Duration::from_secs(20),
            || async { (writes_waiting_on_lock(&admin, &db).await == n as i64 + 1).then_some(()) },
        )
        .await;
    }

    // Everything sent now queues: new ids, preconditions that fail, a
    // delete of an absent id.
    let mut queued = Vec::new();
    for id in fresh {
        let (api, id) = (api.clone(), id.clone());
        queued.push(tokio::spawn(async move { ("put", api.put(&id, &json!({"n": 2})).await) }));
    }
    for header in [("If-Match", "\"7\""), ("If-Match", "\"0\""), ("If-None-Match", "*")] {
        let (api, id) = (api.clone(), existing.clone());
        queued.push(tokio::spawn(async move {
            ("precondition", api.put_with(&id, &json!({"n": 3}), header).await)
        }));
    }
    {
        let (api, id) = (api.clone(), absent.clone());
        queued.push(tokio::spawn(async move { ("delete", api.delete(&id).await) }));
    }
    let metrics_api = api.clone();
    eventually("11 writes wait for a commit slot", Duration::from_secs(20), || async {
        let text = metrics_api.metrics().await;
        (metric_sum(&text, "bagstore_writer_commit_queue_writes", &[("shard", "0")]) == 11.0).then_some(())
    })
    .await;
    sqlx::query("UNLOCK TABLES").execute(&mut *lock).await.expect("unlock");

    for b in blocked {
        assert_eq!(b.await.unwrap().0, 201);
    }
    for q in queued {
        let (what, (status, body)) = q.await.unwrap();
        match what {
            "put" => assert_eq!(status, 201, "{body}"),
            "precondition" => {
                assert_eq!((status, body["current_version"].clone()), (412, json!(1)), "{body}")
            }
            _ => assert_eq!(status, 404, "{body}"),
        }
    }
    // The 11 went in one transaction: one group of more than 8 writes.
    let text = api.metrics().await;
    let groups = metric_sum(&text, "bagstore_writer_commit_group_writes_count", &[("shard", "0")]);
    let small =
        metric_sum(&text, "bagstore_writer_commit_group_writes_bucket", &[("shard", "0"), ("le", "8")]);
    assert_eq!(groups - small, 1.0, "exactly one group of more than 8 writes:\n{text}");
    assert_eq!(metric_sum(&text, "bagstore_writer_commit_queue_writes", &[("shard", "0")]), 0.0);
    // Stored: the new ids at version 1, the existing entity untouched.
    assert_eq!(api.get(existing).await.1["version"], 1);
    for (id, n) in fresh.iter().map(|id| (id, 2)).chain(blockers.iter().map(|id| (id, 0))) {
        let (status, got) = api.get(id).await;
        assert_eq!(
            (status, got["version"].clone(), got["properties"]["n"].clone()),
            (200, json!(1), json!(n)),
            "{id}"
        );
    }
    assert_eq!(api.get(absent).await.0, 404);
    // 1 + 2 + 7 committed writes on shard 0; the 4 refused ones wrote nothing.
    assert_eq!(metric_sum(&text, "bagstore_writer_writes_total", &[("shard", "0")]), 10.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_killed_on_the_server_cost_no_request() {
    let env = TestEnv::new("killed", STANDARD_INDEXES).await;
    let dev = env.dev().await;
    let api = dev.api();
    let ids: Vec<String> = (0..2).flat_map(|s| ids_on(s, 0x6b, 2)).collect();
    for id in &ids {
        assert_eq!(api.put(id, &json!({"user_id": id})).await.0, 201);
        assert_eq!(api.get(id).await.0, 200);
    }
    let q = json!({"index": "index_user_id", "where": {"user_id": ids[0]}});
    eventually("the query finds the entity", Duration::from_secs(20), || async {
        (api.query_ids(&q).await == vec![ids[0].clone()]).then_some(())
    })
    .await;

    for round in 0..3 {
        // Every connection of the service, on both shards, killed at once;
        // the next requests come well within the 1 s that connections are
        // reused without a ping.
        let killed = kill_every_connection(&env).await;
        assert!(killed >= 2, "round {round}: only {killed} connections to kill");
        // Writes first: the connections they take are the killed ones (reads
        // that ran first would leave new connections on top of the list).
        for id in &ids {
            let (status, body) = api.put(id, &json!({"user_id": id, "round": round})).await;
            assert_eq!(status, 200, "round {round}: PUT after the kill: {body}");
        }
        for kill_first in [false, true] {
            if kill_first {
                kill_every_connection(&env).await;
            }
            for id in &ids {
                let (status, body) = api.get(id).await;
                assert_eq!(status, 200, "round {round}: GET after the kill: {body}");
            }
        }
        let (status, body) = api.query(&q).await;
        assert_eq!(status, 200, "round {round}: query after the kill: {body}");
    }
}

/// The reader's entity fetches counted `by` "id", "location" or "stale".
fn fetched(metrics: &str, by: &str) -> f64 {
    metric_sum(metrics, "bagstore_reader_entity_fetches_total", &[("by", by)])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remembered_location_that_no_longer_holds_the_entity_falls_back_to_its_id() {
    let env = TestEnv::new("locations", STANDARD_INDEXES).await;
    let dev = env.dev().await;
    let api = dev.api();
    let ids: Vec<String> = (0..2).flat_map(|s| ids_on(s, 0x7c, 2)).collect();
    for (n, id) in ids.iter().enumerate() {
        assert_eq!(api.put(id, &json!({"user_id": id, "n": n})).await.0, 201);
    }
    let read_all = || async {
        for (n, id) in ids.iter().enumerate() {
            let (status, body) = api.get(id).await;
            assert_eq!(status, 200, "GET {id}: {body}");
            assert_eq!(body["properties"]["n"], json!(n), "GET {id}: {body}");
        }
    };
    // The first reads go by id and learn where the rows are; the second
    // ones use that.
    read_all().await;
    read_all().await;
    let text = api.metrics().await;
    assert_eq!((fetched(&text, "id"), fetched(&text, "location"), fetched(&text, "stale")), (4.0, 4.0, 0.0));
    // An id asked twice is answered and fetched once.
    let (status, doc) = api.get_many(&[&ids[1], &ids[1], &ids[2]]).await;
    assert_eq!(status, 200, "{doc}");
    let got: Vec<&str> = doc["items"].as_array().unwrap().iter().map(|e| e["id"].as_str().unwrap()).collect();
    assert_eq!(got, [ids[1].as_str(), ids[2].as_str()]);
    let text = api.metrics().await;
    assert_eq!((fetched(&text, "location"), fetched(&text, "stale")), (6.0, 0.0));

    // Move every row to another clustered key behind the reader's back.
    for shard in 0..2 {
        let admin = env.pool(shard).await;
        sqlx::query("UPDATE entities SET added_id = added_id + 1000000").execute(&admin).await.expect("move");
        admin.close().await;
    }
    read_all().await;
    let text = api.metrics().await;
    assert_eq!(fetched(&text, "stale"), 4.0, "the moved rows were not noticed:\n{text}");
    // Learned again: by location once more.
    read_all().await;
    let text = api.metrics().await;
    assert_eq!((fetched(&text, "location"), fetched(&text, "stale")), (10.0, 4.0));

    // A deleted entity is found deleted where it was, with no second look.
    assert_eq!(api.delete(&ids[0]).await.0, 200);
    assert_eq!(api.get(&ids[0]).await.0, 404);
    let text = api.metrics().await;
    assert_eq!((fetched(&text, "location"), fetched(&text, "stale")), (11.0, 4.0));
}

#[tokio::test]
async fn index_rows_say_where_their_entities_are_and_a_wrong_location_costs_no_answer() {
    let env = TestEnv::new("rowlocations", STANDARD_INDEXES).await;
    // Its own cleaner waits an hour between sweeps: the wrong locations
    // below must stay wrong until a cleaner is asked to repair them.
    let dev = env
        .spawn_env(&["dev", "--http", "127.0.0.1:0"], &[("BAGSTORE_CLEANER__INTERVAL_MS", "3600000")])
        .await;
    let api = dev.api();
    let user = "5ca1ab1e5ca1ab1e5ca1ab1e5ca1ab1e";
    // New entities in multi-row inserts (a batch: three per shard), one at
    // a time, and an update (the row existed: its location is read).
    let ids: Vec<String> = (0..2).flat_map(|s| ids_on(s, 0x3d, 5)).collect();
    let batch: Vec<_> =
        ids[..3].iter().chain(&ids[5..8]).map(|id| json!({"id": id, "user_id": user})).collect();
    let (status, doc) = api.batch(&batch).await;
    assert_eq!(status, 200, "{doc}");
    for id in ids[3..5].iter().chain(&ids[8..]) {
        assert_eq!(api.put(id, &json!({"user_id": user})).await.0, 201);
    }
    assert_eq!(api.put(&ids[0], &json!({"user_id": user, "n": 1})).await.0, 200);
    env.until_caught_up(&["index_user_id"]).await;
    let rows = env.index_row_locations("index_user_id").await;
    assert_eq!(rows.len(), 10);
    for r in rows {
        assert!(r.given.is_some() && r.given == r.actual, "{r:?}");
    }

    let q = json!({"index": "index_user_id", "where": {"user_id": user}, "limit": 20});
    // The query's ids, sorted (the order is the index's, not the test's).
    let sorted_ids = || async {
        let mut got = api.query_ids(&q).await;
        got.sort();
        got
    };
    let mut all = ids.clone();
    all.sort();
    assert_eq!(sorted_ids().await, all);
    // Local entities came with the scan, the others by their location: no
    // fetch by id at all.
    let text = api.metrics().await;
    assert_eq!((fetched(&text, "id"), fetched(&text, "stale")), (0.0, 0.0), "{text}");

    // Wrong locations, then none: the same answer, at the cost of fetches
    // by id (the local ones miss the join, and every given location is
    // stale: counted as such, then fetched by id).
    let shard = schemas::shard::initial_position_of(&EntityId::parse(user).unwrap().0, 2);
    let admin = env.pool(shard).await;
    sqlx::query("UPDATE index_user_id SET entity_added_id = entity_added_id + 1000000")
        .execute(&admin)
        .await
        .expect("move");
    assert_eq!(sorted_ids().await, all);
    let text = api.metrics().await;
    assert_eq!((fetched(&text, "id"), fetched(&text, "stale")), (0.0, 10.0), "{text}");
    sqlx::query("UPDATE index_user_id SET entity_added_id = NULL").execute(&admin).await.expect("forget");
    assert_eq!(sorted_ids().await, all);

    // A cleaner writes the locations back.
    let cleaner = env.spawn_env(&["cleaner"], &[("BAGSTORE_CLEANER__INTERVAL_MS", "200")]).await;
    eventually("the cleaner to write every location back", Duration::from_secs(60), || async {
        let rows = env.index_row_locations("index_user_id").await;
        rows.iter().all(|r| r.given.is_some() && r.given == r.actual).then_some(())
    })
    .await;
    let m = cleaner.api().metrics().await;
    let drift = |name: &str| metric_sum(&m, name, &[("index", "index_user_id"), ("kind", "location")]);
    assert_eq!(
        (drift("bagstore_cleaner_drift_found_total"), drift("bagstore_cleaner_drift_fixed_total")),
        (10.0, 10.0),
        "{m}"
    );
    cleaner.terminate().await;

    // A table made before the column existed gets it from migrate.
    sqlx::query("ALTER TABLE index_tag DROP COLUMN entity_added_id")
        .execute(&admin)
        .await
        .expect("drop column");
    env.migrate().await;
    let (n,): (i64,) = sqlx::query_as(
        "SELECT COUNT(*) FROM information_schema.COLUMNS \
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'index_tag' AND COLUMN_NAME = 'entity_added_id'",
    )
    .fetch_one(&admin)
    .await
    .unwrap();
    assert_eq!(n, 1);
    admin.close().await;
    dev.terminate().await;
}

/// New rows' locations come from `LAST_INSERT_ID()` (numbered on, where
/// the server numbers a multi-row insert consecutively) or are read back;
/// either way each is that row's own `added_id`.
#[tokio::test]
async fn inserted_entities_report_their_own_locations_both_ways() {
    let env = TestEnv::new("insertlocations", "").await;
    env.migrate().await;
    let pool = env.pool(0).await;
    let mut conn = pool.acquire().await.unwrap();
    // MariaDB's default (innodb_autoinc_lock_mode = 1) numbers them on.
    assert!(storage::entities::autoinc_is_consecutive(0, &mut conn).await.unwrap());
    for (round, consecutive) in [(1u8, true), (2, false), (3, true)] {
        // Ids out of order, so the read-back must match rows by id.
        let rows: Vec<storage::EntityWrite> = [5u8, 1, 4, 2, 3]
            .iter()
            .map(|i| storage::EntityWrite {
                id: EntityId([round * 16 + i; 16]),
                logical: schemas::logical_of(&[round * 16 + i; 16], 4096),
                version: 1,
                updated_us: 1_700_000_000_000_000,
                body: Some(vec![*i]),
                expires_us: None,
            })
            .collect();
        let added = storage::entities::insert_entities(0, &mut conn, &rows, consecutive).await.unwrap();
        assert_eq!(added.len(), rows.len());
        for (storage::EntityWrite { id, .. }, at) in rows.iter().zip(added) {
            let (real,): (u64,) = sqlx::query_as("SELECT added_id FROM entities WHERE id = ?")
                .bind(&id.0[..])
                .fetch_one(&pool)
                .await
                .unwrap();
            assert_eq!(at, Some(real), "round {round}, consecutive {consecutive}, entity {id}");
        }
    }
    drop(conn);
    pool.close().await;
}

/// Kills every connection to this test's databases (but the killer's own);
/// returns how many.
async fn kill_every_connection(env: &TestEnv) -> usize {
    let mut killed = 0;
    for shard in 0..2 {
        let admin = env.pool(shard).await;
        let db = env.dsns[shard].rsplit('/').next().unwrap().to_string();
        let victims: Vec<i64> = sqlx::query_scalar(
            "SELECT id FROM information_schema.processlist WHERE db = ? AND id <> CONNECTION_ID()",
        )
        .bind(&db)
        .fetch_all(&admin)
        .await
        .expect("processlist");
        for v in victims {
            if sqlx::query(&format!("KILL CONNECTION {v}")).execute(&admin).await.is_ok() {
                killed += 1;
            }
        }
        admin.close().await;
    }
    killed
}

/// A batch of new entities on a store whose tables are still small is not
/// held up by a row another transaction has locked. The optimizer scans a
/// table it counts a few rows in for an `IN` list of more ids than that, and
/// a locking read that scans waits on every locked row it passes: the
/// writer's lock of the batch's ids (and of its unique keys) would wait on
/// rows it never asked for, here until the commit timeout (503).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_on_small_tables_does_not_wait_on_rows_it_did_not_ask_for() {
    use sqlx::{Connection, MySqlConnection};
    // `index_email` is unique: a batch reserves its keys in one locking
    // read per shard.
    let env = TestEnv::new("smalltables", crate::unique::UNIQUE_INDEXES).await;
    let dev = env.dev().await;
    let api = dev.api();
    let ids = ids_on(0, 0x6b, 43);
    let (seeds, batch) = (&ids[..3], &ids[3..]);
    // A few entities with keys, until each shard holds a key row.
    for (n, id) in seeds.iter().enumerate() {
        assert_eq!(api.put(id, &json!({"email": format!("seed{n}@example.org")})).await.0, 201);
    }
    let every_shard_has_a_key = || async {
        let counts = env.fetch_all_shards::<(i64,)>("SELECT COUNT(*) FROM index_email").await;
        counts.iter().all(|(_, (n,))| *n > 0)
    };
    let mut more = 0;
    while !every_shard_has_a_key().await {
        let id = EntityId::random().to_hex();
        assert_eq!(api.put(&id, &json!({"email": format!("more{more}@example.org")})).await.0, 201);
        more += 1;
        assert!(more < 64, "no key row on one of the shards after {more} more entities");
    }
    // Hold the seeds' rows of shard 0 and every key row on both shards,
    // as a writer of those entities would (READ COMMITTED, as the writer).
    let mut blockers = Vec::new();
    for shard in 0..2 {
        let mut c = MySqlConnection::connect(&env.dsns[shard]).await.unwrap();
        sqlx::query("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED").execute(&mut c).await.unwrap();
        sqlx::query("BEGIN").execute(&mut c).await.unwrap();
        let keys: Vec<Vec<u8>> = sqlx::query_scalar("SELECT entity_id FROM index_email FOR UPDATE")
            .fetch_all(&mut c)
            .await
            .unwrap();
        assert!(!keys.is_empty());
        if shard == 0 {
            for id in seeds {
                let bytes = EntityId::parse(id).unwrap().0;
                let held: Vec<Vec<u8>> =
                    sqlx::query_scalar("SELECT id FROM entities WHERE id = ? FOR UPDATE")
                        .bind(&bytes[..])
                        .fetch_all(&mut c)
                        .await
                        .unwrap();
                assert_eq!(held.len(), 1);
            }
        }
        blockers.push(c);
    }
    // New ids on shard 0, new keys on both shards.
    let items: Vec<_> = batch
        .iter()
        .enumerate()
        .map(|(n, id)| json!({"id": id, "email": format!("new{n}@example.org")}))
        .collect();
    let (status, doc) = api.batch(&items).await;
    assert_eq!(status, 200, "{doc}");
    let written = doc["results"].as_array().unwrap().iter().filter(|r| r["version"] == 1).count();
    assert_eq!(written, batch.len(), "{doc}");
    for mut c in blockers {
        sqlx::query("ROLLBACK").execute(&mut c).await.unwrap();
    }
    let (status, doc) = api.get_many(&batch.iter().map(String::as_str).collect::<Vec<_>>()).await;
    assert_eq!(status, 200, "{doc}");
    assert_eq!(doc["items"].as_array().unwrap().len(), batch.len(), "{doc}");
}
