//! Per-entity drift repair for one index (see the crate docs for the rules
//! that keep it safe under live traffic).

use schemas::codec;
use schemas::{EntityId, IndexKey, IndexSpec};
use std::collections::HashMap;
use storage::index_rows::{self, IndexRow, IndexRowLocation};
use storage::shards::Routing;
use storage::{topology, EntityRecord, OnShard};

use crate::{Cleaner, CleanerError};

/// What an entity should have in the index: its version and keys (none for
/// a tombstone, an absent id, or a body that cannot be decoded).
fn expected_keys(spec: &IndexSpec, e: Option<&EntityRecord>) -> (u64, Vec<IndexKey>) {
    match e {
        None => (0, Vec::new()),
        Some(e) => {
            let keys = match e.body.as_deref().map(codec::decode_body) {
                Some(Ok(bag)) => spec.keys(&bag),
                Some(Err(err)) => {
                    tracing::error!(id = %e.id, error = %err, "corrupt entity body; it gets no index rows");
                    Vec::new()
                }
                None => Vec::new(),
            };
            (e.version, keys)
        }
    }
}

/// What each entity should have in the index: its version and keys.
type Expected = HashMap<EntityId, (u64, Vec<IndexKey>)>;

/// Repairs the rows of `ids` in `spec`'s index, given what was read of them.
///
/// Entities committed after `settled_us` (before which every event has been
/// applied, see [`crate::lag`]) are left alone: their events may
/// still be on their way through Kafka, and that is lag, not drift.
pub async fn reconcile(
    cleaner: &Cleaner,
    map: &Routing,
    spec: &IndexSpec,
    ids: &[EntityId],
    found: &[EntityRecord],
    settled_us: i64,
) -> Result<(), CleanerError> {
    let in_flight: std::collections::HashSet<EntityId> =
        found.iter().filter(|e| e.updated_us > settled_us).map(|e| e.id).collect();
    let ids: Vec<EntityId> = ids.iter().filter(|id| !in_flight.contains(id)).copied().collect();
    if ids.is_empty() {
        return Ok(());
    }
    // One map for where rows belong and which rows count (`map`, the
    // caller's): with two, a reload in between made a row filtered out as
    // a moved-away copy "missing" at its new home. Its writes check
    // ownership on the shard ([`topology::begin_owned`]) whatever the map.
    let homes = Homes { map, spec, logical_shards: map.logical_shards() };
    let by_id: HashMap<EntityId, &EntityRecord> = found.iter().map(|e| (e.id, e)).collect();
    let expected: Expected =
        ids.iter().map(|id| (*id, expected_keys(spec, by_id.get(id).copied()))).collect();
    let actual = held_rows(cleaner, &homes, &expected.keys().copied().collect::<Vec<_>>()).await?;
    let repairs = repairs(&homes, &expected, &by_id, &actual);
    let candidates = dangling_candidates(&homes, &expected, actual);
    write_missing(cleaner, spec, &repairs).await?;
    write_locations(cleaner, &homes, &repairs).await?;
    if candidates.is_empty() {
        return Ok(());
    }
    remove_dangling(cleaner, &homes, candidates, settled_us).await
}

/// Where a reconcile's rows belong, by the one map it judges with.
struct Homes<'a> {
    map: &'a Routing,
    spec: &'a IndexSpec,
    logical_shards: u16,
}

impl Homes<'_> {
    /// The logical shard of a key's row.
    fn logical_of(&self, key: &IndexKey) -> u16 {
        self.spec.logical_of_key(key, self.logical_shards)
    }

    /// Where a key's row belongs: the owner of its logical shard.
    fn of(&self, key: &IndexKey) -> usize {
        self.map.of_logical(self.logical_of(key))
    }
}

