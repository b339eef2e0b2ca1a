//! Identifiers that end up in SQL text. Table and column names cannot be
//! bound parameters, so they come only from validated configuration: this
//! check is what keeps SQL injection out of the DDL and the index statements.

/// The names of the tables storage creates besides index tables (its
/// `ddl` builds them from these, and a test there checks the list is
/// complete).
pub mod tables {
    /// One row per entity id, on every shard.
    pub const ENTITIES: &str = "entities";
    /// Change events waiting for Kafka, on every shard.
    pub const OUTBOX: &str = "outbox";
    /// Index definitions and states, on the metadata shard.
    pub const INDEX_CATALOG: &str = "bagstore_indexes";
    /// Per index, the newest commit applied, on the metadata shard.
    pub const INDEX_PROGRESS: &str = "bagstore_index_progress";
    /// Who a physical shard is, on every shard.
    pub const SHARD: &str = "bagstore_shard";
    /// The logical shards a physical shard owns, on every shard.
    pub const OWNED: &str = "bagstore_owned";
    /// The logical shards a move is taking from this shard, on every shard.
    pub const MOVING: &str = "bagstore_moving";
    /// Changes to moving logical shards, for the move's catch-up, on every shard.
    pub const JOURNAL: &str = "bagstore_journal";
    /// The logical shards a move is copying to this shard, and which run of
    /// the mover may write them, on every shard.
    pub const INCOMING: &str = "bagstore_incoming";
    /// The cluster's number of logical shards and map epoch (metadata shard).
    pub const CLUSTER: &str = "bagstore_cluster";
    /// The physical shards (metadata shard).
    pub const PHYSICAL: &str = "bagstore_physical";
    /// Logical → physical (metadata shard).
    pub const MAP: &str = "bagstore_map";
    /// Moves in flight (metadata shard).
    pub const MOVES: &str = "bagstore_moves";
    /// The processes and the map epoch each routes with (metadata shard).
    pub const PROCESSES: &str = "bagstore_processes";
    /// The replicas of each physical shard (metadata shard); a shard's
    /// primary is its `bagstore_physical` address.
    pub const REPLICAS: &str = "bagstore_replicas";
    /// `Idempotency-Key`s and the answers they were given, on every shard.
    pub const IDEMPOTENCY: &str = "bagstore_idempotency";
    /// Per consumer group and partition, the newest claim's generation, on
    /// every shard: an index write of an older claim is refused there.
    pub const PARTITION_FENCES: &str = "bagstore_partition_fences";
    /// Each unique-key reservation token a write claimed in its entity
    /// transaction, or that a contender revoked (`storage::unique`).
    pub const UNIQUE_CLAIMS: &str = "bagstore_unique_claims";
    /// Change stream snapshots: per consumer group, where the scan stands
    /// (metadata shard).
    pub const SNAPSHOTS: &str = "bagstore_snapshots";
    /// Which indexer consumer last took each partition of each consumer
    /// group (metadata shard): the indexers' own fence.
    pub const PARTITION_CLAIMS: &str = "bagstore_partition_claims";
    /// The consumers (indexers, the writers' ingest) that assign partitions
    /// among themselves: per consumer group, each member's lease (metadata
    /// shard).
    pub const GROUP_MEMBERS: &str = "bagstore_group_members";
}

/// Tables bagstore owns; an index may not take these names.
pub const RESERVED_TABLES: &[&str] = &[
    tables::ENTITIES,
    tables::OUTBOX,
    tables::SHARD,
    tables::OWNED,
    tables::MOVING,
    tables::JOURNAL,
    tables::INCOMING,
    tables::IDEMPOTENCY,
    tables::PARTITION_FENCES,
    tables::UNIQUE_CLAIMS,
    tables::INDEX_CATALOG,
    tables::INDEX_PROGRESS,
    tables::CLUSTER,
    tables::PHYSICAL,
    tables::REPLICAS,
    tables::MAP,
    tables::MOVES,
    tables::PROCESSES,
    tables::PARTITION_CLAIMS,
    tables::GROUP_MEMBERS,
    tables::SNAPSHOTS,
];
/// Columns every index table has besides its property columns; a property
/// may not take these names.
pub const RESERVED_COLUMNS: &[&str] =
    &["entity_id", "version", "entity_added_id", "logical", "removed_us", "token", "reserved_until_us"];

/// `[a-z][a-z0-9_]{0,63}`: at most 64 characters, MySQL's identifier limit.
pub fn is_valid_identifier(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 64
        && b[0].is_ascii_lowercase()
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_follow_the_documented_pattern() {
        assert!(is_valid_identifier("index_user_id"));
        assert!(is_valid_identifier(&"a".repeat(64)));
        for bad in ["", "Index", "1abc", "a-b", "a b", "a`b", "a;drop", &"a".repeat(65)] {
            assert!(!is_valid_identifier(bad), "{bad:?} accepted");
        }
    }
}
