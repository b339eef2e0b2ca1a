//! The indexer and the cleaner: everything that writes index rows.
//!
//! The indexer runs one Kafka consumer group per index table
//! (`bagstore-index-<table>`), applying change events to that index's rows
//! on every shard. Run as many processes as you like; the group spreads the
//! topic's partitions over them. The cleaner repairs drift and backfills
//! new indexes from the entities themselves.
//!
//! In: change events from the topic; entities and index rows from the
//! shards. Out: index rows, offsets committed only after those rows are
//! committed in MySQL, undecodable events on the dead-letter topic.
//!
//! Layout:
//! - [`plan`]: an event → row deletes and upserts (pure, unit-tested).
//! - [`apply`]: those row operations, one transaction per shard.
//! - [`consume`]: the consumer loop: batches, retries, offsets, dead letters.
//! - [`cleaner`]: drift repair (continuous sweep) and online backfill.
//! - [`metrics`]: the series this crate exports.

pub mod apply;
pub mod cleaner;
pub mod consume;
pub mod metrics;
pub mod plan;

pub use cleaner::Cleaner;
pub use consume::IndexConsumer;
pub use metrics::{CleanerMetrics, Metrics};
