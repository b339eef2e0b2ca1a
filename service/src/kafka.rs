//! Kafka client settings every service shares, topic creation, and the lag
//! of an index's consumer group measured from the broker (so lag is known
//! even when no indexer of that group is alive).

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::config::{FromClientConfig, FromClientConfigAndContext};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::types::RDKafkaConfRes;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use schemas::settings::{is_secret_kafka_option, KafkaSettings};

/// Settings every client shares. Reconnect backoff is capped at 1 s so a
/// broker that comes back is used again quickly.
pub fn base_config(k: &KafkaSettings) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &k.brokers).set("reconnect.backoff.max.ms", "1000");
    for (key, value) in &k.options {
        c.set(key, value);
    }
    c
}

/// Creates a client from `cfg`, like [`ClientConfig::create`], except that a
/// rejected property's value is left out of the error when it may be a
/// secret (rdkafka quotes the value, and these errors end up in logs).
pub fn create<C: FromClientConfig>(cfg: &ClientConfig) -> Result<C, KafkaError> {
    cfg.create().map_err(redact_config_error)
}

/// [`create`], with a client context.
pub fn create_with<C: FromClientConfigAndContext<X>, X: ClientContext>(
    cfg: &ClientConfig,
    context: X,
) -> Result<C, KafkaError> {
    cfg.create_with_context(context).map_err(redact_config_error)
}

/// Hides the value in a `ClientConfig` error about a secret property, or
/// about a property librdkafka does not know: that is a misspelt key, and
/// nobody can tell which secret it was meant to be.
fn redact_config_error(e: KafkaError) -> KafkaError {
    match e {
        KafkaError::ClientConfig(code, desc, key, value)
            if code == RDKafkaConfRes::RD_KAFKA_CONF_UNKNOWN || is_secret_kafka_option(&key) =>
        {
            let desc = if value.is_empty() { desc } else { desc.replace(&value, "***") };
            KafkaError::ClientConfig(code, desc, key, "***".into())
        }
        other => other,
    }
}

/// An idempotent producer with `acks=all`, so retries inside librdkafka
/// neither duplicate nor reorder the messages of one partition; a message
/// fails after `kafka.message_timeout_ms`. Bodies are already compressed
/// (lz4 events, small JSON), so no second compression.
pub fn producer_config(k: &KafkaSettings) -> ClientConfig {
    let mut c = base_config(k);
    c.set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "2")
        .set("compression.type", "none")
        .set("message.timeout.ms", k.message_timeout_ms.to_string());
    with_options(c, k)
}

/// The relay's producer: as [`producer_config`], but its messages never time
/// out inside librdkafka (`message.timeout.ms=0`). When an idempotent
/// producer times a message out, it bumps its epoch and goes on delivering
/// the later ones (KIP-360), so an entity's version 10 could reach the topic
/// before the version 8 that timed out. The relay keeps its own deadline
/// (`kafka.message_timeout_ms`) and, when it passes, throws the whole
/// producer away instead, which then sends nothing more.
pub fn relay_producer_config(k: &KafkaSettings) -> ClientConfig {
    let mut c = producer_config(k);
    c.set("message.timeout.ms", "0");
    with_options(c, k)
}

/// Operator-given librdkafka properties win over bagstore's defaults.
fn with_options(mut c: ClientConfig, k: &KafkaSettings) -> ClientConfig {
    for (key, value) in &k.options {
        c.set(key, value);
    }
    c
}

/// An index consumer: offsets are *stored* by our code only after the
/// index rows they stand for are committed in MySQL, and librdkafka's
/// auto-commit then commits what was stored (at-least-once). `fetch_wait_ms`
/// is its `fetch.wait.max.ms` (see `schemas::settings::FETCH_WAIT_MS`);
/// `kafka.options` still wins over it.
pub fn consumer_config(k: &KafkaSettings, group: &str, fetch_wait_ms: u64) -> ClientConfig {
    let mut c = base_config(k);
    c.set("group.id", group)
        .set("enable.auto.commit", "true")
        .set("auto.commit.interval.ms", "500")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("fetch.wait.max.ms", fetch_wait_ms.to_string());
    with_options(c, k)
}

