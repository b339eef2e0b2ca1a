//! Ordered, keyset-paged scans of one shard's index table for queries,
//! joined with the entities stored next to their rows.

use schemas::filter::KeyRange;
use schemas::index::{IndexKey, IndexSpec, KeyValue};
use schemas::EntityId;
use sqlx::mysql::MySqlArguments;
use sqlx::query::Query;
use sqlx::{MySql, Row};

use crate::entities::EntityRecord;
use crate::error::{id_column, OnShard, Result};
use crate::index_rows::row_key;
use crate::topology::SHARD_EPOCH;

#[derive(Debug, Clone)]
pub struct IndexScan<'a> {
    pub prefix: &'a [KeyValue],
    pub range: Option<&'a KeyRange>,
    /// Continue strictly after (before, when descending) this position:
    /// the values of the properties after the prefix, then the entity id.
    pub after: Option<(&'a [KeyValue], EntityId)>,
    pub descending: bool,
    pub limit: usize,
    /// Also read, in the same statement, each row's entity where it is
    /// stored on this shard (a join on the primary key): the reader then
    /// fetches only the entities that live on other shards.
    pub with_entities: bool,
}

/// One row of an index scan: its full key, its entity id, where the row
/// says its entity is, and (with [`IndexScan::with_entities`]) what this
/// shard holds there.
#[derive(Debug, Clone)]
pub struct ScannedRow {
    pub key: IndexKey,
    pub entity: EntityId,
    /// The row's logical shard: a reader drops rows of logical shards this
    /// physical shard does not own (a moved-away copy not yet removed).
    pub logical: u16,
    /// This shard's epoch, read in the same statement (see
    /// [`crate::topology::shard_epoch`]).
    pub shard_epoch: u64,
    /// The entity's `added_id` on its own shard, as the index row has it.
    pub entity_added_id: Option<u64>,
    pub local: Local,
}

/// The joined entity of a scanned index row.
#[derive(Debug, Clone)]
pub enum Local {
    /// The row's entity, stored on this shard at the row's location.
    Live(EntityRecord),
    /// The row's entity is a tombstone there: deleted.
    Deleted,
    /// Nothing of the entity's at that location here: it lives on another
    /// shard, the row's location is unknown or wrong, or the scan did not
    /// join. The caller fetches it by id.
    Unknown,
}

/// Rows of one shard's index table in index order: full keys and entity ids.
#[tracing::instrument(level = "debug", skip_all, fields(table = %spec.table, shard))]
pub async fn scan_index(
    shard: usize,
    pool: impl sqlx::MySqlExecutor<'_>,
    spec: &IndexSpec,
    scan: &IndexScan<'_>,
) -> Result<Vec<ScannedRow>> {
    let (sql, binds) = scan_sql(spec, scan);
    // Placeholders in SQL order: prefix, range bounds, the keyset terms
    // (whose very last placeholder is the entity id), then the limit.
    let mut q = sqlx::query(&sql);
    for v in &binds.keys {
        q = bind_one(q, v);
    }
    if let Some(id) = binds.after_id {
        q = q.bind(id);
    }
    let rows = q.bind(scan.limit as u64).fetch_all(pool).await.on(shard)?;
    let mut out = Vec::with_capacity(rows.len());
    for r in &rows {
        out.extend(scanned_row(shard, spec, scan.with_entities, r)?);
    }
    Ok(out)
}

/// The values a scan's statement binds before its limit, in SQL order.
#[derive(Debug)]
struct ScanBinds {
    /// Key values: the prefix, the range's bounds, the keyset terms'.
    keys: Vec<KeyValue>,
    /// The entity id the keyset terms end with (a scan that continues).
    after_id: Option<Vec<u8>>,
}

/// The statement of `scan` and the values it binds.
fn scan_sql(spec: &IndexSpec, scan: &IndexScan<'_>) -> (String, ScanBinds) {
    // Columns are qualified by the index table's alias, as the entities
    // table joined in may have columns of the same names.
    let cols: Vec<String> = spec.properties.iter().map(|p| format!("i.`{}`", p.name)).collect();
    let k = scan.prefix.len();
    let (wheres, binds) = scan_conditions(&cols, scan);
    let dir = if scan.descending { " DESC" } else { "" };
    let order: Vec<String> =
        cols[k..].iter().map(|c| format!("{c}{dir}")).chain([format!("i.entity_id{dir}")]).collect();
    // Entity columns get aliases no property name can take (names have no
    // dots). The join is on the entities table's clustered key, checked
    // against the id, so a wrong or unknown location joins nothing.
    let (entity_cols, join) = if scan.with_entities {
        (
            ", e.added_id AS `e.added_id`, e.logical AS `e.logical`, e.version AS `e.version`, \
             TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', e.updated) AS `e.updated_us`, e.body AS `e.body`, \
             e.expires_us AS `e.expires_us`",
            " LEFT JOIN entities AS e FORCE INDEX (PRIMARY) \
             ON e.added_id = i.entity_added_id AND e.id = i.entity_id",
        )
    } else {
        ("", "")
    };
    let sql = format!(
        "SELECT {}, i.entity_id, i.entity_added_id, i.logical, {SHARD_EPOCH} AS shard_epoch{entity_cols} \
         FROM `{}` AS i{join} WHERE {} ORDER BY {} LIMIT ?",
        cols.join(", "),
        spec.table,
        wheres.join(" AND "),
        order.join(", ")
    );
    (sql, binds)
}

