//! The cleaner: online backfill through the index lifecycle, resuming a
//! killed backfill from its cursor, a backfill whose pace follows the
//! shards' health, repairing hand-made drift, and purging index
//! tombstones.

use bagstore_tests::{bagstore_bin, eventually, metric_sum, until_query_is, TestEnv, STANDARD_INDEXES};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const INDEX_LINK: &str = r#"
[[indexes]]
table = "index_link"
properties = [{ name = "link", type = "string", max_len = 735 }]
shard_on = "link"
"#;

fn id(i: usize) -> String {
    format!("{:032x}", 0x1100_0000u64 + i as u64)
}

fn link(i: usize) -> String {
    format!("http://friendfeed.com/e/{i:06}")
}

async fn load(api: &bagstore_tests::Api, n: usize) {
    for start in (0..n).step_by(500) {
        let items: Vec<Value> = (start..(start + 500).min(n))
            .map(|i| json!({"id": id(i), "link": link(i), "title": format!("entry {i}")}))
            .collect();
        let (s, body) = api.batch(&items).await;
        assert_eq!(s, 200);
        assert!(body["results"].as_array().unwrap().iter().all(|r| r["version"] == 1), "{body}");
    }
}

async fn index_state(api: &bagstore_tests::Api, table: &str) -> Option<String> {
    let (status, body) = api.indexes().await;
    assert_eq!(status, 200, "{body}");
    body["indexes"]
        .as_array()?
        .iter()
        .find(|i| i["table"] == table)
        .map(|i| i["state"].as_str().unwrap().to_string())
}

fn by_links(range: std::ops::Range<usize>) -> Value {
    json!({"index": "index_link", "where": {"link": {"in": range.map(link).collect::<Vec<_>>()}}, "limit": 1000})
}