/// Whether `topic` exists with at least one partition (a metadata request;
/// some brokers, such as librdkafka's mock cluster, do not implement the
/// admin API, so existing topics are detected before trying to create them).
async fn topic_exists(k: &KafkaSettings, topic: &str) -> Result<bool, KafkaError> {
    let cfg = base_config(k);
    let topic = topic.to_string();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = create(&cfg)?;
        let md = consumer.fetch_metadata(Some(&topic), Duration::from_secs(10))?;
        Ok(md.topics().iter().any(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty()))
    })
    .await
    .map_err(|_| KafkaError::Canceled)?
}

/// Creates the change topic and its dead-letter topic if missing, and each
/// of `also` (topics with the change topic's partitions: the public change
/// stream).
pub async fn ensure_topics(k: &KafkaSettings, also: &[&str]) -> Result<(), KafkaError> {
    if topics_exist(k, also).await? {
        return Ok(());
    }
    let admin: AdminClient<DefaultClientContext> = create(&base_config(k))?;
    let dlq = k.dlq_topic();
    let mut topics = vec![
        NewTopic::new(&k.topic, k.partitions, TopicReplication::Fixed(k.replication_factor)),
        NewTopic::new(&dlq, 1, TopicReplication::Fixed(k.replication_factor)),
    ];
    topics.extend(
        also.iter().map(|t| NewTopic::new(t, k.partitions, TopicReplication::Fixed(k.replication_factor))),
    );
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    for result in admin.create_topics(&topics, &opts).await? {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => {
                return Err(KafkaError::AdminOp(code))
                    .inspect_err(|_| tracing::error!(%topic, "cannot create topic"))
            }
        }
    }
    Ok(())
}

/// Whether the change topic, its dead-letter topic and each of `also` exist.
pub async fn topics_exist(k: &KafkaSettings, also: &[&str]) -> Result<bool, KafkaError> {
    if !(topic_exists(k, &k.topic).await? && topic_exists(k, &k.dlq_topic()).await?) {
        return Ok(false);
    }
    for t in also {
        if !topic_exists(k, t).await? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// How many brokers the cluster's metadata lists.
pub async fn broker_count(k: &KafkaSettings) -> Result<usize, KafkaError> {
    let cfg = base_config(k);
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = create(&cfg)?;
        Ok(consumer.fetch_metadata(None, Duration::from_secs(10))?.brokers().len())
    })
    .await
    .map_err(|_| KafkaError::Canceled)?
}

/// A consumer that speaks for `group` (reads and commits its offsets)
/// without subscribing, so it never joins the group or triggers a rebalance.
fn group_consumer(k: &KafkaSettings, group: &str) -> Result<BaseConsumer, KafkaError> {
    let mut cfg = base_config(k);
    cfg.set("group.id", group).set("enable.auto.commit", "false");
    create(&cfg)
}

/// How long a new client's watermark queries are not trusted. Measured on
/// tansu 0.6: a client's first queries, for about its first second, answer
/// (0, 0) for partitions holding hundreds of messages, without an error. A
/// high watermark of 0 reads as "no lag", so a lag check (and the
/// cleaner's line between lag and drift) believed the indexes caught up
/// while they were not; a group placed at "the end" started at 0.
const WATERMARK_WARMUP: Duration = Duration::from_secs(2);

/// A client unused for this long is dropped from [`GROUP_CLIENTS`].
const CLIENT_IDLE: Duration = Duration::from_secs(60);

type GroupClients = HashMap<String, (Arc<BaseConsumer>, Instant, Instant)>;

/// [`group_consumer`]s kept for their group (keyed by the settings that
/// reach the cluster and the group), with when each was made and last used,
/// so periodic lag reads pay the warm-up once.
static GROUP_CLIENTS: Mutex<Option<GroupClients>> = Mutex::new(None);

