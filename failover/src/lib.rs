//! bagstore's replicated shards: each physical shard is a MariaDB primary
//! and its replicas (semi-synchronous, GTID; see `storage::replication`
//! for what each server needs and why).
//!
//! - [`switchover`]: a planned change of primary, both servers up
//!   (`bagstore shards switchover`).
//! - [`promote`]: a dead primary replaced by its most advanced replica,
//!   with no acknowledged write lost (`bagstore shards failover`, and the
//!   coordinator).
//! - [`rejoin`]: a server listed as a replica taken back once it answers
//!   (never one holding a transaction the primary lacks).
//! - [`settle`]: a primary restarted read-only before its failover was
//!   due, opened again or replaced.
//! - [`watch`]: the coordinator every cleaner runs (`mysql.failover =
//!   "auto"`), its election, and when it acts.
//! - [`servers`]: reaching a shard's servers as the admin account.
//! - [`metrics`]: what the coordinator exports.
//!
//! A change of primary raises the new primary's shard epoch and the map's
//! `failovers` count of the shard (`storage::topology::switch_primary`).
//! A move's cutover flips the map only if neither its source's nor its
//! target's count changed since it began (`storage::moves::flip`), else it
//! is recovered on the new primaries: failovers and cutovers never
//! interleave.

pub mod metrics;
pub mod promote;
pub mod rejoin;
pub mod servers;
pub mod settle;
pub mod switchover;
pub mod watch;

pub use metrics::FailoverMetrics;
