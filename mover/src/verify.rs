//! The copy phase after the first copy: catching up with the source's
//! journal, and verifying the copy against the source (by checksums, then
//! row by row where those differ). The cutover does both again under its
//! fence, for the last changes and the entities that differed.

use schemas::names::tables;
use schemas::EntityId;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;
use storage::{carry, checksums, entities, index_rows, journal, moves, IndexRow, OnShard};

use crate::{MoveError, Mover, Result, Running};

/// Logical shards compared per verification step.
const LOGICALS_PER_VERIFY: usize = 256;
/// Journal entries applied per catch-up round.
const JOURNAL_BATCH: usize = 2000;
/// The catch-up before verification stops once the journal is this short.
const SHORT_JOURNAL: u64 = 200;

/// Entities whose rows differed between source and target, by table
/// (`entities` or an index table).
pub type Differs = BTreeMap<String, Vec<EntityId>>;

impl Mover {
    /// Applies the journal to the target until it is at most `until`
    /// entries long (0: empty). Returns how many entries were applied.
    pub(crate) async fn catch_up(&self, run: &mut Running<'_>, until: u64) -> Result<u64> {
        let source = run.rec.source as usize;
        let src = self.shards().pool(source);
        let mut applied = 0;
        loop {
            if run.stop.is_cancelled() {
                return Err(MoveError::Stopped);
            }
            let entries = journal::read_journal(source, src, JOURNAL_BATCH).await?;
            if entries.is_empty() {
                break;
            }
            run.touched.extend(entries.iter().map(|e| (e.table.clone(), e.logical)));
            let n = self.apply(run, &journal::by_table(&entries)).await?;
            journal::trim_journal(source, src, &entries).await?;
            applied += entries.len() as u64;
            run.rows_caught_up += n;
            run.outcome.rows_copied += n;
            self.metrics().rows_copied.inc_by(n);
            self.metrics().progressed();
            run.journal_backlog =
                if entries.len() < JOURNAL_BATCH { 0 } else { journal::journal_backlog(source, src).await? };
            self.show(run, false);
            if run.journal_backlog <= until {
                break;
            }
        }
        Ok(applied)
    }

    /// Makes the target's rows of the journaled entities what the source
    /// has now (none, where the source has none). Returns the rows written
    /// or deleted.
    async fn apply(&self, run: &Running<'_>, changed: &BTreeMap<String, Vec<EntityId>>) -> Result<u64> {
        let (source, target) = (run.rec.source as usize, run.rec.target as usize);
        let (src, dst) = (self.shards().pool(source), self.shards().pool(target));
        let mut written = 0;
        for (table, ids) in changed {
            if table == tables::ENTITIES {
                let rows = entities::read_entities_any(source, src, ids).await?.records;
                // An entity the source no longer has (a purged tombstone)
                // goes from the target too, or the two would differ for
                // good. Only ids of the moving logical shards: nothing else
                // of the target's is ours to delete.
                let present: BTreeSet<EntityId> = rows.iter().map(|r| r.id).collect();
                let logicals = &run.rec.logicals;
                let gone: Vec<EntityId> = ids
                    .iter()
                    .copied()
                    .filter(|id| !present.contains(id))
                    .filter(|id| logicals.binary_search(&self.shards().logical_of_id(id)).is_ok())
                    .collect();
                let mut tx = moves::begin_incoming(target, dst, logicals, run.token).await?;
                entities::copy_entities(target, &mut tx, &rows).await?;
                let deleted = carry::delete_entities(target, &mut tx, &gone).await?;
                tx.commit().await.on(target)?;
                written += rows.len() as u64 + deleted;
            } else if let Some(spec) = run.indexes.iter().find(|s| s.table == *table) {
                let logicals = &run.rec.logicals;
                let rows: Vec<_> = index_rows::index_rows_of(source, src, spec, ids)
                    .await?
                    .into_iter()
                    .filter(|r| logicals.binary_search(&r.logical).is_ok())
                    .collect();
                let mut tx = moves::begin_incoming(target, dst, logicals, run.token).await?;
                index_rows::replace_rows_of(target, &mut tx, spec, logicals, ids, &rows).await?;
                tx.commit().await.on(target)?;
                written += rows.len() as u64;
            }
            // A table no index has any more (dropped meanwhile): nothing to carry.
        }
        Ok(written)
    }

