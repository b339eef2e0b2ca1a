//! Upgrading a store that ran an earlier release's removed features: the
//! binary-log outbox (its relay's saved place, its `BLACKHOLE` table) and
//! the bulk backfill (its loaded copies of index tables). `migrate`
//! refuses while dropping them could lose something, and drops them once
//! it cannot; a configuration that still sets a removed key is refused.

use bagstore_tests::{TestEnv, STANDARD_INDEXES};

/// The tables of the removed features on each shard.
async fn leftovers(env: &TestEnv) -> Vec<(usize, (String,))> {
    env.fetch_all_shards(
        "SELECT CAST(table_name AS CHAR) FROM information_schema.tables WHERE table_schema = DATABASE() \
         AND table_name IN ('bagstore_relay_log', 'outbox_log', 'index_user_id__bulk', 'index_foo__live') \
         ORDER BY table_name",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_refuses_while_the_binary_log_may_hold_unpublished_events_then_drops_what_was_left() {
    let env = TestEnv::with_binary_log("upgrade", STANDARD_INDEXES).await;
    env.migrate().await;

    // What the previous release left on shard s0 after running the
    // binary-log outbox: its relay's place, and an event logged after it
    // (in the binary log only: a BLACKHOLE table stores nothing).
    let s0 = env.pool(0).await;
    for ddl in [
        "CREATE TABLE bagstore_relay_log (id TINYINT UNSIGNED NOT NULL, file VARCHAR(255) NOT NULL, \
         pos BIGINT UNSIGNED NOT NULL, through_us BIGINT NOT NULL, PRIMARY KEY (id)) ENGINE=InnoDB",
        "CREATE TABLE outbox_log (seq BIGINT UNSIGNED NOT NULL AUTO_INCREMENT, entity_id BINARY(16) NOT NULL, \
         version BIGINT UNSIGNED NOT NULL, committed TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), \
         event MEDIUMBLOB NOT NULL, PRIMARY KEY (seq)) ENGINE=BLACKHOLE",
    ] {
        sqlx::raw_sql(ddl).execute(&s0).await.expect(ddl);
    }
    let status: (String, u64) = {
        use sqlx::Row;
        let r = sqlx::query("SHOW MASTER STATUS").fetch_one(&s0).await.expect("the binary log is on");
        (r.try_get("File").unwrap(), r.try_get("Position").unwrap())
    };
    sqlx::query("INSERT INTO bagstore_relay_log (id, file, pos, through_us) VALUES (1, ?, ?, 0)")
        .bind(&status.0)
        .bind(status.1)
        .execute(&s0)
        .await
        .unwrap();
    sqlx::query("INSERT INTO outbox_log (entity_id, version, event) VALUES (?, 1, 'an unpublished event')")
        .bind(vec![7u8; 16])
        .execute(&s0)
        .await
        .unwrap();
    // And a bulk backfill's unswapped copy on both shards.
    for shard in 0..2 {
        let pool = env.pool(shard).await;
        sqlx::raw_sql("CREATE TABLE index_user_id__bulk LIKE index_user_id").execute(&pool).await.unwrap();
    }
    let before = leftovers(&env).await;
    assert_eq!(before.len(), 4, "{before:?}");

    // The place is short of the log's end: refused, naming the shard and
    // what to run, and nothing is dropped.
    let (ok, out, err) = env.run(&env.args(&["migrate"]), &[]).await;
    assert!(!ok, "migrate went on over unpublished binary-log events: {out}{err}");
    for words in ["shard s0", "binary log", "writer.outbox = \"table\"", "bagstore migrate"] {
        assert!(err.contains(words), "the refusal does not say {words:?}: {err}");
    }
    assert_eq!(leftovers(&env).await, before);

    // A bulk backfill stopped half way through its swap: refused too,
    // naming the index (its live rows are not merged yet).
    sqlx::query("DELETE FROM bagstore_relay_log").execute(&s0).await.unwrap();
    let s1 = env.pool(1).await;
    sqlx::raw_sql("CREATE TABLE index_foo__live LIKE index_foo").execute(&s1).await.unwrap();
    let (ok, out, err) = env.run(&env.args(&["migrate"]), &[]).await;
    assert!(!ok, "migrate dropped a half-swapped bulk backfill: {out}{err}");
    assert!(err.contains("shard s1") && err.contains("index_foo__live"), "{err}");

    // Drained (the previous release's relay forgot its place) and the swap
    // finished: migrate drops what the removed features left.
    sqlx::raw_sql("DROP TABLE index_foo__live").execute(&s1).await.unwrap();
    env.migrate().await;
    assert_eq!(leftovers(&env).await, vec![], "left behind after the upgrade");
    // Migrating again is harmless.
    env.migrate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configuration_that_sets_a_removed_key_is_refused_naming_it() {
    let env = TestEnv::new("removedkey", STANDARD_INDEXES).await;
    for (var, key) in [
        ("BAGSTORE_WRITER__OUTBOX", "writer.outbox"),
        ("BAGSTORE_CLEANER__BACKFILL_METHOD", "cleaner.backfill_method"),
    ] {
        let (ok, out, err) = env.run(&env.args(&["migrate"]), &[(var, "table")]).await;
        assert!(!ok, "{var} accepted: {out}{err}");
        assert!(err.contains(key) && err.contains("removed") && err.contains(var), "{err}");
    }
    let file = env.dir.path().join("old.toml");
    let toml = env.config_toml().replacen("[writer]\n", "[writer]\noutbox = \"binlog\"\n", 1);
    std::fs::write(&file, toml).unwrap();
    let args: Vec<String> = ["migrate", "--config", &file.display().to_string()].map(String::from).to_vec();
    let (ok, out, err) = env.run(&args, &[]).await;
    assert!(!ok, "writer.outbox in the file accepted: {out}{err}");
    assert!(err.contains("writer.outbox") && err.contains("removed"), "{err}");
}