/// The rows `ids` have in the index, on every shard, each with its shard.
async fn held_rows(
    cleaner: &Cleaner,
    homes: &Homes<'_>,
    ids: &[EntityId],
) -> Result<Vec<(usize, IndexRow)>, CleanerError> {
    let spec = homes.spec;
    let per_shard = cleaner
        .shards()
        .try_each(|shard, pool| async move {
            Ok((shard, index_rows::index_rows_of(shard, pool, spec, ids).await?))
        })
        .await?;
    // Rows on a shard that does not own their logical shard are a moved-away
    // copy waiting for removal, not drift: left alone.
    Ok(per_shard
        .into_iter()
        .flat_map(|(shard, rows)| rows.into_iter().map(move |r| (shard, r)))
        .filter(|(shard, r)| homes.map.of_logical(r.logical) == *shard)
        .collect())
}

/// What the index lacks, per shard: rows to write, locations to set.
struct Repairs {
    missing: Vec<Vec<IndexRow>>,
    missing_count: u64,
    mislocated: Vec<Vec<IndexRowLocation>>,
    mislocated_count: u64,
}

/// Missing: a key the entity produces without its row. Mislocated: a
/// row that is right but does not say where its entity is (written
/// before rows did) or says it wrong; queries then fetch it by id.
fn repairs(
    homes: &Homes<'_>,
    expected: &Expected,
    by_id: &HashMap<EntityId, &EntityRecord>,
    actual: &[(usize, IndexRow)],
) -> Repairs {
    let n = homes.map.slots_len();
    let mut r = Repairs {
        missing: vec![Vec::new(); n],
        missing_count: 0,
        mislocated: vec![Vec::new(); n],
        mislocated_count: 0,
    };
    for (id, (version, keys)) in expected {
        let at = by_id.get(id).map(|e| e.added_id);
        for key in keys {
            let shard = homes.of(key);
            match actual.iter().find(|(s, row)| *s == shard && row.entity == *id && &row.key == key) {
                None => {
                    r.missing[shard].push(IndexRow {
                        key: key.clone(),
                        entity: *id,
                        logical: homes.logical_of(key),
                        version: *version,
                        entity_added_id: at,
                        reservation: None,
                    });
                    r.missing_count += 1;
                }
                Some((_, row)) => {
                    if let Some(at) = at.filter(|a| row.entity_added_id != Some(*a)) {
                        r.mislocated[shard].push(IndexRowLocation {
                            key: key.clone(),
                            entity: *id,
                            entity_added_id: at,
                        });
                        r.mislocated_count += 1;
                    }
                }
            }
        }
    }
    r
}

/// Dangling candidates: a row for a key the entity does not produce (or
/// a row on a shard that key does not route to).
fn dangling_candidates(
    homes: &Homes<'_>,
    expected: &Expected,
    actual: Vec<(usize, IndexRow)>,
) -> Vec<(usize, IndexRow)> {
    actual
        .into_iter()
        .filter(|(shard, r)| {
            let produced = expected.get(&r.entity).is_some_and(|(_, keys)| keys.contains(&r.key));
            !produced || homes.of(&r.key) != *shard
        })
        .collect()
}

/// Writes the missing rows, each shard's in one transaction that owns
/// their logical shards.
async fn write_missing(cleaner: &Cleaner, spec: &IndexSpec, repairs: &Repairs) -> Result<(), CleanerError> {
    if repairs.missing_count == 0 {
        return Ok(());
    }
    let shards = cleaner.shards();
    for (shard, rows) in repairs.missing.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
        let logicals: Vec<u16> = rows.iter().map(|r| r.logical).collect();
        let mut tx = topology::begin_owned(shard, shards.pool(shard), &logicals).await?;
        index_rows::upsert_index_rows(shard, &mut tx, spec, rows).await?;
        tx.commit().await.on(shard)?;
    }
    // A row missing for an entity that has moved on since the scan was a
    // race with the indexer, not drift: counted only once confirmed.
    let overtaken = settle_overtaken(cleaner, spec, &repairs.missing).await?;
    let drift = repairs.missing_count - overtaken.rows.len() as u64;
    let (m, table) = (cleaner.metrics(), spec.table.as_str());
    m.drift_found.with_label_values(&[table, "missing"]).inc_by(drift);
    m.drift_fixed.with_label_values(&[table, "missing"]).inc_by(drift);
    if drift > 0 {
        let ids = repairs
            .missing
            .iter()
            .flatten()
            .filter(|r| !overtaken.rows.iter().any(|(id, key)| *id == r.entity && *key == r.key))
            .map(|r| r.entity);
        tracing::warn!(index = table, rows = drift, overtaken = overtaken.rows.len(), undone = overtaken.undone,
            entities = %some_ids(ids), "wrote missing index rows");
    } else {
        tracing::debug!(
            index = table,
            overtaken = overtaken.rows.len(),
            undone = overtaken.undone,
            "missing index rows were newer writes in flight"
        );
    }
    Ok(())
}