    /// Copies the rows of `differs`' entities again from the source, as a
    /// catch-up would: for a row the journal did not bring. That happens:
    /// the chaos suite once left two new entities of a move uncopied (a
    /// journal entry lost across the mover's kills and killed
    /// connections), and without this the cutover compared, differed and
    /// retried forever.
    pub(crate) async fn recopy(&self, run: &Running<'_>, differs: &Differs) -> Result<u64> {
        if differs.values().all(Vec::is_empty) {
            return Ok(0);
        }
        self.apply(run, differs).await
    }

    /// Catches up, then compares the target with the source logical shard
    /// by logical shard, copies the differing entities again, then catches
    /// up again. Returns the entities that differed: a change the journal
    /// will bring, or a copy that went wrong; the cutover compares them
    /// again once writes are held.
    pub(crate) async fn verify_until_settled(&self, run: &mut Running<'_>) -> Result<Differs> {
        let t = Instant::now();
        self.catch_up(run, SHORT_JOURNAL).await?;
        let caught_up = t.elapsed();
        let differs = self.verify(run, None).await?;
        let verified = t.elapsed() - caught_up;
        self.recopy(run, &differs).await?;
        self.catch_up(run, SHORT_JOURNAL).await?;
        let n: usize = differs.values().map(Vec::len).sum();
        tracing::info!(
            id = run.rec.id,
            differing = n,
            catch_up_secs = (t.elapsed() - verified).as_secs_f64(),
            verify_secs = verified.as_secs_f64(),
            "move verified; differing entities are compared again at the cutover"
        );
        Ok(differs)
    }

    /// Compares source and target: every row of the moving logical shards
    /// (by checksums, then row by row where those differ), or (with `only`)
    /// the rows of those entities. Source and target are read at once.
    pub(crate) async fn verify(&self, run: &mut Running<'_>, only: Option<&Differs>) -> Result<Differs> {
        if only.is_some() {
            return self.compare_rows(run, &run.rec.logicals, only).await;
        }
        // Changes the journal holds and the catch-up has not applied yet.
        let source = run.rec.source as usize;
        let pending: BTreeSet<(String, u16)> =
            journal::pending_logicals(source, self.shards().pool(source)).await?.into_iter().collect();
        let mut out = Differs::new();
        let mut against_copy = 0;
        for step in run.rec.logicals.chunks(LOGICALS_PER_VERIFY) {
            if run.stop.is_cancelled() {
                return Err(MoveError::Stopped);
            }
            let (differing, trusted) = self.differing_logicals(run, step, &pending).await?;
            against_copy += trusted;
            if !differing.is_empty() {
                for (table, ids) in self.compare_rows(run, &differing, None).await? {
                    out.entry(table).or_default().extend(ids);
                }
            }
        }
        // An entity's index rows may lie in logical shards of several steps.
        for ids in out.values_mut() {
            ids.sort_unstable();
            ids.dedup();
        }
        let slices = run.rec.logicals.len() * (1 + run.indexes.len());
        run.outcome.verified_against_copy = against_copy;
        run.outcome.verified_slices = slices;
        tracing::debug!(
            id = run.rec.id,
            against_copy,
            against_source = slices - against_copy,
            "compared (table, logical shard) slices with the copy's digests or the source's rows"
        );
        Ok(out)
    }

    /// The logical shards of `step` whose checksums differ between source
    /// and target, in any table; and how many (table, logical shard)s were
    /// compared with the copy's digests. The target is always summed up
    /// by its server. The source is only where this run's copy did not read
    /// the logical shard, or the journal has named a change to it in that
    /// table since (applied, or `pending`): elsewhere it still has what the
    /// copy read.
    async fn differing_logicals(
        &self,
        run: &Running<'_>,
        step: &[u16],
        pending: &BTreeSet<(String, u16)>,
    ) -> Result<(Vec<u16>, usize)> {
        let (source, target) = (run.rec.source as usize, run.rec.target as usize);
        let (src, dst) = (self.shards().pool(source), self.shards().pool(target));
        let mut out: BTreeSet<u16> = BTreeSet::new();
        let mut trusted_total = 0;
        let mut tables: Vec<Option<&schemas::index::IndexSpec>> = vec![None];
        tables.extend(run.indexes.iter().map(Some));
        for spec in tables {
            let table = spec.map_or(tables::ENTITIES, |s| s.table.as_str());
            let copied = run.copy_sums.tables.get(table);
            let key = |k: u16| (table.to_string(), k);
            let (trusted, reread): (Vec<u16>, Vec<u16>) = step.iter().partition(|k| {
                copied.is_some()
                    && run.copy_sums.logicals.contains(k)
                    && !run.touched.contains(&key(**k))
                    && !pending.contains(&key(**k))
            });
            trusted_total += trusted.len();
            let (source_sums, target_sums) = match spec {
                None => tokio::try_join!(
                    checksums::entities(source, src, &reread),
                    checksums::entities(target, dst, step)
                )?,
                Some(spec) => tokio::try_join!(
                    checksums::index_rows(source, src, spec, &reread),
                    checksums::index_rows(target, dst, spec, step)
                )?,
            };
            let mut want = source_sums;
            if let Some(copied) = copied {
                want.extend(trusted.iter().filter_map(|k| copied.0.get(k).map(|c| (*k, *c))));
            }
            out.extend(checksums::differing(&want, &target_sums));
        }
        Ok((out.into_iter().collect(), trusted_total))
    }

