//! The `bagstore` command: every service, the one-process `dev` stack, and
//! `migrate`, behind one binary.
//!
//! It is its own crate because it is the only place that depends on all
//! three services (`writer`, `indexer`, `reader`); the services never
//! depend on each other.
//!
//! Layout:
//! - [`admin`]: one-shot operator commands (backfill one index, drop one).
//! - [`client`]: the HTTP client commands (`put`, `get`, `query`, `lag`, …).
//! - [`app`]: assembling services (pools, metrics, routers, tasks) and
//!   running them until a signal, shared by `dev` and the single services.
//! - [`migrate`]: creating databases, tables, index metadata and topics.
//! - [`dev`]: private MariaDB shards + embedded Kafka + all services.
//! - [`local`]: the private `mariadbd` launcher (also used by the tests).
//! - [`logging`]: tracing setup.

pub mod admin;
pub mod app;
pub mod client;
pub mod dev;
pub mod local;
pub mod logging;
pub mod migrate;
