//! The public change stream's envelope (version 1): what other programs
//! read from `changes.topic`, in Debezium's shape, as JSON.
//!
//! ```json
//! {"before": {...} | null, "after": {...} | null, "op": "c" | "u" | "d" | "r",
//!  "ts_ms": 1235697046000,
//!  "source": {"connector": "bagstore", "envelope": 1, "id": "<32 hex>", "version": 3,
//!             "logical_shard": 17, "physical_shard": "s0", "committed_at_us": 1235697046000123,
//!             "snapshot": false}}
//! ```
//!
//! The key is the id as 32 lowercase hex; headers `bagstore-version` and
//! `bagstore-op` repeat the version and the op. `schemas/change-event.v1.json`
//! is the JSON Schema (a test checks every envelope against it). The
//! guarantees (at-least-once, each entity's versions in order, dedupe on
//! `(id, version)`) are the internal topic's: the relay writes both from
//! the same outbox row (see docs/api.md, "Change stream (for downstream
//! consumers)").

use serde::Serialize;

use crate::event::{ChangeEvent, Op};
use crate::value::BagJson;

/// The envelope's version, in `source.envelope` and the topic's name.
pub const ENVELOPE_VERSION: u32 = 1;

/// Header names.
pub const HEADER_VERSION: &str = "bagstore-version";
pub const HEADER_OP: &str = "bagstore-op";

/// What happened, Debezium's letters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ChangeOp {
    /// Created: there was no live entity before.
    #[serde(rename = "c")]
    Create,
    /// Replaced or patched.
    #[serde(rename = "u")]
    Update,
    /// Deleted (by a client, or by the cleaner when it expired).
    #[serde(rename = "d")]
    Delete,
    /// A snapshot's read of a live entity (`bagstore changes snapshot`).
    #[serde(rename = "r")]
    Read,
}

impl ChangeOp {
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeOp::Create => "c",
            ChangeOp::Update => "u",
            ChangeOp::Delete => "d",
            ChangeOp::Read => "r",
        }
    }
}

#[derive(Serialize)]
struct Envelope<'a> {
    before: Option<BagJson<'a>>,
    after: Option<BagJson<'a>>,
    op: ChangeOp,
    ts_ms: i64,
    source: Source<'a>,
}

#[derive(Serialize)]
struct Source<'a> {
    connector: &'static str,
    envelope: u32,
    id: String,
    version: u64,
    logical_shard: u16,
    physical_shard: &'a str,
    committed_at_us: i64,
    snapshot: bool,
}

/// One message of the change stream: key, value and the two headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChangeMessage {
    pub key: String,
    pub value: Vec<u8>,
    pub version: String,
    pub op: ChangeOp,
}

/// The message for a committed write: a create when the row had no body
/// before (absent, or a tombstone), an update when it had one, a delete
/// when it has none after. A write over an expired entity the cleaner has
/// not deleted yet is therefore an update whose `before` is the expired
/// bag (what the row held; the indexes remove its rows the same way).
pub fn change_message(event: &ChangeEvent, logical_shard: u16, physical_shard: &str) -> ChangeMessage {
    let op = match (event.op, event.before.is_some()) {
        (Op::Delete, _) => ChangeOp::Delete,
        (Op::Put, true) => ChangeOp::Update,
        (Op::Put, false) => ChangeOp::Create,
    };
    message(event, event.before.as_ref(), op, logical_shard, physical_shard, false)
}

/// The message a snapshot emits for a live entity at its stored version.
pub fn snapshot_message(event: &ChangeEvent, logical_shard: u16, physical_shard: &str) -> ChangeMessage {
    message(event, None, ChangeOp::Read, logical_shard, physical_shard, true)
}

fn message(
    event: &ChangeEvent,
    before: Option<&crate::value::Bag>,
    op: ChangeOp,
    logical_shard: u16,
    physical_shard: &str,
    snapshot: bool,
) -> ChangeMessage {
    let id = event.id.to_hex();
    let envelope = Envelope {
        before: before.map(BagJson),
        after: event.after.as_ref().map(BagJson),
        op,
        ts_ms: event.committed_at_us.div_euclid(1000),
        source: Source {
            connector: "bagstore",
            envelope: ENVELOPE_VERSION,
            id: id.clone(),
            version: event.version,
            logical_shard,
            physical_shard,
            committed_at_us: event.committed_at_us,
            snapshot,
        },
    };
    let value = serde_json::to_vec(&envelope).expect("an envelope always serializes");
    ChangeMessage { key: id, value, version: event.version.to_string(), op }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::value::bag_from_json;
    use crate::EntityId;
    use serde_json::json;

    fn event(op: Op, before: Option<serde_json::Value>, after: Option<serde_json::Value>) -> ChangeEvent {
        ChangeEvent {
            id: EntityId([0xab; 16]),
            version: 7,
            op,
            committed_at_us: 1_235_697_046_000_123,
            shard: 1,
            before: before.map(|b| bag_from_json(&b).unwrap()),
            after: after.map(|a| bag_from_json(&a).unwrap()),
            added_id: Some(3),
        }
    }

    fn value(m: &ChangeMessage) -> serde_json::Value {
        serde_json::from_slice(&m.value).unwrap()
    }

    #[test]
    fn an_update_carries_both_bags_and_the_source_to_dedupe_and_order_by() {
        let m = change_message(&event(Op::Put, Some(json!({"a": 1})), Some(json!({"a": 2}))), 17, "s1");
        assert_eq!(m.key, "abababababababababababababababab");
        assert_eq!((m.version.as_str(), m.op), ("7", ChangeOp::Update));
        assert_eq!(
            value(&m),
            json!({"before": {"a": 1}, "after": {"a": 2}, "op": "u", "ts_ms": 1_235_697_046_000i64,
                   "source": {"connector": "bagstore", "envelope": 1, "id": "abababababababababababababababab",
                              "version": 7, "logical_shard": 17, "physical_shard": "s1",
                              "committed_at_us": 1_235_697_046_000_123i64, "snapshot": false}})
        );
    }

    #[test]
    fn a_write_over_nothing_is_a_create_a_delete_has_no_after_and_a_snapshot_reads() {
        let created = change_message(&event(Op::Put, None, Some(json!({"a": 2}))), 0, "s0");
        assert_eq!(
            (value(&created)["op"].clone(), value(&created)["before"].clone()),
            (json!("c"), json!(null))
        );
        let deleted = change_message(&event(Op::Delete, Some(json!({"a": 2})), None), 0, "s0");
        assert_eq!(value(&deleted)["op"], "d");
        assert_eq!(value(&deleted)["after"], json!(null));
        assert_eq!(value(&deleted)["before"], json!({"a": 2}));
        let read = snapshot_message(&event(Op::Put, None, Some(json!({"a": 2}))), 0, "s0");
        assert_eq!(
            (value(&read)["op"].clone(), value(&read)["source"]["snapshot"].clone()),
            (json!("r"), json!(true))
        );
    }
}
