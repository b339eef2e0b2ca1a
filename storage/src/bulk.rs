//! Bulk loads of a new index's rows (`cleaner.backfill_method = "bulk"`).
//!
//! The backfill computes every row where it runs, then on each shard:
//! 1. [`create`] makes `<table>__bulk`, an empty copy of the index table;
//! 2. [`load`] sorts the rows it is given by primary key and streams them
//!    into it with `LOAD DATA LOCAL INFILE` (no statement per row, and
//!    InnoDB's bulk path into an empty table);
//! 3. [`swap_in`] renames the live table to `<table>__live` and the loaded
//!    one to `<table>` in one atomic `RENAME TABLE`, then merges the rows
//!    the live indexer wrote before the swap into it, by version, the rule
//!    of [`crate::index_rows::upsert_index_rows`]: for each key the higher
//!    version wins, and a tombstone stays over an older row. The indexer's
//!    writes after the swap land in the loaded table directly. Then it
//!    drops `<table>__live`.
//!
//! A backfill stopped before the swap leaves `<table>__bulk`, which the
//! next one drops and loads again; stopped between the rename and the
//! drop, it leaves `<table>__live`, which [`finish_swap`] merges again
//! (the merge is idempotent).

use crate::index_rows::IndexRow;
use crate::{OnShard, Result, StoreError};
use futures::StreamExt;
use mysql_async::prelude::Queryable;
use schemas::index::IndexSpec;
use schemas::index::KeyValue;
use schemas::settings::Dsn;
use sqlx::MySqlPool;
use std::cmp::Ordering;
use std::fmt::Write;

/// The loaded copy of `table` before it is swapped in.
pub fn bulk_table(table: &str) -> String {
    format!("{table}__bulk")
}

/// The live table once the loaded one has taken its name, until merged.
pub fn live_table(table: &str) -> String {
    format!("{table}__live")
}

/// MariaDB's limit on a table name.
const NAME_MAX: usize = 64;

/// Whether `table`'s bulk and live copies have names MariaDB accepts.
pub fn names_fit(table: &str) -> bool {
    bulk_table(table).len().max(live_table(table).len()) <= NAME_MAX
}

async fn exists(shard: usize, pool: &MySqlPool, table: &str) -> Result<bool> {
    let n: (i64,) = sqlx::query_as(
        "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?",
    )
    .bind(table)
    .fetch_one(pool)
    .await
    .on(shard)?;
    Ok(n.0 > 0)
}

/// Completes a swap an earlier backfill began on this shard: merges
/// `<table>__live` into `<table>` and drops it. Returns whether there was one.
pub async fn finish_swap(shard: usize, pool: &MySqlPool, spec: &IndexSpec) -> Result<bool> {
    if !exists(shard, pool, &live_table(&spec.table)).await? {
        return Ok(false);
    }
    merge_live(shard, pool, spec).await?;
    Ok(true)
}

/// Makes `<table>__bulk` an empty copy of the index table (dropping what an
/// earlier, stopped backfill loaded into it).
pub async fn create(shard: usize, pool: &MySqlPool, table: &str) -> Result<()> {
    let bulk = bulk_table(table);
    sqlx::query(&format!("DROP TABLE IF EXISTS `{bulk}`")).execute(pool).await.on(shard)?;
    sqlx::query(&format!("CREATE TABLE `{bulk}` LIKE `{table}`")).execute(pool).await.on(shard)?;
    Ok(())
}

/// Drops `<table>__bulk` if it is there.
pub async fn drop_bulk(shard: usize, pool: &MySqlPool, table: &str) -> Result<()> {
    sqlx::query(&format!("DROP TABLE IF EXISTS `{}`", bulk_table(table))).execute(pool).await.on(shard)?;
    Ok(())
}

/// Byte order of the columns' MariaDB types: `BINARY`/`VARBINARY` compare
/// bytes, `BIGINT` and `DOUBLE` numbers, `BOOLEAN` 0 before 1.
fn key_order(a: &[KeyValue], b: &[KeyValue]) -> Ordering {
    for (x, y) in a.iter().zip(b) {
        let o = match (x, y) {
            (KeyValue::Uuid(x), KeyValue::Uuid(y)) => x.cmp(y),
            (KeyValue::Str(x), KeyValue::Str(y)) => x.as_bytes().cmp(y.as_bytes()),
            (KeyValue::Int(x), KeyValue::Int(y)) => x.cmp(y),
            (KeyValue::Float(x), KeyValue::Float(y)) => x.total_cmp(y),
            (KeyValue::Bool(x), KeyValue::Bool(y)) => x.cmp(y),
            _ => Ordering::Equal,
        };
        if o != Ordering::Equal {
            return o;
        }
    }
    Ordering::Equal
}

fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 0xf)] as char);
    }
}

