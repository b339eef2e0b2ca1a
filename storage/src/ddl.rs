//! DDL for every table bagstore owns. Identifiers come only from validated
//! [`IndexSpec`]s (see [`schemas::names`]), so building SQL text here is safe.

use schemas::index::{IndexSpec, PropType};
use schemas::names::tables;

/// One row per entity id. `added_id` is the clustered key so inserts append
/// (write locality, as in FriendFeed's design); lookups go through the
/// unique `id`. A delete keeps the row as a tombstone (`body` NULL) so the
/// version keeps rising across delete and re-create: that monotonic version
/// is what makes replayed change events harmless in the index tables.
/// `logical` (the id's logical shard) leads a key, so a move finds a
/// logical shard's rows in clustered-key order without a full scan.
/// `expires_us` is the entity's expiry time (µs since the Unix epoch) when
/// expiry is on and the bag has one (see `schemas::expiry`): the cleaner
/// finds expired entities along its key.
pub fn entities() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{}` (
    added_id BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
    id BINARY(16) NOT NULL,
    {LOGICAL_COLUMN},
    version BIGINT UNSIGNED NOT NULL,
    updated TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    body MEDIUMBLOB NULL,
    {EXPIRES_COLUMN},
    PRIMARY KEY (added_id),
    UNIQUE KEY entities_id (id),
    KEY entities_updated (updated),
    KEY entities_logical (logical, added_id),
    KEY entities_expires (expires_us)
) ENGINE=InnoDB",
        tables::ENTITIES
    )
}

/// Change events committed with their write and not yet acknowledged by Kafka.
pub fn outbox() -> String {
    outbox_columns(tables::OUTBOX, "InnoDB")
}

fn outbox_columns(table: &str, engine: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{table}` (
    seq BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
    entity_id BINARY(16) NOT NULL,
    version BIGINT UNSIGNED NOT NULL,
    committed TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    event MEDIUMBLOB NOT NULL,
    PRIMARY KEY (seq)
) ENGINE={engine}"
    )
}

/// The index catalog (definition, state, backfill progress), kept on the
/// metadata shard only: the one well-known place.
pub fn index_catalog() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{}` (
    name VARCHAR(64) NOT NULL,
    spec TEXT NOT NULL,
    state VARCHAR(16) NOT NULL,
    backfill_cursor TEXT NULL,
    rows_done BIGINT UNSIGNED NOT NULL DEFAULT 0,
    rows_total BIGINT UNSIGNED NOT NULL DEFAULT 0,
    {CONFLICTS_COLUMN},
    created TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    changed TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (name)
) ENGINE=InnoDB",
        tables::INDEX_CATALOG
    )
}

/// Per index, the commit time of the newest event its indexers applied
/// (metadata shard): the reader's index freshness.
pub fn index_progress() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{}` (
    name VARCHAR(64) NOT NULL,
    last_applied_commit_us BIGINT NOT NULL,
    changed TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (name)
) ENGINE=InnoDB",
        tables::INDEX_PROGRESS
    )
}

pub fn column_type(ty: PropType, max_len: u32) -> String {
    match ty {
        PropType::Uuid => "BINARY(16)".into(),
        // Bytes, not a collation: exact equality and byte order, like Rust strings.
        PropType::String => format!("VARBINARY({})", 4 * max_len),
        PropType::Int => "BIGINT".into(),
        PropType::Float => "DOUBLE".into(),
        PropType::Bool => "BOOLEAN".into(),
    }
}

