//! Development and test infrastructure, out of the production paths: what
//! `bagstore dev` and the test harness start on a developer's machine.
//! Nothing here installs anything (`scripts/lib.sh` is the one installer);
//! a missing program is a clear error naming the package.
//!
//! Layout:
//! - [`mariadb`]: private `mariadbd` servers (the shards).
//! - [`replication`]: private replicated shards: accounts, replicas.
//! - [`postgres`]: private PostgreSQL clusters (the kill tests' broker
//!   stores in one).
//! - [`supervise`]: the wrapper that ties a server's life to ours.
//! - [`kafka`]: the embedded Kafka (librdkafka's mock cluster).
//! - [`drain`]: waiting until the pipeline has nothing in flight.
//! - [`fds`]: children inherit stdio and no other descriptor of ours.

pub mod drain;
pub mod fds;
pub mod kafka;
pub mod mariadb;
pub mod postgres;
pub mod replication;
mod supervise;
