//! The indexer: applies change events to index rows.
//!
//! It runs one Kafka consumer group per index table
//! (`bagstore-index-<table>`), applying change events to that index's rows
//! on every shard. Run as many processes as you like; the group spreads the
//! topic's partitions over them. (The cleaner, which repairs drift and
//! backfills new indexes from the entities themselves, is the `cleaner`
//! crate.)
//!
//! In: change events from the topic; entities and index rows from the
//! shards. Out: index rows, offsets committed only after those rows are
//! committed in MySQL, undecodable events on the dead-letter topic.
//!
//! Layout:
//! - [`plan`]: an event → row deletes and upserts (pure, unit-tested).
//! - [`apply`]: those row operations, one transaction per shard.
//! - [`consume`]: the consumer loop: batches, retries, offsets, dead letters
//!   (assignment, partition claims and rebuilds are `service::consumer`'s).
//!
//! The modules depend one way: `consume` → `apply` → `plan`.
//! - [`metrics`]: the series this crate exports.

pub mod apply;
pub mod consume;
pub mod metrics;
pub mod plan;

pub use consume::IndexConsumer;
pub use metrics::Metrics;
