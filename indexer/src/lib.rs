//! The indexer: one Kafka consumer group per index table
//! (`bagstore-index-<table>`), applying change events to that index's rows
//! on every shard. Run as many processes as you like; the group spreads the
//! topic's partitions over them.
//!
//! In: change events from the topic. Out: index rows, offsets committed
//! only after those rows are committed in MySQL, undecodable events on the
//! dead-letter topic.
//!
//! Layout:
//! - [`plan`]: an event → row deletes and upserts (pure, unit-tested).
//! - [`apply`]: those row operations, one transaction per shard.
//! - [`consume`]: the consumer loop: batches, retries, offsets, dead letters.
//! - [`metrics`]: the series this crate exports.

pub mod apply;
pub mod consume;
pub mod metrics;
pub mod plan;

pub use consume::IndexConsumer;
pub use metrics::Metrics;