/// One row as a tab-separated line: every key column, then the entity id,
/// version, location and logical shard. Bytes go as hex (`UNHEX` on the
/// server), so no value needs escaping.
fn push_line(out: &mut String, row: &IndexRow) {
    for v in &row.key {
        match v {
            KeyValue::Uuid(b) => push_hex(out, b),
            KeyValue::Str(s) => push_hex(out, s.as_bytes()),
            KeyValue::Int(i) => {
                let _ = write!(out, "{i}");
            }
            KeyValue::Float(f) => {
                let _ = write!(out, "{f:e}");
            }
            KeyValue::Bool(b) => out.push(if *b { '1' } else { '0' }),
        }
        out.push('\t');
    }
    push_hex(out, &row.entity.0);
    let _ = write!(out, "\t{}\t", row.version);
    match row.entity_added_id {
        Some(a) => {
            let _ = write!(out, "{a}");
        }
        None => out.push_str("\\N"),
    }
    let _ = writeln!(out, "\t{}", row.logical);
}

/// The `LOAD DATA` statement for `spec`'s columns into `table`.
fn load_statement(spec: &IndexSpec, table: &str) -> String {
    let vars: Vec<String> = (0..spec.properties.len()).map(|i| format!("@k{i}")).collect();
    let sets: Vec<String> = spec
        .properties
        .iter()
        .enumerate()
        .map(|(i, p)| match p.ty {
            schemas::index::PropType::Uuid | schemas::index::PropType::String => {
                format!("`{}` = UNHEX(@k{i})", p.name)
            }
            _ => format!("`{}` = @k{i}", p.name),
        })
        .collect();
    format!(
        "LOAD DATA LOCAL INFILE 'bagstore-backfill' IGNORE INTO TABLE `{table}` \
         FIELDS TERMINATED BY '\\t' ESCAPED BY '\\\\' LINES TERMINATED BY '\\n' \
         ({}, @entity, version, entity_added_id, logical) SET {}, entity_id = UNHEX(@entity)",
        vars.join(", "),
        sets.join(", ")
    )
}

/// Text handed to the server per chunk of the load's stream.
const CHUNK_BYTES: usize = 4 << 20;

/// Sorts `rows` by primary key, drops repeats, and loads them into
/// `<table>__bulk` on the server behind `dsn` in one `LOAD DATA LOCAL
/// INFILE`, with `unique_checks` and `foreign_key_checks` off (InnoDB's
/// bulk insert while the table is empty). Returns the rows loaded.
pub async fn load(shard: usize, dsn: &Dsn, spec: &IndexSpec, mut rows: Vec<IndexRow>) -> Result<u64> {
    if rows.is_empty() {
        return Ok(0);
    }
    rows.sort_by(|a, b| key_order(&a.key, &b.key).then_with(|| a.entity.0.cmp(&b.entity.0)));
    // An array property can give one entity the same key twice.
    rows.dedup_by(|a, b| a.entity == b.entity && key_order(&a.key, &b.key) == Ordering::Equal);
    let mut chunks = Vec::new();
    let mut text = String::with_capacity(CHUNK_BYTES + 1024);
    for row in &rows {
        push_line(&mut text, row);
        if text.len() >= CHUNK_BYTES {
            chunks.push(bytes::Bytes::from(std::mem::replace(
                &mut text,
                String::with_capacity(CHUNK_BYTES + 1024),
            )));
        }
    }
    chunks.push(bytes::Bytes::from(text));
    drop(rows);
    let bad = |what: &str, e: &dyn std::fmt::Display| StoreError::BulkLoad {
        shard,
        table: spec.table.clone(),
        what: format!("{what}: {e}"),
    };
    let opts = mysql_async::Opts::from_url(dsn.expose()).map_err(|e| bad("cannot use the DSN", &e))?;
    let mut conn = mysql_async::Conn::new(opts).await.map_err(|e| bad("cannot connect", &e))?;
    conn.query_drop("SET SESSION unique_checks = 0, foreign_key_checks = 0")
        .await
        .map_err(|e| bad("session settings", &e))?;
    conn.set_infile_handler(async move { Ok(futures::stream::iter(chunks.into_iter().map(Ok)).boxed()) });
    let statement = load_statement(spec, &bulk_table(&spec.table));
    conn.query_drop(statement).await.map_err(|e| bad("LOAD DATA LOCAL INFILE (is local_infile on?)", &e))?;
    let loaded = conn.affected_rows();
    let _ = conn.disconnect().await;
    Ok(loaded)
}

/// Puts the loaded table in the live one's place, then merges the rows the
/// live table had into it and drops them (see the module's words).
pub async fn swap_in(shard: usize, pool: &MySqlPool, spec: &IndexSpec) -> Result<()> {
    let (t, bulk, live) = (&spec.table, bulk_table(&spec.table), live_table(&spec.table));
    sqlx::query(&format!("RENAME TABLE `{t}` TO `{live}`, `{bulk}` TO `{t}`"))
        .execute(pool)
        .await
        .on(shard)?;
    merge_live(shard, pool, spec).await
}

