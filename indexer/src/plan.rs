//! From a change event to index row operations.
//!
//! rows to delete = keys(before) − keys(after), rows to upsert = keys(after),
//! all stamped with the event's version. Deletes only remove rows written by
//! an older version and upserts never lower a version, so applying an event
//! twice, or an old event after a newer one, leaves the newest state.

use schemas::event::ChangeEvent;
use schemas::{EntityId, IndexKey, IndexSpec};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowOpKind {
    Upsert,
    /// Delete the row if it was written by an older version.
    DeleteOlder,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RowOp {
    pub kind: RowOpKind,
    /// The row's logical shard; which physical shard holds it is the
    /// shard map's business when the row is written.
    pub logical: u16,
    pub key: IndexKey,
    pub entity: EntityId,
    pub version: u64,
    /// Where the entity's row is on its shard, if the event says.
    pub entity_added_id: Option<u64>,
}

/// The row operations one event causes in one index, with their logical
/// shards (of `logical_shards`).
pub fn plan(spec: &IndexSpec, event: &ChangeEvent, logical_shards: u16) -> Vec<RowOp> {
    let before = event.before.as_ref().map(|b| spec.keys(b)).unwrap_or_default();
    let after = event.after.as_ref().map(|b| spec.keys(b)).unwrap_or_default();
    let op = |kind, key: &IndexKey| RowOp {
        kind,
        logical: spec.logical_of_key(key, logical_shards),
        key: key.clone(),
        entity: event.id,
        version: event.version,
        entity_added_id: event.added_id,
    };
    let mut ops: Vec<RowOp> =
        before.iter().filter(|k| !after.contains(k)).map(|k| op(RowOpKind::DeleteOlder, k)).collect();
    ops.extend(after.iter().map(|k| op(RowOpKind::Upsert, k)));
    ops
}

#[cfg(test)]
mod tests {
    use super::*;
    use schemas::event::Op;
    use schemas::value::bag_from_json;
    use schemas::KeyValue;
    use serde_json::json;

    fn spec() -> IndexSpec {
        toml::from_str(
            r#"table = "index_tag"
                          properties = [{ name = "tag", type = "string" }]"#,
        )
        .unwrap()
    }

    fn event(before: Option<serde_json::Value>, after: Option<serde_json::Value>) -> ChangeEvent {
        ChangeEvent {
            id: EntityId([7; 16]),
            version: 5,
            op: if after.is_some() { Op::Put } else { Op::Delete },
            committed_at_us: 0,
            shard: 0,
            before: before.map(|b| bag_from_json(&b).unwrap()),
            after: after.map(|a| bag_from_json(&a).unwrap()),
            added_id: Some(12),
        }
    }

    fn keys(ops: &[RowOp], kind: RowOpKind) -> Vec<String> {
        ops.iter()
            .filter(|o| o.kind == kind)
            .map(|o| match &o.key[0] {
                KeyValue::Str(s) => s.clone(),
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn an_update_deletes_only_keys_that_went_away() {
        let ops =
            plan(&spec(), &event(Some(json!({"tag": ["a", "b"]})), Some(json!({"tag": ["b", "c"]}))), 2);
        assert_eq!(keys(&ops, RowOpKind::DeleteOlder), vec!["a"]);
        assert_eq!(keys(&ops, RowOpKind::Upsert), vec!["b", "c"]);
        assert!(ops.iter().all(|o| o.version == 5 && o.entity == EntityId([7; 16])));
        assert!(ops.iter().all(|o| o.entity_added_id == Some(12)), "rows carry the entity's location");
    }

    #[test]
    fn a_delete_removes_every_old_key_and_adds_none() {
        let ops = plan(&spec(), &event(Some(json!({"tag": "a"})), None), 2);
        assert_eq!(keys(&ops, RowOpKind::DeleteOlder), vec!["a"]);
        assert!(keys(&ops, RowOpKind::Upsert).is_empty());
    }

    #[test]
    fn losing_the_property_removes_the_row() {
        let ops = plan(&spec(), &event(Some(json!({"tag": "a"})), Some(json!({"other": 1}))), 2);
        assert_eq!(keys(&ops, RowOpKind::DeleteOlder), vec!["a"]);
        assert!(keys(&ops, RowOpKind::Upsert).is_empty());
    }

    #[test]
    fn rows_go_to_the_logical_shard_of_their_shard_on_value() {
        let ops = plan(&spec(), &event(None, Some(json!({"tag": ["a", "bagstore"]}))), 4096);
        assert_eq!(ops[0].logical, schemas::logical_of(b"a", 4096));
        assert_eq!(ops[1].logical, schemas::logical_of(b"bagstore", 4096));
    }
}