/// A new index's consumer group starts at the topic's end only on the
/// partitions where it has no offsets yet (`service::kafka::
/// place_group_at_end`): an offset already committed (its indexers took
/// the partition before `migrate` ran again; they never join the broker's
/// group, so the broker would not refuse the move) is left where it is,
/// since skipping their events could lose rows the backfill already passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_index_group_starts_at_the_end_only_where_it_has_no_offsets() {
    use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
    let mut env = TestEnv::new("startatend", STANDARD_INDEXES).await;
    env.migrate().await;
    let writer = env.spawn(&["writer"]).await;
    load(&writer.api(), 200).await;
    let k = env.kafka_settings();
    let group = k.group_for("index_link");
    eventually("events on partition 0", Duration::from_secs(30), || async {
        let lag = service::kafka::group_lag(&k, &group).await.ok()?;
        lag.iter().any(|p| p.partition == 0 && p.high_watermark > 0).then_some(())
    })
    .await;
    let (kc, g) = (k.clone(), group.clone());
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer =
            service::kafka::create(&service::kafka::consumer_config(&kc, &g, 20)).unwrap();
        let mut tpl = rdkafka::TopicPartitionList::new();
        tpl.add_partition_offset(&kc.topic, 0, rdkafka::Offset::Offset(0)).unwrap();
        consumer.commit(&tpl, CommitMode::Sync).expect("offset 0 committed on partition 0");
    })
    .await
    .unwrap();

    env.indexes_toml.push_str(INDEX_LINK);
    let out = env.migrate().await;
    assert!(out.contains("index index_link: CREATING"), "{out}");
    let lag = service::kafka::group_lag(&k, &group).await.unwrap();
    for p in &lag {
        let want = if p.partition == 0 { Some(0) } else { Some(p.high_watermark) };
        assert_eq!(p.committed, want, "partition {}: {lag:?}", p.partition);
    }
    assert!(lag.iter().any(|p| p.partition == 0 && p.high_watermark > 0), "{lag:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_index_is_backfilled_online_through_creating_backfilling_active() {
    let mut env = TestEnv::new("backfill", STANDARD_INDEXES).await;
    env.migrate().await;
    let writer = env.spawn(&["writer"]).await;
    let reader = env.spawn(&["reader"]).await;
    let api = writer.api();
    let rapi = reader.api();
    load(&api, 600).await;

    eventually("the outbox to drain", Duration::from_secs(30), || async {
        (env.count_rows("outbox").await == 0).then_some(())
    })
    .await;
    env.indexes_toml.push_str(INDEX_LINK);
    let out = env.migrate().await;
    assert!(out.contains("index index_link: CREATING"), "{out}");
    // Its consumer group starts at the topic's end: the backfill covers the past.
    let k = env.kafka_settings();
    let lag = service::kafka::group_lag(&k, &k.group_for("index_link")).await.unwrap();
    assert!(lag.iter().all(|p| p.committed == Some(p.high_watermark)), "{lag:?}");
    assert!(lag.iter().map(|p| p.high_watermark).sum::<i64>() >= 600);
    assert_eq!(index_state(&rapi, "index_link").await.as_deref(), Some("CREATING"));
    let (s, doc) = rapi.query(&by_links(0..10)).await;
    assert_eq!((s, doc["type"].clone()), (409, json!("/problems/index-not-ready")), "{doc}");

    // The index's consumer group starts with it; the cleaner backfills, slowly
    // enough (300 rows/s) that the BACKFILLING state can be seen.
    let indexer = env.spawn(&["indexer", "--index", "index_link"]).await;
    let cleaner = env
        .spawn_env(
            &["cleaner"],
            &[("BAGSTORE_CLEANER__BACKFILL_RATE", "300"), ("BAGSTORE_CLEANER__BACKFILL_BATCH", "50")],
        )
        .await;
    eventually("index_link to be BACKFILLING", Duration::from_secs(20), || async {
        (index_state(&rapi, "index_link").await.as_deref() == Some("BACKFILLING")).then_some(())
    })
    .await;
    let (s, doc) = rapi.query(&by_links(0..10)).await;
    assert_eq!(s, 409, "{doc}");
    // The reader caches states for half a second, so it may still say CREATING.
    assert!(doc["state"] == "BACKFILLING" || doc["state"] == "CREATING", "{doc}");
    let mut partial = by_links(0..10);
    partial["allow_partial"] = json!(true);
    assert_eq!(rapi.query(&partial).await.0, 200);
    // Live traffic goes on during the backfill.
    assert_eq!(api.put(&id(9999), &json!({"link": link(9999)})).await.0, 201);

    eventually("index_link to be ACTIVE", Duration::from_secs(30), || async {
        (index_state(&rapi, "index_link").await.as_deref() == Some("ACTIVE")).then_some(())
    })
    .await;
    let (_, doc) = rapi.indexes().await;
    let meta =
        doc["indexes"].as_array().unwrap().iter().find(|i| i["table"] == "index_link").unwrap().clone();
    assert_eq!(meta["backfill"]["fraction"], 1.0, "{meta}");
    assert_eq!(meta["backfill"]["rows_done"], meta["backfill"]["rows_total"], "{meta}");
    let want: Vec<String> = (0..600).map(id).collect();
    let want: Vec<&str> = want.iter().map(String::as_str).collect();
    until_query_is(&rapi, &by_links(0..600), &want).await;
    until_query_is(&rapi, &json!({"where": {"link": link(9999)}}), &[&id(9999)]).await;
    let m = cleaner.api().metrics().await;
    assert_eq!(metric_sum(&m, "bagstore_cleaner_backfill_progress_ratio", &[("index", "index_link")]), 1.0);
    assert_eq!(metric_sum(&m, "bagstore_index_state", &[("index", "index_link")]), 2.0);
    // Backfilled rows (and the indexer's) say where their entity's row is.
    let rows = env.index_row_locations("index_link").await;
    assert_eq!(rows.len(), 601);
    for r in rows {
        assert!(r.given.is_some() && r.given == r.actual, "{r:?}");
    }
    for p in [writer, reader, indexer, cleaner] {
        p.terminate().await;
    }
}

