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
    let ids = &ids[..];
    if ids.is_empty() {
        return Ok(());
    }
    let shards = cleaner.shards();
    // One map for where rows belong and which rows count (`map`, the
    // caller's): with two, a reload in between made a row filtered out as
    // a moved-away copy "missing" at its new home. Its writes check
    // ownership on the shard ([`topology::begin_owned`]) whatever the map.
    let n = map.slots_len();
    let l = map.logical_shards();
    // Where a key's row belongs: the owner of its logical shard.
    let home = |key: &IndexKey| map.of_logical(spec.logical_of_key(key, l));
    let by_id: HashMap<EntityId, &EntityRecord> = found.iter().map(|e| (e.id, e)).collect();
    let expected: HashMap<EntityId, (u64, Vec<IndexKey>)> =
        ids.iter().map(|id| (*id, expected_keys(spec, by_id.get(id).copied()))).collect();

    // The rows these entities have, on every shard.
    let unique: Vec<EntityId> = expected.keys().copied().collect();
    let unique = &unique;
    let per_shard = shards
        .try_each(|shard, pool| async move {
            Ok((shard, index_rows::index_rows_of(shard, pool, spec, unique).await?))
        })
        .await?;
    // Rows on a shard that does not own their logical shard are a moved-away
    // copy waiting for removal, not drift: left alone.
    let actual: Vec<(usize, IndexRow)> = per_shard
        .into_iter()
        .flat_map(|(shard, rows)| rows.into_iter().map(move |r| (shard, r)))
        .filter(|(shard, r)| map.of_logical(r.logical) == *shard)
        .collect();

    // Missing: a key the entity produces without its row. Mislocated: a
    // row that is right but does not say where its entity is (written
    // before rows did) or says it wrong; queries then fetch it by id.
    let mut missing: Vec<Vec<IndexRow>> = vec![Vec::new(); n];
    let mut missing_count = 0u64;
    let mut mislocated: Vec<Vec<IndexRowLocation>> = vec![Vec::new(); n];
    let mut mislocated_count = 0u64;
    for (id, (version, keys)) in &expected {
        let at = by_id.get(id).map(|e| e.added_id);
        for key in keys {
            let shard = home(key);
            match actual.iter().find(|(s, r)| *s == shard && r.entity == *id && &r.key == key) {
                None => {
                    missing[shard].push(IndexRow {
                        key: key.clone(),
                        entity: *id,
                        logical: spec.logical_of_key(key, l),
                        version: *version,
                        entity_added_id: at,
                    });
                    missing_count += 1;
                }
                Some((_, row)) => {
                    if let Some(at) = at.filter(|a| row.entity_added_id != Some(*a)) {
                        mislocated[shard].push(IndexRowLocation {
                            key: key.clone(),
                            entity: *id,
                            entity_added_id: at,
                        });
                        mislocated_count += 1;
                    }
                }
            }
        }
    }
    // Dangling candidates: a row for a key the entity does not produce (or
    // a row on a shard that key does not route to).
    let candidates: Vec<(usize, IndexRow)> = actual
        .into_iter()
        .filter(|(shard, r)| {
            let produced = expected.get(&r.entity).is_some_and(|(_, keys)| keys.contains(&r.key));
            !produced || home(&r.key) != *shard
        })
        .collect();

    let table = spec.table.as_str();
    let m = cleaner.metrics();
    if missing_count > 0 {
        for (shard, rows) in missing.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
            let logicals: Vec<u16> = rows.iter().map(|r| r.logical).collect();
            let mut tx = topology::begin_owned(shard, shards.pool(shard), &logicals).await?;
            index_rows::upsert_index_rows(shard, &mut tx, spec, rows).await?;
            tx.commit().await.on(shard)?;
        }
        // A row the entity's newer write made unneeded meanwhile was a
        // race with the indexer, not drift: counted only once confirmed.
        let undone = undo_overtaken(cleaner, spec, &missing).await?;
        let drift = missing_count - undone;
        m.drift_found.with_label_values(&[table, "missing"]).inc_by(drift);
        m.drift_fixed.with_label_values(&[table, "missing"]).inc_by(drift);
        tracing::info!(index = table, rows = drift, undone, "wrote missing index rows");
    }
    if mislocated_count > 0 {
        m.drift_found.with_label_values(&[table, "location"]).inc_by(mislocated_count);
        let mut fixed = 0;
        for (shard, rows) in mislocated.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
            let logicals: Vec<u16> = rows.iter().map(|r| spec.logical_of_key(&r.key, l)).collect();
            let mut tx = topology::begin_owned(shard, shards.pool(shard), &logicals).await?;
            fixed += index_rows::set_index_row_locations(shard, &mut tx, spec, rows).await?;
            tx.commit().await.on(shard)?;
        }
        m.drift_fixed.with_label_values(&[table, "location"]).inc_by(fixed);
        tracing::info!(index = table, rows = fixed, "wrote entity locations into index rows");
    }
    if candidates.is_empty() {
        return Ok(());
    }
    // Re-read right before deleting: the entity may have changed since the scan.
    let reread_ids: Vec<EntityId> = candidates.iter().map(|(_, r)| r.entity).collect();
    let reread = cleaner.read_any(&reread_ids).await?;
    let now: HashMap<EntityId, &EntityRecord> = reread.iter().map(|e| (e.id, e)).collect();
    // Drift is what the re-read confirms; a candidate the entity's newer
    // write explains is the indexer's business, not drift.
    let (mut confirmed, mut fixed) = (0u64, 0u64);
    for (shard, row) in candidates {
        if now.get(&row.entity).is_some_and(|e| e.updated_us > settled_us) {
            continue; // Changed since the scan and not yet indexed: the indexer's turn.
        }
        let (version, keys) = expected_keys(spec, now.get(&row.entity).copied());
        if keys.contains(&row.key) && home(&row.key) == shard {
            continue; // Valid again: the entity changed under us.
        }
        // Only rows no newer than what we judged: a row rewritten by a newer
        // event (higher version) is the indexer's, and stays.
        let upto = version.max(row.version);
        confirmed += 1;
        let mut tx = topology::begin_owned(shard, shards.pool(shard), &[row.logical]).await?;
        let now = schemas::clock::now_micros();
        fixed +=
            index_rows::remove_index_row_upto(shard, &mut tx, spec, &row.key, &row.entity, upto, now).await?;
        tx.commit().await.on(shard)?;
    }
    m.drift_found.with_label_values(&[table, "dangling"]).inc_by(confirmed);
    m.drift_fixed.with_label_values(&[table, "dangling"]).inc_by(fixed);
    if fixed > 0 {
        tracing::info!(index = table, rows = fixed, "deleted dangling index rows");
    }
    Ok(())
}