    /// Compares the rows of `logicals` (or, with `only`, of those entities
    /// among them) one by one.
    async fn compare_rows(
        &self,
        run: &Running<'_>,
        logicals: &[u16],
        only: Option<&Differs>,
    ) -> Result<Differs> {
        let (source, target) = (run.rec.source as usize, run.rec.target as usize);
        let (src, dst) = (self.shards().pool(source), self.shards().pool(target));
        let mut out = Differs::new();
        let ids = only.map(|d| d.get(tables::ENTITIES).map_or(&[][..], Vec::as_slice));
        if ids.is_none_or(|ids| !ids.is_empty()) {
            let (a, b) = tokio::try_join!(
                entities::fingerprints(source, src, logicals, ids),
                entities::fingerprints(target, dst, logicals, ids)
            )?;
            let differ = symmetric_difference(
                a.iter().map(|f| (f.id, f.clone())),
                b.iter().map(|f| (f.id, f.clone())),
            );
            if !differ.is_empty() {
                out.entry(tables::ENTITIES.to_string()).or_default().extend(differ);
            }
        }
        for spec in &run.indexes {
            let (a, b) = match only {
                None => tokio::try_join!(
                    index_rows::rows_in_logicals(source, src, spec, logicals),
                    index_rows::rows_in_logicals(target, dst, spec, logicals)
                )?,
                Some(d) => {
                    let Some(ids) = d.get(&spec.table).filter(|ids| !ids.is_empty()) else { continue };
                    let keep = |rows: Vec<IndexRow>| -> Vec<IndexRow> {
                        rows.into_iter().filter(|r| logicals.binary_search(&r.logical).is_ok()).collect()
                    };
                    let (a, b) = tokio::try_join!(
                        index_rows::index_rows_of(source, src, spec, ids),
                        index_rows::index_rows_of(target, dst, spec, ids)
                    )?;
                    (keep(a), keep(b))
                }
            };
            let fp = |rows: &[IndexRow]| -> Vec<(EntityId, _)> {
                rows.iter().map(|r| (r.entity, index_rows::row_fingerprint(r))).collect()
            };
            let differ = symmetric_difference(fp(&a).into_iter(), fp(&b).into_iter());
            if !differ.is_empty() {
                out.entry(spec.table.clone()).or_default().extend(differ);
            }
        }
        for ids in out.values_mut() {
            ids.sort_unstable();
            ids.dedup();
        }
        Ok(out)
    }
}

/// The entities whose items are not the same on both sides.
fn symmetric_difference<T: Ord>(
    a: impl Iterator<Item = (EntityId, T)>,
    b: impl Iterator<Item = (EntityId, T)>,
) -> Vec<EntityId> {
    let a: BTreeSet<(EntityId, T)> = a.collect();
    let b: BTreeSet<(EntityId, T)> = b.collect();
    let ids: BTreeSet<EntityId> = a.symmetric_difference(&b).map(|(id, _)| *id).collect();
    ids.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entities_differ_when_any_of_their_items_differ() {
        let id = |b: u8| EntityId([b; 16]);
        let a = vec![(id(1), 1), (id(2), 5), (id(3), 1)];
        let b = vec![(id(1), 1), (id(2), 6), (id(4), 1)];
        assert_eq!(symmetric_difference(a.into_iter(), b.into_iter()), vec![id(2), id(3), id(4)]);
    }
}
