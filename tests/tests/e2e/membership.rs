//! No partition is fetched and applied by two indexers after a mock-broker
//! outage longer than the session timeout (issue 17). The same scenario
//! against the standalone broker is in `chaos_tansu.rs`.

use bagstore_tests::membership::{no_partition_is_worked_twice_after_an_outage, OUTAGE};
use bagstore_tests::{eventually, TestEnv, STANDARD_INDEXES};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_outage_past_the_session_timeout_each_partition_has_one_worker() {
    let env = TestEnv::new("overlap", STANDARD_INDEXES).await;
    let outcome = no_partition_is_worked_twice_after_an_outage(&env, || async {
        env.kafka.broker_down(1).expect("broker down");
        tokio::time::sleep(OUTAGE).await;
        env.kafka.broker_up(1).expect("broker up");
    })
    .await;
    eprintln!("mock broker: {outcome}");
}

/// The partition fence (`storage::fences`) on real InnoDB: a consumer's
/// write transaction holds its claim's fence shared, so a newer claim
/// waits for it to finish, and every later transaction of the old claim
/// is refused on every shard; a shard that missed the raise is raised by
/// the first write there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_claim_waits_for_the_old_owners_write_then_refuses_its_next_ones() {
    use storage::fences::{self, Claim};
    use storage::StoreError;

    let env = TestEnv::new("fences", "").await;
    env.migrate().await;
    let shards = storage::Shards::configured(&schemas::settings::MysqlSettings {
        shards: env.dsns.iter().map(|d| schemas::settings::Dsn(d.clone())).collect(),
        ..Default::default()
    })
    .unwrap();
    let group = "bagstore.index_x";
    let (a, b) = ([0xaa; 16], [0xbb; 16]);
    let old = fences::claim(&shards, group, a, &[0, 1]).await.unwrap();
    assert_eq!(old, vec![Claim { partition: 0, gen: 1 }, Claim { partition: 1, gen: 1 }]);

    // A's write on shard 1 is under way, holding its fences.
    let mut in_flight = shards.pool(1).begin().await.unwrap();
    fences::check(1, &mut in_flight, group, &old).await.unwrap();

    // B is assigned partition 1: its claim is recorded, but raising the
    // fence on shard 1 waits for A's transaction.
    let claim_b = {
        let shards = shards.clone();
        tokio::spawn(async move { fences::claim(&shards, group, b, &[1]).await })
    };
    let shard1 = env.pool(1).await;
    eventually("B's raise waits for A's transaction on shard 1", Duration::from_secs(20), || async {
        let (waiting,): (i64,) = sqlx::query_as(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
             WHERE DB = DATABASE() AND INFO LIKE 'INSERT INTO bagstore_partition_fences%'",
        )
        .fetch_one(&shard1)
        .await
        .unwrap();
        (waiting > 0).then_some(())
    })
    .await;
    assert!(!claim_b.is_finished(), "the newer claim's raise did not wait for the old owner's write");
    in_flight.commit().await.unwrap();
    let new = claim_b.await.unwrap().unwrap();
    assert_eq!(new, vec![Claim { partition: 1, gen: 2 }]);

    // Every later write of A's old claim on partition 1 is refused, on
    // either shard; partition 0 is still A's.
    for shard in [0, 1] {
        let mut tx = shards.pool(shard).begin().await.unwrap();
        match fences::check(shard, &mut tx, group, &old).await {
            Err(StoreError::Fenced { partitions, .. }) => assert_eq!(partitions, vec![1]),
            other => panic!("shard {shard}: the old claim was not refused: {other:?}"),
        }
        fences::check(shard, &mut tx, group, &old[..1]).await.unwrap();
        fences::check(shard, &mut tx, group, &new).await.unwrap();
        tx.rollback().await.unwrap();
    }

    // A shard that missed a raise (here: its fences lost) is raised by the
    // claim's first write there, and then refuses the old claim too.
    sqlx::query("DELETE FROM bagstore_partition_fences").execute(&env.pool(0).await).await.unwrap();
    let mut tx = shards.pool(0).begin().await.unwrap();
    fences::check(0, &mut tx, group, &new).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = shards.pool(0).begin().await.unwrap();
    assert!(matches!(fences::check(0, &mut tx, group, &old).await, Err(StoreError::Fenced { .. })));
    tx.rollback().await.unwrap();
}