/// Closes the race between writing a missing row and a newer write of the
/// same entity: the cleaner read version v and wrote key K at v, but v+1
/// (without K) may have committed, and its event been applied, in between;
/// the indexer found no K to delete then, so K at v would linger. Re-read
/// the entities after the write: a row whose entity moved on and no longer
/// produces its key is deleted, but only at versions no newer than the one
/// written, so an indexer row of a later version stays. Returns how many
/// written rows the entity's newer version had made unneeded.
async fn undo_overtaken(
    cleaner: &Cleaner,
    spec: &IndexSpec,
    written: &[Vec<IndexRow>],
) -> Result<u64, CleanerError> {
    let ids: Vec<EntityId> = written.iter().flatten().map(|row| row.entity).collect();
    let now = cleaner.read_any(&ids).await?;
    let now: HashMap<EntityId, &EntityRecord> = now.iter().map(|e| (e.id, e)).collect();
    let shards = cleaner.shards();
    let mut undone = 0;
    for (shard, rows) in written.iter().enumerate() {
        for row in rows {
            let (current, keys) = expected_keys(spec, now.get(&row.entity).copied());
            if current == row.version || keys.contains(&row.key) {
                continue;
            }
            undone += 1;
            let mut tx = topology::begin_owned(shard, shards.pool(shard), &[row.logical]).await?;
            let at = schemas::clock::now_micros();
            index_rows::remove_index_row_upto(shard, &mut tx, spec, &row.key, &row.entity, row.version, at)
                .await?;
            tx.commit().await.on(shard)?;
            tracing::debug!(index = %spec.table, entity = %row.entity, "undid a repair overtaken by a newer write");
        }
    }
    Ok(undone)
}