/// `(p1, p2, …, entity_id)` is the primary key, so equal keys are ordered by
/// entity id and a lookup is one range scan; `entity_id` has its own key for
/// the cleaner's "which rows does this entity have" question.
/// `entity_added_id` is where the entity's row is on its shard (its
/// clustered key), so a query reads it with one B-tree descent instead of
/// two; NULL where unknown (rows written before the column existed).
/// `logical` is the row's logical shard (of its `shard_on` value), keyed so
/// a move finds a logical shard's rows.
///
/// A unique index's table has the same columns and keys, so queries, moves
/// and checksums read it as any other, and three more: the key alone is a
/// unique key (one row per key: its holder), `token` is the reservation
/// of a write that may still commit (NULL once confirmed) and
/// `reserved_until_us` when that reservation may be taken over (see
/// `crate::unique`). Its rows are never tombstones: a freed key's row is
/// deleted.
pub fn index_table(spec: &IndexSpec) -> String {
    let mut cols = String::new();
    for p in &spec.properties {
        cols.push_str(&format!("    `{}` {} NOT NULL,\n", p.name, column_type(p.ty, p.string_len())));
    }
    let key: Vec<String> = spec.properties.iter().map(|p| format!("`{}`", p.name)).collect();
    let table = &spec.table;
    let key = key.join(", ");
    let unique = match spec.unique {
        true => format!(
            "    {TOKEN_COLUMN},\n    {RESERVED_UNTIL_COLUMN},\n    UNIQUE KEY `{table}_unique` ({key}),\n    \
             KEY `{table}_reserved` (reserved_until_us),\n"
        ),
        false => String::new(),
    };
    format!(
        "CREATE TABLE IF NOT EXISTS `{table}` (\n{cols}    entity_id BINARY(16) NOT NULL,\n    \
         version BIGINT UNSIGNED NOT NULL,\n    {LOCATION_COLUMN},\n    {LOGICAL_COLUMN},\n    \
         {REMOVED_COLUMN},\n{unique}    \
         PRIMARY KEY ({key}, entity_id),\n    KEY `{table}_entity` (entity_id),\n    \
         KEY `{table}_logical` (logical)\n) ENGINE=InnoDB",
    )
}

/// A unique key row's reservation: the token of the write that reserved
/// it, NULL once that write is confirmed (see `crate::unique`).
pub const TOKEN_COLUMN: &str = "token BINARY(16) NULL";

/// Until when a reserved (unconfirmed) unique key row is its writer's
/// alone, µs since the Unix epoch; NULL once confirmed.
pub const RESERVED_UNTIL_COLUMN: &str = "reserved_until_us BIGINT NULL";

/// A CONFLICTED unique index's clashes (JSON: up to 100 `{"key": […],
/// "ids": […]}`), NULL otherwise. `migrate` adds it to older catalogs.
pub const CONFLICTS_COLUMN: &str = "conflicts TEXT NULL";

/// The expiry column of `entities` (NULL: never expires).
pub const EXPIRES_COLUMN: &str = "expires_us BIGINT NULL";

/// An idempotency record's refusal: what a guarded write that the write
/// path refused answered (JSON, the writer's), NULL when it wrote. Added
/// to tables made before refusals were recorded.
pub const REFUSAL_COLUMN: &str = "refusal TEXT NULL";

/// The version floor of a logical shard (on its `bagstore_owned` row):
/// every version a purged tombstone had is at or below it, so an id
/// created from nothing starts above it.
pub const FLOOR_COLUMN: &str = "version_floor BIGINT UNSIGNED NOT NULL DEFAULT 0";

/// Where an index row's entity is (its `added_id`; NULL: unknown). The
/// column an index table gained after its first release: `migrate` adds
/// it to older tables.
pub const LOCATION_COLUMN: &str = "entity_added_id BIGINT UNSIGNED NULL";

/// When an index row was removed: the row stays as a tombstone, so an
/// older event arriving later cannot write its key back; NULL: a live row
/// ([`LIVE`]). `migrate` adds it to older tables.
pub const REMOVED_COLUMN: &str = "removed_us BIGINT NULL";

/// The condition a live index row meets (not a tombstone, see
/// [`REMOVED_COLUMN`]): every read of live rows adds it.
pub const LIVE: &str = "removed_us IS NULL";

/// The logical-shard column of entities and index rows. Tables made before
/// it existed get it from `migrate` with the placeholder default
/// [`LOGICAL_UNKNOWN`], and their rows are filled in.
pub const LOGICAL_COLUMN: &str = "logical SMALLINT UNSIGNED NOT NULL";

/// What a row made before logical shards says until `migrate` fills it in:
/// no cluster has this many logical shards.
pub const LOGICAL_UNKNOWN: u16 = u16::MAX;

