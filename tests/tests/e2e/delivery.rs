//! Invariant W and consumer-group behaviour with separate `bagstore`
//! processes: a broker outage plus a writer crash between commit and
//! publish loses nothing; two indexers share a group and survive a crash.

use bagstore_tests::{eventually, metric_sum, until_query_is, TestEnv, STANDARD_INDEXES};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use schemas::event::ChangeEvent;
use serde_json::json;
use std::collections::HashMap;
use std::time::Duration;

fn entity_id(i: usize) -> String {
    format!("{:032x}", 0xabc0_0000u64 + i as u64)
}

fn user_id(i: usize, version: usize) -> String {
    format!("{:032x}", 0x5500_0000u64 + (i * 10 + version) as u64)
}

/// Every event on the topic, decoded, in partition order.
fn read_topic(env: &TestEnv) -> Vec<ChangeEvent> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", env.brokers())
        .set("group.id", format!("{}-checker", env.name))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut out = Vec::new();
    for p in 0..4 {
        let (_, high) = consumer.fetch_watermarks(&env.topic, p, Duration::from_secs(5)).unwrap();
        if high == 0 {
            continue;
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&env.topic, p, Offset::Beginning).unwrap();
        consumer.assign(&tpl).unwrap();
        let mut seen = 0;
        while seen < high {
            match consumer.poll(Duration::from_secs(5)) {
                Some(Ok(m)) => {
                    seen = m.offset() + 1;
                    out.push(ChangeEvent::decode(m.payload().unwrap()).unwrap());
                }
                Some(Err(e)) => panic!("consume: {e}"),
                None => panic!("partition {p} stalled at {seen} of {high}"),
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_committed_while_kafka_is_down_survive_a_writer_crash_and_are_indexed_in_order() {
    let env = TestEnv::new("outage", STANDARD_INDEXES).await;
    env.migrate().await;
    let indexer = env.spawn(&["indexer"]).await;
    let reader = env.spawn(&["reader"]).await;
    let writer = env.spawn(&["writer"]).await;
    let api = writer.api();
    // The outage hits a running system: every index consumer has joined.
    eventually("the indexer to own all partitions of its 4 groups", Duration::from_secs(60), || async {
        let m = indexer.api().metrics().await;
        (metric_sum(&m, "bagstore_indexer_assigned_partitions", &[]) == 16.0).then_some(())
    })
    .await;

    env.kafka.broker_down(1).unwrap();
    const N: usize = 12;
    for v in 1..=3 {
        for i in 0..N {
            let (s, b) = api.put(&entity_id(i), &json!({"user_id": user_id(i, v), "n": v})).await;
            assert!(s == 200 || s == 201, "{b}");
            assert_eq!(b["version"], v);
        }
    }
    // Committed, acknowledged, and not published: the events wait in the
    // outbox table.
    assert_eq!(env.count_rows("outbox").await, (3 * N) as i64);

    // The writer dies between commit and publish.
    writer.kill9().await;
    let writer2 = env.spawn(&["writer"]).await;
    env.kafka.broker_up(1).unwrap();

    eventually("the outbox to drain", Duration::from_secs(60), || async {
        env.caught_up(&[]).await.then_some(())
    })
    .await;
    let rapi = reader.api();
    for i in 0..N {
        until_query_is(&rapi, &json!({"where": {"user_id": user_id(i, 3)}}), &[&entity_id(i)]).await;
        for v in 1..3 {
            until_query_is(&rapi, &json!({"where": {"user_id": user_id(i, v)}}), &[]).await;
        }
    }

    // Every committed version reached Kafka, and per entity in version order.
    let events = read_topic(&env);
    let mut per_entity: HashMap<String, Vec<u64>> = HashMap::new();
    for e in &events {
        per_entity.entry(e.id.to_hex()).or_default().push(e.version);
    }
    assert_eq!(per_entity.len(), N);
    for (id, versions) in per_entity {
        let mut dedup = versions.clone();
        dedup.dedup();
        assert_eq!(dedup, vec![1, 2, 3], "entity {id}: versions on the topic {versions:?}");
    }
    let m = writer2.api().metrics().await;
    assert!(metric_sum(&m, "bagstore_writer_events_published_total", &[]) >= (3 * N) as f64, "{m}");
    assert_eq!(metric_sum(&m, "bagstore_writer_relay_leader", &[]), 2.0, "this writer leads both shards");
    writer2.terminate().await;
    indexer.terminate().await;
    reader.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_indexers_share_the_partitions_and_the_survivor_takes_over_after_a_crash() {
    let env = TestEnv::new("group", STANDARD_INDEXES).await;
    env.migrate().await;
    let writer = env.spawn(&["writer"]).await;
    let reader = env.spawn(&["reader"]).await;
    let one = env.spawn(&["indexer", "--index", "index_user_id"]).await;
    let two = env.spawn(&["indexer", "--index", "index_user_id"]).await;
    let assigned = |p: &bagstore_tests::Proc| {
        let api = p.api();
        async move {
            metric_sum(
                &api.metrics().await,
                "bagstore_indexer_assigned_partitions",
                &[("index", "index_user_id")],
            )
        }
    };
    eventually("both indexers to own partitions", Duration::from_secs(60), || async {
        let (a, b) = (assigned(&one).await, assigned(&two).await);
        (a > 0.0 && b > 0.0 && a + b == 4.0).then_some(())
    })
    .await;

    let api = writer.api();
    let rapi = reader.api();
    for i in 0..20 {
        api.put(&entity_id(i), &json!({"user_id": user_id(i, 0)})).await;
    }
    for i in 0..20 {
        until_query_is(&rapi, &json!({"where": {"user_id": user_id(i, 0)}}), &[&entity_id(i)]).await;
    }
    let applied_by = |p: &bagstore_tests::Proc| {
        let api = p.api();
        async move { metric_sum(&api.metrics().await, "bagstore_indexer_events_applied_total", &[]) }
    };
    assert!(applied_by(&one).await > 0.0 && applied_by(&two).await > 0.0, "both applied events");

    one.kill9().await;
    for i in 20..40 {
        api.put(&entity_id(i), &json!({"user_id": user_id(i, 0)})).await;
    }
    for i in 20..40 {
        until_query_is(&rapi, &json!({"where": {"user_id": user_id(i, 0)}}), &[&entity_id(i)]).await;
    }
    eventually("the survivor to own every partition", Duration::from_secs(30), || async {
        (assigned(&two).await == 4.0).then_some(())
    })
    .await;
    assert_eq!(env.count_rows("index_user_id").await, 40);
    two.terminate().await;
    writer.terminate().await;
    reader.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_events_go_to_the_dead_letter_topic_and_the_index_moves_on() {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let env = TestEnv::new("dlq", STANDARD_INDEXES).await;
    let dev = env.dev().await;
    let producer: FutureProducer =
        ClientConfig::new().set("bootstrap.servers", env.brokers()).create().unwrap();
    producer
        .send(
            FutureRecord::to(&env.topic).key(&[1u8; 16][..]).payload(&b"\x01not an event"[..]),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    let api = dev.api();
    let user = "7777cccc7777cccc7777cccc7777cccc";
    let id = "40000000000000000000000000000004";
    api.put(id, &json!({"user_id": user})).await;
    until_query_is(&api, &json!({"where": {"user_id": user}}), &[id]).await;
    eventually("one dead letter per index", Duration::from_secs(20), || async {
        let m = api.metrics().await;
        (metric_sum(&m, "bagstore_indexer_events_dead_lettered_total", &[]) == 4.0).then_some(())
    })
    .await;
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", env.brokers())
        .set("group.id", format!("{}-dlq-check", env.name))
        .create()
        .unwrap();
    let dlq = format!("{}.dlq", env.topic);
    let (_, high) = consumer.fetch_watermarks(&dlq, 0, Duration::from_secs(5)).unwrap();
    assert_eq!(high, 4);
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(&dlq, 0, Offset::Beginning).unwrap();
    consumer.assign(&tpl).unwrap();
    let m = consumer.poll(Duration::from_secs(5)).expect("a dead letter").unwrap();
    use rdkafka::message::Headers;
    let headers = m.headers().expect("headers");
    let reason = headers.iter().find(|h| h.key == "bagstore-reason").and_then(|h| h.value).unwrap();
    assert!(String::from_utf8_lossy(reason).contains("byte limit"), "{}", String::from_utf8_lossy(reason));
    assert_eq!(m.payload(), Some(&b"\x01not an event"[..]));
    dev.terminate().await;
}

/// An event delivered again after a newer one removed its key (a broker
/// that appends a retried batch a second time does this) does not bring the
/// index row back: the removal left a tombstone, which only a newer
/// version lifts (`storage::index_rows`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_event_delivered_again_after_its_entitys_delete_does_not_bring_its_row_back() {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let env = TestEnv::new("stale", STANDARD_INDEXES).await;
    let dev = env.dev().await;
    let api = dev.api();
    let user = "5ea1e5ea1e5ea1e5ea1e5ea1e5ea1e00";
    let id = "5ea1e000000000000000000000000001";
    assert_eq!(api.put(id, &json!({"user_id": user})).await.0, 201);
    until_query_is(&api, &json!({"where": {"user_id": user}}), &[id]).await;
    assert_eq!(api.delete(id).await.0, 200);
    eventually("the delete to reach index_user_id", Duration::from_secs(20), || async {
        (env.count_rows("index_user_id").await == 0).then_some(())
    })
    .await;

    // Version 1's event, exactly as the relay published it, appended again.
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", env.brokers())
        .set("group.id", format!("{}-stale-check", env.name))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut first = None;
    for p in 0..4 {
        let (_, high) = consumer.fetch_watermarks(&env.topic, p, Duration::from_secs(5)).unwrap();
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&env.topic, p, Offset::Beginning).unwrap();
        consumer.assign(&tpl).unwrap();
        for _ in 0..high {
            let m = consumer.poll(Duration::from_secs(5)).expect("a message").unwrap();
            let e = ChangeEvent::decode(m.payload().unwrap()).unwrap();
            if e.id.to_string() == id && e.version == 1 {
                first = Some((p, m.key().unwrap().to_vec(), m.payload().unwrap().to_vec()));
            }
        }
    }
    let (partition, key, payload) = first.expect("version 1's event on the topic");
    let producer: FutureProducer =
        ClientConfig::new().set("bootstrap.servers", env.brokers()).create().unwrap();
    let at = producer
        .send(
            FutureRecord::to(&env.topic).partition(partition).key(&key).payload(&payload),
            Duration::from_secs(5),
        )
        .await
        .unwrap()
        .offset;
    // The index's group has applied it once its committed offset is past it.
    let group = env.kafka_settings().group_for("index_user_id");
    let watcher: BaseConsumer =
        ClientConfig::new().set("bootstrap.servers", env.brokers()).set("group.id", &group).create().unwrap();
    eventually("index_user_id's group to commit past the old event", Duration::from_secs(20), || async {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(&env.topic, partition);
        let committed = watcher.committed_offsets(tpl, Duration::from_secs(5)).ok()?;
        let offset = committed.find_partition(&env.topic, partition)?.offset();
        matches!(offset, Offset::Offset(o) if o > at).then_some(())
    })
    .await;
    assert_eq!(
        env.count_rows("index_user_id").await,
        0,
        "the old event brought the deleted entity's row back"
    );
    let tombstones: Vec<(usize, (i64,))> =
        env.fetch_all_shards("SELECT COUNT(*) FROM index_user_id WHERE removed_us IS NOT NULL").await;
    assert_eq!(tombstones.iter().map(|(_, (n,))| n).sum::<i64>(), 1, "the delete's tombstone");
    assert!(api.query_ids(&json!({"where": {"user_id": user}})).await.is_empty());

    // A newer version lifts the tombstone.
    assert_eq!(api.put(id, &json!({"user_id": user})).await.0, 201);
    until_query_is(&api, &json!({"where": {"user_id": user}}), &[id]).await;
    assert_eq!(env.count_rows("index_user_id").await, 1);
    dev.terminate().await;
}