/// Writes where their entities are into the mislocated rows.
async fn write_locations(
    cleaner: &Cleaner,
    homes: &Homes<'_>,
    repairs: &Repairs,
) -> Result<(), CleanerError> {
    if repairs.mislocated_count == 0 {
        return Ok(());
    }
    let (m, spec, table) = (cleaner.metrics(), homes.spec, homes.spec.table.as_str());
    m.drift_found.with_label_values(&[table, "location"]).inc_by(repairs.mislocated_count);
    let shards = cleaner.shards();
    let mut fixed = 0;
    for (shard, rows) in repairs.mislocated.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
        let logicals: Vec<u16> = rows.iter().map(|r| homes.logical_of(&r.key)).collect();
        let mut tx = topology::begin_owned(shard, shards.pool(shard), &logicals).await?;
        fixed += index_rows::set_index_row_locations(shard, &mut tx, spec, rows).await?;
        tx.commit().await.on(shard)?;
    }
    m.drift_fixed.with_label_values(&[table, "location"]).inc_by(fixed);
    tracing::info!(index = table, rows = fixed, "wrote entity locations into index rows");
    Ok(())
}

/// Removes the dangling candidates the entities, read again right before,
/// confirm.
async fn remove_dangling(
    cleaner: &Cleaner,
    homes: &Homes<'_>,
    candidates: Vec<(usize, IndexRow)>,
    settled_us: i64,
) -> Result<(), CleanerError> {
    let (spec, shards) = (homes.spec, cleaner.shards());
    // Re-read right before deleting: the entity may have changed since the scan.
    let reread_ids: Vec<EntityId> = candidates.iter().map(|(_, r)| r.entity).collect();
    let reread = cleaner.read_any(&reread_ids).await?;
    let now: HashMap<EntityId, &EntityRecord> = reread.iter().map(|e| (e.id, e)).collect();
    // Drift is what the re-read confirms; a candidate the entity's newer
    // write explains is the indexer's business, not drift.
    let (mut confirmed, mut fixed) = (0u64, 0u64);
    let mut drifted: Vec<EntityId> = Vec::new();
    for (shard, row) in candidates {
        if now.get(&row.entity).is_some_and(|e| e.updated_us > settled_us) {
            continue; // Changed since the scan and not yet indexed: the indexer's turn.
        }
        let (version, keys) = expected_keys(spec, now.get(&row.entity).copied());
        if keys.contains(&row.key) && homes.of(&row.key) == shard {
            continue; // Valid again: the entity changed under us.
        }
        // Only rows no newer than what we judged: a row rewritten by a newer
        // event (higher version) is the indexer's, and stays.
        let upto = version.max(row.version);
        confirmed += 1;
        drifted.push(row.entity);
        let mut tx = topology::begin_owned(shard, shards.pool(shard), &[row.logical]).await?;
        let now = schemas::clock::now_micros();
        fixed +=
            index_rows::remove_index_row_upto(shard, &mut tx, spec, &row.key, &row.entity, upto, now).await?;
        tx.commit().await.on(shard)?;
    }
    let (m, table) = (cleaner.metrics(), spec.table.as_str());
    m.drift_found.with_label_values(&[table, "dangling"]).inc_by(confirmed);
    m.drift_fixed.with_label_values(&[table, "dangling"]).inc_by(fixed);
    if confirmed > 0 {
        tracing::warn!(index = table, rows = confirmed, fixed, entities = %some_ids(drifted),
            "deleted dangling index rows");
    }
    Ok(())
}