/// Who a physical shard is: its name, its physical id, and the epoch of the
/// last move to or from it (one row).
pub fn shard_identity() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{}` (
    id TINYINT UNSIGNED NOT NULL,
    name VARCHAR(64) NOT NULL,
    physical INT UNSIGNED NOT NULL,
    epoch BIGINT UNSIGNED NOT NULL,
    PRIMARY KEY (id)
) ENGINE=InnoDB",
        tables::SHARD
    )
}

/// The logical shards this physical shard owns: what a write locks shared
/// and a cutover (or a tombstone purge) exclusively. `version_floor`: see
/// [`FLOOR_COLUMN`].
pub fn owned() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{}` (
    logical SMALLINT UNSIGNED NOT NULL,
    {FLOOR_COLUMN},
    PRIMARY KEY (logical)
) ENGINE=InnoDB",
        tables::OWNED
    )
}

/// The condition every removal of a moved-away copy adds (`logical` of the
/// rows deleted): rows of a logical shard this shard owns are never such a
/// copy. A cleanup run by a mover that lost its move can come late, after
/// the logical shards came back to its source; its deletes then leave the
/// owner's rows alone. (A rollback revokes the target's grant first.)
pub const NOT_OWNED: &str = "logical NOT IN (SELECT logical FROM bagstore_owned)";

/// The logical shards a move is taking from this shard, each with the move
/// that journals it (see [`MOVE_ID_COLUMN`]): the journal triggers record
/// changes to these (see [`crate::journal`]).
pub fn moving() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{}` (
    logical SMALLINT UNSIGNED NOT NULL,
    {MOVE_ID_COLUMN},
    PRIMARY KEY (logical)
) ENGINE=InnoDB",
        tables::MOVING
    )
}

/// The move (its id on the metadata shard) whose journal lists a logical
/// shard in `bagstore_moving`: a move stops its own journal only, never
/// the one of the move after it. 0 on rows from before the column existed
/// (added to older tables when `bagstore migrate` runs).
pub const MOVE_ID_COLUMN: &str = "move_id BIGINT UNSIGNED NOT NULL DEFAULT 0";

/// Changes to moving logical shards, written by the journal triggers in the
/// changing transaction: which entity's rows of which table to copy again.
pub fn journal() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{}` (
    seq BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
    logical SMALLINT UNSIGNED NOT NULL,
    tbl VARCHAR(64) NOT NULL,
    entity_id BINARY(16) NOT NULL,
    PRIMARY KEY (seq)
) ENGINE=InnoDB",
        tables::JOURNAL
    )
}

/// The logical shards a move is copying to this shard, with the token of
/// the mover run that may write them: every copy transaction checks its
/// token, and a run taking the move over (or the cutover granting
/// ownership) replaces or removes the rows, so a mover that lost the move
/// (frozen, partitioned) can no longer write.
pub fn incoming() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{}` (
    logical SMALLINT UNSIGNED NOT NULL,
    token BIGINT UNSIGNED NOT NULL,
    PRIMARY KEY (logical)
) ENGINE=InnoDB",
        tables::INCOMING
    )
}

/// The cluster (metadata shard, one row): its number of logical shards and
/// the map's epoch.
pub fn cluster() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{}` (
    id TINYINT UNSIGNED NOT NULL,
    logical_shards SMALLINT UNSIGNED NOT NULL,
    epoch BIGINT UNSIGNED NOT NULL,
    PRIMARY KEY (id)
) ENGINE=InnoDB",
        tables::CLUSTER
    )
}

/// The physical shards (metadata shard): stable id and name, the address
/// (a DSN without its password), the epoch of the last move touching it.
pub fn physical() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{}` (
    id INT UNSIGNED NOT NULL,
    name VARCHAR(64) NOT NULL,
    address TEXT NOT NULL,
    epoch BIGINT UNSIGNED NOT NULL,
    {FAILOVERS_COLUMN},
    PRIMARY KEY (id),
    UNIQUE KEY bagstore_physical_name (name)
) ENGINE=InnoDB",
        tables::PHYSICAL
    )
}

/// The replicas of each physical shard (metadata shard): what a process
/// reads from and fails over to. A shard's primary is its address in
/// `bagstore_physical`.
pub fn replicas() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{}` (
    physical INT UNSIGNED NOT NULL,
    address VARCHAR(1024) CHARACTER SET ascii NOT NULL,
    added TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (physical, address)
) ENGINE=InnoDB",
        tables::REPLICAS
    )
}