async fn meta_row(env: &TestEnv, table: &str) -> (String, i64, i64) {
    let pool = env.pool(0).await;
    let row: (String, i64, i64) =
        sqlx::query_as("SELECT state, CAST(rows_done AS SIGNED), CAST(rows_total AS SIGNED) FROM bagstore_indexes WHERE name = ?")
            .bind(table)
            .fetch_one(&pool)
            .await
            .unwrap();
    pool.close().await;
    row
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_killed_half_way_resumes_from_its_cursor_and_ends_exact() {
    let mut env = TestEnv::new("resume", STANDARD_INDEXES).await;
    env.migrate().await;
    let writer = env.spawn(&["writer"]).await;
    load(&writer.api(), 2000).await;
    env.indexes_toml.push_str(INDEX_LINK);
    env.migrate().await;

    let mut first = bagstore_tests::command(bagstore_bin())
        .args(env.args(&["cleaner", "--index", "index_link", "--rate", "100"]))
        .env("BAGSTORE_CLEANER__BACKFILL_BATCH", "40")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(env.dir.path().join("first-backfill.log")).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    eventually("the first backfill to pass 10%", Duration::from_secs(30), || async {
        (meta_row(&env, "index_link").await.1 >= 200).then_some(())
    })
    .await;
    // Shard 1's index table locked: every batch's rows there wait, while
    // the backfill reads ahead and commits their shard 0 halves. The kill
    // then finds batches half written, which the saved cursor must not
    // cover (else the run below would skip them and end short). At 100
    // rows/s the reading ahead below takes about 2 s, past the cursor's
    // save every second.
    let shard1 = env.pool(1).await;
    let mut lock = shard1.acquire().await.unwrap();
    sqlx::query("LOCK TABLES index_link WRITE").execute(&mut *lock).await.unwrap();
    let shard0 = env.pool(0).await;
    let on_shard0 = || async {
        sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM index_link").fetch_one(&shard0).await.unwrap()
    };
    let at_lock = on_shard0().await;
    // One batch of 40 entities in flight per shard's job would put about
    // 40 rows on shard 0, four about 160; 100 more is reading ahead.
    eventually("the backfill to read ahead of its waiting batches", Duration::from_secs(30), || async {
        (on_shard0().await >= at_lock + 100).then_some(())
    })
    .await;
    first.kill().await.unwrap(); // SIGKILL: no chance to clean up
    sqlx::query("UNLOCK TABLES").execute(&mut *lock).await.unwrap();
    drop(lock);
    let (state, done_at_kill, total) = meta_row(&env, "index_link").await;
    assert_eq!(state, "BACKFILLING");
    assert_eq!(total, 2000);
    assert!(done_at_kill < total, "the kill came too late to test anything");

    let out = bagstore_tests::command(bagstore_bin())
        .args(env.args(&["cleaner", "--index", "index_link"]))
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let want = format!("scanned {} rows in this run (2000 of 2000)", total - done_at_kill);
    assert!(stdout.contains(&want), "expected {want:?} in:\n{stdout}");
    assert_eq!(meta_row(&env, "index_link").await.0, "ACTIVE");
    // Exact: one row per entity, each under its own link.
    assert_eq!(env.count_rows("index_link").await, 2000);
    let reader = env.spawn(&["reader"]).await;
    let want_ids: Vec<String> = (0..2000).map(id).collect();
    for chunk in (0..2000).step_by(1000) {
        let ids: Vec<&str> = want_ids[chunk..chunk + 1000].iter().map(String::as_str).collect();
        until_query_is(&reader.api(), &by_links(chunk..chunk + 1000), &ids).await;
    }
    writer.terminate().await;
    reader.terminate().await;
}

/// The backfill's pace (`bagstore_cleaner_backfill_pace_rows_per_second`)
/// as the cleaner reports it.
async fn pace(cleaner: &bagstore_tests::Proc) -> f64 {
    let m = cleaner.api().metrics().await;
    metric_sum(&m, "bagstore_cleaner_backfill_pace_rows_per_second", &[("index", "index_link")])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_following_health_slows_down_while_a_shard_is_slow_and_ends_exact() {
    let mut env = TestEnv::new("paced", STANDARD_INDEXES).await;
    env.migrate().await;
    let writer = env.spawn(&["writer"]).await;
    load(&writer.api(), 6000).await;
    env.indexes_toml.push_str(INDEX_LINK);
    env.migrate().await;
    let indexer = env.spawn(&["indexer", "--index", "index_link"]).await;
    // At most 500 rows/s, following health: the pace starts at 500.
    let cleaner = env
        .spawn_env(
            &["cleaner"],
            &[
                ("BAGSTORE_CLEANER__BACKFILL_FOLLOW_HEALTH", "true"),
                ("BAGSTORE_CLEANER__BACKFILL_RATE", "500"),
            ],
        )
        .await;
    eventually("the backfill to run with a pace", Duration::from_secs(30), || async {
        (pace(&cleaner).await > 0.0).then_some(())
    })
    .await;
    // Shard 1 turns slow: its probe read waits on a table lock (the probe
    // gives up after 250 ms and counts that long).
    let shard1 = env.pool(1).await;
    let mut lock = shard1.acquire().await.unwrap();
    sqlx::query("LOCK TABLES bagstore_shard WRITE").execute(&mut *lock).await.unwrap();
    // Halved every 250 ms down to its floor (`cleaner::pace::MIN_RATE`).
    eventually("the pace to fall to its floor", Duration::from_secs(20), || async {
        (pace(&cleaner).await == 200.0).then_some(())
    })
    .await;
    let m = cleaner.api().metrics().await;
    let probe = metric_sum(
        &m,
        "bagstore_cleaner_backfill_probe_seconds",
        &[("index", "index_link"), ("what", "probe")],
    );
    let limit = metric_sum(
        &m,
        "bagstore_cleaner_backfill_probe_seconds",
        &[("index", "index_link"), ("what", "limit")],
    );
    assert!(probe >= 0.2 && limit > 0.0 && limit < probe, "probe {probe} s, limit {limit} s");
    let (state, done, total) = meta_row(&env, "index_link").await;
    assert!(state == "BACKFILLING" && done < total, "the backfill ended before the shard turned slow");
    // One probe waits on the stalled shard, not one per attempt: a stall
    // must not cost the server a connection every 250 ms.
    let waiting: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE DB = DATABASE() \
         AND INFO = 'SELECT epoch FROM bagstore_shard WHERE id = 1'",
    )
    .fetch_one(&mut *lock)
    .await
    .unwrap();
    assert_eq!(waiting, 1, "probes waiting on the locked table");
    // Healthy again: the pace climbs back to its ceiling.
    sqlx::query("UNLOCK TABLES").execute(&mut *lock).await.unwrap();
    drop(lock);
    eventually("the pace to climb back to 500 rows/s", Duration::from_secs(20), || async {
        (pace(&cleaner).await == 500.0).then_some(())
    })
    .await;
    eventually("index_link to be ACTIVE", Duration::from_secs(60), || async {
        (meta_row(&env, "index_link").await.0 == "ACTIVE").then_some(())
    })
    .await;
    assert_eq!(env.count_rows("index_link").await, 6000);
    for p in [writer, indexer, cleaner] {
        p.terminate().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_continuous_cleaner_repairs_missing_and_dangling_rows_within_seconds() {
    let env = TestEnv::new("repair", STANDARD_INDEXES).await;
    let dev =
        env.spawn_env(&["dev", "--http", "127.0.0.1:0"], &[("BAGSTORE_CLEANER__INTERVAL_MS", "200")]).await;
    let api = dev.api();
    let user = |i: usize| format!("{:032x}", 0xeeee_0000u64 + i as u64);
    for i in 0..20 {
        assert_eq!(api.put(&id(i), &json!({"user_id": user(i)})).await.0, 201);
    }
    for i in 0..20 {
        until_query_is(&api, &json!({"where": {"user_id": user(i)}}), &[&id(i)]).await;
    }
    let before = api.metrics().await;
    let found = |m: &str, kind: &str| {
        metric_sum(m, "bagstore_cleaner_drift_found_total", &[("index", "index_user_id"), ("kind", kind)])
    };
    let fixed = |m: &str, kind: &str| {
        metric_sum(m, "bagstore_cleaner_drift_fixed_total", &[("index", "index_user_id"), ("kind", kind)])
    };

    let hexb = |s: &str| schemas::EntityId::parse(s).unwrap().0.to_vec();
    // Hand-delete the rows of entities 0..5 and hand-insert wrong rows for 5..8
    // plus one for an id that never existed.
    for s in 0..env.dsns.len() {
        let pool = env.pool(s).await;
        for i in 0..5 {
            sqlx::query("DELETE FROM index_user_id WHERE entity_id = ?")
                .bind(hexb(&id(i)))
                .execute(&pool)
                .await
                .unwrap();
        }
        pool.close().await;
    }
    let mut dangling = vec![];
    for i in 5..8 {
        dangling.push((user(100 + i), id(i)));
    }
    dangling.push((user(0), id(777)));
    for (u, e) in &dangling {
        let shard = schemas::shard::initial_position_of(&hexb(u), env.dsns.len());
        let pool = env.pool(shard).await;
        sqlx::query("INSERT INTO index_user_id (user_id, entity_id, version, logical) VALUES (?, ?, 1, ?)")
            .bind(hexb(u))
            .bind(hexb(e))
            .bind(schemas::logical_of(&hexb(u), 4096))
            .execute(&pool)
            .await
            .unwrap();
        pool.close().await;
    }
    let tampered = Instant::now();
    // Within seconds, but not within 5 any more: the cleaner's first lag
    // probe (which lets it tell drift from lag) waits until its watermark
    // client is trusted, 2 s after it is made (`kafka::WATERMARK_WARMUP`).
    eventually("the index to be exact again", Duration::from_secs(10), || async {
        (env.count_rows("index_user_id").await == 20).then_some(())
    })
    .await;
    let took = tampered.elapsed();
    for i in 0..5 {
        until_query_is(&api, &json!({"where": {"user_id": user(i)}}), &[&id(i)]).await;
    }
    assert_eq!(env.count_rows("index_user_id").await, 20);
    let after = api.metrics().await;
    assert!(found(&after, "missing") - found(&before, "missing") >= 5.0, "{after}");
    assert!(found(&after, "dangling") - found(&before, "dangling") >= 4.0, "{after}");
    assert!(fixed(&after, "missing") - fixed(&before, "missing") >= 5.0);
    assert!(fixed(&after, "dangling") - fixed(&before, "dangling") >= 4.0);
    // The warnings name the entities (32 lowercase hex), so a report can
    // too. The log is JSON lines (not a terminal).
    let log = dev.log_text();
    let warned = |kind: &str| -> String {
        log.lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|j| j["level"] == "WARN" && j["message"] == format!("{kind} index rows").as_str())
            .map(|j| j.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    };
    let (missing, dangled) = (warned("wrote missing"), warned("deleted dangling"));
    for i in 0..5 {
        assert!(missing.contains(&id(i)), "no warning names the missing rows of {}:\n{missing}", id(i));
    }
    for (_, e) in &dangling {
        assert!(dangled.contains(e.as_str()), "no warning names the dangling row of {e}:\n{dangled}");
    }
    eprintln!("drift repaired {took:?} after the tampering");
    dev.terminate().await;
}

/// Index tombstones (rows the indexer marked removed, `storage::index_rows`)
/// stay while no cleaner runs, and a cleaner's index pass deletes them once
/// the index has settled past them by `cleaner.index_tombstone_retention_secs`
/// (0 here), leaving the live rows alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn index_tombstones_stay_until_a_cleaner_purges_them_past_the_settled_time() {
    let env = TestEnv::new("tombpurge", STANDARD_INDEXES).await;
    env.migrate().await;
    let writer = env.spawn(&["writer", "--http", "127.0.0.1:0"]).await;
    let indexer = env.spawn(&["indexer"]).await;
    let reader = env.spawn(&["reader", "--http", "127.0.0.1:0"]).await;
    let (api, read) = (writer.api(), reader.api());
    let user = |i: usize| format!("{:032x}", 0xdddd_0000u64 + i as u64);
    for i in 0..10 {
        assert_eq!(api.put(&id(100 + i), &json!({"user_id": user(i)})).await.0, 201);
    }
    // Each entity moves to another user: its old key's row is removed.
    for i in 0..10 {
        assert_eq!(api.put(&id(100 + i), &json!({"user_id": user(50 + i)})).await.0, 200);
    }
    for i in 0..10 {
        until_query_is(&read, &json!({"where": {"user_id": user(50 + i)}}), &[&id(100 + i)]).await;
    }
    let tombstones = || async {
        let n: Vec<(usize, (i64,))> =
            env.fetch_all_shards("SELECT COUNT(*) FROM index_user_id WHERE removed_us IS NOT NULL").await;
        n.into_iter().map(|(_, (n,))| n).sum::<i64>()
    };
    eventually("ten tombstones", Duration::from_secs(20), || async {
        (tombstones().await == 10).then_some(())
    })
    .await;
    assert_eq!(env.count_rows("index_user_id").await, 10);
    for i in 0..10 {
        assert!(read.query_ids(&json!({"where": {"user_id": user(i)}})).await.is_empty());
    }

    let cleaner = env
        .spawn_env(
            &["cleaner"],
            &[
                ("BAGSTORE_CLEANER__INTERVAL_MS", "200"),
                ("BAGSTORE_CLEANER__INDEX_TOMBSTONE_RETENTION_SECS", "0"),
            ],
        )
        .await;
    eventually("the cleaner to purge the tombstones", Duration::from_secs(30), || async {
        (tombstones().await == 0).then_some(())
    })
    .await;
    assert_eq!(env.count_rows("index_user_id").await, 10, "the purge took live rows");
    for p in [writer, indexer, reader, cleaner] {
        p.terminate().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_index_stops_being_maintained_and_can_be_added_again() {
    let env = TestEnv::new("drop", STANDARD_INDEXES).await;
    env.migrate().await;
    let writer = env.spawn(&["writer"]).await;
    let reader = env.spawn(&["reader"]).await;
    let indexer = env.spawn(&["indexer"]).await;
    let api = writer.api();
    let rapi = reader.api();
    for i in 0..10 {
        api.put(&id(i), &json!({"tags": ["x", format!("t{i}")]})).await;
    }
    until_query_is(&rapi, &json!({"where": {"tags": "t3"}}), &[&id(3)]).await;

    let out = bagstore_tests::command(bagstore_bin())
        .args(["index", "drop", "index_tag", "--config"])
        .arg(env.config_path())
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(index_state(&rapi, "index_tag").await.as_deref(), Some("DROPPING"));
    for s in 0..env.dsns.len() {
        let pool = env.pool(s).await;
        let (n,): (i64,) = sqlx::query_as(
            "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = 'index_tag'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(n, 0, "index_tag still exists on shard {s}");
        pool.close().await;
    }
    eventually("the reader to forget index_tag", Duration::from_secs(5), || async {
        let (s, doc) = rapi.query(&json!({"index": "index_tag", "where": {"tags": "x"}})).await;
        (s == 400 && doc["type"] == "/problems/unknown-index").then_some(())
    })
    .await;
    // Writes go on; the indexer moves past the dropped index's events
    // instead of retrying them forever against tables that are gone.
    for i in 10..20 {
        assert_eq!(api.put(&id(i), &json!({"tags": "x", "user_id": format!("{:032x}", i)})).await.0, 201);
    }
    env.until_caught_up(&["index_tag", "index_user_id"]).await;

    // Adding it back (migrate) starts it over: CREATING, then a backfill.
    assert!(env.migrate().await.contains("index index_tag: CREATING"));
    let cleaner = env.spawn(&["cleaner"]).await;
    eventually("index_tag to be ACTIVE again", Duration::from_secs(30), || async {
        (index_state(&rapi, "index_tag").await.as_deref() == Some("ACTIVE")).then_some(())
    })
    .await;
    let all: Vec<String> = (0..20).map(id).collect();
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    until_query_is(&rapi, &json!({"where": {"tags": "x"}, "limit": 100}), &all).await;
    for p in [writer, reader, indexer, cleaner] {
        p.terminate().await;
    }
}

/// A write's timestamp is taken inside its transaction, before its commit,
/// so a transaction open on a shard holds every index's settled time (the
/// line before which the cleaner judges drift, not lag) at its start for as
/// long as it stays open, while writes around it go on and are applied;
/// once it ends, the settled time moves on. (Before, the settled time ran
/// up to half a second behind the probe's clock, so a write stamped before
/// the probe and committed after it counted as settled before its event
/// was published: the tansu chaos suite's cleaner once found a row
/// "missing" with no move or broker fault to explain it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_write_transaction_holds_the_settled_time_at_its_start() {
    let env = TestEnv::new("settledopen", STANDARD_INDEXES).await;
    let dev =
        env.spawn_env(&["dev", "--http", "127.0.0.1:0"], &[("BAGSTORE_CLEANER__INTERVAL_MS", "200")]).await;
    let api = dev.api();
    let settled =
        |m: &str| metric_sum(m, "bagstore_index_settled_timestamp_seconds", &[("index", "index_user_id")]);
    let n = std::sync::atomic::AtomicUsize::new(0);
    let write = || {
        let i = n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let api = api.clone();
        async move {
            let user = format!("{:032x}", 0xabcd_0000u64 + i as u64);
            assert_eq!(api.put(&id(i), &json!({"user_id": user})).await.0, 201);
        }
    };
    let mut first = 0.0;
    let until = Instant::now() + Duration::from_secs(30);
    while first == 0.0 {
        assert!(Instant::now() < until, "no settled time for index_user_id after 30 s of writes");
        write().await;
        first = settled(&api.metrics().await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A transaction as a writer's begins: its first statement proves the
    // shard owns the logical shards (shared locks), its clock reading comes next.
    let pool = env.pool(0).await;
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT logical FROM bagstore_owned LIMIT 1 LOCK IN SHARE MODE")
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    let opened: f64 = sqlx::query_scalar("SELECT CAST(UNIX_TIMESTAMP(NOW(6)) AS DOUBLE)")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let hold_until = Instant::now() + Duration::from_secs(5);
    let mut highest = first;
    while Instant::now() < hold_until {
        write().await;
        let s = settled(&api.metrics().await);
        highest = highest.max(s);
        assert!(s <= opened, "the settled time {s} passed the start {opened} of a transaction still open");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tx.rollback().await.unwrap();
    let mut after = 0.0;
    let until = Instant::now() + Duration::from_secs(20);
    while after <= opened {
        assert!(
            Instant::now() < until,
            "the settled time stays at {after} after the transaction ended at {opened}"
        );
        write().await;
        after = settled(&api.metrics().await);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    pool.close().await;
    eprintln!(
        "settled time: {first:.3} before, at most {highest:.3} while a transaction from {opened:.3} was open, \
         {after:.3} after it ended"
    );
    dev.terminate().await;
}
