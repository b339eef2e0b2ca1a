//! The chaos suite against a standalone broker process that is killed with
//! `kill -9` and restarted on its data (tansu 0.6.0, PostgreSQL storage), with
//! indexer and writer crashes and killed MySQL connections in between. See
//! `bagstore_tests::chaos`.

use bagstore_tests::chaos::{self, ChaosConfig, Fault};
use bagstore_tests::{TestEnv, STANDARD_INDEXES};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invariants_hold_when_the_broker_process_is_killed_and_restarted() {
    let mut env = TestEnv::with_tansu("chaostansu", STANDARD_INDEXES).await;
    let faults = [Fault::BrokerKill, Fault::IndexerKill, Fault::WriterKill, Fault::MysqlKill];
    chaos::run(&mut env, ChaosConfig::from_env(&faults, 3)).await;
}

/// The chaos suite's crash detector: a broker process that dies without
/// the harness killing it is noticed, recorded (the suite fails on any
/// record) and started again on its data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_dies_on_its_own_is_recorded_as_a_crash() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tansu = bagstore_tests::tansu::Tansu::start(dir.path()).await.expect("tansu starts");
    assert_eq!(tansu.crash(), None, "a fresh broker is healthy");
    assert_eq!(tansu.check().await.expect("check"), None);
    let pid = tansu.pid().expect("running");
    // Not through the harness: as if the broker crashed.
    let status = std::process::Command::new("kill").args(["-9", &pid.to_string()]).status().expect("kill");
    assert!(status.success());
    let why =
        bagstore_tests::eventually("the crash to be noticed", std::time::Duration::from_secs(10), || async {
            tansu.crash()
        })
        .await;
    assert!(why.contains("exited"), "{why}");
    let recorded = tansu.check().await.expect("restart after a crash");
    assert!(recorded.is_some());
    assert_eq!(tansu.crashes().len(), 1, "{:?}", tansu.crashes());
    assert_eq!(tansu.crash(), None, "restarted and healthy again");
    assert_ne!(tansu.pid(), Some(pid));
}

/// No partition is fetched and applied by two indexers after the broker
/// process was gone for longer than the session timeout (issue 17; the
/// mock-cluster run is in the e2e suite's `membership`). tansu does not
/// tell a replaced member so (its heartbeats and commits are accepted):
/// before the partition claims (`indexer::membership`), two indexers both
/// held and applied a partition for 40 s and more here, beside the chaos
/// suite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_broker_kill_past_the_session_timeout_each_partition_has_one_worker() {
    use bagstore_tests::membership::{no_partition_is_worked_twice_after_an_outage, OUTAGE};
    let env = TestEnv::with_tansu("overlaptansu", STANDARD_INDEXES).await;
    let tansu = env.kafka.tansu().expect("tansu");
    let outcome = no_partition_is_worked_twice_after_an_outage(&env, || async {
        tansu.kill9();
        tokio::time::sleep(OUTAGE).await;
        tansu.restart().await.expect("tansu restarts");
    })
    .await;
    eprintln!("tansu: {outcome}");
}
