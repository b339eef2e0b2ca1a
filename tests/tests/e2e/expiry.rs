//! Expiry and tombstone purge (issue 18): an expired entity is invisible
//! to gets, batch gets and queries from its expiry second on, and absent
//! to writes; the cleaner deletes it through the write path (the index
//! follows) within its bound. A purged tombstone's id, re-created, gets a
//! version above any it had; a live entity's versions still go up by one.

use bagstore_tests::{eventually, metric_sum, Api, TestEnv};
use serde_json::json;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A string index on "owner".
const INDEX_OWNER: &str = r#"
[[indexes]]
table = "index_owner"
properties = [{ name = "owner", type = "string", max_len = 32 }]
"#;

const EXPIRY: (&str, &str) = ("BAGSTORE_EXPIRY__PROPERTY", "expires_at");

fn id(n: usize) -> String {
    format!("{n:032x}")
}

fn now_secs_f64() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_secs_f64()
}

/// Polls the wall clock (not a fixed sleep) until it reaches `at` seconds.
async fn until_clock(at: f64) {
    eventually("the wall clock to pass the expiry", Duration::from_secs(30), || async move {
        (now_secs_f64() >= at).then_some(())
    })
    .await
}

/// `(body is null, version)` of an entity's row, if it has one.
async fn entity_row(env: &TestEnv, id: &str) -> Option<(bool, u64)> {
    let rows: Vec<(usize, (i64, u64))> = env
        .fetch_all_shards(&format!(
            "SELECT CAST(body IS NULL AS SIGNED), CAST(version AS UNSIGNED) FROM entities WHERE id = UNHEX('{id}')"
        ))
        .await;
    rows.into_iter().next().map(|(_, (dead, v))| (dead != 0, v))
}

/// `(entity, version)` of every live row of `index_owner` with `owner`.
async fn index_rows(env: &TestEnv, owner: &str) -> Vec<(String, u64)> {
    let mut rows: Vec<(String, u64)> = env
        .fetch_all_shards::<(String, u64)>(&format!(
            "SELECT LOWER(HEX(entity_id)), CAST(version AS UNSIGNED) FROM index_owner WHERE owner = '{owner}' \
             AND removed_us IS NULL"
        ))
        .await
        .into_iter()
        .map(|(_, r)| r)
        .collect();
    rows.sort();
    rows
}

