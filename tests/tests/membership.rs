//! No partition is fetched and applied by two indexers after a mock-broker
//! outage longer than the lease (issue 17); the same scenario against the
//! standalone broker is in `tansu.rs`. Member leases: a member killed and restarted under its name takes its own
//! partitions back and no other member touches them; one not restarted is
//! replaced within its lease; a second process under a taken name wins and
//! the first stops. A newer partition claim waits for the old owner's write
//! in hand and refuses its next ones (the fence on InnoDB).
//!
//! A binary of its own, one test at a time, run after the end-to-end
//! suites.

use bagstore_tests::membership::{
    counts, no_partition_is_worked_twice_after_an_outage, sample, steady_writes, Counts, INDEX, OUTAGE,
    PARTITIONS,
};
use bagstore_tests::{eventually, Proc, TestEnv, STANDARD_INDEXES};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_member_leases_after_an_outage_each_partition_has_one_worker() {
    let env = TestEnv::new("overlapleases", STANDARD_INDEXES).await;
    let outcome = no_partition_is_worked_twice_after_an_outage(&env, || async {
        env.kafka.broker_down(1).expect("broker down");
        tokio::time::sleep(OUTAGE).await;
        env.kafka.broker_up(1).expect("broker up");
    })
    .await;
    eprintln!("mock broker, member leases: {outcome}");
}

/// The lease length here (`kafka.session_timeout_ms`): long enough that a
/// restart under load on a busy machine is well inside it.
const LEASE_MS: &str = "10000";

async fn leased_indexer(env: &TestEnv, member: &str) -> Proc {
    let vars = [("BAGSTORE_INDEXER__MEMBER", member), ("BAGSTORE_KAFKA__SESSION_TIMEOUT_MS", LEASE_MS)];
    env.spawn_env(&["indexer", "--index", INDEX], &vars).await
}

/// Partitions whose applied count rose from `before` to `after`.
fn advanced(before: &Counts, after: &Counts) -> BTreeSet<i32> {
    after
        .iter()
        .filter(|((_, stage), n)| stage == "applied" && **n > 0.0)
        .filter(|(k, n)| before.get(*k).is_none_or(|b| *n > b))
        .map(|((p, _), _)| *p)
        .collect()
}

/// The partitions each of `procs` applied events of in the next second
/// (the test's writes reach every partition several times a second).
async fn working(procs: &[&Proc]) -> Vec<BTreeSet<i32>> {
    let mut before = Vec::new();
    for p in procs {
        before.push(counts(p).await);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut out = Vec::new();
    for (p, b) in procs.iter().zip(&before) {
        out.push(advanced(b, &counts(p).await));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_give_a_restarted_member_its_partitions_and_a_dead_ones_to_the_others() {
    let env = TestEnv::new("leases", STANDARD_INDEXES).await;
    env.migrate().await;
    let writer = env.spawn(&["writer"]).await;
    let writing = steady_writes(writer.url.clone());
    // Sorted members ["a", "b"]: a applies partitions 0 and 2, b 1 and 3.
    let (a_share, b_share): (BTreeSet<i32>, BTreeSet<i32>) =
        ((0..PARTITIONS).step_by(2).collect(), (1..PARTITIONS).step_by(2).collect());
    let a = leased_indexer(&env, "a").await;
    let b = leased_indexer(&env, "b").await;
    eventually("a and b to apply their shares", Duration::from_secs(60), || async {
        (working(&[&a, &b]).await == [a_share.clone(), b_share.clone()]).then_some(())
    })
    .await;
    // The cleaner counts the index's indexers from their leases (the mock
    // broker lists no group members, and leased indexers join none).
    let cleaner = env.spawn(&["cleaner"]).await;
    let consumers = || async {
        bagstore_tests::metric_sum(
            &cleaner.api().metrics().await,
            "bagstore_index_consumers",
            &[("index", INDEX)],
        )
    };
    eventually("the cleaner to count 2 indexers", Duration::from_secs(30), || async {
        (consumers().await == 2.0).then_some(())
    })
    .await;

    // kill -9 and restarted at once under the same name: a takes its own
    // partitions back, and b, whose lease view never lost a, never holds
    // more than its share.
    let b_at_kill = counts(&b).await;
    a.kill9().await;
    let restarted = Instant::now();
    let a2 = leased_indexer(&env, "a").await;
    let mut b_worked = BTreeSet::new();
    let back = loop {
        let (cb, b_held) = sample(&b).await;
        assert!(b_held <= 2.0, "b held {b_held} partitions while a restarted under its name");
        b_worked.extend(advanced(&b_at_kill, &cb));
        let a2_worked = advanced(&Counts::new(), &counts(&a2).await);
        if a2_worked == a_share {
            break restarted.elapsed();
        }
        assert!(
            restarted.elapsed() < Duration::from_secs(30),
            "the restarted a applies {a2_worked:?} 30 s on"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        b_worked.is_subset(&b_share),
        "b applied {b_worked:?} while a restarted; its share is {b_share:?}"
    );

    // kill -9, not restarted: b takes every partition once a's lease runs out.
    a2.kill9().await;
    let killed = Instant::now();
    let b_before = counts(&b).await;
    eventually("b to apply every partition", Duration::from_secs(40), || async {
        (advanced(&b_before, &counts(&b).await).len() == PARTITIONS as usize).then_some(())
    })
    .await;
    let taken_over = killed.elapsed();
    eventually("the cleaner to count 1 indexer", Duration::from_secs(30), || async {
        (consumers().await == 1.0).then_some(())
    })
    .await;

    // A second process under b's name: the one started last holds it, and
    // the first stops applying and says why.
    let c = leased_indexer(&env, "b").await;
    eventually(
        "the first b to stop, and the second to apply every partition",
        Duration::from_secs(40),
        || async {
            let stopped = b.log_text().contains("a process started later took this member name");
            let b_held = sample(&b).await.1;
            let now = working(&[&b, &c]).await;
            (stopped && b_held == 0.0 && now[0].is_empty() && now[1].len() == PARTITIONS as usize)
                .then_some(())
        },
    )
    .await;

    // Nothing was lost across the kills: every entity has its index row.
    writing.stop();
    tokio::time::sleep(Duration::from_millis(100)).await;
    env.until_caught_up(&[INDEX]).await;
    assert_eq!(env.count_rows(INDEX).await, env.count_rows("entities").await, "index rows against entities");
    eprintln!(
        "member leases: restarted a applied its partitions {:.2} s after its start; \
         b took a dead a's partitions {:.2} s after the kill (lease {LEASE_MS} ms)",
        back.as_secs_f64(),
        taken_over.as_secs_f64()
    );
    drop(c);
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
