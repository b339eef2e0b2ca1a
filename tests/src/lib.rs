//! The local-stack harness for bagstore's end-to-end suites.
//!
//! Layout:
//! - [`servers`]: two private `mariadbd` servers per test process; unique
//!   names, so every test gets fresh databases and topics.
//! - [`env`]: [`TestEnv`], one test's world: databases on both servers, its
//!   own Kafka (librdkafka's mock cluster, with broker down/up faults, or a
//!   [`tansu`] broker process to `kill -9`), a temp dir and a config file.
//! - [`process`]: [`Proc`] runs the real `bagstore` binary and waits for
//!   its ready line.
//! - [`api`]: [`Api`], the HTTP API through the `client` crate, and metric
//!   helpers.
//! - [`poll`]: [`eventually`] polls with a deadline; tests never sleep
//!   blindly.
//! - [`model`]: the reference model the suites check results against.
//! - [`chaos`]: the chaos suite, written once, run as a matrix of broker and
//!   replication (`chaos::matrix`: mock, tansu, failover).
//! - [`membership`]: no partition worked on by two indexers after an
//!   outage, also run against both brokers.
//! - [`replicated`]: private replicated shards (issue 33's suites and
//!   benchmark).

pub mod api;
pub mod chaos;
pub mod env;
pub mod ingest;
pub mod membership;
pub mod model;
pub mod poll;
pub mod process;
pub mod python;
pub mod replicated;
mod servers;
pub mod tansu;

pub use api::{metric_sum, until_query_is, Api, Reply};
pub use devstack::mariadb::MariaDb;
pub use env::{Kafka, RowLocation, TestEnv, STANDARD_INDEXES};
pub use poll::eventually;
pub use process::{bagstore_bin, command, std_command, Proc};