async fn owned_by(api: &Api, owner: &str) -> Vec<String> {
    api.query_ids(&json!({"where": {"owner": owner}})).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_entities_vanish_from_every_read_then_the_cleaner_deletes_them() {
    let env = TestEnv::new("expiry", INDEX_OWNER).await;
    env.migrate().await;
    // Writer, reader and indexer; this process's cleaner looks for expired
    // entities only once an hour, so at first only the reads hide them.
    let dev = env
        .spawn_env(
            &["dev", "--http", "127.0.0.1:0"],
            &[EXPIRY, ("BAGSTORE_CLEANER__EXPIRY_INTERVAL_MS", "3600000")],
        )
        .await;
    let api = dev.api();
    // Whole seconds ahead, so "from that second on" is exact.
    let at = now_secs_f64().ceil() + 4.0;
    let soon = json!({"owner": "ann", "expires_at": at as i64});
    for (n, body) in [
        (1, soon.clone()),
        (2, json!({"owner": "ann"})),
        (3, json!({"owner": "ann", "expires_at": at + 3600.0})),
        (4, json!({"owner": "ann", "expires_at": at})),
        (5, json!({"owner": "ann", "expires_at": (at as i64) - 1_000_000})),
    ] {
        let (status, b) = api.put(&id(n), &body).await;
        assert_eq!(status, 201, "{b}");
    }
    // Already expired when written: never visible.
    assert_eq!(api.get(&id(5)).await.0, 404);
    // A non-number expiry is refused, naming the property; nothing is written.
    let (status, problem) = api.put(&id(6), &json!({"owner": "ann", "expires_at": "tomorrow"})).await;
    assert_eq!((status, problem["property"].as_str()), (422, Some("expires_at")), "{problem}");
    assert!(problem["type"].as_str().is_some_and(|t| t.ends_with("bad-expiry")), "{problem}");
    assert_eq!(entity_row(&env, &id(6)).await, None);
    env.until_caught_up(&["index_owner"]).await;
    if now_secs_f64() < at - 0.5 {
        // Before the expiry second (when the machine kept up): visible.
        assert_eq!(api.get(&id(1)).await.0, 200);
        assert_eq!(owned_by(&api, "ann").await, vec![id(1), id(2), id(3), id(4)]);
    }

    until_clock(at).await;
    // Every read that starts from here on leaves 1 and 4 out.
    assert_eq!(api.get(&id(1)).await.0, 404);
    assert_eq!(api.get(&id(4)).await.0, 404);
    assert_eq!(api.get(&id(2)).await.0, 200);
    let (status, many) = api.get_many(&[&id(1), &id(2), &id(3), &id(4)]).await;
    assert_eq!(status, 200, "{many}");
    let got: Vec<&str> =
        many["items"].as_array().expect("items").iter().filter_map(|e| e["id"].as_str()).collect();
    assert_eq!(got, vec![id(2).as_str(), id(3).as_str()], "batch get: {many}");
    assert_eq!(owned_by(&api, "ann").await, vec![id(2), id(3)]);
    // Hidden by the reads alone: the rows are still live, the index rows still there.
    assert_eq!(entity_row(&env, &id(1)).await, Some((false, 1)));
    assert_eq!(index_rows(&env, "ann").await.len(), 5);
    // Writes treat an expired entity as absent: a create succeeds (above
    // the old version); a patch without upsert finds nothing.
    let (status, b) = api.put_with(&id(4), &json!({"owner": "bob"}), ("if-none-match", "*")).await;
    assert_eq!((status, b["version"].as_u64()), (201, Some(2)), "{b}");
    let (status, _) = api
        .raw(
            reqwest::Method::PATCH,
            &format!("/v1/entities/{}", id(5)),
            json!({"$set": {"x": 1}}).to_string().into(),
        )
        .await;
    assert_eq!(status, 404);

    // A cleaner that looks every 200 ms deletes 1 and 5 through the write
    // path: tombstones, index rows gone (the indexer applied the deletes).
    let started = Instant::now();
    let cleaner =
        env.spawn_env(&["cleaner"], &[EXPIRY, ("BAGSTORE_CLEANER__EXPIRY_INTERVAL_MS", "200")]).await;
    eventually("the cleaner to delete the expired entities", Duration::from_secs(30), || async {
        let dead = [1, 5].iter().map(|n| id(*n)).collect::<Vec<_>>();
        for d in &dead {
            if entity_row(&env, d).await.is_none_or(|(tomb, _)| !tomb) {
                return None;
            }
        }
        Some(())
    })
    .await;
    let deleted_after = started.elapsed();
    assert_eq!(entity_row(&env, &id(1)).await, Some((true, 2)), "a delete is one version more");
    env.until_caught_up(&["index_owner"]).await;
    assert_eq!(index_rows(&env, "ann").await, vec![(id(2), 1), (id(3), 1)]);
    assert_eq!(index_rows(&env, "bob").await, vec![(id(4), 2)]);
    // The metrics count the two expirations.
    let metrics = cleaner.api().metrics().await;
    assert_eq!(metric_sum(&metrics, "bagstore_cleaner_expired_total", &[]), 2.0, "{metrics}");
    assert_eq!(metric_sum(&metrics, "bagstore_cleaner_expiry_delay_seconds_count", &[]), 2.0);
    // The bound: a round every 200 ms (plus the process's start).
    assert!(deleted_after < Duration::from_secs(20), "deleted after {deleted_after:?}");
    // 3 (far future) and 2 (none) stay.
    assert_eq!(api.get(&id(3)).await.0, 200);
    assert_eq!(entity_row(&env, &id(3)).await, Some((false, 1)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purged_tombstone_leaves_a_floor_that_re_created_ids_start_above() {
    let env = TestEnv::new("purge", INDEX_OWNER).await;
    env.migrate().await;
    // Tombstones are kept a second, and looked for every 200 ms.
    let dev = env
        .spawn_env(
            &["dev", "--http", "127.0.0.1:0"],
            &[
                ("BAGSTORE_CLEANER__TOMBSTONE_RETENTION_SECS", "1"),
                ("BAGSTORE_CLEANER__PURGE_INTERVAL_MS", "200"),
            ],
        )
        .await;
    let api = dev.api();
    let gone = id(1);
    let logical = schemas::logical_of(&schemas::EntityId::parse(&gone).expect("id").0, 4096);
    // A live neighbour in the same logical shard.
    let neighbour = (2..100_000)
        .map(id)
        .find(|n| schemas::logical_of(&schemas::EntityId::parse(n).expect("id").0, 4096) == logical)
        .expect("an id in the same logical shard");
    for v in 1..=3 {
        let (status, b) = api.put(&gone, &json!({"owner": "ann", "v": v})).await;
        assert_eq!(b["version"].as_u64(), Some(v), "{status} {b}");
    }
    assert_eq!(api.put(&neighbour, &json!({"owner": "ann"})).await.0, 201);
    let (status, b) = api.delete(&gone).await;
    assert_eq!((status, b["version"].as_u64()), (200, Some(4)), "{b}");
    // Purged: the row goes, and the logical shard's floor covers version 4.
    eventually("the tombstone to be purged", Duration::from_secs(30), || async {
        entity_row(&env, &gone).await.is_none().then_some(())
    })
    .await;
    let floors: Vec<(usize, (u64,))> = env
        .fetch_all_shards(&format!(
            "SELECT CAST(version_floor AS UNSIGNED) FROM bagstore_owned WHERE logical = {logical}"
        ))
        .await;
    assert_eq!(floors.len(), 1, "one physical shard owns logical shard {logical}: {floors:?}");
    assert!(floors[0].1 .0 >= 4, "floor {:?} below the purged version 4", floors[0].1);
    assert_eq!(api.get(&gone).await.0, 404);
    let metrics = dev.api().metrics().await;
    assert!(metric_sum(&metrics, "bagstore_cleaner_tombstones_purged_total", &[]) >= 1.0, "{metrics}");

    // Re-created: a version above any it had, so a late event of the old
    // life can never win over it.
    let (status, b) = api.put_with(&gone, &json!({"owner": "bob"}), ("if-none-match", "*")).await;
    assert_eq!(status, 201, "{b}");
    let again = b["version"].as_u64().expect("version");
    assert!(again > 4, "re-created at version {again}, not above 4");
    // The live neighbour still goes up by exactly one per write.
    for want in 2..=4 {
        let (_, b) = api.put(&neighbour, &json!({"owner": "ann", "n": want})).await;
        assert_eq!(b["version"].as_u64(), Some(want), "{b}");
    }
    // The indexes are exact: the old life left nothing behind.
    env.until_caught_up(&["index_owner"]).await;
    assert_eq!(index_rows(&env, "ann").await, vec![(neighbour.clone(), 4)]);
    assert_eq!(index_rows(&env, "bob").await, vec![(gone.clone(), again)]);
    assert_eq!(api.query_ids(&json!({"where": {"owner": "bob"}})).await, vec![gone.clone()]);
}
