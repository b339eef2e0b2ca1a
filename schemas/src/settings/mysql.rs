//! The `[mysql]` section: the shards, their accounts, replication and
//! failover.

use serde::{Deserialize, Serialize};

use super::secrets::{list_or_csv, Dsn, Secret};

/// The MySQL (or MariaDB) shards, one database per physical shard. Which
/// logical shards each holds is the cluster's map, kept in the database.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MysqlSettings {
    /// One DSN per physical shard, in any order: each shard's database
    /// knows its own name, and the cluster's map (in the database, not here)
    /// says what it holds. A new cluster (`bagstore migrate`) names them
    /// `s0`, `s1`, … in this order. May be a TOML list or, from the
    /// environment, a comma-separated string.
    #[serde(deserialize_with = "list_or_csv")]
    pub shards: Vec<Dsn>,
    /// Logical shards of a new cluster (default 4096, see
    /// `schemas::shard::DEFAULT_LOGICAL_SHARDS`); for an existing one, if
    /// given, it must be the number the cluster was created with.
    pub logical_shards: Option<u16>,
    /// Pool size per shard and process; the hot-path connections (commits
    /// and the reader's statements, `storage::conns`) have their own cap of
    /// the same size.
    pub max_connections: u32,
    /// How long a starting process waits for the shards' databases to
    /// answer, and a statement for a free pooled connection.
    pub connect_timeout_ms: u64,
    /// How often a running process checks the map's epoch (and reloads it
    /// when it moved) and reports the epoch it routes with.
    pub map_refresh_ms: u64,
    /// The account `bagstore shards replicas` acts as on a shard's servers
    /// (sets `read_only`, points replicas at their primary, seeds them): it
    /// needs `READ_ONLY ADMIN` (or `SUPER`) and `REPLICATION SLAVE ADMIN`,
    /// which the services' own account must not hold. Empty: the account of
    /// the shard's DSN.
    pub admin_user: String,
    /// `admin_user`'s password.
    pub admin_password: Secret,
    /// The account replicas replicate as (`REPLICATION SLAVE` on every
    /// server of a replicated shard).
    pub replication_user: String,
    /// `replication_user`'s password.
    pub replication_password: Secret,
    /// Replicate asynchronously: a shard's primary acknowledges a write
    /// before any replica holds it, so a failover may lose it. Off (the
    /// default), a shard with replicas acknowledges a write only once a
    /// replica has it, and refuses writes (503) while none is connected.
    /// Read by `shards replicas add` (which then leaves the primary
    /// asynchronous) and by the writers.
    pub allow_async: bool,
    /// Who promotes a replica when a shard's primary stops answering:
    /// `"auto"`, the cleaners (one at a time, elected by a lock on another
    /// shard, see the failover crate's `watch` module), after `failover_after_ms`; or
    /// `"manual"`, the operator with `bagstore shards failover`.
    pub failover: FailoverMode,
    /// How long a primary must fail to answer before an automatic failover
    /// (its write unavailability is about this plus the promotion).
    pub failover_after_ms: u64,
}

/// Who fails a shard over when its primary dies (`mysql.failover`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FailoverMode {
    /// The cleaners, after `mysql.failover_after_ms`.
    #[default]
    Auto,
    /// The operator (`bagstore shards failover SHARD`).
    Manual,
}

impl Default for MysqlSettings {
    fn default() -> Self {
        MysqlSettings {
            shards: Vec::new(),
            logical_shards: None,
            max_connections: 16,
            connect_timeout_ms: 10_000,
            map_refresh_ms: 1000,
            admin_user: String::new(),
            admin_password: Secret(String::new()),
            replication_user: String::new(),
            replication_password: Secret(String::new()),
            allow_async: false,
            failover: FailoverMode::Auto,
            failover_after_ms: 3000,
        }
    }
}
