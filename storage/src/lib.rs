//! Every SQL statement bagstore runs, and the connections they run on.
//!
//! In: the model of `schemas` (ids, index specs and keys, settings). Out:
//! rows as named structs, and [`StoreError`]s that name their shard and say
//! whether running again may help. Nothing here knows about HTTP or Kafka.
//!
//! Layout, one module per aggregate:
//! - [`shards`]: a cluster's shards: pools, the metadata shard, fan-out.
//! - [`conns`]: ping-free connections for the hot paths.
//! - [`dsn`]: DSNs: addresses without passwords, credentials added back.
//! - [`error`]: `StoreError`, naming its shard and whether to retry.
//! - [`ddl`] and [`migrate`]: table definitions; creating what is missing.
//! - [`entities`]: the entity rows ([`EntityRecord`]): the writer's locking
//!   read and writes, reads by id and by location, the cleaner's sweeps.
//! - [`outbox`]: change events waiting for Kafka.
//! - [`purge`]: expired entities to delete; old tombstones purged under a
//!   version floor per logical shard.
//! - [`idempotency`]: `Idempotency-Key` records, written with the write they guard.
//! - [`index_rows`]: index rows: upserts, version-guarded deletes, repairs.
//! - [`index_scan`]: ordered, keyset-paged index scans for queries.
//! - [`catalog`]: index definitions, states and progress (metadata shard).
//! - [`fences`]: partition claims proven inside each index write.
//! - [`leases`]: indexers' member leases, when they assign partitions themselves.
//! - [`locks`]: named locks: one relay per shard, one backfiller per index.
//! - [`moves`]: moving logical shards: the move record, fence, flip.
//! - [`journal`]: what changed on a move's source while it copied.
//! - [`checksums`]: per-logical-shard digests a move's verify compares.
//! - [`carry`]: what a move carries besides rows: version floors,
//!   idempotency records, entities deleted on the source.
//! - [`snapshots`]: change stream snapshots: each group's scan.
//! - [`topology`]: the map in the database; the ownership a write proves,
//!   the epoch a read checks.
//! - [`server`]: statements about a server itself (private dev servers).
//! - [`replication`]: a server's role and position in MariaDB replication;
//!   what semi-sync needs of it; pointing, fencing and promoting servers.
//! - `rows`: statements over many rows (`VALUES` and `IN` lists), cut to
//!   fit; every module above builds its multi-row statements with it.
//! - [`stale`]: [`StaleMapRetry`], what every caller does when its map
//!   turned out stale.
//! - [`write`](mod@write): the write transaction (lock, decide, entity and outbox
//!   rows, commit), shared by the writer and the cleaner's expiry.
//!
//! Timestamps cross as integer microseconds since the Unix epoch; sqlx sets
//! each session's `time_zone` to UTC, so `TIMESTAMPADD` / `TIMESTAMPDIFF`
//! against the epoch are exact. Table and column names in SQL text come
//! only from validated specs (`schemas::names`); every value is bound.

pub mod acks;
pub mod carry;
pub mod catalog;
pub mod checksums;
pub mod conns;
pub mod ddl;
pub mod dsn;
pub mod entities;
pub mod error;
pub mod fences;
pub mod idempotency;
pub mod index_rows;
pub mod index_scan;
pub mod journal;
pub mod leases;
pub mod locks;
pub mod migrate;
pub mod moves;
pub mod outbox;
pub mod purge;
pub mod replication;
mod rows;
pub mod server;
pub mod shards;
pub mod snapshots;
pub mod stale;
pub mod topology;
pub mod unique;
pub mod write;

pub use catalog::IndexMeta;
pub use entities::{EntityRecord, EntityWrite};
pub use error::{OnShard, Result, StoreError};
pub use index_rows::IndexRow;
pub use shards::Shards;
pub use stale::StaleMapRetry;
pub use topology::META_SHARD;
