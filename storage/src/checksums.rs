//! Per-logical-shard checksums: how a move's verify compares its source
//! and its target without carrying their rows over the network.
//!
//! For each logical shard the server counts the rows and XORs a 64-bit
//! digest of each: the first 16 hex digits of an MD5 of the columns a move
//! must carry over. The digest must not be linear: with CRCs, the same
//! change made to two rows of equal length cancels out in the XOR (a test
//! shows it), so CRCs serve only to shorten a body before the MD5.
//! Equal rows give equal checksums whatever their order and whatever their
//! `added_id` on each side; only a logical shard whose checksums differ is
//! then compared row by row.

use schemas::index::{IndexSpec, PropType};
use sqlx::{MySqlExecutor, Row};
use std::collections::BTreeMap;

use crate::error::{OnShard, Result};
use crate::rows::marks;

/// One logical shard's rows of one table, summed up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checksum {
    pub rows: u64,
    /// XOR of every row's digest.
    pub digest: u64,
}

/// Checksums by logical shard; a logical shard without rows is absent.
pub type Checksums = BTreeMap<u16, Checksum>;

/// An entity row's digest covers its id, version and body (a tombstone's
/// NULL body included). Inside the MD5 a body is its CRC-32C and CRC-32:
/// cheaper to hash than the body, and nonlinear once hashed.
const ENTITY_ROW: &str =
    "CONCAT_WS(',', HEX(id), version, IFNULL(CRC32C(body), '-'), IFNULL(CRC32(body), '-'))";

/// One row's 64-bit digest, as SQL over the row described by `row`.
fn digest_of(row: &str) -> String {
    format!("CAST(CONV(LEFT(MD5({row}), 16), 16, 10) AS UNSIGNED)")
}

/// An entity row's digest, as a SQL expression over `entities`' columns:
/// a query that reads rows anyway (a move's copy) selects it beside them,
/// and its [`Sums`] then equal what [`entities`] computes.
pub fn entity_digest() -> String {
    digest_of(ENTITY_ROW)
}

/// An index row's digest, as a SQL expression over `spec`'s table.
pub fn index_digest(spec: &IndexSpec) -> String {
    digest_of(&index_row(spec))
}

/// Checksums summed up from rows read elsewhere, each with its digest.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sums(pub Checksums);

impl Sums {
    /// Counts one row of `logical` with its digest.
    pub fn add(&mut self, logical: u16, digest: u64) {
        let c = self.0.entry(logical).or_insert(Checksum { rows: 0, digest: 0 });
        c.rows += 1;
        c.digest ^= digest;
    }
}

/// Checksums of the entity rows of `logicals`.
pub async fn entities(shard: usize, conn: impl MySqlExecutor<'_>, logicals: &[u16]) -> Result<Checksums> {
    checksums(shard, conn, "entities", ENTITY_ROW, logicals, "").await
}

/// Checksums of the live rows of an index table in `logicals`: each
/// row's key, entity and version (what a move compares row by row where
/// checksums differ).
pub async fn index_rows(
    shard: usize,
    conn: impl MySqlExecutor<'_>,
    spec: &IndexSpec,
    logicals: &[u16],
) -> Result<Checksums> {
    // Live rows only: a move carries no tombstones.
    let live = format!(" AND {}", crate::ddl::LIVE);
    checksums(shard, conn, &spec.table, &index_row(spec), logicals, &live).await
}

/// What an index row's digest covers: its key, entity and version.
fn index_row(spec: &IndexSpec) -> String {
    let mut cols: Vec<String> = spec
        .properties
        .iter()
        .map(|p| match p.ty {
            // Bytes as hex, so no value can contain the separator.
            PropType::Uuid | PropType::String => format!("HEX(`{}`)", p.name),
            // Numbers as the server prints them; MariaDB prints a DOUBLE in
            // the shortest form that reads back as the same value.
            PropType::Int | PropType::Float | PropType::Bool => format!("`{}`", p.name),
        })
        .collect();
    cols.push("HEX(entity_id)".into());
    cols.push("version".into());
    if spec.unique {
        // A reservation moves with its row (CONCAT_WS skips NULLs).
        cols.push("HEX(token)".into());
        cols.push("reserved_until_us".into());
    }
    format!("CONCAT_WS(',', {})", cols.join(", "))
}

async fn checksums(
    shard: usize,
    conn: impl MySqlExecutor<'_>,
    table: &str,
    row: &str,
    logicals: &[u16],
    and_where: &str,
) -> Result<Checksums> {
    if logicals.is_empty() {
        return Ok(Checksums::new());
    }
    let sql = format!(
        "SELECT logical, COUNT(*) AS n, BIT_XOR({}) AS digest \
         FROM `{table}` WHERE logical IN ({}){and_where} GROUP BY logical",
        digest_of(row),
        marks(logicals.len())
    );
    let mut q = sqlx::query(&sql);
    for k in logicals {
        q = q.bind(*k);
    }
    let rows = q.fetch_all(conn).await.on(shard)?;
    let mut out = Checksums::new();
    for r in rows {
        let logical: u16 = r.try_get("logical").on(shard)?;
        let n: i64 = r.try_get("n").on(shard)?;
        let digest: u64 = r.try_get("digest").on(shard)?;
        out.insert(logical, Checksum { rows: n as u64, digest });
    }
    Ok(out)
}

/// The logical shards whose checksums differ between two sides.
pub fn differing(a: &Checksums, b: &Checksums) -> Vec<u16> {
    let mut out: Vec<u16> = a.iter().filter(|(k, c)| b.get(k) != Some(c)).map(|(k, _)| *k).collect();
    out.extend(b.keys().filter(|k| !a.contains_key(k)));
    out.sort_unstable();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_logical_shard_differs_when_its_count_or_digest_differs_or_one_side_lacks_it() {
        let c = |rows, digest| Checksum { rows, digest };
        let a = Checksums::from([(1, c(2, 7)), (2, c(1, 5)), (3, c(4, 4)), (4, c(1, 1))]);
        let b = Checksums::from([(1, c(2, 7)), (2, c(1, 6)), (3, c(3, 4)), (5, c(1, 1))]);
        assert_eq!(differing(&a, &b), vec![2, 3, 4, 5]);
        assert_eq!(differing(&a, &a), Vec::<u16>::new());
    }
}
