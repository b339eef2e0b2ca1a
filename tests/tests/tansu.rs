//! bagstore on a standalone Kafka-protocol broker process, tansu 0.6.0 on
//! PostgreSQL storage, that tests kill with `kill -9` and restart on its
//! data: the harness's crash detector, one worker per partition after a
//! broker kill, the public change stream and Kafka ingest driven by a PyPI
//! `kafka-python` client (sharing no code with librdkafka), and member
//! leases handing a frozen indexer's partitions on. The chaos suite's tansu
//! run is a combination of `tests/tests/chaos.rs`.
//!
//! Its indexers and the writers' Kafka ingest take their partitions by
//! member leases, as they always do; tansu 0.6.0's own group coordinator
//! can keep a dead member as the group's leader, and a group then never
//! forms again (docs/design-notes.md, "tansu's group coordinator and a
//! dead leader"), one of the reasons bagstore does not use it.

use bagstore_tests::{TestEnv, STANDARD_INDEXES};

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
    let status = bagstore_tests::std_command("kill").args(["-9", &pid.to_string()]).status().expect("kill");
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
/// process was gone for longer than the lease (issue 17; the mock-cluster
/// run is in the `membership` suite). On tansu's own group protocol, which
/// bagstore no longer uses, this scenario settled 4 to 23 s after the
/// broker returned in earlier runs and not within 45 s in a CI run.
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
    eprintln!("tansu, member leases: {outcome}");
}

/// The public change stream read by a PyPI `kafka-python` consumer (a
/// client sharing no code with librdkafka) on the standalone broker: a
/// mixed workload with the writer killed with `kill -9` half way and
/// restarted, `bagstore changes snapshot` for a new group, more writes;
/// the consumer reads the group from its offsets (every message checked
/// against the JSON Schema, key and headers against the value) and ends
/// with exactly the live entities and their versions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_python_consumer_rebuilds_the_live_entities_from_snapshot_and_tail() {
    use bagstore_tests::python::{assert_rebuilt, consume_change_stream, mixed_round};
    // The change stream is on by default.
    let env = TestEnv::with_tansu("streamtansu", STANDARD_INDEXES).await;
    env.migrate().await;
    let reader = env.spawn(&["reader", "--http", "127.0.0.1:0"]).await;
    let writer = env.spawn(&["writer", "--http", "127.0.0.1:0"]).await;
    mixed_round(&writer.api(), 0).await;
    mixed_round(&writer.api(), 1).await;
    writer.kill9().await;
    let writer = env.spawn(&["writer", "--http", "127.0.0.1:0"]).await;
    mixed_round(&writer.api(), 2).await;
    let group = "warehouse-loader";
    let (ok, out, err) = env.run(&env.args(&["changes", "snapshot", "--group", group]), &[]).await;
    assert!(ok && out.contains("done"), "{out}{err}");
    mixed_round(&writer.api(), 3).await;
    env.until_caught_up(&[]).await;

    let (brokers, topic) = (env.brokers(), "bagstore.changes.v1");
    let (doc, said) =
        tokio::task::spawn_blocking(move || consume_change_stream(&brokers, topic, group, None))
            .await
            .unwrap();
    eprintln!("{said}");
    assert_rebuilt(&reader.api(), &doc, &said).await;
}

/// Kafka ingest from a PyPI `kafka-python` producer (a client sharing no
/// code with librdkafka) on the standalone broker: 10,000 commands, with
/// malformed ones, refused ones and resends of keyed ones, while two
/// writers consume them and one that holds ingest partitions (its member
/// lease's share) is killed with `kill -9`; a writer is started
/// again as a new member, so the dead one's partitions move when its lease
/// runs out. Every valid command is applied exactly once (each entity's
/// version and properties are the producer's valid commands applied once
/// each), every malformed or refused one is in the dead-letter topic with
/// its reason (once), and every correlation id is answered exactly once,
/// always the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_python_commands_apply_exactly_once_across_a_writer_kill() {
    let env = TestEnv::with_tansu("ingesttansu", STANDARD_INDEXES).await;
    env.migrate().await;
    let tally = bagstore_tests::ingest::producer_scenario(&env, 10_000, None).await;
    eprintln!("ingest: {tally:?}");
    assert!(tally.applied_entities > 250, "{tally:?}");
}

/// An indexer that stops (SIGSTOP, a stalled VM) and stays stopped: within
/// `membership::TAKEOVER_WITHIN` the other applies every partition. On
/// tansu 0.6.0's group protocol this failed in 3 of 17 runs (the survivor
/// applied nothing for 30 s; where the broker logged it, the frozen member
/// had been the group's leader, and tansu kept it as the leader after
/// ending its session); with member leases the survivor takes the
/// partitions when the lease runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_indexers_partitions_go_to_the_survivor_with_member_leases() {
    let env = TestEnv::with_tansu("frozentansu", STANDARD_INDEXES).await;
    let took = bagstore_tests::membership::a_frozen_indexers_partitions_go_to_the_survivor(&env).await;
    eprintln!("tansu, member leases: the survivor applied every partition {took:?} after the freeze");
}
