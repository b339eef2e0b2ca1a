//! The `bagstore` command: every service, the one-process `dev` stack,
//! `migrate`, operator commands and API client commands, behind one binary.
//! It only assembles: the work is in the service crates (`writer`,
//! `indexer`, `cleaner`, `reader`), which never depend on each other.
//!
//! Layout:
//! - [`app`]: assembling services (pools, metrics, routes with their roles,
//!   tasks) and serving them until a signal.
//! - [`migrate`]: creating databases, tables, the index catalog and topics.
//! - [`dev`]: private MariaDB shards + embedded Kafka + all services
//!   (infrastructure from `devstack`).
//! - [`admin`]: one-shot operator commands (backfill one index, drop one).
//! - [`shards`]: `bagstore shards …`: physical shards, moves, rebalancing.
//! - [`changes`]: `bagstore changes snapshot`: a new change stream consumer
//!   group brought up to date.
//! - [`progress`]: progress bars and lines for long commands.
//! - [`client_commands`]: `put`, `get`, `query`, `lag`, … over HTTP.
//! - `table`: plain-text tables, the human form of both kinds of command.
//! - [`logging`]: tracing setup.

pub mod admin;
pub mod app;
pub mod changes;
pub mod client_commands;
pub mod dev;
pub mod dev_replicas;
pub mod logging;
pub mod migrate;
pub mod progress;
pub mod replicas;
pub mod shards;
pub mod switchover;
mod table;
