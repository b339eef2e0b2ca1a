//! What the cleaner counts as drift: a missing row it finds while newer
//! writes of the entity are on their way through the indexer is lag, and
//! only a row missing for an entity that stayed as it was judged is drift.
//! The cleaner runs in this process, so the test decides what its scan saw.

use bagstore_tests::{eventually, TestEnv, STANDARD_INDEXES};
use cleaner::{reconcile, Cleaner, CleanerMetrics};
use schemas::{EntityId, Settings};
use serde_json::json;
use std::time::Duration;
use storage::{EntityRecord, Shards};

/// A cleaner of `env`'s shards in this process (no sweep, no lag probe).
async fn cleaner_of(env: &TestEnv) -> (Cleaner, Shards) {
    let text = std::fs::read_to_string(env.config_path()).unwrap();
    let settings = Settings::from_toml_and_env(&text, std::iter::empty()).unwrap();
    let shards = Shards::connect(&settings.mysql).await.unwrap();
    let health = service::health::Health::new(shards.clone(), None, false);
    let metrics = CleanerMetrics::register(&prometheus::Registry::new()).unwrap();
    (Cleaner::new(settings, shards.clone(), metrics, health), shards)
}

/// (version, removed) of each of `id`'s rows for first name `first` in
/// index_user_name, on every shard.
async fn user_name_rows(env: &TestEnv, id: &EntityId, first: &str) -> Vec<(u64, bool)> {
    let sql = format!(
        "SELECT version, removed_us IS NOT NULL FROM index_user_name \
         WHERE entity_id = UNHEX('{}') AND first_name = '{first}'",
        id.to_hex()
    );
    let rows: Vec<(usize, (u64, bool))> = env.fetch_all_shards(&sql).await;
    rows.into_iter().map(|(_, r)| r).collect()
}

/// The cleaner reads an entity at v1, (Ann, Lee); v2 (Bob, Lee) is written
/// and indexed (Ann's row removed), then v3 (Ann, Lee) again, whose event
/// the stopped indexer has not applied. Judging what it read, the cleaner
/// finds Ann's row missing and writes it at v1 (a tombstone of v2 keeps it
/// removed); re-reading, it finds v3, which produces that row. That is a
/// race with the indexer, not drift (the chaos suite's cleaner counted it
/// as "index_user_name missing 1"). A row lost while the entity stays is
/// still drift, and repaired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_missing_while_newer_writes_are_in_flight_is_lag_not_drift() {
    let env = TestEnv::new("overtaken", STANDARD_INDEXES).await;
    env.migrate().await;
    let writer = env.spawn(&["writer"]).await;
    let indexer = env.spawn(&["indexer"]).await;
    let (cleaner, shards) = cleaner_of(&env).await;
    let api = writer.api();
    let id = EntityId::parse("0000000000000000000000000000ab1e").unwrap();
    let (ann, bob) =
        (json!({"first_name": "Ann", "last_name": "Lee"}), json!({"first_name": "Bob", "last_name": "Lee"}));
    assert_eq!(api.put(&id.to_hex(), &ann).await.0, 201);
    let scanned: Vec<EntityRecord> = cleaner.read_any(&[id]).await.unwrap();
    assert_eq!(scanned[0].version, 1);
    assert_eq!(api.put(&id.to_hex(), &bob).await.1["version"], 2);
    eventually("v2 to remove Ann's row", Duration::from_secs(30), || async {
        (user_name_rows(&env, &id, "Ann").await == vec![(2, true)]).then_some(())
    })
    .await;
    indexer.terminate().await;
    assert_eq!(api.put(&id.to_hex(), &ann).await.1["version"], 3);

    let map = shards.routing();
    let spec = cleaner.settings().index("index_user_name").unwrap();
    // v1 is what the scan saw, and settled: its event was applied.
    let settled = scanned[0].updated_us;
    reconcile::reconcile(&cleaner, &map, spec, &[id], &scanned, settled).await.unwrap();
    let missing = || cleaner.metrics().drift_found.with_label_values(&["index_user_name", "missing"]).get();
    assert_eq!(missing(), 0, "a row missing because of newer writes in flight was counted as drift");
    assert_eq!(user_name_rows(&env, &id, "Ann").await, vec![(2, true)], "v1's write revived the row");

    // The indexer applies v3; then the row is lost while v3 stays.
    let indexer = env.spawn(&["indexer"]).await;
    eventually("v3 to write Ann's row back", Duration::from_secs(30), || async {
        (user_name_rows(&env, &id, "Ann").await == vec![(3, false)]).then_some(())
    })
    .await;
    indexer.terminate().await;
    for s in 0..env.dsns.len() {
        let pool = env.pool(s).await;
        sqlx::query("DELETE FROM index_user_name WHERE entity_id = ?")
            .bind(&id.0[..])
            .execute(&pool)
            .await
            .unwrap();
        pool.close().await;
    }
    let now = cleaner.read_any(&[id]).await.unwrap();
    reconcile::reconcile(&cleaner, &map, spec, &[id], &now, now[0].updated_us).await.unwrap();
    assert_eq!(missing(), 1, "a row lost while its entity stayed is drift");
    assert_eq!(user_name_rows(&env, &id, "Ann").await, vec![(3, false)]);
    writer.terminate().await;
    shards.close().await;
}