/// `INSERT … SELECT` of `<table>__live` into `<table>` by version, then the
/// drop. A deadlock with the live indexer is retried (the merge is
/// idempotent).
async fn merge_live(shard: usize, pool: &MySqlPool, spec: &IndexSpec) -> Result<()> {
    let (t, live) = (&spec.table, live_table(&spec.table));
    let mut cols: Vec<String> = spec.properties.iter().map(|p| format!("`{}`", p.name)).collect();
    cols.extend(["entity_id", "version", "entity_added_id", "logical", "removed_us"].map(String::from));
    let cols = cols.join(", ");
    // Assignments run left to right and see the ones before them, so
    // `version` is raised last.
    // The target's columns are named with its table: the selected table
    // has the same names.
    let merge = format!(
        "INSERT INTO `{t}` ({cols}) SELECT {cols} FROM `{live}` ON DUPLICATE KEY UPDATE \
         `{t}`.removed_us = IF(VALUES(version) > `{t}`.version, VALUES(removed_us), `{t}`.removed_us), \
         `{t}`.entity_added_id = IF(VALUES(version) > `{t}`.version, \
         COALESCE(VALUES(entity_added_id), `{t}`.entity_added_id), \
         COALESCE(`{t}`.entity_added_id, VALUES(entity_added_id))), \
         `{t}`.version = GREATEST(`{t}`.version, VALUES(version))"
    );
    let mut attempt = 0u32;
    loop {
        match sqlx::query(&merge).execute(pool).await.on(shard) {
            Ok(_) => break,
            Err(e) if e.is_retryable_conflict() && attempt < 20 => {
                attempt += 1;
                tokio::time::sleep(std::time::Duration::from_millis(10 << attempt.min(6))).await;
            }
            Err(e) => return Err(e),
        }
    }
    sqlx::query(&format!("DROP TABLE `{live}`")).execute(pool).await.on(shard)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use schemas::index::{IndexProperty, PropType};

    #[test]
    fn keys_sort_as_the_columns_do() {
        use KeyValue::*;
        assert_eq!(key_order(&[Int(-5)], &[Int(3)]), Ordering::Less);
        assert_eq!(key_order(&[Float(-0.5)], &[Float(0.25)]), Ordering::Less);
        assert_eq!(key_order(&[Str("b".into())], &[Str("ab".into())]), Ordering::Greater);
        assert_eq!(key_order(&[Str("a".into()), Int(2)], &[Str("a".into()), Int(1)]), Ordering::Greater);
        assert_eq!(key_order(&[Bool(false)], &[Bool(true)]), Ordering::Less);
    }

    #[test]
    fn a_line_carries_bytes_as_hex_and_an_unknown_location_as_null() {
        let row = IndexRow {
            key: vec![KeyValue::Str("a\tb".into()), KeyValue::Int(-7), KeyValue::Float(1.5)],
            entity: schemas::EntityId([0xab; 16]),
            logical: 9,
            version: 3,
            entity_added_id: None,
        };
        let mut out = String::new();
        push_line(&mut out, &row);
        assert_eq!(out, format!("610962\t-7\t1.5e0\t{}\t3\t\\N\t9\n", "ab".repeat(16)));
        let spec = IndexSpec {
            table: "index_t".into(),
            properties: vec![
                IndexProperty { name: "s".into(), ty: PropType::String, max_len: None },
                IndexProperty { name: "n".into(), ty: PropType::Int, max_len: None },
            ],
            shard_on: None,
            match_on: Default::default(),
        };
        let sql = load_statement(&spec, "index_t__bulk");
        assert!(sql.contains("(@k0, @k1, @entity, version, entity_added_id, logical)"), "{sql}");
        assert!(sql.contains("`s` = UNHEX(@k0), `n` = @k1, entity_id = UNHEX(@entity)"), "{sql}");
    }

    /// The load's client has no TLS: a DSN asking for it is refused, not
    /// connected in plain text.
    #[test]
    fn a_dsn_with_tls_options_is_refused_by_the_loads_client() {
        assert!(mysql_async::Opts::from_url("mysql://u@127.0.0.1:3306/db").is_ok());
        for tls in ["ssl-mode=REQUIRED", "ssl-mode=VERIFY_CA&ssl-ca=/ca.pem"] {
            let url = format!("mysql://u@127.0.0.1:3306/db?{tls}");
            assert!(mysql_async::Opts::from_url(&url).is_err(), "{url}");
        }
    }

    #[test]
    fn the_copies_names_must_fit() {
        assert!(names_fit("index_user_id"));
        assert!(!names_fit(&format!("index_{}", "x".repeat(55))));
    }
}
