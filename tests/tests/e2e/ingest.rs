//! Kafka ingest answers each command once, also when its commands are
//! delivered again: a writer given partitions whose offsets were never
//! committed (as after a crash between answering and committing) reads
//! back what was already answered and does not answer it again; the same
//! across a writer kill. Patch commands
//! read their form by the rule HTTP follows.

use bagstore_tests::ingest::{ingest_lag, taken_by};
use bagstore_tests::{eventually, metric_sum, TestEnv, STANDARD_INDEXES};
use rdkafka::message::Headers;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Message};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::Duration;

const TOPIC: &str = "bagstore.ingest.v1";
const REPLIES: &str = "bagstore.ingest.v1.replies";
const DLQ: &str = "bagstore.ingest.v1.dlq";
const COMMANDS: usize = 200;

/// One answer as read from its topic.
#[derive(Debug)]
struct Answer {
    partition: i32,
    value: Value,
    /// The `bagstore-ingest-source` header.
    source: String,
}

/// Every message of `topic` (4 partitions), from the beginning.
fn read_all(brokers: &str, topic: &str) -> Vec<Answer> {
    bagstore_tests::model::read_messages(brokers, topic, 4, |m| {
        let source = m
            .headers()
            .and_then(|h| h.iter().find(|h| h.key == "bagstore-ingest-source").and_then(|h| h.value))
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .unwrap_or_default();
        let value = serde_json::from_slice(m.payload().expect("payload")).expect("JSON");
        Answer { partition: m.partition(), value, source }
    })
}

