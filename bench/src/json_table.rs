//! The JSON table a user would make instead of bagstore (the native
//! contender of `bench` and `bench_replicas`): one table with a JSON
//! column, virtual generated columns for the indexed properties and a
//! secondary index on them, the index the benchmarks declare in bagstore
//! (`index_user_published`: a user's posts by time).

/// The table, in a contender database of each shard's server.
pub const DDL: &str = "CREATE TABLE IF NOT EXISTS docs (
    added_id BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
    id BINARY(16) NOT NULL,
    doc JSON NOT NULL,
    user_id VARCHAR(32) AS (JSON_VALUE(doc, '$.user_id')) VIRTUAL,
    published BIGINT AS (JSON_VALUE(doc, '$.published')) VIRTUAL,
    PRIMARY KEY (added_id),
    UNIQUE KEY docs_id (id),
    KEY docs_user_published (user_id, published)
) ENGINE=InnoDB";

/// A multi-row insert: this, then one [`ROW`] per document.
pub const INSERT_HEAD: &str = "INSERT INTO docs (id, doc) VALUES";

/// One document of an insert: its id (16 bytes), its JSON text.
pub const ROW: &str = "(?, ?)";
