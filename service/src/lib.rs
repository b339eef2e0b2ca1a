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
//! - [`consumer`]: the fenced group consumer the index consumers and the
//!   writers' Kafka ingest share: assignment, claims, loss, rebuilds.
//! - [`leases`]: a consumer's member lease: the members of a group assign
//!   partitions among themselves.
//! - [`claims`]: the consumer's context: the partitions its lease gave it
//!   and the claims recorded for them, so a lost share is noticed.
//! - [`freshness`]: how far behind an index is (the one lag rule).
//! - [`cluster`]: keeping the map current; this process's heartbeat.
//! - [`health`]: liveness, and readiness by the policy of docs/operations.md,
//!   "Health".
//! - [`config`]: loading `Settings` from a file and the environment.
//! - [`serve`]: bind, serve, signal, and the graceful, bounded stop.

pub mod claims;
pub mod cluster;
pub mod config;
pub mod consumer;
pub mod freshness;
pub mod health;
pub mod http;
pub mod kafka;
pub mod leases;
pub mod serve;

pub use http::Problem;