/// How many entity ids a drift warning names at most.
pub const IDS_LOGGED: usize = 10;

/// Up to [`IDS_LOGGED`] distinct ids (32 lowercase hex, in the order
/// met), comma-separated, then how many more there were: what a drift
/// warning names, so a report can say which entities drifted.
pub fn some_ids(ids: impl IntoIterator<Item = EntityId>) -> String {
    let mut all: std::collections::HashSet<EntityId> = Default::default();
    let mut named: Vec<String> = Vec::new();
    for id in ids {
        if all.insert(id) && named.len() < IDS_LOGGED {
            named.push(id.to_hex());
        }
    }
    let mut out = named.join(",");
    if all.len() > named.len() {
        out.push_str(&format!(" (and {} more)", all.len() - named.len()));
    }
    out
}

/// The written rows whose entity had moved on by the time they were
/// written, and how many of them were taken back.
struct Overtaken {
    rows: Vec<(EntityId, IndexKey)>,
    undone: usize,
}

/// Tells drift from a race with newer writes, once the missing rows are
/// written. The cleaner read version v and found key K's row missing, but
/// the entity may have moved on since the scan: v+1 (without K) committed
/// and its event removed K before the rows were read. That is the indexer
/// keeping up, not drift, also when a still newer version produces K again
/// (its event, not applied yet when the rows were read, writes K itself;
/// the chaos suite's cleaner counted that as a missing row). So the
/// entities are read again: a row is drift only if its entity is still at
/// v (v's event was applied before the settled time, and nothing newer
/// explains the gap). A row whose entity moved on and no longer produces
/// its key is taken back (v+1's event found no K to remove, so K at v
/// would linger), but only at versions no newer than the one written, so
/// an indexer row of a later version stays.
async fn settle_overtaken(
    cleaner: &Cleaner,
    spec: &IndexSpec,
    written: &[Vec<IndexRow>],
) -> Result<Overtaken, CleanerError> {
    let ids: Vec<EntityId> = written.iter().flatten().map(|row| row.entity).collect();
    let now = cleaner.read_any(&ids).await?;
    let now: HashMap<EntityId, &EntityRecord> = now.iter().map(|e| (e.id, e)).collect();
    let shards = cleaner.shards();
    let mut out = Overtaken { rows: Vec::new(), undone: 0 };
    for (shard, rows) in written.iter().enumerate() {
        for row in rows {
            let (current, keys) = expected_keys(spec, now.get(&row.entity).copied());
            if current == row.version {
                continue; // Unchanged since the scan: drift.
            }
            out.rows.push((row.entity, row.key.clone()));
            if keys.contains(&row.key) {
                tracing::debug!(index = %spec.table, entity = %row.entity, written = row.version, current,
                    "a missing row's entity moved on and produces it again: left to the indexer");
                continue;
            }
            out.undone += 1;
            let mut tx = topology::begin_owned(shard, shards.pool(shard), &[row.logical]).await?;
            let at = schemas::clock::now_micros();
            index_rows::remove_index_row_upto(shard, &mut tx, spec, &row.key, &row.entity, row.version, at)
                .await?;
            tx.commit().await.on(shard)?;
            tracing::debug!(index = %spec.table, entity = %row.entity, "undid a repair overtaken by a newer write");
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drift_warning_names_up_to_ten_distinct_ids_in_lowercase_hex() {
        let id = |b: u8| EntityId([b; 16]);
        assert_eq!(some_ids([id(0xab), id(0xab), id(1)]), format!("{},{}", "ab".repeat(16), "01".repeat(16)));
        let many = some_ids((0..15u8).chain(0..15u8).map(id));
        assert_eq!(many.split(',').count(), 10, "{many}");
        assert!(many.ends_with(" (and 5 more)"), "{many}");
        assert_eq!(some_ids([]), "");
    }
}