/// `bagstore_physical.failovers`: how many times a shard's primary changed
/// (see `schemas::topology::PhysicalShard::failovers`); 0 for shards
/// registered before failover existed.
pub const FAILOVERS_COLUMN: &str = "failovers BIGINT UNSIGNED NOT NULL DEFAULT 0";

/// The map (metadata shard): logical shard → physical shard.
pub fn map() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{}` (
    logical SMALLINT UNSIGNED NOT NULL,
    physical INT UNSIGNED NOT NULL,
    PRIMARY KEY (logical)
) ENGINE=InnoDB",
        tables::MAP
    )
}

/// Moves in flight (metadata shard): what, from where to where, how far.
pub fn moves() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{}` (
    id BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
    logicals TEXT NOT NULL,
    source INT UNSIGNED NOT NULL,
    target INT UNSIGNED NOT NULL,
    phase VARCHAR(16) NOT NULL,
    done_logicals TEXT NOT NULL,
    rows_copied BIGINT UNSIGNED NOT NULL DEFAULT 0,
    started TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    changed TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (id)
) ENGINE=InnoDB",
        tables::MOVES
    )
}

/// The processes of the cluster (metadata shard) and the map epoch each
/// routes with: a move removes its source's copy only once every live
/// process is past the cutover.
pub fn processes() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{}` (
    id VARCHAR(64) NOT NULL,
    role VARCHAR(32) NOT NULL,
    epoch BIGINT UNSIGNED NOT NULL,
    seen TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (id)
) ENGINE=InnoDB",
        tables::PROCESSES
    )
}

/// What every physical shard has.
pub fn shard_tables() -> [String; 10] {
    [
        entities(),
        outbox(),
        shard_identity(),
        owned(),
        moving(),
        journal(),
        incoming(),
        idempotency(),
        partition_fences(),
        unique_claims(),
    ]
}

/// Per reservation token of a unique key (see `crate::unique`), on the
/// shard of the entity that reserved it: `claimed` when the entity's
/// write transaction committed under it, not `claimed` when a contender
/// revoked it first. The token is the primary key, so the two race on one
/// row and exactly one wins: a revoked token's write can never commit.
pub fn unique_claims() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{}` (
    token BINARY(16) NOT NULL,
    claimed BOOLEAN NOT NULL,
    recorded_us BIGINT NOT NULL,
    PRIMARY KEY (token),
    KEY unique_claims_recorded (recorded_us)
) ENGINE=InnoDB",
        tables::UNIQUE_CLAIMS
    )
}

/// Each `Idempotency-Key` a write carried (hashed), on the shard of the
/// entity it guarded, written in that write's transaction: the hash of
/// the request and the answer it got, so a retry gets the same answer and
/// writes nothing. Rows older than `writer.idempotency_window_secs` are
/// ignored and purged by the cleaner.
pub fn idempotency() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{}` (
    key_hash BINARY(16) NOT NULL,
    {LOGICAL_COLUMN},
    request_hash BINARY(16) NOT NULL,
    entity_id BINARY(16) NOT NULL,
    version BIGINT UNSIGNED NOT NULL,
    created BOOLEAN NOT NULL,
    {REFUSAL_COLUMN},
    recorded_us BIGINT NOT NULL,
    PRIMARY KEY (key_hash),
    KEY idempotency_recorded (recorded_us),
    KEY idempotency_logical (logical, recorded_us)
) ENGINE=InnoDB",
        tables::IDEMPOTENCY
    )
}

/// What only the metadata shard has.
pub fn meta_tables() -> [String; 11] {
    [
        index_catalog(),
        index_progress(),
        cluster(),
        physical(),
        replicas(),
        map(),
        moves(),
        processes(),
        partition_claims(),
        group_members(),
        snapshots(),
    ]
}

/// Per consumer group, a change stream snapshot (`bagstore changes
/// snapshot`, see `storage::snapshots`): the map epoch its scan runs
/// under, how far it has read each physical shard (JSON: shard id to the
/// last `added_id` emitted), and when it finished.
pub fn snapshots() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{}` (
    grp VARCHAR(255) NOT NULL,
    topic VARCHAR(255) NOT NULL,
    epoch BIGINT UNSIGNED NOT NULL,
    cursors TEXT NOT NULL,
    rows_emitted BIGINT UNSIGNED NOT NULL DEFAULT 0,
    started TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    finished TIMESTAMP(6) NULL,
    PRIMARY KEY (grp)
) ENGINE=InnoDB",
        tables::SNAPSHOTS
    )
}

/// Per consumer group and partition, the consumer (an indexer, or a
/// writer's Kafka ingest) that was last assigned it (see
/// `service::claims`) and the claim's generation (one more than the
/// claim before): a consumer that finds its partition claimed by another
/// since has lost it, whatever the broker told it.
pub fn partition_claims() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{}` (
    grp VARCHAR(255) NOT NULL,
    part INT NOT NULL,
    consumer BINARY(16) NOT NULL,
    claimed TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    {CLAIM_GEN_COLUMN},
    PRIMARY KEY (grp, part)
) ENGINE=InnoDB",
        tables::PARTITION_CLAIMS
    )
}

