//! Process plumbing the services share: HTTP, Kafka clients, the freshness
//! rule, configuration loading, and the serve-then-stop sequence.
//!
//! In: settings and the storage layer. Out: routers, clients and helpers
//! that `writer`, `indexer`, `cleaner`, `reader` and the `bagstore` binary
//! build on. No domain logic lives here.
//!
//! Layout:
//! - [`http`]: problem documents, bounded bodies, default-deny route roles,
//!   request ids, request metrics, the ops routes.
//! - [`kafka`]: client configuration, topics, consumer-group lag.
//! - [`membership`]: noticing that the group gave a consumer's partitions
//!   away (the indexers and the writers' Kafka ingest).
//! - [`leases`]: an indexer's member lease, when indexers assign partitions
//!   among themselves.
//! - [`freshness`]: how far behind an index is (the one lag rule).
//! - [`cluster`]: keeping the map current; this process's heartbeat.
//! - [`health`]: liveness, and readiness by the README's policy.
//! - [`config`]: loading `Settings` from a file and the environment.
//! - [`serve`]: bind, serve, signal, and the graceful, bounded stop.

pub mod cluster;
pub mod config;
pub mod freshness;
pub mod health;
pub mod http;
pub mod kafka;
pub mod leases;
pub mod membership;
pub mod serve;

pub use http::Problem;