/// A warmed-up client for `group`: kept from an earlier call, or made now
/// and waited on until its watermark queries can be trusted (blocking:
/// call from a blocking task).
fn warm_group_consumer(k: &KafkaSettings, group: &str) -> Result<Arc<BaseConsumer>, KafkaError> {
    let key = format!("{}|{:?}|{group}", k.brokers, k.options);
    let now = Instant::now();
    let (client, made) = {
        let mut all = GROUP_CLIENTS.lock().expect("not poisoned");
        let all = all.get_or_insert_with(HashMap::new);
        all.retain(|_, (_, _, used)| now.duration_since(*used) < CLIENT_IDLE);
        match all.get_mut(&key) {
            Some((c, made, used)) => {
                *used = now;
                (c.clone(), *made)
            }
            None => {
                let c = Arc::new(group_consumer(k, group)?);
                all.insert(key, (c.clone(), now, now));
                (c, now)
            }
        }
    };
    if let Some(rest) = WATERMARK_WARMUP.checked_sub(made.elapsed()) {
        std::thread::sleep(rest);
    }
    // Serve what the client has queued (broker state changes, errors): it
    // is used only through calls that wait for their own answers.
    while client.poll(Duration::ZERO).is_some() {}
    Ok(client)
}

/// Forgets `group`'s kept client (after it failed: the next call makes a
/// new one).
fn forget_group_consumer(k: &KafkaSettings, group: &str) {
    let key = format!("{}|{:?}|{group}", k.brokers, k.options);
    if let Some(all) = GROUP_CLIENTS.lock().expect("not poisoned").as_mut() {
        all.remove(&key);
    }
}

fn topic_partitions(consumer: &BaseConsumer, topic: &str, timeout: Duration) -> Result<Vec<i32>, KafkaError> {
    let md = consumer.fetch_metadata(Some(topic), timeout)?;
    Ok(md.topics().iter().flat_map(|t| t.partitions().iter().map(|p| p.id())).collect())
}

/// Lag of one partition for one consumer group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionLag {
    pub partition: i32,
    /// The next offset the broker will assign.
    pub high_watermark: i64,
    /// The group's committed offset (the next event it will read); `None`
    /// when it has committed nothing for this partition yet.
    pub committed: Option<i64>,
}

impl PartitionLag {
    /// Events not yet applied by the group.
    pub fn lag(&self) -> i64 {
        let low = self.committed.unwrap_or(0);
        (self.high_watermark - low).max(0)
    }
}

/// Reads the group's committed offsets and the change topic's high
/// watermarks. The consumer used here never subscribes, so it does not
/// join the group.
pub async fn group_lag(k: &KafkaSettings, group: &str) -> Result<Vec<PartitionLag>, KafkaError> {
    group_lag_on(k, group, &k.topic).await
}

/// [`group_lag`] on another topic (the Kafka ingest group's on its topic).
pub async fn group_lag_on(
    k: &KafkaSettings,
    group: &str,
    topic: &str,
) -> Result<Vec<PartitionLag>, KafkaError> {
    let k = k.clone();
    let (group, topic) = (group.to_string(), topic.to_string());
    tokio::task::spawn_blocking(move || {
        let consumer = warm_group_consumer(&k, &group)?;
        let result = lag_of(&consumer, &topic);
        if result.is_err() {
            forget_group_consumer(&k, &group);
        }
        result
    })
    .await
    .map_err(|_| KafkaError::Canceled)?
}

