//! `/health/live` and `/health/ready` (issue 17): a shard frozen with
//! SIGSTOP, then stopped, is named within 2 s while the process stays
//! ready (degraded), and the answer is `ok` again once the shard is back.
//! The frozen shard is a private mariadbd of this test (the suite's shared
//! servers must not freeze under the other tests).

use bagstore_tests::{eventually, MariaDb, TestEnv, STANDARD_INDEXES};
use devstack::mariadb::MariaDbOptions;
use serde_json::Value;
use std::time::{Duration, Instant};

/// GET `path`: status, body, and how long the answer took.
async fn get(base: &str, path: &str) -> (u16, Value, Duration) {
    let started = Instant::now();
    let r = reqwest::get(format!("{base}{path}")).await.expect("HTTP request");
    let status = r.status().as_u16();
    let body: Value = r.json().await.expect("a JSON body");
    (status, body, started.elapsed())
}

fn failing_names(body: &Value) -> Vec<String> {
    body["failing"]
        .as_array()
        .expect("failing")
        .iter()
        .map(|f| f["name"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_names_a_frozen_or_stopped_shard_within_two_seconds_and_recovers() {
    let mut env = TestEnv::new("health", STANDARD_INDEXES).await;
    let opts =
        MariaDbOptions { ephemeral: true, innodb_buffer_pool_size: Some("16M".into()), ..Default::default() };
    let private = MariaDb::start_with(&env.dir.path().join("s1"), opts).await.expect("a private mariadbd");
    env.dsns[1] = private.dsn(&format!("{}_s1", env.name));
    env.migrate().await;
    let writer = env.spawn(&["writer"]).await;
    let reader = env.spawn(&["reader"]).await;

    for p in [&writer, &reader] {
        eventually("ready and ok", Duration::from_secs(30), || async {
            let (status, body, _) = get(&p.url, "/health/ready").await;
            (status == 200 && body["status"] == "ok").then_some(())
        })
        .await;
        let (status, body, _) = get(&p.url, "/health/live").await;
        assert_eq!((status, body["status"].as_str()), (200, Some("ok")));
    }

    let freeze = |sig: &str| {
        let status = bagstore_tests::std_command("kill")
            .args([sig, &private.pid().to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill {sig}");
    };
    freeze("-STOP");
    for p in [&writer, &reader] {
        let (status, body, took) = get(&p.url, "/health/ready").await;
        assert!(took < Duration::from_secs(2), "the answer took {took:?} with a frozen shard");
        assert_eq!(status, 200, "one shard of two frozen: still ready, degraded: {body}");
        assert_eq!(body["status"], "degraded", "{body}");
        assert!(failing_names(&body).contains(&"shard s1".to_string()), "{body}");
        assert!(!failing_names(&body).contains(&"shard s0".to_string()), "{body}");
        // Liveness checks nothing, so a hung dependency restarts nobody.
        let (status, _, took) = get(&p.url, "/health/live").await;
        assert_eq!(status, 200);
        assert!(took < Duration::from_secs(1), "{took:?}");
    }
    freeze("-CONT");
    for p in [&writer, &reader] {
        eventually("ok again after the shard thawed", Duration::from_secs(20), || async {
            let (status, body, _) = get(&p.url, "/health/ready").await;
            (status == 200 && body["status"] == "ok").then_some(())
        })
        .await;
    }

    private.stop().await.expect("mariadbd stops");
    for p in [&writer, &reader] {
        let (status, body, took) = get(&p.url, "/health/ready").await;
        assert!(took < Duration::from_secs(2), "the answer took {took:?} with a stopped shard");
        assert_eq!((status, body["status"].as_str()), (200, Some("degraded")), "{body}");
        assert!(failing_names(&body).contains(&"shard s1".to_string()), "{body}");
    }
    // The writer's relay of that shard reports itself too, once it notices.
    eventually("the writer's relay of s1 reported failing", Duration::from_secs(20), || async {
        let (_, body, _) = get(&writer.url, "/health/ready").await;
        failing_names(&body).contains(&"relay s1".to_string()).then_some(())
    })
    .await;
}

/// The readiness answer is 503 when a process can serve nothing at all: an
/// indexer whose broker is gone; `ok` again when the broker is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_is_503_for_an_indexer_without_its_broker() {
    let env = TestEnv::new("healthbroker", STANDARD_INDEXES).await;
    env.migrate().await;
    let indexer = env.spawn(&["indexer", "--index", "index_user_id"]).await;
    eventually("the indexer ready and ok", Duration::from_secs(30), || async {
        let (status, body, _) = get(&indexer.url, "/health/ready").await;
        (status == 200 && body["status"] == "ok").then_some(())
    })
    .await;
    env.kafka.broker_down(1).expect("broker down");
    let (status, body, took) = get(&indexer.url, "/health/ready").await;
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert_eq!((status, body["status"].as_str()), (503, Some("unavailable")), "{body}");
    assert!(failing_names(&body).contains(&"broker".to_string()), "{body}");
    env.kafka.broker_up(1).expect("broker up");
    eventually("the indexer ok again", Duration::from_secs(30), || async {
        let (status, body, _) = get(&indexer.url, "/health/ready").await;
        (status == 200 && body["status"] == "ok").then_some(())
    })
    .await;
}

/// An indexer is not ready until its consumer holds its partitions
/// (docs/operations.md, "Health"): while the consumer cannot claim its
/// lease's share (here the metadata shard's claims table is locked, so the
/// claims wait) the answer is 503 `starting`, naming it in `waiting_for`;
/// once it is 200 the consumer holds every partition (a lone member's share
/// is all 4), so what is written then is applied as fast as in steady
/// state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_indexer_is_ready_only_once_its_consumer_holds_its_partitions() {
    let env = TestEnv::new("healthjoin", STANDARD_INDEXES).await;
    env.migrate().await;
    let meta = env.pool(0).await;
    let mut lock = meta.acquire().await.expect("a metadata shard connection");
    sqlx::query("LOCK TABLES bagstore_partition_claims WRITE").execute(&mut *lock).await.expect("lock");
    let indexer = env.spawn(&["indexer", "--index", "index_user_id"]).await;
    let started = Instant::now();
    let mut starting = 0;
    let mut unlocked = false;
    loop {
        let (status, body, _) = get(&indexer.url, "/health/ready").await;
        if status == 200 {
            assert!(unlocked, "ready while its claims could not be written: {body}");
            let metrics = indexer.api().metrics().await;
            let held = bagstore_tests::metric_sum(
                &metrics,
                "bagstore_indexer_assigned_partitions",
                &[("index", "index_user_id")],
            );
            assert_eq!(held, 4.0, "ready while its consumer holds {held} partitions: {body}");
            break;
        }
        assert_eq!((status, body["status"].as_str()), (503, Some("starting")), "{body}");
        assert_eq!(body["waiting_for"], serde_json::json!(["consumer index_user_id"]), "{body}");
        starting += 1;
        if !unlocked && started.elapsed() > Duration::from_secs(2) {
            sqlx::query("UNLOCK TABLES").execute(&mut *lock).await.expect("unlock");
            unlocked = true;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "not ready after 30 s: {body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(starting > 0, "ready at the first answer, before its consumer could have claimed anything");
    eprintln!("the indexer answered 503 starting {starting} times, ready after {:?}", started.elapsed());
}
