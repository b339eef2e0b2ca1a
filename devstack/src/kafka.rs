//! The embedded Kafka: librdkafka's mock cluster, a Kafka-protocol broker
//! inside this process, reachable over TCP by other processes. It keeps
//! nothing across restarts (see `bagstore dev`'s drain).

use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;
use schemas::settings::KafkaSettings;

/// A mock cluster of one broker. Not `Send`: it lives on the task that
/// made it.
pub type EmbeddedKafka = MockCluster<'static, DefaultProducerContext>;

/// Starts a mock cluster with the change topic, its dead-letter topic and
/// each of `also` (the public change stream; as `bagstore migrate` would
/// create them: the mock has no admin API), and points `k` at it.
pub fn start(k: &mut KafkaSettings, also: &[&str]) -> anyhow::Result<EmbeddedKafka> {
    let c = MockCluster::new(1)?;
    k.brokers = c.bootstrap_servers();
    // One broker: one replica (production's default is 3).
    k.replication_factor = 1;
    c.create_topic(&k.topic, k.partitions, 1)?;
    c.create_topic(&k.dlq_topic(), 1, 1)?;
    for t in also {
        c.create_topic(t, k.partitions, 1)?;
    }
    Ok(c)
}