fn lag_of(consumer: &BaseConsumer, topic: &str) -> Result<Vec<PartitionLag>, KafkaError> {
    let timeout = Duration::from_secs(5);
    let partitions = topic_partitions(consumer, topic, timeout)?;
    let mut tpl = TopicPartitionList::new();
    for p in &partitions {
        tpl.add_partition(topic, *p);
    }
    let committed = consumer.committed_offsets(tpl, timeout)?;
    let mut out = Vec::new();
    for p in partitions {
        let (_, high) = consumer.fetch_watermarks(topic, p, timeout)?;
        let committed = committed.find_partition(topic, p).and_then(|e| match e.offset() {
            Offset::Offset(o) => Some(o),
            _ => None,
        });
        out.push(PartitionLag { partition: p, high_watermark: high, committed });
    }
    Ok(out)
}

/// Which of a topic's partitions [`place_group_at_end`] moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placing {
    /// Every partition: a change stream snapshot's group, whose events
    /// before the snapshot the snapshot itself replaces. The broker refuses
    /// the commit while the group has live members.
    Every,
    /// Only where the group has committed nothing: a consumer group created
    /// for a new index, so it does not replay the whole topic (the backfill
    /// that follows reads every entity as it is now). A partition the group
    /// already committed on is left alone: its indexers may be consuming it
    /// (they never join the broker's group, so the broker would not
    /// refuse), and skipping their events could lose an index row the
    /// backfill already passed.
    Uncommitted,
}

/// Commits `group`'s offsets on `topic` at the topic's current end, on the
/// partitions `placing` names; returns those placed (partition, offset).
pub async fn place_group_at_end(
    k: &KafkaSettings,
    group: &str,
    topic: &str,
    placing: Placing,
) -> Result<Vec<(i32, i64)>, KafkaError> {
    let k = k.clone();
    let (group, topic) = (group.to_string(), topic.to_string());
    tokio::task::spawn_blocking(move || {
        let consumer = warm_group_consumer(&k, &group)?;
        let placed = (|| {
            let timeout = Duration::from_secs(5);
            let mut partitions = topic_partitions(&consumer, &topic, timeout)?;
            if placing == Placing::Uncommitted {
                let mut all = TopicPartitionList::new();
                for p in &partitions {
                    all.add_partition(&topic, *p);
                }
                let committed = consumer.committed_offsets(all, timeout)?;
                partitions.retain(|p| {
                    !committed
                        .find_partition(&topic, *p)
                        .is_some_and(|e| matches!(e.offset(), Offset::Offset(_)))
                });
            }
            let mut tpl = TopicPartitionList::new();
            let mut placed = Vec::new();
            for p in partitions {
                let (_, high) = consumer.fetch_watermarks(&topic, p, timeout)?;
                tpl.add_partition_offset(&topic, p, Offset::Offset(high))?;
                placed.push((p, high));
            }
            if !placed.is_empty() {
                consumer.commit(&tpl, CommitMode::Sync)?;
            }
            Ok(placed)
        })();
        if placed.is_err() {
            forget_group_consumer(&k, &group);
        }
        placed
    })
    .await
    .map_err(|_| KafkaError::Canceled)?
}

/// How many partitions `topic` has (blocking: call from a blocking task).
pub fn partition_count(k: &KafkaSettings, topic: &str) -> Result<usize, KafkaError> {
    let consumer: BaseConsumer = create(&base_config(k))?;
    Ok(topic_partitions(&consumer, topic, Duration::from_secs(10))?.len())
}

