//! Applying row operations: one transaction per shard, shards in parallel.
//!
//! A batch first collapses to one operation per row (index key, entity):
//! the one of the newest version. That is what applying them all in order
//! would leave, or closer to the newest state when a batch holds a replayed
//! older event after a newer one (see [`crate::plan`]). The rows of a shard
//! are then written in one fixed order (canonical key bytes, entity id) with
//! multi-row statements: few round trips, and two transactions on the same
//! shard take their row locks in the same order, which keeps concurrent
//! indexers (and the cleaner) from deadlocking each other. Any failure
//! fails the whole apply; re-running it is harmless.

use schemas::IndexSpec;
use std::collections::HashMap;
use storage::fences::{self, Claim};
use storage::index_rows::{self, IndexRow, IndexRowDelete};
use storage::{topology, Shards, StoreError};

use crate::plan::{RowOp, RowOpKind};

/// A row's position in the fixed lock order: canonical key bytes (each
/// value length-prefixed), then the entity id.
type RowOrder = (Vec<u8>, [u8; 16]);

fn order_key(op: &RowOp) -> RowOrder {
    let mut bytes = Vec::new();
    for v in &op.key {
        let b = v.canonical_bytes();
        bytes.extend_from_slice(&(b.len() as u32).to_be_bytes());
        bytes.extend_from_slice(&b);
    }
    (bytes, op.entity.0)
}

/// Per physical shard (by `owner_of`, a logical shard's owner, for
/// `slots` physical ids): one operation per row (the newest version wins;
/// on equal versions the later one), in lock order.
pub fn collapse(ops: &[RowOp], slots: usize, owner_of: impl Fn(u16) -> usize) -> Vec<Vec<&RowOp>> {
    let mut newest: HashMap<RowOrder, &RowOp> = HashMap::new();
    for op in ops {
        let slot = newest.entry(order_key(op)).or_insert(op);
        if op.version >= slot.version {
            *slot = op;
        }
    }
    let mut per_shard: Vec<Vec<(RowOrder, &RowOp)>> = vec![Vec::new(); slots];
    for (k, op) in newest {
        per_shard[owner_of(op.logical)].push((k, op));
    }
    per_shard
        .into_iter()
        .map(|mut v| {
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v.into_iter().map(|(_, op)| op).collect()
        })
        .collect()
}

/// The consumer's claims on the partitions a batch came from, which each
/// of its transactions proves (`storage::fences`).
#[derive(Debug, Clone, Copy)]
pub struct Fence<'a> {
    pub group: &'a str,
    pub claims: &'a [Claim],
}

/// Applies `ops`, one transaction per physical shard, each proving its
/// shard owns the logical shards it writes and that `fence`'s claims are
/// still the newest; a [`StoreError::NotOwner`] means the map was stale
/// (the caller reloads it and runs the batch again, harmlessly), a
/// [`StoreError::Fenced`] that the partitions belong to another consumer
/// now (the caller stops applying them).
pub async fn apply(
    shards: &Shards,
    spec: &IndexSpec,
    ops: &[RowOp],
    fence: &Fence<'_>,
) -> Result<(), StoreError> {
    let per_shard = collapse(ops, shards.slots_len(), |k| shards.of_logical(k));
    let done = shards
        .each_with(&per_shard, |shard, pool, ops| async move {
            let of = |kind: RowOpKind| ops.iter().filter(move |o| o.kind == kind);
            let deletes: Vec<IndexRowDelete> = of(RowOpKind::DeleteOlder)
                .map(|o| IndexRowDelete {
                    key: o.key.clone(),
                    entity: o.entity,
                    logical: o.logical,
                    below_version: o.version,
                })
                .collect();
            let upserts: Vec<IndexRow> = of(RowOpKind::Upsert)
                .map(|o| IndexRow {
                    key: o.key.clone(),
                    entity: o.entity,
                    logical: o.logical,
                    version: o.version,
                    entity_added_id: o.entity_added_id,
                    reservation: None,
                })
                .collect();
            // A frozen old primary never answers: a failover's move of the
            // shard lets go of it, and the retry goes to the new server.
            shards
                .unless_moved(shard, async move {
                    let mut tx = pool.begin().await.map_err(|source| StoreError::Shard { shard, source })?;
                    let logicals: Vec<u16> = ops.iter().map(|o| o.logical).collect();
                    topology::check_owned(shard, &mut tx, &logicals).await?;
                    fences::check(shard, &mut tx, fence.group, fence.claims).await?;
                    if !deletes.is_empty() {
                        let now = schemas::clock::now_micros();
                        index_rows::remove_index_rows_before(shard, &mut tx, spec, &deletes, now).await?;
                    }
                    if !upserts.is_empty() {
                        index_rows::upsert_index_rows(shard, &mut tx, spec, &upserts).await?;
                    }
                    tx.commit().await.map_err(|source| StoreError::Shard { shard, source })
                })
                .await
        })
        .await;
    done.into_iter().try_for_each(|(_, r)| r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use schemas::{EntityId, KeyValue};

    fn op(kind: RowOpKind, tag: &str, entity: u8, version: u64) -> RowOp {
        RowOp {
            kind,
            logical: 0,
            key: vec![KeyValue::Str(tag.into())],
            entity: EntityId([entity; 16]),
            version,
            entity_added_id: None,
        }
    }

    #[test]
    fn each_row_keeps_only_its_newest_operation_in_a_fixed_order() {
        let ops = vec![
            op(RowOpKind::Upsert, "b", 1, 3),
            op(RowOpKind::DeleteOlder, "b", 1, 4),
            op(RowOpKind::Upsert, "a", 2, 1),
            op(RowOpKind::Upsert, "b", 1, 5),
            // A replayed older event after a newer one changes nothing.
            op(RowOpKind::Upsert, "a", 2, 1),
            op(RowOpKind::DeleteOlder, "c", 1, 6),
            op(RowOpKind::Upsert, "c", 1, 5),
        ];
        let out = collapse(&ops, 1, |_| 0);
        let got: Vec<(RowOpKind, String, u8, u64)> = out[0]
            .iter()
            .map(|o| match &o.key[0] {
                KeyValue::Str(s) => (o.kind, s.clone(), o.entity.0[0], o.version),
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (RowOpKind::Upsert, "a".into(), 2, 1),
                (RowOpKind::Upsert, "b".into(), 1, 5),
                (RowOpKind::DeleteOlder, "c".into(), 1, 6),
            ]
        );
    }
}