/// Per consumer group, the indexers that assign its partitions among
/// themselves (see `storage::leases`): each member's stable name, the
/// process now holding the name (its incarnation) and until when its lease
/// runs.
pub fn group_members() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{}` (
    grp VARCHAR(255) NOT NULL,
    member VARCHAR(255) NOT NULL,
    incarnation BINARY(16) NOT NULL,
    expires TIMESTAMP(6) NOT NULL,
    PRIMARY KEY (grp, member)
) ENGINE=InnoDB",
        tables::GROUP_MEMBERS
    )
}

/// A partition claim's generation (0 for a claim made before generations).
pub const CLAIM_GEN_COLUMN: &str = "gen BIGINT UNSIGNED NOT NULL DEFAULT 0";

/// On every shard, per consumer group and partition, the newest claim
/// generation seen there (see [`crate::fences`]).
pub fn partition_fences() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{}` (
    grp VARCHAR(255) NOT NULL,
    part INT NOT NULL,
    {CLAIM_GEN_COLUMN},
    PRIMARY KEY (grp, part)
) ENGINE=InnoDB",
        tables::PARTITION_FENCES
    )
}

/// Every table storage may create besides index tables: the shards', then
/// the metadata shard's.
pub fn base_tables() -> Vec<String> {
    shard_tables().into_iter().chain(meta_tables()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_ddl_names_typed_columns_and_the_keys() {
        let spec: IndexSpec = toml::from_str(
            r#"table = "index_user_name"
               properties = [{ name = "first_name", type = "string", max_len = 10 }, { name = "age", type = "int" }]"#,
        )
        .unwrap();
        let ddl = index_table(&spec);
        assert!(ddl.contains("`first_name` VARBINARY(40) NOT NULL"), "{ddl}");
        assert!(ddl.contains("`age` BIGINT NOT NULL"));
        assert!(ddl.contains("PRIMARY KEY (`first_name`, `age`, entity_id)"));
        assert!(ddl.contains("KEY `index_user_name_entity` (entity_id)"));
        assert!(ddl.contains("entity_added_id BIGINT UNSIGNED NULL,"), "{ddl}");
    }

    /// An index may not take a table or column name storage uses: the
    /// reserved lists that validation checks are what the DDL creates.
    #[test]
    fn reserved_names_are_exactly_what_storage_creates() {
        let created: Vec<String> = base_tables()
            .iter()
            .map(|ddl| ddl.split('`').nth(1).expect("a quoted name").to_string())
            .collect();
        assert_eq!(created, schemas::names::RESERVED_TABLES);
        // A unique index's table: every column an index table may have.
        let spec: IndexSpec = toml::from_str(
            r#"table = "t"
               properties = [{ name = "p", type = "int" }]
               unique = true"#,
        )
        .unwrap();
        let fixed: Vec<String> = index_table(&spec)
            .lines()
            .map(str::trim)
            .filter(|l| !l.starts_with(['`', ')']) && !l.starts_with("CREATE") && !l.contains("KEY"))
            .filter_map(|l| l.split_whitespace().next().map(str::to_string))
            .collect();
        assert_eq!(fixed, schemas::names::RESERVED_COLUMNS);
    }
}