/// The terms of a scan's `WHERE` over the index columns `cols` (qualified),
/// and the values they bind.
fn scan_conditions(cols: &[String], scan: &IndexScan<'_>) -> (Vec<String>, ScanBinds) {
    let k = scan.prefix.len();
    let mut wheres: Vec<String> = cols[..k].iter().map(|c| format!("{c} = ?")).collect();
    let mut binds = ScanBinds { keys: scan.prefix.to_vec(), after_id: None };
    if let Some(r) = scan.range {
        if let Some((v, inc)) = &r.lower {
            wheres.push(format!("{} {} ?", cols[k], if *inc { ">=" } else { ">" }));
            binds.keys.push(v.clone());
        }
        if let Some((v, inc)) = &r.upper {
            wheres.push(format!("{} {} ?", cols[k], if *inc { "<=" } else { "<" }));
            binds.keys.push(v.clone());
        }
    }
    if let Some((rest, id)) = &scan.after {
        // (r1, …, rm, entity_id) > (a1, …, am, id), spelled out so every
        // MySQL dialect can use the primary key for it.
        let op = if scan.descending { "<" } else { ">" };
        let rest_cols = &cols[k..];
        let mut ors = Vec::new();
        for i in 0..=rest.len() {
            let mut parts: Vec<String> = rest_cols[..i].iter().map(|c| format!("{c} = ?")).collect();
            binds.keys.extend(rest[..i].iter().cloned());
            if i < rest.len() {
                parts.push(format!("{} {op} ?", rest_cols[i]));
                binds.keys.push(rest[i].clone());
            } else {
                parts.push(format!("i.entity_id {op} ?"));
            }
            ors.push(format!("({})", parts.join(" AND ")));
        }
        wheres.push(format!("({})", ors.join(" OR ")));
        binds.after_id = Some(id.0.to_vec());
    }
    // Live rows only (a tombstone is a removed row).
    wheres.push(format!("i.{}", crate::ddl::LIVE));
    (wheres, binds)
}

/// One row of a scan; `None` for bytes no key of ours has (a hand-made
/// row). With `with_entities`, its joined entity.
fn scanned_row(
    shard: usize,
    spec: &IndexSpec,
    with_entities: bool,
    r: &sqlx::mysql::MySqlRow,
) -> Result<Option<ScannedRow>> {
    let Some(key) = row_key(shard, spec, r)? else { return Ok(None) };
    let id = id_column(shard, r, "entity_id")?;
    let joined: Option<u64> = match with_entities {
        true => r.try_get("e.added_id").on(shard)?,
        false => None,
    };
    let local = match joined {
        None => Local::Unknown,
        Some(added_id) => match r.try_get::<Option<Vec<u8>>, _>("e.body").on(shard)? {
            None => Local::Deleted,
            Some(body) => Local::Live(EntityRecord {
                id,
                logical: r.try_get("e.logical").on(shard)?,
                added_id,
                version: r.try_get("e.version").on(shard)?,
                updated_us: r.try_get("e.updated_us").on(shard)?,
                body: Some(body),
                expires_us: r.try_get("e.expires_us").on(shard)?,
            }),
        },
    };
    Ok(Some(ScannedRow {
        key,
        entity: id,
        entity_added_id: r.try_get("entity_added_id").on(shard)?,
        logical: r.try_get("logical").on(shard)?,
        shard_epoch: r.try_get("shard_epoch").on(shard)?,
        local,
    }))
}

fn bind_one<'q>(q: Query<'q, MySql, MySqlArguments>, v: &KeyValue) -> Query<'q, MySql, MySqlArguments> {
    match v {
        KeyValue::Uuid(b) => q.bind(b.to_vec()),
        KeyValue::Str(s) => q.bind(s.as_bytes().to_vec()),
        KeyValue::Int(i) => q.bind(*i),
        KeyValue::Float(f) => q.bind(*f),
        KeyValue::Bool(b) => q.bind(*b),
    }
}