/// Replies per correlation id.
fn replies_by_cid(answers: &[Answer]) -> BTreeMap<String, Vec<&Answer>> {
    let mut by: BTreeMap<String, Vec<&Answer>> = BTreeMap::new();
    for a in answers {
        by.entry(a.value["correlation_id"].as_str().expect("correlation_id").to_string())
            .or_default()
            .push(a);
    }
    by
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn commands_delivered_again_to_a_new_writer_are_not_answered_again() {
    let env = TestEnv::new("ingestonce", STANDARD_INDEXES).await;
    env.migrate().await;
    let reader = env.spawn(&["reader", "--http", "127.0.0.1:0"]).await;
    let first = env.spawn(&["writer", "--http", "127.0.0.1:0"]).await;

    // Puts over 50 entities; every tenth command malformed (a dead letter
    // and a refusing reply).
    let producer: FutureProducer =
        ClientConfig::new().set("bootstrap.servers", env.brokers()).create().expect("producer");
    let mut malformed = 0;
    for n in 0..COMMANDS {
        let id = format!("{:032x}", 0x1e57_0000u64 + (n % 50) as u64);
        let command = match n % 10 {
            9 => {
                malformed += 1;
                json!({"op": "put", "id": id, "correlation_id": format!("c{n}")})
            }
            _ => json!({"op": "put", "id": id, "properties": {"n": n}, "correlation_id": format!("c{n}")}),
        };
        let payload = command.to_string();
        producer
            .send(FutureRecord::to(TOPIC).key(&id).payload(&payload), Duration::from_secs(5))
            .await
            .expect("command sent");
    }

    let brokers = env.brokers();
    eventually("every command answered by the first writer", Duration::from_secs(60), || {
        let brokers = brokers.clone();
        async move {
            let replies = tokio::task::spawn_blocking(move || read_all(&brokers, REPLIES)).await.unwrap();
            (replies_by_cid(&replies).len() == COMMANDS).then_some(())
        }
    })
    .await;
    let api = reader.api();
    eventually("the first writer to commit its offsets", Duration::from_secs(30), || async {
        (ingest_lag(&api).await == Some(0)).then_some(())
    })
    .await;
    assert_eq!(first.terminate().await, Some(0));

    // As if the first writer had died after answering, before committing:
    // the second writer's group (another prefix) has no offsets, so every
    // command is delivered to it again.
    let second = env
        .spawn_env(&["writer", "--http", "127.0.0.1:0"], &[("BAGSTORE_KAFKA__GROUP_PREFIX", "second.")])
        .await;
    eventually("the second writer to take every command again", Duration::from_secs(60), || async {
        (taken_by(&second).await >= COMMANDS as f64).then_some(())
    })
    .await;
    let k = env.kafka_settings();
    eventually("the second writer to commit its offsets", Duration::from_secs(30), || async {
        let lag = service::kafka::group_lag_on(&k, "second.bagstore-ingest", TOPIC).await.ok()?;
        (lag.len() == 4 && lag.iter().all(|p| p.lag() == 0)).then_some(())
    })
    .await;
    // It did take them again (the rewind took), and applied none again.
    let metrics = second.api().metrics().await;
    let replayed = metric_sum(&metrics, "bagstore_ingest_commands_total", &[("outcome", "duplicate")]);
    assert_eq!(replayed, (COMMANDS - malformed) as f64, "{metrics}");

    let (replies, dead) =
        tokio::task::spawn_blocking(move || (read_all(&brokers, REPLIES), read_all(&brokers, DLQ)))
            .await
            .unwrap();
    let by_cid = replies_by_cid(&replies);
    assert_eq!(by_cid.len(), COMMANDS);
    for (cid, answers) in &by_cid {
        assert_eq!(answers.len(), 1, "{cid} answered {} times: {answers:?}", answers.len());
        let a = answers[0];
        let n: usize = cid[1..].parse().expect("c<n>");
        assert_eq!(a.value["ok"], n % 10 != 9, "{cid}: {a:?}");
        // The header names the command, and the reply is in its partition.
        let (_, place) = a.source.split_once('/').expect("topic/partition/offset");
        let partition: i32 = place.split('/').next().unwrap().parse().expect("partition");
        assert!(a.source.starts_with(&format!("{TOPIC}/")), "{a:?}");
        assert_eq!(a.partition, partition, "{a:?}");
    }
    assert_eq!(dead.len(), malformed, "one dead letter per malformed command: {dead:?}");
    let mut sources: Vec<&str> = dead.iter().map(|d| d.source.as_str()).collect();
    sources.sort_unstable();
    sources.dedup();
    assert_eq!(sources.len(), malformed, "{dead:?}");
}

/// Patch commands read their form by the rule the HTTP route follows
/// (`schemas::patch::parse`): `"form"` declares it, and without it the keys
/// decide; a mix (and a form that is neither) is refused, dead-lettered
/// with its reason and answered as such. One entity's commands apply in
/// their order, so its versions count the valid ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patch_commands_read_their_form_by_the_rule_http_follows() {
    let env = TestEnv::new("ingestform", STANDARD_INDEXES).await;
    env.migrate().await;
    let reader = env.spawn(&["reader", "--http", "127.0.0.1:0"]).await;
    let _writer = env.spawn(&["writer", "--http", "127.0.0.1:0"]).await;
    let id = format!("{:032x}", 0xf0f0_0001u64);
    let patch = |n: u32, doc: Value, form: Option<&str>| {
        let mut c = json!({"op": "patch", "id": id, "patch": doc, "correlation_id": format!("f{n}")});
        if let Some(f) = form {
            c["form"] = json!(f);
        }
        c
    };
    let commands = [
        json!({"op": "put", "id": id, "properties": {"n": 1, "old": true}, "correlation_id": "f0"}),
        // Undeclared, no `$`: a merge patch.
        patch(1, json!({"title": "t", "old": null}), None),
        // Undeclared, all `$`: operators.
        patch(2, json!({"$inc": {"n": 1}}), None),
        // Declared merge: `$price` is a property.
        patch(3, json!({"$price": 5}), Some("merge")),
        patch(4, json!({"$set": {"n": 10}}), Some("operators")),
        // Refused: a mix, and a form that is neither.
        patch(5, json!({"$price": 6, "n": 0}), None),
        patch(6, json!({"n": 0}), Some("merged")),
    ];
    let producer: FutureProducer =
        ClientConfig::new().set("bootstrap.servers", env.brokers()).create().expect("producer");
    for c in &commands {
        let payload = c.to_string();
        producer
            .send(FutureRecord::to(TOPIC).key(&id).payload(&payload), Duration::from_secs(5))
            .await
            .expect("command sent");
    }
    let brokers = env.brokers();
    let sent = commands.len();
    let replies = eventually("every command answered", Duration::from_secs(60), || {
        let brokers = brokers.clone();
        async move {
            let replies = tokio::task::spawn_blocking(move || read_all(&brokers, REPLIES)).await.unwrap();
            (replies.len() >= sent).then_some(replies)
        }
    })
    .await;
    let by_cid = replies_by_cid(&replies);
    for (n, version) in [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)] {
        let a = &by_cid[&format!("f{n}")];
        assert_eq!(
            (a.len(), &a[0].value["ok"], &a[0].value["version"]),
            (1, &json!(true), &json!(version)),
            "{a:?}"
        );
    }
    for (n, says) in [(5, "mixes"), (6, "\"form\" must be")] {
        let a = &by_cid[&format!("f{n}")];
        assert_eq!((a.len(), &a[0].value["ok"]), (1, &json!(false)), "{a:?}");
        let detail = a[0].value["problem"]["detail"].as_str().unwrap_or_default();
        assert!(detail.contains(says), "f{n}: {detail}");
    }
    let (status, got) = reader.api().get(&id).await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(
        (&got["version"], &got["properties"]),
        (&json!(5), &json!({"n": 10, "title": "t", "$price": 5}))
    );
    let dead = tokio::task::spawn_blocking(move || read_all(&brokers, DLQ)).await.unwrap();
    let reasons: Vec<&str> = dead.iter().filter_map(|d| d.value["reason"].as_str()).collect();
    assert_eq!(reasons.len(), 2, "{dead:?}");
    assert!(reasons[0].contains("mixes") && reasons[1].contains("\"form\""), "{reasons:?}");
}

/// On the mock broker: a kafka-python producer's commands while two writers consume them, one that holds
/// ingest partitions killed with `kill -9` and a new member started
/// (`bagstore_tests::ingest::producer_scenario`, the tansu chaos suite's
/// run, smaller): every valid command applied once, every malformed or
/// refused one dead-lettered once, every correlation id answered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_apply_and_are_answered_once_across_a_writer_kill() {
    let env = TestEnv::new("ingestleases", STANDARD_INDEXES).await;
    env.migrate().await;
    // The mock cluster answers kafka-python's version probe in a way it
    // cannot use: the protocol version is pinned, as for the change stream.
    let tally = bagstore_tests::ingest::producer_scenario(&env, 3_000, Some("1.0.0")).await;
    eprintln!("ingest on member leases: {tally:?}");
    assert!(tally.applied_entities > 250 && tally.dead_lettered > 0, "{tally:?}");
}