/// Reads one partition backwards from its end, `window` offsets at a time,
/// giving each window's messages (in offset order) to `more`, until `more`
/// answers false or the start of the log is read. `reader` names the kept
/// client (see [`warm_group_consumer`]): it only assigns, never joins a
/// group, and one caller at a time may use a name. Blocking: call from a
/// blocking task.
pub fn read_backwards(
    k: &KafkaSettings,
    reader: &str,
    topic: &str,
    partition: i32,
    window: i64,
    mut more: impl FnMut(&[OwnedMessage]) -> bool,
) -> Result<(), KafkaError> {
    let consumer = warm_group_consumer(k, reader)?;
    let read = (|| {
        let timeout = Duration::from_secs(5);
        let (low, mut end) = consumer.fetch_watermarks(topic, partition, timeout)?;
        while end > low {
            let start = (end - window.max(1)).max(low);
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition_offset(topic, partition, Offset::Offset(start))?;
            consumer.assign(&tpl)?;
            let mut got: Vec<OwnedMessage> = Vec::new();
            while got.last().is_none_or(|m| m.offset() < end - 1) {
                match consumer.poll(timeout) {
                    // Left in the queue by an earlier window: not this one.
                    Some(Ok(m)) if m.topic() != topic || m.partition() != partition || m.offset() < start => {
                    }
                    Some(Ok(m)) if m.offset() >= end => break,
                    Some(Ok(m)) => got.push(m.detach()),
                    Some(Err(e)) => return Err(e),
                    None => return Err(KafkaError::MessageConsumption(RDKafkaErrorCode::OperationTimedOut)),
                }
            }
            if !more(&got) {
                break;
            }
            end = start;
        }
        Ok(())
    })();
    let _ = consumer.unassign();
    if read.is_err() {
        forget_group_consumer(k, reader);
    }
    read
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error creating a client from `cfg` (clients are not Debug, so no `expect_err`).
    fn creation_error(result: Result<BaseConsumer, KafkaError>) -> KafkaError {
        match result {
            Ok(_) => panic!("the client was created"),
            Err(e) => e,
        }
    }

    fn settings_with(key: &str, value: &str) -> KafkaSettings {
        let mut k = KafkaSettings { brokers: "127.0.0.1:9".into(), ..Default::default() };
        k.options.insert(key.into(), value.into());
        k
    }

    #[test]
    fn a_rejected_secret_option_is_named_but_its_value_is_not_quoted() {
        // A misspelt property: librdkafka rejects it, and rdkafka's error
        // would quote the value. Even a name that does not look secret
        // (`sasl.pw` for `sasl.password`) is kept out.
        let k = settings_with("sasl.pw", "hunter2");
        let raw = creation_error(base_config(&k).create());
        assert!(raw.to_string().contains("hunter2"), "rdkafka quotes the value: {raw}");
        let err = creation_error(create(&base_config(&k)));
        let text = format!("{err} / {err:?}");
        assert!(text.contains("sasl.pw"), "{text}");
        assert!(!text.contains("hunter2"), "{text}");
    }

    #[test]
    fn a_known_secret_property_rejected_by_librdkafka_is_redacted_everywhere() {
        // E.g. an OAuth secret on a librdkafka built without libcurl.
        let err = redact_config_error(KafkaError::ClientConfig(
            RDKafkaConfRes::RD_KAFKA_CONF_INVALID,
            "Invalid value \"hunter2\" for configuration property".into(),
            "sasl.oauthbearer.client.secret".into(),
            "hunter2".into(),
        ));
        let text = format!("{err} / {err:?}");
        assert!(text.contains("sasl.oauthbearer.client.secret"), "{text}");
        assert!(!text.contains("hunter2"), "{text}");
    }

    #[test]
    fn a_rejected_ordinary_option_keeps_its_value_in_the_error() {
        let k = settings_with("security.protocol", "tls");
        let err = creation_error(create(&producer_config(&k)));
        assert!(err.to_string().contains("tls"), "{err}");
    }

    #[test]
    fn every_client_config_carries_the_operator_options() {
        let mut k = settings_with("security.protocol", "ssl");
        k.options.insert("ssl.ca.location".into(), "/etc/bagstore/ca.pem".into());
        k.options.insert("acks".into(), "1".into());
        for cfg in [base_config(&k), producer_config(&k), consumer_config(&k, "g", 20)] {
            assert_eq!(cfg.get("security.protocol"), Some("ssl"));
            assert_eq!(cfg.get("ssl.ca.location"), Some("/etc/bagstore/ca.pem"));
        }
        // Applied last, so they override bagstore's own defaults.
        assert_eq!(producer_config(&k).get("acks"), Some("1"));
    }
}
